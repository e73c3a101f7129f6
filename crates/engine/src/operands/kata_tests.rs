//! Render tests of the Kata and confidential-computing operands (kata_sandbox_device_plugin,
//! cc_manager, the sandbox validator's CC check) and of which operands a node's workload type
//! places on it in sandbox mode kata (docs/operand-facts.md §20.3, §20.4, §20.6).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

use super::sandbox_tests::{labelled_node, operands_on};
use super::test_support::*;
use crate::workload::WORKLOAD_CONFIG;

/// The kata example's spec (examples/clusterpolicy-sandbox-kata.yaml).
const KATA: &str = "{sandboxWorkloads: {enabled: true, defaultWorkload: container, mode: kata}, \
    vfioManager: {enabled: true}, kataSandboxDevicePlugin: {enabled: true, \
    repository: nvcr.io/nvidia/cloud-native, image: nvidia-sandbox-device-plugin, version: v0.0.5}, \
    ccManager: {enabled: true, defaultMode: 'on', repository: nvcr.io/nvidia/cloud-native, \
    image: k8s-cc-manager, version: v0.4.3}}";

const KATA_OPERANDS: [Operand; 2] = [Operand::KataSandboxDevicePlugin, Operand::CcManager];

fn rendered_operands(spec: &str) -> BTreeSet<Operand> {
    state(spec, &facts())
        .operands
        .into_iter()
        .filter(|o| matches!(o.outcome, Outcome::Rendered(_)))
        .map(|o| o.operand)
        .collect()
}

fn kubevirt() -> String {
    KATA.replace("mode: kata", "mode: kubevirt")
}

#[test]
fn the_kata_plugin_and_the_cc_manager_render_only_in_kata_mode_with_their_switches() {
    let on = rendered_operands(KATA);
    assert!(KATA_OPERANDS.iter().all(|o| on.contains(o)), "{on:?}");
    assert!(on.contains(&Operand::SandboxValidator));
    assert!(!on.contains(&Operand::SandboxDevicePlugin));

    let kubevirt = rendered_operands(&kubevirt());
    assert!(
        KATA_OPERANDS.iter().all(|o| !kubevirt.contains(o)),
        "{kubevirt:?}"
    );

    let no_sandbox = rendered_operands(&KATA.replace(
        "enabled: true, defaultWorkload",
        "enabled: false, defaultWorkload",
    ));
    assert!(KATA_OPERANDS.iter().all(|o| !no_sandbox.contains(o)));

    let switched_off = rendered_operands(
        "{sandboxWorkloads: {enabled: true, mode: kata}, kataSandboxDevicePlugin: {enabled: false}, \
         ccManager: {enabled: false}}",
    );
    assert!(KATA_OPERANDS.iter().all(|o| !switched_off.contains(o)));
    // Absent sections are off, as in NVIDIA's API.
    let absent = rendered_operands("{sandboxWorkloads: {enabled: true, mode: kata}}");
    assert!(KATA_OPERANDS.iter().all(|o| !absent.contains(o)));
}

#[test]
fn in_kata_mode_a_vm_passthrough_node_gets_the_kata_plugin_and_a_container_node_none_of_it() {
    let vm = labelled_node("a100", KATA, &[(WORKLOAD_CONFIG, "vm-passthrough")]);
    assert_eq!(
        operands_on(KATA, &vm),
        BTreeSet::from([
            Operand::SandboxValidator,
            Operand::VfioManager,
            Operand::KataSandboxDevicePlugin,
            Operand::CcManager,
        ]),
        "{:?}",
        vm.labels
    );
    let container = labelled_node("t4", KATA, &[]);
    let on = operands_on(KATA, &container);
    assert!(KATA_OPERANDS.iter().all(|o| !on.contains(o)), "{on:?}");
    assert!(on.contains(&Operand::Driver) && on.contains(&Operand::DevicePlugin));
    // A vm-vgpu node keeps the KubeVirt plugin's key, whose DaemonSet is off in kata mode: it
    // gets the CC manager and the validator only.
    let vgpu = labelled_node("l40s", KATA, &[(WORKLOAD_CONFIG, "vm-vgpu")]);
    let on = operands_on(KATA, &vgpu);
    assert!(on.contains(&Operand::CcManager), "{on:?}");
    assert!(!on.contains(&Operand::KataSandboxDevicePlugin), "{on:?}");
    assert!(!on.contains(&Operand::SandboxDevicePlugin), "{on:?}");
}

#[test]
fn kata_plugin_waits_for_vfio_then_advertises_with_its_identity_and_the_users_aliases() {
    let spec = KATA.replace(
        "version: v0.0.5}",
        "version: v0.0.5, env: [{name: P_GPU_ALIAS, value: gpu}, {name: NVSWITCH_ALIAS, value: ''}]}",
    );
    let ds = daemon_set(&spec, &facts(), Operand::KataSandboxDevicePlugin);
    assert_eq!(
        ds.metadata.name.as_deref(),
        Some("nvidia-kata-sandbox-device-plugin-daemonset")
    );
    let selector = ds.spec.clone().unwrap().selector.match_labels.unwrap();
    assert_eq!(
        selector,
        BTreeMap::from([(
            "app".to_owned(),
            "nvidia-kata-sandbox-device-plugin-daemonset".to_owned()
        )])
    );
    let p = pod(&ds);
    assert_eq!(
        p.node_selector.clone().unwrap(),
        BTreeMap::from([(
            "nvidia.com/gpu.deploy.kata-sandbox-device-plugin".to_owned(),
            "true".to_owned()
        )])
    );
    assert_eq!(
        p.service_account_name.as_deref(),
        Some("nvidia-kata-sandbox-device-plugin")
    );
    assert_eq!(p.runtime_class_name, None);
    let init: Vec<String> = p
        .init_containers
        .iter()
        .flatten()
        .map(|c| c.name.clone())
        .collect();
    assert_eq!(init, ["vfio-pci-validation"]);
    let wait = container(&p, "vfio-pci-validation");
    assert!(wait.args.unwrap()[0].contains("vfio-pci-ready"));

    let main = container(&p, "nvidia-kata-sandbox-device-plugin-ctr");
    assert_eq!(
        main.image.as_deref(),
        Some("nvcr.io/nvidia/cloud-native/nvidia-sandbox-device-plugin:v0.0.5")
    );
    assert_eq!(main.command, None, "the image's own command");
    let names = env_names(&main);
    for name in ["NODE_NAME", "POD_NAMESPACE", "POD_SERVICE_ACCOUNT"] {
        assert!(names.iter().any(|n| n == name), "{name}: {names:?}");
    }
    assert_eq!(env(&main, "P_GPU_ALIAS").as_deref(), Some("gpu"));
    assert_eq!(env(&main, "NVSWITCH_ALIAS").as_deref(), Some(""));
    let mounts: BTreeSet<String> = main
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| m.mount_path.clone())
        .collect();
    assert_eq!(
        mounts,
        BTreeSet::from([
            "/var/lib/kubelet/device-plugins".to_owned(),
            "/var/run/cdi".to_owned()
        ]),
        "no /dev/vfio: the Kata runtime opens the devices from the CDI specs"
    );
    assert_eq!(host_path(&p, "cdi-root").0, "/var/run/cdi");
}

/// The rules of the operand's Role (namespaced) and ClusterRole.
fn grants(spec: &str, operand: Operand) -> (Vec<String>, Vec<String>) {
    let objects = objects(spec, &facts(), operand);
    let flat = |rules: Option<Vec<k8s_openapi::api::rbac::v1::PolicyRule>>| -> Vec<String> {
        rules
            .into_iter()
            .flatten()
            .flat_map(|r| {
                let resources = r.resources.unwrap_or_default();
                r.verbs
                    .iter()
                    .flat_map(|v| resources.iter().map(move |res| format!("{v} {res}")))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    (
        flat(objects.roles.first().and_then(|r| r.rules.clone())),
        flat(objects.cluster_roles.first().and_then(|r| r.rules.clone())),
    )
}

#[test]
fn kata_plugin_may_create_pods_and_node_features_only_when_it_launches_gfd() {
    let (role, cluster) = grants(KATA, Operand::KataSandboxDevicePlugin);
    assert!(role.is_empty(), "{role:?}");
    assert_eq!(cluster, ["get nodes"]);

    for value in ["true", "1", "True"] {
        let gfd = KATA.replace(
            "version: v0.0.5}",
            &format!("version: v0.0.5, env: [{{name: ENABLE_GFD, value: '{value}'}}]}}"),
        );
        let (role, _) = grants(&gfd, Operand::KataSandboxDevicePlugin);
        for needed in [
            "create pods",
            "get pods",
            "create nodefeatures",
            "update nodefeatures",
        ] {
            assert!(
                role.iter().any(|g| g == needed),
                "{value}: {needed}: {role:?}"
            );
        }
        assert!(!role.iter().any(|g| g == "delete pods"), "{role:?}");
    }
    let off = KATA.replace(
        "version: v0.0.5}",
        "version: v0.0.5, env: [{name: ENABLE_GFD, value: 'false'}]}",
    );
    assert!(grants(&off, Operand::KataSandboxDevicePlugin).0.is_empty());
}

#[test]
fn cc_manager_sets_the_default_mode_and_its_namespace_and_cleans_its_readiness_file_on_stop() {
    let ds = daemon_set(KATA, &facts(), Operand::CcManager);
    assert_eq!(ds.metadata.name.as_deref(), Some("nvidia-cc-manager"));
    // NVIDIA's selector (`name`), so its DaemonSet can be taken over; `app` stays on the pods.
    let selector = ds.spec.clone().unwrap().selector.match_labels.unwrap();
    assert_eq!(
        selector,
        BTreeMap::from([("name".to_owned(), "nvidia-cc-manager".to_owned())])
    );
    let p = pod(&ds);
    assert_eq!(
        p.node_selector.clone().unwrap(),
        BTreeMap::from([(
            "nvidia.com/gpu.deploy.cc-manager".to_owned(),
            "true".to_owned()
        )])
    );
    assert!(p.init_containers.as_ref().is_none_or(Vec::is_empty));
    assert_eq!(p.termination_grace_period_seconds, Some(30));
    let main = container(&p, "nvidia-cc-manager");
    assert_eq!(
        main.image.as_deref(),
        Some("nvcr.io/nvidia/cloud-native/k8s-cc-manager:v0.4.3")
    );
    assert_eq!(main.command, None, "the image's own entrypoint");
    assert_eq!(env(&main, "DEFAULT_CC_MODE").as_deref(), Some("on"));
    assert_eq!(
        env(&main, "NVIDIA_VISIBLE_DEVICES").as_deref(),
        Some("void")
    );
    let namespace = main
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "OPERATOR_NAMESPACE")
        .and_then(|e| e.value_from.clone())
        .and_then(|v| v.field_ref)
        .map(|f| f.field_path);
    assert_eq!(namespace.as_deref(), Some("metadata.namespace"));
    assert!(main.security_context.unwrap().privileged.unwrap());
    let resources = main.resources.unwrap();
    assert_eq!(resources.limits.unwrap()["memory"].0, "200Mi");
    let pre_stop = main.lifecycle.unwrap().pre_stop.unwrap().exec.unwrap();
    assert_eq!(
        pre_stop.command.unwrap(),
        ["rm", "-f", "/run/nvidia/validations/.cc-manager-ctr-ready"]
    );
    assert_eq!(host_path(&p, "host-sys").0, "/sys");
    assert_eq!(host_path(&p, "run-nvidia").0, "/run/nvidia");

    // No default mode: the manager's own default applies.
    let unset = KATA.replace("defaultMode: 'on', ", "");
    let main = container(
        &pod(&daemon_set(&unset, &facts(), Operand::CcManager)),
        "nvidia-cc-manager",
    );
    assert_eq!(env(&main, "DEFAULT_CC_MODE"), None);
    assert!(!env_names(&main).contains(&"DEFAULT_CC_MODE".to_owned()));
}

#[test]
fn cc_manager_reads_pods_in_its_namespace_and_may_patch_only_its_own_node() {
    let (role, cluster) = grants(KATA, Operand::CcManager);
    assert_eq!(role, ["get pods", "list pods", "watch pods"]);
    assert_eq!(
        cluster,
        ["get nodes", "list nodes", "patch nodes", "watch nodes"]
    );
    let objects = objects(KATA, &facts(), Operand::CcManager);
    let policy = objects
        .dynamic
        .iter()
        .find(|d| {
            d.types
                .as_ref()
                .is_some_and(|t| t.kind == "ValidatingAdmissionPolicy")
        })
        .expect("no admission policy");
    assert_eq!(
        policy.metadata.name.as_deref(),
        Some("nvidia-cc-manager-own-node")
    );
    let text = policy.data.to_string();
    assert!(
        text.contains("system:serviceaccount:gpu-operator:nvidia-cc-manager"),
        "{text}"
    );
    assert!(
        text.contains("object.metadata.name == variables.callerNode"),
        "{text}"
    );
    assert!(objects.dynamic.iter().any(|d| {
        d.types
            .as_ref()
            .is_some_and(|t| t.kind == "ValidatingAdmissionPolicyBinding")
            && d.metadata.name.as_deref() == Some("nvidia-cc-manager-own-node")
    }));
}

#[test]
fn the_sandbox_validator_checks_cc_first_whenever_cc_manager_is_enabled_in_either_mode() {
    let init = |spec: &str| -> Vec<String> {
        pod(&daemon_set(spec, &facts(), Operand::SandboxValidator))
            .init_containers
            .into_iter()
            .flatten()
            .map(|c| c.name)
            .collect()
    };
    // Then the workload-type checks, which pass at once on nodes of another type.
    const TYPE_CHECKS: [&str; 3] = [
        "vfio-pci-validation",
        "vgpu-manager-validation",
        "vgpu-devices-validation",
    ];
    let with_cc: Vec<&str> = std::iter::once("cc-manager-validation")
        .chain(TYPE_CHECKS)
        .collect();
    assert_eq!(init(KATA), with_cc);
    // Kept in kubevirt mode, where no CC manager runs, as NVIDIA's operator does.
    assert_eq!(init(&kubevirt()), with_cc);
    assert_eq!(
        init(&KATA.replace("ccManager: {enabled: true", "ccManager: {enabled: false")),
        TYPE_CHECKS
    );
    assert_eq!(
        init("{sandboxWorkloads: {enabled: true, mode: kata}}"),
        TYPE_CHECKS
    );

    let p = pod(&daemon_set(KATA, &facts(), Operand::SandboxValidator));
    let cc = container(&p, "cc-manager-validation");
    assert_eq!(env(&cc, "COMPONENT").as_deref(), Some("cc-manager"));
    assert_eq!(env(&cc, "WITH_WAIT").as_deref(), Some("true"));
    assert_eq!(env(&cc, "DEFAULT_GPU_WORKLOAD_CONFIG"), None);
    assert_eq!(
        mount_path(&cc, "run-nvidia-validations"),
        "/run/nvidia/validations"
    );
}

#[test]
fn on_openshift_the_kata_operands_get_scc_named_after_their_own_service_accounts() {
    let openshift = ClusterFacts {
        openshift: true,
        ..facts()
    };
    for (operand, name) in [
        (
            Operand::KataSandboxDevicePlugin,
            "nvidia-kata-sandbox-device-plugin",
        ),
        // Not NVIDIA's misnamed copy of the VFIO manager's SCC, which admits nothing of it.
        (Operand::CcManager, "nvidia-cc-manager"),
    ] {
        let objects = objects(KATA, &openshift, operand);
        let sccs: Vec<&str> = objects
            .dynamic
            .iter()
            .filter(|d| {
                d.types
                    .as_ref()
                    .is_some_and(|t| t.kind == "SecurityContextConstraints")
            })
            .filter_map(|d| d.metadata.name.as_deref())
            .collect();
        assert_eq!(sccs, [name], "{operand:?}");
        let scc = objects
            .dynamic
            .iter()
            .find(|d| d.metadata.name.as_deref() == Some(name))
            .unwrap();
        assert!(
            scc.data
                .to_string()
                .contains(&format!("system:serviceaccount:gpu-operator:{name}")),
            "{operand:?}: {}",
            scc.data
        );
        let annotation = objects.daemon_sets[0]
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("openshift.io/scc"))
            .cloned();
        assert_eq!(annotation.as_deref(), Some(name));
    }
}

#[test]
fn without_an_image_the_kata_operands_run_the_versions_nvidia_v26_7_pins() {
    let spec = "{sandboxWorkloads: {enabled: true, mode: kata}, kataSandboxDevicePlugin: \
        {enabled: true}, ccManager: {enabled: true}}";
    for (operand, container, image) in [
        (
            Operand::KataSandboxDevicePlugin,
            "nvidia-kata-sandbox-device-plugin-ctr",
            "nvcr.io/nvidia/cloud-native/nvidia-sandbox-device-plugin:v0.0.5",
        ),
        (
            Operand::CcManager,
            "nvidia-cc-manager",
            "nvcr.io/nvidia/cloud-native/k8s-cc-manager:v0.4.3",
        ),
    ] {
        let ds = daemon_set(spec, &facts(), operand);
        let pod = pod(&ds);
        let main = pod
            .containers
            .iter()
            .find(|c| c.name == container)
            .unwrap_or_else(|| panic!("{operand:?}: no container {container}"));
        assert_eq!(main.image.as_deref(), Some(image), "{operand:?}");
    }
}
