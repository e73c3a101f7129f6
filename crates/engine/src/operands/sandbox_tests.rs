//! Render tests of the virtual machine operands (vfio_manager, sandbox_device_plugin,
//! sandbox_validator) and of which operands a node's workload type places on it
//! (docs/operand-facts.md §20).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::time::Duration;

use super::test_support::*;
use crate::nodes::{NFD_GPU_LABELS, NodeView, desired_label_changes_for};
use crate::workload::{Sandbox, WORKLOAD_CONFIG};

/// The kubevirt example's spec (examples/clusterpolicy-sandbox-kubevirt.yaml).
const KUBEVIRT: &str = "{sandboxWorkloads: {enabled: true, defaultWorkload: container, mode: kubevirt}, \
    vfioManager: {enabled: true}, sandboxDevicePlugin: {enabled: true, repository: nvcr.io/nvidia, \
    image: kubevirt-gpu-device-plugin, version: v1.6.0}}";

const VM_OPERANDS: [Operand; 3] = [
    Operand::SandboxValidator,
    Operand::VfioManager,
    Operand::SandboxDevicePlugin,
];

fn rendered_operands(spec: &str) -> BTreeSet<Operand> {
    state(spec, &facts())
        .operands
        .into_iter()
        .filter(|o| matches!(o.outcome, Outcome::Rendered(_)))
        .map(|o| o.operand)
        .collect()
}

#[test]
fn vm_operands_render_only_with_sandbox_workloads_and_their_own_switch() {
    let on = rendered_operands(KUBEVIRT);
    assert!(VM_OPERANDS.iter().all(|o| on.contains(o)), "{on:?}");
    let off =
        rendered_operands("{vfioManager: {enabled: true}, sandboxDevicePlugin: {enabled: true}}");
    assert!(VM_OPERANDS.iter().all(|o| !off.contains(o)), "{off:?}");
    // Sandbox workloads alone: the validator; the others need their switch.
    let alone = rendered_operands("{sandboxWorkloads: {enabled: true}}");
    assert!(alone.contains(&Operand::SandboxValidator));
    assert!(!alone.contains(&Operand::VfioManager));
    assert!(!alone.contains(&Operand::SandboxDevicePlugin));
}

#[test]
fn the_kubevirt_device_plugin_is_off_in_kata_mode() {
    let kata = rendered_operands(&KUBEVIRT.replace("mode: kubevirt", "mode: kata"));
    assert!(!kata.contains(&Operand::SandboxDevicePlugin));
    assert!(kata.contains(&Operand::VfioManager));
}

/// A GPU node labelled as the labeller leaves it under `spec`.
pub(super) fn labelled_node(name: &str, spec: &str, labels: &[(&str, &str)]) -> NodeView {
    let mut all: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    all.insert(NFD_GPU_LABELS[0].to_owned(), "true".to_owned());
    let policy = policy_with(spec, &facts());
    let node = NodeView::from_labels(name, None, &all);
    let patch = desired_label_changes_for(
        &node,
        None,
        Duration::from_secs(60),
        &Sandbox::of(&policy.spec),
    );
    for (key, value) in patch {
        match value {
            Some(v) => all.insert(key, v),
            None => all.remove(&key),
        };
    }
    NodeView::from_labels(name, None, &all)
}

/// The operands whose DaemonSets' nodeSelectors select `node`.
pub(super) fn operands_on(spec: &str, node: &NodeView) -> BTreeSet<Operand> {
    let mut out = BTreeSet::new();
    for o in state(spec, &facts()).operands {
        if let Outcome::Rendered(objects) = o.outcome {
            for ds in &objects.daemon_sets {
                let selector = pod(ds).node_selector.unwrap_or_default();
                if !selector.is_empty() && node.matches(&selector) {
                    out.insert(o.operand);
                }
            }
        }
    }
    out
}

#[test]
fn in_a_mixed_fleet_a_vm_passthrough_node_gets_only_the_vm_operands_and_a_container_node_only_the_container_ones()
 {
    let vm = labelled_node("a100", KUBEVIRT, &[(WORKLOAD_CONFIG, "vm-passthrough")]);
    assert_eq!(
        operands_on(KUBEVIRT, &vm),
        BTreeSet::from(VM_OPERANDS),
        "{:?}",
        vm.labels
    );
    for labels in [vec![], vec![(WORKLOAD_CONFIG, "container")]] {
        let container = labelled_node("t4", KUBEVIRT, &labels);
        let on = operands_on(KUBEVIRT, &container);
        assert!(VM_OPERANDS.iter().all(|o| !on.contains(o)), "{on:?}");
        for expected in [
            Operand::Driver,
            Operand::Toolkit,
            Operand::Validator,
            Operand::DevicePlugin,
            Operand::Gfd,
            Operand::DcgmExporter,
        ] {
            assert!(on.contains(&expected), "{expected:?} missing: {on:?}");
        }
    }
}

#[test]
fn vfio_manager_unloads_the_driver_without_evicting_then_binds_and_unbinds_on_stop() {
    let spec = "{sandboxWorkloads: {enabled: true}, vfioManager: {enabled: true, \
        env: [{name: X, value: '1'}], driverManager: {env: [{name: ENABLE_AUTO_DRAIN, value: 'true'}]}}}";
    let ds = daemon_set(spec, &facts(), Operand::VfioManager);
    assert_eq!(ds.metadata.name.as_deref(), Some("nvidia-vfio-manager"));
    let p = pod(&ds);
    assert_eq!(
        p.node_selector.clone().unwrap(),
        BTreeMap::from([(
            "nvidia.com/gpu.deploy.vfio-manager".to_owned(),
            "true".to_owned()
        )])
    );
    // No runtime class: it must not depend on the NVIDIA runtime it is taking away.
    assert_eq!(p.runtime_class_name, None);
    let manager = p.init_containers.clone().unwrap().remove(0);
    assert_eq!(manager.name, "k8s-driver-manager");
    assert_eq!(
        manager.image.as_deref(),
        Some("nvcr.io/nvidia/cloud-native/k8s-driver-manager:v0.12.0")
    );
    assert_eq!(
        env(&manager, "ENABLE_GPU_POD_EVICTION").as_deref(),
        Some("false")
    );
    assert_eq!(env(&manager, "ENABLE_AUTO_DRAIN").as_deref(), Some("true"));
    let main = container(&p, "nvidia-vfio-manager");
    assert!(main.args.clone().unwrap()[0].contains("vfio-manage bind --all"));
    assert_eq!(env(&main, "X").as_deref(), Some("1"));
    let pre_stop = main.lifecycle.unwrap().pre_stop.unwrap().exec.unwrap();
    assert_eq!(
        pre_stop.command.unwrap(),
        ["vfio-manage", "unbind", "--all"]
    );
}

#[test]
fn vfio_managers_driver_manager_pulls_with_its_own_settings_and_host_root_stays_the_mount() {
    let spec = "{sandboxWorkloads: {enabled: true}, hostPaths: {rootFS: /custom}, \
        vfioManager: {enabled: true, imagePullPolicy: Always, \
        driverManager: {imagePullPolicy: Never, imagePullSecrets: [dm-secret]}}}";
    let p = pod(&daemon_set(spec, &facts(), Operand::VfioManager));
    let manager = container(&p, "k8s-driver-manager");
    assert_eq!(manager.image_pull_policy.as_deref(), Some("Never"));
    let main = container(&p, "nvidia-vfio-manager");
    assert_eq!(main.image_pull_policy.as_deref(), Some("Always"));
    assert_eq!(env(&main, "HOST_ROOT").as_deref(), Some("/host"));
    assert_eq!(host_path(&p, "host-root").0, "/custom");
    let secrets: Vec<String> = p
        .image_pull_secrets
        .unwrap()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(secrets, ["dm-secret"]);
}

#[test]
fn vfio_manager_may_patch_nodes_but_reads_pods_only_in_its_namespace() {
    let spec = "{sandboxWorkloads: {enabled: true}, vfioManager: {enabled: true}}";
    let objects = objects(spec, &facts(), Operand::VfioManager);
    let cluster = &objects.cluster_roles[0].rules.clone().unwrap();
    assert!(cluster.iter().all(|r| {
        r.resources
            .as_ref()
            .unwrap()
            .iter()
            .all(|res| res != "pods")
    }));
    let role = &objects.roles[0].rules.clone().unwrap();
    assert!(
        role.iter()
            .any(|r| r.resources.as_ref().unwrap() == &["pods"])
    );
}

#[test]
fn sandbox_device_plugin_waits_for_the_validator_and_mounts_vfio_devices() {
    let ds = daemon_set(KUBEVIRT, &facts(), Operand::SandboxDevicePlugin);
    assert_eq!(
        ds.metadata.name.as_deref(),
        Some("nvidia-sandbox-device-plugin-daemonset")
    );
    let p = pod(&ds);
    let init: Vec<String> = p
        .init_containers
        .iter()
        .flatten()
        .map(|c| c.name.clone())
        .collect();
    assert_eq!(init, ["vfio-pci-validation", "vgpu-devices-validation"]);
    let vgpu = container(&p, "vgpu-devices-validation");
    let script = vgpu.args.unwrap()[0].clone();
    assert!(script.contains("\"vm-vgpu\""), "{script}");
    assert!(script.contains("vgpu-devices-ready"), "{script}");
    let wait = container(&p, "vfio-pci-validation");
    assert_eq!(
        wait.image.as_deref(),
        Some("nvcr.io/nvidia/gpu-operator:v26.7.0")
    );
    assert!(wait.args.unwrap()[0].contains("vfio-pci-ready"));
    let main = container(&p, "nvidia-sandbox-device-plugin-ctr");
    assert_eq!(
        main.image.as_deref(),
        Some("nvcr.io/nvidia/kubevirt-gpu-device-plugin:v1.6.0")
    );
    assert_eq!(main.command, None, "the image's own command");
    assert_eq!(host_path(&p, "vfio").0, "/dev/vfio");
}

#[test]
fn sandbox_validator_checks_carry_the_default_type_and_the_users_step_env() {
    let spec = "{sandboxWorkloads: {enabled: true, defaultWorkload: vm-passthrough}, \
        validator: {vfioPCI: {env: [{name: WITH_WORKLOAD, value: 'false'}]}}}";
    let ds = daemon_set(spec, &facts(), Operand::SandboxValidator);
    let selector = ds.spec.clone().unwrap().selector.match_labels.unwrap();
    assert_eq!(
        selector
            .get("app.kubernetes.io/part-of")
            .map(String::as_str),
        Some("gpu-operator")
    );
    let p = pod(&ds);
    let vfio = container(&p, "vfio-pci-validation");
    assert_eq!(env(&vfio, "COMPONENT").as_deref(), Some("vfio-pci"));
    assert_eq!(env(&vfio, "WITH_WAIT").as_deref(), Some("true"));
    assert_eq!(
        env(&vfio, "DEFAULT_GPU_WORKLOAD_CONFIG").as_deref(),
        Some("vm-passthrough")
    );
    assert_eq!(env(&vfio, "WITH_WORKLOAD").as_deref(), Some("false"));
    assert!(!has_container(&p, "cc-manager-validation"));
    // driver-install-path is not moved by hostPaths.driverInstallDir.
    let moved = daemon_set(
        "{sandboxWorkloads: {enabled: true}, hostPaths: {driverInstallDir: /opt/driver}}",
        &facts(),
        Operand::SandboxValidator,
    );
    assert_eq!(
        host_path(&pod(&moved), "driver-install-path").0,
        "/run/nvidia/driver"
    );
}

#[test]
fn on_openshift_each_vm_operand_gets_its_own_scc_and_annotation() {
    let openshift = ClusterFacts {
        openshift: true,
        ..facts()
    };
    for (operand, name) in [
        (Operand::VfioManager, "nvidia-vfio-manager"),
        (Operand::SandboxDevicePlugin, "nvidia-sandbox-device-plugin"),
        (Operand::SandboxValidator, "nvidia-sandbox-validator"),
    ] {
        let objects = objects(KUBEVIRT, &openshift, operand);
        let scc = objects
            .dynamic
            .iter()
            .find(|d| {
                d.types
                    .as_ref()
                    .is_some_and(|t| t.kind == "SecurityContextConstraints")
            })
            .unwrap_or_else(|| panic!("{operand:?} has no SCC"));
        assert_eq!(scc.metadata.name.as_deref(), Some(name));
        let ds = &objects.daemon_sets[0];
        assert_eq!(
            ds.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("openshift.io/scc"))
                .map(String::as_str),
            Some(name)
        );
    }
}

#[test]
fn the_driver_is_built_per_os_of_the_container_nodes_only() {
    let node = |name: &str, os: (&str, &str), workload: Option<&str>| {
        let mut labels = BTreeMap::from([
            (NFD_GPU_LABELS[0].to_owned(), "true".to_owned()),
            (crate::nodes::OS_ID.to_owned(), os.0.to_owned()),
            (crate::nodes::OS_VERSION_ID.to_owned(), os.1.to_owned()),
        ]);
        if let Some(workload) = workload {
            labels.insert(WORKLOAD_CONFIG.to_owned(), workload.to_owned());
        }
        std::sync::Arc::new(NodeView::from_labels(name, None, &labels))
    };
    // The VM nodes run OSes no container node runs: a RHEL passthrough node and a node of an
    // OS without a driver image (the OS tag is the container nodes': facts::assemble).
    let facts = ClusterFacts {
        gpu_nodes: vec![
            node("a100", ("rhel", "9.4"), Some("vm-passthrough")),
            node("b200", ("talos", "1.9"), Some("vm-passthrough")),
            node("t4", ("ubuntu", "22.04"), None),
        ],
        os_tag: Some("ubuntu22.04".to_owned()),
        ..facts()
    };
    let outcome = state(KUBEVIRT, &facts)
        .operands
        .into_iter()
        .find(|o| o.operand == Operand::Driver)
        .unwrap();
    let Outcome::Rendered(objects) = outcome.outcome else {
        panic!("the driver does not render: {:?}", outcome.outcome);
    };
    let images: Vec<(String, String)> = objects
        .daemon_sets
        .iter()
        .map(|ds| {
            let main = container(&pod(ds), "nvidia-driver-ctr");
            (ds.metadata.name.clone().unwrap(), main.image.unwrap())
        })
        .collect();
    assert_eq!(images.len(), 1, "{images:?}");
    assert_eq!(images[0].0, "nvidia-driver-daemonset");
    assert!(images[0].1.ends_with("-ubuntu22.04"), "{images:?}");
    // No status line about the VM node's OS having no driver image.
    assert_eq!(
        (super::driver::DESCRIPTOR.report)(&policy(KUBEVIRT).spec, &facts),
        None
    );
}
