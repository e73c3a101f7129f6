//! The takeover plan on NVIDIA's own render: our render of the ClusterPolicy NVIDIA's chart
//! writes with its defaults, applied over the DaemonSets NVIDIA's v26.7 operator creates from it
//! (`tests/fixtures/nvidia-v26.7-render/`), field by field as server-side apply merges them.
//! The plan is kept in `tests/golden/takeover-plan.txt`: each field that differs is a pod
//! restart at takeover, so the file shrinks as our render comes closer to NVIDIA's. Regenerate
//! it with `UPDATE_GOLDEN=1 cargo test -p gpu-operator --test takeover` and review the diff.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use clap::Parser;
use gpu_operator::cli::Cli;
use gpu_operator::takeover::{self, Outcome};
use k8s_openapi::api::apps::v1::DaemonSet;
use serde::Deserialize;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nvidia-v26.7-render")
}

/// Our DaemonSets for NVIDIA's chart policy, as `gpu-operator render` prints them.
fn ours() -> Vec<DaemonSet> {
    let policy = fixtures().join("clusterpolicy.yaml");
    let args = [
        "gpu-operator",
        "render",
        "-f",
        &policy.display().to_string(),
        "--os-tag",
        "ubuntu22.04",
        "--namespace",
        "gpu-operator",
    ];
    let cli = Cli::try_parse_from(args).unwrap();
    let mut out = Vec::new();
    cli.run(&mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .filter_map(|doc| {
            let value = serde_yaml_ng::Value::deserialize(doc).ok()?;
            (value.get("kind")?.as_str()? == "DaemonSet")
                .then(|| serde_yaml_ng::from_value(value).unwrap())
        })
        .collect()
}

fn nvidias() -> Vec<DaemonSet> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "yaml") && !p.ends_with("clusterpolicy.yaml")
        })
        .collect();
    files.sort();
    files
        .iter()
        .map(|p| serde_yaml_ng::from_str(&std::fs::read_to_string(p).unwrap()).unwrap())
        .collect()
}

#[test]
fn the_takeover_plan_on_nvidias_default_render_is_the_recorded_one() {
    let plan = takeover::plan(&ours(), &nvidias());
    // Every operand NVIDIA's defaults run has its counterpart here.
    let not_rendered: Vec<&str> = plan
        .iter()
        .filter(|p| p.outcome == Outcome::NotRendered)
        .map(|p| p.name.as_str())
        .collect();
    assert!(not_rendered.is_empty(), "{not_rendered:?}");
    let text = takeover::describe_plan(&plan);
    let golden = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/takeover-plan.txt");
    if std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1") {
        std::fs::write(&golden, &text).unwrap();
    }
    assert_eq!(
        text,
        std::fs::read_to_string(&golden).unwrap_or_default(),
        "the takeover plan changed: regenerate tests/golden/takeover-plan.txt \
         (UPDATE_GOLDEN=1) and review the diff"
    );
}
