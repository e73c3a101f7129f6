//! The invariants a converged cluster holds (IO: reads the cluster, renders with the library).
//!
//! The expected state is the operator library's own render of the live policy with facts read
//! from the live cluster the way the controller's resolve stage reads them (nodes, ConfigMaps,
//! the live device plugin's "last good" sharing copy, the live driver's OS). Then:
//! - every live object labelled `app.kubernetes.io/managed-by=gpu-operator` is rendered, with
//!   the rendering's applied hash (content as rendered), or belongs to an operand whose input is
//!   invalid (frozen, decision 8), or is a sharing copy a live DaemonSet still mounts;
//! - every rendered object is live;
//! - no duplicates: no two DaemonSets or Deployments with the same `app` label, nothing of ours
//!   in another namespace;
//! - every live object's controller owner reference is the policy's uid;
//! - the policy is `ready` for its current generation.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use anyhow::Result;
use gpu_operator::api::{ClusterPolicy, State};
use gpu_operator::controller::{APPLIED_HASH_ANNOTATION, applied_hash};
use gpu_operator::facts::{self, ClusterFacts};
use gpu_operator::model::{Kind, MANAGED_BY_LABEL, MANAGER, OPERAND_LABEL};
use gpu_operator::nodes::NodeView;
use gpu_operator::operands::{device_plugin, nfd};
use gpu_operator::render::{Outcome, render};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::{Client, ResourceExt};
use serde_json::Value;

use crate::session::{policies, ready_condition};

/// `(kind, namespace, name)` of an object.
type Key = (String, String, String);

/// What the cluster looks like now, and what the render of the live policy says it should.
pub struct Verdict {
    /// Every broken invariant, one line each; empty when converged.
    pub problems: Vec<String>,
    /// Live objects of ours, counted.
    pub live_objects: usize,
}

/// Checks every invariant once (no waiting) for policy `policy` and operator namespace
/// `namespace`.
pub async fn check(admin: &Client, namespace: &str, policy: &str) -> Result<Verdict> {
    let mut problems = Vec::new();
    let Some(policy) = policies(admin).get_opt(policy).await? else {
        anyhow::bail!("policy {policy} is gone");
    };
    let uid = policy.metadata.uid.clone().unwrap_or_default();
    if !ready_now(&policy) {
        problems.push(format!(
            "policy not ready for generation {:?}: {}",
            policy.metadata.generation,
            status_line(&policy)
        ));
    }

    let facts = live_facts(admin, namespace, &policy).await?;
    let validated = gpu_operator::validate::validate(&policy, &facts);
    let desired = render(&validated, &facts);
    let mut expected: BTreeMap<Key, String> = BTreeMap::new();
    let mut frozen = BTreeSet::new();
    for state in &desired.operands {
        match &state.outcome {
            Outcome::Rendered(objects) => {
                for object in objects.to_json()? {
                    expected.insert(key_of_json(&object), applied_hash(&object)?);
                }
            }
            Outcome::Invalid(_) => {
                frozen.insert(state.operand.name().to_owned());
            }
            Outcome::Disabled => {}
        }
    }

    let in_use = mounted_copies(admin, namespace).await?;
    let live = live_objects(admin, facts.service_monitor_api).await?;
    let mut seen = BTreeSet::new();
    let mut apps: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for (resource, object) in &live {
        let kind = &resource.kind;
        let key = (
            kind.clone(),
            object.namespace().unwrap_or_default(),
            object.name_any(),
        );
        let describe = || format!("{} {}/{}", key.0, key.1, key.2);
        if !key.1.is_empty() && key.1 != namespace {
            problems.push(format!("{} is outside the operator namespace", describe()));
        }
        let owners: Vec<_> = object
            .owner_references()
            .iter()
            .filter(|o| o.controller == Some(true))
            .collect();
        if owners.len() != 1 || owners[0].uid != uid {
            problems.push(format!(
                "{} is owned by {:?}, not the active policy {uid}",
                describe(),
                owners.iter().map(|o| &o.uid).collect::<Vec<_>>()
            ));
        }
        if kind == "DaemonSet" || kind == "Deployment" {
            let app = object.labels().get("app").cloned().unwrap_or_default();
            apps.entry((kind.clone(), app))
                .or_default()
                .push(object.name_any());
        }
        let operand = object.labels().get(OPERAND_LABEL).cloned();
        match expected.get(&key) {
            Some(hash) => {
                seen.insert(key.clone());
                let live_hash = object.annotations().get(APPLIED_HASH_ANNOTATION);
                if live_hash != Some(hash) {
                    problems.push(format!(
                        "{} is not as rendered (applied hash {live_hash:?}, render {hash})",
                        describe()
                    ));
                }
            }
            None if operand.as_ref().is_some_and(|o| frozen.contains(o)) => {}
            None if kind == "ConfigMap" && in_use.contains(&key.2) => {}
            None => problems.push(format!(
                "{} (operand {operand:?}) is not in the render of the live policy",
                describe()
            )),
        }
    }
    for key in expected.keys().filter(|k| !seen.contains(*k)) {
        problems.push(format!(
            "{} {}/{} is rendered but not live",
            key.0, key.1, key.2
        ));
    }
    for ((kind, app), names) in apps {
        if names.len() > 1 {
            problems.push(format!("duplicate {kind}s for app={app}: {names:?}"));
        }
    }
    Ok(Verdict {
        problems,
        live_objects: live.len(),
    })
}

/// `ready` with the Ready condition observed at the current generation.
pub fn ready_now(policy: &ClusterPolicy) -> bool {
    let observed = ready_condition(policy).and_then(|c| c.observed_generation);
    policy.status.as_ref().map(|s| s.state) == Some(State::Ready)
        && observed >= policy.metadata.generation
}

/// The policy's state and Ready message in one line.
pub fn status_line(policy: &ClusterPolicy) -> String {
    let state = policy.status.as_ref().map(|s| s.state);
    let message = ready_condition(policy)
        .map(|c| c.message.clone())
        .unwrap_or_default();
    format!("state {state:?}: {message}")
}

fn key_of_json(object: &Value) -> Key {
    let text = |pointer: &str| {
        object
            .pointer(pointer)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    (
        text("/kind"),
        text("/metadata/namespace"),
        text("/metadata/name"),
    )
}

/// Every live object carrying our managed-by label, of every kind the operator applies, with
/// its kind name.
pub async fn live_objects(
    admin: &Client,
    service_monitor: bool,
) -> Result<Vec<(ApiResource, DynamicObject)>> {
    let mut resources: Vec<ApiResource> = Kind::ALL
        .into_iter()
        .map(|kind| {
            let (group, version, kind, plural) = kind.api();
            ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
        })
        .collect();
    resources.extend(gpu_operator::operands::common::admission_api_resources());
    if service_monitor {
        resources.push(gpu_operator::operands::dcgm_exporter::service_monitor_api_resource());
    }
    let managed = ListParams::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGER}"));
    let mut out = Vec::new();
    for resource in resources {
        let api: Api<DynamicObject> = Api::all_with(admin.clone(), &resource);
        for object in api.list(&managed).await?.items {
            out.push((resource.clone(), object));
        }
    }
    Ok(out)
}

/// Names of the ConfigMaps live DaemonSets mount as their sharing config.
async fn mounted_copies(admin: &Client, namespace: &str) -> Result<BTreeSet<String>> {
    let daemonsets: Api<DaemonSet> = Api::namespaced(admin.clone(), namespace);
    Ok(daemonsets
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter_map(device_plugin::mounted_copy)
        .map(|(copy, _)| copy)
        .collect())
}

/// The facts the controller's resolve stage would find now, read directly from the API server
/// instead of from caches and assembled by the function the controller uses
/// ([`facts::assemble`]).
pub async fn live_facts(
    admin: &Client,
    namespace: &str,
    policy: &ClusterPolicy,
) -> Result<ClusterFacts> {
    let nodes = Api::<Node>::all(admin.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let views: Vec<Arc<NodeView>> = nodes
        .iter()
        .map(|n| {
            Arc::new(NodeView {
                nfd_annotated: gpu_operator::nodes::nfd_annotated(n.metadata.annotations.as_ref()),
                pool_record: gpu_operator::node_pools::record_annotation(
                    n.metadata.annotations.as_ref(),
                ),
                ..NodeView::from_labels(
                    &n.name_any(),
                    n.metadata.resource_version.clone(),
                    &n.labels().clone(),
                )
            })
        })
        .collect();
    let gpu_nodes = facts::gpu_nodes(&views);
    let groups = admin.list_api_groups().await?;
    let served = |name: &str| groups.groups.iter().any(|g| g.name == name);
    let openshift = served("config.openshift.io");
    // Each GPU node's runtime flavour from its nodeInfo, as the operator detects it.
    let node_runtimes: facts::NodeRuntimes = nodes
        .iter()
        .filter(|n| gpu_nodes.iter().any(|g| g.name == n.name_any()))
        .map(|n| {
            (
                n.name_any(),
                facts::detect(&facts::NodeRuntimeInfo::of_node(n)),
            )
        })
        .collect();
    let runtime = facts::cluster_runtime(
        openshift,
        node_runtimes
            .values()
            .filter_map(|r| r.flavour())
            .map(facts::RuntimeFlavour::runtime),
    );

    let listed = Listed {
        config_maps: Api::<ConfigMap>::namespaced(admin.clone(), namespace)
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .map(|cm| (cm.name_any(), Arc::new(cm)))
            .collect(),
        daemon_sets: Api::<DaemonSet>::namespaced(admin.clone(), namespace)
            .list(&ListParams::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGER}")))
            .await?
            .items
            .into_iter()
            .map(|ds| (ds.name_any(), Arc::new(ds)))
            .collect(),
    };
    let ours_deployed = Api::<Deployment>::namespaced(admin.clone(), namespace)
        .get_opt(nfd::MASTER)
        .await?
        .is_some_and(|d| d.labels().get(MANAGED_BY_LABEL).map(String::as_str) == Some(MANAGER));
    let foreign = foreign_nfd_master(admin)
        .await?
        .then_some("a workload that is not ours");
    let service_monitor_api = served("monitoring.coreos.com");
    // As the operator reads it at start-up (controller::resolve).
    let openshift_version = if openshift {
        let resource = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("config.openshift.io", "v1", "ClusterVersion"),
            "clusterversions",
        );
        Api::<DynamicObject>::all_with(admin.clone(), &resource)
            .get_opt("version")
            .await?
            .and_then(|cv| serde_json::to_value(cv).ok())
            .and_then(|cv| facts::openshift_version(&cv))
    } else {
        None
    };
    let foreign_operator_service_monitor = service_monitor_api
        && Api::<DynamicObject>::namespaced_with(
            admin.clone(),
            namespace,
            &gpu_operator::operands::dcgm_exporter::service_monitor_api_resource(),
        )
        .get_metadata_opt(gpu_operator::operands::operator_metrics::NAME)
        .await?
        .is_some_and(|sm| sm.labels().get(MANAGED_BY_LABEL).map(String::as_str) != Some(MANAGER));
    Ok(facts::assemble(
        &policy.spec,
        &listed,
        facts::Observed {
            namespace: namespace.to_owned(),
            owner: facts::owner_reference(policy),
            runtime,
            node_runtimes,
            openshift,
            openshift_version,
            service_monitor_api,
            // The e2e operators serve plain HTTP (operator::PLAIN_ENDPOINTS).
            operator_metrics_https: false,
            foreign_operator_service_monitor,
            nfd_running: facts::nfd_already_running(foreign, &views, ours_deployed),
            nfd_frozen: facts::nfd_beside_ours(foreign, ours_deployed),
            gpu_nodes,
            image_env: BTreeMap::new(),
            // The chaos policies never ask for OpenShift's Driver Toolkit, so the operator
            // reads no ImageStream either.
            driver_toolkit: None,
            driver_toolkit_broken: false,
        },
    ))
}

/// The operator namespace's objects, as listed.
struct Listed {
    config_maps: BTreeMap<String, Arc<ConfigMap>>,
    daemon_sets: BTreeMap<String, Arc<DaemonSet>>,
}

impl facts::NamespaceObjects for Listed {
    fn config_map(&self, name: &str) -> Option<Arc<ConfigMap>> {
        self.config_maps.get(name).cloned()
    }
    fn daemon_set(&self, name: &str) -> Option<Arc<DaemonSet>> {
        self.daemon_sets.get(name).cloned()
    }

    fn daemon_sets_labelled(&self, key: &str, value: &str) -> Vec<Arc<DaemonSet>> {
        self.daemon_sets
            .values()
            .filter(|ds| ds.labels().get(key).map(String::as_str) == Some(value))
            .cloned()
            .collect()
    }
}

/// Whether an NFD master that is not ours runs (resolve's `foreign_nfd_master`).
async fn foreign_nfd_master(admin: &Client) -> Result<bool> {
    let api: Api<Deployment> = Api::all(admin.clone());
    for selector in [
        "app.kubernetes.io/name=node-feature-discovery",
        "app=nfd-master",
    ] {
        let params =
            ListParams::default().labels(&format!("{selector},{MANAGED_BY_LABEL}!={MANAGER}"));
        if !api.list_metadata(&params).await?.items.is_empty() {
            return Ok(true);
        }
    }
    Ok(false)
}
