//! [`Backend`] for [`CudaBackend`]: each operation checks its shapes and
//! calls the method of its op family's module (see the backend's module
//! documentation), or runs a short host-side step itself.

use super::*;

impl Backend for CudaBackend {
    type Tensor = Tensor;
    type Weight = Weight;
    type KvCache = KvCache;
    type DeltaNetState = DeltaNetState;
    type Routing = Routing;

    fn name(&self) -> String {
        self.description.clone()
    }

    fn memory_bandwidth(&self) -> Result<f64> {
        const BYTES: usize = 1 << 30;
        let src = self.alloc::<u8>("bandwidth probe", BYTES)?;
        let mut dst = self.alloc::<u8>("bandwidth probe", BYTES)?;
        let mut best = f64::INFINITY;
        for _ in 0..6 {
            let start = std::time::Instant::now();
            ok("bandwidth probe", self.stream.memcpy_dtod(&src, &mut dst))?;
            ok("bandwidth probe", self.stream.synchronize())?;
            best = best.min(start.elapsed().as_secs_f64());
        }
        Ok(2.0 * BYTES as f64 / best / 1e9)
    }

    fn load_weight(&self, tensor: &TensorData, role: TensorRole) -> Result<Weight> {
        if tensor.layout.dtype.experts_only() {
            return Err(Error::tensor(
                &tensor.entry.file,
                &tensor.name,
                format!(
                    "stored as {}: the CUDA backend takes q2, q3 and mxfp4 weights only in \
                     routed experts; convert again with --quant q4, q8 or bf16 for the other \
                     matrices",
                    tensor.layout.dtype.name()
                ),
            ));
        }
        let bytes = tensor.bytes();
        let fail = |e: DriverError| {
            device_error(self.ordinal, format!("uploading tensor {}", tensor.name), e)
        };
        let mut data = self.try_alloc::<u8>(bytes.len()).map_err(fail)?;
        if !bytes.is_empty() {
            self.stream
                .memcpy_htod(bytes, &mut data.slice_mut(..bytes.len()))
                .map_err(fail)?;
        }
        Ok(Weight {
            name: tensor.name.clone(),
            layout: tensor.layout,
            data,
            // A router's choice is too sensitive for int8 activations (as
            // on the CPU).
            int8: self.activations == Activations::Int8
                && tensor.layout.dtype == DType::Q4
                && role != TensorRole::Router,
        })
    }

    fn new_kv_cache(&self, shape: AttentionShape, kv: KvType) -> Result<KvCache> {
        check_kv_type(shape, kv)?;
        self.kv_new(shape, kv)
    }

    fn kv_len(&self, cache: &KvCache) -> usize {
        cache.len()
    }

    fn kv_truncate(&self, cache: &mut KvCache, len: usize) {
        self.kv_truncate_to(cache, len);
    }

    fn kv_export(&self, cache: &KvCache) -> Result<HostKv> {
        self.kv_to_host(cache)
    }

    fn kv_import(&self, shape: AttentionShape, host: HostKv) -> Result<KvCache> {
        check_kv_type(shape, host.keys.kv_type())?;
        check_host_kv(shape, &host);
        self.kv_from_host(shape, host)
    }

    fn new_delta_net_state(&self, cfg: &LinearAttentionConfig) -> Result<DeltaNetState> {
        self.linear_new(cfg)
    }

    fn delta_net_copy(&self, state: &DeltaNetState) -> Result<DeltaNetState> {
        self.linear_clone(state)
    }

    fn delta_net_export(&self, state: &DeltaNetState) -> Result<HostDeltaNetState> {
        self.linear_to_host(state)
    }

    fn delta_net_import(
        &self,
        cfg: &LinearAttentionConfig,
        host: HostDeltaNetState,
    ) -> Result<DeltaNetState> {
        self.linear_from_host(cfg, host)
    }

    fn rows(&self, x: &Tensor) -> usize {
        x.rows
    }

    fn gather_rows(&self, x: &Tensor, ranges: &[Range<usize>]) -> Result<Tensor> {
        CudaBackend::gather_rows(self, x, ranges)
    }

    fn concat_rows(&self, parts: &[Tensor]) -> Result<Tensor> {
        CudaBackend::concat_rows(self, parts)
    }

    fn to_host(&self, x: &Tensor) -> Result<Vec<f32>> {
        CudaBackend::to_host(self, x)
    }

    fn host_parts(&self, x: Tensor, lens: &[usize]) -> Result<Vec<crate::backend::HostValues>> {
        CudaBackend::to_host_parts(self, &x, lens)
    }

    fn embed(&self, table: &Weight, tokens: &[u32]) -> Result<Tensor> {
        CudaBackend::embed(self, table, tokens)
    }

    fn linear(&self, x: &Tensor, w: &Weight) -> Result<Tensor> {
        CudaBackend::linear(self, x, w)
    }

    fn rms_norm(&self, x: &Tensor, weight: &Weight, norm: RmsNorm) -> Result<Tensor> {
        CudaBackend::rms_norm(self, x, weight, norm)
    }

    fn split_cols(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        CudaBackend::split_cols(self, x, widths)
    }

    fn add_assign(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        CudaBackend::add_assign(self, x, y)
    }

    fn add_bias(&self, x: &mut Tensor, bias: &Weight) -> Result<()> {
        CudaBackend::add_bias(self, x, bias)
    }

    fn mla_attention(
        &self,
        cache: &mut KvCache,
        q: &Tensor,
        latent: &Tensor,
        k_rot: &Tensor,
        kv_b: &Weight,
        mla: &MlaConfig,
        heads: usize,
    ) -> Result<Tensor> {
        CudaBackend::mla_attention(self, cache, q, latent, k_rot, kv_b, mla, heads)
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        CudaBackend::silu_mul(self, gate, up)
    }

    fn mul_sigmoid(&self, x: &mut Tensor, gate: &Tensor) -> Result<()> {
        CudaBackend::mul_sigmoid(self, x, gate)
    }

    fn rope(&self, x: &mut Tensor, rope: Rope, start_pos: usize) -> Result<()> {
        CudaBackend::rope(self, x, rope, start_pos)
    }

    fn attention(
        &self,
        cache: &mut KvCache,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        shape: AttentionShape,
        sinks: Option<&Weight>,
    ) -> Result<Tensor> {
        CudaBackend::attention(self, cache, q, k, v, shape, sinks)
    }

    fn gated_delta_net(
        &self,
        state: &mut DeltaNetState,
        qkv: &Tensor,
        b: &Tensor,
        a: &Tensor,
        params: GatedDeltaNetParams<'_, Self>,
        cfg: &LinearAttentionConfig,
    ) -> Result<Tensor> {
        CudaBackend::gated_delta_net(self, state, qkv, b, a, params, cfg)
    }

    fn gated_rms_norm(
        &self,
        x: &Tensor,
        gate: &Tensor,
        weight: &Weight,
        eps: f32,
    ) -> Result<Tensor> {
        CudaBackend::gated_rms_norm(self, x, gate, weight, eps)
    }

    fn route(
        &self,
        logits: &Tensor,
        spec: &RouterSpec,
        correction_bias: Option<&Weight>,
    ) -> Result<Routing> {
        CudaBackend::route(self, logits, spec, correction_bias)
    }

    fn selected_experts(&self, routing: &Routing) -> Result<Vec<u32>> {
        CudaBackend::selected_experts(self, routing)
    }

    fn routed_experts(
        &self,
        x: &Tensor,
        routing: &Routing,
        store: &ExpertStore,
        layer: usize,
        ffn: ExpertFfn<'_, Self>,
    ) -> Result<Tensor> {
        self.compute_routed_experts(x, routing, store, layer, ffn)
    }

    fn linear_many(&self, x: &Tensor, ws: &[&Weight]) -> Result<Vec<Tensor>> {
        CudaBackend::linear_many(self, x, ws)
    }

    fn rms_norm_linear_many(
        &self,
        x: &Tensor,
        weight: &Weight,
        norm: RmsNorm,
        ws: &[&Weight],
    ) -> Result<(Tensor, Vec<Tensor>)> {
        CudaBackend::rms_norm_linear_many(self, x, weight, norm, ws)
    }

    fn linear_add(&self, residual: &mut Tensor, x: &Tensor, w: &Weight) -> Result<()> {
        CudaBackend::linear_add(self, residual, x, w)
    }

    fn qk_norm_rope(
        &self,
        q: Tensor,
        k: Tensor,
        q_norm: &Weight,
        k_norm: &Weight,
        norm: RmsNorm,
        rope: Rope,
        start_pos: usize,
    ) -> Result<(Tensor, Tensor)> {
        CudaBackend::qk_norm_rope(self, q, k, q_norm, k_norm, norm, rope, start_pos)
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_decode_many(
        &self,
        caches: &mut [&mut KvCache],
        q: Tensor,
        k: Tensor,
        v: &Tensor,
        q_norm: &Weight,
        k_norm: &Weight,
        norm: RmsNorm,
        rope: Rope,
        shape: AttentionShape,
    ) -> Result<Tensor> {
        CudaBackend::attention_decode_many(self, caches, q, k, v, q_norm, k_norm, norm, rope, shape)
    }

    fn routed_experts_add(
        &self,
        out: &mut Tensor,
        x: &Tensor,
        routing: &Routing,
        store: &ExpertStore,
        layer: usize,
        ffn: ExpertFfn<'_, Self>,
    ) -> Result<()> {
        self.add_routed_experts(out, x, routing, store, layer, ffn)
    }

    fn step_key(
        &self,
        kv: &mut [&mut KvCache],
        linear: &[&DeltaNetState],
        rows: usize,
        sequences: usize,
    ) -> Result<Option<u64>> {
        self.state_key(kv, linear, rows, sequences)
    }

    fn replay_step(&self, key: u64, inputs: &StepInputs<'_>) -> Result<Option<Tensor>> {
        self.replay(key, inputs)
    }

    fn run_step(&self, step: &mut dyn FnMut() -> Result<Tensor>) -> Result<Tensor> {
        self.as_engine_step(step)
    }

    fn record_step(
        &self,
        key: u64,
        inputs: &StepInputs<'_>,
        step: &mut dyn FnMut() -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.record(key, inputs, step)
    }

    fn experts_resident(&self, store: &ExpertStore, layer: usize) -> bool {
        self.layer_resident(store, layer)
    }

    /// Large chunks keep the tensor cores busy: the routed experts of a
    /// chunk run in three launches however many tokens it has, each
    /// expert's weights read (or uploaded) once for all of its tokens.
    /// 2048 measured 17% faster than 512 on a 2048-token prompt
    /// (docs/PERFORMANCE.md).
    fn default_prefill_chunk(&self) -> usize {
        2048
    }

    fn prepare_experts(&self, store: &ExpertStore, progress: &dyn Progress) -> Result<()> {
        match self.parallel {
            Some(_) => self.prepare_all_ranks(store, progress),
            None => self.prepare_device_experts(store, progress).map(|_| ()),
        }
    }

    fn prefetch_experts(&self, store: &ExpertStore, layer: usize, experts: &[u32]) {
        match self.parallel {
            Some(_) => self.prefetch_on_owners(store, layer, experts),
            None => self.note_prefetch(store, layer, experts),
        }
    }

    fn device_expert_stats(&self) -> Option<ExpertCacheStats> {
        Some(self.expert_cache_stats())
    }

    fn state_memory(&self) -> Option<u64> {
        self.ctx.mem_get_info().ok().map(|(free, _)| free as u64)
    }

    fn host_to_device_bandwidth(&self) -> Option<f64> {
        self.pinned_upload_bandwidth().ok()
    }
}
