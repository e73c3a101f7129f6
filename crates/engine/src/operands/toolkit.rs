//! Render stage, container toolkit (pure, no IO): DaemonSet
//! `nvidia-container-toolkit-daemonset` that installs the NVIDIA runtime and CDI specs and
//! configures each GPU node's container runtime where that node's distribution keeps it (config
//! files and socket mounted per runtime flavour, one DaemonSet per flavour in a mixed fleet:
//! operands::toolkit_flavour), gated by the driver validation (docs/operand-facts.md §6).

use k8s_openapi::api::core::v1::{Container, EnvVar, PodSpec};

use super::common::{
    self, DRIVER_INSTALL_DIR_VOLUME, HOST_DEV_CHAR_VOLUME, HOST_ROOT_VOLUME, HostPathType,
    MountExt, OperandDaemonSet, VALIDATIONS_DIR, env, env_field, env_value, host_path_volume,
    merge_user_env, mount, rule, set_env,
};
use super::openshift;
use super::toolkit_flavour;
use super::validator::{self, VALIDATIONS_VOLUME};
use crate::api::{ClusterPolicySpec, Component, ImageKind, ToolkitSpec};
use crate::facts::{ClusterFacts, Runtime, RuntimeFlavour};
use crate::model::ValidatedPolicy;
use crate::model::{Operand, OperandObjects};

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "container-toolkit",
    component: Some(Component::Toolkit),
    deploy_label: Some(crate::nodes::DEPLOY_TOOLKIT),
    consumes_sharing_config: false,
    enabled: super::Enabled::BySwitch,
    images: |_, _| vec![ImageKind::Toolkit, ImageKind::Validator],
    host_paths: install_dir_host_path,
    render,
    check: super::defaults::no_check,
    report: toolkit_flavour::report,
};

/// DaemonSet name and `app` label.
pub const NAME: &str = "nvidia-container-toolkit-daemonset";
/// ServiceAccount and Role name.
pub const SERVICE_ACCOUNT: &str = "nvidia-container-toolkit";
pub const MAIN_CONTAINER: &str = "nvidia-container-toolkit-ctr";
/// ConfigMap (and volume) holding the main container's entrypoint.
pub const ENTRYPOINT_CONFIG_MAP: &str = "nvidia-container-toolkit-entrypoint";
const ENTRYPOINT_KEY: &str = "entrypoint.sh";

const TOOLKIT_ROOT: &str = "toolkit-root";
const TOOLKIT_INSTALL_DIR: &str = "toolkit-install-dir";
const CRIO_HOOKS: &str = "crio-hooks";
const CDI_ROOT: &str = "cdi-root";
const NRI_SOCKET_VOLUME: &str = "nri-socket";
const DEFAULT_NRI_SOCKET: &str = "/var/run/nri/nri.sock";

/// Container-side directories the runtime's host files are mounted under.
const CONFIG_DIR_CTR: &str = "/runtime/config-dir/";
const DROP_IN_DIR_CTR: &str = "/runtime/config-dir.d/";
const SOCKET_DIR_CTR: &str = "/runtime/sock-dir/";
const NRI_DIR_CTR: &str = "/runtime/nri-sock-dir/";

/// The entrypoint (our script): wait for the driver validation, take over the driver roots it
/// found, give containerd time to settle after a restart, then run the toolkit installer.
const ENTRYPOINT: &str = r#"#!/bin/sh
# Entrypoint of the NVIDIA container toolkit (rendered by gpu-operator).
ready=/run/nvidia/validations/driver-ready
until [ -f "$ready" ]; do
  echo "waiting for the driver validation ($ready)"
  sleep 5
done
set -a
. "$ready"
set +a
# containerd >= 1.6.9 may still be restarting from an earlier configuration change.
sleep 5
exec nvidia-toolkit
"#;

/// One host file of the runtime's configuration, mounted through its directory.
struct HostFile {
    volume: &'static str,
    host: String,
    ctr_dir: &'static str,
    kind: HostPathType,
}

impl HostFile {
    fn dir(&self) -> &str {
        match self.host.rfind('/') {
            Some(0) => "/",
            Some(i) => &self.host[..i],
            None => ".",
        }
    }
    fn ctr_path(&self) -> String {
        let file = self.host.rsplit('/').next().unwrap_or_default();
        format!("{}{file}", self.ctr_dir)
    }
}

/// The first of `names` the user set to a non-empty host path, else `default`.
fn user_path(envs: &[EnvVar], names: &[&str], default: &str) -> String {
    names
        .iter()
        .find_map(|n| env_value(envs, n).filter(|v| !v.is_empty()))
        .unwrap_or(default)
        .to_owned()
}

/// Volume names and toolkit variables of one runtime (NVIDIA's names, kept for every flavour).
struct RuntimeNames {
    config_volume: &'static str,
    drop_in_volume: &'static str,
    socket_volume: &'static str,
    config_var: &'static str,
    socket_var: Option<&'static str>,
}

const fn runtime_names(runtime: Runtime) -> RuntimeNames {
    match runtime {
        Runtime::Containerd => RuntimeNames {
            config_volume: "containerd-config",
            drop_in_volume: "containerd-drop-in-config",
            socket_volume: "containerd-socket",
            config_var: "CONTAINERD_CONFIG",
            socket_var: Some("CONTAINERD_SOCKET"),
        },
        Runtime::CriO => RuntimeNames {
            config_volume: "crio-config",
            drop_in_volume: "crio-drop-in-config",
            socket_volume: "crio-socket",
            config_var: "CRIO_CONFIG",
            socket_var: None,
        },
        Runtime::Docker => RuntimeNames {
            config_volume: "docker-config",
            drop_in_volume: "docker-drop-in-config",
            socket_volume: "docker-socket",
            config_var: "DOCKER_CONFIG",
            socket_var: Some("DOCKER_SOCKET"),
        },
    }
}

/// The toolkit variables a user may set that name one of the runtime's host files, with the
/// flavour's own value of each (for [`super::toolkit_flavour::report`]).
pub fn detected_paths(flavour: RuntimeFlavour) -> Vec<(&'static str, Option<&'static str>)> {
    let paths = flavour.paths();
    let names = runtime_names(flavour.runtime());
    let mut vars = vec![
        (names.config_var, Some(paths.config)),
        ("RUNTIME_CONFIG", Some(paths.config)),
        ("RUNTIME_DROP_IN_CONFIG", paths.drop_in),
    ];
    if let Some(var) = names.socket_var {
        vars.push((var, paths.socket));
        vars.push(("RUNTIME_SOCKET", paths.socket));
    }
    vars
}

/// The runtime's configuration and socket: variables pointing the toolkit at container paths,
/// and the host directories mounted there, where `flavour` keeps them. User variables name
/// host paths (read before) and win over the flavour's.
fn runtime_files(flavour: RuntimeFlavour, envs: &mut Vec<EnvVar>) -> Vec<HostFile> {
    let paths = flavour.paths();
    let names = runtime_names(flavour.runtime());
    let config = HostFile {
        volume: names.config_volume,
        host: user_path(envs, &[names.config_var, "RUNTIME_CONFIG"], paths.config),
        ctr_dir: CONFIG_DIR_CTR,
        kind: HostPathType::DirectoryOrCreate,
    };
    let user_drop_in = env_value(envs, "RUNTIME_DROP_IN_CONFIG").filter(|v| !v.is_empty());
    let drop_in = user_drop_in.or(paths.drop_in).map(|host| HostFile {
        volume: names.drop_in_volume,
        host: host.to_owned(),
        ctr_dir: DROP_IN_DIR_CTR,
        kind: HostPathType::DirectoryOrCreate,
    });
    let socket = names
        .socket_var
        .zip(paths.socket)
        .map(|(var, default)| HostFile {
            volume: names.socket_volume,
            host: user_path(envs, &[var, "RUNTIME_SOCKET"], default),
            ctr_dir: SOCKET_DIR_CTR,
            kind: HostPathType::Any,
        });
    // Bundled containerd binaries are not on the host's PATH, so `containerd config dump`
    // cannot show the node's config: the toolkit reads the file that holds it instead.
    if let Some(source) = paths.config_source
        && env_value(envs, "RUNTIME_CONFIG_SOURCE").is_none_or(str::is_empty)
    {
        set_env(
            envs,
            env("RUNTIME_CONFIG_SOURCE", &format!("file={source}")),
        );
    }
    set_env(envs, env("RUNTIME_CONFIG", &config.ctr_path()));
    set_env(envs, env(names.config_var, &config.ctr_path()));
    let mut files = vec![config];
    // Every containerd and CRI-O flavour has a drop-in: the toolkit (1.18 and later) writes
    // its runtimes only there, and an empty path does not make it write the config file
    // instead (docs/operand-facts.md §6.1).
    if let Some(drop_in) = drop_in {
        set_env(envs, env("RUNTIME_DROP_IN_CONFIG", &drop_in.ctr_path()));
        set_env(envs, env("RUNTIME_DROP_IN_CONFIG_HOST_PATH", &drop_in.host));
        files.push(drop_in);
    }
    if let (Some(socket), Some(var)) = (socket, names.socket_var) {
        set_env(envs, env("RUNTIME_SOCKET", &socket.ctr_path()));
        set_env(envs, env(var, &socket.ctr_path()));
        files.push(socket);
    }
    files
}

/// `RUNTIME_CONFIG_SOURCE` names host files as `file=<path>`; the container sees the host
/// root under `/host`.
fn rewrite_config_source(envs: &mut [EnvVar]) {
    if let Some(var) = envs.iter_mut().find(|e| e.name == "RUNTIME_CONFIG_SOURCE")
        && let Some(value) = var.value.as_mut()
    {
        *value = value
            .split(',')
            .map(|entry| match entry.strip_prefix("file=") {
                Some(path) if !path.starts_with("/host/") => format!("file=/host{path}"),
                _ => entry.to_owned(),
            })
            .collect::<Vec<_>>()
            .join(",");
    }
}

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    if !policy.spec.is_enabled(Component::Toolkit) {
        return None;
    }
    let plan = toolkit_flavour::plan(facts);
    let mut objects = OperandObjects::default();
    let role_rules = openshift::use_privileged_scc(facts)
        .into_iter()
        .chain([rule(&["apps"], &["daemonsets"], &["list"])])
        .collect();
    common::add_identity(
        &mut objects,
        Operand::Toolkit,
        SERVICE_ACCOUNT,
        role_rules,
        Vec::new(),
        facts,
    );
    objects.config_maps.push(common::script_config_map(
        Operand::Toolkit,
        ENTRYPOINT_CONFIG_MAP,
        (ENTRYPOINT_KEY, ENTRYPOINT),
        &[(common::APP_LABEL, NAME)],
        facts,
    ));
    objects
        .daemon_sets
        .push(daemon_set(policy, facts, plan.primary));
    for flavour in plan.others {
        let mut ds = daemon_set(policy, facts, flavour);
        toolkit_flavour::select(&mut ds, flavour);
        objects.daemon_sets.push(ds);
    }
    Some(objects)
}

/// The toolkit DaemonSet for the nodes of one runtime flavour.
fn daemon_set(
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
    flavour: RuntimeFlavour,
) -> k8s_openapi::api::apps::v1::DaemonSet {
    let spec = &policy.spec;
    let runtime = flavour.runtime();
    let default_toolkit = ToolkitSpec::default();
    let toolkit = spec.toolkit.as_ref().unwrap_or(&default_toolkit);
    let install_dir = common::toolkit_install_dir(spec);
    let cdi = common::cdi_enabled(spec);
    let nri = common::nri_enabled(spec);

    let mut envs = vec![
        env("ROOT", install_dir),
        env(
            "NVIDIA_CONTAINER_RUNTIME_MODES_CDI_DEFAULT_KIND",
            "management.nvidia.com/gpu",
        ),
        // The toolkit must run under the plain runtime it is about to reconfigure.
        env("NVIDIA_VISIBLE_DEVICES", "void"),
        env("TOOLKIT_PID_FILE", "/run/nvidia/toolkit/toolkit.pid"),
        env_field("NRI_NAMESPACE", "metadata.namespace"),
    ];
    // User variables come first here: they may name non-default host paths of the runtime,
    // which the steps below turn into mounts.
    merge_user_env(&mut envs, toolkit.container.env.as_ref());
    if cdi {
        set_env(&mut envs, env("CDI_ENABLED", "true"));
        set_env(&mut envs, env("NVIDIA_RUNTIME_SET_AS_DEFAULT", "false"));
        set_env(&mut envs, env("NVIDIA_CONTAINER_RUNTIME_MODE", "cdi"));
        set_env(&mut envs, env("CRIO_CONFIG_MODE", "config"));
        if nri {
            set_env(&mut envs, env("ENABLE_NRI_PLUGIN", "true"));
        }
    } else if runtime == Runtime::CriO {
        // Without CDI, CRI-O gets the runtime through an OCI prestart hook.
        set_env(&mut envs, env("CRIO_CONFIG_MODE", "hook"));
    }
    set_env(&mut envs, env("RUNTIME", runtime.toolkit_name()));
    if runtime == Runtime::Containerd && !nri {
        set_env(
            &mut envs,
            env("CONTAINERD_RUNTIME_CLASS", common::runtime_class_name(spec)),
        );
    }

    let mut volumes = vec![
        common::config_map_volume(
            "nvidia-container-toolkit-entrypoint",
            &common::script_config_map_name(ENTRYPOINT_CONFIG_MAP, ENTRYPOINT_KEY, ENTRYPOINT),
            Some(0o700),
            &[],
        ),
        host_path_volume(
            TOOLKIT_ROOT,
            "/run/nvidia/toolkit",
            HostPathType::DirectoryOrCreate,
        ),
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
        host_path_volume(TOOLKIT_INSTALL_DIR, install_dir, HostPathType::Any),
        host_path_volume(HOST_DEV_CHAR_VOLUME, "/dev/char", HostPathType::Any),
        host_path_volume(CDI_ROOT, "/var/run/cdi", HostPathType::DirectoryOrCreate),
    ];
    let mut mounts = vec![
        mount("nvidia-container-toolkit-entrypoint", "/bin/entrypoint.sh")
            .sub_path(ENTRYPOINT_KEY)
            .read_only(),
        mount(TOOLKIT_ROOT, "/run/nvidia/toolkit"),
        mount(VALIDATIONS_VOLUME, VALIDATIONS_DIR),
        mount(DRIVER_INSTALL_DIR_VOLUME, "/driver-root").host_to_container(),
        mount(HOST_ROOT_VOLUME, "/host")
            .read_only()
            .host_to_container(),
        mount(TOOLKIT_INSTALL_DIR, install_dir),
        mount(CDI_ROOT, "/var/run/cdi"),
    ];
    if runtime == Runtime::CriO {
        // OpenShift keeps OCI hooks under /run; other CRI-O hosts under /usr/share.
        let hooks = if facts.openshift {
            "/run/containers/oci/hooks.d"
        } else {
            "/usr/share/containers/oci/hooks.d"
        };
        volumes.push(host_path_volume(CRIO_HOOKS, hooks, HostPathType::Any));
        mounts.push(mount(CRIO_HOOKS, "/usr/share/containers/oci/hooks.d"));
    }
    if nri {
        let host = user_path(&envs, &["NRI_SOCKET"], DEFAULT_NRI_SOCKET);
        let file = HostFile {
            volume: NRI_SOCKET_VOLUME,
            host,
            ctr_dir: NRI_DIR_CTR,
            kind: HostPathType::DirectoryOrCreate,
        };
        set_env(&mut envs, env("NRI_SOCKET", &file.ctr_path()));
        volumes.push(host_path_volume(file.volume, file.dir(), file.kind));
        mounts.push(mount(file.volume, file.ctr_dir));
    } else {
        for file in runtime_files(flavour, &mut envs) {
            volumes.push(host_path_volume(file.volume, file.dir(), file.kind));
            mounts.push(mount(file.volume, file.ctr_dir));
        }
    }
    rewrite_config_source(&mut envs);

    let main = Container {
        env: Some(envs),
        volume_mounts: Some(mounts),
        security_context: Some(common::privileged_s0()),
        ..common::container(
            MAIN_CONTAINER,
            &common::image(policy, ImageKind::Toolkit),
            &["/bin/sh", "-c"],
            &["/bin/entrypoint.sh"],
        )
    };
    let pod = PodSpec {
        service_account_name: Some(SERVICE_ACCOUNT.to_owned()),
        host_pid: Some(true),
        init_containers: Some(vec![validator::driver_validation(policy)]),
        containers: vec![main],
        volumes: Some(volumes),
        ..PodSpec::default()
    };
    let mut ds = OperandDaemonSet::new(Operand::Toolkit, NAME, pod, MAIN_CONTAINER);
    ds.annotations = openshift::scc_annotation(facts, "hostmount-anyuid");
    ds.image = Some(&toolkit.image);
    ds.host_network = toolkit.host_network.unwrap_or(false);
    // NVIDIA's toolkit section has no args: ours are accepted for schema parity but not applied,
    // since replacing the entrypoint would skip the driver wait.
    let overrides = crate::api::ContainerOverrides {
        args: None,
        ..toolkit.container.clone()
    };
    ds.overrides = Some(&overrides);

    common::operand_daemon_set(policy, facts, ds)
}

/// `spec.toolkit.installDir`, which the toolkit and the operands that find its binaries there
/// mount.
pub fn install_dir_host_path(spec: &ClusterPolicySpec) -> Vec<(&'static str, Option<&str>)> {
    vec![(
        "spec.toolkit.installDir",
        spec.toolkit.as_ref().and_then(|t| t.install_dir.as_deref()),
    )]
}
