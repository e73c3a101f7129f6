//! Render stage, RuntimeClasses (pure, no IO): `nvidia` (or `operator.runtimeClass`), plus
//! `nvidia-cdi` and `nvidia-legacy` when CDI is on; none at all with the NRI plugin, which
//! injects devices without a runtime handler (docs/operand-facts.md §4).

use k8s_openapi::api::node::v1::RuntimeClass;

use super::common::{self, COMPONENT_LABEL, PART_OF, add_labels, meta};
use crate::facts::ClusterFacts;
use crate::model::ValidatedPolicy;
use crate::model::{Operand, OperandObjects};

/// What the engine knows about this operand ([`super::Descriptor`]).
pub const DESCRIPTOR: super::Descriptor = super::Descriptor {
    name: "runtime-classes",
    component: None,
    deploy_label: None,
    consumes_sharing_config: false,
    enabled: super::Enabled::When(|spec, _| !crate::model::nri_enabled(spec)),
    images: super::defaults::no_images,
    host_paths: super::defaults::no_host_paths,
    render,
    check: super::defaults::no_check,
    report: super::defaults::no_report,
};

/// Handler names the toolkit configures besides the main one when CDI is on.
pub const CDI_RUNTIME_CLASSES: [&str; 2] = ["nvidia-cdi", "nvidia-legacy"];

pub fn render(policy: &ValidatedPolicy, facts: &ClusterFacts) -> Option<OperandObjects> {
    let spec = &policy.spec;
    if common::nri_enabled(spec) {
        return None;
    }
    let mut names = vec![common::runtime_class_name(spec).to_owned()];
    if common::cdi_enabled(spec) {
        names.extend(CDI_RUNTIME_CLASSES.iter().map(|s| (*s).to_owned()));
    }
    names.dedup();
    let runtime_classes = names
        .into_iter()
        .map(|name| {
            let mut metadata = meta(Operand::RuntimeClasses, &name, facts, false);
            add_labels(&mut metadata, &[(COMPONENT_LABEL, PART_OF)]);
            RuntimeClass {
                metadata,
                // The handler is the runtime name the toolkit writes into the runtime's config.
                handler: name,
                overhead: None,
                scheduling: None,
            }
        })
        .collect();
    Some(OperandObjects {
        runtime_classes,
        ..OperandObjects::default()
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::render::tests::{facts, policy};

    fn names(objects: &OperandObjects) -> Vec<String> {
        objects
            .runtime_classes
            .iter()
            .map(|r| r.metadata.name.clone().unwrap())
            .collect()
    }

    #[test]
    fn cdi_on_by_default_renders_three_runtime_classes_with_matching_handlers() {
        let objects = render(&policy("{}"), &facts()).unwrap();
        assert_eq!(names(&objects), ["nvidia", "nvidia-cdi", "nvidia-legacy"]);
        for rc in &objects.runtime_classes {
            assert_eq!(Some(&rc.handler), rc.metadata.name.as_ref());
        }
    }

    #[test]
    fn cdi_off_renders_only_the_main_runtime_class_under_its_configured_name() {
        let objects = render(
            &policy("{cdi: {enabled: false}, operator: {runtimeClass: gpu}}"),
            &facts(),
        )
        .unwrap();
        assert_eq!(names(&objects), ["gpu"]);
    }

    #[test]
    fn nri_plugin_renders_no_runtime_class() {
        assert!(
            render(
                &policy("{cdi: {enabled: true, nriPluginEnabled: true}}"),
                &facts()
            )
            .is_none()
        );
    }
}
