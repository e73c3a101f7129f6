//! Packaging of the GPU operator, kept out of its binary and image: every generated file of the
//! repository (the CRDs, the chart's copies of them and of the operator's ClusterRole, the OLM
//! bundle) and the check that the committed copies are what the generators write now.
//!
//! `cargo xtask generate` writes them (`make chart` and `make bundle` run it); `cargo xtask
//! check` fails naming each file that differs (`make unit` runs it, so CI does). The generators
//! call the operator's library, not its binary: the CRDs, `gpu-operator rbac`'s output, NFD's
//! CRDs and the images the operator pins come from the functions the operator itself runs.
#![forbid(unsafe_code)]

pub mod bundle;
pub mod generated;
pub mod helm;

use std::path::{Path, PathBuf};

/// The repository this crate was built from (its parent folder).
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}
