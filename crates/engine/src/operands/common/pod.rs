//! Containers, security contexts, volumes and mounts (render stage, pure).

use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, Container, EmptyDirVolumeSource, HostPathVolumeSource, KeyToPath,
    SELinuxOptions, SecurityContext, Volume, VolumeMount,
};

/// A container with a name, image and its command line.
pub fn container(name: &str, image: &str, command: &[&str], args: &[&str]) -> Container {
    let strings = |items: &[&str]| {
        (!items.is_empty()).then(|| items.iter().map(|s| (*s).to_owned()).collect())
    };
    Container {
        name: name.to_owned(),
        image: Some(image.to_owned()),
        command: strings(command),
        args: strings(args),
        ..Container::default()
    }
}

/// `privileged: true`.
pub fn privileged() -> SecurityContext {
    SecurityContext {
        privileged: Some(true),
        ..SecurityContext::default()
    }
}

/// `privileged: true` with SELinux level `s0` (containers that write host paths on SELinux
/// hosts).
pub fn privileged_s0() -> SecurityContext {
    SecurityContext {
        privileged: Some(true),
        se_linux_options: Some(SELinuxOptions {
            level: Some("s0".to_owned()),
            ..SELinuxOptions::default()
        }),
        ..SecurityContext::default()
    }
}

/// The type of a hostPath volume; it decides what the kubelet checks or creates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostPathType {
    /// No check.
    Any,
    /// Must exist and be a directory.
    Directory,
    /// Created (0755) when missing.
    DirectoryOrCreate,
    /// Must exist and be a file.
    File,
    /// Created empty when missing.
    FileOrCreate,
}

/// A hostPath volume.
pub fn host_path_volume(name: &str, path: &str, kind: HostPathType) -> Volume {
    let type_ = match kind {
        HostPathType::Any => None,
        HostPathType::Directory => Some("Directory"),
        HostPathType::DirectoryOrCreate => Some("DirectoryOrCreate"),
        HostPathType::File => Some("File"),
        HostPathType::FileOrCreate => Some("FileOrCreate"),
    };
    Volume {
        name: name.to_owned(),
        host_path: Some(HostPathVolumeSource {
            path: path.to_owned(),
            type_: type_.map(str::to_owned),
        }),
        ..Volume::default()
    }
}

/// A ConfigMap volume, optionally with a file mode and a key-to-path projection.
pub fn config_map_volume(
    name: &str,
    config_map: &str,
    mode: Option<i32>,
    items: &[(&str, &str)],
) -> Volume {
    Volume {
        name: name.to_owned(),
        config_map: Some(ConfigMapVolumeSource {
            name: config_map.to_owned(),
            default_mode: mode,
            items: (!items.is_empty()).then(|| {
                items
                    .iter()
                    .map(|(key, path)| KeyToPath {
                        key: (*key).to_owned(),
                        path: (*path).to_owned(),
                        mode: None,
                    })
                    .collect()
            }),
            optional: None,
        }),
        ..Volume::default()
    }
}

/// An emptyDir volume.
pub fn empty_dir_volume(name: &str) -> Volume {
    Volume {
        name: name.to_owned(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    }
}

/// A read-write mount of volume `name` at `path`.
pub fn mount(name: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: name.to_owned(),
        mount_path: path.to_owned(),
        ..VolumeMount::default()
    }
}

/// Modifiers for [`mount`].
pub trait MountExt {
    /// `readOnly: true`.
    fn read_only(self) -> Self;
    /// `mountPropagation: HostToContainer`: mounts the host makes later show up inside.
    fn host_to_container(self) -> Self;
    /// `mountPropagation: Bidirectional`: mounts made inside show up on the host (the driver
    /// container publishes its root under /run/nvidia/driver this way).
    fn bidirectional(self) -> Self;
    /// Mounts one file or directory of the volume.
    fn sub_path(self, path: &str) -> Self;
}

impl MountExt for VolumeMount {
    fn read_only(mut self) -> Self {
        self.read_only = Some(true);
        self
    }
    fn host_to_container(mut self) -> Self {
        self.mount_propagation = Some("HostToContainer".to_owned());
        self
    }
    fn bidirectional(mut self) -> Self {
        self.mount_propagation = Some("Bidirectional".to_owned());
        self
    }
    fn sub_path(mut self, path: &str) -> Self {
        self.sub_path = Some(path.to_owned());
        self
    }
}

/// A container lifecycle whose `preStop` hook runs `command` (argv, no shell of its own).
pub fn pre_stop_exec(command: &[&str]) -> k8s_openapi::api::core::v1::Lifecycle {
    use k8s_openapi::api::core::v1::{ExecAction, Lifecycle, LifecycleHandler};
    Lifecycle {
        pre_stop: Some(LifecycleHandler {
            exec: Some(ExecAction {
                command: Some(command.iter().map(|s| (*s).to_owned()).collect()),
            }),
            ..LifecycleHandler::default()
        }),
        ..Lifecycle::default()
    }
}
