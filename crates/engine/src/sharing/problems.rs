//! Validate-stage helper (pure, no IO): the scaffolding every config parser here shares.
//!
//! Each parser reads one ConfigMap key and reports every problem it finds, not just the first,
//! each located by the field path inside the key's document; these helpers keep the location,
//! the wording of the common problems (a missing key, broken YAML, an unknown field) and the
//! accept/refuse decision the same across the device plugin, mig-parted and vGPU parsers.

use std::collections::BTreeMap;

use super::yaml::{self, Document};
use super::{ConfigProblem, ProblemReason, list_words, located, suggest};

/// The problems found in one key of one ConfigMap, in the order they were found.
pub(crate) struct Problems<'a> {
    config_map: &'a str,
    key: &'a str,
    found: Vec<ConfigProblem>,
}

impl<'a> Problems<'a> {
    pub(crate) fn new(config_map: &'a str, key: &'a str) -> Self {
        Problems {
            config_map,
            key,
            found: Vec::new(),
        }
    }

    /// Runs `parse` over key `key` of ConfigMap `config_map` with an empty list, and returns
    /// what it parsed when it found nothing, else every problem: a tool refuses the whole file
    /// for any one of them.
    pub(crate) fn collect<T>(
        config_map: &'a str,
        key: &'a str,
        parse: impl FnOnce(&mut Problems<'a>) -> T,
    ) -> Result<T, Vec<ConfigProblem>> {
        let mut problems = Problems::new(config_map, key);
        let parsed = parse(&mut problems);
        problems.into_result(parsed)
    }

    /// Records a problem at `field` (a dotted path; empty for the whole document).
    pub(crate) fn push(&mut self, field: &str, reason: ProblemReason, message: impl Into<String>) {
        self.found.push(ConfigProblem {
            config_map: self.config_map.to_string(),
            key: Some(self.key.to_string()),
            field: (!field.is_empty()).then(|| field.to_string()),
            message: message.into(),
            reason,
        });
    }

    /// How many problems so far; a parser compares counts to tell whether one part was clean.
    pub(crate) fn len(&self) -> usize {
        self.found.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.found.is_empty()
    }

    /// A message located like a problem (`ConfigMap <cm>, key "<key>": <field> <message>`), for
    /// warnings that do not refuse the file.
    pub(crate) fn locate(&self, field: &str, message: &str) -> String {
        located(self.config_map, Some(self.key), Some(field), message)
    }

    /// The first YAML document of `text`, or `None` with the syntax error recorded;
    /// `consequence` ends the message (`, mig-parted cannot read it`).
    pub(crate) fn document(&mut self, text: &str, consequence: &str) -> Option<Document> {
        match yaml::parse_first_document(text) {
            Ok(document) => Some(document),
            Err(error) => {
                self.push(
                    "",
                    ProblemReason::InvalidYaml,
                    format!("is not valid YAML ({error}); fix the syntax{consequence}"),
                );
                None
            }
        }
    }

    /// Every problem found, for a parser that decides acceptance itself.
    pub(crate) fn into_vec(self) -> Vec<ConfigProblem> {
        self.found
    }

    /// `parsed` when nothing was found, else every problem.
    pub(crate) fn into_result<T>(self, parsed: T) -> Result<T, Vec<ConfigProblem>> {
        if self.found.is_empty() {
            Ok(parsed)
        } else {
            Err(self.found)
        }
    }
}

/// The fix for an unknown field `key`: the known field it is likely a typo of, else
/// `<listing> <every known field>`.
pub(crate) fn unknown_field_hint(key: &str, known: &[&str], listing: &str) -> String {
    match suggest(key, known) {
        Some(close) => format!("did you mean {close}?"),
        None => format!("{listing} {}", known.join(", ")),
    }
}

/// The one ConfigMap key a tool reads its config file from.
pub(crate) struct ToolKey {
    pub key: &'static str,
    /// The tool, for messages (`mig-manager`).
    pub reader: &'static str,
    /// Its config, for messages (`the mig-parted config`).
    pub what: &'static str,
}

impl ToolKey {
    /// Parses the key with `parse` (given the ConfigMap, the key and its text), or says the
    /// key is missing, naming the keys there are: a tool given the wrong key name sees no
    /// config at all.
    pub(crate) fn parse<T>(
        &self,
        config_map: &str,
        data: &BTreeMap<String, String>,
        parse: impl FnOnce(&str, &str, &str) -> Result<T, Vec<ConfigProblem>>,
    ) -> Result<T, Vec<ConfigProblem>> {
        let ToolKey { key, reader, what } = self;
        match data.get(*key) {
            Some(text) => parse(config_map, key, text),
            None => {
                let keys: Vec<&str> = data.keys().map(String::as_str).collect();
                Err(vec![ConfigProblem {
                    config_map: config_map.to_string(),
                    key: None,
                    field: None,
                    message: format!(
                        "has no key {key:?}, the only key {reader} reads (its keys: {}); put \
                         {what} under {key}",
                        list_words(&keys)
                    ),
                    reason: ProblemReason::MissingConfigKey,
                }])
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_are_located_and_refuse_the_file() {
        assert_eq!(Problems::collect("cm", "config.yaml", |_| 1), Ok(1));
        let found: Vec<String> = Problems::collect("cm", "config.yaml", |problems| {
            problems.push("a.b", ProblemReason::WrongType, "is 1");
            problems.push("", ProblemReason::InvalidYaml, "is broken");
            assert_eq!(problems.len(), 2);
        })
        .unwrap_err()
        .iter()
        .map(ToString::to_string)
        .collect();
        assert_eq!(
            found,
            [
                "ConfigMap cm, key \"config.yaml\": a.b is 1",
                "ConfigMap cm, key \"config.yaml\": is broken"
            ]
        );
    }

    #[test]
    fn a_missing_key_names_the_keys_there_are() {
        let data = BTreeMap::from([("other".to_string(), String::new())]);
        let tool = ToolKey {
            key: "config.yaml",
            reader: "the tool",
            what: "its config",
        };
        let found = tool.parse("cm", &data, |_, _, _| Ok(())).unwrap_err();
        assert_eq!(
            found[0].to_string(),
            "ConfigMap cm: has no key \"config.yaml\", the only key the tool reads (its keys: \
             other); put its config under config.yaml"
        );
    }

    #[test]
    fn unknown_field_hints_suggest_or_list() {
        assert_eq!(
            unknown_field_hint("devics", &["devices", "x"], "it knows only"),
            "did you mean devices?"
        );
        assert_eq!(
            unknown_field_hint("zzz", &["devices", "x"], "it knows only"),
            "it knows only devices, x"
        );
    }
}
