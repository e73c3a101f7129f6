//! OLM bundle generation (pure, apart from [`from_chart`], which runs helm, and [`read_files`]):
//! the ClusterServiceVersion, the CRD copies and the bundle metadata of `bundle/`.
//!
//! Nothing here is typed twice. The operator Deployment is the Helm chart's own
//! (`templates/operator.yaml`, rendered by `helm template` with `scripts/bundle-values.yaml`,
//! [`from_chart`]), so the operator image of the Deployment, `containerImage` and
//! `relatedImages` is the chart's; the CSV's `permissions` (the operator namespace's Role) and
//! `clusterPermissions` are `gpu-operator rbac` (decision 13), the latter less writing CRDs; the CRDs are `gpu-operator crd` and NFD's (`crds/nfd-api-crds.yaml`, owned
//! by the CSV so OLM installs them, decision 16); the `*_IMAGE` variables and `relatedImages` are
//! the images the operator pins ([`ImageKind::pinned`]), by the digests of
//! `scripts/image-digests.yaml` where known; `alm-examples` are files of `examples/`.
//! `cargo xtask check`, `xtask/tests/bundle.rs` and `tests/e2e/tests/olm.rs` fail when the
//! committed bundle differs from a fresh one.
//!
//! What OLM changes about the chart's Deployment, and why:
//! - release labels (`helm.sh/chart`, `app.kubernetes.io/managed-by`, `.../instance`) are
//!   dropped: OLM, not Helm, manages the pods;
//! - the pod's fixed `runAsUser` is dropped: OpenShift's `restricted-v2` SCC assigns a UID from
//!   the namespace's range and rejects any other (`runAsNonRoot` stays);
//! - every operand's image variable is set, so a catalog mirror can rewrite them (the
//!   `relatedImages` list names the same images);
//! - the operator must not replace its CRD at start-up (`--upgrade-crd=false`): OLM installs
//!   and upgrades it from the bundle. The values file sets that; a Deployment without it is an
//!   error here.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::Path;

use anyhow::Context;
use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{Container, EnvVar};
use k8s_openapi::api::rbac::v1::PolicyRule;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use gpu_operator::api::image::ImageKind;
use gpu_operator::api::{self, MIN_KUBERNETES_VERSION};
use gpu_operator::controller::vendored_crds;
use gpu_operator::crd_upgrade::{CRD_NAME, OPERATOR_VERSION};
use gpu_operator::render::rbac;

use crate::helm::Helm;

/// OLM package name.
pub const PACKAGE: &str = "gpu-operator";
/// The one channel, also the default (OLM's naming convention: stable, fast, candidate).
pub const CHANNEL: &str = "stable";
/// Name of the operator's Deployment, container and ServiceAccount (the chart's).
pub const OPERATOR: &str = "gpu-operator";
/// The namespace OperatorHub suggests; NVIDIA's, which OpenShift users and their tooling expect.
pub const SUGGESTED_NAMESPACE: &str = "nvidia-gpu-operator";
/// The oldest OpenShift release whose Kubernetes is [`MIN_KUBERNETES_VERSION`] (4.20 ships 1.33);
/// `v4.20` means "4.20 and later" to OpenShift's catalog tooling.
pub const OPENSHIFT_VERSIONS: &str = "v4.20";

/// Files of the bundle, relative to its folder.
pub const CSV_FILE: &str = "manifests/gpu-operator.clusterserviceversion.yaml";
pub const CRD_FILE: &str = "manifests/nvidia.com_clusterpolicies.yaml";
/// The GPUCluster CRD (docs/dra.md), owned by the CSV like the ClusterPolicy's.
pub const GPU_CLUSTER_CRD_FILE: &str = "manifests/nvidia.com_gpuclusters.yaml";
/// The NVIDIADriver CRD (docs/nvidiadriver.md), owned by the CSV like the ClusterPolicy's.
pub const NVIDIA_DRIVER_CRD_FILE: &str = "manifests/nvidia.com_nvidiadrivers.yaml";
/// NFD's CRDs, one file each (a bundle manifest holds one object), as `vendored_crds::NAMES` orders them.
pub const NFD_CRD_FILES: [&str; 3] = [
    "manifests/nfd.k8s-sigs.io_nodefeaturegroups.yaml",
    "manifests/nfd.k8s-sigs.io_nodefeaturerules.yaml",
    "manifests/nfd.k8s-sigs.io_nodefeatures.yaml",
];
/// The DRA driver's ComputeDomain CRDs, one file each, as `vendored_crds::COMPUTE_DOMAINS` orders
/// them: under OLM the bundle installs them, the operator only reads them.
pub const COMPUTE_DOMAIN_CRD_FILES: [&str; 2] = [
    "manifests/resource.nvidia.com_computedomaincliques.yaml",
    "manifests/resource.nvidia.com_computedomains.yaml",
];
pub const ANNOTATIONS_FILE: &str = "metadata/annotations.yaml";
pub const DOCKERFILE: &str = "bundle.Dockerfile";
/// The operator's metrics Service, its ServiceMonitor and alert rules, and the Role that lets
/// OpenShift's cluster monitoring (the suggested namespace opts into it) scrape them. OLM
/// creates every object of a bundle, so these need monitoring.coreos.com served: the bundle
/// targets OpenShift (`com.redhat.openshift.versions`), whose monitoring stack always serves it.
pub const METRICS_SERVICE_FILE: &str = "manifests/gpu-operator-metrics_v1_service.yaml";
pub const SERVICE_MONITOR_FILE: &str =
    "manifests/gpu-operator_monitoring.coreos.com_v1_servicemonitor.yaml";
pub const PROMETHEUS_RULE_FILE: &str =
    "manifests/gpu-operator_monitoring.coreos.com_v1_prometheusrule.yaml";
pub const PROMETHEUS_ROLE_FILE: &str =
    "manifests/prometheus-k8s_rbac.authorization.k8s.io_v1_role.yaml";
pub const PROMETHEUS_ROLE_BINDING_FILE: &str =
    "manifests/prometheus-k8s_rbac.authorization.k8s.io_v1_rolebinding.yaml";
/// The alert rules, one source with the chart's PrometheusRule.
const PROMETHEUS_RULES: &str =
    include_str!("../../charts/gpu-operator/files/prometheus-rules.yaml");
/// The Service port NVIDIA's operator gives its metrics (scrape configs select it by name).
const METRICS_PORT_NAME: &str = "gpu-operator-metrics";

/// Who publishes the bundle: the project's name as its README and chart give it. The project
/// publishes no contact address or domain (SECURITY.md sends reports to the repository's
/// private vulnerability reporting), so the CSV lists no maintainer rather than a made-up one
/// (OperatorHub's validator wants a name and an email for each listed).
const PROVIDER: &str = "GPU Operator (Rust) project";
/// The name NVIDIA's OperatorHub example gives its ClusterPolicy, which the commands users copy
/// from NVIDIA's OpenShift documentation name (`kubectl patch clusterpolicy gpu-cluster-policy`).
pub const OPERATORHUB_POLICY_NAME: &str = "gpu-cluster-policy";
const LINKS: [(&str, &str); 1] = [(
    "NVIDIA GPU Operator documentation (the API and Helm values this operator follows)",
    "https://docs.nvidia.com/datacenter/cloud-native/gpu-operator/latest/index.html",
)];

/// Every file's first line. It names the commands that made the bundle before `cargo xtask
/// generate` did; the text stays until the bundle is regenerated for a release anyway, since a
/// change here changes every file of the committed bundle.
const GENERATED: &str =
    "# Generated by `make bundle` (scripts/bundle.sh, `gpu-operator bundle`); do not edit.\n";

/// Labels that describe a Helm release; meaningless once OLM installs the Deployment.
const RELEASE_LABELS: [&str; 3] = [
    "helm.sh/chart",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
];

/// The operator's flag that must be off under OLM (see the module documentation).
const UPGRADE_CRD_OFF: &str = "--upgrade-crd=false";

/// Every image a policy can name. [`in_bundle`] matches on the kind without a wildcard, so a new
/// variant does not compile until it is listed there, next to this list.
const IMAGE_KINDS: [ImageKind; 23] = [
    ImageKind::Driver,
    ImageKind::DriverManager,
    ImageKind::Toolkit,
    ImageKind::DevicePlugin,
    ImageKind::Gfd,
    ImageKind::Dcgm,
    ImageKind::DcgmExporter,
    ImageKind::MigManager,
    ImageKind::NodeStatusExporter,
    ImageKind::Validator,
    ImageKind::InitContainer,
    ImageKind::Gds,
    ImageKind::GdrCopy,
    ImageKind::SandboxDevicePlugin,
    ImageKind::KataSandboxDevicePlugin,
    ImageKind::VgpuManager,
    ImageKind::VgpuDeviceManager,
    ImageKind::VfioManager,
    ImageKind::VfioDriverManager,
    ImageKind::VgpuDriverManager,
    ImageKind::KataManager,
    ImageKind::CcManager,
    ImageKind::Nfd,
];

/// Whether the bundle names the kind's image: every image the operator pins and may deploy.
/// The others (vGPU, Kata, confidential computing, the CUDA init container) have no pinned
/// image; a policy that enables them must name one.
const fn in_bundle(kind: ImageKind) -> bool {
    match kind {
        ImageKind::Driver
        | ImageKind::DriverManager
        | ImageKind::Toolkit
        | ImageKind::DevicePlugin
        | ImageKind::Gfd
        | ImageKind::Dcgm
        | ImageKind::DcgmExporter
        | ImageKind::MigManager
        | ImageKind::NodeStatusExporter
        | ImageKind::Validator
        | ImageKind::Gds
        | ImageKind::GdrCopy
        | ImageKind::Nfd
        | ImageKind::VfioManager
        | ImageKind::VfioDriverManager
        | ImageKind::VgpuDriverManager
        | ImageKind::SandboxDevicePlugin
        | ImageKind::VgpuDeviceManager
        | ImageKind::KataSandboxDevicePlugin
        | ImageKind::CcManager => kind.pinned().is_some(),
        ImageKind::InitContainer | ImageKind::VgpuManager | ImageKind::KataManager => false,
    }
}

/// The operator's image variables and the images they name, one per variable (the validator and
/// the node-status exporter share `VALIDATOR_IMAGE`), in [`IMAGE_KINDS`] order: each pinned
/// image by its digest where [`digest_facts`] knows one (`image:tag@sha256:...`).
pub fn image_env() -> Result<Vec<(&'static str, String)>, BundleError> {
    let facts = digest_facts()?;
    let mut out: Vec<(&'static str, String)> = Vec::new();
    for kind in IMAGE_KINDS {
        if let Some(image) = kind.pinned().filter(|_| in_bundle(kind))
            && !out.iter().any(|(var, _)| *var == kind.env_var())
        {
            out.push((kind.env_var(), pinned_by_digest(image, &facts)?));
        }
    }
    Ok(out)
}

/// The digest table, `scripts/image-digests.yaml`: facts, with where each comes from.
const DIGESTS_YAML: &str = include_str!("../../scripts/image-digests.yaml");
const DIGESTS_FILE: &str = "scripts/image-digests.yaml";

/// One row of the digest table.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DigestFact {
    /// Registry and path, without tag.
    pub image: String,
    pub tag: String,
    /// `sha256:` and 64 hex digits; `None` when no digest is known (`source` says why).
    pub digest: Option<String>,
    /// Where the digest was read, or why there is none.
    pub source: String,
}

impl DigestFact {
    /// `image:tag`, as [`ImageKind::pinned`] names it.
    pub fn tagged(&self) -> String {
        format!("{}:{}", self.image, self.tag)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DigestTable {
    images: Vec<DigestFact>,
}

fn is_sha256_digest(digest: &str) -> bool {
    digest.strip_prefix("sha256:").is_some_and(|hex| {
        hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// The rows of `scripts/image-digests.yaml`, each checked: a well-formed digest, a source, and
/// one row per image.
pub fn digest_facts() -> Result<Vec<DigestFact>, BundleError> {
    let table: DigestTable = serde_yaml_ng::from_str(DIGESTS_YAML)
        .map_err(|e| BundleError::DigestTable(e.to_string()))?;
    for (i, fact) in table.images.iter().enumerate() {
        let row = format!("images[{i}] ({})", fact.tagged());
        if let Some(digest) = fact.digest.as_deref().filter(|d| !is_sha256_digest(d)) {
            return Err(BundleError::DigestTable(format!(
                "{row}: digest {digest:?} is not sha256: and 64 lowercase hex digits"
            )));
        }
        if fact.source.trim().is_empty() {
            return Err(BundleError::DigestTable(format!(
                "{row}: source is empty; say where the digest comes from, or why none is known"
            )));
        }
        if table.images[..i]
            .iter()
            .any(|f| f.tagged() == fact.tagged())
        {
            return Err(BundleError::DigestTable(format!("{row} is listed twice")));
        }
    }
    Ok(table.images)
}

/// `image` (as pinned, `registry/path:tag`) with its digest appended when one is known.
pub fn pinned_by_digest(image: &str, facts: &[DigestFact]) -> Result<String, BundleError> {
    let fact = facts
        .iter()
        .find(|f| f.tagged() == image)
        .ok_or_else(|| BundleError::NoDigestFact(image.to_owned()))?;
    Ok(match &fact.digest {
        Some(digest) => format!("{image}@{digest}"),
        None => image.to_owned(),
    })
}

/// The examples of `examples/` offered as `alm-examples`, at least one per owned kind; the first
/// policy is the console form's default. Policies that need ConfigMaps first or set unsupported
/// sections are left out.
const ALM_EXAMPLES: [(&str, &str); 10] = [
    (
        "examples/clusterpolicy-default.yaml",
        include_str!("../../examples/clusterpolicy-default.yaml"),
    ),
    (
        "examples/clusterpolicy-minimal.yaml",
        include_str!("../../examples/clusterpolicy-minimal.yaml"),
    ),
    (
        "examples/clusterpolicy-gpu-node-pool.yaml",
        include_str!("../../examples/clusterpolicy-gpu-node-pool.yaml"),
    ),
    (
        "examples/gpucluster.yaml",
        include_str!("../../examples/gpucluster.yaml"),
    ),
    (
        "examples/nvidiadriver.yaml",
        include_str!("../../examples/nvidiadriver.yaml"),
    ),
    (
        "examples/nfd/nodefeaturerule.yaml",
        include_str!("../../examples/nfd/nodefeaturerule.yaml"),
    ),
    (
        "examples/nfd/nodefeaturegroup.yaml",
        include_str!("../../examples/nfd/nodefeaturegroup.yaml"),
    ),
    (
        "examples/nfd/nodefeature.yaml",
        include_str!("../../examples/nfd/nodefeature.yaml"),
    ),
    (
        "examples/compute-domain/computedomain.yaml",
        include_str!("../../examples/compute-domain/computedomain.yaml"),
    ),
    (
        "examples/compute-domain/computedomainclique.yaml",
        include_str!("../../examples/compute-domain/computedomainclique.yaml"),
    ),
];

/// The install modes NVIDIA's v26.7.0 CSV declares: its own namespace or one other. The
/// operator is cluster-scoped either way (one ClusterPolicy, operands in its own namespace), so
/// the OperatorGroup's target namespace changes nothing it does.
pub const INSTALL_MODES: [(&str, bool); 4] = [
    ("OwnNamespace", true),
    ("SingleNamespace", true),
    ("MultiNamespace", false),
    ("AllNamespaces", false),
];

/// `olm.skipRange`: OLM replaces any installed release older than this one with it, so each
/// release upgrades the previous ones in place without a `replaces` chain (the first release has
/// no predecessor to name).
pub fn skip_range() -> String {
    format!("<{OPERATOR_VERSION}")
}

/// The GPUCluster's description in the console.
/// The NVIDIADriver's description in the console.
const NVIDIA_DRIVER_DESCRIPTION: &str = "A driver version and type per node pool: one driver DaemonSet per OS of the GPU nodes its nodeSelector selects, upgraded node by node; used while the ClusterPolicy sets driver.useNvidiaDriverCRD.";
const GPU_CLUSTER_DESCRIPTION: &str = "NVIDIA's DRA driver instead of the device plugin: GPUs requested through ResourceClaims by attribute (product, memory, compute capability, MIG profile), and attribute DeviceClasses such as h100 or gpu-80gb.";

/// The DRA driver's compute-domain kinds as owned CRDs of the CSV (v1beta1), in
/// [`COMPUTE_DOMAIN_CRD_FILES`] order: (CRD name, kind, display name, description).
const COMPUTE_DOMAIN_OWNED: [(&str, &str, &str, &str); 2] = [
    (
        "computedomaincliques.resource.nvidia.com",
        "ComputeDomainClique",
        "ComputeDomainClique",
        "NVIDIA DRA driver: the daemons of one NVLink clique of a ComputeDomain, written by the compute-domain daemons.",
    ),
    (
        "computedomains.resource.nvidia.com",
        "ComputeDomain",
        "ComputeDomain",
        "NVIDIA DRA driver: nodes of a multi-node NVLink system joined in one IMEX domain, whose pods share its channel.",
    ),
];

/// NFD's kinds as owned CRDs of the CSV: (CRD name, kind, display name, description).
const NFD_OWNED: [(&str, &str, &str, &str); 3] = [
    (
        "nodefeaturegroups.nfd.k8s-sigs.io",
        "NodeFeatureGroup",
        "NodeFeatureGroup",
        "Node Feature Discovery (v0.19): a group of nodes matching feature rules, listed in its status by nfd-master.",
    ),
    (
        "nodefeaturerules.nfd.k8s-sigs.io",
        "NodeFeatureRule",
        "NodeFeatureRule",
        "Node Feature Discovery (v0.19): rules from which nfd-master labels nodes.",
    ),
    (
        "nodefeatures.nfd.k8s-sigs.io",
        "NodeFeature",
        "NodeFeature",
        "Node Feature Discovery (v0.19): the features nfd-worker found on one node, and labels requested for it.",
    ),
];

/// The CSV's cluster permissions: the operator's generated ClusterRole without writing CRDs.
/// Under OLM the bundle carries the ClusterPolicy CRD and NFD's, and OLM installs and upgrades
/// them, so the operator only reads CRDs (`--upgrade-crd=false` leaves its own alone; NFD's it
/// finds installed and tolerates the refusal to write them; docs/install.md).
pub fn olm_cluster_rules() -> Vec<PolicyRule> {
    rbac::operator_cluster_role()
        .rules
        .unwrap_or_default()
        .into_iter()
        .filter_map(|mut rule| {
            let on_crds = rule
                .api_groups
                .iter()
                .flatten()
                .any(|g| g == "apiextensions.k8s.io")
                && rule
                    .resources
                    .iter()
                    .flatten()
                    .any(|r| r == "customresourcedefinitions");
            if on_crds {
                rule.verbs
                    .retain(|v| !matches!(v.as_str(), "create" | "patch" | "update" | "delete"));
            }
            (!rule.verbs.is_empty()).then_some(rule)
        })
        .collect()
}

/// The icon: a GPU board with its fan, in SVG.
const ICON_SVG: &str = r##"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 64 64" width="64" height="64">
  <rect x="4" y="14" width="56" height="34" rx="4" fill="#1f2a30"/>
  <rect x="8" y="48" width="30" height="6" fill="#c9a227"/>
  <g fill="#c9a227"><rect x="11" y="48" width="2" height="6" fill="#1f2a30"/><rect x="17" y="48" width="2" height="6" fill="#1f2a30"/><rect x="23" y="48" width="2" height="6" fill="#1f2a30"/><rect x="29" y="48" width="2" height="6" fill="#1f2a30"/></g>
  <circle cx="23" cy="31" r="11" fill="#76b900"/>
  <circle cx="23" cy="31" r="3" fill="#1f2a30"/>
  <path d="M23 20a11 11 0 0 1 9 5l-9 6zM34 35a11 11 0 0 1-7 7l-4-11zM14 39a11 11 0 0 1-2-9l11 1z" fill="#1f2a30" opacity="0.6"/>
  <rect x="40" y="22" width="14" height="18" rx="2" fill="#76b900"/>
  <rect x="44" y="26" width="6" height="10" fill="#1f2a30"/>
</svg>
"##;

/// Why no bundle could be made from the given Deployment.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error(
        "the chart's Deployment is named {0:?}, not {OPERATOR:?}: render templates/operator.yaml of charts/gpu-operator"
    )]
    DeploymentName(String),
    #[error("the chart's Deployment has no spec.template.spec: render templates/operator.yaml")]
    NoPodSpec,
    #[error(
        "the chart's Deployment has no container {OPERATOR:?} in spec.template.spec.containers: render templates/operator.yaml"
    )]
    NoContainer,
    #[error(
        "spec.template.spec.serviceAccountName of the chart's Deployment is {0:?}, but the CSV grants `gpu-operator rbac` to ServiceAccount {OPERATOR:?}"
    )]
    ServiceAccount(Option<String>),
    #[error(
        "the operator container has no image: set operator.repository/image/version in scripts/bundle-values.yaml"
    )]
    NoImage,
    #[error(
        "the operator container's args lack {UPGRADE_CRD_OFF}: OLM installs and upgrades the CRD from the bundle, so render the chart with operator.upgradeCRD=false (scripts/bundle-values.yaml)"
    )]
    UpgradeCrd,
    #[error("{DIGESTS_FILE}: {0}")]
    DigestTable(String),
    #[error(
        "the operator pins {0}, which has no row in {DIGESTS_FILE}: add one with its digest, or digest: null and why none is known"
    )]
    NoDigestFact(String),
    #[error("vendored CRDs: {0}")]
    VendoredCrds(String),
}

/// One file of the bundle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BundleFile {
    /// Path relative to the bundle folder.
    pub path: &'static str,
    pub content: String,
}

/// The chart, relative to the repository root.
pub const CHART: &str = "charts/gpu-operator";
/// The values the chart's Deployment is rendered with for the bundle (the operator image's
/// registry, `--upgrade-crd=false`), relative to the repository root.
pub const VALUES_FILE: &str = "scripts/bundle-values.yaml";

/// The chart's operator Deployment, rendered by `helm template` with [`VALUES_FILE`]: offline,
/// as users render the chart (no cluster, Helm's default capabilities).
pub fn chart_deployment(root: &Path, helm: &Helm) -> anyhow::Result<Deployment> {
    // Release name and namespace as the chart's docs install it; neither reaches the bundle
    // ([`olm_deployment`] drops the namespace and the release labels).
    let yaml = helm.template([
        OsStr::new("gpu-operator"),
        root.join(CHART).as_os_str(),
        OsStr::new("--namespace"),
        OsStr::new("gpu-operator"),
        OsStr::new("-f"),
        root.join(VALUES_FILE).as_os_str(),
        OsStr::new("--show-only"),
        OsStr::new("templates/operator.yaml"),
    ])?;
    serde_yaml_ng::from_str(&yaml).context(
        "parsing the chart's templates/operator.yaml, as helm rendered it, as a Deployment",
    )
}

/// Every file of the bundle, from the chart under `root` rendered by `helm`.
pub fn from_chart(root: &Path, helm: &Helm) -> anyhow::Result<Vec<BundleFile>> {
    files(chart_deployment(root, helm)?)
}

/// Every file of the bundle, from the chart's rendered operator Deployment.
pub fn files(chart_deployment: Deployment) -> anyhow::Result<Vec<BundleFile>> {
    let deployment = olm_deployment(chart_deployment)?;
    let csv = cluster_service_version(&deployment)?;
    let annotations = bundle_annotations();
    let mut metadata = String::from(GENERATED);
    metadata.push_str(&serde_yaml_ng::to_string(
        &json!({ "annotations": annotations }),
    )?);
    let mut dockerfile = String::from(GENERATED);
    dockerfile.push_str("FROM scratch\n");
    for (key, value) in &annotations {
        dockerfile.push_str(&format!("LABEL {key}={value}\n"));
    }
    dockerfile.push_str("COPY manifests /manifests/\nCOPY metadata /metadata/\n");
    let monitoring = monitoring_objects(&deployment)?
        .into_iter()
        .map(|(path, object)| {
            Ok(BundleFile {
                path,
                content: format!("{GENERATED}{}", serde_yaml_ng::to_string(&object)?),
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut out = vec![
        BundleFile {
            path: CSV_FILE,
            content: format!("{GENERATED}{}", serde_yaml_ng::to_string(&csv)?),
        },
        BundleFile {
            path: CRD_FILE,
            content: api::crd::crd_yaml()?,
        },
        BundleFile {
            path: GPU_CLUSTER_CRD_FILE,
            content: api::gpu_cluster_crd::crd_yaml()?,
        },
        BundleFile {
            path: NVIDIA_DRIVER_CRD_FILE,
            content: api::nvidia_driver_crd::crd_yaml()?,
        },
    ];
    for (path, crd) in NFD_CRD_FILES.into_iter().zip(nfd_definitions()?) {
        out.push(BundleFile {
            path,
            content: format!(
                "{GENERATED}# NFD v0.19.0's CRD, from crds/nfd-api-crds.yaml.\n{}",
                serde_yaml_ng::to_string(&crd)?
            ),
        });
    }
    let compute_domains = vendored_crds::COMPUTE_DOMAINS
        .definitions()
        .map_err(|e| BundleError::VendoredCrds(e.to_string()))?;
    for (path, crd) in COMPUTE_DOMAIN_CRD_FILES.into_iter().zip(compute_domains) {
        out.push(BundleFile {
            path,
            content: format!(
                "{GENERATED}# NVIDIA's DRA driver CRD, from crds/compute-domain-crds.yaml.\n{}",
                serde_yaml_ng::to_string(&crd)?
            ),
        });
    }
    out.push(BundleFile {
        path: ANNOTATIONS_FILE,
        content: metadata,
    });
    out.push(BundleFile {
        path: DOCKERFILE,
        content: dockerfile,
    });
    out.extend(monitoring);
    Ok(out)
}

/// NFD's CRDs as the operator installs them (`crds/nfd-api-crds.yaml`), in [`NFD_CRD_FILES`]
/// order; OLM installs them from the bundle as CRDs the CSV owns (decision 16).
fn nfd_definitions()
-> Result<Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>, BundleError>
{
    let crds =
        vendored_crds::definitions().map_err(|e| BundleError::VendoredCrds(e.to_string()))?;
    let names: Vec<String> = crds
        .iter()
        .map(|c| c.metadata.name.clone().unwrap_or_default())
        .collect();
    if names != vendored_crds::NAMES {
        return Err(BundleError::VendoredCrds(format!(
            "crds/nfd-api-crds.yaml holds {names:?}, not {:?}",
            vendored_crds::NAMES
        )));
    }
    Ok(crds)
}

/// The monitoring objects of the bundle (see [`METRICS_SERVICE_FILE`]) for the operator
/// Deployment: the Service selects its pods by their `app` label and targets its `metrics`
/// port, as the chart's templates/metrics.yaml does.
fn monitoring_objects(deployment: &Deployment) -> anyhow::Result<Vec<(&'static str, Value)>> {
    let spec = deployment.spec.as_ref();
    let app = spec
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.labels.as_ref())
        .and_then(|l| l.get("app"))
        .context(
            "the operator Deployment's pods carry no `app` label for the metrics Service to select",
        )?;
    let port = spec
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.containers.iter().find(|c| c.name == OPERATOR))
        .and_then(|c| {
            c.ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some("metrics"))
        })
        .context("the operator container has no port named `metrics`")?
        .container_port;
    let labels = json!({ "app": app });
    let rules: Value = serde_yaml_ng::from_str(PROMETHEUS_RULES)
        .context("parsing the chart's files/prometheus-rules.yaml")?;
    Ok(vec![
        (
            METRICS_SERVICE_FILE,
            json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": { "name": OPERATOR, "labels": labels },
                "spec": {
                    "selector": labels,
                    "ports": [{ "name": METRICS_PORT_NAME, "port": port, "targetPort": "metrics", "protocol": "TCP" }],
                },
            }),
        ),
        (
            SERVICE_MONITOR_FILE,
            json!({
                "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
                "metadata": { "name": OPERATOR, "labels": labels },
                "spec": {
                    "jobLabel": "app",
                    "selector": { "matchLabels": labels },
                    // The operator serves /metrics over HTTPS with a self-signed certificate
                    // and admits tokens allowed `get /metrics`, which OpenShift's
                    // prometheus-k8s ClusterRole grants.
                    "endpoints": [{
                        "port": METRICS_PORT_NAME, "path": "/metrics", "interval": "30s",
                        "scheme": "https",
                        "bearerTokenFile": "/var/run/secrets/kubernetes.io/serviceaccount/token",
                        "tlsConfig": { "insecureSkipVerify": true },
                    }],
                },
            }),
        ),
        (
            PROMETHEUS_RULE_FILE,
            json!({
                "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
                "metadata": { "name": OPERATOR, "labels": labels },
                "spec": rules,
            }),
        ),
        (
            PROMETHEUS_ROLE_FILE,
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": { "name": "prometheus-k8s", "labels": labels },
                // Service discovery only: reading /metrics itself takes `get` on the
                // non-resource URL, which OpenShift's prometheus-k8s ClusterRole holds.
                "rules": [{
                    "apiGroups": [""],
                    "resources": ["services", "endpoints", "pods"],
                    "verbs": ["get", "list", "watch"],
                }, {
                    // Prometheus' EndpointSlice discovery (OpenShift 4.16 and later).
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                }],
            }),
        ),
        (
            PROMETHEUS_ROLE_BINDING_FILE,
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": { "name": "prometheus-k8s", "labels": labels },
                "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "prometheus-k8s" },
                "subjects": [{ "kind": "ServiceAccount", "name": "prometheus-k8s", "namespace": "openshift-monitoring" }],
            }),
        ),
    ])
}

/// The bundle's metadata annotations (also the bundle image's labels).
pub fn bundle_annotations() -> BTreeMap<&'static str, &'static str> {
    BTreeMap::from([
        (
            "operators.operatorframework.io.bundle.mediatype.v1",
            "registry+v1",
        ),
        (
            "operators.operatorframework.io.bundle.manifests.v1",
            "manifests/",
        ),
        (
            "operators.operatorframework.io.bundle.metadata.v1",
            "metadata/",
        ),
        ("operators.operatorframework.io.bundle.package.v1", PACKAGE),
        ("operators.operatorframework.io.bundle.channels.v1", CHANNEL),
        (
            "operators.operatorframework.io.bundle.channel.default.v1",
            CHANNEL,
        ),
        ("com.redhat.openshift.versions", OPENSHIFT_VERSIONS),
    ])
}

/// The operator Deployment as OLM installs it: the chart's, changed as the module documentation
/// says. Applying it to its own output changes nothing.
pub fn olm_deployment(mut deployment: Deployment) -> Result<Deployment, BundleError> {
    let name = deployment.metadata.name.clone().unwrap_or_default();
    if name != OPERATOR {
        return Err(BundleError::DeploymentName(name));
    }
    let drop_release_labels = |labels: &mut Option<BTreeMap<String, String>>| {
        if let Some(labels) = labels {
            labels.retain(|k, _| !RELEASE_LABELS.contains(&k.as_str()));
        }
    };
    drop_release_labels(&mut deployment.metadata.labels);
    deployment.metadata.namespace = None;
    let spec = deployment.spec.get_or_insert_with(DeploymentSpec::default);
    if let Some(meta) = spec.template.metadata.as_mut() {
        drop_release_labels(&mut meta.labels);
    }
    let pod = spec.template.spec.as_mut().ok_or(BundleError::NoPodSpec)?;
    if pod.service_account_name.as_deref() != Some(OPERATOR) {
        return Err(BundleError::ServiceAccount(
            pod.service_account_name.clone(),
        ));
    }
    if let Some(security) = pod.security_context.as_mut() {
        security.run_as_user = None;
    }
    let container = pod
        .containers
        .iter_mut()
        .find(|c| c.name == OPERATOR)
        .ok_or(BundleError::NoContainer)?;
    if container.image.as_deref().unwrap_or_default().is_empty() {
        return Err(BundleError::NoImage);
    }
    if !container
        .args
        .iter()
        .flatten()
        .any(|arg| arg == UPGRADE_CRD_OFF)
    {
        return Err(BundleError::UpgradeCrd);
    }
    set_image_env(container)?;
    Ok(deployment)
}

fn set_image_env(container: &mut Container) -> Result<(), BundleError> {
    let env = container.env.get_or_insert_with(Vec::new);
    for (name, image) in image_env()? {
        match env.iter_mut().find(|e| e.name == name) {
            Some(existing) => {
                existing.value = Some(image);
                existing.value_from = None;
            }
            None => env.push(EnvVar {
                name: name.to_owned(),
                value: Some(image),
                value_from: None,
            }),
        }
    }
    Ok(())
}

/// The operator image of an OLM Deployment ([`olm_deployment`] checked that it is set).
fn operator_image(deployment: &Deployment) -> Option<&str> {
    deployment
        .spec
        .as_ref()?
        .template
        .spec
        .as_ref()?
        .containers
        .iter()
        .find(|c| c.name == OPERATOR)?
        .image
        .as_deref()
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ClusterServiceVersion {
    api_version: &'static str,
    kind: &'static str,
    metadata: CsvMetadata,
    spec: CsvSpec,
}

#[derive(Serialize)]
struct CsvMetadata {
    name: String,
    annotations: BTreeMap<&'static str, String>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct CsvSpec {
    display_name: &'static str,
    description: &'static str,
    version: &'static str,
    min_kube_version: String,
    maturity: &'static str,
    provider: Named,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    maintainers: Vec<Maintainer>,
    links: Vec<Link>,
    keywords: Vec<&'static str>,
    icon: Vec<Icon>,
    install_modes: Vec<InstallMode>,
    customresourcedefinitions: Crds,
    install: Install,
    related_images: Vec<RelatedImage>,
}

#[derive(Serialize)]
struct Named {
    name: &'static str,
}

#[derive(Serialize)]
struct Maintainer {
    name: &'static str,
    email: &'static str,
}

#[derive(Serialize)]
struct Link {
    name: &'static str,
    url: &'static str,
}

#[derive(Serialize)]
struct Icon {
    base64data: ByteString,
    mediatype: &'static str,
}

#[derive(Serialize)]
struct InstallMode {
    #[serde(rename = "type")]
    type_: &'static str,
    supported: bool,
}

#[derive(Serialize)]
struct Crds {
    owned: Vec<OwnedCrd>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct OwnedCrd {
    name: &'static str,
    version: &'static str,
    kind: &'static str,
    display_name: &'static str,
    description: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    resources: Vec<CrdResource>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    spec_descriptors: Vec<Descriptor>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    status_descriptors: Vec<Descriptor>,
}

#[derive(Serialize)]
struct CrdResource {
    kind: &'static str,
    name: &'static str,
    version: &'static str,
}

/// A spec or status descriptor: how the OpenShift console shows and edits a field.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    pub path: &'static str,
    pub display_name: &'static str,
    pub description: &'static str,
    #[serde(rename = "x-descriptors")]
    pub x_descriptors: Vec<String>,
}

#[derive(Serialize)]
struct Install {
    strategy: &'static str,
    spec: InstallSpec,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct InstallSpec {
    cluster_permissions: Vec<Permissions>,
    /// Rules OLM grants in the operator's namespace (a Role there).
    permissions: Vec<Permissions>,
    deployments: Vec<DeploymentEntry>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Permissions {
    service_account_name: &'static str,
    rules: Vec<PolicyRule>,
}

#[derive(Serialize)]
struct DeploymentEntry {
    name: &'static str,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    label: BTreeMap<String, String>,
    spec: DeploymentSpec,
}

#[derive(Serialize)]
struct RelatedImage {
    name: String,
    image: String,
}

const SWITCH: &str = "urn:alm:descriptor:com.tectonic.ui:booleanSwitch";
const TEXT: &str = "urn:alm:descriptor:com.tectonic.ui:text";
const CONFIG_MAP: &str = "urn:alm:descriptor:io.kubernetes:ConfigMap";
const ADVANCED: &str = "urn:alm:descriptor:com.tectonic.ui:advanced";

fn descriptor(
    path: &'static str,
    display_name: &'static str,
    description: &'static str,
    x_descriptors: &[&str],
) -> Descriptor {
    Descriptor {
        path,
        display_name,
        description,
        x_descriptors: x_descriptors.iter().map(|s| (*s).to_owned()).collect(),
    }
}

/// `urn:alm:descriptor:com.tectonic.ui:select:<value>` for each value.
fn select(values: &[&str]) -> Vec<String> {
    values
        .iter()
        .map(|v| format!("urn:alm:descriptor:com.tectonic.ui:select:{v}"))
        .collect()
}

/// The fields the console's ClusterPolicy form offers: each operand's switch and the settings
/// users change most (a unit test checks every path and select value against the CRD).
pub fn spec_descriptors() -> Vec<Descriptor> {
    let mut mig_strategy = descriptor(
        "mig.strategy",
        "MIG strategy",
        "How MIG devices are advertised: none, single (all GPUs of a node alike) or mixed.",
        &[],
    );
    mig_strategy.x_descriptors = select(&["none", "single", "mixed"]);
    vec![
        descriptor(
            "driver.enabled",
            "NVIDIA driver",
            "Deploy the containerised NVIDIA driver; turn off where the driver is installed on the host.",
            &[SWITCH],
        ),
        descriptor(
            "driver.version",
            "Driver version",
            "Tag of the driver image; the GPU nodes' OS is appended (for example -rhcos4.20).",
            &[TEXT],
        ),
        descriptor(
            "toolkit.enabled",
            "Container toolkit",
            "Configure the container runtime (CRI-O, containerd) for GPUs through CDI.",
            &[SWITCH],
        ),
        descriptor(
            "devicePlugin.enabled",
            "Device plugin",
            "Advertise nvidia.com/gpu on GPU nodes.",
            &[SWITCH],
        ),
        descriptor(
            "devicePlugin.config.name",
            "Sharing config",
            "ConfigMap in the operator's namespace with device plugin configs (time-slicing, MPS).",
            &[CONFIG_MAP],
        ),
        descriptor(
            "devicePlugin.config.default",
            "Default sharing config",
            "Key of that ConfigMap used on nodes without the nvidia.com/device-plugin.config label.",
            &[TEXT],
        ),
        descriptor(
            "gfd.enabled",
            "GPU feature discovery",
            "Label GPU nodes with product, memory, count and sharing replicas.",
            &[SWITCH],
        ),
        descriptor(
            "dcgmExporter.enabled",
            "DCGM exporter",
            "Export GPU metrics for Prometheus.",
            &[SWITCH],
        ),
        descriptor(
            "dcgmExporter.serviceMonitor.enabled",
            "ServiceMonitor",
            "Create a ServiceMonitor for the DCGM exporter (needs the Prometheus Operator).",
            &[SWITCH],
        ),
        descriptor(
            "dcgm.enabled",
            "Standalone DCGM",
            "Run the DCGM host engine as its own DaemonSet instead of inside the exporter.",
            &[SWITCH, ADVANCED],
        ),
        descriptor(
            "migManager.enabled",
            "MIG manager",
            "Apply the MIG layout a node's nvidia.com/mig.config label names.",
            &[SWITCH],
        ),
        descriptor(
            "migManager.config.name",
            "MIG layouts",
            "ConfigMap in the operator's namespace with the MIG layouts nodes choose from.",
            &[CONFIG_MAP],
        ),
        mig_strategy,
        descriptor(
            "nodeStatusExporter.enabled",
            "Node status exporter",
            "Export the validation status of each GPU node as metrics.",
            &[SWITCH, ADVANCED],
        ),
        descriptor(
            "nfd.enabled",
            "Node feature discovery",
            "Deploy NFD to find GPU nodes (skipped when NFD already runs).",
            &[SWITCH],
        ),
        descriptor(
            "cdi.enabled",
            "CDI",
            "Hand GPUs to containers through the Container Device Interface.",
            &[SWITCH, ADVANCED],
        ),
        descriptor(
            "daemonsets.priorityClassName",
            "Operand priority class",
            "PriorityClass of every operand pod.",
            &[TEXT, ADVANCED],
        ),
    ]
}

/// How the console shows the policy's status.
pub fn status_descriptors() -> Vec<Descriptor> {
    vec![
        descriptor(
            "state",
            "State",
            "ready when every enabled operand is rolled out on its nodes; notReady otherwise; ignored for every policy but the oldest.",
            &["urn:alm:descriptor:io.kubernetes.phase"],
        ),
        descriptor(
            "namespace",
            "Namespace",
            "Namespace of the operands.",
            &[TEXT],
        ),
        descriptor(
            "conditions",
            "Conditions",
            "Ready and Error conditions, with the reason when not ready.",
            &["urn:alm:descriptor:io.kubernetes.conditions"],
        ),
        descriptor(
            "components",
            "Components",
            "Per operand: its DaemonSet, desired, updated and ready pods, config hash and a message.",
            &[],
        ),
    ]
}

/// The namespace the OpenShift console creates when the operator is installed from
/// OperatorHub: labelled privileged for Pod Security Admission (every operand is a privileged
/// pod; OPERAND-FACTS §1, PSA) and for OpenShift's cluster monitoring, which then scrapes the
/// DCGM exporter's ServiceMonitor.
pub fn suggested_namespace() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": SUGGESTED_NAMESPACE,
            "labels": {
                "pod-security.kubernetes.io/enforce": "privileged",
                "pod-security.kubernetes.io/audit": "privileged",
                "pod-security.kubernetes.io/warn": "privileged",
                "openshift.io/cluster-monitoring": "true",
            },
        },
    })
}

/// The ClusterPolicy's description, as the CRD's schema has it (from the Rust type's doc).
fn crd_description() -> String {
    api::crd::crd()
        .spec
        .versions
        .iter()
        .find(|v| v.name == api::VERSION)
        .and_then(|v| {
            v.schema
                .as_ref()?
                .open_api_v3_schema
                .as_ref()?
                .description
                .clone()
        })
        .unwrap_or_default()
}

/// `alm-examples`: the examples as a JSON array. The console form's policy (the first) asks
/// for the Driver Toolkit, as NVIDIA's OperatorHub example does: the bundle is installed on
/// OpenShift, where the driver builds against each node's RHCOS without entitlements only
/// with it, and the operator turns it on only when asked (operands::driver_toolkit). Every
/// ClusterPolicy is named as NVIDIA's OperatorHub example names it
/// ([`OPERATORHUB_POLICY_NAME`]).
pub fn alm_examples() -> anyhow::Result<Value> {
    let mut examples = ALM_EXAMPLES
        .iter()
        .map(|(path, text)| {
            serde_yaml_ng::from_str(text).with_context(|| format!("parsing {path}"))
        })
        .collect::<anyhow::Result<Vec<Value>>>()?;
    if let Some(operator) = examples
        .first_mut()
        .and_then(|policy| policy.pointer_mut("/spec/operator"))
        .and_then(Value::as_object_mut)
    {
        operator.insert("use_ocp_driver_toolkit".to_owned(), Value::Bool(true));
    }
    for policy in examples.iter_mut().filter(|e| e["kind"] == "ClusterPolicy") {
        if let Some(metadata) = policy.get_mut("metadata").and_then(Value::as_object_mut) {
            metadata.insert(
                "name".to_owned(),
                Value::String(OPERATORHUB_POLICY_NAME.to_owned()),
            );
        }
    }
    Ok(Value::Array(examples))
}

const DESCRIPTION: &str = r#"The GPU Operator rolls out the NVIDIA GPU software stack on every GPU node of the cluster from one cluster-scoped `ClusterPolicy` (`nvidia.com/v1`):

* the containerised NVIDIA **driver**, the **container toolkit** (CDI for CRI-O and containerd) and the **validator** that gates everything after it on each node;
* the **device plugin** advertising `nvidia.com/gpu`, with **time-slicing**, **MPS** and **MIG** sharing;
* **GPU feature discovery** and **node feature discovery** labels;
* the **DCGM exporter** for Prometheus metrics and the **MIG manager**.

It is API-compatible with NVIDIA's GPU Operator: the same API group, kind, field names, node labels (`nvidia.com/gpu.deploy.*`, `nvidia.com/device-plugin.config`, `nvidia.com/mig.config`) and operand names, so NVIDIA's documentation and `kubectl patch clusterpolicy` one-liners work unchanged.

### What it adds

* Sharing configs are validated before they reach the plugins: a broken time-slicing or MIG config is reported in the policy status while the plugins keep the last good one, and a ConfigMap edit rolls the plugins without a manual restart.
* MIG layouts are checked against the GPU models of the nodes that select them.
* `status.components` shows every operand's rollout per DaemonSet and why pods are not ready.
* A single sharing-config key with no `default` is used as the default (NVIDIA's operator falls back to no sharing).

### On OpenShift

The operator detects OpenShift (the `config.openshift.io` ClusterVersion API), creates a SecurityContextConstraints object for each privileged operand and the RBAC to use it, and configures the toolkit for CRI-O. Install it into the suggested `nvidia-gpu-operator` namespace, which the console creates labelled `privileged` for Pod Security admission (the operands are privileged pods; label any other namespace the same way), then create the ClusterPolicy from the form (one policy is active; its default values deploy the whole stack).

The operator needs Kubernetes 1.33 or later (OpenShift 4.20 or later).
"#;

/// The ClusterServiceVersion for an OLM Deployment.
fn cluster_service_version(deployment: &Deployment) -> anyhow::Result<ClusterServiceVersion> {
    let image = operator_image(deployment)
        .ok_or(BundleError::NoImage)?
        .to_owned();
    let examples = serde_json::to_string_pretty(&alm_examples()?)?;
    let annotations = BTreeMap::from([
        ("alm-examples", examples),
        ("capabilities", "Basic Install".to_owned()),
        (
            "categories",
            "AI/Machine Learning,OpenShift Optional".to_owned(),
        ),
        ("containerImage", image.clone()),
        ("olm.skipRange", skip_range()),
        (
            "description",
            "The NVIDIA GPU software stack (driver, toolkit, device plugin with time-slicing/MPS/MIG, feature discovery, DCGM exporter, MIG manager) from one ClusterPolicy".to_owned(),
        ),
        (
            "operatorframework.io/suggested-namespace",
            SUGGESTED_NAMESPACE.to_owned(),
        ),
        (
            "operatorframework.io/suggested-namespace-template",
            serde_json::to_string(&suggested_namespace())?,
        ),
    ]);
    let mut related_images = vec![RelatedImage {
        name: OPERATOR.to_owned(),
        image,
    }];
    related_images.extend(image_env()?.into_iter().map(|(var, image)| RelatedImage {
        name: var.to_lowercase().replace('_', "-"),
        image,
    }));
    let label = deployment.metadata.labels.clone().unwrap_or_default();
    let spec = deployment.spec.clone().unwrap_or_default();
    Ok(ClusterServiceVersion {
        api_version: "operators.coreos.com/v1alpha1",
        kind: "ClusterServiceVersion",
        metadata: CsvMetadata {
            name: format!("{PACKAGE}.v{OPERATOR_VERSION}"),
            annotations,
        },
        spec: CsvSpec {
            display_name: "GPU Operator (Rust)",
            description: DESCRIPTION,
            version: OPERATOR_VERSION,
            min_kube_version: format!("{MIN_KUBERNETES_VERSION}.0"),
            maturity: "alpha",
            provider: Named { name: PROVIDER },
            maintainers: Vec::new(),
            links: LINKS.iter().map(|(name, url)| Link { name, url }).collect(),
            keywords: vec![
                "gpu",
                "nvidia",
                "cuda",
                "mig",
                "time-slicing",
                "device-plugin",
                "dcgm",
            ],
            icon: vec![Icon {
                base64data: ByteString(ICON_SVG.as_bytes().to_vec()),
                mediatype: "image/svg+xml",
            }],
            install_modes: INSTALL_MODES
                .into_iter()
                .map(|(type_, supported)| InstallMode { type_, supported })
                .collect(),
            customresourcedefinitions: Crds {
                owned: std::iter::once(OwnedCrd {
                    name: CRD_NAME,
                    version: api::VERSION,
                    kind: "ClusterPolicy",
                    display_name: "ClusterPolicy",
                    description: crd_description(),
                    resources: [
                        "DaemonSet",
                        "Deployment",
                        "ConfigMap",
                        "Service",
                        "ServiceAccount",
                    ]
                    .into_iter()
                    .map(|kind| CrdResource {
                        kind,
                        name: "",
                        version: "v1",
                    })
                    .collect(),
                    spec_descriptors: spec_descriptors(),
                    status_descriptors: status_descriptors(),
                })
                .chain(std::iter::once(OwnedCrd {
                    name: api::gpu_cluster_crd::CRD_NAME,
                    version: "v1alpha1",
                    kind: "GPUCluster",
                    display_name: "GPUCluster",
                    description: GPU_CLUSTER_DESCRIPTION.to_owned(),
                    resources: ["DaemonSet", "Deployment", "ServiceAccount", "DeviceClass"]
                        .into_iter()
                        .map(|kind| CrdResource {
                            kind,
                            name: "",
                            version: "v1",
                        })
                        .collect(),
                    spec_descriptors: Vec::new(),
                    status_descriptors: Vec::new(),
                }))
                .chain(std::iter::once(OwnedCrd {
                    name: api::nvidia_driver_crd::CRD_NAME,
                    version: "v1alpha1",
                    kind: "NVIDIADriver",
                    display_name: "NVIDIADriver",
                    description: NVIDIA_DRIVER_DESCRIPTION.to_owned(),
                    resources: vec![CrdResource {
                        kind: "DaemonSet",
                        name: "",
                        version: "v1",
                    }],
                    spec_descriptors: Vec::new(),
                    status_descriptors: Vec::new(),
                }))
                .chain(
                    NFD_OWNED
                        .into_iter()
                        .map(|(name, kind, display_name, description)| OwnedCrd {
                            name,
                            version: "v1alpha1",
                            kind,
                            display_name,
                            description: description.to_owned(),
                            resources: Vec::new(),
                            spec_descriptors: Vec::new(),
                            status_descriptors: Vec::new(),
                        }),
                )
                .chain(COMPUTE_DOMAIN_OWNED.into_iter().map(
                    |(name, kind, display_name, description)| OwnedCrd {
                        name,
                        version: "v1beta1",
                        kind,
                        display_name,
                        description: description.to_owned(),
                        resources: Vec::new(),
                        spec_descriptors: Vec::new(),
                        status_descriptors: Vec::new(),
                    },
                ))
                .collect(),
            },
            install: Install {
                strategy: "deployment",
                spec: InstallSpec {
                    cluster_permissions: vec![Permissions {
                        service_account_name: OPERATOR,
                        rules: olm_cluster_rules(),
                    }],
                    // OLM makes one Role per entry, in the install namespace: the Lease
                    // stays there.
                    permissions: vec![
                        Permissions {
                            service_account_name: OPERATOR,
                            rules: rbac::operator_role(None).rules.unwrap_or_default(),
                        },
                        Permissions {
                            service_account_name: OPERATOR,
                            rules: rbac::leader_election_role(None).rules.unwrap_or_default(),
                        },
                    ],
                    deployments: vec![DeploymentEntry {
                        name: OPERATOR,
                        label,
                        spec,
                    }],
                },
            },
            related_images,
        },
    })
}

/// The Deployment a CSV's install strategy holds, as the chart would render it for
/// [`files`]: what the drift test feeds back in (OLM's changes are idempotent).
pub fn deployment_of_csv(csv: &Value) -> anyhow::Result<Deployment> {
    let entry = csv
        .pointer("/spec/install/spec/deployments/0")
        .context("the CSV has no spec.install.spec.deployments[0]")?;
    Ok(serde_json::from_value(json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": entry["name"], "labels": entry.get("label").cloned().unwrap_or(json!({}))},
        "spec": entry["spec"],
    }))?)
}

/// Reads a bundle folder's files that [`files`] writes (`None` for a missing one).
pub fn read_files(dir: &Path) -> Vec<(&'static str, Option<String>)> {
    [
        CSV_FILE,
        CRD_FILE,
        GPU_CLUSTER_CRD_FILE,
        NVIDIA_DRIVER_CRD_FILE,
    ]
    .into_iter()
    .chain(NFD_CRD_FILES)
    .chain(COMPUTE_DOMAIN_CRD_FILES)
    .chain([
        ANNOTATIONS_FILE,
        DOCKERFILE,
        METRICS_SERVICE_FILE,
        SERVICE_MONITOR_FILE,
        PROMETHEUS_RULE_FILE,
        PROMETHEUS_ROLE_FILE,
        PROMETHEUS_ROLE_BINDING_FILE,
    ])
    .map(|path| (path, std::fs::read_to_string(dir.join(path)).ok()))
    .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn chart_like_deployment() -> Deployment {
        serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "gpu-operator", "namespace": "gpu-operator", "labels": {
                "helm.sh/chart": "gpu-operator-0.1.0", "app.kubernetes.io/managed-by": "Helm",
                "app.kubernetes.io/instance": "x", "app.kubernetes.io/name": "gpu-operator"}},
            "spec": {
                "selector": {"matchLabels": {"app": "gpu-operator"}},
                "template": {
                    "metadata": {"labels": {"app": "gpu-operator", "helm.sh/chart": "gpu-operator-0.1.0"}},
                    "spec": {
                        "serviceAccountName": "gpu-operator",
                        "securityContext": {"runAsNonRoot": true, "runAsUser": 65532},
                        "containers": [{
                            "name": "gpu-operator", "image": "registry.local/gpu-operator:0.1.0",
                            "args": ["run", "--upgrade-crd=false"],
                            "ports": [{"name": "metrics", "containerPort": 8080}],
                            "env": [{"name": "DRIVER_IMAGE", "value": "old"},
                                    {"name": "OPERATOR_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
                        }]
                    }
                }
            }
        }))
        .unwrap()
    }

    fn schema() -> Value {
        let crd = serde_json::to_value(api::crd::crd()).unwrap();
        crd.pointer("/spec/versions/0/schema/openAPIV3Schema")
            .unwrap()
            .clone()
    }

    /// The schema of `path` (dotted) under `root`'s properties.
    fn property<'a>(root: &'a Value, path: &str) -> Option<&'a Value> {
        path.split('.').try_fold(root, |node, key| {
            node.pointer(&format!("/properties/{key}"))
        })
    }

    #[test]
    fn every_image_kind_is_listed_once() {
        let kinds: BTreeSet<ImageKind> = IMAGE_KINDS.into_iter().collect();
        assert_eq!(kinds.len(), IMAGE_KINDS.len());
    }

    #[test]
    fn image_env_names_every_pinned_image_the_operator_can_deploy() {
        let env: BTreeMap<&str, String> = image_env().unwrap().into_iter().collect();
        for var in [
            "DRIVER_IMAGE",
            "DRIVER_MANAGER_IMAGE",
            "CONTAINER_TOOLKIT_IMAGE",
            "DEVICE_PLUGIN_IMAGE",
            "GFD_IMAGE",
            "DCGM_IMAGE",
            "DCGM_EXPORTER_IMAGE",
            "MIG_MANAGER_IMAGE",
            "VALIDATOR_IMAGE",
            "GDS_IMAGE",
            "GDRCOPY_IMAGE",
            "NFD_IMAGE",
        ] {
            assert!(env.contains_key(var), "{var} missing from {env:?}");
        }
        let facts = digest_facts().unwrap();
        for kind in IMAGE_KINDS {
            if let Some(image) = kind.pinned() {
                let expected = pinned_by_digest(image, &facts).unwrap();
                assert_eq!(env.get(kind.env_var()), Some(&expected), "{kind:?}");
                assert!(
                    expected.starts_with(image),
                    "{expected} is not {image} pinned"
                );
            }
        }
        assert_eq!(
            env.len(),
            image_env().unwrap().len(),
            "a variable is listed twice"
        );
    }

    #[test]
    fn every_pinned_image_has_one_digest_fact_and_every_fact_a_pinned_image() {
        let facts = digest_facts().unwrap();
        let pinned: BTreeSet<&str> = IMAGE_KINDS.iter().filter_map(|k| k.pinned()).collect();
        for image in &pinned {
            assert!(
                facts.iter().any(|f| f.tagged() == *image),
                "{image} has no row in {DIGESTS_FILE}"
            );
        }
        for fact in &facts {
            assert!(
                pinned.contains(fact.tagged().as_str()),
                "{DIGESTS_FILE} has a row for {}, which the operator does not pin (stale?)",
                fact.tagged()
            );
        }
        // The facts found in NVIDIA's v26.7.0 CSV are used, not dropped.
        assert_eq!(
            pinned_by_digest("nvcr.io/nvidia/k8s-device-plugin:v0.20.0", &facts).unwrap(),
            "nvcr.io/nvidia/k8s-device-plugin:v0.20.0@sha256:a61ba9fd8efb82f3a79f877f7580e02c1e8e7593f62473644bc9c79e315c3312"
        );
    }

    #[test]
    fn an_image_without_a_digest_fact_is_an_error_that_names_the_table() {
        let err = pinned_by_digest("nvcr.io/nvidia/new-operand:v1", &digest_facts().unwrap())
            .unwrap_err();
        assert!(
            err.to_string().contains("nvcr.io/nvidia/new-operand:v1")
                && err.to_string().contains(DIGESTS_FILE),
            "{err}"
        );
    }

    #[test]
    fn digests_are_checked_for_form() {
        assert!(is_sha256_digest(&format!("sha256:{}", "0a".repeat(32))));
        assert!(!is_sha256_digest(&format!("sha256:{}", "0A".repeat(32))));
        assert!(!is_sha256_digest(&format!("sha256:{}", "0a".repeat(31))));
        assert!(!is_sha256_digest(&format!("sha512:{}", "0a".repeat(32))));
    }

    #[test]
    fn olm_deployment_drops_release_labels_and_the_fixed_uid_and_sets_image_env() {
        let d = olm_deployment(chart_like_deployment()).unwrap();
        let labels = d.metadata.labels.clone().unwrap();
        assert_eq!(
            labels.keys().collect::<Vec<_>>(),
            ["app.kubernetes.io/name"]
        );
        assert_eq!(d.metadata.namespace, None);
        let spec = d.spec.as_ref().unwrap();
        let template_labels = spec.template.metadata.as_ref().unwrap().labels.clone();
        assert_eq!(template_labels.unwrap().keys().collect::<Vec<_>>(), ["app"]);
        let pod = spec.template.spec.as_ref().unwrap();
        let security = pod.security_context.as_ref().unwrap();
        assert_eq!(security.run_as_user, None);
        assert_eq!(security.run_as_non_root, Some(true));
        let env = pod.containers[0].env.as_ref().unwrap();
        let value = |name: &str| {
            env.iter()
                .find(|e| e.name == name)
                .and_then(|e| e.value.clone())
        };
        assert_eq!(
            value("DRIVER_IMAGE").as_deref(),
            ImageKind::Driver.pinned(),
            "an existing variable is replaced (the driver has no digest: its tag gets the OS)"
        );
        assert_eq!(env.iter().filter(|e| e.name == "DRIVER_IMAGE").count(), 1);
        assert!(
            env.iter()
                .any(|e| e.name == "OPERATOR_NAMESPACE" && e.value_from.is_some())
        );
        assert_eq!(
            olm_deployment(d.clone()).unwrap(),
            d,
            "applying it twice changes nothing"
        );
    }

    #[test]
    fn olm_deployment_rejects_a_chart_that_upgrades_its_own_crd() {
        let mut d = chart_like_deployment();
        let pod = d.spec.as_mut().unwrap().template.spec.as_mut().unwrap();
        pod.containers[0].args = Some(vec!["run".into(), "--upgrade-crd=true".into()]);
        let err = olm_deployment(d).unwrap_err();
        assert!(
            err.to_string().contains("operator.upgradeCRD=false"),
            "{err}"
        );
    }

    #[test]
    fn olm_deployment_rejects_another_service_account() {
        let mut d = chart_like_deployment();
        let pod = d.spec.as_mut().unwrap().template.spec.as_mut().unwrap();
        pod.service_account_name = Some("default".into());
        let err = olm_deployment(d).unwrap_err();
        assert!(err.to_string().contains("serviceAccountName"), "{err}");
    }

    #[test]
    fn descriptor_paths_and_select_values_exist_in_the_crd() {
        let schema = schema();
        let spec = schema.pointer("/properties/spec").unwrap();
        let status = schema.pointer("/properties/status").unwrap();
        for (root, descriptors) in [(spec, spec_descriptors()), (status, status_descriptors())] {
            for d in descriptors {
                let field = property(root, d.path)
                    .unwrap_or_else(|| panic!("descriptor path {} is not in the CRD", d.path));
                for x in &d.x_descriptors {
                    if let Some(value) =
                        x.strip_prefix("urn:alm:descriptor:com.tectonic.ui:select:")
                    {
                        let allowed = field["enum"].as_array().unwrap();
                        assert!(
                            allowed.iter().any(|v| v == value),
                            "{}: {value} is not one of {allowed:?}",
                            d.path
                        );
                    }
                    if x == SWITCH {
                        assert_eq!(field["type"], "boolean", "{}", d.path);
                    }
                }
            }
        }
    }

    #[test]
    fn alm_example_policies_keep_every_field() {
        let examples = alm_examples().unwrap();
        let examples = examples.as_array().unwrap();
        assert_eq!(examples.len(), ALM_EXAMPLES.len());
        let policies: Vec<&Value> = examples
            .iter()
            .filter(|e| e["kind"] == "ClusterPolicy")
            .collect();
        assert!(!policies.is_empty());
        for example in policies {
            assert_eq!(example["apiVersion"], "nvidia.com/v1");
            let policy: api::ClusterPolicy = serde_json::from_value(example.clone()).unwrap();
            assert_eq!(&serde_json::to_value(policy).unwrap(), example);
        }
    }

    #[test]
    fn the_example_policies_are_named_as_nvidias_operatorhub_example() {
        let examples = alm_examples().unwrap();
        let names: Vec<&Value> = examples
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["kind"] == "ClusterPolicy")
            .map(|e| &e["metadata"]["name"])
            .collect();
        assert!(!names.is_empty());
        for name in names {
            assert_eq!(name, "gpu-cluster-policy");
        }
    }

    #[test]
    fn the_csv_names_no_placeholder_provider_or_maintainer() {
        let files = files(chart_like_deployment()).unwrap();
        let csv: Value = serde_yaml_ng::from_str(&files[0].content).unwrap();
        let provider = &csv["spec"]["provider"];
        assert_eq!(provider["name"], PROVIDER);
        assert!(!provider.to_string().contains("example."), "{provider}");
        for maintainer in csv["spec"]["maintainers"].as_array().into_iter().flatten() {
            let email = maintainer["email"].as_str().unwrap_or_default();
            assert!(
                email.contains('@') && !email.contains("example."),
                "a placeholder maintainer: {maintainer}"
            );
        }
    }

    #[test]
    fn the_console_forms_policy_asks_for_the_driver_toolkit_as_nvidias_does() {
        let examples = alm_examples().unwrap();
        assert_eq!(examples[0]["kind"], "ClusterPolicy");
        assert_eq!(
            examples[0]["spec"]["operator"]["use_ocp_driver_toolkit"],
            true
        );
    }

    #[test]
    fn every_owned_crd_has_an_alm_example_of_its_kind_and_version() {
        let files = files(chart_like_deployment()).unwrap();
        let csv: Value = serde_yaml_ng::from_str(&files[0].content).unwrap();
        let examples = alm_examples().unwrap();
        let owned = csv["spec"]["customresourcedefinitions"]["owned"]
            .as_array()
            .unwrap();
        assert_eq!(
            owned.len(),
            3 + NFD_OWNED.len() + COMPUTE_DOMAIN_OWNED.len()
        );
        for crd in owned {
            let group = crd["name"].as_str().unwrap().split_once('.').unwrap().1;
            let api_version = format!("{group}/{}", crd["version"].as_str().unwrap());
            assert!(
                examples
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|e| e["kind"] == crd["kind"] && e["apiVersion"] == api_version.as_str()),
                "no alm-example of {} {api_version}",
                crd["kind"]
            );
        }
        // Each owned NFD CRD is a file of the bundle, with the kind the CSV names.
        let vendored = NFD_OWNED
            .iter()
            .zip(NFD_CRD_FILES)
            .chain(COMPUTE_DOMAIN_OWNED.iter().zip(COMPUTE_DOMAIN_CRD_FILES));
        for ((name, kind, _, _), path) in vendored {
            let file = files.iter().find(|f| f.path == path).unwrap();
            let crd: Value = serde_yaml_ng::from_str(&file.content).unwrap();
            assert_eq!(crd["metadata"]["name"], *name, "{path}");
            assert_eq!(crd["spec"]["names"]["kind"], *kind, "{path}");
        }
    }

    #[test]
    fn the_csv_declares_nvidias_install_modes_and_an_upgrade_range() {
        let files = files(chart_like_deployment()).unwrap();
        let csv: Value = serde_yaml_ng::from_str(&files[0].content).unwrap();
        let modes: Vec<(&str, bool)> = csv["spec"]["installModes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["type"].as_str().unwrap(),
                    m["supported"].as_bool().unwrap(),
                )
            })
            .collect();
        // NVIDIA's v26.7.0 CSV: OwnNamespace and SingleNamespace.
        assert_eq!(
            modes,
            [
                ("OwnNamespace", true),
                ("SingleNamespace", true),
                ("MultiNamespace", false),
                ("AllNamespaces", false)
            ]
        );
        assert_eq!(
            csv["metadata"]["annotations"]["olm.skipRange"],
            format!("<{OPERATOR_VERSION}")
        );
    }

    #[test]
    fn the_csv_may_read_but_not_write_crds() {
        let rules = olm_cluster_rules();
        let on_crds: Vec<&PolicyRule> = rules
            .iter()
            .filter(|r| {
                r.resources
                    .iter()
                    .flatten()
                    .any(|x| x == "customresourcedefinitions")
            })
            .collect();
        assert!(!on_crds.is_empty(), "the operator still reads NFD's CRDs");
        for rule in on_crds {
            assert!(
                rule.verbs
                    .iter()
                    .all(|v| ["get", "list", "watch"].contains(&v.as_str())),
                "{rule:?}"
            );
        }
        // Everything else is the generated ClusterRole's.
        let all = rbac::operator_cluster_role().rules.unwrap();
        let others = |rules: &[PolicyRule]| -> Vec<PolicyRule> {
            rules
                .iter()
                .filter(|r| {
                    !r.resources
                        .iter()
                        .flatten()
                        .any(|x| x == "customresourcedefinitions")
                })
                .cloned()
                .collect()
        };
        assert_eq!(others(&rules), others(&all));
    }

    #[test]
    fn the_suggested_namespace_template_is_a_privileged_namespace() {
        let ns: k8s_openapi::api::core::v1::Namespace =
            serde_json::from_value(suggested_namespace()).unwrap();
        assert_eq!(ns.metadata.name.as_deref(), Some(SUGGESTED_NAMESPACE));
        let labels = ns.metadata.labels.unwrap();
        for mode in ["enforce", "audit", "warn"] {
            assert_eq!(
                labels[&format!("pod-security.kubernetes.io/{mode}")],
                "privileged"
            );
        }
    }

    #[test]
    fn the_owned_crd_is_described() {
        // OperatorHub's good-practices suite warns about an empty description.
        assert!(crd_description().starts_with("The NVIDIA GPU software stack"));
    }

    #[test]
    fn the_icon_is_an_svg_that_round_trips_through_base64() {
        let encoded = serde_json::to_value(ByteString(ICON_SVG.as_bytes().to_vec())).unwrap();
        let decoded: ByteString = serde_json::from_value(encoded).unwrap();
        assert_eq!(decoded.0, ICON_SVG.as_bytes());
        assert!(ICON_SVG.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    }

    #[test]
    fn csv_holds_the_generated_rbac_env_and_related_images() {
        let files = files(chart_like_deployment()).unwrap();
        let csv_text = &files.iter().find(|f| f.path == CSV_FILE).unwrap().content;
        let csv: Value = serde_yaml_ng::from_str(csv_text).unwrap();
        let rules = serde_json::to_value(olm_cluster_rules()).unwrap();
        assert_eq!(
            csv.pointer("/spec/install/spec/clusterPermissions/0/rules"),
            Some(&rules)
        );
        let namespaced = serde_json::to_value(rbac::operator_role(None).rules).unwrap();
        assert_eq!(
            csv.pointer("/spec/install/spec/permissions/0/rules"),
            Some(&namespaced)
        );
        assert_eq!(
            csv.pointer("/spec/install/spec/permissions/0/serviceAccountName"),
            Some(&json!(OPERATOR))
        );
        let leader = serde_json::to_value(rbac::leader_election_role(None).rules).unwrap();
        assert_eq!(
            csv.pointer("/spec/install/spec/permissions/1/rules"),
            Some(&leader)
        );
        assert_eq!(csv["spec"]["minKubeVersion"], "1.33.0");
        let related: Vec<&str> = csv["spec"]["relatedImages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["image"].as_str().unwrap())
            .collect();
        for (_, image) in image_env().unwrap() {
            assert!(
                related.contains(&image.as_str()),
                "{image} not in relatedImages"
            );
        }
        assert!(related.contains(&"registry.local/gpu-operator:0.1.0"));
        let examples: Value = serde_json::from_str(
            csv["metadata"]["annotations"]["alm-examples"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(examples, alm_examples().unwrap());
        // The round trip the drift test relies on.
        let again = files_from_csv(&csv);
        assert_eq!(again, files);
    }

    #[test]
    fn the_metrics_service_selects_the_operator_pods_and_the_rules_are_the_charts() {
        let files = files(chart_like_deployment()).unwrap();
        let object = |path: &str| -> Value {
            serde_yaml_ng::from_str(&files.iter().find(|f| f.path == path).unwrap().content)
                .unwrap()
        };
        let service = object(METRICS_SERVICE_FILE);
        assert_eq!(service["spec"]["selector"], json!({"app": "gpu-operator"}));
        assert_eq!(service["spec"]["ports"][0]["port"], 8080);
        assert_eq!(service["metadata"].get("namespace"), None);
        let monitor = object(SERVICE_MONITOR_FILE);
        assert_eq!(
            monitor["spec"]["selector"]["matchLabels"],
            service["metadata"]["labels"]
        );
        assert_eq!(
            monitor["spec"]["endpoints"][0]["port"],
            service["spec"]["ports"][0]["name"]
        );
        let chart_rules: Value = serde_yaml_ng::from_str(PROMETHEUS_RULES).unwrap();
        assert_eq!(object(PROMETHEUS_RULE_FILE)["spec"], chart_rules);

        let mut no_port = chart_like_deployment();
        no_port
            .spec
            .as_mut()
            .unwrap()
            .template
            .spec
            .as_mut()
            .unwrap()
            .containers[0]
            .ports = None;
        let err = super::files(no_port).unwrap_err().to_string();
        assert!(err.contains("no port named `metrics`"), "{err}");
    }

    fn files_from_csv(csv: &Value) -> Vec<BundleFile> {
        files(deployment_of_csv(csv).unwrap()).unwrap()
    }

    #[test]
    fn no_plain_scalar_reads_as_a_yaml_1_1_boolean() {
        // Go's YAML 1.1 readers (OLM's among them) take these words as booleans.
        let words = [
            "y", "Y", "yes", "Yes", "YES", "n", "N", "no", "No", "NO", "on", "On", "ON", "off",
            "Off", "OFF",
        ];
        for file in files(chart_like_deployment()).unwrap() {
            for line in file.content.lines() {
                let body = line.trim_start().trim_start_matches("- ");
                let value = body.split_once(": ").map_or(body, |(_, v)| v);
                assert!(
                    !words.contains(&value),
                    "{}: `{line}` reads as a boolean in YAML 1.1",
                    file.path
                );
            }
        }
    }
}
