//! `sbom [--target TRIPLE] [--package NAME]`: prints the CycloneDX SBOM of NAME's binary
//! (default `gpu-operator`) as built for TRIPLE (default the host), from `cargo metadata` and
//! Cargo.lock of this workspace. scripts/image-rootfs.sh puts it into the image.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail};

fn host_triple() -> anyhow::Result<String> {
    let out = Command::new("rustc")
        .arg("-vV")
        .output()
        .context("running rustc -vV")?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .context("rustc -vV printed no host")
}

fn main() -> anyhow::Result<()> {
    let mut target = None;
    let mut package = "gpu-operator".to_owned();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--target" => target = Some(args.next().context("--target needs a triple")?),
            "--package" => package = args.next().context("--package needs a name")?,
            other => {
                bail!("unknown argument {other}: usage: sbom [--target TRIPLE] [--package NAME]")
            }
        }
    }
    let target = match target {
        Some(t) => t,
        None => host_triple()?,
    };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let document = sbom::from_workspace(&root, &target, &package)?;
    println!("{}", serde_json::to_string_pretty(&document)?);
    Ok(())
}
