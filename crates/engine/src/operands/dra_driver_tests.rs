//! Unit tests of the DRA driver operand (dra_driver.rs).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use serde_json::json;

use super::common::env_value;
use super::dra_driver::*;
use crate::api::{GpuClusterSpec, ImageKind};
use crate::facts::ClusterFacts;
use crate::model::{MANAGED_BY_LABEL, OPERAND_LABEL, Operand};

fn cluster(spec: serde_json::Value) -> ValidatedGpuCluster {
    let spec: GpuClusterSpec = serde_json::from_value(spec).unwrap();
    ValidatedGpuCluster {
        name: "gpu-cluster".into(),
        image: image(&spec, &BTreeMap::new()).unwrap(),
        validator_image: "nvcr.io/nvidia/gpu-operator:v26.7.0".into(),
        images: BTreeMap::from([
            (ImageKind::Dcgm, "nvcr.io/nvidia/cloud-native/dcgm:4".into()),
            (
                ImageKind::DcgmExporter,
                "nvcr.io/nvidia/k8s/dcgm-exporter:4".into(),
            ),
        ]),
        spec,
        invalid: BTreeMap::new(),
    }
}

fn facts() -> ClusterFacts {
    ClusterFacts {
        namespace: "gpu-operator".into(),
        ..ClusterFacts::default()
    }
}

fn class_names(objects: &crate::model::OperandObjects) -> Vec<String> {
    objects
        .dynamic
        .iter()
        .filter(|o| o.types.as_ref().unwrap().kind == "DeviceClass")
        .map(|o| o.metadata.name.clone().unwrap())
        .collect()
}

#[test]
fn dra_driver_renders_nvidias_daemonset_controller_classes_rbac_and_slice_policy() {
    let objects = render(Operand::DraDriver, &cluster(json!({})), &facts()).unwrap();
    let ds = &objects.daemon_sets[0];
    assert_eq!(ds.metadata.name.as_deref(), Some(KUBELET_PLUGIN));
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let names: Vec<&str> = pod.containers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["gpus", "compute-domains"]);
    assert_eq!(pod.service_account_name.as_deref(), Some(KUBELET_PLUGIN_SA));
    assert_eq!(
        pod.node_selector
            .as_ref()
            .unwrap()
            .get(DEPLOY_LABEL)
            .map(String::as_str),
        Some("true")
    );
    let gpus = &pod.containers[0];
    assert_eq!(gpus.image.as_deref(), Some(PINNED_IMAGE));
    let env = gpus.env.as_ref().unwrap();
    assert_eq!(env_value(env, "HEALTHCHECK_PORT"), Some("51516"));
    assert_eq!(
        env_value(env, "KUBELET_PLUGINS_DIRECTORY_PATH"),
        Some("/var/lib/kubelet/plugins")
    );
    assert_eq!(
        pod.init_containers.as_ref().unwrap()[0].name,
        "driver-validation"
    );
    assert_eq!(
        objects.deployments[0].metadata.name.as_deref(),
        Some(CONTROLLER)
    );
    let roles: Vec<&str> = objects
        .cluster_roles
        .iter()
        .map(|r| r.metadata.name.as_deref().unwrap())
        .collect();
    assert_eq!(
        roles,
        [KUBELET_PLUGIN_SA, CONTROLLER, "compute-domain-daemon"]
    );
    assert_eq!(
        class_names(&objects),
        [
            "gpu.nvidia.com",
            "mig.nvidia.com",
            "vfio.gpu.nvidia.com",
            "compute-domain-daemon.nvidia.com",
            "compute-domain-default-channel.nvidia.com"
        ]
    );
    let policy = objects
        .dynamic
        .iter()
        .find(|o| o.types.as_ref().unwrap().kind == "ValidatingAdmissionPolicy")
        .unwrap();
    let user = policy.data["spec"]["matchConditions"][0]["expression"]
        .as_str()
        .unwrap();
    assert!(
        user.contains("system:serviceaccount:gpu-operator:nvidia-dra-driver-kubeletplugin"),
        "{user}"
    );
}

#[test]
fn compute_domains_off_renders_no_controller_no_second_container_and_no_cd_classes() {
    let objects = render(
        Operand::DraDriver,
        &cluster(json!({"draDriver": {"computeDomains": {"enabled": false}}})),
        &facts(),
    )
    .unwrap();
    assert!(objects.deployments.is_empty());
    let pod = objects.daemon_sets[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    assert_eq!(pod.containers.len(), 1);
    assert_eq!(class_names(&objects).len(), 3);
    assert!(
        !objects
            .service_accounts
            .iter()
            .any(|s| s.metadata.name.as_deref() == Some(CONTROLLER))
    );
}

#[test]
fn every_dra_object_carries_the_apply_contract_labels() {
    let c = cluster(json!({
        "deviceClasses": [{"name": "h100", "productName": "H100"}],
        "dcgm": {"enabled": true},
        "dcgmExporter": {}
    }));
    for operand in Operand::GPU_CLUSTER {
        let objects = render(operand, &c, &facts()).unwrap();
        assert!(!objects.is_empty());
        for value in objects.to_json().unwrap() {
            let labels = &value["metadata"]["labels"];
            assert_eq!(labels[OPERAND_LABEL], json!(operand.name()), "{value}");
            assert_eq!(labels[MANAGED_BY_LABEL], json!("gpu-operator"), "{value}");
        }
    }
}

#[test]
fn feature_gates_health_port_and_user_env_reach_the_containers() {
    let c = cluster(json!({"draDriver": {
        "featureGates": {"MPSSupport": true, "AdminAccess": false},
        "gpus": {"kubeletPlugin": {"healthcheck": {"port": 52000}, "env": [{"name": "GPUS_EXTRA", "value": "1"}]}},
        "computeDomains": {"kubeletPlugin": {"healthcheck": {"enabled": false}}}
    }}));
    let objects = render(Operand::DraDriver, &c, &facts()).unwrap();
    let pod = objects.daemon_sets[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let gpus = pod.containers[0].env.as_ref().unwrap();
    assert_eq!(
        env_value(gpus, "FEATURE_GATES"),
        Some("AdminAccess=false,MPSSupport=true")
    );
    assert_eq!(env_value(gpus, "HEALTHCHECK_PORT"), Some("52000"));
    assert_eq!(env_value(gpus, "GPUS_EXTRA"), Some("1"));
    assert_eq!(
        pod.containers[0]
            .liveness_probe
            .as_ref()
            .unwrap()
            .grpc
            .as_ref()
            .unwrap()
            .port,
        52000
    );
    assert!(pod.containers[1].liveness_probe.is_none());
}

#[test]
fn the_image_comes_from_the_spec_then_the_environment_then_the_pin() {
    let spec: GpuClusterSpec = serde_json::from_value(json!({"draDriver": {
        "repository": "r.local/nvidia/", "image": "dra", "version": "v1"}}))
    .unwrap();
    assert_eq!(
        image(&spec, &BTreeMap::new()).unwrap(),
        "r.local/nvidia/dra:v1"
    );
    let env = BTreeMap::from([(IMAGE_ENV.to_owned(), "env/dra:2".to_owned())]);
    assert_eq!(
        image(&GpuClusterSpec::default(), &env).unwrap(),
        "env/dra:2"
    );
    let partial: GpuClusterSpec =
        serde_json::from_value(json!({"draDriver": {"image": "dra"}})).unwrap();
    assert!(
        image(&partial, &env)
            .unwrap_err()
            .contains("spec.draDriver")
    );
}

#[test]
fn attribute_classes_become_cel_over_the_published_attributes() {
    let spec: GpuClusterSpec = serde_json::from_value(json!({"deviceClasses": [
        {"name": "h100", "productName": "H100", "minCudaComputeCapability": "9.0",
         "minMemory": "80Gi", "minDriverVersion": "580.65.06"},
        {"name": "small-mig", "deviceType": "mig", "migProfile": "1g.5gb"},
    ]}))
    .unwrap();
    let classes = spec.device_classes.unwrap();
    let h100 = class_expression(0, &classes[0]).unwrap();
    assert_eq!(
        h100,
        "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu' \
         && device.attributes['gpu.nvidia.com'].productName.contains('H100') \
         && device.attributes['gpu.nvidia.com'].cudaComputeCapability.compareTo(semver('9.0.0')) >= 0 \
         && device.attributes['gpu.nvidia.com'].driverVersion.compareTo(semver('580.65.6')) >= 0 \
         && device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0"
    );
    let mig = class_expression(1, &classes[1]).unwrap();
    assert!(
        mig.contains("type == 'mig'") && mig.contains("profile == '1g.5gb'"),
        "{mig}"
    );
}

#[test]
fn an_unknown_attribute_is_reported_with_the_ones_the_driver_publishes() {
    let spec: GpuClusterSpec = serde_json::from_value(json!({"deviceClasses": [
        {"name": "fast", "expressions": ["device.attributes['gpu.nvidia.com'].clockMHz > 1000"]},
        {"name": "ok", "expressions": ["device.capacity['gpu.nvidia.com'].memorySlice3 > quantity('0')"]},
    ]}))
    .unwrap();
    let problems = check_classes(&spec);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].starts_with("spec.deviceClasses[0].expressions[0]: clockMHz"),
        "{}",
        problems[0]
    );
    assert!(problems[0].contains("productName") && problems[0].contains("cudaComputeCapability"));
}

#[test]
fn bad_versions_reserved_duplicate_names_and_profiles_on_gpus_are_refused_naming_the_field() {
    let spec: GpuClusterSpec = serde_json::from_value(json!({"deviceClasses": [
        {"name": "a", "minCudaComputeCapability": "nine"},
        {"name": "gpu.nvidia.com"},
        {"name": "b", "migProfile": "1g.5gb"},
        {"name": "b"},
    ]}))
    .unwrap();
    let problems = check_classes(&spec).join("\n");
    assert!(
        problems.contains("spec.deviceClasses[0].minCudaComputeCapability"),
        "{problems}"
    );
    assert!(
        problems.contains("spec.deviceClasses[1].name"),
        "{problems}"
    );
    assert!(
        problems.contains("spec.deviceClasses[2].migProfile"),
        "{problems}"
    );
    assert!(
        problems.contains("spec.deviceClasses[3].name: b is listed twice"),
        "{problems}"
    );
}

fn kinds_named(objects: &crate::model::OperandObjects, kind: &str) -> Vec<String> {
    objects
        .dynamic
        .iter()
        .filter(|o| o.types.as_ref().unwrap().kind == kind)
        .map(|o| o.metadata.name.clone().unwrap())
        .collect()
}

fn has_rule(
    rules: &[k8s_openapi::api::rbac::v1::PolicyRule],
    group: &str,
    resource: &str,
    verbs: &[&str],
) -> bool {
    rules.iter().any(|r| {
        r.api_groups.iter().flatten().any(|g| g == group)
            && r.resources.iter().flatten().any(|x| x == resource)
            && verbs.iter().all(|v| r.verbs.iter().any(|x| x == v))
    })
}

#[test]
fn gpu_cluster_dcgm_follows_nvidias_defaults_off_unless_enabled_and_exporter_when_present() {
    let none = cluster(json!({}));
    assert!(render(Operand::DcgmDra, &none, &facts()).is_none());
    assert!(render(Operand::DcgmExporterDra, &none, &facts()).is_none());
    let on = cluster(json!({"dcgm": {"enabled": true}, "dcgmExporter": {}}));
    assert!(render(Operand::DcgmDra, &on, &facts()).is_some());
    assert!(render(Operand::DcgmExporterDra, &on, &facts()).is_some());
    let off = cluster(json!({"dcgm": {}, "dcgmExporter": {"enabled": false}}));
    assert!(render(Operand::DcgmDra, &off, &facts()).is_none());
    assert!(render(Operand::DcgmExporterDra, &off, &facts()).is_none());
}

#[test]
fn gpu_cluster_exporter_runs_in_dra_mode_with_an_admin_claim_and_resource_api_reads() {
    let c = cluster(
        json!({"dcgm": {"enabled": true}, "dcgmExporter": {"env": [{"name": "X", "value": "1"}]}}),
    );
    let objects = render(Operand::DcgmExporterDra, &c, &facts()).unwrap();
    let ds = &objects.daemon_sets[0];
    assert_eq!(
        ds.metadata.name.as_deref(),
        Some("nvidia-dcgm-exporter-dra")
    );
    let pod = &super::test_support::pod(&objects.daemon_sets[0]);
    assert_eq!(
        pod.service_account_name.as_deref(),
        Some("nvidia-dcgm-exporter-dra")
    );
    assert_eq!(pod.automount_service_account_token, Some(true));
    assert_eq!(
        pod.node_selector
            .as_ref()
            .unwrap()
            .get("nvidia.com/gpu.deploy.dcgm-exporter-dra")
            .map(String::as_str),
        Some("true")
    );
    assert!(pod.init_containers.is_none(), "no toolkit wait under DRA");
    assert!(pod.runtime_class_name.is_none());
    let main = &pod.containers[0];
    let env = main.env.as_ref().unwrap();
    assert_eq!(env_value(env, "KUBERNETES_ENABLE_DRA"), Some("true"));
    assert_eq!(
        env_value(env, "DCGM_REMOTE_HOSTENGINE_INFO"),
        Some("nvidia-dcgm-dra:5555")
    );
    assert_eq!(env_value(env, "X"), Some("1"));
    let claims = pod.resource_claims.as_ref().unwrap();
    assert_eq!(claims[0].name, ADMIN_CLAIM);
    assert_eq!(
        claims[0].resource_claim_template_name.as_deref(),
        Some("nvidia-dcgm-exporter-admin")
    );
    assert_eq!(
        main.resources.as_ref().unwrap().claims.as_ref().unwrap()[0].name,
        ADMIN_CLAIM
    );
    assert_eq!(
        kinds_named(&objects, "ResourceClaimTemplate"),
        ["nvidia-dcgm-exporter-admin"]
    );
    let template = objects
        .dynamic
        .iter()
        .find(|o| o.types.as_ref().unwrap().kind == "ResourceClaimTemplate")
        .unwrap();
    assert_eq!(
        template.data["spec"]["spec"]["devices"]["requests"][0]["exactly"],
        json!({"deviceClassName": "gpu.nvidia.com", "allocationMode": "All", "adminAccess": true})
    );
    let role = objects
        .roles
        .iter()
        .find(|r| r.metadata.name.as_deref() == Some("nvidia-dcgm-exporter-dra"))
        .unwrap();
    assert!(has_rule(
        role.rules.as_ref().unwrap(),
        "resource.k8s.io",
        "resourceclaims",
        &["get", "list", "watch"]
    ));
    let cluster_role = objects
        .cluster_roles
        .iter()
        .find(|r| r.metadata.name.as_deref() == Some("nvidia-dcgm-exporter-dra-read-pods"))
        .unwrap();
    assert!(has_rule(
        cluster_role.rules.as_ref().unwrap(),
        "resource.k8s.io",
        "resourceslices",
        &["get", "list", "watch"]
    ));
    assert!(has_rule(
        cluster_role.rules.as_ref().unwrap(),
        "",
        "pods",
        &["get", "list", "watch"]
    ));
    assert_eq!(
        objects.services[0].metadata.name.as_deref(),
        Some("nvidia-dcgm-exporter-dra")
    );
}

#[test]
fn gpu_cluster_exporter_without_dcgm_uses_its_embedded_engine() {
    let c = cluster(json!({"dcgmExporter": {}}));
    let objects = render(Operand::DcgmExporterDra, &c, &facts()).unwrap();
    let env = super::test_support::pod(&objects.daemon_sets[0]).containers[0]
        .env
        .clone()
        .unwrap();
    assert_eq!(env_value(&env, "DCGM_REMOTE_HOSTENGINE_INFO"), None);
}

#[test]
fn gpu_cluster_dcgm_claims_every_gpu_and_keeps_its_service_node_local() {
    let c = cluster(
        json!({"dcgm": {"enabled": true}, "daemonsets": {"priorityClassName": "gpu-critical"}}),
    );
    let objects = render(Operand::DcgmDra, &c, &facts()).unwrap();
    assert_eq!(
        objects.daemon_sets[0].metadata.name.as_deref(),
        Some("nvidia-dcgm-dra")
    );
    let pod = &super::test_support::pod(&objects.daemon_sets[0]);
    assert_eq!(pod.priority_class_name.as_deref(), Some("gpu-critical"));
    assert_eq!(
        pod.resource_claims.as_ref().unwrap()[0]
            .resource_claim_template_name
            .as_deref(),
        Some("nvidia-dcgm-admin")
    );
    assert!(pod.init_containers.is_none());
    assert_eq!(
        pod.containers[0].image.as_deref(),
        Some("nvcr.io/nvidia/cloud-native/dcgm:4")
    );
    let service = &objects.services[0];
    assert_eq!(service.metadata.name.as_deref(), Some("nvidia-dcgm-dra"));
    assert_eq!(
        service
            .spec
            .as_ref()
            .unwrap()
            .internal_traffic_policy
            .as_deref(),
        Some("Local")
    );
    assert!(has_rule(
        objects.roles[0].rules.as_ref().unwrap(),
        "resource.k8s.io",
        "resourceclaims",
        &["get", "list", "watch"]
    ));
}

#[test]
fn dra_validator_claims_one_gpu_and_lists_it_with_nvidia_smi() {
    let c = cluster(
        json!({"draDriver": {"imagePullPolicy": "Always", "imagePullSecrets": ["regcred"]}}),
    );
    let objects = render(Operand::DraValidator, &c, &facts()).unwrap();
    let ds = &objects.daemon_sets[0];
    assert_eq!(ds.metadata.name.as_deref(), Some("nvidia-dra-validator"));
    let pod = &super::test_support::pod(&objects.daemon_sets[0]);
    assert_eq!(
        pod.node_selector
            .as_ref()
            .unwrap()
            .get("nvidia.com/gpu.deploy.dra-validator")
            .map(String::as_str),
        Some("true")
    );
    let init = &pod.init_containers.as_ref().unwrap()[0];
    assert_eq!(init.name, "gpu-validation");
    assert_eq!(init.args.as_ref().unwrap(), &["nvidia-smi -L"]);
    assert_eq!(
        init.image.as_deref(),
        Some("nvcr.io/nvidia/gpu-operator:v26.7.0")
    );
    assert_eq!(init.image_pull_policy.as_deref(), Some("Always"));
    assert_eq!(
        init.resources.as_ref().unwrap().claims.as_ref().unwrap()[0].name,
        "validation-gpu"
    );
    assert_eq!(pod.image_pull_secrets.as_ref().unwrap()[0].name, "regcred");
    assert_eq!(
        pod.resource_claims.as_ref().unwrap()[0]
            .resource_claim_template_name
            .as_deref(),
        Some("nvidia-dra-validator-gpu")
    );
    let template = objects
        .dynamic
        .iter()
        .find(|o| o.types.as_ref().unwrap().kind == "ResourceClaimTemplate")
        .unwrap();
    assert_eq!(
        template.data["spec"]["spec"]["devices"]["requests"][0]["exactly"],
        json!({"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 1, "adminAccess": true})
    );
}

#[test]
fn an_unwatched_metrics_configmap_and_an_unserved_service_monitor_are_reported_not_acted_on() {
    let spec: GpuClusterSpec = serde_json::from_value(json!({
        "dcgm": {"enabled": true},
        "dcgmExporter": {"config": {"name": "metrics"}, "serviceMonitor": {"enabled": true}}
    }))
    .unwrap();
    let lines = not_acted_on(&spec, false);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(
        lines[0].starts_with("spec.dcgmExporter.config.name"),
        "{lines:?}"
    );
    assert_eq!(not_acted_on(&spec, true).len(), 1);
    let deployed: GpuClusterSpec =
        serde_json::from_value(json!({"dcgm": {"enabled": true}, "dcgmExporter": {}})).unwrap();
    assert!(
        not_acted_on(&deployed, false).is_empty(),
        "DCGM and the exporter are deployed"
    );
}

#[test]
fn dra_plugin_and_compute_domain_daemons_write_only_under_a_confinement_policy() {
    let spec = json!({"draDriver": {"computeDomains": {"enabled": true}}});
    let objects = render(Operand::DraDriver, &cluster(spec), &facts()).unwrap();
    assert!(
        objects
            .service_accounts
            .iter()
            .any(|sa| sa.metadata.name.as_deref() == Some(CD_DAEMON_SA))
    );
    let unconfined = super::common::unconfined_writes(&[&objects], "gpu-operator", &[CD_DAEMON_SA]);
    assert!(unconfined.is_empty(), "{unconfined:?}");
}

#[test]
fn the_mps_role_comes_with_the_mps_support_gate_and_the_dra_driver_scc_on_openshift() {
    let roles = |spec: serde_json::Value, facts: &ClusterFacts| {
        let objects = render(Operand::DraDriver, &cluster(spec), facts).unwrap();
        let names: Vec<String> = objects
            .roles
            .iter()
            .map(|r| r.metadata.name.clone().unwrap())
            .collect();
        (names, kinds_named(&objects, "SecurityContextConstraints"))
    };
    let (plain, sccs) = roles(json!({}), &facts());
    assert!(!plain.contains(&"nvidia-dra-driver-kubeletplugin-mps".to_owned()));
    assert!(sccs.is_empty());
    let openshift = ClusterFacts {
        openshift: true,
        ..facts()
    };
    let (mps, sccs) = roles(
        json!({"draDriver": {"featureGates": {"MPSSupport": true}}}),
        &openshift,
    );
    assert!(mps.contains(&"nvidia-dra-driver-kubeletplugin-mps".to_owned()));
    assert_eq!(sccs, [SCC]);
    let objects = render(Operand::DraDriver, &cluster(json!({})), &openshift).unwrap();
    let scc = objects
        .dynamic
        .iter()
        .find(|o| o.types.as_ref().unwrap().kind == "SecurityContextConstraints")
        .unwrap();
    assert_eq!(
        scc.data["users"],
        json!([
            "system:serviceaccount:gpu-operator:nvidia-dra-driver-kubeletplugin",
            "system:serviceaccount:gpu-operator:compute-domain-daemon-service-account",
        ])
    );
}
