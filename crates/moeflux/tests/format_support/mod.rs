//! Helpers of the checkpoint-format tests (`format_*.rs`): the test data
//! under fixtures/formats/ (tools/make_format_fixtures.py), reading what a
//! conversion stored, and logits of converted models.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use moeflux::convert::{ConvertOptions, ConvertSummary, SourceOptions, convert_with};
use moeflux::format::{MANIFEST_FILE, Manifest};
use moeflux::quant::{DType, MatrixLayout};
use moeflux::util::NoProgress;
use moeflux::{LogitsWanted, Model, ModelOptions};
use safetensors::SafeTensors;
use tempfile::TempDir;

/// fixtures/formats/
pub fn formats_root() -> PathBuf {
    super::common::fixtures_root().join("formats")
}

/// A converted model; the directory lives as long as this value.
pub struct Converted {
    _tmp: TempDir,
    pub dir: PathBuf,
    pub summary: ConvertSummary,
}

pub fn convert_as(input: &Path, quant: DType, keep_nearest: bool) -> Converted {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let options = ConvertOptions {
        quant,
        ..ConvertOptions::default()
    };
    let source = SourceOptions { keep_nearest };
    let summary = convert_with(input, &dir, &options, &source, &NoProgress)
        .unwrap_or_else(|e| panic!("converting {}: {e}", input.display()));
    Converted {
        _tmp: tmp,
        dir,
        summary,
    }
}

pub fn manifest(dir: &Path) -> Manifest {
    Manifest::read(&dir.join(MANIFEST_FILE)).unwrap()
}

/// The stored bytes of a dense tensor and their layout.
pub fn dense_tensor(dir: &Path, name: &str) -> (MatrixLayout, Vec<u8>) {
    let m = manifest(dir);
    let t = &m.tensors[name];
    let layout = t.layout().unwrap();
    let bytes = std::fs::read(dir.join(&t.file)).unwrap();
    let start = t.offset as usize;
    (layout, bytes[start..start + layout.total_bytes].to_vec())
}

/// The stored bytes of expert `e`'s `which` matrix (0 gate, 1 up, 2 down)
/// in MoE layer `layer`.
pub fn expert_tensor(dir: &Path, layer: usize, e: usize, which: usize) -> (MatrixLayout, Vec<u8>) {
    let m = manifest(dir);
    let entry = m.experts.iter().find(|x| x.layer == layer).unwrap();
    let matrix = [&entry.blob.gate, &entry.blob.up, &entry.blob.down][which];
    let layout = matrix.layout().unwrap();
    let bytes = std::fs::read(dir.join(&entry.file)).unwrap();
    let start = e * entry.stride as usize + matrix.offset as usize;
    (layout, bytes[start..start + layout.total_bytes].to_vec())
}

/// The three sections (codes, scales, biases) of a stored quantized matrix.
pub fn sections(layout: &MatrixLayout, bytes: &[u8]) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let groups = layout.rows * layout.cols / 64 * 2;
    (
        bytes[..layout.rows * layout.row_bytes].to_vec(),
        bytes[layout.scales_offset..][..groups].to_vec(),
        bytes[layout.biases_offset..][..groups].to_vec(),
    )
}

/// Logits of every position of `tokens`.
pub fn logits(dir: &Path, tokens: &[u32]) -> Vec<f32> {
    let model = Model::open(dir, &ModelOptions::default())
        .unwrap_or_else(|e| panic!("opening {}: {e}", dir.display()));
    let model = std::sync::Arc::new(model);
    model
        .session()
        .forward(tokens, LogitsWanted::All)
        .unwrap()
        .into_vec()
}

/// A safetensors file's tensor as raw bytes and shape.
pub fn raw_tensor(path: &Path, name: &str) -> (Vec<usize>, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st
        .tensor(name)
        .unwrap_or_else(|_| panic!("{} has no {name}", path.display()));
    (t.shape().to_vec(), t.data().to_vec())
}

pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// Distance in units in the last place of f32.
pub fn ulps(a: f32, b: f32) -> u32 {
    if a == b {
        return 0;
    }
    let key = |x: f32| {
        let bits = x.to_bits() as i64;
        if bits < 0x8000_0000 {
            bits
        } else {
            0x8000_0000 - bits
        }
    };
    (key(a) - key(b)).unsigned_abs().min(u32::MAX as u64) as u32
}

/// Asserts `got` starts with `want` within `max_ulps` f32 ulps.
pub fn assert_ulps(what: &str, got: &[f32], want: &[f32], max_ulps: u32) {
    assert!(
        got.len() >= want.len(),
        "{what}: {} values, expected at least {}",
        got.len(),
        want.len()
    );
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            ulps(g, w) <= max_ulps,
            "{what}[{i}]: {g} vs reference {w} ({} ulps)",
            ulps(g, w)
        );
    }
}

/// Maximum relative L2 error over rows.
pub fn max_row_error(got: &[f32], want: &[f32], vocab: usize) -> f64 {
    super::common::row_errors(got, want, vocab)
        .into_iter()
        .fold(0.0, f64::max)
}
