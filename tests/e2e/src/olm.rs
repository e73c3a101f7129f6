//! Real OLM on the harness: OLM's olm-operator and catalog operator (built by
//! tests/cluster/build.sh from operator-lifecycle-manager at the pinned release) and OLM's CRDs,
//! the RBAC OLM's resolver makes for a ClusterServiceVersion (`csv-rbac`, what an InstallPlan
//! creates, for the test that applies a CSV directly), and the operator run as the container
//! of the Deployment OLM made (IO).
//!
//! Both OLM operators serve metrics and health on :8080 of every address and have no flag to
//! change that, so each runs under `netns-run`, in a network namespace of its own where only
//! the API server's 127.0.0.1 port (and the catalog operator's catalog address) leads out. A
//! failed step panics or errors: this is test support.

use crate::operator::{Operator, OperatorIdentity};
use crate::tools::on_path;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use serde_json::Value;

use crate::cluster::unique_name;

/// The namespace olm-operator runs its own bookkeeping in (`--namespace`).
pub const OLM_NAMESPACE: &str = "olm";
const FIELD_MANAGER: &str = "e2e-olm";

/// OLM's CRDs: the YAML files build.sh copied from OLM's operator-framework/api module.
fn crd_dir() -> Result<PathBuf> {
    Ok(on_path("olm")?
        .parent()
        .context("olm has no folder")?
        .join("olm-crds"))
}

/// The API server's loopback address from the admin kubeconfig (`https://127.0.0.1:PORT`).
fn api_server_address() -> Result<String> {
    let path = std::env::var("KUBECONFIG").context("KUBECONFIG is not set")?;
    let config: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(&path)?)?;
    let server = config["clusters"][0]["cluster"]["server"]
        .as_str()
        .context("the kubeconfig has no clusters[0].cluster.server")?;
    let address = server
        .strip_prefix("https://")
        .with_context(|| format!("server {server} is not https"))?
        .trim_end_matches('/');
    if !address.starts_with("127.0.0.1:") {
        bail!("the API server {server} is not on 127.0.0.1");
    }
    Ok(address.to_owned())
}

/// Server-side applies every object of `dir`'s YAML files.
async fn apply_dir(admin: &Client, dir: &Path) -> Result<Vec<(ApiResource, String)>> {
    let mut applied = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    for file in files {
        let object: DynamicObject = serde_yaml_ng::from_str(&std::fs::read_to_string(&file)?)
            .with_context(|| format!("parsing {}", file.display()))?;
        let resource = api_resource(&object)?;
        let name = object
            .metadata
            .name
            .clone()
            .context("an object without a name")?;
        Api::<DynamicObject>::all_with(admin.clone(), &resource)
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&object),
            )
            .await
            .with_context(|| format!("applying {}", file.display()))?;
        applied.push((resource, name));
    }
    Ok(applied)
}

/// The API resource of a typed object, its plural guessed as kube does (right for every kind
/// used here).
pub fn api_resource(object: &DynamicObject) -> Result<ApiResource> {
    let types = object
        .types
        .as_ref()
        .context("an object without apiVersion/kind")?;
    let (group, version) = types
        .api_version
        .split_once('/')
        .unwrap_or(("", types.api_version.as_str()));
    Ok(ApiResource::from_gvk(&GroupVersionKind::gvk(
        group,
        version,
        &types.kind,
    )))
}

/// Installs OLM's CRDs and waits until the API server serves them.
pub async fn install_crds(admin: &Client) -> Result<()> {
    let dir = crd_dir()?;
    apply_dir(admin, &dir).await?;
    let status = crate::kubectl()
        .args(["wait", "--for=condition=Established", "--timeout=60s", "-f"])
        .arg(&dir)
        .stdout(Stdio::null())
        .status()?;
    anyhow::ensure!(status.success(), "OLM's CRDs did not become established");
    Ok(())
}

/// A running OLM operator (olm-operator or the catalog operator); killed (with its network
/// namespace) when dropped.
pub struct Olm {
    child: Option<Child>,
    pub log: PathBuf,
}

/// Creates OLM's namespace unless it exists.
async fn ensure_olm_namespace(admin: &Client) -> Result<()> {
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(admin.clone());
    if namespaces.get_opt(OLM_NAMESPACE).await?.is_none() {
        let mut ns = k8s_openapi::api::core::v1::Namespace::default();
        ns.metadata.name = Some(OLM_NAMESPACE.to_owned());
        namespaces
            .create(&kube::api::PostParams::default(), &ns)
            .await?;
    }
    Ok(())
}

impl Olm {
    /// Installs OLM's CRDs and its namespace, then starts olm-operator as the harness admin
    /// (OLM runs with cluster-admin in a cluster too), watching every namespace.
    pub async fn start(admin: &Client) -> Result<Self> {
        install_crds(admin).await?;
        ensure_olm_namespace(admin).await?;
        Self::spawn(
            "olm",
            &[
                "--namespace",
                OLM_NAMESPACE,
                // No OpenShift ClusterOperator objects to write status to.
                "--writeStatusName=",
                "--writePackageServerStatusName=",
                "--interval=30s",
            ],
            &[],
        )
    }

    /// Starts OLM's catalog operator as the harness admin, its global catalog namespace OLM's
    /// (a CatalogSource there serves every namespace), able to reach the catalogs served at
    /// `catalog_addresses` (`127.0.0.1:PORT`, the CatalogSources' `spec.address`). It resolves
    /// Subscriptions into InstallPlans and executes them; for a bundle it has to unpack it runs
    /// a Job whose pod kwok does not run ([`crate::olm_catalog::BundleUnpacker`]).
    pub async fn start_catalog_operator(
        admin: &Client,
        catalog_addresses: &[&str],
    ) -> Result<Self> {
        install_crds(admin).await?;
        ensure_olm_namespace(admin).await?;
        Self::spawn(
            "catalog",
            &[
                "--namespace",
                OLM_NAMESPACE,
                "--writeStatusName=",
                // What the unpack Job's containers name: upstream's images at the releases the
                // harness builds.
                "--opmImage",
                &format!(
                    "quay.io/operator-framework/opm:{}",
                    crate::cluster::pinned_version("OPM_VERSION")?
                ),
                "--util-image",
                &format!(
                    "quay.io/operator-framework/olm:{}",
                    crate::cluster::pinned_version("OLM_VERSION")?
                ),
                "--interval=30s",
            ],
            catalog_addresses,
        )
    }

    /// Runs harness binary `binary` with `args` under netns-run, forwarding the API server and
    /// `extra_forwards`.
    fn spawn(binary: &str, args: &[&str], extra_forwards: &[&str]) -> Result<Self> {
        let log = std::env::temp_dir().join(format!("{}.log", unique_name(binary)));
        let file = std::fs::File::create(&log)?;
        let mut command = Command::new(on_path("netns-run")?);
        command.arg("--forward").arg(api_server_address()?);
        for address in extra_forwards {
            command.arg("--forward").arg(address);
        }
        let child = command
            .arg("--")
            .arg(on_path(binary)?)
            .args(args)
            .env(
                "KUBECONFIG",
                std::env::var("KUBECONFIG").context("KUBECONFIG is not set")?,
            )
            .stdout(file.try_clone()?)
            .stderr(file)
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting netns-run {binary}"))?;
        Ok(Olm {
            child: Some(child),
            log,
        })
    }

    /// The last `lines` lines of olm-operator's log (for assertion messages).
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Whether the process still runs.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for Olm {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The RBAC OLM's resolver makes for `csv` (as the API server returned it: uid and namespace
/// set): ServiceAccounts, Roles, RoleBindings, ClusterRoles, ClusterRoleBindings.
pub fn generated_rbac(csv: &Value) -> Result<Vec<DynamicObject>> {
    let mut child = Command::new(on_path("csv-rbac")?)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting csv-rbac")?;
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().context("csv-rbac stdin")?;
        stdin.write_all(serde_json::to_string(csv)?.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    anyhow::ensure!(
        out.status.success(),
        "csv-rbac failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: Value = serde_json::from_slice(&out.stdout)?;
    list["items"]
        .as_array()
        .context("csv-rbac printed no items")?
        .iter()
        .map(|item| Ok(serde_json::from_value(item.clone())?))
        .collect()
}

/// Creates `objects` as the catalog operator would (server-side apply as the admin).
pub async fn apply_objects(admin: &Client, objects: &[DynamicObject]) -> Result<()> {
    for object in objects {
        let resource = api_resource(object)?;
        let name = object
            .metadata
            .name
            .clone()
            .context("an object without a name")?;
        let api: Api<DynamicObject> = match object.metadata.namespace.as_deref() {
            Some(ns) => Api::namespaced_with(admin.clone(), ns, &resource),
            None => Api::all_with(admin.clone(), &resource),
        };
        api.patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(object),
        )
        .await
        .with_context(|| format!("applying {} {name}", resource.kind))?;
    }
    Ok(())
}

/// Deletes the cluster-scoped objects among `objects` (namespaced ones go with their namespace).
pub async fn delete_cluster_scoped(admin: &Client, objects: &[DynamicObject]) -> Result<()> {
    for object in objects.iter().filter(|o| o.metadata.namespace.is_none()) {
        let resource = api_resource(object)?;
        let name = object.metadata.name.clone().unwrap_or_default();
        match Api::<DynamicObject>::all_with(admin.clone(), &resource)
            .delete(&name, &kube::api::DeleteParams::default())
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e).with_context(|| format!("deleting {} {name}", resource.kind)),
        }
    }
    Ok(())
}

/// The operator run as the `gpu-operator` container of the Deployment `deployment` OLM created
/// in `namespace`: its args and env, with a token of its ServiceAccount, so the RBAC OLM
/// generated is its only authority. `pod_name` fills the downward-API `metadata.name`.
pub async fn run_deployment_container(
    admin: &Client,
    namespace: &str,
    deployment: &str,
    pod_name: &str,
) -> Result<(OperatorIdentity, Operator)> {
    let deployment =
        Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(admin.clone(), namespace)
            .get(deployment)
            .await?;
    let pod = deployment
        .spec
        .and_then(|s| s.template.spec)
        .context("the Deployment has no pod template")?;
    let service_account = pod
        .service_account_name
        .clone()
        .context("the pod template names no ServiceAccount")?;
    let container = pod
        .containers
        .iter()
        .find(|c| c.name == "gpu-operator")
        .context("the pod template has no gpu-operator container")?;
    let identity = OperatorIdentity::existing(admin, namespace, &service_account).await?;
    let operator = Operator::start_as_container(&identity, container, pod_name)?;
    Ok((identity, operator))
}
