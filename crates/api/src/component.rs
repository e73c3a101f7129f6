//! The operands a ClusterPolicy can turn on, with NVIDIA's enablement defaults (pure; no IO).

use std::fmt;

use super::{ClusterPolicySpec, SandboxMode};

/// An operand (or optional feature) that a ClusterPolicy switches on or off.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Component {
    /// `spec.driver`.
    Driver,
    /// `spec.toolkit`.
    Toolkit,
    /// `spec.validator` (always on).
    Validator,
    /// `spec.devicePlugin` (also the MPS control daemon).
    DevicePlugin,
    /// `spec.gfd`.
    Gfd,
    /// `spec.dcgm` (the standalone host engine).
    Dcgm,
    /// `spec.dcgmExporter`.
    DcgmExporter,
    /// `spec.migManager`.
    MigManager,
    /// `spec.nodeStatusExporter`.
    NodeStatusExporter,
    /// `spec.nfd` (our addition).
    Nfd,
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
    /// `spec.vgpuDeviceManager`.
    VgpuDeviceManager,
    /// `spec.vfioManager`.
    VfioManager,
    /// `spec.kataManager`.
    KataManager,
    /// `spec.ccManager`.
    CcManager,
}

impl Component {
    /// Every component, in the order the status lists them.
    pub const ALL: [Component; 19] = [
        Component::Driver,
        Component::Toolkit,
        Component::Validator,
        Component::DevicePlugin,
        Component::Gfd,
        Component::Dcgm,
        Component::DcgmExporter,
        Component::MigManager,
        Component::NodeStatusExporter,
        Component::Nfd,
        Component::Gds,
        Component::GdrCopy,
        Component::SandboxDevicePlugin,
        Component::KataSandboxDevicePlugin,
        Component::VgpuManager,
        Component::VgpuDeviceManager,
        Component::VfioManager,
        Component::KataManager,
        Component::CcManager,
    ];

    /// The component's key under `spec`, also its name in `status.components`.
    pub const fn spec_key(self) -> &'static str {
        match self {
            Component::Driver => "driver",
            Component::Toolkit => "toolkit",
            Component::Validator => "validator",
            Component::DevicePlugin => "devicePlugin",
            Component::Gfd => "gfd",
            Component::Dcgm => "dcgm",
            Component::DcgmExporter => "dcgmExporter",
            Component::MigManager => "migManager",
            Component::NodeStatusExporter => "nodeStatusExporter",
            Component::Nfd => "nfd",
            Component::Gds => "gds",
            Component::GdrCopy => "gdrcopy",
            Component::SandboxDevicePlugin => "sandboxDevicePlugin",
            Component::KataSandboxDevicePlugin => "kataSandboxDevicePlugin",
            Component::VgpuManager => "vgpuManager",
            Component::VgpuDeviceManager => "vgpuDeviceManager",
            Component::VfioManager => "vfioManager",
            Component::KataManager => "kataManager",
            Component::CcManager => "ccManager",
        }
    }

    /// Whether the component is on when its section or its `enabled` field is absent, as
    /// NVIDIA's API defines it (not its Helm chart: the chart turns DCGM off, for example).
    pub const fn enabled_by_default(self) -> bool {
        match self {
            Component::Driver
            | Component::Toolkit
            | Component::Validator
            | Component::DevicePlugin
            | Component::Gfd
            | Component::Dcgm
            | Component::DcgmExporter
            | Component::MigManager
            | Component::Nfd => true,
            Component::NodeStatusExporter
            | Component::Gds
            | Component::GdrCopy
            | Component::SandboxDevicePlugin
            | Component::KataSandboxDevicePlugin
            | Component::VgpuManager
            | Component::VgpuDeviceManager
            | Component::VfioManager
            | Component::KataManager
            | Component::CcManager => false,
        }
    }

    /// Whether this operator deploys the component. Unsupported sections are stored as written
    /// and reported in status when enabled.
    pub const fn is_supported(self) -> bool {
        match self {
            Component::Driver
            | Component::Toolkit
            | Component::Validator
            | Component::DevicePlugin
            | Component::Gfd
            | Component::Dcgm
            | Component::DcgmExporter
            | Component::MigManager
            | Component::NodeStatusExporter
            | Component::Nfd
            | Component::Gds
            | Component::GdrCopy
            | Component::SandboxDevicePlugin
            | Component::VfioManager
            | Component::VgpuManager
            | Component::VgpuDeviceManager
            | Component::KataSandboxDevicePlugin
            | Component::CcManager => true,
            // kata-manager is deprecated: NVIDIA's operator stopped deploying it in v26.7, and
            // so does this one (`unsupported_fields` says so and what replaces it).
            Component::KataManager => false,
        }
    }

    /// The sandbox mode the component needs, where it serves only one (NVIDIA's operator
    /// deploys it only in that `sandboxWorkloads.mode`).
    pub const fn needs_sandbox_mode(self) -> Option<SandboxMode> {
        match self {
            Component::SandboxDevicePlugin => Some(SandboxMode::Kubevirt),
            Component::KataSandboxDevicePlugin | Component::CcManager => Some(SandboxMode::Kata),
            _ => None,
        }
    }

    /// Whether the component is deployed only with `sandboxWorkloads.enabled: true`.
    pub const fn needs_sandbox_workloads(self) -> bool {
        matches!(
            self,
            Component::SandboxDevicePlugin
                | Component::KataSandboxDevicePlugin
                | Component::VgpuManager
                | Component::VgpuDeviceManager
                | Component::VfioManager
                | Component::KataManager
                | Component::CcManager
        )
    }
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.spec_key())
    }
}

/// Effective enablement of `component` in `spec`: the section's own switch (or the default when
/// the section or switch is absent), and for sandbox operands the sandbox switch too.
pub(super) fn is_enabled(spec: &ClusterPolicySpec, component: Component) -> bool {
    fn section<T>(s: &Option<T>, component: Component, on: impl Fn(&T) -> bool) -> bool {
        s.as_ref().map_or(component.enabled_by_default(), on)
    }

    let sandbox = spec.sandbox_workloads.as_ref().filter(|s| s.is_enabled());
    if component.needs_sandbox_workloads() && sandbox.is_none() {
        return false;
    }
    if let Some(mode) = component.needs_sandbox_mode()
        && sandbox.map(|s| s.mode()) != Some(mode)
    {
        return false;
    }
    match component {
        Component::Driver => section(&spec.driver, component, |s| s.is_enabled()),
        Component::Toolkit => section(&spec.toolkit, component, |s| s.is_enabled()),
        Component::Validator => true,
        Component::DevicePlugin => section(&spec.device_plugin, component, |s| s.is_enabled()),
        Component::Gfd => section(&spec.gfd, component, |s| s.is_enabled()),
        Component::Dcgm => section(&spec.dcgm, component, |s| s.is_enabled()),
        Component::DcgmExporter => section(&spec.dcgm_exporter, component, |s| s.is_enabled()),
        Component::MigManager => section(&spec.mig_manager, component, |s| s.is_enabled()),
        Component::NodeStatusExporter => {
            section(&spec.node_status_exporter, component, |s| s.is_enabled())
        }
        Component::Nfd => section(&spec.nfd, component, |s| s.is_enabled()),
        Component::Gds => section(&spec.gds, component, |s| s.is_enabled()),
        Component::GdrCopy => section(&spec.gdrcopy, component, |s| s.is_enabled()),
        Component::SandboxDevicePlugin => {
            section(&spec.sandbox_device_plugin, component, |s| s.is_enabled())
        }
        Component::KataSandboxDevicePlugin => {
            section(&spec.kata_sandbox_device_plugin, component, |s| {
                s.is_enabled()
            })
        }
        Component::VgpuManager => section(&spec.vgpu_manager, component, |s| s.is_enabled()),
        Component::VgpuDeviceManager => {
            section(&spec.vgpu_device_manager, component, |s| s.is_enabled())
        }
        Component::VfioManager => section(&spec.vfio_manager, component, |s| s.is_enabled()),
        Component::KataManager => section(&spec.kata_manager, component, |s| s.is_enabled()),
        Component::CcManager => section(&spec.cc_manager, component, |s| s.is_enabled()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::{
        DcgmSpec, DriverSpec, NodeStatusExporterSpec, SandboxWorkloadsSpec, VfioManagerSpec,
    };

    fn spec(yaml: &str) -> ClusterPolicySpec {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn empty_policy_enables_what_nvidia_enables_when_fields_are_absent() {
        let empty = ClusterPolicySpec::default();
        let on: Vec<_> = Component::ALL
            .into_iter()
            .filter(|c| empty.is_enabled(*c))
            .collect();
        assert_eq!(
            on,
            [
                Component::Driver,
                Component::Toolkit,
                Component::Validator,
                Component::DevicePlugin,
                Component::Gfd,
                Component::Dcgm,
                Component::DcgmExporter,
                Component::MigManager,
                Component::Nfd,
            ]
        );
    }

    #[test]
    fn empty_sections_behave_like_absent_sections() {
        let empty_sections = spec(
            "{operator: {}, daemonsets: {}, driver: {}, toolkit: {}, devicePlugin: {}, dcgm: {}, \
             dcgmExporter: {}, gfd: {}, nodeStatusExporter: {}, migManager: {}, gds: {}, \
             gdrcopy: {}, nfd: {}}",
        );
        for c in Component::ALL {
            assert_eq!(
                empty_sections.is_enabled(c),
                ClusterPolicySpec::default().is_enabled(c),
                "{c}"
            );
        }
    }

    #[test]
    fn explicit_switches_win_over_defaults() {
        let s = spec(
            "{driver: {enabled: false}, dcgm: {enabled: false}, nodeStatusExporter: {enabled: true}, \
             gds: {enabled: true}, nfd: {enabled: false}}",
        );
        assert!(!s.is_enabled(Component::Driver));
        assert!(!s.is_enabled(Component::Dcgm));
        assert!(s.is_enabled(Component::NodeStatusExporter));
        assert!(s.is_enabled(Component::Gds));
        assert!(!s.is_enabled(Component::Nfd));
        assert!(
            !DriverSpec {
                enabled: Some(false),
                ..Default::default()
            }
            .is_enabled()
        );
        assert!(DcgmSpec::default().is_enabled());
        assert!(!NodeStatusExporterSpec::default().is_enabled());
    }

    #[test]
    fn validator_cannot_be_switched_off() {
        let s = spec("{validator: {env: [{name: X}]}}");
        assert!(s.is_enabled(Component::Validator));
    }

    #[test]
    fn sandbox_operands_need_sandbox_workloads() {
        let without = spec("{vfioManager: {enabled: true}, kataManager: {enabled: true}}");
        assert!(!without.is_enabled(Component::VfioManager));
        assert!(!without.is_enabled(Component::KataManager));
        assert!(without.unsupported_enabled().is_empty());

        let with = ClusterPolicySpec {
            sandbox_workloads: Some(SandboxWorkloadsSpec {
                enabled: Some(true),
                ..Default::default()
            }),
            vfio_manager: Some(VfioManagerSpec {
                enabled: Some(true),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(with.is_enabled(Component::VfioManager));
        assert!(!with.is_enabled(Component::VgpuManager));
        // The VFIO manager and the vGPU managers are deployed (operands::vfio_manager,
        // vgpu_manager, vgpu_device_manager).
        assert!(with.unsupported_enabled().is_empty());
        let vgpu = ClusterPolicySpec {
            vgpu_manager: Some(crate::VgpuManagerSpec {
                enabled: Some(true),
                ..Default::default()
            }),
            ..with
        };
        assert!(vgpu.is_enabled(Component::VgpuManager));
        assert!(vgpu.unsupported_enabled().is_empty());
    }

    #[test]
    fn sandbox_device_plugins_and_cc_manager_follow_the_sandbox_mode() {
        let on = "{enabled: true}";
        let policy = |mode: &str| {
            spec(&format!(
                "{{sandboxWorkloads: {{enabled: true{mode}}}, sandboxDevicePlugin: {on}, \
                 kataSandboxDevicePlugin: {on}, ccManager: {on}, vfioManager: {on}}}"
            ))
        };
        for (mode, kubevirt) in [
            ("", true),
            (", mode: kubevirt", true),
            (", mode: kata", false),
        ] {
            let s = policy(mode);
            assert_eq!(
                s.is_enabled(Component::SandboxDevicePlugin),
                kubevirt,
                "{mode}"
            );
            assert_eq!(
                s.is_enabled(Component::KataSandboxDevicePlugin),
                !kubevirt,
                "{mode}"
            );
            assert_eq!(s.is_enabled(Component::CcManager), !kubevirt, "{mode}");
            assert!(s.is_enabled(Component::VfioManager), "{mode}");
        }
    }

    #[test]
    fn gds_and_gdrcopy_are_deployed_so_never_listed_as_unsupported() {
        assert!(
            ClusterPolicySpec::default()
                .unsupported_enabled()
                .is_empty()
        );
        assert!(Component::Gds.is_supported() && Component::GdrCopy.is_supported());
        let s = spec("{gds: {enabled: true}, gdrcopy: {enabled: true}}");
        assert!(s.is_enabled(Component::Gds) && s.is_enabled(Component::GdrCopy));
        assert_eq!(s.unsupported_enabled(), []);
    }

    #[test]
    fn nested_switches_follow_nvidia_defaults() {
        let s = spec(
            "{cdi: {}, psa: {}, driver: {rdma: {useHostMofed: true}}, \
             dcgmExporter: {serviceMonitor: {}}}",
        );
        let cdi = s.cdi.as_ref().unwrap();
        assert!(cdi.is_enabled());
        assert!(!cdi.nri_plugin_enabled());
        assert!(!s.psa.as_ref().unwrap().is_enabled());
        let driver = s.driver.as_ref().unwrap();
        assert!(!driver.rdma_enabled());
        assert!(!driver.rdma.as_ref().unwrap().uses_host_mofed());
        assert!(!s.dcgm_exporter.as_ref().unwrap().service_monitor_enabled());
        let on = spec(
            "{cdi: {enabled: true, nriPluginEnabled: true}, dcgmExporter: {serviceMonitor: {enabled: true}}}",
        );
        assert!(on.cdi.as_ref().unwrap().nri_plugin_enabled());
        assert!(on.dcgm_exporter.as_ref().unwrap().service_monitor_enabled());
    }
}
