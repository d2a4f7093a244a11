//! Routed experts on the GPU. Experts come from the host [`ExpertStore`]
//! (its reads, checksums and host cache) and are uploaded into a VRAM
//! cache keyed by (store, layer, expert) with a byte budget, least
//! recently used out first; an expert found there needs no upload and no
//! host request. The store is part of the key because one backend may
//! serve several models.
//!
//! Tokens are grouped by expert; experts are computed one after another in
//! ascending order, each adding its weighted output to the tokens that
//! chose it, so the sum does not depend on what was cached. Host reads of
//! the next few missing experts run while the GPU computes the current
//! ones.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaView};

use super::{CudaBackend, Matrix, Routing, Tensor, device_error, grid_stride, int};
use crate::error::Result;
use crate::experts::{Expert, ExpertStore, Fetch};

/// (expert store, layer, expert)
type VramKey = (u64, u32, u32);
use crate::quant::MatrixLayout;

/// Experts whose host reads are requested together: a batch is requested
/// before the previous one computes, which bounds the host memory in
/// flight beyond the caches.
const EXPERTS_IN_FLIGHT: usize = 8;

/// Offsets of an expert's matrices in its device buffer are aligned to this.
const PART_ALIGN: usize = 256;

/// An expert's gate, up and down matrices in one device buffer.
pub(super) struct DeviceExpert {
    data: CudaSlice<u8>,
    /// (offset, layout) of gate, up and down.
    parts: [(usize, MatrixLayout); 3],
}

impl DeviceExpert {
    fn matrix(&self, part: usize, name: &'static str) -> Matrix<'_> {
        let (offset, layout) = self.parts[part];
        Matrix {
            name,
            layout,
            data: &self.data,
            offset,
        }
    }
}

/// What the VRAM expert cache has done since the backend was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpertCacheStats {
    /// Experts found resident.
    pub hits: u64,
    /// Experts uploaded from the host.
    pub uploads: u64,
    pub uploaded_bytes: u64,
    pub evictions: u64,
    pub resident_bytes: u64,
    /// `None` until the first upload when the budget is automatic.
    pub budget_bytes: Option<u64>,
}

struct Entry {
    expert: Arc<DeviceExpert>,
    bytes: u64,
    last_use: u64,
}

/// The VRAM expert cache. Entries are reference-counted: an expert evicted
/// while a layer still computes with it is freed when that layer drops it.
pub(super) struct VramCache {
    budget: Option<u64>,
    used: u64,
    clock: u64,
    entries: HashMap<VramKey, Entry>,
    /// Resident keys by last use, oldest first.
    by_use: BTreeMap<u64, VramKey>,
    stats: ExpertCacheStats,
}

impl VramCache {
    pub(super) fn new(budget: Option<u64>) -> VramCache {
        VramCache {
            budget,
            used: 0,
            clock: 0,
            entries: HashMap::new(),
            by_use: BTreeMap::new(),
            stats: ExpertCacheStats::default(),
        }
    }

    pub(super) fn budget(&self) -> Option<u64> {
        self.budget
    }

    fn get(&mut self, key: VramKey) -> Option<Arc<DeviceExpert>> {
        self.clock += 1;
        let entry = self.entries.get_mut(&key)?;
        self.by_use.remove(&entry.last_use);
        entry.last_use = self.clock;
        self.by_use.insert(self.clock, key);
        self.stats.hits += 1;
        Some(entry.expert.clone())
    }

    /// Keeps `expert` if it fits in the budget, evicting the least recently
    /// used experts to make room.
    fn insert(&mut self, key: VramKey, expert: Arc<DeviceExpert>, bytes: u64, budget: u64) {
        self.budget = Some(budget);
        self.stats.uploads += 1;
        self.stats.uploaded_bytes += bytes;
        if bytes > budget || self.entries.contains_key(&key) {
            return;
        }
        while self.used + bytes > budget && self.evict_one() {}
        self.clock += 1;
        self.by_use.insert(self.clock, key);
        self.entries.insert(
            key,
            Entry {
                expert,
                bytes,
                last_use: self.clock,
            },
        );
        self.used += bytes;
    }

    /// Drops the least recently used expert; false when none is resident.
    pub(super) fn evict_one(&mut self) -> bool {
        let Some((_, key)) = self.by_use.pop_first() else {
            return false;
        };
        let entry = self.entries.remove(&key).expect("indexed entries exist");
        self.used -= entry.bytes;
        self.stats.evictions += 1;
        true
    }

    pub(super) fn stats(&self) -> ExpertCacheStats {
        ExpertCacheStats {
            resident_bytes: self.used,
            budget_bytes: self.budget,
            ..self.stats
        }
    }
}

/// Where an expert of the current layer comes from.
enum Source {
    Resident(Arc<DeviceExpert>),
    Fetching(Fetch),
}

impl CudaBackend {
    /// See [`crate::backend::Backend::routed_experts`] and the module
    /// documentation.
    pub(super) fn compute_routed_experts(
        &self,
        x: &Tensor,
        routing: &Routing,
        store: &ExpertStore,
        layer: usize,
    ) -> Result<Tensor> {
        let (n, hidden) = (x.rows, x.cols);
        assert_eq!(
            routing.rows, n,
            "routed experts: routing is for other tokens"
        );
        // expert -> its slots (token · top_k + rank), ascending.
        let mut assigned: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for (slot, &expert) in routing.experts_on_host().iter().enumerate() {
            assigned.entry(expert).or_default().push(slot as u32);
        }
        let order: Vec<(u32, Vec<u32>)> = assigned.into_iter().collect();
        let flat: Vec<u32> = order.iter().flat_map(|(_, s)| s.iter().copied()).collect();
        let slots = self.upload("routed experts", &flat);
        let mut out = self.zeros("routed experts", n * hidden);

        let batches: Vec<&[(u32, Vec<u32>)]> = order.chunks(EXPERTS_IN_FLIGHT).collect();
        let mut next = batches.first().map(|b| self.start_batch(layer, b, store));
        let mut offset = 0;
        for i in 0..batches.len() {
            let current = next.take().expect("requested ahead");
            next = batches
                .get(i + 1)
                .map(|b| self.start_batch(layer, b, store));
            for ((_, expert_slots), source) in batches[i].iter().zip(current) {
                let expert = match source {
                    Source::Resident(expert) => expert,
                    Source::Fetching(fetch) => {
                        self.upload_expert(store.id(), layer, &*store.wait(fetch)?)?
                    }
                };
                let m = expert_slots.len();
                let rows = slots.slice(offset..offset + m);
                self.run_expert(x, &expert, &rows, m, routing, &mut out);
                offset += m;
            }
        }
        Ok(Tensor {
            rows: n,
            cols: hidden,
            data: out,
        })
    }

    /// Looks the batch's experts up in VRAM and starts host fetches of the
    /// others.
    fn start_batch(
        &self,
        layer: usize,
        batch: &[(u32, Vec<u32>)],
        store: &ExpertStore,
    ) -> Vec<Source> {
        let resident: Vec<Option<Arc<DeviceExpert>>> = {
            let mut cache = self.experts.lock().unwrap();
            batch
                .iter()
                .map(|&(e, _)| cache.get((store.id(), layer as u32, e)))
                .collect()
        };
        let missing: Vec<usize> = batch
            .iter()
            .zip(&resident)
            .filter(|(_, r)| r.is_none())
            .map(|(&(e, _), _)| e as usize)
            .collect();
        let mut fetches = store.request(layer, &missing).into_iter();
        resident
            .into_iter()
            .map(|r| match r {
                Some(expert) => Source::Resident(expert),
                None => Source::Fetching(fetches.next().expect("one fetch per missing expert")),
            })
            .collect()
    }

    /// Copies an expert read by the host store into device memory and
    /// offers it to the VRAM cache.
    fn upload_expert(&self, store: u64, layer: usize, host: &Expert) -> Result<Arc<DeviceExpert>> {
        let views = [host.gate(), host.up(), host.down()];
        let mut offsets = [0usize; 3];
        let mut total = 0;
        for (offset, view) in offsets.iter_mut().zip(&views) {
            *offset = total;
            total += view.layout.total_bytes.next_multiple_of(PART_ALIGN);
        }
        let what = || format!("uploading expert {} of layer {layer}", host.index);
        let mut data = self
            .try_alloc::<u8>(total)
            .map_err(|e| device_error(self.ordinal, what(), e))?;
        for (&offset, view) in offsets.iter().zip(&views) {
            let len = view.layout.total_bytes;
            self.stream
                .memcpy_htod(
                    &view.bytes[..len],
                    &mut data.slice_mut(offset..offset + len),
                )
                .map_err(|e| device_error(self.ordinal, what(), e))?;
        }
        let expert = Arc::new(DeviceExpert {
            data,
            parts: [
                (offsets[0], views[0].layout),
                (offsets[1], views[1].layout),
                (offsets[2], views[2].layout),
            ],
        });
        let mut cache = self.experts.lock().unwrap();
        let budget = match cache.budget() {
            Some(budget) => budget,
            // Half the device memory still free once the model is loaded:
            // the rest stays for activations and KV caches.
            None => {
                let (free, _) = self
                    .ctx
                    .mem_get_info()
                    .map_err(|e| device_error(self.ordinal, "reading free device memory", e))?;
                free as u64 / 2
            }
        };
        cache.insert(
            (store, layer as u32, host.index as u32),
            expert.clone(),
            total as u64,
            budget,
        );
        Ok(expert)
    }

    /// `out[token] += weight · down(silu(gate(x)) · up(x))` for the `m`
    /// tokens whose slots are `slots`.
    fn run_expert(
        &self,
        x: &Tensor,
        expert: &DeviceExpert,
        slots: &CudaView<'_, u32>,
        m: usize,
        routing: &Routing,
        out: &mut CudaSlice<f32>,
    ) {
        let hidden = x.cols;
        let (m_i, hidden_i, top_k) = (
            int(m, "tokens of an expert"),
            int(hidden, "hidden size"),
            int(routing.top_k, "top-k"),
        );
        let mut xs = self.alloc::<f32>("routed expert input", m * hidden);
        launch!(
            self,
            "gather_rows",
            &self.kernels.gather_rows,
            grid_stride(m * hidden),
            &x.data,
            slots,
            &mut xs,
            &m_i,
            &hidden_i,
            &top_k,
        );
        let gate = self.matmul(&xs, m, hidden, &expert.matrix(0, "expert gate"));
        let up = self.matmul(&xs, m, hidden, &expert.matrix(1, "expert up"));
        let inter = expert.parts[0].1.rows;
        let act = self.silu_mul_raw(&gate, &up, m * inter);
        let y = self.matmul(&act, m, inter, &expert.matrix(2, "expert down"));
        launch!(
            self,
            "scatter_add_rows",
            &self.kernels.scatter_add_rows,
            grid_stride(m * hidden),
            out,
            &y,
            slots,
            &routing.weights,
            &m_i,
            &hidden_i,
            &top_k,
        );
    }
}
