//! The operator's own pass up to its first write, for a policy that is not applied (IO, reads
//! only): the caches filled as at start-up, then resolve -> validate -> render. `gpu-operator
//! plan` reads what it predicts from here, so the plan and the pass it predicts share every
//! rule; only the apply (and what follows it) is left out.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::DaemonSet;
use kube::Client;

use super::coexist::Judge;
use super::resolve::{Discovered, KnownRuntimes, Resolver};
use super::stores::Stores;
use crate::api::ClusterPolicy;
use crate::facts::{self, ClusterFacts};
use crate::model::ValidatedPolicy;
use crate::nodes::NodeView;
use crate::render::{self, DesiredState};

/// What a pass would make of one policy.
pub struct Preview {
    pub validated: ValidatedPolicy,
    pub facts: ClusterFacts,
    pub desired: DesiredState,
    /// Notes resolve made (NFD already running, say).
    pub notes: Vec<String>,
}

/// The caches and discovery a pass starts from, read once.
pub struct Session {
    stores: Stores,
    resolver: Resolver,
    runtimes: KnownRuntimes,
    nodes: Vec<Arc<NodeView>>,
    /// Keeps the watches running while the session is used.
    _pump: tokio::task::JoinHandle<()>,
}

/// How the operator whose pass is previewed runs: its namespace and what it takes from its
/// environment and flags.
pub struct Operator {
    pub namespace: String,
    /// `*_IMAGE` fallbacks from its container's environment (as OLM sets them).
    pub image_env: BTreeMap<String, String>,
    pub metrics_https: bool,
    /// Namespaces where NVIDIA's operator is looked for.
    pub nvidia_operator_namespaces: BTreeSet<String>,
}

impl Session {
    /// Discovers the optional APIs, fills every cache the pass reads and reads the GPU nodes'
    /// runtimes, as the operator does before its first pass.
    pub async fn open(client: &Client, operator: Operator) -> anyhow::Result<Session> {
        let mut judge = Judge::new(client.clone(), operator.nvidia_operator_namespaces);
        let discovered = Discovered::probe(client, &mut judge).await?;
        let (stores, triggers) = Stores::start(client, &operator.namespace);
        let pump = tokio::spawn(async move {
            let mut triggers = std::pin::pin!(triggers);
            while triggers.next().await.is_some() {}
        });
        stores
            .wait_until_ready()
            .await
            .map_err(|e| anyhow::anyhow!("filling the caches: {e}"))?;
        let nodes = stores.nodes.snapshot();
        let mut runtimes = KnownRuntimes::default();
        runtimes
            .refresh(client, &facts::gpu_nodes(&nodes), discovered.openshift)
            .await?;
        let resolver = Resolver::new(
            client.clone(),
            operator.namespace,
            discovered,
            operator.image_env,
            operator.metrics_https,
        );
        Ok(Session {
            stores,
            resolver,
            runtimes,
            nodes,
            _pump: pump,
        })
    }

    /// resolve -> validate -> render for `policy`, as a pass would.
    pub async fn preview(&self, policy: &ClusterPolicy) -> anyhow::Result<Preview> {
        let resolved = self
            .resolver
            .resolve(&self.runtimes, policy, &self.stores, &self.nodes)
            .await?;
        let validated = crate::validate::validate(policy, &resolved.facts);
        let desired = render::render(&validated, &resolved.facts);
        Ok(Preview {
            validated,
            facts: resolved.facts,
            desired,
            notes: resolved.notes,
        })
    }

    /// Every node, as the pass sees it.
    pub fn nodes(&self) -> &[Arc<NodeView>] {
        &self.nodes
    }

    /// The operator's DaemonSets as the cache holds them.
    pub fn daemon_sets(&self) -> Vec<Arc<DaemonSet>> {
        self.stores.daemon_sets.state()
    }

    pub fn discovered(&self) -> &Discovered {
        &self.resolver.discovered
    }
}
