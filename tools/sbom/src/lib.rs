//! The software bill of materials of the operator image (CycloneDX 1.5, JSON): every package
//! compiled into the binary, as Cargo resolved it for the image's target, with its licence, its
//! package URL and the SHA-256 that Cargo.lock pins.
//!
//! Pure functions over `cargo metadata` output and Cargo.lock's text; `main.rs` runs Cargo.
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

/// The CycloneDX document for `root`'s binary: `metadata.component` is the binary itself, the
/// components are every other linked package, and `dependencies` records who pulls in whom.
pub fn bom(metadata: &Value, lock: &[Locked], root: &str) -> anyhow::Result<Value> {
    let linked = linked_packages(metadata, root)?;
    let packages: BTreeMap<&str, &Value> = metadata["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| Some((p["id"].as_str()?, p)))
        .collect();
    let locked: BTreeMap<(&str, &str), &Locked> = lock
        .iter()
        .map(|l| ((l.name.as_str(), l.version.as_str()), l))
        .collect();
    let reference = |id: &str| -> anyhow::Result<String> {
        let p = packages
            .get(id)
            .with_context(|| format!("{id} has no package entry"))?;
        Ok(purl(
            p["name"].as_str().unwrap_or_default(),
            p["version"].as_str().unwrap_or_default(),
        ))
    };

    let mut root_component = Value::Null;
    let mut components = Vec::new();
    for id in &linked {
        let package = packages[id.as_str()];
        let key = (
            package["name"].as_str().unwrap_or_default(),
            package["version"].as_str().unwrap_or_default(),
        );
        let entry = locked.get(&key).copied();
        if entry.is_none() {
            bail!(
                "{}@{} is linked but not in Cargo.lock: run cargo with --locked",
                key.0,
                key.1
            );
        }
        if package["name"] == root && package["source"].is_null() {
            root_component = component(package, entry, "application");
        } else {
            components.push(component(package, entry, "library"));
        }
    }
    components.sort_by(|a, b| a["bom-ref"].as_str().cmp(&b["bom-ref"].as_str()));

    let mut dependencies = Vec::new();
    for node in metadata["resolve"]["nodes"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let Some(id) = node["id"].as_str().filter(|id| linked.contains(*id)) else {
            continue;
        };
        let mut depends_on: Vec<String> = node["deps"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|d| {
                d["dep_kinds"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|k| k["kind"].is_null())
            })
            .filter_map(|d| d["pkg"].as_str())
            .map(reference)
            .collect::<anyhow::Result<_>>()?;
        depends_on.sort();
        depends_on.dedup();
        dependencies.push(json!({ "ref": reference(id)?, "dependsOn": depends_on }));
    }
    dependencies.sort_by(|a, b| a["ref"].as_str().cmp(&b["ref"].as_str()));

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
    let lock_path = root.join("Cargo.lock");
    let lock = std::fs::read_to_string(&lock_path)
        .with_context(|| format!("reading {}", lock_path.display()))?;
    bom(&metadata, &parse_lock(&lock)?, package)
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
