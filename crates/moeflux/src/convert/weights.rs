//! The weight files: the dense file and one file of experts per layer,
//! encoded in parallel and written in order; each expert file is read back
//! and checked.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use rayon::prelude::*;

use super::plan::{
    ColumnPick, DenseTensorPlan, ExpertLayerPlan, ExpertMatrix, RowSource, TensorRole,
};
use super::precision::storage_dtype;
use super::{ConvertOptions, TensorSource};
use crate::error::{Error, Result};
use crate::format::manifest::FileEntry;
use crate::format::{
    BlobMatrix, DENSE_FILE, EXPERT_ALIGN, ExpertBlobLayout, ExpertLayerEntry, Manifest,
    TensorEntry, expert_file_name,
};
use crate::quant::{ALIGN, DType, EncodedRows, GROUP_SIZE, MatrixLayout, RowEncoder, align_up};
use crate::util::{Progress, hex64, parse_hex64};

/// Rows `[start, end)` of a canonical tensor assembled from its sources.
fn gather_rows(
    ckpt: &dyn TensorSource,
    sources: &[RowSource],
    start: usize,
    end: usize,
    out: &mut Vec<f32>,
) -> Result<()> {
    for part in slice_sources(sources, start, end) {
        ckpt.read_rows(&part, out)?;
    }
    Ok(())
}

/// Values converted per block of a large tensor (64 MiB of f32).
const BLOCK_VALUES: usize = 16 << 20;

/// The parts of `sources` that make rows `[start, end)` of the tensor they
/// assemble.
fn slice_sources(sources: &[RowSource], start: usize, end: usize) -> Vec<RowSource> {
    let mut parts = Vec::new();
    let mut base = 0;
    for src in sources {
        let (lo, hi) = (start.max(base), end.min(base + src.rows));
        if lo < hi {
            parts.push(RowSource {
                tensor: src.tensor.clone(),
                row_start: src.row_start + (lo - base),
                rows: hi - lo,
            });
        }
        base += src.rows;
    }
    parts
}

#[allow(clippy::too_many_arguments)]
pub(super) fn write_dense(
    ckpt: &dyn TensorSource,
    tensors: &[DenseTensorPlan],
    quants: &[DType],
    options: &ConvertOptions,
    dir: &Path,
    manifest: &mut Manifest,
    progress: &dyn Progress,
) -> Result<()> {
    let path = dir.join(DENSE_FILE);
    let file = File::create(&path).map_err(|e| Error::io(&path, "creating", e))?;
    let write = |bytes: &[u8], at: usize| {
        file.write_all_at(bytes, at as u64)
            .map_err(|e| Error::io(&path, "writing", e))
    };
    let mut cursor = 0usize;
    for (t, &quant) in tensors.iter().zip(quants) {
        let dtype = storage_dtype(t.role, t.cols, quant);
        let layout = MatrixLayout::new(dtype, t.rows, t.cols).expect("dtype chosen to fit");
        let encoder = RowEncoder::new(layout);
        let offset = align_up(cursor, ALIGN);
        let groups = if dtype.is_quantized() {
            t.cols / GROUP_SIZE
        } else {
            0
        };
        let block_rows = (BLOCK_VALUES / t.cols.max(1)).max(1);
        for start in (0..t.rows).step_by(block_rows) {
            options.check_cancel()?;
            let end = (start + block_rows).min(t.rows);
            // Gather and encode slices of the block in parallel, then write
            // them in order.
            let slice_rows = (end - start)
                .div_ceil(rayon::current_num_threads() * 4)
                .max(1);
            let slices: Vec<(usize, EncodedRows)> = (start..end)
                .step_by(slice_rows)
                .collect::<Vec<_>>()
                .into_par_iter()
                .map(|lo| {
                    let hi = (lo + slice_rows).min(end);
                    if let Some(enc) = ckpt.encoded_rows(&t.name, &layout, lo..hi) {
                        return Ok((lo, enc));
                    }
                    let mut values = Vec::with_capacity((hi - lo) * t.cols);
                    if let Some((pick, width)) = t.columns {
                        let mut rows = Vec::with_capacity((hi - lo) * width);
                        gather_rows(ckpt, &t.sources, lo, hi, &mut rows)?;
                        pick.apply(&rows, width, t.cols, &mut values);
                        return Ok((lo, encoder.encode(&values)));
                    }
                    if let Some(enc) =
                        ckpt.encoded_source_rows(&slice_sources(&t.sources, lo, hi), &layout)
                    {
                        return Ok((lo, enc?));
                    }
                    gather_rows(ckpt, &t.sources, lo, hi, &mut values)?;
                    Ok((lo, encoder.encode(&values)))
                })
                .collect::<Result<_>>()?;
            for (lo, enc) in slices {
                write(&enc.codes, offset + lo * layout.row_bytes)?;
                write(&enc.scales, offset + layout.scales_offset + lo * groups * 2)?;
                write(&enc.biases, offset + layout.biases_offset + lo * groups * 2)?;
            }
            progress.advance(((end - start) * t.cols) as u64, &t.name);
        }
        let shape = if t.is_vector && t.rows == 1 {
            vec![t.cols]
        } else {
            vec![t.rows, t.cols]
        };
        manifest.tensors.insert(
            t.name.clone(),
            TensorEntry {
                file: DENSE_FILE.into(),
                offset: offset as u64,
                nbytes: layout.total_bytes as u64,
                shape,
                dtype,
                role: Some(t.role),
            },
        );
        cursor = offset + layout.total_bytes;
    }
    file.set_len(cursor as u64)
        .map_err(|e| Error::io(&path, "sizing", e))?;
    file.sync_all().map_err(|e| Error::io(&path, "syncing", e))
}

/// Layout of each expert blob of a layer: gate | up | down, each on a
/// 64-byte boundary.
fn blob_layout(layer: &ExpertLayerPlan, quant: [DType; 3]) -> ExpertBlobLayout {
    let (h, i) = (layer.hidden, layer.intermediate);
    let matrix = |offset: usize, rows, cols, quant| {
        let dtype = storage_dtype(TensorRole::Matrix, cols, quant);
        BlobMatrix {
            offset: offset as u64,
            rows,
            cols,
            dtype,
        }
    };
    let size = |m: &BlobMatrix| m.layout().expect("dtype chosen to fit").total_bytes;
    let gate = matrix(0, i, h, quant[0]);
    let up = matrix(align_up(size(&gate), ALIGN), i, h, quant[1]);
    let down = matrix(
        align_up(up.offset as usize + size(&up), ALIGN),
        h,
        i,
        quant[2],
    );
    let nbytes = down.offset + size(&down) as u64;
    ExpertBlobLayout {
        nbytes,
        gate,
        up,
        down,
    }
}

/// The `rows × cols` matrix whose row `r` is column `pick.start +
/// r·pick.step` of `slice` (`cols` rows), appended to `out`.
fn read_across(slice: &[f32], cols: usize, pick: ColumnPick, rows: usize, out: &mut Vec<f32>) {
    let width = slice.len() / cols.max(1);
    out.reserve(rows * cols);
    for r in 0..rows {
        let column = pick.start + r * pick.step;
        out.extend((0..cols).map(|c| slice[c * width + column]));
    }
}

/// Experts encoded in parallel between sequential writes.
const EXPERT_BATCH: usize = 16;

pub(super) fn write_expert_layer(
    ckpt: &dyn TensorSource,
    layer: &ExpertLayerPlan,
    quant: [DType; 3],
    options: &ConvertOptions,
    dir: &Path,
    progress: &dyn Progress,
) -> Result<(ExpertLayerEntry, FileEntry)> {
    let blob = blob_layout(layer, quant);
    let stride = align_up(blob.nbytes as usize, EXPERT_ALIGN);
    let rel = expert_file_name(layer.layer);
    let path = dir.join(&rel);
    std::fs::create_dir_all(path.parent().unwrap())
        .map_err(|e| Error::io(&path, "creating folder", e))?;
    let file = File::create(&path).map_err(|e| Error::io(&path, "creating", e))?;
    file.set_len((stride * layer.num_experts) as u64)
        .map_err(|e| Error::io(&path, "sizing", e))?;
    let parts = [
        (&layer.gate, blob.gate),
        (&layer.up, blob.up),
        (&layer.down, blob.down),
    ];
    let encode_expert = |e: usize| -> Result<Vec<u8>> {
        let mut bytes = vec![0u8; blob.nbytes as usize];
        let mut values = Vec::new();
        for (name, (source, m)) in ["gate", "up", "down"].iter().zip(&parts) {
            let layout = m.layout().expect("dtype chosen to fit");
            let stored = format!("layers.{}.experts.{e}.{name}", layer.layer);
            let rows = source.source(e, m.rows);
            let encoded = match (ckpt.encoded_rows(&stored, &layout, 0..m.rows), source) {
                (Some(enc), _) => layout.assemble(&enc),
                (None, ExpertMatrix::Transposed { pick, .. }) => {
                    let mut slice = Vec::new();
                    ckpt.read_rows(&rows, &mut slice)?;
                    values.clear();
                    read_across(&slice, m.cols, *pick, m.rows, &mut values);
                    RowEncoder::new(layout).encode_matrix(&values)
                }
                (None, ExpertMatrix::InterleavedRows { pick, .. }) => {
                    let mut slice = Vec::new();
                    ckpt.read_rows(&rows, &mut slice)?;
                    values.clear();
                    for r in 0..m.rows {
                        let row = pick.start + r * pick.step;
                        values.extend_from_slice(&slice[row * m.cols..][..m.cols]);
                    }
                    RowEncoder::new(layout).encode_matrix(&values)
                }
                (None, _) => match ckpt.encoded_source_rows(std::slice::from_ref(&rows), &layout) {
                    Some(enc) => layout.assemble(&enc?),
                    None => {
                        values.clear();
                        ckpt.read_rows(&rows, &mut values)?;
                        RowEncoder::new(layout).encode_matrix(&values)
                    }
                },
            };
            bytes[m.offset as usize..][..encoded.len()].copy_from_slice(&encoded);
        }
        Ok(bytes)
    };
    let mut checksums = Vec::with_capacity(layer.num_experts);
    let what = format!("experts of layer {}", layer.layer);
    let per_expert = (3 * layer.hidden * layer.intermediate) as u64;
    for batch in (0..layer.num_experts)
        .collect::<Vec<_>>()
        .chunks(EXPERT_BATCH)
    {
        options.check_cancel()?;
        let blobs: Vec<Vec<u8>> = batch
            .par_iter()
            .map(|&e| encode_expert(e))
            .collect::<Result<_>>()?;
        for (&e, bytes) in batch.iter().zip(blobs) {
            file.write_all_at(&bytes, (e * stride) as u64)
                .map_err(|err| Error::io(&path, "writing", err))?;
            checksums.push(hex64(xxhash_rust::xxh3::xxh3_64(&bytes)));
            progress.advance(per_expert, &what);
        }
    }
    file.sync_all()
        .map_err(|e| Error::io(&path, "syncing", e))?;
    let entry = ExpertLayerEntry {
        layer: layer.layer,
        file: rel.clone(),
        num_experts: layer.num_experts,
        stride: stride as u64,
        blob,
        checksums,
    };
    let (size, hash) = verify_expert_file(&path, &entry)?;
    let file = FileEntry {
        path: rel,
        size,
        xxh3: hex64(hash),
    };
    Ok((entry, file))
}

/// Reads an expert file back, checking every blob against its checksum;
/// returns the file's size and hash.
fn verify_expert_file(path: &Path, entry: &ExpertLayerEntry) -> Result<(u64, u64)> {
    let file = File::open(path).map_err(|e| Error::io(path, "opening", e))?;
    let mut buf = vec![0u8; entry.stride as usize];
    let mut whole = xxhash_rust::xxh3::Xxh3::new();
    for (e, expected) in entry.checksums.iter().enumerate() {
        file.read_exact_at(&mut buf, e as u64 * entry.stride)
            .map_err(|err| Error::io(path, "reading back", err))?;
        whole.update(&buf);
        let expected = parse_hex64(expected).expect("written by hex64");
        let actual = xxhash_rust::xxh3::xxh3_64(&buf[..entry.blob.nbytes as usize]);
        if actual != expected {
            return Err(Error::Checksum {
                path: path.to_path_buf(),
                what: format!("expert {e} right after writing it (disk or memory fault?)"),
                expected,
                actual,
            });
        }
    }
    Ok((entry.stride * entry.num_experts as u64, whole.digest()))
}
