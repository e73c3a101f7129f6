//! One home per operand: each file holds what the operand renders (its objects), what validate
//! checks about its input ([`check`]), and which ConfigMaps and node labels it reads. The shared
//! rendering pieces are in [`common`] (metadata, containers, volumes) and [`openshift`] (SCCs).

pub mod cc_manager;
pub mod common;
pub mod dcgm;
pub mod dcgm_exporter;
pub mod device_plugin;
pub mod dra_driver;
pub mod driver;
pub mod driver_kernel;
pub mod driver_os;
pub mod driver_toolkit;
pub mod driver_variant;
pub mod gfd;
pub mod kata_sandbox_device_plugin;
pub mod mig_manager;
pub mod mps;
pub mod nfd;
pub mod node_status_exporter;
pub mod nvidia_digest;
pub mod nvidia_driver;
pub mod openshift;
pub mod operator_metrics;
pub mod runtime_classes;
pub mod sandbox_device_plugin;
pub mod sandbox_validator;
pub mod toolkit;
pub mod toolkit_flavour;
pub mod validator;
pub mod vfio_manager;
pub mod vgpu_device_manager;
pub mod vgpu_manager;

#[cfg(test)]
mod dcgm_exporter_tests;
#[cfg(test)]
mod device_plugin_tests;
#[cfg(test)]
mod dra_driver_tests;
#[cfg(test)]
mod driver_gds_tests;
#[cfg(test)]
mod driver_tests;
#[cfg(test)]
mod driver_toolkit_tests;
#[cfg(test)]
mod kata_tests;
#[cfg(test)]
mod mig_manager_tests;
#[cfg(test)]
mod nfd_tests;
#[cfg(test)]
mod sandbox_tests;
#[cfg(test)]
pub(crate) mod test_support;
#[cfg(test)]
mod toolkit_flavour_tests;
#[cfg(test)]
mod toolkit_tests;
#[cfg(test)]
mod validator_tests;
#[cfg(test)]
mod vgpu_tests;

use crate::api::{ClusterPolicySpec, Component, ImageKind};
use crate::facts::ClusterFacts;
use crate::model::{Operand, OperandObjects, ValidatedPolicy};

/// What the engine knows about one operand, declared once in the operand's own file
/// (`pub const DESCRIPTOR`); [`descriptor`] is the one table that maps an [`Operand`] to it. A
/// new operand is its file, its [`Operand`] variant and one line there.
pub struct Descriptor {
    /// Stable name: the value of [`crate::model::OPERAND_LABEL`] and the name in status.
    pub name: &'static str,
    /// The ClusterPolicy switch that turns it on (`None`: not a ClusterPolicy component).
    pub component: Option<Component>,
    /// The node label (NVIDIA's key) whose value `true` selects the nodes it runs on; `None`
    /// for operands that are not per-GPU-node DaemonSets.
    pub deploy_label: Option<&'static str>,
    /// Whether it mounts the device plugin's sharing config (the operator-owned copy).
    pub consumes_sharing_config: bool,
    /// When it has objects to render under a policy and facts.
    pub enabled: Enabled,
    /// The images its pods run (`sharing`: a sharing config is mounted).
    pub images: fn(&ClusterPolicySpec, bool) -> Vec<ImageKind>,
    /// Host paths of the spec it mounts besides the common ones, by field path; validate
    /// checks each is absolute.
    pub host_paths: fn(&ClusterPolicySpec) -> Vec<HostPathField<'_>>,
    /// Its objects; `None` when it has nothing to render here.
    pub render: fn(&ValidatedPolicy, &ClusterFacts) -> Option<OperandObjects>,
    /// What validate says about its own input beyond images and host paths: each problem
    /// names the field and the fix, and freezes the operand.
    pub check: fn(&ClusterPolicySpec, &ClusterFacts) -> Vec<String>,
    /// What validate reports while it still renders (an invalid config the nodes are kept
    /// away from).
    pub report: fn(&ClusterPolicySpec, &ClusterFacts) -> Option<String>,
}

/// A host path of the spec by its field path, and its value when set.
pub type HostPathField<'a> = (&'static str, Option<&'a str>);

/// When an operand has objects to render.
#[derive(Clone, Copy)]
pub enum Enabled {
    /// Whenever its [`Descriptor::component`] is switched on.
    BySwitch,
    /// When this says so (a switch plus a fact, or never from a ClusterPolicy).
    When(fn(&ClusterPolicySpec, &ClusterFacts) -> bool),
}

impl Descriptor {
    /// Whether the operand has objects to render under this policy and these facts.
    pub fn is_enabled(&self, spec: &ClusterPolicySpec, facts: &ClusterFacts) -> bool {
        match self.enabled {
            Enabled::BySwitch => self.component.is_some_and(|c| spec.is_enabled(c)),
            Enabled::When(enabled) => enabled(spec, facts),
        }
    }
}

/// The descriptor of `operand`, from its home module.
pub const fn descriptor(operand: Operand) -> &'static Descriptor {
    match operand {
        Operand::RuntimeClasses => &runtime_classes::DESCRIPTOR,
        Operand::OperatorMetrics => &operator_metrics::DESCRIPTOR,
        Operand::Driver => &driver::DESCRIPTOR,
        Operand::Toolkit => &toolkit::DESCRIPTOR,
        Operand::Validator => &validator::DESCRIPTOR,
        Operand::DevicePlugin => &device_plugin::DESCRIPTOR,
        Operand::MpsControlDaemon => &mps::DESCRIPTOR,
        Operand::Gfd => &gfd::DESCRIPTOR,
        Operand::Nfd => &nfd::DESCRIPTOR,
        Operand::Dcgm => &dcgm::DESCRIPTOR,
        Operand::DcgmExporter => &dcgm_exporter::DESCRIPTOR,
        Operand::MigManager => &mig_manager::DESCRIPTOR,
        Operand::NodeStatusExporter => &node_status_exporter::DESCRIPTOR,
        Operand::DraDriver => &dra_driver::DESCRIPTOR,
        Operand::DraDeviceClasses => &dra_driver::CLASSES_DESCRIPTOR,
        Operand::DcgmDra => &dcgm::DRA_DESCRIPTOR,
        Operand::DcgmExporterDra => &dcgm_exporter::DRA_DESCRIPTOR,
        Operand::DraValidator => &validator::DRA_DESCRIPTOR,
        Operand::NvidiaDriver => &nvidia_driver::DESCRIPTOR,
        Operand::SandboxValidator => &sandbox_validator::DESCRIPTOR,
        Operand::VfioManager => &vfio_manager::DESCRIPTOR,
        Operand::SandboxDevicePlugin => &sandbox_device_plugin::DESCRIPTOR,
        Operand::VgpuManager => &vgpu_manager::DESCRIPTOR,
        Operand::VgpuDeviceManager => &vgpu_device_manager::DESCRIPTOR,
        Operand::KataSandboxDevicePlugin => &kata_sandbox_device_plugin::DESCRIPTOR,
        Operand::CcManager => &cc_manager::DESCRIPTOR,
    }
}

/// The objects of `operand`, from its home module; `None` when it has nothing to render here.
pub fn render(
    operand: Operand,
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
) -> Option<OperandObjects> {
    (descriptor(operand).render)(policy, facts)
}

/// What validate says about `operand`'s own input beyond its images and host paths: each
/// problem names the field and the fix, and freezes the operand.
pub fn check(operand: Operand, spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Vec<String> {
    (descriptor(operand).check)(spec, facts)
}

/// What validate reports about `operand` while it still renders (an invalid config the nodes
/// are kept away from).
pub fn report(operand: Operand, spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Option<String> {
    (descriptor(operand).report)(spec, facts)
}

/// The pieces descriptors share: an operand with nothing of its own to check, report, mount or
/// run, and one that a ClusterPolicy never renders (a GPUCluster's or an NVIDIADriver's).
pub mod defaults {
    use super::*;

    pub fn no_check(_: &ClusterPolicySpec, _: &ClusterFacts) -> Vec<String> {
        Vec::new()
    }

    pub fn no_report(_: &ClusterPolicySpec, _: &ClusterFacts) -> Option<String> {
        None
    }

    pub fn no_host_paths(_: &ClusterPolicySpec) -> Vec<(&'static str, Option<&str>)> {
        Vec::new()
    }

    pub fn no_images(_: &ClusterPolicySpec, _: bool) -> Vec<ImageKind> {
        Vec::new()
    }

    /// Never from a ClusterPolicy: rendered from the resource that owns it.
    pub fn not_from_a_policy(_: &ClusterPolicySpec, _: &ClusterFacts) -> bool {
        false
    }

    pub fn renders_nothing(_: &ValidatedPolicy, _: &ClusterFacts) -> Option<OperandObjects> {
        None
    }
}

#[cfg(test)]
mod descriptor_tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn every_operand_has_a_descriptor_of_its_own_name() {
        let every: Vec<Operand> = Operand::ALL
            .into_iter()
            .chain(Operand::GPU_CLUSTER)
            .chain([Operand::NvidiaDriver])
            .collect();
        let names: BTreeSet<&str> = every.iter().map(|o| descriptor(*o).name).collect();
        assert_eq!(names.len(), every.len(), "{names:?}");
        assert!(names.iter().all(|n| !n.is_empty()));
    }

    #[test]
    fn the_sharing_config_consumers_are_the_plugin_gfd_and_the_mps_daemon() {
        let consumers: Vec<Operand> = Operand::ALL
            .into_iter()
            .filter(|o| descriptor(*o).consumes_sharing_config)
            .collect();
        assert_eq!(
            consumers,
            [
                Operand::DevicePlugin,
                Operand::MpsControlDaemon,
                Operand::Gfd
            ]
        );
    }
}
