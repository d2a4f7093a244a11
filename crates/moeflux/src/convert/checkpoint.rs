//! Reading safetensors checkpoints: one file or shards listed by
//! `model.safetensors.index.json`, memory-mapped so a checkpoint larger
//! than RAM is read tensor by tensor.
//!
//! Besides bf16, f16 and f32 tensors, two quantized encodings are read,
//! recognised by their content:
//!
//! - **FP8** (DeepSeek-V3, Qwen3-*-FP8): a `float8_e4m3fn` `weight` with a
//!   `weight_scale_inv` of one scale per block (`quantization_config`'s
//!   `weight_block_size`, 128×128 by default; a single value scales the
//!   whole tensor). A weight is `e4m3 × scale_inv`, computed in f32.
//! - **MLX** affine quantization (mlx-community): a `uint32` `weight`
//!   packing `bits`-wide codes lowest bits first, with `scales` and
//!   `biases` per group of `group_size` inputs (config.json's
//!   `quantization`, per-layer entries overriding the default). A weight is
//!   `q × scale + bias`, moeflux's own q4/q8 scheme: 4- and 8-bit groups of
//!   64 with bf16 scales are copied without re-quantization.
//!
//! MLX checkpoints also name tensors their own way (routed experts stacked
//! in `switch_mlp`, Qwen3.5's `language_model.model.` prefix, the
//! convolution as `[channels, kernel, 1]`, `1 + w` norms for the Qwen3-Next
//! family); opening presents them under the Hugging Face names the
//! architecture plans expect.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors, TensorInfo};

use super::plan::CheckpointIndex;
use super::view::{Op, Store, View, Views};
use crate::error::{Error, Result};
use crate::quant::{DType, EncodedRows, GROUP_SIZE};

const INDEX_FILE: &str = "model.safetensors.index.json";
const SINGLE_FILE: &str = "model.safetensors";

struct Shard {
    path: PathBuf,
    map: Mmap,
    /// Byte offset of the data section (after the JSON header).
    data_start: usize,
    tensors: BTreeMap<String, TensorInfo>,
}

/// How a stored tensor's values are encoded.
#[derive(Clone, Debug)]
enum Encoding {
    /// bf16, f16 or f32.
    Plain,
    /// float8_e4m3fn times a scale per `block` (the whole tensor when the
    /// scale has one value).
    Fp8 { scale: String, block: [usize; 2] },
    /// MLX affine groups: codes packed in u32, scales and biases per group.
    Mlx {
        scales: String,
        biases: String,
        bits: usize,
        group: usize,
    },
}

/// A weight as the checkpoint stores it, its companion tensors (FP8 scales,
/// MLX scales and biases) attached.
#[derive(Clone, Debug)]
struct Stored {
    shard: usize,
    /// The shape of the values (an MLX weight's unpacked shape).
    shape: Vec<usize>,
    encoding: Encoding,
}

/// The tensors of a safetensors checkpoint.
pub struct Checkpoint {
    shards: Vec<Shard>,
    stored: BTreeMap<String, Stored>,
}

/// Opens the checkpoint folder `dir` whose `config.json` is `config`: its
/// tensors under the names and shapes the architecture plans expect.
pub(crate) fn open(
    dir: &Path,
    config: &serde_json::Value,
) -> Result<(Views<Checkpoint>, CheckpointIndex)> {
    let files = shard_files(dir)?;
    let mut shards = Vec::with_capacity(files.len());
    let mut raw: BTreeMap<String, usize> = BTreeMap::new();
    for (i, path) in files.iter().enumerate() {
        let shard = open_shard(path)?;
        for name in shard.tensors.keys() {
            if let Some(prev) = raw.insert(name.clone(), i) {
                return Err(Error::tensor(
                    path,
                    name,
                    format!("also present in {}", files[prev].display()),
                ));
            }
        }
        shards.push(shard);
    }
    check_index_agrees(dir, &shards)?;
    let quant = QuantConfig::read(dir, config)?;
    let stored = attach_companions(&shards, &raw, &quant)?;
    let ckpt = Checkpoint { shards, stored };
    let views = hf_views(&ckpt.stored);
    let source = Views::new(ckpt, views, dir);
    let index = source.index(files, |t| source.store.stored[t].shard);
    Ok((source, index))
}

fn open_shard(path: &Path) -> Result<Shard> {
    let file = File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::bad_file(
            path,
            format!("missing: `{INDEX_FILE}` lists it; download the complete checkpoint"),
        ),
        _ => Error::io(path, "opening checkpoint shard", e),
    })?;
    // SAFETY: the checkpoint is only read; it must not change while the
    // conversion runs.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, "memory-mapping", e))?;
    let (header_len, metadata) = SafeTensors::read_metadata(&map).map_err(|e| {
        Error::bad_file(
            path,
            format!("not a valid safetensors file ({e}); it may be truncated or corrupt"),
        )
    })?;
    let data_start = 8 + header_len;
    let tensors: BTreeMap<String, TensorInfo> = metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| (name, info.clone()))
        .collect();
    for (name, info) in &tensors {
        if data_start + info.data_offsets.1 > map.len() {
            return Err(Error::tensor(
                path,
                name,
                "its data runs past the end of the file; the file is truncated",
            ));
        }
    }
    Ok(Shard {
        path: path.to_path_buf(),
        map,
        data_start,
        tensors,
    })
}

/// Quantization settings of config.json.
struct QuantConfig {
    path: PathBuf,
    /// `quantization_config.weight_block_size` (FP8).
    fp8_block: [usize; 2],
    /// MLX's default `(bits, group_size)`.
    mlx_default: Option<(usize, usize)>,
    /// MLX's per-module settings (`None`: left unquantized).
    mlx_modules: BTreeMap<String, Option<(usize, usize)>>,
    /// MLX's mode when it is not affine (mxfp4, nvfp4, ...).
    mlx_mode: Option<String>,
}

impl QuantConfig {
    fn read(dir: &Path, config: &serde_json::Value) -> Result<QuantConfig> {
        let path = dir.join("config.json");
        let mut q = QuantConfig {
            path: path.clone(),
            fp8_block: [128, 128],
            mlx_default: None,
            mlx_modules: BTreeMap::new(),
            mlx_mode: None,
        };
        if let Some(qc) = config.get("quantization_config")
            && qc.get("quant_method").and_then(|m| m.as_str()) == Some("fp8")
            && let Some(block) = qc.get("weight_block_size")
        {
            let dims: Option<Vec<usize>> = block.as_array().map(|a| {
                a.iter()
                    .filter_map(|v| v.as_u64().map(|v| v as usize))
                    .collect()
            });
            match dims.as_deref() {
                Some(&[r, c]) if r > 0 && c > 0 => q.fp8_block = [r, c],
                _ => {
                    return Err(Error::config(
                        &path,
                        "quantization_config.weight_block_size must be two positive integers",
                    ));
                }
            }
        }
        // MLX writes `quantization` (and, in newer versions, the same
        // object as `quantization_config`).
        let mlx = ["quantization", "quantization_config"]
            .iter()
            .filter_map(|k| config.get(*k))
            .find(|q| q.get("bits").is_some() && q.get("group_size").is_some());
        if let Some(m) = mlx {
            let params = |v: &serde_json::Value, at: &str| -> Result<(usize, usize)> {
                let get = |k: &str| v.get(k).and_then(|x| x.as_u64()).map(|x| x as usize);
                match (get("bits"), get("group_size")) {
                    (Some(b), Some(g)) if (1..=8).contains(&b) && g > 0 => Ok((b, g)),
                    _ => Err(Error::config(
                        &path,
                        format!("{at}: bits (1 to 8) and group_size must be positive integers"),
                    )),
                }
            };
            q.mlx_default = Some(params(m, "quantization")?);
            if let Some(mode) = m.get("mode").and_then(|v| v.as_str())
                && mode != "affine"
            {
                q.mlx_mode = Some(mode.to_string());
            }
            for (key, value) in m.as_object().into_iter().flatten() {
                match value {
                    serde_json::Value::Object(_) => {
                        let entry = params(value, &format!("quantization.{key}"))?;
                        q.mlx_modules.insert(key.clone(), Some(entry));
                    }
                    serde_json::Value::Bool(false) => {
                        q.mlx_modules.insert(key.clone(), None);
                    }
                    _ => {}
                }
            }
        }
        Ok(q)
    }

    /// `(bits, group_size)` of the MLX module `module`.
    fn mlx(&self, module: &str) -> Option<(usize, usize)> {
        match self.mlx_modules.get(module) {
            Some(entry) => *entry,
            None => self.mlx_default,
        }
    }
}

/// Attaches FP8 scales and MLX scales and biases to their weights; those
/// companion tensors are no tensors of their own.
fn attach_companions(
    shards: &[Shard],
    raw: &BTreeMap<String, usize>,
    quant: &QuantConfig,
) -> Result<BTreeMap<String, Stored>> {
    let info = |name: &str| -> Option<(&Shard, &TensorInfo)> {
        let shard = &shards[*raw.get(name)?];
        Some((shard, &shard.tensors[name]))
    };
    let mut companions = std::collections::BTreeSet::new();
    let mut stored = BTreeMap::new();
    for (name, &shard_index) in raw {
        let (shard, t) = info(name).expect("listed");
        let base = name.strip_suffix(".weight");
        let encoding = match t.dtype {
            Dtype::F8_E4M3 => {
                let scale = format!("{}_scale_inv", name);
                let Some((_, s)) = info(&scale) else {
                    return Err(Error::tensor(
                        &shard.path,
                        name,
                        format!(
                            "a float8_e4m3fn tensor without `{scale}`: only block-scaled FP8 \
                             checkpoints (quantization_config.quant_method \"fp8\") are supported"
                        ),
                    ));
                };
                check_fp8_scale(shard, name, t, s, quant.fp8_block)?;
                companions.insert(scale.clone());
                // Static activation scales of some FP8 checkpoints: they
                // quantize inputs at inference, not the weights.
                if let Some(base) = base {
                    for extra in ["input_scale", "activation_scale"] {
                        let extra = format!("{base}.{extra}");
                        if raw.contains_key(&extra) {
                            companions.insert(extra);
                        }
                    }
                }
                Encoding::Fp8 {
                    scale,
                    block: quant.fp8_block,
                }
            }
            Dtype::U32 if base.is_some_and(|b| raw.contains_key(&format!("{b}.scales"))) => {
                let base = base.unwrap();
                let (scales, biases) = (format!("{base}.scales"), format!("{base}.biases"));
                if let Some(mode) = &quant.mlx_mode {
                    return Err(Error::tensor(
                        &shard.path,
                        name,
                        format!("MLX `{mode}` quantization is not supported (affine only)"),
                    ));
                }
                let Some((bits, group)) = quant.mlx(base) else {
                    return Err(Error::tensor(
                        &shard.path,
                        name,
                        format!(
                            "MLX-quantized, but {} has no `quantization` with bits and \
                             group_size for it",
                            quant.path.display()
                        ),
                    ));
                };
                let (_, s) = info(&scales).expect("checked");
                let Some((_, b)) = info(&biases) else {
                    return Err(Error::tensor(
                        &shard.path,
                        name,
                        format!("MLX-quantized, but `{biases}` is missing"),
                    ));
                };
                let shape = mlx_shape(shard, name, t, s, b, bits, group)?;
                companions.insert(scales.clone());
                companions.insert(biases.clone());
                stored.insert(
                    name.clone(),
                    Stored {
                        shard: shard_index,
                        shape,
                        encoding: Encoding::Mlx {
                            scales,
                            biases,
                            bits,
                            group,
                        },
                    },
                );
                continue;
            }
            _ => Encoding::Plain,
        };
        stored.insert(
            name.clone(),
            Stored {
                shard: shard_index,
                shape: t.shape.clone(),
                encoding,
            },
        );
    }
    stored.retain(|name, _| !companions.contains(name));
    Ok(stored)
}

fn is_float(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16)
}

fn check_fp8_scale(
    shard: &Shard,
    name: &str,
    t: &TensorInfo,
    s: &TensorInfo,
    block: [usize; 2],
) -> Result<()> {
    let err = |msg: String| Err(Error::tensor(&shard.path, name, msg));
    if !is_float(s.dtype) {
        return err(format!(
            "its scale_inv is {:?}; expected F32, BF16 or F16",
            s.dtype
        ));
    }
    if s.shape.iter().product::<usize>() == 1 {
        return Ok(());
    }
    let n = t.shape.len();
    if n < 2 || s.shape.len() != n {
        return err(format!(
            "shape {:?} with a weight_scale_inv of shape {:?}: expected one scale per \
             {}x{} block of the last two dimensions",
            t.shape, s.shape, block[0], block[1]
        ));
    }
    let want: Vec<usize> = t.shape[..n - 2]
        .iter()
        .copied()
        .chain([
            t.shape[n - 2].div_ceil(block[0]),
            t.shape[n - 1].div_ceil(block[1]),
        ])
        .collect();
    if s.shape != want {
        return err(format!(
            "shape {:?} needs a weight_scale_inv of shape {want:?} for {}x{} blocks \
             (quantization_config.weight_block_size), found {:?}",
            t.shape, block[0], block[1], s.shape
        ));
    }
    Ok(())
}

/// The unpacked shape of an MLX weight, checked against its scales and
/// biases.
fn mlx_shape(
    shard: &Shard,
    name: &str,
    t: &TensorInfo,
    s: &TensorInfo,
    b: &TensorInfo,
    bits: usize,
    group: usize,
) -> Result<Vec<usize>> {
    let err = |msg: String| Err(Error::tensor(&shard.path, name, msg));
    if !is_float(s.dtype) || b.dtype != s.dtype {
        return err(format!(
            "MLX scales {:?} and biases {:?}: expected both BF16, F16 or F32",
            s.dtype, b.dtype
        ));
    }
    let Some((&packed, lead)) = t.shape.split_last() else {
        return err("an MLX weight must have at least one dimension".into());
    };
    let cols = packed * 32 / bits;
    let groups = cols / group;
    let want: Vec<usize> = lead.iter().copied().chain([groups]).collect();
    if packed * 32 % bits != 0 || !cols.is_multiple_of(group) || s.shape != want || b.shape != want
    {
        return err(format!(
            "packed shape {:?} with scales {:?} and biases {:?} does not fit {bits}-bit \
             codes in groups of {group} (config.json's quantization)",
            t.shape, s.shape, b.shape
        ));
    }
    Ok(lead.iter().copied().chain([cols]).collect())
}

/// Hugging Face names for the stored tensors: MLX's names and layouts
/// mapped back, every other tensor as it is.
fn hf_views(stored: &BTreeMap<String, Stored>) -> BTreeMap<String, View> {
    let mut views = BTreeMap::new();
    // MLX's sanitised Qwen3-Next / Qwen3.5 checkpoints store the
    // convolution as [channels, kernel, 1] and the `1 + w` norms shifted.
    let mut mlx_layout = false;
    for (name, t) in stored {
        let hf = if let Some(rest) = name.strip_prefix("language_model.model.") {
            format!("model.language_model.{rest}")
        } else if let Some(rest) = name.strip_prefix("language_model.lm_head.") {
            format!("lm_head.{rest}")
        } else if let Some(rest) = name.strip_prefix("vision_tower.") {
            format!("model.visual.{rest}")
        } else {
            name.clone()
        };
        if hf.contains(".mlp.switch_mlp.")
            && let [experts, rows, cols] = t.shape[..]
        {
            for e in 0..experts {
                let mut v = View::of(name, vec![rows, cols]);
                v.row_offset = e * rows;
                views.insert(hf.replace(".switch_mlp.", &format!(".experts.{e}.")), v);
            }
            continue;
        }
        if hf.ends_with("conv1d.weight")
            && let [channels, kernel, 1] = t.shape[..]
            && kernel > 1
        {
            mlx_layout = true;
            views.insert(hf, View::of(name, vec![channels, 1, kernel]));
            continue;
        }
        views.insert(hf, View::of(name, t.shape.clone()));
    }
    if mlx_layout {
        const SHIFTED: [&str; 5] = [
            ".input_layernorm.weight",
            ".post_attention_layernorm.weight",
            "model.norm.weight",
            ".q_norm.weight",
            ".k_norm.weight",
        ];
        for (name, v) in views.iter_mut() {
            if v.shape.len() == 1 && SHIFTED.iter().any(|s| name.ends_with(s)) {
                v.op = Op::MinusOne;
            }
        }
    }
    views
}

/// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
/// infinities, S.1111.111 is NaN.
pub(crate) fn e4m3_to_f32(byte: u8) -> f32 {
    static TABLE: LazyLock<[f32; 256]> = LazyLock::new(|| {
        std::array::from_fn(|b| {
            let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
            let exp = ((b >> 3) & 0xf) as i32;
            let man = (b & 7) as f32;
            if exp == 0xf && b & 7 == 7 {
                f32::NAN
            } else if exp == 0 {
                sign * man * (2f32).powi(-9)
            } else {
                sign * (1.0 + man / 8.0) * (2f32).powi(exp - 7)
            }
        })
    });
    TABLE[byte as usize]
}

fn float_at(dtype: Dtype, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        Dtype::BF16 => bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        Dtype::F16 => f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        _ => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()),
    }
}

/// An MLX row: its codes, the dtype of its scales and biases, their bytes.
type MlxRow<'a> = (&'a [u8], Dtype, &'a [u8], &'a [u8]);

impl Checkpoint {
    /// Whether any tensor is FP8 or MLX-quantized.
    pub(crate) fn quantized(&self) -> bool {
        self.stored
            .values()
            .any(|t| !matches!(t.encoding, Encoding::Plain))
    }

    fn raw(&self, t: &Stored, name: &str) -> (&Shard, Dtype, &[u8]) {
        let shard = &self.shards[t.shard];
        let info = &shard.tensors[name];
        let bytes = &shard.map[shard.data_start + info.data_offsets.0..]
            [..info.data_offsets.1 - info.data_offsets.0];
        (shard, info.dtype, bytes)
    }

    fn stored(&self, name: &str) -> &Stored {
        &self.stored[name]
    }

    /// The codes of an MLX row, and its scales' and biases' bytes.
    fn mlx_row(&self, name: &str, row: usize) -> Option<MlxRow<'_>> {
        let t = self.stored(name);
        let Encoding::Mlx {
            scales,
            biases,
            bits,
            group,
        } = &t.encoding
        else {
            return None;
        };
        let cols = *t.shape.last()?;
        let (row_bytes, groups) = (cols * bits / 8, cols / group);
        let (_, _, codes) = self.raw(t, name);
        let (_, sd, s) = self.raw(t, scales);
        let (_, _, b) = self.raw(t, biases);
        let w = sd.bitsize() / 8;
        Some((
            &codes[row * row_bytes..][..row_bytes],
            sd,
            &s[row * groups * w..][..groups * w],
            &b[row * groups * w..][..groups * w],
        ))
    }
}

impl Store for Checkpoint {
    fn read_elements(
        &self,
        name: &str,
        start: usize,
        len: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let t = self.stored(name);
        let total: usize = t.shape.iter().product();
        let cols = *t.shape.last().unwrap_or(&1);
        let (shard, dtype, bytes) = self.raw(t, name);
        if start + len > total {
            return Err(Error::tensor(
                &shard.path,
                name,
                format!("elements {start}..{} of {total} asked", start + len),
            ));
        }
        let range = start..start + len;
        match &t.encoding {
            Encoding::Plain => match dtype {
                Dtype::BF16 | Dtype::F16 | Dtype::F32 => {
                    out.extend(range.map(|i| float_at(dtype, bytes, i)));
                }
                other => {
                    return Err(Error::tensor(
                        &shard.path,
                        name,
                        format!(
                            "dtype {other:?} is not supported (expected BF16, F16, F32, \
                             block-scaled F8_E4M3 or MLX-quantized U32)"
                        ),
                    ));
                }
            },
            Encoding::Fp8 { scale, block } => {
                let (_, sd, s) = self.raw(t, scale);
                let n = t.shape.len();
                let rows = t.shape[n - 2];
                let (brows, bcols) = (rows.div_ceil(block[0]), cols.div_ceil(block[1]));
                let per_tensor = s.len() == sd.bitsize() / 8;
                out.extend(range.map(|i| {
                    let (r, c) = (i / cols, i % cols);
                    let k = if per_tensor {
                        0
                    } else {
                        let (m, r) = (r / rows, r % rows);
                        (m * brows + r / block[0]) * bcols + c / block[1]
                    };
                    e4m3_to_f32(bytes[i]) * float_at(sd, s, k)
                }));
            }
            Encoding::Mlx {
                scales,
                biases,
                bits,
                group,
            } => {
                let (_, sd, s) = self.raw(t, scales);
                let (_, _, b) = self.raw(t, biases);
                let row_bytes = cols * bits / 8;
                let groups = cols / group;
                let mask = (1u32 << bits) - 1;
                out.extend(range.map(|i| {
                    let (r, c) = (i / cols, i % cols);
                    let bit = c * bits;
                    let at = r * row_bytes + bit / 8;
                    let lo = bytes[at] as u32;
                    let hi = if bit % 8 + bits > 8 {
                        bytes[at + 1] as u32
                    } else {
                        0
                    };
                    let q = ((lo | (hi << 8)) >> (bit % 8)) & mask;
                    let g = r * groups + c / group;
                    q as f32 * float_at(sd, s, g) + float_at(sd, b, g)
                }));
            }
        }
        Ok(())
    }

    fn path_of(&self, name: &str) -> &Path {
        &self.shards[self.stored(name).shard].path
    }

    fn bits_per_weight(&self, name: &str) -> Option<f64> {
        let t = self.stored.get(name)?;
        let (_, dtype, _) = self.raw(t, name);
        Some(match &t.encoding {
            Encoding::Plain => dtype.bitsize() as f64,
            Encoding::Fp8 { .. } => 8.0,
            Encoding::Mlx {
                scales,
                bits,
                group,
                ..
            } => {
                let (_, sd, _) = self.raw(t, scales);
                *bits as f64 + 2.0 * sd.bitsize() as f64 / *group as f64
            }
        })
    }

    fn stored_as(&self, name: &str, dtype: DType) -> bool {
        let t = self.stored(name);
        match &t.encoding {
            Encoding::Mlx {
                scales,
                bits,
                group,
                ..
            } => {
                let (_, sd, _) = self.raw(t, scales);
                Some(*bits as u32) == dtype.bits()
                    && *group == GROUP_SIZE
                    && matches!(sd, Dtype::BF16 | Dtype::F16)
            }
            _ => false,
        }
    }

    fn append_encoded_row(
        &self,
        name: &str,
        row: usize,
        _cols: usize,
        out: &mut EncodedRows,
    ) -> Result<bool> {
        let Some((codes, sd, s, b)) = self.mlx_row(name, row) else {
            return Ok(false);
        };
        match sd {
            Dtype::BF16 => {
                out.scales.extend_from_slice(s);
                out.biases.extend_from_slice(b);
            }
            Dtype::F16 => {
                // Exact only when every value survives the narrower
                // mantissa and the wider exponent range of bf16.
                for (src, dst) in [(s, &mut out.scales), (b, &mut out.biases)] {
                    for pair in src.chunks_exact(2) {
                        let v = f16::from_le_bytes([pair[0], pair[1]]).to_f32();
                        let w = bf16::from_f32(v);
                        if w.to_f32() != v {
                            return Ok(false);
                        }
                        dst.extend(w.to_le_bytes());
                    }
                }
            }
            _ => return Ok(false),
        }
        out.codes.extend_from_slice(codes);
        Ok(true)
    }

    fn describe(&self, name: &str) -> Option<String> {
        let t = self.stored(name);
        match &t.encoding {
            Encoding::Plain => None,
            Encoding::Fp8 { .. } => Some("FP8 (e4m3, block scales)".into()),
            Encoding::Mlx { bits, group, .. } => Some(format!("MLX {bits}-bit groups of {group}")),
        }
    }
}

/// The shard files of a checkpoint directory.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    if !dir.is_dir() {
        return Err(Error::bad_file(
            dir,
            "not a directory: pass a Hugging Face checkpoint directory or a GGUF file",
        ));
    }
    let index = dir.join(INDEX_FILE);
    if index.exists() {
        let names = read_index(&index)?
            .into_values()
            .collect::<std::collections::BTreeSet<_>>();
        return names
            .into_iter()
            .map(|name| safe_join(dir, &index, &name))
            .collect();
    }
    let single = dir.join(SINGLE_FILE);
    if single.exists() {
        return Ok(vec![single]);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, "listing", e))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    found.sort();
    if found.is_empty() {
        return Err(Error::bad_file(
            dir,
            format!("no `{SINGLE_FILE}`, `{INDEX_FILE}` or other .safetensors files found"),
        ));
    }
    Ok(found)
}

fn safe_join(dir: &Path, index: &Path, name: &str) -> Result<PathBuf> {
    let rel = Path::new(name);
    if rel.components().count() != 1 || rel.is_absolute() {
        return Err(Error::bad_file(
            index,
            format!("shard name `{name}` must be a file name in the checkpoint directory"),
        ));
    }
    Ok(dir.join(rel))
}

/// `weight_map` of the index: tensor name -> shard file name.
fn read_index(index: &Path) -> Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, "reading", e))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::bad_file(index, format!("malformed JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::bad_file(index, "missing the `weight_map` object"))?;
    map.iter()
        .map(|(k, v)| {
            v.as_str()
                .map(|s| (k.clone(), s.to_string()))
                .ok_or_else(|| {
                    Error::bad_file(index, format!("`weight_map.{k}` must be a file name"))
                })
        })
        .collect()
}

/// Every tensor the index lists must be in the shard it names.
fn check_index_agrees(dir: &Path, shards: &[Shard]) -> Result<()> {
    let index = dir.join(INDEX_FILE);
    if !index.exists() {
        return Ok(());
    }
    for (name, file) in read_index(&index)? {
        let path = dir.join(&file);
        let shard = shards
            .iter()
            .find(|s| s.path == path)
            .expect("shards come from the index");
        if !shard.tensors.contains_key(&name) {
            return Err(Error::tensor(
                &path,
                &name,
                format!(
                    "listed in `{INDEX_FILE}` but absent from this shard; the download is incomplete"
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
    }

    /// An MLX 4-bit matrix whose scales are f16: copied when they are
    /// exact in bf16, re-quantized otherwise.
    #[test]
    fn mlx_f16_scales_are_copied_only_when_exact() {
        use safetensors::tensor::TensorView;
        let dir = tempfile::tempdir().unwrap();
        for (scale, exact) in [(0.5f32, true), (1.0 + 2f32.powi(-10), false)] {
            let codes = vec![0x21u8; 2 * 32];
            let scales = f16::from_f32(scale).to_le_bytes().repeat(2);
            let biases = f16::from_f32(-1.0).to_le_bytes().repeat(2);
            let tensors = [
                (
                    "m.weight",
                    TensorView::new(Dtype::U32, vec![2, 8], &codes).unwrap(),
                ),
                (
                    "m.scales",
                    TensorView::new(Dtype::F16, vec![2, 1], &scales).unwrap(),
                ),
                (
                    "m.biases",
                    TensorView::new(Dtype::F16, vec![2, 1], &biases).unwrap(),
                ),
            ];
            let bytes = safetensors::serialize(tensors, None).unwrap();
            std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
            let config = serde_json::json!({"quantization": {"bits": 4, "group_size": 64}});
            let (source, index) = open(dir.path(), &config).unwrap();
            assert_eq!(index.tensors["m.weight"].shape, vec![2, 64]);
            let ckpt = &source.store;
            assert!(ckpt.stored_as("m.weight", DType::Q4));
            let mut enc = EncodedRows::default();
            assert_eq!(
                ckpt.append_encoded_row("m.weight", 1, 64, &mut enc)
                    .unwrap(),
                exact
            );
            let mut values = Vec::new();
            ckpt.read_elements("m.weight", 64, 3, &mut values).unwrap();
            let s = f16::from_f32(scale).to_f32();
            assert_eq!(values, vec![s - 1.0, 2.0 * s - 1.0, s - 1.0]);
        }
    }

    #[test]
    fn shared_views_keep_rows_apart() {
        let mut stored = BTreeMap::new();
        stored.insert(
            "model.layers.0.mlp.switch_mlp.up_proj.weight".to_string(),
            Stored {
                shard: 0,
                shape: vec![3, 4, 64],
                encoding: Encoding::Plain,
            },
        );
        let views = hf_views(&stored);
        let v = &views["model.layers.0.mlp.experts.2.up_proj.weight"];
        assert_eq!((v.shape.clone(), v.row_offset), (vec![4, 64], 8));
        assert_eq!(views.len(), 3);
    }
}
