//! The expert store: routed experts stay on disk and are read on demand,
//! one positional read per expert, in parallel, into a bounded cache.

mod cache;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rayon::prelude::*;

pub use cache::{ExpertCache, ExpertKey};

use crate::error::{Error, Result};
use crate::format::{ExpertLayerEntry, ModelDir};
use crate::quant::{MatrixLayout, MatrixView};
use crate::util::{AlignedBuf, parse_hex64};

/// Layouts of the three matrices inside every blob of a layer.
#[derive(Debug)]
pub struct BlobLayout {
    pub nbytes: usize,
    pub gate: (usize, MatrixLayout),
    pub up: (usize, MatrixLayout),
    pub down: (usize, MatrixLayout),
}

/// One expert's weights, read from disk.
pub struct Expert {
    pub layer: usize,
    pub index: usize,
    layout: Arc<BlobLayout>,
    data: AlignedBuf,
}

impl Expert {
    fn view(&self, (offset, layout): (usize, MatrixLayout)) -> MatrixView<'_> {
        MatrixView::new(layout, &self.data[offset..offset + layout.total_bytes])
    }

    pub fn gate(&self) -> MatrixView<'_> {
        self.view(self.layout.gate)
    }

    pub fn up(&self) -> MatrixView<'_> {
        self.view(self.layout.up)
    }

    pub fn down(&self) -> MatrixView<'_> {
        self.view(self.layout.down)
    }

    pub fn size_bytes(&self) -> u64 {
        self.data.len() as u64
    }
}

struct LayerFile {
    path: PathBuf,
    file: File,
    stride: u64,
    checksums: Vec<u64>,
    layout: Arc<BlobLayout>,
}

/// Counters of the store's work since it was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpertStats {
    pub hits: u64,
    pub misses: u64,
    pub bytes_read: u64,
    pub read_nanos: u64,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    bytes_read: AtomicU64,
    read_nanos: AtomicU64,
}

/// Expert reads in flight at once: parallel positional reads keep the
/// disk's queue full (several times faster than one at a time).
pub const READ_PARALLELISM: usize = 8;

pub struct ExpertStore {
    layers: Vec<Option<LayerFile>>,
    /// Threads that only read, so blocking I/O never occupies the compute
    /// threads.
    io_pool: rayon::ThreadPool,
    cache: Mutex<ExpertCache>,
    counters: Counters,
}

impl ExpertStore {
    /// Opens every expert file of the model; reads no expert.
    pub fn open(dir: &ModelDir, cache_budget_bytes: u64) -> Result<ExpertStore> {
        let cfg = dir.config();
        let mut layers: Vec<Option<LayerFile>> = (0..cfg.num_layers()).map(|_| None).collect();
        for layer in cfg.moe_layers() {
            let entry = dir
                .manifest()
                .expert_layer(layer)
                .expect("validated by ModelDir::open");
            layers[layer] = Some(Self::open_layer(dir, entry)?);
        }
        let io_pool = rayon::ThreadPoolBuilder::new()
            .num_threads(READ_PARALLELISM)
            .thread_name(|i| format!("moeflux-io-{i}"))
            .build()
            .map_err(|e| Error::invalid("expert reader threads", e.to_string()))?;
        Ok(ExpertStore {
            layers,
            io_pool,
            cache: Mutex::new(ExpertCache::new(cache_budget_bytes)),
            counters: Counters::default(),
        })
    }

    fn open_layer(dir: &ModelDir, entry: &ExpertLayerEntry) -> Result<LayerFile> {
        let path = dir.path_of(&entry.file)?;
        let file = File::open(&path).map_err(|e| Error::io(&path, "opening expert file", e))?;
        let matrix =
            |m: &crate::format::BlobMatrix| (m.offset as usize, m.layout().expect("validated"));
        let layout = BlobLayout {
            nbytes: entry.blob.nbytes as usize,
            gate: matrix(&entry.blob.gate),
            up: matrix(&entry.blob.up),
            down: matrix(&entry.blob.down),
        };
        Ok(LayerFile {
            path,
            file,
            stride: entry.stride,
            checksums: entry
                .checksums
                .iter()
                .map(|c| parse_hex64(c).expect("validated"))
                .collect(),
            layout: Arc::new(layout),
        })
    }

    /// Size of one expert blob of `layer`.
    pub fn expert_bytes(&self, layer: usize) -> u64 {
        self.layers[layer]
            .as_ref()
            .map_or(0, |l| l.layout.nbytes as u64)
    }

    pub fn cache_budget(&self) -> u64 {
        self.cache.lock().unwrap().budget()
    }

    pub fn stats(&self) -> ExpertStats {
        let c = &self.counters;
        ExpertStats {
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            read_nanos: c.read_nanos.load(Ordering::Relaxed),
        }
    }

    /// Returns the requested experts of `layer`, reading the ones the cache
    /// does not hold with parallel positional reads.
    pub fn fetch(&self, layer: usize, experts: &[usize]) -> Result<Vec<Arc<Expert>>> {
        let file = self.layers[layer]
            .as_ref()
            .expect("the forward pass only routes MoE layers");
        let mut found: Vec<Option<Arc<Expert>>> = {
            let mut cache = self.cache.lock().unwrap();
            experts
                .iter()
                .map(|&e| cache.get((layer as u32, e as u32)))
                .collect()
        };
        let missing: Vec<usize> = (0..experts.len()).filter(|&i| found[i].is_none()).collect();
        let hits = (experts.len() - missing.len()) as u64;
        self.counters.hits.fetch_add(hits, Ordering::Relaxed);
        if missing.is_empty() {
            return Ok(found.into_iter().map(Option::unwrap).collect());
        }
        self.counters
            .misses
            .fetch_add(missing.len() as u64, Ordering::Relaxed);
        let start = Instant::now();
        let loaded: Vec<Arc<Expert>> = self.io_pool.install(|| {
            missing
                .par_iter()
                .map(|&i| self.read(file, layer, experts[i]).map(Arc::new))
                .collect::<Result<_>>()
        })?;
        self.counters
            .read_nanos
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let mut cache = self.cache.lock().unwrap();
        for (&i, expert) in missing.iter().zip(loaded) {
            cache.insert((layer as u32, experts[i] as u32), expert.clone());
            found[i] = Some(expert);
        }
        Ok(found.into_iter().map(Option::unwrap).collect())
    }

    fn read(&self, file: &LayerFile, layer: usize, index: usize) -> Result<Expert> {
        let nbytes = file.layout.nbytes;
        let mut data = AlignedBuf::zeroed(nbytes);
        let offset = index as u64 * file.stride;
        file.file.read_exact_at(&mut data, offset).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => Error::bad_file(
                &file.path,
                format!(
                    "truncated: expert {index} of layer {layer} (bytes {offset}..{}) lies past the end of the file; convert the model again",
                    offset + nbytes as u64
                ),
            ),
            _ => Error::io(&file.path, "reading an expert", e),
        })?;
        let expected = file.checksums[index];
        let actual = xxhash_rust::xxh3::xxh3_64(&data);
        if actual != expected {
            return Err(Error::Checksum {
                path: file.path.clone(),
                what: format!("expert {index} of layer {layer}"),
                expected,
                actual,
            });
        }
        self.counters
            .bytes_read
            .fetch_add(nbytes as u64, Ordering::Relaxed);
        Ok(Expert {
            layer,
            index,
            layout: file.layout.clone(),
            data,
        })
    }
}
