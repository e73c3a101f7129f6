//! One home per operand: each file holds what the operand renders (its objects), what validate
//! checks about its input ([`check`]), and which ConfigMaps and node labels it reads. The shared
//! rendering pieces are in [`common`] (metadata, containers, volumes) and [`openshift`] (SCCs).

pub mod common;
pub mod dcgm;
pub mod dcgm_exporter;
pub mod device_plugin;
pub mod dra_driver;
pub mod driver;
pub mod driver_os;
pub mod gfd;
pub mod mig_manager;
pub mod mps;
pub mod nfd;
pub mod node_status_exporter;
pub mod nvidia_driver;
pub mod openshift;
pub mod runtime_classes;
pub mod toolkit;
pub mod validator;

#[cfg(test)]
mod dcgm_exporter_tests;
#[cfg(test)]
mod device_plugin_tests;
#[cfg(test)]
mod dra_driver_tests;
#[cfg(test)]
mod driver_tests;
#[cfg(test)]
mod mig_manager_tests;
#[cfg(test)]
mod nfd_tests;
#[cfg(test)]
pub(crate) mod test_support;
#[cfg(test)]
mod toolkit_tests;
#[cfg(test)]
mod validator_tests;

use crate::api::ClusterPolicySpec;
use crate::facts::ClusterFacts;
use crate::model::{Operand, OperandObjects, ValidatedPolicy};

/// The objects of `operand`, from its home module; `None` when it has nothing to render here.
pub fn render(
    operand: Operand,
    policy: &ValidatedPolicy,
    facts: &ClusterFacts,
) -> Option<OperandObjects> {
    match operand {
        Operand::RuntimeClasses => runtime_classes::render(policy, facts),
        Operand::Driver => driver::render(policy, facts),
        Operand::Toolkit => toolkit::render(policy, facts),
        Operand::Validator => validator::render(policy, facts),
        Operand::DevicePlugin => device_plugin::render(policy, facts),
        Operand::MpsControlDaemon => mps::render(policy, facts),
        Operand::Gfd => gfd::render(policy, facts),
        Operand::Nfd => nfd::render(policy, facts),
        Operand::Dcgm => dcgm::render(policy, facts),
        Operand::DcgmExporter => dcgm_exporter::render(policy, facts),
        Operand::MigManager => mig_manager::render(policy, facts),
        Operand::NodeStatusExporter => node_status_exporter::render(policy, facts),
        // A GPUCluster's or an NVIDIADriver's: rendered from it (dra_driver::render,
        // nvidia_driver::render), never from a ClusterPolicy.
        Operand::DraDriver | Operand::DraDeviceClasses | Operand::NvidiaDriver => None,
    }
}

/// What validate says about `operand`'s own input beyond its images and host paths: each
/// problem names the field and the fix, and freezes the operand.
pub fn check(operand: Operand, spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Vec<String> {
    match operand {
        Operand::Driver => driver::check(spec, facts),
        Operand::MigManager => mig_manager::check(spec, facts),
        Operand::DcgmExporter => dcgm_exporter::check(spec, facts),
        Operand::RuntimeClasses
        | Operand::Toolkit
        | Operand::Validator
        | Operand::DevicePlugin
        | Operand::MpsControlDaemon
        | Operand::Gfd
        | Operand::Nfd
        | Operand::Dcgm
        | Operand::NodeStatusExporter
        | Operand::DraDriver
        | Operand::DraDeviceClasses
        | Operand::NvidiaDriver => Vec::new(),
    }
}

/// What validate reports about `operand` while it still renders (an invalid config the nodes
/// are kept away from).
pub fn report(operand: Operand, spec: &ClusterPolicySpec, facts: &ClusterFacts) -> Option<String> {
    match operand {
        Operand::MigManager => mig_manager::report(facts),
        Operand::Driver => driver_os::report(facts),
        _ => {
            let _ = spec;
            None
        }
    }
}
