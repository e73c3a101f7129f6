//! Render stage, standalone DCGM host engine (pure, no IO): DaemonSet `nvidia-dcgm` and the
//! node-local Service `nvidia-dcgm` through which each exporter reaches its own node's engine
//! (docs/operand-facts.md §11).

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, PodSpec, Probe, Service, ServicePort, ServiceSpec, TCPSocketAction,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::common::{
    self, APP_LABEL, GpuAccess, HostPathType, MountExt, OperandDaemonSet, host_path_volume,
    merge_user_env, mount,
};
use super::{openshift, validator};
use crate::api::{Component, DcgmSpec, ImageKind};
use crate::facts::ClusterFacts;
use crate::model::ValidatedPolicy;
use crate::model::{Operand, OperandObjects};

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "dcgm",
    component: Some(Component::Dcgm),
    deploy_label: Some(crate::nodes::DEPLOY_DCGM),
    consumes_sharing_config: false,
    enabled: super::Enabled::BySwitch,
    images: |_, _| vec![ImageKind::Dcgm, ImageKind::Validator],
    host_paths: super::defaults::no_host_paths,
    render,
    check: super::defaults::no_check,
    report: super::defaults::no_report,
};

/// DaemonSet, Service and `app` label name.
pub const NAME: &str = "nvidia-dcgm";
/// ServiceAccount, Role and SCC name.
pub const SERVICE_ACCOUNT: &str = "nvidia-dcgm";
pub const MAIN_CONTAINER: &str = "nvidia-dcgm-ctr";
/// The host engine's port.
pub const PORT: i32 = 5555;
/// What the exporter sets as `DCGM_REMOTE_HOSTENGINE_INFO` when this operand runs.
pub const REMOTE_HOSTENGINE: &str = "nvidia-dcgm:5555";

const RUN_NVIDIA: &str = "run-nvidia";

fn tcp_probe() -> Probe {
    Probe {
        tcp_socket: Some(TCPSocketAction {
            port: IntOrString::Int(PORT),
            host: None,
        }),
        initial_delay_seconds: Some(15),
        ..Probe::default()
    }
}

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if !spec.is_enabled(Component::Dcgm) {
        return None;
    }
    let default_dcgm = DcgmSpec::default();
    let dcgm = spec.dcgm.as_ref().unwrap_or(&default_dcgm);
    let mut envs = Vec::new();
    merge_user_env(&mut envs, dcgm.container.env.as_ref());
    let main = Container {
        env: (!envs.is_empty()).then_some(envs),
        ports: Some(vec![ContainerPort {
            name: Some("dcgm".to_owned()),
            container_port: PORT,
            protocol: Some("TCP".to_owned()),
            ..ContainerPort::default()
        }]),
        liveness_probe: Some(tcp_probe()),
        readiness_probe: Some(tcp_probe()),
        security_context: Some(common::privileged()),
        // The image's own entrypoint starts nv-hostengine.
        ..common::container(
            MAIN_CONTAINER,
            &common::image(policy, ImageKind::Dcgm),
            &[],
            &[],
        )
    };
    let pod = PodSpec {
        service_account_name: Some(SERVICE_ACCOUNT.to_owned()),
        init_containers: Some(vec![validator::wait_for_toolkit(
            policy,
            mount(RUN_NVIDIA, "/run/nvidia").host_to_container(),
        )]),
        containers: vec![main],
        volumes: Some(vec![host_path_volume(
            RUN_NVIDIA,
            "/run/nvidia",
            HostPathType::Directory,
        )]),
        ..PodSpec::default()
    };
    let mut ds = OperandDaemonSet::new(Operand::Dcgm, NAME, pod, MAIN_CONTAINER);
    ds.annotations = openshift::scc_annotation(facts, "hostmount-anyuid");
    ds.image = Some(&dcgm.image);
    ds.overrides = Some(&dcgm.container);
    ds.host_network = dcgm.host_network.unwrap_or(false);
    ds.gpu_access = GpuAccess::Runtime {
        nri_container: MAIN_CONTAINER,
    };

    let mut service_meta = common::meta(Operand::Dcgm, NAME, facts, true);
    common::add_labels(&mut service_meta, &[(APP_LABEL, NAME)]);
    let service = Service {
        metadata: service_meta,
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".to_owned()),
            // Each exporter must talk to the engine on its own node.
            internal_traffic_policy: Some("Local".to_owned()),
            selector: Some(common::string_map(&[(APP_LABEL, NAME)])),
            ports: Some(vec![ServicePort {
                name: Some("dcgm".to_owned()),
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
    common::add_identity(
        &mut objects,
        Operand::Dcgm,
        SERVICE_ACCOUNT,
        openshift::use_privileged_scc(facts).into_iter().collect(),
        Vec::new(),
        facts,
    );
    objects.services.push(service);
    objects
        .daemon_sets
        .push(common::operand_daemon_set(policy, facts, ds));
    objects.dynamic.extend(openshift::scc(
        Operand::Dcgm,
        SERVICE_ACCOUNT,
        openshift::HostAccess {
            network: true,
            ports: true,
            ..Default::default()
        },
        facts,
    ));
    Some(objects)
}
