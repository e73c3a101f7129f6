//! The simulated OpenShift of the harness: OpenShift's SecurityContextConstraints and
//! ClusterVersion CRDs (`tests/cluster/manifests/openshift/`, written from the public API
//! definitions) installed and removed again, so that an operator started meanwhile detects
//! OpenShift. A failed step panics: this is test support.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::runtime::wait::conditions;
use serde_json::json;

use crate::session::TIMEOUT;
use crate::wait;

pub const SCC_CRD: &str = "securitycontextconstraints.security.openshift.io";
pub const CLUSTER_VERSION_CRD: &str = "clusterversions.config.openshift.io";
/// The API groups the two CRDs serve.
pub const OPENSHIFT_GROUPS: [&str; 2] = ["security.openshift.io", "config.openshift.io"];
const FIELD_MANAGER: &str = "e2e-openshift";

fn manifests_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../cluster/manifests/openshift")
}

pub async fn served_groups(client: &Client) -> Vec<String> {
    client
        .list_api_groups()
        .await
        .unwrap()
        .groups
        .into_iter()
        .map(|g| g.name)
        .filter(|name| OPENSHIFT_GROUPS.contains(&name.as_str()))
        .collect()
}

/// Installs the SCC and ClusterVersion CRDs, waits until they are established, and creates the
/// cluster's `version` ClusterVersion as an OpenShift installer does.
pub async fn install_apis(client: &Client) {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for (name, file) in [
        (SCC_CRD, "securitycontextconstraints.yaml"),
        (CLUSTER_VERSION_CRD, "clusterversions.yaml"),
    ] {
        let path = manifests_dir().join(file);
        let crd: CustomResourceDefinition =
            serde_yaml_ng::from_str(&std::fs::read_to_string(&path).unwrap())
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        api.patch(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&crd),
        )
        .await
        .unwrap();
        wait::for_object(
            api.clone(),
            name,
            TIMEOUT,
            "OpenShift CRD established",
            conditions::is_crd_established(),
        )
        .await
        .unwrap();
    }
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("config.openshift.io", "v1", "ClusterVersion"),
        "clusterversions",
    );
    let mut version = DynamicObject::new("version", &resource);
    version.data = json!({"spec": {"clusterID": "6b1f3a52-8d4e-4c2a-9f0e-3c5d7a9b1e24", "channel": "stable-4.20"}});
    let api = Api::<DynamicObject>::all_with(client.clone(), &resource);
    api.create(&PostParams::default(), &version).await.unwrap();
    // What the cluster-version operator reports once the install has completed: the operator
    // passes its major.minor to the driver as OPENSHIFT_VERSION.
    let release = format!("quay.io/openshift-release-dev/ocp-release:{OPENSHIFT_RELEASE}-x86_64");
    let status = json!({"status": {
        "desired": {"version": OPENSHIFT_RELEASE, "image": release},
        // Empty, not null: a merge patch drops null fields, and the field is required.
        "availableUpdates": [],
        "observedGeneration": 1,
        "versionHash": "harness",
        "history": [{"state": "Completed", "version": OPENSHIFT_RELEASE, "image": release,
            "startedTime": "2026-11-01T00:00:00Z", "completionTime": "2026-11-01T00:40:00Z",
            "verified": false}],
    }});
    api.patch_status("version", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
}

/// The OpenShift release the simulated cluster reports as installed.
pub const OPENSHIFT_RELEASE: &str = "4.20.3";

/// Deletes the OpenShift CRDs (their objects go with them) and waits until the API server no
/// longer serves their groups, so that the next operator started on this harness finds a plain
/// Kubernetes cluster. Tolerates CRDs that are already gone.
pub async fn remove_apis(client: &Client) {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in [SCC_CRD, CLUSTER_VERSION_CRD] {
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => panic!("deleting CRD {name}: {e}"),
        }
    }
    wait::until(TIMEOUT, "OpenShift APIs no longer served", || {
        let (api, client) = (api.clone(), client.clone());
        async move {
            let mut left = served_groups(&client).await;
            for name in [SCC_CRD, CLUSTER_VERSION_CRD] {
                if api.get_opt(name).await?.is_some() {
                    left.push(format!("CRD {name}"));
                }
            }
            Ok(if left.is_empty() {
                Ok(())
            } else {
                Err(left.join(", "))
            })
        }
    })
    .await
    .unwrap();
}

/// Runs `steps` on the simulated OpenShift and, whatever happens in them (a panic included),
/// removes the OpenShift APIs and the test's operator ClusterRole `operator_role` afterwards, so
/// the next test's operator finds a plain Kubernetes cluster. A panic in `steps` is resumed.
pub async fn run_on_simulated_openshift<T>(
    admin: &Client,
    operator_role: &str,
    steps: impl std::future::Future<Output = T>,
) -> T {
    use futures::FutureExt;
    remove_apis(admin).await;
    install_apis(admin).await;
    let outcome = std::panic::AssertUnwindSafe(steps).catch_unwind().await;
    remove_apis(admin).await;
    let _ = Api::<k8s_openapi::api::rbac::v1::ClusterRole>::all(admin.clone())
        .delete(operator_role, &DeleteParams::default())
        .await;
    match outcome {
        Ok(value) => value,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// An operator session on the simulated OpenShift as installed there: the operator running
/// with its generated ClusterRole under the test's name `operator_role` (decision 13; the API
/// server refuses Roles that grant `use` of SCCs unless the operator holds that itself; the
/// fixed name lets [`run_on_simulated_openshift`] remove it after a panic too), and a policy
/// with `spec` created. Called inside [`run_on_simulated_openshift`], whose caller connected:
/// the test cluster is there.
pub async fn start_with_generated_role(
    operator_role: &str,
    spec: serde_json::Value,
) -> crate::session::Setup {
    crate::session::builder()
        .cluster_role(crate::operator::generated_role(operator_role))
        .start(spec)
        .await
        .expect("the caller connected to the test cluster")
}
