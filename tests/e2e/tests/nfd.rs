//! NFD and its CRDs (decision 16): the operator installs NFD's CRDs whenever it deploys NFD and
//! never deletes them; CRDs alone do not mean NFD runs (the NFD it then deploys, run for real,
//! finds a new GPU node), a foreign NFD master does, and status says which it was.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use e2e::nfd::RealNfd;
use e2e::nodes::{self, GpuModel, NFD_NVIDIA_PCI};
use e2e::session::{self, TIMEOUT};
use e2e::wait;
use gpu_operator::api::State;
use gpu_operator::controller::APPLIED_HASH_ANNOTATION;
use gpu_operator::controller::vendored_crds;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Node, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const MASTER: &str = "node-feature-discovery-master";

fn crds(client: &Client) -> Api<CustomResourceDefinition> {
    Api::all(client.clone())
}

#[tokio::test]
async fn nfds_crds_are_installed_with_nfd_and_kept_when_nfd_is_switched_off() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    e2e::nfd::delete_crds(&admin).await.unwrap();
    let Some(s) = session::start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "ready with NFD deployed").await;
    for name in vendored_crds::NAMES {
        let crd = e2e::crd::await_established(&s.admin, name).await.unwrap();
        assert!(
            crd.annotations().contains_key(APPLIED_HASH_ANNOTATION),
            "{name} was not installed by the operator"
        );
    }
    s.patch_policy(json!({"spec": {"nfd": {"enabled": false}}}))
        .await;
    let deployments: Api<Deployment> = Api::namespaced(s.admin.clone(), &s.identity.namespace);
    wait::until(TIMEOUT, "NFD pruned", || {
        let deployments = deployments.clone();
        async move {
            Ok(match deployments.get_opt(MASTER).await? {
                None => Ok(()),
                Some(_) => Err("master still there".to_owned()),
            })
        }
    })
    .await
    .unwrap();
    s.await_state(State::Ready, "ready without NFD").await;
    for name in vendored_crds::NAMES {
        assert!(
            crds(&s.admin).get_opt(name).await.unwrap().is_some(),
            "{name} was deleted with NFD: users' NodeFeatureRules would go with it"
        );
    }
    s.teardown().await;
}

#[tokio::test]
async fn with_nfds_crds_installed_by_hand_and_no_nfd_running_the_operator_still_deploys_nfd() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    e2e::nfd::delete_crds(&admin).await.unwrap();
    // As a user would: NFD's own CRD file, applied by someone else.
    for mut crd in vendored_crds::definitions().unwrap() {
        crd.metadata.annotations = None;
        crds(&admin)
            .patch(
                &crd.name_any(),
                &PatchParams::apply("e2e-user").force(),
                &Patch::Apply(&crd),
            )
            .await
            .unwrap();
        e2e::crd::await_established(&admin, &crd.name_any())
            .await
            .unwrap();
    }
    let Some(s) = session::start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "ready").await;
    let deployments: Api<Deployment> = Api::namespaced(s.admin.clone(), &s.identity.namespace);
    assert!(
        deployments.get_opt(MASTER).await.unwrap().is_some(),
        "served NFD CRDs were taken for a running NFD"
    );
    for name in vendored_crds::NAMES {
        let crd = crds(&s.admin).get(name).await.unwrap();
        assert!(
            crd.annotations().contains_key(APPLIED_HASH_ANNOTATION),
            "{name} was not brought to the deployed NFD's version"
        );
    }
    // And the NFD it deployed works: real NFD finds a GPU node that joins unlabelled.
    let node = session::ephemeral_gpu_node("nfd-by-hand-crds-t4", GpuModel::T4).undiscovered();
    nodes::create(&s.admin, std::slice::from_ref(&node))
        .await
        .unwrap();
    let nfd = RealNfd::start(&s.admin, &s.identity.namespace, std::slice::from_ref(&node))
        .await
        .unwrap();
    let api: Api<Node> = Api::all(s.admin.clone());
    wait::until(TIMEOUT, "the new node found by real NFD", || {
        let api = api.clone();
        async move {
            let labels = api.get("nfd-by-hand-crds-t4").await?.labels().clone();
            Ok(
                if labels.get(NFD_NVIDIA_PCI).map(String::as_str) == Some("true") {
                    Ok(())
                } else {
                    Err(format!("{labels:?}"))
                },
            )
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\nNFD logs:\n{}", nfd.logs()));
    drop(nfd);
    nodes::delete(&s.admin, &[node.name]).await.unwrap();
    e2e::nfd::await_no_annotated_nodes(&s.admin).await.unwrap();
    s.teardown().await;
}

#[tokio::test]
async fn a_foreign_nfd_master_is_left_to_run_and_named_in_status() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    let namespace = e2e::cluster::unique_name("nfd-by-hand");
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": namespace}})).unwrap(),
        )
        .await
        .unwrap();
    // NFD's master runs as a ServiceAccount that may patch nodes, as its Helm chart grants:
    // what makes it count (a Deployment with these labels alone is anyone's to create).
    let account = "nfd-master";
    let role = format!("{namespace}-nfd-master");
    Api::<ServiceAccount>::namespaced(admin.clone(), &namespace)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": account}})).unwrap(),
        )
        .await
        .unwrap();
    Api::<ClusterRole>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": role},
                "rules": [{"apiGroups": [""], "resources": ["nodes"],
                    "verbs": ["get", "list", "watch", "patch", "update"]}]}))
            .unwrap(),
        )
        .await
        .unwrap();
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": role},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]}))
            .unwrap(),
        )
        .await
        .unwrap();
    // NFD as its Helm chart labels it.
    let foreign: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "nfd-master", "labels": {
            "app.kubernetes.io/name": "node-feature-discovery", "role": "master"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app.kubernetes.io/name": "node-feature-discovery"}},
            "template": {
                "metadata": {"labels": {"app.kubernetes.io/name": "node-feature-discovery"}},
                "spec": {"serviceAccountName": account, "containers": [{"name": "nfd-master",
                    "image": "registry.k8s.io/nfd/node-feature-discovery:v0.19.0"}]}
            }
        }
    }))
    .unwrap();
    let foreign_api: Api<Deployment> = Api::namespaced(admin.clone(), &namespace);
    foreign_api
        .create(&PostParams::default(), &foreign)
        .await
        .unwrap();

    let Some(s) = session::start(json!({}), &[]).await else {
        return;
    };
    let ready = s
        .await_state(State::Ready, "ready beside a foreign NFD")
        .await;
    let message = session::ready_condition(&ready).unwrap().message.clone();
    assert!(
        message.contains(&format!(
            "NFD already runs (its master runs as Deployment {namespace}/nfd-master)"
        )),
        "{message}"
    );
    let ours: Api<Deployment> = Api::namespaced(s.admin.clone(), &s.identity.namespace);
    assert!(
        ours.get_opt(MASTER).await.unwrap().is_none(),
        "a second NFD was deployed beside the running one"
    );
    s.teardown().await;
    // Gone before the next test's operator looks for a foreign NFD at its start.
    foreign_api
        .delete("nfd-master", &DeleteParams::default())
        .await
        .unwrap();
    wait::until(TIMEOUT, "the foreign NFD master gone", || {
        let foreign_api = foreign_api.clone();
        async move {
            Ok(match foreign_api.get_opt("nfd-master").await? {
                None => Ok(()),
                Some(_) => Err("still there".to_owned()),
            })
        }
    })
    .await
    .unwrap();
    Api::<ClusterRoleBinding>::all(admin.clone())
        .delete(&role, &DeleteParams::default())
        .await
        .unwrap();
    Api::<ClusterRole>::all(admin.clone())
        .delete(&role, &DeleteParams::default())
        .await
        .unwrap();
    Api::<Namespace>::all(admin.clone())
        .delete(&namespace, &DeleteParams::default())
        .await
        .unwrap();
}
