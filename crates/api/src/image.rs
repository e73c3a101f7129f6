//! Image resolution for operands: policy fields, then the operator's environment, then the
//! pinned default (pure; the environment lookup is passed in).
//!
//! From the policy, `repository/image:version` (with `@` instead of `:` when version is a
//! `sha256:` digest); or `image` alone as a complete reference when repository and version are
//! empty, as tools that pin images by digest write it. When all three are empty the operator's
//! environment variable for the operand (for example `DRIVER_IMAGE`, which OLM sets) is used,
//! then the version this operator pins. A partly filled triple is an error rather than a guess:
//! NVIDIA's operator would build a broken reference such as `nvcr.io/nvidia/driver:` from it.

use thiserror::Error;

use super::ClusterPolicySpec;
use super::common::ImageSpec;

/// Looks up an environment variable of the operator process; injected so that resolution stays
/// pure (`&|name| std::env::var(name).ok()` in production, a map in tests).
pub type EnvLookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Each image a ClusterPolicy can name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ImageKind {
    /// `spec.driver` (the render stage appends the node's OS suffix to a tag).
    Driver,
    /// `spec.driver.manager`, the k8s-driver-manager init container.
    DriverManager,
    /// `spec.toolkit`.
    Toolkit,
    /// `spec.devicePlugin` (also config-manager and the MPS control daemon).
    DevicePlugin,
    /// `spec.gfd`.
    Gfd,
    /// `spec.dcgm`.
    Dcgm,
    /// `spec.dcgmExporter`.
    DcgmExporter,
    /// `spec.migManager`.
    MigManager,
    /// `spec.nodeStatusExporter`.
    NodeStatusExporter,
    /// `spec.validator`.
    Validator,
    /// `spec.operator.initContainer`.
    InitContainer,
    /// `spec.gds`.
    Gds,
    /// `spec.gdrcopy`.
    GdrCopy,
    /// `spec.sandboxDevicePlugin`.
    SandboxDevicePlugin,
    /// `spec.kataSandboxDevicePlugin`.
    KataSandboxDevicePlugin,
    /// `spec.vgpuManager`.
    VgpuManager,
    /// `spec.vgpuManager.driverManager`, the k8s-driver-manager init container of the vGPU
    /// manager.
    VgpuDriverManager,
    /// `spec.vgpuDeviceManager`.
    VgpuDeviceManager,
    /// `spec.vfioManager`.
    VfioManager,
    /// `spec.vfioManager.driverManager`, the k8s-driver-manager init container of the VFIO
    /// manager.
    VfioDriverManager,
    /// `spec.kataManager`.
    KataManager,
    /// `spec.ccManager`.
    CcManager,
    /// `spec.nfd` (our addition).
    Nfd,
}

impl ImageKind {
    /// Path of the section holding the image fields, for messages.
    pub const fn field_path(self) -> &'static str {
        match self {
            ImageKind::Driver => "spec.driver",
            ImageKind::DriverManager => "spec.driver.manager",
            ImageKind::Toolkit => "spec.toolkit",
            ImageKind::DevicePlugin => "spec.devicePlugin",
            ImageKind::Gfd => "spec.gfd",
            ImageKind::Dcgm => "spec.dcgm",
            ImageKind::DcgmExporter => "spec.dcgmExporter",
            ImageKind::MigManager => "spec.migManager",
            ImageKind::NodeStatusExporter => "spec.nodeStatusExporter",
            ImageKind::Validator => "spec.validator",
            ImageKind::InitContainer => "spec.operator.initContainer",
            ImageKind::Gds => "spec.gds",
            ImageKind::GdrCopy => "spec.gdrcopy",
            ImageKind::SandboxDevicePlugin => "spec.sandboxDevicePlugin",
            ImageKind::KataSandboxDevicePlugin => "spec.kataSandboxDevicePlugin",
            ImageKind::VgpuManager => "spec.vgpuManager",
            ImageKind::VgpuDriverManager => "spec.vgpuManager.driverManager",
            ImageKind::VgpuDeviceManager => "spec.vgpuDeviceManager",
            ImageKind::VfioManager => "spec.vfioManager",
            ImageKind::VfioDriverManager => "spec.vfioManager.driverManager",
            ImageKind::KataManager => "spec.kataManager",
            ImageKind::CcManager => "spec.ccManager",
            ImageKind::Nfd => "spec.nfd",
        }
    }

    /// The operator environment variable consulted when the policy names no image; the names
    /// NVIDIA's operator and its OLM bundle use.
    pub const fn env_var(self) -> &'static str {
        match self {
            ImageKind::Driver => "DRIVER_IMAGE",
            ImageKind::DriverManager
            | ImageKind::VfioDriverManager
            | ImageKind::VgpuDriverManager => "DRIVER_MANAGER_IMAGE",
            ImageKind::Toolkit => "CONTAINER_TOOLKIT_IMAGE",
            ImageKind::DevicePlugin => "DEVICE_PLUGIN_IMAGE",
            ImageKind::Gfd => "GFD_IMAGE",
            ImageKind::Dcgm => "DCGM_IMAGE",
            ImageKind::DcgmExporter => "DCGM_EXPORTER_IMAGE",
            ImageKind::MigManager => "MIG_MANAGER_IMAGE",
            ImageKind::NodeStatusExporter | ImageKind::Validator => "VALIDATOR_IMAGE",
            ImageKind::InitContainer => "CUDA_BASE_IMAGE",
            ImageKind::Gds => "GDS_IMAGE",
            ImageKind::GdrCopy => "GDRCOPY_IMAGE",
            ImageKind::SandboxDevicePlugin => "SANDBOX_DEVICE_PLUGIN_IMAGE",
            ImageKind::KataSandboxDevicePlugin => "KATA_SANDBOX_DEVICE_PLUGIN_IMAGE",
            ImageKind::VgpuManager => "VGPU_MANAGER_IMAGE",
            ImageKind::VgpuDeviceManager => "VGPU_DEVICE_MANAGER_IMAGE",
            ImageKind::VfioManager => "VFIO_MANAGER_IMAGE",
            ImageKind::KataManager => "KATA_MANAGER_IMAGE",
            ImageKind::CcManager => "CC_MANAGER_IMAGE",
            ImageKind::Nfd => "NFD_IMAGE",
        }
    }

    /// The image this operator pins for the operand (NVIDIA's Helm defaults of the release we
    /// follow), used when neither the policy nor the environment names one. Images of
    /// operands this operator does not deploy have none.
    pub const fn pinned(self) -> Option<&'static str> {
        match self {
            ImageKind::Driver => Some("nvcr.io/nvidia/driver:595.91.07"),
            // vfio-manage ships in the driver-manager image (docs/operand-facts.md §20.4).
            ImageKind::DriverManager
            | ImageKind::VfioDriverManager
            | ImageKind::VgpuDriverManager
            | ImageKind::VfioManager => {
                Some("nvcr.io/nvidia/cloud-native/k8s-driver-manager:v0.12.0")
            }
            ImageKind::Toolkit => Some("nvcr.io/nvidia/k8s/container-toolkit:v1.20.0"),
            ImageKind::DevicePlugin | ImageKind::Gfd => {
                Some("nvcr.io/nvidia/k8s-device-plugin:v0.20.0")
            }
            ImageKind::Dcgm => Some("nvcr.io/nvidia/cloud-native/dcgm:4.6.0-1-ubuntu24.04"),
            ImageKind::DcgmExporter => {
                Some("nvcr.io/nvidia/k8s/dcgm-exporter:4.6.0-4.8.3-distroless")
            }
            ImageKind::MigManager => Some("nvcr.io/nvidia/cloud-native/k8s-mig-manager:v0.15.0"),
            ImageKind::NodeStatusExporter | ImageKind::Validator => {
                Some("nvcr.io/nvidia/gpu-operator:v26.7.0")
            }
            ImageKind::Gds => Some("nvcr.io/nvidia/cloud-native/nvidia-fs:2.29.4"),
            ImageKind::GdrCopy => Some("nvcr.io/nvidia/cloud-native/gdrdrv:v2.6"),
            ImageKind::Nfd => Some("registry.k8s.io/nfd/node-feature-discovery:v0.19.0"),
            ImageKind::SandboxDevicePlugin => {
                Some("nvcr.io/nvidia/kubevirt-gpu-device-plugin:v1.6.0")
            }
            ImageKind::VgpuDeviceManager => {
                Some("nvcr.io/nvidia/cloud-native/vgpu-device-manager:v0.5.0")
            }
            ImageKind::KataSandboxDevicePlugin => {
                Some("nvcr.io/nvidia/cloud-native/nvidia-sandbox-device-plugin:v0.0.5")
            }
            ImageKind::CcManager => Some("nvcr.io/nvidia/cloud-native/k8s-cc-manager:v0.4.3"),
            // NVIDIA publishes no vGPU manager image: each user builds it from the licensed
            // vGPU host driver (docs/vms.md). The kata-manager is deprecated and not deployed.
            ImageKind::InitContainer | ImageKind::VgpuManager | ImageKind::KataManager => None,
        }
    }
}

/// Where a resolved image reference came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageSource {
    /// The ClusterPolicy's repository/image/version.
    Policy,
    /// The operator's environment variable of that name.
    Environment(&'static str),
    /// The version this operator pins.
    Pinned,
}

/// An image reference ready for a container spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedImage {
    /// The full reference, such as `nvcr.io/nvidia/k8s-device-plugin:v0.20.0`.
    pub reference: String,
    /// Where it came from.
    pub source: ImageSource,
    /// Whether the reference pins a digest (`@sha256:`); tags get no OS suffix then.
    pub is_digest: bool,
}

/// Why no image reference could be formed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ImageError {
    /// Some but not all of repository, image and version are set.
    #[error(
        "{field}: repository, image and version must be set together (or a complete reference put in image alone); {missing} empty"
    )]
    Incomplete {
        /// The section, such as `spec.driver`.
        field: &'static str,
        /// The empty fields, such as `version is` or `repository and image are`.
        missing: String,
    },
    /// Nothing in the policy, the environment variable unset, and nothing pinned.
    #[error(
        "{field}: no image set (repository, image and version are empty) and {env_var} is not set"
    )]
    Missing {
        /// The section, such as `spec.kataManager`.
        field: &'static str,
        /// The environment variable that was consulted.
        env_var: &'static str,
    },
}

impl ImageError {
    /// Stable short reason for events and metrics.
    pub const fn reason(&self) -> &'static str {
        match self {
            ImageError::Incomplete { .. } => "ImageIncomplete",
            ImageError::Missing { .. } => "ImageMissing",
        }
    }
}

fn non_empty(s: &Option<String>) -> Option<&str> {
    s.as_deref().filter(|s| !s.is_empty())
}

fn digest_of(reference: &str) -> bool {
    reference.contains("@sha256:")
}

/// Resolves the image of `kind` from its fields (`None` when the section is absent).
pub fn resolve(
    fields: Option<&ImageSpec>,
    kind: ImageKind,
    env: EnvLookup<'_>,
) -> Result<ResolvedImage, ImageError> {
    let (repository, image, version) = fields.map_or((None, None, None), |f| {
        (
            non_empty(&f.repository),
            non_empty(&f.image),
            non_empty(&f.version),
        )
    });
    match (repository, image, version) {
        (Some(repository), Some(image), Some(version)) => {
            let repository = repository.trim_end_matches('/');
            let reference = if version.starts_with("sha256:") {
                format!("{repository}/{image}@{version}")
            } else {
                format!("{repository}/{image}:{version}")
            };
            Ok(ResolvedImage {
                is_digest: digest_of(&reference),
                reference,
                source: ImageSource::Policy,
            })
        }
        (None, Some(image), None) => Ok(ResolvedImage {
            reference: image.to_owned(),
            source: ImageSource::Policy,
            is_digest: digest_of(image),
        }),
        (None, None, None) => {
            let var = kind.env_var();
            if let Some(reference) = env(var).filter(|v| !v.is_empty()) {
                return Ok(ResolvedImage {
                    is_digest: digest_of(&reference),
                    reference,
                    source: ImageSource::Environment(var),
                });
            }
            kind.pinned()
                .map(|reference| ResolvedImage {
                    reference: reference.to_owned(),
                    source: ImageSource::Pinned,
                    is_digest: digest_of(reference),
                })
                .ok_or(ImageError::Missing {
                    field: kind.field_path(),
                    env_var: var,
                })
        }
        (repository, image, version) => {
            let missing: Vec<&str> = [
                ("repository", repository.is_none()),
                ("image", image.is_none()),
                ("version", version.is_none()),
            ]
            .into_iter()
            .filter_map(|(name, empty)| empty.then_some(name))
            .collect();
            let verb = if missing.len() == 1 { "is" } else { "are" };
            Err(ImageError::Incomplete {
                field: kind.field_path(),
                missing: format!("{} {verb}", missing.join(" and ")),
            })
        }
    }
}

impl ClusterPolicySpec {
    /// The image fields the policy holds for `kind`, if its section is present.
    pub fn image_fields(&self, kind: ImageKind) -> Option<&ImageSpec> {
        match kind {
            ImageKind::Driver => self.driver.as_ref().map(|s| &s.image),
            ImageKind::DriverManager => self
                .driver
                .as_ref()
                .and_then(|d| d.manager.as_ref())
                .map(|m| &m.image),
            ImageKind::Toolkit => self.toolkit.as_ref().map(|s| &s.image),
            ImageKind::DevicePlugin => self.device_plugin.as_ref().map(|s| &s.image),
            ImageKind::Gfd => self.gfd.as_ref().map(|s| &s.image),
            ImageKind::Dcgm => self.dcgm.as_ref().map(|s| &s.image),
            ImageKind::DcgmExporter => self.dcgm_exporter.as_ref().map(|s| &s.image),
            ImageKind::MigManager => self.mig_manager.as_ref().map(|s| &s.image),
            ImageKind::NodeStatusExporter => self.node_status_exporter.as_ref().map(|s| &s.image),
            ImageKind::Validator => self.validator.as_ref().map(|s| &s.image),
            ImageKind::InitContainer => self
                .operator
                .as_ref()
                .and_then(|o| o.init_container.as_ref())
                .map(|i| &i.image),
            ImageKind::Gds => self.gds.as_ref().map(|s| &s.image),
            ImageKind::GdrCopy => self.gdrcopy.as_ref().map(|s| &s.image),
            ImageKind::SandboxDevicePlugin => self.sandbox_device_plugin.as_ref().map(|s| &s.image),
            ImageKind::KataSandboxDevicePlugin => {
                self.kata_sandbox_device_plugin.as_ref().map(|s| &s.image)
            }
            ImageKind::VgpuManager => self.vgpu_manager.as_ref().map(|s| &s.image),
            ImageKind::VgpuDriverManager => self
                .vgpu_manager
                .as_ref()
                .and_then(|v| v.driver_manager.as_ref())
                .map(|m| &m.image),
            ImageKind::VgpuDeviceManager => self.vgpu_device_manager.as_ref().map(|s| &s.image),
            ImageKind::VfioManager => self.vfio_manager.as_ref().map(|s| &s.image),
            ImageKind::VfioDriverManager => self
                .vfio_manager
                .as_ref()
                .and_then(|v| v.driver_manager.as_ref())
                .map(|m| &m.image),
            ImageKind::KataManager => self.kata_manager.as_ref().map(|s| &s.image),
            ImageKind::CcManager => self.cc_manager.as_ref().map(|s| &s.image),
            ImageKind::Nfd => self.nfd.as_ref().map(|s| &s.image),
        }
    }

    /// Resolves the image of `kind` for this policy (see the module documentation).
    pub fn resolve_image(
        &self,
        kind: ImageKind,
        env: EnvLookup<'_>,
    ) -> Result<ResolvedImage, ImageError> {
        resolve(self.image_fields(kind), kind, env)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn fields(repository: &str, image: &str, version: &str) -> ImageSpec {
        let opt = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        ImageSpec {
            repository: opt(repository),
            image: opt(image),
            version: opt(version),
            ..Default::default()
        }
    }

    #[test]
    fn triple_joins_with_colon_for_a_tag() {
        let got = resolve(
            Some(&fields("nvcr.io/nvidia", "k8s-device-plugin", "v0.20.0")),
            ImageKind::DevicePlugin,
            &no_env,
        )
        .unwrap();
        assert_eq!(got.reference, "nvcr.io/nvidia/k8s-device-plugin:v0.20.0");
        assert_eq!(got.source, ImageSource::Policy);
        assert!(!got.is_digest);
    }

    #[test]
    fn triple_joins_with_at_for_a_digest() {
        let digest = "sha256:e243d7a4cbd6e8b7bd5da8a6c5b4c1e0f0e3a3c4a1b2c3d4e5f6a7b8c9d0e1f2";
        let got = resolve(
            Some(&fields("nvcr.io/nvidia", "driver", digest)),
            ImageKind::Driver,
            &no_env,
        )
        .unwrap();
        assert_eq!(got.reference, format!("nvcr.io/nvidia/driver@{digest}"));
        assert!(got.is_digest);
    }

    #[test]
    fn trailing_slash_of_repository_is_not_doubled() {
        let got = resolve(
            Some(&fields("registry.local/nvidia/", "driver", "550.1")),
            ImageKind::Driver,
            &no_env,
        )
        .unwrap();
        assert_eq!(got.reference, "registry.local/nvidia/driver:550.1");
    }

    #[test]
    fn image_alone_is_a_complete_reference() {
        for reference in [
            "nvcr.io/nvidia/k8s/container-toolkit:v1.20.0",
            "registry.local/toolkit@sha256:0123456789abcdef",
        ] {
            let got = resolve(
                Some(&fields("", reference, "")),
                ImageKind::Toolkit,
                &no_env,
            )
            .unwrap();
            assert_eq!(got.reference, reference);
            assert_eq!(got.source, ImageSource::Policy);
            assert_eq!(got.is_digest, reference.contains('@'));
        }
    }

    #[test]
    fn empty_fields_fall_back_to_the_operand_environment_variable() {
        let env: HashMap<&str, &str> = [
            ("DRIVER_IMAGE", "mirror.local/driver:1"),
            ("DEVICE_PLUGIN_IMAGE", "mirror.local/plugin@sha256:ab"),
        ]
        .into();
        let lookup = |name: &str| env.get(name).map(|v| (*v).to_owned());
        let driver = resolve(None, ImageKind::Driver, &lookup).unwrap();
        assert_eq!(driver.reference, "mirror.local/driver:1");
        assert_eq!(driver.source, ImageSource::Environment("DRIVER_IMAGE"));
        let plugin = resolve(
            Some(&ImageSpec::default()),
            ImageKind::DevicePlugin,
            &lookup,
        )
        .unwrap();
        assert_eq!(
            plugin.source,
            ImageSource::Environment("DEVICE_PLUGIN_IMAGE")
        );
        assert!(plugin.is_digest);
    }

    #[test]
    fn policy_wins_over_environment() {
        let lookup = |_: &str| Some("mirror.local/other:1".to_owned());
        let got = resolve(
            Some(&fields("nvcr.io/nvidia", "driver", "550.1")),
            ImageKind::Driver,
            &lookup,
        )
        .unwrap();
        assert_eq!(got.reference, "nvcr.io/nvidia/driver:550.1");
    }

    #[test]
    fn empty_environment_value_counts_as_unset_and_pinned_default_applies() {
        let lookup = |_: &str| Some(String::new());
        let got = resolve(None, ImageKind::MigManager, &lookup).unwrap();
        assert_eq!(got.source, ImageSource::Pinned);
        assert_eq!(
            got.reference,
            "nvcr.io/nvidia/cloud-native/k8s-mig-manager:v0.15.0"
        );
    }

    #[test]
    fn no_policy_no_environment_no_pin_is_an_error_naming_field_and_variable() {
        let err = resolve(None, ImageKind::KataManager, &no_env).unwrap_err();
        assert_eq!(
            err,
            ImageError::Missing {
                field: "spec.kataManager",
                env_var: "KATA_MANAGER_IMAGE"
            }
        );
        assert_eq!(err.reason(), "ImageMissing");
        assert!(err.to_string().contains("KATA_MANAGER_IMAGE"));
    }

    #[test]
    fn partial_triples_are_errors_naming_what_is_missing() {
        let cases = [
            (("nvcr.io/nvidia", "driver", ""), "version is empty"),
            (("", "driver", "550.1"), "repository is empty"),
            (("nvcr.io/nvidia", "", "550.1"), "image is empty"),
            (("nvcr.io/nvidia", "", ""), "image and version are empty"),
            (("", "", "550.1"), "repository and image are empty"),
        ];
        for ((r, i, v), expected) in cases {
            let err = resolve(Some(&fields(r, i, v)), ImageKind::Driver, &no_env).unwrap_err();
            assert_eq!(err.reason(), "ImageIncomplete");
            let message = err.to_string();
            assert!(message.starts_with("spec.driver:"), "{message}");
            assert!(
                message.ends_with(expected),
                "{message} should end with {expected}"
            );
        }
    }

    #[test]
    fn spec_resolves_nested_and_shared_images() {
        let spec: ClusterPolicySpec = serde_yaml_ng::from_str(
            "driver: {manager: {repository: r.local/cn, image: k8s-driver-manager, version: v1}}\n\
             nodeStatusExporter: {}\n\
             operator: {initContainer: {image: r.local/cuda:12}}",
        )
        .unwrap();
        let env =
            |name: &str| (name == "VALIDATOR_IMAGE").then(|| "r.local/validator:1".to_owned());
        assert_eq!(
            spec.resolve_image(ImageKind::DriverManager, &env)
                .unwrap()
                .reference,
            "r.local/cn/k8s-driver-manager:v1"
        );
        assert_eq!(
            spec.resolve_image(ImageKind::NodeStatusExporter, &env)
                .unwrap()
                .reference,
            "r.local/validator:1"
        );
        assert_eq!(
            spec.resolve_image(ImageKind::InitContainer, &env)
                .unwrap()
                .reference,
            "r.local/cuda:12"
        );
        assert_eq!(
            spec.resolve_image(ImageKind::Driver, &env).unwrap().source,
            ImageSource::Pinned
        );
    }
}
