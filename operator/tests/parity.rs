//! The device plugin config corpus (`tests/sharing-corpus/*.yaml`), checked two ways:
//!
//! 1. our validator against each file's header: `# expect: accept|reject`, optional
//!    `# mig-strategy: X` (the policy's `spec.mig.strategy`), `# message: <substring of our
//!    problem>` and `# warning: <substring of one of our warnings>` lines;
//! 2. our validator against the plugin's own config package, built from its Go module by
//!    `tests/parity/build.sh` (decision 5). When that module cannot be downloaded on this
//!    machine the build script exits 3 and the comparison is skipped with a notice, unless
//!    `GPU_OPERATOR_REQUIRE_PARITY=1` makes that a failure.

// A test crate: a broken corpus or oracle should stop the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use gpu_operator::sharing::device_plugin::{MIG_STRATEGY_ENV, OPERATOR_PLUGIN_ENV, validate_key};

struct Case {
    path: PathBuf,
    name: String,
    text: String,
    expect_accept: bool,
    mig_strategy: Option<String>,
    messages: Vec<String>,
    warnings: Vec<String>,
}

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sharing-corpus")
}

fn corpus() -> Vec<Case> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(corpus_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).unwrap();
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            let mut expect = None;
            let mut mig_strategy = None;
            let mut messages = Vec::new();
            let mut warnings = Vec::new();
            for line in text.lines().take_while(|l| l.starts_with('#')) {
                let Some((key, value)) = line.trim_start_matches('#').split_once(':') else {
                    continue;
                };
                let value = value.trim().to_string();
                match key.trim() {
                    "expect" => expect = Some(value),
                    "mig-strategy" => mig_strategy = Some(value),
                    "message" => messages.push(value),
                    "warning" => warnings.push(value),
                    _ => {}
                }
            }
            assert!(
                text.starts_with("# expect: "),
                "{name}: the first line must be `# expect: accept|reject`"
            );
            let expect_accept = match expect.as_deref() {
                Some("accept") => true,
                Some("reject") => false,
                other => panic!("{name}: expect is {other:?}"),
            };
            Case {
                path,
                name,
                text,
                expect_accept,
                mig_strategy,
                messages,
                warnings,
            }
        })
        .collect()
}

#[test]
fn sharing_corpus_is_large_enough() {
    let cases = corpus();
    let rejected = cases.iter().filter(|c| !c.expect_accept).count();
    let warned = cases.iter().filter(|c| !c.warnings.is_empty()).count();
    assert!(rejected >= 25, "only {rejected} invalid configs");
    assert!(cases.len() - rejected >= 10, "too few valid configs");
    assert!(warned >= 10, "too few warning cases");
    for case in &cases {
        assert!(
            case.expect_accept || !case.messages.is_empty(),
            "{}: a rejected file needs a `# message:` line",
            case.name
        );
    }
}

#[test]
fn sharing_corpus_matches_expectations() {
    let mut failures = Vec::new();
    for case in corpus() {
        let result = validate_key(
            "corpus",
            &case.name,
            &case.text,
            case.mig_strategy.as_deref(),
        );
        match (&result, case.expect_accept) {
            (Ok(summary), true) => {
                for expected in &case.warnings {
                    if !summary
                        .warnings
                        .iter()
                        .any(|w| w.contains(expected.as_str()))
                    {
                        failures.push(format!(
                            "{}: no warning contains {expected:?}; warnings: {:#?}",
                            case.name, summary.warnings
                        ));
                    }
                }
                if case.warnings.is_empty() && case.name.starts_with("warn-") {
                    failures.push(format!("{}: a warn- file needs `# warning:`", case.name));
                }
            }
            (Err(problems), false) => {
                let texts: Vec<String> = problems.iter().map(ToString::to_string).collect();
                for expected in &case.messages {
                    if !texts.iter().any(|t| t.contains(expected.as_str())) {
                        failures.push(format!(
                            "{}: no problem contains {expected:?}; problems: {texts:#?}",
                            case.name
                        ));
                    }
                }
                for text in &texts {
                    if !text.starts_with(&format!("ConfigMap corpus, key {:?}: ", case.name)) {
                        failures.push(format!(
                            "{}: {text:?} does not name ConfigMap and key",
                            case.name
                        ));
                    }
                }
            }
            (Ok(_), false) => failures.push(format!("{}: accepted, expected reject", case.name)),
            (Err(problems), true) => failures.push(format!(
                "{}: rejected, expected accept: {:#?}",
                case.name,
                problems.iter().map(ToString::to_string).collect::<Vec<_>>()
            )),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

enum Oracle {
    Built(PathBuf),
    Unavailable(String),
}

fn build_oracle() -> Oracle {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let output = Command::new("bash")
        .arg(root.join("tests/parity/build.sh"))
        .output()
        .expect("run tests/parity/build.sh");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    match output.status.code() {
        Some(0) => {
            let stdout = String::from_utf8_lossy(&output.stdout);
            let path = stdout
                .lines()
                .last()
                .expect("build.sh printed no path")
                .trim();
            Oracle::Built(PathBuf::from(path))
        }
        Some(3) => Oracle::Unavailable(stderr),
        _ => panic!("tests/parity/build.sh failed:\n{stderr}"),
    }
}

#[test]
fn sharing_corpus_parity_with_the_plugin() {
    let oracle = match build_oracle() {
        Oracle::Built(path) => path,
        Oracle::Unavailable(why) => {
            assert!(
                std::env::var("GPU_OPERATOR_REQUIRE_PARITY").as_deref() != Ok("1"),
                "the parity oracle is required but cannot be built:\n{why}"
            );
            eprintln!(
                "SKIPPED: the device plugin's config package cannot be built here, so the corpus was not compared with it:\n{why}"
            );
            return;
        }
    };

    let cases = corpus();
    let mut by_strategy: BTreeMap<Option<&str>, Vec<&Case>> = BTreeMap::new();
    for case in &cases {
        by_strategy
            .entry(case.mig_strategy.as_deref())
            .or_default()
            .push(case);
    }

    let mut disagreements = Vec::new();
    let mut compared = 0;
    for (strategy, group) in by_strategy {
        let mut command = Command::new(&oracle);
        command.env_remove(MIG_STRATEGY_ENV);
        for (name, value) in OPERATOR_PLUGIN_ENV {
            command.env(name, value);
        }
        if let Some(strategy) = strategy {
            command.env(MIG_STRATEGY_ENV, strategy);
        }
        let output = command
            .args(group.iter().map(|c| &c.path))
            .output()
            .expect("run the parity oracle");
        assert!(
            output.status.success(),
            "the parity oracle failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let verdicts: BTreeMap<PathBuf, (bool, String)> = String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(|line| {
                let mut parts = line.splitn(3, '\t');
                let file = PathBuf::from(parts.next().unwrap_or_default());
                let accept = parts.next() == Some("accept");
                (file, (accept, parts.next().unwrap_or_default().to_string()))
            })
            .collect();
        for case in group {
            let Some((plugin_accepts, plugin_error)) = verdicts.get(&case.path) else {
                disagreements.push(format!("{}: the oracle printed no verdict", case.name));
                continue;
            };
            compared += 1;
            let ours = validate_key("corpus", &case.name, &case.text, strategy);
            if ours.is_ok() != *plugin_accepts {
                disagreements.push(format!(
                    "{}: plugin {} ({plugin_error}), validator {}",
                    case.name,
                    if *plugin_accepts {
                        "accepts"
                    } else {
                        "rejects"
                    },
                    match &ours {
                        Ok(_) => "accepts".to_string(),
                        Err(p) => format!("rejects: {}", p[0]),
                    }
                ));
            }
        }
    }
    eprintln!(
        "parity: {} of {compared} corpus files agree with the plugin",
        compared - disagreements.len()
    );
    assert!(disagreements.is_empty(), "{}", disagreements.join("\n"));
}
