//! Real NFD finds the GPU nodes. The chart installed by `helm install` with
//! NFD enabled (its default) on a harness where NFD's CRDs were deleted first; the three CRDs
//! Established; then the nfd-master and nfd-workers the operator rendered run for real
//! (`e2e::nfd`, each as the pod kwok only pretends to run: its ServiceAccount's token, its args,
//! env and ConfigMap): GPU nodes created without any NFD or GFD label get
//! `feature.node.kubernetes.io/pci-10de.present=true` from nfd-master, out of the NodeFeature
//! objects the workers publish from each node's fake sysfs, and a CPU node gets its network
//! card's label and no GPU label; the operator then takes them for GPU nodes and the policy
//! becomes ready with the operands on them.
//!
//! One test at a time (`--test-threads=1`): the ClusterPolicy and the CRDs are cluster-wide.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use e2e::helm::{RELEASE, helm_ok, helm_release, release_namespace, strings};
use e2e::nfd::{MASTER, RealNfd, WORKER};
use e2e::nodes::{self, FakeNode, GpuModel, NFD_NVIDIA_PCI};
use e2e::operator::{Operator, OperatorIdentity};
use e2e::session::{self, EPHEMERAL};
use e2e::wait;
use gpu_operator::api::State;
use gpu_operator::controller::vendored_crds;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams};
use kube::{Client, ResourceExt};

/// The ClusterPolicy the chart creates.
const POLICY: &str = "cluster-policy";
/// The operator's marker for a node it runs GPU operands on.
const GPU_PRESENT: &str = "nvidia.com/gpu.present";
/// The label NFD's worker config gives the CPU nodes' network card (Amazon's ENA, 0x1d0f).
const NETWORK_CARD: &str = "feature.node.kubernetes.io/pci-1d0f.present";
/// Where nfd-master lists the labels it wrote on a node.
const MASTER_LABELS_ANNOTATION: &str = "nfd.node.kubernetes.io/feature-labels";
const TIMEOUT: Duration = Duration::from_secs(120);

fn node_features(client: &Client, namespace: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("nfd.k8s-sigs.io", "v1alpha1", "NodeFeature");
    Api::namespaced_with(client.clone(), namespace, &ApiResource::from_gvk(&gvk))
}

fn labels(node: &Node) -> BTreeMap<String, String> {
    node.metadata.labels.clone().unwrap_or_default()
}

/// Waits until every node's labels satisfy `check` (which says what is still missing).
async fn await_nodes(
    admin: &Client,
    names: &[String],
    what: &str,
    nfd: &RealNfd,
    check: impl Fn(&Node) -> Option<String>,
) -> Vec<Node> {
    let api: Api<Node> = Api::all(admin.clone());
    let check = &check;
    wait::until(TIMEOUT, what, || {
        let api = api.clone();
        async move {
            let mut found = Vec::new();
            for name in names {
                let node = api.get(name).await?;
                if let Some(missing) = check(&node) {
                    return Ok(Err(format!(
                        "{name}: {missing}; labels {:?}",
                        labels(&node)
                    )));
                }
                found.push(node);
            }
            Ok(Ok(found))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\nNFD logs:\n{}", nfd.logs()))
}

#[tokio::test]
async fn helm_install_with_real_nfd_labels_the_gpu_nodes_from_node_features_and_gets_ready() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    e2e::helm::remove_releases(&admin).await;
    // On a fresh harness too: the leftover policies are listed through it.
    e2e::crd::install_cluster_policy_crd(&admin, "e2e-nfd-real")
        .await
        .unwrap();
    session::remove_leftovers(&admin).await;
    e2e::nfd::delete_crds(&admin).await.unwrap();
    e2e::nfd::await_no_annotated_nodes(&admin).await.unwrap();

    // Nodes as they join a real cluster: no NFD or GFD label; only their fake sysfs tells.
    let fleet = vec![
        FakeNode::gpu("nfd-real-t4", GpuModel::T4),
        FakeNode::gpu("nfd-real-h100", GpuModel::H100Sxm80Gb).tainted(true),
        FakeNode::cpu("nfd-real-cpu"),
    ];
    let fleet: Vec<FakeNode> = fleet
        .into_iter()
        .map(|n| n.undiscovered().label(EPHEMERAL, "true"))
        .collect();
    nodes::create(&admin, &fleet).await.unwrap();
    let gpu_nodes: Vec<String> = fleet
        .iter()
        .filter(|n| n.gpu.is_some())
        .map(|n| n.name.clone())
        .collect();
    let cpu_node = vec!["nfd-real-cpu".to_owned()];

    let namespace = release_namespace(&admin).await;
    helm_release("install", &namespace, &[]);
    for name in vendored_crds::NAMES {
        e2e::crd::await_established(&admin, name).await.unwrap();
    }
    let identity = OperatorIdentity::existing(&admin, &namespace, "gpu-operator")
        .await
        .unwrap();
    let operator = Operator::start_as_pod(&identity, &format!("{RELEASE}-e2e")).unwrap();

    // The NFD built for the harness is the NFD the operator deploys. Its master Deployment and
    // worker DaemonSet are sent side by side: RealNfd reads both, so both are awaited.
    let worker = wait::until(
        TIMEOUT,
        "NFD worker DaemonSet and master Deployment applied",
        || {
            let workers = Api::<DaemonSet>::namespaced(admin.clone(), &namespace);
            let masters = Api::<Deployment>::namespaced(admin.clone(), &namespace);
            async move {
                let master = masters.get_opt(MASTER).await?;
                Ok(match (workers.get_opt(WORKER).await?, master) {
                    (Some(worker), Some(_)) => Ok(worker),
                    (worker, master) => Err(format!(
                        "worker applied: {}, master applied: {}",
                        worker.is_some(),
                        master.is_some()
                    )),
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    let image = worker
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|p| p.containers.first().and_then(|c| c.image.clone()))
        .unwrap();
    let pinned = e2e::cluster::pinned_version("NFD_VERSION").unwrap();
    assert!(
        image.ends_with(&format!(":{pinned}")),
        "the operator deploys {image}, the harness runs NFD {pinned} (tests/cluster/versions.env)"
    );
    for node in Api::<Node>::all(admin.clone())
        .list(&ListParams::default().labels(&format!("{EPHEMERAL}=true")))
        .await
        .unwrap()
        .items
    {
        assert!(
            !labels(&node).contains_key(NFD_NVIDIA_PCI),
            "{} carries NFD's label before NFD ran",
            node.name_any()
        );
    }

    let mut nfd = RealNfd::start(&admin, &namespace, &fleet)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\noperator log:\n{}", operator.log_text()));

    // nfd-master labels what the workers found, and says so in its annotation.
    let labelled = await_nodes(&admin, &gpu_nodes, "GPU nodes labelled by NFD", &nfd, |n| {
        let labels = labels(n);
        let written = n
            .annotations()
            .get(MASTER_LABELS_ANNOTATION)
            .cloned()
            .unwrap_or_default();
        (labels.get(NFD_NVIDIA_PCI).map(String::as_str) != Some("true")
            || !written.split(',').any(|l| l == "pci-10de.present"))
        .then(|| format!("no {NFD_NVIDIA_PCI}=true listed in {MASTER_LABELS_ANNOTATION}"))
    })
    .await;
    await_nodes(&admin, &cpu_node, "CPU node labelled by NFD", &nfd, |n| {
        (labels(n).get(NETWORK_CARD).map(String::as_str) != Some("true"))
            .then(|| format!("no {NETWORK_CARD}=true"))
    })
    .await;
    let features = node_features(&admin, &namespace);
    for node in &fleet {
        let feature = features
            .get(&node.name)
            .await
            .unwrap_or_else(|e| panic!("no NodeFeature for {}: {e}\n{}", node.name, nfd.logs()));
        let owners: Vec<String> = feature
            .owner_references()
            .iter()
            .map(|o| format!("{}/{}", o.kind, o.name))
            .collect();
        assert!(
            owners.contains(&format!("DaemonSet/{WORKER}")),
            "NodeFeature {} is not owned by the worker DaemonSet: {owners:?}",
            node.name
        );
    }
    for node in &labelled {
        assert_eq!(
            labels(node).get("feature.node.kubernetes.io/system-os_release.ID"),
            Some(&"ubuntu".to_owned()),
            "{}: the system source did not read the fake host's os-release",
            node.name_any()
        );
    }

    // The operator takes them for GPU nodes, its operands come to them, and the policy is ready
    // counting them.
    await_nodes(&admin, &gpu_nodes, "GPU nodes marked", &nfd, |n| {
        (labels(n).get(GPU_PRESENT).map(String::as_str) != Some("true"))
            .then(|| format!("no {GPU_PRESENT}=true"))
    })
    .await;
    let pods = Api::<Pod>::namespaced(admin.clone(), &namespace);
    let plugin = ListParams::default().labels("app=nvidia-device-plugin-daemonset");
    wait::until(
        TIMEOUT,
        "device plugin running on the new GPU nodes",
        || {
            let (pods, plugin, gpu_nodes) = (pods.clone(), plugin.clone(), &gpu_nodes);
            async move {
                let running: Vec<String> = pods
                    .list(&plugin)
                    .await?
                    .items
                    .into_iter()
                    .filter(|p| {
                        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                    })
                    .filter_map(|p| p.spec.and_then(|s| s.node_name))
                    .collect();
                Ok(match gpu_nodes.iter().find(|n| !running.contains(n)) {
                    None => Ok(()),
                    Some(node) => Err(format!("none on {node}")),
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    let marked = Api::<Node>::all(admin.clone())
        .list_metadata(&ListParams::default().labels(&format!("{GPU_PRESENT}=true")))
        .await
        .unwrap()
        .items
        .len();
    let policies = session::policies(&admin);
    wait::until(TIMEOUT, "policy ready counting the new GPU nodes", || {
        let policies = policies.clone();
        async move {
            let policy = policies.get(POLICY).await?;
            let status = policy.status.unwrap_or_default();
            let counted = status.gpu_nodes.unwrap_or_default() as usize;
            Ok(if status.state == State::Ready && counted == marked {
                Ok(())
            } else {
                Err(format!(
                    "{:?} with {counted} of {marked} GPU nodes",
                    status.state
                ))
            })
        }
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}\noperator log:\n{}\nNFD logs:\n{}",
            operator.log_text(),
            nfd.logs()
        )
    });
    let cpu = Api::<Node>::all(admin.clone())
        .get("nfd-real-cpu")
        .await
        .unwrap();
    assert!(
        !labels(&cpu).contains_key(NFD_NVIDIA_PCI)
            && labels(&cpu).get(GPU_PRESENT).map(String::as_str) != Some("true"),
        "the CPU node was taken for a GPU node: {:?}",
        labels(&cpu)
    );
    nfd.ensure_running().unwrap();

    drop(nfd);
    // The documented teardown: the policy deleted while the operator runs (the chart keeps it
    // on uninstall), then the release.
    let policies = session::policies(&admin);
    policies
        .delete(POLICY, &DeleteParams::default())
        .await
        .unwrap();
    wait::until_none_left(
        &policies,
        &ListParams::default(),
        session::TIMEOUT,
        "policy torn down",
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    helm_ok(&strings(&[
        "uninstall",
        RELEASE,
        "--namespace",
        &namespace,
        "--wait",
    ]));
    let mut operator = operator;
    let _ = operator.terminate(Duration::from_secs(20));
    nodes::delete(
        &admin,
        &fleet.iter().map(|n| n.name.clone()).collect::<Vec<_>>(),
    )
    .await
    .unwrap();
    e2e::nfd::await_no_annotated_nodes(&admin).await.unwrap();
    Api::<Namespace>::all(admin.clone())
        .delete(&namespace, &DeleteParams::default())
        .await
        .unwrap();
}
