//! The operations a model's forward pass is written in. Each backend (CPU,
//! CUDA) implements them over its own tensor and weight types;
//! the model definition in [`crate::blocks`] is written once against this
//! trait, so backends differ in how they compute, never in what.
//!
//! Activations are row-major matrices `[tokens, features]` in f32; heads
//! are contiguous column ranges of a row.
//!
//! Every operation that computes or allocates returns a [`Result`]: a
//! device failure (out of memory included) reaches the caller as
//! [`crate::Error::Device`] instead of ending the process, and the engine
//! rolls back the sequences of the pass that failed.

pub mod cpu;
pub mod cuda;
pub mod kv;

mod host_values;
mod stats;

pub use host_values::HostValues;
pub(crate) use host_values::{into_parts, split_parts};
pub use kv::{KvRows, KvType};
pub use stats::DeviceExpertStats;

/// Tokens processed together in one prefill step, unless the backend
/// prefers another number ([`Backend::default_prefill_chunk`]) or the
/// model's options name one.
pub const DEFAULT_PREFILL_CHUNK: usize = 64;

use std::ops::Range;

use crate::config::{ExpertActivation, LinearAttentionConfig, MlaConfig, RouterSpec};
use crate::error::Result;
use crate::experts::ExpertStore;
use crate::format::{TensorData, TensorRole};
use crate::rope::Yarn;
use crate::util::Progress;

/// Geometry of grouped-query attention.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Sliding-window attention: a query sees this many positions, its own
    /// included, and the KV cache keeps only what later queries can see.
    pub window: Option<usize>,
    /// Multi-head latent attention's cache: one row of `head_dim` per
    /// position (the latent and the rotary key) and no values.
    pub latent: bool,
}

impl AttentionShape {
    /// Positions a cache holding `len` positions keeps after an attention
    /// call: all of them, or the `window - 1` newest that the next query
    /// sees beside itself.
    pub fn retained(&self, len: usize) -> usize {
        match self.window {
            Some(w) => len.min(w.saturating_sub(1)),
            None => len,
        }
    }
}

/// RMSNorm applied to each consecutive group of `weight.len()` features.
#[derive(Clone, Copy, Debug)]
pub struct RmsNorm {
    pub eps: f32,
    /// Scale by `1 + w` instead of `w`.
    pub unit_offset: bool,
}

/// Rotary position embedding of the first `rotary_dim` features of each
/// head, rotating halves (the GPT-NeoX convention Qwen uses).
#[derive(Clone, Copy, Debug)]
pub struct Rope {
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub theta: f64,
    /// YaRN scaling of the frequencies, with cos and sin scaled by its
    /// attention factor; `None`: plain RoPE.
    pub yarn: Option<Yarn>,
}

impl Rope {
    /// Plain RoPE.
    pub fn plain(head_dim: usize, rotary_dim: usize, theta: f64) -> Rope {
        Rope {
            head_dim,
            rotary_dim,
            theta,
            yarn: None,
        }
    }

    /// The `rotary_dim / 2` inverse frequencies, in f32 as transformers
    /// computes them.
    pub fn inv_frequencies(&self) -> Vec<f32> {
        crate::rope::inv_frequencies(self.rotary_dim, self.theta, self.yarn.as_ref())
    }

    /// What cos and sin are multiplied by (YaRN's attention factor; 1 for
    /// plain RoPE).
    pub fn attention_factor(&self) -> f32 {
        self.yarn.map_or(1.0, |y| y.attention_factor() as f32)
    }
}

/// Per-layer weights of Gated DeltaNet that are not projections.
pub struct GatedDeltaNetParams<'a, B: Backend> {
    /// Depthwise causal convolution, `[conv_dim, kernel]`.
    pub conv: &'a B::Weight,
    pub a_log: &'a B::Weight,
    pub dt_bias: &'a B::Weight,
}

impl<B: Backend> Clone for GatedDeltaNetParams<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for GatedDeltaNetParams<'_, B> {}

/// A KV cache in host memory (for saving and loading session state), in
/// the cache's own encoding: keys and values each `[positions held,
/// kv_heads·head_dim]` (a latent cache: its rows as keys, no values).
pub struct HostKv {
    /// The position of the first row (nonzero once a sliding window has
    /// dropped older positions).
    pub first: usize,
    pub keys: KvRows,
    pub values: KvRows,
}

/// What a recorded step reads that changes from one replay to the next
/// (see [`Backend::step_key`]).
pub struct StepInputs<'a> {
    /// Every row's token, one sequence after another.
    pub tokens: &'a [u32],
    /// Each sequence's position before the step.
    pub positions: &'a [usize],
    /// Rows of logits the step returns, each `vocab` wide.
    pub logit_rows: usize,
    pub vocab: usize,
}

/// What a layer's routed experts compute around their three products.
pub struct ExpertFfn<'a, B: Backend> {
    pub activation: ExpertActivation,
    /// Per-expert biases of the gate, up and down products, f32
    /// `[experts, intermediate]`, `[experts, intermediate]` and
    /// `[experts, hidden]` (gpt-oss).
    pub biases: Option<[&'a B::Weight; 3]>,
}

impl<B: Backend> ExpertFfn<'_, B> {
    /// SwiGLU without biases (the Qwen and DeepSeek experts).
    pub fn swiglu() -> Self {
        ExpertFfn {
            activation: ExpertActivation::SwiGlu,
            biases: None,
        }
    }
}

impl<B: Backend> Clone for ExpertFfn<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for ExpertFfn<'_, B> {}

/// A Gated DeltaNet state in host memory: the convolution history
/// `[kernel - 1, conv_dim]` and the recurrent state
/// `[value_heads, key_head_dim, value_head_dim]`.
pub struct HostDeltaNetState {
    pub conv: Vec<f32>,
    pub recurrent: Vec<f32>,
}

pub trait Backend: Send + Sync + Sized + 'static {
    type Tensor: Send + Sync;
    type Weight: Send + Sync;
    /// Keys and values of one full-attention layer of one sequence.
    type KvCache: Send + Sync;
    /// Convolution and recurrent state of one Gated DeltaNet layer of one
    /// sequence.
    type DeltaNetState: Send + Sync;
    /// Each token's selected experts and their weights.
    type Routing: Send + Sync;

    fn name(&self) -> String;

    /// The bandwidth, in GB/s, of the memory this backend streams weights
    /// from, measured now: the ceiling decode speed is reported against
    /// (host RAM read bandwidth on the CPU; a device-to-device copy,
    /// bytes read plus written, on a GPU).
    fn memory_bandwidth(&self) -> Result<f64>;

    /// Makes a stored tensor usable by this backend, for `role` (a router's
    /// matrix takes exact activations).
    fn load_weight(&self, tensor: &TensorData, role: TensorRole) -> Result<Self::Weight>;

    /// An empty cache storing keys and values as `kv` says (a latent
    /// cache only in f32).
    fn new_kv_cache(&self, shape: AttentionShape, kv: KvType) -> Result<Self::KvCache>;
    /// The KV type a model opened on this backend uses unless its options
    /// name one: the fastest that keeps the transformers fixtures within
    /// their tolerances.
    fn default_kv_type(&self) -> KvType {
        KvType::F32
    }
    fn kv_len(&self, cache: &Self::KvCache) -> usize;
    /// Drops every position at or after `len`, which must not be before
    /// the first position the cache holds (a sliding window's cache is
    /// rewound through copies instead, [`Backend::kv_copy`]).
    fn kv_truncate(&self, cache: &mut Self::KvCache, len: usize);
    /// Keys and values in host memory, each `[positions held,
    /// kv_heads·head_dim]` in the cache's encoding.
    fn kv_export(&self, cache: &Self::KvCache) -> Result<HostKv>;
    /// A cache holding `host`, of `host`'s KV type.
    fn kv_import(&self, shape: AttentionShape, host: HostKv) -> Result<Self::KvCache>;
    /// An independent copy of a cache (a sliding window's, for a
    /// checkpoint).
    fn kv_copy(&self, shape: AttentionShape, cache: &Self::KvCache) -> Result<Self::KvCache> {
        self.kv_import(shape, self.kv_export(cache)?)
    }

    fn new_delta_net_state(&self, cfg: &LinearAttentionConfig) -> Result<Self::DeltaNetState>;
    fn delta_net_copy(&self, state: &Self::DeltaNetState) -> Result<Self::DeltaNetState>;
    fn delta_net_export(&self, state: &Self::DeltaNetState) -> Result<HostDeltaNetState>;
    /// Asks `state` to keep its state after each token of its next run
    /// (speculative decoding's check of drafted tokens), so that
    /// [`Backend::delta_net_rewind`] can go back to any of them without
    /// running tokens again; false where the backend cannot.
    fn delta_net_track(&self, _state: &mut Self::DeltaNetState) -> bool {
        false
    }
    /// Puts `state` back to just after the first `keep` tokens of its last
    /// run, if that run was tracked; false (state unchanged) otherwise.
    fn delta_net_rewind(&self, _state: &mut Self::DeltaNetState, _keep: usize) -> Result<bool> {
        Ok(false)
    }
    fn delta_net_import(
        &self,
        cfg: &LinearAttentionConfig,
        host: HostDeltaNetState,
    ) -> Result<Self::DeltaNetState>;

    fn rows(&self, x: &Self::Tensor) -> usize;
    /// The rows of `x` in `ranges`, one after another (a sequence's rows
    /// out of a batch; each sequence's last rows for the logits).
    fn gather_rows(&self, x: &Self::Tensor, ranges: &[Range<usize>]) -> Result<Self::Tensor>;
    /// The rows of `parts`, one tensor after another (every part has the
    /// same columns).
    fn concat_rows(&self, parts: &[Self::Tensor]) -> Result<Self::Tensor>;
    /// Copies a tensor to host memory, row-major.
    fn to_host(&self, x: &Self::Tensor) -> Result<Vec<f32>>;
    /// A tensor's values on the host, row-major, cut into consecutive
    /// parts of `lens` values (which add up to all of them): a batch's
    /// logits, each sequence's its own vector or a range of a buffer the
    /// backend lends (see [`HostValues`]).
    fn host_parts(&self, x: Self::Tensor, lens: &[usize]) -> Result<Vec<HostValues>> {
        Ok(into_parts(self.to_host(&x)?, lens))
    }

    /// Rows of the embedding table for `tokens`.
    fn embed(&self, table: &Self::Weight, tokens: &[u32]) -> Result<Self::Tensor>;
    /// `x · wᵀ` for a weight stored `[out, in]`.
    fn linear(&self, x: &Self::Tensor, w: &Self::Weight) -> Result<Self::Tensor>;
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        norm: RmsNorm,
    ) -> Result<Self::Tensor>;
    /// Splits columns into consecutive parts of the given widths.
    fn split_cols(&self, x: &Self::Tensor, widths: &[usize]) -> Result<Vec<Self::Tensor>>;
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;
    /// Adds the f32 vector `bias` to every row of `x` (projection biases).
    fn add_bias(&self, x: &mut Self::Tensor, bias: &Self::Weight) -> Result<()>;
    /// `silu(gate) * up`.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor>;
    /// `x *= sigmoid(gate)`, elementwise, or per row when `gate` has one
    /// column.
    fn mul_sigmoid(&self, x: &mut Self::Tensor, gate: &Self::Tensor) -> Result<()>;
    /// Rotates each head of `x` for positions `start_pos..start_pos + rows`.
    fn rope(&self, x: &mut Self::Tensor, rope: Rope, start_pos: usize) -> Result<()>;

    /// Appends `k` and `v` to the cache and returns causal attention of `q`
    /// over everything cached (queries sit at the newest positions), or
    /// over the last `shape.window` positions of each query. `sinks`: a
    /// logit per query head that joins the softmax's denominator with no
    /// value (gpt-oss).
    fn attention(
        &self,
        cache: &mut Self::KvCache,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        shape: AttentionShape,
        sinks: Option<&Self::Weight>,
    ) -> Result<Self::Tensor>;

    /// Multi-head latent attention (DeepSeek-V3) with `kv_b` absorbed into
    /// the query and the output: appends each row's latent and rotary key
    /// to the cache (`kv_lora_rank + qk_rope_head_dim` values a position),
    /// then for each query row and head `h`: the query's non-rotary part
    /// through `h`'s key rows of `kv_b` into the latent space, scores
    /// `(q_latent·latent_j + q_rot·k_rot_j)·softmax_scale` over every cached
    /// position up to its own, the softmax-weighted latent, and `h`'s value
    /// rows of `kv_b` applied to it. `q` is `[T, heads·qk_head_dim]`, each
    /// head its rotated part first; `latent` `[T, kv_lora_rank]` (normed),
    /// `k_rot` `[T, qk_rope_head_dim]` (rotated); `kv_b` holds per head its
    /// key's non-rotary rows, then its value rows. Returns
    /// `[T, heads·v_head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn mla_attention(
        &self,
        cache: &mut Self::KvCache,
        q: &Self::Tensor,
        latent: &Self::Tensor,
        k_rot: &Self::Tensor,
        kv_b: &Self::Weight,
        mla: &MlaConfig,
        heads: usize,
    ) -> Result<Self::Tensor>;

    /// Gated DeltaNet's token mixing for a run of tokens: causal conv1d +
    /// SiLU over the q|k|v channels, L2-normalised q and k, decay
    /// `exp(-exp(A_log) · softplus(a + dt_bias))`, `beta = sigmoid(b)`, and
    /// the delta-rule recurrence. Returns `[tokens, value_dim]` before the
    /// gated norm.
    fn gated_delta_net(
        &self,
        state: &mut Self::DeltaNetState,
        qkv: &Self::Tensor,
        b: &Self::Tensor,
        a: &Self::Tensor,
        params: GatedDeltaNetParams<'_, Self>,
        cfg: &LinearAttentionConfig,
    ) -> Result<Self::Tensor>;

    /// RMSNorm of each group of `weight.len()` features, times `weight`,
    /// times `silu(gate)`.
    fn gated_rms_norm(
        &self,
        x: &Self::Tensor,
        gate: &Self::Tensor,
        weight: &Self::Weight,
        eps: f32,
    ) -> Result<Self::Tensor>;

    /// Each token's experts and their weights from the router's logits, as
    /// `spec` says (`correction_bias`: the per-expert bias of a spec that
    /// has one).
    fn route(
        &self,
        logits: &Self::Tensor,
        spec: &RouterSpec,
        correction_bias: Option<&Self::Weight>,
    ) -> Result<Self::Routing>;
    /// The experts a routing selected, every token's in order, on the host
    /// (the expert store reads by these ids).
    fn selected_experts(&self, routing: &Self::Routing) -> Result<Vec<u32>>;

    /// Sum over each token's routed experts of `weight · expert(x)`, with
    /// the experts of `layer` fetched from the store and computed as `ffn`
    /// says.
    fn routed_experts(
        &self,
        x: &Self::Tensor,
        routing: &Self::Routing,
        store: &ExpertStore,
        layer: usize,
        ffn: ExpertFfn<'_, Self>,
    ) -> Result<Self::Tensor>;

    /// `x · wᵀ` for several weights that share the input (a GPU computes
    /// them in one launch).
    fn linear_many(&self, x: &Self::Tensor, ws: &[&Self::Weight]) -> Result<Vec<Self::Tensor>> {
        ws.iter().map(|w| self.linear(x, w)).collect()
    }

    /// `rms_norm(x)` and [`Backend::linear_many`] of it: the normalised x
    /// (for the products after) and the products. A GPU normalises inside
    /// the products' launch during decode, saving the norm's own.
    fn rms_norm_linear_many(
        &self,
        x: &Self::Tensor,
        weight: &Self::Weight,
        norm: RmsNorm,
        ws: &[&Self::Weight],
    ) -> Result<(Self::Tensor, Vec<Self::Tensor>)> {
        let normed = self.rms_norm(x, weight, norm)?;
        let products = self.linear_many(&normed, ws)?;
        Ok((normed, products))
    }

    /// `residual += x · wᵀ` (a GPU adds as it computes).
    fn linear_add(
        &self,
        residual: &mut Self::Tensor,
        x: &Self::Tensor,
        w: &Self::Weight,
    ) -> Result<()> {
        let y = self.linear(x, w)?;
        self.add_assign(residual, &y)
    }

    /// Attention's preparation of queries and keys: RMSNorm of each head of
    /// `q` and `k` with its weight, then RoPE of both for positions
    /// `start_pos..` (a GPU does it in one launch).
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope(
        &self,
        q: Self::Tensor,
        k: Self::Tensor,
        q_norm: &Self::Weight,
        k_norm: &Self::Weight,
        norm: RmsNorm,
        rope: Rope,
        start_pos: usize,
    ) -> Result<(Self::Tensor, Self::Tensor)> {
        let mut q = self.rms_norm(&q, q_norm, norm)?;
        let mut k = self.rms_norm(&k, k_norm, norm)?;
        self.rope(&mut q, rope, start_pos)?;
        self.rope(&mut k, rope, start_pos)?;
        Ok((q, k))
    }

    /// Attention of a decode step of several sequences at once: row `i` of
    /// `q`, `k` and `v` is sequence `i`'s new token and `caches[i]` its KV
    /// cache. Prepares queries and keys as [`Backend::qk_norm_rope`] does,
    /// each at its own sequence's position, then appends and attends as
    /// [`Backend::attention`] does (a GPU launches once for all sequences).
    #[allow(clippy::too_many_arguments)]
    fn attention_decode_many(
        &self,
        caches: &mut [&mut Self::KvCache],
        q: Self::Tensor,
        k: Self::Tensor,
        v: &Self::Tensor,
        q_norm: &Self::Weight,
        k_norm: &Self::Weight,
        norm: RmsNorm,
        rope: Rope,
        shape: AttentionShape,
    ) -> Result<Self::Tensor> {
        attention_decode_each(self, caches, q, k, v, q_norm, k_norm, norm, rope, shape)
    }

    /// `out +=` [`Backend::routed_experts`] (a GPU adds as it computes).
    fn routed_experts_add(
        &self,
        out: &mut Self::Tensor,
        x: &Self::Tensor,
        routing: &Self::Routing,
        store: &ExpertStore,
        layer: usize,
        ffn: ExpertFfn<'_, Self>,
    ) -> Result<()> {
        let y = self.routed_experts(x, routing, store, layer, ffn)?;
        self.add_assign(out, &y)
    }

    /// Names the recording of a step over one sequence's state (its KV
    /// caches and Gated DeltaNet states) that appends `rows` positions to
    /// it, in a step of `sequences` sequences, first making room for them
    /// (and telling a sliding window's cache where they go); steps over the
    /// same state buffers get the same key. `None`: this backend does not
    /// record such steps.
    fn step_key(
        &self,
        _kv: &mut [&mut Self::KvCache],
        _linear: &[&Self::DeltaNetState],
        _rows: usize,
        _sequences: usize,
    ) -> Result<Option<u64>> {
        Ok(None)
    }

    /// Replays the step recorded under `key` (a step's key combines its
    /// sequences' [`Backend::step_key`]s and the batch's shape) for
    /// `inputs`, advancing the KV caches as the step would; `None` when
    /// nothing is recorded under `key`.
    fn replay_step(&self, _key: u64, _inputs: &StepInputs<'_>) -> Result<Option<Self::Tensor>> {
        Ok(None)
    }

    /// Runs `step`, a step the engine would record (decode tokens only,
    /// every expert resident) that this backend does not record now: the
    /// same kernels as [`Backend::record_step`] runs, so a step's logits do
    /// not depend on whether it was recorded.
    fn run_step(&self, step: &mut dyn FnMut() -> Result<Self::Tensor>) -> Result<Self::Tensor> {
        step()
    }

    /// Runs `step`, the step of `inputs`, which returns their logits, and
    /// may record it under `key` for [`Backend::replay_step`].
    fn record_step(
        &self,
        _key: u64,
        _inputs: &StepInputs<'_>,
        step: &mut dyn FnMut() -> Result<Self::Tensor>,
    ) -> Result<Self::Tensor> {
        step()
    }

    /// Whether this backend holds every expert of `layer` itself, so the
    /// store's prediction and prefetch have nothing to do for it (and
    /// asking for the routing would only cost a round trip).
    fn experts_resident(&self, _store: &ExpertStore, _layer: usize) -> bool {
        false
    }

    /// Prompt tokens processed together when the model's options leave it
    /// to the backend ([`crate::ModelOptions::prefill_chunk`] `None`).
    fn default_prefill_chunk(&self) -> usize {
        DEFAULT_PREFILL_CHUNK
    }

    /// During decode, the experts of `layer` (the next MoE layer) that its
    /// router predicts from the current layer's input: a GPU that streams
    /// experts uploads them while the current layer computes.
    fn prefetch_experts(&self, _store: &ExpertStore, _layer: usize, _experts: &[u32]) {}

    /// What the backend's own expert cache (a GPU's VRAM) has done since it
    /// was created; `None` for a backend without one.
    fn device_expert_stats(&self) -> Option<DeviceExpertStats> {
        None
    }

    /// Host-to-device copy bandwidth from page-locked memory in GB/s,
    /// measured now: the ceiling of expert uploads (`None` without a
    /// device).
    fn host_to_device_bandwidth(&self) -> Option<f64> {
        None
    }

    /// Work before the first token: the CPU reads every expert into the
    /// store's cache when they all fit its budget, a GPU uploads every
    /// expert when they all fit in its memory.
    fn prepare_experts(&self, _store: &ExpertStore, _progress: &dyn Progress) -> Result<()> {
        Ok(())
    }

    /// Bytes free now in the memory that holds sequences' KV caches and
    /// states (host memory on the CPU, device memory on a GPU); bounds the
    /// default context. `None` when unknown.
    fn state_memory(&self) -> Option<u64> {
        crate::experts::available_memory()
    }

    /// Whether the operations fork onto the rayon thread pool (the CPU
    /// backend's), so that a forward pass is best run on one of its
    /// workers. A device backend's operations only queue work.
    fn forks_on_host(&self) -> bool {
        false
    }
}

/// [`Backend::attention_decode_many`] one sequence at a time: each row's
/// query and key prepared at its own position, then [`Backend::attention`]
/// over its cache.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode_each<B: Backend>(
    b: &B,
    caches: &mut [&mut B::KvCache],
    q: B::Tensor,
    k: B::Tensor,
    v: &B::Tensor,
    q_norm: &B::Weight,
    k_norm: &B::Weight,
    norm: RmsNorm,
    rope: Rope,
    shape: AttentionShape,
) -> Result<B::Tensor> {
    let outs: Vec<B::Tensor> = caches
        .iter_mut()
        .enumerate()
        .map(|(i, cache)| {
            let rows = i..i + 1;
            let row = |x: &B::Tensor| b.gather_rows(x, std::slice::from_ref(&rows));
            let start = b.kv_len(cache);
            let (q, k) = b.qk_norm_rope(row(&q)?, row(&k)?, q_norm, k_norm, norm, rope, start)?;
            b.attention(cache, &q, &k, &row(v)?, shape, None)
        })
        .collect::<Result<_>>()?;
    b.concat_rows(&outs)
}

/// Whether a cache of `shape` can hold keys and values of type `kv`: a
/// latent cache only in f32, q8 only heads of whole blocks.
pub(crate) fn check_kv_type(shape: AttentionShape, kv: KvType) -> Result<()> {
    if shape.latent && kv != KvType::F32 {
        return Err(crate::Error::invalid(
            "KV cache type",
            format!(
                "multi-head latent attention keeps its latent cache in f32, not {kv}: \
                 use f32 (--kv-type f32)"
            ),
        ));
    }
    match kv.unsupported_head_dim(shape.head_dim) {
        Some(why) => Err(crate::Error::invalid("KV cache type", why)),
        None => Ok(()),
    }
}

/// Panics unless `host`'s keys and values are whole rows of `shape`'s
/// width and share one type (a latent cache: keys only): an import of
/// another cache's export, which cannot be otherwise.
pub(crate) fn check_host_kv(shape: AttentionShape, host: &HostKv) {
    let width = shape.num_kv_heads * shape.head_dim;
    let values = if shape.latent { 0 } else { host.keys.len() };
    assert!(
        host.values.len() == values
            && host.keys.len().is_multiple_of(width)
            && (shape.latent || host.values.kv_type() == host.keys.kv_type()),
        "KV import: {} keys and {} values ({} and {}) are not whole rows of {width}",
        host.keys.len(),
        host.values.len(),
        host.keys.kv_type(),
        host.values.kv_type()
    );
}
