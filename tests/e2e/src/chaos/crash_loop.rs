//! Failure injection through kwok Stages: make the pods of one DaemonSet on one node
//! crash-loop (Running, not Ready, container waiting in CrashLoopBackOff), as a kubelet
//! reports a container that keeps exiting.

use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::json;

use crate::wait;

/// A Stage that keeps the pods labelled `app=<app>` on `node` in CrashLoopBackOff; pods created
/// later (after a rollout or a deletion) crash-loop as well until [`CrashLoop::recover`].
pub struct CrashLoop {
    client: Client,
    stage: String,
    node: String,
    app: String,
}

fn stages(client: &Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("kwok.x-k8s.io", "v1alpha1", "Stage");
    Api::all_with(client.clone(), &ApiResource::from_gvk(&gvk))
}

/// The Stage object: it matches live pods of the DaemonSet on the node that are not already
/// crash-looping, and outweighs kwok's `pod-ready` stage for new ones.
fn stage_manifest(name: &str, node: &str, app: &str) -> serde_json::Value {
    json!({
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {"matchExpressions": [
                {"key": ".spec.nodeName", "operator": "In", "values": [node]},
                {"key": ".metadata.labels.app", "operator": "In", "values": [app]},
                {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                {"key": ".status.phase", "operator": "In", "values": ["Pending", "Running"]},
                {"key": ".status.containerStatuses.[].state.waiting.reason", "operator": "NotIn", "values": ["CrashLoopBackOff"]}
            ]},
            "weight": 100000,
            "next": {"statusTemplate": r#"
{{ $now := Now }}
conditions:
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: Initialized
- lastTransitionTime: {{ $now | Quote }}
  status: "False"
  reason: ContainersNotReady
  type: Ready
- lastTransitionTime: {{ $now | Quote }}
  status: "False"
  reason: ContainersNotReady
  type: ContainersReady
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: PodScheduled
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: false
  started: false
  restartCount: 5
  lastState:
    terminated:
      exitCode: 1
      reason: Error
      startedAt: {{ $now | Quote }}
      finishedAt: {{ $now | Quote }}
  state:
    waiting:
      reason: CrashLoopBackOff
      message: "back-off 2m40s restarting failed container"
{{ end }}
phase: Running
startTime: {{ $now | Quote }}
"#}
        }
    })
}

impl CrashLoop {
    /// Starts crash-looping the pods labelled `app=<app>` on `node`, and returns once they are.
    ///
    /// kwok evaluates Stages when a pod changes, so the pods already running are touched (an
    /// annotation patch) until the new Stage has been seen and they report CrashLoopBackOff.
    pub async fn start(client: &Client, node: &str, app: &str) -> Result<Self> {
        let stage = format!("crashloop-{app}-{node}");
        let object: DynamicObject = serde_json::from_value(stage_manifest(&stage, node, app))?;
        stages(client)
            .create(&PostParams::default(), &object)
            .await
            .with_context(|| format!("creating kwok Stage {stage}"))?;
        let this = CrashLoop {
            client: client.clone(),
            stage,
            node: node.to_string(),
            app: app.to_string(),
        };
        let mut touch = 0u32;
        wait::until(Duration::from_secs(30), "pods crash-looping", || {
            touch += 1;
            let this = &this;
            async move {
                let pods = this.pods().await?;
                if !pods.is_empty() && pods.iter().all(is_crash_looping) {
                    return Ok(Ok(()));
                }
                for pod in pods.iter().filter(|p| !is_crash_looping(p)) {
                    let patch = json!({"metadata": {"annotations": {"gpu-operator.test/touch": touch.to_string()}}});
                    this.api_for(pod).patch(&name_of(pod), &PatchParams::default(), &Patch::Merge(patch)).await?;
                }
                Ok(Err(format!("{} pods, not all crash-looping", pods.len())))
            }
        })
        .await?;
        Ok(this)
    }

    /// Stops the crash loop: removes the Stage and deletes the affected pods (again, until kwok
    /// has seen the Stage go), so their DaemonSet recreates them and kwok makes them Ready.
    pub async fn recover(self) -> Result<()> {
        stages(&self.client)
            .delete(&self.stage, &DeleteParams::default())
            .await
            .with_context(|| format!("deleting kwok Stage {}", self.stage))?;
        wait::until(
            Duration::from_secs(30),
            "crash-looping pods replaced",
            || async {
                let looping: Vec<Pod> = self
                    .pods()
                    .await?
                    .into_iter()
                    .filter(is_crash_looping)
                    .collect();
                if looping.is_empty() {
                    return Ok(Ok(()));
                }
                for pod in &looping {
                    if pod.metadata.deletion_timestamp.is_none() {
                        self.api_for(pod)
                            .delete(&name_of(pod), &DeleteParams::default())
                            .await?;
                    }
                }
                Ok(Err(format!("{} pods still crash-looping", looping.len())))
            },
        )
        .await
    }

    async fn pods(&self) -> Result<Vec<Pod>> {
        let selector = ListParams::default()
            .labels(&format!("app={}", self.app))
            .fields(&format!("spec.nodeName={}", self.node));
        Ok(Api::<Pod>::all(self.client.clone())
            .list(&selector)
            .await?
            .items)
    }

    fn api_for(&self, pod: &Pod) -> Api<Pod> {
        Api::namespaced(
            self.client.clone(),
            pod.metadata.namespace.as_deref().unwrap_or_default(),
        )
    }
}

/// Deletes every crash-loop Stage (left behind by a test that failed before recovering).
pub async fn remove_all(client: &Client) -> Result<()> {
    let api = stages(client);
    for stage in api.list(&ListParams::default()).await?.items {
        let name = stage.metadata.name.unwrap_or_default();
        if name.starts_with("crashloop-") {
            api.delete(&name, &DeleteParams::default()).await?;
        }
    }
    Ok(())
}

fn name_of(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

/// Whether a pod's first container reports CrashLoopBackOff.
pub fn is_crash_looping(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.first())
        .and_then(|c| c.state.as_ref()?.waiting.as_ref()?.reason.as_deref())
        == Some("CrashLoopBackOff")
}
