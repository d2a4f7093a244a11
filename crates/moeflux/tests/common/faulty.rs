//! A backend that runs another and makes one chosen operation fail with
//! [`Error::Device`], as a device out of memory would: the way to test
//! that a failure in the middle of a forward pass reaches the caller, rolls
//! back the sequences of that pass only, and leaves the process and every
//! other sequence working.

use std::ops::Range;
use std::sync::atomic::{AtomicI64, Ordering};

use moeflux::backend::{
    AttentionShape, Backend, DeviceExpertStats, ExpertFfn, GatedDeltaNetParams, HostDeltaNetState,
    HostKv, KvType, RmsNorm, Rope,
};
use moeflux::config::{LinearAttentionConfig, RouterSpec};
use moeflux::experts::ExpertStore;
use moeflux::format::{TensorData, TensorRole};
use moeflux::util::Progress;
use moeflux::{Error, Result};

pub struct Faulty<B: Backend> {
    pub inner: B,
    /// Operations left before the failing one; negative: none fails.
    countdown: AtomicI64,
}

impl<B: Backend> Faulty<B> {
    pub fn new(inner: B) -> Faulty<B> {
        Faulty {
            inner,
            countdown: AtomicI64::new(-1),
        }
    }

    /// Makes the operation `after` operations from now fail (0: the next).
    pub fn arm(&self, after: usize) {
        self.countdown.store(after as i64, Ordering::SeqCst);
    }

    /// Whether the armed failure has happened.
    pub fn fired(&self) -> bool {
        self.countdown.load(Ordering::SeqCst) == -2
    }

    fn check(&self, op: &str) -> Result<()> {
        match self.countdown.fetch_sub(1, Ordering::SeqCst) {
            0 => {
                self.countdown.store(-2, Ordering::SeqCst);
                Err(Error::Device {
                    device: "test device".into(),
                    msg: format!("{op}: out of memory (injected)"),
                })
            }
            n if n < 0 => {
                self.countdown.store(n.min(-1), Ordering::SeqCst);
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

impl<B: Backend> Backend for Faulty<B> {
    type Tensor = B::Tensor;
    type Weight = B::Weight;
    type KvCache = B::KvCache;
    type DeltaNetState = B::DeltaNetState;
    type Routing = B::Routing;

    fn name(&self) -> String {
        format!("faulty {}", self.inner.name())
    }
    fn memory_bandwidth(&self) -> Result<f64> {
        self.inner.memory_bandwidth()
    }
    fn load_weight(&self, tensor: &TensorData, role: TensorRole) -> Result<B::Weight> {
        self.inner.load_weight(tensor, role)
    }
    fn new_kv_cache(&self, shape: AttentionShape, kv: KvType) -> Result<B::KvCache> {
        self.check("new_kv_cache")?;
        self.inner.new_kv_cache(shape, kv)
    }

    fn default_kv_type(&self) -> KvType {
        self.inner.default_kv_type()
    }
    fn kv_len(&self, cache: &B::KvCache) -> usize {
        self.inner.kv_len(cache)
    }
    fn kv_truncate(&self, cache: &mut B::KvCache, len: usize) {
        self.inner.kv_truncate(cache, len)
    }
    fn kv_export(&self, cache: &B::KvCache) -> Result<HostKv> {
        self.check("kv_export")?;
        self.inner.kv_export(cache)
    }
    fn kv_import(&self, shape: AttentionShape, host: HostKv) -> Result<B::KvCache> {
        self.check("kv_import")?;
        self.inner.kv_import(shape, host)
    }
    fn new_delta_net_state(&self, cfg: &LinearAttentionConfig) -> Result<B::DeltaNetState> {
        self.check("new_delta_net_state")?;
        self.inner.new_delta_net_state(cfg)
    }
    fn delta_net_copy(&self, state: &B::DeltaNetState) -> Result<B::DeltaNetState> {
        self.check("delta_net_copy")?;
        self.inner.delta_net_copy(state)
    }
    fn delta_net_export(&self, state: &B::DeltaNetState) -> Result<HostDeltaNetState> {
        self.check("delta_net_export")?;
        self.inner.delta_net_export(state)
    }
    fn delta_net_import(
        &self,
        cfg: &LinearAttentionConfig,
        host: HostDeltaNetState,
    ) -> Result<B::DeltaNetState> {
        self.check("delta_net_import")?;
        self.inner.delta_net_import(cfg, host)
    }
    fn rows(&self, x: &B::Tensor) -> usize {
        self.inner.rows(x)
    }
    fn gather_rows(&self, x: &B::Tensor, ranges: &[Range<usize>]) -> Result<B::Tensor> {
        self.check("gather_rows")?;
        self.inner.gather_rows(x, ranges)
    }
    fn concat_rows(&self, parts: &[B::Tensor]) -> Result<B::Tensor> {
        self.check("concat_rows")?;
        self.inner.concat_rows(parts)
    }
    fn to_host(&self, x: &B::Tensor) -> Result<Vec<f32>> {
        self.check("to_host")?;
        self.inner.to_host(x)
    }
    fn embed(&self, table: &B::Weight, tokens: &[u32]) -> Result<B::Tensor> {
        self.check("embed")?;
        self.inner.embed(table, tokens)
    }
    fn linear(&self, x: &B::Tensor, w: &B::Weight) -> Result<B::Tensor> {
        self.check("linear")?;
        self.inner.linear(x, w)
    }
    fn rms_norm(&self, x: &B::Tensor, weight: &B::Weight, norm: RmsNorm) -> Result<B::Tensor> {
        self.check("rms_norm")?;
        self.inner.rms_norm(x, weight, norm)
    }
    fn split_cols(&self, x: &B::Tensor, widths: &[usize]) -> Result<Vec<B::Tensor>> {
        self.check("split_cols")?;
        self.inner.split_cols(x, widths)
    }
    fn add_assign(&self, x: &mut B::Tensor, y: &B::Tensor) -> Result<()> {
        self.check("add_assign")?;
        self.inner.add_assign(x, y)
    }
    fn mla_attention(
        &self,
        cache: &mut B::KvCache,
        q: &B::Tensor,
        latent: &B::Tensor,
        k_rot: &B::Tensor,
        kv_b: &B::Weight,
        mla: &moeflux::config::MlaConfig,
        heads: usize,
    ) -> Result<B::Tensor> {
        self.check("mla_attention")?;
        self.inner
            .mla_attention(cache, q, latent, k_rot, kv_b, mla, heads)
    }
    fn silu_mul(&self, gate: &B::Tensor, up: &B::Tensor) -> Result<B::Tensor> {
        self.check("silu_mul")?;
        self.inner.silu_mul(gate, up)
    }
    fn add_bias(&self, x: &mut B::Tensor, bias: &B::Weight) -> Result<()> {
        self.check("add_bias")?;
        self.inner.add_bias(x, bias)
    }
    fn mul_sigmoid(&self, x: &mut B::Tensor, gate: &B::Tensor) -> Result<()> {
        self.check("mul_sigmoid")?;
        self.inner.mul_sigmoid(x, gate)
    }
    fn rope(&self, x: &mut B::Tensor, rope: Rope, start_pos: usize) -> Result<()> {
        self.check("rope")?;
        self.inner.rope(x, rope, start_pos)
    }
    fn attention(
        &self,
        cache: &mut B::KvCache,
        q: &B::Tensor,
        k: &B::Tensor,
        v: &B::Tensor,
        shape: AttentionShape,
        sinks: Option<&B::Weight>,
    ) -> Result<B::Tensor> {
        self.check("attention")?;
        self.inner.attention(cache, q, k, v, shape, sinks)
    }
    fn gated_delta_net(
        &self,
        state: &mut B::DeltaNetState,
        qkv: &B::Tensor,
        b: &B::Tensor,
        a: &B::Tensor,
        params: GatedDeltaNetParams<'_, Self>,
        cfg: &LinearAttentionConfig,
    ) -> Result<B::Tensor> {
        self.check("gated_delta_net")?;
        let params = GatedDeltaNetParams {
            conv: params.conv,
            a_log: params.a_log,
            dt_bias: params.dt_bias,
        };
        self.inner.gated_delta_net(state, qkv, b, a, params, cfg)
    }
    fn gated_rms_norm(
        &self,
        x: &B::Tensor,
        gate: &B::Tensor,
        weight: &B::Weight,
        eps: f32,
    ) -> Result<B::Tensor> {
        self.check("gated_rms_norm")?;
        self.inner.gated_rms_norm(x, gate, weight, eps)
    }
    fn route(
        &self,
        logits: &B::Tensor,
        spec: &RouterSpec,
        correction_bias: Option<&B::Weight>,
    ) -> Result<B::Routing> {
        self.check("route")?;
        self.inner.route(logits, spec, correction_bias)
    }
    fn selected_experts(&self, routing: &B::Routing) -> Result<Vec<u32>> {
        self.check("selected_experts")?;
        self.inner.selected_experts(routing)
    }
    fn routed_experts(
        &self,
        x: &B::Tensor,
        routing: &B::Routing,
        store: &ExpertStore,
        layer: usize,
        ffn: ExpertFfn<'_, Self>,
    ) -> Result<B::Tensor> {
        self.check("routed_experts")?;
        let ffn = ExpertFfn {
            activation: ffn.activation,
            biases: ffn.biases,
        };
        self.inner.routed_experts(x, routing, store, layer, ffn)
    }
    fn experts_resident(&self, store: &ExpertStore, layer: usize) -> bool {
        self.inner.experts_resident(store, layer)
    }
    fn default_prefill_chunk(&self) -> usize {
        self.inner.default_prefill_chunk()
    }
    fn prefetch_experts(&self, store: &ExpertStore, layer: usize, experts: &[u32]) {
        self.inner.prefetch_experts(store, layer, experts)
    }
    fn device_expert_stats(&self) -> Option<DeviceExpertStats> {
        self.inner.device_expert_stats()
    }
    fn prepare_experts(&self, store: &ExpertStore, progress: &dyn Progress) -> Result<()> {
        self.inner.prepare_experts(store, progress)
    }
    fn forks_on_host(&self) -> bool {
        self.inner.forks_on_host()
    }
}
