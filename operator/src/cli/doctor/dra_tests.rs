//! The DRA checks on hand-made snapshots: slices like NVIDIA's DRA driver publishes, claims
//! from templates and by name, devices held by other claims; each finding's text and `-o json`
//! is a golden file (`testdata/doctor-dra-*`, `UPDATE_GOLDEN=1` rewrites them).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::cli::golden::assert_golden;
use serde_json::{Value, json};

use super::super::{Output, Report, Snapshot};
use super::*;

const NS: &str = "team-a";

fn node(name: &str, gpus: Option<u32>, taint: bool) -> Node {
    let mut n = json!({"metadata": {"name": name, "labels": {
        "nvidia.com/gpu.present": "true", "kubernetes.io/hostname": name}}});
    if let Some(g) = gpus {
        n["status"] = json!({"allocatable": {"nvidia.com/gpu": g.to_string()}});
    }
    if taint {
        n["spec"] =
            json!({"taints": [{"key": "dedicated", "value": "infer", "effect": "NoSchedule"}]});
    }
    serde_json::from_value(n).unwrap()
}

fn gpu(name: &str, product: &str, memory: &str) -> Value {
    json!({"name": name, "attributes": {
            "type": {"string": "gpu"}, "productName": {"string": product},
            "driverVersion": {"version": "580.95.5"}},
        "capacity": {"memory": {"value": memory}}})
}

fn mig(name: &str, profile: &str) -> Value {
    json!({"name": name, "attributes": {
            "type": {"string": "mig"}, "productName": {"string": "NVIDIA A100-SXM4-40GB"},
            "profile": {"string": profile}},
        "capacity": {"memory": {"value": "4864Mi"}}})
}

fn slice(node: &str, devices: Vec<Value>) -> ResourceSlice {
    serde_json::from_value(json!({
        "metadata": {"name": format!("{node}-gpu.nvidia.com")},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": devices}}))
    .unwrap()
}

fn class(name: &str, expression: &str) -> DeviceClass {
    serde_json::from_value(json!({"metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]}}))
    .unwrap()
}

fn classes() -> Vec<DeviceClass> {
    vec![
        class(
            "gpu.nvidia.com",
            "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
        ),
        class(
            "mig.nvidia.com",
            "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'",
        ),
        class(
            "compute-domain-default-channel.nvidia.com",
            "device.driver == 'compute-domain.nvidia.com'",
        ),
    ]
}

fn request(name: &str, class: &str, cel: Option<&str>) -> Value {
    let mut exactly = json!({"deviceClassName": class});
    if let Some(cel) = cel {
        exactly["selectors"] = json!([{"cel": {"expression": cel}}]);
    }
    json!({"name": name, "exactly": exactly})
}

fn template(name: &str, requests: Value) -> ResourceClaimTemplate {
    serde_json::from_value(json!({"metadata": {"name": name, "namespace": NS},
        "spec": {"spec": {"devices": {"requests": requests}}}}))
    .unwrap()
}

/// A claim generated for `pod` from a template, allocated `devices` on `node` when given.
fn claim(name: &str, requests: Value, allocated: Option<(&str, &[&str], &str)>) -> ResourceClaim {
    let mut c = json!({"metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": requests}}});
    if let Some((node, devices, pod)) = allocated {
        let results: Vec<Value> = devices
            .iter()
            .map(|d| json!({"request": "mig", "driver": "gpu.nvidia.com", "pool": node, "device": d}))
            .collect();
        c["status"] = json!({
            "allocation": {"devices": {"results": results},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]}},
            "reservedFor": [{"resource": "pods", "name": pod, "uid": format!("uid-{pod}")}]});
    }
    serde_json::from_value(c).unwrap()
}

/// A Pending pod with one claim `gpu` from `template`, generated as `<pod>-gpu`.
fn pod(name: &str, template: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {"containers": [{"name": "c", "resources": {"claims": [{"name": "gpu"}]}}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}]},
        "status": {"phase": "Pending",
                   "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": format!("{name}-gpu")}]}}))
    .unwrap()
}

/// A ClusterPolicy that reports itself ready, so that only the DRA checks speak.
fn ready_policy() -> crate::api::ClusterPolicy {
    let condition = |kind: &str, ok: bool, reason: &str| {
        json!({"type": kind, "status": if ok { "True" } else { "False" }, "reason": reason,
            "message": "", "observedGeneration": 1, "lastTransitionTime": "2026-01-01T00:00:00Z"})
    };
    serde_json::from_value(json!({
        "apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
        "metadata": {"name": "cluster-policy", "generation": 1}, "spec": {},
        "status": {"state": "ready", "namespace": "gpu-operator",
            "conditions": [condition("Ready", true, "Ready"), condition("Error", false, "NoError")]}}))
    .unwrap()
}

/// Two nodes without the device plugin: a T4 and an A100-80GB with two GPUs; a third with
/// one A100-40GB split into two 1g.5gb MIG devices.
fn snapshot() -> Snapshot {
    Snapshot {
        nodes: vec![
            node("node-t4", None, false),
            node("node-a100", None, false),
            node("node-mig", None, false),
        ],
        operator_namespace: "gpu-operator".into(),
        policy: Some(ready_policy()),
        dra: DraSnapshot {
            slices: vec![
                slice("node-t4", vec![gpu("gpu-0", "Tesla T4", "15360Mi")]),
                slice(
                    "node-a100",
                    vec![
                        gpu("gpu-0", "NVIDIA A100-SXM4-80GB", "81920Mi"),
                        gpu("gpu-1", "NVIDIA A100-SXM4-80GB", "81920Mi"),
                    ],
                ),
                slice(
                    "node-mig",
                    vec![
                        mig("gpu-0-mig-1g5gb-19-2", "1g.5gb"),
                        mig("gpu-0-mig-1g5gb-19-3", "1g.5gb"),
                    ],
                ),
            ],
            classes: classes(),
            ..DraSnapshot::default()
        },
        ..Snapshot::default()
    }
}

/// Adds the template and its generated claim for `pod`.
fn with_claim(mut s: Snapshot, pod: &str, template_name: &str, requests: Value) -> Snapshot {
    s.dra
        .templates
        .push(template(template_name, requests.clone()));
    s.dra
        .claims
        .push(claim(&format!("{pod}-gpu"), requests, None));
    s
}

fn nodes(s: &Snapshot) -> Vec<&Node> {
    s.nodes.iter().collect()
}

fn checks(d: &Diagnosis) -> Vec<&'static str> {
    d.faults.iter().map(|f| f.check).collect()
}

/// The doctor's whole report on `pod`, text and JSON, against `testdata/doctor-dra-<name>.*`.
fn assert_report_golden(name: &str, s: &Snapshot, pod: &Pod) -> Report {
    let report = Report::of_pod(s, pod);
    assert_golden(
        &format!("doctor-dra-{name}.txt"),
        &report.render(Output::Text).unwrap(),
    );
    assert_golden(
        &format!("doctor-dra-{name}.json"),
        &report.render(Output::Json).unwrap(),
    );
    report
}

const BIG: &str = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('100Gi')) >= 0";

#[test]
fn more_memory_than_any_gpu_names_the_selector_and_each_nodes_memory() {
    let s = with_claim(
        snapshot(),
        "too-big",
        "huge",
        json!([request("gpu", "gpu.nvidia.com", Some(BIG))]),
    );
    let p = pod("too-big", "huge");
    let d = diagnose(&s.dra, &p, &nodes(&s));
    assert_eq!(checks(&d), [DRA_NO_MATCHING_DEVICE]);
    let memory = &d.faults[0];
    assert!(
        memory.problem.contains("request gpu.selectors[0]"),
        "{memory:?}"
    );
    assert!(
        memory
            .problem
            .contains("node-a100: 2 devices (capacity[\"gpu.nvidia.com\"].memory is 81920Mi)"),
        "{memory:?}"
    );
    assert!(
        memory
            .problem
            .contains("node-t4: 1 device (capacity[\"gpu.nvidia.com\"].memory is 15360Mi)"),
        "{memory:?}"
    );
    assert!(
        memory
            .fix
            .contains("kubectl get resourceslices --field-selector spec.nodeName="),
        "{memory:?}"
    );
    assert!(
        memory
            .fix
            .contains("kubectl -n team-a edit resourceclaimtemplate huge"),
        "{memory:?}"
    );
    // The MIG devices are ruled out by the class, before the request's selector: a footnote.
    assert!(
        memory.problem.ends_with(
            "besides, DeviceClass gpu.nvidia.com.selectors[0] rules out node-mig: 2 devices"
        ),
        "{memory:?}"
    );
    assert_eq!(d.claims[0].state, "unsatisfiable");
    assert_eq!(
        d.claims[0].requests[0]
            .nodes
            .iter()
            .map(|n| n.matching)
            .sum::<usize>(),
        0
    );
    assert_report_golden("too-much-memory", &s, &p);
}

#[test]
fn a_product_not_present_names_the_attribute_each_node_publishes() {
    let s = with_claim(
        snapshot(),
        "h100",
        "h100",
        json!([request(
            "gpu",
            "gpu.nvidia.com",
            Some("device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H100 80GB HBM3'")
        )]),
    );
    let p = pod("h100", "h100");
    let d = diagnose(&s.dra, &p, &nodes(&s));
    assert_eq!(checks(&d)[0], DRA_NO_MATCHING_DEVICE);
    assert!(
        d.faults[0]
            .problem
            .contains("attributes[\"gpu.nvidia.com\"].productName is \"NVIDIA A100-SXM4-80GB\""),
        "{:?}",
        d.faults[0]
    );
    assert!(
        d.faults[0].problem.contains("productName is \"Tesla T4\""),
        "{:?}",
        d.faults[0]
    );
    assert_report_golden("product-not-present", &s, &p);
}

#[test]
fn a_mig_profile_whose_devices_are_all_held_names_the_holding_claims_and_pods() {
    let mig_request = json!([request(
        "mig",
        "mig.nvidia.com",
        Some("device.attributes['gpu.nvidia.com'].profile == '1g.5gb'")
    )]);
    let mut s = with_claim(snapshot(), "third", "one-mig", mig_request.clone());
    s.dra.claims.push(claim(
        "first-gpu",
        mig_request.clone(),
        Some(("node-mig", &["gpu-0-mig-1g5gb-19-2"], "first")),
    ));
    s.dra.claims.push(claim(
        "second-gpu",
        mig_request,
        Some(("node-mig", &["gpu-0-mig-1g5gb-19-3"], "second")),
    ));
    let p = pod("third", "one-mig");
    let d = diagnose(&s.dra, &p, &nodes(&s));
    assert_eq!(checks(&d), [DRA_DEVICES_ALLOCATED]);
    let f = &d.faults[0];
    assert!(f.problem.contains("ResourceClaim team-a/first-gpu (reserved for team-a/first) holds gpu.nvidia.com/node-mig/gpu-0-mig-1g5gb-19-2"), "{f:?}");
    assert!(
        f.problem
            .contains("ResourceClaim team-a/second-gpu (reserved for team-a/second)"),
        "{f:?}"
    );
    assert!(f.problem.contains("node-mig: 2 matching, 0 free"), "{f:?}");
    assert!(
        f.fix
            .starts_with("kubectl -n team-a describe resourceclaim first-gpu"),
        "{f:?}"
    );
    let node = &d.claims[0].requests[0]
        .nodes
        .iter()
        .find(|n| n.node == "node-mig")
        .unwrap();
    assert_eq!((node.matching, node.free, node.held_by.len()), (2, 0, 2));
    assert_report_golden("devices-held", &s, &p);

    // With one of them freed the same pod fits.
    s.dra.claims.retain(|c| c.name_any() != "second-gpu");
    let d = diagnose(&s.dra, &p, &nodes(&s));
    assert!(d.faults.is_empty(), "{:?}", d.faults);
    assert_eq!(d.claims[0].state, "ok");
    assert_eq!(d.claims[0].nodes, ["node-mig"]);
}

#[test]
fn a_satisfiable_claim_reads_ok_with_the_nodes_it_fits() {
    let s = with_claim(
        snapshot(),
        "fits",
        "big",
        json!([request(
            "gpu",
            "gpu.nvidia.com",
            Some("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0")
        )]),
    );
    let p = pod("fits", "big");
    let d = diagnose(&s.dra, &p, &nodes(&s));
    assert!(d.faults.is_empty() && d.hints.is_empty(), "{d:?}");
    assert_eq!(d.claims[0].state, "ok");
    assert_eq!(d.claims[0].nodes, ["node-a100"]);
    let report = assert_report_golden("ok", &s, &p);
    assert!(report.faults.is_empty());
    assert!(
        report
            .render(Output::Text)
            .unwrap()
            .contains("claim gpu (ResourceClaim fits-gpu from template big): ok (fits node-a100)")
    );
}

#[test]
fn a_node_the_pod_does_not_tolerate_is_not_where_its_claim_fits() {
    let mut s = with_claim(
        snapshot(),
        "fits",
        "big",
        json!([request(
            "gpu",
            "gpu.nvidia.com",
            Some(BIG.replace("100Gi", "40Gi").as_str())
        )]),
    );
    s.nodes[1] = node("node-a100", None, true);
    let p = pod("fits", "big");
    let allowed: Vec<&Node> = s
        .nodes
        .iter()
        .filter(|n| n.name_any() != "node-a100")
        .collect();
    let d = diagnose(&s.dra, &p, &allowed);
    assert_eq!(checks(&d), [DRA_NO_MATCHING_DEVICE]);
    // Through the doctor: its own node filter leaves the tainted node out.
    let report = Report::of_pod(&s, &p);
    assert_eq!(report.resource_claims[0].state, "unsatisfiable");
    assert!(
        report.resource_claims[0].requests[0]
            .nodes
            .iter()
            .all(|n| n.node != "node-a100")
    );
}

#[test]
fn two_requests_that_fit_alone_but_not_together_are_not_enough_devices() {
    let s = with_claim(
        snapshot(),
        "pair",
        "pair",
        json!([
            request(
                "a",
                "gpu.nvidia.com",
                Some(BIG.replace("100Gi", "40Gi").as_str())
            ),
            request(
                "b",
                "gpu.nvidia.com",
                Some(BIG.replace("100Gi", "40Gi").as_str())
            ),
            request(
                "c",
                "gpu.nvidia.com",
                Some(BIG.replace("100Gi", "40Gi").as_str())
            ),
        ]),
    );
    let p = pod("pair", "pair");
    let d = diagnose(&s.dra, &p, &nodes(&s));
    assert_eq!(checks(&d), [DRA_NOT_ENOUGH_DEVICES]);
    assert!(
        d.faults[0].problem.contains("at least 3 distinct devices"),
        "{:?}",
        d.faults[0]
    );
    assert_report_golden("not-enough-devices", &s, &p);
}

#[test]
fn a_count_above_what_any_node_has_is_not_enough_devices() {
    let mut r = request("gpu", "gpu.nvidia.com", None);
    r["exactly"]["count"] = json!(3);
    let s = with_claim(snapshot(), "three", "three", json!([r]));
    let d = diagnose(&s.dra, &pod("three", "three"), &nodes(&s));
    assert_eq!(checks(&d), [DRA_NOT_ENOUGH_DEVICES]);
    assert!(
        d.faults[0].problem.contains("needs 3 devices on one node"),
        "{:?}",
        d.faults[0]
    );
    assert!(
        d.faults[0]
            .problem
            .contains("node-a100: 2 matching, 2 free"),
        "{:?}",
        d.faults[0]
    );
    assert!(
        d.faults[0].fix.contains("exactly.count"),
        "{:?}",
        d.faults[0]
    );
}

#[test]
fn a_missing_device_class_and_a_missing_template_are_named_with_the_field() {
    let s = with_claim(
        snapshot(),
        "typo",
        "typo",
        json!([request("gpu", "gpu.nvidia.comm", None)]),
    );
    let d = diagnose(&s.dra, &pod("typo", "typo"), &nodes(&s));
    assert_eq!(checks(&d), [DRA_DEVICE_CLASS_MISSING]);
    assert!(
        d.faults[0].problem.contains("deviceClassName"),
        "{:?}",
        d.faults[0]
    );
    assert_eq!(d.claims[0].state, "unsatisfiable");
    assert_report_golden("device-class-missing", &s, &pod("typo", "typo"));

    let mut p = pod("nothing", "absent");
    p.status = None;
    let d = diagnose(&s.dra, &p, &nodes(&s));
    assert_eq!(checks(&d), [DRA_CLAIM_MISSING]);
    assert!(
        d.faults[0]
            .problem
            .contains("ResourceClaimTemplate team-a/absent"),
        "{:?}",
        d.faults[0]
    );
    assert_eq!(d.claims[0].state, "missing");
}

#[test]
fn a_claim_not_generated_yet_is_judged_from_its_template_as_a_hint() {
    let mut s = snapshot();
    s.dra.templates.push(template(
        "big",
        json!([request("gpu", "gpu.nvidia.com", Some(BIG))]),
    ));
    let mut p = pod("early", "big");
    p.status = None;
    let d = diagnose(&s.dra, &p, &nodes(&s));
    assert_eq!(d.hints[0].check, DRA_CLAIM_MISSING);
    assert_eq!(checks(&d), [DRA_NO_MATCHING_DEVICE]);
    assert_eq!(d.claims[0].resource_claim, None);
}

#[test]
fn an_attribute_a_device_lacks_is_the_schedulers_cel_runtime_error() {
    let s = with_claim(
        snapshot(),
        "err",
        "err",
        json!([request(
            "gpu",
            "gpu.nvidia.com",
            Some(
                "device.attributes['gpu.nvidia.com'].cudaComputeCapability.compareTo(semver('8.0.0')) >= 0"
            )
        )]),
    );
    let p = pod("err", "err");
    let d = diagnose(&s.dra, &p, &nodes(&s));
    assert!(checks(&d).contains(&DRA_SELECTOR_ERROR), "{:?}", d.faults);
    let f = d
        .faults
        .iter()
        .find(|f| f.check == DRA_SELECTOR_ERROR)
        .unwrap();
    assert!(
        f.problem
            .contains("CEL runtime error: no such key: cudaComputeCapability"),
        "{f:?}"
    );
    assert!(f.fix.contains("has("), "{f:?}");
    assert_report_golden("selector-error", &s, &p);
}

#[test]
fn a_selector_outside_the_subset_is_not_evaluated_and_never_a_fault() {
    let s = with_claim(
        snapshot(),
        "regex",
        "regex",
        json!([request(
            "gpu",
            "gpu.nvidia.com",
            Some("device.attributes['gpu.nvidia.com'].productName.matches('^NVIDIA A100')")
        )]),
    );
    let p = pod("regex", "regex");
    let d = diagnose(&s.dra, &p, &nodes(&s));
    assert!(d.faults.is_empty(), "{:?}", d.faults);
    assert_eq!(d.claims[0].state, "not-evaluated");
    assert_eq!(d.hints[0].check, DRA_NOT_EVALUATED);
    assert!(
        d.hints[0]
            .problem
            .contains("not evaluated: regular expressions"),
        "{:?}",
        d.hints
    );
    assert_report_golden("not-evaluated", &s, &p);
}

#[test]
fn a_node_advertising_nvidia_gpu_while_dra_publishes_its_gpus_is_a_conflict() {
    let mut s = with_claim(
        snapshot(),
        "fits",
        "big",
        json!([request("gpu", "gpu.nvidia.com", None)]),
    );
    s.nodes[1] = node("node-a100", Some(2), false);
    let d = diagnose(&s.dra, &pod("fits", "big"), &nodes(&s));
    assert_eq!(checks(&d), [DRA_DEVICE_PLUGIN_CONFLICT]);
    assert!(d.faults[0].problem.contains("node node-a100: the device plugin advertises 2 nvidia.com/gpu while the DRA driver gpu.nvidia.com publishes 2 GPUs"), "{:?}", d.faults[0]);
    // MIG devices alone are not the device plugin's whole GPUs.
    s.nodes[2] = node("node-mig", Some(1), false);
    assert_eq!(conflicts(&s.dra, &nodes(&s)).len(), 1);
    assert_report_golden("device-plugin-conflict", &s, &pod("fits", "big"));
}

#[test]
fn a_compute_domain_claim_waits_for_its_domain_to_be_ready() {
    let mut s = snapshot();
    s.dra.claims.push(
        serde_json::from_value(json!({
        "metadata": {"name": "trainer-channel", "namespace": NS},
        "spec": {"devices": {
            "requests": [request("channel", "compute-domain-default-channel.nvidia.com", None)],
            "config": [{"requests": ["channel"], "opaque": {"driver": "compute-domain.nvidia.com",
                "parameters": {"apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "ComputeDomainChannelConfig", "domainID": "cd-uid-1"}}}]}}}))
        .unwrap(),
    );
    s.dra.compute_domains = Some(vec![json!({
        "metadata": {"name": "trainer", "namespace": NS, "uid": "cd-uid-1"},
        "status": {"status": "NotReady"}})]);
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": "trainer", "namespace": NS},
        "spec": {"containers": [{"name": "c"}],
                 "resourceClaims": [{"name": "channel", "resourceClaimName": "trainer-channel"}]}}))
    .unwrap();
    let d = diagnose(&s.dra, &p, &nodes(&s));
    assert!(
        checks(&d).contains(&DRA_COMPUTE_DOMAIN_NOT_READY),
        "{:?}",
        d.faults
    );
    let f = d
        .faults
        .iter()
        .find(|f| f.check == DRA_COMPUTE_DOMAIN_NOT_READY)
        .unwrap();
    assert!(
        f.problem
            .contains("ComputeDomain team-a/trainer, whose status is NotReady"),
        "{f:?}"
    );
    assert!(
        f.fix
            .starts_with("kubectl -n team-a describe computedomain trainer"),
        "{f:?}"
    );
    assert_report_golden("compute-domain-not-ready", &s, &p);

    s.dra.compute_domains = Some(vec![json!({
        "metadata": {"name": "trainer", "namespace": NS, "uid": "cd-uid-1"},
        "status": {"status": "Ready"}})]);
    let d = diagnose(&s.dra, &p, &nodes(&s));
    assert!(
        !checks(&d).contains(&DRA_COMPUTE_DOMAIN_NOT_READY),
        "{:?}",
        d.faults
    );
    s.dra.compute_domains = Some(Vec::new());
    let d = diagnose(&s.dra, &p, &nodes(&s));
    assert!(
        d.faults
            .iter()
            .any(|f| f.check == DRA_COMPUTE_DOMAIN_NOT_READY
                && f.problem.contains("no ComputeDomain has that UID")),
        "{:?}",
        d.faults
    );
}

#[test]
fn an_allocated_claim_reads_allocated_on_its_node_and_holds_nothing_against_itself() {
    let mig_request = json!([request("mig", "mig.nvidia.com", None)]);
    let mut s = snapshot();
    s.dra
        .templates
        .push(template("one-mig", mig_request.clone()));
    s.dra.claims.push(claim(
        "placed-gpu",
        mig_request,
        Some(("node-mig", &["gpu-0-mig-1g5gb-19-2"], "placed")),
    ));
    let d = diagnose(&s.dra, &pod("placed", "one-mig"), &nodes(&s));
    assert!(d.faults.is_empty(), "{:?}", d.faults);
    assert_eq!(d.claims[0].state, "allocated");
    assert_eq!(d.claims[0].nodes, ["node-mig"]);
}

#[test]
fn a_pod_without_claims_gets_no_dra_findings() {
    let s = snapshot();
    let p: Pod = serde_json::from_value(json!({"metadata": {"name": "plain", "namespace": NS},
        "spec": {"containers": [{"name": "c"}]}}))
    .unwrap();
    let d = diagnose(&s.dra, &p, &nodes(&s));
    assert!(d.claims.is_empty() && d.faults.is_empty() && d.hints.is_empty());
}

#[test]
fn a_claim_already_allocated_pins_the_pods_other_claims_to_its_node() {
    let mig_request = json!([request("mig", "mig.nvidia.com", None)]);
    let mut s = snapshot();
    s.dra.claims.push(claim(
        "shared",
        mig_request,
        Some(("node-mig", &["gpu-0-mig-1g5gb-19-2"], "other")),
    ));
    s.dra.templates.push(template(
        "whole",
        json!([request("gpu", "gpu.nvidia.com", None)]),
    ));
    s.dra.claims.push(claim(
        "both-gpu",
        json!([request("gpu", "gpu.nvidia.com", None)]),
        None,
    ));
    // One claim by name (allocated on node-mig), one from a template: whole GPUs exist only
    // elsewhere, so the pod fits nowhere.
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": "both", "namespace": NS},
        "spec": {"containers": [{"name": "c"}],
                 "resourceClaims": [{"name": "mig", "resourceClaimName": "shared"},
                                    {"name": "gpu", "resourceClaimTemplateName": "whole"}]},
        "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "both-gpu"}]}}))
    .unwrap();
    let d = diagnose(&s.dra, &p, &nodes(&s));
    assert_eq!(d.claims[0].state, "allocated");
    assert_eq!(d.claims[1].state, "unsatisfiable");
    assert_eq!(checks(&d), [DRA_NO_MATCHING_DEVICE]);
    assert!(
        d.faults[0].problem.contains("node-mig: 2 devices"),
        "{:?}",
        d.faults[0]
    );
    assert!(
        !d.faults[0].problem.contains("node-a100"),
        "{:?}",
        d.faults[0]
    );
}

#[test]
fn the_cluster_report_names_a_device_plugin_and_dra_conflict_without_a_pod() {
    let mut s = snapshot();
    s.nodes[1] = node("node-a100", Some(2), false);
    let report = Report::of_cluster(&s);
    let conflicts: Vec<&Finding> = report
        .faults
        .iter()
        .filter(|f| f.check == DRA_DEVICE_PLUGIN_CONFLICT)
        .collect();
    assert_eq!(conflicts.len(), 1, "{:?}", report.faults);
    assert!(
        conflicts[0].problem.starts_with("node node-a100:"),
        "{conflicts:?}"
    );
    // Without the device plugin's GPUs there is nothing to double-book.
    let report = Report::of_cluster(&snapshot());
    assert!(
        report
            .faults
            .iter()
            .all(|f| f.check != DRA_DEVICE_PLUGIN_CONFLICT),
        "{:?}",
        report.faults
    );
}
