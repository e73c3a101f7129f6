//! Per-operand render tests: what each operand's pods need (docs/operand-facts.md §5-§15), the
//! cross-cutting rules of §1 as each operand sees them, and hashes that change exactly when
//! the configuration a pod consumes changes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Container, PodSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::tests::{facts, policy, policy_with, rendered};
use super::{DesiredState, Outcome, render};
use crate::facts::{ClusterFacts, ConfigMapData, Runtime};
use crate::model::{CONFIG_HASH_ANNOTATION, Operand, OperandObjects};
use crate::operands::common;

fn state(spec: &str, facts: &ClusterFacts) -> DesiredState {
    render(&policy_with(spec, facts), facts)
}

fn objects(spec: &str, facts: &ClusterFacts, operand: Operand) -> OperandObjects {
    rendered(&state(spec, facts), operand)
}

fn daemon_set(spec: &str, facts: &ClusterFacts, operand: Operand) -> DaemonSet {
    objects(spec, facts, operand).daemon_sets.remove(0)
}

fn pod(ds: &DaemonSet) -> PodSpec {
    ds.spec.clone().unwrap().template.spec.unwrap()
}

fn template_annotations(ds: &DaemonSet) -> BTreeMap<String, String> {
    ds.spec
        .clone()
        .unwrap()
        .template
        .metadata
        .unwrap()
        .annotations
        .unwrap_or_default()
}

fn container(pod: &PodSpec, name: &str) -> Container {
    pod.init_containers
        .iter()
        .flatten()
        .chain(&pod.containers)
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
        .clone()
}

fn has_container(pod: &PodSpec, name: &str) -> bool {
    pod.init_containers
        .iter()
        .flatten()
        .chain(&pod.containers)
        .any(|c| c.name == name)
}

fn env(c: &Container, name: &str) -> Option<String> {
    c.env
        .iter()
        .flatten()
        .find(|e| e.name == name)
        .and_then(|e| e.value.clone())
}

fn env_names(c: &Container) -> Vec<String> {
    c.env.iter().flatten().map(|e| e.name.clone()).collect()
}

fn host_path(pod: &PodSpec, volume: &str) -> (String, Option<String>) {
    let v = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == volume)
        .unwrap_or_else(|| panic!("no volume {volume}"));
    let hp = v.host_path.clone().unwrap();
    (hp.path, hp.type_)
}

fn mount_path(c: &Container, volume: &str) -> String {
    c.volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == volume)
        .unwrap()
        .mount_path
        .clone()
}

fn sharing(data: &[(&str, &str)]) -> ClusterFacts {
    ClusterFacts {
        sharing_source: Some(ConfigMapData {
            name: "device-plugin-config".to_owned(),
            data: data
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }),
        ..facts()
    }
}

const SHARED: &str = "{devicePlugin: {config: {name: device-plugin-config, default: default}}}";
const TS4: &str = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n";
const TS8: &str = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 8\n";

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
            "{driver: {useNvidiaDriverCRD: true}}",
            vec![Operand::Driver],
        ),
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
            // The node-status exporter is off unless switched on.
            let expected =
                off.contains(&op_state.operand) || op_state.operand == Operand::NodeStatusExporter;
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
    assert!(matches!(nfd.operands[1].outcome, Outcome::Disabled));
    assert_eq!(nfd.operands[1].operand, Operand::Nfd);
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

// --- driver --------------------------------------------------------------------------------------

#[test]
fn driver_pod_has_manager_init_startup_probe_host_pid_and_os_suffixed_image() {
    let ds = daemon_set("{}", &facts(), Operand::Driver);
    let p = pod(&ds);
    assert_eq!(p.host_pid, Some(true));
    assert_eq!(p.runtime_class_name, None);
    assert_eq!(
        p.init_containers.as_ref().unwrap()[0].name,
        "k8s-driver-manager"
    );
    let main = container(&p, "nvidia-driver-ctr");
    assert_eq!(
        main.image.as_deref(),
        Some("nvcr.io/nvidia/driver:595.91.07-ubuntu22.04")
    );
    let probe = main.startup_probe.clone().unwrap();
    assert_eq!(
        (
            probe.initial_delay_seconds,
            probe.period_seconds,
            probe.timeout_seconds,
            probe.failure_threshold
        ),
        (Some(60), Some(10), Some(60), Some(120))
    );
    assert_eq!(mount_path(&main, "run-nvidia"), "/run/nvidia");
    assert_eq!(
        main.volume_mounts
            .unwrap()
            .iter()
            .find(|m| m.name == "run-nvidia")
            .unwrap()
            .mount_propagation
            .as_deref(),
        Some("Bidirectional")
    );
    assert_eq!(
        host_path(&p, "run-nvidia"),
        (
            "/run/nvidia".to_owned(),
            Some("DirectoryOrCreate".to_owned())
        )
    );
    assert_eq!(host_path(&p, "host-sys").1.as_deref(), Some("Directory"));
    let manager = container(&p, "k8s-driver-manager");
    assert_eq!(
        env(&manager, "NVIDIA_VISIBLE_DEVICES").as_deref(),
        Some("void")
    );
    assert!(env(&manager, "DRIVER_CONFIG_DIGEST").is_some());
    assert_eq!(
        env(&manager, "DRIVER_CONFIG_DIGEST"),
        env(&container(&p, "nvidia-driver-ctr"), "DRIVER_CONFIG_DIGEST")
    );
    assert!(!has_container(&p, "nvidia-peermem-ctr"));
    let selector = ds.spec.unwrap().selector.match_labels.unwrap();
    assert_eq!(
        selector,
        common::string_map(&[("app", "nvidia-driver-daemonset")])
    );
    let objects = objects("{}", &facts(), Operand::Driver);
    assert_eq!(
        objects.config_maps[0].metadata.name.as_deref(),
        Some("nvidia-driver-startup-probe")
    );
    assert!(
        objects.config_maps[0].data.as_ref().unwrap()["startup-probe.sh"]
            .contains(".driver-ctr-ready")
    );
}

#[test]
fn driver_probe_overrides_rdma_sidecar_and_digest_changes_with_driver_settings() {
    let spec = "{driver: {startupProbe: {initialDelaySeconds: 5, failureThreshold: 3}, rdma: {enabled: true, useHostMofed: true}}}";
    let p = pod(&daemon_set(spec, &facts(), Operand::Driver));
    let probe = container(&p, "nvidia-driver-ctr").startup_probe.unwrap();
    assert_eq!(
        (
            probe.initial_delay_seconds,
            probe.failure_threshold,
            probe.period_seconds
        ),
        (Some(5), Some(3), Some(10))
    );
    assert!(has_container(&p, "nvidia-peermem-ctr"));
    assert_eq!(host_path(&p, "mlnx-ofed-usr-src").0, "/usr/src");
    assert_eq!(
        env(&container(&p, "nvidia-driver-ctr"), "USE_HOST_MOFED").as_deref(),
        Some("true")
    );

    let digest = |spec: &str| {
        env(
            &container(
                &pod(&daemon_set(spec, &facts(), Operand::Driver)),
                "k8s-driver-manager",
            ),
            "DRIVER_CONFIG_DIGEST",
        )
    };
    assert_eq!(digest("{}"), digest("{}"));
    assert_ne!(
        digest("{}"),
        digest("{driver: {env: [{name: X, value: '1'}]}}")
    );
    assert_ne!(
        digest("{}"),
        digest("{driver: {repository: nvcr.io/nvidia, image: driver, version: '580.1'}}")
    );
    // Scheduling settings do not reinstall the driver.
    assert_eq!(
        digest("{}"),
        digest("{daemonsets: {priorityClassName: other}}")
    );
}

#[test]
fn driver_is_invalid_without_os_and_absent_with_the_nvidia_driver_crd() {
    let s = state(
        "{}",
        &ClusterFacts {
            os_tag: None,
            ..facts()
        },
    );
    assert!(matches!(&s.operands[2].outcome, Outcome::Invalid(m) if m.contains("OS suffix")));
    let s = state("{driver: {useNvidiaDriverCRD: true}}", &facts());
    assert!(matches!(s.operands[2].outcome, Outcome::Disabled));
}

// --- container toolkit ---------------------------------------------------------------------------

fn toolkit(spec: &str, runtime: Runtime) -> (PodSpec, Container) {
    let f = ClusterFacts { runtime, ..facts() };
    let p = pod(&daemon_set(spec, &f, Operand::Toolkit));
    let main = container(&p, "nvidia-container-toolkit-ctr");
    (p, main)
}

#[test]
fn toolkit_configures_containerd_through_its_config_dirs_and_socket() {
    let (p, c) = toolkit("{}", Runtime::Containerd);
    assert_eq!(env(&c, "RUNTIME").as_deref(), Some("containerd"));
    assert_eq!(
        env(&c, "CONTAINERD_CONFIG").as_deref(),
        Some("/runtime/config-dir/config.toml")
    );
    assert_eq!(
        env(&c, "RUNTIME_CONFIG").as_deref(),
        Some("/runtime/config-dir/config.toml")
    );
    assert_eq!(
        env(&c, "RUNTIME_DROP_IN_CONFIG").as_deref(),
        Some("/runtime/config-dir.d/99-nvidia.toml")
    );
    assert_eq!(
        env(&c, "RUNTIME_DROP_IN_CONFIG_HOST_PATH").as_deref(),
        Some("/etc/containerd/conf.d/99-nvidia.toml")
    );
    assert_eq!(
        env(&c, "CONTAINERD_SOCKET").as_deref(),
        Some("/runtime/sock-dir/containerd.sock")
    );
    assert_eq!(
        env(&c, "CONTAINERD_RUNTIME_CLASS").as_deref(),
        Some("nvidia")
    );
    assert_eq!(env(&c, "CDI_ENABLED").as_deref(), Some("true"));
    assert_eq!(
        env(&c, "NVIDIA_CONTAINER_RUNTIME_MODE").as_deref(),
        Some("cdi")
    );
    assert_eq!(env(&c, "NVIDIA_VISIBLE_DEVICES").as_deref(), Some("void"));
    assert_eq!(host_path(&p, "containerd-config").0, "/etc/containerd");
    assert_eq!(
        host_path(&p, "containerd-drop-in-config").0,
        "/etc/containerd/conf.d"
    );
    assert_eq!(
        host_path(&p, "containerd-socket"),
        ("/run/containerd".to_owned(), None)
    );
    assert_eq!(mount_path(&c, "containerd-socket"), "/runtime/sock-dir/");
    assert_eq!(p.host_pid, Some(true));
    assert_eq!(p.runtime_class_name, None);
    assert_eq!(p.init_containers.unwrap()[0].name, "driver-validation");
}

#[test]
fn toolkit_reads_user_host_paths_before_pointing_the_toolkit_at_container_paths() {
    let spec = "{toolkit: {env: [{name: CONTAINERD_CONFIG, value: /var/lib/rancher/k3s/agent/etc/containerd/config.toml}, \
                {name: CONTAINERD_SOCKET, value: /run/k3s/containerd/containerd.sock}, \
                {name: RUNTIME_CONFIG_SOURCE, value: 'command,file=/etc/containerd/config.toml'}]}}";
    let (p, c) = toolkit(spec, Runtime::Containerd);
    assert_eq!(
        host_path(&p, "containerd-config").0,
        "/var/lib/rancher/k3s/agent/etc/containerd"
    );
    assert_eq!(host_path(&p, "containerd-socket").0, "/run/k3s/containerd");
    assert_eq!(
        env(&c, "CONTAINERD_CONFIG").as_deref(),
        Some("/runtime/config-dir/config.toml")
    );
    assert_eq!(
        env(&c, "RUNTIME_CONFIG_SOURCE").as_deref(),
        Some("command,file=/host/etc/containerd/config.toml")
    );
}

#[test]
fn toolkit_configures_crio_without_a_socket_and_with_a_hook_when_cdi_is_off() {
    let (p, c) = toolkit("{}", Runtime::CriO);
    assert_eq!(env(&c, "RUNTIME").as_deref(), Some("crio"));
    assert_eq!(
        env(&c, "CRIO_CONFIG").as_deref(),
        Some("/runtime/config-dir/config.toml")
    );
    assert_eq!(env(&c, "CRIO_CONFIG_MODE").as_deref(), Some("config"));
    assert_eq!(env(&c, "CONTAINERD_RUNTIME_CLASS"), None);
    assert_eq!(env(&c, "RUNTIME_SOCKET"), None);
    assert_eq!(
        host_path(&p, "crio-drop-in-config").0,
        "/etc/crio/crio.conf.d"
    );
    assert_eq!(
        host_path(&p, "crio-hooks").0,
        "/usr/share/containers/oci/hooks.d"
    );
    let (_, c) = toolkit("{cdi: {enabled: false}}", Runtime::CriO);
    assert_eq!(env(&c, "CRIO_CONFIG_MODE").as_deref(), Some("hook"));
    assert_eq!(env(&c, "CDI_ENABLED"), None);
}

#[test]
fn toolkit_configures_docker_through_daemon_json_and_its_socket() {
    let (p, c) = toolkit("{}", Runtime::Docker);
    assert_eq!(env(&c, "RUNTIME").as_deref(), Some("docker"));
    assert_eq!(
        env(&c, "DOCKER_CONFIG").as_deref(),
        Some("/runtime/config-dir/daemon.json")
    );
    assert_eq!(
        env(&c, "DOCKER_SOCKET").as_deref(),
        Some("/runtime/sock-dir/docker.sock")
    );
    assert_eq!(host_path(&p, "docker-socket").0, "/var/run");
    assert!(
        !p.volumes
            .unwrap()
            .iter()
            .any(|v| v.name.contains("drop-in"))
    );
}

#[test]
fn toolkit_with_nri_mounts_only_the_nri_socket() {
    let (p, c) = toolkit(
        "{cdi: {enabled: true, nriPluginEnabled: true}}",
        Runtime::Containerd,
    );
    assert_eq!(env(&c, "ENABLE_NRI_PLUGIN").as_deref(), Some("true"));
    assert_eq!(
        env(&c, "NRI_SOCKET").as_deref(),
        Some("/runtime/nri-sock-dir/nri.sock")
    );
    assert_eq!(env(&c, "CONTAINERD_RUNTIME_CLASS"), None);
    assert_eq!(host_path(&p, "nri-socket").0, "/var/run/nri");
    assert!(
        !p.volumes
            .unwrap()
            .iter()
            .any(|v| v.name.starts_with("containerd"))
    );
}

#[test]
fn toolkit_install_dir_moves_root_and_the_cdi_hook_path_of_its_consumers() {
    let spec = "{toolkit: {installDir: /opt/nvidia}}";
    let (p, c) = toolkit(spec, Runtime::Containerd);
    assert_eq!(env(&c, "ROOT").as_deref(), Some("/opt/nvidia"));
    assert_eq!(host_path(&p, "toolkit-install-dir").0, "/opt/nvidia");
    let plugin = container(
        &pod(&daemon_set(spec, &facts(), Operand::DevicePlugin)),
        "nvidia-device-plugin",
    );
    assert_eq!(
        env(&plugin, "NVIDIA_CDI_HOOK_PATH").as_deref(),
        Some("/opt/nvidia/toolkit/nvidia-cdi-hook")
    );
    let mig = container(
        &pod(&daemon_set(spec, &facts(), Operand::MigManager)),
        "nvidia-mig-manager",
    );
    assert_eq!(
        env(&mig, "NVIDIA_CDI_HOOK_PATH").as_deref(),
        Some("/opt/nvidia/toolkit/nvidia-cdi-hook")
    );
    let no_toolkit = container(
        &pod(&daemon_set(
            "{toolkit: {enabled: false}}",
            &facts(),
            Operand::DevicePlugin,
        )),
        "nvidia-device-plugin",
    );
    assert_eq!(env(&no_toolkit, "NVIDIA_CDI_HOOK_PATH"), None);
}

// --- validator -----------------------------------------------------------------------------------

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

// --- device plugin, MPS, GFD and the sharing config (decision 4) -------------------------------

#[test]
fn without_a_sharing_config_no_consumer_runs_config_manager() {
    // Named in the policy, but no valid config in the facts: no config-manager (decision 4).
    for facts in [facts(), sharing(&[("default", TS4)])] {
        let spec = if facts.sharing_source.is_some() {
            "{}"
        } else {
            SHARED
        };
        for op in [
            Operand::DevicePlugin,
            Operand::MpsControlDaemon,
            Operand::Gfd,
        ] {
            let ds = daemon_set(spec, &facts, op);
            let p = pod(&ds);
            assert!(!has_container(&p, "config-manager"), "{}", op.name());
            assert!(!has_container(&p, "config-manager-init"), "{}", op.name());
            assert_eq!(p.share_process_namespace, None);
            assert!(!template_annotations(&ds).contains_key(CONFIG_HASH_ANNOTATION));
        }
    }
}

#[test]
fn sharing_config_is_mounted_as_an_immutable_hashed_copy_by_all_three_consumers() {
    let f = sharing(&[("default", TS4), ("eight", TS8)]);
    let plugin = objects(SHARED, &f, Operand::DevicePlugin);
    let copy = plugin
        .config_maps
        .iter()
        .find(|c| c.immutable == Some(true))
        .unwrap();
    let copy_name = copy.metadata.name.clone().unwrap();
    let hash = common::config_hash(copy.data.as_ref().unwrap());
    assert_eq!(copy_name, format!("device-plugin-config-{}", &hash[..10]));
    assert_eq!(copy.data.as_ref().unwrap().len(), 2);
    for (op, process, signal) in [
        (
            Operand::DevicePlugin,
            "nvidia-device-plugin",
            "nvidia-device-plugin",
        ),
        (
            Operand::Gfd,
            "gpu-feature-discovery",
            "gpu-feature-discovery",
        ),
        (
            Operand::MpsControlDaemon,
            "mps-control-daemon-ctr",
            "/usr/bin/mps-control-daemon",
        ),
    ] {
        let ds = daemon_set(SHARED, &f, op);
        let p = pod(&ds);
        assert_eq!(
            template_annotations(&ds)[CONFIG_HASH_ANNOTATION],
            hash,
            "{}",
            op.name()
        );
        let volume = p
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == "available-configs")
            .unwrap();
        assert_eq!(volume.config_map.as_ref().unwrap().name, copy_name);
        assert_eq!(
            env(&container(&p, process), "CONFIG_FILE").as_deref(),
            Some("/config/config.yaml")
        );
        let init = container(&p, "config-manager-init");
        assert_eq!(
            init.image.as_deref(),
            Some("nvcr.io/nvidia/k8s-device-plugin:v0.20.0")
        );
        assert_eq!(env(&init, "ONESHOT").as_deref(), Some("true"));
        assert_eq!(env(&init, "DEFAULT_CONFIG").as_deref(), Some("default"));
        assert_eq!(env(&init, "FALLBACK_STRATEGIES").as_deref(), Some("empty"));
        assert_eq!(
            env(&init, "CONFIG_FILE_SRCDIR").as_deref(),
            Some("/available-configs")
        );
        assert_eq!(
            env(&init, "CONFIG_FILE_DST").as_deref(),
            Some("/config/config.yaml")
        );
        let sidecar = container(&p, "config-manager");
        assert_eq!(env(&sidecar, "ONESHOT").as_deref(), Some("false"));
        assert_eq!(env(&sidecar, "SIGNAL").as_deref(), Some("1"));
        assert_eq!(env(&sidecar, "PROCESS_TO_SIGNAL").as_deref(), Some(signal));
        if op == Operand::MpsControlDaemon {
            // Host PIDs instead of a shared namespace; argv[0] is the absolute path.
            assert_eq!(p.host_pid, Some(true));
            assert_eq!(p.share_process_namespace, None);
            assert_eq!(container(&p, process).command.unwrap(), [signal]);
        } else {
            assert_eq!(p.share_process_namespace, Some(true));
        }
    }
}

#[test]
fn the_copy_a_live_consumer_mounts_is_read_back_with_its_default_key() {
    let facts = sharing(&[("default", TS4), ("big", TS8)]);
    let plugin = objects(SHARED, &facts, Operand::DevicePlugin);
    let copy_name = plugin
        .config_maps
        .iter()
        .find(|c| c.immutable == Some(true))
        .and_then(|c| c.metadata.name.clone())
        .unwrap();
    for op in [
        Operand::DevicePlugin,
        Operand::Gfd,
        Operand::MpsControlDaemon,
    ] {
        let ds = daemon_set(SHARED, &facts, op);
        assert_eq!(
            crate::operands::device_plugin::mounted_copy(&ds),
            Some((copy_name.clone(), "default".to_owned())),
            "{op:?}"
        );
    }
    let plain = daemon_set("{}", &super::tests::facts(), Operand::DevicePlugin);
    assert_eq!(crate::operands::device_plugin::mounted_copy(&plain), None);
}

#[test]
fn sharing_hash_changes_with_content_and_never_with_the_default_key() {
    let hash_with = |spec: &str, f: &ClusterFacts| {
        template_annotations(&daemon_set(spec, f, Operand::DevicePlugin))[CONFIG_HASH_ANNOTATION]
            .clone()
    };
    let hash = |f: &ClusterFacts| hash_with(SHARED, f);
    let four = sharing(&[("default", TS4)]);
    let eight = sharing(&[("default", TS8)]);
    assert_eq!(hash(&four), hash(&sharing(&[("default", TS4)])));
    assert_ne!(hash(&four), hash(&eight));
    let two_keys = sharing(&[("default", TS4), ("x", TS8)]);
    let with_default = hash(&two_keys);
    let default_x = "{devicePlugin: {config: {name: device-plugin-config, default: x}}}";
    assert_eq!(hash_with(default_x, &two_keys), with_default);
}

#[test]
fn gfd_keeps_nvidia_selector_and_orders_user_env_before_config_and_mig() {
    let spec = "{mig: {strategy: single}, devicePlugin: {config: {name: device-plugin-config}}, \
                gfd: {env: [{name: MIG_STRATEGY, value: none}, {name: GFD_SLEEP_INTERVAL, value: 10s}]}}";
    let ds = daemon_set(spec, &sharing(&[("default", TS4)]), Operand::Gfd);
    let selector = ds.spec.clone().unwrap().selector.match_labels.unwrap();
    assert_eq!(selector["app.kubernetes.io/part-of"], "nvidia-gpu");
    let main = container(&pod(&ds), "gpu-feature-discovery");
    // The operator's MIG strategy wins over the user's here, as in NVIDIA's operator.
    assert_eq!(env(&main, "MIG_STRATEGY").as_deref(), Some("single"));
    assert_eq!(env(&main, "GFD_SLEEP_INTERVAL").as_deref(), Some("10s"));
    let openshift = ClusterFacts {
        openshift: true,
        runtime: Runtime::CriO,
        ..facts()
    };
    let main = container(
        &pod(&daemon_set("{}", &openshift, Operand::Gfd)),
        "gpu-feature-discovery",
    );
    assert_eq!(env(&main, "USE_NODE_FEATURE_API").as_deref(), Some("false"));
}

#[test]
fn mps_daemon_uses_the_plugin_service_account_and_needs_mps_capable_nodes() {
    let p = pod(&daemon_set("{}", &facts(), Operand::MpsControlDaemon));
    assert_eq!(
        p.service_account_name.as_deref(),
        Some("nvidia-device-plugin")
    );
    let selector = p.node_selector.unwrap();
    assert_eq!(selector["nvidia.com/gpu.deploy.device-plugin"], "true");
    assert_eq!(selector["nvidia.com/mps.capable"], "true");
    let names: Vec<String> = p
        .init_containers
        .unwrap()
        .into_iter()
        .map(|c| c.name)
        .collect();
    assert_eq!(names, ["toolkit-validation", "mps-control-daemon-mounts"]);
    assert!(
        objects("{}", &facts(), Operand::MpsControlDaemon)
            .service_accounts
            .is_empty()
    );
}

#[test]
fn device_plugin_mps_root_moves_both_mps_volumes() {
    let p = pod(&daemon_set(
        "{devicePlugin: {mps: {root: /var/mps}}}",
        &facts(),
        Operand::DevicePlugin,
    ));
    assert_eq!(host_path(&p, "mps-root").0, "/var/mps");
    assert_eq!(host_path(&p, "mps-shm").0, "/var/mps/shm");
    assert_eq!(
        env(&container(&p, "nvidia-device-plugin"), "MPS_ROOT").as_deref(),
        Some("/var/mps")
    );
}

// --- DCGM and the exporter -----------------------------------------------------------------------

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

// --- MIG manager ---------------------------------------------------------------------------------

#[test]
fn mig_manager_renders_and_hashes_the_default_layouts() {
    let objects = objects("{}", &facts(), Operand::MigManager);
    let names: Vec<String> = objects
        .config_maps
        .iter()
        .map(|c| c.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "nvidia-mig-manager-entrypoint",
            "default-mig-parted-config",
            "default-gpu-clients"
        ]
    );
    let layouts = &objects.config_maps[1].data.as_ref().unwrap()["config.yaml"];
    let parsed: serde_json::Value = serde_yaml_ng::from_str(layouts).unwrap();
    let configs = parsed["mig-configs"].as_object().unwrap();
    for name in [
        "all-disabled",
        "all-enabled",
        "all-balanced",
        "all-1g.10gb",
        "all-1g.10gb.me",
        "all-7g.80gb",
    ] {
        assert!(configs.contains_key(name), "{name} missing");
    }
    // Device filters stay strings: unquoted hex is a YAML integer, which mig-parted rejects.
    let filter = &configs["all-7g.80gb"][0]["device-filter"];
    assert!(
        filter
            .as_array()
            .unwrap()
            .iter()
            .all(serde_json::Value::is_string),
        "{filter}"
    );
    let ds = &objects.daemon_sets[0];
    let p = pod(ds);
    assert_eq!((p.host_pid, p.host_ipc), (Some(true), Some(true)));
    let main = container(&p, "nvidia-mig-manager");
    assert_eq!(
        env(&main, "DEFAULT_CONFIG_FILE").as_deref(),
        Some("/mig-parted-config/config-default.yaml")
    );
    assert_eq!(env(&main, "CONFIG_FILE"), None);
    let hash = common::config_hash(objects.config_maps[1].data.as_ref().unwrap());
    assert_eq!(template_annotations(ds)[CONFIG_HASH_ANNOTATION], hash);
}

#[test]
fn mig_manager_with_a_custom_config_mounts_it_and_rolls_when_it_changes() {
    let custom = |yaml: &str| ClusterFacts {
        mig_config: Some(ConfigMapData {
            name: "layouts".to_owned(),
            data: [("config.yaml".to_owned(), yaml.to_owned())].into(),
        }),
        ..facts()
    };
    let spec = "{migManager: {config: {name: layouts}, gpuClientsConfig: {name: clients}}}";
    let a = objects(
        spec,
        &custom("version: v1\nmig-configs: {a: [{devices: all, mig-enabled: false}]}\n"),
        Operand::MigManager,
    );
    let b = objects(
        spec,
        &custom("version: v1\nmig-configs: {b: [{devices: all, mig-enabled: false}]}\n"),
        Operand::MigManager,
    );
    assert_eq!(
        a.config_maps.len(),
        1,
        "only the entrypoint: no default layouts or clients"
    );
    let main = container(&pod(&a.daemon_sets[0]), "nvidia-mig-manager");
    assert_eq!(
        env(&main, "CONFIG_FILE").as_deref(),
        Some("/mig-parted-config/config.yaml")
    );
    assert_ne!(
        template_annotations(&a.daemon_sets[0])[CONFIG_HASH_ANNOTATION],
        template_annotations(&b.daemon_sets[0])[CONFIG_HASH_ANNOTATION]
    );
}

// --- NFD -----------------------------------------------------------------------------------------

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
