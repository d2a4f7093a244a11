//! Shared helpers of the integration tests: the transformers fixtures made
//! by `tools/make_fixtures.py`, converted into temporary model directories.

#![allow(dead_code)]

pub mod backends;
pub mod batch;
pub mod faulty;
pub mod ops;
pub mod ops_extended;
pub mod ops_kv;
pub mod ops_latent;
pub mod speculative;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use moeflux::convert::{ConvertOptions, convert};
use moeflux::quant::DType;
use moeflux::util::NoProgress;
use moeflux::{Model, ModelOptions};
use safetensors::SafeTensors;
use tempfile::TempDir;

pub const FIXTURES: &[&str] = &[
    "qwen3_moe",
    "qwen3_moe_sparse_step",
    "qwen3_next",
    "qwen3_5_moe",
    "glm4_moe",
    "glm4_moe_qk_norm",
    "deepseek_v3",
    "deepseek_v3_no_q_lora",
    "gpt_oss",
];

/// Fixtures with a multi-token-prediction head and its reference outputs
/// (`mtp.safetensors`, tools/make_mtp_fixtures.py).
pub const MTP_FIXTURES: &[&str] = &["qwen3_5_moe", "deepseek_v3"];

/// The repository's fixtures: under `$MOEFLUX_REPO` when set (a test
/// binary run from another checkout, e.g. on a GPU machine), else beside
/// the crate the tests were built from.
pub fn fixtures_root() -> PathBuf {
    match std::env::var_os("MOEFLUX_REPO").filter(|v| !v.is_empty()) {
        Some(repo) => PathBuf::from(repo).join("fixtures"),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures"),
    }
}

/// A converted fixture; the directory lives as long as this value.
pub struct Converted {
    _tmp: TempDir,
    pub dir: PathBuf,
}

pub fn convert_checkpoint(checkpoint: &Path, quant: DType) -> Converted {
    convert_checkpoint_with(checkpoint, quant, None)
}

/// [`convert_checkpoint`] with the routed experts at `expert_quant`.
pub fn convert_checkpoint_with(
    checkpoint: &Path,
    quant: DType,
    expert_quant: Option<DType>,
) -> Converted {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let options = ConvertOptions {
        quant,
        expert_quant,
        ..ConvertOptions::default()
    };
    convert(checkpoint, &dir, &options, &NoProgress)
        .unwrap_or_else(|e| panic!("converting {}: {e}", checkpoint.display()));
    Converted { _tmp: tmp, dir }
}

pub fn convert_fixture(name: &str, quant: DType) -> Converted {
    convert_checkpoint(&fixtures_root().join(name).join("hf"), quant)
}

/// The expert precisions the conformance suite runs routed experts at,
/// each with the precision of the rest: q4, q8 and bf16 throughout, and
/// q3 and q2 experts beside q8 (convert's default for them), and MXFP4
/// experts.
pub const EXPERT_RECIPES: [(DType, DType); 6] = [
    (DType::Q4, DType::Q4),
    (DType::Q8, DType::Q8),
    (DType::Bf16, DType::Bf16),
    (DType::Q8, DType::Q3),
    (DType::Q8, DType::Q2),
    (DType::Q8, DType::Mxfp4),
];

/// A fixture converted with its routed experts at `experts`.
pub fn convert_fixture_with(name: &str, quant: DType, experts: DType) -> Converted {
    convert_checkpoint_with(&fixtures_root().join(name).join("hf"), quant, Some(experts))
}

pub fn open(dir: &Path, options: ModelOptions) -> Arc<Model> {
    Arc::new(
        Model::open(dir, &options).unwrap_or_else(|e| panic!("opening {}: {e}", dir.display())),
    )
}

/// The reference outputs recorded with transformers.
pub struct Reference {
    bytes: Vec<u8>,
}

impl Reference {
    pub fn load(name: &str) -> Reference {
        Reference::load_file(name, "reference.safetensors")
    }

    /// Another file of references of fixture `name`.
    pub fn load_file(name: &str, file: &str) -> Reference {
        let path = fixtures_root().join(name).join(file);
        Reference {
            bytes: std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        }
    }

    fn tensor(&self, key: &str) -> (Vec<usize>, Vec<u8>) {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st
            .tensor(key)
            .unwrap_or_else(|_| panic!("reference has no `{key}`"));
        (t.shape().to_vec(), t.data().to_vec())
    }

    pub fn tokens(&self, key: &str) -> Vec<u32> {
        let (_, data) = self.tensor(key);
        data.chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
            .collect()
    }

    /// `(rows, cols, values)`
    pub fn logits(&self, key: &str) -> (usize, usize, Vec<f32>) {
        let (shape, data) = self.tensor(key);
        let values = data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        (shape[0], shape[1], values)
    }
}

/// The bundled model's directory and the prompt its drafting tests use.
pub fn bundled_prompt() -> (PathBuf, Vec<u32>) {
    let dir = moeflux::bundled::model_dir(&NoProgress).unwrap();
    let tokenizer = moeflux::text::Tokenizer::from_dir(&dir).unwrap();
    let prompt = tokenizer
        .encode(
            "It is a truth universally acknowledged, that a single man",
            true,
        )
        .unwrap();
    (dir, prompt)
}

/// Relative L2 error of each row of `got` against `want`.
pub fn row_errors(got: &[f32], want: &[f32], cols: usize) -> Vec<f64> {
    assert_eq!(got.len(), want.len(), "logit counts differ");
    got.chunks_exact(cols)
        .zip(want.chunks_exact(cols))
        .map(|(g, w)| {
            let diff: f64 = g.iter().zip(w).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
            let norm: f64 = w.iter().map(|b| (*b as f64).powi(2)).sum();
            (diff / norm).sqrt()
        })
        .collect()
}

pub fn argmax(row: &[f32]) -> usize {
    moeflux::model::argmax(row) as usize
}

/// Fraction of rows whose arg-max agrees.
pub fn top1_agreement(got: &[f32], want: &[f32], cols: usize) -> f64 {
    let rows = got.len() / cols;
    let same = got
        .chunks_exact(cols)
        .zip(want.chunks_exact(cols))
        .filter(|(g, w)| argmax(g) == argmax(w))
        .count();
    same as f64 / rows as f64
}

/// Asserts that `result` is an error whose message mentions every one of
/// `parts`.
pub fn expect_error(result: moeflux::Result<impl std::fmt::Debug>, parts: &[&str]) {
    let err = result.expect_err("expected an error").to_string();
    for part in parts {
        assert!(err.contains(part), "error should mention `{part}`: {err}");
    }
}
