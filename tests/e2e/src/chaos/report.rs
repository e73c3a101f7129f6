//! What a chaos run measured (pure): per fault kind, how many were injected, how long the
//! cluster took to converge after each (median and maximum), and how often a replica exited
//! without being killed.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use super::faults::Fault;

#[derive(Clone, Debug, Default)]
pub struct KindStats {
    pub convergence: Vec<Duration>,
    /// Replica exits the driver did not cause, during this kind's faults.
    pub exits: u32,
}

#[derive(Clone, Debug, Default)]
pub struct Report {
    pub seed: u64,
    pub kinds: BTreeMap<Fault, KindStats>,
    /// Writes by each replica over the run (Lease writes aside).
    pub writes: BTreeMap<String, u64>,
}

impl Report {
    pub fn record(&mut self, fault: Fault, convergence: Duration, exits: u32) {
        let stats = self.kinds.entry(fault).or_default();
        stats.convergence.push(convergence);
        stats.exits += exits;
    }

    pub fn faults(&self) -> usize {
        self.kinds.values().map(|s| s.convergence.len()).sum()
    }
}

/// The median of `values` (the upper one of an even count); zero for none.
pub fn median(values: &[Duration]) -> Duration {
    let mut sorted = values.to_vec();
    sorted.sort();
    sorted.get(sorted.len() / 2).copied().unwrap_or_default()
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "chaos run, seed {} (CHAOS_SEED={} replays it): {} faults",
            self.seed,
            self.seed,
            self.faults()
        )?;
        writeln!(
            f,
            "{:<36} {:>5} {:>10} {:>10} {:>6}",
            "fault", "count", "median s", "max s", "exits"
        )?;
        for (fault, stats) in &self.kinds {
            let max = stats.convergence.iter().max().copied().unwrap_or_default();
            writeln!(
                f,
                "{:<36} {:>5} {:>10.1} {:>10.1} {:>6}",
                fault.name(),
                stats.convergence.len(),
                median(&stats.convergence).as_secs_f64(),
                max.as_secs_f64(),
                stats.exits
            )?;
        }
        write!(f, "writes by replica (Lease aside): {:?}", self.writes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_table_per_kind() {
        let s = Duration::from_secs;
        assert_eq!(median(&[s(3), s(1), s(2)]), s(2));
        assert_eq!(median(&[]), Duration::ZERO);
        let mut report = Report {
            seed: 7,
            ..Report::default()
        };
        report.record(Fault::EtcdStop, s(4), 0);
        report.record(Fault::EtcdStop, s(2), 1);
        report.record(Fault::NodeAdded, s(1), 0);
        assert_eq!(report.faults(), 3);
        let text = report.to_string();
        assert!(text.contains("CHAOS_SEED=7"), "{text}");
        let etcd = text
            .lines()
            .find(|l| l.starts_with("etcd stopped"))
            .unwrap_or_default();
        assert!(
            etcd.contains(" 2 ") && etcd.contains("4.0") && etcd.ends_with('1'),
            "{etcd}"
        );
    }
}
