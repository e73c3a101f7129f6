//! Render stage (pure, no IO) of a GPUCluster: NVIDIA's DRA driver (kubelet-plugin DaemonSet
//! with a `gpus` and a `compute-domains` container, the compute-domain controller Deployment,
//! their RBAC, the DeviceClasses and the ResourceSlice ValidatingAdmissionPolicy) and our
//! attribute DeviceClasses. Names, RBAC, env and mounts are NVIDIA's published facts.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    DaemonSet, DaemonSetSpec, DaemonSetUpdateStrategy, Deployment, DeploymentSpec,
    RollingUpdateDaemonSet,
};
use k8s_openapi::api::core::v1::{
    Affinity, Container, EnvVar, GRPCAction, LocalObjectReference, NodeAffinity, NodeSelector,
    NodeSelectorRequirement, NodeSelectorTerm, PodSpec, PodTemplateSpec, Probe,
    ResourceRequirements, SecurityContext, Toleration, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube_core::DynamicObject;
use kube_core::TypeMeta;
use serde_json::{Value, json};

use super::common::{
    self, APP_LABEL, COMPONENT_LABEL, DEFAULT_DRIVER_INSTALL_DIR, DEFAULT_KUBELET_ROOT_DIR,
    DEFAULT_PRIORITY_CLASS, HostPathType, VALIDATIONS_DIR, env, env_field, gpu_toleration,
    host_path_volume, mount, rule, rule_named,
};
use crate::api::{
    AttributeDeviceClass, DraDeviceType, DraKubeletPluginSpec, GpuClusterSpec, ImageKind,
    ResourceRequirements as ApiResources,
};
use crate::facts::ClusterFacts;
use crate::model::{Operand, OperandObjects, ValidatedPolicy};

/// NVIDIA's DRA driver: rendered for a GPUCluster ([`render`]), never from a ClusterPolicy.
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "dra-driver",
    ..NOT_FROM_A_POLICY
};

/// A GPUCluster's attribute DeviceClasses, frozen alone when one is invalid
/// ([`check_classes`]).
pub const CLASSES_DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "dra-device-classes",
    ..NOT_FROM_A_POLICY
};

/// A GPUCluster's operand: nothing from a ClusterPolicy.
pub(crate) const NOT_FROM_A_POLICY: super::Descriptor = super::Descriptor {
    name: "",
    component: None,
    deploy_label: None,
    consumes_sharing_config: false,
    enabled: super::Enabled::When(super::defaults::not_from_a_policy),
    images: super::defaults::no_images,
    host_paths: super::defaults::no_host_paths,
    render: super::defaults::renders_nothing,
    check: super::defaults::no_check,
    report: super::defaults::no_report,
};
use crate::nodes::NFD_GPU_LABELS;

/// The DRA driver's name: the `driver` of its ResourceSlices and the attribute domain.
pub const DRIVER_NAME: &str = "gpu.nvidia.com";
/// The compute-domain driver's name.
pub const COMPUTE_DOMAIN_DRIVER: &str = "compute-domain.nvidia.com";
/// The compute-domain CRDs the operator installs with compute domains (sorted; RBAC names them).
pub const COMPUTE_DOMAIN_CRDS: [&str; 2] = [
    "computedomaincliques.resource.nvidia.com",
    "computedomains.resource.nvidia.com",
];
/// Kubelet-plugin DaemonSet name and `app` label (NVIDIA's).
pub const KUBELET_PLUGIN: &str = "nvidia-dra-driver-kubelet-plugin";
/// Its ServiceAccount.
pub const KUBELET_PLUGIN_SA: &str = "nvidia-dra-driver-kubeletplugin";
/// Compute-domain controller Deployment, its `app` label and ServiceAccount.
pub const CONTROLLER: &str = "nvidia-dra-driver-controller";
/// ServiceAccount of the compute-domain daemons the controller starts.
pub const CD_DAEMON_SA: &str = "compute-domain-daemon-service-account";
/// The SCC admitting the kubelet plugin's and the compute-domain daemons' pods on OpenShift.
pub const SCC: &str = "nvidia-dra-driver";
/// `app.kubernetes.io/name` of every DRA driver object.
const APP_NAME: &str = "nvidia-dra-driver";
/// Node label (NVIDIA's key) whose value `true` selects the kubelet plugin's nodes.
pub const DEPLOY_LABEL: &str = "nvidia.com/gpu.deploy.dra-driver";
/// Every node label a GPUCluster writes: [`DEPLOY_LABEL`] and the deploy keys of its DCGM,
/// exporter and validator (each `true` where no value is set).
pub fn deploy_keys() -> impl Iterator<Item = &'static str> {
    std::iter::once(DEPLOY_LABEL).chain(
        Operand::GPU_CLUSTER
            .into_iter()
            .filter_map(Operand::deploy_label),
    )
}
/// The ValidatingAdmissionPolicy (and binding) that keeps each plugin to its own node's slices.
pub const SLICES_POLICY: &str = "resourceslices-policy-nvidia-dra-driver";
/// The admission policy keeping the kubelet plugin's node writes to its own node.
pub const PLUGIN_CONFINEMENT_POLICY: &str = "nvidia-dra-driver-kubeletplugin-own-node";
/// The admission policy keeping the compute-domain daemons' pod writes to their own node.
pub const CD_DAEMON_CONFINEMENT_POLICY: &str = "compute-domain-daemon-own-node";
/// Image used when the GPUCluster names none and DRA_DRIVER_IMAGE is unset (NVIDIA's chart
/// default of the release we follow).
pub const PINNED_IMAGE: &str = "nvcr.io/nvidia/dra-driver-nvidia-gpu:v0.5.0";
/// Operator environment variable naming the DRA driver image.
pub const IMAGE_ENV: &str = "DRA_DRIVER_IMAGE";
/// The driver's own DeviceClasses: name, driver, device type.
pub const DRIVER_CLASSES: [(&str, &str, &str); 3] = [
    ("gpu.nvidia.com", DRIVER_NAME, "gpu"),
    ("mig.nvidia.com", DRIVER_NAME, "mig"),
    ("vfio.gpu.nvidia.com", DRIVER_NAME, "vfio"),
];
/// Device attributes the driver publishes for GPUs and MIG devices (gpu.nvidia.com domain).
pub const PUBLISHED_ATTRIBUTES: [&str; 12] = [
    "type",
    "uuid",
    "productName",
    "brand",
    "architecture",
    "cudaComputeCapability",
    "driverVersion",
    "cudaDriverVersion",
    "addressingMode",
    "parentUUID",
    "profile",
    "pciBusID",
];
/// Device capacities the driver publishes (MIG devices add `memorySlice<N>`).
pub const PUBLISHED_CAPACITIES: [&str; 7] = [
    "memory",
    "multiprocessors",
    "copyEngines",
    "decoders",
    "encoders",
    "jpegEngines",
    "ofaEngines",
];

/// A GPUCluster after validation: what render needs.
#[derive(Clone, Debug, Default)]
pub struct ValidatedGpuCluster {
    pub name: String,
    pub spec: GpuClusterSpec,
    /// The DRA driver image reference.
    pub image: String,
    /// The validator image of the driver-validation init container and the DRA validator.
    pub validator_image: String,
    /// The DCGM and DCGM exporter image references (absent when not deployed or invalid).
    pub images: BTreeMap<ImageKind, String>,
    /// Operands whose input is invalid (frozen), with the message naming field and fix.
    pub invalid: BTreeMap<Operand, String>,
}

/// The DRA driver image: the GPUCluster's fields, else [`IMAGE_ENV`], else [`PINNED_IMAGE`].
pub fn image(spec: &GpuClusterSpec, env: &BTreeMap<String, String>) -> Result<String, String> {
    let d = spec.dra_driver.clone().unwrap_or_default();
    let set = |v: &Option<String>| v.clone().filter(|s| !s.is_empty());
    match (set(&d.repository), set(&d.image), set(&d.version)) {
        (Some(r), Some(i), Some(v)) if v.starts_with("sha256:") => {
            Ok(format!("{}/{i}@{v}", r.trim_end_matches('/')))
        }
        (Some(r), Some(i), Some(v)) => Ok(format!("{}/{i}:{v}", r.trim_end_matches('/'))),
        (None, None, None) => Ok(env
            .get(IMAGE_ENV)
            .filter(|v| !v.is_empty())
            .cloned()
            .unwrap_or_else(|| PINNED_IMAGE.to_owned())),
        _ => Err(
            "spec.draDriver: repository, image and version must be set together (or none of them)"
                .to_owned(),
        ),
    }
}

/// The objects of `operand` for `cluster`; `None` for an operand that is not a GPUCluster's.
pub fn render(
    operand: Operand,
    cluster: &ValidatedGpuCluster,
    facts: &ClusterFacts,
) -> Option<OperandObjects> {
    match operand {
        Operand::DraDriver => Some(render_driver(cluster, facts)),
        Operand::DraDeviceClasses => Some(render_attribute_classes(cluster, facts)),
        Operand::DcgmDra => super::dcgm::render_dra(&policy_view(cluster), facts),
        Operand::DcgmExporterDra => super::dcgm_exporter::render_dra(&policy_view(cluster), facts),
        Operand::DraValidator => Some(super::validator::render_dra(cluster, facts)),
        _ => None,
    }
}

/// Whether a GPUCluster deploys the standalone DCGM engine: only with `dcgm.enabled: true`
/// (NVIDIA's GPUCluster default is off, unlike a ClusterPolicy's).
pub fn dcgm_enabled(spec: &GpuClusterSpec) -> bool {
    spec.dcgm.as_ref().and_then(|d| d.enabled) == Some(true)
}

/// Whether a GPUCluster deploys the DCGM exporter: when `dcgmExporter` is present and not
/// `enabled: false` (NVIDIA's rule; NVIDIA's chart always writes the section).
pub fn dcgm_exporter_enabled(spec: &GpuClusterSpec) -> bool {
    spec.dcgm_exporter
        .as_ref()
        .is_some_and(|d| d.enabled != Some(false))
}

/// The ClusterPolicy-shaped view of a GPUCluster that the DCGM and exporter renderers take: its
/// `dcgm`, `dcgmExporter`, `daemonsets` and kubelet root, each switched on by the GPUCluster's
/// own defaults ([`dcgm_enabled`], [`dcgm_exporter_enabled`]), with the images validate
/// resolved.
pub fn policy_view(cluster: &ValidatedGpuCluster) -> ValidatedPolicy {
    let spec = &cluster.spec;
    let dcgm = crate::api::DcgmSpec {
        enabled: Some(dcgm_enabled(spec)),
        ..spec.dcgm.clone().unwrap_or_default()
    };
    let exporter = crate::api::DcgmExporterSpec {
        enabled: Some(dcgm_exporter_enabled(spec)),
        ..spec.dcgm_exporter.clone().unwrap_or_default()
    };
    let host_paths = crate::api::HostPathsSpec {
        kubelet_root_dir: spec
            .host_paths
            .as_ref()
            .and_then(|h| h.kubelet_root_dir.clone()),
        ..Default::default()
    };
    ValidatedPolicy {
        name: cluster.name.clone(),
        spec: crate::api::ClusterPolicySpec {
            dcgm: Some(dcgm),
            dcgm_exporter: Some(exporter),
            daemonsets: spec.daemonsets.clone(),
            host_paths: Some(host_paths),
            ..Default::default()
        },
        images: cluster.images.clone(),
        ..Default::default()
    }
}

/// The name of the pod-level claim on a GPUCluster operand's GPUs (NVIDIA's).
pub const ADMIN_CLAIM: &str = "admin-gpus";

/// A ResourceClaimTemplate `name` asking the driver's `gpu.nvidia.com` class for GPUs with admin
/// access (never reserved, never counted against allocatable, blind to who else uses them):
/// every GPU of the node (`count: None`) or `count` of them. The operator namespace must carry
/// `resource.kubernetes.io/admin-access=true` for the API server to accept it.
pub fn admin_claim_template(
    operand: Operand,
    name: &str,
    request: &str,
    count: Option<i64>,
    facts: &ClusterFacts,
) -> DynamicObject {
    let exactly = match count {
        None => {
            json!({"deviceClassName": DRIVER_CLASSES[0].0, "allocationMode": "All", "adminAccess": true})
        }
        Some(n) => {
            json!({"deviceClassName": DRIVER_CLASSES[0].0, "allocationMode": "ExactCount", "count": n, "adminAccess": true})
        }
    };
    dynamic(
        "resource.k8s.io/v1",
        "ResourceClaimTemplate",
        common::meta(operand, name, facts, true),
        json!({"spec": {"spec": {"devices": {"requests": [{"name": request, "exactly": exactly}]}}}}),
    )
}

/// Gives `pod` the claim `claim` from `template` and every one of its containers (init
/// containers included) access to it: NVIDIA's GPUCluster operands reach GPUs this way, not
/// through the NVIDIA runtime.
pub fn claim_gpus(pod: &mut PodSpec, claim: &str, template: &str) {
    pod.resource_claims = Some(vec![k8s_openapi::api::core::v1::PodResourceClaim {
        name: claim.to_owned(),
        resource_claim_template_name: Some(template.to_owned()),
        ..Default::default()
    }]);
    for c in pod
        .init_containers
        .iter_mut()
        .flatten()
        .chain(pod.containers.iter_mut())
    {
        c.resources
            .get_or_insert_default()
            .claims
            .get_or_insert_default()
            .push(k8s_openapi::api::core::v1::ResourceClaim {
                name: claim.to_owned(),
                ..Default::default()
            });
    }
}

/// [`claim_gpus`] with the admin claim on every GPU of the node ([`ADMIN_CLAIM`]).
pub fn claim_every_gpu(pod: &mut PodSpec, template: &str) {
    claim_gpus(pod, ADMIN_CLAIM, template);
}

fn labels(component: &str) -> BTreeMap<String, String> {
    common::string_map(&[
        ("app.kubernetes.io/name", APP_NAME),
        (COMPONENT_LABEL, component),
    ])
}

fn meta(name: &str, facts: &ClusterFacts, namespaced: bool, component: &str) -> ObjectMeta {
    let mut m = common::meta(Operand::DraDriver, name, facts, namespaced);
    m.labels.get_or_insert_default().extend(labels(component));
    m
}

fn render_driver(cluster: &ValidatedGpuCluster, facts: &ClusterFacts) -> OperandObjects {
    let op = Operand::DraDriver;
    let dra = cluster.spec.dra_driver.clone().unwrap_or_default();
    let mut objects = OperandObjects::default();
    let ns_rules = |rules: &[(&str, &str, &[&str])]| {
        rules
            .iter()
            .map(|(g, r, v)| rule(&[g], &[r], v))
            .collect::<Vec<_>>()
    };
    // The kubelet plugin's identity.
    objects
        .service_accounts
        .push(k8s_openapi::api::core::v1::ServiceAccount {
            metadata: meta(KUBELET_PLUGIN_SA, facts, true, KUBELET_PLUGIN),
            ..Default::default()
        });
    // Both plugins publish their node's ResourceSlices and read the claims they prepare; the
    // compute-domain plugin labels its node and follows ComputeDomains in every namespace.
    // Pods are not read cluster-wide (NVIDIA's chart grants it): only the MPS manager lists
    // pods, of its own namespace.
    common::add_cluster_role(
        &mut objects,
        op,
        KUBELET_PLUGIN_SA,
        KUBELET_PLUGIN_SA,
        ns_rules(&[
            (
                "resource.nvidia.com",
                "computedomains",
                &["get", "list", "watch"],
            ),
            (
                "resource.k8s.io",
                "resourceclaims",
                &["get", "list", "watch"],
            ),
            (
                "resource.k8s.io",
                "resourceslices",
                &["get", "list", "watch", "create", "update", "delete"],
            ),
            ("", "nodes", &["get", "list", "watch", "update", "patch"]),
        ]),
        facts,
    );
    // The MPS control daemons (feature gate MPSSupport, off by default) are Deployments the
    // gpus plugin gets, creates and deletes in its namespace, then lists their pods.
    if mps_support(cluster) {
        common::add_role(
            &mut objects,
            op,
            "nvidia-dra-driver-kubeletplugin-mps",
            KUBELET_PLUGIN_SA,
            ns_rules(&[
                ("apps", "deployments", &["get", "create", "delete"]),
                ("", "pods", &["list"]),
            ]),
            facts,
        );
    }
    common::add_role(
        &mut objects,
        op,
        "nvidia-dra-driver-kubeletplugin-driver-validation",
        KUBELET_PLUGIN_SA,
        ns_rules(&[("apps", "daemonsets", &["list"])]),
        facts,
    );
    let compute_domains = dra.compute_domains_enabled();
    if compute_domains {
        common::add_role(
            &mut objects,
            op,
            KUBELET_PLUGIN_SA,
            KUBELET_PLUGIN_SA,
            ns_rules(&[("resource.nvidia.com", "computedomaincliques", &["get"])]),
            facts,
        );
        objects
            .service_accounts
            .push(k8s_openapi::api::core::v1::ServiceAccount {
                metadata: meta(CONTROLLER, facts, true, CONTROLLER),
                ..Default::default()
            });
        common::add_cluster_role(
            &mut objects,
            op,
            CONTROLLER,
            CONTROLLER,
            ns_rules(&[
                (
                    "resource.nvidia.com",
                    "computedomains",
                    &["get", "list", "watch", "update"],
                ),
                ("resource.nvidia.com", "computedomains/status", &["update"]),
                (
                    "resource.k8s.io",
                    "resourceclaimtemplates",
                    &["get", "list", "watch", "create", "update", "delete"],
                ),
                ("", "nodes", &["get", "list", "watch", "update"]),
            ]),
            facts,
        );
        // Its leader election (LEADER_ELECTION_LEASE_LOCK_NAMESPACE and _NAME) is in this
        // namespace on one Lease, so Leases need no ClusterRole: create (not limitable by
        // name), then read and renew only that one.
        let leases = [
            rule(&["coordination.k8s.io"], &["leases"], &["create"]),
            rule_named(
                &["coordination.k8s.io"],
                &["leases"],
                &[CONTROLLER],
                &["get", "update"],
            ),
        ];
        common::add_role(
            &mut objects,
            op,
            CONTROLLER,
            CONTROLLER,
            // The compute-domain daemons' DaemonSets, their pods and the cliques are all in
            // the driver's namespace (NVIDIA's chart reads pods cluster-wide).
            ns_rules(&[
                (
                    "apps",
                    "daemonsets",
                    &["get", "list", "watch", "create", "update", "delete"],
                ),
                ("", "pods", &["get", "list", "watch"]),
                (
                    "resource.nvidia.com",
                    "computedomaincliques",
                    &["get", "list", "watch", "update"],
                ),
            ])
            .into_iter()
            .chain(leases)
            .collect(),
            facts,
        );
        objects
            .service_accounts
            .push(k8s_openapi::api::core::v1::ServiceAccount {
                metadata: meta(CD_DAEMON_SA, facts, true, "compute-domain-daemon"),
                ..Default::default()
            });
        // A daemon follows its ComputeDomain (in the workload's namespace) and writes its
        // status; its clique and its own pod are in the driver's namespace, where it runs.
        common::add_cluster_role(
            &mut objects,
            op,
            "compute-domain-daemon",
            CD_DAEMON_SA,
            vec![
                rule(
                    &["resource.nvidia.com"],
                    &["computedomains"],
                    &["get", "list", "watch"],
                ),
                rule(
                    &["resource.nvidia.com"],
                    &["computedomains/status"],
                    &["update"],
                ),
            ],
            facts,
        );
        common::add_role(
            &mut objects,
            op,
            "compute-domain-daemon",
            CD_DAEMON_SA,
            vec![
                rule(
                    &["resource.nvidia.com"],
                    &["computedomaincliques"],
                    &["get", "list", "watch", "create", "update"],
                ),
                rule(&[""], &["pods"], &["get", "list", "watch", "patch"]),
            ],
            facts,
        );
    }
    for (name, driver, type_) in DRIVER_CLASSES {
        objects.dynamic.push(device_class(
            op,
            name,
            vec![format!(
                "device.driver == '{driver}' && device.attributes['{driver}'].type == '{type_}'"
            )],
            facts,
        ));
    }
    if compute_domains {
        objects.dynamic.push(device_class(
            op,
            "compute-domain-daemon.nvidia.com",
            vec![format!(
                "device.driver == '{COMPUTE_DOMAIN_DRIVER}' && device.attributes['{COMPUTE_DOMAIN_DRIVER}'].type == 'daemon'"
            )],
            facts,
        ));
        objects.dynamic.push(device_class(
            op,
            "compute-domain-default-channel.nvidia.com",
            vec![format!(
                "device.driver == '{COMPUTE_DOMAIN_DRIVER}' && device.attributes['{COMPUTE_DOMAIN_DRIVER}'].type == 'channel' && device.attributes['{COMPUTE_DOMAIN_DRIVER}'].id == 0"
            )],
            facts,
        ));
    }
    objects.daemon_sets.push(kubelet_plugin(cluster, facts));
    if compute_domains {
        objects.deployments.push(controller(cluster, facts));
    }
    objects.dynamic.extend(slices_policy(facts));
    // The plugin labels its own node; the compute-domain daemons patch their own pods.
    objects.dynamic.extend(common::confinement_policy(
        op,
        PLUGIN_CONFINEMENT_POLICY,
        &[KUBELET_PLUGIN_SA],
        &[common::own_node_writes()],
        facts,
    ));
    if compute_domains {
        objects.dynamic.extend(common::confinement_policy(
            op,
            CD_DAEMON_CONFINEMENT_POLICY,
            &[CD_DAEMON_SA],
            &[common::Confinement {
                group: "",
                resources: &["pods", "pods/status"],
                operations: &["UPDATE"],
                checks: vec![(
                    "object.spec.?nodeName.orValue('') == variables.callerNode".to_owned(),
                    "'only pods on the node of the caller may be written, not ' + request.name"
                        .to_owned(),
                )],
            }],
            facts,
        ));
    }
    // NVIDIA's SCC for the privileged, host-path pods of the plugin and the daemons.
    objects.dynamic.extend(super::openshift::scc_for(
        op,
        SCC,
        &[KUBELET_PLUGIN_SA, CD_DAEMON_SA],
        super::openshift::HostAccess {
            network: true,
            ports: true,
            ..Default::default()
        },
        facts,
    ));
    objects
}

/// Whether the GPUCluster switches the driver's MPSSupport feature gate on.
fn mps_support(cluster: &ValidatedGpuCluster) -> bool {
    cluster
        .spec
        .dra_driver
        .as_ref()
        .and_then(|d| d.feature_gates.as_ref())
        .and_then(|g| g.get("MPSSupport"))
        .copied()
        .unwrap_or(false)
}

fn dynamic(api_version: &str, kind: &str, metadata: ObjectMeta, body: Value) -> DynamicObject {
    DynamicObject {
        types: Some(TypeMeta {
            api_version: api_version.to_owned(),
            kind: kind.to_owned(),
        }),
        metadata,
        data: body,
    }
}

fn device_class(
    operand: Operand,
    name: &str,
    selectors: Vec<String>,
    facts: &ClusterFacts,
) -> DynamicObject {
    let selectors: Vec<Value> = selectors
        .into_iter()
        .map(|e| json!({"cel": {"expression": e}}))
        .collect();
    let mut metadata = common::meta(operand, name, facts, false);
    metadata
        .labels
        .get_or_insert_default()
        .extend(labels("deviceclass"));
    dynamic(
        "resource.k8s.io/v1",
        "DeviceClass",
        metadata,
        json!({"spec": {"selectors": selectors}}),
    )
}

/// NVIDIA's ResourceSlice policy: the kubelet plugin's identity may only write the slices of
/// the node its pod runs on.
fn slices_policy(facts: &ClusterFacts) -> Vec<DynamicObject> {
    let user = format!(
        "system:serviceaccount:{}:{KUBELET_PLUGIN_SA}",
        facts.namespace
    );
    let target = r#"(request.operation == "DELETE" ? oldObject : object)"#;
    let policy = dynamic(
        "admissionregistration.k8s.io/v1",
        "ValidatingAdmissionPolicy",
        meta(SLICES_POLICY, facts, false, KUBELET_PLUGIN),
        json!({"spec": {
            "failurePolicy": "Fail",
            "matchConditions": [{"name": "isRestrictedUser",
                "expression": format!("request.userInfo.username == \"{user}\"")}],
            "matchConstraints": {"resourceRules": [{
                "apiGroups": ["resource.k8s.io"],
                "apiVersions": ["v1", "v1beta1", "v1beta2"],
                "operations": ["CREATE", "UPDATE", "DELETE"],
                "resources": ["resourceslices"]}]},
            "variables": [
                {"name": "userNodeName", "expression":
                    "request.userInfo.extra[?'authentication.kubernetes.io/node-name'][0].orValue('')"},
                {"name": "objectNodeName", "expression": format!("{target}.spec.?nodeName.orValue(\"\")")},
                {"name": "nodeSelectorValue", "expression": format!("{target}.spec.?nodeSelector.orValue(null)")},
                {"name": "allNodesValue", "expression": format!("{target}.spec.?allNodes.orValue(false)")},
            ],
            "validations": [
                {"expression": "variables.userNodeName != \"\"",
                 "message": "no node association found for user, this user must run in a pod on a node and ServiceAccountTokenPodNodeInfo must be enabled"},
                {"expression": "variables.userNodeName == variables.objectNodeName || variables.allNodesValue == true || variables.nodeSelectorValue != null",
                 "messageExpression": "\"this user running on node '\"+variables.userNodeName+\"' may not modify cluster or node resourceslices\""},
            ],
        }}),
    );
    let binding = dynamic(
        "admissionregistration.k8s.io/v1",
        "ValidatingAdmissionPolicyBinding",
        meta(SLICES_POLICY, facts, false, KUBELET_PLUGIN),
        json!({"spec": {"policyName": SLICES_POLICY, "validationActions": ["Deny"]}}),
    );
    vec![policy, binding]
}

fn feature_gates(cluster: &ValidatedGpuCluster) -> Option<String> {
    let gates = cluster.spec.dra_driver.as_ref()?.feature_gates.as_ref()?;
    (!gates.is_empty()).then(|| {
        gates
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    })
}

fn resources(spec: Option<&ApiResources>) -> Option<ResourceRequirements> {
    spec.map(|r| ResourceRequirements {
        limits: r.limits.clone(),
        requests: r.requests.clone(),
        ..Default::default()
    })
}

fn user_env(envs: &mut Vec<EnvVar>, spec: Option<&Vec<crate::api::EnvVar>>) {
    common::merge_user_env(envs, spec);
}

fn grpc_probe(port: i32, period: i32, failures: i32) -> Probe {
    Probe {
        grpc: Some(GRPCAction {
            port,
            service: Some("liveness".to_owned()),
        }),
        period_seconds: Some(period),
        timeout_seconds: Some(10),
        failure_threshold: Some(failures),
        ..Default::default()
    }
}

/// The health port of a plugin container, `None` when its health service is switched off.
fn health_port(spec: Option<&DraKubeletPluginSpec>, default: i32) -> Option<i32> {
    let hc = spec.and_then(|s| s.healthcheck.as_ref());
    if hc.and_then(|h| h.enabled) == Some(false) {
        return None;
    }
    Some(hc.and_then(|h| h.port).unwrap_or(default))
}

/// The wrapper NVIDIA's plugin containers run: load what driver validation found, then exec.
fn plugin_script(binary: &str) -> String {
    format!(
        "set -a\nsource {VALIDATIONS_DIR}/driver-ready\nset +a\n\
         if [ \"${{MASK_NVIDIA_DRIVER_PARAMS}}\" = \"true\" ]; then\n  \
         cp /proc/driver/nvidia/params /root/gpu-params\n  \
         sed -i 's/^ModifyDeviceFiles: 1$/ModifyDeviceFiles: 0/' /root/gpu-params\n  \
         mount --bind /root/gpu-params /proc/driver/nvidia/params\nfi\n\
         exec {binary} -v \"${{LOG_VERBOSITY}}\""
    )
}

#[allow(clippy::too_many_arguments)]
fn plugin_container(
    name: &str,
    binary: &str,
    http: &str,
    spec: Option<&DraKubeletPluginSpec>,
    default_port: i32,
    extra_env: Vec<EnvVar>,
    cluster: &ValidatedGpuCluster,
    kubelet_dir: &str,
    liveness_period: i32,
) -> Container {
    let mut envs = vec![
        env("HTTP_ENDPOINT", http),
        env("METRICS_PATH", "/metrics"),
        env("LOG_VERBOSITY", "4"),
        env("MASK_NVIDIA_DRIVER_PARAMS", ""),
        env("NVIDIA_VISIBLE_DEVICES", "void"),
        env("CDI_ROOT", "/var/run/cdi"),
        env("NVIDIA_MIG_CONFIG_DEVICES", "all"),
        env_field("NODE_NAME", "spec.nodeName"),
        env_field("NAMESPACE", "metadata.namespace"),
        env(
            "KUBELET_REGISTRAR_DIRECTORY_PATH",
            &format!("{kubelet_dir}/plugins_registry"),
        ),
        env(
            "KUBELET_PLUGINS_DIRECTORY_PATH",
            &format!("{kubelet_dir}/plugins"),
        ),
    ];
    envs.extend(extra_env);
    let port = health_port(spec, default_port);
    if let Some(port) = port {
        envs.push(env("HEALTHCHECK_PORT", &port.to_string()));
    }
    if let Some(gates) = feature_gates(cluster) {
        envs.push(env("FEATURE_GATES", &gates));
    }
    user_env(&mut envs, spec.and_then(|s| s.env.as_ref()));
    let mut c = common::container(name, &cluster.image, &["bash", "-c"], &[]);
    c.args = Some(vec![plugin_script(binary)]);
    c.env = Some(envs);
    c.image_pull_policy = Some(pull_policy(cluster));
    c.security_context = Some(SecurityContext {
        privileged: Some(true),
        ..Default::default()
    });
    c.resources = resources(spec.and_then(|s| s.resources.as_ref()));
    c.liveness_probe = port.map(|p| grpc_probe(p, liveness_period, 3));
    c.startup_probe = port.map(|p| Probe {
        period_seconds: Some(1),
        failure_threshold: Some(600),
        ..grpc_probe(p, 1, 600)
    });
    c.volume_mounts = Some(vec![
        mount(
            "plugins-registry",
            &format!("{kubelet_dir}/plugins_registry"),
        ),
        VolumeMount {
            mount_propagation: Some("Bidirectional".to_owned()),
            ..mount("plugins", &format!("{kubelet_dir}/plugins"))
        },
        mount("cdi", "/var/run/cdi"),
        VolumeMount {
            read_only: Some(true),
            ..mount("validations", VALIDATIONS_DIR)
        },
        VolumeMount {
            read_only: Some(true),
            mount_propagation: Some("HostToContainer".to_owned()),
            ..mount(common::HOST_ROOT_VOLUME, "/host")
        },
        VolumeMount {
            mount_propagation: Some("HostToContainer".to_owned()),
            ..mount(common::DRIVER_INSTALL_DIR_VOLUME, "/driver-root")
        },
    ]);
    c
}

fn pull_policy(cluster: &ValidatedGpuCluster) -> String {
    match cluster
        .spec
        .dra_driver
        .as_ref()
        .and_then(|d| d.image_pull_policy.as_deref())
    {
        Some(p @ ("Always" | "Never" | "IfNotPresent")) => p.to_owned(),
        _ => "IfNotPresent".to_owned(),
    }
}

fn pull_secrets(cluster: &ValidatedGpuCluster) -> Option<Vec<LocalObjectReference>> {
    let secrets = cluster
        .spec
        .dra_driver
        .as_ref()?
        .image_pull_secrets
        .as_ref()?;
    (!secrets.is_empty()).then(|| {
        secrets
            .iter()
            .map(|s| LocalObjectReference { name: s.clone() })
            .collect()
    })
}

fn host_paths(cluster: &ValidatedGpuCluster) -> (String, String) {
    let hp = cluster.spec.host_paths.clone().unwrap_or_default();
    let or = |v: Option<String>, d: &str| v.filter(|s| !s.is_empty()).unwrap_or(d.to_owned());
    (
        or(hp.driver_install_dir, DEFAULT_DRIVER_INSTALL_DIR),
        or(hp.kubelet_root_dir, DEFAULT_KUBELET_ROOT_DIR),
    )
}

fn tolerations(cluster: &ValidatedGpuCluster) -> Vec<Toleration> {
    cluster
        .spec
        .daemonsets
        .as_ref()
        .and_then(|d| d.tolerations.clone())
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| vec![gpu_toleration()])
}

fn priority_class(cluster: &ValidatedGpuCluster) -> String {
    cluster
        .spec
        .daemonsets
        .as_ref()
        .and_then(|d| d.priority_class_name.clone())
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| DEFAULT_PRIORITY_CLASS.to_owned())
}

/// GPU nodes as NVIDIA's chart finds them: any NFD NVIDIA PCI label or `gpu.present`.
fn gpu_node_affinity() -> Affinity {
    let term = |key: &str, value: &str| NodeSelectorTerm {
        match_expressions: Some(vec![NodeSelectorRequirement {
            key: key.to_owned(),
            operator: "In".to_owned(),
            values: Some(vec![value.to_owned()]),
        }]),
        ..Default::default()
    };
    let mut terms: Vec<NodeSelectorTerm> = NFD_GPU_LABELS.iter().map(|k| term(k, "true")).collect();
    terms.push(term("nvidia.com/gpu.present", "true"));
    Affinity {
        node_affinity: Some(NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: terms,
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn kubelet_plugin(cluster: &ValidatedGpuCluster, facts: &ClusterFacts) -> DaemonSet {
    let dra = cluster.spec.dra_driver.clone().unwrap_or_default();
    let (driver_dir, kubelet_dir) = host_paths(cluster);
    let gpus_spec = dra.gpus.as_ref().and_then(|g| g.kubelet_plugin.as_ref());
    let mut containers = vec![plugin_container(
        "gpus",
        "gpu-kubelet-plugin",
        ":8080",
        gpus_spec,
        51516,
        vec![env("HOST_ROOT", "/host"), env("IMAGE_NAME", &cluster.image)],
        cluster,
        &kubelet_dir,
        30,
    )];
    if dra.compute_domains_enabled() {
        let cd_spec = dra
            .compute_domains
            .as_ref()
            .and_then(|c| c.kubelet_plugin.as_ref());
        containers.push(plugin_container(
            "compute-domains",
            "compute-domain-kubelet-plugin",
            ":8081",
            cd_spec,
            51515,
            vec![env("GPU_CLIQUE_LABEL_ENABLED", "true")],
            cluster,
            &kubelet_dir,
            10,
        ));
    }
    let mut init = common::container(
        common::DRIVER_VALIDATION_CONTAINER,
        &cluster.validator_image,
        &["nvidia-validator"],
        &[],
    );
    init.env = Some(vec![
        env("COMPONENT", "driver"),
        env("WITH_WAIT", "true"),
        env("DRIVER_VALIDATION_SKIP_GPU_INIT", "true"),
        env("DISABLE_DEV_CHAR_SYMLINK_CREATION", "true"),
        env_field("OPERATOR_NAMESPACE", "metadata.namespace"),
        env("HOST_ROOT", "/"),
        env("DRIVER_INSTALL_DIR", &driver_dir),
        env("DRIVER_INSTALL_DIR_CTR_PATH", "/driver-root"),
    ]);
    init.image_pull_policy = Some("IfNotPresent".to_owned());
    init.security_context = Some(SecurityContext {
        privileged: Some(true),
        run_as_user: Some(0),
        ..Default::default()
    });
    init.volume_mounts = Some(vec![
        VolumeMount {
            read_only: Some(true),
            mount_propagation: Some("HostToContainer".to_owned()),
            ..mount(common::HOST_ROOT_VOLUME, "/host")
        },
        VolumeMount {
            mount_propagation: Some("HostToContainer".to_owned()),
            ..mount(common::DRIVER_INSTALL_DIR_VOLUME, "/driver-root")
        },
        mount("validations", VALIDATIONS_DIR),
    ]);
    let volumes = vec![
        host_path_volume(
            "plugins-registry",
            &format!("{kubelet_dir}/plugins_registry"),
            HostPathType::Any,
        ),
        host_path_volume(
            "plugins",
            &format!("{kubelet_dir}/plugins"),
            HostPathType::Any,
        ),
        host_path_volume("cdi", "/var/run/cdi", HostPathType::Any),
        host_path_volume(common::HOST_ROOT_VOLUME, "/", HostPathType::Any),
        host_path_volume(
            common::DRIVER_INSTALL_DIR_VOLUME,
            &driver_dir,
            HostPathType::DirectoryOrCreate,
        ),
        host_path_volume(
            "validations",
            VALIDATIONS_DIR,
            HostPathType::DirectoryOrCreate,
        ),
    ];
    let mut pod_labels = labels(KUBELET_PLUGIN);
    pod_labels.insert(APP_LABEL.to_owned(), KUBELET_PLUGIN.to_owned());
    let ds_extra = cluster.spec.daemonsets.clone().unwrap_or_default();
    pod_labels.extend(
        ds_extra
            .labels
            .clone()
            .unwrap_or_default()
            .into_iter()
            .filter(|(k, _)| k != APP_LABEL),
    );
    let mut metadata = meta(KUBELET_PLUGIN, facts, true, KUBELET_PLUGIN);
    metadata
        .labels
        .get_or_insert_default()
        .insert(APP_LABEL.to_owned(), KUBELET_PLUGIN.to_owned());
    DaemonSet {
        metadata,
        spec: Some(DaemonSetSpec {
            selector: LabelSelector {
                match_labels: Some(common::string_map(&[(APP_LABEL, KUBELET_PLUGIN)])),
                ..Default::default()
            },
            update_strategy: Some(DaemonSetUpdateStrategy {
                type_: Some("RollingUpdate".to_owned()),
                rolling_update: Some(RollingUpdateDaemonSet {
                    max_unavailable: Some(IntOrString::String("100%".to_owned())),
                    ..Default::default()
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: ds_extra.annotations.clone(),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    affinity: Some(gpu_node_affinity()),
                    node_selector: Some(common::string_map(&[(DEPLOY_LABEL, "true")])),
                    containers,
                    init_containers: Some(vec![init]),
                    priority_class_name: Some(priority_class(cluster)),
                    service_account_name: Some(KUBELET_PLUGIN_SA.to_owned()),
                    tolerations: Some(tolerations(cluster)),
                    image_pull_secrets: pull_secrets(cluster),
                    volumes: Some(volumes),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        status: None,
    }
}

fn controller(cluster: &ValidatedGpuCluster, facts: &ClusterFacts) -> Deployment {
    let dra = cluster.spec.dra_driver.clone().unwrap_or_default();
    let spec = dra
        .compute_domains
        .as_ref()
        .and_then(|c| c.controller.as_ref());
    let mut envs = vec![
        env("HTTP_ENDPOINT", ":8080"),
        env("METRICS_PATH", "/metrics"),
        env("PPROF_PATH", ""),
        env("LOG_VERBOSITY", "4"),
        env("LOG_VERBOSITY_CD_DAEMON", "4"),
        env_field("POD_NAME", "metadata.name"),
        env_field("NAMESPACE", "metadata.namespace"),
        env("IMAGE_NAME", &cluster.image),
        env("NVIDIA_VISIBLE_DEVICES", "void"),
        env("LEADER_ELECTION_ENABLED", "false"),
        env("LEADER_ELECTION_LEASE_LOCK_NAME", CONTROLLER),
        env("LEADER_ELECTION_LEASE_LOCK_NAMESPACE", &facts.namespace),
        env("LEADER_ELECTION_LEASE_DURATION", "15s"),
        env("LEADER_ELECTION_RENEW_DEADLINE", "10s"),
        env("LEADER_ELECTION_RETRY_PERIOD", "2s"),
    ];
    if let Some(gates) = feature_gates(cluster) {
        envs.push(env("FEATURE_GATES", &gates));
    }
    user_env(&mut envs, spec.and_then(|s| s.env.as_ref()));
    let mut c = common::container(
        "compute-domain",
        &cluster.image,
        &["compute-domain-controller", "-v", "$(LOG_VERBOSITY)"],
        &[],
    );
    c.env = Some(envs);
    c.image_pull_policy = Some(pull_policy(cluster));
    c.resources = resources(spec.and_then(|s| s.resources.as_ref()));
    let toleration = |key: &str, effect: Option<&str>| Toleration {
        key: Some(key.to_owned()),
        operator: Some("Exists".to_owned()),
        effect: effect.map(str::to_owned),
        ..Default::default()
    };
    let mut pod_labels = labels(CONTROLLER);
    pod_labels.insert(APP_LABEL.to_owned(), CONTROLLER.to_owned());
    let mut metadata = meta(CONTROLLER, facts, true, CONTROLLER);
    metadata
        .labels
        .get_or_insert_default()
        .insert(APP_LABEL.to_owned(), CONTROLLER.to_owned());
    let affinity: Affinity = serde_json::from_value(json!({
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100,
            "preference": {"matchExpressions": [
                {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]}}]},
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100,
            "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                "labelSelector": {"matchLabels": {APP_LABEL: CONTROLLER}}}}]},
    }))
    .unwrap_or_default();
    Deployment {
        metadata,
        spec: Some(DeploymentSpec {
            replicas: Some(1),
            selector: LabelSelector {
                match_labels: Some(common::string_map(&[(APP_LABEL, CONTROLLER)])),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    affinity: Some(affinity),
                    containers: vec![c],
                    priority_class_name: Some(DEFAULT_PRIORITY_CLASS.to_owned()),
                    service_account_name: Some(CONTROLLER.to_owned()),
                    image_pull_secrets: pull_secrets(cluster),
                    tolerations: Some(vec![
                        toleration("node-role.kubernetes.io/control-plane", Some("NoSchedule")),
                        toleration("node-role.kubernetes.io/master", Some("NoSchedule")),
                        toleration("CriticalAddonsOnly", None),
                        gpu_toleration(),
                    ]),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        status: None,
    }
}

// ---------------------------------------------------------------------------------------------
// Attribute DeviceClasses

/// A version as the driver publishes it (semver `major.minor.patch`) from `9.0` or `580.65.06`.
fn semver(field: &str, value: &str) -> Result<String, String> {
    let parts: Vec<&str> = value.trim().split('.').collect();
    let numeric = parts
        .iter()
        .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()));
    if !numeric || parts.is_empty() || parts.len() > 3 {
        return Err(format!(
            "{field}: {value:?} is not a version of the form MAJOR.MINOR[.PATCH] (for example 9.0)"
        ));
    }
    let n = |i: usize| {
        parts
            .get(i)
            .map(|p| p.trim_start_matches('0'))
            .map(|p| if p.is_empty() { "0" } else { p })
            .unwrap_or("0")
            .to_owned()
    };
    Ok(format!("{}.{}.{}", n(0), n(1), n(2)))
}

/// A CEL string literal (single-quoted, with quotes and backslashes escaped).
fn literal(value: &str) -> String {
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// Attribute and capacity names `expression` reads from the driver's domain that the driver
/// does not publish.
pub fn unknown_names(expression: &str) -> Vec<String> {
    let mut unknown = Vec::new();
    for (prefix, known) in [
        ("attributes", &PUBLISHED_ATTRIBUTES[..]),
        ("capacity", &PUBLISHED_CAPACITIES[..]),
    ] {
        for quote in ['\'', '"'] {
            let needle = format!("device.{prefix}[{quote}{DRIVER_NAME}{quote}].");
            for (at, _) in expression.match_indices(&needle) {
                let rest = &expression[at + needle.len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let ok = known.contains(&name.as_str())
                    || (prefix == "capacity"
                        && name.strip_prefix("memorySlice").is_some_and(|n| {
                            !n.is_empty() && n.chars().all(|c| c.is_ascii_digit())
                        }));
                if !ok && !name.is_empty() && !unknown.contains(&name) {
                    unknown.push(name);
                }
            }
        }
    }
    unknown
}

/// The CEL selector of one attribute class, or what is wrong with it (naming the field).
pub fn class_expression(index: usize, class: &AttributeDeviceClass) -> Result<String, String> {
    let field = |f: &str| format!("spec.deviceClasses[{index}].{f}");
    let a = |name: &str| format!("device.attributes['{DRIVER_NAME}'].{name}");
    let type_ = match class.device_type.unwrap_or_default() {
        DraDeviceType::Gpu => "gpu",
        DraDeviceType::Mig => "mig",
    };
    let mut terms = vec![
        format!("device.driver == '{DRIVER_NAME}'"),
        format!("{} == '{type_}'", a("type")),
    ];
    if let Some(p) = class.product_name.as_deref().filter(|s| !s.is_empty()) {
        terms.push(format!("{}.contains({})", a("productName"), literal(p)));
    }
    if let Some(v) = class.architecture.as_deref().filter(|s| !s.is_empty()) {
        terms.push(format!("{} == {}", a("architecture"), literal(v)));
    }
    if let Some(v) = class.min_cuda_compute_capability.as_deref() {
        let v = semver(&field("minCudaComputeCapability"), v)?;
        terms.push(format!(
            "{}.compareTo(semver('{v}')) >= 0",
            a("cudaComputeCapability")
        ));
    }
    if let Some(v) = class.min_driver_version.as_deref() {
        let v = semver(&field("minDriverVersion"), v)?;
        terms.push(format!(
            "{}.compareTo(semver('{v}')) >= 0",
            a("driverVersion")
        ));
    }
    if let Some(q) = &class.min_memory {
        terms.push(format!(
            "device.capacity['{DRIVER_NAME}'].memory.compareTo(quantity({})) >= 0",
            literal(&q.0)
        ));
    }
    if let Some(p) = class.mig_profile.as_deref().filter(|s| !s.is_empty()) {
        if type_ != "mig" {
            return Err(format!(
                "{}: a MIG profile needs deviceType: mig",
                field("migProfile")
            ));
        }
        terms.push(format!("{} == {}", a("profile"), literal(p)));
    }
    for (i, e) in class.expressions.iter().flatten().enumerate() {
        let unknown = unknown_names(e);
        if !unknown.is_empty() {
            return Err(format!(
                "{}: {} not published by the DRA driver; it publishes the attributes {} and the capacities {} (and memorySlice<N> on MIG devices)",
                field(&format!("expressions[{i}]")),
                unknown.join(", "),
                PUBLISHED_ATTRIBUTES.join(", "),
                PUBLISHED_CAPACITIES.join(", "),
            ));
        }
        terms.push(format!("({e})"));
    }
    Ok(terms.join(" && "))
}

/// The static checks of the attribute classes: every problem, each naming its field.
pub fn check_classes(spec: &GpuClusterSpec) -> Vec<String> {
    let classes = spec.device_classes.clone().unwrap_or_default();
    let mut problems: Vec<String> = classes
        .iter()
        .enumerate()
        .filter_map(|(i, c)| class_expression(i, c).err())
        .collect();
    let reserved: Vec<&str> = DRIVER_CLASSES
        .iter()
        .map(|c| c.0)
        .chain([
            "compute-domain-daemon.nvidia.com",
            "compute-domain-default-channel.nvidia.com",
        ])
        .collect();
    for (i, c) in classes.iter().enumerate() {
        if reserved.contains(&c.name.as_str()) {
            problems.push(format!(
                "spec.deviceClasses[{i}].name: {} is one of the DRA driver's own DeviceClasses; choose another name",
                c.name
            ));
        }
        if classes[..i].iter().any(|o| o.name == c.name) {
            problems.push(format!(
                "spec.deviceClasses[{i}].name: {} is listed twice",
                c.name
            ));
        }
    }
    problems
}

fn render_attribute_classes(cluster: &ValidatedGpuCluster, facts: &ClusterFacts) -> OperandObjects {
    let mut objects = OperandObjects::default();
    for (i, class) in cluster.spec.device_classes.iter().flatten().enumerate() {
        // Validate rejected any class whose expression fails; a failure here renders nothing.
        if let Ok(expression) = class_expression(i, class) {
            objects.dynamic.push(device_class(
                Operand::DraDeviceClasses,
                &class.name,
                vec![expression],
                facts,
            ));
        }
    }
    objects
}

/// The GPUCluster fields this operator stores but does not act on, as status lines: a
/// GPUCluster's exporter mounts the metrics ConfigMap `dcgmExporter.config.name` names, but
/// the GPUCluster pass does not watch it, so an edit reaches the pods only when they restart;
/// a ServiceMonitor asked for where the Prometheus Operator's API is not served is skipped.
pub fn not_acted_on(spec: &GpuClusterSpec, service_monitor_api: bool) -> Vec<String> {
    let mut out = Vec::new();
    let exporter = spec
        .dcgm_exporter
        .as_ref()
        .filter(|_| dcgm_exporter_enabled(spec));
    if exporter
        .and_then(|e| e.config.as_ref())
        .and_then(|c| c.name.as_deref())
        .is_some_and(|n| !n.is_empty())
    {
        out.push("spec.dcgmExporter.config.name: the metrics ConfigMap is mounted, but an edit of it does not restart the exporter; delete the nvidia-dcgm-exporter-dra pods to apply one".to_owned());
    }
    if exporter.is_some_and(|e| e.service_monitor_enabled()) && !service_monitor_api {
        out.push("spec.dcgmExporter.serviceMonitor: no ServiceMonitor, this cluster does not serve monitoring.coreos.com/v1 (the Prometheus Operator's CRDs); install them and restart the operator, or set it to false".to_owned());
    }
    out
}
