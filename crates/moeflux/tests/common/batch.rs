//! Batched = alone, written once for every backend: sequences of
//! different lengths, prompts and generated tokens mixed in one forward
//! pass, against each sequence run alone.

use std::sync::Arc;

use std::path::Path;

use moeflux::backend::Backend;
use moeflux::{BatchItem, Error, LogitsWanted, Model, ModelOptions, Phase, Session, forward_batch};

use super::faulty::Faulty;
use super::{argmax, row_errors};

/// A sequence: the history it already holds, then the tokens of the batched
/// step (1 = a decode token).
pub struct Plan {
    pub history: Vec<u32>,
    pub step: Vec<u32>,
}

/// `n` sequences of different lengths: histories from 0 to over a prefill
/// chunk, steps of one token (decode) or several (prefill, some spanning
/// two chunks).
pub fn plans(tokens: &[u32], n: usize) -> Vec<Plan> {
    let history_lens = [0, 3, 17, 1, 70, 9, 33, 2];
    let step_lens = [5, 1, 1, 70, 1, 12, 1, 66];
    (0..n)
        .map(|i| {
            let (h, s) = (history_lens[i % 8], step_lens[i % 8]);
            let at = (7 * i) % (tokens.len() - h - s);
            Plan {
                history: tokens[at..at + h].to_vec(),
                step: tokens[at + h..at + h + s].to_vec(),
            }
        })
        .collect()
}

/// `n` sequences of different lengths each bringing one token: a decode
/// step of the whole batch.
pub fn decode_plans(tokens: &[u32], n: usize) -> Vec<Plan> {
    (0..n)
        .map(|i| {
            let h = 1 + (13 * i) % 90;
            let at = (5 * i) % (tokens.len() - h - 1);
            Plan {
                history: tokens[at..at + h].to_vec(),
                step: vec![tokens[at + h]],
            }
        })
        .collect()
}

fn phase(tokens: &[u32]) -> Phase {
    match tokens.len() {
        1 => Phase::Decode,
        _ => Phase::Prefill,
    }
}

/// Each plan's step logits (every row) with the sequence alone.
pub fn alone<B: Backend>(model: &Arc<Model<B>>, plans: &[Plan]) -> Vec<Vec<f32>> {
    plans
        .iter()
        .map(|p| {
            let mut session = model.session();
            if !p.history.is_empty() {
                session.prefill(&p.history).unwrap();
            }
            session
                .forward(&p.step, LogitsWanted::All)
                .unwrap()
                .into_vec()
        })
        .collect()
}

/// The same, every sequence in one batch: the histories in one batched
/// pass, then the steps in another.
pub fn batched<B: Backend>(model: &Arc<Model<B>>, plans: &[Plan]) -> Vec<Vec<f32>> {
    let mut sessions: Vec<Session<B>> = plans.iter().map(|_| model.session()).collect();
    let mut items: Vec<BatchItem<'_, B>> = sessions
        .iter_mut()
        .zip(plans)
        .filter(|(_, p)| !p.history.is_empty())
        .map(|(session, p)| BatchItem {
            session,
            tokens: &p.history,
            wanted: LogitsWanted::Last,
            phase: Phase::Prefill,
        })
        .collect();
    forward_batch(&mut items).unwrap();
    let mut items: Vec<BatchItem<'_, B>> = sessions
        .iter_mut()
        .zip(plans)
        .map(|(session, p)| BatchItem {
            session,
            tokens: &p.step,
            wanted: LogitsWanted::All,
            phase: phase(&p.step),
        })
        .collect();
    forward_batch(&mut items)
        .unwrap()
        .into_iter()
        .map(|l| l.into_vec())
        .collect()
}

/// Greedy continuations of each plan's history + step, `n` tokens each:
/// alone, then all sequences decoding together.
pub fn greedy_both<B: Backend>(
    model: &Arc<Model<B>>,
    plans: &[Plan],
    n: usize,
) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let prompt = |p: &Plan| [p.history.as_slice(), &p.step].concat();
    let alone = plans
        .iter()
        .map(|p| model.generate_greedy(&prompt(p), n).unwrap())
        .collect();
    let prompts: Vec<Vec<u32>> = plans.iter().map(prompt).collect();
    let mut sessions: Vec<Session<B>> = plans.iter().map(|_| model.session()).collect();
    let mut items: Vec<BatchItem<'_, B>> = sessions
        .iter_mut()
        .zip(&prompts)
        .map(|(session, tokens)| BatchItem {
            session,
            tokens,
            wanted: LogitsWanted::Last,
            phase: Phase::Prefill,
        })
        .collect();
    let mut last: Vec<Vec<f32>> = forward_batch(&mut items)
        .unwrap()
        .into_iter()
        .map(|l| l.into_vec())
        .collect();
    let mut out = vec![Vec::new(); plans.len()];
    for _ in 0..n {
        let next: Vec<[u32; 1]> = last.iter().map(|l| [argmax(l) as u32]).collect();
        for (o, t) in out.iter_mut().zip(&next) {
            o.push(t[0]);
        }
        let mut items: Vec<BatchItem<'_, B>> = sessions
            .iter_mut()
            .zip(&next)
            .map(|(session, t)| BatchItem {
                session,
                tokens: t,
                wanted: LogitsWanted::Last,
                phase: Phase::Decode,
            })
            .collect();
        last = forward_batch(&mut items)
            .unwrap()
            .into_iter()
            .map(|l| l.into_vec())
            .collect();
    }
    (alone, out)
}

/// Runs 1, 3 and 8 sequences batched and alone on `model` (whose vocabulary
/// the tokens are drawn from); fails when a row of logits differs by more
/// than `bound` (relative L2) or a greedy continuation differs.
pub fn check_batched_equals_alone<B: Backend>(model: &Arc<Model<B>>, label: &str, bound: f64) {
    let vocab = model.config().vocab_size;
    let mut rng = moeflux::util::SplitMix64(7);
    let tokens: Vec<u32> = (0..400).map(|_| rng.below(vocab as u64) as u32).collect();
    for n in [1, 3, 8] {
        let plans = plans(&tokens, n);
        for (kind, plans) in [("mixed", &plans), ("decode", &decode_plans(&tokens, n))] {
            let want = alone(model, plans);
            let got = batched(model, plans);
            let mut max = 0f64;
            for (g, w) in got.iter().zip(&want) {
                max = row_errors(g, w, vocab).into_iter().fold(max, f64::max);
            }
            println!("{label:<28} {n} sequences, {kind}: batched vs alone, max rel err {max:.2e}");
            assert!(
                max <= bound,
                "{label}, {n} sequences ({kind}): batched logits differ from alone by {max:.3e}"
            );
        }
        let (alone, together) = greedy_both(model, &plans, 8);
        assert_eq!(
            together, alone,
            "{label}, {n} sequences: greedy tokens differ"
        );
    }
}

/// One item of a batch that decodes or prefills `tokens` into `session`.
fn item<'a, B: Backend>(session: &'a mut Session<B>, tokens: &'a [u32]) -> BatchItem<'a, B> {
    BatchItem {
        session,
        tokens,
        wanted: LogitsWanted::Last,
        phase: phase(tokens),
    }
}

/// A device failure in the middle of a batched forward pass (an operation
/// of `inner` failing as an out-of-memory would, through [`Faulty`])
/// reaches the caller as [`Error::Device`]; the batch's sequences are
/// rolled back to where they were; another sequence and the process go on;
/// and the same batch, run again, gives what it gives on a model that never
/// failed.
pub fn check_device_failure_is_contained<B: Backend>(dir: &Path, inner: impl Fn() -> B) {
    let open = |backend| {
        Arc::new(Model::open_with(backend, dir, &ModelOptions::default()).expect("model opens"))
    };
    let model = open(Faulty::new(inner()));
    let reference = open(Faulty::new(inner()));
    let prompts: [&[u32]; 3] = [
        &[3, 14, 15, 92, 65],
        &[35, 89, 79],
        &[32, 38, 46, 26, 43, 38, 32],
    ];
    let steps: [&[u32]; 3] = [&[7], &[1, 41, 42, 43], &[9]];
    let prefilled = |model: &Arc<Model<Faulty<B>>>| -> Vec<Session<Faulty<B>>> {
        prompts
            .iter()
            .map(|p| {
                let mut s = model.session();
                s.prefill(p).expect("prefill");
                s
            })
            .collect()
    };
    let mut sessions = prefilled(&model);
    let before: Vec<Vec<f32>> = sessions
        .iter()
        .map(|s| s.last_logits().expect("logits after prefill").to_vec())
        .collect();
    let [a, b, c] = sessions.as_mut_slice() else {
        unreachable!("three sessions")
    };
    for after in [0, 7, 60] {
        model.backend().arm(after);
        let result = forward_batch(&mut [item(a, steps[0]), item(b, steps[1])]);
        assert!(
            model.backend().fired(),
            "the failure was armed {after} operations ahead"
        );
        match result {
            Err(Error::Device { msg, .. }) => assert!(msg.contains("injected"), "{msg}"),
            other => panic!("expected a device error, got {:?}", other.map(|_| ())),
        }
        assert_eq!(
            (a.position(), b.position()),
            (prompts[0].len(), prompts[1].len())
        );
        assert_eq!(a.last_logits(), Some(before[0].as_slice()), "a rolled back");
        assert_eq!(b.last_logits(), Some(before[1].as_slice()), "b rolled back");
    }
    // Another sequence goes on as if nothing happened.
    let mut want = prefilled(&reference);
    let got_c = c
        .forward(steps[2], LogitsWanted::Last)
        .expect("c goes on")
        .into_vec();
    let want_c = want[2]
        .forward(steps[2], LogitsWanted::Last)
        .unwrap()
        .into_vec();
    assert_eq!(got_c, want_c, "the other sequence");
    // The failed batch, run again, gives what a never-failed model gives.
    let got = forward_batch(&mut [item(a, steps[0]), item(b, steps[1])]).expect("the retry");
    let [wa, wb, _] = want.as_mut_slice() else {
        unreachable!("three sessions")
    };
    let expected = forward_batch(&mut [item(wa, steps[0]), item(wb, steps[1])]).unwrap();
    for (g, w) in got.iter().zip(&expected) {
        assert_eq!(g.data, w.data, "the retried batch");
    }
}
