//! Hybrid decode: when a layer of a decode step selects experts that are
//! not in VRAM, the CPU computes some of them from the host's expert cache
//! while the GPU computes the others, the missing ones among those
//! uploaded over PCIe. What crosses the bus for a CPU expert is the token's
//! activations (one row each way), not the expert's weights.
//!
//! Which experts go where is a cost model's choice, made per layer from
//! throughputs measured as the model runs: the copy stream's bytes per
//! second (its timed upload batches) and the CPU's on the experts it
//! computed (a moving average). A worker thread computes the CPU's share
//! (its parallel regions on the CPU pool) while the decode thread queues
//! the GPU's, then the decode thread waits for it and adds it; the CPU
//! takes experts only while it computes them faster per byte than the
//! link uploads them; then it takes as many of the missing
//! experts as finish no later than the uploads would, counting the uploads
//! already queued ahead of them; the next layer's prefetch leaves it the
//! same share of the experts predicted for it. Only experts whose bytes
//! are in the expert store's memory qualify (the CPU never waits for a
//! disk read), and an upload stays cached where a CPU computation does not,
//! so ties go to the upload.
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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, DevicePtr};

use super::experts::FfnArgs;
use super::{CudaBackend, Routing, Tensor, Weight, device_error, ok};
use crate::backend::ExpertFfn;
use crate::backend::cpu::Activations;
use crate::backend::cpu::moe::{Ffn, weighted_experts};
use crate::config::ExpertActivation;
use crate::error::Result;
use crate::experts::{Expert, ExpertStore};

/// Whether decode steps may compute the experts missing from VRAM on the
/// CPU (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuExperts {
    /// The GPU computes every expert; missing ones are uploaded.
    Off,
    /// The cost model chooses, expert by expert; the CPU's products take
    /// their activations as `activations` says.
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

/// Host time a layer's CPU share costs beyond its products (the token's
/// activations and routing weights down, the result back up) before it
/// has been measured.
const CPU_OVERHEAD_FIRST_GUESS: f64 = 30e-6;

/// The CPU's throughput before it has computed an expert, bytes per second.
const CPU_FIRST_GUESS: f64 = 20e9;

/// The copy stream's throughput before an upload has been timed.
const PCIE_FIRST_GUESS: f64 = 20e9;

/// Weight of the newest measurement in the CPU's moving average.
const CPU_AVERAGE_WEIGHT: f64 = 0.1;

/// The CPU's first computations, not measured: its threads start and the
/// experts' pages are first touched.
const CPU_WARM_UP: usize = 4;

/// After this many layers in a row where the CPU could have taken experts
/// and the cost model gave it none, it takes one: its throughput is
/// measured again, so one slow measurement cannot shut it out for good.
const CPU_RETRY_AFTER: usize = 256;

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

/// The hybrid decode's settings and measurements.
pub(super) struct Hybrid {
    activations: Activations,
    /// Every eligible expert to the CPU, without the cost model.
    every: bool,
    /// Seconds per byte the CPU's experts took (moving average), and
    /// how many computations it has seen.
    cpu_seconds_per_byte: Mutex<(Option<f64>, usize)>,
    /// Seconds the decode thread spent on a layer's CPU share beside its
    /// products (moving average): the downloads, the result's upload.
    overhead_seconds: Mutex<(Option<f64>, usize)>,
    /// Layers in a row where the cost model gave the CPU nothing it could
    /// have taken.
    declined: AtomicUsize,
    /// The experts of a layer (by store and layer) that its prefetch left
    /// to the CPU: the layer gives them to the CPU if it selects them.
    left: Mutex<Option<LayerExperts>>,
    /// Host copies of the experts' biases (gpt-oss), by the device address
    /// of the gate bias.
    biases: Mutex<HashMap<u64, HostBiases>>,
    /// The CPU's fraction of the missing experts, moved by each layer's
    /// finishing order (`balance`), or fixed.
    fraction: Option<Mutex<f64>>,
    balance: bool,
    /// The thread that computes a layer's CPU share while the decode
    /// thread queues the GPU's.
    worker: CpuWorker,
}

/// How far one layer's finishing order moves the CPU's fraction.
const BALANCE_STEP: f64 = 0.02;

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
    jobs: Mutex<Option<mpsc::Sender<Sent>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl CpuWorker {
    fn start() -> CpuWorker {
        let (jobs, received) = mpsc::channel::<Sent>();
        let thread = std::thread::Builder::new()
            .name("moeflux-cpu-experts".into())
            .spawn(move || {
                for (job, reply) in received {
                    // A caller gone (its layer failed) wants no result.
                    let _ = reply.send(job.run());
                }
            })
            .ok();
        CpuWorker {
            jobs: Mutex::new(Some(jobs)),
            thread: Mutex::new(thread),
        }
    }
}

impl Drop for CpuWorker {
    fn drop(&mut self) {
        // Closing the channel ends the worker's loop.
        self.jobs.lock().unwrap().take();
        if let Some(thread) = self.thread.lock().unwrap().take() {
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
                cpu_seconds_per_byte: Mutex::new((None, 0)),
                overhead_seconds: Mutex::new((None, 0)),
                declined: AtomicUsize::new(0),
                left: Mutex::new(None),
                biases: Mutex::new(HashMap::new()),
                fraction: match crate::tuning::cuda_cpu_share().as_deref() {
                    Some("balance") => Some(Mutex::new(0.5)),
                    Some(p) => p.parse::<f64>().ok().map(|p| Mutex::new(p / 100.0)),
                    None => None,
                },
                balance: crate::tuning::cuda_cpu_share().as_deref() == Some("balance"),
                worker: CpuWorker::start(),
            }),
        }
    }

    fn cpu_seconds_per_byte(&self) -> f64 {
        self.cpu_seconds_per_byte
            .lock()
            .unwrap()
            .0
            .unwrap_or(1.0 / CPU_FIRST_GUESS)
    }

    fn overhead_seconds(&self) -> f64 {
        self.overhead_seconds
            .lock()
            .unwrap()
            .0
            .unwrap_or(CPU_OVERHEAD_FIRST_GUESS)
    }

    fn measured(&self, bytes: u64, seconds: f64) {
        average_in(&self.cpu_seconds_per_byte, seconds / bytes.max(1) as f64);
    }

    /// Notes the decode thread's time on a layer's CPU share beside its
    /// products.
    pub(super) fn measured_overhead(&self, seconds: f64) {
        average_in(&self.overhead_seconds, seconds);
    }

    /// The CPU's share of `missing + committed` experts by the fraction.
    fn by_fraction(&self, (missing, eligible, committed): (usize, usize, usize)) -> Option<usize> {
        let f = *self.fraction.as_ref()?.lock().unwrap();
        let total = (f * (missing + committed) as f64).round() as usize;
        let share = total.saturating_sub(committed).min(eligible);
        if share + committed == 0 && eligible > 0 {
            // No finishing order to learn from: lean towards the CPU.
            self.finished(false);
        }
        Some(share)
    }

    /// Moves the CPU's fraction by the order a layer's two shares finished
    /// in: down when the GPU's was done first, up when the CPU's was.
    fn finished(&self, gpu_first: bool) {
        if let (true, Some(f)) = (self.balance, &self.fraction) {
            let mut f = f.lock().unwrap();
            *f = match gpu_first {
                true => (*f - BALANCE_STEP).max(0.0),
                false => (*f + BALANCE_STEP).min(1.0),
            };
        }
    }

    /// The cost model's share for the CPU, or one expert after
    /// [`CPU_RETRY_AFTER`] layers of none it could have taken.
    fn retried(&self, share: usize, eligible: usize) -> usize {
        if share > 0 || eligible == 0 {
            self.declined.store(0, Ordering::Relaxed);
            return share;
        }
        match self.declined.fetch_add(1, Ordering::Relaxed) + 1 >= CPU_RETRY_AFTER {
            true => {
                self.declined.store(0, Ordering::Relaxed);
                1
            }
            false => 0,
        }
    }
}

/// Adds `sample` to a moving average after the first [`CPU_WARM_UP`]
/// samples (its threads start, the experts' pages are first touched).
fn average_in(average: &Mutex<(Option<f64>, usize)>, sample: f64) {
    let mut guard = average.lock().unwrap();
    let (average, seen) = &mut *guard;
    *seen += 1;
    if *seen <= CPU_WARM_UP {
        return;
    }
    *average = Some(match *average {
        None => sample,
        Some(a) => a + CPU_AVERAGE_WEIGHT * (sample - a),
    });
}

/// How many of `missing` experts of `bytes` each the CPU takes (at most
/// `eligible`) beside the `committed` it computes already: the count whose
/// later finishing time is earliest, the CPU finishing after
/// `(committed + c) · bytes · cpu` seconds (plus `overhead` when it
/// computes any), the uploads after the copy stream's `backlog` seconds
/// plus `(missing − c) · bytes · pcie`. Ties go to uploading.
pub(super) fn cpu_share(
    (missing, eligible, committed): (usize, usize, usize),
    bytes: f64,
    (cpu, pcie): (f64, f64),
    backlog: f64,
    overhead: f64,
) -> usize {
    let finish = |c: usize| {
        let cpu_time = match committed + c {
            0 => 0.0,
            n => overhead + n as f64 * bytes * cpu,
        };
        let uploads = match missing - c {
            0 => 0.0,
            u => backlog + u as f64 * bytes * pcie,
        };
        cpu_time.max(uploads)
    };
    (0..=eligible.min(missing))
        .min_by(|&a, &b| finish(a).total_cmp(&finish(b)))
        .unwrap_or(0)
}

impl CudaBackend {
    /// The number of `missing` experts of `layer` (of which `eligible`
    /// have their bytes in host memory) the CPU takes now beside the
    /// `committed` it computes already, or 0 when the backend does not
    /// compute experts on the CPU.
    pub(super) fn cpu_experts_now(
        &self,
        store: &ExpertStore,
        layer: usize,
        (missing, eligible, committed): (usize, usize, usize),
    ) -> usize {
        let Some(hybrid) = self.hybrid_decode() else {
            return 0;
        };
        if eligible == 0 || hybrid.every {
            return eligible;
        }
        if let Some(share) = hybrid.by_fraction((missing, eligible, committed)) {
            return share;
        }
        let bytes = self.device_expert_bytes(store, layer) as f64;
        let (pcie, backlog) = {
            let mut cache = self.experts.lock().unwrap();
            (
                cache
                    .upload_seconds_per_byte()
                    .unwrap_or(1.0 / PCIE_FIRST_GUESS),
                cache.uploads_in_flight(),
            )
        };
        let backlog = backlog as f64 * pcie;
        let cpu = hybrid.cpu_seconds_per_byte();
        if cpu >= pcie {
            // A CPU slower than the link per byte costs more than it saves
            // (measured: docs/PERFORMANCE.md).
            return hybrid.retried(committed, eligible) - committed;
        }
        let share = cpu_share(
            (missing, eligible, committed),
            bytes,
            (cpu, pcie),
            backlog,
            hybrid.overhead_seconds(),
        );
        // Experts the CPU computes anyway keep its throughput measured.
        hybrid.retried(share + committed, eligible) - committed
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
    fn start_cpu_experts(&self, inputs: &CpuInputs, chosen: Vec<(Arc<Expert>, f32)>) -> CpuWork {
        let hybrid = self.hybrid_decode().expect("the CPU computes experts");
        let bytes = chosen.iter().map(|(e, _)| e.nbytes() as u64).sum();
        let experts = chosen.len() as u64;
        let job = CpuJob {
            x: inputs.x.clone(),
            chosen,
            activations: hybrid.activations,
            activation: inputs.activation,
            biases: inputs.biases.clone(),
        };
        let (reply, result) = mpsc::channel();
        let here = match hybrid.worker.jobs.lock().unwrap().as_ref() {
            Some(jobs) => jobs.send((job, reply)).err().map(|unsent| unsent.0.0),
            None => Some(job),
        };
        CpuWork {
            here,
            result,
            bytes,
            experts,
        }
    }

    /// The CPU's result of [`CudaBackend::start_cpu_experts`], counted in
    /// the cache's statistics and the CPU's measured throughput.
    fn finish_cpu_experts(&self, work: CpuWork) -> Result<Vec<f32>> {
        let hybrid = self.hybrid_decode().expect("the CPU computes experts");
        let result = match work.here {
            Some(job) => job.run(),
            None => work.result.recv().map_err(|_| {
                device_error(self.ordinal, "experts on the CPU", "the CPU worker stopped")
            })?,
        };
        let (y, elapsed) = result.unwrap_or_else(|panic| resume_unwind(panic));
        let seconds = elapsed.as_secs_f64();
        hybrid.measured(work.bytes, seconds);
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
    /// store's memory, as many as the cost model gives it (the last
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
        // Those the prefetch left to the CPU go to it; the cost model
        // shares the others.
        let left = self.left_to_cpu(store, layer);
        let (mut chosen, mut eligible): (Vec<_>, Vec<_>) =
            in_host_memory(store, layer, missing.iter().copied())
                .into_iter()
                .partition(|(k, _)| left.contains(&ids[*k]));
        let counts = (missing.len() - chosen.len(), eligible.len(), chosen.len());
        let take = self.cpu_experts_now(store, layer, counts);
        chosen.extend(eligible.split_off(eligible.len() - take));
        if chosen.is_empty() {
            return Ok(None);
        }
        let start = Instant::now();
        Ok(Some(CpuShare {
            inputs: self.cpu_inputs(x, routing, cpu_ffn)?,
            chosen,
            reading: start.elapsed(),
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
        let work = self.start_cpu_experts(&cpu.inputs, chosen);
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
            hybrid.finished(done);
        }
        let start = Instant::now();
        if on_gpu || accumulate {
            let y = self.upload("experts on the CPU", &y)?;
            self.add_assign_raw(out, &y, x.cols)?;
        } else {
            ok(
                "experts on the CPU",
                self.stream.memcpy_htod(&y, &mut out.slice_mut(..x.cols)),
            )?;
        }
        if let Some(hybrid) = self.hybrid_decode() {
            hybrid.measured_overhead((cpu.reading + start.elapsed()).as_secs_f64());
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
    /// The decode thread's time reading the inputs.
    reading: Duration,
}

#[cfg(test)]
mod tests {
    use super::cpu_share;

    const MB: f64 = 1e6;

    #[test]
    fn nothing_missing_or_nothing_eligible_stays_on_the_gpu() {
        assert_eq!(cpu_share((0, 0, 0), MB, (1e-9, 1e-9), 0.0, 0.0), 0);
        assert_eq!(cpu_share((8, 0, 0), MB, (1e-12, 1e-9), 0.0, 0.0), 0);
    }

    #[test]
    fn equal_throughputs_split_evenly_and_ties_upload() {
        // 8 experts of 1 MB at 1 GB/s both ways: 4 and 4 finish together.
        assert_eq!(cpu_share((8, 8, 0), MB, (1e-9, 1e-9), 0.0, 0.0), 4);
        // One expert: either alone takes as long; the upload is kept.
        assert_eq!(cpu_share((1, 1, 0), MB, (1e-9, 1e-9), 0.0, 0.0), 0);
    }

    #[test]
    fn the_faster_side_takes_more() {
        // The CPU three times as fast: it takes 6 of 8 (6 ms against 2).
        assert_eq!(cpu_share((8, 8, 0), MB, (1e-9 / 3.0, 1e-9), 0.0, 0.0), 6);
        // The CPU three times as slow: 2 of 8.
        assert_eq!(cpu_share((8, 8, 0), MB, (3e-9, 1e-9), 0.0, 0.0), 2);
        // But never more than the eligible ones.
        assert_eq!(cpu_share((8, 3, 0), MB, (1e-12, 1e-9), 0.0, 0.0), 3);
    }

    #[test]
    fn a_busy_copy_stream_and_the_cpus_overhead_move_the_split() {
        // Uploads already queued for 4 ms: the CPU takes 6 of 8 at equal
        // speeds (6 ms against 4 + 2).
        assert_eq!(cpu_share((8, 8, 0), MB, (1e-9, 1e-9), 4e-3, 0.0), 6);
        // An overhead longer than an upload of every expert: none.
        assert_eq!(cpu_share((2, 2, 0), MB, (1e-9, 1e-9), 0.0, 5e-3), 0);
    }

    #[test]
    fn experts_the_cpu_computes_already_count_against_it() {
        // 4 committed and 4 more missing at equal speeds: the CPU would
        // finish 4 + c, the uploads 4 − c; none more.
        assert_eq!(cpu_share((4, 4, 4), MB, (1e-9, 1e-9), 0.0, 0.0), 0);
        // 2 committed, 6 missing: 2 more make 4 and 4.
        assert_eq!(cpu_share((6, 6, 2), MB, (1e-9, 1e-9), 0.0, 0.0), 2);
    }
}
