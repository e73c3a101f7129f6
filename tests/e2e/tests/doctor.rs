//! `gpu-operator doctor` against the harness (docs/doctor.md): each fault the harness can make
//! is named with its fix and makes the exit code non-zero; a healthy cluster exits 0 and its
//! table equals `testdata/doctor-healthy.txt` (regenerate with `UPDATE_GOLDEN=1`). It runs as
//! the user (the admin kubeconfig), as the operator (its ServiceAccount's kubeconfig), and as
//! the kubectl plugin `kubectl gpu doctor` (a `kubectl-gpu` link on PATH), which finds a pod in
//! the kubeconfig context's namespace without `-n`. `-o json` and `-o yaml` carry the table's
//! facts and the faults; faults exit 1, a doctor that cannot run (no kubeconfig, an unknown
//! context, a pod that does not exist) exits 2 and prints no report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use e2e::chaos::CrashLoop;
use e2e::cluster::unique_name;
use e2e::nodes::{self, FakeNode, GpuModel};
use e2e::session::EPHEMERAL;
use e2e::session::{self, Setup, TIMEOUT};
use e2e::wait;
use gpu_operator::api::State;
use gpu_operator::cli::doctor::{
    ALLOCATABLE_ZERO, DRIVER_CRASH_LOOP, MIG_STRATEGY_MISMATCH, MISSING_TOLERATION,
    NFD_WORKER_KEPT_OFF, NO_GPU_NODE, NODE_AFFINITY_MISMATCH, RUNTIME_CLASS_MISSING,
    VALIDATOR_NOT_READY,
};
use gpu_operator::cli::doctor::{EXIT_COULD_NOT_RUN, EXIT_FAULTS};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::node::v1::RuntimeClass;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

/// What one doctor run printed and how it exited.
struct Report {
    ok: bool,
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Report {
    /// A run that could not diagnose: exit 2, no report, the reason on stderr.
    fn assert_could_not_run(&self, mentions: &str) {
        assert_eq!(
            self.code,
            Some(i32::from(EXIT_COULD_NOT_RUN)),
            "{}{}",
            self.stdout,
            self.stderr
        );
        assert_eq!(self.stdout, "");
        assert!(
            self.stderr.contains(mentions),
            "{mentions} not in {}",
            self.stderr
        );
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}{}", self.stdout, self.stderr))
    }

    fn assert_fault(&self, check: &str, mentions: &str) {
        let line = format!("FAULT {check}: ");
        assert!(
            self.code == Some(i32::from(EXIT_FAULTS))
                && self
                    .stdout
                    .lines()
                    .any(|l| l.starts_with(&line) && l.contains(mentions)),
            "expected {check} mentioning {mentions}, exit {:?}:\n{}{}",
            self.code,
            self.stdout,
            self.stderr
        );
        // Every finding carries its fix on the next line.
        let fixes = self
            .stdout
            .lines()
            .filter(|l| l.starts_with("  fix: "))
            .count();
        let faults = self
            .stdout
            .lines()
            .filter(|l| l.starts_with("FAULT "))
            .count();
        assert_eq!(fixes, faults, "{}", self.stdout);
    }
}

fn run(mut command: Command, args: &[&str]) -> Report {
    let output = command.args(args).output().unwrap();
    Report {
        ok: output.status.success(),
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// The doctor with the user's (admin) kubeconfig from the environment.
fn doctor(args: &[&str]) -> Report {
    let mut command = Command::new(e2e::operator::binary().unwrap());
    command.arg("doctor");
    run(command, args)
}

fn golden_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/doctor-healthy.txt")
}

/// Sets (or with `None` removes) `nvidia.com/gpu` in every GPU node's status, as the device
/// plugin would advertise it (kwok has no device plugin).
async fn advertise_gpus(admin: &Client, on: bool) {
    let nodes: Api<Node> = Api::all(admin.clone());
    for node in nodes
        .list(&ListParams::default().labels("nvidia.com/gpu.present=true"))
        .await
        .unwrap()
        .items
    {
        let count = node.labels().get("nvidia.com/gpu.count").cloned();
        let value = if on { json!(count) } else { json!(null) };
        let patch = json!({"status": {"capacity": {"nvidia.com/gpu": value}, "allocatable": {"nvidia.com/gpu": value}}});
        nodes
            .patch_status(
                &node.name_any(),
                &PatchParams::default(),
                &Patch::Merge(patch),
            )
            .await
            .unwrap();
    }
}

async fn pod(admin: &Client, namespace: &str, name: &str, spec: serde_json::Value) {
    Api::<Pod>::namespaced(admin.clone(), namespace)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap(),
        )
        .await
        .unwrap();
}

fn gpu_container(resource: &str) -> serde_json::Value {
    json!([{"name": "c", "image": "cuda", "resources": {"limits": {resource: "1"}}}])
}

fn tolerate_all() -> serde_json::Value {
    json!([{"operator": "Exists"}])
}

async fn until_healthy(setup: &Setup) -> Report {
    wait::until(TIMEOUT, "doctor exits 0", || async {
        let report = doctor(&[]);
        Ok(if report.ok {
            Ok(report)
        } else {
            Err(report.stdout)
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", setup.operator.log_text()))
}

#[tokio::test]
async fn doctor_names_each_fault_with_its_fix_and_passes_a_healthy_cluster() {
    let Some(mut setup) = session::start(json!({}), &[]).await else {
        return;
    };
    let admin = setup.admin.clone();
    // A failed run may have left the GPUs advertised.
    advertise_gpus(&admin, false).await;
    setup.await_state(State::Ready, "policy ready").await;
    let namespace = unique_name("doctor");
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": namespace}})).unwrap(),
        )
        .await
        .unwrap();

    // Allocatable 0: kwok has no device plugin until we play it.
    doctor(&[]).assert_fault(
        ALLOCATABLE_ZERO,
        "gpu-t4-0 has no allocatable nvidia.com/gpu",
    );
    pod(
        &admin,
        &namespace,
        "needs-gpu",
        json!({
        "nodeSelector": {"kubernetes.io/hostname": "gpu-t4-0"},
        "containers": gpu_container("nvidia.com/gpu")}),
    )
    .await;
    doctor(&["needs-gpu", "-n", &namespace]).assert_fault(ALLOCATABLE_ZERO, "gpu-t4-0");
    // The same fault in JSON, with the same exit status.
    let as_json = doctor(&["needs-gpu", "-n", &namespace, "-o", "json"]);
    assert_eq!(
        as_json.code,
        Some(i32::from(EXIT_FAULTS)),
        "{}",
        as_json.stderr
    );
    let report = as_json.json();
    assert_eq!(report["pod"]["namespace"], namespace.as_str());
    assert_eq!(report["pod"]["name"], "needs-gpu");
    assert!(
        report["faults"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["check"] == ALLOCATABLE_ZERO
                && f["problem"].as_str().unwrap().contains("gpu-t4-0")),
        "{report}"
    );

    // Without -n, the pod is looked for in the kubeconfig context's namespace, as kubectl does.
    let context_kubeconfig = std::env::temp_dir().join(unique_name("doctor-kubeconfig"));
    std::fs::copy(std::env::var("KUBECONFIG").unwrap(), &context_kubeconfig).unwrap();
    let context_path = context_kubeconfig.display().to_string();
    e2e::cluster::kubectl_output(&[
        "config",
        "set-context",
        "--current",
        "--namespace",
        &namespace,
        "--kubeconfig",
        &context_path,
    ])
    .unwrap();
    doctor(&["needs-gpu", "--kubeconfig", &context_path])
        .assert_fault(ALLOCATABLE_ZERO, "gpu-t4-0");
    // ... and not in default, where the admin kubeconfig's context points.
    doctor(&["needs-gpu"]).assert_could_not_run("default/needs-gpu");

    // Could not run: exit 2, no report.
    doctor(&["--kubeconfig", "/nonexistent/kubeconfig", "-o", "json"])
        .assert_could_not_run("/nonexistent/kubeconfig");
    doctor(&["--context", "no-such-context"]).assert_could_not_run("no-such-context");
    doctor(&["no-such-pod", "-n", &namespace]).assert_could_not_run("no-such-pod");

    // Healthy: exit 0, the golden table, the same from the operator's kubeconfig and as a
    // kubectl plugin.
    advertise_gpus(&admin, true).await;
    let healthy = until_healthy(&setup).await;
    if std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1") {
        std::fs::write(golden_path(), &healthy.stdout).unwrap();
    }
    assert_eq!(
        healthy.stdout,
        std::fs::read_to_string(golden_path()).unwrap()
    );
    // JSON and YAML: the table's facts, no fault, exit 0.
    let json = doctor(&["-o", "json"]);
    assert!(json.ok, "{}{}", json.stdout, json.stderr);
    let report = json.json();
    assert_eq!(report["version"], 1);
    assert_eq!(report["faults"], serde_json::json!([]));
    let rows: Vec<&str> = healthy
        .stdout
        .lines()
        .skip(1)
        .take_while(|l| !l.is_empty())
        .collect();
    let nodes = report["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), rows.len(), "{report}");
    for (node, row) in nodes.iter().zip(&rows) {
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(node["name"], cells[0], "{row}");
        assert_eq!(node["validator"], "Ready", "{row}");
        assert_eq!(node["allocatableGpus"], cells[cells.len() - 4], "{row}");
        let taints = node["taints"].as_array().unwrap();
        assert_eq!(
            cells[cells.len() - 1] == "-",
            taints.is_empty(),
            "{row}: {node}"
        );
    }
    let yaml = doctor(&["--output", "yaml"]);
    assert!(yaml.ok, "{}", yaml.stderr);
    let from_yaml: serde_json::Value = serde_yaml_ng::from_str(&yaml.stdout).unwrap();
    assert_eq!(from_yaml, report);
    let kubeconfig = setup.identity.kubeconfig.display().to_string();
    let as_operator = doctor(&["--kubeconfig", &kubeconfig]);
    assert!(as_operator.ok, "{}", as_operator.stdout);
    assert_eq!(as_operator.stdout, healthy.stdout);
    let plugins = std::env::temp_dir().join(unique_name("kubectl-plugins"));
    std::fs::create_dir_all(&plugins).unwrap();
    std::os::unix::fs::symlink(
        e2e::operator::binary().unwrap(),
        plugins.join("kubectl-gpu"),
    )
    .unwrap();
    let path = format!(
        "{}:{}",
        plugins.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut kubectl = e2e::kubectl();
    kubectl.env("PATH", &path);
    let plugin = run(kubectl, &["gpu", "doctor"]);
    assert!(plugin.ok, "{}", plugin.stdout);
    assert_eq!(plugin.stdout, healthy.stdout);
    // As a plugin with kubectl's own flags, and the context's namespace for the pod.
    let mut kubectl = e2e::kubectl();
    kubectl.env("PATH", &path);
    let plugin = run(
        kubectl,
        &[
            "gpu",
            "doctor",
            "on-no-node",
            "--kubeconfig",
            &context_path,
            "-o",
            "json",
        ],
    );
    assert_eq!(
        plugin.code,
        Some(i32::from(EXIT_COULD_NOT_RUN)),
        "{}",
        plugin.stderr
    );
    assert!(
        plugin.stderr.contains(&format!("{namespace}/on-no-node")),
        "{}",
        plugin.stderr
    );
    let mut kubectl = e2e::kubectl();
    kubectl
        .env("PATH", &path)
        .env("KUBECONFIG", &context_kubeconfig);
    let plugin = run(kubectl, &["gpu", "doctor", "needs-gpu", "-o", "json"]);
    assert_ne!(
        plugin.code,
        Some(i32::from(EXIT_COULD_NOT_RUN)),
        "{}",
        plugin.stderr
    );
    assert_eq!(plugin.json()["pod"]["namespace"], namespace.as_str());
    // kubectl's completion of `kubectl gpu <TAB>` through a kubectl_complete-gpu link.
    std::os::unix::fs::symlink(
        e2e::operator::binary().unwrap(),
        plugins.join("kubectl_complete-gpu"),
    )
    .unwrap();
    let mut kubectl = e2e::kubectl();
    kubectl.env("PATH", &path);
    let completed = run(kubectl, &["__complete", "gpu", "doctor", "--out"]);
    assert!(
        completed.ok && completed.stdout.lines().any(|l| l.starts_with("--output")),
        "{}{}",
        completed.stdout,
        completed.stderr
    );
    std::fs::remove_dir_all(&plugins).unwrap();
    std::fs::remove_file(&context_kubeconfig).unwrap();

    // No GPU node for the pod's selector; a missing toleration; a MIG resource the strategy
    // does not advertise.
    pod(
        &admin,
        &namespace,
        "b200",
        json!({
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-B200"},
        "tolerations": tolerate_all(), "containers": gpu_container("nvidia.com/gpu")}),
    )
    .await;
    doctor(&["b200", "-n", &namespace]).assert_fault(NO_GPU_NODE, "nodeSelector");
    // A required node affinity no GPU node meets: the expression that fails on each node.
    pod(
        &admin,
        &namespace,
        "b200-affinity",
        json!({
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
            {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-B200"]}]}]}}},
        "tolerations": tolerate_all(), "containers": gpu_container("nvidia.com/gpu")}),
    )
    .await;
    let affinity = doctor(&["b200-affinity", "-n", &namespace]);
    affinity.assert_fault(NO_GPU_NODE, "required node affinity");
    affinity.assert_fault(
        NODE_AFFINITY_MISMATCH,
        "off GPU node gpu-t4-0: nodeSelectorTerms[0].matchExpressions[0] \
         (nvidia.com/gpu.product In [NVIDIA-B200]): the node's is Tesla-T4",
    );
    let excluded = doctor(&["b200-affinity", "-n", &namespace, "-o", "json"]).json()["faults"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["check"] == NODE_AFFINITY_MISMATCH)
        .count();
    assert!(
        excluded >= 6,
        "every GPU node of the fleet: {}",
        affinity.stdout
    );
    pod(
        &admin,
        &namespace,
        "untolerated",
        json!({
        "nodeSelector": {"kubernetes.io/hostname": "gpu-tainted-t4-0"},
        "containers": gpu_container("nvidia.com/gpu")}),
    )
    .await;
    doctor(&["untolerated", "-n", &namespace])
        .assert_fault(MISSING_TOLERATION, "nvidia.com/gpu=present:NoSchedule");
    pod(
        &admin,
        &namespace,
        "mig",
        json!({
        "tolerations": tolerate_all(), "containers": gpu_container("nvidia.com/mig-1g.5gb")}),
    )
    .await;
    doctor(&["mig", "-n", &namespace]).assert_fault(MIG_STRATEGY_MISMATCH, "nvidia.com/mig-1g.5gb");

    // The validator crash-loops (and then the driver) on one node.
    let on_t4 = json!({"nodeSelector": {"kubernetes.io/hostname": "gpu-t4-0"},
                       "tolerations": tolerate_all(), "containers": gpu_container("nvidia.com/gpu")});
    pod(&admin, &namespace, "on-t4", on_t4).await;
    let crash = CrashLoop::start(&admin, "gpu-t4-0", "nvidia-operator-validator")
        .await
        .unwrap();
    doctor(&[]).assert_fault(VALIDATOR_NOT_READY, "gpu-t4-0 is CrashLoopBackOff");
    doctor(&["on-t4", "-n", &namespace]).assert_fault(VALIDATOR_NOT_READY, "gpu-t4-0");
    crash.recover().await.unwrap();
    let crash = CrashLoop::start(&admin, "gpu-t4-0", "nvidia-driver-daemonset")
        .await
        .unwrap();
    doctor(&[]).assert_fault(DRIVER_CRASH_LOOP, "on gpu-t4-0 is crash-looping");
    crash.recover().await.unwrap();

    // The RuntimeClass gone (operator stopped, so it is not put back at once).
    setup.operator.terminate(Duration::from_secs(20)).unwrap();
    Api::<RuntimeClass>::all(admin.clone())
        .delete("nvidia", &DeleteParams::default())
        .await
        .unwrap();
    doctor(&[]).assert_fault(RUNTIME_CLASS_MISSING, "RuntimeClass nvidia");
    setup.start_operator_again().await;
    until_healthy(&setup).await;

    // A node NFD never labelled behind a taint NFD's worker does not tolerate: named, with the
    // toleration to add, instead of staying an unexplained non-GPU node.
    let unseen = FakeNode::gpu(unique_name("doctor-unseen"), GpuModel::T4)
        .undiscovered()
        .label(EPHEMERAL, "true");
    nodes::create(&admin, std::slice::from_ref(&unseen))
        .await
        .unwrap();
    Api::<Node>::all(admin.clone())
        .patch(
            &unseen.name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": [
                {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]}})),
        )
        .await
        .unwrap();
    let report = doctor(&[]);
    report.assert_fault(
        NFD_WORKER_KEPT_OFF,
        &format!("taint dedicated=ml:NoSchedule keeps NFD's worker (node-feature-discovery-worker) off {}", unseen.name),
    );
    assert!(
        report
            .stdout
            .contains(r#"{"effect":"NoSchedule","key":"dedicated","operator":"Exists"}"#),
        "{}",
        report.stdout
    );
    nodes::delete(&admin, std::slice::from_ref(&unseen.name))
        .await
        .unwrap();

    Api::<Namespace>::all(admin.clone())
        .delete(&namespace, &DeleteParams::default())
        .await
        .unwrap();
    advertise_gpus(&admin, false).await;
    setup.teardown().await;
}
