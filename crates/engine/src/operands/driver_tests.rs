//! Render tests of the driver: what its pods need (docs/operand-facts.md).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::test_support::*;

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
    // A fixed name: renaming it would restart every running driver (decision 20).
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

fn driver_outcome(s: &DesiredState) -> &Outcome {
    &s.operands
        .iter()
        .find(|o| o.operand == Operand::Driver)
        .unwrap()
        .outcome
}

#[test]
fn driver_liveness_and_readiness_probes_exist_only_when_the_policy_sets_them() {
    let main = |spec: &str| {
        container(
            &pod(&daemon_set(spec, &facts(), Operand::Driver)),
            "nvidia-driver-ctr",
        )
    };
    let plain = main("{}");
    assert_eq!((plain.liveness_probe, plain.readiness_probe), (None, None));

    let probed = main(
        "{driver: {livenessProbe: {periodSeconds: 120, failureThreshold: 5}, readinessProbe: {}}}",
    );
    let liveness = probed.liveness_probe.unwrap();
    let command = liveness.exec.as_ref().unwrap().command.clone().unwrap();
    assert!(command[2].contains("nvidia-smi"), "{command:?}");
    // Unlike the startup probe, it must not write the ready file every period.
    assert!(!command.join(" ").contains("startup-probe"), "{command:?}");
    assert_eq!(
        (
            liveness.period_seconds,
            liveness.failure_threshold,
            liveness.timeout_seconds,
            liveness.success_threshold
        ),
        (Some(120), Some(5), Some(60), Some(1))
    );
    let readiness = probed.readiness_probe.unwrap();
    assert_eq!(readiness.exec, liveness.exec);
    assert_eq!(
        (readiness.period_seconds, readiness.failure_threshold),
        (Some(30), Some(3))
    );

    for path in ["spec.driver.livenessProbe", "spec.driver.readinessProbe"] {
        let spec: crate::api::ClusterPolicySpec = serde_yaml_ng::from_str(
            "{driver: {livenessProbe: {periodSeconds: 10}, readinessProbe: {periodSeconds: 10}}}",
        )
        .unwrap();
        assert!(
            !spec
                .unsupported_fields()
                .iter()
                .any(|u| u.path.starts_with(path)),
            "{path} is acted on"
        );
    }
}

#[test]
fn a_liveness_probe_needing_two_successes_is_rejected_naming_the_field() {
    let s = state("{driver: {livenessProbe: {successThreshold: 2}}}", &facts());
    assert!(
        matches!(driver_outcome(&s), Outcome::Invalid(m) if m.contains("spec.driver.livenessProbe.successThreshold")),
        "{:?}",
        driver_outcome(&s)
    );
    let s = state(
        "{driver: {readinessProbe: {successThreshold: 2}}}",
        &facts(),
    );
    assert!(!matches!(driver_outcome(&s), Outcome::Invalid(_)));
}

#[test]
fn driver_is_invalid_without_os_and_use_nvidia_driver_crd_is_acted_on() {
    let s = state(
        "{}",
        &ClusterFacts {
            os_tag: None,
            ..facts()
        },
    );
    assert!(matches!(driver_outcome(&s), Outcome::Invalid(m) if m.contains("OS suffix")));
    // Acted on now: the field is no longer reported as stored-only.
    let spec: crate::api::ClusterPolicySpec =
        serde_yaml_ng::from_str("{driver: {useNvidiaDriverCRD: true}}").unwrap();
    assert!(
        !spec
            .unsupported_fields()
            .iter()
            .any(|u| u.path == "spec.driver.useNvidiaDriverCRD")
    );
}

/// `fleet` with the named nodes carrying the NVIDIADriver pool label.
fn pooled(mut facts: ClusterFacts, pooled: &[&str]) -> ClusterFacts {
    for node in &mut facts.gpu_nodes {
        if pooled.contains(&node.name.as_str()) {
            std::sync::Arc::make_mut(node)
                .labels
                .insert(crate::nodes::DRIVER_POOL.to_owned(), "pool-a".to_owned());
        }
    }
    facts
}

fn keeps_off_pools(ds: &DaemonSet) -> bool {
    let term = pod(ds)
        .affinity
        .and_then(|a| a.node_affinity)
        .and_then(|a| a.required_during_scheduling_ignored_during_execution)
        .map(|r| r.node_selector_terms);
    term.is_some_and(|t| {
        t[0].match_expressions.as_ref().unwrap()[0].key == crate::nodes::DRIVER_POOL
            && t[0].match_expressions.as_ref().unwrap()[0].operator == "DoesNotExist"
    })
}

#[test]
fn with_nvidia_driver_crd_the_policy_driver_keeps_off_pooled_nodes_and_keeps_the_rest() {
    let f = fleet(
        &[
            ("a", Some(("ubuntu", "22.04"))),
            ("b", Some(("ubuntu", "24.04"))),
        ],
        "ubuntu22.04",
    );
    // Off: no affinity, the template is what it always was.
    let plain = objects("{}", &f, Operand::Driver);
    assert!(!plain.daemon_sets.iter().any(keeps_off_pools));
    // On, no pool yet: every node keeps the policy's driver, kept off future pool nodes.
    let spec = "{driver: {useNvidiaDriverCRD: true}}";
    let on = objects(spec, &f, Operand::Driver);
    assert_eq!(on.daemon_sets.len(), 2);
    assert!(on.daemon_sets.iter().all(keeps_off_pools));
    // Node a (ubuntu22.04) in a pool: b's DaemonSet stays exactly as it was.
    let b = |o: &OperandObjects| {
        o.daemon_sets
            .iter()
            .find(|d| d.metadata.name.as_deref() == Some("nvidia-driver-daemonset-ubuntu24.04"))
            .cloned()
            .unwrap()
    };
    let pooled_a = objects(spec, &pooled(f.clone(), &["a"]), Operand::Driver);
    assert_eq!(pooled_a.daemon_sets.len(), 1);
    assert_eq!(b(&pooled_a), b(&on));
    let main = container(&pod(&b(&pooled_a)), "nvidia-driver-ctr");
    assert!(main.image.unwrap().ends_with("-ubuntu24.04"));
    // Every node pooled: no DaemonSet, but the identity and probe ConfigMap the pools use.
    let all = objects(spec, &pooled(f, &["a", "b"]), Operand::Driver);
    assert!(all.daemon_sets.is_empty());
    assert_eq!(all.service_accounts.len(), 1);
    assert_eq!(all.config_maps.len(), 1);
}

/// GPU nodes reporting `(name, Some((ID, VERSION_ID)))` through NFD, for mixed-OS fleets.
fn fleet(nodes: &[(&str, Option<(&str, &str)>)], primary: &str) -> ClusterFacts {
    let gpu_nodes = nodes
        .iter()
        .map(|(name, os)| {
            let mut labels: BTreeMap<String, String> = [(
                "feature.node.kubernetes.io/pci-10de.present".to_owned(),
                "true".to_owned(),
            )]
            .into();
            if let Some((id, version)) = os {
                labels.insert(crate::nodes::OS_ID.to_owned(), (*id).to_owned());
                labels.insert(
                    crate::nodes::OS_VERSION_ID.to_owned(),
                    (*version).to_owned(),
                );
            }
            std::sync::Arc::new(crate::nodes::NodeView::from_labels(name, None, &labels))
        })
        .collect();
    ClusterFacts {
        os_tag: Some(primary.to_owned()),
        gpu_nodes,
        ..facts()
    }
}

#[test]
fn one_os_keeps_one_daemonset_without_an_os_selector() {
    let f = fleet(
        &[
            ("a", Some(("ubuntu", "22.04"))),
            ("b", Some(("ubuntu", "22.04"))),
        ],
        "ubuntu22.04",
    );
    let objects = objects("{}", &f, Operand::Driver);
    assert_eq!(objects.daemon_sets.len(), 1);
    let p = pod(&objects.daemon_sets[0]);
    assert!(!p.node_selector.unwrap().contains_key(crate::nodes::OS_ID));
}

#[test]
fn ubuntu_22_04_and_24_04_nodes_get_one_driver_daemonset_each_with_the_matching_tag() {
    let f = fleet(
        &[
            ("a", Some(("ubuntu", "22.04"))),
            ("b", Some(("ubuntu", "24.04"))),
            ("c", Some(("ubuntu", "24.04"))),
        ],
        "ubuntu22.04",
    );
    let objects = objects("{}", &f, Operand::Driver);
    let by_name: BTreeMap<String, &DaemonSet> = objects
        .daemon_sets
        .iter()
        .map(|d| (d.metadata.name.clone().unwrap(), d))
        .collect();
    assert_eq!(
        by_name.keys().collect::<Vec<_>>(),
        [
            "nvidia-driver-daemonset",
            "nvidia-driver-daemonset-ubuntu24.04"
        ]
    );
    for (name, version) in [
        ("nvidia-driver-daemonset", "22.04"),
        ("nvidia-driver-daemonset-ubuntu24.04", "24.04"),
    ] {
        let ds = by_name[name];
        let p = pod(ds);
        let image = container(&p, "nvidia-driver-ctr").image.unwrap();
        assert_eq!(
            image,
            format!("nvcr.io/nvidia/driver:595.91.07-ubuntu{version}")
        );
        let selector = p.node_selector.unwrap();
        assert_eq!(selector[crate::nodes::OS_ID], "ubuntu");
        assert_eq!(selector[crate::nodes::OS_VERSION_ID], version);
        assert_eq!(selector["nvidia.com/gpu.deploy.driver"], "true");
        // Its own selector and app label, so the two DaemonSets never claim each other's pods.
        let spec = ds.spec.as_ref().unwrap();
        assert_eq!(spec.selector.match_labels.as_ref().unwrap()["app"], name);
        assert_eq!(
            spec.template
                .metadata
                .as_ref()
                .unwrap()
                .labels
                .as_ref()
                .unwrap()["app"],
            name
        );
        assert_eq!(
            spec.template
                .metadata
                .as_ref()
                .unwrap()
                .labels
                .as_ref()
                .unwrap()["app.kubernetes.io/component"],
            "nvidia-driver"
        );
    }
    let s = state("{}", &f);
    assert!(
        !s.operands
            .iter()
            .any(|o| matches!(o.outcome, Outcome::Invalid(_)))
    );
}

#[test]
fn nodes_of_an_unknown_os_get_no_driver_daemonset_and_are_reported() {
    let f = fleet(
        &[
            ("a", Some(("ubuntu", "22.04"))),
            ("f", Some(("flatcar", "3975"))),
            ("g", None),
        ],
        "ubuntu22.04",
    );
    let objects = objects("{}", &f, Operand::Driver);
    assert_eq!(objects.daemon_sets.len(), 1);
    let selector = pod(&objects.daemon_sets[0]).node_selector.unwrap();
    assert_eq!(selector[crate::nodes::OS_VERSION_ID], "22.04");
    let p = policy_with("{}", &f);
    let reported = &p.reported[&Operand::Driver];
    assert!(
        reported.contains("get no driver pod: f (flatcar3975), g (no NFD OS labels)"),
        "{reported}"
    );
}

/// The driver config digest of the policy `spec` renders (the same on the manager and the
/// driver container).
fn config_digest(spec: &str) -> String {
    let mut facts = facts();
    for name in ["repos", "other-repos", "certs", "modules"] {
        let data = BTreeMap::from([("a.conf".to_owned(), "x".to_owned())]);
        facts.driver_config_maps.insert(
            name.to_owned(),
            ConfigMapData {
                name: name.to_owned(),
                data,
            },
        );
    }
    let p = pod(&daemon_set(spec, &facts, Operand::Driver));
    let on_manager = env(&container(&p, "k8s-driver-manager"), "DRIVER_CONFIG_DIGEST");
    assert_eq!(
        on_manager,
        env(&container(&p, "nvidia-driver-ctr"), "DRIVER_CONFIG_DIGEST")
    );
    assert_eq!(
        crate::operands::driver::carried_config_digest(&p),
        on_manager.as_deref()
    );
    on_manager.unwrap()
}

#[test]
fn every_install_relevant_driver_setting_moves_the_config_digest() {
    let base = config_digest("{driver: {}}");
    for spec in [
        "{driver: {repository: nvcr.io/nvidia, image: driver, version: '580.1'}}",
        "{driver: {kernelModuleType: open}}",
        "{driver: {env: [{name: X, value: '1'}]}}",
        "{driver: {env: [{name: HTTPS_PROXY, value: 'http://proxy:3128'}]}}",
        "{driver: {secretEnv: driver-secrets}}",
        "{driver: {licensingConfig: {configMapName: licensing, nlsEnabled: true}}}",
        "{driver: {licensingConfig: {secretName: licensing, nlsEnabled: true}}}",
        "{driver: {repoConfig: {configMapName: repos}}}",
        "{driver: {certConfig: {name: certs}}}",
        "{driver: {kernelModuleConfig: {name: modules}}}",
        "{driver: {rdma: {enabled: true}}}",
        "{driver: {rdma: {enabled: true, useHostMofed: true}}}",
    ] {
        assert_ne!(config_digest(spec), base, "{spec} must move the digest");
    }
    assert_ne!(
        config_digest("{driver: {repoConfig: {configMapName: repos}}}"),
        config_digest("{driver: {repoConfig: {configMapName: other-repos}}}"),
        "another ConfigMap name"
    );
}

#[test]
fn the_driver_manager_metadata_and_scheduling_leave_the_config_digest_alone() {
    let base = config_digest("{driver: {}}");
    for spec in [
        // An operator upgrade that ships another manager restarts drivers in place only.
        "{driver: {manager: {repository: nvcr.io/nvidia/cloud-native, image: k8s-driver-manager, version: v9.9.9}}}",
        "{driver: {manager: {env: [{name: ENABLE_AUTO_DRAIN, value: 'true'}]}}}",
        "{driver: {}, daemonsets: {labels: {team: ml}, annotations: {owner: platform}}}",
        "{driver: {}, daemonsets: {tolerations: [{key: dedicated, operator: Exists, effect: NoSchedule}]}}",
        "{driver: {}, daemonsets: {priorityClassName: other}}",
        "{driver: {resources: {limits: {memory: 4Gi}}}}",
        "{driver: {startupProbe: {initialDelaySeconds: 5, failureThreshold: 3}}}",
        "{driver: {livenessProbe: {periodSeconds: 60}, readinessProbe: {}}}",
    ] {
        assert_eq!(config_digest(spec), base, "{spec} must not move the digest");
    }
}

/// `fleet` with each node's kernel label.
fn kernel_fleet(nodes: &[(&str, (&str, &str), &str)], primary: &str) -> ClusterFacts {
    let mut f = fleet(
        &nodes
            .iter()
            .map(|(name, os, _)| (*name, Some(*os)))
            .collect::<Vec<_>>(),
        primary,
    );
    for (node, (_, _, kernel)) in f.gpu_nodes.iter_mut().zip(nodes) {
        let mut labels = node.labels.clone();
        labels.insert(
            crate::nodes::KERNEL_VERSION.to_owned(),
            (*kernel).to_owned(),
        );
        *node = std::sync::Arc::new(crate::nodes::NodeView::from_labels(
            &node.name, None, &labels,
        ));
    }
    f
}

const PRECOMPILED: &str = "{driver: {usePrecompiled: true, repository: nvcr.io/nvidia, \
    image: driver, version: '580', repoConfig: {configMapName: repos}}}";

#[test]
fn precompiled_drivers_get_one_daemonset_per_kernel_with_nvidias_names_images_and_selectors() {
    let mut f = kernel_fleet(
        &[
            ("a", ("ubuntu", "22.04"), "5.15.0-1048-aws"),
            ("b", ("ubuntu", "22.04"), "5.15.0-1048-aws"),
            ("c", ("ubuntu", "24.04"), "6.8.0-1008-aws"),
        ],
        "ubuntu22.04",
    );
    f.driver_config_maps.insert(
        "repos".to_owned(),
        crate::facts::ConfigMapData {
            name: "repos".to_owned(),
            data: [("a.list".to_owned(), "deb x".to_owned())].into(),
        },
    );
    let objects = objects(PRECOMPILED, &f, Operand::Driver);
    let got: Vec<(String, String, BTreeMap<String, String>)> = objects
        .daemon_sets
        .iter()
        .map(|ds| {
            let p = pod(ds);
            (
                ds.metadata.name.clone().unwrap(),
                container(&p, "nvidia-driver-ctr").image.unwrap(),
                p.node_selector.unwrap(),
            )
        })
        .collect();
    assert_eq!(got.len(), 2, "{got:?}");
    let (name, image, selector) = &got[0];
    assert_eq!(name, "nvidia-driver-daemonset-5.15.0-1048-aws-ubuntu22.04");
    assert_eq!(
        image,
        "nvcr.io/nvidia/driver:580-5.15.0-1048-aws-ubuntu22.04"
    );
    assert_eq!(selector[crate::nodes::KERNEL_VERSION], "5.15.0-1048-aws");
    assert_eq!(selector[crate::nodes::OS_VERSION_ID], "22.04");
    assert_eq!(selector["nvidia.com/gpu.deploy.driver"], "true");
    let (name, image, _) = &got[1];
    assert_eq!(name, "nvidia-driver-daemonset-6.8.0-1008-aws-ubuntu24.04");
    assert_eq!(
        image,
        "nvcr.io/nvidia/driver:580-6.8.0-1008-aws-ubuntu24.04"
    );
    for ds in &objects.daemon_sets {
        assert_eq!(
            ds.metadata.labels.as_ref().unwrap()[super::driver::PRECOMPILED_LABEL],
            "true"
        );
        let template = ds
            .spec
            .as_ref()
            .unwrap()
            .template
            .metadata
            .as_ref()
            .unwrap();
        assert_eq!(
            template.labels.as_ref().unwrap()[super::driver::PRECOMPILED_LABEL],
            "true"
        );
        // Nothing is installed from packages: the repository config is not mounted.
        let p = pod(ds);
        assert!(
            !p.volumes
                .unwrap_or_default()
                .iter()
                .any(|v| v.name.contains("repo")),
            "{:?}",
            ds.metadata.name
        );
    }
}

#[test]
fn precompiled_drivers_are_refused_where_they_cannot_apply_naming_the_field() {
    let f = kernel_fleet(
        &[("a", ("ubuntu", "22.04"), "5.15.0-1048-aws")],
        "ubuntu22.04",
    );
    let problem = |spec: &str, facts: &ClusterFacts| match driver_outcome(&state(spec, facts)) {
        Outcome::Invalid(m) => m.clone(),
        other => panic!("{spec}: {other:?}"),
    };
    assert!(
        problem(
            "{driver: {usePrecompiled: true, repository: r, image: driver, version: 'sha256:abc'}}",
            &f
        )
        .contains("spec.driver.version")
    );
    assert!(
        problem(
            "{driver: {usePrecompiled: true, repository: r, image: driver, version: '580'}, gds: {enabled: true}}",
            &f
        )
        .contains("spec.gds.enabled")
    );
}

#[test]
fn with_nvidiadriver_pools_in_charge_use_precompiled_is_not_acted_on_by_the_policy() {
    let f = kernel_fleet(
        &[("a", ("ubuntu", "22.04"), "5.15.0-1048-aws")],
        "ubuntu22.04",
    );
    let both = "{driver: {usePrecompiled: true, useNvidiaDriverCRD: true, repository: r, \
        image: driver, version: '580'}}";
    // NVIDIA's operator leaves the driver to the NVIDIADrivers: the nodes no pool selects keep
    // the policy's driver built on the node, and the field is listed as not acted on.
    let objects = objects(both, &f, Operand::Driver);
    let names: Vec<String> = objects
        .daemon_sets
        .iter()
        .map(|ds| ds.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(names, [super::driver::NAME]);
    assert_eq!(
        objects.daemon_sets[0].metadata.labels.as_ref().unwrap()[super::driver::PRECOMPILED_LABEL],
        "false"
    );
    assert!(
        policy(both)
            .spec
            .unsupported_fields()
            .iter()
            .any(|u| u.path == "spec.driver.usePrecompiled")
    );
    // Its own running precompiled DaemonSets are not switched at once by turning the CRD on.
    let running = daemon_set(
        "{driver: {usePrecompiled: true, repository: r, image: driver, version: '580'}}",
        &f,
        Operand::Driver,
    );
    let precompiled = ClusterFacts {
        live_driver: crate::facts::LiveDriver {
            daemon_sets: vec![std::sync::Arc::new(running)],
        },
        ..f
    };
    match driver_outcome(&state(both, &precompiled)) {
        Outcome::Invalid(m) => assert!(
            m.starts_with("spec.driver.useNvidiaDriverCRD: the GPU nodes run precompiled")
                && m.contains("set spec.driver.useNvidiaDriverCRD back to false"),
            "{m}"
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn on_openshift_the_driver_and_the_vgpu_manager_get_openshift_version_and_a_users_value_wins() {
    let openshift = ClusterFacts {
        openshift: true,
        openshift_version: Some("4.20".to_owned()),
        ..facts()
    };
    let main = |spec: &str, facts: &ClusterFacts, operand, name: &str| {
        container(&pod(&daemon_set(spec, facts, operand)), name)
    };
    let driver = main("{}", &openshift, Operand::Driver, "nvidia-driver-ctr");
    assert_eq!(env(&driver, "OPENSHIFT_VERSION").as_deref(), Some("4.20"));
    let vgpu = "{sandboxWorkloads: {enabled: true, defaultWorkload: vm-vgpu}, vgpuManager: \
        {enabled: true, repository: registry.example.com/nvidia, image: vgpu-manager, \
        version: 580.65.05}}";
    let manager = main(
        vgpu,
        &openshift,
        Operand::VgpuManager,
        "nvidia-vgpu-manager-ctr",
    );
    assert_eq!(env(&manager, "OPENSHIFT_VERSION").as_deref(), Some("4.20"));
    // Elsewhere, or with the version unknown, there is none.
    let plain = main("{}", &facts(), Operand::Driver, "nvidia-driver-ctr");
    assert_eq!(env(&plain, "OPENSHIFT_VERSION"), None);
    // The user's env overrides it.
    let own = "{driver: {env: [{name: OPENSHIFT_VERSION, value: '4.19'}]}}";
    let driver = main(own, &openshift, Operand::Driver, "nvidia-driver-ctr");
    assert_eq!(env(&driver, "OPENSHIFT_VERSION").as_deref(), Some("4.19"));
}

#[test]
fn openshift_version_is_major_minor_of_the_first_completed_history_entry() {
    let version = |history: serde_json::Value| {
        crate::facts::openshift_version(&serde_json::json!({"status": {"history": history}}))
    };
    // The newest entry first: an update in progress is skipped.
    assert_eq!(
        version(serde_json::json!([
            {"state": "Partial", "version": "4.21.0"},
            {"state": "Completed", "version": "4.20.3"},
        ]))
        .as_deref(),
        Some("4.20")
    );
    assert_eq!(
        version(serde_json::json!([{"state": "Completed", "version": "4"}])).as_deref(),
        Some("4")
    );
    assert_eq!(
        version(serde_json::json!([{"state": "Partial", "version": "4.20.3"}])),
        None
    );
    assert_eq!(
        crate::facts::openshift_version(&serde_json::json!({"spec": {}})),
        None
    );
}
