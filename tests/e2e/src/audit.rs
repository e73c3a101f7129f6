//! Reading the API server's audit log (JSON lines, metadata level, one entry per completed
//! request), to count the requests an identity made between two points of a test.

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

use anyhow::{Context, Result};
use serde::Deserialize;

/// Verbs that change state.
pub const MUTATING_VERBS: [&str; 5] = ["create", "update", "patch", "delete", "deletecollection"];

/// One audit entry, reduced to what tests count by.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditEvent {
    pub verb: String,
    pub user: AuditUser,
    #[serde(default)]
    pub object_ref: Option<ObjectRef>,
    #[serde(rename = "requestURI")]
    pub request_uri: String,
    #[serde(default)]
    pub response_status: Option<ResponseStatus>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct AuditUser {
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
        let mut file = std::fs::File::open(&self.path)
            .with_context(|| format!("opening {}", self.path.display()))?;
        file.seek(SeekFrom::Start(mark.0))?;
        let mut text = String::new();
        file.read_to_string(&mut text)?;
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).with_context(|| format!("parsing audit entry {l}")))
            .collect()
    }

    /// The mutating requests `username` made after `mark`.
    pub fn mutating_since(&self, mark: Mark, username: &str) -> Result<Vec<AuditEvent>> {
        Ok(self
            .since(mark)?
            .into_iter()
            .filter(|e| e.user.username == username && e.is_mutating())
            .collect())
    }
}

/// The audit username of a ServiceAccount.
pub fn service_account_user(namespace: &str, name: &str) -> String {
    format!("system:serviceaccount:{namespace}:{name}")
}
