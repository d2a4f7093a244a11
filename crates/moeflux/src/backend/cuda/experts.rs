//! Routed experts on the GPU. Experts come from the host [`ExpertStore`]
//! (its reads, checksums and host cache) through a pinned host tier and
//! are uploaded into a VRAM cache keyed by (store, layer, expert) with a
//! byte budget (`streaming.rs`); an expert found there needs no upload and
//! no host request. The store is part of the key because one backend may
//! serve several models.
//!
//! One token (decode) runs two fused kernels over its top-k experts, which
//! find each expert through a table of device addresses. When every expert
//! of the layer is resident (the whole model fits the budget: see
//! [`CudaBackend::prepare_device_experts`]) the table is the layer's,
//! indexed by the ids `route` left on the device, and nothing returns to
//! the host. Otherwise the host reads the ids, makes the missing experts
//! resident and passes a table of just the selected ones: the same kernels,
//! so the results are identical either way.
//!
//! Several tokens (prefill, in prefill.rs) are sorted by expert into tiles
//! of up to 32 slots and run in three launches over the same
//! kind of address table: the layer's, or a table per batch of streamed
//! experts (host reads of the next batch run while the GPU computes the
//! current one). Outputs are per slot and summed in rank order at the end,
//! so the result does not depend on what was cached.

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig};

use super::device_expert::{DeviceExpert, PART_ALIGN, PartsLayout, expert_bytes, expert_inter};
use super::geometry::{
    DOWN_WARPS, GATE_UP_WARPS, MAX_TOP_K, TC_B_LANES, TC_DOWN_MAX_WARPS, TC_DOWN_SPLIT,
};
use super::vram_cache::VramCache;
use super::{CudaBackend, Routing, Tensor, device_error, grid_stride, int};
use crate::backend::ExpertFfn;
use crate::config::ExpertActivation;
use crate::error::Result;
use crate::experts::{ExpertStore, Fetch};
use crate::quant::DType;
use crate::util::Progress;

/// Device memory the automatic budget leaves free for KV caches and
/// activations: this much, or a tenth of the device, whichever is more.
const RESERVE_BYTES: u64 = 4 << 30;

/// Experts whose host reads are requested together: a batch is requested
/// before the previous one computes, which bounds the host memory in
/// flight beyond the caches.
pub(super) const EXPERTS_IN_FLIGHT: usize = 8;

/// Bytes of shared memory one token's input of `cols` values takes staged
/// for the tensor-core products of matvec_tc.cu (`tc_staged_words`): a B
/// table (`tc_table_words`: 4 · 2 words per B lane per 64 columns) and the
/// groups' Σ x (padded to an even count of words).
pub(super) fn tc_staged_bytes(cols: usize) -> usize {
    let groups = cols / 64;
    4 * (groups * 4 * TC_B_LANES * 2 + groups.next_multiple_of(2))
}

/// Bytes of shared memory moe_down_tc_q4 takes for `top_k` experts of
/// `inter` columns: per expert its staged input, then 16 partial sums per
/// expert and share of its groups.
fn down_tc_shared_bytes(top_k: usize, inter: usize) -> usize {
    top_k * tc_staged_bytes(inter) + 4 * 16 * top_k * TC_DOWN_SPLIT
}

/// Where an expert of the current layer comes from.
enum Source {
    Resident(Arc<DeviceExpert>),
    Fetching(Fetch),
}

impl CudaBackend {
    /// Whether every expert of `layer` is in VRAM (of the GPU holding it),
    /// so the store has nothing to predict or prefetch for it.
    pub(super) fn layer_resident(&self, store: &ExpertStore, layer: usize) -> bool {
        self.ranks().all(|rank| {
            let cache = rank.experts.lock().unwrap();
            cache.complete_layer(store.id(), layer as u32).is_some()
        })
    }

    /// The VRAM expert budget: as configured, or the device memory free
    /// now less a reserve for KV caches and activations.
    pub(super) fn expert_budget(&self, cache: &VramCache) -> Result<u64> {
        if let Some(budget) = cache.budget() {
            return Ok(budget);
        }
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(|e| device_error(self.ordinal, "reading free device memory", e))?;
        let reserve = RESERVE_BYTES.max(total as u64 / 10);
        Ok((free as u64).saturating_sub(reserve))
    }

    /// Uploads every expert of the model when they all fit in the VRAM
    /// budget, so that decoding never waits for the host; otherwise leaves
    /// the cache to fill as experts are used. Returns whether they fit.
    pub fn prepare_device_experts(
        &self,
        store: &ExpertStore,
        progress: &dyn Progress,
    ) -> Result<bool> {
        let budget = self.expert_budget(&self.experts.lock().unwrap())?;
        // The experts this GPU holds, each part padded to PART_ALIGN.
        let total = self.owned_expert_bytes(store);
        let padded = total
            + store
                .moe_layers()
                .map(|l| self.owned_count(store, l) as u64)
                .sum::<u64>()
                * 3
                * PART_ALIGN as u64;
        if padded > budget {
            // Streamed: every expert pinned in host memory first, when
            // they fit there.
            self.preload_pinned(store, progress)?;
            self.fill_vram(store, progress)?;
            return Ok(false);
        }
        progress.start(total);
        for layer in store.moe_layers() {
            self.upload_resident_layer(store, layer, EXPERTS_IN_FLIGHT * 4, progress)?;
        }
        progress.finish();
        Ok(true)
    }

    /// See [`crate::backend::Backend::routed_experts`] and the module
    /// documentation.
    pub(super) fn compute_routed_experts(
        &self,
        x: &Tensor,
        routing: &Routing,
        store: &ExpertStore,
        layer: usize,
        ffn: ExpertFfn<'_, CudaBackend>,
    ) -> Result<Tensor> {
        if let Some(parallel) = &self.parallel {
            return self.parallel_routed_experts(parallel, x, routing, store, layer, ffn);
        }
        let cpu_ffn = ffn;
        let ffn = ffn_args(self, ffn);
        let (n, hidden) = (x.rows, x.cols);
        assert_eq!(
            routing.rows, n,
            "routed experts: routing is for other tokens"
        );
        if n == 1 {
            let mut out = self.alloc::<f32>("routed experts", hidden)?;
            self.decode_routed_experts(
                x,
                routing,
                store,
                layer,
                ffn,
                Some(cpu_ffn),
                &mut out,
                false,
            )?;
            return Ok(Tensor {
                rows: 1,
                cols: hidden,
                data: out,
            });
        }
        if let Some(y) = self.grouped_expert_outputs(x, routing, store, layer, ffn)? {
            let mut out = self.alloc::<f32>("routed experts", n * hidden)?;
            self.launch_prefill_combine(&y, routing, &mut out, hidden, false)?;
            return Ok(Tensor {
                rows: n,
                cols: hidden,
                data: out,
            });
        }
        // expert -> its slots (token · top_k + rank), ascending.
        let mut assigned: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for (slot, &expert) in self.routing_on_host(routing)?.iter().enumerate() {
            assigned.entry(expert).or_default().push(slot as u32);
        }
        let order: Vec<(u32, Vec<u32>)> = assigned.into_iter().collect();
        self.host_grouped_experts(x, routing, store, layer, ffn, &order)
    }

    /// The routed experts of the slots of `order` (experts with their
    /// slots, ascending), grouped by expert on the host: the grouped
    /// tensor-core kernels, or one expert at a time where those do not
    /// apply. Slots not in `order` contribute nothing.
    pub(super) fn host_grouped_experts(
        &self,
        x: &Tensor,
        routing: &Routing,
        store: &ExpertStore,
        layer: usize,
        ffn: FfnArgs,
        order: &[(u32, Vec<u32>)],
    ) -> Result<Tensor> {
        let (n, hidden) = (x.rows, x.cols);
        self.experts.lock().unwrap().stats.batched_expert_bytes +=
            order.len() as u64 * expert_bytes(store, layer);
        let flat: Vec<u32> = order.iter().flat_map(|(_, s)| s.iter().copied()).collect();
        if let Some(out) =
            self.prefill_routed_experts(x, routing, store, layer, ffn, order, &flat)?
        {
            return Ok(out);
        }
        let slots = self.upload("routed experts", &flat)?;
        let mut out = self.zeros("routed experts", n * hidden)?;

        let batches: Vec<&[(u32, Vec<u32>)]> = order.chunks(EXPERTS_IN_FLIGHT).collect();
        let mut next = batches.first().map(|b| self.start_batch(layer, b, store));
        let mut offset = 0;
        for i in 0..batches.len() {
            let current = next.take().expect("requested ahead");
            next = batches
                .get(i + 1)
                .map(|b| self.start_batch(layer, b, store));
            for ((e, expert_slots), source) in batches[i].iter().zip(current) {
                let expert = match source {
                    Source::Resident(expert) => expert,
                    Source::Fetching(fetch) => {
                        self.upload_expert(store, layer, &*store.wait(fetch)?)?
                    }
                };
                let m = expert_slots.len();
                let rows = slots.slice(offset..offset + m);
                self.run_expert(x, (*e, &expert), ffn, &rows, m, routing, &mut out)?;
                offset += m;
            }
        }
        Ok(Tensor {
            rows: n,
            cols: hidden,
            data: out,
        })
    }

    /// `out += routed experts` (see [`crate::backend::Backend::routed_experts_add`]).
    pub(super) fn add_routed_experts(
        &self,
        out: &mut Tensor,
        x: &Tensor,
        routing: &Routing,
        store: &ExpertStore,
        layer: usize,
        ffn: ExpertFfn<'_, CudaBackend>,
    ) -> Result<()> {
        assert!(
            out.rows == x.rows && out.cols == x.cols,
            "routed experts: output [{}, {}] for input [{}, {}]",
            out.rows,
            out.cols,
            x.rows,
            x.cols
        );
        if let Some(parallel) = &self.parallel {
            let y = self.parallel_routed_experts(parallel, x, routing, store, layer, ffn)?;
            return crate::backend::Backend::add_assign(self, out, &y);
        }
        let args = ffn_args(self, ffn);
        if x.rows == 1 {
            return self.decode_routed_experts(
                x,
                routing,
                store,
                layer,
                args,
                Some(ffn),
                &mut out.data,
                true,
            );
        }
        if let Some(y) = self.grouped_expert_outputs(x, routing, store, layer, args)? {
            return self.launch_prefill_combine(&y, routing, &mut out.data, x.cols, true);
        }
        let y = self.compute_routed_experts(x, routing, store, layer, ffn)?;
        crate::backend::Backend::add_assign(self, out, &y)
    }

    /// One token, into `out` (added to it with `accumulate`): the fused
    /// kernels over the layer's address table when the layer is complete,
    /// else over a table of the selected experts made resident by the host,
    /// less those the CPU computes (hybrid.rs; only given `cpu_ffn`, the
    /// experts' computation for it).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn decode_routed_experts(
        &self,
        x: &Tensor,
        routing: &Routing,
        store: &ExpertStore,
        layer: usize,
        ffn: FfnArgs,
        cpu_ffn: Option<ExpertFfn<'_, CudaBackend>>,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        let top_k = routing.top_k;
        let inter = store
            .blob_layout(layer)
            .expect("routed experts of an MoE layer")
            .gate
            .1
            .rows;
        // Allocated first: an allocation may evict experts, which must not
        // happen between looking the layer up and queueing its kernels.
        let mut act = self.alloc::<f32>("routed experts", top_k * inter)?;
        {
            let mut cache = self.experts.lock().unwrap();
            if cache.complete_layer(store.id(), layer as u32).is_some() {
                // Several GPUs run every slot of the token, the others' as
                // stand-ins (parallel.rs): the first GPU counts the token's.
                if self.share.as_ref().is_none_or(|share| share.rank == 0) {
                    cache.count_hits(top_k as u64);
                }
                let complete = cache
                    .complete_layer(store.id(), layer as u32)
                    .expect("checked");
                self.launch_decode_experts(
                    x,
                    &complete.addresses,
                    &routing.experts,
                    routing,
                    complete.parts,
                    ffn,
                    &mut act,
                    out,
                    accumulate,
                )?;
                drop(cache);
                return self.decode_layer_done(store, layer, None);
            }
        }
        // Streamed: the ids to the host, the missing experts uploaded in
        // one batch on the copy stream, the same kernels over a table of
        // the selected experts.
        let ids = self.routing_on_host(routing)?;
        if let Some(cpu_ffn) = cpu_ffn
            && let Some(cpu) = self.experts_for_cpu(store, layer, ids, x, routing, cpu_ffn)?
        {
            return self.hybrid_decode_experts(
                x, routing, store, layer, ffn, cpu, &mut act, out, accumulate,
            );
        }
        self.run_streamed(
            x, routing, ids, store, layer, ffn, &mut act, out, accumulate,
        )
    }

    /// The experts `ids` (one for each of `routing`'s slots, in order) made
    /// resident, the missing ones uploaded in one batch on the copy stream,
    /// and run by the fused kernels over a table of their own.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_streamed(
        &self,
        x: &Tensor,
        routing: &Routing,
        ids: &[u32],
        store: &ExpertStore,
        layer: usize,
        ffn: FfnArgs,
        act: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        let experts = self.stream_experts(store, layer, ids)?;
        let addresses: Vec<u64> = experts.iter().map(|e| e.address(&self.stream)).collect();
        let table = self.upload("routed experts", &addresses)?;
        let ranks = self.upload("routed experts", &(0..ids.len() as u32).collect::<Vec<_>>())?;
        let parts = experts[0].parts;
        self.launch_decode_experts(x, &table, &ranks, routing, parts, ffn, act, out, accumulate)?;
        // The experts stay alive until the kernels are queued and are
        // stamped with the event after them (see streaming.rs).
        self.decode_layer_done(store, layer, Some((ids, &experts)))
    }

    /// `act = act(gate · x, up · x)` for each selected expert, then
    /// `out (+)= Σ weight · (down · act + bias)`, the experts found through
    /// `table[ids[k]]` (their biases by `routing.experts`).
    #[allow(clippy::too_many_arguments)]
    fn launch_decode_experts(
        &self,
        x: &Tensor,
        table: &CudaSlice<u64>,
        ids: &CudaSlice<u32>,
        routing: &Routing,
        parts: PartsLayout,
        ffn: FfnArgs,
        act: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        let gate = parts.matrices[0].1;
        let (inter, hidden, top_k) = (expert_inter(&parts.matrices, x.cols), x.cols, routing.top_k);
        let (gate_up, down_kernel) = match gate.dtype {
            DType::F32 => (&self.kernels.moe_gate_up_f32, &self.kernels.moe_down_f32),
            DType::Bf16 => (&self.kernels.moe_gate_up_bf16, &self.kernels.moe_down_bf16),
            DType::Q8 => (&self.kernels.moe_gate_up_q8, &self.kernels.moe_down_q8),
            DType::Q4 => (&self.kernels.moe_gate_up_q4, &self.kernels.moe_down_q4),
            DType::Q3 => (&self.kernels.moe_gate_up_q3, &self.kernels.moe_down_q3),
            DType::Q2 => (&self.kernels.moe_gate_up_q2, &self.kernels.moe_down_q2),
            DType::Mxfp4 => (
                &self.kernels.moe_gate_up_mxfp4,
                &self.kernels.moe_down_mxfp4,
            ),
        };
        let vec = super::linear::vector_cols(gate.dtype);
        assert!(
            hidden.is_multiple_of(vec) && inter.is_multiple_of(vec),
            "routed experts: sizes {hidden} and {inter} must be multiples of {vec} for {}",
            gate.dtype.name()
        );
        assert!(
            top_k <= MAX_TOP_K,
            "routed experts: top-{top_k} exceeds the {MAX_TOP_K} the kernels take"
        );
        let (inter_i, hidden_i, top_k_i, experts_i) = (
            int(inter, "expert intermediate size"),
            int(hidden, "hidden size"),
            int(top_k, "top-k"),
            int(table.len(), "experts"),
        );
        let (gate_part, up_part, down_part) = (parts.part(0), parts.part(1), parts.part(2));
        let accumulate_i = i32::from(accumulate);
        launch!(
            self,
            "routed experts gate/up",
            gate_up,
            LaunchConfig {
                grid_dim: (inter.div_ceil(GATE_UP_WARPS) as u32, top_k as u32, 1),
                block_dim: ((GATE_UP_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            },
            table,
            ids,
            &x.data,
            &mut *act,
            &inter_i,
            &hidden_i,
            &gate_part,
            &up_part,
            &experts_i,
            &ffn,
            &routing.experts
        );
        // q4 downs run on the tensor cores where the device has them and
        // the experts' B tables fit in shared memory (matvec_tc.cu).
        let tc_shared = down_tc_shared_bytes(top_k, inter);
        let tensor_cores = gate.dtype == DType::Q4
            && parts.matrices[2].0.is_multiple_of(8)
            && self.tc_shared_limit.is_some_and(|limit| tc_shared <= limit);
        let (down_kernel, down_config) = if tensor_cores {
            (
                &self.kernels.moe_down_tc_q4,
                LaunchConfig {
                    grid_dim: (hidden.div_ceil(16) as u32, 1, 1),
                    block_dim: (
                        ((top_k * TC_DOWN_SPLIT).min(TC_DOWN_MAX_WARPS) * 32) as u32,
                        1,
                        1,
                    ),
                    shared_mem_bytes: tc_shared as u32,
                },
            )
        } else {
            (
                down_kernel,
                LaunchConfig {
                    grid_dim: (hidden as u32, 1, 1),
                    block_dim: ((DOWN_WARPS * 32) as u32, 1, 1),
                    shared_mem_bytes: 0,
                },
            )
        };
        launch!(
            self,
            "routed experts down",
            down_kernel,
            down_config,
            table,
            ids,
            &routing.weights,
            &*act,
            out,
            &hidden_i,
            &inter_i,
            &top_k_i,
            &down_part,
            &accumulate_i,
            &ffn,
            &routing.experts
        );
        Ok(())
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

    /// `out[token] += weight · down(silu(gate(x)) · up(x))` for the `m`
    /// tokens whose slots are `slots`.
    #[allow(clippy::too_many_arguments)]
    fn run_expert(
        &self,
        x: &Tensor,
        (id, expert): (u32, &DeviceExpert),
        ffn: FfnArgs,
        slots: &CudaView<'_, u32>,
        m: usize,
        routing: &Routing,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let hidden = x.cols;
        let (m_i, hidden_i, top_k) = (
            int(m, "tokens of an expert"),
            int(hidden, "hidden size"),
            int(routing.top_k, "top-k"),
        );
        let mut xs = self.alloc::<f32>("routed expert input", m * hidden)?;
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
        let gate = self.matmul(&xs, m, hidden, &expert.matrix(0, "expert gate"))?;
        let up = self.matmul(&xs, m, hidden, &expert.matrix(1, "expert up"))?;
        let inter = expert.parts.matrices[0].1.rows;
        let (m_l, inter_i) = (m as i64, int(inter, "expert intermediate size"));
        let mut act = self.alloc::<f32>("routed expert activation", m * inter)?;
        launch!(
            self,
            "expert_act_rows",
            &self.kernels.expert_act_rows,
            grid_stride(m * inter),
            &gate,
            &up,
            &mut act,
            &m_l,
            &inter_i,
            &id,
            &ffn
        );
        let mut y = self.matmul(&act, m, inter, &expert.matrix(2, "expert down"))?;
        launch!(
            self,
            "expert_down_bias_rows",
            &self.kernels.expert_down_bias_rows,
            grid_stride(m * hidden),
            &mut y,
            &m_l,
            &hidden_i,
            &id,
            &ffn
        );
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
        Ok(())
    }
}

/// [`ExpertFfn`] as the kernels take it (`ExpertFfn` in moe.cu): the
/// biases' device addresses (0: none) and the clamp (`limit` 0: plain
/// SwiGLU).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct FfnArgs {
    gate_bias: u64,
    up_bias: u64,
    down_bias: u64,
    limit: f32,
    alpha: f32,
}

// SAFETY: plain data laid out as the kernels' struct (C layout, device
// addresses as 64-bit integers).
unsafe impl DeviceRepr for FfnArgs {}

pub(super) fn ffn_args(b: &CudaBackend, ffn: ExpertFfn<'_, CudaBackend>) -> FfnArgs {
    let address = |w: &super::Weight| w.data.device_ptr(&b.stream).0;
    let [gate_bias, up_bias, down_bias] = ffn.biases.map_or([0; 3], |ws| ws.map(address));
    let (limit, alpha) = match ffn.activation {
        ExpertActivation::SwiGlu => (0.0, 0.0),
        ExpertActivation::ClampedSwiGlu { limit, alpha } => (limit, alpha),
    };
    FfnArgs {
        gate_bias,
        up_bias,
        down_bias,
        limit,
        alpha,
    }
}
