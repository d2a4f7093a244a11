//! Conformance of the operations DeepSeek-V3, Kimi K2 and GLM-4.5 brought:
//! multi-head latent attention over a latent cache, and routers other than
//! the plain softmax (the grouped sigmoid router with its correction bias,
//! gpt-oss's softmax over the chosen). Each backend is compared with the
//! reference (as in [`super::ops`]), and the reference itself with a
//! direct computation of transformers' formulas, so that an error the
//! backends share is caught too.
//!
//! Bounds: latent attention 1e-5 of the output's scale against the
//! reference and against the f64 computation of the expanded form (f32
//! rounding in another order through three products: the absorbed query,
//! the attention, the value rows); the exported latent rows exactly. Routers:
//! the experts chosen exactly, their weights 1e-6 of the largest (of the
//! scaling against the f64 computation).

use moeflux::backend::cpu::KvCache as CpuKv;
use moeflux::backend::{AttentionShape, Backend, KvType};
use moeflux::config::{ExpertGroups, MlaConfig, RouterSpec, ScoreFunction};
use moeflux::quant::DType;

use super::ops::{
    Activations, Conformance, TestWeights, assert_close, both, host, reference, values,
};

/// A latent geometry: heads, kv_lora_rank, qk_rope_head_dim,
/// qk_nope_head_dim, v_head_dim, and how kv_b is stored.
struct Geometry {
    heads: usize,
    lora: usize,
    rope: usize,
    nope: usize,
    v: usize,
    dtype: DType,
}

/// Multi-head latent attention in f64 in its expanded form, as
/// transformers computes it: position j's key for head h is `[k_rot_j |
/// W_k(h) · c_j]` and its value `W_v(h) · c_j` (`kv_b` rows dequantized,
/// per head its key rows then its value rows); the `n` query rows sit at
/// the last positions, each head's rotary part first.
fn direct_latent_attention(
    g: &Geometry,
    mla: &MlaConfig,
    q: &[f32],
    latents: &[f32],
    k_rots: &[f32],
    kv_b: &[f32],
) -> Vec<f32> {
    let (lora, rope, nope, v) = (g.lora, g.rope, g.nope, g.v);
    let qk = rope + nope;
    let len = latents.len() / lora;
    let n = q.len() / (g.heads * qk);
    let project = |row: usize, c: &[f32]| -> f64 {
        kv_b[row * lora..][..lora]
            .iter()
            .zip(c)
            .map(|(&w, &x)| w as f64 * x as f64)
            .sum()
    };
    let mut out = vec![0f32; n * g.heads * v];
    for h in 0..g.heads {
        let base = h * (nope + v);
        // Every position's expanded key and value for this head.
        let keys: Vec<Vec<f64>> = (0..len)
            .map(|j| {
                let c = &latents[j * lora..][..lora];
                let rotary = k_rots[j * rope..][..rope].iter().map(|&x| x as f64);
                rotary
                    .chain((0..nope).map(|i| project(base + i, c)))
                    .collect()
            })
            .collect();
        let vals: Vec<Vec<f64>> = (0..len)
            .map(|j| {
                let c = &latents[j * lora..][..lora];
                (0..v).map(|i| project(base + nope + i, c)).collect()
            })
            .collect();
        for t in 0..n {
            let position = len - n + t;
            let query = &q[(t * g.heads + h) * qk..][..qk];
            let scores: Vec<f64> = keys[..=position]
                .iter()
                .map(|k| {
                    query.iter().zip(k).map(|(&a, b)| a as f64 * b).sum::<f64>()
                        * mla.softmax_scale as f64
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = e.iter().sum();
            for (i, o) in out[(t * g.heads + h) * v..][..v].iter_mut().enumerate() {
                *o = (e.iter().zip(&vals).map(|(p, x)| p * x[i]).sum::<f64>() / total) as f32;
            }
        }
    }
    out
}

/// Multi-head latent attention ([`Backend::mla_attention`]) against the
/// reference over prefill chunks and decode tokens of awkward sizes
/// (fewer heads than a tile of rows, partial tiles, a decode step after
/// 1500 positions split over many blocks), latent rows as wide as
/// DeepSeek-V3's (512 + 64), `kv_b` stored in every type; the latent rows
/// exported exactly, then truncation and import. The reference is checked
/// against the expanded form in f64 while the context is short.
pub fn mla_attention<B: Conformance>(b: &B, _: Activations) {
    let r = reference();
    let geometries = [
        (
            Geometry {
                heads: 5,
                lora: 64,
                rope: 16,
                nope: 24,
                v: 20,
                dtype: DType::F32,
            },
            1500,
        ),
        (
            Geometry {
                heads: 20,
                lora: 128,
                rope: 12,
                nope: 16,
                v: 40,
                dtype: DType::Q4,
            },
            300,
        ),
        (
            Geometry {
                heads: 3,
                lora: 512,
                rope: 64,
                nope: 32,
                v: 16,
                dtype: DType::Bf16,
            },
            300,
        ),
        (
            Geometry {
                heads: 17,
                lora: 64,
                rope: 16,
                nope: 8,
                v: 8,
                dtype: DType::Q8,
            },
            40,
        ),
    ];
    for (g, long) in geometries {
        let what = format!(
            "mla_attention {} heads, latent {} + {}, nope {}, v {}, kv_b {}",
            g.heads,
            g.lora,
            g.rope,
            g.nope,
            g.v,
            g.dtype.name()
        );
        let (lora, rope, qk) = (g.lora, g.rope, g.rope + g.nope);
        let mla = MlaConfig {
            q_lora_rank: None,
            kv_lora_rank: lora,
            qk_nope_head_dim: g.nope,
            qk_rope_head_dim: rope,
            v_head_dim: g.v,
            rope_interleave: true,
            softmax_scale: 0.9 / (qk as f32).sqrt(),
        };
        let kv_b_rows = g.heads * (g.nope + g.v);
        let kv_b_data = values(kv_b_rows * lora, lora as u64 + g.heads as u64);
        let weights = TestWeights::new(&[("test.kv_b", g.dtype, vec![kv_b_rows, lora], kv_b_data)]);
        let kv_b_r = weights.load(&r, "test.kv_b", &[kv_b_rows, lora]);
        let kv_b_b = weights.load(b, "test.kv_b", &[kv_b_rows, lora]);
        let view = weights.dir.tensor("test.kv_b", &[kv_b_rows, lora]).unwrap();
        let mut kv_b = vec![0f32; kv_b_rows * lora];
        for (i, row) in kv_b.chunks_exact_mut(lora).enumerate() {
            view.view().dequantize_row(i, row);
        }
        let shape = AttentionShape {
            num_heads: g.heads,
            num_kv_heads: 1,
            head_dim: lora + rope,
            window: None,
            latent: true,
        };
        let mut cache_r = r.new_kv_cache(shape, KvType::F32).unwrap();
        let mut cache_b = b.new_kv_cache(shape, KvType::F32).unwrap();
        // Every position's latent and rotary key so far, for the direct
        // computation.
        let (mut latents, mut k_rots) = (Vec::new(), Vec::new());
        let mut step = |n: usize, seed: u64, cache_r: &mut CpuKv, cache_b: &mut B::KvCache| {
            let (q_r, q_b) = both(b, n, g.heads * qk, values(n * g.heads * qk, seed));
            let latent = values(n * lora, seed + 1);
            let k_rot = values(n * rope, seed + 2);
            let (c_r, c_b) = both(b, n, lora, latent.clone());
            let (k_r, k_b) = both(b, n, rope, k_rot.clone());
            latents.truncate(r.kv_len(cache_r) * lora);
            k_rots.truncate(r.kv_len(cache_r) * rope);
            latents.extend_from_slice(&latent);
            k_rots.extend_from_slice(&k_rot);
            let want = r
                .mla_attention(cache_r, &q_r, &c_r, &k_r, &kv_b_r, &mla, g.heads)
                .unwrap()
                .data;
            let got = host(
                b,
                &b.mla_attention(cache_b, &q_b, &c_b, &k_b, &kv_b_b, &mla, g.heads)
                    .unwrap(),
            );
            let at = format!("{what}: chunk of {n} at {}", r.kv_len(cache_r) - n);
            assert_close(&at, &got, &want, 1e-5);
            if latents.len() / lora <= 64 {
                let direct = direct_latent_attention(&g, &mla, &q_r.data, &latents, &k_rots, &kv_b);
                assert_close(
                    &format!("{at}: reference against f64"),
                    &want,
                    &direct,
                    1e-5,
                );
            }
        };
        for (i, n) in [5, 1, 1, 17, 1, 2, long, 1, 3, 1].into_iter().enumerate() {
            step(n, 10 * i as u64, &mut cache_r, &mut cache_b);
        }
        let len = 32 + long;
        assert_eq!(b.kv_len(&cache_b), len, "{what}: positions cached");
        let (exported, want) = (
            b.kv_export(&cache_b).unwrap(),
            r.kv_export(&cache_r).unwrap(),
        );
        assert_eq!(
            exported.keys.len(),
            len * (lora + rope),
            "{what}: exported rows"
        );
        assert_eq!(exported.keys, want.keys, "{what}: exported latent rows");
        assert!(
            exported.values.is_empty(),
            "{what}: a latent cache has no values"
        );

        r.kv_truncate(&mut cache_r, 20);
        b.kv_truncate(&mut cache_b, 20);
        assert_eq!(b.kv_len(&cache_b), 20);
        step(4, 77, &mut cache_r, &mut cache_b);
        step(1, 78, &mut cache_r, &mut cache_b);

        let mut imported = b.kv_import(shape, r.kv_export(&cache_r).unwrap()).unwrap();
        assert_eq!(b.kv_len(&imported), 25);
        step(1, 91, &mut cache_r, &mut imported);
        step(6, 92, &mut cache_r, &mut imported);
    }
}

/// A router's choice computed directly in f64 from transformers' formulas
/// (DeepSeek-V3's and GLM-4.5's `route_tokens_to_experts`, gpt-oss's
/// router): per token, each chosen expert and its weight, as a sorted
/// list (transformers' top-k leaves the order of the chosen to the
/// implementation).
fn direct_route(
    logits: &[f32],
    experts: usize,
    spec: &RouterSpec,
    bias: Option<&[f32]>,
) -> Vec<Vec<(u32, f64)>> {
    let descending =
        |v: &mut Vec<(usize, f64)>| v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    logits
        .chunks_exact(experts)
        .map(|row| {
            let x: Vec<f64> = row.iter().map(|&v| v as f64).collect();
            let scores: Vec<f64> = match spec.score {
                ScoreFunction::Softmax => {
                    let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let total: f64 = x.iter().map(|v| (v - max).exp()).sum();
                    x.iter().map(|v| (v - max).exp() / total).collect()
                }
                ScoreFunction::Sigmoid => x.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect(),
                ScoreFunction::SoftmaxOfChosen => x.clone(),
            };
            let mut choice = scores.clone();
            if let Some(bias) = bias.filter(|_| spec.correction_bias) {
                choice
                    .iter_mut()
                    .zip(bias)
                    .for_each(|(c, &b)| *c += b as f64);
            }
            if let Some(g) = spec.groups {
                let size = experts / g.count;
                let mut group_scores: Vec<(usize, f64)> = choice
                    .chunks_exact(size)
                    .map(|group| {
                        let mut sorted = group.to_vec();
                        sorted.sort_by(|a, b| b.total_cmp(a));
                        sorted.iter().take(2).sum()
                    })
                    .enumerate()
                    .collect();
                descending(&mut group_scores);
                for &(dropped, _) in &group_scores[g.keep..] {
                    choice[dropped * size..][..size].fill(f64::NEG_INFINITY);
                }
            }
            let mut order: Vec<(usize, f64)> = choice.into_iter().enumerate().collect();
            descending(&mut order);
            let chosen: Vec<usize> = order[..spec.top_k].iter().map(|&(e, _)| e).collect();
            let mut picked: Vec<f64> = chosen.iter().map(|&e| scores[e]).collect();
            if spec.score == ScoreFunction::SoftmaxOfChosen {
                let max = picked.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                picked.iter_mut().for_each(|p| *p = (*p - max).exp());
                let total: f64 = picked.iter().sum();
                picked.iter_mut().for_each(|p| *p /= total);
            }
            let sum: f64 = picked.iter().sum();
            let scale = spec.scaling as f64 / if spec.renormalize { sum } else { 1.0 };
            let mut weighted: Vec<(u32, f64)> = chosen
                .iter()
                .zip(&picked)
                .map(|(&e, &p)| (e as u32, p * scale))
                .collect();
            weighted.sort_by_key(|&(e, _)| e);
            weighted
        })
        .collect()
}

/// Routers other than the plain softmax ([`Backend::route`]) against the
/// reference's [`RouterSpec`] implementation: the grouped sigmoid router
/// with its correction bias (groups of one, of 15 and of 32 experts, fewer
/// unmasked experts than the top-k, renormalisation on and off, scaling),
/// a softmax with groups and a bias, gpt-oss's softmax over the chosen,
/// Kimi K2's 384 experts without groups and a thousand experts (fewer
/// tokens per block). Logits and biases on a coarse grid tie often: the
/// experts chosen, in order, must be the reference's exactly (ties to the
/// lower index, as the lower group), the weights within 1e-6 of the
/// largest. On random logits (no ties) the reference equals a direct f64
/// computation of transformers' routers, chosen sets and weights.
pub fn routers<B: Conformance>(b: &B, _: Activations) {
    let r = reference();
    let sigmoid = |top_k, groups: Option<(usize, usize)>, renormalize, scaling| RouterSpec {
        top_k,
        score: ScoreFunction::Sigmoid,
        groups: groups.map(|(count, keep)| ExpertGroups { count, keep }),
        correction_bias: true,
        renormalize,
        scaling,
    };
    let cases = [
        (256, sigmoid(8, Some((8, 4)), true, 2.5)),
        (256, sigmoid(8, Some((8, 3)), false, 1.0)),
        (60, sigmoid(5, Some((4, 2)), true, 1.5)),
        (12, sigmoid(4, Some((6, 1)), true, 1.0)),
        (8, sigmoid(2, Some((8, 3)), true, 1.0)),
        (384, sigmoid(8, None, true, 2.827)),
        (1000, sigmoid(6, Some((10, 4)), true, 1.0)),
        (
            64,
            RouterSpec {
                score: ScoreFunction::Softmax,
                ..sigmoid(6, Some((4, 2)), false, 16.0)
            },
        ),
        (
            32,
            RouterSpec {
                top_k: 4,
                score: ScoreFunction::SoftmaxOfChosen,
                groups: None,
                correction_bias: false,
                renormalize: false,
                scaling: 1.0,
            },
        ),
        (
            128,
            RouterSpec {
                top_k: 4,
                score: ScoreFunction::SoftmaxOfChosen,
                groups: None,
                correction_bias: false,
                renormalize: true,
                scaling: 1.0,
            },
        ),
    ];
    for (experts, spec) in cases {
        let bias = values(experts, 3 + experts as u64);
        // Ties: values on a grid of eighths, logits off it by 0.03 (so no
        // two sigmoids of opposite logits sum to one, a near-tie of group
        // scores that f32 rounding could break either way).
        let coarse = |v: &[f32], offset: f32| -> Vec<f32> {
            v.iter().map(|x| (x * 4.0).round() / 8.0 + offset).collect()
        };
        for (inputs, tied) in [("random", false), ("tied", true)] {
            let bias = if tied {
                coarse(&bias, 0.0)
            } else {
                bias.clone()
            };
            let weights =
                TestWeights::new(&[("test.bias", DType::F32, vec![experts], bias.clone())]);
            let (bias_r, bias_b) = (
                weights.load(&r, "test.bias", &[experts]),
                weights.load(b, "test.bias", &[experts]),
            );
            for n in [1, 9] {
                let what = format!("route {n}x{experts} {inputs} {spec:?}");
                let logits = values(n * experts, n as u64 * 31 + experts as u64);
                let logits = if tied { coarse(&logits, 0.03) } else { logits };
                let (l_r, l_b) = both(b, n, experts, logits.clone());
                let want = r.route(&l_r, &spec, Some(&bias_r)).unwrap();
                let got = b.route(&l_b, &spec, Some(&bias_b)).unwrap();
                let want_experts = r.selected_experts(&want).unwrap();
                assert_eq!(
                    b.selected_experts(&got).unwrap(),
                    want_experts,
                    "{what}: experts"
                );
                assert_close(
                    &format!("{what}: weights"),
                    &b.routing_weights(&got),
                    &want.weights,
                    1e-6,
                );
                if !tied {
                    let direct = direct_route(&logits, experts, &spec, Some(&bias));
                    for (t, direct) in direct.iter().enumerate() {
                        let k = spec.top_k;
                        let mut mine: Vec<(u32, f32)> = want_experts[t * k..][..k]
                            .iter()
                            .copied()
                            .zip(want.weights[t * k..][..k].iter().copied())
                            .collect();
                        mine.sort_by_key(|&(e, _)| e);
                        let ids = |v: &[(u32, f64)]| v.iter().map(|&(e, _)| e).collect::<Vec<_>>();
                        assert_eq!(
                            mine.iter().map(|&(e, _)| e).collect::<Vec<_>>(),
                            ids(direct),
                            "{what}: token {t}, the reference against transformers' formula"
                        );
                        for (&(_, w), &(e, d)) in mine.iter().zip(direct) {
                            assert!(
                                (w as f64 - d).abs() <= 1e-6 * spec.scaling.max(1.0) as f64,
                                "{what}: token {t} expert {e}: weight {w} against {d}"
                            );
                        }
                    }
                }
            }
        }
    }
}
