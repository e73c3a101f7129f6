//! ConfigMaps that nobody's policy names cannot grow the operator's memory
//! (operator/src/controller/config_maps.rs): thousands of large ConfigMaps in the operator
//! namespace, which anyone allowed to create ConfigMaps there could write, leave its resident
//! memory far under its limit, while an edit of the ConfigMap the policy names still rolls its
//! consumers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use e2e::procstat;
use e2e::session::*;
use e2e::wait;
use futures::StreamExt;
use gpu_operator::api::State;
use gpu_operator::operands::device_plugin::mounted_copy;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

/// How many ConfigMaps, of how many bytes of data each.
const COUNT: usize = 5_000;
const BYTES: usize = 100 * 1024;
/// Requests in flight while creating them.
const CONCURRENCY: usize = 16;
/// The bound on the operator's resident memory with all of them present.
const RSS_LIMIT_MIB: f64 = 100.0;
const LABEL: &str = "gpu-operator.test/filler";

const PLUGIN: &str = "nvidia-device-plugin-daemonset";

async fn mounted(s: &Setup) -> Option<String> {
    mounted_copy(&s.daemonsets().get(PLUGIN).await.ok()?).map(|(copy, _)| copy)
}

/// Creates `cm`, again after a server error: 500 MB written by 16 clients at once can make a
/// loaded harness' API server lose its etcd connection for a moment.
async fn create_retrying(api: &Api<ConfigMap>, cm: &ConfigMap) {
    let mut attempts = 0;
    loop {
        match api.create(&PostParams::default(), cm).await {
            Ok(_) => return,
            // An attempt that failed late may have been stored.
            Err(kube::Error::Api(e)) if e.code == 409 && attempts > 0 => return,
            Err(kube::Error::Api(e)) if e.code >= 500 && attempts < 5 => {
                attempts += 1;
                tokio::time::sleep(Duration::from_secs(attempts)).await;
            }
            Err(e) => panic!("creating ConfigMap {:?}: {e}", cm.metadata.name),
        }
    }
}

#[tokio::test]
async fn thousands_of_unnamed_config_maps_leave_the_operators_memory_bounded() {
    let Some(s) = start(
        json!({"devicePlugin": {"config": {"name": "time-slicing-config"}}}),
        &[],
    )
    .await
    else {
        return;
    };
    let ns = s.identity.namespace.clone();
    config_map(
        &s.admin,
        &ns,
        "time-slicing-config",
        &[("any", &time_slicing(4))],
    )
    .await;
    s.await_state(State::Ready, "ready with the sharing config")
        .await;
    let first = mounted(&s).await.expect("the plugin mounts no copy");
    let pid = s.operator.pid().unwrap();
    let ticks = procstat::clock_ticks();
    let before = procstat::read(pid, ticks).unwrap();

    // 5,000 ConfigMaps of 100 KiB that no policy names (500 MB of data).
    let api = Api::<ConfigMap>::namespaced(s.admin.clone(), &ns);
    let filler = "x".repeat(BYTES);
    let created = std::time::Instant::now();
    futures::stream::iter(0..COUNT)
        .map(|i| {
            let (api, filler) = (api.clone(), filler.clone());
            async move {
                let cm: ConfigMap = serde_json::from_value(json!({
                    "metadata": {"name": format!("filler-{i}"), "labels": {LABEL: "true"}},
                    "data": {"blob": filler},
                }))
                .unwrap();
                create_retrying(&api, &cm).await;
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<()>>()
        .await;
    eprintln!("created {COUNT} ConfigMaps in {:?}", created.elapsed());

    // The named ConfigMap changes after all of them, on the same watch: once its consumers
    // roll, the operator has seen every filler event before it.
    config_map(
        &s.admin,
        &ns,
        "time-slicing-config",
        &[("any", &time_slicing(8))],
    )
    .await;
    wait::until(Duration::from_secs(120), "the plugin on a new copy", || {
        let (s, first) = (&s, first.clone());
        async move {
            Ok(match mounted(s).await {
                Some(copy) if copy != first => Ok(()),
                other => Err(format!("{other:?}")),
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", s.operator.log_text()));
    let after = procstat::read(pid, ticks).unwrap();
    eprintln!(
        "operator RSS: {:.1} MiB before, {:.1} MiB with {COUNT} ConfigMaps of {} KiB (peak {:.1} MiB)",
        before.rss_mib(),
        after.rss_mib(),
        BYTES / 1024,
        after.hwm_mib()
    );
    let rss = after.rss_mib();

    // One by one, as they were created: a single collection delete of 500 MB can outlast a
    // request's timeout on a busy API server.
    futures::stream::iter(0..COUNT)
        .map(|i| {
            let api = api.clone();
            async move {
                match api
                    .delete(&format!("filler-{i}"), &DeleteParams::default())
                    .await
                {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => panic!("deleting filler-{i}: {e}"),
                }
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<()>>()
        .await;
    assert!(
        rss < RSS_LIMIT_MIB,
        "operator RSS {rss:.1} MiB with {COUNT} ConfigMaps of {} KiB (limit {RSS_LIMIT_MIB} MiB)",
        BYTES / 1024
    );
    s.teardown().await;
}
