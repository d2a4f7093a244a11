//! Expert parallelism over the GPUs of one host (`--device cuda:0,1`):
//! each MoE layer's routed experts are divided among the GPUs, everything
//! else runs on the first.
//!
//! The first GPU (rank 0) holds the dense weights, the KV caches and the
//! Gated DeltaNet states and runs every operation but the routed experts.
//! At a MoE layer it routes as one GPU would and sends the layer's input
//! rows, the selected ids and their weights to the other GPUs (an NCCL
//! broadcast); every GPU computes the slots whose expert it holds, and an
//! NCCL reduce sums the partial outputs into rank 0's. A decode token over
//! a layer resident on every GPU is divided on the devices: `moe_own_slots`
//! gives each GPU its slots and turns the others into a stand-in expert of
//! weight 0, so the one-token kernels run unchanged and nothing returns to
//! the host. Other calls (prefill chunks, several sequences' tokens,
//! streamed layers) read the ids on the host, which groups each GPU's slots
//! by expert for the grouped kernels of prefill.rs, zero in the others.
//! Per token and MoE layer the GPUs exchange the hidden state and a partial
//! sum: kilobytes, where streaming an expert moves megabytes.
//!
//! Each GPU's VRAM cache fronts its own share of the experts: when the
//! shares fit, each GPU uploads its share before the first token; when
//! they do not, each streams its share through its own pinned tier.
//!
//! The sums run in another order than on one GPU (every GPU's slots, then
//! the sum over GPUs), so results agree with one GPU's within the CUDA
//! backend's bound, not bit for bit; they do not depend on what is cached.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaSlice, DevicePtr};

use super::experts::{FfnArgs, ffn_args};
use super::nccl::{Comm, Group};
use super::{CudaBackend, CudaOptions, Routing, Tensor, Weight};
use crate::backend::ExpertFfn;
use crate::error::{Error, Result};
use crate::experts::ExpertStore;
use crate::util::Progress;

/// Which GPU (rank) holds each routed expert.
#[derive(Clone, Debug)]
pub struct ExpertPlacement {
    ranks: usize,
    /// Owners by layer and expert, where measured routing frequencies gave
    /// them; other layers are dealt round-robin.
    by_layer: HashMap<usize, Vec<u16>>,
}

impl ExpertPlacement {
    /// Expert `e` of every layer on GPU `e mod ranks`.
    pub fn round_robin(ranks: usize) -> ExpertPlacement {
        assert!(ranks >= 1, "a placement needs a GPU");
        ExpertPlacement {
            ranks,
            by_layer: HashMap::new(),
        }
    }

    /// Experts placed so each GPU holds as many experts of a layer as the
    /// others (to one) and the routing frequencies `counts[layer][expert]`
    /// measured on a workload are spread as evenly as that allows: the
    /// most used expert first, each to the GPU with the least traffic so
    /// far that still has room. Layers without counts are dealt
    /// round-robin.
    pub fn balanced(ranks: usize, counts: &BTreeMap<usize, Vec<u64>>) -> ExpertPlacement {
        assert!(
            (1..=usize::from(u16::MAX)).contains(&ranks),
            "a placement needs a GPU"
        );
        let mut by_layer = HashMap::new();
        for (&layer, counts) in counts {
            let experts = counts.len();
            let mut order: Vec<usize> = (0..experts).collect();
            order.sort_by_key(|&e| (std::cmp::Reverse(counts[e]), e));
            let room = experts.div_ceil(ranks);
            let (mut load, mut held) = (vec![0u64; ranks], vec![0usize; ranks]);
            let mut owner = vec![0u16; experts];
            for e in order {
                let rank = (0..ranks)
                    .filter(|&r| held[r] < room)
                    .min_by_key(|&r| (load[r], held[r], r))
                    .expect("ranks · room ≥ experts");
                owner[e] = rank as u16;
                load[rank] += counts[e];
                held[rank] += 1;
            }
            by_layer.insert(layer, owner);
        }
        ExpertPlacement { ranks, by_layer }
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// The GPU (rank) holding expert `expert` of `layer`.
    pub fn owner(&self, layer: usize, expert: u32) -> usize {
        match self.by_layer.get(&layer) {
            Some(owners) => owners[expert as usize] as usize,
            None => expert as usize % self.ranks,
        }
    }
}

/// `own_experts_table`s by (store, layer).
type OwnTables = Mutex<HashMap<(u64, usize), Arc<CudaSlice<u32>>>>;

/// A GPU's part in expert parallelism: its rank, the placement, and its
/// `own_experts_table`s by (store, layer).
pub(super) struct Share {
    pub(super) rank: usize,
    pub(super) placement: Arc<ExpertPlacement>,
    own: OwnTables,
}

/// Rank 0's view of the others (see the module documentation).
pub(super) struct ExpertParallel {
    /// One communicator per rank, rank 0's first; dropped before the
    /// backends whose streams they use.
    comms: Vec<Comm>,
    peers: Vec<PeerRank>,
    /// Bytes sent between GPUs so far (inputs, routing, partial outputs).
    exchanged: AtomicU64,
}

struct PeerRank {
    backend: CudaBackend,
    /// Rank 0's per-expert biases (gpt-oss) copied to this GPU, by their
    /// address on rank 0.
    biases: Mutex<HashMap<u64, Arc<Weight>>>,
}

impl CudaBackend {
    /// A backend computing on the devices `ordinals`, the first holding
    /// everything but the routed experts, which `placement` divides among
    /// them (see the module documentation); one device is a plain
    /// [`CudaBackend::with_options`]. Steps are not recorded as graphs.
    pub fn on_devices(
        ordinals: &[usize],
        options: CudaOptions,
        placement: ExpertPlacement,
    ) -> Result<CudaBackend> {
        let names = ordinals
            .iter()
            .map(|o| o.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let Some((&first, others)) = ordinals.split_first() else {
            return Err(Error::invalid("--device", "no CUDA device named"));
        };
        if others.is_empty() {
            return CudaBackend::with_options(first, options);
        }
        if (1..ordinals.len()).any(|i| ordinals[..i].contains(&ordinals[i])) {
            return Err(Error::invalid(
                format!("--device cuda:{names}"),
                "a device is named twice",
            ));
        }
        if placement.ranks() != ordinals.len() {
            return Err(Error::invalid(
                "--expert-placement",
                format!(
                    "the placement is for {} GPUs, --device names {}",
                    placement.ranks(),
                    ordinals.len()
                ),
            ));
        }
        let options = CudaOptions {
            graphs: Some(false),
            batched_steps: Some(false),
            ..options
        };
        let placement = Arc::new(placement);
        let share = |rank| Share {
            rank,
            placement: placement.clone(),
            own: Mutex::new(HashMap::new()),
        };
        let mut primary = CudaBackend::with_options(first, options)?;
        primary.share = Some(share(0));
        let mut peers = Vec::with_capacity(others.len());
        for (i, &ordinal) in others.iter().enumerate() {
            let mut backend = CudaBackend::with_options(ordinal, options)?;
            backend.share = Some(share(i + 1));
            peers.push(PeerRank {
                backend,
                biases: Mutex::new(HashMap::new()),
            });
        }
        let streams: Vec<_> = std::iter::once(primary.stream.clone())
            .chain(peers.iter().map(|p| p.backend.stream.clone()))
            .collect();
        let comms = Comm::for_streams(&streams)?;
        let version = super::nccl::version()?;
        let devices: Vec<String> = std::iter::once(&primary)
            .chain(peers.iter().map(|p| &p.backend))
            .map(|b| b.description.clone())
            .collect();
        primary.description = format!(
            "{} GPUs, experts divided among them (NCCL {version}): {}",
            ordinals.len(),
            devices.join("; ")
        );
        primary.parallel = Some(ExpertParallel {
            comms,
            peers,
            exchanged: AtomicU64::new(0),
        });
        Ok(primary)
    }

    /// Whether this GPU holds expert `expert` of `layer` (always, alone).
    pub(super) fn owns(&self, layer: usize, expert: u32) -> bool {
        self.share
            .as_ref()
            .is_none_or(|s| s.placement.owner(layer, expert) == s.rank)
    }

    /// How many experts of `layer` this GPU holds.
    pub(super) fn owned_count(&self, store: &ExpertStore, layer: usize) -> usize {
        let experts = store.expert_count(layer);
        match self.share {
            None => experts,
            Some(_) => (0..experts as u32).filter(|&e| self.owns(layer, e)).count(),
        }
    }

    /// Bytes of the experts this GPU holds, as stored (on one GPU,
    /// [`ExpertStore::total_expert_bytes`]).
    pub(super) fn owned_expert_bytes(&self, store: &ExpertStore) -> u64 {
        store
            .moe_layers()
            .map(|l| {
                let blob = store.blob_layout(l).expect("an MoE layer's experts");
                self.owned_count(store, l) as u64 * blob.nbytes as u64
            })
            .sum()
    }

    /// Every GPU of the backend, this one first.
    pub(super) fn ranks(&self) -> impl Iterator<Item = &CudaBackend> {
        std::iter::once(self).chain(
            self.parallel
                .iter()
                .flat_map(|p| p.peers.iter().map(|p| &p.backend)),
        )
    }

    /// Bytes exchanged between the GPUs so far.
    pub(super) fn exchanged_bytes(&self) -> u64 {
        self.parallel
            .as_ref()
            .map_or(0, |p| p.exchanged.load(Ordering::Relaxed))
    }

    /// The routed experts of `x` summed over every GPU's share (see the
    /// module documentation).
    pub(super) fn parallel_routed_experts(
        &self,
        parallel: &ExpertParallel,
        x: &Tensor,
        routing: &Routing,
        store: &ExpertStore,
        layer: usize,
        ffn: ExpertFfn<'_, CudaBackend>,
    ) -> Result<Tensor> {
        let (n, hidden, top_k) = (x.rows, x.cols, routing.top_k);
        // A decode token whose layer is resident on every GPU is divided on
        // the devices, without a round trip; otherwise the host groups the
        // slots by expert and GPU.
        let on_device = n == 1 && self.layer_resident(store, layer);
        let orders = match on_device {
            true => None,
            false => {
                let ids = self.routing_on_host(routing)?;
                let placement = &self.share.as_ref().expect("parallel").placement;
                let mut orders = vec![BTreeMap::<u32, Vec<u32>>::new(); parallel.peers.len() + 1];
                for (slot, &expert) in ids.iter().enumerate() {
                    let rank = placement.owner(layer, expert);
                    orders[rank].entry(expert).or_default().push(slot as u32);
                }
                let orders: Vec<Vec<(u32, Vec<u32>)>> = orders
                    .into_iter()
                    .map(|o| o.into_iter().collect())
                    .collect();
                Some((ids, orders))
            }
        };

        // The other GPUs' copies of the input rows and the routing.
        let mut inputs = Vec::with_capacity(parallel.peers.len());
        for peer in &parallel.peers {
            let b = &peer.backend;
            let what = "expert inputs from the first GPU";
            inputs.push((
                b.alloc::<f32>(what, n * hidden)?,
                b.alloc::<u32>(what, n * top_k)?,
                b.alloc::<f32>(what, n * top_k)?,
            ));
        }
        let (row_bytes, slot_bytes) = (n * hidden * 4, n * top_k * 4);
        let group = Group::start()?;
        // SAFETY: every buffer holds the bytes given and lives until the
        // streams that the collectives are queued on are past them: rank
        // 0's are the caller's, the others' are dropped (freed in stream
        // order) at the end of this call, after the reduce below.
        unsafe {
            let root = &parallel.comms[0];
            group.broadcast(root, address(self, &x.data), row_bytes, 0)?;
            group.broadcast(root, address(self, &routing.experts), slot_bytes, 0)?;
            group.broadcast(root, address(self, &routing.weights), slot_bytes, 0)?;
            for ((peer, comm), (xs, experts, weights)) in
                parallel.peers.iter().zip(&parallel.comms[1..]).zip(&inputs)
            {
                let b = &peer.backend;
                group.broadcast(comm, address(b, xs), row_bytes, 0)?;
                group.broadcast(comm, address(b, experts), slot_bytes, 0)?;
                group.broadcast(comm, address(b, weights), slot_bytes, 0)?;
            }
        }
        group.end()?;

        // The other GPUs' shares are queued first, so that they compute
        // while this one queues its own.
        let mut partials = Vec::with_capacity(parallel.peers.len());
        for (i, (peer, (xs, experts, weights))) in parallel.peers.iter().zip(inputs).enumerate() {
            let b = &peer.backend;
            let x = Tensor {
                rows: n,
                cols: hidden,
                data: xs,
            };
            let routing = Routing {
                top_k,
                rows: n,
                experts,
                weights,
                host_experts: match &orders {
                    Some((ids, _)) => OnceLock::from(ids.to_vec()),
                    None => OnceLock::new(),
                },
            };
            let biases = match ffn.biases {
                Some(ws) => Some(
                    ws.map(|w| peer.bias(self, w))
                        .into_iter()
                        .collect::<Result<Vec<_>>>()?,
                ),
                None => None,
            };
            let ffn = ffn_args(
                b,
                ExpertFfn {
                    activation: ffn.activation,
                    biases: biases.as_ref().map(|ws| [&*ws[0], &*ws[1], &*ws[2]]),
                },
            );
            partials.push(match &orders {
                None => b.own_decode_share(&x, &routing, store, layer, ffn)?,
                Some((_, orders)) => {
                    b.share_of_routed_experts(&x, &routing, store, layer, ffn, &orders[i + 1])?
                }
            });
        }
        let args = ffn_args(self, ffn);
        let own = match &orders {
            None => self.own_decode_share(x, routing, store, layer, args)?,
            Some((_, orders)) => {
                self.share_of_routed_experts(x, routing, store, layer, args, &orders[0])?
            }
        };

        let group = Group::start()?;
        // SAFETY: as above; rank 0's sum lands in `own`, returned.
        unsafe {
            group.reduce_sum(&parallel.comms[0], address(self, &own.data), n * hidden, 0)?;
            for ((peer, comm), partial) in parallel
                .peers
                .iter()
                .zip(&parallel.comms[1..])
                .zip(&partials)
            {
                group.reduce_sum(comm, address(&peer.backend, &partial.data), n * hidden, 0)?;
            }
        }
        group.end()?;
        if orders.is_some() {
            // Each GPU uploads the next layer's predicted experts it holds
            // (streamed layers; see `prefetch_on_owners`).
            for rank in self.ranks() {
                rank.decode_layer_done(store, layer, None)?;
            }
        }
        let per_peer = 2 * row_bytes + 2 * slot_bytes;
        parallel
            .exchanged
            .fetch_add((per_peer * parallel.peers.len()) as u64, Ordering::Relaxed);
        Ok(own)
    }

    /// One decode token's routed experts over this GPU's share of a layer
    /// resident on every GPU: the slots of the others' experts become a
    /// stand-in of weight 0 on the device (moe.cu `moe_own_slots`), then
    /// the decode kernels run over this GPU's address table.
    fn own_decode_share(
        &self,
        x: &Tensor,
        routing: &Routing,
        store: &ExpertStore,
        layer: usize,
        ffn: FfnArgs,
    ) -> Result<Tensor> {
        let own = self.own_experts_table(store, layer)?;
        let slots = routing.rows * routing.top_k;
        let what = "this GPU's share of the routing";
        let mut experts = self.alloc::<u32>(what, slots)?;
        let mut weights = self.alloc::<f32>(what, slots)?;
        let slots_i = super::int(slots, "routed slots");
        launch!(
            self,
            "routed experts: this GPU's slots",
            &self.kernels.moe_own_slots,
            super::grid_stride(slots),
            &routing.experts,
            &routing.weights,
            &*own,
            &mut experts,
            &mut weights,
            &slots_i
        );
        let mine = Routing {
            top_k: routing.top_k,
            rows: routing.rows,
            experts,
            weights,
            host_experts: OnceLock::new(),
        };
        let mut out = self.alloc::<f32>("routed experts", x.cols)?;
        self.decode_routed_experts(x, &mine, store, layer, ffn, None, &mut out, false)?;
        Ok(Tensor {
            rows: 1,
            cols: x.cols,
            data: out,
        })
    }

    /// `own[e]` for `moe_own_slots`: e where this GPU holds expert e of
    /// `layer`, else the first expert it holds (made once per layer).
    fn own_experts_table(&self, store: &ExpertStore, layer: usize) -> Result<Arc<CudaSlice<u32>>> {
        let share = self.share.as_ref().expect("parallel");
        let key = (store.id(), layer);
        if let Some(table) = share.own.lock().unwrap().get(&key) {
            return Ok(table.clone());
        }
        let count = store.expert_count(layer) as u32;
        let stand_in = (0..count)
            .find(|&e| self.owns(layer, e))
            .expect("a GPU holding a resident layer holds one of its experts");
        let own: Vec<u32> = (0..count)
            .map(|e| if self.owns(layer, e) { e } else { stand_in })
            .collect();
        let table = Arc::new(self.upload("this GPU's experts", &own)?);
        share.own.lock().unwrap().insert(key, table.clone());
        Ok(table)
    }

    /// The slots of `order` (this GPU's experts, with their slots) of the
    /// routed experts of `x`, zero in the rows' other slots.
    fn share_of_routed_experts(
        &self,
        x: &Tensor,
        routing: &Routing,
        store: &ExpertStore,
        layer: usize,
        ffn: FfnArgs,
        order: &[(u32, Vec<u32>)],
    ) -> Result<Tensor> {
        if order.is_empty() {
            return Ok(Tensor {
                rows: x.rows,
                cols: x.cols,
                data: self.zeros("routed experts", x.rows * x.cols)?,
            });
        }
        self.host_grouped_experts(x, routing, store, layer, ffn, order)
    }

    /// [`crate::backend::Backend::prepare_experts`] on every GPU at once,
    /// each uploading (or pinning) its share, reported as one piece of
    /// work.
    pub(super) fn prepare_all_ranks(
        &self,
        store: &ExpertStore,
        progress: &dyn Progress,
    ) -> Result<()> {
        let ranks: Vec<&CudaBackend> = self.ranks().collect();
        progress.start(ranks.iter().map(|r| r.owned_expert_bytes(store)).sum());
        let shared = Shared(progress);
        std::thread::scope(|scope| {
            let running: Vec<_> = ranks
                .iter()
                .map(|rank| {
                    let shared = &shared;
                    scope.spawn(move || rank.prepare_device_experts(store, shared))
                })
                .collect();
            running
                .into_iter()
                .map(|r| r.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect::<Result<Vec<bool>>>()
        })?;
        progress.finish();
        Ok(())
    }

    /// Passes the next layer's predicted experts to the GPUs holding them.
    pub(super) fn prefetch_on_owners(&self, store: &ExpertStore, layer: usize, experts: &[u32]) {
        for rank in self.ranks() {
            let own: Vec<u32> = experts
                .iter()
                .copied()
                .filter(|&e| rank.owns(layer, e))
                .collect();
            if !own.is_empty() {
                rank.note_prefetch(store, layer, &own);
            }
        }
    }
}

/// The progress of one GPU's part of [`CudaBackend::prepare_all_ranks`]:
/// its advances count toward the whole, which starts and finishes once.
struct Shared<'a>(&'a dyn Progress);

impl Progress for Shared<'_> {
    fn advance(&self, done: u64, what: &str) {
        self.0.advance(done, what);
    }

    fn note(&self, text: &str) {
        self.0.note(text);
    }
}

impl PeerRank {
    /// Rank 0's bias weight `w` on this GPU (copied once).
    fn bias(&self, primary: &CudaBackend, w: &Weight) -> Result<Arc<Weight>> {
        let key = address(primary, &w.data);
        if let Some(copy) = self.biases.lock().unwrap().get(&key) {
            return Ok(copy.clone());
        }
        let bytes = primary.download("expert biases", &w.data, w.data.len())?;
        let copy = Arc::new(Weight {
            name: w.name.clone(),
            layout: w.layout,
            data: self.backend.upload("expert biases", &bytes)?,
            int8: w.int8,
        });
        self.biases.lock().unwrap().insert(key, copy.clone());
        Ok(copy)
    }
}

/// The device address of `data`, a buffer of `backend`'s device.
fn address<T>(backend: &CudaBackend, data: &CudaSlice<T>) -> u64 {
    data.device_ptr(&backend.stream).0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_deals_experts_in_turn() {
        let p = ExpertPlacement::round_robin(2);
        let owners: Vec<usize> = (0..6).map(|e| p.owner(3, e)).collect();
        assert_eq!(owners, [0, 1, 0, 1, 0, 1]);
    }

    #[test]
    fn balanced_placement_spreads_traffic_and_keeps_counts_even() {
        // Two hot experts (0 and 1) must land on different GPUs, and each
        // GPU holds four of the eight experts.
        let counts = BTreeMap::from([(5, vec![100, 90, 1, 1, 1, 1, 1, 1])]);
        let p = ExpertPlacement::balanced(2, &counts);
        assert_ne!(p.owner(5, 0), p.owner(5, 1));
        let held = (0..8).filter(|&e| p.owner(5, e) == 0).count();
        assert_eq!(held, 4);
        let load = |r| {
            (0..8)
                .filter(|&e| p.owner(5, e) == r)
                .map(|e| counts[&5][e as usize])
                .sum::<u64>()
        };
        assert!(
            load(0).abs_diff(load(1)) <= 10,
            "{} vs {}",
            load(0),
            load(1)
        );
        // Layers without counts: round-robin.
        assert_eq!(p.owner(6, 3), 1);
    }

    #[test]
    fn balanced_placement_handles_uneven_expert_counts() {
        let counts = BTreeMap::from([(0, vec![5; 7])]);
        let p = ExpertPlacement::balanced(3, &counts);
        let held: Vec<usize> = (0..3)
            .map(|r| (0..7).filter(|&e| p.owner(0, e) == r).count())
            .collect();
        assert!(held.iter().all(|&h| h == 2 || h == 3), "{held:?}");
        assert_eq!(held.iter().sum::<usize>(), 7);
    }
}
