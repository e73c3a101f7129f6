//! OLM from a catalog on the harness (IO): bundle and catalog images published to the harness
//! registry by `scripts/olm-catalog.sh` (what `make release` runs), the catalog image's
//! container run as OLM's registry pod would run it (`opm serve`, under netns-run so its
//! every-address listener is reachable on 127.0.0.1 only), and the one step kwok cannot run:
//! the catalog operator's bundle unpack Job ([`BundleUnpacker`]).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::batch::v1::Job;
use kube::Client;
use kube::api::{Api, ListParams};
use serde_json::Value;

use crate::cluster::unique_name;
use crate::operator::write_token_kubeconfig;
use crate::tools::on_path;

/// The label OLM's catalog operator puts on its bundle unpack Jobs.
const BUNDLE_UNPACK_LABEL: &str = "operatorframework.io/bundle-unpack-ref";
/// The port `opm serve` listens on inside its network namespace (a registry pod's).
const OPM_SERVE_PORT: u16 = 50051;

/// opm and oras as `tests/cluster/build.sh opm oras` built them (cached after the first build),
/// or `None` when they cannot be built here ([`crate::cluster::prerequisite`]).
pub fn tools() -> Option<Tools> {
    crate::cluster::prerequisite(
        "opm and oras (tests/cluster/build.sh opm oras) could not be built",
        crate::registry::run_script("tests/cluster/build.sh", &["opm", "oras"]).and_then(|out| {
            let bin = PathBuf::from(
                out.lines()
                    .last()
                    .context("build.sh printed nothing")?
                    .trim(),
            );
            Ok(Tools {
                opm: bin.join("opm"),
                oras: bin.join("oras"),
            })
        }),
    )
}

/// The catalog tools' binaries.
#[derive(Clone, Debug)]
pub struct Tools {
    pub opm: PathBuf,
    pub oras: PathBuf,
}

/// The port the catalog is served on: `OLM_CATALOG_PORT`, else `HARNESS_PORT_BASE` + 7
/// (tests/cluster/lib.sh).
pub fn catalog_port() -> Result<u16> {
    if let Ok(port) = std::env::var("OLM_CATALOG_PORT") {
        return port.parse().context("OLM_CATALOG_PORT");
    }
    let base: u16 = std::env::var("HARNESS_PORT_BASE")
        .unwrap_or_else(|_| "16400".to_owned())
        .parse()
        .context("HARNESS_PORT_BASE")?;
    Ok(base + 7)
}

/// What `scripts/olm-catalog.sh` published.
#[derive(Clone, Debug)]
pub struct Published {
    /// Every bundle of the catalog, oldest first, by digest.
    pub bundles: Vec<String>,
    /// The catalog image, `repository:tag@digest`.
    pub catalog: String,
    /// The FBC folder the catalog image carries.
    pub fbc: PathBuf,
}

/// Publishes `bundles` (folders or published bundle references, oldest first) and their
/// catalog to `registry` with `scripts/olm-catalog.sh`, its files under `out`.
pub fn publish(registry: &str, out: &Path, bundles: &[&str]) -> Result<Published> {
    let out_arg = out.to_str().context("a non-UTF-8 folder")?;
    let mut args = vec![registry, out_arg];
    args.extend_from_slice(bundles);
    let stdout = crate::registry::run_script("scripts/olm-catalog.sh", &args)?;
    let field = |key: &str| -> Vec<String> {
        stdout
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("{key}=")).map(str::to_owned))
            .collect()
    };
    Ok(Published {
        bundles: field("bundle"),
        catalog: field("catalog")
            .pop()
            .context("olm-catalog.sh printed no catalog")?,
        fbc: PathBuf::from(
            field("fbc")
                .pop()
                .context("olm-catalog.sh printed no fbc")?,
        ),
    })
}

/// Runs oras with `args` (plain HTTP: the harness registry is on loopback) and returns stdout.
fn oras(tools: &Tools, args: &[&str]) -> Result<Vec<u8>> {
    let out = Command::new(&tools.oras)
        .args(args)
        .arg("--plain-http")
        .output()
        .context("running oras")?;
    if !out.status.success() {
        bail!(
            "oras {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out.stdout)
}

/// Pulls image `reference` from the registry as a container runtime would and unpacks its
/// layers into `root`; its image config (entrypoint, cmd, labels).
pub fn pull_image(tools: &Tools, reference: &str, root: &Path) -> Result<Value> {
    let manifest: Value = serde_json::from_slice(&oras(tools, &["manifest", "fetch", reference])?)?;
    let repository = reference
        .split('@')
        .next()
        .and_then(|r| r.rsplit_once(':').filter(|(_, tag)| !tag.contains('/')))
        .map_or_else(
            || reference.split('@').next().unwrap_or(reference),
            |(repo, _)| repo,
        );
    let blob = |digest: &str| -> Result<Vec<u8>> {
        oras(
            tools,
            &[
                "blob",
                "fetch",
                "--output",
                "-",
                &format!("{repository}@{digest}"),
            ],
        )
    };
    let config_digest = manifest["config"]["digest"]
        .as_str()
        .context("the manifest has no config")?;
    let config: Value = serde_json::from_slice(&blob(config_digest)?)?;
    std::fs::create_dir_all(root)?;
    for layer in manifest["layers"].as_array().context("no layers")? {
        let digest = layer["digest"].as_str().context("a layer without digest")?;
        let file = root.with_extension(format!("layer-{}", &digest[7..19]));
        std::fs::write(&file, blob(digest)?)?;
        let status = Command::new("tar")
            .arg("-xzf")
            .arg(&file)
            .arg("-C")
            .arg(root)
            .status()?;
        std::fs::remove_file(&file)?;
        anyhow::ensure!(status.success(), "unpacking layer {digest} of {reference}");
    }
    Ok(config)
}

/// The catalog image's container, run as OLM's registry pod runs it (its entrypoint and cmd, the
/// port OLM's pod gives it), its filesystem a folder here; killed when dropped.
pub struct CatalogServer {
    child: Option<Child>,
    pub address: String,
    pub log: PathBuf,
}

impl CatalogServer {
    /// Pulls `image`, starts its container serving on `127.0.0.1:port` and waits until its
    /// gRPC health service answers `SERVING` (the image's own grpc_health_probe, as OLM's
    /// registry pod's readiness probe asks).
    pub async fn start(tools: &Tools, image: &str, port: u16) -> Result<Self> {
        let root = std::env::temp_dir().join(unique_name("catalog-image"));
        let config = pull_image(tools, image, &root)?;
        let config = &config["config"];
        let mut argv: Vec<String> = config["Entrypoint"]
            .as_array()
            .into_iter()
            .flatten()
            .chain(config["Cmd"].as_array().into_iter().flatten())
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .context("a non-string argument")
            })
            .collect::<Result<_>>()?;
        anyhow::ensure!(!argv.is_empty(), "{image} has no entrypoint or cmd");
        // The container's paths are the image's files here.
        for arg in &mut argv {
            if arg.starts_with('/') {
                *arg = root.join(&arg[1..]).to_string_lossy().into_owned();
            }
        }
        let address = format!("127.0.0.1:{port}");
        let log = std::env::temp_dir().join(format!("{}.log", unique_name("opm-serve")));
        let file = std::fs::File::create(&log)?;
        let child = Command::new(on_path("netns-run")?)
            .arg("--publish")
            .arg(format!("{address}={OPM_SERVE_PORT}"))
            .arg("--")
            .args(&argv)
            .args(["-p", &OPM_SERVE_PORT.to_string()])
            // A container's termination log path does not exist here.
            .args(["--termination-log", "/dev/null"])
            .stdout(file.try_clone()?)
            .stderr(file)
            .stdin(Stdio::null())
            .spawn()
            .context("starting the catalog image's opm serve")?;
        let mut server = CatalogServer {
            child: Some(child),
            address,
            log,
        };
        let probe = root.join("bin/grpc_health_probe");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let ok = Command::new(&probe)
                .arg(format!("-addr={}", server.address))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()?
                .success();
            if ok {
                return Ok(server);
            }
            if !server.is_running() || tokio::time::Instant::now() >= deadline {
                bail!(
                    "opm serve of {image} is not serving on {} (log {}):\n{}",
                    server.address,
                    server.log.display(),
                    std::fs::read_to_string(&server.log).unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Whether the process still runs.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Stops the server (the catalog operator sees its connection drop).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for CatalogServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Does the work of the catalog operator's bundle unpack Jobs, which kwok marks complete without
/// running. Each such Job's pod copies the bundle image's files to /bundle (init containers
/// `util` and `pull`) and runs `opm alpha bundle extract -m /bundle/ -n NS -c NAME -z` as the
/// Job's ServiceAccount, which writes the bundle's manifests into the ConfigMap the catalog
/// operator reads. Here, for every Job it finds: the image the `pull` container names is pulled
/// from the registry and unpacked into a folder, and the `extract` container's own command is
/// run with the harness's opm (the release the Job's opm image is), `/bundle/` being that folder,
/// with a token of the Job's ServiceAccount (so the Role OLM made for the Job is its authority)
/// in a kubeconfig rather than the pod's mounted token. Stops when dropped.
pub struct BundleUnpacker {
    task: tokio::task::JoinHandle<()>,
    done: Arc<Mutex<BTreeSet<String>>>,
    errors: Arc<Mutex<Vec<String>>>,
}

impl BundleUnpacker {
    /// Starts watching `namespace` (the CatalogSource's, where OLM runs the Jobs).
    pub fn start(admin: &Client, tools: &Tools, namespace: &str) -> Self {
        let done = Arc::new(Mutex::new(BTreeSet::new()));
        let errors = Arc::new(Mutex::new(Vec::new()));
        let jobs: Api<Job> = Api::namespaced(admin.clone(), namespace);
        let (admin, tools, namespace) = (admin.clone(), tools.clone(), namespace.to_owned());
        let (task_done, task_errors) = (done.clone(), errors.clone());
        let task = tokio::spawn(async move {
            loop {
                let listed = jobs
                    .list(&ListParams::default().labels(BUNDLE_UNPACK_LABEL))
                    .await;
                for job in listed.map(|l| l.items).unwrap_or_default() {
                    let key = format!(
                        "{}/{}",
                        job.metadata.name.clone().unwrap_or_default(),
                        job.metadata.uid.clone().unwrap_or_default()
                    );
                    if task_done.lock().is_ok_and(|d| d.contains(&key)) {
                        continue;
                    }
                    match unpack(&admin, &tools, &namespace, &job).await {
                        Ok(()) => {
                            if let Ok(mut d) = task_done.lock() {
                                d.insert(key);
                            }
                        }
                        Err(e) => {
                            if let Ok(mut errors) = task_errors.lock() {
                                errors.push(format!("{key}: {e:#}"));
                            }
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        BundleUnpacker { task, done, errors }
    }

    /// The Jobs (`name/uid`) whose work was done.
    pub fn unpacked(&self) -> Vec<String> {
        self.done
            .lock()
            .map(|d| d.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// The failures so far (a Job is tried again on the next round).
    pub fn errors(&self) -> Vec<String> {
        self.errors.lock().map(|e| e.clone()).unwrap_or_default()
    }
}

impl Drop for BundleUnpacker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One unpack Job's work (see [`BundleUnpacker`]).
async fn unpack(admin: &Client, tools: &Tools, namespace: &str, job: &Job) -> Result<()> {
    let pod = job
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .context("the Job has no pod template")?;
    let bundle_image = pod
        .init_containers
        .iter()
        .flatten()
        .find(|c| c.name == "pull")
        .and_then(|c| c.image.clone())
        .context("no `pull` init container with an image")?;
    let extract = pod
        .containers
        .iter()
        .find(|c| c.name == "extract")
        .context("no `extract` container")?;
    let command = extract
        .command
        .clone()
        .context("the extract container has no command")?;
    anyhow::ensure!(
        command.first().is_some_and(|c| c == "opm"),
        "the extract container runs {command:?}, not opm"
    );
    let service_account = pod
        .service_account_name
        .clone()
        .context("the Job's pod names no ServiceAccount")?;

    let root = std::env::temp_dir().join(unique_name("bundle-unpack"));
    pull_image(tools, &bundle_image, &root)?;
    let bundle = format!("{}/", root.display());
    let args: Vec<String> = command[1..]
        .iter()
        .map(|a| {
            if a == "/bundle/" {
                bundle.clone()
            } else {
                a.clone()
            }
        })
        .collect();
    anyhow::ensure!(
        args.contains(&bundle),
        "the extract command {command:?} does not read /bundle/"
    );
    let token = crate::cluster::service_account_token(admin, namespace, &service_account).await?;
    let kubeconfig =
        write_token_kubeconfig(&format!("{namespace}-{service_account}-unpack"), &token)?;
    let mut run = Command::new(&tools.opm);
    run.args(&args).arg("--kubeconfig").arg(&kubeconfig);
    for var in extract.env.iter().flatten() {
        if let Some(value) = &var.value {
            run.env(&var.name, value);
        }
    }
    let out = run.output().context("running opm alpha bundle extract")?;
    let _ = std::fs::remove_file(&kubeconfig);
    let _ = std::fs::remove_dir_all(&root);
    anyhow::ensure!(
        out.status.success(),
        "opm {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
