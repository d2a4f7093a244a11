//! Causal grouped-query attention over a growing KV cache, its keys and
//! values in any [`KvType`]: the loops read each cached row in its own
//! encoding (f32, bf16 bits, or q8 codes with their blocks' scales) and
//! compute in f32.

use std::cell::RefCell;

use rayon::prelude::*;

use super::pool;
use super::simd::{self, Isa, dot};
use crate::backend::kv::{KvRows, KvType, Q8_BLOCK, bf16_value};
use crate::backend::{AttentionShape, Rope};
use crate::config::MlaConfig;

/// Keys and values of the positions a sequence's next queries can see,
/// `[held, kv_heads·head_dim]`: every position so far, or a sliding
/// window's newest.
pub struct KvCache {
    pub shape: AttentionShape,
    /// The position of the first row held (positions before it were
    /// dropped by a sliding window).
    pub first: usize,
    pub keys: KvRows,
    pub values: KvRows,
}

impl KvCache {
    pub fn new(shape: AttentionShape, kv: KvType) -> Self {
        KvCache {
            shape,
            first: 0,
            keys: KvRows::new(kv),
            values: KvRows::new(kv),
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
            self.keys.drop_front(drop);
            self.values.drop_front(drop);
            self.first = len - keep;
        }
    }

    /// The rows of a latent cache (always f32).
    fn latent_rows(&mut self) -> &mut Vec<f32> {
        match &mut self.keys {
            KvRows::F32(rows) => rows,
            other => panic!("a latent cache holds f32 rows, not {}", other.kv_type()),
        }
    }
}

/// Appends `k`, `v` (`n` rows) and attends each of the `n` queries to every
/// cached position up to and including its own (within the window, if the
/// shape has one), with a sink logit per query head when `sinks` is given.
/// The new keys and values are stored first, so every query sees them as
/// the cache holds them.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    isa: Isa,
    on_pool: bool,
    cache: &mut KvCache,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    sinks: Option<&[f32]>,
) -> Vec<f32> {
    let s = cache.shape;
    let start = cache.len();
    cache.keys.push(k);
    cache.values.push(v);
    let (hd, q_width) = (s.head_dim, s.num_heads * s.head_dim);
    let group = s.num_heads / s.num_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; n * q_width];
    let held = &*cache;
    // One task per (position, KV head): the query heads that share a KV
    // head read each cached key and value once between them. Each head's
    // arithmetic is the same as attending it alone.
    let task = |scores: &mut Vec<f32>, i: usize, out: &mut [f32]| {
        let (t, kv_head) = (i / s.num_kv_heads, i % s.num_kv_heads);
        let position = start + t;
        let oldest = match s.window {
            Some(w) => (position + 1).saturating_sub(w).max(held.first),
            None => held.first,
        };
        let heads = HeadGroup {
            isa,
            queries: &q[t * q_width + kv_head * group * hd..][..group * hd],
            offset: kv_head * hd,
            visible: oldest - held.first..position + 1 - held.first,
            sinks: sinks.map(|s| &s[kv_head * group..(kv_head + 1) * group]),
            scale,
            head_dim: hd,
            width: s.num_kv_heads * hd,
        };
        isa.vectorize(
            #[inline(always)]
            || match (&held.keys, &held.values) {
                (KvRows::F32(k), KvRows::F32(v)) => {
                    heads.attend(k.as_slice(), v.as_slice(), scores, out)
                }
                (KvRows::Bf16(k), KvRows::Bf16(v)) => {
                    heads.attend(&Bf16Rows(k), &Bf16Rows(v), scores, out)
                }
                (
                    KvRows::Q8 { codes, scales },
                    KvRows::Q8 {
                        codes: v_codes,
                        scales: v_scales,
                    },
                ) => heads.attend(
                    &Q8Rows { codes, scales },
                    &Q8Rows {
                        codes: v_codes,
                        scales: v_scales,
                    },
                    scores,
                    out,
                ),
                _ => unreachable!("a cache's keys and values share its type"),
            },
        );
    };
    match on_pool {
        true => pool::for_chunks_mut(true, &mut out, group * hd, |i, out| {
            SCORES.with_borrow_mut(|scores| task(scores, i, out))
        }),
        false => out
            .par_chunks_mut(group * hd)
            .enumerate()
            .for_each_init(Vec::new, |scores: &mut Vec<f32>, (i, out)| {
                task(scores, i, out)
            }),
    }
    cache.drop_outside_window();
    out
}

/// A cache's keys or values, a head row at a time in f32: `at` is the
/// index of the row's first value (a multiple of [`Q8_BLOCK`] for q8).
trait Rows {
    /// The `scratch.len()` values at `at`: borrowed where the cache holds
    /// f32, else decoded into `scratch` (once per position, whatever the
    /// number of query heads that read it).
    fn row<'a>(&'a self, at: usize, scratch: &'a mut [f32]) -> &'a [f32];
}

impl Rows for [f32] {
    #[inline(always)]
    fn row<'a>(&'a self, at: usize, scratch: &'a mut [f32]) -> &'a [f32] {
        &self[at..][..scratch.len()]
    }
}

/// bf16 bits.
struct Bf16Rows<'a>(&'a [u16]);

impl Rows for Bf16Rows<'_> {
    #[inline(always)]
    fn row<'a>(&'a self, at: usize, scratch: &'a mut [f32]) -> &'a [f32] {
        let len = scratch.len();
        for (x, &bits) in scratch.iter_mut().zip(&self.0[at..][..len]) {
            *x = bf16_value(bits);
        }
        scratch
    }
}

/// q8 codes and a scale per [`Q8_BLOCK`] of them: each value its code
/// times its block's scale.
struct Q8Rows<'a> {
    codes: &'a [i8],
    scales: &'a [f32],
}

impl Rows for Q8Rows<'_> {
    #[inline(always)]
    fn row<'a>(&'a self, at: usize, scratch: &'a mut [f32]) -> &'a [f32] {
        let len = scratch.len();
        let codes = self.codes[at..][..len].chunks_exact(Q8_BLOCK);
        let scales = &self.scales[at / Q8_BLOCK..];
        for ((x, codes), &scale) in scratch.chunks_exact_mut(Q8_BLOCK).zip(codes).zip(scales) {
            for (x, &c) in x.iter_mut().zip(codes) {
                *x = c as f32 * scale;
            }
        }
        scratch
    }
}

thread_local! {
    /// A thread's scores for [`attend`]'s tasks on moeflux's workers,
    /// kept between regions so a decode step allocates none.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Keys whose scores [`HeadGroup::attend`] computes together.
const KEYS: usize = 8;

/// The query heads of one position that share a KV head.
struct HeadGroup<'a> {
    /// Whose `dots8` the scores take.
    isa: Isa,
    /// `[heads, head_dim]`.
    queries: &'a [f32],
    /// Column of the KV head in a cache row.
    offset: usize,
    /// Rows of the cache they see.
    visible: std::ops::Range<usize>,
    /// Each head's sink logit.
    sinks: Option<&'a [f32]>,
    scale: f32,
    head_dim: usize,
    /// Values of a cache row.
    width: usize,
}

impl HeadGroup<'_> {
    /// Softmax-weighted sums of the visible values into `out`
    /// (`[heads, head_dim]`); plain loops, vectorised by
    /// [`Isa::vectorize`].
    #[inline(always)]
    fn attend<K: Rows + ?Sized, V: Rows + ?Sized>(
        &self,
        keys: &K,
        values: &V,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let hd = self.head_dim;
        let heads = self.queries.len() / hd;
        let at = |j: usize| (self.visible.start + j) * self.width + self.offset;
        let n = self.visible.len();
        // Decoded rows of keys, then of values (borrowed in place for f32).
        let mut decoded = vec![0f32; KEYS.max(VALUES) * hd];
        // scores[h * n + j], KEYS keys at a time (each score as `dot`
        // gives it alone).
        scores.clear();
        scores.resize(heads * n, 0.0);
        let blocks = n / KEYS;
        for b in 0..blocks {
            let mut scratch = decoded.chunks_exact_mut(hd);
            let block: [&[f32]; KEYS] = std::array::from_fn(|k| {
                let scratch = scratch.next().expect("a row of scratch per key");
                keys.row(at(b * KEYS + k), scratch)
            });
            for (h, query) in self.queries.chunks_exact(hd).enumerate() {
                let products = self.isa.dots8(query, block);
                let row = &mut scores[h * n + b * KEYS..][..KEYS];
                for (score, product) in row.iter_mut().zip(products) {
                    *score = product * self.scale;
                }
            }
        }
        for j in blocks * KEYS..n {
            let key = keys.row(at(j), &mut decoded[..hd]);
            for (h, query) in self.queries.chunks_exact(hd).enumerate() {
                scores[h * n + j] = dot(query, key) * self.scale;
            }
        }
        // Each score becomes its softmax weight.
        for (h, row) in scores.chunks_exact_mut(n).enumerate() {
            let sink = self.sinks.map(|s| s[h]);
            let max = simd::max(row).max(sink.unwrap_or(f32::NEG_INFINITY));
            let total = simd::exp_sum(row, max) + sink.map_or(0.0, |s| simd::exp(s - max));
            let inv = 1.0 / total;
            row.iter_mut().for_each(|x| *x *= inv);
        }
        // The weighted sums, `VALUES` positions at a time: their rows
        // (decoded once) are read by every head.
        for first in (0..n).step_by(VALUES) {
            let count = VALUES.min(n - first);
            let mut scratch = decoded.chunks_exact_mut(hd);
            let block: [&[f32]; VALUES] = std::array::from_fn(|k| match scratch.next() {
                Some(scratch) if k < count => values.row(at(first + k), scratch),
                _ => &[],
            });
            let block = &block[..count];
            let weights = |h: usize| &scores[h * n + first..][..count];
            let mut pairs = out.chunks_exact_mut(2 * hd);
            for (p, pair) in pairs.by_ref().enumerate() {
                let (a, b) = pair.split_at_mut(hd);
                weighted_sums([weights(2 * p), weights(2 * p + 1)], block, [a, b]);
            }
            let last = pairs.into_remainder();
            if !last.is_empty() {
                weighted_sums([weights(heads - 1)], block, [last]);
            }
        }
    }
}

/// `outs[h] += Σ_j weights[h][j] · values[j]` for `H` heads, each sum's
/// terms added in position order (as one position at a time would); each
/// head's sums of `SUM_COLS` columns stay in registers across the
/// positions, `H` heads' of them at once so the additions of one position
/// do not wait on each other.
#[inline(always)]
fn weighted_sums<const H: usize>(weights: [&[f32]; H], values: &[&[f32]], outs: [&mut [f32]; H]) {
    let width = outs[0].len();
    let whole = width / SUM_COLS * SUM_COLS;
    for c in (0..whole).step_by(SUM_COLS) {
        let mut sums: [[f32; SUM_COLS]; H] = std::array::from_fn(|h| {
            outs[h][c..c + SUM_COLS]
                .try_into()
                .expect("SUM_COLS columns")
        });
        for (j, value) in values.iter().enumerate() {
            let value: &[f32; SUM_COLS] =
                value[c..c + SUM_COLS].try_into().expect("SUM_COLS columns");
            for h in 0..H {
                let w = weights[h][j];
                for i in 0..SUM_COLS {
                    sums[h][i] += w * value[i];
                }
            }
        }
        for h in 0..H {
            outs[h][c..c + SUM_COLS].copy_from_slice(&sums[h]);
        }
    }
    for (j, value) in values.iter().enumerate() {
        for h in 0..H {
            let w = weights[h][j];
            for (o, &v) in outs[h][whole..].iter_mut().zip(&value[whole..]) {
                *o += w * v;
            }
        }
    }
}

/// Positions whose values [`HeadGroup::attend`] sums together.
const VALUES: usize = 16;

/// Columns of a head's output summed in registers (heads of other widths
/// sum the rest a column at a time).
const SUM_COLS: usize = 64;

/// [`crate::backend::Backend::mla_attention`] on the CPU: appends `n` rows
/// of `[latent | k_rot]` to the cache (one KV head of the latent width, no
/// values) and attends each query row's heads over it, `kv_b` dequantized
/// (`[heads·(nope + v), kv_lora]`).
#[allow(clippy::too_many_arguments)]
pub fn attend_latent(
    on_pool: bool,
    cache: &mut KvCache,
    q: &[f32],
    latent: &[f32],
    k_rot: &[f32],
    kv_b: &[f32],
    mla: &MlaConfig,
    heads: usize,
) -> Vec<f32> {
    let (lora, rope, nope, v) = (
        mla.kv_lora_rank,
        mla.qk_rope_head_dim,
        mla.qk_nope_head_dim,
        mla.v_head_dim,
    );
    let (width, qk) = (lora + rope, rope + nope);
    assert_eq!(
        cache.shape.head_dim * cache.shape.num_kv_heads,
        width,
        "latent cache width"
    );
    let n = latent.len() / lora;
    let start = cache.len();
    let cached = cache.latent_rows();
    for t in 0..n {
        cached.extend_from_slice(&latent[t * lora..][..lora]);
        cached.extend_from_slice(&k_rot[t * rope..][..rope]);
    }
    let cached = &*cached;
    let mut out = vec![0f32; n * heads * v];
    pool::for_chunks_mut(on_pool, &mut out, v, |i, out| {
        let (t, h) = (i / heads, i % heads);
        let query = &q[(t * heads + h) * qk..][..qk];
        let (q_rot, q_nope) = query.split_at(rope);
        let rows = &kv_b[h * (nope + v) * lora..][..(nope + v) * lora];
        let (w_k, w_v) = rows.split_at(nope * lora);
        // The query's non-rotary part in the latent space.
        let mut q_latent = vec![0f32; lora];
        for (&qi, w) in q_nope.iter().zip(w_k.chunks_exact(lora)) {
            q_latent.iter_mut().zip(w).for_each(|(a, &w)| *a += qi * w);
        }
        let visible = start + t + 1;
        let mut scores: Vec<f32> = (0..visible)
            .map(|j| {
                let row = &cached[j * width..][..width];
                let s: f32 = q_latent
                    .iter()
                    .zip(&row[..lora])
                    .map(|(a, b)| a * b)
                    .sum::<f32>()
                    + q_rot
                        .iter()
                        .zip(&row[lora..])
                        .map(|(a, b)| a * b)
                        .sum::<f32>();
                s * mla.softmax_scale
            })
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            total += *s;
        }
        let mut o_latent = vec![0f32; lora];
        for (j, &s) in scores.iter().enumerate() {
            let w = s / total;
            let row = &cached[j * width..][..lora];
            o_latent.iter_mut().zip(row).for_each(|(o, &c)| *o += w * c);
        }
        for (o, w) in out.iter_mut().zip(w_v.chunks_exact(lora)) {
            *o = w.iter().zip(&o_latent).map(|(a, b)| a * b).sum();
        }
    });
    out
}

/// Rotates the first `rotary_dim` features of each `head_dim` group of
/// every row, row `t` at position `start_pos + t` (halves rotated against
/// each other, as transformers' `rotate_half`), with cos and sin scaled by
/// the rope's attention factor (YaRN).
pub fn rope(on_pool: bool, x: &mut [f32], cols: usize, rope: Rope, start_pos: usize) {
    let (head_dim, half) = (rope.head_dim, rope.rotary_dim / 2);
    // Frequencies in f32 like transformers' RotaryEmbedding.
    let inv_freq = rope.inv_frequencies();
    let scale = rope.attention_factor();
    pool::for_chunks_mut(on_pool, x, cols, |t, row| {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::util::SplitMix64(seed);
        (0..n)
            .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            .collect()
    }

    /// The absorbed form equals attention over keys and values expanded
    /// from the latent by `kv_b`, over a cache grown in two steps.
    #[test]
    fn latent_attention_equals_expanded_attention() {
        let mla = MlaConfig {
            q_lora_rank: None,
            kv_lora_rank: 8,
            qk_nope_head_dim: 6,
            qk_rope_head_dim: 4,
            v_head_dim: 5,
            rope_interleave: true,
            softmax_scale: 0.37,
        };
        let (heads, lora, rope, nope, v) = (3, 8, 4, 6, 5);
        let qk = rope + nope;
        let kv_b = values(heads * (nope + v) * lora, 1);
        let mut cache = KvCache::new(
            AttentionShape {
                num_heads: heads,
                num_kv_heads: 1,
                head_dim: lora + rope,
                window: None,
                latent: true,
            },
            KvType::F32,
        );
        let (mut latents, mut k_rots) = (Vec::new(), Vec::new());
        for (step, n) in [(0u64, 3usize), (1, 2)] {
            let q = values(n * heads * qk, 10 + step);
            let latent = values(n * lora, 20 + step);
            let k_rot = values(n * rope, 30 + step);
            let start = latents.len() / lora;
            latents.extend_from_slice(&latent);
            k_rots.extend_from_slice(&k_rot);
            let got = attend_latent(true, &mut cache, &q, &latent, &k_rot, &kv_b, &mla, heads);
            for t in 0..n {
                for h in 0..heads {
                    let query = &q[(t * heads + h) * qk..][..qk];
                    let w = &kv_b[h * (nope + v) * lora..][..(nope + v) * lora];
                    let project = |rows: &[f32], c: &[f32]| -> Vec<f32> {
                        rows.chunks_exact(lora)
                            .map(|r| r.iter().zip(c).map(|(a, b)| a * b).sum())
                            .collect()
                    };
                    let visible = start + t + 1;
                    let scores: Vec<f32> = (0..visible)
                        .map(|j| {
                            let c = &latents[j * lora..][..lora];
                            let mut key = k_rots[j * rope..][..rope].to_vec();
                            key.extend(project(&w[..nope * lora], c));
                            query.iter().zip(&key).map(|(a, b)| a * b).sum::<f32>()
                                * mla.softmax_scale
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                    let total: f32 = e.iter().sum();
                    let mut want = vec![0f32; v];
                    for (j, p) in e.iter().enumerate() {
                        let value = project(&w[nope * lora..], &latents[j * lora..][..lora]);
                        want.iter_mut()
                            .zip(value)
                            .for_each(|(o, x)| *o += p / total * x);
                    }
                    let out = &got[(t * heads + h) * v..][..v];
                    for (g, w) in out.iter().zip(&want) {
                        assert!(
                            (g - w).abs() < 1e-5,
                            "step {step} token {t} head {h}: {g} against {w}"
                        );
                    }
                }
            }
        }
        assert_eq!(cache.len(), 5);
        assert_eq!(
            cache.keys.len(),
            5 * (lora + rope),
            "only the latent and rotary key are cached"
        );
        assert!(cache.values.is_empty());
    }
}
