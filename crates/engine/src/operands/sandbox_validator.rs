//! Render stage, sandbox validator (pure, no IO): DaemonSet `nvidia-sandbox-validator` on
//! `vm-passthrough` and `vm-vgpu` nodes. Its init container runs `nvidia-validator` for the
//! node's workload type and write `/run/nvidia/validations/workload-type` and the `*-ready`
//! files the sandbox device plugin waits for; its preStop removes them (docs/operand-facts.md
//! §20.4, §20.8). On whenever sandbox workloads are (it has no switch of its own).
//!
//! The confidential-computing check (`cc-manager-validation`) comes first with
//! `ccManager.enabled`, then the VFIO check (`vfio-pci-validation`) and the vGPU checks
//! (`vgpu-manager-validation`, then `vgpu-devices-validation`); each passes at once on nodes of
//! another type.

use k8s_openapi::api::core::v1::{Container, PodSpec};

use super::common::{
    self, HOST_ROOT_VOLUME, HostPathType, MountExt, OperandDaemonSet, PART_OF, PART_OF_LABEL,
    VALIDATIONS_DIR, env, env_field, host_path_volume, merge_user_env, mount, rule,
};
use super::openshift;
use super::validator::VALIDATIONS_VOLUME;
use crate::api::{ClusterPolicySpec, ImageKind, SandboxWorkload, ValidatorComponentSpec};
use crate::facts::ClusterFacts;
use crate::model::{Operand, OperandObjects, ValidatedPolicy};
use crate::workload::Sandbox;

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "sandbox-validator",
    component: None,
    deploy_label: Some(crate::workload::DEPLOY_SANDBOX_VALIDATOR),
    consumes_sharing_config: false,
    enabled: super::Enabled::When(|spec, _| enabled(spec)),
    images: |_, _| vec![ImageKind::Validator],
    host_paths: super::defaults::no_host_paths,
    render,
    check: super::defaults::no_check,
    report: super::defaults::no_report,
};

/// DaemonSet name and `app` label (NVIDIA's).
pub const NAME: &str = "nvidia-sandbox-validator";
/// ServiceAccount, ClusterRole and SCC name.
pub const SERVICE_ACCOUNT: &str = "nvidia-sandbox-validator";
pub const MAIN_CONTAINER: &str = "nvidia-sandbox-validator";
pub const VFIO_PCI_VALIDATION: &str = "vfio-pci-validation";
pub const VGPU_MANAGER_VALIDATION: &str = "vgpu-manager-validation";
pub const VGPU_DEVICES_VALIDATION: &str = "vgpu-devices-validation";
pub const CC_MANAGER_VALIDATION: &str = "cc-manager-validation";

/// NVIDIA names this volume apart from `driver-install-dir`, so `hostPaths.driverInstallDir`
/// does not move it (§20.4).
const DRIVER_INSTALL_PATH: &str = "driver-install-path";

/// The files a sandbox check (its `COMPONENT`) writes under `/run/nvidia/validations` when it
/// passes (§20.8); the sandbox device plugin waits for them.
pub fn files_written(component: &str) -> &'static [&'static str] {
    match component {
        "vfio-pci" => &["workload-type", "vfio-pci-ready"],
        // `host-vgpu-manager-ready` instead when the host runs its own vGPU manager.
        "vgpu-manager" => &[
            "workload-type",
            "vgpu-manager-ready",
            "host-vgpu-manager-ready",
        ],
        "vgpu-devices" => &["workload-type", "vgpu-devices-ready"],
        "cc-manager" => &["cc-manager-ready"],
        _ => &[],
    }
}

/// Whether sandbox workloads are on (the validator follows them alone).
pub fn enabled(spec: &ClusterPolicySpec) -> bool {
    Sandbox::of(spec).enabled
}

/// The label value of a workload type.
fn workload_name(workload: SandboxWorkload) -> &'static str {
    match workload {
        SandboxWorkload::Container => "container",
        SandboxWorkload::VmPassthrough => "vm-passthrough",
        SandboxWorkload::VmVgpu => "vm-vgpu",
    }
}

/// One check: `nvidia-validator` for `component`, waiting until it passes; it works the node's
/// type out itself from the node label and `DEFAULT_GPU_WORKLOAD_CONFIG`.
fn validation(
    policy: &ValidatedPolicy,
    name: &str,
    component: &str,
    user: Option<&ValidatorComponentSpec>,
    mounts: Vec<k8s_openapi::api::core::v1::VolumeMount>,
) -> Container {
    let sandbox = Sandbox::of(&policy.spec);
    let mut envs = vec![
        env("WITH_WAIT", "true"),
        env("COMPONENT", component),
        env_field("NODE_NAME", "spec.nodeName"),
        env(
            "DEFAULT_GPU_WORKLOAD_CONFIG",
            workload_name(sandbox.default_workload),
        ),
    ];
    merge_user_env(&mut envs, user.and_then(|u| u.env.as_ref()));
    nvidia_validator(policy, name, envs, mounts)
}

/// A privileged init container running `nvidia-validator` with `envs`.
fn nvidia_validator(
    policy: &ValidatedPolicy,
    name: &str,
    envs: Vec<k8s_openapi::api::core::v1::EnvVar>,
    mounts: Vec<k8s_openapi::api::core::v1::VolumeMount>,
) -> Container {
    Container {
        env: Some(envs),
        security_context: Some(common::privileged_s0()),
        volume_mounts: Some(mounts),
        ..common::container(
            name,
            &common::image(policy, ImageKind::Validator),
            &["sh", "-c"],
            &["nvidia-validator"],
        )
    }
}

/// Whether the pods carry the confidential-computing check: whenever `ccManager.enabled` is
/// set, in either sandbox mode, as NVIDIA's operator does. In kubevirt mode no CC manager runs,
/// so the check passes only on nodes without `nvidia.com/cc.capable=true` (it skips itself
/// there) and holds the validator on CC-capable ones; that is NVIDIA's behaviour, kept so a
/// policy means the same here (docs/operand-facts.md §20.9).
pub fn checks_cc_manager(spec: &ClusterPolicySpec) -> bool {
    spec.cc_manager.as_ref().is_some_and(|c| c.is_enabled())
}

/// The CC check: on a node labelled `nvidia.com/cc.capable=true` it waits for the CC manager's
/// readiness file, then writes `cc-manager-ready`; elsewhere it passes at once (§20.8). It does
/// not depend on the workload type and has no user env in NVIDIA's API.
fn cc_manager_validation(policy: &ValidatedPolicy) -> Container {
    let envs = vec![
        env("WITH_WAIT", "true"),
        env("COMPONENT", "cc-manager"),
        env_field("NODE_NAME", "spec.nodeName"),
    ];
    nvidia_validator(
        policy,
        CC_MANAGER_VALIDATION,
        envs,
        vec![mount(VALIDATIONS_VOLUME, VALIDATIONS_DIR).bidirectional()],
    )
}

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if !enabled(spec) {
        return None;
    }
    let validator = spec.validator.as_ref();
    let validations = || mount(VALIDATIONS_VOLUME, VALIDATIONS_DIR).bidirectional();
    let host_root = || {
        mount(HOST_ROOT_VOLUME, "/host")
            .read_only()
            .host_to_container()
    };
    // NVIDIA's order: the CC check first, then the workload-type checks; vgpu-devices waits for
    // the devices the vGPU device manager creates once vgpu-manager has passed.
    let mut init = Vec::new();
    if checks_cc_manager(spec) {
        init.push(cc_manager_validation(policy));
    }
    init.extend([
        validation(
            policy,
            VFIO_PCI_VALIDATION,
            "vfio-pci",
            validator.and_then(|v| v.vfio_pci.as_ref()),
            vec![host_root(), validations()],
        ),
        validation(
            policy,
            VGPU_MANAGER_VALIDATION,
            "vgpu-manager",
            validator.and_then(|v| v.vgpu_manager.as_ref()),
            vec![
                host_root(),
                // nvidia-smi of the containerised vGPU manager, when the host has none.
                mount(DRIVER_INSTALL_PATH, common::DEFAULT_DRIVER_INSTALL_DIR).host_to_container(),
                validations(),
            ],
        ),
        validation(
            policy,
            VGPU_DEVICES_VALIDATION,
            "vgpu-devices",
            validator.and_then(|v| v.vgpu_devices.as_ref()),
            vec![validations()],
        ),
    ]);

    let mut main_env = Vec::new();
    merge_user_env(
        &mut main_env,
        validator.and_then(|v| v.container.env.as_ref()),
    );
    let clean_up = format!("rm -f {VALIDATIONS_DIR}/*");
    let main = Container {
        env: (!main_env.is_empty()).then_some(main_env),
        volume_mounts: Some(vec![validations()]),
        security_context: Some(common::privileged()),
        lifecycle: Some(common::pre_stop_exec(&["sh", "-c", &clean_up])),
        ..common::container(
            MAIN_CONTAINER,
            &common::image(policy, ImageKind::Validator),
            &["sh", "-c"],
            &["echo all sandbox validations are successful; while true; do sleep 86400; done"],
        )
    };
    let pod = PodSpec {
        service_account_name: Some(SERVICE_ACCOUNT.to_owned()),
        init_containers: Some(init),
        containers: vec![main],
        volumes: Some(vec![
            host_path_volume(
                VALIDATIONS_VOLUME,
                VALIDATIONS_DIR,
                HostPathType::DirectoryOrCreate,
            ),
            host_path_volume(
                DRIVER_INSTALL_PATH,
                common::DEFAULT_DRIVER_INSTALL_DIR,
                HostPathType::Any,
            ),
            host_path_volume(HOST_ROOT_VOLUME, "/", HostPathType::Any),
        ]),
        ..PodSpec::default()
    };
    let mut ds = OperandDaemonSet::new(Operand::SandboxValidator, NAME, pod, MAIN_CONTAINER);
    ds.extra_selector = vec![(PART_OF_LABEL, PART_OF)];
    ds.annotations = openshift::scc_annotation(facts, SERVICE_ACCOUNT);
    ds.image = validator.map(|v| &v.image);
    ds.overrides = validator.map(|v| &v.container);
    ds.host_network = validator.and_then(|v| v.host_network).unwrap_or(false);

    let mut objects = OperandObjects::default();
    common::add_identity(
        &mut objects,
        Operand::SandboxValidator,
        SERVICE_ACCOUNT,
        openshift::use_privileged_scc(facts).into_iter().collect(),
        // The checks read their own node's workload label.
        vec![rule(&[""], &["nodes"], &["get"])],
        facts,
    );
    objects
        .daemon_sets
        .push(common::operand_daemon_set(policy, facts, ds));
    objects.dynamic.extend(openshift::scc(
        Operand::SandboxValidator,
        SERVICE_ACCOUNT,
        openshift::HostAccess::default(),
        facts,
    ));
    Some(objects)
}
