//! GGUF input (llama.cpp's format): a single file or split
//! `NAME-00001-of-0000N.gguf` files.
//!
//! [`GgufFile`] parses one file's header defensively: every count and
//! length is bounded by the bytes left in the file before anything is
//! allocated, offsets and sizes use checked arithmetic, tensor data must lie
//! inside the data section, aligned, without overlapping; a malformed file
//! gives an error naming the file and the field, never a panic. Metadata
//! arrays are not copied while parsing; they are decoded when asked for.
//!
//! Conversion maps a GGUF of a family moeflux implements (`qwen3moe`,
//! `qwen3next`, `qwen35moe`) back to the Hugging Face checkpoint the
//! architecture plans read (`arch.rs`: the configuration rebuilt from the
//! metadata, tensor names and layouts mapped back), rebuilds the tokenizer
//! and chat template (`tokenizer.rs`), and dequantizes each tensor exactly
//! as ggml does (`quants.rs`).

mod arch;
mod quants;
mod tokenizer;

use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

pub use quants::GgmlType;

use super::TensorSource;
use super::plan::CheckpointIndex;
use super::view::{Store, Views};
use crate::error::{Error, Result};

const MAGIC: &[u8; 4] = b"GGUF";
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
/// by [`GgufFile::strings`], [`GgufFile::ints`] and [`GgufFile::floats`].
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

/// One GGUF file, memory-mapped, its header parsed and checked.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    version: u32,
    metadata: Vec<(String, Value)>,
    tensors: Vec<GgufTensor>,
}

/// Reads the header of a GGUF file from a byte buffer.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a Path,
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

    fn string(&mut self, what: &str) -> Result<String> {
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

    fn scalar(&mut self, t: ValueType, what: &str) -> Result<Value> {
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

    fn field_error(&self, key: &str, msg: impl std::fmt::Display) -> Error {
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

type Parsed = (u32, Vec<(String, Value)>, Vec<GgufTensor>);

fn parse(path: &Path, bytes: &[u8]) -> Result<Parsed> {
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
    fn open(paths: &[PathBuf]) -> Result<GgufStore> {
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
    fn meta(&self) -> &GgufFile {
        &self.files[0]
    }

    fn get(&self, name: &str) -> Option<&GgufTensor> {
        let &(f, i) = self.tensors.get(name)?;
        Some(&self.files[f].tensors[i])
    }

    fn file_of(&self, name: &str) -> usize {
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

/// The files a conversion writes for a GGUF file's tokenizer metadata.
#[derive(Clone, Debug, Default)]
pub struct TokenizerFiles {
    /// `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`
    /// and their contents; none when the tokenizer cannot be rebuilt.
    pub files: Vec<(String, Vec<u8>)>,
    /// What could not be rebuilt, and why.
    pub notes: Vec<String>,
}

/// The tokenizer files of a GGUF file (a vocabulary-only GGUF works too).
pub fn rebuild_tokenizer(file: &GgufFile) -> Result<TokenizerFiles> {
    tokenizer::side_files(file, &serde_json::json!({}))
}

/// A GGUF input opened for conversion.
pub(crate) struct Opened {
    pub files: Vec<PathBuf>,
    pub source: Box<dyn TensorSource>,
    pub index: CheckpointIndex,
    pub config_json: serde_json::Value,
    /// tokenizer.json, tokenizer_config.json, generation_config.json.
    pub side_files: Vec<(String, Vec<u8>)>,
}

pub(crate) fn open(files: &[PathBuf]) -> Result<Opened> {
    let store = GgufStore::open(files)?;
    let mapped = arch::map(&store)?;
    let TokenizerFiles {
        files: side_files,
        notes,
    } = tokenizer::side_files(store.meta(), &mapped.config_json)?;
    let dir = files[0].parent().unwrap_or(Path::new(".")).to_path_buf();
    let views = Views::new(store, mapped.views, &files[0]);
    for line in notes {
        views.notes.say(line);
    }
    let mut index = views.index(files.to_vec(), |t| views.store.file_of(t));
    index.dir = dir;
    Ok(Opened {
        files: files.to_vec(),
        source: Box::new(views),
        index,
        config_json: mapped.config_json,
        side_files,
    })
}
