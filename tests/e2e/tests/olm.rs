//! The OLM bundle (`bundle/`) checked by the real tools: operator-framework's validators (the
//! default, OperatorHub and good-practices suites, built from their Go module by
//! `tests/olm/build.sh`) pass it and reject a broken copy; the bundle generator (what `cargo
//! xtask generate` runs: helm renders the chart's Deployment) reproduces it byte for byte, and the
//! CSV grants exactly the chart's ClusterRole; every `alm-examples` entry is accepted by the
//! harness's API server and stored with every field as written (nothing pruned); the namespace
//! the CSV suggests admits privileged operand pods under Pod Security admission.
//!
//! The example test creates cluster-wide policies; like every test touching the cluster it runs
//! one at a time (`--test-threads=1`, as tests/e2e.sh runs them) and removes leftovers first.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use e2e::cluster::pinned_version;
use e2e::session::{self, TIMEOUT};
use e2e::tools::{self, repo_root};
use e2e::wait;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::runtime::wait::conditions;
use serde_json::Value;
use xtask::bundle::{self, CRD_FILE, CSV_FILE};

const FIX: &str = "regenerate it with `cargo xtask generate` and review the diff";

fn bundle_dir() -> PathBuf {
    repo_root().join("bundle")
}

fn committed_csv() -> Value {
    let path = bundle_dir().join(CSV_FILE);
    serde_yaml_ng::from_str(&std::fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A fresh folder under the system temp dir.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the validators (`validator`: validate-bundle, which tests/olm/build.sh builds) on
/// `dir`: success and the combined output.
fn validate(validator: &Path, dir: &Path) -> (bool, String) {
    let out = Command::new(validator).arg(dir).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn the_bundle_passes_the_operator_framework_validators() {
    let Some(validator) = tools::checker("tests/olm/build.sh") else {
        return;
    };
    let (ok, output) = validate(&validator, &bundle_dir());
    println!("{output}");
    // No warning either: the CSV may not create CRDs (OLM installs the bundle's, NFD's
    // included), which was the one good-practices warning before NFD's CRDs were bundled.
    for suite in ["default", "operatorhub", "good-practices"] {
        assert!(
            output.contains(&format!("suite {suite}: 0 errors, 0 warnings")),
            "suite {suite} did not run clean:\n{output}"
        );
    }
    assert!(ok, "the validators rejected bundle/:\n{output}");

    // The same validators on a copy without an icon and with a category OperatorHub does not
    // know: they must fail, naming both.
    let broken = scratch("gpu-operator-broken-bundle");
    for (path, content) in bundle::read_files(&bundle_dir()) {
        let target = broken.join(path);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::write(&target, content.unwrap()).unwrap();
    }
    let mut csv = committed_csv();
    csv["spec"].as_object_mut().unwrap().remove("icon");
    csv["metadata"]["annotations"]["categories"] = "GPUs".into();
    std::fs::write(
        broken.join(CSV_FILE),
        serde_yaml_ng::to_string(&csv).unwrap(),
    )
    .unwrap();
    let (ok, output) = validate(&validator, &broken);
    std::fs::remove_dir_all(&broken).unwrap();
    assert!(
        !ok,
        "the validators accept a bundle without an icon:\n{output}"
    );
    assert!(output.contains("Icon"), "{output}");
    assert!(output.contains("\"GPUs\""), "{output}");
}

/// Runs helm from PATH (the harness env puts it there).
fn helm_template(args: &[&str]) -> String {
    let out = Command::new("helm")
        .arg("template")
        .arg("gpu-operator")
        .arg(repo_root().join("charts/gpu-operator"))
        .args(["--namespace", "gpu-operator"])
        .args([
            "--kube-version",
            &pinned_version("KUBERNETES_VERSION").unwrap(),
        ])
        .args(args)
        .output()
        .expect("running helm: source $HARNESS_DIR/env to put it on PATH");
    assert!(
        out.status.success(),
        "helm template failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn make_bundle_reproduces_the_committed_bundle_from_the_chart() {
    let Some(helm) = tools::harness_tool("helm") else {
        return;
    };
    let fresh = bundle::from_chart(&repo_root(), &xtask::helm::Helm::at(helm)).unwrap();
    for (file, (path, committed)) in fresh.iter().zip(bundle::read_files(&bundle_dir())) {
        assert_eq!(
            file.path, path,
            "read_files lists the files the generator writes"
        );
        assert!(
            Some(&file.content) == committed.as_ref(),
            "bundle/{path} differs from what `cargo xtask generate` writes now (chart, RBAC, CRD, examples or images changed): {FIX}"
        );
    }

    // The CSV's permissions are the chart's ClusterRole, rule for rule, less writing CRDs
    // (OLM installs the bundle's CRDs; the chart's operator installs NFD's itself).
    let role: Value = serde_yaml_ng::from_str(&helm_template(&[
        "--show-only",
        "templates/clusterrole.yaml",
    ]))
    .unwrap();
    let generated = gpu_operator::render::rbac::operator_cluster_role();
    assert!(
        role["rules"] == serde_json::to_value(generated.rules).unwrap(),
        "the chart's ClusterRole differs from `gpu-operator rbac`: run `make chart`"
    );
    let chart_role: Value =
        serde_yaml_ng::from_str(&helm_template(&["--show-only", "templates/role.yaml"])).unwrap();
    let generated_role = gpu_operator::render::rbac::operator_role(None);
    assert!(
        chart_role["rules"] == serde_json::to_value(&generated_role.rules).unwrap(),
        "the chart's Role differs from `gpu-operator rbac`: run `make chart`"
    );
    let csv = committed_csv();
    assert!(
        csv["spec"]["install"]["spec"]["clusterPermissions"][0]["rules"]
            == serde_json::to_value(bundle::olm_cluster_rules()).unwrap(),
        "the CSV's clusterPermissions differ from the chart's ClusterRole less writing CRDs: {FIX}"
    );
    assert!(
        csv["spec"]["install"]["spec"]["permissions"][0]["rules"]
            == serde_json::to_value(&generated_role.rules).unwrap(),
        "the CSV's permissions differ from the chart's Role: {FIX}"
    );
    // And it runs the chart's operator container: same command, probes, security context.
    let chart: Value =
        serde_yaml_ng::from_str(&helm_template(&["--show-only", "templates/operator.yaml"]))
            .unwrap();
    let ours = &csv["spec"]["install"]["spec"]["deployments"][0]["spec"]["template"]["spec"]["containers"]
        [0];
    let theirs = &chart["spec"]["template"]["spec"]["containers"][0];
    for field in [
        "command",
        "ports",
        "livenessProbe",
        "readinessProbe",
        "resources",
        "securityContext",
    ] {
        assert_eq!(ours[field], theirs[field], "operator container {field}");
    }
}

/// Whether `live` holds everything `written` holds, value for value (the server may add
/// defaulted fields; it must not drop or change one).
fn stored_as_written(written: &Value, live: &Value, path: &str, lost: &mut Vec<String>) {
    use gpu_operator::json_diff::{self, Difference, Rules};
    lost.extend(
        json_diff::differences(path, written, live, &Rules::SUBSET)
            .into_iter()
            .map(|d| match d {
                Difference::Missing { path, .. } | Difference::Extra { path, .. } => path,
                Difference::Length {
                    path,
                    wanted,
                    found,
                }
                | Difference::Changed {
                    path,
                    wanted,
                    found,
                } => format!("{path}: wrote {wanted}, stored {found}"),
            }),
    );
}

#[tokio::test]
async fn every_alm_example_is_stored_as_written() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    // The bundle's own CRD copies, as OLM would install them (the same field manager as the
    // sessions, which apply the identical crds/ copies).
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    let mut scopes = std::collections::BTreeMap::new();
    let own = [
        CRD_FILE,
        bundle::GPU_CLUSTER_CRD_FILE,
        bundle::NVIDIA_DRIVER_CRD_FILE,
    ];
    for file in own
        .into_iter()
        .chain(bundle::NFD_CRD_FILES)
        .chain(bundle::COMPUTE_DOMAIN_CRD_FILES)
    {
        let crd: CustomResourceDefinition =
            serde_yaml_ng::from_str(&std::fs::read_to_string(bundle_dir().join(file)).unwrap())
                .unwrap();
        let name = crd.metadata.name.clone().unwrap();
        scopes.insert(crd.spec.names.kind.clone(), crd.spec.scope.clone());
        crds.patch(
            &name,
            &PatchParams::apply(session::CRD_FIELD_MANAGER).force(),
            &Patch::Apply(&crd),
        )
        .await
        .unwrap();
        wait::for_object(
            crds.clone(),
            &name,
            Duration::from_secs(60),
            "CRD established",
            conditions::is_crd_established(),
        )
        .await
        .unwrap();
    }
    session::remove_leftovers(&admin).await;
    let namespace = "e2e-olm-examples";
    delete_namespace(&admin, namespace).await;
    let mut ns = Namespace::default();
    ns.metadata.name = Some(namespace.to_owned());
    Api::<Namespace>::all(admin.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();

    let examples: Value = serde_json::from_str(
        committed_csv()["metadata"]["annotations"]["alm-examples"]
            .as_str()
            .expect("alm-examples is a string"),
    )
    .unwrap();
    let examples = examples.as_array().unwrap();
    assert!(!examples.is_empty(), "alm-examples is empty");
    // One at a time: a second policy would only be marked ignored, and the CRD is all that
    // judges them here (no operator runs).
    for (i, example) in examples.iter().enumerate() {
        let object: DynamicObject = serde_json::from_value(example.clone()).unwrap();
        let types = object.types.clone().unwrap();
        let (group, version) = types.api_version.split_once('/').unwrap();
        let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, &types.kind));
        let api: Api<DynamicObject> = match scopes.get(&types.kind).map(String::as_str) {
            Some("Namespaced") => Api::namespaced_with(admin.clone(), namespace, &resource),
            Some(_) => Api::all_with(admin.clone(), &resource),
            None => panic!(
                "alm-examples[{i}] is a {}, which the bundle has no CRD for",
                types.kind
            ),
        };
        let name = object.metadata.name.clone().unwrap();
        let created = api
            .create(&PostParams::default(), &object)
            .await
            .unwrap_or_else(|e| panic!("alm-examples[{i}] ({name}) is rejected: {e}"));
        let live = serde_json::to_value(&created).unwrap();
        let mut lost = Vec::new();
        stored_as_written(&example["spec"], &live["spec"], "spec", &mut lost);
        assert!(
            lost.is_empty(),
            "alm-examples[{i}] ({name}) is not stored as written: {lost:?}"
        );
        api.delete(&name, &DeleteParams::default()).await.unwrap();
        wait::until(TIMEOUT, "example deleted", || {
            let (api, name) = (api.clone(), name.clone());
            async move {
                Ok(match api.get_opt(&name).await? {
                    None => Ok(()),
                    Some(_) => Err("still there".to_owned()),
                })
            }
        })
        .await
        .unwrap();
    }
    delete_namespace(&admin, namespace).await;
}

/// A pod with what operand pods ask for: host PID, a host path, a privileged container.
fn privileged_pod() -> Pod {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "privileged-operand"},
        "spec": {
            "hostPID": true,
            "containers": [{
                "name": "main", "image": "registry.example.com/operand:1",
                "securityContext": {"privileged": true},
                "volumeMounts": [{"name": "host", "mountPath": "/host"}],
            }],
            "volumes": [{"name": "host", "hostPath": {"path": "/"}}],
        },
    }))
    .unwrap()
}

async fn delete_namespace(client: &kube::Client, name: &str) {
    let api: Api<Namespace> = Api::all(client.clone());
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => panic!("deleting namespace {name}: {e}"),
    }
    wait::until(TIMEOUT, "namespace deleted", || {
        let (api, name) = (api.clone(), name.to_owned());
        async move {
            Ok(match api.get_opt(&name).await? {
                None => Ok(()),
                Some(_) => Err(format!("{name} still there")),
            })
        }
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn the_suggested_namespace_admits_privileged_operands_under_pod_security() {
    let Some(admin) = e2e::connect().await else {
        return;
    };
    let template: Namespace = serde_json::from_str(
        committed_csv()["metadata"]["annotations"]["operatorframework.io/suggested-namespace-template"]
            .as_str()
            .expect("the CSV has a suggested-namespace-template"),
    )
    .unwrap();
    let name = template.metadata.name.clone().unwrap();
    // A namespace held to the restricted profile, as OpenShift holds namespaces by default.
    let restricted = "e2e-olm-restricted";
    for ns in [name.as_str(), restricted] {
        delete_namespace(&admin, ns).await;
    }
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    namespaces
        .create(&PostParams::default(), &template)
        .await
        .unwrap();
    let mut strict = Namespace::default();
    strict.metadata.name = Some(restricted.to_owned());
    strict.metadata.labels = Some(
        [(
            "pod-security.kubernetes.io/enforce".to_owned(),
            "restricted".to_owned(),
        )]
        .into(),
    );
    namespaces
        .create(&PostParams::default(), &strict)
        .await
        .unwrap();

    // Pod Security admission runs on dry-run requests too: nothing is scheduled.
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let in_template = Api::<Pod>::namespaced(admin.clone(), &name)
        .create(&dry_run, &privileged_pod())
        .await;
    let in_restricted = Api::<Pod>::namespaced(admin.clone(), restricted)
        .create(&dry_run, &privileged_pod())
        .await;
    for ns in [name.as_str(), restricted] {
        delete_namespace(&admin, ns).await;
    }
    in_template.unwrap_or_else(|e| {
        panic!("namespace {name} from the CSV's template rejects a privileged operand pod: {e}")
    });
    let refused = in_restricted.expect_err("the restricted namespace admitted a privileged pod");
    assert!(
        refused.to_string().contains("PodSecurity"),
        "refused for another reason than Pod Security: {refused}"
    );
}
