//! The pinned host tier of streamed experts: page-locked slots holding
//! experts in their device layout, so that an upload is a DMA on the copy
//! stream (see streaming.rs).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use cudarc::driver::CudaEvent;

use super::device_expert::{DeviceLayout, VramKey};
use crate::experts::Expert;

/// Pinned slots allocated at once (one `cuMemHostAlloc`).
pub(super) const SLOTS_PER_CHUNK: usize = 32;

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

pub(super) struct PinnedSlot {
    ptr: *mut u8,
    key: Option<VramKey>,
    tick: u64,
    /// The copy-stream event after the last upload that read the slot.
    pub(super) read_by: Option<Arc<CudaEvent>>,
}

// SAFETY: see PinnedChunk.
unsafe impl Send for PinnedSlot {}
unsafe impl Sync for PinnedSlot {}

/// Experts in page-locked host memory, one fixed-size slot each, least
/// recently used out first.
#[derive(Default)]
pub(super) struct PinnedTier {
    /// 0 until configured at the first streamed upload.
    pub(super) budget: u64,
    pub(super) slot_bytes: usize,
    chunks: Vec<PinnedChunk>,
    pub(super) slots: Vec<PinnedSlot>,
    pub(super) map: HashMap<VramKey, usize>,
    by_use: BTreeMap<u64, usize>,
    pub(super) tick: u64,
    /// Slots of the batch being prepared: never evicted for each other.
    pub(super) batch_start_tick: u64,
}

impl PinnedTier {
    pub(super) fn allocated_bytes(&self) -> u64 {
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
    pub(super) fn lookup(&mut self, key: VramKey) -> Option<usize> {
        let slot = *self.map.get(&key)?;
        self.touch(slot);
        Some(slot)
    }

    /// A slot for `key` (to be filled now): a never used one, a new chunk's
    /// within the budget, or the least recently used one outside the
    /// current batch. `None` when there is none.
    pub(super) fn acquire(
        &mut self,
        key: VramKey,
        ctx: &Arc<cudarc::driver::CudaContext>,
    ) -> Option<usize> {
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
    pub(super) fn bytes(&self, slot: usize, len: usize) -> &[u8] {
        assert!(len <= self.slot_bytes);
        // SAFETY: the slot lies within its chunk, which lives as long as
        // `self`; it was filled before being read.
        unsafe { std::slice::from_raw_parts(self.slots[slot].ptr, len) }
    }

    /// Copies an expert into a slot in its device layout.
    pub(super) fn fill(&mut self, slot: usize, host: &Expert, layout: &DeviceLayout) {
        let base = self.slots[slot].ptr;
        for (view, &(offset, _)) in [host.gate(), host.up(), host.down()]
            .iter()
            .zip(&layout.parts.matrices)
        {
            let len = view.layout.total_bytes;
            assert!(offset + len <= self.slot_bytes);
            // SAFETY: within the slot, which no copy reads any more
            // (acquire waited) and nothing else writes (the cache's lock).
            unsafe { std::ptr::copy_nonoverlapping(view.bytes.as_ptr(), base.add(offset), len) };
        }
    }
}
