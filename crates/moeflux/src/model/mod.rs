//! An opened model: validated files, weights on a backend, the expert
//! store, and the forward pass over sequences.

use std::path::Path;

use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::blocks::Weights;
use crate::blocks::decoder::{Decoder, LayerState};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::experts::{ExpertStats, ExpertStore};
use crate::format::{ModelDir, OpenOptions};

/// Tokens processed together in one prefill step.
pub const DEFAULT_PREFILL_CHUNK: usize = 64;

#[derive(Clone, Debug)]
pub struct ModelOptions {
    /// Bytes of experts kept in memory; `None` picks a default from the
    /// model size and available memory.
    pub expert_cache_bytes: Option<u64>,
    pub prefill_chunk: usize,
    pub verify_checksums: bool,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            expert_cache_bytes: None,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            verify_checksums: true,
        }
    }
}

pub struct Model<B: Backend = CpuBackend> {
    dir: ModelDir,
    backend: B,
    decoder: Decoder<B>,
    store: ExpertStore,
    prefill_chunk: usize,
}

/// The state of one token sequence: KV caches and linear-attention states
/// for every layer, and how many tokens it holds.
pub struct Sequence<B: Backend = CpuBackend> {
    layers: Vec<LayerState<B>>,
    position: usize,
}

impl<B: Backend> Sequence<B> {
    /// Tokens processed so far.
    pub fn position(&self) -> usize {
        self.position
    }
}

/// Which positions' logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    All,
    Last,
}

/// Logits as a row-major `[rows, vocab]` matrix.
#[derive(Clone, Debug)]
pub struct Logits {
    pub rows: usize,
    pub vocab: usize,
    pub data: Vec<f32>,
}

impl Logits {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
}

impl Model<CpuBackend> {
    pub fn open(path: &Path, options: &ModelOptions) -> Result<Self> {
        Model::open_with(CpuBackend, path, options)
    }
}

impl<B: Backend> Model<B> {
    pub fn open_with(backend: B, path: &Path, options: &ModelOptions) -> Result<Self> {
        if options.prefill_chunk == 0 {
            return Err(Error::invalid("prefill chunk", "must be at least 1"));
        }
        let dir = ModelDir::open(
            path,
            OpenOptions {
                verify_checksums: options.verify_checksums,
            },
        )?;
        let budget = options
            .expert_cache_bytes
            .unwrap_or_else(|| default_cache_budget(dir.manifest().expert_bytes()));
        let store = ExpertStore::open(&dir, budget)?;
        let decoder = Decoder::load(&Weights {
            dir: &dir,
            backend: &backend,
        })?;
        Ok(Model {
            dir,
            backend,
            decoder,
            store,
            prefill_chunk: options.prefill_chunk,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        self.dir.config()
    }

    pub fn dir(&self) -> &ModelDir {
        &self.dir
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn expert_stats(&self) -> ExpertStats {
        self.store.stats()
    }

    pub fn expert_cache_budget(&self) -> u64 {
        self.store.cache_budget()
    }

    pub fn new_sequence(&self) -> Sequence<B> {
        Sequence {
            layers: self.decoder.new_state(&self.backend, self.config()),
            position: 0,
        }
    }

    fn check_tokens(&self, seq: &Sequence<B>, tokens: &[u32]) -> Result<()> {
        let cfg = self.config();
        if tokens.is_empty() {
            return Err(Error::invalid(
                "tokens",
                "the prompt is empty: give at least one token",
            ));
        }
        if let Some((i, &t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, t)| **t as usize >= cfg.vocab_size)
        {
            return Err(Error::invalid(
                "tokens",
                format!(
                    "token id {t} (at index {i}) is out of range: the vocabulary has {} ids (0..{})",
                    cfg.vocab_size,
                    cfg.vocab_size - 1
                ),
            ));
        }
        let end = seq.position + tokens.len();
        if end > cfg.max_position_embeddings {
            return Err(Error::invalid(
                "tokens",
                format!(
                    "{} tokens after position {} exceed the model's context of {} positions",
                    tokens.len(),
                    seq.position,
                    cfg.max_position_embeddings
                ),
            ));
        }
        Ok(())
    }

    /// Appends `tokens` to the sequence, processing them in chunks, and
    /// returns the logits asked for.
    pub fn forward(
        &self,
        seq: &mut Sequence<B>,
        tokens: &[u32],
        wanted: LogitsWanted,
    ) -> Result<Logits> {
        self.check_tokens(seq, tokens)?;
        let vocab = self.config().vocab_size;
        let mut data = Vec::new();
        let chunks: Vec<&[u32]> = tokens.chunks(self.prefill_chunk).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let rows = match wanted {
                LogitsWanted::All => chunk.len(),
                LogitsWanted::Last if i + 1 == chunks.len() => 1,
                LogitsWanted::Last => 0,
            };
            let logits =
                self.decoder
                    .forward(&self.backend, chunk, &mut seq.layers, &self.store, rows)?;
            seq.position += chunk.len();
            if let Some(logits) = logits {
                data.extend(self.backend.to_host(&logits));
            }
        }
        Ok(Logits {
            rows: data.len() / vocab,
            vocab,
            data,
        })
    }

    /// Greedy continuation of `prompt`: the prompt is prefilled, then each
    /// new token is fed back one at a time through the decode path.
    pub fn generate_greedy(&self, prompt: &[u32], max_new_tokens: usize) -> Result<Vec<u32>> {
        let mut seq = self.new_sequence();
        let mut logits = self.forward(&mut seq, prompt, LogitsWanted::Last)?;
        let mut out = Vec::with_capacity(max_new_tokens);
        for step in 0..max_new_tokens {
            let next = argmax(logits.row(0));
            out.push(next);
            if step + 1 < max_new_tokens {
                logits = self.forward(&mut seq, &[next], LogitsWanted::Last)?;
            }
        }
        Ok(out)
    }
}

/// Index of the largest value (the first on ties).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// Keeps every expert when they fit in half the available memory,
/// otherwise half the available memory.
fn default_cache_budget(expert_bytes: u64) -> u64 {
    let available = available_memory().unwrap_or(4 << 30);
    expert_bytes.min(available / 2)
}

fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
