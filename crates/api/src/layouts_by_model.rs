//! Our extension `layoutsByModel` (types; no IO): the GPU sharing config and the MIG layout each
//! GPU model gets, so that a node an autoscaler adds gets its layout from its product label
//! with no human step. NVIDIA's API has no such field: there the `nvidia.com/device-plugin.config`
//! and `nvidia.com/mig.config` labels are set per node by hand. The decisions live in the engine
//! (`crates/engine/src/by_model.rs`).

use std::collections::BTreeMap;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

/// The layouts of one GPU model, each a node label value. A field left out leaves that label to
/// the node's owner.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelLayout {
    /// Key of the device plugin's sharing ConfigMap (`spec.devicePlugin.config.name`) these GPUs
    /// use, written as the node label `nvidia.com/device-plugin.config`. For example
    /// `time-sliced-4`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
    )]
    pub sharing: Option<String>,
    /// MIG layout (a `mig-configs` entry of `spec.migManager.config`) these GPUs get, written as
    /// the node label `nvidia.com/mig.config`. For example `all-1g.5gb`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
    )]
    pub mig: Option<String>,
}

/// Layouts by GPU model: keys are GPU products as GPU feature discovery labels them
/// (`nvidia.com/gpu.product`, for example `Tesla-T4` or `NVIDIA-A100-SXM4-40GB`), compared
/// without case and without a MIG suffix; `*` matches any run of characters
/// (`NVIDIA-H100*`). A product without `*` wins over patterns, then the pattern with the most
/// characters other than `*`.
pub type LayoutsByModel = BTreeMap<String, ModelLayout>;

/// Schema of [`LayoutsByModel`]: at most 64 models, each key a product or pattern.
pub(crate) fn layouts_by_model(generator: &mut SchemaGenerator) -> Schema {
    let layout = generator.subschema_for::<ModelLayout>();
    json_schema!({
        "type": "object",
        "maxProperties": 64,
        "additionalProperties": layout,
        "x-kubernetes-validations": [{
            "rule": "self.all(k, size(k) > 0 && size(k) <= 128)",
            "message": "layoutsByModel keys are GPU products as nvidia.com/gpu.product shows them (for example Tesla-T4 or NVIDIA-H100*), 1 to 128 characters"
        }]
    })
}
