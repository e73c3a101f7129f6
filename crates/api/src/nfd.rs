//! The `spec.nfd` section, our addition: Node Feature Discovery deployed by the operator
//! (types; no IO).
//!
//! NVIDIA's chart deploys NFD as a subchart; here the operator does, and the chart maps its
//! `node-feature-discovery.*` values into this section. Being new, the section may validate more
//! strictly than NVIDIA's sections do.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, Toleration};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::common::{ImageSpec, ResourceRequirements, enabled_or, free_form_object};

/// Node Feature Discovery, deployed by this operator: a master Deployment, a worker DaemonSet
/// on every node and a garbage collector.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "!((has(self.repository) && size(self.repository) > 0) || (has(self.version) && size(self.version) > 0)) || ((has(self.repository) && size(self.repository) > 0) && (has(self.image) && size(self.image) > 0) && (has(self.version) && size(self.version) > 0))",
    "message": "nfd.repository, nfd.image and nfd.version must be set together, or a complete reference put in nfd.image alone"
}]))]
pub struct NfdSpec {
    /// Deploy NFD. Defaults to true; the operator still skips it when NFD already runs in the
    /// cluster (its NodeFeature API is served or nodes carry NFD annotations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The NFD image, registry.k8s.io/nfd/node-feature-discovery at the version the operator
    /// pins when empty.
    #[serde(flatten)]
    pub image: ImageSpec,
    /// Settings of the NFD master, which turns worker reports into node labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master: Option<NfdMasterSpec>,
    /// Settings of the NFD worker DaemonSet, which inspects each node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<NfdWorkerSpec>,
}

impl NfdSpec {
    /// Whether NFD is deployed (unless found running); true when `enabled` is absent.
    pub fn is_enabled(&self) -> bool {
        enabled_or(self.enabled, true)
    }
}

/// Settings of the NFD master.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NfdMasterSpec {
    /// Label namespaces, besides NFD's own, that the master publishes. nvidia.com is always
    /// added so that GPU feature discovery's labels reach the nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(max = 32),
        inner(length(max = 253)),
        extend("x-kubernetes-validations" = [{
            "rule": "self.all(ns, ns.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$'))",
            "message": "nfd.master.extraLabelNs entries must be DNS subdomains such as example.com"
        }])
    )]
    pub extra_label_ns: Option<Vec<String>>,
    /// Extra settings for nfd-master.conf, merged over the operator's, in NFD's own format.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form_object")]
    pub config: Option<serde_json::Map<String, Value>>,
    /// Tolerations of the master pod; by default it tolerates control-plane nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    /// Affinity of the master pod; by default it prefers control-plane nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Node labels the master pod must match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Resources of the master container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
}

/// Settings of the NFD worker.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NfdWorkerSpec {
    /// Extra settings for nfd-worker.conf, merged over the operator's, in NFD's own format
    /// (for example sources.pci.deviceClassWhitelist).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form_object")]
    pub config: Option<serde_json::Map<String, Value>>,
    /// Tolerations of the worker pods. By default they tolerate control-plane nodes and the
    /// nvidia.com/gpu taint; a non-empty list replaces that.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    /// Affinity of the worker pods, for example to keep them on GPU node pools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Node labels the worker pods must match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Resources of the worker container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
}
