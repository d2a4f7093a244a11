//! One GGUF file: opened and its header checked, its metadata read by
//! type, its tensors dequantized.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::header::{Cursor, GgufTensor, Value, ValueType, parse};
use crate::error::{Error, Result};

/// One GGUF file, memory-mapped, its header parsed and checked.
pub struct GgufFile {
    pub(super) path: PathBuf,
    map: Mmap,
    version: u32,
    metadata: Vec<(String, Value)>,
    pub(super) tensors: Vec<GgufTensor>,
}

impl GgufFile {
    /// Opens and checks a GGUF file's header.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).map_err(|e| Error::io(path, "opening", e))?;
        // SAFETY: the file is only read; it must not change while it is
        // converted.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, "memory-mapping", e))?;
        let (version, metadata, tensors) = parse(path, &map)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            map,
            version,
            metadata,
            tensors,
        })
    }

    /// Parses and checks a GGUF file held in memory as [`GgufFile::open`]
    /// does (`path` names it in errors): the entry point for fuzzing the
    /// header parser.
    pub fn validate(bytes: &[u8], path: &Path) -> Result<()> {
        parse(path, bytes).map(|_| ())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Metadata keys in file order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.metadata.iter().map(|(k, _)| k.as_str())
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub(super) fn field_error(&self, key: &str, msg: impl std::fmt::Display) -> Error {
        Error::bad_file(&self.path, format!("GGUF metadata `{key}`: {msg}"))
    }

    /// An unsigned integer value (any integer type, non-negative).
    pub fn uint(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Uint(v)) => Ok(Some(*v)),
            Some(Value::Int(v)) if *v >= 0 => Ok(Some(*v as u64)),
            Some(other) => Err(self.field_error(
                key,
                format!("expected an unsigned integer, found {other:?}"),
            )),
        }
    }

    /// A number (integer or float).
    pub fn float(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Float(v)) => Ok(Some(*v)),
            Some(Value::Uint(v)) => Ok(Some(*v as f64)),
            Some(Value::Int(v)) => Ok(Some(*v as f64)),
            Some(other) => {
                Err(self.field_error(key, format!("expected a number, found {other:?}")))
            }
        }
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(v)) => Ok(Some(*v)),
            Some(other) => Err(self.field_error(key, format!("expected a bool, found {other:?}"))),
        }
    }

    pub fn string(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(v)) => Ok(Some(v)),
            Some(other) => {
                Err(self.field_error(key, format!("expected a string, found {other:?}")))
            }
        }
    }

    fn array(&self, key: &str) -> Result<Option<(ValueType, usize, &[u8])>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array { elem, count, bytes }) => {
                Ok(Some((*elem, *count, &self.map[bytes.clone()])))
            }
            Some(other) => {
                Err(self.field_error(key, format!("expected an array, found {other:?}")))
            }
        }
    }

    /// An array of strings.
    pub fn strings(&self, key: &str) -> Result<Option<Vec<String>>> {
        let Some((elem, count, bytes)) = self.array(key)? else {
            return Ok(None);
        };
        if elem != ValueType::String {
            return Err(self.field_error(key, format!("expected strings, found {elem:?} values")));
        }
        let mut c = Cursor {
            bytes,
            at: 0,
            path: &self.path,
        };
        (0..count)
            .map(|_| c.string(key))
            .collect::<Result<_>>()
            .map(Some)
    }

    /// An array of integers (any integer or bool type).
    pub fn ints(&self, key: &str) -> Result<Option<Vec<i64>>> {
        self.numbers(key, |v| match v {
            Value::Int(i) => Some(i),
            Value::Uint(u) => i64::try_from(u).ok(),
            Value::Bool(b) => Some(b as i64),
            _ => None,
        })
    }

    /// An array of numbers.
    pub fn floats(&self, key: &str) -> Result<Option<Vec<f64>>> {
        self.numbers(key, |v| match v {
            Value::Int(i) => Some(i as f64),
            Value::Uint(u) => Some(u as f64),
            Value::Float(f) => Some(f),
            _ => None,
        })
    }

    fn numbers<T>(
        &self,
        key: &str,
        convert: impl Fn(Value) -> Option<T>,
    ) -> Result<Option<Vec<T>>> {
        let Some((elem, count, bytes)) = self.array(key)? else {
            return Ok(None);
        };
        if elem == ValueType::String {
            return Err(self.field_error(key, "expected numbers, found strings"));
        }
        let mut c = Cursor {
            bytes,
            at: 0,
            path: &self.path,
        };
        (0..count)
            .map(|_| {
                let v = c.scalar(elem, key)?;
                convert(v)
                    .ok_or_else(|| self.field_error(key, format!("{elem:?} values out of range")))
            })
            .collect::<Result<_>>()
            .map(Some)
    }

    /// The tensors, in file order.
    pub fn tensors(&self) -> &[GgufTensor] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Appends `len` values of a tensor from element `start` (row-major,
    /// `dims[0]` fastest), dequantized; quantized types need whole blocks.
    pub fn read_elements(
        &self,
        t: &GgufTensor,
        start: usize,
        len: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let bs = t.ggml_type.block_size();
        let end = start.checked_add(len).filter(|&e| e <= t.elements());
        if end.is_none() || !start.is_multiple_of(bs) || !len.is_multiple_of(bs) {
            return Err(Error::tensor(
                &self.path,
                &t.name,
                format!(
                    "elements {start}..+{len} asked of {} {} values (blocks of {bs})",
                    t.elements(),
                    t.ggml_type.name()
                ),
            ));
        }
        let bb = t.ggml_type.block_bytes();
        let from = t.start + start / bs * bb;
        t.ggml_type
            .dequantize(&self.map[from..from + len / bs * bb], out);
        Ok(())
    }

    /// A whole tensor's values, dequantized.
    pub fn read_tensor(&self, name: &str) -> Result<Vec<f32>> {
        let t = self
            .tensor(name)
            .ok_or_else(|| Error::tensor(&self.path, name, "no such tensor in the file"))?;
        let mut out = Vec::with_capacity(t.elements());
        self.read_elements(t, 0, t.elements(), &mut out)?;
        Ok(out)
    }
}
