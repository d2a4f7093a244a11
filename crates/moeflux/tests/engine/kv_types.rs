//! Sessions with bf16 and q8 KV caches (and f32, the default) on the
//! fixture models: saved states, truncation, checkpoints and the KV budget
//! work for every type on a hybrid model, a full-attention one and one
//! with sliding windows; a state loads only into a session of its type;
//! multi-head latent attention keeps its latent cache in f32; sessions of
//! several types batch together as they run alone.

use std::path::Path;
use std::sync::Arc;

use crate::common::*;
use moeflux::backend::KvType;
use moeflux::quant::DType;
use moeflux::{
    BatchItem, LogitsWanted, Model, ModelOptions, Phase, Session, SessionOptions, forward_batch,
};

/// A hybrid model, a plain one, and one with sliding-window layers.
const MODELS: [&str; 3] = ["qwen3_5_moe", "qwen3_moe", "gpt_oss"];

fn open_kv(converted: &Converted, kv: Option<KvType>) -> Arc<Model> {
    open(
        &converted.dir,
        ModelOptions {
            kv_type: kv,
            ..ModelOptions::default()
        },
    )
}

fn decode_all(session: &mut Session, tokens: &[u32]) -> Vec<f32> {
    tokens
        .iter()
        .flat_map(|&t| session.decode(t).unwrap())
        .collect()
}

fn max_rel_error(got: &[f32], want: &[f32], vocab: usize) -> f64 {
    row_errors(got, want, vocab).into_iter().fold(0.0, f64::max)
}

/// Save and load continue bit for bit; truncation and a restored
/// checkpoint continue as a fresh prefill of the same tokens (1e-6, as for
/// f32: every row is rounded alone, whatever the chunk); the KV budget
/// counts the type's bytes.
#[test]
fn every_kv_type_saves_truncates_and_restores() {
    for name in MODELS {
        let converted = convert_fixture(name, DType::Q4);
        let tokens = Reference::load(name).tokens("tokens_long");
        for kv in KvType::ALL {
            let model = open_kv(&converted, Some(kv));
            assert_eq!(model.kv_type(), kv);
            let per_position = model.config().kv_bytes_per_position(kv);
            assert_eq!(model.kv_bytes_per_position(), per_position);
            let vocab = model.config().vocab_size;
            let (prefix, rest) = tokens.split_at(37);

            let mut uninterrupted = model.session();
            uninterrupted.prefill(prefix).unwrap();
            assert_eq!(
                model.kv_bytes_in_use(),
                37 * per_position,
                "{name} {kv}: KV budget"
            );
            let want = decode_all(&mut uninterrupted, rest);
            drop(uninterrupted);

            let mut first = model.session();
            first.prefill(prefix).unwrap();
            let bytes = first.save_state().unwrap();
            drop(first);
            let mut second = model.session();
            second.load_state(&bytes, Path::new("<memory>")).unwrap();
            assert_eq!(
                decode_all(&mut second, rest),
                want,
                "{name} {kv}: loaded state diverged"
            );
            drop(second);

            let fresh = |tokens: &[u32]| {
                model
                    .session()
                    .forward(tokens, LogitsWanted::All)
                    .unwrap()
                    .into_vec()
            };
            let mut session = model.session();
            session.prefill(&tokens[..20]).unwrap();
            session.checkpoint().unwrap();
            session.prefill(&tokens[20..60]).unwrap();
            session.truncate(30).unwrap();
            let got = session.forward(&tokens[60..70], LogitsWanted::All).unwrap();
            let mut whole = tokens[..30].to_vec();
            whole.extend(&tokens[60..70]);
            let err = max_rel_error(&got.data, &fresh(&whole)[30 * vocab..], vocab);
            println!("{name:<12} {kv:<4} truncate(30) + continue vs fresh prefill: {err:.2e}");
            assert!(err <= 1e-6, "{name} {kv}: truncation: {err:.3e}");

            session.restore_to(20).unwrap();
            let got = session.forward(&tokens[40..50], LogitsWanted::All).unwrap();
            let mut whole = tokens[..20].to_vec();
            whole.extend(&tokens[40..50]);
            let err = max_rel_error(&got.data, &fresh(&whole)[20 * vocab..], vocab);
            assert!(err <= 1e-6, "{name} {kv}: restored checkpoint: {err:.3e}");
        }
    }
}

/// A state names its KV type: a session of another type refuses it,
/// saying which type loads it, and stays as it was; a session of the type
/// (by the model's option or its own) loads it. A state of version 1 (no
/// type: f32) loads into f32 sessions only.
#[test]
fn a_state_loads_only_into_a_session_of_its_kv_type() {
    let converted = convert_fixture("qwen3_moe", DType::Q4);
    let tokens = Reference::load("qwen3_moe").tokens("tokens_long");
    let bf16 = open_kv(&converted, Some(KvType::Bf16));
    let mut saved = bf16.session();
    saved.prefill(&tokens[..12]).unwrap();
    let bytes = saved.save_state().unwrap();

    let q8 = open_kv(&converted, Some(KvType::Q8));
    let mut target = q8.session();
    target.prefill(&tokens[..3]).unwrap();
    expect_error(
        target.load_state(&bytes, Path::new("bf16.state")),
        &["bf16.state", "bf16 KV cache", "q8", "--kv-type bf16"],
    );
    assert_eq!(target.position(), 3, "a refused load leaves the session");
    let mut as_bf16 = q8.session_with(SessionOptions {
        kv_type: Some(KvType::Bf16),
        ..SessionOptions::default()
    });
    assert_eq!(as_bf16.kv_type(), KvType::Bf16);
    as_bf16.load_state(&bytes, Path::new("bf16.state")).unwrap();
    assert_eq!(as_bf16.tokens(), &tokens[..12]);
    assert_eq!(as_bf16.last_logits(), saved.last_logits());

    // The same state as version 1 wrote it: no type in the header.
    let f32_model = open_kv(&converted, Some(KvType::F32));
    let mut f32_session = f32_model.session();
    f32_session.prefill(&tokens[..12]).unwrap();
    let version_1 = as_version_1(&f32_session.save_state().unwrap());
    let mut loaded = f32_model.session();
    loaded
        .load_state(&version_1, Path::new("v1.state"))
        .unwrap();
    assert_eq!(loaded.last_logits(), f32_session.last_logits());
    expect_error(
        bf16.session().load_state(&version_1, Path::new("v1.state")),
        &["v1.state", "f32 KV cache", "--kv-type f32"],
    );
}

/// `state` (version 2, an f32 cache) as version 1 wrote it: version 1, no
/// KV type in the header, checksummed again.
fn as_version_1(state: &[u8]) -> Vec<u8> {
    let header_len = u32::from_le_bytes(state[20..24].try_into().unwrap()) as usize;
    let mut header: serde_json::Value =
        serde_json::from_slice(&state[24..24 + header_len]).unwrap();
    assert_eq!(header["kv_type"], "f32");
    header.as_object_mut().unwrap().remove("kv_type");
    let header = serde_json::to_vec(&header).unwrap();
    let mut out = state[..8].to_vec();
    out.extend(1u32.to_le_bytes());
    out.extend(&state[12..20]);
    out.extend((header.len() as u32).to_le_bytes());
    out.extend(&header);
    out.extend(&state[24 + header_len..state.len() - 8]);
    let checksum = xxhash_rust::xxh3::xxh3_64(&out);
    out.extend(checksum.to_le_bytes());
    out
}

/// Multi-head latent attention keeps its latent cache in f32: a model
/// asked for another type is refused at open, a session asked for one
/// when it first runs, each saying so; by default it is f32.
#[test]
fn latent_attention_keeps_its_cache_in_f32() {
    let converted = convert_fixture("deepseek_v3", DType::Q4);
    for kv in [KvType::Bf16, KvType::Q8] {
        let refused = Model::open(
            &converted.dir,
            &ModelOptions {
                kv_type: Some(kv),
                ..ModelOptions::default()
            },
        )
        .err()
        .expect("refused");
        let text = refused.to_string();
        assert!(
            text.contains("--kv-type") && text.contains("latent cache in f32"),
            "{text}"
        );
        let model = open_kv(&converted, None);
        assert_eq!(model.kv_type(), KvType::F32);
        let mut session = model.session_with(SessionOptions {
            kv_type: Some(kv),
            ..SessionOptions::default()
        });
        expect_error(session.prefill(&[1, 2, 3]), &["latent cache in f32"]);
        assert_eq!(session.position(), 0);
    }
}

/// Sessions of the three types in one batch: each sequence's logits equal
/// its own run alone (the CPU's batched bound, 1e-5 relative), and each
/// cache holds its own type's bytes in the budget.
#[test]
fn sessions_of_several_kv_types_batch_as_they_run_alone() {
    let converted = convert_fixture("gpt_oss", DType::Q4);
    let tokens = Reference::load("gpt_oss").tokens("tokens_long");
    let model = open_kv(&converted, None);
    let vocab = model.config().vocab_size;
    let session = |kv| {
        model.session_with(SessionOptions {
            kv_type: Some(kv),
            ..SessionOptions::default()
        })
    };
    let alone: Vec<Vec<f32>> = KvType::ALL
        .iter()
        .map(|&kv| {
            let mut s = session(kv);
            let mut logits = s
                .forward(&tokens[..20], LogitsWanted::All)
                .unwrap()
                .into_vec();
            logits.extend(decode_all(&mut s, &tokens[20..24]));
            logits
        })
        .collect();
    let mut sessions: Vec<Session> = KvType::ALL.iter().map(|&kv| session(kv)).collect();
    let mut together = vec![Vec::new(); sessions.len()];
    let run = |sessions: &mut [Session], part: &[u32], phase, together: &mut [Vec<f32>]| {
        let mut items: Vec<BatchItem<_>> = sessions
            .iter_mut()
            .map(|session| BatchItem {
                session,
                tokens: part,
                wanted: LogitsWanted::All,
                phase,
            })
            .collect();
        for (out, logits) in together.iter_mut().zip(forward_batch(&mut items).unwrap()) {
            out.extend_from_slice(&logits.data);
        }
    };
    run(&mut sessions, &tokens[..20], Phase::Prefill, &mut together);
    for t in 20..24 {
        run(
            &mut sessions,
            &tokens[t..t + 1],
            Phase::Decode,
            &mut together,
        );
    }
    let per_position: u64 = KvType::ALL
        .iter()
        .map(|&kv| model.config().kv_bytes_per_position(kv))
        .sum();
    assert_eq!(model.kv_bytes_in_use(), 24 * per_position);
    for ((kv, got), want) in KvType::ALL.iter().zip(&together).zip(&alone) {
        let err = max_rel_error(got, want, vocab);
        assert!(err <= 1e-5, "{kv}: batched against alone {err:.3e}");
    }
}
