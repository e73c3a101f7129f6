//! Apply stage, planning (pure, no IO): the `nvidia.com/*` resources the device plugin will
//! advertise in a GPU node's `status.allocatable` once its sharing config and MIG layout are in
//! effect.
//!
//! The rules restate the pinned device plugin (k8s-device-plugin v0.20.0: its README and
//! `internal/rm`) and mig-parted (v0.15.0), as docs/config-facts.md summarises them:
//!
//! - Every GPU is one `nvidia.com/gpu`, except that under the `single` and `mixed` MIG strategies
//!   a MIG-enabled GPU is replaced by its MIG devices: one `nvidia.com/gpu` each under `single`,
//!   one `nvidia.com/mig-<profile>` each under `mixed` (`+` in a profile written as `.`).
//! - `single` needs every GPU MIG-enabled, each with MIG devices, all of one profile (or no GPU
//!   MIG-enabled); otherwise the plugin exits at start ("invalid MIG configuration") and the
//!   node advertises nothing, which is reported as an error.
//! - A shared resource's count is multiplied by its replicas, under `<name>.shared` when the
//!   sharing section sets `renameByDefault` (the plugin ignores a per-resource `rename`, which
//!   [`PluginConfigSummary`]'s `advertised_as` already accounts for). MPS refuses MIG devices.
//! - mig-parted configures each GPU by the last entry of the layout whose `device-filter` and
//!   `devices` select it; GPUs no entry selects keep whatever they had, which cannot be
//!   predicted and is reported as an error.
//!
//! Resources with no devices are not advertised at all (the plugin starts no server for them),
//! so they are absent from the result rather than present with 0.

use std::collections::BTreeMap;

use crate::sharing::device_plugin::{MIG_STRATEGIES, PluginConfigSummary, SharingStrategy};
use crate::sharing::mig::{self, MigConfigFile, MigDevices, MigEntry};

/// The resource every full GPU, and every MIG device under the `single` strategy, is
/// advertised as.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// What a GPU node has, as GFD labels it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeGpus<'a> {
    /// `nvidia.com/gpu.product`.
    pub product: &'a str,
    /// `nvidia.com/gpu.count`.
    pub count: u32,
}

/// The node's GPUs once mig-manager has applied the layout.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Inventory {
    /// GPUs with MIG disabled: the plugin sees them whole.
    full: u64,
    /// One item per MIG-enabled GPU: its instances (profile as NVML names it -> count), which
    /// may be none.
    mig: Vec<BTreeMap<String, u64>>,
}

/// The resources the device plugin advertises on such a node, name -> count, or why it
/// advertises nothing / cannot be predicted (an error message naming the config and the fix).
pub fn advertised(
    gpus: &NodeGpus<'_>,
    plugin: Option<&PluginConfigSummary>,
    mig_strategy: &str,
    mig: Option<(&MigConfigFile, &str)>,
) -> Result<BTreeMap<String, u64>, String> {
    if !MIG_STRATEGIES.contains(&mig_strategy) {
        return Err(format!(
            "the MIG strategy is {mig_strategy:?}, which the device plugin refuses (it exits at start); set spec.mig.strategy to none, single or mixed"
        ));
    }
    let inventory = inventory(gpus, mig_strategy, mig)?;
    let devices = devices_by_resource(gpus.product, &inventory, mig_strategy)?;
    match plugin {
        Some(plugin) if plugin.sharing != SharingStrategy::None => {
            shared(devices, plugin, &inventory, mig_strategy)
        }
        _ => Ok(devices),
    }
}

/// The node's GPUs after the layout is applied.
fn inventory(
    gpus: &NodeGpus<'_>,
    mig_strategy: &str,
    mig: Option<(&MigConfigFile, &str)>,
) -> Result<Inventory, String> {
    let product = gpus.product;
    if let Some(slice) = single_strategy_slice(product) {
        // GFD has labelled the node for the `single` strategy: gpu.count counts MIG devices
        // of one profile, and the number of boards is not on the node.
        if slice == "INVALID" {
            return Err(format!(
                "{product} says GPU feature discovery found an invalid MIG setup for the single strategy, so the node's GPUs cannot be counted from its labels; fix the MIG layout (nvidia.com/mig.config) or use MIG strategy mixed"
            ));
        }
        return match (mig, mig_strategy) {
            (Some((_, layout)), _) => Err(format!(
                "{product} names a MIG device, so nvidia.com/gpu.count={} counts MIG devices, not GPUs, and how many GPUs MIG layout {layout:?} partitions cannot be read from the labels; predict again once GPU feature discovery labels the boards (MIG strategy none or mixed)",
                gpus.count
            )),
            (None, "none") => Err(format!(
                "{product} names a MIG device, so nvidia.com/gpu.count={} counts MIG devices, not the GPUs MIG strategy none would advertise; predict again once GPU feature discovery labels the boards",
                gpus.count
            )),
            // The MIG devices stay as they are; which board holds which does not change what
            // either strategy advertises, so one stand-in GPU holds them all.
            (None, _) => Ok(Inventory {
                full: 0,
                mig: vec![BTreeMap::from([(slice.to_string(), u64::from(gpus.count))])],
            }),
        };
    }
    let Some((config, layout)) = mig else {
        // Nobody changes MIG modes on this node, and GFD shows no MIG slice: its GPUs are
        // taken to be whole.
        return Ok(Inventory {
            full: u64::from(gpus.count),
            mig: Vec::new(),
        });
    };
    // check_node also refuses a gpu.count past MAX_GPU_INDEX, which bounds the loop below.
    mig::check_node(config, layout, product, Some(&gpus.count.to_string()))?;
    let entries = config.configs.get(layout).map_or(&[][..], Vec::as_slice);
    let selecting: Vec<&MigEntry> = entries
        .iter()
        .filter(|entry| entry_selects(entry, product))
        .collect();
    if selecting.is_empty() {
        return Err(format!(
            "MIG layout {layout:?} has no entry for {product}: every entry's device-filter names other GPU models, so mig-manager leaves these GPUs as they are; add an entry without a device-filter (or with this model's) to the layout, or choose another layout in nvidia.com/mig.config"
        ));
    }
    let mut inventory = Inventory::default();
    let mut unconfigured = Vec::new();
    for gpu in 0..gpus.count {
        // mig-parted applies entries in order, so a later entry wins for a GPU both select.
        match selecting
            .iter()
            .rev()
            .find(|entry| selects_index(entry, gpu))
        {
            Some(entry) if entry.mig_enabled => inventory.mig.push(instances(entry)?),
            Some(_) => inventory.full += 1,
            None => unconfigured.push(gpu.to_string()),
        }
    }
    if !unconfigured.is_empty() {
        return Err(format!(
            "MIG layout {layout:?} has no entry for GPU {} of {product}, so mig-manager leaves it as it is and what it advertises cannot be predicted; add `devices: all` or its index to an entry of the layout",
            unconfigured.join(", ")
        ));
    }
    Ok(inventory)
}

/// The profile GFD appended to `nvidia.com/gpu.product` under the `single` strategy
/// (`A100-SXM4-40GB-MIG-1g.5gb`, `...-MIG-1g.5gb-SHARED`, `...-MIG-INVALID`).
fn single_strategy_slice(product: &str) -> Option<&str> {
    let (_, slice) = product.split_once("-MIG-")?;
    Some(slice.strip_suffix("-SHARED").unwrap_or(slice))
}

/// Whether the entry's `device-filter` selects the node's model. Asked of
/// [`mig::layout_selects`] with a one-entry layout so that the filter is read exactly as the
/// rest of the operator reads it.
fn entry_selects(entry: &MigEntry, product: &str) -> bool {
    const ONE: &str = "entry";
    let single = MigConfigFile {
        configs: BTreeMap::from([(ONE.to_string(), vec![entry.clone()])]),
    };
    mig::layout_selects(&single, ONE, product)
}

fn selects_index(entry: &MigEntry, gpu: u32) -> bool {
    match &entry.devices {
        MigDevices::All => true,
        MigDevices::Indexes(indexes) => indexes.contains(&i64::from(gpu)),
    }
}

/// The entry's instances by the profile name NVML (and so the plugin) reports.
fn instances(entry: &MigEntry) -> Result<BTreeMap<String, u64>, String> {
    let mut out: BTreeMap<String, u64> = BTreeMap::new();
    for (name, count) in entry.mig_devices.iter().flatten() {
        if *count == 0 {
            continue;
        }
        // check_node has already refused names that do not parse.
        let canonical = mig::parse_profile_name(name)
            .map_err(|why| format!("MIG profile {name:?} is not a profile name ({why})"))?
            .canonical();
        *out.entry(canonical).or_default() += u64::from(*count);
    }
    Ok(out)
}

/// The resource a MIG profile is advertised as under the `mixed` strategy.
fn mixed_resource(profile: &str) -> String {
    format!("nvidia.com/mig-{}", profile.replace('+', "."))
}

/// Devices per resource before sharing.
fn devices_by_resource(
    product: &str,
    inventory: &Inventory,
    mig_strategy: &str,
) -> Result<BTreeMap<String, u64>, String> {
    let mut out: BTreeMap<String, u64> = BTreeMap::new();
    let full = inventory.full;
    let mig_gpus = &inventory.mig;
    if mig_strategy == "none" {
        // The plugin ignores MIG mode and hands out whole GPUs.
        let all = full + mig_gpus.len() as u64;
        if all > 0 {
            out.insert(GPU_RESOURCE.to_string(), all);
        }
        return Ok(out);
    }
    let mut by_profile: BTreeMap<&str, u64> = BTreeMap::new();
    for instances in mig_gpus {
        for (profile, count) in instances {
            *by_profile.entry(profile.as_str()).or_default() += count;
        }
    }
    if mig_strategy == "single" {
        let invalid = |why: String| {
            Err(format!(
                "the device plugin exits at start under MIG strategy single on {product} (invalid MIG configuration: {why}), so the node advertises no GPUs; choose a layout that gives every GPU the same single profile, or set spec.mig.strategy to mixed"
            ))
        };
        if mig_gpus.iter().any(|instances| instances.is_empty()) {
            return invalid("a GPU has MIG enabled but no MIG devices".to_string());
        }
        if full > 0 && !mig_gpus.is_empty() {
            return invalid(format!(
                "{full} GPU{} would have MIG disabled and {} enabled; all must agree",
                if full == 1 { "" } else { "s" },
                mig_gpus.len()
            ));
        }
        if by_profile.len() > 1 {
            let names: Vec<&str> = by_profile.keys().copied().collect();
            return invalid(format!(
                "more than one MIG device type ({})",
                names.join(", ")
            ));
        }
        let total = full + by_profile.values().sum::<u64>();
        if total > 0 {
            out.insert(GPU_RESOURCE.to_string(), total);
        }
        return Ok(out);
    }
    // mixed: MIG-disabled GPUs stay whole; a MIG-enabled GPU without instances offers nothing.
    if full > 0 {
        out.insert(GPU_RESOURCE.to_string(), full);
    }
    for (profile, count) in by_profile {
        out.insert(mixed_resource(profile), count);
    }
    Ok(out)
}

/// Applies the sharing section: each shared resource's devices become `replicas` devices each,
/// under its advertised name.
fn shared(
    devices: BTreeMap<String, u64>,
    plugin: &PluginConfigSummary,
    inventory: &Inventory,
    mig_strategy: &str,
) -> Result<BTreeMap<String, u64>, String> {
    if plugin.sharing == SharingStrategy::Mps {
        if mig_strategy == "mixed" {
            return Err(
                "the device plugin refuses MPS sharing under MIG strategy mixed and exits at start, so the node advertises no GPUs; set spec.mig.strategy to none or single, or share by time-slicing in the device plugin config"
                    .to_string(),
            );
        }
        if mig_strategy == "single" && !inventory.mig.is_empty() {
            return Err(
                "the device plugin refuses MPS sharing of MIG devices (MPS shares full GPUs only) and exits at start, so the node advertises no GPUs; choose a MIG layout that disables MIG on this node (such as all-disabled), or share by time-slicing in the device plugin config"
                    .to_string(),
            );
        }
    }
    let sharing_names: Vec<&str> = plugin.resources.iter().map(|r| r.name.as_str()).collect();
    let mut out: BTreeMap<String, u64> = devices
        .iter()
        .filter(|(name, _)| !sharing_names.contains(&name.as_str()))
        .map(|(name, count)| (name.clone(), *count))
        .collect();
    for resource in &plugin.resources {
        let Some(&count) = devices.get(&resource.name) else {
            // A resource this node does not have (a MIG profile under strategy none, say)
            // shares nothing.
            continue;
        };
        let replicated = count.saturating_mul(resource.replicas);
        // Two entries for one resource make the same replicas of the same devices: the larger
        // count wins rather than the sum.
        let slot = out.entry(resource.advertised_as.clone()).or_default();
        *slot = (*slot).max(replicated);
    }
    Ok(out)
}

#[cfg(test)]
#[path = "allocatable_tests.rs"]
mod tests;
