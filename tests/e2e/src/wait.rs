//! Awaiting conditions with a deadline instead of sleeping: watch-based where a single object
//! is awaited, polling with a short interval where a condition spans several objects.

use std::future::Future;
use std::time::Duration;

use anyhow::{Result, bail};
use kube::runtime::wait::{Condition, await_condition};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;

/// Waits until object `name` satisfies `condition`, or fails after `timeout` naming `what`.
pub async fn for_object<K>(
    api: Api<K>,
    name: &str,
    timeout: Duration,
    what: &str,
    condition: impl Condition<K>,
) -> Result<K>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    match tokio::time::timeout(timeout, await_condition(api, name, condition)).await {
        Ok(Ok(Some(object))) => Ok(object),
        Ok(Ok(None)) => bail!("{what}: {name} was deleted while waiting"),
        Ok(Err(e)) => bail!("{what}: watching {name} failed: {e}"),
        Err(_) => bail!("{what}: {name} not reached within {timeout:?}"),
    }
}

/// Polls `check` every 100 ms until it returns `Some`, or fails after `timeout` with the last
/// observation described by `describe`.
pub async fn until<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<std::result::Result<T, String>>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last = match check().await? {
            Ok(value) => return Ok(value),
            Err(observed) => observed,
        };
        if tokio::time::Instant::now() >= deadline {
            bail!("{what} not reached within {timeout:?}; last seen: {last}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls until `api` lists no object matching `params` (for example the operands a deleted
/// policy owned, after garbage collection), or fails after `timeout` naming `what` and how many
/// were left.
pub async fn until_none_left<K>(
    api: &Api<K>,
    params: &kube::api::ListParams,
    timeout: Duration,
    what: &str,
) -> Result<()>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    until(timeout, what, || async {
        let left = api.list_metadata(params).await?.items.len();
        Ok(if left == 0 {
            Ok(())
        } else {
            Err(format!("{left} left"))
        })
    })
    .await
}
