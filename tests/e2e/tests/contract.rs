//! The operand API contract (docs/operand-api-contract.md, facts in
//! testdata/operand-api-contract.tsv) against the harness, on a plain cluster and on the
//! simulated OpenShift. With a policy that renders every operand and every RBAC-bearing option:
//!
//! - every API a row needs is served (discovery: group/version, resource, subresource);
//! - the API server's authorizer allows every row to the operand's rendered ServiceAccount
//!   (SubjectAccessReview as `system:serviceaccount:<ns>:<sa>`, created by the admin);
//! - no rendered Role or ClusterRole grants an operand ServiceAccount anything no row needs.
//!
//! One cluster has one sandbox mode: the policy renders mode kubevirt first, then is patched to
//! mode kata for the ServiceAccounts only that mode renders (the Kata device plugin, the CC
//! manager).
//!
//! Beside the policy runs a GPUCluster with every RBAC-bearing option (the DRA driver with
//! compute domains, DCGM, the exporter, the DRA validator): created first and Ready, so that the
//! policy's device plugin, which the GPUCluster then reports as a conflict, freezes its objects
//! without deleting them (docs/dra.md).
//!
//! Every failure names the operand, its ServiceAccount and the request. The same checks run
//! offline on a local rendering in `e2e::contract`'s unit tests, which also show that a Role
//! with one rule removed fails them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};

use e2e::contract::{self, Need, Rbac, Row, Scope};
use e2e::dra;
use e2e::openshift;
use e2e::session::{self, Crd, Setup, TIMEOUT, config_map, time_slicing};
use gpu_operator::api::{GPU_CLUSTER_NAME, GPUCluster, GpuClusterState, State};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};

const MANAGED: &str = "app.kubernetes.io/managed-by=gpu-operator";
/// The operator's generated ClusterRole on the simulated OpenShift, under a name of this test's.
const OPERATOR_ROLE: &str = "gpu-operator-e2e-contract";

/// Every Role and binding in the operator namespace, and our ClusterRoles and bindings.
async fn live_rbac(admin: &Client, namespace: &str) -> Rbac {
    let all = ListParams::default();
    let managed = ListParams::default().labels(MANAGED);
    Rbac {
        roles: Api::<Role>::namespaced(admin.clone(), namespace)
            .list(&all)
            .await
            .unwrap()
            .items,
        role_bindings: Api::<RoleBinding>::namespaced(admin.clone(), namespace)
            .list(&all)
            .await
            .unwrap()
            .items,
        cluster_roles: Api::<ClusterRole>::all(admin.clone())
            .list(&managed)
            .await
            .unwrap()
            .items,
        cluster_role_bindings: Api::<ClusterRoleBinding>::all(admin.clone())
            .list(&managed)
            .await
            .unwrap()
            .items,
    }
}

/// Failures of discovery: a row's API version, resource or subresource not served. API
/// versions not served at all are returned separately, with the rows needing them.
async fn discovery_failures(
    admin: &Client,
    rows: &[&Row],
) -> (Vec<String>, BTreeMap<String, Vec<String>>) {
    let mut failures = Vec::new();
    let mut unserved: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut by_version: BTreeMap<String, Vec<&Row>> = BTreeMap::new();
    for row in rows.iter().filter(|r| r.need == Need::Uses && !r.is_none()) {
        by_version.entry(row.api_version()).or_default().push(row);
    }
    for (version, rows) in by_version {
        let listed = if version == "v1" {
            admin.list_core_api_resources("v1").await
        } else {
            admin.list_api_group_resources(&version).await
        };
        let served: BTreeSet<String> = match listed {
            Ok(list) => list.resources.into_iter().map(|r| r.name).collect(),
            Err(kube::Error::Api(e)) if e.code == 404 => {
                unserved.insert(
                    version.clone(),
                    rows.iter()
                        .map(|r| format!("{} ({}): {r}", r.operand, r.service_account))
                        .collect(),
                );
                continue;
            }
            Err(e) => panic!("discovery of {version}: {e}"),
        };
        for row in rows {
            // `finalizers` is no served subresource: RBAC alone knows it (owner references).
            let wanted = match row.subresource.as_deref() {
                Some("finalizers") | None => row.resource.clone(),
                Some(_) => row.rbac_resource(),
            };
            if !served.contains(&wanted) {
                failures.push(format!(
                    "{} (ServiceAccount {}): {row}: {version} does not serve {wanted}",
                    row.operand, row.service_account
                ));
            }
        }
    }
    (failures, unserved)
}

/// Whether the API server's authorizer allows `row` to the operand's ServiceAccount.
async fn authorized(admin: &Client, namespace: &str, row: &Row) -> bool {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(format!(
                "system:serviceaccount:{namespace}:{}",
                row.service_account
            )),
            groups: Some(vec![
                "system:serviceaccounts".to_owned(),
                format!("system:serviceaccounts:{namespace}"),
                "system:authenticated".to_owned(),
            ]),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(row.verb.clone()),
                group: Some(row.group.clone()),
                version: Some(row.version.clone()),
                resource: Some(row.resource.clone()),
                subresource: row.subresource.clone(),
                name: row.name.clone(),
                namespace: match row.scope {
                    Scope::Namespaced => Some(namespace.to_owned()),
                    Scope::Cluster => None,
                },
                ..ResourceAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    };
    let answer = Api::<SubjectAccessReview>::all(admin.clone())
        .create(&PostParams::default(), &review)
        .await
        .unwrap();
    answer.status.is_some_and(|s| s.allowed)
}

/// The ServiceAccounts only the kata policy renders (its Kata device plugin and CC manager):
/// one cluster has one sandbox mode, so the test checks them after patching the policy to it.
fn kata_only_accounts(namespace: &str, openshift: bool) -> BTreeSet<String> {
    let kubevirt = contract::rendered_service_accounts(&contract::policy(), namespace, openshift);
    contract::rendered_service_accounts(&contract::kata_policy(), namespace, openshift)
        .difference(&kubevirt)
        .cloned()
        .collect()
}

/// Every check of the contract for the rows of the ServiceAccounts `checked` selects, on a
/// session whose policy renders them and is ready; the failures, one a line.
async fn contract_failures(
    setup: &Setup,
    openshift: bool,
    checked: impl Fn(&str) -> bool,
) -> Vec<String> {
    let admin = &setup.admin;
    let namespace = &setup.identity.namespace;
    let all: Vec<Row> = contract::rows()
        .into_iter()
        .filter(|r| checked(&r.service_account))
        .collect();
    let rows: Vec<&Row> = all.iter().filter(|r| r.applies(openshift)).collect();
    let mut failures = Vec::new();

    let accounts: BTreeSet<String> = Api::<ServiceAccount>::namespaced(admin.clone(), namespace)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|sa| sa.name_any())
        .collect();
    for (sa, operands) in contract::service_accounts(&all) {
        if !accounts.contains(&sa) {
            failures.push(format!(
                "{}: ServiceAccount {sa} was not rendered",
                operands.into_iter().collect::<Vec<_>>().join(", ")
            ));
        }
    }

    let (discovery, unserved) = discovery_failures(admin, &rows).await;
    failures.extend(discovery);
    // Every API a row needs is served, NFD's included: the operator installs NFD's CRDs
    // whenever it deploys NFD.
    for (version, needing) in &unserved {
        for n in needing {
            failures.push(format!("{n}: {version} is not served"));
        }
    }

    let mut allowed = 0;
    for row in rows.iter().filter(|r| !r.is_none()) {
        if authorized(admin, namespace, row).await {
            allowed += 1;
        } else {
            failures.push(format!(
                "{} ({} container, ServiceAccount {}): SubjectAccessReview denies {row} [{}]",
                row.operand, row.container, row.service_account, row.source
            ));
        }
    }

    let live = live_rbac(admin, namespace).await;
    let excess = contract::excess(&all, openshift, |sa| live.held_by(namespace, sa));
    println!(
        "openshift={openshift}: {} rows ({} uses, {} parity), {allowed} allowed by \
         SubjectAccessReview, {} excess grants",
        rows.len(),
        rows.iter().filter(|r| r.need == Need::Uses).count(),
        rows.iter().filter(|r| r.need == Need::Parity).count(),
        excess.len()
    );
    failures.extend(excess);
    failures
}

/// The sharing ConfigMap the contract policy names (config-manager in three pods).
async fn sharing_config(setup: &Setup) {
    config_map(
        &setup.admin,
        &setup.identity.namespace,
        "sharing",
        &[("default", &time_slicing(2))],
    )
    .await;
}

async fn remove_gpu_cluster(admin: &Client) {
    e2e::dra::remove_gpu_cluster(admin).await.unwrap();
}

/// The contract session: the GPUCluster (stand-in ResourceSlices published, since its pods
/// claim GPUs) created and Ready, then the policy with the sharing ConfigMap, Ready.
async fn start_contract(builder: session::SessionBuilder, what: &str) -> Option<Setup> {
    let prepared = builder.crd(Crd::GpuCluster).prepare().await?;
    remove_gpu_cluster(&prepared.admin).await;
    dra::remove_all(&prepared.admin).await.unwrap();
    dra::publish_fleet(&prepared.admin).await.unwrap();
    let (admin, identity, operator) = prepared.start_operator().await;
    let cluster: GPUCluster = serde_json::from_value(serde_json::json!({
        "apiVersion": "nvidia.com/v1alpha1", "kind": "GPUCluster",
        "metadata": {"name": GPU_CLUSTER_NAME}, "spec": contract::gpu_cluster(),
    }))
    .unwrap();
    Api::<GPUCluster>::all(admin.clone())
        .create(&PostParams::default(), &cluster)
        .await
        .unwrap();
    dra::await_state(
        &admin,
        GpuClusterState::Ready,
        TIMEOUT,
        &format!("contract GPUCluster ready{what}"),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    let policy = e2e::cluster::unique_name("cluster-policy");
    let setup = Setup {
        admin,
        identity,
        operator,
        policy,
    };
    sharing_config(&setup).await;
    session::create_policy(&setup.admin, &setup.policy, contract::policy()).await;
    setup
        .await_state(State::Ready, &format!("contract policy ready{what}"))
        .await;
    Some(setup)
}

/// Deletes the GPUCluster (its objects are garbage-collected) and the stand-in slices, then
/// the policy ([`Setup::teardown`]).
async fn stop_contract(setup: Setup) {
    remove_gpu_cluster(&setup.admin).await;
    dra::remove_all(&setup.admin).await.unwrap();
    setup.teardown().await;
}

/// The contract on the kubevirt policy, then, patched to the kata policy and ready again, on
/// the ServiceAccounts only that one renders.
async fn both_modes_failures(setup: &Setup, openshift: bool, what: &str) -> Vec<String> {
    let kata = kata_only_accounts(&setup.identity.namespace, openshift);
    let mut failures = contract_failures(setup, openshift, |sa| !kata.contains(sa)).await;
    setup
        .patch_policy(serde_json::json!({"spec": contract::kata_policy()}))
        .await;
    // The policy is still Ready from before the patch: wait for the kata operands first.
    let accounts =
        Api::<ServiceAccount>::namespaced(setup.admin.clone(), &setup.identity.namespace);
    e2e::wait::until(TIMEOUT, &format!("kata ServiceAccounts{what}"), || async {
        let live: BTreeSet<String> = accounts
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .map(|sa| sa.name_any())
            .collect();
        let absent: Vec<&String> = kata.iter().filter(|sa| !live.contains(*sa)).collect();
        Ok(if absent.is_empty() {
            Ok(())
        } else {
            Err(format!("{absent:?} absent"))
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", setup.operator.log_text()));
    setup
        .await_state(
            State::Ready,
            &format!("contract policy ready in kata mode{what}"),
        )
        .await;
    failures.extend(contract_failures(setup, openshift, |sa| kata.contains(sa)).await);
    failures
}

#[tokio::test]
async fn every_operand_service_account_may_make_exactly_the_requests_its_binary_makes() {
    let Some(setup) = start_contract(session::builder(), "").await else {
        return;
    };
    let failures = both_modes_failures(&setup, false, "").await;
    stop_contract(setup).await;
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test]
async fn on_openshift_every_operand_may_make_its_requests_and_use_its_scc() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    let failures =
        openshift::run_on_simulated_openshift(&admin, OPERATOR_ROLE, openshift_contract()).await;
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

async fn openshift_contract() -> Vec<String> {
    let builder = session::builder().cluster_role(e2e::operator::generated_role(OPERATOR_ROLE));
    let setup = start_contract(builder, " on OpenShift")
        .await
        .expect("the caller connected to the test cluster");
    let log = setup.operator.log_text();
    assert!(
        log.contains("openshift: true"),
        "the operator did not report OpenShift at start-up:\n{log}"
    );
    let failures = both_modes_failures(&setup, true, " on OpenShift").await;
    stop_contract(setup).await;
    failures
}
