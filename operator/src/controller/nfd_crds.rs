//! Apply stage, NFD's CRDs (IO; decision 16): whenever the operator deploys NFD it installs and
//! upgrades NFD's CRDs (NodeFeature, NodeFeatureRule, NodeFeatureGroup) at the version of the NFD
//! image it pins, with server-side apply. Without them the worker cannot report a node and the
//! master labels nothing, so no node would ever become a GPU node on a fresh cluster.
//!
//! They are never deleted, not even when NFD is switched off: deleting a CRD deletes every
//! object of it, the users' NodeFeatureRules included. They carry no owner reference for the same
//! reason. Each CRD is written only when its applied-hash annotation differs from the bundled
//! definition, and the operator looks at them once per process (and again after a failure), so
//! a steady cluster costs no request for them.
//!
//! RBAC: `create` on customresourcedefinitions (Kubernetes cannot scope `create` by name) and
//! `get`/`patch` on the three names. Under OLM the bundle carries these CRDs and the CSV grants
//! only `get`: a refused write (403) of a CRD that is already installed is then no failure, the
//! served definition is used and the policy's status says so ([`READ_ONLY_NOTE`]); a refused
//! create of a missing one is an error that says what to install.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde::Deserialize;

use super::plan::{APPLIED_HASH_ANNOTATION, applied_hash};
use crate::model::MANAGER;

/// NFD's CRDs as NFD v0.19.0 publishes them (`deployment/base/nfd-crds/nfd-api-crds.yaml` of
/// sigs.k8s.io/node-feature-discovery; the chart's `crds/` holds the same file).
const NFD_CRDS_YAML: &str = include_str!("../../../crds/nfd-api-crds.yaml");

pub use crate::operands::nfd::CRD_NAMES as NAMES;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("NFD's bundled CRDs do not parse: {0}")]
    Parse(#[from] serde_yaml_ng::Error),
    #[error("hashing NFD's CRD {name}: {source}")]
    Hash {
        name: String,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "installing NFD's CRD {name} (the operator's ClusterRole needs create on customresourcedefinitions and get/patch on NFD's three, as the chart's has): {source}"
    )]
    Apply {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "NFD's CRD {name} is not installed and the operator may not create it ({source}): install NFD's CRDs (the OLM bundle and the chart carry them, crds/nfd-api-crds.yaml), or grant create on customresourcedefinitions"
    )]
    Missing {
        name: String,
        #[source]
        source: kube::Error,
    },
}

/// What [`ensure`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Ensured {
    /// CRDs written (installed or upgraded).
    pub written: Vec<String>,
    /// CRDs installed by someone else that the operator may not write (403): used as served.
    pub read_only: Vec<String>,
}

/// The status note while NFD's CRDs are used as installed by someone else.
pub const READ_ONLY_NOTE: &str = "NFD's CRDs are used as installed (the operator may not update them; under OLM the bundle installs them)";

fn is_forbidden(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(status) if status.code == 403)
}

/// NFD's CRDs as the operator installs them, sorted by name (the order of [`NAMES`]).
pub fn definitions() -> Result<Vec<CustomResourceDefinition>, Error> {
    let mut crds = serde_yaml_ng::Deserializer::from_str(NFD_CRDS_YAML)
        .map(CustomResourceDefinition::deserialize)
        .collect::<Result<Vec<_>, _>>()
        .map_err(Error::Parse)?;
    crds.sort_by_key(|c| c.name_any());
    Ok(crds)
}

/// Installs or upgrades each of NFD's CRDs whose served copy lacks the bundled definition's
/// hash; an installed one the operator may not write is left as served. The three are
/// ensured side by side: each is a read and maybe a write, and the first pass waits for them.
pub async fn ensure(client: &Client) -> Result<Ensured, Error> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let answers =
        futures::future::join_all(definitions()?.into_iter().map(|crd| ensure_one(&api, crd)))
            .await;
    let mut outcome = Ensured::default();
    for answer in answers {
        match answer? {
            Some(Written::Written(name)) => outcome.written.push(name),
            Some(Written::ReadOnly(name)) => outcome.read_only.push(name),
            None => {}
        }
    }
    Ok(outcome)
}

/// What [`ensure_one`] did to a CRD that was not current.
enum Written {
    Written(String),
    ReadOnly(String),
}

async fn ensure_one(
    api: &Api<CustomResourceDefinition>,
    mut crd: CustomResourceDefinition,
) -> Result<Option<Written>, Error> {
    let name = crd.name_any();
    let value = serde_json::to_value(&crd).map_err(|source| Error::Hash {
        name: name.clone(),
        source,
    })?;
    let hash = applied_hash(&value).map_err(|source| Error::Hash {
        name: name.clone(),
        source,
    })?;
    let apply_error = |source| Error::Apply {
        name: name.clone(),
        source,
    };
    let served = api.get_metadata_opt(&name).await.map_err(apply_error)?;
    if served
        .as_ref()
        .is_some_and(|s| s.annotations().get(APPLIED_HASH_ANNOTATION) == Some(&hash))
    {
        return Ok(None);
    }
    crd.annotations_mut()
        .insert(APPLIED_HASH_ANNOTATION.to_owned(), hash);
    let params = PatchParams::apply(MANAGER).force();
    match api.patch(&name, &params, &Patch::Apply(&crd)).await {
        Ok(_) => Ok(Some(Written::Written(name))),
        Err(e) if is_forbidden(&e) && served.is_some() => Ok(Some(Written::ReadOnly(name))),
        Err(source) if is_forbidden(&source) => Err(Error::Missing { name, source }),
        Err(e) => Err(apply_error(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bundled_definitions_are_nfds_three_crds() {
        let crds = definitions().unwrap();
        let names: Vec<String> = crds.iter().map(|c| c.name_any()).collect();
        assert_eq!(names, NAMES);
        assert!(crds.iter().all(|c| c.spec.group == "nfd.k8s-sigs.io"));
    }

    #[test]
    fn the_chart_ships_the_same_nfd_crds_the_operator_installs() {
        let chart = include_str!("../../../charts/gpu-operator/crds/nfd-api-crds.yaml");
        assert_eq!(
            chart, NFD_CRDS_YAML,
            "charts/gpu-operator/crds/nfd-api-crds.yaml differs from crds/nfd-api-crds.yaml: run `make chart`"
        );
    }
}
