//! Opening the input: a safetensors checkpoint folder or a GGUF file, with
//! its configuration and conversion plan; [`Input`] reads its tensors
//! without converting.

use std::path::Path;

use super::plan::{self, ConversionPlan, RowSource};
use super::{TensorSource, checkpoint, gguf};
use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// A checkpoint opened for conversion, with its configuration and plan.
pub(super) struct CheckpointSource {
    pub(super) ckpt: Box<dyn TensorSource>,
    pub(super) plan: ConversionPlan,
    pub(super) config_json: serde_json::Value,
    pub(super) config: ModelConfig,
    /// The folder whose tokenizer and generation files are copied.
    pub(super) side_dir: Option<std::path::PathBuf>,
    /// Files written instead of copied (a config.json without the
    /// quantization settings of a quantized input; a GGUF's tokenizer).
    pub(super) generated: Vec<(String, Vec<u8>)>,
    /// Every tensor's Hugging Face name and shape.
    shapes: std::collections::BTreeMap<String, Vec<usize>>,
}

impl CheckpointSource {
    pub(super) fn open(input: &Path) -> Result<CheckpointSource> {
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

/// A checkpoint opened the way [`convert`](super::convert) opens it, for reading its
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
