//! Every environment variable moeflux reads, in one place.
//!
//! | variable | what it does | default |
//! | --- | --- | --- |
//! | `MOEFLUX_CACHE` | where moeflux keeps what it can rebuild: the converted bundled model, compiled GPU kernels | `$XDG_CACHE_HOME/moeflux`, else `~/.cache/moeflux` |
//! | `XDG_STATE_HOME` | where `moeflux chat` keeps its input history (`moeflux/chat_history`) | `~/.local/state` |
//! | `MOEFLUX_CPU_KERNELS` | the CPU kernel set: `scalar`, `avx2`, `avx512` or `neon` (a slower one than the machine's best, to compare) | the fastest available |
//! | `MOEFLUX_CPU_SPIN_US` | microseconds the CPU backend's idle workers spin, waiting for the next parallel region, before they park; also how long hybrid decode's CPU worker and the decode thread spin for a job and its result | 2000 |
//! | `MOEFLUX_CPU_TASK_MACS` | multiply-adds below which the CPU backend does not split a product's rows into more tasks | 131072 |
//! | `MOEFLUX_CPU_PROFILE` | `1`: wall time, threads' busy time and the serial time before each of the CPU backend's parallel regions, per place in the source that starts it, printed by `moeflux bench` | off |
//! | `MOEFLUX_CPU_POOL` | `0`: the CPU backend's parallel regions run on rayon's threads instead of its own spinning workers | on |
//! | `MOEFLUX_CUDA_GRAPHS` | `0`: decode steps are launched op by op instead of recorded as CUDA graphs and replayed | on |
//! | `MOEFLUX_CUDA_BATCHED_STEPS` | `0`: calls of several tokens (prompt chunks, several sequences decoding, a check of drafted tokens) group their routed experts on the host and take the prefill kernels, and only one sequence's one-token decode steps are recorded (to compare) | on |
//! | `MOEFLUX_CUDA_PDL` | `0`: no programmatic dependent launch (kernels wait for the one before to finish) | on from compute capability 9.0 |
//! | `MOEFLUX_CUDA_TILED_EXPERTS` | `0`: q4 expert codes stay row by row in VRAM; `1`: they are tiled for the kernels of several tokens (from compute capability 8.0; to compare) | tiled where steps run several tokens together (`serve`, `bench --sequences`, `--draft`) and in the library, row by row for the other commands |
//! | `MOEFLUX_CUDA_PROFILE` | `1`: device time per operation, printed when the backend is dropped (graphs off) | off |
//! | `MOEFLUX_CUDA_DEFINES` | `NAME=VALUE ...` passed to NVRTC as `-D` options: the kernels' tuning constants (not their launch geometry, which the host must share: refused) | none |
//! | `MOEFLUX_CUDA_WHOLE_ROWS_MIN` | rows (over one launch) from which a one-token product gives each warp whole rows | 1024 |
//! | `MOEFLUX_CUDA_FEW_LINEAR_MAX` | most tokens (from 2) whose q4 products take the few-token tensor-core kernels (`0`: none, they take the 64-token tiles or the CUDA-core kernels) | 32 |
//! | `MOEFLUX_CUDA_GDN_CHUNKED_MIN` | tokens from which Gated DeltaNet runs in chunks on the tensor cores | 64 |
//! | `MOEFLUX_CUDA_GROUPED_DECODE_MIN` | positions from which one sequence's decode step takes a block per KV head's group of query heads for its attention (several sequences' steps take it at every length) | 2048; on the tensor cores (`MOEFLUX_CUDA_GROUPED_DECODE_TC`) 0 for bf16 caches, 256 for f32 |
//! | `MOEFLUX_CUDA_GROUPED_DECODE_TC` | `0`: the grouped decode attention of bf16 and f32 KV caches multiplies on the CUDA cores instead of the tensor cores (to compare) | on from compute capability 8.0 |
//! | `MOEFLUX_CUDA_CPU_FIRST` | the percentage of layers (5 to 95) in which hybrid decode's `--cpu-experts auto` moves the CPU's fraction of the missing experts until the CPU's products finish before the GPU's share | 75 |
//! | `MOEFLUX_CUDA_CPU_SHARE` | a fixed percentage of the experts missing from VRAM that hybrid decode's `--cpu-experts auto` gives the CPU (to compare) | moved by each layer's finishing order |
//! | `MOEFLUX_CUDA_DECODE_SPLITS` | most blocks a head's positions are split over in a decode step (`1`: one block per head), at most 32 (`DECODE_ATTN_MAX_SPLITS`) | 32 |
//!
//! The `MOEFLUX_CPU_*` variables and the `MOEFLUX_CUDA_*` ones other than
//! `GRAPHS` are for measuring the kernels (docs/PERFORMANCE.md); a user's settings are the command's
//! options.

use std::ffi::OsString;
use std::path::PathBuf;

/// A variable's value, if set and not empty.
fn var(name: &str) -> Option<OsString> {
    std::env::var_os(name).filter(|v| !v.is_empty())
}

/// Whether `name` is not set to `0` (a switch that is on by default).
fn switched_on(name: &str) -> bool {
    var(name).is_none_or(|v| v != "0")
}

/// A number from `name`, if set to one.
fn optional_number<T: std::str::FromStr>(name: &str) -> Option<T> {
    var(name).and_then(|v| v.to_str().and_then(|v| v.parse().ok()))
}

/// A number from `name`, or `default` when unset or not a number.
fn number(name: &str, default: usize) -> usize {
    optional_number(name).unwrap_or(default)
}

/// `MOEFLUX_CACHE`, else `$XDG_CACHE_HOME/moeflux`, else
/// `~/.cache/moeflux`, else a folder in the temporary directory.
pub fn cache_dir() -> PathBuf {
    var("MOEFLUX_CACHE")
        .map(PathBuf::from)
        .or_else(|| var("XDG_CACHE_HOME").map(|p| PathBuf::from(p).join("moeflux")))
        .or_else(|| var("HOME").map(|p| PathBuf::from(p).join(".cache/moeflux")))
        .unwrap_or_else(|| std::env::temp_dir().join("moeflux-cache"))
}

/// Where programs keep state between runs: `$XDG_STATE_HOME`, else
/// `~/.local/state`.
pub fn state_dir() -> Option<PathBuf> {
    var("XDG_STATE_HOME")
        .map(PathBuf::from)
        .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".local/state")))
}

/// `MOEFLUX_CPU_KERNELS`: the name of the CPU kernel set asked for.
pub fn cpu_kernels() -> Option<String> {
    var("MOEFLUX_CPU_KERNELS").and_then(|v| v.into_string().ok())
}

/// `MOEFLUX_CPU_SPIN_US`: how long an idle CPU worker spins before it
/// parks.
pub fn cpu_spin() -> std::time::Duration {
    std::time::Duration::from_micros(number("MOEFLUX_CPU_SPIN_US", 2000) as u64)
}

/// `MOEFLUX_CPU_TASK_MACS`: the fewest multiply-adds of a CPU product's
/// task, unless the whole product has fewer.
pub fn cpu_task_macs(default: usize) -> usize {
    number("MOEFLUX_CPU_TASK_MACS", default).max(1)
}

/// `MOEFLUX_CPU_POOL`: whether the CPU backend's parallel regions run on
/// its own workers (else on rayon's).
pub fn cpu_pool() -> bool {
    switched_on("MOEFLUX_CPU_POOL")
}

/// `MOEFLUX_CPU_PROFILE`: whether to time the CPU backend's parallel
/// regions.
pub fn cpu_profile() -> bool {
    var("MOEFLUX_CPU_PROFILE").is_some_and(|v| v != "0")
}

/// `MOEFLUX_CUDA_GRAPHS`: whether decode steps may be recorded and
/// replayed.
pub fn cuda_graphs() -> bool {
    switched_on("MOEFLUX_CUDA_GRAPHS")
}

/// `MOEFLUX_CUDA_BATCHED_STEPS`: whether calls of several tokens (prompt
/// chunks included) group their routed experts on the device, and steps
/// of several tokens may be recorded.
pub fn cuda_batched_steps() -> bool {
    switched_on("MOEFLUX_CUDA_BATCHED_STEPS")
}

/// `MOEFLUX_CUDA_PDL`: whether kernels may launch while the one before
/// finishes.
pub fn cuda_programmatic_launch() -> bool {
    switched_on("MOEFLUX_CUDA_PDL")
}

/// `MOEFLUX_CUDA_TILED_EXPERTS`, if set: whether q4 expert codes are tiled
/// in VRAM (backend/cuda/device_expert.rs; not `0`: yes).
pub fn cuda_tiled_experts() -> Option<bool> {
    var("MOEFLUX_CUDA_TILED_EXPERTS").map(|v| v != "0")
}

/// `MOEFLUX_CUDA_PROFILE`: whether to time every operation.
pub fn cuda_profile() -> bool {
    var("MOEFLUX_CUDA_PROFILE").is_some_and(|v| v != "0")
}

/// `MOEFLUX_CUDA_DEFINES`: the `NAME=VALUE` pairs given.
pub fn cuda_defines() -> Vec<String> {
    var("MOEFLUX_CUDA_DEFINES")
        .and_then(|v| v.into_string().ok())
        .map(|v| v.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// `MOEFLUX_CUDA_WHOLE_ROWS_MIN`, else `default`.
pub fn cuda_whole_rows_min(default: usize) -> usize {
    number("MOEFLUX_CUDA_WHOLE_ROWS_MIN", default)
}

/// `MOEFLUX_CUDA_FEW_LINEAR_MAX`, else `default`.
pub fn cuda_few_linear_max(default: usize) -> usize {
    number("MOEFLUX_CUDA_FEW_LINEAR_MAX", default)
}

/// `MOEFLUX_CUDA_GDN_CHUNKED_MIN`, else `default`.
pub fn cuda_gdn_chunked_min(default: usize) -> usize {
    number("MOEFLUX_CUDA_GDN_CHUNKED_MIN", default)
}

/// `MOEFLUX_CUDA_DECODE_SPLITS`, else `default`; at least 1 and at most
/// `default` (what the decode kernels' buffers are sized for).
pub fn cuda_decode_splits(default: usize) -> usize {
    number("MOEFLUX_CUDA_DECODE_SPLITS", default).clamp(1, default)
}

/// Whether `MOEFLUX_CUDA_GROUPED_DECODE_TC` is not `0`.
pub fn cuda_grouped_decode_tc() -> bool {
    switched_on("MOEFLUX_CUDA_GROUPED_DECODE_TC")
}

/// `MOEFLUX_CUDA_GROUPED_DECODE_MIN`, if set to a number.
pub fn cuda_grouped_decode_min() -> Option<usize> {
    optional_number("MOEFLUX_CUDA_GROUPED_DECODE_MIN")
}

/// `MOEFLUX_CUDA_CPU_FIRST`: the percentage of layers in which hybrid
/// decode's CPU share should finish first, if set to a number.
pub fn cuda_cpu_first() -> Option<f64> {
    optional_number("MOEFLUX_CUDA_CPU_FIRST")
}

/// `MOEFLUX_CUDA_CPU_SHARE`: a fixed percentage of the experts missing
/// from VRAM that hybrid decode's `auto` gives the CPU, if set to a number.
pub fn cuda_cpu_share() -> Option<f64> {
    optional_number("MOEFLUX_CUDA_CPU_SHARE")
}
