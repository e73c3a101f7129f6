//! Structural JSON comparison (pure): the one walker behind "does the cluster hold what we
//! wrote" everywhere it is asked — the apply plan's `is_subset`, the CRD upgrade check and the
//! end-to-end tests. Callers choose the [`Rules`] and word the [`Difference`]s themselves.

use std::collections::BTreeSet;
use std::ops::ControlFlow;

use serde_json::Value;

/// How two values are compared.
#[derive(Clone, Copy, Debug)]
pub struct Rules {
    /// A zero value wanted (`""`, `false`, `0`, `null`, empty list or map) equals an absent or
    /// null one (the API server omits them), and a wanted `null` equals anything.
    pub zero_is_absent: bool,
    /// Lists whose wanted elements all carry a unique merge key (`mountPath`, `devicePath`,
    /// `uid` or `name`, as server-side apply merges them) are matched by that key, and the
    /// other side may hold more elements; other lists match element by element.
    pub merge_keyed_lists: bool,
    /// Whether keys the other side has and the wanted side lacks count, at an object's path.
    pub extra_keys_count: fn(&str) -> bool,
}

impl Rules {
    /// Every wanted field must be there with the same value; more is fine.
    pub const SUBSET: Rules = Rules {
        zero_is_absent: false,
        merge_keyed_lists: false,
        extra_keys_count: never,
    };
    /// Both sides must be identical.
    pub const EXACT: Rules = Rules {
        zero_is_absent: false,
        merge_keyed_lists: false,
        extra_keys_count: always,
    };
}

fn never(_: &str) -> bool {
    false
}

fn always(_: &str) -> bool {
    true
}

/// One place where the two sides differ; `path` is the field's JSON path.
#[derive(Clone, Debug, PartialEq)]
pub enum Difference<'a> {
    /// A wanted field (or merge-keyed list element) the other side lacks.
    Missing { path: String, wanted: &'a Value },
    /// A field the other side has and the wanted side lacks, where such keys count.
    Extra { path: String, found: &'a Value },
    /// Lists of different lengths, compared element by element.
    Length {
        path: String,
        wanted: &'a Value,
        found: &'a Value,
    },
    /// Different values (or kinds of value).
    Changed {
        path: String,
        wanted: &'a Value,
        found: &'a Value,
    },
}

impl Difference<'_> {
    /// The JSON path of the field that differs.
    pub fn path(&self) -> &str {
        match self {
            Difference::Missing { path, .. }
            | Difference::Extra { path, .. }
            | Difference::Length { path, .. }
            | Difference::Changed { path, .. } => path,
        }
    }
}

/// Every difference between `wanted` and `found` under `rules`, in walk order.
pub fn differences<'a>(
    path: &str,
    wanted: &'a Value,
    found: &'a Value,
    rules: &Rules,
) -> Vec<Difference<'a>> {
    let mut out = Vec::new();
    let _ = walk(path, wanted, found, rules, &mut |d| {
        out.push(d);
        ControlFlow::Continue(())
    });
    out
}

/// The first difference between `wanted` and `found` under `rules`, if any.
pub fn first_difference<'a>(
    path: &str,
    wanted: &'a Value,
    found: &'a Value,
    rules: &Rules,
) -> Option<Difference<'a>> {
    let mut first = None;
    let _ = walk(path, wanted, found, rules, &mut |d| {
        first = Some(d);
        ControlFlow::Break(())
    });
    first
}

/// Whether a value equals absent for the API server.
pub fn is_zero(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.values().all(is_zero),
    }
}

/// The merge key of a list whose elements server-side apply merges one by one: the first of the
/// usual keys that every wanted element carries, with no value twice.
fn merge_key(wanted: &[Value]) -> Option<&'static str> {
    const KEYS: [&str; 4] = ["mountPath", "devicePath", "uid", "name"];
    KEYS.into_iter().find(|key| {
        let mut seen = BTreeSet::new();
        wanted.iter().all(|e| {
            e.get(key)
                .and_then(Value::as_str)
                .is_some_and(|v| seen.insert(v))
        })
    })
}

type Visit<'v, 'a> = dyn FnMut(Difference<'a>) -> ControlFlow<()> + 'v;

fn walk<'a>(
    path: &str,
    wanted: &'a Value,
    found: &'a Value,
    rules: &Rules,
    visit: &mut Visit<'_, 'a>,
) -> ControlFlow<()> {
    match (wanted, found) {
        (Value::Object(w), Value::Object(f)) => {
            for (key, wv) in w {
                let child = format!("{path}.{key}");
                match f.get(key) {
                    Some(fv) => walk(&child, wv, fv, rules, visit)?,
                    None if rules.zero_is_absent && is_zero(wv) => {}
                    None => visit(Difference::Missing {
                        path: child,
                        wanted: wv,
                    })?,
                }
            }
            if (rules.extra_keys_count)(path) {
                for (key, fv) in f.iter().filter(|(k, _)| !w.contains_key(*k)) {
                    visit(Difference::Extra {
                        path: format!("{path}.{key}"),
                        found: fv,
                    })?;
                }
            }
            ControlFlow::Continue(())
        }
        (Value::Array(w), Value::Array(f)) => {
            match merge_key(w).filter(|_| rules.merge_keyed_lists && !w.is_empty()) {
                Some(key) => {
                    for wv in w {
                        let id = wv.get(key).and_then(Value::as_str).unwrap_or_default();
                        let element = format!("{path}[{key}={id}]");
                        match f
                            .iter()
                            .find(|fv| fv.get(key).and_then(Value::as_str) == Some(id))
                        {
                            Some(fv) => walk(&element, wv, fv, rules, visit)?,
                            None => visit(Difference::Missing {
                                path: element,
                                wanted: wv,
                            })?,
                        }
                    }
                    ControlFlow::Continue(())
                }
                None if w.len() == f.len() => {
                    for (i, (wv, fv)) in w.iter().zip(f).enumerate() {
                        walk(&format!("{path}[{i}]"), wv, fv, rules, visit)?;
                    }
                    ControlFlow::Continue(())
                }
                None => visit(Difference::Length {
                    path: path.to_owned(),
                    wanted,
                    found,
                }),
            }
        }
        (w, Value::Null) if rules.zero_is_absent && is_zero(w) => ControlFlow::Continue(()),
        (Value::Null, _) if rules.zero_is_absent => ControlFlow::Continue(()),
        (w, f) if w == f => ControlFlow::Continue(()),
        (w, f) => visit(Difference::Changed {
            path: path.to_owned(),
            wanted: w,
            found: f,
        }),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn subset_ignores_extra_keys_and_exact_reports_them_after_the_wanted_ones() {
        let wanted = json!({"a": 1, "b": {"c": [1, 2]}});
        let found = json!({"a": 1, "b": {"c": [1, 3], "d": true}, "e": 0});
        let subset = differences("", &wanted, &found, &Rules::SUBSET);
        assert_eq!(
            subset,
            vec![Difference::Changed {
                path: ".b.c[1]".into(),
                wanted: &json!(2),
                found: &json!(3)
            }]
        );
        let exact: Vec<String> = differences("", &wanted, &found, &Rules::EXACT)
            .into_iter()
            .map(|d| match d {
                Difference::Extra { path, .. } => format!("extra {path}"),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(exact.len(), 3, "{exact:?}");
        assert_eq!(exact[1..], ["extra .b.d", "extra .e"]);
    }

    #[test]
    fn merge_keyed_lists_match_by_key_and_zero_values_equal_absent() {
        let rules = Rules {
            zero_is_absent: true,
            merge_keyed_lists: true,
            extra_keys_count: never,
        };
        let wanted = json!({"env": [{"name": "B", "value": "2"}], "paused": false});
        let found = json!({"env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]});
        assert_eq!(first_difference("", &wanted, &found, &rules), None);
        let gone = json!({"env": [{"name": "A"}]});
        assert_eq!(
            first_difference("", &wanted, &gone, &rules),
            Some(Difference::Missing {
                path: ".env[name=B]".into(),
                wanted: &json!({"name": "B", "value": "2"})
            })
        );
        let strict = first_difference("", &wanted, &found, &Rules::SUBSET);
        assert!(
            matches!(strict, Some(Difference::Length { .. })),
            "{strict:?}"
        );
    }
}
