//! Render stage, node status exporter (pure, no IO): DaemonSet `nvidia-node-status-exporter`
//! serving the validator's per-node status files as metrics on :8000, its Service, and a
//! ServiceMonitor wherever that API is served (docs/operand-facts.md §14). Off unless enabled.

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, PodSpec, SecurityContext, Service, ServicePort, ServiceSpec,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube_core::DynamicObject;
use serde_json::json;

use super::common::{
    self, APP_LABEL, HOST_ROOT_VOLUME, HostPathType, MountExt, OperandDaemonSet, env, env_field,
    host_path_volume, merge_user_env, mount, rule,
};
use super::{dcgm_exporter, openshift};
use crate::api::{Component, ImageKind, NodeStatusExporterSpec};
use crate::facts::ClusterFacts;
use crate::model::ValidatedPolicy;
use crate::model::{Operand, OperandObjects};

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "node-status-exporter",
    component: Some(Component::NodeStatusExporter),
    deploy_label: Some(crate::nodes::DEPLOY_NODE_STATUS_EXPORTER),
    consumes_sharing_config: false,
    enabled: super::Enabled::BySwitch,
    images: |_, _| vec![ImageKind::NodeStatusExporter],
    host_paths: super::defaults::no_host_paths,
    render,
    check: super::defaults::no_check,
    report: super::defaults::no_report,
};

/// DaemonSet, Service, ServiceMonitor and `app` label name.
pub const NAME: &str = "nvidia-node-status-exporter";
/// ServiceAccount, Role, ClusterRole and SCC name.
pub const SERVICE_ACCOUNT: &str = "nvidia-node-status-exporter";
pub const MAIN_CONTAINER: &str = "nvidia-node-status-exporter";
pub const PORT: i32 = 8000;
const PORT_NAME: &str = "node-status";
const RUN_NVIDIA: &str = "run-nvidia";

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if !spec.is_enabled(Component::NodeStatusExporter) {
        return None;
    }
    let default_exporter = NodeStatusExporterSpec::default();
    let exporter = spec
        .node_status_exporter
        .as_ref()
        .unwrap_or(&default_exporter);
    let mut envs = vec![
        // Reads status files only; must not be handled by the NVIDIA runtime.
        env("NVIDIA_VISIBLE_DEVICES", "void"),
        env("COMPONENT", "metrics"),
        env("METRICS_PORT", &PORT.to_string()),
        env_field("NODE_NAME", "spec.nodeName"),
        env_field("OPERATOR_NAMESPACE", "metadata.namespace"),
    ];
    merge_user_env(&mut envs, exporter.container.env.as_ref());
    let main = Container {
        env: Some(envs),
        ports: Some(vec![ContainerPort {
            name: Some(PORT_NAME.to_owned()),
            container_port: PORT,
            protocol: Some("TCP".to_owned()),
            ..ContainerPort::default()
        }]),
        volume_mounts: Some(vec![
            mount(RUN_NVIDIA, "/run/nvidia").host_to_container(),
            mount(HOST_ROOT_VOLUME, "/host")
                .read_only()
                .host_to_container(),
        ]),
        security_context: Some(SecurityContext {
            run_as_user: Some(0),
            ..common::privileged()
        }),
        ..common::container(
            MAIN_CONTAINER,
            &common::image(policy, ImageKind::NodeStatusExporter),
            &["nvidia-validator"],
            &[],
        )
    };
    let pod = PodSpec {
        service_account_name: Some(SERVICE_ACCOUNT.to_owned()),
        containers: vec![main],
        volumes: Some(vec![
            host_path_volume(RUN_NVIDIA, "/run/nvidia", HostPathType::Directory),
            host_path_volume(HOST_ROOT_VOLUME, "/", HostPathType::Any),
        ]),
        ..PodSpec::default()
    };
    let mut ds = OperandDaemonSet::new(Operand::NodeStatusExporter, NAME, pod, MAIN_CONTAINER);
    ds.annotations = openshift::scc_annotation(facts, SERVICE_ACCOUNT);
    ds.image = Some(&exporter.image);
    ds.host_network = exporter.host_network.unwrap_or(false);
    ds.overrides = Some(&exporter.container);

    let mut service_meta = common::meta(Operand::NodeStatusExporter, NAME, facts, true);
    common::add_labels(&mut service_meta, &[(APP_LABEL, NAME)]);
    service_meta.annotations = Some(common::string_map(&[("prometheus.io/scrape", "true")]));
    let service = Service {
        metadata: service_meta,
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".to_owned()),
            selector: Some(common::string_map(&[(APP_LABEL, NAME)])),
            ports: Some(vec![ServicePort {
                name: Some(PORT_NAME.to_owned()),
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
    let role_rules = openshift::use_any_scc(facts)
        .into_iter()
        .chain([
            rule(&[""], &["pods"], &["get", "list"]),
            rule(&["apps"], &["daemonsets"], &["get", "list", "watch"]),
        ])
        .collect();
    common::add_identity(
        &mut objects,
        Operand::NodeStatusExporter,
        SERVICE_ACCOUNT,
        role_rules,
        vec![rule(&[""], &["nodes"], &["get", "list", "watch"])],
        facts,
    );
    objects.services.push(service);
    objects
        .daemon_sets
        .push(common::operand_daemon_set(policy, facts, ds));
    // NVIDIA has no switch for this one: it exists wherever the API does.
    if facts.service_monitor_api {
        objects.dynamic.push(service_monitor(facts));
    }
    objects.dynamic.extend(openshift::scc(
        Operand::NodeStatusExporter,
        SERVICE_ACCOUNT,
        openshift::HostAccess::default(),
        facts,
    ));
    Some(objects)
}

fn service_monitor(facts: &ClusterFacts) -> DynamicObject {
    let mut object = DynamicObject::new(NAME, &dcgm_exporter::service_monitor_api_resource());
    let mut metadata = common::meta(Operand::NodeStatusExporter, NAME, facts, true);
    common::add_labels(&mut metadata, &[(APP_LABEL, NAME)]);
    object.metadata = metadata;
    object.data = json!({
        "spec": {
            "jobLabel": PORT_NAME,
            "namespaceSelector": {"matchNames": [facts.namespace]},
            "selector": {"matchLabels": {APP_LABEL: NAME}},
            "endpoints": [{"port": PORT_NAME, "path": "/metrics"}],
        }
    });
    object
}
