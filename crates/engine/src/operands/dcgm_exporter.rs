//! Render stage, DCGM exporter (pure, no IO): DaemonSet `nvidia-dcgm-exporter` publishing GPU
//! metrics on :9400, its Service, and a ServiceMonitor where the Prometheus Operator's API is
//! served (docs/operand-facts.md §12). A custom metrics ConfigMap is hashed into the pod template.
//! A GPUCluster's exporter is the same operand under NVIDIA's `-dra` names ([`render_dra`]): it
//! reaches every GPU of its node through a DRA claim with admin access instead of the NVIDIA
//! runtime, and runs in its DRA mode (`KUBERNETES_ENABLE_DRA`): the kubelet reports DRA-allocated
//! devices by pool and device name, which the exporter resolves to GPUs through ResourceSlices.

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, HTTPGetAction, PodSpec, Probe, Service, ServicePort, ServiceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube_core::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::{Value, json};

use super::common::{
    self, APP_LABEL, GpuAccess, HostPathType, MountExt, OperandDaemonSet, config_map_problem, env,
    env_field, env_value, host_path_volume, merge_user_env, mount, rule,
};
use super::{dcgm, dra_driver, openshift, validator};
use crate::api::{ClusterPolicySpec, Component, DcgmExporterSpec, ImageKind, ServiceMonitorSpec};
use crate::facts::ClusterFacts;
use crate::model::ValidatedPolicy;
use crate::model::{Operand, OperandObjects};

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "dcgm-exporter",
    component: Some(Component::DcgmExporter),
    deploy_label: Some(crate::nodes::DEPLOY_DCGM_EXPORTER),
    consumes_sharing_config: false,
    enabled: super::Enabled::BySwitch,
    images: |_, _| vec![ImageKind::DcgmExporter, ImageKind::Validator],
    host_paths: super::defaults::no_host_paths,
    render,
    check,
    report: super::defaults::no_report,
};

/// DaemonSet, Service, ServiceMonitor and `app` label name.
pub const NAME: &str = "nvidia-dcgm-exporter";
/// ServiceAccount, Role and SCC name.
pub const SERVICE_ACCOUNT: &str = "nvidia-dcgm-exporter";
pub const MAIN_CONTAINER: &str = "nvidia-dcgm-exporter";
/// ClusterRole letting the exporter read pods (pod labels / UIDs on metrics); rendered whenever
/// its token is mounted, since its pod informer then runs.
pub const READ_PODS_ROLE: &str = "nvidia-dcgm-exporter-read-pods";
pub const PORT: i32 = 9400;
/// Key of the metrics list in `dcgmExporter.config.name`.
pub const METRICS_KEY: &str = "dcgm-metrics.csv";
const METRICS_PATH: &str = "/etc/dcgm-exporter/dcgm-metrics.csv";
const DEFAULT_COLLECTORS: &str = "/etc/dcgm-exporter/dcp-metrics-included.csv";
const DEFAULT_HPC_DIR: &str = "/var/lib/dcgm-exporter/job-mapping";

/// A GPUCluster's exporter: DaemonSet, Service, ServiceMonitor, `app` label, ServiceAccount,
/// Role and SCC name (NVIDIA's).
pub const DRA_NAME: &str = "nvidia-dcgm-exporter-dra";
/// Its ClusterRole: pods and ResourceSlices, read.
pub const DRA_READ_ROLE: &str = "nvidia-dcgm-exporter-dra-read-pods";
/// Its admin-access claim on every GPU of its node.
pub const DRA_CLAIM_TEMPLATE: &str = "nvidia-dcgm-exporter-admin";

/// A GPUCluster's DCGM exporter (NVIDIA's `state-dcgm-exporter`).
pub const DRA_DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "dcgm-exporter-dra",
    deploy_label: Some(crate::nodes::DEPLOY_DCGM_EXPORTER_DRA),
    ..super::dra_driver::NOT_FROM_A_POLICY
};

/// Which exporter: the ClusterPolicy's, or a GPUCluster's in DRA mode.
struct Flavor {
    operand: Operand,
    name: &'static str,
    read_role: &'static str,
    remote_hostengine: &'static str,
    /// The claim template of a GPUCluster's exporter (GPUs through DRA, not the runtime).
    dra_claim: Option<&'static str>,
}

const POLICY_FLAVOR: Flavor = Flavor {
    operand: Operand::DcgmExporter,
    name: NAME,
    read_role: READ_PODS_ROLE,
    remote_hostengine: dcgm::REMOTE_HOSTENGINE,
    dra_claim: None,
};

const DRA_FLAVOR: Flavor = Flavor {
    operand: Operand::DcgmExporterDra,
    name: DRA_NAME,
    read_role: DRA_READ_ROLE,
    remote_hostengine: dcgm::DRA_REMOTE_HOSTENGINE,
    dra_claim: Some(DRA_CLAIM_TEMPLATE),
};

const POD_RESOURCES: &str = "pod-gpu-resources";
const RUN_NVIDIA: &str = "run-nvidia";
const METRICS_CONFIG: &str = "metrics-config";
const HPC_JOB_MAPPING: &str = "hpc-job-mapping";

/// The API of ServiceMonitor objects.
pub fn service_monitor_api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("monitoring.coreos.com", "v1", "ServiceMonitor"),
        "servicemonitors",
    )
}

fn health_probe(period: Option<i32>) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some("/health".to_owned()),
            port: IntOrString::Int(PORT),
            ..HTTPGetAction::default()
        }),
        initial_delay_seconds: Some(45),
        period_seconds: period,
        ..Probe::default()
    }
}

fn is_true(value: Option<&str>) -> bool {
    value.is_some_and(|v| v.eq_ignore_ascii_case("true"))
}

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    render_as(&POLICY_FLAVOR, policy, facts)
}

/// A GPUCluster's exporter, from the ClusterPolicy-shaped view of the GPUCluster
/// ([`super::dra_driver::policy_view`]).
pub fn render_dra(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    render_as(&DRA_FLAVOR, policy, facts)
}

fn render_as(
    flavor: &Flavor,
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if !spec.is_enabled(Component::DcgmExporter) {
        return None;
    }
    let (operand, name, dra) = (flavor.operand, flavor.name, flavor.dra_claim.is_some());
    let default_exporter = DcgmExporterSpec::default();
    let exporter = spec.dcgm_exporter.as_ref().unwrap_or(&default_exporter);
    let metrics_config = exporter
        .config
        .as_ref()
        .and_then(|c| c.name.as_deref())
        .filter(|n| !n.is_empty());
    let hpc = exporter
        .hpc_job_mapping
        .as_ref()
        .filter(|h| h.enabled.unwrap_or(false))
        .map(|h| {
            h.directory
                .as_deref()
                .filter(|d| !d.is_empty())
                .unwrap_or(DEFAULT_HPC_DIR)
                .to_owned()
        });

    let mut envs = vec![
        env("DCGM_EXPORTER_LISTEN", &format!(":{PORT}")),
        // Maps GPUs to the pods using them through the kubelet's pod-resources API.
        env("DCGM_EXPORTER_KUBERNETES", "true"),
        env(
            "DCGM_EXPORTER_COLLECTORS",
            if metrics_config.is_some() {
                METRICS_PATH
            } else {
                DEFAULT_COLLECTORS
            },
        ),
        env_field("NODE_NAME", "spec.nodeName"),
    ];
    if spec.is_enabled(Component::Dcgm) {
        envs.push(env("DCGM_REMOTE_HOSTENGINE_INFO", flavor.remote_hostengine));
    }
    if let Some(dir) = &hpc {
        envs.push(env("DCGM_HPC_JOB_MAPPING_DIR", dir));
    }
    if dra {
        // Without it DRA-allocated GPUs carry no pod, namespace or container label.
        envs.push(env("KUBERNETES_ENABLE_DRA", "true"));
    }
    // The policy's pod-metadata switches, as NVIDIA's operator passes them; a variable of the
    // same name in env wins.
    if exporter.enable_pod_labels == Some(true) {
        envs.push(env("DCGM_EXPORTER_KUBERNETES_ENABLE_POD_LABELS", "true"));
    }
    if exporter.enable_pod_uid == Some(true) {
        envs.push(env("DCGM_EXPORTER_KUBERNETES_ENABLE_POD_UID", "true"));
    }
    if let Some(regexes) = exporter
        .pod_label_allowlist_regex
        .as_ref()
        .filter(|r| !r.is_empty())
    {
        envs.push(env(
            "DCGM_EXPORTER_KUBERNETES_POD_LABEL_ALLOWLIST_REGEX",
            &regexes.join(","),
        ));
    }
    merge_user_env(&mut envs, exporter.container.env.as_ref());
    let pod_labels_on = is_true(env_value(
        &envs,
        "DCGM_EXPORTER_KUBERNETES_ENABLE_POD_LABELS",
    )) || is_true(env_value(&envs, "DCGM_EXPORTER_KUBERNETES_ENABLE_POD_UID"));
    let configmap_data = env_value(&envs, "DCGM_EXPORTER_CONFIGMAP_DATA")
        .is_some_and(|v| !v.is_empty() && v != "none");
    // The exporter reads the API server only for pod labels or a metrics ConfigMap. Once it
    // has a token, DCGM_EXPORTER_KUBERNETES=true starts its pod informer whatever the pod
    // label switches say (dcgm-exporter internal/pkg/transformation/kubernetes.go,
    // NewPodMapper), so reading pods comes with the token.
    // In DRA mode the ResourceSlice and pod informers always run.
    let needs_token = pod_labels_on || configmap_data || dra;

    let mut mounts = vec![mount(POD_RESOURCES, "/var/lib/kubelet/pod-resources").read_only()];
    let mut volumes = vec![host_path_volume(
        POD_RESOURCES,
        &common::join_path(common::kubelet_root_dir(spec), "pod-resources"),
        HostPathType::Any,
    )];
    if !dra {
        volumes.push(host_path_volume(
            RUN_NVIDIA,
            "/run/nvidia",
            HostPathType::Any,
        ));
    }
    if let Some(name) = metrics_config {
        volumes.push(common::config_map_volume(
            METRICS_CONFIG,
            name,
            None,
            &[(METRICS_KEY, METRICS_KEY)],
        ));
        mounts.push(
            mount(METRICS_CONFIG, METRICS_PATH)
                .sub_path(METRICS_KEY)
                .read_only(),
        );
    }
    if let Some(dir) = &hpc {
        volumes.push(host_path_volume(
            HPC_JOB_MAPPING,
            dir,
            HostPathType::DirectoryOrCreate,
        ));
        mounts.push(mount(HPC_JOB_MAPPING, dir).read_only());
    }
    let main = Container {
        env: Some(envs),
        ports: Some(vec![ContainerPort {
            name: Some("metrics".to_owned()),
            container_port: PORT,
            protocol: Some("TCP".to_owned()),
            ..ContainerPort::default()
        }]),
        liveness_probe: Some(health_probe(Some(5))),
        readiness_probe: Some(health_probe(None)),
        volume_mounts: Some(mounts),
        security_context: Some(common::privileged()),
        ..common::container(
            MAIN_CONTAINER,
            &common::image(policy, ImageKind::DcgmExporter),
            &[],
            &[],
        )
    };
    let mut pod = PodSpec {
        service_account_name: Some(name.to_owned()),
        automount_service_account_token: Some(needs_token),
        host_pid: exporter.host_pid.filter(|p| *p),
        containers: vec![main],
        volumes: Some(volumes),
        ..PodSpec::default()
    };
    match flavor.dra_claim {
        Some(template) => dra_driver::claim_every_gpu(&mut pod, template),
        None => {
            pod.init_containers = Some(vec![validator::wait_for_toolkit(
                policy,
                mount(RUN_NVIDIA, "/run/nvidia").host_to_container(),
            )]);
        }
    }
    let mut ds = OperandDaemonSet::new(operand, name, pod, MAIN_CONTAINER);
    ds.annotations = openshift::scc_annotation(facts, name);
    for extra in [&exporter.pod_annotations, &exporter.annotations]
        .into_iter()
        .flatten()
    {
        ds.pod_annotations.extend(extra.clone());
    }
    if let Some(labels) = &exporter.pod_labels {
        ds.pod_labels = labels.clone();
    }
    ds.image = Some(&exporter.image);
    ds.overrides = Some(&exporter.container);
    ds.host_network = exporter.host_network.unwrap_or(false);
    ds.gpu_access = if dra {
        GpuAccess::None
    } else {
        GpuAccess::Runtime {
            nri_container: MAIN_CONTAINER,
        }
    };
    ds.config_hash = metrics_config
        .and(facts.dcgm_metrics.as_ref())
        .map(|cm| common::config_hash(&cm.data));

    let mut service_meta = common::meta(operand, name, facts, true);
    common::add_labels(&mut service_meta, &[(APP_LABEL, name)]);
    service_meta.annotations = Some(common::string_map(&[("prometheus.io/scrape", "true")]));
    let service_spec = exporter.service.as_ref();
    let service = Service {
        metadata: service_meta,
        spec: Some(ServiceSpec {
            type_: Some(
                service_spec
                    .and_then(|s| s.type_.clone())
                    .filter(|t| !t.is_empty())
                    .unwrap_or_else(|| "ClusterIP".to_owned()),
            ),
            internal_traffic_policy: service_spec
                .and_then(|s| s.internal_traffic_policy.clone())
                .filter(|t| !t.is_empty()),
            selector: Some(common::string_map(&[(APP_LABEL, name)])),
            ports: Some(vec![ServicePort {
                name: Some("gpu-metrics".to_owned()),
                port: PORT,
                target_port: Some(IntOrString::Int(PORT)),
                protocol: Some("TCP".to_owned()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        status: None,
    };

    let mut objects = OperandObjects::default();
    // In DRA mode (NVIDIA's dcgm-exporter DRA RBAC) it also reads the ResourceClaims of its
    // namespace and every ResourceSlice, to map (pool, device) names to GPUs.
    let read = ["get", "list", "watch"];
    // A GPUCluster's exporter has its own SCC only, as NVIDIA's (which admits it by
    // ServiceAccount); a ClusterPolicy's may also use the privileged one.
    let role_rules = openshift::use_privileged_scc(facts)
        .filter(|_| !dra)
        .into_iter()
        .chain(dra.then(|| rule(&["resource.k8s.io"], &["resourceclaims"], &read)))
        .chain([rule(&[""], &["configmaps"], &["get", "list"])])
        .collect();
    common::add_identity(&mut objects, operand, name, role_rules, Vec::new(), facts);
    if needs_token {
        common::add_cluster_role(
            &mut objects,
            operand,
            flavor.read_role,
            name,
            std::iter::once(rule(&[""], &["pods"], &read))
                .chain(dra.then(|| rule(&["resource.k8s.io"], &["resourceslices"], &read)))
                .collect(),
            facts,
        );
    }
    objects.services.push(service);
    objects
        .daemon_sets
        .push(common::operand_daemon_set(policy, facts, ds));
    if let Some(template) = flavor.dra_claim {
        objects.dynamic.push(dra_driver::admin_claim_template(
            operand,
            template,
            dra_driver::ADMIN_CLAIM,
            None,
            facts,
        ));
    }
    if exporter.service_monitor_enabled() && facts.service_monitor_api {
        objects
            .dynamic
            .push(service_monitor(operand, name, exporter, facts));
    }
    objects.dynamic.extend(openshift::scc(
        operand,
        name,
        openshift::HostAccess {
            ports: true,
            pid: dra,
            network: dra,
            ..Default::default()
        },
        facts,
    ));
    Some(objects)
}

fn service_monitor(
    operand: Operand,
    name: &str,
    exporter: &DcgmExporterSpec,
    facts: &ClusterFacts,
) -> DynamicObject {
    let settings = exporter.service_monitor.clone().unwrap_or_default();
    let mut object = DynamicObject::new(name, &service_monitor_api_resource());
    object.metadata = service_monitor_meta(operand, name, &settings, facts);
    let endpoint = tuned_endpoint(
        json!({"port": "gpu-metrics", "path": "/metrics"}),
        &settings,
    );
    object.data = json!({
        "spec": {
            "jobLabel": APP_LABEL,
            "namespaceSelector": {"matchNames": [facts.namespace]},
            "selector": {"matchLabels": {APP_LABEL: name}},
            "endpoints": [endpoint],
        }
    });
    object
}

/// A ServiceMonitor's metadata: the policy's `additionalLabels` under ours, and `app: <name>`.
pub(crate) fn service_monitor_meta(
    operand: Operand,
    name: &str,
    settings: &ServiceMonitorSpec,
    facts: &ClusterFacts,
) -> ObjectMeta {
    let mut metadata = common::meta(operand, name, facts, true);
    let mut labels = settings.additional_labels.clone().unwrap_or_default();
    labels.extend(metadata.labels.take().unwrap_or_default());
    labels.insert(APP_LABEL.to_owned(), name.to_owned());
    metadata.labels = Some(labels);
    metadata
}

/// `endpoint` with the policy's scrape settings (NVIDIA applies them to the first endpoint):
/// interval, scrape timeout, honorLabels and relabelings, where set.
pub(crate) fn tuned_endpoint(mut endpoint: Value, settings: &ServiceMonitorSpec) -> Value {
    if let Some(interval) = settings.interval.as_ref().filter(|i| !i.is_empty()) {
        endpoint["interval"] = json!(interval);
    }
    if let Some(timeout) = settings.scrape_timeout.as_ref().filter(|t| !t.is_empty()) {
        endpoint["scrapeTimeout"] = json!(timeout);
    }
    if let Some(honor) = settings.honor_labels {
        endpoint["honorLabels"] = json!(honor);
    }
    if let Some(relabelings) = settings.relabelings.as_ref().filter(|r| !r.is_empty()) {
        endpoint["relabelings"] = serde_json::to_value(relabelings).unwrap_or_default();
    }
    endpoint
}

/// What validate says about dcgm-exporter's input: the metrics ConfigMap
/// `dcgmExporter.config.name` names must exist with its key.
pub fn check(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Vec<String> {
    let name = spec
        .dcgm_exporter
        .as_ref()
        .and_then(|d| d.config.as_ref())
        .and_then(|c| c.name.as_deref())
        .filter(|n| !n.is_empty());
    name.and_then(|name| {
        config_map_problem(
            "spec.dcgmExporter.config.name",
            name,
            METRICS_KEY,
            facts.dcgm_metrics.as_ref(),
            facts,
            "or remove the field to collect the default metrics",
        )
    })
    .into_iter()
    .collect()
}

/// Validate's status note for a DCGM exporter ServiceMonitor the policy asks for where the cluster
/// does not serve the Prometheus Operator's API: it is skipped (as NVIDIA's operator skips it)
/// and everything else is deployed, so the policy can still become ready.
pub fn service_monitor_note(spec: &ClusterPolicySpec, api_served: bool) -> Option<String> {
    let wanted = spec.is_enabled(Component::DcgmExporter)
        && spec
            .dcgm_exporter
            .as_ref()
            .is_some_and(|e| e.service_monitor_enabled());
    (wanted && !api_served).then(|| {
        "no ServiceMonitor for the DCGM exporter: dcgmExporter.serviceMonitor.enabled is true but \
         this cluster does not serve monitoring.coreos.com/v1 (the Prometheus Operator's CRDs); \
         install them and restart the operator, or set it to false"
            .to_owned()
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn a_wanted_service_monitor_without_the_prometheus_operator_api_is_a_status_note() {
        let spec = |yaml: &str| -> crate::api::ClusterPolicySpec {
            serde_yaml_ng::from_str(yaml).unwrap()
        };
        let wanted = spec("dcgmExporter: {serviceMonitor: {enabled: true}}");
        let note = service_monitor_note(&wanted, false).expect("no note");
        assert!(note.contains("monitoring.coreos.com/v1"), "{note}");
        assert_eq!(service_monitor_note(&wanted, true), None);
        assert_eq!(
            service_monitor_note(
                &spec("dcgmExporter: {serviceMonitor: {enabled: false}}"),
                false
            ),
            None
        );
        assert_eq!(
            service_monitor_note(
                &spec("dcgmExporter: {enabled: false, serviceMonitor: {enabled: true}}"),
                false
            ),
            None
        );
    }
}
