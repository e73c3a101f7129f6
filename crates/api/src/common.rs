//! Building blocks shared by the ClusterPolicy sections (types and schema helpers; no IO).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

/// The pattern NVIDIA's CRD puts on every `image` field. It is not anchored, so it only asks for
/// one letter, digit or dash somewhere: full references with `/`, `:` and `@` pass.
pub(crate) const IMAGE_PATTERN: &str = r"[a-zA-Z0-9\-]+";

/// Kubernetes' resource quantity syntax (`500m`, `1Gi`, `2`, `1e3`).
const QUANTITY_PATTERN: &str = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$";

/// Schema of a resource list: names such as `cpu` or `memory` mapped to quantities, written
/// either as integers or as quantity strings.
pub(crate) fn quantity_map(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "additionalProperties": {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": true
        }
    })
}

/// A label or annotation key: an optional DNS-subdomain prefix and `/`, then a name of at most
/// 63 characters that starts and ends with a letter or digit (Kubernetes' qualified name).
const QUALIFIED_NAME_PATTERN: &str = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$";

/// A label value: empty, or at most 63 characters that start and end with a letter or digit.
const LABEL_VALUE_PATTERN: &str = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$";

/// Most entries a label or annotation map may hold: a bound the CEL cost estimate needs, far
/// above what operand objects carry.
const MAX_METADATA_ENTRIES: u32 = 64;

/// The CEL rule that rejects, at admission, a key of map `field` the API server would refuse on
/// every object rendered from it (decision 15), naming the first offending key.
fn qualified_keys_rule(field: &str) -> serde_json::Value {
    let valid = format!(
        "(k.matches(r'{QUALIFIED_NAME_PATTERN}') && (!k.contains('/') || k.indexOf('/') <= 253))"
    );
    const RULE: &str = "an optional DNS prefix of at most 253 characters and /, then a name of \
        at most 63 letters, digits, -, _ or . that starts and ends with a letter or digit";
    serde_json::json!({
        "rule": format!("self.all(k, {valid})"),
        "message": format!("every key of {field} must be a valid Kubernetes key: {RULE}"),
        "messageExpression": format!(
            "'{field} key ' + self.filter(k, !{valid})[0] + ' is not a valid Kubernetes key: {RULE}'"
        ),
        "reason": "FieldValueInvalid"
    })
}

/// Schema of a label map named `field`: keys and values the API server accepts as labels,
/// checked at admission instead of failing every object the operator renders from them.
fn label_map_named(field: &str) -> Schema {
    json_schema!({
        "type": "object",
        "maxProperties": MAX_METADATA_ENTRIES,
        "additionalProperties": {
            "type": "string",
            "maxLength": 63,
            "pattern": LABEL_VALUE_PATTERN
        },
        "x-kubernetes-validations": [qualified_keys_rule(field)]
    })
}

/// Schema of an annotation map named `field`: keys the API server accepts (values are free).
fn annotation_map_named(field: &str) -> Schema {
    json_schema!({
        "type": "object",
        "maxProperties": MAX_METADATA_ENTRIES,
        "additionalProperties": {"type": "string"},
        "x-kubernetes-validations": [qualified_keys_rule(field)]
    })
}

/// [`label_map_named`] for a field named `labels`.
pub(crate) fn label_map(_: &mut SchemaGenerator) -> Schema {
    label_map_named("labels")
}

/// [`label_map_named`] for a field named `podLabels`.
pub(crate) fn pod_label_map(_: &mut SchemaGenerator) -> Schema {
    label_map_named("podLabels")
}

/// [`annotation_map_named`] for a field named `annotations`.
pub(crate) fn annotation_map(_: &mut SchemaGenerator) -> Schema {
    annotation_map_named("annotations")
}

/// [`annotation_map_named`] for a field named `podAnnotations`.
pub(crate) fn pod_annotation_map(_: &mut SchemaGenerator) -> Schema {
    annotation_map_named("podAnnotations")
}

/// Schema of a free-form object whose content the API server stores as written.
pub(crate) fn free_form_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true
    })
}

/// One environment variable for an operand's main container.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct EnvVar {
    /// Name of the variable. Required and not empty.
    #[schemars(length(min = 1))]
    pub name: String,
    /// Literal value of the variable; absent means the empty string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

/// Compute resources for an operand's containers, in the same form as a container's
/// `resources` (without `claims`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ResourceRequirements {
    /// Upper bounds, for example `{cpu: 500m, memory: 1Gi}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "quantity_map")]
    pub limits: Option<BTreeMap<String, Quantity>>,
    /// Amounts the scheduler reserves; they default to the limits when only limits are given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "quantity_map")]
    pub requests: Option<BTreeMap<String, Quantity>>,
}

/// Where a container image comes from and how it is pulled.
///
/// The image is `repository/image:version`, or `repository/image@sha256:...` when version is a
/// digest starting with `sha256:`. When repository and version are both empty, image may hold a
/// complete reference on its own (useful for tools that pin images by digest). When all three
/// are empty the operator falls back to its environment (for example DRIVER_IMAGE, set by OLM),
/// then to the version it pins.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageSpec {
    /// Registry and path that hold the image, for example nvcr.io/nvidia.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repository: Option<String>,
    /// Image name, for example driver; or a complete image reference when repository and version
    /// are left empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = IMAGE_PATTERN))]
    pub image: Option<String>,
    /// Image tag, or a digest such as sha256:0123... (then joined with @ instead of :).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// When the kubelet pulls the image: Always, Never or IfNotPresent. Any other value is
    /// treated as IfNotPresent, which is also the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    /// Names of Secrets in the operator's namespace used to pull the image. They are added to
    /// the operand's pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secrets: Option<Vec<String>>,
}

/// Overrides for an operand's containers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ContainerOverrides {
    /// Resource requests and limits, applied to every regular container of the operand's pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Arguments that replace the main container's arguments. Note that for some operands this
    /// bypasses the entrypoint that waits for the driver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Vec<String>>,
    /// Environment variables set on the main container. A variable the operator also sets is
    /// overridden by the value given here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<EnvVar>>,
}

/// A reference to a ConfigMap in the operator's namespace, by name.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ConfigMapName {
    /// Name of the ConfigMap in the operator's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Timing of a container probe. Unset values keep the operand's built-in probe timing.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContainerProbeSpec {
    /// Seconds after the container starts before the first probe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_delay_seconds: Option<i32>,
    /// Seconds after which one probe attempt times out. At least 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub timeout_seconds: Option<i32>,
    /// Seconds between probes. At least 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub period_seconds: Option<i32>,
    /// Consecutive successes after a failure before the probe counts as passing. At least 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub success_threshold: Option<i32>,
    /// Consecutive failures before the probe counts as failed. At least 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub failure_threshold: Option<i32>,
}

/// Reads an optional `enabled` switch with the operand's default for an absent value.
pub(crate) fn enabled_or(enabled: Option<bool>, default: bool) -> bool {
    enabled.unwrap_or(default)
}
