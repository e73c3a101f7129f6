//! Resolve stage (IO, mostly from caches): the cluster facts render needs. Container runtimes
//! are read from nodes on demand and cached; optional APIs are discovered once at start-up.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::Client;
use kube::api::Api;

use kube::runtime::reflector::ObjectRef;

use super::stores::Stores;
use crate::api::{ClusterPolicy, Component};
use crate::facts::{self, ClusterFacts, NodeRuntime, Observed};
use crate::nodes::NodeView;

/// Optional APIs and coexistence facts found at start-up (decision 14).
#[derive(Clone, Debug, Default)]
pub struct Discovered {
    pub openshift: bool,
    /// OpenShift's `major.minor` from the ClusterVersion, read once at start-up as NVIDIA's
    /// operator reads it ([`crate::facts::openshift_version`]).
    pub openshift_version: Option<String>,
    pub service_monitor: bool,
    /// An NFD master that is not ours and whose ServiceAccount may patch nodes
    /// (`Deployment namespace/name`): NFD already runs.
    pub foreign_nfd: Option<String>,
    /// Fields of ours the served ClusterPolicy CRD lacks (an older or NVIDIA-installed CRD
    /// would silently prune them from every policy).
    pub crd_missing_fields: Vec<String>,
    /// Holder of NVIDIA's own operator's leader Lease at start-up, when it is live; the
    /// controller keeps it current from then on (controller::coexist).
    pub nvidia_operator: Option<String>,
}

impl Discovered {
    pub async fn probe(
        client: &Client,
        judge: &mut super::coexist::Judge,
    ) -> Result<Self, kube::Error> {
        let groups = client.list_api_groups().await?;
        let has = |name: &str| groups.groups.iter().any(|g| g.name == name);
        let openshift = has("config.openshift.io");
        Ok(Discovered {
            openshift,
            openshift_version: if openshift {
                openshift_version(client).await
            } else {
                None
            },
            service_monitor: has("monitoring.coreos.com"),
            foreign_nfd: foreign_nfd_master(client).await?,
            crd_missing_fields: missing_crd_fields(client).await?,
            nvidia_operator: nvidia_operator_live(client, judge).await?,
        })
    }

    /// The store-less kinds operands may render here (ServiceMonitor where its API is served,
    /// SCCs on OpenShift, and everywhere the admission policies that confine operands to their
    /// node), which pruning lists.
    pub fn optional_kinds(&self) -> Vec<kube::api::ApiResource> {
        [
            self.service_monitor
                .then(crate::operands::dcgm_exporter::service_monitor_api_resource),
            self.openshift
                .then(crate::operands::openshift::scc_api_resource),
        ]
        .into_iter()
        .flatten()
        .chain(crate::operands::common::admission_api_resources())
        .collect()
    }

    /// Problems that stop this operator from acting safely, for status; `nvidia_operator` is
    /// the live holder of NVIDIA's operator Lease now.
    pub fn coexistence_problems(&self, nvidia_operator: Option<&str>) -> Vec<String> {
        let mut problems = Vec::new();
        if !self.crd_missing_fields.is_empty() {
            problems.push(format!(
                "the served ClusterPolicy CRD lacks {} (an older or NVIDIA-installed CRD prunes them from every policy): apply ours with `gpu-operator crd | kubectl apply --server-side -f -`",
                self.crd_missing_fields.join(", ")
            ));
        }
        if let Some(holder) = nvidia_operator {
            problems.push(format!(
                "{NVIDIA_OPERATOR_RUNS} (held by {holder}); this operator makes no changes while it does: uninstall one of the two"
            ));
        }
        problems
    }
}

/// How status starts to say that NVIDIA's operator is live.
const NVIDIA_OPERATOR_RUNS: &str = "NVIDIA's GPU Operator is running";

/// Whether `status` already says that NVIDIA's operator is live (its Ready condition).
pub fn says_nvidia_operator_runs(status: Option<&crate::api::ClusterPolicyStatus>) -> bool {
    status
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == super::status::READY && c.message.contains(NVIDIA_OPERATOR_RUNS))
}

/// Our fields that must be in the served schema: a sample across spec and status.
async fn missing_crd_fields(client: &Client) -> Result<Vec<String>, kube::Error> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let Some(crd) = api.get_opt(crate::api::crd::CRD_NAME).await? else {
        return Ok(vec![format!(
            "the whole CRD ({} is not installed)",
            crate::api::crd::CRD_NAME
        )]);
    };
    let schema = crd
        .spec
        .versions
        .iter()
        .find(|v| v.name == "v1")
        .and_then(|v| v.schema.as_ref())
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .map(|s| serde_json::to_value(s).unwrap_or_default())
        .unwrap_or_default();
    let wanted = [
        ("spec.nfd", "/properties/spec/properties/nfd"),
        (
            "status.components",
            "/properties/status/properties/components",
        ),
    ];
    Ok(wanted
        .iter()
        .filter(|(_, pointer)| schema.pointer(pointer).is_none())
        .map(|(field, _)| (*field).to_string())
        .collect())
}

/// The holder of NVIDIA's operator Lease if it was renewed within its duration and `judge`
/// trusts it.
async fn nvidia_operator_live(
    client: &Client,
    judge: &mut super::coexist::Judge,
) -> Result<Option<String>, kube::Error> {
    use k8s_openapi::api::coordination::v1::Lease;
    let api: Api<Lease> = Api::all(client.clone());
    let leases = api
        .list(&kube::api::ListParams::default().fields(&format!(
            "metadata.name={}",
            super::coexist::NVIDIA_OPERATOR_LEASE
        )))
        .await?;
    let leases: Vec<std::sync::Arc<Lease>> =
        leases.items.into_iter().map(std::sync::Arc::new).collect();
    let (live, _) = super::coexist::live_leases(&leases, k8s_openapi::jiff::Timestamp::now());
    judge.trusted_holder(&live).await
}

/// An NFD master workload someone else deployed (NFD's Helm chart or kustomize manifests, or
/// NVIDIA's operator's subchart), found by its labels in any namespace. Labels are anyone's to
/// set, so a master counts only when its pods' ServiceAccount may patch nodes, which an NFD
/// master needs and a namespace tenant cannot be granted; others are logged and ignored. A
/// served NodeFeature API proves nothing: NFD's CRDs can exist without NFD (decision 16).
/// OpenShift's version from ClusterVersion `version`; none (and a warning) when it cannot be
/// read or names no completed version yet: the driver then runs without OPENSHIFT_VERSION,
/// where NVIDIA's operator would stop reconciling.
async fn openshift_version(client: &Client) -> Option<String> {
    let resource = kube::discovery::ApiResource {
        group: "config.openshift.io".to_owned(),
        version: "v1".to_owned(),
        api_version: "config.openshift.io/v1".to_owned(),
        kind: "ClusterVersion".to_owned(),
        plural: "clusterversions".to_owned(),
    };
    let api: Api<kube::api::DynamicObject> = Api::all_with(client.clone(), &resource);
    match api.get_opt("version").await {
        Ok(found) => {
            let version = found
                .and_then(|cv| serde_json::to_value(cv).ok())
                .and_then(|cv| facts::openshift_version(&cv));
            if version.is_none() {
                tracing::warn!(
                    "ClusterVersion version names no completed version: the driver gets no OPENSHIFT_VERSION"
                );
            }
            version
        }
        Err(e) => {
            tracing::warn!(error = %e, "reading ClusterVersion version failed: the driver gets no OPENSHIFT_VERSION");
            None
        }
    }
}

async fn foreign_nfd_master(client: &Client) -> Result<Option<String>, kube::Error> {
    use k8s_openapi::api::apps::v1::Deployment;
    let api: Api<Deployment> = Api::all(client.clone());
    for selector in [
        "app.kubernetes.io/name=node-feature-discovery",
        "app=nfd-master",
    ] {
        let params = kube::api::ListParams::default().labels(&format!(
            "{selector},{}!={}",
            crate::model::MANAGED_BY_LABEL,
            crate::model::MANAGER
        ));
        for d in api.list(&params).await?.items {
            let namespace = d.metadata.namespace.clone().unwrap_or_default();
            let workload = format!(
                "Deployment {namespace}/{}",
                d.metadata.name.as_deref().unwrap_or_default()
            );
            let service_account = d
                .spec
                .as_ref()
                .and_then(|s| s.template.spec.as_ref())
                .and_then(|p| p.service_account_name.clone())
                .unwrap_or_else(|| "default".to_owned());
            if super::coexist::service_account_is_privileged(client, &namespace, &service_account)
                .await?
            {
                return Ok(Some(workload));
            }
            tracing::warn!(%workload, %service_account, "ignoring an NFD-labelled Deployment: its ServiceAccount may not patch nodes, so it is no NFD master");
        }
    }
    Ok(None)
}

/// What resolve found: facts only (validate judges them), plus what it noticed about NFD.
pub struct Resolved {
    pub facts: ClusterFacts,
    pub notes: Vec<String>,
}

pub struct Resolver {
    client: Client,
    namespace: String,
    pub discovered: Discovered,
    image_env: BTreeMap<String, String>,
    /// Whether this operator serves /metrics over HTTPS (`--metrics-secure`).
    metrics_https: bool,
}

/// Each GPU node's runtime as read from its nodeInfo, with the NFD image labels it was read
/// under: a node is read once, and again only when those labels change (a re-image shows as a
/// new OS release or kernel), so a steady fleet costs no read. Whole Node objects are never
/// kept, only the detected flavour.
#[derive(Debug, Default)]
pub struct KnownRuntimes {
    by_node: HashMap<String, (ImageKey, NodeRuntime)>,
}

/// The node labels a re-image changes ([`KnownRuntimes`]).
type ImageKey = [Option<String>; 3];

fn image_key(node: &NodeView) -> ImageKey {
    use crate::nodes::{KERNEL_VERSION, OS_ID, OS_VERSION_ID};
    [OS_ID, OS_VERSION_ID, KERNEL_VERSION].map(|k| node.label(k).map(str::to_owned))
}

/// Above this many nodes to read, one paged LIST of all nodes is cheaper than a GET each.
const MAX_NODE_GETS: usize = 32;
/// Page size of that LIST: bounds the memory held for full Node objects at a time.
const NODE_PAGE: u32 = 250;

impl KnownRuntimes {
    /// Each GPU node's runtime, by name.
    pub fn node_runtimes(&self, gpu_nodes: &[Arc<NodeView>]) -> facts::NodeRuntimes {
        gpu_nodes
            .iter()
            .filter_map(|n| Some((n.name.clone(), self.by_node.get(&n.name)?.1)))
            .collect()
    }

    /// The runtime known for `node`, if it was read.
    pub fn get(&self, node: &str) -> Option<NodeRuntime> {
        self.by_node.get(node).map(|(_, r)| *r)
    }

    /// Reads the nodeInfo of the GPU nodes not read yet or re-imaged since, and forgets nodes
    /// that are no GPU nodes any more: a GET each, or one paged LIST when many are due
    /// (the first pass of a large fleet).
    pub async fn refresh(
        &mut self,
        client: &Client,
        gpu_nodes: &[Arc<NodeView>],
        openshift: bool,
    ) -> Result<(), kube::Error> {
        let names: std::collections::HashSet<&str> =
            gpu_nodes.iter().map(|n| n.name.as_str()).collect();
        self.by_node.retain(|n, _| names.contains(n.as_str()));
        let due: HashMap<&str, ImageKey> = gpu_nodes
            .iter()
            .map(|n| (n.name.as_str(), image_key(n)))
            .filter(|(name, key)| self.by_node.get(*name).is_none_or(|(k, _)| k != key))
            .collect();
        if due.is_empty() {
            return Ok(());
        }
        let api: Api<Node> = Api::all(client.clone());
        let mut record = |node: &Node| {
            let Some(name) = node.metadata.name.as_deref() else {
                return;
            };
            if let Some(key) = due.get(name) {
                let detected = facts::detect(&facts::NodeRuntimeInfo::of_node(node));
                let runtime = facts::on_cluster(detected, openshift);
                self.by_node.insert(name.to_owned(), (key.clone(), runtime));
            }
        };
        if due.len() <= MAX_NODE_GETS {
            for name in due.keys() {
                if let Some(node) = api.get_opt(name).await? {
                    record(&node);
                }
            }
            return Ok(());
        }
        let mut params = kube::api::ListParams::default().limit(NODE_PAGE);
        loop {
            let page = api.list(&params).await?;
            page.items.iter().for_each(&mut record);
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => return Ok(()),
            }
        }
    }
}

impl Resolver {
    pub fn new(
        client: Client,
        namespace: String,
        discovered: Discovered,
        image_env: BTreeMap<String, String>,
        metrics_https: bool,
    ) -> Self {
        Resolver {
            client,
            namespace,
            discovered,
            image_env,
            metrics_https,
        }
    }

    /// Whether a ServiceMonitor with the name of the operator's own exists and is not ours
    /// (the installer's). Read only when the policy asks for one where the API is served.
    async fn foreign_operator_service_monitor(
        &self,
        policy: &ClusterPolicy,
    ) -> Result<bool, kube::Error> {
        use crate::operands::operator_metrics;
        if !self.discovered.service_monitor || operator_metrics::wanted(&policy.spec).is_none() {
            return Ok(false);
        }
        let api: Api<kube::api::DynamicObject> = Api::namespaced_with(
            self.client.clone(),
            &self.namespace,
            &crate::operands::dcgm_exporter::service_monitor_api_resource(),
        );
        Ok(api
            .get_metadata_opt(operator_metrics::NAME)
            .await?
            .is_some_and(|found| {
                !super::plan::is_ours(&found.metadata, policy.metadata.uid.as_deref())
            }))
    }

    /// The cluster's one runtime (facts::cluster_runtime) from its GPU nodes' runtimes.
    fn cluster_runtime(&self, node_runtimes: &facts::NodeRuntimes) -> facts::Runtime {
        facts::cluster_runtime(
            self.discovered.openshift,
            node_runtimes
                .values()
                .filter_map(|r| r.flavour())
                .map(facts::RuntimeFlavour::runtime),
        )
    }

    /// The flavour of the primary toolkit DaemonSet (operands::toolkit_flavour::primary), from
    /// what the render reads too, for the label stage that places nodes on it.
    pub fn toolkit_primary(
        &self,
        runtimes: &KnownRuntimes,
        stores: &Stores,
        gpu_nodes: &[Arc<NodeView>],
    ) -> facts::RuntimeFlavour {
        use crate::operands::{toolkit, toolkit_flavour};
        let node_runtimes = runtimes.node_runtimes(gpu_nodes);
        let live = stores
            .daemon_sets
            .get(&ObjectRef::new(toolkit::NAME).within(&self.namespace))
            .and_then(|ds| toolkit_flavour::live_flavour(&ds));
        toolkit_flavour::primary(
            live,
            &node_runtimes,
            gpu_nodes,
            self.cluster_runtime(&node_runtimes),
        )
    }

    pub async fn resolve(
        &self,
        runtimes: &KnownRuntimes,
        policy: &ClusterPolicy,
        stores: &Stores,
        nodes: &[Arc<NodeView>],
    ) -> Result<Resolved, kube::Error> {
        let gpu_nodes = facts::gpu_nodes(nodes);
        let node_runtimes = runtimes.node_runtimes(&gpu_nodes);
        let runtime = self.cluster_runtime(&node_runtimes);
        let ours_deployed = stores
            .deployments
            .get(&ObjectRef::new(crate::operands::nfd::MASTER).within(&self.namespace))
            .is_some();
        let nfd_running = facts::nfd_already_running(
            self.discovered.foreign_nfd.as_deref(),
            nodes,
            ours_deployed,
        );
        let nfd_frozen =
            facts::nfd_beside_ours(self.discovered.foreign_nfd.as_deref(), ours_deployed);
        let mut notes = Vec::new();
        if let Some(why) = &nfd_running
            && policy.spec.is_enabled(Component::Nfd)
        {
            notes.push(format!(
                "node-feature-discovery is not deployed: NFD already runs ({why})"
            ));
        }
        stores
            .user_config_maps
            .fetch(
                &self.client,
                &self.namespace,
                facts::config_map_names(&policy.spec),
            )
            .await?;
        let driver_toolkit = self.driver_toolkit_image_stream(policy).await?;
        let facts = facts::assemble(
            &policy.spec,
            &Cached {
                stores,
                namespace: &self.namespace,
            },
            Observed {
                namespace: self.namespace.clone(),
                owner: facts::owner_reference(policy),
                runtime,
                node_runtimes,
                openshift: self.discovered.openshift,
                openshift_version: self.discovered.openshift_version.clone(),
                service_monitor_api: self.discovered.service_monitor,
                operator_metrics_https: self.metrics_https,
                foreign_operator_service_monitor: self
                    .foreign_operator_service_monitor(policy)
                    .await?,
                nfd_running,
                nfd_frozen,
                gpu_nodes,
                image_env: self.image_env.clone(),
                driver_toolkit: driver_toolkit.as_ref().map(facts::driver_toolkit_tags),
                driver_toolkit_broken: driver_toolkit
                    .as_ref()
                    .is_some_and(facts::driver_toolkit_broken),
            },
        );
        Ok(Resolved { facts, notes })
    }

    /// OpenShift's `openshift/driver-toolkit` ImageStream when the policy asks for the Driver
    /// Toolkit on OpenShift (one GET; the image API is OpenShift's); `None` when it is absent
    /// or not asked for.
    async fn driver_toolkit_image_stream(
        &self,
        policy: &ClusterPolicy,
    ) -> Result<Option<serde_json::Value>, kube::Error> {
        use crate::operands::driver_toolkit::{IMAGE_STREAM, IMAGE_STREAM_NAMESPACE};
        let asked = policy
            .spec
            .operator
            .as_ref()
            .and_then(|o| o.use_ocp_driver_toolkit)
            == Some(true);
        if !self.discovered.openshift || !asked {
            return Ok(None);
        }
        let resource = kube::discovery::ApiResource {
            group: "image.openshift.io".to_owned(),
            version: "v1".to_owned(),
            api_version: "image.openshift.io/v1".to_owned(),
            kind: "ImageStream".to_owned(),
            plural: "imagestreams".to_owned(),
        };
        let api: Api<kube::api::DynamicObject> =
            Api::namespaced_with(self.client.clone(), IMAGE_STREAM_NAMESPACE, &resource);
        let found = api.get_opt(IMAGE_STREAM).await?;
        Ok(found.map(|stream| serde_json::to_value(&stream).unwrap_or_default()))
    }
}

/// The operator namespace's objects, from the caches.
struct Cached<'a> {
    stores: &'a Stores,
    namespace: &'a str,
}

impl facts::NamespaceObjects for Cached<'_> {
    fn config_map(&self, name: &str) -> Option<Arc<ConfigMap>> {
        self.stores.config_map(self.namespace, name)
    }

    fn daemon_set(&self, name: &str) -> Option<Arc<DaemonSet>> {
        self.stores
            .daemon_sets
            .get(&ObjectRef::new(name).within(self.namespace))
    }

    fn daemon_sets_labelled(&self, key: &str, value: &str) -> Vec<Arc<DaemonSet>> {
        self.stores
            .daemon_sets
            .state()
            .into_iter()
            .filter(|ds| {
                ds.metadata.namespace.as_deref() == Some(self.namespace)
                    && ds
                        .metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(key))
                        .map(String::as_str)
                        == Some(value)
            })
            .collect()
    }
}

/// Image fallbacks from the operator's environment (`*_IMAGE`), as OLM sets them.
pub fn image_env_from_process() -> BTreeMap<String, String> {
    std::env::vars()
        .filter(|(k, _)| k.ends_with("_IMAGE"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::facts::Runtime;
    use crate::nodes::{OS_ID, OS_VERSION_ID};

    fn view(name: &str, id: &str, version: &str) -> Arc<NodeView> {
        let labels = [
            (OS_ID.to_string(), id.to_string()),
            (OS_VERSION_ID.to_string(), version.to_string()),
        ]
        .into();
        Arc::new(NodeView::from_labels(name, None, &labels))
    }

    #[test]
    fn os_tag_keeps_full_version_except_for_rhel_family() {
        use crate::operands::driver_os::primary_os;
        assert_eq!(
            primary_os(&[view("a", "ubuntu", "22.04")], None).as_deref(),
            Some("ubuntu22.04")
        );
        assert_eq!(
            primary_os(&[view("a", "rhel", "9.4")], None).as_deref(),
            Some("rhel9")
        );
        assert_eq!(primary_os(&[], None), None);
    }

    #[test]
    fn runtime_comes_from_the_version_prefix() {
        assert_eq!(
            facts::parse_runtime("containerd://2.1.0"),
            Runtime::Containerd
        );
        assert_eq!(facts::parse_runtime("cri-o://1.33.2"), Runtime::CriO);
        assert_eq!(facts::parse_runtime("docker://28.2.2"), Runtime::Docker);
        assert_eq!(facts::parse_runtime(""), Runtime::Containerd);
    }
}
