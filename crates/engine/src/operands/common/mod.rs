//! Render stage, the pieces every operand shares (pure, no IO), one file per kind: effective
//! settings of absent fields ([`settings`]), metadata ([`meta`]), node-confining admission policies ([`admission`]), config hashes ([`hash`]),
//! environment ([`env`]), containers and volumes ([`pod`]), the sandbox managers'
//! k8s-driver-manager ([`driver_manager`]), RBAC ([`rbac`]) and the cross-cutting
//! DaemonSet rules ([`daemon_set`]). Their items are re-exported here, so operands name them as
//! `common::...`.

mod admission;
mod daemon_set;
mod driver_manager;
mod env;
mod hash;
mod meta;
mod pod;
mod rbac;
mod settings;

pub use admission::*;
pub use daemon_set::*;
pub use driver_manager::*;
pub use env::*;
pub use hash::*;
pub use meta::*;
pub use pod::*;
pub use rbac::*;
pub use settings::*;

/// NVIDIA's pod label that DaemonSet selectors (and mig-manager's pod waits) use.
pub const APP_LABEL: &str = "app";
/// Recommended label: the application an object belongs to (our operand name).
pub const NAME_LABEL: &str = "app.kubernetes.io/name";
/// Recommended label: the larger application; part of two NVIDIA selectors.
pub const PART_OF_LABEL: &str = "app.kubernetes.io/part-of";
/// Recommended label: the role within the application.
pub const COMPONENT_LABEL: &str = "app.kubernetes.io/component";
/// Value of [`PART_OF_LABEL`] on every object.
pub const PART_OF: &str = "gpu-operator";
/// The taint key GPU node pools carry; every operand tolerates it by default.
pub const GPU_TAINT_KEY: &str = "nvidia.com/gpu";
/// PriorityClass of operand pods unless `daemonsets.priorityClassName` names another.
pub const DEFAULT_PRIORITY_CLASS: &str = "system-node-critical";
/// Host (and container) directory of the validator's status files.
pub const VALIDATIONS_DIR: &str = "/run/nvidia/validations";
/// Default host directory of the containerised driver's root file system.
pub const DEFAULT_DRIVER_INSTALL_DIR: &str = "/run/nvidia/driver";
/// Default directory where the toolkit installs itself on the host.
pub const DEFAULT_TOOLKIT_INSTALL_DIR: &str = "/usr/local/nvidia";
/// Default MPS root on the host.
pub const DEFAULT_MPS_ROOT: &str = "/run/nvidia/mps";
/// Default kubelet root directory.
pub const DEFAULT_KUBELET_ROOT_DIR: &str = "/var/lib/kubelet";
/// Pod annotation prefix through which the NRI plugin injects CDI devices.
pub const NRI_ANNOTATION_PREFIX: &str = "nvidia.cdi.k8s.io/container.";
/// The CDI device the NRI annotation asks for: every GPU, management view.
pub const NRI_ANNOTATION_VALUE: &str = "management.nvidia.com/gpu=all";

/// Volume names the cross-cutting hostPaths rules rewrite (docs/operand-facts.md §1).
pub const HOST_ROOT_VOLUME: &str = "host-root";
pub const HOST_DEV_CHAR_VOLUME: &str = "host-dev-char";
pub const DRIVER_INSTALL_DIR_VOLUME: &str = "driver-install-dir";
/// The init container whose driver-root mount follows `hostPaths.driverInstallDir`.
pub const DRIVER_VALIDATION_CONTAINER: &str = "driver-validation";
