use std::sync::Arc;

use super::*;
use crate::facts::ConfigMapData;
use crate::nodes::{GPU_PRESENT, MIG_CAPABLE};

const T4: &str = "Tesla-T4";
const A100_40: &str = "NVIDIA-A100-SXM4-40GB";
const A100_80: &str = "NVIDIA-A100-SXM4-80GB";
const H100: &str = "NVIDIA-H100-80GB-HBM3";

fn node(name: &str, product: &str, extra: &[(&str, &str)]) -> Arc<NodeView> {
    let mut labels: BTreeMap<String, String> = [
        (GPU_PRESENT, "true"),
        (GPU_PRODUCT, product),
        (GPU_COUNT, "8"),
        (
            MIG_CAPABLE,
            if product.contains("A100") || product.contains("H100") {
                "true"
            } else {
                "false"
            },
        ),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect();
    labels.extend(
        extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    Arc::new(NodeView::from_labels(name, Some("1".into()), &labels))
}

/// The scenario's map: T4 time-sliced 4-way, A100-40GB MIG all-1g.5gb, H100 MPS.
fn spec(extra: &[(&str, ModelLayout)]) -> ClusterPolicySpec {
    let mut models: LayoutsByModel = [
        (
            "Tesla-T4".to_owned(),
            ModelLayout {
                sharing: Some("time-sliced-4".into()),
                mig: None,
            },
        ),
        (
            "NVIDIA-A100-SXM4-40GB".to_owned(),
            ModelLayout {
                sharing: None,
                mig: Some("all-1g.5gb".into()),
            },
        ),
        (
            "NVIDIA-H100*".to_owned(),
            ModelLayout {
                sharing: Some("mps-2".into()),
                mig: None,
            },
        ),
    ]
    .into();
    models.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    serde_json::from_value(serde_json::json!({
        "devicePlugin": {"config": {"name": "sharing", "default": "off"}},
        "layoutsByModel": models,
    }))
    .unwrap()
}

fn mounted() -> SharingConfig {
    SharingConfig {
        source: "sharing".into(),
        data: ["off", "time-sliced-4", "mps-2"]
            .iter()
            .map(|k| ((*k).to_owned(), String::new()))
            .collect(),
        default_key: "off".into(),
        default_inferred: false,
    }
}

fn facts(nodes: Vec<Arc<NodeView>>) -> ClusterFacts {
    ClusterFacts {
        gpu_nodes: nodes,
        ..ClusterFacts::default()
    }
}

fn labels_of(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[test]
fn products_match_without_case_mig_suffix_or_spaces_and_exact_keys_beat_patterns() {
    let models: LayoutsByModel = [
        "*",
        "nvidia-h100*",
        "NVIDIA-H100-80GB-HBM3",
        "NVIDIA-A100-*-40GB",
    ]
    .iter()
    .map(|k| ((*k).to_owned(), ModelLayout::default()))
    .collect();
    let key = |product: &str| entry_for(&models, product).map(|(k, _)| k.to_owned());
    assert_eq!(key(H100).as_deref(), Some("NVIDIA-H100-80GB-HBM3"));
    assert_eq!(key("NVIDIA-H100-PCIe").as_deref(), Some("nvidia-h100*"));
    assert_eq!(key("NVIDIA H100 NVL").as_deref(), Some("nvidia-h100*"));
    assert_eq!(
        key("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb").as_deref(),
        Some("NVIDIA-A100-*-40GB")
    );
    assert_eq!(key(A100_80).as_deref(), Some("*"));
    assert_eq!(key(T4).as_deref(), Some("*"));
    let no_catch_all: LayoutsByModel = [("Tesla-T4".to_owned(), ModelLayout::default())].into();
    assert!(entry_for(&no_catch_all, A100_40).is_none());
    assert!(entry_for(&no_catch_all, "tesla-t4").is_some());
}

#[test]
fn glob_stars_match_any_run_including_none() {
    assert!(glob("a*c", "abbbc"));
    assert!(glob("a*c", "ac"));
    assert!(glob("*", ""));
    assert!(glob("a**b*", "axxbyy"));
    assert!(!glob("a*c", "abd"));
    assert!(!glob("abc", "abcd"));
}

#[test]
fn every_model_gets_its_labels() {
    let nodes = vec![
        node("t4", T4, &[]),
        node("a100-40", A100_40, &[]),
        node("h100", H100, &[]),
        node("a100-80", A100_80, &[]),
    ];
    let plan = plan(&spec(&[]), &facts(nodes), Some(&mounted()));
    assert_eq!(
        plan.labels_for("t4"),
        Some(&labels_of(&[(DEVICE_PLUGIN_CONFIG, "time-sliced-4")]))
    );
    assert_eq!(
        plan.labels_for("a100-40"),
        Some(&labels_of(&[(MIG_CONFIG, "all-1g.5gb")]))
    );
    assert_eq!(
        plan.labels_for("h100"),
        Some(&labels_of(&[(DEVICE_PLUGIN_CONFIG, "mps-2")]))
    );
    assert_eq!(plan.labels_for("a100-80"), None, "no entry covers it");
    assert_eq!(plan.sharing_problem, None);
    assert_eq!(plan.mig_problem, None);
}

#[test]
fn a_mig_profile_the_model_lacks_freezes_only_that_models_nodes_and_names_the_entry() {
    // 1g.5gb exists on the A100-40GB only; the 80GB board's smallest slice is 1g.10gb.
    let bad = ModelLayout {
        sharing: None,
        mig: Some("all-1g.5gb".into()),
    };
    let spec = spec(&[("NVIDIA-A100-SXM4-80GB", bad)]);
    let nodes = vec![
        node("a100-40", A100_40, &[]),
        node("a100-80-fresh", A100_80, &[]),
        node("a100-80-set", A100_80, &[(MIG_CONFIG, "all-disabled")]),
        node("t4", T4, &[]),
    ];
    let plan = plan(&spec, &facts(nodes), Some(&mounted()));
    assert_eq!(
        plan.labels_for("a100-40"),
        Some(&labels_of(&[(MIG_CONFIG, "all-1g.5gb")]))
    );
    assert_eq!(plan.labels_for("a100-80-fresh"), None, "nothing added");
    assert_eq!(
        plan.labels_for("a100-80-set"),
        Some(&labels_of(&[(MIG_CONFIG, "all-disabled")])),
        "what it carries is kept"
    );
    assert!(plan.labels_for("t4").is_some());
    let problem = plan.mig_problem.unwrap();
    assert!(
        problem.starts_with(r#"spec.layoutsByModel["NVIDIA-A100-SXM4-80GB"].mig "all-1g.5gb": "#),
        "{problem}"
    );
    assert!(
        problem.contains("frozen on nodes a100-80-fresh and a100-80-set"),
        "{problem}"
    );
    assert!(!problem.contains("a100-40"), "{problem}");
    assert_eq!(plan.sharing_problem, None);
}

#[test]
fn a_sharing_key_the_mounted_config_lacks_is_refused_with_its_keys() {
    let spec = spec(&[(
        "Tesla-T4",
        ModelLayout {
            sharing: Some("time-sliced-8".into()),
            mig: None,
        },
    )]);
    let nodes = vec![
        node("t4", T4, &[(DEVICE_PLUGIN_CONFIG, "time-sliced-4")]),
        node("h100", H100, &[]),
    ];
    let plan = plan(&spec, &facts(nodes), Some(&mounted()));
    assert_eq!(
        plan.labels_for("t4"),
        Some(&labels_of(&[(DEVICE_PLUGIN_CONFIG, "time-sliced-4")])),
        "frozen at its current key"
    );
    assert!(plan.labels_for("h100").is_some());
    let problem = plan.sharing_problem.unwrap();
    assert!(
        problem.contains(r#"has no key "time-sliced-8" (its keys: mps-2, off and time-sliced-4)"#),
        "{problem}"
    );
    assert!(problem.ends_with("(frozen on node t4)"), "{problem}");
}

#[test]
fn sharing_needs_a_named_config_and_mig_needs_mig_manager() {
    let mut spec = spec(&[]);
    spec.device_plugin = None;
    spec.mig_manager = Some(serde_json::from_value(serde_json::json!({"enabled": false})).unwrap());
    let nodes = vec![node("t4", T4, &[]), node("a100-40", A100_40, &[])];
    let plan = plan(&spec, &facts(nodes), None);
    assert!(plan.labels.is_empty(), "{:?}", plan.labels);
    assert!(
        plan.sharing_problem
            .unwrap()
            .contains("spec.devicePlugin.config.name names no sharing ConfigMap")
    );
    assert!(plan.mig_problem.unwrap().contains("mig-manager is off"));
}

#[test]
fn a_custom_mig_config_is_checked_as_mig_manager_reads_it() {
    let mut spec = spec(&[]);
    spec.mig_manager =
        Some(serde_json::from_value(serde_json::json!({"config": {"name": "layouts"}})).unwrap());
    let text = "version: v1\nmig-configs:\n  half:\n    - devices: all\n      mig-enabled: true\n      mig-devices:\n        3g.20gb: 2\n";
    let facts = ClusterFacts {
        mig_config: Some(ConfigMapData {
            name: "layouts".into(),
            data: [("config.yaml".to_owned(), text.to_owned())].into(),
        }),
        ..facts(vec![node("a100-40", A100_40, &[])])
    };
    let missing = plan(&spec, &facts, Some(&mounted()));
    assert!(
        missing
            .mig_problem
            .unwrap()
            .contains("is not in the MIG config"),
        "all-1g.5gb is not among the custom layouts"
    );
    let mut half = spec.clone();
    half.layouts_by_model.as_mut().unwrap().insert(
        A100_40.to_owned(),
        ModelLayout {
            sharing: None,
            mig: Some("half".into()),
        },
    );
    let ok = plan(&half, &facts, Some(&mounted()));
    assert_eq!(ok.mig_problem, None);
    assert_eq!(
        ok.labels_for("a100-40"),
        Some(&labels_of(&[(MIG_CONFIG, "half")]))
    );
}

#[test]
fn nodes_without_a_product_or_taken_out_get_nothing() {
    let waiting = {
        let labels: BTreeMap<String, String> = [(GPU_PRESENT.to_owned(), "true".to_owned())].into();
        Arc::new(NodeView::from_labels("waiting", None, &labels))
    };
    let out = node("out", T4, &[(DEPLOY_OPERANDS, "false")]);
    let plan = plan(&spec(&[]), &facts(vec![waiting, out]), Some(&mounted()));
    assert!(plan.labels.is_empty());
}

#[test]
fn the_mig_default_steps_aside_only_where_an_entry_names_a_layout() {
    let spec = spec(&[]);
    assert!(names_mig_layout(&spec, &node("a", A100_40, &[])));
    assert!(
        !names_mig_layout(&spec, &node("h", H100, &[])),
        "H100's entry sets only sharing"
    );
    assert!(!names_mig_layout(&spec, &node("b", A100_80, &[])));
    assert!(!names_mig_layout(
        &ClusterPolicySpec::default(),
        &node("a", A100_40, &[])
    ));
}

#[test]
fn a_node_nfd_found_a_gpu_on_gets_its_layout_in_the_pass_that_marks_it() {
    let labels: BTreeMap<String, String> = [
        (
            crate::nodes::NFD_GPU_LABELS[0].to_owned(),
            "true".to_owned(),
        ),
        (GPU_PRODUCT.to_owned(), T4.to_owned()),
    ]
    .into();
    let joining = Arc::new(NodeView::from_labels("joining", None, &labels));
    let plan = plan(&spec(&[]), &facts(vec![joining.clone()]), Some(&mounted()));
    assert_eq!(
        plan.labels_for("joining"),
        Some(&labels_of(&[(DEVICE_PLUGIN_CONFIG, "time-sliced-4")]))
    );
    let want = crate::node_pools::desired(&ClusterPolicySpec::default(), &plan, &joining);
    assert_eq!(want.labels[DEVICE_PLUGIN_CONFIG], "time-sliced-4");
}
