//! Render tests of the device plugin, the MPS daemon, GFD and the sharing config: what its pods need (docs/operand-facts.md).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::test_support::*;

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
        .find(|c| {
            c.metadata
                .labels
                .as_ref()
                .unwrap()
                .get(common::CONFIG_COPY_LABEL)
                .map(String::as_str)
                == Some("sharing")
        })
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
        .find(|c| {
            c.metadata
                .labels
                .as_ref()
                .unwrap()
                .get(common::CONFIG_COPY_LABEL)
                .map(String::as_str)
                == Some("sharing")
        })
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
    let plain = daemon_set("{}", &crate::render::tests::facts(), Operand::DevicePlugin);
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
