//! The manifest (`manifest.json`) of a moeflux model directory: the model's
//! configuration, every tensor's location and encoding, the expert files'
//! layout, and each file's size and checksum.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::arch::names;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::quant::{DType, MatrixLayout};

pub const FORMAT_NAME: &str = "moeflux";
/// The version this moeflux writes: 2 records each tensor's role.
pub const FORMAT_VERSION: u32 = 2;
/// The oldest version this moeflux reads (1: no roles).
pub const OLDEST_FORMAT_VERSION: u32 = 1;

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// Bumped on any incompatible change of the layout.
    pub version: u32,
    /// The moeflux version that wrote the directory.
    pub producer: String,
    /// Random weights with a real model's shapes (`moeflux synth`).
    #[serde(default)]
    pub synthetic: bool,
    /// Precision asked for at conversion (`q4`, `q8`, `bf16`); individual
    /// tensors may differ (norms stay f32, routers at least 8-bit).
    pub quantization: DType,
    pub group_size: usize,
    /// The Hugging Face `config.json`, verbatim.
    pub config: serde_json::Value,
    pub files: Vec<FileEntry>,
    pub tensors: BTreeMap<String, TensorEntry>,
    pub experts: Vec<ExpertLayerEntry>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// Relative to the model directory.
    pub path: String,
    pub size: u64,
    /// xxHash3-64 of the whole file, hex.
    pub xxh3: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorEntry {
    pub file: String,
    pub offset: u64,
    pub nbytes: u64,
    /// Logical shape: `[n]` for vectors, `[rows, cols]` for matrices.
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// What the tensor is for, as the converter's plan said (absent in
    /// directories written before roles were recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<TensorRole>,
}

/// What a stored tensor is for, which decides how it is stored and used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TensorRole {
    /// A weight matrix: quantized at the requested precision when its input
    /// dimension is a multiple of the quantization group.
    Matrix,
    /// A matrix whose precision matters more than its size (router, shared
    /// expert gate): never stored below 8 bits, and multiplied with exact
    /// activations.
    Router,
    /// Norm weights and other small vectors: kept in f32.
    Vector,
}

impl TensorEntry {
    pub fn rows_cols(&self) -> (usize, usize) {
        match self.shape.as_slice() {
            [n] => (1, *n),
            [rows, cols] => (*rows, *cols),
            _ => (0, 0),
        }
    }

    pub fn layout(&self) -> Option<MatrixLayout> {
        let (rows, cols) = self.rows_cols();
        MatrixLayout::new(self.dtype, rows, cols)
    }
}

/// The experts of one MoE layer: expert `e` is the blob at byte
/// `e * stride` of `file`; every blob has the same internal layout.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertLayerEntry {
    pub layer: usize,
    pub file: String,
    pub num_experts: usize,
    pub stride: u64,
    pub blob: ExpertBlobLayout,
    /// xxHash3-64 of each expert blob (its `blob.nbytes` bytes), hex.
    pub checksums: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertBlobLayout {
    pub nbytes: u64,
    pub gate: BlobMatrix,
    pub up: BlobMatrix,
    pub down: BlobMatrix,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlobMatrix {
    pub offset: u64,
    pub rows: usize,
    pub cols: usize,
    pub dtype: DType,
}

impl BlobMatrix {
    pub fn layout(&self) -> Option<MatrixLayout> {
        MatrixLayout::new(self.dtype, self.rows, self.cols)
    }
}

impl Manifest {
    pub fn read(path: &Path) -> Result<Manifest> {
        let text = std::fs::read_to_string(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::bad_file(
                path,
                "not found: this is not a moeflux model directory \
                 (create one with `moeflux convert <HF_DIR> -o <DIR>`)",
            ),
            _ => Error::io(path, "reading the manifest", e),
        })?;
        // The format and version first, so that a newer directory is named
        // as such rather than as a manifest with fields this one does not
        // know.
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::bad_file(path, format!("malformed manifest: {e}")))?;
        let format = value.get("format").and_then(|v| v.as_str()).unwrap_or("");
        if format != FORMAT_NAME {
            return Err(Error::bad_file(
                path,
                format!("`format` is `{format}`, expected `{FORMAT_NAME}`"),
            ));
        }
        let version = value.get("version").and_then(|v| v.as_u64()).unwrap_or(0);
        if !(OLDEST_FORMAT_VERSION as u64..=FORMAT_VERSION as u64).contains(&version) {
            return Err(Error::bad_file(
                path,
                format!(
                    "format version {version} is not supported by this moeflux (reads versions \
                     {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION}); convert the model again with \
                     this version, or use the moeflux that wrote it"
                ),
            ));
        }
        serde_json::from_value(value)
            .map_err(|e| Error::bad_file(path, format!("malformed manifest: {e}")))
    }

    /// The model's configuration: `config.json`'s, with a
    /// multi-token-prediction layer only where the conversion kept one.
    /// `path` names the manifest in errors.
    pub fn model_config(&self, path: &Path) -> Result<ModelConfig> {
        let mut config = ModelConfig::from_hf_json(&self.config, path)?;
        if !self.tensors.contains_key(names::MTP_FC_EMBED) {
            config.mtp = None;
        }
        Ok(config)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("manifest serializes")
    }

    pub fn file(&self, path: &str) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.path == path)
    }

    pub fn expert_layer(&self, layer: usize) -> Option<&ExpertLayerEntry> {
        self.experts.iter().find(|e| e.layer == layer)
    }

    pub fn dense_bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.nbytes).sum()
    }

    pub fn expert_bytes(&self) -> u64 {
        self.experts
            .iter()
            .map(|l| l.blob.nbytes * l.num_experts as u64)
            .sum()
    }
}
