//! The software bill of materials of the operator image (CycloneDX 1.5, JSON): every package
//! compiled into the binary, as Cargo resolved it for the image's target, with its licence, its
//! package URL and the SHA-256 that Cargo.lock pins.
//!
//! Which packages are linked, and who pulls in whom, comes from `cargo tree -p <package>`: it
//! resolves features for that package alone, as `cargo build -p` does, whereas `cargo metadata`
//! unifies the features of every workspace member (a test-only feature of a shared dependency
//! would add crates the binary never links). Licences and repositories come from
//! `cargo metadata`, checksums from Cargo.lock. Pure functions over their output; `main.rs` and
//! [`from_workspace`] run Cargo.
//! The output is deterministic (sorted, no timestamp, no random serial number), so two image
//! builds of one tree carry the same SBOM byte for byte (scripts/image-check.sh compares them).

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// One package of Cargo.lock.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Locked {
    pub name: String,
    pub version: String,
    /// `registry+https://...` for crates.io, absent for workspace members.
    pub source: Option<String>,
    /// SHA-256 of the `.crate` file, for registry packages.
    pub checksum: Option<String>,
}

/// The `[[package]]` entries of a Cargo.lock (format version 3 or 4). Cargo.lock is a fixed
/// subset of TOML written by Cargo alone: one `key = "value"` per line, arrays only for
/// `dependencies`, which is all this reads past.
pub fn parse_lock(text: &str) -> anyhow::Result<Vec<Locked>> {
    let mut out = Vec::new();
    let mut current: Option<BTreeMap<String, String>> = None;
    let flush = |entry: Option<BTreeMap<String, String>>, out: &mut Vec<Locked>| {
        if let Some(mut fields) = entry {
            let (Some(name), Some(version)) = (fields.remove("name"), fields.remove("version"))
            else {
                bail!("a [[package]] of Cargo.lock lacks its name or version");
            };
            out.push(Locked {
                name,
                version,
                source: fields.remove("source"),
                checksum: fields.remove("checksum"),
            });
        }
        Ok(())
    };
    for line in text.lines() {
        let line = line.trim();
        if line == "[[package]]" {
            flush(current.take(), &mut out)?;
            current = Some(BTreeMap::new());
        } else if line.starts_with('[') {
            flush(current.take(), &mut out)?;
        } else if let (Some(fields), Some((key, value))) =
            (current.as_mut(), line.split_once(" = "))
            && let Some(value) = value.strip_prefix('"').and_then(|v| v.strip_suffix('"'))
        {
            fields.insert(key.to_owned(), value.to_owned());
        }
    }
    flush(current, &mut out)?;
    if out.is_empty() {
        bail!("Cargo.lock holds no [[package]]");
    }
    Ok(out)
}

/// The ids of the packages linked into `root`'s binary: `root` and everything reachable through
/// normal dependencies (proc macros included: they run in the build and shape the code), never
/// dev- or build-dependencies. `metadata` must be filtered to the image's platform
/// (`cargo metadata --filter-platform`), so platform-specific dependencies of other targets are
/// already absent.
pub fn linked_packages(metadata: &Value, root: &str) -> anyhow::Result<BTreeSet<String>> {
    let packages = metadata["packages"]
        .as_array()
        .context("metadata has no packages")?;
    let root_id = packages
        .iter()
        .find(|p| p["name"] == root && p["source"].is_null())
        .and_then(|p| p["id"].as_str())
        .with_context(|| format!("{root} is not a member of this workspace"))?;
    let nodes: BTreeMap<&str, &Value> = metadata["resolve"]["nodes"]
        .as_array()
        .context("metadata has no resolve graph (run without --no-deps)")?
        .iter()
        .filter_map(|n| Some((n["id"].as_str()?, n)))
        .collect();
    let mut seen = BTreeSet::new();
    let mut todo = vec![root_id.to_owned()];
    while let Some(id) = todo.pop() {
        if !seen.insert(id.clone()) {
            continue;
        }
        let node = nodes
            .get(id.as_str())
            .with_context(|| format!("{id} is not in the resolve graph"))?;
        for dep in node["deps"].as_array().into_iter().flatten() {
            let normal = dep["dep_kinds"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|k| k["kind"].is_null());
            if normal && let Some(pkg) = dep["pkg"].as_str() {
                todo.push(pkg.to_owned());
            }
        }
    }
    Ok(seen)
}

/// A package as `cargo tree` names it.
pub type NameVersion = (String, String);

/// Who pulls in whom: (dependent, dependency).
pub type Edges = BTreeSet<(NameVersion, NameVersion)>;

/// The packages and edges of `cargo tree --prefix depth -f '{p}'` output: every line is
/// `<depth><name> v<version>[ (path)][ (*)]`, a child below its parent at depth + 1.
pub fn parse_tree(text: &str) -> anyhow::Result<(BTreeSet<NameVersion>, Edges)> {
    let mut packages = BTreeSet::new();
    let mut edges = BTreeSet::new();
    let mut parents: Vec<NameVersion> = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let digits = line.chars().take_while(char::is_ascii_digit).count();
        let depth: usize = line[..digits]
            .parse()
            .with_context(|| format!("cargo tree line without a depth: {line}"))?;
        let mut words = line[digits..].split_whitespace();
        let (Some(name), Some(version)) =
            (words.next(), words.next().and_then(|v| v.strip_prefix('v')))
        else {
            bail!("cargo tree line without name and version: {line}");
        };
        let package = (name.to_owned(), version.to_owned());
        parents.truncate(depth);
        if let Some(parent) = parents.last() {
            edges.insert((parent.clone(), package.clone()));
        } else if depth != 0 {
            bail!("cargo tree line deeper than its parent: {line}");
        }
        packages.insert(package.clone());
        parents.push(package);
    }
    if packages.is_empty() {
        bail!("cargo tree printed no package");
    }
    Ok((packages, edges))
}

/// A licence field as an SPDX expression: crates.io still holds the pre-SPDX `MIT/Apache-2.0`
/// form, which means `MIT OR Apache-2.0`.
pub fn spdx_expression(license: &str) -> String {
    license
        .split('/')
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" OR ")
}

/// The package URL of a Cargo package (purl spec, type `cargo`).
pub fn purl(name: &str, version: &str) -> String {
    format!("pkg:cargo/{name}@{version}")
}

fn component(package: &Value, locked: Option<&Locked>, kind: &str) -> Value {
    let name = package["name"].as_str().unwrap_or_default();
    let version = package["version"].as_str().unwrap_or_default();
    let mut component = json!({
        "type": kind,
        "bom-ref": purl(name, version),
        "name": name,
        "version": version,
        "purl": purl(name, version),
    });
    if let Some(license) = package["license"].as_str() {
        component["licenses"] = json!([{ "expression": spdx_expression(license) }]);
    }
    if let Some(checksum) = locked.and_then(|l| l.checksum.as_deref()) {
        component["hashes"] = json!([{ "alg": "SHA-256", "content": checksum }]);
    }
    if let Some(repository) = package["repository"].as_str() {
        component["externalReferences"] = json!([{ "type": "vcs", "url": repository }]);
    }
    component
}

/// The CycloneDX document for `root`'s binary from its `cargo tree` (packages and edges),
/// `metadata` (licences, repositories) and `lock` (checksums): `metadata.component` is the
/// binary itself, the components are every other linked package, and `dependencies` records
/// who pulls in whom.
pub fn bom(tree: &str, metadata: &Value, lock: &[Locked], root: &str) -> anyhow::Result<Value> {
    let (linked, edges) = parse_tree(tree)?;
    let packages: BTreeMap<(&str, &str), &Value> = metadata["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| Some(((p["name"].as_str()?, p["version"].as_str()?), p)))
        .collect();
    let locked: BTreeMap<(&str, &str), &Locked> = lock
        .iter()
        .map(|l| ((l.name.as_str(), l.version.as_str()), l))
        .collect();

    let mut root_component = Value::Null;
    let mut components = Vec::new();
    for (name, version) in &linked {
        let key = (name.as_str(), version.as_str());
        let package = packages
            .get(&key)
            .with_context(|| format!("{name}@{version} is linked but cargo metadata lacks it"))?;
        let Some(entry) = locked.get(&key).copied() else {
            bail!("{name}@{version} is linked but not in Cargo.lock: run cargo with --locked");
        };
        if name == root && package["source"].is_null() {
            root_component = component(package, Some(entry), "application");
        } else {
            components.push(component(package, Some(entry), "library"));
        }
    }
    if root_component.is_null() {
        bail!("{root} is not the root of the tree");
    }
    components.sort_by(|a, b| a["bom-ref"].as_str().cmp(&b["bom-ref"].as_str()));

    let mut depends_on: BTreeMap<String, BTreeSet<String>> = linked
        .iter()
        .map(|(n, v)| (purl(n, v), BTreeSet::new()))
        .collect();
    for ((from_name, from_version), (to_name, to_version)) in &edges {
        depends_on
            .entry(purl(from_name, from_version))
            .or_default()
            .insert(purl(to_name, to_version));
    }
    let dependencies: Vec<Value> = depends_on
        .into_iter()
        .map(|(from, to)| json!({ "ref": from, "dependsOn": to }))
        .collect();

    Ok(json!({
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "version": 1,
        "metadata": {
            "component": root_component,
            "tools": { "components": [{
                "type": "application",
                "name": "sbom",
                "version": env!("CARGO_PKG_VERSION"),
                "description": "tools/sbom of this repository",
            }]},
        },
        "components": components,
        "dependencies": dependencies,
    }))
}

/// The SBOM of `package`'s binary in the workspace at `root`, built for `target`: runs
/// `cargo metadata --locked --filter-platform` and reads the workspace's Cargo.lock.
pub fn from_workspace(
    root: &std::path::Path,
    target: &str,
    package: &str,
) -> anyhow::Result<Value> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = std::process::Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--filter-platform",
            target,
        ])
        .arg("--manifest-path")
        .arg(root.join("Cargo.toml"))
        .output()
        .context("running cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let metadata: Value = serde_json::from_slice(&out.stdout).context("parsing cargo metadata")?;
    let tree = cargo_tree(root, target, package)?;
    let lock_path = root.join("Cargo.lock");
    let lock = std::fs::read_to_string(&lock_path)
        .with_context(|| format!("reading {}", lock_path.display()))?;
    bom(&tree, &metadata, &parse_lock(&lock)?, package)
}

/// `cargo tree` of `package`'s normal dependencies for `target`, with depths.
pub fn cargo_tree(root: &std::path::Path, target: &str, package: &str) -> anyhow::Result<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = std::process::Command::new(cargo)
        .args([
            "tree", "--locked", "-p", package, "-e", "normal", "--target", target,
        ])
        .args(["--prefix", "depth", "-f", "{p}"])
        .arg("--manifest-path")
        .arg(root.join("Cargo.toml"))
        .output()
        .context("running cargo tree")?;
    if !out.status.success() {
        bail!(
            "cargo tree failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8(out.stdout).context("cargo tree printed no UTF-8")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_slash_licences_become_spdx_or_expressions() {
        assert_eq!(spdx_expression("MIT/Apache-2.0"), "MIT OR Apache-2.0");
        assert_eq!(spdx_expression("Unlicense OR MIT"), "Unlicense OR MIT");
    }

    #[test]
    fn lock_entries_keep_source_and_checksum_and_skip_dependency_arrays() {
        let lock = "version = 4\n\n[[package]]\nname = \"a\"\nversion = \"1.0.0\"\nsource = \"registry+https://github.com/rust-lang/crates.io-index\"\nchecksum = \"abc\"\ndependencies = [\n \"b\",\n]\n\n[[package]]\nname = \"b\"\nversion = \"0.1.0\"\n";
        let parsed = parse_lock(lock).unwrap();
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed[0].checksum.as_deref(), Some("abc"));
        assert_eq!(parsed[1].source, None);
        assert!(parse_lock("version = 4\n").is_err());
    }

    fn dep(pkg: &str, kind: Option<&str>) -> Value {
        json!({ "pkg": pkg, "dep_kinds": [{ "kind": kind, "target": null }] })
    }

    #[test]
    fn tree_lines_give_packages_and_who_pulls_them_in() {
        let tree = "0root v1.0.0 (/src)\n1a v0.1.0\n2c v3.0.0\n1b v0.2.0\n2c v3.0.0 (*)\n";
        let (packages, edges) = parse_tree(tree).unwrap();
        assert_eq!(packages.len(), 4);
        let nv = |n: &str, v: &str| (n.to_owned(), v.to_owned());
        assert!(edges.contains(&(nv("b", "0.2.0"), nv("c", "3.0.0"))));
        assert!(edges.contains(&(nv("root", "1.0.0"), nv("a", "0.1.0"))));
        assert!(!edges.contains(&(nv("a", "0.1.0"), nv("b", "0.2.0"))));
        assert!(parse_tree("2deep v1.0.0\n").is_err());
    }

    #[test]
    fn only_normal_dependencies_are_linked() {
        let metadata = json!({
            "packages": [
                { "id": "root", "name": "root", "version": "1.0.0", "source": null },
                { "id": "lib", "name": "lib", "version": "1.0.0", "source": "registry" },
                { "id": "dev", "name": "dev", "version": "1.0.0", "source": "registry" },
                { "id": "build", "name": "build", "version": "1.0.0", "source": "registry" },
                { "id": "deep", "name": "deep", "version": "1.0.0", "source": "registry" },
            ],
            "resolve": { "nodes": [
                { "id": "root", "deps": [dep("lib", None), dep("dev", Some("dev")), dep("build", Some("build"))] },
                { "id": "lib", "deps": [dep("deep", None)] },
                { "id": "dev", "deps": [] }, { "id": "build", "deps": [] }, { "id": "deep", "deps": [] },
            ]},
        });
        let linked = linked_packages(&metadata, "root").unwrap();
        assert_eq!(
            linked.into_iter().collect::<Vec<_>>(),
            ["deep", "lib", "root"]
        );
    }
}
