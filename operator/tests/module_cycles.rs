//! No import cycle between the files of `operator/src` (issue 16): each stage and each operand
//! sits on the modules below it, never beside or above.
//!
//! The graph is built from the source text: a file depends on the file of every module it names
//! through `crate::...`, `super::...`, `self::...` (braced groups included) or through one of its
//! own child modules (`child::item`). Test code (`*_tests.rs`, and everything from a trailing
//! `#[cfg(test)] mod tests`) is left out: tests may reach anywhere. Cycles are found with
//! Tarjan's strongly connected components; any component of more than one file fails, but for
//! one named exception: the `api` folder, where `ClusterPolicySpec` is assembled in `api/mod.rs`
//! from the section types of its files and their `impl ClusterPolicySpec` blocks sit beside them
//! (one data model split by section, not layers).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module path (`["render", "common"]`) of a source file relative to `src`.
fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_owned());
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The source without comments and without its inline test module.
fn production_code(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]") && declares_test_module(lines.clone()) {
            break;
        }
        if trimmed.starts_with("//") {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Whether the lines after a `#[cfg(test)]` open an inline test module (other attributes may
/// come first); by convention it is the last item of its file.
fn declares_test_module<'a>(mut lines: impl Iterator<Item = &'a str>) -> bool {
    lines
        .find(|l| !l.trim_start().starts_with("#["))
        .is_some_and(|l| {
            let l = l.trim_start();
            let l = l.strip_prefix("pub(crate) ").unwrap_or(l);
            l.starts_with("mod ") && l.trim_end().ends_with('{')
        })
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every path that starts at `root::` (`crate`, `super`, `self` or a child module), with braced
/// groups expanded: `crate::a::{b, c::d}` gives `a::b` and `a::c::d` (root removed).
fn paths_from(code: &str, root: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let pattern = format!("{root}::");
    let bytes: Vec<char> = code.chars().collect();
    let text: String = bytes.iter().collect();
    let mut start = 0;
    while let Some(at) = text[start..].find(&pattern) {
        let pos = start + at;
        start = pos + pattern.len();
        let before = text[..pos].chars().next_back();
        if before.is_some_and(|c| is_ident(c) || c == ':') {
            continue;
        }
        expand(&text[start..], Vec::new(), &mut found);
    }
    found
}

/// Reads a path tail (`a::b::{c, d}`) at the start of `rest`, pushing each full path.
fn expand(rest: &str, prefix: Vec<String>, found: &mut Vec<Vec<String>>) {
    let mut path = prefix;
    let mut chars = rest.char_indices().peekable();
    loop {
        let ident: String = rest[chars.peek().map_or(rest.len(), |(i, _)| *i)..]
            .chars()
            .take_while(|c| is_ident(*c))
            .collect();
        if !ident.is_empty() {
            for _ in 0..ident.chars().count() {
                chars.next();
            }
            path.push(ident);
            let tail: String = chars.clone().map(|(_, c)| c).take(2).collect();
            if tail == "::" {
                chars.next();
                chars.next();
                continue;
            }
            found.push(path);
            return;
        }
        if chars.peek().is_some_and(|(_, c)| *c == '{') {
            let (open, _) = chars.next().unwrap();
            let mut depth = 1;
            let mut item_start = open + 1;
            for (i, c) in chars.by_ref() {
                match c {
                    '{' => depth += 1,
                    '}' | ',' if depth == 1 => {
                        expand(rest[item_start..i].trim(), path.clone(), found);
                        item_start = i + 1;
                        if c == '}' {
                            break;
                        }
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            return;
        }
        found.push(path);
        return;
    }
}

/// The file (module) a path lands in: the longest prefix that is a module.
fn resolve(path: &[String], modules: &BTreeSet<Vec<String>>) -> Option<Vec<String>> {
    (0..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|candidate| modules.contains(candidate))
}

/// Declared child modules (`mod x;`, `pub mod x;`) of a file's code.
fn children(code: &str) -> Vec<String> {
    code.lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            let l = l.strip_prefix("pub(crate) ").unwrap_or(l);
            l.strip_prefix("mod ")?.strip_suffix(';').map(str::to_owned)
        })
        .collect()
}

fn graph(src: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut modules = BTreeSet::new();
    let mut code = BTreeMap::new();
    for file in &files {
        let rel = file.strip_prefix(src).unwrap();
        let name = rel.to_string_lossy();
        let module = module_of(rel);
        modules.insert(module.clone());
        if name.ends_with("_tests.rs") || name.ends_with("/tests.rs") || name == "main.rs" {
            continue;
        }
        code.insert(
            module,
            production_code(&std::fs::read_to_string(file).unwrap()),
        );
    }
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (module, code) in &code {
        let is_dir_module = modules
            .iter()
            .any(|m| m.len() == module.len() + 1 && m.starts_with(module));
        // `super::` of a `mod.rs` is its parent; of a plain file, its folder's module.
        let parent = module[..module.len().saturating_sub(1)].to_vec();
        let mut roots: Vec<(String, Vec<String>)> = vec![
            ("crate".into(), vec![]),
            ("super".into(), parent),
            ("self".into(), module.clone()),
        ];
        for child in children(code) {
            let mut base = module.clone();
            base.push(child.clone());
            if is_dir_module || modules.contains(&base) {
                roots.push((child, module.clone()));
            }
        }
        for (root, base) in roots {
            for tail in paths_from(code, &root) {
                let mut full = base.clone();
                if !matches!(root.as_str(), "crate" | "super" | "self") {
                    full.push(root.clone());
                }
                full.extend(tail);
                if let Some(target) = resolve(&full, &modules)
                    && &target != module
                    && !target.is_empty()
                {
                    edges.entry(module.clone()).or_default().insert(target);
                }
            }
        }
    }
    edges
}

/// Strongly connected components with more than one member (Tarjan).
fn cycles(edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<Vec<String>>> {
    struct State<'a> {
        edges: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        index: BTreeMap<Vec<String>, usize>,
        low: BTreeMap<Vec<String>, usize>,
        stack: Vec<Vec<String>>,
        on_stack: BTreeSet<Vec<String>>,
        out: Vec<Vec<Vec<String>>>,
    }
    fn visit(s: &mut State<'_>, v: &Vec<String>) {
        let n = s.index.len();
        s.index.insert(v.clone(), n);
        s.low.insert(v.clone(), n);
        s.stack.push(v.clone());
        s.on_stack.insert(v.clone());
        for w in s.edges.get(v).cloned().unwrap_or_default() {
            if !s.index.contains_key(&w) {
                visit(s, &w);
                let low = s.low[v].min(s.low[&w]);
                s.low.insert(v.clone(), low);
            } else if s.on_stack.contains(&w) {
                let low = s.low[v].min(s.index[&w]);
                s.low.insert(v.clone(), low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(&w);
                let done = &w == v;
                component.push(w);
                if done {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let mut state = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !state.index.contains_key(v) {
            visit(&mut state, v);
        }
    }
    state.out
}

fn show(module: &[String]) -> String {
    if module.is_empty() {
        "crate".into()
    } else {
        module.join("::")
    }
}

#[test]
fn operator_src_has_no_import_cycle() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let edges = graph(&src);
    if std::env::var_os("SHOW_MODULE_EDGES").is_some() {
        for (from, to) in &edges {
            for t in to {
                println!("{} -> {}", show(from), show(t));
            }
        }
    }
    let found: Vec<_> = cycles(&edges)
        .into_iter()
        .filter(|c| !c.iter().all(|m| m.first().is_some_and(|top| top == "api")))
        .collect();
    let text: Vec<String> = found
        .iter()
        .map(|c| {
            format!(
                "{} files: {}",
                c.len(),
                c.iter().map(|m| show(m)).collect::<Vec<_>>().join(", ")
            )
        })
        .collect();
    assert!(found.is_empty(), "import cycles:\n{}", text.join("\n"));
}

#[test]
fn the_checker_finds_a_cycle_and_follows_braced_and_child_paths() {
    let dir = std::env::temp_dir().join(format!("module-cycles-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("a")).unwrap();
    std::fs::write(dir.join("lib.rs"), "pub mod a;\npub mod b;\n").unwrap();
    std::fs::write(dir.join("a/mod.rs"), "mod inner;\nfn f() { inner::g(); }\n").unwrap();
    std::fs::write(dir.join("a/inner.rs"), "use crate::{x, b::Thing};\n").unwrap();
    std::fs::write(
        dir.join("b.rs"),
        "// crate::nothing\nuse crate::a::f;\n#[cfg(test)]\nmod tests { use crate::c; }\n",
    )
    .unwrap();
    let edges = graph(&dir);
    let found = cycles(&edges);
    let _ = std::fs::remove_dir_all(&dir);
    let names: Vec<Vec<String>> = found
        .iter()
        .map(|c| c.iter().map(|m| show(m)).collect())
        .collect();
    assert_eq!(names, vec![vec!["a", "a::inner", "b"]]);
}
