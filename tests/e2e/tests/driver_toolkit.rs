//! OpenShift's Driver Toolkit on the simulated OpenShift (docs/operand-facts.md §3.3): GPU nodes
//! of two RHCOS versions get one driver DaemonSet each with the version's toolkit image from
//! ImageStream `openshift/driver-toolkit`; a node of a third version gets a third; that
//! version's tag removed, status names the version and its node while every pool stays; and
//! the running toolkit fleet is switched back to the standard driver only node by node. An
//! NVIDIADriver pool gets its own toolkit DaemonSet per RHCOS version of its nodes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};

use e2e::crd::TemporaryCrd;
use e2e::session::{self, Crd, TIMEOUT};
use e2e::wait;
use e2e::{nodes, openshift};
use gpu_operator::api::{NVIDIADriver, NvidiaDriverState, State};
use gpu_operator::nodes::OSTREE_VERSION;
use gpu_operator::operands::driver_toolkit::{CONTAINER, IMAGE_STREAM, IMAGE_STREAM_NAMESPACE};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use kube::{Client, ResourceExt};
use serde_json::json;

const OPERATOR_ROLE: &str = "gpu-operator-e2e-driver-toolkit";
const CRD: &str = "imagestreams.image.openshift.io";
const V414: &str = "414.92.202407091253-0";
const V415: &str = "415.92.202407091355-0";
const V416: &str = "416.94.202410211619-0";

/// OpenShift serves ImageStreams from its own API server; here a CRD with the same group,
/// version, kind and plural stands in. Its schema is a minimal structural one that keeps every
/// field (x-kubernetes-preserve-unknown-fields), not openshift/api's: the operator reads only
/// `spec.tags[].name` and `spec.tags[].from.name`. Dropping the guard removes the CRD (its
/// ImageStreams with it) and namespace `openshift`, so other suites see no such API.
fn install_image_stream_api() -> TemporaryCrd {
    let manifest = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: imagestreams.image.openshift.io
spec:
  group: image.openshift.io
  scope: Namespaced
  names: {plural: imagestreams, singular: imagestream, kind: ImageStream, listKind: ImageStreamList}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec: {type: object, x-kubernetes-preserve-unknown-fields: true}
          status: {type: object, x-kubernetes-preserve-unknown-fields: true}
---
apiVersion: v1
kind: Namespace
metadata:
  name: openshift
"#;
    let file = std::env::temp_dir().join(format!("e2e-imagestream-{}.yaml", std::process::id()));
    std::fs::write(&file, manifest).unwrap();
    let crd = TemporaryCrd::apply(&file, CRD);
    let _ = std::fs::remove_file(&file);
    crd.unwrap().also_removing("openshift")
}

fn image_streams(client: &Client) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("image.openshift.io", "v1", "ImageStream"),
        "imagestreams",
    );
    Api::namespaced_with(client.clone(), IMAGE_STREAM_NAMESPACE, &resource)
}

fn toolkit_image(version: &str) -> String {
    let digest: String = version
        .chars()
        .filter(char::is_ascii_digit)
        .take(3)
        .collect();
    format!(
        "quay.io/openshift-release-dev/ocp-v4.0-art-dev@sha256:{}",
        digest.repeat(22)[..64].to_owned()
    )
}

/// The ImageStream as OpenShift writes it: a `spec.tags` entry per RHCOS version pointing at
/// the release's toolkit image, `latest`, and the imported digests in `status.tags`.
fn image_stream(versions: &[&str]) -> serde_json::Value {
    let tag = |name: &str, version: &str| {
        json!({"name": name, "from": {"kind": "DockerImage", "name": toolkit_image(version)},
               "importPolicy": {}, "referencePolicy": {"type": "Source"}})
    };
    let mut spec_tags: Vec<_> = versions.iter().map(|v| tag(v, v)).collect();
    spec_tags.push(tag("latest", versions[versions.len() - 1]));
    let status_tags: Vec<_> = versions
        .iter()
        .map(|v| {
            json!({"tag": v, "items": [{"dockerImageReference": toolkit_image(v),
            "image": toolkit_image(v).split('@').nth(1).unwrap(), "generation": 1,
            "created": "2024-07-09T12:53:00Z"}]})
        })
        .collect();
    json!({
        "apiVersion": "image.openshift.io/v1", "kind": "ImageStream",
        "metadata": {"name": IMAGE_STREAM, "namespace": IMAGE_STREAM_NAMESPACE},
        "spec": {"lookupPolicy": {"local": false}, "tags": spec_tags},
        "status": {"dockerImageRepository": "", "tags": status_tags},
    })
}

async fn write_image_stream(client: &Client, versions: &[&str]) {
    image_streams(client)
        .patch(
            IMAGE_STREAM,
            &PatchParams::apply("e2e-openshift").force(),
            &Patch::Apply(image_stream(versions)),
        )
        .await
        .unwrap();
}

async fn set_rhcos(admin: &Client, node: &str, version: Option<&str>) {
    nodes::set_label(admin, node, OSTREE_VERSION, version)
        .await
        .unwrap();
}

fn pool(version: &str) -> String {
    format!("nvidia-driver-daemonset-{version}")
}

/// Driver DaemonSet name -> its toolkit container's image.
async fn toolkit_pools(admin: &Client, namespace: &str) -> BTreeMap<String, String> {
    Api::<DaemonSet>::namespaced(admin.clone(), namespace)
        .list(&ListParams::default().labels("openshift.driver-toolkit=true"))
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|ds| {
            let image = ds
                .spec
                .as_ref()
                .and_then(|s| s.template.spec.as_ref())
                .and_then(|p| p.containers.iter().find(|c| c.name == CONTAINER))
                .and_then(|c| c.image.clone())
                .unwrap_or_default();
            (ds.name_any(), image)
        })
        .collect()
}

#[tokio::test]
async fn each_rhcos_version_gets_its_toolkit_pool_and_a_version_losing_its_tag_is_reported() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    openshift::run_on_simulated_openshift(&admin, OPERATOR_ROLE, steps(&admin)).await;
}

async fn steps(admin: &Client) {
    let _api = install_image_stream_api();
    write_image_stream(admin, &[V414, V415, V416]).await;
    let mut gpu_nodes = e2e::nodes::gpu_node_names(admin).await.unwrap();
    gpu_nodes.sort();
    assert!(gpu_nodes.len() >= 3, "{gpu_nodes:?}");
    let joining = gpu_nodes[0].clone();
    let (old, new) = gpu_nodes.split_at(gpu_nodes.len() / 2);
    for node in old {
        set_rhcos(admin, node, Some(V414)).await;
    }
    for node in new {
        set_rhcos(admin, node, Some(V415)).await;
    }
    let s = openshift::start_with_generated_role(
        OPERATOR_ROLE,
        json!({"operator": {"use_ocp_driver_toolkit": true}}),
    )
    .await;
    s.await_state(State::Ready, "toolkit policy ready").await;
    let namespace = s.identity.namespace.clone();
    let pools = toolkit_pools(admin, &namespace).await;
    assert_eq!(
        pools,
        BTreeMap::from([
            (pool(V414), toolkit_image(V414)),
            (pool(V415), toolkit_image(V415)),
        ]),
        "operator log:\n{}",
        s.operator.log_text()
    );
    assert!(
        Api::<DaemonSet>::namespaced(admin.clone(), &namespace)
            .get_opt("nvidia-driver-daemonset")
            .await
            .unwrap()
            .is_none()
    );

    // A node of a third RHCOS version (an upgrade reached it): a third pool.
    set_rhcos(admin, &joining, Some(V416)).await;
    wait::until(TIMEOUT, "a pool for the third RHCOS version", || {
        let (admin, namespace) = (admin.clone(), namespace.clone());
        async move {
            let pools = toolkit_pools(&admin, &namespace).await;
            let want: BTreeSet<String> = [pool(V414), pool(V415), pool(V416)].into();
            Ok(
                if pools.keys().cloned().collect::<BTreeSet<_>>() == want
                    && pools[&pool(V416)] == toolkit_image(V416)
                {
                    Ok(())
                } else {
                    Err(format!("{pools:?}"))
                },
            )
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));

    // The third version's tag goes: status names the version and its node; every pool stays,
    // the third keeping the image it runs.
    write_image_stream(admin, &[V414, V415]).await;
    let policy = s.policy.clone();
    wait::until(TIMEOUT, "status names the untagged version", || {
        let (admin, policy, joining) = (admin.clone(), policy.clone(), joining.clone());
        async move {
            let message = session::ready_message(&admin, &policy).await?;
            Ok(
                if message.contains(&format!("no tag {V416}")) && message.contains(&joining) {
                    Ok(())
                } else {
                    Err(message)
                },
            )
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    assert_eq!(
        toolkit_pools(admin, &namespace).await,
        BTreeMap::from([
            (pool(V414), toolkit_image(V414)),
            (pool(V415), toolkit_image(V415)),
            (pool(V416), toolkit_image(V416)),
        ])
    );

    // Switching the running toolkit fleet back to the standard driver, with automatic
    // upgrades off: nothing is torn down; the standard DaemonSet waits for nodes handed to it,
    // and status says how to hand them over.
    s.patch_policy(json!({"spec": {"operator": {"use_ocp_driver_toolkit": false}}}))
        .await;
    wait::until(
        TIMEOUT,
        "the switch back waits for nodes handed over",
        || {
            let (admin, policy) = (admin.clone(), policy.clone());
            async move {
                let message = session::ready_message(&admin, &policy).await?;
                Ok(
                    if message.contains(
                        "switching from drivers built with the Driver Toolkit to drivers built on \
                     the node",
                    ) && message.contains("nvidia.com/gpu-operator.driver-variant=built-on-node")
                    {
                        Ok(())
                    } else {
                        Err(message)
                    },
                )
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    assert_eq!(toolkit_pools(admin, &namespace).await.len(), 3);
    assert!(
        Api::<DaemonSet>::namespaced(admin.clone(), &namespace)
            .get_opt("nvidia-driver-daemonset")
            .await
            .unwrap()
            .is_some()
    );
    let standard_pods = Api::<Pod>::namespaced(admin.clone(), &namespace)
        .list(&ListParams::default().labels("app.kubernetes.io/component=nvidia-driver"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| {
            p.owner_references()
                .iter()
                .any(|o| o.name == "nvidia-driver-daemonset")
        })
        .count();
    assert_eq!(
        standard_pods, 0,
        "no node was handed to the standard driver"
    );

    s.teardown().await;
    for node in &gpu_nodes {
        set_rhcos(admin, node, None).await;
    }
}

const POOL_ROLE: &str = "gpu-operator-e2e-driver-toolkit-pool";
const POOL_LABEL: &str = "nvidia.com/gpu-operator.nvidiadriver";

#[tokio::test]
async fn an_nvidia_driver_pool_gets_a_toolkit_daemonset_per_rhcos_version_of_its_nodes() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    openshift::run_on_simulated_openshift(&admin, POOL_ROLE, pool_steps(&admin)).await;
}

async fn pool_steps(admin: &Client) {
    let _api = install_image_stream_api();
    write_image_stream(admin, &[V414, V415]).await;
    let mut gpu_nodes = e2e::nodes::gpu_node_names(admin).await.unwrap();
    gpu_nodes.sort();
    assert!(gpu_nodes.len() >= 2, "{gpu_nodes:?}");
    let (old, new) = gpu_nodes.split_at(gpu_nodes.len() / 2);
    for node in old {
        set_rhcos(admin, node, Some(V414)).await;
    }
    for node in new {
        set_rhcos(admin, node, Some(V415)).await;
    }
    let s = session::builder()
        .crd(Crd::NvidiaDriver)
        .cluster_role(e2e::operator::generated_role(POOL_ROLE))
        .start(json!({"operator": {"use_ocp_driver_toolkit": true},
                      "driver": {"useNvidiaDriverCRD": true}}))
        .await
        .expect("the caller connected to the test cluster");
    // No nodeSelector: every GPU node is the pool's.
    let drivers = Api::<NVIDIADriver>::all(admin.clone());
    let pool: NVIDIADriver = serde_json::from_value(json!({
        "apiVersion": "nvidia.com/v1alpha1", "kind": "NVIDIADriver",
        "metadata": {"name": "dtk"},
        "spec": {"driverType": "gpu", "repository": "nvcr.io/nvidia", "image": "driver",
                 "version": "580.95.05"}
    }))
    .unwrap();
    drivers.create(&PostParams::default(), &pool).await.unwrap();
    let namespace = s.identity.namespace.clone();
    let name = |v: &str| format!("nvidia-gpu-driver-dtk-{v}");
    wait::until(
        TIMEOUT,
        "a toolkit DaemonSet per RHCOS version of the pool",
        || {
            let (admin, namespace, drivers) = (admin.clone(), namespace.clone(), drivers.clone());
            async move {
                let pools = toolkit_pools(&admin, &namespace).await;
                let want = BTreeMap::from([
                    (name(V414), toolkit_image(V414)),
                    (name(V415), toolkit_image(V415)),
                ]);
                let state = drivers.get("dtk").await?.status.map(|s| s.state);
                Ok(
                    if pools == want && state == Some(NvidiaDriverState::Ready) {
                        Ok(())
                    } else {
                        Err(format!("{pools:?}, {state:?}"))
                    },
                )
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    let daemonsets = Api::<DaemonSet>::namespaced(admin.clone(), &namespace);
    for (v, nodes) in [(V414, old), (V415, new)] {
        let d = daemonsets.get(&name(v)).await.unwrap();
        assert_eq!(d.labels()["openshift.driver-toolkit.rhcos"], v);
        let pod = d.spec.unwrap().template.spec.unwrap();
        assert_eq!(pod.node_selector.unwrap()[OSTREE_VERSION], v);
        for node in nodes {
            let n = Api::<k8s_openapi::api::core::v1::Node>::all(admin.clone())
                .get(node)
                .await
                .unwrap();
            assert_eq!(n.labels().get(POOL_LABEL).map(String::as_str), Some("dtk"));
        }
    }

    drivers
        .delete("dtk", &DeleteParams::default())
        .await
        .unwrap();
    wait::until_none_left(
        &drivers,
        &ListParams::default(),
        TIMEOUT,
        "NVIDIADriver gone",
    )
    .await
    .unwrap();
    s.teardown().await;
    for node in &gpu_nodes {
        set_rhcos(admin, node, None).await;
        nodes::set_label(admin, node, POOL_LABEL, None)
            .await
            .unwrap();
    }
}
