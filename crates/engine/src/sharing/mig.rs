//! Validate stage (pure, no IO): mig-parted configs (`version: v1`, `mig-configs`), parsed as
//! mig-parted v0.15.0 parses them and checked per node against the GPU model (decision 7).
//!
//! [`parse_config`] rejects exactly what mig-parted's decoders reject (docs/config-facts.md §4.1-4.2):
//! exact keys, unknown keys fatal, no number-to-string coercion, the profile-name grammar.
//! mig-parted checks nothing against hardware before it applies a layout, and a profile name no
//! GPU of the node offers makes it clear the GPU and report success (§4.3). [`check_node`] is
//! the operator's own report on that: unknown layouts, profiles a model does not have, counts
//! that do not fit the placement rules (§4.5), device indexes past `nvidia.com/gpu.count`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::mig_profiles::{self, GpuModel, MODELS, MigProfile, NVIDIA_PCI_VENDOR, Placement};
use super::problems::{Problems, ToolKey, unknown_field_hint};
use super::yaml::{Node, dedup_entries};
use super::{ConfigProblem, ProblemReason, list_words};
use crate::nodes::MIG_CONFIG;

/// The ConfigMap key mig-manager reads (`CONFIG_FILE=/mig-parted-config/config.yaml`).
pub const MIG_CONFIG_KEY: &str = "config.yaml";

const TOOL_KEY: ToolKey = ToolKey {
    key: MIG_CONFIG_KEY,
    reader: "mig-manager",
    what: "the mig-parted config",
};

/// Layouts named in one message before the rest are counted.
const LAYOUTS_IN_MESSAGE: usize = 12;

/// The highest GPU index a config may name, and the most GPUs a node is judged for. No node
/// holds more than a few dozen GPUs; the bound keeps a hostile or mistyped config
/// (`devices: [0, 4294967295]`, `nvidia.com/gpu.count=4000000000`) from making the per-GPU
/// check loop for minutes. mig-parted accepts any integer, but an index this high matches no
/// GPU anywhere, so rejecting it loses nothing.
pub const MAX_GPU_INDEX: i64 = 255;

const TOP_FIELDS: &[&str] = &["version", "mig-configs"];
const ENTRY_FIELDS: &[&str] = &["device-filter", "devices", "mig-enabled", "mig-devices"];

/// A parsed mig-parted config: layout name -> entries, in file order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MigConfigFile {
    pub configs: BTreeMap<String, Vec<MigEntry>>,
}

/// One entry of a layout: which GPUs it configures and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigEntry {
    /// `device-filter` values (`0x<device><vendor>[:0x<subdevice><subvendor>]`); empty = all.
    pub device_filter: Vec<String>,
    pub devices: MigDevices,
    pub mig_enabled: bool,
    /// Profile name -> instance count; `None` when the entry has no `mig-devices`.
    pub mig_devices: Option<BTreeMap<String, u32>>,
}

/// The GPUs an entry names, by index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MigDevices {
    All,
    /// Indexes as written; mig-parted accepts negative and duplicate ones (they match nothing
    /// or the same GPU).
    Indexes(Vec<i64>),
}

impl MigDevices {
    fn contains(&self, gpu: u32) -> bool {
        match self {
            MigDevices::All => true,
            MigDevices::Indexes(indexes) => indexes.contains(&i64::from(gpu)),
        }
    }
}

/// A MIG profile name split into its parts (go-nvlib's grammar).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProfileName {
    pub compute_slices: u32,
    pub gpu_slices: u32,
    pub memory_gb: u32,
    /// `+` or `-` with its attributes (`me`, `me.all`, `gfx`), as written.
    pub attributes: Option<(char, Vec<String>)>,
}

impl ProfileName {
    /// The name NVML reports for the profile: `Nc.` dropped when it equals the `g` number.
    pub fn canonical(&self) -> String {
        let mut out = if self.compute_slices == self.gpu_slices {
            format!("{}g.{}gb", self.gpu_slices, self.memory_gb)
        } else {
            format!(
                "{}c.{}g.{}gb",
                self.compute_slices, self.gpu_slices, self.memory_gb
            )
        };
        if let Some((sign, attributes)) = &self.attributes {
            out.push(*sign);
            out.push_str(&attributes.join(","));
        }
        out
    }
}

/// Parses a profile name as mig-parted does; the error says what is wrong.
pub fn parse_profile_name(name: &str) -> Result<ProfileName, String> {
    let (base, attributes) = match name.find(['+', '-']) {
        Some(i) => {
            let sign = name[i..].chars().next().unwrap_or('+');
            let rest = &name[i + 1..];
            if rest.contains(['+', '-']) {
                return Err("it may have one '+' or '-' attribute part, not several".into());
            }
            let attributes: Vec<String> = rest.split(',').map(str::to_string).collect();
            for (i, a) in attributes.iter().enumerate() {
                let starts_with_letter = a.chars().next().is_some_and(|c| c.is_ascii_alphabetic());
                if !starts_with_letter
                    || a.ends_with('.')
                    || !a.chars().all(|c| c.is_ascii_alphanumeric() || c == '.')
                {
                    return Err(format!(
                        "attribute {a:?} must start with a letter and hold only letters, digits and '.'"
                    ));
                }
                if attributes[..i].contains(a) {
                    return Err(format!("attribute {a:?} appears twice"));
                }
            }
            (&name[..i], Some((sign, attributes)))
        }
        None => (name, None),
    };
    let bad_base = || format!("{base:?} is not of the form <N>g.<N>gb or <N>c.<N>g.<N>gb");
    let body = base.strip_suffix("gb").ok_or_else(bad_base)?;
    let number = |s: &str, suffix: &str| -> Option<u32> {
        let digits = s.strip_suffix(suffix)?;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        digits.parse().ok()
    };
    let parts: Vec<&str> = body.split('.').collect();
    let (compute, gpu, memory) = match parts.as_slice() {
        [g, m] => {
            let g = number(g, "g").ok_or_else(bad_base)?;
            (g, g, number(m, "").ok_or_else(bad_base)?)
        }
        [c, g, m] => (
            number(c, "c").ok_or_else(bad_base)?,
            number(g, "g").ok_or_else(bad_base)?,
            number(m, "").ok_or_else(bad_base)?,
        ),
        _ => return Err(bad_base()),
    };
    Ok(ProfileName {
        compute_slices: compute,
        gpu_slices: gpu,
        memory_gb: memory,
        attributes,
    })
}

/// Reads the mig-parted config from the ConfigMap named by `migManager.config.name`.
pub fn parse_config(
    config_map: &str,
    data: &BTreeMap<String, String>,
) -> Result<MigConfigFile, Vec<ConfigProblem>> {
    TOOL_KEY.parse(config_map, data, parse_yaml)
}

/// Parses one mig-parted config document.
pub fn parse_yaml(
    config_map: &str,
    key: &str,
    text: &str,
) -> Result<MigConfigFile, Vec<ConfigProblem>> {
    Problems::collect(config_map, key, |problems| Parser { problems }.file(text))
}

struct Parser<'p, 'a> {
    problems: &'p mut Problems<'a>,
}

impl Parser<'_, '_> {
    fn unexpected(&mut self, path: &str, key: &str, fields: &[&str]) {
        let hint = unknown_field_hint(key, fields, "it knows only");
        let field = if path.is_empty() {
            key.to_string()
        } else {
            format!("{path}.{key}")
        };
        self.problems.push(
            &field,
            ProblemReason::UnexpectedField,
            format!("is not a field mig-parted knows, and it refuses the whole file ({hint})"),
        );
    }

    fn file(&mut self, text: &str) -> MigConfigFile {
        let mut file = MigConfigFile::default();
        let Some(root) = self
            .problems
            .document(text, ", mig-parted cannot read it")
            .map(|document| document.node)
        else {
            return file;
        };
        let entries = match &root {
            // An empty document (or `null`, or only comments) becomes JSON null, which
            // mig-parted's decoder (sigs.k8s.io/yaml) drops before its own checks run: the file
            // parses with no layouts, and every nvidia.com/mig.config value then fails as a
            // layout that does not exist (check_node says so).
            Node::Null => return file,
            Node::Map(entries) => entries,
            other => {
                self.problems.push(
                    "",
                    ProblemReason::WrongType,
                    format!(
                        "is {} at the top level; a mig-parted config is a mapping with version: v1 and mig-configs",
                        other.describe()
                    ),
                );
                return file;
            }
        };
        let (entries, _) = dedup_entries(entries);
        for (key, _) in &entries {
            if !TOP_FIELDS.contains(key) {
                self.unexpected("", key, TOP_FIELDS);
            }
        }
        match entries
            .iter()
            .find(|(k, _)| *k == "version")
            .map(|(_, v)| *v)
        {
            None if !entries.is_empty() => self.problems.push(
                "version",
                ProblemReason::MissingField,
                "is missing; add `version: v1`",
            ),
            // `{}`: mig-parted reads the empty version and refuses it ("unknown version").
            None => self.problems.push(
                "version",
                ProblemReason::MissingField,
                "is missing from an empty mapping, which mig-parted refuses (unknown version); \
                 write `version: v1` and the layouts under mig-configs",
            ),
            Some(Node::Str(v)) if v == "v1" => {}
            Some(Node::Str(v)) => self.problems.push(
                "version",
                ProblemReason::UnknownVersion,
                format!("is {v:?}; the only version mig-parted knows is v1"),
            ),
            Some(other) => self.problems.push(
                "version",
                ProblemReason::WrongType,
                format!(
                    "is {}; it must be the string v1 (write `version: v1`)",
                    other.describe()
                ),
            ),
        }
        let Some(configs) = entries
            .iter()
            .find(|(k, _)| *k == "mig-configs")
            .map(|(_, v)| *v)
        else {
            return file;
        };
        let configs = match configs {
            Node::Map(configs) if !configs.is_empty() => configs,
            Node::Map(_) | Node::Null => {
                self.problems.push(
                    "mig-configs",
                    ProblemReason::MissingField,
                    "is empty; mig-parted needs at least one layout",
                );
                return file;
            }
            other => {
                self.problems.push(
                    "mig-configs",
                    ProblemReason::WrongType,
                    format!(
                        "is {}; it must map layout names to lists of entries",
                        other.describe()
                    ),
                );
                return file;
            }
        };
        let (configs, _) = dedup_entries(configs);
        for (name, value) in configs {
            let path = format!("mig-configs.{name}");
            let items = match value {
                Node::Seq(items) if !items.is_empty() => items,
                Node::Seq(_) | Node::Null => {
                    self.problems.push(
                        &path,
                        ProblemReason::MissingField,
                        "has no entries; mig-parted needs at least one (for example `- devices: all` with `mig-enabled: false`)",
                    );
                    continue;
                }
                other => {
                    self.problems.push(
                        &path,
                        ProblemReason::WrongType,
                        format!("is {}; it must be a list of entries", other.describe()),
                    );
                    continue;
                }
            };
            let parsed: Vec<Option<MigEntry>> = items
                .iter()
                .enumerate()
                .map(|(i, item)| self.entry(&format!("{path}[{i}]"), item))
                .collect();
            if let Some(parsed) = parsed.into_iter().collect::<Option<Vec<_>>>() {
                file.configs.insert(name.to_string(), parsed);
            }
        }
        file
    }

    fn entry(&mut self, path: &str, node: &Node) -> Option<MigEntry> {
        let Node::Map(entries) = node else {
            self.problems.push(
                path,
                ProblemReason::WrongType,
                format!(
                    "is {}; an entry is a mapping with devices and mig-enabled",
                    node.describe()
                ),
            );
            return None;
        };
        let problems_before = self.problems.len();
        let (entries, _) = dedup_entries(entries);
        for (key, _) in &entries {
            if !ENTRY_FIELDS.contains(key) {
                self.unexpected(path, key, ENTRY_FIELDS);
            }
        }
        let get = |name: &str| entries.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);

        let devices = match get("devices") {
            None => {
                self.problems.push(
                    path,
                    ProblemReason::MissingField,
                    "has no devices; add `devices: all` or a list of GPU indexes",
                );
                None
            }
            Some(node) => self.devices(&format!("{path}.devices"), node),
        };
        let mig_enabled = match get("mig-enabled") {
            None => {
                self.problems.push(
                    path,
                    ProblemReason::MissingField,
                    "has no mig-enabled; add `mig-enabled: true` or `mig-enabled: false`",
                );
                None
            }
            Some(Node::Bool(b)) => Some(*b),
            Some(Node::Null) => Some(false),
            Some(other) => {
                let hint = if matches!(other, Node::Str(s) if s == "true" || s == "false") {
                    " (remove the quotes)"
                } else {
                    ""
                };
                self.problems.push(
                    &format!("{path}.mig-enabled"),
                    ProblemReason::WrongType,
                    format!("is {}; it must be true or false{hint}", other.describe()),
                );
                None
            }
        };
        let device_filter = match get("device-filter") {
            None | Some(Node::Null) => Vec::new(),
            Some(node) => self.device_filter(&format!("{path}.device-filter"), node),
        };
        let mig_devices = match get("mig-devices") {
            None | Some(Node::Null) => None,
            Some(node) => self.mig_devices(&format!("{path}.mig-devices"), node),
        };
        if let Some(enabled) = mig_enabled {
            let listed = mig_devices.as_ref().is_some_and(|d| !d.is_empty());
            if enabled && mig_devices.is_none() && !matches!(get("mig-devices"), Some(Node::Map(_)))
            {
                self.problems.push(
                    path,
                    ProblemReason::MissingField,
                    "has mig-enabled: true but no mig-devices; list the instances, or write `mig-devices: {}` for MIG mode without instances",
                );
            } else if !enabled && listed {
                self.problems.push(
                    &format!("{path}.mig-devices"),
                    ProblemReason::InvalidValue,
                    "lists MIG devices although mig-enabled is false; remove them or set mig-enabled: true",
                );
            }
        }
        if self.problems.len() > problems_before {
            return None;
        }
        Some(MigEntry {
            device_filter,
            devices: devices?,
            mig_enabled: mig_enabled?,
            mig_devices,
        })
    }

    fn devices(&mut self, field: &str, node: &Node) -> Option<MigDevices> {
        match node {
            Node::Str(s) if s == "all" => Some(MigDevices::All),
            Node::Seq(items) => {
                let mut indexes = Vec::new();
                for (i, item) in items.iter().enumerate() {
                    match item {
                        Node::Null => indexes.push(0),
                        _ => match item.as_integer().and_then(|n| i64::try_from(n).ok()) {
                            Some(n) if n > MAX_GPU_INDEX => {
                                self.problems.push(
                                    &format!("{field}[{i}]"),
                                    ProblemReason::InvalidValue,
                                    format!(
                                        "is {n}, past the highest GPU index the operator accepts ({MAX_GPU_INDEX}); list the indexes of the node's GPUs (0 to gpu.count - 1) or write `devices: all`"
                                    ),
                                );
                                return None;
                            }
                            Some(n) => indexes.push(n),
                            None => {
                                self.problems.push(
                                    &format!("{field}[{i}]"),
                                    ProblemReason::WrongType,
                                    format!(
                                        "is {}; GPU indexes are plain numbers (no quotes)",
                                        item.describe()
                                    ),
                                );
                                return None;
                            }
                        },
                    }
                }
                Some(MigDevices::Indexes(indexes))
            }
            other => {
                self.problems.push(
                    field,
                    ProblemReason::WrongType,
                    format!(
                        "is {}; it must be all (lowercase) or a list of GPU indexes such as [0, 1]",
                        other.describe()
                    ),
                );
                None
            }
        }
    }

    fn device_filter(&mut self, field: &str, node: &Node) -> Vec<String> {
        let one = |this: &mut Self, field: &str, node: &Node| -> Option<String> {
            match node {
                Node::Str(s) => Some(s.clone()),
                Node::Null => Some(String::new()),
                Node::Int(n) => {
                    this.problems.push(
                        field,
                        ProblemReason::WrongType,
                        format!(
                            "is the number {n} (YAML reads an unquoted 0x... as a number); quote it, such as \"0x20B010DE\""
                        ),
                    );
                    None
                }
                other => {
                    this.problems.push(
                        field,
                        ProblemReason::WrongType,
                        format!(
                            "is {}; it must be a quoted PCI id such as \"0x20B010DE\"",
                            other.describe()
                        ),
                    );
                    None
                }
            }
        };
        match node {
            Node::Seq(items) => items
                .iter()
                .enumerate()
                .filter_map(|(i, item)| one(self, &format!("{field}[{i}]"), item))
                .collect(),
            other => one(self, field, other).into_iter().collect(),
        }
    }

    fn mig_devices(&mut self, field: &str, node: &Node) -> Option<BTreeMap<String, u32>> {
        let Node::Map(entries) = node else {
            self.problems.push(
                field,
                ProblemReason::WrongType,
                format!(
                    "is {}; it must map profile names to counts, such as {{\"1g.10gb\": 7}}",
                    node.describe()
                ),
            );
            return None;
        };
        let (entries, _) = dedup_entries(entries);
        let mut out = BTreeMap::new();
        let mut valid = true;
        for (name, count) in &entries {
            let item = format!("{field}.{name}");
            if let Err(why) = parse_profile_name(name) {
                self.problems.push(
                    &item,
                    ProblemReason::InvalidMigProfile,
                    format!(
                        "is not a MIG profile name: {why}; names look like 1g.10gb, 1g.10gb+me or 1c.2g.20gb"
                    ),
                );
                valid = false;
                continue;
            }
            let count = match count {
                Node::Null => Some(0),
                other => other.as_integer(),
            };
            match count.map(u32::try_from) {
                Some(Ok(n)) => {
                    out.insert((*name).to_string(), n);
                }
                Some(Err(_)) => {
                    self.problems.push(
                        &item,
                        ProblemReason::InvalidValue,
                        format!(
                            "is {}; a count must be 0 or more",
                            count.unwrap_or_default()
                        ),
                    );
                    valid = false;
                }
                None => {
                    self.problems.push(
                        &item,
                        ProblemReason::WrongType,
                        format!(
                            "is {}; a count is a plain number (no quotes)",
                            entries
                                .iter()
                                .find(|(k, _)| k == name)
                                .map_or_else(String::new, |(_, v)| v.describe())
                        ),
                    );
                    valid = false;
                }
            }
        }
        if valid && !out.is_empty() && out.values().all(|n| *n == 0) {
            self.problems.push(
                field,
                ProblemReason::InvalidValue,
                "gives every profile a count of 0; give at least one a count, or write `mig-devices: {}`",
            );
            valid = false;
        }
        valid.then_some(out)
    }
}

/// Checks that `layout` (a node's `nvidia.com/mig.config`) exists in `config` and fits the
/// node's GPUs, identified from `nvidia.com/gpu.product` (any `-MIG-...` / `-SHARED` suffix
/// stripped) and, when given, `nvidia.com/gpu.count`. The error is one line for status.
pub fn check_node(
    config: &MigConfigFile,
    layout: &str,
    gpu_product_label: &str,
    gpu_count_label: Option<&str>,
) -> Result<(), String> {
    let Some(entries) = config.configs.get(layout) else {
        let names: Vec<&str> = config.configs.keys().map(String::as_str).collect();
        let listed = if names.is_empty() {
            "it defines none".to_string()
        } else if names.len() > LAYOUTS_IN_MESSAGE {
            format!(
                "it defines {} and {} more",
                names[..LAYOUTS_IN_MESSAGE].join(", "),
                names.len() - LAYOUTS_IN_MESSAGE
            )
        } else {
            format!("it defines {}", list_words(&names))
        };
        return Err(format!(
            "MIG layout {layout:?} is not in the MIG config ({listed}); fix the {MIG_CONFIG} label or add the layout"
        ));
    };
    let (board, mig_suffix) = mig_profiles::board_product(gpu_product_label);
    let model = mig_profiles::identify_model(gpu_product_label);
    // Under the `single` strategy gpu.count counts MIG devices, not boards.
    let count: Option<u32> = if mig_suffix {
        None
    } else {
        gpu_count_label.and_then(|c| c.trim().parse().ok())
    };
    if let Some(count) = count
        && i64::from(count) > MAX_GPU_INDEX + 1
    {
        return Err(format!(
            "the node's nvidia.com/gpu.count={count} is more GPUs than the operator judges a layout for ({}); fix the label",
            MAX_GPU_INDEX + 1
        ));
    }

    let applies: Vec<bool> = entries.iter().map(|e| filter_matches(e, model)).collect();
    let mut errors = Vec::new();

    for (i, entry) in entries.iter().enumerate() {
        let MigDevices::Indexes(indexes) = &entry.devices else {
            continue;
        };
        if !applies[i] {
            continue;
        }
        for index in indexes {
            if *index < 0 {
                errors.push(format!(
                    "entry {i} lists device index {index}, which matches no GPU"
                ));
            } else if let Some(count) = count
                && *index >= i64::from(count)
            {
                errors.push(format!(
                    "entry {i} lists device index {index}, but the node has {count} GPU{} (nvidia.com/gpu.count={count})",
                    if count == 1 { "" } else { "s" }
                ));
            }
        }
    }

    // Each GPU is configured by the last entry that matches it.
    let gpus = count.unwrap_or_else(|| {
        entries
            .iter()
            .zip(&applies)
            .filter(|(_, applies)| **applies)
            .filter_map(|(e, _)| match &e.devices {
                MigDevices::Indexes(ix) => ix.iter().copied().max(),
                MigDevices::All => None,
            })
            .filter_map(|max| u32::try_from(max).ok())
            .map(|max| max.saturating_add(1))
            .max()
            .unwrap_or(1)
    });
    let mut gpus_by_entry: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
    for gpu in 0..gpus {
        let last = (0..entries.len())
            .rev()
            .find(|&i| applies[i] && entries[i].devices.contains(gpu));
        if let Some(i) = last {
            gpus_by_entry.entry(i).or_default().push(gpu);
        }
    }

    for (i, gpu_list) in gpus_by_entry {
        let entry = &entries[i];
        if !entry.mig_enabled {
            continue;
        }
        let which = if entry.devices == MigDevices::All && count.is_none() {
            "every GPU".to_string()
        } else {
            describe_gpus(&gpu_list)
        };
        let Some(model) = model else {
            errors.push(format!(
                "{which}: MIG is enabled, but {board} has no MIG profiles the operator knows (it is not MIG-capable, or a model missing from the operator's table)"
            ));
            continue;
        };
        if let Err(why) = check_instances(model, entry.mig_devices.as_ref()) {
            errors.push(format!("{which}: {why}"));
        }
    }

    if errors.is_empty() {
        Ok(())
    } else {
        let model_name = model.map_or(String::new(), |m| format!(" (model {})", m.name));
        Err(format!(
            "MIG layout {layout:?} does not fit {gpu_product_label}{model_name}: {}",
            errors.join("; ")
        ))
    }
}

/// Whether some entry of `layout` in `config` selects the GPUs of `gpu_product_label` by its
/// `device-filter` (no filter selects every GPU). mig-parted leaves GPUs no entry selects as
/// they are, which `check_node` accepts: a node chose the layout and it does nothing there.
pub fn layout_selects(config: &MigConfigFile, layout: &str, gpu_product_label: &str) -> bool {
    let model = mig_profiles::identify_model(gpu_product_label);
    config
        .configs
        .get(layout)
        .is_some_and(|entries| entries.iter().any(|e| filter_matches(e, model)))
}

/// Whether an entry's `device-filter` selects this model (no filter selects every GPU). A
/// filter with a subsystem part is judged by its device part alone; one that does not parse
/// matches nothing, as in mig-parted.
fn filter_matches(entry: &MigEntry, model: Option<&GpuModel>) -> bool {
    if entry.device_filter.is_empty() {
        return true;
    }
    let Some(model) = model else {
        return false;
    };
    entry.device_filter.iter().any(|filter| {
        let device_part = filter.split(':').next().unwrap_or_default();
        parse_go_uint32(device_part).is_some_and(|value| {
            let device = (value >> 16) as u16;
            let vendor = (value & 0xFFFF) as u16;
            vendor == NVIDIA_PCI_VENDOR && model.pci_device_ids.contains(&device)
        })
    })
}

/// Go's `strconv.ParseUint(s, 0, 32)`: `0x`, `0o`, `0b` or leading-`0` octal prefixes.
fn parse_go_uint32(s: &str) -> Option<u32> {
    let lower = s.to_ascii_lowercase();
    let (radix, digits) = if let Some(d) = lower.strip_prefix("0x") {
        (16, d)
    } else if let Some(d) = lower.strip_prefix("0o") {
        (8, d)
    } else if let Some(d) = lower.strip_prefix("0b") {
        (2, d)
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, &lower[1..])
    } else {
        (10, lower.as_str())
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix) || c == '_') {
        return None;
    }
    u32::from_str_radix(&digits.replace('_', ""), radix).ok()
}

/// Checks one GPU's instances against the model: names, counts, slices and placement.
fn check_instances(
    model: &GpuModel,
    mig_devices: Option<&BTreeMap<String, u32>>,
) -> Result<(), String> {
    let mut wanted: Vec<(&'static MigProfile, u32, &str)> = Vec::new();
    let mut problems = Vec::new();
    for (name, count) in mig_devices.into_iter().flatten() {
        if *count == 0 {
            continue;
        }
        let parsed = match parse_profile_name(name) {
            Ok(parsed) => parsed,
            Err(why) => {
                problems.push(format!("{name} is not a profile name ({why})"));
                continue;
            }
        };
        if parsed.compute_slices != parsed.gpu_slices {
            problems.push(format!(
                "{name} is a compute-instance profile, which the operator cannot check"
            ));
            continue;
        }
        match model.profile(&parsed.canonical()) {
            None => problems.push(format!(
                "{name} does not exist on {} (it offers {})",
                model.name,
                model
                    .profiles
                    .iter()
                    .map(|p| p.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            Some(profile) if *count > u32::from(profile.max) => problems.push(format!(
                "{count} × {name} is more than the {} that fit on one {} GPU",
                profile.max, model.name
            )),
            Some(profile) => wanted.push((profile, *count, name)),
        }
    }
    if !problems.is_empty() {
        return Err(problems.join(", "));
    }
    let described = wanted
        .iter()
        .map(|(_, count, name)| format!("{count} × {name}"))
        .collect::<Vec<_>>()
        .join(" + ");
    let slices: u32 = wanted
        .iter()
        .map(|(p, count, _)| u32::from(p.slices) * count)
        .sum();
    if slices > u32::from(model.compute_slices) {
        return Err(format!(
            "{described} needs {slices} compute slices, but a {} GPU has {}",
            model.name, model.compute_slices
        ));
    }
    let mut placements: Vec<Placement> = wanted
        .iter()
        .flat_map(|(p, count, _)| std::iter::repeat_n(p.placement, *count as usize))
        .collect();
    placements.sort_by_key(|p| std::cmp::Reverse(p.size));
    if !place(&placements, 0, model.memory_slices) {
        return Err(format!(
            "{described} cannot be placed side by side in the {} memory slices of a {} GPU",
            model.memory_slices, model.name
        ));
    }
    Ok(())
}

/// Backtracking search for non-overlapping starts; `occupied` is a bit per memory slice.
fn place(instances: &[Placement], occupied: u16, memory_slices: u8) -> bool {
    let Some((first, rest)) = instances.split_first() else {
        return true;
    };
    first
        .placement_masks(memory_slices)
        .any(|mask| occupied & mask == 0 && place(rest, occupied | mask, memory_slices))
}

impl Placement {
    fn placement_masks(self, memory_slices: u8) -> impl Iterator<Item = u16> {
        let size = self.size;
        self.starts
            .iter()
            .filter(move |start| **start + size <= memory_slices)
            .map(move |start| ((1u16 << size) - 1) << start)
    }
}

/// `GPU 3`, `GPUs 4-7`, `GPUs 0, 2 and 5-6`.
fn describe_gpus(gpus: &[u32]) -> String {
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for &gpu in gpus {
        match ranges.last_mut() {
            Some((_, end)) if *end + 1 == gpu => *end = gpu,
            _ => ranges.push((gpu, gpu)),
        }
    }
    let parts: Vec<String> = ranges
        .iter()
        .map(|(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect();
    if gpus.len() == 1 {
        format!("GPU {}", parts[0])
    } else {
        format!("GPUs {}", list_words(&parts))
    }
}

/// At most this many nodes are named per reason; the rest are counted.
const NODES_IN_MESSAGE: usize = 5;
/// At most this many distinct reasons are shown; the rest are counted.
const REASONS_IN_MESSAGE: usize = 8;

/// What status says about the nodes' MIG layouts: the GPU nodes whose `nvidia.com/mig.config`
/// names a layout that is missing from `config` or does not fit their GPUs, and the nodes whose
/// `nvidia.com/mig.config.state` is `failed` (mig-manager gave up on them), grouped by reason
/// (`node a: why` or `nodes a, b and 3 more: why`), so a thousand nodes with the same problem
/// make one line. `None` when every node is fine.
pub fn node_report(config: &MigConfigFile, nodes: &[&crate::nodes::NodeView]) -> Option<String> {
    use crate::nodes::{GPU_COUNT, GPU_PRODUCT, MIG_CONFIG_STATE};
    let mut by_reason: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    // A fleet has a handful of (layout, GPU, count) combinations over thousands of nodes: each
    // is checked once per pass.
    let mut checks: BTreeMap<(&str, &str, Option<&str>), Result<(), String>> = BTreeMap::new();
    for node in nodes {
        let layout = node.label(MIG_CONFIG);
        let checked = layout.map(|layout| {
            let product = node.label(GPU_PRODUCT).unwrap_or_default();
            let count = node.label(GPU_COUNT);
            checks
                .entry((layout, product, count))
                .or_insert_with(|| check_node(config, layout, product, count))
                .clone()
        });
        let reason = match checked {
            Some(Err(why))
                if layout == Some("all-disabled")
                    && !config.configs.contains_key("all-disabled") =>
            {
                format!(
                    "{why} (all-disabled is what the operator gives MIG-capable nodes without a layout: add it to the config, or set spec.migManager.config.default to \"\")"
                )
            }
            Some(Err(why)) => why,
            _ if node.label(MIG_CONFIG_STATE) == Some("failed") => format!(
                "mig-manager failed to apply layout {:?} ({MIG_CONFIG_STATE}=failed); see the nvidia-mig-manager pod log on the node",
                layout.unwrap_or_default()
            ),
            _ => continue,
        };
        by_reason.entry(reason).or_default().push(&node.name);
    }
    if by_reason.is_empty() {
        return None;
    }
    let reasons = by_reason.len();
    let mut lines: Vec<String> = by_reason
        .into_iter()
        .take(REASONS_IN_MESSAGE)
        .map(|(reason, mut names)| {
            names.sort_unstable();
            let mut listed: Vec<String> = names
                .iter()
                .take(NODES_IN_MESSAGE)
                .map(|n| (*n).to_string())
                .collect();
            if names.len() > NODES_IN_MESSAGE {
                listed.push(format!("{} more", names.len() - NODES_IN_MESSAGE));
            }
            let noun = if names.len() == 1 { "node" } else { "nodes" };
            format!("{noun} {}: {reason}", list_words(&listed))
        })
        .collect();
    if reasons > REASONS_IN_MESSAGE {
        lines.push(format!("{} more problems", reasons - REASONS_IN_MESSAGE));
    }
    Some(lines.join("; "))
}

/// A mig-parted config with `all-disabled`, `all-enabled`, `all-balanced` and one
/// `all-<profile>` per profile name (`+` written as `.`), each entry limited to the models that
/// offer it by `device-filter`. Generated from [`MODELS`], in the shape of gpu-operator's
/// default config.
pub fn default_config() -> String {
    let mut layouts: Vec<(String, Vec<GeneratedEntry>)> = Vec::new();

    let balanced = MODELS
        .iter()
        .map(|m| {
            let devices = m
                .balanced
                .iter()
                .map(|(name, count)| ((*name).to_string(), u32::from(*count)))
                .collect();
            (m, devices)
        })
        .collect();
    layouts.push(("all-balanced".to_string(), group_by_devices(balanced)));

    let mut names: Vec<&str> = MODELS
        .iter()
        .flat_map(|m| m.profiles.iter().map(|p| p.name))
        .collect();
    names.sort_unstable();
    names.dedup();
    for name in names {
        let per_model = MODELS
            .iter()
            .filter_map(|m| {
                let profile = m.profile(name)?;
                Some((
                    m,
                    BTreeMap::from([(name.to_string(), u32::from(profile.max))]),
                ))
            })
            .collect();
        layouts.push((
            format!("all-{}", name.replace('+', ".")),
            group_by_devices(per_model),
        ));
    }

    let mut out = String::from("version: v1\nmig-configs:\n");
    out.push_str("  all-disabled:\n    - devices: all\n      mig-enabled: false\n\n");
    out.push_str(
        "  all-enabled:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {}\n",
    );
    for (layout, entries) in layouts {
        let _ = write!(out, "\n  {layout}:\n");
        for (filters, devices) in entries {
            let quoted: Vec<String> = filters.iter().map(|f| format!("{f:?}")).collect();
            let _ = writeln!(out, "    - device-filter: [{}]", quoted.join(", "));
            out.push_str("      devices: all\n      mig-enabled: true\n      mig-devices:\n");
            for (name, count) in devices {
                let _ = writeln!(out, "        {name:?}: {count}");
            }
        }
    }
    out
}

/// One generated entry: its `device-filter` values and its `mig-devices`.
type GeneratedEntry = (Vec<String>, BTreeMap<String, u32>);

/// Merges models that get the same `mig-devices` into one entry with all their filters.
fn group_by_devices(per_model: Vec<(&GpuModel, BTreeMap<String, u32>)>) -> Vec<GeneratedEntry> {
    let mut groups: Vec<GeneratedEntry> = Vec::new();
    for (model, devices) in per_model {
        match groups.iter_mut().find(|(_, d)| *d == devices) {
            Some((filters, _)) => filters.extend(model.device_filters()),
            None => groups.push((model.device_filters(), devices)),
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mig_node(name: &str, labels: &[(&str, &str)]) -> crate::nodes::NodeView {
        let labels = labels
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect();
        crate::nodes::NodeView::from_labels(name, None, &labels)
    }

    #[test]
    fn node_report_names_unfitting_unknown_and_failed_layouts_and_passes_fitting_ones() {
        let config = parse_yaml("mig-config", "config.yaml", SCENARIO_4).unwrap();
        let a100_40 = mig_node(
            "a100-40",
            &[
                ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-40GB"),
                ("nvidia.com/gpu.count", "8"),
                ("nvidia.com/mig.config", "inference-7"),
            ],
        );
        assert_eq!(node_report(&config, &[&a100_40]), None);

        let h100 = mig_node(
            "h100",
            &[
                ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
                ("nvidia.com/gpu.count", "8"),
                ("nvidia.com/mig.config", "inference-7"),
            ],
        );
        let training = mig_node(
            "a100-training",
            &[
                ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-40GB"),
                ("nvidia.com/gpu.count", "8"),
                ("nvidia.com/mig.config", "training-4"),
            ],
        );
        let unknown = mig_node(
            "typo",
            &[
                ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-40GB"),
                ("nvidia.com/mig.config", "inference-8"),
            ],
        );
        let failed = mig_node(
            "stuck",
            &[
                ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-40GB"),
                ("nvidia.com/mig.config", "inference-7"),
                ("nvidia.com/mig.config.state", "failed"),
            ],
        );
        let report =
            node_report(&config, &[&a100_40, &h100, &training, &unknown, &failed]).unwrap();
        assert!(!report.contains("a100-40:"), "{report}");
        assert!(report.contains("node h100: "), "{report}");
        assert!(report.contains("1g.5gb"), "{report}");
        assert!(report.contains("node a100-training: "), "{report}");
        assert!(
            report.contains("node typo: MIG layout \"inference-8\" is not in the MIG config"),
            "{report}"
        );
        assert!(report.contains("node stuck: "), "{report}");
        assert!(
            report.contains("nvidia.com/mig.config.state=failed"),
            "{report}"
        );

        // Many nodes with one problem make one line.
        let many: Vec<crate::nodes::NodeView> = (0..40)
            .map(|i| {
                mig_node(
                    &format!("n{i:02}"),
                    &[
                        ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
                        ("nvidia.com/mig.config", "inference-7"),
                    ],
                )
            })
            .collect();
        let refs: Vec<&crate::nodes::NodeView> = many.iter().chain([&unknown]).collect();
        let report = node_report(&config, &refs).unwrap();
        assert_eq!(report.matches("does not fit").count(), 1, "{report}");
        assert!(
            report.starts_with("nodes n00, n01, n02, n03, n04 and 35 more: MIG layout"),
            "{report}"
        );
        assert!(report.contains("; node typo: "), "{report}");
    }

    /// The per-model MIG layouts ConfigMap published for mixed A100/H100 fleets, as published.
    const SCENARIO_4: &str =
        include_str!("../../../../operator/tests/fixtures/scenario-4-mig-config.yaml");

    /// The fake fleet's products (tests/e2e/src/nodes.rs) with their gpu.count.
    const FLEET: [(&str, &str); 6] = [
        ("Tesla-T4", "1"),
        ("NVIDIA-A100-SXM4-40GB", "8"),
        ("NVIDIA-A100-SXM4-80GB", "8"),
        ("NVIDIA-H100-80GB-HBM3", "8"),
        ("NVIDIA-H200", "8"),
        ("NVIDIA-A30", "4"),
    ];

    fn parse(text: &str) -> MigConfigFile {
        parse_yaml("mig-config", MIG_CONFIG_KEY, text).unwrap_or_else(|p| {
            panic!(
                "{}",
                p.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("\n")
            )
        })
    }

    #[test]
    fn scenario_4_parses_because_mig_parted_accepts_it() {
        let data = BTreeMap::from([(MIG_CONFIG_KEY.to_string(), SCENARIO_4.to_string())]);
        let file = parse_config("mig-config", &data).unwrap();
        assert_eq!(file.configs.len(), 2);
        assert_eq!(
            file.configs["training-4"][0].devices,
            MigDevices::Indexes(vec![4, 5, 6, 7])
        );
    }

    #[test]
    fn inference_7_fits_only_the_a100_40gb() {
        let file = parse(SCENARIO_4);
        for (product, count) in FLEET {
            let result = check_node(&file, "inference-7", product, Some(count));
            if product == "NVIDIA-A100-SXM4-40GB" {
                assert_eq!(result, Ok(()), "{product}");
            } else {
                assert!(result.is_err(), "{product} accepted inference-7");
            }
        }
        assert_eq!(
            check_node(&file, "inference-7", "NVIDIA-A100-SXM4-80GB", Some("8")),
            Err("MIG layout \"inference-7\" does not fit NVIDIA-A100-SXM4-80GB (model A100-80GB): GPUs 0-3: 1g.5gb does not exist on A100-80GB (it offers 1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb)".to_string())
        );
        let a30 = check_node(&file, "inference-7", "NVIDIA-A30", Some("4")).unwrap_err();
        assert!(a30.contains("1g.5gb does not exist on A30"), "{a30}");
    }

    #[test]
    fn training_4_fits_no_gpu() {
        let file = parse(SCENARIO_4);
        for (product, count) in FLEET {
            assert!(
                check_node(&file, "training-4", product, Some(count)).is_err(),
                "{product} accepted training-4"
            );
        }
        assert_eq!(
            check_node(&file, "training-4", "NVIDIA-A100-SXM4-40GB", Some("8")),
            Err("MIG layout \"training-4\" does not fit NVIDIA-A100-SXM4-40GB (model A100-40GB): GPUs 4-7: 4 × 2g.10gb is more than the 3 that fit on one A100-40GB GPU".to_string())
        );
        // An A30 node has 4 GPUs, so indexes 4-7 do not exist there either.
        let a30 = check_node(&file, "training-4", "NVIDIA-A30", Some("4")).unwrap_err();
        assert!(
            a30.contains("device index 7, but the node has 4 GPUs"),
            "{a30}"
        );
    }

    #[test]
    fn t4_cannot_take_a_mig_layout() {
        let file = parse(SCENARIO_4);
        let t4 = check_node(&file, "inference-7", "Tesla-T4", Some("1")).unwrap_err();
        assert!(
            t4.contains("device index 1, but the node has 1 GPU "),
            "{t4}"
        );
        let file = parse(&default_config());
        let t4 = check_node(&file, "all-balanced", "Tesla-T4", Some("1"));
        // all-balanced filters by PCI id, so no entry applies to a T4: nothing to do.
        assert_eq!(t4, Ok(()));
        let t4 = check_node(&file, "all-enabled", "Tesla-T4", Some("1")).unwrap_err();
        assert!(t4.contains("Tesla-T4 has no MIG profiles"), "{t4}");
        assert_eq!(
            check_node(&file, "all-disabled", "Tesla-T4", Some("1")),
            Ok(())
        );
    }

    #[test]
    fn unknown_layout_is_reported() {
        let file = parse(SCENARIO_4);
        assert_eq!(
            check_node(&file, "inference-8", "NVIDIA-A100-SXM4-40GB", Some("8")),
            Err("MIG layout \"inference-8\" is not in the MIG config (it defines inference-7 and training-4); fix the nvidia.com/mig.config label or add the layout".to_string())
        );
    }

    #[test]
    fn a_huge_device_index_is_rejected_by_the_parser_naming_the_field() {
        for devices in ["[0, 4294967295]", "[256]", "[0, 9223372036854775807]"] {
            let text = format!(
                "version: v1\nmig-configs:\n  x:\n    - devices: {devices}\n      mig-enabled: true\n      mig-devices: {{\"1g.10gb\": 7}}\n"
            );
            let problems = parse_yaml("mig", MIG_CONFIG_KEY, &text).expect_err(devices);
            let text: Vec<String> = problems.iter().map(ToString::to_string).collect();
            let text = text.join("\n");
            assert!(text.contains(".devices["), "{text}");
            assert!(text.contains("past the highest GPU index"), "{text}");
        }
        // The highest accepted index still parses.
        parse(
            "version: v1\nmig-configs:\n  x:\n    - devices: [0, 255]\n      mig-enabled: false\n",
        );
    }

    #[test]
    fn a_huge_gpu_count_label_is_reported_not_iterated() {
        let file = parse(
            "version: v1\nmig-configs:\n  x:\n    - devices: all\n      mig-enabled: false\n",
        );
        let started = std::time::Instant::now();
        let e = check_node(&file, "x", "NVIDIA-H100-80GB-HBM3", Some("4000000000")).unwrap_err();
        assert!(e.contains("nvidia.com/gpu.count=4000000000"), "{e}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn device_index_out_of_range_is_reported() {
        let file = parse(
            "version: v1\nmig-configs:\n  x:\n    - devices: [0, 9]\n      mig-enabled: true\n      mig-devices: {\"3g.40gb\": 2}\n",
        );
        let e = check_node(&file, "x", "NVIDIA-H100-80GB-HBM3", Some("8")).unwrap_err();
        assert!(
            e.contains(
                "entry 0 lists device index 9, but the node has 8 GPUs (nvidia.com/gpu.count=8)"
            ),
            "{e}"
        );
        // Without gpu.count the index is not judged.
        assert_eq!(
            check_node(&file, "x", "NVIDIA-H100-80GB-HBM3", None),
            Ok(())
        );
        // Under the single strategy gpu.count counts MIG devices, so it is not used.
        assert_eq!(
            check_node(&file, "x", "NVIDIA-H100-80GB-HBM3-MIG-3g.40gb", Some("4")),
            Ok(())
        );
    }

    #[test]
    fn placement_rules_from_the_facts() {
        let fits = |devices: &str| {
            let file = parse(&format!(
                "version: v1\nmig-configs:\n  x:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {devices}\n"
            ));
            check_node(&file, "x", "NVIDIA-A100-SXM4-40GB", Some("8"))
        };
        assert_eq!(fits("{\"4g.20gb\": 1, \"3g.20gb\": 1}"), Ok(()));
        assert_eq!(
            fits("{\"3g.20gb\": 1, \"2g.10gb\": 1, \"1g.5gb\": 2}"),
            Ok(())
        );
        assert_eq!(fits("{\"2g.10gb\": 3, \"1g.5gb\": 1}"), Ok(()));
        assert_eq!(fits("{\"4g.20gb\": 1, \"1g.10gb\": 2}"), Ok(()));
        assert_eq!(fits("{\"7g.40gb\": 1}"), Ok(()));
        let e = fits("{\"3g.20gb\": 2, \"1g.5gb\": 1}").unwrap_err();
        assert!(
            e.contains("cannot be placed side by side in the 8 memory slices"),
            "{e}"
        );
        let e = fits("{\"1g.5gb\": 8}").unwrap_err();
        assert!(e.contains("8 × 1g.5gb is more than the 7"), "{e}");
        let e = fits("{\"4g.20gb\": 1, \"2g.10gb\": 2}").unwrap_err();
        assert!(
            e.contains("needs 8 compute slices, but a A100-40GB GPU has 7"),
            "{e}"
        );
        let e = fits("{\"1g.5gb+foo\": 1}").unwrap_err();
        assert!(e.contains("1g.5gb+foo does not exist on A100-40GB"), "{e}");
    }

    #[test]
    fn each_fake_model_takes_its_own_profiles() {
        let layouts = [
            ("NVIDIA-A100-SXM4-40GB", "{\"1g.5gb\": 7}"),
            ("NVIDIA-A100-SXM4-80GB", "{\"1g.10gb\": 7}"),
            ("NVIDIA-H100-80GB-HBM3", "{\"2g.20gb\": 3, \"1g.10gb\": 1}"),
            ("NVIDIA-H200", "{\"3g.71gb\": 2}"),
            ("NVIDIA-A30", "{\"2g.12gb\": 1, \"1g.6gb\": 2}"),
        ];
        for (product, devices) in layouts {
            let file = parse(&format!(
                "version: v1\nmig-configs:\n  x:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {devices}\n"
            ));
            assert_eq!(
                check_node(&file, "x", product, Some("8")),
                Ok(()),
                "{product}"
            );
            for (other, _) in layouts.iter().filter(|(p, _)| *p != product) {
                // None of these layouts carries over to another model unchanged, except the
                // A100-80GB / H100-80GB pair, which share their profiles.
                let same_profiles = matches!(
                    (product, *other),
                    ("NVIDIA-A100-SXM4-80GB", "NVIDIA-H100-80GB-HBM3")
                        | ("NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB")
                );
                assert_eq!(
                    check_node(&file, "x", other, Some("8")).is_ok(),
                    same_profiles,
                    "{devices} on {other}"
                );
            }
        }
        let file = parse(
            "version: v1\nmig-configs:\n  x:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {\"2g.12gb\": 3}\n",
        );
        let e = check_node(&file, "x", "NVIDIA-A30", Some("4")).unwrap_err();
        assert!(e.contains("3 × 2g.12gb is more than the 2"), "{e}");
    }

    #[test]
    fn device_filter_limits_entries_to_their_models() {
        let file = parse(
            "version: v1\nmig-configs:\n  mixed-fleet:\n    - device-filter: \"0x20B010DE\"\n      devices: all\n      mig-enabled: true\n      mig-devices: {\"1g.5gb\": 7}\n    - device-filter: [\"0x233010DE\", \"0x232210DE\"]\n      devices: all\n      mig-enabled: true\n      mig-devices: {\"1g.10gb\": 7}\n",
        );
        assert_eq!(
            check_node(&file, "mixed-fleet", "NVIDIA-A100-SXM4-40GB", Some("8")),
            Ok(())
        );
        assert_eq!(
            check_node(&file, "mixed-fleet", "NVIDIA-H100-80GB-HBM3", Some("8")),
            Ok(())
        );
        // No entry selects an A30, so nothing is applied there.
        assert_eq!(
            check_node(&file, "mixed-fleet", "NVIDIA-A30", Some("4")),
            Ok(())
        );
        // Without the filters the H100 entry would win on every GPU; with them the A100 keeps
        // its own layout. A filter with a subsystem part is judged by its device part.
        let file = parse(
            "version: v1\nmig-configs:\n  x:\n    - device-filter: \"0x20B010DE:0x134F10DE\"\n      devices: all\n      mig-enabled: true\n      mig-devices: {\"1g.10gb\": 7}\n",
        );
        assert!(check_node(&file, "x", "NVIDIA-A100-SXM4-40GB", Some("8")).is_err());
    }

    #[test]
    fn later_entries_win_for_the_gpus_they_match() {
        let file = parse(
            "version: v1\nmig-configs:\n  x:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {\"2g.10gb\": 4}\n    - devices: all\n      mig-enabled: false\n",
        );
        // The broken first entry is overridden on every GPU.
        assert_eq!(
            check_node(&file, "x", "NVIDIA-A100-SXM4-40GB", Some("8")),
            Ok(())
        );
    }

    #[test]
    fn default_config_parses_and_every_layout_fits_its_models() {
        let text = default_config();
        let file = parse(&text);
        for name in [
            "all-disabled",
            "all-enabled",
            "all-balanced",
            "all-1g.10gb",
            "all-1g.10gb.me",
            "all-7g.141gb",
            "all-1g.6gb",
            "all-2g.48gb.me.all",
        ] {
            assert!(file.configs.contains_key(name), "{name} missing:\n{text}");
        }
        // all-1g.10gb: 4 on an A100-40GB (double memory), 7 on A100-80GB / H100-80GB.
        let entries = &file.configs["all-1g.10gb"];
        assert_eq!(entries.len(), 2);
        assert_eq!(
            entries[0].device_filter,
            vec!["0x20B010DE", "0x20B110DE", "0x20F110DE", "0x20F610DE"]
        );
        assert_eq!(entries[0].mig_devices.as_ref().unwrap()["1g.10gb"], 4);
        assert_eq!(entries[1].mig_devices.as_ref().unwrap()["1g.10gb"], 7);
        for model in MODELS {
            let product = format!("NVIDIA-{}", model.product_words[0].join("-"));
            assert_eq!(
                mig_profiles::identify_model(&product),
                Some(model),
                "{product}"
            );
            for layout in file.configs.keys() {
                let offered = layout == "all-disabled"
                    || layout == "all-enabled"
                    || layout == "all-balanced"
                    || model
                        .profiles
                        .iter()
                        .any(|p| format!("all-{}", p.name.replace('+', ".")) == *layout);
                if offered {
                    assert_eq!(
                        check_node(&file, layout, &product, Some("8")),
                        Ok(()),
                        "{layout} on {product}"
                    );
                }
            }
        }
    }

    #[test]
    fn profile_grammar_follows_go_nvlib() {
        for good in [
            "1g.5gb",
            "1g.10gb+me",
            "1g.10gb+me.all",
            "1g.24gb-me",
            "1g.24gb+gfx",
            "1c.2g.20gb",
            "2g.20gb+me,gfx",
            "0g.0gb",
            "1g.5gb+foo",
            "007g.5gb",
        ] {
            assert!(parse_profile_name(good).is_ok(), "{good}");
        }
        for bad in [
            "1g.5GB",
            "1g",
            "1g.5",
            "1g.5gb+me-x",
            "1g.5gb+",
            "1g.5gb+me,me",
            "1g.5gb+1me",
            "1g.5gb+me+gfx",
            "1g.5gb.me",
            " 1g.5gb",
            "1g.5gb+me.",
        ] {
            assert!(parse_profile_name(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_profile_name("7c.7g.40gb").unwrap().canonical(),
            "7g.40gb"
        );
    }

    // What mig-parted rejects, with its messages: the corpus in tests/mig-corpus
    // (tests/mig_corpus.rs).

    #[test]
    fn mig_parted_accepts_what_its_decoders_accept() {
        // yes/on booleans, integral floats, empty mig-devices, a version-only or empty file.
        let file = parse(
            "version: v1\nmig-configs:\n  a:\n    - devices: [0, 1.0]\n      mig-enabled: yes\n      mig-devices: {}\n  on:\n    - devices: all\n      mig-enabled: off\n",
        );
        assert_eq!(
            file.configs["a"][0].devices,
            MigDevices::Indexes(vec![0, 1])
        );
        assert!(file.configs["a"][0].mig_enabled);
        assert!(
            file.configs.contains_key("true"),
            "{:?}",
            file.configs.keys()
        );
        assert!(parse("version: v1\n").configs.is_empty());
        assert!(parse("").configs.is_empty());
    }

    #[test]
    fn missing_config_yaml_key_is_reported() {
        let data = BTreeMap::from([("config".to_string(), SCENARIO_4.to_string())]);
        let p = parse_config("mig-config", &data).unwrap_err();
        assert_eq!(
            p[0].to_string(),
            "ConfigMap mig-config: has no key \"config.yaml\", the only key mig-manager reads (its keys: config); put the mig-parted config under config.yaml"
        );
    }
}
