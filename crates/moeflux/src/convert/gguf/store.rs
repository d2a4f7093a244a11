//! The GGUF input: which files an input names (a file, the parts of a
//! split file, or a folder holding one model), and their tensors together
//! as one [`Store`].

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use super::header::MAGIC;
use super::{GgmlType, GgufFile, GgufTensor};
use crate::convert::view::Store;
use crate::error::{Error, Result};

/// The files of split GGUF input: `NAME-00001-of-00003.gguf` names its
/// siblings.
fn split_siblings(path: &Path) -> Result<Option<Vec<PathBuf>>> {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return Ok(None);
    };
    let Some(stem) = name.strip_suffix(".gguf") else {
        return Ok(None);
    };
    let parts: Vec<&str> = stem.rsplitn(4, '-').collect();
    let [count, "of", index, base] = parts[..] else {
        return Ok(None);
    };
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(count) || !digits(index) {
        return Ok(None);
    }
    let (index, count): (usize, usize) = (index.parse().unwrap(), count.parse().unwrap());
    if index != 1 {
        return Err(Error::invalid(
            "INPUT",
            format!(
                "`{}` is part {index} of {count} of a split GGUF: pass the first part, \
                 {base}-00001-of-{count:05}.gguf",
                path.display()
            ),
        ));
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    Ok(Some(
        (1..=count)
            .map(|i| dir.join(format!("{base}-{i:05}-of-{count:05}.gguf")))
            .collect(),
    ))
}

/// Whether a file starts with GGUF's magic.
fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok_and(|_| &magic == MAGIC)
}

/// The GGUF files `input` names: a GGUF file (the first of split files),
/// or a folder holding one GGUF model and no config.json. `None` when the
/// input is no GGUF.
pub(crate) fn input_files(input: &Path) -> Result<Option<Vec<PathBuf>>> {
    let first = if input.is_file() {
        if !is_gguf(input) {
            return Err(Error::bad_file(
                input,
                "neither a GGUF file nor a checkpoint folder: pass a Hugging Face checkpoint \
                 folder (config.json and safetensors) or a .gguf file",
            ));
        }
        input.to_path_buf()
    } else if input.is_dir() && !input.join("config.json").exists() {
        let mut found: Vec<PathBuf> = std::fs::read_dir(input)
            .map_err(|e| Error::io(input, "listing", e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
            .collect();
        found.sort();
        let firsts: Vec<PathBuf> = found
            .into_iter()
            .filter(|p| split_siblings(p).is_ok())
            .collect();
        match firsts.len() {
            0 => return Ok(None),
            1 => firsts.into_iter().next().unwrap(),
            _ => {
                return Err(Error::invalid(
                    "INPUT",
                    format!(
                        "{} holds several GGUF models ({}); pass the file to convert",
                        input.display(),
                        firsts
                            .iter()
                            .filter_map(|p| p.file_name()?.to_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
        }
    } else {
        return Ok(None);
    };
    Ok(Some(split_siblings(&first)?.unwrap_or(vec![first])))
}

/// The tensors of one or more GGUF files (split parts), as a [`Store`].
pub(crate) struct GgufStore {
    files: Vec<GgufFile>,
    /// Tensor name -> (file, index in that file).
    tensors: BTreeMap<String, (usize, usize)>,
}

impl GgufStore {
    pub(super) fn open(paths: &[PathBuf]) -> Result<GgufStore> {
        let files: Vec<GgufFile> = paths
            .iter()
            .map(|p| {
                if !p.is_file() {
                    return Err(Error::bad_file(
                        p,
                        "missing: a part of this split GGUF is not there; download every part",
                    ));
                }
                GgufFile::open(p)
            })
            .collect::<Result<_>>()?;
        let first = &files[0];
        if let Some(count) = first.uint("split.count")?
            && count as usize != files.len()
        {
            return Err(first.field_error(
                "split.count",
                format!("{count} parts, but {} files are named", files.len()),
            ));
        }
        let mut tensors = BTreeMap::new();
        for (f, file) in files.iter().enumerate() {
            if files.len() > 1 {
                match file.uint("split.no")? {
                    Some(n) if n as usize == f => {}
                    other => {
                        return Err(file.field_error(
                            "split.no",
                            format!("{other:?}, expected {f} for part {} of the split", f + 1),
                        ));
                    }
                }
            }
            for (i, t) in file.tensors.iter().enumerate() {
                if let Some((g, _)) = tensors.insert(t.name.clone(), (f, i)) {
                    return Err(Error::tensor(
                        &file.path,
                        &t.name,
                        format!("also in {}", files[g].path.display()),
                    ));
                }
            }
        }
        if let Some(total) = first.uint("split.tensors.count")?
            && total as usize != tensors.len()
        {
            return Err(first.field_error(
                "split.tensors.count",
                format!("{total} tensors, but the parts hold {}", tensors.len()),
            ));
        }
        Ok(GgufStore { files, tensors })
    }

    /// The file with the model's metadata (the first part).
    pub(super) fn meta(&self) -> &GgufFile {
        &self.files[0]
    }

    pub(super) fn get(&self, name: &str) -> Option<&GgufTensor> {
        let &(f, i) = self.tensors.get(name)?;
        Some(&self.files[f].tensors[i])
    }

    pub(super) fn file_of(&self, name: &str) -> usize {
        self.tensors.get(name).map_or(0, |&(f, _)| f)
    }
}

impl Store for GgufStore {
    fn read_elements(
        &self,
        name: &str,
        start: usize,
        len: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let &(f, i) = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::tensor(self.meta().path(), name, "missing from the GGUF file"))?;
        let file = &self.files[f];
        file.read_elements(&file.tensors[i], start, len, out)
    }

    fn path_of(&self, name: &str) -> &Path {
        self.files[self.file_of(name)].path()
    }

    fn bits_per_weight(&self, name: &str) -> Option<f64> {
        Some(self.get(name)?.ggml_type.bits_per_weight())
    }

    fn describe(&self, name: &str) -> Option<String> {
        match self.get(name)?.ggml_type {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => None,
            t => Some(format!("GGUF {}", t.name())),
        }
    }
}
