//! Render stage, operator-validator (pure, no IO): DaemonSet `nvidia-operator-validator` whose
//! init containers check driver -> toolkit -> CUDA -> device plugin on each node and write
//! `/run/nvidia/validations/<stage>-ready`, the files other operands' init containers wait for
//! (docs/operand-facts.md §3, §7). Also the validation init containers other operands reuse.

use k8s_openapi::api::core::v1::{Container, PodSpec, VolumeMount};

use super::common::{
    self, DRIVER_INSTALL_DIR_VOLUME, DRIVER_VALIDATION_CONTAINER, GpuAccess, HOST_DEV_CHAR_VOLUME,
    HOST_ROOT_VOLUME, HostPathType, MountExt, OperandDaemonSet, PART_OF, PART_OF_LABEL,
    VALIDATIONS_DIR, env, env_field, host_path_volume, merge_user_env, mount, rule,
};
use super::openshift;
use crate::api::{Component, ImageKind};
use crate::facts::ClusterFacts;
use crate::model::ValidatedPolicy;
use crate::model::{Operand, OperandObjects};

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "operator-validator",
    component: Some(Component::Validator),
    deploy_label: Some(crate::nodes::DEPLOY_VALIDATOR),
    consumes_sharing_config: false,
    enabled: super::Enabled::BySwitch,
    images: |_, _| vec![ImageKind::Validator],
    host_paths: super::defaults::no_host_paths,
    render,
    check: super::defaults::no_check,
    report: super::defaults::no_report,
};

/// DaemonSet name and `app` label.
pub const NAME: &str = "nvidia-operator-validator";
/// ServiceAccount (and Role, ClusterRole, SCC) name; the CUDA workload pod runs under it too.
pub const SERVICE_ACCOUNT: &str = "nvidia-operator-validator";
/// The main container: it only reports success and cleans the status files up on stop.
pub const MAIN_CONTAINER: &str = "nvidia-operator-validator";
pub const TOOLKIT_VALIDATION: &str = "toolkit-validation";
pub const CUDA_VALIDATION: &str = "cuda-validation";
pub const PLUGIN_VALIDATION: &str = "plugin-validation";
/// `app` labels of the workload pods the CUDA and plugin checks start.
pub const WORKLOAD_APPS: [&str; 2] = ["nvidia-cuda-validator", "nvidia-device-plugin-validator"];
/// The admission policy keeping the validator's pod writes to its own workload pods.
pub const CONFINEMENT_POLICY: &str = "nvidia-operator-validator-workloads";
/// The hostPath volume holding the status files.
pub const VALIDATIONS_VOLUME: &str = "run-nvidia-validations";

/// The checks the validator runs on each node, in order; each writes one status file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Driver,
    Toolkit,
    Cuda,
    Plugin,
}

impl Stage {
    /// Every stage, in the order the init containers run.
    pub const ALL: [Stage; 4] = [Stage::Driver, Stage::Toolkit, Stage::Cuda, Stage::Plugin];

    /// The `COMPONENT` value that selects the check in `nvidia-validator`.
    pub const fn component(self) -> &'static str {
        match self {
            Stage::Driver => "driver",
            Stage::Toolkit => "toolkit",
            Stage::Cuda => "cuda",
            Stage::Plugin => "plugin",
        }
    }

    /// The status file the check writes when it passes.
    pub fn ready_file(self) -> String {
        format!("{VALIDATIONS_DIR}/{}-ready", self.component())
    }
}

/// The `driver-validation` init container (validator and toolkit pods): waits for the driver
/// (host-installed or containerised), creates the `/dev/char` links and writes `driver-ready`.
pub fn driver_validation(policy: &ValidatedPolicy) -> Container {
    Container {
        env: Some(vec![
            env("WITH_WAIT", "true"),
            env("COMPONENT", Stage::Driver.component()),
            env_field("OPERATOR_NAMESPACE", "metadata.namespace"),
        ]),
        volume_mounts: Some(vec![
            mount(HOST_ROOT_VOLUME, "/host")
                .read_only()
                .host_to_container(),
            mount(
                DRIVER_INSTALL_DIR_VOLUME,
                common::DEFAULT_DRIVER_INSTALL_DIR,
            )
            .host_to_container(),
            mount(VALIDATIONS_VOLUME, VALIDATIONS_DIR).bidirectional(),
            mount(HOST_DEV_CHAR_VOLUME, "/host-dev-char"),
        ]),
        security_context: Some(common::privileged_s0()),
        ..validator_container(policy, DRIVER_VALIDATION_CONTAINER)
    }
}

/// What a `toolkit-validation` init container says while it waits: NVIDIA's words, to the
/// letter, since they are part of the pod template (a different word would restart NVIDIA's
/// pods when this operator takes them over). MIG manager's says "toolkit".
pub const WAITING_FOR_STACK: &str = "nvidia container stack";
pub const WAITING_FOR_TOOLKIT: &str = "nvidia container toolkit";

/// A `toolkit-validation` init container for operands that need the NVIDIA runtime: it only
/// waits until the validator wrote `toolkit-ready`. `validations` mounts the status directory
/// at [`VALIDATIONS_DIR`] (directly or through `/run/nvidia`).
pub fn wait_for_toolkit(policy: &ValidatedPolicy, validations: VolumeMount) -> Container {
    wait_for_toolkit_saying(policy, validations, WAITING_FOR_STACK)
}

/// [`wait_for_toolkit`], saying it waits for `what`.
pub fn wait_for_toolkit_saying(
    policy: &ValidatedPolicy,
    validations: VolumeMount,
    what: &str,
) -> Container {
    let file = Stage::Toolkit.ready_file();
    let script =
        format!("until [ -f {file} ]; do echo waiting for {what} to be setup; sleep 5; done");
    Container {
        command: Some(vec!["sh".to_owned(), "-c".to_owned()]),
        args: Some(vec![script]),
        volume_mounts: Some(vec![validations]),
        security_context: Some(common::privileged()),
        ..common::container(
            TOOLKIT_VALIDATION,
            &common::image(policy, ImageKind::Validator),
            &[],
            &[],
        )
    }
}

fn validator_container(policy: &ValidatedPolicy, name: &str) -> Container {
    common::container(
        name,
        &common::image(policy, ImageKind::Validator),
        &["sh", "-c"],
        &["nvidia-validator"],
    )
}

/// The variables that let the CUDA and plugin checks start their own workload pods with the
/// validator's image, pull settings and runtime class.
fn workload_env(
    policy: &ValidatedPolicy,
    runtime_class: Option<&str>,
) -> Vec<k8s_openapi::api::core::v1::EnvVar> {
    let image = policy.spec.validator.as_ref().map(|v| &v.image);
    let mut out = vec![
        env(
            "VALIDATOR_IMAGE",
            &common::image(policy, ImageKind::Validator),
        ),
        env("VALIDATOR_IMAGE_PULL_POLICY", &common::pull_policy(image)),
    ];
    let secrets: Vec<&str> = image
        .and_then(|i| i.image_pull_secrets.as_ref())
        .into_iter()
        .flatten()
        .map(String::as_str)
        .filter(|s| !s.is_empty())
        .collect();
    if !secrets.is_empty() {
        out.push(env("VALIDATOR_IMAGE_PULL_SECRETS", &secrets.join(",")));
    }
    if let Some(class) = runtime_class {
        out.push(env("VALIDATOR_RUNTIME_CLASS", class));
    }
    out
}

/// A GPUCluster's DRA validator (NVIDIA's `state-dra-validation`).
pub const DRA_DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "dra-validator",
    deploy_label: Some(crate::nodes::DEPLOY_DRA_VALIDATOR),
    ..super::dra_driver::NOT_FROM_A_POLICY
};

/// The DRA validator's DaemonSet, ServiceAccount, `app` label and SCC name (NVIDIA's).
pub const DRA_NAME: &str = "nvidia-dra-validator";
/// Its claim template: one GPU of the node with admin access.
pub const DRA_CLAIM_TEMPLATE: &str = "nvidia-dra-validator-gpu";
/// Its pod-level claim name and init container (NVIDIA's).
pub const DRA_CLAIM: &str = "validation-gpu";
pub const GPU_VALIDATION: &str = "gpu-validation";

/// A GPUCluster's DRA validator, NVIDIA's DRA-native counterpart of this operand: its pod claims
/// one GPU of its node through the DRA driver (admin access: never reserved, never blocked by
/// workloads), so it is scheduled only once the driver publishes the node's GPUs; its
/// `gpu-validation` init container runs `nvidia-smi -L`, which the claim's CDI injection
/// provides, proving the driver allocated and injected a working GPU; the main container then
/// holds the pod Ready. Image, pull policy and pull secrets are the validator image and
/// `draDriver`'s settings, as in NVIDIA's operator; tolerations, priority class, labels and
/// annotations come from `daemonsets`.
pub fn render_dra(
    cluster: &super::dra_driver::ValidatedGpuCluster,
    facts: &ClusterFacts,
) -> OperandObjects {
    let operand = Operand::DraValidator;
    let dra = cluster.spec.dra_driver.clone().unwrap_or_default();
    let image = crate::api::ImageSpec {
        image_pull_policy: dra.image_pull_policy.clone(),
        image_pull_secrets: dra.image_pull_secrets.clone(),
        ..Default::default()
    };
    let mut policy = super::dra_driver::policy_view(cluster);
    policy
        .images
        .insert(ImageKind::Validator, cluster.validator_image.clone());
    policy.spec.validator = Some(crate::api::ValidatorSpec {
        image: image.clone(),
        ..Default::default()
    });
    let check = common::container(
        GPU_VALIDATION,
        &cluster.validator_image,
        &["sh", "-c"],
        // nvidia-smi comes with the claimed GPU's CDI injection, not with the image.
        &["nvidia-smi -L"],
    );
    let main = common::container(
        DRA_NAME,
        &cluster.validator_image,
        &["sh", "-c"],
        &["echo all validations are successful; while true; do sleep 86400; done"],
    );
    let mut pod = PodSpec {
        service_account_name: Some(DRA_NAME.to_owned()),
        init_containers: Some(vec![check]),
        containers: vec![main],
        ..PodSpec::default()
    };
    super::dra_driver::claim_gpus(&mut pod, DRA_CLAIM, DRA_CLAIM_TEMPLATE);
    let mut ds = OperandDaemonSet::new(operand, DRA_NAME, pod, DRA_NAME);
    ds.annotations = openshift::scc_annotation(facts, DRA_NAME);
    ds.image = Some(&image);
    ds.gpu_access = GpuAccess::None;
    let mut objects = OperandObjects::default();
    // It makes no API request, and its own SCC admits it by ServiceAccount: no Role (NVIDIA
    // grants it none either).
    common::add_identity(
        &mut objects,
        operand,
        DRA_NAME,
        Vec::new(),
        Vec::new(),
        facts,
    );
    let mut daemon_set = common::operand_daemon_set(&policy, facts, ds);
    // The check is no validator step: it runs as the image's user, as NVIDIA's does.
    if let Some(c) = daemon_set
        .spec
        .as_mut()
        .and_then(|s| s.template.spec.as_mut())
        .and_then(|p| p.init_containers.as_mut())
        .and_then(|c| c.first_mut())
    {
        c.security_context = None;
    }
    objects.daemon_sets.push(daemon_set);
    objects
        .dynamic
        .push(super::dra_driver::admin_claim_template(
            operand,
            DRA_CLAIM_TEMPLATE,
            DRA_CLAIM,
            Some(1),
            facts,
        ));
    objects.dynamic.extend(openshift::scc(
        operand,
        DRA_NAME,
        openshift::HostAccess::default(),
        facts,
    ));
    objects
}

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if !spec.is_enabled(Component::Validator) {
        return None;
    }
    let validator = spec.validator.as_ref();
    let runtime_class = common::sets_runtime_class(spec, facts)
        .then(|| common::runtime_class_name(spec).to_owned());
    let validations = || mount(VALIDATIONS_VOLUME, VALIDATIONS_DIR).bidirectional();

    let toolkit = Container {
        env: Some(vec![
            // Only a container the runtime handed GPUs to can run nvidia-smi.
            env("NVIDIA_VISIBLE_DEVICES", "all"),
            env("WITH_WAIT", "false"),
            env("COMPONENT", Stage::Toolkit.component()),
        ]),
        volume_mounts: Some(vec![validations()]),
        security_context: Some(common::privileged()),
        ..validator_container(policy, TOOLKIT_VALIDATION)
    };

    let mut cuda_env = vec![
        env("WITH_WAIT", "false"),
        env("COMPONENT", Stage::Cuda.component()),
        env_field("NODE_NAME", "spec.nodeName"),
        env_field("OPERATOR_NAMESPACE", "metadata.namespace"),
    ];
    cuda_env.extend(workload_env(policy, runtime_class.as_deref()));
    merge_user_env(
        &mut cuda_env,
        validator
            .and_then(|v| v.cuda.as_ref())
            .and_then(|s| s.env.as_ref()),
    );
    let cuda = Container {
        env: Some(cuda_env),
        volume_mounts: Some(vec![validations()]),
        security_context: Some(common::privileged()),
        ..validator_container(policy, CUDA_VALIDATION)
    };

    let mut init = vec![driver_validation(policy), toolkit, cuda];
    // The plugin check needs a plugin to check.
    if spec.is_enabled(Component::DevicePlugin) {
        let mut plugin_env = vec![
            env("COMPONENT", Stage::Plugin.component()),
            env("WITH_WAIT", "false"),
            env("WITH_WORKLOAD", "false"),
        ];
        if let Some(strategy) = common::mig_strategy(spec) {
            plugin_env.push(env("MIG_STRATEGY", common::mig_strategy_name(strategy)));
        }
        plugin_env.push(env_field("NODE_NAME", "spec.nodeName"));
        plugin_env.push(env_field("OPERATOR_NAMESPACE", "metadata.namespace"));
        plugin_env.extend(workload_env(policy, runtime_class.as_deref()));
        merge_user_env(
            &mut plugin_env,
            validator
                .and_then(|v| v.plugin.as_ref())
                .and_then(|s| s.env.as_ref()),
        );
        init.push(Container {
            env: Some(plugin_env),
            volume_mounts: Some(vec![validations()]),
            security_context: Some(common::privileged()),
            ..validator_container(policy, PLUGIN_VALIDATION)
        });
    }

    let mut main_env = Vec::new();
    merge_user_env(
        &mut main_env,
        validator.and_then(|v| v.container.env.as_ref()),
    );
    let clean_up = format!("rm -f {VALIDATIONS_DIR}/*-ready");
    let main = Container {
        env: (!main_env.is_empty()).then_some(main_env),
        volume_mounts: Some(vec![validations()]),
        security_context: Some(common::privileged()),
        // The hidden .driver-* files belong to the driver container and are not matched.
        lifecycle: Some(common::pre_stop_exec(&["sh", "-c", &clean_up])),
        ..common::container(
            MAIN_CONTAINER,
            &common::image(policy, ImageKind::Validator),
            &["sh", "-c"],
            &["echo all validations are successful; while true; do sleep 86400; done"],
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
                DRIVER_INSTALL_DIR_VOLUME,
                common::DEFAULT_DRIVER_INSTALL_DIR,
                HostPathType::Any,
            ),
            host_path_volume(HOST_ROOT_VOLUME, "/", HostPathType::Any),
            host_path_volume(HOST_DEV_CHAR_VOLUME, "/dev/char", HostPathType::Any),
        ]),
        ..PodSpec::default()
    };
    let mut ds = OperandDaemonSet::new(Operand::Validator, NAME, pod, MAIN_CONTAINER);
    ds.extra_selector = vec![(PART_OF_LABEL, PART_OF)];
    ds.image = validator.map(|v| &v.image);
    ds.overrides = validator.map(|v| &v.container);
    ds.host_network = validator.and_then(|v| v.host_network).unwrap_or(false);
    ds.gpu_access = GpuAccess::Runtime {
        nri_container: TOOLKIT_VALIDATION,
    };

    let mut objects = OperandObjects::default();
    let role_rules = openshift::use_privileged_scc(facts)
        .into_iter()
        .chain([
            // The CUDA and plugin checks run workload pods, poll them and clean them up; the
            // confinement policy keeps these to workload pods on the caller's node.
            rule(&[""], &["pods"], &["create", "get", "list", "delete"]),
            // The driver check looks for the driver DaemonSet.
            rule(&["apps"], &["daemonsets"], &["get", "list", "watch"]),
        ])
        .collect();
    let cluster_rules = vec![
        rule(&[""], &["nodes"], &["get", "list", "watch"]),
        // Workload pods carry owner references that block the policy's deletion.
        rule(
            &["nvidia.com"],
            &["clusterpolicies/finalizers", "nvidiadrivers/finalizers"],
            &[
                "create", "get", "list", "watch", "update", "patch", "delete",
            ],
        ),
    ];
    common::add_identity(
        &mut objects,
        Operand::Validator,
        SERVICE_ACCOUNT,
        role_rules,
        cluster_rules,
        facts,
    );
    objects.dynamic.extend(confinement(facts));
    objects
        .daemon_sets
        .push(common::operand_daemon_set(policy, facts, ds));
    objects.dynamic.extend(openshift::scc(
        Operand::Validator,
        SERVICE_ACCOUNT,
        openshift::HostAccess {
            pid: true,
            ..Default::default()
        },
        facts,
    ));
    Some(objects)
}

/// The validator may create pods in the operator namespace, which admits privileged pods: its
/// token must not start anything but its own workload pod on its own node (its ServiceAccount,
/// one of its `app` labels, no host path), nor delete other pods.
fn confinement(facts: &ClusterFacts) -> Vec<kube_core::DynamicObject> {
    let apps = common::cel_list(&WORKLOAD_APPS);
    let create = common::Confinement {
        group: "",
        resources: &["pods"],
        operations: &["CREATE"],
        checks: vec![
            (
                format!("object.spec.?serviceAccountName.orValue('') == '{SERVICE_ACCOUNT}'"),
                format!(
                    "'workload pods run as ServiceAccount {SERVICE_ACCOUNT}, not ' + \
                     object.spec.?serviceAccountName.orValue('(none)')"
                ),
            ),
            (
                format!("object.metadata.?labels[?'app'].orValue('') in {apps}"),
                format!(
                    "'workload pods carry the label app={}'",
                    WORKLOAD_APPS.join(" or app=")
                ),
            ),
            (
                "object.spec.?nodeName.orValue('') == variables.callerNode".to_owned(),
                "'workload pods are pinned to the node of the validator that starts them'"
                    .to_owned(),
            ),
            (
                "!object.spec.?volumes.orValue([]).exists(v, has(v.hostPath))".to_owned(),
                "'workload pods mount no host path'".to_owned(),
            ),
        ],
    };
    let delete = common::Confinement {
        group: "",
        resources: &["pods"],
        operations: &["DELETE"],
        checks: vec![(
            format!(
                "oldObject.metadata.?labels[?'app'].orValue('') in {apps} && \
                 oldObject.spec.?nodeName.orValue('') == variables.callerNode"
            ),
            "'only workload pods on the node of the caller may be deleted, not ' + oldObject.metadata.name"
                .to_owned(),
        )],
    };
    common::confinement_policy(
        Operand::Validator,
        CONFINEMENT_POLICY,
        &[SERVICE_ACCOUNT],
        &[create, delete],
        facts,
    )
}
