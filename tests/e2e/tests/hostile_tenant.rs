//! A namespace tenant (anyone with `edit` in one namespace) cannot switch the operator off,
//! make it remove its own NFD, or make it take over and later delete objects that are not its
//! own (decisions 14, 16 and 19). Each test plants what such a tenant, or another installer,
//! can create, and checks the operator goes on as if it were not there.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use e2e::cluster::unique_name;
use e2e::session::{self, Setup, TIMEOUT, ready_message};
use e2e::wait;
use gpu_operator::api::State;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, ServiceAccount};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

const NVIDIA_LEASE: &str = "53822513.nvidia.com";
/// How fast a policy edit must still reach its DaemonSet beside a decoy Lease.
const EDIT_BOUND: Duration = Duration::from_secs(2);
/// One of the operand ConfigMaps the default policy renders under a fixed name (the driver's
/// startup probe; entrypoints are named by their content, so no one can guess them ahead).
const OPERAND_CONFIG_MAP: &str = "nvidia-driver-startup-probe";
const ADOPT: &str = "nvidia.com/gpu-operator.adopt";

async fn create_namespace(admin: &Client, name: &str) {
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": name}})).unwrap(),
        )
        .await
        .unwrap();
}

async fn delete_namespace(admin: &Client, name: &str) {
    Api::<Namespace>::all(admin.clone())
        .delete(name, &DeleteParams::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn a_decoy_nvidia_lease_in_a_tenant_namespace_changes_nothing() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    // No real NVIDIA Lease left by another test.
    for lease in Api::<Lease>::all(admin.clone())
        .list(&kube::api::ListParams::default().fields(&format!("metadata.name={NVIDIA_LEASE}")))
        .await
        .unwrap()
        .items
    {
        Api::<Lease>::namespaced(admin.clone(), &lease.namespace().unwrap_or_default())
            .delete(NVIDIA_LEASE, &DeleteParams::default())
            .await
            .unwrap();
    }
    let Some(s) = session::start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;

    // The tenant's holder is even a running pod, named as controller-runtime's identity says,
    // but its ServiceAccount is the namespace's default one.
    let tenant = unique_name("tenant-a");
    create_namespace(&s.admin, &tenant).await;
    let node = e2e::nodes::gpu_node_names(&s.admin).await.unwrap()[0].clone();
    let holder_pod = "gpu-operator-5d8f7c9b6-xk2lp";
    let pods: Api<Pod> = Api::namespaced(s.admin.clone(), &tenant);
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "metadata": {"name": holder_pod},
            "spec": {"nodeName": node, "containers": [{"name": "decoy", "image": "busybox"}]}
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    wait::for_object(
        pods.clone(),
        holder_pod,
        TIMEOUT,
        "decoy holder pod running",
        |p: Option<&Pod>| {
            p.and_then(|p| p.status.as_ref())
                .and_then(|s| s.phase.as_deref())
                == Some("Running")
        },
    )
    .await
    .unwrap();
    let now = k8s_openapi::jiff::Timestamp::now();
    let leases: Api<Lease> = Api::namespaced(s.admin.clone(), &tenant);
    leases
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": NVIDIA_LEASE},
                "spec": {"holderIdentity": format!("{holder_pod}_0c1e2d3f-4a5b-6c7d-8e9f-a0b1c2d3e4f5"),
                    "leaseDurationSeconds": 60, "acquireTime": now, "renewTime": now}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    // The operator has judged the Lease once it says so; an operator that does not judge it
    // says nothing, and the edit below shows what it did instead.
    let _ = s
        .operator
        .await_log(
            "ignoring a Lease with NVIDIA's operator name",
            Duration::from_secs(5),
        )
        .await;

    let started = Instant::now();
    s.patch_policy(
        json!({"spec": {"dcgmExporter": {"env": [{"name": "E2E_TENANT", "value": "1"}]}}}),
    )
    .await;
    let applied = wait::until(
        EDIT_BOUND,
        "policy edit applied beside the decoy Lease",
        || async {
            let value = s.template_env("nvidia-dcgm-exporter", "E2E_TENANT").await;
            Ok(if value.as_deref() == Some("1") {
                Ok(started.elapsed())
            } else {
                Err(format!("E2E_TENANT={value:?}"))
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    eprintln!("policy edit applied {applied:?} after it was sent, beside a decoy Lease");
    s.await_state(State::Ready, "ready beside the decoy Lease")
        .await;
    let message = ready_message(&s.admin, &s.policy).await.unwrap();
    assert!(
        !message.contains("NVIDIA's GPU Operator is running"),
        "{message}"
    );
    // Seen and judged, not missed: the decoy was looked at and ignored.
    assert!(
        s.operator
            .log_text()
            .contains("ignoring a Lease with NVIDIA's operator name"),
        "{}",
        s.operator.log_text()
    );

    leases
        .delete(NVIDIA_LEASE, &DeleteParams::default())
        .await
        .unwrap();
    delete_namespace(&s.admin, &tenant).await;
    s.teardown().await;
}

#[tokio::test]
async fn a_decoy_nfd_master_in_a_tenant_namespace_never_removes_our_nfd() {
    let Some(mut s) = session::start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "ready with NFD deployed").await;
    let ours: Api<Deployment> = Api::namespaced(s.admin.clone(), &s.identity.namespace);
    let master = "node-feature-discovery-master";
    let uid = ours.get(master).await.unwrap().uid();

    // Labelled as NFD's kustomize manifests label the master, run as the namespace's default
    // ServiceAccount (no pods: the labels are all a tenant needs to plant).
    let tenant = unique_name("tenant-a");
    create_namespace(&s.admin, &tenant).await;
    Api::<Deployment>::namespaced(s.admin.clone(), &tenant)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "nfd-master", "labels": {"app": "nfd-master"}},
                "spec": {
                    "replicas": 0,
                    "selector": {"matchLabels": {"app": "nfd-master"}},
                    "template": {
                        "metadata": {"labels": {"app": "nfd-master"}},
                        "spec": {"containers": [{"name": "nfd-master",
                            "image": "registry.k8s.io/nfd/node-feature-discovery:v0.19.0"}]}
                    }
                }
            }))
            .unwrap(),
        )
        .await
        .unwrap();

    // The operator looks for a running NFD when it starts.
    s.restart_operator().await;
    s.await_state(State::Ready, "ready after the restart beside the decoy")
        .await;
    let after = ours.get_opt(master).await.unwrap();
    assert_eq!(
        after.as_ref().map(ResourceExt::uid),
        Some(uid),
        "our NFD master was removed or replaced after a restart beside a tenant's decoy\n{}",
        s.operator.log_text()
    );
    let message = ready_message(&s.admin, &s.policy).await.unwrap();
    assert!(!message.contains("NFD already runs"), "{message}");

    delete_namespace(&s.admin, &tenant).await;
    s.teardown().await;
}

/// Another NFD whose master may patch nodes (as NFD's own chart grants) is real: found beside
/// ours at a restart, ours is frozen (kept as it is, not pruned) and status says why.
#[tokio::test]
async fn a_privileged_foreign_nfd_beside_ours_freezes_ours_and_says_why() {
    let Some(mut s) = session::start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "ready with NFD deployed").await;
    let ours: Api<Deployment> = Api::namespaced(s.admin.clone(), &s.identity.namespace);
    let master = "node-feature-discovery-master";
    let uid = ours.get(master).await.unwrap().uid();

    let other = unique_name("other-nfd");
    create_namespace(&s.admin, &other).await;
    let role = format!("{other}-master");
    Api::<ServiceAccount>::namespaced(s.admin.clone(), &other)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "nfd-master"}})).unwrap(),
        )
        .await
        .unwrap();
    Api::<ClusterRole>::all(s.admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": role},
                "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]}))
            .unwrap(),
        )
        .await
        .unwrap();
    Api::<ClusterRoleBinding>::all(s.admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": role},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                "subjects": [{"kind": "ServiceAccount", "name": "nfd-master", "namespace": other}]}))
            .unwrap(),
        )
        .await
        .unwrap();
    Api::<Deployment>::namespaced(s.admin.clone(), &other)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "nfd-master", "labels": {"app": "nfd-master"}},
                "spec": {
                    "replicas": 0,
                    "selector": {"matchLabels": {"app": "nfd-master"}},
                    "template": {
                        "metadata": {"labels": {"app": "nfd-master"}},
                        "spec": {"serviceAccountName": "nfd-master", "containers": [{"name": "nfd-master",
                            "image": "registry.k8s.io/nfd/node-feature-discovery:v0.19.0"}]}
                    }
                }
            }))
            .unwrap(),
        )
        .await
        .unwrap();

    s.restart_operator().await;
    let why = format!(
        "another NFD master runs as Deployment {other}/nfd-master beside the one this operator deployed"
    );
    wait::until(TIMEOUT, "status says why our NFD is frozen", || async {
        let message = ready_message(&s.admin, &s.policy).await?;
        Ok(if message.contains(&why) {
            Ok(())
        } else {
            Err(message)
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    assert_eq!(
        ours.get_opt(master)
            .await
            .unwrap()
            .as_ref()
            .map(ResourceExt::uid),
        Some(uid),
        "our NFD master was removed because another NFD appeared"
    );

    delete_namespace(&s.admin, &other).await;
    Api::<ClusterRoleBinding>::all(s.admin.clone())
        .delete(&role, &DeleteParams::default())
        .await
        .unwrap();
    Api::<ClusterRole>::all(s.admin.clone())
        .delete(&role, &DeleteParams::default())
        .await
        .unwrap();
    s.teardown().await;
}

/// Whether `meta` shows the object is ours: our managed-by label and an owner reference to the
/// policy with `uid`.
fn owned_by_us(meta: &kube::api::ObjectMeta, uid: &str) -> bool {
    meta.labels
        .as_ref()
        .and_then(|l| l.get("app.kubernetes.io/managed-by"))
        .is_some_and(|v| v == "gpu-operator")
        && meta.owner_references.iter().flatten().any(|r| r.uid == uid)
}

#[tokio::test]
async fn objects_we_did_not_create_are_left_alone_until_adopted() {
    let Some(prepared) = session::builder().prepare().await else {
        return;
    };
    let admin = prepared.admin.clone();
    let classes: Api<RuntimeClass> = Api::all(admin.clone());
    if classes.get_opt("nvidia").await.unwrap().is_some() {
        classes
            .delete("nvidia", &DeleteParams::default())
            .await
            .unwrap();
    }
    // As k3s creates it when it finds the NVIDIA container runtime.
    let k3s_class = classes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "nvidia", "labels": {"created-by": "k3s"}},
                "handler": "nvidia"
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let (admin, identity, operator) = prepared.start_operator().await;
    let namespace = identity.namespace.clone();
    let config_maps: Api<ConfigMap> = Api::namespaced(admin.clone(), &namespace);
    let left = config_maps
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": OPERAND_CONFIG_MAP},
                "data": {"startup-probe.sh": "#!/bin/sh\n# someone else's\n"}
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let policy = unique_name("cluster-policy");
    session::create_policy(&admin, &policy, json!({})).await;
    let mut s = Setup {
        admin,
        identity,
        operator,
        policy,
    };

    let class_line = "RuntimeClass/nvidia exists and was not created by this operator: delete it, \
                      or annotate it nvidia.com/gpu-operator.adopt=true to make it ours";
    let map_line = format!(
        "ConfigMap/{OPERAND_CONFIG_MAP} in namespace {namespace} exists and was not created by \
         this operator: delete it, or annotate it nvidia.com/gpu-operator.adopt=true"
    );
    wait::until(TIMEOUT, "status names both foreign objects", || async {
        let message = ready_message(&s.admin, &s.policy).await?;
        Ok(
            if message.contains(class_line) && message.contains(&map_line) {
                Ok(())
            } else {
                Err(message)
            },
        )
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    let class = classes.get("nvidia").await.unwrap();
    let map = config_maps.get(OPERAND_CONFIG_MAP).await.unwrap();
    assert_eq!(class.resource_version(), k3s_class.resource_version());
    assert_eq!(map.resource_version(), left.resource_version());
    assert!(class.owner_references().is_empty() && map.owner_references().is_empty());

    // The ConfigMap's owner hands it over; the RuntimeClass stays k3s's.
    let adopt = json!({"metadata": {"annotations": {ADOPT: "true"}}});
    config_maps
        .patch(
            OPERAND_CONFIG_MAP,
            &PatchParams::default(),
            &Patch::Merge(&adopt),
        )
        .await
        .unwrap();
    let policy_uid = session::policies(&s.admin)
        .get(&s.policy)
        .await
        .unwrap()
        .uid()
        .unwrap();
    let uid = policy_uid.clone();
    wait::for_object(
        config_maps.clone(),
        OPERAND_CONFIG_MAP,
        TIMEOUT,
        "the adopted ConfigMap ours",
        move |cm: Option<&ConfigMap>| cm.is_some_and(|cm| owned_by_us(cm.meta(), &uid)),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));

    // Deleting the policy collects what is ours and leaves k3s's RuntimeClass as it was.
    session::policies(&s.admin)
        .delete(&s.policy, &DeleteParams::default())
        .await
        .unwrap();
    wait::until_none_left(
        &s.daemonsets(),
        &kube::api::ListParams::default(),
        TIMEOUT,
        "operands garbage-collected",
    )
    .await
    .unwrap();
    wait::until(
        TIMEOUT,
        "the adopted ConfigMap collected with the policy",
        || async {
            Ok(match config_maps.get_opt(OPERAND_CONFIG_MAP).await? {
                None => Ok(()),
                Some(_) => Err("still there".to_owned()),
            })
        },
    )
    .await
    .unwrap();
    let class = classes.get("nvidia").await.unwrap();
    assert_eq!(
        class.resource_version(),
        k3s_class.resource_version(),
        "k3s's RuntimeClass was changed"
    );

    // Under a new policy, k3s's RuntimeClass adopted becomes ours (and goes with the policy).
    s.policy = unique_name("cluster-policy");
    session::create_policy(&s.admin, &s.policy, json!({})).await;
    classes
        .patch("nvidia", &PatchParams::default(), &Patch::Merge(&adopt))
        .await
        .unwrap();
    let uid = session::policies(&s.admin)
        .get(&s.policy)
        .await
        .unwrap()
        .uid()
        .unwrap();
    wait::for_object(
        classes.clone(),
        "nvidia",
        TIMEOUT,
        "the adopted RuntimeClass ours",
        move |rc: Option<&RuntimeClass>| rc.is_some_and(|rc| owned_by_us(rc.meta(), &uid)),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    s.await_state(State::Ready, "ready once both are ours")
        .await;
    s.teardown().await;
}

/// A RuntimeClass we stop rendering is pruned only when no unfinished pod names it: a user's
/// GPU pod on `nvidia-cdi` keeps it through a switch to CDI off, while `nvidia-legacy`, which
/// no pod names, goes.
#[tokio::test]
async fn a_runtime_class_that_running_pods_name_is_never_pruned() {
    let Some(s) = session::start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "ready with CDI on").await;
    let classes: Api<RuntimeClass> = Api::all(s.admin.clone());
    assert!(classes.get_opt("nvidia-cdi").await.unwrap().is_some());

    let workloads = unique_name("gpu-workloads");
    create_namespace(&s.admin, &workloads).await;
    let node = e2e::nodes::gpu_node_names(&s.admin).await.unwrap()[0].clone();
    let pods: Api<Pod> = Api::namespaced(s.admin.clone(), &workloads);
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "metadata": {"name": "training"},
            "spec": {"nodeName": node, "runtimeClassName": "nvidia-cdi",
                "containers": [{"name": "cuda", "image": "nvcr.io/nvidia/cuda:12.9.0-base-ubuntu22.04"}]}
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    wait::for_object(
        pods.clone(),
        "training",
        TIMEOUT,
        "the GPU workload running",
        |p: Option<&Pod>| {
            p.and_then(|p| p.status.as_ref())
                .and_then(|s| s.phase.as_deref())
                == Some("Running")
        },
    )
    .await
    .unwrap();

    s.patch_policy(json!({"spec": {"cdi": {"enabled": false}}}))
        .await;
    wait::until(
        TIMEOUT,
        "nvidia-legacy, which no pod names, pruned",
        || async {
            Ok(match classes.get_opt("nvidia-legacy").await? {
                None => Ok(()),
                Some(_) => Err("still there".to_owned()),
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    assert!(
        classes.get_opt("nvidia-cdi").await.unwrap().is_some(),
        "a RuntimeClass a running pod names was pruned\n{}",
        s.operator.log_text()
    );

    delete_namespace(&s.admin, &workloads).await;
    s.teardown().await;
}
