//! What fills the expert tiers when a model opens: every expert uploaded
//! when they all fit in VRAM; otherwise the pinned host tier filled with
//! every expert that fits in it, then the VRAM budget with whole layers
//! from it; and the probe of the link the uploads cross.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{DevicePtr, DriverError};

use super::streaming::{HostExpert, Purpose, Upload};
use super::{CudaBackend, device_error};
use crate::error::Result;
use crate::experts::ExpertStore;
use crate::util::Progress;

/// Host reads requested together while filling the pinned tier.
const PRELOAD_IN_FLIGHT: usize = 32;

impl CudaBackend {
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
                .filter(|&e| {
                    self.owns(layer, e as u32)
                        && !cache.contains((store.id(), layer as u32, e as u32))
                })
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

    /// Fills the VRAM budget with whole layers, in order, from the pinned
    /// tier (else the store): the first prompt and decode steps find
    /// complete layers instead of waiting for the cache's allocations and
    /// uploads; decode then keeps what it uses. For streamed experts,
    /// after [`CudaBackend::preload_pinned`].
    pub(super) fn fill_vram(&self, store: &ExpertStore, progress: &dyn Progress) -> Result<()> {
        let sid = store.id();
        // The layers that fit, each with its experts not yet in VRAM.
        let plan: Vec<(usize, Vec<u32>)> = {
            let mut cache = self.experts.lock().unwrap();
            self.attach_streams(&mut cache, store)?;
            let mut room = self.expert_budget(&cache)?.saturating_sub(cache.used);
            let mut plan = Vec::new();
            for layer in store.moe_layers() {
                let bytes = self.device_expert_bytes(store, layer);
                let missing: Vec<u32> = (0..store.expert_count(layer) as u32)
                    .filter(|&e| self.owns(layer, e) && !cache.contains((sid, layer as u32, e)))
                    .collect();
                let need = missing.len() as u64 * bytes;
                if need > room {
                    break;
                }
                room -= need;
                plan.push((layer, missing));
            }
            plan
        };
        let total: u64 = plan
            .iter()
            .map(|(l, m)| m.len() as u64 * self.device_expert_bytes(store, *l))
            .sum();
        progress.start(total);
        for (layer, missing) in plan {
            let bytes = self.device_expert_bytes(store, layer);
            for chunk in missing.chunks(PRELOAD_IN_FLIGHT) {
                let pinned = self.pinned_holds(store, layer, chunk);
                let mut uploads = Vec::with_capacity(chunk.len());
                for (&e, pinned) in chunk.iter().zip(pinned) {
                    let host = match pinned {
                        true => None,
                        false => Some(HostExpert::Shared(
                            store
                                .fetch(layer, &[e as usize])?
                                .pop()
                                .expect("one expert"),
                        )),
                    };
                    uploads.push(Upload { index: e, host });
                }
                self.upload_batch(store, layer, uploads, Purpose::Resident)?;
                progress.advance(chunk.len() as u64 * bytes, "filling the VRAM expert cache");
            }
        }
        progress.finish();
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
                .map(|l| self.owned_count(store, l) as u64)
                .sum();
            if slots * cache.pinned.slot_bytes as u64 > cache.pinned.budget {
                return Ok(false);
            }
        }
        progress.start(self.owned_expert_bytes(store));
        for layer in store.moe_layers() {
            let layout = self.device_layout(store, layer);
            let indices: Vec<usize> = (0..store.expert_count(layer))
                .filter(|&e| self.owns(layer, e as u32))
                .collect();
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
}
