//! Apply stage, the CRDs of the software the operator deploys (IO), vendored as their authors
//! publish them ([`CrdSet`]):
//! - NFD's (decision 16): whenever the operator deploys NFD it installs and upgrades NFD's CRDs
//!   (NodeFeature, NodeFeatureRule, NodeFeatureGroup) at the version of the NFD image it pins.
//!   Without them the worker cannot report a node and the master labels nothing, so no node
//!   would ever become a GPU node on a fresh cluster.
//! - The DRA driver's compute domains ([`COMPUTE_DOMAINS`]): whenever a GPUCluster deploys compute
//!   domains, ComputeDomain and ComputeDomainClique. Without them the compute-domain controller
//!   cannot watch its resource and users cannot create a ComputeDomain.
//!
//! They are written with server-side apply and never deleted, not even when their software is
//! switched off: deleting a CRD deletes every object of it, the users' NodeFeatureRules or
//! ComputeDomains included. They carry no owner reference for the same reason. Each CRD is written only when its applied-hash annotation differs from the bundled
//! definition, and the operator looks at them once per process (and again after a failure), so
//! a steady cluster costs no request for them.
//!
//! RBAC: `create` on customresourcedefinitions (Kubernetes cannot scope `create` by name) and
//! `get`/`patch` on each set's names. Under OLM the bundle carries these CRDs and the CSV grants
//! only `get`: a refused write (403) of a CRD that is already installed is then no failure, the
//! served definition is used and the owner's status says so ([`CrdSet::read_only_note`]); a
//! refused create of a missing one is an error that says what to install.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde::Deserialize;

use super::plan::{APPLIED_HASH_ANNOTATION, applied_hash};
use crate::model::MANAGER;

/// CRDs of one piece of software, vendored unchanged under `crds/` (the chart and the OLM bundle
/// carry the same file).
pub struct CrdSet {
    /// Whose CRDs, for messages: "NFD's".
    pub whose: &'static str,
    /// The vendored file, as the repository names it.
    pub file: &'static str,
    /// Its text.
    pub yaml: &'static str,
    /// The CRD names it holds, sorted (RBAC names them).
    pub names: &'static [&'static str],
}

/// NFD's CRDs as NFD v0.19.0 publishes them (`deployment/base/nfd-crds/nfd-api-crds.yaml` of
/// sigs.k8s.io/node-feature-discovery).
pub const NFD: CrdSet = CrdSet {
    whose: "NFD's",
    file: "crds/nfd-api-crds.yaml",
    yaml: include_str!("../../../crds/nfd-api-crds.yaml"),
    names: &crate::operands::nfd::CRD_NAMES,
};

/// The DRA driver's ComputeDomain CRDs as NVIDIA's GPU Operator v26.7.0 chart ships them (the
/// file's header names the source).
pub const COMPUTE_DOMAINS: CrdSet = CrdSet {
    whose: "the DRA driver's compute-domain",
    file: "crds/compute-domain-crds.yaml",
    yaml: include_str!("../../../crds/compute-domain-crds.yaml"),
    names: &crate::operands::dra_driver::COMPUTE_DOMAIN_CRDS,
};

/// NFD's CRD names (the bundle orders its files by them).
pub const NAMES: &[&str] = NFD.names;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{whose} bundled CRDs ({file}) do not parse: {source}")]
    Parse {
        whose: &'static str,
        file: &'static str,
        #[source]
        source: serde_yaml_ng::Error,
    },
    #[error("hashing {whose} CRD {name}: {source}")]
    Hash {
        whose: &'static str,
        name: String,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "installing {whose} CRD {name} (the operator's ClusterRole needs create on customresourcedefinitions and get/patch on {name}, as the chart's has): {source}"
    )]
    Apply {
        whose: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "{whose} CRD {name} is not installed and the operator may not create it ({source}): install it (the OLM bundle and the chart carry it, {file}), or grant create on customresourcedefinitions"
    )]
    Missing {
        whose: &'static str,
        file: &'static str,
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

impl CrdSet {
    /// The status note while this set's CRDs are used as installed by someone else.
    pub fn read_only_note(&self, names: &[String]) -> String {
        format!(
            "{} CRDs {} are used as installed (the operator may not update them; under OLM the bundle installs them)",
            self.whose,
            names.join(", ")
        )
    }
}

fn is_forbidden(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(status) if status.code == 403)
}

/// NFD's CRDs as the operator installs them, sorted by name (the order of [`NAMES`]).
pub fn definitions() -> Result<Vec<CustomResourceDefinition>, Error> {
    NFD.definitions()
}

impl CrdSet {
    /// The set's CRDs as the operator installs them, sorted by name (the order of `names`).
    pub fn definitions(&self) -> Result<Vec<CustomResourceDefinition>, Error> {
        let mut crds = serde_yaml_ng::Deserializer::from_str(self.yaml)
            .map(CustomResourceDefinition::deserialize)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| Error::Parse {
                whose: self.whose,
                file: self.file,
                source,
            })?;
        crds.sort_by_key(|c| c.name_any());
        Ok(crds)
    }
}

/// [`ensure_set`] of NFD's CRDs.
pub async fn ensure(client: &Client) -> Result<Ensured, Error> {
    ensure_set(client, &NFD).await
}

/// Installs or upgrades each CRD of `set` whose served copy lacks the bundled definition's
/// hash; an installed one the operator may not write is left as served. They are ensured side
/// by side: each is a read and maybe a write, and the first pass waits for them.
pub async fn ensure_set(client: &Client, set: &CrdSet) -> Result<Ensured, Error> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let answers = futures::future::join_all(
        set.definitions()?
            .into_iter()
            .map(|crd| ensure_one(&api, set, crd)),
    )
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
    set: &CrdSet,
    mut crd: CustomResourceDefinition,
) -> Result<Option<Written>, Error> {
    let whose = set.whose;
    let name = crd.name_any();
    let value = serde_json::to_value(&crd).map_err(|source| Error::Hash {
        whose,
        name: name.clone(),
        source,
    })?;
    let hash = applied_hash(&value).map_err(|source| Error::Hash {
        whose,
        name: name.clone(),
        source,
    })?;
    let apply_error = |source| Error::Apply {
        whose,
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
        Err(source) if is_forbidden(&source) => Err(Error::Missing {
            whose,
            file: set.file,
            name,
            source,
        }),
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
            chart, NFD.yaml,
            "charts/gpu-operator/crds/nfd-api-crds.yaml differs from crds/nfd-api-crds.yaml: run `cargo xtask generate`"
        );
    }

    #[test]
    fn the_compute_domain_crds_are_nvidias_two_and_the_chart_ships_them() {
        let crds = COMPUTE_DOMAINS.definitions().unwrap();
        let names: Vec<String> = crds.iter().map(|c| c.name_any()).collect();
        assert_eq!(names, COMPUTE_DOMAINS.names);
        assert!(crds.iter().all(|c| c.spec.group == "resource.nvidia.com"));
        let chart = include_str!("../../../charts/gpu-operator/crds/compute-domain-crds.yaml");
        assert_eq!(
            chart, COMPUTE_DOMAINS.yaml,
            "the chart's copy differs from crds/compute-domain-crds.yaml: run `cargo xtask generate`"
        );
    }
}
