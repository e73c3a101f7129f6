//! ConfigMaps of the operator namespace that users create (IO: a metadata watch and GETs), held
//! so that anyone who may create ConfigMaps there cannot grow the operator's memory with them.
//!
//! The operator's own ConfigMaps are cached whole by the label watch in [`super::stores`]. Of
//! every other ConfigMap only the name and resourceVersion are kept (a metadata-only watch, in
//! small pages); the data is fetched with a GET, and kept, only for the names a policy refers to
//! ([`crate::facts::config_map_names`], the driver's), and fetched again only when the
//! resourceVersion moved. A change to a named ConfigMap wakes a pass at once (decision 10:
//! an edit rolls its consumers within a second); a change to any other wakes nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, RwLock};

use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};

use super::stores::Wake;
use crate::model::{MANAGED_BY_LABEL, MANAGER};

/// ConfigMaps per page of the metadata list: a page is read whole, and metadata may carry up
/// to 256 KiB of annotations per object.
const PAGE_SIZE: u32 = 25;

/// Users' ConfigMaps: names and versions of all, data of the named ones.
#[derive(Clone, Default)]
pub struct UserConfigMaps {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Every user ConfigMap's resourceVersion, by name.
    versions: RwLock<BTreeMap<String, String>>,
    /// Names some policy referred to since start-up: their changes wake a pass. Grows only with
    /// what policies name (cluster-scoped objects a namespace tenant cannot write).
    named: RwLock<BTreeSet<String>>,
    /// The named ConfigMaps as last fetched.
    fetched: Mutex<BTreeMap<String, Arc<ConfigMap>>>,
    ready: tokio::sync::Notify,
    is_ready: std::sync::atomic::AtomicBool,
}

impl UserConfigMaps {
    /// The metadata watch of every ConfigMap in `namespace` without our label; yields when a
    /// named one changes (and once the first list is in).
    pub fn watch(&self, client: &Client, namespace: &str) -> BoxStream<'static, Wake> {
        let api = Api::<PartialObjectMeta<ConfigMap>>::namespaced(client.clone(), namespace);
        // `!=` also selects objects without the label: every ConfigMap the label watch misses.
        let config = watcher::Config::default()
            .labels(&format!("{MANAGED_BY_LABEL}!={MANAGER}"))
            .page_size(PAGE_SIZE);
        let this = self.clone();
        let mut pending: Option<BTreeMap<String, String>> = None;
        watcher::watcher(api, config)
            .default_backoff()
            .filter_map(move |event| {
                let wake = match event {
                    Ok(event) => this.apply(event, &mut pending),
                    Err(e) => {
                        tracing::warn!(error = %e, "ConfigMap metadata watch failed; retrying with backoff");
                        None
                    }
                };
                async move { wake }
            })
            .boxed()
    }

    /// Applies one watch event; what it wakes.
    fn apply(
        &self,
        event: Event<PartialObjectMeta<ConfigMap>>,
        pending: &mut Option<BTreeMap<String, String>>,
    ) -> Option<Wake> {
        let entry = |m: &PartialObjectMeta<ConfigMap>| {
            (m.name_any(), m.resource_version().unwrap_or_default())
        };
        let mut versions = self.inner.versions.write().ok()?;
        match event {
            Event::Init => {
                *pending = Some(BTreeMap::new());
                None
            }
            Event::InitApply(m) => {
                if let Some(p) = pending.as_mut() {
                    let (name, version) = entry(&m);
                    p.insert(name, version);
                }
                None
            }
            Event::InitDone => {
                if let Some(p) = pending.take() {
                    *versions = p;
                }
                self.inner
                    .is_ready
                    .store(true, std::sync::atomic::Ordering::Release);
                self.inner.ready.notify_waiters();
                Some(Wake::Soon)
            }
            Event::Apply(m) => {
                let (name, version) = entry(&m);
                let changed = versions.get(&name) != Some(&version);
                let named = self.is_named(&name);
                versions.insert(name, version);
                (changed && named).then_some(Wake::Now)
            }
            Event::Delete(m) => {
                let name = m.name_any();
                versions.remove(&name);
                if let Ok(mut fetched) = self.inner.fetched.lock() {
                    fetched.remove(&name);
                }
                self.is_named(&name).then_some(Wake::Now)
            }
        }
    }

    fn is_named(&self, name: &str) -> bool {
        self.inner.named.read().is_ok_and(|n| n.contains(name))
    }

    /// Resolves once the first list has been seen.
    pub async fn wait_until_ready(&self) {
        loop {
            let notified = self.inner.ready.notified();
            if self
                .inner
                .is_ready
                .load(std::sync::atomic::Ordering::Acquire)
            {
                return;
            }
            notified.await;
        }
    }

    /// Makes [`Self::get`] answer for `names`: each existing one whose version moved since its
    /// last fetch is read again. The names are remembered, so their later changes wake a pass.
    pub async fn fetch<'n>(
        &self,
        client: &Client,
        namespace: &str,
        names: impl IntoIterator<Item = &'n str>,
    ) -> Result<(), kube::Error> {
        let api = Api::<ConfigMap>::namespaced(client.clone(), namespace);
        for name in names {
            if let Ok(mut named) = self.inner.named.write() {
                named.insert(name.to_owned());
            }
            let Some(version) = self.version(name) else {
                self.forget(name);
                continue;
            };
            if self
                .get(name)
                .is_some_and(|cm| cm.resource_version() == Some(version.clone()))
            {
                continue;
            }
            match api.get_opt(name).await? {
                Some(cm) => {
                    if let Ok(mut fetched) = self.inner.fetched.lock() {
                        fetched.insert(name.to_owned(), Arc::new(cm));
                    }
                }
                None => self.forget(name),
            }
        }
        Ok(())
    }

    fn version(&self, name: &str) -> Option<String> {
        self.inner.versions.read().ok()?.get(name).cloned()
    }

    fn forget(&self, name: &str) {
        if let Ok(mut fetched) = self.inner.fetched.lock() {
            fetched.remove(name);
        }
    }

    /// A named ConfigMap as last fetched.
    pub fn get(&self, name: &str) -> Option<Arc<ConfigMap>> {
        self.inner.fetched.lock().ok()?.get(name).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(name: &str, version: &str) -> PartialObjectMeta<ConfigMap> {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": {"name": name, "resourceVersion": version}
        }))
        .unwrap()
    }

    #[test]
    fn only_a_change_to_a_named_config_map_wakes_a_pass() {
        let cms = UserConfigMaps::default();
        let mut pending = None;
        assert_eq!(cms.apply(Event::Init, &mut pending), None);
        assert_eq!(
            cms.apply(Event::InitApply(meta("ts", "1")), &mut pending),
            None
        );
        assert_eq!(cms.apply(Event::InitDone, &mut pending), Some(Wake::Soon));
        cms.inner.named.write().unwrap().insert("ts".into());
        // Someone else's ConfigMaps, however many: no pass.
        for i in 0..100 {
            assert_eq!(
                cms.apply(Event::Apply(meta(&format!("junk-{i}"), "2")), &mut pending),
                None
            );
        }
        assert_eq!(
            cms.apply(Event::Apply(meta("ts", "3")), &mut pending),
            Some(Wake::Now)
        );
        // The same version again (a relist) is no news.
        assert_eq!(cms.apply(Event::Apply(meta("ts", "3")), &mut pending), None);
        assert_eq!(
            cms.apply(Event::Delete(meta("ts", "3")), &mut pending),
            Some(Wake::Now)
        );
        assert_eq!(cms.version("junk-7").as_deref(), Some("2"));
        assert_eq!(cms.version("ts"), None);
    }
}
