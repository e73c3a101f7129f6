//! The scheduler's placement rules as the doctor applies them: each node affinity operator, the
//! edge cases of terms, and the toleration rules.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use k8s_openapi::api::core::v1::{Node, Pod, Taint, Toleration};
use serde_json::{Value, json};

use super::*;

fn node(name: &str, labels: Value) -> Node {
    serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap()
}

fn a100() -> Node {
    node(
        "gpu-a100-0",
        json!({
            "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB",
            "nvidia.com/gpu.count": "8",
            "nvidia.com/gpu.memory": "40960",
            "zone": "a"
        }),
    )
}

fn pod(spec: Value) -> Pod {
    let mut spec = spec;
    spec["containers"] = json!([{"name": "c"}]);
    serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": spec})).unwrap()
}

/// A pod whose required node affinity is `terms`.
fn requiring(terms: Value) -> Pod {
    pod(json!({"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}}))
}

/// A pod requiring the one expression `expression`.
fn expression(expression: Value) -> Pod {
    requiring(json!([{"matchExpressions": [expression]}]))
}

fn admits(pod: &Pod, node: &Node) -> bool {
    affinity_misses(pod, node).is_none()
}

fn op(key: &str, operator: &str, values: &[&str]) -> Value {
    json!({"key": key, "operator": operator, "values": values})
}

#[test]
fn in_admits_a_node_whose_label_is_one_of_the_values() {
    let n = a100();
    assert!(admits(
        &expression(op(
            "nvidia.com/gpu.product",
            "In",
            &["Tesla-T4", "NVIDIA-A100-SXM4-40GB"]
        )),
        &n
    ));
    assert!(!admits(
        &expression(op("nvidia.com/gpu.product", "In", &["Tesla-T4"])),
        &n
    ));
    // A node without the label is not in any set.
    assert!(!admits(&expression(op("rack", "In", &["r1"])), &n));
}

#[test]
fn not_in_admits_a_node_without_the_label_or_with_another_value() {
    let n = a100();
    assert!(admits(&expression(op("rack", "NotIn", &["r1"])), &n));
    assert!(admits(&expression(op("zone", "NotIn", &["b", "c"])), &n));
    assert!(!admits(&expression(op("zone", "NotIn", &["a"])), &n));
}

#[test]
fn exists_and_does_not_exist_test_the_key_only() {
    let n = a100();
    assert!(admits(&expression(op("zone", "Exists", &[])), &n));
    assert!(!admits(&expression(op("rack", "Exists", &[])), &n));
    assert!(admits(&expression(op("rack", "DoesNotExist", &[])), &n));
    assert!(!admits(&expression(op("zone", "DoesNotExist", &[])), &n));
    // Without a values field at all, too.
    assert!(admits(
        &expression(json!({"key": "zone", "operator": "Exists"})),
        &n
    ));
}

#[test]
fn gt_and_lt_compare_as_integers_not_as_text() {
    let n = a100();
    // "8" > "10" as text; 8 < 10 as integers.
    assert!(!admits(
        &expression(op("nvidia.com/gpu.count", "Gt", &["10"])),
        &n
    ));
    assert!(admits(
        &expression(op("nvidia.com/gpu.count", "Lt", &["10"])),
        &n
    ));
    assert!(admits(
        &expression(op("nvidia.com/gpu.memory", "Gt", &["24000"])),
        &n
    ));
    // Strictly greater or less.
    assert!(!admits(
        &expression(op("nvidia.com/gpu.count", "Gt", &["8"])),
        &n
    ));
    assert!(!admits(
        &expression(op("nvidia.com/gpu.count", "Lt", &["8"])),
        &n
    ));
    assert!(admits(
        &expression(op("nvidia.com/gpu.count", "Gt", &["-1"])),
        &n
    ));
}

#[test]
fn gt_and_lt_never_match_a_label_that_is_not_an_integer_or_is_missing() {
    let n = a100();
    let miss = affinity_misses(&expression(op("zone", "Gt", &["0"])), &n).unwrap();
    assert!(
        miss[0].contains("the node's \"a\" is not an integer"),
        "{miss:?}"
    );
    assert!(!admits(&expression(op("zone", "Lt", &["100"])), &n));
    assert!(!admits(&expression(op("rack", "Gt", &["0"])), &n));
}

#[test]
fn gt_with_a_value_that_is_not_one_integer_voids_its_term() {
    let n = a100();
    for values in [&["many"][..], &["1", "2"][..], &[][..]] {
        let pod = expression(op("nvidia.com/gpu.count", "Gt", values));
        let miss = affinity_misses(&pod, &n).unwrap();
        assert!(
            miss[0].contains("is invalid") && miss[0].contains("matches no node"),
            "{values:?}: {miss:?}"
        );
    }
}

#[test]
fn an_invalid_expression_voids_its_term_even_when_another_expression_fails_first() {
    let n = a100();
    let pod = requiring(json!([{"matchExpressions": [
        op("zone", "In", &["b"]),
        op("zone", "Near", &["a"])
    ]}]));
    let miss = affinity_misses(&pod, &n).unwrap();
    assert!(
        miss[0].contains("matchExpressions[1] (zone Near [a]) is invalid: unknown operator"),
        "{miss:?}"
    );
    // In without values and Exists with values are invalid too.
    assert!(!admits(&expression(op("zone", "In", &[])), &n));
    assert!(!admits(&expression(op("zone", "Exists", &["a"])), &n));
}

#[test]
fn expressions_within_a_term_are_anded() {
    let n = a100();
    let both = requiring(json!([{"matchExpressions": [
        op("zone", "In", &["a"]),
        op("nvidia.com/gpu.product", "In", &["Tesla-T4"])
    ]}]));
    let miss = affinity_misses(&both, &n).unwrap();
    assert_eq!(miss.len(), 1);
    assert_eq!(
        miss[0],
        "nodeSelectorTerms[0].matchExpressions[1] (nvidia.com/gpu.product In [Tesla-T4]): the \
         node's is NVIDIA-A100-SXM4-40GB"
    );
}

#[test]
fn terms_are_ored_and_each_failing_term_says_why() {
    let n = a100();
    let either = requiring(json!([
        {"matchExpressions": [op("zone", "In", &["b"])]},
        {"matchExpressions": [op("zone", "In", &["a"])]}
    ]));
    assert!(admits(&either, &n));
    let neither = requiring(json!([
        {"matchExpressions": [op("zone", "In", &["b"])]},
        {"matchExpressions": [op("rack", "Exists", &[])]}
    ]));
    assert_eq!(
        affinity_misses(&neither, &n).unwrap(),
        [
            "nodeSelectorTerms[0].matchExpressions[0] (zone In [b]): the node's is a",
            "nodeSelectorTerms[1].matchExpressions[0] (rack Exists): the node has no label rack",
        ]
    );
}

#[test]
fn an_empty_term_list_matches_no_node() {
    let pod = requiring(json!([]));
    assert_eq!(affinity_misses(&pod, &a100()), Some(Vec::new()));
}

#[test]
fn a_term_without_expressions_matches_no_node_but_another_term_still_can() {
    let n = a100();
    let empty = requiring(json!([{}]));
    let miss = affinity_misses(&empty, &n).unwrap();
    assert_eq!(
        miss,
        ["nodeSelectorTerms[0] has no expressions, so it matches no node"]
    );
    let empty_lists = requiring(json!([{"matchExpressions": [], "matchFields": []}]));
    assert!(!admits(&empty_lists, &n));
    let with_another = requiring(json!([{}, {"matchExpressions": [op("zone", "Exists", &[])]}]));
    assert!(admits(&with_another, &n));
}

#[test]
fn match_fields_tests_the_node_name_with_in_and_not_in_of_one_value() {
    let n = a100();
    let field = |operator: &str, values: &[&str]| {
        requiring(json!([{"matchFields": [
            {"key": "metadata.name", "operator": operator, "values": values}]}]))
    };
    assert!(admits(&field("In", &["gpu-a100-0"]), &n));
    assert!(!admits(&field("In", &["gpu-t4-0"]), &n));
    assert!(admits(&field("NotIn", &["gpu-t4-0"]), &n));
    let miss = affinity_misses(&field("NotIn", &["gpu-a100-0"]), &n).unwrap();
    assert_eq!(
        miss,
        [
            "nodeSelectorTerms[0].matchFields[0] (field metadata.name NotIn [gpu-a100-0]): the \
             node is gpu-a100-0"
        ]
    );
    // Two values, or another operator: the term is void.
    assert!(!admits(&field("In", &["gpu-a100-0", "gpu-t4-0"]), &n));
    assert!(!admits(&field("Exists", &[]), &n));
    // Fields and labels of one term are ANDed.
    let both = requiring(json!([{
        "matchExpressions": [op("zone", "In", &["a"])],
        "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-t4-0"]}]
    }]));
    assert!(!admits(&both, &n));
}

#[test]
fn node_selector_and_required_affinity_are_both_needed() {
    let n = a100();
    let both = pod(json!({
        "nodeSelector": {"zone": "b"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
            {"nodeSelectorTerms": [{"matchExpressions": [op("zone", "Exists", &[])]}]}}}
    }));
    assert!(affinity_misses(&both, &n).is_none());
    assert_eq!(
        selector_misses(&both, &n),
        ["zone=b (the node's is a)".to_owned()]
    );
    let absent = pod(json!({"nodeSelector": {"rack": "r1"}}));
    assert_eq!(
        selector_misses(&absent, &n),
        ["rack=r1 (the node has no label rack)".to_owned()]
    );
}

#[test]
fn preferred_terms_rank_only_and_weight_zero_or_empty_terms_do_not_count() {
    let preferring = pod(json!({"affinity": {"nodeAffinity": {
    "preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 0, "preference": {"matchExpressions": [op("zone", "In", &["a"])]}},
        {"weight": 10, "preference": {}},
        {"weight": 50, "preference": {"matchExpressions": [op("zone", "In", &["a"])]}}
    ]}}}));
    let counted = preferences(&preferring);
    assert_eq!(counted.len(), 1);
    assert_eq!((counted[0].index, counted[0].weight), (2, 50));
    assert!(term_admits(counted[0].term, &a100()));
    assert_eq!(term_text(counted[0].term), "zone In [a]");
    // No required affinity: nothing keeps it off.
    assert!(!has_required_affinity(&preferring));
    assert!(affinity_misses(&preferring, &a100()).is_none());
}

fn taint(key: &str, value: Option<&str>, effect: &str) -> Taint {
    Taint {
        key: key.into(),
        value: value.map(Into::into),
        effect: effect.into(),
        time_added: None,
    }
}

fn toleration(spec: Value) -> Toleration {
    serde_json::from_value(spec).unwrap()
}

#[test]
fn an_empty_key_with_exists_tolerates_every_taint() {
    let all = toleration(json!({"operator": "Exists"}));
    for t in [
        taint("nvidia.com/gpu", Some("present"), "NoSchedule"),
        taint("dedicated", None, "NoExecute"),
        taint("x", Some("y"), "PreferNoSchedule"),
    ] {
        assert!(tolerates(&all, &t), "{t:?}");
    }
    // With an effect, only that effect.
    let no_schedule = toleration(json!({"operator": "Exists", "effect": "NoSchedule"}));
    assert!(tolerates(&no_schedule, &taint("a", None, "NoSchedule")));
    assert!(!tolerates(&no_schedule, &taint("a", None, "NoExecute")));
}

#[test]
fn an_empty_effect_matches_every_effect() {
    let any_effect = toleration(json!({"key": "dedicated", "operator": "Exists"}));
    assert!(tolerates(
        &any_effect,
        &taint("dedicated", Some("ml"), "NoSchedule")
    ));
    assert!(tolerates(
        &any_effect,
        &taint("dedicated", Some("ml"), "NoExecute")
    ));
    assert!(!tolerates(
        &any_effect,
        &taint("other", Some("ml"), "NoExecute")
    ));
}

#[test]
fn the_operator_defaults_to_equal_which_compares_values() {
    let t = taint("dedicated", Some("ml"), "NoSchedule");
    let implicit = toleration(json!({"key": "dedicated", "value": "ml"}));
    let explicit = toleration(json!({"key": "dedicated", "operator": "Equal", "value": "ml"}));
    assert!(tolerates(&implicit, &t));
    assert!(tolerates(&explicit, &t));
    let other_value = toleration(json!({"key": "dedicated", "value": "web"}));
    assert!(!tolerates(&other_value, &t));
    // An absent value equals an empty one.
    let valueless = toleration(json!({"key": "dedicated"}));
    assert!(tolerates(
        &valueless,
        &taint("dedicated", None, "NoSchedule")
    ));
    assert!(tolerates(
        &valueless,
        &taint("dedicated", Some(""), "NoSchedule")
    ));
    assert!(!tolerates(&valueless, &t));
}

#[test]
fn an_unknown_toleration_operator_tolerates_nothing() {
    let t = taint("dedicated", Some("ml"), "NoSchedule");
    let odd = toleration(json!({"key": "dedicated", "operator": "Gt", "value": "ml"}));
    assert!(!tolerates(&odd, &t));
}

#[test]
fn no_schedule_and_no_execute_block_and_prefer_no_schedule_only_ranks() {
    let mut n = a100();
    n.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
        taints: Some(vec![
            taint("a", None, "NoSchedule"),
            taint("b", None, "NoExecute"),
            taint("c", None, "PreferNoSchedule"),
        ]),
        ..Default::default()
    });
    let bare = pod(json!({}));
    let keys = |taints: Vec<Taint>| taints.into_iter().map(|t| t.key).collect::<Vec<_>>();
    assert_eq!(keys(untolerated(&bare, &n, blocks)), ["a", "b"]);
    assert_eq!(
        keys(untolerated(&bare, &n, |t| t.effect == PREFER_NO_SCHEDULE)),
        ["c"]
    );
    let tolerant = pod(json!({"tolerations": [{"key": "a", "operator": "Exists"}]}));
    assert_eq!(keys(untolerated(&tolerant, &n, blocks)), ["b"]);
}
