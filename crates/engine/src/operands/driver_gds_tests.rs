//! Render tests of the driver's GPUDirect Storage (nvidia-fs) and GDRCopy (gdrdrv) sidecars:
//! NVIDIA's containers (docs/operand-facts.md §5.1), the flags the validator reads, the driver
//! config digest, and bad input freezing the driver alone.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use k8s_openapi::api::core::v1::VolumeMount;

use super::test_support::*;

const BOTH: &str = "{gds: {enabled: true}, gdrcopy: {enabled: true}}";

fn mounts(c: &Container) -> Vec<VolumeMount> {
    c.volume_mounts.clone().unwrap_or_default()
}

#[test]
fn gds_and_gdrcopy_add_nvidias_sidecars_with_os_suffixed_images() {
    let p = pod(&daemon_set(BOTH, &facts(), Operand::Driver));
    let names: Vec<&str> = p.containers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        ["nvidia-driver-ctr", "nvidia-fs-ctr", "nvidia-gdrcopy-ctr"]
    );
    for (name, image, install, module) in [
        (
            "nvidia-fs-ctr",
            "nvcr.io/nvidia/cloud-native/nvidia-fs:2.29.4-ubuntu22.04",
            "nvidia-gds-driver install",
            "nvidia_fs",
        ),
        (
            "nvidia-gdrcopy-ctr",
            "nvcr.io/nvidia/cloud-native/gdrdrv:v2.6-ubuntu22.04",
            "nvidia-gdrcopy-driver install",
            "gdrdrv",
        ),
    ] {
        let c = container(&p, name);
        assert_eq!(c.image.as_deref(), Some(image));
        assert_eq!(c.image_pull_policy.as_deref(), Some("IfNotPresent"));
        assert_eq!(c.command.clone().unwrap(), ["bash", "-xc"]);
        let args = c.args.clone().unwrap();
        assert_eq!(args.len(), 1);
        assert!(
            args[0].starts_with("until [ -d /run/nvidia/driver/usr/src ] && lsmod | grep nvidia;"),
            "{}",
            args[0]
        );
        assert!(args[0].ends_with(&format!("exec {install}")), "{}", args[0]);
        let sc = c.security_context.clone().unwrap();
        assert_eq!(sc.privileged, Some(true));
        assert_eq!(sc.se_linux_options.unwrap().level.as_deref(), Some("s0"));
        let probe = c.startup_probe.clone().unwrap();
        assert_eq!(
            probe.exec.unwrap().command.unwrap(),
            ["sh", "-c", &format!("lsmod | grep {module}")]
        );
        assert_eq!(
            (
                probe.initial_delay_seconds,
                probe.period_seconds,
                probe.timeout_seconds,
                probe.failure_threshold,
                probe.success_threshold
            ),
            (Some(10), Some(10), Some(10), Some(120), Some(1))
        );
        let m = mounts(&c);
        let got: Vec<(&str, &str, Option<&str>, Option<bool>)> = m
            .iter()
            .map(|m| {
                (
                    m.name.as_str(),
                    m.mount_path.as_str(),
                    m.mount_propagation.as_deref(),
                    m.read_only,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("run-nvidia", "/run/nvidia", Some("HostToContainer"), None),
                ("var-log", "/var/log", None, None),
                ("dev-log", "/dev/log", None, Some(true)),
            ]
        );
        assert_eq!(c.env, None);
        assert!(c.liveness_probe.is_none() && c.readiness_probe.is_none());
    }
    // The flags the startup probe writes into .driver-ctr-ready for the validator.
    let main = container(&p, "nvidia-driver-ctr");
    assert_eq!(env(&main, "GDS_ENABLED").as_deref(), Some("true"));
    assert_eq!(env(&main, "GDRCOPY_ENABLED").as_deref(), Some("true"));
    // Not on the manager (NVIDIA sets only RDMA there).
    let manager = container(&p, "k8s-driver-manager");
    assert_eq!(env(&manager, "GDS_ENABLED"), None);
}

#[test]
fn each_sidecar_follows_only_its_own_switch() {
    let p = pod(&daemon_set(
        "{gdrcopy: {enabled: true}, gds: {enabled: false}}",
        &facts(),
        Operand::Driver,
    ));
    assert!(has_container(&p, "nvidia-gdrcopy-ctr"));
    assert!(!has_container(&p, "nvidia-fs-ctr"));
    let main = container(&p, "nvidia-driver-ctr");
    assert_eq!(env(&main, "GDS_ENABLED"), None);
    assert_eq!(env(&main, "GDRCOPY_ENABLED").as_deref(), Some("true"));
}

#[test]
fn switched_off_sidecars_leave_nothing_behind() {
    let plain = daemon_set("{}", &facts(), Operand::Driver);
    for off in [
        "{gds: {enabled: false}, gdrcopy: {enabled: false}}",
        "{gds: {version: '2.20.5', env: [{name: A, value: b}]}, gdrcopy: {imagePullSecrets: [s]}}",
    ] {
        assert_eq!(daemon_set(off, &facts(), Operand::Driver), plain, "{off}");
    }
}

#[test]
fn sidecar_images_env_pull_settings_secret_env_and_build_inputs_come_from_the_policy() {
    let mut f = facts();
    for name in ["repos", "certs"] {
        f.driver_config_maps.insert(
            name.to_owned(),
            ConfigMapData {
                name: name.to_owned(),
                data: BTreeMap::from([("a.conf".to_owned(), "x".to_owned())]),
            },
        );
    }
    let spec = "{driver: {imagePullSecrets: [driver-pull], secretEnv: proxies, \
                repoConfig: {configMapName: repos}, certConfig: {name: certs}, \
                resources: {limits: {memory: 1Gi}}}, \
                gds: {enabled: true, repository: mirror.local/nv, image: nvidia-fs, \
                version: '2.20.5', imagePullPolicy: Always, imagePullSecrets: [gds-pull, driver-pull], \
                env: [{name: NVFS_MAX_PEER_DEVS, value: '64'}]}, \
                gdrcopy: {enabled: true, version: 'sha256:abc', repository: mirror.local/nv, \
                image: gdrdrv, imagePullSecrets: [gdr-pull]}}";
    let p = pod(&daemon_set(spec, &f, Operand::Driver));
    let gds = container(&p, "nvidia-fs-ctr");
    assert_eq!(
        gds.image.as_deref(),
        Some("mirror.local/nv/nvidia-fs:2.20.5-ubuntu22.04")
    );
    assert_eq!(gds.image_pull_policy.as_deref(), Some("Always"));
    assert_eq!(env(&gds, "NVFS_MAX_PEER_DEVS").as_deref(), Some("64"));
    let gdr = container(&p, "nvidia-gdrcopy-ctr");
    // A digest pins one image: no OS suffix.
    assert_eq!(
        gdr.image.as_deref(),
        Some("mirror.local/nv/gdrdrv@sha256:abc")
    );
    let secrets: Vec<String> = p
        .image_pull_secrets
        .clone()
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(secrets, ["driver-pull", "gds-pull", "gdr-pull"]);
    for c in [&gds, &gdr] {
        let from = c.env_from.clone().unwrap();
        assert_eq!(from[0].secret_ref.as_ref().unwrap().name, "proxies");
        assert_eq!(
            mount_path(c, "repo-config"),
            "/etc/apt/sources.list.d/a.conf"
        );
        assert_eq!(
            mount_path(c, "cert-config"),
            "/usr/local/share/ca-certificates/a.conf"
        );
        assert!(c.resources.as_ref().unwrap().limits.is_some());
    }
}

#[test]
fn a_mixed_os_fleet_gets_sidecar_images_of_each_os() {
    let labels = |version: &str| -> BTreeMap<String, String> {
        [
            ("feature.node.kubernetes.io/pci-10de.present", "true"),
            (crate::nodes::OS_ID, "ubuntu"),
            (crate::nodes::OS_VERSION_ID, version),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    };
    let f = ClusterFacts {
        gpu_nodes: vec![
            std::sync::Arc::new(crate::nodes::NodeView::from_labels(
                "a",
                None,
                &labels("22.04"),
            )),
            std::sync::Arc::new(crate::nodes::NodeView::from_labels(
                "b",
                None,
                &labels("24.04"),
            )),
        ],
        ..facts()
    };
    let objects = objects(BOTH, &f, Operand::Driver);
    assert_eq!(objects.daemon_sets.len(), 2);
    for ds in &objects.daemon_sets {
        let p = pod(ds);
        let os = if ds.metadata.name.as_deref() == Some("nvidia-driver-daemonset") {
            "ubuntu22.04"
        } else {
            "ubuntu24.04"
        };
        assert_eq!(
            container(&p, "nvidia-fs-ctr").image.unwrap(),
            format!("nvcr.io/nvidia/cloud-native/nvidia-fs:2.29.4-{os}")
        );
        assert_eq!(
            container(&p, "nvidia-gdrcopy-ctr").image.unwrap(),
            format!("nvcr.io/nvidia/cloud-native/gdrdrv:v2.6-{os}")
        );
    }
}

#[test]
fn the_validator_learns_of_gds_and_gdrcopy_through_the_driver_ready_file() {
    // The driver container's flags ...
    let p = pod(&daemon_set(BOTH, &facts(), Operand::Driver));
    let main = container(&p, "nvidia-driver-ctr");
    assert_eq!(env(&main, "GDS_ENABLED").as_deref(), Some("true"));
    // ... are what the startup probe writes into .driver-ctr-ready ...
    let objects = objects(BOTH, &facts(), Operand::Driver);
    let script = &objects.config_maps[0].data.as_ref().unwrap()["startup-probe.sh"];
    assert!(script.contains("echo \"GDS_ENABLED: ${GDS_ENABLED:-false}\""));
    assert!(script.contains("echo \"GDRCOPY_ENABLED: ${GDRCOPY_ENABLED:-false}\""));
    // ... which NVIDIA's validator reads in its waiting driver check, then waits for nvidia_fs
    // and gdrdrv and writes nvidia-fs-ready and gdrcopy-ready.
    let v = pod(&daemon_set(BOTH, &facts(), Operand::Validator));
    let check = v
        .init_containers
        .unwrap()
        .into_iter()
        .find(|c| c.name == "driver-validation")
        .unwrap();
    assert_eq!(env(&check, "COMPONENT").as_deref(), Some("driver"));
    assert_eq!(env(&check, "WITH_WAIT").as_deref(), Some("true"));
    assert_eq!(
        mount_path(&check, "run-nvidia-validations"),
        "/run/nvidia/validations"
    );
}

#[test]
fn the_device_plugin_is_told_to_inject_the_gds_and_gdrcopy_devices() {
    let plugin = |spec: &str| {
        container(
            &pod(&daemon_set(spec, &facts(), Operand::DevicePlugin)),
            "nvidia-device-plugin",
        )
    };
    let on = plugin(BOTH);
    assert_eq!(env(&on, "GDS_ENABLED").as_deref(), Some("true"));
    assert_eq!(env(&on, "MOFED_ENABLED").as_deref(), Some("true"));
    assert_eq!(env(&on, "GDRCOPY_ENABLED").as_deref(), Some("true"));
    let off = plugin("{}");
    for name in ["GDS_ENABLED", "MOFED_ENABLED", "GDRCOPY_ENABLED"] {
        assert_eq!(env(&off, name), None, "{name}");
    }
}

fn digest(spec: &str) -> String {
    let p = pod(&daemon_set(spec, &facts(), Operand::Driver));
    crate::operands::driver::carried_config_digest(&p)
        .unwrap()
        .to_owned()
}

#[test]
fn switching_gds_or_gdrcopy_or_changing_their_image_or_env_moves_the_config_digest() {
    let base = digest("{}");
    let mut seen = vec![base.clone()];
    for spec in [
        "{gds: {enabled: true}}",
        "{gdrcopy: {enabled: true}}",
        BOTH,
        "{gds: {enabled: true, repository: nvcr.io/nvidia/cloud-native, image: nvidia-fs, version: '2.20.5'}}",
        "{gds: {enabled: true, env: [{name: A, value: b}]}}",
        "{gdrcopy: {enabled: true, env: [{name: A, value: b}]}}",
    ] {
        let d = digest(spec);
        assert!(!seen.contains(&d), "{spec} must move the digest");
        seen.push(d);
    }
    // Switched off again: the digest of a policy without them, so no reinstall is left pending.
    assert_eq!(
        digest("{gds: {enabled: false}, gdrcopy: {enabled: false}}"),
        base
    );
    // Pull settings do not change what is installed.
    assert_eq!(
        digest("{gds: {enabled: true, imagePullPolicy: Always, imagePullSecrets: [s]}}"),
        digest("{gds: {enabled: true}}")
    );
}

fn driver_problem(spec: &str, facts: &ClusterFacts) -> String {
    let p = policy_with(spec, facts);
    assert_eq!(
        p.invalid.keys().collect::<Vec<_>>(),
        [&Operand::Driver],
        "only the driver is frozen"
    );
    p.invalid[&Operand::Driver].clone()
}

#[test]
fn bad_sidecar_input_freezes_only_the_driver_naming_the_field_and_the_fix() {
    let m = driver_problem(
        "{gds: {enabled: true, repository: nvcr.io/nvidia/cloud-native, image: nvidia-fs}}",
        &facts(),
    );
    assert!(
        m.starts_with("spec.gds: repository, image and version"),
        "{m}"
    );
    assert!(m.contains("version is empty"), "{m}");
    let m = driver_problem("{gdrcopy: {enabled: true, version: v2.5}}", &facts());
    assert!(m.starts_with("spec.gdrcopy:"), "{m}");
    // No OS known: the sidecar's tag cannot get its suffix either.
    let m = driver_problem(
        "{driver: {version: 'sha256:abc', repository: r.local, image: driver}, gds: {enabled: true}}",
        &ClusterFacts {
            os_tag: None,
            ..facts()
        },
    );
    assert!(
        m.starts_with(
            "spec.gds: the GPUDirect Storage (nvidia-fs) image tag needs the GPU nodes' OS suffix"
        ),
        "{m}"
    );
    assert!(m.contains("pin spec.gds.version to a sha256 digest"), "{m}");
}
