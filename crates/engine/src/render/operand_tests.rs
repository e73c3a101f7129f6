//! Per-operand render tests: what each operand's pods need (docs/operand-facts.md §5-§15), the
//! cross-cutting rules of §1 as each operand sees them, and hashes that change exactly when
//! the configuration a pod consumes changes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::operands::test_support::*;

// --- disabled operands render nothing ----------------------------------------------------------

#[test]
fn disabled_operands_render_nothing_and_report_disabled() {
    let cases = [
        ("{driver: {enabled: false}}", vec![Operand::Driver]),
        ("{toolkit: {enabled: false}}", vec![Operand::Toolkit]),
        (
            "{devicePlugin: {enabled: false}}",
            vec![Operand::DevicePlugin, Operand::MpsControlDaemon],
        ),
        ("{gfd: {enabled: false}}", vec![Operand::Gfd]),
        ("{dcgm: {enabled: false}}", vec![Operand::Dcgm]),
        (
            "{dcgmExporter: {enabled: false}}",
            vec![Operand::DcgmExporter],
        ),
        ("{migManager: {enabled: false}}", vec![Operand::MigManager]),
        ("{nfd: {enabled: false}}", vec![Operand::Nfd]),
        (
            "{cdi: {enabled: true, nriPluginEnabled: true}}",
            vec![Operand::RuntimeClasses],
        ),
        ("{}", vec![Operand::NodeStatusExporter]),
    ];
    for (spec, off) in cases {
        let s = state(spec, &facts());
        for op_state in &s.operands {
            let disabled = matches!(op_state.outcome, Outcome::Disabled);
            // The node-status exporter, the operator's ServiceMonitor and the virtual machine
            // operands are off unless asked for.
            let expected = off.contains(&op_state.operand)
                || matches!(
                    op_state.operand,
                    Operand::NodeStatusExporter
                        | Operand::OperatorMetrics
                        | Operand::SandboxValidator
                        | Operand::VfioManager
                        | Operand::SandboxDevicePlugin
                        | Operand::VgpuManager
                        | Operand::VgpuDeviceManager
                        | Operand::KataSandboxDevicePlugin
                        | Operand::CcManager
                );
            assert_eq!(disabled, expected, "{spec}: {}", op_state.operand.name());
        }
    }
    let nfd = state(
        "{}",
        &ClusterFacts {
            nfd_running: true,
            ..facts()
        },
    );
    let nfd = nfd
        .operands
        .iter()
        .find(|o| o.operand == Operand::Nfd)
        .unwrap();
    assert!(matches!(nfd.outcome, Outcome::Disabled));
}

#[test]
fn invalid_operand_is_reported_and_the_others_render() {
    let s = state("{gfd: {repository: r.local, image: gfd}}", &facts());
    for op_state in &s.operands {
        match (&op_state.outcome, op_state.operand) {
            (Outcome::Invalid(message), Operand::Gfd) => assert!(message.contains("spec.gfd")),
            (Outcome::Invalid(m), other) => panic!("{} invalid: {m}", other.name()),
            _ => {}
        }
    }
    assert!(
        s.to_yaml()
            .unwrap()
            .starts_with("# gpu-feature-discovery not rendered (invalid input): spec.gfd")
    );
}

// --- cross-cutting rules -----------------------------------------------------------------------

#[test]
fn daemonsets_tolerations_replace_the_default_and_priority_class_follows_the_policy() {
    let ds = daemon_set("{}", &facts(), Operand::DevicePlugin);
    let tolerations = pod(&ds).tolerations.unwrap();
    assert_eq!(tolerations, vec![common::gpu_toleration()]);
    assert_eq!(
        pod(&ds).priority_class_name.as_deref(),
        Some("system-node-critical")
    );

    let ds = daemon_set(
        "{daemonsets: {tolerations: [{key: dedicated, operator: Exists}], priorityClassName: gpu-critical}}",
        &facts(),
        Operand::DevicePlugin,
    );
    let tolerations = pod(&ds).tolerations.unwrap();
    assert_eq!(tolerations.len(), 1);
    assert_eq!(tolerations[0].key.as_deref(), Some("dedicated"));
    assert_eq!(
        pod(&ds).priority_class_name.as_deref(),
        Some("gpu-critical")
    );
}

#[test]
fn update_strategy_rolling_with_max_unavailable_but_driver_always_on_delete() {
    let spec =
        "{daemonsets: {updateStrategy: RollingUpdate, rollingUpdate: {maxUnavailable: '1'}}}";
    let plugin = daemon_set(spec, &facts(), Operand::DevicePlugin)
        .spec
        .unwrap()
        .update_strategy
        .unwrap();
    assert_eq!(plugin.type_.as_deref(), Some("RollingUpdate"));
    assert_eq!(
        plugin.rolling_update.unwrap().max_unavailable,
        Some(IntOrString::Int(1))
    );
    let percent = daemon_set(
        "{daemonsets: {rollingUpdate: {maxUnavailable: 10%}}}",
        &facts(),
        Operand::Gfd,
    )
    .spec
    .unwrap()
    .update_strategy
    .unwrap();
    assert_eq!(
        percent.rolling_update.unwrap().max_unavailable,
        Some(IntOrString::String("10%".to_owned()))
    );
    let driver = daemon_set(spec, &facts(), Operand::Driver)
        .spec
        .unwrap()
        .update_strategy
        .unwrap();
    assert_eq!(driver.type_.as_deref(), Some("OnDelete"));
    let all = daemon_set(
        "{daemonsets: {updateStrategy: OnDelete}}",
        &facts(),
        Operand::Validator,
    )
    .spec
    .unwrap()
    .update_strategy
    .unwrap();
    assert_eq!(all.type_.as_deref(), Some("OnDelete"));
}

#[test]
fn user_labels_and_annotations_reach_daemonset_and_pods_but_never_selector_keys() {
    let spec = "{daemonsets: {labels: {team: gpu, app: evil, app.kubernetes.io/part-of: evil}, annotations: {a: b}}}";
    let ds = daemon_set(spec, &facts(), Operand::Validator);
    let labels = ds.metadata.labels.clone().unwrap();
    assert_eq!(labels["team"], "gpu");
    assert_eq!(labels["app"], "nvidia-operator-validator");
    assert_eq!(labels["app.kubernetes.io/part-of"], "gpu-operator");
    let template = ds.spec.clone().unwrap().template.metadata.unwrap();
    assert_eq!(template.labels.as_ref().unwrap()["team"], "gpu");
    assert_eq!(
        template.labels.as_ref().unwrap()["app"],
        "nvidia-operator-validator"
    );
    assert_eq!(ds.metadata.annotations.unwrap()["a"], "b");
    assert_eq!(template.annotations.unwrap()["a"], "b");
}

#[test]
fn pull_secrets_are_deduplicated_and_include_the_validators_for_validation_init_containers() {
    let spec = "{devicePlugin: {imagePullSecrets: [a, b, a], imagePullPolicy: Always}, \
                validator: {imagePullSecrets: [b, c], imagePullPolicy: Never}}";
    let p = pod(&daemon_set(spec, &facts(), Operand::DevicePlugin));
    let names: Vec<String> = p
        .image_pull_secrets
        .clone()
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["a", "b", "c"]);
    assert_eq!(
        container(&p, "nvidia-device-plugin")
            .image_pull_policy
            .as_deref(),
        Some("Always")
    );
    assert_eq!(
        container(&p, "toolkit-validation")
            .image_pull_policy
            .as_deref(),
        Some("Never")
    );
    let odd = pod(&daemon_set(
        "{gfd: {imagePullPolicy: Sometimes}}",
        &facts(),
        Operand::Gfd,
    ));
    assert_eq!(
        container(&odd, "gpu-feature-discovery")
            .image_pull_policy
            .as_deref(),
        Some("IfNotPresent")
    );
}

#[test]
fn resources_go_to_every_regular_container_and_args_replace_the_main_containers() {
    let spec = "{devicePlugin: {config: {name: device-plugin-config, default: default}, \
                resources: {limits: {memory: 1Gi}}, args: [--x]}, validator: {resources: {limits: {cpu: '1'}}}}";
    let p = pod(&daemon_set(
        spec,
        &sharing(&[("default", TS4)]),
        Operand::DevicePlugin,
    ));
    for name in ["nvidia-device-plugin", "config-manager"] {
        let limits = container(&p, name).resources.unwrap().limits.unwrap();
        assert_eq!(limits["memory"].0, "1Gi", "{name}");
    }
    let validation = container(&p, "toolkit-validation")
        .resources
        .unwrap()
        .limits
        .unwrap();
    assert_eq!(validation["cpu"].0, "1");
    assert_eq!(container(&p, "nvidia-device-plugin").args.unwrap(), ["--x"]);
    assert_eq!(container(&p, "config-manager").args, None);
}

#[test]
fn user_env_is_set_or_appended_on_the_main_container_and_wins() {
    let spec =
        "{devicePlugin: {env: [{name: DEVICE_LIST_STRATEGY, value: envvar}, {name: EXTRA}]}}";
    let c = container(
        &pod(&daemon_set(spec, &facts(), Operand::DevicePlugin)),
        "nvidia-device-plugin",
    );
    assert_eq!(env(&c, "DEVICE_LIST_STRATEGY").as_deref(), Some("envvar"));
    assert_eq!(env(&c, "EXTRA").as_deref(), Some(""));
    let names = env_names(&c);
    assert_eq!(
        names
            .iter()
            .filter(|n| *n == "DEVICE_LIST_STRATEGY")
            .count(),
        1
    );
    assert_eq!(names.last().map(String::as_str), Some("EXTRA"));
}

#[test]
fn host_network_sets_the_dns_policy_that_keeps_cluster_dns() {
    let p = pod(&daemon_set(
        "{dcgm: {hostNetwork: true}}",
        &facts(),
        Operand::Dcgm,
    ));
    assert_eq!(p.host_network, Some(true));
    assert_eq!(p.dns_policy.as_deref(), Some("ClusterFirstWithHostNet"));
}

#[test]
fn host_network_reaches_every_operand_that_has_the_field() {
    let cases = [
        ("driver", Operand::Driver),
        ("toolkit", Operand::Toolkit),
        ("devicePlugin", Operand::DevicePlugin),
        ("gfd", Operand::Gfd),
        ("dcgm", Operand::Dcgm),
        ("dcgmExporter", Operand::DcgmExporter),
        ("migManager", Operand::MigManager),
        ("nodeStatusExporter", Operand::NodeStatusExporter),
        ("validator", Operand::Validator),
    ];
    for (section, operand) in cases {
        let on = format!("{{{section}: {{enabled: true, hostNetwork: true}}}}");
        let off = format!("{{{section}: {{enabled: true}}}}");
        assert_eq!(
            pod(&daemon_set(&on, &facts(), operand)).host_network,
            Some(true),
            "{section}.hostNetwork: true"
        );
        assert_eq!(
            pod(&daemon_set(&off, &facts(), operand)).host_network,
            None,
            "{section} without hostNetwork"
        );
    }
}

#[test]
fn validation_init_containers_get_validator_image_root_and_step_env() {
    let spec = "{validator: {repository: r.local, image: validator, version: v9, \
                driver: {env: [{name: DISABLE_DEV_CHAR_SYMLINK_CREATION, value: 'true'}]}, \
                toolkit: {env: [{name: T, value: '1'}]}}}";
    let f = facts();
    let toolkit_pod = pod(&daemon_set(spec, &f, Operand::Toolkit));
    let driver_validation = container(&toolkit_pod, "driver-validation");
    assert_eq!(
        driver_validation.image.as_deref(),
        Some("r.local/validator:v9")
    );
    assert_eq!(
        driver_validation
            .security_context
            .clone()
            .unwrap()
            .run_as_user,
        Some(0)
    );
    assert_eq!(
        env(&driver_validation, "DISABLE_DEV_CHAR_SYMLINK_CREATION").as_deref(),
        Some("true")
    );
    let wait = container(
        &pod(&daemon_set(spec, &f, Operand::Gfd)),
        "toolkit-validation",
    );
    assert_eq!(wait.image.as_deref(), Some("r.local/validator:v9"));
    assert_eq!(env(&wait, "T").as_deref(), Some("1"));
}

#[test]
fn runtime_class_is_set_on_gpu_operands_except_with_nri_or_crio_without_cdi() {
    let gpu_operands = [
        Operand::Validator,
        Operand::DevicePlugin,
        Operand::MpsControlDaemon,
        Operand::Gfd,
        Operand::Dcgm,
        Operand::DcgmExporter,
        Operand::MigManager,
    ];
    let spec = "{nodeStatusExporter: {enabled: true}, operator: {runtimeClass: nvidia-gpu}}";
    let s = state(spec, &facts());
    for op in Operand::ALL {
        for ds in &rendered_or_empty(&s, op).daemon_sets {
            let rc = pod(ds).runtime_class_name;
            if gpu_operands.contains(&op) {
                assert_eq!(rc.as_deref(), Some("nvidia-gpu"), "{}", op.name());
            } else {
                assert_eq!(rc, None, "{}", op.name());
            }
        }
    }
    let crio = ClusterFacts {
        runtime: Runtime::CriO,
        ..facts()
    };
    assert_eq!(
        pod(&daemon_set("{cdi: {enabled: false}}", &crio, Operand::Gfd)).runtime_class_name,
        None
    );
    assert!(
        pod(&daemon_set("{}", &crio, Operand::Gfd))
            .runtime_class_name
            .is_some()
    );
    let nri = "{cdi: {enabled: true, nriPluginEnabled: true}}";
    let ds = daemon_set(nri, &facts(), Operand::DevicePlugin);
    assert_eq!(pod(&ds).runtime_class_name, None);
    assert_eq!(
        template_annotations(&ds)["nvidia.cdi.k8s.io/container.nvidia-device-plugin"],
        "management.nvidia.com/gpu=all"
    );
    let validator = daemon_set(nri, &facts(), Operand::Validator);
    assert!(
        template_annotations(&validator)
            .contains_key("nvidia.cdi.k8s.io/container.toolkit-validation")
    );
}

fn rendered_or_empty(s: &DesiredState, op: Operand) -> OperandObjects {
    s.operands
        .iter()
        .find(|o| o.operand == op)
        .and_then(|o| match &o.outcome {
            Outcome::Rendered(objects) => Some(objects.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

#[test]
fn mig_env_follows_the_strategy_on_plugin_mps_and_gfd() {
    let cases = [
        ("{}", None, Some("all")),
        ("{mig: {strategy: none}}", Some("none"), None),
        ("{mig: {strategy: single}}", Some("single"), Some("all")),
        ("{mig: {strategy: mixed}}", Some("mixed"), Some("all")),
    ];
    for (spec, strategy, monitor) in cases {
        for (op, main) in [
            (Operand::DevicePlugin, "nvidia-device-plugin"),
            (Operand::MpsControlDaemon, "mps-control-daemon-ctr"),
            (Operand::Gfd, "gpu-feature-discovery"),
        ] {
            let c = container(&pod(&daemon_set(spec, &facts(), op)), main);
            assert_eq!(
                env(&c, "MIG_STRATEGY").as_deref(),
                strategy,
                "{spec} {main}"
            );
            assert_eq!(
                env(&c, "NVIDIA_MIG_MONITOR_DEVICES").as_deref(),
                monitor,
                "{spec} {main}"
            );
        }
    }
}

#[test]
fn custom_host_paths_move_volumes_and_driver_validation_but_not_mount_paths() {
    let spec = "{hostPaths: {rootFS: /host-root, driverInstallDir: /opt/nvidia/driver, kubeletRootDir: /data/kubelet}}";
    let p = pod(&daemon_set(spec, &facts(), Operand::Toolkit));
    assert_eq!(host_path(&p, "host-root").0, "/host-root");
    assert_eq!(host_path(&p, "host-dev-char").0, "/host-root/dev/char");
    assert_eq!(host_path(&p, "driver-install-dir").0, "/opt/nvidia/driver");
    for c in p.init_containers.iter().flatten().chain(&p.containers) {
        assert_eq!(
            env(c, "HOST_ROOT").as_deref(),
            Some("/host-root"),
            "{}",
            c.name
        );
    }
    let validation = container(&p, "driver-validation");
    assert_eq!(
        env(&validation, "DRIVER_INSTALL_DIR").as_deref(),
        Some("/opt/nvidia/driver")
    );
    assert_eq!(
        mount_path(&validation, "driver-install-dir"),
        "/opt/nvidia/driver"
    );
    assert_eq!(
        mount_path(
            &container(&p, "nvidia-container-toolkit-ctr"),
            "driver-install-dir"
        ),
        "/driver-root"
    );
    assert_eq!(
        mount_path(&container(&p, "nvidia-container-toolkit-ctr"), "host-root"),
        "/host"
    );
    let exporter = pod(&daemon_set(spec, &facts(), Operand::DcgmExporter));
    assert_eq!(
        host_path(&exporter, "pod-gpu-resources").0,
        "/data/kubelet/pod-resources"
    );
    // The device plugin's kubelet socket directory stays where NVIDIA keeps it.
    let plugin = pod(&daemon_set(spec, &facts(), Operand::DevicePlugin));
    assert_eq!(
        host_path(&plugin, "device-plugin").0,
        "/var/lib/kubelet/device-plugins"
    );
}

#[test]
fn owner_reference_from_the_facts_is_a_blocking_controller_reference() {
    let owner = k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
        api_version: "nvidia.com/v1".to_owned(),
        kind: "ClusterPolicy".to_owned(),
        name: "p".to_owned(),
        uid: "u".to_owned(),
        controller: Some(false),
        block_owner_deletion: None,
    };
    let f = ClusterFacts {
        owner: Some(owner),
        ..facts()
    };
    let ds = daemon_set("{}", &f, Operand::Gfd);
    let refs = ds.metadata.owner_references.unwrap();
    assert_eq!(refs[0].controller, Some(true));
    assert_eq!(refs[0].block_owner_deletion, Some(true));
}

// --- hashing -------------------------------------------------------------------------------------

#[test]
fn config_hash_is_sha256_over_length_prefixed_keys_and_values() {
    let data: BTreeMap<String, String> = [("a".to_owned(), "b".to_owned())].into();
    // 8-byte big-endian lengths: 1 "a" 1 "b".
    let mut bytes = Vec::new();
    bytes.extend(1u64.to_be_bytes());
    bytes.extend(b"a");
    bytes.extend(1u64.to_be_bytes());
    bytes.extend(b"b");
    assert_eq!(common::config_hash(&data), common::sha256_hex(&bytes));
    assert_eq!(
        common::sha256_hex(b"abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    // Moving a character between key and value changes the hash.
    let other: BTreeMap<String, String> = [("ab".to_owned(), String::new())].into();
    assert_ne!(common::config_hash(&data), common::config_hash(&other));
}

#[test]
fn policy_helper_resolves_images() {
    assert!(policy("{}").invalid.is_empty());
}
