//! NVIDIA's driver config digest (pure): the value NVIDIA's operator (v26.7) puts in
//! `DRIVER_CONFIG_DIGEST` on the driver pods it renders, recomputed from a pod spec. A driver
//! pod NVIDIA's operator started carries it; recomputed over what this operator would run, it
//! tells whether that pod already runs the same driver installation
//! (docs/operand-facts.md §5.0).
//!
//! NVIDIA extracts its `DriverInstallState` from the pod spec (the manager's image and env; the
//! driver container's image, command, args, env, Secret env source and mounts; the images of
//! the peermem, GDS, GDRCopy and Driver Toolkit sidecars; every volume; the host root) and
//! hashes the fields that are not empty, in the alphabetical order of their Go names, each as
//! `Name:` followed by the value as the Go library spew prints it with `%#v`, with FNV-1a
//! (32 bits), written in decimal.

use k8s_openapi::api::core::v1::{Container, EnvVar, PodSpec};

/// One field's value, printed the way spew prints its Go type.
enum Field {
    Text(String),
    Flag(bool),
    Words(Vec<String>),
    Env(Vec<(String, String)>),
    Mounts(Vec<[String; 4]>),
    Volumes(Vec<[String; 4]>),
}

impl Field {
    fn is_zero(&self) -> bool {
        match self {
            Field::Text(s) => s.is_empty(),
            Field::Flag(b) => !b,
            Field::Words(v) => v.is_empty(),
            Field::Env(v) => v.is_empty(),
            Field::Mounts(v) | Field::Volumes(v) => v.is_empty(),
        }
    }

    /// spew's `%#v`: the type in parentheses, then the value; the elements of a slice without
    /// their type, a struct's fields as `Name:(type)value` separated by spaces.
    fn spew(&self) -> String {
        let structs =
            |ty: &str, items: Vec<String>| format!("([]config.{ty})[{}]", items.join(" "));
        match self {
            Field::Text(s) => format!("(string){s}"),
            Field::Flag(b) => format!("(bool){b}"),
            Field::Words(v) => format!("([]string)[{}]", v.join(" ")),
            Field::Env(v) => structs(
                "EnvVar",
                v.iter()
                    .map(|(n, val)| format!("{{Name:(string){n} Value:(string){val}}}"))
                    .collect(),
            ),
            Field::Mounts(v) => structs(
                "VolumeMountConfig",
                v.iter()
                    .map(|[n, path, sub, ro]| {
                        format!(
                            "{{Name:(string){n} MountPath:(string){path} SubPath:(string){sub} \
                             ReadOnly:(bool){ro}}}"
                        )
                    })
                    .collect(),
            ),
            Field::Volumes(v) => structs(
                "VolumeConfig",
                v.iter()
                    .map(|[n, cm, secret, host]| {
                        format!(
                            "{{Name:(string){n} ConfigMapName:(string){cm} \
                             SecretName:(string){secret} HostPath:(string){host}}}"
                        )
                    })
                    .collect(),
            ),
        }
    }
}

/// The env var the digest is carried in; NVIDIA computes the digest before setting it.
const DIGEST_ENV: &str = "DRIVER_CONFIG_DIGEST";

/// Plain-valued env vars (a value from the downward API or a reference does not count), by name.
fn env(vars: Option<&Vec<EnvVar>>) -> Field {
    let mut out: Vec<(String, String)> = vars
        .into_iter()
        .flatten()
        .filter(|e| e.value_from.is_none() && e.name != DIGEST_ENV)
        .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Field::Env(out)
}

fn image(c: &Container) -> Field {
    Field::Text(c.image.clone().unwrap_or_default())
}

/// The text NVIDIA hashes for `pod` (its `DriverInstallState`, non-empty fields only).
pub fn digest_input(pod: &PodSpec) -> String {
    let mut fields: Vec<(&str, Field)> = Vec::new();
    if let Some(manager) = pod
        .init_containers
        .iter()
        .flatten()
        .find(|c| c.name == "k8s-driver-manager")
    {
        fields.push(("DriverManagerImage", image(manager)));
        fields.push(("ManagerEnv", env(manager.env.as_ref())));
    }
    for c in &pod.containers {
        match c.name.as_str() {
            "nvidia-driver-ctr" => {
                fields.push(("DriverImage", image(c)));
                fields.push((
                    "DriverCommand",
                    Field::Words(c.command.clone().unwrap_or_default()),
                ));
                fields.push((
                    "DriverArgs",
                    Field::Words(c.args.clone().unwrap_or_default()),
                ));
                fields.push(("DriverEnv", env(c.env.as_ref())));
                // The last Secret wins, as in NVIDIA's loop.
                let secret = c
                    .env_from
                    .iter()
                    .flatten()
                    .filter_map(|e| e.secret_ref.as_ref())
                    .next_back()
                    .map(|s| s.name.clone())
                    .unwrap_or_default();
                fields.push(("SecretEnvSource", Field::Text(secret)));
                let mut mounts: Vec<[String; 4]> = c
                    .volume_mounts
                    .iter()
                    .flatten()
                    .map(|m| {
                        [
                            m.name.clone(),
                            m.mount_path.clone(),
                            m.sub_path.clone().unwrap_or_default(),
                            m.read_only.unwrap_or(false).to_string(),
                        ]
                    })
                    .collect();
                mounts.sort_by(|a, b| (&a[0], &a[1]).cmp(&(&b[0], &b[1])));
                fields.push(("AdditionalVolumeMounts", Field::Mounts(mounts)));
            }
            "nvidia-peermem-ctr" => {
                fields.push(("PeermemImage", image(c)));
                fields.push(("GPUDirectRDMAEnabled", Field::Flag(true)));
            }
            "nvidia-fs-ctr" => {
                fields.push(("GDSImage", image(c)));
                fields.push(("GDSEnabled", Field::Flag(true)));
                fields.push(("GDSEnv", env(c.env.as_ref())));
            }
            "nvidia-gdrcopy-ctr" => {
                fields.push(("GDRCopyImage", image(c)));
                fields.push(("GDRCopyEnabled", Field::Flag(true)));
                fields.push(("GDRCopyEnv", env(c.env.as_ref())));
            }
            "openshift-driver-toolkit-ctr" => {
                fields.push(("DTKImage", image(c)));
                fields.push(("DTKEnabled", Field::Flag(true)));
            }
            _ => {}
        }
    }
    let mut volumes: Vec<[String; 4]> = pod
        .volumes
        .iter()
        .flatten()
        .map(|v| {
            [
                v.name.clone(),
                v.config_map
                    .as_ref()
                    .map(|c| c.name.clone())
                    .unwrap_or_default(),
                v.secret
                    .as_ref()
                    .and_then(|s| s.secret_name.clone())
                    .unwrap_or_default(),
                v.host_path
                    .as_ref()
                    .map(|h| h.path.clone())
                    .unwrap_or_default(),
            ]
        })
        .collect();
    volumes.sort_by(|a, b| a[0].cmp(&b[0]));
    let host_root = volumes
        .iter()
        .find(|v| v[0] == "host-root")
        .map(|v| v[3].clone())
        .unwrap_or_default();
    fields.push(("AdditionalVolumes", Field::Volumes(volumes)));
    fields.push(("HostRoot", Field::Text(host_root)));

    // A later container of the same kind replaces an earlier one's fields, as NVIDIA's
    // assignments do; then Go's byte order of the names.
    let mut named: std::collections::BTreeMap<&str, Field> = std::collections::BTreeMap::new();
    for (name, field) in fields {
        named.insert(name, field);
    }
    named
        .iter()
        .filter(|(_, f)| !f.is_zero())
        .map(|(name, f)| format!("{name}:{}", f.spew()))
        .collect()
}

/// FNV-1a, 32 bits.
fn fnv1a32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5_u32, |hash, b| {
        (hash ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

/// The `DRIVER_CONFIG_DIGEST` NVIDIA's operator would put on a driver pod with this spec.
pub fn digest(pod: &PodSpec) -> String {
    fnv1a32(digest_input(pod).as_bytes()).to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use k8s_openapi::api::apps::v1::DaemonSet;

    use super::*;

    fn nvidia_driver() -> DaemonSet {
        serde_yaml_ng::from_str(include_str!(
            "../../../../operator/tests/fixtures/nvidia-v26.7-render/nvidia-driver-daemonset.yaml"
        ))
        .unwrap()
    }

    fn pod(ds: &DaemonSet) -> PodSpec {
        ds.spec.clone().unwrap().template.spec.unwrap()
    }

    fn carried(pod: &PodSpec) -> Vec<String> {
        pod.init_containers
            .iter()
            .flatten()
            .chain(&pod.containers)
            .flat_map(|c| c.env.iter().flatten())
            .filter(|e| e.name == DIGEST_ENV)
            .filter_map(|e| e.value.clone())
            .collect()
    }

    #[test]
    fn fnv1a32_matches_the_reference_vectors() {
        // The published FNV-1a test vectors.
        assert_eq!(fnv1a32(b""), 0x811c_9dc5);
        assert_eq!(fnv1a32(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a32(b"foobar"), 0xbf9c_f968);
    }

    #[test]
    fn the_digest_of_nvidias_default_driver_pod_is_the_one_it_carries() {
        let pod = pod(&nvidia_driver());
        assert_eq!(carried(&pod), ["3379408550", "3379408550"]);
        let input = digest_input(&pod);
        assert!(
            input.starts_with(
                "AdditionalVolumeMounts:([]config.VolumeMountConfig)[{Name:(string)dev-log \
                 MountPath:(string)/dev/log SubPath:(string) ReadOnly:(bool)false}"
            ),
            "{input}"
        );
        assert_eq!(digest(&pod), "3379408550", "{input}");
    }

    #[test]
    fn what_changes_the_installation_changes_the_digest_and_the_rest_does_not() {
        let mut ds = nvidia_driver();
        let base = digest(&pod(&ds));
        let spec = ds.spec.as_mut().unwrap().template.spec.as_mut().unwrap();
        // Tolerations, probes and a value from the downward API do not count.
        spec.tolerations = None;
        spec.containers[0].startup_probe = None;
        spec.containers[0]
            .env
            .get_or_insert_with(Vec::new)
            .push(EnvVar {
                name: "NODE".into(),
                value_from: Some(Default::default()),
                ..EnvVar::default()
            });
        assert_eq!(digest(&pod(&ds)), base);
        // The driver version does.
        let spec = ds.spec.as_mut().unwrap().template.spec.as_mut().unwrap();
        spec.containers[0].image = Some("nvcr.io/nvidia/driver:580.105.08-ubuntu22.04".into());
        assert_ne!(digest(&pod(&ds)), base);
    }
}

#[cfg(test)]
mod ours {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use k8s_openapi::api::apps::v1::DaemonSet;
    use k8s_openapi::api::core::v1::{HostPathVolumeSource, Volume};

    use super::digest_input;
    use crate::operands::test_support::*;

    #[test]
    fn our_default_driver_differs_from_nvidias_in_its_digest_only_by_two_known_fields() {
        let nvidia: DaemonSet = serde_yaml_ng::from_str(include_str!(
            "../../../../operator/tests/fixtures/nvidia-v26.7-render/nvidia-driver-daemonset.yaml"
        ))
        .unwrap();
        let mut f = facts();
        f.os_tag = Some("ubuntu22.04".into());
        // NVIDIA's chart passes `driver.kernelModuleType: auto`, as ours does.
        let chart = "driver: {kernelModuleType: auto}";
        let mut ours = pod(&daemon_set(chart, &f, Operand::Driver));
        // The two differences docs/operand-facts.md §5.0 names.
        ours.volumes.as_mut().unwrap().push(Volume {
            name: "run-nvidia-validations".into(),
            host_path: Some(HostPathVolumeSource {
                path: "/run/nvidia/validations".into(),
                type_: Some("DirectoryOrCreate".into()),
            }),
            ..Volume::default()
        });
        for m in ours.containers[0].volume_mounts.as_mut().unwrap() {
            if m.name == "driver-startup-probe-script" {
                m.read_only = None;
            }
        }
        assert_eq!(digest_input(&ours), digest_input(&pod(&nvidia)));
    }
}
