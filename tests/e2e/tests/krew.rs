//! The kubectl plugin as users install it: `scripts/krew-plugin.sh` packages the operator binary
//! as krew's `gpu` plugin, krew (built from its Go module by tests/cluster/build.sh) installs it
//! from the archive and manifest, and `kubectl gpu doctor` through kubectl's plugin lookup gives
//! what the binary's own `doctor` gives against the same cluster.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

use e2e::session;
use e2e::tools::{harness_tool, repo_root};

/// Stdout of `command`, and whether it ran at all (the doctor exits non-zero on faults).
fn stdout(mut command: Command) -> String {
    let output = command.output().unwrap();
    assert!(
        output.status.code().is_some(),
        "{:?} was killed: {}",
        command,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn run_ok(command: &mut Command) {
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{command:?}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test]
async fn krew_installs_the_packaged_plugin_and_kubectl_gpu_doctor_works() {
    let Some(krew) = harness_tool("krew") else {
        return;
    };
    // No policy: the doctor has a fault to name.
    let Some(_prepared) = session::builder().prepare().await else {
        return;
    };
    let binary = e2e::operator::binary().unwrap();
    let dir = std::env::temp_dir().join(format!("gpu-operator-krew-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dist = dir.join("dist");
    run_ok(
        Command::new(repo_root().join("scripts/krew-plugin.sh"))
            .arg(&binary)
            .arg("v0.1.0")
            .arg(format!("file://{}", dist.display()))
            .arg(&dist),
    );
    let archive = std::fs::read_dir(&dist)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with(".tar.gz"))
        .unwrap();

    let krew_root = dir.join("krew");
    run_ok(
        Command::new(&krew)
            .env("KREW_ROOT", &krew_root)
            .arg("install")
            .arg(format!("--manifest={}", dist.join("gpu.yaml").display()))
            .arg(format!("--archive={}", archive.display())),
    );
    let installed = krew_root.join("bin/kubectl-gpu");
    assert!(Path::new(&installed).exists(), "krew linked no kubectl-gpu");

    // kubectl finds the plugin on PATH, as with krew's bin folder added to it.
    let path = format!(
        "{}:{}",
        krew_root.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut kubectl = e2e::cluster::kubectl();
    kubectl.env("PATH", path).args(["gpu", "doctor"]);
    let through_kubectl = stdout(kubectl);
    let mut direct = Command::new(&binary);
    direct.arg("doctor");
    let direct = stdout(direct);
    assert!(
        through_kubectl.contains("no-cluster-policy"),
        "{through_kubectl}"
    );
    assert_eq!(through_kubectl, direct);
    std::fs::remove_dir_all(&dir).unwrap();
}
