//! Apply stage, the namespace (IO): the operator namespace's Pod Security labels.
//!
//! Operands run privileged pods (host paths, host PID), which the `baseline` and `restricted`
//! levels reject. With `spec.psa.enabled` or on OpenShift the namespace is labelled `privileged`
//! for enforce, audit and warn, as NVIDIA's operator does. A merge patch, only when a label
//! differs; labels are never removed (the namespace is not ours, and other values may have been set
//! on purpose once we stop).

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
    let api: Api<Namespace> = Api::all(client.clone());
    let live = api.get(namespace).await?;
    let changes = psa_changes(&live.metadata.labels.unwrap_or_default());
    if changes.is_empty() {
        return Ok(());
    }
    let patch = json!({"metadata": {"labels": changes}});
    api.patch(namespace, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    tracing::info!(
        namespace,
        "labelled the namespace for privileged pods (Pod Security)"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
