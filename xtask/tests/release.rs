//! What a release carries, checked against one another: one version across the Cargo
//! workspace, the Helm chart, the OLM bundle's CSV, the operator image (its tag, the
//! Containerfile) and the CHANGELOG; one operator image reference across the chart, the CSV
//! (Deployment, `containerImage`, `relatedImages`) and docs/install.md; the Containerfile
//! building the layout `make image` builds (image/image.env); the chart's install-time
//! Kubernetes check naming the operator's minimum; the Apache-2.0 LICENSE the manifests declare.
//! The image itself is checked by `make image-check` (scripts/image-check.sh).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use gpu_operator::api::MIN_KUBERNETES_VERSION;
use serde_json::Value;
use xtask::bundle::CSV_FILE;

/// The operator's version (the workspace's, which this crate shares).
const VERSION: &str = gpu_operator::crd_upgrade::OPERATOR_VERSION;

fn repo_file(path: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn yaml(path: &str) -> Value {
    serde_yaml_ng::from_str(&repo_file(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn csv() -> Value {
    yaml(&format!("bundle/{CSV_FILE}"))
}

/// KEY=VALUE lines of a shell file (comments and blank lines skipped, one level of quotes off).
fn env_file(path: &str) -> BTreeMap<String, String> {
    repo_file(path)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l
                .split_once('=')
                .unwrap_or_else(|| panic!("{path}: not KEY=VALUE: {l}"));
            (k.to_owned(), v.trim_matches('"').to_owned())
        })
        .collect()
}

fn image_env() -> BTreeMap<String, String> {
    env_file("image/image.env")
}

fn image_env_var(name: &str) -> String {
    image_env()
        .remove(name)
        .unwrap_or_else(|| panic!("image/image.env has no {name}"))
}

/// The operator image reference the committed bundle was generated with:
/// `<scripts/bundle-values.yaml operator.repository>/<image name>:<version>`.
fn bundle_image() -> String {
    let values = yaml("scripts/bundle-values.yaml");
    let repository = values["operator"]["repository"]
        .as_str()
        .expect("scripts/bundle-values.yaml sets no operator.repository");
    assert!(
        values["operator"].get("version").is_none() && values["operator"].get("image").is_none(),
        "scripts/bundle-values.yaml must not set operator.image or operator.version: the bundle names the release's image (the chart's image name and appVersion)"
    );
    format!("{repository}/{}:{VERSION}", image_env_var("IMAGE_NAME"))
}

#[test]
fn one_version_across_cargo_chart_bundle_image_and_changelog() {
    let chart = yaml("charts/gpu-operator/Chart.yaml");
    assert_eq!(
        chart["version"], VERSION,
        "charts/gpu-operator/Chart.yaml version differs from the workspace's version in Cargo.toml"
    );
    assert_eq!(
        chart["appVersion"], VERSION,
        "charts/gpu-operator/Chart.yaml appVersion (the image tag) differs from Cargo.toml's version"
    );

    let csv = csv();
    assert_eq!(
        csv["spec"]["version"], VERSION,
        "the CSV's spec.version: run `cargo xtask generate`"
    );
    assert_eq!(
        csv["metadata"]["name"],
        format!("gpu-operator.v{VERSION}"),
        "the CSV's name: run `cargo xtask generate`"
    );
    let image = csv["metadata"]["annotations"]["containerImage"]
        .as_str()
        .unwrap();
    assert!(
        image.ends_with(&format!(":{VERSION}")),
        "the CSV's containerImage {image} is not tagged {VERSION}: run `cargo xtask generate`"
    );

    // The Containerfile's version label defaults to the release; `make image` takes it from
    // the binary, whose version is Cargo's.
    let containerfile = repo_file("Containerfile");
    assert!(
        containerfile
            .lines()
            .any(|l| l.trim() == format!("ARG VERSION={VERSION}")),
        "Containerfile: ARG VERSION is not {VERSION}"
    );

    let changelog = repo_file("CHANGELOG.md");
    assert!(
        changelog
            .lines()
            .any(|l| l.starts_with(&format!("## {VERSION} ")) || l == format!("## {VERSION}")),
        "CHANGELOG.md has no section `## {VERSION}` for this release"
    );
}

#[test]
fn one_operator_image_reference_across_chart_bundle_and_docs() {
    let expected = bundle_image();

    // The chart's image name is the image's; its tag defaults to the appVersion (checked above).
    let values = yaml("charts/gpu-operator/values.yaml");
    assert_eq!(
        values["operator"]["image"],
        image_env_var("IMAGE_NAME"),
        "charts/gpu-operator/values.yaml operator.image differs from image/image.env IMAGE_NAME"
    );
    assert_eq!(
        values["operator"]["repository"], "",
        "the chart of a checkout must have no default registry (scripts/release.sh sets it in the published chart): installing without one fails with a message instead"
    );

    // The CSV: its Deployment, containerImage and relatedImages.
    let csv = csv();
    assert_eq!(
        csv["metadata"]["annotations"]["containerImage"], expected,
        "the CSV's containerImage: run `cargo xtask generate`"
    );
    let deployment_images: Vec<&str> = csv["spec"]["install"]["spec"]["deployments"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|d| {
            d["spec"]["template"]["spec"]["containers"]
                .as_array()
                .unwrap()
        })
        .filter_map(|c| c["image"].as_str())
        .collect();
    assert_eq!(
        deployment_images,
        [expected.as_str()],
        "the CSV Deployment's image: run `cargo xtask generate`"
    );
    let related: Vec<&Value> = csv["spec"]["relatedImages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["name"] == "gpu-operator")
        .collect();
    assert_eq!(related.len(), 1, "relatedImages has no single gpu-operator");
    assert_eq!(
        related[0]["image"], expected,
        "relatedImages gpu-operator: run `cargo xtask generate`"
    );

    // docs/install.md names the same registry and tag wherever it names the image.
    let docs = repo_file("docs/install.md");
    let name = format!("/{}:", image_env_var("IMAGE_NAME"));
    let mentions: Vec<&str> = docs
        .split(|c: char| c.is_whitespace() || c == '`' || c == '"')
        .filter(|w| w.contains(&name))
        .collect();
    assert!(
        mentions.iter().any(|m| m.ends_with(&expected)),
        "docs/install.md never names {expected}"
    );
    for mention in mentions {
        let reference = mention.trim_start_matches("docker://");
        assert_eq!(
            reference, expected,
            "docs/install.md names the operator image as {mention}, the bundle as {expected}"
        );
    }
}

/// The instructions of the Containerfile's last stage, as (INSTRUCTION, arguments) with line
/// continuations joined.
fn final_stage() -> Vec<(String, String)> {
    let text = repo_file("Containerfile").replace("\\\n", " ");
    let instructions: Vec<(String, String)> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (instruction, args) = l.split_once(' ').unwrap_or((l, ""));
            (instruction.to_uppercase(), args.trim().to_owned())
        })
        .collect();
    let last_from = instructions
        .iter()
        .rposition(|(i, _)| i == "FROM")
        .expect("Containerfile has no FROM");
    instructions[last_from..].to_vec()
}

/// `KEY=VALUE KEY="VALUE WITH SPACES" ...` as ENV and LABEL write them.
fn pairs(args: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = args.trim();
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=').expect("KEY=VALUE");
        let (value, after) = match after.strip_prefix('"') {
            Some(quoted) => {
                let end = quoted.find('"').expect("closing quote");
                (&quoted[..end], &quoted[end + 1..])
            }
            None => after.split_once(' ').unwrap_or((after, "")),
        };
        out.insert(key.trim().to_owned(), value.to_owned());
        rest = after.trim();
    }
    out
}

#[test]
fn every_containerfile_base_but_scratch_is_pinned_by_digest() {
    let text = repo_file("Containerfile");
    let bases: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter_map(|l| l.strip_prefix("FROM "))
        .filter_map(|args| args.split_whitespace().find(|w| !w.starts_with("--")))
        .collect();
    assert!(!bases.is_empty(), "Containerfile has no FROM");
    for base in bases {
        if base == "scratch" {
            continue;
        }
        let digest = base
            .split_once("@sha256:")
            .map(|(_, d)| d)
            .unwrap_or_default();
        assert!(
            digest.len() == 64 && digest.chars().all(|c| c.is_ascii_hexdigit()),
            "FROM {base}: pin the base by digest (NAME:TAG@sha256:...), a tag can move"
        );
    }
}

#[test]
fn the_containerfile_builds_the_layout_make_image_builds() {
    let stage = final_stage();
    let all = |instruction: &str| -> Vec<String> {
        stage
            .iter()
            .filter(|(i, _)| i == instruction)
            .map(|(_, a)| a.clone())
            .collect()
    };
    assert_eq!(
        all("FROM"),
        ["scratch"],
        "the image has no base (no shell, nothing but its files)"
    );
    assert_eq!(
        all("COPY"),
        ["--from=build /rootfs/ /"],
        "the image's files come only from scripts/image-rootfs.sh, as in make image"
    );
    assert!(
        repo_file("Containerfile").contains("RUN scripts/image-rootfs.sh /rootfs"),
        "the build stage must write the file system with scripts/image-rootfs.sh"
    );
    assert!(
        repo_file("scripts/image.sh").contains("scripts/image-rootfs.sh"),
        "make image must take its files from scripts/image-rootfs.sh too"
    );

    let env = image_env();
    assert_eq!(all("USER"), [env["IMAGE_USER"].clone()]);
    assert_eq!(
        all("ENTRYPOINT"),
        [format!("[\"{}\"]", env["IMAGE_BINARY"])]
    );
    assert!(all("CMD").is_empty(), "make image sets no CMD");
    assert_eq!(all("WORKDIR"), ["/"]);

    let envs: BTreeMap<String, String> = all("ENV").iter().flat_map(|a| pairs(a)).collect();
    assert_eq!(
        envs,
        BTreeMap::from([
            ("PATH".to_owned(), env["IMAGE_ENV_PATH"].clone()),
            ("SSL_CERT_FILE".to_owned(), env["IMAGE_CA_BUNDLE"].clone()),
        ])
    );
    let image_sh = repo_file("scripts/image.sh");
    for flag in [
        "--env \"PATH=$IMAGE_ENV_PATH\"",
        "--env \"SSL_CERT_FILE=$IMAGE_CA_BUNDLE\"",
    ] {
        assert!(image_sh.contains(flag), "scripts/image.sh lacks {flag}");
    }

    let labels: BTreeMap<String, String> = all("LABEL").iter().flat_map(|a| pairs(a)).collect();
    let oci = |name: &str| format!("org.opencontainers.image.{name}");
    let expected = BTreeMap::from([
        (oci("title"), env["IMAGE_TITLE"].clone()),
        (oci("description"), env["IMAGE_DESCRIPTION"].clone()),
        (oci("licenses"), env["IMAGE_LICENSES"].clone()),
        (oci("version"), "${VERSION}".to_owned()),
        (oci("revision"), "${REVISION}".to_owned()),
        (oci("created"), "${CREATED}".to_owned()),
    ]);
    assert_eq!(labels, expected, "the Containerfile's labels");
    for key in expected.keys() {
        assert!(
            image_sh.contains(&format!("--label \"{key}=")),
            "scripts/image.sh does not set {key}"
        );
    }
    // The operator's package description, read from its manifest (this crate's is xtask's).
    let operator_description = repo_file("operator/Cargo.toml")
        .lines()
        .find_map(|l| l.strip_prefix("description = "))
        .map(|d| d.trim_matches('"').to_owned())
        .expect("operator/Cargo.toml has no description");
    assert_eq!(
        env["IMAGE_DESCRIPTION"], operator_description,
        "image/image.env IMAGE_DESCRIPTION differs from operator/Cargo.toml's description"
    );
}

#[test]
fn the_charts_install_time_kubernetes_check_names_the_operators_minimum() {
    let helpers = repo_file("charts/gpu-operator/templates/_helpers.tpl");
    assert!(
        helpers.contains(&format!(
            "{{{{- define \"gpu-operator.minKubernetesVersion\" -}}}}{MIN_KUBERNETES_VERSION}{{{{- end -}}}}"
        )),
        "templates/_helpers.tpl gpu-operator.minKubernetesVersion differs from MIN_KUBERNETES_VERSION ({MIN_KUBERNETES_VERSION})"
    );
    let chart = yaml("charts/gpu-operator/Chart.yaml");
    assert!(
        chart.get("kubeVersion").is_none(),
        "Chart.yaml kubeVersion breaks `helm template` and `helm lint` without --kube-version: the check belongs to install time"
    );
}

#[test]
fn the_license_is_the_apache_2_0_text_the_manifests_declare() {
    let license = repo_file("LICENSE");
    assert!(
        license.trim_start().starts_with("Apache License")
            && license.contains("Version 2.0, January 2004")
            && license.contains("TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION")
            && license.contains("END OF TERMS AND CONDITIONS")
            && license.contains("APPENDIX: How to apply the Apache License to your work."),
        "LICENSE is not the full Apache License 2.0 text"
    );
    assert_eq!(env!("CARGO_PKG_LICENSE"), "Apache-2.0");
    assert_eq!(image_env_var("IMAGE_LICENSES"), "Apache-2.0");
}
