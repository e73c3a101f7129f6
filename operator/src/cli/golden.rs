//! Golden files of the commands' output (tests only): `src/cli/testdata/<name>`, rewritten with
//! `UPDATE_GOLDEN=1` and then reviewed like code.

#![allow(clippy::unwrap_used, clippy::expect_used)]

/// Compares `actual` with the golden file `testdata/<name>` (`UPDATE_GOLDEN=1` rewrites it).
pub fn assert_golden(name: &str, actual: &str) {
    let path = format!("{}/src/cli/testdata/{name}", env!("CARGO_MANIFEST_DIR"));
    if std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1") {
        std::fs::write(&path, actual).unwrap();
    }
    let golden = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}; write it with UPDATE_GOLDEN=1 and review"));
    assert_eq!(
        actual, golden,
        "{name}: regenerate with UPDATE_GOLDEN=1 and review"
    );
}
