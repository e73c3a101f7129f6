//! `bench`: measures an operator on the running harness (see bench/README.md; `make bench`
//! starts the harness and calls this).
//!
//! ```text
//! bench run --nodes N [--gpu-operator PATH] [--operator-cmd CMD [--operator-name NAME]]
//!           [--changes 25] [--steady-seconds 60] [--pause-ms 1000] [--out DIR]
//!           [--cluster-admin] [--ready-timeout-seconds 1800] [--policy-merge JSON]
//! bench summary FILE.json...      one Markdown table over several runs (scaling)
//! ```
//!
//! `run` creates N fake GPU nodes (+1 CPU node), then for our operator (and, with
//! `--operator-cmd`, for that command afterwards, on the same cluster) measures: policy
//! creation -> every operand DaemonSet applied and -> `status.state=ready`; `kubectl patch
//! clusterpolicy` (switching the sharing ConfigMap) and ConfigMap edits -> device-plugin
//! DaemonSet template updated (median / p95); RSS (idle, peak, steady) and CPU seconds; and the
//! API requests of the operator's identity (audit log) during a steady window while every
//! node's `nvidia.com/gfd.timestamp` is rewritten once. Writes `n<N>.json` and `n<N>.md`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};
use e2e::audit::{self, AuditEvent, AuditLog};
use e2e::nodes;
use e2e::operator::{Operator, OperatorIdentity, free_port, reconciles};
use e2e::procstat::{self, ProcStat};
use e2e::steady::{self, GFD_TIMESTAMP};
use futures::StreamExt;
use gpu_operator::model::config_hash;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use k8s_openapi::api::rbac::v1::ClusterRole;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde::Deserialize;
use serde_json::{Value, json};

mod report;

use report::*;

const PLUGIN_DS: &str = "nvidia-device-plugin-daemonset";
const POLICY: &str = "bench-policy";
const CONFIG_A: &str = "bench-sharing-a";
const CONFIG_B: &str = "bench-sharing-b";
/// The MIG ConfigMap the default policy names; NVIDIA's chart ships it, the bench creates it
/// from examples/configmaps/mig-config.yaml.
const MIG_CONFIG: &str = "default-mig-parted-config";
/// The audit username of the harness admin (client certificate CN).
const ADMIN_USER: &str = "admin";
/// Labels the operator writes on GPU nodes; stripped between two operators under test.
const OPERATOR_NODE_LABEL_PREFIXES: [&str; 2] =
    [gpu_operator::nodes::GPU_PRESENT, "nvidia.com/gpu.deploy."];

#[derive(Clone, Debug)]
struct Options {
    nodes: usize,
    gpu_operator: PathBuf,
    others: Vec<(String, String)>,
    changes: usize,
    steady: Duration,
    pause: Duration,
    out: PathBuf,
    cluster_admin: bool,
    ready_timeout: Duration,
    /// A JSON merge patch (RFC 7386) over the bench's policy, e.g. to measure with
    /// `{"spec":{"daemonsets":{"updateStrategy":"OnDelete"}}}`.
    policy_merge: Option<Value>,
    /// `--image ARCHIVE`: our operator runs from this OCI archive (`make image`) under runc, as
    /// the chart's Deployment (`helm template` of `--chart`) says: its securityContext and
    /// limits. Pulled in `run`.
    image: Option<PathBuf>,
    chart: PathBuf,
    pulled: Option<e2e::container::Image>,
}

fn usage() -> &'static str {
    "usage: bench run --nodes N [--gpu-operator PATH] [--operator-cmd CMD [--operator-name NAME]] \
     [--changes 25] [--steady-seconds 60] [--pause-ms 1000] [--out DIR] [--cluster-admin] \
     [--ready-timeout-seconds 1800] [--policy-merge JSON] [--image OCI-ARCHIVE [--chart DIR]] \
     | bench summary FILE.json..."
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Options> {
    let mut o = Options {
        nodes: 100,
        gpu_operator: PathBuf::new(),
        others: Vec::new(),
        changes: 25,
        steady: Duration::from_secs(60),
        pause: Duration::from_millis(1000),
        out: PathBuf::from("bench/results"),
        cluster_admin: false,
        ready_timeout: Duration::from_secs(1800),
        policy_merge: None,
        image: None,
        chart: e2e::tools::repo_root().join("charts/gpu-operator"),
        pulled: None,
    };
    let mut gpu_operator = None;
    let mut next_name = None;
    while let Some(arg) = args.next() {
        let mut value = || args.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--nodes" => o.nodes = value()?.parse()?,
            "--gpu-operator" => gpu_operator = Some(PathBuf::from(value()?)),
            "--operator-name" => next_name = Some(value()?),
            "--operator-cmd" => {
                let cmd = value()?;
                if !cmd.trim().is_empty() {
                    let name = next_name
                        .take()
                        .unwrap_or_else(|| format!("other-{}", o.others.len() + 1));
                    o.others.push((name, cmd));
                }
            }
            "--changes" => o.changes = value()?.parse()?,
            "--steady-seconds" => o.steady = Duration::from_secs(value()?.parse()?),
            "--pause-ms" => o.pause = Duration::from_millis(value()?.parse()?),
            "--out" => o.out = PathBuf::from(value()?),
            "--cluster-admin" => o.cluster_admin = true,
            "--image" => o.image = Some(PathBuf::from(value()?)),
            "--chart" => o.chart = PathBuf::from(value()?),
            "--ready-timeout-seconds" => o.ready_timeout = Duration::from_secs(value()?.parse()?),
            "--policy-merge" => {
                let text = value()?;
                let patch: Value = serde_json::from_str(&text)
                    .with_context(|| format!("--policy-merge {text}: not JSON"))?;
                anyhow::ensure!(
                    patch.is_object(),
                    "--policy-merge {text}: not a JSON object"
                );
                o.policy_merge = Some(patch);
            }
            other => bail!("unknown argument {other}; {}", usage()),
        }
    }
    anyhow::ensure!(o.changes >= 1, "--changes must be at least 1");
    o.gpu_operator = match gpu_operator {
        Some(p) => p,
        // The image's own binary renders and prints the RBAC.
        None if o.image.is_some() => PathBuf::new(),
        // Built next to this binary (`cargo build --release -p gpu-operator -p e2e --bins`).
        None => std::env::current_exe()?
            .parent()
            .context("locating the target folder")?
            .join("gpu-operator"),
    };
    Ok(o)
}

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("run") => run(parse(args)?).await,
        Some("summary") => {
            let files: Vec<PathBuf> = args.map(PathBuf::from).collect();
            print!("{}", summary(&files)?);
            Ok(())
        }
        _ => bail!("{}", usage()),
    }
}

// ---------------------------------------------------------------------------------------------
// The run

async fn run(mut o: Options) -> Result<()> {
    if let Some(archive) = &o.image {
        let dir = e2e::cluster::harness_dir()?.join("bench-image");
        let image = e2e::container::Image::pull(
            &e2e::container::ImageSource::Archive(archive.clone()),
            &dir,
        )?;
        if o.gpu_operator.as_os_str().is_empty() {
            let rootfs = dir.join("rootfs");
            let _ = std::fs::remove_dir_all(&rootfs);
            image.unpack(&rootfs)?;
            o.gpu_operator = rootfs.join("usr/local/bin/gpu-operator");
        }
        eprintln!(
            "bench: image {} ({}), run under runc",
            archive.display(),
            image.digest
        );
        o.pulled = Some(image);
    }
    let admin = e2e::client().await?;
    let started_wall = SystemTime::now();
    let mut report = Report {
        gpu_nodes: o.nodes,
        cpu_nodes: 1,
        started: format!("{}", k8s_openapi::jiff::Timestamp::now()),
        machine: machine(),
        policy_merge: o.policy_merge.clone(),
        ..Report::default()
    };
    e2e::crd::install_cluster_policy_crd(&admin, "bench").await?;

    // The fleet: N GPU nodes (T4 / A100 / H100, tainted like GPU pools) and one CPU node.
    let fleet = nodes::fleet("bench", o.nodes, 1, true);
    let t = Instant::now();
    nodes::create(&admin, &fleet).await?;
    report.nodes_created_s = t.elapsed().as_secs_f64();
    eprintln!(
        "bench: {} nodes created in {:.1}s",
        fleet.len(),
        report.nodes_created_s
    );
    await_nodes_ready(&admin, fleet.len()).await?;
    report.nodes_ready_s = t.elapsed().as_secs_f64();
    eprintln!("bench: nodes Ready after {:.1}s", report.nodes_ready_s);
    let gpu_names: Vec<String> = fleet
        .iter()
        .filter(|n| n.gpu.is_some())
        .map(|n| n.name.clone())
        .collect();

    let mut subjects: Vec<(String, Option<String>)> = vec![("gpu-operator".into(), None)];
    subjects.extend(o.others.iter().map(|(n, c)| (n.clone(), Some(c.clone()))));
    let count = subjects.len();
    for (i, (name, cmd)) in subjects.into_iter().enumerate() {
        let last = i + 1 == count;
        eprintln!("bench: measuring {name}");
        let r = measure(&o, &admin, &gpu_names, &name, cmd.as_deref(), last).await;
        if let Some(e) = &r.error {
            eprintln!("bench: {name} failed: {e}");
        }
        report.operators.push(r);
    }

    if let Ok(dir) = e2e::cluster::harness_dir()
        && let Ok(procs) = e2e::procs::recorded(&dir)
    {
        let ticks = procstat::clock_ticks();
        for p in procs {
            if let Ok(s) = procstat::read(p.pid, ticks) {
                report
                    .control_plane_rss_mib
                    .insert(p.name.clone(), round1(s.rss_mib()));
            }
        }
    }
    report.load_end = loadavg();
    let _ = started_wall;

    std::fs::create_dir_all(&o.out)?;
    let base = o.out.join(format!("n{}", o.nodes));
    std::fs::write(
        base.with_extension("json"),
        serde_json::to_string_pretty(&report)? + "\n",
    )?;
    let md = markdown(&report);
    std::fs::write(base.with_extension("md"), &md)?;
    println!("{md}");
    eprintln!("bench: wrote {}.json and .md", base.display());
    if let Some(e) = report.operators.iter().find_map(|r| r.error.clone()) {
        bail!("a measurement failed: {e}");
    }
    Ok(())
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

async fn await_nodes_ready(admin: &Client, n: usize) -> Result<()> {
    let api: Api<Node> = Api::all(admin.clone());
    let lp = ListParams::default().labels(&format!("{}=true", nodes::FAKE_NODE_LABEL));
    e2e::wait::until(Duration::from_secs(600), "fake nodes Ready", || {
        let (api, lp) = (api.clone(), lp.clone());
        async move {
            let list = api.list(&lp).await?;
            let ready = list
                .items
                .iter()
                .filter(|node| {
                    node.status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
                })
                .count();
            Ok(if ready >= n {
                Ok(())
            } else {
                Err(format!("{ready}/{n} Ready"))
            })
        }
    })
    .await
}

fn sharing_config(replicas: u32) -> String {
    format!(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: {replicas}\n"
    )
}

fn config_map(namespace: &str, name: &str, replicas: u32) -> ConfigMap {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace},
        "data": {"any": sharing_config(replicas)}
    }))
    .unwrap_or_default()
}

/// examples/configmaps/mig-config.yaml under the name the default policy uses.
fn mig_config_map(namespace: &str) -> Result<ConfigMap> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/configmaps/mig-config.yaml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut cm: ConfigMap = serde_yaml_ng::from_str(&text)?;
    cm.metadata.name = Some(MIG_CONFIG.into());
    cm.metadata.namespace = Some(namespace.into());
    Ok(cm)
}

/// examples/clusterpolicy-default.yaml (NVIDIA's chart defaults) with a time-slicing config,
/// and `--policy-merge` over it.
fn policy_value(merge: Option<&Value>) -> Result<Value> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/clusterpolicy-default.yaml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut policy: Value = serde_yaml_ng::from_str(&text)?;
    policy["metadata"] = json!({"name": POLICY});
    policy["spec"]["devicePlugin"]["config"] = json!({"name": CONFIG_A, "default": "any"});
    if let Some(patch) = merge {
        json_patch::merge(&mut policy, patch);
    }
    Ok(policy)
}

fn policy_api(client: &Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("nvidia.com", "v1", "ClusterPolicy");
    Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&gvk, "clusterpolicies"),
    )
}

/// The DaemonSets `gpu-operator render` produces for the policy on this fleet (NVIDIA's names,
/// decision 1, so they hold for NVIDIA's operator as well).
fn expected_daemonsets(binary: &Path, namespace: &str, policy: &Value) -> Result<Vec<String>> {
    let dir = std::env::temp_dir().join(format!("bench-render-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let policy_file = dir.join("policy.yaml");
    let cm_file = dir.join("config.yaml");
    let mig_file = dir.join("mig.yaml");
    std::fs::write(&policy_file, serde_yaml_ng::to_string(policy)?)?;
    std::fs::write(
        &cm_file,
        serde_yaml_ng::to_string(&config_map(namespace, CONFIG_A, 4))?,
    )?;
    std::fs::write(
        &mig_file,
        serde_yaml_ng::to_string(&mig_config_map(namespace)?)?,
    )?;
    let out = Command::new(binary)
        .args(["render", "-f"])
        .arg(&policy_file)
        .args(["--os-tag", "ubuntu22.04", "--namespace", namespace])
        .arg("--sharing-config")
        .arg(&cm_file)
        .arg("--mig-config")
        .arg(&mig_file)
        .output()
        .context("running gpu-operator render")?;
    let _ = std::fs::remove_dir_all(&dir);
    anyhow::ensure!(
        out.status.success(),
        "gpu-operator render failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    let mut names = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let v = Value::deserialize(doc)?;
        if v["kind"] == "DaemonSet"
            && let Some(n) = v["metadata"]["name"].as_str()
        {
            names.push(n.to_string());
        }
    }
    anyhow::ensure!(!names.is_empty(), "render produced no DaemonSet");
    Ok(names)
}

/// What a watch on the operand DaemonSets has seen.
#[derive(Clone, Debug, Default)]
struct Seen {
    first_seen: BTreeMap<String, SystemTime>,
    plugin_generation: i64,
    plugin_hash: Option<String>,
    plugin_changed_at: Option<SystemTime>,
}

fn watch_daemonsets(
    admin: &Client,
    namespace: &str,
) -> (
    tokio::sync::watch::Receiver<Seen>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = tokio::sync::watch::channel(Seen::default());
    let api: Api<DaemonSet> = Api::namespaced(admin.clone(), namespace);
    let task = tokio::spawn(async move {
        let mut stream = watcher(api, watcher::Config::default())
            .default_backoff()
            .applied_objects()
            .boxed();
        while let Some(item) = stream.next().await {
            let Ok(ds) = item else { continue };
            let now = SystemTime::now();
            let name = ds.name_any();
            tx.send_modify(|s| {
                s.first_seen.entry(name.clone()).or_insert(now);
                let generation = ds.metadata.generation.unwrap_or(0);
                if name == PLUGIN_DS && generation != s.plugin_generation {
                    s.plugin_generation = generation;
                    s.plugin_hash = config_hash(&ds).map(str::to_owned);
                    s.plugin_changed_at = Some(now);
                }
            });
        }
    });
    (rx, task)
}

/// A running operator under test; `metrics_port` only for ours (another operator's metrics
/// are not read).
struct Process {
    operator: Operator,
    metrics_port: Option<u16>,
}

impl Process {
    fn pid(&self) -> u32 {
        self.operator.pid().unwrap_or_default()
    }

    fn log_text(&self) -> String {
        self.operator.log_text()
    }

    fn terminate(&mut self) {
        if self.operator.terminate(Duration::from_secs(10)).is_err() {
            let _ = self.operator.kill();
        }
    }
}

/// Starts our operator (`cmd` `None`) or `cmd` through the e2e operator launcher.
fn start_operator(
    binary: &Path,
    identity: &OperatorIdentity,
    cmd: Option<&str>,
    log_dir: &Path,
    name: &str,
) -> Result<Process> {
    let port = free_port()?;
    let mut command = match cmd {
        None => {
            let mut c = Command::new(binary);
            c.arg("run")
                .args(["--namespace", &identity.namespace])
                .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
                .args(e2e::operator::PLAIN_ENDPOINTS)
                // Debug for apply: names the first field that differs when an object is
                // re-applied (evidence for any write that should not have happened); and for
                // the per-stage pass timings (where a change's latency goes).
                .env(
                    "RUST_LOG",
                    "info,gpu_operator::controller::apply=debug,gpu_operator::controller::timing=debug",
                );
            c
        }
        Some(cmd) => {
            let mut c = Command::new("bash");
            c.args(["-c", &format!("exec {cmd}")]);
            c
        }
    };
    command
        .env("OPERATOR_NAMESPACE", &identity.namespace)
        .env("METRICS_ADDR", format!("127.0.0.1:{port}"));
    let operator = Operator::launch(command, identity, log_dir.join(format!("{name}.log")), port)
        .with_context(|| format!("starting {name}"))?;
    Ok(Process {
        operator,
        metrics_port: cmd.is_none().then_some(port),
    })
}

/// Our operator run from `image` under runc as the chart's Deployment (`helm template`) says,
/// in the identity's namespace with its ServiceAccount; waits for its readiness probe.
async fn start_container(
    o: &Options,
    admin: &Client,
    image: &e2e::container::Image,
    identity: &OperatorIdentity,
    r: &mut OperatorReport,
) -> Result<Process> {
    let tools = e2e::container::Tools::find()?;
    let out = Command::new("helm")
        .args(["template", "gpu-operator"])
        .arg(&o.chart)
        .args(["-n", &identity.namespace])
        .args(["--set", "operator.repository=bench.local/gpu-operator"])
        .output()
        .context("running helm template (is the harness env sourced?)")?;
    anyhow::ensure!(
        out.status.success(),
        "helm template failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    let mut deployment = None;
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let v = Value::deserialize(doc)?;
        if v["kind"] == "Deployment" {
            deployment = Some(v);
        }
    }
    let deployment: k8s_openapi::api::apps::v1::Deployment =
        serde_json::from_value(deployment.context("the chart rendered no Deployment")?)?;
    let spec = deployment
        .spec
        .and_then(|s| s.template.spec)
        .context("the Deployment has no pod spec")?;
    anyhow::ensure!(
        spec.service_account_name.as_deref() == Some(identity.service_account.as_str()),
        "the chart's pod runs as {:?}, the bench's identity is {}",
        spec.service_account_name,
        identity.service_account
    );
    let limits = spec
        .containers
        .first()
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.limits.clone())
        .unwrap_or_default();
    let pod = e2e::container::PodContext::rendered(&identity.namespace, "gpu-operator-bench", spec);
    let operator = Operator::start_in_container(
        admin,
        &tools,
        image,
        &pod,
        "gpu-operator",
        Duration::from_secs(300),
    )
    .await?;
    r.command = format!(
        "runc: the chart's Deployment, image {}",
        image.layout.display()
    );
    r.container = Some(ContainerReport {
        image: o
            .image
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        image_digest: image.digest.clone(),
        memory_limit_mib: limits
            .get("memory")
            .and_then(|q| e2e::container::parse_bytes(&q.0).ok())
            .map(|b| b as f64 / 1024.0 / 1024.0),
        cpu_limit_millicores: limits
            .get("cpu")
            .and_then(|q| e2e::container::parse_millicpu(&q.0).ok()),
        ..ContainerReport::default()
    });
    Ok(Process {
        operator,
        metrics_port: None,
    })
}

/// Applies the ClusterRole `gpu-operator rbac` prints (the chart's) and returns its name.
async fn generated_cluster_role(admin: &Client, binary: &Path) -> Result<String> {
    let out = Command::new(binary)
        .arg("rbac")
        .output()
        .context("running gpu-operator rbac")?;
    anyhow::ensure!(out.status.success(), "gpu-operator rbac failed");
    let text = String::from_utf8(out.stdout)?;
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let v = Value::deserialize(doc)?;
        if v["kind"] == "ClusterRole" {
            let role: ClusterRole = serde_json::from_value(v)?;
            let name = role.name_any();
            Api::<ClusterRole>::all(admin.clone())
                .patch(
                    &name,
                    &PatchParams::apply("bench").force(),
                    &Patch::Apply(&role),
                )
                .await?;
            return Ok(name);
        }
    }
    bail!("gpu-operator rbac printed no ClusterRole")
}

fn stat(pid: u32, ticks: u64) -> ProcStat {
    procstat::read_tree(pid, ticks).unwrap_or_default()
}

async fn measure(
    o: &Options,
    admin: &Client,
    gpu_names: &[String],
    name: &str,
    cmd: Option<&str>,
    last: bool,
) -> OperatorReport {
    let mut r = OperatorReport {
        name: name.to_string(),
        command: cmd.map_or_else(
            || format!("{} run", o.gpu_operator.display()),
            str::to_string,
        ),
        ..OperatorReport::default()
    };
    let mut process = None;
    let mut identity = None;
    let result = measure_inner(
        o,
        admin,
        gpu_names,
        cmd,
        &mut r,
        &mut process,
        &mut identity,
    )
    .await;
    if let Err(e) = result {
        let log = process
            .as_ref()
            .map(|p: &Process| p.log_text())
            .unwrap_or_default();
        let tail: String = log
            .lines()
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        r.error = Some(format!("{e:#}\noperator log tail:\n{tail}"));
    }
    // Between two operators the cluster goes back to where it was: no policy, no operands, no
    // operator labels on nodes. After the last one the harness is torn down anyway.
    if !last && let Err(e) = reset(admin, identity.as_ref(), gpu_names).await {
        eprintln!("bench: reset after {name} failed: {e:#}");
    }
    if let Some(mut p) = process {
        p.terminate();
    }
    if !last && let Some(id) = identity {
        let _ = id.delete().await;
    }
    r
}

async fn measure_inner(
    o: &Options,
    admin: &Client,
    gpu_names: &[String],
    cmd: Option<&str>,
    r: &mut OperatorReport,
    process_out: &mut Option<Process>,
    identity_out: &mut Option<OperatorIdentity>,
) -> Result<()> {
    let ticks = procstat::clock_ticks();
    let log = AuditLog::from_env()?;
    let role = if o.cluster_admin || cmd.is_some() {
        "cluster-admin".to_string()
    } else {
        generated_cluster_role(admin, &o.gpu_operator).await?
    };
    r.rbac = format!("ClusterRole {role}");
    let identity = OperatorIdentity::create(admin, &role).await?;
    let user = identity.username();
    let namespace = identity.namespace.clone();
    *identity_out = Some(identity);
    let identity = identity_out.as_ref().context("identity")?;

    // The user's sharing ConfigMaps exist before the policy names them.
    let cms: Api<ConfigMap> = Api::namespaced(admin.clone(), &namespace);
    for (cm, replicas) in [(CONFIG_A, 4), (CONFIG_B, 8)] {
        cms.create(
            &PostParams::default(),
            &config_map(&namespace, cm, replicas),
        )
        .await?;
    }
    let policy = policy_value(o.policy_merge.as_ref())?;
    r.convergence.expected_daemonsets = expected_daemonsets(&o.gpu_operator, &namespace, &policy)?;

    // Start the operator and let it fill its caches.
    let log_dir = e2e::cluster::harness_dir().unwrap_or_else(|_| std::env::temp_dir());
    let started = Instant::now();
    *process_out = Some(match (&o.pulled, cmd) {
        (Some(image), None) => start_container(o, admin, image, identity, r).await?,
        _ => start_operator(&o.gpu_operator, identity, cmd, &log_dir, &r.name)?,
    });
    let process = process_out.as_mut().context("process")?;
    let pid = process.pid();
    if cmd.is_none() {
        let log_path = process.operator.log.clone();
        e2e::wait::until(Duration::from_secs(300), "operator caches ready", || {
            let text = std::fs::read_to_string(&log_path).unwrap_or_default();
            async move {
                Ok(if text.contains("caches ready") {
                    Ok(())
                } else {
                    Err("starting".to_string())
                })
            }
        })
        .await?;
    } else {
        tokio::time::sleep(Duration::from_secs(15)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let s_idle = stat(pid, ticks);
    r.memory.idle_rss_mib = round1(s_idle.rss_mib());
    r.cpu.startup_s = s_idle.cpu_seconds;
    eprintln!(
        "bench: operator up in {:.1}s, RSS {:.1} MiB",
        started.elapsed().as_secs_f64(),
        s_idle.rss_mib()
    );

    // 1. Convergence.
    let (seen, watch_task) = watch_daemonsets(admin, &namespace);
    r.load.insert("convergence".into(), loadavg());
    let mark = log.mark()?;
    let t0 = SystemTime::now();
    let object: DynamicObject = serde_json::from_value(policy)?;
    let policies = policy_api(admin);
    policies.create(&PostParams::default(), &object).await?;
    let expected: BTreeSet<String> = r.convergence.expected_daemonsets.iter().cloned().collect();
    let mut rx = seen.clone();
    let applied = tokio::time::timeout(
        o.ready_timeout,
        rx.wait_for(|s| expected.iter().all(|n| s.first_seen.contains_key(n))),
    )
    .await;
    match applied {
        Ok(Ok(s)) => {
            let times: Vec<f64> = expected
                .iter()
                .filter_map(|n| s.first_seen.get(n))
                .map(|t| secs_since(t0, *t))
                .collect();
            r.convergence.first_daemonset_s = times.iter().copied().reduce(f64::min);
            r.convergence.all_daemonsets_s = times.iter().copied().reduce(f64::max);
        }
        _ => {
            let s = seen.borrow().clone();
            let missing: Vec<&String> = expected
                .iter()
                .filter(|n| !s.first_seen.contains_key(*n))
                .collect();
            bail!("operand DaemonSets not all applied: missing {missing:?}");
        }
    }
    eprintln!(
        "bench: all {} DaemonSets applied after {:.2}s",
        expected.len(),
        r.convergence.all_daemonsets_s.unwrap_or_default()
    );
    let ready_at = await_policy_ready(&policies, o.ready_timeout).await?;
    r.convergence.ready_s = Some(secs_since(t0, ready_at));
    eprintln!(
        "bench: policy ready after {:.1}s",
        r.convergence.ready_s.unwrap_or_default()
    );
    let s_ready = stat(pid, ticks);
    r.memory.ready_rss_mib = round1(s_ready.rss_mib());
    r.cpu.convergence_s = s_ready.cpu_seconds - s_idle.cpu_seconds;
    let events = log.of_user_since(mark, &user)?;
    let label_patches: Vec<&AuditEvent> = events
        .iter()
        .filter(|e| e.verb == "patch" && e.resource() == "nodes")
        .collect();
    r.convergence.node_label_patches = label_patches.len() as u64;
    r.convergence.nodes_labelled_s = label_patches
        .iter()
        .map(|e| secs_since(t0, e.completed()))
        .reduce(f64::max);
    r.convergence.writes = audit::writes_excluding_leases(&events).len() as u64;
    r.convergence.requests = audit::by_verb_and_resource(&events);

    // 2. Steady: once the operator has stopped writing, a window with the GFD label churn.
    let settle = steady::await_quiet(
        &log,
        &user,
        Duration::from_secs(5),
        Duration::from_secs(300),
    )
    .await?;
    r.steady.settle_s = settle.as_secs_f64();
    let s_settled = stat(pid, ticks);
    r.cpu.settle_s = s_settled.cpu_seconds - s_ready.cpu_seconds;
    r.load.insert("steady".into(), loadavg());
    let reconciles_before = match process.metrics_port {
        Some(p) => reconciles(p).await,
        None => None,
    };
    let mark = log.mark()?;
    let window = Instant::now();
    r.steady.label_rewrites =
        steady::rewrite_label_spread(admin, gpu_names, GFD_TIMESTAMP, o.steady).await?;
    tokio::time::sleep(o.steady.saturating_sub(window.elapsed())).await;
    r.steady.window_s = window.elapsed().as_secs_f64();
    let s_steady = stat(pid, ticks);
    r.cpu.steady_s = s_steady.cpu_seconds - s_settled.cpu_seconds;
    r.memory.steady_rss_mib = round1(s_steady.rss_mib());
    // Entries are written when a request completes: give the last ones a moment.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let events: Vec<AuditEvent> = log
        .of_user_since(mark, &user)?
        .into_iter()
        .filter(|e| e.completed() <= SystemTime::now())
        .collect();
    r.steady.write_details = audit::described_writes(&events);
    r.steady.writes_excluding_lease = r.steady.write_details.len() as u64;
    r.steady.lease_writes = events
        .iter()
        .filter(|e| e.is_mutating() && e.is_lease())
        .count() as u64;
    // A watch is logged when it ends: only requests that began in the window count.
    let window_start = SystemTime::now() - window.elapsed();
    let in_window: Vec<AuditEvent> = events
        .into_iter()
        .filter(|e| e.received() >= window_start)
        .collect();
    r.steady.requests_by_verb = audit::by_verb(&in_window);
    r.steady.requests = audit::by_verb_and_resource(&in_window);
    if let (Some(p), Some(before)) = (process.metrics_port, reconciles_before) {
        r.steady.reconciles = reconciles(p).await.map(|after| after - before);
    }
    eprintln!(
        "bench: steady {:.0}s: {} writes (Lease aside), {} Lease writes, requests {:?}",
        r.steady.window_s,
        r.steady.writes_excluding_lease,
        r.steady.lease_writes,
        r.steady.requests_by_verb
    );

    // 3. Rollout latency: switch the sharing ConfigMap in the policy, then edit the ConfigMap.
    r.load.insert("rollouts".into(), loadavg());
    let mark = log.mark()?;
    let mut active = CONFIG_A;
    let mut policy_triggers = Vec::new();
    let mut series = Series::new();
    for _ in 0..o.changes {
        let next = if active == CONFIG_A {
            CONFIG_B
        } else {
            CONFIG_A
        };
        let patch = json!({"spec": {"devicePlugin": {"config": {"name": next}}}});
        let policies = policies.clone();
        let outcome = timed_change(&seen, || async move {
            policies
                .patch(POLICY, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map(|_| ())
        })
        .await?;
        active = next;
        policy_triggers.push(outcome.sent);
        series.record(&outcome, "policy patches")?;
        tokio::time::sleep(o.pause).await;
    }
    r.policy_patch = series.latency();
    eprintln!(
        "bench: policy patch -> template: median {:?} ms, p95 {:?} ms",
        r.policy_patch.median_ms, r.policy_patch.p95_ms
    );
    let mut series = Series::new();
    for i in 0..o.changes {
        let cm = config_map(&namespace, active, 10 + i as u32);
        let patch = json!({"data": cm.data});
        let cms = cms.clone();
        let outcome = timed_change(&seen, || async move {
            cms.patch(active, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map(|_| ())
        })
        .await?;
        series.record(&outcome, "ConfigMap edits")?;
        tokio::time::sleep(o.pause).await;
    }
    r.configmap_edit = series.latency();
    eprintln!(
        "bench: ConfigMap edit -> template: median {:?} ms, p95 {:?} ms",
        r.configmap_edit.median_ms, r.configmap_edit.p95_ms
    );
    // Server-side view of the same changes (API server timestamps).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let operator_patches: Vec<SystemTime> = log
        .of_user_since(mark, &user)?
        .iter()
        .filter(|e| {
            e.verb == "patch" && e.resource() == "daemonsets" && e.name() == Some(PLUGIN_DS)
        })
        .map(AuditEvent::completed)
        .collect();
    let admin_events = log.of_user_since(mark, ADMIN_USER)?;
    let triggers = |resource: &str, name: &str| -> Vec<SystemTime> {
        admin_events
            .iter()
            .filter(|e| e.verb == "patch" && e.resource() == resource && e.name() == Some(name))
            .map(AuditEvent::received)
            .collect()
    };
    let policy_received = triggers("clusterpolicies", POLICY);
    let cm_received = triggers("configmaps", active);
    let mut all: Vec<SystemTime> = policy_received
        .iter()
        .chain(&cm_received)
        .copied()
        .collect();
    all.sort();
    let server = |mine: &[SystemTime]| -> Vec<Option<f64>> {
        mine.iter()
            .map(|t| {
                let next = all.iter().find(|u| *u > t).copied();
                operator_patches
                    .iter()
                    .find(|p| *p > t && next.is_none_or(|n| **p < n))
                    .map(|p| {
                        p.duration_since(*t)
                            .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
                    })
            })
            .collect()
    };
    fill_server(&mut r.policy_patch, server(&policy_received));
    fill_server(&mut r.configmap_edit, server(&cm_received));
    let _ = policy_triggers;

    if let (Some(k), Some(c)) = (r.container.as_mut(), process.operator.container.as_ref()) {
        // Read while the container still runs: its cgroup goes with it.
        let stats = c.cgroup_stats()?;
        k.cgroup_version = stats.version.clone();
        k.cgroup_memory_peak_mib = stats.memory_peak_mib().map(round1);
        k.oom_kills = stats.oom_kills;
        k.memory_limit_hits = stats.memory_limit_hits;
        k.cpu_throttled_periods = stats.cpu_throttled_periods;
        k.cpu_throttled_s = stats.cpu_throttled_ns.map(|ns| round1(ns as f64 / 1e9));
        k.probes = c.probe_report().to_string();
        eprintln!(
            "bench: container cgroup at the end: {stats:?}; probes {}",
            k.probes
        );
        anyhow::ensure!(
            stats.oom_kills == Some(0),
            "the operator's container saw OOM kills: {stats:?}"
        );
    }
    let s_end = stat(pid, ticks);
    r.cpu.rollouts_s = s_end.cpu_seconds - s_steady.cpu_seconds;
    r.cpu.total_s = s_end.cpu_seconds;
    r.memory.final_rss_mib = round1(s_end.rss_mib());
    r.memory.peak_rss_mib = round1(s_end.hwm_mib());
    watch_task.abort();
    Ok(())
}

fn latency(samples: Vec<f64>, first: Option<f64>, timeouts: usize, hash_changed: bool) -> Latency {
    let s = sorted(&samples);
    Latency {
        first_ms: first.map(round1),
        median_ms: median(&s).map(round1),
        p95_ms: percentile(&s, 95.0).map(round1),
        max_ms: s.last().copied().map(round1),
        samples_ms: samples.into_iter().map(round1).collect(),
        timeouts,
        hash_changed_every_time: hash_changed,
        ..Latency::default()
    }
}

/// One entry per change, in order: None where no DaemonSet patch of ours followed it.
fn fill_server(l: &mut Latency, per_change: Vec<Option<f64>>) {
    l.server_first_ms = per_change.first().copied().flatten().map(round1);
    let samples: Vec<f64> = per_change.into_iter().flatten().collect();
    let s = sorted(&samples);
    l.server_median_ms = median(&s).map(round1);
    l.server_p95_ms = percentile(&s, 95.0).map(round1);
    l.server_samples_ms = samples.into_iter().map(round1).collect();
}

struct ChangeOutcome {
    sent: SystemTime,
    latency: Option<f64>,
    hash_changed: bool,
}

/// The outcomes of a series of changes of one kind.
struct Series {
    samples: Vec<f64>,
    /// The first change's latency; None when it timed out.
    first: Option<f64>,
    timeouts: usize,
    hashes_changed: bool,
}

impl Series {
    fn new() -> Self {
        Series {
            samples: Vec::new(),
            first: None,
            timeouts: 0,
            hashes_changed: true,
        }
    }

    /// Records one change; the third that rolled nothing ends the run (`what` names the kind).
    fn record(&mut self, outcome: &ChangeOutcome, what: &str) -> Result<()> {
        if self.samples.is_empty() && self.timeouts == 0 {
            self.first = outcome.latency;
        }
        match outcome.latency {
            Some(l) => self.samples.push(l),
            None => self.timeouts += 1,
        }
        self.hashes_changed &= outcome.hash_changed;
        anyhow::ensure!(self.timeouts < 3, "3 {what} rolled nothing within 30 s");
        Ok(())
    }

    fn latency(self) -> Latency {
        latency(self.samples, self.first, self.timeouts, self.hashes_changed)
    }
}

/// Sends one change and waits (30 s at most) until the device-plugin DaemonSet's generation
/// moves past the one before it; the latency runs from just before the request is sent.
async fn timed_change<F, Fut>(
    seen: &tokio::sync::watch::Receiver<Seen>,
    send: F,
) -> Result<ChangeOutcome>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<(), kube::Error>>,
{
    let mut rx = seen.clone();
    let (generation, hash) = {
        let s = rx.borrow_and_update();
        (s.plugin_generation, s.plugin_hash.clone())
    };
    let sent = SystemTime::now();
    send().await?;
    let waited = tokio::time::timeout(
        Duration::from_secs(30),
        rx.wait_for(|s| s.plugin_generation > generation),
    )
    .await;
    Ok(match waited {
        Ok(Ok(s)) => ChangeOutcome {
            sent,
            latency: s.plugin_changed_at.map(|t| {
                t.duration_since(sent)
                    .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
            }),
            hash_changed: s.plugin_hash.is_some() && s.plugin_hash != hash,
        },
        _ => ChangeOutcome {
            sent,
            latency: None,
            hash_changed: false,
        },
    })
}

async fn await_policy_ready(
    policies: &Api<DynamicObject>,
    timeout: Duration,
) -> Result<SystemTime> {
    e2e::wait::until(timeout, "policy status ready", || {
        let policies = policies.clone();
        async move {
            let p = policies.get(POLICY).await?;
            let status = &p.data["status"];
            let observed = status["conditions"]
                .as_array()
                .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
                .and_then(|c| c["observedGeneration"].as_i64());
            Ok(
                if status["state"] == "ready" && observed >= p.metadata.generation {
                    Ok(SystemTime::now())
                } else {
                    Err(format!(
                        "state {} {}",
                        status["state"],
                        status["conditions"]
                            .as_array()
                            .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
                            .map(|c| c["message"].to_string())
                            .unwrap_or_default()
                    ))
                },
            )
        }
    })
    .await
}

/// Deletes the policy, waits for its operands to go, removes the operator's node labels.
async fn reset(
    admin: &Client,
    identity: Option<&OperatorIdentity>,
    gpu_names: &[String],
) -> Result<()> {
    let policies = policy_api(admin);
    match policies.delete(POLICY, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => return Err(e.into()),
    }
    if let Some(id) = identity {
        let ds: Api<DaemonSet> = Api::namespaced(admin.clone(), &id.namespace);
        e2e::wait::until_none_left(
            &ds,
            &ListParams::default(),
            Duration::from_secs(900),
            "operand DaemonSets gone",
        )
        .await?;
    }
    let api: Api<Node> = Api::all(admin.clone());
    futures::stream::iter(gpu_names.iter().map(|name| {
        let api = api.clone();
        async move {
            let node = api.get_metadata(name).await?;
            let labels: serde_json::Map<String, Value> = node
                .labels()
                .keys()
                .filter(|k| {
                    OPERATOR_NODE_LABEL_PREFIXES
                        .iter()
                        .any(|p| k.starts_with(p))
                })
                .map(|k| (k.clone(), Value::Null))
                .collect();
            if !labels.is_empty() {
                api.patch(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"labels": labels}})),
                )
                .await?;
            }
            Ok::<_, anyhow::Error>(())
        }
    }))
    .buffer_unordered(32)
    .collect::<Vec<_>>()
    .await
    .into_iter()
    .collect::<Result<Vec<()>>>()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let s: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(percentile(&s, 95.0), Some(19.0));
        assert_eq!(percentile(&s, 100.0), Some(20.0));
        assert_eq!(median(&s), Some(10.5));
        assert_eq!(median(&[3.0]), Some(3.0));
        assert_eq!(percentile(&[], 95.0), None);
    }

    #[test]
    fn options_parse() {
        let o = parse(
            [
                "--nodes",
                "1000",
                "--gpu-operator",
                "/x",
                "--operator-name",
                "nv",
                "--operator-cmd",
                "nv-operator --flag",
                "--operator-cmd",
                "",
            ]
            .map(String::from)
            .into_iter(),
        )
        .unwrap();
        assert_eq!(o.nodes, 1000);
        assert_eq!(
            o.others,
            vec![("nv".to_string(), "nv-operator --flag".to_string())]
        );
        assert!(parse(["--bogus".to_string()].into_iter()).is_err());
    }

    #[test]
    fn the_policy_names_the_first_sharing_config() {
        let p = policy_value(None).unwrap();
        assert_eq!(p["spec"]["devicePlugin"]["config"]["name"], CONFIG_A);
        assert_eq!(p["kind"], "ClusterPolicy");
    }

    #[test]
    fn the_first_change_is_reported_as_itself_or_not_at_all() {
        let outcome = |latency| ChangeOutcome {
            sent: SystemTime::now(),
            latency,
            hash_changed: true,
        };
        let mut series = Series::new();
        for l in [Some(70.0), Some(20.0), None] {
            series.record(&outcome(l), "changes").unwrap();
        }
        assert_eq!(series.latency().first_ms, Some(70.0));
        // A first change that timed out is not replaced by the second.
        let mut series = Series::new();
        for l in [None, Some(20.0)] {
            series.record(&outcome(l), "changes").unwrap();
        }
        assert_eq!(series.latency().first_ms, None);

        let mut l = Latency::default();
        fill_server(&mut l, vec![None, Some(12.34), Some(10.0)]);
        assert_eq!(l.server_first_ms, None);
        assert_eq!(l.server_samples_ms, vec![12.3, 10.0]);
    }

    #[test]
    fn policy_merge_overrides_one_field_and_keeps_the_rest() {
        let o = parse(
            [
                "--policy-merge",
                r#"{"spec":{"daemonsets":{"updateStrategy":"OnDelete"}}}"#,
            ]
            .map(String::from)
            .into_iter(),
        )
        .unwrap();
        let p = policy_value(o.policy_merge.as_ref()).unwrap();
        assert_eq!(p["spec"]["daemonsets"]["updateStrategy"], "OnDelete");
        assert_eq!(
            p["spec"]["daemonsets"]["rollingUpdate"]["maxUnavailable"],
            "1"
        );
        assert_eq!(p["spec"]["devicePlugin"]["config"]["name"], CONFIG_A);
        assert!(parse(["--policy-merge", "[1]"].map(String::from).into_iter()).is_err());
    }
}
