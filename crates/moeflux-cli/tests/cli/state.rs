//! `generate --save-state` / `--load-state`: a generation continued later
//! equals one run straight through.

use std::path::Path;

use super::moeflux;

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

/// The fixture `name` converted into `tmp`.
fn converted(name: &str, tmp: &Path) -> std::path::PathBuf {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
        .join("hf");
    let model = tmp.join("model");
    moeflux()
        .args(["convert", fixture.to_str().unwrap(), "-o"])
        .arg(&model)
        .assert()
        .success();
    model
}

#[test]
fn a_saved_generation_continues_where_it_stopped() {
    let tmp = tempfile::tempdir().unwrap();
    let model = converted("qwen3_5_moe", tmp.path());
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

/// `--kv-type`: a generation with a bf16 or q8 KV cache continues from its
/// saved state as it runs straight through; a state saved with one type is
/// refused by a run of another, the message naming the file and the type
/// to pass.
#[test]
fn a_state_continues_only_with_its_kv_type() {
    let tmp = tempfile::tempdir().unwrap();
    let model = converted("qwen3_moe", tmp.path());
    for kv in ["bf16", "q8"] {
        let state = tmp.path().join(format!("{kv}.state"));
        let state = state.to_str().unwrap();
        let typed = ["--device", "cpu", "--kv-type", kv];
        let straight = generate(
            &model,
            &[&typed[..], &["--prompt-tokens", "5,6,7", "-n", "10"]].concat(),
        );
        let first = generate(
            &model,
            &[
                &typed[..],
                &["--prompt-tokens", "5,6,7", "-n", "4", "--save-state", state],
            ]
            .concat(),
        );
        let rest = generate(
            &model,
            &[&typed[..], &["--load-state", state, "-n", "6"]].concat(),
        );
        assert_eq!([first, rest].concat(), straight, "--kv-type {kv}");

        let other = if kv == "bf16" { "q8" } else { "bf16" };
        let out = moeflux()
            .args(["generate", "-m", model.to_str().unwrap(), "--device", "cpu"])
            .args(["--kv-type", other, "--load-state", state, "-n", "2"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!("{kv}.state"))
                && stderr.contains(&format!("--kv-type {kv}"))
                && !stderr.contains("panicked"),
            "{stderr}"
        );
    }
}
