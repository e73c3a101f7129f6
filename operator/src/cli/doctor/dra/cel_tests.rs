//! The selector subset evaluated over devices like NVIDIA's DRA driver publishes them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

const GPU: &str = "gpu.nvidia.com";

fn a100_40gb() -> Device {
    let attributes = BTreeMap::from([
        (
            "productName".to_owned(),
            Value::String("NVIDIA A100-SXM4-40GB".into()),
        ),
        ("type".to_owned(), Value::String("gpu".into())),
        ("index".to_owned(), Value::Int(3)),
        ("migCapable".to_owned(), Value::Bool(true)),
        (
            "driverVersion".to_owned(),
            Value::Version(Version::parse("580.95.5").unwrap()),
        ),
        (
            "cudaComputeCapability".to_owned(),
            Value::Version(Version::parse("8.0.0").unwrap()),
        ),
    ]);
    let capacity = BTreeMap::from([("memory".to_owned(), Quantity::parse("40536Mi").unwrap())]);
    Device {
        driver: GPU.into(),
        attributes: BTreeMap::from([(GPU.to_owned(), attributes)]),
        capacity: BTreeMap::from([(GPU.to_owned(), capacity)]),
    }
}

fn eval_str(src: &str) -> std::result::Result<bool, Error> {
    evaluate(&parse(src)?, &a100_40gb())
}

#[test]
fn quantities_compare_exactly_across_suffixes() {
    // NVML's 40536Mi is less than 40Gi (40960Mi): the scheduler does not match it.
    assert_eq!(
        eval_str("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0"),
        Ok(false)
    );
    assert_eq!(
        eval_str("device.capacity[\"gpu.nvidia.com\"].memory.compareTo(quantity(\"39Gi\")) > 0"),
        Ok(true)
    );
    assert_eq!(
        eval_str("device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('42G'))"),
        Ok(true),
        "40536Mi = 42.5e9 bytes"
    );
    assert_eq!(
        eval_str("device.capacity['gpu.nvidia.com'].memory.isLessThan(quantity('40536Mi'))"),
        Ok(false)
    );
    assert_eq!(
        eval_str("device.capacity['gpu.nvidia.com'].memory == quantity('40536Mi')"),
        Ok(true)
    );
    let q = |s: &str| Quantity::parse(s).unwrap().nanos;
    assert_eq!(q("1.5Gi"), 3 * (1i128 << 29) * 1_000_000_000);
    assert_eq!(q("100m"), 100_000_000);
    assert_eq!(q("2e3"), q("2k"));
    assert_eq!(q("1n"), 1);
    assert!(Quantity::parse("12XB").is_none());
    assert!(Quantity::parse("").is_none());
}

#[test]
fn typed_attributes_compare_by_their_type() {
    assert_eq!(
        eval_str("device.attributes['gpu.nvidia.com'].productName == 'NVIDIA A100-SXM4-40GB'"),
        Ok(true)
    );
    assert_eq!(
        eval_str("device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA H100')"),
        Ok(false)
    );
    assert_eq!(
        eval_str(
            "device.attributes['gpu.nvidia.com'].index >= 2 && device.attributes['gpu.nvidia.com'].migCapable"
        ),
        Ok(true)
    );
    assert_eq!(
        eval_str("device.attributes['gpu.nvidia.com'].productName.lowerAscii().contains('a100')"),
        Ok(true)
    );
    assert_eq!(
        eval_str("device.attributes['gpu.nvidia.com'].type in ['gpu', 'mig']"),
        Ok(true)
    );
    assert_eq!(eval_str("device.driver == 'gpu.nvidia.com'"), Ok(true));
    // Comparing a string with an int has no overload: an error, as in the scheduler.
    assert!(matches!(
        eval_str("device.attributes['gpu.nvidia.com'].productName > 3"),
        Err(Error::Runtime(_))
    ));
}

#[test]
fn versions_compare_as_semvers() {
    assert_eq!(
        eval_str(
            "device.attributes['gpu.nvidia.com'].driverVersion.isGreaterThan(semver('550.54.15'))"
        ),
        Ok(true)
    );
    assert_eq!(
        eval_str(
            "device.attributes['gpu.nvidia.com'].cudaComputeCapability.compareTo(semver('9.0.0')) >= 0"
        ),
        Ok(false)
    );
    assert_eq!(
        eval_str("device.attributes['gpu.nvidia.com'].driverVersion == semver('580.95.5')"),
        Ok(true)
    );
    assert_eq!(
        eval_str("device.attributes['gpu.nvidia.com'].cudaComputeCapability.major() == 8"),
        Ok(true)
    );
    let v = |s: &str| Version::parse(s).unwrap();
    assert!(v("1.0.0-rc.1") < v("1.0.0"));
    assert!(v("1.0.0-alpha") < v("1.0.0-alpha.1"));
    assert!(v("1.0.0-2") < v("1.0.0-10"));
    assert!(Version::parse("1.2").is_none());
    assert!(Version::parse("01.2.3").is_none());
}

#[test]
fn a_missing_attribute_is_a_runtime_error_and_an_unknown_domain_an_empty_map() {
    assert_eq!(
        eval_str("device.attributes['gpu.nvidia.com'].profile == '1g.5gb'"),
        Err(Error::Runtime("no such key: profile".into()))
    );
    assert_eq!(
        eval_str("has(device.attributes['gpu.nvidia.com'].profile)"),
        Ok(false)
    );
    assert_eq!(
        eval_str("'profile' in device.attributes['gpu.nvidia.com']"),
        Ok(false)
    );
    assert_eq!(
        eval_str("device.attributes['other.example.com'].size() == 0"),
        Ok(true)
    );
    // CEL's && and || absorb an error on either side when the other decides.
    assert_eq!(
        eval_str("device.attributes['gpu.nvidia.com'].profile == 'x' && false"),
        Ok(false)
    );
    assert_eq!(
        eval_str("true || device.attributes['gpu.nvidia.com'].profile == 'x'"),
        Ok(true)
    );
    assert!(matches!(
        eval_str("device.attributes['gpu.nvidia.com'].profile == 'x' && true"),
        Err(Error::Runtime(_))
    ));
}

#[test]
fn what_is_outside_the_subset_is_not_evaluated() {
    for src in [
        "device.attributes['gpu.nvidia.com'].productName.matches('^NVIDIA')",
        "[1, 2].all(x, x > 0)",
        "device.attributes['gpu.nvidia.com'].productName.split(' ')[0] == 'NVIDIA'",
        "timestamp('2024-01-01T00:00:00Z') > timestamp('2023-01-01T00:00:00Z')",
        "device.attributes['gpu.nvidia.com'].productName == '''x'''",
    ] {
        let got = eval_str(src);
        assert!(matches!(got, Err(Error::Unsupported(_))), "{src}: {got:?}");
        assert!(got.unwrap_err().to_string().starts_with("not evaluated: "));
    }
}

#[test]
fn ints_arithmetic_ternaries_and_precedence() {
    assert_eq!(eval_str("1 + 2 * 3 == 7"), Ok(true));
    assert_eq!(eval_str("(1 + 2) * 3 == 9 && 7 % 4 == 3"), Ok(true));
    assert_eq!(eval_str("!(1 < 2) || -3 < -2"), Ok(true));
    assert_eq!(eval_str("1 == 1.0"), Ok(true));
    assert_eq!(eval_str("true ? 1 > 0 : false"), Ok(true));
    assert!(matches!(eval_str("1 / 0 == 0"), Err(Error::Runtime(_))));
    assert!(matches!(
        eval_str("device.attributes['gpu.nvidia.com'].index"),
        Err(Error::Runtime(_))
    ));
}

#[test]
fn reads_name_what_the_device_has_for_each_path_the_expression_reads() {
    let e = parse(
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0 && \
         device.attributes['gpu.nvidia.com'].profile == '1g.5gb' && device.driver == 'x'",
    )
    .unwrap();
    assert_eq!(
        reads(&e, &a100_40gb()),
        vec![
            (
                "capacity[\"gpu.nvidia.com\"].memory".to_owned(),
                Some("40536Mi".to_owned())
            ),
            ("attributes[\"gpu.nvidia.com\"].profile".to_owned(), None),
            (
                "device.driver".to_owned(),
                Some("\"gpu.nvidia.com\"".to_owned())
            ),
        ]
    );
}
