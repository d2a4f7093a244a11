//! Routing and the routed experts on the CPU.
//!
//! Tokens of a chunk are grouped by expert, so each expert is fetched and
//! dequantized once per chunk however many tokens chose it. Experts are
//! fetched a few at a time, which bounds the memory in flight beyond the
//! cache's budget.

use std::borrow::Cow;
use std::sync::Arc;

use super::linear::{Activations, Product, matmul_many_with, matmul_pairs_with};
use super::pool;
use super::simd::Isa;
use crate::config::{ExpertActivation, ExpertGroups, RouterSpec, ScoreFunction};
use crate::error::Result;
use crate::experts::{Expert, ExpertStore, Fetch};

/// Each token's `top_k` experts (most probable first) and their weights.
pub struct Routing {
    pub top_k: usize,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

/// Each token's experts and weights as `spec` routes them, following
/// transformers' routers (Qwen3's softmax top-k, DeepSeek-V3's grouped
/// sigmoid with its correction bias, gpt-oss's softmax over the chosen).
/// `bias` is the per-expert correction bias when the spec uses one. A
/// prefill chunk's tokens are routed in parallel, `ROUTE_TOKENS` a task.
pub fn route(
    on_pool: bool,
    logits: &[f32],
    num_experts: usize,
    spec: &RouterSpec,
    bias: Option<&[f32]>,
) -> Routing {
    let top_k = spec.top_k;
    let mut chosen = vec![(0u32, 0f32); logits.len() / num_experts * top_k];
    pool::for_chunks_mut(on_pool, &mut chosen, ROUTE_TOKENS * top_k, |i, out| {
        let rows = logits[i * ROUTE_TOKENS * num_experts..].chunks_exact(num_experts);
        let mut scratch = RouteScratch::new(num_experts);
        for (row, out) in rows.zip(out.chunks_exact_mut(top_k)) {
            scratch.route(row, spec, bias, out);
        }
    });
    let (experts, weights) = chosen.into_iter().unzip();
    Routing {
        top_k,
        experts,
        weights,
    }
}

/// Tokens one routing task takes: each sorts every expert's score.
const ROUTE_TOKENS: usize = 16;

/// A routing task's working rows.
struct RouteScratch {
    scores: Vec<f32>,
    choice: Vec<f32>,
    order: Vec<u32>,
}

impl RouteScratch {
    fn new(num_experts: usize) -> RouteScratch {
        RouteScratch {
            scores: vec![0f32; num_experts],
            choice: vec![0f32; num_experts],
            order: Vec::with_capacity(num_experts),
        }
    }

    /// One token's `(expert, weight)` pairs, most probable first, into
    /// `out` (`top_k` long).
    fn route(
        &mut self,
        row: &[f32],
        spec: &RouterSpec,
        bias: Option<&[f32]>,
        out: &mut [(u32, f32)],
    ) {
        let RouteScratch {
            scores,
            choice,
            order,
        } = self;
        match spec.score {
            ScoreFunction::Softmax => {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let total: f32 = row.iter().map(|&x| (x - max).exp()).sum();
                for (s, &x) in scores.iter_mut().zip(row) {
                    *s = (x - max).exp() / total;
                }
            }
            ScoreFunction::Sigmoid => {
                for (s, &x) in scores.iter_mut().zip(row) {
                    *s = 1.0 / (1.0 + (-x).exp());
                }
            }
            // The choice is by logit; the weights are the softmax of the
            // chosen logits, below.
            ScoreFunction::SoftmaxOfChosen => scores.copy_from_slice(row),
        }
        choice.copy_from_slice(scores);
        if let Some(bias) = bias.filter(|_| spec.correction_bias) {
            choice.iter_mut().zip(bias).for_each(|(c, b)| *c += b);
        }
        if let Some(groups) = spec.groups {
            keep_best_groups(choice, groups);
        }
        order.clear();
        order.extend(0..scores.len() as u32);
        // Ties resolve to the lower index, like a stable descending sort.
        order.sort_by(|&a, &b| {
            choice[b as usize]
                .total_cmp(&choice[a as usize])
                .then(a.cmp(&b))
        });
        let chosen = &order[..out.len()];
        let mut picked: Vec<f32> = chosen.iter().map(|&e| scores[e as usize]).collect();
        if spec.score == ScoreFunction::SoftmaxOfChosen {
            let max = picked.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            picked.iter_mut().for_each(|p| *p = (*p - max).exp());
            let total: f32 = picked.iter().sum();
            picked.iter_mut().for_each(|p| *p /= total);
        }
        let mut scale = spec.scaling;
        if spec.renormalize {
            // transformers adds 1e-20 to sigmoid routers' sums.
            let guard = if spec.score == ScoreFunction::Sigmoid {
                1e-20
            } else {
                0.0
            };
            scale /= picked.iter().sum::<f32>() + guard;
        }
        for ((o, &e), p) in out.iter_mut().zip(chosen).zip(&picked) {
            *o = (e, p * scale);
        }
    }
}

/// Excludes every group but the `groups.keep` whose two best scores sum
/// highest (transformers 5's DeepSeek-V3 and GLM-4.5 routers: masked
/// scores become minus infinity, so a kept expert whose corrected score is
/// negative still wins over a dropped one).
fn keep_best_groups(choice: &mut [f32], groups: ExpertGroups) {
    let size = choice.len() / groups.count;
    let mut group_scores: Vec<(usize, f32)> = choice
        .chunks_exact(size)
        .map(|g| {
            let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &s in g {
                if s > first {
                    (first, second) = (s, first);
                } else if s > second {
                    second = s;
                }
            }
            if size < 2 { first } else { first + second }
        })
        .enumerate()
        .collect();
    group_scores.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    for &(g, _) in &group_scores[groups.keep..] {
        choice[g * size..(g + 1) * size].fill(f32::NEG_INFINITY);
    }
}

/// What the experts compute around their products: the activation and
/// the per-expert gate, up and down biases (`[experts, width]` each).
#[derive(Clone, Copy)]
pub struct Ffn<'a> {
    pub activation: ExpertActivation,
    pub biases: Option<[&'a [f32]; 3]>,
}

impl Ffn<'_> {
    /// The activation of one expert's gate and up rows (`inter` wide,
    /// biases added first), into `gate`.
    fn activate(&self, expert: usize, inter: usize, gate: &mut [f32], up: &[f32]) {
        for (g, u) in gate.chunks_exact_mut(inter).zip(up.chunks_exact(inter)) {
            self.activate_part(expert, inter, 0, g, u);
        }
    }

    /// [`Ffn::activate`] of one token's values `[first, first + gate.len())`.
    fn activate_part(
        &self,
        expert: usize,
        inter: usize,
        first: usize,
        gate: &mut [f32],
        up: &[f32],
    ) {
        match self.biases {
            Some([gate_bias, up_bias, _]) => {
                let gb = &gate_bias[expert * inter + first..][..gate.len()];
                let ub = &up_bias[expert * inter + first..][..gate.len()];
                for (((g, &u), &gb), &ub) in gate.iter_mut().zip(up).zip(gb).zip(ub) {
                    *g = activation(self.activation, *g + gb, u + ub);
                }
            }
            None => {
                for (g, &u) in gate.iter_mut().zip(up) {
                    *g = activation(self.activation, *g, u);
                }
            }
        }
    }

    /// Adds the expert's down bias to each of its output rows.
    fn add_down_bias(&self, expert: usize, out: &mut [f32], hidden: usize) {
        if let Some([_, _, down_bias]) = self.biases {
            let b = &down_bias[expert * hidden..][..hidden];
            for row in out.chunks_exact_mut(hidden) {
                row.iter_mut().zip(b).for_each(|(o, b)| *o += b);
            }
        }
    }
}

/// One value of an expert's activation from its gate and up values.
#[inline]
pub fn activation(kind: ExpertActivation, gate: f32, up: f32) -> f32 {
    match kind {
        ExpertActivation::SwiGlu => gate / (1.0 + (-gate).exp()) * up,
        ExpertActivation::ClampedSwiGlu { limit, alpha } => {
            let g = gate.min(limit);
            let u = up.clamp(-limit, limit);
            g / (1.0 + (-alpha * g).exp()) * (u + 1.0)
        }
    }
}

/// Experts fetched and computed together; the in-flight bound.
const EXPERTS_IN_FLIGHT: usize = 8;

/// Most experts already in memory computed together.
const READY_GROUP: usize = 32;

/// Experts' inputs of fewer values than this are gathered, and their
/// activations computed, on the calling thread.
const MIN_PARALLEL_VALUES: usize = 1 << 16;

/// expert -> [(token, weight)]
type Assigned = std::collections::BTreeMap<usize, Vec<(usize, f32)>>;

#[allow(clippy::too_many_arguments)]
pub fn routed_experts(
    isa: Isa,
    on_pool: bool,
    x: &[f32],
    hidden: usize,
    routing: &Routing,
    store: &ExpertStore,
    layer: usize,
    activations: Activations,
    ffn: Ffn<'_>,
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
    // time hides behind compute. Experts in memory wait for the next
    // batch's, up to `READY_GROUP`, so a prefill chunk whose experts are
    // all cached computes them in a few parallel regions, not a few per
    // batch.
    let mut ready: Vec<Arc<Expert>> = Vec::new();
    let mut next = batches.first().map(|b| store.request(layer, b));
    for i in 0..batches.len() {
        let current = next.take().expect("requested ahead");
        next = batches.get(i + 1).map(|b| store.request(layer, b));
        let (cached, reading): (Vec<Fetch>, Vec<Fetch>) =
            current.into_iter().partition(Fetch::is_ready);
        for fetch in cached {
            ready.push(store.wait(fetch)?);
        }
        let last = i + 1 == batches.len();
        if reading.is_empty() && !last && ready.len() + EXPERTS_IN_FLIGHT <= READY_GROUP {
            continue;
        }
        if n == 1 && reading.is_empty() {
            let weights: Vec<f32> = ready.iter().map(|e| assigned[&e.index][0].1).collect();
            one_token_experts(
                isa,
                on_pool,
                &ready,
                &weights,
                x,
                activations,
                ffn,
                &mut out,
            );
            ready.clear();
            continue;
        }
        let mut results = experts(isa, on_pool, &ready, x, hidden, &assigned, activations, ffn);
        ready.clear();
        for fetch in reading {
            let expert = store.wait(fetch)?;
            results.extend(experts(
                isa,
                on_pool,
                &[expert],
                x,
                hidden,
                &assigned,
                activations,
                ffn,
            ));
        }
        // Summed in ascending expert order whatever finished first (every
        // expert of earlier groups is below this group's), so the result
        // does not depend on read timing or grouping.
        results.sort_by_key(|(index, _)| *index);
        add_weighted(on_pool, &mut out, hidden, &results, &assigned);
    }
    Ok(out)
}

/// One token's `Σ weight · expert(x)` over `chosen` (experts and their
/// routing weights), summed in ascending expert order as
/// [`routed_experts`] sums: a GPU's decode step hands the CPU the experts
/// it holds in host memory while the GPU computes the others. The
/// machine's best kernels and every thread of the pool take them.
pub fn weighted_experts(
    x: &[f32],
    chosen: &[(Arc<Expert>, f32)],
    activations: Activations,
    ffn: Ffn<'_>,
) -> Vec<f32> {
    let (isa, on_pool) = (Isa::get(), crate::tuning::cpu_pool());
    let mut chosen: Vec<&(Arc<Expert>, f32)> = chosen.iter().collect();
    chosen.sort_by_key(|(e, _)| e.index);
    let (experts, weights): (Vec<Arc<Expert>>, Vec<f32>) =
        chosen.into_iter().map(|(e, w)| (e.clone(), *w)).unzip();
    let mut out = vec![0f32; x.len()];
    one_token_experts(
        isa,
        on_pool,
        &experts,
        &weights,
        x,
        activations,
        ffn,
        &mut out,
    );
    out
}

/// `out += Σ weights[k] · expert_k(x)` for one token, in the order of
/// `experts`: the gate and up products in one parallel region whose tasks
/// each activate the rows they computed (so no thread reads the others'
/// results for it), then the down products; the values are those of
/// [`experts`] and [`add_weighted`], bit for bit. (Down's tasks stay one
/// expert's rows each: tasks over all experts' rows, which could sum
/// them in place, read eight short runs of rows instead of one long run,
/// and ran slower.)
#[allow(clippy::too_many_arguments)]
fn one_token_experts(
    isa: Isa,
    on_pool: bool,
    experts: &[Arc<Expert>],
    weights: &[f32],
    x: &[f32],
    activations: Activations,
    ffn: Ffn<'_>,
    out: &mut [f32],
) {
    let product = |x, w| Product {
        x,
        n: 1,
        w,
        activations,
    };
    let pairs: Vec<[Product<'_>; 2]> = experts
        .iter()
        .map(|e| [product(x, e.gate()), product(x, e.up())])
        .collect();
    let act = matmul_pairs_with(isa, on_pool, &pairs, |k, first, gate, up| {
        let e = &experts[k];
        ffn.activate_part(e.index, e.gate().rows(), first, gate, up);
    });
    let down: Vec<Product<'_>> = experts
        .iter()
        .zip(&act)
        .map(|(e, act)| product(act, e.down()))
        .collect();
    let down = matmul_many_with(isa, on_pool, &down);
    let hidden = out.len();
    for ((e, mut y), w) in experts.iter().zip(down).zip(weights) {
        ffn.add_down_bias(e.index, &mut y, hidden);
        for (o, v) in out.iter_mut().zip(&y) {
            *o += w * v;
        }
    }
}

/// Adds each expert's rows, times their routing weights, to its tokens'
/// rows of `out`, in the order of `results`. Tasks own ranges of tokens,
/// so every token's sum keeps that order whichever thread computes it.
fn add_weighted(
    on_pool: bool,
    out: &mut [f32],
    hidden: usize,
    results: &[(usize, Vec<f32>)],
    assigned: &Assigned,
) {
    let tokens = pool::groups_per_task(hidden);
    pool::for_chunks_mut(on_pool, out, tokens * hidden, |i, rows| {
        let range = i * tokens..i * tokens + rows.len() / hidden;
        for (index, y) in results {
            let pairs = &assigned[index];
            // Each expert's tokens are in ascending order.
            let from = pairs.partition_point(|&(t, _)| t < range.start);
            for (&(t, w), row) in pairs[from..]
                .iter()
                .zip(y.chunks_exact(hidden).skip(from))
                .take_while(|((t, _), _)| range.contains(t))
            {
                let o = &mut rows[(t - range.start) * hidden..][..hidden];
                for (o, v) in o.iter_mut().zip(row) {
                    *o += w * v;
                }
            }
        }
    });
}

/// Each expert's `down(act(gate(x), up(x)))` for its tokens (biases added
/// where `ffn` has them), with its index. The gate and up products of all of them form one parallel
/// region, their down products another: two forks and joins for the lot
/// instead of three per expert, and tasks of equal work across the
/// experts, so both threads stream weights until the region's end. When
/// an expert takes every token (always, in decode) its input is `x`
/// itself, quantized once for all of them.
#[allow(clippy::too_many_arguments)]
fn experts(
    isa: Isa,
    on_pool: bool,
    experts: &[Arc<Expert>],
    x: &[f32],
    hidden: usize,
    assigned: &Assigned,
    activations: Activations,
    ffn: Ffn<'_>,
) -> Vec<(usize, Vec<f32>)> {
    let n = x.len() / hidden;
    // The gathering of inputs and the activations take a task per expert
    // when there are enough values to pay for a parallel region (a prefill
    // chunk's), else the calling thread does them (a decode step's).
    let tokens: usize = experts.iter().map(|e| assigned[&e.index].len()).sum();
    let per_task = if tokens * hidden >= MIN_PARALLEL_VALUES {
        1
    } else {
        experts.len()
    };
    let mut inputs: Vec<(Cow<'_, [f32]>, usize)> = experts
        .iter()
        .map(|_| (Cow::Borrowed(&[][..]), 0))
        .collect();
    pool::for_chunks_mut(on_pool, &mut inputs, per_task, |i, slots| {
        for (slot, e) in slots.iter_mut().zip(&experts[i * per_task..]) {
            let tokens = &assigned[&e.index];
            let every = tokens.len() == n && tokens.iter().enumerate().all(|(i, &(t, _))| i == t);
            let xs = if every {
                Cow::Borrowed(x)
            } else {
                let mut rows = Vec::with_capacity(tokens.len() * hidden);
                for &(t, _) in tokens {
                    rows.extend_from_slice(&x[t * hidden..(t + 1) * hidden]);
                }
                Cow::Owned(rows)
            };
            *slot = (xs, tokens.len());
        }
    });
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
    let mut gate_up = matmul_many_with(isa, on_pool, &gate_up);
    pool::for_chunks_mut(on_pool, &mut gate_up, 2 * per_task, |i, pairs| {
        for (pair, e) in pairs.chunks_exact_mut(2).zip(&experts[i * per_task..]) {
            let [gate, up] = pair else {
                unreachable!("gate and up")
            };
            ffn.activate(e.index, e.gate().rows(), gate, up);
        }
    });
    let act: Vec<Vec<f32>> = gate_up
        .chunks_exact_mut(2)
        .map(|pair| std::mem::take(&mut pair[0]))
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
    let mut down = matmul_many_with(isa, on_pool, &down);
    for (e, out) in experts.iter().zip(&mut down) {
        ffn.add_down_bias(e.index, out, hidden);
    }
    experts.iter().map(|e| e.index).zip(down).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sigmoid(x: f32) -> f32 {
        1.0 / (1.0 + (-x).exp())
    }

    #[test]
    fn softmax_router_picks_the_most_probable_and_renormalises() {
        let logits = [0.5f32, 2.0, -1.0, 1.0];
        let r = route(false, &logits, 4, &RouterSpec::softmax(2, true), None);
        assert_eq!(r.experts, [1, 3]);
        let (a, b) = (2.0f32.exp(), 1.0f32.exp());
        assert!((r.weights[0] - a / (a + b)).abs() < 1e-6);
        assert!((r.weights[1] - b / (a + b)).abs() < 1e-6);
        let raw = route(false, &logits, 4, &RouterSpec::softmax(2, false), None);
        let total: f32 = logits.iter().map(|x| x.exp()).sum();
        assert!((raw.weights[0] - a / total).abs() < 1e-6);
    }

    #[test]
    fn grouped_sigmoid_router_chooses_with_the_bias_and_weighs_without_it() {
        // Eight experts in four groups of two; a group's score is the sum
        // of its two choice scores.
        let logits = [3.0f32, -3.0, 1.0, 0.8, -2.0, -2.0, 0.5, 0.4];
        let bias = [0.0f32, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0];
        let spec = RouterSpec {
            top_k: 2,
            score: ScoreFunction::Sigmoid,
            groups: Some(ExpertGroups { count: 4, keep: 2 }),
            correction_bias: true,
            renormalize: true,
            scaling: 2.5,
        };
        let r = route(false, &logits, 8, &spec, Some(&bias));
        // Choice scores: group 0: s(3)+s(-3) = 1.0; group 1: s(1)+s(.8) ≈
        // 1.42; group 2 ≈ 0.24; group 3: s(.5)+2+s(.4) ≈ 3.22. Kept: 3 and
        // 1; best: 6 (with its bias), then 2.
        assert_eq!(r.experts, [6, 2]);
        let (w6, w2) = (sigmoid(0.5), sigmoid(1.0));
        let total = w6 + w2 + 1e-20;
        assert!((r.weights[0] - 2.5 * w6 / total).abs() < 1e-6);
        assert!((r.weights[1] - 2.5 * w2 / total).abs() < 1e-6);
        // Without the bias the choice is by score alone: groups 1 and 3
        // (1.42 and 1.22 against group 0's 1.0), so expert 0, the best
        // alone, is out: experts 2 and 3.
        let plain = RouterSpec {
            correction_bias: false,
            renormalize: false,
            scaling: 1.0,
            ..spec
        };
        let r = route(false, &logits, 8, &plain, Some(&bias));
        assert_eq!(r.experts, [2, 3]);
        assert!((r.weights[0] - sigmoid(1.0)).abs() < 1e-6);
        assert!((r.weights[1] - sigmoid(0.8)).abs() < 1e-6);
    }

    #[test]
    fn softmax_of_the_chosen_weighs_the_chosen_logits_only() {
        let logits = [1.0f32, 3.0, 2.0, 0.0, -1.0, 2.5];
        let spec = RouterSpec {
            score: ScoreFunction::SoftmaxOfChosen,
            ..RouterSpec::softmax(2, false)
        };
        let r = route(false, &logits, 6, &spec, None);
        assert_eq!(r.experts, [1, 5]);
        let (a, b) = (3.0f32.exp(), 2.5f32.exp());
        assert!((r.weights[0] - a / (a + b)).abs() < 1e-6);
        assert!((r.weights[1] - b / (a + b)).abs() < 1e-6);
    }
}
