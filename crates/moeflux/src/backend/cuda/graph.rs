//! Recorded steps (CUDA graphs). With every expert resident a decode step
//! is several hundred small launches whose cost is the host's work of
//! issuing them, not the GPU's. So the second step of a shape over the
//! same state buffers is captured into a graph, and later steps replay it:
//! the tokens and positions are written to device memory the recorded
//! kernels read (embed, q/k RoPE, KV store, attention; a sliding window's
//! cache has a row word of its own, set when the step is keyed), and the
//! KV caches' lengths are advanced here, as the recorded code would have.
//! Everything a step decides lives on the device (routers' choices and a
//! several-token call's grouping of slots by expert included), so any
//! model's one-sequence steps can be recorded: one token, or a token and
//! its drafts. A step of several sequences, one token each, reads each
//! sequence's position from an array (`attention_decode_many`); where a
//! model's attention needs one sequence's position alone, such steps run
//! unrecorded.
//!
//! The first run of a step's key is a probe: it runs as usual and notes
//! whatever a recording could not replay (a read of device data on the
//! host, a position baked into a launch); such keys are never recorded.
//!
//! A recording bakes in the addresses of the state buffers (KV caches,
//! Gated DeltaNet states) and every weight, so it is keyed by the state
//! (and the model by the batch's shape): a KV cache that grows to new
//! buffers, or another session, gets its own. Replays compute exactly what
//! the recorded code computes: the same kernels with the same arguments.
//!
//! Each kernel of a recording that follows another is linked to it by a
//! programmatic edge: its blocks may launch while the kernel before is
//! still running, and wait at `await_inputs` (kernels/common.cuh) for that
//! kernel to finish before reading anything it wrote. Launch latency then
//! overlaps work instead of following it, and a one-token product's
//! weights are fetched into L2 before its input is ready. The driver only
//! allows such edges in a graph without memory nodes, so a recorded step
//! takes its temporaries from an [`Arena`] rather than the stream.
//!
//! `MOEFLUX_CUDA_GRAPHS=0` turns recording off (and so does profiling,
//! which times each launch); `MOEFLUX_CUDA_PDL=0` keeps plain edges
//! (programmatic ones need compute capability 9.0 or later).

use std::collections::{HashMap, HashSet, VecDeque};
use std::ptr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::sys::{self, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DriverError};

use super::{CudaBackend, DeltaNetState, KvCache, Tensor, ok};
use crate::backend::StepInputs;
use crate::error::Result;

/// Recordings kept (one per live sequence or batch shape, typically).
const MAX_RECORDINGS: usize = 8;

/// What a step being recorded reads its inputs from, and the KV caches it
/// appends to.
pub(super) struct Capture {
    /// The step's tokens, one u32 per row.
    tokens: u64,
    rows: usize,
    /// The position of a one-sequence step (a u32 word; 0 with several).
    position: u64,
    /// Each sequence's position (i64s) of a step of several sequences.
    positions: u64,
    sequences: usize,
    /// Each KV cache the step appends to, and how many positions.
    kv_lens: Vec<(Arc<AtomicUsize>, usize)>,
    /// Set when the step read an input no device memory holds (the probe
    /// rules that out; a recording that still does is not used).
    invalid: bool,
    arena: Arena,
}

/// The first run of a step's key (see the module documentation).
pub(super) struct Probe {
    rows: usize,
    sequences: usize,
    recordable: bool,
}

/// A step being probed or recorded.
pub(super) enum StepRun {
    Probe(Probe),
    Capture(Capture),
}

/// The memory of a recorded step's temporaries: a memory pool of the
/// recording's own, allocated from on a stream that is not being captured.
/// Allocations on the capturing stream would be recorded as memory nodes,
/// and the driver links kernels by programmatic edges only in graphs
/// without them; and the pool keeps the memory the replays use for as long
/// as the recording lives (nothing else allocates from it). Temporaries
/// freed during the recording are reused by later ones of the same step,
/// which the recorded order of launches makes safe, as on a stream.
pub(super) struct Arena {
    pool: sys::CUmemoryPool,
    stream: Arc<CudaStream>,
}

// SAFETY: the pool handle is usable from any thread of the context, and
// an Arena is only used under the backend's capture or recordings mutex.
unsafe impl Send for Arena {}

impl Arena {
    fn new(capturing: &Arc<CudaStream>) -> Result<Arena, DriverError> {
        let ctx = capturing.context();
        ctx.bind_to_thread()?;
        let stream = ctx.new_stream()?;
        // SAFETY: zero is a valid value of this plain C struct (no handle
        // types, no security attributes, no size limit).
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = ctx.ordinal() as i32;
        let mut pool = ptr::null_mut();
        // SAFETY: valid properties; the pool is destroyed with the Arena.
        unsafe { sys::cuMemPoolCreate(&mut pool, &props) }.result()?;
        let arena = Arena { pool, stream };
        // Never hand memory back to the device while the recording lives:
        // its replays use it.
        let mut keep = u64::MAX;
        // SAFETY: a live pool; the attribute takes a u64.
        unsafe {
            sys::cuMemPoolSetAttribute(
                arena.pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep as *mut u64).cast(),
            )
        }
        .result()?;
        Ok(arena)
    }

    /// `len` values of device memory from the pool.
    pub(super) fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>, DriverError> {
        let mut ptr = 0;
        // SAFETY: a live pool and stream; the slice frees the memory back
        // to the pool on that stream when dropped.
        unsafe {
            sys::cuMemAllocFromPoolAsync(
                &mut ptr,
                len.max(1) * std::mem::size_of::<T>(),
                self.pool,
                self.stream.cu_stream(),
            )
            .result()?;
            Ok(self.stream.upgrade_device_ptr(ptr, len))
        }
    }

    /// Bytes of the pool handed out and not yet freed.
    fn in_use(&self) -> Result<u64, DriverError> {
        let mut used = 0u64;
        // SAFETY: a live pool; the attribute is a u64.
        unsafe {
            sys::cuMemPoolGetAttribute(
                self.pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                (&mut used as *mut u64).cast(),
            )
        }
        .result()?;
        Ok(used)
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: the pool was created by Arena::new and is owned here;
        // the driver releases it once any outstanding allocation is freed.
        unsafe {
            let _ = sys::cuMemPoolDestroy(self.pool);
        }
    }
}

struct Recording {
    graph: StepGraph,
    inputs: InputBuffers,
    logits: CudaSlice<f32>,
    kv_lens: Vec<(Arc<AtomicUsize>, usize)>,
    /// Dropped after the graph, whose replays use its memory.
    _arena: Arena,
}

/// The device memory a recorded step reads its tokens and positions from.
struct InputBuffers {
    tokens: CudaSlice<u32>,
    position: CudaSlice<u32>,
    positions: CudaSlice<i64>,
}

// SAFETY: a recording is only touched under the backend's mutex, and the
// graph's handles are usable from any thread of the context.
unsafe impl Send for Recording {}

#[derive(Default)]
pub(super) struct Recordings {
    by_key: HashMap<u64, Recording>,
    /// Keys by age, oldest first.
    order: VecDeque<u64>,
    /// Keys seen once: a step is recorded the second time its state is
    /// seen, after one ordinary step (the probe) has created what the
    /// first use of a state creates (rotary tables, say).
    seen: HashSet<u64>,
    /// Keys whose probe found the step cannot be recorded.
    unrecordable: HashSet<u64>,
    /// Steps replayed so far.
    replayed: u64,
}

pub(super) fn enabled_by_env() -> bool {
    crate::tuning::cuda_graphs()
}

/// Programmatic edges are on unless `MOEFLUX_CUDA_PDL=0` (for comparing).
pub(super) fn programmatic_by_env() -> bool {
    crate::tuning::cuda_programmatic_launch()
}

/// A captured and instantiated step. Ours rather than cudarc's `CudaGraph`
/// because the edges are rewritten between capture and instantiation.
struct StepGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    stream: Arc<CudaStream>,
}

impl StepGraph {
    /// Ends the capture on `stream` and instantiates what it recorded, with
    /// programmatic kernel-to-kernel edges if asked.
    fn end_capture(stream: &Arc<CudaStream>, programmatic: bool) -> Result<Self, DriverError> {
        stream.context().bind_to_thread()?;
        let mut graph = ptr::null_mut();
        // SAFETY: the stream is capturing (begun by `record`); the graph
        // is owned by the StepGraph from here on, which destroys it.
        unsafe { sys::cuStreamEndCapture(stream.cu_stream(), &mut graph) }.result()?;
        let mut step = StepGraph {
            graph,
            exec: ptr::null_mut(),
            stream: stream.clone(),
        };
        if graph.is_null() {
            return Err(DriverError(
                sys::cudaError_enum::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
            ));
        }
        let instantiate = |step: &mut StepGraph| {
            // SAFETY: a live graph; the exec is destroyed with the StepGraph.
            unsafe { sys::cuGraphInstantiateWithFlags(&mut step.exec, step.graph, 0) }.result()
        };
        if programmatic {
            // SAFETY: a live graph not yet instantiated.
            let linked = unsafe { make_programmatic(graph) }
                .map_err(|(what, e)| format!("{what}: {e:?}"))
                .and_then(|()| instantiate(&mut step).map_err(|e| format!("instantiating: {e:?}")));
            match linked {
                Ok(()) => return Ok(step),
                Err(why) => {
                    // A driver that refuses programmatic edges still runs
                    // the step with plain ones, only slower.
                    static WARNED: std::sync::Once = std::sync::Once::new();
                    WARNED.call_once(|| {
                        eprintln!(
                            "moeflux: CUDA programmatic launch unavailable ({why}); \
                             decode steps use plain graph edges"
                        )
                    });
                    // SAFETY: the graph as above; its exec, if any, is
                    // destroyed before instantiating again.
                    unsafe {
                        if !step.exec.is_null() {
                            sys::cuGraphExecDestroy(step.exec).result()?;
                            step.exec = ptr::null_mut();
                        }
                        retype_kernel_edges(graph, PROGRAMMATIC_EDGE, PLAIN_EDGE)
                            .map_err(|(_, e)| e)?;
                    }
                }
            }
        }
        instantiate(&mut step)?;
        Ok(step)
    }

    fn launch(&self) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        // SAFETY: an instantiated graph, launched on the stream it was
        // captured from.
        unsafe { sys::cuGraphLaunch(self.exec, self.stream.cu_stream()) }.result()
    }
}

impl Drop for StepGraph {
    fn drop(&mut self) {
        // SAFETY: handles created in end_capture and owned here. Errors
        // (a context already torn down) leave nothing to free.
        unsafe {
            if !self.exec.is_null() {
                let _ = sys::cuGraphExecDestroy(self.exec);
            }
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

/// A plain edge: the downstream node starts after the upstream completes.
const PLAIN_EDGE: sys::CUgraphEdgeData = sys::CUgraphEdgeData {
    from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_DEFAULT as u8,
    to_port: 0,
    type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_DEFAULT as u8,
    reserved: [0; 5],
};

/// A programmatic edge: the downstream kernel may launch once every block
/// of the upstream one has called `griddepcontrol.launch_dependents`.
const PROGRAMMATIC_EDGE: sys::CUgraphEdgeData = sys::CUgraphEdgeData {
    from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
    to_port: 0,
    type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
    reserved: [0; 5],
};

/// A failed driver call, named.
type EdgeError = (&'static str, DriverError);

/// Turns every plain kernel-to-kernel edge of `graph` into a programmatic
/// one (see the module's documentation). Edges to or from other nodes
/// (copies, memsets) stay as they are.
///
/// # Safety
/// `graph` is a live graph that is not being modified elsewhere, and
/// every kernel it holds calls `await_inputs` before reading memory.
unsafe fn make_programmatic(graph: sys::CUgraph) -> Result<(), EdgeError> {
    // SAFETY: as the caller promises.
    unsafe { retype_kernel_edges(graph, PLAIN_EDGE, PROGRAMMATIC_EDGE) }
}

/// Replaces the kernel-to-kernel edges of `graph` annotated `from` by
/// edges annotated `to`. If the driver refuses the new edges, the old
/// ones are put back before the error returns.
///
/// # Safety
/// `graph` is a live graph that is not being modified elsewhere.
unsafe fn retype_kernel_edges(
    graph: sys::CUgraph,
    from: sys::CUgraphEdgeData,
    to: sys::CUgraphEdgeData,
) -> Result<(), EdgeError> {
    let mut count = 0usize;
    // SAFETY (all calls): a live graph, and buffers sized by the first
    // call's count.
    unsafe {
        let (no_nodes, no_data) = (ptr::null_mut(), ptr::null_mut());
        sys::cuGraphGetEdges_v2(graph, no_nodes, no_nodes, no_data, &mut count)
            .result()
            .map_err(|e| ("counting the graph's edges", e))?;
        let mut sources: Vec<sys::CUgraphNode> = vec![ptr::null_mut(); count];
        let mut targets: Vec<sys::CUgraphNode> = vec![ptr::null_mut(); count];
        let mut data = vec![PLAIN_EDGE; count];
        sys::cuGraphGetEdges_v2(
            graph,
            sources.as_mut_ptr(),
            targets.as_mut_ptr(),
            data.as_mut_ptr(),
            &mut count,
        )
        .result()
        .map_err(|e| ("listing the graph's edges", e))?;
        let is_kernel = |node: sys::CUgraphNode| -> Result<bool, EdgeError> {
            let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            sys::cuGraphNodeGetType(node, &mut kind)
                .result()
                .map_err(|e| ("reading a node's type", e))?;
            Ok(kind == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL)
        };
        let (mut kept_sources, mut kept_targets) = (Vec::new(), Vec::new());
        for i in 0..count {
            if data[i] == from && is_kernel(sources[i])? && is_kernel(targets[i])? {
                kept_sources.push(sources[i]);
                kept_targets.push(targets[i]);
            }
        }
        let n = kept_sources.len();
        if n == 0 {
            return Ok(());
        }
        let (s, t) = (kept_sources.as_ptr(), kept_targets.as_ptr());
        sys::cuGraphRemoveDependencies_v2(graph, s, t, vec![from; n].as_ptr(), n)
            .result()
            .map_err(|e| ("removing kernel-to-kernel edges", e))?;
        if let Err(e) =
            sys::cuGraphAddDependencies_v2(graph, s, t, vec![to; n].as_ptr(), n).result()
        {
            sys::cuGraphAddDependencies_v2(graph, s, t, vec![from; n].as_ptr(), n)
                .result()
                .map_err(|e| ("restoring kernel-to-kernel edges", e))?;
            return Err(("adding retyped kernel-to-kernel edges", e));
        }
        Ok(())
    }
}

impl CudaBackend {
    /// The device word holding the position of the one-sequence step being
    /// recorded; 0 (no word) when nothing is being recorded. A step of
    /// several sequences has no such word: its probe or recording is marked.
    pub(super) fn recorded_position(&self) -> u64 {
        let mut run = self.capture.lock().unwrap();
        match run.as_mut() {
            None => 0,
            Some(StepRun::Probe(probe)) => {
                probe.recordable &= probe.sequences == 1;
                0
            }
            Some(StepRun::Capture(capture)) => {
                capture.invalid |= capture.sequences != 1;
                capture.position
            }
        }
    }

    /// The device word holding the cache row of the first of `n` positions
    /// the step being recorded appends to `cache` (the position, or a
    /// sliding window's row word), registering the cache as one the step
    /// appends to; 0 (no word) when nothing is being recorded.
    pub(super) fn recorded_row(&self, cache: &KvCache, n: usize) -> u64 {
        let row = cache.row_word(self);
        let mut run = self.capture.lock().unwrap();
        match run.as_mut() {
            None => 0,
            Some(StepRun::Probe(probe)) => {
                probe.recordable &= row.is_some() || probe.sequences == 1;
                0
            }
            Some(StepRun::Capture(capture)) => {
                capture.kv_lens.push((cache.len_counter().clone(), n));
                capture.invalid |= row.is_none() && capture.sequences != 1;
                row.unwrap_or(capture.position)
            }
        }
    }

    /// Registers `cache` as one the step being recorded appends a position
    /// to, whose kernel takes the row from [`CudaBackend::recorded_positions`].
    pub(super) fn recorded_append(&self, cache: &KvCache) {
        if let Some(StepRun::Capture(capture)) = self.capture.lock().unwrap().as_mut() {
            capture.kv_lens.push((cache.len_counter().clone(), 1));
        }
    }

    /// The device array of each sequence's position (i64) of the step of
    /// `sequences` sequences being recorded, if one is.
    pub(super) fn recorded_positions(&self, sequences: usize) -> Option<u64> {
        let mut run = self.capture.lock().unwrap();
        match run.as_mut() {
            Some(StepRun::Probe(probe)) => {
                probe.recordable &= probe.sequences == sequences;
                None
            }
            Some(StepRun::Capture(capture)) if capture.sequences == sequences => {
                Some(capture.positions)
            }
            Some(StepRun::Capture(capture)) => {
                capture.invalid = true;
                None
            }
            None => None,
        }
    }

    /// The device array of the `n` tokens of the step being recorded, if
    /// one is.
    pub(super) fn recorded_tokens(&self, n: usize) -> Option<u64> {
        let mut run = self.capture.lock().unwrap();
        match run.as_mut() {
            Some(StepRun::Probe(probe)) => {
                probe.recordable &= probe.rows == n;
                None
            }
            Some(StepRun::Capture(capture)) if capture.rows == n => Some(capture.tokens),
            Some(StepRun::Capture(capture)) => {
                capture.invalid = true;
                None
            }
            None => None,
        }
    }

    /// Notes that the step being probed or recorded did something a replay
    /// would not redo (read device data on the host, baked a position into
    /// a launch): its key is not recorded.
    pub(super) fn note_unrecordable(&self) {
        match self.capture.lock().unwrap().as_mut() {
            Some(StepRun::Probe(probe)) => probe.recordable = false,
            Some(StepRun::Capture(capture)) => capture.invalid = true,
            None => {}
        }
    }

    /// Decode steps replayed since the backend was created.
    pub fn replayed_steps(&self) -> u64 {
        self.recordings.lock().unwrap().replayed
    }

    /// `len` values of device memory for a temporary of the step being
    /// recorded, if one is (see [`Arena`]).
    pub(super) fn recording_alloc<T: DeviceRepr>(
        &self,
        len: usize,
    ) -> Option<Result<CudaSlice<T>, DriverError>> {
        match self.capture.lock().unwrap().as_ref() {
            Some(StepRun::Capture(c)) => Some(c.arena.alloc(len)),
            _ => None,
        }
    }

    /// Names the state of one sequence of a step of `sequences` that
    /// appends `rows` positions, after making room for them. Without
    /// several-token steps (`MOEFLUX_CUDA_BATCHED_STEPS=0`) only one
    /// sequence's one-token steps are keyed, as before them.
    pub(super) fn state_key(
        &self,
        kv: &mut [&mut KvCache],
        linear: &[&DeltaNetState],
        rows: usize,
        sequences: usize,
    ) -> Result<Option<u64>> {
        let several = rows > 1 || sequences > 1;
        if !self.graphs_enabled || (several && !self.batched_steps) {
            return Ok(None);
        }
        let mut key = xxhash_rust::xxh3::Xxh3::new();
        for cache in kv.iter_mut() {
            self.kv_prepare_step(cache, rows)?;
            for word in cache.identity(self) {
                key.update(&word.to_le_bytes());
            }
            // One sequence's attention kernels depend on the context's
            // length (several sequences' take the grouped kernels always).
            if sequences == 1 {
                key.update(&[u8::from(self.grouped_decode(cache))]);
            }
        }
        for state in linear {
            key.update(&state.conv.device_ptr(&self.stream).0.to_le_bytes());
            key.update(&state.recurrent.device_ptr(&self.stream).0.to_le_bytes());
        }
        Ok(Some(key.digest()))
    }

    /// Sets a device word a recorded step reads. A memset, not a copy: it
    /// needs no host buffer and is queued like a kernel.
    pub(super) fn set_word(&self, word: &mut CudaSlice<u32>, value: u32, op: &str) -> Result<()> {
        let (ptr, _sync) = word.device_ptr_mut(&self.stream);
        // SAFETY: one 32-bit word at a live device allocation, on the
        // backend's stream.
        ok(op, unsafe {
            cudarc::driver::sys::cuMemsetD32Async(ptr, value, 1, self.stream.cu_stream()).result()
        })
    }

    /// Writes a recording's tokens and positions: words set in place for
    /// one token of one sequence, copies otherwise.
    fn set_step_inputs(
        &self,
        inputs: &mut InputBuffers,
        tokens: &[u32],
        positions: &[usize],
    ) -> Result<()> {
        let op = "setting a recorded step's inputs";
        let word = |position: usize| {
            u32::try_from(position)
                .unwrap_or_else(|_| panic!("{op}: position {position} exceeds 32 bits"))
        };
        match tokens {
            [token] => self.set_word(&mut inputs.tokens, *token, op)?,
            _ => ok(op, self.stream.memcpy_htod(tokens, &mut inputs.tokens))?,
        }
        match positions {
            [position] => self.set_word(&mut inputs.position, word(*position), op),
            _ => {
                let positions: Vec<i64> = positions.iter().map(|&p| word(p) as i64).collect();
                ok(
                    op,
                    self.stream.memcpy_htod(&positions, &mut inputs.positions),
                )
            }
        }
    }

    /// A fresh device copy of a recording's logits.
    fn copy_logits(&self, logits: &CudaSlice<f32>, rows: usize) -> Result<Tensor> {
        let mut out = self.tensor("recorded step", rows, logits.len() / rows)?;
        ok(
            "recorded step",
            self.stream.memcpy_dtod(logits, &mut out.data),
        )?;
        Ok(out)
    }

    pub(super) fn replay(&self, key: u64, step: &StepInputs<'_>) -> Result<Option<Tensor>> {
        let mut recordings = self.recordings.lock().unwrap();
        let Some(recording) = recordings.by_key.get_mut(&key) else {
            return Ok(None);
        };
        self.set_step_inputs(&mut recording.inputs, step.tokens, step.positions)?;
        ok("replaying a recorded step", recording.graph.launch())?;
        for (len, n) in &recording.kv_lens {
            len.fetch_add(*n, Ordering::Relaxed);
        }
        let logits = self.copy_logits(&recording.logits, step.logit_rows)?;
        recordings.replayed += 1;
        Ok(Some(logits))
    }

    /// Runs `step` (see [`crate::backend::Backend::record_step`]): the
    /// first time for `key` as a probe, the second time recorded, unless
    /// the probe found it cannot be.
    pub(super) fn record(
        &self,
        key: u64,
        inputs: &StepInputs<'_>,
        step: &mut dyn FnMut() -> Result<Tensor>,
    ) -> Result<Tensor> {
        let (tokens, positions) = (inputs.tokens, inputs.positions);
        let logits_len = inputs.logit_rows * inputs.vocab;
        let first = {
            let mut recordings = self.recordings.lock().unwrap();
            if recordings.unrecordable.contains(&key) {
                drop(recordings);
                return self.engine_step(step);
            }
            recordings.seen.insert(key)
        };
        if first {
            return self.probe(key, tokens.len(), positions.len(), step);
        }
        let op = "recording a step";
        let logit_rows = inputs.logit_rows;
        let mut inputs = InputBuffers {
            tokens: self.alloc::<u32>(op, tokens.len())?,
            position: self.alloc::<u32>(op, 1)?,
            positions: self.alloc::<i64>(op, positions.len())?,
        };
        let mut logits = self.alloc::<f32>(op, logits_len)?;
        self.set_step_inputs(&mut inputs, tokens, positions)?;
        *self.capture.lock().unwrap() = Some(StepRun::Capture(Capture {
            tokens: inputs.tokens.device_ptr(&self.stream).0,
            rows: tokens.len(),
            position: match positions.len() {
                1 => inputs.position.device_ptr(&self.stream).0,
                _ => 0,
            },
            positions: inputs.positions.device_ptr(&self.stream).0,
            sequences: positions.len(),
            kv_lens: Vec::new(),
            invalid: false,
            arena: ok(op, Arena::new(&self.stream))?,
        }));
        let begun = self
            .stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED);
        if begun.is_err() {
            self.capture.lock().unwrap().take();
        }
        ok(op, begun)?;
        let computed = self.engine_step(step).and_then(|out| {
            assert_eq!(
                out.rows * out.cols,
                logits_len,
                "{op}: the step's logits are not {logits_len} values"
            );
            ok(op, self.stream.memcpy_dtod(&out.data, &mut logits))
        });
        let Some(StepRun::Capture(capture)) = self.capture.lock().unwrap().take() else {
            unreachable!("set above")
        };
        let graph = StepGraph::end_capture(&self.stream, self.programmatic_launch);
        if graph.is_err() {
            // A capture the driver refused fails the same way every time:
            // the key runs unrecorded from now.
            self.recordings.lock().unwrap().unrecordable.insert(key);
        }
        let graph = ok(op, graph)?;
        computed?;
        if capture.invalid {
            // The probe should have ruled this out; the caller rolls the
            // step's sequences back, and the key runs unrecorded from now.
            self.recordings.lock().unwrap().unrecordable.insert(key);
            return Err(crate::error::Error::Device {
                device: format!("cuda:{}", self.ordinal),
                msg: format!("{op}: the step read an input that no device memory holds"),
            });
        }
        ok(op, graph.launch())?;
        let out = self.copy_logits(&logits, logit_rows)?;
        // Memory the step kept (none, as written) would be shared by its
        // holder and every replay: such a recording is used once, not kept.
        if ok(op, capture.arena.in_use())? != 0 {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                eprintln!(
                    "moeflux: a recorded CUDA step kept device memory; steps are not replayed"
                )
            });
            self.recordings.lock().unwrap().unrecordable.insert(key);
            return Ok(out);
        }
        let mut recordings = self.recordings.lock().unwrap();
        if recordings.by_key.len() >= MAX_RECORDINGS
            && let Some(oldest) = recordings.order.pop_front()
        {
            recordings.by_key.remove(&oldest);
        }
        recordings.order.push_back(key);
        recordings.by_key.insert(
            key,
            Recording {
                graph,
                inputs,
                logits,
                kv_lens: capture.kv_lens,
                _arena: capture.arena,
            },
        );
        Ok(out)
    }

    /// Runs `step` as an engine step on this thread.
    fn engine_step(&self, step: &mut dyn FnMut() -> Result<Tensor>) -> Result<Tensor> {
        self.as_engine_step(step)
    }

    /// Runs `f` on this thread as the engine runs a recorded step: routed
    /// experts of 2 to 128 tokens of a resident layer take the few-token
    /// kernels with f32 activations (grouped.rs), as decode steps of several
    /// sequences and checks of drafts do. For checking those kernels alone.
    pub fn as_engine_step<R>(&self, f: impl FnOnce() -> R) -> R {
        *self.engine_step.lock().unwrap() = Some(std::thread::current().id());
        let out = f();
        *self.engine_step.lock().unwrap() = None;
        out
    }

    /// Whether this thread is running an engine step.
    pub(super) fn in_engine_step(&self) -> bool {
        *self.engine_step.lock().unwrap() == Some(std::thread::current().id())
    }

    /// The first run of `key`: as usual, noting whether it can be recorded.
    fn probe(
        &self,
        key: u64,
        rows: usize,
        sequences: usize,
        step: &mut dyn FnMut() -> Result<Tensor>,
    ) -> Result<Tensor> {
        *self.capture.lock().unwrap() = Some(StepRun::Probe(Probe {
            rows,
            sequences,
            recordable: true,
        }));
        let out = self.engine_step(step);
        let Some(StepRun::Probe(probe)) = self.capture.lock().unwrap().take() else {
            unreachable!("set above")
        };
        if !probe.recordable {
            self.recordings.lock().unwrap().unrecordable.insert(key);
        }
        out
    }
}
