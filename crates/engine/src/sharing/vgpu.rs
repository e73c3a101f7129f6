//! Validate stage (pure, no IO): the vGPU device manager's config file (`version: v1`,
//! `vgpu-configs`), read before it reaches any node (docs/operand-facts.md §20.5).
//!
//! The file names configs; each config is a list of entries, and each entry says which GPUs
//! (`devices`, optionally narrowed by `device-filter`) get which vGPU types and how many
//! (`vgpu-devices`). The vGPU device manager refuses a file with unknown keys, a count that is
//! not positive, a type name it cannot parse, or an entry mixing time-sliced and MIG-backed
//! types; a node whose `nvidia.com/vgpu.config` label names a config the file lacks fails
//! there. Both are caught here, so an edit that would break the nodes is never rolled out.

use std::collections::BTreeMap;

use super::problems::{Problems, ToolKey, unknown_field_hint};
use super::yaml::{self, Node};
use super::{ConfigProblem, ProblemReason, list_words};
use crate::nodes::NodeView;

/// The key of the ConfigMap the vGPU device manager reads (`CONFIG_FILE=/vgpu-config/config.yaml`).
pub const CONFIG_KEY: &str = "config.yaml";
/// The node label choosing a node's vGPU config (set by the user).
pub const VGPU_CONFIG_LABEL: &str = "nvidia.com/vgpu.config";

const TOOL_KEY: ToolKey = ToolKey {
    key: CONFIG_KEY,
    reader: "the vGPU device manager",
    what: "the vGPU config",
};

const TOP_FIELDS: [&str; 2] = ["version", "vgpu-configs"];
const ENTRY_FIELDS: [&str; 3] = ["devices", "vgpu-devices", "device-filter"];

/// A parsed config file: entries by config name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VgpuConfigFile {
    pub configs: BTreeMap<String, Vec<VgpuEntry>>,
}

impl VgpuConfigFile {
    /// The config names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.configs.keys().map(String::as_str).collect()
    }
}

/// Which GPUs of a node an entry applies to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Devices {
    All,
    Indices(Vec<u32>),
}

/// One entry of a config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VgpuEntry {
    pub devices: Devices,
    /// vGPU type name to count.
    pub vgpu_devices: BTreeMap<String, u32>,
    /// PCI device IDs (`0x20B510DE`) the entry is limited to; empty for every GPU.
    pub device_filter: Vec<String>,
}

/// How a vGPU type shares its GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// Time-sliced: `<GPU>[-<suffix>…]-<GB><series>` (`A10-4Q`, `RTX6000-Ada-24Q`).
    TimeSliced,
    /// Backed by a MIG slice: `<GPU>-<slices>-<GB><series>[ME|NOME|MEALL|GFX]` (`A30-2-12C`).
    MigBacked,
}

/// Parses a vGPU type name (`A10-4Q`, `A30-2-12C`, `DC-4-32CGFX`) into how it shares its GPU,
/// or says why it is not one.
pub fn parse_type_name(name: &str) -> Result<Sharing, String> {
    let parts: Vec<&str> = name.split('-').collect();
    let (last, rest) = match parts.split_last() {
        Some((last, rest)) if !rest.is_empty() && rest.iter().all(|p| !p.is_empty()) => {
            (*last, rest)
        }
        _ => {
            return Err(
                "is not a vGPU type name: it must be <GPU>-<memory in GB><series>, such as \
                 A10-4Q, or <GPU>-<MIG slices>-<memory in GB><series>, such as A30-2-12C"
                    .to_owned(),
            );
        }
    };
    let digits = last.chars().take_while(char::is_ascii_digit).count();
    let (memory, tail) = last.split_at(digits);
    let mut tail_chars = tail.chars();
    let series = tail_chars.next();
    let attribute = tail_chars.as_str();
    if memory.is_empty() || !matches!(series, Some('A' | 'B' | 'C' | 'Q')) {
        return Err(format!(
            "ends in {last:?}, which is not <memory in GB><series> with series A, B, C or Q \
             (such as 4Q or 12C)"
        ));
    }
    if !matches!(attribute, "" | "ME" | "NOME" | "MEALL" | "GFX") {
        return Err(format!(
            "ends in {last:?}: after the series only ME, NOME, MEALL or GFX may follow (MIG-backed \
             types)"
        ));
    }
    let slices = rest.len() >= 2
        && rest
            .last()
            .is_some_and(|p| p.chars().all(|c| c.is_ascii_digit()));
    match (slices, attribute.is_empty()) {
        (true, _) => Ok(Sharing::MigBacked),
        (false, true) => Ok(Sharing::TimeSliced),
        (false, false) => Err(format!(
            "has the MIG attribute {attribute:?} but no MIG slice count: a MIG-backed type is \
             <GPU>-<MIG slices>-<memory in GB><series>{attribute}, such as A100-1-5C{attribute}"
        )),
    }
}

/// Reads the config from the ConfigMap's data (`config_map`: its name, for messages).
pub fn parse_config(
    config_map: &str,
    data: &BTreeMap<String, String>,
) -> Result<VgpuConfigFile, Vec<ConfigProblem>> {
    TOOL_KEY.parse(config_map, data, parse_yaml)
}

/// Parses one config document.
pub fn parse_yaml(
    config_map: &str,
    key: &str,
    text: &str,
) -> Result<VgpuConfigFile, Vec<ConfigProblem>> {
    Problems::collect(config_map, key, |problems| Parser { problems }.file(text))
}

struct Parser<'p, 'a> {
    problems: &'p mut Problems<'a>,
}

impl Parser<'_, '_> {
    fn unexpected(&mut self, field: &str, key: &str, known: &[&str]) {
        let hint = unknown_field_hint(key, known, "the allowed keys are");
        self.problems.push(
            field,
            ProblemReason::UnexpectedField,
            format!(
                "is not a key the vGPU device manager knows, and it refuses the whole file; \
                 remove or rename it ({hint})"
            ),
        );
    }

    fn file(&mut self, text: &str) -> VgpuConfigFile {
        let mut file = VgpuConfigFile::default();
        let Some(root) = self
            .problems
            .document(text, "")
            .map(|document| document.node)
        else {
            return file;
        };
        let Node::Map(entries) = &root else {
            self.problems.push(
                "",
                ProblemReason::WrongType,
                format!(
                    "is {} at the top level; a vGPU config is a mapping with version: v1 and \
                     vgpu-configs",
                    root.describe()
                ),
            );
            return file;
        };
        let (entries, _) = yaml::dedup_entries(entries);
        let mut version = None;
        let mut configs = None;
        for (key, value) in entries {
            match key {
                "version" => version = Some(value),
                "vgpu-configs" => configs = Some(value),
                other => self.unexpected(other, other, &TOP_FIELDS),
            }
        }
        match version {
            Some(Node::Str(v)) if v == "v1" => {}
            Some(other) => self.problems.push(
                "version",
                ProblemReason::UnknownVersion,
                format!(
                    "is {}; the only version is v1: set version: v1",
                    other.describe()
                ),
            ),
            None => self.problems.push(
                "version",
                ProblemReason::MissingField,
                "is missing; add version: v1",
            ),
        }
        match configs {
            Some(Node::Map(named)) if !named.is_empty() => {
                let (named, _) = yaml::dedup_entries(named);
                for (name, value) in named {
                    if let Some(list) = self.config(name, value) {
                        file.configs.insert(name.to_owned(), list);
                    }
                }
            }
            Some(Node::Map(_)) | Some(Node::Null) | None => self.problems.push(
                "vgpu-configs",
                ProblemReason::MissingField,
                "is missing or empty; name at least one config, such as default, with its \
                 entries",
            ),
            Some(other) => self.problems.push(
                "vgpu-configs",
                ProblemReason::WrongType,
                format!(
                    "is {}; it must map config names to lists of entries",
                    other.describe()
                ),
            ),
        }
        file
    }

    fn config(&mut self, name: &str, value: &Node) -> Option<Vec<VgpuEntry>> {
        let path = format!("vgpu-configs.{name}");
        let Node::Seq(items) = value else {
            self.problems.push(
                &path,
                ProblemReason::WrongType,
                format!(
                    "is {}; a config is a non-empty list of entries with devices and vgpu-devices",
                    value.describe()
                ),
            );
            return None;
        };
        if items.is_empty() {
            self.problems.push(
                &path,
                ProblemReason::MissingField,
                "is an empty list; give it at least one entry with devices and vgpu-devices, or \
                 remove the config",
            );
            return None;
        }
        let before = self.problems.len();
        let entries: Vec<VgpuEntry> = items
            .iter()
            .enumerate()
            .filter_map(|(i, item)| self.entry(&format!("{path}[{i}]"), item))
            .collect();
        (self.problems.len() == before).then_some(entries)
    }

    fn entry(&mut self, path: &str, item: &Node) -> Option<VgpuEntry> {
        let Node::Map(fields) = item else {
            self.problems.push(
                path,
                ProblemReason::WrongType,
                format!(
                    "is {}; an entry is a mapping with devices and vgpu-devices",
                    item.describe()
                ),
            );
            return None;
        };
        let (fields, _) = yaml::dedup_entries(fields);
        let (mut devices, mut types, mut filter) = (None, None, Vec::new());
        for &(key, value) in &fields {
            match key {
                "devices" => devices = self.devices(&format!("{path}.devices"), value),
                "vgpu-devices" => types = self.types(&format!("{path}.vgpu-devices"), value),
                "device-filter" => filter = self.filter(&format!("{path}.device-filter"), value),
                other => self.unexpected(&format!("{path}.{other}"), other, &ENTRY_FIELDS),
            }
        }
        let present = |k: &str| fields.iter().any(|(key, _)| *key == k);
        for required in ["devices", "vgpu-devices"] {
            if !present(required) {
                let example = if required == "devices" {
                    "devices: all"
                } else {
                    "vgpu-devices: {A10-4Q: 6}"
                };
                self.problems.push(
                    &format!("{path}.{required}"),
                    ProblemReason::MissingField,
                    format!("is missing; every entry needs it (for example {example})"),
                );
            }
        }
        Some(VgpuEntry {
            devices: devices?,
            vgpu_devices: types?,
            device_filter: filter,
        })
    }

    fn devices(&mut self, path: &str, value: &Node) -> Option<Devices> {
        match value {
            Node::Str(s) if s == "all" => Some(Devices::All),
            Node::Seq(items) if !items.is_empty() => {
                let mut indices = Vec::new();
                for (i, item) in items.iter().enumerate() {
                    match item.as_integer().and_then(|n| u32::try_from(n).ok()) {
                        Some(n) => indices.push(n),
                        None => {
                            self.problems.push(
                                &format!("{path}[{i}]"),
                                ProblemReason::WrongType,
                                format!(
                                    "is {}; GPU indices are whole numbers from 0",
                                    item.describe()
                                ),
                            );
                            return None;
                        }
                    }
                }
                Some(Devices::Indices(indices))
            }
            other => {
                self.problems.push(
                    path,
                    ProblemReason::InvalidValue,
                    format!(
                        "is {}; it must be all or a non-empty list of GPU indices such as [0, 1]",
                        other.describe()
                    ),
                );
                None
            }
        }
    }

    fn types(&mut self, path: &str, value: &Node) -> Option<BTreeMap<String, u32>> {
        let Node::Map(entries) = value else {
            self.problems.push(
                path,
                ProblemReason::WrongType,
                format!(
                    "is {}; it must map vGPU type names to counts, such as {{A10-4Q: 6}}",
                    value.describe()
                ),
            );
            return None;
        };
        if entries.is_empty() {
            self.problems.push(
                path,
                ProblemReason::MissingField,
                "is empty; name at least one vGPU type with its count, such as A10-4Q: 6",
            );
            return None;
        }
        let (entries, _) = yaml::dedup_entries(entries);
        let before = self.problems.len();
        let mut out = BTreeMap::new();
        let mut kinds = BTreeMap::new();
        for (name, count) in entries {
            let field = format!("{path}.{name}");
            match parse_type_name(name) {
                Ok(kind) => {
                    kinds.insert(name, kind);
                }
                Err(why) => self.problems.push(
                    &field,
                    ProblemReason::InvalidValue,
                    format!("{why}; use a type the GPU offers (nvidia-smi vgpu -s lists them)"),
                ),
            }
            match count
                .as_integer()
                .and_then(|n| u32::try_from(n).ok())
                .filter(|n| *n > 0)
            {
                Some(n) => {
                    out.insert(name.to_owned(), n);
                }
                None => self.problems.push(
                    &field,
                    ProblemReason::InvalidValue,
                    format!(
                        "has count {}; a count must be a whole number above 0 (remove the type \
                         instead of giving it 0)",
                        count.describe()
                    ),
                ),
            }
        }
        let time_sliced: Vec<&str> = kinds
            .iter()
            .filter(|(_, k)| **k == Sharing::TimeSliced)
            .map(|(n, _)| *n)
            .collect();
        let mig: Vec<&str> = kinds
            .iter()
            .filter(|(_, k)| **k == Sharing::MigBacked)
            .map(|(n, _)| *n)
            .collect();
        if !time_sliced.is_empty() && !mig.is_empty() {
            self.problems.push(
                path,
                ProblemReason::InvalidValue,
                format!(
                    "mixes time-sliced types ({}) with MIG-backed types ({}) in one entry; a GPU \
                     runs one kind: put them in separate entries for different devices",
                    list_words(&time_sliced),
                    list_words(&mig)
                ),
            );
        }
        (self.problems.len() == before).then_some(out)
    }

    fn filter(&mut self, path: &str, value: &Node) -> Vec<String> {
        let ids: Vec<&Node> = match value {
            Node::Seq(items) => items.iter().collect(),
            other => vec![other],
        };
        let mut out = Vec::new();
        for id in ids {
            match id {
                Node::Str(s) if !s.is_empty() => out.push(s.clone()),
                other => self.problems.push(
                    path,
                    ProblemReason::WrongType,
                    format!(
                        "holds {}; a device filter is a PCI device ID string such as \"0x20B510DE\", \
                         or a list of them (quote it: unquoted it may read as a number)",
                        other.describe()
                    ),
                ),
            }
        }
        out
    }
}

/// The GPU nodes whose `nvidia.com/vgpu.config` label names a config `file` lacks, as one line
/// for status naming each node, its label value and the configs there are; `None` when every
/// label names one.
pub fn node_report(config_map: &str, file: &VgpuConfigFile, nodes: &[&NodeView]) -> Option<String> {
    let missing: Vec<String> = nodes
        .iter()
        .filter_map(|n| {
            let wanted = n.label(VGPU_CONFIG_LABEL)?;
            (!file.configs.contains_key(wanted))
                .then(|| format!("{} ({VGPU_CONFIG_LABEL}={wanted})", n.name))
        })
        .collect();
    if missing.is_empty() {
        return None;
    }
    Some(format!(
        "{} name a vGPU config that ConfigMap {config_map} does not have (its configs: {}); the \
         vGPU device manager leaves those nodes' vGPU devices as they are: label each with one of \
         the configs, or add the config to the ConfigMap",
        list_words(&missing),
        list_words(&file.names())
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn problems(text: &str) -> Vec<String> {
        match parse_yaml("vgpu-config", CONFIG_KEY, text) {
            Ok(_) => Vec::new(),
            Err(found) => found.iter().map(ToString::to_string).collect(),
        }
    }

    const GOOD: &str = "version: v1\nvgpu-configs:\n  default:\n  - devices: all\n    \
                        vgpu-devices:\n      A10-4Q: 6\n  A30-2-12C:\n  - devices: [0, 1]\n    \
                        device-filter: \"0x20B710DE\"\n    vgpu-devices:\n      A30-2-12C: 2\n";

    #[test]
    fn time_sliced_and_mig_backed_type_names_parse() {
        for name in [
            "A10-4Q",
            "RTX6000-Ada-24Q",
            "A100D-80C",
            "L40S-48A",
            "T4-16B",
        ] {
            assert_eq!(parse_type_name(name), Ok(Sharing::TimeSliced), "{name}");
        }
        for name in ["A30-2-12C", "DC-4-32CGFX", "A100-1-5CME", "H100-7-80CNOME"] {
            assert_eq!(parse_type_name(name), Ok(Sharing::MigBacked), "{name}");
        }
        for name in [
            "A10", "A10-4", "A10-4X", "-4Q", "A10--4Q", "A10-4QME", "A10-Q4",
        ] {
            assert!(parse_type_name(name).is_err(), "{name}");
        }
    }

    #[test]
    fn a_valid_file_parses_with_its_configs() {
        let file = parse_yaml("vgpu-config", CONFIG_KEY, GOOD).unwrap();
        assert_eq!(file.names(), ["A30-2-12C", "default"]);
        let entry = &file.configs["A30-2-12C"][0];
        assert_eq!(entry.devices, Devices::Indices(vec![0, 1]));
        assert_eq!(entry.device_filter, ["0x20B710DE"]);
        assert_eq!(entry.vgpu_devices["A30-2-12C"], 2);
    }

    #[test]
    fn errors_name_the_config_map_key_config_and_field_and_say_the_fix() {
        let broken = GOOD.replace("A10-4Q: 6", "A10-4Q: 0");
        let found = problems(&broken);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with(
                "ConfigMap vgpu-config, key \"config.yaml\": \
                 vgpu-configs.default[0].vgpu-devices.A10-4Q has count 0"
            ),
            "{}",
            found[0]
        );
        assert!(found[0].contains("above 0"), "{}", found[0]);
    }

    #[test]
    fn unknown_keys_a_wrong_version_and_an_empty_file_are_refused() {
        let typo = GOOD.replace("device-filter", "device-filters");
        assert!(problems(&typo)[0].contains("did you mean device-filter?"));
        assert!(problems(&GOOD.replace("v1", "v2"))[0].contains("version is the string \"v2\""));
        assert!(
            problems("version: v1\nvgpu-configs: {}\n")[0]
                .contains("vgpu-configs is missing or empty")
        );
        assert!(problems("version: v1\nvgpu-configs: {a: []}\nextra: 1\n").len() == 2);
        assert!(problems("version: v1\nvgpu-configs: [\n")[0].contains("not valid YAML"));
        let missing = "version: v1\nvgpu-configs:\n  a:\n  - vgpu-devices: {A10-4Q: 1}\n";
        assert!(problems(missing)[0].contains("vgpu-configs.a[0].devices is missing"));
    }

    #[test]
    fn an_entry_mixing_time_sliced_and_mig_backed_types_is_refused() {
        let mixed = "version: v1\nvgpu-configs:\n  a:\n  - devices: all\n    vgpu-devices: \
                     {A30-4C: 1, A30-2-12C: 1}\n";
        let found = problems(mixed);
        assert!(
            found[0].contains("mixes time-sliced types (A30-4C)"),
            "{found:?}"
        );
    }

    #[test]
    fn a_missing_config_key_names_the_keys_there_are() {
        let data = BTreeMap::from([("vgpu.yaml".to_owned(), GOOD.to_owned())]);
        let found = parse_config("vgpu-config", &data).unwrap_err();
        assert!(found[0].to_string().contains("has no key \"config.yaml\""));
        assert!(found[0].to_string().contains("vgpu.yaml"));
    }

    #[test]
    fn nodes_labelled_with_an_unknown_config_are_named_with_the_configs_there_are() {
        let file = parse_yaml("vgpu-config", CONFIG_KEY, GOOD).unwrap();
        let labels = |v: &str| BTreeMap::from([(VGPU_CONFIG_LABEL.to_owned(), v.to_owned())]);
        let good = NodeView::from_labels("good", None, &labels("default"));
        let bad = NodeView::from_labels("bad", None, &labels("A10-24Q"));
        assert_eq!(node_report("vgpu-config", &file, &[&good]), None);
        let report = node_report("vgpu-config", &file, &[&good, &bad]).unwrap();
        assert!(
            report.starts_with("bad (nvidia.com/vgpu.config=A10-24Q) name a vGPU config"),
            "{report}"
        );
        assert!(
            report.contains("its configs: A30-2-12C and default"),
            "{report}"
        );
    }
}
