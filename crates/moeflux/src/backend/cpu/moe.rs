//! Routing and the routed experts on the CPU.
//!
//! Tokens of a chunk are grouped by expert, so each expert is fetched and
//! dequantized once per chunk however many tokens chose it. Experts are
//! fetched a few at a time, which bounds the memory in flight beyond the
//! cache's budget.

use std::borrow::Cow;
use std::sync::Arc;

use super::linear::{Activations, Product, matmul_many};
use crate::error::Result;
use crate::experts::{Expert, ExpertStore, Fetch};

/// Each token's `top_k` experts (most probable first) and their weights.
pub struct Routing {
    pub top_k: usize,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

/// Softmax, top-k and optional renormalisation, as transformers' Qwen
/// routers compute them.
pub fn route(logits: &[f32], num_experts: usize, top_k: usize, normalize: bool) -> Routing {
    let n = logits.len() / num_experts;
    let mut experts = Vec::with_capacity(n * top_k);
    let mut weights = Vec::with_capacity(n * top_k);
    let mut order: Vec<u32> = Vec::with_capacity(num_experts);
    for row in logits.chunks_exact(num_experts) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let total: f32 = row.iter().map(|&x| (x - max).exp()).sum();
        order.clear();
        order.extend(0..num_experts as u32);
        // Ties resolve to the lower index, like a stable descending sort.
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        let chosen = &order[..top_k];
        let probs: Vec<f32> = chosen
            .iter()
            .map(|&e| (row[e as usize] - max).exp() / total)
            .collect();
        let scale = if normalize {
            1.0 / probs.iter().sum::<f32>()
        } else {
            1.0
        };
        experts.extend_from_slice(chosen);
        weights.extend(probs.iter().map(|p| p * scale));
    }
    Routing {
        top_k,
        experts,
        weights,
    }
}

/// Experts fetched and computed together; the in-flight bound.
const EXPERTS_IN_FLIGHT: usize = 8;

/// expert -> [(token, weight)]
type Assigned = std::collections::BTreeMap<usize, Vec<(usize, f32)>>;

pub fn routed_experts(
    x: &[f32],
    hidden: usize,
    routing: &Routing,
    store: &ExpertStore,
    layer: usize,
    activations: Activations,
) -> Result<Vec<f32>> {
    let n = x.len() / hidden;
    let mut assigned = Assigned::new();
    for t in 0..n {
        for j in 0..routing.top_k {
            let i = t * routing.top_k + j;
            assigned
                .entry(routing.experts[i] as usize)
                .or_default()
                .push((t, routing.weights[i]));
        }
    }
    let order: Vec<usize> = assigned.keys().copied().collect();
    let batches: Vec<&[usize]> = order.chunks(EXPERTS_IN_FLIGHT).collect();
    let mut out = vec![0f32; n * hidden];
    // The next batch's reads start before this batch computes, and within
    // a batch the experts already in memory compute (together) while the
    // others are read, which then compute as their reads complete: disk
    // time hides behind compute.
    let mut next = batches.first().map(|b| store.request(layer, b));
    for i in 0..batches.len() {
        let current = next.take().expect("requested ahead");
        next = batches.get(i + 1).map(|b| store.request(layer, b));
        let (ready, reading): (Vec<Fetch>, Vec<Fetch>) =
            current.into_iter().partition(Fetch::is_ready);
        let ready: Vec<Arc<Expert>> = ready
            .into_iter()
            .map(|f| store.wait(f))
            .collect::<Result<_>>()?;
        let mut results = experts(&ready, x, hidden, &assigned, activations);
        for fetch in reading {
            let expert = store.wait(fetch)?;
            results.extend(experts(&[expert], x, hidden, &assigned, activations));
        }
        // Summed in ascending expert order whatever finished first, so the
        // result does not depend on read timing.
        results.sort_by_key(|(index, _)| *index);
        for (index, y) in results {
            for (&(t, w), row) in assigned[&index].iter().zip(y.chunks_exact(hidden)) {
                for (o, v) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(row) {
                    *o += w * v;
                }
            }
        }
    }
    Ok(out)
}

/// Each expert's `down(silu(gate(x)) * up(x))` for its tokens, with its
/// index. The gate and up products of all of them form one parallel
/// region, their down products another: two forks and joins for the lot
/// instead of three per expert, and tasks of equal work across the
/// experts, so both threads stream weights until the region's end. When
/// an expert takes every token (always, in decode) its input is `x`
/// itself, quantized once for all of them.
fn experts(
    experts: &[Arc<Expert>],
    x: &[f32],
    hidden: usize,
    assigned: &Assigned,
    activations: Activations,
) -> Vec<(usize, Vec<f32>)> {
    let n = x.len() / hidden;
    let inputs: Vec<(Cow<'_, [f32]>, usize)> = experts
        .iter()
        .map(|e| {
            let tokens = &assigned[&e.index];
            let every = tokens.len() == n && tokens.iter().enumerate().all(|(i, &(t, _))| i == t);
            let xs = if every {
                Cow::Borrowed(x)
            } else {
                tokens
                    .iter()
                    .flat_map(|&(t, _)| &x[t * hidden..(t + 1) * hidden])
                    .copied()
                    .collect()
            };
            (xs, tokens.len())
        })
        .collect();
    let gate_up: Vec<Product<'_>> = experts
        .iter()
        .zip(&inputs)
        .flat_map(|(e, (xs, m))| {
            [e.gate(), e.up()].map(|w| Product {
                x: xs,
                n: *m,
                w,
                activations,
            })
        })
        .collect();
    let gate_up = matmul_many(&gate_up);
    let act: Vec<Vec<f32>> = gate_up
        .chunks_exact(2)
        .map(|pair| {
            let (gate, up) = (&pair[0], &pair[1]);
            gate.iter()
                .zip(up)
                .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
                .collect()
        })
        .collect();
    let down: Vec<Product<'_>> = experts
        .iter()
        .zip(&act)
        .zip(&inputs)
        .map(|((e, act), (_, m))| Product {
            x: act,
            n: *m,
            w: e.down(),
            activations,
        })
        .collect();
    let down = matmul_many(&down);
    experts.iter().map(|e| e.index).zip(down).collect()
}
