//! `generate --save-state` / `--load-state`: a generation continued later
//! equals one run straight through.

use std::path::Path;

use assert_cmd::Command;

fn moeflux() -> Command {
    Command::cargo_bin("moeflux").unwrap()
}

fn generate(model: &Path, extra: &[&str]) -> Vec<u32> {
    let out = moeflux()
        .args([
            "generate",
            "-m",
            model.to_str().unwrap(),
            "--temp",
            "0",
            "--print-token-ids",
        ])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect()
}

#[test]
fn a_saved_generation_continues_where_it_stopped() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_5_moe/hf");
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    moeflux()
        .args([
            "convert",
            fixture.to_str().unwrap(),
            "-o",
            model.to_str().unwrap(),
        ])
        .assert()
        .success();
    let state = tmp.path().join("run.state");
    let state = state.to_str().unwrap();

    let straight = generate(&model, &["--prompt-tokens", "5,6,7", "-n", "12"]);
    let first = generate(
        &model,
        &["--prompt-tokens", "5,6,7", "-n", "5", "--save-state", state],
    );
    let rest = generate(&model, &["--load-state", state, "-n", "7"]);
    assert_eq!([first, rest].concat(), straight);

    std::fs::write(state, b"MFXSTATE garbage that is long enough to be read").unwrap();
    let out = moeflux()
        .args([
            "generate",
            "-m",
            model.to_str().unwrap(),
            "--load-state",
            state,
            "-n",
            "2",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("run.state") && !stderr.contains("panicked"),
        "{stderr}"
    );
}
