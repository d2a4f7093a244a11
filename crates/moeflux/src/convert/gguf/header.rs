//! A GGUF file's header: its metadata values and tensor infos, parsed
//! defensively from the bytes.

use std::ops::Range;
use std::path::Path;

use super::GgmlType;
use crate::error::{Error, Result};

pub(super) const MAGIC: &[u8; 4] = b"GGUF";
/// ggml's limit on tensor dimensions.
const MAX_DIMS: usize = 4;
/// `general.alignment` when absent.
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value's type, as GGUF numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Bytes of a fixed-size value; strings are at least their 8-byte
    /// length.
    fn min_size(self) -> usize {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// A metadata value. Arrays keep their place in the file and are decoded
/// by [`GgufFile::strings`](super::GgufFile::strings), [`GgufFile::ints`](super::GgufFile::ints) and [`GgufFile::floats`](super::GgufFile::floats).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Int(i64),
    Uint(u64),
    Float(f64),
    Bool(bool),
    String(String),
    Array {
        elem: ValueType,
        count: usize,
        bytes: Range<usize>,
    },
}

/// A tensor as the file lists it.
#[derive(Clone, Debug)]
pub struct GgufTensor {
    pub name: String,
    /// ggml's `ne`: the fastest-varying dimension first (a Hugging Face
    /// `[rows, cols]` matrix is `[cols, rows]`).
    pub dims: Vec<usize>,
    pub ggml_type: GgmlType,
    /// Bytes from the start of the file.
    pub start: usize,
    pub nbytes: usize,
}

impl GgufTensor {
    pub fn elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// The shape a Hugging Face checkpoint gives this tensor.
    pub fn hf_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

/// Reads the header of a GGUF file from a byte buffer.
pub(super) struct Cursor<'a> {
    pub(super) bytes: &'a [u8],
    pub(super) at: usize,
    pub(super) path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn error(&self, what: &str, msg: impl std::fmt::Display) -> Error {
        Error::bad_file(
            self.path,
            format!("GGUF {what} (at byte {}): {msg}", self.at),
        )
    }

    fn left(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(self.error(
                what,
                format!(
                    "needs {n} bytes but the file ends {} bytes later; it is truncated",
                    self.left()
                ),
            ));
        }
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }

    /// A count of items of at least `min_size` bytes each, bounded by the
    /// bytes left in the file.
    fn count(&mut self, what: &str, min_size: usize) -> Result<usize> {
        let n = self.u64(what)?;
        let fits = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(min_size).map(|bytes| (n, bytes)))
            .filter(|&(_, bytes)| bytes <= self.left());
        match fits {
            Some((n, _)) => Ok(n),
            None => Err(self.error(
                what,
                format!(
                    "{n} items of at least {min_size} bytes cannot fit in the {} bytes left in \
                     the file",
                    self.left()
                ),
            )),
        }
    }

    pub(super) fn string(&mut self, what: &str) -> Result<String> {
        let len = self.count(what, 1)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| self.error(what, "the string is not valid UTF-8"))
    }

    /// Skips a string, returning nothing (array elements).
    fn skip_string(&mut self, what: &str) -> Result<()> {
        let len = self.count(what, 1)?;
        self.take(len, what).map(|_| ())
    }

    fn value_type(&mut self, what: &str) -> Result<ValueType> {
        let id = self.u32(what)?;
        ValueType::from_id(id).ok_or_else(|| {
            self.error(
                what,
                format!("unknown value type {id} (GGUF defines 0 to 12)"),
            )
        })
    }

    pub(super) fn scalar(&mut self, t: ValueType, what: &str) -> Result<Value> {
        use ValueType::*;
        let b = self.take(t.min_size(), what)?;
        Ok(match t {
            U8 => Value::Uint(b[0] as u64),
            I8 => Value::Int(b[0] as i8 as i64),
            U16 => Value::Uint(u16::from_le_bytes([b[0], b[1]]) as u64),
            I16 => Value::Int(i16::from_le_bytes([b[0], b[1]]) as i64),
            U32 => Value::Uint(u32::from_le_bytes(b.try_into().unwrap()) as u64),
            I32 => Value::Int(i32::from_le_bytes(b.try_into().unwrap()) as i64),
            F32 => Value::Float(f32::from_le_bytes(b.try_into().unwrap()) as f64),
            Bool => match b[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                other => return Err(self.error(what, format!("bool value {other} is not 0 or 1"))),
            },
            U64 => Value::Uint(u64::from_le_bytes(b.try_into().unwrap())),
            I64 => Value::Int(i64::from_le_bytes(b.try_into().unwrap())),
            F64 => Value::Float(f64::from_le_bytes(b.try_into().unwrap())),
            String | Array => unreachable!("not scalars"),
        })
    }

    fn value(&mut self, what: &str) -> Result<Value> {
        let t = self.value_type(what)?;
        match t {
            ValueType::String => Ok(Value::String(self.string(what)?)),
            ValueType::Array => {
                let elem = self.value_type(what)?;
                if elem == ValueType::Array {
                    return Err(self.error(what, "arrays of arrays are not supported"));
                }
                let count = self.count(what, elem.min_size())?;
                let start = self.at;
                if elem == ValueType::String {
                    for _ in 0..count {
                        self.skip_string(what)?;
                    }
                } else {
                    // `count` fits the bytes left: checked above.
                    self.take(count * elem.min_size(), what)?;
                }
                Ok(Value::Array {
                    elem,
                    count,
                    bytes: start..self.at,
                })
            }
            scalar => self.scalar(scalar, what),
        }
    }
}

type Parsed = (u32, Vec<(String, Value)>, Vec<GgufTensor>);

pub(super) fn parse(path: &Path, bytes: &[u8]) -> Result<Parsed> {
    let mut c = Cursor { bytes, at: 0, path };
    if c.take(4, "magic")? != MAGIC {
        return Err(Error::bad_file(
            path,
            "not a GGUF file (it does not start with `GGUF`)",
        ));
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        let hint = if (2..=3).contains(&version.swap_bytes()) {
            "; this is a big-endian GGUF, and moeflux reads little-endian ones"
        } else {
            ""
        };
        return Err(c.error(
            "version",
            format!("version {version} is not supported (GGUF 2 and 3 are){hint}"),
        ));
    }
    // A tensor info is at least a name length, one dimension, a type and
    // an offset; a metadata entry a key length, a type and a value.
    let tensor_count = c.count("tensor_count", 8 + 4 + 8 + 4 + 8)?;
    let kv_count = c.count("metadata_kv_count", 8 + 4 + 1)?;
    let mut metadata: Vec<(String, Value)> = Vec::new();
    for i in 0..kv_count {
        let key = c.string(&format!("metadata key {i}"))?;
        let value = c.value(&format!("metadata `{key}`"))?;
        if metadata.iter().any(|(k, _)| *k == key) {
            return Err(c.error(&format!("metadata `{key}`"), "the key appears twice"));
        }
        metadata.push((key, value));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, Value::Uint(a))) if *a > 0 && a.is_power_of_two() && *a <= 1 << 20 => *a,
        Some((_, v)) => {
            return Err(Error::bad_file(
                path,
                format!(
                    "GGUF metadata `general.alignment`: {v:?} is not a power of two up to 1 MiB"
                ),
            ));
        }
    } as usize;
    let mut infos = Vec::with_capacity(tensor_count);
    for i in 0..tensor_count {
        let name = c.string(&format!("tensor {i} name"))?;
        let what = format!("tensor `{name}`");
        let n_dims = c.u32(&format!("{what} n_dims"))? as usize;
        if !(1..=MAX_DIMS).contains(&n_dims) {
            return Err(c.error(
                &format!("{what} n_dims"),
                format!("{n_dims} dimensions (1 to {MAX_DIMS} allowed)"),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims);
        for d in 0..n_dims {
            let n = c.u64(&format!("{what} dimension {d}"))?;
            match usize::try_from(n).ok().filter(|&n| n > 0) {
                Some(n) => dims.push(n),
                None => {
                    return Err(c.error(
                        &format!("{what} dimension {d}"),
                        format!("{n} is not a usable size"),
                    ));
                }
            }
        }
        let type_id = c.u32(&format!("{what} type"))?;
        let ggml_type =
            GgmlType::from_id(type_id).map_err(|msg| c.error(&format!("{what} type"), msg))?;
        let offset = c.u64(&format!("{what} offset"))?;
        infos.push((name, dims, ggml_type, offset));
    }
    let data_start = c.at.div_ceil(alignment) * alignment;
    let data_len = bytes.len().saturating_sub(data_start);
    let mut tensors: Vec<GgufTensor> = Vec::with_capacity(infos.len());
    let mut names = std::collections::HashSet::new();
    for (name, dims, ggml_type, offset) in infos {
        let err = |msg: String| Error::bad_file(path, format!("GGUF tensor `{name}`: {msg}"));
        if !names.insert(name.clone()) {
            return Err(err("the name appears twice".into()));
        }
        let elements = dims
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| err(format!("dimensions {dims:?} overflow")))?;
        let bs = ggml_type.block_size();
        if !dims[0].is_multiple_of(bs) {
            return Err(err(format!(
                "its rows of {} values are not whole {} blocks of {bs}",
                dims[0],
                ggml_type.name()
            )));
        }
        let nbytes = (elements / bs)
            .checked_mul(ggml_type.block_bytes())
            .ok_or_else(|| err("its size overflows".into()))?;
        let offset =
            usize::try_from(offset).map_err(|_| err(format!("offset {offset} is out of range")))?;
        if !offset.is_multiple_of(alignment) {
            return Err(err(format!(
                "offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        if offset.checked_add(nbytes).is_none_or(|end| end > data_len) {
            return Err(err(format!(
                "its {nbytes} bytes at offset {offset} run past the end of the data section \
                 ({data_len} bytes); the file is truncated or damaged"
            )));
        }
        tensors.push(GgufTensor {
            name,
            dims,
            ggml_type,
            start: data_start + offset,
            nbytes,
        });
    }
    let mut by_start: Vec<&GgufTensor> = tensors.iter().collect();
    by_start.sort_by_key(|t| t.start);
    for pair in by_start.windows(2) {
        if pair[0].start + pair[0].nbytes > pair[1].start {
            return Err(Error::bad_file(
                path,
                format!(
                    "GGUF tensors `{}` and `{}` overlap in the data section",
                    pair[0].name, pair[1].name
                ),
            ));
        }
    }
    Ok((version, metadata, tensors))
}
