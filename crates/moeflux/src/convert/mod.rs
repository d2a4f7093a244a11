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
mod output;
pub mod plan;
mod view;

use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::format::manifest::{FORMAT_NAME, FORMAT_VERSION, FileEntry};
use crate::format::{
    BlobMatrix, COPIED_FILES, DENSE_FILE, EXPERT_ALIGN, ExpertBlobLayout, ExpertLayerEntry,
    MANIFEST_FILE, Manifest, ModelDir, OpenOptions, TensorEntry, expert_file_name,
};
use crate::quant::{ALIGN, DType, EncodedRows, GROUP_SIZE, MatrixLayout, RowEncoder, align_up};
use crate::util::{Progress, hex64, parse_hex64};
pub use output::OutputLock;
pub(crate) use output::{SOURCE, check_not_nested, is_model_dir};

use plan::{ConversionPlan, DenseTensorPlan, ExpertLayerPlan, RowSource, TensorRole};

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
    /// `Q4`, `Q8` or `Bf16`.
    pub quant: DType,
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
            overwrite: false,
            cancel: None,
        }
    }
}

impl ConvertOptions {
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
    let dtypes = Dtypes::uniform(&s.plan, options.quant);
    let side = SideFiles {
        dir: s.side_dir.as_deref(),
        generated: &s.generated,
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

/// A checkpoint opened for conversion, with its configuration and plan.
struct CheckpointSource {
    ckpt: Box<dyn TensorSource>,
    plan: ConversionPlan,
    config_json: serde_json::Value,
    config: ModelConfig,
    /// The folder whose tokenizer and generation files are copied.
    side_dir: Option<std::path::PathBuf>,
    /// Files written instead of copied (a config.json without the
    /// quantization settings of a quantized input; a GGUF's tokenizer).
    generated: Vec<(String, Vec<u8>)>,
    /// Every tensor's Hugging Face name and shape.
    shapes: std::collections::BTreeMap<String, Vec<usize>>,
}

impl CheckpointSource {
    fn open(input: &Path) -> Result<CheckpointSource> {
        if let Some(files) = gguf::input_files(input)? {
            let g = gguf::open(&files)?;
            let config = ModelConfig::from_hf_json(&g.config_json, &g.files[0])?;
            let plan = config.architecture.conversion_plan(&config, &g.index)?;
            let shapes = shapes_of(&g.index);
            let mut generated = g.side_files;
            generated.push((
                "config.json".into(),
                pretty_json(&g.config_json).into_bytes(),
            ));
            return Ok(CheckpointSource {
                ckpt: g.source,
                plan,
                config_json: g.config_json,
                config,
                side_dir: None,
                generated,
                shapes,
            });
        }
        let config_path = input.join("config.json");
        let mut config_json = read_json(&config_path)?;
        let config = ModelConfig::from_hf_json(&config_json, &config_path)?;
        let (ckpt, index) = checkpoint::open(input, &config_json)?;
        let plan = config.architecture.conversion_plan(&config, &index)?;
        let shapes = shapes_of(&index);
        let mut generated = Vec::new();
        if ckpt.store.quantized() {
            // The converted weights are no longer FP8 or MLX-quantized.
            if let Some(obj) = config_json.as_object_mut() {
                obj.remove("quantization");
                obj.remove("quantization_config");
            }
            generated.push(("config.json".into(), pretty_json(&config_json).into_bytes()));
        }
        Ok(CheckpointSource {
            ckpt: Box::new(ckpt),
            plan,
            config_json,
            config,
            side_dir: Some(input.to_path_buf()),
            generated,
            shapes,
        })
    }
}

fn shapes_of(index: &plan::CheckpointIndex) -> std::collections::BTreeMap<String, Vec<usize>> {
    index
        .tensors
        .iter()
        .map(|(name, t)| (name.clone(), t.shape.clone()))
        .collect()
}

/// A checkpoint opened the way [`convert`] opens it, for reading its
/// tensors without converting: Hugging Face names and shapes, values in
/// f32 as the converter receives them (dequantized, mapped back from MLX's
/// or GGUF's layout).
///
/// ```
/// use moeflux::convert::Input;
/// use std::path::Path;
///
/// let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/qwen3_moe/hf"));
/// let input = Input::open(dir)?;
/// let shape = input.shape("model.norm.weight").unwrap().to_vec();
/// assert_eq!(input.read("model.norm.weight")?.len(), shape.iter().product::<usize>());
/// # Ok::<(), moeflux::Error>(())
/// ```
pub struct Input {
    source: CheckpointSource,
}

impl Input {
    /// Opens a safetensors checkpoint folder or a GGUF file.
    pub fn open(input: &Path) -> Result<Input> {
        Ok(Input {
            source: CheckpointSource::open(input)?,
        })
    }

    /// The configuration the conversion writes (a GGUF's rebuilt from its
    /// metadata).
    pub fn config_json(&self) -> &serde_json::Value {
        &self.source.config_json
    }

    /// Every tensor's Hugging Face name.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.source.shapes.keys().map(String::as_str)
    }

    /// A tensor's Hugging Face shape.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.source.shapes.get(name).map(Vec::as_slice)
    }

    /// Bits per weight with which the input stores a tensor, scales
    /// included (16 for bf16, 8 for FP8, 4.5 for MLX 4-bit in groups of 64
    /// or GGUF Q4_0, ...).
    pub fn stored_bits(&self, name: &str) -> Option<f64> {
        self.source.ckpt.stored_bits(name)
    }

    /// A whole tensor's values, row-major.
    pub fn read(&self, name: &str) -> Result<Vec<f32>> {
        let shape = self
            .shape(name)
            .ok_or_else(|| Error::tensor(Path::new("input"), name, "no such tensor"))?;
        let cols = *shape.last().unwrap_or(&1);
        let rows = shape
            .iter()
            .product::<usize>()
            .checked_div(cols)
            .unwrap_or(0);
        let mut out = Vec::with_capacity(rows * cols);
        self.source.ckpt.read_rows(
            &RowSource {
                tensor: name.to_string(),
                row_start: 0,
                rows,
            },
            &mut out,
        )?;
        Ok(out)
    }

    /// A file the conversion writes instead of copying it (`config.json`
    /// of a quantized input; a GGUF's `tokenizer.json`,
    /// `tokenizer_config.json`, `generation_config.json`).
    pub fn generated_file(&self, name: &str) -> Option<&[u8]> {
        self.source
            .generated
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, bytes)| bytes.as_slice())
    }
}

fn pretty_json(value: &serde_json::Value) -> String {
    serde_json::to_string_pretty(value).expect("JSON values serialize") + "\n"
}

/// The files of a model directory besides its weights: copied from a
/// checkpoint folder, or written by the conversion. A synthetic model has
/// neither.
pub(crate) struct SideFiles<'a> {
    pub dir: Option<&'a Path>,
    pub generated: &'a [(String, Vec<u8>)],
}

impl SideFiles<'_> {
    fn synthetic(&self) -> bool {
        self.dir.is_none() && self.generated.is_empty()
    }
}

/// The precision asked of each matrix of a plan (before
/// `storage_dtype`'s rules for routers and odd sizes).
pub(crate) struct Dtypes {
    dense: Vec<DType>,
    experts: Vec<[DType; 3]>,
    /// The manifest's `quantization`: the precision of most weights.
    label: DType,
}

impl Dtypes {
    /// Every matrix at `quant`.
    fn uniform(plan: &ConversionPlan, quant: DType) -> Dtypes {
        Dtypes {
            dense: vec![quant; plan.dense.len()],
            experts: vec![[quant; 3]; plan.experts.len()],
            label: quant,
        }
    }

    fn choose(
        plan: &ConversionPlan,
        source: &dyn TensorSource,
        options: &ConvertOptions,
        source_options: &SourceOptions,
    ) -> Dtypes {
        if !source_options.keep_nearest {
            return Dtypes::uniform(plan, options.quant);
        }
        let nearest = |tensor: &str| match source.stored_bits(tensor) {
            Some(bits) => nearest_dtype(bits),
            None => options.quant,
        };
        let mut weights: std::collections::BTreeMap<&'static str, (u64, DType)> =
            Default::default();
        let mut count = |d: DType, n: usize| {
            weights.entry(d.name()).or_insert((0, d)).0 += n as u64;
        };
        let dense: Vec<DType> = plan
            .dense
            .iter()
            .map(|t| {
                // An assembled tensor: the mean of its sources, by rows.
                let (mut bits, mut rows) = (0.0, 0);
                for s in &t.sources {
                    if let Some(b) = source.stored_bits(&s.tensor) {
                        bits += b * s.rows as f64;
                        rows += s.rows;
                    }
                }
                let d = if rows == 0 {
                    options.quant
                } else {
                    nearest_dtype(bits / rows as f64)
                };
                if t.role != TensorRole::Vector {
                    count(d, t.rows * t.cols);
                }
                d
            })
            .collect();
        let experts: Vec<[DType; 3]> = plan
            .experts
            .iter()
            .map(|l| {
                let ds = [&l.gate, &l.up, &l.down].map(|m| nearest(&m.source(0, 1).tensor));
                for d in ds {
                    count(d, l.num_experts * l.hidden * l.intermediate);
                }
                ds
            })
            .collect();
        let label = weights
            .values()
            .max_by_key(|(n, _)| *n)
            .map_or(options.quant, |(_, d)| *d);
        Dtypes {
            dense,
            experts,
            label,
        }
    }
}

/// The moeflux matrix type closest in size to `bits` per weight (q4 is 4.5
/// bits with its scales, q8 8.5, bf16 16); ties go to the larger type.
fn nearest_dtype(bits: f64) -> DType {
    [(DType::Bf16, 16.0), (DType::Q8, 8.5), (DType::Q4, 4.5)]
        .into_iter()
        .min_by(|a, b| (a.1 - bits).abs().total_cmp(&(b.1 - bits).abs()))
        .map(|(d, _)| d)
        .expect("candidates")
}

/// Writes a model directory from a plan and a source of weights, staged
/// and verified. `side_files` is the checkpoint folder whose tokenizer and
/// generation files are copied; a synthetic model has none.
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_model(
    source: &dyn TensorSource,
    plan: ConversionPlan,
    config_json: serde_json::Value,
    config: ModelConfig,
    side_files: Option<&Path>,
    output: &Path,
    options: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertSummary> {
    let dtypes = Dtypes::uniform(&plan, options.quant);
    let side = SideFiles {
        dir: side_files,
        generated: &[],
    };
    write_model_with(
        source,
        plan,
        config_json,
        config,
        &side,
        &dtypes,
        output,
        options,
        progress,
    )
}

/// [`write_model`] with side files that may be generated and a precision
/// per matrix.
#[allow(clippy::too_many_arguments)]
fn write_model_with(
    source: &dyn TensorSource,
    plan: ConversionPlan,
    config_json: serde_json::Value,
    config: ModelConfig,
    side_files: &SideFiles<'_>,
    dtypes: &Dtypes,
    output: &Path,
    options: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertSummary> {
    if !matches!(options.quant, DType::Q4 | DType::Q8 | DType::Bf16) {
        return Err(Error::invalid("--quant", "must be q4, q8 or bf16"));
    }
    output::check_output(output, options.overwrite)?;
    let existed = output.exists();
    let mut lock = OutputLock::acquire(output, options.cancel.as_deref(), &|o| {
        progress.note(&format!(
            "another moeflux process is writing {}: waiting for it to finish",
            o.display()
        ))
    })?;
    if !existed && !lock.restored() && is_model_dir(output) {
        return converted_meanwhile(
            output,
            &config_json,
            dtypes.label,
            side_files.synthetic(),
            plan,
            config,
        );
    }
    write_model_locked(
        &mut lock,
        source,
        plan,
        config_json,
        config,
        side_files,
        dtypes,
        options,
        progress,
    )
}

/// [`write_model`] for a caller that holds the output's lock.
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_model_locked(
    lock: &mut OutputLock,
    source: &dyn TensorSource,
    plan: ConversionPlan,
    config_json: serde_json::Value,
    config: ModelConfig,
    side_files: &SideFiles<'_>,
    dtypes: &Dtypes,
    options: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertSummary> {
    output::check_output(lock.output(), options.overwrite)?;
    let staging = lock.side_folder(output::STAGING)?;
    progress.start(total_weights(&plan));
    let mut manifest = Manifest {
        format: FORMAT_NAME.into(),
        version: FORMAT_VERSION,
        producer: format!("moeflux {}", env!("CARGO_PKG_VERSION")),
        synthetic: side_files.synthetic(),
        quantization: dtypes.label,
        group_size: GROUP_SIZE,
        config: config_json,
        files: Vec::new(),
        tensors: Default::default(),
        experts: Vec::new(),
    };
    write_dense(
        source,
        &plan.dense,
        &dtypes.dense,
        options,
        &staging.path,
        &mut manifest,
        progress,
    )?;
    let mut expert_files = Vec::with_capacity(plan.experts.len());
    for (layer, quant) in plan.experts.iter().zip(&dtypes.experts) {
        let (entry, file) =
            write_expert_layer(source, layer, *quant, options, &staging.path, progress)?;
        manifest.experts.push(entry);
        expert_files.push(file);
    }
    progress.finish();
    let notes = source.notes();
    for line in &notes {
        progress.note(line);
    }
    write_side_files(side_files, &staging.path)?;
    record_files(&staging.path, expert_files, &mut manifest)?;
    write_atomic(
        &staging.path.join(MANIFEST_FILE),
        manifest.to_json().as_bytes(),
    )?;
    // Open the staged directory as a reader would: this checks the manifest
    // against the files, every size and the dense checksum.
    ModelDir::open(
        &staging.path,
        OpenOptions {
            verify_checksums: true,
        },
    )?;
    lock.commit(staging, options.overwrite)?;
    Ok(ConvertSummary {
        tensors: manifest.tensors.len(),
        moe_layers: manifest.experts.len(),
        dense_bytes: manifest.dense_bytes(),
        expert_bytes: manifest.expert_bytes(),
        skipped: plan.skipped,
        unknown: plan.unknown,
        notes,
        config,
    })
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::bad_file(
            path,
            "missing: a Hugging Face checkpoint needs its config.json",
        ),
        _ => Error::io(path, "reading", e),
    })?;
    serde_json::from_str(&text).map_err(|e| Error::config(path, format!("malformed JSON: {e}")))
}

fn total_weights(plan: &ConversionPlan) -> u64 {
    let dense: usize = plan.dense.iter().map(|t| t.rows * t.cols).sum();
    let experts: usize = plan
        .experts
        .iter()
        .map(|l| l.num_experts * 3 * l.hidden * l.intermediate)
        .sum();
    (dense + experts) as u64
}

/// The stored type of a canonical tensor.
fn storage_dtype(role: TensorRole, cols: usize, quant: DType) -> DType {
    let dtype = match role {
        TensorRole::Vector => return DType::F32,
        TensorRole::Router if quant == DType::Q4 => DType::Q8,
        _ => quant,
    };
    if dtype.is_quantized() && !cols.is_multiple_of(GROUP_SIZE) {
        DType::Bf16
    } else {
        dtype
    }
}

/// Rows `[start, end)` of a canonical tensor assembled from its sources.
fn gather_rows(
    ckpt: &dyn TensorSource,
    sources: &[RowSource],
    start: usize,
    end: usize,
    out: &mut Vec<f32>,
) -> Result<()> {
    for part in slice_sources(sources, start, end) {
        ckpt.read_rows(&part, out)?;
    }
    Ok(())
}

/// Values converted per block of a large tensor (64 MiB of f32).
const BLOCK_VALUES: usize = 16 << 20;

/// The parts of `sources` that make rows `[start, end)` of the tensor they
/// assemble.
fn slice_sources(sources: &[RowSource], start: usize, end: usize) -> Vec<RowSource> {
    let mut parts = Vec::new();
    let mut base = 0;
    for src in sources {
        let (lo, hi) = (start.max(base), end.min(base + src.rows));
        if lo < hi {
            parts.push(RowSource {
                tensor: src.tensor.clone(),
                row_start: src.row_start + (lo - base),
                rows: hi - lo,
            });
        }
        base += src.rows;
    }
    parts
}

#[allow(clippy::too_many_arguments)]
fn write_dense(
    ckpt: &dyn TensorSource,
    tensors: &[DenseTensorPlan],
    quants: &[DType],
    options: &ConvertOptions,
    dir: &Path,
    manifest: &mut Manifest,
    progress: &dyn Progress,
) -> Result<()> {
    let path = dir.join(DENSE_FILE);
    let file = File::create(&path).map_err(|e| Error::io(&path, "creating", e))?;
    let write = |bytes: &[u8], at: usize| {
        file.write_all_at(bytes, at as u64)
            .map_err(|e| Error::io(&path, "writing", e))
    };
    let mut cursor = 0usize;
    for (t, &quant) in tensors.iter().zip(quants) {
        let dtype = storage_dtype(t.role, t.cols, quant);
        let layout = MatrixLayout::new(dtype, t.rows, t.cols).expect("dtype chosen to fit");
        let encoder = RowEncoder::new(layout);
        let offset = align_up(cursor, ALIGN);
        let groups = if dtype.is_quantized() {
            t.cols / GROUP_SIZE
        } else {
            0
        };
        let block_rows = (BLOCK_VALUES / t.cols.max(1)).max(1);
        for start in (0..t.rows).step_by(block_rows) {
            options.check_cancel()?;
            let end = (start + block_rows).min(t.rows);
            // Gather and encode slices of the block in parallel, then write
            // them in order.
            let slice_rows = (end - start)
                .div_ceil(rayon::current_num_threads() * 4)
                .max(1);
            let slices: Vec<(usize, EncodedRows)> = (start..end)
                .step_by(slice_rows)
                .collect::<Vec<_>>()
                .into_par_iter()
                .map(|lo| {
                    let hi = (lo + slice_rows).min(end);
                    if let Some(enc) = ckpt.encoded_rows(&t.name, &layout, lo..hi) {
                        return Ok((lo, enc));
                    }
                    if let Some(enc) =
                        ckpt.encoded_source_rows(&slice_sources(&t.sources, lo, hi), &layout)
                    {
                        return Ok((lo, enc?));
                    }
                    let mut values = Vec::with_capacity((hi - lo) * t.cols);
                    gather_rows(ckpt, &t.sources, lo, hi, &mut values)?;
                    Ok((lo, encoder.encode(&values)))
                })
                .collect::<Result<_>>()?;
            for (lo, enc) in slices {
                write(&enc.codes, offset + lo * layout.row_bytes)?;
                write(&enc.scales, offset + layout.scales_offset + lo * groups * 2)?;
                write(&enc.biases, offset + layout.biases_offset + lo * groups * 2)?;
            }
            progress.advance(((end - start) * t.cols) as u64, &t.name);
        }
        let shape = if t.is_vector && t.rows == 1 {
            vec![t.cols]
        } else {
            vec![t.rows, t.cols]
        };
        manifest.tensors.insert(
            t.name.clone(),
            TensorEntry {
                file: DENSE_FILE.into(),
                offset: offset as u64,
                nbytes: layout.total_bytes as u64,
                shape,
                dtype,
                role: Some(t.role),
            },
        );
        cursor = offset + layout.total_bytes;
    }
    file.set_len(cursor as u64)
        .map_err(|e| Error::io(&path, "sizing", e))?;
    file.sync_all().map_err(|e| Error::io(&path, "syncing", e))
}

/// Layout of each expert blob of a layer: gate | up | down, each on a
/// 64-byte boundary.
fn blob_layout(layer: &ExpertLayerPlan, quant: [DType; 3]) -> ExpertBlobLayout {
    let (h, i) = (layer.hidden, layer.intermediate);
    let matrix = |offset: usize, rows, cols, quant| {
        let dtype = storage_dtype(TensorRole::Matrix, cols, quant);
        BlobMatrix {
            offset: offset as u64,
            rows,
            cols,
            dtype,
        }
    };
    let size = |m: &BlobMatrix| m.layout().expect("dtype chosen to fit").total_bytes;
    let gate = matrix(0, i, h, quant[0]);
    let up = matrix(align_up(size(&gate), ALIGN), i, h, quant[1]);
    let down = matrix(
        align_up(up.offset as usize + size(&up), ALIGN),
        h,
        i,
        quant[2],
    );
    let nbytes = down.offset + size(&down) as u64;
    ExpertBlobLayout {
        nbytes,
        gate,
        up,
        down,
    }
}

/// Experts encoded in parallel between sequential writes.
const EXPERT_BATCH: usize = 16;

fn write_expert_layer(
    ckpt: &dyn TensorSource,
    layer: &ExpertLayerPlan,
    quant: [DType; 3],
    options: &ConvertOptions,
    dir: &Path,
    progress: &dyn Progress,
) -> Result<(ExpertLayerEntry, FileEntry)> {
    let blob = blob_layout(layer, quant);
    let stride = align_up(blob.nbytes as usize, EXPERT_ALIGN);
    let rel = expert_file_name(layer.layer);
    let path = dir.join(&rel);
    std::fs::create_dir_all(path.parent().unwrap())
        .map_err(|e| Error::io(&path, "creating folder", e))?;
    let file = File::create(&path).map_err(|e| Error::io(&path, "creating", e))?;
    file.set_len((stride * layer.num_experts) as u64)
        .map_err(|e| Error::io(&path, "sizing", e))?;
    let parts = [
        (&layer.gate, blob.gate),
        (&layer.up, blob.up),
        (&layer.down, blob.down),
    ];
    let encode_expert = |e: usize| -> Result<Vec<u8>> {
        let mut bytes = vec![0u8; blob.nbytes as usize];
        let mut values = Vec::new();
        for (name, (source, m)) in ["gate", "up", "down"].iter().zip(&parts) {
            let layout = m.layout().expect("dtype chosen to fit");
            let stored = format!("layers.{}.experts.{e}.{name}", layer.layer);
            let rows = source.source(e, m.rows);
            let encoded = match ckpt.encoded_rows(&stored, &layout, 0..m.rows) {
                Some(enc) => layout.assemble(&enc),
                None => match ckpt.encoded_source_rows(std::slice::from_ref(&rows), &layout) {
                    Some(enc) => layout.assemble(&enc?),
                    None => {
                        values.clear();
                        ckpt.read_rows(&rows, &mut values)?;
                        RowEncoder::new(layout).encode_matrix(&values)
                    }
                },
            };
            bytes[m.offset as usize..][..encoded.len()].copy_from_slice(&encoded);
        }
        Ok(bytes)
    };
    let mut checksums = Vec::with_capacity(layer.num_experts);
    let what = format!("experts of layer {}", layer.layer);
    let per_expert = (3 * layer.hidden * layer.intermediate) as u64;
    for batch in (0..layer.num_experts)
        .collect::<Vec<_>>()
        .chunks(EXPERT_BATCH)
    {
        options.check_cancel()?;
        let blobs: Vec<Vec<u8>> = batch
            .par_iter()
            .map(|&e| encode_expert(e))
            .collect::<Result<_>>()?;
        for (&e, bytes) in batch.iter().zip(blobs) {
            file.write_all_at(&bytes, (e * stride) as u64)
                .map_err(|err| Error::io(&path, "writing", err))?;
            checksums.push(hex64(xxhash_rust::xxh3::xxh3_64(&bytes)));
            progress.advance(per_expert, &what);
        }
    }
    file.sync_all()
        .map_err(|e| Error::io(&path, "syncing", e))?;
    let entry = ExpertLayerEntry {
        layer: layer.layer,
        file: rel.clone(),
        num_experts: layer.num_experts,
        stride: stride as u64,
        blob,
        checksums,
    };
    let (size, hash) = verify_expert_file(&path, &entry)?;
    let file = FileEntry {
        path: rel,
        size,
        xxh3: hex64(hash),
    };
    Ok((entry, file))
}

/// Reads an expert file back, checking every blob against its checksum;
/// returns the file's size and hash.
fn verify_expert_file(path: &Path, entry: &ExpertLayerEntry) -> Result<(u64, u64)> {
    let file = File::open(path).map_err(|e| Error::io(path, "opening", e))?;
    let mut buf = vec![0u8; entry.stride as usize];
    let mut whole = xxhash_rust::xxh3::Xxh3::new();
    for (e, expected) in entry.checksums.iter().enumerate() {
        file.read_exact_at(&mut buf, e as u64 * entry.stride)
            .map_err(|err| Error::io(path, "reading back", err))?;
        whole.update(&buf);
        let expected = parse_hex64(expected).expect("written by hex64");
        let actual = xxhash_rust::xxh3::xxh3_64(&buf[..entry.blob.nbytes as usize]);
        if actual != expected {
            return Err(Error::Checksum {
                path: path.to_path_buf(),
                what: format!("expert {e} right after writing it (disk or memory fault?)"),
                expected,
                actual,
            });
        }
    }
    Ok((entry.stride * entry.num_experts as u64, whole.digest()))
}

fn write_side_files(side: &SideFiles<'_>, dir: &Path) -> Result<()> {
    for (name, bytes) in side.generated {
        debug_assert!(COPIED_FILES.contains(&name.as_str()));
        let to = dir.join(name);
        std::fs::write(&to, bytes).map_err(|e| Error::io(&to, "writing", e))?;
    }
    let Some(input) = side.dir else {
        return Ok(());
    };
    for name in COPIED_FILES {
        let from = input.join(name);
        if from.is_file() && !side.generated.iter().any(|(n, _)| n == name) {
            let to = dir.join(name);
            std::fs::copy(&from, &to).map_err(|e| Error::io(&from, "copying", e))?;
        }
    }
    Ok(())
}

/// Lists every file of the directory in the manifest with its size and
/// checksum (the expert files were hashed while being verified).
fn record_files(dir: &Path, expert_files: Vec<FileEntry>, manifest: &mut Manifest) -> Result<()> {
    let mut paths: Vec<String> = vec![DENSE_FILE.into()];
    paths.extend(
        COPIED_FILES
            .iter()
            .filter(|n| dir.join(n).is_file())
            .map(|n| n.to_string()),
    );
    manifest.files = paths
        .into_iter()
        .map(|rel| {
            let (size, hash) = hash_file(&dir.join(&rel))?;
            Ok(FileEntry {
                path: rel,
                size,
                xxh3: hex64(hash),
            })
        })
        .collect::<Result<_>>()?;
    manifest.files.extend(expert_files);
    Ok(())
}

/// Size and xxHash3-64 of a file, read in a streaming fashion.
pub fn hash_file(path: &Path) -> Result<(u64, u64)> {
    let mut file = File::open(path).map_err(|e| Error::io(path, "opening", e))?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 8 << 20];
    let mut size = 0u64;
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| Error::io(path, "reading", e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((size, hasher.digest()))
}

/// Writes a file through a temporary name and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(&tmp, "writing", e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, "renaming into place", e))
}

/// The summary of a model another process converted into `output` while
/// this one waited for the lock, provided it is the model this one would
/// have written.
fn converted_meanwhile(
    output: &Path,
    config_json: &serde_json::Value,
    quant: DType,
    synthetic: bool,
    plan: ConversionPlan,
    config: ModelConfig,
) -> Result<ConvertSummary> {
    let manifest = Manifest::read(&output.join(MANIFEST_FILE))?;
    if manifest.config != *config_json
        || manifest.quantization != quant
        || manifest.synthetic != synthetic
    {
        return Err(Error::bad_file(
            output,
            "another moeflux process wrote a different model here while this one waited; \
             choose another output, or pass --force to replace it",
        ));
    }
    ModelDir::open(
        output,
        OpenOptions {
            verify_checksums: false,
        },
    )?;
    Ok(ConvertSummary {
        tensors: manifest.tensors.len(),
        moe_layers: manifest.experts.len(),
        dense_bytes: manifest.dense_bytes(),
        expert_bytes: manifest.expert_bytes(),
        skipped: plan.skipped,
        unknown: plan.unknown,
        notes: Vec::new(),
        config,
    })
}
