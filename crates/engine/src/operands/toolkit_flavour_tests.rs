//! Render tests of the toolkit per runtime flavour: on a host root laid out as each
//! distribution lays it out, the rendered variables and hostPath mounts reach, inside the pod,
//! the files that distribution's runtime reads; mixed fleets get one DaemonSet per flavour.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use super::test_support::*;
use crate::facts::{NodeRuntime, ReadOnlyImage, RuntimeFlavour};
use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::DaemonSet;

use crate::nodes::{DEPLOY_DRIVER, DEPLOY_TOOLKIT, NodeView, READ_ONLY_IMAGE, TOOLKIT_HANDOVER};

fn node_with(name: &str, labels: &[(&str, &str)]) -> NodeView {
    let labels: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    NodeView::from_labels(name, None, &labels)
}

/// One distribution's layout, written down from its documentation (docs/operand-facts.md
/// §6.1), independently of the render's table: the file its runtime reads that the toolkit
/// writes, the file holding the effective config, and the socket.
struct Layout {
    flavour: RuntimeFlavour,
    config: &'static str,
    source: Option<&'static str>,
    /// `None`: the runtime reloads its configuration without a socket call (CRI-O).
    socket: Option<&'static str>,
    /// The drop-in directory's file the runtime imports, where it imports one.
    drop_in: Option<&'static str>,
}

const LAYOUTS: [Layout; 9] = [
    Layout {
        flavour: RuntimeFlavour::Containerd,
        config: "/etc/containerd/config.toml",
        source: None,
        socket: Some("/run/containerd/containerd.sock"),
        drop_in: Some("/etc/containerd/conf.d/99-nvidia.toml"),
    },
    Layout {
        flavour: RuntimeFlavour::K3s,
        config: "/var/lib/rancher/k3s/agent/etc/containerd/config.toml.tmpl",
        source: Some("/var/lib/rancher/k3s/agent/etc/containerd/config.toml"),
        socket: Some("/run/k3s/containerd/containerd.sock"),
        drop_in: Some("/var/lib/rancher/k3s/agent/etc/containerd/config.toml.d/99-nvidia.toml"),
    },
    Layout {
        flavour: RuntimeFlavour::K3sV3,
        config: "/var/lib/rancher/k3s/agent/etc/containerd/config-v3.toml.tmpl",
        source: Some("/var/lib/rancher/k3s/agent/etc/containerd/config.toml"),
        socket: Some("/run/k3s/containerd/containerd.sock"),
        drop_in: Some("/var/lib/rancher/k3s/agent/etc/containerd/config-v3.toml.d/99-nvidia.toml"),
    },
    Layout {
        flavour: RuntimeFlavour::Rke2,
        config: "/var/lib/rancher/rke2/agent/etc/containerd/config.toml.tmpl",
        source: Some("/var/lib/rancher/rke2/agent/etc/containerd/config.toml"),
        socket: Some("/run/k3s/containerd/containerd.sock"),
        drop_in: Some("/var/lib/rancher/rke2/agent/etc/containerd/config.toml.d/99-nvidia.toml"),
    },
    Layout {
        flavour: RuntimeFlavour::Rke2V3,
        config: "/var/lib/rancher/rke2/agent/etc/containerd/config-v3.toml.tmpl",
        source: Some("/var/lib/rancher/rke2/agent/etc/containerd/config.toml"),
        socket: Some("/run/k3s/containerd/containerd.sock"),
        drop_in: Some("/var/lib/rancher/rke2/agent/etc/containerd/config-v3.toml.d/99-nvidia.toml"),
    },
    Layout {
        flavour: RuntimeFlavour::CriO,
        config: "/etc/crio/config.toml",
        source: None,
        socket: None,
        drop_in: Some("/etc/crio/crio.conf.d/99-nvidia.conf"),
    },
    Layout {
        flavour: RuntimeFlavour::K0s,
        // k0s reads no top-level file the toolkit could write: only the drop-in matters.
        config: "/etc/k0s/nvidia-container-toolkit.toml",
        source: Some("/etc/k0s/containerd.toml"),
        socket: Some("/run/k0s/containerd.sock"),
        drop_in: Some("/etc/k0s/containerd.d/99-nvidia.toml"),
    },
    Layout {
        flavour: RuntimeFlavour::MicroK8s,
        config: "/var/snap/microk8s/current/args/containerd-template.toml",
        source: Some("/var/snap/microk8s/current/args/containerd-template.toml"),
        socket: Some("/var/snap/microk8s/common/run/containerd.sock"),
        drop_in: Some("/var/snap/microk8s/current/args/conf.d/99-nvidia.toml"),
    },
    Layout {
        flavour: RuntimeFlavour::Docker,
        config: "/etc/docker/daemon.json",
        source: None,
        socket: Some("/var/run/docker.sock"),
        drop_in: None,
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
    for file in [layout.socket, layout.source].into_iter().flatten() {
        std::fs::create_dir_all(at(file).parent().unwrap()).unwrap();
        std::fs::write(at(file), "").unwrap();
    }
    for dir in [Some(layout.config), layout.drop_in].into_iter().flatten() {
        std::fs::create_dir_all(at(dir).parent().unwrap()).unwrap();
    }
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
        let socket_var = match layout.flavour {
            RuntimeFlavour::Docker => "DOCKER_SOCKET",
            RuntimeFlavour::CriO => "CRIO_SOCKET",
            _ => "CONTAINERD_SOCKET",
        };
        match layout.socket {
            Some(want) => {
                let socket = host_path_of(&p, &c, &env(&c, socket_var).unwrap());
                assert_eq!(socket, want, "{name}: socket");
                assert!(on_root(&root, &socket).exists(), "{name}: socket exists");
                assert_eq!(env(&c, "RUNTIME_SOCKET"), env(&c, socket_var), "{name}");
            }
            None => {
                assert_eq!(env(&c, socket_var), None, "{name}: no socket");
                assert_eq!(env(&c, "RUNTIME_SOCKET"), None, "{name}: no socket");
            }
        }
        match layout.drop_in {
            Some(want) => {
                let ctr = env(&c, "RUNTIME_DROP_IN_CONFIG").unwrap();
                let drop_in = host_path_of(&p, &c, &ctr);
                assert_eq!(drop_in, want, "{name}: drop-in");
                assert!(
                    on_root(&root, &drop_in).parent().unwrap().is_dir(),
                    "{name}: the drop-in's directory is mounted from where the runtime reads it"
                );
                assert_eq!(
                    env(&c, "RUNTIME_DROP_IN_CONFIG_HOST_PATH").as_deref(),
                    Some(want),
                    "{name}: the host path the toolkit names in the imports"
                );
            }
            None => assert_eq!(env(&c, "RUNTIME_DROP_IN_CONFIG"), None, "{name}"),
        }

        // The effective config is read through the read-only host root at /host.
        let source = env(&c, "RUNTIME_CONFIG_SOURCE");
        match layout.source {
            Some(file) => {
                let ctr = source.as_deref().unwrap().strip_prefix("file=").unwrap();
                let host = host_path_of(&p, &c, ctr);
                assert_eq!(host.trim_start_matches('/'), file.trim_start_matches('/'));
                assert!(on_root(&root, &host).exists(), "{name}: config source");
            }
            None => assert_eq!(source, None, "{name}: stock runtimes are dumped"),
        }
        let _ = std::fs::remove_dir_all(&root);
    }
}

/// A required node affinity term as its `key In values` expressions.
type Term = Vec<(String, Vec<String>)>;

/// The nodes a DaemonSet's pods may run on, as (nodeSelector, required affinity terms).
fn placement(ds: &DaemonSet) -> (BTreeMap<String, String>, Vec<Term>) {
    let p = pod(ds);
    let terms = p
        .affinity
        .and_then(|a| a.node_affinity)
        .and_then(|n| n.required_during_scheduling_ignored_during_execution)
        .map(|r| r.node_selector_terms)
        .unwrap_or_default()
        .into_iter()
        .map(|t| {
            t.match_expressions
                .unwrap_or_default()
                .into_iter()
                .map(|e| {
                    assert_eq!(e.operator, "In");
                    (e.key, e.values.unwrap_or_default())
                })
                .collect()
        })
        .collect();
    (p.node_selector.unwrap_or_default(), terms)
}

fn names(daemon_sets: &[DaemonSet]) -> Vec<String> {
    daemon_sets
        .iter()
        .map(|ds| ds.metadata.name.clone().unwrap())
        .collect()
}

#[test]
fn a_mixed_fleet_gets_one_daemon_set_per_flavour_placed_by_the_deploy_value() {
    use RuntimeFlavour::*;
    let f = fleet(&[
        ("gpu-k3s", NodeRuntime::Flavour(K3sV3)),
        ("gpu-rke2", NodeRuntime::Flavour(Rke2)),
        ("gpu-containerd", NodeRuntime::Flavour(Containerd)),
        ("gpu-crio", NodeRuntime::Flavour(CriO)),
    ]);
    let daemon_sets = objects("{}", &f, Operand::Toolkit).daemon_sets;
    assert_eq!(
        names(&daemon_sets),
        [
            "nvidia-container-toolkit-daemonset",
            "nvidia-container-toolkit-daemonset-k3s-containerd2",
            "nvidia-container-toolkit-daemonset-rke2",
            "nvidia-container-toolkit-daemonset-crio",
        ]
    );
    // The primary keeps NVIDIA's selector; each other selects its flavour's deploy value, or
    // a node it is handing over.
    let (selector, terms) = placement(&daemon_sets[0]);
    assert_eq!(selector[DEPLOY_TOOLKIT], "true");
    assert!(terms.is_empty(), "{terms:?}");
    for (ds, flavour) in daemon_sets[1..]
        .iter()
        .zip(["k3s-containerd2", "rke2", "crio"])
    {
        let (selector, terms) = placement(ds);
        assert!(!selector.contains_key(DEPLOY_TOOLKIT), "{selector:?}");
        assert_eq!(
            terms,
            [DEPLOY_TOOLKIT, TOOLKIT_HANDOVER]
                .map(|k| vec![(k.to_owned(), vec![flavour.to_owned()])])
        );
    }
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
fn a_flavour_joining_changes_nothing_the_running_daemon_set_runs() {
    use RuntimeFlavour::*;
    let mut f = fleet(&[
        ("a", NodeRuntime::Flavour(K3s)),
        ("b", NodeRuntime::Flavour(K3s)),
    ]);
    let alone = objects("{}", &f, Operand::Toolkit).daemon_sets;
    assert_eq!(names(&alone), ["nvidia-container-toolkit-daemonset"]);
    f.live_toolkit_flavour = super::toolkit_flavour::live_flavour(&alone[0]);
    assert_eq!(f.live_toolkit_flavour, Some(K3s));
    // A stock containerd node and a CRI-O node join: k3s keeps the running name and the
    // running DaemonSet is the same object, so none of its pods restarts.
    f.node_runtimes
        .insert("c".to_owned(), NodeRuntime::Flavour(Containerd));
    f.node_runtimes
        .insert("d".to_owned(), NodeRuntime::Flavour(CriO));
    let mixed = objects("{}", &f, Operand::Toolkit).daemon_sets;
    assert_eq!(
        names(&mixed),
        [
            "nvidia-container-toolkit-daemonset",
            "nvidia-container-toolkit-daemonset-containerd",
            "nvidia-container-toolkit-daemonset-crio",
        ]
    );
    assert_eq!(mixed[0], alone[0]);
}

#[test]
fn a_flavour_still_handing_nodes_over_keeps_its_daemon_set() {
    use RuntimeFlavour::*;
    // The last k3s node was re-imaged to containerd 2; its k3s pod stays until the new one
    // is ready, so the k3s DaemonSet stays too.
    let mut f = fleet(&[
        ("a", NodeRuntime::Flavour(Containerd)),
        ("b", NodeRuntime::Flavour(K3sV3)),
    ]);
    f.gpu_nodes = vec![Arc::new(node_with(
        "b",
        &[
            (DEPLOY_TOOLKIT, "k3s-containerd2"),
            (TOOLKIT_HANDOVER, "k3s"),
        ],
    ))];
    assert_eq!(
        names(&objects("{}", &f, Operand::Toolkit).daemon_sets),
        [
            "nvidia-container-toolkit-daemonset",
            "nvidia-container-toolkit-daemonset-k3s",
            "nvidia-container-toolkit-daemonset-k3s-containerd2",
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
    assert_eq!(names(&daemon_sets), ["nvidia-container-toolkit-daemonset"]);
    let policy = policy_with("{}", &f);
    let report = super::toolkit_flavour::report(&policy.spec, &f).unwrap();
    assert!(report.contains("gpu-br (Bottlerocket)"), "{report}");
    assert!(report.contains("toolkit.enabled=false"), "{report}");
}

/// A GPU node's labels after the label stage's deploy labels and toolkit placement.
fn placed(
    labels: &[(&str, &str)],
    runtime: Option<NodeRuntime>,
    ready: &[&str],
) -> BTreeMap<String, Option<String>> {
    use crate::nodes::desired_label_changes;
    let node = node_with("n", labels);
    let base = desired_label_changes(&node, None, std::time::Duration::from_secs(60));
    let ready = |ds: &str| ready.contains(&ds);
    let patch = super::toolkit_flavour::place(
        &node,
        base,
        &super::toolkit_flavour::Placement {
            primary: RuntimeFlavour::Containerd,
            runtime,
            ready: &ready,
        },
    );
    patch
        .into_iter()
        .filter(|(k, _)| [DEPLOY_TOOLKIT, TOOLKIT_HANDOVER, DEPLOY_DRIVER].contains(&k.as_str()))
        .collect()
}

fn gpu<'a>(extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut labels = vec![("feature.node.kubernetes.io/pci-10de.present", "true")];
    labels.extend_from_slice(extra);
    labels
}

fn expect(pairs: &[(&str, Option<&str>)]) -> BTreeMap<String, Option<String>> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.map(str::to_owned)))
        .collect()
}

const K3S: Option<NodeRuntime> = Some(NodeRuntime::Flavour(RuntimeFlavour::K3s));
const K3S_V3: Option<NodeRuntime> = Some(NodeRuntime::Flavour(RuntimeFlavour::K3sV3));
const STOCK: Option<NodeRuntime> = Some(NodeRuntime::Flavour(RuntimeFlavour::Containerd));

#[test]
fn a_new_node_is_placed_on_its_flavour_once_its_runtime_is_known() {
    assert_eq!(
        placed(&gpu(&[]), None, &[]),
        expect(&[(DEPLOY_DRIVER, Some("true"))])
    );
    assert_eq!(
        placed(&gpu(&[]), STOCK, &[]),
        expect(&[
            (DEPLOY_DRIVER, Some("true")),
            (DEPLOY_TOOLKIT, Some("true"))
        ])
    );
    assert_eq!(
        placed(&gpu(&[]), K3S, &[]),
        expect(&[(DEPLOY_DRIVER, Some("true")), (DEPLOY_TOOLKIT, Some("k3s"))])
    );
}

#[test]
fn a_node_leaving_the_primary_flavour_gets_the_new_pod_before_losing_the_old() {
    let on_primary = gpu(&[(DEPLOY_TOOLKIT, "true"), (DEPLOY_DRIVER, "true")]);
    // First the incoming flavour's DaemonSet is brought beside the running one.
    assert_eq!(
        placed(&on_primary, K3S_V3, &[]),
        expect(&[(TOOLKIT_HANDOVER, Some("k3s-containerd2"))])
    );
    let both = gpu(&[
        (DEPLOY_TOOLKIT, "true"),
        (DEPLOY_DRIVER, "true"),
        (TOOLKIT_HANDOVER, "k3s-containerd2"),
    ]);
    // Nothing moves while its pod is not ready (the primary's is).
    assert_eq!(
        placed(&both, K3S_V3, &["nvidia-container-toolkit-daemonset"]),
        expect(&[])
    );
    // Then the node leaves the primary.
    assert_eq!(
        placed(
            &both,
            K3S_V3,
            &["nvidia-container-toolkit-daemonset-k3s-containerd2"]
        ),
        expect(&[
            (DEPLOY_TOOLKIT, Some("k3s-containerd2")),
            (TOOLKIT_HANDOVER, None)
        ])
    );
}

#[test]
fn a_node_moving_between_other_flavours_keeps_the_outgoing_one_until_the_new_is_ready() {
    let on_k3s = gpu(&[(DEPLOY_TOOLKIT, "k3s"), (DEPLOY_DRIVER, "true")]);
    assert_eq!(
        placed(&on_k3s, K3S_V3, &["nvidia-container-toolkit-daemonset-k3s"]),
        expect(&[
            (DEPLOY_TOOLKIT, Some("k3s-containerd2")),
            (TOOLKIT_HANDOVER, Some("k3s"))
        ])
    );
    let moving = gpu(&[
        (DEPLOY_TOOLKIT, "k3s-containerd2"),
        (DEPLOY_DRIVER, "true"),
        (TOOLKIT_HANDOVER, "k3s"),
    ]);
    assert_eq!(
        placed(&moving, K3S_V3, &["nvidia-container-toolkit-daemonset-k3s"]),
        expect(&[])
    );
    assert_eq!(
        placed(
            &moving,
            K3S_V3,
            &["nvidia-container-toolkit-daemonset-k3s-containerd2"]
        ),
        expect(&[(TOOLKIT_HANDOVER, None)])
    );
    // Into the primary: NVIDIA's `true` at once, the outgoing flavour kept by the handover.
    assert_eq!(
        placed(&on_k3s, STOCK, &[]),
        expect(&[
            (DEPLOY_TOOLKIT, Some("true")),
            (TOOLKIT_HANDOVER, Some("k3s"))
        ])
    );
}

#[test]
fn read_only_images_get_neither_toolkit_nor_driver_and_values_of_others_stay() {
    let read_only = Some(NodeRuntime::ReadOnly(ReadOnlyImage::Talos));
    assert_eq!(
        placed(&gpu(&[]), read_only, &[]),
        expect(&[
            (DEPLOY_DRIVER, Some(READ_ONLY_IMAGE)),
            (DEPLOY_TOOLKIT, Some(READ_ONLY_IMAGE))
        ])
    );
    // Re-imaged to a writable OS: both come back.
    let was = gpu(&[
        (DEPLOY_TOOLKIT, READ_ONLY_IMAGE),
        (DEPLOY_DRIVER, READ_ONLY_IMAGE),
    ]);
    assert_eq!(
        placed(&was, STOCK, &[]),
        expect(&[
            (DEPLOY_DRIVER, Some("true")),
            (DEPLOY_TOOLKIT, Some("true"))
        ])
    );
    // A `false` someone set is theirs, whatever the flavour.
    let off = gpu(&[(DEPLOY_TOOLKIT, "false"), (DEPLOY_DRIVER, "false")]);
    assert_eq!(placed(&off, K3S, &[]), expect(&[]));
    assert_eq!(placed(&off, read_only, &[]), expect(&[]));
    // Operands taken off the node: our flavour value and handover go with the rest.
    let taken_off = gpu(&[
        ("nvidia.com/gpu.deploy.operands", "false"),
        (DEPLOY_TOOLKIT, "k3s"),
        (TOOLKIT_HANDOVER, "rke2"),
    ]);
    assert_eq!(
        placed(&taken_off, K3S, &[]),
        expect(&[(DEPLOY_TOOLKIT, None), (TOOLKIT_HANDOVER, None)])
    );
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
