//! GPU nodes for virtual machines, chosen per node (`spec.sandboxWorkloads`, docs/vms.md), on
//! the harness: a mixed fleet where each stack runs only on its nodes, and one node relabelled
//! from containers to vm-passthrough and back; a vm-vgpu node switching back to containers while
//! a vGPU manager pod adopted from NVIDIA (NVIDIA's labels only) is still on it.
//!
//! The order of a switch is read from one pod watch on the switching node: a watch delivers
//! events in etcd order, so "every container-stack pod was deleted before the VFIO manager's pod
//! was created" is a fact of the stream, not of clocks. To make the order independent of how
//! fast kwok deletes pods, the test puts a finalizer on one pod of the leaving stack: the DCGM
//! exporter on the way to VMs (a pod the operator does not watch, so only its on-demand look at
//! the node sees it), the VFIO manager on the way back. The operator's node writes, with their
//! times, come from the audit log. The operator runs with its generated ClusterRole.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use e2e::audit::AuditLog;
use e2e::cluster::unique_name;
use e2e::nodes::{self, GpuModel};
use e2e::session::{self, Setup, TIMEOUT, ephemeral_gpu_node};
use e2e::wait;
use gpu_operator::api::State;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const WORKLOAD_CONFIG: &str = "nvidia.com/gpu.workload.config";
const DEPLOY_VFIO: &str = "nvidia.com/gpu.deploy.vfio-manager";
const DEPLOY_DRIVER: &str = "nvidia.com/gpu.deploy.driver";
const HOLD: &str = "gpu-operator.test/hold";

const VFIO: &str = "nvidia-vfio-manager";
const VM_STACK: [&str; 3] = [
    VFIO,
    "nvidia-sandbox-device-plugin-daemonset",
    "nvidia-sandbox-validator",
];
const DCGM_EXPORTER: &str = "nvidia-dcgm-exporter";
/// The container stack's DaemonSets every container GPU node of the default policy runs
/// (drivers and toolkits by prefix: one DaemonSet per OS or runtime flavour).
const CONTAINER_STACK: [&str; 6] = [
    "nvidia-driver-daemonset",
    "nvidia-container-toolkit-daemonset",
    "nvidia-device-plugin-daemonset",
    "gpu-feature-discovery",
    DCGM_EXPORTER,
    "nvidia-operator-validator",
];

/// Whether a DaemonSet belongs to the container stack, including the operands that run on some
/// container nodes only (MIG manager, MPS control daemon) or when enabled.
fn is_container_stack(daemon_set: &str) -> bool {
    CONTAINER_STACK.iter().any(|d| daemon_set.starts_with(d))
        || [
            "nvidia-dcgm",
            "nvidia-mig-manager",
            "nvidia-device-plugin-mps-control-daemon",
            "nvidia-node-status-exporter",
        ]
        .contains(&daemon_set)
}

/// How long a held pod keeps its stack on the node: past the labeller's 5 s second look, so a
/// key added too early would show.
const HELD_FOR: Duration = Duration::from_secs(8);

fn owner(pod: &Pod) -> String {
    pod.owner_references()
        .iter()
        .find(|o| o.kind == "DaemonSet")
        .map(|o| o.name.clone())
        .unwrap_or_default()
}

fn node_of(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default()
}

/// The operand DaemonSets with a pod on each node.
async fn stacks_by_node(pods: &Api<Pod>) -> BTreeMap<String, BTreeSet<String>> {
    let mut by_node: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for pod in pods.list(&ListParams::default()).await.unwrap().items {
        let (node, ds) = (node_of(&pod), owner(&pod));
        if !node.is_empty() && !ds.is_empty() {
            by_node.entry(node).or_default().insert(ds);
        }
    }
    by_node
}

/// What is wrong with a node's operand pods for its workload type, if anything.
fn misplaced(vm: bool, stacks: &BTreeSet<String>) -> Option<String> {
    let container: Vec<&String> = stacks.iter().filter(|d| is_container_stack(d)).collect();
    let vm_pods: Vec<&String> = stacks
        .iter()
        .filter(|d| VM_STACK.contains(&d.as_str()))
        .collect();
    if vm {
        let missing: Vec<&str> = VM_STACK
            .into_iter()
            .filter(|d| !stacks.contains(*d))
            .collect();
        (!container.is_empty() || !missing.is_empty())
            .then(|| format!("container pods {container:?}, VM pods missing {missing:?}"))
    } else {
        let missing: Vec<&str> = CONTAINER_STACK
            .into_iter()
            .filter(|d| !stacks.iter().any(|s| s.starts_with(d)))
            .collect();
        (!vm_pods.is_empty() || !missing.is_empty())
            .then(|| format!("VM pods {vm_pods:?}, container pods missing {missing:?}"))
    }
}

/// Waits until every GPU node runs exactly its type's stack; `vm` names the vm-passthrough
/// nodes.
async fn until_placed(s: &Setup, vm: &BTreeSet<String>, what: &str) {
    let pods = Api::<Pod>::namespaced(s.admin.clone(), &s.identity.namespace);
    let admin = s.admin.clone();
    let vm = vm.clone();
    wait::until(TIMEOUT, what, || {
        let (pods, admin, vm) = (pods.clone(), admin.clone(), vm.clone());
        async move {
            let by_node = stacks_by_node(&pods).await;
            for node in nodes::gpu_node_names(&admin).await? {
                let stacks = by_node.get(&node).cloned().unwrap_or_default();
                if let Some(problem) = misplaced(vm.contains(&node), &stacks) {
                    return Ok(Err(format!("{node}: {problem}")));
                }
            }
            Ok(Ok(()))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
}

/// One pod event on the watched node, in the order the watch delivered it.
#[derive(Clone, Debug)]
struct Seen {
    at: SystemTime,
    deleted: bool,
    pod: String,
    daemon_set: String,
}

/// Records every pod creation and deletion on `node` in the operator's namespace.
fn record_pods(pods: Api<Pod>, node: &str) -> (Arc<Mutex<Vec<Seen>>>, tokio::task::JoinHandle<()>) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let task = tokio::spawn(async move {
        let mut known = BTreeSet::new();
        let mut stream = watcher(pods, config).default_backoff().boxed();
        while let Some(event) = stream.next().await {
            let (pod, deleted) = match event {
                Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => (pod, false),
                Ok(watcher::Event::Delete(pod)) => (pod, true),
                _ => continue,
            };
            let name = pod.name_any();
            // A pod is recorded when first seen and when gone, not on each status change.
            if deleted || known.insert(name.clone()) {
                record.lock().unwrap().push(Seen {
                    at: SystemTime::now(),
                    deleted,
                    daemon_set: owner(&pod),
                    pod: name,
                });
            }
        }
    });
    (seen, task)
}

/// The pod of `daemon_set` on `node`.
async fn pod_of(pods: &Api<Pod>, node: &str, daemon_set: &str) -> Pod {
    let on_node = ListParams::default().fields(&format!("spec.nodeName={node}"));
    wait::until(TIMEOUT, &format!("a {daemon_set} pod on {node}"), || {
        let (pods, on_node) = (pods.clone(), on_node.clone());
        async move {
            let list = pods.list(&on_node).await?;
            Ok(list
                .items
                .into_iter()
                .find(|p| owner(p) == daemon_set)
                .ok_or_else(|| "none".to_owned()))
        }
    })
    .await
    .unwrap()
}

async fn set_finalizer(pods: &Api<Pod>, pod: &str, held: bool) {
    let finalizers: Vec<&str> = if held { vec![HOLD] } else { vec![] };
    let patch = json!({"metadata": {"finalizers": finalizers}});
    match pods
        .patch(pod, &PatchParams::default(), &Patch::Merge(patch))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 && !held => {}
        Err(e) => panic!("setting the finalizer of {pod}: {e}"),
    }
}

/// Holds `pod` through its deletion for [`HELD_FOR`] once the DaemonSet controller has deleted
/// it, then lets it go. Returns what was wrong during the hold (an arriving key or pod that
/// should have waited), checked before the pod is released so a failure leaves nothing held.
async fn hold_through_deletion(
    s: &Setup,
    pods: &Api<Pod>,
    pod: &str,
    node: &str,
    waiting_key: &str,
    waiting_daemon_set: &str,
) -> (Option<String>, SystemTime) {
    wait::until(TIMEOUT, &format!("{pod} being deleted"), || {
        let pods = pods.clone();
        let pod = pod.to_owned();
        async move {
            Ok(match pods.get_opt(&pod).await? {
                Some(p) if p.metadata.deletion_timestamp.is_some() => Ok(()),
                other => Err(format!(
                    "{:?}",
                    other.map(|p| p.metadata.deletion_timestamp)
                )),
            })
        }
    })
    .await
    .unwrap();
    tokio::time::sleep(HELD_FOR).await;
    let node_labels = Api::<Node>::all(s.admin.clone())
        .get(node)
        .await
        .unwrap()
        .labels()
        .clone();
    let arrived = stacks_by_node(pods)
        .await
        .get(node)
        .is_some_and(|stacks| stacks.iter().any(|d| d.starts_with(waiting_daemon_set)));
    let problem = (node_labels.contains_key(waiting_key) || arrived).then(|| {
        format!(
            "while {pod} was still on {node}: {waiting_key} = {:?}, {waiting_daemon_set} pod \
             present: {arrived}",
            node_labels.get(waiting_key)
        )
    });
    let released = SystemTime::now();
    set_finalizer(pods, pod, false).await;
    (problem, released)
}

/// Asserts, on the recorded stream, that every pod of the leaving stack was deleted before the
/// first pod of `arriving` was created.
fn assert_left_before_arrived(seen: &[Seen], leaving: impl Fn(&str) -> bool, arriving: &str) {
    let first_arrival = seen
        .iter()
        .position(|e| !e.deleted && e.daemon_set.starts_with(arriving))
        .unwrap_or_else(|| panic!("no {arriving} pod created: {seen:#?}"));
    let left: Vec<&Seen> = seen.iter().filter(|e| leaving(&e.daemon_set)).collect();
    let created: BTreeSet<&str> = left
        .iter()
        .filter(|e| !e.deleted)
        .map(|e| e.pod.as_str())
        .collect();
    assert!(
        !created.is_empty(),
        "no leaving pod was on the node: {seen:#?}"
    );
    for pod in created {
        let deleted = seen
            .iter()
            .position(|e| e.deleted && e.pod == pod)
            .unwrap_or_else(|| panic!("{pod} never deleted: {seen:#?}"));
        assert!(
            deleted < first_arrival,
            "{pod} deleted after the first {arriving} pod was created: {seen:#?}"
        );
    }
    let last_gone = seen[..first_arrival]
        .iter()
        .rev()
        .find(|e| e.deleted && leaving(&e.daemon_set))
        .unwrap();
    let gap = seen[first_arrival]
        .at
        .duration_since(last_gone.at)
        .unwrap_or_default();
    println!(
        "{} gone, then {} created {gap:?} later",
        last_gone.pod, seen[first_arrival].pod
    );
}

/// The operator's node patches on `node` since `mark`: there must be one before `released`
/// (the leaving stack's keys come off at once) and one after it (the arriving owner's key,
/// held back until the held pod was gone).
fn assert_patched_around(
    audit: &AuditLog,
    mark: e2e::audit::Mark,
    user: &str,
    node: &str,
    released: SystemTime,
) {
    let patches: Vec<SystemTime> = audit
        .of_user_since(mark, user)
        .unwrap()
        .iter()
        .filter(|e| e.verb == "patch" && e.resource() == "nodes" && e.name() == Some(node))
        .map(|e| e.received())
        .collect();
    assert!(
        patches.iter().any(|t| *t < released) && patches.iter().any(|t| *t > released),
        "the operator's patches of {node} at {patches:?}, the held pod released at {released:?}"
    );
}

async fn gpu_nodes(client: &Client) -> Vec<String> {
    nodes::gpu_node_names(client).await.unwrap()
}

#[tokio::test]
async fn a_mixed_fleet_runs_each_stack_on_its_nodes_and_a_relabelled_node_changes_stack_in_order() {
    let Some(prepared) = session::builder().prepare().await else {
        return;
    };
    let vm: BTreeSet<String> = (0..2)
        .map(|i| unique_name(&format!("a100-vm-{i}")))
        .collect();
    let switching = unique_name("t4-switch");
    let mut extra: Vec<_> = vm
        .iter()
        .map(|n| {
            ephemeral_gpu_node(n, GpuModel::A100Sxm40Gb).label(WORKLOAD_CONFIG, "vm-passthrough")
        })
        .collect();
    extra.push(ephemeral_gpu_node(&switching, GpuModel::T4));
    nodes::create(&prepared.admin, &extra).await.unwrap();
    let s = prepared
        .start(json!({
            "sandboxWorkloads": {"enabled": true, "defaultWorkload": "container", "mode": "kubevirt"},
            "vfioManager": {"enabled": true},
            "sandboxDevicePlugin": {"enabled": true, "repository": "nvcr.io/nvidia",
                "image": "kubevirt-gpu-device-plugin", "version": "v1.6.0"},
        }))
        .await;
    s.await_state(State::Ready, "policy ready on a mixed fleet")
        .await;
    assert!(gpu_nodes(&s.admin).await.len() > vm.len() + 1);
    until_placed(&s, &vm, "each stack only on its nodes").await;

    let pods = Api::<Pod>::namespaced(s.admin.clone(), &s.identity.namespace);
    let audit = AuditLog::from_env().unwrap();
    let user = s.identity.username();

    // Containers -> vm-passthrough, the DCGM exporter's pod held through its deletion.
    let exporter = pod_of(&pods, &switching, DCGM_EXPORTER).await.name_any();
    set_finalizer(&pods, &exporter, true).await;
    let (seen, recorder) = record_pods(pods.clone(), &switching);
    let mark = audit.mark().unwrap();
    nodes::set_label(
        &s.admin,
        &switching,
        WORKLOAD_CONFIG,
        Some("vm-passthrough"),
    )
    .await
    .unwrap();
    let (problem, released) =
        hold_through_deletion(&s, &pods, &exporter, &switching, DEPLOY_VFIO, VFIO).await;
    assert!(problem.is_none(), "{}", problem.unwrap());
    let mut now_vm = vm.clone();
    now_vm.insert(switching.clone());
    until_placed(&s, &now_vm, "the relabelled node runs the VM stack").await;
    recorder.abort();
    let to_vm = seen.lock().unwrap().clone();
    assert_left_before_arrived(&to_vm, is_container_stack, VFIO);
    assert_patched_around(&audit, mark, &user, &switching, released);

    // vm-passthrough -> containers, the VFIO manager's pod held through its deletion.
    let vfio = pod_of(&pods, &switching, VFIO).await.name_any();
    set_finalizer(&pods, &vfio, true).await;
    let (seen, recorder) = record_pods(pods.clone(), &switching);
    let mark = audit.mark().unwrap();
    nodes::set_label(&s.admin, &switching, WORKLOAD_CONFIG, Some("container"))
        .await
        .unwrap();
    let (problem, released) = hold_through_deletion(
        &s,
        &pods,
        &vfio,
        &switching,
        DEPLOY_DRIVER,
        "nvidia-driver-daemonset",
    )
    .await;
    assert!(problem.is_none(), "{}", problem.unwrap());
    until_placed(&s, &vm, "the relabelled node runs containers again").await;
    recorder.abort();
    let to_container = seen.lock().unwrap().clone();
    assert_left_before_arrived(&to_container, |d| d == VFIO, "nvidia-driver-daemonset");
    assert_patched_around(&audit, mark, &user, &switching, released);

    let admin = s.admin.clone();
    s.teardown().await;
    let mut names: Vec<String> = vm.into_iter().collect();
    names.push(switching);
    nodes::delete(&admin, &names).await.unwrap();
}

/// A vGPU manager pod as NVIDIA's operator runs it: only NVIDIA's `app` label (what a vGPU
/// manager DaemonSet adopted from NVIDIA keeps), on `node`.
fn nvidia_vgpu_manager_pod(namespace: &str, name: &str, node: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace,
            "labels": {"app": "nvidia-vgpu-manager-daemonset"}},
        "spec": {"nodeName": node, "containers": [{"name": "nvidia-vgpu-manager-ctr",
            "image": "registry.example.com/nvidia/vgpu-manager:580.65.05-ubuntu22.04"}]}
    }))
    .unwrap()
}

#[tokio::test]
async fn a_vgpu_node_switching_to_containers_waits_for_a_vgpu_manager_pod_adopted_from_nvidia() {
    let Some(prepared) = session::builder().prepare().await else {
        return;
    };
    let node = unique_name("a30-vgpu-switch");
    nodes::create(
        &prepared.admin,
        &[ephemeral_gpu_node(&node, GpuModel::A30).label(WORKLOAD_CONFIG, "vm-vgpu")],
    )
    .await
    .unwrap();
    let s = prepared
        .start(json!({
            "sandboxWorkloads": {"enabled": true, "defaultWorkload": "container", "mode": "kubevirt"},
        }))
        .await;
    s.await_state(State::Ready, "policy ready with a vm-vgpu node")
        .await;
    let pods = Api::<Pod>::namespaced(s.admin.clone(), &s.identity.namespace);
    let held = unique_name("nvidia-vgpu-manager-daemonset");
    pods.create(
        &Default::default(),
        &nvidia_vgpu_manager_pod(&s.identity.namespace, &held, &node),
    )
    .await
    .unwrap();
    // The operator's pod caches see it before the switch (its watch is what is under test).
    tokio::time::sleep(Duration::from_secs(2)).await;

    nodes::set_label(&s.admin, &node, WORKLOAD_CONFIG, Some("container"))
        .await
        .unwrap();
    tokio::time::sleep(HELD_FOR).await;
    let labels = Api::<Node>::all(s.admin.clone())
        .get(&node)
        .await
        .unwrap()
        .labels()
        .clone();
    assert!(
        !labels.contains_key(DEPLOY_DRIVER),
        "{node} got {DEPLOY_DRIVER} while NVIDIA's vGPU manager pod {held} was still on it: \
         {labels:?}"
    );
    pods.delete(&held, &Default::default()).await.unwrap();
    wait::until(TIMEOUT, &format!("{DEPLOY_DRIVER} on {node}"), || {
        let admin = s.admin.clone();
        let node = node.clone();
        async move {
            let labels = Api::<Node>::all(admin).get(&node).await?.labels().clone();
            Ok(match labels.get(DEPLOY_DRIVER).map(String::as_str) {
                Some("true") => Ok(()),
                other => Err(format!("{other:?}")),
            })
        }
    })
    .await
    .unwrap();

    let admin = s.admin.clone();
    s.teardown().await;
    nodes::delete(&admin, &[node]).await.unwrap();
}
