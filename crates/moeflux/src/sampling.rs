//! Choosing the next token from a row of logits, and deciding when
//! generation stops.
//!
//! [`Sampler`] follows transformers' `generate`: the repetition penalty,
//! then (OpenAI's) presence and frequency penalties, then greedy argmax, or
//! temperature, top-k, top-p and min-p in that order and a draw from what
//! is left. [`SamplerConfig::from_generation_config`] reads a model's
//! defaults with transformers' meaning for each field. [`StopCondition`]
//! ends generation on an end-of-sequence id or a stop string in the
//! streamed text.

use std::collections::HashMap;
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::format::GENERATION_CONFIG_FILE;
use crate::util::read_json_if_present;

/// How the next token is chosen. Each filter's "off" value leaves the
/// distribution as it is.
///
/// [`Default`] is greedy; set a temperature to sample. A model's own
/// settings come from [`SamplerConfig::from_generation_config`]:
///
/// ```
/// use moeflux::sampling::SamplerConfig;
///
/// let config = SamplerConfig {
///     temperature: 0.8,
///     top_p: 0.95,
///     seed: Some(42),
///     ..SamplerConfig::default()
/// };
/// assert!(config.validate().is_ok() && !config.is_greedy());
/// assert!(SamplerConfig::default().is_greedy());
///
/// // The bundled model's generation_config.json: do_sample, temperature 0.7.
/// let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
/// let model_defaults = SamplerConfig::from_generation_config(&dir)?;
/// assert_eq!(model_defaults.temperature, 0.7);
/// # Ok::<(), moeflux::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// Divides the logits; 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (ties included); 0 = off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability adds
    /// up to at least `top_p`; 1 = off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 = off.
    pub min_p: f32,
    /// Logits of tokens already in the prompt or the output are divided by
    /// it when positive and multiplied by it when negative; 1 = off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated; 0 = off.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated; 0 = off.
    pub frequency_penalty: f32,
    /// Seed of the random draws; `None` takes one from the operating system
    /// (see [`Sampler::seed`] to repeat a run).
    pub seed: Option<u64>,
}

/// transformers' defaults (`GenerationConfig._get_default_generation_params`):
/// no sampling, and top-k 50 once sampling is turned on.
impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 50,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
        }
    }
}

impl SamplerConfig {
    /// The model's defaults from `dir/generation_config.json`, read as
    /// transformers reads them: a missing file or field takes transformers'
    /// default, and `do_sample` false (or absent) means greedy whatever the
    /// temperature. `presence_penalty` and `frequency_penalty`, not
    /// transformers fields, are read where a file has them.
    pub fn from_generation_config(dir: &Path) -> Result<SamplerConfig> {
        let Some((path, cfg)) = read_json_if_present(&dir.join(GENERATION_CONFIG_FILE))? else {
            return Ok(SamplerConfig::default());
        };
        let number = |key: &str, default: f32| -> Result<f32> {
            match cfg.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v.as_f64().map(|x| x as f32).ok_or_else(|| {
                    Error::bad_file(&path, format!("\"{key}\" should be a number, found {v}"))
                }),
            }
        };
        let do_sample = match cfg.get("do_sample") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(Error::bad_file(
                    &path,
                    format!("\"do_sample\" should be true or false, found {v}"),
                ));
            }
        };
        let top_k = match cfg.get("top_k") {
            None | Some(Value::Null) => 50,
            Some(v) => v
                .as_u64()
                .and_then(|k| usize::try_from(k).ok())
                .ok_or_else(|| {
                    Error::bad_file(
                        &path,
                        format!("\"top_k\" should be a whole number ≥ 0, found {v}"),
                    )
                })?,
        };
        let temperature = number("temperature", 1.0)?;
        let config = SamplerConfig {
            temperature: if do_sample { temperature } else { 0.0 },
            top_k,
            top_p: number("top_p", 1.0)?,
            min_p: number("min_p", 0.0)?,
            repetition_penalty: number("repetition_penalty", 1.0)?,
            presence_penalty: number("presence_penalty", 0.0)?,
            frequency_penalty: number("frequency_penalty", 0.0)?,
            seed: None,
        };
        config
            .validate()
            .map_err(|e| Error::bad_file(&path, e.to_string()))?;
        Ok(config)
    }

    /// Checks every field's range.
    pub fn validate(&self) -> Result<()> {
        let (t, p, m, r) = (
            self.temperature,
            self.top_p,
            self.min_p,
            self.repetition_penalty,
        );
        let checks = [
            (
                "temperature",
                t,
                t.is_finite() && t >= 0.0,
                "≥ 0 (0 = greedy)",
            ),
            ("top_p", p, p > 0.0 && p <= 1.0, "in (0, 1] (1 = off)"),
            ("min_p", m, (0.0..=1.0).contains(&m), "in [0, 1] (0 = off)"),
            (
                "repetition_penalty",
                r,
                r.is_finite() && r > 0.0,
                "> 0 (1 = off)",
            ),
            (
                "presence_penalty",
                self.presence_penalty,
                self.presence_penalty.is_finite(),
                "finite (0 = off)",
            ),
            (
                "frequency_penalty",
                self.frequency_penalty,
                self.frequency_penalty.is_finite(),
                "finite (0 = off)",
            ),
        ];
        match checks.into_iter().find(|&(_, _, ok, _)| !ok) {
            Some((option, got, _, want)) => {
                Err(Error::invalid(option, format!("must be {want}, got {got}")))
            }
            None => Ok(()),
        }
    }

    /// Whether the next token is the most likely one, with no draw.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Picks next tokens; seeded, so a run repeats exactly with the same seed.
///
/// [`Sampler::sample`] fits [`Session::generate`]'s `pick` argument.
///
/// ```
/// use moeflux::sampling::{Sampler, SamplerConfig};
///
/// let logits = [0.5, 3.0, 1.0, -2.0];
/// let mut greedy = Sampler::new(SamplerConfig::default())?;
/// assert_eq!(greedy.sample(&logits, &[], &[])?, 1);
///
/// // top-k 2: only ids 1 and 2 can be drawn.
/// let config = SamplerConfig {
///     temperature: 1.0,
///     top_k: 2,
///     seed: Some(7),
///     ..SamplerConfig::default()
/// };
/// let mut sampler = Sampler::new(config.clone())?;
/// let mut again = Sampler::new(config)?;
/// for _ in 0..20 {
///     let id = sampler.sample(&logits, &[], &[])?;
///     assert!(id == 1 || id == 2);
///     // The same seed draws the same tokens.
///     assert_eq!(again.sample(&logits, &[], &[])?, id);
/// }
/// # Ok::<(), moeflux::Error>(())
/// ```
///
/// [`Session::generate`]: crate::Session::generate
pub struct Sampler {
    config: SamplerConfig,
    seed: u64,
    /// ChaCha8: the same stream on every platform and `rand` version.
    rng: ChaCha8Rng,
}

impl Sampler {
    /// A sampler for `config`, once its ranges are checked
    /// ([`SamplerConfig::validate`]).
    pub fn new(config: SamplerConfig) -> Result<Sampler> {
        config.validate()?;
        let seed = config.seed.unwrap_or_else(rand::random);
        Ok(Sampler {
            rng: ChaCha8Rng::seed_from_u64(seed),
            seed,
            config,
        })
    }

    /// The settings in use.
    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// The seed in use (drawn from the OS when the config gave none).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The next token, given the logits of the last position, the prompt
    /// and the tokens generated so far. The repetition penalty looks at
    /// both (as transformers does); presence and frequency penalties at the
    /// generated tokens only (as OpenAI defines them).
    pub fn sample(&mut self, logits: &[f32], prompt: &[u32], generated: &[u32]) -> Result<u32> {
        let scores = self.penalized(logits, prompt, generated)?;
        if self.config.is_greedy() {
            return argmax(&scores);
        }
        let dist = self.distribution(&scores)?;
        let mut u = self.rng.random::<f64>();
        for &(id, p) in &dist {
            if u < p {
                return Ok(id);
            }
            u -= p;
        }
        // Rounding left u just past the total: the least likely kept token.
        Ok(dist[dist.len() - 1].0)
    }

    /// The next token when a drafter guessed `draft` for it: the draft is
    /// kept exactly when the returned token equals it. Greedy keeps it when
    /// it is the most likely token; sampling keeps it with its probability
    /// `p(draft)` and otherwise draws from the distribution without it
    /// (speculative rejection sampling with a drafter that proposes one
    /// token for sure), so each token follows exactly the distribution
    /// [`Sampler::sample`] draws from.
    pub fn sample_with_draft(
        &mut self,
        logits: &[f32],
        prompt: &[u32],
        generated: &[u32],
        draft: u32,
    ) -> Result<u32> {
        let scores = self.penalized(logits, prompt, generated)?;
        if self.config.is_greedy() {
            return argmax(&scores);
        }
        let dist = self.distribution(&scores)?;
        let kept = dist
            .iter()
            .find(|(id, _)| *id == draft)
            .map_or(0.0, |d| d.1);
        if self.rng.random::<f64>() < kept {
            return Ok(draft);
        }
        let rest: Vec<(u32, f64)> = dist.into_iter().filter(|(id, _)| *id != draft).collect();
        let mut u = self.rng.random::<f64>() * (1.0 - kept);
        for &(id, p) in &rest {
            if u < p {
                return Ok(id);
            }
            u -= p;
        }
        // Rounding left u past the rest's total (or the draft was the only
        // token left, kept = 1 up to rounding): the least likely other token.
        Ok(rest.last().map_or(draft, |d| d.0))
    }

    /// The logits with the repetition, presence and frequency penalties.
    fn penalized(&self, logits: &[f32], prompt: &[u32], generated: &[u32]) -> Result<Vec<f32>> {
        if logits.is_empty() {
            return Err(Error::invalid("logits", "the row is empty"));
        }
        let mut scores = logits.to_vec();
        if let Some(&id) = prompt
            .iter()
            .chain(generated)
            .find(|&&id| id as usize >= scores.len())
        {
            return Err(Error::invalid(
                "token history",
                format!("token id {id} is out of range for {} logits", scores.len()),
            ));
        }
        let c = &self.config;
        if c.repetition_penalty != 1.0 {
            let mut seen = vec![false; scores.len()];
            for &id in prompt.iter().chain(generated) {
                let id = id as usize;
                if !std::mem::replace(&mut seen[id], true) {
                    let s = &mut scores[id];
                    *s = if *s < 0.0 {
                        *s * c.repetition_penalty
                    } else {
                        *s / c.repetition_penalty
                    };
                }
            }
        }
        if c.presence_penalty != 0.0 || c.frequency_penalty != 0.0 {
            let mut counts: HashMap<u32, u32> = HashMap::new();
            for &id in generated {
                *counts.entry(id).or_default() += 1;
            }
            for (id, n) in counts {
                scores[id as usize] -= c.presence_penalty + c.frequency_penalty * n as f32;
            }
        }
        Ok(scores)
    }

    /// The distribution drawn from: `(id, probability)`, most likely first,
    /// after temperature, top-k, top-p and min-p.
    fn distribution(&self, scores: &[f32]) -> Result<Vec<(u32, f64)>> {
        let c = &self.config;
        // In f64: a tiny temperature must not overflow the scaled logits.
        let t = f64::from(c.temperature);
        let mut cand: Vec<(u32, f64)> = scores
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_finite())
            .map(|(i, &s)| (i as u32, f64::from(s) / t))
            .collect();
        if cand.is_empty() {
            return Err(Error::invalid("logits", "no token has a finite logit"));
        }
        if c.top_k > 0 && c.top_k < cand.len() {
            // Partition first: sorting 150k logits every token is slow.
            cand.select_nth_unstable_by(c.top_k - 1, |a, b| b.1.total_cmp(&a.1));
            let kth = cand[c.top_k - 1].1;
            cand.retain(|&(_, s)| s >= kth);
        }
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let max = cand[0].1;
        let mut dist: Vec<(u32, f64)> = cand.iter().map(|&(id, s)| (id, (s - max).exp())).collect();
        normalize(&mut dist);
        if c.top_p < 1.0 {
            // transformers: drop the least likely tokens while their
            // cumulative probability stays ≤ 1 - top_p; keep at least one.
            let limit = 1.0 - f64::from(c.top_p);
            let mut cum = 0.0;
            let mut keep = dist.len();
            while keep > 1 {
                cum += dist[keep - 1].1;
                if cum > limit {
                    break;
                }
                keep -= 1;
            }
            dist.truncate(keep);
            normalize(&mut dist);
        }
        if c.min_p > 0.0 {
            let threshold = f64::from(c.min_p) * dist[0].1;
            dist.retain(|&(_, p)| p >= threshold);
            normalize(&mut dist);
        }
        Ok(dist)
    }
}

fn normalize(dist: &mut [(u32, f64)]) {
    let total: f64 = dist.iter().map(|(_, p)| p).sum();
    for (_, p) in dist.iter_mut() {
        *p /= total;
    }
}

/// Index of the largest score, the first on ties; NaN never wins.
fn argmax(scores: &[f32]) -> Result<u32> {
    let mut best: Option<usize> = None;
    for (i, &s) in scores.iter().enumerate() {
        if !s.is_nan() && best.is_none_or(|b| s > scores[b]) {
            best = Some(i);
        }
    }
    best.map(|i| i as u32)
        .ok_or_else(|| Error::invalid("logits", "every logit is NaN"))
}

/// Ends generation on an end-of-sequence id or on a stop string in the
/// streamed text.
///
/// Text is pushed piece by piece as it is decoded. A stop string may span
/// pieces, so text that could be the start of one is held back until the
/// following text settles it; the text before a stop string is emitted,
/// the stop string itself and anything after it are not.
#[derive(Clone, Debug)]
pub struct StopCondition {
    eos_ids: Vec<u32>,
    stop_strings: Vec<String>,
    held: String,
}

/// What pushing a piece of text gives.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopStep {
    /// Text that can be shown: it is no part of a stop string.
    pub text: String,
    /// The stop string that was completed: generation ends here.
    pub stopped_by: Option<String>,
}

impl StopCondition {
    /// Stops on any of `eos_ids` or on any of `stop_strings` (none may be
    /// empty).
    pub fn new(eos_ids: Vec<u32>, stop_strings: Vec<String>) -> Result<StopCondition> {
        if stop_strings.iter().any(String::is_empty) {
            return Err(Error::invalid(
                "stop strings",
                "an empty stop string would stop at once",
            ));
        }
        Ok(StopCondition {
            eos_ids,
            stop_strings,
            held: String::new(),
        })
    }

    /// Whether `id` ends generation. Its text is not pushed; call
    /// [`finish`](Self::finish) for the text still held back.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }

    /// Adds decoded text; returns what can be shown and whether a stop
    /// string was completed.
    pub fn push(&mut self, text: &str) -> StopStep {
        self.held.push_str(text);
        let first_stop = self
            .stop_strings
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|&(at, _)| at);
        if let Some((at, stop)) = first_stop {
            let stop = stop.clone();
            self.held.truncate(at);
            return StopStep {
                text: std::mem::take(&mut self.held),
                stopped_by: Some(stop),
            };
        }
        // Hold back the longest tail that a stop string starts with.
        let tail = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stop_strings.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let rest = self.held.split_off(tail);
        StopStep {
            text: std::mem::replace(&mut self.held, rest),
            stopped_by: None,
        }
    }

    /// Generation ended otherwise (EOS, length): the text held back, which
    /// turned out to be no stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests;
