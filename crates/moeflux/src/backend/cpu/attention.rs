//! Causal grouped-query attention over a growing KV cache.

use rayon::prelude::*;

use super::simd::{Isa, dot};
use crate::backend::{AttentionShape, Rope};

/// Keys and values of the positions a sequence's next queries can see,
/// `[held, kv_heads·head_dim]`: every position so far, or a sliding
/// window's newest.
pub struct KvCache {
    pub shape: AttentionShape,
    /// The position of the first row held (positions before it were
    /// dropped by a sliding window).
    pub first: usize,
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
}

impl KvCache {
    pub fn new(shape: AttentionShape) -> Self {
        KvCache {
            shape,
            first: 0,
            keys: Vec::new(),
            values: Vec::new(),
        }
    }

    /// Positions seen so far, held or dropped.
    pub fn len(&self) -> usize {
        self.first + self.held()
    }

    /// Positions held.
    pub fn held(&self) -> usize {
        self.keys.len() / self.width()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn width(&self) -> usize {
        self.shape.num_kv_heads * self.shape.head_dim
    }

    /// Drops positions at or after `len` (not before [`KvCache::first`]).
    pub fn truncate(&mut self, len: usize) {
        assert!(
            len >= self.first,
            "a sliding-window cache cannot be cut back before its first held position"
        );
        let rows = (len - self.first) * self.width();
        self.keys.truncate(rows);
        self.values.truncate(rows);
    }

    /// Keeps only what the shape's window lets the next query see.
    fn drop_outside_window(&mut self) {
        let (len, held) = (self.len(), self.held());
        let keep = self.shape.retained(len);
        if keep < held {
            let drop = (held - keep) * self.width();
            self.keys.drain(..drop);
            self.values.drain(..drop);
            self.first = len - keep;
        }
    }
}

/// Appends `k`, `v` (`n` rows) and attends each of the `n` queries to every
/// cached position up to and including its own (within the window, if the
/// shape has one), with a sink logit per query head when `sinks` is given.
pub fn attend(
    isa: Isa,
    cache: &mut KvCache,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    sinks: Option<&[f32]>,
) -> Vec<f32> {
    let s = cache.shape;
    let start = cache.len();
    cache.keys.extend_from_slice(k);
    cache.values.extend_from_slice(v);
    let (hd, q_width) = (s.head_dim, s.num_heads * s.head_dim);
    let group = s.num_heads / s.num_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; n * q_width];
    let held = &*cache;
    // One task per (position, KV head): the query heads that share a KV
    // head read each cached key and value once between them. Each head's
    // arithmetic is the same as attending it alone.
    out.par_chunks_mut(group * hd).enumerate().for_each_init(
        Vec::new,
        |scores: &mut Vec<f32>, (i, out)| {
            let (t, kv_head) = (i / s.num_kv_heads, i % s.num_kv_heads);
            let position = start + t;
            let oldest = match s.window {
                Some(w) => (position + 1).saturating_sub(w).max(held.first),
                None => held.first,
            };
            let heads = HeadGroup {
                queries: &q[t * q_width + kv_head * group * hd..][..group * hd],
                offset: kv_head * hd,
                visible: oldest - held.first..position + 1 - held.first,
                sinks: sinks.map(|s| &s[kv_head * group..(kv_head + 1) * group]),
                scale,
            };
            isa.vectorize(
                #[inline(always)]
                || heads.attend(held, scores, out),
            );
        },
    );
    cache.drop_outside_window();
    out
}

/// The query heads of one position that share a KV head.
struct HeadGroup<'a> {
    /// `[heads, head_dim]`.
    queries: &'a [f32],
    /// Column of the KV head in a cache row.
    offset: usize,
    /// Rows of the cache they see.
    visible: std::ops::Range<usize>,
    /// Each head's sink logit.
    sinks: Option<&'a [f32]>,
    scale: f32,
}

impl HeadGroup<'_> {
    /// Softmax-weighted sums of the visible values into `out`
    /// (`[heads, head_dim]`); plain loops, vectorised by
    /// [`Isa::vectorize`].
    #[inline(always)]
    fn attend(&self, cache: &KvCache, scores: &mut Vec<f32>, out: &mut [f32]) {
        let hd = cache.shape.head_dim;
        let heads = self.queries.len() / hd;
        let width = cache.shape.num_kv_heads * hd;
        let at = |j: usize| (self.visible.start + j) * width + self.offset;
        let n = self.visible.len();
        // scores[h * n + j]
        scores.clear();
        scores.resize(heads * n, 0.0);
        for j in 0..n {
            let key = &cache.keys[at(j)..][..hd];
            for (h, query) in self.queries.chunks_exact(hd).enumerate() {
                scores[h * n + j] = dot(query, key) * self.scale;
            }
        }
        let mut inv = vec![0f32; heads];
        for (h, row) in scores.chunks_exact_mut(n).enumerate() {
            let sink = self.sinks.map(|s| s[h]);
            let max = row
                .iter()
                .copied()
                .chain(sink)
                .fold(f32::NEG_INFINITY, f32::max);
            let mut total = sink.map_or(0.0, |s| (s - max).exp());
            for x in row.iter_mut() {
                *x = (*x - max).exp();
                total += *x;
            }
            inv[h] = 1.0 / total;
        }
        for j in 0..n {
            let value = &cache.values[at(j)..][..hd];
            for (h, out) in out.chunks_exact_mut(hd).enumerate() {
                let w = scores[h * n + j] * inv[h];
                for (o, &v) in out.iter_mut().zip(value) {
                    *o += w * v;
                }
            }
        }
    }
}

/// Rotates the first `rotary_dim` features of each `head_dim` group of
/// every row, row `t` at position `start_pos + t` (halves rotated against
/// each other, as transformers' `rotate_half`), with cos and sin scaled by
/// the rope's attention factor (YaRN).
pub fn rope(x: &mut [f32], cols: usize, rope: Rope, start_pos: usize) {
    let (head_dim, half) = (rope.head_dim, rope.rotary_dim / 2);
    // Frequencies in f32 like transformers' RotaryEmbedding.
    let inv_freq = rope.inv_frequencies();
    let scale = rope.attention_factor();
    x.par_chunks_mut(cols).enumerate().for_each(|(t, row)| {
        let pos = (start_pos + t) as f32;
        let (cos, sin): (Vec<f32>, Vec<f32>) = inv_freq
            .iter()
            .map(|&f| {
                let angle = pos * f;
                (angle.cos() * scale, angle.sin() * scale)
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
