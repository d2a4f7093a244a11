//! Causal grouped-query attention over a growing KV cache.

use rayon::prelude::*;

use super::simd::{Isa, dot};
use crate::backend::AttentionShape;

/// Keys and values of every position seen so far, `[len, kv_heads·head_dim]`.
pub struct KvCache {
    pub shape: AttentionShape,
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
}

impl KvCache {
    pub fn new(shape: AttentionShape) -> Self {
        KvCache {
            shape,
            keys: Vec::new(),
            values: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.keys.len() / (self.shape.num_kv_heads * self.shape.head_dim)
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// Appends `k`, `v` (`n` rows) and attends each of the `n` queries to every
/// cached position up to and including its own.
pub fn attend(cache: &mut KvCache, q: &[f32], k: &[f32], v: &[f32], n: usize) -> Vec<f32> {
    let s = cache.shape;
    let start = cache.len();
    cache.keys.extend_from_slice(k);
    cache.values.extend_from_slice(v);
    let (hd, q_width) = (s.head_dim, s.num_heads * s.head_dim);
    let group = s.num_heads / s.num_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; n * q_width];
    let isa = Isa::get();
    let cache = &*cache;
    out.par_chunks_mut(hd).enumerate().for_each_init(
        Vec::new,
        |scores: &mut Vec<f32>, (i, out)| {
            let (t, head) = (i / s.num_heads, i % s.num_heads);
            let head = Head {
                query: &q[t * q_width + head * hd..][..hd],
                offset: (head / group) * hd,
                visible: start + t + 1,
                scale,
            };
            isa.vectorize(|| head.attend(cache, scores, out));
        },
    );
    out
}

/// One query head at one position.
struct Head<'a> {
    query: &'a [f32],
    /// Column of its KV head in a cache row.
    offset: usize,
    /// Cached positions it sees.
    visible: usize,
    scale: f32,
}

impl Head<'_> {
    /// Softmax-weighted sum of the visible values into `out`; plain loops,
    /// vectorised by [`Isa::vectorize`].
    #[inline(always)]
    fn attend(&self, cache: &KvCache, scores: &mut Vec<f32>, out: &mut [f32]) {
        let hd = self.query.len();
        let width = cache.shape.num_kv_heads * hd;
        let at = |j: usize| j * width + self.offset;
        scores.clear();
        scores.extend(
            (0..self.visible).map(|j| dot(self.query, &cache.keys[at(j)..][..hd]) * self.scale),
        );
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0f32;
        for x in scores.iter_mut() {
            *x = (*x - max).exp();
            total += *x;
        }
        let inv = 1.0 / total;
        for (j, &p) in scores.iter().enumerate() {
            let w = p * inv;
            for (o, &v) in out.iter_mut().zip(&cache.values[at(j)..][..hd]) {
                *o += w * v;
            }
        }
    }
}

/// Rotates the first `rotary_dim` features of each `head_dim` group of
/// every row, row `t` at position `start_pos + t` (halves rotated against
/// each other, as transformers' `rotate_half`).
pub fn rope(
    x: &mut [f32],
    cols: usize,
    head_dim: usize,
    rotary_dim: usize,
    theta: f64,
    start_pos: usize,
) {
    let half = rotary_dim / 2;
    // Frequencies in f32 like transformers' RotaryEmbedding.
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / rotary_dim as f32))
        .collect();
    x.par_chunks_mut(cols).enumerate().for_each(|(t, row)| {
        let pos = (start_pos + t) as f32;
        let (cos, sin): (Vec<f32>, Vec<f32>) = inv_freq
            .iter()
            .map(|&f| {
                let angle = pos * f;
                (angle.cos(), angle.sin())
            })
            .unzip();
        for head in row.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (x1, x2) = (head[i], head[i + half]);
                head[i] = x1 * cos[i] - x2 * sin[i];
                head[i + half] = x2 * cos[i] + x1 * sin[i];
            }
        }
    });
}
