//! The bundled default model (bundled/qwen35-tiny: a small Qwen3.5-MoE
//! trained on Jane Austen's novels). Its checkpoint is compiled into the
//! binary, so `moeflux generate` and `moeflux chat` work without `-m` on a
//! machine with nothing downloaded; on first use it is converted (bf16)
//! into the cache directory.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use moeflux::convert::{ConvertOptions, convert};
use moeflux::quant::DType;

use crate::commands::convert::progress_bar;

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

const FILES: &[(&str, &[u8])] = &[
    bundled_file!("config.json"),
    bundled_file!("generation_config.json"),
    bundled_file!("model.safetensors"),
    bundled_file!("tokenizer.json"),
    bundled_file!("tokenizer_config.json"),
];

/// The converted bundled model, converting it on first use. The directory
/// name carries a hash of the embedded files, so a newer build never picks
/// up an older conversion.
pub fn default_model_dir(quiet: bool) -> Result<PathBuf> {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    for (name, bytes) in FILES {
        hasher.update(name.as_bytes());
        hasher.update(bytes);
    }
    let root = moeflux::util::cache_dir();
    let dir = root.join(format!("qwen35-tiny-bf16-{:016x}", hasher.digest()));
    if dir.join("manifest.json").is_file() {
        return Ok(dir);
    }
    if !quiet {
        eprintln!(
            "moeflux: no -m given: converting the bundled model (qwen35-tiny) into {} (first use only)",
            dir.display()
        );
    }
    let source = root.join(format!(".qwen35-tiny-checkpoint-{}", std::process::id()));
    let result = unpack_and_convert(&source, &dir);
    let _ = std::fs::remove_dir_all(&source);
    match result {
        Ok(()) => Ok(dir),
        // Another moeflux converted it at the same time.
        Err(_) if dir.join("manifest.json").is_file() => Ok(dir),
        Err(e) => Err(e),
    }
}

fn unpack_and_convert(source: &Path, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(source).with_context(|| format!("creating {}", source.display()))?;
    for (name, bytes) in FILES {
        let path = source.join(name);
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
    }
    let options = ConvertOptions {
        quant: DType::Bf16,
        overwrite: false,
    };
    convert(source, dir, &options, &progress_bar())?;
    Ok(())
}
