//! Render stage, OpenShift pieces (pure, no IO): SecurityContextConstraints for the operands
//! that need host namespaces, and the `use` grants on SCCs that operand Roles carry. Nothing
//! here renders unless the facts say the cluster is OpenShift (docs/operand-facts.md §16).

use std::collections::BTreeMap;

use k8s_openapi::api::rbac::v1::PolicyRule;
use kube_core::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::json;

use super::common::{meta, rule, rule_named};
use crate::facts::ClusterFacts;
use crate::model::Operand;

/// API group of SecurityContextConstraints.
pub const SCC_GROUP: &str = "security.openshift.io";
/// Resource name of SecurityContextConstraints (for RBAC rules).
pub const SCC_RESOURCE: &str = "securitycontextconstraints";
/// The built-in SCC every operand Role may `use`.
pub const PRIVILEGED_SCC: &str = "privileged";
/// DaemonSet annotation naming the SCC its pods are meant to run under.
pub const SCC_ANNOTATION: &str = "openshift.io/scc";

/// Host namespaces and ports an SCC admits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostAccess {
    pub pid: bool,
    pub ipc: bool,
    pub network: bool,
    pub ports: bool,
}

/// `use` on the built-in `privileged` SCC, on OpenShift.
pub fn use_privileged_scc(facts: &ClusterFacts) -> Option<PolicyRule> {
    facts
        .openshift
        .then(|| rule_named(&[SCC_GROUP], &[SCC_RESOURCE], &[PRIVILEGED_SCC], &["use"]))
}

/// `use` on any SCC (the node-status exporter's Role), on OpenShift.
pub fn use_any_scc(facts: &ClusterFacts) -> Option<PolicyRule> {
    facts
        .openshift
        .then(|| rule(&[SCC_GROUP], &[SCC_RESOURCE], &["use"]))
}

/// The `openshift.io/scc` DaemonSet annotation, on OpenShift.
pub fn scc_annotation(facts: &ClusterFacts, scc: &str) -> BTreeMap<String, String> {
    if facts.openshift {
        BTreeMap::from([(SCC_ANNOTATION.to_owned(), scc.to_owned())])
    } else {
        BTreeMap::new()
    }
}

/// The API resource of SecurityContextConstraints.
pub fn scc_api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(SCC_GROUP, "v1", "SecurityContextConstraints"),
        SCC_RESOURCE,
    )
}

/// An SCC named after the operand's ServiceAccount (`name`), admitting that ServiceAccount's
/// privileged pods with the given host access; `None` off OpenShift.
pub fn scc(
    operand: Operand,
    name: &str,
    host: HostAccess,
    facts: &ClusterFacts,
) -> Option<DynamicObject> {
    scc_for(operand, name, &[name], host, facts)
}

/// An SCC `name` admitting the privileged pods of `service_accounts` (in the operator
/// namespace) with the given host access; `None` off OpenShift.
pub fn scc_for(
    operand: Operand,
    name: &str,
    service_accounts: &[&str],
    host: HostAccess,
    facts: &ClusterFacts,
) -> Option<DynamicObject> {
    if !facts.openshift {
        return None;
    }
    let run_as_any = json!({"type": "RunAsAny"});
    let mut object = DynamicObject::new(name, &scc_api_resource());
    object.metadata = meta(operand, name, facts, false);
    object.data = json!({
        "allowPrivilegedContainer": true,
        "allowPrivilegeEscalation": true,
        "allowHostDirVolumePlugin": true,
        "allowHostPID": host.pid,
        "allowHostIPC": host.ipc,
        "allowHostNetwork": host.network,
        "allowHostPorts": host.ports,
        "allowedCapabilities": ["*"],
        // The SCC schema requires these three keys to be present, null meaning "none" and
        // "priority 0": without them OpenShift's API server rejects the object.
        "defaultAddCapabilities": null,
        "requiredDropCapabilities": null,
        "priority": null,
        "allowedUnsafeSysctls": ["*"],
        "readOnlyRootFilesystem": false,
        "runAsUser": run_as_any,
        "seLinuxContext": run_as_any,
        "fsGroup": run_as_any,
        "supplementalGroups": run_as_any,
        "seccompProfiles": ["*"],
        "volumes": ["*"],
        "groups": ["system:cluster-admins", "system:nodes", "system:masters"],
        "users": service_accounts
            .iter()
            .map(|sa| format!("system:serviceaccount:{}:{sa}", facts.namespace))
            .collect::<Vec<_>>(),
    });
    Some(object)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// The `required` list of SecurityContextConstraints in OpenShift's API (security/v1); the
    /// harness CRD in tests/cluster/manifests/openshift/ carries the same list, and the
    /// OpenShift e2e test has its API server judge the rendered objects.
    const REQUIRED: [&str; 12] = [
        "allowHostDirVolumePlugin",
        "allowHostIPC",
        "allowHostNetwork",
        "allowHostPID",
        "allowHostPorts",
        "allowPrivilegedContainer",
        "allowedCapabilities",
        "defaultAddCapabilities",
        "priority",
        "readOnlyRootFilesystem",
        "requiredDropCapabilities",
        "volumes",
    ];

    fn openshift() -> ClusterFacts {
        ClusterFacts {
            namespace: "nvidia-gpu-operator".to_owned(),
            openshift: true,
            ..ClusterFacts::default()
        }
    }

    #[test]
    fn an_scc_carries_every_field_openshifts_schema_requires() {
        let host = HostAccess {
            pid: true,
            ..HostAccess::default()
        };
        let scc = scc(Operand::Driver, "nvidia-driver", host, &openshift()).unwrap();
        let data = scc.data.as_object().unwrap();
        for key in REQUIRED {
            assert!(data.contains_key(key), "{key} is missing");
        }
        assert_eq!(data["allowHostPID"], true);
        assert_eq!(data["allowHostIPC"], false);
        assert_eq!(
            data["users"],
            json!(["system:serviceaccount:nvidia-gpu-operator:nvidia-driver"])
        );
    }

    #[test]
    fn nothing_openshift_renders_off_openshift() {
        let facts = ClusterFacts::default();
        assert!(
            scc(
                Operand::Driver,
                "nvidia-driver",
                HostAccess::default(),
                &facts
            )
            .is_none()
        );
        assert!(use_privileged_scc(&facts).is_none());
        assert!(use_any_scc(&facts).is_none());
        assert!(scc_annotation(&facts, "nvidia-driver").is_empty());
    }
}
