//! Speculative decoding on the CPU: greedy output with drafts equals plain
//! decoding on every fixture architecture and the bundled model.

use crate::common::speculative::check_greedy_equal;
use crate::common::*;
use moeflux::quant::DType;
use moeflux::{Model, ModelOptions};

/// Logits after a rewound step against plain decoding's: the check runs
/// several tokens in one pass where decoding runs one, which the prefill
/// against decode test bounds the same way.
const TOLERANCE: f64 = 1e-4;

#[test]
fn greedy_with_drafts_equals_plain_decoding_on_every_fixture() {
    for name in FIXTURES {
        let converted = convert_fixture(name, DType::Q4);
        let model = open(&converted.dir, ModelOptions::default());
        let prompt = Reference::load(name).tokens("tokens_long");
        check_greedy_equal(name, &model, &prompt[..20], TOLERANCE);
    }
}

#[test]
fn greedy_with_drafts_equals_plain_decoding_on_the_bundled_model() {
    let (dir, prompt) = bundled_prompt();
    let model = std::sync::Arc::new(Model::open(&dir, &ModelOptions::default()).unwrap());
    check_greedy_equal("bundled", &model, &prompt, TOLERANCE);
    // Checks longer than a prefill chunk run in several passes: rewound
    // from a copy of the Gated DeltaNet states instead of their steps.
    let chunked = ModelOptions {
        prefill_chunk: Some(2),
        ..ModelOptions::default()
    };
    let model = std::sync::Arc::new(Model::open(&dir, &chunked).unwrap());
    check_greedy_equal("bundled, chunks of 2", &model, &prompt, TOLERANCE);
}
