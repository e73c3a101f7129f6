//! OpenShift support against the harness with OpenShift's API types installed: the
//! SecurityContextConstraints and ClusterVersion CRDs of `tests/cluster/manifests/openshift/`
//! (written from the public API definitions). The operator detects OpenShift once, at start-up,
//! from the ClusterVersion API; it then creates an SCC per privileged operand, which the API
//! server must accept against the real schema, grants the other operands `use` of the built-in
//! `privileged` SCC, configures the toolkit for CRI-O, and the policy becomes ready. Without
//! those APIs nothing of that is rendered or even requested.
//!
//! Nothing upstream enforces SCCs, so every operand pod is checked here against the SCC that
//! admits it: host namespaces, host ports, privileged containers, volume types, host paths,
//! added capabilities, fixed UIDs and SELinux options (the strategies of OpenShift's SCC
//! admission that our operands touch).
//!
//! Every other test binary on the shared harness starts operators that probe for OpenShift, so
//! the CRDs are removed again (and awaited until no longer served) whether the test passes or
//! fails, and leftovers of an interrupted run are removed first.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};

use e2e::audit::AuditLog;
use e2e::openshift;
use e2e::session::{self, Setup, TIMEOUT};
use e2e::wait;
use gpu_operator::api::State;
use gpu_operator::operands::openshift::{SCC_ANNOTATION, scc_api_resource};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Container, PodSpec};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, DynamicObject, ListParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

/// The operator's generated ClusterRole, under a name of this test's own.
const OPERATOR_ROLE: &str = "gpu-operator-e2e-openshift";
const MANAGED: &str = "app.kubernetes.io/managed-by=gpu-operator";

/// The SCCs of docs/operand-facts.md §16: name (= the operand's ServiceAccount), then whether it admits
/// host PID, host IPC, host network and host ports. Exactly these, no more.
const EXPECTED_SCCS: [(&str, [bool; 4]); 7] = [
    ("nvidia-driver", [true, false, false, false]),
    ("nvidia-operator-validator", [true, false, false, false]),
    ("nvidia-gpu-feature-discovery", [true, false, false, false]),
    ("nvidia-dcgm", [false, false, true, true]),
    ("nvidia-dcgm-exporter", [false, false, false, true]),
    ("nvidia-mig-manager", [true, true, false, false]),
    ("nvidia-node-status-exporter", [false, false, false, false]),
];

/// The `openshift.io/scc` annotation each operand DaemonSet carries (docs/operand-facts.md §18.24);
/// absent for the validator, GFD and mig-manager.
const SCC_ANNOTATIONS: [(&str, Option<&str>); 9] = [
    ("nvidia-driver-daemonset", Some("nvidia-driver")),
    (
        "nvidia-container-toolkit-daemonset",
        Some("hostmount-anyuid"),
    ),
    ("nvidia-device-plugin-daemonset", Some("hostmount-anyuid")),
    ("nvidia-dcgm", Some("hostmount-anyuid")),
    ("nvidia-dcgm-exporter", Some("nvidia-dcgm-exporter")),
    (
        "nvidia-node-status-exporter",
        Some("nvidia-node-status-exporter"),
    ),
    ("nvidia-operator-validator", None),
    ("gpu-feature-discovery", None),
    ("nvidia-mig-manager", None),
];

/// Workloads that no SCC available to them admits on OpenShift (none: NFD's worker, which
/// mounts host paths, uses the privileged SCC). The test fails when one appears.
const KNOWN_UNADMITTED: [&str; 0] = [];

fn scc_api(client: &Client) -> Api<DynamicObject> {
    Api::all_with(client.clone(), &scc_api_resource())
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn all_containers(pod: &PodSpec) -> impl Iterator<Item = &Container> {
    pod.init_containers.iter().flatten().chain(&pod.containers)
}

/// What `pod` asks for that `scc` does not allow (empty: the SCC admits the pod).
fn scc_refusals(scc: &Value, pod: &PodSpec) -> Vec<String> {
    let mut refused = Vec::new();
    let allows = |field: &str| scc[field].as_bool() == Some(true);
    for (asked, field, what) in [
        (pod.host_pid, "allowHostPID", "hostPID"),
        (pod.host_ipc, "allowHostIPC", "hostIPC"),
        (pod.host_network, "allowHostNetwork", "hostNetwork"),
    ] {
        if asked == Some(true) && !allows(field) {
            refused.push(what.to_owned());
        }
    }
    let allowed_caps = strings(&scc["allowedCapabilities"]);
    let volumes = strings(&scc["volumes"]);
    let uid_any = scc["runAsUser"]["type"] == "RunAsAny";
    let selinux_any = scc["seLinuxContext"]["type"] == "RunAsAny";
    // Unset means true in the SCC API.
    let escalation = scc["allowPrivilegeEscalation"].as_bool() != Some(false);
    if pod
        .security_context
        .as_ref()
        .is_some_and(|s| s.run_as_user.is_some())
        && !uid_any
    {
        refused.push("pod runAsUser".to_owned());
    }
    for c in all_containers(pod) {
        let name = &c.name;
        if c.ports
            .iter()
            .flatten()
            .any(|p| p.host_port.unwrap_or(0) > 0)
            && !allows("allowHostPorts")
        {
            refused.push(format!("{name}: hostPort"));
        }
        let Some(sc) = c.security_context.as_ref() else {
            continue;
        };
        if sc.privileged == Some(true) && !allows("allowPrivilegedContainer") {
            refused.push(format!("{name}: privileged"));
        }
        if (sc.privileged == Some(true) || sc.allow_privilege_escalation == Some(true))
            && !escalation
        {
            refused.push(format!("{name}: privilege escalation"));
        }
        if sc.run_as_user.is_some() && !uid_any {
            refused.push(format!("{name}: runAsUser {:?}", sc.run_as_user));
        }
        if sc.se_linux_options.is_some() && !selinux_any {
            refused.push(format!("{name}: seLinuxOptions"));
        }
        for cap in sc
            .capabilities
            .as_ref()
            .and_then(|c| c.add.as_ref())
            .into_iter()
            .flatten()
        {
            if !allowed_caps.iter().any(|a| a == "*" || a == cap) {
                refused.push(format!("{name}: capability {cap}"));
            }
        }
    }
    for volume in pod.volumes.iter().flatten() {
        let value = serde_json::to_value(volume).unwrap();
        let kind = value
            .as_object()
            .unwrap()
            .keys()
            .find(|k| *k != "name")
            .cloned()
            .unwrap_or_default();
        if !volumes.iter().any(|v| v == "*" || *v == kind) {
            refused.push(format!("volume {} ({kind})", volume.name));
        }
        if kind == "hostPath" && !allows("allowHostDirVolumePlugin") {
            refused.push(format!("volume {} (host directory)", volume.name));
        }
    }
    refused
}

/// What OpenShift's default `restricted-v2` SCC (every authenticated user may use it) refuses
/// in `pod`: host access, privilege, fixed UIDs, SELinux options, added capabilities other
/// than NET_BIND_SERVICE, volume types outside its list.
fn restricted_v2_refusals(pod: &PodSpec) -> Vec<String> {
    let restricted = json!({
        "allowHostPID": false, "allowHostIPC": false, "allowHostNetwork": false,
        "allowHostPorts": false, "allowPrivilegedContainer": false,
        "allowPrivilegeEscalation": false, "allowHostDirVolumePlugin": false,
        "allowedCapabilities": ["NET_BIND_SERVICE"],
        "runAsUser": {"type": "MustRunAsRange"}, "seLinuxContext": {"type": "MustRunAs"},
        "volumes": ["configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                    "persistentVolumeClaim", "projected", "secret"],
    });
    scc_refusals(&restricted, pod)
}

/// Whether a Role bound to ServiceAccount `sa` in `namespace` grants `use` of SCC `scc`.
fn may_use_scc(
    roles: &[Role],
    bindings: &[RoleBinding],
    namespace: &str,
    sa: &str,
    scc: &str,
) -> bool {
    bindings
        .iter()
        .filter(|b| {
            b.subjects.iter().flatten().any(|s| {
                s.kind == "ServiceAccount"
                    && s.name == sa
                    && s.namespace.as_deref().unwrap_or(namespace) == namespace
            })
        })
        .filter(|b| b.role_ref.kind == "Role")
        .filter_map(|b| roles.iter().find(|r| r.name_any() == b.role_ref.name))
        .flat_map(|r| r.rules.iter().flatten())
        .any(|rule| {
            rule.api_groups
                .iter()
                .flatten()
                .any(|g| g == "security.openshift.io")
                && rule
                    .resources
                    .iter()
                    .flatten()
                    .any(|r| r == "securitycontextconstraints")
                && rule.verbs.iter().any(|v| v == "use")
                && rule
                    .resource_names
                    .as_ref()
                    .is_none_or(|names| names.is_empty() || names.iter().any(|n| n == scc))
        })
}

fn env_of(pod: &PodSpec, container: &str) -> BTreeMap<String, String> {
    pod.containers
        .iter()
        .find(|c| c.name == container)
        .unwrap_or_else(|| panic!("no container {container}"))
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
        .collect()
}

fn host_paths(pod: &PodSpec) -> BTreeSet<String> {
    pod.volumes
        .iter()
        .flatten()
        .filter_map(|v| v.host_path.as_ref().map(|h| h.path.clone()))
        .collect()
}

fn pod_of(ds: &DaemonSet) -> &PodSpec {
    ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap()
}

/// The toolkit DaemonSet and its main container's environment.
async fn toolkit(setup: &Setup) -> (PodSpec, BTreeMap<String, String>) {
    let ds = setup
        .daemonsets()
        .get("nvidia-container-toolkit-daemonset")
        .await
        .unwrap();
    let pod = pod_of(&ds).clone();
    let env = env_of(&pod, "nvidia-container-toolkit-ctr");
    (pod, env)
}

#[tokio::test]
async fn on_openshift_the_operator_creates_sccs_the_api_server_accepts_and_the_policy_becomes_ready()
 {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    openshift::run_on_simulated_openshift(&admin, OPERATOR_ROLE, openshift_steps(&admin)).await;
}

async fn openshift_steps(admin: &Client) {
    // DCGM and the node-status exporter on: every operand with an SCC of its own is rendered.
    let setup = openshift::start_with_generated_role(
        OPERATOR_ROLE,
        json!({"dcgm": {"enabled": true}, "nodeStatusExporter": {"enabled": true}}),
    )
    .await;
    let ready = setup
        .await_state(State::Ready, "policy ready on OpenShift")
        .await;
    let log = setup.operator.log_text();
    assert!(
        log.contains("openshift: true"),
        "the operator did not report OpenShift at start-up:\n{log}"
    );
    let namespace = setup.identity.namespace.clone();
    let policy_uid = ready.uid().unwrap();

    // The operator namespace admits the privileged operand pods (Pod Security labels).
    let ns_labels = Api::<k8s_openapi::api::core::v1::Namespace>::all(admin.clone())
        .get(&namespace)
        .await
        .unwrap()
        .metadata
        .labels
        .unwrap_or_default();
    for mode in ["enforce", "audit", "warn"] {
        assert_eq!(
            ns_labels
                .get(&format!("pod-security.kubernetes.io/{mode}"))
                .map(String::as_str),
            Some("privileged"),
            "namespace {namespace} labels: {ns_labels:?}"
        );
    }

    // The SCCs, as the API server stored them (it rejects one that lacks a required field and
    // prunes a misspelt one).
    let sccs: BTreeMap<String, Value> = scc_api(admin)
        .list(&ListParams::default().labels(MANAGED))
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|o| {
            let owners = o.owner_references().to_vec();
            assert!(
                owners
                    .iter()
                    .any(|r| r.uid == policy_uid && r.controller == Some(true)),
                "SCC {} is not owned by the policy: {owners:?}",
                o.name_any()
            );
            (o.name_any(), o.data)
        })
        .collect();
    assert_eq!(
        sccs.keys().map(String::as_str).collect::<BTreeSet<_>>(),
        EXPECTED_SCCS
            .iter()
            .map(|(n, _)| *n)
            .collect::<BTreeSet<_>>(),
        "SCCs created"
    );
    for (name, [pid, ipc, network, ports]) in EXPECTED_SCCS {
        let scc = &sccs[name];
        let flags = [
            "allowHostPID",
            "allowHostIPC",
            "allowHostNetwork",
            "allowHostPorts",
        ]
        .map(|f| {
            scc[f]
                .as_bool()
                .unwrap_or_else(|| panic!("{name}: {f} not stored"))
        });
        assert_eq!(
            flags,
            [pid, ipc, network, ports],
            "{name}: host PID, IPC, network, ports"
        );
        assert_eq!(scc["allowPrivilegedContainer"], true, "{name}");
        assert_eq!(scc["allowHostDirVolumePlugin"], true, "{name}");
        assert_eq!(scc["readOnlyRootFilesystem"], false, "{name}");
        assert_eq!(
            strings(&scc["users"]),
            [format!("system:serviceaccount:{namespace}:{name}")],
            "{name}: the operand's ServiceAccount, and only it"
        );
        for strategy in [
            "runAsUser",
            "seLinuxContext",
            "fsGroup",
            "supplementalGroups",
        ] {
            assert_eq!(scc[strategy]["type"], "RunAsAny", "{name}: {strategy}");
        }
    }

    // Every operand pod is admitted by an SCC its ServiceAccount may use: its own SCC (named in
    // the SCC's users), the built-in `privileged` one (a Role grant), or restricted-v2.
    let roles = Api::<Role>::namespaced(admin.clone(), &namespace)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    let bindings = Api::<RoleBinding>::namespaced(admin.clone(), &namespace)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    let daemon_sets = setup
        .daemonsets()
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;

    // The driver gets OpenShift's major.minor, read from the ClusterVersion, as NVIDIA's does.
    let driver = daemon_sets
        .iter()
        .find(|d| d.name_any().starts_with("nvidia-driver-daemonset"))
        .expect("no driver DaemonSet on OpenShift");
    let main = pod_of(driver)
        .containers
        .iter()
        .find(|c| c.name == "nvidia-driver-ctr")
        .expect("no driver container");
    let openshift_version = main
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "OPENSHIFT_VERSION")
        .and_then(|e| e.value.clone());
    assert_eq!(
        openshift_version.as_deref(),
        Some("4.20"),
        "{}: OPENSHIFT_VERSION from ClusterVersion {}",
        driver.name_any(),
        openshift::OPENSHIFT_RELEASE
    );
    let deployments = Api::<Deployment>::namespaced(admin.clone(), &namespace)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    let workloads: Vec<(String, PodSpec)> = daemon_sets
        .iter()
        .map(|d| (format!("DaemonSet/{}", d.name_any()), pod_of(d).clone()))
        .chain(deployments.iter().map(|d| {
            let pod = d.spec.as_ref().unwrap().template.spec.clone().unwrap();
            (format!("Deployment/{}", d.name_any()), pod)
        }))
        .collect();
    let mut own_scc = BTreeSet::new();
    let mut unadmitted = BTreeSet::new();
    for (workload, pod) in &workloads {
        let sa = pod.service_account_name.clone().unwrap_or_default();
        let user = format!("system:serviceaccount:{namespace}:{sa}");
        if let Some((name, scc)) = sccs
            .iter()
            .find(|(_, scc)| strings(&scc["users"]).contains(&user))
        {
            let refused = scc_refusals(scc, pod);
            assert!(
                refused.is_empty(),
                "{workload} runs as {sa}, whose SCC {name} does not admit: {refused:?}"
            );
            own_scc.insert(name.clone());
        } else if may_use_scc(&roles, &bindings, &namespace, &sa, "privileged") {
            // privileged admits everything.
        } else if !restricted_v2_refusals(pod).is_empty() {
            unadmitted.insert(workload.clone());
        }
    }
    assert_eq!(
        own_scc.iter().map(String::as_str).collect::<BTreeSet<_>>(),
        EXPECTED_SCCS
            .iter()
            .map(|(n, _)| *n)
            .collect::<BTreeSet<_>>(),
        "every SCC admits a running operand"
    );
    assert_eq!(
        unadmitted
            .iter()
            .map(String::as_str)
            .collect::<BTreeSet<_>>(),
        KNOWN_UNADMITTED.into_iter().collect::<BTreeSet<_>>(),
        "workloads no available SCC admits"
    );
    for name in [
        "nvidia-container-toolkit-daemonset",
        "nvidia-device-plugin-daemonset",
    ] {
        let ds = daemon_sets.iter().find(|d| d.name_any() == name).unwrap();
        let sa = pod_of(ds).service_account_name.clone().unwrap();
        assert!(
            may_use_scc(&roles, &bindings, &namespace, &sa, "privileged"),
            "{name} has no SCC of its own and its ServiceAccount {sa} may not use privileged"
        );
    }

    for (name, scc) in SCC_ANNOTATIONS {
        let ds = daemon_sets
            .iter()
            .find(|d| d.name_any() == name)
            .unwrap_or_else(|| panic!("DaemonSet {name} not rendered"));
        assert_eq!(
            ds.annotations().get(SCC_ANNOTATION).map(String::as_str),
            scc,
            "{name}: {SCC_ANNOTATION}"
        );
    }

    // CRI-O paths for the toolkit, although the fake nodes report containerd: OpenShift always
    // runs CRI-O.
    let (pod, env) = toolkit(&setup).await;
    assert_eq!(env.get("RUNTIME").map(String::as_str), Some("crio"));
    assert_eq!(
        env.get("CRIO_CONFIG_MODE").map(String::as_str),
        Some("config")
    );
    assert!(
        !env.keys().any(|k| k.starts_with("CONTAINERD_")),
        "containerd settings on OpenShift: {env:?}"
    );
    let paths = host_paths(&pod);
    for path in [
        "/etc/crio",
        "/etc/crio/crio.conf.d",
        "/run/containers/oci/hooks.d",
    ] {
        assert!(
            paths.contains(path),
            "toolkit lacks host path {path}: {paths:?}"
        );
    }
    assert!(
        !paths.iter().any(|p| p.contains("containerd")),
        "containerd host paths on OpenShift: {paths:?}"
    );

    // Disabling an operand removes its SCC with its DaemonSet; the other SCCs stay.
    setup
        .patch_policy(json!({"spec": {"nodeStatusExporter": {"enabled": false}}}))
        .await;
    let api = scc_api(admin);
    let remaining = wait::until(TIMEOUT, "the node-status exporter's SCC pruned", || {
        let api = api.clone();
        async move {
            let names: BTreeSet<String> = api
                .list(&ListParams::default().labels(MANAGED))
                .await?
                .items
                .iter()
                .map(ResourceExt::name_any)
                .collect();
            Ok(if names.contains("nvidia-node-status-exporter") {
                Err(format!("{names:?}"))
            } else {
                Ok(names)
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", setup.operator.log_text()));
    let expected: BTreeSet<String> = EXPECTED_SCCS
        .iter()
        .map(|(n, _)| n.to_string())
        .filter(|n| n != "nvidia-node-status-exporter")
        .collect();
    assert_eq!(
        remaining, expected,
        "SCCs after disabling the node-status exporter"
    );

    setup.teardown().await;
    wait::until(TIMEOUT, "SCCs garbage-collected with the policy", || {
        let api = api.clone();
        async move {
            let left = api
                .list(&ListParams::default().labels(MANAGED))
                .await?
                .items
                .len();
            Ok(if left == 0 {
                Ok(())
            } else {
                Err(format!("{left} SCCs"))
            })
        }
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn without_openshift_apis_nothing_openshift_is_rendered_or_requested() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    openshift::remove_apis(&admin).await;
    let audit = AuditLog::from_env().unwrap();
    let mark = audit.mark().unwrap();
    let Some(setup) = session::start(
        json!({"dcgm": {"enabled": true}, "nodeStatusExporter": {"enabled": true}}),
        &[],
    )
    .await
    else {
        return;
    };
    setup
        .await_state(State::Ready, "policy ready without OpenShift")
        .await;
    let namespace = setup.identity.namespace.clone();

    for ds in setup
        .daemonsets()
        .list(&ListParams::default())
        .await
        .unwrap()
    {
        assert!(
            !ds.annotations().contains_key(SCC_ANNOTATION),
            "{} carries {SCC_ANNOTATION}",
            ds.name_any()
        );
    }
    for role in Api::<Role>::namespaced(admin.clone(), &namespace)
        .list(&ListParams::default())
        .await
        .unwrap()
    {
        // The operator's own Role holds what every variant's operand Roles grant (it may only
        // grant what it holds), OpenShift's included; the operand Roles are what must not.
        if role.name_any() == gpu_operator::render::rbac::OPERATOR_ROLE {
            continue;
        }
        let grants_scc = role.rules.iter().flatten().any(|r| {
            r.api_groups
                .iter()
                .flatten()
                .any(|g| g == "security.openshift.io")
        });
        assert!(!grants_scc, "Role {} grants SCC use", role.name_any());
    }
    let (pod, env) = toolkit(&setup).await;
    assert_eq!(env.get("RUNTIME").map(String::as_str), Some("containerd"));
    assert!(
        !host_paths(&pod).iter().any(|p| p.contains("crio")),
        "CRI-O paths without OpenShift"
    );

    let user = setup.identity.username();
    let asked: Vec<String> = audit
        .since(mark)
        .unwrap()
        .into_iter()
        .filter(|e| e.user.username == user)
        .filter(|e| {
            openshift::OPENSHIFT_GROUPS
                .iter()
                .any(|g| e.request_uri.contains(g))
        })
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect();
    assert!(
        asked.is_empty(),
        "the operator requested OpenShift APIs that are not served: {asked:?}"
    );
    setup.teardown().await;
}
