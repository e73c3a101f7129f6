//! The OLM bundle installed by real OLM: OLM's olm-operator (operator-lifecycle-manager at the
//! pinned release, `e2e::olm`) runs on the harness; the bundle's CRDs and CSV are applied in a
//! namespace with an OperatorGroup, with the RBAC OLM's resolver makes from the CSV's permissions
//! (what the catalog operator's InstallPlan would create), and the CSV reaches `Succeeded` once
//! the Deployment OLM created is Available (kwok runs its pod on a fake node). Then that
//! Deployment's container is run as the operator, with its args and env and the token of its
//! ServiceAccount, so the RBAC OLM generated is its only authority: a policy converges to
//! `ready`. With one permission taken out of the CSV, it fails naming the request denied.
//!
//! Installing from a catalog (CatalogSource, Subscription, the catalog operator's InstallPlan,
//! an upgrade through the channel) is tests/e2e/tests/olm_catalog.rs; this test keeps the CSV
//! and RBAC checks that need a CSV changed before OLM sees it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::Duration;

use e2e::olm::{self, Olm};
use e2e::operator::{Operator, OperatorIdentity};
use e2e::session::{self, TIMEOUT};
use e2e::wait;
use gpu_operator::api::State;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use kube::runtime::wait::conditions;
use serde_json::{Value, json};
use xtask::bundle::{CRD_FILE, CSV_FILE, NFD_CRD_FILES};

/// How long OLM may take to install the CSV (its requeues are seconds apart).
const INSTALL_TIMEOUT: Duration = Duration::from_secs(240);

fn bundle_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bundle")
}

fn committed_csv() -> Value {
    serde_yaml_ng::from_str(&std::fs::read_to_string(bundle_dir().join(CSV_FILE)).unwrap()).unwrap()
}

fn csv_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("operators.coreos.com", "v1alpha1", "ClusterServiceVersion"),
        "clusterserviceversions",
    )
}

/// The bundle's CRDs, applied as the catalog operator applies a bundle's (the ClusterPolicy
/// CRD with the field manager the other tests use for the identical crds/ copy).
async fn apply_bundle_crds(admin: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    for file in std::iter::once(CRD_FILE).chain(NFD_CRD_FILES) {
        let crd: CustomResourceDefinition =
            serde_yaml_ng::from_str(&std::fs::read_to_string(bundle_dir().join(file)).unwrap())
                .unwrap();
        let name = crd.metadata.name.clone().unwrap();
        crds.patch(
            &name,
            &PatchParams::apply(session::CRD_FIELD_MANAGER).force(),
            &Patch::Apply(&crd),
        )
        .await
        .unwrap();
        // As OLM installs them: without the hash an operator that applied them earlier in this
        // harness left (`nvidia.com/gpu-operator.applied-hash`), which would spare it the write.
        crds.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"nvidia.com/gpu-operator.applied-hash": null}}})),
        )
        .await
        .unwrap();
        wait::for_object(
            crds.clone(),
            &name,
            Duration::from_secs(60),
            "CRD established",
            conditions::is_crd_established(),
        )
        .await
        .unwrap();
    }
}

/// An install in progress: OLM, the namespace with its OperatorGroup and the CSV, and the RBAC
/// OLM generated for it.
struct Install {
    admin: Client,
    olm: Olm,
    namespace: String,
    rbac: Vec<DynamicObject>,
}

impl Install {
    /// Starts OLM and installs `csv` (the committed one, or a changed copy) the way OLM does;
    /// `None` where this run has no test cluster (the test is skipped).
    async fn start(csv: Value) -> Option<Self> {
        let admin = e2e::connect().await?;
        apply_bundle_crds(&admin).await;
        session::remove_leftovers(&admin).await;
        let olm = Olm::start(&admin).await.unwrap();
        let namespace = e2e::cluster::unique_name("olm-gpu-operator");
        let mut ns = Namespace::default();
        ns.metadata.name = Some(namespace.clone());
        Api::<Namespace>::all(admin.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap();
        // OwnNamespace: the OperatorGroup targets the install namespace.
        let group: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "operators.coreos.com/v1", "kind": "OperatorGroup",
            "metadata": {"name": "gpu-operator", "namespace": namespace},
            "spec": {"targetNamespaces": [namespace]},
        }))
        .unwrap();
        olm::apply_objects(&admin, &[group]).await.unwrap();
        let mut csv: DynamicObject = serde_json::from_value(csv).unwrap();
        csv.metadata.namespace = Some(namespace.clone());
        let created =
            Api::<DynamicObject>::namespaced_with(admin.clone(), &namespace, &csv_resource())
                .create(&PostParams::default(), &csv)
                .await
                .unwrap();
        let rbac = olm::generated_rbac(&serde_json::to_value(&created).unwrap()).unwrap();
        olm::apply_objects(&admin, &rbac).await.unwrap();
        Some(Install {
            admin,
            olm,
            namespace,
            rbac,
        })
    }

    fn csvs(&self) -> Api<DynamicObject> {
        Api::namespaced_with(self.admin.clone(), &self.namespace, &csv_resource())
    }

    /// Waits for the CSV's phase `Succeeded`.
    async fn await_succeeded(&mut self, csv_name: &str) {
        let csvs = self.csvs();
        let outcome = wait::until(INSTALL_TIMEOUT, "CSV phase Succeeded", || {
            let csvs = csvs.clone();
            async move {
                let csv = csvs.get(csv_name).await?;
                let status = &csv.data["status"];
                Ok(if status["phase"] == "Succeeded" {
                    Ok(())
                } else {
                    Err(format!(
                        "phase {} reason {} message {}",
                        status["phase"], status["reason"], status["message"]
                    ))
                })
            }
        })
        .await;
        if let Err(e) = outcome {
            panic!(
                "{e}\nolm-operator running: {}\nits log:\n{}",
                self.olm.is_running(),
                self.olm.log_tail(40)
            );
        }
    }

    /// The Deployment OLM created from the CSV's install strategy.
    async fn deployment(&self) -> Deployment {
        Api::<Deployment>::namespaced(self.admin.clone(), &self.namespace)
            .get("gpu-operator")
            .await
            .unwrap()
    }

    /// The operator run as that Deployment's container, with its ServiceAccount's token.
    async fn run_operator(&self) -> (OperatorIdentity, Operator) {
        olm::run_deployment_container(
            &self.admin,
            &self.namespace,
            "gpu-operator",
            "gpu-operator-olm-0",
        )
        .await
        .unwrap()
    }

    /// Deletes the policy (its operands collected while the operator still runs), then the
    /// namespace and the cluster-scoped RBAC; OLM stops when dropped.
    async fn remove(self, policy: &str, mut operator: Operator) {
        session::policies(&self.admin)
            .delete(policy, &DeleteParams::default())
            .await
            .unwrap();
        let daemon_sets: Api<DaemonSet> = Api::namespaced(self.admin.clone(), &self.namespace);
        wait::until_none_left(
            &daemon_sets,
            &ListParams::default(),
            TIMEOUT,
            "operands garbage-collected",
        )
        .await
        .unwrap();
        operator.terminate(Duration::from_secs(20)).unwrap();
        Api::<Namespace>::all(self.admin.clone())
            .delete(&self.namespace, &DeleteParams::default())
            .await
            .unwrap();
        olm::delete_cluster_scoped(&self.admin, &self.rbac)
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn real_olm_installs_the_bundle_and_its_operator_converges_with_the_csvs_permissions() {
    let csv = committed_csv();
    let csv_name = csv["metadata"]["name"].as_str().unwrap().to_owned();
    let Some(mut install) = Install::start(csv.clone()).await else {
        return;
    };
    install.await_succeeded(&csv_name).await;

    // OLM made the Deployment of the CSV's install strategy, and it is Available.
    let deployment = install.deployment().await;
    let available = deployment
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Available" && c.status == "True");
    assert!(available, "{:?}", deployment.status);
    let ours = &csv["spec"]["install"]["spec"]["deployments"][0]["spec"]["template"]["spec"]["containers"]
        [0];
    let theirs = serde_json::to_value(
        &deployment
            .spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap()
            .containers[0],
    )
    .unwrap();
    for field in ["image", "args", "command"] {
        assert_eq!(
            theirs[field], ours[field],
            "OLM's Deployment container {field}"
        );
    }
    // The ClusterRole OLM generated grants the CSV's clusterPermissions, rule for rule.
    let role = install
        .rbac
        .iter()
        .find(|o| o.types.as_ref().is_some_and(|t| t.kind == "ClusterRole"))
        .expect("OLM generated no ClusterRole");
    assert_eq!(
        role.data["rules"],
        csv["spec"]["install"]["spec"]["clusterPermissions"][0]["rules"]
    );
    // And the Role in the operator namespace grants the CSV's permissions.
    let role = install
        .rbac
        .iter()
        .find(|o| o.types.as_ref().is_some_and(|t| t.kind == "Role"))
        .expect("OLM generated no Role");
    assert_eq!(
        role.data["rules"],
        csv["spec"]["install"]["spec"]["permissions"][0]["rules"]
    );

    // Its container as the operator, with only that RBAC: a default policy becomes ready.
    let (_identity, operator) = install.run_operator().await;
    let policy = e2e::cluster::unique_name("cluster-policy");
    session::create_policy(&install.admin, &policy, json!({})).await;
    let ready = session::await_policy_state(
        &install.admin,
        &policy,
        State::Ready,
        "policy ready under OLM's RBAC",
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    // It deployed NFD with NFD's CRDs from the bundle, which it may read but not write.
    let message = session::ready_condition(&ready).unwrap().message.clone();
    assert!(
        message.contains(gpu_operator::controller::vendored_crds::READ_ONLY_NOTE),
        "{message}"
    );
    install.remove(&policy, operator).await;
}

/// The CSV with `verb` taken from the rules granting it on `resource` in `group`, in its
/// clusterPermissions and its (operator namespace) permissions alike (a rule that names more
/// resources is split so the others keep it).
fn without_permission(mut csv: Value, group: &str, resource: &str, verb: &str) -> Value {
    let mut removed = false;
    for scope in ["clusterPermissions", "permissions"] {
        let rules = csv["spec"]["install"]["spec"][scope][0]["rules"]
            .as_array_mut()
            .unwrap();
        removed |= remove_grant(rules, group, resource, verb);
    }
    assert!(removed, "no rule grants {verb} on {resource}.{group}");
    csv
}

/// Takes `verb` on `resource` of `group` from `rules`; whether any rule granted it.
fn remove_grant(rules: &mut Vec<Value>, group: &str, resource: &str, verb: &str) -> bool {
    let mut out = Vec::new();
    let mut removed = false;
    for rule in rules.drain(..) {
        let grants = rule["apiGroups"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g == group)
            && rule["resources"]
                .as_array()
                .unwrap()
                .iter()
                .any(|r| r == resource)
            && rule["verbs"].as_array().unwrap().iter().any(|v| v == verb)
            && rule.get("resourceNames").is_none();
        if !grants {
            out.push(rule);
            continue;
        }
        removed = true;
        let mut others = rule.clone();
        others["resources"]
            .as_array_mut()
            .unwrap()
            .retain(|r| r != resource);
        if !others["resources"].as_array().unwrap().is_empty() {
            out.push(others);
        }
        let mut narrowed = rule;
        narrowed["resources"] = json!([resource]);
        narrowed["verbs"]
            .as_array_mut()
            .unwrap()
            .retain(|v| v != verb);
        if !narrowed["verbs"].as_array().unwrap().is_empty() {
            out.push(narrowed);
        }
    }
    *rules = out;
    removed
}

#[tokio::test]
async fn under_olm_one_permission_less_fails_naming_the_denied_request() {
    // Server-side apply of the operand DaemonSets is a patch.
    let csv = without_permission(committed_csv(), "apps", "daemonsets", "patch");
    let csv_name = csv["metadata"]["name"].as_str().unwrap().to_owned();
    let Some(mut install) = Install::start(csv).await else {
        return;
    };
    install.await_succeeded(&csv_name).await;
    let (identity, operator) = install.run_operator().await;
    let policy = e2e::cluster::unique_name("cluster-policy");
    session::create_policy(&install.admin, &policy, json!({})).await;
    let denied = format!(
        "User \"{}\" cannot patch resource \"daemonsets\" in API group \"apps\"",
        identity.username()
    );
    let policies = session::policies(&install.admin);
    let outcome = wait::until(TIMEOUT, "the denied request in the policy's status", || {
        let (policies, policy, denied) = (policies.clone(), policy.clone(), denied.clone());
        async move {
            let p = policies.get(&policy).await?;
            let status = p.status.unwrap_or_default();
            let messages: Vec<String> = status
                .conditions
                .unwrap_or_default()
                .into_iter()
                .map(|c| format!("{} {}: {}", c.type_, c.reason, c.message))
                .collect();
            Ok(
                if status.state != State::Ready && messages.iter().any(|m| m.contains(&denied)) {
                    Ok(())
                } else {
                    Err(messages.join("\n"))
                },
            )
        }
    })
    .await;
    if let Err(e) = outcome {
        panic!(
            "{e}\nwanted: {denied}\noperator log:\n{}",
            operator.log_text()
        );
    }
    install.remove(&policy, operator).await;
}
