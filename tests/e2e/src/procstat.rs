//! Memory and CPU time of a process (and its children) from /proc, for the benchmark: resident
//! set (`VmRSS`), its peak (`VmHWM`) and user + system CPU seconds (`/proc/PID/stat`).

use std::process::Command;

use anyhow::{Context, Result};

/// One reading of a process tree.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcStat {
    /// Resident set now, KiB (`VmRSS`), summed over the tree.
    pub rss_kib: u64,
    /// Peak resident set, KiB (`VmHWM`), summed over the tree (an upper bound for several
    /// processes, exact for one).
    pub hwm_kib: u64,
    /// User + system CPU time, seconds, summed over the tree.
    pub cpu_seconds: f64,
}

impl ProcStat {
    pub fn rss_mib(&self) -> f64 {
        self.rss_kib as f64 / 1024.0
    }

    pub fn hwm_mib(&self) -> f64 {
        self.hwm_kib as f64 / 1024.0
    }
}

/// Clock ticks per second of `/proc/PID/stat` times (`getconf CLK_TCK`, 100 on Linux).
pub fn clock_ticks() -> u64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100)
}

/// `VmRSS` and `VmHWM` (KiB) from the text of `/proc/PID/status`.
fn parse_status(text: &str) -> Result<(u64, u64)> {
    let field = |name: &str| -> Result<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("{name} missing in /proc status"))
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// Parent pid and utime + stime (ticks) from the text of `/proc/PID/stat`. The command name
/// (field 2) may hold spaces and parentheses, so fields are counted after the last `)`.
fn parse_stat(text: &str) -> Result<(u32, u64)> {
    let rest = text
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("malformed /proc stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state): ppid is field 4, utime 14, stime 15.
    let get = |i: usize| -> Result<u64> {
        fields
            .get(i)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("field {} missing in /proc stat", i + 3))
    };
    Ok((get(1)? as u32, get(11)? + get(12)?))
}

/// A single process: its memory and CPU time.
pub fn read(pid: u32, ticks: u64) -> Result<ProcStat> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    let (rss_kib, hwm_kib) = parse_status(&status)?;
    let (_, cpu) = parse_stat(&stat)?;
    Ok(ProcStat {
        rss_kib,
        hwm_kib,
        cpu_seconds: cpu as f64 / ticks as f64,
    })
}

/// `pid` and every descendant (a wrapper shell's children included).
pub fn tree(pid: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let Some(child) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if let Ok(text) = std::fs::read_to_string(format!("/proc/{child}/stat"))
                && let Ok((ppid, _)) = parse_stat(&text)
            {
                parents.push((child, ppid));
            }
        }
    }
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        out.extend(
            parents
                .iter()
                .filter(|(_, ppid)| *ppid == p)
                .map(|(c, _)| *c),
        );
        i += 1;
    }
    out
}

/// The sum over `pid` and its descendants (processes that vanish meanwhile are skipped; `pid`
/// itself must exist).
pub fn read_tree(pid: u32, ticks: u64) -> Result<ProcStat> {
    let mut total = read(pid, ticks)?;
    for child in tree(pid).into_iter().skip(1) {
        if let Ok(s) = read(child, ticks) {
            total.rss_kib += s.rss_kib;
            total.hwm_kib += s.hwm_kib;
            total.cpu_seconds += s.cpu_seconds;
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_status_and_stat() {
        let status = "Name:\tgpu-operator\nVmHWM:\t   30720 kB\nVmRSS:\t   20480 kB\n";
        assert_eq!(parse_status(status).unwrap(), (20480, 30720));
        let stat = "42 (gpu op (x)) S 7 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 9 0";
        assert_eq!(parse_stat(stat).unwrap(), (7, 300));
        assert!(parse_status("Name: x\n").is_err());
    }

    #[test]
    fn reads_this_process() {
        let me = std::process::id();
        let s = read(me, clock_ticks()).unwrap();
        assert!(s.rss_kib > 0 && s.hwm_kib >= s.rss_kib, "{s:?}");
        assert!(tree(me).contains(&me));
    }
}
