//! Render stage, CC manager (pure, no IO): DaemonSet `nvidia-cc-manager` on virtual machine
//! nodes in sandbox mode kata. It puts the node's GPUs into the confidential-computing mode the
//! node's `nvidia.com/cc.mode` label asks for (else `ccManager.defaultMode`), pausing the VM
//! operands through their deploy labels while the GPUs reset, and reports the result in
//! `nvidia.com/cc.mode.state` and `nvidia.com/cc.ready.state` (docs/operand-facts.md §20.4,
//! §20.6). The sandbox validator's `cc-manager-validation` waits for its readiness file. On with
//! sandbox workloads in mode kata and `ccManager.enabled`.

use k8s_openapi::api::core::v1::{Container, EnvVar as K8sEnvVar, PodSpec};

use super::common::{
    self, HostPathType, OperandDaemonSet, VALIDATIONS_DIR, env, env_field, host_path_volume,
    merge_user_env, mount, rule,
};
use super::openshift;
use crate::api::{CcManagerSpec, CcMode, Component, ImageKind};
use crate::facts::ClusterFacts;
use crate::model::{Operand, OperandObjects, ValidatedPolicy};

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "cc-manager",
    component: Some(Component::CcManager),
    deploy_label: Some(crate::workload::DEPLOY_CC_MANAGER),
    consumes_sharing_config: false,
    enabled: super::Enabled::BySwitch,
    images: |_, _| vec![ImageKind::CcManager],
    host_paths: super::defaults::no_host_paths,
    render,
    check: super::defaults::no_check,
    report: super::defaults::no_report,
};

/// DaemonSet name and `app` label of the DaemonSet (NVIDIA's).
pub const NAME: &str = "nvidia-cc-manager";
/// ServiceAccount, Role, ClusterRole and SCC name. NVIDIA's SCC for this operand is a copy of
/// the VFIO manager's under that name, so it admits nothing of this one; ours is its own.
pub const SERVICE_ACCOUNT: &str = "nvidia-cc-manager";
pub const MAIN_CONTAINER: &str = "nvidia-cc-manager";
/// The admission policy keeping the CC manager's node writes to its own node.
pub const CONFINEMENT_POLICY: &str = "nvidia-cc-manager-own-node";
/// The file the CC manager creates once ready; the sandbox validator waits for it.
pub const READINESS_FILE: &str = ".cc-manager-ctr-ready";

/// The pod label NVIDIA's DaemonSet selects on (its pods also carry `app`).
const SELECTOR_LABEL: &str = "name";
const HOST_SYS: &str = "host-sys";
const RUN_NVIDIA: &str = "run-nvidia";

/// The label value of a CC mode (the CC manager's spelling).
pub const fn cc_mode_name(mode: CcMode) -> &'static str {
    match mode {
        CcMode::On => "on",
        CcMode::Off => "off",
        CcMode::Devtools => "devtools",
        CcMode::Ppcie => "ppcie",
    }
}

/// The manager's own settings, before the user's env.
fn manager_env(cc: &CcManagerSpec) -> Vec<K8sEnvVar> {
    let mut envs = vec![
        env_field("NODE_NAME", "spec.nodeName"),
        // It reaches the GPUs through sysfs; the runtime must not hand it any.
        env("NVIDIA_VISIBLE_DEVICES", "void"),
    ];
    // Unset, the manager defaults to `on` (forced `off` on a host without TDX or SEV-SNP).
    if let Some(mode) = cc.default_mode {
        envs.push(env("DEFAULT_CC_MODE", cc_mode_name(mode)));
    }
    // Before a mode change it waits for the paused VM operands' pods to leave, listing them in
    // OPERATOR_NAMESPACE, which defaults to `gpu-operator`. NVIDIA's DaemonSet leaves it unset,
    // so in any other namespace the wait finds no pods and the GPUs reset under running
    // operands; the pod's own namespace is the operator's.
    envs.push(env_field("OPERATOR_NAMESPACE", "metadata.namespace"));
    envs
}

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if !spec.is_enabled(Component::CcManager) {
        return None;
    }
    let default_manager = CcManagerSpec::default();
    let cc = spec.cc_manager.as_ref().unwrap_or(&default_manager);

    let mut envs = manager_env(cc);
    merge_user_env(&mut envs, cc.container.env.as_ref());
    let clean_up = format!("{VALIDATIONS_DIR}/{READINESS_FILE}");
    let main = Container {
        env: Some(envs),
        resources: Some(common::small_manager_resources()),
        security_context: Some(common::privileged_s0()),
        // GPU registers and resets through sysfs; the readiness file under /run/nvidia.
        volume_mounts: Some(vec![
            mount(HOST_SYS, "/sys"),
            mount(RUN_NVIDIA, "/run/nvidia"),
        ]),
        // A stopped manager is no longer ready: the validator's check must wait again.
        lifecycle: Some(common::pre_stop_exec(&["rm", "-f", &clean_up])),
        // The image's own entrypoint.
        ..common::container(
            MAIN_CONTAINER,
            &common::image(policy, ImageKind::CcManager),
            &[],
            &[],
        )
    };
    let pod = PodSpec {
        service_account_name: Some(SERVICE_ACCOUNT.to_owned()),
        containers: vec![main],
        termination_grace_period_seconds: Some(30),
        volumes: Some(vec![
            host_path_volume(HOST_SYS, "/sys", HostPathType::Directory),
            host_path_volume(RUN_NVIDIA, "/run/nvidia", HostPathType::DirectoryOrCreate),
        ]),
        ..PodSpec::default()
    };
    let mut ds = OperandDaemonSet::new(Operand::CcManager, NAME, pod, MAIN_CONTAINER);
    ds.annotations = openshift::scc_annotation(facts, SERVICE_ACCOUNT);
    ds.image = Some(&cc.image);
    ds.overrides = Some(&cc.container);
    ds.host_network = cc.host_network.unwrap_or(false);
    ds.pod_labels = common::string_map(&[(SELECTOR_LABEL, NAME)]);

    let mut objects = OperandObjects::default();
    let role_rules = openshift::use_privileged_scc(facts)
        .into_iter()
        // It waits for the paused operands' pods, which live in the operator namespace.
        .chain([rule(&[""], &["pods"], &["get", "list", "watch"])])
        .collect();
    // It watches its node's mode label and writes the state labels and the pauses there.
    let cluster_rules = vec![rule(&[""], &["nodes"], &["get", "list", "patch", "watch"])];
    common::add_identity(
        &mut objects,
        Operand::CcManager,
        SERVICE_ACCOUNT,
        role_rules,
        cluster_rules,
        facts,
    );
    // Its token may patch only its own node.
    objects.dynamic.extend(common::confinement_policy(
        Operand::CcManager,
        CONFINEMENT_POLICY,
        &[SERVICE_ACCOUNT],
        &[common::own_node_writes()],
        facts,
    ));
    let mut daemon_set = common::operand_daemon_set(policy, facts, ds);
    // NVIDIA selects these pods by `name`, not `app`; a DaemonSet's selector cannot change, so
    // taking over NVIDIA's needs the same one.
    if let Some(spec) = daemon_set.spec.as_mut() {
        spec.selector.match_labels = Some(common::string_map(&[(SELECTOR_LABEL, NAME)]));
    }
    objects.daemon_sets.push(daemon_set);
    objects.dynamic.extend(openshift::scc(
        Operand::CcManager,
        SERVICE_ACCOUNT,
        openshift::HostAccess::default(),
        facts,
    ));
    Some(objects)
}
