//! The MIG config corpus (`tests/mig-corpus/*.yaml`): our mig-parted config parser against
//! mig-parted v0.15.0's verdict on each file.
//!
//! Each file opens with header lines: `# expect: accept|reject` (mig-parted's verdict),
//! `# mig-parted v0.15.0: <its error, or why it accepts>` (facts, read from its
//! api/spec/v1/spec.go and pkg/types/mig_config.go; mig-parted wraps errors as `unmarshal error:
//! error unmarshaling JSON: while decoding JSON: <error>`), and for rejects one or more
//! `# message: <substring of our problem>`. The rest of the file is the config.yaml text.
//! mig-parted itself cannot be built here (the Go module proxy refuses github.com/NVIDIA/*), so
//! its verdicts are recorded, not recomputed.

// A test crate: a broken corpus should stop the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use gpu_operator::sharing::mig::parse_yaml;

const MIG_PARTED: &str = "mig-parted v0.15.0";

struct Case {
    name: String,
    text: String,
    expect_accept: bool,
    mig_parted_says: String,
    messages: Vec<String>,
}

fn corpus() -> Vec<Case> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mig-corpus");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let whole = std::fs::read_to_string(&path).unwrap();
            let mut expect = None;
            let mut mig_parted_says = None;
            let mut messages = Vec::new();
            let mut body = Vec::new();
            let mut in_header = true;
            for line in whole.lines() {
                let header = line.strip_prefix("# ").and_then(|l| l.split_once(": "));
                match header {
                    Some(("expect", v)) if in_header => expect = Some(v == "accept"),
                    Some((key, v)) if in_header && key == MIG_PARTED => {
                        mig_parted_says = Some(v.to_owned());
                    }
                    Some(("message", v)) if in_header => messages.push(v.to_owned()),
                    _ => {
                        in_header = false;
                        body.push(line);
                    }
                }
            }
            let text = if body.is_empty() {
                String::new()
            } else {
                body.join("\n") + "\n"
            };
            Case {
                expect_accept: expect.unwrap_or_else(|| panic!("{name}: no `# expect:` line")),
                mig_parted_says: mig_parted_says
                    .unwrap_or_else(|| panic!("{name}: no `# {MIG_PARTED}:` line (its verdict)")),
                name,
                text,
                messages,
            }
        })
        .collect()
}

#[test]
fn our_mig_config_parser_agrees_with_mig_parted_on_every_corpus_file() {
    let cases = corpus();
    let rejects = cases.iter().filter(|c| !c.expect_accept).count();
    assert!(
        rejects >= 30 && cases.len() - rejects >= 10,
        "corpus looks incomplete: {} files, {rejects} rejects",
        cases.len()
    );
    let mut disagreements = Vec::new();
    for case in &cases {
        match parse_yaml("mig-config", "config.yaml", &case.text) {
            Ok(_) if case.expect_accept => {}
            Ok(_) => disagreements.push(format!(
                "{}: we accept it; {MIG_PARTED} rejects it: {}",
                case.name, case.mig_parted_says
            )),
            Err(problems) if case.expect_accept => disagreements.push(format!(
                "{}: we reject it ({}); {MIG_PARTED} accepts it",
                case.name,
                problems
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ")
            )),
            Err(problems) => {
                let ours: Vec<String> = problems.iter().map(ToString::to_string).collect();
                assert!(
                    !case.messages.is_empty(),
                    "{}: a reject names at least one `# message:`",
                    case.name
                );
                for expected in &case.messages {
                    if !ours.iter().any(|p| p.contains(expected.as_str())) {
                        disagreements.push(format!(
                            "{}: {expected:?} not in our problems {ours:?}",
                            case.name
                        ));
                    }
                }
                for problem in &ours {
                    assert!(
                        problem.starts_with("ConfigMap mig-config, key \"config.yaml\": "),
                        "{}: a problem names the ConfigMap and key: {problem}",
                        case.name
                    );
                }
            }
        }
    }
    assert!(
        disagreements.is_empty(),
        "{} disagreement(s) with {MIG_PARTED}:\n  {}",
        disagreements.len(),
        disagreements.join("\n  ")
    );
}
