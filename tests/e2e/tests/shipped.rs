//! What users copy works as shipped: NVIDIA's documented MIG JSON patch applies to the policy
//! `helm install` created (it needs `spec.migManager.config` to exist), and with the chart's
//! `ci/time-slicing-values.yaml` a GPU node that joins after the install is found by the real
//! NFD (`e2e::nfd`: nfd-master and nfd-worker as the pods kwok only pretends to run) and taken
//! for a GPU node by the operator.
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
use e2e::tools::repo_root;
use e2e::wait;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams};

/// The ClusterPolicy the chart creates.
const POLICY: &str = "cluster-policy";
const GPU_PRESENT: &str = "nvidia.com/gpu.present";
const TIMEOUT: Duration = Duration::from_secs(120);

/// The patch as NVIDIA's MIG documentation types it.
const NVIDIA_MIG_PATCH: &str =
    r#"[{"op":"replace","path":"/spec/migManager/config/name","value":"custom-mig-config"}]"#;

fn labels(node: &Node) -> BTreeMap<String, String> {
    node.metadata.labels.clone().unwrap_or_default()
}

/// A clean slate: no release, no policy, NFD's CRDs gone and no node left annotated by a master.
async fn clean(admin: &Client, crd_manager: &str) {
    e2e::helm::remove_releases(admin).await;
    e2e::crd::install_cluster_policy_crd(admin, crd_manager)
        .await
        .unwrap();
    session::remove_leftovers(admin).await;
}

/// The documented teardown: the policy deleted (the chart keeps it on uninstall), the release,
/// the namespace.
async fn uninstall(admin: &Client, namespace: &str, operator: Option<&Operator>) {
    let policies = session::policies(admin);
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
    .unwrap_or_else(|e| {
        panic!(
            "{e}\noperator log:\n{}",
            operator.map(Operator::log_text).unwrap_or_default()
        )
    });
    helm_ok(&strings(&[
        "uninstall",
        RELEASE,
        "--namespace",
        namespace,
        "--wait",
    ]));
    Api::<Namespace>::all(admin.clone())
        .delete(namespace, &DeleteParams::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn nvidias_mig_json_patch_applies_to_the_policy_helm_install_created() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    clean(&admin, "e2e-shipped-mig").await;
    let namespace = release_namespace(&admin).await;
    helm_release("install", &namespace, &[]);

    let patched = e2e::kubectl()
        .args([
            "patch",
            &format!("clusterpolicy/{POLICY}"),
            "--type=json",
            &format!("-p={NVIDIA_MIG_PATCH}"),
        ])
        .output()
        .unwrap();
    assert!(
        patched.status.success(),
        "NVIDIA's MIG patch failed on the chart's policy: {}",
        String::from_utf8_lossy(&patched.stderr)
    );
    let policy = session::policies(&admin).get(POLICY).await.unwrap();
    let config = policy
        .spec
        .mig_manager
        .as_ref()
        .and_then(|m| m.config.as_ref())
        .expect("no spec.migManager.config after the patch");
    assert_eq!(config.name.as_deref(), Some("custom-mig-config"));

    uninstall(&admin, &namespace, None).await;
}

#[tokio::test]
async fn with_the_time_slicing_values_a_gpu_node_joining_after_install_is_found_by_nfd() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    clean(&admin, "e2e-shipped-nfd").await;
    e2e::nfd::delete_crds(&admin).await.unwrap();
    e2e::nfd::await_no_annotated_nodes(&admin).await.unwrap();

    // Before the install: one CPU node that NFD has not seen yet.
    let cpu = FakeNode::cpu("late-nfd-cpu")
        .undiscovered()
        .label(EPHEMERAL, "true");
    nodes::create(&admin, std::slice::from_ref(&cpu))
        .await
        .unwrap();

    let namespace = release_namespace(&admin).await;
    let values = repo_root().join("charts/gpu-operator/ci/time-slicing-values.yaml");
    helm_release(
        "install",
        &namespace,
        &strings(&["-f", &values.display().to_string()]),
    );
    for name in gpu_operator::controller::vendored_crds::NAMES {
        e2e::crd::await_established(&admin, name).await.unwrap();
    }
    let identity = OperatorIdentity::existing(&admin, &namespace, "gpu-operator")
        .await
        .unwrap();
    let operator = Operator::start_as_pod(&identity, &format!("{RELEASE}-e2e")).unwrap();
    wait::until(TIMEOUT, "NFD worker and master applied", || {
        let workers = Api::<DaemonSet>::namespaced(admin.clone(), &namespace);
        let masters = Api::<Deployment>::namespaced(admin.clone(), &namespace);
        async move {
            let both = workers.get_opt(WORKER).await?.is_some()
                && masters.get_opt(MASTER).await?.is_some();
            Ok(if both {
                Ok(())
            } else {
                Err("not yet".to_owned())
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    let mut nfd = RealNfd::start(&admin, &namespace, std::slice::from_ref(&cpu))
        .await
        .unwrap_or_else(|e| panic!("{e:#}\noperator log:\n{}", operator.log_text()));

    // A GPU node joins: its worker must be placed there (an affinity on NFD's own label would
    // keep it off), find the board, and nfd-master label the node.
    let late = FakeNode::gpu("late-nfd-t4", GpuModel::T4)
        .undiscovered()
        .label(EPHEMERAL, "true");
    nodes::create(&admin, std::slice::from_ref(&late))
        .await
        .unwrap();
    nfd.add_workers(&admin, &namespace, std::slice::from_ref(&late))
        .await
        .unwrap_or_else(|e| {
            panic!("{e:#}: the time-slicing values keep NFD's worker off a GPU node that joined after install")
        });
    let nodes_api: Api<Node> = Api::all(admin.clone());
    let late_name = late.name.as_str();
    wait::until(
        TIMEOUT,
        "the late GPU node labelled by NFD, then marked",
        || {
            let nodes_api = nodes_api.clone();
            async move {
                let node = nodes_api.get(late_name).await?;
                let labels = labels(&node);
                Ok(
                    match (
                        labels.get(NFD_NVIDIA_PCI).map(String::as_str),
                        labels.get(GPU_PRESENT).map(String::as_str),
                    ) {
                        (Some("true"), Some("true")) => Ok(()),
                        _ => Err(format!("labels {labels:?}")),
                    },
                )
            }
        },
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}\noperator log:\n{}\nNFD logs:\n{}",
            operator.log_text(),
            nfd.logs()
        )
    });
    nfd.ensure_running().unwrap();

    drop(nfd);
    uninstall(&admin, &namespace, Some(&operator)).await;
    let mut operator = operator;
    let _ = operator.terminate(Duration::from_secs(20));
    nodes::delete(&admin, &[cpu.name.clone(), late.name.clone()])
        .await
        .unwrap();
    e2e::nfd::await_no_annotated_nodes(&admin).await.unwrap();
}
