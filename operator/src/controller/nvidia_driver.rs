//! The NVIDIADriver reconcile (IO): per NVIDIADriver, select its GPU nodes -> validate (its
//! input, then the overlap rule across pools) -> render ([`crate::operands::nvidia_driver`]) ->
//! apply/prune and observe (the ClusterPolicy's machinery, with a ledger per NVIDIADriver and
//! the NVIDIADriver as owner) -> status, patched only when it changed; then the pool label on
//! the nodes, which hands each node from the ClusterPolicy's driver DaemonSets to its pool's.
//!
//! Guarantees and caveats:
//! - Acted on only while the active ClusterPolicy sets `driver.useNvidiaDriverCRD: true` (and
//!   deploys the driver). Otherwise each NVIDIADriver is `disabled`, its DaemonSets are pruned
//!   and the pool labels removed, so the policy's own driver DaemonSets cover every GPU node
//!   again. With NVIDIA's operator live, or no ClusterPolicy in force, nothing is written but
//!   the NVIDIADrivers' status.
//! - The handover never leaves a GPU node without a driver DaemonSet that wants it: a node gets
//!   the pool label (and the policy's DaemonSets let go of it) only after its pool's DaemonSet
//!   was applied in this pass, and loses it when the pool stops covering it. The driver pods'
//!   anti-affinity keeps one driver pod per node meanwhile.
//! - Two pools selecting the same GPU node: the older keeps it, the younger is `notReady` with
//!   a message naming both and the nodes, renders nothing new and keeps what runs (decision 8).
//!   An NVIDIADriver with invalid input is frozen the same way; the nodes it already ran on
//!   keep its label, the others stay with the policy's driver.
//! - Node selectors over labels the node cache does not keep are answered by one label-selected
//!   metadata list per NVIDIADriver and pass; a relabelled node is seen on the next pass (a
//!   pool that is not ready looks again after a while).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ListParams};
use kube::{Client, Resource, ResourceExt};

use super::observe::Diagnoser;
use super::owner::{self, Again, Error, LabelAttempts, Owner, UNSETTLED_REQUEUE};
use super::plan::Ledger;
use super::scheduler::Requeue;
use super::{Deps, apply, observe, status};
use crate::api::{
    ClusterPolicy, Component, ImageKind, NVIDIADriver, NvidiaDriverState, NvidiaDriverStatus, State,
};
use crate::facts::{ClusterFacts, ConfigMapData};
use crate::model::{Operand, ValidatedPolicy};
use crate::nodes::{DEPLOY_OPERANDS, DRIVER_POOL, LabelPatch, NodeView};
use crate::operands::driver::{self, referenced_config_maps};
use crate::operands::nvidia_driver::{self as pool, Claim, ValidatedNvidiaDriver};
use crate::render::{DesiredState, OperandState, Outcome};

/// What one NVIDIADriver pass reads: the controller's dependencies, NVIDIA's operator if it
/// is live, and the ClusterPolicy in force with what its last pass validated and resolved.
struct Pass<'a> {
    deps: &'a Deps,
    client: &'a Client,
    namespace: &'a str,
    nvidia_operator: Option<&'a str>,
    policy: Option<(&'a ClusterPolicy, &'a ValidatedPolicy, &'a ClusterFacts)>,
}

/// What the NVIDIADriver passes keep between passes: a ledger per NVIDIADriver (by uid), and
/// the pool labels sent.
#[derive(Default)]
pub struct Memory {
    ledgers: BTreeMap<String, Ledger>,
    /// Pool label patches the cache has not shown yet.
    labels: LabelAttempts,
}

/// Why NVIDIADrivers are not acted on now, or `None` when they are.
fn not_in_use(ctx: &Pass<'_>) -> Option<String> {
    if let Some(other) = ctx.nvidia_operator {
        return Some(format!(
            "NVIDIA's GPU operator ({other}) is live and runs the drivers; this operator stands aside"
        ));
    }
    let Some((policy, _, _)) = ctx.policy else {
        return Some("no ClusterPolicy is in force".to_owned());
    };
    if !policy.spec.is_enabled(Component::Driver) {
        return Some(format!(
            "ClusterPolicy {} sets driver.enabled=false",
            policy.name_any()
        ));
    }
    if !driver::uses_nvidia_driver_crd(&policy.spec) {
        return Some(format!(
            "ClusterPolicy {} does not set driver.useNvidiaDriverCRD=true; its own driver \
             DaemonSets serve every GPU node",
            policy.name_any()
        ));
    }
    None
}

/// The line a ClusterPolicy's status carries with `useNvidiaDriverCRD`: which GPU nodes run an
/// NVIDIADriver pool's driver, and which keep the policy's own.
pub fn policy_note(
    policy: &ClusterPolicy,
    served: bool,
    nodes: &[Arc<NodeView>],
) -> Option<String> {
    if !driver::uses_nvidia_driver_crd(&policy.spec) {
        return None;
    }
    if !served {
        return Some(
            "driver.useNvidiaDriverCRD: the NVIDIADriver CRD is not served, so every GPU node \
             keeps this policy's driver DaemonSets"
                .to_owned(),
        );
    }
    let gpu: Vec<&NodeView> = nodes
        .iter()
        .filter(|n| n.is_gpu_node() && n.label(DEPLOY_OPERANDS) != Some("false"))
        .map(Arc::as_ref)
        .collect();
    let mut pools: BTreeMap<&str, usize> = BTreeMap::new();
    let mut own = Vec::new();
    for node in &gpu {
        match node.label(DRIVER_POOL) {
            Some(p) => *pools.entry(p).or_default() += 1,
            None => own.push(node.name.as_str()),
        }
    }
    let covered: usize = pools.values().sum();
    let by_pool: Vec<String> = pools.iter().map(|(p, n)| format!("{p}: {n}")).collect();
    let listed: Vec<&str> = own.iter().take(10).copied().collect();
    let more = own.len().saturating_sub(10);
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    Some(match (covered, own.len()) {
        (0, _) => "driver.useNvidiaDriverCRD: no NVIDIADriver selects a GPU node yet, so every \
                   GPU node keeps this policy's driver DaemonSets"
            .to_owned(),
        (_, 0) => format!(
            "driver.useNvidiaDriverCRD: all {covered} GPU node(s) run the driver of an \
             NVIDIADriver pool ({})",
            by_pool.join(", ")
        ),
        (_, n) => format!(
            "driver.useNvidiaDriverCRD: {covered} GPU node(s) run the driver of an NVIDIADriver \
             pool ({}); {n} GPU node(s) no NVIDIADriver selects keep this policy's driver: {}{more}",
            by_pool.join(", "),
            listed.join(", ")
        ),
    })
}

/// Reconciles every NVIDIADriver, then the pool labels on the nodes. `policy` is the
/// ClusterPolicy in force with what its last pass validated and resolved (none while it is
/// being deleted or has not had a pass).
pub async fn reconcile_all(
    deps: &Deps,
    memory: &mut Memory,
    diagnoser: &mut Diagnoser,
    policy: Option<(&ClusterPolicy, &ValidatedPolicy, &ClusterFacts)>,
) -> Result<Requeue, Error> {
    let Some(store) = deps.nvidia_drivers.as_ref() else {
        return Ok(None);
    };
    let nvidia_operator = deps.nvidia.holder();
    let ctx = &Pass {
        deps,
        client: &deps.client,
        namespace: &deps.settings.namespace,
        nvidia_operator: nvidia_operator.as_deref(),
        policy,
    };
    let drivers: Vec<NVIDIADriver> = store
        .state()
        .iter()
        .filter_map(|g| g.0.as_ref().ok().cloned())
        .filter(|d| d.metadata.deletion_timestamp.is_none())
        .collect();
    let nodes = deps.stores.nodes.snapshot();
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    if let Some(why) = not_in_use(ctx) {
        let acts = ctx.nvidia_operator.is_none() && ctx.policy.is_some();
        for d in &drivers {
            if acts {
                // Switched off: the pool's DaemonSets go, the policy's cover the nodes again.
                let desired = one(Outcome::Disabled);
                apply_for(ctx, memory, d, &desired).await?;
            }
            let status = NvidiaDriverStatus {
                state: NvidiaDriverState::Disabled,
                namespace: Some(ctx.namespace.to_owned()),
                conditions: owner::keep_transition_times(
                    d.status.as_ref().and_then(|s| s.conditions.clone()),
                    Some(vec![status::condition_now(
                        status::READY,
                        false,
                        "Disabled",
                        why.clone(),
                        d.metadata.generation,
                        now.clone(),
                    )]),
                ),
                selected_nodes: None,
                components: None,
            };
            owner::patch_status(ctx.client, d, d.status.as_ref(), &status).await?;
        }
        if acts {
            label_nodes(ctx.client, &mut memory.labels, &nodes, &BTreeMap::new()).await?;
        }
        return Ok(None);
    }
    let Some((_, validated_policy, policy_facts)) = ctx.policy else {
        return Ok(None);
    };

    // Select and validate every pool, then the overlap rule over the valid ones.
    let mut pools = Vec::new();
    let mut invalid: BTreeMap<String, String> = BTreeMap::new();
    for d in &drivers {
        let selected = select(ctx.client, d, &nodes).await?;
        let facts = pool_facts(ctx, policy_facts, d, &selected);
        let (validated, problems) = validate(d, selected, &facts, &deps.image_env);
        if !problems.is_empty() {
            invalid.insert(d.name_any(), problems.join("; "));
        }
        pools.push((d, validated, facts));
    }
    let claims: Vec<Claim> = pools
        .iter()
        .filter(|(d, _, _)| !invalid.contains_key(&d.name_any()))
        .map(|(d, v, _)| Claim {
            name: d.name_any(),
            created: d.metadata.creation_timestamp.as_ref().map(|t| t.0),
            nodes: v.nodes.iter().map(|n| n.name.clone()).collect(),
        })
        .collect();
    invalid.extend(pool::overlaps(&claims));

    let mut wanted: BTreeMap<String, String> = BTreeMap::new();
    let mut outcomes = Vec::new();
    for (d, validated, facts) in &pools {
        let name = d.name_any();
        let outcome = match invalid.get(&name) {
            Some(message) => Outcome::Invalid(message.clone()),
            None => Outcome::Rendered(pool::render(validated_policy, validated, facts)),
        };
        let desired = one(outcome);
        let applied = apply_for(ctx, memory, d, &desired).await?;
        let label = pool::pool_label_value(&name);
        match &desired.operands[0].outcome {
            Outcome::Rendered(objects) => {
                // Only nodes whose OS got a DaemonSet leave the policy's driver.
                for ds in &objects.daemon_sets {
                    for node in validated.nodes.iter().filter(|n| runs_on(ds, n)) {
                        wanted.insert(node.name.clone(), label.clone());
                    }
                }
            }
            // Frozen: the nodes it ran on stay its own.
            _ => {
                for node in nodes
                    .iter()
                    .filter(|n| n.label(DRIVER_POOL) == Some(label.as_str()))
                {
                    wanted.entry(node.name.clone()).or_insert(label.clone());
                }
            }
        }
        outcomes.push((*d, validated, desired, applied));
    }
    let observed = observe::observe(ctx.client, &deps.stores, diagnoser).await;
    let mut next: Requeue = None;
    for (d, validated, desired, applied) in &outcomes {
        let requeue = report(ctx, d, validated, desired, applied, &observed, now.clone()).await?;
        next = next.into_iter().chain(requeue).min();
    }
    let in_flight = label_nodes(ctx.client, &mut memory.labels, &nodes, &wanted).await?;
    let labels = (in_flight > 0).then_some(UNSETTLED_REQUEUE);
    Ok(next.into_iter().chain(labels).min())
}

/// A desired state with the one NVIDIADriver operand.
fn one(outcome: Outcome) -> DesiredState {
    DesiredState {
        operands: vec![OperandState {
            operand: Operand::NvidiaDriver,
            outcome,
        }],
    }
}

/// Whether `ds` selects `node` by its OS labels (the pool's nodes all match the rest).
fn runs_on(ds: &k8s_openapi::api::apps::v1::DaemonSet, node: &NodeView) -> bool {
    let selector = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.node_selector.clone())
        .unwrap_or_default();
    selector
        .iter()
        .filter(|(k, _)| k.starts_with("feature.node.kubernetes.io/system-os_release"))
        .all(|(k, v)| node.labels.get(k) == Some(v))
}

/// The GPU nodes the NVIDIADriver's selector matches, each carrying the selector's labels (the
/// node cache keeps only the labels the operator reads). Selectors over read labels are matched
/// in the cache; others cost one label-selected metadata list.
async fn select(
    client: &Client,
    d: &NVIDIADriver,
    nodes: &[Arc<NodeView>],
) -> Result<Vec<Arc<NodeView>>, Error> {
    let selector = pool::selector(&d.spec);
    let gpu = |n: &&Arc<NodeView>| n.is_gpu_node() && n.label(DEPLOY_OPERANDS) != Some("false");
    let names: BTreeSet<String> = if selector.keys().all(|k| crate::nodes::is_read_label(k)) {
        nodes
            .iter()
            .filter(|n| n.matches(&selector))
            .map(|n| n.name.clone())
            .collect()
    } else {
        let params = ListParams::default().labels(&pool::label_selector(&d.spec));
        Api::<Node>::all(client.clone())
            .list_metadata(&params)
            .await
            .map_err(|source| Error::Select {
                owner: Owner::of(d),
                source,
            })?
            .items
            .into_iter()
            .map(|n| n.name_any())
            .collect()
    };
    Ok(nodes
        .iter()
        .filter(gpu)
        .filter(|n| names.contains(&n.name))
        .map(|n| {
            // The pool's selector as labels: copied only for the pool's nodes.
            let mut n = NodeView::clone(n);
            n.labels
                .extend(selector.iter().map(|(k, v)| (k.clone(), v.clone())));
            Arc::new(n)
        })
        .collect())
}

/// The facts a pool renders with: the policy's, with the NVIDIADriver as owner, the pool's
/// nodes and OS, and the ConfigMaps its settings name (from the cache of the namespace).
fn pool_facts(
    ctx: &Pass<'_>,
    policy: &ClusterFacts,
    d: &NVIDIADriver,
    nodes: &[Arc<NodeView>],
) -> ClusterFacts {
    let (os_pools, _) = crate::operands::driver_os::pools(nodes);
    let as_driver = crate::api::DriverSpec {
        repo_config: d
            .spec
            .repo_config
            .as_ref()
            .map(|r| crate::api::DriverRepoConfigSpec {
                config_map_name: r.name.clone(),
            }),
        cert_config: d.spec.cert_config.clone(),
        kernel_module_config: d.spec.kernel_module_config.clone(),
        ..Default::default()
    };
    let driver_config_maps = referenced_config_maps(&as_driver)
        .into_iter()
        .filter_map(|(_, name)| {
            let cm = ctx.deps.stores.config_maps.state().into_iter().find(|c| {
                c.name_any() == name && c.namespace().as_deref() == Some(ctx.namespace)
            })?;
            Some((
                name.to_owned(),
                ConfigMapData {
                    name: name.to_owned(),
                    data: cm.data.clone().unwrap_or_default(),
                },
            ))
        })
        .collect();
    ClusterFacts {
        owner: d.controller_owner_ref(&()),
        os_tag: os_pools.first().map(|p| p.tag.clone()),
        gpu_nodes: nodes.to_vec(),
        driver_config_maps,
        ..policy.clone()
    }
}

/// Validate stage of one NVIDIADriver: its image, the driver-manager image it names, and the
/// driver operand's own checks. Returns the pool and its problems.
fn validate(
    d: &NVIDIADriver,
    nodes: Vec<Arc<NodeView>>,
    facts: &ClusterFacts,
    env: &BTreeMap<String, String>,
) -> (ValidatedNvidiaDriver, Vec<String>) {
    let mut problems = pool::check(&d.spec, facts);
    let image = pool::image(&d.spec).unwrap_or_else(|e| {
        problems.push(e);
        String::new()
    });
    let lookup = |name: &str| env.get(name).cloned();
    let manager_image = match d.spec.manager.as_ref().map(|m| &m.image) {
        Some(fields) if fields.image.is_some() || fields.version.is_some() => {
            match crate::api::resolve(Some(fields), ImageKind::DriverManager, &lookup) {
                Ok(r) => Some(r.reference),
                Err(e) => {
                    problems.push(format!("spec.manager: {e}"));
                    None
                }
            }
        }
        _ => None,
    };
    (
        ValidatedNvidiaDriver {
            name: d.name_any(),
            spec: d.spec.clone(),
            image,
            manager_image,
            nodes,
        },
        problems,
    )
}

/// Apply stage for one NVIDIADriver: its operand with its own ledger, owned by it.
async fn apply_for(
    ctx: &Pass<'_>,
    memory: &mut Memory,
    d: &NVIDIADriver,
    desired: &DesiredState,
) -> Result<apply::ApplyReport, Error> {
    let uid = d.uid().unwrap_or_default();
    let ledger = memory.ledgers.entry(uid.clone()).or_default();
    owner::apply(
        ctx.deps,
        &Owner::of(d),
        Some(uid.as_str()),
        desired,
        ledger,
        &[],
    )
    .await
}

/// Observe and status stages of one NVIDIADriver.
async fn report(
    ctx: &Pass<'_>,
    d: &NVIDIADriver,
    pool: &ValidatedNvidiaDriver,
    desired: &DesiredState,
    applied: &apply::ApplyReport,
    observed: &observe::Observed,
    now: Time,
) -> Result<Requeue, Error> {
    let unsupported = crate::operands::nvidia_driver::not_acted_on(&d.spec);
    let notes: Vec<String> = crate::operands::nvidia_driver::unknown_os(pool)
        .into_iter()
        .collect();
    let unsettled = applied.unsettled();
    let computed = status::compute(&status::StatusInputs {
        notes: &notes,
        unsupported: &unsupported,
        ..owner::status_inputs(
            d.metadata.generation,
            ctx.namespace,
            desired,
            observed,
            &pool.nodes,
            applied,
            &unsettled,
            now,
        )
    });
    let invalid = matches!(desired.operands[0].outcome, Outcome::Invalid(_));
    let mut conditions = computed.conditions;
    let empty = pool.nodes.is_empty() && !invalid;
    if empty {
        // "No GPU node" here means the pool's selector matched none.
        for c in conditions.iter_mut().flatten() {
            if c.type_ == status::READY {
                c.message = format!(
                    "nodeSelector {} selects no GPU node",
                    crate::operands::nvidia_driver::label_selector(&d.spec)
                );
            }
        }
    }
    let status = NvidiaDriverStatus {
        state: match computed.state {
            State::Ready if !empty => NvidiaDriverState::Ready,
            _ => NvidiaDriverState::NotReady,
        },
        namespace: computed.namespace,
        conditions: owner::keep_transition_times(
            d.status.as_ref().and_then(|s| s.conditions.clone()),
            conditions,
        ),
        selected_nodes: Some(pool.nodes.len() as i32),
        components: computed.components,
    };
    let ready = status.state == NvidiaDriverState::Ready;
    owner::patch_status(ctx.client, d, d.status.as_ref(), &status).await?;
    let again = Again {
        ready,
        waits_for_user: invalid,
        unsettled: !unsettled.is_empty(),
        retry_after: applied.retry_after,
        deadline: None,
    };
    Ok(again.requeue(ctx.deps.settings.not_ready_requeue))
}

/// Sets [`DRIVER_POOL`] to `wanted[node]` on each GPU node and removes it elsewhere, with a
/// merge patch on the node's resource version (decision 2). Returns how many patches the cache
/// has not shown yet.
async fn label_nodes(
    client: &Client,
    attempts: &mut LabelAttempts,
    nodes: &[Arc<NodeView>],
    wanted: &BTreeMap<String, String>,
) -> Result<usize, Error> {
    let writes = owner::write_labels(client, nodes, attempts, None, |node| {
        let want = wanted.get(&node.name);
        if node.labels.get(DRIVER_POOL) == want {
            return LabelPatch::new();
        }
        [(DRIVER_POOL.to_owned(), want.cloned())].into()
    })
    .await;
    if let Some(source) = writes.failure {
        return Err(Error::Labels {
            purpose: " for their NVIDIADriver pools",
            source,
        });
    }
    Ok(attempts.in_flight(nodes))
}
