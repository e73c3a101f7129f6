//! Render tests of the MIG manager: what its pods need (docs/operand-facts.md).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::test_support::*;

#[test]
fn mig_manager_renders_and_hashes_the_default_layouts() {
    let objects = objects("{}", &facts(), Operand::MigManager);
    let mut names: Vec<String> = objects
        .config_maps
        .iter()
        .map(|c| c.metadata.name.clone().unwrap())
        .collect();
    let entrypoint = names.remove(0);
    assert!(
        entrypoint.starts_with("nvidia-mig-manager-entrypoint-"),
        "{entrypoint}"
    );
    assert_eq!(names, ["default-mig-parted-config", "default-gpu-clients"]);
    let layouts = &objects.config_maps[1].data.as_ref().unwrap()["config.yaml"];
    let parsed: serde_json::Value = serde_yaml_ng::from_str(layouts).unwrap();
    let configs = parsed["mig-configs"].as_object().unwrap();
    for name in [
        "all-disabled",
        "all-enabled",
        "all-balanced",
        "all-1g.10gb",
        "all-1g.10gb.me",
        "all-7g.80gb",
    ] {
        assert!(configs.contains_key(name), "{name} missing");
    }
    // Device filters stay strings: unquoted hex is a YAML integer, which mig-parted rejects.
    let filter = &configs["all-7g.80gb"][0]["device-filter"];
    assert!(
        filter
            .as_array()
            .unwrap()
            .iter()
            .all(serde_json::Value::is_string),
        "{filter}"
    );
    let ds = &objects.daemon_sets[0];
    let p = pod(ds);
    assert_eq!((p.host_pid, p.host_ipc), (Some(true), Some(true)));
    let main = container(&p, "nvidia-mig-manager");
    assert_eq!(
        env(&main, "DEFAULT_CONFIG_FILE").as_deref(),
        Some("/mig-parted-config/config-default.yaml")
    );
    assert_eq!(env(&main, "CONFIG_FILE"), None);
    let hash = common::config_hash(objects.config_maps[1].data.as_ref().unwrap());
    assert_eq!(template_annotations(ds)[CONFIG_HASH_ANNOTATION], hash);
}

#[test]
fn mig_manager_with_a_custom_config_mounts_it_and_rolls_when_it_changes() {
    let custom = |yaml: &str| ClusterFacts {
        mig_config: Some(ConfigMapData {
            name: "layouts".to_owned(),
            data: [("config.yaml".to_owned(), yaml.to_owned())].into(),
        }),
        ..facts()
    };
    let spec = "{migManager: {config: {name: layouts}, gpuClientsConfig: {name: clients}}}";
    let a = objects(
        spec,
        &custom("version: v1\nmig-configs: {a: [{devices: all, mig-enabled: false}]}\n"),
        Operand::MigManager,
    );
    let b = objects(
        spec,
        &custom("version: v1\nmig-configs: {b: [{devices: all, mig-enabled: false}]}\n"),
        Operand::MigManager,
    );
    assert_eq!(
        a.config_maps.len(),
        1,
        "only the entrypoint: no default layouts or clients"
    );
    let main = container(&pod(&a.daemon_sets[0]), "nvidia-mig-manager");
    assert_eq!(
        env(&main, "CONFIG_FILE").as_deref(),
        Some("/mig-parted-config/config.yaml")
    );
    assert_ne!(
        template_annotations(&a.daemon_sets[0])[CONFIG_HASH_ANNOTATION],
        template_annotations(&b.daemon_sets[0])[CONFIG_HASH_ANNOTATION]
    );
}
