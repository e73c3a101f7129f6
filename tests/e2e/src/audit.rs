//! Reading the API server's audit log (JSON lines, metadata level, one entry per completed
//! request): the requests an identity made between two points of a test, when each was received
//! and completed, and counts by verb and resource (the tests' "zero writes", the benchmark's
//! traffic).

use std::collections::BTreeMap;
use std::fmt;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use k8s_openapi::jiff::Timestamp;
use serde::Deserialize;

/// Verbs that change state.
pub const MUTATING_VERBS: [&str; 5] = ["create", "update", "patch", "delete", "deletecollection"];

/// One audit entry, reduced to what tests count by.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditEvent {
    pub verb: String,
    /// Empty for a request the API server could not authenticate (a 401 while a restarted API
    /// server's token authenticator is still starting).
    #[serde(default)]
    pub user: AuditUser,
    #[serde(default)]
    pub object_ref: Option<ObjectRef>,
    #[serde(rename = "requestURI")]
    pub request_uri: String,
    #[serde(default)]
    pub response_status: Option<ResponseStatus>,
    pub request_received_timestamp: Timestamp,
    /// When the entry was written: the request completed (a watch: when it ended).
    pub stage_timestamp: Timestamp,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct AuditUser {
    #[serde(default)]
    pub username: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectRef {
    #[serde(default)]
    pub resource: Option<String>,
    #[serde(default)]
    pub subresource: Option<String>,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct ResponseStatus {
    #[serde(default)]
    pub code: Option<u16>,
}

impl AuditEvent {
    pub fn is_mutating(&self) -> bool {
        MUTATING_VERBS.contains(&self.verb.as_str())
    }

    /// `resource[/subresource]`, e.g. `leases` or `nodes/status`.
    pub fn resource(&self) -> String {
        let r = self.object_ref.clone().unwrap_or_default();
        match (r.resource, r.subresource) {
            (Some(res), Some(sub)) => format!("{res}/{sub}"),
            (Some(res), None) => res,
            _ => self.request_uri.clone(),
        }
    }

    pub fn name(&self) -> Option<&str> {
        self.object_ref.as_ref()?.name.as_deref()
    }

    /// A request on a Lease: the identity's leader election, which renews on a timer and so is
    /// not counted in "zero writes when nothing changes" (decision 9).
    pub fn is_lease(&self) -> bool {
        self.resource() == "leases"
    }

    pub fn received(&self) -> SystemTime {
        to_system_time(self.request_received_timestamp)
    }

    pub fn completed(&self) -> SystemTime {
        to_system_time(self.stage_timestamp)
    }
}

/// `verb resource name`, e.g. `patch nodes gpu-3`: how assertion messages list requests.
impl fmt::Display for AuditEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.verb, self.resource())?;
        match self.name() {
            Some(name) => write!(f, " {name}"),
            None => Ok(()),
        }
    }
}

fn to_system_time(t: Timestamp) -> SystemTime {
    u64::try_from(t.as_nanosecond()).map_or(SystemTime::UNIX_EPOCH, |n| {
        SystemTime::UNIX_EPOCH + Duration::from_nanos(n)
    })
}

/// The audit log of the running harness.
pub struct AuditLog {
    path: PathBuf,
}

/// A point in the audit log (its length when taken); entries after it came later.
#[derive(Clone, Copy, Debug)]
pub struct Mark(u64);

impl AuditLog {
    /// The log named by `HARNESS_AUDIT_LOG` (set in `$HARNESS_DIR/env` by `up.sh`).
    pub fn from_env() -> Result<Self> {
        let path = std::env::var_os("HARNESS_AUDIT_LOG")
            .map(PathBuf::from)
            .context(
                "HARNESS_AUDIT_LOG is not set: source $HARNESS_DIR/env after tests/cluster/up.sh",
            )?;
        Ok(AuditLog { path })
    }

    pub fn mark(&self) -> Result<Mark> {
        let len = std::fs::metadata(&self.path)
            .with_context(|| format!("reading {}", self.path.display()))?
            .len();
        Ok(Mark(len))
    }

    /// Every entry written after `mark`.
    pub fn since(&self, mark: Mark) -> Result<Vec<AuditEvent>> {
        self.read(mark, |_| true)
    }

    /// The entries of `username` written after `mark`. Only that identity's lines are parsed,
    /// which matters for a benchmark's log of a million requests.
    pub fn of_user_since(&self, mark: Mark, username: &str) -> Result<Vec<AuditEvent>> {
        let quoted = format!("\"username\":\"{username}\"");
        Ok(self
            .read(mark, |line| line.contains(&quoted))?
            .into_iter()
            .filter(|e| e.user.username == username)
            .collect())
    }

    /// The mutating requests `username` made after `mark`.
    pub fn mutating_since(&self, mark: Mark, username: &str) -> Result<Vec<AuditEvent>> {
        Ok(self
            .of_user_since(mark, username)?
            .into_iter()
            .filter(AuditEvent::is_mutating)
            .collect())
    }

    fn read(&self, mark: Mark, keep: impl Fn(&str) -> bool) -> Result<Vec<AuditEvent>> {
        let mut file = std::fs::File::open(&self.path)
            .with_context(|| format!("opening {}", self.path.display()))?;
        file.seek(SeekFrom::Start(mark.0))?;
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        // A line still being written has no newline yet: the next read gets it whole.
        let complete = text.rfind('\n').map_or("", |end| &text[..end]);
        complete
            .lines()
            .filter(|l| !l.trim().is_empty() && keep(l))
            .map(|l| serde_json::from_str(l).with_context(|| format!("parsing audit entry {l}")))
            .collect()
    }
}

/// Counts by `verb resource` (e.g. `patch nodes`, `watch daemonsets`).
pub fn by_verb_and_resource(events: &[AuditEvent]) -> BTreeMap<String, u64> {
    count_by(events, |e| format!("{} {}", e.verb, e.resource()))
}

/// Counts by verb.
pub fn by_verb(events: &[AuditEvent]) -> BTreeMap<String, u64> {
    count_by(events, |e| e.verb.clone())
}

fn count_by(events: &[AuditEvent], key: impl Fn(&AuditEvent) -> String) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for e in events {
        *out.entry(key(e)).or_insert(0) += 1;
    }
    out
}

/// Mutating requests other than Lease renewals: what "zero writes" counts (decision 9).
pub fn writes_excluding_leases(events: &[AuditEvent]) -> Vec<&AuditEvent> {
    events
        .iter()
        .filter(|e| e.is_mutating() && !e.is_lease())
        .collect()
}

/// [`writes_excluding_leases`] as `verb resource name` lines, for reports and assertion messages.
pub fn described_writes(events: &[AuditEvent]) -> Vec<String> {
    writes_excluding_leases(events)
        .iter()
        .map(ToString::to_string)
        .collect()
}

/// The audit username of a ServiceAccount.
pub fn service_account_user(namespace: &str, name: &str) -> String {
    format!("system:serviceaccount:{namespace}:{name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATCH: &str = r#"{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"x","stage":"ResponseComplete","requestURI":"/api/v1/nodes/n1","verb":"patch","user":{"username":"system:serviceaccount:ns:gpu-operator"},"objectRef":{"resource":"nodes","name":"n1","apiVersion":"v1"},"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-11-22T02:49:17.123456Z","stageTimestamp":"2026-11-22T02:49:17.125456Z"}"#;
    const LEASE: &str = r#"{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"y","stage":"ResponseComplete","requestURI":"/apis/coordination.k8s.io/v1/namespaces/ns/leases/gpu-operator","verb":"update","user":{"username":"system:serviceaccount:ns:gpu-operator"},"objectRef":{"resource":"leases","namespace":"ns","name":"gpu-operator","apiGroup":"coordination.k8s.io","apiVersion":"v1"},"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-11-22T02:49:18Z","stageTimestamp":"2026-11-22T02:49:18.001Z"}"#;
    const OTHER: &str = r#"{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"z","stage":"ResponseComplete","requestURI":"/api/v1/nodes","verb":"list","user":{"username":"admin"},"objectRef":{"resource":"nodes","apiVersion":"v1"},"requestReceivedTimestamp":"2026-11-22T02:49:19Z","stageTimestamp":"2026-11-22T02:49:19Z"}"#;

    /// A lease read refused while the API server was starting again: no username.
    const UNAUTHENTICATED: &str = r#"{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"a9a65f45-761e-4a20-a998-3d5dbd3d3f48","stage":"ResponseStarted","requestURI":"/apis/coordination.k8s.io/v1/namespaces/gpu-operator-4ff841/leases/gpu-operator-leader","verb":"get","user":{},"sourceIPs":["127.0.0.1"],"objectRef":{"resource":"leases","namespace":"gpu-operator-4ff841","name":"gpu-operator-leader","apiGroup":"coordination.k8s.io","apiVersion":"v1"},"responseStatus":{"metadata":{},"status":"Failure","message":"Unauthorized","reason":"Unauthorized","code":401},"requestReceivedTimestamp":"2026-11-28T18:32:26.260434Z","stageTimestamp":"2026-11-28T18:32:26.292552Z"}"#;

    fn log_with(text: &str) -> (AuditLog, PathBuf) {
        let path = std::env::temp_dir().join(format!(
            "audit-test-{}-{}.log",
            std::process::id(),
            text.len()
        ));
        std::fs::write(&path, text).unwrap();
        (AuditLog { path: path.clone() }, path)
    }

    #[test]
    fn an_entry_parses_with_its_resource_name_and_timestamps() {
        let e: AuditEvent = serde_json::from_str(PATCH).unwrap();
        assert!(e.is_mutating() && !e.is_lease());
        assert_eq!(e.to_string(), "patch nodes n1");
        let took = e.completed().duration_since(e.received()).unwrap();
        assert_eq!(took, Duration::from_millis(2));
    }

    #[test]
    fn one_identitys_entries_skip_others_and_a_line_still_being_written() {
        let operator = "system:serviceaccount:ns:gpu-operator";
        let partial = &PATCH[..PATCH.len() / 2];
        let (log, path) = log_with(&format!("{PATCH}\n{OTHER}\n{LEASE}\n{partial}"));
        let events = log.of_user_since(Mark(0), operator).unwrap();
        assert_eq!(events.len(), 2, "the half-written line is left for later");
        assert_eq!(by_verb(&events)["patch"], 1);
        assert_eq!(by_verb_and_resource(&events)["update leases"], 1);
        assert_eq!(described_writes(&events), ["patch nodes n1"]);
        assert_eq!(log.since(Mark(0)).unwrap().len(), 3);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn an_unauthenticated_request_is_read_as_nobodys() {
        let (log, path) = log_with(&format!("{UNAUTHENTICATED}\n{PATCH}\n"));
        let events = log.since(Mark(0)).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].user.username, "");
        assert_eq!(
            log.of_user_since(Mark(0), "system:serviceaccount:ns:gpu-operator")
                .unwrap()
                .len(),
            1
        );
        std::fs::remove_file(path).unwrap();
    }
}
