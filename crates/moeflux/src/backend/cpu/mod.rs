//! The CPU backend: f32 activations, weights read in place from the
//! memory-mapped model files, a decode step's parallel regions on
//! moeflux's spinning workers (`pool.rs`), the rest on rayon's.

mod attention;
mod bandwidth;
#[cfg(test)]
mod bench;
mod gated_delta_net;
mod linear;
pub(crate) mod moe;
pub(crate) mod pool;
pub mod profile;
mod simd;

use std::ops::Range;

use super::{
    AttentionShape, Backend, ExpertFfn, GatedDeltaNetParams, HostDeltaNetState, HostKv, KvType,
    RmsNorm, Rope, check_host_kv, check_kv_type,
};
use crate::config::{ExpertActivation, LinearAttentionConfig, MlaConfig, RouterSpec};
use crate::error::Result;
use crate::experts::ExpertStore;
use crate::format::{TensorData, TensorRole};
use crate::quant::DType;
use crate::util::Progress;
use linear::{Product, matmul_many_with};
use simd::Isa;

pub use attention::KvCache;
pub use bandwidth::memory_read_bandwidth;
pub use gated_delta_net::DeltaNetState;
pub use linear::{Activations, dot, matmul};
pub use moe::Routing;

/// Choices of the CPU backend.
#[derive(Clone, Copy, Debug)]
pub struct CpuOptions {
    pub activations: Activations,
    /// Products and attention run on moeflux's spinning workers instead of
    /// rayon's (same results, bit for bit); by default unless
    /// `MOEFLUX_CPU_POOL=0`.
    pub pool: bool,
}

impl Default for CpuOptions {
    fn default() -> CpuOptions {
        CpuOptions {
            activations: Activations::default(),
            pool: crate::tuning::cpu_pool(),
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend {
    options: CpuOptions,
    /// The SIMD kernels this backend runs; `None`: the process-wide choice
    /// ([`KernelSet::detected`]).
    kernels: Option<KernelSet>,
}

impl CpuBackend {
    pub fn with_options(options: CpuOptions) -> CpuBackend {
        CpuBackend {
            options,
            kernels: None,
        }
    }

    /// This backend running the kernels of `kernels` instead of the
    /// process-wide choice (to compare kernel sets within one process).
    pub fn with_kernels(self, kernels: KernelSet) -> CpuBackend {
        CpuBackend {
            kernels: Some(kernels),
            ..self
        }
    }

    /// The kernels this backend runs.
    pub fn kernels(&self) -> KernelSet {
        self.kernels.unwrap_or_else(KernelSet::detected)
    }

    fn isa(&self) -> Isa {
        self.kernels().0
    }
}

/// One of the SIMD kernel sets this machine runs (AVX-512, AVX2+FMA,
/// NEON, scalar): values come only from the machine's detected features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelSet(Isa);

impl KernelSet {
    /// The set the backend runs unless told otherwise: the fastest
    /// available, or the one `MOEFLUX_CPU_KERNELS` names.
    pub fn detected() -> KernelSet {
        KernelSet(Isa::get())
    }

    /// Every set this machine runs, fastest first (scalar last, always).
    pub fn available() -> Vec<KernelSet> {
        Isa::available().into_iter().map(KernelSet).collect()
    }

    /// The portable scalar kernels, which every machine runs.
    pub fn scalar() -> KernelSet {
        KernelSet(Isa::Scalar)
    }

    /// The set called `name` (`scalar`, `avx2`, `avx512`, `neon`), if this
    /// machine runs it.
    pub fn named(name: &str) -> Option<KernelSet> {
        KernelSet::available()
            .into_iter()
            .find(|k| k.name() == name)
    }

    pub fn name(self) -> &'static str {
        self.0.name()
    }
}

/// A row-major `[rows, cols]` matrix of f32.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Tensor {
        debug_assert_eq!(data.len(), rows * cols);
        Tensor { rows, cols, data }
    }
}

/// A stored tensor used in place from its mapping.
pub struct Weight {
    tensor: TensorData,
    /// How products with it take their activations: as the backend's
    /// options say, except for routers and the shared expert's gate, which
    /// always take f32. A routing decision flips on a small error; these
    /// are the matrices the converter keeps at 8 bits or more for that
    /// reason, and they are small.
    activations: Activations,
}

impl Weight {
    /// The matrix, checked to take rows of `x`'s width.
    fn view_for(&self, x: &Tensor) -> crate::quant::MatrixView<'_> {
        let view = self.tensor.view();
        assert_eq!(
            x.cols,
            view.cols(),
            "linear: input width vs weight {}",
            self.tensor.name
        );
        view
    }

    /// The values of an f32 tensor (norm weights and other vectors),
    /// without the padding that aligns the next tensor in the file.
    fn f32s(&self) -> &[f32] {
        assert_eq!(
            self.tensor.entry.dtype,
            DType::F32,
            "tensor {} must be f32",
            self.tensor.name
        );
        let values: &[f32] = bytemuck::cast_slice(self.tensor.bytes());
        &values[..self.tensor.layout.rows * self.tensor.layout.cols]
    }
}

impl Backend for CpuBackend {
    type Tensor = Tensor;
    type Weight = Weight;
    type KvCache = KvCache;
    type DeltaNetState = DeltaNetState;
    type Routing = Routing;

    fn name(&self) -> String {
        let activations = match self.options.activations {
            Activations::F32 => "",
            Activations::Int8 => ", int8 activations",
        };
        let kernels = match self.kernels {
            Some(k) => format!(", {} kernels", k.name()),
            None => String::new(),
        };
        format!(
            "cpu ({} threads{activations}{kernels})",
            rayon::current_num_threads()
        )
    }

    fn memory_bandwidth(&self) -> Result<f64> {
        Ok(memory_read_bandwidth())
    }

    fn load_weight(&self, tensor: &TensorData, role: TensorRole) -> Result<Weight> {
        Ok(Weight {
            tensor: tensor.clone(),
            // A router's choice is too sensitive for int8 activations.
            activations: match role {
                TensorRole::Router => Activations::F32,
                _ => self.options.activations,
            },
        })
    }

    fn new_kv_cache(&self, shape: AttentionShape, kv: KvType) -> Result<KvCache> {
        check_kv_type(shape, kv)?;
        Ok(KvCache::new(shape, kv))
    }

    fn kv_len(&self, cache: &KvCache) -> usize {
        cache.len()
    }

    fn kv_truncate(&self, cache: &mut KvCache, len: usize) {
        cache.truncate(len);
    }

    fn kv_export(&self, cache: &KvCache) -> Result<HostKv> {
        Ok(HostKv {
            first: cache.first,
            keys: cache.keys.clone(),
            values: cache.values.clone(),
        })
    }

    fn kv_import(&self, shape: AttentionShape, host: HostKv) -> Result<KvCache> {
        check_kv_type(shape, host.keys.kv_type())?;
        check_host_kv(shape, &host);
        Ok(KvCache {
            shape,
            first: host.first,
            keys: host.keys,
            values: host.values,
        })
    }

    fn new_delta_net_state(&self, cfg: &LinearAttentionConfig) -> Result<DeltaNetState> {
        Ok(DeltaNetState::new(cfg))
    }

    fn delta_net_copy(&self, state: &DeltaNetState) -> Result<DeltaNetState> {
        Ok(DeltaNetState {
            track_next: false,
            steps: None,
            ..state.clone()
        })
    }

    fn delta_net_export(&self, state: &DeltaNetState) -> Result<HostDeltaNetState> {
        Ok(HostDeltaNetState {
            conv: state.conv.clone(),
            recurrent: state.recurrent.clone(),
        })
    }

    fn delta_net_import(
        &self,
        _cfg: &LinearAttentionConfig,
        host: HostDeltaNetState,
    ) -> Result<DeltaNetState> {
        Ok(DeltaNetState {
            conv: host.conv,
            recurrent: host.recurrent,
            track_next: false,
            steps: None,
        })
    }

    fn delta_net_track(&self, state: &mut DeltaNetState) -> bool {
        state.track_next = true;
        true
    }

    fn delta_net_rewind(&self, state: &mut DeltaNetState, keep: usize) -> Result<bool> {
        Ok(state.rewind(keep))
    }

    fn rows(&self, x: &Tensor) -> usize {
        x.rows
    }

    fn gather_rows(&self, x: &Tensor, ranges: &[Range<usize>]) -> Result<Tensor> {
        let mut data = Vec::with_capacity(ranges.iter().map(|r| r.len()).sum::<usize>() * x.cols);
        for r in ranges {
            data.extend_from_slice(&x.data[r.start * x.cols..r.end * x.cols]);
        }
        Ok(Tensor::new(data.len() / x.cols.max(1), x.cols, data))
    }

    fn concat_rows(&self, parts: &[Tensor]) -> Result<Tensor> {
        let cols = parts.first().map_or(0, |p| p.cols);
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
        for p in parts {
            assert_eq!(p.cols, cols, "concat_rows: columns differ");
            data.extend_from_slice(&p.data);
        }
        Ok(Tensor::new(parts.iter().map(|p| p.rows).sum(), cols, data))
    }

    fn to_host(&self, x: &Tensor) -> Result<Vec<f32>> {
        Ok(x.data.clone())
    }

    fn host_parts(&self, x: Tensor, lens: &[usize]) -> Result<Vec<crate::backend::HostValues>> {
        Ok(crate::backend::into_parts(x.data, lens))
    }

    fn embed(&self, table: &Weight, tokens: &[u32]) -> Result<Tensor> {
        let view = table.tensor.view();
        let cols = view.cols();
        let mut data = vec![0f32; tokens.len() * cols];
        for (row, &tok) in data.chunks_exact_mut(cols).zip(tokens) {
            view.dequantize_row(tok as usize, row);
        }
        Ok(Tensor::new(tokens.len(), cols, data))
    }

    fn linear(&self, x: &Tensor, w: &Weight) -> Result<Tensor> {
        let view = w.view_for(x);
        let product = Product {
            x: &x.data,
            n: x.rows,
            w: view,
            activations: w.activations,
        };
        let mut out = matmul_many_with(self.isa(), self.options.pool, &[product]);
        let out = out.pop().expect("one product");
        Ok(Tensor::new(x.rows, view.rows(), out))
    }

    /// The products share one parallel region, and one preparation of `x`
    /// where their weights take it alike.
    fn linear_many(&self, x: &Tensor, ws: &[&Weight]) -> Result<Vec<Tensor>> {
        let products: Vec<Product<'_>> = ws
            .iter()
            .map(|w| {
                let view = w.view_for(x);
                Product {
                    x: &x.data,
                    n: x.rows,
                    w: view,
                    activations: w.activations,
                }
            })
            .collect();
        Ok(matmul_many_with(self.isa(), self.options.pool, &products)
            .into_iter()
            .zip(ws)
            .map(|(out, w)| Tensor::new(x.rows, w.tensor.view().rows(), out))
            .collect())
    }

    fn rms_norm(&self, x: &Tensor, weight: &Weight, norm: RmsNorm) -> Result<Tensor> {
        let w = weight.f32s();
        let g = w.len();
        let offset = if norm.unit_offset { 1.0 } else { 0.0 };
        let mut data = vec![0f32; x.data.len()];
        let chunk = pool::groups_per_task(g) * g;
        pool::for_chunks_mut(self.options.pool, &mut data, chunk, |i, out| {
            for (o, x) in out.chunks_mut(g).zip(x.data[i * chunk..].chunks(g)) {
                // The squares summed in `dot`'s lanes: a vectorised sum,
                // not a chain of dependent additions (a decode step's
                // norms run on one thread).
                let inv = 1.0 / (dot(x, x) / g as f32 + norm.eps).sqrt();
                for i in 0..g {
                    o[i] = x[i] * inv * (offset + w[i]);
                }
            }
        });
        Ok(Tensor::new(x.rows, x.cols, data))
    }

    fn split_cols(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        assert_eq!(widths.iter().sum::<usize>(), x.cols, "split_cols widths");
        let mut start = 0;
        Ok(widths
            .iter()
            .map(|&w| {
                let data = x
                    .data
                    .chunks_exact(x.cols)
                    .flat_map(|row| &row[start..start + w])
                    .copied()
                    .collect();
                start += w;
                Tensor::new(x.rows, w, data)
            })
            .collect())
    }

    fn add_assign(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        assert_eq!(x.data.len(), y.data.len());
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn add_bias(&self, x: &mut Tensor, bias: &Weight) -> Result<()> {
        let bias = bias.f32s();
        assert_eq!(bias.len(), x.cols, "add_bias: bias width");
        for row in x.data.chunks_exact_mut(x.cols) {
            row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
        }
        Ok(())
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let data = gate
            .data
            .iter()
            .zip(&up.data)
            .map(|(&g, &u)| moe::activation(ExpertActivation::SwiGlu, g, u))
            .collect();
        Ok(Tensor::new(gate.rows, gate.cols, data))
    }

    fn mul_sigmoid(&self, x: &mut Tensor, gate: &Tensor) -> Result<()> {
        let sigmoid = |g: f32| 1.0 / (1.0 + (-g).exp());
        if gate.cols == 1 {
            for (row, &g) in x.data.chunks_exact_mut(x.cols).zip(&gate.data) {
                let s = sigmoid(g);
                row.iter_mut().for_each(|v| *v *= s);
            }
        } else {
            assert_eq!(x.data.len(), gate.data.len());
            x.data
                .iter_mut()
                .zip(&gate.data)
                .for_each(|(v, &g)| *v *= sigmoid(g));
        };
        Ok(())
    }

    fn rope(&self, x: &mut Tensor, rope: Rope, start_pos: usize) -> Result<()> {
        attention::rope(self.options.pool, &mut x.data, x.cols, rope, start_pos);
        Ok(())
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
        let rows = heads * (mla.qk_nope_head_dim + mla.v_head_dim);
        let ids: Vec<u32> = (0..rows as u32).collect();
        let kv_b = self.embed(kv_b, &ids)?;
        let out = attention::attend_latent(
            self.options.pool,
            cache,
            &q.data,
            &latent.data,
            &k_rot.data,
            &kv_b.data,
            mla,
            heads,
        );
        Ok(Tensor::new(q.rows, heads * mla.v_head_dim, out))
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
        let sinks = sinks.map(Weight::f32s);
        let out = attention::attend(
            self.isa(),
            self.options.pool,
            cache,
            &q.data,
            &k.data,
            &v.data,
            q.rows,
            sinks,
        );
        Ok(Tensor::new(q.rows, shape.num_heads * shape.head_dim, out))
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
        let inputs = gated_delta_net::Inputs {
            qkv: &qkv.data,
            b: &b.data,
            a: &a.data,
            conv_weight: params.conv.f32s(),
            a_log: params.a_log.f32s(),
            dt_bias: params.dt_bias.f32s(),
        };
        let out =
            gated_delta_net::forward(self.isa(), self.options.pool, state, inputs, qkv.rows, cfg);
        Ok(Tensor::new(qkv.rows, cfg.value_dim(), out))
    }

    fn gated_rms_norm(
        &self,
        x: &Tensor,
        gate: &Tensor,
        weight: &Weight,
        eps: f32,
    ) -> Result<Tensor> {
        let out = gated_delta_net::gated_rms_norm(
            self.options.pool,
            &x.data,
            &gate.data,
            weight.f32s(),
            eps,
        );
        Ok(Tensor::new(x.rows, x.cols, out))
    }

    fn route(
        &self,
        logits: &Tensor,
        spec: &RouterSpec,
        correction_bias: Option<&Weight>,
    ) -> Result<Routing> {
        let bias = correction_bias.map(|w| {
            let mut row = vec![0f32; w.tensor.view().cols()];
            w.tensor.view().dequantize_row(0, &mut row);
            row
        });
        Ok(moe::route(
            self.options.pool,
            &logits.data,
            logits.cols,
            spec,
            bias.as_deref(),
        ))
    }

    fn selected_experts(&self, routing: &Routing) -> Result<Vec<u32>> {
        Ok(routing.experts.clone())
    }

    fn routed_experts(
        &self,
        x: &Tensor,
        routing: &Routing,
        store: &ExpertStore,
        layer: usize,
        ffn: ExpertFfn<'_, Self>,
    ) -> Result<Tensor> {
        let ffn = moe::Ffn {
            activation: ffn.activation,
            biases: ffn.biases.map(|b| b.map(Weight::f32s)),
        };
        let out = moe::routed_experts(
            self.isa(),
            self.options.pool,
            &x.data,
            x.cols,
            routing,
            store,
            layer,
            self.options.activations,
            ffn,
        )?;
        Ok(Tensor::new(x.rows, x.cols, out))
    }

    /// The store's cache is this backend's memory: once it holds every
    /// expert, a decode step has nothing to predict or read ahead.
    fn experts_resident(&self, store: &ExpertStore, _layer: usize) -> bool {
        store.holds_every_expert()
    }

    /// Every expert read into the store's cache when they all fit its
    /// budget (see [`ExpertStore::load_all`]).
    fn prepare_experts(&self, store: &ExpertStore, progress: &dyn Progress) -> Result<()> {
        store.load_all(progress).map(|_| ())
    }

    fn forks_on_host(&self) -> bool {
        true
    }

    /// Large chunks: each expert's weights are read once a chunk and
    /// multiplied by all of the chunk's tokens routed to it, whose number
    /// the wide int8 kernels need (on the 24-layer qwen3-30b-a3b shape, 2
    /// cores, int8 activations: pp512 66 tok/s in chunks of 64, 82 of 128,
    /// 86 of 256, 91 of 512; f32 activations 42 and 49 at 64 and 512).
    fn default_prefill_chunk(&self) -> usize {
        512
    }
}
