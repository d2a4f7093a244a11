//! `moeflux convert`: a checkpoint in, a moeflux model directory out.
//!
//! The input is recognised by its content: a Hugging Face safetensors
//! folder (bf16, f16 or f32 tensors; block-scaled FP8; MLX affine
//! quantization, see [`checkpoint`]) or a GGUF file, single or split (see
//! [`gguf`]).
//!
//! Conversion streams: the checkpoint is memory-mapped and each tensor is
//! read, converted and written in blocks of rows, so a checkpoint larger
//! than memory converts. Everything is written into a hidden directory
//! beside the output, verified by reading it back, and only then renamed
//! into place; a failed or interrupted conversion leaves no partial model.

pub mod checkpoint;
pub mod gguf;
mod input;
mod output;
pub mod plan;
mod precision;
mod view;
mod weights;
mod write;

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::quant::{DType, EncodedRows, MatrixLayout};
use crate::util::Progress;
pub use input::Input;
pub use output::OutputLock;
pub(crate) use output::{SOURCE, check_not_nested};
pub(crate) use write::{SideFiles, write_model};
pub use write::{hash_file, write_atomic};

use input::CheckpointSource;
use plan::RowSource;
use precision::Dtypes;
use write::{write_model_locked, write_model_with};

/// Where converted weights come from: a checkpoint, or generated values for
/// a synthetic model.
pub trait TensorSource: Sync {
    /// Appends rows of a source tensor, as f32, to `out`.
    fn read_rows(&self, src: &RowSource, out: &mut Vec<f32>) -> Result<()>;

    /// Rows `rows` of the stored matrix `name` already encoded, for sources
    /// that can produce the encoding directly (random weights); `None`
    /// means read the values and encode them.
    fn encoded_rows(
        &self,
        _name: &str,
        _layout: &MatrixLayout,
        _rows: Range<usize>,
    ) -> Option<EncodedRows> {
        None
    }

    /// Bits per weight with which the source stores a tensor (scales
    /// included), for [`SourceOptions::keep_nearest`].
    fn stored_bits(&self, _tensor: &str) -> Option<f64> {
        None
    }

    /// The rows of `sources`, one after another, already in `layout`'s
    /// encoding, for sources that store them so (MLX 4- and 8-bit groups of
    /// 64): copied, not re-quantized. `None` means read the values and
    /// encode them.
    fn encoded_source_rows(
        &self,
        _sources: &[RowSource],
        _layout: &MatrixLayout,
    ) -> Option<Result<EncodedRows>> {
        None
    }

    /// What the conversion should tell the user about how tensors were
    /// read (copied bit for bit, re-quantized, ...), once it is done.
    fn notes(&self) -> Vec<String> {
        Vec::new()
    }
}

/// How [`convert`] writes the model.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    /// `Q4`, `Q8` or `Bf16`: every matrix but the routed experts'.
    pub quant: DType,
    /// The routed experts' precision, `Q2`, `Q3`, `Q4`, `Q8`, `Bf16` or
    /// `Mxfp4` (gpt-oss's experts kept as they are: MXFP4 values encode
    /// back exactly; others are rounded to it); `None`: as `quant`. Experts are most of a model's bytes, so they
    /// take the fewest bits: flash-moe ran Qwen3.5-397B with 2-bit experts
    /// and the rest at 8 bits.
    pub expert_quant: Option<DType>,
    /// Replace an existing output directory (only an empty one, or a
    /// model moeflux wrote holding nothing else).
    pub overwrite: bool,
    /// Raised (by Ctrl-C, say) to stop the conversion; what it staged is
    /// removed and it returns [`Error::Interrupted`].
    pub cancel: Option<Arc<AtomicBool>>,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            quant: DType::Q4,
            expert_quant: None,
            overwrite: false,
            cancel: None,
        }
    }
}

impl ConvertOptions {
    /// The routed experts' precision.
    pub fn experts(&self) -> DType {
        self.expert_quant.unwrap_or(self.quant)
    }

    /// Refuses precisions the converter does not write.
    fn check(&self) -> Result<()> {
        if !matches!(self.quant, DType::Q4 | DType::Q8 | DType::Bf16) {
            return Err(Error::invalid("--quant", "must be q4, q8 or bf16"));
        }
        if !matches!(
            self.experts(),
            DType::Q2 | DType::Q3 | DType::Q4 | DType::Q8 | DType::Bf16 | DType::Mxfp4
        ) {
            return Err(Error::invalid(
                "--expert-quant",
                "must be q2, q3, q4, q8, bf16 or mxfp4",
            ));
        }
        Ok(())
    }

    fn check_cancel(&self) -> Result<()> {
        match &self.cancel {
            Some(flag) if flag.load(Ordering::Relaxed) => Err(Error::Interrupted),
            _ => Ok(()),
        }
    }
}

/// How [`convert_with`] reads its input.
#[derive(Clone, Debug, Default)]
pub struct SourceOptions {
    /// Store each matrix in the moeflux type closest in size to the way the
    /// input stores it (a GGUF Q4_K or an MLX 4-bit matrix as q4, Q6_K or
    /// FP8 as q8, bf16 as bf16; a matrix assembled from several input
    /// tensors by their mean size, weighted by rows) instead of
    /// [`ConvertOptions::quant`]. Routers still keep at least 8 bits.
    pub keep_nearest: bool,
}

/// What a conversion produced.
#[derive(Debug)]
pub struct ConvertSummary {
    /// The model's configuration as moeflux reads it.
    pub config: ModelConfig,
    /// Tensors written.
    pub tensors: usize,
    /// Layers with routed experts.
    pub moe_layers: usize,
    /// Bytes of the dense file.
    pub dense_bytes: u64,
    /// Bytes of all expert files.
    pub expert_bytes: u64,
    /// Checkpoint tensors left out on purpose, with the reason.
    pub skipped: Vec<(String, &'static str)>,
    /// Checkpoint tensors the architecture does not use.
    pub unknown: Vec<String>,
    /// What the user should know about how the input was read (tensors
    /// copied bit for bit or re-quantized, a tokenizer rebuilt, ...).
    pub notes: Vec<String>,
}

/// Converts the Hugging Face checkpoint folder `input` (`config.json`,
/// `*.safetensors`, tokenizer files if any; bf16, f16, f32, FP8 or MLX
/// quantized) or the GGUF file `input` (the first of split files) into a
/// model directory at `output` that [`Model::open`] reads, quantized as
/// `options` says. The output is staged beside `output`, verified, then
/// renamed into place; an existing `output` is refused unless
/// `options.overwrite` allows replacing it.
///
/// ```
/// use moeflux::convert::{ConvertOptions, convert};
/// use moeflux::quant::DType;
/// use moeflux::{Model, ModelOptions};
/// use std::path::Path;
///
/// let input = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/qwen3_moe/hf"));
/// let temp = tempfile::tempdir().unwrap();
/// let output = temp.path().join("model");
///
/// let options = ConvertOptions {
///     quant: DType::Q8,
///     ..ConvertOptions::default()
/// };
/// let summary = convert(input, &output, &options, &moeflux::util::NoProgress)?;
/// assert!(summary.moe_layers > 0 && summary.expert_bytes > 0);
///
/// let model = Model::open(&output, &ModelOptions::default())?;
/// assert_eq!(model.config().vocab_size, summary.config.vocab_size);
/// # Ok::<(), moeflux::Error>(())
/// ```
///
/// [`Model::open`]: crate::Model::open
pub fn convert(
    input: &Path,
    output: &Path,
    options: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertSummary> {
    convert_with(input, output, options, &SourceOptions::default(), progress)
}

/// [`convert`] with options on how the input is read.
pub fn convert_with(
    input: &Path,
    output: &Path,
    options: &ConvertOptions,
    source_options: &SourceOptions,
    progress: &dyn Progress,
) -> Result<ConvertSummary> {
    check_not_nested(input, output)?;
    let s = CheckpointSource::open(input)?;
    let dtypes = Dtypes::choose(&s.plan, &*s.ckpt, options, source_options);
    let side = SideFiles {
        dir: s.side_dir.as_deref(),
        generated: &s.generated,
        synthetic: false,
    };
    write_model_with(
        &*s.ckpt,
        s.plan,
        s.config_json,
        s.config,
        &side,
        &dtypes,
        output,
        options,
        progress,
    )
}

/// [`convert`] for a caller that already holds the output's lock.
pub(crate) fn convert_locked(
    lock: &mut OutputLock,
    input: &Path,
    options: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertSummary> {
    let s = CheckpointSource::open(input)?;
    let dtypes = Dtypes::recipe(&s.plan, options);
    let side = SideFiles {
        dir: s.side_dir.as_deref(),
        generated: &s.generated,
        synthetic: false,
    };
    write_model_locked(
        lock,
        &*s.ckpt,
        s.plan,
        s.config_json,
        s.config,
        &side,
        &dtypes,
        options,
        progress,
    )
}
