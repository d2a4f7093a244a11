//! Streaming of routed experts that do not all fit in VRAM.
//!
//! Three tiers: the VRAM expert cache (a byte budget, least recently used
//! out first), a pinned (page-locked) host tier holding experts in their
//! device layout, and the host [`ExpertStore`] (its cache, then disk). An
//! expert read from the store is copied into a pinned slot once; every
//! later upload of it is a DMA from that slot on a copy stream of its own,
//! overlapping the compute stream.
//!
//! Ordering between the two streams is explicit (cudarc's event tracking
//! is off in this backend):
//! - an upload batch ends with an event; the compute stream waits for it
//!   before the first kernel that reads one of its experts (at once for the
//!   experts a layer asked for, at first use for prefetched ones);
//! - an evicted buffer is reused for another upload only once nothing
//!   holds it, and after the copy stream has waited for the compute event
//!   recorded after the last kernels that read it (decode stamps each
//!   expert it used with one; an expert used otherwise gets an event
//!   recorded when it is reused);
//! - buffers are allocated and freed on the compute stream, so a free is
//!   ordered after the kernels queued before it; a copy stream writing
//!   into a newly allocated buffer first waits for the compute stream;
//! - a pinned slot is overwritten on the host only after the copy that read
//!   it last has completed.
//!
//! During decode the next MoE layer's experts predicted by its router
//! ([`crate::backend::Backend::prefetch_experts`]) are uploaded after the
//! current layer's own uploads and kernels are queued, so they arrive while
//! it computes. Nothing here runs when every expert is resident.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use cudarc::driver::sys::{CUevent_flags, CUresult};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DriverError};
use serde::Serialize;

use super::experts::{DeviceExpert, PartsLayout};
use super::{CudaBackend, device_error};
use crate::error::Result;
use crate::experts::{Expert, ExpertStore, available_memory};
use crate::quant::MatrixLayout;
use crate::util::Progress;

/// (expert store, layer, expert)
pub(super) type VramKey = (u64, u32, u32);
/// (expert store, layer)
type LayerKey = (u64, u32);

/// Offsets of an expert's matrices in its device buffer (and pinned slot)
/// are aligned to this.
pub(super) const PART_ALIGN: usize = 256;

/// Pinned slots allocated at once (one `cuMemHostAlloc`).
const SLOTS_PER_CHUNK: usize = 32;

/// Host reads requested together while filling the pinned tier.
const PRELOAD_IN_FLIGHT: usize = 32;

/// What the VRAM expert cache and the copies feeding it have done since
/// the backend was created. Every routed expert a layer uses counts once,
/// as a hit or a miss; misses and prefetches are uploaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ExpertCacheStats {
    /// Experts found in VRAM when a layer used them (prefetched included).
    pub hits: u64,
    /// Experts a layer used that were not in VRAM: uploaded on demand.
    pub misses: u64,
    /// Hits on experts a prefetch uploaded.
    pub prefetch_hits: u64,
    /// Experts uploaded ahead of use (the next layer's router's guess).
    pub prefetches: u64,
    /// Every upload: misses and prefetches.
    pub uploads: u64,
    /// Bytes copied from host to device for uploads (over PCIe).
    pub uploaded_bytes: u64,
    /// Time the copy stream spent copying those bytes (device events).
    pub copy_nanos: u64,
    pub evictions: u64,
    pub resident_bytes: u64,
    /// `None` until the first upload when the budget is automatic.
    pub budget_bytes: Option<u64>,
    /// Layers whose experts are all resident: their tokens are decoded
    /// without returning the routing to the host.
    pub complete_layers: u64,
    /// Uploads whose bytes were already in the pinned host tier.
    pub pinned_hits: u64,
    /// Uploads whose bytes came from the expert store (then pinned).
    pub pinned_misses: u64,
    pub pinned_bytes: u64,
    pub pinned_budget_bytes: u64,
}

impl ExpertCacheStats {
    /// The work done between `earlier` and `self` (sizes and budgets as
    /// of `self`).
    pub fn since(&self, earlier: &ExpertCacheStats) -> ExpertCacheStats {
        ExpertCacheStats {
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            prefetch_hits: self.prefetch_hits - earlier.prefetch_hits,
            prefetches: self.prefetches - earlier.prefetches,
            uploads: self.uploads - earlier.uploads,
            uploaded_bytes: self.uploaded_bytes - earlier.uploaded_bytes,
            copy_nanos: self.copy_nanos - earlier.copy_nanos,
            evictions: self.evictions - earlier.evictions,
            pinned_hits: self.pinned_hits - earlier.pinned_hits,
            pinned_misses: self.pinned_misses - earlier.pinned_misses,
            ..*self
        }
    }

    /// Share of used experts found in VRAM.
    pub fn hit_rate(&self) -> f64 {
        match self.hits + self.misses {
            0 => 1.0,
            uses => self.hits as f64 / uses as f64,
        }
    }

    /// Host-to-device throughput of the uploads while the copy stream was
    /// copying, in GB/s.
    pub fn copy_gb_s(&self) -> Option<f64> {
        (self.copy_nanos > 0).then(|| self.uploaded_bytes as f64 / self.copy_nanos as f64)
    }
}

/// When the compute stream is done with a buffer.
#[derive(Clone)]
enum LastUse {
    /// No kernel has read it since its upload.
    Never,
    /// After this compute-stream event.
    After(Arc<CudaEvent>),
    /// Not known: after the work queued on the compute stream so far.
    Unknown,
}

/// A device buffer holding (or having held) an expert.
struct Buffer {
    expert: Arc<DeviceExpert>,
    bytes: u64,
    /// The copy-stream event after its upload, until the compute stream
    /// has waited for it.
    upload: Option<Arc<CudaEvent>>,
    last_use: LastUse,
}

impl Buffer {
    /// A buffer just allocated for an expert of `bytes` laid out as `parts`.
    /// Allocated on the compute stream, so a copy into it waits for nothing
    /// else (`LastUse::Unknown`).
    fn fresh(data: CudaSlice<u8>, parts: [(usize, MatrixLayout); 3], bytes: u64) -> Buffer {
        Buffer {
            expert: Arc::new(DeviceExpert { data, parts }),
            bytes,
            upload: None,
            last_use: LastUse::Unknown,
        }
    }
}

struct Entry {
    buffer: Buffer,
    last_use_tick: u64,
    /// Prefetched and not yet used.
    prefetched: bool,
}

/// A layer whose experts are all resident: their addresses by expert id.
pub(super) struct CompleteLayer {
    pub(super) addresses: CudaSlice<u64>,
    pub(super) parts: PartsLayout,
}

/// The compute stream and the copy stream.
struct Streams {
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
}

/// The VRAM expert cache, its free buffers and the pinned host tier.
pub(super) struct VramCache {
    budget: Option<u64>,
    /// Bytes of cached experts and free buffers.
    used: u64,
    clock: u64,
    entries: HashMap<VramKey, Entry>,
    /// Resident keys by last use, oldest first.
    by_use: BTreeMap<u64, VramKey>,
    /// Buffers of evicted experts, by size, to upload into again.
    free: HashMap<u64, Vec<Buffer>>,
    /// Resident experts per layer.
    resident: HashMap<LayerKey, usize>,
    complete: HashMap<LayerKey, CompleteLayer>,
    streams: Option<Streams>,
    pinned: PinnedTier,
    /// (start, end) events of upload batches not yet added to `copy_nanos`.
    timings: Vec<(CudaEvent, Arc<CudaEvent>)>,
    /// Bytes of the pinned tier as configured (`None`: a quarter of the
    /// available host memory, at most the experts' size).
    pinned_config: Option<u64>,
    /// The next layer's predicted experts, uploaded once the current
    /// layer's work is queued.
    pending_prefetch: Option<(LayerKey, Vec<u32>)>,
    stats: ExpertCacheStats,
}

/// What an upload batch is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Purpose {
    /// Used by the layer now: the compute stream waits for the batch.
    Demand,
    /// Guessed for the next layer: waited for at first use.
    Prefetch,
    /// Making every expert resident before the first token: straight from
    /// the store's buffers, no pinned tier.
    Resident,
}

impl VramCache {
    pub(super) fn new(budget: Option<u64>) -> VramCache {
        VramCache {
            budget,
            pinned_config: None,
            used: 0,
            clock: 0,
            entries: HashMap::new(),
            by_use: BTreeMap::new(),
            free: HashMap::new(),
            resident: HashMap::new(),
            complete: HashMap::new(),
            streams: None,
            pinned: PinnedTier::default(),
            timings: Vec::new(),
            pending_prefetch: None,
            stats: ExpertCacheStats::default(),
        }
    }

    /// The address table of a layer whose experts are all resident.
    pub(super) fn complete_layer(&self, store: u64, layer: u32) -> Option<&CompleteLayer> {
        self.complete.get(&(store, layer))
    }

    /// Whether an expert is cached (not counted as a use).
    pub(super) fn contains(&self, key: VramKey) -> bool {
        self.entries.contains_key(&key)
    }

    /// Counts every selected expert of a complete layer's decode step as a
    /// hit (they are, without looking).
    pub(super) fn count_hits(&mut self, n: u64) {
        self.stats.hits += n;
    }

    pub(super) fn budget(&self) -> Option<u64> {
        self.budget
    }

    /// A use of `key` by a layer: the cached expert, most recently used
    /// now and ready for the compute stream, or `None` (a miss, counted
    /// when it is uploaded). The caller queues its kernels before letting
    /// go of the expert.
    pub(super) fn get(&mut self, key: VramKey) -> Option<Arc<DeviceExpert>> {
        self.clock += 1;
        let entry = self.entries.get_mut(&key)?;
        self.by_use.remove(&entry.last_use_tick);
        entry.last_use_tick = self.clock;
        self.by_use.insert(self.clock, key);
        self.stats.hits += 1;
        if std::mem::take(&mut entry.prefetched) {
            self.stats.prefetch_hits += 1;
        }
        if let Some(upload) = entry.buffer.upload.take() {
            let streams = self.streams.as_ref().expect("uploads attach the streams");
            super::must(
                "waiting for an expert upload",
                streams.compute.wait(&upload),
            );
        }
        // Stamped with an event once the caller's kernels are queued
        // (decode), else unknown.
        entry.buffer.last_use = LastUse::Unknown;
        Some(entry.buffer.expert.clone())
    }

    /// Stamps the experts a decode step used with the compute-stream
    /// event after its kernels.
    fn stamp(&mut self, keys: &[VramKey], used: &[Arc<DeviceExpert>], event: &Arc<CudaEvent>) {
        for (key, expert) in keys.iter().zip(used) {
            if let Some(entry) = self.entries.get_mut(key)
                && Arc::ptr_eq(&entry.buffer.expert, expert)
            {
                entry.buffer.last_use = LastUse::After(event.clone());
            }
        }
    }

    /// Evicts the least recently used expert into the free buffers; false
    /// when none is cached.
    fn evict_lru(&mut self) -> bool {
        let Some((_, key)) = self.by_use.pop_first() else {
            return false;
        };
        let mut entry = self.entries.remove(&key).expect("indexed entries exist");
        self.stats.evictions += 1;
        let layer = (key.0, key.1);
        *self
            .resident
            .get_mut(&layer)
            .expect("counted when inserted") -= 1;
        // A complete layer's kernels find experts without stamping them.
        let was_complete = self.complete.remove(&layer).is_some();
        if was_complete {
            self.stats.complete_layers = self.complete.len() as u64;
        }
        if was_complete || Arc::strong_count(&entry.buffer.expert) > 1 {
            entry.buffer.last_use = LastUse::Unknown;
        }
        self.free
            .entry(entry.buffer.bytes)
            .or_default()
            .push(entry.buffer);
        true
    }

    /// Frees a buffer's device memory (in compute-stream order, after the
    /// kernels queued so far and after its upload).
    fn release(&mut self, buffer: Buffer) {
        self.used -= buffer.bytes;
        if let (Some(upload), Some(streams)) = (&buffer.upload, &self.streams) {
            super::must("releasing an expert", streams.compute.wait(upload));
        }
        drop(buffer);
    }

    /// Gives device memory back after an allocation failed: a free buffer,
    /// else the least recently used expert. False when nothing is left.
    pub(super) fn evict_one(&mut self) -> bool {
        if self.release_one_free(None) {
            return true;
        }
        self.evict_lru() && self.release_one_free(None)
    }

    /// Frees one free buffer (of another size than `keep`, when given).
    fn release_one_free(&mut self, keep: Option<u64>) -> bool {
        let Some(&size) = self
            .free
            .iter()
            .find(|(size, list)| Some(**size) != keep && !list.is_empty())
            .map(|(size, _)| size)
        else {
            return false;
        };
        let list = self.free.get_mut(&size).expect("found");
        let buffer = list.pop().expect("not empty");
        if list.is_empty() {
            self.free.remove(&size);
        }
        self.release(buffer);
        true
    }

    /// A free buffer of `bytes` that nothing holds any more.
    fn take_free(&mut self, bytes: u64) -> Option<Buffer> {
        let list = self.free.get_mut(&bytes)?;
        let i = list
            .iter()
            .position(|b| Arc::strong_count(&b.expert) == 1)?;
        Some(list.swap_remove(i))
    }

    pub(super) fn stats(&self) -> ExpertCacheStats {
        ExpertCacheStats {
            resident_bytes: self.used,
            budget_bytes: self.budget,
            pinned_bytes: self.pinned.allocated_bytes(),
            pinned_budget_bytes: self.pinned.budget,
            ..self.stats
        }
    }

    /// Adds the copy time of finished upload batches to the statistics;
    /// with `all`, waits for the unfinished ones.
    fn harvest_timings(&mut self, all: bool) {
        let mut nanos = 0u64;
        self.timings.retain(|(start, end)| {
            if !all && !end.is_complete() {
                return true;
            }
            if let Ok(ms) = start.elapsed_ms(end) {
                nanos += (f64::from(ms) * 1e6) as u64;
            }
            false
        });
        self.stats.copy_nanos += nanos;
    }
}

/// Page-locked host memory allocated by `cuMemHostAlloc`.
struct PinnedChunk {
    ptr: *mut u8,
    ctx: Arc<cudarc::driver::CudaContext>,
}

// SAFETY: the chunk owns its allocation; slots of it are written under the
// cache's lock and read by DMA ordered by events.
unsafe impl Send for PinnedChunk {}
unsafe impl Sync for PinnedChunk {}

impl Drop for PinnedChunk {
    fn drop(&mut self) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: allocated by malloc_host; every copy reading it has
        // completed (the cache synchronises the copy stream first).
        self.ctx.record_err(unsafe {
            cudarc::driver::result::free_host(self.ptr as *mut std::ffi::c_void)
        });
    }
}

struct PinnedSlot {
    ptr: *mut u8,
    key: Option<VramKey>,
    tick: u64,
    /// The copy-stream event after the last upload that read the slot.
    read_by: Option<Arc<CudaEvent>>,
}

// SAFETY: see PinnedChunk.
unsafe impl Send for PinnedSlot {}
unsafe impl Sync for PinnedSlot {}

/// Experts in page-locked host memory, one fixed-size slot each, least
/// recently used out first.
#[derive(Default)]
struct PinnedTier {
    /// 0 until configured at the first streamed upload.
    budget: u64,
    slot_bytes: usize,
    chunks: Vec<PinnedChunk>,
    slots: Vec<PinnedSlot>,
    map: HashMap<VramKey, usize>,
    by_use: BTreeMap<u64, usize>,
    tick: u64,
    /// Slots of the batch being prepared: never evicted for each other.
    batch_start_tick: u64,
}

impl PinnedTier {
    fn allocated_bytes(&self) -> u64 {
        (self.slots.len() * self.slot_bytes) as u64
    }

    fn touch(&mut self, slot: usize) {
        self.tick += 1;
        let s = &mut self.slots[slot];
        if s.key.is_some() {
            self.by_use.remove(&s.tick);
            self.by_use.insert(self.tick, slot);
        }
        s.tick = self.tick;
    }

    /// The slot holding `key`, as most recently used.
    fn lookup(&mut self, key: VramKey) -> Option<usize> {
        let slot = *self.map.get(&key)?;
        self.touch(slot);
        Some(slot)
    }

    /// A slot for `key` (to be filled now): a never used one, a new chunk's
    /// within the budget, or the least recently used one outside the
    /// current batch. `None` when there is none.
    fn acquire(&mut self, key: VramKey, ctx: &Arc<cudarc::driver::CudaContext>) -> Option<usize> {
        if self.slot_bytes == 0 {
            return None;
        }
        let slot = match self.slots.iter().position(|s| s.key.is_none()) {
            Some(slot) => slot,
            None if self.allocated_bytes() + (SLOTS_PER_CHUNK * self.slot_bytes) as u64
                <= self.budget =>
            {
                self.grow(ctx)?
            }
            None => {
                let (&tick, &slot) = self.by_use.first_key_value()?;
                if tick > self.batch_start_tick {
                    return None;
                }
                self.by_use.remove(&tick);
                let old = self.slots[slot]
                    .key
                    .take()
                    .expect("indexed slots hold a key");
                self.map.remove(&old);
                slot
            }
        };
        if let Some(read_by) = self.slots[slot].read_by.take() {
            // The host must not overwrite what a copy still reads.
            super::must("waiting for a pinned slot", read_by.synchronize());
        }
        self.slots[slot].key = Some(key);
        self.map.insert(key, slot);
        self.touch(slot);
        Some(slot)
    }

    /// Allocates a chunk of slots; returns the first.
    fn grow(&mut self, ctx: &Arc<cudarc::driver::CudaContext>) -> Option<usize> {
        let bytes = SLOTS_PER_CHUNK * self.slot_bytes;
        ctx.bind_to_thread().ok()?;
        // SAFETY: plain page-locked allocation, freed by PinnedChunk.
        let ptr = unsafe { cudarc::driver::result::malloc_host(bytes, 0) }.ok()? as *mut u8;
        self.chunks.push(PinnedChunk {
            ptr,
            ctx: ctx.clone(),
        });
        let first = self.slots.len();
        for i in 0..SLOTS_PER_CHUNK {
            self.slots.push(PinnedSlot {
                // SAFETY: within the allocation of `bytes`.
                ptr: unsafe { ptr.add(i * self.slot_bytes) },
                key: None,
                tick: 0,
                read_by: None,
            });
        }
        Some(first)
    }

    /// The first `len` bytes of a slot.
    fn bytes(&self, slot: usize, len: usize) -> &[u8] {
        assert!(len <= self.slot_bytes);
        // SAFETY: the slot lies within its chunk, which lives as long as
        // `self`; it was filled before being read.
        unsafe { std::slice::from_raw_parts(self.slots[slot].ptr, len) }
    }

    /// Copies an expert into a slot in its device layout.
    fn fill(&mut self, slot: usize, host: &Expert, layout: &DeviceLayout) {
        let base = self.slots[slot].ptr;
        for (view, &(offset, _)) in [host.gate(), host.up(), host.down()]
            .iter()
            .zip(&layout.parts)
        {
            let len = view.layout.total_bytes;
            assert!(offset + len <= self.slot_bytes);
            // SAFETY: within the slot, which no copy reads any more
            // (acquire waited) and nothing else writes (the cache's lock).
            unsafe { std::ptr::copy_nonoverlapping(view.bytes.as_ptr(), base.add(offset), len) };
        }
    }
}

/// An expert's parts in a device buffer (or pinned slot).
#[derive(Clone, Copy)]
pub(super) struct DeviceLayout {
    pub(super) parts: [(usize, MatrixLayout); 3],
    pub(super) total: usize,
}

impl DeviceLayout {
    /// The layout of every expert of `layer`: parts one after another,
    /// each aligned to [`PART_ALIGN`].
    pub(super) fn of(store: &ExpertStore, layer: usize) -> DeviceLayout {
        let blob = store
            .blob_layout(layer)
            .expect("routed experts of an MoE layer");
        let mut parts = [blob.gate, blob.up, blob.down];
        let mut total = 0;
        for part in parts.iter_mut() {
            part.0 = total;
            total += part.1.total_bytes.next_multiple_of(PART_ALIGN);
        }
        DeviceLayout { parts, total }
    }
}

/// One expert of an upload batch: its bytes come from the pinned tier
/// when it holds them, else from `host` (the store's pageable buffer),
/// copied into a pinned slot first when one is free.
struct Upload<'a> {
    index: u32,
    host: Option<HostExpert<'a>>,
}

/// An expert in the store's memory, borrowed or shared.
enum HostExpert<'a> {
    Borrowed(&'a Expert),
    Shared(Arc<Expert>),
}

impl std::ops::Deref for HostExpert<'_> {
    type Target = Expert;

    fn deref(&self) -> &Expert {
        match self {
            HostExpert::Borrowed(e) => e,
            HostExpert::Shared(e) => e,
        }
    }
}

impl CudaBackend {
    /// Sets the bytes of page-locked host memory holding streamed experts
    /// in their device layout, so that uploads are asynchronous DMA
    /// (`None`, the default: a quarter of the available host memory, at
    /// most what the experts take; 0: uploads copy from the expert store's
    /// pageable memory). Takes effect if set before the first streamed
    /// upload.
    pub fn set_pinned_cache_bytes(&self, bytes: Option<u64>) {
        self.experts.lock().unwrap().pinned_config = bytes;
    }

    /// The copy stream, created at the first streamed upload, and the
    /// pinned tier's size.
    fn attach_streams(&self, cache: &mut VramCache, store: &ExpertStore) -> Result<()> {
        if cache.streams.is_some() {
            return Ok(());
        }
        let copy = self
            .ctx
            .new_stream()
            .map_err(|e| device_error(self.ordinal, "creating the copy stream", e))?;
        cache.streams = Some(Streams {
            compute: self.stream.clone(),
            copy,
        });
        let slot_bytes = store
            .moe_layers()
            .map(|l| DeviceLayout::of(store, l).total)
            .max()
            .unwrap_or(0);
        let padded = store
            .moe_layers()
            .map(|l| store.expert_count(l) as u64)
            .sum::<u64>()
            * slot_bytes as u64;
        let budget = cache
            .pinned_config
            .unwrap_or_else(|| available_memory().unwrap_or(0) / 4)
            .min(padded.next_multiple_of((SLOTS_PER_CHUNK * slot_bytes.max(1)) as u64));
        cache.pinned.slot_bytes = slot_bytes;
        cache.pinned.budget = budget;
        Ok(())
    }

    /// Bytes each expert of `layer` takes on the device (and copies over
    /// PCIe when uploaded).
    pub fn device_expert_bytes(&self, store: &ExpertStore, layer: usize) -> u64 {
        DeviceLayout::of(store, layer).total as u64
    }

    /// The experts `ids` of `layer` for one decode step, in that order,
    /// ready for the compute stream: cached ones as they are, the others
    /// uploaded in one batch on the copy stream (their bytes from the
    /// pinned tier, else the store). Call [`CudaBackend::decode_layer_done`]
    /// once the kernels that read them are queued.
    pub(super) fn stream_experts(
        &self,
        store: &ExpertStore,
        layer: usize,
        ids: &[u32],
    ) -> Result<Vec<Arc<DeviceExpert>>> {
        let sid = store.id();
        let mut found: Vec<Option<Arc<DeviceExpert>>> = Vec::with_capacity(ids.len());
        let mut from_store = Vec::new();
        {
            let mut cache = self.experts.lock().unwrap();
            self.attach_streams(&mut cache, store)?;
            for &e in ids {
                let key = (sid, layer as u32, e);
                let hit = cache.get(key);
                if hit.is_none() && !cache.pinned.map.contains_key(&key) {
                    from_store.push(e as usize);
                }
                found.push(hit);
            }
        }
        // Host reads (cache or disk) outside the lock, all at once.
        let mut read: HashMap<u32, Arc<Expert>> = HashMap::new();
        for fetch in store.request(layer, &from_store) {
            let expert = store.wait(fetch)?;
            read.insert(expert.index as u32, expert);
        }
        let uploads: Vec<Upload<'_>> = ids
            .iter()
            .zip(&found)
            .filter(|(_, f)| f.is_none())
            .map(|(&e, _)| Upload {
                index: e,
                host: read.get(&e).map(|h| HostExpert::Borrowed(h)),
            })
            .collect();
        let mut uploaded = self
            .upload_batch(store, layer, uploads, Purpose::Demand)?
            .into_iter();
        Ok(found
            .into_iter()
            .map(|f| f.unwrap_or_else(|| uploaded.next().expect("one upload per miss")))
            .collect())
    }

    /// After a decode step's kernels for `layer` are queued: stamps the
    /// streamed experts it used (`used`, for `ids`) with a compute event,
    /// then uploads the next layer's predicted experts.
    pub(super) fn decode_layer_done(
        &self,
        store: &ExpertStore,
        layer: usize,
        used: Option<(&[u32], &[Arc<DeviceExpert>])>,
    ) -> Result<()> {
        let pending = {
            let mut cache = self.experts.lock().unwrap();
            if let Some((ids, experts)) = used {
                let event = self
                    .stream
                    .record_event(None)
                    .map_err(|e| device_error(self.ordinal, "recording an event", e))?;
                let keys: Vec<VramKey> =
                    ids.iter().map(|&e| (store.id(), layer as u32, e)).collect();
                cache.stamp(&keys, experts, &Arc::new(event));
            }
            cache.pending_prefetch.take()
        };
        match pending {
            Some(((sid, next), experts)) if sid == store.id() && next as usize != layer => {
                self.prefetch_now(store, next as usize, &experts)
            }
            _ => Ok(()),
        }
    }

    /// Registers the next layer's predicted experts (see
    /// [`crate::backend::Backend::prefetch_experts`]); they are uploaded
    /// after the current layer's work is queued.
    pub(super) fn note_prefetch(&self, store: &ExpertStore, layer: usize, experts: &[u32]) {
        let mut cache = self.experts.lock().unwrap();
        if cache.complete_layer(store.id(), layer as u32).is_some() {
            return;
        }
        cache.pending_prefetch = Some(((store.id(), layer as u32), experts.to_vec()));
    }

    /// Uploads the predicted experts of `layer` that are not in VRAM and
    /// whose bytes are at hand (pinned, or in the store's cache); the
    /// others are left to the store's read-ahead and the layer's demand.
    fn prefetch_now(&self, store: &ExpertStore, layer: usize, experts: &[u32]) -> Result<()> {
        let sid = store.id();
        let uploads: Vec<Upload<'_>> = {
            let cache = self.experts.lock().unwrap();
            let bytes = DeviceLayout::of(store, layer).total as u64;
            if cache.budget.is_some_and(|budget| bytes > budget) {
                return Ok(()); // the cache could not keep them
            }
            let mut seen = HashSet::new();
            experts
                .iter()
                .filter(|&&e| seen.insert(e) && !cache.contains((sid, layer as u32, e)))
                .filter_map(|&e| {
                    let host = match cache.pinned.map.contains_key(&(sid, layer as u32, e)) {
                        true => None,
                        false => Some(HostExpert::Shared(store.peek(layer, e as usize)?)),
                    };
                    Some(Upload { index: e, host })
                })
                .collect()
        };
        if !uploads.is_empty() {
            self.upload_batch(store, layer, uploads, Purpose::Prefetch)?;
        }
        Ok(())
    }

    /// Copies an expert read by the host store into device memory and
    /// offers it to the VRAM cache (a miss of the layer that asked for it);
    /// the compute stream is ordered after the copy.
    pub(super) fn upload_expert(
        &self,
        store: &ExpertStore,
        layer: usize,
        host: &Expert,
    ) -> Result<Arc<DeviceExpert>> {
        let upload = Upload {
            index: host.index as u32,
            host: Some(HostExpert::Borrowed(host)),
        };
        let mut experts = self.upload_batch(store, layer, vec![upload], Purpose::Demand)?;
        Ok(experts.pop().expect("one upload"))
    }

    /// Uploads experts of `layer` back to back on the copy stream and
    /// offers them to the cache; returns them in order.
    fn upload_batch(
        &self,
        store: &ExpertStore,
        layer: usize,
        uploads: Vec<Upload<'_>>,
        purpose: Purpose,
    ) -> Result<Vec<Arc<DeviceExpert>>> {
        if uploads.is_empty() {
            return Ok(Vec::new());
        }
        let layout = DeviceLayout::of(store, layer);
        let bytes = layout.total as u64;
        let (sid, count) = (store.id(), store.expert_count(layer));
        let what = |e: DriverError| {
            device_error(
                self.ordinal,
                format!("uploading experts of layer {layer}"),
                e,
            )
        };
        let mut guard = self.experts.lock().unwrap();
        let cache = &mut *guard;
        self.attach_streams(cache, store)?;
        let budget = self.expert_budget(cache)?;
        cache.budget = Some(budget);
        // Slots touched from here on are not evicted for one another.
        cache.pinned.batch_start_tick = cache.pinned.tick;

        // Host side: every expert's bytes in a pinned slot where possible.
        let mut sources: Vec<(u32, Option<usize>, Option<HostExpert<'_>>)> = Vec::new();
        for upload in uploads {
            let key = (sid, layer as u32, upload.index);
            if purpose != Purpose::Resident
                && let Some(slot) = cache.pinned.lookup(key)
            {
                cache.stats.pinned_hits += 1;
                sources.push((upload.index, Some(slot), None));
                continue;
            }
            let host = match upload.host {
                Some(host) => host,
                // Pinned when asked for, evicted since (another thread).
                None => HostExpert::Shared(
                    store
                        .fetch(layer, &[upload.index as usize])?
                        .pop()
                        .expect("one expert"),
                ),
            };
            if purpose != Purpose::Resident {
                cache.stats.pinned_misses += 1;
            }
            let slot = match purpose {
                Purpose::Resident => None,
                _ => cache.pinned.acquire(key, &self.ctx),
            };
            if let Some(slot) = slot {
                cache.pinned.fill(slot, &host, &layout);
            }
            sources.push((upload.index, slot, slot.is_none().then_some(host)));
        }

        // Device side: a buffer for each, reused or allocated.
        let mut buffers: Vec<(Buffer, bool)> = Vec::with_capacity(sources.len());
        let mut wait_compute = false;
        for _ in &sources {
            let (buffer, cached) = self.acquire_buffer(cache, bytes, budget, &layout)?;
            match &buffer.last_use {
                LastUse::Never => {}
                LastUse::Unknown => wait_compute = true,
                LastUse::After(event) => {
                    if !event.is_complete() {
                        let streams = cache.streams.as_ref().expect("attached");
                        streams.copy.wait(event).map_err(what)?;
                    }
                }
            }
            buffers.push((buffer, cached));
        }
        let streams = cache.streams.as_ref().expect("attached");
        if wait_compute {
            streams.copy.join(&streams.compute).map_err(what)?;
        }
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = streams.copy.record_event(timing).map_err(what)?;
        for ((_, slot, host), (buffer, _)) in sources.iter().zip(&buffers) {
            let (dst, _sync) = buffer.expert.data.device_ptr(&streams.copy);
            match (slot, host) {
                (Some(slot), _) => {
                    let src = cache.pinned.bytes(*slot, layout.total);
                    // SAFETY: the buffer holds `layout.total` bytes and no
                    // kernel reads it until the batch's event; the slot is
                    // not overwritten before that event either.
                    unsafe {
                        cudarc::driver::result::memcpy_htod_async(
                            dst,
                            src,
                            streams.copy.cu_stream(),
                        )
                    }
                    .map_err(what)?;
                }
                (None, Some(host)) => {
                    for (view, &(offset, _)) in [host.gate(), host.up(), host.down()]
                        .iter()
                        .zip(&layout.parts)
                    {
                        let src = &view.bytes[..view.layout.total_bytes];
                        // SAFETY: within the buffer; pageable memory is
                        // staged before the call returns.
                        unsafe {
                            cudarc::driver::result::memcpy_htod_async(
                                dst + offset as u64,
                                src,
                                streams.copy.cu_stream(),
                            )
                        }
                        .map_err(what)?;
                    }
                }
                (None, None) => unreachable!("every upload has a source"),
            }
        }
        let end = Arc::new(streams.copy.record_event(timing).map_err(what)?);
        // A prefetched expert the cache could not keep is freed (on the
        // compute stream) as soon as this returns: after its copy too.
        if purpose != Purpose::Prefetch || buffers.iter().any(|(_, cached)| !cached) {
            streams.compute.wait(&end).map_err(what)?;
        }
        let n = sources.len() as u64;
        for (_, slot, _) in &sources {
            if let Some(slot) = slot {
                cache.pinned.slots[*slot].read_by = Some(end.clone());
            }
        }
        cache.timings.push((start, end.clone()));
        cache.stats.uploads += n;
        cache.stats.uploaded_bytes += n * bytes;
        match purpose {
            Purpose::Prefetch => cache.stats.prefetches += n,
            Purpose::Demand => cache.stats.misses += n,
            Purpose::Resident => {}
        }

        let mut out = Vec::with_capacity(buffers.len());
        for ((index, _, _), (mut buffer, cached)) in sources.into_iter().zip(buffers) {
            buffer.upload = (purpose == Purpose::Prefetch).then(|| end.clone());
            buffer.last_use = if purpose == Purpose::Prefetch {
                LastUse::Never
            } else {
                LastUse::Unknown
            };
            let expert = buffer.expert.clone();
            if cached {
                self.insert(cache, (sid, layer as u32, index), buffer, count, purpose)?;
            }
            out.push(expert);
        }
        if cache.timings.len() > 64 {
            cache.harvest_timings(false);
        }
        Ok(out)
    }

    /// A buffer of `bytes` for an upload and whether it will be cached:
    /// a free one, a new one within the budget, one freed by evicting the
    /// least recently used experts, or (when even an empty cache could not
    /// keep it) a new one outside the cache.
    fn acquire_buffer(
        &self,
        cache: &mut VramCache,
        bytes: u64,
        budget: u64,
        layout: &DeviceLayout,
    ) -> Result<(Buffer, bool)> {
        let cached = bytes <= budget;
        let mut buffer = loop {
            if cached && let Some(buffer) = cache.take_free(bytes) {
                break buffer;
            }
            if !cached || cache.used + bytes <= budget {
                let data = self.alloc_for_expert(cache, bytes as usize)?;
                if cached {
                    cache.used += bytes;
                }
                break Buffer::fresh(data, layout.parts, bytes);
            }
            if !cache.release_one_free(Some(bytes)) && !cache.evict_lru() {
                // Only buffers still held by layers in flight: drop ours.
                if !cache.release_one_free(None) {
                    let data = self.alloc_for_expert(cache, bytes as usize)?;
                    return Ok((Buffer::fresh(data, layout.parts, bytes), false));
                }
            }
        };
        Arc::get_mut(&mut buffer.expert)
            .expect("free buffers are taken when nothing holds them")
            .parts = layout.parts;
        Ok((buffer, cached))
    }

    /// Device memory for an expert on the compute stream; when memory runs
    /// out, free buffers and cached experts are given back first.
    fn alloc_for_expert(&self, cache: &mut VramCache, bytes: usize) -> Result<CudaSlice<u8>> {
        loop {
            // SAFETY: an upload fills the buffer before any kernel reads it.
            match unsafe { self.stream.alloc::<u8>(bytes.max(1)) } {
                Err(e) if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY && cache.evict_one() => {}
                result => {
                    return result
                        .map_err(|e| device_error(self.ordinal, "allocating an expert", e));
                }
            }
        }
    }

    /// Caches an uploaded expert; when that completes its layer, the
    /// layer's address table goes to the device.
    fn insert(
        &self,
        cache: &mut VramCache,
        key: VramKey,
        buffer: Buffer,
        layer_experts: usize,
        purpose: Purpose,
    ) -> Result<()> {
        if cache.entries.contains_key(&key) {
            // Uploaded twice (another thread): keep the first.
            cache.free.entry(buffer.bytes).or_default().push(buffer);
            return Ok(());
        }
        cache.clock += 1;
        cache.by_use.insert(cache.clock, key);
        cache.entries.insert(
            key,
            Entry {
                buffer,
                last_use_tick: cache.clock,
                prefetched: purpose == Purpose::Prefetch,
            },
        );
        let (sid, layer) = (key.0, key.1);
        let resident = cache.resident.entry((sid, layer)).or_default();
        *resident += 1;
        if *resident < layer_experts {
            return Ok(());
        }
        let streams = cache.streams.as_ref().expect("attached");
        let mut addresses = Vec::with_capacity(layer_experts);
        for e in 0..layer_experts as u32 {
            let entry = cache
                .entries
                .get_mut(&(sid, layer, e))
                .expect("a complete layer has every expert");
            // The layer's kernels find its experts without asking: every
            // upload must be done first.
            if let Some(upload) = entry.buffer.upload.take() {
                streams.compute.wait(&upload).map_err(|e| {
                    device_error(self.ordinal, format!("expert table of layer {layer}"), e)
                })?;
            }
            addresses.push(entry.buffer.expert.address(&self.stream));
        }
        let parts = PartsLayout(
            cache
                .entries
                .get(&(sid, layer, 0))
                .expect("complete")
                .buffer
                .expert
                .parts,
        );
        let table = self
            .stream
            .clone_htod(&addresses)
            .map_err(|e| device_error(self.ordinal, format!("expert table of layer {layer}"), e))?;
        cache.complete.insert(
            (sid, layer),
            CompleteLayer {
                addresses: table,
                parts,
            },
        );
        cache.stats.complete_layers = cache.complete.len() as u64;
        Ok(())
    }

    /// Uploads every expert of `layer` not yet resident, straight from the
    /// store (before the first token, when all experts fit in VRAM).
    pub(super) fn upload_resident_layer(
        &self,
        store: &ExpertStore,
        layer: usize,
        batch: usize,
        progress: &dyn Progress,
    ) -> Result<()> {
        let missing: Vec<usize> = {
            let cache = self.experts.lock().unwrap();
            (0..store.expert_count(layer))
                .filter(|&e| !cache.contains((store.id(), layer as u32, e as u32)))
                .collect()
        };
        for chunk in missing.chunks(batch) {
            let mut uploads = Vec::with_capacity(chunk.len());
            for fetch in store.request(layer, chunk) {
                let expert = store.wait(fetch)?;
                progress.advance(expert.nbytes() as u64, "uploading experts");
                uploads.push(Upload {
                    index: expert.index as u32,
                    host: Some(HostExpert::Shared(expert)),
                });
            }
            self.upload_batch(store, layer, uploads, Purpose::Resident)?;
        }
        Ok(())
    }

    /// Fills the pinned tier with every expert of the model when they fit
    /// in it (and not in VRAM), so decoding never waits for the store.
    /// Returns whether it did.
    pub(super) fn preload_pinned(
        &self,
        store: &ExpertStore,
        progress: &dyn Progress,
    ) -> Result<bool> {
        let sid = store.id();
        {
            let mut cache = self.experts.lock().unwrap();
            self.attach_streams(&mut cache, store)?;
            let slots: u64 = store
                .moe_layers()
                .map(|l| store.expert_count(l) as u64)
                .sum();
            if slots * cache.pinned.slot_bytes as u64 > cache.pinned.budget {
                return Ok(false);
            }
        }
        progress.start(store.total_expert_bytes());
        for layer in store.moe_layers() {
            let layout = DeviceLayout::of(store, layer);
            let indices: Vec<usize> = (0..store.expert_count(layer)).collect();
            for chunk in indices.chunks(PRELOAD_IN_FLIGHT) {
                for fetch in store.request(layer, chunk) {
                    let expert = store.wait(fetch)?;
                    progress.advance(expert.nbytes() as u64, "pinning experts in host memory");
                    let mut cache = self.experts.lock().unwrap();
                    let key = (sid, layer as u32, expert.index as u32);
                    if cache.pinned.lookup(key).is_some() {
                        continue;
                    }
                    cache.pinned.batch_start_tick = cache.pinned.tick;
                    if let Some(slot) = cache.pinned.acquire(key, &self.ctx) {
                        cache.pinned.fill(slot, &expert, &layout);
                    }
                }
            }
        }
        progress.finish();
        Ok(true)
    }

    /// Host-to-device bandwidth in GB/s from page-locked memory, measured
    /// now on the copy stream (best of several 256 MiB copies).
    pub fn pinned_upload_bandwidth(&self) -> Result<f64> {
        const BYTES: usize = 256 << 20;
        let fail = |e: DriverError| device_error(self.ordinal, "host-to-device bandwidth probe", e);
        let copy = self.ctx.new_stream().map_err(fail)?;
        // SAFETY: zeroed below before anything reads it.
        let mut host = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(BYTES, 0) }.map_err(fail)?;
        host.as_mut_slice().map_err(fail)?.fill(0);
        let device = {
            // SAFETY: only written by the copies.
            let data = unsafe { copy.alloc::<u8>(BYTES) }.map_err(fail)?;
            copy.synchronize().map_err(fail)?;
            data
        };
        let src = host.as_slice().map_err(fail)?;
        let (dst, _sync) = device.device_ptr(&copy);
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let start = copy.record_event(timing).map_err(fail)?;
            // SAFETY: `device` holds BYTES bytes; `src` is BYTES pinned bytes
            // that live until the stream is synchronised below.
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, copy.cu_stream()) }
                .map_err(fail)?;
            let end = copy.record_event(timing).map_err(fail)?;
            let ms = start.elapsed_ms(&end).map_err(fail)?;
            best = best.min(f64::from(ms) * 1e-3);
        }
        copy.synchronize().map_err(fail)?;
        Ok(BYTES as f64 / best / 1e9)
    }

    /// The VRAM cache's statistics, after every upload queued so far has
    /// been timed.
    pub(super) fn streaming_stats(&self) -> ExpertCacheStats {
        let mut cache = self.experts.lock().unwrap();
        if let Some(streams) = &cache.streams {
            super::must("timing expert uploads", streams.copy.synchronize());
        }
        cache.harvest_timings(true);
        cache.stats()
    }
}

impl Drop for VramCache {
    fn drop(&mut self) {
        // Pinned chunks are freed after the copies reading them.
        if let Some(streams) = &self.streams {
            streams
                .copy
                .context()
                .record_err(streams.copy.synchronize());
        }
    }
}
