//! Reading Hugging Face safetensors checkpoints: one file or shards listed
//! by `model.safetensors.index.json`, memory-mapped so a checkpoint larger
//! than RAM is read tensor by tensor.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors, TensorInfo};

use super::TensorSource;
use super::plan::{CheckpointIndex, CheckpointTensor, RowSource};
use crate::error::{Error, Result};

const INDEX_FILE: &str = "model.safetensors.index.json";
const SINGLE_FILE: &str = "model.safetensors";

struct Shard {
    path: PathBuf,
    map: Mmap,
    /// Byte offset of the data section (after the JSON header).
    data_start: usize,
    tensors: BTreeMap<String, TensorInfo>,
}

pub struct Checkpoint {
    shards: Vec<Shard>,
    pub index: CheckpointIndex,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let files = shard_files(dir)?;
        let mut shards = Vec::with_capacity(files.len());
        let mut tensors = BTreeMap::new();
        for (i, path) in files.iter().enumerate() {
            let file = File::open(path).map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => Error::bad_file(
                    path,
                    format!("missing: `{INDEX_FILE}` lists it; download the complete checkpoint"),
                ),
                _ => Error::io(path, "opening checkpoint shard", e),
            })?;
            // SAFETY: the checkpoint is only read; it must not change while
            // the conversion runs.
            let map =
                unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, "memory-mapping", e))?;
            let (header_len, metadata) = SafeTensors::read_metadata(&map).map_err(|e| {
                Error::bad_file(
                    path,
                    format!("not a valid safetensors file ({e}); it may be truncated or corrupt"),
                )
            })?;
            let infos: BTreeMap<String, TensorInfo> = metadata
                .tensors()
                .into_iter()
                .map(|(name, info)| (name, info.clone()))
                .collect();
            for (name, info) in &infos {
                if let Some(prev) = tensors.insert(
                    name.clone(),
                    CheckpointTensor {
                        shape: info.shape.clone(),
                        shard: i,
                    },
                ) {
                    return Err(Error::tensor(
                        path,
                        name,
                        format!("also present in {}", files[prev.shard].display()),
                    ));
                }
            }
            shards.push(Shard {
                path: path.clone(),
                map,
                data_start: 8 + header_len,
                tensors: infos,
            });
        }
        check_index_agrees(dir, &shards)?;
        Ok(Checkpoint {
            index: CheckpointIndex {
                dir: dir.to_path_buf(),
                shards: files,
                tensors,
                synthetic: false,
            },
            shards,
        })
    }

    fn locate(&self, name: &str) -> Option<(&Shard, &TensorInfo)> {
        let t = self.index.get(name)?;
        let shard = &self.shards[t.shard];
        Some((shard, &shard.tensors[name]))
    }
}

impl TensorSource for Checkpoint {
    /// Reads rows of a tensor viewed as `[leading dims product, last dim]`
    /// and converts them to f32, appending to `out`.
    fn read_rows(&self, src: &RowSource, out: &mut Vec<f32>) -> Result<()> {
        let (shard, info) = self.locate(&src.tensor).ok_or_else(|| {
            Error::tensor(&self.index.dir, &src.tensor, "missing from the checkpoint")
        })?;
        let cols = *info.shape.last().unwrap_or(&1);
        let width = match info.dtype {
            Dtype::BF16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
            other => {
                return Err(Error::tensor(
                    &shard.path,
                    &src.tensor,
                    format!("dtype {other:?} is not supported (expected BF16, F16 or F32)"),
                ));
            }
        };
        let start = shard.data_start + info.data_offsets.0 + src.row_start * cols * width;
        let len = src.rows * cols * width;
        let bytes = &shard.map[start..start + len];
        let before = out.len();
        match info.dtype {
            Dtype::BF16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            Dtype::F16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            _ => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
        }
        if out[before..].iter().any(|v| !v.is_finite()) {
            return Err(Error::tensor(
                &shard.path,
                &src.tensor,
                "contains NaN or infinite values; the checkpoint is damaged",
            ));
        }
        Ok(())
    }
}

/// The shard files of a checkpoint directory.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    if !dir.is_dir() {
        return Err(Error::bad_file(
            dir,
            "not a directory: pass a Hugging Face checkpoint directory",
        ));
    }
    let index = dir.join(INDEX_FILE);
    if index.exists() {
        let names = read_index(&index)?.into_values().collect::<BTreeSet<_>>();
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
