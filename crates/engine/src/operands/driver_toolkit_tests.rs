//! Render tests of the OpenShift Driver Toolkit driver (operands::driver_toolkit).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::test_support::*;
use crate::nodes::{NodeView, OS_ID, OS_VERSION_ID, OSTREE_VERSION};

const DTK: &str = "{operator: {use_ocp_driver_toolkit: true}, \
    driver: {repoConfig: {configMapName: repos}, certConfig: {name: certs}}}";
const V414: &str = "414.92.202312132152-0";
const V415: &str = "415.92.202402201450-0";

/// An OpenShift cluster with GPU nodes of the given RHCOS (OSTree) versions (None: no label)
/// and the ImageStream's tags.
fn openshift(nodes: &[(&str, Option<&str>)], tags: Option<&[&str]>) -> ClusterFacts {
    let gpu_nodes = nodes
        .iter()
        .map(|(name, ostree)| {
            let mut labels: BTreeMap<String, String> = [
                ("feature.node.kubernetes.io/pci-10de.present", "true"),
                (OS_ID, "rhcos"),
                (OS_VERSION_ID, "4.14"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
            if let Some(v) = ostree {
                labels.insert(OSTREE_VERSION.to_owned(), (*v).to_owned());
            }
            std::sync::Arc::new(NodeView::from_labels(name, None, &labels))
        })
        .collect();
    let mut f = ClusterFacts {
        openshift: true,
        runtime: Runtime::CriO,
        os_tag: Some("rhcos4.14".to_owned()),
        gpu_nodes,
        driver_toolkit: tags.map(|tags| {
            tags.iter()
                .map(|v| ((*v).to_owned(), format!("quay.io/ocp/dtk@sha256:{v}")))
                .collect()
        }),
        ..facts()
    };
    for (name, key) in [("repos", "r.repo"), ("certs", "ca.crt")] {
        f.driver_config_maps.insert(
            name.to_owned(),
            ConfigMapData {
                name: name.to_owned(),
                data: [(key.to_owned(), "x".to_owned())].into(),
            },
        );
    }
    f
}

fn names(objects: &OperandObjects) -> Vec<String> {
    objects
        .daemon_sets
        .iter()
        .map(|ds| ds.metadata.name.clone().unwrap())
        .collect()
}

#[test]
fn each_rhcos_version_gets_a_driver_daemonset_with_its_toolkit_image_nvidias_names_and_labels() {
    let f = openshift(
        &[("a", Some(V414)), ("b", Some(V414)), ("c", Some(V415))],
        Some(&[V414, V415]),
    );
    let objects = objects(DTK, &f, Operand::Driver);
    assert_eq!(
        names(&objects),
        [
            format!("nvidia-driver-daemonset-{V414}"),
            format!("nvidia-driver-daemonset-{V415}")
        ]
    );
    let ds = &objects.daemon_sets[0];
    let name = ds.metadata.name.clone().unwrap();
    let labels = ds.metadata.labels.clone().unwrap();
    assert_eq!(labels["app"], name);
    assert_eq!(labels["openshift.driver-toolkit"], "true");
    assert_eq!(labels["openshift.driver-toolkit.rhcos"], V414);
    let spec = ds.spec.clone().unwrap();
    assert_eq!(spec.selector.match_labels.unwrap()["app"], name);
    let template = spec.template.metadata.unwrap().labels.unwrap();
    assert_eq!(template["app"], name);
    assert_eq!(template["openshift.driver-toolkit"], "true");
    let p = pod(ds);
    let selector = p.node_selector.clone().unwrap();
    assert_eq!(selector[OSTREE_VERSION], V414);
    assert_eq!(selector["nvidia.com/gpu.deploy.driver"], "true");

    let main = container(&p, "nvidia-driver-ctr");
    assert_eq!(main.command.clone().unwrap(), ["ocp_dtk_entrypoint"]);
    assert_eq!(main.args.clone().unwrap(), ["nv-ctr-run-with-dtk"]);
    assert!(main.image.clone().unwrap().ends_with("-rhcos4.14"));
    assert_eq!(
        mount_path(&main, "shared-nvidia-driver-toolkit"),
        "/mnt/shared-nvidia-driver-toolkit"
    );
    let dtk = container(&p, "openshift-driver-toolkit-ctr");
    assert_eq!(
        dtk.image.clone().unwrap(),
        format!("quay.io/ocp/dtk@sha256:{V414}")
    );
    assert_eq!(env(&dtk, "RHCOS_VERSION").unwrap(), V414);
    assert_eq!(env(&dtk, "NVIDIA_VISIBLE_DEVICES").unwrap(), "void");
    assert!(env(&dtk, "GDS_ENABLED").is_none());
    assert_eq!(dtk.security_context.clone().unwrap().privileged, Some(true));
    for (volume, path) in [
        (
            "shared-nvidia-driver-toolkit",
            "/mnt/shared-nvidia-driver-toolkit",
        ),
        ("var-log", "/var/log"),
        ("mlnx-ofed-usr-src", "/run/mellanox/drivers/usr/src"),
        ("host-os-release", "/host-etc/os-release"),
        // Not in NVIDIA's toolkit container: it builds with the OS's packages too.
        ("repo-config", "/etc/yum.repos.d/r.repo"),
        ("cert-config", "/etc/pki/ca-trust/extracted/pem/ca.crt"),
    ] {
        assert_eq!(mount_path(&dtk, volume), path, "{volume}");
    }
    let shared = p
        .volumes
        .clone()
        .unwrap()
        .into_iter()
        .find(|v| v.name == "shared-nvidia-driver-toolkit")
        .unwrap();
    assert!(shared.empty_dir.is_some());
    // The digest covers the toolkit: the same on manager, driver and toolkit containers.
    let digest = env(&dtk, "DRIVER_CONFIG_DIGEST").unwrap();
    assert_eq!(env(&main, "DRIVER_CONFIG_DIGEST").unwrap(), digest);
    let other = pod(&objects.daemon_sets[1]);
    assert_ne!(
        env(
            &container(&other, "openshift-driver-toolkit-ctr"),
            "DRIVER_CONFIG_DIGEST"
        )
        .unwrap(),
        digest
    );
    assert!(!policy_with(DTK, &f).reported.contains_key(&Operand::Driver));
}

#[test]
fn a_version_without_its_tag_gets_no_daemonset_and_is_reported_with_its_nodes() {
    let f = openshift(
        &[("a", Some(V414)), ("c", Some(V415)), ("d", None)],
        Some(&[V414]),
    );
    let objects = objects(DTK, &f, Operand::Driver);
    assert_eq!(names(&objects), [format!("nvidia-driver-daemonset-{V414}")]);
    let reported = policy_with(DTK, &f).reported[&Operand::Driver].clone();
    assert!(
        reported.contains(&format!(
            "RHCOS {V415} (c): no tag {V415} in ImageStream openshift/driver-toolkit, no driver pod"
        )),
        "{reported}"
    );
    assert!(reported.contains("label, no driver pod: d"), "{reported}");
}

#[test]
fn a_running_pool_keeps_its_toolkit_image_while_its_tag_is_gone() {
    let mut f = openshift(&[("a", Some(V414)), ("c", Some(V415))], Some(&[V414]));
    f.live_driver_toolkit
        .insert(V415.to_owned(), "quay.io/ocp/dtk@sha256:old".to_owned());
    let objects = objects(DTK, &f, Operand::Driver);
    assert_eq!(objects.daemon_sets.len(), 2);
    let dtk = container(
        &pod(&objects.daemon_sets[1]),
        "openshift-driver-toolkit-ctr",
    );
    assert_eq!(dtk.image.unwrap(), "quay.io/ocp/dtk@sha256:old");
    let reported = policy_with(DTK, &f).reported[&Operand::Driver].clone();
    assert!(
        reported.contains("its running pool keeps quay.io/ocp/dtk@sha256:old"),
        "{reported}"
    );
}

#[test]
fn without_the_imagestream_no_toolkit_daemonset_is_rendered_and_status_says_why() {
    let f = openshift(&[("a", Some(V414))], None);
    assert!(objects(DTK, &f, Operand::Driver).daemon_sets.is_empty());
    let reported = policy_with(DTK, &f).reported[&Operand::Driver].clone();
    assert!(
        reported.contains("no ImageStream openshift/driver-toolkit"),
        "{reported}"
    );
}

#[test]
fn gds_and_gdrcopy_build_with_the_toolkit_too() {
    let spec = "{operator: {use_ocp_driver_toolkit: true}, gds: {enabled: true}, \
        gdrcopy: {enabled: true}}";
    let f = openshift(&[("a", Some(V414))], Some(&[V414]));
    let p = pod(&objects(spec, &f, Operand::Driver).daemon_sets[0]);
    let dtk = container(&p, "openshift-driver-toolkit-ctr");
    assert_eq!(env(&dtk, "GDS_ENABLED").unwrap(), "true");
    assert_eq!(env(&dtk, "GDRCOPY_ENABLED").unwrap(), "true");
    for (name, run) in [
        ("nvidia-fs-ctr", "nv-fs-ctr-run-with-dtk"),
        ("nvidia-gdrcopy-ctr", "gdrcopy-ctr-run-with-dtk"),
    ] {
        let c = container(&p, name);
        assert_eq!(c.args.clone().unwrap(), [run]);
        assert_eq!(
            mount_path(&c, "shared-nvidia-driver-toolkit"),
            "/mnt/shared-nvidia-driver-toolkit"
        );
    }
}

#[test]
fn the_standard_driver_renders_unless_the_toolkit_is_asked_for_on_openshift() {
    let f = openshift(&[("a", Some(V414))], Some(&[V414]));
    for spec in ["{}", "{operator: {use_ocp_driver_toolkit: false}}"] {
        assert_eq!(
            names(&objects(spec, &f, Operand::Driver)),
            ["nvidia-driver-daemonset"],
            "{spec}"
        );
    }
    let not_openshift = ClusterFacts {
        openshift: false,
        runtime: Runtime::Containerd,
        ..f
    };
    assert_eq!(
        names(&objects(DTK, &not_openshift, Operand::Driver)),
        ["nvidia-driver-daemonset"]
    );
}

#[test]
fn imagestream_tags_are_read_as_nvidia_reads_them() {
    let stream = serde_json::json!({
        "apiVersion": "image.openshift.io/v1", "kind": "ImageStream",
        "spec": {"tags": [
            {"name": "latest", "from": {"kind": "DockerImage", "name": "quay.io/x@sha256:l"}},
            {"name": V414, "from": {"kind": "DockerImage", "name": "quay.io/x@sha256:a"}},
            {"name": "", "from": {"kind": "DockerImage", "name": "quay.io/x@sha256:b"}},
            {"name": V415},
        ]}
    });
    let tags = crate::facts::driver_toolkit_tags(&stream);
    assert_eq!(
        tags,
        [(V414.to_owned(), "quay.io/x@sha256:a".to_owned())].into()
    );
}

#[test]
fn the_gauges_say_what_nvidias_say() {
    use crate::operands::driver_toolkit::gauges;
    let spec = |s: &str| policy(s).spec.clone();
    let both = openshift(&[("a", Some(V414)), ("c", Some(V415))], Some(&[V414, V415]));
    assert_eq!(gauges(&spec(DTK), &both), [1, 0, 0, 0, 0]);
    assert_eq!(gauges(&spec("{}"), &both), [0; 5]);
    let one_tag = openshift(&[("a", Some(V414)), ("c", Some(V415))], Some(&[V414]));
    assert_eq!(gauges(&spec(DTK), &one_tag), [1, 0, 0, 1, 0]);
    let no_stream = openshift(&[("a", Some(V414))], None);
    assert_eq!(gauges(&spec(DTK), &no_stream), [-1, 0, 1, 0, 0]);
    let unlabelled = openshift(&[("a", None)], Some(&[V414]));
    assert_eq!(gauges(&spec(DTK), &unlabelled), [-1, 1, 0, 0, 0]);
    let broken = ClusterFacts {
        driver_toolkit_broken: true,
        ..both
    };
    assert_eq!(gauges(&spec(DTK), &broken), [1, 0, 0, 0, 1]);
}

#[test]
fn a_running_fleet_is_not_switched_to_or_from_the_toolkit_at_once() {
    let problem = |spec: &str, f: &ClusterFacts| {
        crate::operands::check(Operand::Driver, &policy(spec).spec, f).join("\n")
    };
    let mut standard = openshift(&[("a", Some(V414))], Some(&[V414]));
    standard.live_driver.built_on_node = true;
    standard.live_driver.without_toolkit = true;
    assert!(problem(DTK, &standard).contains(
        "spec.operator.use_ocp_driver_toolkit: the GPU nodes run driver DaemonSets built without"
    ));
    assert!(matches!(
        state(DTK, &standard)
            .operands
            .iter()
            .find(|o| o.operand == Operand::Driver)
            .unwrap()
            .outcome,
        Outcome::Invalid(_)
    ));
    assert_eq!(problem("{}", &standard), "");
    let mut toolkit = openshift(&[("a", Some(V414))], Some(&[V414]));
    toolkit.live_driver.built_on_node = true;
    toolkit
        .live_driver_toolkit
        .insert(V414.to_owned(), "quay.io/x@sha256:a".to_owned());
    assert!(problem("{}", &toolkit).contains("Driver Toolkit DaemonSets"));
    assert_eq!(problem(DTK, &toolkit), "");
}
