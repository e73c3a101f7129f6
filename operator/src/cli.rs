//! Command line of the `gpu-operator` binary: argument parsing and dispatch (IO only through
//! the writer it is handed).
//!
//! Each subcommand is one variant of [`Command`] with its own `Args` struct and one arm in
//! [`Cli::run`]; adding `run`, `render` or `rbac` touches nothing else.

/// `gpu-operator cleanup`: finishes the teardown of a deleted ClusterPolicy without the operator.
pub mod cleanup;
/// `gpu-operator doctor` (and `kubectl gpu doctor`): read-only diagnosis of GPU pods and nodes.
pub mod doctor;
#[cfg(test)]
mod golden;
/// `gpu-operator migrate --from-nvidia`: takes over a fleet NVIDIA's operator runs.
pub mod migrate;
pub mod plan;

use std::io::Write;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use crate::api;

/// What `gpu-operator --version` prints after the name: the release and the git commit the
/// binary was built from (operator/build.rs; "unknown" when built without git metadata).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("GPU_OPERATOR_COMMIT"),
    ")"
);

/// The git commit of [`VERSION`].
pub const COMMIT: &str = env!("GPU_OPERATOR_COMMIT");

/// Kubernetes operator that rolls out the NVIDIA GPU software stack from one ClusterPolicy.
#[derive(Debug, Parser)]
#[command(name = "gpu-operator", version = VERSION, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the operator: watch ClusterPolicies and keep every GPU node's operands in place.
    Run(RunArgs),
    /// Print the CustomResourceDefinitions the operator serves, as YAML (apply with
    /// `kubectl apply --server-side -f -`).
    Crd(CrdArgs),
    /// Print every object the operator would apply for a ClusterPolicy, as multi-document
    /// YAML (for review and GitOps). Cluster facts come from the flags; no cluster is contacted
    /// and owner references are left out.
    Render(RenderArgs),
    /// Print the operator's ClusterRole `gpu-operator`: what the controller needs plus every
    /// permission it grants to operands (Kubernetes rejects grants the granter lacks).
    Rbac(RbacArgs),
    /// Why GPU pods stay Pending: a table of the GPU nodes and their faults, or, given a pod
    /// name, that pod's checklist, each fault with the command that fixes it. Reads only; exits 1
    /// when it finds a fault, 2 when it cannot run. Also `kubectl gpu doctor` through a
    /// `kubectl-gpu` link.
    Doctor(doctor::DoctorArgs),
    /// Finish the teardown of a deleted ClusterPolicy when no operator runs: take what the
    /// operator put on the nodes off them (its taints and labels, the GPU memory resource, the
    /// driver upgrade's labels and cordons), delete the node-pool PriorityClasses no pod uses,
    /// and remove the finalizer that holds ClusterPolicies in Terminating. Refuses while a
    /// ClusterPolicy that is not being deleted exists, or NVIDIA's operator is live.
    Cleanup(cleanup::CleanupArgs),
    /// Take over a fleet NVIDIA's GPU Operator runs, restarting nothing: prints the plan (every
    /// object touched, every pod it would restart, every field it would lose); `--apply` stops
    /// NVIDIA's operator and replaces its CRD. docs/migrate-from-nvidia.md.
    Migrate(migrate::MigrateArgs),
    /// What applying a ClusterPolicy will do, before it is applied: the objects that change,
    /// the DaemonSets whose pods roll and on how many nodes, the driver upgrade's cordons,
    /// evictions and waves, the node labels that change, and the operands whose input is
    /// invalid. Reads only (the policy is checked by a dry run). Also `kubectl gpu plan`.
    Plan(plan::PlanArgs),
    /// Print a shell completion script: `source <(gpu-operator completion bash)`, or save it
    /// where the shell loads completions from. For `kubectl gpu <TAB>` (kubectl 1.26 or later),
    /// link this binary as `kubectl_complete-gpu` on PATH beside `kubectl-gpu`.
    Completion(CompletionArgs),
}

/// Arguments of `gpu-operator completion`.
#[derive(Debug, Args)]
pub struct CompletionArgs {
    /// The shell to complete in.
    #[arg(value_enum)]
    pub shell: CompletionShell,
}

/// The shells `completion` writes scripts for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CompletionShell {
    Bash,
    Zsh,
    Fish,
}

impl From<CompletionShell> for clap_complete::Shell {
    fn from(shell: CompletionShell) -> Self {
        match shell {
            CompletionShell::Bash => clap_complete::Shell::Bash,
            CompletionShell::Zsh => clap_complete::Shell::Zsh,
            CompletionShell::Fish => clap_complete::Shell::Fish,
        }
    }
}

/// Arguments of `gpu-operator run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Namespace the operator runs in and deploys operands to.
    #[arg(long, env = "OPERATOR_NAMESPACE")]
    pub namespace: Option<String>,
    /// Address of the /metrics endpoint.
    #[arg(long, default_value = "127.0.0.1:8080", env = "METRICS_ADDR")]
    pub metrics_addr: std::net::SocketAddr,
    /// Serve /metrics over HTTPS to callers the API server authenticates (TokenReview) and
    /// allows `get` on the non-resource URL /metrics (SubjectAccessReview). `false` serves it
    /// over plain HTTP to anyone who can connect, as NVIDIA's operator does.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "METRICS_SECURE")]
    pub metrics_secure: bool,
    /// Folder holding the metrics certificate and key as `tls.crt` and `tls.key` (a mounted
    /// `kubernetes.io/tls` Secret); without it a self-signed certificate is made at start-up.
    #[arg(long, env = "METRICS_CERT_PATH")]
    pub metrics_cert_path: Option<std::path::PathBuf>,
    /// Address of the /healthz and /readyz probes (plain HTTP, no authentication).
    #[arg(long, default_value = "127.0.0.1:8081", env = "HEALTH_ADDR")]
    pub health_addr: std::net::SocketAddr,
    /// Hold a Lease so only one replica reconciles (turn off only for a single replica).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,
    /// Name of the leader-election Lease in the operator namespace. The generated Role lets
    /// the operator renew only the default one: another name needs a Role of its own.
    #[arg(long, default_value = crate::render::rbac::LEADER_LEASE)]
    pub lease_name: String,
    /// Namespace of the leader-election Lease (default: the operator namespace), as NVIDIA's
    /// `--leader-elect-namespace`. The operator then needs the leader-election Role there (the
    /// chart's `operator.leaseNamespace` places it).
    #[arg(long, alias = "leader-elect-namespace", env = "LEASE_NAMESPACE")]
    pub lease_namespace: Option<String>,
    /// Seconds a leader's Lease stays valid without renewal (a standby takes over after it).
    #[arg(long, default_value_t = 15)]
    pub lease_duration_seconds: u64,
    /// Identity in the Lease (default: POD_NAME, else hostname and pid).
    #[arg(long)]
    pub identity: Option<String>,
    /// Seconds a node's NFD GPU label must stay gone before the node is unmarked (NFD restarts
    /// remove and re-add labels).
    #[arg(long, default_value_t = 60)]
    pub gpu_label_grace_seconds: u64,
    /// Seconds one reconcile pass may run before it is abandoned (its requests cancelled) and
    /// retried with backoff.
    #[arg(long, default_value_t = 300)]
    pub pass_deadline_seconds: u64,
    /// Seconds work may wait with no reconcile pass completing before /healthz fails (a wedged
    /// loop; the kubelet then restarts the process). Keep it above the pass deadline plus the
    /// longest retry backoff (60 s).
    #[arg(long, default_value_t = 600)]
    pub stall_seconds: u64,
    /// Log as JSON lines (as in a cluster) instead of text.
    #[arg(long, env = "LOG_JSON")]
    pub json_logs: bool,
    /// At start-up, replace the served ClusterPolicy CRD with this operator's when it is ours
    /// and out of date (Helm never upgrades a chart's CRDs); a CRD of NVIDIA's operator or one
    /// written by a newer operator is left alone.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "UPGRADE_CRD")]
    pub upgrade_crd: bool,
    /// Namespaces where NVIDIA's GPU Operator may run (comma-separated): its leader Lease there
    /// stops this operator whoever holds it. Elsewhere the Lease counts only when its holder is
    /// a running pod whose ServiceAccount may update ClusterPolicies or patch nodes, so a
    /// namespace tenant cannot switch this operator off.
    #[arg(long, value_delimiter = ',', env = "NVIDIA_OPERATOR_NAMESPACES")]
    pub nvidia_operator_namespaces: Vec<String>,
}

/// Arguments of `gpu-operator crd`.
#[derive(Debug, Args)]
pub struct CrdArgs {
    /// Print the GPUCluster (nvidia.com/v1alpha1) CRD instead of the ClusterPolicy one.
    #[arg(long, conflicts_with = "nvidia_driver")]
    pub gpu_cluster: bool,
    /// Print the NVIDIADriver (nvidia.com/v1alpha1) CRD instead of the ClusterPolicy one.
    #[arg(long)]
    pub nvidia_driver: bool,
}

/// Container runtime of the GPU nodes, as `render` takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RuntimeArg {
    Containerd,
    #[value(name = "cri-o")]
    CriO,
    Docker,
}

impl From<RuntimeArg> for crate::facts::Runtime {
    fn from(arg: RuntimeArg) -> Self {
        match arg {
            RuntimeArg::Containerd => crate::facts::Runtime::Containerd,
            RuntimeArg::CriO => crate::facts::Runtime::CriO,
            RuntimeArg::Docker => crate::facts::Runtime::Docker,
        }
    }
}

/// Arguments of `gpu-operator render`.
#[derive(Debug, Args)]
pub struct RenderArgs {
    /// The ClusterPolicy, as a YAML file.
    #[arg(short = 'f', long = "filename", value_name = "POLICY")]
    pub file: std::path::PathBuf,
    /// Container runtime of the GPU nodes (default containerd; cri-o with --openshift).
    #[arg(long, value_enum)]
    pub runtime: Option<RuntimeArg>,
    /// Render for OpenShift (SecurityContextConstraints, CRI-O).
    #[arg(long)]
    pub openshift: bool,
    /// OS of the GPU nodes as NFD reports it, `<ID><VERSION_ID>` (for example ubuntu22.04):
    /// the driver image tag's suffix. Without it the driver is not rendered unless its image
    /// is pinned by digest.
    #[arg(long, value_name = "TAG")]
    pub os_tag: Option<String>,
    /// Namespace of the operator and its operands.
    #[arg(long, default_value = "gpu-operator")]
    pub namespace: String,
    /// Render ServiceMonitors as if the Prometheus Operator's API were served.
    #[arg(long)]
    pub service_monitor: bool,
    /// Render as if node-feature-discovery already ran (no NFD of our own).
    #[arg(long)]
    pub nfd_running: bool,
    /// The ConfigMap (YAML file) that devicePlugin.config.name names.
    #[arg(long, value_name = "FILE")]
    pub sharing_config: Option<std::path::PathBuf>,
    /// The ConfigMap (YAML file) that migManager.config.name names.
    #[arg(long, value_name = "FILE")]
    pub mig_config: Option<std::path::PathBuf>,
    /// The ConfigMap (YAML file) that dcgmExporter.config.name names.
    #[arg(long, value_name = "FILE")]
    pub dcgm_metrics: Option<std::path::PathBuf>,
    /// ConfigMaps (YAML files, several documents allowed), each used for whichever field of
    /// the policy names it; repeatable.
    #[arg(long = "config-map", value_name = "FILE")]
    pub config_maps: Vec<std::path::PathBuf>,
    /// The cluster's Nodes (YAML file, several documents allowed), whose labels decide what
    /// depends on the GPU nodes (precompiled driver pools by kernel, driver DaemonSets per OS).
    #[arg(long, value_name = "FILE")]
    pub nodes: Option<std::path::PathBuf>,
    /// OpenShift's `openshift/driver-toolkit` ImageStream (YAML file, as `oc get imagestream -n
    /// openshift driver-toolkit -o yaml` prints it): its tags are the Driver Toolkit images by
    /// RHCOS version, for `operator.use_ocp_driver_toolkit`; absent: no ImageStream.
    #[arg(long, value_name = "FILE")]
    pub driver_toolkit_imagestream: Option<std::path::PathBuf>,
}

/// Arguments of `gpu-operator rbac`.
#[derive(Debug, Args)]
pub struct RbacArgs {
    /// Place the Role in this namespace, and also print the ClusterRoleBinding and RoleBinding
    /// to ServiceAccount gpu-operator there.
    #[arg(long)]
    pub namespace: Option<String>,
}

fn read_yaml_documents<T: serde::de::DeserializeOwned>(
    path: &std::path::Path,
) -> anyhow::Result<Vec<T>> {
    use serde::Deserialize as _;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for document in serde_yaml_ng::Deserializer::from_str(&text) {
        let value = serde_yaml_ng::Value::deserialize(document)
            .with_context(|| format!("parsing {}", path.display()))?;
        if value.is_null() {
            continue;
        }
        out.push(
            serde_yaml_ng::from_value(value)
                .with_context(|| format!("parsing {}", path.display()))?,
        );
    }
    Ok(out)
}

fn read_one_config_map(
    path: Option<&std::path::Path>,
) -> anyhow::Result<Option<k8s_openapi::api::core::v1::ConfigMap>> {
    let Some(path) = path else { return Ok(None) };
    let mut docs = read_yaml_documents(path)?;
    anyhow::ensure!(
        docs.len() == 1,
        "{} must hold exactly one ConfigMap",
        path.display()
    );
    Ok(docs.pop())
}

impl RenderArgs {
    /// The policy and facts these arguments describe (reads the files).
    pub fn inputs(&self) -> anyhow::Result<(api::ClusterPolicy, crate::facts::ClusterFacts)> {
        use crate::render::inputs::{RenderOptions, facts_for};
        let mut policies: Vec<api::ClusterPolicy> = read_yaml_documents(&self.file)?;
        anyhow::ensure!(
            policies.len() == 1,
            "{} must hold exactly one ClusterPolicy",
            self.file.display()
        );
        let policy = policies.remove(0);
        let mut config_maps = Vec::new();
        for path in &self.config_maps {
            config_maps.extend(read_yaml_documents(path)?);
        }
        let options = RenderOptions {
            namespace: self.namespace.clone(),
            runtime: self.runtime.map(Into::into),
            openshift: self.openshift,
            os_tag: self.os_tag.clone(),
            service_monitor_api: self.service_monitor,
            nfd_running: self.nfd_running,
            sharing_config: read_one_config_map(self.sharing_config.as_deref())?,
            mig_config: read_one_config_map(self.mig_config.as_deref())?,
            dcgm_metrics: read_one_config_map(self.dcgm_metrics.as_deref())?,
            config_maps,
            nodes: match &self.nodes {
                Some(path) => read_yaml_documents(path)?,
                None => Vec::new(),
            },
            driver_toolkit: match &self.driver_toolkit_imagestream {
                Some(path) => {
                    let mut docs: Vec<serde_json::Value> = read_yaml_documents(path)?;
                    anyhow::ensure!(
                        docs.len() == 1,
                        "{} must hold exactly one ImageStream",
                        path.display()
                    );
                    docs.pop()
                }
                None => None,
            },
        };
        let facts = facts_for(&policy, &options)?;
        Ok((policy, facts))
    }
}

/// What `gpu-operator rbac` prints: the operator's ClusterRole and its Role (for the operator
/// namespace) and, given a namespace, the Role placed there and both bindings to ServiceAccount
/// gpu-operator there. The chart's ClusterRole and Role are this output under templated headers
/// (`cargo xtask generate`, xtask/src/generated.rs).
pub fn rbac_yaml(namespace: Option<&str>) -> anyhow::Result<String> {
    use crate::render::rbac;
    let mut documents = vec![
        serde_yaml_ng::to_string(&rbac::operator_cluster_role())
            .context("serialising the ClusterRole")?,
        serde_yaml_ng::to_string(&rbac::operator_role(namespace))
            .context("serialising the Role")?,
        serde_yaml_ng::to_string(&rbac::leader_election_role(namespace))
            .context("serialising the leader-election Role")?,
    ];
    if let Some(namespace) = namespace {
        documents.push(
            serde_yaml_ng::to_string(&rbac::operator_cluster_role_binding(namespace))
                .context("serialising the ClusterRoleBinding")?,
        );
        documents.push(
            serde_yaml_ng::to_string(&rbac::operator_role_binding(namespace))
                .context("serialising the RoleBinding")?,
        );
        documents.push(
            serde_yaml_ng::to_string(&rbac::leader_election_role_binding(namespace, namespace))
                .context("serialising the leader-election RoleBinding")?,
        );
    }
    Ok(documents.join("---\n"))
}

/// The name kubectl finds a plugin by: `kubectl gpu ...` runs `kubectl-gpu ...`.
pub const KUBECTL_PLUGIN: &str = "kubectl-gpu";

/// The name kubectl (1.26 and later) runs to complete `kubectl gpu <TAB>`: it passes the words
/// after `gpu`, the last being the one to complete (maybe empty), and reads one candidate a line
/// (`value<TAB>description`), then `:<directive>` as cobra defines it.
pub const KUBECTL_PLUGIN_COMPLETION: &str = "kubectl_complete-gpu";

/// Cobra's directive for "complete these, and no file names".
const COBRA_NO_FILE_COMPLETION: u8 = 4;
/// Cobra's directive for "the shell's default completion" (file names).
const COBRA_DEFAULT: u8 = 0;

/// The process's name, without its folder.
fn invoked_as() -> String {
    let argv0 = std::env::args_os().next().unwrap_or_default();
    std::path::Path::new(&argv0)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_owned()
}

/// Whether this process was started as [`KUBECTL_PLUGIN_COMPLETION`].
pub fn invoked_for_kubectl_completion() -> bool {
    invoked_as() == KUBECTL_PLUGIN_COMPLETION
}

/// What [`KUBECTL_PLUGIN_COMPLETION`] prints for `words` (after `kubectl gpu`; the last is the
/// word being completed): subcommands, flags of the subcommand reached, or a flag's values.
pub fn kubectl_plugin_completions(words: &[String]) -> String {
    use clap::CommandFactory;
    let root = Cli::command();
    let (to_complete, before) = match words.split_last() {
        Some((last, before)) => (last.as_str(), before),
        None => ("", &[][..]),
    };
    let mut command = &root;
    let mut pending_value: Option<&clap::Arg> = None;
    let mut positionals = 0;
    for word in before {
        if pending_value.take().is_some() {
            continue;
        }
        if let Some(flag) = word.strip_prefix("--") {
            let (name, inline) = flag
                .split_once('=')
                .map_or((flag, false), |(n, _)| (n, true));
            let arg = command.get_arguments().find(|a| a.get_long() == Some(name));
            if !inline && arg.is_some_and(takes_value) {
                pending_value = arg;
            }
        } else if let Some(short) = word.strip_prefix('-').filter(|s| s.chars().count() == 1) {
            let c = short.chars().next();
            let arg = command.get_arguments().find(|a| a.get_short() == c);
            if arg.is_some_and(takes_value) {
                pending_value = arg;
            }
        } else if let Some(sub) = command.find_subcommand(word) {
            command = sub;
            positionals = 0;
        } else {
            positionals += 1;
        }
    }
    let mut lines: Vec<String> = Vec::new();
    let mut directive = COBRA_NO_FILE_COMPLETION;
    let values = |arg: &clap::Arg, lines: &mut Vec<String>| -> bool {
        let possible = arg.get_possible_values();
        for v in possible.iter().filter(|v| !v.is_hide_set()) {
            if v.get_name().starts_with(to_complete) {
                lines.push(with_help(v.get_name(), v.get_help()));
            }
        }
        !possible.is_empty()
    };
    if let Some(arg) = pending_value {
        if !values(arg, &mut lines) {
            // A free value (a path, a name): the shell's own completion.
            directive = COBRA_DEFAULT;
        }
    } else if to_complete.starts_with('-') {
        for arg in command.get_arguments().filter(|a| !a.is_hide_set()) {
            if let Some(long) = arg.get_long() {
                let flag = format!("--{long}");
                if flag.starts_with(to_complete) {
                    lines.push(with_help(&flag, arg.get_help()));
                }
            }
        }
        if !command.is_disable_help_flag_set() && "--help".starts_with(to_complete) {
            lines.push("--help\tPrint help".into());
        }
    } else if command.has_subcommands() {
        for sub in command.get_subcommands().filter(|c| !c.is_hide_set()) {
            if sub.get_name().starts_with(to_complete) {
                lines.push(with_help(sub.get_name(), sub.get_about()));
            }
        }
    } else if let Some(arg) = command.get_positionals().nth(positionals)
        && !values(arg, &mut lines)
    {
        // A free positional (a pod name, a file): the shell's own completion.
        directive = COBRA_DEFAULT;
    }
    let mut out = String::new();
    for line in lines {
        out.push_str(&line);
        out.push('\n');
    }
    out.push_str(&format!(":{directive}\n"));
    out
}

fn takes_value(arg: &clap::Arg) -> bool {
    arg.get_action().takes_values()
}

fn with_help(value: &str, help: Option<&clap::builder::StyledStr>) -> String {
    match help.map(|h| h.to_string()) {
        Some(h) if !h.is_empty() => {
            let first = h.lines().next().unwrap_or_default();
            let first = first.split(". ").next().unwrap_or(first);
            format!("{value}\t{}", first.trim_end_matches('.'))
        }
        _ => value.to_owned(),
    }
}

/// The exit status for an error [`Cli::run`] returned: the doctor's own
/// ([`doctor::Failure::exit_code`]), else 1.
pub fn exit_code(error: &anyhow::Error) -> u8 {
    error
        .downcast_ref::<doctor::Failure>()
        .map_or(1, doctor::Failure::exit_code)
}

impl Cli {
    /// Parses the process arguments; invoked as [`KUBECTL_PLUGIN`] (a link to this binary),
    /// help and errors name it `kubectl gpu`.
    pub fn parse_args() -> Self {
        use clap::{CommandFactory, FromArgMatches};
        let mut command = Cli::command();
        if invoked_as() == KUBECTL_PLUGIN {
            command = command.name("kubectl gpu").bin_name("kubectl gpu");
        }
        let matches = command.get_matches();
        Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    }

    /// Runs the parsed command, writing its output to `out` and warnings to standard error.
    pub fn run(self, out: &mut dyn Write) -> anyhow::Result<()> {
        self.run_with(out, &mut std::io::stderr())
    }

    /// Runs the parsed command, writing its output to `out` and warnings to `err`.
    pub fn run_with(self, out: &mut dyn Write, err: &mut dyn Write) -> anyhow::Result<()> {
        match self.command {
            Command::Run(args) => {
                let options = crate::run::RunOptions {
                    namespace: args.namespace,
                    metrics_addr: args.metrics_addr,
                    metrics_secure: args.metrics_secure,
                    metrics_cert_path: args.metrics_cert_path,
                    health_addr: args.health_addr,
                    leader_elect: args.leader_elect,
                    lease_name: args.lease_name,
                    lease_namespace: args.lease_namespace.filter(|n| !n.is_empty()),
                    lease_duration: std::time::Duration::from_secs(args.lease_duration_seconds),
                    identity: args.identity,
                    gpu_label_grace: std::time::Duration::from_secs(args.gpu_label_grace_seconds),
                    pass_deadline: std::time::Duration::from_secs(args.pass_deadline_seconds),
                    stall: std::time::Duration::from_secs(args.stall_seconds),
                    json_logs: args.json_logs,
                    upgrade_crd: args.upgrade_crd,
                    nvidia_operator_namespaces: args
                        .nvidia_operator_namespaces
                        .into_iter()
                        .map(|n| n.trim().to_owned())
                        .filter(|n| !n.is_empty())
                        .collect(),
                };
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .context("starting the async runtime")?;
                runtime.block_on(crate::run::run(options))
            }
            Command::Crd(CrdArgs {
                gpu_cluster,
                nvidia_driver,
            }) => {
                let yaml = if gpu_cluster {
                    api::gpu_cluster_crd::crd_yaml().context("serialising the GPUCluster CRD")?
                } else if nvidia_driver {
                    api::nvidia_driver_crd::crd_yaml()
                        .context("serialising the NVIDIADriver CRD")?
                } else {
                    api::crd::crd_yaml().context("serialising the ClusterPolicy CRD")?
                };
                out.write_all(yaml.as_bytes())
                    .context("writing the CRD to standard output")?;
                Ok(())
            }
            Command::Render(args) => {
                let (policy, facts) = args.inputs()?;
                for warning in render_warnings(&policy, &facts) {
                    writeln!(err, "warning: {warning}").context("writing to standard error")?;
                }
                let yaml = crate::render::inputs::render_yaml(&policy, &facts)
                    .context("serialising the rendered objects")?;
                out.write_all(yaml.as_bytes())
                    .context("writing the objects to standard output")?;
                Ok(())
            }
            Command::Rbac(RbacArgs { namespace }) => {
                let yaml = rbac_yaml(namespace.as_deref())?;
                out.write_all(yaml.as_bytes())
                    .context("writing the ClusterRole to standard output")?;
                Ok(())
            }
            Command::Doctor(args) => doctor::run(&args, out),
            Command::Cleanup(args) => cleanup::run(&args, out),
            Command::Migrate(args) => migrate::run(&args, out),
            Command::Plan(args) => plan::run(&args, out),
            Command::Completion(CompletionArgs { shell }) => {
                use clap::CommandFactory;
                let name = if invoked_as() == KUBECTL_PLUGIN {
                    KUBECTL_PLUGIN
                } else {
                    "gpu-operator"
                };
                let mut command = Cli::command();
                clap_complete::generate(clap_complete::Shell::from(shell), &mut command, name, out);
                Ok(())
            }
        }
    }
}

/// What `render` leaves out and why, for standard error (standard output, often piped to
/// `kubectl apply`, carries the same as YAML comments nobody reads): each operand not rendered
/// for invalid input, and for the driver without an OS the flag that supplies it.
pub fn render_warnings(
    policy: &api::ClusterPolicy,
    facts: &crate::facts::ClusterFacts,
) -> Vec<String> {
    use crate::render::{Outcome, render};
    let state = render(&crate::validate::validate(policy, facts), facts);
    let mut out = Vec::new();
    for operand in &state.operands {
        let Outcome::Invalid(message) = &operand.outcome else {
            continue;
        };
        let name = operand.operand.name();
        let mut line = format!("{name} not rendered: {}", message.replace('\n', " "));
        if name == "driver" && facts.os_tag.is_none() {
            line.push_str(
                "; pass --os-tag <ID><VERSION_ID>, the GPU nodes' OS as NFD reports it (for \
                 example --os-tag ubuntu22.04), or --nodes with their Node objects",
            );
        }
        out.push(line);
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn version_names_the_release_and_the_commit() {
        let err = Cli::try_parse_from(["gpu-operator", "--version"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::DisplayVersion);
        let printed = err.render().to_string();
        assert_eq!(
            printed,
            format!(
                "gpu-operator {} (commit {COMMIT})\n",
                env!("CARGO_PKG_VERSION")
            )
        );
        assert!(
            COMMIT == "unknown"
                || (COMMIT.len() >= 7 && COMMIT.bytes().all(|b| b.is_ascii_hexdigit())),
            "the commit is neither a git hash nor \"unknown\": {COMMIT:?}"
        );
    }

    /// Packaging (the OLM bundle, the chart's generated files) is `cargo xtask`'s, not the
    /// operator binary's: the binary holds only what users run.
    #[test]
    fn the_subcommands_are_the_user_facing_ones() {
        let names: Vec<String> = Cli::command()
            .get_subcommands()
            .map(|c| c.get_name().to_owned())
            .collect();
        assert_eq!(
            names,
            [
                "run",
                "crd",
                "render",
                "rbac",
                "doctor",
                "cleanup",
                "migrate",
                "plan",
                "completion"
            ]
        );
    }

    fn printed(args: &[&str]) -> (String, String) {
        let cli = Cli::try_parse_from(std::iter::once("gpu-operator").chain(args.iter().copied()))
            .unwrap();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        cli.run_with(&mut out, &mut err).unwrap();
        (
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        )
    }

    #[test]
    fn completion_scripts_complete_the_subcommands_and_the_doctors_flags() {
        let (bash, _) = printed(&["completion", "bash"]);
        assert!(
            bash.contains("complete -F") && bash.contains("gpu-operator"),
            "{bash}"
        );
        let (zsh, _) = printed(&["completion", "zsh"]);
        assert!(zsh.starts_with("#compdef gpu-operator"), "{zsh}");
        let (fish, _) = printed(&["completion", "fish"]);
        assert!(fish.contains("complete -c gpu-operator"), "{fish}");
        for script in [&bash, &zsh, &fish] {
            for word in ["doctor", "render", "kubeconfig", "output", "json"] {
                assert!(script.contains(word), "{word} missing:\n{script}");
            }
        }
        assert!(Cli::try_parse_from(["gpu-operator", "completion", "powershell"]).is_err());
    }

    fn kubectl_complete(words: &[&str]) -> Vec<String> {
        let words: Vec<String> = words.iter().map(|w| (*w).to_owned()).collect();
        kubectl_plugin_completions(&words)
            .lines()
            .map(|l| l.split('\t').next().unwrap_or_default().to_owned())
            .collect()
    }

    #[test]
    fn kubectl_plugin_completion_offers_subcommands_flags_and_values_as_cobra_reads_them() {
        let top = kubectl_complete(&[""]);
        assert!(top.contains(&"doctor".to_owned()) && top.contains(&"render".to_owned()));
        assert_eq!(top.last().unwrap(), ":4");
        assert_eq!(kubectl_complete(&["do"]), ["doctor", ":4"]);
        assert_eq!(
            kubectl_complete(&["doctor", "-o", ""]),
            ["text", "json", "yaml", ":4"]
        );
        assert_eq!(
            kubectl_complete(&["doctor", "--output", "j"]),
            ["json", ":4"]
        );
        assert_eq!(
            kubectl_complete(&["doctor", "--kube"]),
            ["--kubeconfig", ":4"]
        );
        // A path or a name: the shell's own completion (cobra's default directive).
        assert_eq!(kubectl_complete(&["doctor", "--kubeconfig", ""]), [":0"]);
        assert_eq!(kubectl_complete(&["doctor", "-n", "ml", ""]), [":0"]);
        assert_eq!(
            kubectl_complete(&["completion", ""]),
            ["bash", "zsh", "fish", ":4"]
        );
        let line = kubectl_plugin_completions(&["doc".to_owned()]);
        assert!(
            line.starts_with("doctor\tWhy GPU pods stay Pending"),
            "{line}"
        );
    }

    #[test]
    fn render_without_an_os_says_on_stderr_that_the_driver_is_left_out_and_names_the_flag() {
        let policy = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../examples/clusterpolicy-default.yaml"
        );
        let (out, err) = printed(&["render", "-f", policy]);
        assert!(
            err.starts_with("warning: driver not rendered: ") && err.contains("--os-tag"),
            "{err}"
        );
        assert!(!out.contains("name: nvidia-driver-daemonset\n"), "{out}");
        let (out, err) = printed(&["render", "-f", policy, "--os-tag", "ubuntu22.04"]);
        assert_eq!(err, "");
        assert!(out.contains("name: nvidia-driver-daemonset\n"));
    }

    #[test]
    fn crd_subcommand_prints_the_committed_crd() {
        let cli = Cli::try_parse_from(["gpu-operator", "crd"]).unwrap();
        let mut out = Vec::new();
        cli.run(&mut out).unwrap();
        let printed = String::from_utf8(out).unwrap();
        assert_eq!(printed, api::crd::crd_yaml().unwrap());
        assert!(printed.contains("name: clusterpolicies.nvidia.com"));
    }
}
