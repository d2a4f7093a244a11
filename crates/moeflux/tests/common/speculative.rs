//! Speculative decoding = plain decoding, written once for every backend:
//! greedy generation with drafts checked in one forward pass against the
//! same generation one token at a time.

use std::ops::ControlFlow;
use std::sync::Arc;

use moeflux::backend::Backend;
use moeflux::model::argmax;
use moeflux::speculative::{DraftLength, Drafter, PromptLookup, Speculation, generate};
use moeflux::{Model, Result, Session};

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
