//! Golden files: what `gpu-operator render` prints for every example policy (with the sample
//! ConfigMaps of `examples/configmaps/` and fixed facts), and what `gpu-operator rbac` prints,
//! are kept under `operator/tests/golden/`. Any difference fails; after an intended change,
//! regenerate them with `UPDATE_GOLDEN=1 cargo test -p gpu-operator golden` and review the diff.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use clap::Parser;
use gpu_operator::cli::Cli;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn yaml_files(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with(prefix) && name.ends_with(".yaml")
        })
        .collect();
    files.sort();
    files
}

/// Runs the CLI exactly as a user would and returns what it printed.
fn run(args: &[String]) -> String {
    let cli = Cli::try_parse_from(args).unwrap();
    let mut out = Vec::new();
    cli.run(&mut out).unwrap();
    String::from_utf8(out).unwrap()
}

/// (golden file name, command line) for every case.
fn cases() -> Vec<(String, Vec<String>)> {
    let config_maps: Vec<String> = yaml_files(&repo().join("examples/configmaps"), "")
        .into_iter()
        .flat_map(|p| ["--config-map".to_owned(), p.display().to_string()])
        .collect();
    let mut cases = Vec::new();
    for example in yaml_files(&repo().join("examples"), "clusterpolicy-") {
        let stem = example.file_stem().unwrap().to_string_lossy().into_owned();
        let mut args: Vec<String> = ["gpu-operator", "render", "-f"]
            .into_iter()
            .map(str::to_owned)
            .collect();
        args.push(example.display().to_string());
        args.extend(["--os-tag", "ubuntu22.04", "--namespace", "gpu-operator"].map(str::to_owned));
        args.extend(config_maps.clone());
        // The GPU nodes a policy's render depends on, where its example has them.
        let nodes = repo().join("examples/nodes").join(format!("{stem}.yaml"));
        if nodes.exists() {
            args.extend(["--nodes".to_owned(), nodes.display().to_string()]);
        }
        // OpenShift's Driver Toolkit ImageStream, where its example has one: the example is
        // then rendered for OpenShift (RHCOS nodes, CRI-O).
        let stream = repo()
            .join("examples/imagestreams")
            .join(format!("{stem}.yaml"));
        if stream.exists() {
            for arg in args.iter_mut() {
                if arg == "ubuntu22.04" {
                    *arg = "rhcos4.14".to_owned();
                }
            }
            args.extend([
                "--openshift".to_owned(),
                "--driver-toolkit-imagestream".to_owned(),
                stream.display().to_string(),
            ]);
        }
        cases.push((format!("{stem}.yaml"), args.clone()));
        if stem == "clusterpolicy-maximal" {
            // OpenShift with the Prometheus Operator: SCCs, CRI-O, ServiceMonitors.
            let mut openshift = args.clone();
            for (i, arg) in openshift.iter_mut().enumerate() {
                if i > 0 && arg == "ubuntu22.04" {
                    *arg = "rhcos4.16".to_owned();
                }
            }
            openshift.extend(["--openshift", "--service-monitor"].map(str::to_owned));
            cases.push((format!("{stem}.openshift.yaml"), openshift));
        }
    }
    // The default policy on fleets of each container runtime flavour (nodeInfo in the node
    // files): the toolkit DaemonSets per flavour.
    let default = repo().join("examples/clusterpolicy-default.yaml");
    for nodes in yaml_files(&repo().join("examples/nodes"), "runtime-") {
        let stem = nodes.file_stem().unwrap().to_string_lossy().into_owned();
        let mut args: Vec<String> = ["gpu-operator", "render", "-f"]
            .into_iter()
            .map(str::to_owned)
            .collect();
        args.push(default.display().to_string());
        args.extend(["--os-tag", "ubuntu22.04", "--namespace", "gpu-operator"].map(str::to_owned));
        args.extend(["--nodes".to_owned(), nodes.display().to_string()]);
        cases.push((format!("clusterpolicy-default.{stem}.yaml"), args));
    }
    cases.push((
        "rbac.yaml".to_owned(),
        ["gpu-operator", "rbac", "--namespace", "gpu-operator"]
            .map(str::to_owned)
            .to_vec(),
    ));
    cases
}

#[test]
fn golden_files_match_render_and_rbac_output() {
    let update = std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1");
    let cases = cases();
    assert!(cases.len() >= 8, "examples not found");
    let mut stale = Vec::new();
    for (name, args) in &cases {
        let printed = run(args);
        let path = golden_dir().join(name);
        if update {
            std::fs::write(&path, &printed).unwrap();
            continue;
        }
        let golden = std::fs::read_to_string(&path).unwrap_or_default();
        if golden != printed {
            let line = golden
                .lines()
                .zip(printed.lines())
                .position(|(a, b)| a != b)
                .unwrap_or_else(|| golden.lines().count().min(printed.lines().count()));
            stale.push(format!(
                "{name} differs from the output at line {}: golden {:?}, now {:?}",
                line + 1,
                golden.lines().nth(line),
                printed.lines().nth(line)
            ));
        }
    }
    let expected: Vec<&String> = cases.iter().map(|(n, _)| n).collect();
    for file in yaml_files(&golden_dir(), "") {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        if !expected.contains(&&name) {
            if update {
                std::fs::remove_file(&file).unwrap();
            } else {
                stale.push(format!("{name} belongs to no example"));
            }
        }
    }
    assert!(
        stale.is_empty(),
        "golden files are out of date (regenerate with `UPDATE_GOLDEN=1 cargo test -p gpu-operator golden` and review the diff):\n{}",
        stale.join("\n")
    );
}
