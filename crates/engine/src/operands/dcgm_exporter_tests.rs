//! Render tests of DCGM and the DCGM exporter: what its pods need (docs/operand-facts.md).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::test_support::*;

#[test]
fn exporter_uses_the_standalone_engine_only_when_it_runs() {
    let with = container(
        &pod(&daemon_set("{}", &facts(), Operand::DcgmExporter)),
        "nvidia-dcgm-exporter",
    );
    assert_eq!(
        env(&with, "DCGM_REMOTE_HOSTENGINE_INFO").as_deref(),
        Some("nvidia-dcgm:5555")
    );
    let without = container(
        &pod(&daemon_set(
            "{dcgm: {enabled: false}}",
            &facts(),
            Operand::DcgmExporter,
        )),
        "nvidia-dcgm-exporter",
    );
    assert_eq!(env(&without, "DCGM_REMOTE_HOSTENGINE_INFO"), None);
    let dcgm = objects("{}", &facts(), Operand::Dcgm);
    let service = dcgm.services[0].spec.clone().unwrap();
    assert_eq!(service.internal_traffic_policy.as_deref(), Some("Local"));
}

#[test]
fn exporter_service_monitor_needs_the_switch_and_the_api() {
    let spec = "{dcgmExporter: {serviceMonitor: {enabled: true, interval: 15s, scrapeTimeout: 10s, additionalLabels: {release: prom}}}}";
    let with_api = ClusterFacts {
        service_monitor_api: true,
        ..facts()
    };
    let monitors = objects(spec, &with_api, Operand::DcgmExporter).dynamic;
    assert_eq!(monitors.len(), 1);
    assert_eq!(
        monitors[0].metadata.labels.as_ref().unwrap()["release"],
        "prom"
    );
    assert_eq!(monitors[0].data["spec"]["endpoints"][0]["interval"], "15s");
    assert_eq!(
        monitors[0].data["spec"]["endpoints"][0]["scrapeTimeout"],
        "10s"
    );
    assert!(
        objects(spec, &facts(), Operand::DcgmExporter)
            .dynamic
            .is_empty()
    );
    assert!(
        objects("{}", &with_api, Operand::DcgmExporter)
            .dynamic
            .is_empty()
    );
    // The node-status exporter's exists wherever the API does.
    assert_eq!(
        objects(
            "{nodeStatusExporter: {enabled: true}}",
            &with_api,
            Operand::NodeStatusExporter
        )
        .dynamic
        .len(),
        1
    );
}

#[test]
fn exporter_reads_pods_only_when_pod_labels_are_asked_for() {
    let off = objects("{}", &facts(), Operand::DcgmExporter);
    assert!(off.cluster_roles.is_empty());
    assert_eq!(
        pod(&off.daemon_sets[0]).automount_service_account_token,
        Some(false)
    );
    let on = objects(
        "{dcgmExporter: {env: [{name: DCGM_EXPORTER_KUBERNETES_ENABLE_POD_LABELS, value: 'true'}]}}",
        &facts(),
        Operand::DcgmExporter,
    );
    assert_eq!(
        on.cluster_roles[0].metadata.name.as_deref(),
        Some("nvidia-dcgm-exporter-read-pods")
    );
    assert_eq!(
        pod(&on.daemon_sets[0]).automount_service_account_token,
        Some(true)
    );
}

#[test]
fn exporter_with_a_token_for_its_metrics_configmap_may_read_pods() {
    // With a token its pod informer runs, pod labels or not (dcgm-exporter 4.8.x NewPodMapper).
    let cm = objects(
        "{dcgmExporter: {env: [{name: DCGM_EXPORTER_CONFIGMAP_DATA, value: 'gpu-operator:metrics'}]}}",
        &facts(),
        Operand::DcgmExporter,
    );
    assert_eq!(
        pod(&cm.daemon_sets[0]).automount_service_account_token,
        Some(true)
    );
    assert_eq!(
        cm.cluster_roles[0].metadata.name.as_deref(),
        Some("nvidia-dcgm-exporter-read-pods")
    );
    assert_eq!(cm.cluster_role_bindings.len(), 1);
}

#[test]
fn exporter_pod_metadata_fields_become_the_exporters_variables_and_read_access_to_pods() {
    let cases = [
        (
            "{dcgmExporter: {enablePodLabels: true, podLabelAllowlistRegex: ['^app$', '^team-.*']}}",
            vec![
                ("DCGM_EXPORTER_KUBERNETES_ENABLE_POD_LABELS", "true"),
                (
                    "DCGM_EXPORTER_KUBERNETES_POD_LABEL_ALLOWLIST_REGEX",
                    "^app$,^team-.*",
                ),
            ],
        ),
        (
            "{dcgmExporter: {enablePodUID: true}}",
            vec![("DCGM_EXPORTER_KUBERNETES_ENABLE_POD_UID", "true")],
        ),
    ];
    for (spec, expected) in cases {
        let on = objects(spec, &facts(), Operand::DcgmExporter);
        let p = pod(&on.daemon_sets[0]);
        let envs = p.containers[0].env.clone().unwrap_or_default();
        for (name, value) in expected {
            let got = envs.iter().find(|e| e.name == name);
            assert_eq!(
                got.and_then(|e| e.value.as_deref()),
                Some(value),
                "{spec}: {name}"
            );
        }
        assert_eq!(p.automount_service_account_token, Some(true), "{spec}");
        assert_eq!(
            on.cluster_roles[0].metadata.name.as_deref(),
            Some("nvidia-dcgm-exporter-read-pods"),
            "{spec}"
        );
    }
    let off = objects(
        "{dcgmExporter: {enablePodLabels: false, enablePodUID: false}}",
        &facts(),
        Operand::DcgmExporter,
    );
    assert!(off.cluster_roles.is_empty());
    let envs = pod(&off.daemon_sets[0]).containers[0]
        .env
        .clone()
        .unwrap_or_default();
    assert!(
        !envs
            .iter()
            .any(|e| e.name.starts_with("DCGM_EXPORTER_KUBERNETES_")),
        "{envs:?}"
    );
}

#[test]
fn exporter_metrics_config_is_mounted_and_hashed() {
    let metrics = |csv: &str| ClusterFacts {
        dcgm_metrics: Some(ConfigMapData {
            name: "metrics".to_owned(),
            data: [("dcgm-metrics.csv".to_owned(), csv.to_owned())].into(),
        }),
        ..facts()
    };
    let spec = "{dcgmExporter: {config: {name: metrics}}}";
    let a = daemon_set(
        spec,
        &metrics("DCGM_FI_DEV_GPU_UTIL, gauge, x\n"),
        Operand::DcgmExporter,
    );
    let b = daemon_set(
        spec,
        &metrics("DCGM_FI_DEV_GPU_TEMP, gauge, y\n"),
        Operand::DcgmExporter,
    );
    assert_ne!(
        template_annotations(&a)[CONFIG_HASH_ANNOTATION],
        template_annotations(&b)[CONFIG_HASH_ANNOTATION]
    );
    let c = container(&pod(&a), "nvidia-dcgm-exporter");
    assert_eq!(
        env(&c, "DCGM_EXPORTER_COLLECTORS").as_deref(),
        Some("/etc/dcgm-exporter/dcgm-metrics.csv")
    );
    assert_eq!(
        mount_path(&c, "metrics-config"),
        "/etc/dcgm-exporter/dcgm-metrics.csv"
    );
    assert!(
        !template_annotations(&daemon_set("{}", &facts(), Operand::DcgmExporter))
            .contains_key(CONFIG_HASH_ANNOTATION)
    );
}
