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
mod file;
mod header;
mod quants;
mod store;
mod tokenizer;

use std::path::{Path, PathBuf};

pub use file::GgufFile;
pub use header::{GgufTensor, Value, ValueType};
pub use quants::GgmlType;
pub(crate) use store::input_files;

use super::TensorSource;
use super::plan::CheckpointIndex;
use super::view::Views;
use crate::error::Result;
use store::GgufStore;

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
