//! Validate stage of the GPUCluster pass (no IO).
//!
//! The DRA driver's, DCGM's and the exporter's images, the attribute classes, and a conflict
//! with the ClusterPolicy in force.

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::ResourceExt;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::Store;

use crate::api::{ClusterPolicy, Component, GPUCluster, ImageKind};
use crate::model::Operand;
use crate::nodes::{DEPLOY_OPERANDS, NodeView};
use crate::operands::dra_driver::{self, ValidatedGpuCluster};

/// The ClusterPolicy whose device plugin would hand out the same GPUs, with a message.
pub fn conflict(policy: Option<&ClusterPolicy>, nodes: &[Arc<NodeView>]) -> Option<String> {
    let policy = policy.filter(|p| p.metadata.deletion_timestamp.is_none())?;
    if !policy.spec.is_enabled(Component::DevicePlugin) {
        return None;
    }
    let shared = nodes
        .iter()
        .filter(|n| n.has_nfd_gpu() && n.label(DEPLOY_OPERANDS) != Some("false"))
        .count();
    (shared > 0).then(|| {
        format!(
            "ClusterPolicy {} deploys the device plugin on the same {shared} GPU node(s), so each GPU would be allocated twice (nvidia.com/gpu and DRA); set spec.devicePlugin.enabled=false in the ClusterPolicy or delete this GPUCluster (nothing is applied or deleted meanwhile)",
            policy.name_any()
        )
    })
}

/// The line a ClusterPolicy's status carries while a GPUCluster drives the same GPUs.
pub fn policy_note(
    clusters: Option<&Store<DeserializeGuard<GPUCluster>>>,
    policy: &ClusterPolicy,
    nodes: &[Arc<NodeView>],
) -> Option<String> {
    let clusters = clusters?;
    let cluster = clusters
        .state()
        .iter()
        .find_map(|g| g.0.as_ref().ok().cloned())?;
    conflict(Some(policy), nodes)
        .map(|_| format!("GPUCluster {} drives the same GPU nodes with the DRA driver; its operands are frozen until the device plugin is switched off here or the GPUCluster is deleted", cluster.name_any()))
}

/// Validate stage of a GPUCluster: image, attribute classes, and the conflict.
pub fn validate(
    cluster: &GPUCluster,
    env: &BTreeMap<String, String>,
    conflict: Option<&String>,
) -> ValidatedGpuCluster {
    let mut invalid = BTreeMap::new();
    let image = dra_driver::image(&cluster.spec, env).unwrap_or_else(|e| {
        invalid.insert(Operand::DraDriver, e);
        String::new()
    });
    let lookup = |name: &str| env.get(name).cloned();
    let validator_image = crate::api::resolve(None, ImageKind::Validator, &lookup)
        .map(|r| r.reference)
        .unwrap_or_default();
    let mut images = BTreeMap::new();
    let sections = [
        (
            Operand::DcgmDra,
            ImageKind::Dcgm,
            dra_driver::dcgm_enabled(&cluster.spec),
            cluster.spec.dcgm.as_ref().map(|d| &d.image),
        ),
        (
            Operand::DcgmExporterDra,
            ImageKind::DcgmExporter,
            dra_driver::dcgm_exporter_enabled(&cluster.spec),
            cluster.spec.dcgm_exporter.as_ref().map(|d| &d.image),
        ),
    ];
    for (operand, kind, enabled, fields) in sections {
        if !enabled {
            continue;
        }
        match crate::api::resolve(fields, kind, &lookup) {
            Ok(resolved) => {
                images.insert(kind, resolved.reference);
            }
            Err(e) => {
                invalid.insert(operand, e.to_string());
            }
        }
    }
    let problems = dra_driver::check_classes(&cluster.spec);
    if !problems.is_empty() {
        invalid.insert(Operand::DraDeviceClasses, problems.join("; "));
    }
    if let Some(message) = conflict {
        for operand in Operand::GPU_CLUSTER {
            invalid.insert(operand, message.clone());
        }
    }
    ValidatedGpuCluster {
        name: cluster.name_any(),
        spec: cluster.spec.clone(),
        image,
        validator_image,
        images,
        invalid,
    }
}
