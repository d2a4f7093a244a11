//! Routing counts for placing experts over several GPUs: `perplexity
//! --routing-counts` writes how often each expert was chosen, and
//! `--expert-placement` refuses files that are not counts of the model it
//! opens, and devices that are not several GPUs, before any weight is read.

use std::path::{Path, PathBuf};

use assert_cmd::Command;

fn cache() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("placement-cache")
}

fn moeflux() -> Command {
    let mut cmd = Command::cargo_bin("moeflux").unwrap();
    cmd.env("MOEFLUX_CACHE", cache());
    cmd
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("placement")
        .join(name);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Counts of the bundled model over a short text, written by `perplexity`.
fn counts(dir: &Path) -> (PathBuf, serde_json::Value) {
    let text = dir.join("text.txt");
    std::fs::write(
        &text,
        "The river ran past the mill and under the old stone bridge, where the children \
         fished on summer evenings and the miller counted sacks of flour. "
            .repeat(8),
    )
    .unwrap();
    let out_path = dir.join("counts.json");
    let out = moeflux()
        .args(["perplexity", "--device", "cpu", "--ctx", "64", "-f"])
        .arg(&text)
        .arg("--routing-counts")
        .arg(&out_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&out_path).unwrap()).unwrap();
    (out_path, json)
}

#[test]
fn perplexity_counts_every_token_of_every_moe_layer() {
    let (_, json) = counts(&scratch("count"));
    let tokens = json["tokens"].as_u64().unwrap();
    assert!(tokens >= 64, "{json}");
    let layers = json["layers"].as_object().unwrap();
    assert!(!layers.is_empty(), "no layer counted");
    let sums: Vec<u64> = layers
        .values()
        .map(|experts| {
            experts
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c.as_u64().unwrap())
                .sum()
        })
        .collect();
    // Each token chooses top-k experts at every MoE layer.
    let top_k = sums[0] / tokens;
    assert!(
        top_k >= 1 && sums[0] == top_k * tokens,
        "{sums:?} over {tokens} tokens"
    );
    assert!(sums.iter().all(|&s| s == sums[0]), "{sums:?}");
}

#[test]
fn placement_is_refused_on_one_device_and_for_other_models() {
    let dir = scratch("refuse");
    let (path, json) = counts(&dir);
    let run = |file: &Path, device: &str| {
        let out = moeflux()
            .args([
                "generate",
                "-n",
                "1",
                "-p",
                "hi",
                "--device",
                device,
                "--expert-placement",
            ])
            .arg(file)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&path, "cpu");
    assert!(
        err.contains("--expert-placement") && err.contains("several GPUs"),
        "{err}"
    );

    let garbage = dir.join("garbage.json");
    std::fs::write(&garbage, "{\"tokens\": \"many\"}").unwrap();
    let err = run(&garbage, "cpu");
    assert!(err.contains("not routing counts"), "{err}");

    let mut other = json.clone();
    other["layers"]["999"] = other["layers"]
        .as_object()
        .unwrap()
        .values()
        .next()
        .unwrap()
        .clone();
    let other_path = dir.join("other.json");
    std::fs::write(&other_path, other.to_string()).unwrap();
    let err = run(&other_path, "cpu");
    assert!(err.contains("layer 999 has no routed experts"), "{err}");
}
