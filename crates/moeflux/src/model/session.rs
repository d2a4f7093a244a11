//! Sessions: one token sequence each, with its KV caches and
//! Gated DeltaNet states, position checkpoints for prefix reuse, exact
//! truncation, and state save/load.
//!
//! Full-attention KV caches truncate exactly; Gated DeltaNet states cannot
//! be rewound, so a session keeps its token history and rebuilds a past
//! state by restoring the nearest checkpoint at or before it and prefilling
//! the tokens in between.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::batch::{BatchItem, forward_batch, run_rounds};
use super::hidden::HiddenStates;
use super::state;
use super::{Logits, LogitsWanted, Model};
use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, HostValues, KvType};
use crate::blocks::batch::Phase;
use crate::blocks::decoder::LayerState;
use crate::error::{Error, Result};

/// How [`Session::new`] sets up a session.
///
/// ```
/// use std::sync::Arc;
/// use moeflux::{Model, ModelOptions, Session, SessionOptions};
///
/// # let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
/// let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
/// let options = SessionOptions {
///     context: Some(256),
///     ..SessionOptions::default()
/// };
/// let session = Session::new(model.clone(), options);
/// assert_eq!(session.capacity(), 256);
/// # Ok::<(), moeflux::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Most positions the session may hold; `None` means the model's
    /// context length (`max_position_embeddings`).
    pub context: Option<usize>,
    /// Checkpoints kept besides the always-available empty state at
    /// position 0; beyond it the least recently used one goes, never the
    /// newest.
    pub max_checkpoints: usize,
    /// How the session's KV caches store keys and values; `None`: the
    /// model's type ([`Model::kv_type`]). A type the model cannot store is
    /// refused when the session first runs.
    pub kv_type: Option<KvType>,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            context: None,
            max_checkpoints: 4,
            kv_type: None,
        }
    }
}

pub(super) struct Checkpoint<B: Backend> {
    pub(super) position: usize,
    /// Per layer, a copy of the state that truncation cannot bring back:
    /// a Gated DeltaNet state or a sliding window's KV cache (`None` for
    /// full attention, whose KV cache is truncated instead).
    saved: Vec<Option<LayerState<B>>>,
    logits: Option<HostValues>,
    created: u64,
    used: u64,
}

/// One token sequence run through a [`Model`]: its tokens, KV caches,
/// Gated DeltaNet states and the logits predicting the next token.
///
/// [`prefill`](Session::prefill) appends a prompt,
/// [`decode`](Session::decode) one token, [`generate`](Session::generate)
/// continues with tokens a function picks. A session can go back:
/// [`truncate`](Session::truncate) to any earlier position,
/// [`restore_to`](Session::restore_to) to a [`checkpoint`](Session::checkpoint);
/// and its whole state can be saved and loaded
/// ([`save_state`](Session::save_state), [`load_state`](Session::load_state)).
///
/// ```
/// use std::sync::Arc;
/// use moeflux::{Model, ModelOptions};
///
/// # let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
/// let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
/// let mut session = model.session();
/// let logits = session.prefill(&[10, 20, 30])?;
/// let next = moeflux::model::argmax(&logits);
/// session.decode(next)?;
/// assert_eq!(session.tokens(), &[10, 20, 30, next]);
/// # Ok::<(), moeflux::Error>(())
/// ```
pub struct Session<B: Backend = CpuBackend> {
    pub(super) model: Arc<Model<B>>,
    pub(super) layers: Vec<LayerState<B>>,
    pub(super) tokens: Vec<u32>,
    capacity: usize,
    /// Logits after the last token, when known (shared with the
    /// [`Logits`] of the forward pass that made them).
    pub(super) logits: Option<HostValues>,
    pub(super) checkpoints: Vec<Checkpoint<B>>,
    max_checkpoints: usize,
    clock: u64,
    kv_type: KvType,
    kv_bytes_per_position: u64,
    kv_reserved: u64,
    interrupt: Option<Arc<AtomicBool>>,
    /// The tokens' hidden states, while kept
    /// ([`Session::keep_hidden_states`]).
    pub(super) hidden: Option<HiddenStates<B>>,
}

impl<B: Backend> Session<B> {
    /// A new, empty session of `model` ([`Model::session`] with default
    /// options). The context is `options.context`, at most the model's.
    pub fn new(model: Arc<Model<B>>, options: SessionOptions) -> Self {
        let context = model.config().max_position_embeddings;
        let kv_type = options.kv_type.unwrap_or(model.kv_type());
        Session {
            kv_type,
            kv_bytes_per_position: model.config().kv_bytes_per_position(kv_type),
            layers: Vec::new(),
            capacity: options.context.unwrap_or(context).min(context),
            model,
            tokens: Vec::new(),
            logits: None,
            checkpoints: Vec::new(),
            max_checkpoints: options.max_checkpoints.max(1),
            clock: 0,
            kv_reserved: 0,
            interrupt: None,
            hidden: None,
        }
    }

    /// The model the session runs.
    pub fn model(&self) -> &Arc<Model<B>> {
        &self.model
    }

    /// Tokens held.
    pub fn position(&self) -> usize {
        self.tokens.len()
    }

    /// Most tokens the session can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// How the session's KV caches store keys and values.
    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// Tokens the session can still take before its context is full.
    pub fn remaining(&self) -> usize {
        self.capacity - self.position()
    }

    /// A flag that, once raised, stops a long [`Session::forward`] (or
    /// prefill) between two of its chunks with [`Error::Interrupted`]. The
    /// chunks already run stay in the session, a consistent state ending
    /// earlier than asked.
    pub fn set_interrupt(&mut self, flag: Option<Arc<AtomicBool>>) {
        self.interrupt = flag;
    }

    /// Every token the session holds, in order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Logits predicting the token after the last one, when known (after a
    /// forward, a restore, or a load; not after an exact truncation of a
    /// model without linear attention).
    pub fn last_logits(&self) -> Option<&[f32]> {
        self.logits.as_deref()
    }

    /// Gives the last logits a vector of their own where they are a part
    /// of a step's download lent by the backend (see
    /// [`crate::backend::HostValues`]): for a session kept aside, so that
    /// the buffer serves later steps.
    pub fn detach_logits(&mut self) {
        if let Some(logits) = &mut self.logits {
            logits.detach();
        }
    }

    /// Positions of the stored checkpoints, ascending.
    pub fn checkpoints(&self) -> Vec<usize> {
        self.checkpoints.iter().map(|c| c.position).collect()
    }

    pub(super) fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.model.config().vocab_size;
        if tokens.is_empty() {
            return Err(Error::invalid(
                "tokens",
                "the prompt is empty: give at least one token",
            ));
        }
        if let Some((i, &t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, t)| **t as usize >= vocab)
        {
            return Err(Error::invalid(
                "tokens",
                format!(
                    "token id {t} (at index {i}) is out of range: the vocabulary has {vocab} ids (0..{})",
                    vocab - 1
                ),
            ));
        }
        if self.position() + tokens.len() > self.capacity {
            return Err(Error::invalid(
                "tokens",
                format!(
                    "{} more tokens after position {} exceed the session's context of {} positions",
                    tokens.len(),
                    self.position(),
                    self.capacity
                ),
            ));
        }
        Ok(())
    }

    /// Appends `tokens` and returns the logits asked for. On failure (a
    /// damaged expert file, say) the session is rebuilt to the position
    /// before the call where possible, never left half-updated; an
    /// interruption ([`Session::set_interrupt`]) keeps the chunks done.
    pub fn forward(&mut self, tokens: &[u32], wanted: LogitsWanted) -> Result<Logits> {
        self.forward_as(tokens, wanted, Phase::Prefill)
    }

    /// Appends generated tokens and returns the logits after each of them:
    /// the check of drafted tokens in speculative decoding.
    pub(crate) fn forward_drafted(&mut self, tokens: &[u32]) -> Result<Logits> {
        self.forward_as(tokens, LogitsWanted::All, Phase::Decode)
    }

    fn forward_as(&mut self, tokens: &[u32], wanted: LogitsWanted, phase: Phase) -> Result<Logits> {
        let mut item = [BatchItem {
            session: self,
            tokens,
            wanted,
            phase,
        }];
        Ok(forward_batch(&mut item)?.pop().expect("one item"))
    }

    /// Appends a prompt (at least one token, all within the vocabulary and
    /// the context); returns the logits after its last token, which predict
    /// the next.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use moeflux::{Model, ModelOptions};
    /// # let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
    /// # let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
    /// let mut session = model.session();
    /// let logits = session.prefill(&[1, 2, 3, 4])?;
    /// assert_eq!(logits.len(), model.config().vocab_size);
    /// assert_eq!(session.position(), 4);
    /// assert!(session.prefill(&[]).is_err());
    /// # Ok::<(), moeflux::Error>(())
    /// ```
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        Ok(self.forward(tokens, LogitsWanted::Last)?.into_vec())
    }

    /// Appends one token; returns the logits predicting the next.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use moeflux::{Model, ModelOptions};
    /// use moeflux::model::argmax;
    ///
    /// # let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
    /// # let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
    /// let mut session = model.session();
    /// let mut logits = session.prefill(&[1, 2, 3])?;
    /// for _ in 0..3 {
    ///     logits = session.decode(argmax(&logits))?;
    /// }
    /// assert_eq!(session.position(), 6);
    /// # Ok::<(), moeflux::Error>(())
    /// ```
    pub fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        Ok(self
            .forward_as(&[token], LogitsWanted::Last, Phase::Decode)?
            .into_vec())
    }

    /// Generates up to `max_new_tokens`, fewer if the context fills up
    /// first ([`Session::remaining`] is then 0). Each token is chosen by
    /// `pick` from the current logits, the tokens before this call (the
    /// prompt) and those generated so far; it is appended to the session
    /// (so the session always ends with the logits of what comes next) and
    /// passed to `on_token`, which can stop generation. Returns the new
    /// tokens.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use moeflux::{Model, ModelOptions};
    /// use std::ops::ControlFlow;
    /// use moeflux::model::argmax;
    ///
    /// # let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
    /// # let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
    /// let mut session = model.session();
    /// session.prefill(&[1, 2, 3])?;
    /// // Greedy, stopping after the second token.
    /// let mut seen = 0;
    /// let new = session.generate(
    ///     10,
    ///     |logits, _prompt, _generated| Ok(argmax(logits)),
    ///     |_token| {
    ///         seen += 1;
    ///         Ok(if seen == 2 { ControlFlow::Break(()) } else { ControlFlow::Continue(()) })
    ///     },
    /// )?;
    /// assert_eq!(new.len(), 2);
    /// assert_eq!(session.position(), 5);
    /// # Ok::<(), moeflux::Error>(())
    /// ```
    pub fn generate(
        &mut self,
        max_new_tokens: usize,
        mut pick: impl FnMut(&[f32], &[u32], &[u32]) -> Result<u32>,
        mut on_token: impl FnMut(u32) -> Result<ControlFlow<()>>,
    ) -> Result<Vec<u32>> {
        let mut logits = self.current_logits()?;
        let prompt_len = self.position();
        let steps = max_new_tokens.min(self.remaining());
        let mut out = Vec::with_capacity(steps);
        for _ in 0..steps {
            let next = pick(&logits, &self.tokens[..prompt_len], &out)?;
            logits = self.decode(next)?;
            out.push(next);
            if on_token(next)?.is_break() {
                break;
            }
        }
        Ok(out)
    }

    /// The logits after the last token, recomputing them if an exact
    /// truncation dropped them.
    pub(crate) fn current_logits(&mut self) -> Result<Vec<f32>> {
        if let Some(logits) = &self.logits {
            return Ok(logits.to_vec());
        }
        let Some(&last) = self.tokens.last() else {
            return Err(Error::invalid(
                "generate",
                "the session is empty: prefill a prompt first",
            ));
        };
        self.truncate(self.position() - 1)?;
        self.decode(last)
    }

    /// Runs tokens in prefill chunks, extending the history chunk by
    /// chunk (no checks, no rollback: see [`forward_batch`]).
    pub(super) fn run(&mut self, tokens: &[u32], wanted: LogitsWanted) -> Result<Logits> {
        let mut item = [BatchItem {
            session: self,
            tokens,
            wanted,
            phase: Phase::Prefill,
        }];
        Ok(run_rounds(&mut item)?.pop().expect("one item"))
    }

    pub(super) fn interrupted(&self) -> bool {
        self.interrupt
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// Stores a checkpoint at the current position and returns it. The
    /// empty state (position 0) needs none. At most
    /// [`SessionOptions::max_checkpoints`] are kept.
    ///
    /// Checkpoint a shared prefix (a system prompt, say) to go back to it
    /// with [`Session::restore_to`] without running it again:
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use moeflux::{Model, ModelOptions};
    /// # let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
    /// # let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
    /// let mut session = model.session();
    /// let after_prefix = session.prefill(&[1, 2, 3])?;
    /// let prefix = session.checkpoint()?;
    /// assert_eq!(prefix, 3);
    /// assert_eq!(session.checkpoints(), vec![3]);
    ///
    /// session.prefill(&[4, 5])?;
    /// session.restore_to(prefix)?;
    /// assert_eq!(session.tokens(), &[1, 2, 3]);
    /// assert_eq!(session.last_logits(), Some(after_prefix.as_slice()));
    /// # Ok::<(), moeflux::Error>(())
    /// ```
    pub fn checkpoint(&mut self) -> Result<usize> {
        let position = self.position();
        if position == 0 {
            return Ok(0);
        }
        let saved = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| self.model.copy_unrewindable(i, l))
            .collect::<Result<_>>()?;
        self.clock += 1;
        let checkpoint = Checkpoint {
            position,
            saved,
            // A copy of their own: a checkpoint may be kept long.
            logits: self.logits.clone().map(|mut l| {
                l.detach();
                l
            }),
            created: self.clock,
            used: self.clock,
        };
        match self
            .checkpoints
            .binary_search_by_key(&position, |c| c.position)
        {
            Ok(i) => self.checkpoints[i] = checkpoint,
            Err(i) => self.checkpoints.insert(i, checkpoint),
        }
        while self.checkpoints.len() > self.max_checkpoints {
            let newest = self.checkpoints.iter().map(|c| c.created).max().unwrap();
            let (victim, _) = self
                .checkpoints
                .iter()
                .enumerate()
                .filter(|(_, c)| c.created != newest)
                .min_by_key(|(_, c)| c.used)
                .expect("more than one checkpoint");
            self.checkpoints.remove(victim);
        }
        Ok(position)
    }

    /// Removes the checkpoint at `position`; false if there was none.
    pub fn forget(&mut self, position: usize) -> bool {
        let before = self.checkpoints.len();
        self.checkpoints.retain(|c| c.position != position);
        before != self.checkpoints.len()
    }

    /// Returns to a checkpointed position (0 always works; a model without
    /// linear or sliding-window attention can return to any earlier
    /// position). Checkpoints
    /// after it are dropped. Elsewhere it fails and leaves the session as
    /// it was; [`Session::truncate`] goes to any position.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use moeflux::{Model, ModelOptions};
    /// # let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
    /// # let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
    /// let mut session = model.session();
    /// session.prefill(&[1, 2])?;
    /// let at = session.checkpoint()?;
    /// session.prefill(&[3, 4, 5])?;
    ///
    /// // The bundled model has linear-attention layers: only a checkpoint
    /// // (or the empty state) can be restored.
    /// assert!(session.restore_to(4).is_err());
    /// session.restore_to(at)?;
    /// assert_eq!(session.position(), 2);
    /// session.restore_to(0)?;
    /// assert!(session.tokens().is_empty());
    /// # Ok::<(), moeflux::Error>(())
    /// ```
    pub fn restore_to(&mut self, position: usize) -> Result<()> {
        self.check_position(position)?;
        let exact = position == 0 || self.checkpoints.iter().any(|c| c.position == position);
        if exact {
            self.apply_checkpoint(position)?;
        } else if self.model.rewinds_by_truncation() {
            self.rebuild(position)?;
        } else {
            return Err(Error::invalid(
                "restore_to",
                format!(
                    "no checkpoint at position {position} (checkpoints: {:?}); \
                     truncate({position}) rebuilds from the nearest earlier one",
                    self.checkpoints()
                ),
            ));
        }
        self.checkpoints.retain(|c| c.position <= position);
        self.sync_kv();
        Ok(())
    }

    /// Removes every position at or after `position`, as if only the first
    /// `position` tokens had been given. Exact for any position: KV caches
    /// are cut, and Gated DeltaNet states are rebuilt from the nearest
    /// checkpoint at or before it by running the tokens in between again.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use moeflux::{Model, ModelOptions};
    /// # let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
    /// # let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
    /// let mut session = model.session();
    /// let expected = session.prefill(&[1, 2, 3])?;
    /// session.prefill(&[4, 5, 6])?;
    ///
    /// session.truncate(3)?;
    /// assert_eq!(session.tokens(), &[1, 2, 3]);
    /// assert_eq!(session.last_logits(), Some(expected.as_slice()));
    /// # Ok::<(), moeflux::Error>(())
    /// ```
    pub fn truncate(&mut self, position: usize) -> Result<()> {
        self.check_position(position)?;
        if position < self.position() {
            let result = self.rebuild(position);
            let kept = self.position();
            self.checkpoints.retain(|c| c.position <= kept);
            self.sync_kv();
            result?;
        }
        Ok(())
    }

    /// Empties the session and drops its checkpoints.
    pub fn clear(&mut self) {
        self.reset();
        self.checkpoints.clear();
        self.sync_kv();
    }

    /// Back to the empty state; the layer states are made again when next
    /// needed.
    fn reset(&mut self) {
        self.layers = Vec::new();
        self.tokens.clear();
        self.logits = None;
        if self.hidden.is_some() {
            self.hidden = Some(HiddenStates::starting_at(0));
        }
    }

    /// The layer states, made on first use (making them can fail on a
    /// device short of memory; a session costs nothing until then).
    pub(super) fn layers_mut(&mut self) -> Result<&mut [LayerState<B>]> {
        if self.layers.is_empty() {
            self.layers = self.model.new_layer_states(self.kv_type)?;
        }
        Ok(&mut self.layers)
    }

    fn check_position(&self, position: usize) -> Result<()> {
        if position > self.position() {
            return Err(Error::invalid(
                "position",
                format!(
                    "{position} is beyond the session's {} tokens",
                    self.position()
                ),
            ));
        }
        Ok(())
    }

    /// Puts the layer states back to checkpoint `position` (0: empty).
    fn apply_checkpoint(&mut self, position: usize) -> Result<()> {
        let b = self.model.backend();
        if position == 0 {
            self.reset();
            return Ok(());
        }
        self.clock += 1;
        let clock = self.clock;
        let ckpt = self
            .checkpoints
            .iter_mut()
            .find(|c| c.position == position)
            .expect("caller checked the checkpoint exists");
        ckpt.used = clock;
        // Copies first, so that a failed one leaves the state as it was.
        let copies = ckpt
            .saved
            .iter()
            .enumerate()
            .map(|(i, saved)| match saved {
                Some(state) => self.model.copy_unrewindable(i, state),
                None => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        for (layer, copy) in self.layers.iter_mut().zip(copies) {
            match (layer, copy) {
                (layer, Some(copy)) => *layer = copy,
                (LayerState::Attention(cache), None) => b.kv_truncate(cache, position),
                (LayerState::DeltaNet(_), None) => {
                    unreachable!("checkpoints store every Gated DeltaNet layer")
                }
            }
        }
        self.logits = ckpt.logits.clone();
        self.truncate_tokens(position)?;
        Ok(())
    }

    /// Brings the state to exactly the first `target` tokens of the
    /// history: KV caches are cut; Gated DeltaNet states and sliding
    /// windows come from the nearest checkpoint at or before `target`, then
    /// the tokens in between are prefilled again.
    pub(super) fn rebuild(&mut self, target: usize) -> Result<()> {
        if self.model.rewinds_by_truncation() {
            let b = self.model.backend();
            for layer in &mut self.layers {
                if let LayerState::Attention(cache) = layer {
                    b.kv_truncate(cache, target);
                }
            }
            self.truncate_tokens(target)?;
            self.logits = None;
            return Ok(());
        }
        let history = self.tokens[..target].to_vec();
        let base = self
            .checkpoints
            .iter()
            .map(|c| c.position)
            .filter(|&p| p <= target)
            .max()
            .unwrap_or(0);
        self.apply_checkpoint(base)?;
        if base < target
            && let Err(err) = self.run(&history[base..], LogitsWanted::Last)
        {
            self.apply_checkpoint(base)?;
            return Err(err);
        }
        Ok(())
    }

    /// Grows this session's share of the model's KV budget to cover
    /// `positions`.
    pub(super) fn reserve_kv(&mut self, positions: usize) -> Result<()> {
        let needed = positions as u64 * self.kv_bytes_per_position;
        if needed > self.kv_reserved {
            self.model.kv.reserve(needed - self.kv_reserved)?;
            self.kv_reserved = needed;
        }
        Ok(())
    }

    /// Returns what the session no longer holds to the KV budget.
    pub(super) fn sync_kv(&mut self) {
        let held = self.position() as u64 * self.kv_bytes_per_position;
        if held < self.kv_reserved {
            self.model.kv.release(self.kv_reserved - held);
            self.kv_reserved = held;
        }
    }

    /// The session's tokens, KV caches, Gated DeltaNet states and last
    /// logits, as bytes (versioned, checksummed, tied to this model).
    /// [`Session::load_state`] puts them into a session of the same model.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use moeflux::{Model, ModelOptions};
    /// use std::path::Path;
    ///
    /// # let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
    /// # let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
    /// let mut session = model.session();
    /// session.prefill(&[1, 2, 3])?;
    /// let saved = session.save_state()?;
    ///
    /// let mut other = model.session();
    /// other.load_state(&saved, Path::new("<memory>"))?;
    /// assert_eq!(other.tokens(), session.tokens());
    /// assert_eq!(other.last_logits(), session.last_logits());
    /// # Ok::<(), moeflux::Error>(())
    /// ```
    pub fn save_state(&self) -> Result<Vec<u8>> {
        let fresh;
        let layers = if self.layers.is_empty() {
            fresh = self.model.new_layer_states(self.kv_type)?;
            &fresh
        } else {
            &self.layers
        };
        let logits = self.logits.as_deref();
        state::encode(&self.model, self.kv_type, layers, &self.tokens, logits)
    }

    /// Writes [`Session::save_state`] to a file (through a temporary name).
    pub fn save_state_file(&self, path: &Path) -> Result<()> {
        crate::convert::write_atomic(path, &self.save_state()?)
    }

    /// Replaces the session's state with a saved one
    /// ([`Session::save_state`]); `source` names where the bytes came from,
    /// in errors. Checkpoints are dropped. A state saved from another
    /// model or with another KV type, or damaged, is refused and the
    /// session left as it was.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use moeflux::{Model, ModelOptions};
    /// use std::path::Path;
    ///
    /// # let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
    /// # let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
    /// let mut session = model.session();
    /// session.prefill(&[1, 2, 3])?;
    /// let mut saved = session.save_state()?;
    ///
    /// let mut other = model.session();
    /// other.load_state(&saved, Path::new("<memory>"))?;
    /// assert_eq!(other.position(), 3);
    ///
    /// let last = saved.len() - 1;
    /// saved[last] ^= 1;
    /// assert!(other.load_state(&saved, Path::new("<memory>")).is_err());
    /// assert_eq!(other.position(), 3);
    /// # Ok::<(), moeflux::Error>(())
    /// ```
    pub fn load_state(&mut self, bytes: &[u8], source: &Path) -> Result<()> {
        let loaded = state::decode(&self.model, self.kv_type, bytes, source)?;
        if loaded.tokens.len() > self.capacity {
            return Err(Error::bad_file(
                source,
                format!(
                    "holds {} tokens, more than the session's context of {}",
                    loaded.tokens.len(),
                    self.capacity
                ),
            ));
        }
        self.reserve_kv(loaded.tokens.len())?;
        self.layers = loaded.layers;
        self.tokens = loaded.tokens;
        self.logits = loaded.logits.map(HostValues::from);
        if self.hidden.is_some() {
            self.hidden = Some(HiddenStates::starting_at(self.position()));
        }
        self.checkpoints.clear();
        self.sync_kv();
        Ok(())
    }

    /// Reads a file written by [`Session::save_state_file`] into the
    /// session, as [`Session::load_state`] does.
    pub fn load_state_file(&mut self, path: &Path) -> Result<()> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, "reading session state", e))?;
        self.load_state(&bytes, path)
    }
}

impl<B: Backend> Drop for Session<B> {
    fn drop(&mut self) {
        self.model.kv.release(self.kv_reserved);
    }
}
