//! The operator installed from an OLM catalog, as OpenShift and OperatorHub users install it,
//! then upgraded through the catalog's channel. Real components throughout: the bundle and
//! catalog images are published to the harness's OCI registry by `scripts/olm-catalog.sh` (what
//! `make release` runs; `opm render` of the pushed bundle images); the catalog image's container
//! (`opm serve` of its /configs) is run as OLM's registry pod would and named by a CatalogSource
//! `spec.address`; OLM's catalog operator resolves the Subscription into an InstallPlan
//! (Automatic) and executes it (CRDs, RBAC, the CSV); olm-operator installs the CSV's
//! Deployment, which kwok runs on a fake node; that Deployment's container is then run as the
//! operator with its ServiceAccount's token, so the RBAC of the InstallPlan is its authority.
//!
//! Versions: the first is the committed bundle/ as it is (`gpu-operator.v0.1.0`); the second is
//! the same bundle as `0.1.1-test.1`, `replaces: gpu-operator.v0.1.0` and
//! `olm.skipRange: <0.1.1-test.1`, published with a new catalog listing both; the catalog server
//! is restarted on the same address with it, as a CatalogSource's registry pod is replaced.
//!
//! Simulated: the catalog operator unpacks a bundle whose catalog entry names an image (every
//! `opm render` output does) with a Job; kwok marks its pod complete without running it, so
//! `e2e::olm_catalog::BundleUnpacker` does that pod's work: it pulls the image the Job's `pull`
//! container names from the registry and runs the Job's own `opm alpha bundle extract` command
//! (the harness's opm, the release the Job's image is) as the Job's ServiceAccount, which writes
//! the ConfigMap the catalog operator reads. A catalog whose bundles have no image would spare
//! the Job (opm serves `olm.bundle.object` content only for those), but no published catalog
//! looks like that.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use e2e::crd::TemporaryCrd;
use e2e::olm::{self, OLM_NAMESPACE, Olm};
use e2e::olm_catalog::{self, BundleUnpacker, CatalogServer};
use e2e::session::{self, TIMEOUT};
use e2e::wait;
use gpu_operator::api::State;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use serde_json::{Value, json};
use xtask::bundle::{CSV_FILE, OPERATORHUB_POLICY_NAME};

/// How long OLM may take from Subscription to a Succeeded CSV (its requeues are seconds apart,
/// the catalog operator's resolution retries back off).
const INSTALL_TIMEOUT: Duration = Duration::from_secs(300);
const UPGRADE_VERSION: &str = "0.1.1-test.1";

fn bundle_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bundle")
}

fn olm_resource(version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("operators.coreos.com", version, kind),
        plural,
    )
}

fn csvs(admin: &Client, namespace: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        admin.clone(),
        namespace,
        &olm_resource(
            "v1alpha1",
            "ClusterServiceVersion",
            "clusterserviceversions",
        ),
    )
}

fn subscriptions(admin: &Client, namespace: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        admin.clone(),
        namespace,
        &olm_resource("v1alpha1", "Subscription", "subscriptions"),
    )
}

fn install_plans(admin: &Client, namespace: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        admin.clone(),
        namespace,
        &olm_resource("v1alpha1", "InstallPlan", "installplans"),
    )
}

fn yaml_object(text: Value) -> DynamicObject {
    serde_json::from_value(text).unwrap()
}

/// The committed bundle as version `version`, replacing the CSV `replaces`: a copy under `dir`.
fn bundle_version(dir: &Path, version: &str, replaces: &str) -> PathBuf {
    let out = dir.join(format!("bundle-{version}"));
    for sub in ["manifests", "metadata"] {
        std::fs::create_dir_all(out.join(sub)).unwrap();
        for entry in std::fs::read_dir(bundle_dir().join(sub)).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), out.join(sub).join(entry.file_name())).unwrap();
        }
    }
    let path = out.join(CSV_FILE);
    let mut csv: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    csv["metadata"]["name"] = json!(format!("gpu-operator.v{version}"));
    csv["metadata"]["annotations"]["olm.skipRange"] = json!(format!("<{version}"));
    csv["spec"]["version"] = json!(version);
    csv["spec"]["replaces"] = json!(replaces);
    std::fs::write(&path, serde_yaml_ng::to_string(&csv).unwrap()).unwrap();
    out
}

/// As OLM installs the CRDs, without the hash an operator that applied them earlier in this
/// harness left (`nvidia.com/gpu-operator.applied-hash`), which would spare it the write.
async fn forget_applied_crd_hashes(admin: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    for crd in crds.list(&ListParams::default()).await.unwrap().items {
        let annotations = crd.metadata.annotations.clone().unwrap_or_default();
        if annotations.contains_key("nvidia.com/gpu-operator.applied-hash") {
            crds.patch(
                crd.metadata.name.as_deref().unwrap(),
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {"nvidia.com/gpu-operator.applied-hash": null}}})),
            )
            .await
            .unwrap();
        }
    }
}

/// Waits until the Subscription has installed `csv` and that CSV is `Succeeded`.
async fn await_installed(
    admin: &Client,
    namespace: &str,
    subscription: &str,
    csv: &str,
    unpacker: &BundleUnpacker,
    logs: &[&Olm],
) {
    let (subs, csv_api) = (subscriptions(admin, namespace), csvs(admin, namespace));
    let outcome = wait::until(INSTALL_TIMEOUT, &format!("{csv} installed"), || {
        let (subs, csv_api) = (subs.clone(), csv_api.clone());
        async move {
            let sub = subs.get(subscription).await?;
            let conditions = sub.data["status"]["conditions"].as_array().cloned();
            if let Some(failed) = conditions.into_iter().flatten().find(|c| {
                c["type"] == "InstallPlanFailed" && c["status"] == "True"
            }) {
                anyhow::bail!("the InstallPlan failed: {}", failed["message"]);
            }
            let installed = sub.data["status"]["installedCSV"].as_str().unwrap_or("");
            let phase = match csv_api.get_opt(csv).await? {
                Some(c) => c.data["status"]["phase"].as_str().unwrap_or("").to_owned(),
                None => "absent".to_owned(),
            };
            Ok(if installed == csv && phase == "Succeeded" {
                Ok(())
            } else {
                Err(format!(
                    "subscription state {} currentCSV {} installedCSV {installed} conditions {}; {csv} phase {phase}",
                    sub.data["status"]["state"],
                    sub.data["status"]["currentCSV"],
                    sub.data["status"]["conditions"]
                ))
            })
        }
    })
    .await;
    if let Err(e) = outcome {
        let tails: Vec<String> = logs
            .iter()
            .map(|o| format!("{}:\n{}", o.log.display(), o.log_tail(30)))
            .collect();
        panic!(
            "{e}\nbundle unpacks done {:?}, failed {:?}\n{}",
            unpacker.unpacked(),
            unpacker.errors(),
            tails.join("\n")
        );
    }
}

/// Samples the policy's state every 100 ms until stopped; every state seen that is not ready.
struct ReadySampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<(usize, Vec<String>)>,
}

impl ReadySampler {
    fn start(admin: &Client, policy: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (api, policy, flag) = (session::policies(admin), policy.to_owned(), stop.clone());
        let task = tokio::spawn(async move {
            let (mut samples, mut not_ready) = (0, Vec::new());
            while !flag.load(Ordering::Relaxed) {
                match api.get(&policy).await {
                    Ok(p) => {
                        samples += 1;
                        let state = p.status.map(|s| s.state).unwrap_or_default();
                        if state != State::Ready {
                            not_ready.push(format!("{state:?}"));
                        }
                    }
                    Err(e) => not_ready.push(format!("read failed: {e}")),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (samples, not_ready)
        });
        ReadySampler { stop, task }
    }

    async fn finish(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap()
    }
}

#[tokio::test]
async fn a_subscription_installs_from_the_catalog_and_upgrades_through_the_channel_while_the_policy_stays_ready()
 {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    let Some(registry) = e2e::registry::start() else {
        return;
    };
    let Some(tools) = olm_catalog::tools() else {
        return;
    };
    // The InstallPlan creates the CRDs on a fresh harness; earlier tests may have left them.
    if Api::<CustomResourceDefinition>::all(admin.clone())
        .get_opt("clusterpolicies.nvidia.com")
        .await
        .unwrap()
        .is_some()
    {
        session::remove_leftovers(&admin).await;
    }
    forget_applied_crd_hashes(&admin).await;
    // OpenShift serves the Prometheus Operator's API, which the bundle's ServiceMonitor and
    // PrometheusRule need: OLM fails an InstallPlan whose objects' API is not served.
    let Some(monitoring) = e2e::tools::checker("tests/monitoring/crds.sh") else {
        return;
    };
    let _monitoring_crds = [
        (
            "monitoring.coreos.com_servicemonitors.yaml",
            "servicemonitors.monitoring.coreos.com",
        ),
        (
            "monitoring.coreos.com_prometheusrules.yaml",
            "prometheusrules.monitoring.coreos.com",
        ),
    ]
    .map(|(file, name)| TemporaryCrd::apply(&monitoring.join(file), name).unwrap());
    let work = std::env::temp_dir().join(e2e::cluster::unique_name("olm-catalog"));
    std::fs::create_dir_all(&work).unwrap();
    // A repository path of this run's own, so a release test's tags never meet these.
    let registry = format!("{registry}/{}", e2e::cluster::unique_name("olm-catalog"));

    // --- Version 1: the committed bundle, published with its catalog.
    let first = olm_catalog::publish(
        &registry,
        &work.join("v1"),
        &[bundle_dir().to_str().unwrap()],
    )
    .unwrap();
    let committed: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(bundle_dir().join(CSV_FILE)).unwrap())
            .unwrap();
    let first_csv = committed["metadata"]["name"].as_str().unwrap().to_owned();
    let fbc = std::fs::read_to_string(first.fbc.join("gpu-operator/catalog.json")).unwrap();
    assert!(
        fbc.contains(&first.bundles[0]),
        "the catalog names the pushed bundle {}",
        first.bundles[0]
    );

    let port = olm_catalog::catalog_port().unwrap();
    let mut server = CatalogServer::start(&tools, &first.catalog, port)
        .await
        .unwrap();
    let olm_operator = Olm::start(&admin).await.unwrap();
    let catalog_operator = Olm::start_catalog_operator(&admin, &[server.address.as_str()])
        .await
        .unwrap();
    let unpacker = BundleUnpacker::start(&admin, &tools, OLM_NAMESPACE);

    // --- What a user applies: a CatalogSource, then an OperatorGroup and a Subscription.
    let source = e2e::cluster::unique_name("gpu-operator-catalog");
    olm::apply_objects(
        &admin,
        &[yaml_object(json!({
            "apiVersion": "operators.coreos.com/v1alpha1", "kind": "CatalogSource",
            "metadata": {"name": source, "namespace": OLM_NAMESPACE},
            "spec": {"sourceType": "grpc", "address": server.address,
                     "displayName": "GPU Operator (e2e)", "publisher": "e2e"},
        }))],
    )
    .await
    .unwrap();
    let namespace = e2e::cluster::unique_name("olm-catalog-gpu-operator");
    let mut ns = Namespace::default();
    ns.metadata.name = Some(namespace.clone());
    Api::<Namespace>::all(admin.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    olm::apply_objects(
        &admin,
        &[
            yaml_object(json!({
                "apiVersion": "operators.coreos.com/v1", "kind": "OperatorGroup",
                "metadata": {"name": "gpu-operator", "namespace": namespace},
                "spec": {"targetNamespaces": [namespace]},
            })),
            yaml_object(json!({
                "apiVersion": "operators.coreos.com/v1alpha1", "kind": "Subscription",
                "metadata": {"name": "gpu-operator", "namespace": namespace},
                "spec": {"channel": "stable", "name": "gpu-operator", "source": source,
                         "sourceNamespace": OLM_NAMESPACE, "installPlanApproval": "Automatic"},
            })),
        ],
    )
    .await
    .unwrap();
    let logs = [&olm_operator, &catalog_operator];
    await_installed(
        &admin,
        &namespace,
        "gpu-operator",
        &first_csv,
        &unpacker,
        &logs,
    )
    .await;

    // The catalog operator's InstallPlan did it: Automatic, Complete, creating the CSV, the CRDs
    // and the RBAC; and the bundle content came through an unpack Job.
    let plans = install_plans(&admin, &namespace);
    let plan = wait::until(TIMEOUT, "the InstallPlan Complete", || {
        let (plans, first_csv) = (plans.clone(), first_csv.clone());
        async move {
            let found = plans
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .find(|p| {
                    p.data["spec"]["clusterServiceVersionNames"]
                        .as_array()
                        .is_some_and(|n| n.iter().any(|n| n == first_csv.as_str()))
                });
            Ok(match found {
                Some(p) if p.data["status"]["phase"] == "Complete" => Ok(p),
                Some(p) => Err(format!("phase {}", p.data["status"]["phase"])),
                None => Err("no InstallPlan for the first CSV".to_owned()),
            })
        }
    })
    .await
    .unwrap();
    assert_eq!(plan.data["spec"]["approval"], "Automatic");
    let kinds: Vec<&str> = plan.data["status"]["plan"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["status"] == "Created" || s["status"] == "Present")
        .filter_map(|s| s["resource"]["kind"].as_str())
        .collect();
    for kind in [
        "ClusterServiceVersion",
        "CustomResourceDefinition",
        "ClusterRole",
        "ClusterRoleBinding",
        "ServiceAccount",
    ] {
        assert!(
            kinds.contains(&kind),
            "the InstallPlan created no {kind}: {kinds:?}"
        );
    }
    assert!(
        !unpacker.unpacked().is_empty(),
        "no bundle unpack Job ran: {:?}",
        unpacker.errors()
    );

    // --- The CSV's Deployment container as the operator; OperatorHub's example policy name.
    let (_identity, mut operator) =
        olm::run_deployment_container(&admin, &namespace, "gpu-operator", "gpu-operator-olm-0")
            .await
            .unwrap();
    let policy = OPERATORHUB_POLICY_NAME;
    session::create_policy(&admin, policy, json!({})).await;
    session::await_policy_state(
        &admin,
        policy,
        State::Ready,
        "policy ready from the catalog",
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));

    // --- Upgrade: version 2 replaces version 1 in a new catalog, served where the old was.
    let sampler = ReadySampler::start(&admin, policy);
    let upgrade_started = std::time::Instant::now();
    let second_dir = bundle_version(&work, UPGRADE_VERSION, &first_csv);
    let second = olm_catalog::publish(
        &registry,
        &work.join("v2"),
        &[first.bundles[0].as_str(), second_dir.to_str().unwrap()],
    )
    .unwrap();
    let second_csv = format!("gpu-operator.v{UPGRADE_VERSION}");
    let fbc = std::fs::read_to_string(second.fbc.join("gpu-operator/catalog.json")).unwrap();
    assert!(
        fbc.contains(&format!("\"replaces\": \"{first_csv}\"")),
        "the channel entry of {second_csv} replaces {first_csv}:\n{fbc}"
    );
    server.stop();
    server = CatalogServer::start(&tools, &second.catalog, port)
        .await
        .unwrap();
    await_installed(
        &admin,
        &namespace,
        "gpu-operator",
        &second_csv,
        &unpacker,
        &logs,
    )
    .await;
    // The old CSV is replaced: OLM deletes it once the new one succeeded.
    let csv_api = csvs(&admin, &namespace);
    wait::until(TIMEOUT, "the replaced CSV deleted", || {
        let csv_api = csv_api.clone();
        let first_csv = first_csv.clone();
        async move {
            Ok(match csv_api.get_opt(&first_csv).await? {
                None => Ok(()),
                Some(c) => Err(format!("{first_csv} phase {}", c.data["status"]["phase"])),
            })
        }
    })
    .await
    .unwrap();
    let sub = subscriptions(&admin, &namespace)
        .get("gpu-operator")
        .await
        .unwrap();
    assert_eq!(sub.data["status"]["currentCSV"], second_csv.as_str());
    let deployment_owner =
        Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(admin.clone(), &namespace)
            .get("gpu-operator")
            .await
            .unwrap()
            .metadata
            .labels
            .unwrap_or_default()
            .get("olm.owner")
            .cloned();
    assert_eq!(deployment_owner.as_deref(), Some(second_csv.as_str()));

    // The new Deployment's container takes over as a rolling update would: started beside the
    // old one, which then stops and hands over the lease.
    let (_identity2, mut upgraded) =
        olm::run_deployment_container(&admin, &namespace, "gpu-operator", "gpu-operator-olm-1")
            .await
            .unwrap();
    operator.terminate(Duration::from_secs(20)).unwrap();
    session::await_policy_state(
        &admin,
        policy,
        State::Ready,
        "policy ready after the upgrade",
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", upgraded.log_text()));
    // The new operator acts on the policy: a change it has to roll out reaches ready again.
    session::policies(&admin)
        .patch(
            policy,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"dcgmExporter": {"enabled": false}}})),
        )
        .await
        .unwrap();
    let daemon_sets: Api<DaemonSet> = Api::namespaced(admin.clone(), &namespace);
    wait::until(
        TIMEOUT,
        "the DCGM exporter removed by the upgraded operator",
        || {
            let daemon_sets = daemon_sets.clone();
            async move {
                let names: Vec<String> = daemon_sets
                    .list(&ListParams::default())
                    .await?
                    .items
                    .into_iter()
                    .filter_map(|d| d.metadata.name)
                    .collect();
                Ok(if names.iter().any(|n| n.contains("dcgm-exporter")) {
                    Err(format!("{names:?}"))
                } else {
                    Ok(())
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", upgraded.log_text()));
    let (samples, not_ready) = sampler.finish().await;
    eprintln!(
        "upgrade through the channel: {:.1} s, {samples} samples of the policy, {} not ready",
        upgrade_started.elapsed().as_secs_f64(),
        not_ready.len()
    );
    assert!(samples > 10, "only {samples} samples of the policy");
    assert!(
        not_ready.is_empty(),
        "the policy left ready during the upgrade ({} of {samples} samples): {not_ready:?}",
        not_ready.len()
    );

    // --- Uninstall as docs/install.md says: the policy, then the Subscription and the CSV.
    session::policies(&admin)
        .delete(policy, &DeleteParams::default())
        .await
        .unwrap();
    wait::until_none_left(
        &daemon_sets,
        &ListParams::default(),
        TIMEOUT,
        "operands garbage-collected",
    )
    .await
    .unwrap();
    upgraded.terminate(Duration::from_secs(20)).unwrap();
    subscriptions(&admin, &namespace)
        .delete("gpu-operator", &DeleteParams::default())
        .await
        .unwrap();
    csvs(&admin, &namespace)
        .delete(&second_csv, &DeleteParams::default())
        .await
        .unwrap();
    Api::<Namespace>::all(admin.clone())
        .delete(&namespace, &DeleteParams::default())
        .await
        .unwrap();
    Api::<DynamicObject>::namespaced_with(
        admin.clone(),
        OLM_NAMESPACE,
        &olm_resource("v1alpha1", "CatalogSource", "catalogsources"),
    )
    .delete(&source, &DeleteParams::default())
    .await
    .unwrap();
    drop(server);
    let _ = std::fs::remove_dir_all(&work);
}
