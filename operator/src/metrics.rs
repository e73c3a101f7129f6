//! Prometheus metrics of the operator (no IO here; `http` serves them): reconciles, errors,
//! durations, GPU nodes and ready operands; and NVIDIA's operator's metric names with their
//! meanings, so dashboards and alerts written for it keep working (docs/metrics.md lists both).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    reason: String,
}

/// Nodes per driver upgrade state, in the order of NVIDIA's `nodes_upgrades_*` gauges.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UpgradeCounts {
    pub in_progress: usize,
    pub done: usize,
    pub failed: usize,
    pub available: usize,
    pub pending: usize,
}

/// `gpu_operator_reconciliation_status` as NVIDIA's operator defines it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReconciliationStatus {
    /// Every operand ready.
    Success = 1,
    /// The operands are not ready (yet).
    NotReady = 0,
    /// No ClusterPolicy is in force (none, being deleted, or undecodable).
    PolicyUnavailable = -1,
    /// The reconcile failed (API errors, an object refused, an invalid config).
    OperatorError = -2,
}

/// NVIDIA's operator's metrics under their names.
#[derive(Clone, Default)]
struct NvidiaCompatible {
    gpu_nodes_total: Gauge,
    reconciliation_status: Gauge,
    reconciliation_last_success: Gauge<f64, AtomicU64>,
    reconciliation: Counter,
    reconciliation_failed: Counter,
    has_nfd_labels: Gauge,
    driver_auto_upgrade_enabled: Gauge,
    /// `nodes_upgrades_{in_progress,done,failed,available,pending}`: GPU nodes per driver upgrade
    /// state (controller::upgrade), 0 while automatic upgrades are off.
    upgrades: [Gauge; 5],
    /// `openshift_driver_toolkit_{enabled,nfd_too_old,imagestream_missing,rhcos_tags_missing,
    /// imagestream_broken}`.
    driver_toolkit: [Gauge; 5],
}

impl NvidiaCompatible {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "gpu_nodes_total",
            "Number of nodes with GPUs",
            self.gpu_nodes_total.clone(),
        );
        registry.register(
            "reconciliation_status",
            "1 if the reconciliation is currently successful, 0 if the operands are not ready, -1 if the cluster policy is unavailable, -2 if an error occurred within the operator.",
            self.reconciliation_status.clone(),
        );
        registry.register(
            "reconciliation_last_success_ts_seconds",
            "Timestamp (in seconds) of the last reconciliation loop success",
            self.reconciliation_last_success.clone(),
        );
        registry.register(
            "reconciliation",
            "Total number of reconciliation",
            self.reconciliation.clone(),
        );
        registry.register(
            "reconciliation_failed",
            "Number of failed reconciliation",
            self.reconciliation_failed.clone(),
        );
        registry.register(
            "reconciliation_has_nfd_labels",
            "1 if NFD mandatory kernel labels have been found, 0 otherwise",
            self.has_nfd_labels.clone(),
        );
        registry.register(
            "driver_auto_upgrade_enabled",
            "1 if driver auto upgrade is enabled 0 if not",
            self.driver_auto_upgrade_enabled.clone(),
        );
        let upgrades = [
            ("in_progress", "being upgraded"),
            ("done", "successfully upgraded"),
            ("failed", "whose upgrade failed"),
            ("available", "where an upgrade can be done"),
            ("pending", "where an upgrade is pending"),
        ];
        for ((name, what), gauge) in upgrades.into_iter().zip(&self.upgrades) {
            registry.register(
                format!("nodes_upgrades_{name}"),
                format!("Number of nodes {what}"),
                gauge.clone(),
            );
        }
        let toolkit = [
            (
                "enabled",
                "1 if OCP DriverToolkit is enabled, -1 if requested but could not be enabled, 0 if not requested",
            ),
            (
                "nfd_too_old",
                "1 if OCP DriverToolkit was requested but NFD does not expose the required OSTREE labels, 0 otherwise",
            ),
            (
                "imagestream_missing",
                "1 if OCP DriverToolkit was requested but its imagestream is not available, 0 otherwise",
            ),
            (
                "rhcos_tags_missing",
                "1 if OCP DriverToolkit is enabled but some of the RHCOS tags are missing, 0 otherwise",
            ),
            (
                "imagestream_broken",
                "1 if OCP DriverToolkit is enabled but its imagestream is broken (rhbz#2015024), 0 otherwise",
            ),
        ];
        for ((name, help), gauge) in toolkit.into_iter().zip(&self.driver_toolkit) {
            registry.register(
                format!("openshift_driver_toolkit_{name}"),
                help,
                gauge.clone(),
            );
        }
    }
}

/// The operator's metrics; cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    reconciles: Counter,
    errors: Family<ErrorLabels, Counter>,
    duration: Histogram,
    gpu_nodes: Gauge,
    ready_operands: Gauge,
    readiness_waiting: Family<StepLabels, Gauge>,
    quarantined: Gauge,
    quarantine_held: Gauge,
    nvidia: NvidiaCompatible,
}

/// The step a node waits on before its startup taint comes off.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StepLabels {
    step: String,
}

/// The steps of [`StepLabels`], each always exported (0 when no node waits on it).
const READINESS_STEPS: [&str; 3] = ["discovery", "validator", "device-plugin"];

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("gpu_operator");
        let reconciles = Counter::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let duration = Histogram::new([0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]);
        let gpu_nodes = Gauge::default();
        let ready_operands = Gauge::default();
        registry.register(
            "reconciles",
            "Reconcile passes of the active ClusterPolicy",
            reconciles.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Failed reconcile passes by reason",
            errors.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Duration of reconcile passes",
            duration.clone(),
        );
        registry.register(
            "gpu_nodes",
            "Nodes labelled nvidia.com/gpu.present=true",
            gpu_nodes.clone(),
        );
        registry.register(
            "ready_operands",
            "Operand workloads with every pod available",
            ready_operands.clone(),
        );
        let readiness_waiting = Family::<StepLabels, Gauge>::default();
        let quarantined = Gauge::default();
        let quarantine_held = Gauge::default();
        registry.register(
            "gpu_readiness_waiting_nodes",
            "Nodes keeping their gpuReadiness startup taint, by the step they wait on",
            readiness_waiting.clone(),
        );
        registry.register(
            "gpu_quarantined_nodes",
            "Nodes quarantined by gpuReadiness for missing GPUs or a failing validator",
            quarantined.clone(),
        );
        registry.register(
            "gpu_quarantine_breaker_held",
            "1 while more nodes are unhealthy at once than gpuReadiness may quarantine",
            quarantine_held.clone(),
        );
        for step in READINESS_STEPS {
            let _ = readiness_waiting.get_or_create(&StepLabels {
                step: step.to_owned(),
            });
        }
        let nvidia = NvidiaCompatible::default();
        nvidia.register(&mut registry);
        Metrics {
            registry: Arc::new(registry),
            reconciles,
            errors,
            duration,
            gpu_nodes,
            ready_operands,
            readiness_waiting,
            quarantined,
            quarantine_held,
            nvidia,
        }
    }
}

impl Metrics {
    pub fn observe_reconcile(&self, took: Duration) {
        self.reconciles.inc();
        self.nvidia.reconciliation.inc();
        self.duration.observe(took.as_secs_f64());
    }

    pub fn observe_error(&self, reason: &str) {
        self.errors
            .get_or_create(&ErrorLabels {
                reason: reason.to_string(),
            })
            .inc();
        self.nvidia.reconciliation_failed.inc();
        self.observe_status(ReconciliationStatus::OperatorError, 0.0);
    }

    /// The outcome of a pass; `now` (seconds since the epoch) is recorded as the last success
    /// when it succeeded.
    pub fn observe_status(&self, status: ReconciliationStatus, now: f64) {
        self.nvidia.reconciliation_status.set(status as i64);
        if status == ReconciliationStatus::Success {
            self.nvidia.reconciliation_last_success.set(now);
        }
    }

    /// What a pass saw. `toolkit`: the `openshift_driver_toolkit_*` gauges in their order
    /// (operands::driver_toolkit::gauges).
    pub fn observe_state(
        &self,
        gpu_nodes: usize,
        ready_operands: usize,
        nfd_labelled_nodes: usize,
        toolkit: [i64; 5],
    ) {
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.gpu_nodes.set(count(gpu_nodes));
        self.ready_operands.set(count(ready_operands));
        self.nvidia.gpu_nodes_total.set(count(gpu_nodes));
        self.nvidia
            .has_nfd_labels
            .set(i64::from(nfd_labelled_nodes > 0));
        for (gauge, value) in self.nvidia.driver_toolkit.iter().zip(toolkit) {
            gauge.set(value);
        }
    }

    /// Driver upgrades: whether they are on, and the nodes per state (all 0 when off).
    pub fn observe_upgrades(&self, enabled: bool, summary: &UpgradeCounts) {
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.nvidia
            .driver_auto_upgrade_enabled
            .set(i64::from(enabled));
        let values = [
            summary.in_progress,
            summary.done,
            summary.failed,
            summary.available,
            summary.pending,
        ];
        for (gauge, value) in self.nvidia.upgrades.iter().zip(values) {
            gauge.set(count(value));
        }
    }

    /// GPU readiness: nodes waiting per step (by the step names of
    /// crate::gpu_readiness::Wait::step), quarantined nodes, and whether the breaker holds.
    pub fn observe_readiness<'a>(
        &self,
        waiting: impl IntoIterator<Item = &'a str>,
        quarantined: usize,
        held: bool,
    ) {
        let mut counts: BTreeMap<&str, i64> = READINESS_STEPS.iter().map(|s| (*s, 0)).collect();
        for step in waiting {
            *counts.entry(step).or_default() += 1;
        }
        for (step, n) in counts {
            self.readiness_waiting
                .get_or_create(&StepLabels {
                    step: step.to_owned(),
                })
                .set(n);
        }
        self.quarantined
            .set(i64::try_from(quarantined).unwrap_or(i64::MAX));
        self.quarantine_held.set(i64::from(held));
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Every sample name `/metrics` carries, from the registry's `# TYPE` lines: a gauge's own
/// name, a counter's with `_total`, a histogram's `_bucket`, `_sum` and `_count`. The names that
/// alert rules and dashboards may select (tests/e2e/tests/monitoring.rs checks them against it).
pub fn exported_names() -> Vec<String> {
    // A labelled family is encoded only once it has a series.
    let metrics = Metrics::default();
    metrics.observe_error("any");
    let text = metrics.encode();
    let mut names = Vec::new();
    for line in text.lines() {
        let mut words = line.split(' ');
        let (Some("#"), Some("TYPE"), Some(name), Some(kind)) =
            (words.next(), words.next(), words.next(), words.next())
        else {
            continue;
        };
        match kind {
            "counter" => names.push(format!("{name}_total")),
            "histogram" => {
                names.extend(["_bucket", "_sum", "_count"].map(|s| format!("{name}{s}")));
            }
            _ => names.push(name.to_owned()),
        }
    }
    names
}

/// NVIDIA's operator's metric names (v26.7), as its dashboards and alerts use them.
pub const NVIDIA_METRICS: [&str; 17] = [
    "gpu_operator_gpu_nodes_total",
    "gpu_operator_reconciliation_last_success_ts_seconds",
    "gpu_operator_reconciliation_status",
    "gpu_operator_reconciliation_total",
    "gpu_operator_reconciliation_failed_total",
    "gpu_operator_reconciliation_has_nfd_labels",
    "gpu_operator_openshift_driver_toolkit_enabled",
    "gpu_operator_openshift_driver_toolkit_nfd_too_old",
    "gpu_operator_openshift_driver_toolkit_imagestream_missing",
    "gpu_operator_openshift_driver_toolkit_rhcos_tags_missing",
    "gpu_operator_openshift_driver_toolkit_imagestream_broken",
    "gpu_operator_driver_auto_upgrade_enabled",
    "gpu_operator_nodes_upgrades_in_progress",
    "gpu_operator_nodes_upgrades_done",
    "gpu_operator_nodes_upgrades_failed",
    "gpu_operator_nodes_upgrades_available",
    "gpu_operator_nodes_upgrades_pending",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconciles_and_errors_are_exported() {
        let m = Metrics::default();
        m.observe_reconcile(Duration::from_millis(3));
        m.observe_error("ApplyFailed");
        m.observe_state(6, 5, 6, [0; 5]);
        let text = m.encode();
        assert!(text.contains("gpu_operator_reconciles_total 1"), "{text}");
        assert!(
            text.contains(r#"gpu_operator_reconcile_errors_total{reason="ApplyFailed"} 1"#),
            "{text}"
        );
        assert!(text.contains("gpu_operator_gpu_nodes 6"), "{text}");
    }

    #[test]
    fn nvidia_metrics_holds_every_name_dashboards_of_nvidias_operator_use() {
        // The names teams' monitoring of NVIDIA's operator uses (its dashboards and alerts); the
        // e2e scrape in tests/e2e/tests/apply.rs looks for each name of NVIDIA_METRICS on a
        // running operator.
        let mut listed = vec![
            "gpu_operator_gpu_nodes_total".to_owned(),
            "gpu_operator_reconciliation_status".to_owned(),
            "gpu_operator_reconciliation_total".to_owned(),
            "gpu_operator_reconciliation_failed_total".to_owned(),
            "gpu_operator_reconciliation_last_success_ts_seconds".to_owned(),
            "gpu_operator_reconciliation_has_nfd_labels".to_owned(),
            "gpu_operator_driver_auto_upgrade_enabled".to_owned(),
        ];
        for s in ["in_progress", "done", "failed", "available", "pending"] {
            listed.push(format!("gpu_operator_nodes_upgrades_{s}"));
        }
        for s in [
            "enabled",
            "nfd_too_old",
            "imagestream_missing",
            "rhcos_tags_missing",
            "imagestream_broken",
        ] {
            listed.push(format!("gpu_operator_openshift_driver_toolkit_{s}"));
        }
        for name in &listed {
            assert!(NVIDIA_METRICS.contains(&name.as_str()), "{name} missing");
        }
        assert_eq!(listed.len(), NVIDIA_METRICS.len());
    }

    #[test]
    fn exported_names_are_the_sample_names_including_unobserved_families() {
        let names = exported_names();
        for name in NVIDIA_METRICS {
            assert!(names.iter().any(|n| n == name), "{name} missing: {names:?}");
        }
        for name in [
            "gpu_operator_reconciles_total",
            "gpu_operator_reconcile_errors_total",
            "gpu_operator_reconcile_duration_seconds_bucket",
            "gpu_operator_reconcile_duration_seconds_count",
            "gpu_operator_ready_operands",
        ] {
            assert!(names.iter().any(|n| n == name), "{name} missing: {names:?}");
        }
        // A counter's family name is not a sample name.
        assert!(!names.iter().any(|n| n == "gpu_operator_reconciles"));
    }

    #[test]
    fn every_nvidia_metric_name_is_exported_with_its_meaning() {
        let m = Metrics::default();
        m.observe_reconcile(Duration::from_millis(3));
        m.observe_state(6, 5, 6, [0; 5]);
        m.observe_status(ReconciliationStatus::Success, 1_700_000_000.0);
        let text = m.encode();
        let sample = |name: &str| {
            text.lines()
                .find(|l| l.split([' ', '{']).next() == Some(name))
                .map(|l| l.rsplit(' ').next().unwrap_or_default().to_owned())
        };
        for name in NVIDIA_METRICS {
            assert!(sample(name).is_some(), "{name} missing:\n{text}");
        }
        assert_eq!(sample("gpu_operator_gpu_nodes_total").as_deref(), Some("6"));
        assert_eq!(
            sample("gpu_operator_reconciliation_status").as_deref(),
            Some("1")
        );
        assert_eq!(
            sample("gpu_operator_reconciliation_total").as_deref(),
            Some("1")
        );
        assert_eq!(
            sample("gpu_operator_reconciliation_last_success_ts_seconds").as_deref(),
            Some("1700000000.0")
        );
        m.observe_error("ApplyFailed");
        let text = m.encode();
        assert!(
            text.contains("gpu_operator_reconciliation_status -2"),
            "{text}"
        );
        assert!(
            text.contains("gpu_operator_reconciliation_failed_total 1"),
            "{text}"
        );
    }
}
