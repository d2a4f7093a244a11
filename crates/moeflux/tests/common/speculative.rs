//! Speculative decoding = plain decoding, written once for every backend:
//! greedy generation with drafts checked in one forward pass against the
//! same generation one token at a time.

use std::ops::ControlFlow;
use std::sync::Arc;

use moeflux::backend::Backend;
use moeflux::model::argmax;
use moeflux::speculative::{
    DraftLength, DraftSource, Drafter, MtpDrafter, PromptLookup, Speculation, generate,
};
use moeflux::{Model, Result, Session};

use super::{Reference, row_errors};

/// Which drafted positions an [`Oracle`] gets wrong.
type Wrong = fn(usize) -> bool;

/// Drafts plain decoding's own continuation, wrong wherever `wrong` says:
/// every draft length is checked, with rejections at every offset.
pub struct Oracle {
    pub truth: Vec<u32>,
    pub vocab: u32,
    /// Which drafted position (counted over the whole generation) to get
    /// wrong.
    pub wrong: Wrong,
}

impl<B: Backend> Drafter<B> for Oracle {
    fn draft(&mut self, session: &Session<B>, next: u32, k: usize) -> Result<Vec<u32>> {
        // `next` sits at `session.position()`; drafts follow it.
        assert_eq!(
            next,
            self.truth[session.position()],
            "the token before the drafts"
        );
        let at = session.position() + 1;
        Ok((at..(at + k).min(self.truth.len()))
            .map(|i| match (self.wrong)(i) {
                true => (self.truth[i] + 1) % self.vocab,
                false => self.truth[i],
            })
            .collect())
    }
}

/// Greedy tokens, the session's tokens and the last logits of plain
/// decoding.
pub fn plain<B: Backend>(model: &Arc<Model<B>>, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let mut session = model.session();
    session.prefill(prompt).unwrap();
    session
        .generate(
            n,
            |l, _, _| Ok(argmax(l)),
            |_| Ok(ControlFlow::Continue(())),
        )
        .unwrap();
    (
        session.tokens().to_vec(),
        session.last_logits().unwrap().to_vec(),
    )
}

/// Greedy generation through `drafter`; the session's tokens, its last
/// logits and how many drafts were kept.
pub fn drafted<B: Backend>(
    model: &Arc<Model<B>>,
    prompt: &[u32],
    n: usize,
    drafter: &mut dyn Drafter<B>,
    length: DraftLength,
    stop_after: Option<usize>,
) -> (Vec<u32>, Vec<f32>, u64) {
    let mut session = model.session();
    drafter.prepare(&mut session);
    session.prefill(prompt).unwrap();
    let mut speculation = Speculation::new(drafter, length);
    let mut seen = 0;
    let out = generate(
        &mut session,
        &mut speculation,
        n,
        |l, _, _, _| Ok(argmax(l)),
        |_| {
            seen += 1;
            Ok(match stop_after == Some(seen) {
                true => ControlFlow::Break(()),
                false => ControlFlow::Continue(()),
            })
        },
    )
    .unwrap();
    assert_eq!(&session.tokens()[prompt.len()..], out.as_slice());
    (
        session.tokens().to_vec(),
        session.last_logits().unwrap().to_vec(),
        speculation.stats.accepted,
    )
}

/// Greedy generation with drafts equals plain greedy decoding on `model`:
/// the same tokens, and the session left with logits within `tolerance`
/// (relative to the row's largest) of plain decoding's; with drafts of 1
/// to 4 tokens (all right, wrong at every offset), adaptive lengths,
/// prompt lookup, and a stop in the middle of a step.
pub fn check_greedy_equal<B: Backend>(
    name: &str,
    model: &Arc<Model<B>>,
    prompt: &[u32],
    tolerance: f64,
) {
    let n = 24;
    let (want, want_logits) = plain(model, prompt, n);
    let vocab = model.config().vocab_size as u32;
    let close = |got: &[f32], what: &str| {
        let err = super::row_errors(got, &want_logits, want_logits.len())[0];
        assert!(
            err <= tolerance,
            "{name} {what}: last logits differ by {err:.3e}"
        );
    };
    let patterns: [(&str, Wrong); 3] = [
        ("all right", |_| false),
        ("every third wrong", |i| i % 3 == 0),
        ("every fifth wrong", |i| i % 5 == 2),
    ];
    for k in 1..=4 {
        for (what, wrong) in patterns {
            let mut oracle = Oracle {
                truth: want.clone(),
                vocab,
                wrong,
            };
            let (got, logits, accepted) =
                drafted(model, prompt, n, &mut oracle, DraftLength::Fixed(k), None);
            assert_eq!(got, want, "{name}: k = {k}, drafts {what}");
            assert!(accepted > 0, "{name}: k = {k}, drafts {what}: none kept");
            close(&logits, &format!("k = {k}, drafts {what}"));
        }
    }
    let mut oracle = Oracle {
        truth: want.clone(),
        vocab,
        wrong: |i| i % 7 == 3,
    };
    let (got, logits, _) = drafted(model, prompt, n, &mut oracle, DraftLength::DEFAULT, None);
    assert_eq!(got, want, "{name}: adaptive drafts");
    close(&logits, "adaptive drafts");

    let mut lookup = PromptLookup::default();
    let (got, logits, _) = drafted(model, prompt, n, &mut lookup, DraftLength::Fixed(3), None);
    assert_eq!(got, want, "{name}: prompt lookup");
    close(&logits, "prompt lookup");

    // Stopped after 5 tokens, in the middle of a step of 4 right drafts.
    let (short, short_logits) = plain(model, prompt, 5);
    let mut oracle = Oracle {
        truth: want.clone(),
        vocab,
        wrong: |_| false,
    };
    let (got, logits, _) = drafted(
        model,
        prompt,
        n,
        &mut oracle,
        DraftLength::Fixed(4),
        Some(5),
    );
    assert_eq!(got, short, "{name}: stopped in a step");
    let err = super::row_errors(&logits, &short_logits, short_logits.len())[0];
    assert!(
        err <= tolerance,
        "{name}: stopped in a step: logits differ by {err:.3e}"
    );
}

/// A session of `model` that keeps hidden states, holding `tokens`.
pub fn mtp_session<B: Backend>(model: &Arc<Model<B>>, tokens: &[u32]) -> Session<B> {
    let mut session = model.session();
    DraftSource::Mtp.prepare(&mut session);
    session.prefill(tokens).unwrap();
    session
}

/// The head's first draft logits after the session and `next`, from a new
/// drafter (one pass over every row).
pub fn fresh_mtp_row<B: Backend>(session: &Session<B>, next: u32) -> Vec<f32> {
    let mut drafter = MtpDrafter::new(session.model()).unwrap();
    let rows = drafter.draft_logits(session, next, 1).unwrap();
    assert_eq!(rows.rows, 1);
    rows.into_vec()
}

/// The largest relative error of the multi-token-prediction head of
/// fixture `name` (`model`, its bf16 conversion) against the PyTorch
/// reference (`mtp.safetensors`): at every position of `tokens_long`, in
/// one pass after prompts of several lengths and row by row as a session
/// grows, and along the drafting chains, whose greedy tokens must be the
/// reference's.
pub fn mtp_reference_error<B: Backend>(name: &str, model: &Arc<Model<B>>) -> f64 {
    assert!(model.has_mtp(), "{name}: converted without its head");
    let tokens = Reference::load(name).tokens("tokens_long");
    let mtp = Reference::load_file(name, "mtp.safetensors");
    let (rows, vocab, want) = mtp.logits("mtp_logits_long");
    assert_eq!(rows, tokens.len() - 1);
    let want_row = |i: usize| &want[i * vocab..(i + 1) * vocab];
    let mut worst: f64 = 0.0;
    for p in [1, 2, 7, 30, 79] {
        let session = mtp_session(model, &tokens[..p]);
        let got = fresh_mtp_row(&session, tokens[p]);
        worst = worst.max(row_errors(&got, want_row(p - 1), vocab)[0]);
    }
    let mut session = mtp_session(model, &tokens[..1]);
    let mut drafter = MtpDrafter::new(model).unwrap();
    for (p, &next) in tokens.iter().enumerate().skip(1) {
        let got = drafter.draft_logits(&session, next, 1).unwrap();
        worst = worst.max(row_errors(&got.data, want_row(p - 1), vocab)[0]);
        session.decode(next).unwrap();
    }
    for p in [7, 40] {
        let (steps, _, want) = mtp.logits(&format!("mtp_chain_{p}_logits"));
        let session = mtp_session(model, &tokens[..p]);
        let mut drafter = MtpDrafter::new(model).unwrap();
        let got = drafter.draft_logits(&session, tokens[p], steps).unwrap();
        assert_eq!(got.rows, steps);
        for err in row_errors(&got.data, &want, vocab) {
            worst = worst.max(err);
        }
        let drafts = drafter.draft(&session, tokens[p], steps).unwrap();
        let want_tokens = mtp.tokens(&format!("mtp_chain_{p}_tokens"));
        assert_eq!(
            drafts, want_tokens,
            "{name}: chained drafts after {p} tokens"
        );
    }
    worst
}

/// Greedy generation with the multi-token-prediction head's drafts (1 to
/// 4 tokens a step, and adaptive) equals plain greedy decoding on `model`,
/// the session left with logits within `tolerance` of plain decoding's.
pub fn check_greedy_equal_with_mtp<B: Backend>(
    name: &str,
    model: &Arc<Model<B>>,
    prompt: &[u32],
    tolerance: f64,
) {
    let n = 24;
    let (want, want_logits) = plain(model, prompt, n);
    for length in (1..=4)
        .map(DraftLength::Fixed)
        .chain([DraftLength::DEFAULT])
    {
        let mut drafter = MtpDrafter::new(model).unwrap();
        let (got, logits, _) = drafted(model, prompt, n, &mut drafter, length, None);
        assert_eq!(got, want, "{name}: {length:?}");
        let err = row_errors(&logits, &want_logits, want_logits.len())[0];
        assert!(err <= tolerance, "{name}: {length:?}: logits {err:.3e}");
    }
}
