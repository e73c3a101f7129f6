//! Render stage, MIG manager (pure, no IO): DaemonSet `nvidia-mig-manager` that applies the
//! MIG layout named by each node's `nvidia.com/mig.config` label, its entrypoint, the default
//! layouts ConfigMap `default-mig-parted-config` (generated from the per-model profile table)
//! and the default GPU-clients list (docs/operand-facts.md §13, docs/config-facts.md §4.4 and §5). The layouts
//! the pods read are hashed into the pod template.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, PodSpec};
use serde_json::json;

use super::common::{
    self, DRIVER_INSTALL_DIR_VOLUME, GpuAccess, HOST_ROOT_VOLUME, HostPathType, MountExt,
    OperandDaemonSet, VALIDATIONS_DIR, config_map_problem, env, env_field, host_path_volume,
    merge_user_env, mount, rule,
};
use super::openshift;
use super::validator::{self, VALIDATIONS_VOLUME};
use crate::api::{ClusterPolicySpec, Component, ImageKind, MigManagerSpec};
use crate::facts::ClusterFacts;
use crate::model::ValidatedPolicy;
use crate::model::{Operand, OperandObjects};
use crate::nodes::NodeView;
use crate::sharing::mig;

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "mig-manager",
    component: Some(Component::MigManager),
    deploy_label: Some(crate::nodes::DEPLOY_MIG_MANAGER),
    consumes_sharing_config: false,
    enabled: super::Enabled::BySwitch,
    images: |_, _| vec![ImageKind::MigManager, ImageKind::Validator],
    host_paths: super::toolkit::install_dir_host_path,
    render,
    check,
    report: |_, facts| report(facts),
};

/// DaemonSet name and `app` label.
pub const NAME: &str = "nvidia-mig-manager";
/// ServiceAccount, Role, ClusterRole and SCC name.
pub const SERVICE_ACCOUNT: &str = "nvidia-mig-manager";
pub const MAIN_CONTAINER: &str = "nvidia-mig-manager";
/// The admission policy keeping mig-manager's writes to its own node.
pub const CONFINEMENT_POLICY: &str = "nvidia-mig-manager-own-node";
/// Suffix of the ConfigMap `<node>-mig-config` mig-manager publishes its layouts in.
pub const NODE_CONFIG_MAP_SUFFIX: &str = "-mig-config";
pub const ENTRYPOINT_CONFIG_MAP: &str = "nvidia-mig-manager-entrypoint";
/// The layouts ConfigMap rendered when the policy names no other.
pub const DEFAULT_CONFIG_MAP: &str = "default-mig-parted-config";
/// The host services list rendered when the policy names no other.
pub const DEFAULT_GPU_CLIENTS: &str = "default-gpu-clients";
/// Key of the layouts in a MIG config ConfigMap.
pub const CONFIG_KEY: &str = "config.yaml";
/// Key of the services list in a GPU-clients ConfigMap.
pub const CLIENTS_KEY: &str = "clients.yaml";
const ENTRYPOINT_KEY: &str = "entrypoint.sh";

const HOST_SYS: &str = "host-sys";
const GPU_CLIENTS: &str = "gpu-clients";
const MIG_PARTED_CONFIG: &str = "mig-parted-config";
const CDI_ROOT: &str = "cdi-root";

/// The entrypoint (our script): wait for the driver validation, take over what it found, and
/// stop host GPU clients during a change only when the driver is installed on the host.
const ENTRYPOINT: &str = r#"#!/bin/sh
# Entrypoint of the NVIDIA MIG manager (rendered by gpu-operator).
ready=/run/nvidia/validations/driver-ready
until [ -f "$ready" ]; do
  echo "waiting for the driver validation ($ready)"
  sleep 5
done
set -a
. "$ready"
set +a
export WITH_SHUTDOWN_HOST_GPU_CLIENTS="${IS_HOST_DRIVER:-false}"
exec nvidia-mig-manager
"#;

/// Host services that hold GPUs open and are stopped while a GPU is repartitioned.
const DEFAULT_CLIENT_SERVICES: [&str; 9] = [
    "nvsm.service",
    "nvsm-mqtt.service",
    "nvsm-core.service",
    "nvsm-api-gateway.service",
    "nvsm-notifier.service",
    "nv_peer_mem.service",
    "nvidia-dcgm.service",
    "dcgm.service",
    "dcgm-exporter.service",
];

/// The default layouts (mig-parted `version: v1`): `all-disabled`, `all-enabled`,
/// `all-balanced` and one `all-<profile>` per MIG profile, limited by PCI device filter to the
/// models that offer it. Generated from the per-model profile table the MIG validation uses
/// (`sharing::mig_profiles`), so the layouts we ship and the ones we accept cannot drift apart.
pub fn default_mig_config() -> String {
    default_mig_config_text().to_owned()
}

/// [`default_mig_config`], generated once: every pass validates against it.
fn default_mig_config_text() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(crate::sharing::mig::default_config)
}

fn default_clients() -> String {
    let config = json!({"version": "v1", "systemd-services": DEFAULT_CLIENT_SERVICES});
    serde_yaml_ng::to_string(&config).unwrap_or_default()
}

/// The custom layouts ConfigMap the policy names, if it names one other than the default.
pub fn custom_config_name(spec: &MigManagerSpec) -> Option<&str> {
    spec.config
        .as_ref()
        .and_then(|c| c.name.as_deref())
        .filter(|n| !n.is_empty() && *n != DEFAULT_CONFIG_MAP)
}

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if !spec.is_enabled(Component::MigManager) {
        return None;
    }
    let default_manager = MigManagerSpec::default();
    let manager = spec.mig_manager.as_ref().unwrap_or(&default_manager);
    let custom_config = custom_config_name(manager);
    let custom_clients = manager
        .gpu_clients_config
        .as_ref()
        .and_then(|c| c.name.as_deref())
        .filter(|n| !n.is_empty());

    let mut objects = OperandObjects::default();
    let mut envs = vec![
        env_field("NODE_NAME", "spec.nodeName"),
        env_field("POD_NAME", "metadata.name"),
        env_field("POD_NAMESPACE", "metadata.namespace"),
        env("GPU_CLIENTS_FILE", "/gpu-clients/clients.yaml"),
        // Where mig-manager looks for operand pods to wait for before repartitioning.
        env_field("DEFAULT_GPU_CLIENTS_NAMESPACE", "metadata.namespace"),
    ];
    let config_hash = match custom_config {
        Some(_) => {
            envs.push(env("CONFIG_FILE", "/mig-parted-config/config.yaml"));
            facts
                .mig_config
                .as_ref()
                .map(|cm| common::config_hash(&cm.data))
        }
        None => {
            // mig-manager generates layouts from the hardware and falls back to these only
            // when it finds no profiles.
            envs.push(env(
                "DEFAULT_CONFIG_FILE",
                "/mig-parted-config/config-default.yaml",
            ));
            let data = BTreeMap::from([(CONFIG_KEY.to_owned(), default_mig_config())]);
            let hash = common::config_hash(&data);
            objects.config_maps.push(common::config_map(
                Operand::MigManager,
                DEFAULT_CONFIG_MAP,
                data,
                facts,
            ));
            Some(hash)
        }
    };
    if custom_clients.is_none() {
        objects.config_maps.push(common::config_map(
            Operand::MigManager,
            DEFAULT_GPU_CLIENTS,
            BTreeMap::from([(CLIENTS_KEY.to_owned(), default_clients())]),
            facts,
        ));
    }
    if common::cdi_enabled(spec) {
        envs.push(env("CDI_ENABLED", "true"));
        if spec.is_enabled(Component::Toolkit) {
            let hook =
                common::join_path(common::toolkit_install_dir(spec), "toolkit/nvidia-cdi-hook");
            envs.push(env("NVIDIA_CDI_HOOK_PATH", &hook));
        }
    }
    merge_user_env(&mut envs, manager.container.env.as_ref());

    let config_volume = match custom_config {
        Some(name) => common::config_map_volume(MIG_PARTED_CONFIG, name, None, &[]),
        None => common::config_map_volume(
            MIG_PARTED_CONFIG,
            DEFAULT_CONFIG_MAP,
            None,
            &[(CONFIG_KEY, "config-default.yaml")],
        ),
    };
    let volumes = vec![
        common::config_map_volume(
            ENTRYPOINT_CONFIG_MAP,
            &common::script_config_map_name(ENTRYPOINT_CONFIG_MAP, ENTRYPOINT_KEY, ENTRYPOINT),
            Some(0o700),
            &[],
        ),
        host_path_volume(HOST_SYS, "/sys", HostPathType::Directory),
        host_path_volume(
            VALIDATIONS_VOLUME,
            VALIDATIONS_DIR,
            HostPathType::DirectoryOrCreate,
        ),
        host_path_volume(
            DRIVER_INSTALL_DIR_VOLUME,
            common::DEFAULT_DRIVER_INSTALL_DIR,
            HostPathType::DirectoryOrCreate,
        ),
        host_path_volume(HOST_ROOT_VOLUME, "/", HostPathType::Any),
        common::config_map_volume(
            GPU_CLIENTS,
            custom_clients.unwrap_or(DEFAULT_GPU_CLIENTS),
            None,
            &[],
        ),
        config_volume,
        host_path_volume(CDI_ROOT, "/var/run/cdi", HostPathType::DirectoryOrCreate),
    ];
    let main = Container {
        env: Some(envs),
        volume_mounts: Some(vec![
            mount(ENTRYPOINT_CONFIG_MAP, "/bin/entrypoint.sh")
                .sub_path(ENTRYPOINT_KEY)
                .read_only(),
            mount(HOST_SYS, "/sys"),
            mount(VALIDATIONS_VOLUME, VALIDATIONS_DIR),
            mount(DRIVER_INSTALL_DIR_VOLUME, "/driver-root").host_to_container(),
            // Writable: mig-manager chroots here to stop and start host GPU clients.
            mount(HOST_ROOT_VOLUME, "/host").host_to_container(),
            mount(GPU_CLIENTS, "/gpu-clients"),
            mount(MIG_PARTED_CONFIG, "/mig-parted-config"),
            mount(CDI_ROOT, "/var/run/cdi"),
        ]),
        security_context: Some(common::privileged()),
        ..common::container(
            MAIN_CONTAINER,
            &common::image(policy, ImageKind::MigManager),
            &["/bin/sh", "-c"],
            &["/bin/entrypoint.sh"],
        )
    };
    let pod = PodSpec {
        service_account_name: Some(SERVICE_ACCOUNT.to_owned()),
        host_pid: Some(true),
        host_ipc: Some(true),
        init_containers: Some(vec![validator::wait_for_toolkit_saying(
            policy,
            mount(VALIDATIONS_VOLUME, VALIDATIONS_DIR).host_to_container(),
            validator::WAITING_FOR_TOOLKIT,
        )]),
        containers: vec![main],
        volumes: Some(volumes),
        ..PodSpec::default()
    };
    let mut ds = OperandDaemonSet::new(Operand::MigManager, NAME, pod, MAIN_CONTAINER);
    ds.image = Some(&manager.image);
    ds.host_network = manager.host_network.unwrap_or(false);
    ds.overrides = Some(&manager.container);
    ds.gpu_access = GpuAccess::Runtime {
        nri_container: MAIN_CONTAINER,
    };
    ds.config_hash = config_hash;

    let role_rules = openshift::use_privileged_scc(facts)
        .into_iter()
        .chain([
            // It waits for operand pods to leave and deletes validator pods after a change
            // (polling: no watch); the confinement policy keeps deletes to its node's pods.
            rule(&[""], &["pods"], &["get", "list", "delete"]),
            // It publishes the layouts it generated as <node>-mig-config, and writes no other
            // ConfigMap (the confinement policy).
            rule(&[""], &["configmaps"], &["create", "get", "update"]),
        ])
        .collect();
    common::add_identity(
        &mut objects,
        Operand::MigManager,
        SERVICE_ACCOUNT,
        role_rules,
        vec![
            // It writes mig.config.state and pauses operands through their deploy labels, on
            // its own node only (the confinement policy), always by merge patch.
            rule(&[""], &["nodes"], &["get", "list", "watch", "patch"]),
            rule(&[""], &["pods"], &["list"]),
        ],
        facts,
    );
    objects.config_maps.insert(
        0,
        common::script_config_map(
            Operand::MigManager,
            ENTRYPOINT_CONFIG_MAP,
            (ENTRYPOINT_KEY, ENTRYPOINT),
            &[(common::APP_LABEL, NAME)],
            facts,
        ),
    );
    objects.dynamic.extend(confinement(facts));
    objects
        .daemon_sets
        .push(common::operand_daemon_set(policy, facts, ds));
    objects.dynamic.extend(openshift::scc(
        Operand::MigManager,
        SERVICE_ACCOUNT,
        openshift::HostAccess {
            pid: true,
            ipc: true,
            ..Default::default()
        },
        facts,
    ));
    Some(objects)
}

/// What validate says about mig-manager's input: the ConfigMap `migManager.config.name` names
/// must exist with its key, and the layouts in it (or in the default) must parse as mig-parted
/// reads them (decision 7).
pub fn check(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Vec<String> {
    if let Some(name) = spec.mig_manager.as_ref().and_then(custom_config_name)
        && let Some(problem) = config_map_problem(
            "spec.migManager.config.name",
            name,
            CONFIG_KEY,
            facts.mig_config.as_ref(),
            facts,
            "or remove the field to use the default layouts",
        )
    {
        return vec![problem];
    }
    match layouts(facts) {
        Ok(_) => Vec::new(),
        Err(found) => vec![
            found
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        ],
    }
}

/// The layouts mig-manager applies: the named ConfigMap's, else the default ones.
pub fn layouts(
    facts: &ClusterFacts,
) -> Result<mig::MigConfigFile, Vec<crate::sharing::ConfigProblem>> {
    // The default layouts are parsed once (a test proves they parse).
    static DEFAULT: std::sync::OnceLock<
        Result<mig::MigConfigFile, Vec<crate::sharing::ConfigProblem>>,
    > = std::sync::OnceLock::new();
    match &facts.mig_config {
        Some(cm) => mig::parse_config(&cm.name, &cm.data),
        None => DEFAULT
            .get_or_init(|| {
                mig::parse_yaml(DEFAULT_CONFIG_MAP, CONFIG_KEY, default_mig_config_text())
            })
            .clone(),
    }
}

/// Reported while mig-manager still renders: GPU nodes asking for a layout that does not fit
/// their GPUs, or where mig-manager gave up (decision 7).
pub fn report(facts: &ClusterFacts) -> Option<String> {
    let file = layouts(facts).ok()?;
    let gpu_nodes: Vec<&NodeView> = facts.gpu_nodes.iter().map(AsRef::as_ref).collect();
    mig::node_report(&file, &gpu_nodes)
}

/// mig-manager runs privileged on every MIG node: its token may patch its own node, publish
/// its own node's `<node>-mig-config`, and delete pods of its own node, nothing beyond (not
/// the entrypoints and configs other nodes' privileged pods run, nor their pods).
fn confinement(facts: &ClusterFacts) -> Vec<kube_core::DynamicObject> {
    let config_maps = common::Confinement {
        group: "",
        resources: &["configmaps"],
        operations: &["CREATE", "UPDATE", "DELETE"],
        checks: vec![(
            format!(
                "request.operation != 'DELETE' && \
                 object.metadata.name == variables.callerNode + '{NODE_CONFIG_MAP_SUFFIX}'"
            ),
            format!(
                "'the only ConfigMap it may write is <its node>{NODE_CONFIG_MAP_SUFFIX}, not ' + \
                 request.name"
            ),
        )],
    };
    let pods = common::Confinement {
        group: "",
        resources: &["pods"],
        operations: &["DELETE"],
        checks: vec![(
            "oldObject.spec.?nodeName.orValue('') == variables.callerNode".to_owned(),
            "'only pods on the node of the caller may be deleted, not ' + request.name".to_owned(),
        )],
    };
    common::confinement_policy(
        Operand::MigManager,
        CONFINEMENT_POLICY,
        &[SERVICE_ACCOUNT],
        &[common::own_node_writes(), config_maps, pods],
        facts,
    )
}
