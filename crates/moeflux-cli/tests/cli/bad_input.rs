//! Bad input never crashes or corrupts: every failure exits with status 1
//! and a message naming the file, tensor or option at fault, never a panic,
//! and leaves no partial output behind.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::moeflux;
use assert_cmd::Command;
use tempfile::TempDir;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
        .join("hf")
}

/// Runs a command expected to fail cleanly; returns its stderr.
fn fails(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected exit status 1, stderr:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "panicked:\n{stderr}");
    assert!(
        stderr.lines().any(|l| l.starts_with("error: ")),
        "unexpected stderr:\n{stderr}"
    );
    stderr
}

fn assert_mentions(stderr: &str, parts: &[&str]) {
    for part in parts {
        assert!(
            stderr.contains(part),
            "stderr should mention `{part}`:\n{stderr}"
        );
    }
}

/// A copy of a checkpoint directory that a test may damage.
fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// A converted model in a temporary directory.
fn converted() -> (TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    moeflux()
        .args([
            "convert",
            fixture("qwen3_moe").to_str().unwrap(),
            "-o",
            model.to_str().unwrap(),
            "--quant",
            "q4",
        ])
        .assert()
        .success();
    (tmp, model)
}

fn generate(model: &Path, tokens: &str) -> Command {
    let mut cmd = moeflux();
    cmd.args([
        "generate",
        "-m",
        model.to_str().unwrap(),
        "--prompt-tokens",
        tokens,
        "-n",
        "2",
        "--temp",
        "0",
        "--print-token-ids",
    ]);
    cmd
}

fn flip_byte(path: &Path, offset: u64) {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    file.read_exact_at(&mut b, offset).unwrap();
    file.write_all_at(&[b[0] ^ 0x5a], offset).unwrap();
}

fn truncate(path: &Path, by: u64) {
    let file = OpenOptions::new().write(true).open(path).unwrap();
    let len = file.metadata().unwrap().len();
    file.set_len(len - by).unwrap();
}

fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut json: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut json);
    fs::write(path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
}

/// Converting into `out` fails, and neither `out` nor anything a
/// conversion keeps beside it while it runs (staging folder, lock file)
/// remains.
fn convert_fails(input: &Path, out: &Path) -> String {
    let stderr = fails(moeflux().args([
        "convert",
        input.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]));
    assert!(!out.exists(), "a failed conversion left {}", out.display());
    let leftovers: Vec<_> = fs::read_dir(out.parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".moeflux-"))
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
    stderr
}

#[test]
fn missing_checkpoint_file_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    copy_dir(&fixture("qwen3_moe"), &ckpt);
    fs::remove_file(ckpt.join("model.safetensors")).unwrap();
    let err = convert_fails(&ckpt, &tmp.path().join("out"));
    assert_mentions(&err, &["ckpt", "no `model.safetensors`"]);
}

#[test]
fn missing_model_file_is_reported() {
    let (_tmp, model) = converted();
    fs::remove_file(model.join("dense.bin")).unwrap();
    let err = fails(&mut generate(&model, "1,2,3"));
    assert_mentions(&err, &["dense.bin", "missing"]);
}

#[test]
fn truncated_checkpoint_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    copy_dir(&fixture("qwen3_moe"), &ckpt);
    truncate(&ckpt.join("model.safetensors"), 1000);
    let err = convert_fails(&ckpt, &tmp.path().join("out"));
    assert_mentions(&err, &["model.safetensors", "truncated"]);
}

#[test]
fn truncated_dense_file_is_reported() {
    let (_tmp, model) = converted();
    truncate(&model.join("dense.bin"), 64);
    let err = fails(&mut generate(&model, "1,2,3"));
    assert_mentions(&err, &["dense.bin", "truncated"]);
}

#[test]
fn truncated_expert_file_is_reported() {
    let (_tmp, model) = converted();
    truncate(&model.join("experts/layer_000.bin"), 4096);
    let err = fails(&mut generate(&model, "1,2,3"));
    assert_mentions(&err, &["experts/layer_000.bin", "truncated"]);
}

#[test]
fn dense_checksum_mismatch_is_reported() {
    let (_tmp, model) = converted();
    flip_byte(&model.join("dense.bin"), 100);
    let err = fails(&mut generate(&model, "1,2,3"));
    assert_mentions(&err, &["dense.bin", "checksum mismatch"]);
}

#[test]
fn expert_checksum_mismatch_is_reported_when_the_expert_is_read() {
    let (_tmp, model) = converted();
    let manifest: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(model.join("manifest.json")).unwrap()).unwrap();
    let stride = manifest["experts"][0]["stride"].as_u64().unwrap();
    let file = model.join("experts/layer_000.bin");
    // Damage every expert of layer 0 so whichever is routed is caught.
    for e in 0..8 {
        flip_byte(&file, e * stride + 10);
    }
    let err = fails(&mut generate(&model, "1,2,3"));
    assert_mentions(
        &err,
        &["experts/layer_000.bin", "checksum mismatch", "of layer 0"],
    );
}

#[test]
fn wrong_tensor_shape_in_checkpoint_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    copy_dir(&fixture("qwen3_moe"), &ckpt);
    // Declare a larger head count: k_proj no longer has the shape it implies.
    edit_json(&ckpt.join("config.json"), |c| {
        c["num_key_value_heads"] = 4.into()
    });
    let err = convert_fails(&ckpt, &tmp.path().join("out"));
    assert_mentions(
        &err,
        &[
            "model.layers.0.self_attn.k_proj.weight",
            "expected shape [128, 64]",
            "found [64, 64]",
        ],
    );
}

#[test]
fn wrong_tensor_shape_in_manifest_is_reported() {
    let (_tmp, model) = converted();
    edit_json(&model.join("manifest.json"), |m| {
        m["tensors"]["layers.1.attn.o_proj"]["shape"] = serde_json::json!([64, 64]);
    });
    let err = fails(&mut generate(&model, "1,2,3"));
    assert_mentions(&err, &["manifest.json", "layers.1.attn.o_proj"]);
}

#[test]
fn tensor_roles_are_recorded_and_a_wrong_one_is_refused() {
    let (_tmp, model) = converted();
    let manifest_path = model.join("manifest.json");
    let manifest: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&manifest_path).unwrap()).unwrap();
    let role = |name: &str| manifest["tensors"][name]["role"].clone();
    assert_eq!(role("layers.0.moe.router"), "router");
    assert_eq!(role("layers.0.attn.o_proj"), "matrix");
    assert_eq!(role("layers.0.input_norm"), "vector");
    edit_json(&manifest_path, |m| {
        m["tensors"]["layers.0.moe.router"]["role"] = "matrix".into();
    });
    let err = fails(&mut generate(&model, "1,2,3"));
    assert_mentions(&err, &["layers.0.moe.router", "recorded as a Matrix"]);
}

#[test]
fn format_versions_one_and_two_are_read_and_a_newer_one_named() {
    let (_tmp, model) = converted();
    let manifest_path = model.join("manifest.json");
    // A version-1 directory: no roles.
    edit_json(&manifest_path, |m| {
        m["version"] = 1.into();
        for (_, tensor) in m["tensors"].as_object_mut().unwrap() {
            tensor.as_object_mut().unwrap().remove("role");
        }
    });
    generate(&model, "1,2,3").assert().success();
    // A directory from a newer moeflux, with a field this one does not know.
    edit_json(&manifest_path, |m| {
        m["version"] = 3.into();
        m["tensors"]["layers.0.attn.o_proj"]["sparsity"] = 0.5.into();
    });
    let err = fails(&mut generate(&model, "1,2,3"));
    assert_mentions(
        &err,
        &["manifest.json", "format version 3 is not supported"],
    );
}

#[test]
fn unknown_architecture_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    copy_dir(&fixture("qwen3_moe"), &ckpt);
    edit_json(&ckpt.join("config.json"), |c| {
        c["model_type"] = "llama4".into()
    });
    let err = convert_fails(&ckpt, &tmp.path().join("out"));
    assert_mentions(
        &err,
        &["config.json", "unknown model_type `llama4`", "qwen3_moe"],
    );

    let (_tmp, model) = converted();
    edit_json(&model.join("manifest.json"), |m| {
        m["config"]["model_type"] = "llama4".into()
    });
    let err = fails(&mut generate(&model, "1,2,3"));
    assert_mentions(&err, &["manifest.json", "unknown model_type `llama4`"]);
}

#[test]
fn unsupported_option_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    copy_dir(&fixture("qwen3_moe"), &ckpt);
    edit_json(&ckpt.join("config.json"), |c| {
        c["rope_scaling"] = serde_json::json!({"rope_type": "dynamic", "factor": 4.0});
    });
    let err = convert_fails(&ckpt, &tmp.path().join("out"));
    assert_mentions(&err, &["config.json", "rope_scaling type `dynamic`"]);
}

#[test]
fn malformed_config_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    copy_dir(&fixture("qwen3_moe"), &ckpt);
    fs::write(ckpt.join("config.json"), "{\"model_type\": \"qwen3_moe\", ").unwrap();
    let err = convert_fails(&ckpt, &tmp.path().join("out"));
    assert_mentions(&err, &["config.json", "malformed JSON"]);
}

#[test]
fn malformed_manifest_is_reported() {
    let (_tmp, model) = converted();
    fs::write(model.join("manifest.json"), "{ not json").unwrap();
    let err = fails(&mut generate(&model, "1,2,3"));
    assert_mentions(&err, &["manifest.json", "malformed manifest"]);
}

#[test]
fn token_id_beyond_the_vocabulary_is_reported() {
    let (tmp, model) = converted();
    let err = fails(&mut generate(&model, "1,300,3"));
    assert_mentions(&err, &["token id 300", "out of range", "300 ids"]);
    let out = tmp.path().join("out.npy");
    let err = fails(moeflux().args([
        "logits",
        "-m",
        model.to_str().unwrap(),
        "--tokens",
        "5,999",
        "-o",
        out.to_str().unwrap(),
    ]));
    assert_mentions(&err, &["token id 999"]);
    assert!(!out.exists(), "no output file after a failure");
}

#[test]
fn empty_prompt_is_reported() {
    let (_tmp, model) = converted();
    let err = fails(&mut generate(&model, ""));
    assert_mentions(&err, &["prompt is empty"]);
}

#[test]
fn output_directory_is_never_overwritten_by_accident() {
    let (_tmp, model) = converted();
    let err = fails(moeflux().args([
        "convert",
        fixture("qwen3_moe").to_str().unwrap(),
        "-o",
        model.to_str().unwrap(),
    ]));
    assert_mentions(&err, &["already exists", "--force"]);
    // The existing model still works.
    generate(&model, "1,2,3").assert().success();
}

#[test]
fn draft_options_are_checked_before_the_weights_are_read() {
    let cache = TempDir::new().unwrap();
    let run = |args: &[&str]| {
        moeflux()
            .env("MOEFLUX_CACHE", cache.path())
            .args(["generate", "-p", "Emma", "-n", "4"])
            .args(args)
            .output()
            .unwrap()
    };
    // Inconsistent options: status 1, before the bundled model is converted.
    let out = run(&["--draft-tokens", "3"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_mentions(&stderr, &["--draft-tokens", "--draft lookup"]);
    assert_eq!(fs::read_dir(cache.path()).unwrap().count(), 0, "{stderr}");
    // Values out of range: a usage error (status 2) naming the option.
    for (args, names) in [
        (
            &["--draft", "lookup", "--draft-tokens", "0"][..],
            &["--draft-tokens", "1..=16"][..],
        ),
        (
            &["--draft", "lookup", "--draft-tokens", "17"],
            &["--draft-tokens", "1..=16"],
        ),
        (&["--draft", "sometimes"], &["--draft", "lookup", "mtp"]),
    ] {
        let out = run(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert_mentions(&stderr, names);
    }
}

#[test]
fn draft_rounds_without_drafts_are_refused_before_the_weights_are_read() {
    let cache = TempDir::new().unwrap();
    let out = moeflux()
        .env("MOEFLUX_CACHE", cache.path())
        .args(["bench", "-n", "4", "--no-ceilings", "--draft-rounds", "5"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_mentions(&stderr, &["--draft-rounds", "--draft lookup"]);
    assert_eq!(fs::read_dir(cache.path()).unwrap().count(), 0, "{stderr}");
}
