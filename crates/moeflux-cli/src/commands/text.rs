//! Streaming generated text: tokens sampled, decoded to whole characters,
//! checked against stop strings, and written out as they arrive.

use std::io::Write;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::Result;
use moeflux::Session;
use moeflux::backend::Backend;
use moeflux::sampling::{Sampler, StopCondition};
use moeflux::text::Tokenizer;

/// What one streamed generation produced.
pub struct Streamed {
    pub tokens: Vec<u32>,
    /// The text shown (without stop strings or end-of-text tokens).
    pub text: String,
    pub seconds: f64,
    pub interrupted: bool,
}

pub struct TextGeneration<'a> {
    pub tokenizer: &'a Tokenizer,
    pub sampler: &'a mut Sampler,
    pub stop_strings: &'a [String],
    pub max_tokens: usize,
    /// Set (by Ctrl-C) to end the generation early.
    pub interrupt: Option<&'a AtomicBool>,
}

impl TextGeneration<'_> {
    /// Generates from the session's current state, writing text to `out`.
    pub fn run<B: Backend>(
        &mut self,
        session: &mut Session<B>,
        out: &mut dyn Write,
    ) -> Result<Streamed> {
        let mut stop = StopCondition::new(
            self.tokenizer.special_tokens().stop_ids.clone(),
            self.stop_strings.to_vec(),
        )?;
        let mut decoder = self.tokenizer.stream_decoder(true);
        let mut text = String::new();
        let mut emit = |piece: &str, text: &mut String| -> Result<()> {
            text.push_str(piece);
            out.write_all(piece.as_bytes())?;
            out.flush()?;
            Ok(())
        };
        let (mut ended, mut interrupted) = (false, false);
        let start = Instant::now();
        let sampler = &mut *self.sampler;
        let interrupt = self.interrupt;
        let tokens = session.generate(
            self.max_tokens,
            |logits, prompt, generated| sampler.sample(logits, prompt, generated),
            |id| {
                if interrupt.is_some_and(|flag| flag.load(Ordering::Relaxed)) {
                    interrupted = true;
                    return Ok(ControlFlow::Break(()));
                }
                if stop.is_eos(id) {
                    ended = true;
                    return Ok(ControlFlow::Break(()));
                }
                let step = stop.push(&decoder.step(id)?);
                emit(&step.text, &mut text)
                    .map_err(|e| moeflux::Error::invalid("output", e.to_string()))?;
                if step.stopped_by.is_some() {
                    ended = true;
                    return Ok(ControlFlow::Break(()));
                }
                Ok(ControlFlow::Continue(()))
            },
        )?;
        if !ended {
            let rest = stop.push(&decoder.finish()?).text + &stop.finish();
            emit(&rest, &mut text)?;
        }
        Ok(Streamed {
            tokens,
            text,
            seconds: start.elapsed().as_secs_f64(),
            interrupted,
        })
    }
}

/// `N tokens in S s (R tok/s)`.
pub fn rate(tokens: usize, seconds: f64) -> String {
    format!(
        "{tokens} tokens in {seconds:.2} s ({:.1} tok/s)",
        tokens as f64 / seconds.max(1e-9)
    )
}
