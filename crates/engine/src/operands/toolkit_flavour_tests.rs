//! Render tests of the toolkit per runtime flavour: on a host root laid out as each
//! distribution lays it out, the rendered variables and hostPath mounts reach, inside the pod,
//! the files that distribution's runtime reads; mixed fleets get one DaemonSet per flavour.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use super::test_support::*;
use crate::facts::{NodeRuntime, ReadOnlyImage, RuntimeFlavour};
use crate::nodes::RUNTIME_FLAVOUR;

/// One distribution's layout, written down from its documentation (docs/operand-facts.md
/// §6.1), independently of the render's table: the file its runtime reads that the toolkit
/// writes, the file holding the effective config, and the socket.
struct Layout {
    flavour: RuntimeFlavour,
    config: &'static str,
    source: Option<&'static str>,
    socket: &'static str,
}

const LAYOUTS: [Layout; 7] = [
    Layout {
        flavour: RuntimeFlavour::Containerd,
        config: "/etc/containerd/config.toml",
        source: None,
        socket: "/run/containerd/containerd.sock",
    },
    Layout {
        flavour: RuntimeFlavour::K3s,
        config: "/var/lib/rancher/k3s/agent/etc/containerd/config.toml.tmpl",
        source: Some("/var/lib/rancher/k3s/agent/etc/containerd/config.toml"),
        socket: "/run/k3s/containerd/containerd.sock",
    },
    Layout {
        flavour: RuntimeFlavour::K3sV3,
        config: "/var/lib/rancher/k3s/agent/etc/containerd/config-v3.toml.tmpl",
        source: Some("/var/lib/rancher/k3s/agent/etc/containerd/config.toml"),
        socket: "/run/k3s/containerd/containerd.sock",
    },
    Layout {
        flavour: RuntimeFlavour::Rke2,
        config: "/var/lib/rancher/rke2/agent/etc/containerd/config.toml.tmpl",
        source: Some("/var/lib/rancher/rke2/agent/etc/containerd/config.toml"),
        socket: "/run/k3s/containerd/containerd.sock",
    },
    Layout {
        flavour: RuntimeFlavour::K0s,
        config: "/etc/k0s/containerd.d/nvidia.toml",
        source: Some("/etc/k0s/containerd.d/nvidia.toml"),
        socket: "/run/k0s/containerd.sock",
    },
    Layout {
        flavour: RuntimeFlavour::MicroK8s,
        config: "/var/snap/microk8s/current/args/containerd-template.toml",
        source: Some("/var/snap/microk8s/current/args/containerd-template.toml"),
        socket: "/var/snap/microk8s/common/run/containerd.sock",
    },
    Layout {
        flavour: RuntimeFlavour::Docker,
        config: "/etc/docker/daemon.json",
        source: None,
        socket: "/var/run/docker.sock",
    },
];

fn fleet(nodes: &[(&str, NodeRuntime)]) -> ClusterFacts {
    ClusterFacts {
        node_runtimes: nodes.iter().map(|(n, r)| ((*n).to_owned(), *r)).collect(),
        ..facts()
    }
}

/// A fresh host root with the distribution's directories, socket and effective config.
fn host_root(layout: &Layout) -> PathBuf {
    let root = std::env::temp_dir().join(format!(
        "gpu-operator-toolkit-{}-{}",
        std::process::id(),
        layout.flavour.label()
    ));
    let _ = std::fs::remove_dir_all(&root);
    let at = |p: &str| root.join(p.trim_start_matches('/'));
    for file in [Some(layout.socket), layout.source].into_iter().flatten() {
        std::fs::create_dir_all(at(file).parent().unwrap()).unwrap();
        std::fs::write(at(file), "").unwrap();
    }
    std::fs::create_dir_all(at(layout.config).parent().unwrap()).unwrap();
    root
}

/// Where a path inside the main container lands on the host: through the mount with the
/// longest matching mount path to its volume's hostPath.
fn host_path_of(pod: &PodSpec, c: &Container, ctr_path: &str) -> String {
    let mounts = c.volume_mounts.as_ref().unwrap();
    let mount = mounts
        .iter()
        .filter(|m| ctr_path.starts_with(m.mount_path.trim_end_matches('/')))
        .max_by_key(|m| m.mount_path.len())
        .unwrap_or_else(|| panic!("{ctr_path} is mounted nowhere"));
    let volume = pod
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.name == mount.name)
        .unwrap();
    let host = &volume.host_path.as_ref().unwrap().path;
    let rest = &ctr_path[mount.mount_path.trim_end_matches('/').len()..];
    format!(
        "{}/{}",
        host.trim_end_matches('/'),
        rest.trim_start_matches('/')
    )
}

fn on_root(root: &Path, host: &str) -> PathBuf {
    root.join(host.trim_start_matches('/'))
}

#[test]
fn each_flavour_writes_and_talks_to_the_files_its_runtime_reads() {
    for layout in &LAYOUTS {
        let root = host_root(layout);
        let f = fleet(&[("gpu-a", NodeRuntime::Flavour(layout.flavour))]);
        let p = pod(&daemon_set("{}", &f, Operand::Toolkit));
        let c = container(&p, "nvidia-container-toolkit-ctr");
        let name = layout.flavour.label();

        let config = host_path_of(&p, &c, &env(&c, "RUNTIME_CONFIG").unwrap());
        assert_eq!(config, layout.config, "{name}: config");
        assert!(
            on_root(&root, &config).parent().unwrap().is_dir(),
            "{name}: the config's directory is mounted from where the runtime keeps it"
        );
        let socket_var = if layout.flavour == RuntimeFlavour::Docker {
            "DOCKER_SOCKET"
        } else {
            "CONTAINERD_SOCKET"
        };
        let socket = host_path_of(&p, &c, &env(&c, socket_var).unwrap());
        assert_eq!(socket, layout.socket, "{name}: socket");
        assert!(on_root(&root, &socket).exists(), "{name}: socket exists");
        assert_eq!(env(&c, "RUNTIME_SOCKET"), env(&c, socket_var), "{name}");

        // The effective config is read through the read-only host root at /host.
        let source = env(&c, "RUNTIME_CONFIG_SOURCE");
        match layout.source {
            Some(file) => {
                let ctr = source.as_deref().unwrap().strip_prefix("file=").unwrap();
                let host = host_path_of(&p, &c, ctr);
                assert_eq!(host.trim_start_matches('/'), file.trim_start_matches('/'));
                assert!(on_root(&root, &host).exists(), "{name}: config source");
                // A distribution that imports no drop-in: the toolkit writes the file itself.
                assert_eq!(env(&c, "RUNTIME_DROP_IN_CONFIG").as_deref(), Some(""));
            }
            None => assert_eq!(source, None, "{name}: stock runtimes are dumped"),
        }
        let _ = std::fs::remove_dir_all(&root);
    }
}

#[test]
fn a_mixed_fleet_gets_one_daemon_set_per_flavour_each_on_its_nodes() {
    use RuntimeFlavour::*;
    let f = fleet(&[
        ("gpu-k3s", NodeRuntime::Flavour(K3sV3)),
        ("gpu-rke2", NodeRuntime::Flavour(Rke2)),
        ("gpu-containerd", NodeRuntime::Flavour(Containerd)),
        ("gpu-crio", NodeRuntime::Flavour(CriO)),
    ]);
    let daemon_sets = objects("{}", &f, Operand::Toolkit).daemon_sets;
    let found: Vec<(String, String)> = daemon_sets
        .iter()
        .map(|ds| {
            let selector = pod(ds).node_selector.unwrap();
            (
                ds.metadata.name.clone().unwrap(),
                selector[RUNTIME_FLAVOUR].clone(),
            )
        })
        .collect();
    assert_eq!(
        found,
        [
            ("nvidia-container-toolkit-daemonset", "containerd"),
            (
                "nvidia-container-toolkit-daemonset-k3s-containerd2",
                "k3s-containerd2"
            ),
            ("nvidia-container-toolkit-daemonset-rke2", "rke2"),
            ("nvidia-container-toolkit-daemonset-crio", "crio"),
        ]
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
    );
    // Each keeps its own app label and selector, so none adopts another's pods.
    for ds in &daemon_sets {
        let name = ds.metadata.name.as_deref().unwrap();
        let selector = ds
            .spec
            .as_ref()
            .unwrap()
            .selector
            .match_labels
            .as_ref()
            .unwrap();
        assert_eq!(selector["app"], name);
    }
}

#[test]
fn a_fleet_of_one_flavour_keeps_the_single_unselected_daemon_set() {
    let f = fleet(&[
        ("a", NodeRuntime::Flavour(RuntimeFlavour::K3s)),
        ("b", NodeRuntime::Flavour(RuntimeFlavour::K3s)),
    ]);
    let daemon_sets = objects("{}", &f, Operand::Toolkit).daemon_sets;
    assert_eq!(daemon_sets.len(), 1);
    assert_eq!(
        daemon_sets[0].metadata.name.as_deref(),
        Some("nvidia-container-toolkit-daemonset")
    );
    let selector = pod(&daemon_sets[0]).node_selector.unwrap();
    assert!(!selector.contains_key(RUNTIME_FLAVOUR), "{selector:?}");
}

#[test]
fn the_flavour_the_live_daemon_set_configures_keeps_the_plain_name() {
    use RuntimeFlavour::*;
    // The fleet ran k3s only; a stock containerd node joins: k3s keeps the running name.
    let mut f = fleet(&[("a", NodeRuntime::Flavour(K3s))]);
    let live = daemon_set("{}", &f, Operand::Toolkit);
    assert_eq!(super::toolkit_flavour::live_flavour(&live), Some(K3s));
    f.node_runtimes
        .insert("b".to_owned(), NodeRuntime::Flavour(Containerd));
    f.live_toolkit_flavour = Some(K3s);
    let names: Vec<String> = objects("{}", &f, Operand::Toolkit)
        .daemon_sets
        .iter()
        .map(|ds| ds.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "nvidia-container-toolkit-daemonset-containerd",
            "nvidia-container-toolkit-daemonset"
        ]
    );
}

#[test]
fn read_only_nodes_get_no_toolkit_and_status_says_what_to_use_instead() {
    let f = fleet(&[
        ("gpu-a", NodeRuntime::Flavour(RuntimeFlavour::Containerd)),
        ("gpu-br", NodeRuntime::ReadOnly(ReadOnlyImage::Bottlerocket)),
    ]);
    let daemon_sets = objects("{}", &f, Operand::Toolkit).daemon_sets;
    assert_eq!(daemon_sets.len(), 1);
    assert_eq!(
        pod(&daemon_sets[0]).node_selector.unwrap()[RUNTIME_FLAVOUR],
        "containerd"
    );
    let policy = policy_with("{}", &f);
    let report = super::toolkit_flavour::report(&policy.spec, &f).unwrap();
    assert!(report.contains("gpu-br (Bottlerocket)"), "{report}");
    assert!(report.contains("toolkit.enabled=false"), "{report}");
}

#[test]
fn a_user_path_wins_and_status_names_the_override() {
    let f = fleet(&[("gpu-a", NodeRuntime::Flavour(RuntimeFlavour::K3s))]);
    let spec = "toolkit: {env: [{name: CONTAINERD_CONFIG, value: /srv/k3s/config.toml.tmpl}]}";
    let p = pod(&daemon_set(spec, &f, Operand::Toolkit));
    let c = container(&p, "nvidia-container-toolkit-ctr");
    assert_eq!(
        host_path_of(&p, &c, &env(&c, "RUNTIME_CONFIG").unwrap()),
        "/srv/k3s/config.toml.tmpl"
    );
    let policy = policy_with(spec, &f);
    let report = super::toolkit_flavour::report(&policy.spec, &f).unwrap();
    assert!(
        report.contains("CONTAINERD_CONFIG=/srv/k3s/config.toml.tmpl overrides the detected /var/lib/rancher/k3s/agent/etc/containerd/config.toml.tmpl for the k3s nodes gpu-a"),
        "{report}"
    );
    // Without a detected flavour there is nothing to override.
    assert_eq!(super::toolkit_flavour::report(&policy.spec, &facts()), None);
}
