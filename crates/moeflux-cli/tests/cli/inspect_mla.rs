//! `inspect` reports the KV cache an attention layer keeps per position:
//! for multi-head latent attention, the latent and the rotary key alone
//! (in f32 whatever the KV type, which refuses bf16 and q8); for keys and
//! values, the bytes of each KV type.

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

#[test]
fn inspect_reports_every_kv_type_and_latent_attention_refuses_them() {
    let tmp = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    for name in ["qwen3_moe", "deepseek_v3"] {
        let model = tmp.path().join(name);
        Command::cargo_bin("moeflux")
            .unwrap()
            .args([
                "convert",
                root.join(name).join("hf").to_str().unwrap(),
                "-o",
            ])
            .arg(&model)
            .assert()
            .success();
    }
    let inspect = |name: &str, kv: &str| {
        Command::cargo_bin("moeflux")
            .unwrap()
            .args(["inspect", "-m"])
            .arg(tmp.path().join(name))
            .args(["--kv-type", kv])
            .output()
            .unwrap()
    };
    // 2 KV heads of 32: 2 · 64 values of 4 bytes (f32), 2 (bf16), or 1
    // and an f32 scale per 32 (q8); 4 layers.
    let out = inspect("qwen3_moe", "q8");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("KV cache       512 bytes per position and attention layer (keys and values, f32; bf16 256, q8 144)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("KV cache 576 B per position in q8"),
        "{stdout}"
    );
    let out = inspect("deepseek_v3", "bf16");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--kv-type") && stderr.contains("latent cache in f32"),
        "{stderr}"
    );
    let out = Command::cargo_bin("moeflux")
        .unwrap()
        .args([
            "generate",
            "--device",
            "cpu",
            "--kv-type",
            "q8",
            "-n",
            "1",
            "-m",
        ])
        .arg(tmp.path().join("deepseek_v3"))
        .args(["--prompt-tokens", "1,2"])
        .output()
        .unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--kv-type")
            && stderr.contains("latent cache in f32")
            && !stderr.contains("panicked"),
        "{stderr}"
    );
}
