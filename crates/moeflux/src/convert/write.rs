//! Writing a model directory: staged beside the output, the weights, side
//! files and manifest written, verified by opening it as a reader would,
//! then renamed into place.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use super::output::{self, OutputLock, is_model_dir};
use super::plan::ConversionPlan;
use super::precision::Dtypes;
use super::weights::{write_dense, write_expert_layer};
use super::{ConvertOptions, ConvertSummary, TensorSource};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::format::manifest::{FORMAT_NAME, FORMAT_VERSION, FileEntry};
use crate::format::{COPIED_FILES, DENSE_FILE, MANIFEST_FILE, Manifest, ModelDir, OpenOptions};
use crate::quant::{DType, GROUP_SIZE};
use crate::util::{Progress, hex64};

/// The files of a model directory besides its weights: copied from a
/// checkpoint folder, or written by the conversion (a synthetic model's
/// placeholder tokenizer among them).
pub(crate) struct SideFiles<'a> {
    pub dir: Option<&'a Path>,
    pub generated: &'a [(String, Vec<u8>)],
    /// Random weights, not a checkpoint's (recorded in the manifest).
    pub synthetic: bool,
}

/// Writes a model directory from a plan and a source of weights in one
/// precision, staged and verified.
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_model(
    source: &dyn TensorSource,
    plan: ConversionPlan,
    config_json: serde_json::Value,
    config: ModelConfig,
    side: &SideFiles<'_>,
    output: &Path,
    options: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertSummary> {
    let dtypes = Dtypes::recipe(&plan, options);
    write_model_with(
        source,
        plan,
        config_json,
        config,
        side,
        &dtypes,
        output,
        options,
        progress,
    )
}

/// [`write_model`] with a precision per matrix.
#[allow(clippy::too_many_arguments)]
pub(super) fn write_model_with(
    source: &dyn TensorSource,
    plan: ConversionPlan,
    config_json: serde_json::Value,
    config: ModelConfig,
    side_files: &SideFiles<'_>,
    dtypes: &Dtypes,
    output: &Path,
    options: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertSummary> {
    options.check()?;
    output::check_output(output, options.overwrite)?;
    let existed = output.exists();
    let mut lock = OutputLock::acquire(output, options.cancel.as_deref(), &|o| {
        progress.note(&format!(
            "another moeflux process is writing {}: waiting for it to finish",
            o.display()
        ))
    })?;
    if !existed && !lock.restored() && is_model_dir(output) {
        return converted_meanwhile(
            output,
            &config_json,
            dtypes.label,
            side_files.synthetic,
            plan,
            config,
        );
    }
    write_model_locked(
        &mut lock,
        source,
        plan,
        config_json,
        config,
        side_files,
        dtypes,
        options,
        progress,
    )
}

/// [`write_model`] for a caller that holds the output's lock.
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_model_locked(
    lock: &mut OutputLock,
    source: &dyn TensorSource,
    plan: ConversionPlan,
    config_json: serde_json::Value,
    config: ModelConfig,
    side_files: &SideFiles<'_>,
    dtypes: &Dtypes,
    options: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertSummary> {
    output::check_output(lock.output(), options.overwrite)?;
    let staging = lock.side_folder(output::STAGING)?;
    progress.start(total_weights(&plan));
    let mut manifest = Manifest {
        format: FORMAT_NAME.into(),
        version: FORMAT_VERSION,
        producer: format!("moeflux {}", env!("CARGO_PKG_VERSION")),
        synthetic: side_files.synthetic,
        quantization: dtypes.label,
        group_size: GROUP_SIZE,
        config: config_json,
        files: Vec::new(),
        tensors: Default::default(),
        experts: Vec::new(),
    };
    write_dense(
        source,
        &plan.dense,
        &dtypes.dense,
        options,
        &staging.path,
        &mut manifest,
        progress,
    )?;
    let mut expert_files = Vec::with_capacity(plan.experts.len());
    for (layer, quant) in plan.experts.iter().zip(&dtypes.experts) {
        let (entry, file) =
            write_expert_layer(source, layer, *quant, options, &staging.path, progress)?;
        manifest.experts.push(entry);
        expert_files.push(file);
    }
    progress.finish();
    let notes = source.notes();
    for line in &notes {
        progress.note(line);
    }
    write_side_files(side_files, &staging.path)?;
    record_files(&staging.path, expert_files, &mut manifest)?;
    write_atomic(
        &staging.path.join(MANIFEST_FILE),
        manifest.to_json().as_bytes(),
    )?;
    // Open the staged directory as a reader would: this checks the manifest
    // against the files, every size and the dense checksum.
    let opened = ModelDir::open(
        &staging.path,
        OpenOptions {
            verify_checksums: true,
            mtp_head: true,
        },
    )?;
    // As opened: with a multi-token-prediction layer only if one was kept.
    let config = ModelConfig {
        mtp: opened.config().mtp.clone(),
        ..config
    };
    drop(opened);
    lock.commit(staging, options.overwrite)?;
    Ok(ConvertSummary {
        tensors: manifest.tensors.len(),
        moe_layers: manifest.experts.len(),
        dense_bytes: manifest.dense_bytes(),
        expert_bytes: manifest.expert_bytes(),
        skipped: plan.skipped,
        unknown: plan.unknown,
        notes,
        config,
    })
}

fn total_weights(plan: &ConversionPlan) -> u64 {
    let dense: usize = plan.dense.iter().map(|t| t.rows * t.cols).sum();
    let experts: usize = plan
        .experts
        .iter()
        .map(|l| l.num_experts * 3 * l.hidden * l.intermediate)
        .sum();
    (dense + experts) as u64
}

fn write_side_files(side: &SideFiles<'_>, dir: &Path) -> Result<()> {
    for (name, bytes) in side.generated {
        debug_assert!(COPIED_FILES.contains(&name.as_str()));
        let to = dir.join(name);
        std::fs::write(&to, bytes).map_err(|e| Error::io(&to, "writing", e))?;
    }
    let Some(input) = side.dir else {
        return Ok(());
    };
    for name in COPIED_FILES {
        let from = input.join(name);
        if from.is_file() && !side.generated.iter().any(|(n, _)| n == name) {
            let to = dir.join(name);
            std::fs::copy(&from, &to).map_err(|e| Error::io(&from, "copying", e))?;
        }
    }
    Ok(())
}

/// Lists every file of the directory in the manifest with its size and
/// checksum (the expert files were hashed while being verified).
fn record_files(dir: &Path, expert_files: Vec<FileEntry>, manifest: &mut Manifest) -> Result<()> {
    let mut paths: Vec<String> = vec![DENSE_FILE.into()];
    paths.extend(
        COPIED_FILES
            .iter()
            .filter(|n| dir.join(n).is_file())
            .map(|n| n.to_string()),
    );
    manifest.files = paths
        .into_iter()
        .map(|rel| {
            let (size, hash) = hash_file(&dir.join(&rel))?;
            Ok(FileEntry {
                path: rel,
                size,
                xxh3: hex64(hash),
            })
        })
        .collect::<Result<_>>()?;
    manifest.files.extend(expert_files);
    Ok(())
}

/// Size and xxHash3-64 of a file, read in a streaming fashion.
pub fn hash_file(path: &Path) -> Result<(u64, u64)> {
    let mut file = File::open(path).map_err(|e| Error::io(path, "opening", e))?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 8 << 20];
    let mut size = 0u64;
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| Error::io(path, "reading", e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((size, hasher.digest()))
}

/// Writes a file through a temporary name and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(&tmp, "writing", e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, "renaming into place", e))
}

/// The summary of a model another process converted into `output` while
/// this one waited for the lock, provided it is the model this one would
/// have written.
fn converted_meanwhile(
    output: &Path,
    config_json: &serde_json::Value,
    quant: DType,
    synthetic: bool,
    plan: ConversionPlan,
    config: ModelConfig,
) -> Result<ConvertSummary> {
    let manifest = Manifest::read(&output.join(MANIFEST_FILE))?;
    if manifest.config != *config_json
        || manifest.quantization != quant
        || manifest.synthetic != synthetic
    {
        return Err(Error::bad_file(
            output,
            "another moeflux process wrote a different model here while this one waited; \
             choose another output, or pass --force to replace it",
        ));
    }
    ModelDir::open(
        output,
        OpenOptions {
            verify_checksums: false,
            mtp_head: true,
        },
    )?;
    Ok(ConvertSummary {
        tensors: manifest.tensors.len(),
        moe_layers: manifest.experts.len(),
        dense_bytes: manifest.dense_bytes(),
        expert_bytes: manifest.expert_bytes(),
        skipped: plan.skipped,
        unknown: plan.unknown,
        notes: Vec::new(),
        config,
    })
}
