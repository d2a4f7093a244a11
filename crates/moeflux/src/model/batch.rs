//! Several sessions through the model at once: [`forward_batch`] runs
//! their tokens in shared forward passes, one per prefill chunk, whatever
//! the mix of prompts and generated tokens.

use std::sync::Arc;

use super::{BatchOutput, Logits, LogitsWanted, Session};
use crate::backend::{Backend, HostValues};
use crate::blocks::batch::{ForwardBatch, Phase};
use crate::blocks::decoder::LayerState;
use crate::error::{Error, Result};

/// One session's part of a batched forward pass ([`forward_batch`]).
pub struct BatchItem<'a, B: Backend> {
    pub session: &'a mut Session<B>,
    /// Tokens to append to the session.
    pub tokens: &'a [u32],
    pub wanted: LogitsWanted,
    /// A prompt being read, or a generated token.
    pub phase: Phase,
}

/// Appends each item's tokens to its session, all sessions going through
/// the model together: one forward pass per prefill chunk, whatever the
/// mix of prompts and generated tokens, in which each expert is read and
/// multiplied once for every row that chose it. Returns each item's logits;
/// they equal what the sessions would get alone.
///
/// Every item is checked before anything runs. On failure every session is
/// rebuilt to where it was before the call; an interruption (a session's
/// [`Session::set_interrupt`] flag) keeps the chunks done.
pub fn forward_batch<B: Backend>(items: &mut [BatchItem<'_, B>]) -> Result<Vec<Logits>> {
    let Some(first) = items.first() else {
        return Ok(Vec::new());
    };
    let model = first.session.model.clone();
    for item in items.iter() {
        if !Arc::ptr_eq(&item.session.model, &model) {
            return Err(Error::invalid(
                "forward_batch",
                "every session of a batch must belong to the same model",
            ));
        }
        item.session.check_tokens(item.tokens)?;
    }
    for i in 0..items.len() {
        let session = &mut *items[i].session;
        let needed = session.position() + items[i].tokens.len();
        if let Err(err) = session.reserve_kv(needed) {
            items[..i].iter_mut().for_each(|it| it.session.sync_kv());
            return Err(err);
        }
    }
    // The logits are taken, not copied: a successful pass replaces them, a
    // failed one puts them back.
    let starts: Vec<(usize, Option<HostValues>)> = items
        .iter_mut()
        .map(|it| (it.session.position(), it.session.logits.take()))
        .collect();
    match run_rounds(items) {
        Ok(logits) => Ok(logits),
        Err(Error::Interrupted) => {
            items.iter_mut().for_each(|it| it.session.sync_kv());
            Err(Error::Interrupted)
        }
        Err(err) => {
            for (item, (start, logits)) in items.iter_mut().zip(starts) {
                let session = &mut *item.session;
                // Back where it was, the logits there included (a KV cache
                // cut back exactly does not recompute them).
                if session.rebuild(start).is_ok() && session.logits.is_none() {
                    session.logits = logits;
                }
                session.sync_kv();
            }
            Err(err)
        }
    }
}

/// The forward passes of [`forward_batch`]: in round `r`, every item with
/// an `r`-th chunk of tokens contributes it.
pub(super) fn run_rounds<B: Backend>(items: &mut [BatchItem<'_, B>]) -> Result<Vec<Logits>> {
    let model = items[0].session.model.clone();
    let (chunk, vocab) = (model.prefill_chunk, model.config().vocab_size);
    let rounds = items
        .iter()
        .map(|it| it.tokens.len().div_ceil(chunk))
        .max()
        .unwrap_or(0);
    let mut data: Vec<Option<HostValues>> = vec![None; items.len()];
    for round in 0..rounds {
        if round > 0 && items.iter().any(|it| it.session.interrupted()) {
            items.iter_mut().for_each(|it| it.session.logits = None);
            return Err(Error::Interrupted);
        }
        let mut batch = ForwardBatch::default();
        let mut members = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let tokens: &[u32] = item.tokens;
            let chunks = tokens.len().div_ceil(chunk);
            if round >= chunks {
                continue;
            }
            let part = &tokens[round * chunk..((round + 1) * chunk).min(tokens.len())];
            let rows = match item.wanted {
                LogitsWanted::All => part.len(),
                LogitsWanted::Last if round + 1 == chunks => 1,
                LogitsWanted::Last => 0,
            };
            batch.push(part, item.phase, rows);
            members.push((i, part, rows));
        }
        let keep_hidden = members
            .iter()
            .any(|m| items[m.0].session.keeps_hidden_states());
        let BatchOutput { logits, mut hidden } = {
            let mut states: Vec<&mut [LayerState<B>]> = items
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| members.iter().any(|m| m.0 == *i))
                .map(|(_, it)| it.session.layers_mut())
                .collect::<Result<_>>()?;
            model.run_batch(&mut states, &batch, keep_hidden)?
        };
        let single = members.len() == 1;
        // One part per segment when any row's logits were asked for.
        let mut parts = logits.map(Vec::into_iter);
        // Each sequence's rows, where hidden states are split among them.
        let sequence_rows = match keep_hidden && !single {
            true => batch.ranges(),
            false => Vec::new(),
        };
        for (s, (i, part, rows)) in members.into_iter().enumerate() {
            let session = &mut *items[i].session;
            let rows_kept = match (session.keeps_hidden_states(), single) {
                (false, _) => None,
                (true, true) => hidden.take(),
                (true, false) => hidden
                    .as_ref()
                    .map(|all| model.backend().gather_rows(all, &sequence_rows[s..s + 1]))
                    .transpose()?,
            };
            session.append(part, rows_kept)?;
            let values = parts.as_mut().and_then(Iterator::next);
            if rows == 0 {
                continue;
            }
            let values = values.expect("logit rows were asked for");
            // A sequence's first logits (a decode step's) are kept as they
            // came, later chunks' appended to a vector of their own.
            data[i] = Some(match data[i].take() {
                None => values,
                Some(before) => {
                    let mut all = before.into_vec();
                    all.extend_from_slice(&values);
                    HostValues::from(all)
                }
            });
        }
    }
    Ok(items
        .iter_mut()
        .zip(data)
        .map(|(item, data)| {
            let data = data.unwrap_or_default();
            let rows = data.len() / vocab;
            // The session keeps the last row: these logits themselves when
            // they are one row, else a copy (not a part of many rows).
            item.session.logits = Some(match rows {
                1 => data.clone(),
                _ => HostValues::from(data[data.len() - vocab..].to_vec()),
            });
            Logits { rows, vocab, data }
        })
        .collect())
}
