//! The expert store: routed experts stay on disk and are read on demand,
//! one positional read per expert, several in parallel, into a
//! byte-budgeted cache; reads for the next layer can start early
//! (prefetch) and overlap the current layer's compute.
//!
//! Reads bypass the page cache (`O_DIRECT`) when the experts do not fit in
//! memory, where caching them twice (page cache and expert cache) would
//! only evict useful pages; when they fit, buffered reads let the page
//! cache keep what the expert cache drops.

mod cache;
mod routing_counts;

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use serde::Serialize;

pub use cache::{CachePolicy, ExpertCache, ExpertKey, Weighted, simulate};
pub use routing_counts::RoutingCounts;

use crate::error::{Error, Result};
use crate::format::{ExpertLayerEntry, ModelDir};
use crate::quant::{MatrixLayout, MatrixView};
use crate::util::{AlignedBuf, Progress, parse_hex64};

/// Expert reads in flight at once: parallel positional reads keep the
/// disk's queue full (several times faster than one at a time).
pub const READ_PARALLELISM: usize = 8;

/// Reads [`ExpertStore::load_all`] keeps in flight: a few per I/O thread,
/// few enough to bound the memory of reads not yet in the cache.
const LOAD_ALL_IN_FLIGHT: usize = 4 * READ_PARALLELISM;

/// How expert files are read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub enum IoMode {
    /// Direct when the experts exceed 3/4 of physical memory, else buffered.
    #[default]
    Auto,
    /// No page cache (`O_DIRECT` on Linux, `F_NOCACHE` on macOS).
    Direct,
    /// Through the page cache.
    Buffered,
}

/// Which experts to read ahead for the next MoE layer while the current
/// one computes (single-token decode). The next layer's router is the
/// default: on a trained model's routing it names ~89% of the experts the
/// next layer will use and raises streaming decode speed; on random-weight
/// (synthetic) models its guesses are poorer and it costs more disk time
/// than it saves (docs/PERFORMANCE.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub enum Prefetch {
    Off,
    /// The next layer's router applied to the current layer's input.
    #[default]
    Router,
    /// The experts the next layer used for the previous token.
    PreviousToken,
}

#[derive(Clone, Copy, Debug)]
pub struct StoreOptions {
    pub cache_bytes: u64,
    pub policy: CachePolicy,
    pub io: IoMode,
}

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

    /// Bytes of the blob as read.
    pub fn nbytes(&self) -> usize {
        self.data.len()
    }
}

impl Weighted for Arc<Expert> {
    fn weight(&self) -> u64 {
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ExpertStats {
    /// Requests found in the cache (including experts a prefetch brought).
    pub hits: u64,
    /// Requests served by a prefetch (finished or still in flight).
    pub prefetch_waits: u64,
    /// Requests read on demand.
    pub misses: u64,
    pub bytes_read: u64,
    /// Time during which at least one read was in flight.
    pub read_nanos: u64,
    pub prefetches_issued: u64,
    /// Decode steps' routed experts that each predictor had named.
    pub router_predicted: u64,
    pub previous_token_predicted: u64,
    pub predicted_out_of: u64,
}

impl ExpertStats {
    /// The work done between `earlier` and `self`.
    pub fn since(&self, earlier: &ExpertStats) -> ExpertStats {
        ExpertStats {
            hits: self.hits - earlier.hits,
            prefetch_waits: self.prefetch_waits - earlier.prefetch_waits,
            misses: self.misses - earlier.misses,
            bytes_read: self.bytes_read - earlier.bytes_read,
            read_nanos: self.read_nanos - earlier.read_nanos,
            prefetches_issued: self.prefetches_issued - earlier.prefetches_issued,
            router_predicted: self.router_predicted - earlier.router_predicted,
            previous_token_predicted: self.previous_token_predicted
                - earlier.previous_token_predicted,
            predicted_out_of: self.predicted_out_of - earlier.predicted_out_of,
        }
    }

    /// Share of requests served without an on-demand read.
    pub fn hit_rate(&self) -> f64 {
        let total = self.hits + self.prefetch_waits + self.misses;
        if total == 0 {
            1.0
        } else {
            (self.hits + self.prefetch_waits) as f64 / total as f64
        }
    }

    /// Share of decode-routed experts the router predictor named.
    pub fn router_prediction_rate(&self) -> Option<f64> {
        (self.predicted_out_of > 0)
            .then(|| self.router_predicted as f64 / self.predicted_out_of as f64)
    }

    /// Share of decode-routed experts the previous token had also used.
    pub fn previous_token_prediction_rate(&self) -> Option<f64> {
        (self.predicted_out_of > 0)
            .then(|| self.previous_token_predicted as f64 / self.predicted_out_of as f64)
    }
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    prefetch_waits: AtomicU64,
    misses: AtomicU64,
    bytes_read: AtomicU64,
    read_nanos: AtomicU64,
    prefetches_issued: AtomicU64,
    router_predicted: AtomicU64,
    previous_token_predicted: AtomicU64,
    predicted_out_of: AtomicU64,
}

/// An expert being fetched.
pub enum Fetch {
    Ready(Arc<Expert>),
    Reading {
        layer: usize,
        index: usize,
        slot: Arc<Pending>,
        /// Started by a prefetch rather than by this request.
        prefetched: bool,
    },
}

impl Fetch {
    pub fn is_ready(&self) -> bool {
        matches!(self, Fetch::Ready(_))
    }
}

/// A read in flight on an I/O thread.
#[derive(Default)]
pub struct Pending {
    /// `Some(None)`: the read failed (the requester reads again and reports).
    done: Mutex<Option<Option<Arc<Expert>>>>,
    ready: Condvar,
}

struct Shared {
    layers: Vec<Option<LayerFile>>,
    cache: Mutex<ExpertCache<Arc<Expert>>>,
    pending: Mutex<HashMap<ExpertKey, Arc<Pending>>>,
    counters: Counters,
    /// Per layer: experts of the last single-token request, and the router
    /// prediction registered for the next one.
    last_used: Mutex<Vec<Vec<u32>>>,
    predicted: Mutex<Vec<Option<Vec<u32>>>>,
    trace: Mutex<Option<Vec<ExpertKey>>>,
    /// While counted: how many times each expert of each layer was routed
    /// to (see [`ExpertStore::count_routing`]).
    routing_counts: Mutex<Option<HashMap<usize, Vec<u64>>>>,
    /// Whether `routing_counts` is counting: read by every MoE layer, so
    /// a flag rather than the lock.
    counting_routing: AtomicBool,
    /// Reads in flight and since when at least one has been, to count the
    /// time the disk is busy (`read_nanos`).
    in_flight: Mutex<(usize, Option<Instant>)>,
}

pub struct ExpertStore {
    /// Unique within the process: caches beyond the store (a GPU's) key
    /// experts by it.
    id: u64,
    shared: Arc<Shared>,
    /// Threads that only read, so blocking I/O never occupies the compute
    /// threads.
    io_pool: rayon::ThreadPool,
    direct: bool,
    /// The decoder's layers; a multi-token-prediction layer comes after
    /// them.
    decoder_layers: usize,
}

impl ExpertStore {
    /// Opens every expert file of the model; reads no expert.
    pub fn open(dir: &ModelDir, options: StoreOptions) -> Result<ExpertStore> {
        let cfg = dir.config();
        let expert_bytes = dir.manifest().expert_bytes();
        let direct = match options.io {
            IoMode::Direct => true,
            IoMode::Buffered => false,
            IoMode::Auto => physical_memory().is_some_and(|ram| expert_bytes * 4 > ram * 3),
        };
        // The decoder's layers and a multi-token-prediction layer after them.
        let n = cfg.num_layers() + usize::from(cfg.mtp.is_some());
        let mut layers: Vec<Option<LayerFile>> = (0..n).map(|_| None).collect();
        for layer in cfg.expert_layers() {
            let entry = dir
                .manifest()
                .expert_layer(layer)
                .expect("validated by ModelDir::open");
            layers[layer] = Some(open_layer(dir, entry, direct)?);
        }
        let io_pool = rayon::ThreadPoolBuilder::new()
            .num_threads(READ_PARALLELISM)
            .thread_name(|i| format!("moeflux-io-{i}"))
            .build()
            .map_err(|e| Error::invalid("expert reader threads", e.to_string()))?;
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        Ok(ExpertStore {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            shared: Arc::new(Shared {
                layers,
                cache: Mutex::new(ExpertCache::new(options.cache_bytes, options.policy)),
                pending: Mutex::new(HashMap::new()),
                counters: Counters::default(),
                last_used: Mutex::new(vec![Vec::new(); n]),
                predicted: Mutex::new(vec![None; n]),
                trace: Mutex::new(None),
                routing_counts: Mutex::new(None),
                counting_routing: AtomicBool::new(false),
                in_flight: Mutex::new((0, None)),
            }),
            io_pool,
            direct,
            decoder_layers: cfg.num_layers(),
        })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether reads bypass the page cache.
    pub fn direct_io(&self) -> bool {
        self.direct
    }

    /// The layers that have experts, in order.
    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.shared.layers.len()).filter(|&l| self.shared.layers[l].is_some())
    }

    /// The decoder's next layer with experts after `layer`, if any (not a
    /// multi-token-prediction layer, which runs only when drafting).
    pub fn next_decoder_moe_layer(&self, layer: usize) -> Option<usize> {
        self.moe_layers()
            .find(|&l| l > layer)
            .filter(|&l| l < self.decoder_layers)
    }

    /// How many experts `layer` has (0 for a layer without experts).
    pub fn expert_count(&self, layer: usize) -> usize {
        self.shared.layers[layer]
            .as_ref()
            .map_or(0, |l| l.checksums.len())
    }

    /// Where gate, up and down lie in each expert blob of `layer`.
    pub fn blob_layout(&self, layer: usize) -> Option<&BlobLayout> {
        self.shared.layers[layer].as_ref().map(|l| &*l.layout)
    }

    /// Bytes of every expert of every layer, as stored.
    pub fn total_expert_bytes(&self) -> u64 {
        self.moe_layers()
            .map(|l| {
                let file = self.shared.layers[l].as_ref().expect("an MoE layer");
                file.layout.nbytes as u64 * file.checksums.len() as u64
            })
            .sum()
    }

    pub fn cache_budget(&self) -> u64 {
        self.shared.cache.lock().unwrap().budget()
    }

    /// Whether the cache holds every expert of every layer (as after
    /// [`ExpertStore::load_all`]); with a budget that holds them all it
    /// evicts none, so nothing is left to read or predict.
    pub fn holds_every_expert(&self) -> bool {
        let total: usize = self.moe_layers().map(|l| self.expert_count(l)).sum();
        self.shared.cache.lock().unwrap().len() == total
    }

    pub fn cache_policy(&self) -> CachePolicy {
        self.shared.cache.lock().unwrap().policy()
    }

    pub fn stats(&self) -> ExpertStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ExpertStats {
            hits: get(&c.hits),
            prefetch_waits: get(&c.prefetch_waits),
            misses: get(&c.misses),
            bytes_read: get(&c.bytes_read),
            read_nanos: get(&c.read_nanos),
            prefetches_issued: get(&c.prefetches_issued),
            router_predicted: get(&c.router_predicted),
            previous_token_predicted: get(&c.previous_token_predicted),
            predicted_out_of: get(&c.predicted_out_of),
        }
    }

    /// Starts (or stops and returns) recording every expert request, to
    /// replay against cache policies with [`simulate`].
    pub fn record_trace(&self, on: bool) -> Option<Vec<ExpertKey>> {
        let mut trace = self.shared.trace.lock().unwrap();
        if on {
            *trace = Some(Vec::new());
            None
        } else {
            trace.take()
        }
    }

    /// Starts (or stops and returns) counting how often the router picks
    /// each expert, by layer: the measured frequencies that place experts
    /// over several GPUs. While on, every MoE layer reads its routing on
    /// the host (a round trip on a GPU).
    pub fn count_routing(&self, on: bool) -> Option<HashMap<usize, Vec<u64>>> {
        let mut counts = self.shared.routing_counts.lock().unwrap();
        self.shared.counting_routing.store(on, Ordering::Relaxed);
        if on {
            *counts = Some(HashMap::new());
            None
        } else {
            counts.take()
        }
    }

    /// Whether [`ExpertStore::count_routing`] is on.
    pub fn counting_routing(&self) -> bool {
        self.shared.counting_routing.load(Ordering::Relaxed)
    }

    /// Counts the experts a router selected for `layer` (every token's).
    pub fn note_routing(&self, layer: usize, experts: &[u32]) {
        if let Some(counts) = self.shared.routing_counts.lock().unwrap().as_mut() {
            let layer_counts = counts
                .entry(layer)
                .or_insert_with(|| vec![0; self.expert_count(layer)]);
            for &e in experts {
                layer_counts[e as usize] += 1;
            }
        }
    }

    /// Starts fetching experts of `layer`: those the cache holds (or a
    /// prefetch brought) are ready; the others are read in the background,
    /// in parallel, so the caller can compute with the ready ones
    /// meanwhile. [`ExpertStore::wait`] completes each fetch.
    pub fn request(&self, layer: usize, experts: &[usize]) -> Vec<Fetch> {
        let s = &self.shared;
        let keys: Vec<ExpertKey> = experts.iter().map(|&e| (layer as u32, e as u32)).collect();
        if let Some(trace) = s.trace.lock().unwrap().as_mut() {
            trace.extend(&keys);
        }
        let cached: Vec<Option<Arc<Expert>>> = {
            let mut cache = s.cache.lock().unwrap();
            keys.iter().map(|&k| cache.get(k)).collect()
        };
        let mut pending = s.pending.lock().unwrap();
        let fetches: Vec<Fetch> = cached
            .into_iter()
            .zip(experts)
            .zip(&keys)
            .map(
                |((cached, &index), key)| match (cached, pending.remove(key)) {
                    (Some(expert), _) => {
                        s.counters.hits.fetch_add(1, Ordering::Relaxed);
                        Fetch::Ready(expert)
                    }
                    (None, Some(slot)) => Fetch::Reading {
                        layer,
                        index,
                        slot,
                        prefetched: true,
                    },
                    (None, None) => {
                        s.counters.misses.fetch_add(1, Ordering::Relaxed);
                        Fetch::Reading {
                            layer,
                            index,
                            slot: self.start_read(layer, index),
                            prefetched: false,
                        }
                    }
                },
            )
            .collect();
        fetches
    }

    /// Completes a fetch: waits for its read and offers the expert to the
    /// cache. A failed background read is repeated here, so its error is
    /// reported to the caller.
    pub fn wait(&self, fetch: Fetch) -> Result<Arc<Expert>> {
        let (layer, index, slot, prefetched) = match fetch {
            Fetch::Ready(expert) => return Ok(expert),
            Fetch::Reading {
                layer,
                index,
                slot,
                prefetched,
            } => (layer, index, slot, prefetched),
        };
        let s = &self.shared;
        let read = {
            let mut done = slot.done.lock().unwrap();
            while done.is_none() {
                done = slot.ready.wait(done).unwrap();
            }
            done.clone().flatten()
        };
        let expert = match read {
            Some(expert) => expert,
            None => Arc::new(s.read(layer, index)?),
        };
        if prefetched {
            s.counters.prefetch_waits.fetch_add(1, Ordering::Relaxed);
        }
        s.cache
            .lock()
            .unwrap()
            .insert((layer as u32, index as u32), expert.clone());
        Ok(expert)
    }

    /// Reads every expert into the cache when the cache's budget holds them
    /// all, so decoding never waits for the disk (a model that fits runs at
    /// memory speed from its first token). Reads run in parallel on the I/O
    /// threads; they count as bytes read, not as cache misses. Returns
    /// whether it did.
    pub fn load_all(&self, progress: &dyn Progress) -> Result<bool> {
        if self.total_expert_bytes() > self.cache_budget() {
            return Ok(false);
        }
        progress.start(self.total_expert_bytes());
        for layer in self.moe_layers() {
            let missing: Vec<usize> = {
                let cache = self.shared.cache.lock().unwrap();
                (0..self.expert_count(layer))
                    .filter(|&e| !cache.contains((layer as u32, e as u32)))
                    .collect()
            };
            for chunk in missing.chunks(LOAD_ALL_IN_FLIGHT) {
                let reads: Vec<Fetch> = chunk
                    .iter()
                    .map(|&index| Fetch::Reading {
                        layer,
                        index,
                        slot: self.start_read(layer, index),
                        prefetched: false,
                    })
                    .collect();
                for read in reads {
                    let expert = self.wait(read)?;
                    progress.advance(expert.nbytes() as u64, "reading experts into memory");
                }
            }
        }
        progress.finish();
        Ok(true)
    }

    /// Returns the requested experts of `layer` once all are in memory.
    pub fn fetch(&self, layer: usize, experts: &[usize]) -> Result<Vec<Arc<Expert>>> {
        self.request(layer, experts)
            .into_iter()
            .map(|f| self.wait(f))
            .collect()
    }

    /// Reads an expert on an I/O thread; the slot receives it (or `None`
    /// if the read failed).
    fn start_read(&self, layer: usize, index: usize) -> Arc<Pending> {
        let slot = Arc::new(Pending::default());
        let (shared, done) = (self.shared.clone(), slot.clone());
        shared.reads_started();
        self.io_pool.spawn(move || {
            let expert = shared.read(layer, index).ok().map(Arc::new);
            shared.reads_finished();
            *done.done.lock().unwrap() = Some(expert);
            done.ready.notify_all();
        });
        slot
    }

    /// Records the experts one decode step routed to in `layer`: scores the
    /// predictions made for it and remembers the set for the next step.
    pub fn note_decode_routing(&self, layer: usize, experts: &[u32]) {
        let s = &self.shared;
        let c = &s.counters;
        let prediction = s.predicted.lock().unwrap()[layer].take();
        let mut last = s.last_used.lock().unwrap();
        if let Some(predicted) = prediction {
            let previous: HashSet<u32> = last[layer].iter().copied().collect();
            let predicted: HashSet<u32> = predicted.into_iter().collect();
            let count =
                |set: &HashSet<u32>| experts.iter().filter(|e| set.contains(e)).count() as u64;
            c.router_predicted
                .fetch_add(count(&predicted), Ordering::Relaxed);
            c.previous_token_predicted
                .fetch_add(count(&previous), Ordering::Relaxed);
            c.predicted_out_of
                .fetch_add(experts.len() as u64, Ordering::Relaxed);
        }
        last[layer] = experts.to_vec();
    }

    /// Registers the router's prediction for `layer`'s next request and
    /// starts reading the experts that `mode` names; returns them.
    pub fn predict(&self, layer: usize, router_prediction: Vec<u32>, mode: Prefetch) -> Vec<u32> {
        let s = &self.shared;
        let to_read = match mode {
            Prefetch::Off => Vec::new(),
            Prefetch::Router => router_prediction.clone(),
            Prefetch::PreviousToken => s.last_used.lock().unwrap()[layer].clone(),
        };
        s.predicted.lock().unwrap()[layer] = Some(router_prediction);
        self.prefetch(layer, &to_read);
        to_read
    }

    /// The expert if the cache holds it, without counting a request (a
    /// GPU's prefetch looks here for bytes at hand).
    pub fn peek(&self, layer: usize, index: usize) -> Option<Arc<Expert>> {
        self.shared
            .cache
            .lock()
            .unwrap()
            .peek((layer as u32, index as u32))
    }

    /// Starts background reads of the experts of `layer` that are neither
    /// cached nor already being read; a finished read waits in `pending`
    /// until a request takes it. Finished reads of earlier predictions for
    /// this layer that no request took are dropped.
    fn prefetch(&self, layer: usize, experts: &[u32]) {
        let s = &self.shared;
        let cache = s.cache.lock().unwrap();
        let mut pending = s.pending.lock().unwrap();
        pending.retain(|&(l, _), p| l as usize != layer || p.done.lock().unwrap().is_none());
        for &e in experts {
            let key = (layer as u32, e);
            if cache.contains(key) || pending.contains_key(&key) {
                continue;
            }
            pending.insert(key, self.start_read(layer, e as usize));
            s.counters.prefetches_issued.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Shared {
    fn reads_started(&self) {
        let mut f = self.in_flight.lock().unwrap();
        if f.0 == 0 {
            f.1 = Some(Instant::now());
        }
        f.0 += 1;
    }

    fn reads_finished(&self) {
        let mut f = self.in_flight.lock().unwrap();
        f.0 -= 1;
        if f.0 == 0
            && let Some(since) = f.1.take()
        {
            self.counters
                .read_nanos
                .fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }

    fn read(&self, layer: usize, index: usize) -> Result<Expert> {
        let file = self.layers[layer]
            .as_ref()
            .expect("only MoE layers route to experts");
        // Whole strides, so the length stays block-aligned for O_DIRECT.
        let mut data = AlignedBuf::zeroed(file.stride as usize);
        let offset = index as u64 * file.stride;
        file.file.read_exact_at(&mut data, offset).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => Error::bad_file(
                &file.path,
                format!(
                    "truncated: expert {index} of layer {layer} (bytes {offset}..{}) lies past the end of the file; convert the model again",
                    offset + file.stride
                ),
            ),
            _ => Error::io(&file.path, "reading an expert", e),
        })?;
        let expected = file.checksums[index];
        let actual = xxhash_rust::xxh3::xxh3_64(&data[..file.layout.nbytes]);
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
            .fetch_add(file.stride, Ordering::Relaxed);
        Ok(Expert {
            layer,
            index,
            layout: file.layout.clone(),
            data,
        })
    }
}

fn open_layer(dir: &ModelDir, entry: &ExpertLayerEntry, direct: bool) -> Result<LayerFile> {
    let path = dir.path_of(&entry.file)?;
    let file = if direct {
        crate::platform::open_uncached(&path)
    } else {
        File::open(&path)
    }
    .map_err(|e| Error::io(&path, "opening expert file", e))?;
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

/// Physical memory in bytes (Linux `MemTotal`, macOS `hw.memsize`).
pub fn physical_memory() -> Option<u64> {
    crate::platform::physical_memory()
}

/// Memory available to new allocations in bytes (Linux `MemAvailable`,
/// macOS free and inactive pages).
pub fn available_memory() -> Option<u64> {
    crate::platform::available_memory()
}
