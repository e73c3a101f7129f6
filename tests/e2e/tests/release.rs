//! A release installed the way NVIDIA's users install: `make release` publishes to the
//! harness's OCI registry (distribution's registry on 127.0.0.1, tests/cluster/registry.sh) the
//! operator image pushed from the reproducible archive with its digest unchanged, its SBOM as an
//! OCI referrer (artifactType, subject), the chart as an OCI artifact and the image list; then
//! `helm install` from `oci://` with no `--set`, the Deployment naming the released image, a
//! policy ready, and `helm upgrade -f charts/gpu-operator/ci/time-slicing-values.yaml` with no
//! other flag rolling the plugins. The chart of the checkout still refuses to install without
//! an image, naming the value.
//!
//! The operator runs from the published image, pulled back from the registry, under runc as a
//! kubelet would run the Deployment's pod (e2e::container): its command and args, env with the
//! downward API, the chart's securityContext (non-root user, read-only root, no capabilities,
//! no_new_privs, RuntimeDefault seccomp), memory and CPU limits as cgroup limits, the chart's
//! ServiceAccount token; ready when its readiness probe passes. The test reads back from
//! /proc and the cgroup that each of those is in force. `--plain-http` is on the helm commands
//! only because the harness registry serves plain HTTP.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use e2e::container;
use e2e::helm::{RELEASE, helm, helm_ok, release_namespace, strings};
use e2e::operator::Operator;
use e2e::tools::repo_root;
use e2e::{session, wait};
use gpu_operator::api::State;
use gpu_operator::crd_upgrade::OPERATOR_VERSION;
use gpu_operator::model::config_hash;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, ListParams};
use kube::{Client, ResourceExt};
use serde_json::Value;

/// The ClusterPolicy the chart creates.
const POLICY: &str = "cluster-policy";
/// The chart's ServiceAccount.
const OPERATOR_ACCOUNT: &str = "gpu-operator";
/// The path under the registry the release is published to (REGISTRY=127.0.0.1:PORT/PATH).
const PATH: &str = "gpu-operator";
const TIMEOUT: Duration = Duration::from_secs(120);
const SBOM_TYPE: &str = "application/vnd.cyclonedx+json";

/// Runs a command, failing with its output; its stdout.
fn run_ok(command: &mut Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("running {command:?}: {e}"));
    assert!(
        out.status.success(),
        "{command:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `oras ARGS --plain-http`, parsed as JSON.
fn oras_json(oras: &Path, args: &[&str]) -> Value {
    let text = run_ok(Command::new(oras).args(args).arg("--plain-http"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("oras {args:?}: {e}:\n{text}"))
}

/// The manifest digest the OCI archive's index names (what `make image` built).
fn archive_digest(archive: &Path) -> String {
    let index = run_ok(
        Command::new("tar")
            .arg("-xOf")
            .arg(archive)
            .arg("index.json"),
    );
    let index: Value = serde_json::from_str(&index).unwrap();
    let manifests = index["manifests"].as_array().unwrap();
    assert_eq!(manifests.len(), 1, "{index}");
    assert_eq!(
        manifests[0]["annotations"]["org.opencontainers.image.ref.name"], OPERATOR_VERSION,
        "the archive's tag"
    );
    manifests[0]["digest"].as_str().unwrap().to_owned()
}

/// The first container of the Deployment's pod template.
fn operator_container(deployment: &Deployment) -> k8s_openapi::api::core::v1::Container {
    deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.containers.first())
        .cloned()
        .expect("the Deployment has no container")
}

/// Whether a RollingUpdate DaemonSet finished rolling out its current template.
fn rolled_out(ds: &DaemonSet) -> bool {
    let Some(status) = ds.status.as_ref() else {
        return false;
    };
    status.observed_generation == ds.metadata.generation
        && status.updated_number_scheduled == Some(status.desired_number_scheduled)
        && status.number_available == Some(status.desired_number_scheduled)
}

/// Fields of /proc/PID/status.
fn proc_status(pid: u32) -> BTreeMap<String, String> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect()
}

/// What the kernel says about the operator's process: the chart's securityContext and limits
/// are in force (user 65532, no capabilities, no_new_privs, seccomp filter, read-only root,
/// 350Mi and 500m), and the downward API gave it its pod's name.
fn assert_runs_as_the_chart_says(operator: &Operator, pod_name: &str) {
    let running = operator.container.as_ref().unwrap();
    let pid = running.pid;
    let status = proc_status(pid);
    assert_eq!(
        status["Uid"].split_whitespace().next(),
        Some("65532"),
        "{status:?}"
    );
    assert_eq!(
        status["Gid"].split_whitespace().next(),
        Some("65532"),
        "{status:?}"
    );
    assert_eq!(status["CapEff"], "0000000000000000", "{status:?}");
    assert_eq!(status["CapBnd"], "0000000000000000", "{status:?}");
    assert_eq!(status["NoNewPrivs"], "1", "{status:?}");
    assert_eq!(status["Seccomp"], "2", "no seccomp filter: {status:?}");
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    let root = mountinfo
        .lines()
        .find(|l| l.split_whitespace().nth(4) == Some("/"))
        .unwrap_or_else(|| panic!("no root mount:\n{mountinfo}"));
    assert!(
        root.split_whitespace()
            .nth(5)
            .is_some_and(|o| o.split(',').any(|o| o == "ro")),
        "the root file system is writable: {root}"
    );
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    assert!(
        environ
            .split('\0')
            .any(|e| e == format!("POD_NAME={pod_name}")),
        "POD_NAME: {environ}"
    );
    let args = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let args: Vec<String> = String::from_utf8_lossy(&args)
        .split('\0')
        .filter(|a| !a.is_empty())
        .map(str::to_owned)
        .collect();
    assert_eq!(
        args.first().map(String::as_str),
        Some("gpu-operator"),
        "{args:?}"
    );
    assert_eq!(args.get(1).map(String::as_str), Some("run"), "{args:?}");
    let stats = running.cgroup_stats().unwrap();
    assert_eq!(
        stats.memory_limit_bytes,
        Some(350 * 1024 * 1024),
        "{stats:?}"
    );
    assert_eq!(
        (stats.cpu_quota_us, stats.cpu_period_us),
        (Some(50_000), Some(100_000)),
        "{stats:?}"
    );
}

/// Waits until the policy is `ready` for its current generation.
async fn await_ready(admin: &Client, operator: &Operator, what: &str) {
    session::await_policy_state(admin, POLICY, State::Ready, what)
        .await
        .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
}

#[test]
fn release_refuses_a_version_other_than_the_checkouts_naming_the_fix() {
    let out = Command::new(repo_root().join("scripts/release.sh"))
        .args(["127.0.0.1:1/gpu-operator", "99.0.0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "release.sh accepted VERSION 99.0.0");
    for text in [
        "VERSION=99.0.0",
        &format!("this checkout builds {OPERATOR_VERSION}"),
        "charts/gpu-operator/Chart.yaml",
    ] {
        assert!(stderr.contains(text), "{text:?} not in:\n{stderr}");
    }
    let out = Command::new(repo_root().join("scripts/release.sh"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "release.sh ran with no REGISTRY");
    assert!(stderr.contains("REGISTRY is not set"), "{stderr}");
}

#[tokio::test]
async fn a_release_published_to_a_registry_installs_and_upgrades_with_no_flags() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    let Some(registry) = e2e::registry::start() else {
        return;
    };
    let Some(oras) = e2e::registry::oras() else {
        return;
    };
    e2e::helm::remove_releases(&admin).await;
    // The CRD as the other tests install it (a fresh harness has none), so leftovers can be
    // listed; helm install leaves an existing CRD as it is.
    e2e::crd::install_cluster_policy_crd(&admin, session::CRD_FIELD_MANAGER)
        .await
        .unwrap();
    session::remove_leftovers(&admin).await;

    // --- make release, as a maintainer types it.
    let out_dir = std::env::temp_dir().join(e2e::cluster::unique_name("release"));
    let repository = format!("{registry}/{PATH}");
    let mut make = Command::new("make");
    make.current_dir(repo_root())
        .arg("release")
        .arg(format!("REGISTRY={repository}"))
        .arg(format!("VERSION={OPERATOR_VERSION}"))
        .env("OUT", &out_dir);
    // Without the variables cargo sets for this test: build scripts that name them in
    // rerun-if-env-changed (ring's CARGO_PKG_NAME, ...) would rebuild the image's binary.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy().into_owned();
        if (name == "CARGO" || name.starts_with("CARGO_"))
            && name != "CARGO_TARGET_DIR"
            && name != "CARGO_HOME"
        {
            make.env_remove(name);
        }
    }
    let started = Instant::now();
    let printed = run_ok(&mut make);
    println!("make release: {:?}", started.elapsed());

    // The image list: the operator by tag and digest first, then operand images.
    let images = std::fs::read_to_string(out_dir.join("images.txt")).unwrap();
    let listed: Vec<&str> = images.lines().filter(|l| !l.starts_with('#')).collect();
    let tagged = format!("{repository}/gpu-operator:{OPERATOR_VERSION}");
    let (first_tagged, digest) = listed[0]
        .split_once('@')
        .expect("no digest on the first line");
    assert_eq!(first_tagged, tagged, "images.txt:\n{images}");
    assert!(
        listed
            .iter()
            .any(|i| i.starts_with("nvcr.io/nvidia/k8s-device-plugin:")),
        "no device plugin image in images.txt:\n{images}"
    );
    assert!(
        images
            .lines()
            .any(|l| l.starts_with("# nvcr.io/nvidia/driver:")),
        "the driver's per-OS tag is not explained in images.txt:\n{images}"
    );
    assert!(
        printed.contains(&format!("image={tagged}@{digest}")),
        "{printed}"
    );

    // The registry serves the archive's manifest under the tag, digest unchanged.
    assert_eq!(
        digest,
        archive_digest(&out_dir.join("gpu-operator.oci.tar"))
    );
    let resolved = run_ok(Command::new(&oras).args(["resolve", "--plain-http", &tagged]));
    assert_eq!(resolved.trim(), digest, "the registry's digest of {tagged}");

    // The SBOM is a referrer of that manifest: its artifactType, its subject, its content.
    let subject = format!("{repository}/gpu-operator@{digest}");
    let discovered = oras_json(&oras, &["discover", "--format", "json", &subject]);
    let referrers: Vec<&Value> = discovered["referrers"]
        .as_array()
        .unwrap_or_else(|| panic!("no referrers in {discovered}"))
        .iter()
        .filter(|r| r["artifactType"] == SBOM_TYPE)
        .collect();
    assert_eq!(
        referrers.len(),
        1,
        "SBOM referrers of {subject}: {discovered}"
    );
    let sbom_digest = referrers[0]["digest"].as_str().unwrap();
    let manifest = oras_json(
        &oras,
        &[
            "manifest",
            "fetch",
            &format!("{repository}/gpu-operator@{sbom_digest}"),
        ],
    );
    assert_eq!(manifest["artifactType"], SBOM_TYPE, "{manifest}");
    assert_eq!(manifest["subject"]["digest"], digest, "{manifest}");
    let layer = manifest["layers"][0]["digest"].as_str().unwrap();
    let sbom = oras_json(
        &oras,
        &[
            "blob",
            "fetch",
            "--output",
            "-",
            &format!("{repository}/gpu-operator@{layer}"),
        ],
    );
    assert_eq!(sbom["bomFormat"], "CycloneDX", "the SBOM blob");
    let on_disk: Value = serde_json::from_str(
        &std::fs::read_to_string(out_dir.join("gpu-operator.sbom.cdx.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(sbom, on_disk, "the SBOM in the registry is not the image's");

    // --- helm install from the registry, with no --set.
    let namespace = release_namespace(&admin).await;
    let chart = format!("oci://{repository}/charts/gpu-operator");
    let started = Instant::now();
    helm_ok(&strings(&[
        "install",
        RELEASE,
        &chart,
        "-n",
        &namespace,
        "--create-namespace",
        "--plain-http",
        "--wait",
        "--timeout",
        "3m",
    ]));
    println!("helm install from {chart}: {:?}", started.elapsed());
    let deployment = Api::<Deployment>::namespaced(admin.clone(), &namespace)
        .get("gpu-operator")
        .await
        .unwrap();
    let deployed = operator_container(&deployment);
    assert_eq!(
        deployed.image.as_deref(),
        Some(tagged.as_str()),
        "the Deployment does not name the released image"
    );
    assert_eq!(
        deployment
            .status
            .as_ref()
            .and_then(|s| s.available_replicas),
        Some(1),
        "operator Deployment not available after helm install --wait"
    );

    // The Deployment's pod, run from the image the registry serves, under runc.
    let Some(tools) = e2e::cluster::prerequisite(
        "runc, netns-run or seccomp-default (tests/cluster/container-tools.sh) is missing",
        container::Tools::find(),
    ) else {
        return;
    };
    let image = container::Image::pull(
        &container::ImageSource::Registry {
            reference: tagged.clone(),
            oras: oras.clone(),
        },
        &out_dir.join("pulled"),
    )
    .unwrap();
    assert_eq!(
        image.digest, digest,
        "the pulled image is not the published one"
    );
    let pod = container::deployment_pod(&admin, &namespace, "gpu-operator", TIMEOUT)
        .await
        .unwrap();
    let pod = container::PodContext::live(&pod).unwrap();
    assert_eq!(
        pod.spec.service_account_name.as_deref(),
        Some(OPERATOR_ACCOUNT)
    );
    let started = Instant::now();
    let mut operator = Operator::start_in_container(
        &admin,
        &tools,
        &image,
        &pod,
        "gpu-operator",
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("the released image did not run as its Deployment says: {e:#}"));
    println!(
        "operator container ready {:?} after its start",
        started.elapsed()
    );
    assert_runs_as_the_chart_says(&operator, &pod.name);
    operator
        .await_log("caches ready", TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    let started = Instant::now();
    await_ready(
        &admin,
        &operator,
        "policy ready after helm install from the registry",
    )
    .await;
    println!(
        "policy ready {:?} after the operator started",
        started.elapsed()
    );

    let daemonsets = Api::<DaemonSet>::namespaced(admin.clone(), &namespace);
    let before: BTreeMap<String, DaemonSet> = daemonsets
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|d| (d.name_any(), d))
        .collect();

    // --- helm upgrade with the values file and nothing else.
    let values = repo_root().join("charts/gpu-operator/ci/time-slicing-values.yaml");
    let started = Instant::now();
    helm_ok(&strings(&[
        "upgrade",
        RELEASE,
        &chart,
        "-n",
        &namespace,
        "-f",
        &values.display().to_string(),
        "--plain-http",
        "--wait",
        "--timeout",
        "3m",
    ]));
    println!(
        "helm upgrade -f time-slicing-values.yaml: {:?}",
        started.elapsed()
    );
    let upgraded = Api::<Deployment>::namespaced(admin.clone(), &namespace)
        .get("gpu-operator")
        .await
        .unwrap();
    assert_eq!(
        operator_container(&upgraded).image.as_deref(),
        Some(tagged.as_str()),
        "helm upgrade with a values file changed the operator's image"
    );
    for consumer in ["nvidia-device-plugin-daemonset", "gpu-feature-discovery"] {
        let old = before
            .get(consumer)
            .and_then(|d| config_hash(d).map(str::to_owned));
        let ds = daemonsets.clone();
        wait::until(
            TIMEOUT,
            &format!("{consumer} rolled with the time-slicing config"),
            || {
                let ds = ds.clone();
                let old = old.clone();
                async move {
                    let now = ds.get(consumer).await?;
                    let hash = config_hash(&now).map(str::to_owned);
                    Ok(if hash.is_some() && hash != old && rolled_out(&now) {
                        Ok(())
                    } else {
                        Err(format!(
                            "hash {hash:?} (was {old:?}), status {:?}",
                            now.status
                        ))
                    })
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    }
    await_ready(&admin, &operator, "policy ready after helm upgrade").await;
    let running = operator.container.as_ref().unwrap();
    let report = running.probe_report();
    assert!(
        report.restart_due.is_none() && report.ready,
        "probes after the upgrade: {report}"
    );
    assert!(
        report.counts.get("liveness").is_some_and(|(ok, _)| *ok > 0),
        "the liveness probe never passed: {report}"
    );
    let stats = running.cgroup_stats().unwrap();
    assert_eq!(stats.oom_kills, Some(0), "{stats:?}");
    println!(
        "probes: {report}; memory peak {:.1} MiB of {:?} bytes",
        stats.memory_peak_mib().unwrap_or_default(),
        stats.memory_limit_bytes
    );

    // --- The chart of the checkout is unchanged by the release: it still names the value.
    let out = helm(&strings(&[
        "install",
        "unpublished",
        &e2e::helm::chart(),
        "-n",
        &namespace,
        "--dry-run=server",
    ]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the checkout's chart installed with no image"
    );
    for text in [
        "operator.repository is not set",
        "--set operator.repository=",
        "make release",
    ] {
        assert!(stderr.contains(text), "{text:?} not in:\n{stderr}");
    }

    // Teardown as docs/install.md gives it.
    session::policies(&admin)
        .delete(POLICY, &DeleteParams::default())
        .await
        .unwrap();
    helm_ok(&strings(&[
        "uninstall",
        RELEASE,
        "-n",
        &namespace,
        "--wait",
    ]));
    wait::until_none_left(
        &session::policies(&admin),
        &ListParams::default(),
        TIMEOUT,
        "policy deleted",
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator log:\n{}", operator.log_text()));
    if let Err(e) = operator.terminate(Duration::from_secs(20)) {
        panic!("{e}:\n{}", operator.log_text());
    }
    Api::<Namespace>::all(admin.clone())
        .delete(&namespace, &DeleteParams::default())
        .await
        .unwrap();
    let _ = std::fs::remove_dir_all(&out_dir);
}
