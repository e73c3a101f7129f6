//! Validate stage of `doctor` (pure, no IO): whether a pod's DRA ResourceClaims
//! (`resource.k8s.io/v1`) can be allocated on the nodes it may go to, and when not, why.
//!
//! For each claim of the pod (by name, or the one generated from its template, found through
//! `status.resourceClaimStatuses`), each request's DeviceClass and the ResourceSlices published
//! for each node the pod may go to: per device, the first selector (the class's, then the
//! request's) that rules it out, with what the device publishes for the attributes it reads
//! ([`cel`]); then the devices that other claims' allocations hold, with those claims and the
//! pods they are reserved for. A request fits a node when enough matching devices are free
//! there, all requests of the pod's claims together with distinct devices (a matching, as the
//! scheduler's allocator needs). Request constraints (`matchAttribute`), `firstAvailable`
//! sub-requests, device taints and consumable capacity are not judged: such a claim is "not
//! evaluated" and never called unsatisfiable.
//!
//! Also: a node where the device plugin advertises `nvidia.com/gpu` while NVIDIA's DRA driver
//! publishes its GPUs (both hand out the same GPUs), and the ComputeDomain (NVIDIA's
//! `resource.nvidia.com/v1beta1`) a compute-domain claim's opaque config names by UID.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{
    DeviceClass, DeviceRequest, DeviceSelector, ResourceClaim, ResourceClaimSpec,
    ResourceClaimTemplate, ResourceSlice,
};
use kube::ResourceExt;

use super::Finding;

pub mod cel;

pub const DRA_CLAIM_MISSING: &str = "dra-claim-missing";
pub const DRA_DEVICE_CLASS_MISSING: &str = "dra-device-class-missing";
pub const DRA_NO_DEVICES: &str = "dra-no-devices";
pub const DRA_NO_MATCHING_DEVICE: &str = "dra-no-matching-device";
pub const DRA_SELECTOR_ERROR: &str = "dra-selector-error";
pub const DRA_DEVICES_ALLOCATED: &str = "dra-devices-allocated";
pub const DRA_NOT_ENOUGH_DEVICES: &str = "dra-not-enough-devices";
pub const DRA_DEVICE_PLUGIN_CONFLICT: &str = "dra-device-plugin-conflict";
pub const DRA_COMPUTE_DOMAIN_NOT_READY: &str = "dra-compute-domain-not-ready";
/// A hint: what the doctor could not judge (a selector outside its CEL subset, a constraint).
pub const DRA_NOT_EVALUATED: &str = "dra-not-evaluated";

/// NVIDIA's DRA driver for GPUs (its ResourceSlices' `spec.driver` and attribute domain).
pub const NVIDIA_GPU_DRIVER: &str = "gpu.nvidia.com";
/// The DeviceClasses of NVIDIA's compute-domain driver.
pub const COMPUTE_DOMAIN_CLASSES: [&str; 2] = [
    "compute-domain-daemon.nvidia.com",
    "compute-domain-default-channel.nvidia.com",
];
const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// What the doctor reads of DRA: every ResourceSlice, DeviceClass, ResourceClaim and
/// ResourceClaimTemplate, and NVIDIA's ComputeDomains (as JSON: no Rust type of ours). Empty
/// where the API server does not serve `resource.k8s.io/v1`.
#[derive(Clone, Debug, Default)]
pub struct DraSnapshot {
    pub slices: Vec<ResourceSlice>,
    pub classes: Vec<DeviceClass>,
    pub claims: Vec<ResourceClaim>,
    pub templates: Vec<ResourceClaimTemplate>,
    /// `None` when the ComputeDomain CRD is not served.
    pub compute_domains: Option<Vec<serde_json::Value>>,
    /// The kinds the user may not list (`resourceclaims.resource.k8s.io`): judged without.
    pub unreadable: Vec<String>,
}

/// One claim of the pod as `-o json` reports it (`resourceClaims[]`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimReport {
    /// The entry's name in the pod's `spec.resourceClaims`.
    pub name: String,
    /// The ResourceClaim (`null` while the one of a template is not created).
    pub resource_claim: Option<String>,
    /// The ResourceClaimTemplate it comes from, if any.
    pub template: Option<String>,
    /// `ok` (it fits a node the pod may go to), `allocated`, `unsatisfiable`, `not-evaluated`,
    /// `missing`.
    pub state: String,
    /// With `ok`: the nodes it fits; with `allocated`: the node its allocation is on.
    pub nodes: Vec<String>,
    pub requests: Vec<RequestReport>,
}

/// One request of a claim.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestReport {
    pub name: String,
    pub device_class: String,
    /// `ExactCount` or `All`.
    pub allocation_mode: String,
    pub count: i64,
    /// Every selector that applies, the class's first: `<where>: <expression>`.
    pub selectors: Vec<String>,
    /// Per node the pod may go to.
    pub nodes: Vec<NodeDevices>,
}

/// The devices of one node for one request.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeDevices {
    pub node: String,
    /// Devices its ResourceSlices publish.
    pub devices: usize,
    /// Devices every selector matches.
    pub matching: usize,
    /// Matching devices no other claim holds.
    pub free: usize,
    /// The other claims holding matching devices.
    pub held_by: Vec<Holder>,
}

/// A claim whose allocation holds devices a request matches.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Holder {
    /// `namespace/name`
    pub claim: String,
    /// The pods it is reserved for, `namespace/name`.
    pub pods: Vec<String>,
    /// `driver/pool/device`
    pub devices: Vec<String>,
}

/// What the DRA checks found for one pod.
#[derive(Clone, Debug, Default)]
pub struct Diagnosis {
    pub claims: Vec<ClaimReport>,
    pub faults: Vec<Finding>,
    pub hints: Vec<Finding>,
}

/// `(driver, pool, device)`: how an allocation names a device.
type DeviceId = (String, String, String);

fn id_text(id: &DeviceId) -> String {
    format!("{}/{}/{}", id.0, id.1, id.2)
}

/// One published device, ready for CEL.
struct Published {
    id: DeviceId,
    device: cel::Device,
}

fn published(slice: &ResourceSlice) -> Vec<Published> {
    let driver = &slice.spec.driver;
    slice
        .spec
        .devices
        .iter()
        .flatten()
        .map(|d| {
            let mut device = cel::Device {
                driver: driver.clone(),
                ..cel::Device::default()
            };
            // An unqualified name belongs to the driver's own domain.
            let split = |name: &str| match name.split_once('/') {
                Some((domain, id)) => (domain.to_owned(), id.to_owned()),
                None => (driver.clone(), name.to_owned()),
            };
            for (name, a) in d.attributes.iter().flatten() {
                let value = if let Some(s) = &a.string {
                    cel::Value::String(s.clone())
                } else if let Some(i) = a.int {
                    cel::Value::Int(i)
                } else if let Some(b) = a.bool {
                    cel::Value::Bool(b)
                } else if let Some(v) = a.version.as_deref().and_then(cel::Version::parse) {
                    cel::Value::Version(v)
                } else {
                    continue;
                };
                let (domain, id) = split(name);
                device
                    .attributes
                    .entry(domain)
                    .or_default()
                    .insert(id, value);
            }
            for (name, c) in d.capacity.iter().flatten() {
                if let Some(q) = cel::Quantity::parse(&c.value.0) {
                    let (domain, id) = split(name);
                    device.capacity.entry(domain).or_default().insert(id, q);
                }
            }
            Published {
                id: (driver.clone(), slice.spec.pool.name.clone(), d.name.clone()),
                device,
            }
        })
        .collect()
}

/// The devices published for `node`: its own slices and those for all nodes.
fn devices_on<'a>(dra: &'a DraSnapshot, node: &str) -> impl Iterator<Item = &'a ResourceSlice> {
    let node = node.to_owned();
    dra.slices.iter().filter(move |s| {
        s.spec.node_name.as_deref() == Some(node.as_str()) || s.spec.all_nodes == Some(true)
    })
}

/// Whose allocation holds each device, other than the claims in `except`.
fn holders<'a>(
    dra: &'a DraSnapshot,
    except: &BTreeSet<(String, String)>,
) -> BTreeMap<DeviceId, &'a ResourceClaim> {
    let mut out = BTreeMap::new();
    for claim in &dra.claims {
        let key = (claim.namespace().unwrap_or_default(), claim.name_any());
        if except.contains(&key) {
            continue;
        }
        let results = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref());
        for r in results.into_iter().flatten() {
            // Admin access shares a device without taking it from anyone.
            if r.admin_access == Some(true) {
                continue;
            }
            out.insert((r.driver.clone(), r.pool.clone(), r.device.clone()), claim);
        }
    }
    out
}

fn reserved_pods(claim: &ResourceClaim) -> Vec<String> {
    let ns = claim.namespace().unwrap_or_default();
    claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .into_iter()
        .flatten()
        .filter(|r| r.resource == "pods")
        .map(|r| format!("{ns}/{}", r.name))
        .collect()
}

/// A selector of a request, where it comes from, and its parsed form.
struct Selector {
    place: String,
    expression: String,
    parsed: Result<cel::Expr, cel::Error>,
}

fn selectors(list: Option<&Vec<DeviceSelector>>, place: &str) -> Vec<Selector> {
    list.into_iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, s)| {
            let expression = s.cel.as_ref()?.expression.clone();
            Some(Selector {
                place: format!("{place}.selectors[{i}]"),
                parsed: cel::parse(&expression),
                expression,
            })
        })
        .collect()
}

/// Why one device is not selected: the selector and what the device has for what it reads.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct RuledOut {
    place: String,
    expression: String,
    /// `false`, or the error text.
    outcome: String,
    has: String,
}

/// The first selector that rules `device` out; `Err` when one cannot be evaluated (then the
/// device is neither in nor out).
fn rule_out(selectors: &[Selector], device: &cel::Device) -> Result<Option<RuledOut>, String> {
    for s in selectors {
        let outcome = match &s.parsed {
            Ok(e) => cel::evaluate(e, device),
            Err(e) => Err(e.clone()),
        };
        let outcome = match outcome {
            Ok(true) => continue,
            Ok(false) => "false".to_owned(),
            Err(e @ cel::Error::Runtime(_)) => e.to_string(),
            Err(e @ cel::Error::Unsupported(_)) => {
                return Err(format!("{} {:?}: {e}", s.place, s.expression));
            }
        };
        let has = s
            .parsed
            .as_ref()
            .map(|e| {
                cel::reads(e, device)
                    .into_iter()
                    .map(|(path, value)| match value {
                        Some(v) => format!("{path} is {v}"),
                        None => format!("{path} is not published"),
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default();
        return Ok(Some(RuledOut {
            place: s.place.clone(),
            expression: s.expression.clone(),
            outcome,
            has,
        }));
    }
    Ok(None)
}

/// One request to place, with what was learned on each node.
struct Need<'a> {
    claim: usize,
    request: &'a DeviceRequest,
    class: String,
    all: bool,
    count: usize,
    selectors: Vec<Selector>,
    /// node -> (published, matching ids, free ids, holders, ruled out, not evaluated)
    per_node: BTreeMap<String, NodeLook>,
}

#[derive(Default)]
struct NodeLook {
    published: usize,
    matching: Vec<DeviceId>,
    free: Vec<DeviceId>,
    held: BTreeMap<(String, String), (Vec<String>, Vec<String>)>,
    ruled_out: BTreeMap<(String, String, String), Vec<(String, String)>>,
    not_evaluated: Vec<String>,
}

/// The pod's claim entries: (entry name, claim name if known, template name if any).
fn claim_entries(pod: &Pod) -> Vec<(String, Option<String>, Option<String>)> {
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref());
    pod.spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_ref())
        .into_iter()
        .flatten()
        .map(
            |c| match (&c.resource_claim_name, &c.resource_claim_template_name) {
                (Some(name), _) => (c.name.clone(), Some(name.clone()), None),
                (None, template) => {
                    let generated = statuses
                        .into_iter()
                        .flatten()
                        .find(|s| s.name == c.name)
                        .and_then(|s| s.resource_claim_name.clone());
                    (c.name.clone(), generated, template.clone())
                }
            },
        )
        .collect()
}

/// Whether `pod` uses DRA claims at all.
pub fn has_claims(pod: &Pod) -> bool {
    !claim_entries(pod).is_empty()
}

/// Matches every needed slot to a distinct free device on one node (augmenting paths).
fn fits_together(slots: &[&[DeviceId]]) -> bool {
    fn augment(
        slot: usize,
        slots: &[&[DeviceId]],
        owner: &mut BTreeMap<DeviceId, usize>,
        seen: &mut BTreeSet<DeviceId>,
    ) -> bool {
        for d in slots[slot] {
            if !seen.insert(d.clone()) {
                continue;
            }
            let taken_by = owner.get(d).copied();
            if taken_by.is_none_or(|other| augment(other, slots, owner, seen)) {
                owner.insert(d.clone(), slot);
                return true;
            }
        }
        false
    }
    let mut owner = BTreeMap::new();
    (0..slots.len()).all(|s| augment(s, slots, &mut owner, &mut BTreeSet::new()))
}

/// The DRA checks of `pod` on `nodes`, the nodes its selector, affinity and tolerations allow.
pub fn diagnose(dra: &DraSnapshot, pod: &Pod, nodes: &[&Node]) -> Diagnosis {
    let mut out = Diagnosis::default();
    let entries = claim_entries(pod);
    if entries.is_empty() {
        return out;
    }
    let ns = pod.namespace().unwrap_or_else(|| "default".into());
    let pod_name = pod.name_any();
    let node_names: Vec<String> = nodes.iter().map(|n| n.name_any()).collect();
    let mine: BTreeSet<(String, String)> = entries
        .iter()
        .filter_map(|(_, c, _)| c.clone().map(|c| (ns.clone(), c)))
        .collect();
    let held = holders(dra, &mine);

    let mut needs: Vec<Need> = Vec::new();
    let mut specs: Vec<Option<&ResourceClaimSpec>> = Vec::new();
    for (i, (entry, claim_name, template)) in entries.iter().enumerate() {
        let claim = claim_name.as_ref().and_then(|c| {
            dra.claims
                .iter()
                .find(|x| x.namespace().as_deref() == Some(ns.as_str()) && &x.name_any() == c)
        });
        let template_spec = template.as_ref().and_then(|t| {
            dra.templates
                .iter()
                .find(|x| x.namespace().as_deref() == Some(ns.as_str()) && &x.name_any() == t)
                .map(|t| &t.spec.spec)
        });
        let mut report = ClaimReport {
            name: entry.clone(),
            resource_claim: claim.map(ResourceExt::name_any),
            template: template.clone(),
            state: String::new(),
            nodes: Vec::new(),
            requests: Vec::new(),
        };
        let spec = match (claim, template_spec) {
            (Some(c), _) => Some(&c.spec),
            (None, Some(t)) => Some(t),
            (None, None) => None,
        };
        if claim.is_none() {
            let generated_later = claim_name.is_none() && template_spec.is_some();
            let (what, fix) = match (claim_name, template) {
                (Some(c), _) => (
                    format!("ResourceClaim {ns}/{c} (spec.resourceClaims[{i}]) does not exist"),
                    format!(
                        "kubectl -n {ns} get resourceclaims; create {c}, or point the pod's claim at one that exists"
                    ),
                ),
                (None, Some(t)) if template_spec.is_none() => (
                    format!(
                        "ResourceClaimTemplate {ns}/{t} (spec.resourceClaims[{i}].resourceClaimTemplateName) does not exist, so no claim is generated"
                    ),
                    format!("kubectl -n {ns} get resourceclaimtemplates; create {t}"),
                ),
                (None, Some(t)) => (
                    format!(
                        "the ResourceClaim of template {t} is not generated yet (status.resourceClaimStatuses has none for {entry}); judged from the template"
                    ),
                    format!(
                        "kubectl -n {ns} describe pod {pod_name}  (the resource-claim controller's events)"
                    ),
                ),
                (None, None) => (
                    format!("spec.resourceClaims[{i}] names neither a claim nor a template"),
                    format!("kubectl -n {ns} get pod {pod_name} -o yaml"),
                ),
            };
            let finding = Finding {
                check: DRA_CLAIM_MISSING,
                problem: format!("pod {pod_name}'s claim {entry}: {what}"),
                fix,
            };
            // A claim the controller has yet to generate is a wait, not a fault.
            if generated_later {
                out.hints.push(finding);
            } else {
                out.faults.push(finding);
                report.state = "missing".into();
            }
        }
        let allocated = claim.and_then(|c| c.status.as_ref()?.allocation.as_ref());
        if let Some(a) = allocated {
            report.state = "allocated".into();
            report.nodes = allocation_nodes(a);
        }
        specs.push(spec);
        if allocated.is_none() {
            for request in spec
                .and_then(|s| s.devices.as_ref())
                .and_then(|d| d.requests.as_ref())
                .into_iter()
                .flatten()
            {
                let Some(exactly) = &request.exactly else {
                    out.hints.push(Finding {
                        check: DRA_NOT_EVALUATED,
                        problem: format!("claim {entry} request {}: not evaluated: firstAvailable sub-requests are not judged by the doctor", request.name),
                        fix: format!("kubectl -n {ns} describe pod {pod_name}  (the scheduler's reason)"),
                    });
                    report.state = "not-evaluated".into();
                    continue;
                };
                let class = dra
                    .classes
                    .iter()
                    .find(|c| c.name_any() == exactly.device_class_name);
                let Some(class) = class else {
                    out.faults.push(Finding {
                        check: DRA_DEVICE_CLASS_MISSING,
                        problem: format!(
                            "claim {entry} request {} names DeviceClass {} (spec.devices.requests[].exactly.deviceClassName), which does not exist",
                            request.name, exactly.device_class_name
                        ),
                        fix: "kubectl get deviceclasses  (the classes the DRA driver installs); set deviceClassName to one of them".into(),
                    });
                    report.state = "unsatisfiable".into();
                    continue;
                };
                let mut sel = selectors(
                    class.spec.selectors.as_ref(),
                    &format!("DeviceClass {}", class.name_any()),
                );
                sel.extend(selectors(
                    exactly.selectors.as_ref(),
                    &format!("request {}", request.name),
                ));
                let all = exactly.allocation_mode.as_deref() == Some("All");
                needs.push(Need {
                    claim: i,
                    request,
                    class: exactly.device_class_name.clone(),
                    all,
                    count: if all {
                        0
                    } else {
                        usize::try_from(exactly.count.unwrap_or(1)).unwrap_or(0)
                    },
                    selectors: sel,
                    per_node: BTreeMap::new(),
                });
            }
            if spec
                .and_then(|s| s.devices.as_ref())
                .and_then(|d| d.constraints.as_ref())
                .is_some_and(|c| !c.is_empty())
            {
                out.hints.push(Finding {
                    check: DRA_NOT_EVALUATED,
                    problem: format!("claim {entry}: not evaluated: spec.devices.constraints (matchAttribute) are not judged by the doctor; its devices are judged one by one"),
                    fix: format!("kubectl -n {ns} describe pod {pod_name}  (the scheduler's reason)"),
                });
            }
        }
        out.claims.push(report);
    }

    // A claim already allocated pins the pod to its node: the others must fit there.
    let pinned = out
        .claims
        .iter()
        .filter(|c| c.state == "allocated" && !c.nodes.is_empty())
        .map(|c| c.nodes.iter().cloned().collect::<BTreeSet<String>>())
        .reduce(|a, b| a.intersection(&b).cloned().collect());
    let node_names: Vec<String> = match pinned {
        Some(pinned) => node_names
            .into_iter()
            .filter(|n| pinned.contains(n))
            .collect(),
        None => node_names,
    };

    // Each request on each node.
    for node in &node_names {
        let devices: Vec<Published> = devices_on(dra, node).flat_map(published).collect();
        for need in &mut needs {
            let mut look = NodeLook {
                published: devices.len(),
                ..NodeLook::default()
            };
            for d in &devices {
                match rule_out(&need.selectors, &d.device) {
                    Err(why) => {
                        if !look.not_evaluated.contains(&why) {
                            look.not_evaluated.push(why);
                        }
                    }
                    Ok(Some(r)) => look
                        .ruled_out
                        .entry((r.place, r.expression, r.outcome))
                        .or_default()
                        .push((d.id.2.clone(), r.has)),
                    Ok(None) => {
                        look.matching.push(d.id.clone());
                        let admin = need.request.exactly.as_ref().and_then(|e| e.admin_access)
                            == Some(true);
                        match held.get(&d.id) {
                            Some(claim) if !admin => {
                                let entry = look
                                    .held
                                    .entry((
                                        claim.namespace().unwrap_or_default(),
                                        claim.name_any(),
                                    ))
                                    .or_insert_with(|| (reserved_pods(claim), Vec::new()));
                                entry.1.push(id_text(&d.id));
                            }
                            _ => look.free.push(d.id.clone()),
                        }
                    }
                }
            }
            need.per_node.insert(node.clone(), look);
        }
    }

    // Where all of the pod's unallocated requests fit together.
    let fits: Vec<String> = node_names
        .iter()
        .filter(|node| {
            let mut slots: Vec<&[DeviceId]> = Vec::new();
            for need in &needs {
                let look = &need.per_node[*node];
                if !look.not_evaluated.is_empty() {
                    return false;
                }
                if need.all {
                    if look.matching.is_empty() || look.free.len() < look.matching.len() {
                        return false;
                    }
                    slots.extend(std::iter::repeat_n(look.free.as_slice(), look.free.len()));
                } else {
                    slots.extend(std::iter::repeat_n(look.free.as_slice(), need.count));
                }
            }
            fits_together(&slots)
        })
        .cloned()
        .collect();

    let mut unsatisfiable = false;
    let mut any_not_evaluated = false;
    for (i, report) in out.claims.iter_mut().enumerate() {
        let mine: Vec<&Need> = needs.iter().filter(|n| n.claim == i).collect();
        report.requests = mine.iter().map(|n| request_report(n)).collect();
        if report.state == "allocated" {
            continue;
        }
        let not_evaluated: BTreeSet<String> = mine
            .iter()
            .flat_map(|n| n.per_node.values().flat_map(|l| l.not_evaluated.clone()))
            .collect();
        let before = out.faults.len();
        if not_evaluated.is_empty() {
            for need in &mine {
                out.faults.extend(request_faults(
                    need,
                    &report.name,
                    &ns,
                    &pod_name,
                    report.template.as_deref(),
                    report.resource_claim.as_deref(),
                ));
            }
        }
        for why in &not_evaluated {
            out.hints.push(Finding {
                check: DRA_NOT_EVALUATED,
                problem: format!(
                    "claim {}: {why}; the doctor does not guess whether those devices match",
                    report.name
                ),
                fix: format!("kubectl -n {ns} describe pod {pod_name}  (the scheduler's reason)"),
            });
        }
        if out.faults.len() > before {
            report.state = "unsatisfiable".into();
            unsatisfiable = true;
        } else if !not_evaluated.is_empty() {
            report.state = "not-evaluated".into();
            any_not_evaluated = true;
        } else if report.state == "unsatisfiable" {
            unsatisfiable = true;
        } else if report.state == "not-evaluated" {
            any_not_evaluated = true;
        }
    }
    // Each request fits some node alone: do they fit one node together, with distinct devices?
    if !needs.is_empty() && !unsatisfiable && !any_not_evaluated {
        if fits.is_empty() {
            let total: usize = needs.iter().map(|n| if n.all { 1 } else { n.count }).sum();
            out.faults.push(Finding {
                check: DRA_NOT_ENOUGH_DEVICES,
                problem: format!(
                    "pod {pod_name}'s claims need at least {total} distinct devices together on one node; each request fits some node alone, but no node it may go to ({}) has them all free",
                    node_names.join(", ")
                ),
                fix: "kubectl get resourceslices -o wide; kubectl get resourceclaims -A  (what is free where); ask for fewer devices in the pod's claims".into(),
            });
        }
        for report in &mut out.claims {
            if report.state.is_empty() {
                if fits.is_empty() {
                    report.state = "unsatisfiable".into();
                } else {
                    report.state = "ok".into();
                    report.nodes = fits.clone();
                }
            }
        }
    }
    for report in &mut out.claims {
        if report.state.is_empty() {
            report.state = "ok".into();
            report.nodes = fits.clone();
        }
    }
    out.faults.extend(conflicts(dra, nodes));
    out.faults.extend(compute_domain_faults(
        dra,
        &ns,
        &pod_name,
        &out.claims,
        &specs,
    ));
    out
}

fn request_report(need: &Need) -> RequestReport {
    RequestReport {
        name: need.request.name.clone(),
        device_class: need.class.clone(),
        allocation_mode: if need.all { "All" } else { "ExactCount" }.into(),
        count: i64::try_from(need.count).unwrap_or(i64::MAX),
        selectors: need
            .selectors
            .iter()
            .map(|s| format!("{}: {}", s.place, s.expression))
            .collect(),
        nodes: need
            .per_node
            .iter()
            .map(|(node, l)| NodeDevices {
                node: node.clone(),
                devices: l.published,
                matching: l.matching.len(),
                free: l.free.len(),
                held_by: l
                    .held
                    .iter()
                    .map(|((cns, c), (pods, devices))| Holder {
                        claim: format!("{cns}/{c}"),
                        pods: pods.clone(),
                        devices: devices.clone(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

fn allocation_nodes(a: &k8s_openapi::api::resource::v1::AllocationResult) -> Vec<String> {
    a.node_selector
        .iter()
        .flat_map(|s| &s.node_selector_terms)
        .flat_map(|t| t.match_fields.iter().flatten())
        .filter(|f| f.key == "metadata.name")
        .flat_map(|f| f.values.iter().flatten().cloned())
        .collect()
}

/// (a class's selector, where it is, its expression, `false` or the error): how rule-outs are
/// grouped, the request's own selectors sorting first.
type SelectorKey = (bool, String, String, String);

/// The faults of one request that fits no node.
fn request_faults(
    need: &Need,
    entry: &str,
    ns: &str,
    pod_name: &str,
    template: Option<&str>,
    claim: Option<&str>,
) -> Vec<Finding> {
    let looks: Vec<(&String, &NodeLook)> = need.per_node.iter().collect();
    let wanted = |l: &NodeLook| {
        if need.all {
            !l.matching.is_empty() && l.free.len() == l.matching.len()
        } else {
            l.free.len() >= need.count
        }
    };
    // Alone, it fits some node (or cannot be judged there): not this request's fault.
    if looks.iter().any(|(_, l)| wanted(l)) {
        return Vec::new();
    }
    let what = format!(
        "claim {entry} request {} (DeviceClass {})",
        need.request.name, need.class
    );
    let edit = match (template, claim) {
        (Some(t), _) => format!(
            "kubectl -n {ns} edit resourceclaimtemplate {t}  (a generated claim does not change: recreate pod {pod_name} after)"
        ),
        (None, Some(c)) => format!(
            "kubectl -n {ns} describe resourceclaim {c}  (a claim's spec does not change: create a new one)"
        ),
        _ => format!("kubectl -n {ns} get pod {pod_name} -o yaml"),
    };
    let nodes_text = |ns: &[&String]| ns.iter().map(|n| n.as_str()).collect::<Vec<_>>().join(", ");
    if looks.is_empty() || looks.iter().all(|(_, l)| l.published == 0) {
        let names: Vec<&String> = looks.iter().map(|(n, _)| *n).collect();
        return vec![Finding {
            check: DRA_NO_DEVICES,
            problem: format!(
                "{what}: no ResourceSlice publishes devices on the nodes pod {pod_name} may go to ({})",
                if names.is_empty() {
                    "none".to_owned()
                } else {
                    nodes_text(&names)
                }
            ),
            fix: "kubectl get resourceslices -o wide  (which nodes the DRA driver publishes devices for; is its kubelet plugin running on the nodes?)".into(),
        }];
    }
    let mut out = Vec::new();
    if looks.iter().all(|(_, l)| l.matching.is_empty()) {
        // Group by selector and outcome: which devices on which nodes, and what they have.
        // The request's own selectors first: what the user asked for is the likelier cause.
        let mut by_selector: BTreeMap<SelectorKey, Vec<(String, String)>> = BTreeMap::new();
        for (node, l) in &looks {
            for (key, devices) in &l.ruled_out {
                let mut has: Vec<&str> = devices.iter().map(|(_, h)| h.as_str()).collect();
                has.sort_unstable();
                has.dedup();
                let has = has
                    .into_iter()
                    .filter(|h| !h.is_empty())
                    .collect::<Vec<_>>();
                let (place, expression, outcome) = key.clone();
                let key = (place.starts_with("DeviceClass"), place, expression, outcome);
                by_selector.entry(key).or_default().push((
                    (*node).clone(),
                    format!(
                        "{node}: {} device{}{}",
                        devices.len(),
                        if devices.len() == 1 { "" } else { "s" },
                        if has.is_empty() {
                            String::new()
                        } else {
                            format!(" ({})", has.join("; "))
                        }
                    ),
                ));
            }
        }
        // Devices the class already rules out (MIG devices for a GPU class) only explain the
        // rest when the request's own selectors rule out none: otherwise they are a footnote.
        let request_groups = by_selector.keys().any(|(class, ..)| !class);
        let mut footnote = Vec::new();
        for ((class, place, expression, outcome), per_node) in by_selector {
            let first_node = per_node[0].0.clone();
            let per_node: Vec<String> = per_node.into_iter().map(|(_, text)| text).collect();
            if class && request_groups {
                let nodes: Vec<&str> = per_node
                    .iter()
                    .map(|p| p.split(" (").next().unwrap_or(p))
                    .collect();
                footnote.push(format!("{place} rules out {}", nodes.join(", ")));
                continue;
            }
            let error = outcome != "false";
            out.push(Finding {
                check: if error { DRA_SELECTOR_ERROR } else { DRA_NO_MATCHING_DEVICE },
                problem: format!(
                    "{what} matches no device on the nodes pod {pod_name} may go to: {place} {expression:?} {} for {}",
                    if error { format!("fails ({outcome})") } else { "is false".into() },
                    per_node.join(", ")
                ),
                fix: if error {
                    format!(
                        "the scheduler stops allocating the claim on this error: guard the attribute with has(...) or 'name' in device.attributes[...]: {edit}; kubectl get resourceslices --field-selector spec.nodeName={first_node} -o yaml  (what the devices publish)"
                    )
                } else if class {
                    format!(
                        "kubectl get resourceslices --field-selector spec.nodeName={first_node} -o yaml  (what the devices publish); kubectl get deviceclass {} -o yaml; name a DeviceClass whose selectors these devices match: {edit}",
                        need.class
                    )
                } else {
                    format!(
                        "kubectl get resourceslices --field-selector spec.nodeName={first_node} -o yaml  (what the devices publish); lower the request or change its selector to what a device has: {edit}"
                    )
                },
            });
        }
        if let (Some(first), false) = (out.first_mut(), footnote.is_empty()) {
            first.problem = format!("{}; besides, {}", first.problem, footnote.join("; "));
        }
        return out;
    }
    // The holding claims, in name order (the fix names the first).
    let holders: BTreeSet<&(String, String)> =
        looks.iter().flat_map(|(_, l)| l.held.keys()).collect();
    let summary: Vec<String> = looks
        .iter()
        .filter(|(_, l)| !l.matching.is_empty())
        .map(|(n, l)| format!("{n}: {} matching, {} free", l.matching.len(), l.free.len()))
        .collect();
    let need_text = if need.all {
        "all matching devices free".to_owned()
    } else {
        format!(
            "{} device{}",
            need.count,
            if need.count == 1 { "" } else { "s" }
        )
    };
    if holders.is_empty() {
        out.push(Finding {
            check: DRA_NOT_ENOUGH_DEVICES,
            problem: format!("{what} needs {need_text} on one node; no node pod {pod_name} may go to has that many that match ({})", summary.join("; ")),
            fix: format!("lower spec.devices.requests[].exactly.count: {edit}"),
        });
        return out;
    }
    let held_text: Vec<String> = looks
        .iter()
        .flat_map(|(_, l)| &l.held)
        .map(|((cns, c), (pods, devices))| {
            format!(
                "ResourceClaim {cns}/{c} (reserved for {}) holds {}",
                if pods.is_empty() {
                    "no pod".to_owned()
                } else {
                    pods.join(", ")
                },
                devices.join(", ")
            )
        })
        .collect();
    let (claim_ns, first_holder) = holders
        .first()
        .map(|(n, c)| (n.as_str(), c.as_str()))
        .unwrap_or((ns, ""));
    out.push(Finding {
        check: DRA_DEVICES_ALLOCATED,
        problem: format!(
            "{what} needs {need_text} on one node; the devices that match are allocated to other claims ({}): {}",
            summary.join("; "),
            held_text.join("; ")
        ),
        fix: format!(
            "kubectl -n {claim_ns} describe resourceclaim {first_holder}  (who holds it); the claim is freed when its pods end: wait, delete those pods, or lower the request ({edit})"
        ),
    });
    out
}

/// Nodes the pod may go to where the device plugin advertises `nvidia.com/gpu` and NVIDIA's
/// DRA driver publishes whole GPUs: each GPU can be handed out twice.
pub fn conflicts(dra: &DraSnapshot, nodes: &[&Node]) -> Vec<Finding> {
    let mut out = Vec::new();
    for node in nodes {
        let name = node.name_any();
        let advertised = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get(GPU_RESOURCE))
            .map(|q| q.0.clone())
            .filter(|q| q != "0");
        let Some(advertised) = advertised else {
            continue;
        };
        let gpus = devices_on(dra, &name)
            .filter(|s| s.spec.driver == NVIDIA_GPU_DRIVER)
            .flat_map(published)
            .filter(|d| {
                d.device
                    .attributes
                    .get(NVIDIA_GPU_DRIVER)
                    .and_then(|a| a.get("type"))
                    .is_none_or(|t| *t == cel::Value::String("gpu".into()))
            })
            .count();
        if gpus == 0 {
            continue;
        }
        out.push(Finding {
            check: DRA_DEVICE_PLUGIN_CONFLICT,
            problem: format!(
                "node {name}: the device plugin advertises {advertised} {GPU_RESOURCE} while the DRA driver {NVIDIA_GPU_DRIVER} publishes {gpus} GPU{} there: the same GPUs can be given to a device-plugin pod and to a claim",
                if gpus == 1 { "" } else { "s" }
            ),
            fix: format!(
                "kubectl label node {name} nvidia.com/gpu.deploy.device-plugin=false --overwrite  (leave the GPUs to DRA), or stop the DRA driver's kubelet plugin there; kubectl get resourceslices --field-selector spec.nodeName={name}"
            ),
        });
    }
    out
}

/// The ComputeDomains that compute-domain claims of the pod name (by UID in their opaque
/// config's `domainID`): missing or not `Ready`.
fn compute_domain_faults(
    dra: &DraSnapshot,
    ns: &str,
    pod_name: &str,
    claims: &[ClaimReport],
    specs: &[Option<&ResourceClaimSpec>],
) -> Vec<Finding> {
    let mut out = Vec::new();
    for (report, spec) in claims.iter().zip(specs) {
        let Some(devices) = spec.and_then(|s| s.devices.as_ref()) else {
            continue;
        };
        let cd_requests: Vec<&str> = devices
            .requests
            .iter()
            .flatten()
            .filter(|r| {
                r.exactly
                    .as_ref()
                    .is_some_and(|e| COMPUTE_DOMAIN_CLASSES.contains(&e.device_class_name.as_str()))
            })
            .map(|r| r.name.as_str())
            .collect();
        if cd_requests.is_empty() {
            continue;
        }
        let domain_ids: BTreeSet<String> = devices
            .config
            .iter()
            .flatten()
            .filter_map(|c| c.opaque.as_ref())
            .filter_map(|o| o.parameters.0.get("domainID")?.as_str().map(str::to_owned))
            .collect();
        // Not readable: a hint already says the claims are judged without them.
        if dra
            .unreadable
            .iter()
            .any(|u| u.starts_with("computedomains."))
        {
            continue;
        }
        for id in domain_ids {
            let Some(domains) = &dra.compute_domains else {
                out.push(Finding {
                    check: DRA_COMPUTE_DOMAIN_NOT_READY,
                    problem: format!("claim {} asks for a compute-domain device of ComputeDomain UID {id}, but the ComputeDomain CRD (resource.nvidia.com) is not served", report.name),
                    fix: "kubectl get crd computedomains.resource.nvidia.com  (install NVIDIA's DRA driver with its compute-domain part)".into(),
                });
                continue;
            };
            let found = domains
                .iter()
                .find(|d| d["metadata"]["uid"].as_str() == Some(id.as_str()));
            let Some(domain) = found else {
                out.push(Finding {
                    check: DRA_COMPUTE_DOMAIN_NOT_READY,
                    problem: format!("claim {} names ComputeDomain UID {id} in its opaque config, and no ComputeDomain has that UID (deleted?)", report.name),
                    fix: format!("kubectl get computedomains -A; recreate pod {pod_name} from a ResourceClaimTemplate of an existing ComputeDomain (spec.channel.resourceClaimTemplate.name)"),
                });
                continue;
            };
            let status = domain["status"]["status"].as_str().unwrap_or("unknown");
            if status != "Ready" {
                let name = domain["metadata"]["name"].as_str().unwrap_or("?");
                let dns = domain["metadata"]["namespace"].as_str().unwrap_or(ns);
                out.push(Finding {
                    check: DRA_COMPUTE_DOMAIN_NOT_READY,
                    problem: format!(
                        "claim {} (requests {}) belongs to ComputeDomain {dns}/{name}, whose status is {status}: its channel is not prepared until the domain's IMEX daemons are ready",
                        report.name,
                        cd_requests.join(", ")
                    ),
                    fix: format!(
                        "kubectl -n {dns} describe computedomain {name}  (status.nodes); kubectl get pods -A -l resource.nvidia.com/computeDomain  (its daemons)"
                    ),
                });
            }
        }
    }
    out
}

/// The claims as text, one line each, after the pod's line.
pub fn claims_text(claims: &[ClaimReport]) -> String {
    let mut out = String::new();
    for c in claims {
        let source = match (&c.resource_claim, &c.template) {
            (Some(r), Some(t)) => format!("ResourceClaim {r} from template {t}"),
            (Some(r), None) => format!("ResourceClaim {r}"),
            (None, Some(t)) => format!("template {t}, no ResourceClaim yet"),
            (None, None) => "no ResourceClaim".into(),
        };
        let nodes = if c.nodes.is_empty() {
            String::new()
        } else if c.state == "allocated" {
            format!(" on {}", c.nodes.join(", "))
        } else {
            format!(" (fits {})", c.nodes.join(", "))
        };
        out.push_str(&format!(
            "claim {} ({source}): {}{nodes}\n",
            c.name, c.state
        ));
    }
    out
}

#[cfg(test)]
#[path = "dra_tests.rs"]
mod tests;
