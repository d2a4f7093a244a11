//! An opened model: validated files, weights on a backend, the expert
//! store, and the forward pass that [`Session`]s drive.
//!
//! A [`Model`] is immutable once open and safe to share between threads
//! (wrap it in an [`Arc`]); each conversation is a [`Session`] holding its
//! own KV caches and Gated DeltaNet states, while all sessions share the
//! weights and one expert cache.

mod batch;
mod hidden;
mod recorded;
mod rewind;
mod session;
mod state;

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub use crate::blocks::batch::Phase;
pub use batch::{BatchItem, forward_batch};
pub use rewind::RewindPoint;
pub use session::{Session, SessionOptions};

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, HostValues, KvType};
use crate::blocks::Weights;
use crate::blocks::batch::ForwardBatch;
use crate::blocks::decoder::{Decoder, DecoderOutput, LayerState};
use crate::blocks::mtp::MtpOutput;
use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::experts::{
    CachePolicy, ExpertStats, ExpertStore, IoMode, Prefetch, StoreOptions, available_memory,
};
use crate::format::{ModelDir, OpenOptions};
use crate::util::{Progress, human_bytes};

pub use crate::backend::DEFAULT_PREFILL_CHUNK;

/// How [`Model::open`] opens a model: expert cache, reads, prefetch,
/// prefill chunk, checks and the KV memory limit. [`Default`] suits most
/// uses; set the fields that matter and take the rest from it.
///
/// ```
/// use std::sync::Arc;
/// use moeflux::{Model, ModelOptions};
///
/// let options = ModelOptions {
///     expert_cache_bytes: Some(64 << 20),
///     kv_limit_bytes: Some(256 << 20),
///     ..ModelOptions::default()
/// };
/// # let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
/// let model = Model::open(&dir, &options)?;
/// assert_eq!(model.expert_cache_budget(), 64 << 20);
/// # Ok::<(), moeflux::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct ModelOptions {
    /// Bytes of experts kept in memory; `None` picks a default from the
    /// model size and available memory ([`default_cache_budget`]).
    pub expert_cache_bytes: Option<u64>,
    /// Which experts the cache evicts first when it is full.
    pub cache_policy: CachePolicy,
    /// How expert files are read (through the page cache or not).
    pub io: IoMode,
    /// Which experts are read ahead for the next layer during decode.
    pub prefetch: Prefetch,
    /// Tokens processed together in one prefill step; `None`: the
    /// backend's choice ([`Backend::default_prefill_chunk`]).
    pub prefill_chunk: Option<usize>,
    /// Hash the dense weight file against the manifest's checksum when
    /// opening (on by default; the file is read once more). Expert blobs
    /// are always checked as they are read.
    pub verify_checksums: bool,
    /// Bytes all sessions together may hold in KV caches; `None` is no
    /// limit beyond each session's context length.
    pub kv_limit_bytes: Option<u64>,
    /// Open the model's multi-token-prediction head, when it has one (on
    /// by default): what `--draft mtp` drafts with. Off, its weights take
    /// no memory on the backend and its experts none in the cache.
    pub mtp_head: bool,
    /// How sessions' KV caches store keys and values unless a session's
    /// options say otherwise; `None`: the backend's default
    /// ([`Backend::default_kv_type`]), or f32 where the model cannot use
    /// it. Refused at open where the model cannot store it.
    pub kv_type: Option<KvType>,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            expert_cache_bytes: None,
            cache_policy: CachePolicy::default(),
            io: IoMode::default(),
            prefetch: Prefetch::default(),
            prefill_chunk: None,
            verify_checksums: true,
            kv_limit_bytes: None,
            mtp_head: true,
            kv_type: None,
        }
    }
}

/// An opened model directory: the dense weights on a backend (the CPU
/// unless [`Model::open_with`] names another), the expert store, and the
/// forward pass. Open it once, wrap it in an [`Arc`] and start a
/// [`Session`] per conversation ([`Model::session`]); sessions on other
/// threads share the weights and the expert cache.
///
/// ```
/// use std::sync::Arc;
/// use moeflux::{Model, ModelOptions};
///
/// let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
/// let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
/// assert_eq!(model.config().vocab_size, 4096);
///
/// let prompt = [1, 2, 3];
/// let new = model.generate_greedy(&prompt, 4)?;
/// assert_eq!(new.len(), 4);
/// # Ok::<(), moeflux::Error>(())
/// ```
pub struct Model<B: Backend = CpuBackend> {
    dir: ModelDir,
    backend: B,
    decoder: Decoder<B>,
    store: ExpertStore,
    prefill_chunk: usize,
    fingerprint: u64,
    kv: KvBudget,
    kv_type: KvType,
    options: ModelOptions,
}

/// What [`Model::run_batch`] returns.
pub(crate) struct BatchOutput<B: Backend> {
    /// The logits of the rows the batch wants, on the host: each segment's
    /// rows (`logit_rows` of them, possibly none), a part of its own.
    pub logits: Option<Vec<HostValues>>,
    /// Every row's hidden state after the final norm, when asked for.
    pub hidden: Option<B::Tensor>,
}

/// Which positions' logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// One row per token given.
    All,
    /// The last token's row only.
    Last,
}

/// Logits as a row-major `[rows, vocab]` matrix.
#[derive(Clone, Debug)]
pub struct Logits {
    /// Positions.
    pub rows: usize,
    /// Logits per position: the vocabulary size.
    pub vocab: usize,
    /// `rows * vocab` values. Shared with the session when they are one
    /// row (the session keeps its last row), and a step of many sequences
    /// on a GPU lends each its part of the download (see [`HostValues`]);
    /// [`Logits::into_vec`] gives a vector of one's own.
    pub data: HostValues,
}

impl Logits {
    /// The logits of row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    /// The logits of the last row.
    pub fn last(&self) -> &[f32] {
        self.row(self.rows - 1)
    }

    /// The values as a vector of one's own: moved out, or copied while the
    /// session still shares them.
    pub fn into_vec(self) -> Vec<f32> {
        self.data.into_vec()
    }
}

/// The KV memory all sessions of a model share.
struct KvBudget {
    limit: Option<u64>,
    used: AtomicU64,
}

impl KvBudget {
    /// Takes `bytes` more from the budget, or explains why it cannot.
    fn reserve(&self, bytes: u64) -> Result<()> {
        let Some(limit) = self.limit else {
            self.used.fetch_add(bytes, Ordering::Relaxed);
            return Ok(());
        };
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= limit)
            })
            .map(|_| ())
            .map_err(|used| {
                Error::invalid(
                    "KV cache limit",
                    format!(
                        "{} more would exceed the limit of {} ({} held by open sessions); \
                         raise the limit, truncate or end sessions",
                        human_bytes(bytes),
                        human_bytes(limit),
                        human_bytes(used)
                    ),
                )
            })
    }

    fn release(&self, bytes: u64) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
    }
}

impl Model<CpuBackend> {
    /// Opens the model directory at `path` (made by [`convert::convert`]
    /// or `moeflux convert`) on the CPU backend: the manifest is checked,
    /// the dense weights are mapped, and experts are read on demand.
    ///
    /// ```
    /// use moeflux::{Model, ModelOptions};
    ///
    /// let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
    /// let model = Model::open(&dir, &ModelOptions::default())?;
    /// assert_eq!(model.dir().root(), dir.as_path());
    /// # Ok::<(), moeflux::Error>(())
    /// ```
    ///
    /// [`convert::convert`]: crate::convert::convert
    pub fn open(path: &Path, options: &ModelOptions) -> Result<Self> {
        Model::open_with(CpuBackend::default(), path, options)
    }
}

impl<B: Backend> Model<B> {
    /// [`Model::open`] on the given backend: the CPU one with settings of
    /// its own, or a device backend from [`crate::backend`].
    ///
    /// ```
    /// use moeflux::backend::cpu::CpuBackend;
    /// use moeflux::{Model, ModelOptions};
    ///
    /// # let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
    /// let model = Model::open_with(CpuBackend::default(), &dir, &ModelOptions::default())?;
    /// assert!(model.default_context() >= 1);
    /// # Ok::<(), moeflux::Error>(())
    /// ```
    pub fn open_with(backend: B, path: &Path, options: &ModelOptions) -> Result<Self> {
        let prefill_chunk = options
            .prefill_chunk
            .unwrap_or_else(|| backend.default_prefill_chunk());
        if prefill_chunk == 0 {
            return Err(Error::invalid("prefill chunk", "must be at least 1"));
        }
        let dir = ModelDir::open(
            path,
            OpenOptions {
                verify_checksums: options.verify_checksums,
                mtp_head: options.mtp_head,
            },
        )?;
        let kv_type = dir
            .config()
            .kv_type(options.kv_type, backend.default_kv_type())
            .map_err(|why| Error::invalid("KV cache type (--kv-type)", why))?;
        let store = ExpertStore::open(
            &dir,
            StoreOptions {
                cache_bytes: options
                    .expert_cache_bytes
                    .unwrap_or_else(|| default_cache_budget(dir.manifest())),
                policy: options.cache_policy,
                io: options.io,
            },
        )?;
        let decoder = Decoder::load(
            &Weights {
                dir: &dir,
                backend: &backend,
            },
            options.prefetch,
        )?;
        Ok(Model {
            fingerprint: fingerprint(&dir),
            kv: KvBudget {
                limit: options.kv_limit_bytes,
                used: AtomicU64::new(0),
            },
            kv_type,
            dir,
            backend,
            decoder,
            store,
            prefill_chunk,
            options: options.clone(),
        })
    }

    /// Readies the backend before the first token: the CPU reads every
    /// expert into the expert cache when they all fit its budget, a GPU
    /// uploads every expert when they all fit in its memory (see
    /// [`Backend::prepare_experts`]).
    pub fn prepare_experts(&self, progress: &dyn Progress) -> Result<()> {
        self.backend.prepare_experts(&self.store, progress)
    }

    /// The model's configuration (shapes, layers, vocabulary, context).
    pub fn config(&self) -> &ModelConfig {
        self.dir.config()
    }

    /// The options the model was opened with.
    pub fn options(&self) -> &ModelOptions {
        &self.options
    }

    /// Prompt tokens run in one forward pass: a scheduler that cuts
    /// prompts at multiples of it runs the same passes as
    /// [`Session::prefill`], so its results equal the session's alone.
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// The opened model directory (manifest, files).
    pub fn dir(&self) -> &ModelDir {
        &self.dir
    }

    /// The backend the model runs on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The expert store's counters (cache hits, reads, bytes).
    pub fn expert_stats(&self) -> ExpertStats {
        self.store.stats()
    }

    /// Bytes of experts the cache may hold.
    pub fn expert_cache_budget(&self) -> u64 {
        self.store.cache_budget()
    }

    /// The expert store (cache, reads, prefetch, statistics).
    pub fn experts(&self) -> &ExpertStore {
        &self.store
    }

    /// Identifies the model's exact weights; saved session states carry it
    /// so a state is never loaded into another model.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Bytes of KV cache held by all sessions.
    pub fn kv_bytes_in_use(&self) -> u64 {
        self.kv.used.load(Ordering::Relaxed)
    }

    /// How sessions' KV caches store keys and values unless a session's
    /// options say otherwise.
    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// Bytes of KV cache one position of a session takes with the model's
    /// KV type.
    pub fn kv_bytes_per_position(&self) -> u64 {
        self.config().kv_bytes_per_position(self.kv_type)
    }

    /// The context a session gets by default: the model's
    /// (`max_position_embeddings`), bounded so that one session's KV cache
    /// (of the model's KV type) takes at most half the memory free now on
    /// the backend.
    pub fn default_context(&self) -> usize {
        let model = self.config().max_position_embeddings;
        match (self.backend.state_memory(), self.kv_bytes_per_position()) {
            (Some(free), per) if per > 0 => model.min((free / 2 / per).max(1) as usize),
            _ => model,
        }
    }

    /// A new, empty session with default options
    /// ([`Session::new`] takes [`SessionOptions`]).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use moeflux::{Model, ModelOptions};
    ///
    /// # let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
    /// let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
    /// let mut session = model.session();
    /// let logits = session.prefill(&[1, 2, 3])?;
    /// assert_eq!(logits.len(), model.config().vocab_size);
    /// assert_eq!(session.position(), 3);
    /// # Ok::<(), moeflux::Error>(())
    /// ```
    pub fn session(self: &Arc<Self>) -> Session<B> {
        Session::new(self.clone(), SessionOptions::default())
    }

    /// A new, empty session with `options` (its context, the checkpoints
    /// it keeps).
    pub fn session_with(self: &Arc<Self>, options: SessionOptions) -> Session<B> {
        Session::new(self.clone(), options)
    }

    /// Whether cutting the KV caches brings a session back to any earlier
    /// position: not with Gated DeltaNet states or sliding windows, which
    /// have let go of what earlier positions had.
    fn rewinds_by_truncation(&self) -> bool {
        self.config()
            .layers
            .iter()
            .all(|l| l.kind == LayerKind::FullAttention)
    }

    /// A copy of layer `layer`'s state if truncation cannot restore it (a
    /// Gated DeltaNet state, a sliding window's KV cache), for a
    /// checkpoint; `None` for a full-attention KV cache.
    fn copy_unrewindable(
        &self,
        layer: usize,
        state: &LayerState<B>,
    ) -> Result<Option<LayerState<B>>> {
        let b = &self.backend;
        Ok(match state {
            LayerState::DeltaNet(s) => Some(LayerState::DeltaNet(b.delta_net_copy(s)?)),
            LayerState::Attention(cache) => {
                let shape = crate::blocks::attention::shape(self.config(), layer);
                match shape.window {
                    Some(_) => Some(LayerState::Attention(b.kv_copy(shape, cache)?)),
                    None => None,
                }
            }
        })
    }

    /// Empty layer states of a sequence whose KV caches store `kv`, or why
    /// this model cannot store it.
    fn new_layer_states(&self, kv: KvType) -> Result<Vec<LayerState<B>>> {
        self.config()
            .kv_type(Some(kv), kv)
            .map_err(|why| Error::invalid("KV cache type (SessionOptions::kv_type)", why))?;
        self.decoder.new_state(&self.backend, self.config(), kv)
    }

    /// Runs a batch through the decoder, `states[i]` holding sequence
    /// `i`'s layers, and returns the logits of the rows the batch wants,
    /// on the host, and with `keep_hidden` every row's hidden state after
    /// the final norm, on the backend.
    pub(crate) fn run_batch(
        &self,
        states: &mut [&mut [LayerState<B>]],
        batch: &ForwardBatch,
        keep_hidden: bool,
    ) -> Result<BatchOutput<B>> {
        let out = self.on_worker(|| self.forward_on_backend(states, batch, keep_hidden))?;
        let vocab = self.config().vocab_size;
        let parts: Vec<usize> = batch
            .segments
            .iter()
            .map(|s| s.logit_rows * vocab)
            .collect();
        Ok(BatchOutput {
            logits: out
                .logits
                .map(|l| self.backend.host_parts(l, &parts))
                .transpose()?,
            hidden: out.hidden,
        })
    }

    /// Runs `work` where the backend computes best. On a worker of the
    /// thread pool, the CPU backend's parallel operations fork from inside
    /// the pool instead of each being injected from outside and waited for
    /// (hundreds per token). A device backend runs on this thread: the
    /// hand-over to a worker and back would add two thread wake-ups to
    /// every token.
    pub(crate) fn on_worker<T: Send>(&self, work: impl FnOnce() -> T + Send) -> T {
        match self.backend.forks_on_host() {
            true => rayon::join(work, || ()).0,
            false => work(),
        }
    }

    /// [`Decoder::forward`], except that a decode step whose experts the
    /// backend holds entirely may be recorded by the backend and replayed
    /// on later steps (see `recorded.rs`).
    fn forward_on_backend(
        &self,
        states: &mut [&mut [LayerState<B>]],
        batch: &ForwardBatch,
        keep_hidden: bool,
    ) -> Result<DecoderOutput<B>> {
        if !keep_hidden && let Some(logits) = self.recorded_step(states, batch)? {
            return Ok(DecoderOutput {
                logits: Some(logits),
                hidden: None,
            });
        }
        self.decoder
            .forward(&self.backend, batch, states, &self.store, keep_hidden)
    }

    /// Whether the model has a multi-token-prediction head (converted from
    /// a checkpoint that ships one): `--draft mtp` drafts with it.
    pub fn has_mtp(&self) -> bool {
        self.decoder.mtp().is_some()
    }

    /// An empty KV cache of the multi-token-prediction head's layer, keys
    /// and values stored as `kv`.
    pub(crate) fn new_mtp_state(&self, kv: KvType) -> Result<LayerState<B>> {
        let mtp = self
            .decoder
            .mtp()
            .expect("asked of a model with an MTP head");
        mtp.new_state(&self.backend, self.config(), kv)
    }

    /// Runs rows of positions `first..` through the multi-token-prediction
    /// head ([`MtpHead::forward`](crate::blocks::mtp::MtpHead::forward)):
    /// `hidden` the hidden states, `tokens` the token after each position;
    /// the logits and chained hidden states of the last `wanted` rows.
    pub(crate) fn mtp_forward(
        &self,
        state: &mut LayerState<B>,
        hidden: &B::Tensor,
        tokens: &[u32],
        first: usize,
        wanted: usize,
    ) -> Result<MtpOutput<B>> {
        self.on_worker(|| {
            self.decoder.mtp_forward(
                &self.backend,
                state,
                hidden,
                tokens,
                first,
                wanted,
                &self.store,
            )
        })
    }

    /// Greedy continuation of `prompt` in a fresh session: the prompt is
    /// prefilled, then each new token is fed back through the decode path.
    pub fn generate_greedy(
        self: &Arc<Self>,
        prompt: &[u32],
        max_new_tokens: usize,
    ) -> Result<Vec<u32>> {
        let mut session = self.session();
        session.prefill(prompt)?;
        session.generate(
            max_new_tokens,
            |logits, _, _| Ok(argmax(logits)),
            |_| Ok(ControlFlow::Continue(())),
        )
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

/// Hash of every file checksum and the configuration.
fn fingerprint(dir: &ModelDir) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for f in &dir.manifest().files {
        h.update(f.path.as_bytes());
        h.update(f.xxh3.as_bytes());
    }
    h.update(dir.manifest().config.to_string().as_bytes());
    h.digest()
}

/// The default expert cache: every expert when they fit in half the
/// memory available now, otherwise half of it less the dense weights
/// (which are mapped and compete for the same memory).
pub fn default_cache_budget(manifest: &crate::format::Manifest) -> u64 {
    let available = available_memory().unwrap_or(4 << 30);
    let experts = manifest.expert_bytes();
    if experts <= available / 2 {
        experts
    } else {
        (available / 2)
            .saturating_sub(manifest.dense_bytes())
            .max(available / 8)
    }
}
