//! Render stage, Node Feature Discovery (pure, no IO; decision 16): the worker DaemonSet that
//! inspects every node (its PCI devices are how GPU nodes are found), the master Deployment
//! that turns reports into node labels (publishing `nvidia.com/*` so GFD's labels arrive), their
//! ConfigMaps and RBAC, from `spec.nfd` (docs/operand-facts.md §15). Not rendered where NFD already
//! runs.
//!
//! NFD's own CRDs (NodeFeature, NodeFeatureRule, NodeFeatureGroup) are not rendered here: they
//! are never pruned, so the apply stage installs them apart (`controller::vendored_crds`); the chart's
//! `crds/` holds them too.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    DaemonSet, DaemonSetSpec, DaemonSetUpdateStrategy, Deployment, DeploymentSpec,
    RollingUpdateDaemonSet,
};
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, Container, ContainerPort, HTTPGetAction, LocalObjectReference,
    NodeAffinity, NodeSelectorRequirement, NodeSelectorTerm, PodSpec, PodTemplateSpec,
    PreferredSchedulingTerm, Probe, ResourceRequirements, SecurityContext, Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::{Value, json};

use super::common::{
    self, HostPathType, MountExt, NAME_LABEL, env_field, host_path_volume, mount, rule, rule_named,
};
use super::openshift;
use crate::api::{Component, NfdSpec};
use crate::facts::ClusterFacts;
use crate::model::ValidatedPolicy;
use crate::model::{CONFIG_HASH_ANNOTATION, MANAGED_BY_LABEL, MANAGER, Operand, OperandObjects};

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "node-feature-discovery",
    component: Some(Component::Nfd),
    deploy_label: None,
    consumes_sharing_config: false,
    enabled: super::Enabled::When(|spec, facts| {
        spec.is_enabled(Component::Nfd) && !facts.nfd_running
    }),
    images: |_, _| vec![crate::api::ImageKind::Nfd],
    host_paths: super::defaults::no_host_paths,
    render,
    check: |_, facts| facts.nfd_frozen.iter().cloned().collect(),
    report: super::defaults::no_report,
};

/// Prefix of every NFD object name; also its `app.kubernetes.io/name`.
pub const NAME: &str = "node-feature-discovery";
/// The master's ServiceAccount.
pub const SERVICE_ACCOUNT: &str = "node-feature-discovery";
/// The workers' own ServiceAccount: a worker runs on every node, so its token must not carry
/// the master's right to patch every node (as in NFD's own chart).
pub const WORKER_SERVICE_ACCOUNT: &str = "node-feature-discovery-worker";
pub const MASTER: &str = "node-feature-discovery-master";
pub const WORKER: &str = "node-feature-discovery-worker";
pub const MASTER_CONFIG_MAP: &str = "node-feature-discovery-master-conf";
pub const WORKER_CONFIG_MAP: &str = "node-feature-discovery-worker-conf";
/// Label telling master and worker pods apart in selectors.
pub const ROLE_LABEL: &str = "role";
/// The label namespace GFD writes; always published.
pub const NVIDIA_LABEL_NS: &str = "nvidia.com";
/// The names of NFD's CRDs, which the operator installs with the NFD it deploys (sorted; RBAC
/// names them).
pub const CRD_NAMES: [&str; 3] = [
    "nodefeaturegroups.nfd.k8s-sigs.io",
    "nodefeaturerules.nfd.k8s-sigs.io",
    "nodefeatures.nfd.k8s-sigs.io",
];
const MASTER_CONFIG_KEY: &str = "nfd-master.conf";
const WORKER_CONFIG_KEY: &str = "nfd-worker.conf";
const CONFIG_DIR: &str = "/etc/kubernetes/node-feature-discovery";
const FEATURES_DIR: &str = "/etc/kubernetes/node-feature-discovery/features.d/";
const PORT: i32 = 8080;
const CONTROL_PLANE_LABEL: &str = "node-role.kubernetes.io/control-plane";

/// Overlays `overlay` onto `base`: objects merge key by key, anything else replaces.
fn deep_merge(base: &mut Value, overlay: &Value) {
    match (base, overlay) {
        (Value::Object(base), Value::Object(overlay)) => {
            for (key, value) in overlay {
                match base.get_mut(key) {
                    Some(existing) => deep_merge(existing, value),
                    None => {
                        base.insert(key.clone(), value.clone());
                    }
                }
            }
        }
        (base, overlay) => *base = overlay.clone(),
    }
}

fn yaml(value: &Value) -> String {
    serde_yaml_ng::to_string(value).unwrap_or_default()
}

/// `nfd-master.conf`: the user's settings over ours, and `extraLabelNs` always holding
/// `nvidia.com` (without it NFD drops GFD's labels).
pub fn master_config(nfd: &NfdSpec) -> String {
    let master = nfd.master.as_ref();
    let mut namespaces = vec![NVIDIA_LABEL_NS.to_owned()];
    for ns in master
        .and_then(|m| m.extra_label_ns.as_ref())
        .into_iter()
        .flatten()
    {
        if !namespaces.contains(ns) {
            namespaces.push(ns.clone());
        }
    }
    let mut config = json!({});
    if let Some(user) = master.and_then(|m| m.config.as_ref()) {
        deep_merge(&mut config, &Value::Object(user.clone()));
    }
    if let Some(Value::Array(user_ns)) = config.get("extraLabelNs") {
        for ns in user_ns.iter().filter_map(Value::as_str) {
            if !namespaces.iter().any(|n| n == ns) {
                namespaces.push(ns.to_owned());
            }
        }
    }
    config["extraLabelNs"] = json!(namespaces);
    yaml(&config)
}

/// `nfd-worker.conf`: PCI labels for network and display controllers by vendor (which yields
/// `feature.node.kubernetes.io/pci-10de.present` on GPU nodes), under the user's settings.
pub fn worker_config(nfd: &NfdSpec) -> String {
    let mut config = json!({
        "sources": {"pci": {
            "deviceClassWhitelist": ["02", "0200", "0207", "0300", "0302"],
            "deviceLabelFields": ["vendor"],
        }}
    });
    if let Some(user) = nfd.worker.as_ref().and_then(|w| w.config.as_ref()) {
        deep_merge(&mut config, &Value::Object(user.clone()));
    }
    yaml(&config)
}

fn quantities(pairs: &[(&str, &str)]) -> BTreeMap<String, Quantity> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned())))
        .collect()
}

fn resources(
    user: Option<&crate::api::ResourceRequirements>,
    requests: &[(&str, &str)],
    limits: &[(&str, &str)],
) -> ResourceRequirements {
    match user {
        Some(user) => ResourceRequirements {
            limits: user.limits.clone(),
            requests: user.requests.clone(),
            claims: None,
        },
        None => ResourceRequirements {
            limits: Some(quantities(limits)),
            requests: Some(quantities(requests)),
            claims: None,
        },
    }
}

/// NFD needs no privileges: it reads host files through read-only mounts.
fn restricted() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_owned()]),
            add: None,
        }),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        ..SecurityContext::default()
    }
}

fn health_probe(initial_delay: Option<i32>, failure_threshold: Option<i32>) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some("/healthz".to_owned()),
            port: IntOrString::String("http".to_owned()),
            ..HTTPGetAction::default()
        }),
        initial_delay_seconds: initial_delay,
        failure_threshold,
        ..Probe::default()
    }
}

fn control_plane_toleration() -> Toleration {
    Toleration {
        key: Some(CONTROL_PLANE_LABEL.to_owned()),
        operator: Some("Exists".to_owned()),
        effect: Some("NoSchedule".to_owned()),
        ..Toleration::default()
    }
}

fn tolerations(user: Option<&Vec<Toleration>>, default: Vec<Toleration>) -> Vec<Toleration> {
    user.filter(|t| !t.is_empty()).cloned().unwrap_or(default)
}

/// The worker's tolerations, plus one for each `nodePools` and `gpuReadiness` taint not tolerated
/// yet: NFD must keep running on tainted GPU nodes.
fn worker_tolerations(
    spec: &crate::api::ClusterPolicySpec,
    user: Option<&Vec<Toleration>>,
) -> Vec<Toleration> {
    let mut out = tolerations(
        user,
        vec![control_plane_toleration(), common::gpu_toleration()],
    );
    let pools = crate::node_pools::operand_tolerations(spec, &out);
    out.extend(pools);
    // A node joining with the startup taint is discovered by NFD before anything else runs.
    let readiness = crate::gpu_readiness::operand_tolerations(spec, &out);
    out.extend(readiness);
    out
}

fn selector(role: &str) -> BTreeMap<String, String> {
    common::string_map(&[(NAME_LABEL, NAME), (ROLE_LABEL, role)])
}

fn workload_meta(name: &str, role: &str, facts: &ClusterFacts) -> ObjectMeta {
    let mut meta = common::meta(Operand::Nfd, name, facts, true);
    common::add_labels(&mut meta, &[(ROLE_LABEL, role)]);
    meta
}

fn template_meta(role: &str, config_hash: String) -> ObjectMeta {
    let mut labels = selector(role);
    labels.insert(common::PART_OF_LABEL.to_owned(), common::PART_OF.to_owned());
    labels.insert(MANAGED_BY_LABEL.to_owned(), MANAGER.to_owned());
    ObjectMeta {
        labels: Some(labels),
        annotations: Some(BTreeMap::from([(
            CONFIG_HASH_ANNOTATION.to_owned(),
            config_hash,
        )])),
        ..ObjectMeta::default()
    }
}

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if !spec.is_enabled(Component::Nfd) || facts.nfd_running {
        return None;
    }
    let default_nfd = NfdSpec::default();
    let nfd = spec.nfd.as_ref().unwrap_or(&default_nfd);
    let image = common::image(policy, crate::api::ImageKind::Nfd);
    let pull_policy = common::pull_policy(Some(&nfd.image));
    let pull_secrets: Option<Vec<LocalObjectReference>> = nfd
        .image
        .image_pull_secrets
        .as_ref()
        .map(|names| {
            let mut unique: Vec<&String> = Vec::new();
            for n in names.iter().filter(|n| !n.is_empty()) {
                if !unique.contains(&n) {
                    unique.push(n);
                }
            }
            unique
                .into_iter()
                .map(|name| LocalObjectReference { name: name.clone() })
                .collect::<Vec<_>>()
        })
        .filter(|v| !v.is_empty());
    let priority = common::priority_class(spec);
    let http_port = || {
        Some(vec![ContainerPort {
            name: Some("http".to_owned()),
            container_port: PORT,
            protocol: Some("TCP".to_owned()),
            ..ContainerPort::default()
        }])
    };

    let master_data = BTreeMap::from([(MASTER_CONFIG_KEY.to_owned(), master_config(nfd))]);
    let worker_data = BTreeMap::from([(WORKER_CONFIG_KEY.to_owned(), worker_config(nfd))]);
    let master_hash = common::config_hash(&master_data);
    let worker_hash = common::config_hash(&worker_data);
    let master_spec = nfd.master.clone().unwrap_or_default();
    let worker_spec = nfd.worker.clone().unwrap_or_default();

    let master_container = Container {
        env: Some(vec![env_field("NODE_NAME", "spec.nodeName")]),
        ports: http_port(),
        image_pull_policy: Some(pull_policy.clone()),
        startup_probe: Some(health_probe(None, Some(30))),
        liveness_probe: Some(health_probe(None, None)),
        readiness_probe: Some(health_probe(None, Some(10))),
        resources: Some(resources(
            master_spec.resources.as_ref(),
            &[("cpu", "100m"), ("memory", "128Mi")],
            &[("memory", "4Gi")],
        )),
        security_context: Some(restricted()),
        volume_mounts: Some(vec![mount("nfd-master-conf", CONFIG_DIR).read_only()]),
        // One replica, so no leader election.
        ..common::container(
            "nfd-master",
            &image,
            &["nfd-master"],
            &[&format!("-port={PORT}")],
        )
    };
    let default_master_affinity = Affinity {
        node_affinity: Some(NodeAffinity {
            preferred_during_scheduling_ignored_during_execution: Some(vec![
                PreferredSchedulingTerm {
                    weight: 1,
                    preference: NodeSelectorTerm {
                        match_expressions: Some(vec![NodeSelectorRequirement {
                            key: CONTROL_PLANE_LABEL.to_owned(),
                            operator: "Exists".to_owned(),
                            values: None,
                        }]),
                        match_fields: None,
                    },
                },
            ]),
            ..NodeAffinity::default()
        }),
        ..Affinity::default()
    };
    let master = Deployment {
        metadata: workload_meta(MASTER, "master", facts),
        spec: Some(DeploymentSpec {
            replicas: Some(1),
            selector: LabelSelector {
                match_labels: Some(selector("master")),
                match_expressions: None,
            },
            template: PodTemplateSpec {
                metadata: Some(template_meta("master", master_hash)),
                spec: Some(PodSpec {
                    service_account_name: Some(SERVICE_ACCOUNT.to_owned()),
                    enable_service_links: Some(false),
                    dns_policy: Some("ClusterFirstWithHostNet".to_owned()),
                    priority_class_name: Some(priority.clone()),
                    image_pull_secrets: pull_secrets.clone(),
                    tolerations: Some(tolerations(
                        master_spec.tolerations.as_ref(),
                        vec![control_plane_toleration()],
                    )),
                    affinity: Some(
                        master_spec
                            .affinity
                            .clone()
                            .unwrap_or(default_master_affinity),
                    ),
                    node_selector: master_spec.node_selector.clone().filter(|n| !n.is_empty()),
                    containers: vec![master_container],
                    volumes: Some(vec![common::config_map_volume(
                        "nfd-master-conf",
                        MASTER_CONFIG_MAP,
                        None,
                        &[(MASTER_CONFIG_KEY, MASTER_CONFIG_KEY)],
                    )]),
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }),
        status: None,
    };

    let host_mounts: [(&str, &str, &str); 7] = [
        ("host-boot", "/boot", "/host-boot"),
        ("host-os-release", "/etc/os-release", "/host-etc/os-release"),
        ("host-sys", "/sys", "/host-sys"),
        ("host-usr-lib", "/usr/lib", "/host-usr/lib"),
        ("host-lib", "/lib", "/host-lib"),
        ("host-proc-swaps", "/proc/swaps", "/host-proc/swaps"),
        ("features-d", FEATURES_DIR, FEATURES_DIR),
    ];
    let mut worker_volumes: Vec<_> = host_mounts
        .iter()
        .map(|(name, host, _)| host_path_volume(name, host, HostPathType::Any))
        .collect();
    worker_volumes.push(common::config_map_volume(
        "nfd-worker-conf",
        WORKER_CONFIG_MAP,
        None,
        &[(WORKER_CONFIG_KEY, WORKER_CONFIG_KEY)],
    ));
    let mut worker_mounts: Vec<_> = host_mounts
        .iter()
        .map(|(name, _, path)| mount(name, path).read_only())
        .collect();
    worker_mounts.push(mount("nfd-worker-conf", CONFIG_DIR).read_only());
    let worker_container = Container {
        env: Some(vec![
            env_field("NODE_NAME", "spec.nodeName"),
            env_field("POD_NAME", "metadata.name"),
            env_field("POD_UID", "metadata.uid"),
        ]),
        ports: http_port(),
        image_pull_policy: Some(pull_policy),
        liveness_probe: Some(health_probe(Some(10), None)),
        readiness_probe: Some(health_probe(Some(5), Some(10))),
        resources: Some(resources(
            worker_spec.resources.as_ref(),
            &[("cpu", "5m"), ("memory", "64Mi")],
            &[("memory", "512Mi")],
        )),
        security_context: Some(restricted()),
        volume_mounts: Some(worker_mounts),
        ..common::container(
            "nfd-worker",
            &image,
            &["nfd-worker"],
            // NodeFeature objects owned by the worker pod vanish with it.
            &["-owner-refs=pod,ds", &format!("-port={PORT}")],
        )
    };
    let worker = DaemonSet {
        metadata: workload_meta(WORKER, "worker", facts),
        spec: Some(DaemonSetSpec {
            selector: LabelSelector {
                match_labels: Some(selector("worker")),
                match_expressions: None,
            },
            template: PodTemplateSpec {
                metadata: Some(template_meta("worker", worker_hash)),
                spec: Some(PodSpec {
                    service_account_name: Some(WORKER_SERVICE_ACCOUNT.to_owned()),
                    dns_policy: Some("ClusterFirstWithHostNet".to_owned()),
                    priority_class_name: Some(priority),
                    image_pull_secrets: pull_secrets,
                    // Every node, GPU pools included: this is how GPU nodes are found.
                    tolerations: Some(worker_tolerations(spec, worker_spec.tolerations.as_ref())),
                    affinity: worker_spec.affinity.clone(),
                    node_selector: worker_spec.node_selector.clone().filter(|n| !n.is_empty()),
                    containers: vec![worker_container],
                    volumes: Some(worker_volumes),
                    ..PodSpec::default()
                }),
            },
            update_strategy: Some(DaemonSetUpdateStrategy {
                type_: Some("RollingUpdate".to_owned()),
                rolling_update: Some(RollingUpdateDaemonSet {
                    max_unavailable: Some(IntOrString::String("10%".to_owned())),
                    max_surge: None,
                }),
            }),
            ..DaemonSetSpec::default()
        }),
        status: None,
    };

    let mut objects = OperandObjects::default();
    objects
        .service_accounts
        .push(k8s_openapi::api::core::v1::ServiceAccount {
            metadata: common::meta(Operand::Nfd, SERVICE_ACCOUNT, facts, true),
            ..Default::default()
        });
    objects
        .service_accounts
        .push(k8s_openapi::api::core::v1::ServiceAccount {
            metadata: common::meta(Operand::Nfd, WORKER_SERVICE_ACCOUNT, facts, true),
            ..Default::default()
        });
    const NFD_GROUP: &str = "nfd.k8s-sigs.io";
    common::add_cluster_role(
        &mut objects,
        Operand::Nfd,
        NAME,
        SERVICE_ACCOUNT,
        vec![
            rule(&[""], &["namespaces"], &["watch", "list"]),
            // The master writes the labels.
            rule(
                &[""],
                &["nodes", "nodes/status"],
                &["get", "patch", "update", "list"],
            ),
            rule(
                &[NFD_GROUP],
                &["nodefeatures", "nodefeaturerules", "nodefeaturegroups"],
                &["get", "list", "watch"],
            ),
            rule(
                &[NFD_GROUP],
                &["nodefeaturegroups/status"],
                &["patch", "update"],
            ),
        ],
        facts,
    );
    // The master's leader-election Lease lives in its own namespace, so a Role there is enough
    // (a ClusterRole would let it, and the operator that grants it, write Leases anywhere).
    common::add_role(
        &mut objects,
        Operand::Nfd,
        NAME,
        SERVICE_ACCOUNT,
        vec![
            rule(&["coordination.k8s.io"], &["leases"], &["create"]),
            rule_named(
                &["coordination.k8s.io"],
                &["leases"],
                &["nfd-master.nfd.kubernetes.io"],
                &["get", "update"],
            ),
        ],
        facts,
    );
    common::add_role(
        &mut objects,
        Operand::Nfd,
        WORKER,
        WORKER_SERVICE_ACCOUNT,
        vec![
            // Each worker reports its node as a NodeFeature object.
            rule(
                &[NFD_GROUP],
                &["nodefeatures"],
                &["create", "get", "update", "delete"],
            ),
            rule(&[""], &["pods"], &["get"]),
        ]
        .into_iter()
        // The worker mounts host paths: on OpenShift only the privileged SCC admits it.
        .chain(openshift::use_privileged_scc(facts))
        .collect(),
        facts,
    );
    objects.config_maps.push(common::config_map(
        Operand::Nfd,
        MASTER_CONFIG_MAP,
        master_data,
        facts,
    ));
    objects.config_maps.push(common::config_map(
        Operand::Nfd,
        WORKER_CONFIG_MAP,
        worker_data,
        facts,
    ));
    objects.daemon_sets.push(worker);
    objects.deployments.push(master);
    Some(objects)
}
