//! `gpu-operator plan -f policy.yaml` (also `kubectl gpu plan`): what applying a ClusterPolicy
//! will do, read from the live cluster and written nowhere.
//!
//! The policy goes through the API server as a dry run (its schema defaults and validation rules
//! apply, nothing is stored), then through the operator's own pass up to its first write
//! (controller::preview): resolve, validate, render. Against what runs now that gives the
//! objects that change (a field diff), which DaemonSets roll their pods and on how many nodes,
//! the driver rollout forecast by the upgrade stage's own state machine (cordons, evictions by
//! namespace, waves), the node labels the layouts-by-model and node pools change, and the
//! operands whose input is invalid, with the message status would show. docs/plan.md.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;

use anyhow::{Context, bail};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde::Serialize;
use serde_json::{Value, json};

use crate::api::ClusterPolicy;
use crate::controller::preview::{Operator, Preview, Session};
use crate::controller::upgrade::forecast::{Ending, Forecast};
use crate::json_diff::{self, Difference};
use crate::render::Outcome as Rendered;
use crate::takeover::{self, Outcome};

/// How the plan is printed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    #[default]
    Text,
    /// One JSON object (`"version": 1`), the shape docs/plan.md documents.
    Json,
}

/// Arguments of `gpu-operator plan`.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// The ClusterPolicy to plan for (YAML or JSON; `-` reads standard input).
    #[arg(short = 'f', long = "filename", value_name = "FILE")]
    pub file: std::path::PathBuf,
    /// The namespace the operator runs in and deploys operands to.
    #[arg(short = 'n', long, default_value = "gpu-operator")]
    pub namespace: String,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Text)]
    pub output: Output,
    /// Kubeconfig to use (default: KUBECONFIG, ~/.kube/config, or the in-cluster account).
    #[arg(long)]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// Kubeconfig context to use.
    #[arg(long)]
    pub context: Option<String>,
}

/// The plan, as `-o json` prints it.
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Plan {
    pub version: u32,
    pub policy: String,
    /// `create` (no such policy yet) or `update`.
    pub change: String,
    /// Set when the policy would not be the one in force (an older policy exists).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ignored_for: Option<String>,
    /// Operands whose input is invalid (frozen: nothing of theirs changes) or reported.
    pub verdicts: Vec<Verdict>,
    pub objects: Vec<ObjectChange>,
    pub rollouts: Vec<Rollout>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver_upgrade: Option<DriverUpgrade>,
    pub node_labels: Vec<NodeLabels>,
    /// GPU nodes whose advertised `nvidia.com/*` resources change.
    pub allocatable: Vec<NodeAllocatable>,
    /// Notes of the operator's own resolve (NFD already running, say).
    pub notes: Vec<String>,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Verdict {
    pub component: String,
    /// `invalid`: its objects are left as they are; `reported`: it still renders.
    pub state: String,
    pub message: String,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ObjectChange {
    /// `Kind namespace/name`.
    pub object: String,
    /// `created`, `changed` or `deleted`.
    pub change: String,
    /// The fields that change, `path: now -> planned` (at most [`FIELDS_SHOWN`]).
    pub fields: Vec<String>,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Rollout {
    pub daemon_set: String,
    /// `pods-start` (new DaemonSet), `pods-roll`, `pods-stay` (OnDelete), `driver-upgrade`,
    /// `driver-kept` (its pods already run the installation rendered), `pods-removed`
    /// (DaemonSet deleted).
    pub outcome: String,
    /// Nodes whose pods start, roll or go.
    pub nodes: usize,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct DriverUpgrade {
    pub max_parallel_upgrades: usize,
    pub max_unavailable: usize,
    pub drain: bool,
    /// The DaemonSet that pulls the new driver images on every node before the first cordon.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pre_pull: Option<String>,
    pub waves: usize,
    pub nodes: Vec<NodeUpgrade>,
    /// Pods evicted, counted by namespace.
    pub evictions_by_namespace: BTreeMap<String, usize>,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NodeUpgrade {
    pub node: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wave: Option<usize>,
    pub cordon: bool,
    pub restart_only: bool,
    pub evicted: Vec<String>,
    pub waits_for_jobs: usize,
    /// `done`, `untouched`, or `failed: <reason>`.
    pub ending: String,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NodeLabels {
    pub node: String,
    /// Labels set, with their new value.
    pub set: BTreeMap<String, String>,
    pub removed: Vec<String>,
    /// Labels the plan would set that someone else set by hand: left alone.
    pub kept: Vec<String>,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NodeAllocatable {
    pub node: String,
    /// The node's allocatable `nvidia.com/*` resources now, as it reports them.
    pub now: BTreeMap<String, String>,
    /// What its device plugin will advertise once the change is rolled out (crate::allocatable).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub planned: Option<BTreeMap<String, u64>>,
    /// Why nothing can be predicted (the plugin would refuse the layout, say).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// At most this many changed fields are listed per object.
const FIELDS_SHOWN: usize = 8;

/// Field manager named on the dry-run requests (nothing is stored under it).
const FIELD_MANAGER: &str = "gpu-operator-plan";

/// Runs the command: prints the plan.
pub fn run(args: &PlanArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let plan = runtime.block_on(async {
        let client =
            super::doctor::client(args.kubeconfig.as_deref(), args.context.as_deref()).await?;
        make(&client, args).await
    })?;
    match args.output {
        Output::Text => out.write_all(text(&plan).as_bytes()),
        Output::Json => {
            let json = serde_json::to_string_pretty(&plan).context("serialising the plan")?;
            writeln!(out, "{json}")
        }
    }
    .context("writing the plan")
}

/// Reads the policy file as a JSON value.
fn read_file(path: &std::path::Path) -> anyhow::Result<Value> {
    let text = if path.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading the policy from stdin")?
    } else {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
    };
    let value: Value = serde_yaml_ng::from_str(&text)
        .with_context(|| format!("{}: not a YAML or JSON document", path.display()))?;
    if value["kind"] != "ClusterPolicy" || value["apiVersion"] != "nvidia.com/v1" {
        bail!(
            "{}: kind {} apiVersion {}: plan reads one ClusterPolicy (apiVersion nvidia.com/v1)",
            path.display(),
            value["kind"],
            value["apiVersion"]
        );
    }
    Ok(value)
}

/// The policy as the API server would store it: a dry-run create or replace (schema defaults
/// and validation rules applied, nothing stored), and whether it replaces `live`.
async fn as_stored(
    client: &Client,
    mut policy: Value,
    live: Option<&ClusterPolicy>,
) -> anyhow::Result<ClusterPolicy> {
    let api: Api<ClusterPolicy> = Api::all(client.clone());
    let params = PostParams {
        dry_run: true,
        field_manager: Some(FIELD_MANAGER.to_owned()),
    };
    let name = policy["metadata"]["name"]
        .as_str()
        .context("the policy has no metadata.name")?
        .to_owned();
    let stored = match live {
        Some(live) => {
            policy["metadata"]["resourceVersion"] = json!(live.resource_version());
            let object: ClusterPolicy =
                serde_json::from_value(policy).context("reading the policy")?;
            api.replace(&name, &params, &object).await
        }
        None => {
            let object: ClusterPolicy =
                serde_json::from_value(policy).context("reading the policy")?;
            api.create(&params, &object).await
        }
    };
    stored.map_err(|e| match e {
        kube::Error::Api(e) => anyhow::anyhow!(
            "the API server refuses the policy ({}): {}; nothing would change",
            e.reason,
            e.message
        ),
        e => anyhow::Error::new(e).context("dry-run of the policy"),
    })
}

/// How our operator runs, read from its Deployment in `namespace` (its container's `*_IMAGE`
/// environment and `--metrics-secure`); defaults when none is found.
pub(crate) async fn operator_settings(
    client: &Client,
    namespace: &str,
) -> anyhow::Result<Operator> {
    let deployments = Api::<Deployment>::namespaced(client.clone(), namespace)
        .list(&ListParams::default())
        .await
        .with_context(|| format!("listing Deployments in {namespace}"))?;
    let container = deployments
        .items
        .iter()
        .filter_map(|d| d.spec.as_ref()?.template.spec.as_ref())
        .flat_map(|p| p.containers.iter())
        .find(|c| c.args.as_ref().and_then(|a| a.first()).map(String::as_str) == Some("run"));
    let image_env = container
        .and_then(|c| c.env.as_ref())
        .into_iter()
        .flatten()
        .filter(|e| e.name.ends_with("_IMAGE"))
        .filter_map(|e| Some((e.name.clone(), e.value.clone()?)))
        .collect();
    let metrics_https = !container
        .and_then(|c| c.args.as_ref())
        .into_iter()
        .flatten()
        .any(|a| a == "--metrics-secure=false");
    Ok(Operator {
        namespace: namespace.to_owned(),
        image_env,
        metrics_https,
        nvidia_operator_namespaces: std::collections::BTreeSet::from([namespace.to_owned()]),
    })
}

/// Builds the plan.
pub async fn make(client: &Client, args: &PlanArgs) -> anyhow::Result<Plan> {
    let file = read_file(&args.file)?;
    let name = file["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let policies = Api::<ClusterPolicy>::all(client.clone())
        .list(&ListParams::default())
        .await
        .context("listing ClusterPolicies (is the ClusterPolicy CRD installed?)")?
        .items;
    let live = policies.iter().find(|p| p.name_any() == name).cloned();
    let (active, _) = super::doctor::split_active(policies);
    let planned = as_stored(client, file, live.as_ref()).await?;
    let session = Session::open(client, operator_settings(client, &args.namespace).await?).await?;
    let after = session.preview(&planned).await?;
    let before = match &live {
        Some(live) => Some(session.preview(live).await?),
        None => None,
    };
    let live_daemon_sets: Vec<DaemonSet> = session
        .daemon_sets()
        .iter()
        .map(|d| (**d).clone())
        .collect();
    let change = if live.is_some() { "update" } else { "create" }.to_owned();
    if let Some(active) = active.map(|a| a.name_any()).filter(|a| *a != name) {
        // An ignored policy changes nothing but its own status.
        return Ok(Plan {
            version: 1,
            policy: name,
            change,
            ignored_for: Some(active),
            verdicts: verdicts(&after),
            notes: after.notes.clone(),
            ..Plan::default()
        });
    }
    let compared = Comparison {
        planned: &planned,
        after: &after,
        before: before.as_ref(),
        live_daemon_sets: &live_daemon_sets,
    };
    Ok(Plan {
        policy: name,
        change,
        ..consequences(client, &args.namespace, &session, compared).await?
    })
}

/// One policy's pass against the cluster as it runs now.
pub struct Comparison<'a> {
    /// The policy as it would be stored.
    pub planned: &'a ClusterPolicy,
    /// The pass for it.
    pub after: &'a Preview,
    /// The pass for the policy in force now, if there is one of that name.
    pub before: Option<&'a Preview>,
    /// The operand DaemonSets running now: ours, or NVIDIA's on a takeover.
    pub live_daemon_sets: &'a [DaemonSet],
}

/// What the pass of `compared.after` changes: objects, pod rollouts, the driver rollout
/// forecast, node labels and advertised GPUs, with the verdicts and notes of its validate and
/// resolve. `policy` and `change` are left for the caller to name.
pub async fn consequences(
    client: &Client,
    namespace: &str,
    session: &Session,
    compared: Comparison<'_>,
) -> anyhow::Result<Plan> {
    let Comparison {
        planned,
        after,
        before,
        live_daemon_sets,
    } = compared;
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .context("listing Nodes")?
        .items;
    let mut plan = Plan {
        version: 1,
        verdicts: verdicts(after),
        notes: after.notes.clone(),
        ..Plan::default()
    };
    plan.objects = object_changes(client, after, before).await?;
    let (rollouts, driver) = rollouts(after, before, live_daemon_sets, &nodes);
    plan.rollouts = rollouts;
    if let Some((live, next)) = driver {
        let validator_expected = live_daemon_sets
            .iter()
            .any(|d| d.name_any() == crate::operands::validator::NAME);
        let forecast = crate::controller::upgrade::forecast_rollout(
            client,
            namespace,
            &planned.spec,
            session.nodes(),
            &live,
            &next,
            validator_expected,
        )
        .await
        .context("forecasting the driver rollout")?;
        plan.driver_upgrade = forecast.map(|r| DriverUpgrade {
            pre_pull: r.pre_pull,
            ..driver_upgrade(&r.policy, &r.forecast)
        });
    }
    plan.node_labels = node_labels(after, &nodes);
    plan.allocatable = allocatable(before, after, &nodes, &plan.node_labels);
    Ok(plan)
}

fn verdicts(after: &Preview) -> Vec<Verdict> {
    let invalid = after
        .validated
        .invalid
        .iter()
        .map(|(operand, message)| Verdict {
            component: operand.name().to_owned(),
            state: "invalid".to_owned(),
            message: message.clone(),
        });
    let reported = after
        .validated
        .reported
        .iter()
        .map(|(operand, message)| Verdict {
            component: operand.name().to_owned(),
            state: "reported".to_owned(),
            message: message.clone(),
        });
    invalid.chain(reported).collect()
}

/// `Kind namespace/name`, or `Kind name` for a cluster-scoped object.
pub(crate) fn key_of(object: &Value) -> String {
    let kind = object["kind"].as_str().unwrap_or_default();
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    match object["metadata"]["namespace"].as_str() {
        Some(ns) => format!("{kind} {ns}/{name}"),
        None => format!("{kind} {name}"),
    }
}

fn short(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(80) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

/// The changed fields of `desired` against `live`, `path: live -> planned`.
pub fn field_changes(desired: &Value, live: &Value) -> Vec<String> {
    let mut desired = desired.clone();
    // Owner references carry the policy's uid, which a dry run does not show.
    if let Some(meta) = desired["metadata"].as_object_mut() {
        meta.remove("ownerReferences");
    }
    json_diff::differences("", &desired, live, &crate::controller::plan::PLAN_RULES)
        .iter()
        .map(|d| match d {
            Difference::Missing { path, wanted } => format!("{path}: none -> {}", short(wanted)),
            Difference::Extra { path, found } => format!("{path}: {} -> none", short(found)),
            Difference::Length {
                path,
                wanted,
                found,
            }
            | Difference::Changed {
                path,
                wanted,
                found,
            } => {
                format!("{path}: {} -> {}", short(found), short(wanted))
            }
        })
        .collect()
}

/// Reads `object` as it is live, if it exists.
pub(crate) async fn live_object(client: &Client, object: &Value) -> anyhow::Result<Option<Value>> {
    let api_version = object["apiVersion"].as_str().unwrap_or_default();
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let kind = object["kind"].as_str().unwrap_or_default();
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind));
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    let api: Api<DynamicObject> = match object["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    };
    match api.get_opt(name).await {
        Ok(found) => Ok(found.map(|o| serde_json::to_value(o).unwrap_or_default())),
        // A kind the cluster does not serve: it would be created (and refused) by the apply.
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", key_of(object))),
    }
}

pub(crate) fn rendered_objects(preview: &Preview) -> anyhow::Result<Vec<Value>> {
    preview
        .desired
        .operands
        .iter()
        .filter_map(|s| match &s.outcome {
            Rendered::Rendered(objects) => Some(objects.to_json()),
            _ => None,
        })
        .try_fold(Vec::new(), |mut all, objects| {
            all.extend(objects.context("serialising the rendered objects")?);
            Ok(all)
        })
}

/// What the apply sends for `object` over `live`, when not `object` itself: a DaemonSet adopted
/// from NVIDIA's operator keeps its live pod template (controller::apply's
/// `ScopedApi::adopted`).
fn sent_over(object: &Value, live: &Value) -> Option<Value> {
    if object["kind"] != "DaemonSet" {
        return None;
    }
    let desired: DaemonSet = serde_json::from_value(object.clone()).ok()?;
    let live: DaemonSet = serde_json::from_value(live.clone()).ok()?;
    let sent = takeover::keep_adopted_template(&desired, &live)?;
    serde_json::to_value(sent).ok()
}

/// Every object the apply would create or change, and those of operands the policy turns off
/// (pruned). A frozen (invalid) operand's objects are left out: they do not change.
async fn object_changes(
    client: &Client,
    after: &Preview,
    before: Option<&Preview>,
) -> anyhow::Result<Vec<ObjectChange>> {
    let planned = rendered_objects(after)?;
    let mut changes = Vec::new();
    for object in &planned {
        let key = key_of(object);
        match live_object(client, object).await? {
            None => changes.push(ObjectChange {
                object: key,
                change: "created".to_owned(),
                fields: Vec::new(),
            }),
            Some(live) => {
                let sent = sent_over(object, &live);
                let fields = field_changes(sent.as_ref().unwrap_or(object), &live);
                if !fields.is_empty() {
                    changes.push(ObjectChange {
                        object: key,
                        change: "changed".to_owned(),
                        fields: fields.into_iter().take(FIELDS_SHOWN).collect(),
                    });
                }
            }
        }
    }
    // Operands turned off: what they render now is pruned.
    let disabled: Vec<_> = after
        .desired
        .operands
        .iter()
        .filter(|s| matches!(s.outcome, Rendered::Disabled))
        .map(|s| s.operand)
        .collect();
    if let Some(before) = before {
        for state in &before.desired.operands {
            let Rendered::Rendered(objects) = &state.outcome else {
                continue;
            };
            if !disabled.contains(&state.operand) {
                continue;
            }
            for object in objects
                .to_json()
                .context("serialising the rendered objects")?
            {
                if live_object(client, &object).await?.is_some() {
                    changes.push(ObjectChange {
                        object: key_of(&object),
                        change: "deleted".to_owned(),
                        fields: Vec::new(),
                    });
                }
            }
        }
    }
    Ok(changes)
}

/// Taints the DaemonSet controller tolerates for every pod it places (its default
/// tolerations), by key and effect; `network-unavailable` only for host-network pods.
const DAEMON_SET_TOLERATED: [(&str, &str); 6] = [
    ("node.kubernetes.io/not-ready", "NoExecute"),
    ("node.kubernetes.io/unreachable", "NoExecute"),
    ("node.kubernetes.io/disk-pressure", "NoSchedule"),
    ("node.kubernetes.io/memory-pressure", "NoSchedule"),
    ("node.kubernetes.io/pid-pressure", "NoSchedule"),
    ("node.kubernetes.io/unschedulable", "NoSchedule"),
];
const NETWORK_UNAVAILABLE: &str = "node.kubernetes.io/network-unavailable";

/// Nodes the DaemonSet controller would run a pod of `ds` on: its node selector and required
/// node affinity admit the node and every NoSchedule or NoExecute taint is tolerated, with the
/// controller's own tolerations added (the scheduler's rules, as doctor applies them:
/// cli::doctor::affinity).
pub fn selected(ds: &DaemonSet, nodes: &[Node]) -> usize {
    use super::doctor::affinity::{affinity_misses, blocks, selector_misses, untolerated};
    let template = ds
        .spec
        .as_ref()
        .map(|s| s.template.clone())
        .unwrap_or_default();
    let host_network = template
        .spec
        .as_ref()
        .and_then(|s| s.host_network)
        .unwrap_or(false);
    let pod = k8s_openapi::api::core::v1::Pod {
        metadata: template.metadata.unwrap_or_default(),
        spec: template.spec,
        status: None,
    };
    let controller_tolerates = |taint: &k8s_openapi::api::core::v1::Taint| {
        DAEMON_SET_TOLERATED
            .iter()
            .any(|(key, effect)| taint.key == *key && taint.effect == *effect)
            || (host_network && taint.key == NETWORK_UNAVAILABLE && taint.effect == "NoSchedule")
    };
    nodes
        .iter()
        .filter(|node| selector_misses(&pod, node).is_empty())
        .filter(|node| affinity_misses(&pod, node).is_none())
        .filter(|node| {
            untolerated(&pod, node, |t| blocks(t) && !controller_tolerates(t)).is_empty()
        })
        .count()
}

fn scheduled(ds: &DaemonSet) -> usize {
    ds.status.as_ref().map_or(0, |s| {
        usize::try_from(s.desired_number_scheduled).unwrap_or(0)
    })
}

/// What happens to each DaemonSet's pods, and the driver DaemonSet whose template changes (live,
/// planned) for the rollout forecast.
#[allow(clippy::type_complexity)]
fn rollouts(
    after: &Preview,
    before: Option<&Preview>,
    live: &[DaemonSet],
    nodes: &[Node],
) -> (Vec<Rollout>, Option<(DaemonSet, DaemonSet)>) {
    // DaemonSets of operands the policy turns off (their pods go); a frozen operand's stay.
    let removed: Vec<String> = before
        .into_iter()
        .flat_map(|b| &b.desired.operands)
        .filter(|s| {
            after
                .desired
                .operands
                .iter()
                .any(|a| a.operand == s.operand && matches!(a.outcome, Rendered::Disabled))
        })
        .filter_map(|s| match &s.outcome {
            Rendered::Rendered(objects) => Some(&objects.daemon_sets),
            _ => None,
        })
        .flatten()
        .map(|d| d.name_any())
        .collect();
    let desired: Vec<DaemonSet> = after
        .desired
        .operands
        .iter()
        .filter_map(|s| match &s.outcome {
            Rendered::Rendered(objects) => Some(objects.daemon_sets.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    let mut out = Vec::new();
    let mut driver = None;
    for p in takeover::plan(&desired, live) {
        let live_ds = live.iter().find(|d| d.name_any() == p.name);
        let ours = desired.iter().find(|d| d.name_any() == p.name);
        let (outcome, count) = match (&p.outcome, live_ds, ours) {
            (Outcome::Created, _, Some(ours)) => ("pods-start", selected(ours, nodes)),
            (Outcome::PodsRoll, Some(l), _) => ("pods-roll", scheduled(l)),
            (Outcome::PodsStay, Some(l), _) => ("pods-stay", scheduled(l)),
            // NVIDIA's digest of our template is the one its pods carry: they run what we
            // render, and the upgrade stage leaves them (takeover::Outcome::Driver).
            (
                Outcome::Driver {
                    installation_kept: true,
                },
                Some(l),
                _,
            ) => ("driver-kept", scheduled(l)),
            (Outcome::Driver { .. }, Some(l), Some(ours)) => {
                driver = Some((l.clone(), ours.clone()));
                ("driver-upgrade", scheduled(l))
            }
            (Outcome::NotRendered, Some(l), _) if removed.contains(&p.name) => {
                ("pods-removed", scheduled(l))
            }
            _ => continue,
        };
        out.push(Rollout {
            daemon_set: p.name,
            outcome: outcome.to_owned(),
            nodes: count,
        });
    }
    (out, driver)
}

fn driver_upgrade(
    policy: &crate::controller::upgrade::machine::Policy,
    f: &Forecast,
) -> DriverUpgrade {
    let mut evictions_by_namespace = BTreeMap::new();
    for pod in f.nodes.iter().flat_map(|n| &n.evicted) {
        let namespace = pod.split_once('/').map_or(pod.as_str(), |(ns, _)| ns);
        *evictions_by_namespace
            .entry(namespace.to_owned())
            .or_insert(0) += 1;
    }
    DriverUpgrade {
        max_parallel_upgrades: policy.max_parallel,
        max_unavailable: policy.max_unavailable,
        drain: policy.drain.is_some(),
        pre_pull: None,
        waves: f.waves,
        nodes: f
            .nodes
            .iter()
            .map(|n| NodeUpgrade {
                node: n.name.clone(),
                wave: n.wave,
                cordon: n.cordoned,
                restart_only: n.restart_only,
                evicted: n.evicted.clone(),
                waits_for_jobs: n.waits_for_jobs,
                ending: match &n.ending {
                    Ending::Done => "done".to_owned(),
                    Ending::Untouched => "untouched".to_owned(),
                    Ending::Failed(why) => format!("failed: {why}"),
                },
            })
            .collect(),
        evictions_by_namespace,
    }
}

/// The labels the node-pool stage (layouts by model, pools) would change on each GPU node, by
/// the patch it would send.
fn node_labels(after: &Preview, nodes: &[Node]) -> Vec<NodeLabels> {
    use crate::node_pools::{Record, desired, object_patch};
    let spec = &after.validated.spec;
    let views: BTreeMap<&str, &Arc<crate::nodes::NodeView>> = after
        .facts
        .gpu_nodes
        .iter()
        .map(|v| (v.name.as_str(), v))
        .collect();
    let mut out = Vec::new();
    for node in nodes {
        let Some(view) = views.get(node.name_any().as_str()) else {
            continue;
        };
        let want = desired(spec, &after.validated.by_model, view);
        let record = Record::of(view).unwrap_or_default();
        let (patch, kept) = object_patch(node, &record, &want);
        let labels = patch
            .as_ref()
            .and_then(|p| p["metadata"]["labels"].as_object().cloned())
            .unwrap_or_default();
        let set: BTreeMap<String, String> = labels
            .iter()
            .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
            .collect();
        let removed: Vec<String> = labels
            .iter()
            .filter(|(_, v)| v.is_null())
            .map(|(k, _)| k.clone())
            .collect();
        let kept: Vec<String> = kept.into_iter().filter(|k| !k.contains(':')).collect();
        if set.is_empty() && removed.is_empty() && kept.is_empty() {
            continue;
        }
        out.push(NodeLabels {
            node: node.name_any(),
            set,
            removed,
            kept,
        });
    }
    out
}

/// What a GPU node with `labels` advertises under `preview`'s sharing and MIG configs.
pub fn predicted(
    preview: &Preview,
    labels: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, u64>, String> {
    use crate::allocatable::{NodeGpus, advertised};
    use crate::nodes::{DEVICE_PLUGIN_CONFIG, GPU_COUNT, GPU_PRODUCT, MIG_CONFIG};
    use crate::sharing::{device_plugin, mig};
    let spec = &preview.validated.spec;
    // A node serving virtual machines runs no device plugin: its GPUs go to VMs under the
    // names KubeVirt's plugin derives from the PCI database, none of them `nvidia.com/gpu`.
    let view = crate::nodes::NodeView::from_labels("", None, labels);
    if crate::workload::Sandbox::of(spec).workload_of(&view)
        != crate::api::SandboxWorkload::Container
    {
        return Ok(BTreeMap::new());
    }
    let product = labels.get(GPU_PRODUCT).map_or("", String::as_str);
    let count = labels
        .get(GPU_COUNT)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no {GPU_COUNT} label (GFD has not labelled the node)"))?;
    let strategy_override = spec.mig.as_ref().and_then(|m| m.strategy).map(|s| match s {
        crate::api::MigStrategy::None => "none",
        crate::api::MigStrategy::Single => "single",
        crate::api::MigStrategy::Mixed => "mixed",
    });
    let plugin = match &preview.validated.sharing {
        Some(sharing) => {
            let key = labels
                .get(DEVICE_PLUGIN_CONFIG)
                .unwrap_or(&sharing.default_key);
            let yaml = sharing.data.get(key).ok_or_else(|| {
                format!("its {DEVICE_PLUGIN_CONFIG} key {key:?} is not in the sharing config")
            })?;
            Some(
                device_plugin::validate_key(&sharing.source, key, yaml, strategy_override)
                    .map_err(|problems| format!("sharing config key {key:?}: {problems:?}"))?,
            )
        }
        None => None,
    };
    let strategy = plugin
        .as_ref()
        .map_or(strategy_override.unwrap_or("none"), |p| {
            p.mig_strategy.as_str()
        });
    let layout = labels
        .get(MIG_CONFIG)
        .filter(|_| spec.is_enabled(crate::api::Component::MigManager));
    let config = match (&preview.facts.mig_config, layout) {
        (_, None) => None,
        (Some(custom), Some(_)) => Some(
            mig::parse_config(&custom.name, &custom.data)
                .map_err(|p| format!("MIG config {}: {p:?}", custom.name))?,
        ),
        (None, Some(_)) => Some(
            mig::parse_yaml(
                "default-mig-parted-config",
                mig::MIG_CONFIG_KEY,
                &mig::default_config(),
            )
            .map_err(|p| format!("the default MIG config: {p:?}"))?,
        ),
    };
    let gpus = NodeGpus { product, count };
    advertised(
        &gpus,
        plugin.as_ref(),
        strategy,
        config.as_ref().zip(layout.map(String::as_str)),
    )
}

/// Per GPU node, what its device plugin advertises now and after, where the configs that
/// decide it (sharing key, MIG layout, strategy) change.
fn allocatable(
    before: Option<&Preview>,
    after: &Preview,
    nodes: &[Node],
    label_changes: &[NodeLabels],
) -> Vec<NodeAllocatable> {
    let mut out = Vec::new();
    for node in nodes {
        let name = node.name_any();
        if !after.facts.gpu_nodes.iter().any(|v| v.name == name) {
            continue;
        }
        let labels_now = node.labels().clone();
        let mut labels_after = labels_now.clone();
        if let Some(change) = label_changes.iter().find(|c| c.node == name) {
            labels_after.extend(change.set.clone());
            for key in &change.removed {
                labels_after.remove(key);
            }
        }
        let planned = predicted(after, &labels_after);
        let unchanged = before.is_some_and(|b| predicted(b, &labels_now) == planned);
        if unchanged {
            continue;
        }
        let now = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .into_iter()
            .flatten()
            .filter(|(k, _)| k.starts_with("nvidia.com/"))
            .map(|(k, v)| (k.clone(), v.0.clone()))
            .collect();
        let (planned, error) = match planned {
            Ok(p) => (Some(p), None),
            Err(e) => (None, Some(e)),
        };
        out.push(NodeAllocatable {
            node: name,
            now,
            planned,
            error,
        });
    }
    out
}

/// The plan as text: one section per kind of consequence.
pub fn text(plan: &Plan) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(s, "ClusterPolicy {} ({}):", plan.policy, plan.change);
    if let Some(active) = &plan.ignored_for {
        let _ = writeln!(
            s,
            "  ignored: ClusterPolicy {active} is in force (the oldest wins); nothing but this \
             policy's status would change"
        );
        return s;
    }
    if !plan.verdicts.is_empty() {
        let _ = writeln!(s, "\nInvalid input (as status would report it):");
        for v in &plan.verdicts {
            let what = if v.state == "invalid" {
                "frozen, its objects stay as they are"
            } else {
                "reported, still applied"
            };
            let _ = writeln!(s, "  {} ({what}): {}", v.component, v.message);
        }
    }
    let _ = writeln!(s, "\nObjects:");
    if plan.objects.is_empty() {
        let _ = writeln!(s, "  none change");
    }
    for o in &plan.objects {
        let _ = writeln!(s, "  {}: {}", o.object, o.change);
        for f in &o.fields {
            let _ = writeln!(s, "    {f}");
        }
    }
    let _ = writeln!(s, "\nPods:");
    if plan.rollouts.is_empty() {
        let _ = writeln!(s, "  no pod restarts");
    }
    for r in &plan.rollouts {
        let what = match r.outcome.as_str() {
            "pods-start" => "new DaemonSet: pods start",
            "pods-roll" => "template changes: pods roll (RollingUpdate)",
            "pods-stay" => "template changes; OnDelete: pods stay until deleted",
            "driver-upgrade" => "driver template changes: the driver upgrade replaces its pods",
            "driver-kept" => {
                "driver template changes; its pods already run the installation rendered: \
                 nothing restarts"
            }
            "pods-removed" => "turned off: DaemonSet and pods removed",
            other => other,
        };
        let _ = writeln!(s, "  {}: {what}, on {} node(s)", r.daemon_set, r.nodes);
    }
    if let Some(u) = &plan.driver_upgrade {
        let _ = writeln!(
            s,
            "\nDriver upgrade: {} wave(s) (maxParallelUpgrades {}, maxUnavailable {} node(s), drain {})",
            u.waves,
            u.max_parallel_upgrades,
            u.max_unavailable,
            if u.drain { "on" } else { "off" }
        );
        let _ = writeln!(
            s,
            "  each node: cordon, evictions, the driver pod replaced, the validator pod restarted to \
             validate it, uncordon"
        );
        if let Some(pre_pull) = &u.pre_pull {
            let _ = writeln!(
                s,
                "  first, DaemonSet {pre_pull} pulls the new driver images on every node (no node \
                 is cordoned before its images are there)"
            );
        }
        for n in &u.nodes {
            let wave = n
                .wave
                .map_or_else(|| "-".to_owned(), |w| format!("wave {w}"));
            let mut line = format!("  {} ({wave}): ", n.node);
            if n.restart_only {
                line.push_str("driver pod restarted in place, no cordon");
            } else if n.cordon {
                line.push_str("cordoned");
            } else if n.wave.is_some() {
                line.push_str("already cordoned");
            }
            if !n.evicted.is_empty() {
                let _ = write!(line, ", evicts {}", n.evicted.join(", "));
            }
            if n.waits_for_jobs > 0 {
                let _ = write!(line, ", waits for {} job pod(s) first", n.waits_for_jobs);
            }
            let _ = writeln!(s, "{line}; {}", n.ending);
        }
        if !u.evictions_by_namespace.is_empty() {
            let by_ns: Vec<String> = u
                .evictions_by_namespace
                .iter()
                .map(|(ns, n)| format!("{ns}: {n}"))
                .collect();
            let _ = writeln!(s, "  evictions by namespace: {}", by_ns.join(", "));
        }
    }
    if !plan.node_labels.is_empty() {
        let _ = writeln!(s, "\nNode labels:");
        for n in &plan.node_labels {
            let mut parts: Vec<String> = n.set.iter().map(|(k, v)| format!("{k}={v}")).collect();
            parts.extend(n.removed.iter().map(|k| format!("{k}-")));
            parts.extend(n.kept.iter().map(|k| format!("{k} (set by hand: kept)")));
            let _ = writeln!(s, "  {}: {}", n.node, parts.join(", "));
        }
    }
    if !plan.allocatable.is_empty() {
        let _ = writeln!(s, "\nAdvertised GPUs (node allocatable):");
        let show = |m: &mut dyn Iterator<Item = (String, String)>| {
            let parts: Vec<String> = m.map(|(k, v)| format!("{k}: {v}")).collect();
            if parts.is_empty() {
                "none".to_owned()
            } else {
                parts.join(", ")
            }
        };
        for a in &plan.allocatable {
            let now = show(&mut a.now.iter().map(|(k, v)| (k.clone(), v.clone())));
            let planned = match (&a.planned, &a.error) {
                (Some(p), _) => show(&mut p.iter().map(|(k, v)| (k.clone(), v.to_string()))),
                (None, Some(e)) => format!("cannot be predicted: {e}"),
                (None, None) => "unknown".to_owned(),
            };
            let _ = writeln!(s, "  {}: now {now}; planned {planned}", a.node);
        }
    }
    for note in &plan.notes {
        let _ = writeln!(s, "\nNote: {note}");
    }
    s
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
