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
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let options = ConvertOptions {
        quant,
        ..ConvertOptions::default()
    };
    convert(checkpoint, &dir, &options, &NoProgress)
        .unwrap_or_else(|e| panic!("converting {}: {e}", checkpoint.display()));
    Converted { _tmp: tmp, dir }
}

pub fn convert_fixture(name: &str, quant: DType) -> Converted {
    convert_checkpoint(&fixtures_root().join(name).join("hf"), quant)
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
        let path = fixtures_root().join(name).join("reference.safetensors");
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
