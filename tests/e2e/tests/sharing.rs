//! GPU sharing configs end to end: time-slicing as a user sets it up on a running cluster
//! (a ConfigMap, then a patch of the live policy; edits, a broken edit that never reaches the
//! nodes, the fix), a node label naming a missing key, and a published mig-parted config's
//! layouts checked against each fake GPU model.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use e2e::audit::AuditLog;
use e2e::cluster::unique_name;
use e2e::nodes::{self, FakeNode, GpuModel};
use e2e::session::*;
use e2e::wait;
use gpu_operator::api::State;
use gpu_operator::operands::device_plugin::{CONFIG_COPY_LABEL, mounted_copy};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use serde_json::json;

const PLUGIN: &str = "nvidia-device-plugin-daemonset";
const GFD: &str = "gpu-feature-discovery";

/// The copy each sharing consumer's template mounts, and its generation.
async fn consumers(s: &Setup) -> BTreeMap<String, (Option<String>, i64)> {
    let api = s.daemonsets();
    let mut out = BTreeMap::new();
    for name in [PLUGIN, GFD] {
        let ds = api.get(name).await.unwrap();
        out.insert(
            name.to_string(),
            (
                mounted_copy(&ds).map(|(copy, _)| copy),
                ds.metadata.generation.unwrap_or(0),
            ),
        );
    }
    out
}

/// Waits until both consumers mount a copy other than `old` (the same one) and returns it.
async fn await_new_copy(s: &Setup, old: Option<&str>) -> String {
    let api = s.daemonsets();
    let old = old.map(str::to_string);
    wait::until(
        TIMEOUT,
        "device plugin and GFD on a new config copy",
        || {
            let (api, old) = (api.clone(), old.clone());
            async move {
                let plugin = mounted_copy(&api.get(PLUGIN).await?).map(|(c, _)| c);
                let gfd = mounted_copy(&api.get(GFD).await?).map(|(c, _)| c);
                Ok(match (&plugin, &gfd) {
                    (Some(p), Some(g)) if p == g && Some(p) != old.as_ref() => Ok(p.clone()),
                    _ => Err(format!("plugin {plugin:?}, gfd {gfd:?}")),
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", s.operator.log_text()))
}

/// The sharing-config copies (script copies carry the same label with another value).
async fn copies(s: &Setup) -> Vec<String> {
    let mut names: Vec<String> =
        Api::<ConfigMap>::namespaced(s.admin.clone(), &s.identity.namespace)
            .list_metadata(&ListParams::default().labels(&format!("{CONFIG_COPY_LABEL}=sharing")))
            .await
            .unwrap()
            .items
            .into_iter()
            .map(|c| c.name_any())
            .collect();
    names.sort();
    names
}

#[tokio::test]
async fn time_slicing_by_patching_the_live_policy() {
    let Some(s) = start(json!({}), &[]).await else {
        return;
    };
    s.await_state(State::Ready, "policy ready").await;
    let ns = s.identity.namespace.clone();

    // kubectl create configmap time-slicing-config --from-file=any=any.yaml; kubectl patch.
    config_map(
        &s.admin,
        &ns,
        "time-slicing-config",
        &[("any", &time_slicing(4))],
    )
    .await;
    s.patch_policy(json!({"spec": {"devicePlugin": {"config": {"name": "time-slicing-config"}}}}))
        .await;
    let first = await_new_copy(&s, None).await;
    assert!(first.starts_with("time-slicing-config-"), "{first}");
    let p = s
        .await_state(State::Ready, "ready with the sharing config")
        .await;
    let message = component_message(&p, "device-plugin");
    assert!(
        message.contains(&format!("config {first} (default key \"any\")")),
        "status names the config in effect: {message}"
    );
    let (_, ready) = ready_reason_and_message(&p);
    eprintln!("with time-slicing-config: device-plugin component: {message}; Ready: {ready}");
    assert!(ready.contains("default inferred"), "{ready}");

    // Replicas 4 -> 8: both consumers roll to a new copy, no manual restart.
    let before = consumers(&s).await;
    config_map(
        &s.admin,
        &ns,
        "time-slicing-config",
        &[("any", &time_slicing(8))],
    )
    .await;
    let second = await_new_copy(&s, Some(&first)).await;
    let after = consumers(&s).await;
    for name in [PLUGIN, GFD] {
        assert!(after[name].1 > before[name].1, "{name} rolled: {after:?}");
    }
    s.await_state(State::Ready, "ready after 4 -> 8").await;

    // Break the YAML: reported, nothing rolls.
    let audit = AuditLog::from_env().unwrap();
    let before_break = s.quiet_mark(&audit).await;
    let rolled_to_8 = consumers(&s).await;
    config_map(
        &s.admin,
        &ns,
        "time-slicing-config",
        &[("any", "version: v1\nsharing:\n  timeSlicing: [\n")],
    )
    .await;
    let p = s
        .await_invalid_config(&["time-slicing-config", "any", &second])
        .await;
    eprintln!(
        "broken YAML, Ready condition: {:?}",
        ready_reason_and_message(&p)
    );
    assert!(
        component_message(&p, "device-plugin").contains("invalid configuration"),
        "{}",
        component_message(&p, "device-plugin")
    );

    // A node added meanwhile still gets the last good config.
    let late = unique_name("late-a100");
    nodes::create(
        &s.admin,
        &[FakeNode::gpu(&late, GpuModel::A100Sxm40Gb).label(EPHEMERAL, "true")],
    )
    .await
    .unwrap();
    let pods = Api::<Pod>::namespaced(s.admin.clone(), &ns);
    let on_late = ListParams::default()
        .labels(&format!("app={PLUGIN}"))
        .fields(&format!("spec.nodeName={late}"));
    let pod = wait::until(TIMEOUT, "device plugin pod on the new node", || {
        let (pods, on_late) = (pods.clone(), on_late.clone());
        async move {
            let list = pods.list(&on_late).await?.items;
            Ok(list
                .into_iter()
                .next()
                .ok_or_else(|| "no pod yet".to_string()))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", s.operator.log_text()));
    let mounted: Vec<String> = pod
        .spec
        .unwrap()
        .volumes
        .unwrap_or_default()
        .into_iter()
        .filter_map(|v| v.config_map.map(|c| c.name))
        .collect();
    assert!(
        mounted.contains(&second),
        "new node mounts {mounted:?}, not the last good {second}"
    );
    assert_eq!(
        s.writes_once_quiet(&audit, before_break, &["daemonsets"])
            .await,
        Vec::<String>::new(),
        "a broken config wrote a DaemonSet"
    );
    assert_eq!(consumers(&s).await, rolled_to_8);

    // Fixing it back to the very content that runs: reported as fixed, no roll.
    config_map(
        &s.admin,
        &ns,
        "time-slicing-config",
        &[("any", &time_slicing(8))],
    )
    .await;
    s.await_state(State::Ready, "ready once fixed back").await;
    assert_eq!(consumers(&s).await, rolled_to_8, "identical content rolled");

    // Break it again, then fix it with new content: they roll exactly once.
    let before_second_break = audit.mark().unwrap();
    config_map(
        &s.admin,
        &ns,
        "time-slicing-config",
        &[("any", &time_slicing(0))],
    )
    .await;
    s.await_invalid_config(&["replicas"]).await;
    config_map(
        &s.admin,
        &ns,
        "time-slicing-config",
        &[("any", &time_slicing(6))],
    )
    .await;
    let third = await_new_copy(&s, Some(&second)).await;
    s.await_state(State::Ready, "ready after the fix").await;
    let writes = s
        .writes_once_quiet(&audit, before_second_break, &["daemonsets"])
        .await;
    for name in [PLUGIN, GFD] {
        let to_it: Vec<&String> = writes
            .iter()
            .filter(|w| w.ends_with(&format!(" {name}")))
            .collect();
        assert_eq!(to_it.len(), 1, "one write of {name}: {writes:#?}");
    }
    let fixed = consumers(&s).await;
    for name in [PLUGIN, GFD] {
        assert_eq!(
            fixed[name].1,
            rolled_to_8[name].1 + 1,
            "{name} rolled once: {fixed:?}"
        );
        assert_eq!(fixed[name].0.as_deref(), Some(third.as_str()));
    }
    // Copies of finished rollouts are pruned; the one in use stays.
    let (setup, third) = (&s, &third);
    wait::until(TIMEOUT, "old copies pruned", || async move {
        let left = copies(setup).await;
        Ok(if left == [third.clone()] {
            Ok(())
        } else {
            Err(format!("{left:?}"))
        })
    })
    .await
    .unwrap();

    nodes::delete(&s.admin, &[late]).await.unwrap();
    s.teardown().await;
}

#[tokio::test]
async fn a_node_labelled_with_a_missing_config_key_is_named_in_status() {
    let Some(s) = start(
        json!({"devicePlugin": {"config": {"name": "sharing", "default": "default"}}}),
        &[],
    )
    .await
    else {
        return;
    };
    let ns = s.identity.namespace.clone();
    config_map(
        &s.admin,
        &ns,
        "sharing",
        &[("default", &time_slicing(2)), ("big", &time_slicing(8))],
    )
    .await;
    s.await_state(State::Ready, "ready with two keys").await;
    let copy = consumers(&s).await[PLUGIN].0.clone().unwrap();

    let node = unique_name("typo-t4");
    nodes::create(
        &s.admin,
        &[FakeNode::gpu(&node, GpuModel::T4)
            .label(EPHEMERAL, "true")
            .label("nvidia.com/device-plugin.config", "huge")],
    )
    .await
    .unwrap();
    let p = s
        .await_invalid_config(&[&node, "\"huge\"", "nvidia.com/device-plugin.config"])
        .await;
    let (_, message) = ready_reason_and_message(&p);
    assert!(
        message.contains(&copy),
        "keeps the last good copy: {message}"
    );

    nodes::delete(&s.admin, std::slice::from_ref(&node))
        .await
        .unwrap();
    s.await_state(State::Ready, "ready once the node is gone")
        .await;
    s.teardown().await;
}

/// A user's mig-parted config as published (`inference-7`: seven 1g.5gb slices, which fit an
/// A100 40GB; `training-4`: four 2g.10gb), shared with the operator's MIG unit tests.
const PUBLISHED_MIG_CONFIG: &str =
    include_str!("../../../operator/tests/fixtures/scenario-4-mig-config.yaml");

#[tokio::test]
async fn published_mig_layouts_are_checked_against_each_gpu_model() {
    let Some(s) = start(
        json!({"migManager": {"config": {"name": "mig-config"}}, "mig": {"strategy": "single"}}),
        &[],
    )
    .await
    else {
        return;
    };
    config_map(
        &s.admin,
        &s.identity.namespace,
        "mig-config",
        &[("config.yaml", PUBLISHED_MIG_CONFIG)],
    )
    .await;
    let layout = "nvidia.com/mig.config";
    let node = |model, layout_name: &str| {
        let name = unique_name(&format!("mig-{}", layout_name));
        (
            name.clone(),
            FakeNode::gpu(name, model)
                .label(EPHEMERAL, "true")
                .label(layout, layout_name),
        )
    };
    let (fits, fits_node) = node(GpuModel::A100Sxm40Gb, "inference-7");
    let (a100_80, a100_80_node) = node(GpuModel::A100Sxm80Gb, "inference-7");
    let (h100, h100_node) = node(GpuModel::H100Sxm80Gb, "inference-7");
    let (training, training_node) = node(GpuModel::A100Sxm40Gb, "training-4");
    let (t4, t4_node) = node(GpuModel::T4, "inference-7");
    let (unknown, unknown_node) = node(GpuModel::A100Sxm40Gb, "inference-8");
    let (failed, failed_node) = node(GpuModel::A100Sxm40Gb, "inference-7");
    let failed_node = failed_node.label("nvidia.com/mig.config.state", "failed");
    let all = [
        fits_node,
        a100_80_node,
        h100_node,
        training_node,
        t4_node,
        unknown_node,
        failed_node,
    ];
    nodes::create(&s.admin, &all).await.unwrap();

    let p = s
        .await_invalid_config(&[&a100_80, &h100, &training, &t4, &unknown, &failed])
        .await;
    let message = component_message(&p, "mig-manager");
    eprintln!("mig-manager component: {message}");
    assert!(
        !message.contains(fits.as_str()),
        "inference-7 fits an A100-40GB: {message}"
    );
    for (node, why) in [
        (&a100_80, "1g.5gb does not exist on A100-80GB"),
        (&h100, "1g.5gb does not exist on H100"),
        (&training, "more than the 3 that fit"),
        (&unknown, "is not in the MIG config"),
        (&failed, "nvidia.com/mig.config.state=failed"),
    ] {
        // Groups read `node a: why` or `nodes a, b and c: why`, joined by "; ".
        let at = message
            .find(node.as_str())
            .unwrap_or_else(|| panic!("{node} not reported: {message}"));
        let group = &message[at..];
        let group = &group[..group.find("; node").unwrap_or(group.len())];
        assert!(group.contains(why), "{node}: {group}");
    }

    // A MIG-capable node without a layout gets all-disabled (decision 7), never overwritten.
    let node_api = Api::<k8s_openapi::api::core::v1::Node>::all(s.admin.clone());
    let bare = unique_name("mig-unlabelled");
    let bare_node = FakeNode::gpu(&bare, GpuModel::H100Sxm80Gb).label(EPHEMERAL, "true");
    nodes::create(&s.admin, &[bare_node]).await.unwrap();
    wait::until(TIMEOUT, "mig.config defaulted", || {
        let (node_api, bare) = (node_api.clone(), bare.clone());
        async move {
            let labels = node_api
                .get(&bare)
                .await?
                .metadata
                .labels
                .unwrap_or_default();
            Ok(match labels.get(layout).map(String::as_str) {
                Some("all-disabled") => Ok(()),
                other => Err(format!("{other:?}")),
            })
        }
    })
    .await
    .unwrap();
    let chosen = node_api.get(&h100).await.unwrap().labels()[layout].clone();
    assert_eq!(
        chosen, "inference-7",
        "a chosen layout is never overwritten"
    );

    let mut names: Vec<String> = vec![fits, a100_80, h100, training, t4, unknown, failed, bare];
    names.sort();
    nodes::delete(&s.admin, &names).await.unwrap();
    s.teardown().await;
}

#[tokio::test]
async fn an_mps_config_runs_the_mps_control_daemon_on_the_nodes_gfd_marks() {
    let Some(s) = start(
        json!({"devicePlugin": {"config": {"name": "mps-config", "default": "mps"}}}),
        &[],
    )
    .await
    else {
        return;
    };
    let ns = s.identity.namespace.clone();
    let mps = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n";
    config_map(&s.admin, &ns, "mps-config", &[("mps", mps)]).await;
    s.await_state(State::Ready, "ready with an MPS config")
        .await;

    // GFD labels nodes whose selected config uses MPS; here the test plays GFD.
    let node = unique_name("mps-h100");
    nodes::create(
        &s.admin,
        &[FakeNode::gpu(&node, GpuModel::H100Sxm80Gb)
            .label(EPHEMERAL, "true")
            .label("nvidia.com/mps.capable", "true")],
    )
    .await
    .unwrap();
    let pods = Api::<Pod>::namespaced(s.admin.clone(), &ns);
    let daemon = ListParams::default().labels("app=nvidia-device-plugin-mps-control-daemon");
    let pod = wait::until(TIMEOUT, "MPS control daemon pod", || {
        let (pods, daemon) = (pods.clone(), daemon.clone());
        async move {
            let list = pods.list(&daemon).await?.items;
            let on: Vec<String> = list
                .iter()
                .filter_map(|p| p.spec.as_ref()?.node_name.clone())
                .collect();
            Ok(match list.into_iter().next() {
                Some(p) if on.len() == 1 => Ok(p),
                _ => Err(format!("pods on {on:?}")),
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", s.operator.log_text()));
    let spec = pod.spec.unwrap();
    assert_eq!(
        spec.node_name.as_deref(),
        Some(node.as_str()),
        "only where GFD marks MPS"
    );
    let volumes = spec.volumes.unwrap_or_default();
    let host_paths: Vec<String> = volumes
        .iter()
        .filter_map(|v| Some(v.host_path.as_ref()?.path.clone()))
        .collect();
    assert!(
        host_paths.iter().any(|p| p == "/run/nvidia/mps"),
        "{host_paths:?}"
    );
    let copy = consumers(&s).await[PLUGIN].0.clone().unwrap();
    assert!(
        volumes
            .iter()
            .any(|v| v.config_map.as_ref().is_some_and(|c| c.name == copy)),
        "the daemon mounts the same copy {copy}"
    );
    nodes::delete(&s.admin, std::slice::from_ref(&node))
        .await
        .unwrap();
    s.teardown().await;
}

#[tokio::test]
async fn a_mig_config_section_without_a_name_uses_the_operators_own_layouts() {
    // As in NVIDIA's v26.7 CRD, migManager.config.name has no server-side default; without it
    // mig-manager mounts the layouts ConfigMap the operator renders itself (NVIDIA's chart sets
    // exactly this section).
    let Some(s) = start(
        json!({"migManager": {"config": {"default": "all-disabled"}}}),
        &[],
    )
    .await
    else {
        return;
    };
    let p = s
        .await_state(State::Ready, "ready with the default MIG config")
        .await;
    let name = p
        .spec
        .mig_manager
        .and_then(|m| m.config)
        .and_then(|c| c.name);
    assert_eq!(name, None, "no server-side default for the name");
    let ds = s.daemonsets().get("nvidia-mig-manager").await.unwrap();
    let mounted: Vec<String> = ds
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|p| p.volumes)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|v| v.config_map.map(|c| c.name))
        .collect();
    assert!(
        mounted.iter().any(|n| n == "default-mig-parted-config"),
        "{mounted:?}"
    );
    s.teardown().await;
}

/// The message `gpu-operator render` prints for `operand` (`# <operand> not rendered (invalid
/// input): <message>`), from the binary the operator runs as.
fn render_message(policy: &serde_json::Value, namespace: &str, operand: &str) -> String {
    let dir = std::env::temp_dir().join(unique_name("render-same-message"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("policy.yaml");
    let document = json!({
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": {"name": "p"},
        "spec": policy,
    });
    std::fs::write(&file, serde_yaml_ng::to_string(&document).unwrap()).unwrap();
    let output = std::process::Command::new(e2e::operator::binary().unwrap())
        .args([
            "render",
            "--os-tag",
            "ubuntu22.04",
            "--namespace",
            namespace,
            "-f",
        ])
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(output.status.success(), "{output:?}");
    let text = String::from_utf8(output.stdout).unwrap();
    let prefix = format!("# {operand} not rendered (invalid input): ");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| panic!("no line {prefix:?} in:\n{text}"))
        .to_owned()
}

#[tokio::test]
async fn a_missing_mig_or_dcgm_config_map_reads_the_same_in_status_and_in_gpu_operator_render() {
    // The controller and `gpu-operator render` share one validate step, so they cannot
    // disagree about a missing ConfigMap.
    let spec = json!({
        "migManager": {"config": {"name": "missing-layouts"}},
        "dcgmExporter": {"config": {"name": "missing-metrics"}},
    });
    let Some(s) = start(spec.clone(), &[]).await else {
        return;
    };
    s.await_invalid_config(&["missing-layouts", "missing-metrics"])
        .await;
    let p = policies(&s.admin).get(&s.policy).await.unwrap();
    const KEPT: &str = "invalid configuration, live objects kept as they were: ";
    for (operand, config_map) in [
        ("mig-manager", "missing-layouts"),
        ("dcgm-exporter", "missing-metrics"),
    ] {
        let in_status = component_message(&p, operand);
        let in_status = in_status
            .strip_prefix(KEPT)
            .unwrap_or_else(|| panic!("{operand}: {in_status}"));
        let rendered = render_message(&spec, &s.identity.namespace, operand);
        assert_eq!(in_status, rendered, "{operand}");
        assert!(rendered.contains(config_map), "{rendered}");
    }
    s.teardown().await;
}
