//! Render tests of the vGPU operands (vgpu_manager, vgpu_device_manager) and of the sandbox
//! validator's vGPU checks (docs/operand-facts.md §20.4, §20.5, §20.8).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use super::test_support::*;
use super::vgpu_device_manager::{self, LiveConfig};
use crate::nodes::{NFD_GPU_LABELS, NodeView, OS_ID, OS_VERSION_ID};
use crate::sharing::vgpu::VGPU_CONFIG_LABEL;
use crate::workload::WORKLOAD_CONFIG;

/// The kubevirt example's vGPU part (examples/clusterpolicy-sandbox-kubevirt.yaml).
const VGPU: &str = "{sandboxWorkloads: {enabled: true, defaultWorkload: container}, \
    vgpuManager: {enabled: true, repository: registry.example.com/nvidia, image: vgpu-manager, \
    version: 580.65.05}, vgpuDeviceManager: {enabled: true, repository: nvcr.io/nvidia/cloud-native, \
    image: vgpu-device-manager, version: v0.5.0}}";

const BROKEN: &str = "version: v1\nvgpu-configs:\n  default:\n  - devices: all\n    \
                      vgpu-devices:\n      L40S-12Q: 0\n";
const GOOD: &str = "version: v1\nvgpu-configs:\n  default:\n  - devices: all\n    \
                    vgpu-devices:\n      L40S-12Q: 4\n";

fn gpu_node(name: &str, labels: &[(&str, &str)]) -> Arc<NodeView> {
    let mut all: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    all.insert(NFD_GPU_LABELS[0].to_owned(), "true".to_owned());
    Arc::new(NodeView::from_labels(name, None, &all))
}

fn vgpu_node(name: &str, os: (&str, &str), config: Option<&str>) -> Arc<NodeView> {
    let mut labels = vec![
        (WORKLOAD_CONFIG, "vm-vgpu"),
        (OS_ID, os.0),
        (OS_VERSION_ID, os.1),
    ];
    if let Some(config) = config {
        labels.push((VGPU_CONFIG_LABEL, config));
    }
    gpu_node(name, &labels)
}

fn with_nodes(nodes: Vec<Arc<NodeView>>) -> ClusterFacts {
    ClusterFacts {
        gpu_nodes: nodes,
        ..facts()
    }
}

fn user_config(text: &str) -> ConfigMapData {
    ConfigMapData {
        name: "vgpu-config".into(),
        data: BTreeMap::from([("config.yaml".to_owned(), text.to_owned())]),
    }
}

fn with_user_config(spec: &str) -> String {
    spec.replace(
        "vgpuDeviceManager: {enabled: true,",
        "vgpuDeviceManager: {enabled: true, config: {name: vgpu-config},",
    )
}

fn outcome(spec: &str, facts: &ClusterFacts, operand: Operand) -> Outcome {
    state(spec, facts)
        .operands
        .into_iter()
        .find(|o| o.operand == operand)
        .unwrap()
        .outcome
}

#[test]
fn vgpu_manager_runs_the_host_driver_per_os_of_the_vm_vgpu_nodes_after_the_driver_manager() {
    let facts = with_nodes(vec![
        vgpu_node("l40s-a", ("ubuntu", "22.04"), None),
        vgpu_node("l40s-b", ("rhel", "9.4"), None),
        // A container node of a third OS does not get a vGPU manager DaemonSet of its own.
        gpu_node("t4", &[(OS_ID, "ubuntu"), (OS_VERSION_ID, "24.04")]),
    ]);
    let objects = objects(VGPU, &facts, Operand::VgpuManager);
    let found: Vec<(String, String)> = objects
        .daemon_sets
        .iter()
        .map(|ds| {
            let p = pod(ds);
            let main = container(&p, "nvidia-vgpu-manager-ctr");
            (ds.metadata.name.clone().unwrap(), main.image.unwrap())
        })
        .collect();
    assert_eq!(
        found,
        [
            (
                "nvidia-vgpu-manager-daemonset".to_owned(),
                "registry.example.com/nvidia/vgpu-manager:580.65.05-rhel9".to_owned()
            ),
            (
                "nvidia-vgpu-manager-daemonset-ubuntu22.04".to_owned(),
                "registry.example.com/nvidia/vgpu-manager:580.65.05-ubuntu22.04".to_owned()
            ),
        ]
    );
    let ds = &objects.daemon_sets[1];
    let p = pod(ds);
    let selector = p.node_selector.clone().unwrap();
    assert_eq!(
        selector.get("nvidia.com/gpu.deploy.vgpu-manager").unwrap(),
        "true"
    );
    assert_eq!(selector.get(OS_ID).unwrap(), "ubuntu");
    assert_eq!(p.host_pid, Some(true));
    assert_eq!(p.host_ipc, Some(true));
    assert_eq!(p.termination_grace_period_seconds, Some(120));
    assert_eq!(
        template_annotations(ds)
            .get("kubectl.kubernetes.io/default-container")
            .unwrap(),
        "nvidia-vgpu-manager-ctr"
    );
    let init = p.init_containers.clone().unwrap();
    assert_eq!(init.len(), 1);
    assert_eq!(init[0].name, "k8s-driver-manager");
    assert_eq!(
        init[0].image.as_deref(),
        Some("nvcr.io/nvidia/cloud-native/k8s-driver-manager:v0.12.0")
    );
    assert_eq!(
        env(&init[0], "ENABLE_GPU_POD_EVICTION").as_deref(),
        Some("false")
    );
    let main = container(&p, "nvidia-vgpu-manager-ctr");
    assert_eq!(main.command.clone().unwrap(), ["nvidia-driver"]);
    assert_eq!(main.args.clone().unwrap(), ["init"]);
    assert_eq!(
        host_path(&p, "nv-firmware").0,
        "/run/nvidia/driver/lib/firmware"
    );
    assert_eq!(mount_path(&main, "vfio"), "/dev/vfio");
    // No runtime class: it brings the driver the NVIDIA runtime needs.
    assert_eq!(p.runtime_class_name, None);
}

#[test]
fn one_os_of_vm_vgpu_nodes_gets_one_plain_daemonset_without_an_os_selector() {
    let facts = with_nodes(vec![vgpu_node("l40s", ("ubuntu", "24.04"), None)]);
    let ds = daemon_set(VGPU, &facts, Operand::VgpuManager);
    assert_eq!(
        ds.metadata.name.as_deref(),
        Some("nvidia-vgpu-manager-daemonset")
    );
    let p = pod(&ds);
    assert!(!p.node_selector.clone().unwrap().contains_key(OS_ID));
    assert_eq!(
        container(&p, "nvidia-vgpu-manager-ctr").image.as_deref(),
        Some("registry.example.com/nvidia/vgpu-manager:580.65.05-ubuntu24.04")
    );
}

#[test]
fn vgpu_manager_without_an_image_is_invalid_naming_the_fields_and_nothing_else_breaks() {
    let spec = "{sandboxWorkloads: {enabled: true}, vgpuManager: {enabled: true}, \
        vgpuDeviceManager: {enabled: true, repository: nvcr.io/nvidia/cloud-native, \
        image: vgpu-device-manager, version: v0.5.0}}";
    let Outcome::Invalid(why) = outcome(spec, &facts(), Operand::VgpuManager) else {
        panic!("the vGPU manager renders without an image");
    };
    assert!(why.contains("spec.vgpuManager.repository"), "{why}");
    assert!(why.contains("spec.vgpuManager.version"), "{why}");
    assert!(
        why.contains("NVIDIA publishes no vGPU manager image"),
        "{why}"
    );
    for other in [
        Operand::VgpuDeviceManager,
        Operand::SandboxValidator,
        Operand::Driver,
    ] {
        assert!(
            matches!(outcome(spec, &facts(), other), Outcome::Rendered(_)),
            "{other:?}"
        );
    }
    // An image name alone (NVIDIA's values carry `image: vgpu-manager`) is no image either.
    let bare = spec.replace(
        "vgpuManager: {enabled: true}",
        "vgpuManager: {enabled: true, image: vgpu-manager}",
    );
    let Outcome::Invalid(why) = outcome(&bare, &facts(), Operand::VgpuManager) else {
        panic!("a bare image name renders");
    };
    assert!(why.contains("spec.vgpuManager.repository"), "{why}");
}

#[test]
fn vgpu_manager_mounts_each_kernel_module_parameter_file_under_drivers_and_a_missing_map_freezes_it()
 {
    let spec = VGPU.replace(
        "version: 580.65.05}",
        "version: 580.65.05, kernelModuleConfig: {name: vgpu-modules}}",
    );
    let node = vgpu_node("l40s", ("ubuntu", "24.04"), None);
    let modules = ConfigMapData {
        name: "vgpu-modules".into(),
        data: BTreeMap::from([
            (
                "nvidia.conf".to_owned(),
                "NVreg_RegistryDwords=\"x\"".to_owned(),
            ),
            ("nvidia-vgpu-vfio.conf".to_owned(), String::new()),
        ]),
    };
    let facts = ClusterFacts {
        driver_config_maps: BTreeMap::from([("vgpu-modules".to_owned(), modules)]),
        ..with_nodes(vec![node.clone()])
    };
    let p = pod(&daemon_set(&spec, &facts, Operand::VgpuManager));
    let volume = p
        .volumes
        .clone()
        .unwrap()
        .into_iter()
        .find(|v| v.name == "kernel-module-config")
        .expect("no kernel module parameter volume");
    assert_eq!(volume.config_map.unwrap().name, "vgpu-modules");
    let main = container(&p, "nvidia-vgpu-manager-ctr");
    let files: Vec<(String, Option<String>)> = main
        .volume_mounts
        .unwrap()
        .into_iter()
        .filter(|m| m.name == "kernel-module-config")
        .map(|m| (m.mount_path, m.sub_path))
        .collect();
    assert_eq!(
        files,
        [
            (
                "/drivers/nvidia-vgpu-vfio.conf".to_owned(),
                Some("nvidia-vgpu-vfio.conf".to_owned())
            ),
            (
                "/drivers/nvidia.conf".to_owned(),
                Some("nvidia.conf".to_owned())
            ),
        ]
    );
    // The policy's field is acted on, so status no longer lists it.
    let policy: crate::api::ClusterPolicySpec = serde_yaml_ng::from_str(&spec).unwrap();
    assert!(
        !policy
            .unsupported_fields()
            .iter()
            .any(|u| u.path.contains("kernelModuleConfig")),
        "{:?}",
        policy.unsupported_fields()
    );

    // Named but absent: the vGPU manager is invalid naming the field and the fix; the others
    // render.
    let without = with_nodes(vec![node]);
    let Outcome::Invalid(why) = outcome(&spec, &without, Operand::VgpuManager) else {
        panic!("the vGPU manager renders without its kernel module ConfigMap");
    };
    assert!(
        why.contains(
            "spec.vgpuManager.kernelModuleConfig.name: ConfigMap vgpu-modules was not found"
        ),
        "{why}"
    );
    assert!(why.contains("create it, or clear the field"), "{why}");
    assert!(matches!(
        outcome(&spec, &without, Operand::VgpuDeviceManager),
        Outcome::Rendered(_)
    ));
}

#[test]
fn vgpu_manager_is_left_to_nvidiadrivers_with_the_driver_crd() {
    let spec = VGPU.replace(
        "sandboxWorkloads:",
        "driver: {useNvidiaDriverCRD: true}, sandboxWorkloads:",
    );
    assert!(matches!(
        outcome(&spec, &facts(), Operand::VgpuManager),
        Outcome::Disabled
    ));
    assert!(matches!(
        outcome(&spec, &facts(), Operand::VgpuDeviceManager),
        Outcome::Rendered(_)
    ));
}

#[test]
fn vgpu_device_manager_mounts_a_content_named_copy_of_the_default_configs() {
    let objects = objects(VGPU, &facts(), Operand::VgpuDeviceManager);
    let ds = &objects.daemon_sets[0];
    assert_eq!(
        ds.metadata.name.as_deref(),
        Some("nvidia-vgpu-device-manager")
    );
    let p = pod(ds);
    let main = container(&p, "nvidia-vgpu-device-manager");
    assert_eq!(
        main.image.as_deref(),
        Some("nvcr.io/nvidia/cloud-native/vgpu-device-manager:v0.5.0")
    );
    assert_eq!(main.command, None, "the image's own entrypoint");
    assert_eq!(
        env(&main, "CONFIG_FILE").as_deref(),
        Some("/vgpu-config/config.yaml")
    );
    assert_eq!(
        env(&main, "DEFAULT_VGPU_CONFIG").as_deref(),
        Some("default")
    );
    assert_eq!(mount_path(&main, "driver-install-dir"), "/driver-root");
    let init = container(&p, "vgpu-manager-validation");
    assert!(init.args.unwrap()[0].contains("host-vgpu-manager-ready"));
    let copy = p
        .volumes
        .unwrap()
        .into_iter()
        .find(|v| v.name == "vgpu-config")
        .unwrap()
        .config_map
        .unwrap()
        .name;
    assert!(copy.starts_with("default-vgpu-devices-config-"), "{copy}");
    let names: Vec<&str> = objects
        .config_maps
        .iter()
        .map(|cm| cm.metadata.name.as_deref().unwrap())
        .collect();
    assert_eq!(names, ["default-vgpu-devices-config", copy.as_str()]);
    let copy_cm = &objects.config_maps[1];
    assert_eq!(copy_cm.immutable, Some(true));
    assert_eq!(
        template_annotations(ds).get(CONFIG_HASH_ANNOTATION),
        Some(&common::config_hash(copy_cm.data.as_ref().unwrap()))
    );
}

#[test]
fn a_valid_user_config_rolls_out_as_a_new_copy() {
    let spec = with_user_config(VGPU);
    let facts = ClusterFacts {
        vgpu_config: Some(user_config(GOOD)),
        ..facts()
    };
    let objects = objects(&spec, &facts, Operand::VgpuDeviceManager);
    let names: Vec<&str> = objects
        .config_maps
        .iter()
        .map(|cm| cm.metadata.name.as_deref().unwrap())
        .collect();
    assert_eq!(names.len(), 1, "no default ConfigMap: {names:?}");
    assert!(names[0].starts_with("vgpu-config-"), "{names:?}");
    assert_eq!(
        vgpu_device_manager::mounted_copy(&objects.daemon_sets[0]).as_deref(),
        Some(names[0])
    );
}

#[test]
fn an_invalid_edit_keeps_the_last_good_copy_and_is_reported_naming_field_and_fix() {
    let spec = with_user_config(VGPU);
    let good = ClusterFacts {
        vgpu_config: Some(user_config(GOOD)),
        ..facts()
    };
    let before = daemon_set(&spec, &good, Operand::VgpuDeviceManager);
    let broken = ClusterFacts {
        vgpu_config: Some(user_config(BROKEN)),
        vgpu_live_config: LiveConfig::Copy {
            source: "vgpu-config".into(),
            data: user_config(GOOD).data,
        },
        ..facts()
    };
    let after = daemon_set(&spec, &broken, Operand::VgpuDeviceManager);
    assert_eq!(before, after, "the DaemonSet is rewritten");
    let reported = policy_with(&spec, &broken).reported[&Operand::VgpuDeviceManager].clone();
    assert!(
        reported.contains(
            "ConfigMap vgpu-config, key \"config.yaml\": vgpu-configs.default[0].vgpu-devices.L40S-12Q has count 0"
        ),
        "{reported}"
    );
    assert!(reported.contains("above 0"), "{reported}");
    assert!(
        reported.contains("keeps the last good config vgpu-config-"),
        "{reported}"
    );
}

#[test]
fn a_first_ever_invalid_config_or_a_deleted_last_good_copy_freezes_the_device_manager() {
    let spec = with_user_config(VGPU);
    for live in [
        LiveConfig::Nothing,
        LiveConfig::Gone("vgpu-config-0123456789".into()),
    ] {
        let facts = ClusterFacts {
            vgpu_config: Some(user_config(BROKEN)),
            vgpu_live_config: live.clone(),
            ..facts()
        };
        let Outcome::Invalid(why) = outcome(&spec, &facts, Operand::VgpuDeviceManager) else {
            panic!("{live:?}: renders with a broken config");
        };
        assert!(why.contains("has count 0"), "{why}");
    }
    // A named ConfigMap that does not exist says so.
    let Outcome::Invalid(why) = outcome(&spec, &facts(), Operand::VgpuDeviceManager) else {
        panic!("renders without its ConfigMap");
    };
    assert!(
        why.contains("names ConfigMap vgpu-config, which does not exist"),
        "{why}"
    );
}

#[test]
fn a_node_label_naming_an_unknown_config_is_reported_with_the_configs_there_are() {
    let facts = with_nodes(vec![
        vgpu_node("l40s-a", ("ubuntu", "22.04"), Some("L40S-12Q")),
        vgpu_node("l40s-b", ("ubuntu", "22.04"), Some("L40S-7Q")),
    ]);
    let policy = policy_with(VGPU, &facts);
    let reported = &policy.reported[&Operand::VgpuDeviceManager];
    assert!(
        reported.starts_with("l40s-b (nvidia.com/vgpu.config=L40S-7Q) name a vGPU config"),
        "{reported}"
    );
    assert!(
        reported.contains("default-vgpu-devices-config"),
        "{reported}"
    );
    assert!(reported.contains("L40S-12Q"), "{reported}");
    // Still rendered, with the same config.
    assert!(matches!(
        outcome(VGPU, &facts, Operand::VgpuDeviceManager),
        Outcome::Rendered(_)
    ));
}

#[test]
fn an_edit_removing_a_config_a_node_names_is_not_rolled_out() {
    let spec = with_user_config(VGPU);
    let two =
        format!("{GOOD}  L40S-48Q:\n  - devices: all\n    vgpu-devices:\n      L40S-48Q: 1\n");
    let facts = ClusterFacts {
        vgpu_config: Some(user_config(GOOD)),
        vgpu_live_config: LiveConfig::Copy {
            source: "vgpu-config".into(),
            data: user_config(&two).data,
        },
        gpu_nodes: vec![vgpu_node("l40s", ("ubuntu", "22.04"), Some("L40S-48Q"))],
        ..facts()
    };
    let reported = &policy_with(&spec, &facts).reported[&Operand::VgpuDeviceManager];
    assert!(
        reported.contains("removes configs that nodes still name"),
        "{reported}"
    );
    assert!(reported.contains("L40S-48Q (node l40s)"), "{reported}");
    let ds = daemon_set(&spec, &facts, Operand::VgpuDeviceManager);
    let copy = vgpu_device_manager::mounted_copy(&ds).unwrap();
    let last = common::hashed_name("vgpu-config", &common::config_hash(&user_config(&two).data));
    assert_eq!(copy, last);
}

#[test]
fn vgpu_operands_may_write_only_their_own_node_and_read_pods_in_their_namespace() {
    for (operand, policy_name) in [
        (Operand::VgpuManager, "nvidia-vgpu-manager-own-node"),
        (
            Operand::VgpuDeviceManager,
            "nvidia-vgpu-device-manager-own-node",
        ),
    ] {
        let objects = objects(VGPU, &facts(), operand);
        let cluster = objects.cluster_roles[0].rules.clone().unwrap();
        assert!(
            cluster
                .iter()
                .all(|r| r.resources.as_ref().unwrap() == &["nodes"]),
            "{operand:?}: {cluster:?}"
        );
        let role = objects.roles[0].rules.clone().unwrap();
        assert!(
            role.iter()
                .any(|r| r.resources.as_ref().unwrap() == &["pods"])
        );
        assert!(
            objects
                .dynamic
                .iter()
                .any(|d| d.metadata.name.as_deref() == Some(policy_name)),
            "{operand:?}"
        );
    }
}

#[test]
fn sandbox_validator_runs_the_vgpu_checks_in_order_with_the_users_env() {
    let spec = "{sandboxWorkloads: {enabled: true, defaultWorkload: vm-vgpu}, \
        validator: {vgpuManager: {env: [{name: A, value: '1'}]}, \
        vgpuDevices: {env: [{name: B, value: '2'}]}}}";
    let p = pod(&daemon_set(spec, &facts(), Operand::SandboxValidator));
    let init: Vec<String> = p
        .init_containers
        .iter()
        .flatten()
        .map(|c| c.name.clone())
        .collect();
    assert_eq!(
        init,
        [
            "vfio-pci-validation",
            "vgpu-manager-validation",
            "vgpu-devices-validation"
        ]
    );
    let manager = container(&p, "vgpu-manager-validation");
    assert_eq!(env(&manager, "COMPONENT").as_deref(), Some("vgpu-manager"));
    assert_eq!(env(&manager, "A").as_deref(), Some("1"));
    assert_eq!(
        env(&manager, "DEFAULT_GPU_WORKLOAD_CONFIG").as_deref(),
        Some("vm-vgpu")
    );
    assert_eq!(
        mount_path(&manager, "driver-install-path"),
        "/run/nvidia/driver"
    );
    let devices = container(&p, "vgpu-devices-validation");
    assert_eq!(env(&devices, "COMPONENT").as_deref(), Some("vgpu-devices"));
    assert_eq!(env(&devices, "B").as_deref(), Some("2"));
    assert_eq!(env(&devices, "A"), None);
}
