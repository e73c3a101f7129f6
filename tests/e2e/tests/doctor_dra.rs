//! `gpu-operator doctor <pod>` on pods whose GPUs come from DRA ResourceClaims, against the real
//! kube-apiserver and kube-scheduler with the stand-in kubelet plugin's ResourceSlices
//! (e2e::dra): a claim asking for more memory than any GPU has, one for a product no node has,
//! one for a MIG profile whose devices other claims hold, each named with its claim, the
//! attribute or the holding claims, and the fix; a satisfiable claim reads ok. Each pod is
//! judged while a scheduling gate holds it back, then released: the scheduler must agree (the
//! satisfiable one lands on a node the doctor said it fits, the others stay Pending with the
//! scheduler's reason).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use e2e::cluster::unique_name;
use e2e::dra;
use e2e::nodes::{self, GpuModel};
use e2e::session::{self, TIMEOUT};
use e2e::wait;
use gpu_operator::cli::doctor::dra::{
    DRA_DEVICE_PLUGIN_CONFLICT, DRA_DEVICES_ALLOCATED, DRA_NO_MATCHING_DEVICE,
};
use gpu_operator::cli::doctor::{EXIT_COULD_NOT_RUN, EXIT_FAULTS};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Client;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use serde_json::{Value, json};

const GATE: &str = "gpu-operator.test/doctor-first";

fn resource_api(client: &Client, ns: Option<&str>, kind: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk("resource.k8s.io", "v1", kind));
    match ns {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    }
}

async fn create(client: &Client, ns: Option<&str>, kind: &str, body: Value) {
    let obj: DynamicObject = serde_json::from_value(body).unwrap();
    resource_api(client, ns, kind)
        .create(&PostParams::default(), &obj)
        .await
        .unwrap_or_else(|e| panic!("creating {kind}: {e}"));
}

fn request(class: &str, cel: &str) -> Value {
    json!([{"name": "gpu", "exactly": {"deviceClassName": class,
        "selectors": [{"cel": {"expression": cel}}]}}])
}

async fn template(client: &Client, ns: &str, name: &str, requests: Value) {
    create(
        client,
        Some(ns),
        "ResourceClaimTemplate",
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name}, "spec": {"spec": {"devices": {"requests": requests}}}}),
    )
    .await;
}

/// A pod with one claim `gpu` from `template`, held back by a scheduling gate when `gated`.
async fn claim_pod(client: &Client, ns: &str, name: &str, template: &str, gated: bool) {
    let mut spec = json!({
        "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
                        "resources": {"claims": [{"name": "gpu"}]}}],
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        "tolerations": [{"operator": "Exists"}]});
    if gated {
        spec["schedulingGates"] = json!([{"name": GATE}]);
    }
    let pod: Pod =
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap();
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
}

/// Waits until the resource-claim controller has generated the pod's claim (so the doctor
/// judges the claim itself, not only its template).
async fn claim_generated(client: &Client, ns: &str, name: &str) -> String {
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    wait::until(TIMEOUT, &format!("claim of {name} generated"), || {
        let api = api.clone();
        async move {
            let p = api.get(name).await?;
            let claim = p
                .status
                .and_then(|s| s.resource_claim_statuses)
                .into_iter()
                .flatten()
                .find_map(|s| s.resource_claim_name);
            Ok(claim.ok_or_else(|| "no resourceClaimStatuses yet".to_owned()))
        }
    })
    .await
    .unwrap()
}

async fn ungate(client: &Client, ns: &str, name: &str) {
    Api::<Pod>::namespaced(client.clone(), ns)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"schedulingGates": null}})),
        )
        .await
        .unwrap();
}

async fn scheduled_node(client: &Client, ns: &str, name: &str) -> String {
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    wait::until(TIMEOUT, &format!("pod {name} scheduled"), || {
        let api = api.clone();
        async move {
            let p = api.get(name).await?;
            Ok(match p.spec.as_ref().and_then(|s| s.node_name.clone()) {
                Some(n) => Ok(n),
                None => Err(format!("{:?}", p.status.and_then(|s| s.conditions))),
            })
        }
    })
    .await
    .unwrap()
}

/// The scheduler's message once it has found the pod unschedulable.
async fn unschedulable(client: &Client, ns: &str, name: &str) -> String {
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    wait::until(TIMEOUT, &format!("pod {name} unschedulable"), || {
        let api = api.clone();
        async move {
            let p = api.get(name).await?;
            let cond = p
                .status
                .and_then(|s| s.conditions)
                .into_iter()
                .flatten()
                .find(|c| {
                    c.type_ == "PodScheduled"
                        && c.status == "False"
                        && c.reason.as_deref() == Some("Unschedulable")
                });
            Ok(cond
                .map(|c| c.message.unwrap_or_default())
                .ok_or_else(|| "not yet".to_owned()))
        }
    })
    .await
    .unwrap()
}

/// One doctor run on a pod: exit code, text, and the same run's JSON.
struct Verdict {
    code: Option<i32>,
    text: String,
    json: Value,
}

impl Verdict {
    fn faults(&self, check: &str) -> Vec<&Value> {
        self.json["faults"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["check"] == json!(check))
            .collect()
    }

    fn dra_faults(&self) -> Vec<&Value> {
        self.json["faults"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["check"].as_str().unwrap().starts_with("dra-"))
            .collect()
    }

    fn claim(&self) -> &Value {
        &self.json["resourceClaims"][0]
    }

    /// The text carries each JSON fault as `FAULT <check>: <problem>` and its fix.
    fn assert_text_matches_json(&self) {
        for f in self.json["faults"].as_array().unwrap() {
            let line = format!(
                "FAULT {}: {}\n  fix: {}",
                f["check"].as_str().unwrap(),
                f["problem"].as_str().unwrap(),
                f["fix"].as_str().unwrap()
            );
            assert!(self.text.contains(&line), "{line}\nnot in\n{}", self.text);
        }
    }
}

fn doctor(ns: &str, pod: &str) -> Verdict {
    let run = |extra: &[&str]| {
        let out = Command::new(e2e::operator::binary().unwrap())
            .args(["doctor", "-n", ns, pod])
            .args(extra)
            .output()
            .unwrap();
        assert_ne!(
            out.status.code(),
            Some(i32::from(EXIT_COULD_NOT_RUN)),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, text) = run(&[]);
    let (json_code, json) = run(&["-o", "json"]);
    assert_eq!(code, json_code, "text and JSON exit alike");
    let json: Value = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"));
    let v = Verdict { code, text, json };
    v.assert_text_matches_json();
    v
}

#[tokio::test]
async fn doctor_explains_dra_claims_and_the_scheduler_agrees() {
    let Some(prepared) = session::builder().prepare().await else {
        return;
    };
    let admin = prepared.admin.clone();
    let started = std::time::Instant::now();
    let prefix = unique_name("ddra");
    // Two nodes of whole GPUs (A100-80GB, H100) and one A100-40GB with MIG devices.
    let a100 = format!("{prefix}-a100-80gb");
    let h100 = format!("{prefix}-h100");
    let mig = format!("{prefix}-a100-mig");
    nodes::create(
        &admin,
        &[
            session::ephemeral_gpu_node(&a100, GpuModel::A100Sxm80Gb),
            session::ephemeral_gpu_node(&h100, GpuModel::H100Sxm80Gb),
            session::ephemeral_gpu_node(&mig, GpuModel::A100Sxm40Gb),
        ],
    )
    .await
    .unwrap();
    dra::publish(
        &admin,
        &a100,
        dra::gpu_devices(&a100, GpuModel::A100Sxm80Gb),
    )
    .await
    .unwrap();
    dra::publish(
        &admin,
        &h100,
        dra::gpu_devices(&h100, GpuModel::H100Sxm80Gb),
    )
    .await
    .unwrap();
    // One partitioned GPU: two 1g.5gb, one 2g.10gb, one 3g.20gb.
    dra::publish(&admin, &mig, dra::a100_40gb_balanced_mig_devices(&mig, 0))
        .await
        .unwrap();

    // Classes of this test only, so that no other test's claims compete.
    let gpu_class = format!("{prefix}-gpu");
    let mig_class = format!("{prefix}-mig");
    for (name, kind) in [(&gpu_class, "gpu"), (&mig_class, "mig")] {
        create(&admin, None, "DeviceClass", json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": name, "labels": {session::EPHEMERAL: "true"}},
            "spec": {"selectors": [{"cel": {"expression": format!(
                "device.driver == '{}' && device.attributes['{}'].type == '{kind}'", dra::DRIVER, dra::DRIVER)}}]}}))
        .await;
    }
    let ns = unique_name("doctor-dra");
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap(),
        )
        .await
        .unwrap();
    let memory = |q: &str| {
        format!(
            "device.capacity['{}'].memory.compareTo(quantity('{q}')) >= 0",
            dra::DRIVER
        )
    };
    template(&admin, &ns, "huge", request(&gpu_class, &memory("200Gi"))).await;
    template(&admin, &ns, "big", request(&gpu_class, &memory("80Gi"))).await;
    template(
        &admin,
        &ns,
        "h200",
        request(
            &gpu_class,
            &format!(
                "device.attributes['{}'].productName == 'NVIDIA H200'",
                dra::DRIVER
            ),
        ),
    )
    .await;
    template(
        &admin,
        &ns,
        "one-1g",
        request(
            &mig_class,
            &format!("device.attributes['{}'].profile == '1g.5gb'", dra::DRIVER),
        ),
    )
    .await;

    // The MIG profile's two devices, taken first by two pods the scheduler places.
    for holder in ["holder-0", "holder-1"] {
        claim_pod(&admin, &ns, holder, "one-1g", false).await;
    }
    for holder in ["holder-0", "holder-1"] {
        assert_eq!(scheduled_node(&admin, &ns, holder).await, mig);
    }
    let holder_claims = [
        claim_generated(&admin, &ns, "holder-0").await,
        claim_generated(&admin, &ns, "holder-1").await,
    ];

    for (pod, t) in [
        ("fits", "big"),
        ("too-big", "huge"),
        ("no-h200", "h200"),
        ("third-1g", "one-1g"),
    ] {
        claim_pod(&admin, &ns, pod, t, true).await;
    }
    for pod in ["fits", "too-big", "no-h200", "third-1g"] {
        claim_generated(&admin, &ns, pod).await;
    }

    // Satisfiable: ok, on the two 80 GB nodes (NVML's 81920Mi and 81559Mi: the H100 does not
    // reach 80Gi = 81920Mi, so only the A100-80GB fits).
    let fits = doctor(&ns, "fits");
    assert!(fits.dra_faults().is_empty(), "{}", fits.text);
    assert_eq!(fits.claim()["state"], json!("ok"), "{}", fits.text);
    assert_eq!(fits.claim()["nodes"], json!([a100]), "{}", fits.text);
    assert!(
        fits.text.contains("claim gpu (ResourceClaim fits-gpu-")
            && fits.text.contains(&format!("): ok (fits {a100})")),
        "{}",
        fits.text
    );

    // More memory than any GPU has: the claim, the selector, what each node has, the fix.
    let too_big = doctor(&ns, "too-big");
    assert_eq!(too_big.code, Some(i32::from(EXIT_FAULTS)));
    assert_eq!(too_big.claim()["state"], json!("unsatisfiable"));
    let f = too_big.faults(DRA_NO_MATCHING_DEVICE);
    assert_eq!(f.len(), 1, "{}", too_big.text);
    let problem = f[0]["problem"].as_str().unwrap();
    for needle in [
        "claim gpu request gpu",
        "quantity('200Gi')",
        // The API server writes a quantity canonically: 81920Mi is published as 80Gi.
        &format!("{a100}: 8 devices (capacity[\"gpu.nvidia.com\"].memory is 80Gi)"),
        &format!("{h100}: 8 devices (capacity[\"gpu.nvidia.com\"].memory is 81559Mi)"),
    ] {
        assert!(problem.contains(needle), "{needle} not in {problem}");
    }
    let fix = f[0]["fix"].as_str().unwrap();
    assert!(
        fix.contains("kubectl get resourceslices --field-selector spec.nodeName="),
        "{fix}"
    );
    assert!(
        fix.contains(&format!("kubectl -n {ns} edit resourceclaimtemplate huge")),
        "{fix}"
    );

    // A product not present: the attribute and each node's value.
    let no_h200 = doctor(&ns, "no-h200");
    let f = no_h200.faults(DRA_NO_MATCHING_DEVICE);
    assert_eq!(f.len(), 1, "{}", no_h200.text);
    let problem = f[0]["problem"].as_str().unwrap();
    assert!(
        problem.contains("productName == 'NVIDIA H200'"),
        "{problem}"
    );
    assert!(
        problem.contains("productName is \"NVIDIA A100-SXM4-80GB\""),
        "{problem}"
    );
    assert!(
        problem.contains("productName is \"NVIDIA H100 80GB HBM3\""),
        "{problem}"
    );

    // Every 1g.5gb held: the holding claims and their pods.
    let third = doctor(&ns, "third-1g");
    let f = third.faults(DRA_DEVICES_ALLOCATED);
    assert_eq!(f.len(), 1, "{}", third.text);
    let problem = f[0]["problem"].as_str().unwrap();
    assert!(
        problem.contains(&format!("{mig}: 2 matching, 0 free")),
        "{problem}"
    );
    for (claim, pod) in holder_claims.iter().zip(["holder-0", "holder-1"]) {
        assert!(
            problem.contains(&format!(
                "ResourceClaim {ns}/{claim} (reserved for {ns}/{pod})"
            )),
            "{claim} {pod} not in {problem}"
        );
    }
    assert!(
        f[0]["fix"].as_str().unwrap().starts_with(&format!(
            "kubectl -n {ns} describe resourceclaim {}",
            holder_claims[0]
        )),
        "{}",
        third.text
    );
    let held = &third.claim()["requests"][0]["nodes"];
    let on_mig = held
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == json!(mig))
        .unwrap();
    assert_eq!(
        (on_mig["matching"].clone(), on_mig["free"].clone()),
        (json!(2), json!(0))
    );
    assert_eq!(on_mig["heldBy"].as_array().unwrap().len(), 2);
    // The devices the doctor calls held are exactly those the scheduler allocated to them.
    let mut allocated: Vec<String> = Vec::new();
    for claim in &holder_claims {
        let c = resource_api(&admin, Some(&ns), "ResourceClaim")
            .get(claim)
            .await
            .unwrap();
        for r in c.data["status"]["allocation"]["devices"]["results"]
            .as_array()
            .unwrap()
        {
            allocated.push(format!(
                "{}/{}/{}",
                r["driver"].as_str().unwrap(),
                r["pool"].as_str().unwrap(),
                r["device"].as_str().unwrap()
            ));
        }
    }
    let mut held_devices: Vec<String> = on_mig["heldBy"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|h| h["devices"].as_array().unwrap().clone())
        .map(|d| d.as_str().unwrap().to_owned())
        .collect();
    allocated.sort();
    held_devices.sort();
    assert_eq!(held_devices, allocated);
    println!("fits, before the scheduler:\n{}", fits.text);
    println!("third-1g, before the scheduler:\n{}", third.text);

    // The scheduler agrees with each verdict.
    for pod in ["fits", "too-big", "no-h200", "third-1g"] {
        ungate(&admin, &ns, pod).await;
    }
    let landed = scheduled_node(&admin, &ns, "fits").await;
    assert_eq!(landed, a100, "the doctor said it fits only {a100}");
    for pod in ["too-big", "no-h200", "third-1g"] {
        let why = unschedulable(&admin, &ns, pod).await;
        let p = Api::<Pod>::namespaced(admin.clone(), &ns)
            .get(pod)
            .await
            .unwrap();
        assert!(
            p.spec.unwrap().node_name.is_none(),
            "{pod} was placed: {why}"
        );
        // Once the scheduler has spoken, the doctor still names the same cause.
        let again = doctor(&ns, pod);
        assert_eq!(
            again.claim()["state"],
            json!("unsatisfiable"),
            "{pod}: {}",
            again.text
        );
        println!("{pod}: scheduler: {why}");
    }
    // The placed pod's claim now reads allocated on the node it landed on.
    let placed = doctor(&ns, "fits");
    assert_eq!(
        placed.claim()["state"],
        json!("allocated"),
        "{}",
        placed.text
    );
    assert_eq!(placed.claim()["nodes"], json!([landed]), "{}", placed.text);
    // The device it got is one of the 8 the doctor counted as matching and free there.
    let fits_claim = placed.claim()["resourceClaim"].as_str().unwrap().to_owned();
    let c = resource_api(&admin, Some(&ns), "ResourceClaim")
        .get(&fits_claim)
        .await
        .unwrap();
    let device = c.data["status"]["allocation"]["devices"]["results"][0]["device"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        dra::gpu_devices(&a100, GpuModel::A100Sxm80Gb)
            .iter()
            .any(|d| d["name"] == json!(device)),
        "{device}"
    );
    let on_a100 = fits.claim()["requests"][0]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == json!(a100))
        .unwrap()
        .clone();
    assert_eq!(
        (on_a100["matching"].clone(), on_a100["free"].clone()),
        (json!(8), json!(8))
    );

    // The device plugin advertising the same GPUs DRA publishes is a finding.
    nodes::advertise_gpus(&admin, &h100, Some(8)).await.unwrap();
    let conflict = doctor(&ns, "too-big");
    let f = conflict.faults(DRA_DEVICE_PLUGIN_CONFLICT);
    assert_eq!(f.len(), 1, "{}", conflict.text);
    assert!(
        f[0]["problem"].as_str().unwrap().contains(&format!(
            "node {h100}: the device plugin advertises 8 nvidia.com/gpu while the DRA driver gpu.nvidia.com publishes 8 GPUs"
        )),
        "{}",
        conflict.text
    );

    println!("doctor_dra: {:.1}s", started.elapsed().as_secs_f64());
    Api::<Namespace>::all(admin.clone())
        .delete(&ns, &DeleteParams::default())
        .await
        .unwrap();
    for class in [&gpu_class, &mig_class] {
        resource_api(&admin, None, "DeviceClass")
            .delete(class, &DeleteParams::default())
            .await
            .unwrap();
    }
    dra::remove_all(&admin).await.unwrap();
    nodes::delete(&admin, &[a100, h100, mig]).await.unwrap();
}
