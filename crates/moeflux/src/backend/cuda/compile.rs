//! The kernels: CUDA C sources compiled by NVRTC for the device's exact
//! architecture on first use and cached on disk, so later runs load the
//! binary in milliseconds.
//!
//! The options: the architecture, then the launch geometry (geometry.rs)
//! as `-DNAME=VALUE`, which the kernels do not define themselves, then the
//! tuning defines of `MOEFLUX_CUDA_DEFINES` (see [`tuning_defines`]).
//!
//! The cache key hashes the sources, the compile options, the compute
//! capability and the NVRTC version: any change compiles afresh. Files go
//! to `$MOEFLUX_CACHE/kernels` (else `$XDG_CACHE_HOME/moeflux/kernels`,
//! else `~/.cache/moeflux/kernels`); a cache that cannot be written only
//! costs the compile next time.

use std::ffi::{CStr, CString, c_char};
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{Ptx, result as nvrtc, sys as nvrtc_sys};

use super::geometry;
use crate::backend::KvType;

/// The sources, compiled as one program in this order (common.cuh first:
/// NVRTC is given no include paths).
const SOURCES: [(&str, &str); 15] = [
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("linear.cu", include_str!("kernels/linear.cu")),
    ("norm.cu", include_str!("kernels/norm.cu")),
    ("elementwise.cu", include_str!("kernels/elementwise.cu")),
    ("kv_cache.cu", include_str!("kernels/kv_cache.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("mla.cu", include_str!("kernels/mla.cu")),
    (
        "gated_delta_net.cu",
        include_str!("kernels/gated_delta_net.cu"),
    ),
    ("gdn_chunked.cu", include_str!("kernels/gdn_chunked.cu")),
    ("gemm.cu", include_str!("kernels/gemm.cu")),
    ("moe.cu", include_str!("kernels/moe.cu")),
    ("matvec_tc.cu", include_str!("kernels/matvec_tc.cu")),
    ("linear_few.cu", include_str!("kernels/linear_few.cu")),
    ("moe_prefill.cu", include_str!("kernels/moe_prefill.cu")),
    ("moe_few.cu", include_str!("kernels/moe_few.cu")),
];

/// Declares the kernels the backend launches; each is looked up by its
/// `extern "C"` name once, when the module loads. `Kernels::kv` holds the
/// kernels that read or write a KV cache, one set per [`KvType`]
/// ([`KvKernels`]).
macro_rules! kernels {
    ($($name:ident),* $(,)?) => {
        pub(super) struct Kernels {
            $(pub $name: CudaFunction,)*
            kv: [KvKernels; 3],
        }

        /// The kernels' names, for the test that they are all defined.
        #[cfg(test)]
        const NAMES: &[&str] = &[$(stringify!($name)),*];

        impl Kernels {
            fn load(module: &Arc<CudaModule>) -> Result<Kernels, String> {
                let [f32, bf16, q8] = KvType::ALL.map(|kv| KvKernels::load(module, kv));
                Ok(Kernels {
                    $($name: function(module, stringify!($name))?,)*
                    kv: [f32?, bf16?, q8?],
                })
            }

            /// The kernels over a KV cache of type `kv`.
            pub fn kv(&self, kv: KvType) -> &KvKernels {
                let index = KvType::ALL.iter().position(|&t| t == kv).expect("every type");
                &self.kv[index]
            }
        }
    };
}

/// Declares the kernels compiled once per KV cache encoding, each named
/// with the type's name after it (`attention_decode_128_bf16`).
macro_rules! kv_kernels {
    ($($name:ident),* $(,)?) => {
        pub(super) struct KvKernels {
            $(pub $name: CudaFunction,)*
        }

        /// Their names without the type.
        #[cfg(test)]
        const KV_NAMES: &[&str] = &[$(stringify!($name)),*];

        impl KvKernels {
            fn load(module: &Arc<CudaModule>, kv: KvType) -> Result<KvKernels, String> {
                Ok(KvKernels {
                    $($name: function(module, &format!("{}_{kv}", stringify!($name)))?,)*
                })
            }
        }
    };
}

fn function(module: &Arc<CudaModule>, name: &str) -> Result<CudaFunction, String> {
    module
        .load_function(name)
        .map_err(|e| format!("kernel `{name}` missing from the module: {e}"))
}

kernels!(
    embed,
    linear_f32_t1,
    linear_f32_t8,
    linear_bf16_t1,
    linear_bf16_t8,
    linear_q8_t1,
    linear_q8_t8,
    linear_q4_t1,
    linear_q4_t8,
    linear_tc_q4,
    linear_tc_q4_i8,
    linear_tc_q8,
    linear_tc_bf16,
    sum_split_parts,
    linear_vector_f32,
    linear_vector_bf16,
    linear_vector_q8,
    linear_vector_q4,
    linear_vector_f32_rows,
    linear_vector_bf16_rows,
    linear_vector_q8_rows,
    linear_vector_q4_rows,
    linear_vector_f32_normed,
    linear_vector_bf16_normed,
    linear_vector_q8_normed,
    linear_vector_q4_normed,
    linear_vector_f32_rows_normed,
    linear_vector_bf16_rows_normed,
    linear_vector_q8_rows_normed,
    linear_vector_q4_rows_normed,
    rms_norm,
    gated_rms_norm,
    qk_norm_rope,
    qk_norm_rope_warps,
    add_assign,
    add_bias,
    silu_mul,
    mul_sigmoid,
    mul_sigmoid_rows,
    copy_cols,
    fill_words,
    rope,
    mla_absorb_query,
    mla_attention,
    mla_value_out,
    gdn_conv,
    gdn_conv_history,
    gdn_qk_norm,
    gdn_recurrence,
    gdn_chunk_prepare,
    gdn_chunk_state,
    gdn_chunk_output,
    route,
    route_warp_4,
    route_warp_8,
    route_warp_16,
    route_general,
    gather_rows,
    scatter_add_rows,
    moe_own_slots,
    expert_act_rows,
    expert_down_bias_rows,
    tile_q4_codes,
    moe_gate_up_f32,
    moe_gate_up_bf16,
    moe_gate_up_q8,
    moe_gate_up_q4,
    moe_gate_up_q3,
    moe_gate_up_q2,
    moe_gate_up_mxfp4,
    moe_down_f32,
    moe_down_bf16,
    moe_down_q8,
    moe_down_q4,
    moe_down_q3,
    moe_down_q2,
    moe_down_mxfp4,
    moe_down_tc_q4,
    linear_vector_tc_q4,
    linear_few_q4_1,
    linear_few_q4_2,
    linear_few_q4_4,
    moe_prefill_gate_up_q4,
    moe_prefill_gate_up_q8,
    moe_prefill_gate_up_bf16,
    moe_prefill_gate_up_q3,
    moe_prefill_gate_up_q2,
    moe_prefill_gate_up_mxfp4,
    moe_prefill_down_q4,
    moe_prefill_down_q8,
    moe_prefill_down_bf16,
    moe_prefill_down_q3,
    moe_prefill_down_q2,
    moe_prefill_down_mxfp4,
    moe_prefill_gate_up_q4_i8,
    moe_prefill_down_q4_i8,
    moe_prefill_combine,
    split_activations,
    quantize_activations_q4,
    moe_group_slots,
    moe_few_gate_up_q4,
    moe_few_down_q4,
    attention_decode_grouped_tc_bf16,
    attention_decode_batch_grouped_tc_bf16,
    attention_decode_grouped_tc_f32,
    attention_decode_batch_grouped_tc_f32,
);

kv_kernels!(
    attention,
    attention_decode_128,
    attention_decode_256,
    attention_decode_512,
    attention_decode_batch_128,
    attention_decode_batch_256,
    attention_decode_batch_512,
    attention_decode_grouped_128_g8,
    attention_decode_grouped_128_g16,
    attention_decode_grouped_256_g8,
    attention_decode_batch_grouped_128_g8,
    attention_decode_batch_grouped_128_g16,
    attention_decode_batch_grouped_256_g8,
    flash_attention_128,
    flash_attention_256,
    flash_attention_128_direct,
    flash_attention_256_direct,
    kv_store,
);

/// The program text: every file after a `#line` directive, so compiler
/// messages name the file and line they come from.
fn program() -> String {
    SOURCES
        .iter()
        .map(|(name, text)| format!("#line 1 \"{name}\"\n{text}\n"))
        .collect()
}

/// Loads the kernels for the context's device, compiling them if the disk
/// cache has no binary for this device, source and compiler.
pub(super) fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, String> {
    // SAFETY: only probes whether the library can be opened.
    if !unsafe { nvrtc_sys::is_culib_present() } {
        return Err(
            "the NVRTC library (libnvrtc.so) was not found: install CUDA's runtime \
                    compiler or add its directory (e.g. /usr/local/cuda/lib64) to LD_LIBRARY_PATH"
                .into(),
        );
    }
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| format!("reading the compute capability: {e}"))?;
    let arch = format!("sm_{major}{minor}");
    let mut options = vec![format!("--gpu-architecture={arch}")];
    options.extend(geometry_defines());
    options.extend(tuning_defines()?);
    let (nvrtc_major, nvrtc_minor) = nvrtc_version()?;
    let source = program();
    let mut key = xxhash_rust::xxh3::Xxh3::new();
    key.update(source.as_bytes());
    key.update(options.join(" ").as_bytes());
    key.update(format!("{arch} nvrtc {nvrtc_major}.{nvrtc_minor}").as_bytes());
    let path = cache_dir().join(format!("moeflux-{arch}-{:016x}.cubin", key.digest()));

    let cached = std::fs::read(&path)
        .ok()
        .and_then(|cubin| ctx.load_module(Ptx::from_binary(cubin)).ok());
    let module = match cached {
        Some(module) => module,
        None => {
            let cubin = compile(&source, &options).map_err(|e| {
                format!(
                    "compiling the kernels for {arch} with NVRTC {nvrtc_major}.{nvrtc_minor}: {e}"
                )
            })?;
            store(&path, &cubin);
            ctx.load_module(Ptx::from_binary(cubin))
                .map_err(|e| format!("loading the compiled kernels: {e}"))?
        }
    };
    Kernels::load(&module)
}

/// The launch geometry the host launches with, as `-D` options: the
/// kernels take every one of these constants from here.
fn geometry_defines() -> Vec<String> {
    geometry::DEFINES
        .iter()
        .map(|(name, value)| format!("-D{name}={value}"))
        .collect()
}

/// `-D` options from `MOEFLUX_CUDA_DEFINES` (`NAME=VALUE ...`), for tuning
/// experiments on constants the kernels declare overridable (`#ifndef`:
/// unrolling, blocks per SM); they are part of the cache key like every
/// option. The launch geometry wins: a define naming one of its constants
/// is refused, since the host would still launch with its own value
/// (change the constant in geometry.rs instead).
fn tuning_defines() -> Result<Vec<String>, String> {
    tuning_options(&crate::tuning::cuda_defines().join(" "))
}

fn tuning_options(defines: &str) -> Result<Vec<String>, String> {
    defines
        .split_whitespace()
        .map(|define| {
            let name = define.split('=').next().unwrap_or(define);
            if geometry::DEFINES
                .iter()
                .any(|(geometry, _)| *geometry == name)
            {
                return Err(format!(
                    "MOEFLUX_CUDA_DEFINES sets {name}, which is launch geometry the host \
                     launches with: change it in backend/cuda/geometry.rs instead"
                ));
            }
            Ok(format!("-D{define}"))
        })
        .collect()
}

fn nvrtc_version() -> Result<(i32, i32), String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("querying the NVRTC version: {e}"))?;
    Ok((major, minor))
}

/// Compiles `source` to a CUBIN for the architecture named in `options`.
fn compile(source: &str, options: &[String]) -> Result<Vec<u8>, String> {
    let src = CString::new(source).expect("kernel sources contain no NUL");
    let name = CString::new("moeflux.cu").expect("no NUL");
    let prog = nvrtc::create_program(&src, Some(&name)).map_err(|e| e.to_string())?;
    // SAFETY: `prog` is a live program until destroyed below; the buffers
    // passed to NVRTC are sized by the sizes it reports.
    let result = unsafe {
        match nvrtc::compile_program(prog, options) {
            Err(e) => {
                let log = nvrtc::get_program_log(prog)
                    .map(|log| CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned())
                    .unwrap_or_default();
                Err(format!("{e}\n{log}"))
            }
            Ok(()) => {
                let mut size = 0usize;
                nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| format!("reading the binary size: {e}"))
                    .and_then(|()| {
                        let mut cubin = vec![0u8; size];
                        nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char)
                            .result()
                            .map_err(|e| format!("reading the binary: {e}"))
                            .map(|()| cubin)
                    })
            }
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

/// Where compiled kernels are kept (see the module documentation).
fn cache_dir() -> PathBuf {
    crate::util::cache_dir().join("kernels")
}

/// Writes through a temporary name, so a concurrent reader never loads a
/// partial binary. Failures are ignored: the cache only saves time.
fn store(path: &std::path::Path, cubin: &[u8]) {
    let Some(dir) = path.parent() else { return };
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&tmp, cubin))
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel the backend looks up is defined by the sources (on a
    /// machine without a GPU nothing else resolves the names).
    #[test]
    fn every_declared_kernel_is_defined_in_the_sources() {
        let source = program();
        let typed = KV_NAMES
            .iter()
            .flat_map(|name| KvType::ALL.map(|kv| format!("{name}_{kv}")));
        for name in NAMES.iter().map(|n| n.to_string()).chain(typed) {
            let defined = source.contains(&format!(" {name}("))
                || source.contains(&format!("ATTENTION_KERNEL({name},"))
                || source.contains(&format!("KV_STORE_KERNEL({name},"))
                || source.contains(&format!("LINEAR_KERNEL({name},"))
                || source.contains(&format!("LINEAR_VECTOR_KERNEL({name},"))
                || source.contains(&format!("FLASH_ATTENTION_KERNEL({name},"))
                || source.contains(&format!("ATTENTION_DECODE_KERNEL({name},"))
                || source.contains(&format!("ATTENTION_DECODE_BATCH_KERNEL({name},"))
                || source.contains(&format!("ATTENTION_DECODE_GROUPED_KERNEL({name},"))
                || source.contains(&format!("ATTENTION_DECODE_BATCH_GROUPED_KERNEL({name},"))
                || source.contains(&format!("ATTENTION_DECODE_GROUPED({name},"))
                || source.contains(&format!("ATTENTION_DECODE_BATCH({name},"))
                || source.contains(&format!("ROUTE_WARP_KERNEL({name},"))
                || source.contains(&format!("LINEAR_FEW_Q4({name},"))
                || source.contains(&format!("LINEAR_TC({name},"))
                || ["_rows", "_normed", "_rows_normed"].iter().any(|suffix| {
                    name.strip_suffix(suffix).is_some_and(|base| {
                        source.contains(&format!("LINEAR_VECTOR_KERNEL({base},"))
                    })
                })
                || ["moe_gate_up_", "moe_down_"].iter().any(|prefix| {
                    name.strip_prefix(prefix).is_some_and(|suffix| {
                        source.contains(&format!("MOE_DECODE_KERNELS({suffix},"))
                    })
                });
            assert!(defined, "kernel {name} is not defined in kernels/");
        }
    }

    /// The kernels take their launch geometry from geometry.rs only: each
    /// file's `#if !defined(...)` guard names constants of geometry.rs, no
    /// file defines one itself, and every constant is used by some kernel.
    #[test]
    fn kernels_take_the_launch_geometry_from_the_host() {
        let is_geometry = |name: &str| geometry::DEFINES.iter().any(|(n, _)| *n == name);
        let mut guarded = Vec::new();
        for (file, text) in SOURCES {
            let text = text.replace("\\\n", " ");
            for line in text.lines().map(str::trim) {
                if let Some(name) = line.strip_prefix("#define ") {
                    let name = name.split([' ', '(']).next().unwrap_or_default();
                    assert!(
                        !is_geometry(name),
                        "{file} defines {name}, which geometry.rs defines"
                    );
                }
                if line.starts_with("#if !defined(") {
                    for name in line.split("defined(").skip(1) {
                        let name = name.split(')').next().unwrap_or_default();
                        assert!(
                            is_geometry(name),
                            "{file} expects {name}, not in geometry.rs"
                        );
                        guarded.push(name.to_string());
                    }
                }
            }
        }
        for (name, _) in geometry::DEFINES {
            assert!(
                guarded.iter().any(|g| g == name),
                "geometry.rs's {name} is expected by no kernel file's guard"
            );
        }
    }

    /// tools/nvrtc_check.py reads geometry.rs line by line: each
    /// `NAME: type = digits;` line is a define. That reading gives exactly
    /// the defines compile.rs passes.
    #[test]
    fn the_nvrtc_check_reads_the_same_geometry() {
        let parsed: Vec<(String, u64)> = include_str!("geometry.rs")
            .lines()
            .filter_map(|line| {
                let (name, rest) = line.trim().split_once(':')?;
                let (ty, value) = rest.split_once('=')?;
                let value = value.trim().strip_suffix(';')?.replace('_', "");
                let name_ok = name.starts_with(|c: char| c.is_ascii_uppercase())
                    && name
                        .chars()
                        .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
                let ty_ok = !ty.trim().is_empty()
                    && ty
                        .trim()
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
                (name_ok && ty_ok && value.chars().all(|c| c.is_ascii_digit()))
                    .then(|| (name.to_string(), value.parse().expect("digits")))
            })
            .collect();
        let defines: Vec<(String, u64)> = geometry::DEFINES
            .iter()
            .map(|(name, value)| (name.to_string(), *value))
            .collect();
        assert_eq!(parsed, defines);
    }

    /// `MOEFLUX_CUDA_DEFINES` tunes what the kernels declare overridable
    /// but may not change the launch geometry.
    #[test]
    fn tuning_defines_cannot_override_the_geometry() {
        assert_eq!(
            tuning_options(" WORD_UNROLL=8  DOWN_MIN_BLOCKS=2 ").unwrap(),
            ["-DWORD_UNROLL=8", "-DDOWN_MIN_BLOCKS=2"]
        );
        let refused = tuning_options("WORD_UNROLL=8 VEC_WARPS=4").unwrap_err();
        assert!(refused.contains("VEC_WARPS"), "{refused}");
        assert!(geometry_defines().contains(&"-DVEC_WARPS=8".to_string()));
    }

    /// Decode recordings link kernels by programmatic edges (graph.rs),
    /// which are only safe if every kernel waits for its inputs before
    /// reading them: each kernel body calls `await_inputs()` before any
    /// other statement but shared-memory declarations and L2 prefetches of
    /// weights.
    #[test]
    fn every_kernel_awaits_its_inputs_first() {
        let source = program().replace("\\\n", "\n");
        let mut kernels = 0;
        for (at, _) in source.match_indices("__global__") {
            let body = &source[at..];
            let open = body.find('{').expect("a kernel has a body");
            let signature = body[..open]
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            let statements = body[open + 1..]
                .split(';')
                .map(str::trim)
                .skip_while(|s| s.starts_with("prefetch_") || s.starts_with("extern __shared__"));
            let first = statements.take(1).collect::<String>();
            assert_eq!(
                first, "await_inputs()",
                "kernel `{signature}` does not begin with await_inputs()"
            );
            kernels += 1;
        }
        assert!(kernels >= NAMES.len() / 2, "found only {kernels} kernels");
    }
}
