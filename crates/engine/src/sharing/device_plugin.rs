//! Validate stage (pure, no IO): one key of the device plugin's ConfigMap, judged as the pinned
//! plugin (k8s-device-plugin v0.20.0, docs/config-facts.md §1) judges it when the operator runs it.
//!
//! The plugin reads the file with `sigs.k8s.io/yaml` into Go structs: ordinary sections match
//! keys case-insensitively and ignore unknown ones; the `sharing.timeSlicing` / `sharing.mps`
//! sections and their resource items have hand-written decoders with exact keys. Then the
//! command line and environment overwrite the file, and the plugin checks the merged flags. We
//! reject exactly what makes it exit (decision 5), and warn about what it ignores or resets.
//!
//! The environment the operator gives the plugin ([`OPERATOR_PLUGIN_ENV`], plus `MIG_STRATEGY`
//! from `spec.mig.strategy`) beats the file, so a file value those variables replace cannot
//! stop the plugin: it only earns a warning. Type errors still count everywhere, because the
//! plugin decodes the whole file before anything overwrites it.

use std::collections::BTreeMap;

use super::problems::{Problems, unknown_field_hint};
use super::yaml::{self, Node, dedup_entries};
use super::{ConfigProblem, ProblemReason};

/// The MIG strategies the plugin knows, exactly (case-sensitive).
pub const MIG_STRATEGIES: [&str; 3] = ["none", "single", "mixed"];

/// The variable through which `spec.mig.strategy` reaches the device plugin and GFD.
pub const MIG_STRATEGY_ENV: &str = "MIG_STRATEGY";

/// Environment the operator sets on the device plugin container besides `MIG_STRATEGY` and
/// `CONFIG_FILE` (NVIDIA's operator sets the same). The plugin lets the environment beat the
/// config file, so these file fields are inert, and the validator and the parity test both
/// assume them. The render stage should take its values from here.
pub const OPERATOR_PLUGIN_ENV: &[(&str, &str)] = &[
    ("PASS_DEVICE_SPECS", "true"),
    ("FAIL_ON_INIT_ERROR", "true"),
    ("DEVICE_LIST_STRATEGY", "envvar"),
    ("DEVICE_ID_STRATEGY", "uuid"),
    ("MPS_ROOT", "/run/nvidia/mps"),
];

/// The file field each variable of [`OPERATOR_PLUGIN_ENV`] replaces.
const ENV_OVERRIDES: &[(&str, &str)] = &[
    ("flags.failOnInitError", "FAIL_ON_INIT_ERROR"),
    ("flags.mpsRoot", "MPS_ROOT"),
    ("flags.plugin.passDeviceSpecs", "PASS_DEVICE_SPECS"),
    ("flags.plugin.deviceListStrategy", "DEVICE_LIST_STRATEGY"),
    ("flags.plugin.deviceIDStrategy", "DEVICE_ID_STRATEGY"),
];

/// Resource names the plugin accepts at most this long (`nvidia.com/` included).
const MAX_RESOURCE_NAME_LENGTH: usize = 63;
/// Replicas the MPS control daemon allows per GPU (compute capability >= 7.5 / older).
const MPS_MAX_REPLICAS: u64 = 48;
const MPS_MAX_REPLICAS_PRE_VOLTA: u64 = 16;

const TOP_FIELDS: &[&str] = &["version", "flags", "resources", "sharing", "imex"];
const FLAG_FIELDS: &[&str] = &[
    "migStrategy",
    "failOnInitError",
    "nvidiaDriverRoot",
    "nvidiaDevRoot",
    "mpsRoot",
    "gdrcopyEnabled",
    "gdsEnabled",
    "mofedEnabled",
    "useNodeFeatureAPI",
    "deviceDiscoveryStrategy",
    "plugin",
    "gfd",
];
const FLAG_BOOLS: &[&str] = &[
    "failOnInitError",
    "gdrcopyEnabled",
    "gdsEnabled",
    "mofedEnabled",
    "useNodeFeatureAPI",
];
const PLUGIN_FIELDS: &[&str] = &[
    "passDeviceSpecs",
    "deviceListStrategy",
    "deviceIDStrategy",
    "cdiAnnotationPrefix",
    "nvidiaCTKPath",
    "containerDriverRoot",
    "sharedDevicesAllocationPolicy",
];
const GFD_FIELDS: &[&str] = &[
    "oneshot",
    "noTimestamp",
    "sleepInterval",
    "outputFile",
    "machineTypeFile",
];
const RESOURCES_FIELDS: &[&str] = &["gpus", "mig"];
const RESOURCE_PATTERN_FIELDS: &[&str] = &["pattern", "name"];
const SHARING_FIELDS: &[&str] = &["timeSlicing", "mps"];
const REPLICATED_FIELDS: &[&str] = &["renameByDefault", "failRequestsGreaterThanOne", "resources"];
const REPLICATED_RESOURCE_FIELDS: &[&str] = &["name", "devices", "replicas", "rename"];
const IMEX_FIELDS: &[&str] = &["channelIDs", "required"];

/// How GPUs are shared, as GFD reports it in `nvidia.com/gpu.sharing-strategy`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SharingStrategy {
    #[default]
    None,
    TimeSlicing,
    Mps,
}

impl SharingStrategy {
    pub const fn as_str(self) -> &'static str {
        match self {
            SharingStrategy::None => "none",
            SharingStrategy::TimeSlicing => "time-slicing",
            SharingStrategy::Mps => "mps",
        }
    }
}

/// One shared resource of the active sharing section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedResource {
    /// Full resource name, `nvidia.com/gpu` or `nvidia.com/mig-<profile>`.
    pub name: String,
    /// Replicas advertised per device.
    pub replicas: u64,
    /// Name the shared replicas are advertised under: `name`, or `name.shared` with
    /// `renameByDefault`.
    pub advertised_as: String,
}

/// What an accepted config does, and what in it the plugin ignores.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PluginConfigSummary {
    pub sharing: SharingStrategy,
    /// The resources of the active section (MPS when present, else time-slicing).
    pub resources: Vec<SharedResource>,
    pub rename_by_default: bool,
    /// Whether a pod asking for more than one replica is refused (MPS defaults to true).
    pub fail_requests_greater_than_one: bool,
    /// The MIG strategy the plugin runs with: `spec.mig.strategy` when given, else the file's
    /// `flags.migStrategy`, else `none`.
    pub mig_strategy: String,
    /// Keys and values the plugin ignores, resets or overrides; each names the ConfigMap, key
    /// and field.
    pub warnings: Vec<String>,
}

/// Checks one ConfigMap key holding a device plugin config file.
///
/// `mig_strategy_override` is `spec.mig.strategy`, which reaches the plugin as `MIG_STRATEGY`
/// and beats the file's `flags.migStrategy` (decision 5).
pub fn validate_key(
    config_map: &str,
    key: &str,
    yaml: &str,
    mig_strategy_override: Option<&str>,
) -> Result<PluginConfigSummary, Vec<ConfigProblem>> {
    let mut checker = Checker {
        problems: Problems::new(config_map, key),
        warnings: Vec::new(),
    };
    let summary = checker.check(yaml, mig_strategy_override);
    match summary {
        Some(mut summary) if checker.problems.is_empty() => {
            summary.warnings = checker.warnings;
            Ok(summary)
        }
        _ => Err(checker.problems.into_vec()),
    }
}

/// A decoded `sharing.timeSlicing` or `sharing.mps` section.
struct Replicated {
    rename_by_default: bool,
    fail_requests_greater_than_one: Option<bool>,
    resources: Vec<(String, u64)>,
}

struct Checker<'a> {
    problems: Problems<'a>,
    warnings: Vec<String>,
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// Matched fields of one section, in the order Go's decoder assigns them.
struct Fields<'n>(Vec<(&'static str, &'n Node)>);

impl<'n> Fields<'n> {
    /// The value that ends up in the field (the last assignment).
    fn last(&self, name: &str) -> Option<&'n Node> {
        self.0
            .iter()
            .rev()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| *v)
    }
    /// Every value assigned to the field; each one is decoded, so each can fail.
    fn all(&self, name: &'static str) -> impl Iterator<Item = &'n Node> + '_ {
        self.0
            .iter()
            .filter(move |(n, _)| *n == name)
            .map(|(_, v)| *v)
    }
    fn has(&self, name: &str) -> bool {
        self.0.iter().any(|(n, _)| *n == name)
    }
}

impl Checker<'_> {
    fn warn(&mut self, field: &str, message: impl AsRef<str>) {
        let warning = self.problems.locate(field, message.as_ref());
        self.warnings.push(warning);
    }

    fn check(&mut self, text: &str, mig_override: Option<&str>) -> Option<PluginConfigSummary> {
        let document = self
            .problems
            .document(text, ", the device plugin cannot read it")?;
        if document.more_documents {
            self.warn(
                "",
                "holds more than one YAML document; the device plugin reads only the first, remove the others",
            );
        }
        let top = match &document.node {
            Node::Null => Fields(Vec::new()),
            Node::Map(_) => self.ordinary("", &document.node, TOP_FIELDS)?,
            other => {
                self.problems.push(
                    "",
                    ProblemReason::WrongType,
                    format!(
                        "is {} at the top level; a device plugin config is a mapping that starts with `version: v1`",
                        other.describe()
                    ),
                );
                return None;
            }
        };

        for node in top.all("version") {
            let version = self.coerced_string("version", node).unwrap_or_default();
            if !version.is_empty() && version != "v1" {
                self.problems.push(
                    "version",
                    ProblemReason::UnknownVersion,
                    format!(
                        "is {version:?}; the only version the device plugin knows is v1 (write `version: v1`)"
                    ),
                );
            }
        }

        let file_mig_strategy = self.check_flags(top.last("flags"));
        if let Some(node) = top.last("resources") {
            self.check_resources_section(node);
        }
        if let Some(node) = top.last("imex") {
            self.check_imex(node);
        }

        let mig_strategy = self.effective_mig_strategy(file_mig_strategy, mig_override);

        let mut time_slicing = None;
        let mut mps = None;
        if let Some(sharing) = top.last("sharing")
            && let Some(fields) = self.ordinary("sharing", sharing, SHARING_FIELDS)
        {
            for node in fields.all("timeSlicing") {
                time_slicing = self.check_replicated("sharing.timeSlicing", node);
            }
            for node in fields.all("mps") {
                // A null `mps` is the same as none; a null `timeSlicing` is not (its decoder
                // runs on null and finds no resources).
                if *node != Node::Null {
                    mps = self.check_replicated("sharing.mps", node);
                } else {
                    mps = None;
                }
            }
            if fields.has("mps")
                && fields.last("mps") != Some(&Node::Null)
                && fields.has("timeSlicing")
            {
                self.warn(
                    "sharing.timeSlicing",
                    "is ignored because sharing.mps is also set (MPS wins); keep only the one you want",
                );
            }
        }

        let mig_strategy = mig_strategy?;
        let (sharing, active, section) = match (mps, time_slicing) {
            (Some(mps), _) => (SharingStrategy::Mps, Some(mps), "sharing.mps"),
            (None, Some(ts)) => (
                SharingStrategy::TimeSlicing,
                Some(ts),
                "sharing.timeSlicing",
            ),
            (None, None) => (SharingStrategy::None, None, ""),
        };

        if sharing == SharingStrategy::Mps {
            self.check_mps_limits(section, active.as_ref(), &mig_strategy, mig_override);
        }
        if let Some(active) = &active {
            for (i, (name, _)) in active.resources.iter().enumerate() {
                self.check_advertised(
                    &format!("{section}.resources[{i}].name"),
                    name,
                    &mig_strategy,
                    sharing == SharingStrategy::Mps,
                );
            }
        }

        let rename_by_default = active.as_ref().is_some_and(|a| a.rename_by_default);
        Some(PluginConfigSummary {
            sharing,
            resources: active
                .as_ref()
                .map(|a| {
                    a.resources
                        .iter()
                        .map(|(name, replicas)| SharedResource {
                            name: name.clone(),
                            replicas: *replicas,
                            advertised_as: if a.rename_by_default {
                                format!("{name}.shared")
                            } else {
                                name.clone()
                            },
                        })
                        .collect()
                })
                .unwrap_or_default(),
            rename_by_default,
            fail_requests_greater_than_one: match (&active, sharing) {
                (Some(a), SharingStrategy::Mps) => a.fail_requests_greater_than_one.unwrap_or(true),
                (Some(a), _) => a.fail_requests_greater_than_one.unwrap_or(false),
                (None, _) => false,
            },
            mig_strategy,
            warnings: Vec::new(),
        })
    }

    // ---- sections -------------------------------------------------------------------------

    /// An ordinary Go struct: keys match field names case-insensitively (an exact match first),
    /// unknown keys are ignored. `null` is an empty section; anything but a mapping is fatal.
    fn ordinary<'n>(
        &mut self,
        path: &str,
        node: &'n Node,
        fields: &[&'static str],
    ) -> Option<Fields<'n>> {
        let entries = match node {
            Node::Null => return Some(Fields(Vec::new())),
            Node::Map(entries) => entries,
            other => {
                self.problems.push(
                    path,
                    ProblemReason::WrongType,
                    format!("is {}; it must be a mapping", other.describe()),
                );
                return None;
            }
        };
        let (mut entries, duplicated) = dedup_entries(entries);
        for key in duplicated {
            self.warn(
                &join(path, key),
                "appears more than once; the device plugin keeps the last value, remove the others",
            );
        }
        // The YAML becomes a Go map and then JSON, whose keys are sorted; for keys that differ
        // only in case, the one sorting last wins.
        entries.sort_by(|a, b| a.0.cmp(b.0));
        let mut matched = Vec::new();
        for (key, value) in entries {
            if let Some(field) = fields.iter().find(|f| **f == key) {
                matched.push((*field, value));
            } else if let Some(field) = fields.iter().find(|f| f.eq_ignore_ascii_case(key)) {
                self.warn(
                    &join(path, key),
                    format!(
                        "is read as {field} only because the device plugin ignores case here; write {field}"
                    ),
                );
                matched.push((*field, value));
            } else {
                self.unknown_key(path, key, fields);
            }
        }
        Some(Fields(matched))
    }

    /// A section with a hand-written decoder: keys are exact, unknown ones ignored.
    fn exact<'n>(
        &mut self,
        path: &str,
        entries: &'n [(String, Node)],
        fields: &[&'static str],
    ) -> Fields<'n> {
        let (entries, duplicated) = dedup_entries(entries);
        for key in duplicated {
            self.warn(
                &join(path, key),
                "appears more than once; the device plugin keeps the last value, remove the others",
            );
        }
        let mut matched = Vec::new();
        for (key, value) in entries {
            if let Some(field) = fields.iter().find(|f| **f == key) {
                matched.push((*field, value));
            } else if let Some(field) = fields.iter().find(|f| f.eq_ignore_ascii_case(key)) {
                self.warn(
                    &join(path, key),
                    format!(
                        "is ignored: keys here are case-sensitive, so the device plugin does not read it as {field}; write {field}"
                    ),
                );
            } else {
                self.unknown_key(path, key, fields);
            }
        }
        Fields(matched)
    }

    fn unknown_key(&mut self, path: &str, key: &str, fields: &[&'static str]) {
        let where_ = if path.is_empty() {
            "at the top level".to_string()
        } else {
            format!("in {path}")
        };
        let hint = unknown_field_hint(key, fields, &format!("the keys it reads {where_} are"));
        self.warn(
            &join(path, key),
            format!("is not a key the device plugin knows {where_}; it is ignored ({hint})"),
        );
    }

    /// `flags`, `flags.plugin`, `flags.gfd`. Returns the file's `migStrategy`.
    fn check_flags(&mut self, node: Option<&Node>) -> Option<String> {
        let fields = self.ordinary("flags", node?, FLAG_FIELDS)?;
        let mut mig_strategy = None;
        for (name, value) in &fields.0 {
            let field = join("flags", name);
            match *name {
                "plugin" => self.check_plugin_flags(value),
                "gfd" => self.check_gfd_flags(value),
                bool_field if FLAG_BOOLS.contains(&bool_field) => {
                    self.boolean(&field, value);
                }
                "migStrategy" => mig_strategy = self.coerced_string(&field, value),
                "deviceDiscoveryStrategy" => {
                    if let Some(v) = self.coerced_string(&field, value)
                        && !["auto", "nvml", "tegra"].contains(&v.as_str())
                    {
                        self.problems.push(
                            &field,
                            ProblemReason::InvalidValue,
                            format!(
                                "is {v:?}; the device plugin accepts auto, nvml or tegra (vfio is for GPU feature discovery only)"
                            ),
                        );
                    }
                }
                _ => {
                    self.coerced_string(&field, value);
                }
            }
        }
        for (field, env) in ENV_OVERRIDES {
            if let Some(name) = field.strip_prefix("flags.")
                && !name.contains('.')
                && fields.last(name).is_some_and(|v| *v != Node::Null)
            {
                self.warn_overridden(field, env);
            }
        }
        mig_strategy
    }

    fn warn_overridden(&mut self, field: &str, env: &str) {
        let value = OPERATOR_PLUGIN_ENV
            .iter()
            .find(|(name, _)| name == &env)
            .map_or("", |(_, v)| v);
        self.warn(
            field,
            format!(
                "has no effect: the operator sets {env}={value} on the device plugin, and the environment beats the file; remove it"
            ),
        );
    }

    fn check_plugin_flags(&mut self, node: &Node) {
        let Some(fields) = self.ordinary("flags.plugin", node, PLUGIN_FIELDS) else {
            return;
        };
        for (name, value) in &fields.0 {
            let field = join("flags.plugin", name);
            match *name {
                "passDeviceSpecs" => {
                    self.boolean(&field, value);
                }
                "deviceListStrategy" => match value {
                    Node::Null | Node::Str(_) => {}
                    Node::Seq(items) => {
                        for (i, item) in items.iter().enumerate() {
                            if !matches!(item, Node::Str(_) | Node::Null) {
                                self.problems.push(
                                    &format!("{field}[{i}]"),
                                    ProblemReason::WrongType,
                                    format!(
                                        "is {}; it must be a strategy name such as envvar (a string)",
                                        item.describe()
                                    ),
                                );
                            }
                        }
                    }
                    other => self.problems.push(
                        &field,
                        ProblemReason::WrongType,
                        format!(
                            "is {}; it must be a strategy name or a list of them (envvar, volume-mounts, cdi-annotations, cdi-cri)",
                            other.describe()
                        ),
                    ),
                },
                "sharedDevicesAllocationPolicy" => {
                    if let Some(v) = self.coerced_string(&field, value)
                        && !["distributed", "packed"].contains(&v.as_str())
                    {
                        self.problems.push(
                            &field,
                            ProblemReason::InvalidValue,
                            format!("is {v:?}; it must be distributed or packed"),
                        );
                    }
                }
                _ => {
                    self.coerced_string(&field, value);
                }
            }
        }
        for (field, env) in ENV_OVERRIDES {
            if let Some(name) = field.strip_prefix("flags.plugin.")
                && fields.last(name).is_some_and(|v| *v != Node::Null)
            {
                self.warn_overridden(field, env);
            }
        }
    }

    fn check_gfd_flags(&mut self, node: &Node) {
        let Some(fields) = self.ordinary("flags.gfd", node, GFD_FIELDS) else {
            return;
        };
        for (name, value) in &fields.0 {
            let field = join("flags.gfd", name);
            match *name {
                "oneshot" | "noTimestamp" => {
                    self.boolean(&field, value);
                }
                "sleepInterval" => self.check_duration(&field, value),
                _ => {
                    self.coerced_string(&field, value);
                }
            }
        }
    }

    fn check_duration(&mut self, field: &str, node: &Node) {
        match node {
            Node::Null => {}
            Node::Str(s) if s == "infinite" || is_go_duration(s) => {}
            Node::Str(s) => self.problems.push(
                field,
                ProblemReason::InvalidValue,
                format!("is {s:?}; it must be a duration such as 60s, 5m or 1h30m, or infinite"),
            ),
            Node::Int(_) | Node::Float(_) => self.warn(
                field,
                format!(
                    "is the bare number {}, which GPU feature discovery reads as nanoseconds; write a unit, such as 60s",
                    node.describe()
                ),
            ),
            other => self.problems.push(
                field,
                ProblemReason::WrongType,
                format!(
                    "is {}; it must be a duration such as 60s",
                    other.describe()
                ),
            ),
        }
    }

    fn check_imex(&mut self, node: &Node) {
        let Some(fields) = self.ordinary("imex", node, IMEX_FIELDS) else {
            return;
        };
        for node in fields.all("required") {
            self.boolean("imex.required", node);
        }
        for node in fields.all("channelIDs") {
            let ids = match node {
                Node::Null => Vec::new(),
                Node::Seq(items) => {
                    let mut ids = Vec::new();
                    for (i, item) in items.iter().enumerate() {
                        match item {
                            Node::Null => ids.push(0),
                            _ => match item.as_integer() {
                                Some(id) => ids.push(id),
                                None => self.problems.push(
                                    &format!("imex.channelIDs[{i}]"),
                                    ProblemReason::WrongType,
                                    format!("is {}; it must be a number", item.describe()),
                                ),
                            },
                        }
                    }
                    ids
                }
                other => {
                    self.problems.push(
                        "imex.channelIDs",
                        ProblemReason::WrongType,
                        format!("is {}; it must be a list of numbers", other.describe()),
                    );
                    continue;
                }
            };
            if !(ids.is_empty() || ids == [0]) {
                self.problems.push(
                    "imex.channelIDs",
                    ProblemReason::InvalidValue,
                    "may only be [] or [0]; the device plugin supports IMEX channel 0 alone",
                );
            }
        }
    }

    /// The top-level `resources` section: decoded and checked, then dropped by the plugin.
    fn check_resources_section(&mut self, node: &Node) {
        let Some(fields) = self.ordinary("resources", node, RESOURCES_FIELDS) else {
            return;
        };
        for (name, value) in &fields.0 {
            let path = join("resources", name);
            let items = match value {
                Node::Null => continue,
                Node::Seq(items) => items,
                other => {
                    self.problems.push(
                        &path,
                        ProblemReason::WrongType,
                        format!(
                            "is {}; it must be a list of {{pattern, name}} items",
                            other.describe()
                        ),
                    );
                    continue;
                }
            };
            for (i, item) in items.iter().enumerate() {
                let item_path = format!("{path}[{i}]");
                let Node::Map(entries) = item else {
                    self.problems.push(
                        &item_path,
                        ProblemReason::WrongType,
                        format!(
                            "is {}; it must be a mapping with pattern and name",
                            item.describe()
                        ),
                    );
                    continue;
                };
                let fields = self.exact(&item_path, entries, RESOURCE_PATTERN_FIELDS);
                match fields.last("pattern") {
                    None => self.problems.push(
                        &item_path,
                        ProblemReason::MissingField,
                        "has no pattern; every item needs both pattern and name",
                    ),
                    Some(pattern) => {
                        self.plain_string(&format!("{item_path}.pattern"), pattern);
                    }
                }
                match fields.last("name") {
                    None => self.problems.push(
                        &item_path,
                        ProblemReason::MissingField,
                        "has no name; every item needs both pattern and name",
                    ),
                    Some(name) => {
                        self.resource_name(&format!("{item_path}.name"), name);
                    }
                }
            }
            if !items.is_empty() {
                self.warn(
                    &path,
                    "is not supported yet by the device plugin, which ignores it; remove it",
                );
            }
        }
    }

    /// `sharing.timeSlicing` or `sharing.mps`.
    fn check_replicated(&mut self, path: &str, node: &Node) -> Option<Replicated> {
        let entries = match node {
            Node::Map(entries) => entries,
            Node::Null => {
                self.problems.push(
                    path,
                    ProblemReason::MissingField,
                    "is empty; it needs a resources list (to share nothing, remove the section)",
                );
                return None;
            }
            other => {
                self.problems.push(
                    path,
                    ProblemReason::WrongType,
                    format!(
                        "is {}; it must be a mapping with a resources list",
                        other.describe()
                    ),
                );
                return None;
            }
        };
        let fields = self.exact(path, entries, REPLICATED_FIELDS);
        let rename_by_default = fields
            .last("renameByDefault")
            .and_then(|n| self.boolean(&join(path, "renameByDefault"), n))
            .unwrap_or(false);
        let fail_requests_greater_than_one = fields
            .last("failRequestsGreaterThanOne")
            .and_then(|n| self.boolean(&join(path, "failRequestsGreaterThanOne"), n));
        let resources_path = join(path, "resources");
        let items = match fields.last("resources") {
            None => {
                self.problems.push(
                    path,
                    ProblemReason::MissingField,
                    "has no resources; list what to share, for example `resources: [{name: nvidia.com/gpu, replicas: 4}]`",
                );
                return None;
            }
            Some(Node::Seq(items)) if !items.is_empty() => items,
            Some(Node::Seq(_) | Node::Null) => {
                self.problems.push(
                    &resources_path,
                    ProblemReason::MissingField,
                    "is empty; list at least one resource to share (to share nothing, remove the section)",
                );
                return None;
            }
            Some(other) => {
                self.problems.push(
                    &resources_path,
                    ProblemReason::WrongType,
                    format!(
                        "is {}; it must be a list of {{name, replicas}} items",
                        other.describe()
                    ),
                );
                return None;
            }
        };
        let mut resources = Vec::new();
        let mut valid = true;
        for (i, item) in items.iter().enumerate() {
            match self.check_replicated_resource(
                &format!("{resources_path}[{i}]"),
                item,
                rename_by_default,
            ) {
                Some(resource) => resources.push(resource),
                None => valid = false,
            }
        }
        let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, (name, _)) in resources.iter().enumerate() {
            if let Some(first) = seen.insert(name.as_str(), i) {
                self.warn(
                    &format!("{resources_path}[{i}]"),
                    format!(
                        "shares {name} again (first at {resources_path}[{first}]); the device plugin does not reject this, but only one entry can apply, remove the duplicate"
                    ),
                );
            }
        }
        valid.then_some(Replicated {
            rename_by_default,
            fail_requests_greater_than_one,
            resources,
        })
    }

    fn check_replicated_resource(
        &mut self,
        path: &str,
        node: &Node,
        rename_by_default: bool,
    ) -> Option<(String, u64)> {
        let entries = match node {
            Node::Map(entries) => entries,
            other => {
                self.problems.push(
                    path,
                    ProblemReason::WrongType,
                    format!(
                        "is {}; each resource is a mapping such as {{name: nvidia.com/gpu, replicas: 4}}",
                        other.describe()
                    ),
                );
                return None;
            }
        };
        let fields = self.exact(path, entries, REPLICATED_RESOURCE_FIELDS);
        let name = match fields.last("name") {
            None => {
                self.problems.push(
                    path,
                    ProblemReason::MissingField,
                    "has no name; add `name: nvidia.com/gpu` (or the resource to share)",
                );
                None
            }
            Some(node) => self.resource_name(&join(path, "name"), node),
        };
        let devices_all = match fields.last("devices") {
            None => Some(true),
            Some(node) => self.devices(&join(path, "devices"), node),
        };
        let replicas = match fields.last("replicas") {
            None => {
                self.problems.push(
                    path,
                    ProblemReason::MissingField,
                    "has no replicas; add `replicas: N` with N at least 2",
                );
                None
            }
            Some(node) => self.replicas(&join(path, "replicas"), node),
        };
        let rename = fields
            .last("rename")
            .map(|node| self.resource_name(&join(path, "rename"), node));

        let (name, replicas, devices_all) = (name?, replicas?, devices_all?);
        if let Some(rename) = rename {
            let rename = rename?;
            let default_rename = format!("{name}.shared");
            if !rename_by_default {
                self.warn(
                    &join(path, "rename"),
                    "is ignored: the device plugin does not support renaming yet; set renameByDefault: true to advertise <name>.shared, or remove rename",
                );
            } else if rename != default_rename {
                self.warn(
                    &join(path, "rename"),
                    format!(
                        "is ignored: with renameByDefault the resource is always advertised as {default_rename}; remove rename"
                    ),
                );
            }
        }
        if !devices_all {
            self.warn(
                &join(path, "devices"),
                "is ignored: the device plugin shares every device (choosing devices is not supported yet); remove devices",
            );
        }
        Some((name, replicas))
    }

    // ---- values ---------------------------------------------------------------------------

    /// A string field of an ordinary section: scalars become text (`1`, `true`).
    fn coerced_string(&mut self, field: &str, node: &Node) -> Option<String> {
        match node {
            Node::Null => None,
            Node::Str(s) => Some(s.clone()),
            Node::Bool(b) => Some(b.to_string()),
            Node::Int(i) => Some(i.to_string()),
            Node::Float(f) => Some(yaml::format_float(*f)),
            other => {
                self.problems.push(
                    field,
                    ProblemReason::WrongType,
                    format!("is {}; it must be a single value", other.describe()),
                );
                None
            }
        }
    }

    /// A string inside a hand-written decoder: no coercion.
    fn plain_string(&mut self, field: &str, node: &Node) -> Option<String> {
        match node {
            Node::Null => Some(String::new()),
            Node::Str(s) => Some(s.clone()),
            other => {
                self.problems.push(
                    field,
                    ProblemReason::WrongType,
                    format!("is {}; it must be a string (quote it)", other.describe()),
                );
                None
            }
        }
    }

    fn boolean(&mut self, field: &str, node: &Node) -> Option<bool> {
        match node {
            Node::Null => None,
            Node::Bool(b) => Some(*b),
            Node::Str(s) => {
                let hint = match s.to_ascii_lowercase().as_str() {
                    "true" | "yes" | "on" | "y" => "; write true without quotes",
                    "false" | "no" | "off" | "n" => "; write false without quotes",
                    _ => "",
                };
                self.problems.push(
                    field,
                    ProblemReason::WrongType,
                    format!("is {}; it must be true or false{hint}", node.describe()),
                );
                None
            }
            other => {
                self.problems.push(
                    field,
                    ProblemReason::WrongType,
                    format!("is {}; it must be true or false", other.describe()),
                );
                None
            }
        }
    }

    fn replicas(&mut self, field: &str, node: &Node) -> Option<u64> {
        match node.as_integer() {
            Some(n) if n > i128::from(i64::MAX) => {
                self.problems.push(
                    field,
                    ProblemReason::InvalidReplicas,
                    format!(
                        "is {n}, too large for the device plugin; use a realistic number such as 4"
                    ),
                );
                None
            }
            Some(n) if n < 2 => {
                self.problems.push(
                    field,
                    ProblemReason::InvalidReplicas,
                    format!(
                        "is {n}; it must be at least 2 (1 means no sharing: remove the resource instead)"
                    ),
                );
                None
            }
            Some(n) => u64::try_from(n).ok(),
            None => {
                let message = match node {
                    Node::Null => "is empty; it must be a number of at least 2".to_string(),
                    Node::Str(s) if s.trim().parse::<i64>().is_ok() => format!(
                        "is the string {s:?}; it must be a number: write {} without quotes",
                        s.trim()
                    ),
                    other => format!(
                        "is {}; it must be a whole number of at least 2",
                        other.describe()
                    ),
                };
                let reason = if *node == Node::Null {
                    ProblemReason::InvalidReplicas
                } else {
                    ProblemReason::WrongType
                };
                self.problems.push(field, reason, message);
                None
            }
        }
    }

    /// `devices`: `all`, a positive count, or a list of device references. Returns whether it
    /// is `all`.
    fn devices(&mut self, field: &str, node: &Node) -> Option<bool> {
        const FORMS: &str =
            "all, a count of at least 1, or a list of GPU indexes, MIG indexes (\"0:1\") or UUIDs";
        match node {
            Node::Str(s) if s == "all" => Some(true),
            Node::Str(_) | Node::Null => {
                self.problems.push(
                    field,
                    ProblemReason::InvalidValue,
                    format!(
                        "is {}; it must be {FORMS} (`all` is lowercase)",
                        node.describe()
                    ),
                );
                None
            }
            Node::Seq(items) => {
                let mut valid = true;
                for (i, item) in items.iter().enumerate() {
                    let ok = match item {
                        Node::Null => true,
                        Node::Str(s) => is_device_ref(s),
                        other => other
                            .as_integer()
                            .is_some_and(|n| n >= 0 && n <= i128::from(u64::MAX)),
                    };
                    if !ok {
                        valid = false;
                        self.problems.push(
                            &format!("{field}[{i}]"),
                            ProblemReason::InvalidValue,
                            format!(
                                "is {}; list GPU indexes (0), MIG indexes (\"0:1\") or UUIDs (GPU-..., MIG-...)",
                                item.describe()
                            ),
                        );
                    }
                }
                valid.then_some(false)
            }
            other => match other.as_integer() {
                Some(n) if n > 0 && n <= i128::from(i64::MAX) => Some(false),
                _ => {
                    self.problems.push(
                        field,
                        ProblemReason::InvalidValue,
                        format!("is {}; it must be {FORMS}", other.describe()),
                    );
                    None
                }
            },
        }
    }

    /// A resource name: `nvidia.com/` is prepended unless present, and the rest must be a DNS
    /// subdomain. Returns the full name.
    fn resource_name(&mut self, field: &str, node: &Node) -> Option<String> {
        let raw = match node {
            Node::Str(s) => s.as_str(),
            Node::Null => "",
            other => {
                self.problems.push(
                    field,
                    ProblemReason::WrongType,
                    format!(
                        "is {}; it must be a resource name such as nvidia.com/gpu (quote it)",
                        other.describe()
                    ),
                );
                return None;
            }
        };
        let full = if raw.starts_with("nvidia.com/") {
            raw.to_string()
        } else {
            format!("nvidia.com/{raw}")
        };
        if full.len() > MAX_RESOURCE_NAME_LENGTH {
            self.problems.push(
                field,
                ProblemReason::InvalidResourceName,
                format!(
                    "is {raw:?}: {full} has {} characters, more than the {MAX_RESOURCE_NAME_LENGTH} a resource name may have; shorten it",
                    full.len()
                ),
            );
            return None;
        }
        let name = full.split_once('/').map_or(full.as_str(), |(_, n)| n);
        if !is_dns_subdomain(name) {
            let lower = raw.to_ascii_lowercase();
            let hint = if raw.is_empty() {
                "name the resource to share, such as nvidia.com/gpu".to_string()
            } else if lower.starts_with("nvidia.com/")
                && is_dns_subdomain(&lower["nvidia.com/".len()..])
            {
                format!("write it in lowercase ({lower})")
            } else if name.contains('/') {
                "resources always live under nvidia.com/, so write only the part after it, such as gpu".to_string()
            } else if name.chars().any(|c| c.is_ascii_uppercase())
                && is_dns_subdomain(&name.to_ascii_lowercase())
            {
                format!("write it in lowercase ({})", full.to_ascii_lowercase())
            } else {
                "after nvidia.com/ use lowercase letters, digits, '-' and '.', starting and ending with a letter or digit".to_string()
            };
            self.problems.push(
                field,
                ProblemReason::InvalidResourceName,
                format!("is {raw:?}, and {full} is not a valid resource name; {hint}"),
            );
            return None;
        }
        Some(full)
    }

    // ---- cross-field ----------------------------------------------------------------------

    /// The MIG strategy the plugin runs with. `None` when it is invalid (already reported).
    fn effective_mig_strategy(
        &mut self,
        file: Option<String>,
        mig_override: Option<&str>,
    ) -> Option<String> {
        match mig_override {
            Some(policy) => {
                if !MIG_STRATEGIES.contains(&policy) {
                    self.problems.push(
                        "",
                        ProblemReason::InvalidValue,
                        format!(
                            "cannot be used: the ClusterPolicy's spec.mig.strategy is {policy:?}, and the device plugin accepts only none, single or mixed"
                        ),
                    );
                    return None;
                }
                if let Some(file) = file.filter(|f| f != policy) {
                    self.warn(
                        "flags.migStrategy",
                        format!(
                            "is {file:?}, but the ClusterPolicy's spec.mig.strategy ({policy}) wins ({MIG_STRATEGY_ENV} beats the file); remove it or make them agree"
                        ),
                    );
                }
                Some(policy.to_string())
            }
            None => {
                let strategy = file.unwrap_or_else(|| "none".to_string());
                if MIG_STRATEGIES.contains(&strategy.as_str()) {
                    Some(strategy)
                } else {
                    self.problems.push(
                        "flags.migStrategy",
                        ProblemReason::InvalidValue,
                        format!(
                            "is {strategy:?}; it must be none, single or mixed (lowercase), or set spec.mig.strategy in the ClusterPolicy"
                        ),
                    );
                    None
                }
            }
        }
    }

    fn check_mps_limits(
        &mut self,
        section: &str,
        active: Option<&Replicated>,
        mig_strategy: &str,
        mig_override: Option<&str>,
    ) {
        let source = if mig_override.is_some() {
            "the ClusterPolicy's spec.mig.strategy"
        } else {
            "flags.migStrategy"
        };
        match mig_strategy {
            "mixed" => self.problems.push(
                section,
                ProblemReason::MpsWithMixedMig,
                format!(
                    "cannot be used with MIG strategy mixed (from {source}): the device plugin refuses MPS under mixed; use MIG strategy none or single, or time-slicing"
                ),
            ),
            "single" => self.warn(
                section,
                "is used with MIG strategy single: the device plugin stops on nodes whose GPUs have MIG enabled (MPS shares full GPUs only)",
            ),
            _ => {}
        }
        for (i, (_, replicas)) in active
            .map(|a| a.resources.as_slice())
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            let field = format!("{section}.resources[{i}].replicas");
            if *replicas > MPS_MAX_REPLICAS {
                self.warn(
                    &field,
                    format!(
                        "is {replicas}: the MPS control daemon refuses more than {MPS_MAX_REPLICAS} replicas per GPU ({MPS_MAX_REPLICAS_PRE_VOLTA} on GPUs before compute capability 7.5) and will not start; lower it"
                    ),
                );
            } else if *replicas > MPS_MAX_REPLICAS_PRE_VOLTA {
                self.warn(
                    &field,
                    format!(
                        "is {replicas}: the MPS control daemon refuses more than {MPS_MAX_REPLICAS_PRE_VOLTA} replicas on GPUs before compute capability 7.5 (such as V100 or P100)"
                    ),
                );
            }
        }
    }

    /// Warns when a shared resource is not one the plugin advertises under this strategy.
    fn check_advertised(&mut self, field: &str, name: &str, mig_strategy: &str, mps: bool) {
        let short = name.strip_prefix("nvidia.com/").unwrap_or(name);
        if short == "gpu" {
            return;
        }
        if short.starts_with("mig-") {
            if mps {
                self.warn(
                    field,
                    format!("is {name}, but MPS shares full GPUs only; this entry shares nothing"),
                );
            } else if mig_strategy != "mixed" {
                self.warn(
                    field,
                    format!(
                        "is {name}, which the device plugin advertises only under MIG strategy mixed (it runs with {mig_strategy}); this entry shares nothing"
                    ),
                );
            }
            return;
        }
        self.warn(
            field,
            format!(
                "is {name}, which the device plugin never advertises (it advertises nvidia.com/gpu, and nvidia.com/mig-<profile> under MIG strategy mixed); this entry shares nothing"
            ),
        );
    }
}

/// RFC 1123 subdomain: at most 253 characters, dot-separated labels of lowercase letters,
/// digits and '-', each starting and ending with a letter or digit.
fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            let bytes = label.as_bytes();
            !bytes.is_empty()
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
                && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
                && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
        })
}

/// A `devices` list entry: a GPU index, a MIG index `<gpu>:<mig>`, or a GPU or MIG UUID.
fn is_device_ref(s: &str) -> bool {
    let is_index = |t: &str| {
        !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) && t.parse::<u64>().is_ok()
    };
    let is_gpu_uuid = |t: &str| t.strip_prefix("GPU-").is_some_and(is_uuid);
    if is_index(s) || is_gpu_uuid(s) {
        return true;
    }
    if let Some((gpu, mig)) = s.split_once(':')
        && is_index(gpu)
        && is_index(mig)
    {
        return true;
    }
    let Some(suffix) = s.strip_prefix("MIG-") else {
        return false;
    };
    if is_uuid(suffix) {
        return true;
    }
    let parts: Vec<&str> = suffix.splitn(3, '/').collect();
    matches!(parts.as_slice(), [gpu, gi, ci] if is_gpu_uuid(gpu) && is_index(gi) && is_index(ci))
}

/// The UUID forms Go's `github.com/google/uuid.Parse` accepts.
fn is_uuid(s: &str) -> bool {
    let hex = |t: &str| t.bytes().all(|b| b.is_ascii_hexdigit());
    let dashed = |t: &str| {
        t.len() == 36
            && t.bytes().enumerate().all(|(i, b)| {
                if [8, 13, 18, 23].contains(&i) {
                    b == b'-'
                } else {
                    b.is_ascii_hexdigit()
                }
            })
    };
    match s.len() {
        32 => hex(s),
        36 => dashed(s),
        38 => s.starts_with('{') && s.ends_with('}') && dashed(&s[1..37]),
        45 => {
            s.get(..9)
                .is_some_and(|p| p.eq_ignore_ascii_case("urn:uuid:"))
                && dashed(&s[9..])
        }
        _ => false,
    }
}

/// Go's `time.ParseDuration` syntax: `[-+]?` then one or more `<number><unit>`, or `0`.
fn is_go_duration(s: &str) -> bool {
    let s = s.strip_prefix(['-', '+']).unwrap_or(s);
    if s == "0" {
        return true;
    }
    if s.is_empty() {
        return false;
    }
    let mut rest = s;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number = &rest[..number_len];
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return false;
        }
        rest = &rest[number_len..];
        let Some(unit) = ["ns", "us", "µs", "μs", "ms", "s", "m", "h"]
            .iter()
            .filter(|u| rest.starts_with(**u))
            .max_by_key(|u| u.len())
        else {
            return false;
        };
        rest = &rest[unit.len()..];
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(yaml: &str) -> PluginConfigSummary {
        validate_key("cm", "k", yaml, None).unwrap_or_else(|p| panic!("rejected: {p:?}"))
    }

    fn problems(yaml: &str, strategy: Option<&str>) -> Vec<String> {
        validate_key("cm", "k", yaml, strategy)
            .map(|s| panic!("accepted: {s:?}"))
            .unwrap_or_else(|p| p.iter().map(ToString::to_string).collect())
    }

    #[test]
    fn time_slicing_summary_reports_replicas_and_rename() {
        let s = ok(
            "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n    - name: gpu\n      replicas: 4\n",
        );
        assert_eq!(s.sharing, SharingStrategy::TimeSlicing);
        assert_eq!(
            s.resources,
            vec![SharedResource {
                name: "nvidia.com/gpu".into(),
                replicas: 4,
                advertised_as: "nvidia.com/gpu.shared".into()
            }]
        );
        assert!(s.rename_by_default);
        assert!(!s.fail_requests_greater_than_one);
        assert_eq!(s.mig_strategy, "none");
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    }

    #[test]
    fn replicas_zero_names_configmap_key_field_and_fix() {
        let p = validate_key(
            "time-slicing-config",
            "any",
            "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 0\n",
            None,
        )
        .unwrap_err();
        assert_eq!(
            p[0].to_string(),
            "ConfigMap time-slicing-config, key \"any\": sharing.timeSlicing.resources[0].replicas is 0; it must be at least 2 (1 means no sharing: remove the resource instead)"
        );
        assert_eq!(p[0].reason, ProblemReason::InvalidReplicas);
    }

    #[test]
    fn empty_documents_are_valid_and_share_nothing() {
        for text in ["", "# only a comment\n", "{}", "null", "version: v1\n"] {
            let s = ok(text);
            assert_eq!(s.sharing, SharingStrategy::None, "{text:?}");
        }
    }

    #[test]
    fn mps_defaults_to_failing_requests_above_one() {
        let s = ok("sharing:\n  mps:\n    resources:\n    - {name: gpu, replicas: 2}\n");
        assert_eq!(s.sharing, SharingStrategy::Mps);
        assert!(s.fail_requests_greater_than_one);
        let s = ok(
            "sharing:\n  mps:\n    failRequestsGreaterThanOne: false\n    resources:\n    - {name: gpu, replicas: 2}\n",
        );
        assert!(!s.fail_requests_greater_than_one);
    }

    #[test]
    fn policy_mig_strategy_beats_the_file() {
        let mps = "flags: {migStrategy: mixed}\nsharing: {mps: {resources: [{name: gpu, replicas: 2}]}}\n";
        assert!(problems(mps, None)[0].contains("MIG strategy mixed (from flags.migStrategy)"));
        let s = validate_key("cm", "k", mps, Some("none")).unwrap();
        assert_eq!(s.mig_strategy, "none");
        assert!(s.warnings[0].contains("spec.mig.strategy (none) wins"));
        let p = problems(
            "sharing: {mps: {resources: [{name: gpu, replicas: 2}]}}\n",
            Some("mixed"),
        );
        assert!(
            p[0].contains("from the ClusterPolicy's spec.mig.strategy"),
            "{p:?}"
        );
    }

    #[test]
    fn an_invalid_file_strategy_is_harmless_when_the_policy_sets_one() {
        let text = "flags: {migStrategy: Mixed}\n";
        assert!(problems(text, None)[0].contains("flags.migStrategy is \"Mixed\""));
        assert_eq!(
            validate_key("cm", "k", text, Some("single"))
                .unwrap()
                .mig_strategy,
            "single"
        );
    }

    #[test]
    fn file_fields_the_operator_environment_replaces_only_warn() {
        let s = ok(
            "flags:\n  mpsRoot: /tmp\n  plugin:\n    deviceIDStrategy: serial\n    deviceListStrategy: \"envvar,cdi-cri\"\n",
        );
        assert_eq!(s.warnings.len(), 3, "{:?}", s.warnings);
        assert!(
            s.warnings
                .iter()
                .any(|w| w.contains("DEVICE_ID_STRATEGY=uuid"))
        );
    }

    #[test]
    fn device_references_follow_the_plugin() {
        for good in [
            "0",
            "12",
            "0:3",
            "GPU-b1028956-cfa2-0990-bf4a-5da9abb51763",
            "MIG-b1028956-cfa2-0990-bf4a-5da9abb51763",
            "MIG-GPU-b1028956-cfa2-0990-bf4a-5da9abb51763/3/0",
            "GPU-b1028956cfa20990bf4a5da9abb51763",
        ] {
            assert!(is_device_ref(good), "{good}");
        }
        for bad in [
            "gpu0",
            "-1",
            "0:",
            "GPU-xyz",
            "MIG-GPU-b1028956-cfa2-0990-bf4a-5da9abb51763/3",
            "",
        ] {
            assert!(!is_device_ref(bad), "{bad}");
        }
    }

    #[test]
    fn go_durations() {
        for good in ["60s", "1h30m", "-5m", "1.5h", "0", "300ms", "2µs"] {
            assert!(is_go_duration(good), "{good}");
        }
        for bad in ["", "60", "sixty seconds", "1d", "5 m", "."] {
            assert!(!is_go_duration(bad), "{bad}");
        }
    }

    #[test]
    fn resource_names() {
        assert!(is_dns_subdomain("mig-1g.10gb"));
        assert!(!is_dns_subdomain("GPU"));
        assert!(!is_dns_subdomain("example.com/gpu"));
        assert!(!is_dns_subdomain("-gpu"));
        assert!(!is_dns_subdomain("gpu..x"));
    }
}
