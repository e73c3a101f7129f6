use super::*;
use crate::sharing::device_plugin::validate_key;
use crate::sharing::mig::{MIG_CONFIG_KEY, default_config, parse_yaml};

const T4: &str = "Tesla-T4";
const A100_40: &str = "NVIDIA-A100-SXM4-40GB";
const H100: &str = "NVIDIA-H100-80GB-HBM3";

const TIME_SLICED_4: &str = "version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
";

const TIME_SLICED_4_RENAMED: &str = "version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
";

const MPS_4: &str = "version: v1
sharing:
  mps:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
";

fn plugin(yaml: &str, mig_strategy: &str) -> PluginConfigSummary {
    validate_key("sharing-config", "any", yaml, Some(mig_strategy))
        .expect("the test's device plugin config is valid")
}

/// The mig-parted config the operator ships by default.
fn default_layouts() -> MigConfigFile {
    parse_yaml(
        "default-mig-parted-config",
        MIG_CONFIG_KEY,
        &default_config(),
    )
    .expect("the shipped mig-parted config parses")
}

fn node(product: &str, count: u32) -> NodeGpus<'_> {
    NodeGpus { product, count }
}

fn resources(entries: &[(&str, u64)]) -> BTreeMap<String, u64> {
    entries
        .iter()
        .map(|(name, count)| ((*name).to_string(), *count))
        .collect()
}

#[test]
fn time_slicing_multiplies_gpus_by_replicas() {
    // k8s-device-plugin README, "With CUDA Time-Slicing": "If this configuration were applied
    // to a node with 8 GPUs on it, the plugin would now advertise 80 `nvidia.com/gpu`
    // resources to Kubernetes instead of 8."
    let sharing = plugin(TIME_SLICED_4, "none");
    assert_eq!(
        advertised(&node(T4, 4), Some(&sharing), "none", None),
        Ok(resources(&[("nvidia.com/gpu", 16)]))
    );
}

#[test]
fn rename_by_default_advertises_only_the_shared_name() {
    // k8s-device-plugin README, "With CUDA Time-Slicing": "If `renameByDefault=true`, then each
    // resource will be advertised under the name `<resource-name>.shared` instead of simply
    // `<resource-name>`." ... "then 80 `nvidia.com/gpu.shared` resources would be advertised to
    // Kubernetes instead of 8 `nvidia.com/gpu` resources."
    let sharing = plugin(TIME_SLICED_4_RENAMED, "none");
    let advertised = advertised(&node(T4, 4), Some(&sharing), "none", None);
    assert_eq!(advertised, Ok(resources(&[("nvidia.com/gpu.shared", 16)])));
}

#[test]
fn no_sharing_advertises_one_gpu_per_gpu() {
    // k8s-device-plugin README: the plugin exposes "the number of GPUs on each nodes of your
    // cluster"; under MIG strategy none the MIG layout does not change that.
    assert_eq!(
        advertised(&node(T4, 4), None, "none", None),
        Ok(resources(&[("nvidia.com/gpu", 4)]))
    );
    let layouts = default_layouts();
    assert_eq!(
        advertised(
            &node(A100_40, 8),
            None,
            "none",
            Some((&layouts, "all-1g.5gb"))
        ),
        Ok(resources(&[("nvidia.com/gpu", 8)]))
    );
}

#[test]
fn mixed_strategy_advertises_each_profile_under_its_own_name() {
    // k8s-device-plugin README, MIG_STRATEGY: "With a `MIG_STRATEGY` of mixed, you will have
    // additional resources available to you of the form
    // `nvidia.com/mig-<slice_count>g.<memory_size>gb`".
    let layouts = default_layouts();
    assert_eq!(
        advertised(
            &node(A100_40, 8),
            None,
            "mixed",
            Some((&layouts, "all-1g.5gb"))
        ),
        Ok(resources(&[("nvidia.com/mig-1g.5gb", 56)]))
    );
}

#[test]
fn single_strategy_advertises_each_mig_device_as_a_gpu() {
    // GPU feature discovery README, "MIG 'single' strategy": "the single `nvidia.com/gpu` label
    // is overloaded to provide information about MIG devices on the node, rather than full
    // GPUs ... a system with 8 full GPUs, each of which is partitioned into 7 equal sized MIG
    // devices (56 total)."
    let layouts = default_layouts();
    assert_eq!(
        advertised(
            &node(A100_40, 8),
            None,
            "single",
            Some((&layouts, "all-1g.5gb"))
        ),
        Ok(resources(&[("nvidia.com/gpu", 56)]))
    );
}

#[test]
fn single_strategy_with_several_profiles_advertises_nothing() {
    // GPU feature discovery README, "MIG 'single' strategy": "This assumes all GPUs on the node
    // have been divided into identical partitions of the same size." The plugin exits with
    // "invalid MIG configuration" when they are not.
    let layouts = default_layouts();
    let why = advertised(
        &node(A100_40, 8),
        None,
        "single",
        Some((&layouts, "all-balanced")),
    )
    .expect_err("all-balanced mixes profiles");
    assert!(why.contains("more than one MIG device type"), "{why}");
    assert!(why.contains("mixed"), "{why}");
}

#[test]
fn mixed_strategy_counts_every_profile_of_a_balanced_layout() {
    // k8s-device-plugin README, MIG_STRATEGY: under mixed "you will have additional resources
    // available to you of the form `nvidia.com/mig-<slice_count>g.<memory_size>gb`"; the
    // all-balanced layout gives each A100-40GB 2 × 1g.5gb, 1 × 2g.10gb and 1 × 3g.20gb.
    let layouts = default_layouts();
    assert_eq!(
        advertised(
            &node(A100_40, 8),
            None,
            "mixed",
            Some((&layouts, "all-balanced"))
        ),
        Ok(resources(&[
            ("nvidia.com/mig-1g.5gb", 16),
            ("nvidia.com/mig-2g.10gb", 8),
            ("nvidia.com/mig-3g.20gb", 8),
        ]))
    );
}

#[test]
fn time_slicing_replicates_mig_resources_too() {
    // k8s-device-plugin README, "With CUDA Time-Slicing": "the only supported resource available
    // for time-slicing are `nvidia.com/gpu` as well as any of the resource types that emerge
    // from configuring a node with the mixed MIG strategy."
    let sharing = plugin(
        "version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/mig-1g.5gb
      replicas: 2
",
        "mixed",
    );
    let layouts = default_layouts();
    assert_eq!(
        advertised(
            &node(A100_40, 8),
            Some(&sharing),
            "mixed",
            Some((&layouts, "all-balanced"))
        ),
        Ok(resources(&[
            ("nvidia.com/mig-1g.5gb", 32),
            ("nvidia.com/mig-2g.10gb", 8),
            ("nvidia.com/mig-3g.20gb", 8),
        ]))
    );
}

#[test]
fn mps_multiplies_full_gpus_by_replicas() {
    // k8s-device-plugin README, "With CUDA MPS": "If this configuration were applied to a node
    // with 8 GPUs on it, the plugin would now advertise 80 `nvidia.com/gpu` resources to
    // Kubernetes instead of 8."
    let sharing = plugin(MPS_4, "none");
    assert_eq!(
        advertised(&node(H100, 8), Some(&sharing), "none", None),
        Ok(resources(&[("nvidia.com/gpu", 32)]))
    );
}

#[test]
fn mps_on_mig_devices_advertises_nothing() {
    // k8s-device-plugin README, "With CUDA MPS": "Sharing with MPS is currently not supported
    // on devices with MIG enabled."
    let sharing = plugin(MPS_4, "single");
    let layouts = default_layouts();
    let why = advertised(
        &node(H100, 8),
        Some(&sharing),
        "single",
        Some((&layouts, "all-1g.10gb")),
    )
    .expect_err("MPS cannot share MIG devices");
    assert!(why.contains("MPS"), "{why}");
}

#[test]
fn a_layout_with_mig_disabled_leaves_whole_gpus() {
    // mig-parted README: "the `all-disabled` label refers to the MIG configuration that
    // disables MIG for all GPUs on the node"; the GPU Operator's MIG page: "mixed: MIG mode is
    // not enabled on all GPUs on a node", so GPUs without MIG stay `nvidia.com/gpu`.
    let layouts = default_layouts();
    for strategy in ["single", "mixed"] {
        assert_eq!(
            advertised(
                &node(A100_40, 8),
                None,
                strategy,
                Some((&layouts, "all-disabled"))
            ),
            Ok(resources(&[("nvidia.com/gpu", 8)])),
            "strategy {strategy}"
        );
    }
}

#[test]
fn mixed_strategy_keeps_mig_disabled_gpus_whole() {
    // mig-parted README: "the `custom-config` label defines a completely custom configuration
    // which disables MIG on the first 4 GPUs on the node, and applies a mix of MIG devices
    // across the rest"; the GPU Operator's MIG page: "mixed: MIG mode is not enabled on all GPUs
    // on a node".
    let layouts = parse_yaml(
        "custom-mig-parted-config",
        MIG_CONFIG_KEY,
        r#"version: v1
mig-configs:
  half:
    - devices: all
      mig-enabled: false
    - devices: [4, 5, 6, 7]
      mig-enabled: true
      mig-devices:
        "3g.20gb": 2
"#,
    )
    .expect("the test's layout parses");
    assert_eq!(
        advertised(&node(A100_40, 8), None, "mixed", Some((&layouts, "half"))),
        Ok(resources(&[
            ("nvidia.com/gpu", 4),
            ("nvidia.com/mig-3g.20gb", 8)
        ]))
    );
    let why = advertised(&node(A100_40, 8), None, "single", Some((&layouts, "half")))
        .expect_err("single needs every GPU alike");
    assert!(why.contains("MIG disabled"), "{why}");
}

#[test]
fn an_unknown_layout_is_named_in_the_error() {
    // mig-parted README: "Each of the sections under `mig-configs` is user-defined, with custom
    // labels used to refer to them" and "a runtime flag (or environment variable) can be used to
    // decide which of these configurations to actually apply": a label the file does not
    // define names no configuration.
    let layouts = default_layouts();
    let why = advertised(
        &node(A100_40, 8),
        None,
        "mixed",
        Some((&layouts, "all-9g.99gb")),
    )
    .expect_err("the layout does not exist");
    assert!(why.contains("\"all-9g.99gb\""), "{why}");
}

#[test]
fn a_layout_without_an_entry_for_the_model_is_named_in_the_error() {
    // No README states the device-filter rule in prose; mig-parted's example mig-manager config
    // (deployments/container/nvidia-mig-manager-example.yaml) shows it: entries such as
    // `- device-filter: ["0x20B210DE", "0x20B510DE", ...]` apply to those PCI device ids only,
    // so a T4 gets nothing from the per-model entries of all-1g.5gb.
    let layouts = default_layouts();
    let why = advertised(&node(T4, 4), None, "mixed", Some((&layouts, "all-1g.5gb")))
        .expect_err("no entry of all-1g.5gb selects a T4");
    assert!(why.contains("\"all-1g.5gb\""), "{why}");
    assert!(why.contains(T4), "{why}");
}

#[test]
fn an_unknown_mig_strategy_is_refused() {
    // k8s-device-plugin README, MIG_STRATEGY: "[none | single | mixed] (default 'none')".
    let why = advertised(&node(T4, 4), None, "Mixed", None).expect_err("strategies are exact");
    assert!(why.contains("\"Mixed\""), "{why}");
}

#[test]
fn a_layout_that_leaves_gpus_unconfigured_cannot_be_predicted() {
    // mig-parted README: its custom-config example names every GPU of the DGX-A100 ("disables
    // MIG on the first 4 GPUs on the node, and applies a mix of MIG devices across the rest").
    // What happens to a GPU no entry names is not in the README: mig-parted walks only the GPUs
    // an entry selects (WalkSelectedMigConfigForEachGPU), so it keeps the MIG mode it had.
    let layouts = parse_yaml(
        "custom-mig-parted-config",
        MIG_CONFIG_KEY,
        r#"version: v1
mig-configs:
  first-half:
    - devices: [0, 1, 2, 3]
      mig-enabled: true
      mig-devices:
        "1g.5gb": 7
"#,
    )
    .expect("the test's layout parses");
    let why = advertised(
        &node(A100_40, 8),
        None,
        "mixed",
        Some((&layouts, "first-half")),
    )
    .expect_err("GPUs 4-7 are left as they are");
    assert!(why.contains("\"first-half\""), "{why}");
    assert!(why.contains("GPU 4, 5, 6, 7"), "{why}");
}

#[test]
fn single_strategy_labels_count_mig_devices() {
    // GPU feature discovery README, "MIG 'single' strategy": `nvidia.com/gpu.product
    // (overridden)` is "Model of the GPU (with MIG info added)", e.g. A100-SXM4-40GB-MIG-1g.5gb,
    // and `nvidia.com/gpu.count (overridden)` is the "Number of MIG devices", e.g. 56.
    let labelled = node("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", 56);
    let sharing = plugin(TIME_SLICED_4, "single");
    assert_eq!(
        advertised(&labelled, Some(&sharing), "single", None),
        Ok(resources(&[("nvidia.com/gpu", 224)]))
    );
    assert_eq!(
        advertised(&labelled, None, "mixed", None),
        Ok(resources(&[("nvidia.com/mig-1g.5gb", 56)]))
    );
    // The boards behind 56 MIG devices are not on the labels, so neither a new layout nor MIG
    // strategy none can be predicted.
    let layouts = default_layouts();
    let why = advertised(&labelled, None, "single", Some((&layouts, "all-2g.10gb")))
        .expect_err("the boards are not labelled");
    assert!(why.contains("counts MIG devices"), "{why}");
    assert!(advertised(&labelled, None, "none", None).is_err());
}

#[test]
fn media_extension_profiles_are_advertised_with_a_dot() {
    // Not stated in the READMEs: k8s-device-plugin v0.20.0 names a mixed-strategy resource
    // `"mig-" + profile` with every `+` replaced by `.` (internal/rm/rm.go,
    // AddDefaultResourcesToConfig), as a resource name may not hold `+`.
    let layouts = default_layouts();
    assert_eq!(
        advertised(
            &node(A100_40, 8),
            None,
            "mixed",
            Some((&layouts, "all-1g.5gb.me"))
        ),
        Ok(resources(&[("nvidia.com/mig-1g.5gb.me", 8)]))
    );
}
