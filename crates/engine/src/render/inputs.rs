//! Render stage inputs of the `render` subcommand (pure, no IO): the cluster facts come from
//! flags and from ConfigMaps given as files instead of from a cluster (decision 3). Owner
//! references are left out, so the output can be applied by GitOps tools as it is.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use thiserror::Error;

use super::render;
use crate::api::ClusterPolicy;
use crate::facts::{self, ClusterFacts, NamespaceObjects, NodeRuntimeInfo, Observed, Runtime};
use crate::nodes::NodeView;
use crate::operands::mig_manager;
use crate::sharing::select::{SharingDecision, select_config};
use crate::validate::validate;

/// The facts `gpu-operator render` takes as flags.
#[derive(Clone, Debug, Default)]
pub struct RenderOptions {
    /// The operator namespace.
    pub namespace: String,
    /// The container runtime; CRI-O on OpenShift, containerd when not given.
    pub runtime: Option<Runtime>,
    pub openshift: bool,
    /// The GPU nodes' `<ID><VERSION_ID>` (the driver tag's suffix).
    pub os_tag: Option<String>,
    /// Whether the ServiceMonitor API is served.
    pub service_monitor_api: bool,
    /// Whether NFD already runs (then ours is not rendered).
    pub nfd_running: bool,
    /// The ConfigMap `devicePlugin.config.name` names.
    pub sharing_config: Option<ConfigMap>,
    /// The ConfigMap `migManager.config.name` names.
    pub mig_config: Option<ConfigMap>,
    /// The ConfigMap `dcgmExporter.config.name` names.
    pub dcgm_metrics: Option<ConfigMap>,
    /// Any ConfigMaps; each is used for whichever field of the policy names it (others are
    /// ignored), so one set of files serves every policy.
    pub config_maps: Vec<ConfigMap>,
    /// The cluster's nodes, for what depends on the GPU nodes' labels (precompiled driver
    /// pools by kernel, DaemonSets per OS); none: no GPU node is known.
    pub nodes: Vec<Node>,
    /// OpenShift's `openshift/driver-toolkit` ImageStream, as the API serves it (its tags are
    /// the Driver Toolkit images by RHCOS version); none: absent.
    pub driver_toolkit: Option<serde_json::Value>,
}

/// Why the inputs do not make a set of facts.
#[derive(Debug, Error)]
pub enum InputError {
    /// A ConfigMap given for a role the policy names differently.
    #[error(
        "{flag} holds ConfigMap {given}, but {field} is {named}; pass the ConfigMap the policy names"
    )]
    NotNamed {
        flag: &'static str,
        given: String,
        field: &'static str,
        named: String,
    },
    /// The sharing config would not be mounted by the operator either.
    #[error("sharing config ConfigMap {name} is invalid: {problems}")]
    InvalidSharingConfig { name: String, problems: String },
    /// `--openshift` with another runtime than CRI-O.
    #[error("OpenShift always runs CRI-O; drop --runtime or pass --runtime cri-o")]
    OpenShiftRuntime,
}

impl InputError {
    /// Stable short reason.
    pub const fn reason(&self) -> &'static str {
        match self {
            InputError::NotNamed { .. } => "ConfigMapNotNamed",
            InputError::InvalidSharingConfig { .. } => "InvalidSharingConfig",
            InputError::OpenShiftRuntime => "OpenShiftRuntime",
        }
    }
}

fn name_of(cm: &ConfigMap) -> String {
    cm.metadata.name.clone().unwrap_or_default()
}

/// Picks the ConfigMap the policy names at `field` from an explicit flag or from the pool.
fn pick<'a>(
    named: Option<&str>,
    explicit: Option<&'a ConfigMap>,
    pool: &'a [ConfigMap],
    flag: &'static str,
    field: &'static str,
) -> Result<Option<&'a ConfigMap>, InputError> {
    let Some(named) = named.filter(|n| !n.is_empty()) else {
        return Ok(None);
    };
    if let Some(cm) = explicit {
        if name_of(cm) != named {
            return Err(InputError::NotNamed {
                flag,
                given: name_of(cm),
                field,
                named: named.to_owned(),
            });
        }
        return Ok(Some(cm));
    }
    Ok(pool.iter().find(|cm| name_of(cm) == named))
}

/// The facts for rendering `policy` with these options.
pub fn facts_for(
    policy: &ClusterPolicy,
    options: &RenderOptions,
) -> Result<ClusterFacts, InputError> {
    let spec = &policy.spec;
    let runtime = match (options.openshift, options.runtime) {
        (true, None | Some(Runtime::CriO)) => Runtime::CriO,
        (true, Some(_)) => return Err(InputError::OpenShiftRuntime),
        (false, runtime) => runtime.unwrap_or(Runtime::Containerd),
    };
    let gpu_nodes = facts::gpu_nodes(
        &options
            .nodes
            .iter()
            .map(|node| {
                Arc::new(NodeView::from_labels(
                    node.metadata.name.as_deref().unwrap_or_default(),
                    None,
                    node.metadata.labels.as_ref().unwrap_or(&BTreeMap::new()),
                ))
            })
            .collect::<Vec<_>>(),
    );
    // Each GPU node's runtime flavour, where its Node YAML carries status.nodeInfo.
    let node_runtimes: facts::NodeRuntimes = options
        .nodes
        .iter()
        .filter(|node| node.status.as_ref().is_some_and(|s| s.node_info.is_some()))
        .filter_map(|node| {
            let name = node.metadata.name.as_deref()?;
            gpu_nodes.iter().any(|g| g.name == name).then(|| {
                (
                    name.to_owned(),
                    facts::detect(&NodeRuntimeInfo::of_node(node)),
                )
            })
        })
        .collect();
    // Without --runtime the nodes' own runtimes decide, as the operator decides.
    let runtime = match options.runtime {
        None if !options.openshift && !node_runtimes.is_empty() => facts::cluster_runtime(
            false,
            node_runtimes
                .values()
                .filter_map(|r| r.flavour())
                .map(facts::RuntimeFlavour::runtime),
        ),
        _ => runtime,
    };
    let pool = &options.config_maps;
    let plugin_config = spec.device_plugin.as_ref().and_then(|d| d.config.as_ref());
    let sharing_cm = pick(
        plugin_config.and_then(|c| c.name.as_deref()),
        options.sharing_config.as_ref(),
        pool,
        "--sharing-config",
        "spec.devicePlugin.config.name",
    )?;
    if let Some(cm) = sharing_cm {
        // The operator would keep the nodes on their last good config; here there is none, so
        // an invalid one is refused outright.
        let data = cm.data.clone().unwrap_or_default();
        let default = plugin_config.and_then(|c| c.default.as_deref());
        let strategy = spec
            .mig
            .as_ref()
            .and_then(|m| m.strategy)
            .map(crate::operands::common::mig_strategy_name);
        if let SharingDecision::Invalid { problems, .. } =
            select_config(&name_of(cm), &data, default, &BTreeMap::new(), strategy)
        {
            return Err(InputError::InvalidSharingConfig {
                name: name_of(cm),
                problems: problems
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        }
    }
    let mig_cm = pick(
        spec.mig_manager
            .as_ref()
            .and_then(mig_manager::custom_config_name),
        options.mig_config.as_ref(),
        pool,
        "--mig-config",
        "spec.migManager.config.name",
    )?;
    let dcgm_cm = pick(
        spec.dcgm_exporter
            .as_ref()
            .and_then(|d| d.config.as_ref())
            .and_then(|c| c.name.as_deref()),
        options.dcgm_metrics.as_ref(),
        pool,
        "--dcgm-metrics",
        "spec.dcgmExporter.config.name",
    )?;
    let objects = Given {
        picked: [sharing_cm, mig_cm, dcgm_cm]
            .into_iter()
            .flatten()
            .collect(),
        pool,
    };
    let mut facts = facts::assemble(
        spec,
        &objects,
        Observed {
            namespace: options.namespace.clone(),
            owner: None,
            runtime,
            openshift: options.openshift,
            // Read from the live ClusterVersion only: a render has no cluster, so the driver
            // renders without OPENSHIFT_VERSION.
            openshift_version: None,
            service_monitor_api: options.service_monitor_api,
            // The chart's and the bundle's default (operator.metrics.secure).
            operator_metrics_https: true,
            foreign_operator_service_monitor: false,
            nfd_running: options.nfd_running.then(|| "--nfd-running".to_owned()),
            nfd_frozen: None,
            gpu_nodes,
            node_runtimes,
            image_env: BTreeMap::new(),
            driver_toolkit: options
                .driver_toolkit
                .as_ref()
                .map(facts::driver_toolkit_tags),
            driver_toolkit_broken: options
                .driver_toolkit
                .as_ref()
                .is_some_and(facts::driver_toolkit_broken),
        },
    );
    // The flag stands in for the GPU nodes' OS (the primary one, with --nodes).
    facts.os_tag = options.os_tag.clone().filter(|t| !t.is_empty());
    Ok(facts)
}

/// The ConfigMaps given on the command line, as the namespace's objects (no DaemonSets live).
struct Given<'a> {
    picked: Vec<&'a ConfigMap>,
    pool: &'a [ConfigMap],
}

impl NamespaceObjects for Given<'_> {
    fn config_map(&self, name: &str) -> Option<Arc<ConfigMap>> {
        self.picked
            .iter()
            .copied()
            .chain(self.pool)
            .find(|cm| name_of(cm) == name)
            .map(|cm| Arc::new(cm.clone()))
    }

    fn daemon_set(&self, _: &str) -> Option<Arc<DaemonSet>> {
        None
    }

    // Offline rendering has no cluster: nothing runs.
    fn daemon_sets_labelled(&self, _: &str, _: &str) -> Vec<Arc<DaemonSet>> {
        Vec::new()
    }
}

/// Validates and renders `policy` with these facts, as multi-document YAML. A sharing config
/// the policy names but the facts lack is noted in a leading comment: the device plugin is then
/// rendered without config-manager, as the operator does until a valid config exists.
pub fn render_yaml(
    policy: &ClusterPolicy,
    facts: &ClusterFacts,
) -> Result<String, serde_yaml_ng::Error> {
    let validated = validate(policy, facts);
    let mut out = String::new();
    let named = policy
        .spec
        .device_plugin
        .as_ref()
        .and_then(|d| d.config.as_ref())
        .and_then(|c| c.name.as_deref())
        .filter(|n| !n.is_empty());
    if let (Some(name), None) = (named, facts.sharing_source.as_ref()) {
        out.push_str(&format!(
            "# device-plugin: ConfigMap {name} (spec.devicePlugin.config.name) was not given \
             (--sharing-config or --config-map); rendered without config-manager\n"
        ));
    }
    out.push_str(&render(&validated, facts).to_yaml()?);
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn config_map(name: &str, data: &[(&str, &str)]) -> ConfigMap {
        ConfigMap {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(name.to_owned()),
                ..Default::default()
            },
            data: Some(
                data.iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..Default::default()
        }
    }

    fn policy(spec: &str) -> ClusterPolicy {
        ClusterPolicy::new("p", serde_yaml_ng::from_str(spec).unwrap())
    }

    const TS: &str = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n";

    #[test]
    fn config_maps_from_the_pool_fill_the_facts_for_the_fields_that_name_them() {
        let p = policy(
            "{devicePlugin: {config: {name: sharing}}, migManager: {config: {name: layouts}}, \
             driver: {kernelModuleConfig: {name: params}}}",
        );
        let options = RenderOptions {
            config_maps: vec![
                config_map("sharing", &[("only", TS)]),
                config_map("layouts", &[("config.yaml", "version: v1\n")]),
                config_map("params", &[("nvidia.conf", "")]),
                config_map("unrelated", &[]),
            ],
            ..RenderOptions::default()
        };
        let facts = facts_for(&p, &options).unwrap();
        let sharing = validate(&p, &facts).sharing.unwrap();
        assert_eq!(sharing.default_key, "only");
        assert!(sharing.default_inferred);
        assert_eq!(facts.mig_config.unwrap().name, "layouts");
        assert!(facts.driver_config_maps.contains_key("params"));
        assert!(facts.dcgm_metrics.is_none());
        assert_eq!(facts.runtime, Runtime::Containerd);
        assert!(facts.owner.is_none());
    }

    #[test]
    fn explicit_config_map_must_be_the_one_the_policy_names() {
        let p = policy("{devicePlugin: {config: {name: sharing}}}");
        let options = RenderOptions {
            sharing_config: Some(config_map("other", &[("a", TS)])),
            ..RenderOptions::default()
        };
        let err = facts_for(&p, &options).unwrap_err();
        assert_eq!(err.reason(), "ConfigMapNotNamed");
        assert!(
            err.to_string()
                .contains("spec.devicePlugin.config.name is sharing")
        );
    }

    #[test]
    fn an_invalid_sharing_config_is_refused_with_the_plugins_reason() {
        let p = policy("{devicePlugin: {config: {name: sharing}}}");
        let bad = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 1\n";
        let options = RenderOptions {
            sharing_config: Some(config_map("sharing", &[("a", bad)])),
            ..RenderOptions::default()
        };
        let err = facts_for(&p, &options).unwrap_err();
        assert_eq!(err.reason(), "InvalidSharingConfig");
    }

    #[test]
    fn openshift_means_crio() {
        let p = policy("{}");
        let on = |runtime| RenderOptions {
            openshift: true,
            runtime,
            ..RenderOptions::default()
        };
        assert_eq!(facts_for(&p, &on(None)).unwrap().runtime, Runtime::CriO);
        assert_eq!(
            facts_for(&p, &on(Some(Runtime::CriO))).unwrap().runtime,
            Runtime::CriO
        );
        assert_eq!(
            facts_for(&p, &on(Some(Runtime::Docker)))
                .unwrap_err()
                .reason(),
            "OpenShiftRuntime"
        );
    }
}
