//! Resolve stage, the pure half: [`ClusterFacts`] from what was read of the cluster. The operator
//! reads from its caches, the chaos checker from listings of the API server; both go through
//! [`assemble`], so the checker cannot drift from the operator it checks.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use super::{ClusterFacts, ConfigMapData, LastGood, LiveDriver, Runtime, SharingConfig};
use kube_core::Resource;

use crate::api::{ClusterPolicy, ClusterPolicySpec, SandboxWorkload};
use crate::model::{OPERAND_LABEL, Operand};
use crate::nodes::{NFD_ANNOTATION_PREFIX, NodeView};
use crate::operands::{
    device_plugin, driver, driver_os, driver_toolkit, mig_manager, toolkit, toolkit_flavour,
    vgpu_device_manager, vgpu_manager,
};
use crate::workload::Sandbox;

/// The objects of the operator namespace that facts are read from, by name.
pub trait NamespaceObjects {
    fn config_map(&self, name: &str) -> Option<Arc<ConfigMap>>;
    fn daemon_set(&self, name: &str) -> Option<Arc<DaemonSet>>;
    /// The operator namespace's DaemonSets that carry label `key` with `value`.
    fn daemon_sets_labelled(&self, key: &str, value: &str) -> Vec<Arc<DaemonSet>>;
}

/// What was observed about the cluster as a whole, besides the namespace's objects.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    pub namespace: String,
    pub owner: Option<OwnerReference>,
    pub runtime: Runtime,
    /// See [`ClusterFacts::node_runtimes`].
    pub node_runtimes: super::NodeRuntimes,
    pub openshift: bool,
    /// See [`ClusterFacts::openshift_version`].
    pub openshift_version: Option<String>,
    pub service_monitor_api: bool,
    /// See [`ClusterFacts::operator_metrics_https`].
    pub operator_metrics_https: bool,
    /// See [`ClusterFacts::foreign_operator_service_monitor`].
    pub foreign_operator_service_monitor: bool,
    /// Why NFD already runs, if it does ([`nfd_already_running`]).
    pub nfd_running: Option<String>,
    /// Why our deployed NFD is frozen, if it is ([`nfd_beside_ours`]).
    pub nfd_frozen: Option<String>,
    /// The GPU nodes, as [`gpu_nodes`] picks them.
    pub gpu_nodes: Vec<Arc<NodeView>>,
    pub image_env: BTreeMap<String, String>,
    /// See [`ClusterFacts::driver_toolkit`].
    pub driver_toolkit: Option<BTreeMap<String, String>>,
    /// See [`ClusterFacts::driver_toolkit_broken`].
    pub driver_toolkit_broken: bool,
}

/// The facts validate and render need, from the policy's references and what was observed.
pub fn assemble(
    spec: &ClusterPolicySpec,
    objects: &impl NamespaceObjects,
    observed: Observed,
) -> ClusterFacts {
    let present = |name: Option<&str>| -> Option<ConfigMapData> {
        let name = name.filter(|n| !n.is_empty())?;
        let cm = objects.config_map(name)?;
        Some(ConfigMapData {
            name: name.to_owned(),
            data: cm.data.clone().unwrap_or_default(),
        })
    };
    let sharing_source = present(sharing_config_name(spec));
    let mig_config = present(mig_config_name(spec));
    let dcgm_metrics = present(dcgm_metrics_name(spec));
    let vgpu_config = present(vgpu_device_manager::custom_config_name(spec));
    // ConfigMaps the host drivers mount key by key; validate reports a named but missing one.
    let driver_config_maps = host_driver_config_maps(spec)
        .filter_map(|name| Some((name.to_owned(), present(Some(name))?)))
        .collect();
    // The OS the live driver DaemonSet runs stays the primary one (driver_os).
    // The policy's own driver DaemonSets (NVIDIADriver pools' are theirs, each pool judging
    // its own switches).
    let own_driver = objects.daemon_sets_labelled(OPERAND_LABEL, Operand::Driver.name());
    let live_os = objects
        .daemon_set(driver::NAME)
        .and_then(|ds| live_driver_os(&ds));
    ClusterFacts {
        namespace: observed.namespace,
        owner: observed.owner,
        runtime: observed.runtime,
        node_runtimes: observed
            .node_runtimes
            .into_iter()
            .map(|(node, runtime)| (node, super::on_cluster(runtime, observed.openshift)))
            .collect(),
        live_toolkit_flavour: objects
            .daemon_set(toolkit::NAME)
            .as_deref()
            .and_then(toolkit_flavour::live_flavour),
        os_tag: driver_os_tag(spec, &observed.gpu_nodes, live_os.as_deref()),
        openshift: observed.openshift,
        openshift_version: observed.openshift_version,
        service_monitor_api: observed.service_monitor_api,
        live_driver: LiveDriver {
            daemon_sets: own_driver.clone(),
        },
        operator_metrics_https: observed.operator_metrics_https,
        foreign_operator_service_monitor: observed.foreign_operator_service_monitor,
        nfd_running: observed.nfd_running.is_some(),
        nfd_frozen: observed.nfd_frozen,
        sharing_source,
        sharing_last_good: last_good(objects),
        mig_config,
        dcgm_metrics,
        vgpu_config,
        vgpu_live_config: vgpu_device_manager::live_config(
            objects.daemon_set(vgpu_device_manager::NAME).as_deref(),
            |name| objects.config_map(name),
        ),
        vgpu_manager_live_os: objects
            .daemon_set(vgpu_manager::NAME)
            .as_deref()
            .and_then(vgpu_manager::live_os),
        driver_config_maps,
        gpu_nodes: observed.gpu_nodes,
        image_env: observed.image_env,
        driver_toolkit: observed.driver_toolkit,
        driver_toolkit_broken: observed.driver_toolkit_broken,
        live_driver_toolkit: live_driver_toolkit(&own_driver),
    }
}

fn label_is(ds: &DaemonSet, key: &str, value: &str) -> bool {
    ds.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(key))
        .is_some_and(|v| v == value)
}

/// The toolkit image of each Driver Toolkit DaemonSet among `daemon_sets` (one owner's), by its
/// RHCOS version label.
pub fn live_driver_toolkit(daemon_sets: &[Arc<DaemonSet>]) -> BTreeMap<String, String> {
    daemon_sets
        .iter()
        .filter(|ds| label_is(ds, driver_toolkit::IDENTIFICATION_LABEL, "true"))
        .filter_map(|ds| {
            let version = ds
                .metadata
                .labels
                .as_ref()?
                .get(driver_toolkit::VERSION_LABEL)?;
            let pod = ds.spec.as_ref()?.template.spec.as_ref()?;
            let image = pod
                .containers
                .iter()
                .find(|c| c.name == driver_toolkit::CONTAINER)?
                .image
                .clone()?;
            Some((version.clone(), image))
        })
        .collect()
}

/// The OS the driver image is tagged with ([`ClusterFacts::os_tag`]): the primary OS of the
/// GPU nodes that run containers, as nodes given to virtual machines run no driver; of any GPU
/// node when none runs containers (the tag then names what the fleet runs).
fn driver_os_tag(
    spec: &ClusterPolicySpec,
    gpu_nodes: &[Arc<NodeView>],
    live_tag: Option<&str>,
) -> Option<String> {
    let containers: Vec<Arc<NodeView>> = Sandbox::of(spec)
        .nodes_running(gpu_nodes, SandboxWorkload::Container)
        .cloned()
        .collect();
    driver_os::primary_os(&containers, live_tag)
        .or_else(|| driver_os::primary_os(gpu_nodes, live_tag))
}

/// Every ConfigMap of the operator namespace whose data [`assemble`] reads for `spec`, besides
/// the operator's own (the sharing config copy): the ones its users name. The operator keeps
/// only these, and its own, with their data (operator/src/controller/config_maps.rs).
pub fn config_map_names(spec: &ClusterPolicySpec) -> Vec<&str> {
    let mut names: Vec<&str> = [
        sharing_config_name(spec),
        mig_config_name(spec),
        dcgm_metrics_name(spec),
        vgpu_device_manager::custom_config_name(spec),
    ]
    .into_iter()
    .flatten()
    .collect();
    names.extend(host_driver_config_maps(spec));
    names.retain(|n| !n.is_empty());
    names
}

/// The ConfigMaps the driver and the vGPU manager mount key by key, by name.
fn host_driver_config_maps(spec: &ClusterPolicySpec) -> impl Iterator<Item = &str> {
    spec.driver
        .iter()
        .flat_map(|d| {
            driver::referenced_config_maps(d)
                .into_iter()
                .map(|(_, n)| n)
        })
        .chain(vgpu_manager::kernel_module_config_name(spec))
}

fn sharing_config_name(spec: &ClusterPolicySpec) -> Option<&str> {
    spec.device_plugin
        .as_ref()
        .and_then(|d| d.config.as_ref())
        .and_then(|c| c.name.as_deref())
}

/// The schema defaults the name to the operator's own ConfigMap, which render creates; this is
/// a user's only when it differs.
fn mig_config_name(spec: &ClusterPolicySpec) -> Option<&str> {
    spec.mig_manager
        .as_ref()
        .and_then(mig_manager::custom_config_name)
}

fn dcgm_metrics_name(spec: &ClusterPolicySpec) -> Option<&str> {
    spec.dcgm_exporter
        .as_ref()
        .and_then(|d| d.config.as_ref())
        .and_then(|c| c.name.as_deref())
}

/// The GPU nodes: NFD's GPU label or our `nvidia.com/gpu.present`.
pub fn gpu_nodes(nodes: &[Arc<NodeView>]) -> Vec<Arc<NodeView>> {
    nodes
        .iter()
        .filter(|n| n.is_gpu_node() || n.has_nfd_gpu())
        .cloned()
        .collect()
}

/// The OS suffix of the image the live driver DaemonSet's main container runs.
fn live_driver_os(ds: &DaemonSet) -> Option<String> {
    let pod = ds.spec.as_ref()?.template.spec.as_ref()?;
    let main = pod
        .containers
        .iter()
        .find(|c| c.name == driver::MAIN_CONTAINER)?;
    driver_os::image_os_suffix(main.image.as_deref()?).map(str::to_owned)
}

/// The sharing config the live device plugin mounts (decision 4's "last good").
fn last_good(objects: &impl NamespaceObjects) -> LastGood {
    let Some((copy, default_key)) = objects
        .daemon_set(device_plugin::NAME)
        .as_deref()
        .and_then(device_plugin::mounted_copy)
    else {
        return LastGood::Nothing;
    };
    match objects.config_map(&copy) {
        Some(cm) => LastGood::Copy(SharingConfig {
            source: cm
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(device_plugin::CONFIG_SOURCE_ANNOTATION))
                .cloned()
                .unwrap_or_else(|| copy.clone()),
            data: cm.data.clone().unwrap_or_default(),
            default_key,
            default_inferred: false,
        }),
        None => LastGood::Gone(copy),
    }
}

/// Why NFD counts as already running, so that ours is not deployed, if it does: a trusted
/// foreign master workload (its ServiceAccount may patch nodes), or nodes that an NFD master
/// annotated, while ours is not deployed (decision 16). Once ours is deployed no signal counts
/// here: not deploying it would prune it ([`nfd_beside_ours`] freezes it instead).
pub fn nfd_already_running(
    foreign: Option<&str>,
    nodes: &[Arc<NodeView>],
    ours_deployed: bool,
) -> Option<String> {
    if ours_deployed {
        return None;
    }
    if let Some(workload) = foreign {
        return Some(format!("its master runs as {workload}"));
    }
    let annotated = nodes.iter().filter(|n| n.nfd_annotated).count();
    (annotated > 0).then(|| {
        format!("{annotated} nodes carry {NFD_ANNOTATION_PREFIX}* annotations from an NFD master that is not ours")
    })
}

/// Why our deployed NFD is frozen (kept as it is, neither updated nor pruned), if it is: a
/// trusted foreign master runs beside it, and two masters would fight over the nodes' labels.
pub fn nfd_beside_ours(foreign: Option<&str>, ours_deployed: bool) -> Option<String> {
    let workload = foreign.filter(|_| ours_deployed)?;
    Some(format!(
        "another NFD master runs as {workload} beside the one this operator deployed; ours is \
         kept as it is (neither updated nor removed): remove the other NFD, or set \
         spec.nfd.enabled=false to leave node feature discovery to it"
    ))
}

/// One runtime for the cluster: CRI-O on OpenShift; elsewhere containerd if any GPU node runs
/// it, else the first GPU node's, else containerd.
pub fn cluster_runtime(
    openshift: bool,
    gpu_node_runtimes: impl IntoIterator<Item = Runtime>,
) -> Runtime {
    if openshift {
        return Runtime::CriO;
    }
    let mut first = None;
    for runtime in gpu_node_runtimes {
        if runtime == Runtime::Containerd {
            return Runtime::Containerd;
        }
        first.get_or_insert(runtime);
    }
    first.unwrap_or_default()
}

/// Controller owner reference to the policy, so deleting it garbage-collects every operand.
pub fn owner_reference(policy: &ClusterPolicy) -> Option<OwnerReference> {
    let mut reference = policy.controller_owner_ref(&())?;
    reference.block_owner_deletion = Some(true);
    Some(reference)
}

/// A node's runtime from its `containerRuntimeVersion` (`containerd://2.1.0`).
pub fn parse_runtime(version: &str) -> Runtime {
    match version.split("://").next() {
        Some("cri-o") => Runtime::CriO,
        Some("docker") => Runtime::Docker,
        _ => Runtime::Containerd,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;
    use crate::model::Operand;
    use crate::operands::test_support::{SHARED, TS4, daemon_set, sharing};

    #[derive(Default)]
    struct Listed {
        config_maps: BTreeMap<String, Arc<ConfigMap>>,
        daemon_sets: BTreeMap<String, Arc<DaemonSet>>,
    }

    impl NamespaceObjects for Listed {
        fn config_map(&self, name: &str) -> Option<Arc<ConfigMap>> {
            self.config_maps.get(name).cloned()
        }
        fn daemon_set(&self, name: &str) -> Option<Arc<DaemonSet>> {
            self.daemon_sets.get(name).cloned()
        }
        fn daemon_sets_labelled(&self, key: &str, value: &str) -> Vec<Arc<DaemonSet>> {
            self.daemon_sets
                .values()
                .filter(|ds| {
                    ds.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(key))
                        .map(String::as_str)
                        == Some(value)
                })
                .cloned()
                .collect()
        }
    }

    fn config_map(name: &str, data: &[(&str, &str)]) -> Arc<ConfigMap> {
        Arc::new(ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            data: Some(
                data.iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..ConfigMap::default()
        })
    }

    fn spec(yaml: &str) -> ClusterPolicySpec {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn only_referenced_config_maps_that_exist_are_read() {
        let mut listed = Listed::default();
        listed
            .config_maps
            .insert("ts".into(), config_map("ts", &[("any", TS4)]));
        listed
            .config_maps
            .insert("repos".into(), config_map("repos", &[("a.repo", "x")]));
        let spec = spec(
            "devicePlugin: {config: {name: ts}}\n\
             dcgmExporter: {config: {name: missing}}\n\
             driver: {repoConfig: {configMapName: repos}, certConfig: {name: certs}}\n",
        );
        let facts = assemble(&spec, &listed, Observed::default());
        assert_eq!(facts.sharing_source.unwrap().data["any"], TS4);
        assert!(facts.dcgm_metrics.is_none());
        assert_eq!(
            facts.driver_config_maps.keys().collect::<Vec<_>>(),
            ["repos"]
        );
    }

    /// Records every ConfigMap name asked for.
    #[derive(Default)]
    struct Recording(std::sync::Mutex<Vec<String>>);

    impl NamespaceObjects for Recording {
        fn config_map(&self, name: &str) -> Option<Arc<ConfigMap>> {
            self.0.lock().unwrap().push(name.to_owned());
            None
        }
        fn daemon_set(&self, _: &str) -> Option<Arc<DaemonSet>> {
            None
        }
        fn daemon_sets_labelled(&self, _: &str, _: &str) -> Vec<Arc<DaemonSet>> {
            Vec::new()
        }
    }

    #[test]
    fn config_map_names_lists_every_config_map_assemble_reads() {
        // The operator fetches only these names' data: one assemble reads but this list lacks
        // would be missing from the facts.
        let spec = spec(
            "devicePlugin: {config: {name: ts}}\n\
             migManager: {config: {name: my-mig}}\n\
             dcgmExporter: {config: {name: metrics}}\n\
             vgpuDeviceManager: {config: {name: my-vgpu}}\n\
             vgpuManager: {kernelModuleConfig: {name: vgpu-modules}}\n\
             driver: {repoConfig: {configMapName: repos}, certConfig: {name: certs},\n\
                      kernelModuleConfig: {name: modules}}\n",
        );
        let recording = Recording::default();
        assemble(&spec, &recording, Observed::default());
        let mut read = recording.0.into_inner().unwrap();
        read.sort();
        let mut listed = config_map_names(&spec);
        listed.sort_unstable();
        assert_eq!(read, listed);
        assert_eq!(read.len(), 8, "{read:?}");
    }

    #[test]
    fn the_driver_os_is_the_container_nodes_not_the_vm_nodes() {
        let node = |name: &str, id: &str, version: &str, workload: Option<&str>| {
            let mut labels = BTreeMap::from([
                (
                    crate::nodes::NFD_GPU_LABELS[0].to_owned(),
                    "true".to_owned(),
                ),
                (crate::nodes::OS_ID.to_owned(), id.to_owned()),
                (crate::nodes::OS_VERSION_ID.to_owned(), version.to_owned()),
            ]);
            if let Some(workload) = workload {
                labels.insert(
                    crate::workload::WORKLOAD_CONFIG.to_owned(),
                    workload.to_owned(),
                );
            }
            Arc::new(NodeView::from_labels(name, None, &labels))
        };
        // The VM node sorts first by name.
        let gpu_nodes = vec![
            node("a100", "rhel", "9.4", Some("vm-passthrough")),
            node("t4", "ubuntu", "22.04", None),
        ];
        let os = |spec: &ClusterPolicySpec, nodes: &[Arc<NodeView>]| {
            let observed = Observed {
                gpu_nodes: nodes.to_vec(),
                ..Observed::default()
            };
            assemble(spec, &Listed::default(), observed).os_tag
        };
        let sandbox = spec("sandboxWorkloads: {enabled: true}\n");
        assert_eq!(os(&sandbox, &gpu_nodes).as_deref(), Some("ubuntu22.04"));
        // Without sandbox workloads every GPU node runs containers.
        assert_eq!(os(&spec("{}"), &gpu_nodes).as_deref(), Some("rhel9"));
        // A fleet of VM nodes only still names its OS.
        assert_eq!(os(&sandbox, &gpu_nodes[..1]).as_deref(), Some("rhel9"));
    }

    #[test]
    fn the_last_good_sharing_config_is_what_the_live_plugin_mounts() {
        let plugin = daemon_set(SHARED, &sharing(&[("default", TS4)]), Operand::DevicePlugin);
        let (copy, default_key) = device_plugin::mounted_copy(&plugin).unwrap();
        let mut listed = Listed::default();
        listed
            .daemon_sets
            .insert(device_plugin::NAME.into(), Arc::new(plugin));
        let spec = spec(SHARED);
        assert_eq!(
            assemble(&spec, &listed, Observed::default()).sharing_last_good,
            LastGood::Gone(copy.clone())
        );
        listed
            .config_maps
            .insert(copy.clone(), config_map(&copy, &[("default", TS4)]));
        let LastGood::Copy(last) = assemble(&spec, &listed, Observed::default()).sharing_last_good
        else {
            panic!("no copy read back");
        };
        assert_eq!(
            (last.default_key, last.data["default"].as_str()),
            (default_key, TS4)
        );
    }

    #[test]
    fn containerd_wins_the_cluster_runtime_and_otherwise_the_first_node_decides() {
        use Runtime::*;
        assert_eq!(
            cluster_runtime(false, [CriO, Containerd, Docker]),
            Containerd
        );
        assert_eq!(cluster_runtime(false, [Docker, CriO]), Docker);
        assert_eq!(cluster_runtime(false, []), Containerd);
        assert_eq!(cluster_runtime(true, [Containerd]), CriO);
        assert_eq!(parse_runtime("cri-o://1.31.0"), CriO);
    }

    fn annotated_node(name: &str) -> Arc<NodeView> {
        let mut node = NodeView::from_labels(name, None, &BTreeMap::new());
        node.nfd_annotated = true;
        Arc::new(node)
    }

    #[test]
    fn a_foreign_nfd_keeps_ours_from_being_deployed_but_never_removes_it() {
        let master = Some("Deployment nfd/nfd-master");
        // Not deployed yet: a trusted foreign master or annotated nodes mean NFD runs.
        assert!(nfd_already_running(master, &[], false).is_some());
        assert!(nfd_already_running(None, &[annotated_node("a")], false).is_some());
        assert!(nfd_beside_ours(master, false).is_none());
        // Ours deployed: it stays rendered (not pruned); beside a foreign master it is frozen.
        assert!(nfd_already_running(master, &[annotated_node("a")], true).is_none());
        let frozen = nfd_beside_ours(master, true).unwrap();
        assert!(frozen.contains("Deployment nfd/nfd-master"), "{frozen}");
        assert!(frozen.contains("spec.nfd.enabled=false"), "{frozen}");
        assert!(nfd_beside_ours(None, true).is_none());
    }
}
