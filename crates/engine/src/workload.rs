//! Node labelling, workload type (pure, no IO): which workload a GPU node serves (containers,
//! whole GPUs passed through to virtual machines, or vGPUs) and the deploy labels that type
//! asks for (docs/operand-facts.md §20.1). `nodes::desired_label_changes_for` writes them.
//!
//! The set is computed per call from the policy's values: nothing is kept between nodes or
//! passes, so the mode of one pass cannot leak into the next (NVIDIA's operator edits a shared
//! map in place, §20.1).

use std::collections::{BTreeMap, BTreeSet};

use crate::api::{ClusterPolicySpec, SandboxMode, SandboxWorkload};
use crate::nodes::{self, NodeView};
use crate::operands;

/// The node label that chooses a node's workload type (NVIDIA's key, set by the user).
pub const WORKLOAD_CONFIG: &str = "nvidia.com/gpu.workload.config";

/// NVIDIA's deploy keys of the virtual machine operands (§20.1). Only the first three have an
/// operand of ours yet; the others are written as NVIDIA writes them, so that the node's label
/// set matches and a later operand finds its nodes already labelled.
pub const DEPLOY_SANDBOX_DEVICE_PLUGIN: &str = "nvidia.com/gpu.deploy.sandbox-device-plugin";
pub const DEPLOY_SANDBOX_VALIDATOR: &str = "nvidia.com/gpu.deploy.sandbox-validator";
pub const DEPLOY_VFIO_MANAGER: &str = "nvidia.com/gpu.deploy.vfio-manager";
pub const DEPLOY_KATA_SANDBOX_DEVICE_PLUGIN: &str =
    "nvidia.com/gpu.deploy.kata-sandbox-device-plugin";
pub const DEPLOY_KATA_MANAGER: &str = "nvidia.com/gpu.deploy.kata-manager";
pub const DEPLOY_CC_MANAGER: &str = "nvidia.com/gpu.deploy.cc-manager";
pub const DEPLOY_VGPU_MANAGER: &str = "nvidia.com/gpu.deploy.vgpu-manager";
pub const DEPLOY_VGPU_DEVICE_MANAGER: &str = "nvidia.com/gpu.deploy.vgpu-device-manager";

/// Every virtual machine deploy key, sorted. With [`nodes::DEPLOY_KEYS`] they are every key
/// the labeller manages: a key of either list that a node's type does not ask for is removed.
pub const SANDBOX_DEPLOY_KEYS: [&str; 8] = [
    DEPLOY_CC_MANAGER,
    DEPLOY_KATA_MANAGER,
    DEPLOY_KATA_SANDBOX_DEVICE_PLUGIN,
    DEPLOY_SANDBOX_DEVICE_PLUGIN,
    DEPLOY_SANDBOX_VALIDATOR,
    DEPLOY_VFIO_MANAGER,
    DEPLOY_VGPU_DEVICE_MANAGER,
    DEPLOY_VGPU_MANAGER,
];

/// What the policy says about sandbox workloads, as the labeller needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sandbox {
    /// `sandboxWorkloads.enabled`; off, every GPU node is a container node.
    pub enabled: bool,
    /// `sandboxWorkloads.defaultWorkload`: the type of a node without a valid label.
    pub default_workload: SandboxWorkload,
    /// `sandboxWorkloads.mode`.
    pub mode: SandboxMode,
}

impl Sandbox {
    /// No sandbox workloads: every GPU node runs containers, as before sandbox support.
    pub const DISABLED: Sandbox = Sandbox {
        enabled: false,
        default_workload: SandboxWorkload::Container,
        mode: SandboxMode::Kubevirt,
    };

    /// The policy's `sandboxWorkloads`, with NVIDIA's defaults for absent fields.
    pub fn of(spec: &ClusterPolicySpec) -> Self {
        match &spec.sandbox_workloads {
            Some(s) => Sandbox {
                enabled: s.is_enabled(),
                default_workload: s.default_workload.unwrap_or(SandboxWorkload::Container),
                mode: s.mode(),
            },
            None => Sandbox::DISABLED,
        }
    }

    /// The workload type of `node`: container when sandbox workloads are off; else its
    /// [`WORKLOAD_CONFIG`] label when that names a type, else the default type (a missing or
    /// unknown value is not written back, as in NVIDIA's operator).
    pub fn workload_of(&self, node: &NodeView) -> SandboxWorkload {
        if !self.enabled {
            return SandboxWorkload::Container;
        }
        node.label(WORKLOAD_CONFIG)
            .and_then(parse_workload)
            .unwrap_or(self.default_workload)
    }

    /// The nodes of `nodes` whose workload type is `workload`: the one filter behind "the GPU
    /// nodes that run containers" (the driver's fleet and OS tag) and "the vm-vgpu nodes".
    pub fn nodes_running<'a, N: AsRef<NodeView>>(
        &self,
        nodes: &'a [N],
        workload: SandboxWorkload,
    ) -> impl Iterator<Item = &'a N> + 'a {
        let sandbox = *self;
        nodes
            .iter()
            .filter(move |n| sandbox.workload_of(n.as_ref()) == workload)
    }

    /// The deploy keys a node of `workload` carries (every value `true`); `mig_capable` adds
    /// mig-manager on container nodes only.
    pub fn deploy_keys(
        &self,
        workload: SandboxWorkload,
        mig_capable: bool,
    ) -> BTreeSet<&'static str> {
        let mut keys = BTreeSet::from([nodes::DEPLOY_CLIENT]);
        match workload {
            SandboxWorkload::Container => {
                keys.extend(
                    nodes::DEPLOY_KEYS
                        .into_iter()
                        .filter(|k| *k != nodes::DEPLOY_MIG_MANAGER || mig_capable),
                );
            }
            SandboxWorkload::VmPassthrough => {
                // The mode decides which device plugin advertises passed-through GPUs.
                keys.insert(match self.mode {
                    SandboxMode::Kubevirt => DEPLOY_SANDBOX_DEVICE_PLUGIN,
                    SandboxMode::Kata => DEPLOY_KATA_SANDBOX_DEVICE_PLUGIN,
                });
                keys.extend([
                    DEPLOY_SANDBOX_VALIDATOR,
                    DEPLOY_VFIO_MANAGER,
                    DEPLOY_KATA_MANAGER,
                    DEPLOY_CC_MANAGER,
                ]);
            }
            SandboxWorkload::VmVgpu => {
                // The KubeVirt plugin's key in either mode: in kata mode its DaemonSet is off.
                keys.extend([
                    DEPLOY_SANDBOX_DEVICE_PLUGIN,
                    DEPLOY_SANDBOX_VALIDATOR,
                    DEPLOY_CC_MANAGER,
                    DEPLOY_VGPU_MANAGER,
                    DEPLOY_VGPU_DEVICE_MANAGER,
                ]);
            }
        }
        keys
    }

    /// The deploy keys `node` should carry.
    pub fn deploy_keys_of(&self, node: &NodeView) -> BTreeSet<&'static str> {
        self.deploy_keys(
            self.workload_of(node),
            node.label(nodes::MIG_CAPABLE) == Some("true"),
        )
    }
}

/// A workload type from its label value (NVIDIA's spelling); `None` for anything else.
pub fn parse_workload(value: &str) -> Option<SandboxWorkload> {
    match value {
        "container" => Some(SandboxWorkload::Container),
        "vm-passthrough" => Some(SandboxWorkload::VmPassthrough),
        "vm-vgpu" => Some(SandboxWorkload::VmVgpu),
        _ => None,
    }
}

/// Every deploy key the labeller manages: the container stack's and the client's
/// ([`nodes::DEPLOY_KEYS`]) and the virtual machine operands' ([`SANDBOX_DEPLOY_KEYS`]).
pub fn managed_deploy_keys() -> impl Iterator<Item = &'static str> {
    nodes::DEPLOY_KEYS.into_iter().chain(SANDBOX_DEPLOY_KEYS)
}

/// Whether operand pods of each stack are still on a node: the container stack's (the driver
/// and every operand that opens the GPUs through it), the VFIO manager's (which holds them bound
/// to vfio-pci) and the vGPU manager's (whose host driver holds them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackPodsLeft {
    pub container: bool,
    pub vfio: bool,
    pub vgpu: bool,
}

/// Orders a switch of a node's workload type, which NVIDIA's labeller does in one patch
/// (docs/operand-facts.md §20.2): the leaving stack's keys come off at once, but the arriving
/// stack's owner of the GPUs (the driver, the VFIO manager or the vGPU manager) is labelled
/// only once the other stacks' pods are gone, so no two drivers hold the GPUs at once and the
/// GPUs are unbound before a driver loads. Returns whether a key was held back (the caller
/// looks again shortly: pod departures are not all watched).
pub fn order_switch(patch: &mut nodes::LabelPatch, left: StackPodsLeft) -> bool {
    let mut held = false;
    for (key, waits) in [
        (DEPLOY_VFIO_MANAGER, left.container || left.vgpu),
        (DEPLOY_VGPU_MANAGER, left.container || left.vfio),
        (nodes::DEPLOY_DRIVER, left.vfio || left.vgpu),
    ] {
        if waits && matches!(patch.get(key), Some(Some(_))) {
            patch.remove(key);
            held = true;
        }
    }
    held
}

/// The `app` labels of the container stack's operand pods other than the driver and the
/// toolkit: each opens the GPUs through the NVIDIA driver or waits on it, so a node's GPUs can
/// leave that driver only once none is left (NVIDIA's driver manager waits for the same pods by
/// the same labels before it unloads the driver, docs/operand-facts.md §20.2).
const CONTAINER_STACK_APPS: [&str; 8] = [
    operands::validator::NAME,
    operands::device_plugin::NAME,
    operands::mps::NAME,
    operands::gfd::NAME,
    operands::dcgm::NAME,
    operands::dcgm_exporter::NAME,
    operands::mig_manager::NAME,
    operands::node_status_exporter::NAME,
];

/// Whether a pod with these labels belongs to the container stack: a driver pod (ours by its
/// component label, NVIDIA's by its `app` label), a toolkit pod of any runtime flavour, or one
/// of [`CONTAINER_STACK_APPS`]. Pre-pull pods only pull an image and do not count.
pub fn is_container_stack_pod(labels: &BTreeMap<String, String>) -> bool {
    let label = |key: &str| labels.get(key).map(String::as_str);
    if label(operands::common::COMPONENT_LABEL) == Some(operands::driver::COMPONENT) {
        return true;
    }
    let Some(app) = label(operands::common::APP_LABEL) else {
        return false;
    };
    let toolkit = operands::toolkit::NAME;
    app == operands::driver::NAME
        || app == toolkit
        || app
            .strip_prefix(toolkit)
            .is_some_and(|flavour| flavour.starts_with('-'))
        || CONTAINER_STACK_APPS.contains(&app)
}

impl Sandbox {
    /// Whether `node` is to receive a virtual machine stack's owner of the GPUs (the VFIO or the
    /// vGPU manager) that it does not carry yet: a switch (or a new VM node) whose container
    /// stack must be gone first. The labeller looks at such a node's pods before it adds the key.
    /// Exactly the nodes whose label patch would add that key (a GPU node not taken out of
    /// every operand, without the key: any value, `false` or a pause included, is respected).
    pub fn awaits_vm_owner(&self, node: &NodeView) -> bool {
        if !node.has_nfd_gpu() || node.label(nodes::DEPLOY_OPERANDS) == Some("false") {
            return false;
        }
        let keys = self.deploy_keys_of(node);
        [DEPLOY_VFIO_MANAGER, DEPLOY_VGPU_MANAGER]
            .into_iter()
            .any(|key| keys.contains(key) && node.label(key).is_none())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn node(labels: &[(&str, &str)]) -> NodeView {
        let labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        NodeView::from_labels("n1", None, &labels)
    }

    fn on(default_workload: SandboxWorkload, mode: SandboxMode) -> Sandbox {
        Sandbox {
            enabled: true,
            default_workload,
            mode,
        }
    }

    #[test]
    fn disabled_sandbox_workloads_make_every_node_a_container_node_whatever_its_label() {
        let vm = node(&[(WORKLOAD_CONFIG, "vm-passthrough")]);
        assert_eq!(
            Sandbox::DISABLED.workload_of(&vm),
            SandboxWorkload::Container
        );
        let spec: ClusterPolicySpec = serde_yaml_ng::from_str(
            "{sandboxWorkloads: {enabled: false, defaultWorkload: vm-passthrough}}",
        )
        .unwrap();
        assert_eq!(
            Sandbox::of(&spec).workload_of(&vm),
            SandboxWorkload::Container
        );
        assert_eq!(
            Sandbox::of(&ClusterPolicySpec::default()),
            Sandbox::DISABLED
        );
    }

    #[test]
    fn the_workload_label_chooses_the_type_when_it_names_one() {
        let sandbox = on(SandboxWorkload::Container, SandboxMode::Kubevirt);
        for (value, workload) in [
            ("container", SandboxWorkload::Container),
            ("vm-passthrough", SandboxWorkload::VmPassthrough),
            ("vm-vgpu", SandboxWorkload::VmVgpu),
        ] {
            assert_eq!(
                sandbox.workload_of(&node(&[(WORKLOAD_CONFIG, value)])),
                workload
            );
        }
    }

    #[test]
    fn a_missing_empty_or_unknown_label_falls_back_to_the_default_type() {
        let sandbox = on(SandboxWorkload::VmPassthrough, SandboxMode::Kubevirt);
        for labels in [
            vec![],
            vec![(WORKLOAD_CONFIG, "")],
            vec![(WORKLOAD_CONFIG, "vm-passthru")],
        ] {
            assert_eq!(
                sandbox.workload_of(&node(&labels)),
                SandboxWorkload::VmPassthrough,
                "{labels:?}"
            );
        }
    }

    #[test]
    fn the_default_type_comes_from_the_spec_and_is_container_when_absent() {
        let spec: ClusterPolicySpec =
            serde_yaml_ng::from_str("{sandboxWorkloads: {enabled: true}}").unwrap();
        let sandbox = Sandbox::of(&spec);
        assert_eq!(
            sandbox,
            on(SandboxWorkload::Container, SandboxMode::Kubevirt)
        );
        let spec: ClusterPolicySpec = serde_yaml_ng::from_str(
            "{sandboxWorkloads: {enabled: true, defaultWorkload: vm-vgpu, mode: kata}}",
        )
        .unwrap();
        assert_eq!(
            Sandbox::of(&spec),
            on(SandboxWorkload::VmVgpu, SandboxMode::Kata)
        );
    }

    #[test]
    fn container_nodes_carry_the_container_stack_and_mig_manager_only_when_mig_capable() {
        let sandbox = on(SandboxWorkload::Container, SandboxMode::Kubevirt);
        let plain = sandbox.deploy_keys(SandboxWorkload::Container, false);
        let expected: BTreeSet<&str> = nodes::DEPLOY_KEYS
            .into_iter()
            .filter(|k| *k != nodes::DEPLOY_MIG_MANAGER)
            .collect();
        assert_eq!(plain, expected);
        let mig = sandbox.deploy_keys(SandboxWorkload::Container, true);
        assert!(mig.contains(nodes::DEPLOY_MIG_MANAGER));
        assert!(mig.iter().all(|k| !SANDBOX_DEPLOY_KEYS.contains(k)));
    }

    #[test]
    fn vm_passthrough_nodes_in_kubevirt_mode_carry_the_kubevirt_plugin_vfio_and_the_sandbox_validator()
     {
        let sandbox = on(SandboxWorkload::Container, SandboxMode::Kubevirt);
        // MIG capability does not bring mig-manager to a VM node.
        let keys = sandbox.deploy_keys(SandboxWorkload::VmPassthrough, true);
        assert_eq!(
            keys,
            BTreeSet::from([
                nodes::DEPLOY_CLIENT,
                DEPLOY_SANDBOX_DEVICE_PLUGIN,
                DEPLOY_SANDBOX_VALIDATOR,
                DEPLOY_VFIO_MANAGER,
                DEPLOY_KATA_MANAGER,
                DEPLOY_CC_MANAGER,
            ])
        );
    }

    #[test]
    fn vm_passthrough_nodes_in_kata_mode_carry_the_kata_plugin_instead() {
        let keys = on(SandboxWorkload::Container, SandboxMode::Kata)
            .deploy_keys(SandboxWorkload::VmPassthrough, false);
        assert!(keys.contains(DEPLOY_KATA_SANDBOX_DEVICE_PLUGIN));
        assert!(!keys.contains(DEPLOY_SANDBOX_DEVICE_PLUGIN));
    }

    #[test]
    fn vm_vgpu_nodes_carry_the_vgpu_managers_and_the_kubevirt_plugin_key_in_either_mode() {
        for mode in [SandboxMode::Kubevirt, SandboxMode::Kata] {
            let keys =
                on(SandboxWorkload::Container, mode).deploy_keys(SandboxWorkload::VmVgpu, true);
            assert_eq!(
                keys,
                BTreeSet::from([
                    nodes::DEPLOY_CLIENT,
                    DEPLOY_SANDBOX_DEVICE_PLUGIN,
                    DEPLOY_SANDBOX_VALIDATOR,
                    DEPLOY_CC_MANAGER,
                    DEPLOY_VGPU_MANAGER,
                    DEPLOY_VGPU_DEVICE_MANAGER,
                ]),
                "{mode:?}"
            );
        }
    }

    #[test]
    fn the_set_does_not_depend_on_the_mode_asked_before() {
        let kata = on(SandboxWorkload::Container, SandboxMode::Kata);
        let kubevirt = on(SandboxWorkload::Container, SandboxMode::Kubevirt);
        let first = kubevirt.deploy_keys(SandboxWorkload::VmPassthrough, false);
        let _ = kata.deploy_keys(SandboxWorkload::VmPassthrough, false);
        assert_eq!(
            kubevirt.deploy_keys(SandboxWorkload::VmPassthrough, false),
            first
        );
    }

    fn switch_patch(to_vm: bool) -> nodes::LabelPatch {
        let (add, remove) = if to_vm {
            (DEPLOY_VFIO_MANAGER, nodes::DEPLOY_DRIVER)
        } else {
            (nodes::DEPLOY_DRIVER, DEPLOY_VFIO_MANAGER)
        };
        nodes::LabelPatch::from([
            (add.to_owned(), Some("true".to_owned())),
            (remove.to_owned(), None),
            (DEPLOY_SANDBOX_VALIDATOR.to_owned(), Some("true".to_owned())),
        ])
    }

    #[test]
    fn vfio_manager_is_labelled_only_once_no_container_stack_pod_is_left() {
        let mut patch = switch_patch(true);
        let held = order_switch(
            &mut patch,
            StackPodsLeft {
                container: true,
                ..StackPodsLeft::default()
            },
        );
        assert!(held);
        assert_eq!(patch.get(DEPLOY_VFIO_MANAGER), None);
        // The container stack's keys still come off, and other VM keys still go on.
        assert_eq!(patch.get(nodes::DEPLOY_DRIVER), Some(&None));
        assert!(patch.contains_key(DEPLOY_SANDBOX_VALIDATOR));
        let mut gone = switch_patch(true);
        assert!(!order_switch(&mut gone, StackPodsLeft::default()));
        assert_eq!(gone, switch_patch(true));
    }

    #[test]
    fn the_driver_is_labelled_only_once_no_vfio_manager_pod_is_left() {
        let mut patch = switch_patch(false);
        assert!(order_switch(
            &mut patch,
            StackPodsLeft {
                vfio: true,
                ..StackPodsLeft::default()
            },
        ));
        assert_eq!(patch.get(nodes::DEPLOY_DRIVER), None);
        assert_eq!(patch.get(DEPLOY_VFIO_MANAGER), Some(&None));
        // The container stack's own pods never hold back its own driver.
        let mut own = switch_patch(false);
        assert!(!order_switch(
            &mut own,
            StackPodsLeft {
                container: true,
                ..StackPodsLeft::default()
            },
        ));
        assert!(own.contains_key(nodes::DEPLOY_DRIVER));
    }

    #[test]
    fn the_vgpu_manager_waits_for_the_container_stack_and_the_vfio_manager_and_the_driver_for_it() {
        let vgpu = |left: StackPodsLeft| {
            let mut patch = nodes::LabelPatch::from([
                (DEPLOY_VGPU_MANAGER.to_owned(), Some("true".to_owned())),
                (nodes::DEPLOY_DRIVER.to_owned(), None),
            ]);
            (order_switch(&mut patch, left), patch)
        };
        for left in [
            StackPodsLeft {
                container: true,
                ..StackPodsLeft::default()
            },
            StackPodsLeft {
                vfio: true,
                ..StackPodsLeft::default()
            },
        ] {
            let (held, patch) = vgpu(left);
            assert!(held, "{left:?}");
            assert_eq!(patch.get(DEPLOY_VGPU_MANAGER), None, "{left:?}");
        }
        let (held, patch) = vgpu(StackPodsLeft {
            vgpu: true,
            ..StackPodsLeft::default()
        });
        assert!(!held);
        assert!(patch.contains_key(DEPLOY_VGPU_MANAGER));

        let mut driver =
            nodes::LabelPatch::from([(nodes::DEPLOY_DRIVER.to_owned(), Some("true".to_owned()))]);
        assert!(order_switch(
            &mut driver,
            StackPodsLeft {
                vgpu: true,
                ..StackPodsLeft::default()
            }
        ));
        assert!(driver.is_empty());
    }

    fn pod_labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn container_stack_pods_are_the_driver_the_toolkit_and_the_operands_that_open_the_gpus() {
        for labels in [
            vec![
                ("app", "nvidia-driver-daemonset-ubuntu22.04"),
                ("app.kubernetes.io/component", "nvidia-driver"),
            ],
            vec![("app", "nvidia-driver-daemonset")],
            vec![("app", "nvidia-container-toolkit-daemonset")],
            vec![("app", "nvidia-container-toolkit-daemonset-k3s")],
            vec![("app", "nvidia-device-plugin-daemonset")],
            vec![("app", "nvidia-device-plugin-mps-control-daemon")],
            vec![("app", "gpu-feature-discovery")],
            vec![("app", "nvidia-dcgm")],
            vec![("app", "nvidia-dcgm-exporter")],
            vec![("app", "nvidia-mig-manager")],
            vec![("app", "nvidia-node-status-exporter")],
            vec![("app", "nvidia-operator-validator")],
        ] {
            assert!(is_container_stack_pod(&pod_labels(&labels)), "{labels:?}");
        }
        for labels in [
            vec![
                ("app", "nvidia-vfio-manager"),
                ("name", "nvidia-vfio-manager"),
            ],
            vec![("app", "nvidia-sandbox-validator")],
            vec![("app", "nvidia-sandbox-device-plugin-daemonset")],
            vec![
                ("app", "nvidia-driver-prepull"),
                ("app.kubernetes.io/component", "nvidia-driver-prepull"),
            ],
            vec![("app", "node-feature-discovery")],
            vec![("app", "gpu-operator")],
            vec![("app", "nvidia-container-toolkit-daemonsetx")],
            vec![],
        ] {
            assert!(!is_container_stack_pod(&pod_labels(&labels)), "{labels:?}");
        }
    }

    #[test]
    fn a_node_awaits_its_vm_owner_until_it_carries_the_owner_key() {
        let sandbox = on(SandboxWorkload::Container, SandboxMode::Kubevirt);
        let gpu = nodes::NFD_GPU_LABELS[0];
        let passthrough = [(gpu, "true"), (WORKLOAD_CONFIG, "vm-passthrough")];
        assert!(sandbox.awaits_vm_owner(&node(&passthrough)));
        // Any value counts as carried: ours, a pause written by a manager, a user's `false`.
        for value in ["true", "paused-for-cc-mode-change", "false"] {
            let carried = node(&[
                (gpu, "true"),
                (WORKLOAD_CONFIG, "vm-passthrough"),
                (DEPLOY_VFIO_MANAGER, value),
            ]);
            assert!(!sandbox.awaits_vm_owner(&carried), "{value:?}");
        }
        assert!(sandbox.awaits_vm_owner(&node(&[(gpu, "true"), (WORKLOAD_CONFIG, "vm-vgpu")])));
        assert!(!sandbox.awaits_vm_owner(&node(&[(gpu, "true")])));
        // Not a GPU node, taken out of every operand, or sandbox workloads off: no VM owner.
        assert!(!sandbox.awaits_vm_owner(&node(&[(WORKLOAD_CONFIG, "vm-passthrough")])));
        assert!(!sandbox.awaits_vm_owner(&node(&[
            (gpu, "true"),
            (WORKLOAD_CONFIG, "vm-passthrough"),
            (nodes::DEPLOY_OPERANDS, "false"),
        ])));
        assert!(!Sandbox::DISABLED.awaits_vm_owner(&node(&passthrough)));
    }

    #[test]
    fn the_sandbox_keys_are_sorted_and_disjoint_from_the_container_keys() {
        let mut sorted = SANDBOX_DEPLOY_KEYS;
        sorted.sort_unstable();
        assert_eq!(sorted, SANDBOX_DEPLOY_KEYS);
        assert!(
            SANDBOX_DEPLOY_KEYS
                .iter()
                .all(|k| !nodes::DEPLOY_KEYS.contains(k))
        );
    }
}
