//! The routed experts of many tokens (prefill) in three launches on the
//! tensor cores (kernels/moe_prefill.cu), instead of a gather, three
//! matmuls, an activation and a scatter per expert.
//!
//! The slots (token · top_k + rank) are sorted by expert and each expert's
//! run is cut into tiles of at most [`MP_BN`] slots: on the device when
//! every expert of the layer is resident (grouped.rs), else on the host,
//! which reads the routing to fetch the missing experts. A tile names the
//! expert by its index in a table of device addresses (the layer's table,
//! indexed by expert id, when every expert is resident; else a table of
//! the experts of the launch at the same indices). Then:
//! gate and up with silu(gate)·up into `act` (one row per sorted slot),
//! down into `y` (one row per slot), and the weighted sum of each token's
//! `y` rows in rank order. Each output is computed by one block whatever
//! the other experts of its launch, so launching all experts of a layer
//! at once or a few at a time as they are streamed gives identical results.
//!
//! The arithmetic is gemm.rs's (split activations, exact integer codes),
//! so each product is within f32 rounding of the CPU's; or, for q4
//! experts with [`CudaOptions::activations`](super::CudaOptions) int8, the
//! CPU's int8 arithmetic on the integer tensor cores (activations quantized
//! per group of 64 inputs), within its bound.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::device_expert::{DeviceExpert, ExpertPart, PartsLayout, expert_inter};
use super::experts::{EXPERTS_IN_FLIGHT, FfnArgs};
use super::gemm::{Q8Rows, QuantizedRows};
use super::geometry::{
    I8_STAGES, MP_BM, MP_BN, MP_I8_STAGE_BYTES, MP_Q4_STAGE_BYTES, MP_STAGES, MP_THREADS,
};
use super::{CudaBackend, Routing, Tensor, grid_stride, int, ok};
use crate::backend::cpu::Activations;
use crate::error::Result;
use crate::experts::{Expert, ExpertStore};
use crate::quant::{DType, MatrixLayout};

/// Dynamic shared memory of the q4 kernels: their stages in flight.
pub(super) const Q4_SHARED_BYTES: usize = MP_STAGES * MP_Q4_STAGE_BYTES;

/// Dynamic shared memory of the q4 kernels of int8 activations.
const I8_SHARED_BYTES: usize = I8_STAGES * MP_I8_STAGE_BYTES;

/// Activations split for the q4 kernels (`SplitRows` in moe_prefill.cu):
/// the device addresses of their hi and lo bf16 rows and of their sums
/// per group of 64 columns.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct SplitRows {
    hi: u64,
    lo: u64,
    sums: u64,
}

// SAFETY: three u64s, laid out as the kernels' struct of three pointers.
unsafe impl DeviceRepr for SplitRows {}

impl SplitRows {
    /// For a kernel's parameter it does not use.
    const NONE: SplitRows = SplitRows {
        hi: 0,
        lo: 0,
        sums: 0,
    };
}

/// The inputs of the q4 kernels as `x` and `act` (laid out in `act`'s own
/// buffer), and the buffers behind them (kept until the kernels are
/// queued; freed in stream order after).
enum Q4Inputs {
    /// Split into bf16 halves.
    Split {
        x: SplitRows,
        act: SplitRows,
        _buffers: (CudaSlice<u16>, CudaSlice<f32>, CudaSlice<f32>),
    },
    /// Quantized to int8.
    Int8 {
        x: QuantizedRows,
        act: Q8Rows,
        _buffers: CudaSlice<f32>,
    },
}

/// What the grouped kernels of one call read besides the experts, made
/// once per call ([`CudaBackend::prefill_inputs`]) and shared by all its
/// launches: for q4 experts the layer input split or quantized and `act`'s
/// layout to match; nothing for the other types, which read `x` and `act`
/// as they are.
pub(super) struct PrefillInputs {
    q4: Option<Q4Inputs>,
}

/// The tiles of a call, four u32 each: expert (index in the table), first
/// sorted slot, slots, 0.
pub(super) struct Tiles {
    data: Vec<u32>,
    /// The tiles of each expert of the call, in `data`'s units.
    by_expert: Vec<Range<usize>>,
}

impl Tiles {
    /// Tiles for experts in `order` (expert id, its slots), whose slots
    /// lie in that order in the sorted slot list.
    pub(super) fn new(order: &[(u32, Vec<u32>)]) -> Tiles {
        let mut data = Vec::new();
        let mut by_expert = Vec::with_capacity(order.len());
        let mut start = 0;
        for (expert, slots) in order {
            let first = data.len();
            for at in (0..slots.len()).step_by(MP_BN) {
                let count = MP_BN.min(slots.len() - at);
                data.extend([*expert, (start + at) as u32, count as u32, 0]);
            }
            by_expert.push(first..data.len());
            start += slots.len();
        }
        Tiles { data, by_expert }
    }

    pub(super) fn all(&self) -> &[u32] {
        &self.data
    }

    /// The tiles of the experts at these indices of the call's order.
    pub(super) fn of(&self, experts: impl Iterator<Item = usize>) -> Vec<u32> {
        experts
            .flat_map(|i| self.data[self.by_expert[i].clone()].iter().copied())
            .collect()
    }
}

impl CudaBackend {
    /// Whether the grouped kernels take experts with these gate (or up)
    /// and down layouts: q4, q8 or bf16 (bf16 widths a multiple of 8), on
    /// sm_80 or later. Otherwise experts run one at a time.
    pub(super) fn prefill_kernels_fit(
        &self,
        gate: MatrixLayout,
        down: MatrixLayout,
    ) -> Result<bool> {
        let widths_fit = match gate.dtype {
            // Quantized widths are whole 64-column groups by construction.
            DType::Q4 | DType::Q8 | DType::Q3 | DType::Q2 | DType::Mxfp4 => true,
            DType::Bf16 => gate.cols.is_multiple_of(8) && down.cols.is_multiple_of(8),
            DType::F32 => false,
        };
        let (major, _) = ok(
            "routed experts (tensor cores)",
            self.ctx.compute_capability(),
        )?;
        Ok(widths_fit && major >= 8 && down.dtype == gate.dtype)
    }

    /// The inputs of a call's grouped kernels over experts whose gate is
    /// laid out as `gate`, `act` its activations' buffer; q4 experts' as
    /// `activations` says. Made before the expert cache is locked: its
    /// allocations may evict experts.
    pub(super) fn prefill_inputs(
        &self,
        x: &Tensor,
        act: &mut CudaSlice<f32>,
        gate: MatrixLayout,
        activations: Activations,
    ) -> Result<PrefillInputs> {
        let q4 = match (gate.dtype, activations) {
            (DType::Q4, Activations::F32) => Some(self.split_q4_inputs(x, act, gate.rows)?),
            (DType::Q4, Activations::Int8) => Some(self.quantize_q4_inputs(x, act, gate.rows)?),
            _ => None,
        };
        Ok(PrefillInputs { q4 })
    }

    /// `act` and `y` for the tiles `tiles.0` (`count` of them, or as many
    /// as the device word at address `tiles.1` says, when not 0) of a call:
    /// `act[i] = act(gate · x, up · x)` and `y[slots[i]] = down · act[i] + bias`
    /// for each sorted slot `i` of the tiles, the experts found through
    /// `table` at offsets `parts` (gate, up, down); `inputs` from
    /// [`prefill_inputs`](Self::prefill_inputs) for this `x` and `act`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_prefill_experts(
        &self,
        x: &Tensor,
        inputs: &PrefillInputs,
        top_k: usize,
        table: &CudaSlice<u64>,
        (tiles, tile_count): (&CudaSlice<u32>, u64),
        count: usize,
        slots: &CudaSlice<u32>,
        parts: &PartsLayout,
        ffn: FfnArgs,
        act: &mut CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let gate = parts.matrices[0].1;
        let (inter, hidden) = (expert_inter(&parts.matrices, x.cols), x.cols);
        let tiles_x = u32::try_from(count).expect("tiles fit a grid");
        let (inter_i, hidden_i, top_k_i) = (
            int(inter, "expert intermediate size"),
            int(hidden, "hidden size"),
            int(top_k, "top-k"),
        );
        let (gate_part, up_part, down_part) = (parts.part(0), parts.part(1), parts.part(2));
        let config = |rows_per_block: usize, rows: usize, shared_mem_bytes: usize| LaunchConfig {
            grid_dim: (tiles_x, rows.div_ceil(rows_per_block) as u32, 1),
            block_dim: (MP_THREADS, 1, 1),
            shared_mem_bytes: shared_mem_bytes as u32,
        };
        if gate.dtype == DType::Q4 {
            let q4 = Q4Launch {
                table,
                tiles: (tiles, tile_count),
                slots,
                grid: (tiles_x, inter, hidden),
                sizes: (inter_i, hidden_i, top_k_i),
                parts: (gate_part, up_part, down_part),
                ffn,
                y: y.device_ptr_mut(&self.stream).0,
            };
            return match inputs
                .q4
                .as_ref()
                .expect("prefill_inputs lays out the inputs of q4 experts")
            {
                Q4Inputs::Split { x, act, .. } => self.launch_q4_pair(
                    &q4,
                    [
                        &self.kernels.moe_prefill_gate_up_q4,
                        &self.kernels.moe_prefill_down_q4,
                    ],
                    Q4_SHARED_BYTES,
                    [x, act, &SplitRows::NONE],
                ),
                Q4Inputs::Int8 { x, act, .. } => self.launch_q4_pair(
                    &q4,
                    [
                        &self.kernels.moe_prefill_gate_up_q4_i8,
                        &self.kernels.moe_prefill_down_q4_i8,
                    ],
                    I8_SHARED_BYTES,
                    [&x.rows, act, &Q8Rows::NONE],
                ),
            };
        }
        let (gate_up, down_kernel) = match gate.dtype {
            DType::Q8 => (
                &self.kernels.moe_prefill_gate_up_q8,
                &self.kernels.moe_prefill_down_q8,
            ),
            DType::Bf16 => (
                &self.kernels.moe_prefill_gate_up_bf16,
                &self.kernels.moe_prefill_down_bf16,
            ),
            DType::Q3 => (
                &self.kernels.moe_prefill_gate_up_q3,
                &self.kernels.moe_prefill_down_q3,
            ),
            DType::Q2 => (
                &self.kernels.moe_prefill_gate_up_q2,
                &self.kernels.moe_prefill_down_q2,
            ),
            DType::Mxfp4 => (
                &self.kernels.moe_prefill_gate_up_mxfp4,
                &self.kernels.moe_prefill_down_mxfp4,
            ),
            DType::Q4 => unreachable!("q4 experts take their own kernels above"),
            DType::F32 => unreachable!("f32 experts take the per-expert path"),
        };
        // These kernels' tiles are static shared memory (29 KiB).
        launch!(
            self,
            "routed experts gate/up (tensor cores)",
            gate_up,
            config(MP_BM / 2, inter, 0),
            table,
            tiles,
            &tile_count,
            slots,
            &x.data,
            &mut *act,
            &inter_i,
            &hidden_i,
            &top_k_i,
            &gate_part,
            &up_part,
            &ffn
        );
        launch!(
            self,
            "routed experts down (tensor cores)",
            down_kernel,
            config(MP_BM, hidden, 0),
            table,
            tiles,
            &tile_count,
            slots,
            &*act,
            y,
            &hidden_i,
            &inter_i,
            &top_k_i,
            &down_part,
            &down_part,
            &ffn
        );
        Ok(())
    }

    /// A q4 call's gate/up and down `kernels` (`shared` bytes of dynamic
    /// shared memory), their activations `rows`: the layer input, `act`,
    /// and the rows of a parameter a kernel does not use.
    fn launch_q4_pair<R: DeviceRepr>(
        &self,
        call: &Q4Launch<'_>,
        kernels: [&CudaFunction; 2],
        shared: usize,
        [x, act, none]: [&R; 3],
    ) -> Result<()> {
        let (tiles_x, inter, hidden) = call.grid;
        let config = |rows_per_block: usize, rows: usize| LaunchConfig {
            grid_dim: (tiles_x, rows.div_ceil(rows_per_block) as u32, 1),
            block_dim: (MP_THREADS, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let (inter_i, hidden_i, top_k_i) = call.sizes;
        let (gate_part, up_part, down_part) = call.parts;
        let (tiles, tile_count) = call.tiles;
        let no_output = 0u64;
        launch!(
            self,
            "routed experts gate/up (tensor cores)",
            kernels[0],
            config(MP_BM / 2, inter),
            call.table,
            tiles,
            &tile_count,
            call.slots,
            x,
            &no_output,
            act,
            &inter_i,
            &hidden_i,
            &top_k_i,
            &gate_part,
            &up_part,
            &call.ffn
        );
        launch!(
            self,
            "routed experts down (tensor cores)",
            kernels[1],
            config(MP_BM, hidden),
            call.table,
            tiles,
            &tile_count,
            call.slots,
            act,
            &call.y,
            none,
            &hidden_i,
            &inter_i,
            &top_k_i,
            &down_part,
            &down_part,
            &call.ffn
        );
        Ok(())
    }

    /// The int8 q4 kernels' inputs: the layer input `x` quantized (one
    /// launch), and `act` laid out for gate/up to write and down to read
    /// (its codes in `act`'s buffer, their parameters in one of their own).
    fn quantize_q4_inputs(
        &self,
        x: &Tensor,
        act: &mut CudaSlice<f32>,
        inter: usize,
    ) -> Result<Q4Inputs> {
        const OP: &str = "routed experts (tensor cores)";
        let quantized = self.quantize_q4_activations(OP, &x.data, x.rows, x.cols)?;
        let act_rows = act.len() / inter;
        let act_params =
            self.alloc::<f32>(OP, 4 * act_rows * (inter / crate::quant::GROUP_SIZE))?;
        let act_q8 = Q8Rows {
            codes: act.device_ptr_mut(&self.stream).0,
            params: act_params.device_ptr(&self.stream).0,
        };
        Ok(Q4Inputs::Int8 {
            x: quantized,
            act: act_q8,
            _buffers: act_params,
        })
    }

    /// The q4 kernels' inputs: the layer input `x` split (one launch), and
    /// `act` laid out split for gate/up to write and down to read (hi in
    /// its first half, lo in its second, the sums in a buffer of their
    /// own).
    fn split_q4_inputs(
        &self,
        x: &Tensor,
        act: &mut CudaSlice<f32>,
        inter: usize,
    ) -> Result<Q4Inputs> {
        const OP: &str = "routed experts (tensor cores)";
        let hidden = x.cols;
        let groups = |cols: usize| cols / crate::quant::GROUP_SIZE;
        let x_halves = self.alloc::<u16>(OP, 2 * x.rows * hidden)?;
        let x_sums = self.alloc::<f32>(OP, x.rows * groups(hidden))?;
        let act_rows = act.len() / inter;
        let act_sums = self.alloc::<f32>(OP, act_rows * groups(inter))?;
        let split = |halves: u64, rows: usize, cols: usize, sums: &CudaSlice<f32>| SplitRows {
            hi: halves,
            lo: halves + (2 * rows * cols) as u64,
            sums: sums.device_ptr(&self.stream).0,
        };
        let x_split = split(x_halves.device_ptr(&self.stream).0, x.rows, hidden, &x_sums);
        let act_split = split(
            act.device_ptr_mut(&self.stream).0,
            act_rows,
            inter,
            &act_sums,
        );
        let (rows_i, hidden_i) = (int(x.rows, "tokens"), int(hidden, "hidden size"));
        launch!(
            self,
            "routed experts: splitting the input",
            &self.kernels.split_activations,
            grid_stride(x.rows * hidden / 8),
            &x.data,
            &x_split,
            &rows_i,
            &hidden_i
        );
        Ok(Q4Inputs::Split {
            x: x_split,
            act: act_split,
            _buffers: (x_halves, x_sums, act_sums),
        })
    }

    /// `out (+)= Σ_k weight[t, k] · y[t · top_k + k]` for every token `t`
    /// of `routing`, k in rank order; with `accumulate` added to `out`.
    pub(super) fn launch_prefill_combine(
        &self,
        y: &CudaSlice<f32>,
        routing: &Routing,
        out: &mut CudaSlice<f32>,
        hidden: usize,
        accumulate: bool,
    ) -> Result<()> {
        let n = routing.rows;
        let (n_i, hidden_i, top_k_i) = (
            int(n, "tokens"),
            int(hidden, "hidden size"),
            int(routing.top_k, "top-k"),
        );
        let accumulate_i = i32::from(accumulate);
        launch!(
            self,
            "routed experts combine",
            &self.kernels.moe_prefill_combine,
            grid_stride(n * hidden),
            y,
            &routing.weights,
            out,
            &n_i,
            &hidden_i,
            &top_k_i,
            &accumulate_i
        );
        Ok(())
    }
}

impl CudaBackend {
    /// Several tokens' routed experts through the grouped tensor-core
    /// kernels (see prefill.rs), or `None` when the layer's experts do not
    /// qualify (f32 experts, a device older than sm_80). `order` is each
    /// expert with its slots, ascending; `flat` the slots in that order.
    /// A complete layer runs in one launch pair over its address table;
    /// otherwise the resident experts run first, in one launch pair, while
    /// the host reads the first missing ones, then the missing experts a
    /// batch at a time. Outputs are per slot, so both give the same result.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn prefill_routed_experts(
        &self,
        x: &Tensor,
        routing: &Routing,
        store: &ExpertStore,
        layer: usize,
        ffn: FfnArgs,
        order: &[(u32, Vec<u32>)],
        flat: &[u32],
    ) -> Result<Option<Tensor>> {
        let blob = store
            .blob_layout(layer)
            .expect("routed experts of an MoE layer");
        if !self.prefill_kernels_fit(blob.gate.1, blob.down.1)? {
            if blob.gate.1.dtype.experts_only() {
                return Err(crate::error::Error::invalid(
                    "--device",
                    format!(
                        "{} experts of many tokens need the tensor-core kernels of sm_80 or \
                         later; run on the CPU or convert the experts to q4",
                        blob.gate.1.dtype.name()
                    ),
                ));
            }
            return Ok(None);
        }
        let (n, hidden, top_k) = (x.rows, x.cols, routing.top_k);
        let inter = blob.gate.1.rows;
        let tiles = Tiles::new(order);
        let tile_count = tiles.all().len() / 4;
        // Allocated first: an allocation may evict experts, which must not
        // happen between looking the layer up and queueing its kernels.
        let slots = self.upload("routed experts", flat)?;
        let all_tiles = self.upload("routed experts", tiles.all())?;
        let mut act = self.alloc::<f32>("routed experts", flat.len() * inter)?;
        let inputs = self.prefill_inputs(x, &mut act, blob.gate.1, self.activations)?;
        // Outputs by slot: slots of other GPUs' experts stay zero.
        let mut y = match flat.len() < n * top_k {
            true => self.zeros::<f32>("routed experts", n * top_k * hidden)?,
            false => self.alloc::<f32>("routed experts", flat.len() * hidden)?,
        };
        let mut out = self.alloc::<f32>("routed experts", n * hidden)?;
        let id = store.id();
        let mut ahead = self.take_prompt_ahead(store, layer)?;
        let complete = {
            let mut cache = self.experts.lock().unwrap();
            let complete = cache.complete_layer(id, layer as u32).is_some();
            if complete {
                cache.count_hits(order.len() as u64);
                let complete = cache.complete_layer(id, layer as u32).expect("checked");
                self.launch_prefill_experts(
                    x,
                    &inputs,
                    top_k,
                    &complete.addresses,
                    (&all_tiles, 0),
                    tile_count,
                    &slots,
                    &complete.parts,
                    ffn,
                    &mut act,
                    &mut y,
                )?;
            }
            complete
        };
        if !complete {
            // The experts resident now or uploaded ahead, kept alive until
            // their kernels are queued, and the others.
            let resident: Vec<Option<Arc<DeviceExpert>>> = {
                let mut cache = self.experts.lock().unwrap();
                order
                    .iter()
                    .map(|&(e, _)| {
                        cache
                            .get((id, layer as u32, e))
                            .or_else(|| ahead.remove(&e))
                    })
                    .collect()
            };
            let missing: Vec<usize> = (0..order.len())
                .filter(|&i| resident[i].is_none())
                .collect();
            let ids: Vec<u32> = missing.iter().map(|&i| order[i].0).collect();
            // Pinned experts upload from their slots; the others are read
            // by the store, a batch ahead.
            let pinned = self.pinned_holds(store, layer, &ids);
            let batches: Vec<Range<usize>> = (0..missing.len())
                .step_by(EXPERTS_IN_FLIGHT)
                .map(|start| start..(start + EXPERTS_IN_FLIGHT).min(missing.len()))
                .collect();
            let request = |batch: &Range<usize>| {
                let reads: Vec<usize> = batch
                    .clone()
                    .filter(|&j| !pinned[j])
                    .map(|j| ids[j] as usize)
                    .collect();
                store.request(layer, &reads)
            };
            let call = PrefillCall {
                x,
                inputs: &inputs,
                top_k,
                order,
                tiles: &tiles,
                all_tiles: &all_tiles,
                slots: &slots,
                experts: store.expert_count(layer),
                ffn,
            };
            // The first reads start before the resident experts compute.
            let mut next = batches.first().map(&request);
            let resident: Vec<(usize, Arc<DeviceExpert>)> = resident
                .into_iter()
                .enumerate()
                .filter_map(|(i, e)| e.map(|e| (i, e)))
                .collect();
            self.launch_prefill_group(&call, &resident, &mut act, &mut y)?;
            self.stamp_prefill_group(store, layer, order, &resident)?;
            drop(resident);
            for (i, batch) in batches.iter().enumerate() {
                let mut reads = next.take().expect("requested ahead").into_iter();
                next = batches.get(i + 1).map(&request);
                let mut read = Vec::with_capacity(batch.len());
                for j in batch.clone() {
                    read.push(match pinned[j] {
                        true => None,
                        false => Some(store.wait(reads.next().expect("one read a miss"))?),
                    });
                }
                let sources: Vec<(u32, Option<&Expert>)> = batch
                    .clone()
                    .zip(&read)
                    .map(|(j, host)| (ids[j], host.as_deref()))
                    .collect();
                let uploaded = self.upload_for_prompt(store, layer, &sources)?;
                let group: Vec<(usize, Arc<DeviceExpert>)> =
                    batch.clone().map(|j| missing[j]).zip(uploaded).collect();
                self.launch_prefill_group(&call, &group, &mut act, &mut y)?;
                self.stamp_prefill_group(store, layer, order, &group)?;
            }
        }
        if order.len() >= self.owned_count(store, layer) {
            self.upload_next_layer_ahead(store, layer)?;
        }
        self.launch_prefill_combine(&y, routing, &mut out, hidden, false)?;
        Ok(Some(Tensor {
            rows: n,
            cols: hidden,
            data: out,
        }))
    }

    /// Stamps the experts of a group (indices into `order`, with their
    /// buffers) whose kernels are queued; see [`CudaBackend::experts_used`].
    fn stamp_prefill_group(
        &self,
        store: &ExpertStore,
        layer: usize,
        order: &[(u32, Vec<u32>)],
        group: &[(usize, Arc<DeviceExpert>)],
    ) -> Result<()> {
        let ids: Vec<u32> = group.iter().map(|(i, _)| order[*i].0).collect();
        let experts: Vec<Arc<DeviceExpert>> = group.iter().map(|(_, e)| e.clone()).collect();
        self.experts_used(store, layer, &ids, &experts)
    }

    /// The grouped kernels over some experts of a call (indices into its
    /// order, with their device buffers), through a table of just those
    /// experts indexed by expert id.
    fn launch_prefill_group(
        &self,
        call: &PrefillCall<'_>,
        experts: &[(usize, Arc<DeviceExpert>)],
        act: &mut CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let Some((_, first)) = experts.first() else {
            return Ok(());
        };
        let mut addresses = vec![0u64; call.experts];
        for (i, expert) in experts {
            addresses[call.order[*i].0 as usize] = expert.address(&self.stream);
        }
        let table = self.upload("routed experts", &addresses)?;
        let subset;
        let (tiles, count) = if experts.len() == call.order.len() {
            (call.all_tiles, call.tiles.all().len() / 4)
        } else {
            let chosen = call.tiles.of(experts.iter().map(|(i, _)| *i));
            subset = self.upload("routed experts", &chosen)?;
            (&subset, chosen.len() / 4)
        };
        self.launch_prefill_experts(
            call.x,
            call.inputs,
            call.top_k,
            &table,
            (tiles, 0),
            count,
            call.slots,
            &first.parts,
            call.ffn,
            act,
            y,
        )?;
        Ok(())
    }
}

/// What the launches of one prefill call share (see
/// [`CudaBackend::launch_prefill_group`]).
struct PrefillCall<'a> {
    x: &'a Tensor,
    inputs: &'a PrefillInputs,
    top_k: usize,
    order: &'a [(u32, Vec<u32>)],
    tiles: &'a Tiles,
    all_tiles: &'a CudaSlice<u32>,
    slots: &'a CudaSlice<u32>,
    ffn: FfnArgs,
    /// Experts of the layer (the table's length).
    experts: usize,
}

/// What the two launches of a q4 call share (see
/// [`CudaBackend::launch_q4_pair`]): the experts' table, the tiles (and the
/// device word counting them, or 0), the sorted slots, the grid's tiles and
/// the rows of gate/up and of down, the sizes as the kernels take them
/// (intermediate, hidden, top-k), the matrices' places, and `y`'s address.
struct Q4Launch<'a> {
    table: &'a CudaSlice<u64>,
    tiles: (&'a CudaSlice<u32>, u64),
    slots: &'a CudaSlice<u32>,
    grid: (u32, usize, usize),
    sizes: (i32, i32, i32),
    parts: (ExpertPart, ExpertPart, ExpertPart),
    ffn: FfnArgs,
    y: u64,
}
