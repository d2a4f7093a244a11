//! GGUF input: not read yet.

use std::path::{Path, PathBuf};

use super::TensorSource;
use super::plan::CheckpointIndex;
use crate::error::{Error, Result};

pub(crate) struct Opened {
    pub files: Vec<PathBuf>,
    pub source: Box<dyn TensorSource>,
    pub index: CheckpointIndex,
    pub config_json: serde_json::Value,
    pub side_files: Vec<(String, Vec<u8>)>,
}

/// The GGUF files `input` names; `None` when it is no GGUF input.
pub(crate) fn input_files(_input: &Path) -> Result<Option<Vec<PathBuf>>> {
    Ok(None)
}

pub(crate) fn open(files: &[PathBuf]) -> Result<Opened> {
    Err(Error::bad_file(
        &files[0],
        "GGUF input is not supported yet",
    ))
}
