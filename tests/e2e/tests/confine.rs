//! Operand tokens stay on their node, proven with real requests (admission runs only on those,
//! never on a SubjectAccessReview). For the driver, the validator and mig-manager a pod of the
//! operand's ServiceAccount is placed on node A, and a token bound to it (what the kubelet
//! mounts; the API server adds A as the `authentication.kubernetes.io/node-name` claim) then:
//!
//! - driver: patches node A, but not node B;
//! - validator: creates its CUDA workload pod on A, but no pod with another ServiceAccount, a
//!   host path, or on B, and deletes no pod but its workload pods of A;
//! - mig-manager: publishes `A-mig-config`, but neither rewrites its entrypoint ConfigMap nor
//!   writes `B-mig-config`, nor deletes a pod on B.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use e2e::cluster::{own_extra_claim, pod_bound_client, unique_name};
use e2e::nodes::{self, GpuModel};
use e2e::session::{self, Setup, TIMEOUT, ephemeral_gpu_node};
use e2e::wait;
use gpu_operator::api::State;
use gpu_operator::controller::APPLIED_HASH_ANNOTATION;
use gpu_operator::operands::common::NODE_NAME_CLAIM;
use gpu_operator::operands::{driver, mig_manager, validator};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, ServiceAccount};
use kube::Client;
use kube::ResourceExt;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use serde_json::{Value, json};

/// A pod of `service_account` pinned to `node`, as the operand's DaemonSet would place it;
/// `extra` is merged into its spec.
fn pod(
    name: &str,
    namespace: &str,
    service_account: &str,
    node: &str,
    labels: Value,
    extra: Value,
) -> Pod {
    let mut spec = json!({
        "serviceAccountName": service_account,
        "nodeName": node,
        "containers": [{"name": "main", "image": "registry.invalid/pause:1"}],
        "tolerations": [{"operator": "Exists"}],
    });
    if let (Value::Object(spec), Value::Object(extra)) = (&mut spec, extra) {
        spec.extend(extra);
    }
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": spec,
    }))
    .unwrap()
}

/// The operand ServiceAccount exists (the operator created it) and a pod of it runs on `node`;
/// returns a client with that pod's bound token, after checking the claim names `node`.
async fn operand_on(
    admin: &Client,
    namespace: &str,
    service_account: &str,
    node: &str,
) -> (Client, String) {
    let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), namespace);
    wait::until(
        TIMEOUT,
        &format!("ServiceAccount {service_account}"),
        || {
            let accounts = accounts.clone();
            async move {
                Ok(match accounts.get_opt(service_account).await? {
                    Some(sa) => Ok(sa),
                    None => Err("absent".to_owned()),
                })
            }
        },
    )
    .await
    .unwrap();
    let name = unique_name(&format!("{service_account}-holder"));
    let pods: Api<Pod> = Api::namespaced(admin.clone(), namespace);
    let holder = pods
        .create(
            &PostParams::default(),
            &pod(
                &name,
                namespace,
                service_account,
                node,
                json!({}),
                json!({}),
            ),
        )
        .await
        .unwrap();
    let client = pod_bound_client(admin, &holder).await.unwrap();
    assert_eq!(
        own_extra_claim(&client, NODE_NAME_CLAIM).await.unwrap(),
        [node.to_owned()],
        "the API server puts the bound pod's node into the token's {NODE_NAME_CLAIM} claim"
    );
    (client, name)
}

/// The request was refused by the admission policy `policy` (not by RBAC: its message names
/// the policy).
fn assert_denied_by<T: std::fmt::Debug>(result: kube::Result<T>, policy: &str, what: &str) {
    match result {
        Err(kube::Error::Api(e)) => assert!(
            e.message.contains(policy),
            "{what}: refused, but not by admission policy {policy}: {} {}",
            e.code,
            e.message
        ),
        other => panic!("{what}: expected a denial by {policy}, got {other:?}"),
    }
}

/// Waits until the policy's confinement policies are bound (they are applied last).
async fn await_policies(setup: &Setup, names: &[&str]) {
    let bindings = admission_api(&setup.admin, "ValidatingAdmissionPolicyBinding");
    for name in names {
        wait::until(TIMEOUT, &format!("binding {name}"), || {
            let bindings = bindings.clone();
            async move {
                Ok(match bindings.get_opt(name).await? {
                    Some(b) => Ok(b),
                    None => Err("absent".to_owned()),
                })
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", setup.operator.log_text()));
    }
    // A new policy reaches the API server's admission cache within about a second.
    tokio::time::sleep(Duration::from_secs(3)).await;
}

#[tokio::test]
async fn operand_tokens_bound_to_a_pod_write_only_on_their_own_node() {
    let Some(prepared) = session::builder().prepare().await else {
        return;
    };
    let admin = prepared.admin.clone();
    let suffix = unique_name("confine");
    let (node_a, node_b) = (format!("{suffix}-a"), format!("{suffix}-b"));
    nodes::create(
        &admin,
        &[
            ephemeral_gpu_node(&node_a, GpuModel::H100Sxm80Gb),
            ephemeral_gpu_node(&node_b, GpuModel::H100Sxm80Gb),
        ],
    )
    .await
    .unwrap();
    let setup: Setup = prepared.start(json!({})).await;
    let namespace = setup.identity.namespace.clone();
    await_policies(
        &setup,
        &[
            driver::CONFINEMENT_POLICY,
            validator::CONFINEMENT_POLICY,
            mig_manager::CONFINEMENT_POLICY,
        ],
    )
    .await;
    let mut holders = Vec::new();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &namespace);

    // Driver: its own node only.
    let (driver, holder) = operand_on(&admin, &namespace, driver::SERVICE_ACCOUNT, &node_a).await;
    holders.push(holder);
    let nodes_as_driver: Api<Node> = Api::all(driver.clone());
    let label = |value: Value| {
        Patch::Merge(json!({"metadata": {"labels": {"gpu-operator.test/confine": value}}}))
    };
    nodes_as_driver
        .patch(&node_a, &PatchParams::default(), &label(json!("own")))
        .await
        .expect("the driver patches its own node");
    assert_denied_by(
        nodes_as_driver
            .patch(&node_b, &PatchParams::default(), &label(json!("other")))
            .await,
        driver::CONFINEMENT_POLICY,
        "driver token patching another node",
    );

    // Validator: only its workload pod, on its node, as itself, without host paths.
    let (validator_client, holder) =
        operand_on(&admin, &namespace, validator::SERVICE_ACCOUNT, &node_a).await;
    holders.push(holder);
    let pods_as_validator: Api<Pod> = Api::namespaced(validator_client.clone(), &namespace);
    let workload_labels = json!({"app": validator::WORKLOAD_APPS[0]});
    let workload = |name: &str, sa: &str, node: &str, extra: Value| {
        pod(name, &namespace, sa, node, workload_labels.clone(), extra)
    };
    let create = PostParams::default();
    assert_denied_by(
        pods_as_validator
            .create(
                &create,
                &workload(&unique_name("as-operator"), "default", &node_a, json!({})),
            )
            .await,
        validator::CONFINEMENT_POLICY,
        "validator token creating a pod of another ServiceAccount",
    );
    let host_path = json!({"volumes": [{"name": "root", "hostPath": {"path": "/"}}]});
    assert_denied_by(
        pods_as_validator
            .create(
                &create,
                &workload(
                    &unique_name("host"),
                    validator::SERVICE_ACCOUNT,
                    &node_a,
                    host_path,
                ),
            )
            .await,
        validator::CONFINEMENT_POLICY,
        "validator token creating a pod with a host path",
    );
    assert_denied_by(
        pods_as_validator
            .create(
                &create,
                &workload(
                    &unique_name("elsewhere"),
                    validator::SERVICE_ACCOUNT,
                    &node_b,
                    json!({}),
                ),
            )
            .await,
        validator::CONFINEMENT_POLICY,
        "validator token creating a pod on another node",
    );
    let unlabelled = pod(
        &unique_name("unlabelled"),
        &namespace,
        validator::SERVICE_ACCOUNT,
        &node_a,
        json!({"app": "something-else"}),
        json!({}),
    );
    assert_denied_by(
        pods_as_validator.create(&create, &unlabelled).await,
        validator::CONFINEMENT_POLICY,
        "validator token creating a pod without a workload label",
    );
    let allowed = unique_name("nvidia-cuda-validator");
    pods_as_validator
        .create(
            &create,
            &workload(&allowed, validator::SERVICE_ACCOUNT, &node_a, json!({})),
        )
        .await
        .expect("the validator creates its workload pod on its own node");
    assert_denied_by(
        pods_as_validator
            .delete(&holders[0], &DeleteParams::default())
            .await,
        validator::CONFINEMENT_POLICY,
        "validator token deleting a pod that is not its workload",
    );
    pods_as_validator
        .delete(&allowed, &DeleteParams::default())
        .await
        .expect("the validator deletes its workload pod");

    // mig-manager: its own node's ConfigMap and pods, never an entrypoint.
    let (mig, holder) = operand_on(&admin, &namespace, mig_manager::SERVICE_ACCOUNT, &node_a).await;
    holders.push(holder);
    let config_maps_as_mig: Api<ConfigMap> = Api::namespaced(mig.clone(), &namespace);
    let config_maps: Api<ConfigMap> = Api::namespaced(admin.clone(), &namespace);
    let entrypoint_name = entrypoint_config_map(&setup).await;
    let mut entrypoint = config_maps_as_mig.get(&entrypoint_name).await.unwrap();
    entrypoint.data.get_or_insert_default().insert(
        "entrypoint.sh".to_owned(),
        "#!/bin/sh\nexec sh\n".to_owned(),
    );
    match config_maps_as_mig
        .replace(&entrypoint_name, &PostParams::default(), &entrypoint)
        .await
    {
        Err(kube::Error::Api(e)) => assert!(
            e.message.contains(mig_manager::CONFINEMENT_POLICY) || e.message.contains("immutable"),
            "mig-manager token rewriting {entrypoint_name}: refused for another reason: {}",
            e.message
        ),
        other => panic!("mig-manager token rewrote entrypoint {entrypoint_name}: {other:?}"),
    }
    let node_config = |node: &str| -> ConfigMap {
        serde_json::from_value(json!({
            "metadata": {"name": format!("{node}{}", mig_manager::NODE_CONFIG_MAP_SUFFIX)},
            "data": {"config.yaml": "version: v1\n"},
        }))
        .unwrap()
    };
    config_maps_as_mig
        .create(&create, &node_config(&node_a))
        .await
        .expect("mig-manager publishes its own node's layouts");
    assert_denied_by(
        config_maps_as_mig
            .create(&create, &node_config(&node_b))
            .await,
        mig_manager::CONFINEMENT_POLICY,
        "mig-manager token writing another node's ConfigMap",
    );
    let victim = unique_name("victim");
    pods.create(
        &create,
        &pod(
            &victim,
            &namespace,
            "default",
            &node_b,
            json!({}),
            json!({}),
        ),
    )
    .await
    .unwrap();
    assert_denied_by(
        Api::<Pod>::namespaced(mig.clone(), &namespace)
            .delete(&victim, &DeleteParams::default())
            .await,
        mig_manager::CONFINEMENT_POLICY,
        "mig-manager token deleting a pod on another node",
    );
    let nodes_as_mig: Api<Node> = Api::all(mig.clone());
    assert_denied_by(
        nodes_as_mig
            .patch(&node_b, &PatchParams::default(), &label(json!("other")))
            .await,
        mig_manager::CONFINEMENT_POLICY,
        "mig-manager token patching another node",
    );

    // Clean up what this test made besides the session.
    config_maps
        .delete(
            &format!("{node_a}{}", mig_manager::NODE_CONFIG_MAP_SUFFIX),
            &DeleteParams::default(),
        )
        .await
        .unwrap();
    for name in holders.iter().chain([&victim]) {
        pods.delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }
    setup.teardown().await;
    nodes::delete(&admin, &[node_a, node_b]).await.unwrap();
}

/// An admission-registration API of `kind` (a policy or its binding).
fn admission_api(admin: &Client, kind: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", kind);
    Api::all_with(admin.clone(), &ApiResource::from_gvk(&gvk))
}

/// The confinement policies are cached nowhere by the operator, yet they are what keeps a
/// driver token off other nodes: deleting a binding or editing a policy at steady state (a
/// converged, ready policy; nothing else wakes the reconcile) must be undone by the operator.
#[tokio::test]
async fn a_deleted_binding_or_edited_confinement_policy_is_restored_at_steady_state() {
    let Some(setup) = session::start(json!({}), &[]).await else {
        return;
    };
    await_policies(&setup, &[driver::CONFINEMENT_POLICY]).await;
    setup
        .await_state(State::Ready, "ready before the tampering")
        .await;
    let policies = admission_api(&setup.admin, "ValidatingAdmissionPolicy");
    let bindings = admission_api(&setup.admin, "ValidatingAdmissionPolicyBinding");
    let name = driver::CONFINEMENT_POLICY;
    let rendered = policies.get(name).await.unwrap();
    let rendered_hash = rendered.annotations().get(APPLIED_HASH_ANNOTATION).cloned();

    bindings
        .delete(name, &DeleteParams::default())
        .await
        .unwrap();
    policies
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({
                "metadata": {"annotations": {APPLIED_HASH_ANNOTATION: "tampered"}},
                "spec": {"validations": [{"expression": "true"}]},
            })),
        )
        .await
        .unwrap();

    wait::until(
        Duration::from_secs(60),
        "binding and policy restored",
        || {
            let (policies, bindings) = (policies.clone(), bindings.clone());
            let rendered = rendered.clone();
            let rendered_hash = rendered_hash.clone();
            async move {
                let binding = bindings.get_opt(name).await?;
                let policy = policies.get(name).await?;
                let hash = policy.annotations().get(APPLIED_HASH_ANNOTATION).cloned();
                Ok(
                    if binding.is_some()
                        && hash == rendered_hash
                        && policy.data["spec"] == rendered.data["spec"]
                    {
                        Ok(())
                    } else {
                        Err(format!(
                            "binding present: {}, policy hash {hash:?}",
                            binding.is_some()
                        ))
                    },
                )
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", setup.operator.log_text()));
    setup.teardown().await;
}

/// The ConfigMap mig-manager's DaemonSet mounts at `/bin/entrypoint.sh`.
async fn entrypoint_config_map(setup: &Setup) -> String {
    let ds = wait::until(TIMEOUT, "mig-manager DaemonSet", || {
        let api = setup.daemonsets();
        async move {
            Ok(match api.get_opt(mig_manager::NAME).await? {
                Some(ds) => Ok(ds),
                None => Err("absent".to_owned()),
            })
        }
    })
    .await
    .unwrap();
    let pod = ds.spec.unwrap().template.spec.unwrap();
    let volume = pod
        .containers
        .iter()
        .flat_map(|c| c.volume_mounts.iter().flatten())
        .find(|m| m.mount_path == "/bin/entrypoint.sh")
        .map(|m| m.name.clone())
        .expect("mig-manager mounts an entrypoint");
    pod.volumes
        .unwrap()
        .into_iter()
        .find(|v| v.name == volume)
        .and_then(|v| v.config_map)
        .map(|c| c.name)
        .expect("the entrypoint volume is a ConfigMap")
}
