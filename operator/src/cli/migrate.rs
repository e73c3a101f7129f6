//! `gpu-operator migrate --from-nvidia` (IO around pure plans): hands a fleet that NVIDIA's GPU
//! Operator runs over to this operator with nothing restarted (docs/migrate-from-nvidia.md).
//!
//! A dry run by default: it reads the cluster and prints every object the takeover touches and
//! what each change restarts (crate::takeover), then this operator's first pass over the policy
//! as `gpu-operator plan` forecasts a change (cli::plan::consequences over
//! controller::preview: objects, pods, driver rollout, node labels, advertised GPUs), and refuses, without `--force`, when our CRD
//! would drop a field the stored ClusterPolicy holds. With `--apply` it stops NVIDIA's operator
//! (its Deployment scaled to zero, its leader Lease released once no pod of it runs), keeps the
//! ClusterPolicy out of NVIDIA's `helm uninstall` (and hands it to a release of our chart when
//! asked), and replaces NVIDIA's ClusterPolicy CRD with ours, checking that the policy reads
//! back with every field it held. The operator then adopts the operands through their owner
//! reference to the policy (decision 19) and keeps their templates where they differ from ours
//! only in what changes nothing run (decision 20).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

use super::plan::Comparison;
use crate::api::ClusterPolicy;
use crate::api::crd::CRD_NAME;
use crate::controller::coexist::NVIDIA_OPERATOR_LEASE;
use crate::controller::plan::is_ours;
use crate::controller::preview::Session;
use crate::json_diff::{self, Rules};
use crate::takeover;

/// Arguments of `gpu-operator migrate`.
#[derive(Debug, clap::Args)]
pub struct MigrateArgs {
    /// Take over from NVIDIA's GPU Operator (the only source there is; required, so the
    /// command says what it does).
    #[arg(long, required = true)]
    pub from_nvidia: bool,
    /// The namespace NVIDIA's operator and its operands run in; this operator's goes there too.
    #[arg(short = 'n', long, default_value = "gpu-operator")]
    pub namespace: String,
    /// Do it. Without it nothing is written: the plan is printed.
    #[arg(long)]
    pub apply: bool,
    /// Go on although our CRD would drop fields the ClusterPolicy holds (they are listed).
    #[arg(long)]
    pub force: bool,
    /// Hand the ClusterPolicy to this Helm release of our chart (installed next with
    /// `clusterPolicy.deployCR=true`); without it the policy is left to you, and our chart is
    /// installed with `clusterPolicy.deployCR=false`.
    #[arg(long, value_name = "RELEASE")]
    pub helm_release: Option<String>,
    /// NVIDIA's operator Deployment, when it is not found by its image
    /// (`.../nvidia/gpu-operator`).
    #[arg(long, value_name = "NAME")]
    pub nvidia_deployment: Option<String>,
    /// How long to wait for NVIDIA's operator pods to go, in seconds.
    #[arg(long, default_value_t = 120)]
    pub timeout_seconds: u64,
    /// Kubeconfig to use (default: KUBECONFIG, ~/.kube/config, or the in-cluster account).
    #[arg(long)]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// Kubeconfig context to use.
    #[arg(long)]
    pub context: Option<String>,
}

/// Field manager of the writes `migrate` makes.
const FIELD_MANAGER: &str = "gpu-operator-migrate";
/// Helm's annotation that keeps an object out of `helm uninstall`.
const HELM_KEEP: &str = "helm.sh/resource-policy";
const HELM_RELEASE_NAME: &str = "meta.helm.sh/release-name";
const HELM_RELEASE_NAMESPACE: &str = "meta.helm.sh/release-namespace";
const MANAGED_BY: &str = "app.kubernetes.io/managed-by";

/// Runs the command: prints the plan, and with `--apply` carries it out.
pub fn run(args: &MigrateArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let client =
            super::doctor::client(args.kubeconfig.as_deref(), args.context.as_deref()).await?;
        let live = Live::read(&client, args).await?;
        let first_pass = FirstPass::read(&client, &live, args).await?;
        let plan = plan(&live, &first_pass, args)?;
        out.write_all(plan.text.as_bytes())
            .context("writing the plan")?;
        if !plan.lost.is_empty() && !args.force {
            bail!(
                "our ClusterPolicy CRD does not store {} field(s) the policy holds ({}): they \
                 would be lost. Nothing was changed. Move them to fields we store, or pass \
                 --force to lose them",
                plan.lost.len(),
                plan.lost.join(", ")
            );
        }
        if !args.apply {
            writeln!(
                out,
                "\ndry run: nothing was changed; run again with --apply to do it"
            )
            .context("writing the plan")?;
            return Ok(());
        }
        apply(&client, &live, args, out).await
    })
}

/// What the takeover reads of the cluster.
struct Live {
    policy: Value,
    policy_name: String,
    policy_uid: String,
    crd: Option<CustomResourceDefinition>,
    operator: Option<Deployment>,
    daemon_sets: Vec<DaemonSet>,
}

/// This operator's first pass over the taken-over policy, as `gpu-operator plan` forecasts a
/// pass (controller::preview: the operator's own resolve, validate and render).
struct FirstPass {
    /// What it renders.
    rendered: Vec<Value>,
    /// `Kind namespace/name` of every rendered object, with its metadata if it exists.
    existing: BTreeMap<String, Option<kube::api::ObjectMeta>>,
    /// What it changes: objects, pods, the driver rollout, node labels, advertised GPUs.
    consequences: super::plan::Plan,
}

fn policy_api(client: &Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("nvidia.com", "v1", "ClusterPolicy");
    Api::all_with(client.clone(), &ApiResource::from_gvk(&gvk))
}

/// Whether `d` runs NVIDIA's operator: named by the flag, or running its image
/// (`nvcr.io/nvidia/gpu-operator`, or a mirror keeping the `nvidia/gpu-operator` path).
fn is_nvidias_operator(d: &Deployment, named: Option<&str>) -> bool {
    if let Some(name) = named {
        return d.name_any() == name;
    }
    d.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .is_some_and(|p| {
            p.containers.iter().any(|c| {
                let image = c.image.as_deref().unwrap_or_default();
                let repository = image.split(['@']).next().unwrap_or_default();
                let repository = match repository.rsplit_once(':') {
                    Some((r, tag)) if !tag.contains('/') => r,
                    _ => repository,
                };
                repository.ends_with("nvidia/gpu-operator")
            })
        })
}

impl Live {
    async fn read(client: &Client, args: &MigrateArgs) -> anyhow::Result<Self> {
        let ns = &args.namespace;
        let policies = policy_api(client)
            .list(&ListParams::default())
            .await
            .context("listing ClusterPolicies (is the ClusterPolicy CRD installed?)")?;
        let mut live: Vec<DynamicObject> = policies
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect();
        let policy = match live.len() {
            1 => live.remove(0),
            0 => bail!("no ClusterPolicy to take over: NVIDIA's operator runs none here"),
            n => bail!("{n} ClusterPolicies; NVIDIA's operator runs one: delete the others first"),
        };
        let policy_name = policy.name_any();
        let policy_uid = policy.uid().unwrap_or_default();
        let policy = serde_json::to_value(&policy).context("reading the ClusterPolicy")?;
        let crd = Api::<CustomResourceDefinition>::all(client.clone())
            .get_opt(CRD_NAME)
            .await
            .context("reading the ClusterPolicy CRD")?;
        let deployments = Api::<Deployment>::namespaced(client.clone(), ns)
            .list(&ListParams::default())
            .await
            .with_context(|| format!("listing Deployments in {ns}"))?;
        let operator = deployments
            .items
            .into_iter()
            .find(|d| is_nvidias_operator(d, args.nvidia_deployment.as_deref()));
        let daemon_sets = Api::<DaemonSet>::namespaced(client.clone(), ns)
            .list(&ListParams::default())
            .await
            .with_context(|| format!("listing DaemonSets in {ns}"))?
            .items
            .into_iter()
            .filter(|d| d.owner_references().iter().any(|o| o.uid == policy_uid))
            .collect();
        Ok(Live {
            policy,
            policy_name,
            policy_uid,
            crd,
            operator,
            daemon_sets,
        })
    }
}

impl FirstPass {
    async fn read(client: &Client, live: &Live, args: &MigrateArgs) -> anyhow::Result<Self> {
        let policy: ClusterPolicy = serde_json::from_value(live.policy.clone())
            .context("reading the ClusterPolicy as this operator's API")?;
        let operator = super::plan::operator_settings(client, &args.namespace).await?;
        let session = Session::open(client, operator).await?;
        let after = session.preview(&policy).await?;
        let rendered = super::plan::rendered_objects(&after)?;
        let mut existing_objects = BTreeMap::new();
        for object in &rendered {
            let meta = super::plan::live_object(client, object)
                .await?
                .map(|o| serde_json::from_value(o["metadata"].clone()))
                .transpose()
                .context("reading an object's metadata")?;
            existing_objects.insert(super::plan::key_of(object), meta);
        }
        let compared = Comparison {
            planned: &policy,
            after: &after,
            // Nothing of ours runs yet: every object is compared with what NVIDIA's left.
            before: None,
            live_daemon_sets: &live.daemon_sets,
        };
        let consequences = super::plan::Plan {
            policy: live.policy_name.clone(),
            change: "takeover".to_owned(),
            ..super::plan::consequences(client, &args.namespace, &session, compared).await?
        };
        Ok(FirstPass {
            rendered,
            existing: existing_objects,
            consequences,
        })
    }
}

/// Paths under `value` that a structural schema would drop: fields neither named by
/// `properties`, nor allowed by `additionalProperties`, nor under
/// `x-kubernetes-preserve-unknown-fields`.
pub fn pruned_paths(value: &Value, schema: &Value, path: &str, out: &mut Vec<String>) {
    let preserve = schema["x-kubernetes-preserve-unknown-fields"] == json!(true);
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                let child_path = format!("{path}.{key}");
                if let Some(s) = schema["properties"].get(key) {
                    pruned_paths(child, s, &child_path, out);
                } else if schema["additionalProperties"].is_object() {
                    pruned_paths(child, &schema["additionalProperties"], &child_path, out);
                } else if !(preserve || schema["additionalProperties"] == json!(true)) {
                    out.push(child_path);
                }
            }
        }
        Value::Array(items) if schema["items"].is_object() => {
            for (i, item) in items.iter().enumerate() {
                pruned_paths(item, &schema["items"], &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// The spec fields of `policy` our CRD would not store.
fn lost_fields(policy: &Value) -> anyhow::Result<Vec<String>> {
    let crd = serde_json::to_value(crate::api::crd::crd()).context("serialising our CRD")?;
    let spec_schema =
        &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    let mut lost = Vec::new();
    pruned_paths(&policy["spec"], spec_schema, "spec", &mut lost);
    Ok(lost)
}

/// The printed plan and the fields that would be lost.
struct Plan {
    text: String,
    lost: Vec<String>,
}

/// Whether the served CRD is ours (crd_upgrade's rule).
fn crd_is_ours(crd: &CustomResourceDefinition) -> bool {
    let verdict = crate::crd_upgrade::decide(
        Some(crd),
        &crate::api::crd::crd(),
        crate::crd_upgrade::OPERATOR_VERSION,
    );
    !matches!(verdict, crate::crd_upgrade::Verdict::Foreign { .. })
}

fn plan(live: &Live, first_pass: &FirstPass, args: &MigrateArgs) -> anyhow::Result<Plan> {
    let mut text = String::new();
    let mut line = |s: String| {
        text.push_str(&s);
        text.push('\n');
    };
    let lost = lost_fields(&live.policy)?;
    let name = &live.policy_name;
    line(format!(
        "ClusterPolicy {name}: kept; this operator reconciles it"
    ));
    match &args.helm_release {
        Some(release) => line(format!(
            "  Helm: kept out of NVIDIA's `helm uninstall` ({HELM_KEEP}=keep) and handed to release \
             {release} in {ns} (install our chart as {release} with clusterPolicy.deployCR=true: \
             Helm adopts it and writes the chart's values over its spec)",
            ns = args.namespace
        )),
        None => line(format!(
            "  Helm: kept out of NVIDIA's `helm uninstall` ({HELM_KEEP}=keep) and left to you (install \
             our chart with --set clusterPolicy.deployCR=false)"
        )),
    }
    match &live.crd {
        Some(crd) if crd_is_ours(crd) => {
            line(format!("CustomResourceDefinition {CRD_NAME}: ours already"))
        }
        Some(_) => line(format!(
            "CustomResourceDefinition {CRD_NAME}: NVIDIA's, replaced by ours (the policy is read \
             back after and must hold every field it held)"
        )),
        None => line(format!("CustomResourceDefinition {CRD_NAME}: absent")),
    }
    if lost.is_empty() {
        line("  no stored field of the policy is lost".to_owned());
    } else {
        for path in &lost {
            line(format!("  LOST: {path} (our CRD does not store it)"));
        }
    }
    match &live.operator {
        Some(d) => line(format!(
            "Deployment {}/{}: NVIDIA's operator, scaled to 0 replicas; then its Lease \
             {NVIDIA_OPERATOR_LEASE} is released",
            args.namespace,
            d.name_any()
        )),
        None => line(format!(
            "NVIDIA's operator: no Deployment in {} runs it (stopped already, or name it with \
             --nvidia-deployment)",
            args.namespace
        )),
    }
    let desired: Vec<DaemonSet> = first_pass
        .rendered
        .iter()
        .filter(|o| o["kind"] == "DaemonSet")
        .map(|o| serde_json::from_value(o.clone()))
        .collect::<Result<_, _>>()
        .context("reading our rendered DaemonSets")?;
    let daemon_set_plan = takeover::plan(&desired, &live.daemon_sets);
    text.push_str(&takeover::describe_plan(&daemon_set_plan));
    let mut line = |s: String| {
        text.push_str(&s);
        text.push('\n');
    };
    for object in first_pass
        .rendered
        .iter()
        .filter(|o| o["kind"] != "DaemonSet")
    {
        let key = super::plan::key_of(object);
        let what = match first_pass.existing.get(&key).cloned().flatten() {
            None => "created".to_owned(),
            Some(meta)
                if meta
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|o| o.uid == live.policy_uid) =>
            {
                "exists, owned by the policy: adopted".to_owned()
            }
            Some(meta) if is_ours(&meta, Some(&live.policy_uid)) => {
                "exists, carries our managed-by label: adopted".to_owned()
            }
            Some(_) => format!(
                "exists and is not ours: its operand stays frozen until it is deleted or \
                 annotated {}=true",
                crate::controller::plan::ADOPT_ANNOTATION
            ),
        };
        line(format!("{key}: {what}"));
    }
    let forecast = &first_pass.consequences;
    // What restarts pods: a template that rolls, a driver whose installation differs.
    let restarted: Vec<&str> = forecast
        .rollouts
        .iter()
        .filter(|r| r.outcome == "pods-roll" || r.outcome == "driver-upgrade")
        .map(|r| r.daemon_set.as_str())
        .collect();
    if restarted.is_empty() {
        line("Pods restarted by the takeover: none".to_owned());
    } else {
        line(format!(
            "Pods restarted by the takeover: those of {}",
            restarted.join(", ")
        ));
    }
    if forecast.node_labels.is_empty() && forecast.driver_upgrade.is_none() {
        line("Nodes: no label, taint or cordon is changed by the takeover".to_owned());
    } else {
        line("Nodes: changed by the takeover (below)".to_owned());
    }
    line(String::new());
    line(
        "This operator's first pass over the policy, as `gpu-operator plan` reports a change:"
            .to_owned(),
    );
    text.push_str(&super::plan::text(forecast));
    Ok(Plan { text, lost })
}

/// Carries the plan out.
async fn apply(
    client: &Client,
    live: &Live,
    args: &MigrateArgs,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let ns = &args.namespace;
    let mut say = |s: String| writeln!(out, "{s}").context("writing the progress");
    say(String::new())?;
    if let Some(operator) = &live.operator {
        stop_operator(
            client,
            ns,
            operator,
            Duration::from_secs(args.timeout_seconds),
        )
        .await?;
        say(format!(
            "Deployment {ns}/{}: scaled to 0; no pod of it runs",
            operator.name_any()
        ))?;
        if release_lease(client, ns).await? {
            say(format!("Lease {ns}/{NVIDIA_OPERATOR_LEASE}: released"))?;
        }
    }
    hand_over_policy(client, live, args).await?;
    say(format!(
        "ClusterPolicy {}: kept out of NVIDIA's helm uninstall",
        live.policy_name
    ))?;
    if let Some(crd) = &live.crd
        && !crd_is_ours(crd)
    {
        replace_crd(client, crd).await?;
        check_policy_kept(client, live).await?;
        say(format!(
            "CustomResourceDefinition {CRD_NAME}: ours; ClusterPolicy {} reads back with every field it held",
            live.policy_name
        ))?;
    }
    let release = live.policy["metadata"]["annotations"][HELM_RELEASE_NAME]
        .as_str()
        .unwrap_or("<NVIDIA's release>");
    let deploy_cr = if args.helm_release.is_some() {
        "true"
    } else {
        "false"
    };
    let ours = args.helm_release.as_deref().unwrap_or("gpu-operator");
    say(format!(
        "\nNVIDIA's operator is stopped and its operands run on. Next:\n  helm uninstall {release} -n {ns}   \
         # NVIDIA's release; the ClusterPolicy and its operands stay\n  helm install {ours} \
         oci://<registry>/charts/gpu-operator -n {ns} --set clusterPolicy.deployCR={deploy_cr}"
    ))?;
    Ok(())
}

/// Scales NVIDIA's operator to zero and waits until none of its pods is left.
async fn stop_operator(
    client: &Client,
    ns: &str,
    operator: &Deployment,
    timeout: Duration,
) -> anyhow::Result<()> {
    let name = operator.name_any();
    let selector = operator
        .spec
        .as_ref()
        .and_then(|s| s.selector.match_labels.clone())
        .unwrap_or_default()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    anyhow::ensure!(
        !selector.is_empty(),
        "Deployment {ns}/{name} selects its pods by no label"
    );
    let api = Api::<Deployment>::namespaced(client.clone(), ns);
    api.patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"replicas": 0}})),
    )
    .await
    .with_context(|| format!("scaling Deployment {ns}/{name} to 0"))?;
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let left = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .with_context(|| format!("listing the pods of Deployment {ns}/{name}"))?
            .items;
        if left.is_empty() {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "{} pod(s) of NVIDIA's operator Deployment {ns}/{name} still run after {}s ({}); \
                 it stays scaled to 0: run again once they are gone",
                left.len(),
                timeout.as_secs(),
                left.iter()
                    .map(|p| p.name_any())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Releases NVIDIA's leader Lease when its holder no longer runs, as NVIDIA's operator does when
/// it stops cleanly (an empty holder), so this operator need not wait for it to expire
/// (decision 14 counts a live Lease). Returns whether it wrote.
async fn release_lease(client: &Client, ns: &str) -> anyhow::Result<bool> {
    let api = Api::<Lease>::namespaced(client.clone(), ns);
    let Some(lease) = api
        .get_opt(NVIDIA_OPERATOR_LEASE)
        .await
        .context("reading NVIDIA's Lease")?
    else {
        return Ok(false);
    };
    let holder = lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.clone())
        .unwrap_or_default();
    if holder.is_empty() {
        return Ok(false);
    }
    // controller-runtime's identity is `<pod name>_<uuid>`.
    let pod = holder.split('_').next().unwrap_or_default();
    if Api::<Pod>::namespaced(client.clone(), ns)
        .get_opt(pod)
        .await
        .context("reading the Lease holder's pod")?
        .is_some()
    {
        bail!("Lease {ns}/{NVIDIA_OPERATOR_LEASE} is held by {holder}, whose pod still runs");
    }
    let patch = json!({
        "metadata": {"resourceVersion": lease.metadata.resource_version},
        "spec": {"holderIdentity": null, "renewTime": null, "acquireTime": null},
    });
    api.patch(
        NVIDIA_OPERATOR_LEASE,
        &PatchParams::default(),
        &Patch::Merge(patch),
    )
    .await
    .context("releasing NVIDIA's Lease")?;
    Ok(true)
}

/// Keeps the policy out of NVIDIA's `helm uninstall`, and hands it to our release or to nobody.
async fn hand_over_policy(client: &Client, live: &Live, args: &MigrateArgs) -> anyhow::Result<()> {
    let patch = helm_handover_patch(&live.policy, args.helm_release.as_deref(), &args.namespace);
    policy_api(client)
        .patch(
            &live.policy_name,
            &PatchParams::default(),
            &Patch::Merge(patch),
        )
        .await
        .with_context(|| format!("handing ClusterPolicy {} over", live.policy_name))?;
    Ok(())
}

/// The merge patch that keeps `policy` out of NVIDIA's `helm uninstall` and hands it to our
/// release `release`, or to nobody: Helm's release annotations go, and its `managed-by: Helm`
/// label (a label another tool set stays).
fn helm_handover_patch(policy: &Value, release: Option<&str>, namespace: &str) -> Value {
    let live = &policy["metadata"]["labels"][MANAGED_BY];
    let (release, release_ns, managed_by) = match release {
        Some(r) => (json!(r), json!(namespace), json!("Helm")),
        None if *live == "Helm" => (Value::Null, Value::Null, Value::Null),
        None => (Value::Null, Value::Null, live.clone()),
    };
    let mut patch = json!({"metadata": {"annotations": {
        HELM_KEEP: "keep",
        HELM_RELEASE_NAME: release,
        HELM_RELEASE_NAMESPACE: release_ns,
    }}});
    // A null removes Helm's label; an absent label is not written at all.
    if !(managed_by.is_null() && live.is_null()) {
        patch["metadata"]["labels"] = json!({MANAGED_BY: managed_by});
    }
    patch
}

/// Replaces NVIDIA's CRD with ours (crd_upgrade's replacement: its metadata, our spec).
async fn replace_crd(client: &Client, served: &CustomResourceDefinition) -> anyhow::Result<()> {
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    let params = PostParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PostParams::default()
    };
    api.replace(CRD_NAME, &params, &crate::crd_upgrade::replacement(served))
        .await
        .context("replacing NVIDIA's ClusterPolicy CRD with ours (needs update on customresourcedefinitions)")?;
    await_established(client).await
}

/// Waits until the replaced CRD is `Established`. The server swaps the schema it applies a
/// moment later (the CRD's status has no observed generation to wait for), so the read-back
/// that follows can still see the policy through NVIDIA's schema. The refusal does not rest on
/// it: `lost_fields` compares the policy with our schema before anything is written.
async fn await_established(client: &Client) -> anyhow::Result<()> {
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    for _ in 0..120 {
        let crd = api
            .get(CRD_NAME)
            .await
            .context("reading the ClusterPolicy CRD")?;
        let established = crd
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            });
        if established {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    bail!("the ClusterPolicy CRD is not Established 30s after it was replaced")
}

/// Reads the policy back under our CRD and checks that its spec holds every field it held.
async fn check_policy_kept(client: &Client, live: &Live) -> anyhow::Result<()> {
    let lost: BTreeSet<String> = lost_fields(&live.policy)?.into_iter().collect();
    let after = policy_api(client)
        .get(&live.policy_name)
        .await
        .context("reading the ClusterPolicy back")?;
    let after = serde_json::to_value(&after).context("reading the ClusterPolicy back")?;
    let differences: Vec<String> =
        json_diff::differences("spec", &live.policy["spec"], &after["spec"], &Rules::SUBSET)
            .iter()
            .filter(|d| !lost.iter().any(|l| d.path().starts_with(l.as_str())))
            .map(|d| format!("{d:?}"))
            .collect();
    anyhow::ensure!(
        differences.is_empty(),
        "ClusterPolicy {} lost fields under our CRD: {}",
        live.policy_name,
        differences.join("; ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_field_our_crd_does_not_name_is_reported_lost_and_known_or_preserved_ones_are_not() {
        let policy = json!({"spec": {
            "driver": {"enabled": true, "futureKnob": 1},
            "daemonsets": {"labels": {"any": "value"}},
            "futureOperand": {"enabled": true},
        }});
        let lost = lost_fields(&policy).unwrap();
        assert_eq!(lost, ["spec.driver.futureKnob", "spec.futureOperand"]);

        let schema = json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true});
        let mut out = Vec::new();
        pruned_paths(&json!({"a": {"b": 1}}), &schema, "x", &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn nvidias_operator_is_found_by_its_image_or_by_name() {
        let deployment = |name: &str, image: &str| -> Deployment {
            serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": {"selector": {}, "template": {"spec": {"containers": [{"name": "c", "image": image}]}}},
            }))
            .unwrap()
        };
        assert!(is_nvidias_operator(
            &deployment("gpu-operator", "nvcr.io/nvidia/gpu-operator:v26.7.0"),
            None
        ));
        assert!(is_nvidias_operator(
            &deployment("x", "mirror.local:5000/nvidia/gpu-operator@sha256:00"),
            None
        ));
        assert!(!is_nvidias_operator(
            &deployment("gpu-operator", "ghcr.io/example/gpu-operator:0.1.0"),
            None
        ));
        assert!(is_nvidias_operator(
            &deployment("mine", "registry.local/op:1"),
            Some("mine")
        ));
    }

    #[test]
    fn the_policy_leaves_nvidias_release_and_keeps_a_managed_by_label_helm_did_not_set() {
        let helm = json!({"metadata": {"labels": {MANAGED_BY: "Helm"}}});
        let argo = json!({"metadata": {"labels": {MANAGED_BY: "argocd"}}});
        let to_nobody = helm_handover_patch(&helm, None, "gpu-operator");
        let labels = to_nobody["metadata"]["labels"].as_object().unwrap();
        assert_eq!(labels.get(MANAGED_BY), Some(&Value::Null));
        assert_eq!(to_nobody["metadata"]["annotations"][HELM_KEEP], "keep");
        assert_eq!(
            to_nobody["metadata"]["annotations"][HELM_RELEASE_NAME],
            Value::Null
        );
        let kept = helm_handover_patch(&argo, None, "gpu-operator");
        assert_eq!(kept["metadata"]["labels"][MANAGED_BY], "argocd");
        let unlabelled = helm_handover_patch(&json!({}), None, "gpu-operator");
        assert!(unlabelled["metadata"].get("labels").is_none());
        let ours = helm_handover_patch(&helm, Some("gpu-operator"), "gpu-operator");
        assert_eq!(ours["metadata"]["labels"][MANAGED_BY], "Helm");
        assert_eq!(
            ours["metadata"]["annotations"][HELM_RELEASE_NAMESPACE],
            "gpu-operator"
        );
    }
}
