//! Gated DeltaNet on the CPU: the token-by-token recurrence, parallel over
//! value heads (each head's state evolves independently).

use std::sync::Mutex;

use super::pool;
use super::simd::Isa;

use crate::config::LinearAttentionConfig;

/// A sequence's state for one linear-attention layer.
#[derive(Clone)]
pub struct DeltaNetState {
    /// The last `kernel - 1` inputs of the convolution, oldest first,
    /// `[kernel - 1, conv_dim]`.
    pub conv: Vec<f32>,
    /// Per value head, the `[key_head_dim, value_head_dim]` state matrix.
    pub recurrent: Vec<f32>,
    /// Keep the state after each token of the next run ([`Self::steps`]).
    pub track_next: bool,
    /// The states after each token of the last run, when it was tracked:
    /// what lets speculative decoding go back to any of them.
    pub steps: Option<Steps>,
}

/// The states within one run of `n` tokens.
#[derive(Clone)]
pub struct Steps {
    n: usize,
    conv_dim: usize,
    /// `dk · dv`, one head's state.
    head_size: usize,
    /// The convolution's inputs, the state's history first,
    /// `[kernel - 1 + n, conv_dim]`: the conv state after `t` tokens is
    /// rows `t..t + kernel - 1`.
    window: Vec<f32>,
    /// Per value head, its state after each token, `[heads, n, dk · dv]`.
    recurrent: Vec<f32>,
}

impl DeltaNetState {
    pub fn new(cfg: &LinearAttentionConfig) -> Self {
        DeltaNetState {
            conv: vec![0.0; (cfg.conv_kernel - 1) * cfg.conv_dim()],
            recurrent: vec![0.0; cfg.num_value_heads * cfg.key_head_dim * cfg.value_head_dim],
            track_next: false,
            steps: None,
        }
    }

    /// Back to the state after the first `keep` tokens of the last run;
    /// false (and nothing changed) unless that run was tracked and
    /// `1 ≤ keep ≤` its length.
    pub fn rewind(&mut self, keep: usize) -> bool {
        let Some(steps) = self.steps.take() else {
            return false;
        };
        if keep == 0 || keep > steps.n {
            return false;
        }
        let history = self.conv.len();
        self.conv
            .copy_from_slice(&steps.window[keep * steps.conv_dim..][..history]);
        let size = steps.head_size;
        for (h, state) in self.recurrent.chunks_exact_mut(size).enumerate() {
            state.copy_from_slice(&steps.recurrent[(h * steps.n + keep - 1) * size..][..size]);
        }
        true
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torch's softplus (beta 1, threshold 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// Scales `x` by `1 / sqrt(Σx² + 1e-6)`, the L2 norm of the FLA kernels.
fn l2_normalize(x: &mut [f32]) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Inputs of one run of tokens, all row-major with `n` rows.
pub struct Inputs<'a> {
    pub qkv: &'a [f32],
    pub b: &'a [f32],
    pub a: &'a [f32],
    /// `[conv_dim, kernel]`.
    pub conv_weight: &'a [f32],
    pub a_log: &'a [f32],
    pub dt_bias: &'a [f32],
}

/// A value head's output, recurrent state and trail.
type HeadParts<'a> = (&'a mut [f32], &'a mut [f32], &'a mut [f32]);

pub fn forward(
    isa: Isa,
    on_pool: bool,
    state: &mut DeltaNetState,
    inp: Inputs<'_>,
    n: usize,
    cfg: &LinearAttentionConfig,
) -> Vec<f32> {
    let conv_dim = cfg.conv_dim();
    let kernel = cfg.conv_kernel;
    let (dk, dv) = (cfg.key_head_dim, cfg.value_head_dim);
    let (nk, nv) = (cfg.num_key_heads, cfg.num_value_heads);
    let key_dim = cfg.key_dim();

    // Causal depthwise convolution + SiLU over [history | new inputs].
    let history = kernel - 1;
    let mut window = Vec::with_capacity((history + n) * conv_dim);
    window.extend_from_slice(&state.conv);
    window.extend_from_slice(&inp.qkv[..n * conv_dim]);
    let mut mixed = vec![0f32; n * conv_dim];
    pool::for_chunks_mut(on_pool, &mut mixed, conv_dim, |t, out| {
        for (c, o) in out.iter_mut().enumerate() {
            let w = &inp.conv_weight[c * kernel..(c + 1) * kernel];
            let acc: f32 = (0..kernel)
                .map(|i| w[i] * window[(t + i) * conv_dim + c])
                .sum();
            *o = silu(acc);
        }
    });
    let keep = window.len() - history * conv_dim;
    state.conv.copy_from_slice(&window[keep..]);
    let track = std::mem::take(&mut state.track_next);
    let mut trail = match track {
        true => vec![0f32; nv * n * dk * dv],
        false => Vec::new(),
    };

    // Normalised queries (also scaled by 1/sqrt(dk)) and keys.
    let q_scale = 1.0 / (dk as f32).sqrt();
    pool::for_chunks_mut(on_pool, &mut mixed, conv_dim, |_, row| {
        for head in row[..2 * key_dim].chunks_exact_mut(dk) {
            l2_normalize(head);
        }
        row[..key_dim].iter_mut().for_each(|v| *v *= q_scale);
    });

    // The recurrence, one value head per task.
    let value_dim = cfg.value_dim();
    let heads_per_key = nv / nk;
    let mut out_by_head = vec![0f32; nv * n * dv];
    // Each head's part of the trail (empty when not tracking).
    let trail_part = if track { n * dk * dv } else { 1 };
    let trail_parts: Vec<&mut [f32]> = match track {
        true => trail.chunks_mut(trail_part).collect(),
        false => (0..nv).map(|_| &mut [][..]).collect(),
    };
    // Each head's output, state and trail, taken by the thread that runs it.
    let heads: Vec<Mutex<HeadParts<'_>>> = out_by_head
        .chunks_mut(n * dv)
        .zip(state.recurrent.chunks_mut(dk * dv))
        .zip(trail_parts)
        .map(|((out, s), trail)| Mutex::new((out, s, trail)))
        .collect();
    pool::run(on_pool, heads.len(), |h| {
        let mut parts = heads[h].lock().unwrap_or_else(|e| e.into_inner());
        let (out, s, trail) = &mut *parts;
        let key = (h / heads_per_key) * dk;
        let head = Recurrence {
            mixed: &mixed,
            conv_dim,
            q: key,
            k: key_dim + key,
            v: 2 * key_dim + h * dv,
            dk,
            dv,
        };
        let decay_rate = -inp.a_log[h].exp();
        let gates: Vec<(f32, f32)> = (0..n)
            .map(|t| {
                let decay = (decay_rate * softplus(inp.a[t * nv + h] + inp.dt_bias[h])).exp();
                (decay, sigmoid(inp.b[t * nv + h]))
            })
            .collect();
        isa.vectorize(
            #[inline(always)]
            || head.run(s, &gates, out, trail),
        );
    });
    drop(heads);
    state.steps = track.then(|| Steps {
        n,
        conv_dim,
        head_size: dk * dv,
        window,
        recurrent: trail,
    });
    // [heads, n, dv] -> [n, heads·dv]
    let mut out = vec![0f32; n * value_dim];
    for h in 0..nv {
        for t in 0..n {
            out[t * value_dim + h * dv..][..dv]
                .copy_from_slice(&out_by_head[(h * n + t) * dv..][..dv]);
        }
    }
    out
}

/// The delta rule of one value head over a run of tokens.
struct Recurrence<'a> {
    /// Convolved inputs, `[n, conv_dim]`.
    mixed: &'a [f32],
    conv_dim: usize,
    /// Columns of this head's query, key and value in a row of `mixed`.
    q: usize,
    k: usize,
    v: usize,
    dk: usize,
    dv: usize,
}

impl Recurrence<'_> {
    /// Updates the state `s` (`[dk, dv]`) token by token with each token's
    /// (decay, beta) and writes the outputs (`[n, dv]`); plain loops over
    /// `dv`, vectorised by [`Isa::vectorize`].
    #[inline(always)]
    /// A non-empty `trail` (`[n, dk · dv]`) receives the state after each
    /// token.
    fn run(&self, s: &mut [f32], gates: &[(f32, f32)], out: &mut [f32], trail: &mut [f32]) {
        let (dk, dv) = (self.dk, self.dv);
        let mut kv_mem = vec![0f32; dv];
        for (t, &(decay, beta)) in gates.iter().enumerate() {
            let row = &self.mixed[t * self.conv_dim..(t + 1) * self.conv_dim];
            let (q, k, v) = (
                &row[self.q..][..dk],
                &row[self.k..][..dk],
                &row[self.v..][..dv],
            );
            s.iter_mut().for_each(|x| *x *= decay);
            kv_mem.fill(0.0);
            for (i, &ki) in k.iter().enumerate() {
                for (m, &sv) in kv_mem.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                    *m += sv * ki;
                }
            }
            for (m, &vj) in kv_mem.iter_mut().zip(v) {
                *m = (vj - *m) * beta; // now the delta
            }
            let o = &mut out[t * dv..(t + 1) * dv];
            o.fill(0.0);
            for i in 0..dk {
                let srow = &mut s[i * dv..(i + 1) * dv];
                for (sv, &d) in srow.iter_mut().zip(kv_mem.iter()) {
                    *sv += k[i] * d;
                }
                for (ov, &sv) in o.iter_mut().zip(srow.iter()) {
                    *ov += sv * q[i];
                }
            }
            if !trail.is_empty() {
                trail[t * dk * dv..][..dk * dv].copy_from_slice(s);
            }
        }
    }
}

/// RMSNorm over each `weight.len()` group, times weight, times silu(gate).
pub fn gated_rms_norm(
    on_pool: bool,
    x: &[f32],
    gate: &[f32],
    weight: &[f32],
    eps: f32,
) -> Vec<f32> {
    let g = weight.len();
    let mut out = vec![0f32; x.len()];
    let chunk = pool::groups_per_task(g) * g;
    pool::for_chunks_mut(on_pool, &mut out, chunk, |i, out| {
        let (x, gate) = (&x[i * chunk..], &gate[i * chunk..]);
        for ((o, x), z) in out.chunks_mut(g).zip(x.chunks(g)).zip(gate.chunks(g)) {
            let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() / g as f32 + eps).sqrt();
            for i in 0..g {
                o[i] = x[i] * inv * weight[i] * silu(z[i]);
            }
        }
    });
    out
}
