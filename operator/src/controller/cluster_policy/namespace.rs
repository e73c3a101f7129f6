//! Apply stage, the namespace (IO): the operator namespace's Pod Security labels.
//!
//! Operands run privileged pods (host paths, host PID), which the `baseline` and `restricted`
//! levels reject. With `spec.psa.enabled` or on OpenShift the namespace is labelled `privileged`
//! for enforce, audit and warn, as NVIDIA's operator does. A merge patch, only when a label
//! differs; labels are never removed (the namespace is not ours, and other values may have been set
//! on purpose once we stop).
//!
//! A GPUCluster's DCGM, exporter and DRA validator claim GPUs with admin access, which the API
//! server accepts only in a namespace labelled `resource.kubernetes.io/admin-access=true`
//! ([`ensure_admin_access`], as NVIDIA's operator labels it; never removed either).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Map, Value, json};

const LEVEL: &str = "privileged";
const MODES: [&str; 3] = ["enforce", "audit", "warn"];

/// The label changes that make `labels` admit privileged pods (pure).
pub fn psa_changes(labels: &BTreeMap<String, String>) -> Map<String, Value> {
    MODES
        .iter()
        .map(|mode| format!("pod-security.kubernetes.io/{mode}"))
        .filter(|key| labels.get(key).map(String::as_str) != Some(LEVEL))
        .map(|key| (key, Value::String(LEVEL.to_string())))
        .collect()
}

/// Labels `namespace` for privileged pods if it is not already.
pub async fn ensure_privileged(client: &Client, namespace: &str) -> Result<(), kube::Error> {
    ensure_labels(
        client,
        namespace,
        psa_changes,
        "labelled the namespace for privileged pods (Pod Security)",
    )
    .await
}

/// The namespace label the API server requires for ResourceClaims and ResourceClaimTemplates
/// that ask for admin access.
pub const ADMIN_ACCESS_LABEL: &str = "resource.kubernetes.io/admin-access";

/// The label change that lets `labels`' namespace hold admin-access claims (pure).
pub fn admin_access_changes(labels: &BTreeMap<String, String>) -> Map<String, Value> {
    (labels.get(ADMIN_ACCESS_LABEL).map(String::as_str) != Some("true"))
        .then(|| {
            (
                ADMIN_ACCESS_LABEL.to_owned(),
                Value::String("true".to_owned()),
            )
        })
        .into_iter()
        .collect()
}

/// Labels `namespace` for admin-access claims if it is not already.
pub async fn ensure_admin_access(client: &Client, namespace: &str) -> Result<(), kube::Error> {
    ensure_labels(
        client,
        namespace,
        admin_access_changes,
        "labelled the namespace for admin-access GPU claims (DRA)",
    )
    .await
}

/// Merge-patches the labels `changes` asks for onto `namespace`, when there are any.
async fn ensure_labels(
    client: &Client,
    namespace: &str,
    changes: fn(&BTreeMap<String, String>) -> Map<String, Value>,
    done: &str,
) -> Result<(), kube::Error> {
    let api: Api<Namespace> = Api::all(client.clone());
    let live = api.get(namespace).await?;
    let changes = changes(&live.metadata.labels.unwrap_or_default());
    if changes.is_empty() {
        return Ok(());
    }
    let patch = json!({"metadata": {"labels": changes}});
    api.patch(namespace, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    tracing::info!(namespace, "{done}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_access_is_labelled_once_and_a_true_value_is_kept() {
        let none = admin_access_changes(&BTreeMap::new());
        assert_eq!(none.get(ADMIN_ACCESS_LABEL), Some(&json!("true")));
        let other = BTreeMap::from([(ADMIN_ACCESS_LABEL.to_owned(), "false".to_owned())]);
        assert_eq!(admin_access_changes(&other).len(), 1);
        let set = BTreeMap::from([(ADMIN_ACCESS_LABEL.to_owned(), "true".to_owned())]);
        assert!(admin_access_changes(&set).is_empty());
    }

    #[test]
    fn only_missing_or_different_levels_are_patched() {
        let mut labels = BTreeMap::from([
            (
                "pod-security.kubernetes.io/enforce".to_string(),
                "privileged".to_string(),
            ),
            (
                "pod-security.kubernetes.io/warn".to_string(),
                "restricted".to_string(),
            ),
        ]);
        let changes = psa_changes(&labels);
        assert_eq!(
            changes.keys().collect::<Vec<_>>(),
            [
                "pod-security.kubernetes.io/audit",
                "pod-security.kubernetes.io/warn"
            ]
        );
        for (k, v) in changes {
            labels.insert(k, v.as_str().unwrap().to_string());
        }
        assert!(psa_changes(&labels).is_empty());
    }
}
