//! Validate-stage helper (pure, no IO): reads YAML the way NVIDIA's Go tools do.
//!
//! The device plugin and mig-parted both read their files with `sigs.k8s.io/yaml`: YAML 1.1
//! (go-yaml v2) turned into JSON, then decoded by Go's `encoding/json`. That differs from the
//! YAML 1.2 rules `serde_yaml_ng` applies in ways that decide accept/reject:
//!
//! - an unquoted `yes`, `no`, `on`, `off`, `y`, `n` is a boolean, and `010` is octal, `1_000` an
//!   integer; quoted, each stays a string;
//! - a key given twice is not an error: the last value wins;
//! - only the first document of a multi-document stream is read.
//!
//! So the text is parsed into [`Node`], a JSON-like tree where plain scalars have been resolved
//! with YAML 1.1 rules. Whether a scalar was quoted is told from where its text sits in the
//! source: a quoted scalar's text starts right after its opening quote.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// One YAML value after YAML 1.1 resolution, as Go's JSON decoder sees it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Node {
    Null,
    Bool(bool),
    /// Any integer; `i128` holds every value go-yaml can produce (int64 and uint64).
    Int(i128),
    Float(f64),
    Str(String),
    Seq(Vec<Node>),
    /// Keys in document order, duplicates kept (see [`Node::entries`]).
    Map(Vec<(String, Node)>),
}

impl Node {
    /// How the value reads in a message: `null`, `true`, `3`, `"text"`, `a list`, `a mapping`.
    pub(crate) fn describe(&self) -> String {
        match self {
            Node::Null => "null (empty)".to_string(),
            Node::Bool(b) => b.to_string(),
            Node::Int(i) => i.to_string(),
            Node::Float(f) => format_float(*f),
            Node::Str(s) => format!("the string {s:?}"),
            Node::Seq(_) => "a list".to_string(),
            Node::Map(_) => "a mapping".to_string(),
        }
    }

    /// An integer value as Go's JSON decoder would store it in an `int`: integers, and floats
    /// without a fractional part (go-yaml's `2.0` reaches JSON as `2`).
    pub(crate) fn as_integer(&self) -> Option<i128> {
        match self {
            Node::Int(i) => Some(*i),
            Node::Float(f) if f.fract() == 0.0 && f.abs() < 1e21 => Some(*f as i128),
            _ => None,
        }
    }
}

/// Entries of a mapping with duplicates resolved (the last value wins, at the position of the
/// first occurrence), plus the keys that were duplicated.
pub(crate) fn dedup_entries(entries: &[(String, Node)]) -> (Vec<(&str, &Node)>, Vec<&str>) {
    let mut out: Vec<(&str, &Node)> = Vec::with_capacity(entries.len());
    let mut duplicated: Vec<&str> = Vec::new();
    for (key, value) in entries {
        if let Some(slot) = out.iter_mut().find(|(k, _)| *k == key.as_str()) {
            slot.1 = value;
            if !duplicated.contains(&key.as_str()) {
                duplicated.push(key.as_str());
            }
        } else {
            out.push((key.as_str(), value));
        }
    }
    (out, duplicated)
}

/// A parsed file: its first document, and whether more followed.
#[derive(Debug)]
pub(crate) struct Document {
    pub node: Node,
    pub more_documents: bool,
}

/// Parses the first YAML document of `src`. An empty stream is `null`, as for go-yaml.
pub(crate) fn parse_first_document(src: &str) -> Result<Document, String> {
    let mut documents = serde_yaml_ng::Deserializer::from_str(src);
    let Some(first) = documents.next() else {
        return Ok(Document {
            node: Node::Null,
            more_documents: false,
        });
    };
    let node = NodeSeed { src }
        .deserialize(first)
        .map_err(|e| e.to_string())?;
    // go-yaml stops after the first document and never looks at the rest, so a broken second
    // document is not an error; only its presence is reported.
    let more_documents = documents.next().is_some();
    Ok(Document {
        node,
        more_documents,
    })
}

#[derive(Clone, Copy)]
struct NodeSeed<'s> {
    src: &'s str,
}

impl<'de> DeserializeSeed<'de> for NodeSeed<'_> {
    type Value = Node;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Node, D::Error> {
        deserializer.deserialize_any(NodeVisitor { src: self.src })
    }
}

struct NodeVisitor<'s> {
    src: &'s str,
}

impl NodeVisitor<'_> {
    /// True when `text` is a slice of the source that starts right after a quote character,
    /// i.e. the scalar was written quoted. Plain scalars never start after a quote.
    fn is_quoted(&self, text: &str) -> bool {
        let base = self.src.as_ptr() as usize;
        let start = text.as_ptr() as usize;
        if start <= base || start > base + self.src.len() {
            return false;
        }
        matches!(
            self.src.as_bytes().get(start - base - 1),
            Some(b'\'' | b'"')
        )
    }
}

impl<'de> Visitor<'de> for NodeVisitor<'_> {
    type Value = Node;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Node, E> {
        Ok(Node::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Node, E> {
        Ok(Node::Int(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Node, E> {
        Ok(Node::Int(v.into()))
    }
    fn visit_i128<E: de::Error>(self, v: i128) -> Result<Node, E> {
        Ok(Node::Int(v))
    }
    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Node, E> {
        // Past uint64 go-yaml gives up on integers and the value fails every numeric field.
        Ok(i128::try_from(v).map_or_else(|_| Node::Float(v as f64), Node::Int))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Node, E> {
        Ok(Node::Float(v))
    }
    fn visit_unit<E>(self) -> Result<Node, E> {
        Ok(Node::Null)
    }
    fn visit_none<E>(self) -> Result<Node, E> {
        Ok(Node::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Node, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Node, E> {
        if self.is_quoted(v) {
            Ok(Node::Str(v.to_string()))
        } else {
            Ok(resolve_plain(v))
        }
    }
    fn visit_str<E>(self, v: &str) -> Result<Node, E> {
        // Not a slice of the source: escapes, folding or a block scalar, all of which go-yaml
        // keeps as strings.
        Ok(Node::Str(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Node, E> {
        Ok(Node::Str(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(NodeSeed { src: self.src })? {
            items.push(item);
        }
        Ok(Node::Seq(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key_seed(NodeSeed { src: self.src })? {
            let value = map.next_value_seed(NodeSeed { src: self.src })?;
            let key = key_text(&key).ok_or_else(|| {
                de::Error::custom(format!(
                    "a mapping key is {}; keys must be scalars",
                    key.describe()
                ))
            })?;
            entries.push((key, value));
        }
        Ok(Node::Map(entries))
    }
    fn visit_enum<A: de::EnumAccess<'de>>(self, _data: A) -> Result<Node, A::Error> {
        Err(de::Error::custom(
            "a custom YAML tag (like !foo) is not supported here",
        ))
    }
}

/// The JSON key a scalar YAML key becomes (`sigs.k8s.io/yaml` formats non-string keys).
fn key_text(key: &Node) -> Option<String> {
    match key {
        Node::Null => Some("null".to_string()),
        Node::Bool(b) => Some(b.to_string()),
        Node::Int(i) => Some(i.to_string()),
        Node::Float(f) => Some(format_float(*f)),
        Node::Str(s) => Some(s.clone()),
        Node::Seq(_) | Node::Map(_) => None,
    }
}

/// Formats a float like Go's `strconv.FormatFloat(f, 'g', -1, 64)` for ordinary values.
pub(crate) fn format_float(f: f64) -> String {
    if f.fract() == 0.0 && f.abs() < 1e21 {
        format!("{}", f as i128)
    } else {
        format!("{f}")
    }
}

/// YAML 1.1 resolution (go-yaml v2) of a plain scalar that YAML 1.2 left as a string.
fn resolve_plain(text: &str) -> Node {
    match text {
        "y" | "Y" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" => return Node::Bool(true),
        "n" | "N" | "no" | "No" | "NO" | "off" | "Off" | "OFF" => return Node::Bool(false),
        _ => {}
    }
    let starts_numeric = text
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_digit() || matches!(c, '+' | '-' | '.'));
    if starts_numeric {
        let plain: String = text.chars().filter(|&c| c != '_').collect();
        if let Some(i) = go_parse_int(&plain) {
            return Node::Int(i);
        }
        if is_yaml_float(&plain)
            && let Ok(f) = plain.parse::<f64>()
        {
            return Node::Float(f);
        }
    }
    Node::Str(text.to_string())
}

/// Go's `strconv.ParseInt(s, 0, 64)` / `ParseUint(s, 0, 64)`: sign, then `0x`, `0o`, `0b` or a
/// leading `0` (octal) prefix, else decimal.
fn go_parse_int(s: &str) -> Option<i128> {
    let (negative, unsigned) = match s.as_bytes().first()? {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    let lower = unsigned.to_ascii_lowercase();
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
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let magnitude = u64::from_str_radix(digits, radix).ok()?;
    let value = i128::from(magnitude);
    if negative {
        (value <= i128::from(i64::MAX) + 1).then_some(-value)
    } else {
        Some(value)
    }
}

/// go-yaml v2's float syntax: `[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?`.
fn is_yaml_float(s: &str) -> bool {
    let s = s.strip_prefix(['+', '-']).unwrap_or(s);
    let (mantissa, exponent) = match s.find(['e', 'E']) {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (s, None),
    };
    let mantissa_ok = match mantissa.split_once('.') {
        Some(("", frac)) => !frac.is_empty() && frac.chars().all(|c| c.is_ascii_digit()),
        Some((int, frac)) => {
            int.chars().all(|c| c.is_ascii_digit()) && frac.chars().all(|c| c.is_ascii_digit())
        }
        None => !mantissa.is_empty() && mantissa.chars().all(|c| c.is_ascii_digit()),
    };
    let exponent_ok = exponent.is_none_or(|e| {
        let e = e.strip_prefix(['+', '-']).unwrap_or(e);
        !e.is_empty() && e.chars().all(|c| c.is_ascii_digit())
    });
    mantissa_ok && exponent_ok
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(src: &str) -> Node {
        parse_first_document(src).unwrap().node
    }

    fn value(src: &str) -> Node {
        match parse(src) {
            Node::Map(entries) => entries.into_iter().next().unwrap().1,
            other => panic!("not a mapping: {other:?}"),
        }
    }

    #[test]
    fn plain_yaml_1_1_booleans_are_booleans_and_quoted_ones_strings() {
        assert_eq!(value("a: yes"), Node::Bool(true));
        assert_eq!(value("a: Off"), Node::Bool(false));
        assert_eq!(value("a: 'yes'"), Node::Str("yes".into()));
        assert_eq!(value("a: \"on\""), Node::Str("on".into()));
        assert_eq!(value("a: true"), Node::Bool(true));
        assert_eq!(value("a: \"true\""), Node::Str("true".into()));
        assert_eq!(value("{a: [yes, 'no']}"), {
            Node::Seq(vec![Node::Bool(true), Node::Str("no".into())])
        });
    }

    #[test]
    fn yaml_1_1_numbers_follow_go_yaml() {
        assert_eq!(value("a: 010"), Node::Int(8));
        assert_eq!(value("a: 1_000"), Node::Int(1000));
        assert_eq!(value("a: 0x1F"), Node::Int(31));
        assert_eq!(value("a: '010'"), Node::Str("010".into()));
        assert_eq!(value("a: 2.0").as_integer(), Some(2));
        assert_eq!(value("a: 2.5").as_integer(), None);
        assert_eq!(value("a: -3"), Node::Int(-3));
    }

    #[test]
    fn duplicate_keys_keep_the_last_value() {
        let Node::Map(entries) = parse("a: 1\nb: 2\na: 3\n") else {
            panic!("not a mapping")
        };
        let (deduped, duplicated) = dedup_entries(&entries);
        assert_eq!(deduped, vec![("a", &Node::Int(3)), ("b", &Node::Int(2))]);
        assert_eq!(duplicated, vec!["a"]);
    }

    #[test]
    fn only_the_first_document_is_read() {
        let doc = parse_first_document("a: 1\n---\n[broken\n").unwrap();
        assert_eq!(doc.node, Node::Map(vec![("a".into(), Node::Int(1))]));
        assert!(doc.more_documents);
        let empty = parse_first_document("# nothing here\n").unwrap();
        assert_eq!(empty.node, Node::Null);
        assert!(!empty.more_documents);
    }

    #[test]
    fn syntax_errors_are_reported() {
        assert!(parse_first_document("a: [1, 2\n").is_err());
        assert!(parse_first_document("a:\n\t- b\n").is_err());
    }
}
