//! Validate stage of the NVIDIADriver pass (no IO).
//!
//! Each pool's input, then the one-default rule (the oldest default NVIDIADriver is the
//! fallback) and the overlap rule across the valid pools (the older keeps a node two pools
//! select, decision 8).

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::ResourceExt;

use super::Pool;
use crate::api::{ClusterPolicySpec, ImageKind, NVIDIADriver};
use crate::facts::ClusterFacts;
use crate::nodes::NodeView;
use crate::operands::nvidia_driver::{self as pool, Claim, ValidatedNvidiaDriver};

/// Validate stage: every pool with its verdict. `resolved` are the pools with their nodes and
/// facts, in the order of the NVIDIADrivers; `policy` is the ClusterPolicy in force (or the
/// GPUCluster install's stand-in).
pub fn validate_all<'a>(
    resolved: Vec<(&'a NVIDIADriver, Vec<Arc<NodeView>>, ClusterFacts)>,
    env: &BTreeMap<String, String>,
    policy: &ClusterPolicySpec,
) -> Vec<Pool<'a>> {
    let mut pools: Vec<Pool<'a>> = resolved
        .into_iter()
        .map(|(driver, nodes, facts)| {
            let (validated, problems) = validate(driver, nodes, &facts, env, policy);
            Pool {
                driver,
                validated,
                facts,
                invalid: (!problems.is_empty()).then(|| problems.join("; ")),
            }
        })
        .collect();
    let defaults: Vec<(String, Option<k8s_openapi::jiff::Timestamp>)> = pools
        .iter()
        .filter(|p| p.invalid.is_none() && p.driver.spec.is_default())
        .map(|p| {
            let created = p.driver.metadata.creation_timestamp.as_ref().map(|t| t.0);
            (p.driver.name_any(), created)
        })
        .collect();
    let extra = pool::extra_defaults(&defaults);
    for p in &mut pools {
        if let Some(message) = extra.get(&p.driver.name_any()) {
            p.invalid = Some(message.clone());
        }
    }
    let claims: Vec<Claim> = pools
        .iter()
        .filter(|p| p.invalid.is_none())
        .map(|p| Claim {
            name: p.driver.name_any(),
            created: p.driver.metadata.creation_timestamp.as_ref().map(|t| t.0),
            nodes: p.validated.nodes.iter().map(|n| n.name.clone()).collect(),
        })
        .collect();
    let overlaps = pool::overlaps(&claims);
    for p in &mut pools {
        if p.invalid.is_none()
            && let Some(message) = overlaps.get(&p.driver.name_any())
        {
            p.invalid = Some(message.clone());
        }
    }
    pools
}

/// Validate stage of one NVIDIADriver: how its nodes are split, its image, the driver-manager
/// image it names, the GDS and GDRCopy images when they are on, and the driver operand's own
/// checks. Returns the pool and its problems.
fn validate(
    d: &NVIDIADriver,
    nodes: Vec<Arc<NodeView>>,
    facts: &ClusterFacts,
    env: &BTreeMap<String, String>,
    policy: &ClusterPolicySpec,
) -> (ValidatedNvidiaDriver, Vec<String>) {
    let build = pool::build(policy, &d.spec, facts);
    let mut problems = pool::check(&d.spec, build, facts);
    let image = pool::image(&d.spec).unwrap_or_else(|e| {
        problems.push(e);
        String::new()
    });
    let lookup = |name: &str| env.get(name).cloned();
    let manager_image = match d.spec.manager.as_ref().map(|m| &m.image) {
        Some(fields) if fields.image.is_some() || fields.version.is_some() => {
            match crate::api::resolve(Some(fields), ImageKind::DriverManager, &lookup) {
                Ok(r) => Some(r.reference),
                Err(e) => {
                    problems.push(format!("spec.manager: {e}"));
                    None
                }
            }
        }
        _ => None,
    };
    let (gds_image, gdrcopy_image) = pool::sidecar_images(&d.spec).unwrap_or_else(|e| {
        problems.extend(e);
        (None, None)
    });
    (
        ValidatedNvidiaDriver {
            name: d.name_any(),
            spec: d.spec.clone(),
            image,
            manager_image,
            gds_image,
            gdrcopy_image,
            nodes,
            build,
        },
        problems,
    )
}
