//! One rendered object as a YAML document that every Kubernetes client reads back as written.
//!
//! Our emitter speaks YAML 1.2, where only `true` and `false` are booleans, so it writes the
//! string `on` plain. kubectl and Helm read YAML 1.1 (go-yaml v2 through sigs.k8s.io/yaml),
//! where `on`, `yes`, `n` and their kin are booleans: `value: on` in an env var then fails
//! schema validation as a bool. Such strings are written quoted.

use serde_json::Value;

/// Plain scalars YAML 1.1 resolves to booleans that a YAML 1.2 emitter leaves unquoted
/// (`true` and `false` it quotes itself).
const YAML11_ONLY_BOOLEANS: [&str; 16] = [
    "y", "Y", "yes", "Yes", "YES", "n", "N", "no", "No", "NO", "on", "On", "ON", "off", "Off",
    "OFF",
];

/// Stands in front of a string to quote while the emitter runs; letters only, so the emitter
/// keeps the marked string plain and it can be found again in the text.
const MARK: &str = "yamlElevenQuoteMark";

/// `object` (apiVersion, kind and metadata first) as one YAML document without the `---`.
pub(super) fn document(object: Value) -> Result<String, serde_yaml_ng::Error> {
    // A string that already holds the mark cannot be told apart from one we marked; such an
    // object is written as the emitter writes it (never with a value changed).
    let marking = !serde_json::to_string(&object)
        .map_err(<serde_yaml_ng::Error as serde::ser::Error>::custom)?
        .contains(MARK);
    let object = if marking { marked(object) } else { object };
    let text = serde_yaml_ng::to_string(&identity_first(object))?;
    Ok(if marking { quote_marked(&text) } else { text })
}

/// The object with `apiVersion`, `kind` and `metadata` first (JSON objects sort their keys,
/// which would put them in the middle of kinds without a `spec`, such as SCCs).
fn identity_first(object: Value) -> serde_yaml_ng::Mapping {
    let mut out = serde_yaml_ng::Mapping::new();
    let Value::Object(mut map) = object else {
        return out;
    };
    for key in ["apiVersion", "kind", "metadata"] {
        if let Some(value) = map.remove(key) {
            out.insert(key.into(), to_yaml_value(value));
        }
    }
    for (key, value) in map {
        out.insert(key.into(), to_yaml_value(value));
    }
    out
}

fn to_yaml_value(value: Value) -> serde_yaml_ng::Value {
    serde_yaml_ng::to_value(value).unwrap_or(serde_yaml_ng::Value::Null)
}

/// Every string value and key that YAML 1.1 reads as a boolean, with [`MARK`] in front.
fn marked(value: Value) -> Value {
    let mark = |s: String| {
        if YAML11_ONLY_BOOLEANS.contains(&s.as_str()) {
            format!("{MARK}{s}")
        } else {
            s
        }
    };
    match value {
        Value::String(s) => Value::String(mark(s)),
        Value::Array(items) => Value::Array(items.into_iter().map(marked).collect()),
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(key, value)| (mark(key), marked(value)))
                .collect(),
        ),
        other => other,
    }
}

/// The emitted text with each marked plain scalar single-quoted and its mark gone.
fn quote_marked(text: &str) -> String {
    let mut pieces = text.split(MARK);
    let mut out = pieces.next().unwrap_or_default().to_owned();
    for piece in pieces {
        let end = piece
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(piece.len());
        out.push('\'');
        out.push_str(&piece[..end]);
        out.push('\'');
        out.push_str(&piece[end..]);
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strings_yaml_1_1_reads_as_booleans_are_written_quoted() {
        let object = json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "x"},
            "data": {"on": "on", "mode": "off", "list": ["y", "n", "yes", "no"], "b": true},
        });
        let text = document(object.clone()).unwrap();
        assert!(text.contains("mode: 'off'"), "{text}");
        assert!(text.contains("'on': 'on'"), "{text}");
        assert!(text.contains("- 'y'\n"), "{text}");
        assert!(!text.contains(MARK), "{text}");
        // Read back, every value is what was rendered (a real boolean stays one).
        let back: Value = serde_yaml_ng::from_str(&text).unwrap();
        assert_eq!(back, object);
    }

    #[test]
    fn longer_strings_and_block_text_are_left_as_the_emitter_writes_them() {
        let object = json!({"kind": "ConfigMap", "data": {
            "script": "set -e\non\nno\n", "word": "online", "flag": "noon"}});
        let text = document(object.clone()).unwrap();
        assert_eq!(
            text,
            serde_yaml_ng::to_string(&identity_first(object)).unwrap()
        );
    }

    #[test]
    fn a_string_already_holding_the_mark_is_written_unchanged() {
        let object = json!({"kind": "ConfigMap", "data": {
            "a": format!("{MARK}on"), "b": "on"}});
        let back: Value = serde_yaml_ng::from_str(&document(object.clone()).unwrap()).unwrap();
        assert_eq!(back, object);
    }
}
