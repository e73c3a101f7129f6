//! Render tests of the container toolkit: what its pods need (docs/operand-facts.md).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::test_support::*;

fn toolkit(spec: &str, runtime: Runtime) -> (PodSpec, Container) {
    let f = ClusterFacts { runtime, ..facts() };
    let p = pod(&daemon_set(spec, &f, Operand::Toolkit));
    let main = container(&p, "nvidia-container-toolkit-ctr");
    (p, main)
}

#[test]
fn toolkit_configures_containerd_through_its_config_dirs_and_socket() {
    let (p, c) = toolkit("{}", Runtime::Containerd);
    assert_eq!(env(&c, "RUNTIME").as_deref(), Some("containerd"));
    assert_eq!(
        env(&c, "CONTAINERD_CONFIG").as_deref(),
        Some("/runtime/config-dir/config.toml")
    );
    assert_eq!(
        env(&c, "RUNTIME_CONFIG").as_deref(),
        Some("/runtime/config-dir/config.toml")
    );
    assert_eq!(
        env(&c, "RUNTIME_DROP_IN_CONFIG").as_deref(),
        Some("/runtime/config-dir.d/99-nvidia.toml")
    );
    assert_eq!(
        env(&c, "RUNTIME_DROP_IN_CONFIG_HOST_PATH").as_deref(),
        Some("/etc/containerd/conf.d/99-nvidia.toml")
    );
    assert_eq!(
        env(&c, "CONTAINERD_SOCKET").as_deref(),
        Some("/runtime/sock-dir/containerd.sock")
    );
    assert_eq!(
        env(&c, "CONTAINERD_RUNTIME_CLASS").as_deref(),
        Some("nvidia")
    );
    assert_eq!(env(&c, "CDI_ENABLED").as_deref(), Some("true"));
    assert_eq!(
        env(&c, "NVIDIA_CONTAINER_RUNTIME_MODE").as_deref(),
        Some("cdi")
    );
    assert_eq!(env(&c, "NVIDIA_VISIBLE_DEVICES").as_deref(), Some("void"));
    assert_eq!(host_path(&p, "containerd-config").0, "/etc/containerd");
    assert_eq!(
        host_path(&p, "containerd-drop-in-config").0,
        "/etc/containerd/conf.d"
    );
    assert_eq!(
        host_path(&p, "containerd-socket"),
        ("/run/containerd".to_owned(), None)
    );
    assert_eq!(mount_path(&c, "containerd-socket"), "/runtime/sock-dir/");
    assert_eq!(p.host_pid, Some(true));
    assert_eq!(p.runtime_class_name, None);
    assert_eq!(p.init_containers.unwrap()[0].name, "driver-validation");
}

#[test]
fn toolkit_reads_user_host_paths_before_pointing_the_toolkit_at_container_paths() {
    let spec = "{toolkit: {env: [{name: CONTAINERD_CONFIG, value: /var/lib/rancher/k3s/agent/etc/containerd/config.toml}, \
                {name: CONTAINERD_SOCKET, value: /run/k3s/containerd/containerd.sock}, \
                {name: RUNTIME_CONFIG_SOURCE, value: 'command,file=/etc/containerd/config.toml'}]}}";
    let (p, c) = toolkit(spec, Runtime::Containerd);
    assert_eq!(
        host_path(&p, "containerd-config").0,
        "/var/lib/rancher/k3s/agent/etc/containerd"
    );
    assert_eq!(host_path(&p, "containerd-socket").0, "/run/k3s/containerd");
    assert_eq!(
        env(&c, "CONTAINERD_CONFIG").as_deref(),
        Some("/runtime/config-dir/config.toml")
    );
    assert_eq!(
        env(&c, "RUNTIME_CONFIG_SOURCE").as_deref(),
        Some("command,file=/host/etc/containerd/config.toml")
    );
}

#[test]
fn toolkit_configures_crio_without_a_socket_and_with_a_hook_when_cdi_is_off() {
    let (p, c) = toolkit("{}", Runtime::CriO);
    assert_eq!(env(&c, "RUNTIME").as_deref(), Some("crio"));
    assert_eq!(
        env(&c, "CRIO_CONFIG").as_deref(),
        Some("/runtime/config-dir/config.toml")
    );
    assert_eq!(env(&c, "CRIO_CONFIG_MODE").as_deref(), Some("config"));
    assert_eq!(env(&c, "CONTAINERD_RUNTIME_CLASS"), None);
    assert_eq!(env(&c, "RUNTIME_SOCKET"), None);
    assert_eq!(
        host_path(&p, "crio-drop-in-config").0,
        "/etc/crio/crio.conf.d"
    );
    assert_eq!(
        host_path(&p, "crio-hooks").0,
        "/usr/share/containers/oci/hooks.d"
    );
    let (_, c) = toolkit("{cdi: {enabled: false}}", Runtime::CriO);
    assert_eq!(env(&c, "CRIO_CONFIG_MODE").as_deref(), Some("hook"));
    assert_eq!(env(&c, "CDI_ENABLED"), None);
}

#[test]
fn toolkit_configures_docker_through_daemon_json_and_its_socket() {
    let (p, c) = toolkit("{}", Runtime::Docker);
    assert_eq!(env(&c, "RUNTIME").as_deref(), Some("docker"));
    assert_eq!(
        env(&c, "DOCKER_CONFIG").as_deref(),
        Some("/runtime/config-dir/daemon.json")
    );
    assert_eq!(
        env(&c, "DOCKER_SOCKET").as_deref(),
        Some("/runtime/sock-dir/docker.sock")
    );
    assert_eq!(host_path(&p, "docker-socket").0, "/var/run");
    assert!(
        !p.volumes
            .unwrap()
            .iter()
            .any(|v| v.name.contains("drop-in"))
    );
}

#[test]
fn toolkit_with_nri_mounts_only_the_nri_socket() {
    let (p, c) = toolkit(
        "{cdi: {enabled: true, nriPluginEnabled: true}}",
        Runtime::Containerd,
    );
    assert_eq!(env(&c, "ENABLE_NRI_PLUGIN").as_deref(), Some("true"));
    assert_eq!(
        env(&c, "NRI_SOCKET").as_deref(),
        Some("/runtime/nri-sock-dir/nri.sock")
    );
    assert_eq!(env(&c, "CONTAINERD_RUNTIME_CLASS"), None);
    assert_eq!(host_path(&p, "nri-socket").0, "/var/run/nri");
    assert!(
        !p.volumes
            .unwrap()
            .iter()
            .any(|v| v.name.starts_with("containerd"))
    );
}

#[test]
fn toolkit_install_dir_moves_root_and_the_cdi_hook_path_of_its_consumers() {
    let spec = "{toolkit: {installDir: /opt/nvidia}}";
    let (p, c) = toolkit(spec, Runtime::Containerd);
    assert_eq!(env(&c, "ROOT").as_deref(), Some("/opt/nvidia"));
    assert_eq!(host_path(&p, "toolkit-install-dir").0, "/opt/nvidia");
    let plugin = container(
        &pod(&daemon_set(spec, &facts(), Operand::DevicePlugin)),
        "nvidia-device-plugin",
    );
    assert_eq!(
        env(&plugin, "NVIDIA_CDI_HOOK_PATH").as_deref(),
        Some("/opt/nvidia/toolkit/nvidia-cdi-hook")
    );
    let mig = container(
        &pod(&daemon_set(spec, &facts(), Operand::MigManager)),
        "nvidia-mig-manager",
    );
    assert_eq!(
        env(&mig, "NVIDIA_CDI_HOOK_PATH").as_deref(),
        Some("/opt/nvidia/toolkit/nvidia-cdi-hook")
    );
    let no_toolkit = container(
        &pod(&daemon_set(
            "{toolkit: {enabled: false}}",
            &facts(),
            Operand::DevicePlugin,
        )),
        "nvidia-device-plugin",
    );
    assert_eq!(env(&no_toolkit, "NVIDIA_CDI_HOOK_PATH"), None);
}
