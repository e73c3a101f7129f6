//! The GPUCluster stack against the real control plane: the DRA driver rendered, ready and
//! removed; real ResourceClaims allocated by the real kube-scheduler from the stand-in kubelet
//! plugin's ResourceSlices (by memory, by an attribute class, MIG profiles, a shared claim);
//! a ClusterPolicy beside a GPUCluster reported with nothing deleted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use e2e::cluster::unique_name;
use e2e::dra;
use e2e::nodes::{self, GpuModel};
use e2e::operator::{Operator, OperatorIdentity};
use e2e::session::{self, Crd, TIMEOUT};
use e2e::wait;
use gpu_operator::api::{GPU_CLUSTER_NAME, GPUCluster, GpuClusterState};
use gpu_operator::operands::dra_driver;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::rbac::v1::ClusterRole;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

struct Dra {
    admin: Client,
    identity: OperatorIdentity,
    operator: Operator,
}

fn clusters(client: &Client) -> Api<GPUCluster> {
    Api::all(client.clone())
}

fn dynamic(client: &Client, group: &str, kind: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(group, "v1", kind);
    Api::all_with(client.clone(), &ApiResource::from_gvk(&gvk))
}

async fn remove_gpu_cluster(admin: &Client) {
    dra::remove_gpu_cluster(admin).await.unwrap();
}

/// Both CRDs installed, leftovers removed, the operator running; no policy yet. `None` where
/// this run has no test cluster (the test is skipped).
async fn start() -> Option<Dra> {
    let prepared = session::builder().crd(Crd::GpuCluster).prepare().await?;
    remove_gpu_cluster(&prepared.admin).await;
    dra::remove_all(&prepared.admin).await.unwrap();
    dra::publish_fleet(&prepared.admin).await.unwrap();
    let (admin, identity, operator) = prepared.start_operator().await;
    Some(Dra {
        admin,
        identity,
        operator,
    })
}

impl Dra {
    async fn create_gpu_cluster(&self, spec: Value) {
        let cluster: GPUCluster = serde_json::from_value(json!({
            "apiVersion": "nvidia.com/v1alpha1", "kind": "GPUCluster",
            "metadata": {"name": GPU_CLUSTER_NAME}, "spec": spec
        }))
        .unwrap();
        clusters(&self.admin)
            .create(&PostParams::default(), &cluster)
            .await
            .unwrap();
    }

    /// Waits until the GPUCluster reports `want` for its generation; returns its Ready message.
    async fn await_state(&self, want: GpuClusterState, what: &str) -> String {
        dra::await_state(&self.admin, want, TIMEOUT, what)
            .await
            .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", self.operator.log_text()))
    }

    async fn stop(mut self) {
        remove_gpu_cluster(&self.admin).await;
        dra::remove_all(&self.admin).await.unwrap();
        self.operator.terminate(Duration::from_secs(20)).unwrap();
        self.identity.delete().await.unwrap();
    }
}

const CLASSES: &str = "deviceClasses";

fn attribute_classes() -> Value {
    json!([
        {"name": "h100", "productName": "H100"},
        {"name": "gpu-80gb", "minMemory": "80Gi"},
        {"name": "hopper-cc90", "architecture": "Hopper", "minCudaComputeCapability": "9.0"},
    ])
}

#[tokio::test]
async fn gpu_cluster_renders_the_dra_driver_reaches_ready_and_deleting_it_removes_everything() {
    let Some(dra) = start().await else {
        return;
    };
    let ns = dra.identity.namespace.clone();
    dra.create_gpu_cluster(json!({CLASSES: attribute_classes()}))
        .await;
    dra.await_state(GpuClusterState::Ready, "GPUCluster ready")
        .await;

    let ds = Api::<DaemonSet>::namespaced(dra.admin.clone(), &ns)
        .get("nvidia-dra-driver-kubelet-plugin")
        .await
        .unwrap();
    let containers: Vec<String> = ds
        .spec
        .unwrap()
        .template
        .spec
        .unwrap()
        .containers
        .iter()
        .map(|c| c.name.clone())
        .collect();
    assert_eq!(containers, ["gpus", "compute-domains"]);
    Api::<Deployment>::namespaced(dra.admin.clone(), &ns)
        .get("nvidia-dra-driver-controller")
        .await
        .unwrap();
    let roles = Api::<ClusterRole>::all(dra.admin.clone());
    roles.get("nvidia-dra-driver-kubeletplugin").await.unwrap();
    let classes = dynamic(&dra.admin, "resource.k8s.io", "DeviceClass");
    for name in [
        "gpu.nvidia.com",
        "mig.nvidia.com",
        "vfio.gpu.nvidia.com",
        "h100",
        "gpu-80gb",
        "hopper-cc90",
    ] {
        classes
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("DeviceClass {name}: {e}"));
    }
    dynamic(
        &dra.admin,
        "admissionregistration.k8s.io",
        "ValidatingAdmissionPolicy",
    )
    .get("resourceslices-policy-nvidia-dra-driver")
    .await
    .unwrap();
    // Every GPU node was labelled for the kubelet plugin, under the teardown finalizer.
    let gpu_nodes = nodes::gpu_node_names(&dra.admin).await.unwrap();
    assert!(!gpu_nodes.is_empty());
    let node_api = Api::<Node>::all(dra.admin.clone());
    for name in &gpu_nodes {
        let node = node_api.get(name).await.unwrap();
        assert_eq!(
            node.labels()
                .get(dra_driver::DEPLOY_LABEL)
                .map(String::as_str),
            Some("true"),
            "{name}"
        );
    }
    assert!(gpu_operator::cleanup::has_finalizer(
        &clusters(&dra.admin).get(GPU_CLUSTER_NAME).await.unwrap()
    ));
    // A value someone else set is theirs: it stays.
    let theirs = &gpu_nodes[0];
    let user_value = json!({"metadata": {"labels": {"nvidia.com/gpu.deploy.dcgm-dra": "false"}}});
    node_api
        .patch(theirs, &PatchParams::default(), &Patch::Merge(&user_value))
        .await
        .unwrap();

    // Deleting the GPUCluster removes its objects (garbage collection through owner references)
    // and, before it goes, the labels it set on the nodes.
    clusters(&dra.admin)
        .delete(GPU_CLUSTER_NAME, &DeleteParams::default())
        .await
        .unwrap();
    let managed = ListParams::default()
        .labels("nvidia.com/gpu-operator.operand in (dra-driver,dra-device-classes)");
    wait::until_none_left(&classes, &managed, TIMEOUT, "DeviceClasses collected")
        .await
        .unwrap();
    wait::until_none_left(
        &Api::<DaemonSet>::namespaced(dra.admin.clone(), &ns),
        &managed,
        TIMEOUT,
        "DaemonSet collected",
    )
    .await
    .unwrap();
    wait::until_none_left(&roles, &managed, TIMEOUT, "ClusterRoles collected")
        .await
        .unwrap();
    for name in &gpu_nodes {
        let labels = node_api.get(name).await.unwrap().labels().clone();
        let left: Vec<&String> = dra_driver::deploy_keys()
            .filter_map(|key| labels.get_key_value(key))
            .filter(|(_, value)| value.as_str() == "true")
            .map(|(key, _)| key)
            .collect();
        assert!(left.is_empty(), "{name} keeps {left:?}");
    }
    let theirs_now = node_api.get(theirs).await.unwrap();
    assert_eq!(
        theirs_now
            .labels()
            .get("nvidia.com/gpu.deploy.dcgm-dra")
            .map(String::as_str),
        Some("false")
    );
    let unset = json!({"metadata": {"labels": {"nvidia.com/gpu.deploy.dcgm-dra": null}}});
    node_api
        .patch(theirs, &PatchParams::default(), &Patch::Merge(&unset))
        .await
        .unwrap();
    dra.stop().await;
}

fn pods(client: &Client, ns: &str) -> Api<Pod> {
    Api::namespaced(client.clone(), ns)
}

async fn create_namespace(client: &Client, name: &str) {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
}

async fn create(client: &Client, ns: &str, kind: &str, body: Value) {
    let gvk = GroupVersionKind::gvk("resource.k8s.io", "v1", kind);
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk));
    let obj: DynamicObject = serde_json::from_value(body).unwrap();
    api.create(&PostParams::default(), &obj).await.unwrap();
}

fn template(name: &str, requests: Value) -> Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": name}, "spec": {"spec": {"devices": {"requests": requests}}}})
}

fn request(name: &str, class: &str, cel: Option<&str>) -> Value {
    let mut exactly = json!({"deviceClassName": class});
    if let Some(cel) = cel {
        exactly["selectors"] = json!([{"cel": {"expression": cel}}]);
    }
    json!({"name": name, "exactly": exactly})
}

/// A pod whose containers each use every claim; `claims` are (name, template or claim name,
/// from a template).
async fn claim_pod(
    client: &Client,
    ns: &str,
    name: &str,
    containers: usize,
    claims: &[(&str, &str, bool)],
) {
    let resource_claims: Vec<Value> = claims
        .iter()
        .map(|(n, source, from_template)| {
            if *from_template {
                json!({"name": n, "resourceClaimTemplateName": source})
            } else {
                json!({"name": n, "resourceClaimName": source})
            }
        })
        .collect();
    let uses: Vec<Value> = claims.iter().map(|(n, _, _)| json!({"name": n})).collect();
    let containers: Vec<Value> = (0..containers)
        .map(|i| json!({"name": format!("c{i}"), "image": "registry.k8s.io/pause:3.10", "resources": {"claims": uses}}))
        .collect();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"containers": containers, "resourceClaims": resource_claims,
                 "tolerations": [{"operator": "Exists"}]}
    }))
    .unwrap();
    pods(client, ns)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
}

async fn scheduled_node(client: &Client, ns: &str, name: &str) -> String {
    let api = pods(client, ns);
    wait::until(TIMEOUT, &format!("pod {name} scheduled"), || {
        let api = api.clone();
        async move {
            let p = api.get(name).await?;
            Ok(match p.spec.as_ref().and_then(|s| s.node_name.clone()) {
                Some(n) => Ok(n),
                None => Err(format!("{:?}", p.status.and_then(|s| s.conditions))),
            })
        }
    })
    .await
    .unwrap()
}

/// Waits until the scheduler has said the pod cannot be placed; returns its message.
async fn unschedulable(client: &Client, ns: &str, name: &str) -> String {
    let api = pods(client, ns);
    wait::until(TIMEOUT, &format!("pod {name} unschedulable"), || {
        let api = api.clone();
        async move {
            let p = api.get(name).await?;
            let cond = p
                .status
                .and_then(|s| s.conditions)
                .into_iter()
                .flatten()
                .find(|c| {
                    c.type_ == "PodScheduled"
                        && c.status == "False"
                        && c.reason.as_deref() == Some("Unschedulable")
                });
            Ok(cond
                .map(|c| c.message.unwrap_or_default())
                .ok_or_else(|| "not yet".to_owned()))
        }
    })
    .await
    .unwrap()
}

/// Fake GPU nodes of the given models with the stand-in's ResourceSlices, by name.
async fn dra_nodes(client: &Client, prefix: &str, models: &[GpuModel]) -> Vec<(String, GpuModel)> {
    let made: Vec<(String, GpuModel)> = models
        .iter()
        .map(|m| (format!("{prefix}-{}", m.slug()), *m))
        .collect();
    let fakes: Vec<_> = made
        .iter()
        .map(|(n, m)| session::ephemeral_gpu_node(n, *m))
        .collect();
    nodes::create(client, &fakes).await.unwrap();
    for (name, model) in &made {
        dra::publish(client, name, dra::gpu_devices(name, *model))
            .await
            .unwrap();
    }
    made
}

const MEMORY_40GI: &str =
    "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0";

#[tokio::test]
async fn claims_by_attribute_land_only_on_matching_gpus_and_an_impossible_one_stays_pending() {
    let Some(dra) = start().await else {
        return;
    };
    dra.create_gpu_cluster(json!({CLASSES: attribute_classes()}))
        .await;
    dra.await_state(GpuClusterState::Ready, "GPUCluster ready")
        .await;
    let prefix = unique_name("dra");
    let made = dra_nodes(
        &dra.admin,
        &prefix,
        &[
            GpuModel::T4,
            GpuModel::A100Sxm40Gb,
            GpuModel::A100Sxm80Gb,
            GpuModel::H100Sxm80Gb,
        ],
    )
    .await;
    let node = |m: GpuModel| made.iter().find(|(_, mm)| *mm == m).unwrap().0.clone();
    let ns = unique_name("gpu-claim");
    create_namespace(&dra.admin, &ns).await;
    create(
        &dra.admin,
        &ns,
        "ResourceClaimTemplate",
        template(
            "big",
            json!([request("big", "gpu.nvidia.com", Some(MEMORY_40GI))]),
        ),
    )
    .await;
    create(
        &dra.admin,
        &ns,
        "ResourceClaimTemplate",
        template("h100", json!([request("gpu", "h100", None)])),
    )
    .await;
    create(
        &dra.admin,
        &ns,
        "ResourceClaimTemplate",
        template(
            "huge",
            json!([request(
                "gpu",
                "gpu.nvidia.com",
                Some("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('200Gi')) >= 0")
            )]),
        ),
    )
    .await;

    // Eight pods asking for >= 40Gi: the 16 big GPUs fit them; the T4 (15Gi) and the
    // A100-40GB (NVML reports 40536Mi) never match.
    let allowed = [node(GpuModel::A100Sxm80Gb), node(GpuModel::H100Sxm80Gb)];
    for i in 0..8 {
        claim_pod(
            &dra.admin,
            &ns,
            &format!("big-{i}"),
            1,
            &[("gpu", "big", true)],
        )
        .await;
    }
    for i in 0..8 {
        let on = scheduled_node(&dra.admin, &ns, &format!("big-{i}")).await;
        assert!(
            allowed.contains(&on),
            "big-{i} landed on {on}, not on {allowed:?}"
        );
    }
    claim_pod(&dra.admin, &ns, "by-class", 1, &[("gpu", "h100", true)]).await;
    assert_eq!(
        scheduled_node(&dra.admin, &ns, "by-class").await,
        node(GpuModel::H100Sxm80Gb)
    );

    claim_pod(&dra.admin, &ns, "too-big", 1, &[("gpu", "huge", true)]).await;
    let why = unschedulable(&dra.admin, &ns, "too-big").await;
    let p = pods(&dra.admin, &ns).get("too-big").await.unwrap();
    assert!(
        p.spec.unwrap().node_name.is_none(),
        "too-big was placed: {why}"
    );

    Api::<Namespace>::all(dra.admin.clone())
        .delete(&ns, &DeleteParams::default())
        .await
        .unwrap();
    let names: Vec<String> = made.into_iter().map(|(n, _)| n).collect();
    nodes::delete(&dra.admin, &names).await.unwrap();
    dra.stop().await;
}

#[tokio::test]
async fn mig_profile_requests_are_allocated_on_one_partitioned_a100_and_a_shared_claim_once() {
    let Some(dra) = start().await else {
        return;
    };
    dra.create_gpu_cluster(json!({})).await;
    dra.await_state(GpuClusterState::Ready, "GPUCluster ready")
        .await;
    let name = format!("{}-a100-mig", unique_name("dra"));
    nodes::create(
        &dra.admin,
        &[session::ephemeral_gpu_node(&name, GpuModel::A100Sxm40Gb)],
    )
    .await
    .unwrap();
    let devices: Vec<Value> = (0..2)
        .flat_map(|minor| dra::a100_40gb_balanced_mig_devices(&name, minor))
        .collect();
    dra::publish(&dra.admin, &name, devices).await.unwrap();
    let ns = unique_name("gpu-claim");
    create_namespace(&dra.admin, &ns).await;
    let profile = |p: &str| format!("device.attributes['gpu.nvidia.com'].profile == '{p}'");
    create(
        &dra.admin,
        &ns,
        "ResourceClaimTemplate",
        template(
            "gpu-devices",
            json!([
                request("1g-5gb-0", "mig.nvidia.com", Some(&profile("1g.5gb"))),
                request("1g-5gb-1", "mig.nvidia.com", Some(&profile("1g.5gb"))),
                request("2g-10gb", "mig.nvidia.com", Some(&profile("2g.10gb"))),
                request("3g-20gb", "mig.nvidia.com", Some(&profile("3g.20gb"))),
            ]),
        ),
    )
    .await;
    claim_pod(&dra.admin, &ns, "mig", 1, &[("gpu", "gpu-devices", true)]).await;
    assert_eq!(scheduled_node(&dra.admin, &ns, "mig").await, name);
    let claims = {
        let gvk = GroupVersionKind::gvk("resource.k8s.io", "v1", "ResourceClaim");
        Api::<DynamicObject>::namespaced_with(dra.admin.clone(), &ns, &ApiResource::from_gvk(&gvk))
    };
    let pod = pods(&dra.admin, &ns).get("mig").await.unwrap();
    let claim_name = pod.status.unwrap().resource_claim_statuses.unwrap()[0]
        .resource_claim_name
        .clone()
        .unwrap();
    let claim = claims.get(&claim_name).await.unwrap();
    let results = claim.data["status"]["allocation"]["devices"]["results"]
        .as_array()
        .unwrap()
        .clone();
    let profiles: Vec<String> = results
        .iter()
        .map(|r| r["device"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(results.len(), 4, "{profiles:?}");
    assert!(
        results.iter().all(|r| r["pool"] == json!(name)),
        "{results:?}"
    );

    // One claim by name, two containers of one pod: allocated once, reserved for the one pod.
    create(&dra.admin, &ns, "ResourceClaim", json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "shared"},
        "spec": {"devices": {"requests": [request("mig", "mig.nvidia.com", Some(&profile("1g.5gb")))]}}})).await;
    claim_pod(&dra.admin, &ns, "sharing", 2, &[("gpu", "shared", false)]).await;
    assert_eq!(scheduled_node(&dra.admin, &ns, "sharing").await, name);
    let shared = claims.get("shared").await.unwrap();
    let results = shared.data["status"]["allocation"]["devices"]["results"]
        .as_array()
        .unwrap();
    assert_eq!(results.len(), 1, "{results:?}");
    let reserved = shared.data["status"]["reservedFor"].as_array().unwrap();
    assert_eq!(reserved.len(), 1, "{reserved:?}");
    assert_eq!(reserved[0]["name"], json!("sharing"));

    Api::<Namespace>::all(dra.admin.clone())
        .delete(&ns, &DeleteParams::default())
        .await
        .unwrap();
    nodes::delete(&dra.admin, &[name]).await.unwrap();
    dra.stop().await;
}

#[tokio::test]
async fn a_cluster_policy_beside_a_gpu_cluster_is_reported_in_both_and_nothing_is_deleted() {
    let Some(dra) = start().await else {
        return;
    };
    let ns = dra.identity.namespace.clone();
    dra.create_gpu_cluster(json!({CLASSES: attribute_classes()}))
        .await;
    dra.await_state(GpuClusterState::Ready, "GPUCluster ready")
        .await;
    let ds_api = Api::<DaemonSet>::namespaced(dra.admin.clone(), &ns);
    let before = ds_api
        .get("nvidia-dra-driver-kubelet-plugin")
        .await
        .unwrap();

    // A default ClusterPolicy deploys the device plugin on the same GPU nodes.
    let policy = unique_name("cluster-policy");
    session::create_policy(&dra.admin, &policy, json!({})).await;
    let message = dra
        .await_state(GpuClusterState::NotReady, "GPUCluster reports the conflict")
        .await;
    assert!(
        message.contains(&policy) && message.contains("devicePlugin.enabled=false"),
        "{message}"
    );
    wait::until(TIMEOUT, "ClusterPolicy reports the GPUCluster", || {
        let admin = dra.admin.clone();
        let policy = policy.clone();
        async move {
            let m = session::ready_message(&admin, &policy).await?;
            Ok(if m.contains("GPUCluster gpu-cluster") {
                Ok(())
            } else {
                Err(m)
            })
        }
    })
    .await
    .unwrap();
    ds_api.get("nvidia-device-plugin-daemonset").await.unwrap();
    let after = ds_api
        .get("nvidia-dra-driver-kubelet-plugin")
        .await
        .unwrap();
    assert_eq!(
        before.metadata.uid, after.metadata.uid,
        "the DRA DaemonSet was replaced"
    );
    assert!(after.metadata.deletion_timestamp.is_none());
    dynamic(&dra.admin, "resource.k8s.io", "DeviceClass")
        .get("h100")
        .await
        .unwrap();

    // Switching the device plugin off resolves it; still nothing of either was deleted.
    session::policies(&dra.admin)
        .patch(
            &policy,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"devicePlugin": {"enabled": false}}})),
        )
        .await
        .unwrap();
    dra.await_state(GpuClusterState::Ready, "GPUCluster ready again")
        .await;
    let again = ds_api
        .get("nvidia-dra-driver-kubelet-plugin")
        .await
        .unwrap();
    assert_eq!(before.metadata.uid, again.metadata.uid);
    ds_api.get("nvidia-driver-daemonset").await.unwrap();

    session::policies(&dra.admin)
        .delete(&policy, &DeleteParams::default())
        .await
        .unwrap();
    dra.stop().await;
    let _ = ds_api
        .list(&ListParams::default())
        .await
        .map(|l| l.items.iter().map(|d| d.name_any()).collect::<Vec<_>>());
}

/// With compute domains on (a GPUCluster's default) the operator installs NVIDIA's two
/// ComputeDomain CRDs; a ComputeDomain is accepted; the compute-domain controller's and the
/// kubelet plugin's rendered identities may make their requests on it; and DCGM, its exporter
/// in DRA mode (with the ResourceSlice reads that mode needs) and the DRA validator are
/// rendered. kwok runs none of them, so their contracts are what is checked.
#[tokio::test]
async fn compute_domain_crds_are_installed_and_dcgm_its_exporter_and_the_validator_follow_dra() {
    use e2e::operator::{Access, may};
    use gpu_operator::operands::{dcgm, dcgm_exporter, dra_driver, validator};
    let Some(dra) = start().await else {
        return;
    };
    let ns = dra.identity.namespace.clone();
    dra.create_gpu_cluster(json!({"dcgm": {"enabled": true}, "dcgmExporter": {}}))
        .await;
    dra.await_state(GpuClusterState::Ready, "GPUCluster ready")
        .await;
    for crd in dra_driver::COMPUTE_DOMAIN_CRDS {
        e2e::crd::await_established(&dra.admin, crd)
            .await
            .unwrap_or_else(|e| panic!("{crd}: {e}\noperator log:\n{}", dra.operator.log_text()));
    }

    // A ComputeDomain as NVIDIA documents it is accepted, in a workload namespace.
    let gvk = GroupVersionKind::gvk("resource.nvidia.com", "v1beta1", "ComputeDomain");
    let domains: Api<DynamicObject> =
        Api::namespaced_with(dra.admin.clone(), &ns, &ApiResource::from_gvk(&gvk));
    let domain: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
        "metadata": {"name": "imex-domain"},
        "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": "imex-channel"}}},
    }))
    .unwrap();
    domains
        .create(&PostParams::default(), &domain)
        .await
        .expect("a ComputeDomain is accepted");

    // The controller watches and updates ComputeDomains in every namespace and their status,
    // and keeps the cliques in the driver's namespace; the kubelet plugin reads both.
    let access = |verb, resource, namespace| Access {
        verb,
        group: "resource.nvidia.com",
        resource,
        namespace,
        name: None,
    };
    for (sa, wanted) in [
        (
            dra_driver::CONTROLLER,
            vec![
                access("list", "computedomains", None),
                access("watch", "computedomains", None),
                access("update", "computedomains", Some("default")),
                access("update", "computedomains/status", Some("default")),
                access("update", "computedomaincliques", Some(ns.as_str())),
            ],
        ),
        (
            dra_driver::KUBELET_PLUGIN_SA,
            vec![
                access("get", "computedomains", Some("default")),
                access("get", "computedomaincliques", Some(ns.as_str())),
            ],
        ),
    ] {
        for request in wanted {
            assert!(
                may(&dra.admin, &ns, sa, request).await.unwrap(),
                "{sa} may not {request:?}"
            );
        }
    }

    // DCGM, the exporter in DRA mode and the DRA validator, each its own DaemonSet.
    let daemon_sets = Api::<DaemonSet>::namespaced(dra.admin.clone(), &ns);
    for name in [dcgm::DRA_NAME, dcgm_exporter::DRA_NAME, validator::DRA_NAME] {
        wait::until(TIMEOUT, &format!("DaemonSet {name}"), || {
            let daemon_sets = daemon_sets.clone();
            async move {
                Ok(match daemon_sets.get_opt(name).await? {
                    Some(ds) => Ok(ds),
                    None => Err("absent".to_owned()),
                })
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", dra.operator.log_text()));
    }
    let exporter = daemon_sets.get(dcgm_exporter::DRA_NAME).await.unwrap();
    let pod = exporter.spec.unwrap().template.spec.unwrap();
    let env = |name: &str| {
        pod.containers
            .iter()
            .flat_map(|c| c.env.iter().flatten())
            .find(|e| e.name == name)
            .and_then(|e| e.value.clone())
    };
    assert_eq!(env("KUBERNETES_ENABLE_DRA").as_deref(), Some("true"));
    let exporter_sa = pod.service_account_name.clone().unwrap_or_default();
    for verb in ["list", "watch"] {
        let request = Access {
            verb,
            group: "resource.k8s.io",
            resource: "resourceslices",
            namespace: None,
            name: None,
        };
        assert!(
            may(&dra.admin, &ns, &exporter_sa, request).await.unwrap(),
            "{exporter_sa} may not {request:?}"
        );
    }

    domains
        .delete("imex-domain", &DeleteParams::default())
        .await
        .unwrap();
    dra.stop().await;
}
