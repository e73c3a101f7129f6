//! Object metadata: the contract and recommended labels, the owner reference, ConfigMaps
//! (render stage, pure).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::*;
use crate::facts::ClusterFacts;
use crate::model::{MANAGED_BY_LABEL, MANAGER, OPERAND_LABEL, Operand};

/// The labels every object of `operand` carries: the apply/prune contract and the recommended
/// `app.kubernetes.io/*` labels.
pub fn operand_labels(operand: Operand) -> BTreeMap<String, String> {
    BTreeMap::from([
        (MANAGED_BY_LABEL.to_owned(), MANAGER.to_owned()),
        (OPERAND_LABEL.to_owned(), operand.name().to_owned()),
        (NAME_LABEL.to_owned(), operand.name().to_owned()),
        (PART_OF_LABEL.to_owned(), PART_OF.to_owned()),
    ])
}

/// The owner reference to the ClusterPolicy, as a controller reference that blocks the owner's
/// deletion until the child is gone.
pub fn owner_references(facts: &ClusterFacts) -> Option<Vec<OwnerReference>> {
    facts.owner.as_ref().map(|owner| {
        vec![OwnerReference {
            controller: Some(true),
            block_owner_deletion: Some(true),
            ..owner.clone()
        }]
    })
}

/// Metadata of an object of `operand`: name, contract labels, owner reference, and the operator
/// namespace when `namespaced`.
pub fn meta(operand: Operand, name: &str, facts: &ClusterFacts, namespaced: bool) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: namespaced.then(|| facts.namespace.clone()),
        labels: Some(operand_labels(operand)),
        owner_references: owner_references(facts),
        ..ObjectMeta::default()
    }
}

/// Adds labels to an object's metadata (ours win over what is there).
pub fn add_labels(meta: &mut ObjectMeta, labels: &[(&str, &str)]) {
    let map = meta.labels.get_or_insert_with(BTreeMap::new);
    for (k, v) in labels {
        map.insert((*k).to_owned(), (*v).to_owned());
    }
}

/// Builds a string map from pairs.
pub fn string_map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// A ConfigMap of `operand` with the given data.
pub fn config_map(
    operand: Operand,
    name: &str,
    data: BTreeMap<String, String>,
    facts: &ClusterFacts,
) -> ConfigMap {
    ConfigMap {
        metadata: meta(operand, name, facts, true),
        data: Some(data),
        ..ConfigMap::default()
    }
}

/// Label on the operator's immutable, content-named ConfigMaps (sharing-config copies,
/// scripts); its value says which. Pruning keeps them while pods that mount an older one may
/// still run.
pub const CONFIG_COPY_LABEL: &str = "nvidia.com/gpu-operator.config-copy";

/// The name of the script ConfigMap `base` holding `script` under `key`: `<base>-<hash>`.
pub fn script_config_map_name(base: &str, key: &str, script: &str) -> String {
    hashed_name(base, &config_hash(&script_data(key, script)))
}

/// A ConfigMap holding a script that privileged operand pods run (an entrypoint, a probe):
/// immutable and named by its content ([`script_config_map_name`]), so no identity that may
/// update ConfigMaps can change what runs on every GPU node, and a new script reaches pods
/// only by a new name in their template. `labels` are added to the operand's.
pub fn script_config_map(
    operand: Operand,
    base: &str,
    (key, script): (&str, &str),
    labels: &[(&str, &str)],
    facts: &ClusterFacts,
) -> ConfigMap {
    let name = script_config_map_name(base, key, script);
    let mut cm = config_map(operand, &name, script_data(key, script), facts);
    add_labels(&mut cm.metadata, labels);
    add_labels(&mut cm.metadata, &[(CONFIG_COPY_LABEL, "script")]);
    cm.immutable = Some(true);
    cm
}

fn script_data(key: &str, script: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(key.to_owned(), script.to_owned())])
}
