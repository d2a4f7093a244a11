//! The bundled trained model (bundled/qwen35-tiny) against the numbers its
//! training script recorded with PyTorch: held-out perplexity over the
//! same windows, and the tokenizer producing the same ids.

use std::path::PathBuf;

use crate::common::*;
use moeflux::ModelOptions;
use moeflux::perplexity::perplexity;
use moeflux::quant::DType;
use moeflux::text::Tokenizer;
use moeflux::util::NoProgress;

fn bundled() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bundled/qwen35-tiny")
}

fn reference() -> serde_json::Value {
    let text = std::fs::read_to_string(bundled().join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn heldout_perplexity_matches_pytorch() {
    let reference = reference();
    let r = &reference["perplexity"];
    let ctx = r["ctx"].as_u64().unwrap() as usize;
    let text = std::fs::read_to_string(bundled().join("heldout.txt")).unwrap();
    let tokens = Tokenizer::from_dir(&bundled())
        .unwrap()
        .encode(&text, false)
        .unwrap();
    assert_eq!(tokens.len() as u64, r["n_tokens"].as_u64().unwrap());
    let want = r["bfloat16_weights"]["ppl"].as_f64().unwrap();
    for (quant, tolerance) in [(DType::Bf16, 0.01), (DType::Q8, 0.01), (DType::Q4, 0.05)] {
        let converted = convert_checkpoint(&bundled(), quant);
        let model = open(&converted.dir, ModelOptions::default());
        let got = perplexity(&model, &tokens, ctx, &NoProgress).unwrap();
        assert_eq!(
            got.scored_tokens as u64,
            r["scored_tokens"].as_u64().unwrap()
        );
        let rel = (got.ppl - want).abs() / want;
        println!(
            "bundled {:<4} perplexity {:.4} vs PyTorch {want:.4} (bf16 weights): {:+.3}%",
            quant.name(),
            got.ppl,
            100.0 * (got.ppl - want) / want
        );
        assert!(
            rel <= tolerance,
            "{}: perplexity {} vs {want} ({:.3}%)",
            quant.name(),
            got.ppl,
            100.0 * rel
        );
    }
}
