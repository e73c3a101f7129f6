//! Render stage of the GPUCluster pass (IO: a dry run of the attribute DeviceClasses).
//!
//! The DRA operands' desired state ([`crate::operands::dra_driver`]), with the attribute classes
//! the API server refuses frozen. A dry run is sent once per distinct rendering, so a steady pass
//! sends none.

use std::collections::BTreeMap;

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::{Client, ResourceExt};

use super::optional_kinds;
use crate::controller::owner::Error;
use crate::controller::{apply, plan};
use crate::facts::ClusterFacts;
use crate::model::{MANAGER, Operand};
use crate::operands::dra_driver::{self, ValidatedGpuCluster};
use crate::render::{DesiredState, OperandState, Outcome};

/// Dry-run verdict per rendered attribute class (by hash): `Err` holds the API's message.
pub type DryRuns = BTreeMap<String, Result<(), String>>;

/// Render stage: the desired state, checked by the API server.
pub async fn render(
    client: &Client,
    dry_runs: &mut DryRuns,
    cluster: &ValidatedGpuCluster,
    facts: &ClusterFacts,
) -> Result<DesiredState, Error> {
    let mut desired = desired(cluster, facts);
    dry_run_classes(client, dry_runs, &mut desired).await?;
    Ok(desired)
}

/// The DesiredState of the GPUCluster's operands.
fn desired(cluster: &ValidatedGpuCluster, facts: &ClusterFacts) -> DesiredState {
    DesiredState {
        operands: Operand::GPU_CLUSTER
            .into_iter()
            .map(|operand| OperandState {
                operand,
                outcome: match cluster.invalid.get(&operand) {
                    Some(message) => Outcome::Invalid(message.clone()),
                    None => dra_driver::render(operand, cluster, facts)
                        .map_or(Outcome::Disabled, Outcome::Rendered),
                },
            })
            .collect(),
    }
}

/// The API server compiles each attribute class's CEL (server-side apply, dry run); a class it
/// refuses freezes the attribute classes with its message.
async fn dry_run_classes(
    client: &Client,
    dry_runs: &mut DryRuns,
    desired: &mut DesiredState,
) -> Result<(), Error> {
    let Some(state) = desired
        .operands
        .iter_mut()
        .find(|s| s.operand == Operand::DraDeviceClasses)
    else {
        return Ok(());
    };
    let Outcome::Rendered(objects) = &state.outcome else {
        return Ok(());
    };
    let resource = &optional_kinds()[0];
    let api: Api<DynamicObject> = Api::all_with(client.clone(), resource);
    let mut refused = Vec::new();
    for class in &objects.dynamic {
        let mut sent = class.clone();
        sent.metadata.owner_references = None;
        let value = serde_json::to_value(&sent).unwrap_or_default();
        let hash = plan::applied_hash(&value).unwrap_or_default();
        let known = dry_runs.get(&hash).cloned();
        let verdict = match known {
            Some(v) => v,
            None => {
                let params = PatchParams::apply(MANAGER).force().dry_run();
                let verdict = match api
                    .patch(&class.name_any(), &params, &Patch::Apply(&sent))
                    .await
                {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(s)) if (400..500).contains(&s.code) && s.code != 429 => {
                        Err(s.message)
                    }
                    Err(source) => {
                        return Err(Error::Apply(apply::ApplyError::Apply {
                            kind: "DeviceClass",
                            name: class.name_any(),
                            source,
                        }));
                    }
                };
                dry_runs.insert(hash, verdict.clone());
                verdict
            }
        };
        if let Err(message) = verdict {
            refused.push(format!(
                "DeviceClass {} refused by the API server: {message}",
                class.name_any()
            ));
        }
    }
    if !refused.is_empty() {
        state.outcome = Outcome::Invalid(refused.join("; "));
    }
    Ok(())
}
