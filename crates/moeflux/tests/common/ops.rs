//! The backends' conformance suite: every operation of [`Backend`] on
//! random inputs of awkward sizes, written once, generic over the backend
//! under test and compared with the reference, the CPU backend with its
//! portable scalar kernels and f32 activations ([`reference`]).
//! [`backend_tests!`] makes each (operation, backend) pair its own test;
//! tests/backend_ops.rs lists the CPU's kernel sets, tests/cuda.rs the
//! CUDA backend. Run with `--nocapture` to see the measured errors.
//!
//! Bounds, each checked against the reference's result:
//! - products (`linear`, `linear_many`, the products of
//!   `rms_norm_linear_many`): each output within 1e-5 of the magnitude of
//!   its terms, `Σ|w·x|` (f32 rounding in another order, whatever the
//!   tiles). With int8 activations and q4/q8 weights, plus the rounding of
//!   the activations the CPU kernels' own test states, `Σ_g Σ|w − c_g|·d_g/2`
//!   (`c_g` a group's central weight, `d_g` the token's int8 step in that
//!   group), the magnitude then also counting the groups' centred terms
//!   `Σ_g |c_g·Σ x|` ([`ProductBounds::product`]); `linear_add` adds 1e-6 of
//!   `|residual| + |product|` for its addition;
//! - routed experts: the first-order error of products each within its
//!   bound above, carried through `silu(gate)·up` and the down projection
//!   and weighted by the routing ([`expert_error_bounds`]); one and nine
//!   tokens of f32 activations also within 1e-5 of the output's scale;
//!   `routed_experts_add` adds 1e-6 of `|out| + |experts|`;
//! - RMSNorm, the gated RMSNorm, RoPE, attention, the Gated DeltaNet output
//!   and recurrent state: 1e-5 of the output's scale (its largest |value|);
//!   the convolution history 1e-6; `qk_norm_rope` 2e-5 (the norm's bound
//!   plus RoPE's: the rotation keeps magnitudes);
//! - `attention_decode_many`: 1e-4 of the output's scale, ten times
//!   attention's: the queries and keys it prepares (within `qk_norm_rope`'s
//!   2e-5) enter scores `q·k/√d`, whose error grows with `√d`, up to 16
//!   for 256-wide heads (measured on an H100: below 1e-6); the keys it
//!   caches within 2e-5, the values exactly;
//! - routing weights, `silu_mul`, `mul_sigmoid`: 1e-6; `add_assign` 1e-7;
//! - exact where no arithmetic reorders: embedding rows, row and column
//!   copies, exported keys and values, the experts chosen;
//! - KV cache types: the attention operations run on caches of every
//!   [`KvType`], each against the reference's cache of the same type
//!   (which holds the same rows bit for bit) within the bounds above;
//!   bf16 and q8 against the f32 reference within a bound that follows
//!   from their rounding (common/ops_kv.rs).
//!
//! The model-level checks ([`super::batch`]) run per backend as well:
//! batched sequences against each alone within the backend's
//! [`Conformance::BATCHED_BOUND`], and a device failure contained.

use std::any::Any;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use rayon::prelude::*;

pub use moeflux::backend::cpu::Activations;
use moeflux::backend::cpu::{
    CpuBackend, DeltaNetState as CpuDeltaNet, KvCache as CpuKv, Tensor as CpuTensor,
    Weight as CpuWeight,
};
use moeflux::backend::{
    AttentionShape, Backend, ExpertFfn, GatedDeltaNetParams, HostKv, KvRows, KvType, RmsNorm, Rope,
    attention_decode_each,
};
use moeflux::config::{LinearAttentionConfig, RouterSpec};
use moeflux::experts::{CachePolicy, ExpertStore, IoMode, StoreOptions};
use moeflux::format::{ModelDir, OpenOptions, TensorRole};
use moeflux::quant::{DType, GROUP_SIZE, MatrixLayout, MatrixView, RowEncoder};
use moeflux::{Model, ModelOptions};

pub use super::backends::{Conformance, reference};
#[allow(unused_imports)]
pub use super::ops_extended::{add_bias, attention_with_sinks_and_window, clamped_biased_experts};
#[allow(unused_imports)]
pub use super::ops_kv::kv_types_stay_within_their_rounding;
#[allow(unused_imports)]
pub use super::ops_latent::{mla_attention, routers};
use super::{
    Converted, EXPERT_RECIPES, convert_checkpoint_with, convert_fixture, convert_fixture_with,
};

/// Makes a module `$name` of tests, one per operation of the suite, each
/// running it on the backend `$make()` returns (a closure returning
/// `Option<impl Conformance>`; `None`: not on this machine, the test says
/// "skipped" and passes), and the model-level checks on it. `int8 $name`
/// makes only the operations int8 activations change (products and routed
/// experts), with the int8 bounds: the rest runs the same code as the f32
/// entry of the same kernels (and the kernels' own tests hold a token's
/// int8 products equal whatever the batch).
///
/// ```ignore
/// backend_tests!(cpu_avx2, || cpu("avx2", Activations::F32));
/// backend_tests!(int8 cpu_avx2_int8, || cpu("avx2", Activations::Int8));
/// ```
#[allow(unused_macros)]
macro_rules! backend_tests {
    ($name:ident, $make:expr) => {
        $crate::common::ops::backend_tests!(@module $name, $make, F32, [
            linear_and_embed_match_reference => linear_and_embed,
            one_token_product_of_many_rows_matches_reference => one_token_product_of_many_rows,
            linear_on_awkward_tiles_matches_reference => linear_on_awkward_tiles,
            fused_products_match_reference => fused_products,
            norms_match_reference => norms,
            elementwise_ops_match_reference => elementwise,
            rope_matches_reference => rope,
            qk_norm_rope_matches_reference => qk_norm_rope,
            attention_matches_reference_across_chunks_growth_truncation_and_import => attention,
            prefill_attention_matches_reference_for_every_head_dimension => prefill_attention,
            attention_decode_many_matches_reference => attention_decode_many,
            decode_after_long_contexts_matches_reference => long_context_decode,
            gated_delta_net_matches_reference_across_chunks_copies_and_import => gated_delta_net,
            routing_matches_reference => routing,
            routed_experts_match_reference => routed_experts,
            grouped_experts_of_many_tokens_match_reference => grouped_experts,
            experts_of_few_tokens_each_match_reference => few_token_experts,
            add_bias_matches_reference => add_bias,
            attention_with_sinks_and_window_matches_reference => attention_with_sinks_and_window,
            clamped_biased_experts_match_reference => clamped_biased_experts,
            latent_attention_matches_reference_across_chunks_truncation_and_import => mla_attention,
            grouped_sigmoid_and_chosen_softmax_routers_match_reference => routers,
            kv_types_stay_within_their_rounding_of_f32_attention => kv_types_stay_within_their_rounding,
        ], [
            batched_sequences_equal_each_sequence_alone => batched_equals_alone,
            a_device_failure_fails_only_its_batch_and_the_process_goes_on => device_failure_contained,
        ]);
    };
    (int8 $name:ident, $make:expr) => {
        $crate::common::ops::backend_tests!(@module $name, $make, Int8, [
            linear_and_embed_match_reference => linear_and_embed,
            one_token_product_of_many_rows_matches_reference => one_token_product_of_many_rows,
            linear_on_awkward_tiles_matches_reference => linear_on_awkward_tiles,
            fused_products_match_reference => fused_products,
            routed_experts_match_reference => routed_experts,
            grouped_experts_of_many_tokens_match_reference => grouped_experts,
            experts_of_few_tokens_each_match_reference => few_token_experts,
        ], []);
    };
    (@module $name:ident, $make:expr, $activations:ident,
        [$($test:ident => $op:ident,)*], [$($model_test:ident => $model_op:ident,)*]) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            use $crate::common::ops;

            fn backend() -> Option<impl ops::Conformance> {
                let backend = ($make)();
                if backend.is_none() {
                    println!("skipped: {} is not available here", stringify!($name));
                }
                backend
            }

            $(
                #[test]
                fn $test() {
                    if let Some(b) = backend() {
                        ops::$op(&b, ops::Activations::$activations);
                    }
                }
            )*

            $(
                #[test]
                fn $model_test() {
                    if backend().is_some() {
                        ops::$model_op(stringify!($name), || backend().expect("available"));
                    }
                }
            )*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use backend_tests;

// ---------------------------------------------------------------------
// Helpers.

/// `n` values in [-1, 1), the same for the same seed.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `got` equals `want` within `tolerance` of the largest `|want|`.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tolerance: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    assert!(
        got.iter().all(|v| v.is_finite()),
        "{what}: non-finite output"
    );
    let scale = want
        .iter()
        .fold(0f64, |m, v| m.max(v.abs() as f64))
        .max(1e-30);
    let worst = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (g, w)| m.max((g - w).abs() as f64));
    assert!(
        worst <= tolerance * scale,
        "{what}: max error {worst:.3e} exceeds {tolerance:.0e} of {scale:.3e}"
    );
}

/// Each of `got` within its `bounds` of `want`; returns the worst error as
/// a fraction of its bound.
pub fn assert_within(what: &str, got: &[f32], want: &[f32], bounds: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let mut worst = 0f64;
    for (i, ((&g, &w), &bound)) in got.iter().zip(want).zip(bounds).enumerate() {
        let error = (g - w).abs() as f64;
        assert!(
            g.is_finite() && error <= bound + 1e-30,
            "{what} [{i}]: {g} vs {w} (bound {bound:.3e})"
        );
        worst = worst.max(error / (bound + 1e-30));
    }
    worst
}

/// The value `make` computes for `key`, computed once per process however
/// many tests ask (concurrently or not): references and bounds shared by
/// the backends of one test binary.
pub fn cached<T: Send + Sync + 'static>(key: &str, make: impl FnOnce() -> T) -> Arc<T> {
    type Cell = Arc<OnceLock<Arc<dyn Any + Send + Sync>>>;
    static CELLS: OnceLock<Mutex<HashMap<String, Cell>>> = OnceLock::new();
    let cell = CELLS
        .get_or_init(Default::default)
        .lock()
        .unwrap()
        .entry(key.to_string())
        .or_default()
        .clone();
    cell.get_or_init(|| Arc::new(make()))
        .clone()
        .downcast()
        .unwrap_or_else(|_| panic!("{key}: cached with another type"))
}

/// A converted fixture with test tensors added to its manifest, so that
/// every backend loads them through the normal path.
pub struct TestWeights {
    _converted: Converted,
    pub dir: ModelDir,
}

impl TestWeights {
    pub fn new(tensors: &[(&str, DType, Vec<usize>, Vec<f32>)]) -> TestWeights {
        let converted = convert_fixture("qwen3_moe", DType::Bf16);
        let mut bytes: Vec<u8> = Vec::new();
        let mut entries = serde_json::Map::new();
        for (name, dtype, shape, data) in tensors {
            let (rows, cols) = match shape.as_slice() {
                [n] => (1, *n),
                [r, c] => (*r, *c),
                _ => panic!("{name}: one or two dimensions"),
            };
            let layout = MatrixLayout::new(*dtype, rows, cols).expect("storable");
            bytes.resize(bytes.len().next_multiple_of(64), 0);
            let offset = bytes.len();
            bytes.extend(RowEncoder::new(layout).encode_matrix(data));
            entries.insert(
                name.to_string(),
                serde_json::json!({
                    "file": "test.bin", "offset": offset, "nbytes": layout.total_bytes,
                    "shape": shape, "dtype": dtype.name(),
                }),
            );
        }
        std::fs::write(converted.dir.join("test.bin"), &bytes).unwrap();
        let manifest_path = converted.dir.join("manifest.json");
        let mut manifest: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&manifest_path).unwrap()).unwrap();
        manifest["tensors"].as_object_mut().unwrap().extend(entries);
        manifest["files"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({
                "path": "test.bin", "size": bytes.len(),
                "xxh3": format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes)),
            }));
        std::fs::write(&manifest_path, manifest.to_string()).unwrap();
        let dir = ModelDir::open(&converted.dir, OpenOptions::default()).unwrap();
        TestWeights {
            _converted: converted,
            dir,
        }
    }

    pub fn load<B: Backend>(&self, backend: &B, name: &str, shape: &[usize]) -> B::Weight {
        backend
            .load_weight(&self.dir.tensor(name, shape).unwrap(), TensorRole::Matrix)
            .unwrap()
    }
}

/// The same host matrix on the reference and on `b`.
pub fn both<B: Conformance>(
    b: &B,
    rows: usize,
    cols: usize,
    data: Vec<f32>,
) -> (CpuTensor, B::Tensor) {
    let on_b = b.upload(rows, cols, &data);
    (CpuTensor::new(rows, cols, data), on_b)
}

/// Attention of `n` random rows (queries, keys and values drawn from
/// `seed`, `seed + 1` and `seed + 2`) appended to the reference's cache and
/// to `b`'s: the reference's output, then `b`'s.
pub fn attend_random_rows<B: Conformance>(
    r: &CpuBackend,
    b: &B,
    (cache_r, cache_b): (&mut <CpuBackend as Backend>::KvCache, &mut B::KvCache),
    shape: AttentionShape,
    n: usize,
    seed: u64,
) -> (Vec<f32>, Vec<f32>) {
    let (q_width, kv_width) = (
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
    );
    let (q_r, q_b) = both(b, n, q_width, values(n * q_width, seed));
    let (k_r, k_b) = both(b, n, kv_width, values(n * kv_width, seed + 1));
    let (v_r, v_b) = both(b, n, kv_width, values(n * kv_width, seed + 2));
    let want = r
        .attention(cache_r, &q_r, &k_r, &v_r, shape, None)
        .unwrap()
        .data;
    let got = host(
        b,
        &b.attention(cache_b, &q_b, &k_b, &v_b, shape, None).unwrap(),
    );
    (want, got)
}

/// Causal attention in f64 of the `n` rows [`attend_random_rows`] draws
/// with `seed`, after the keys and values of `history` (cut first to the
/// positions before the rows: the cache holds `cached` with them; the new
/// rows appended), each query head reading its group's KV head, scores
/// scaled by 1/√head_dim; rounded to f32 once at the end.
fn exact_attention(
    shape: AttentionShape,
    n: usize,
    seed: u64,
    (keys, vals): &mut (Vec<f32>, Vec<f32>),
    cached: usize,
) -> Vec<f32> {
    let (heads, kv_heads, d) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    let kv_width = kv_heads * d;
    let before = cached - n;
    keys.truncate(before * kv_width);
    vals.truncate(before * kv_width);
    let q = values(n * heads * d, seed);
    keys.extend(values(n * kv_width, seed + 1));
    vals.extend(values(n * kv_width, seed + 2));
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = Vec::with_capacity(n * heads * d);
    for i in 0..n {
        let positions = before + i + 1;
        for h in 0..heads {
            let g = h / (heads / kv_heads);
            let qh = &q[(i * heads + h) * d..][..d];
            let scores: Vec<f64> = (0..positions)
                .map(|j| {
                    let k = &keys[j * kv_width + g * d..][..d];
                    qh.iter()
                        .zip(k)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = p.iter().sum();
            for c in 0..d {
                let v: f64 = (0..positions)
                    .map(|j| p[j] * vals[j * kv_width + g * d + c] as f64)
                    .sum();
                out.push((v / total) as f32);
            }
        }
    }
    out
}

/// Plain SwiGLU experts without biases.
pub fn swiglu<B: Backend>() -> ExpertFfn<'static, B> {
    ExpertFfn::swiglu()
}

pub fn host<B: Backend>(b: &B, x: &B::Tensor) -> Vec<f32> {
    b.to_host(x).unwrap()
}

/// Quantization parameter `g` of row `r` (bf16) at `offset` in `w`.
fn group_param(w: &MatrixView<'_>, offset: usize, r: usize, g: usize) -> f64 {
    let at = offset + 2 * (r * w.layout.groups_per_row() + g);
    f32::from_bits((u16::from_le_bytes([w.bytes[at], w.bytes[at + 1]]) as u32) << 16) as f64
}

/// `Σ a·b` and `Σ |a·b|` in f64 (eight independent lanes).
fn dot_and_magnitude(a: &[f32], b: &[f32]) -> (f64, f64) {
    let (mut sum, mut magnitude) = ([0f64; 8], [0f64; 8]);
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (at, bt) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            let p = x[i] as f64 * y[i] as f64;
            sum[i] += p;
            magnitude[i] += p.abs();
        }
    }
    for (i, (&x, &y)) in at.iter().zip(bt).enumerate() {
        let p = x as f64 * y as f64;
        sum[i] += p;
        magnitude[i] += p.abs();
    }
    (sum.iter().sum(), magnitude.iter().sum())
}

/// A matrix, dequantized, with what [`ProductBounds::product`] needs of
/// it: with int8 activations and q4/q8 weights, each row's per-group
/// central weight `c_g` and spread `Σ|w − c_g|`.
pub struct ProductBounds {
    cols: usize,
    rows: Vec<f32>,
    /// `(c_g, Σ|w − c_g|)` per row and group.
    int8: Option<Vec<(f64, f64)>>,
}

/// A token's int8 step `d_g` and sum `Σ x` per group of inputs.
pub struct TokenGroups(Vec<(f64, f64)>);

impl TokenGroups {
    pub fn new(x: &[f32]) -> TokenGroups {
        TokenGroups(
            x.chunks(GROUP_SIZE)
                .map(|xs| {
                    let max = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                    ((max / 127.0) as f64, xs.iter().map(|&v| v as f64).sum())
                })
                .collect(),
        )
    }
}

impl ProductBounds {
    pub fn new(w: &MatrixView<'_>, activations: Activations) -> ProductBounds {
        let cols = w.cols();
        let mut rows = vec![0f32; w.rows() * cols];
        for (r, row) in rows.chunks_mut(cols).enumerate() {
            w.dequantize_row(r, row);
        }
        let int8 = match (activations, w.layout.dtype.bits()) {
            (Activations::Int8, Some(bits)) => {
                let mean = ((1u32 << bits) - 1) as f64 / 2.0;
                let l = &w.layout;
                let groups = l.groups_per_row();
                let mut params = Vec::with_capacity(w.rows() * groups);
                for (r, row) in rows.chunks(cols).enumerate() {
                    for (g, ws) in row.chunks(GROUP_SIZE).enumerate() {
                        let scale = group_param(w, l.scales_offset, r, g);
                        let centre = group_param(w, l.biases_offset, r, g) + mean * scale;
                        let spread = ws.iter().map(|&w| (w as f64 - centre).abs()).sum();
                        params.push((centre, spread));
                    }
                }
                Some(params)
            }
            _ => None,
        };
        ProductBounds { cols, rows, int8 }
    }

    /// Row `r`, dequantized.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.rows[r * self.cols..(r + 1) * self.cols]
    }

    /// Whether [`ProductBounds::product`] needs the token's groups.
    pub fn int8(&self) -> bool {
        self.int8.is_some()
    }

    /// `Σ w·x` for row `r` and the token `x` (whose groups `groups` are
    /// when int8 activations apply), and the bound of the module's
    /// documentation on a backend's result: 1e-5 of `Σ|w·x|`; with int8
    /// activations, plus `Σ_g Σ|w − c_g|·d_g/2`, the magnitude also
    /// counting `Σ_g |c_g·Σ x|`.
    pub fn product(&self, r: usize, x: &[f32], groups: Option<&TokenGroups>) -> (f64, f64) {
        let (sum, mut magnitude) = dot_and_magnitude(self.row(r), x);
        let mut rounding = 0f64;
        if let Some(params) = &self.int8 {
            let groups = groups.expect("a token's groups for int8 activations");
            let row = &params[r * groups.0.len()..(r + 1) * groups.0.len()];
            for (&(centre, spread), &(step, total)) in row.iter().zip(&groups.0) {
                rounding += spread * step / 2.0;
                magnitude += (centre * total).abs();
            }
        }
        (sum, 1e-5 * magnitude + rounding)
    }
}

/// Per output of `x · wᵀ` (`x` is `[n, cols]`, the output `[n, rows]`),
/// the bound of [`ProductBounds::product`].
fn product_bounds(
    weights: &TestWeights,
    name: &str,
    rows: usize,
    cols: usize,
    x: &[f32],
    activations: Activations,
) -> Vec<f64> {
    exact_products(weights, name, rows, cols, x, activations)
        .into_iter()
        .map(|(_, bound)| bound)
        .collect()
}

/// Per output of `x · wᵀ`, the sum in f64 of the dequantized weights times
/// `x`, and the bound of [`ProductBounds::product`].
fn exact_products(
    weights: &TestWeights,
    name: &str,
    rows: usize,
    cols: usize,
    x: &[f32],
    activations: Activations,
) -> Vec<(f64, f64)> {
    let tensor = weights.dir.tensor(name, &[rows, cols]).unwrap();
    let matrix = ProductBounds::new(&tensor.view(), activations);
    let mut products = vec![(0f64, 0f64); x.len() / cols * rows];
    products
        .par_chunks_mut(rows)
        .zip(x.par_chunks(cols))
        .for_each(|(out, token)| {
            let groups = matrix.int8().then(|| TokenGroups::new(token));
            for (r, product) in out.iter_mut().enumerate() {
                *product = matrix.product(r, token, groups.as_ref());
            }
        });
    products
}

fn activations_name(activations: Activations) -> &'static str {
    match activations {
        Activations::F32 => "f32",
        Activations::Int8 => "int8",
    }
}

/// `b`'s product of `x` (`[n, cols]`) with the test matrix `name` against
/// the reference's, within [`ProductBounds::product`] per output; the reference and
/// the bounds computed once per process.
#[allow(clippy::too_many_arguments)]
fn check_product<B: Conformance>(
    b: &B,
    activations: Activations,
    weights: &TestWeights,
    name: &str,
    rows: usize,
    cols: usize,
    x: &[f32],
    what: &str,
) -> f64 {
    let n = x.len() / cols;
    let tensor = weights.dir.tensor(name, &[rows, cols]).unwrap();
    let key = format!(
        "product {name} {rows}x{cols} {:016x} by {:016x}",
        xxhash_rust::xxh3::xxh3_64(tensor.bytes()),
        xxhash_rust::xxh3::xxh3_64(bytemuck::cast_slice(x)),
    );
    let products = |activations| {
        cached(
            &format!("{key} products {}", activations_name(activations)),
            || exact_products(weights, name, rows, cols, x, activations),
        )
    };
    let want = cached(&key, || {
        let r = reference();
        let w = weights.load(&r, name, &[rows, cols]);
        let want = host(
            &r,
            &r.linear(&CpuTensor::new(n, cols, x.to_vec()), &w).unwrap(),
        );
        // The reference itself against the sums in f64, within the f32
        // bound: the scalar kernels it runs (and the scalar entries of
        // this suite, which are the reference) are held to the products'
        // values, not only to themselves.
        let (exact, bounds): (Vec<f32>, Vec<f64>) = products(Activations::F32)
            .iter()
            .map(|&(sum, bound)| (sum as f32, bound))
            .unzip();
        assert_within(&format!("reference {what}"), &want, &exact, &bounds);
        want
    });
    let bounds: Vec<f64> = products(activations)
        .iter()
        .map(|&(_, bound)| bound)
        .collect();
    let w = weights.load(b, name, &[rows, cols]);
    let got = host(b, &b.linear(&b.upload(n, cols, x), &w).unwrap());
    assert_within(what, &got, &want, &bounds)
}

// ---------------------------------------------------------------------
// Products.

/// Every dtype on shapes of one to 130 rows, 1 to 64 tokens and widths of
/// one to 32 groups (unquantized types also widths of no whole group), and
/// embedding rows of the same tables.
pub fn linear_and_embed<B: Conformance>(b: &B, activations: Activations) {
    let r = reference();
    let shapes = [
        (1, 1, 64),
        (2, 5, 128),
        (3, 7, 192),
        (9, 13, 64),
        (1, 37, 2048),
        (64, 9, 128),
        (5, 130, 192),
        (17, 66, 320),
    ];
    let mut tensors = Vec::new();
    for dtype in [DType::F32, DType::Bf16, DType::Q8, DType::Q4] {
        for (i, &(n, rows, cols)) in shapes.iter().enumerate() {
            // Unquantized types also take widths of no whole group.
            let cols = if dtype.is_quantized() { cols } else { cols + 3 };
            let name = format!("test.{}.{i}", dtype.name());
            tensors.push((name, dtype, n, vec![rows, cols]));
        }
    }
    let specs: Vec<(&str, DType, Vec<usize>, Vec<f32>)> = tensors
        .iter()
        .enumerate()
        .map(|(i, (name, dtype, _, shape))| {
            let data = values(shape[0] * shape[1], (i % shapes.len()) as u64 + 1);
            (name.as_str(), *dtype, shape.clone(), data)
        })
        .collect();
    let weights = TestWeights::new(&specs);
    for (name, dtype, n, shape) in &tensors {
        let (n, rows, cols) = (*n, shape[0], shape[1]);
        let mut x = values(n * cols, (n * cols) as u64);
        x[cols / 3] = 9.0; // an outlier, as real activations have
        let what = format!("linear {} n={n} {rows}x{cols}", dtype.name());
        let worst = check_product(b, activations, &weights, name, rows, cols, &x, &what);
        println!("{what}: worst error {worst:.3} of the bound");
        let tokens: Vec<u32> = (0..2 * rows as u32 + 1)
            .map(|i| (i * 7) % rows as u32)
            .collect();
        let table = weights.load(b, name, shape);
        assert_eq!(
            host(b, &b.embed(&table, &tokens).unwrap()),
            host(
                &r,
                &r.embed(&weights.load(&r, name, shape), &tokens).unwrap()
            ),
            "embed {}",
            dtype.name()
        );
    }
}

/// One token's q4 product with a matrix of many rows (an LM head; CUDA
/// runs it on the tensor cores), the row count no multiple of 16.
pub fn one_token_product_of_many_rows<B: Conformance>(b: &B, activations: Activations) {
    let (rows, cols) = (40_009, 192);
    let name = "test.lm_head";
    let weights = TestWeights::new(&[(name, DType::Q4, vec![rows, cols], values(rows * cols, 5))]);
    let mut x = values(cols, 17);
    x[cols / 3] = 9.0;
    let what = format!("q4 product of one token, {rows}x{cols}");
    let worst = check_product(b, activations, &weights, name, rows, cols, &x, &what);
    println!("{what}: worst error {worst:.3} of the bound");
}

/// Shapes that leave partial tiles everywhere (CUDA's tensor-core kernels
/// take 16 tokens and more): rows no multiple of 128, token counts around
/// 64, a bf16 width of no whole 64-column stage. Some rows are offset
/// (large biases, all-positive groups), and tokens differ in scale by
/// orders of magnitude, as real activations do.
pub fn linear_on_awkward_tiles<B: Conformance>(b: &B, activations: Activations) {
    // (rows, cols); 72 columns only for bf16 (the quantized types need
    // whole 64-column groups).
    let shapes: [(usize, usize); 4] = [(130, 64), (37, 192), (200, 2048), (129, 72)];
    let mut tensors = Vec::new();
    for dtype in [DType::Bf16, DType::Q8, DType::Q4] {
        for (i, &(rows, cols)) in shapes.iter().enumerate() {
            if dtype.is_quantized() && !cols.is_multiple_of(64) {
                continue;
            }
            let mut data = values(rows * cols, 100 + i as u64);
            for row in data.chunks_mut(cols).skip(1).step_by(4) {
                row.iter_mut().for_each(|w| *w += 2.5);
            }
            let name = format!("test.tc.{}.{i}", dtype.name());
            tensors.push((name, dtype, vec![rows, cols], data));
        }
    }
    let specs: Vec<(&str, DType, Vec<usize>, Vec<f32>)> = tensors
        .iter()
        .map(|(n, d, s, v)| (n.as_str(), *d, s.clone(), v.clone()))
        .collect();
    let weights = TestWeights::new(&specs);
    for (name, dtype, shape, _) in &tensors {
        let (rows, cols) = (shape[0], shape[1]);
        for n in [16, 17, 63, 64, 130, 512] {
            let mut x = values(n * cols, (n * cols + rows) as u64);
            x[cols / 3] = 9.0; // an outlier, as real activations have
            for (t, token) in x.chunks_mut(cols).enumerate() {
                let scale = [1.0, 1e-3, 30.0][t % 3];
                token.iter_mut().for_each(|v| *v *= scale);
            }
            let what = format!("linear {:<4} n={n:<3} {rows}x{cols}", dtype.name());
            let worst = check_product(b, activations, &weights, name, rows, cols, &x, &what);
            println!("{what}: worst error {worst:.3} of the bound");
        }
    }
}

/// The fused forms of products: `linear_many` (matrices of a few rows and
/// of over a thousand, every dtype), `rms_norm_linear_many` (one token,
/// the norm inside the products' launch on a GPU, and several) and
/// `linear_add`.
pub fn fused_products<B: Conformance>(b: &B, activations: Activations) {
    let r = reference();
    let cols = 320;
    let rows = [37, 5, 1100];
    let mut specs = vec![(
        "test.norm".to_string(),
        DType::F32,
        vec![cols],
        values(cols, 7),
    )];
    for dtype in [DType::F32, DType::Bf16, DType::Q8, DType::Q4] {
        for (m, &rows) in rows.iter().enumerate() {
            let name = format!("test.{}.{m}", dtype.name());
            specs.push((name, dtype, vec![rows, cols], values(rows * cols, m as u64)));
        }
    }
    let refs: Vec<(&str, DType, Vec<usize>, Vec<f32>)> = specs
        .iter()
        .map(|(n, d, s, v)| (n.as_str(), *d, s.clone(), v.clone()))
        .collect();
    let weights = TestWeights::new(&refs);
    let norm_weight = (
        weights.load(&r, "test.norm", &[cols]),
        weights.load(b, "test.norm", &[cols]),
    );
    for dtype in [DType::F32, DType::Bf16, DType::Q8, DType::Q4] {
        let names: Vec<String> = (0..rows.len())
            .map(|m| format!("test.{}.{m}", dtype.name()))
            .collect();
        let on_r: Vec<_> = names
            .iter()
            .zip(rows)
            .map(|(name, rows)| weights.load(&r, name, &[rows, cols]))
            .collect();
        let on_b: Vec<_> = names
            .iter()
            .zip(rows)
            .map(|(name, rows)| weights.load(b, name, &[rows, cols]))
            .collect();
        let (on_r, on_b): (Vec<_>, Vec<_>) = (on_r.iter().collect(), on_b.iter().collect());
        for n in [1, 3, 20] {
            let mut x = values(n * cols, (cols + n) as u64);
            x[cols / 5] = 11.0;
            let (x_r, x_b) = both(b, n, cols, x.clone());
            let what = format!("{} n={n}", dtype.name());
            let check_all = |op: &str, got: &[B::Tensor], want: &[CpuTensor], input: &[f32]| {
                let mut worst = 0f64;
                for (m, (g, w)) in got.iter().zip(want).enumerate() {
                    let bounds =
                        product_bounds(&weights, &names[m], rows[m], cols, input, activations);
                    let at = format!("{op} {what}: product {m} ({} rows)", rows[m]);
                    worst = worst.max(assert_within(&at, &host(b, g), &w.data, &bounds));
                }
                println!("{op:<20} {what}: worst error {worst:.3} of the bound");
            };
            check_all(
                "linear_many",
                &b.linear_many(&x_b, &on_b).unwrap(),
                &r.linear_many(&x_r, &on_r).unwrap(),
                &x,
            );
            for unit_offset in [false, true] {
                let norm = RmsNorm {
                    eps: 1e-6,
                    unit_offset,
                };
                let (normed, products) = b
                    .rms_norm_linear_many(&x_b, &norm_weight.1, norm, &on_b)
                    .unwrap();
                let (h, want) = r
                    .rms_norm_linear_many(&x_r, &norm_weight.0, norm, &on_r)
                    .unwrap();
                assert_close(
                    &format!("rms_norm_linear_many {what}: normalised input"),
                    &host(b, &normed),
                    &h.data,
                    1e-5,
                );
                check_all("rms_norm_linear_many", &products, &want, &h.data);
            }
            let residual = values(n * rows[0], 3 + n as u64);
            let (mut res_r, mut res_b) = both(b, n, rows[0], residual.clone());
            r.linear_add(&mut res_r, &x_r, on_r[0]).unwrap();
            b.linear_add(&mut res_b, &x_b, on_b[0]).unwrap();
            let mut bounds = product_bounds(&weights, &names[0], rows[0], cols, &x, activations);
            for ((bound, &before), &after) in bounds.iter_mut().zip(&residual).zip(&res_r.data) {
                *bound += 1e-6 * (before.abs() + (after - before).abs()) as f64;
            }
            assert_within(
                &format!("linear_add {what}"),
                &host(b, &res_b),
                &res_r.data,
                &bounds,
            );
        }
    }
}

// ---------------------------------------------------------------------
// Norms and element-wise operations.

pub fn norms<B: Conformance>(b: &B, _: Activations) {
    let r = reference();
    let weights = TestWeights::new(&[
        ("test.norm208", DType::F32, vec![208], values(208, 3)),
        ("test.norm48", DType::F32, vec![48], values(48, 4)),
        ("test.norm80", DType::F32, vec![80], values(80, 5)),
    ]);
    for (name, group, rows, cols) in [
        ("test.norm208", 208, 5, 208),
        ("test.norm48", 48, 3, 48 * 5),
        ("test.norm80", 80, 1, 80),
    ] {
        let (w_r, w_b) = (
            weights.load(&r, name, &[group]),
            weights.load(b, name, &[group]),
        );
        let (x_r, x_b) = both(b, rows, cols, values(rows * cols, group as u64));
        for unit_offset in [false, true] {
            let norm = RmsNorm {
                eps: 1e-6,
                unit_offset,
            };
            assert_close(
                &format!("rms_norm {name} unit_offset={unit_offset}"),
                &host(b, &b.rms_norm(&x_b, &w_b, norm).unwrap()),
                &r.rms_norm(&x_r, &w_r, norm).unwrap().data,
                1e-5,
            );
        }
        let (z_r, z_b) = both(b, rows, cols, values(rows * cols, 99));
        assert_close(
            &format!("gated_rms_norm {name}"),
            &host(b, &b.gated_rms_norm(&x_b, &z_b, &w_b, 1e-6).unwrap()),
            &r.gated_rms_norm(&x_r, &z_r, &w_r, 1e-6).unwrap().data,
            1e-5,
        );
    }
}

pub fn elementwise<B: Conformance>(b: &B, _: Activations) {
    let r = reference();
    let (rows, cols) = (7, 61);
    let (x_r, x_b) = both(b, rows, cols, values(rows * cols, 1));
    let (y_r, y_b) = both(b, rows, cols, values(rows * cols, 2));
    assert_eq!(host(b, &x_b), x_r.data, "to_host");
    assert_eq!(b.rows(&x_b), rows);

    let widths = [13, 40, 8];
    for (g, c) in b
        .split_cols(&x_b, &widths)
        .unwrap()
        .iter()
        .zip(r.split_cols(&x_r, &widths).unwrap())
    {
        assert_eq!(host(b, g), c.data, "split_cols");
    }
    let (last, all) = (rows - 1..rows, 0..rows);
    let gathers: [&[std::ops::Range<usize>]; 4] = [
        std::slice::from_ref(&last),
        std::slice::from_ref(&all),
        &[0..2, 4..7],
        &[1..1, 2..5, 6..7, 0..1],
    ];
    for ranges in gathers {
        assert_eq!(
            host(b, &b.gather_rows(&x_b, ranges).unwrap()),
            r.gather_rows(&x_r, ranges).unwrap().data,
            "gather_rows {ranges:?}"
        );
    }
    let split = [0..2, 2..2, 2..7];
    let parts: Vec<_> = split
        .iter()
        .map(|s| b.gather_rows(&x_b, std::slice::from_ref(s)).unwrap())
        .collect();
    assert_eq!(
        host(b, &b.concat_rows(&parts).unwrap()),
        x_r.data,
        "concat_rows"
    );

    let (mut a_r, mut a_b) = both(b, rows, cols, values(rows * cols, 1));
    r.add_assign(&mut a_r, &y_r).unwrap();
    b.add_assign(&mut a_b, &y_b).unwrap();
    assert_close("add_assign", &host(b, &a_b), &a_r.data, 1e-7);

    assert_close(
        "silu_mul",
        &host(b, &b.silu_mul(&x_b, &y_b).unwrap()),
        &r.silu_mul(&x_r, &y_r).unwrap().data,
        1e-6,
    );

    let (mut m_r, mut m_b) = both(b, rows, cols, values(rows * cols, 1));
    r.mul_sigmoid(&mut m_r, &y_r).unwrap();
    b.mul_sigmoid(&mut m_b, &y_b).unwrap();
    assert_close("mul_sigmoid", &host(b, &m_b), &m_r.data, 1e-6);

    let (g_r, g_b) = both(b, rows, 1, values(rows, 5));
    let (mut m_r, mut m_b) = both(b, rows, cols, values(rows * cols, 1));
    r.mul_sigmoid(&mut m_r, &g_r).unwrap();
    b.mul_sigmoid(&mut m_b, &g_b).unwrap();
    assert_close("mul_sigmoid per row", &host(b, &m_b), &m_r.data, 1e-6);
}

/// Partial and whole rotations, θ from 1e4 to 1e7, positions up to 123457;
/// YaRN with gpt-oss' settings (truncate false, attention factor 1.35)
/// and DeepSeek-V3's (factor 40, mscale equal to mscale_all_dim), on a
/// partial rotation.
fn ropes() -> [(Rope, usize); 5] {
    let yarn = moeflux::rope::Yarn {
        factor: 32.0,
        original_max_position_embeddings: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: None,
        mscale_all_dim: None,
        attention_factor: None,
        truncate: false,
    };
    let deepseek = moeflux::rope::Yarn {
        factor: 40.0,
        mscale: Some(1.0),
        mscale_all_dim: Some(1.0),
        truncate: true,
        ..yarn
    };
    [
        (Rope::plain(40, 24, 10_000.0), 0),
        (Rope::plain(40, 40, 1_000_000.0), 1000),
        (Rope::plain(64, 16, 10_000_000.0), 123_457),
        (
            Rope {
                yarn: Some(yarn),
                ..Rope::plain(64, 64, 150_000.0)
            },
            70_001,
        ),
        (
            Rope {
                yarn: Some(deepseek),
                ..Rope::plain(48, 32, 10_000.0)
            },
            5,
        ),
    ]
}

pub fn rope<B: Conformance>(b: &B, _: Activations) {
    let r = reference();
    for (rope, start) in ropes() {
        let (head_dim, rotary_dim) = (rope.head_dim, rope.rotary_dim);
        let (rows, cols) = (5, 3 * head_dim);
        let (mut x_r, mut x_b) = both(b, rows, cols, values(rows * cols, head_dim as u64));
        r.rope(&mut x_r, rope, start).unwrap();
        b.rope(&mut x_b, rope, start).unwrap();
        assert_close(
            &format!("rope {head_dim}/{rotary_dim} at {start}"),
            &host(b, &x_b),
            &x_r.data,
            1e-5,
        );
    }
}

/// RMSNorm of each head of q and k, then RoPE (one launch on a GPU), for
/// one token and several, with and without the unit offset; 160 tokens
/// (960 heads) take CUDA's warp-per-head kernel on GPUs of up to 160
/// multiprocessors.
pub fn qk_norm_rope<B: Conformance>(b: &B, _: Activations) {
    let r = reference();
    for (rope, start) in ropes() {
        let (head_dim, rotary_dim) = (rope.head_dim, rope.rotary_dim);
        let (qw, kw) = (
            format!("test.q_norm.{head_dim}"),
            format!("test.k_norm.{head_dim}"),
        );
        let weights = TestWeights::new(&[
            (&qw, DType::F32, vec![head_dim], values(head_dim, 8)),
            (&kw, DType::F32, vec![head_dim], values(head_dim, 9)),
        ]);
        for (n, unit_offset) in [(1, false), (1, true), (7, true), (160, true)] {
            let norm = RmsNorm {
                eps: 1e-6,
                unit_offset,
            };
            let (q_r, q_b) = both(b, n, 5 * head_dim, values(n * 5 * head_dim, 11));
            let (k_r, k_b) = both(b, n, head_dim, values(n * head_dim, 12));
            let (q_want, k_want) = r
                .qk_norm_rope(
                    q_r,
                    k_r,
                    &weights.load(&r, &qw, &[head_dim]),
                    &weights.load(&r, &kw, &[head_dim]),
                    norm,
                    rope,
                    start,
                )
                .unwrap();
            let (q_got, k_got) = b
                .qk_norm_rope(
                    q_b,
                    k_b,
                    &weights.load(b, &qw, &[head_dim]),
                    &weights.load(b, &kw, &[head_dim]),
                    norm,
                    rope,
                    start,
                )
                .unwrap();
            let what = format!("qk_norm_rope {head_dim}/{rotary_dim} at {start}, n={n}");
            assert_close(&format!("{what}: q"), &host(b, &q_got), &q_want.data, 2e-5);
            assert_close(&format!("{what}: k"), &host(b, &k_got), &k_want.data, 2e-5);
        }
    }
}

// ---------------------------------------------------------------------
// Attention and Gated DeltaNet.

/// A head size every KV type stores: `head_dim`, or for q8 (whose blocks
/// of 32 values do not straddle heads) `q8_head_dim`.
pub fn head_dim_for(kv: KvType, head_dim: usize, q8_head_dim: usize) -> usize {
    match kv {
        KvType::Q8 if !head_dim.is_multiple_of(32) => q8_head_dim,
        _ => head_dim,
    }
}

/// Chunks of several tokens and of one; 309 positions, past the CUDA
/// cache's first capacity of 256, so it grows; truncation; a cache
/// imported from the reference's export: for every KV type against the
/// reference's cache of that type, which holds the same rows bit for bit
/// (heads of 40, or 64 for q8, which refuses 40).
pub fn attention<B: Conformance>(b: &B, _: Activations) {
    let r = reference();
    for kv in KvType::ALL {
        let head_dim = head_dim_for(kv, 40, 64);
        let shape = AttentionShape {
            num_heads: 6,
            num_kv_heads: 2,
            head_dim,
            window: None,
            latent: false,
        };
        let mut cache_r = r.new_kv_cache(shape, kv).unwrap();
        let mut cache_b = b.new_kv_cache(shape, kv).unwrap();
        // The keys and values so far, for the f64 attention the reference's
        // is held to (an f32 cache stores them as they are).
        let mut history: (Vec<f32>, Vec<f32>) = (Vec::new(), Vec::new());
        let mut step = |n: usize, seed: u64, cache_r: &mut CpuKv, cache_b: &mut B::KvCache| {
            let (want, got) = attend_random_rows(&r, b, (cache_r, cache_b), shape, n, seed);
            if kv == KvType::F32 {
                let exact = exact_attention(shape, n, seed, &mut history, r.kv_len(cache_r));
                assert_close(
                    &format!("reference attention chunk of {n} (seed {seed}) against f64"),
                    &want,
                    &exact,
                    1e-5,
                );
            }
            assert_close(
                &format!("{kv} attention chunk of {n} (seed {seed})"),
                &got,
                &want,
                1e-5,
            );
        };
        for (i, n) in [5, 1, 300, 3].into_iter().enumerate() {
            step(n, 10 * i as u64, &mut cache_r, &mut cache_b);
        }
        assert_eq!(b.kv_len(&cache_b), 309);
        let (exported, want) = (
            b.kv_export(&cache_b).unwrap(),
            r.kv_export(&cache_r).unwrap(),
        );
        assert_eq!(exported.keys.kv_type(), kv, "kv_export type");
        assert_eq!(exported.keys, want.keys, "{kv} kv_export keys");
        assert_eq!(exported.values, want.values, "{kv} kv_export values");

        r.kv_truncate(&mut cache_r, 100);
        b.kv_truncate(&mut cache_b, 100);
        assert_eq!(b.kv_len(&cache_b), 100);
        step(4, 77, &mut cache_r, &mut cache_b);

        let mut imported = b.kv_import(shape, r.kv_export(&cache_r).unwrap()).unwrap();
        assert_eq!(b.kv_len(&imported), 104);
        step(2, 91, &mut cache_r, &mut imported);
    }
    let shape = AttentionShape {
        num_heads: 6,
        num_kv_heads: 2,
        head_dim: 40,
        window: None,
        latent: false,
    };
    let refused = b.new_kv_cache(shape, KvType::Q8).err().expect("q8 of 40");
    assert!(refused.to_string().contains("multiple of 32"), "{refused}");
}

/// Prefill chunks (CUDA's tiled kernels from 16 tokens) with head
/// dimensions of 128 and 256 (as in the real models) and 132 (96 for q8),
/// chunks that leave partial row and key tiles, and chunks after context,
/// for every KV type.
pub fn prefill_attention<B: Conformance>(b: &B, _: Activations) {
    let r = reference();
    for kv in KvType::ALL {
        for (heads, kv_heads, head_dim) in [(32, 4, 128), (16, 2, 256), (5, 5, 132)] {
            let head_dim = head_dim_for(kv, head_dim, 96);
            let shape = AttentionShape {
                num_heads: heads,
                num_kv_heads: kv_heads,
                head_dim,
                window: None,
                latent: false,
            };
            let mut cache_r = r.new_kv_cache(shape, kv).unwrap();
            let mut cache_b = b.new_kv_cache(shape, kv).unwrap();
            for (i, n) in [70, 16, 1, 45].into_iter().enumerate() {
                let seed = 1000 + 10 * i as u64 + head_dim as u64;
                let (want, got) =
                    attend_random_rows(&r, b, (&mut cache_r, &mut cache_b), shape, n, seed);
                assert_close(
                    &format!("{kv} attention, head_dim {head_dim}, chunk of {n}"),
                    &got,
                    &want,
                    1e-5,
                );
            }
        }
    }
}

/// `len` rows of keys and values of `width` from the seeds `seed` and
/// `seed + 1`, as a cache of type `kv` holds them.
pub fn host_kv(kv: KvType, len: usize, width: usize, seed: u64) -> HostKv {
    HostKv {
        first: 0,
        keys: KvRows::encode(kv, &values(len * width, seed)),
        values: KvRows::encode(kv, &values(len * width, seed + 1)),
    }
}

/// The q and k norm weights of the tests of several sequences' decode
/// steps (`head_dim` values each, seeds 8 and 9), on the reference and on
/// `b`.
fn decode_qk_norms<B: Conformance>(
    r: &CpuBackend,
    b: &B,
    head_dim: usize,
) -> ((CpuWeight, CpuWeight), (B::Weight, B::Weight)) {
    let weights = TestWeights::new(&[
        (
            "test.q_norm",
            DType::F32,
            vec![head_dim],
            values(head_dim, 8),
        ),
        (
            "test.k_norm",
            DType::F32,
            vec![head_dim],
            values(head_dim, 9),
        ),
    ]);
    let load = |name| {
        (
            weights.load(r, name, &[head_dim]),
            weights.load(b, name, &[head_dim]),
        )
    };
    let ((qn_r, qn_b), (kn_r, kn_b)) = (load("test.q_norm"), load("test.k_norm"));
    ((qn_r, kn_r), (qn_b, kn_b))
}

/// Two decode steps of sequences of `kv` caches after `history` positions
/// each, all at once ([`Backend::attention_decode_many`]) and one at a time
/// on `b` itself ([`attention_decode_each`]): both prepare the same queries
/// and keys, so the caches hold the same rows bit for bit and the outputs
/// differ only by f32 rounding in another order (1e-5 of the output's
/// scale). How far a type's rounding takes attention from the exact
/// result is `kv_types_stay_within_their_rounding`'s.
fn decode_many_equals_each<B: Conformance>(
    b: &B,
    shape: AttentionShape,
    kv: KvType,
    history: &[usize],
) {
    let r = reference();
    let (heads, head_dim) = (shape.num_heads, shape.head_dim);
    let (q_width, kv_width) = (heads * head_dim, shape.num_kv_heads * head_dim);
    let (_, (q_norm, k_norm)) = decode_qk_norms(&r, b, head_dim);
    let norm = RmsNorm {
        eps: 1e-6,
        unit_offset: true,
    };
    let rope = Rope::plain(head_dim, head_dim / 2, 1_000_000.0);
    let caches = || -> Vec<B::KvCache> {
        history
            .iter()
            .enumerate()
            .map(|(s, &len)| {
                let seed = 700 + 2 * s as u64;
                b.kv_import(shape, host_kv(kv, len, kv_width, seed))
                    .unwrap()
            })
            .collect()
    };
    let (mut together, mut alone) = (caches(), caches());
    let n = history.len();
    for round in 0..2u64 {
        let seed = 900 + 10 * round;
        let input = |cols: usize, seed: u64| b.upload(n, cols, &values(n * cols, seed));
        let mut refs: Vec<&mut B::KvCache> = together.iter_mut().collect();
        let (q, k, v) = (
            input(q_width, seed),
            input(kv_width, seed + 1),
            input(kv_width, seed + 2),
        );
        let got = b
            .attention_decode_many(&mut refs, q, k, &v, &q_norm, &k_norm, norm, rope, shape)
            .unwrap();
        let mut refs: Vec<&mut B::KvCache> = alone.iter_mut().collect();
        let (q, k) = (input(q_width, seed), input(kv_width, seed + 1));
        let want =
            attention_decode_each(b, &mut refs, q, k, &v, &q_norm, &k_norm, norm, rope, shape)
                .unwrap();
        let (got, want) = (host(b, &got), host(b, &want));
        for (s, (g, w)) in got.chunks(q_width).zip(want.chunks(q_width)).enumerate() {
            assert_close(
                &format!(
                    "{kv} decode of {n} sequences together against alone, head_dim {head_dim}, \
                     round {round}, sequence {s} after {} positions",
                    history[s] + round as usize
                ),
                g,
                w,
                1e-5,
            );
        }
    }
    for (s, (t, a)) in together.iter().zip(&alone).enumerate() {
        let (t, a) = (b.kv_export(t).unwrap(), b.kv_export(a).unwrap());
        assert_eq!(t.keys, a.keys, "{kv} sequence {s}'s keys");
        assert_eq!(t.values, a.values, "{kv} sequence {s}'s values");
    }
}

/// Two decode steps of several sequences at once (one launch each on a
/// GPU), each sequence at its own position (one with an empty cache), for
/// the head dimensions of the real models and an odd one; afterwards every
/// cache holds what the reference's holds. bf16 and q8 caches: against
/// the same steps one sequence at a time ([`decode_many_equals_each`]).
pub fn attention_decode_many<B: Conformance>(b: &B, _: Activations) {
    for kv in [KvType::Bf16, KvType::Q8] {
        for (heads, kv_heads, head_dim) in [(6, 2, 40), (16, 2, 128), (8, 1, 256)] {
            let shape = AttentionShape {
                num_heads: heads,
                num_kv_heads: kv_heads,
                head_dim: head_dim_for(kv, head_dim, 96),
                window: None,
                latent: false,
            };
            decode_many_equals_each(b, shape, kv, &[0, 1, 37, 300, 5]);
        }
    }
    let r = reference();
    for (heads, kv_heads, head_dim) in [(6, 2, 40), (16, 2, 128), (8, 1, 256)] {
        let shape = AttentionShape {
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            window: None,
            latent: false,
        };
        let (q_width, kv_width) = (heads * head_dim, kv_heads * head_dim);
        let ((qn_r, kn_r), (qn_b, kn_b)) = decode_qk_norms(&r, b, head_dim);
        let norm = RmsNorm {
            eps: 1e-6,
            unit_offset: true,
        };
        let rope = Rope::plain(head_dim, head_dim / 2, 1_000_000.0);
        let history = [0, 1, 37, 300, 5];
        let mut caches_r = Vec::new();
        let mut caches_b = Vec::new();
        for (s, &len) in history.iter().enumerate() {
            let host_kv = || HostKv {
                first: 0,
                keys: KvRows::F32(values(len * kv_width, 100 + s as u64)),
                values: KvRows::F32(values(len * kv_width, 200 + s as u64)),
            };
            caches_r.push(r.kv_import(shape, host_kv()).unwrap());
            caches_b.push(b.kv_import(shape, host_kv()).unwrap());
        }
        let n = history.len();
        for round in 0..2 {
            let seed = 10 * round as u64 + head_dim as u64;
            let (q_r, q_b) = both(b, n, q_width, values(n * q_width, seed));
            let (k_r, k_b) = both(b, n, kv_width, values(n * kv_width, seed + 1));
            let (v_r, v_b) = both(b, n, kv_width, values(n * kv_width, seed + 2));
            let mut refs_r: Vec<&mut CpuKv> = caches_r.iter_mut().collect();
            let mut refs_b: Vec<&mut B::KvCache> = caches_b.iter_mut().collect();
            let want = r
                .attention_decode_many(&mut refs_r, q_r, k_r, &v_r, &qn_r, &kn_r, norm, rope, shape)
                .unwrap()
                .data;
            let got = b
                .attention_decode_many(&mut refs_b, q_b, k_b, &v_b, &qn_b, &kn_b, norm, rope, shape)
                .unwrap();
            let what = format!("attention_decode_many head_dim {head_dim}, round {round}");
            let got = host(b, &got);
            for (s, (g, w)) in got.chunks(q_width).zip(want.chunks(q_width)).enumerate() {
                assert_close(&format!("{what}, sequence {s}"), g, w, 1e-4);
            }
            let worst = got
                .iter()
                .zip(&want)
                .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
            println!("{what}: max error {worst:.2e}");
        }
        for (s, (c_b, c_r)) in caches_b.iter().zip(&caches_r).enumerate() {
            assert_eq!(b.kv_len(c_b), history[s] + 2, "sequence {s}: length");
            let (got, want) = (b.kv_export(c_b).unwrap(), r.kv_export(c_r).unwrap());
            assert_close(
                &format!("attention_decode_many head_dim {head_dim}: sequence {s}'s keys"),
                &got.keys.decode(),
                &want.keys.decode(),
                2e-5,
            );
            assert_eq!(got.values, want.values, "sequence {s}'s values");
        }
    }
}

/// Decode steps after long contexts, where a GPU splits each head's
/// positions over several blocks and merges their results: histories of
/// one chunk of positions and one more, several chunks, and chunks that
/// do not divide evenly among the splits; several steps in a row (each
/// merges anew), one sequence at a time and several at once, for the head
/// dimensions of the real models and an odd one, groups of 8 and 16 query
/// heads per KV head, an odd group and none (a GPU's kernels differ by
/// group); for every KV type (heads of 96 for q8 instead of 40), the
/// several sequences of bf16 and q8 against the same steps one sequence at
/// a time ([`decode_many_equals_each`]). Bounds as `attention` and
/// `attention_decode_many`.
pub fn long_context_decode<B: Conformance>(b: &B, _: Activations) {
    for kv in KvType::ALL {
        long_context_decode_of_type(b, kv);
    }
    long_context_decode_with_sinks_and_windows(b);
}

fn long_context_decode_of_type<B: Conformance>(b: &B, kv: KvType) {
    let r = reference();
    for (heads, kv_heads, head_dim) in [
        (32, 4, 128),
        (6, 2, 40),
        (8, 1, 256),
        (32, 2, 128),
        (4, 4, 64),
    ] {
        let head_dim = head_dim_for(kv, head_dim, 96);
        let shape = AttentionShape {
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            window: None,
            latent: false,
        };
        let (q_width, kv_width) = (heads * head_dim, kv_heads * head_dim);
        for (i, len) in [512, 513, 2047, 4700].into_iter().enumerate() {
            let seed = 3000 + 10 * i as u64 + head_dim as u64;
            let mut cache_r = r
                .kv_import(shape, host_kv(kv, len, kv_width, seed))
                .unwrap();
            let mut cache_b = b
                .kv_import(shape, host_kv(kv, len, kv_width, seed))
                .unwrap();
            for step in 0..3 {
                let seed = seed + 100 * step + 2;
                let (want, got) =
                    attend_random_rows(&r, b, (&mut cache_r, &mut cache_b), shape, 1, seed);
                assert_close(
                    &format!(
                        "{kv} decode after {} positions, head_dim {head_dim}",
                        len + step as usize
                    ),
                    &got,
                    &want,
                    1e-5,
                );
            }
            let (got, want) = (
                b.kv_export(&cache_b).unwrap(),
                r.kv_export(&cache_r).unwrap(),
            );
            assert_eq!(
                got.keys, want.keys,
                "keys after decoding from {len} positions"
            );
            assert_eq!(
                got.values, want.values,
                "values after decoding from {len} positions"
            );
        }

        let history = [1500, 3, 4100];
        if kv != KvType::F32 {
            decode_many_equals_each(b, shape, kv, &history);
            continue;
        }
        let ((qn_r, kn_r), (qn_b, kn_b)) = decode_qk_norms(&r, b, head_dim);
        let norm = RmsNorm {
            eps: 1e-6,
            unit_offset: true,
        };
        let rope = Rope::plain(head_dim, head_dim, 1_000_000.0);
        let mut caches_r = Vec::new();
        let mut caches_b = Vec::new();
        for (s, &len) in history.iter().enumerate() {
            let seed = 500 + 2 * s as u64;
            caches_r.push(
                r.kv_import(shape, host_kv(kv, len, kv_width, seed))
                    .unwrap(),
            );
            caches_b.push(
                b.kv_import(shape, host_kv(kv, len, kv_width, seed))
                    .unwrap(),
            );
        }
        let n = history.len();
        for round in 0..2 {
            let seed = 40 * round as u64 + head_dim as u64;
            let (q_r, q_b) = both(b, n, q_width, values(n * q_width, seed));
            let (k_r, k_b) = both(b, n, kv_width, values(n * kv_width, seed + 1));
            let (v_r, v_b) = both(b, n, kv_width, values(n * kv_width, seed + 2));
            let mut refs_r: Vec<&mut CpuKv> = caches_r.iter_mut().collect();
            let mut refs_b: Vec<&mut B::KvCache> = caches_b.iter_mut().collect();
            let want = r
                .attention_decode_many(&mut refs_r, q_r, k_r, &v_r, &qn_r, &kn_r, norm, rope, shape)
                .unwrap()
                .data;
            let got = b
                .attention_decode_many(&mut refs_b, q_b, k_b, &v_b, &qn_b, &kn_b, norm, rope, shape)
                .unwrap();
            let got = host(b, &got);
            for (s, (g, w)) in got.chunks(q_width).zip(want.chunks(q_width)).enumerate() {
                assert_close(
                    &format!(
                        "long decode of several sequences, head_dim {head_dim}, round {round}, \
                         sequence {s} after {} positions",
                        history[s] + round
                    ),
                    g,
                    w,
                    1e-4,
                );
            }
        }
    }
}

/// Decode steps after long contexts with sink logits, with and without a
/// sliding window (one short of a GPU's grouped kernels and one past), for
/// gpt-oss's head shape, qwen3's (a GPU's tensor-core kernels for bf16)
/// and an odd one (96 for q8), against the reference, for every KV type.
fn long_context_decode_with_sinks_and_windows<B: Conformance>(b: &B) {
    let r = reference();
    for (kv, (heads, kv_heads, head_dim, window)) in KvType::ALL.into_iter().flat_map(|kv| {
        [
            (64, 8, 64, Some(3000)),
            (64, 8, 64, None),
            (6, 2, 40, Some(700)),
            (64, 8, 64, Some(1500)),
            (32, 4, 128, Some(3000)),
            (32, 4, 128, None),
        ]
        .map(|case| (kv, case))
    }) {
        let head_dim = head_dim_for(kv, head_dim, 96);
        let shape = AttentionShape {
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            window,
            latent: false,
        };
        let kv_width = kv_heads * head_dim;
        let q_width = heads * head_dim;
        let sink_values: Vec<f32> = values(heads, 7).iter().map(|v| 2.0 * v).collect();
        let weights = TestWeights::new(&[("test.sinks", DType::F32, vec![heads], sink_values)]);
        let (sinks_r, sinks_b) = (
            weights.load(&r, "test.sinks", &[heads]),
            weights.load(b, "test.sinks", &[heads]),
        );
        let len = 4700;
        let held = shape.retained(len);
        let window_kv = || HostKv {
            first: len - held,
            ..host_kv(kv, held, kv_width, 41)
        };
        let mut cache_r = r.kv_import(shape, window_kv()).unwrap();
        let mut cache_b = b.kv_import(shape, window_kv()).unwrap();
        for step in 0..3u64 {
            let seed = 60 + 10 * step;
            let (q_r, q_b) = both(b, 1, q_width, values(q_width, seed));
            let (k_r, k_b) = both(b, 1, kv_width, values(kv_width, seed + 1));
            let (v_r, v_b) = both(b, 1, kv_width, values(kv_width, seed + 2));
            let want = r
                .attention(&mut cache_r, &q_r, &k_r, &v_r, shape, Some(&sinks_r))
                .unwrap()
                .data;
            let got = b
                .attention(&mut cache_b, &q_b, &k_b, &v_b, shape, Some(&sinks_b))
                .unwrap();
            assert_close(
                &format!(
                    "{kv} decode with sinks after {} positions, window {window:?}, head_dim \
                     {head_dim}",
                    len + step as usize
                ),
                &host(b, &got),
                &want,
                1e-5,
            );
        }
    }
}

/// Head sizes that leave lanes and warps of CUDA's recurrence partly idle
/// (24 × 40) and the real models' (128 × 128); runs of 64 tokens and more
/// (CUDA's chunked tensor-core form: one whole chunk, partial last chunks,
/// many chunks) and shorter ones, each continuing the other's state;
/// 20 × 36 pads the chunked form's key rows to whole MMA steps; 160 × 48
/// is too wide for it. Copies leave their originals alone; a state
/// imported from the reference's export continues as the reference does.
pub fn gated_delta_net<B: Conformance>(b: &B, _: Activations) {
    let r = reference();
    for (key_head_dim, value_head_dim) in [(24, 40), (128, 128), (20, 36), (160, 48)] {
        check_gated_delta_net(
            &r,
            b,
            LinearAttentionConfig {
                num_key_heads: 2,
                num_value_heads: 4,
                key_head_dim,
                value_head_dim,
                conv_kernel: 4,
            },
        );
    }
}

fn check_gated_delta_net<B: Conformance>(r: &CpuBackend, b: &B, cfg: LinearAttentionConfig) {
    let (channels, nv) = (cfg.conv_dim(), cfg.num_value_heads);
    let weights = TestWeights::new(&[
        (
            "test.conv",
            DType::F32,
            vec![channels, 4],
            values(channels * 4, 1),
        ),
        ("test.a_log", DType::F32, vec![nv], values(nv, 2)),
        ("test.dt_bias", DType::F32, vec![nv], values(nv, 3)),
    ]);
    let conv = (
        weights.load(r, "test.conv", &[channels, 4]),
        weights.load(b, "test.conv", &[channels, 4]),
    );
    let a_log = (
        weights.load(r, "test.a_log", &[nv]),
        weights.load(b, "test.a_log", &[nv]),
    );
    let dt_bias = (
        weights.load(r, "test.dt_bias", &[nv]),
        weights.load(b, "test.dt_bias", &[nv]),
    );
    let mut state_r = r.new_delta_net_state(&cfg).unwrap();
    let mut state_b = b.new_delta_net_state(&cfg).unwrap();
    let step = |n: usize, seed: u64, state_r: &mut CpuDeltaNet, state_b: &mut B::DeltaNetState| {
        let (qkv_r, qkv_b) = both(b, n, channels, values(n * channels, seed));
        let (b_r, b_b) = both(b, n, nv, values(n * nv, seed + 1));
        let (a_r, a_b) = both(b, n, nv, values(n * nv, seed + 2));
        let want = r
            .gated_delta_net(
                state_r,
                &qkv_r,
                &b_r,
                &a_r,
                GatedDeltaNetParams {
                    conv: &conv.0,
                    a_log: &a_log.0,
                    dt_bias: &dt_bias.0,
                },
                &cfg,
            )
            .unwrap();
        let got = b
            .gated_delta_net(
                state_b,
                &qkv_b,
                &b_b,
                &a_b,
                GatedDeltaNetParams {
                    conv: &conv.1,
                    a_log: &a_log.1,
                    dt_bias: &dt_bias.1,
                },
                &cfg,
            )
            .unwrap();
        assert_close(
            &format!(
                "gated_delta_net {}x{} chunk of {n} (seed {seed})",
                cfg.key_head_dim, cfg.value_head_dim
            ),
            &host(b, &got),
            &want.data,
            1e-5,
        );
    };
    let compare_states = |what: &str, got: &B::DeltaNetState, want: &CpuDeltaNet| {
        let (g, w) = (
            b.delta_net_export(got).unwrap(),
            r.delta_net_export(want).unwrap(),
        );
        assert_close(
            &format!("{what}: convolution history"),
            &g.conv,
            &w.conv,
            1e-6,
        );
        assert_close(
            &format!("{what}: recurrent state"),
            &g.recurrent,
            &w.recurrent,
            1e-5,
        );
    };
    for (i, n) in [5, 1, 2, 9, 200, 64, 3, 130, 700].into_iter().enumerate() {
        step(n, 10 * i as u64, &mut state_r, &mut state_b);
        compare_states(&format!("after chunk {i}"), &state_b, &state_r);
    }
    let mut copy_r = r.delta_net_copy(&state_r).unwrap();
    let mut copy_b = b.delta_net_copy(&state_b).unwrap();
    step(3, 50, &mut copy_r, &mut copy_b);
    // The originals did not move with their copies.
    compare_states("original after its copy ran", &state_b, &state_r);
    let mut imported = b
        .delta_net_import(&cfg, r.delta_net_export(&state_r).unwrap())
        .unwrap();
    step(2, 60, &mut state_r, &mut imported);
}

// ---------------------------------------------------------------------
// Routing and experts.

pub fn routing<B: Conformance>(b: &B, _: Activations) {
    let r = reference();
    for (n, experts, top_k) in [(9, 37, 5), (1, 8, 2), (4, 300, 10), (3, 512, 1)] {
        let logits = values(n * experts, experts as u64);
        let (l_r, l_b) = both(b, n, experts, logits.clone());
        for normalize in [false, true] {
            let spec = RouterSpec::softmax(top_k, normalize);
            let want = r.route(&l_r, &spec, None).unwrap();
            let (ids, weights) = softmax_top_k(&logits, experts, top_k, normalize);
            assert_eq!(
                want.experts, ids,
                "reference route {n}x{experts} top-{top_k}: not the f64 choice"
            );
            assert_close(
                &format!("reference route weights {n}x{experts} top-{top_k} normalize={normalize}"),
                &want.weights,
                &weights,
                1e-6,
            );
            let got = b.route(&l_b, &spec, None).unwrap();
            assert_eq!(
                b.selected_experts(&got).unwrap(),
                r.selected_experts(&want).unwrap(),
                "route {n}x{experts} top-{top_k}"
            );
            assert_close(
                &format!("route weights {n}x{experts} top-{top_k} normalize={normalize}"),
                &b.routing_weights(&got),
                &want.weights,
                1e-6,
            );
        }
    }
}

/// Each row's softmax top-k in f64, as the reference is held to: the
/// experts, most probable first (ties to the lower index), and their
/// probabilities, renormalised over the chosen with `normalize`; rounded
/// to f32 once at the end.
fn softmax_top_k(
    logits: &[f32],
    experts: usize,
    top_k: usize,
    normalize: bool,
) -> (Vec<u32>, Vec<f32>) {
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    for row in logits.chunks_exact(experts) {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let total: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
        let p: Vec<f64> = row
            .iter()
            .map(|&x| (x as f64 - max).exp() / total)
            .collect();
        let mut order: Vec<usize> = (0..experts).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let chosen = &order[..top_k];
        let sum: f64 = chosen.iter().map(|&e| p[e]).sum();
        for &e in chosen {
            ids.push(e as u32);
            weights.push(match normalize {
                true => p[e] / sum,
                false => p[e],
            } as f32);
        }
    }
    (ids, weights)
}

/// The expert store of a small converted model, every expert fitting its
/// cache.
pub fn whole_store(dir: &ModelDir) -> ExpertStore {
    ExpertStore::open(
        dir,
        StoreOptions {
            cache_bytes: 1 << 30,
            policy: CachePolicy::Lfu,
            io: IoMode::Buffered,
        },
    )
    .unwrap()
}

/// Routed experts of one token (CUDA's fused decode kernels) and of nine,
/// bf16, q4, q3, q2 and MXFP4, on the qwen3_5_moe fixture;
/// `routed_experts_add` too.
pub fn routed_experts<B: Conformance>(b: &B, activations: Activations) {
    let r = reference();
    for (rest, quant) in [
        (DType::Bf16, DType::Bf16),
        (DType::Q4, DType::Q4),
        (DType::Q8, DType::Q3),
        (DType::Q8, DType::Q2),
        (DType::Q8, DType::Mxfp4),
    ] {
        let converted = convert_fixture_with("qwen3_5_moe", rest, quant);
        let dir = ModelDir::open(&converted.dir, OpenOptions::default()).unwrap();
        let store = whole_store(&dir);
        let cfg = dir.config();
        let (hidden, experts, top_k) = (cfg.hidden_size, cfg.moe.num_experts, cfg.moe.router.top_k);
        let layer = cfg.moe_layers().next().expect("an MoE layer");
        let spec = RouterSpec::softmax(top_k, true);
        for n in [1, 9] {
            let x = values(n * hidden, n as u64);
            let (x_r, x_b) = both(b, n, hidden, x.clone());
            let (l_r, l_b) = both(b, n, experts, values(n * experts, 7 + n as u64));
            let routing_r = r.route(&l_r, &spec, None).unwrap();
            let routing_b = b.route(&l_b, &spec, None).unwrap();
            let want = r
                .routed_experts(&x_r, &routing_r, &store, layer, swiglu())
                .unwrap();
            let got = host(
                b,
                &b.routed_experts(&x_b, &routing_b, &store, layer, swiglu())
                    .unwrap(),
            );
            let what = format!("routed experts {} n={n}", quant.name());
            if activations == Activations::F32 {
                assert_close(&what, &got, &want.data, 1e-5);
            }
            let bounds = expert_error_bounds(&store, layer, &x, hidden, &routing_r, activations);
            let worst = assert_within(&what, &got, &want.data, &bounds);
            println!("{what}: worst error {worst:.3} of the bound");

            let out = values(n * hidden, 40 + n as u64);
            let (mut out_r, mut out_b) = both(b, n, hidden, out.clone());
            r.routed_experts_add(&mut out_r, &x_r, &routing_r, &store, layer, swiglu())
                .unwrap();
            b.routed_experts_add(&mut out_b, &x_b, &routing_b, &store, layer, swiglu())
                .unwrap();
            let bounds: Vec<f64> = bounds
                .iter()
                .zip(&out)
                .zip(&want.data)
                .map(|((bound, &o), &y)| bound + 1e-6 * (o.abs() + y.abs()) as f64)
                .collect();
            assert_within(
                &format!("routed_experts_add {} n={n}", quant.name()),
                &host(b, &out_b),
                &out_r.data,
                &bounds,
            );
        }
    }
}

/// A one-layer qwen3_moe checkpoint (f32) larger than the fixtures, so that
/// CUDA's grouped prefill kernels see several 64-column stages, partial
/// 128-row tiles and experts with many 32-slot tiles: hidden 192, expert
/// intermediate 320, 16 experts, top-4. Every fifth weight row is offset
/// (all-positive groups, large biases once quantized).
pub fn synthetic_moe_checkpoint() -> tempfile::TempDir {
    synthetic_moe_checkpoint_of(192, 320)
}

/// [`synthetic_moe_checkpoint`] with other widths: hidden 256 and expert
/// intermediate 512 give every expert matrix whole quads of 64-column
/// groups and whole 16-row tiles, the shape CUDA's few-token kernels take
/// their fast path on (as real models' do).
pub fn synthetic_moe_checkpoint_of(hidden: usize, inter: usize) -> tempfile::TempDir {
    let (experts, vocab, heads, kv_heads, head_dim) = (16usize, 300usize, 4usize, 2usize, 32usize);
    let tmp = tempfile::tempdir().unwrap();
    let config = serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "attention_bias": false, "decoder_sparse_step": 1, "head_dim": head_dim,
        "hidden_act": "silu", "hidden_size": hidden, "intermediate_size": 128,
        "max_position_embeddings": 512, "mlp_only_layers": [],
        "moe_intermediate_size": inter, "norm_topk_prob": true,
        "num_attention_heads": heads, "num_experts_per_tok": 4, "num_hidden_layers": 1,
        "num_key_value_heads": kv_heads, "num_local_experts": experts,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": true, "vocab_size": vocab,
    });
    std::fs::write(tmp.path().join("config.json"), config.to_string()).unwrap();
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![vocab, hidden]),
        ("model.norm.weight".into(), vec![hidden]),
    ];
    let l = "model.layers.0";
    for (name, shape) in [
        ("input_layernorm.weight", vec![hidden]),
        ("post_attention_layernorm.weight", vec![hidden]),
        ("self_attn.q_proj.weight", vec![heads * head_dim, hidden]),
        ("self_attn.k_proj.weight", vec![kv_heads * head_dim, hidden]),
        ("self_attn.v_proj.weight", vec![kv_heads * head_dim, hidden]),
        ("self_attn.o_proj.weight", vec![hidden, heads * head_dim]),
        ("self_attn.q_norm.weight", vec![head_dim]),
        ("self_attn.k_norm.weight", vec![head_dim]),
        ("mlp.gate.weight", vec![experts, hidden]),
    ] {
        shapes.push((format!("{l}.{name}"), shape));
    }
    for e in 0..experts {
        for (name, shape) in [
            ("gate_proj", vec![inter, hidden]),
            ("up_proj", vec![inter, hidden]),
            ("down_proj", vec![hidden, inter]),
        ] {
            shapes.push((format!("{l}.mlp.experts.{e}.{name}.weight"), shape));
        }
    }
    let data: Vec<Vec<u8>> = shapes
        .iter()
        .enumerate()
        .map(|(i, (_, shape))| {
            let cols = *shape.last().unwrap();
            let mut v = values(shape.iter().product(), 1000 + i as u64);
            if shape.len() == 2 {
                for row in v.chunks_mut(cols).skip(2).step_by(5) {
                    row.iter_mut().for_each(|w| *w += 1.5);
                }
            }
            v.iter().flat_map(|f| f.to_le_bytes()).collect()
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = shapes
        .iter()
        .zip(&data)
        .map(|((name, shape), bytes)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .unwrap();
            (name.clone(), view)
        })
        .collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    std::fs::write(tmp.path().join("model.safetensors"), bytes).unwrap();
    tmp
}

/// The inputs of [`grouped_experts`] for `n` tokens: tokens whose scales
/// differ by orders of magnitude, with an outlier, and router logits with
/// one expert chosen by (nearly) every token.
pub fn grouped_expert_inputs(n: usize, hidden: usize, experts: usize) -> (Vec<f32>, Vec<f32>) {
    let mut x = values(n * hidden, 31 * n as u64);
    x[hidden / 3] = 9.0;
    for (t, token) in x.chunks_mut(hidden).enumerate() {
        let scale = [1.0, 1e-3, 30.0][t % 3];
        token.iter_mut().for_each(|v| *v *= scale);
    }
    let mut logits = values(n * experts, 5 + n as u64);
    for row in logits.chunks_mut(experts) {
        row[experts / 2] += 4.0;
    }
    (x, logits)
}

/// The token counts of [`grouped_experts`].
pub const GROUPED_TOKENS: [usize; 4] = [17, 40, 130, 512];

/// The token counts of [`few_token_experts`]: a check of drafted tokens
/// to a decode step of many sequences, a few slots per expert (CUDA groups
/// them by expert on the device, q4 experts in its few-token kernels).
pub const FEW_TOKENS: [usize; 6] = [2, 3, 5, 9, 33, 64];

/// The routed experts of many tokens (CUDA's grouped tensor-core kernels)
/// with every expert prepared (resident on a GPU), for the experts of
/// [`EXPERT_RECIPES`], on the qwen3_5_moe fixture and on the larger
/// [`synthetic_moe_checkpoint`], within [`expert_error_bounds`].
pub fn grouped_experts<B: Conformance>(b: &B, activations: Activations) {
    check_grouped_experts(b, activations, &GROUPED_TOKENS, false);
}

/// The routed experts of a few tokens per expert, every expert prepared,
/// as [`grouped_experts`] checks them, and `routed_experts_add` of them
/// (its addition within 1e-6 of `|out| + |experts|`, as
/// [`routed_experts`] allows); run as the engine's recorded steps run
/// them (on CUDA, grouped on the device).
pub fn few_token_experts<B: Conformance>(b: &B, activations: Activations) {
    b.as_engine_step(|| check_grouped_experts(b, activations, &FEW_TOKENS, true));
}

/// [`grouped_experts`] for `tokens`, and with `add` `routed_experts_add`
/// too.
fn check_grouped_experts<B: Conformance>(
    b: &B,
    activations: Activations,
    tokens: &[usize],
    add: bool,
) {
    let r = reference();
    let synthetic = synthetic_moe_checkpoint();
    // The few-token q4 kernels' fast path (whole quads of groups) too.
    let quads = add.then(|| synthetic_moe_checkpoint_of(256, 512));
    for (rest, quant) in EXPERT_RECIPES {
        let mut models = vec![
            (
                "qwen3_5_moe",
                convert_fixture_with("qwen3_5_moe", rest, quant),
            ),
            (
                "synthetic",
                convert_checkpoint_with(synthetic.path(), rest, Some(quant)),
            ),
        ];
        if let Some(quads) = quads.as_ref().filter(|_| quant == DType::Q4) {
            models.push((
                "synthetic_quads",
                convert_checkpoint_with(quads.path(), rest, Some(quant)),
            ));
        }
        for (model, converted) in models {
            let dir = ModelDir::open(&converted.dir, OpenOptions::default()).unwrap();
            let store = whole_store(&dir);
            let cfg = dir.config();
            let (hidden, experts, top_k) =
                (cfg.hidden_size, cfg.moe.num_experts, cfg.moe.router.top_k);
            let layer = cfg.moe_layers().next().expect("an MoE layer");
            let spec = RouterSpec::softmax(top_k, true);
            b.prepare_experts(&store, &moeflux::util::NoProgress)
                .unwrap();
            for &n in tokens {
                let (x, logits) = grouped_expert_inputs(n, hidden, experts);
                let what = format!("grouped experts {model} {} n={n}", quant.name());
                let routing_r = || {
                    r.route(&CpuTensor::new(n, experts, logits.clone()), &spec, None)
                        .unwrap()
                };
                let want = cached(&what, || {
                    let x_r = CpuTensor::new(n, hidden, x.clone());
                    r.routed_experts(&x_r, &routing_r(), &store, layer, swiglu())
                        .unwrap()
                        .data
                });
                let bounds = cached(&format!("{what} {}", activations_name(activations)), || {
                    expert_error_bounds(&store, layer, &x, hidden, &routing_r(), activations)
                });
                let routing = b
                    .route(&b.upload(n, experts, &logits), &spec, None)
                    .unwrap();
                let got = host(
                    b,
                    &b.routed_experts(&b.upload(n, hidden, &x), &routing, &store, layer, swiglu())
                        .unwrap(),
                );
                let worst = assert_within(&what, &got, &want, &bounds);
                println!("{what}: worst error {worst:.3} of the bound");
                if add {
                    let out = values(n * hidden, 90 + n as u64);
                    let mut out_b = b.upload(n, hidden, &out);
                    b.routed_experts_add(
                        &mut out_b,
                        &b.upload(n, hidden, &x),
                        &routing,
                        &store,
                        layer,
                        swiglu(),
                    )
                    .unwrap();
                    let want_sum: Vec<f32> =
                        out.iter().zip(want.iter()).map(|(o, y)| o + y).collect();
                    let bounds: Vec<f64> = bounds
                        .iter()
                        .zip(&out)
                        .zip(want.iter())
                        .map(|((bound, &o), &y)| bound + 1e-6 * (o.abs() + y.abs()) as f64)
                        .collect();
                    assert_within(
                        &format!("{what}, added"),
                        &host(b, &out_b),
                        &want_sum,
                        &bounds,
                    );
                }
            }
        }
    }
}

/// Per output of the routed experts, the first-order error bound when
/// every product is within its bound ([`ProductBounds::product`]): for
/// `g = gate·x` and `u = up·x` those bounds; `act = silu(g)·u` carries them
/// through its derivatives; the down projection adds its own product bound
/// (on `act`) and `Σ|down|·δact`; the routing weights scale each expert's
/// share.
pub fn expert_error_bounds(
    store: &ExpertStore,
    layer: usize,
    x: &[f32],
    hidden: usize,
    routing: &moeflux::backend::cpu::Routing,
    activations: Activations,
) -> Vec<f64> {
    // Each chosen expert's matrices, once.
    let mut ids: Vec<usize> = routing.experts.iter().map(|&e| e as usize).collect();
    ids.sort_unstable();
    ids.dedup();
    let matrices: HashMap<usize, [ProductBounds; 3]> = ids
        .par_iter()
        .map(|&id| {
            let expert = store.fetch(layer, &[id]).unwrap().remove(0);
            let matrices = [expert.gate(), expert.up(), expert.down()]
                .map(|view| ProductBounds::new(&view, activations));
            (id, matrices)
        })
        .collect();
    let mut bounds = vec![0f64; x.len()];
    bounds
        .par_chunks_mut(hidden)
        .zip(x.par_chunks(hidden))
        .enumerate()
        .for_each(|(t, (bounds, xt))| {
            let x_groups = TokenGroups::new(xt);
            for k in 0..routing.top_k {
                let slot = t * routing.top_k + k;
                let [gate, up, down] = &matrices[&(routing.experts[slot] as usize)];
                let weight = routing.weights[slot] as f64;
                let inter = gate.rows.len() / hidden;
                let mut act = vec![0f32; inter];
                let mut act_error = vec![0f64; inter];
                for j in 0..inter {
                    let (g, g_error) = gate.product(j, xt, Some(&x_groups));
                    let (u, u_error) = up.product(j, xt, Some(&x_groups));
                    let sigmoid = 1.0 / (1.0 + (-g).exp());
                    let silu = g * sigmoid;
                    let silu_slope = sigmoid * (1.0 + g * (1.0 - sigmoid));
                    act[j] = (silu * u) as f32;
                    act_error[j] = (silu_slope * u).abs() * g_error + silu.abs() * u_error;
                }
                let act_groups = TokenGroups::new(&act);
                let act_error: Vec<f32> = act_error.iter().map(|&e| e as f32).collect();
                for (r, bound) in bounds.iter_mut().enumerate() {
                    let (_, own) = down.product(r, &act, Some(&act_groups));
                    let (_, carried) = dot_and_magnitude(down.row(r), &act_error);
                    *bound += weight * (own + carried);
                }
            }
        });
    bounds
}

// ---------------------------------------------------------------------
// Model-level checks per backend.

fn open_on<B: Backend>(backend: B, dir: &Path) -> Arc<Model<B>> {
    Arc::new(
        Model::open_with(backend, dir, &ModelOptions::default())
            .unwrap_or_else(|e| panic!("opening {}: {e}", dir.display())),
    )
}

/// Every fixture in bf16 and q4: sequences batched equal each alone
/// within the backend's [`Conformance::BATCHED_BOUND`] (common/batch.rs).
pub fn batched_equals_alone<B: Conformance>(label: &str, make: impl Fn() -> B) {
    for &name in super::FIXTURES {
        for quant in [DType::Bf16, DType::Q4] {
            let converted = convert_fixture(name, quant);
            let model = open_on(make(), &converted.dir);
            super::batch::check_batched_equals_alone(
                &model,
                &format!("{name} {label} {}", quant.name()),
                B::BATCHED_BOUND,
            );
        }
    }
}

/// Every fixture in q8 and q4: a device failure in the middle of a batch
/// fails only that batch (common/batch.rs).
pub fn device_failure_contained<B: Conformance>(_label: &str, make: impl Fn() -> B) {
    for &name in super::FIXTURES {
        for quant in [DType::Q8, DType::Q4] {
            let converted = convert_fixture(name, quant);
            super::batch::check_device_failure_is_contained(&converted.dir, &make);
        }
    }
}
