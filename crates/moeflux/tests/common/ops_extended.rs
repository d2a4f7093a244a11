//! Conformance of the operations gpt-oss brought: projection biases,
//! attention with sink logits and a sliding window, and routed experts with
//! biases and the clamped SwiGLU. Each backend is compared with the
//! reference (as in [`super::ops`]) and the reference itself with a direct
//! f64 computation of transformers' formulas, so that an error the backends
//! share is caught too.
//!
//! Bounds: `add_bias` exact (one addition); attention 1e-5 of the output's
//! scale against the reference and 1e-5 against the f64 computation; the
//! experts 1e-5 of the output's scale against both (f32 activations).

use moeflux::backend::cpu::{
    CpuBackend, KvCache as CpuKv, Routing as CpuRouting, Weight as CpuWeight,
};
use moeflux::backend::{AttentionShape, Backend, ExpertFfn, KvRows, KvType};
use moeflux::config::{ExpertActivation, RouterSpec, ScoreFunction};
use moeflux::experts::ExpertStore;
use moeflux::format::{ModelDir, OpenOptions, TensorRole};
use moeflux::quant::DType;

use super::convert_fixture;
use super::ops::{
    Activations, Conformance, TestWeights, assert_close, both, head_dim_for, host, reference,
    values, whole_store,
};

/// `x += bias` on every row, for a row count and width the kernels do not
/// divide evenly.
pub fn add_bias<B: Conformance>(b: &B, _: Activations) {
    let r = reference();
    let (rows, cols) = (7, 61);
    let weights = TestWeights::new(&[("test.bias", DType::F32, vec![cols], values(cols, 3))]);
    let (mut x_r, mut x_b) = both(b, rows, cols, values(rows * cols, 1));
    let bias = values(cols, 3);
    let direct: Vec<f32> = x_r
        .data
        .iter()
        .enumerate()
        .map(|(i, v)| v + bias[i % cols])
        .collect();
    r.add_bias(&mut x_r, &weights.load(&r, "test.bias", &[cols]))
        .unwrap();
    b.add_bias(&mut x_b, &weights.load(b, "test.bias", &[cols]))
        .unwrap();
    assert_eq!(x_r.data, direct, "add_bias: reference");
    assert_eq!(host(b, &x_b), direct, "add_bias");
}

/// Attention of query heads over `keys`/`values` (every position so far,
/// `[positions, kv_width]`), transformers' eager attention in f64: the
/// queries at the last `n` positions, each over its window, with the sink
/// logit in the softmax's denominator.
pub fn direct_attention(
    shape: AttentionShape,
    sinks: Option<&[f32]>,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
) -> Vec<f32> {
    let hd = shape.head_dim;
    let kv_width = shape.num_kv_heads * hd;
    let mut out = vec![0f32; q.len()];
    for row in direct_probabilities(shape, sinks, q, keys) {
        let out = &mut out[row.at..][..hd];
        for (j, p) in row.probabilities.iter().enumerate() {
            let value = &values[(row.first + j) * kv_width + row.column..][..hd];
            for (o, &v) in out.iter_mut().zip(value) {
                *o += (p * v as f64) as f32;
            }
        }
    }
    out
}

/// One query head's softmax over the positions it sees.
pub struct DirectRow {
    /// Where its output starts in `[tokens, heads·head_dim]`.
    pub at: usize,
    /// The column of its KV head in a cache row.
    pub column: usize,
    /// The first position it sees.
    pub first: usize,
    /// Each seen position's probability, in f64 (the sink's share is the
    /// rest).
    pub probabilities: Vec<f64>,
}

/// The probabilities of [`direct_attention`], each query head of each of
/// the last `q.len() / (heads·head_dim)` positions of `keys`.
pub fn direct_probabilities(
    shape: AttentionShape,
    sinks: Option<&[f32]>,
    q: &[f32],
    keys: &[f32],
) -> Vec<DirectRow> {
    let hd = shape.head_dim;
    let (q_width, kv_width) = (shape.num_heads * hd, shape.num_kv_heads * hd);
    let (n, len) = (q.len() / q_width, keys.len() / kv_width);
    let group = shape.num_heads / shape.num_kv_heads;
    let scale = 1.0 / (hd as f64).sqrt();
    let mut rows = Vec::with_capacity(n * shape.num_heads);
    for t in 0..n {
        let position = len - n + t;
        let first = shape.window.map_or(0, |w| (position + 1).saturating_sub(w));
        for h in 0..shape.num_heads {
            let query = &q[t * q_width + h * hd..][..hd];
            let column = (h / group) * hd;
            let logits: Vec<f64> = (first..=position)
                .map(|j| {
                    let key = &keys[j * kv_width + column..][..hd];
                    query
                        .iter()
                        .zip(key)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let sink = sinks.map(|s| s[h] as f64);
            let max = logits
                .iter()
                .copied()
                .chain(sink)
                .fold(f64::NEG_INFINITY, f64::max);
            let total: f64 = logits.iter().map(|l| (l - max).exp()).sum::<f64>()
                + sink.map_or(0.0, |s| (s - max).exp());
            rows.push(DirectRow {
                at: t * q_width + h * hd,
                column,
                first,
                probabilities: logits.iter().map(|l| (l - max).exp() / total).collect(),
            });
        }
    }
    rows
}

/// Sink logits of `heads` query heads on the scale of the logits (so that
/// they take a clear share), on the reference, on a backend and on the
/// host.
pub struct TestSinks<B: Backend> {
    reference: CpuWeight,
    backend: B::Weight,
    host: Vec<f32>,
}

impl<B: Backend> TestSinks<B> {
    pub fn new(r: &CpuBackend, b: &B, heads: usize, seed: u64) -> TestSinks<B> {
        let host: Vec<f32> = values(heads, seed).iter().map(|v| 2.0 * v).collect();
        let weights = TestWeights::new(&[("test.sinks", DType::F32, vec![heads], host.clone())]);
        TestSinks {
            reference: weights.load(r, "test.sinks", &[heads]),
            backend: weights.load(b, "test.sinks", &[heads]),
            host,
        }
    }

    /// The sinks on the reference, the backend and the host, or none.
    pub fn given(&self, given: bool) -> (Option<&CpuWeight>, Option<&B::Weight>, Option<&[f32]>) {
        match given {
            true => (Some(&self.reference), Some(&self.backend), Some(&self.host)),
            false => (None, None, None),
        }
    }
}

/// Sliding windows of 8 and 3 positions with and without sinks, and sinks
/// over a whole cache: chunks of one token and of several (longer than the
/// window), 304 positions in all, each against the reference and the
/// direct computation (over the keys and values as the cache's type holds
/// them); the cache holds only the window's last positions (exported as
/// such), and a cache imported from the reference's export, or copied,
/// continues as the reference does. Every KV type (heads of 64 for q8,
/// else 40).
pub fn attention_with_sinks_and_window<B: Conformance>(b: &B, _: Activations) {
    for kv in KvType::ALL {
        attention_with_sinks_and_window_of_type(b, kv);
    }
}

fn attention_with_sinks_and_window_of_type<B: Conformance>(b: &B, kv: KvType) {
    let r = reference();
    let (heads, kv_heads, head_dim) = (6, 2, head_dim_for(kv, 40, 64));
    let sinks = TestSinks::new(&r, b, heads, 5);
    for (window, with_sinks) in [(Some(8), true), (Some(3), false), (None, true)] {
        let shape = AttentionShape {
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            window,
            latent: false,
        };
        let (sinks_r, sinks_b, sinks_host) = sinks.given(with_sinks);
        let (q_width, kv_width) = (heads * head_dim, kv_heads * head_dim);
        let mut cache_r = r.new_kv_cache(shape, kv).unwrap();
        let mut cache_b = b.new_kv_cache(shape, kv).unwrap();
        // Every key and value so far, for the direct computation.
        let mut history = (Vec::new(), Vec::new());
        let what = format!("{kv} attention window {window:?} sinks {with_sinks}");
        let held_as = |x: &[f32]| KvRows::encode(kv, x);
        let step = |n: usize,
                    seed: u64,
                    cache_r: &mut CpuKv,
                    cache_b: &mut B::KvCache,
                    (all_keys, all_values): &mut (Vec<f32>, Vec<f32>)| {
            let q = values(n * q_width, seed);
            let (q_r, q_b) = both(b, n, q_width, q.clone());
            let k = values(n * kv_width, seed + 1);
            let v = values(n * kv_width, seed + 2);
            let (k_r, k_b) = both(b, n, kv_width, k.clone());
            let (v_r, v_b) = both(b, n, kv_width, v.clone());
            all_keys.extend(k);
            all_values.extend(v);
            let want = r
                .attention(cache_r, &q_r, &k_r, &v_r, shape, sinks_r)
                .unwrap()
                .data;
            let direct = direct_attention(
                shape,
                sinks_host,
                &q,
                &held_as(all_keys).decode(),
                &held_as(all_values).decode(),
            );
            assert_close(
                &format!("{what}: reference, chunk of {n}"),
                &want,
                &direct,
                1e-5,
            );
            let got = host(
                b,
                &b.attention(cache_b, &q_b, &k_b, &v_b, shape, sinks_b)
                    .unwrap(),
            );
            assert_close(&format!("{what}: chunk of {n}"), &got, &want, 1e-5);
        };
        // Past 256 positions, where a CUDA cache first runs out of room and
        // a window's lets go of its old rows.
        let chunks = [5, 1, 20, 1, 1, 3, 240, 1, 30, 1, 1];
        for (i, n) in chunks.into_iter().enumerate() {
            step(n, 10 * i as u64, &mut cache_r, &mut cache_b, &mut history);
        }
        let len: usize = chunks.iter().sum();
        assert_eq!(b.kv_len(&cache_b), len, "{what}: positions seen");
        let held = shape.retained(len);
        let (exported, want) = (
            b.kv_export(&cache_b).unwrap(),
            r.kv_export(&cache_r).unwrap(),
        );
        assert_eq!(want.first, len - held, "{what}: first position held");
        assert_eq!(
            want.keys,
            held_as(&history.0[(len - held) * kv_width..]),
            "{what}: the reference holds the window's newest keys"
        );
        assert_eq!(
            exported.first, want.first,
            "{what}: exported first position"
        );
        assert_eq!(exported.keys, want.keys, "{what}: exported keys");
        assert_eq!(exported.values, want.values, "{what}: exported values");

        let mut imported = b.kv_import(shape, r.kv_export(&cache_r).unwrap()).unwrap();
        assert_eq!(b.kv_len(&imported), len, "{what}: imported length");
        let mut copy_r = r.kv_copy(shape, &cache_r).unwrap();
        step(2, 91, &mut cache_r, &mut imported, &mut history);
        // The copy still holds the cache as it was before that step.
        let copied = r.kv_export(&copy_r).unwrap();
        assert_eq!(copied.first, len - held, "{what}: the copy is independent");
        r.kv_truncate(&mut copy_r, len);
        assert_eq!(r.kv_len(&copy_r), len);
    }
}

/// The fixture's experts (bf16 and q4) with its biases and clamped SwiGLU,
/// for one token and nine, against the reference and a direct f64
/// computation from the dequantized matrices; `routed_experts_add` too.
pub fn clamped_biased_experts<B: Conformance>(b: &B, _: Activations) {
    let r = reference();
    for quant in [DType::Bf16, DType::Q4] {
        let converted = convert_fixture("gpt_oss", quant);
        let dir = ModelDir::open(&converted.dir, OpenOptions::default()).unwrap();
        let store = whole_store(&dir);
        let cfg = dir.config();
        let moe = &cfg.moe;
        let (hidden, experts, inter) = (
            cfg.hidden_size,
            moe.num_experts,
            moe.expert_intermediate_size,
        );
        assert!(
            matches!(
                moe.expert_activation,
                ExpertActivation::ClampedSwiGlu { .. }
            ) && moe.expert_bias,
            "the gpt_oss fixture's experts are clamped and biased"
        );
        let layer = cfg.moe_layers().next().expect("an MoE layer");
        let names = ["gate", "up", "down"].map(|p| format!("layers.{layer}.moe.experts_{p}_bias"));
        let shapes = [[experts, inter], [experts, inter], [experts, hidden]];
        let load =
            |backend: &B| [0, 1, 2].map(|i| load_vector_from(&dir, backend, &names[i], &shapes[i]));
        let load_r = [0, 1, 2].map(|i| load_vector_from(&dir, &r, &names[i], &shapes[i]));
        let biases_b = load(b);
        let biases_host: Vec<Vec<f32>> = (0..3)
            .map(|i| bytemuck_f32s(&dir, &names[i], &shapes[i]))
            .collect();
        let ffn_r = ExpertFfn {
            activation: moe.expert_activation,
            biases: Some([&load_r[0], &load_r[1], &load_r[2]]),
        };
        let ffn_b = ExpertFfn {
            activation: moe.expert_activation,
            biases: Some([&biases_b[0], &biases_b[1], &biases_b[2]]),
        };
        let spec = RouterSpec {
            score: ScoreFunction::SoftmaxOfChosen,
            ..RouterSpec::softmax(moe.router.top_k, false)
        };
        for n in [1, 9] {
            let x = values(n * hidden, 20 + n as u64);
            let (x_r, x_b) = both(b, n, hidden, x.clone());
            let (l_r, l_b) = both(b, n, experts, values(n * experts, 30 + n as u64));
            let routing_r = r.route(&l_r, &spec, None).unwrap();
            let routing_b = b.route(&l_b, &spec, None).unwrap();
            let want = r
                .routed_experts(&x_r, &routing_r, &store, layer, ffn_r)
                .unwrap();
            let what = format!("clamped biased experts {} n={n}", quant.name());
            let direct = direct_experts(
                &store,
                layer,
                &x,
                hidden,
                &routing_r,
                moe.expert_activation,
                &biases_host,
            );
            assert_close(&format!("{what}: reference"), &want.data, &direct, 1e-5);
            let got = host(
                b,
                &b.routed_experts(&x_b, &routing_b, &store, layer, ffn_b)
                    .unwrap(),
            );
            assert_close(&what, &got, &want.data, 1e-5);

            let out = values(n * hidden, 40 + n as u64);
            let (mut out_r, mut out_b) = both(b, n, hidden, out);
            r.routed_experts_add(&mut out_r, &x_r, &routing_r, &store, layer, ffn_r)
                .unwrap();
            b.routed_experts_add(&mut out_b, &x_b, &routing_b, &store, layer, ffn_b)
                .unwrap();
            assert_close(
                &format!("{what}: routed_experts_add"),
                &host(b, &out_b),
                &out_r.data,
                1e-5,
            );
        }
    }
}

fn load_vector_from<B: Backend>(dir: &ModelDir, b: &B, name: &str, shape: &[usize]) -> B::Weight {
    b.load_weight(&dir.tensor(name, shape).unwrap(), TensorRole::Vector)
        .unwrap()
}

/// An f32 tensor's values.
fn bytemuck_f32s(dir: &ModelDir, name: &str, shape: &[usize]) -> Vec<f32> {
    let t = dir.tensor(name, shape).unwrap();
    let view = t.view();
    let mut out = vec![0f32; view.rows() * view.cols()];
    for (row, chunk) in out.chunks_exact_mut(view.cols()).enumerate() {
        view.dequantize_row(row, chunk);
    }
    out
}

/// transformers' gpt-oss experts in f64 on the stored (dequantized)
/// matrices: `gate_up = x·W + b`, the clamps, `(up + 1)·gate·σ(α·gate)`,
/// `down·act + b`, weighted by the routing.
fn direct_experts(
    store: &ExpertStore,
    layer: usize,
    x: &[f32],
    hidden: usize,
    routing: &CpuRouting,
    activation: ExpertActivation,
    biases: &[Vec<f32>],
) -> Vec<f32> {
    let ExpertActivation::ClampedSwiGlu { limit, alpha } = activation else {
        panic!("the direct computation is of the clamped SwiGLU")
    };
    let (limit, alpha) = (limit as f64, alpha as f64);
    let mut out = vec![0f32; x.len()];
    for (t, xt) in x.chunks_exact(hidden).enumerate() {
        let mut acc = vec![0f64; hidden];
        for k in 0..routing.top_k {
            let slot = t * routing.top_k + k;
            let e = routing.experts[slot] as usize;
            let expert = store.fetch(layer, &[e]).unwrap().remove(0);
            let (gate, up, down) = (expert.gate(), expert.up(), expert.down());
            let inter = gate.rows();
            let row = |view: &moeflux::quant::MatrixView<'_>, r: usize| {
                let mut w = vec![0f32; view.cols()];
                view.dequantize_row(r, &mut w);
                w
            };
            let dot =
                |w: &[f32], v: &[f64]| w.iter().zip(v).map(|(&a, &b)| a as f64 * b).sum::<f64>();
            let xt: Vec<f64> = xt.iter().map(|&v| v as f64).collect();
            let act: Vec<f64> = (0..inter)
                .map(|j| {
                    let g = (dot(&row(&gate, j), &xt) + biases[0][e * inter + j] as f64).min(limit);
                    let u = (dot(&row(&up, j), &xt) + biases[1][e * inter + j] as f64)
                        .clamp(-limit, limit);
                    g / (1.0 + (-alpha * g).exp()) * (u + 1.0)
                })
                .collect();
            let weight = routing.weights[slot] as f64;
            for (h, a) in acc.iter_mut().enumerate() {
                *a += weight * (dot(&row(&down, h), &act) + biases[2][e * hidden + h] as f64);
            }
        }
        for (o, a) in out[t * hidden..][..hidden].iter_mut().zip(acc) {
            *o = a as f32;
        }
    }
    out
}
