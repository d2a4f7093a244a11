//! Batched = alone on the CPU: several sequences of different lengths
//! going through the model together, prompts and generated tokens mixed in
//! one forward pass, give each sequence the logits and the greedy tokens it
//! gets alone (common/batch.rs; the CUDA suite runs the same check).

mod common;

use common::batch::{check_batched_equals_alone, check_device_failure_is_contained};
use common::*;
use moeflux::quant::DType;
use moeflux::{BatchItem, LogitsWanted, ModelOptions, Phase, forward_batch};

/// Bound on the relative L2 error of any row of batched logits against the
/// same sequence alone, on the CPU.
const CPU_BOUND: f64 = 1e-5;

#[test]
fn batched_sequences_equal_each_sequence_alone() {
    for name in FIXTURES {
        for quant in [DType::Bf16, DType::Q4] {
            let converted = convert_fixture(name, quant);
            let model = open(&converted.dir, ModelOptions::default());
            check_batched_equals_alone(&model, &format!("{name} {}", quant.name()), CPU_BOUND);
        }
    }
}

#[test]
fn a_batch_mixing_models_or_overflowing_a_context_is_refused_untouched() {
    let converted = convert_fixture("qwen3_moe", DType::Q8);
    let model = open(&converted.dir, ModelOptions::default());
    let other = open(&converted.dir, ModelOptions::default());
    let (mut a, mut b) = (model.session(), other.session());
    a.prefill(&[1, 2, 3]).unwrap();
    let mut items = [
        BatchItem {
            session: &mut a,
            tokens: &[4],
            wanted: LogitsWanted::Last,
            phase: Phase::Decode,
        },
        BatchItem {
            session: &mut b,
            tokens: &[4, 5],
            wanted: LogitsWanted::Last,
            phase: Phase::Prefill,
        },
    ];
    assert!(forward_batch(&mut items).is_err());
    assert_eq!((a.position(), b.position()), (3, 0));

    let mut c = model.session_with(moeflux::SessionOptions {
        context: Some(4),
        ..Default::default()
    });
    let mut items = [
        BatchItem {
            session: &mut a,
            tokens: &[4],
            wanted: LogitsWanted::Last,
            phase: Phase::Decode,
        },
        BatchItem {
            session: &mut c,
            tokens: &[1, 2, 3, 4, 5],
            wanted: LogitsWanted::Last,
            phase: Phase::Prefill,
        },
    ];
    assert!(forward_batch(&mut items).is_err());
    assert_eq!((a.position(), c.position()), (3, 0));
    assert_eq!(model.kv_bytes_in_use(), 3 * model.kv_bytes_per_position());
}

#[test]
fn a_device_failure_fails_only_its_batch_and_the_process_goes_on() {
    for name in FIXTURES {
        let converted = convert_fixture(name, DType::Q8);
        check_device_failure_is_contained(
            &converted.dir,
            moeflux::backend::cpu::CpuBackend::default,
        );
    }
}
