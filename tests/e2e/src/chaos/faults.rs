//! The faults the driver draws from, and how each is injected and lifted again (IO). Every
//! choice a fault makes (which object, which node, how long) comes from the run's PRNG, so a
//! seed replays the same run on the same fleet.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, ObjectMeta, Patch, PatchParams};
use kube::{Client, ResourceExt};
use rand::RngExt;
use rand::rngs::StdRng;
use serde_json::json;

use super::checker::{self, ready_now, status_line};
use super::crash_loop::CrashLoop;
use super::replicas::Replicas;
use crate::faults::ControlPlane;
use crate::nodes::{self, GpuModel, NFD_GPU_LABEL_KEYS};
use crate::session::{ephemeral_gpu_node, policies};
use crate::wait;

/// The user's sharing config the chaos policy names (`devicePlugin.config.name`).
pub const SHARING_CONFIG: &str = "chaos-sharing";
/// The user's MIG layouts the chaos policy names (`migManager.config.name`).
pub const MIG_CONFIG: &str = "chaos-mig";
/// The sharing config's key every node uses.
const SHARING_KEY: &str = "time-slicing";
/// Operands the faults switch off and on again (their objects are pruned, then applied).
const TOGGLED: [&str; 2] = ["dcgmExporter", "gfd"];
/// DaemonSets whose pods a fault sends into CrashLoopBackOff.
const CRASH_LOOP_APPS: [&str; 4] = [
    "nvidia-device-plugin-daemonset",
    "gpu-feature-discovery",
    "nvidia-operator-validator",
    "nvidia-dcgm-exporter",
];
/// How long an injected problem may take to show in the policy's status.
const REPORT_TIMEOUT: Duration = Duration::from_secs(90);

/// One kind of fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    KillLeaderFirstRollout,
    KillLeaderSteady,
    KillLeaderMidSharingRoll,
    KillLeaderMidPrune,
    StopLeaderPastLease,
    ApiServerRestart,
    EtcdStop,
    DeleteManagedObject,
    EditManagedObject,
    StripManagedByLabel,
    PolicyChange,
    SharingConfigValid,
    SharingConfigInvalid,
    MigConfigValid,
    MigConfigInvalid,
    NfdLabelsFlapShort,
    NfdLabelsGonePastGrace,
    NodeAdded,
    NodeDeleted,
    CrashLoopingOperand,
}

impl Fault {
    /// The faults drawn during a run (the first-rollout kill opens every run instead).
    pub const DRAWN: [Fault; 19] = [
        Fault::KillLeaderSteady,
        Fault::KillLeaderMidSharingRoll,
        Fault::KillLeaderMidPrune,
        Fault::StopLeaderPastLease,
        Fault::ApiServerRestart,
        Fault::EtcdStop,
        Fault::DeleteManagedObject,
        Fault::EditManagedObject,
        Fault::StripManagedByLabel,
        Fault::PolicyChange,
        Fault::SharingConfigValid,
        Fault::SharingConfigInvalid,
        Fault::MigConfigValid,
        Fault::MigConfigInvalid,
        Fault::NfdLabelsFlapShort,
        Fault::NfdLabelsGonePastGrace,
        Fault::NodeAdded,
        Fault::NodeDeleted,
        Fault::CrashLoopingOperand,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Fault::KillLeaderFirstRollout => "SIGKILL leader, first rollout",
            Fault::KillLeaderSteady => "SIGKILL leader, steady",
            Fault::KillLeaderMidSharingRoll => "SIGKILL leader, mid sharing roll",
            Fault::KillLeaderMidPrune => "SIGKILL leader, mid prune",
            Fault::StopLeaderPastLease => "SIGSTOP leader past the lease",
            Fault::ApiServerRestart => "kube-apiserver restart",
            Fault::EtcdStop => "etcd stopped",
            Fault::DeleteManagedObject => "managed object deleted",
            Fault::EditManagedObject => "managed object edited",
            Fault::StripManagedByLabel => "managed-by label stripped",
            Fault::PolicyChange => "valid policy change",
            Fault::SharingConfigValid => "sharing config edit, valid",
            Fault::SharingConfigInvalid => "sharing config edit, invalid",
            Fault::MigConfigValid => "MIG config edit, valid",
            Fault::MigConfigInvalid => "MIG config edit, invalid",
            Fault::NfdLabelsFlapShort => "NFD labels flap within grace",
            Fault::NfdLabelsGonePastGrace => "NFD labels gone past grace",
            Fault::NodeAdded => "node added",
            Fault::NodeDeleted => "node deleted",
            Fault::CrashLoopingOperand => "crash-looping operand",
        }
    }
}

/// Timings of the faults.
#[derive(Clone, Debug)]
pub struct FaultSettings {
    pub lease_seconds: u64,
    pub gpu_label_grace_seconds: u64,
    /// Range of seconds etcd stays stopped.
    pub etcd_stop_seconds: (u64, u64),
}

/// Everything the faults act on, and what they changed so far.
pub struct World {
    pub admin: Client,
    pub replicas: Replicas,
    pub control_plane: ControlPlane,
    pub policy: String,
    pub rng: StdRng,
    pub settings: FaultSettings,
    /// GPU nodes this run added (deleted again at the end).
    pub added_nodes: Vec<String>,
    /// Time-slicing replicas of the valid sharing config now in place.
    pub sharing_replicas: u32,
    /// Layout names of the valid MIG config now in place.
    pub mig_layouts: u32,
    /// Counts the policy edits, for values that differ every time.
    pub edits: u32,
}

/// The ClusterPolicy spec of a chaos run: a sharing config and MIG layouts of the user's, so
/// config edits reach the consumers.
pub fn policy_spec() -> serde_json::Value {
    json!({
        "devicePlugin": {"config": {"name": SHARING_CONFIG, "default": SHARING_KEY}},
        "migManager": {"config": {"name": MIG_CONFIG, "default": "all-disabled"}},
        "mig": {"strategy": "single"},
    })
}

pub fn sharing_config(replicas: u32) -> String {
    format!(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: {replicas}\n"
    )
}

/// A valid MIG file: `all-disabled` plus `extra` more layouts that keep MIG off.
pub fn mig_config(extra: u32) -> String {
    let mut text = String::from(
        "version: v1\nmig-configs:\n  all-disabled:\n    - devices: all\n      mig-enabled: false\n",
    );
    for i in 0..extra {
        text.push_str(&format!(
            "  chaos-{i}:\n    - devices: all\n      mig-enabled: false\n"
        ));
    }
    text
}

/// Writes ConfigMap `name` with one key in `namespace`.
pub async fn write_config_map(
    admin: &Client,
    namespace: &str,
    name: &str,
    key: &str,
    value: &str,
) -> Result<()> {
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        data: Some([(key.to_owned(), value.to_owned())].into()),
        ..ConfigMap::default()
    };
    Api::<ConfigMap>::namespaced(admin.clone(), namespace)
        .patch(
            name,
            &PatchParams::apply("chaos").force(),
            &Patch::Apply(&cm),
        )
        .await
        .with_context(|| format!("writing ConfigMap {name}"))?;
    Ok(())
}

fn millis(rng: &mut StdRng, low: u64, high: u64) -> Duration {
    Duration::from_millis(rng.random_range(low..=high))
}

fn pick<'a, T>(rng: &mut StdRng, items: &'a [T]) -> Option<&'a T> {
    (!items.is_empty()).then(|| &items[rng.random_range(0..items.len())])
}

impl World {
    /// Injects `fault` and lifts it again where it is lifted (a stopped process continued, a
    /// flapped label back); returns what it did, for the log.
    pub async fn inject(&mut self, fault: Fault) -> Result<String> {
        match fault {
            Fault::KillLeaderFirstRollout => {
                let delay = millis(&mut self.rng, 0, 1500);
                tokio::time::sleep(delay).await;
                let leader = self.kill_leader().await?;
                Ok(format!("killed {leader} {delay:?} into the first rollout"))
            }
            Fault::KillLeaderSteady => {
                let leader = self.kill_leader().await?;
                Ok(format!("killed {leader}"))
            }
            Fault::KillLeaderMidSharingRoll => {
                let replicas = self.new_sharing_replicas();
                self.write_sharing(&sharing_config(replicas)).await?;
                self.sharing_replicas = replicas;
                let delay = millis(&mut self.rng, 0, 800);
                tokio::time::sleep(delay).await;
                let leader = self.kill_leader().await?;
                Ok(format!(
                    "replicas -> {replicas}, killed {leader} {delay:?} later"
                ))
            }
            Fault::KillLeaderMidPrune => {
                let enabled = self.enabled_toggles().await?;
                let section = match pick(&mut self.rng, &enabled) {
                    Some(s) => s.clone(),
                    None => {
                        // Nothing left to prune: switch one on and let it roll out first.
                        self.set_enabled(TOGGLED[0], true).await?;
                        self.await_ready(Duration::from_secs(180)).await?;
                        TOGGLED[0].to_owned()
                    }
                };
                self.set_enabled(&section, false).await?;
                let delay = millis(&mut self.rng, 0, 800);
                tokio::time::sleep(delay).await;
                let leader = self.kill_leader().await?;
                Ok(format!("{section} off, killed {leader} {delay:?} later"))
            }
            Fault::StopLeaderPastLease => {
                let leader = self.replicas.await_leader(Duration::from_secs(120)).await?;
                let pause = Duration::from_secs(self.settings.lease_seconds + 3);
                self.replicas.pause(leader, pause).await?;
                // Give the resumed process the time to notice it lost the Lease, so that its
                // exit (if it exits) is counted for this fault.
                let exited = self
                    .replicas
                    .await_exit(leader, Duration::from_secs(5))
                    .await;
                Ok(format!(
                    "stopped {} for {pause:?}; after SIGCONT it {}",
                    self.replicas.slots[leader].name,
                    if exited { "exited" } else { "kept running" }
                ))
            }
            Fault::ApiServerRestart => {
                let down = millis(&mut self.rng, 0, 3000);
                self.control_plane
                    .restart_apiserver(&self.admin, down)
                    .await?;
                Ok(format!(
                    "down {down:?} beyond its shutdown (kwok restarted after)"
                ))
            }
            Fault::EtcdStop => {
                let (low, high) = self.settings.etcd_stop_seconds;
                let stop = Duration::from_secs(self.rng.random_range(low..=high));
                self.control_plane.pause_etcd_for(stop).await?;
                // Requests that were waiting for etcd finish now; the API server must answer.
                self.control_plane.await_apiserver(&self.admin).await?;
                Ok(format!("stopped {stop:?}"))
            }
            Fault::DeleteManagedObject => {
                let Some((resource, object)) = self.random_managed_object().await? else {
                    return Ok("no managed object".into());
                };
                self.api_for(&resource, &object)
                    .delete(&object.name_any(), &DeleteParams::default())
                    .await?;
                Ok(format!("deleted {} {}", resource.kind, object.name_any()))
            }
            Fault::EditManagedObject => {
                let Some((resource, object)) = self.random_managed_object().await? else {
                    return Ok("no managed object".into());
                };
                let (patch, what) = edit_patch(&resource.kind, &object)?;
                self.api_for(&resource, &object)
                    .patch(&object.name_any(), &PatchParams::default(), &patch)
                    .await?;
                Ok(format!("{what} of {} {}", resource.kind, object.name_any()))
            }
            Fault::StripManagedByLabel => {
                let Some((resource, object)) = self.random_managed_object().await? else {
                    return Ok("no managed object".into());
                };
                let patch = json!([{"op": "remove", "path": "/metadata/labels/app.kubernetes.io~1managed-by"}]);
                self.api_for(&resource, &object)
                    .patch(
                        &object.name_any(),
                        &PatchParams::default(),
                        &Patch::<()>::Json(serde_json::from_value(patch)?),
                    )
                    .await?;
                Ok(format!("stripped {} {}", resource.kind, object.name_any()))
            }
            Fault::PolicyChange => self.policy_change().await,
            Fault::SharingConfigValid => {
                let replicas = self.new_sharing_replicas();
                self.write_sharing(&sharing_config(replicas)).await?;
                self.sharing_replicas = replicas;
                Ok(format!("replicas -> {replicas}"))
            }
            Fault::SharingConfigInvalid => {
                let bad = if self.rng.random_bool(0.5) {
                    sharing_config(1)
                } else {
                    "version: v1\nsharing: [not, a, map\n".to_owned()
                };
                self.write_sharing(&bad).await?;
                let seen = self.await_reported(SHARING_CONFIG, "device-plugin").await;
                self.write_sharing(&sharing_config(self.sharing_replicas))
                    .await?;
                seen.map(|s| format!("reported ({s}), then restored"))
            }
            Fault::MigConfigValid => {
                let layouts = (self.mig_layouts + 1) % 4;
                self.write_mig(&mig_config(layouts)).await?;
                self.mig_layouts = layouts;
                Ok(format!("{} extra layouts", layouts))
            }
            Fault::MigConfigInvalid => {
                let bad = if self.rng.random_bool(0.5) {
                    "version: v1\nmig-configs:\n  all-disabled:\n    - devices: all\n      mig-enabled: true\n      mig-devices:\n        \"9g.999gb\": 1\n".to_owned()
                } else {
                    "mig-configs: {{{".to_owned()
                };
                self.write_mig(&bad).await?;
                let seen = self.await_reported(MIG_CONFIG, "mig-manager").await;
                self.write_mig(&mig_config(self.mig_layouts)).await?;
                seen.map(|s| format!("reported ({s}), then restored"))
            }
            Fault::NfdLabelsFlapShort => {
                let grace = self.settings.gpu_label_grace_seconds * 1000;
                let gone = millis(&mut self.rng, 300, grace.saturating_sub(1500).max(300));
                self.flap_nfd_labels(gone).await
            }
            Fault::NfdLabelsGonePastGrace => {
                let grace = self.settings.gpu_label_grace_seconds * 1000;
                let gone = millis(&mut self.rng, grace + 3000, grace + 6000);
                self.flap_nfd_labels(gone).await
            }
            Fault::NodeAdded => {
                let name = self.add_node().await?;
                Ok(format!("added {name}"))
            }
            Fault::NodeDeleted => {
                let added = if self.added_nodes.is_empty() {
                    let name = self.add_node().await?;
                    self.await_ready(Duration::from_secs(180)).await?;
                    format!("added {name} first, ")
                } else {
                    String::new()
                };
                let index = self.rng.random_range(0..self.added_nodes.len());
                let name = self.added_nodes.remove(index);
                nodes::delete(&self.admin, std::slice::from_ref(&name)).await?;
                Ok(format!("{added}deleted {name}"))
            }
            Fault::CrashLoopingOperand => self.crash_loop().await,
        }
    }

    async fn kill_leader(&mut self) -> Result<String> {
        let leader = self.replicas.await_leader(Duration::from_secs(120)).await?;
        self.replicas.kill_and_restart(leader)?;
        Ok(self.replicas.slots[leader].name.clone())
    }

    fn new_sharing_replicas(&mut self) -> u32 {
        loop {
            let r = self.rng.random_range(2..=8);
            if r != self.sharing_replicas {
                return r;
            }
        }
    }

    async fn write_sharing(&self, text: &str) -> Result<()> {
        write_config_map(
            &self.admin,
            self.replicas.namespace(),
            SHARING_CONFIG,
            SHARING_KEY,
            text,
        )
        .await
    }

    async fn write_mig(&self, text: &str) -> Result<()> {
        write_config_map(
            &self.admin,
            self.replicas.namespace(),
            MIG_CONFIG,
            "config.yaml",
            text,
        )
        .await
    }

    async fn patch_policy(&self, patch: serde_json::Value) -> Result<()> {
        policies(&self.admin)
            .patch(&self.policy, &PatchParams::default(), &Patch::Merge(patch))
            .await?;
        Ok(())
    }

    async fn set_enabled(&self, section: &str, enabled: bool) -> Result<()> {
        self.patch_policy(json!({"spec": {section: {"enabled": enabled}}}))
            .await
    }

    /// The toggled sections that are on now (on unless set to false).
    async fn enabled_toggles(&self) -> Result<Vec<String>> {
        let policy = policies(&self.admin).get(&self.policy).await?;
        let spec = serde_json::to_value(&policy.spec)?;
        Ok(TOGGLED
            .iter()
            .filter(|s| spec.pointer(&format!("/{s}/enabled")) != Some(&json!(false)))
            .map(|s| (*s).to_owned())
            .collect())
    }

    async fn policy_change(&mut self) -> Result<String> {
        self.edits += 1;
        let n = self.edits;
        match self.rng.random_range(0..4) {
            0 => {
                let section = TOGGLED[self.rng.random_range(0..TOGGLED.len())];
                let on = self.enabled_toggles().await?.iter().any(|s| s == section);
                self.set_enabled(section, !on).await?;
                Ok(format!("{section}.enabled -> {}", !on))
            }
            1 => {
                self.patch_policy(json!({"spec": {"devicePlugin": {"env": [{"name": "CHAOS_EDIT", "value": n.to_string()}]}}}))
                    .await?;
                Ok(format!("devicePlugin.env CHAOS_EDIT={n}"))
            }
            2 => {
                self.patch_policy(json!({"spec": {"daemonsets": {"annotations": {"chaos.example.com/edit": n.to_string()}}}}))
                    .await?;
                Ok(format!("daemonsets.annotations edit={n}"))
            }
            _ => {
                let policy = policies(&self.admin).get(&self.policy).await?;
                let spec = serde_json::to_value(&policy.spec)?;
                let next = if spec.pointer("/mig/strategy") == Some(&json!("mixed")) {
                    "single"
                } else {
                    "mixed"
                };
                self.patch_policy(json!({"spec": {"mig": {"strategy": next}}}))
                    .await?;
                Ok(format!("mig.strategy -> {next}"))
            }
        }
    }

    /// Waits until the policy is not ready and its status names ConfigMap `name` or its
    /// consumer `operand` (an invalid config reported; a layout that fits no GPU is reported
    /// per node and layout, without the ConfigMap's name).
    async fn await_reported(&self, name: &str, operand: &str) -> Result<String> {
        let api = policies(&self.admin);
        wait::until(
            REPORT_TIMEOUT,
            &format!("status reports {name} invalid"),
            || {
                let api = api.clone();
                async move {
                    let p = api.get(&self.policy).await?;
                    let line = status_line(&p);
                    Ok(
                        if !ready_now(&p) && (line.contains(name) || line.contains(operand)) {
                            Ok(line)
                        } else {
                            Err(line)
                        },
                    )
                }
            },
        )
        .await
    }

    /// Waits (bounded) until the policy is ready for its current generation.
    pub async fn await_ready(&self, timeout: Duration) -> Result<()> {
        let api = policies(&self.admin);
        wait::until(timeout, "policy ready", || {
            let api = api.clone();
            async move {
                let p = api.get(&self.policy).await?;
                Ok(if ready_now(&p) {
                    Ok(())
                } else {
                    Err(status_line(&p))
                })
            }
        })
        .await
    }

    /// A live object of ours, drawn at random from every one sorted by kind and name.
    async fn random_managed_object(
        &mut self,
    ) -> Result<Option<(kube::api::ApiResource, DynamicObject)>> {
        let mut live = checker::live_objects(&self.admin, false).await?;
        live.sort_by_key(|(r, o)| (r.kind.clone(), o.namespace(), o.name_any()));
        let index = (!live.is_empty()).then(|| self.rng.random_range(0..live.len()));
        Ok(index.map(|i| live.swap_remove(i)))
    }

    fn api_for(
        &self,
        resource: &kube::api::ApiResource,
        object: &DynamicObject,
    ) -> Api<DynamicObject> {
        match object.namespace() {
            Some(ns) => Api::namespaced_with(self.admin.clone(), &ns, resource),
            None => Api::all_with(self.admin.clone(), resource),
        }
    }

    /// Removes NFD's GPU labels from 1 to 3 GPU nodes of the fleet for `gone`, then puts them
    /// back.
    async fn flap_nfd_labels(&mut self, gone: Duration) -> Result<String> {
        let mut names = nodes::gpu_node_names(&self.admin).await?;
        names.sort();
        let count = self.rng.random_range(1..=names.len().clamp(1, 3));
        let mut chosen = BTreeSet::new();
        while chosen.len() < count.min(names.len()) {
            chosen.insert(names[self.rng.random_range(0..names.len())].clone());
        }
        let api: Api<Node> = Api::all(self.admin.clone());
        let labels = |value: Option<&str>| {
            let map: serde_json::Map<String, serde_json::Value> = NFD_GPU_LABEL_KEYS
                .iter()
                .map(|k| ((*k).to_owned(), json!(value)))
                .collect();
            json!({"metadata": {"labels": map}})
        };
        // Only the key each node had comes back; fake nodes carry the first.
        for name in &chosen {
            api.patch(name, &PatchParams::default(), &Patch::Merge(labels(None)))
                .await?;
        }
        tokio::time::sleep(gone).await;
        let back = json!({"metadata": {"labels": {NFD_GPU_LABEL_KEYS[0]: "true"}}});
        for name in &chosen {
            api.patch(name, &PatchParams::default(), &Patch::Merge(&back))
                .await?;
        }
        Ok(format!("{chosen:?} without NFD's GPU label for {gone:?}"))
    }

    async fn add_node(&mut self) -> Result<String> {
        let model = *pick(&mut self.rng, &GpuModel::FLEET).context("no GPU model")?;
        let name = crate::cluster::unique_name("chaos-node");
        let tainted = self.rng.random_bool(0.5);
        let node = ephemeral_gpu_node(&name, model).tainted(tainted);
        nodes::create(&self.admin, &[node]).await?;
        self.added_nodes.push(name.clone());
        Ok(format!("{name} ({})", model.slug()))
    }

    async fn crash_loop(&mut self) -> Result<String> {
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), self.replicas.namespace());
        let mut candidates = Vec::new();
        for app in CRASH_LOOP_APPS {
            let list = pods
                .list(&ListParams::default().labels(&format!("app={app}")))
                .await?;
            for pod in list.items {
                if let Some(node) = pod.spec.and_then(|s| s.node_name) {
                    candidates.push((app, node));
                }
            }
        }
        candidates.sort();
        candidates.dedup();
        let Some((app, node)) = pick(&mut self.rng, &candidates).cloned() else {
            return Ok("no operand pod to crash-loop".into());
        };
        let crash = CrashLoop::start(&self.admin, &node, app).await?;
        let seen = self.await_not_ready().await;
        crash.recover().await?;
        seen.map(|s| format!("{app} on {node}: {s}"))
    }

    /// Waits until the policy says it is not ready (an operand crash-loops).
    async fn await_not_ready(&self) -> Result<String> {
        let api = policies(&self.admin);
        wait::until(
            REPORT_TIMEOUT,
            "policy not ready while an operand crash-loops",
            || {
                let api = api.clone();
                async move {
                    let p = api.get(&self.policy).await?;
                    Ok(if ready_now(&p) {
                        Err(status_line(&p))
                    } else {
                        Ok(status_line(&p))
                    })
                }
            },
        )
        .await
    }
}

/// The edit of a field we set: a workload's image, a mutable ConfigMap's data, else our
/// applied-hash annotation (every object carries it).
fn edit_patch(
    kind: &str,
    object: &DynamicObject,
) -> Result<(Patch<serde_json::Value>, &'static str)> {
    let immutable = object.data.get("immutable") == Some(&json!(true));
    Ok(match kind {
        "DaemonSet" | "Deployment" => (
            Patch::Json(serde_json::from_value(json!([{
                "op": "replace",
                "path": "/spec/template/spec/containers/0/image",
                "value": "registry.invalid/chaos:edited"
            }]))?),
            "image",
        ),
        "ConfigMap" if !immutable && object.data.get("data").is_some() => (
            Patch::Merge(json!({"data": {"chaos-edited": "true"}})),
            "data",
        ),
        _ => (
            Patch::Merge(json!({"metadata": {"annotations": {
                gpu_operator::controller::APPLIED_HASH_ANNOTATION: "chaos-edited"
            }}})),
            "applied-hash annotation",
        ),
    })
}
