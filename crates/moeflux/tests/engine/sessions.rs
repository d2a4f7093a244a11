//! Sessions on the fixture models: state save/load, checkpoints, truncation,
//! concurrent sessions, and the errors around them. Each property is
//! checked on a hybrid model (Gated DeltaNet + attention), a full-attention
//! one, one with sliding-window layers (whose caches have let go of the
//! oldest positions) and one of multi-head latent attention (a latent cache
//! without values), since their states rewind differently.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::{Arc, Barrier};

use crate::common::*;
use moeflux::quant::DType;
use moeflux::{LogitsWanted, Model, ModelOptions, Session, SessionOptions};

/// A hybrid model, a plain one, one with sliding-window layers, and one of
/// multi-head latent attention (whose cache holds latents and no values).
const MODELS: [&str; 4] = ["qwen3_5_moe", "qwen3_moe", "gpt_oss", "deepseek_v3"];

fn model(name: &str) -> (Converted, Arc<Model>, Vec<u32>) {
    let converted = convert_fixture(name, DType::Q4);
    let model = open(&converted.dir, ModelOptions::default());
    let tokens = Reference::load(name).tokens("tokens_long");
    (converted, model, tokens)
}

/// Logits of every position of `tokens` in a fresh session.
fn fresh(model: &Arc<Model>, tokens: &[u32]) -> Vec<f32> {
    model
        .session()
        .forward(tokens, LogitsWanted::All)
        .unwrap()
        .into_vec()
}

fn max_rel_error(got: &[f32], want: &[f32], vocab: usize) -> f64 {
    row_errors(got, want, vocab).into_iter().fold(0.0, f64::max)
}

/// Feeds `tokens` one at a time, collecting each step's logits.
fn decode_all(session: &mut Session, tokens: &[u32]) -> Vec<f32> {
    tokens
        .iter()
        .flat_map(|&t| session.decode(t).unwrap())
        .collect()
}

#[test]
fn saved_and_loaded_state_continues_identically() {
    for name in MODELS {
        let (_c, model, tokens) = model(name);
        let (prefix, rest) = tokens.split_at(37);
        let mut uninterrupted = model.session();
        uninterrupted.prefill(prefix).unwrap();
        let want = decode_all(&mut uninterrupted, rest);

        let mut first = model.session();
        first.prefill(prefix).unwrap();
        let bytes = first.save_state().unwrap();
        drop(first);
        let mut second = model.session();
        second.load_state(&bytes, Path::new("<memory>")).unwrap();
        assert_eq!(second.position(), prefix.len());
        assert_eq!(second.tokens(), prefix);
        assert_eq!(
            decode_all(&mut second, rest),
            want,
            "{name}: loaded state diverged"
        );
    }
}

#[test]
fn restore_to_checkpoint_then_continue_equals_fresh_prefill() {
    for name in MODELS {
        let (_c, model, tokens) = model(name);
        let vocab = model.config().vocab_size;
        let mut session = model.session();
        session.prefill(&tokens[..20]).unwrap();
        assert_eq!(session.checkpoint().unwrap(), 20);
        session.prefill(&tokens[20..50]).unwrap();
        session.checkpoint().unwrap();
        session.prefill(&tokens[50..60]).unwrap();

        session.restore_to(20).unwrap();
        assert_eq!(session.position(), 20);
        assert_eq!(
            session.checkpoints(),
            vec![20],
            "{name}: checkpoints after 20 must go"
        );
        // Continue with a different suffix than the one dropped.
        let suffix: Vec<u32> = tokens[60..80].to_vec();
        let got = session
            .forward(&suffix, LogitsWanted::All)
            .unwrap()
            .into_vec();
        let mut whole = tokens[..20].to_vec();
        whole.extend(&suffix);
        let want = fresh(&model, &whole);
        let err = max_rel_error(&got, &want[20 * vocab..], vocab);
        println!("{name:<12} restore_to(20) + continue vs fresh prefill: max rel err {err:.2e}");
        assert!(err <= 1e-6, "{name}: {err:.3e}");

        session.restore_to(0).unwrap();
        assert_eq!(session.position(), 0);
        assert!(session.checkpoints().is_empty());
    }
}

/// A sliding window's cache has let go of what earlier positions saw:
/// only a checkpoint (or the empty state) can be restored; the error says
/// that truncate rebuilds instead.
#[test]
fn sliding_window_models_restore_only_checkpoints() {
    let (_c, model, tokens) = model("gpt_oss");
    let mut session = model.session();
    session.prefill(&tokens[..30]).unwrap();
    expect_error(
        session.restore_to(20),
        &["no checkpoint at position 20", "truncate(20)"],
    );
    assert_eq!(
        session.position(),
        30,
        "a refused restore leaves the session"
    );
    session.truncate(20).unwrap();
    assert_eq!(session.position(), 20);
}

#[test]
fn truncate_then_continue_equals_fresh_prefill() {
    for name in MODELS {
        let (_c, model, tokens) = model(name);
        let vocab = model.config().vocab_size;
        for checkpoint_at in [None, Some(16)] {
            let mut session = model.session();
            session.prefill(&tokens[..16]).unwrap();
            if checkpoint_at.is_some() {
                session.checkpoint().unwrap();
            }
            session.prefill(&tokens[16..70]).unwrap();
            session.truncate(41).unwrap();
            assert_eq!(session.position(), 41);
            assert_eq!(session.tokens(), &tokens[..41]);
            let suffix = &tokens[70..80];
            let got = session
                .forward(suffix, LogitsWanted::All)
                .unwrap()
                .into_vec();
            let mut whole = tokens[..41].to_vec();
            whole.extend(suffix);
            let want = fresh(&model, &whole);
            let err = max_rel_error(&got, &want[41 * vocab..], vocab);
            println!(
                "{name:<12} truncate(41) (checkpoint {checkpoint_at:?}) + continue vs fresh: max rel err {err:.2e}"
            );
            assert!(err <= 1e-6, "{name}: {err:.3e}");
        }
    }
}

#[test]
fn generation_after_exact_truncation_recovers_the_logits() {
    let (_c, model, tokens) = model("qwen3_moe");
    let mut session = model.session();
    session.prefill(&tokens[..30]).unwrap();
    session.truncate(12).unwrap();
    let greedy = |l: &[f32], _: &[u32], _: &[u32]| Ok(moeflux::model::argmax(l));
    let got = session
        .generate(5, greedy, |_| Ok(ControlFlow::Continue(())))
        .unwrap();
    let mut fresh = model.session();
    fresh.prefill(&tokens[..12]).unwrap();
    let want = fresh
        .generate(5, greedy, |_| Ok(ControlFlow::Continue(())))
        .unwrap();
    assert_eq!(got, want);
    assert_eq!(session.position(), 17);
}

#[test]
fn checkpoints_are_capped_keeping_the_newest() {
    let (_c, model, tokens) = model("qwen3_5_moe");
    let options = SessionOptions {
        max_checkpoints: 2,
        ..Default::default()
    };
    let mut session = Session::new(model.clone(), options);
    for end in [5, 10, 15] {
        session.prefill(&tokens[session.position()..end]).unwrap();
        session.checkpoint().unwrap();
    }
    assert_eq!(
        session.checkpoints(),
        vec![10, 15],
        "the least recently used goes"
    );
    assert!(session.forget(10));
    assert!(!session.forget(10));
    let err = session.restore_to(10).unwrap_err().to_string();
    assert!(err.contains("no checkpoint at position 10"), "{err}");
    session.restore_to(15).unwrap();
    session.restore_to(0).unwrap();
}

#[test]
fn sessions_interleaved_on_threads_match_running_alone() {
    let (_c, model, tokens) = model("qwen3_5_moe");
    let prompts: Vec<&[u32]> = vec![&tokens[..9], &tokens[30..41], &tokens[50..53]];
    let continuations: Vec<&[u32]> = vec![&tokens[9..25], &tokens[41..57], &tokens[53..69]];
    let alone: Vec<Vec<f32>> = prompts
        .iter()
        .zip(&continuations)
        .map(|(p, c)| {
            let mut s = model.session();
            s.prefill(p).unwrap();
            decode_all(&mut s, c)
        })
        .collect();
    let barrier = Barrier::new(prompts.len());
    let together: Vec<Vec<f32>> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .zip(&continuations)
            .map(|(p, c)| {
                let (model, barrier) = (&model, &barrier);
                scope.spawn(move || {
                    let mut s = model.session();
                    s.prefill(p).unwrap();
                    let mut out = Vec::new();
                    for &t in c.iter() {
                        barrier.wait(); // every thread takes one step per round
                        out.extend(s.decode(t).unwrap());
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, alone);
}

#[test]
fn corrupt_state_is_refused() {
    let (_c, model, tokens) = model("qwen3_5_moe");
    let mut s = model.session();
    s.prefill(&tokens[..10]).unwrap();
    let mut bytes = s.save_state().unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    let mut target = model.session();
    target.prefill(&tokens[..3]).unwrap();
    expect_error(
        target.load_state(&bytes, Path::new("state.bin")),
        &["state.bin", "checksum mismatch"],
    );
    assert_eq!(
        target.position(),
        3,
        "a refused load leaves the session as it was"
    );
}

#[test]
fn truncated_state_is_refused() {
    let (_c, model, tokens) = model("qwen3_moe");
    let mut s = model.session();
    s.prefill(&tokens[..10]).unwrap();
    let bytes = s.save_state().unwrap();
    let mut target = model.session();
    expect_error(
        target.load_state(&bytes[..bytes.len() - 100], Path::new("state.bin")),
        &["state.bin", "truncated"],
    );
    expect_error(
        target.load_state(&bytes[..20], Path::new("state.bin")),
        &["not a moeflux session state"],
    );
}

#[test]
fn state_of_another_model_is_refused() {
    let (_c, model, tokens) = model("qwen3_5_moe");
    let (_c2, other, _) = model_pair_other();
    let mut s = other.session();
    s.prefill(&tokens[..5]).unwrap();
    let bytes = s.save_state().unwrap();
    expect_error(
        model.session().load_state(&bytes, Path::new("other.state")),
        &["other.state", "different model"],
    );
}

/// The same architecture converted at another precision: same shapes,
/// different weights.
fn model_pair_other() -> (Converted, Arc<Model>, ()) {
    let converted = convert_fixture("qwen3_5_moe", DType::Q8);
    let model = open(&converted.dir, ModelOptions::default());
    (converted, model, ())
}

#[test]
fn position_beyond_the_context_is_an_error() {
    let (_c, model, tokens) = model("qwen3_5_moe");
    let mut s = Session::new(
        model.clone(),
        SessionOptions {
            context: Some(12),
            ..Default::default()
        },
    );
    assert_eq!(s.capacity(), 12);
    s.prefill(&tokens[..10]).unwrap();
    expect_error(
        s.prefill(&tokens[10..13]),
        &["exceed the session's context of 12"],
    );
    assert_eq!(s.position(), 10, "a refused prefill changes nothing");
    s.prefill(&tokens[10..12]).unwrap();
    expect_error(s.decode(1), &["context of 12"]);
    expect_error(s.truncate(13), &["beyond the session's 12 tokens"]);
}

#[test]
fn kv_limit_is_enforced_across_sessions() {
    let converted = convert_fixture("qwen3_moe", DType::Q4);
    let cfg_tokens = Reference::load("qwen3_moe").tokens("tokens_long");
    // qwen3_moe fixture: 4 attention layers x 2 (k, v) x 64 floats x 4 bytes.
    let per_position = 4 * 2 * 64 * 4;
    let model = open(
        &converted.dir,
        ModelOptions {
            kv_limit_bytes: Some(30 * per_position),
            ..Default::default()
        },
    );
    let mut a = model.session();
    a.prefill(&cfg_tokens[..20]).unwrap();
    let mut b = model.session();
    b.prefill(&cfg_tokens[..10]).unwrap();
    assert_eq!(model.kv_bytes_in_use(), 30 * per_position);
    expect_error(b.decode(1), &["KV cache limit", "exceed the limit"]);
    assert_eq!(b.position(), 10);
    a.truncate(5).unwrap();
    b.decode(1).unwrap();
    drop(a);
    assert_eq!(model.kv_bytes_in_use(), 11 * per_position);
}

#[test]
fn a_failed_forward_leaves_a_consistent_session() {
    for name in MODELS {
        let converted = convert_fixture(name, DType::Q4);
        // No expert cache: every expert is read from disk when routed.
        let model = open(
            &converted.dir,
            ModelOptions {
                expert_cache_bytes: Some(0),
                ..Default::default()
            },
        );
        let tokens = Reference::load(name).tokens("tokens_long");
        let vocab = model.config().vocab_size;
        let mut session = model.session();
        session.prefill(&tokens[..10]).unwrap();
        session.checkpoint().unwrap();

        let file = converted.dir.join("experts/layer_003.bin");
        let original = std::fs::read(&file).unwrap();
        let mut damaged = original.clone();
        damaged.iter_mut().step_by(4096).for_each(|b| *b ^= 0xff);
        std::fs::write(&file, &damaged).unwrap();
        expect_error(
            session.prefill(&tokens[10..30]),
            &["checksum mismatch", "of layer 3"],
        );
        assert_eq!(
            session.position(),
            10,
            "{name}: rolled back to before the call"
        );
        assert_eq!(session.tokens(), &tokens[..10]);

        std::fs::write(&file, &original).unwrap();
        let got = session
            .forward(&tokens[10..30], LogitsWanted::All)
            .unwrap()
            .into_vec();
        let want = fresh(&model, &tokens[..30]);
        assert_eq!(
            got,
            want[10 * vocab..],
            "{name}: the session continues as if nothing failed"
        );
    }
}
