//! `--draft mtp` from the command line: the same greedy tokens as without
//! drafts on a fixture with a multi-token-prediction head, `inspect` shows
//! the head, and a model without one is refused before its weights are
//! read, the error naming the problem.

use std::path::{Path, PathBuf};

use super::moeflux;
use tempfile::TempDir;

/// A fixture converted to q4 in a temporary directory.
fn converted(name: &str) -> (TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
        .join("hf");
    moeflux()
        .args(["convert", fixture.to_str().unwrap(), "-o"])
        .arg(&model)
        .args(["--quant", "q4"])
        .assert()
        .success();
    (tmp, model)
}

fn generate(model: &Path, extra: &[&str]) -> std::process::Output {
    moeflux()
        .args(["generate", "-m"])
        .arg(model)
        .args(["--prompt-tokens", "5,17,200,31,9,44,120,7", "-n", "16"])
        .args(["--temp", "0", "--print-token-ids", "--quiet"])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn generate_with_mtp_drafts_gives_the_tokens_of_plain_decoding() {
    for name in ["qwen3_5_moe", "deepseek_v3"] {
        let (_tmp, model) = converted(name);
        let plain = generate(&model, &[]);
        assert!(plain.status.success());
        for extra in [
            &["--draft", "mtp", "--stats"][..],
            &["--draft", "mtp", "--draft-tokens", "3", "--stats"],
        ] {
            let drafted = generate(&model, extra);
            let stderr = String::from_utf8_lossy(&drafted.stderr);
            assert!(drafted.status.success(), "{name} {extra:?}: {stderr}");
            assert_eq!(drafted.stdout, plain.stdout, "{name} {extra:?}");
            // The fixtures' heads are random: drafted and checked, rarely
            // kept.
            let checks = stderr
                .lines()
                .find_map(|l| l.strip_prefix("drafts: "))
                .and_then(|l| l.split(", ").nth(1))
                .and_then(|c| c.trim_end_matches(" checks").parse::<u32>().ok());
            assert!(checks.is_some_and(|c| c > 0), "{name} {extra:?}: {stderr}");
        }
        let inspect = moeflux()
            .args(["inspect", "-m"])
            .arg(&model)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&inspect.stdout);
        assert!(
            stdout.contains("mtp head       multi-token prediction (--draft mtp)")
                && stdout.contains("     4  "),
            "{name}: {stdout}"
        );
    }
}

#[test]
fn draft_mtp_without_a_head_is_refused_before_the_weights_are_read() {
    let (_tmp, model) = converted("qwen3_moe");
    // A damaged dense file: reading the weights would fail on it first.
    let dense = model.join("dense.bin");
    let mut bytes = std::fs::read(&dense).unwrap();
    bytes[0] ^= 1;
    std::fs::write(&dense, bytes).unwrap();
    for command in [&["generate", "--prompt-tokens", "1,2"][..], &["bench"]] {
        let out = moeflux()
            .args(command)
            .args(["-m", model.to_str().unwrap(), "--draft", "mtp"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{command:?}: {stderr}");
        assert!(
            stderr.contains("no multi-token-prediction head")
                && stderr.contains("--draft lookup")
                && !stderr.contains("checksum"),
            "{command:?}: {stderr}"
        );
    }
    let inspect = moeflux()
        .args(["inspect", "-m"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&inspect.stdout).contains("mtp head       none"),
        "{}",
        String::from_utf8_lossy(&inspect.stdout)
    );
}
