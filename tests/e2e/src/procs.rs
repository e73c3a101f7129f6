//! Processes the tests start or watch (IO): what the harness processes are and where they
//! listen, from `$HARNESS_DIR/pids` and /proc, and signals to any of them by pid.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

/// The signals the tests send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// Asks a process to shut down (a kubelet's first step).
    Term,
    /// Ends it at once: no clean-up, no Lease released.
    Kill,
    /// Freezes it: it keeps its connections and timers but does nothing, as a process on a
    /// stalled node or in a long GC pause.
    Stop,
    /// Lets a stopped process run again.
    Cont,
}

impl Signal {
    /// The name kill(1) takes.
    pub const fn name(self) -> &'static str {
        match self {
            Signal::Term => "TERM",
            Signal::Kill => "KILL",
            Signal::Stop => "STOP",
            Signal::Cont => "CONT",
        }
    }
}

/// Sends `signal` to `pid` with kill(1) (the crate forbids the unsafe libc call).
pub fn signal(pid: u32, signal: Signal) -> Result<()> {
    let name = signal.name();
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .context("running kill")?;
    anyhow::ensure!(status.success(), "kill -{name} {pid} failed");
    Ok(())
}

/// A process `up.sh` started: its name, pid and the binary it runs.
#[derive(Clone, Debug)]
pub struct HarnessProcess {
    pub name: String,
    pub pid: u32,
    pub binary: String,
}

impl HarnessProcess {
    /// Whether the pid is still running the binary it was started with.
    pub fn is_running(&self) -> bool {
        std::fs::read_link(format!("/proc/{}/exe", self.pid))
            .map(|exe| exe.to_string_lossy() == self.binary)
            .unwrap_or(false)
    }
}

/// The processes recorded in `<dir>/pids` ("name pid binary" per line).
pub fn recorded(dir: &Path) -> Result<Vec<HarnessProcess>> {
    let path = dir.join("pids");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let mut parts = line.split_whitespace();
            let (Some(name), Some(pid), Some(binary)) = (parts.next(), parts.next(), parts.next())
            else {
                anyhow::bail!("malformed line in {}: {line}", path.display());
            };
            Ok(HarnessProcess {
                name: name.to_string(),
                pid: pid.parse()?,
                binary: binary.to_string(),
            })
        })
        .collect()
}

/// The TCP addresses `pid` listens on (from its socket fds and /proc/net/tcp{,6}).
pub fn listening_addresses(pid: u32) -> Result<Vec<SocketAddr>> {
    let inodes: HashSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .with_context(|| format!("listing fds of pid {pid}"))?
        .filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|target| {
            let t = target.to_string_lossy().into_owned();
            t.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect();
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).with_context(|| format!("reading {table}"))?;
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
            if cols.len() < 10 || cols[3] != "0A" {
                continue;
            }
            let Ok(inode) = cols[9].parse::<u64>() else {
                continue;
            };
            if inodes.contains(&inode) {
                out.push(
                    parse_proc_addr(cols[1])
                        .with_context(|| format!("parsing {} in {table}", cols[1]))?,
                );
            }
        }
    }
    Ok(out)
}

/// Parses `0100007F:1F90` (IPv4) or the 32-hex-digit IPv6 form, both in host (little-endian
/// 32-bit word) order as the kernel prints them.
fn parse_proc_addr(s: &str) -> Result<SocketAddr> {
    let (ip, port) = s.split_once(':').context("no port")?;
    let port = u16::from_str_radix(port, 16)?;
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(u32::from_str_radix(ip, 16)?.swap_bytes())),
        32 => {
            let mut bytes = [0u8; 16];
            for word in 0..4 {
                let w = u32::from_str_radix(&ip[word * 8..word * 8 + 8], 16)?.swap_bytes();
                bytes[word * 4..word * 4 + 4].copy_from_slice(&w.to_be_bytes());
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => anyhow::bail!("unexpected address length"),
    };
    Ok(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kernel_socket_addresses() {
        assert_eq!(
            parse_proc_addr("0100007F:4010").unwrap(),
            "127.0.0.1:16400".parse().unwrap()
        );
        assert_eq!(
            parse_proc_addr("00000000:0050").unwrap(),
            "0.0.0.0:80".parse().unwrap()
        );
        assert_eq!(
            parse_proc_addr("00000000000000000000000001000000:4010").unwrap(),
            "[::1]:16400".parse().unwrap()
        );
        assert_eq!(
            parse_proc_addr("00000000000000000000000000000000:0050").unwrap(),
            "[::]:80".parse().unwrap()
        );
    }
}
