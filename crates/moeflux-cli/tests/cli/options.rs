//! Options as the command line reads them: `--device` names,
//! `--cpu-experts` settings, and the
//! precision `convert` gives the matrices other than the routed experts
//! when only `--expert-quant` is given.

use std::path::Path;

use super::moeflux;

/// `generate`'s stderr with `option value` on a model that does not
/// exist: a value the parser takes fails later, at the model.
fn option_error(option: &str, value: &str) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let out = moeflux()
        .args(["generate", "--prompt-tokens", "1", "-n", "1", option, value])
        .arg("-m")
        .arg(tmp.path().join("absent"))
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "{option} {value}: succeeded without a model"
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn device_error(device: &str) -> String {
    option_error("--device", device)
}

#[test]
fn device_names_are_taken_or_refused_with_the_forms_expected() {
    let expected = "expected auto, cpu, cuda, cuda:N or cuda:N,M,...";
    for good in ["auto", "cpu", "cuda", "cuda:3", "cuda:0,1"] {
        let stderr = device_error(good);
        assert!(
            !stderr.contains("invalid value"),
            "{good} refused:\n{stderr}"
        );
    }
    for bad in [
        "gpu", "cuda:", "cuda:x", "cuda:-1", "CPU", "cuda:0,", "cuda:0;1",
    ] {
        let stderr = device_error(bad);
        assert!(
            stderr.contains("invalid value") && stderr.contains(expected),
            "{bad}:\n{stderr}"
        );
    }
    let stderr = device_error("cuda:1,1");
    assert!(
        stderr.contains("invalid value") && stderr.contains("a device is named twice"),
        "{stderr}"
    );
}

/// Hybrid decode's setting: auto, all or off, anything else refused with
/// the three named.
#[test]
fn cpu_experts_takes_auto_all_or_off() {
    for good in ["auto", "all", "off"] {
        let stderr = option_error("--cpu-experts", good);
        assert!(
            !stderr.contains("invalid value"),
            "{good} refused:\n{stderr}"
        );
    }
    for bad in ["on", "none", "AUTO"] {
        let stderr = option_error("--cpu-experts", bad);
        assert!(
            stderr.contains("invalid value") && stderr.contains("auto, all, off"),
            "{bad}:\n{stderr}"
        );
    }
}

/// Without `--quant`, experts below 4 bits come with q8 elsewhere, any
/// other expert width with q4; `convert` says which.
#[test]
fn the_rest_defaults_to_q8_beside_experts_below_four_bits() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_moe/hf");
    for (experts, label) in [
        (None, "(qwen3_moe, q4)"),
        (Some("q2"), "(qwen3_moe, q2 experts, q8 elsewhere)"),
        (Some("q3"), "(qwen3_moe, q3 experts, q8 elsewhere)"),
        (Some("q4"), "(qwen3_moe, q4)"),
        (Some("mxfp4"), "(qwen3_moe, mxfp4 experts, q4 elsewhere)"),
        (Some("bf16"), "(qwen3_moe, bf16 experts, q4 elsewhere)"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let mut cmd = moeflux();
        cmd.arg("convert")
            .arg(&fixture)
            .arg("-o")
            .arg(tmp.path().join("model"));
        if let Some(e) = experts {
            cmd.args(["--expert-quant", e]);
        }
        let out = cmd.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{experts:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains(label), "{experts:?}: {stdout}");
    }
}
