//! The k8s-driver-manager init container of the sandbox host-driver managers, and the fixed
//! resources of the small node managers (render stage, pure).

use k8s_openapi::api::core::v1::{Container, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::*;
use crate::api::{DriverManagerSpec, ImageKind};
use crate::model::ValidatedPolicy;

/// The driver manager's init container name (NVIDIA's).
pub const DRIVER_MANAGER_CONTAINER: &str = "k8s-driver-manager";
/// The volumes [`driver_manager_container`] mounts; the pod declares them: `/run/nvidia` and
/// `/sys` of the host (and [`HOST_ROOT_VOLUME`], the host's `/`).
pub const RUN_NVIDIA_VOLUME: &str = "run-nvidia";
pub const HOST_SYS_VOLUME: &str = "host-sys";

/// The k8s-driver-manager init container of the VFIO and vGPU managers: it unloads the NVIDIA
/// driver, if loaded, once the operands using it are gone, so the manager can take the GPUs.
/// It neither evicts GPU pods nor drains (NVIDIA's settings for both); the user's
/// `driverManager.env` (`manager`) can change that. `image` names the manager's own
/// driverManager image.
pub fn driver_manager_container(
    policy: &ValidatedPolicy,
    image: ImageKind,
    manager: Option<&DriverManagerSpec>,
) -> Container {
    let mut envs = vec![
        env_field("NODE_NAME", "spec.nodeName"),
        // The manager talks to the API server only; it must not get GPUs from the runtime.
        env("NVIDIA_VISIBLE_DEVICES", "void"),
        env("ENABLE_GPU_POD_EVICTION", "false"),
        env("ENABLE_AUTO_DRAIN", "false"),
        env_field("OPERATOR_NAMESPACE", "metadata.namespace"),
    ];
    merge_user_env(&mut envs, manager.and_then(|m| m.env.as_ref()));
    Container {
        env: Some(envs),
        security_context: Some(privileged()),
        volume_mounts: Some(vec![
            mount(RUN_NVIDIA_VOLUME, "/run/nvidia").bidirectional(),
            mount(HOST_ROOT_VOLUME, "/host")
                .read_only()
                .host_to_container(),
            mount(HOST_SYS_VOLUME, "/sys"),
        ]),
        ..container(
            DRIVER_MANAGER_CONTAINER,
            &super::image(policy, image),
            &["driver-manager"],
            &["uninstall_driver"],
        )
    }
}

/// NVIDIA's resources for the VFIO and CC managers, which only bind or reset GPUs through
/// sysfs: 100m CPU and 200Mi memory requested, the same memory as the limit.
pub fn small_manager_resources() -> ResourceRequirements {
    let memory = || Quantity("200Mi".to_owned());
    ResourceRequirements {
        requests: Some(
            [
                ("cpu".to_owned(), Quantity("100m".to_owned())),
                ("memory".to_owned(), memory()),
            ]
            .into(),
        ),
        limits: Some([("memory".to_owned(), memory())].into()),
        claims: None,
    }
}
