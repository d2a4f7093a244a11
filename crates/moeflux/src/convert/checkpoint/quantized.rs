//! FP8 and MLX quantization recognised: config.json's settings, each
//! quantized weight's companion tensors (FP8 scales, MLX scales and
//! biases) attached and their shapes checked.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorInfo};

use super::{Encoding, Shard, Stored};
use crate::error::{Error, Result};

/// Quantization settings of config.json.
pub(super) struct QuantConfig {
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
    pub(super) fn read(dir: &Path, config: &serde_json::Value) -> Result<QuantConfig> {
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
pub(super) fn attach_companions(
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
            Dtype::U8 if mxfp4_scales(name, raw).is_some() => {
                let scales = mxfp4_scales(name, raw).expect("checked");
                let (_, s) = info(&scales).expect("listed");
                let shape = mxfp4_shape(shard, name, t, s)?;
                companions.insert(scales.clone());
                stored.insert(
                    name.clone(),
                    Stored {
                        shard: shard_index,
                        shape,
                        encoding: Encoding::Mxfp4 { scales },
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

/// The scales of an MXFP4 `{name}_blocks` tensor, `{name}_scales`, if
/// the checkpoint has them.
fn mxfp4_scales(name: &str, raw: &BTreeMap<String, usize>) -> Option<String> {
    let scales = format!("{}_scales", name.strip_suffix("_blocks")?);
    raw.contains_key(&scales).then_some(scales)
}

/// The values' shape of MXFP4 blocks `[..., groups, 16]`, checked against
/// their scales `[..., groups]` (both u8).
fn mxfp4_shape(shard: &Shard, name: &str, t: &TensorInfo, s: &TensorInfo) -> Result<Vec<usize>> {
    let n = t.shape.len();
    let fits = n >= 2
        && t.shape[n - 1] == 16
        && s.dtype == Dtype::U8
        && s.shape.as_slice() == &t.shape[..n - 1];
    if !fits {
        return Err(Error::tensor(
            &shard.path,
            name,
            format!(
                "MXFP4 blocks of shape {:?} with scales {:?} {:?}: expected u8 blocks                  [..., groups, 16] and u8 scales [..., groups]",
                t.shape, s.dtype, s.shape
            ),
        ));
    }
    Ok(t.shape[..n - 2]
        .iter()
        .copied()
        .chain([t.shape[n - 2] * 32])
        .collect())
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
