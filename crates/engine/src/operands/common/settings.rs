//! What an absent field of the spec means: the CRD's defaults are applied by validate; these
//! cover sections that are absent altogether (render stage, pure).

use super::*;
use crate::api::{ClusterPolicySpec, ImageKind, ImageSpec, MigStrategy};
use crate::facts::{ClusterFacts, Runtime};
use crate::model::ValidatedPolicy;

/// Whether CDI is used (default true).
pub fn cdi_enabled(spec: &ClusterPolicySpec) -> bool {
    spec.cdi.as_ref().is_none_or(|c| c.is_enabled())
}

pub use crate::model::nri_enabled;

/// The RuntimeClass name operand pods and workloads use (`nvidia` unless overridden).
pub fn runtime_class_name(spec: &ClusterPolicySpec) -> &str {
    spec.operator
        .as_ref()
        .map_or("nvidia", |o| o.runtime_class())
}

/// The MIG strategy, when the policy sets one.
pub fn mig_strategy(spec: &ClusterPolicySpec) -> Option<MigStrategy> {
    spec.mig.as_ref().and_then(|m| m.strategy)
}

pub(super) fn non_empty(value: Option<&String>) -> Option<&str> {
    value.map(String::as_str).filter(|s| !s.is_empty())
}

/// `hostPaths.rootFS`, `/` when empty.
pub fn root_fs(spec: &ClusterPolicySpec) -> &str {
    non_empty(spec.host_paths.as_ref().and_then(|h| h.root_fs.as_ref())).unwrap_or("/")
}

/// `hostPaths.driverInstallDir`, `/run/nvidia/driver` when empty.
pub fn driver_install_dir(spec: &ClusterPolicySpec) -> &str {
    non_empty(
        spec.host_paths
            .as_ref()
            .and_then(|h| h.driver_install_dir.as_ref()),
    )
    .unwrap_or(DEFAULT_DRIVER_INSTALL_DIR)
}

/// `hostPaths.kubeletRootDir`, `/var/lib/kubelet` when empty.
pub fn kubelet_root_dir(spec: &ClusterPolicySpec) -> &str {
    non_empty(
        spec.host_paths
            .as_ref()
            .and_then(|h| h.kubelet_root_dir.as_ref()),
    )
    .unwrap_or(DEFAULT_KUBELET_ROOT_DIR)
}

/// `toolkit.installDir`, `/usr/local/nvidia` when empty.
pub fn toolkit_install_dir(spec: &ClusterPolicySpec) -> &str {
    non_empty(spec.toolkit.as_ref().and_then(|t| t.install_dir.as_ref()))
        .unwrap_or(DEFAULT_TOOLKIT_INSTALL_DIR)
}

/// `devicePlugin.mps.root`, `/run/nvidia/mps` when empty.
pub fn mps_root(spec: &ClusterPolicySpec) -> &str {
    non_empty(
        spec.device_plugin
            .as_ref()
            .and_then(|d| d.mps.as_ref())
            .and_then(|m| m.root.as_ref()),
    )
    .unwrap_or(DEFAULT_MPS_ROOT)
}

/// Joins a host directory and a relative path without doubling the slash.
pub fn join_path(dir: &str, rest: &str) -> String {
    format!(
        "{}/{}",
        dir.trim_end_matches('/'),
        rest.trim_start_matches('/')
    )
}

/// Whether operand pods that use GPUs get `runtimeClassName` (docs/operand-facts.md §1): not with the
/// NRI plugin, and not on CRI-O without CDI (the OCI hook does the work there).
pub fn sets_runtime_class(spec: &ClusterPolicySpec, facts: &ClusterFacts) -> bool {
    !(nri_enabled(spec) || (!cdi_enabled(spec) && facts.runtime == Runtime::CriO))
}

/// The resolved image of `kind`. validate resolved every image an enabled operand needs and
/// [`crate::render::render`] checks that before calling an operand module, so the empty fallback is
/// never rendered.
pub fn image(policy: &ValidatedPolicy, kind: ImageKind) -> String {
    policy.images.get(&kind).cloned().unwrap_or_default()
}

/// A pull policy as the kubelet knows it; anything else is IfNotPresent, as NVIDIA does.
pub fn pull_policy(image: Option<&ImageSpec>) -> String {
    match image.and_then(|i| i.image_pull_policy.as_deref()) {
        Some(p @ ("Always" | "Never" | "IfNotPresent")) => p.to_owned(),
        _ => "IfNotPresent".to_owned(),
    }
}
