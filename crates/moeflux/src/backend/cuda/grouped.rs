//! Routed experts of several tokens of a resident layer, grouped by expert
//! on the device (kernels/moe_few.cu): a prompt chunk, a decode step of
//! several sequences or a check of drafted tokens needs no host round trip
//! for its routing, so the device never waits for the host between layers
//! and an engine step can be recorded (graph.rs).
//!
//! `moe_group_slots` sorts the slots by expert into tiles whose number
//! stays on the device; the expert kernels' grids are sized for the most
//! tiles the call can have. The sort is the host's (experts ascending,
//! each expert's slots ascending, runs cut at the same tile size), so a
//! prompt gives the same results bit for bit whether its layers are
//! resident (sorted here) or streamed (sorted on the host, experts.rs),
//! and whatever its chunks.
//!
//! Prompt chunks take prefill.rs's grouped kernels over tiles of
//! [`MP_BN`] slots, with the backend's activations. Engine steps (at most
//! [`DEVICE_GROUPING_MAX_TOKENS`] tokens) take f32 activations, as one
//! sequence's decode does: q4 experts moe_few.cu's kernels, which read an
//! expert's weights once for up to [`FEW_SLOTS`] of its slots on the tensor
//! cores, other encodings the grouped prefill kernels. Both then sum each
//! token's outputs in rank order.

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};

use super::device_expert::{PartsLayout, expert_bytes, expert_inter};
use super::experts::FfnArgs;
use super::geometry::{FEW_DOWN_TILES, FEW_SLOTS, FEW_WARPS, GROUP_THREADS, MP_BN};
use super::{CudaBackend, MAX_SHARED_BYTES, Routing, Tensor, int, ok};
use crate::backend::cpu::Activations;
use crate::error::Result;
use crate::experts::ExpertStore;
use crate::quant::{DType, GROUP_SIZE};

/// Most tokens of an engine step whose routed experts are grouped on the
/// device; larger steps sort on the host.
pub(super) const DEVICE_GROUPING_MAX_TOKENS: usize = 128;

/// Bytes of dynamic shared memory `moe_group_slots` takes for `experts`
/// experts: each expert's count, first sorted position and first tile,
/// and each warp's cursor into each expert's run.
fn group_shared_bytes(experts: usize) -> usize {
    4 * experts * (3 + GROUP_THREADS as usize / 32)
}

/// Bytes of dynamic shared memory moe_few.cu's kernels take for inputs of
/// `cols` columns: the B table of [`FEW_SLOTS`] rows (four rows a column
/// tile, 32 lanes × 8 bytes per step, four steps per 64-column group),
/// then Σ x per row and group, then each row's input row (an i32).
fn few_shared_bytes(cols: usize) -> usize {
    let groups = cols / GROUP_SIZE;
    FEW_SLOTS / 4 * groups * 4 * 32 * 8 + 4 * FEW_SLOTS * groups + 4 * FEW_SLOTS
}

/// The most tiles `slots` slots over `experts` experts make, cut at
/// `tile_slots`: each expert used starts one, and each full run of
/// `tile_slots` slots may add one.
fn max_tiles(slots: usize, experts: usize, tile_slots: usize) -> usize {
    slots.min(experts.min(slots) + slots / tile_slots)
}

impl CudaBackend {
    /// Each slot's expert output (`y`, `[tokens · top_k, hidden]`, bias
    /// included, not yet weighted) of `x`'s tokens, grouped by expert on
    /// the device, when the call qualifies: several-token calls grouped on
    /// the device (`MOEFLUX_CUDA_BATCHED_STEPS`, on by default), the grouped
    /// kernels for these experts on this device, every expert of the layer
    /// resident when the kernels are queued, and for an engine step at most
    /// [`DEVICE_GROUPING_MAX_TOKENS`] tokens. `None`: nothing was queued,
    /// and the caller takes the host's path.
    /// [`CudaBackend::launch_prefill_combine`] sums the slots.
    pub(super) fn grouped_expert_outputs(
        &self,
        x: &Tensor,
        routing: &Routing,
        store: &ExpertStore,
        layer: usize,
        ffn: FfnArgs,
    ) -> Result<Option<CudaSlice<f32>>> {
        let (n, hidden, top_k) = (x.rows, x.cols, routing.top_k);
        let Some(limit) = self.tc_shared_limit else {
            return Ok(None);
        };
        let step = self.in_engine_step();
        if !self.batched_steps || (step && n > DEVICE_GROUPING_MAX_TOKENS) {
            return Ok(None);
        }
        let blob = store
            .blob_layout(layer)
            .expect("routed experts of an MoE layer");
        let experts = store.expert_count(layer);
        let group_shared = group_shared_bytes(experts);
        if !self.prefill_kernels_fit(blob.gate.1, blob.down.1)? || group_shared > MAX_SHARED_BYTES {
            return Ok(None);
        }
        let inter = blob.gate.1.rows;
        let few = step
            && blob.gate.1.dtype == DType::Q4
            && few_shared_bytes(hidden).max(few_shared_bytes(inter)) <= limit;
        let tile_slots = if few { FEW_SLOTS } else { MP_BN };
        let slots = n * top_k;
        let tiles = max_tiles(slots, experts, tile_slots);
        let expert_bytes = expert_bytes(store, layer);
        let op = "routed experts (grouped on the device)";
        // Allocated first: an allocation may evict experts, which must not
        // happen between looking the layer up and queueing its kernels.
        let mut sorted = self.alloc::<u32>(op, slots)?;
        let mut tile_list = self.alloc::<u32>(op, 4 * tiles)?;
        let mut tile_count = self.alloc::<u32>(op, 1)?;
        let mut act = self.alloc::<f32>(op, slots * inter)?;
        let mut y = self.alloc::<f32>(op, slots * hidden)?;
        // moe_few.cu's kernels read x and act as they are; an engine step
        // computes in f32, as one sequence's decode step does.
        let activations = match step {
            true => Activations::F32,
            false => self.activations,
        };
        let inputs = match few {
            true => None,
            false => Some(self.prefill_inputs(x, &mut act, blob.gate.1, activations)?),
        };
        {
            let cache = self.experts.lock().unwrap();
            let Some(complete) = cache.complete_layer(store.id(), layer as u32) else {
                return Ok(None);
            };
            let (slots_i, experts_i, tile_slots_i, tiles_i) = (
                int(slots, "slots"),
                int(experts, "experts"),
                int(tile_slots, "tile slots"),
                int(tiles, "tiles"),
            );
            let used = self.batched_expert_bytes.device_ptr(&self.stream).0;
            launch!(
                self,
                "routed experts: grouping by expert",
                &self.kernels.moe_group_slots,
                LaunchConfig {
                    grid_dim: (1, 1, 1),
                    block_dim: (GROUP_THREADS, 1, 1),
                    shared_mem_bytes: group_shared as u32,
                },
                &routing.experts,
                &slots_i,
                &experts_i,
                &tile_slots_i,
                &tiles_i,
                &mut sorted,
                &mut tile_list,
                &mut tile_count,
                &used,
                &expert_bytes
            );
            if few {
                self.launch_few_experts(
                    x,
                    top_k,
                    &complete.addresses,
                    (&tile_list, &tile_count, tiles),
                    &sorted,
                    &complete.parts,
                    ffn,
                    &mut act,
                    &mut y,
                )?;
            } else {
                let count = tile_count.device_ptr(&self.stream).0;
                self.launch_prefill_experts(
                    x,
                    inputs.as_ref().expect("made where not few"),
                    top_k,
                    &complete.addresses,
                    (&tile_list, count),
                    tiles,
                    &sorted,
                    &complete.parts,
                    ffn,
                    &mut act,
                    &mut y,
                )?;
            }
        }
        Ok(Some(y))
    }

    /// moe_few.cu's q4 kernels over the tiles `tiles` (their list, their
    /// count on the device, the most there can be): `act` by sorted
    /// position, then `y` by slot.
    #[allow(clippy::too_many_arguments)]
    fn launch_few_experts(
        &self,
        x: &Tensor,
        top_k: usize,
        table: &CudaSlice<u64>,
        (tiles, tile_count, most): (&CudaSlice<u32>, &CudaSlice<u32>, usize),
        sorted: &CudaSlice<u32>,
        layout: &PartsLayout,
        ffn: FfnArgs,
        act: &mut CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let hidden = x.cols;
        let inter = expert_inter(&layout.matrices, hidden);
        let (inter_i, hidden_i, top_k_i) = (
            int(inter, "expert intermediate size"),
            int(hidden, "hidden size"),
            int(top_k, "top-k"),
        );
        let most = u32::try_from(most).expect("tiles fit a grid");
        let config = |rows_per_block: usize, rows: usize, cols: usize| LaunchConfig {
            grid_dim: (rows.div_ceil(rows_per_block) as u32, most, 1),
            block_dim: ((FEW_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: few_shared_bytes(cols) as u32,
        };
        let (gate, up, down) = (layout.part(0), layout.part(1), layout.part(2));
        launch!(
            self,
            "routed experts gate/up (few tokens)",
            &self.kernels.moe_few_gate_up_q4,
            config(16 * FEW_WARPS, inter, hidden),
            table,
            tiles,
            tile_count,
            sorted,
            &x.data,
            &mut *act,
            &inter_i,
            &hidden_i,
            &top_k_i,
            &gate,
            &up,
            &ffn
        );
        launch!(
            self,
            "routed experts down (few tokens)",
            &self.kernels.moe_few_down_q4,
            config(16 * FEW_WARPS * FEW_DOWN_TILES, hidden, inter),
            table,
            tiles,
            tile_count,
            sorted,
            &*act,
            y,
            &hidden_i,
            &inter_i,
            &down,
            &ffn
        );
        Ok(())
    }

    /// Expert bytes the several-token calls grouped on the device have
    /// used (each distinct expert once per call), as counted there.
    pub(super) fn grouped_expert_bytes(&self) -> Result<u64> {
        let op = "reading the grouped experts' bytes";
        let host = ok(op, self.stream.clone_dtoh(&self.batched_expert_bytes))?;
        ok(op, self.stream.synchronize())?;
        Ok(host[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The grids cover every tile a call can make, whatever its routing:
    /// each token's slots name distinct experts, and an expert's slots are
    /// cut into tiles of at most `tile_slots`.
    #[test]
    fn the_tile_bound_covers_every_routing() {
        let mut rng = crate::util::SplitMix64(3);
        for _ in 0..2000 {
            let experts = 1 + rng.below(40) as usize;
            let top_k = 1 + rng.below(experts.min(8) as u64) as usize;
            let tokens = 1 + rng.below(70) as usize;
            let tile_slots = [4, 8, 32][rng.below(3) as usize];
            let mut count = vec![0usize; experts];
            for _ in 0..tokens {
                // top_k distinct experts, skewed towards the first ones.
                let mut chosen = Vec::new();
                while chosen.len() < top_k {
                    let e = rng.below(experts as u64).min(rng.below(experts as u64)) as usize;
                    if !chosen.contains(&e) {
                        chosen.push(e);
                    }
                }
                chosen.iter().for_each(|&e| count[e] += 1);
            }
            let tiles: usize = count.iter().map(|c| c.div_ceil(tile_slots)).sum();
            assert!(
                tiles <= max_tiles(tokens * top_k, experts, tile_slots),
                "{tiles} tiles of {tokens} tokens, top-{top_k} of {experts}, cut at {tile_slots}"
            );
        }
    }
}
