//! The moeflux model directory (docs/FORMAT.md):
//!
//! ```text
//! manifest.json            configuration, tensor and expert layout, checksums
//! dense.bin                every non-expert tensor, 64-byte aligned, mmap-able
//! experts/layer_NNN.bin    one file per MoE layer; expert e at e × stride,
//!                          each a 4 KiB-aligned blob gate | up | down
//! tokenizer.json, ...      copied from the checkpoint when present
//! ```
//!
//! Opening a directory validates the manifest against the files on disk
//! before anything is computed, so a truncated or corrupt model is reported
//! with the file at fault instead of failing mid-generation.

pub mod manifest;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::quant::{ALIGN, MatrixLayout, MatrixView};
use crate::util::{BUFFER_ALIGN, parse_hex64};
pub use manifest::{
    BlobMatrix, ExpertBlobLayout, ExpertLayerEntry, Manifest, TensorEntry, TensorRole,
};

pub const MANIFEST_FILE: &str = "manifest.json";
/// Files of a Hugging Face checkpoint that a model directory keeps.
pub const CONFIG_FILE: &str = "config.json";
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
pub const DENSE_FILE: &str = "dense.bin";
/// Alignment of each expert blob inside its layer file.
pub const EXPERT_ALIGN: usize = BUFFER_ALIGN;

pub fn expert_file_name(layer: usize) -> String {
    format!("experts/layer_{layer:03}.bin")
}

/// Files copied verbatim from a Hugging Face checkpoint directory.
pub const COPIED_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
];

#[derive(Clone, Copy, Debug)]
pub struct OpenOptions {
    /// Hash the dense weight file against the manifest on open. Expert
    /// blobs are always checked as they are read from disk.
    pub verify_checksums: bool,
    /// Open the multi-token-prediction head when the directory has one;
    /// without it the model is opened as if it had none.
    pub mtp_head: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            verify_checksums: true,
            mtp_head: true,
        }
    }
}

/// An opened, validated model directory.
pub struct ModelDir {
    root: PathBuf,
    manifest: Manifest,
    config: ModelConfig,
    maps: HashMap<String, Arc<Mmap>>,
}

/// A dense tensor: its manifest entry and the mapped file holding it.
#[derive(Clone)]
pub struct TensorData {
    pub name: String,
    pub entry: TensorEntry,
    pub layout: MatrixLayout,
    map: Arc<Mmap>,
}

impl TensorData {
    pub fn bytes(&self) -> &[u8] {
        let start = self.entry.offset as usize;
        &self.map[start..start + self.entry.nbytes as usize]
    }

    pub fn view(&self) -> MatrixView<'_> {
        MatrixView::new(self.layout, self.bytes())
    }

    /// The mapping that holds this tensor, so backends can borrow weights
    /// without copying them.
    pub fn mapping(&self) -> &Arc<Mmap> {
        &self.map
    }
}

impl ModelDir {
    pub fn open(root: &Path, options: OpenOptions) -> Result<ModelDir> {
        if !root.is_dir() {
            return Err(Error::bad_file(
                root,
                "not a directory: pass a moeflux model directory made by `moeflux convert`",
            ));
        }
        let manifest_path = root.join(MANIFEST_FILE);
        let manifest = Manifest::read(&manifest_path)?;
        let mut config = manifest.model_config(&manifest_path)?;
        if !options.mtp_head {
            config.mtp = None;
        }
        let dir = ModelDir {
            root: root.to_path_buf(),
            manifest,
            config,
            maps: HashMap::new(),
        };
        dir.check_files()?;
        dir.check_tensors()?;
        dir.check_experts()?;
        dir.map_dense(options)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn manifest_path(&self) -> PathBuf {
        self.root.join(MANIFEST_FILE)
    }

    /// Resolves a manifest-relative path, refusing anything that would
    /// escape the model directory.
    pub fn path_of(&self, relative: &str) -> Result<PathBuf> {
        let rel = Path::new(relative);
        let escapes = rel.is_absolute()
            || rel
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)));
        if escapes || relative.is_empty() {
            return Err(Error::bad_file(
                self.manifest_path(),
                format!("file path `{relative}` must stay inside the model directory"),
            ));
        }
        Ok(self.root.join(rel))
    }

    fn check_files(&self) -> Result<()> {
        for f in &self.manifest.files {
            let path = self.path_of(&f.path)?;
            let meta = std::fs::metadata(&path).map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => Error::bad_file(
                    &path,
                    "missing: the manifest lists it; the model directory is incomplete (convert again)",
                ),
                _ => Error::io(&path, "reading file metadata", e),
            })?;
            if meta.len() != f.size {
                return Err(Error::bad_file(
                    &path,
                    format!(
                        "size is {} bytes, the manifest says {}: the file is truncated or was modified (convert again)",
                        meta.len(),
                        f.size
                    ),
                ));
            }
            if parse_hex64(&f.xxh3).is_none() {
                return Err(Error::bad_file(
                    self.manifest_path(),
                    format!(
                        "file `{}`: checksum `{}` is not 16 hex digits",
                        f.path, f.xxh3
                    ),
                ));
            }
        }
        Ok(())
    }

    fn file_size(&self, relative: &str, what: &str) -> Result<u64> {
        self.manifest.file(relative).map(|f| f.size).ok_or_else(|| {
            Error::bad_file(
                self.manifest_path(),
                format!("{what} refers to file `{relative}`, which the manifest does not list"),
            )
        })
    }

    fn check_tensors(&self) -> Result<()> {
        let manifest_path = self.manifest_path();
        for (name, t) in &self.manifest.tensors {
            let bad = |msg: String| Err(Error::tensor(&manifest_path, name, msg));
            let size = self.file_size(&t.file, &format!("tensor `{name}`"))?;
            let Some(layout) = t.layout() else {
                return bad(format!(
                    "shape {:?} cannot be stored as {} (quantized matrices need a multiple of 64 columns)",
                    t.shape,
                    t.dtype.name()
                ));
            };
            if t.shape.is_empty() || t.shape.len() > 2 {
                return bad(format!(
                    "shape {:?} must have one or two dimensions",
                    t.shape
                ));
            }
            if layout.total_bytes as u64 != t.nbytes {
                return bad(format!(
                    "nbytes is {} but shape {:?} as {} needs {}",
                    t.nbytes,
                    t.shape,
                    t.dtype.name(),
                    layout.total_bytes
                ));
            }
            if t.offset % ALIGN as u64 != 0
                || t.offset.checked_add(t.nbytes).is_none_or(|end| end > size)
            {
                return bad(format!(
                    "bytes {}..{} are not {ALIGN}-byte aligned or lie outside `{}` ({size} bytes)",
                    t.offset,
                    t.offset.saturating_add(t.nbytes),
                    t.file
                ));
            }
        }
        Ok(())
    }

    fn check_experts(&self) -> Result<()> {
        let cfg = &self.config;
        let manifest_path = self.manifest_path();
        let (h, inter) = (cfg.hidden_size, cfg.moe.expert_intermediate_size);
        for layer in cfg.expert_layers() {
            let bad = |msg: String| {
                Err(Error::bad_file(
                    &manifest_path,
                    format!("experts of layer {layer}: {msg}"),
                ))
            };
            let Some(e) = self.manifest.expert_layer(layer) else {
                return bad("missing from the manifest".into());
            };
            let size = self.file_size(&e.file, &format!("experts of layer {layer}"))?;
            if e.num_experts != cfg.moe.num_experts {
                return bad(format!(
                    "{} experts listed, config.json says {}",
                    e.num_experts, cfg.moe.num_experts
                ));
            }
            if e.checksums.len() != e.num_experts
                || e.checksums.iter().any(|c| parse_hex64(c).is_none())
            {
                return bad(format!("need {} checksums of 16 hex digits", e.num_experts));
            }
            if e.stride % EXPERT_ALIGN as u64 != 0 || e.stride < e.blob.nbytes {
                return bad(format!(
                    "stride {} must be a multiple of {EXPERT_ALIGN} and at least the blob size {}",
                    e.stride, e.blob.nbytes
                ));
            }
            if e.stride
                .checked_mul(e.num_experts as u64)
                .is_none_or(|end| end > size)
            {
                return bad(format!(
                    "{} experts of {} bytes do not fit in `{}` ({size} bytes)",
                    e.num_experts, e.stride, e.file
                ));
            }
            for (part, m, rows, cols) in [
                ("gate", &e.blob.gate, inter, h),
                ("up", &e.blob.up, inter, h),
                ("down", &e.blob.down, h, inter),
            ] {
                let Some(layout) = m.layout() else {
                    return bad(format!(
                        "{part}: {}x{} cannot be stored as {}",
                        m.rows,
                        m.cols,
                        m.dtype.name()
                    ));
                };
                if (m.rows, m.cols) != (rows, cols) {
                    return bad(format!(
                        "{part} is {}x{}, config.json implies {rows}x{cols}",
                        m.rows, m.cols
                    ));
                }
                if m.offset % ALIGN as u64 != 0
                    || m.offset + layout.total_bytes as u64 > e.blob.nbytes
                {
                    return bad(format!(
                        "{part} at offset {} lies outside the {}-byte blob or is misaligned",
                        m.offset, e.blob.nbytes
                    ));
                }
            }
        }
        Ok(())
    }

    fn map_dense(mut self, options: OpenOptions) -> Result<ModelDir> {
        let mut files: Vec<String> = self
            .manifest
            .tensors
            .values()
            .map(|t| t.file.clone())
            .collect();
        files.sort();
        files.dedup();
        for rel in files {
            let path = self.path_of(&rel)?;
            let file = File::open(&path).map_err(|e| Error::io(&path, "opening", e))?;
            // SAFETY: the model directory is treated as read-only while open;
            // writers (the converter) never modify a directory in place.
            let map =
                unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, "memory-mapping", e))?;
            if options.verify_checksums {
                let entry = self.manifest.file(&rel).expect("checked in check_tensors");
                let expected = parse_hex64(&entry.xxh3).expect("checked in check_files");
                let actual = xxhash_rust::xxh3::xxh3_64(&map);
                if actual != expected {
                    return Err(Error::Checksum {
                        path,
                        what: "the file".into(),
                        expected,
                        actual,
                    });
                }
            }
            self.maps.insert(rel, Arc::new(map));
        }
        Ok(self)
    }

    /// A dense tensor with the shape the model expects.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<TensorData> {
        let entry = self.manifest.tensors.get(name).ok_or_else(|| {
            Error::tensor(
                self.manifest_path(),
                name,
                format!("missing (expected shape {shape:?})"),
            )
        })?;
        if entry.shape != shape {
            return Err(Error::tensor(
                self.manifest_path(),
                name,
                format!(
                    "shape is {:?}, the model's configuration needs {shape:?}",
                    entry.shape
                ),
            ));
        }
        Ok(TensorData {
            name: name.to_string(),
            layout: entry.layout().expect("validated on open"),
            entry: entry.clone(),
            map: self.maps[&entry.file].clone(),
        })
    }
}
