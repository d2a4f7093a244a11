//! The CUDA backend against the CPU backend (the reference for every
//! operation) and against transformers.
//!
//! Tolerances:
//! - whole models, CUDA against CPU on the same converted weights: relative
//!   L2 error of the logits ≤ 1e-3 at every position, for bf16, q8 and q4
//!   alike: both backends dequantize the same stored codes to the same f32
//!   weights and accumulate in f32, so quantization cancels out and only
//!   the summation order differs (the error the bf16 bound was set for);
//! - whole models against transformers: the CPU suite's bounds (bf16 1e-3;
//!   q4 1e-3 against transformers on the same quantized weights; q8 3e-2
//!   against the unquantized model, the quantization error itself);
//! - single operations: 1e-5 of the output's scale (f32 rounding in another
//!   order), exact where no arithmetic reorders (embedding rows, copies,
//!   expert selection).
//!
//! Without a CUDA device every test prints "skipped: no CUDA device" and
//! passes; `MOEFLUX_REQUIRE_CUDA=1` turns that into a failure (the GPU suite
//! sets it). A device that is there but fails to initialise always fails.
//! Run with `--nocapture` to see the measured errors.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::*;
use moeflux::backend::cpu::{
    CpuBackend, DeltaNetState as CpuDeltaNet, KvCache as CpuKv, Tensor as CpuTensor,
};
use moeflux::backend::cuda::{
    CudaBackend, CudaOptions, DeltaNetState as CudaDeltaNet, KvCache as CudaKv,
    Tensor as CudaTensor, device_count,
};
use moeflux::backend::{AttentionShape, Backend, GatedDeltaNetParams, RmsNorm, Rope};
use moeflux::config::{LinearAttentionConfig, RouterSpec};
use moeflux::experts::{CachePolicy, ExpertStore, IoMode, StoreOptions};
use moeflux::format::{ModelDir, OpenOptions};
use moeflux::quant::{DType, MatrixLayout, RowEncoder};
use moeflux::{LogitsWanted, Model, ModelOptions};

/// The CUDA backend on device 0, or `None` (after saying so) when this
/// machine has no CUDA device.
fn cuda_with(options: CudaOptions) -> Option<CudaBackend> {
    match device_count() {
        Ok(0) => {
            assert!(
                std::env::var_os("MOEFLUX_REQUIRE_CUDA").is_none(),
                "no CUDA device found, but MOEFLUX_REQUIRE_CUDA is set"
            );
            println!("skipped: no CUDA device");
            None
        }
        Ok(_) => Some(CudaBackend::with_options(0, options).unwrap_or_else(|e| {
            panic!("a CUDA device is present but the backend failed to initialise: {e}")
        })),
        Err(e) => panic!("the CUDA driver is installed but failing: {e}"),
    }
}

fn cuda() -> Option<CudaBackend> {
    cuda_with(CudaOptions::default())
}

fn open_cuda(dir: &Path, options: ModelOptions, backend: CudaBackend) -> Arc<Model<CudaBackend>> {
    Arc::new(
        Model::open_with(backend, dir, &options)
            .unwrap_or_else(|e| panic!("opening {} on CUDA: {e}", dir.display())),
    )
}

fn chunked(prefill_chunk: usize) -> ModelOptions {
    ModelOptions {
        prefill_chunk: Some(prefill_chunk),
        ..ModelOptions::default()
    }
}

fn max_error(got: &[f32], want: &[f32], vocab: usize) -> f64 {
    row_errors(got, want, vocab).into_iter().fold(0.0, f64::max)
}

/// Every fixture, converted to `quant`, on CUDA against the CPU and against
/// the transformers reference `logits_{length}{suffix}`.
fn check_fixtures(quant: DType, suffix: &str, reference_tolerance: f64) {
    if cuda().is_none() {
        return;
    }
    for name in FIXTURES {
        let converted = convert_fixture(name, quant);
        let reference = Reference::load(name);
        for chunk in [moeflux::model::DEFAULT_PREFILL_CHUNK, 7] {
            let cpu = open(&converted.dir, chunked(chunk));
            let gpu = open_cuda(&converted.dir, chunked(chunk), cuda().expect("a device"));
            for length in ["short", "long"] {
                let tokens = reference.tokens(&format!("tokens_{length}"));
                let (_, vocab, want) = reference.logits(&format!("logits_{length}{suffix}"));
                let got = gpu.session().forward(&tokens, LogitsWanted::All).unwrap();
                let on_cpu = cpu.session().forward(&tokens, LogitsWanted::All).unwrap();
                assert_eq!((got.rows, got.vocab), (tokens.len(), vocab));
                assert!(
                    got.data.iter().all(|v| v.is_finite()),
                    "{name}: non-finite logits"
                );
                let vs_cpu = max_error(&got.data, &on_cpu.data, vocab);
                let vs_reference = max_error(&got.data, &want, vocab);
                println!(
                    "{name:<22} {:<5} {length:<5} ({} tokens, chunk {chunk:>2}): cuda vs cpu {vs_cpu:.2e}, vs ref{suffix} {vs_reference:.2e}, top-1 {:.0}%",
                    quant.name(),
                    tokens.len(),
                    100.0 * top1_agreement(&got.data, &want, vocab)
                );
                assert!(
                    vs_cpu <= 1e-3,
                    "{name} {}: CUDA differs from the CPU by {vs_cpu:.3e} ({length}, chunk {chunk})",
                    quant.name()
                );
                assert!(
                    vs_reference <= reference_tolerance,
                    "{name} {}: CUDA differs from transformers by {vs_reference:.3e} ({length}, chunk {chunk})",
                    quant.name()
                );
            }
        }
    }
}

#[test]
fn bf16_logits_match_cpu_and_transformers() {
    check_fixtures(DType::Bf16, "", 1e-3);
}

#[test]
fn q8_logits_match_cpu_and_transformers() {
    check_fixtures(DType::Q8, "", 3e-2);
}

#[test]
fn q4_logits_match_cpu_and_transformers_on_the_same_quantized_weights() {
    check_fixtures(DType::Q4, "_q4", 1e-3);
}

#[test]
fn greedy_continuation_matches_transformers_generate() {
    if cuda().is_none() {
        return;
    }
    for name in FIXTURES {
        let converted = convert_fixture(name, DType::Bf16);
        let reference = Reference::load(name);
        let gpu = open_cuda(&converted.dir, ModelOptions::default(), cuda().unwrap());
        let prompt = reference.tokens("tokens_short");
        let want = reference.tokens("generate_ids");
        let got = gpu.generate_greedy(&prompt, want.len()).unwrap();
        assert_eq!(got, want, "{name}: greedy continuation on CUDA differs");
    }
}

#[test]
fn batched_sequences_equal_each_sequence_alone() {
    if cuda().is_none() {
        return;
    }
    for name in FIXTURES {
        let converted = convert_fixture(name, DType::Q4);
        let gpu = open_cuda(&converted.dir, ModelOptions::default(), cuda().unwrap());
        // The bound of prefill against decode: a batch of several decode
        // tokens runs the many-row kernels a lone decode token does not.
        common::batch::check_batched_equals_alone(&gpu, &format!("{name} CUDA q4"), 1e-4);
    }
}

#[test]
fn a_device_failure_fails_only_its_batch_and_the_process_goes_on() {
    if cuda().is_none() {
        return;
    }
    for name in FIXTURES {
        let converted = convert_fixture(name, DType::Q4);
        common::batch::check_device_failure_is_contained(&converted.dir, || cuda().unwrap());
    }
}

#[test]
fn prefill_logits_equal_token_by_token_decode() {
    if cuda().is_none() {
        return;
    }
    for name in FIXTURES {
        let converted = convert_fixture(name, DType::Q4);
        let tokens = Reference::load(name).tokens("tokens_long");
        let gpu = open_cuda(&converted.dir, ModelOptions::default(), cuda().unwrap());
        let prefill = gpu.session().forward(&tokens, LogitsWanted::All).unwrap();
        let mut session = gpu.session();
        let decoded: Vec<f32> = tokens
            .iter()
            .flat_map(|&t| session.decode(t).unwrap())
            .collect();
        let max = max_error(&decoded, &prefill.data, prefill.vocab);
        println!(
            "{name:<22} CUDA prefill vs decode over {} tokens: max rel err {max:.2e}",
            tokens.len()
        );
        assert!(
            max <= 1e-4,
            "{name}: prefill and decode differ by {max:.3e}"
        );
    }
}

#[test]
fn tiny_expert_caches_give_identical_results() {
    if cuda().is_none() {
        return;
    }
    for name in FIXTURES {
        let converted = convert_fixture(name, DType::Q4);
        let tokens = Reference::load(name).tokens("tokens_long");
        let unbounded = ModelOptions {
            expert_cache_bytes: Some(u64::MAX),
            ..Default::default()
        };
        let big = open_cuda(
            &converted.dir,
            unbounded.clone(),
            cuda_with(CudaOptions {
                expert_cache_bytes: Some(u64::MAX),
            })
            .unwrap(),
        );
        let manifest = big.dir().manifest();
        let one_per_layer = manifest.experts[0].blob.nbytes * manifest.experts.len() as u64;
        // One expert per layer in host memory, none at all in VRAM or in
        // the pinned host tier.
        let small_gpu = cuda_with(CudaOptions {
            expert_cache_bytes: Some(1),
        })
        .unwrap();
        small_gpu.set_pinned_cache_bytes(Some(0));
        let small = open_cuda(
            &converted.dir,
            ModelOptions {
                expert_cache_bytes: Some(one_per_layer),
                ..Default::default()
            },
            small_gpu,
        );
        let run = |model: &Arc<Model<CudaBackend>>| {
            let mut session = model.session();
            let mut logits = session.forward(&tokens, LogitsWanted::All).unwrap().data;
            for &t in tokens.iter().take(8) {
                logits.extend(session.decode(t).unwrap());
            }
            logits
        };
        assert_eq!(
            run(&small),
            run(&big),
            "{name}: small caches changed the results"
        );
        let (s, b) = (
            small.backend().expert_cache_stats(),
            big.backend().expert_cache_stats(),
        );
        println!(
            "{name:<22} VRAM uploads: {} with no cache, {} unbounded ({} hits); host misses {} vs {}",
            s.uploads,
            b.uploads,
            b.hits,
            small.expert_stats().misses,
            big.expert_stats().misses
        );
        assert!(s.uploads > b.uploads && s.hits == 0 && b.hits > 0);
        assert!(small.expert_stats().misses > big.expert_stats().misses);
    }
}

/// Experts uploaded before the first token (every layer complete: decode
/// never returns to the host) against experts streamed through a VRAM
/// cache that holds nothing: the same kernels, so the same logits.
#[test]
fn resident_and_streamed_experts_give_identical_results() {
    if cuda().is_none() {
        return;
    }
    for name in FIXTURES {
        for quant in [DType::Q4, DType::Bf16] {
            let converted = convert_fixture(name, quant);
            let tokens = Reference::load(name).tokens("tokens_long");
            let resident = open_cuda(&converted.dir, ModelOptions::default(), cuda().unwrap());
            resident
                .prepare_experts(&moeflux::util::NoProgress)
                .unwrap();
            let moe_layers = resident.config().moe_layers().count() as u64;
            assert_eq!(
                resident.backend().expert_cache_stats().complete_layers,
                moe_layers,
                "{name}: every layer resident after prepare_experts"
            );
            let streamed = open_cuda(
                &converted.dir,
                ModelOptions::default(),
                cuda_with(CudaOptions {
                    expert_cache_bytes: Some(1),
                })
                .unwrap(),
            );
            let run = |model: &Arc<Model<CudaBackend>>| {
                let mut session = model.session();
                let mut logits = session
                    .forward(&tokens[..5], LogitsWanted::All)
                    .unwrap()
                    .data;
                for &t in &tokens[5..] {
                    logits.extend(session.decode(t).unwrap());
                }
                logits
            };
            let before = resident.backend().expert_cache_stats();
            assert_eq!(
                run(&resident),
                run(&streamed),
                "{name} {}: resident and streamed experts differ",
                quant.name()
            );
            let after = resident.backend().expert_cache_stats();
            println!(
                "{name:<22} {}: resident decode {} hits, {} uploads after prepare; streamed {} uploads",
                quant.name(),
                after.hits - before.hits,
                after.uploads - before.uploads,
                streamed.backend().expert_cache_stats().uploads
            );
            assert_eq!(
                after.uploads, before.uploads,
                "{name}: nothing uploaded after prepare"
            );
            assert_eq!(streamed.backend().expert_cache_stats().complete_layers, 0);
        }
    }
}

/// Experts streamed through a VRAM cache of three experts (through the
/// pinned host tier, with and without prefetch, and from pageable memory
/// with the pinned tier off): the logits equal those of resident experts
/// and the statistics add up: every expert a decode step uses is a hit or
/// a miss, every miss and prefetch is an upload of the expert's bytes, and
/// every upload's bytes came from the pinned tier or the store.
#[test]
fn streamed_expert_statistics_are_consistent() {
    use moeflux::experts::Prefetch;
    if cuda().is_none() {
        return;
    }
    for name in FIXTURES {
        let converted = convert_fixture(name, DType::Q4);
        let tokens = Reference::load(name).tokens("tokens_long");
        let resident = open_cuda(&converted.dir, ModelOptions::default(), cuda().unwrap());
        resident
            .prepare_experts(&moeflux::util::NoProgress)
            .unwrap();
        let cfg = resident.config();
        let moe_layers: Vec<usize> = cfg.moe_layers().collect();
        let expert_bytes = resident
            .backend()
            .device_expert_bytes(resident.experts(), moe_layers[0]);
        assert!(
            moe_layers.iter().all(|&l| resident
                .backend()
                .device_expert_bytes(resident.experts(), l)
                == expert_bytes),
            "{name}: the fixture's experts differ in size across layers"
        );
        let prompt = 5;
        let run = |model: &Arc<Model<CudaBackend>>| {
            let mut session = model.session();
            let mut logits = session
                .forward(&tokens[..prompt], LogitsWanted::All)
                .unwrap()
                .data;
            let before = model.backend().expert_cache_stats();
            for &t in &tokens[prompt..] {
                logits.extend(session.decode(t).unwrap());
            }
            let decode = model.backend().expert_cache_stats().since(&before);
            (logits, decode)
        };
        let (want, _) = run(&resident);
        for (prefetch, pinned) in [
            (Prefetch::Off, None),
            (Prefetch::Router, None),
            (Prefetch::Off, Some(0)),
        ] {
            let what = format!("{name} (prefetch {prefetch:?}, pinned tier {pinned:?})");
            let backend = cuda_with(CudaOptions {
                expert_cache_bytes: Some(3 * expert_bytes),
            })
            .unwrap();
            backend.set_pinned_cache_bytes(pinned);
            let streamed = open_cuda(
                &converted.dir,
                ModelOptions {
                    prefetch,
                    ..ModelOptions::default()
                },
                backend,
            );
            streamed
                .prepare_experts(&moeflux::util::NoProgress)
                .unwrap();
            let (got, d) = run(&streamed);
            assert_eq!(got, want, "{what}: streamed and resident experts differ");
            let all = streamed.backend().expert_cache_stats();
            println!(
                "{what:<50} decode: {} hits ({} prefetched), {} misses, {} prefetches, {} B uploaded in {} ns; pinned {} hits, {} misses",
                d.hits,
                d.prefetch_hits,
                d.misses,
                d.prefetches,
                d.uploaded_bytes,
                d.copy_nanos,
                d.pinned_hits,
                d.pinned_misses
            );
            let uses = ((tokens.len() - prompt) * moe_layers.len() * cfg.moe.router.top_k) as u64;
            assert_eq!(d.hits + d.misses, uses, "{what}: uses");
            assert_eq!(d.uploads, d.misses + d.prefetches, "{what}: uploads");
            assert_eq!(d.uploaded_bytes, d.uploads * expert_bytes, "{what}: bytes");
            assert_eq!(
                all.uploaded_bytes,
                all.uploads * expert_bytes,
                "{what}: bytes, prefill included"
            );
            assert_eq!(
                all.pinned_hits + all.pinned_misses,
                all.uploads,
                "{what}: each upload's bytes from the pinned tier or the store"
            );
            assert!(d.prefetch_hits <= d.prefetches && d.prefetch_hits <= d.hits);
            assert!(d.misses > 0 && d.copy_nanos > 0, "{what}: nothing streamed");
            assert!(
                all.resident_bytes <= 3 * expert_bytes,
                "{what}: {} bytes cached over a budget of {}",
                all.resident_bytes,
                3 * expert_bytes
            );
            assert_eq!(all.complete_layers, 0);
            match (prefetch, pinned) {
                (Prefetch::Off, _) => assert_eq!(d.prefetches, 0, "{what}: prefetched"),
                (Prefetch::Router, _) => assert!(d.prefetches > 0, "{what}: no prefetch"),
                _ => {}
            }
            if pinned == Some(0) {
                assert_eq!((all.pinned_hits, all.pinned_bytes), (0, 0), "{what}");
            } else {
                assert!(all.pinned_hits > 0, "{what}: the pinned tier never served");
            }
        }
        let bandwidth = resident.backend().host_to_device_bandwidth().unwrap();
        println!("{name:<22} pinned host-to-device bandwidth {bandwidth:.1} GB/s");
        assert!(bandwidth > 0.1);
    }
}

/// Saving and loading state, truncation and checkpoints exercise the
/// export, import, truncate and copy operations; a state saved on CUDA
/// also continues on the CPU.
#[test]
fn sessions_save_truncate_and_restore_on_cuda() {
    if cuda().is_none() {
        return;
    }
    for name in ["qwen3_5_moe", "qwen3_moe"] {
        let converted = convert_fixture(name, DType::Q4);
        let tokens = Reference::load(name).tokens("tokens_long");
        let gpu = open_cuda(&converted.dir, ModelOptions::default(), cuda().unwrap());
        let cpu = open(&converted.dir, ModelOptions::default());
        let (prefix, rest) = tokens.split_at(37);
        let decode_all = |session: &mut moeflux::Session<CudaBackend>, tokens: &[u32]| {
            tokens
                .iter()
                .flat_map(|&t| session.decode(t).unwrap())
                .collect::<Vec<f32>>()
        };
        let vocab = gpu.config().vocab_size;

        let mut uninterrupted = gpu.session();
        uninterrupted.prefill(prefix).unwrap();
        let want = decode_all(&mut uninterrupted, rest);

        let mut first = gpu.session();
        first.prefill(prefix).unwrap();
        let bytes = first.save_state().unwrap();
        let mut second = gpu.session();
        second.load_state(&bytes, Path::new("<memory>")).unwrap();
        assert_eq!(
            decode_all(&mut second, rest),
            want,
            "{name}: load_state on CUDA"
        );

        let mut on_cpu = cpu.session();
        on_cpu.load_state(&bytes, Path::new("<memory>")).unwrap();
        let continued: Vec<f32> = rest
            .iter()
            .flat_map(|&t| on_cpu.decode(t).unwrap())
            .collect();
        let err = max_error(&continued, &want, vocab);
        println!("{name:<22} CUDA state continued on the CPU: max rel err {err:.2e}");
        assert!(
            err <= 1e-3,
            "{name}: CUDA state continued on the CPU differs by {err:.3e}"
        );

        let mut session = gpu.session();
        session.prefill(&tokens[..20]).unwrap();
        let at20 = session.checkpoint().unwrap();
        session.prefill(&tokens[20..]).unwrap();
        session.truncate(20).unwrap();
        session.restore_to(at20).unwrap();
        let again = decode_all(&mut session, &tokens[20..]);
        let mut fresh = gpu.session();
        fresh.prefill(&tokens[..20]).unwrap();
        let expected = decode_all(&mut fresh, &tokens[20..]);
        assert_eq!(again, expected, "{name}: truncate and restore on CUDA");
    }
}

// ---------------------------------------------------------------------
// Single operations, CUDA against the CPU backend on random inputs of
// awkward sizes.

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `got` equals `want` within `tolerance` of the largest `|want|`.
fn assert_close(what: &str, got: &[f32], want: &[f32], tolerance: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    assert!(
        got.iter().all(|v| v.is_finite()),
        "{what}: non-finite output"
    );
    let scale = want
        .iter()
        .fold(0f64, |m, v| m.max(v.abs() as f64))
        .max(1e-30);
    let worst = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (g, w)| m.max((g - w).abs() as f64));
    assert!(
        worst <= tolerance * scale,
        "{what}: max error {worst:.3e} exceeds {tolerance:.0e} of {scale:.3e}"
    );
}

/// A converted fixture with test tensors added to its manifest, so that
/// both backends can load them through the normal path.
struct TestWeights {
    _converted: Converted,
    dir: ModelDir,
}

impl TestWeights {
    fn new(tensors: &[(&str, DType, Vec<usize>, Vec<f32>)]) -> TestWeights {
        let converted = convert_fixture("qwen3_moe", DType::Bf16);
        let mut bytes: Vec<u8> = Vec::new();
        let mut entries = serde_json::Map::new();
        for (name, dtype, shape, data) in tensors {
            let (rows, cols) = match shape.as_slice() {
                [n] => (1, *n),
                [r, c] => (*r, *c),
                _ => panic!("{name}: one or two dimensions"),
            };
            let layout = MatrixLayout::new(*dtype, rows, cols).expect("storable");
            bytes.resize(bytes.len().next_multiple_of(64), 0);
            let offset = bytes.len();
            bytes.extend(RowEncoder::new(layout).encode_matrix(data));
            entries.insert(
                name.to_string(),
                serde_json::json!({
                    "file": "test.bin", "offset": offset, "nbytes": layout.total_bytes,
                    "shape": shape, "dtype": dtype.name(),
                }),
            );
        }
        std::fs::write(converted.dir.join("test.bin"), &bytes).unwrap();
        let manifest_path = converted.dir.join("manifest.json");
        let mut manifest: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&manifest_path).unwrap()).unwrap();
        manifest["tensors"].as_object_mut().unwrap().extend(entries);
        manifest["files"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({
                "path": "test.bin", "size": bytes.len(),
                "xxh3": format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes)),
            }));
        std::fs::write(&manifest_path, manifest.to_string()).unwrap();
        let dir = ModelDir::open(&converted.dir, OpenOptions::default()).unwrap();
        TestWeights {
            _converted: converted,
            dir,
        }
    }

    fn load<B: Backend>(&self, backend: &B, name: &str, shape: &[usize]) -> B::Weight {
        backend
            .load_weight(
                &self.dir.tensor(name, shape).unwrap(),
                moeflux::format::TensorRole::Matrix,
            )
            .unwrap()
    }
}

/// The same host matrix on both backends.
fn both(gpu: &CudaBackend, rows: usize, cols: usize, data: Vec<f32>) -> (CpuTensor, CudaTensor) {
    let on_gpu = gpu.tensor_from_host(rows, cols, &data).unwrap();
    (CpuTensor::new(rows, cols, data), on_gpu)
}

#[test]
fn linear_and_embed_match_cpu_for_every_dtype() {
    let Some(gpu) = cuda() else { return };
    let cpu = CpuBackend::default();
    let shapes = [
        (1, 1, 64),
        (2, 5, 128),
        (3, 7, 192),
        (9, 13, 64),
        (1, 37, 2048),
        (64, 9, 128),
        (5, 130, 192),
        (17, 66, 320),
    ];
    let mut tensors = Vec::new();
    for dtype in [DType::F32, DType::Bf16, DType::Q8, DType::Q4] {
        for (i, &(_, rows, cols)) in shapes.iter().enumerate() {
            // Unquantized types also take widths of no whole group.
            let cols = if dtype.is_quantized() { cols } else { cols + 3 };
            let name = format!("test.{}.{i}", dtype.name());
            tensors.push((name, dtype, [rows, cols], values(rows * cols, i as u64 + 1)));
        }
    }
    let specs: Vec<(&str, DType, Vec<usize>, Vec<f32>)> = tensors
        .iter()
        .map(|(n, d, s, v)| (n.as_str(), *d, s.to_vec(), v.clone()))
        .collect();
    let weights = TestWeights::new(&specs);
    for (name, dtype, shape, _) in &tensors {
        let (rows, cols) = (shape[0], shape[1]);
        let w_cpu = weights.load(&cpu, name, shape);
        let w_gpu = weights.load(&gpu, name, shape);
        let n = shapes.iter().find(|s| s.1 == rows).unwrap().0;
        let mut x = values(n * cols, (n * cols) as u64);
        x[cols / 3] = 9.0; // an outlier, as real activations have
        let (x_cpu, x_gpu) = both(&gpu, n, cols, x.clone());
        let want = cpu.to_host(&cpu.linear(&x_cpu, &w_cpu).unwrap()).unwrap();
        let got = gpu.to_host(&gpu.linear(&x_gpu, &w_gpu).unwrap()).unwrap();
        // Per output, f32 rounding of the terms' magnitudes.
        let view = weights.dir.tensor(name, shape).unwrap();
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            view.view().dequantize_row(r, &mut row);
            for t in 0..n {
                let magnitude: f64 = row
                    .iter()
                    .zip(&x[t * cols..(t + 1) * cols])
                    .map(|(&w, &v)| (w as f64 * v as f64).abs())
                    .sum();
                let (g, w) = (got[t * rows + r], want[t * rows + r]);
                assert!(
                    ((g - w).abs() as f64) <= 1e-5 * magnitude + 1e-30,
                    "linear {} n={n} {rows}x{cols} [{t},{r}]: {g} vs {w}",
                    dtype.name()
                );
            }
        }
        let tokens: Vec<u32> = (0..2 * rows as u32 + 1)
            .map(|i| (i * 7) % rows as u32)
            .collect();
        assert_eq!(
            gpu.to_host(&gpu.embed(&w_gpu, &tokens).unwrap()).unwrap(),
            cpu.to_host(&cpu.embed(&w_cpu, &tokens).unwrap()).unwrap(),
            "embed {}",
            dtype.name()
        );
    }
}

#[test]
fn norms_match_cpu() {
    let Some(gpu) = cuda() else { return };
    let cpu = CpuBackend::default();
    let weights = TestWeights::new(&[
        ("test.norm208", DType::F32, vec![208], values(208, 3)),
        ("test.norm48", DType::F32, vec![48], values(48, 4)),
        ("test.norm80", DType::F32, vec![80], values(80, 5)),
    ]);
    for (name, group, rows, cols) in [
        ("test.norm208", 208, 5, 208),
        ("test.norm48", 48, 3, 48 * 5),
        ("test.norm80", 80, 1, 80),
    ] {
        let (w_cpu, w_gpu) = (
            weights.load(&cpu, name, &[group]),
            weights.load(&gpu, name, &[group]),
        );
        let (x_cpu, x_gpu) = both(&gpu, rows, cols, values(rows * cols, group as u64));
        for unit_offset in [false, true] {
            let norm = RmsNorm {
                eps: 1e-6,
                unit_offset,
            };
            assert_close(
                &format!("rms_norm {name} unit_offset={unit_offset}"),
                &gpu.to_host(&gpu.rms_norm(&x_gpu, &w_gpu, norm).unwrap())
                    .unwrap(),
                &cpu.to_host(&cpu.rms_norm(&x_cpu, &w_cpu, norm).unwrap())
                    .unwrap(),
                1e-5,
            );
        }
        let (z_cpu, z_gpu) = both(&gpu, rows, cols, values(rows * cols, 99));
        assert_close(
            &format!("gated_rms_norm {name}"),
            &gpu.to_host(&gpu.gated_rms_norm(&x_gpu, &z_gpu, &w_gpu, 1e-6).unwrap())
                .unwrap(),
            &cpu.to_host(&cpu.gated_rms_norm(&x_cpu, &z_cpu, &w_cpu, 1e-6).unwrap())
                .unwrap(),
            1e-5,
        );
    }
}

/// One token's q4 product with a matrix of many rows (an LM head) runs on
/// the tensor cores (linear_vector_tc_q4) and matches the CPU within f32
/// rounding of the terms' magnitudes (1e-5 of Σ|w·x|, as for `linear`);
/// the row count is no multiple of the kernel's 16-row tiles.
#[test]
fn many_row_q4_product_of_one_token_matches_cpu() {
    let Some(gpu) = cuda() else { return };
    let cpu = CpuBackend::default();
    let (rows, cols) = (40_009, 192);
    let name = "test.lm_head";
    let weights = TestWeights::new(&[(name, DType::Q4, vec![rows, cols], values(rows * cols, 5))]);
    let (w_cpu, w_gpu) = (
        weights.load(&cpu, name, &[rows, cols]),
        weights.load(&gpu, name, &[rows, cols]),
    );
    let mut x = values(cols, 17);
    x[cols / 3] = 9.0;
    let (x_cpu, x_gpu) = both(&gpu, 1, cols, x.clone());
    let want = cpu.to_host(&cpu.linear(&x_cpu, &w_cpu).unwrap()).unwrap();
    let got = gpu.to_host(&gpu.linear(&x_gpu, &w_gpu).unwrap()).unwrap();
    let view = weights.dir.tensor(name, &[rows, cols]).unwrap();
    let mut row = vec![0f32; cols];
    for r in 0..rows {
        view.view().dequantize_row(r, &mut row);
        let magnitude: f64 = row
            .iter()
            .zip(&x)
            .map(|(&w, &v)| (w as f64 * v as f64).abs())
            .sum();
        assert!(
            ((got[r] - want[r]).abs() as f64) <= 1e-5 * magnitude,
            "row {r}: {} vs {}",
            got[r],
            want[r]
        );
    }
}

/// A decode step's RMSNorm applied by the one-token products that read it
/// (both the column-split and the whole-row kernels, every type) agrees
/// with the norm's own launch followed by the products: the normalised
/// input the launch stores matches the CPU's norm, and each product is
/// within f32 rounding of the terms' magnitudes (1e-5 of Σ|w·x|, as for
/// `linear`) of the separate launches' (the fused kernels scale the sum
/// by the norm's factor instead of each input, so they round differently).
#[test]
fn norm_fused_into_one_token_products_matches_separate_launches() {
    let Some(gpu) = cuda() else { return };
    let cpu = CpuBackend::default();
    // Matrices of one launch: few rows (columns split across warps) and
    // more than a thousand (whole rows per warp).
    let launches: [&[usize]; 2] = [&[37, 5], &[1100]];
    let mut specs: Vec<_> = [320, 2048]
        .map(|cols| {
            (
                format!("test.norm.{cols}"),
                DType::F32,
                vec![cols],
                values(cols, 7),
            )
        })
        .into();
    for dtype in [DType::F32, DType::Bf16, DType::Q8, DType::Q4] {
        for cols in [320, 2048] {
            for (l, rows) in launches.iter().enumerate() {
                for (m, &r) in rows.iter().enumerate() {
                    let name = format!("test.{}.{cols}.{l}.{m}", dtype.name());
                    let data = values(r * cols, (l * 10 + m) as u64);
                    specs.push((name, dtype, vec![r, cols], data));
                }
            }
        }
    }
    let refs: Vec<(&str, DType, Vec<usize>, Vec<f32>)> = specs
        .iter()
        .map(|(n, d, s, v)| (n.as_str(), *d, s.clone(), v.clone()))
        .collect();
    let weights = TestWeights::new(&refs);
    for dtype in [DType::F32, DType::Bf16, DType::Q8, DType::Q4] {
        for cols in [320, 2048] {
            let norm_name = format!("test.norm.{cols}");
            let (nw_cpu, nw_gpu) = (
                weights.load(&cpu, &norm_name, &[cols]),
                weights.load(&gpu, &norm_name, &[cols]),
            );
            let mut x = values(cols, cols as u64 + 3);
            x[cols / 5] = 11.0;
            let (x_cpu, x_gpu) = both(&gpu, 1, cols, x);
            for (l, rows) in launches.iter().enumerate() {
                let ws: Vec<_> = rows
                    .iter()
                    .enumerate()
                    .map(|(m, &r)| {
                        let name = format!("test.{}.{cols}.{l}.{m}", dtype.name());
                        weights.load(&gpu, &name, &[r, cols])
                    })
                    .collect();
                let ws: Vec<_> = ws.iter().collect();
                for unit_offset in [false, true] {
                    let norm = RmsNorm {
                        eps: 1e-6,
                        unit_offset,
                    };
                    let what = format!(
                        "{} {cols} cols, rows {rows:?}, offset {unit_offset}",
                        dtype.name()
                    );
                    let (normed, fused) = gpu
                        .rms_norm_linear_many(&x_gpu, &nw_gpu, norm, &ws)
                        .unwrap();
                    let separate_norm = gpu.rms_norm(&x_gpu, &nw_gpu, norm).unwrap();
                    let separate = gpu.linear_many(&separate_norm, &ws).unwrap();
                    let h = cpu
                        .to_host(&cpu.rms_norm(&x_cpu, &nw_cpu, norm).unwrap())
                        .unwrap();
                    assert_close(
                        &format!("{what}: normalised input against the CPU"),
                        &gpu.to_host(&normed).unwrap(),
                        &h,
                        1e-5,
                    );
                    for (m, (f, s)) in fused.iter().zip(&separate).enumerate() {
                        let (got, want) = (gpu.to_host(f).unwrap(), gpu.to_host(s).unwrap());
                        let name = format!("test.{}.{cols}.{l}.{m}", dtype.name());
                        let view = weights.dir.tensor(&name, &[rows[m], cols]).unwrap();
                        let mut row = vec![0f32; cols];
                        for r in 0..rows[m] {
                            view.view().dequantize_row(r, &mut row);
                            let magnitude: f64 = row
                                .iter()
                                .zip(&h)
                                .map(|(&w, &v)| (w as f64 * v as f64).abs())
                                .sum();
                            assert!(
                                ((got[r] - want[r]).abs() as f64) <= 1e-5 * magnitude,
                                "{what}: product {m} row {r}: {} fused vs {} separate",
                                got[r],
                                want[r]
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn elementwise_ops_match_cpu() {
    let Some(gpu) = cuda() else { return };
    let cpu = CpuBackend::default();
    let (rows, cols) = (7, 61);
    let (x_cpu, x_gpu) = both(&gpu, rows, cols, values(rows * cols, 1));
    let (y_cpu, y_gpu) = both(&gpu, rows, cols, values(rows * cols, 2));
    assert_eq!(gpu.to_host(&x_gpu).unwrap(), x_cpu.data, "to_host");
    assert_eq!(gpu.rows(&x_gpu), rows);

    let widths = [13, 40, 8];
    for (g, c) in gpu
        .split_cols(&x_gpu, &widths)
        .unwrap()
        .iter()
        .zip(cpu.split_cols(&x_cpu, &widths).unwrap())
    {
        assert_eq!(gpu.to_host(g).unwrap(), c.data, "split_cols");
    }
    let (last, all) = (rows - 1..rows, 0..rows);
    let gathers: [&[std::ops::Range<usize>]; 4] = [
        std::slice::from_ref(&last),
        std::slice::from_ref(&all),
        &[0..2, 4..7],
        &[1..1, 2..5, 6..7, 0..1],
    ];
    for ranges in gathers {
        assert_eq!(
            gpu.to_host(&gpu.gather_rows(&x_gpu, ranges).unwrap())
                .unwrap(),
            cpu.gather_rows(&x_cpu, ranges).unwrap().data,
            "gather_rows {ranges:?}"
        );
    }
    let split = [0..2, 2..2, 2..7];
    let parts_gpu: Vec<_> = split
        .iter()
        .map(|r| gpu.gather_rows(&x_gpu, std::slice::from_ref(r)).unwrap())
        .collect();
    let parts_cpu: Vec<_> = split
        .iter()
        .map(|r| cpu.gather_rows(&x_cpu, std::slice::from_ref(r)).unwrap())
        .collect();
    assert_eq!(
        gpu.to_host(&gpu.concat_rows(&parts_gpu).unwrap()).unwrap(),
        x_cpu.data,
        "concat_rows"
    );
    assert_eq!(
        cpu.concat_rows(&parts_cpu).unwrap().data,
        x_cpu.data,
        "concat_rows"
    );

    let (mut a_cpu, mut a_gpu) = both(&gpu, rows, cols, values(rows * cols, 1));
    cpu.add_assign(&mut a_cpu, &y_cpu).unwrap();
    gpu.add_assign(&mut a_gpu, &y_gpu).unwrap();
    assert_close(
        "add_assign",
        &gpu.to_host(&a_gpu).unwrap(),
        &a_cpu.data,
        1e-7,
    );

    assert_close(
        "silu_mul",
        &gpu.to_host(&gpu.silu_mul(&x_gpu, &y_gpu).unwrap()).unwrap(),
        &cpu.silu_mul(&x_cpu, &y_cpu).unwrap().data,
        1e-6,
    );

    let (mut m_cpu, mut m_gpu) = both(&gpu, rows, cols, values(rows * cols, 1));
    cpu.mul_sigmoid(&mut m_cpu, &y_cpu).unwrap();
    gpu.mul_sigmoid(&mut m_gpu, &y_gpu).unwrap();
    assert_close(
        "mul_sigmoid",
        &gpu.to_host(&m_gpu).unwrap(),
        &m_cpu.data,
        1e-6,
    );

    let (g_cpu, g_gpu) = both(&gpu, rows, 1, values(rows, 5));
    let (mut r_cpu, mut r_gpu) = both(&gpu, rows, cols, values(rows * cols, 1));
    cpu.mul_sigmoid(&mut r_cpu, &g_cpu).unwrap();
    gpu.mul_sigmoid(&mut r_gpu, &g_gpu).unwrap();
    assert_close(
        "mul_sigmoid per row",
        &gpu.to_host(&r_gpu).unwrap(),
        &r_cpu.data,
        1e-6,
    );
}

#[test]
fn rope_matches_cpu() {
    let Some(gpu) = cuda() else { return };
    let cpu = CpuBackend::default();
    for (head_dim, rotary_dim, theta, start) in [
        (40, 24, 10_000.0, 0),
        (40, 40, 1_000_000.0, 1000),
        (64, 16, 10_000_000.0, 123_457),
    ] {
        let rope = Rope {
            head_dim,
            rotary_dim,
            theta,
        };
        let (rows, cols) = (5, 3 * head_dim);
        let (mut x_cpu, mut x_gpu) = both(&gpu, rows, cols, values(rows * cols, head_dim as u64));
        cpu.rope(&mut x_cpu, rope, start).unwrap();
        gpu.rope(&mut x_gpu, rope, start).unwrap();
        assert_close(
            &format!("rope {head_dim}/{rotary_dim} at {start}"),
            &gpu.to_host(&x_gpu).unwrap(),
            &x_cpu.data,
            1e-5,
        );
    }
}

#[test]
fn attention_matches_cpu_across_chunks_growth_truncation_and_import() {
    let Some(gpu) = cuda() else { return };
    let cpu = CpuBackend::default();
    let shape = AttentionShape {
        num_heads: 6,
        num_kv_heads: 2,
        head_dim: 40,
    };
    let (q_width, kv_width) = (6 * 40, 2 * 40);
    let mut cache_cpu = cpu.new_kv_cache(shape).unwrap();
    let mut cache_gpu = gpu.new_kv_cache(shape).unwrap();
    let step = |n: usize, seed: u64, cache_cpu: &mut CpuKv, cache_gpu: &mut CudaKv| {
        let (q_cpu, q_gpu) = both(&gpu, n, q_width, values(n * q_width, seed));
        let (k_cpu, k_gpu) = both(&gpu, n, kv_width, values(n * kv_width, seed + 1));
        let (v_cpu, v_gpu) = both(&gpu, n, kv_width, values(n * kv_width, seed + 2));
        let want = cpu
            .attention(cache_cpu, &q_cpu, &k_cpu, &v_cpu, shape)
            .unwrap()
            .data;
        let got = gpu
            .to_host(
                &gpu.attention(cache_gpu, &q_gpu, &k_gpu, &v_gpu, shape)
                    .unwrap(),
            )
            .unwrap();
        assert_close(
            &format!("attention chunk of {n} (seed {seed})"),
            &got,
            &want,
            1e-5,
        );
    };
    // 309 positions: past the first capacity of 256, so the cache grows.
    for (i, n) in [5, 1, 300, 3].into_iter().enumerate() {
        step(n, 10 * i as u64, &mut cache_cpu, &mut cache_gpu);
    }
    assert_eq!(gpu.kv_len(&cache_gpu), 309);
    let (exported, reference) = (
        gpu.kv_export(&cache_gpu).unwrap(),
        cpu.kv_export(&cache_cpu).unwrap(),
    );
    assert_eq!(exported.keys, reference.keys, "kv_export keys");
    assert_eq!(exported.values, reference.values, "kv_export values");

    cpu.kv_truncate(&mut cache_cpu, 100);
    gpu.kv_truncate(&mut cache_gpu, 100);
    assert_eq!(gpu.kv_len(&cache_gpu), 100);
    step(4, 77, &mut cache_cpu, &mut cache_gpu);

    let mut imported = gpu
        .kv_import(shape, cpu.kv_export(&cache_cpu).unwrap())
        .unwrap();
    assert_eq!(gpu.kv_len(&imported), 104);
    step(2, 91, &mut cache_cpu, &mut imported);
}

/// Prefill chunks (16 tokens and more) take the tiled kernels; head
/// dimensions of 128 and 256 (the two variants, as in the real models),
/// chunks that leave partial row and key tiles, and chunks after context.
#[test]
fn prefill_attention_matches_cpu_for_both_head_dimensions() {
    let Some(gpu) = cuda() else { return };
    let cpu = CpuBackend::default();
    for (heads, kv_heads, head_dim) in [(32, 4, 128), (16, 2, 256), (5, 5, 132)] {
        let shape = AttentionShape {
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
        };
        let (q_width, kv_width) = (heads * head_dim, kv_heads * head_dim);
        let mut cache_cpu = cpu.new_kv_cache(shape).unwrap();
        let mut cache_gpu = gpu.new_kv_cache(shape).unwrap();
        for (i, n) in [70, 16, 1, 45].into_iter().enumerate() {
            let seed = 1000 + 10 * i as u64 + head_dim as u64;
            let (q_cpu, q_gpu) = both(&gpu, n, q_width, values(n * q_width, seed));
            let (k_cpu, k_gpu) = both(&gpu, n, kv_width, values(n * kv_width, seed + 1));
            let (v_cpu, v_gpu) = both(&gpu, n, kv_width, values(n * kv_width, seed + 2));
            let want = cpu
                .attention(&mut cache_cpu, &q_cpu, &k_cpu, &v_cpu, shape)
                .unwrap()
                .data;
            let got = gpu
                .to_host(
                    &gpu.attention(&mut cache_gpu, &q_gpu, &k_gpu, &v_gpu, shape)
                        .unwrap(),
                )
                .unwrap();
            assert_close(
                &format!("attention, head_dim {head_dim}, chunk of {n}"),
                &got,
                &want,
                1e-5,
            );
        }
    }
}

/// Head sizes that leave lanes and warps of the recurrence partly idle
/// (24 × 40), and the real models' (128 × 128, a warp's lanes holding
/// four rows of a state column each). Runs of 64 tokens and more take the
/// chunked tensor-core form (one whole chunk, partial last chunks, many
/// chunks), the shorter ones the recurrence, each continuing the other's
/// state. 20 × 36 pads the chunked form's key rows to whole MMA steps;
/// 160 × 48 is too wide for it, so long runs take the recurrence.
#[test]
fn gated_delta_net_matches_cpu_across_chunks_copies_and_import() {
    let Some(gpu) = cuda() else { return };
    let cpu = CpuBackend::default();
    for (key_head_dim, value_head_dim) in [(24, 40), (128, 128), (20, 36), (160, 48)] {
        check_gated_delta_net(
            &cpu,
            &gpu,
            LinearAttentionConfig {
                num_key_heads: 2,
                num_value_heads: 4,
                key_head_dim,
                value_head_dim,
                conv_kernel: 4,
            },
        );
    }
}

fn check_gated_delta_net(cpu: &CpuBackend, gpu: &CudaBackend, cfg: LinearAttentionConfig) {
    let (channels, nv) = (cfg.conv_dim(), cfg.num_value_heads);
    let weights = TestWeights::new(&[
        (
            "test.conv",
            DType::F32,
            vec![channels, 4],
            values(channels * 4, 1),
        ),
        ("test.a_log", DType::F32, vec![nv], values(nv, 2)),
        ("test.dt_bias", DType::F32, vec![nv], values(nv, 3)),
    ]);
    let conv = (
        weights.load(cpu, "test.conv", &[channels, 4]),
        weights.load(gpu, "test.conv", &[channels, 4]),
    );
    let a_log = (
        weights.load(cpu, "test.a_log", &[nv]),
        weights.load(gpu, "test.a_log", &[nv]),
    );
    let dt_bias = (
        weights.load(cpu, "test.dt_bias", &[nv]),
        weights.load(gpu, "test.dt_bias", &[nv]),
    );
    let mut state_cpu = cpu.new_delta_net_state(&cfg).unwrap();
    let mut state_gpu = gpu.new_delta_net_state(&cfg).unwrap();
    let step = |n: usize, seed: u64, state_cpu: &mut CpuDeltaNet, state_gpu: &mut CudaDeltaNet| {
        let (qkv_cpu, qkv_gpu) = both(gpu, n, channels, values(n * channels, seed));
        let (b_cpu, b_gpu) = both(gpu, n, nv, values(n * nv, seed + 1));
        let (a_cpu, a_gpu) = both(gpu, n, nv, values(n * nv, seed + 2));
        let want = cpu
            .gated_delta_net(
                state_cpu,
                &qkv_cpu,
                &b_cpu,
                &a_cpu,
                GatedDeltaNetParams {
                    conv: &conv.0,
                    a_log: &a_log.0,
                    dt_bias: &dt_bias.0,
                },
                &cfg,
            )
            .unwrap();
        let got = gpu
            .gated_delta_net(
                state_gpu,
                &qkv_gpu,
                &b_gpu,
                &a_gpu,
                GatedDeltaNetParams {
                    conv: &conv.1,
                    a_log: &a_log.1,
                    dt_bias: &dt_bias.1,
                },
                &cfg,
            )
            .unwrap();
        assert_close(
            &format!("gated_delta_net chunk of {n} (seed {seed})"),
            &gpu.to_host(&got).unwrap(),
            &want.data,
            1e-5,
        );
    };
    let compare_states = |what: &str, got: &CudaDeltaNet, want: &CpuDeltaNet| {
        let (g, w) = (
            gpu.delta_net_export(got).unwrap(),
            cpu.delta_net_export(want).unwrap(),
        );
        assert_close(
            &format!("{what}: convolution history"),
            &g.conv,
            &w.conv,
            1e-6,
        );
        assert_close(
            &format!("{what}: recurrent state"),
            &g.recurrent,
            &w.recurrent,
            1e-5,
        );
    };
    for (i, n) in [5, 1, 2, 9, 200, 64, 3, 130, 700].into_iter().enumerate() {
        step(n, 10 * i as u64, &mut state_cpu, &mut state_gpu);
        compare_states(&format!("after chunk {i}"), &state_gpu, &state_cpu);
    }
    let mut copy_cpu = cpu.delta_net_copy(&state_cpu).unwrap();
    let mut copy_gpu = gpu.delta_net_copy(&state_gpu).unwrap();
    step(3, 50, &mut copy_cpu, &mut copy_gpu);
    // The originals did not move with their copies.
    compare_states("original after its copy ran", &state_gpu, &state_cpu);
    let mut imported = gpu
        .delta_net_import(&cfg, cpu.delta_net_export(&state_cpu).unwrap())
        .unwrap();
    step(2, 60, &mut state_cpu, &mut imported);
}

#[test]
fn routing_matches_cpu() {
    let Some(gpu) = cuda() else { return };
    let cpu = CpuBackend::default();
    for (n, experts, top_k) in [(9, 37, 5), (1, 8, 2), (4, 300, 10), (3, 512, 1)] {
        let (l_cpu, l_gpu) = both(&gpu, n, experts, values(n * experts, experts as u64));
        for normalize in [false, true] {
            let want = cpu
                .route(&l_cpu, &RouterSpec::softmax(top_k, normalize), None)
                .unwrap();
            let got = gpu
                .route(&l_gpu, &RouterSpec::softmax(top_k, normalize), None)
                .unwrap();
            assert_eq!(
                gpu.selected_experts(&got).unwrap(),
                cpu.selected_experts(&want).unwrap(),
                "route {n}x{experts} top-{top_k}"
            );
            assert_close(
                &format!("route weights {n}x{experts} top-{top_k} normalize={normalize}"),
                &got.weights_to_host().unwrap(),
                &want.weights,
                1e-6,
            );
        }
    }
}

/// The expert store of a small converted model, every expert fitting its
/// cache.
fn whole_store(dir: &ModelDir) -> ExpertStore {
    ExpertStore::open(
        dir,
        StoreOptions {
            cache_bytes: 1 << 30,
            policy: CachePolicy::Lfu,
            io: IoMode::Buffered,
        },
    )
    .unwrap()
}

#[test]
fn routed_experts_match_cpu() {
    let Some(gpu) = cuda() else { return };
    let cpu = CpuBackend::default();
    for quant in [DType::Bf16, DType::Q4] {
        let converted = convert_fixture("qwen3_5_moe", quant);
        let dir = ModelDir::open(&converted.dir, OpenOptions::default()).unwrap();
        let store = whole_store(&dir);
        let cfg = dir.config();
        let (hidden, experts, top_k) = (cfg.hidden_size, cfg.moe.num_experts, cfg.moe.router.top_k);
        let layer = cfg.moe_layers().next().expect("an MoE layer");
        for n in [1, 9] {
            let (x_cpu, x_gpu) = both(&gpu, n, hidden, values(n * hidden, n as u64));
            let (l_cpu, l_gpu) = both(&gpu, n, experts, values(n * experts, 7 + n as u64));
            let want = cpu
                .routed_experts(
                    &x_cpu,
                    &cpu.route(&l_cpu, &RouterSpec::softmax(top_k, true), None)
                        .unwrap(),
                    &store,
                    layer,
                )
                .unwrap();
            let got = gpu
                .routed_experts(
                    &x_gpu,
                    &gpu.route(&l_gpu, &RouterSpec::softmax(top_k, true), None)
                        .unwrap(),
                    &store,
                    layer,
                )
                .unwrap();
            assert_close(
                &format!("routed experts {} n={n}", quant.name()),
                &gpu.to_host(&got).unwrap(),
                &want.data,
                1e-5,
            );
        }
    }
}

/// The tensor-core kernels (gemm.cu, which `linear` takes from 16 tokens
/// on for q4, q8 and bf16 weights) against the CPU, on shapes that leave
/// partial tiles everywhere: rows not a multiple of the 128-row tile,
/// token counts around the 64-token tile, a bf16 width of no whole
/// 64-column stage. Some rows are offset (large biases, all-positive
/// groups), and tokens differ in scale by orders of magnitude, as real
/// activations do. Same per-output bound as
/// `linear_and_embed_match_cpu_for_every_dtype`.
#[test]
fn tensor_core_linear_matches_cpu_on_awkward_shapes() {
    let Some(gpu) = cuda() else { return };
    let cpu: CpuBackend = Default::default();
    // (rows, cols); 72 columns only for bf16 (the quantized types need
    // whole 64-column groups).
    let shapes: [(usize, usize); 4] = [(130, 64), (37, 192), (200, 2048), (129, 72)];
    let mut tensors = Vec::new();
    for dtype in [DType::Bf16, DType::Q8, DType::Q4] {
        for (i, &(rows, cols)) in shapes.iter().enumerate() {
            if dtype.is_quantized() && !cols.is_multiple_of(64) {
                continue;
            }
            let mut data = values(rows * cols, 100 + i as u64);
            for row in data.chunks_mut(cols).skip(1).step_by(4) {
                row.iter_mut().for_each(|w| *w += 2.5);
            }
            let name = format!("test.tc.{}.{i}", dtype.name());
            tensors.push((name, dtype, vec![rows, cols], data));
        }
    }
    let specs: Vec<(&str, DType, Vec<usize>, Vec<f32>)> = tensors
        .iter()
        .map(|(n, d, s, v)| (n.as_str(), *d, s.clone(), v.clone()))
        .collect();
    let weights = TestWeights::new(&specs);
    for (name, dtype, shape, _) in &tensors {
        let (rows, cols) = (shape[0], shape[1]);
        let w_cpu = weights.load(&cpu, name, shape);
        let w_gpu = weights.load(&gpu, name, shape);
        let view = weights.dir.tensor(name, shape).unwrap();
        let mut dequantized = vec![0f32; rows * cols];
        for (r, row) in dequantized.chunks_mut(cols).enumerate() {
            view.view().dequantize_row(r, row);
        }
        for n in [16, 17, 63, 64, 130, 512] {
            let mut x = values(n * cols, (n * cols + rows) as u64);
            x[cols / 3] = 9.0; // an outlier, as real activations have
            for (t, token) in x.chunks_mut(cols).enumerate() {
                let scale = [1.0, 1e-3, 30.0][t % 3];
                token.iter_mut().for_each(|v| *v *= scale);
            }
            let (x_cpu, x_gpu) = both(&gpu, n, cols, x.clone());
            let want = cpu.to_host(&cpu.linear(&x_cpu, &w_cpu).unwrap()).unwrap();
            let got = gpu.to_host(&gpu.linear(&x_gpu, &w_gpu).unwrap()).unwrap();
            assert_eq!(got.len(), n * rows);
            // The worst error as a fraction of its output's bound.
            let mut worst = 0f64;
            for (t, token) in x.chunks(cols).enumerate() {
                for (r, row) in dequantized.chunks(cols).enumerate() {
                    let magnitude: f64 = row
                        .iter()
                        .zip(token)
                        .map(|(&w, &v)| (w as f64 * v as f64).abs())
                        .sum();
                    let (g, w) = (got[t * rows + r], want[t * rows + r]);
                    let bound = 1e-5 * magnitude + 1e-30;
                    assert!(
                        g.is_finite() && ((g - w).abs() as f64) <= bound,
                        "tensor-core linear {} n={n} {rows}x{cols} [{t},{r}]: {g} vs {w}",
                        dtype.name()
                    );
                    worst = worst.max((g - w).abs() as f64 / bound);
                }
            }
            println!(
                "tensor-core linear {:<4} n={n:<3} {rows}x{cols}: worst error {worst:.3} of the bound",
                dtype.name()
            );
        }
    }
}

/// A one-layer qwen3_moe checkpoint (f32) larger than the fixtures, so that
/// the grouped prefill kernels see several 64-column stages, partial
/// 128-row tiles and experts with many 32-slot tiles: hidden 192,
/// expert intermediate 320, 16 experts, top-4. Every fifth weight row is
/// offset (all-positive groups, large biases once quantized).
fn synthetic_moe_checkpoint() -> tempfile::TempDir {
    let (hidden, inter, experts, vocab, heads, kv_heads, head_dim) = (
        192usize, 320usize, 16usize, 300usize, 4usize, 2usize, 32usize,
    );
    let tmp = tempfile::tempdir().unwrap();
    let config = serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "attention_bias": false, "decoder_sparse_step": 1, "head_dim": head_dim,
        "hidden_act": "silu", "hidden_size": hidden, "intermediate_size": 128,
        "max_position_embeddings": 512, "mlp_only_layers": [],
        "moe_intermediate_size": inter, "norm_topk_prob": true,
        "num_attention_heads": heads, "num_experts_per_tok": 4, "num_hidden_layers": 1,
        "num_key_value_heads": kv_heads, "num_local_experts": experts,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": true, "vocab_size": vocab,
    });
    std::fs::write(tmp.path().join("config.json"), config.to_string()).unwrap();
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![vocab, hidden]),
        ("model.norm.weight".into(), vec![hidden]),
    ];
    let l = "model.layers.0";
    for (name, shape) in [
        ("input_layernorm.weight", vec![hidden]),
        ("post_attention_layernorm.weight", vec![hidden]),
        ("self_attn.q_proj.weight", vec![heads * head_dim, hidden]),
        ("self_attn.k_proj.weight", vec![kv_heads * head_dim, hidden]),
        ("self_attn.v_proj.weight", vec![kv_heads * head_dim, hidden]),
        ("self_attn.o_proj.weight", vec![hidden, heads * head_dim]),
        ("self_attn.q_norm.weight", vec![head_dim]),
        ("self_attn.k_norm.weight", vec![head_dim]),
        ("mlp.gate.weight", vec![experts, hidden]),
    ] {
        shapes.push((format!("{l}.{name}"), shape));
    }
    for e in 0..experts {
        for (name, shape) in [
            ("gate_proj", vec![inter, hidden]),
            ("up_proj", vec![inter, hidden]),
            ("down_proj", vec![hidden, inter]),
        ] {
            shapes.push((format!("{l}.mlp.experts.{e}.{name}.weight"), shape));
        }
    }
    let data: Vec<Vec<u8>> = shapes
        .iter()
        .enumerate()
        .map(|(i, (_, shape))| {
            let cols = *shape.last().unwrap();
            let mut v = values(shape.iter().product(), 1000 + i as u64);
            if shape.len() == 2 {
                for row in v.chunks_mut(cols).skip(2).step_by(5) {
                    row.iter_mut().for_each(|w| *w += 1.5);
                }
            }
            v.iter().flat_map(|f| f.to_le_bytes()).collect()
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = shapes
        .iter()
        .zip(&data)
        .map(|((name, shape), bytes)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .unwrap();
            (name.clone(), view)
        })
        .collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    std::fs::write(tmp.path().join("model.safetensors"), bytes).unwrap();
    tmp
}

/// The routed experts of many tokens (the grouped tensor-core kernels of
/// moe_prefill.cu for q4, q8 and bf16) against the CPU, on the
/// qwen3_5_moe fixture and on a larger synthetic layer, with one expert
/// chosen by every token (many 32-slot tiles) and tokens whose scales
/// differ by orders of magnitude. Bound (see `expert_error_bounds`): each
/// output within the first-order error of f32-like rounding of every
/// product, 1e-5 of the terms' magnitudes as in the tensor-core linear
/// test, carried through silu·up and the down projection. The same calls on experts all resident (one launch over the layer's
/// table), streamed through an empty VRAM cache (a few experts per
/// launch) and half cached (both) must agree exactly.
#[test]
fn grouped_prefill_experts_match_cpu_and_agree_however_cached() {
    let Some(resident_gpu) = cuda() else { return };
    let cpu: CpuBackend = Default::default();
    let synthetic = synthetic_moe_checkpoint();
    for quant in [DType::Q4, DType::Q8, DType::Bf16] {
        for (model, converted) in [
            ("qwen3_5_moe", convert_fixture("qwen3_5_moe", quant)),
            ("synthetic", convert_checkpoint(synthetic.path(), quant)),
        ] {
            let dir = ModelDir::open(&converted.dir, OpenOptions::default()).unwrap();
            let store = whole_store(&dir);
            let cfg = dir.config();
            let (hidden, experts, top_k) =
                (cfg.hidden_size, cfg.moe.num_experts, cfg.moe.router.top_k);
            let layer = cfg.moe_layers().next().expect("an MoE layer");
            let streamed_gpu = cuda_with(CudaOptions {
                expert_cache_bytes: Some(1),
            })
            .unwrap();
            // Half of one layer's experts: the second call finds some
            // resident and uploads the others.
            let layers = cfg.moe_layers().count() as u64;
            let half_gpu = cuda_with(CudaOptions {
                expert_cache_bytes: Some(store.total_expert_bytes() / layers / 2),
            })
            .unwrap();
            resident_gpu
                .prepare_experts(&store, &moeflux::util::NoProgress)
                .unwrap();
            assert!(
                resident_gpu.experts_resident(&store, layer),
                "{model}: every expert resident after prepare_experts"
            );
            for n in [17, 40, 130, 512] {
                let mut x = values(n * hidden, 31 * n as u64);
                x[hidden / 3] = 9.0;
                for (t, token) in x.chunks_mut(hidden).enumerate() {
                    let scale = [1.0, 1e-3, 30.0][t % 3];
                    token.iter_mut().for_each(|v| *v *= scale);
                }
                let mut logits = values(n * experts, 5 + n as u64);
                for row in logits.chunks_mut(experts) {
                    row[experts / 2] += 4.0; // chosen by (nearly) every token
                }
                let x_cpu = CpuTensor::new(n, hidden, x.clone());
                let l_cpu = CpuTensor::new(n, experts, logits.clone());
                let want = cpu
                    .routed_experts(
                        &x_cpu,
                        &cpu.route(&l_cpu, &RouterSpec::softmax(top_k, true), None)
                            .unwrap(),
                        &store,
                        layer,
                    )
                    .unwrap()
                    .data;
                let on = |gpu: &CudaBackend| {
                    let x = gpu.tensor_from_host(n, hidden, &x).unwrap();
                    let l = gpu.tensor_from_host(n, experts, &logits).unwrap();
                    let routing = gpu
                        .route(&l, &RouterSpec::softmax(top_k, true), None)
                        .unwrap();
                    gpu.to_host(&gpu.routed_experts(&x, &routing, &store, layer).unwrap())
                        .unwrap()
                };
                let got = on(&resident_gpu);
                let what = format!("grouped experts {model} {} n={n}", quant.name());
                assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite");
                let routing = cpu
                    .route(&l_cpu, &RouterSpec::softmax(top_k, true), None)
                    .unwrap();
                let bounds = expert_error_bounds(&store, layer, &x, hidden, &routing, 1e-5);
                let mut worst = 0f64;
                for ((g, w), bound) in got.iter().zip(&want).zip(&bounds) {
                    worst = worst.max((g - w).abs() as f64 / (bound + 1e-30));
                }
                println!("{what}: worst error {worst:.3} of the bound");
                assert!(worst <= 1.0, "{what}: error {worst:.3} of the bound");
                assert_eq!(on(&streamed_gpu), got, "{what}: streamed experts differ");
                let first = on(&half_gpu);
                assert_eq!(first, got, "{what}: half-cached experts differ");
                assert_eq!(on(&half_gpu), got, "{what}: half-cached experts differ");
            }
        }
    }
}

/// Per output of the routed experts, the first-order error bound when every
/// product `a·b` is computed within `relative · |a·b|` (summed over terms):
/// for `g = gate·x`, `u = up·x` the errors are `relative · Σ|gate·x|` and
/// `relative · Σ|up·x|`; `act = silu(g)·u` carries them through its
/// derivatives; the down projection adds `relative · Σ|down·act|` and
/// `Σ|down|·δact`; the routing weights scale each expert's share.
fn expert_error_bounds(
    store: &ExpertStore,
    layer: usize,
    x: &[f32],
    hidden: usize,
    routing: &moeflux::backend::cpu::Routing,
    relative: f64,
) -> Vec<f64> {
    let n = x.len() / hidden;
    let mut bounds = vec![0f64; n * hidden];
    for t in 0..n {
        let xt: Vec<f64> = x[t * hidden..(t + 1) * hidden]
            .iter()
            .map(|&v| v as f64)
            .collect();
        for k in 0..routing.top_k {
            let slot = t * routing.top_k + k;
            let expert = &store
                .fetch(layer, &[routing.experts[slot] as usize])
                .unwrap()[0];
            let weight = routing.weights[slot] as f64;
            let (gate, up, down) = (expert.gate(), expert.up(), expert.down());
            let inter = gate.layout.rows;
            let mut row = vec![0f32; hidden.max(inter)];
            let mut act = vec![0f64; inter];
            let mut act_error = vec![0f64; inter];
            for j in 0..inter {
                let mut terms = |view: &moeflux::quant::MatrixView<'_>| {
                    view.dequantize_row(j, &mut row[..hidden]);
                    let (mut sum, mut magnitude) = (0f64, 0f64);
                    for (&w, &v) in row.iter().zip(&xt) {
                        sum += w as f64 * v;
                        magnitude += (w as f64 * v).abs();
                    }
                    (sum, relative * magnitude)
                };
                let (g, g_error) = terms(&gate);
                let (u, u_error) = terms(&up);
                let sigmoid = 1.0 / (1.0 + (-g).exp());
                let silu = g * sigmoid;
                let silu_slope = sigmoid * (1.0 + g * (1.0 - sigmoid));
                act[j] = silu * u;
                act_error[j] = (silu_slope * u).abs() * g_error + silu.abs() * u_error;
            }
            for r in 0..hidden {
                down.dequantize_row(r, &mut row[..inter]);
                let mut bound = 0f64;
                for j in 0..inter {
                    let w = row[j].abs() as f64;
                    bound += relative * w * act[j].abs() + w * act_error[j];
                }
                bounds[t * hidden + r] += weight * bound;
            }
        }
    }
    bounds
}
