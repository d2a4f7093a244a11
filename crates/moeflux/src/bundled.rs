//! The bundled default model, `qwen35-tiny`: a small Qwen3.5-MoE trained
//! on Jane Austen's novels (bundled/qwen35-tiny/README.md). Its checkpoint
//! is compiled into the library, so a program using moeflux has a real
//! model to run on a machine with nothing downloaded; on first use it is
//! converted (bf16) into the cache directory ([`crate::util::cache_dir`]).
//!
//! Any number of processes may ask for it at once: one converts, the
//! others wait for it and use its result.
//!
//! ```
//! use std::sync::Arc;
//! use moeflux::{Model, ModelOptions};
//!
//! let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
//! let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
//! let new = model.generate_greedy(&[1, 2, 3], 3)?;
//! assert_eq!(new.len(), 3);
//! # Ok::<(), moeflux::Error>(())
//! ```

use std::path::PathBuf;

use crate::convert::{ConvertOptions, OutputLock, SOURCE, convert_locked};
use crate::error::{Error, Result};
use crate::format::MANIFEST_FILE;
use crate::quant::DType;
use crate::util::Progress;

/// The bundled model's name.
pub const NAME: &str = "qwen35-tiny";

macro_rules! bundled_file {
    ($name:literal) => {
        (
            $name,
            include_bytes!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../bundled/qwen35-tiny/",
                $name
            )) as &[u8],
        )
    };
}

/// The checkpoint's files, as compiled in.
const FILES: &[(&str, &[u8])] = &[
    bundled_file!("config.json"),
    bundled_file!("generation_config.json"),
    bundled_file!("model.safetensors"),
    bundled_file!("tokenizer.json"),
    bundled_file!("tokenizer_config.json"),
];

/// Where the converted bundled model lives. The folder's name carries a
/// hash of the embedded files, so a newer build never picks up an older
/// conversion.
pub fn cached_dir() -> PathBuf {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    for (name, bytes) in FILES {
        hasher.update(name.as_bytes());
        hasher.update(bytes);
    }
    crate::util::cache_dir().join(format!("{NAME}-bf16-{:016x}", hasher.digest()))
}

/// The converted bundled model's directory, converting it first if no
/// process has yet. `progress` shows the conversion and receives a note
/// when it starts or has to wait for another process.
///
/// ```
/// let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
/// assert_eq!(dir, moeflux::bundled::cached_dir());
/// assert!(dir.join("tokenizer.json").is_file());
/// # Ok::<(), moeflux::Error>(())
/// ```
pub fn model_dir(progress: &dyn Progress) -> Result<PathBuf> {
    let dir = cached_dir();
    let ready = || dir.join(MANIFEST_FILE).is_file();
    if ready() {
        return Ok(dir);
    }
    let mut lock = OutputLock::acquire(&dir, None, &|_| {
        progress.note("another moeflux process is converting the bundled model: waiting for it")
    })?;
    if ready() {
        return Ok(dir);
    }
    progress.note(&format!(
        "converting the bundled model ({NAME}) into {} (first use only)",
        dir.display()
    ));
    let source = lock.side_folder(SOURCE)?;
    for (name, bytes) in FILES {
        let path = source.path.join(name);
        std::fs::write(&path, bytes).map_err(|e| Error::io(&path, "writing", e))?;
    }
    let options = ConvertOptions {
        quant: DType::Bf16,
        ..ConvertOptions::default()
    };
    convert_locked(&mut lock, &source.path, &options, progress)?;
    Ok(dir)
}
