//! The safetensors files of a checkpoint folder: one file, the shards an
//! index lists, or every `.safetensors` file; each memory-mapped and its
//! header checked, the index checked against the shards.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{SafeTensors, TensorInfo};

use super::Shard;
use crate::error::{Error, Result};

const INDEX_FILE: &str = "model.safetensors.index.json";
const SINGLE_FILE: &str = "model.safetensors";

pub(super) fn open_shard(path: &Path) -> Result<Shard> {
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
    let (data_start, tensors) = read_header(path, &map)?;
    Ok(Shard {
        path: path.to_path_buf(),
        map,
        data_start,
        tensors,
    })
}

/// A safetensors file's header: where the data starts and each tensor's
/// place, every tensor's data within the file.
fn read_header(path: &Path, bytes: &[u8]) -> Result<(usize, BTreeMap<String, TensorInfo>)> {
    let (header_len, metadata) = SafeTensors::read_metadata(bytes).map_err(|e| {
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
        if data_start.saturating_add(info.data_offsets.1) > bytes.len() {
            return Err(Error::tensor(
                path,
                name,
                "its data runs past the end of the file; the file is truncated",
            ));
        }
    }
    Ok((data_start, tensors))
}

/// Reads and checks a safetensors file held in memory as a conversion
/// opens each shard (`path` names it in errors): the entry point for
/// fuzzing the header reading.
pub fn validate_safetensors(bytes: &[u8], path: &Path) -> Result<()> {
    read_header(path, bytes).map(|_| ())
}

/// The shard files of a checkpoint directory.
pub(super) fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
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
pub(super) fn check_index_agrees(dir: &Path, shards: &[Shard]) -> Result<()> {
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
