//! Render tests of the operator validator: what its pods need (docs/operand-facts.md).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::test_support::*;

#[test]
fn validator_runs_driver_toolkit_cuda_plugin_and_drops_plugin_without_a_device_plugin() {
    let ds = daemon_set("{mig: {strategy: mixed}}", &facts(), Operand::Validator);
    let p = pod(&ds);
    let names: Vec<String> = p
        .init_containers
        .clone()
        .unwrap()
        .into_iter()
        .map(|c| c.name)
        .collect();
    assert_eq!(
        names,
        [
            "driver-validation",
            "toolkit-validation",
            "cuda-validation",
            "plugin-validation"
        ]
    );
    let components: Vec<Option<String>> = p
        .init_containers
        .clone()
        .unwrap()
        .iter()
        .map(|c| env(c, "COMPONENT"))
        .collect();
    assert_eq!(
        components,
        [
            Some("driver".into()),
            Some("toolkit".into()),
            Some("cuda".into()),
            Some("plugin".into())
        ]
    );
    let cuda = container(&p, "cuda-validation");
    assert_eq!(
        env(&cuda, "VALIDATOR_RUNTIME_CLASS").as_deref(),
        Some("nvidia")
    );
    assert_eq!(
        env(&cuda, "VALIDATOR_IMAGE").as_deref(),
        Some("nvcr.io/nvidia/gpu-operator:v26.7.0")
    );
    assert_eq!(
        env(&container(&p, "plugin-validation"), "MIG_STRATEGY").as_deref(),
        Some("mixed")
    );
    assert_eq!(
        env(
            &container(&p, "toolkit-validation"),
            "NVIDIA_VISIBLE_DEVICES"
        )
        .as_deref(),
        Some("all")
    );
    let pre_stop = container(&p, "nvidia-operator-validator")
        .lifecycle
        .unwrap()
        .pre_stop
        .unwrap()
        .exec
        .unwrap()
        .command
        .unwrap();
    assert!(pre_stop[2].contains("/run/nvidia/validations/*-ready"));
    let selector = ds.spec.unwrap().selector.match_labels.unwrap();
    assert_eq!(
        selector,
        common::string_map(&[
            ("app", "nvidia-operator-validator"),
            ("app.kubernetes.io/part-of", "gpu-operator")
        ])
    );
    let without = pod(&daemon_set(
        "{devicePlugin: {enabled: false}}",
        &facts(),
        Operand::Validator,
    ));
    assert!(!has_container(&without, "plugin-validation"));
}
