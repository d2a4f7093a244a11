//! Perplexity over a text in fixed windows, as llama.cpp's perplexity tool
//! and the bundled model's training script compute it: the tokens are cut
//! into non-overlapping windows of `ctx` (the remainder dropped), each
//! window is evaluated from an empty state, and the logits at position `i`
//! score token `i + 1`, so the first token of a window is context only.
//! `ppl = exp(Σ nll / scored tokens)`, natural log.

use std::sync::Arc;

use serde::Serialize;

use crate::LogitsWanted;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::util::Progress;

#[derive(Clone, Debug, Serialize)]
pub struct Perplexity {
    pub ctx: usize,
    pub windows: usize,
    pub scored_tokens: usize,
    /// Negative log-likelihood summed over each window.
    pub window_nll: Vec<f64>,
    pub mean_nll: f64,
    pub ppl: f64,
}

/// Evaluates `tokens` in windows of `ctx`; `progress` counts windows.
pub fn perplexity<B: Backend>(
    model: &Arc<Model<B>>,
    tokens: &[u32],
    ctx: usize,
    progress: &dyn Progress,
) -> Result<Perplexity> {
    if ctx < 2 {
        return Err(Error::invalid(
            "--ctx",
            "must be at least 2 (one context token, one scored)",
        ));
    }
    let windows = tokens.len() / ctx;
    if windows == 0 {
        return Err(Error::invalid(
            "text",
            format!(
                "has {} tokens, fewer than one window of --ctx {ctx}; use a longer text or a smaller --ctx",
                tokens.len()
            ),
        ));
    }
    progress.start(windows as u64);
    let mut window_nll = Vec::with_capacity(windows);
    for window in tokens.chunks_exact(ctx) {
        let logits = model.session().forward(window, LogitsWanted::All)?;
        let nll: f64 = (0..ctx - 1)
            .map(|i| negative_log_likelihood(logits.row(i), window[i + 1]))
            .sum();
        window_nll.push(nll);
        progress.advance(1, "windows");
    }
    progress.finish();
    let scored_tokens = windows * (ctx - 1);
    let mean_nll = window_nll.iter().sum::<f64>() / scored_tokens as f64;
    Ok(Perplexity {
        ctx,
        windows,
        scored_tokens,
        window_nll,
        mean_nll,
        ppl: mean_nll.exp(),
    })
}

/// `-log softmax(logits)[target]`, computed stably in f64.
fn negative_log_likelihood(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let log_sum: f64 = logits
        .iter()
        .map(|&l| (l as f64 - max).exp())
        .sum::<f64>()
        .ln();
    max + log_sum - logits[target as usize] as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_of_a_uniform_distribution_is_log_vocab() {
        let logits = vec![3.0f32; 50];
        assert!((negative_log_likelihood(&logits, 7) - 50f64.ln()).abs() < 1e-12);
        let mut peaked = vec![0.0f32; 4];
        peaked[2] = 100.0;
        assert!(negative_log_likelihood(&peaked, 2) < 1e-12);
    }
}
