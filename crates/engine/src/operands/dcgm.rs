//! Render stage, standalone DCGM host engine (pure, no IO): DaemonSet `nvidia-dcgm` and the
//! node-local Service `nvidia-dcgm` through which each exporter reaches its own node's engine
//! (docs/operand-facts.md §11). A GPUCluster's engine is the same operand under NVIDIA's `-dra`
//! names ([`render_dra`]): its pod reaches every GPU of its node through a DRA claim with
//! admin access instead of the NVIDIA runtime, and waits for no toolkit.

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, PodSpec, Probe, Service, ServicePort, ServiceSpec, TCPSocketAction,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::common::{
    self, APP_LABEL, GpuAccess, HostPathType, MountExt, OperandDaemonSet, host_path_volume,
    merge_user_env, mount, rule,
};
use super::{dra_driver, openshift, validator};
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
/// A GPUCluster's engine: DaemonSet, Service, `app` label, ServiceAccount, Role and SCC name.
pub const DRA_NAME: &str = "nvidia-dcgm-dra";
/// What a GPUCluster's exporter sets as `DCGM_REMOTE_HOSTENGINE_INFO` when its DCGM runs.
pub const DRA_REMOTE_HOSTENGINE: &str = "nvidia-dcgm-dra:5555";
/// A GPUCluster's engine's admin-access claim on every GPU of its node.
pub const DRA_CLAIM_TEMPLATE: &str = "nvidia-dcgm-admin";

/// A GPUCluster's DCGM host engine (NVIDIA's `state-dcgm`).
pub const DRA_DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "dcgm-dra",
    deploy_label: Some(crate::nodes::DEPLOY_DCGM_DRA),
    ..super::dra_driver::NOT_FROM_A_POLICY
};

/// Which DCGM DaemonSet: the ClusterPolicy's, or a GPUCluster's.
struct Flavor {
    operand: Operand,
    name: &'static str,
    /// The claim template of a GPUCluster's engine (GPUs through DRA, not the runtime).
    dra_claim: Option<&'static str>,
}

const POLICY_FLAVOR: Flavor = Flavor {
    operand: Operand::Dcgm,
    name: NAME,
    dra_claim: None,
};

const DRA_FLAVOR: Flavor = Flavor {
    operand: Operand::DcgmDra,
    name: DRA_NAME,
    dra_claim: Some(DRA_CLAIM_TEMPLATE),
};

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
    render_as(&POLICY_FLAVOR, policy, facts)
}

/// A GPUCluster's engine, from the ClusterPolicy-shaped view of the GPUCluster
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
    if !spec.is_enabled(Component::Dcgm) {
        return None;
    }
    let (operand, name) = (flavor.operand, flavor.name);
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
    let mut pod = PodSpec {
        service_account_name: Some(name.to_owned()),
        containers: vec![main],
        ..PodSpec::default()
    };
    if let Some(template) = flavor.dra_claim {
        dra_driver::claim_every_gpu(&mut pod, template);
    } else {
        pod.init_containers = Some(vec![validator::wait_for_toolkit(
            policy,
            mount(RUN_NVIDIA, "/run/nvidia").host_to_container(),
        )]);
        pod.volumes = Some(vec![host_path_volume(
            RUN_NVIDIA,
            "/run/nvidia",
            HostPathType::Directory,
        )]);
    }
    let mut ds = OperandDaemonSet::new(operand, name, pod, MAIN_CONTAINER);
    ds.annotations = match flavor.dra_claim {
        Some(_) => openshift::scc_annotation(facts, name),
        None => openshift::scc_annotation(facts, "hostmount-anyuid"),
    };
    ds.image = Some(&dcgm.image);
    ds.overrides = Some(&dcgm.container);
    ds.host_network = dcgm.host_network.unwrap_or(false);
    ds.gpu_access = match flavor.dra_claim {
        Some(_) => GpuAccess::None,
        None => GpuAccess::Runtime {
            nri_container: MAIN_CONTAINER,
        },
    };

    let mut service_meta = common::meta(operand, name, facts, true);
    common::add_labels(&mut service_meta, &[(APP_LABEL, name)]);
    let service = Service {
        metadata: service_meta,
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".to_owned()),
            // Each exporter must talk to the engine on its own node.
            internal_traffic_policy: Some("Local".to_owned()),
            selector: Some(common::string_map(&[(APP_LABEL, name)])),
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
    // NVIDIA's GPUCluster engine is granted reads of ResourceClaims (the claims its GPUs come
    // from), and no SCC but its own, which admits it by ServiceAccount; a ClusterPolicy's may
    // also use the privileged SCC, as NVIDIA's.
    let role_rules = match flavor.dra_claim {
        Some(_) => vec![rule(
            &["resource.k8s.io"],
            &["resourceclaims"],
            &["get", "list", "watch"],
        )],
        None => openshift::use_privileged_scc(facts).into_iter().collect(),
    };
    common::add_identity(&mut objects, operand, name, role_rules, Vec::new(), facts);
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
    objects.dynamic.extend(openshift::scc(
        operand,
        name,
        openshift::HostAccess {
            network: true,
            ports: true,
            ..Default::default()
        },
        facts,
    ));
    Some(objects)
}
