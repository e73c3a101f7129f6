//! Render tests of NFD: what its pods need (docs/operand-facts.md).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::test_support::*;

#[test]
fn nfd_publishes_nvidia_labels_and_keeps_user_settings() {
    let spec = "{nfd: {master: {extraLabelNs: [example.com], config: {klog: {v: 2}}}, \
                worker: {config: {sources: {pci: {deviceLabelFields: [vendor, device]}}}}}}";
    let objects = objects(spec, &facts(), Operand::Nfd);
    let master_conf: serde_json::Value =
        serde_yaml_ng::from_str(&objects.config_maps[0].data.as_ref().unwrap()["nfd-master.conf"])
            .unwrap();
    assert_eq!(
        master_conf["extraLabelNs"],
        serde_json::json!(["nvidia.com", "example.com"])
    );
    assert_eq!(master_conf["klog"]["v"], 2);
    let worker_conf: serde_json::Value =
        serde_yaml_ng::from_str(&objects.config_maps[1].data.as_ref().unwrap()["nfd-worker.conf"])
            .unwrap();
    assert_eq!(
        worker_conf["sources"]["pci"]["deviceLabelFields"],
        serde_json::json!(["vendor", "device"])
    );
    assert_eq!(
        worker_conf["sources"]["pci"]["deviceClassWhitelist"][0],
        "02"
    );
    let worker = pod(&objects.daemon_sets[0]);
    assert!(
        worker
            .tolerations
            .unwrap()
            .iter()
            .any(|t| t.key.as_deref() == Some("nvidia.com/gpu"))
    );
    assert_eq!(
        worker.node_selector, None,
        "the worker must run on every node to find GPUs"
    );
    assert_eq!(
        objects.deployments[0].spec.clone().unwrap().replicas,
        Some(1)
    );
}
