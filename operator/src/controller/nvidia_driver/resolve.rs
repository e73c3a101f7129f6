//! Resolve stage of the NVIDIADriver pass (IO: a node list per pool, when the cache cannot say).
//!
//! One label-selected node list per pool whose selector reads labels the node cache does not keep.
//! Each pool's GPU nodes and the facts it renders with.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams};
use kube::{Client, Resource, ResourceExt};

use super::Pass;
use crate::api::NVIDIADriver;
use crate::controller::owner::{Error, Owner};
use crate::facts::{ClusterFacts, ConfigMapData};
use crate::nodes::{DEPLOY_OPERANDS, NodeView};
use crate::operands::driver::referenced_config_maps;
use crate::operands::nvidia_driver as pool;

/// Resolve stage: each NVIDIADriver with its GPU nodes and the facts it renders with (the
/// policy's `facts`, with the pool's nodes, OS and ConfigMaps). A default NVIDIADriver's nodes
/// are the GPU nodes no non-default one selects.
pub async fn resolve_all<'a>(
    ctx: &Pass<'_>,
    drivers: &'a [NVIDIADriver],
    nodes: &[Arc<NodeView>],
    facts: &ClusterFacts,
) -> Result<Vec<(&'a NVIDIADriver, Vec<Arc<NodeView>>, ClusterFacts)>, Error> {
    let mut selections = Vec::new();
    for d in drivers {
        selections.push(select(ctx.client, d, nodes, ctx.policy.is_none()).await?);
    }
    // A default pool serves the GPU nodes no other NVIDIADriver selects (NVIDIA's fallback).
    let taken: BTreeSet<String> = drivers
        .iter()
        .zip(&selections)
        .filter(|(d, _)| !d.spec.is_default())
        .flat_map(|(_, nodes)| nodes.iter().map(|n| n.name.clone()))
        .collect();
    let mut resolved = Vec::new();
    for (d, mut selected) in drivers.iter().zip(selections) {
        if d.spec.is_default() {
            selected.retain(|n| !taken.contains(&n.name));
        }
        let spec = driver_spec(d);
        let names = referenced_config_maps(&spec)
            .into_iter()
            .map(|(_, name)| name);
        ctx.deps
            .stores
            .user_config_maps
            .fetch(ctx.client, ctx.namespace, names)
            .await
            .map_err(Error::Resolve)?;
        let pool_facts = pool_facts(ctx, facts, d, &selected);
        resolved.push((d, selected, pool_facts));
    }
    Ok(resolved)
}

/// The GPU nodes the NVIDIADriver's selector matches, each carrying the selector's labels (the
/// node cache keeps only the labels the operator reads). Selectors over read labels are matched
/// in the cache; others cost one label-selected metadata list.
async fn select(
    client: &Client,
    d: &NVIDIADriver,
    nodes: &[Arc<NodeView>],
    standalone: bool,
) -> Result<Vec<Arc<NodeView>>, Error> {
    let selector = pool::selector(&d.spec);
    // In a GPUCluster install this pass marks the GPU nodes itself: NFD's word is enough.
    let gpu = |n: &&Arc<NodeView>| {
        (n.is_gpu_node() || (standalone && n.has_nfd_gpu()))
            && n.label(DEPLOY_OPERANDS) != Some("false")
    };
    // No nodeSelector: every GPU node, also one this pass has not marked yet.
    let every_gpu_node = d.spec.node_selector.as_ref().is_none_or(BTreeMap::is_empty);
    let names: BTreeSet<String> = if selector.keys().all(|k| crate::nodes::is_read_label(k)) {
        nodes
            .iter()
            .filter(|n| n.matches(&selector) || (every_gpu_node && gpu(n)))
            .map(|n| n.name.clone())
            .collect()
    } else {
        let params = ListParams::default().labels(&pool::label_selector(&d.spec));
        Api::<Node>::all(client.clone())
            .list_metadata(&params)
            .await
            .map_err(|source| Error::Select {
                owner: Owner::of(d),
                source,
            })?
            .items
            .into_iter()
            .map(|n| n.name_any())
            .collect()
    };
    Ok(nodes
        .iter()
        .filter(gpu)
        .filter(|n| names.contains(&n.name))
        .map(|n| {
            // The pool's selector as labels: copied only for the pool's nodes.
            let mut n = NodeView::clone(n);
            n.labels
                .extend(selector.iter().map(|(k, v)| (k.clone(), v.clone())));
            Arc::new(n)
        })
        .collect())
}

/// The facts a pool renders with: the policy's, with the NVIDIADriver as owner, the pool's
/// nodes and OS, and the ConfigMaps its settings name (from the cache of the namespace).
fn pool_facts(
    ctx: &Pass<'_>,
    policy: &ClusterFacts,
    d: &NVIDIADriver,
    nodes: &[Arc<NodeView>],
) -> ClusterFacts {
    let (os_pools, _) = crate::operands::driver_os::pools(nodes);
    let as_driver = driver_spec(d);
    let driver_config_maps = referenced_config_maps(&as_driver)
        .into_iter()
        .filter_map(|(_, name)| {
            let cm = ctx.deps.stores.config_map(ctx.namespace, name)?;
            Some((
                name.to_owned(),
                ConfigMapData {
                    name: name.to_owned(),
                    data: cm.data.clone().unwrap_or_default(),
                },
            ))
        })
        .collect();
    // What the pool's own DaemonSets run, so that its switches are judged on them alone.
    let uid = d.uid();
    let own: Vec<Arc<DaemonSet>> = ctx
        .deps
        .stores
        .daemon_sets
        .state()
        .into_iter()
        .filter(|ds| {
            ds.metadata.namespace.as_deref() == Some(ctx.namespace)
                && ds
                    .owner_references()
                    .iter()
                    .any(|o| Some(&o.uid) == uid.as_ref())
        })
        .collect();
    ClusterFacts {
        owner: d.controller_owner_ref(&()),
        os_tag: os_pools.first().map(|p| p.tag.clone()),
        gpu_nodes: nodes.to_vec(),
        driver_config_maps,
        live_driver: crate::facts::LiveDriver {
            daemon_sets: own.clone(),
        },
        live_driver_toolkit: crate::facts::live_driver_toolkit(&own),
        ..policy.clone()
    }
}

/// The NVIDIADriver's ConfigMap settings as the ClusterPolicy's driver spec carries them.
fn driver_spec(d: &NVIDIADriver) -> crate::api::DriverSpec {
    crate::api::DriverSpec {
        repo_config: d
            .spec
            .repo_config
            .as_ref()
            .map(|r| crate::api::DriverRepoConfigSpec {
                config_map_name: r.name.clone(),
            }),
        cert_config: d.spec.cert_config.clone(),
        kernel_module_config: d.spec.kernel_module_config.clone(),
        ..Default::default()
    }
}
