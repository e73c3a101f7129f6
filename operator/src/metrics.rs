//! Prometheus metrics of the operator (no IO here; `http` serves them): reconciles, errors,
//! durations, GPU nodes and ready operands.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    reason: String,
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
}

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
        Metrics {
            registry: Arc::new(registry),
            reconciles,
            errors,
            duration,
            gpu_nodes,
            ready_operands,
        }
    }
}

impl Metrics {
    pub fn observe_reconcile(&self, took: Duration) {
        self.reconciles.inc();
        self.duration.observe(took.as_secs_f64());
    }

    pub fn observe_error(&self, reason: &str) {
        self.errors
            .get_or_create(&ErrorLabels {
                reason: reason.to_string(),
            })
            .inc();
    }

    pub fn observe_state(&self, gpu_nodes: usize, ready_operands: usize) {
        self.gpu_nodes
            .set(i64::try_from(gpu_nodes).unwrap_or(i64::MAX));
        self.ready_operands
            .set(i64::try_from(ready_operands).unwrap_or(i64::MAX));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconciles_and_errors_are_exported() {
        let m = Metrics::default();
        m.observe_reconcile(Duration::from_millis(3));
        m.observe_error("ApplyFailed");
        m.observe_state(6, 5);
        let text = m.encode();
        assert!(text.contains("gpu_operator_reconciles_total 1"), "{text}");
        assert!(
            text.contains(r#"gpu_operator_reconcile_errors_total{reason="ApplyFailed"} 1"#),
            "{text}"
        );
        assert!(text.contains("gpu_operator_gpu_nodes 6"), "{text}");
    }
}
