//! Taking over a fleet NVIDIA's GPU Operator runs (docs/migrate-from-nvidia.md), on the harness.
//!
//! The cluster holds what NVIDIA's v26.7 operator leaves for its chart's default values
//! (`operator/tests/fixtures/nvidia-v26.7-render/`, facts): its ClusterPolicy as NVIDIA's Helm
//! release created it, under a CRD that is not ours; its operator Deployment holding its leader
//! Lease; its operand DaemonSets owned by the policy, with their ServiceAccounts, script
//! ConfigMaps and the `nvidia` RuntimeClass; GPU nodes with its deploy and upgrade-state labels
//! and NFD's annotations; the operand pods running, and a GPU job on every node. Then
//! `gpu-operator migrate --from-nvidia` (dry run, then `--apply`), NVIDIA's Deployment removed
//! as its `helm uninstall` would, and this operator started. Sampled every 100 ms throughout:
//! no operand pod replaced, no workload pod deleted, no node cordoned, no node's
//! `nvidia.com/gpu` allocatable lower.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use e2e::audit::{self, AuditLog};
use e2e::nodes::{self, FakeNode, GpuModel};
use e2e::operator::{Operator, OperatorIdentity};
use e2e::session::{self, Setup, TIMEOUT};
use e2e::{steady, wait};
use gpu_operator::api::State;
use gpu_operator::takeover::TEMPLATE_KEPT_ANNOTATION;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, ServiceAccount};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

const FIXTURE_MANAGER: &str = "nvidia-gpu-operator";
const UPGRADE_STATE: &str = "nvidia.com/gpu-driver-upgrade-state";
const NVIDIA_LEASE: &str = "53822513.nvidia.com";
const NVIDIA_RELEASE: &str = "gpu-operator-1764400000";
const DRIVER: &str = "nvidia-driver-daemonset";

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../operator/tests/fixtures/nvidia-v26.7-render")
}

fn policy_api(client: &Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("nvidia.com", "v1", "ClusterPolicy");
    Api::all_with(client.clone(), &ApiResource::from_gvk(&gvk))
}

/// NVIDIA's operand DaemonSets, as its operator renders them for the chart's defaults.
fn nvidia_daemon_sets() -> Vec<DaemonSet> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "yaml") && !p.ends_with("clusterpolicy.yaml")
        })
        .collect();
    files.sort();
    files
        .iter()
        .map(|p| serde_yaml_ng::from_str(&std::fs::read_to_string(p).unwrap()).unwrap())
        .collect()
}

/// The served ClusterPolicy CRD replaced by one that is not ours, as NVIDIA's chart installs
/// it: our schema without our version annotation and without `status.components` (the field
/// only ours has); with `preserve_unknown`, its spec keeps fields no schema names (a newer
/// NVIDIA CRD's field, to us).
async fn install_nvidias_crd(admin: &Client, preserve_unknown: bool) {
    let api = Api::<CustomResourceDefinition>::all(admin.clone());
    let mut crd = api.get(gpu_operator::api::crd::CRD_NAME).await.unwrap();
    let mut spec = serde_json::to_value(gpu_operator::api::crd::crd().spec).unwrap();
    let schema = &mut spec["versions"][0]["schema"]["openAPIV3Schema"];
    schema["properties"]["status"]["properties"]
        .as_object_mut()
        .unwrap()
        .remove("components");
    if preserve_unknown {
        schema["properties"]["spec"]["x-kubernetes-preserve-unknown-fields"] = json!(true);
    }
    crd.spec = serde_json::from_value(spec).unwrap();
    crd.metadata.annotations = None;
    crd.metadata.managed_fields = None;
    crd.status = None;
    api.replace(&crd.name_any(), &PostParams::default(), &crd)
        .await
        .unwrap();
    e2e::crd::await_established(admin, gpu_operator::api::crd::CRD_NAME)
        .await
        .unwrap();
    await_served_schema(admin, preserve_unknown).await;
}

/// Waits until the API server writes ClusterPolicies with the schema just stored.
///
/// A CRD that was already established stays so through a replace, while the server swaps its
/// schema a moment later: a policy created in between is pruned by the old one. A server-side
/// dry-run create shows which schema is served now.
async fn await_served_schema(admin: &Client, keeps_unknown_spec_fields: bool) {
    let probe: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
        "metadata": {"name": "served-schema-probe"},
        "spec": {"schemaProbe": {"enabled": true}},
    }))
    .unwrap();
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let api = policy_api(admin);
    wait::until(
        Duration::from_secs(30),
        "the stored CRD schema served",
        || {
            let (api, probe, dry_run) = (api.clone(), probe.clone(), dry_run.clone());
            async move {
                let created = api.create(&dry_run, &probe).await?;
                let kept = created.data["spec"].get("schemaProbe").is_some();
                Ok(if kept == keeps_unknown_spec_fields {
                    Ok(())
                } else {
                    Err(format!("unknown spec fields kept: {kept}"))
                })
            }
        },
    )
    .await
    .unwrap();
}

/// Our CRD back, replaced whole (a server-side apply would keep fields another manager set).
async fn restore_our_crd(admin: &Client) {
    let api = Api::<CustomResourceDefinition>::all(admin.clone());
    let mut crd = api.get(gpu_operator::api::crd::CRD_NAME).await.unwrap();
    crd.spec = gpu_operator::api::crd::crd().spec;
    crd.metadata.managed_fields = None;
    crd.status = None;
    api.replace(&crd.name_any(), &PostParams::default(), &crd)
        .await
        .unwrap();
    e2e::crd::await_established(admin, gpu_operator::api::crd::CRD_NAME)
        .await
        .unwrap();
    await_served_schema(admin, false).await;
}

/// What NVIDIA's operator left in namespace `ns`.
struct NvidiaFleet {
    policy: String,
    nodes: Vec<String>,
    workloads: Vec<String>,
}

fn owner(policy: &DynamicObject) -> Value {
    json!({
        "apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy", "name": policy.name_any(),
        "uid": policy.uid().unwrap(), "controller": true, "blockOwnerDeletion": true,
    })
}

async fn apply<K>(api: &Api<K>, name: &str, object: Value)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch(
        name,
        &PatchParams::apply(FIXTURE_MANAGER).force(),
        &Patch::Apply(object),
    )
    .await
    .unwrap_or_else(|e| panic!("applying {name}: {e}"));
}

/// The nodes NVIDIA's operator manages: its deploy labels (mig-manager on MIG-capable GPUs
/// only), `gpu.present`, a finished upgrade, NFD's master annotation.
fn nvidia_node(name: &str, model: GpuModel) -> FakeNode {
    let mut node = session::ephemeral_gpu_node(name, model)
        .label("nvidia.com/gpu.present", "true")
        .label(UPGRADE_STATE, "upgrade-done");
    for operand in [
        "driver",
        "container-toolkit",
        "device-plugin",
        "gpu-feature-discovery",
        "dcgm-exporter",
        "dcgm",
        "operator-validator",
        "node-status-exporter",
    ] {
        node = node.label(format!("nvidia.com/gpu.deploy.{operand}"), "true");
    }
    if model.mig_capable() {
        node = node.label("nvidia.com/gpu.deploy.mig-manager", "true");
    }
    node
}

async fn create_nvidia_fleet(
    admin: &Client,
    ns: &str,
    policy_spec_extra: Value,
    with_jobs: bool,
) -> NvidiaFleet {
    // The policy, as NVIDIA's Helm release created it.
    let mut policy: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(fixtures().join("clusterpolicy.yaml")).unwrap(),
    )
    .unwrap();
    policy["metadata"]["labels"] = json!({"app.kubernetes.io/managed-by": "Helm"});
    policy["metadata"]["annotations"] =
        json!({"meta.helm.sh/release-name": NVIDIA_RELEASE, "meta.helm.sh/release-namespace": ns});
    if let (Some(spec), Some(extra)) = (
        policy["spec"].as_object_mut(),
        policy_spec_extra.as_object(),
    ) {
        spec.extend(extra.clone());
    }
    let name = policy["metadata"]["name"].as_str().unwrap().to_owned();
    let policy: DynamicObject = serde_json::from_value(policy).unwrap();
    let policy = policy_api(admin)
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();
    let owner = owner(&policy);

    let models = GpuModel::FLEET;
    let fake: Vec<FakeNode> = models
        .iter()
        .enumerate()
        .map(|(i, m)| nvidia_node(&e2e::cluster::unique_name(&format!("nv-{i}")), *m))
        .collect();
    nodes::create(admin, &fake).await.unwrap();
    let node_names: Vec<String> = fake.iter().map(|n| n.name.clone()).collect();
    let node_api = Api::<Node>::all(admin.clone());
    for node in &node_names {
        let annotations = json!({"metadata": {"annotations": {
            "nfd.node.kubernetes.io/feature-labels": "pci-10de.present,system-os_release.ID",
        }}});
        node_api
            .patch(node, &PatchParams::default(), &Patch::Merge(annotations))
            .await
            .unwrap();
    }

    // What the operand pods name: ServiceAccounts, script ConfigMaps, the RuntimeClass.
    let daemon_sets = nvidia_daemon_sets();
    let mut accounts = BTreeSet::new();
    let mut config_maps = BTreeSet::new();
    for ds in &daemon_sets {
        let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        accounts.extend(pod.service_account_name.clone());
        config_maps.extend(
            pod.volumes
                .iter()
                .flatten()
                .filter_map(|v| v.config_map.as_ref().map(|c| c.name.clone())),
        );
    }
    let labels = json!({"app.kubernetes.io/managed-by": "gpu-operator"});
    for sa in &accounts {
        let object = json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": sa, "namespace": ns, "labels": labels, "ownerReferences": [owner]}});
        apply(
            &Api::<ServiceAccount>::namespaced(admin.clone(), ns),
            sa,
            object,
        )
        .await;
    }
    for cm in &config_maps {
        let object = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": cm, "namespace": ns, "labels": labels, "ownerReferences": [owner]},
            "data": {"entrypoint.sh": "#!/bin/sh\n# NVIDIA's script\n"}});
        apply(&Api::<ConfigMap>::namespaced(admin.clone(), ns), cm, object).await;
    }
    let runtime_class = json!({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
        "metadata": {"name": "nvidia", "labels": labels, "ownerReferences": [owner]}, "handler": "nvidia"});
    // One a failed run left would hold an owner reference to a policy that is gone.
    let runtime_classes = Api::<RuntimeClass>::all(admin.clone());
    if runtime_classes.get_opt("nvidia").await.unwrap().is_some() {
        runtime_classes
            .delete("nvidia", &DeleteParams::default())
            .await
            .unwrap();
        wait::until_none_left(
            &runtime_classes,
            &ListParams::default().fields("metadata.name=nvidia"),
            TIMEOUT,
            "RuntimeClass nvidia gone",
        )
        .await
        .unwrap();
    }
    apply(&runtime_classes, "nvidia", runtime_class).await;

    // NVIDIA's operator, holding its leader Lease.
    let operator = json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "gpu-operator", "namespace": ns,
            "labels": {"app": "gpu-operator", "app.kubernetes.io/managed-by": "Helm"},
            "annotations": {"meta.helm.sh/release-name": NVIDIA_RELEASE}},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "gpu-operator"}},
            "template": {"metadata": {"labels": {"app": "gpu-operator"}},
                "spec": {"serviceAccountName": "gpu-operator",
                    "tolerations": [{"operator": "Exists"}],
                    "containers": [{"name": "gpu-operator", "image": "nvcr.io/nvidia/gpu-operator:v26.7.0",
                        "command": ["gpu-operator"], "args": ["--leader-elect"]}]}}}});
    let deployments = Api::<Deployment>::namespaced(admin.clone(), ns);
    apply(&deployments, "gpu-operator", operator).await;
    let pods = Api::<Pod>::namespaced(admin.clone(), ns);
    let holder = wait::until(TIMEOUT, "NVIDIA's operator pod running", || {
        let pods = pods.clone();
        async move {
            let list = pods
                .list(&ListParams::default().labels("app=gpu-operator"))
                .await?;
            Ok(match list.items.iter().find(|p| pod_ready(p)) {
                Some(p) => Ok(p.name_any()),
                None => Err(format!("{} pod(s), none ready", list.items.len())),
            })
        }
    })
    .await
    .unwrap();
    let now = serde_json::to_value(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
        k8s_openapi::jiff::Timestamp::now(),
    ))
    .unwrap();
    let lease = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": NVIDIA_LEASE, "namespace": ns},
        "spec": {"holderIdentity": format!("{holder}_6b1c2d0e-1111-4a2b-9c3d-000000000001"),
            "leaseDurationSeconds": 137, "acquireTime": now, "renewTime": now}});
    apply(
        &Api::<Lease>::namespaced(admin.clone(), ns),
        NVIDIA_LEASE,
        lease,
    )
    .await;

    // The operand DaemonSets, owned by the policy.
    let ds_api = Api::<DaemonSet>::namespaced(admin.clone(), ns);
    for ds in daemon_sets {
        let mut value = serde_json::to_value(&ds).unwrap();
        value["apiVersion"] = json!("apps/v1");
        value["kind"] = json!("DaemonSet");
        value["metadata"]["namespace"] = json!(ns);
        value["metadata"]["ownerReferences"] = json!([owner]);
        apply(&ds_api, &ds.name_any(), value).await;
    }
    // Every pod of every DaemonSet that selects a node runs on it.
    wait::until(TIMEOUT, "NVIDIA's operand pods ready", || {
        let ds_api = ds_api.clone();
        async move {
            let list = ds_api.list(&ListParams::default()).await?;
            let waiting: Vec<String> = list
                .items
                .iter()
                .filter(|d| {
                    d.owner_references()
                        .iter()
                        .any(|o| o.kind == "ClusterPolicy")
                })
                .filter(|d| {
                    let s = d.status.clone().unwrap_or_default();
                    s.number_ready != s.desired_number_scheduled
                })
                .map(|d| d.name_any())
                .collect();
            Ok(if waiting.is_empty() {
                Ok(())
            } else {
                Err(format!("waiting for {waiting:?}"))
            })
        }
    })
    .await
    .unwrap();

    // A GPU job on every node.
    let mut workloads = Vec::new();
    for node in node_names.iter().filter(|_| with_jobs) {
        let name = format!("train-{node}");
        let pod = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": {"e2e-workload": "training"}},
            "spec": {"nodeName": node, "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "cuda", "image": "nvcr.io/nvidia/cuda:12.8.0-base-ubuntu22.04",
                    "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}});
        apply(&pods, &name, pod).await;
        workloads.push(name);
    }
    let want = workloads.len();
    wait::until(TIMEOUT, "GPU jobs running", || {
        let pods = pods.clone();
        async move {
            let list = pods
                .list(&ListParams::default().labels("e2e-workload=training"))
                .await?;
            let ready = list.items.iter().filter(|p| pod_ready(p)).count();
            Ok(if ready == want {
                Ok(())
            } else {
                Err(format!("{ready} ready"))
            })
        }
    })
    .await
    .unwrap();
    NvidiaFleet {
        policy: name,
        nodes: node_names,
        workloads,
    }
}

fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// What the sampler compares every sample with.
#[derive(Clone, Debug)]
struct Baseline {
    /// Operand pods (owned by a DaemonSet) on the fleet's nodes, by name: uid.
    operand_pods: BTreeMap<String, String>,
    workloads: BTreeMap<String, String>,
    allocatable: BTreeMap<String, String>,
}

/// `except_driver`: the driver's and validator's pods are left out (an upgrade replaces them).
async fn baseline(admin: &Client, ns: &str, fleet: &NvidiaFleet, except_driver: bool) -> Baseline {
    let pods = Api::<Pod>::namespaced(admin.clone(), ns)
        .list(&ListParams::default())
        .await
        .unwrap();
    let on_fleet = |p: &Pod| {
        p.spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_some_and(|n| fleet.nodes.contains(n))
    };
    let operand_pods = pods
        .items
        .iter()
        .filter(|p| on_fleet(p) && p.owner_references().iter().any(|o| o.kind == "DaemonSet"))
        .filter(|p| {
            !(except_driver
                && p.labels()
                    .get("app")
                    .is_some_and(|a| a == DRIVER || a == "nvidia-operator-validator"))
        })
        .map(|p| (p.name_any(), p.uid().unwrap()))
        .collect();
    let workloads = pods
        .items
        .iter()
        .filter(|p| fleet.workloads.contains(&p.name_any()))
        .map(|p| (p.name_any(), p.uid().unwrap()))
        .collect();
    let mut allocatable = BTreeMap::new();
    for node in &fleet.nodes {
        let n = Api::<Node>::all(admin.clone()).get(node).await.unwrap();
        allocatable.insert(node.clone(), gpus(&n));
    }
    Baseline {
        operand_pods,
        workloads,
        allocatable,
    }
}

fn gpus(node: &Node) -> String {
    node.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get("nvidia.com/gpu"))
        .map(|q| q.0.clone())
        .unwrap_or_default()
}

/// Samples every 100 ms until `stop`; returns every violation seen and the number of samples.
async fn sample(
    admin: Client,
    ns: String,
    base: Baseline,
    stop: Arc<AtomicBool>,
) -> (Vec<String>, u64) {
    let pods = Api::<Pod>::namespaced(admin.clone(), &ns);
    let node_api = Api::<Node>::all(admin);
    let mut violations = Vec::new();
    let mut samples = 0;
    while !stop.load(Ordering::Relaxed) {
        samples += 1;
        if let Ok(list) = pods.list(&ListParams::default()).await {
            let live: BTreeMap<String, (String, bool)> = list
                .items
                .iter()
                .map(|p| {
                    (
                        p.name_any(),
                        (p.uid().unwrap(), p.metadata.deletion_timestamp.is_some()),
                    )
                })
                .collect();
            for (name, uid) in base.operand_pods.iter().chain(&base.workloads) {
                match live.get(name) {
                    Some((u, false)) if u == uid => {}
                    Some((u, deleting)) => violations.push(format!(
                        "pod {name}: uid {u} (was {uid}), being deleted: {deleting}"
                    )),
                    None => violations.push(format!("pod {name}: gone")),
                }
            }
        }
        for (node, before) in &base.allocatable {
            if let Ok(n) = node_api.get(node).await {
                if n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) {
                    violations.push(format!("node {node}: cordoned"));
                }
                let now = gpus(&n);
                if now.parse::<u32>().unwrap_or(0) < before.parse::<u32>().unwrap_or(0) {
                    violations.push(format!(
                        "node {node}: nvidia.com/gpu allocatable {now}, was {before}"
                    ));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    violations.dedup();
    (violations, samples)
}

/// `gpu-operator migrate --from-nvidia -n ns ARGS` as the cluster's admin.
fn migrate(ns: &str, args: &[&str]) -> Output {
    Command::new(e2e::operator::binary().unwrap())
        .args(["migrate", "--from-nvidia", "-n", ns])
        .args(args)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Where the dry run's plan is kept for the record (the CI artefacts, the closing note).
fn record(name: &str, content: &str) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/e2e-records");
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(dir.join(name), content);
}

/// A session with NVIDIA's fleet in the operator identity's namespace, under NVIDIA's CRD
/// (`preserve_unknown`: one that keeps unknown spec fields), the policy's spec with
/// `spec_extra`; `None` where this run has no test cluster.
async fn nvidia_fleet(
    preserve_unknown: bool,
    spec_extra: Value,
    with_jobs: bool,
) -> Option<(Client, OperatorIdentity, NvidiaFleet)> {
    let admin = session::builder().prepare().await?.admin;
    restore_our_crd(&admin).await;
    let identity = OperatorIdentity::with_generated_role(&admin).await.unwrap();
    install_nvidias_crd(&admin, preserve_unknown).await;
    let fleet = create_nvidia_fleet(&admin, &identity.namespace, spec_extra, with_jobs).await;
    Some((admin, identity, fleet))
}

/// The session's teardown (the policy deleted, its operands collected), then the fleet's nodes.
async fn tear_down(
    admin: Client,
    identity: OperatorIdentity,
    operator: Operator,
    fleet: NvidiaFleet,
) {
    let nodes = fleet.nodes.clone();
    Setup {
        admin: admin.clone(),
        identity,
        operator,
        policy: fleet.policy,
    }
    .teardown()
    .await;
    nodes::delete(&admin, &nodes).await.unwrap();
}

#[tokio::test]
async fn a_fleet_nvidias_operator_runs_is_taken_over_with_nothing_restarted() {
    let Some((admin, identity, fleet)) = nvidia_fleet(false, json!({}), true).await else {
        return;
    };
    let ns = identity.namespace.clone();
    let ds_api = Api::<DaemonSet>::namespaced(admin.clone(), &ns);
    let generations: BTreeMap<String, Option<i64>> = ds_api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|d| (d.name_any(), d.metadata.generation))
        .collect();
    let base = baseline(&admin, &ns, &fleet, false).await;
    assert!(
        base.operand_pods.len() >= 3 * 5,
        "operand pods on the fleet: {:?}",
        base.operand_pods
    );
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn(sample(
        admin.clone(),
        ns.clone(),
        base.clone(),
        stop.clone(),
    ));

    // The dry run: the plan, nothing written.
    let dry = migrate(&ns, &[]);
    let plan = text(&dry.stdout);
    record("migrate-plan.txt", &plan);
    assert!(dry.status.success(), "{plan}\n{}", text(&dry.stderr));
    assert!(
        plan.contains("Pods restarted by the takeover: none"),
        "{plan}"
    );
    for ds in &generations {
        assert!(
            plan.contains(&format!(
                "DaemonSet {}: adopted keeping NVIDIA's template",
                ds.0
            )) || plan.contains(&format!("DaemonSet {}: adopted as it is", ds.0)),
            "{}:\n{plan}",
            ds.0
        );
    }
    assert!(plan.contains("NVIDIA's, replaced by ours"), "{plan}");
    // The rest is `gpu-operator plan`'s forecast of the first pass: no pod restarts, no driver
    // rollout, and no pod template changes (the kept templates are what the apply sends).
    let forecast = plan
        .split_once("This operator's first pass over the policy")
        .map(|(_, f)| f)
        .unwrap_or_else(|| panic!("no forecast of the first pass:\n{plan}"));
    assert!(forecast.contains("\nPods:\n  no pod restarts\n"), "{plan}");
    assert!(!forecast.contains("Driver upgrade:"), "{plan}");
    assert!(
        !forecast.lines().any(|l| l.contains("spec.template.spec")),
        "a pod template change forecast:\n{plan}"
    );
    let operator_api = Api::<Deployment>::namespaced(admin.clone(), &ns);
    let replicas = |d: Deployment| d.spec.unwrap().replicas;
    assert_eq!(
        replicas(operator_api.get("gpu-operator").await.unwrap()),
        Some(1),
        "the dry run wrote"
    );

    // The takeover.
    let applied = migrate(&ns, &["--apply"]);
    let applied_text = text(&applied.stdout);
    record("migrate-apply.txt", &applied_text);
    assert!(
        applied.status.success(),
        "{applied_text}\n{}",
        text(&applied.stderr)
    );
    assert_eq!(
        replicas(operator_api.get("gpu-operator").await.unwrap()),
        Some(0)
    );
    let crd = Api::<CustomResourceDefinition>::all(admin.clone())
        .get(gpu_operator::api::crd::CRD_NAME)
        .await
        .unwrap();
    assert!(
        crd.annotations()
            .contains_key("nvidia.com/gpu-operator.crd-version"),
        "the CRD is ours now"
    );
    let policy = policy_api(&admin).get(&fleet.policy).await.unwrap();
    assert_eq!(
        policy
            .annotations()
            .get("helm.sh/resource-policy")
            .map(String::as_str),
        Some("keep")
    );
    // NVIDIA's `helm uninstall`: its operator Deployment goes, the policy stays.
    operator_api
        .delete("gpu-operator", &DeleteParams::default())
        .await
        .unwrap();

    let operator = Operator::start(&identity, &[]).unwrap();
    session::await_policy_state(
        &admin,
        &fleet.policy,
        State::Ready,
        "the taken-over policy ready",
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    let message = session::ready_message(&admin, &fleet.policy).await.unwrap();
    assert!(
        message.contains("keep the pod template NVIDIA's operator gave them"),
        "the status says which templates are NVIDIA's: {message}"
    );
    // Every NVIDIA DaemonSet is ours now (applied by us), its template kept: same generation.
    let adopted = ds_api.list(&ListParams::default()).await.unwrap().items;
    for ds in &adopted {
        let name = ds.name_any();
        let Some(before) = generations.get(&name) else {
            continue;
        };
        assert!(
            ds.annotations()
                .contains_key(gpu_operator::controller::APPLIED_HASH_ANNOTATION),
            "{name} was not applied by us"
        );
        let _ = before;
    }

    // Steady state: 60 s without a write.
    let log = AuditLog::from_env().unwrap();
    let user = identity.username();
    steady::await_quiet(&log, &user, Duration::from_secs(5), Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    let from = log.mark().unwrap();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let events = log.of_user_since(from, &user).unwrap();
    let writes = audit::described_writes(&events);
    assert!(
        audit::writes_excluding_leases(&events).is_empty(),
        "writes in 60 s of steady state: {writes:?}"
    );

    stop.store(true, Ordering::Relaxed);
    let (violations, samples) = sampler.await.unwrap();
    eprintln!("takeover sampled {samples} times");
    assert!(samples > 100, "{samples} samples");
    assert!(
        violations.is_empty(),
        "{violations:#?}\noperator log:\n{}",
        operator.log_text()
    );

    tear_down(admin, identity, operator, fleet).await;
}

#[tokio::test]
async fn a_takeover_that_would_lose_a_stored_field_is_refused_without_force() {
    let spec = json!({"futureOperand": {"enabled": true}});
    let Some((admin, identity, fleet)) = nvidia_fleet(true, spec, false).await else {
        return;
    };
    let ns = identity.namespace.clone();

    let dry = migrate(&ns, &[]);
    let (out, err) = (text(&dry.stdout), text(&dry.stderr));
    assert!(!dry.status.success(), "{out}");
    assert!(out.contains("LOST: spec.futureOperand"), "{out}");
    assert!(
        err.contains("spec.futureOperand") && err.contains("--force"),
        "{err}"
    );
    let applied = migrate(&ns, &["--apply"]);
    assert!(!applied.status.success());
    // Nothing changed: NVIDIA's operator runs, the CRD is NVIDIA's, the field is stored.
    let operator = Api::<Deployment>::namespaced(admin.clone(), &ns)
        .get("gpu-operator")
        .await
        .unwrap();
    assert_eq!(operator.spec.unwrap().replicas, Some(1));
    let policy = policy_api(&admin).get(&fleet.policy).await.unwrap();
    assert_eq!(
        policy.data["spec"]["futureOperand"],
        json!({"enabled": true})
    );
    assert!(!policy.annotations().contains_key("helm.sh/resource-policy"));

    restore_our_crd(&admin).await;
    policy_api(&admin)
        .delete(&fleet.policy, &DeleteParams::default())
        .await
        .unwrap();
    wait::until_none_left(
        &Api::<DaemonSet>::namespaced(admin.clone(), &ns),
        &ListParams::default(),
        TIMEOUT,
        "operands collected",
    )
    .await
    .unwrap();
    nodes::delete(&admin, &fleet.nodes).await.unwrap();
    identity.delete().await.unwrap();
}

/// The driver pod of `node` and its image, once exactly one runs there.
async fn driver_image(pods: &Api<Pod>, node: &str) -> Option<String> {
    let list = pods
        .list(
            &ListParams::default()
                .labels(&format!("app={DRIVER}"))
                .fields(&format!("spec.nodeName={node}")),
        )
        .await
        .ok()?;
    let [pod] = list.items.as_slice() else {
        return None;
    };
    pod_ready(pod)
        .then(|| {
            pod.spec
                .as_ref()?
                .containers
                .iter()
                .find(|c| c.name == "nvidia-driver-ctr")?
                .image
                .clone()
        })
        .flatten()
}

#[tokio::test]
async fn a_driver_change_asked_for_during_a_takeover_is_rolled_out_by_the_upgrade_after_it() {
    // No GPU job: the upgrade's pod deletion is the upgrade test's subject (upgrade.rs).
    let Some((admin, identity, fleet)) = nvidia_fleet(false, json!({}), false).await else {
        return;
    };
    let ns = identity.namespace.clone();
    let base = baseline(&admin, &ns, &fleet, true).await;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn(sample(
        admin.clone(),
        ns.clone(),
        base.clone(),
        stop.clone(),
    ));
    let applied = migrate(&ns, &["--apply"]);
    assert!(
        applied.status.success(),
        "{}\n{}",
        text(&applied.stdout),
        text(&applied.stderr)
    );
    Api::<Deployment>::namespaced(admin.clone(), &ns)
        .delete("gpu-operator", &DeleteParams::default())
        .await
        .unwrap();
    // The new version, asked for before this operator has reconciled anything.
    let bump = json!({"spec": {"driver": {"version": "600.10.01"}}});
    policy_api(&admin)
        .patch(&fleet.policy, &PatchParams::default(), &Patch::Merge(bump))
        .await
        .unwrap();
    let operator = Operator::start(&identity, &[]).unwrap();

    // The driver takes our template (the version changed), the others keep NVIDIA's.
    let ds_api = Api::<DaemonSet>::namespaced(admin.clone(), &ns);
    let pods = Api::<Pod>::namespaced(admin.clone(), &ns);
    let upgraded = wait::until(
        Duration::from_secs(180),
        "every fleet node upgraded to 600.10.01",
        || {
            let (pods, nodes) = (pods.clone(), fleet.nodes.clone());
            let node_api = Api::<Node>::all(admin.clone());
            async move {
                let mut left = Vec::new();
                for node in &nodes {
                    let image = driver_image(&pods, node).await.unwrap_or_default();
                    let n = node_api.get(node).await?;
                    let state = n.labels().get(UPGRADE_STATE).cloned().unwrap_or_default();
                    let cordoned = n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
                    if !image.contains("600.10.01") || state != "upgrade-done" || cordoned {
                        left.push(format!("{node}: {image} {state} cordoned={cordoned}"));
                    }
                }
                Ok(if left.is_empty() {
                    Ok(())
                } else {
                    Err(left.join("; "))
                })
            }
        },
    )
    .await;
    if let Err(e) = upgraded {
        let status = policy_api(&admin).get(&fleet.policy).await.unwrap().data["status"].clone();
        panic!(
            "{e}\nstatus: {status:#}\noperator log:\n{}",
            operator.log_text()
        );
    }
    let driver = ds_api.get(DRIVER).await.unwrap();
    assert!(
        !driver.annotations().contains_key(TEMPLATE_KEPT_ANNOTATION),
        "ours went out"
    );
    for ds in ds_api.list(&ListParams::default()).await.unwrap().items {
        if ds.name_any() != DRIVER
            && ds
                .owner_references()
                .iter()
                .any(|o| o.kind == "ClusterPolicy")
        {
            assert!(
                ds.annotations().contains_key(TEMPLATE_KEPT_ANNOTATION),
                "{}",
                ds.name_any()
            );
        }
    }
    session::await_policy_state(
        &admin,
        &fleet.policy,
        State::Ready,
        "ready after the upgrade",
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));

    stop.store(true, Ordering::Relaxed);
    let (violations, _) = sampler.await.unwrap();
    // Cordons belong to the upgrade here; only replaced pods of other operands count.
    let replaced: Vec<&String> = violations
        .iter()
        .filter(|v| v.starts_with("pod "))
        .collect();
    assert!(
        replaced.is_empty(),
        "{replaced:#?}\noperator log:\n{}",
        operator.log_text()
    );

    tear_down(admin, identity, operator, fleet).await;
}
