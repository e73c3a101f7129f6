//! The benchmark's results: what one run measures (serialised to `n<N>.json`), and the
//! Markdown tables made from one run or several.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::SystemTime;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

// ---------------------------------------------------------------------------------------------
// Results

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Latency {
    /// Client side: request sent -> template change seen by a watch on the DaemonSet.
    pub samples_ms: Vec<f64>,
    pub median_ms: Option<f64>,
    pub p95_ms: Option<f64>,
    pub max_ms: Option<f64>,
    /// Server side (audit timestamps): trigger request received -> the operator's DaemonSet
    /// patch completed.
    pub server_samples_ms: Vec<f64>,
    pub server_median_ms: Option<f64>,
    pub server_p95_ms: Option<f64>,
    /// The first change of the series (after the steady window: no write for a minute), client
    /// side and server side; None when it timed out or left no DaemonSet patch.
    #[serde(default)]
    pub first_ms: Option<f64>,
    #[serde(default)]
    pub server_first_ms: Option<f64>,
    /// Changes after which no template update came within 30 s.
    pub timeouts: usize,
    /// Every change gave the pod template a new config-hash annotation value.
    pub hash_changed_every_time: bool,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Memory {
    pub idle_rss_mib: f64,
    pub peak_rss_mib: f64,
    pub ready_rss_mib: f64,
    pub steady_rss_mib: f64,
    pub final_rss_mib: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Cpu {
    pub startup_s: f64,
    pub convergence_s: f64,
    pub settle_s: f64,
    pub steady_s: f64,
    pub rollouts_s: f64,
    pub total_s: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Convergence {
    pub expected_daemonsets: Vec<String>,
    pub first_daemonset_s: Option<f64>,
    pub all_daemonsets_s: Option<f64>,
    /// Last node label patch of the operator after the policy was created (API server time).
    pub nodes_labelled_s: Option<f64>,
    pub node_label_patches: u64,
    pub ready_s: Option<f64>,
    pub requests: BTreeMap<String, u64>,
    pub writes: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Steady {
    pub window_s: f64,
    pub settle_s: f64,
    pub label_rewrites: usize,
    pub requests_by_verb: BTreeMap<String, u64>,
    pub requests: BTreeMap<String, u64>,
    pub writes_excluding_lease: u64,
    pub write_details: Vec<String>,
    pub lease_writes: u64,
    pub reconciles: Option<f64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct OperatorReport {
    pub name: String,
    pub command: String,
    pub rbac: String,
    pub convergence: Convergence,
    pub steady: Steady,
    pub policy_patch: Latency,
    pub configmap_edit: Latency,
    pub memory: Memory,
    pub cpu: Cpu,
    pub load: BTreeMap<String, String>,
    pub error: Option<String>,
    /// Set when the operator ran from its image under runc (`--image`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<ContainerReport>,
}

/// The operator's container under runc: the image, and what its cgroup said at the end of the
/// run (while it still ran).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct ContainerReport {
    pub image: String,
    pub image_digest: String,
    /// The chart's limits as rendered (`helm template`).
    pub memory_limit_mib: Option<f64>,
    pub cpu_limit_millicores: Option<u64>,
    pub cgroup_version: String,
    /// memory.max_usage_in_bytes (v1) or memory.peak (v2): page cache and kernel memory
    /// charged to the container included, so above the process's VmHWM.
    pub cgroup_memory_peak_mib: Option<f64>,
    pub oom_kills: Option<u64>,
    /// How often usage reached the limit (v1 memory.failcnt, v2 `max` events).
    pub memory_limit_hits: Option<u64>,
    pub cpu_throttled_periods: Option<u64>,
    pub cpu_throttled_s: Option<f64>,
    /// The probes' report at the end.
    pub probes: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Report {
    pub gpu_nodes: usize,
    pub cpu_nodes: usize,
    pub started: String,
    pub machine: String,
    pub nodes_created_s: f64,
    pub nodes_ready_s: f64,
    pub operators: Vec<OperatorReport>,
    pub control_plane_rss_mib: BTreeMap<String, f64>,
    pub load_end: String,
    /// `--policy-merge`: what this run changed in the default policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_merge: Option<serde_json::Value>,
}

pub(crate) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub(crate) fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .unwrap_or(0);
    format!("{cores} cores, {} GiB memory", mem / 1024 / 1024)
}

pub(crate) fn secs_since(t0: SystemTime, t: SystemTime) -> f64 {
    t.duration_since(t0).map_or(0.0, |d| d.as_secs_f64())
}

/// Nearest-rank percentile of sorted samples.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    Some(sorted[rank.min(sorted.len()) - 1])
}

pub(crate) fn median(sorted: &[f64]) -> Option<f64> {
    let n = sorted.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(sorted[n / 2]),
        _ => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

pub(crate) fn sorted(v: &[f64]) -> Vec<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s
}

// ---------------------------------------------------------------------------------------------
// Markdown

pub(crate) fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_string(), |x| format!("{x:.digits$}"))
}

pub(crate) fn counts(m: &BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return "none".into();
    }
    m.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Rows of one operator's figures: (metric, value).
pub(crate) fn rows(r: &OperatorReport) -> Vec<(String, String)> {
    let c = &r.convergence;
    let lat = |l: &Latency| {
        format!(
            "{} / {} / {} (n={}{})",
            opt(l.median_ms, 1),
            opt(l.p95_ms, 1),
            opt(l.max_ms, 1),
            l.samples_ms.len(),
            if l.timeouts > 0 {
                format!(", {} timed out", l.timeouts)
            } else {
                String::new()
            }
        )
    };
    let server = |l: &Latency| {
        format!(
            "{} / {} (n={})",
            opt(l.server_median_ms, 1),
            opt(l.server_p95_ms, 1),
            l.server_samples_ms.len()
        )
    };
    vec![
        (
            "policy created -> first / all operand DaemonSets applied (s)".into(),
            format!(
                "{} / {} ({} DaemonSets)",
                opt(c.first_daemonset_s, 2),
                opt(c.all_daemonsets_s, 2),
                c.expected_daemonsets.len()
            ),
        ),
        (
            "policy created -> last node label patch (s), label patches".into(),
            format!("{}, {}", opt(c.nodes_labelled_s, 2), c.node_label_patches),
        ),
        (
            "policy created -> status.state=ready (s)".into(),
            opt(c.ready_s, 1),
        ),
        (
            "kubectl patch clusterpolicy -> device-plugin template, median / p95 / max (ms)".into(),
            lat(&r.policy_patch),
        ),
        (
            "  same, API server timestamps, median / p95 (ms)".into(),
            server(&r.policy_patch),
        ),
        (
            "  the first one, after the steady window (no write for a minute), client / server (ms)"
                .into(),
            format!(
                "{} / {}",
                opt(r.policy_patch.first_ms, 1),
                opt(r.policy_patch.server_first_ms, 1)
            ),
        ),
        (
            "ConfigMap edit -> device-plugin template, median / p95 / max (ms)".into(),
            lat(&r.configmap_edit),
        ),
        (
            "  same, API server timestamps, median / p95 (ms)".into(),
            server(&r.configmap_edit),
        ),
        (
            "RSS idle (caches filled, no policy) (MiB)".into(),
            format!("{:.1}", r.memory.idle_rss_mib),
        ),
        (
            "RSS at ready / steady / after rollouts (MiB)".into(),
            format!(
                "{:.1} / {:.1} / {:.1}",
                r.memory.ready_rss_mib, r.memory.steady_rss_mib, r.memory.final_rss_mib
            ),
        ),
        (
            "RSS peak, VmHWM (MiB)".into(),
            format!("{:.1}", r.memory.peak_rss_mib),
        ),
        (
            "CPU s: start-up / convergence / settle / steady / rollouts / total".into(),
            format!(
                "{:.2} / {:.2} / {:.2} / {:.2} / {:.2} / {:.2}",
                r.cpu.startup_s,
                r.cpu.convergence_s,
                r.cpu.settle_s,
                r.cpu.steady_s,
                r.cpu.rollouts_s,
                r.cpu.total_s
            ),
        ),
        (
            format!(
                "steady {:.0} s ({} gfd.timestamp rewrites): requests by verb",
                r.steady.window_s, r.steady.label_rewrites
            ),
            counts(&r.steady.requests_by_verb),
        ),
        (
            "steady: writes, Lease aside (target 0) / Lease writes".into(),
            format!(
                "**{}** / {}",
                r.steady.writes_excluding_lease, r.steady.lease_writes
            ),
        ),
        (
            "steady: reconcile passes".into(),
            opt(r.steady.reconciles, 0),
        ),
        (
            "convergence: writes (Lease aside)".into(),
            c.writes.to_string(),
        ),
        (
            "runc container: cgroup memory peak / limit (MiB), OOM kills, CPU throttled (s)".into(),
            r.container.as_ref().map_or_else(
                || "host process".to_string(),
                |k| {
                    format!(
                        "{} / {} MiB, {} OOM kills, {} s",
                        opt(k.cgroup_memory_peak_mib, 1),
                        opt(k.memory_limit_mib, 0),
                        k.oom_kills.map_or_else(|| "-".to_string(), |n| n.to_string()),
                        opt(k.cpu_throttled_s, 1)
                    )
                },
            ),
        ),
    ]
}

pub(crate) fn markdown(report: &Report) -> String {
    let mut out = format!(
        "## {} GPU nodes (+{} CPU node)\n\nMachine: {}; load (1/5/15 min) at convergence / steady / rollouts / end: {}; started {}.\nNodes created in {:.1} s, all Ready after {:.1} s.\n\n",
        report.gpu_nodes,
        report.cpu_nodes,
        report.machine,
        report
            .operators
            .iter()
            .map(|o| format!(
                "{} / {} / {}",
                o.load.get("convergence").cloned().unwrap_or_default(),
                o.load.get("steady").cloned().unwrap_or_default(),
                o.load.get("rollouts").cloned().unwrap_or_default()
            ))
            .collect::<Vec<_>>()
            .join("; ")
            + &format!(" / {}", report.load_end),
        report.started,
        report.nodes_created_s,
        report.nodes_ready_s,
    );
    if let Some(patch) = &report.policy_merge {
        out.push_str(&format!(
            "Policy: examples/clusterpolicy-default.yaml merged with `{patch}`.\n\n"
        ));
    }
    out.push_str("| metric |");
    for o in &report.operators {
        out.push_str(&format!(" {} |", o.name));
    }
    out.push_str("\n|---|");
    for _ in &report.operators {
        out.push_str("---|");
    }
    out.push('\n');
    let all: Vec<Vec<(String, String)>> = report.operators.iter().map(rows).collect();
    if let Some(first) = all.first() {
        for (i, (metric, _)) in first.iter().enumerate() {
            out.push_str(&format!("| {metric} |"));
            for r in &all {
                out.push_str(&format!(" {} |", r[i].1));
            }
            out.push('\n');
        }
    }
    for o in &report.operators {
        out.push_str(&format!(
            "\n{}: steady requests by verb and resource: {}.\nConvergence requests: {}.\n",
            o.name,
            counts(&o.steady.requests),
            counts(&o.convergence.requests)
        ));
        if !o.steady.write_details.is_empty() {
            out.push_str(&format!(
                "Steady writes: {}\n",
                o.steady.write_details.join("; ")
            ));
        }
        if let Some(e) = &o.error {
            out.push_str(&format!("\n**{} failed**:\n```\n{e}\n```\n", o.name));
        }
    }
    out.push_str(&format!(
        "\nControl plane RSS (MiB) at the end: {}\n",
        report
            .control_plane_rss_mib
            .iter()
            .map(|(k, v)| format!("{k} {v:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    out
}

/// One table over several runs (one column per N), with memory growth per 1,000 nodes.
pub(crate) fn summary(files: &[PathBuf]) -> Result<String> {
    let mut reports: Vec<Report> = files
        .iter()
        .map(|f| {
            let text =
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            serde_json::from_str(&text).with_context(|| format!("parsing {}", f.display()))
        })
        .collect::<Result<_>>()?;
    reports.sort_by_key(|r| r.gpu_nodes);
    let ours: Vec<(&Report, &OperatorReport)> = reports
        .iter()
        .filter_map(|r| r.operators.first().map(|o| (r, o)))
        .collect();
    let mut out = String::from("| metric |");
    for (r, _) in &ours {
        out.push_str(&format!(" N = {} |", r.gpu_nodes));
    }
    out.push_str("\n|---|");
    for _ in &ours {
        out.push_str("---|");
    }
    out.push('\n');
    let all: Vec<Vec<(String, String)>> = ours.iter().map(|(_, o)| rows(o)).collect();
    if let Some(first) = all.first() {
        for (i, (metric, _)) in first.iter().enumerate() {
            out.push_str(&format!("| {metric} |"));
            for r in &all {
                out.push_str(&format!(" {} |", r[i].1));
            }
            out.push('\n');
        }
    }
    out.push_str("| load (1 min) at convergence / steady / rollouts |");
    for (_, o) in &ours {
        out.push_str(&format!(
            " {} / {} / {} |",
            first_field(o.load.get("convergence")),
            first_field(o.load.get("steady")),
            first_field(o.load.get("rollouts"))
        ));
    }
    out.push('\n');
    if let (Some((a, oa)), Some((b, ob))) = (ours.first(), ours.last())
        && b.gpu_nodes > a.gpu_nodes
    {
        let per_k = |x: f64, y: f64| (y - x) / (b.gpu_nodes - a.gpu_nodes) as f64 * 1000.0;
        out.push_str(&format!(
            "\nMemory growth per 1,000 nodes ({} -> {}): idle {:.1} MiB, steady {:.1} MiB, peak {:.1} MiB.\n",
            a.gpu_nodes,
            b.gpu_nodes,
            per_k(oa.memory.idle_rss_mib, ob.memory.idle_rss_mib),
            per_k(oa.memory.steady_rss_mib, ob.memory.steady_rss_mib),
            per_k(oa.memory.peak_rss_mib, ob.memory.peak_rss_mib),
        ));
    }
    Ok(out)
}

pub(crate) fn first_field(s: Option<&String>) -> String {
    s.and_then(|s| s.split_whitespace().next())
        .unwrap_or("-")
        .to_string()
}
