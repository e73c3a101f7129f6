//! The harness itself: a real control plane whose controllers, scheduler, garbage collector,
//! admission and audit log behave as on a real cluster, with kwok standing in for kubelets.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use e2e::audit::{AuditLog, service_account_user};
use e2e::chaos::CrashLoop;
use e2e::cluster::{pinned_version, service_account_client, unique_name};
use e2e::{nodes, procs, wait};
use k8s_openapi::api::apps::v1::{DaemonSet, DaemonSetSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, Node, Pod, PodSpec, PodTemplateSpec, ServiceAccount,
    Toleration,
};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};

const TIMEOUT: Duration = Duration::from_secs(90);

async fn namespace(client: &Client, prefix: &str) -> String {
    let name = unique_name(prefix);
    e2e::cluster::create_namespace(client, &name).await.unwrap();
    name
}

async fn delete_namespace(client: &Client, name: &str) {
    Api::<Namespace>::all(client.clone())
        .delete(name, &DeleteParams::default())
        .await
        .unwrap();
}

/// A DaemonSet like an operand's: on nodes with NFD's NVIDIA PCI label, tolerating the GPU taint.
fn gpu_daemonset(name: &str) -> DaemonSet {
    let labels = BTreeMap::from([("app".to_string(), name.to_string())]);
    DaemonSet {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: Some(DaemonSetSpec {
            selector: LabelSelector {
                match_labels: Some(labels.clone()),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    node_selector: Some(BTreeMap::from([(
                        nodes::NFD_NVIDIA_PCI.to_string(),
                        "true".to_string(),
                    )])),
                    tolerations: Some(vec![Toleration {
                        key: Some(nodes::GPU_TAINT_KEY.into()),
                        operator: Some("Exists".into()),
                        effect: Some("NoSchedule".into()),
                        ..Toleration::default()
                    }]),
                    containers: vec![Container {
                        name: "main".into(),
                        image: Some("registry.k8s.io/pause:3.10".into()),
                        ..Container::default()
                    }],
                    ..PodSpec::default()
                }),
            },
            ..DaemonSetSpec::default()
        }),
        ..DaemonSet::default()
    }
}

/// Waits until the DaemonSet's status satisfies `ok(desired, ready, unavailable)`.
async fn await_daemonset(
    api: &Api<DaemonSet>,
    name: &str,
    what: &str,
    ok: impl Fn(i32, i32, i32) -> bool,
) -> DaemonSet {
    wait::until(TIMEOUT, what, || async {
        let ds = api.get(name).await?;
        let s = ds.status.clone().unwrap_or_default();
        let unavailable = s.number_unavailable.unwrap_or(0);
        if ok(s.desired_number_scheduled, s.number_ready, unavailable) {
            Ok(Ok(ds))
        } else {
            Ok(Err(format!(
                "desired={} ready={} unavailable={}",
                s.desired_number_scheduled, s.number_ready, unavailable
            )))
        }
    })
    .await
    .unwrap()
}

async fn pods_of(client: &Client, namespace: &str, app: &str) -> Vec<Pod> {
    Api::<Pod>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels(&format!("app={app}")))
        .await
        .unwrap()
        .items
}

#[tokio::test]
async fn daemonset_on_gpu_nodes_becomes_ready_on_each_and_is_garbage_collected() {
    let Some(client) = e2e::connect().await else {
        return;
    };
    let gpu_nodes = nodes::gpu_node_names(&client).await.unwrap();
    assert!(
        !gpu_nodes.is_empty(),
        "the harness has no fake GPU nodes: run tests/cluster/nodes.sh first"
    );
    let ns = namespace(&client, "ds-ready").await;
    let api: Api<DaemonSet> = Api::namespaced(client.clone(), &ns);
    api.create(&PostParams::default(), &gpu_daemonset("probe"))
        .await
        .unwrap();

    let expected = gpu_nodes.len() as i32;
    await_daemonset(
        &api,
        "probe",
        "every GPU node runs a Ready pod",
        |desired, ready, _| desired == expected && ready == expected,
    )
    .await;

    let pods = pods_of(&client, &ns, "probe").await;
    let mut placed: Vec<String> = pods
        .iter()
        .filter_map(|p| p.spec.as_ref()?.node_name.clone())
        .collect();
    placed.sort();
    let mut want = gpu_nodes.clone();
    want.sort();
    assert_eq!(
        placed, want,
        "exactly one pod per GPU node, none on CPU nodes"
    );

    api.delete("probe", &DeleteParams::background())
        .await
        .unwrap();
    wait::until(
        TIMEOUT,
        "pods garbage-collected after their DaemonSet is deleted",
        || async {
            let left = pods_of(&client, &ns, "probe").await.len();
            Ok(if left == 0 {
                Ok(())
            } else {
                Err(format!("{left} pods left"))
            })
        },
    )
    .await
    .unwrap();
    delete_namespace(&client, &ns).await;
}

#[tokio::test]
async fn apiserver_reports_the_pinned_version() {
    let Some(client) = e2e::connect().await else {
        return;
    };
    let info = client.apiserver_version().await.unwrap();
    let pinned = pinned_version("KUBERNETES_VERSION").unwrap();
    assert_eq!(info.git_version, pinned);
    assert_eq!(
        format!("v{}.{}", info.major, info.minor),
        pinned.rsplit_once('.').unwrap().0
    );
    assert_eq!(info.git_tree_state, "clean");
}

#[tokio::test]
async fn crash_looping_pods_on_one_node_make_the_daemonset_unavailable_until_recovered() {
    let Some(client) = e2e::connect().await else {
        return;
    };
    let gpu_nodes = nodes::gpu_node_names(&client).await.unwrap();
    let expected = gpu_nodes.len() as i32;
    let ns = namespace(&client, "crashloop").await;
    let api: Api<DaemonSet> = Api::namespaced(client.clone(), &ns);
    let app = unique_name("flaky");
    api.create(&PostParams::default(), &gpu_daemonset(&app))
        .await
        .unwrap();
    await_daemonset(&api, &app, "all pods Ready", |d, r, _| {
        d == expected && r == expected
    })
    .await;

    let victim = &gpu_nodes[0];
    let crash = CrashLoop::start(&client, victim, &app).await.unwrap();
    let ds = await_daemonset(&api, &app, "one node's pod unavailable", |d, r, u| {
        d == expected && u == 1 && r == expected - 1
    })
    .await;
    assert_eq!(ds.status.unwrap().number_unavailable, Some(1));
    let pods = pods_of(&client, &ns, &app).await;
    let broken = pods
        .iter()
        .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(victim.as_str()))
        .unwrap();
    let waiting = broken
        .status
        .as_ref()
        .unwrap()
        .container_statuses
        .as_ref()
        .unwrap()[0]
        .state
        .as_ref()
        .unwrap()
        .waiting
        .as_ref()
        .unwrap();
    assert_eq!(waiting.reason.as_deref(), Some("CrashLoopBackOff"));

    crash.recover().await.unwrap();
    await_daemonset(&api, &app, "recovered", |d, r, u| {
        d == expected && r == expected && u == 0
    })
    .await;
    delete_namespace(&client, &ns).await;
}

#[tokio::test]
async fn audit_log_counts_the_mutating_requests_of_one_identity() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    let ns = namespace(&admin, "audit").await;
    let sa_name = "audit-probe";
    let sa = ServiceAccount {
        metadata: ObjectMeta {
            name: Some(sa_name.into()),
            ..ObjectMeta::default()
        },
        ..ServiceAccount::default()
    };
    Api::<ServiceAccount>::namespaced(admin.clone(), &ns)
        .create(&PostParams::default(), &sa)
        .await
        .unwrap();
    let role = Role {
        metadata: ObjectMeta {
            name: Some("configmaps".into()),
            ..ObjectMeta::default()
        },
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["configmaps".into()]),
            verbs: ["get", "list", "create", "patch", "delete"]
                .map(String::from)
                .to_vec(),
            ..PolicyRule::default()
        }]),
    };
    Api::<Role>::namespaced(admin.clone(), &ns)
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding = RoleBinding {
        metadata: ObjectMeta {
            name: Some("configmaps".into()),
            ..ObjectMeta::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: "configmaps".into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: sa_name.into(),
            namespace: Some(ns.clone()),
            ..Subject::default()
        }]),
    };
    Api::<RoleBinding>::namespaced(admin.clone(), &ns)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();

    let probe = service_account_client(&admin, &ns, sa_name).await.unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(probe, &ns);
    let log = AuditLog::from_env().unwrap();
    let mark = log.mark().unwrap();

    // 3 creates, 1 patch, 1 delete (5 writes) and 2 reads.
    for i in 0..3 {
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(format!("cm-{i}")),
                ..ObjectMeta::default()
            },
            data: Some(BTreeMap::from([("k".to_string(), i.to_string())])),
            ..ConfigMap::default()
        };
        cms.create(&PostParams::default(), &cm).await.unwrap();
    }
    cms.patch(
        "cm-0",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"data": {"k": "x"}})),
    )
    .await
    .unwrap();
    cms.get("cm-1").await.unwrap();
    cms.list(&ListParams::default()).await.unwrap();
    cms.delete("cm-2", &DeleteParams::default()).await.unwrap();

    let writes = log
        .mutating_since(mark, &service_account_user(&ns, sa_name))
        .unwrap();
    let mut verbs: Vec<&str> = writes.iter().map(|e| e.verb.as_str()).collect();
    verbs.sort();
    assert_eq!(
        verbs,
        ["create", "create", "create", "delete", "patch"],
        "{writes:#?}"
    );
    assert!(writes.iter().all(|e| e.resource() == "configmaps"));
    delete_namespace(&admin, &ns).await;
}

#[tokio::test]
async fn harness_listens_only_on_loopback() {
    let Some(cluster) = e2e::cluster::test_cluster() else {
        return;
    };
    let processes = procs::recorded(&cluster.dir).unwrap();
    assert_eq!(
        processes.len(),
        5,
        "etcd, apiserver, controller-manager, scheduler, kwok: {processes:?}"
    );
    for p in &processes {
        assert!(p.is_running(), "{} ({}) is not running", p.name, p.pid);
        let addresses = procs::listening_addresses(p.pid).unwrap();
        assert!(!addresses.is_empty(), "{} listens nowhere", p.name);
        for a in addresses {
            assert!(a.ip().is_loopback(), "{} listens on {a}", p.name);
        }
    }
}

/// Fake GPU nodes carry what real ones do, and kwok keeps them Ready.
#[tokio::test]
async fn fake_gpu_nodes_look_like_real_ones() {
    let Some(client) = e2e::connect().await else {
        return;
    };
    let api: Api<Node> = Api::all(client.clone());
    let name = unique_name("probe-h100");
    let node = nodes::FakeNode::gpu(&name, nodes::GpuModel::H100Sxm80Gb).tainted(true);
    nodes::create(&client, std::slice::from_ref(&node))
        .await
        .unwrap();
    let live = wait::for_object(
        api.clone(),
        &name,
        TIMEOUT,
        "node Ready",
        |n: Option<&Node>| {
            n.and_then(|n| n.status.as_ref()?.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        },
    )
    .await
    .unwrap();
    let labels = live.metadata.labels.clone().unwrap();
    assert_eq!(labels["nvidia.com/gpu.product"], "NVIDIA-H100-80GB-HBM3");
    assert_eq!(labels["nvidia.com/mig.capable"], "true");
    assert_eq!(
        labels["feature.node.kubernetes.io/pci-0302_10de.present"],
        "true"
    );
    let status = live.status.unwrap();
    assert_eq!(status.capacity.unwrap()["pods"].0, "110");
    let info = status.node_info.unwrap();
    assert_eq!(info.container_runtime_version, "containerd://2.1.0");
    assert_eq!(info.os_image, "Ubuntu 22.04 LTS");
    let taints = live.spec.unwrap().taints.unwrap();
    assert_eq!(taints[0].key, nodes::GPU_TAINT_KEY);
    nodes::delete(&client, &[name]).await.unwrap();
}

/// A second harness on other ports runs beside the first (as a demo beside a test run does),
/// listens only on loopback, and `down.sh` stops every process it started.
#[tokio::test]
async fn second_harness_runs_beside_the_first_and_down_leaves_nothing() {
    let Some(first) = e2e::connect().await else {
        return;
    };
    let scripts = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../cluster");
    let base: u32 = std::env::var("HARNESS_PORT_BASE")
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(16400)
        + 50;
    let dir = std::env::temp_dir().join(unique_name("second-harness"));
    let run = |script: &str| {
        let output = std::process::Command::new(scripts.join(script))
            .env("HARNESS_PORT_BASE", base.to_string())
            .env("HARNESS_DIR", &dir)
            .env_remove("KUBECONFIG")
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{script} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap()
    };

    let out = run("up.sh");
    let last = out.lines().last().unwrap();
    assert_eq!(
        last,
        format!("export KUBECONFIG={}/admin.kubeconfig", dir.display())
    );
    let processes = procs::recorded(&dir).unwrap();
    assert_eq!(processes.len(), 5);
    for p in &processes {
        for a in procs::listening_addresses(p.pid).unwrap() {
            assert!(a.ip().is_loopback(), "{} listens on {a}", p.name);
        }
    }
    // The first harness is untouched and still answers.
    first.apiserver_version().await.unwrap();

    run("down.sh");
    for p in &processes {
        assert!(!p.is_running(), "{} ({}) survived down.sh", p.name, p.pid);
    }
    assert!(!dir.exists(), "down.sh left {}", dir.display());
}
