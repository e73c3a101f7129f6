//! A stand-in for NVIDIA's DRA kubelet plugin on fake GPU nodes: it publishes, for each node,
//! the ResourceSlice (`resource.k8s.io/v1`) the real `gpu-kubelet-plugin` would, with the
//! device attributes and capacities it reports per model, so the real kube-scheduler allocates
//! real ResourceClaims. Also installs the GPUCluster CRD.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
};
use serde_json::{Value, json};

use crate::nodes::GpuModel;
use crate::wait;

/// The driver name the slices carry (and the attribute domain).
pub const DRIVER: &str = "gpu.nvidia.com";
/// Label on every slice the stand-in publishes, so tests can remove them.
pub const STAND_IN_LABEL: &str = "gpu-operator.test/dra-stand-in";
/// Driver version every stand-in GPU reports.
pub const DRIVER_VERSION: &str = "580.95.5";

/// Waits until the GPUCluster reports `want` for its current generation; returns the message of
/// its `Ready` condition.
pub async fn await_state(
    client: &Client,
    want: gpu_operator::api::GpuClusterState,
    timeout: Duration,
    what: &str,
) -> Result<String> {
    let api: Api<gpu_operator::api::GPUCluster> = Api::all(client.clone());
    wait::until(timeout, what, || {
        let api = api.clone();
        async move {
            let cluster = api.get(gpu_operator::api::GPU_CLUSTER_NAME).await?;
            let status = cluster.status.clone().unwrap_or_default();
            let ready = status
                .conditions
                .iter()
                .flatten()
                .find(|c| c.type_ == "Ready")
                .cloned();
            let current = ready
                .as_ref()
                .and_then(|r| r.observed_generation)
                .is_some_and(|g| Some(g) >= cluster.metadata.generation);
            Ok(if status.state == want && current {
                Ok(ready.map(|r| r.message).unwrap_or_default())
            } else {
                Err(format!("{status:?}"))
            })
        }
    })
    .await
}

/// Installs the GPUCluster CRD from the operator's types and waits until it is established.
pub async fn install_gpu_cluster_crd(client: &Client) -> Result<()> {
    let crd = gpu_operator::api::gpu_cluster_crd::crd();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.patch(
        gpu_operator::api::gpu_cluster_crd::CRD_NAME,
        &PatchParams::apply("e2e-dra").force(),
        &Patch::Apply(&crd),
    )
    .await
    .context("applying the GPUCluster CRD")?;
    crate::crd::await_established(client, gpu_operator::api::gpu_cluster_crd::CRD_NAME).await?;
    await_owner_kind_admitted(client).await
}

/// An Established CRD is not yet known to the API server's admission RESTMapper (refreshed up
/// to every 30 s): until it is, `OwnerReferencesPermissionEnforcement` refuses every child whose
/// owner reference to a GPUCluster has `blockOwnerDeletion` ("cannot find RESTMapping"). Waits,
/// with a server-side dry run of such a child, until the kind is admitted.
async fn await_owner_kind_admitted(client: &Client) -> Result<()> {
    let api: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(client.clone(), "default");
    let child: k8s_openapi::api::core::v1::ConfigMap = serde_json::from_value(json!({
        "metadata": {
            "name": "e2e-gpucluster-owner-probe",
            "ownerReferences": [{
                "apiVersion": "nvidia.com/v1alpha1",
                "kind": "GPUCluster",
                "name": gpu_operator::api::GPU_CLUSTER_NAME,
                "uid": "00000000-0000-0000-0000-000000000000",
                "blockOwnerDeletion": true,
            }],
        },
    }))?;
    let dry_run = kube::api::PostParams {
        dry_run: true,
        ..Default::default()
    };
    wait::until(Duration::from_secs(90), "GPUCluster kind admitted", || {
        let (api, child, dry_run) = (api.clone(), child.clone(), dry_run.clone());
        async move {
            Ok(match api.create(&dry_run, &child).await {
                Err(kube::Error::Api(e)) if e.message.contains("RESTMapping") => Err(e.message),
                other => Ok(other.map(|_| ())?),
            })
        }
    })
    .await
}

/// What NVML reports for one board, as the DRA driver publishes it.
struct Board {
    product: &'static str,
    brand: &'static str,
    architecture: &'static str,
    compute: &'static str,
    /// Total memory in MiB as NVML reports it (less than the marketing size: the A100 40GB
    /// reports 40536 MiB, so `>= 40Gi` does not match it).
    memory_mib: u64,
    gpus: u32,
}

fn board(model: GpuModel) -> Board {
    match model {
        GpuModel::T4 => Board {
            product: "Tesla T4",
            brand: "Tesla",
            architecture: "Turing",
            compute: "7.5.0",
            memory_mib: 15360,
            gpus: 1,
        },
        GpuModel::A100Sxm40Gb => Board {
            product: "NVIDIA A100-SXM4-40GB",
            brand: "Nvidia",
            architecture: "Ampere",
            compute: "8.0.0",
            memory_mib: 40536,
            gpus: 8,
        },
        GpuModel::A100Sxm80Gb => Board {
            product: "NVIDIA A100-SXM4-80GB",
            brand: "Nvidia",
            architecture: "Ampere",
            compute: "8.0.0",
            memory_mib: 81920,
            gpus: 8,
        },
        GpuModel::H100Sxm80Gb => Board {
            product: "NVIDIA H100 80GB HBM3",
            brand: "Nvidia",
            architecture: "Hopper",
            compute: "9.0.0",
            memory_mib: 81559,
            gpus: 8,
        },
        GpuModel::H200 => Board {
            product: "NVIDIA H200",
            brand: "Nvidia",
            architecture: "Hopper",
            compute: "9.0.0",
            memory_mib: 143771,
            gpus: 8,
        },
        GpuModel::A30 => Board {
            product: "NVIDIA A30",
            brand: "Nvidia",
            architecture: "Ampere",
            compute: "8.0.0",
            memory_mib: 24576,
            gpus: 4,
        },
    }
}

fn common_attributes(node: &str, b: &Board, minor: u32) -> serde_json::Map<String, Value> {
    let mut a = serde_json::Map::new();
    a.insert(
        "uuid".into(),
        json!({"string": format!("GPU-{node}-{minor}")}),
    );
    a.insert("productName".into(), json!({"string": b.product}));
    a.insert("brand".into(), json!({"string": b.brand}));
    a.insert("architecture".into(), json!({"string": b.architecture}));
    a.insert(
        "cudaComputeCapability".into(),
        json!({"version": b.compute}),
    );
    a.insert("driverVersion".into(), json!({"version": DRIVER_VERSION}));
    a.insert("cudaDriverVersion".into(), json!({"version": "13.0.0"}));
    a
}

/// The whole-GPU devices of a node (`gpu-<minor>`, type gpu, capacity memory).
pub fn gpu_devices(node: &str, model: GpuModel) -> Vec<Value> {
    let b = board(model);
    (0..b.gpus)
        .map(|minor| {
            let mut a = common_attributes(node, &b, minor);
            a.insert("type".into(), json!({"string": "gpu"}));
            json!({
                "name": format!("gpu-{minor}"),
                "attributes": a,
                "capacity": {"memory": {"value": format!("{}Mi", b.memory_mib)}},
            })
        })
        .collect()
}

/// The MIG devices of one A100-40GB partitioned with the all-balanced layout (two 1g.5gb, one
/// 2g.10gb, one 3g.20gb), named as the driver names them (`gpu-<minor>-mig-<profile>-<id>-<start>`).
pub fn a100_40gb_balanced_mig_devices(node: &str, minor: u32) -> Vec<Value> {
    let b = board(GpuModel::A100Sxm40Gb);
    // profile, GI profile id, placement start, size, memory MiB, multiprocessors
    let layout = [
        ("2g.10gb", 14, 0, 2, 9984, 28),
        ("1g.5gb", 19, 2, 1, 4864, 14),
        ("1g.5gb", 19, 3, 1, 4864, 14),
        ("3g.20gb", 9, 4, 4, 19968, 42),
    ];
    layout
        .iter()
        .map(|(profile, id, start, size, mem, sms)| {
            let mut a = common_attributes(node, &b, minor);
            a.insert("type".into(), json!({"string": "mig"}));
            a.insert("profile".into(), json!({"string": profile}));
            a.insert(
                "parentUUID".into(),
                json!({"string": format!("GPU-{node}-{minor}")}),
            );
            a.insert(
                "uuid".into(),
                json!({"string": format!("MIG-{node}-{minor}-{start}")}),
            );
            let mut capacity = serde_json::Map::new();
            capacity.insert("memory".into(), json!({"value": format!("{mem}Mi")}));
            capacity.insert("multiprocessors".into(), json!({"value": sms.to_string()}));
            for slice in *start..start + size {
                capacity.insert(format!("memorySlice{slice}"), json!({"value": "1"}));
            }
            json!({
                "name": format!("gpu-{minor}-mig-{}-{id}-{start}", profile.replace('.', "")),
                "attributes": a,
                "capacity": capacity,
            })
        })
        .collect()
}

fn slices_api(client: &Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("resource.k8s.io", "v1", "ResourceSlice");
    Api::all_with(client.clone(), &ApiResource::from_gvk(&gvk))
}

/// Publishes the ResourceSlice of `node` holding `devices` (one pool per node, as the plugin).
pub async fn publish(client: &Client, node: &str, devices: Vec<Value>) -> Result<()> {
    let name = format!("{node}-{DRIVER}");
    let slice: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": name, "labels": {STAND_IN_LABEL: "true"}},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        }
    }))?;
    slices_api(client)
        .patch(
            &name,
            &PatchParams::apply("dra-stand-in").force(),
            &Patch::Apply(&slice),
        )
        .await
        .with_context(|| format!("publishing ResourceSlice {name}"))?;
    Ok(())
}

/// Publishes the stand-in's slices on every GPU node of the standing fleet, as the real kubelet
/// plugin would once it runs there: a GPUCluster's DCGM, exporter and validator pods claim their
/// node's GPUs (admin access) and stay Pending without them. T4 boards, which no attribute class,
/// memory bound or MIG profile of the tests matches, so their claims still land only on the
/// nodes a test makes for them.
pub async fn publish_fleet(client: &Client) -> Result<()> {
    for node in crate::nodes::gpu_node_names(client).await? {
        publish(client, &node, gpu_devices(&node, GpuModel::T4)).await?;
    }
    Ok(())
}

/// Deletes the GPUCluster, if any, and waits until it is gone. Its teardown finalizer is
/// finished here when no operator runs to do it (a leftover of a failed test).
pub async fn remove_gpu_cluster(client: &Client) -> Result<()> {
    use gpu_operator::api::{GPU_CLUSTER_NAME, GPUCluster};
    let api = Api::<GPUCluster>::all(client.clone());
    match api.delete(GPU_CLUSTER_NAME, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    let gone = wait::until_none_left(
        &api,
        &ListParams::default(),
        Duration::from_secs(30),
        "GPUCluster gone",
    )
    .await;
    if gone.is_err() {
        crate::session::finish_teardowns(client).await;
        wait::until_none_left(
            &api,
            &ListParams::default(),
            Duration::from_secs(60),
            "GPUCluster gone after its teardown",
        )
        .await?;
    }
    Ok(())
}

/// Removes every slice the stand-in published.
pub async fn remove_all(client: &Client) -> Result<()> {
    let api = slices_api(client);
    let lp = ListParams::default().labels(&format!("{STAND_IN_LABEL}=true"));
    api.delete_collection(&DeleteParams::default(), &lp).await?;
    wait::until_none_left(&api, &lp, Duration::from_secs(60), "stand-in slices gone").await?;
    Ok(())
}
