//! Batches the engine refuses before running anything. That sequences
//! batched equal each alone (common/batch.rs), and that a device failure
//! fails only its batch, are checked per backend by the conformance suite
//! (common/ops.rs: tests/backend_ops.rs for the CPU's kernel sets,
//! tests/cuda.rs for CUDA).

use crate::common::*;
use moeflux::quant::DType;
use moeflux::{BatchItem, LogitsWanted, ModelOptions, Phase, forward_batch};

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
