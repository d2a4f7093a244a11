//! Hybrid decode: when a layer of a decode step selects experts that are
//! not in VRAM, the CPU computes some of them from the host's expert cache
//! while the GPU computes the others, the missing ones among those
//! uploaded over PCIe. What crosses the bus for a CPU expert is the token's
//! activations (one row each way), not the expert's weights.
//!
//! The CPU takes a fraction of each layer's missing experts, and each
//! layer's finishing order moves it: down when the GPU's share (its
//! kernels and the copy stream's uploads) was done before the CPU's
//! products, up (by a third of that step) when not. The fraction so
//! settles where the CPU finishes first in three layers of four, on
//! whatever the host's cores and the link can do, without a model of
//! either. Not at one layer in two: a layer waits for the later of its
//! two shares, and the CPU's time varies more than the GPU's, so a CPU
//! that is usually first costs less than one that is first half the
//! time. The next layer's prefetch leaves the CPU the same fraction of
//! the experts predicted for it. Only experts whose bytes are
//! in the expert store's memory qualify (the CPU never waits for a disk
//! read).
//!
//! A worker thread computes the CPU's share (its parallel regions on the
//! CPU pool, one thread of which it leaves to the decode thread) while the
//! decode thread queues the GPU's: queueing is tens of driver calls, about
//! 100 µs a layer, which would otherwise come before the CPU starts. The
//! decode thread then waits for the worker and adds its result.
//!
//! The decode path asks `experts_for_cpu` for the CPU's share of a layer
//! and, when there is one, runs the layer through `hybrid_decode_experts`.
//!
//! Which experts the CPU takes depends on timing, so results may differ
//! between runs in the last bits (the CPU sums in another order than the
//! GPU, within the backends' agreed bounds); `CpuExperts::Off` gives the
//! GPU every expert, as before.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, DevicePtr};

use super::experts::FfnArgs;
use super::{CudaBackend, Routing, Tensor, Weight, device_error, ok};
use crate::backend::ExpertFfn;
use crate::backend::cpu::Activations;
use crate::backend::cpu::moe::{Ffn, weighted_experts};
use crate::backend::cpu::pool::spin_until;
use crate::config::ExpertActivation;
use crate::error::Result;
use crate::experts::{Expert, ExpertStore};

/// Whether decode steps may compute the experts missing from VRAM on the
/// CPU (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuExperts {
    /// The GPU computes every expert; missing ones are uploaded.
    Off,
    /// The CPU takes the fraction of the missing experts that finishes
    /// with the GPU's share; its products take their activations as
    /// `activations` says.
    Auto { activations: Activations },
    /// The CPU computes every missing expert whose bytes are in the store's
    /// memory (a GPU behind a slow link; and the tests of this path).
    All { activations: Activations },
}

impl Default for CpuExperts {
    fn default() -> CpuExperts {
        CpuExperts::Auto {
            activations: Activations::F32,
        }
    }
}

/// The CPU's fraction of a layer's missing experts before any layer's
/// finishing order has moved it.
const FIRST_FRACTION: f64 = 0.5;

/// How far a layer whose GPU share finished first moves the CPU's
/// fraction down.
const BALANCE_STEP: f64 = 0.02;

/// The share of layers in which the CPU's products should finish before
/// the GPU's share (see the module documentation).
const CPU_FIRST: f64 = 0.75;

/// Experts of a layer: (store, layer) and their indices.
type LayerExperts = ((u64, u32), Vec<u32>);

/// The experts' gate, up and down biases of a layer, on the host.
type HostBiases = Arc<[Vec<f32>; 3]>;

/// A token's inputs to the experts the CPU computes.
pub(super) struct CpuInputs {
    pub(super) x: Vec<f32>,
    /// The routing weights of the token's selected experts, in order.
    pub(super) weights: Vec<f32>,
    activation: ExpertActivation,
    biases: Option<HostBiases>,
}

/// The hybrid decode's settings and state.
pub(super) struct Hybrid {
    activations: Activations,
    /// Every eligible expert to the CPU, whatever the fraction.
    every: bool,
    fraction: Mutex<Fraction>,
    /// The experts of a layer (by store and layer) that its prefetch left
    /// to the CPU: the layer gives them to the CPU if it selects them.
    left: Mutex<Option<LayerExperts>>,
    /// Host copies of the experts' biases (gpt-oss), by the device address
    /// of the gate bias.
    biases: Mutex<HashMap<u64, HostBiases>>,
    /// The thread that computes a layer's CPU share while the decode
    /// thread queues the GPU's.
    worker: CpuWorker,
}

/// The CPU's fraction of the missing experts: moved by each layer's
/// finishing order, or fixed (`MOEFLUX_CUDA_CPU_SHARE`, to measure).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Fraction {
    of_missing: f64,
    moves: bool,
    /// How far a layer whose CPU share finished first moves the fraction
    /// up: `BALANCE_STEP * (1 - q) / q` for a CPU first in a share `q` of
    /// the layers, so that at that share the steps up and down cancel.
    up_step: f64,
}

impl Fraction {
    /// A fixed fraction (`fixed_percent` of the missing experts), or one
    /// that moves until the CPU finishes first in `cpu_first_percent` of
    /// the layers ([`CPU_FIRST`] when `None`).
    fn new(fixed_percent: Option<f64>, cpu_first_percent: Option<f64>) -> Fraction {
        let q = cpu_first_percent.map_or(CPU_FIRST, |p| (p / 100.0).clamp(0.05, 0.95));
        let up_step = BALANCE_STEP * (1.0 - q) / q;
        match fixed_percent {
            Some(p) => Fraction {
                of_missing: (p / 100.0).clamp(0.0, 1.0),
                moves: false,
                up_step,
            },
            None => Fraction {
                of_missing: FIRST_FRACTION,
                moves: true,
                up_step,
            },
        }
    }

    /// How many of `missing` experts (at most `eligible`) the CPU takes
    /// beside the `committed` it computes already: the fraction of them
    /// all, less those committed.
    fn share(&mut self, (missing, eligible, committed): (usize, usize, usize)) -> usize {
        let total = (self.of_missing * (missing + committed) as f64).round() as usize;
        let share = total.saturating_sub(committed).min(eligible);
        if share + committed == 0 && eligible > 0 {
            // A layer the CPU sits out has no finishing order to learn
            // from: the fraction leans towards the CPU until it takes one.
            self.finished(false);
        }
        share
    }

    /// Moves the fraction by the order a layer's two shares finished in.
    fn finished(&mut self, gpu_first: bool) {
        if self.moves {
            self.of_missing = match gpu_first {
                true => (self.of_missing - BALANCE_STEP).max(0.0),
                false => (self.of_missing + self.up_step).min(1.0),
            };
        }
    }
}

/// A layer's CPU share for the worker: the token's activations, the
/// experts with their routing weights, how to compute them.
struct CpuJob {
    x: Vec<f32>,
    chosen: Vec<(Arc<Expert>, f32)>,
    activations: Activations,
    activation: ExpertActivation,
    biases: Option<HostBiases>,
}

/// What the worker returns: the weighted sum, or the panic it caught.
type CpuResult = std::thread::Result<(Vec<f32>, Duration)>;

/// A job for the worker and where its result goes (a channel of its own:
/// threads decoding on one backend at once each get their own result).
type Sent = (CpuJob, mpsc::Sender<CpuResult>);

/// A thread running [`weighted_experts`] on the jobs it is sent (its
/// parallel regions on the CPU pool, as the decode thread's would be).
struct CpuWorker {
    /// `None` once dropped, or where the thread could not be started.
    jobs: Option<mpsc::Sender<Sent>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// How long a receiver of jobs or results spins before it blocks.
    spin: Duration,
}

impl CpuWorker {
    fn start() -> CpuWorker {
        let (jobs, received) = mpsc::channel::<Sent>();
        let spin = crate::tuning::cpu_spin();
        let thread = std::thread::Builder::new()
            .name("moeflux-cpu-experts".into())
            .spawn(move || {
                // The decode thread queues the GPU's share meanwhile.
                crate::backend::cpu::pool::leave_free(1);
                while let Ok((job, reply)) = spin_recv(&received, spin) {
                    // A caller gone (its layer failed) wants no result.
                    let _ = reply.send(job.run());
                }
            })
            .ok();
        CpuWorker {
            jobs: thread.is_some().then_some(jobs),
            thread,
            spin,
        }
    }
}

/// Receives from `from`, spinning for up to `spin` before it blocks: a
/// layer hands a job over and its result back every few hundred
/// microseconds, and waking a blocked thread costs microseconds (more in a
/// virtual machine), twice a layer.
fn spin_recv<T>(from: &mpsc::Receiver<T>, spin: Duration) -> Result<T, mpsc::RecvError> {
    let polled = spin_until(spin, 64, || match from.try_recv() {
        Ok(value) => Some(Ok(value)),
        Err(mpsc::TryRecvError::Disconnected) => Some(Err(mpsc::RecvError)),
        Err(mpsc::TryRecvError::Empty) => None,
    });
    polled.unwrap_or_else(|| from.recv())
}

impl Drop for CpuWorker {
    fn drop(&mut self) {
        // Closing the channel ends the worker's loop.
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Hybrid {
    pub(super) fn new(setting: CpuExperts) -> Option<Hybrid> {
        match setting {
            CpuExperts::Off => None,
            CpuExperts::Auto { activations } | CpuExperts::All { activations } => Some(Hybrid {
                activations,
                every: matches!(setting, CpuExperts::All { .. }),
                fraction: Mutex::new(Fraction::new(
                    crate::tuning::cuda_cpu_share(),
                    crate::tuning::cuda_cpu_first(),
                )),
                left: Mutex::new(None),
                biases: Mutex::new(HashMap::new()),
                worker: CpuWorker::start(),
            }),
        }
    }
}

impl CudaBackend {
    /// The number of `missing` experts of a layer (of which `eligible`
    /// have their bytes in host memory) the CPU takes now beside the
    /// `committed` it computes already, or 0 when the backend does not
    /// compute experts on the CPU.
    pub(super) fn cpu_experts_now(&self, counts: (usize, usize, usize)) -> usize {
        match self.hybrid_decode() {
            None => 0,
            Some(hybrid) if hybrid.every => counts.1,
            Some(hybrid) => hybrid.fraction.lock().unwrap().share(counts),
        }
    }

    /// Notes the experts of `layer` its prefetch left to the CPU.
    pub(super) fn leave_to_cpu(&self, store: &ExpertStore, layer: usize, experts: Vec<u32>) {
        if let Some(hybrid) = self.hybrid_decode() {
            *hybrid.left.lock().unwrap() = Some(((store.id(), layer as u32), experts));
        }
    }

    /// The experts the prefetch of `layer` left to the CPU (taken: once).
    pub(super) fn left_to_cpu(&self, store: &ExpertStore, layer: usize) -> Vec<u32> {
        let Some(hybrid) = self.hybrid_decode() else {
            return Vec::new();
        };
        match hybrid.left.lock().unwrap().take() {
            Some((key, experts)) if key == (store.id(), layer as u32) => experts,
            _ => Vec::new(),
        }
    }

    /// The hybrid decode's state when this GPU computes experts on the CPU
    /// (not where several GPUs divide them).
    pub(super) fn hybrid_decode(&self) -> Option<&Hybrid> {
        self.hybrid.as_ref().filter(|_| self.share.is_none())
    }

    /// What the CPU needs of a token before the GPU's share is queued (a
    /// download then waits for nothing else): its activations, routing
    /// weights, and the experts' biases where they have them.
    pub(super) fn cpu_inputs(
        &self,
        x: &Tensor,
        routing: &Routing,
        ffn: ExpertFfn<'_, CudaBackend>,
    ) -> Result<CpuInputs> {
        let hybrid = self.hybrid_decode().expect("the CPU computes experts");
        let op = "experts on the CPU";
        self.note_unrecordable();
        let x_host = ok(op, self.stream.clone_dtoh(&x.data.slice(..x.cols)))?;
        let weights = ok(op, self.stream.clone_dtoh(&routing.weights))?;
        ok(op, self.stream.synchronize())?;
        let biases = match ffn.biases {
            Some(ws) => Some(self.host_biases(hybrid, ws)?),
            None => None,
        };
        Ok(CpuInputs {
            x: x_host,
            weights,
            activation: ffn.activation,
            biases,
        })
    }

    /// Starts `Σ weight · expert(x)` over `chosen` (experts in host memory
    /// with their routing weights) on the CPU worker; where it has none,
    /// [`CudaBackend::finish_cpu_experts`] computes it on this thread.
    fn start_cpu_experts(&self, inputs: CpuInputs, chosen: Vec<(Arc<Expert>, f32)>) -> CpuWork {
        let hybrid = self.hybrid_decode().expect("the CPU computes experts");
        let bytes = chosen.iter().map(|(e, _)| e.nbytes() as u64).sum();
        let experts = chosen.len() as u64;
        let job = CpuJob {
            x: inputs.x,
            chosen,
            activations: hybrid.activations,
            activation: inputs.activation,
            biases: inputs.biases,
        };
        let (reply, result) = mpsc::channel();
        let here = match &hybrid.worker.jobs {
            Some(jobs) => jobs.send((job, reply)).err().map(|unsent| unsent.0.0),
            None => Some(job),
        };
        CpuWork {
            here,
            result,
            spin: hybrid.worker.spin,
            bytes,
            experts,
        }
    }

    /// The CPU's result of [`CudaBackend::start_cpu_experts`], counted in
    /// the cache's statistics.
    fn finish_cpu_experts(&self, work: CpuWork) -> Result<Vec<f32>> {
        let result = match work.here {
            Some(job) => job.run(),
            None => spin_recv(&work.result, work.spin).map_err(|_| {
                device_error(self.ordinal, "experts on the CPU", "the CPU worker stopped")
            })?,
        };
        let (y, elapsed) = result.unwrap_or_else(|panic| resume_unwind(panic));
        let seconds = elapsed.as_secs_f64();
        let mut cache = self.experts.lock().unwrap();
        cache.stats.cpu_experts += work.experts;
        cache.stats.cpu_expert_bytes += work.bytes;
        cache.stats.cpu_nanos += (seconds * 1e9) as u64;
        Ok(y)
    }

    /// Events after the work queued so far on the compute and copy streams.
    fn gpu_side_events(&self) -> Result<Vec<cudarc::driver::CudaEvent>> {
        let op = "experts on the CPU";
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let mut events = vec![ok(op, self.stream.record_event(flags))?];
        if let Some(streams) = &self.experts.lock().unwrap().streams {
            events.push(ok(op, streams.copy.record_event(flags))?);
        }
        Ok(events)
    }

    /// The experts' gate, up and down biases on the host, downloaded once.
    fn host_biases(&self, hybrid: &Hybrid, ws: [&Weight; 3]) -> Result<HostBiases> {
        let key = ws[0].data.device_ptr(&self.stream).0;
        if let Some(biases) = hybrid.biases.lock().unwrap().get(&key) {
            return Ok(biases.clone());
        }
        let mut host: [Vec<f32>; 3] = Default::default();
        for (h, w) in host.iter_mut().zip(ws) {
            let bytes = self.download("expert biases", &w.data, w.data.len())?;
            *h = bytemuck::pod_collect_to_vec(&bytes);
        }
        let host = Arc::new(host);
        hybrid.biases.lock().unwrap().insert(key, host.clone());
        Ok(host)
    }

    /// The experts of `ids` the CPU takes now: missing from VRAM, in the
    /// store's memory, as many as its fraction gives it (the last
    /// selected first); `None` when it takes none.
    pub(super) fn experts_for_cpu(
        &self,
        store: &ExpertStore,
        layer: usize,
        ids: &[u32],
        x: &Tensor,
        routing: &Routing,
        cpu_ffn: ExpertFfn<'_, CudaBackend>,
    ) -> Result<Option<CpuShare>> {
        if self.hybrid_decode().is_none() {
            return Ok(None);
        }
        let missing: Vec<(usize, u32)> = {
            let cache = self.experts.lock().unwrap();
            ids.iter()
                .copied()
                .enumerate()
                .filter(|&(_, e)| !cache.contains((store.id(), layer as u32, e)))
                .collect()
        };
        // Those the prefetch left to the CPU go to it; its fraction shares
        // the others.
        let left = self.left_to_cpu(store, layer);
        let (mut chosen, mut eligible): (Vec<_>, Vec<_>) =
            in_host_memory(store, layer, missing.iter().copied())
                .into_iter()
                .partition(|(k, _)| left.contains(&ids[*k]));
        let counts = (missing.len() - chosen.len(), eligible.len(), chosen.len());
        let take = self.cpu_experts_now(counts);
        chosen.extend(eligible.split_off(eligible.len() - take));
        if chosen.is_empty() {
            return Ok(None);
        }
        Ok(Some(CpuShare {
            inputs: self.cpu_inputs(x, routing, cpu_ffn)?,
            chosen,
        }))
    }

    /// A decode step's layer whose experts `cpu.chosen` the CPU computes
    /// while the GPU computes the others (uploaded where missing); the next
    /// layer's prefetch is queued before the CPU starts, so the copy
    /// stream works meanwhile.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn hybrid_decode_experts(
        &self,
        x: &Tensor,
        routing: &Routing,
        store: &ExpertStore,
        layer: usize,
        ffn: FfnArgs,
        cpu: CpuShare,
        act: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        let ids = routing.experts_on_host()?;
        let on_cpu: Vec<usize> = cpu.chosen.iter().map(|(k, _)| *k).collect();
        let (gpu_ids, gpu_weights): (Vec<u32>, Vec<f32>) = (0..routing.top_k)
            .filter(|k| !on_cpu.contains(k))
            .map(|k| (ids[k], cpu.inputs.weights[k]))
            .unzip();
        let chosen: Vec<(Arc<Expert>, f32)> = cpu
            .chosen
            .into_iter()
            .map(|(k, e)| (e, cpu.inputs.weights[k]))
            .collect();
        // The CPU starts first: queueing the GPU's share is tens of driver
        // calls, which the CPU's products then overlap.
        let work = self.start_cpu_experts(cpu.inputs, chosen);
        let on_gpu = !gpu_ids.is_empty();
        if on_gpu {
            let share = Routing {
                top_k: gpu_ids.len(),
                rows: 1,
                experts: self.upload("routed experts", &gpu_ids)?,
                weights: self.upload("routed experts", &gpu_weights)?,
                host_experts: gpu_ids.clone().into(),
            };
            self.run_streamed(x, &share, &gpu_ids, store, layer, ffn, act, out, accumulate)?;
        } else {
            self.decode_layer_done(store, layer, None)?;
        }
        let gpu_done = self.gpu_side_events()?;
        let y = self.finish_cpu_experts(work)?;
        if let Some(hybrid) = self.hybrid_decode() {
            let mut done = true;
            for event in &gpu_done {
                done &= ok("experts on the CPU", event.try_is_complete())?;
            }
            hybrid.fraction.lock().unwrap().finished(done);
        }
        if on_gpu || accumulate {
            let y = self.upload("experts on the CPU", &y)?;
            self.add_assign_raw(out, &y, x.cols)?;
        } else {
            ok(
                "experts on the CPU",
                self.stream.memcpy_htod(&y, &mut out.slice_mut(..x.cols)),
            )?;
        }
        Ok(())
    }
}

/// The experts of `ids` whose bytes the store holds in memory, with their
/// places in `ids`.
pub(super) fn in_host_memory(
    store: &ExpertStore,
    layer: usize,
    ids: impl IntoIterator<Item = (usize, u32)>,
) -> Vec<(usize, Arc<Expert>)> {
    ids.into_iter()
        .filter_map(|(k, e)| store.peek(layer, e as usize).map(|x| (k, x)))
        .collect()
}

/// A layer's CPU share on its way: sent to the worker, or (`here`) to be
/// computed on the decode thread.
struct CpuWork {
    here: Option<CpuJob>,
    /// The worker's answer, unless computed `here`.
    result: mpsc::Receiver<CpuResult>,
    /// How long waiting for `result` spins before it blocks.
    spin: Duration,
    bytes: u64,
    experts: u64,
}

impl CpuJob {
    fn run(self) -> CpuResult {
        catch_unwind(AssertUnwindSafe(|| {
            let start = Instant::now();
            let ffn = Ffn {
                activation: self.activation,
                biases: self
                    .biases
                    .as_deref()
                    .map(|[g, u, d]| [&g[..], &u[..], &d[..]]),
            };
            let y = weighted_experts(&self.x, &self.chosen, self.activations, ffn);
            (y, start.elapsed())
        }))
    }
}

/// The experts the CPU takes in a decode step's layer (their places among
/// the selected and their bytes in host memory), and the token's inputs.
pub(super) struct CpuShare {
    inputs: CpuInputs,
    chosen: Vec<(usize, Arc<Expert>)>,
}

#[cfg(test)]
mod tests {
    use super::{BALANCE_STEP, FIRST_FRACTION, Fraction};

    #[test]
    fn the_cpu_takes_its_fraction_of_the_missing_experts() {
        let mut half = Fraction::new(Some(50.0), None);
        assert_eq!(half.share((8, 8, 0)), 4);
        // Never more than the eligible ones.
        assert_eq!(half.share((8, 3, 0)), 3);
        // Experts it computes already count: 2 committed of 8 leave 2.
        assert_eq!(half.share((6, 6, 2)), 2);
        assert_eq!(half.share((4, 4, 4)), 0);
        assert_eq!(Fraction::new(Some(100.0), None).share((5, 5, 0)), 5);
        assert_eq!(Fraction::new(Some(0.0), None).share((5, 5, 0)), 0);
        // A fixed fraction does not move.
        half.finished(true);
        assert_eq!(half, Fraction::new(Some(50.0), None));
    }

    #[test]
    fn the_finishing_order_moves_the_fraction_within_bounds() {
        let mut f = Fraction::new(None, None);
        assert_eq!(f.of_missing, FIRST_FRACTION);
        f.finished(true);
        assert!((f.of_missing - (FIRST_FRACTION - BALANCE_STEP)).abs() < 1e-12);
        for _ in 0..100 {
            f.finished(true);
        }
        assert_eq!(f.of_missing, 0.0);
        assert_eq!(f.share((8, 8, 0)), 0);
        // Layers the CPU sits out lean towards it until it takes one.
        let mut layers = 0;
        while f.share((8, 8, 0)) == 0 {
            layers += 1;
            assert!(layers < 100, "the fraction stays at {}", f.of_missing);
        }
        assert_eq!(f.share((8, 8, 0)), 1);
        for _ in 0..1000 {
            f.finished(false);
        }
        assert_eq!(f.of_missing, 1.0);
        assert_eq!(f.share((8, 5, 0)), 5);
        // Nothing eligible: nothing to learn, nothing moves.
        let mut none = Fraction::new(None, None);
        assert_eq!(none.share((8, 0, 0)), 0);
        assert_eq!(none.of_missing, FIRST_FRACTION);
    }

    #[test]
    fn the_fraction_settles_where_the_cpu_finishes_first_as_often_as_asked() {
        // A model host: the CPU finishes first when a uniform draw is above
        // the fraction, so it is first in `1 - fraction` of the layers and
        // the fraction should settle at `1 - q`.
        for (percent, settles) in [(None, 0.25), (Some(50.0), 0.5), (Some(85.0), 0.15)] {
            let mut f = Fraction::new(None, percent);
            let mut seed = 0x2545_f491_4f6c_dd1du64;
            let mut sum = 0.0;
            let layers = 200_000;
            for layer in 0..layers {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let draw = (seed >> 11) as f64 / (1u64 << 53) as f64;
                f.finished(draw <= f.of_missing);
                if layer >= layers / 2 {
                    sum += f.of_missing;
                }
            }
            let mean = sum / (layers - layers / 2) as f64;
            assert!(
                (mean - settles).abs() < 0.02,
                "aimed at {percent:?}: settled at {mean}, not {settles}"
            );
        }
    }
}
