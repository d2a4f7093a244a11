//! The VRAM expert cache (see streaming.rs for how it is fed): experts in
//! device buffers keyed by (store, layer, expert) within a byte budget,
//! least recently used out first, evicted buffers kept by size for the
//! next uploads, the staging buffers through which several tokens' calls
//! stream the experts it has no room for, the address tables of layers
//! whose experts are all resident, and the statistics of it all.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};

use super::device_expert::{DeviceExpert, PartsLayout, VramKey};
use super::pinned::PinnedTier;
use crate::backend::DeviceExpertStats as ExpertCacheStats;

/// (expert store, layer)
type LayerKey = (u64, u32);

/// Staging buffers kept for each expert size: two batches of a prompt's
/// uploads, so that one batch uploads while the kernels of the one before
/// read theirs, and a third for the first batch of a layer while the
/// experts uploaded ahead for it ([`PromptAhead`]) are still held.
pub(super) const STAGING_BUFFERS: usize = 3 * super::experts::EXPERTS_IN_FLIGHT;

/// When the compute stream is done with a buffer.
#[derive(Clone)]
pub(super) enum LastUse {
    /// No kernel has read it since its upload.
    Never,
    /// After this compute-stream event.
    After(Arc<CudaEvent>),
    /// Not known: after the work queued on the compute stream so far.
    Unknown,
}

/// A device buffer holding (or having held) an expert.
pub(super) struct Buffer {
    pub(super) expert: Arc<DeviceExpert>,
    pub(super) bytes: u64,
    /// The copy-stream event after its upload, until the compute stream
    /// has waited for it.
    pub(super) upload: Option<Arc<CudaEvent>>,
    pub(super) last_use: LastUse,
}

impl Buffer {
    /// A buffer just allocated for an expert of `bytes` laid out as `parts`.
    /// Allocated on the compute stream, so a copy into it waits for nothing
    /// else (`LastUse::Unknown`).
    pub(super) fn fresh(data: CudaSlice<u8>, parts: PartsLayout, bytes: u64) -> Buffer {
        Buffer {
            expert: Arc::new(DeviceExpert { data, parts }),
            bytes,
            upload: None,
            last_use: LastUse::Unknown,
        }
    }
}

pub(super) struct Entry {
    pub(super) buffer: Buffer,
    pub(super) last_use_tick: u64,
    /// Prefetched and not yet used.
    pub(super) prefetched: bool,
}

/// A layer whose experts are all resident: their addresses by expert id.
pub(super) struct CompleteLayer {
    pub(super) addresses: CudaSlice<u64>,
    pub(super) parts: PartsLayout,
}

/// The first experts of the next layer of a long prompt, uploaded while
/// the layer before finishes (streaming.rs `upload_next_layer_ahead`),
/// for that layer's call to take.
pub(super) struct PromptAhead {
    pub(super) layer: LayerKey,
    /// Those in staging buffers (the cache holds the others), by id.
    pub(super) staged: Vec<(u32, Arc<DeviceExpert>)>,
    /// The copy-stream event after their upload.
    pub(super) uploaded: Arc<CudaEvent>,
}

/// The compute stream and the copy stream.
pub(super) struct Streams {
    pub(super) compute: Arc<CudaStream>,
    pub(super) copy: Arc<CudaStream>,
}

/// The VRAM expert cache, its free buffers and the pinned host tier.
pub(super) struct VramCache {
    pub(super) budget: Option<u64>,
    /// Bytes of cached experts and free buffers.
    pub(super) used: u64,
    pub(super) clock: u64,
    pub(super) entries: HashMap<VramKey, Entry>,
    /// Resident keys by last use, oldest first.
    pub(super) by_use: BTreeMap<u64, VramKey>,
    /// Buffers of evicted experts, by size, to upload into again.
    pub(super) free: HashMap<u64, Vec<Buffer>>,
    /// Buffers outside the budget for the experts of several tokens' calls
    /// that the cache has no room for (a prompt reads every expert of a
    /// layer: caching them would push out the experts decode keeps
    /// using), least recently used first.
    pub(super) staging: VecDeque<Buffer>,
    /// Resident experts per layer.
    pub(super) resident: HashMap<LayerKey, usize>,
    pub(super) complete: HashMap<LayerKey, CompleteLayer>,
    pub(super) streams: Option<Streams>,
    pub(super) pinned: PinnedTier,
    /// (start, end) events of upload batches not yet added to
    /// `copy_nanos`.
    pub(super) timings: Vec<(CudaEvent, Arc<CudaEvent>)>,
    /// Bytes of the pinned tier as configured (`None`: a quarter of the
    /// available host memory, at most the experts' size).
    pub(super) pinned_config: Option<u64>,
    /// The next layer's predicted experts, uploaded once the current
    /// layer's work is queued.
    pub(super) pending_prefetch: Option<(LayerKey, Vec<u32>)>,
    pub(super) prompt_ahead: Option<PromptAhead>,
    pub(super) stats: ExpertCacheStats,
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
            staging: VecDeque::new(),
            resident: HashMap::new(),
            complete: HashMap::new(),
            streams: None,
            pinned: PinnedTier::default(),
            timings: Vec::new(),
            pending_prefetch: None,
            prompt_ahead: None,
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

    /// Stamps the experts a step used (cached or staged) with the
    /// compute-stream event after its kernels.
    pub(super) fn stamp(
        &mut self,
        keys: &[VramKey],
        used: &[Arc<DeviceExpert>],
        event: &Arc<CudaEvent>,
    ) {
        for (key, expert) in keys.iter().zip(used) {
            if let Some(entry) = self.entries.get_mut(key)
                && Arc::ptr_eq(&entry.buffer.expert, expert)
            {
                entry.buffer.last_use = LastUse::After(event.clone());
            } else if let Some(buffer) = self
                .staging
                .iter_mut()
                .find(|b| Arc::ptr_eq(&b.expert, expert))
            {
                buffer.last_use = LastUse::After(event.clone());
            }
        }
    }

    /// The least recently used staging buffer of `bytes` that nothing
    /// holds, when its last reader is done or when the pool holds
    /// [`STAGING_BUFFERS`] of that size (the copy then waits for the
    /// reader); else `None`, for a new one.
    pub(super) fn take_staging(&mut self, bytes: u64) -> Option<Buffer> {
        let same_size = self.staging.iter().filter(|b| b.bytes == bytes).count();
        let i = self
            .staging
            .iter()
            .position(|b| b.bytes == bytes && Arc::strong_count(&b.expert) == 1)?;
        let done = match &self.staging[i].last_use {
            LastUse::Never => true,
            LastUse::After(event) => event.is_complete(),
            LastUse::Unknown => false,
        };
        (done || same_size >= STAGING_BUFFERS).then(|| self.staging.remove(i).expect("found"))
    }

    /// Evicts the least recently used expert into the free buffers; false
    /// when none is cached.
    pub(super) fn evict_lru(&mut self) -> bool {
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
        // A staging buffer nothing holds: freed in compute-stream order,
        // which waited for its upload.
        if let Some(i) = self
            .staging
            .iter()
            .position(|b| Arc::strong_count(&b.expert) == 1)
        {
            self.staging.remove(i);
            return true;
        }
        self.evict_lru() && self.release_one_free(None)
    }

    /// Frees one free buffer (of another size than `keep`, when given).
    pub(super) fn release_one_free(&mut self, keep: Option<u64>) -> bool {
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
    pub(super) fn take_free(&mut self, bytes: u64) -> Option<Buffer> {
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
    pub(super) fn harvest_timings(&mut self, all: bool) {
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
