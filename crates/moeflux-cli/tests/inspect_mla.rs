//! `inspect` reports the KV cache an attention layer keeps per position:
//! for multi-head latent attention, the latent and the rotary key alone.

use std::path::Path;

use assert_cmd::Command;

#[test]
fn inspect_reports_the_latent_kv_cache_of_mla() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/deepseek_v3/hf");
    Command::cargo_bin("moeflux")
        .unwrap()
        .args(["convert", fixture.to_str().unwrap(), "-o"])
        .arg(&model)
        .args(["--quant", "q8"])
        .assert()
        .success();
    let out = Command::cargo_bin("moeflux")
        .unwrap()
        .args(["inspect", "-m"])
        .arg(&model)
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{stdout}");
    // kv_lora_rank 64 + qk_rope_head_dim 16 values of 4 bytes, where full
    // keys and values would be 2 · 4 heads · (16 + 16) · 4 = 1024.
    assert!(
        stdout.contains("KV cache       320 bytes per position and attention layer (latent 64 + rotary key 16, f32)"),
        "{stdout}"
    );
}
