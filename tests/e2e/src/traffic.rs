//! API traffic of one identity from the audit log, with the API server's timestamps: requests
//! by verb and resource in a window, and when each happened (for the benchmark and the
//! steady-state test). `audit` counts; this module also times.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use k8s_openapi::jiff::Timestamp;
use serde::Deserialize;

use crate::audit::{AuditLog, MUTATING_VERBS};

/// An audit entry with its timestamps.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TimedEvent {
    pub verb: String,
    pub user: crate::audit::AuditUser,
    #[serde(default)]
    pub object_ref: Option<crate::audit::ObjectRef>,
    #[serde(rename = "requestURI")]
    pub request_uri: String,
    #[serde(default)]
    pub response_status: Option<crate::audit::ResponseStatus>,
    pub request_received_timestamp: Timestamp,
    pub stage_timestamp: Timestamp,
}

impl TimedEvent {
    pub fn is_mutating(&self) -> bool {
        MUTATING_VERBS.contains(&self.verb.as_str())
    }

    /// `resource[/subresource]`, e.g. `nodes` or `clusterpolicies/status`.
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

    /// A watch is logged when it ends; everything else when it completes.
    pub fn received(&self) -> SystemTime {
        to_system_time(self.request_received_timestamp)
    }

    pub fn completed(&self) -> SystemTime {
        to_system_time(self.stage_timestamp)
    }

    /// A write of the identity's own leader-election Lease (excluded from "zero writes").
    pub fn is_lease(&self) -> bool {
        self.resource() == "leases"
    }
}

fn to_system_time(t: Timestamp) -> SystemTime {
    let nanos = t.as_nanosecond();
    if nanos >= 0 {
        SystemTime::UNIX_EPOCH + Duration::from_nanos(nanos as u64)
    } else {
        SystemTime::UNIX_EPOCH
    }
}

/// The audit log read with timestamps, from a byte offset on.
pub struct TimedLog {
    path: PathBuf,
}

/// A byte offset in the audit log.
#[derive(Clone, Copy, Debug)]
pub struct Offset(pub u64);

impl TimedLog {
    pub fn from_env() -> Result<Self> {
        // Same variable as `AuditLog`; constructing one checks it is set.
        AuditLog::from_env()?;
        let path = std::env::var_os("HARNESS_AUDIT_LOG")
            .map(PathBuf::from)
            .context("HARNESS_AUDIT_LOG is not set")?;
        Ok(TimedLog { path })
    }

    pub fn offset(&self) -> Result<Offset> {
        Ok(Offset(
            std::fs::metadata(&self.path)
                .with_context(|| format!("reading {}", self.path.display()))?
                .len(),
        ))
    }

    /// The entries of `username` written after `from`.
    pub fn since(&self, from: Offset, username: &str) -> Result<Vec<TimedEvent>> {
        let mut file = std::fs::File::open(&self.path)
            .with_context(|| format!("opening {}", self.path.display()))?;
        file.seek(SeekFrom::Start(from.0))?;
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        // A line still being written has no newline yet: leave it for the next read.
        let complete = text.rfind('\n').map_or("", |i| &text[..i]);
        let quoted = format!("\"username\":\"{username}\"");
        complete
            .lines()
            .filter(|l| l.contains(&quoted))
            .map(|l| serde_json::from_str(l).with_context(|| format!("parsing audit entry {l}")))
            .collect()
    }
}

/// Counts by `verb resource` (e.g. `patch nodes`, `watch daemonsets`).
pub fn by_verb_and_resource(events: &[TimedEvent]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for e in events {
        *out.entry(format!("{} {}", e.verb, e.resource()))
            .or_insert(0) += 1;
    }
    out
}

/// Counts by verb.
pub fn by_verb(events: &[TimedEvent]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for e in events {
        *out.entry(e.verb.clone()).or_insert(0) += 1;
    }
    out
}

/// Mutating requests other than Lease renewals: what "zero writes" counts (decision 9).
pub fn writes_excluding_leases(events: &[TimedEvent]) -> Vec<&TimedEvent> {
    events
        .iter()
        .filter(|e| e.is_mutating() && !e.is_lease())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_an_audit_line_with_timestamps() {
        let line = r#"{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"x","stage":"ResponseComplete","requestURI":"/api/v1/nodes/n1","verb":"patch","user":{"username":"system:serviceaccount:ns:gpu-operator"},"objectRef":{"resource":"nodes","name":"n1","apiVersion":"v1"},"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-11-22T02:49:17.123456Z","stageTimestamp":"2026-11-22T02:49:17.125456Z"}"#;
        let e: TimedEvent = serde_json::from_str(line).unwrap();
        assert!(e.is_mutating() && !e.is_lease());
        assert_eq!(e.resource(), "nodes");
        assert_eq!(e.name(), Some("n1"));
        let took = e.completed().duration_since(e.received()).unwrap();
        assert_eq!(took, Duration::from_millis(2));
        assert_eq!(
            by_verb_and_resource(std::slice::from_ref(&e))["patch nodes"],
            1
        );
        assert_eq!(writes_excluding_leases(std::slice::from_ref(&e)).len(), 1);
    }
}
