//! Sharing and MIG layouts chosen by GPU model (`spec.layoutsByModel`, docs/sharing.md), on the
//! harness: a fleet of T4, A100-40GB, A100-80GB and H100 nodes. The map is added to a running
//! fleet (so the A100s already carry the operator's `all-disabled` MIG default, which the map
//! replaces); a hand-set label is kept; an entry naming a MIG profile the A100-80GB lacks freezes
//! only the A100-80GB nodes and status names it; a node that joins gets its layout with no human
//! step; removing the map removes exactly what the operator set. The operator runs with its
//! generated ClusterRole.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Instant;

use e2e::cluster::unique_name;
use e2e::nodes::{self, GpuModel};
use e2e::session::{self, Setup, TIMEOUT, component_message, config_map, ephemeral_gpu_node};
use e2e::wait;
use gpu_operator::api::State;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

const SHARING: &str = "nvidia.com/device-plugin.config";
const MIG: &str = "nvidia.com/mig.config";

const OFF: &str = "version: v1\n";
const MPS_2: &str = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n";

/// The scenario's map, the A100-80GB entry given by `a100_80`.
fn layouts(a100_80: Value) -> Value {
    json!({
        "Tesla-T4": {"sharing": "time-sliced-4"},
        "NVIDIA-A100-SXM4-40GB": {"mig": "all-1g.5gb"},
        "NVIDIA-H100*": {"sharing": "mps-2"},
        "NVIDIA-A100-SXM4-80GB": a100_80,
    })
}

async fn gpu_nodes(client: &Client) -> Vec<Node> {
    nodes::marked_gpu_nodes(client).await.unwrap()
}

fn label<'a>(node: &'a Node, key: &str) -> Option<&'a str> {
    node.labels().get(key).map(String::as_str)
}

/// Waits until every GPU node's two layout labels are what `want` says for it (by name, then
/// by product); the message names the first node that differs.
async fn until_labels(
    s: &Setup,
    what: &str,
    want: impl Fn(&Node) -> (Option<&'static str>, Option<&'static str>) + Clone,
) {
    let admin = s.admin.clone();
    wait::until(TIMEOUT, what, || {
        let (admin, want) = (admin.clone(), want.clone());
        async move {
            let nodes = gpu_nodes(&admin).await;
            for node in &nodes {
                let got = (label(node, SHARING), label(node, MIG));
                let wanted = want(node);
                if got != wanted {
                    return Ok(Err(format!(
                        "{} ({}): (sharing, mig) {got:?}, want {wanted:?}",
                        node.name_any(),
                        label(node, "nvidia.com/gpu.product").unwrap_or_default()
                    )));
                }
            }
            Ok(Ok(()))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
}

#[tokio::test]
async fn layouts_follow_the_gpu_model_keep_hand_set_labels_freeze_a_bad_entry_and_leave_with_the_map()
 {
    let Some(prepared) = session::builder().prepare().await else {
        return;
    };
    let a100_80: Vec<String> = (0..2)
        .map(|i| unique_name(&format!("a100-80-{i}")))
        .collect();
    let by_hand = unique_name("t4-by-hand");
    let mut extra: Vec<_> = a100_80
        .iter()
        .map(|n| ephemeral_gpu_node(n, GpuModel::A100Sxm80Gb))
        .collect();
    extra.push(ephemeral_gpu_node(&by_hand, GpuModel::T4).label(SHARING, "off"));
    nodes::create(&prepared.admin, &extra).await.unwrap();
    let s = prepared.start(json!({})).await;
    s.await_state(State::Ready, "policy ready without layouts")
        .await;
    // Before the map: MIG-capable nodes carry the operator's default.
    until_labels(&s, "the all-disabled default on MIG-capable nodes", |n| {
        let mig = (label(n, "nvidia.com/mig.capable") == Some("true")).then_some("all-disabled");
        let sharing = label(n, SHARING).is_some().then_some("off");
        (sharing, mig)
    })
    .await;

    let ns = s.identity.namespace.clone();
    config_map(
        &s.admin,
        &ns,
        "sharing",
        &[
            ("off", OFF),
            ("time-sliced-4", &session::time_slicing(4)),
            ("mps-2", MPS_2),
        ],
    )
    .await;
    // all-1g.5gb is a profile the A100-80GB does not have (its smallest is 1g.10gb).
    s.patch_policy(json!({"spec": {
        "devicePlugin": {"config": {"name": "sharing", "default": "off"}},
        "layoutsByModel": layouts(json!({"mig": "all-1g.5gb"})),
    }}))
    .await;
    let expected = {
        let by_hand = by_hand.clone();
        move |n: &Node| {
            if n.name_any() == by_hand {
                return (Some("off"), None);
            }
            match label(n, "nvidia.com/gpu.product").unwrap_or_default() {
                p if p == GpuModel::T4.product() => (Some("time-sliced-4"), None),
                p if p == GpuModel::A100Sxm40Gb.product() => (None, Some("all-1g.5gb")),
                // Frozen: it keeps the default it carries.
                p if p == GpuModel::A100Sxm80Gb.product() => (None, Some("all-disabled")),
                p if p.starts_with("NVIDIA-H100") => (Some("mps-2"), Some("all-disabled")),
                _ => (None, None),
            }
        }
    };
    until_labels(&s, "every model's layout", expected.clone()).await;

    // Status names the entry and exactly the frozen nodes.
    let p = wait::until(TIMEOUT, "the bad entry reported", || {
        let policies = session::policies(&s.admin);
        let name = s.policy.clone();
        async move {
            let p = policies.get(&name).await?;
            let message = component_message(&p, "mig-manager");
            Ok(
                if message.contains(r#"spec.layoutsByModel["NVIDIA-A100-SXM4-80GB"].mig"#) {
                    Ok(p)
                } else {
                    Err(message)
                },
            )
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    let message = component_message(&p, "mig-manager");
    eprintln!("mig-manager component with the bad entry: {message}");
    for node in &a100_80 {
        assert!(message.contains(node.as_str()), "{message}");
    }
    let others: Vec<String> = gpu_nodes(&s.admin)
        .await
        .iter()
        .filter(|n| label(n, "nvidia.com/gpu.product") != Some(GpuModel::A100Sxm80Gb.product()))
        .map(ResourceExt::name_any)
        .collect();
    for node in &others {
        assert!(
            !message.contains(node.as_str()),
            "{node} is not frozen: {message}"
        );
    }

    // A node that joins gets its layout from GFD's product label alone.
    let late = unique_name("late-h100");
    let joined = Instant::now();
    nodes::create(
        &s.admin,
        &[ephemeral_gpu_node(&late, GpuModel::H100Sxm80Gb)],
    )
    .await
    .unwrap();
    let nodes_api = Api::<Node>::all(s.admin.clone());
    // When the operator's GPU mark arrived, for comparison: the layout comes in the same pass.
    let marked = std::sync::Mutex::new(None);
    wait::until(TIMEOUT, "the late node's layout", || {
        let (api, late, marked) = (nodes_api.clone(), late.clone(), &marked);
        async move {
            let node = api.get(&late).await?;
            if label(&node, "nvidia.com/gpu.present").is_some() {
                marked.lock().unwrap().get_or_insert(joined.elapsed());
            }
            Ok(match label(&node, SHARING) {
                Some("mps-2") => Ok(()),
                other => Err(format!("{other:?}")),
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", s.operator.log_text()));
    eprintln!(
        "a joining H100 carried {SHARING}=mps-2 {:.2} s after it was created with GFD's labels (nvidia.com/gpu.present: {:.2?})",
        joined.elapsed().as_secs_f64(),
        marked.lock().unwrap()
    );
    for line in s
        .operator
        .log_text()
        .lines()
        .filter(|l| l.contains(late.as_str()))
    {
        eprintln!("  operator: {line}");
    }

    // The fix: the A100-80GB gets a layout it has, in place of the default.
    s.patch_policy(json!({"spec": {"layoutsByModel": layouts(json!({"mig": "all-1g.10gb"}))}}))
        .await;
    until_labels(&s, "the fixed entry rolled out", {
        let expected = expected.clone();
        move |n: &Node| match expected(n) {
            (sharing, Some("all-disabled"))
                if label(n, "nvidia.com/gpu.product") == Some(GpuModel::A100Sxm80Gb.product()) =>
            {
                (sharing, Some("all-1g.10gb"))
            }
            other => other,
        }
    })
    .await;
    s.await_state(State::Ready, "ready once the entry fits")
        .await;

    // Removing the map removes what the operator set, and only that; MIG-capable nodes fall
    // back to the default.
    s.patch_policy(json!({"spec": {"layoutsByModel": null}}))
        .await;
    let by_hand_name = by_hand.clone();
    until_labels(&s, "the map's labels removed", move |n| {
        let sharing = (n.name_any() == by_hand_name).then_some("off");
        let mig = (label(n, "nvidia.com/mig.capable") == Some("true")).then_some("all-disabled");
        (sharing, mig)
    })
    .await;
    let records: BTreeMap<String, String> = gpu_nodes(&s.admin)
        .await
        .iter()
        .filter_map(|n| {
            Some((
                n.name_any(),
                n.annotations()
                    .get("nvidia.com/gpu-operator.node-pool")?
                    .clone(),
            ))
        })
        .collect();
    assert!(records.is_empty(), "records left: {records:?}");

    let admin = s.admin.clone();
    s.teardown().await;
    let mut ours = a100_80;
    ours.extend([by_hand, late]);
    nodes::delete(&admin, &ours).await.unwrap();
}
