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
//! the host in f32. Only summation orders differ.
//!
//! A device failure inside an operation (memory exhausted even after
//! emptying the expert cache, a kernel fault) is returned as
//! [`Error::Device`] naming the operation: the session that ran it rolls
//! back, and the process and other sessions go on. Only a failure of the
//! waits that keep memory safe (an expert buffer held until its copy is
//! done) ends the process (`must`).

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

mod compile;
mod experts;
mod gemm;
mod graph;
mod prefill;
mod profile;
mod state;
mod streaming;

use std::collections::HashMap;
use std::fmt::Display;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::CUresult;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut,
    DeviceRepr, DriverError, LaunchConfig, PinnedHostSlice, ValidAsZeroBits,
};

pub use state::{DeltaNetState, KvCache};
pub use streaming::ExpertCacheStats;

use super::{
    AttentionShape, Backend, GatedDeltaNetParams, HostDeltaNetState, HostKv, RmsNorm, Rope,
};
use crate::config::LinearAttentionConfig;
use crate::error::{Error, Result};
use crate::experts::ExpertStore;
use crate::format::TensorData;
use crate::quant::{DType, MatrixLayout};
use crate::util::{Progress, human_bytes};
use compile::Kernels;
use streaming::VramCache;

/// Threads per block of the grid-stride kernels.
const THREADS: u32 = 256;
/// Most blocks of a grid-stride launch (they loop over the rest).
const MAX_BLOCKS: usize = 65_535;
/// Warps per block of the linear kernels (`LINEAR_WARPS` in linear.cu).
const LINEAR_WARPS: usize = 4;
/// Warps per block of the one-token linear kernel (`VEC_WARPS` in
/// linear.cu).
const VECTOR_WARPS: usize = 8;
/// Rows per block of the one-token linear kernel (`VEC_ROWS`).
const VECTOR_ROWS: usize = 4;
/// Rows per block of its whole-rows variant (`VEC_WARPS · ROWS_PER_WARP`).
const WHOLE_ROWS: usize = VECTOR_WARPS * 2;
/// Rows (over the matrices of one launch) from which the whole-rows
/// variant is used, unless `MOEFLUX_CUDA_WHOLE_ROWS_MIN` says otherwise
/// (a tuning knob).
const WHOLE_ROWS_MIN: usize = 1024;
/// Columns from which rows are split across a block's warps whatever the
/// rows: each warp still has a long stretch to stream (o_proj of the 30B
/// shape, 2048 × 4096: 6.3 µs split, 7.7 µs whole rows, H100).
const SPLIT_COLS_MIN: usize = 4096;
/// Matrices one launch of the one-token linear kernel covers (`MAX_JOBS`).
const MAX_MATVEC_JOBS: usize = 4;

/// One matrix of a one-token linear launch (`MatvecJob` in linear.cu):
/// device addresses, its rows, and its first block of the grid.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MatvecJob {
    codes: u64,
    scales: u64,
    biases: u64,
    out: u64,
    rows: i32,
    first_block: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct MatvecJobs {
    job: [MatvecJob; MAX_MATVEC_JOBS],
    count: i32,
}

// SAFETY: plain data laid out as the kernels' structs (C layout, device
// addresses as 64-bit integers).
unsafe impl DeviceRepr for MatvecJobs {}

/// The RMSNorm a one-token product applies to its input (`FusedNorm` in
/// linear.cu): the norm's weight, where block 0 stores the normalised
/// input, and the norm's parameters.
#[repr(C)]
#[derive(Clone, Copy)]
struct FusedNorm {
    weight: u64,
    normed: u64,
    eps: f32,
    offset: f32,
}

// SAFETY: plain data laid out as the kernels' struct (C layout, device
// addresses as 64-bit integers).
unsafe impl DeviceRepr for FusedNorm {}

/// Values from which [`Backend::to_host`] copies through page-locked
/// memory (a vocabulary's logits; small downloads are not worth it).
const PINNED_DOWNLOAD_MIN: usize = 1 << 14;

/// Rows from which a one-token q4 product runs on the tensor cores
/// ([`CudaBackend::matvec_tensor_cores`]): LM heads, not layer matrices.
const TC_VECTOR_ROWS_MIN: usize = 32768;
/// Warps per block of linear_vector_tc_q4 (`TC_VECTOR_WARPS` in
/// matvec_tc.cu), and its blocks per SM (two fit by registers; fewer or
/// more were slower).
const TC_VECTOR_WARPS: usize = 8;
const TC_VECTOR_BLOCKS_PER_SM: usize = 2;

/// Tokens (warps) per block of the one-warp router.
const ROUTE_WARPS: usize = 4;
/// Threads per block of the attention kernel (`ATTN_WARPS` warps).
const ATTENTION_THREADS: u32 = 128;
/// Threads per block of its one-token variant (`DECODE_ATTN_WARPS` warps).
const ATTENTION_DECODE_THREADS: u32 = 512;
/// Largest head dimension of the attention kernel (`ATTN_MAX_PER_LANE` · 32).
const MAX_HEAD_DIM: usize = 512;
/// Query rows per block, keys per staged tile and warps of the prefill
/// attention kernel (`FA_ROWS`, `FA_KEYS`, `FA_WARPS`, `FA_ROWS_PER_WARP`,
/// `FA_KEY_PAD` in attention.cu).
const FLASH_ROWS: usize = 32;
const FLASH_KEYS: usize = 32;
const FLASH_WARPS: usize = 4;
const FLASH_ROWS_PER_WARP: usize = 8;
const FLASH_KEY_PAD: usize = 4;
/// Largest head dimension of the prefill attention kernels.
const FLASH_MAX_HEAD_DIM: usize = 256;
/// Tokens from which attention takes the prefill kernels: with fewer, the
/// (token, head) blocks of the other kernel are more parallel.
const FLASH_MIN_TOKENS: usize = 16;

/// Dynamic shared memory of a prefill attention block: the query rows,
/// a tile of keys (rows padded) and values, and each warp's probabilities.
fn flash_attention_shared_bytes(head_dim: usize) -> usize {
    4 * (FLASH_ROWS * head_dim
        + FLASH_KEYS * (head_dim + FLASH_KEY_PAD)
        + FLASH_KEYS * head_dim
        + FLASH_WARPS * FLASH_KEYS * FLASH_ROWS_PER_WARP)
}
/// Warps (value columns) per block of the Gated DeltaNet recurrence
/// (`GDN_WARPS`), and its largest key head dimension (32 · `GDN_LANE_ROWS`).
const GDN_WARPS: usize = 16;
const GDN_MAX_KEY_DIM: usize = 256;
/// Tokens from which Gated DeltaNet's delta rule runs in chunks on the
/// tensor cores (gdn_chunked.cu) instead of token by token, unless
/// `MOEFLUX_CUDA_GDN_CHUNKED_MIN` says otherwise (a tuning knob).
const GDN_CHUNKED_MIN: usize = 64;
/// Tokens per chunk (`GDN_CHUNK`), state columns per block
/// (`GDN_STATE_COLS`), threads per block and the largest head dimension
/// (`GDN_MAX_DIM`) of the chunked kernels.
const GDN_CHUNK: usize = 64;
const GDN_STATE_COLS: usize = 32;
const GDN_CHUNK_THREADS: u32 = 256;
const GDN_CHUNK_MAX_DIM: usize = 128;

/// Dynamic shared memory of the chunked Gated DeltaNet kernels
/// (gdn_chunked.cu; strides as there): gdn_chunk_prepare's K and Q (then
/// the right-hand sides), L, the inverses of L's diagonal blocks, g and β; gdn_chunk_state's state tile, U,
/// W_k, Kᵀ and update factors; gdn_chunk_output's Q, M, S0 tile, U and g.
fn gdn_chunked_shared_bytes(dk: usize, dv: usize) -> [usize; 3] {
    let ldk = dk.next_multiple_of(32) + 4;
    let ldx = dk.max(dv).next_multiple_of(32) + 4;
    let (tile_ld, tri_ld) = (GDN_STATE_COLS + 8, GDN_CHUNK + 4);
    let dk16 = dk.next_multiple_of(16);
    [
        4 * (GDN_CHUNK * (ldk + ldx + 2 * tri_ld) + 2 * GDN_CHUNK),
        4 * (dk16 * (tile_ld + tri_ld) + GDN_CHUNK * (tile_ld + ldk) + GDN_CHUNK),
        4 * (GDN_CHUNK * (ldk + tri_ld + tile_ld) + dk.next_multiple_of(8) * tile_ld + GDN_CHUNK),
    ]
}
/// Shared memory a block may use without opting in to more.
const MAX_SHARED_BYTES: usize = 48 * 1024;

/// A count from the environment variable `name` (a tuning knob for
/// experiments), else `default`.
fn tuning_knob(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

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

/// Options of a [`CudaBackend`].
#[derive(Clone, Copy, Debug, Default)]
pub struct CudaOptions {
    /// Bytes of device memory for cached experts; `None`: the device memory
    /// still free when the experts are first prepared (after the weights),
    /// less a reserve for KV caches and activations (the larger of 4 GiB
    /// and a tenth of the device). The cache also gives memory back when an
    /// allocation fails.
    pub expert_cache_bytes: Option<u64>,
}

/// Computes on one CUDA device (see the module documentation). Each model
/// owns its backend: the VRAM expert cache is keyed by layer and expert.
pub struct CudaBackend {
    ordinal: usize,
    description: String,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    /// Rotary frequencies by (rotary_dim, theta bits).
    rope_frequencies: Mutex<HashMap<(usize, u64), RopeFrequencies>>,
    experts: Mutex<VramCache>,
    /// Device time per operation, when `MOEFLUX_CUDA_PROFILE` is set.
    profiler: Option<profile::Profiler>,
    /// Whether decode steps are recorded and replayed (graph.rs).
    graphs_enabled: bool,
    /// Whether recordings link kernels by programmatic edges (graph.rs;
    /// compute capability 9.0 and later).
    programmatic_launch: bool,
    /// See [`WHOLE_ROWS_MIN`].
    whole_rows_min: usize,
    /// See [`GDN_CHUNKED_MIN`].
    gdn_chunked_min: usize,
    /// Streaming multiprocessors of the device.
    sm_count: usize,
    /// Page-locked memory that large downloads (a decode step's logits)
    /// pass through: a copy from the device into it runs at the bus's
    /// speed, one into pageable memory is staged by the driver.
    download_staging: Mutex<Option<PinnedHostSlice<f32>>>,
    /// Shared memory a block of the kernels that opt in to more than
    /// [`MAX_SHARED_BYTES`] may use (the tensor-core expert down and the
    /// chunked Gated DeltaNet); None before compute capability 8.0, where
    /// those kernels are not built.
    tc_shared_limit: Option<usize>,
    /// The step being recorded, if one is.
    capture: Mutex<Option<graph::Capture>>,
    recordings: Mutex<graph::Recordings>,
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
}

impl Weight {
    fn matrix(&self) -> Matrix<'_> {
        Matrix {
            name: &self.name,
            layout: self.layout,
            data: &self.data,
            offset: 0,
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
}

/// Each token's selected experts and weights on the device, and the ids on
/// the host once something asked for them (the expert store reads by id).
pub struct Routing {
    top_k: usize,
    rows: usize,
    experts: CudaSlice<u32>,
    weights: CudaSlice<f32>,
    host_experts: OnceLock<Vec<u32>>,
}

impl Routing {
    fn experts_on_host(&self) -> Result<&[u32]> {
        if let Some(ids) = self.host_experts.get() {
            return Ok(ids);
        }
        let stream = self.experts.stream();
        let ids = ok(
            "reading the selected experts",
            stream.clone_dtoh(&self.experts),
        )?;
        ok("reading the selected experts", stream.synchronize())?;
        Ok(self.host_experts.get_or_init(|| ids))
    }

    /// Every token's expert weights, in the order of the selected experts.
    pub fn weights_to_host(&self) -> Result<Vec<f32>> {
        let stream = self.weights.stream();
        let weights = ok(
            "reading the routing weights",
            stream.clone_dtoh(&self.weights),
        )?;
        ok("reading the routing weights", stream.synchronize())?;
        Ok(weights)
    }
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

/// Columns one 32-bit word of a row holds in the one-token kernels
/// (`WORD_COLS` in linear.cu): rows whose width is a multiple of it take
/// them.
fn vector_cols(dtype: DType) -> usize {
    match dtype {
        DType::Q4 => 8,
        DType::Q8 => 4,
        DType::Bf16 => 2,
        DType::F32 => 1,
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
        let flash_shared = flash_attention_shared_bytes(FLASH_MAX_HEAD_DIM) as i32;
        for kernel in [&kernels.flash_attention_128, &kernels.flash_attention_256] {
            kernel
                .set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    flash_shared,
                )
                .map_err(|e| fail("allowing the attention kernels their shared memory", e))?;
        }
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
            for kernel in [
                &kernels.moe_down_tc_q4,
                &kernels.gdn_chunk_prepare,
                &kernels.gdn_chunk_state,
                &kernels.gdn_chunk_output,
            ] {
                kernel
                    .set_attribute(
                        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        limit,
                    )
                    .map_err(|e| fail("allowing the tensor-core kernels their shared memory", e))?;
            }
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
        Ok(CudaBackend {
            ordinal,
            description: format!(
                "cuda:{ordinal} ({name}, sm_{major}{minor}, {}; VRAM expert cache {cache})",
                human_bytes(memory as u64)
            ),
            ctx,
            stream,
            kernels,
            rope_frequencies: Mutex::new(HashMap::new()),
            experts: Mutex::new(VramCache::new(options.expert_cache_bytes)),
            profiler: profile::Profiler::from_env(),
            capture: Mutex::new(None),
            recordings: Mutex::new(graph::Recordings::default()),
            graphs_enabled: graph::enabled_by_env() && profile::Profiler::from_env().is_none(),
            programmatic_launch: major >= 9 && graph::programmatic_by_env(),
            whole_rows_min: tuning_knob("MOEFLUX_CUDA_WHOLE_ROWS_MIN", WHOLE_ROWS_MIN),
            gdn_chunked_min: tuning_knob("MOEFLUX_CUDA_GDN_CHUNKED_MIN", GDN_CHUNKED_MIN),
            sm_count,
            download_staging: Mutex::new(None),
            tc_shared_limit,
        })
    }

    /// What the VRAM expert cache has done so far.
    pub fn expert_cache_stats(&self) -> ExpertCacheStats {
        self.streaming_stats()
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

    /// `x · wᵀ` for `x` `[n, cols]` in device memory.
    fn matmul(
        &self,
        x: &CudaSlice<f32>,
        n: usize,
        cols: usize,
        w: &Matrix<'_>,
    ) -> Result<CudaSlice<f32>> {
        let l = w.layout;
        assert_eq!(
            cols, l.cols,
            "linear: input width {cols} vs weight {} [{}, {}]",
            w.name, l.rows, l.cols
        );
        if let Some(out) = self.matmul_tensor_cores(x, n, cols, w)? {
            return Ok(out);
        }
        let single = n == 1;
        if single && cols.is_multiple_of(vector_cols(l.dtype)) {
            return self.matvec(x, w);
        }
        let (op, kernel) = match (l.dtype, single) {
            (DType::F32, true) => ("linear f32", &self.kernels.linear_f32_t1),
            (DType::F32, false) => ("linear f32", &self.kernels.linear_f32_t8),
            (DType::Bf16, true) => ("linear bf16", &self.kernels.linear_bf16_t1),
            (DType::Bf16, false) => ("linear bf16", &self.kernels.linear_bf16_t8),
            (DType::Q8, true) => ("linear q8", &self.kernels.linear_q8_t1),
            (DType::Q8, false) => ("linear q8", &self.kernels.linear_q8_t8),
            (DType::Q4, true) => ("linear q4", &self.kernels.linear_q4_t1),
            (DType::Q4, false) => ("linear q4", &self.kernels.linear_q4_t8),
        };
        let tile = if single { 1 } else { 8 };
        let token_tiles = n.div_ceil(tile);
        assert!(
            token_tiles <= MAX_BLOCKS,
            "linear: {n} tokens in one call is too many"
        );
        let (codes, scales, biases) = w.sections();
        let mut out = self.alloc::<f32>(op, n * l.rows)?;
        let (rows, cols, n_i) = (int(l.rows, "rows"), int(cols, "columns"), int(n, "tokens"));
        let config = LaunchConfig {
            grid_dim: (l.rows.div_ceil(LINEAR_WARPS) as u32, token_tiles as u32, 1),
            block_dim: ((LINEAR_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self, op, kernel, config, &codes, &scales, &biases, x, &mut out, &rows, &cols, &n_i
        );
        Ok(out)
    }

    /// [`Backend::qk_norm_rope`], row `t` at position `start_pos + t`, or
    /// at `positions[t]` when given (rows of several sequences).
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_at(
        &self,
        mut q: Tensor,
        mut k: Tensor,
        q_norm: &Weight,
        k_norm: &Weight,
        norm: RmsNorm,
        rope: Rope,
        start_pos: usize,
        positions: Option<&CudaSlice<i64>>,
    ) -> Result<(Tensor, Tensor)> {
        let positions = positions.map_or(0, |p| p.device_ptr(&self.stream).0);
        let head_dim = rope.head_dim;
        assert!(
            q_norm.vector_len("qk_norm_rope") == head_dim
                && k_norm.vector_len("qk_norm_rope") == head_dim
                && q.rows == k.rows
                && q.cols.is_multiple_of(head_dim)
                && k.cols.is_multiple_of(head_dim)
                && rope.rotary_dim <= head_dim
                && rope.rotary_dim.is_multiple_of(2),
            "qk_norm_rope: q [{}, {}], k [{}, {}], head_dim {head_dim}, rotary_dim {}",
            q.rows,
            q.cols,
            k.rows,
            k.cols,
            rope.rotary_dim
        );
        let op = "qk_norm_rope";
        let position = self.recorded_position(None);
        let frequencies = self.rope_frequencies(rope.rotary_dim, rope.theta)?;
        let (q_heads, k_heads) = (q.cols / head_dim, k.cols / head_dim);
        let offset = if norm.unit_offset { 1.0f32 } else { 0.0 };
        let (rows, q_heads_i, k_heads_i, head_dim_i, half, start) = (
            long(q.rows),
            int(q_heads, "query heads"),
            int(k_heads, "key heads"),
            int(head_dim, "head_dim"),
            int(rope.rotary_dim / 2, "rotary half"),
            long(start_pos),
        );
        launch!(
            self,
            op,
            &self.kernels.qk_norm_rope,
            block_per_item(
                q.rows * (q_heads + k_heads),
                if head_dim <= 128 { 128 } else { 256 },
                (head_dim * 4) as u32
            ),
            &mut q.data,
            &mut k.data,
            &q_norm.data,
            &k_norm.data,
            &*frequencies,
            &rows,
            &q_heads_i,
            &k_heads_i,
            &head_dim_i,
            &half,
            &norm.eps,
            &offset,
            &start,
            &position,
            &positions
        );
        Ok((q, k))
    }

    /// `w · x` for one token, 16 bytes of a row per lane at a time (see
    /// linear.cu), or on the tensor cores for a q4 matrix of many rows.
    fn matvec(&self, x: &CudaSlice<f32>, w: &Matrix<'_>) -> Result<CudaSlice<f32>> {
        if let Some(out) = self.matvec_tensor_cores(x, w)? {
            return Ok(out);
        }
        let mut out = self.alloc::<f32>("linear", w.layout.rows)?;
        self.matvecs(x, &mut [(w, &mut out)], false, None)?;
        Ok(out)
    }

    /// `w · x` for one token with linear_vector_tc_q4 (matvec_tc.cu) where
    /// it applies: q4, at least [`TC_VECTOR_ROWS_MIN`] rows (an LM head),
    /// compute capability 8.0 or later, the B table within the default
    /// shared memory, codes 8-byte aligned. 79.0 vs 92.4 µs for the 30B
    /// shape's LM head on an H100 (kernel bench).
    fn matvec_tensor_cores(
        &self,
        x: &CudaSlice<f32>,
        w: &Matrix<'_>,
    ) -> Result<Option<CudaSlice<f32>>> {
        let l = w.layout;
        let shared = experts::tc_staged_bytes(l.cols);
        if l.dtype != DType::Q4
            || l.rows < TC_VECTOR_ROWS_MIN
            || self.tc_shared_limit.is_none()
            || shared > MAX_SHARED_BYTES
            || !w.offset.is_multiple_of(8)
        {
            return Ok(None);
        }
        let mut out = self.alloc::<f32>("linear", l.rows)?;
        let (codes, scales, biases) = w.sections();
        let config = LaunchConfig {
            grid_dim: ((self.sm_count * TC_VECTOR_BLOCKS_PER_SM) as u32, 1, 1),
            block_dim: ((TC_VECTOR_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let (rows, cols) = (int(l.rows, "rows"), int(l.cols, "columns"));
        launch!(
            self,
            "linear q4 (tensor cores)",
            &self.kernels.linear_vector_tc_q4,
            config,
            &codes,
            &scales,
            &biases,
            x,
            &mut out,
            &rows,
            &cols
        );
        Ok(Some(out))
    }

    /// [`CudaBackend::matvecs`] into a new one-row tensor per matrix.
    fn matvecs_to_tensors(
        &self,
        x: &CudaSlice<f32>,
        matrices: &[&Matrix<'_>],
        norm: Option<FusedNorm>,
    ) -> Result<Vec<Tensor>> {
        let mut outs: Vec<CudaSlice<f32>> = matrices
            .iter()
            .map(|m| self.alloc("linear", m.layout.rows))
            .collect::<Result<_>>()?;
        let mut jobs: Vec<(&Matrix<'_>, &mut CudaSlice<f32>)> =
            matrices.iter().copied().zip(outs.iter_mut()).collect();
        self.matvecs(x, &mut jobs, false, norm)?;
        Ok(outs
            .into_iter()
            .zip(matrices)
            .map(|(data, m)| Tensor {
                rows: 1,
                cols: m.layout.rows,
                data,
            })
            .collect())
    }

    /// Whether [`CudaBackend::matvecs`] takes these matrices for one token
    /// of width `cols`: the same type, rows a whole number of 16-byte loads.
    fn matvecs_fit(cols: usize, ws: &[&Matrix<'_>]) -> bool {
        (1..=MAX_MATVEC_JOBS).contains(&ws.len())
            && ws.iter().all(|w| {
                w.layout.dtype == ws[0].layout.dtype
                    && w.layout.cols == cols
                    && cols.is_multiple_of(vector_cols(w.layout.dtype))
            })
    }

    /// `out_j (+)= w_j · x` for one token `x` and up to
    /// [`MAX_MATVEC_JOBS`] matrices of one type, in one launch; with
    /// `accumulate` each result is added to its output. With `norm` the
    /// products take the RMSNorm of x instead (see `FusedNorm` in
    /// linear.cu), which the launch also stores where `norm` says.
    fn matvecs(
        &self,
        x: &CudaSlice<f32>,
        jobs: &mut [(&Matrix<'_>, &mut CudaSlice<f32>)],
        accumulate: bool,
        norm: Option<FusedNorm>,
    ) -> Result<()> {
        let ws: Vec<&Matrix<'_>> = jobs.iter().map(|(w, _)| *w).collect();
        let cols = ws[0].layout.cols;
        assert!(
            Self::matvecs_fit(cols, &ws),
            "linear: {} matrices of one token do not fit the one-token kernel",
            ws.len()
        );
        let dtype = ws[0].layout.dtype;
        let k = &self.kernels;
        // Whole rows per warp stream faster (12.9 vs 18.4 µs for q, k and v
        // of the 30B shape on an H100); matrices of few rows (a router) need
        // the columns split to keep enough loads in flight (5.3 vs 10.7 µs).
        let whole_rows = cols < SPLIT_COLS_MIN
            && ws.iter().map(|w| w.layout.rows).sum::<usize>() >= self.whole_rows_min;
        // Per type: columns split, whole rows, and both with the norm fused.
        let (op, kernels) = match dtype {
            DType::F32 => (
                "linear f32",
                [
                    &k.linear_vector_f32,
                    &k.linear_vector_f32_rows,
                    &k.linear_vector_f32_normed,
                    &k.linear_vector_f32_rows_normed,
                ],
            ),
            DType::Bf16 => (
                "linear bf16",
                [
                    &k.linear_vector_bf16,
                    &k.linear_vector_bf16_rows,
                    &k.linear_vector_bf16_normed,
                    &k.linear_vector_bf16_rows_normed,
                ],
            ),
            DType::Q8 => (
                "linear q8",
                [
                    &k.linear_vector_q8,
                    &k.linear_vector_q8_rows,
                    &k.linear_vector_q8_normed,
                    &k.linear_vector_q8_rows_normed,
                ],
            ),
            DType::Q4 => (
                "linear q4",
                [
                    &k.linear_vector_q4,
                    &k.linear_vector_q4_rows,
                    &k.linear_vector_q4_normed,
                    &k.linear_vector_q4_rows_normed,
                ],
            ),
        };
        let kernel = kernels[usize::from(whole_rows) + 2 * usize::from(norm.is_some())];
        let rows_per_block = if whole_rows { WHOLE_ROWS } else { VECTOR_ROWS };
        let mut packed = MatvecJobs {
            job: [MatvecJob::default(); MAX_MATVEC_JOBS],
            count: jobs.len() as i32,
        };
        let mut blocks = 0;
        for (slot, (w, out)) in packed.job.iter_mut().zip(jobs.iter_mut()) {
            let l = w.layout;
            assert!(
                out.len() >= l.rows,
                "linear: output of {} too short",
                w.name
            );
            let (codes, scales, biases) = w.sections();
            *slot = MatvecJob {
                codes: codes.device_ptr(&self.stream).0,
                scales: scales.device_ptr(&self.stream).0,
                biases: biases.device_ptr(&self.stream).0,
                out: out.device_ptr_mut(&self.stream).0,
                rows: int(l.rows, "rows"),
                first_block: int(blocks, "blocks"),
            };
            blocks += l.rows.div_ceil(rows_per_block);
        }
        let config = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: ((VECTOR_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (cols_i, accumulate_i) = (int(cols, "columns"), i32::from(accumulate));
        match &norm {
            None => launch!(self, op, kernel, config, &packed, x, &cols_i, &accumulate_i),
            Some(norm) => {
                launch!(
                    self,
                    op,
                    kernel,
                    config,
                    &packed,
                    x,
                    &cols_i,
                    &accumulate_i,
                    norm
                )
            }
        };
        Ok(())
    }

    fn silu_mul_raw(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        len: usize,
    ) -> Result<CudaSlice<f32>> {
        let mut out = self.alloc::<f32>("silu_mul", len)?;
        let n = long(len);
        launch!(
            self,
            "silu_mul",
            &self.kernels.silu_mul,
            grid_stride(len),
            gate,
            up,
            &mut out,
            &n
        );
        Ok(out)
    }

    /// Rotary frequencies, computed in f32 exactly as the CPU backend does
    /// (transformers' RotaryEmbedding), uploaded once per shape.
    fn rope_frequencies(&self, rotary_dim: usize, theta: f64) -> Result<RopeFrequencies> {
        let mut cache = self.rope_frequencies.lock().unwrap();
        let key = (rotary_dim, theta.to_bits());
        if let Some(frequencies) = cache.get(&key) {
            return Ok(frequencies.clone());
        }
        let inv_freq: Vec<f32> = (0..rotary_dim / 2)
            .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / rotary_dim as f32))
            .collect();
        let frequencies = Arc::new(self.upload("rope", &inv_freq)?);
        cache.insert(key, frequencies.clone());
        Ok(frequencies)
    }

    /// RMSNorm of each group of `weight`'s length; `z` adds the gate of
    /// Gated DeltaNet's norm.
    fn norm(
        &self,
        x: &Tensor,
        weight: &Weight,
        z: Option<&Tensor>,
        eps: f32,
        offset: f32,
    ) -> Result<Tensor> {
        let op = if z.is_some() {
            "gated_rms_norm"
        } else {
            "rms_norm"
        };
        let group = weight.vector_len(op);
        let total = x.rows * x.cols;
        assert!(
            group > 0 && total.is_multiple_of(group),
            "{op}: {} values are not groups of {group} ({})",
            total,
            weight.name
        );
        let groups = total / group;
        // Few long groups (a decode step's rows) take wide blocks: each
        // thread's loads are serial, so fewer per thread is faster.
        let threads = match group {
            0..=128 => 128,
            129..=512 => 256,
            _ if groups < 64 => 1024,
            _ => 256,
        };
        let config = block_per_item(groups, threads, 0);
        let mut out = self.tensor(op, x.rows, x.cols)?;
        let (groups, group) = (long(groups), int(group, "norm group"));
        match z {
            None => launch!(
                self,
                op,
                &self.kernels.rms_norm,
                config,
                &x.data,
                &weight.data,
                &mut out.data,
                &groups,
                &group,
                &eps,
                &offset
            ),
            Some(z) => {
                assert_eq!(z.rows * z.cols, total, "gated_rms_norm: gate shape");
                launch!(
                    self,
                    op,
                    &self.kernels.gated_rms_norm,
                    config,
                    &x.data,
                    &z.data,
                    &weight.data,
                    &mut out.data,
                    &groups,
                    &group,
                    &eps
                )
            }
        }
        Ok(out)
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

impl Backend for CudaBackend {
    type Tensor = Tensor;
    type Weight = Weight;
    type KvCache = KvCache;
    type DeltaNetState = DeltaNetState;
    type Routing = Routing;

    fn name(&self) -> String {
        self.description.clone()
    }

    fn memory_bandwidth(&self) -> Result<f64> {
        const BYTES: usize = 1 << 30;
        let src = self.alloc::<u8>("bandwidth probe", BYTES)?;
        let mut dst = self.alloc::<u8>("bandwidth probe", BYTES)?;
        let mut best = f64::INFINITY;
        for _ in 0..6 {
            let start = std::time::Instant::now();
            ok("bandwidth probe", self.stream.memcpy_dtod(&src, &mut dst))?;
            ok("bandwidth probe", self.stream.synchronize())?;
            best = best.min(start.elapsed().as_secs_f64());
        }
        Ok(2.0 * BYTES as f64 / best / 1e9)
    }

    fn load_weight(&self, tensor: &TensorData) -> Result<Weight> {
        let bytes = tensor.bytes();
        let fail = |e: DriverError| {
            device_error(self.ordinal, format!("uploading tensor {}", tensor.name), e)
        };
        let mut data = self.try_alloc::<u8>(bytes.len()).map_err(fail)?;
        if !bytes.is_empty() {
            self.stream
                .memcpy_htod(bytes, &mut data.slice_mut(..bytes.len()))
                .map_err(fail)?;
        }
        Ok(Weight {
            name: tensor.name.clone(),
            layout: tensor.layout,
            data,
        })
    }

    fn new_kv_cache(&self, shape: AttentionShape) -> Result<KvCache> {
        self.kv_new(shape)
    }

    fn kv_len(&self, cache: &KvCache) -> usize {
        cache.len()
    }

    fn kv_truncate(&self, cache: &mut KvCache, len: usize) {
        self.kv_truncate_to(cache, len);
    }

    fn kv_export(&self, cache: &KvCache) -> Result<HostKv> {
        self.kv_to_host(cache)
    }

    fn kv_import(&self, shape: AttentionShape, host: HostKv) -> Result<KvCache> {
        self.kv_from_host(shape, host)
    }

    fn new_delta_net_state(&self, cfg: &LinearAttentionConfig) -> Result<DeltaNetState> {
        self.linear_new(cfg)
    }

    fn delta_net_copy(&self, state: &DeltaNetState) -> Result<DeltaNetState> {
        self.linear_clone(state)
    }

    fn delta_net_export(&self, state: &DeltaNetState) -> Result<HostDeltaNetState> {
        self.linear_to_host(state)
    }

    fn delta_net_import(
        &self,
        cfg: &LinearAttentionConfig,
        host: HostDeltaNetState,
    ) -> Result<DeltaNetState> {
        self.linear_from_host(cfg, host)
    }

    fn rows(&self, x: &Tensor) -> usize {
        x.rows
    }

    fn gather_rows(&self, x: &Tensor, ranges: &[Range<usize>]) -> Result<Tensor> {
        let rows = ranges.iter().map(|r| r.len()).sum();
        let mut out = self.tensor("gather_rows", rows, x.cols)?;
        let mut at = 0;
        for r in ranges.iter().filter(|r| !r.is_empty()) {
            let (from, to) = (r.start * x.cols, r.end * x.cols);
            ok(
                "gather_rows",
                self.stream.memcpy_dtod(
                    &x.data.slice(from..to),
                    &mut out.data.slice_mut(at..at + to - from),
                ),
            )?;
            at += to - from;
        }
        Ok(out)
    }

    fn concat_rows(&self, parts: &[Tensor]) -> Result<Tensor> {
        let cols = parts.first().map_or(0, |p| p.cols);
        let mut out = self.tensor("concat_rows", parts.iter().map(|p| p.rows).sum(), cols)?;
        let mut at = 0;
        for p in parts.iter().filter(|p| p.rows > 0) {
            assert_eq!(p.cols, cols, "concat_rows: columns differ");
            let len = p.rows * p.cols;
            ok(
                "concat_rows",
                self.stream
                    .memcpy_dtod(&p.data.slice(..len), &mut out.data.slice_mut(at..at + len)),
            )?;
            at += len;
        }
        Ok(out)
    }

    fn to_host(&self, x: &Tensor) -> Result<Vec<f32>> {
        let len = x.rows * x.cols;
        if len < PINNED_DOWNLOAD_MIN {
            return self.download("to_host", &x.data, len);
        }
        let op = "to_host";
        let mut staging = self.download_staging.lock().unwrap();
        if staging.as_ref().is_none_or(|s| s.len() < len) {
            // SAFETY: page-locked memory the copy below writes before it is
            // read (cached, not write-combined: the host reads it).
            *staging = Some(ok(op, unsafe { self.ctx.alloc_pinned_with_flags(len, 0) })?);
        }
        // The buffer may be longer than this download: copy into its first
        // `len` values only.
        let host = &mut ok(
            op,
            staging.as_mut().expect("allocated above").as_mut_slice(),
        )?[..len];
        ok(op, self.stream.memcpy_dtoh(&x.data.slice(..len), host))?;
        ok(op, self.stream.synchronize())?;
        ok(op, self.ctx.check_err())?;
        Ok(host.to_vec())
    }

    fn embed(&self, table: &Weight, tokens: &[u32]) -> Result<Tensor> {
        let l = table.layout;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= l.rows) {
            panic!(
                "embed: token {bad} is outside table {} of {} rows",
                table.name, l.rows
            );
        }
        let mut out = self.tensor("embed", tokens.len(), l.cols)?;
        // A step being recorded reads its token from the device.
        let recorded = match tokens.len() {
            1 => self.recorded_token(),
            _ => None,
        };
        let (_uploaded, ids) = match recorded {
            Some(word) => (None, word),
            None => {
                let ids = self.upload("embed", tokens)?;
                let address = ids.device_ptr(&self.stream).0;
                (Some(ids), address)
            }
        };
        let (codes, scales, biases) = table.matrix().sections();
        let dtype: i32 = match l.dtype {
            DType::F32 => 0,
            DType::Bf16 => 1,
            DType::Q8 => 2,
            DType::Q4 => 3,
        };
        let (n, rows, cols) = (
            int(tokens.len(), "tokens"),
            int(l.rows, "embedding rows"),
            int(l.cols, "embedding width"),
        );
        launch!(
            self,
            "embed",
            &self.kernels.embed,
            grid_stride(tokens.len() * l.cols),
            &codes,
            &scales,
            &biases,
            &dtype,
            &ids,
            &mut out.data,
            &n,
            &rows,
            &cols
        );
        Ok(out)
    }

    fn linear(&self, x: &Tensor, w: &Weight) -> Result<Tensor> {
        let data = self.matmul(&x.data, x.rows, x.cols, &w.matrix())?;
        Ok(Tensor {
            rows: x.rows,
            cols: w.layout.rows,
            data,
        })
    }

    fn rms_norm(&self, x: &Tensor, weight: &Weight, norm: RmsNorm) -> Result<Tensor> {
        let offset = if norm.unit_offset { 1.0 } else { 0.0 };
        self.norm(x, weight, None, norm.eps, offset)
    }

    fn split_cols(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        assert_eq!(widths.iter().sum::<usize>(), x.cols, "split_cols widths");
        let (rows, src_cols) = (long(x.rows), int(x.cols, "columns"));
        let mut start = 0;
        widths
            .iter()
            .map(|&width| {
                let mut part = self.tensor("split_cols", x.rows, width)?;
                let (start_i, width_i) = (int(start, "column"), int(width, "width"));
                launch!(
                    self,
                    "copy_cols",
                    &self.kernels.copy_cols,
                    grid_stride(x.rows * width),
                    &x.data,
                    &mut part.data,
                    &rows,
                    &src_cols,
                    &start_i,
                    &width_i
                );
                start += width;
                Ok(part)
            })
            .collect::<Result<_>>()
    }

    fn add_assign(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        let len = x.rows * x.cols;
        assert_eq!(len, y.rows * y.cols, "add_assign: shapes differ");
        let n = long(len);
        launch!(
            self,
            "add_assign",
            &self.kernels.add_assign,
            grid_stride(len),
            &mut x.data,
            &y.data,
            &n
        );
        Ok(())
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let len = gate.rows * gate.cols;
        assert_eq!(len, up.rows * up.cols, "silu_mul: shapes differ");
        Ok(Tensor {
            rows: gate.rows,
            cols: gate.cols,
            data: self.silu_mul_raw(&gate.data, &up.data, len)?,
        })
    }

    fn mul_sigmoid(&self, x: &mut Tensor, gate: &Tensor) -> Result<()> {
        let len = x.rows * x.cols;
        if gate.cols == 1 {
            assert_eq!(gate.rows, x.rows, "mul_sigmoid: one gate per row");
            let (rows, cols) = (long(x.rows), int(x.cols, "columns"));
            launch!(
                self,
                "mul_sigmoid_rows",
                &self.kernels.mul_sigmoid_rows,
                grid_stride(len),
                &mut x.data,
                &gate.data,
                &rows,
                &cols
            );
        } else {
            assert_eq!(len, gate.rows * gate.cols, "mul_sigmoid: shapes differ");
            let n = long(len);
            launch!(
                self,
                "mul_sigmoid",
                &self.kernels.mul_sigmoid,
                grid_stride(len),
                &mut x.data,
                &gate.data,
                &n
            );
        };
        Ok(())
    }

    fn rope(&self, x: &mut Tensor, rope: Rope, start_pos: usize) -> Result<()> {
        assert!(
            rope.head_dim > 0
                && x.cols.is_multiple_of(rope.head_dim)
                && rope.rotary_dim <= rope.head_dim
                && rope.rotary_dim.is_multiple_of(2),
            "rope: {} columns, head_dim {}, rotary_dim {}",
            x.cols,
            rope.head_dim,
            rope.rotary_dim
        );
        let half = rope.rotary_dim / 2;
        if half == 0 {
            return Ok(());
        }
        let frequencies = self.rope_frequencies(rope.rotary_dim, rope.theta)?;
        let total = x.rows * (x.cols / rope.head_dim) * half;
        let (rows, cols, head_dim, half, start) = (
            long(x.rows),
            int(x.cols, "columns"),
            int(rope.head_dim, "head_dim"),
            int(half, "rotary half"),
            long(start_pos),
        );
        launch!(
            self,
            "rope",
            &self.kernels.rope,
            grid_stride(total),
            &mut x.data,
            &*frequencies,
            &rows,
            &cols,
            &head_dim,
            &half,
            &start
        );
        Ok(())
    }

    fn attention(
        &self,
        cache: &mut KvCache,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        shape: AttentionShape,
    ) -> Result<Tensor> {
        let (heads, kv_heads, head_dim) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let n = q.rows;
        assert!(
            kv_heads > 0 && heads.is_multiple_of(kv_heads) && head_dim <= MAX_HEAD_DIM,
            "attention: {heads} heads over {kv_heads} KV heads of {head_dim} (at most {MAX_HEAD_DIM})"
        );
        assert_eq!(q.cols, heads * head_dim, "attention: query width");
        assert!(
            k.cols == kv_heads * head_dim && v.cols == k.cols && k.rows == n && v.rows == n,
            "attention: key/value shapes"
        );
        // One token: the attention kernel stores its key and value itself.
        let (start, position) = if n == 1 {
            self.kv_claim_one(cache)?
        } else {
            let start = cache.len();
            self.kv_append(cache, &k.data, &v.data, n)?;
            (start, self.recorded_position(None))
        };
        let mut out = self.tensor("attention", n, heads * head_dim)?;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let (n_i, heads_i, kv_heads_i, head_dim_i, start_l) = (
            int(n, "tokens"),
            int(heads, "heads"),
            int(kv_heads, "KV heads"),
            int(head_dim, "head_dim"),
            long(start),
        );
        if n >= FLASH_MIN_TOKENS && head_dim <= FLASH_MAX_HEAD_DIM && head_dim.is_multiple_of(4) {
            let kernel = match head_dim {
                ..=128 => &self.kernels.flash_attention_128,
                _ => &self.kernels.flash_attention_256,
            };
            let rows = n * (heads / kv_heads);
            let config = LaunchConfig {
                grid_dim: (
                    u32::try_from(rows.div_ceil(FLASH_ROWS)).expect("attention: too many tokens"),
                    u32::try_from(kv_heads).expect("attention: too many KV heads"),
                    1,
                ),
                block_dim: ((FLASH_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: flash_attention_shared_bytes(head_dim) as u32,
            };
            launch!(
                self,
                "attention (prefill)",
                kernel,
                config,
                &q.data,
                cache.keys(),
                cache.values(),
                &mut out.data,
                &n_i,
                &heads_i,
                &kv_heads_i,
                &head_dim_i,
                &start_l,
                &scale
            );
            return Ok(out);
        }
        if n > 1 {
            launch!(
                self,
                "attention",
                &self.kernels.attention,
                block_per_item(n * heads, ATTENTION_THREADS, 0),
                &q.data,
                cache.keys(),
                cache.values(),
                &mut out.data,
                &n_i,
                &heads_i,
                &kv_heads_i,
                &head_dim_i,
                &start_l,
                &position,
                &scale
            );
            return Ok(out);
        }
        // One token: the kernel reads the token's key and value from k and
        // v and writes them into the cache.
        let kernel = match head_dim {
            ..=128 => &self.kernels.attention_decode_128,
            129..=256 => &self.kernels.attention_decode_256,
            _ => &self.kernels.attention_decode_512,
        };
        let (new_k, new_v) = (
            k.data.device_ptr(&self.stream).0,
            v.data.device_ptr(&self.stream).0,
        );
        launch!(
            self,
            "attention",
            kernel,
            block_per_item(heads, ATTENTION_DECODE_THREADS, 0),
            &q.data,
            cache.keys(),
            cache.values(),
            &mut out.data,
            &n_i,
            &heads_i,
            &kv_heads_i,
            &head_dim_i,
            &start_l,
            &position,
            &scale,
            &new_k,
            &new_v
        );
        Ok(out)
    }

    fn gated_delta_net(
        &self,
        state: &mut DeltaNetState,
        qkv: &Tensor,
        b: &Tensor,
        a: &Tensor,
        params: GatedDeltaNetParams<'_, Self>,
        cfg: &LinearAttentionConfig,
    ) -> Result<Tensor> {
        let n = qkv.rows;
        let channels = cfg.conv_dim();
        let (nk, nv, dk, dv) = (
            cfg.num_key_heads,
            cfg.num_value_heads,
            cfg.key_head_dim,
            cfg.value_head_dim,
        );
        let kernel = cfg.conv_kernel;
        assert_eq!(qkv.cols, channels, "gated_delta_net: q|k|v width");
        assert!(
            b.cols == nv && a.cols == nv && b.rows == n && a.rows == n,
            "gated_delta_net: b and a must be [tokens, value_heads]"
        );
        assert!(
            nk > 0 && nv.is_multiple_of(nk) && dk <= GDN_MAX_KEY_DIM,
            "gated_delta_net: {nv} value heads over {nk} key heads of {dk} (at most {GDN_MAX_KEY_DIM})"
        );
        assert_eq!(
            params.conv.vector_len("gated_delta_net"),
            channels * kernel,
            "gated_delta_net: convolution taps"
        );
        assert!(
            params.a_log.vector_len("gated_delta_net") == nv
                && params.dt_bias.vector_len("gated_delta_net") == nv,
            "gated_delta_net: A_log and dt_bias need one value per value head"
        );
        let (n_i, channels_i, kernel_i) = (
            int(n, "tokens"),
            int(channels, "convolution channels"),
            int(kernel, "convolution kernel"),
        );
        let (nk_i, nv_i, dk_i, dv_i) = (
            int(nk, "key heads"),
            int(nv, "value heads"),
            int(dk, "key head dim"),
            int(dv, "value head dim"),
        );
        let mut mixed = self.alloc::<f32>("gated_delta_net", n * channels)?;
        launch!(
            self,
            "gdn_conv",
            &self.kernels.gdn_conv,
            grid_stride(n * channels),
            &qkv.data,
            &state.conv,
            &params.conv.data,
            &mut mixed,
            &n_i,
            &channels_i,
            &kernel_i
        );
        launch!(
            self,
            "gdn_conv_history",
            &self.kernels.gdn_conv_history,
            grid_stride(channels),
            &qkv.data,
            &mut state.conv,
            &n_i,
            &channels_i,
            &kernel_i
        );
        let q_scale = 1.0 / (dk as f32).sqrt();
        launch!(
            self,
            "gdn_qk_norm",
            &self.kernels.gdn_qk_norm,
            grid_stride(n * 2 * nk * 32),
            &mut mixed,
            &n_i,
            &channels_i,
            &nk_i,
            &dk_i,
            &q_scale
        );
        let mut out = self.tensor("gated_delta_net", n, cfg.value_dim())?;
        let shared = gdn_chunked_shared_bytes(dk, dv);
        let chunked = n >= self.gdn_chunked_min
            && dk <= GDN_CHUNK_MAX_DIM
            && dv <= GDN_CHUNK_MAX_DIM
            && dk.is_multiple_of(4)
            && dv.is_multiple_of(4)
            && self
                .tc_shared_limit
                .is_some_and(|limit| shared.iter().all(|&bytes| bytes <= limit));
        if chunked {
            let chunks = n.div_ceil(GDN_CHUNK);
            let pieces = nv * chunks;
            let mut work = self.alloc::<f32>(
                "gated_delta_net",
                pieces * (GDN_CHUNK * (dv + dk + GDN_CHUNK + 1) + dk * dv),
            )?;
            let config = |grid_dim: (u32, u32, u32), shared_mem_bytes: usize| LaunchConfig {
                grid_dim,
                block_dim: (GDN_CHUNK_THREADS, 1, 1),
                shared_mem_bytes: shared_mem_bytes as u32,
            };
            let column_tiles = dv.div_ceil(GDN_STATE_COLS) as u32;
            launch!(
                self,
                "gdn_chunk_prepare",
                &self.kernels.gdn_chunk_prepare,
                config((nv as u32, chunks as u32, 1), shared[0]),
                &mixed,
                &b.data,
                &a.data,
                &params.a_log.data,
                &params.dt_bias.data,
                &mut work,
                &n_i,
                &channels_i,
                &nk_i,
                &nv_i,
                &dk_i,
                &dv_i
            );
            // The state pass, then the outputs: the same parameters, the
            // last buffer written.
            let mut pass = |op: &str,
                            kernel: &CudaFunction,
                            grid: (u32, u32, u32),
                            shared_bytes: usize,
                            written: &mut CudaSlice<f32>|
             -> Result<()> {
                launch!(
                    self,
                    op,
                    kernel,
                    config(grid, shared_bytes),
                    &mixed,
                    &mut work,
                    written,
                    &n_i,
                    &channels_i,
                    &nk_i,
                    &nv_i,
                    &dk_i,
                    &dv_i
                );
                Ok(())
            };
            pass(
                "gdn_chunk_state",
                &self.kernels.gdn_chunk_state,
                (nv as u32, column_tiles, 1),
                shared[1],
                &mut state.recurrent,
            )?;
            pass(
                "gdn_chunk_output",
                &self.kernels.gdn_chunk_output,
                (nv as u32, chunks as u32, column_tiles),
                shared[2],
                &mut out.data,
            )?;
        } else {
            let config = LaunchConfig {
                grid_dim: (nv as u32, dv.div_ceil(GDN_WARPS) as u32, 1),
                block_dim: ((GDN_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(
                self,
                "gdn_recurrence",
                &self.kernels.gdn_recurrence,
                config,
                &mixed,
                &b.data,
                &a.data,
                &params.a_log.data,
                &params.dt_bias.data,
                &mut state.recurrent,
                &mut out.data,
                &n_i,
                &channels_i,
                &nk_i,
                &nv_i,
                &dk_i,
                &dv_i
            );
        }
        Ok(out)
    }

    fn gated_rms_norm(
        &self,
        x: &Tensor,
        gate: &Tensor,
        weight: &Weight,
        eps: f32,
    ) -> Result<Tensor> {
        self.norm(x, weight, Some(gate), eps, 0.0)
    }

    fn route(&self, logits: &Tensor, top_k: usize, normalize: bool) -> Result<Routing> {
        let (n, experts) = (logits.rows, logits.cols);
        assert!(
            top_k >= 1 && top_k <= experts && experts + 1024 <= MAX_SHARED_BYTES,
            "route: top-{top_k} of {experts} experts"
        );
        let mut ids = self.alloc::<u32>("route", n * top_k)?;
        let mut weights = self.alloc::<f32>("route", n * top_k)?;
        let (n_i, experts_i, top_k_i, normalize_i) = (
            int(n, "tokens"),
            int(experts, "experts"),
            int(top_k, "top-k"),
            i32::from(normalize),
        );
        // Up to 512 experts, one warp per token with the logits in registers;
        // more, one block per token.
        let warp_config = LaunchConfig {
            grid_dim: (n.div_ceil(ROUTE_WARPS) as u32, 1, 1),
            block_dim: ((ROUTE_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (kernel, config) = match experts {
            0..=128 => (&self.kernels.route_warp_4, warp_config),
            129..=256 => (&self.kernels.route_warp_8, warp_config),
            257..=512 => (&self.kernels.route_warp_16, warp_config),
            _ => (
                &self.kernels.route,
                block_per_item(n, THREADS, experts as u32),
            ),
        };
        launch!(
            self,
            "route",
            kernel,
            config,
            &logits.data,
            &mut ids,
            &mut weights,
            &n_i,
            &experts_i,
            &top_k_i,
            &normalize_i
        );
        Ok(Routing {
            top_k,
            rows: n,
            experts: ids,
            weights,
            host_experts: OnceLock::new(),
        })
    }

    fn selected_experts(&self, routing: &Routing) -> Result<Vec<u32>> {
        Ok(routing.experts_on_host()?.to_vec())
    }

    fn routed_experts(
        &self,
        x: &Tensor,
        routing: &Routing,
        store: &ExpertStore,
        layer: usize,
    ) -> Result<Tensor> {
        self.compute_routed_experts(x, routing, store, layer)
    }

    fn linear_many(&self, x: &Tensor, ws: &[&Weight]) -> Result<Vec<Tensor>> {
        let matrices: Vec<Matrix<'_>> = ws.iter().map(|w| w.matrix()).collect();
        let refs: Vec<&Matrix<'_>> = matrices.iter().collect();
        if x.rows != 1 || !Self::matvecs_fit(x.cols, &refs) {
            return ws.iter().map(|w| self.linear(x, w)).collect();
        }
        self.matvecs_to_tensors(&x.data, &refs, None)
    }

    fn rms_norm_linear_many(
        &self,
        x: &Tensor,
        weight: &Weight,
        norm: RmsNorm,
        ws: &[&Weight],
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let matrices: Vec<Matrix<'_>> = ws.iter().map(|w| w.matrix()).collect();
        let refs: Vec<&Matrix<'_>> = matrices.iter().collect();
        if x.rows != 1
            || weight.vector_len("rms_norm") != x.cols
            || !Self::matvecs_fit(x.cols, &refs)
        {
            let normed = self.rms_norm(x, weight, norm)?;
            let products = self.linear_many(&normed, ws)?;
            return Ok((normed, products));
        }
        let mut normed = self.tensor("rms_norm", 1, x.cols)?;
        let fused = FusedNorm {
            weight: weight.data.device_ptr(&self.stream).0,
            normed: normed.data.device_ptr_mut(&self.stream).0,
            eps: norm.eps,
            offset: if norm.unit_offset { 1.0 } else { 0.0 },
        };
        let products = self.matvecs_to_tensors(&x.data, &refs, Some(fused))?;
        Ok((normed, products))
    }

    fn linear_add(&self, residual: &mut Tensor, x: &Tensor, w: &Weight) -> Result<()> {
        let m = w.matrix();
        assert!(
            residual.rows == x.rows && residual.cols == w.layout.rows,
            "linear_add: residual [{}, {}] for output [{}, {}]",
            residual.rows,
            residual.cols,
            x.rows,
            w.layout.rows
        );
        if x.rows == 1 && Self::matvecs_fit(x.cols, &[&m]) {
            self.matvecs(&x.data, &mut [(&m, &mut residual.data)], true, None)?;
        } else {
            let y = self.linear(x, w)?;
            self.add_assign(residual, &y)?;
        };
        Ok(())
    }

    fn qk_norm_rope(
        &self,
        q: Tensor,
        k: Tensor,
        q_norm: &Weight,
        k_norm: &Weight,
        norm: RmsNorm,
        rope: Rope,
        start_pos: usize,
    ) -> Result<(Tensor, Tensor)> {
        self.qk_norm_rope_at(q, k, q_norm, k_norm, norm, rope, start_pos, None)
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_decode_many(
        &self,
        caches: &mut [&mut KvCache],
        q: Tensor,
        k: Tensor,
        v: &Tensor,
        q_norm: &Weight,
        k_norm: &Weight,
        norm: RmsNorm,
        rope: Rope,
        shape: AttentionShape,
    ) -> Result<Tensor> {
        let (heads, kv_heads, head_dim) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let n = caches.len();
        assert!(
            kv_heads > 0 && heads.is_multiple_of(kv_heads) && head_dim <= MAX_HEAD_DIM,
            "attention: {heads} heads over {kv_heads} KV heads of {head_dim} (at most {MAX_HEAD_DIM})"
        );
        assert!(
            q.rows == n
                && k.rows == n
                && v.rows == n
                && q.cols == heads * head_dim
                && k.cols == kv_heads * head_dim
                && v.cols == k.cols,
            "attention: {n} sequences' query, key and value shapes"
        );
        let op = "attention (batched decode)";
        let starts = self.kv_claim_each(caches)?;
        let positions = self.upload(op, &starts)?;
        let (q, k) = self.qk_norm_rope_at(q, k, q_norm, k_norm, norm, rope, 0, Some(&positions))?;
        let pointers = |part: fn(&KvCache) -> &CudaSlice<f32>| -> Vec<u64> {
            caches
                .iter()
                .map(|c| part(c).device_ptr(&self.stream).0)
                .collect()
        };
        let keys = self.upload(op, &pointers(KvCache::keys))?;
        let values = self.upload(op, &pointers(KvCache::values))?;
        let mut out = self.tensor(op, n, heads * head_dim)?;
        let kernel = match head_dim {
            ..=128 => &self.kernels.attention_decode_batch_128,
            129..=256 => &self.kernels.attention_decode_batch_256,
            _ => &self.kernels.attention_decode_batch_512,
        };
        let config = LaunchConfig {
            grid_dim: (
                u32::try_from(heads).expect("attention: too many heads"),
                u32::try_from(n).expect("attention: too many sequences"),
                1,
            ),
            block_dim: (ATTENTION_DECODE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let scale = 1.0 / (head_dim as f32).sqrt();
        let (heads_i, kv_heads_i, head_dim_i) = (
            int(heads, "heads"),
            int(kv_heads, "KV heads"),
            int(head_dim, "head_dim"),
        );
        launch!(
            self,
            op,
            kernel,
            config,
            &q.data,
            &keys,
            &values,
            &mut out.data,
            &heads_i,
            &kv_heads_i,
            &head_dim_i,
            &positions,
            &scale,
            &k.data,
            &v.data
        );
        Ok(out)
    }

    fn routed_experts_add(
        &self,
        out: &mut Tensor,
        x: &Tensor,
        routing: &Routing,
        store: &ExpertStore,
        layer: usize,
    ) -> Result<()> {
        self.add_routed_experts(out, x, routing, store, layer)
    }

    fn step_key(&self, kv: &mut [&mut KvCache], linear: &[&DeltaNetState]) -> Result<Option<u64>> {
        self.state_key(kv, linear)
    }

    fn replay_step(&self, key: u64, token: u32, position: usize) -> Result<Option<Tensor>> {
        self.replay(key, token, position)
    }

    fn record_step(
        &self,
        key: u64,
        token: u32,
        position: usize,
        logits_len: usize,
        step: &mut dyn FnMut() -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.record(key, token, position, logits_len, step)
    }

    fn experts_resident(&self, store: &ExpertStore, layer: usize) -> bool {
        self.layer_resident(store, layer)
    }

    /// Large chunks keep the tensor cores busy: the routed experts of a
    /// chunk run in three launches however many tokens it has.
    fn default_prefill_chunk(&self) -> usize {
        512
    }

    fn prepare_experts(&self, store: &ExpertStore, progress: &dyn Progress) -> Result<()> {
        self.prepare_device_experts(store, progress).map(|_| ())
    }

    fn prefetch_experts(&self, store: &ExpertStore, layer: usize, experts: &[u32]) {
        self.note_prefetch(store, layer, experts);
    }

    fn device_expert_stats(&self) -> Option<ExpertCacheStats> {
        Some(self.streaming_stats())
    }

    fn state_memory(&self) -> Option<u64> {
        self.ctx.mem_get_info().ok().map(|(free, _)| free as u64)
    }

    fn host_to_device_bandwidth(&self) -> Option<f64> {
        self.pinned_upload_bandwidth().ok()
    }
}
