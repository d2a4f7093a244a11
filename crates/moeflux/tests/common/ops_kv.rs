//! The KV cache types against exact attention, on every backend: a bf16
//! or q8 cache holds each key and value within its type's rounding, the
//! backend attends exactly over what it holds, and so its output stays
//! within a bound of the f32 reference's that follows from the rounding.
//!
//! Bounds, each checked per value:
//! - the held keys and values (exported, decoded) against the exact ones:
//!   bf16 2⁻⁸·|x| (8 significant bits, rounded to nearest); q8 half its
//!   block's step, `s·(1/2 + 1e-5) + 2⁻²²·|x|` (`s = max|x|/127`; the rest
//!   the f32 rounding of `x/s` and of `code·s`);
//! - the output against attention over the held rows computed directly in
//!   f64: 1e-5 of the output's scale (f32 arithmetic in another order);
//! - the output against the f32 reference: with the held keys off by at
//!   most `e_k(j, d)` and the values by `e_v(j, d)`, a score moves by at
//!   most `E_j = Σ_d |q_d|·e_k(j, d)/√head_dim`; with `E` a query's largest,
//!   each probability by a factor within `e^{±2E}`, so
//!   `|out' − out| ≤ (e^{2E} − 1)·Σ_j p_j·|v_j| + e^{2E}·Σ_j p_j·e_v(j)`
//!   per dimension (`p` the exact probabilities; a sink's share carries no
//!   value and no error), plus the 1e-5 above.

use moeflux::backend::{AttentionShape, Backend, HostKv, KvRows, KvType};

use super::ops::{
    Activations, Conformance, assert_close, assert_within, both, host, reference, values,
};
use super::ops_extended::{TestSinks, direct_attention, direct_probabilities};

/// A case: heads, KV heads, head size, window, sinks, positions imported
/// before the chunks, the chunks.
type Case = (
    usize,
    usize,
    usize,
    Option<usize>,
    bool,
    usize,
    &'static [usize],
);

/// Chunks of one token and of many (CUDA's tiled prefill from 16, a cache
/// grown past 256 positions), a sliding window with sinks, and decode
/// steps after 2100 imported positions (CUDA's grouped kernels).
const CASES: [Case; 4] = [
    (6, 2, 64, None, false, 0, &[20, 1, 5, 1, 300, 1]),
    (32, 4, 128, None, false, 0, &[40, 1, 1]),
    (8, 2, 64, Some(9), true, 0, &[3, 1, 20, 1, 1]),
    (32, 4, 128, None, false, 2100, &[1, 1]),
];

pub fn kv_types_stay_within_their_rounding<B: Conformance>(b: &B, _: Activations) {
    for kv in [KvType::Bf16, KvType::Q8] {
        for case in CASES {
            check_type(b, kv, case);
        }
    }
}

fn check_type<B: Conformance>(b: &B, kv: KvType, case: Case) {
    let r = reference();
    let (heads, kv_heads, head_dim, window, with_sinks, history, chunks) = case;
    let shape = AttentionShape {
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        window,
        latent: false,
    };
    let (q_width, kv_width) = (heads * head_dim, kv_heads * head_dim);
    let sinks = TestSinks::new(&r, b, heads, 6);
    let (sinks_r, sinks_b, sinks_host) = sinks.given(with_sinks);
    let mut keys = values(history * kv_width, 51);
    let mut vals = values(history * kv_width, 52);
    let imported = |as_type: KvType| HostKv {
        first: 0,
        keys: KvRows::encode(as_type, &keys),
        values: KvRows::encode(as_type, &vals),
    };
    let mut cache_r = r.kv_import(shape, imported(KvType::F32)).unwrap();
    let mut cache_b = b.kv_import(shape, imported(kv)).unwrap();
    let what = format!("{kv} attention, heads {heads}/{kv_heads} of {head_dim}, window {window:?}");
    let (mut worst, mut largest) = (0f64, 0f32);
    for (i, &n) in chunks.iter().enumerate() {
        let seed = 60 + 10 * i as u64;
        let q = values(n * q_width, seed);
        let k = values(n * kv_width, seed + 1);
        let v = values(n * kv_width, seed + 2);
        let (q_r, q_b) = both(b, n, q_width, q.clone());
        let (k_r, k_b) = both(b, n, kv_width, k.clone());
        let (v_r, v_b) = both(b, n, kv_width, v.clone());
        keys.extend(k);
        vals.extend(v);
        let exact = r
            .attention(&mut cache_r, &q_r, &k_r, &v_r, shape, sinks_r)
            .unwrap()
            .data;
        let got = host(
            b,
            &b.attention(&mut cache_b, &q_b, &k_b, &v_b, shape, sinks_b)
                .unwrap(),
        );
        let held = |x: &[f32]| KvRows::encode(kv, x).decode();
        let over_held = direct_attention(shape, sinks_host, &q, &held(&keys), &held(&vals));
        assert_close(
            &format!("{what}: chunk {i} of {n} over the rows the cache holds"),
            &got,
            &over_held,
            1e-5,
        );
        let scale = exact.iter().fold(0f64, |m, x| m.max(x.abs() as f64));
        let bounds = rounding_bounds(shape, sinks_host, &q, (&keys, &vals), kv, 1e-5 * scale);
        let fraction = assert_within(
            &format!("{what}: chunk {i} of {n} against the f32 reference"),
            &got,
            &exact,
            &bounds,
        );
        worst = worst.max(fraction);
        largest = got
            .iter()
            .zip(&exact)
            .fold(largest, |m, (g, e)| m.max((g - e).abs()));
    }
    let exported = b.kv_export(&cache_b).unwrap();
    let from = exported.first * kv_width;
    for (name, rows, exact) in [
        ("keys", &exported.keys, &keys),
        ("values", &exported.values, &vals),
    ] {
        let exact = &exact[from..];
        let bounds = rounding(kv, exact);
        assert_within(
            &format!("{what}: held {name}"),
            &rows.decode(),
            exact,
            &bounds,
        );
    }
    println!(
        "{what}: largest error against f32 {largest:.2e}, at most {:.1}% of the bound",
        100.0 * worst
    );
}

/// How far a cache of type `kv` may hold each of `x` from its value (see
/// the module documentation).
fn rounding(kv: KvType, x: &[f32]) -> Vec<f64> {
    match kv {
        KvType::F32 => vec![0.0; x.len()],
        KvType::Bf16 => x.iter().map(|v| v.abs() as f64 / 256.0).collect(),
        KvType::Q8 => x
            .chunks(32)
            .flat_map(|block| {
                let step = (block.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0) as f64;
                block
                    .iter()
                    .map(move |v| step * (0.5 + 1e-5) + v.abs() as f64 / (1u64 << 22) as f64)
            })
            .collect(),
    }
}

/// The bound on each output of attention over keys and values held as
/// `kv` against attention over the exact ones, plus `slack` (see the
/// module documentation).
fn rounding_bounds(
    shape: AttentionShape,
    sinks: Option<&[f32]>,
    q: &[f32],
    (keys, vals): (&[f32], &[f32]),
    kv: KvType,
    slack: f64,
) -> Vec<f64> {
    let hd = shape.head_dim;
    let kv_width = shape.num_kv_heads * hd;
    let (key_error, value_error) = (rounding(kv, keys), rounding(kv, vals));
    let scale = 1.0 / (hd as f64).sqrt();
    let mut bounds = vec![slack; q.len()];
    for row in direct_probabilities(shape, sinks, q, keys) {
        let query = &q[row.at..][..hd];
        let at = |j: usize| (row.first + j) * kv_width + row.column;
        let largest = (0..row.probabilities.len())
            .map(|j| {
                let errors = &key_error[at(j)..][..hd];
                scale
                    * query
                        .iter()
                        .zip(errors)
                        .map(|(q, e)| q.abs() as f64 * e)
                        .sum::<f64>()
            })
            .fold(0.0, f64::max);
        let grow = (2.0 * largest).exp();
        for (d, bound) in bounds[row.at..][..hd].iter_mut().enumerate() {
            let (mut magnitude, mut error) = (0.0, 0.0);
            for (j, p) in row.probabilities.iter().enumerate() {
                magnitude += p * vals[at(j) + d].abs() as f64;
                error += p * value_error[at(j) + d];
            }
            *bound += (grow - 1.0) * magnitude + grow * error;
        }
    }
    bounds
}
