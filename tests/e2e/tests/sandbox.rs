//! Virtual machine workloads end to end: vGPU device configs on a fleet with vm-vgpu nodes. A
//! broken edit of the configs ConfigMap and a node label naming a config the file lacks are
//! reported in the ClusterPolicy status (the field, the config, the fix) and change nothing the
//! nodes run; fixing the config rolls the vGPU device manager once.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use e2e::audit::AuditLog;
use e2e::cluster::unique_name;
use e2e::nodes::{self, FakeNode, GpuModel};
use e2e::session::*;
use e2e::wait;
use gpu_operator::api::State;
use gpu_operator::operands::vgpu_device_manager::{NAME, mounted_copy};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

const CONFIG_MAP: &str = "vgpu-config";
/// What a config change may roll: the DaemonSets and the config copies they mount.
const WORKLOADS: &[&str] = &["daemonsets", "configmaps"];

/// A vGPU config file with `default` (L40S-12Q) and `extra` configs; `count` vGPUs per GPU.
fn configs(count: i64) -> String {
    format!(
        "version: v1\nvgpu-configs:\n  default:\n  - devices: all\n    vgpu-devices:\n      \
         L40S-12Q: {count}\n  extra:\n  - devices: all\n    vgpu-devices:\n      L40S-48Q: 1\n"
    )
}

fn spec() -> serde_json::Value {
    json!({
        "sandboxWorkloads": {"enabled": true, "defaultWorkload": "container", "mode": "kubevirt"},
        "vgpuManager": {
            "enabled": true,
            "repository": "registry.example.com/nvidia",
            "image": "vgpu-manager",
            "version": "580.65.05",
        },
        "vgpuDeviceManager": {
            "enabled": true,
            "repository": "nvcr.io/nvidia/cloud-native",
            "image": "vgpu-device-manager",
            "version": "v0.5.0",
            "config": {"name": CONFIG_MAP, "default": "default"},
        },
    })
}

/// The copy the live vGPU device manager mounts, and the DaemonSet's generation.
async fn live(s: &Setup) -> (Option<String>, i64) {
    let ds = s.daemonsets().get(NAME).await.unwrap();
    (mounted_copy(&ds), ds.metadata.generation.unwrap_or(0))
}

/// Waits until the vGPU device manager mounts a copy other than `old`, and returns it.
async fn await_copy_other_than(s: &Setup, old: Option<&str>) -> String {
    let (api, old) = (s.daemonsets(), old.map(str::to_owned));
    wait::until(TIMEOUT, "vGPU device manager on a new config copy", || {
        let (api, old) = (api.clone(), old.clone());
        async move {
            let copy = api.get_opt(NAME).await?.as_ref().and_then(mounted_copy);
            Ok(match copy {
                Some(c) if Some(&c) != old.as_ref() => Ok(c),
                other => Err(format!("mounts {other:?}")),
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", s.operator.log_text()))
}

async fn label_node(s: &Setup, node: &str, key: &str, value: Option<&str>) {
    Api::<Node>::all(s.admin.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {key: value}}})),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn an_invalid_vgpu_config_is_reported_and_changes_nothing_until_fixed() {
    let Some(s) = start(spec(), &[]).await else {
        return;
    };
    let ns = s.identity.namespace.clone();
    config_map(&s.admin, &ns, CONFIG_MAP, &[("config.yaml", &configs(4))]).await;
    let l40s = unique_name("l40s-vgpu");
    nodes::create(
        &s.admin,
        &[FakeNode::gpu(&l40s, GpuModel::A30)
            .label(EPHEMERAL, "true")
            .label("nvidia.com/gpu.workload.config", "vm-vgpu")],
    )
    .await
    .unwrap();
    let first = await_copy_other_than(&s, None).await;
    assert!(first.starts_with("vgpu-config-"), "{first}");
    s.await_state(State::Ready, "ready with the vGPU config")
        .await;
    let running = live(&s).await;

    // A broken edit: count 0. Reported with the ConfigMap, key, config and field, and the fix;
    // the DaemonSet and the copy it mounts are not written.
    let audit = AuditLog::from_env().unwrap();
    let before_break = s.quiet_mark(&audit).await;
    config_map(&s.admin, &ns, CONFIG_MAP, &[("config.yaml", &configs(0))]).await;
    let p = s
        .await_invalid_config(&[
            "ConfigMap vgpu-config, key \"config.yaml\"",
            "vgpu-configs.default[0].vgpu-devices.L40S-12Q has count 0",
            "above 0",
            &first,
        ])
        .await;
    eprintln!(
        "broken vGPU config, Ready: {:?}",
        ready_reason_and_message(&p)
    );
    assert!(
        component_message(&p, "vgpu-device-manager").contains("invalid configuration"),
        "{}",
        component_message(&p, "vgpu-device-manager")
    );
    assert_eq!(
        s.writes_once_quiet(&audit, before_break, WORKLOADS).await,
        Vec::<String>::new(),
        "a broken vGPU config wrote a DaemonSet or a ConfigMap"
    );
    assert_eq!(live(&s).await, running);

    // Fixed back to the content that runs: ready, no roll.
    config_map(&s.admin, &ns, CONFIG_MAP, &[("config.yaml", &configs(4))]).await;
    s.await_state(State::Ready, "ready once fixed back").await;
    assert_eq!(live(&s).await, running, "identical content rolled");

    // A node label naming a config the file lacks: the node, the value and the configs there
    // are, and again nothing written.
    let before_label = audit.mark().unwrap();
    label_node(&s, &l40s, "nvidia.com/vgpu.config", Some("L40S-7Q")).await;
    let p = s
        .await_invalid_config(&[
            &l40s,
            "nvidia.com/vgpu.config=L40S-7Q",
            "its configs: default and extra",
        ])
        .await;
    eprintln!(
        "unknown vGPU config label, Ready: {:?}",
        ready_reason_and_message(&p)
    );
    assert_eq!(
        s.writes_once_quiet(&audit, before_label, WORKLOADS).await,
        Vec::<String>::new(),
        "a node label naming an unknown config wrote a DaemonSet or a ConfigMap"
    );
    assert_eq!(live(&s).await, running);
    label_node(&s, &l40s, "nvidia.com/vgpu.config", Some("extra")).await;
    s.await_state(State::Ready, "ready with a known config label")
        .await;

    // Removing a config the node still names is not rolled out either.
    config_map(
        &s.admin,
        &ns,
        CONFIG_MAP,
        &[("config.yaml", &configs(4).replace("  extra:", "  other:"))],
    )
    .await;
    s.await_invalid_config(&["removes configs that nodes still name", "extra (node"])
        .await;
    assert_eq!(live(&s).await, running);

    // A fix with new content rolls the DaemonSet once, to a new copy.
    config_map(&s.admin, &ns, CONFIG_MAP, &[("config.yaml", &configs(2))]).await;
    let second = await_copy_other_than(&s, Some(&first)).await;
    s.await_state(State::Ready, "ready after the fix").await;
    let (copy, generation) = live(&s).await;
    assert_eq!(copy.as_deref(), Some(second.as_str()));
    assert_eq!(generation, running.1 + 1, "rolled once");

    nodes::delete(&s.admin, std::slice::from_ref(&l40s))
        .await
        .unwrap();
    s.teardown().await;
}
