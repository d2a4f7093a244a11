//! The CUDA backend: the operations of [`Backend`] as our own CUDA C
//! kernels (`kernels/`), compiled by NVRTC for the device at first use and
//! cached on disk (`compile.rs`). The CUDA libraries are loaded at run
//! time, so the same binary runs without CUDA and uses a GPU where there
//! is one ([`device_count`] tells which).
//!
//! Residency: weights are copied to device memory when the model opens;
//! activations, KV caches and Gated DeltaNet states live there and every
//! operation runs on one stream, in order. Data crosses to the host only
//! where the trait asks for it: logits ([`Backend::to_host`]), saved
//! session state, and each MoE layer's selected expert ids, which the
//! expert store needs to read experts (see `experts.rs`).
//!
//! Numerics follow the CPU backend: f32 activations and accumulation,
//! weights dequantized exactly as stored, rotary frequencies computed on
//! the host in f32. Only summation orders differ. With
//! [`CudaOptions::activations`] int8, a prompt's q4 products take the CPU's
//! int8 arithmetic instead (gemm.rs).
//!
//! A device failure inside an operation (memory exhausted even after
//! emptying the expert cache, a kernel fault) is returned as
//! [`Error::Device`] naming the operation: the session that ran it rolls
//! back, and the process and other sessions go on. Only a failure of the
//! waits that keep memory safe (an expert buffer held until its copy is
//! done) ends the process (`must`).
//!
//! The host code mirrors the kernels: each kernel file's launches live in
//! the module of the same family beside it (`linear.rs` for linear.cu,
//! `norm.rs`, `elementwise.rs`, `attention.rs`, `mla.rs`, `delta_net.rs` for
//! gated_delta_net.cu and gdn_chunked.cu, `routing.rs` and `experts.rs`
//! for moe.cu, `gemm.rs`, `prefill.rs` for moe_prefill.cu, `grouped.rs`
//! for moe_few.cu). This file holds the backend, its construction and the
//! device helpers; `ops.rs` the implementation of [`Backend`], which calls
//! those modules' methods.

/// Launches a kernel on the backend's stream:
/// `launch!(backend, "what", &kernel, config, args...)`, each argument a
/// reference (`&slice`, `&mut slice`, `&view`, `&scalar`) in the order of
/// the kernel's parameters.
macro_rules! launch {
    ($backend:expr, $op:expr, $kernel:expr, $config:expr, $($arg:expr),+ $(,)?) => {{
        let mut builder = $backend.stream.launch_builder($kernel);
        $(cudarc::driver::PushKernelArg::arg(&mut builder, $arg);)+
        let start = $backend.profiler.as_ref().map(|p| p.mark(&$backend.stream));
        // SAFETY: the arguments follow the kernel's parameter list in
        // kernels/, and the callers size every buffer for what the kernel
        // reads and writes.
        let launched = unsafe { builder.launch($config) };
        $crate::backend::cuda::ok($op, launched)?;
        if let (Some(profiler), Some(start)) = ($backend.profiler.as_ref(), start) {
            profiler.record($op, start, &$backend.stream);
        }
    }};
}

mod attention;
mod compile;
mod delta_net;
mod device_expert;
mod download;
mod elementwise;
mod experts;
mod gemm;
mod geometry;
mod graph;
mod grouped;
mod hybrid;
mod linear;
mod linear_few;
mod mla;
mod nccl;
mod norm;
mod ops;
mod parallel;
mod pinned;
mod prefill;
mod preload;
mod profile;
mod routing;
mod state;
mod streaming;
mod vram_cache;

use std::collections::HashMap;
use std::fmt::Display;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUresult;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, DeviceRepr, DriverError,
    LaunchConfig, ValidAsZeroBits,
};

pub use crate::backend::DeviceExpertStats as ExpertCacheStats;
pub use hybrid::CpuExperts;
pub use parallel::ExpertPlacement;
pub use routing::Routing;
pub use state::{DeltaNetState, KvCache};

use super::{
    AttentionShape, Backend, ExpertFfn, GatedDeltaNetParams, HostDeltaNetState, HostKv, KvType,
    RmsNorm, Rope, StepInputs, check_host_kv, check_kv_type,
};
use crate::backend::cpu::Activations;
use crate::config::{LinearAttentionConfig, MlaConfig, RouterSpec};
use crate::error::{Error, Result};
use crate::experts::ExpertStore;
use crate::format::{TensorData, TensorRole};
use crate::quant::{DType, MatrixLayout};
use crate::util::{Progress, human_bytes};
use compile::Kernels;
use vram_cache::VramCache;

/// Threads per block of the grid-stride kernels.
const THREADS: u32 = 256;
/// Most blocks of a grid-stride launch (they loop over the rest).
const MAX_BLOCKS: usize = 65_535;

/// Shared memory a block may use without opting in to more.
const MAX_SHARED_BYTES: usize = 48 * 1024;

/// CUDA devices this process can use: 0 when there is no driver library
/// or no device, an error when a driver is installed but fails.
pub fn device_count() -> Result<usize> {
    // SAFETY: only probes whether the driver library can be opened.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Ok(0);
    }
    match cudarc::driver::result::init() {
        Ok(()) => {}
        Err(e) if e.0 == CUresult::CUDA_ERROR_NO_DEVICE => return Ok(0),
        Err(e) => {
            return Err(Error::invalid(
                "CUDA",
                format!("the driver is installed but failed to initialise: {e}"),
            ));
        }
    }
    let count = cudarc::driver::result::device::get_count()
        .map_err(|e| Error::invalid("CUDA", format!("counting devices: {e}")))?;
    Ok(count.max(0) as usize)
}

/// Rotary inverse frequencies on the device, shared by the layers.
type RopeFrequencies = Arc<CudaSlice<f32>>;

/// What rotary frequencies are cached by (see `rope_frequencies`).
type RopeKey = (usize, u64, Option<[u64; 5]>);

/// Options of a [`CudaBackend`].
#[derive(Clone, Copy, Debug, Default)]
pub struct CudaOptions {
    /// Bytes of device memory for cached experts; `None`: the device memory
    /// still free when the experts are first prepared (after the weights),
    /// less a reserve for KV caches and activations (the larger of 4 GiB
    /// and a tenth of the device). The cache also gives memory back when an
    /// allocation fails.
    pub expert_cache_bytes: Option<u64>,
    /// Whether decode steps are recorded as CUDA graphs and replayed;
    /// `None`: as `MOEFLUX_CUDA_GRAPHS` says (on). Never while profiling.
    pub graphs: Option<bool>,
    /// Whether calls of several tokens (prompt chunks included) group their
    /// routed experts on the device, and steps of several tokens may be
    /// recorded; `None`: as `MOEFLUX_CUDA_BATCHED_STEPS` says (on).
    pub batched_steps: Option<bool>,
    /// Whether decode steps may compute experts missing from VRAM on the
    /// CPU (hybrid.rs; default: the share that finishes with the GPU's).
    pub cpu_experts: CpuExperts,
    /// How a prompt's q4 products (routed experts and dense matrices, not
    /// routers) take their activations: f32 (split into two bf16 halves,
    /// within f32 rounding of the CPU's f32 products) or int8 (quantized per
    /// group of 64 inputs as the CPU's int8 activations are, on the integer
    /// tensor cores: faster, with the CPU's int8 accuracy). Decode steps
    /// take f32 either way.
    pub activations: Activations,
    /// Whether the prefill attention copies each tile of keys and values
    /// into shared memory (`cp.async`) while the tile before computes, where
    /// a block's shared memory holds the copy; `None`: yes. Otherwise tiles
    /// are staged straight from the cache, as on devices whose blocks hold
    /// less; both give the same results.
    pub attention_copies: Option<bool>,
    /// Whether q4 expert codes are stored in VRAM by 16-row tiles, each
    /// tile's codes of one 64-column group together, so the tensor-core
    /// kernels of several tokens read memory in order (device_expert.rs;
    /// from compute capability 8.0): 12% faster decode of 16 or 64
    /// sequences together on an H100, 2% slower decode of one sequence.
    /// `None`: as `MOEFLUX_CUDA_TILED_EXPERTS` says, tiled when unset. Both
    /// give the same results.
    pub tiled_experts: Option<bool>,
}

/// Computes on one CUDA device (see the module documentation). Each model
/// owns its backend: the VRAM expert cache is keyed by layer and expert.
pub struct CudaBackend {
    ordinal: usize,
    description: String,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    /// Rotary frequencies by rotary_dim, theta bits and the YaRN settings
    /// that change them.
    rope_frequencies: Mutex<HashMap<RopeKey, RopeFrequencies>>,
    experts: Mutex<VramCache>,
    /// Device time per operation, when `MOEFLUX_CUDA_PROFILE` is set.
    profiler: Option<profile::Profiler>,
    /// Whether decode steps are recorded and replayed (graph.rs).
    graphs_enabled: bool,
    /// Whether steps of several tokens group their routed experts on the
    /// device (grouped.rs) and may be recorded (`MOEFLUX_CUDA_BATCHED_STEPS`).
    batched_steps: bool,
    /// Whether the prefill attention copies its tiles ahead where it can
    /// ([`CudaOptions::attention_copies`]).
    attention_copies: bool,
    /// The thread running an engine step (graph.rs `record`), if one is:
    /// its calls (at most 128 tokens) group routed experts with f32
    /// activations, q4 experts for the few-token kernels, as one
    /// sequence's decode computes; other calls (prompt chunks) with the
    /// backend's activations for the prefill kernels.
    engine_step: Mutex<Option<std::thread::ThreadId>>,
    /// Expert bytes the calls grouped on the device used (grouped.rs),
    /// counted there.
    batched_expert_bytes: CudaSlice<u64>,
    /// Whether recordings link kernels by programmatic edges (graph.rs;
    /// compute capability 9.0 and later).
    programmatic_launch: bool,
    /// See [`linear::WHOLE_ROWS_MIN`].
    whole_rows_min: usize,
    /// See [`linear_few::FEW_LINEAR_MAX_TOKENS`].
    few_linear_max: usize,
    /// See [`delta_net::GDN_CHUNKED_MIN`].
    gdn_chunked_min: usize,
    /// Most blocks a head's positions are split over in a decode step.
    decode_splits_max: usize,
    /// Positions from which one sequence's decode step takes the grouped
    /// attention kernels, when set (else [`attention::GROUPED_DECODE_MIN`],
    /// or on the tensor cores every length for bf16 caches and
    /// [`attention::GROUPED_DECODE_TC_F32_MIN`] for f32).
    grouped_decode_min: Option<usize>,
    /// Whether the grouped decode attention of bf16 and f32 caches takes
    /// the tensor-core kernels (compute capability 8.0 and later).
    grouped_decode_tc: bool,
    /// Streaming multiprocessors of the device.
    sm_count: usize,
    /// Page-locked buffers of large downloads (a decode step's logits).
    downloads: Mutex<download::Downloads>,
    /// Shared memory a block of the kernels that opt in to more than
    /// [`MAX_SHARED_BYTES`] may use (the tensor-core expert down and the
    /// chunked Gated DeltaNet); None before compute capability 8.0, where
    /// those kernels are not built.
    tc_shared_limit: Option<usize>,
    /// Whether q4 expert codes are tiled in VRAM for the tensor-core
    /// kernels (device_expert.rs; compute capability 8.0 and later).
    tiled_experts: bool,
    /// The step being probed or recorded, if one is.
    capture: Mutex<Option<graph::StepRun>>,
    recordings: Mutex<graph::Recordings>,
    /// This GPU's rank and the experts it holds, when several GPUs divide
    /// them (parallel.rs); `None`: it holds every expert.
    share: Option<parallel::Share>,
    /// The other GPUs, on the first of several.
    parallel: Option<parallel::ExpertParallel>,
    /// Hybrid decode's settings and measurements; `None`: off.
    hybrid: Option<hybrid::Hybrid>,
    /// See [`CudaOptions::activations`].
    activations: Activations,
}

/// A row-major `[rows, cols]` f32 matrix in device memory.
pub struct Tensor {
    rows: usize,
    cols: usize,
    data: CudaSlice<f32>,
}

/// A stored tensor copied to device memory in its stored encoding.
pub struct Weight {
    name: String,
    layout: MatrixLayout,
    data: CudaSlice<u8>,
    /// Whether prompts' products take int8 activations (q4, not a router,
    /// [`CudaOptions::activations`] int8).
    int8: bool,
}

impl Weight {
    fn matrix(&self) -> Matrix<'_> {
        Matrix {
            name: &self.name,
            layout: self.layout,
            data: &self.data,
            offset: 0,
            int8: self.int8,
        }
    }

    /// The length of an f32 vector (norm weights and other parameters).
    fn vector_len(&self, op: &str) -> usize {
        assert_eq!(
            self.layout.dtype,
            DType::F32,
            "{op}: tensor {} must be f32",
            self.name
        );
        self.layout.rows * self.layout.cols
    }
}

/// A stored matrix at `offset` in a device buffer (a dense weight, or a
/// part of an expert).
struct Matrix<'a> {
    name: &'a str,
    layout: MatrixLayout,
    data: &'a CudaSlice<u8>,
    offset: usize,
    /// See [`Weight`]'s `int8`.
    int8: bool,
}

/// The result of a device call as moeflux's: a failure (out of memory
/// included) is an [`Error::Device`] naming the operation.
pub(crate) fn ok<T>(op: &str, result: std::result::Result<T, DriverError>) -> Result<T> {
    result.map_err(|e| Error::Device {
        device: "CUDA".into(),
        msg: format!("{op}: {e}"),
    })
}

/// A device call that keeps memory safe (a wait that holds a buffer until
/// a copy that reads or writes it is done): if the driver cannot do even
/// that, the context is broken and going on could corrupt memory, so the
/// process ends with the driver's message.
pub(crate) fn must<T>(op: &str, result: std::result::Result<T, DriverError>) -> T {
    result.unwrap_or_else(|e| panic!("CUDA failed in {op}: {e}"))
}

/// A size passed to a kernel as `int`.
fn int(value: usize, what: &str) -> i32 {
    i32::try_from(value)
        .unwrap_or_else(|_| panic!("{what} = {value} exceeds the CUDA kernels' 32-bit sizes"))
}

fn long(value: usize) -> i64 {
    value as i64
}

fn device_error(ordinal: usize, what: impl Display, e: impl Display) -> Error {
    Error::Device {
        device: format!("cuda:{ordinal}"),
        msg: format!("{what}: {e}"),
    }
}

/// Lets the device's stream-ordered memory pool keep freed memory instead
/// of returning it to the driver at every synchronisation: each token
/// allocates and frees many small buffers.
fn keep_freed_memory(ctx: &CudaContext) -> std::result::Result<(), DriverError> {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: `pool` receives the device's default pool, which lives as long
    // as the context; the attribute value is a u64 as the driver expects.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
        .result()
    }
}

/// A grid-stride launch over `total` elements.
fn grid_stride(total: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            total.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of `threads` per item, up to [`MAX_BLOCKS`] (the kernels loop
/// over the rest).
fn block_per_item(items: usize, threads: u32, shared_mem_bytes: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (items.clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes,
    }
}

impl CudaBackend {
    /// The backend on device `ordinal` with default options.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        CudaBackend::with_options(ordinal, CudaOptions::default())
    }

    pub fn with_options(ordinal: usize, options: CudaOptions) -> Result<CudaBackend> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::invalid(
                format!("cuda:{ordinal}"),
                match count {
                    0 => "no CUDA device found (no NVIDIA driver, or no GPU visible)".to_string(),
                    n => format!("no such device: there are {n} (cuda:0 to cuda:{})", n - 1),
                },
            ));
        }
        let fail = |what: &str, e: DriverError| device_error(ordinal, what, e);
        let ctx = CudaContext::new(ordinal).map_err(|e| fail("creating a context", e))?;
        // SAFETY: the backend uses a single stream, so no buffer is ever
        // shared between streams and cudarc's cross-stream events are not
        // needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| fail("creating a stream", e))?;
        if ctx.has_async_alloc() {
            keep_freed_memory(&ctx).map_err(|e| fail("configuring the memory pool", e))?;
        }
        let kernels = compile::load(&ctx).map_err(|e| device_error(ordinal, "kernels", e))?;
        // Lets `kernel` launch with up to `bytes` of dynamic shared memory.
        let allow_shared = |kernel: &CudaFunction, bytes: usize, which: &str| {
            kernel
                .set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
                .map_err(|e| fail(&format!("allowing the {which} their shared memory"), e))
        };
        allow_shared(
            &kernels.mla_attention,
            mla::MLA_MAX_SHARED_BYTES,
            "attention kernels",
        )?;
        let name = ctx.name().map_err(|e| fail("reading the device name", e))?;
        let sm_count =
            ctx.attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| fail("reading the number of multiprocessors", e))? as usize;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| fail("reading the compute capability", e))?;
        let tc_shared_limit = if major >= 8 {
            let limit = ctx
                .attribute(
                    cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                )
                .map_err(|e| fail("reading the shared memory limit", e))?;
            // The q4 expert kernels also have static shared memory, so they
            // are allowed what they launch with rather than the limit.
            for kernel in [
                &kernels.moe_prefill_gate_up_q4,
                &kernels.moe_prefill_down_q4,
            ] {
                allow_shared(kernel, prefill::Q4_SHARED_BYTES, "q4 expert kernels")?;
            }
            for kernel in [
                &kernels.moe_down_tc_q4,
                &kernels.moe_few_gate_up_q4,
                &kernels.moe_few_down_q4,
                &kernels.gdn_chunk_prepare,
                &kernels.gdn_chunk_state,
                &kernels.gdn_chunk_output,
            ]
            .into_iter()
            .chain(KvType::ALL.into_iter().flat_map(|kv| {
                let k = kernels.kv(kv);
                [
                    &k.flash_attention_128,
                    &k.flash_attention_256,
                    &k.flash_attention_128_direct,
                    &k.flash_attention_256_direct,
                ]
            })) {
                allow_shared(kernel, limit as usize, "tensor-core kernels")?;
            }
            allow_shared(
                &kernels.tile_q4_codes,
                device_expert::CODE_TILE_MAX_BYTES,
                "expert tiling kernel",
            )?;
            Some(limit as usize)
        } else {
            None
        };
        let memory = ctx
            .total_mem()
            .map_err(|e| fail("reading the memory size", e))?;
        let cache = match options.expert_cache_bytes {
            Some(bytes) => human_bytes(bytes),
            None => "auto".to_string(),
        };
        let batched_expert_bytes = stream
            .alloc_zeros::<u64>(1)
            .map_err(|e| fail("allocating a counter", e))?;
        Ok(CudaBackend {
            ordinal,
            description: format!(
                "cuda:{ordinal} ({name}, sm_{major}{minor}, {}; VRAM expert cache {cache}{})",
                human_bytes(memory as u64),
                match options.activations {
                    Activations::F32 => "",
                    Activations::Int8 => "; int8 activations for prompts' q4 products",
                }
            ),
            ctx,
            stream,
            kernels,
            rope_frequencies: Mutex::new(HashMap::new()),
            experts: Mutex::new(VramCache::new(options.expert_cache_bytes)),
            profiler: profile::Profiler::from_env(),
            capture: Mutex::new(None),
            recordings: Mutex::new(graph::Recordings::default()),
            graphs_enabled: options.graphs.unwrap_or_else(graph::enabled_by_env)
                && profile::Profiler::from_env().is_none(),
            batched_steps: options
                .batched_steps
                .unwrap_or_else(crate::tuning::cuda_batched_steps),
            attention_copies: options.attention_copies.unwrap_or(true),
            engine_step: Mutex::new(None),
            batched_expert_bytes,
            programmatic_launch: major >= 9 && graph::programmatic_by_env(),
            whole_rows_min: crate::tuning::cuda_whole_rows_min(linear::WHOLE_ROWS_MIN),
            few_linear_max: crate::tuning::cuda_few_linear_max(linear_few::FEW_LINEAR_MAX_TOKENS),
            gdn_chunked_min: crate::tuning::cuda_gdn_chunked_min(delta_net::GDN_CHUNKED_MIN),
            decode_splits_max: crate::tuning::cuda_decode_splits(geometry::DECODE_ATTN_MAX_SPLITS),
            grouped_decode_min: crate::tuning::cuda_grouped_decode_min(),
            grouped_decode_tc: major >= 8 && crate::tuning::cuda_grouped_decode_tc(),
            sm_count,
            downloads: Mutex::default(),
            tc_shared_limit,
            tiled_experts: tc_shared_limit.is_some()
                && options
                    .tiled_experts
                    .or_else(crate::tuning::cuda_tiled_experts)
                    .unwrap_or(true),
            share: None,
            parallel: None,
            hybrid: hybrid::Hybrid::new(options.cpu_experts),
            activations: options.activations,
        })
    }

    /// What the VRAM expert cache has done so far; on several GPUs, their
    /// caches together (a layer counts as complete when it is on every
    /// GPU) and the bytes exchanged between them.
    pub fn expert_cache_stats(&self) -> ExpertCacheStats {
        let mut all = self.streaming_stats();
        for peer in self.ranks().skip(1) {
            let s = peer.streaming_stats();
            all.hits += s.hits;
            all.misses += s.misses;
            all.prefetch_hits += s.prefetch_hits;
            all.prefetches += s.prefetches;
            all.uploads += s.uploads;
            all.uploaded_bytes += s.uploaded_bytes;
            all.copy_nanos = all.copy_nanos.max(s.copy_nanos);
            all.evictions += s.evictions;
            all.resident_bytes += s.resident_bytes;
            all.budget_bytes = all.budget_bytes.zip(s.budget_bytes).map(|(a, b)| a + b);
            all.complete_layers = all.complete_layers.min(s.complete_layers);
            all.pinned_hits += s.pinned_hits;
            all.pinned_misses += s.pinned_misses;
            all.pinned_bytes += s.pinned_bytes;
            all.pinned_budget_bytes += s.pinned_budget_bytes;
            all.batched_expert_bytes += s.batched_expert_bytes;
            all.cpu_experts += s.cpu_experts;
            all.cpu_expert_bytes += s.cpu_expert_bytes;
            all.cpu_nanos += s.cpu_nanos;
        }
        all.exchanged_bytes = self.exchanged_bytes();
        all
    }

    /// A device tensor holding `data` (`[rows, cols]`, row-major).
    pub fn tensor_from_host(&self, rows: usize, cols: usize, data: &[f32]) -> Result<Tensor> {
        assert_eq!(
            data.len(),
            rows * cols,
            "tensor_from_host: data is not [rows, cols]"
        );
        Ok(Tensor {
            rows,
            cols,
            data: self.upload("tensor_from_host", data)?,
        })
    }

    /// Uninitialised device memory for `len` values (at least one, so that
    /// empty tensors are valid buffers too). When memory runs out, cached
    /// experts are dropped until the allocation fits or none is left.
    fn try_alloc<T: DeviceRepr>(
        &self,
        len: usize,
    ) -> std::result::Result<CudaSlice<T>, DriverError> {
        if let Some(recorded) = self.recording_alloc(len) {
            return recorded;
        }
        loop {
            // SAFETY: callers write the memory before it is read (or zero it).
            match unsafe { self.stream.alloc::<T>(len.max(1)) } {
                Err(e)
                    if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY
                        && self.experts.lock().unwrap().evict_one() => {}
                result => return result,
            }
        }
    }

    fn alloc<T: DeviceRepr>(&self, op: &str, len: usize) -> Result<CudaSlice<T>> {
        ok(op, self.try_alloc(len))
    }

    fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, op: &str, len: usize) -> Result<CudaSlice<T>> {
        let mut data = self.alloc(op, len)?;
        ok(op, self.stream.memset_zeros(&mut data))?;
        Ok(data)
    }

    fn upload<T: DeviceRepr>(&self, op: &str, data: &[T]) -> Result<CudaSlice<T>> {
        let mut buffer = self.alloc(op, data.len())?;
        if !data.is_empty() {
            ok(
                op,
                self.stream
                    .memcpy_htod(data, &mut buffer.slice_mut(..data.len())),
            )?;
        }
        Ok(buffer)
    }

    /// The first `len` values of `data`, on the host.
    fn download<T: DeviceRepr + Default + Clone>(
        &self,
        op: &str,
        data: &CudaSlice<T>,
        len: usize,
    ) -> Result<Vec<T>> {
        if len == 0 {
            return Ok(Vec::new());
        }
        self.note_unrecordable();
        let host = ok(op, self.stream.clone_dtoh(&data.slice(..len)))?;
        ok(op, self.stream.synchronize())?;
        ok(op, self.ctx.check_err())?;
        Ok(host)
    }

    fn tensor(&self, op: &str, rows: usize, cols: usize) -> Result<Tensor> {
        Ok(Tensor {
            rows,
            cols,
            data: self.alloc(op, rows * cols)?,
        })
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if let Some(profiler) = &self.profiler {
            eprintln!("{}", profiler.report());
        }
    }
}

impl<'a> Matrix<'a> {
    /// The storage type as the kernels number it (`DT_*` in common.cuh).
    fn dtype_code(&self) -> i32 {
        match self.layout.dtype {
            DType::F32 => 0,
            DType::Bf16 => 1,
            DType::Q8 => 2,
            DType::Q4 => 3,
            DType::Q3 => 4,
            DType::Q2 => 5,
            DType::Mxfp4 => 6,
        }
    }

    /// Views of the codes (or plain values), scales and biases; the
    /// unquantized types have no scales or biases and pass the values
    /// again in their place.
    fn sections(&self) -> (CudaView<'a, u8>, CudaView<'a, u8>, CudaView<'a, u8>) {
        let l = self.layout;
        let data: &'a CudaSlice<u8> = self.data;
        let start = self.offset;
        let at = |offset: usize| data.slice(start + offset..start + l.total_bytes);
        if l.dtype.is_quantized() {
            (at(0), at(l.scales_offset), at(l.biases_offset))
        } else {
            (at(0), at(0), at(0))
        }
    }
}
