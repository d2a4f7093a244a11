//! Streaming of routed experts that do not all fit in VRAM.
//!
//! Three tiers: the VRAM expert cache (vram_cache.rs: a byte budget, least
//! recently used out first), a pinned (page-locked) host tier holding
//! experts in their device layout (pinned.rs), and the host
//! [`ExpertStore`] (its cache, then disk). An
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

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cudarc::driver::sys::{CUevent_flags, CUresult};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DriverError, LaunchConfig, PushKernelArg};

use super::device_expert::{DeviceExpert, DeviceLayout, PartsLayout, VramKey};
use super::experts::EXPERTS_IN_FLIGHT;
use super::geometry::CODE_TILE_ROWS;
use super::hybrid::in_host_memory;
use super::pinned::SLOTS_PER_CHUNK;
use super::vram_cache::{Buffer, CompleteLayer, Entry, LastUse, PromptAhead, Streams, VramCache};
use super::{CudaBackend, ExpertCacheStats, device_error};
use crate::error::Result;
use crate::experts::{Expert, ExpertStore, available_memory};

/// What an upload batch is for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Purpose {
    /// Used by the layer now: the compute stream waits for the batch.
    Demand,
    /// Guessed for the next layer: waited for at first use.
    Prefetch,
    /// Filling VRAM before the first token: from the pinned tier where it
    /// holds the expert, else straight from the store's buffers (no pinned
    /// slot taken).
    Resident,
    /// Used now by a call of several tokens (a prompt chunk, several
    /// sequences' step): like `Demand`, but when the cache is full the
    /// expert goes through a staging buffer instead of evicting one.
    Prompt,
    /// The next layer's first experts during a long prompt
    /// ([`CudaBackend::upload_next_layer_ahead`]): buffers as for
    /// `Prompt`, waited for at first use as for `Prefetch`.
    PromptAhead,
}

impl Purpose {
    /// Whether the upload takes a staging buffer rather than evict.
    fn stages(self) -> bool {
        matches!(self, Purpose::Prompt | Purpose::PromptAhead)
    }

    /// Whether the compute stream waits for the upload when it uses the
    /// expert rather than right after queueing it.
    fn waited_at_use(self) -> bool {
        matches!(self, Purpose::Prefetch | Purpose::PromptAhead)
    }
}

/// Experts of the next layer a long prompt's call uploads ahead: two
/// batches, held in staging beside the batch that layer's own uploads
/// start with (see `STAGING_BUFFERS`).
const PROMPT_AHEAD: usize = 2 * EXPERTS_IN_FLIGHT;

/// One expert of an upload batch: its bytes come from the pinned tier
/// when it holds them, else from `host` (the store's pageable buffer),
/// copied into a pinned slot first when one is free.
pub(super) struct Upload<'a> {
    pub(super) index: u32,
    pub(super) host: Option<HostExpert<'a>>,
}

/// An expert in the store's memory, borrowed or shared.
pub(super) enum HostExpert<'a> {
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
    /// upload. On several GPUs, each has a tier of this size.
    pub fn set_pinned_cache_bytes(&self, bytes: Option<u64>) {
        for rank in self.ranks() {
            rank.experts.lock().unwrap().pinned_config = bytes;
        }
    }

    /// The copy stream, created at the first streamed upload, and the
    /// pinned tier's size.
    pub(super) fn attach_streams(&self, cache: &mut VramCache, store: &ExpertStore) -> Result<()> {
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
            .map(|l| self.device_layout(store, l).total)
            .max()
            .unwrap_or(0);
        let padded = store
            .moe_layers()
            .map(|l| self.owned_count(store, l) as u64)
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
        self.device_layout(store, layer).total as u64
    }

    /// Where an expert of `layer` keeps its matrices on this device.
    pub(super) fn device_layout(&self, store: &ExpertStore, layer: usize) -> DeviceLayout {
        DeviceLayout::of(store, layer, self.tiled_experts)
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
                self.stamp_used(&mut cache, store, layer, ids, experts)?;
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
    /// Where the CPU computes experts (hybrid.rs), its fraction of those
    /// in the store's memory, the least likely first, is left to it.
    fn prefetch_now(&self, store: &ExpertStore, layer: usize, experts: &[u32]) -> Result<()> {
        let sid = store.id();
        let mut uploads: Vec<Upload<'_>> = {
            let cache = self.experts.lock().unwrap();
            let bytes = self.device_expert_bytes(store, layer);
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
        if self.hybrid_decode().is_some() {
            let places = uploads.iter().enumerate().map(|(i, u)| (i, u.index));
            let in_memory = in_host_memory(store, layer, places);
            let for_cpu = self.cpu_experts_now((uploads.len(), in_memory.len(), 0));
            let left: Vec<u32> = in_memory
                .iter()
                .rev()
                .take(for_cpu)
                .map(|&(i, _)| uploads.remove(i).index)
                .collect();
            self.leave_to_cpu(store, layer, left);
        }
        if !uploads.is_empty() {
            self.upload_batch(store, layer, uploads, Purpose::Prefetch)?;
        }
        Ok(())
    }

    /// Which of the experts `ids` of `layer` the pinned tier holds (their
    /// uploads need no read from the store).
    pub(super) fn pinned_holds(&self, store: &ExpertStore, layer: usize, ids: &[u32]) -> Vec<bool> {
        let cache = self.experts.lock().unwrap();
        ids.iter()
            .map(|&e| {
                cache
                    .pinned
                    .map
                    .contains_key(&(store.id(), layer as u32, e))
            })
            .collect()
    }

    /// Uploads experts of `layer` for a call of several tokens, in one
    /// batch, each from the pinned tier or from its bytes read by the
    /// store (`None`: pinned); the compute stream waits for the batch.
    /// Experts the cache has no room for are staged, not cached. Call
    /// [`CudaBackend::experts_used`] once their kernels are queued.
    pub(super) fn upload_for_prompt(
        &self,
        store: &ExpertStore,
        layer: usize,
        experts: &[(u32, Option<&Expert>)],
    ) -> Result<Vec<Arc<DeviceExpert>>> {
        let uploads = experts
            .iter()
            .map(|&(index, host)| Upload {
                index,
                host: host.map(HostExpert::Borrowed),
            })
            .collect();
        self.upload_batch(store, layer, uploads, Purpose::Prompt)
    }

    /// After a call of several tokens over `layer` that used every expert
    /// this GPU holds of it (a long prompt's chunk, which then uses nearly
    /// every expert of the next layer too): the first [`PROMPT_AHEAD`]
    /// experts of the decoder's next MoE layer that VRAM lacks and the
    /// pinned tier holds upload now, so the link works while this layer
    /// finishes and the next one's attention and routing run, instead of
    /// idling until that layer's call asks for them; it takes them
    /// ([`CudaBackend::take_prompt_ahead`]).
    pub(super) fn upload_next_layer_ahead(&self, store: &ExpertStore, layer: usize) -> Result<()> {
        let Some(next) = store.next_decoder_moe_layer(layer) else {
            return Ok(());
        };
        let key = |e: u32| (store.id(), next as u32, e);
        let uploads: Vec<Upload<'_>> = {
            let cache = self.experts.lock().unwrap();
            if cache.complete_layer(store.id(), next as u32).is_some() {
                return Ok(());
            }
            (0..store.expert_count(next) as u32)
                .filter(|&e| {
                    self.owns(next, e)
                        && !cache.contains(key(e))
                        && cache.pinned.map.contains_key(&key(e))
                })
                .take(PROMPT_AHEAD)
                .map(|index| Upload { index, host: None })
                .collect()
        };
        self.upload_batch(store, next, uploads, Purpose::PromptAhead)?;
        Ok(())
    }

    /// The experts of `layer` that [`CudaBackend::upload_next_layer_ahead`]
    /// put in staging buffers, by id, with the compute stream ordered after
    /// their upload (those the cache kept are found in it); what was
    /// uploaded ahead for another layer (a call that failed before it) is
    /// let go.
    pub(super) fn take_prompt_ahead(
        &self,
        store: &ExpertStore,
        layer: usize,
    ) -> Result<HashMap<u32, Arc<DeviceExpert>>> {
        let mut cache = self.experts.lock().unwrap();
        let Some(ahead) = cache.prompt_ahead.take() else {
            return Ok(HashMap::new());
        };
        if ahead.layer != (store.id(), layer as u32) || ahead.staged.is_empty() {
            return Ok(HashMap::new());
        }
        let streams = cache.streams.as_ref().expect("uploads attach the streams");
        streams
            .compute
            .wait(&ahead.uploaded)
            .map_err(|e| device_error(self.ordinal, "waiting for experts uploaded ahead", e))?;
        Ok(ahead.staged.into_iter().collect())
    }

    /// After kernels reading the experts `ids` of `layer` (in `experts`,
    /// cached or staged) are queued: stamps them with a compute event, so
    /// that a later upload into their buffers waits for those kernels
    /// alone.
    pub(super) fn experts_used(
        &self,
        store: &ExpertStore,
        layer: usize,
        ids: &[u32],
        experts: &[Arc<DeviceExpert>],
    ) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut cache = self.experts.lock().unwrap();
        self.stamp_used(&mut cache, store, layer, ids, experts)
    }

    /// See [`CudaBackend::experts_used`]; the caller holds the cache.
    fn stamp_used(
        &self,
        cache: &mut VramCache,
        store: &ExpertStore,
        layer: usize,
        ids: &[u32],
        experts: &[Arc<DeviceExpert>],
    ) -> Result<()> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| device_error(self.ordinal, "recording an event", e))?;
        let keys: Vec<VramKey> = ids.iter().map(|&e| (store.id(), layer as u32, e)).collect();
        cache.stamp(&keys, experts, &Arc::new(event));
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
    pub(super) fn upload_batch(
        &self,
        store: &ExpertStore,
        layer: usize,
        uploads: Vec<Upload<'_>>,
        purpose: Purpose,
    ) -> Result<Vec<Arc<DeviceExpert>>> {
        if uploads.is_empty() {
            return Ok(Vec::new());
        }
        let layout = self.device_layout(store, layer);
        let bytes = layout.total as u64;
        let sid = store.id();
        let count = (self.owned_count(store, layer), store.expert_count(layer));
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
            if let Some(slot) = cache.pinned.lookup(key) {
                if purpose != Purpose::Resident {
                    cache.stats.pinned_hits += 1;
                }
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
            let (buffer, cached) = self.acquire_buffer(cache, bytes, budget, &layout, purpose)?;
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
                        .zip(&layout.parts.matrices)
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
        // After every copy, so the link never waits for the tiling.
        for (buffer, _) in &buffers {
            let (dst, _sync) = buffer.expert.data.device_ptr(&streams.copy);
            self.tile_codes(&streams.copy, dst, &layout.parts)
                .map_err(what)?;
        }
        let end = Arc::new(streams.copy.record_event(timing).map_err(what)?);
        // A prefetched expert the cache could not keep is freed (on the
        // compute stream) as soon as this returns: after its copy too. The
        // next layer's staged experts are held until that layer's call.
        let freed = purpose == Purpose::Prefetch && buffers.iter().any(|(_, cached)| !cached);
        if !purpose.waited_at_use() || freed {
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
            Purpose::Demand | Purpose::Prompt | Purpose::PromptAhead => cache.stats.misses += n,
            Purpose::Resident => {}
        }

        let mut out = Vec::with_capacity(buffers.len());
        let mut staged = Vec::new();
        for ((index, _, _), (mut buffer, cached)) in sources.into_iter().zip(buffers) {
            buffer.upload = purpose.waited_at_use().then(|| end.clone());
            buffer.last_use = if purpose.waited_at_use() {
                LastUse::Never
            } else {
                LastUse::Unknown
            };
            let expert = buffer.expert.clone();
            if cached {
                self.insert(cache, (sid, layer as u32, index), buffer, count, purpose)?;
            } else if purpose.stages() {
                cache.staging.push_back(buffer);
                if purpose == Purpose::PromptAhead {
                    staged.push((index, expert.clone()));
                }
            }
            out.push(expert);
        }
        if purpose == Purpose::PromptAhead {
            cache.prompt_ahead = Some(PromptAhead {
                layer: (sid, layer as u32),
                staged,
                uploaded: end.clone(),
            });
        }
        if cache.timings.len() > 64 {
            cache.harvest_timings(false);
        }
        Ok(out)
    }

    /// Rewrites the tiled matrices (device_expert.rs) of the expert just
    /// copied, row by row, to the buffer at `expert` into their tiled
    /// form, in place, on `stream` (after the copy, before anything reads
    /// the buffer).
    fn tile_codes(
        &self,
        stream: &CudaStream,
        expert: u64,
        parts: &PartsLayout,
    ) -> std::result::Result<(), DriverError> {
        for i in 0..3 {
            if !parts.is_tiled(i) {
                continue;
            }
            let (offset, layout) = parts.matrices[i];
            let tiles = (layout.rows / CODE_TILE_ROWS) as u32;
            let row_bytes = layout.row_bytes as i32;
            let codes = expert + offset as u64;
            let mut builder = stream.launch_builder(&self.kernels.tile_q4_codes);
            builder.arg(&codes).arg(&row_bytes);
            // SAFETY: tile_q4_codes(u8* codes, int row_bytes) over `tiles`
            // tiles of CODE_TILE_ROWS rows: the matrix's codes, inside the
            // buffer; tileable() bounds the shared memory by what the
            // kernel was allowed (mod.rs).
            unsafe {
                builder.launch(LaunchConfig {
                    grid_dim: (tiles, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: (CODE_TILE_ROWS * layout.row_bytes) as u32,
                })
            }?;
        }
        Ok(())
    }

    /// A buffer of `bytes` for an upload and whether it will be cached:
    /// a free one, a new one within the budget, one freed by evicting the
    /// least recently used experts, or (when even an empty cache could not
    /// keep it) a new one outside the cache. A [`Purpose::Prompt`] upload
    /// evicts nothing: when the cache is full it takes a staging buffer
    /// (reused once its last reader is done, else new up to
    /// [`STAGING_BUFFERS`](super::vram_cache::STAGING_BUFFERS) of a size).
    fn acquire_buffer(
        &self,
        cache: &mut VramCache,
        bytes: u64,
        budget: u64,
        layout: &DeviceLayout,
        purpose: Purpose,
    ) -> Result<(Buffer, bool)> {
        let fits = bytes <= budget;
        let fresh = |cache: &mut VramCache| -> Result<Buffer> {
            let data = self.alloc_for_expert(cache, bytes as usize)?;
            Ok(Buffer::fresh(data, layout.parts, bytes))
        };
        let (mut buffer, cached) = loop {
            if fits && let Some(buffer) = cache.take_free(bytes) {
                break (buffer, true);
            }
            if fits && cache.used + bytes <= budget {
                let buffer = fresh(cache)?;
                cache.used += bytes;
                break (buffer, true);
            }
            if !fits || purpose.stages() {
                let staged = match purpose.stages() {
                    true => cache.take_staging(bytes),
                    false => None,
                };
                break (staged.map_or_else(|| fresh(cache), Ok)?, false);
            }
            if !cache.release_one_free(Some(bytes))
                && !cache.evict_lru()
                && !cache.release_one_free(None)
            {
                // Only buffers still held by layers in flight: one of our
                // own, outside the cache.
                break (fresh(cache)?, false);
            }
        };
        Arc::get_mut(&mut buffer.expert)
            .expect("free and staging buffers are taken when nothing holds them")
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
        (owned, layer_experts): (usize, usize),
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
        if *resident < owned {
            return Ok(());
        }
        // Complete: every expert of the layer this GPU holds (all of them
        // but on one of several GPUs, whose table has 0 for the others').
        let streams = cache.streams.as_ref().expect("attached");
        let mut addresses = Vec::with_capacity(layer_experts);
        let mut first = None;
        for e in 0..layer_experts as u32 {
            if !self.owns(layer as usize, e) {
                addresses.push(0);
                continue;
            }
            first.get_or_insert(e);
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
        let parts = cache
            .entries
            .get(&(
                sid,
                layer,
                first.expect("a GPU holds an expert of a complete layer"),
            ))
            .expect("complete")
            .buffer
            .expert
            .parts;
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

    /// The VRAM cache's statistics, after every upload queued so far has
    /// been timed.
    pub(super) fn streaming_stats(&self) -> ExpertCacheStats {
        let mut cache = self.experts.lock().unwrap();
        if let Some(streams) = &cache.streams {
            super::must("timing expert uploads", streams.copy.synchronize());
        }
        cache.harvest_timings(true);
        let mut stats = cache.stats();
        drop(cache);
        // A statistic: a device that cannot return it fails the next
        // operation instead.
        stats.batched_expert_bytes += self.grouped_expert_bytes().unwrap_or(0);
        stats
    }
}
