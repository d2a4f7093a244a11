//! The multi-token-prediction head on the CPU: conversion keeps it, its
//! logits match the PyTorch reference of tools/mtp_reference.py (vLLM's
//! math) on the fixtures that have one, its state follows the session
//! through checks, rewinds and truncations, and greedy decoding with its
//! drafts equals plain decoding.

use std::ops::ControlFlow;

use crate::common::speculative::{
    Oracle, check_greedy_equal_with_mtp, drafted, fresh_mtp_row, mtp_reference_error, mtp_session,
    plain,
};
use crate::common::*;
use moeflux::backend::Backend;
use moeflux::backend::cpu::CpuBackend;
use moeflux::format::Manifest;
use moeflux::model::argmax;
use moeflux::model::forward_batch;
use moeflux::quant::DType;
use moeflux::speculative::{DraftLength, DraftSource, Drafter, MtpDrafter, Speculation, generate};
use moeflux::{BatchItem, LogitsWanted, ModelOptions, Phase, Result, Session};

/// bf16 weights against the float32 reference: only summation order
/// differs, as in tests/transformers_parity.rs.
const REFERENCE_TOLERANCE: f64 = 1e-3;
/// The head run row by row as a session grows against one run over every
/// row: the prefill = decode bound of tests/engine/decode_consistency.rs.
const INCREMENTAL_TOLERANCE: f64 = 1e-4;

#[test]
fn mtp_head_matches_the_reference() {
    for name in MTP_FIXTURES {
        let converted = convert_fixture(name, DType::Bf16);
        for chunk in [64, 7] {
            let options = ModelOptions {
                prefill_chunk: Some(chunk),
                ..ModelOptions::default()
            };
            let worst = mtp_reference_error(name, &open(&converted.dir, options));
            println!("{name} (chunk {chunk}): MTP logits within {worst:.2e} of the reference");
            assert!(
                worst <= REFERENCE_TOLERANCE,
                "{name} (chunk {chunk}): MTP logits differ from the reference by {worst:.3e}"
            );
        }
    }
}

/// The expert store holds the head's experts after the decoder's, and
/// the decoder's next MoE layer after its last is none: work that
/// anticipates the next layer (a GPU's uploads ahead) never reaches for
/// the head, which runs only when drafting.
#[test]
fn the_next_decoder_moe_layer_skips_the_mtp_head() {
    for name in MTP_FIXTURES {
        let converted = convert_fixture(name, DType::Bf16);
        let model = open(&converted.dir, ModelOptions::default());
        let (cfg, store) = (model.config(), model.experts());
        let head = cfg.mtp_layer().expect("an MTP fixture");
        let decoder: Vec<usize> = cfg.moe_layers().collect();
        let stored: Vec<usize> = store.moe_layers().collect();
        assert_eq!(
            stored.last(),
            Some(&head),
            "{name}: the head's experts are stored last"
        );
        for pair in decoder.windows(2) {
            assert_eq!(
                store.next_decoder_moe_layer(pair[0]),
                Some(pair[1]),
                "{name}"
            );
        }
        let last = *decoder.last().expect("a decoder MoE layer");
        assert_eq!(
            store.next_decoder_moe_layer(last),
            None,
            "{name}: after {last}"
        );
        assert_eq!(
            store.next_decoder_moe_layer(head),
            None,
            "{name}: after the head"
        );
    }
}

/// Drafts `oracle`'s tokens while checking, at every step, that the MTP
/// drafter following the session (through the checks, rewinds and
/// truncations) gives the logits of a new drafter that runs every row.
struct Followed {
    inner: MtpDrafter<CpuBackend>,
    oracle: Oracle,
    checks: usize,
    worst: f64,
}

impl Drafter<CpuBackend> for Followed {
    fn draft(&mut self, session: &Session, next: u32, k: usize) -> Result<Vec<u32>> {
        let got = self.inner.draft_logits(session, next, 1)?;
        let want = fresh_mtp_row(session, next);
        self.worst = self.worst.max(row_errors(&got.data, &want, want.len())[0]);
        self.checks += 1;
        Drafter::draft(&mut self.oracle, session, next, k)
    }

    fn prepare(&mut self, session: &mut Session) {
        self.inner.prepare(session);
    }
}

#[test]
fn mtp_state_follows_the_session() {
    for name in MTP_FIXTURES {
        let converted = convert_fixture(name, DType::Q4);
        let model = open(&converted.dir, ModelOptions::default());
        let prompt = &Reference::load(name).tokens("tokens_long")[..20];
        let (truth, _) = plain(&model, prompt, 24);
        let vocab = model.config().vocab_size as u32;
        for k in 1..=4 {
            for wrong in [|_| false, |i| i % 3 == 0] as [fn(usize) -> bool; 2] {
                let mut followed = Followed {
                    inner: MtpDrafter::new(&model).unwrap(),
                    oracle: Oracle {
                        truth: truth.clone(),
                        vocab,
                        wrong,
                    },
                    checks: 0,
                    worst: 0.0,
                };
                let (got, _, accepted) = drafted(
                    &model,
                    prompt,
                    24,
                    &mut followed,
                    DraftLength::Fixed(k),
                    None,
                );
                assert_eq!(got, truth, "{name}: k = {k}");
                assert!(accepted > 0 && followed.checks > 0, "{name}: k = {k}");
                assert!(
                    followed.worst <= INCREMENTAL_TOLERANCE,
                    "{name}: k = {k}: the followed head is {:.3e} from a new one",
                    followed.worst
                );
            }
        }
        // Back to an earlier position and on with other tokens: the head
        // drops what no longer holds.
        let mut session = mtp_session(&model, prompt);
        let mut drafter = MtpDrafter::new(&model).unwrap();
        session
            .generate(
                8,
                |l, _, _| Ok(argmax(l)),
                |_| Ok(ControlFlow::Continue(())),
            )
            .unwrap();
        drafter.draft_logits(&session, 1, 3).unwrap();
        session.truncate(prompt.len() + 3).unwrap();
        session.prefill(&[5, 6, 7]).unwrap();
        let got = drafter.draft_logits(&session, 9, 1).unwrap();
        let want = fresh_mtp_row(&session, 9);
        let err = row_errors(&got.data, &want, want.len())[0];
        assert!(
            err <= INCREMENTAL_TOLERANCE,
            "{name}: after a truncation: {err:.3e}"
        );
    }
}

#[test]
fn greedy_with_mtp_drafts_equals_plain_decoding() {
    for name in MTP_FIXTURES {
        let converted = convert_fixture(name, DType::Q4);
        let model = open(&converted.dir, ModelOptions::default());
        let prompt = &Reference::load(name).tokens("tokens_long")[..20];
        check_greedy_equal_with_mtp(name, &model, prompt, INCREMENTAL_TOLERANCE);
        let (want, _) = plain(&model, prompt, 24);
        // A session that did not keep its prompt's hidden states: the head
        // drafts from the positions after it.
        let mut session = model.session();
        session.prefill(prompt).unwrap();
        let mut drafter = MtpDrafter::new(&model).unwrap();
        let mut speculation = Speculation::new(&mut drafter, DraftLength::Fixed(2));
        let got = generate(
            &mut session,
            &mut speculation,
            24,
            |l, _, _, _| Ok(argmax(l)),
            |_| Ok(ControlFlow::Continue(())),
        )
        .unwrap();
        assert_eq!(
            &want[prompt.len()..],
            got.as_slice(),
            "{name}: late hidden states"
        );
        assert!(speculation.stats.drafted > 0, "{name}: nothing drafted");
    }
}

/// The hidden states a session keeps, on the host.
fn hidden_of(session: &Session, positions: std::ops::Range<usize>) -> Vec<f32> {
    let rows = session.hidden_states(positions).unwrap().expect("kept");
    session.model().backend().to_host(&rows).unwrap()
}

#[test]
fn sessions_keep_the_hidden_states_of_their_own_tokens() {
    let converted = convert_fixture("qwen3_5_moe", DType::Q4);
    let model = open(
        &converted.dir,
        ModelOptions {
            prefill_chunk: Some(5),
            ..ModelOptions::default()
        },
    );
    let tokens = Reference::load("qwen3_5_moe").tokens("tokens_long");
    let prompts = [&tokens[..3], &tokens[10..27], &tokens[40..48]];
    let alone: Vec<Vec<f32>> = prompts
        .iter()
        .map(|p| hidden_of(&mtp_session(&model, p), 0..p.len()))
        .collect();
    // Batched, a prompt and decode tokens mixed, then each a token more.
    let mut sessions: Vec<Session> = prompts
        .iter()
        .map(|_| {
            let mut s = model.session();
            s.keep_hidden_states(true);
            s
        })
        .collect();
    sessions[0].prefill(prompts[0]).unwrap();
    {
        let mut items: Vec<BatchItem<'_, CpuBackend>> = sessions
            .iter_mut()
            .zip(prompts)
            .enumerate()
            .map(|(i, (session, p))| BatchItem {
                session,
                tokens: if i == 0 { &[7] } else { p },
                wanted: LogitsWanted::Last,
                phase: if i == 0 {
                    Phase::Decode
                } else {
                    Phase::Prefill
                },
            })
            .collect();
        forward_batch(&mut items).unwrap();
    }
    for (i, (session, want)) in sessions.iter().zip(&alone).enumerate() {
        let got = hidden_of(session, 0..prompts[i].len());
        let err = row_errors(&got, want, 64).into_iter().fold(0.0, f64::max);
        assert!(
            err <= 1e-5,
            "sequence {i}: hidden states {err:.3e} from alone"
        );
    }
    // Kept across parts and cut with the session.
    let mut session = mtp_session(&model, &tokens[..30]);
    for &t in &tokens[30..36] {
        session.decode(t).unwrap();
    }
    let whole = hidden_of(&session, 0..36);
    assert_eq!(hidden_of(&session, 12..33), whole[12 * 64..33 * 64]);
    session.truncate(20).unwrap();
    assert!(session.hidden_states(0..21).unwrap().is_none());
    assert_eq!(hidden_of(&session, 0..20), whole[..20 * 64]);
    session.keep_hidden_states(false);
    assert!(session.hidden_states(0..1).unwrap().is_none());
}

#[test]
fn conversion_keeps_the_mtp_head_only_where_config_names_it() {
    let h = 64;
    for (name, fc) in [
        ("qwen3_5_moe", "mtp.fc.weight"),
        ("deepseek_v3", "model.layers.4.eh_proj.weight"),
    ] {
        let converted = convert_fixture(name, DType::Bf16);
        let manifest = Manifest::read(&converted.dir.join("manifest.json")).unwrap();
        assert_eq!(manifest.version, 2, "{name}: a compatible addition");
        let layer = manifest.experts.last().unwrap();
        assert_eq!(
            layer.layer, 4,
            "{name}: the head's experts after the decoder's"
        );
        assert_eq!(layer.file, "experts/layer_004.bin");
        // fc split per input, bit for bit.
        let source = read_bf16(name, fc);
        let model = open(&converted.dir, ModelOptions::default());
        let dense = |t: &str| {
            let e = &manifest.tensors[t];
            assert_eq!(
                (e.shape.as_slice(), e.dtype),
                (&[h, h][..], DType::Bf16),
                "{t}"
            );
            let bytes = std::fs::read(converted.dir.join(&e.file)).unwrap();
            bytes[e.offset as usize..(e.offset + e.nbytes) as usize].to_vec()
        };
        for (canon, start) in [("mtp.fc_embed", 0), ("mtp.fc_hidden", h)] {
            let want: Vec<u8> = source
                .chunks_exact(2 * h * 2)
                .flat_map(|row| row[start * 2..(start + h) * 2].to_vec())
                .collect();
            assert_eq!(dense(canon), want, "{name}: {canon}");
        }
        assert!(model.has_mtp());
        assert!(model.experts().moe_layers().any(|l| l == 4));
        // Opened without it: no head, its experts not in the store.
        let without = open(
            &converted.dir,
            ModelOptions {
                mtp_head: false,
                ..ModelOptions::default()
            },
        );
        assert!(!without.has_mtp() && without.config().mtp.is_none());
        assert!(without.experts().moe_layers().all(|l| l < 4), "{name}");
        // The same checkpoint whose config.json names no MTP layer: the
        // model converts without it, the head's tensors skipped.
        let tmp = tempfile::tempdir().unwrap();
        let hf = tmp.path().join("hf");
        std::fs::create_dir(&hf).unwrap();
        for f in ["config.json", "model.safetensors", "generation_config.json"] {
            let from = fixtures_root().join(name).join("hf").join(f);
            if from.exists() {
                std::fs::copy(from, hf.join(f)).unwrap();
            }
        }
        let config_path = hf.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
        for key in ["mtp_num_hidden_layers", "num_nextn_predict_layers"] {
            if config.get(key).is_some() {
                config[key] = 0.into();
            }
        }
        std::fs::write(&config_path, config.to_string()).unwrap();
        let plain = convert_checkpoint(&hf, DType::Bf16);
        let manifest = Manifest::read(&plain.dir.join("manifest.json")).unwrap();
        assert!(
            !manifest.tensors.keys().any(|t| t.starts_with("mtp.")),
            "{name}"
        );
        assert!(manifest.experts.iter().all(|e| e.layer < 4), "{name}");
        let model = open(&plain.dir, ModelOptions::default());
        assert!(!model.has_mtp(), "{name}");
        let err = DraftSource::Mtp.drafter(&*model).err().expect("no head");
        let message = err.to_string();
        assert!(
            message.contains("no multi-token-prediction head")
                && message.contains("--draft lookup"),
            "{message}"
        );
    }
}

/// The raw bf16 bytes of a checkpoint tensor of fixture `name`.
fn read_bf16(name: &str, tensor: &str) -> Vec<u8> {
    let bytes = std::fs::read(fixtures_root().join(name).join("hf/model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(tensor).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::BF16);
    t.data().to_vec()
}

/// The bundled model's trained head: greedy with its drafts equals plain
/// decoding, and greedy generation keeps at least half as many first
/// drafts as the share its training measured on held-out text
/// (`reference.json`'s `mtp.acceptance.first_draft_kept`).
#[test]
fn bundled_model_drafts_with_its_trained_head() {
    let (dir, prompt) = bundled_prompt();
    let model = open(&dir, ModelOptions::default());
    assert!(model.has_mtp(), "the bundled model has no MTP head");
    check_greedy_equal_with_mtp("bundled", &model, &prompt, INCREMENTAL_TOLERANCE);
    let reference: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixtures_root().join("../bundled/qwen35-tiny/reference.json")).unwrap(),
    )
    .unwrap();
    let measured = reference["mtp"]["acceptance"]["first_draft_kept"]
        .as_f64()
        .expect("reference.json records the head's acceptance");
    let mut drafter = MtpDrafter::new(&model).unwrap();
    let mut session = mtp_session(&model, &prompt);
    let mut speculation = Speculation::new(&mut drafter, DraftLength::Fixed(1));
    generate(
        &mut session,
        &mut speculation,
        64,
        |l, _, _, _| Ok(argmax(l)),
        |_| Ok(ControlFlow::Continue(())),
    )
    .unwrap();
    let kept = speculation.stats.acceptance();
    println!("bundled: {kept:.3} of first drafts kept (training measured {measured:.3})");
    assert!(
        kept >= measured / 2.0,
        "{kept:.3} kept, training measured {measured:.3}"
    );
}
