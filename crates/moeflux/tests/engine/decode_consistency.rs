//! The engine against itself: prefill against token-by-token decode, and a
//! one-expert-per-layer cache against an unbounded one.

use crate::common::*;
use moeflux::backend::KvType;
use moeflux::backend::cpu::{Activations, CpuBackend, CpuOptions};
use moeflux::quant::DType;
use moeflux::{LogitsWanted, Model, ModelOptions};

#[test]
fn prefill_logits_equal_token_by_token_decode() {
    for name in FIXTURES {
        let converted = convert_fixture(name, DType::Q4);
        let reference = Reference::load(name);
        for activations in [Activations::F32, Activations::Int8] {
            let cpu = CpuBackend::with_options(CpuOptions {
                activations,
                ..CpuOptions::default()
            });
            let model = std::sync::Arc::new(
                Model::open_with(cpu, &converted.dir, &ModelOptions::default()).unwrap(),
            );
            let tokens = reference.tokens("tokens_long");
            let prefill = model.session().forward(&tokens, LogitsWanted::All).unwrap();
            let mut session = model.session();
            let mut decoded = Vec::with_capacity(prefill.data.len());
            for &t in &tokens {
                decoded.extend(session.decode(t).unwrap());
            }
            assert_eq!(session.position(), tokens.len());
            let errors = row_errors(&decoded, &prefill.data, prefill.vocab);
            let max = errors.iter().copied().fold(0.0, f64::max);
            println!(
                "{name:<22} {activations:?} activations, prefill vs decode over {} tokens: max rel err {max:.2e}",
                tokens.len()
            );
            assert!(
                max <= 1e-4,
                "{name} ({activations:?}): prefill and decode differ by {max:.3e}"
            );
        }
    }
}

/// Every KV type: prefill and token-by-token decode round each row of keys
/// and values alone, the same way, so they agree as the f32 cache does
/// (the same 1e-4 bound; measured 0). Multi-head latent attention keeps
/// f32 and refuses the others.
#[test]
fn prefill_logits_equal_token_by_token_decode_for_every_kv_type() {
    for name in FIXTURES {
        let converted = convert_fixture(name, DType::Q4);
        let tokens = Reference::load(name).tokens("tokens_long");
        for kv in [KvType::Bf16, KvType::Q8] {
            let options = ModelOptions {
                kv_type: Some(kv),
                ..ModelOptions::default()
            };
            let Ok(model) = Model::open(&converted.dir, &options) else {
                assert!(
                    name.starts_with("deepseek"),
                    "{name} refused a {kv} KV cache"
                );
                continue;
            };
            let model = std::sync::Arc::new(model);
            let prefill = model.session().forward(&tokens, LogitsWanted::All).unwrap();
            let mut session = model.session();
            let decoded: Vec<f32> = tokens
                .iter()
                .flat_map(|&t| session.decode(t).unwrap())
                .collect();
            let errors = row_errors(&decoded, &prefill.data, prefill.vocab);
            let max = errors.iter().copied().fold(0.0, f64::max);
            println!(
                "{name:<22} {kv} KV cache, prefill vs decode over {} tokens: max rel err {max:.2e}",
                tokens.len()
            );
            assert!(
                max <= 1e-4,
                "{name} ({kv}): prefill and decode differ by {max:.3e}"
            );
        }
    }
}

#[test]
fn one_cached_expert_per_layer_gives_identical_results() {
    for name in FIXTURES {
        let converted = convert_fixture(name, DType::Q4);
        let reference = Reference::load(name);
        let tokens = reference.tokens("tokens_long");
        let unbounded = open(
            &converted.dir,
            ModelOptions {
                expert_cache_bytes: Some(u64::MAX),
                ..Default::default()
            },
        );
        let manifest = unbounded.dir().manifest();
        let one_per_layer = manifest.experts[0].blob.nbytes * manifest.experts.len() as u64;
        let tiny = open(
            &converted.dir,
            ModelOptions {
                expert_cache_bytes: Some(one_per_layer),
                ..Default::default()
            },
        );
        let run = |model: &std::sync::Arc<moeflux::Model>| {
            let mut session = model.session();
            let mut logits = session
                .forward(&tokens, LogitsWanted::All)
                .unwrap()
                .into_vec();
            for t in tokens.iter().take(8) {
                logits.extend(session.decode(*t).unwrap());
            }
            logits
        };
        assert_eq!(
            run(&tiny),
            run(&unbounded),
            "{name}: a small cache changed the results"
        );
        let (small, big) = (tiny.expert_stats(), unbounded.expert_stats());
        println!(
            "{name:<22} cache of one expert per layer: {} misses vs {} unbounded",
            small.misses, big.misses
        );
        assert!(
            small.misses > big.misses,
            "{name}: the small cache should have evicted experts"
        );
    }
}

/// moeflux's spinning workers and rayon's compute the same logits, bit for
/// bit, for prefill and decode, on more threads than tasks in some regions
/// and fewer in others.
#[test]
fn cpu_worker_pool_gives_identical_logits() {
    for name in FIXTURES {
        let converted = convert_fixture(name, DType::Q4);
        let tokens = Reference::load(name).tokens("tokens_long");
        for activations in [Activations::F32, Activations::Int8] {
            let run = |pool: bool, threads: usize| {
                let cpu = CpuBackend::with_options(CpuOptions { activations, pool });
                let model = std::sync::Arc::new(
                    Model::open_with(cpu, &converted.dir, &ModelOptions::default()).unwrap(),
                );
                let threads = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                threads.install(|| {
                    let mut session = model.session();
                    let mut logits = session
                        .forward(&tokens, LogitsWanted::All)
                        .unwrap()
                        .into_vec();
                    for &t in tokens.iter().take(6) {
                        logits.extend(session.decode(t).unwrap());
                    }
                    logits
                })
            };
            let rayon = run(false, 4);
            for threads in [2, 4] {
                assert!(
                    run(true, threads) == rayon,
                    "{name} ({activations:?}): the worker pool on {threads} threads changed the logits"
                );
            }
        }
    }
}
