//! Throughput of the matrix kernels beside this machine's memory read
//! bandwidth. Ignored by default; run with
//! `cargo test --release -p moeflux --lib matmul_throughput -- --ignored --nocapture`.

use half::bf16;

use super::bandwidth::{best_of, read_bandwidth};
use super::linear::{Activations, matmul_with};
use super::simd::Isa;
use crate::quant::{DType, MatrixLayout, MatrixView};
use crate::util::AlignedBuf;

/// A random matrix whose scales and biases are sane bf16 values.
fn matrix(dtype: DType, rows: usize, cols: usize, seed: u64) -> (MatrixLayout, AlignedBuf) {
    let layout = MatrixLayout::new(dtype, rows, cols).unwrap();
    let mut bytes = AlignedBuf::zeroed(layout.total_bytes);
    let mut state = seed | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for chunk in bytes.chunks_exact_mut(8) {
        chunk.copy_from_slice(&next().to_le_bytes());
    }
    let small = |v: u64| {
        bf16::from_f32((v % 1000) as f32 / 1e5)
            .to_bits()
            .to_le_bytes()
    };
    let params = match dtype {
        d if d.is_quantized() => layout.scales_offset..layout.total_bytes,
        _ => 0..layout.scales_offset,
    };
    for pair in bytes[params].chunks_exact_mut(2) {
        pair.copy_from_slice(&small(next()));
    }
    if dtype == DType::Mxfp4 {
        // Exponents near 2^0, as trained weights have: subnormal weights
        // would time the FPU's slow path.
        for e in &mut bytes[layout.scales_offset..layout.biases_offset] {
            *e = 120 + (next() % 8) as u8;
        }
    }
    (layout, bytes)
}

#[test]
#[ignore = "benchmark"]
fn matmul_throughput() {
    let threads = rayon::current_num_threads();
    let big = vec![1f32; 128 << 20];
    for isa in Isa::available().into_iter().filter(|&i| i != Isa::Scalar) {
        let ceiling = read_bandwidth(isa, &big);
        println!("{isa:?}, {threads} threads: read bandwidth {ceiling:.1} GB/s");
        let modes = [
            (DType::Q4, Activations::F32),
            (DType::Q4, Activations::Int8),
            (DType::Q8, Activations::F32),
            (DType::Q8, Activations::Int8),
            (DType::Q3, Activations::F32),
            (DType::Q3, Activations::Int8),
            (DType::Q2, Activations::F32),
            (DType::Q2, Activations::Int8),
            (DType::Mxfp4, Activations::F32),
            (DType::Bf16, Activations::F32),
        ];
        for (dtype, activations) in modes {
            let name = match activations {
                Activations::F32 => dtype.name().to_string(),
                Activations::Int8 => format!("{}·i8", dtype.name()),
            };
            // Compute speed of one core on a matrix that stays in L2.
            let (l, b) = matrix(dtype, 256, 2048, 99);
            let view = MatrixView::new(l, &b);
            let x = vec![0.25f32; 2048];
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            let secs = pool.install(|| {
                best_of(5, || {
                    for _ in 0..100 {
                        std::hint::black_box(matmul_with(isa, &x, 1, &view, activations));
                    }
                }) / 100.0
            });
            println!(
                "  matvec {name:<7} 256 x 2048 in L2, 1 thread: {:.1} Gweights/s, {:.1} GB/s",
                256.0 * 2048.0 / secs / 1e9,
                l.total_bytes as f64 / secs / 1e9
            );
            for (rows, cols) in [(768, 2048), (2048, 768), (4096, 2048), (151936, 2048)] {
                let one = MatrixLayout::new(dtype, rows, cols).unwrap().total_bytes;
                // Enough matrices to miss the 32 MB L3 on every call.
                let count = (160usize << 20).div_ceil(one);
                let mats: Vec<_> = (0..count)
                    .map(|i| matrix(dtype, rows, cols, i as u64 + 1))
                    .collect();
                let views: Vec<_> = mats.iter().map(|(l, b)| MatrixView::new(*l, b)).collect();
                let x: Vec<f32> = (0..cols).map(|i| (i % 17) as f32 / 17.0 - 0.5).collect();
                let secs = best_of(3, || {
                    for v in &views {
                        std::hint::black_box(matmul_with(isa, &x, 1, v, activations));
                    }
                }) / count as f64;
                let gbs = one as f64 / secs / 1e9;
                println!(
                    "  matvec {name:<7} {rows:>6} x {cols}: {:>7.1} us, {gbs:5.1} GB/s = {:3.0}% of read bandwidth",
                    secs * 1e6,
                    100.0 * gbs / ceiling
                );
                if (rows, cols) != (4096, 2048) {
                    continue;
                }
                // A prefill chunk against n matrix-vector products.
                let n = 64;
                let xs: Vec<f32> = (0..n * cols)
                    .map(|i| (i % 23) as f32 / 23.0 - 0.5)
                    .collect();
                let gemm = best_of(3, || {
                    for v in views.iter().take(4) {
                        std::hint::black_box(matmul_with(isa, &xs, n, v, activations));
                    }
                }) / 4.0;
                let macs = (rows * cols * n) as f64;
                println!(
                    "  gemm   {name:<7} {rows:>6} x {cols}, n = {n}: {:>7.1} us, {:5.1} GMAC/s, {:.1}x faster than {n} matvecs",
                    gemm * 1e6,
                    macs / gemm / 1e9,
                    secs * n as f64 / gemm
                );
            }
        }
    }
}

/// One core's int8 products of a q4 expert's shapes by token count, as
/// prefill gives an expert its tokens: the matrices stay in L2, so this
/// times the kernels' arithmetic. Run with
/// `cargo test --release -p moeflux --lib int8_tokens_throughput -- --ignored --nocapture`.
#[test]
#[ignore = "benchmark"]
fn int8_tokens_throughput() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    for isa in Isa::available().into_iter().filter(|&i| i != Isa::Scalar) {
        for (rows, cols) in [(768, 2048), (2048, 768)] {
            let (l, b) = matrix(DType::Q4, rows, cols, 5);
            let view = MatrixView::new(l, &b);
            for n in [1, 2, 3, 4, 8, 16, 32, 64] {
                let xs: Vec<f32> = (0..n * cols)
                    .map(|i| (i % 23) as f32 / 23.0 - 0.5)
                    .collect();
                let secs = pool.install(|| {
                    best_of(5, || {
                        for _ in 0..10 {
                            std::hint::black_box(matmul_with(
                                isa,
                                &xs,
                                n,
                                &view,
                                Activations::Int8,
                            ));
                        }
                    }) / 10.0
                });
                println!(
                    "{isa:?} q4·i8 {rows} x {cols}, n = {n:>2}: {:>7.1} us, {:5.1} GMAC/s",
                    secs * 1e6,
                    (rows * cols * n) as f64 / secs / 1e9
                );
            }
        }
    }
}

/// Decode of the qwen3-30b-a3b shapes without the rest of the engine: per
/// token and layer the q/k/v, o, 8 experts' gate/up and down products (q4),
/// then the LM head, int8 activations, as a forward pass issues them; the
/// weights (about 700 MB) are far beyond the caches. Each run is followed
/// by the memory read probe, so the two are compared run by run. Run with
/// `cargo test --release -p moeflux --lib decode_layers_throughput -- --ignored --nocapture`.
#[test]
#[ignore = "benchmark"]
fn decode_layers_throughput() {
    use super::linear::{Product, matmul_many_with};
    fn view((l, b): &(MatrixLayout, AlignedBuf)) -> MatrixView<'_> {
        MatrixView::new(*l, b)
    }
    let isa = Isa::get();
    let pool = super::CpuOptions::default().pool;
    let (hidden, q_width, kv_width, inter, top_k, vocab) = (2048, 4096, 512, 768, 8, 151936);
    let layers = 16;
    let activations = Activations::Int8;
    let mut seed = 1;
    let mut matrices = |shapes: &[(usize, usize)]| -> Vec<(MatrixLayout, AlignedBuf)> {
        shapes
            .iter()
            .map(|&(rows, cols)| {
                seed += 1;
                matrix(DType::Q4, rows, cols, seed)
            })
            .collect()
    };
    let attention: Vec<_> = (0..layers)
        .map(|_| {
            matrices(&[
                (q_width, hidden),
                (kv_width, hidden),
                (kv_width, hidden),
                (hidden, q_width),
            ])
        })
        .collect();
    let experts: Vec<_> = (0..layers)
        .map(|_| {
            (0..top_k)
                .map(|_| matrices(&[(inter, hidden), (inter, hidden), (hidden, inter)]))
                .collect::<Vec<_>>()
        })
        .collect();
    let head = matrices(&[(vocab, hidden)]);
    let bytes: usize = attention
        .iter()
        .flatten()
        .chain(experts.iter().flatten().flatten())
        .chain(&head)
        .map(|(l, _)| l.total_bytes)
        .sum();
    let x: Vec<f32> = (0..hidden).map(|i| (i % 17) as f32 / 17.0 - 0.5).collect();
    let token = || {
        for (attn, experts) in attention.iter().zip(&experts) {
            let qkv: Vec<Product<'_>> = attn[..3]
                .iter()
                .map(|w| Product {
                    x: &x,
                    n: 1,
                    w: view(w),
                    activations,
                })
                .collect();
            let qkv = matmul_many_with(isa, pool, &qkv);
            let o = Product {
                x: &qkv[0],
                n: 1,
                w: view(&attn[3]),
                activations,
            };
            std::hint::black_box(matmul_many_with(isa, pool, &[o]));
            let gate_up: Vec<Product<'_>> = experts
                .iter()
                .flat_map(|e| {
                    [&e[0], &e[1]].map(|w| Product {
                        x: &x,
                        n: 1,
                        w: view(w),
                        activations,
                    })
                })
                .collect();
            let act: Vec<Vec<f32>> = matmul_many_with(isa, pool, &gate_up)
                .chunks_exact(2)
                .map(|p| p[0].iter().zip(&p[1]).map(|(g, u)| g * u).collect())
                .collect();
            let down: Vec<Product<'_>> = experts
                .iter()
                .zip(&act)
                .map(|(e, a)| Product {
                    x: a,
                    n: 1,
                    w: view(&e[2]),
                    activations,
                })
                .collect();
            std::hint::black_box(matmul_many_with(isa, pool, &down));
        }
        let head = Product {
            x: &x,
            n: 1,
            w: view(&head[0]),
            activations,
        };
        std::hint::black_box(matmul_many_with(isa, pool, &[head]));
    };
    let big = vec![1f32; 128 << 20];
    let tokens = 16;
    println!(
        "{isa:?}, {} threads (moeflux's workers: {pool}), {:.1} MB of weights per token",
        rayon::current_num_threads(),
        bytes as f64 / 1e6
    );
    // The kernels' compute speed: one core, an expert's matrices in L2.
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    for w in &experts[0][0][1..] {
        let x = &x[..w.0.cols];
        let secs = one.install(|| {
            best_of(5, || {
                for _ in 0..100 {
                    std::hint::black_box(matmul_with(isa, x, 1, &view(w), activations));
                }
            }) / 100.0
        });
        println!(
            "  in L2, 1 thread: {} x {}: {:.1} Gweights/s",
            w.0.rows,
            w.0.cols,
            (w.0.rows * w.0.cols) as f64 / secs / 1e9
        );
    }
    for _ in 0..6 {
        // On a pool worker, as the engine runs its forward pass.
        let secs = rayon::join(
            || {
                token();
                let t = std::time::Instant::now();
                for _ in 0..tokens {
                    token();
                }
                t.elapsed().as_secs_f64() / tokens as f64
            },
            || (),
        )
        .0;
        let achieved = bytes as f64 / secs / 1e9;
        let probe = read_bandwidth(isa, &big);
        println!(
            "  {:.2} ms/token, {achieved:.1} GB/s; probe {probe:.1} GB/s; {:.0}%",
            secs * 1e3,
            100.0 * achieved / probe
        );
    }
}

/// qwen3-30b-a3b's attention: 32 query heads over 4 KV heads of 128.
fn qwen3_30b_attention() -> crate::backend::AttentionShape {
    crate::backend::AttentionShape {
        num_heads: 32,
        num_kv_heads: 4,
        head_dim: 128,
        window: None,
        latent: false,
    }
}

/// `n` values uniform in [-0.5, 0.5) a call, from `seed`.
fn uniform_values(seed: u64) -> impl FnMut(usize) -> Vec<f32> {
    let mut rng = crate::util::SplitMix64(seed);
    move |n| {
        (0..n)
            .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            .collect()
    }
}

/// A decode step's attention over 8192 cached positions of the
/// qwen3-30b-a3b shape (32 query heads over 4 KV heads of 128) for each KV
/// type: the cache's bytes read per step against the read bandwidth.
/// `cargo test --release -p moeflux --lib attention_decode_throughput -- --ignored --nocapture`
#[test]
#[ignore = "benchmark"]
fn attention_decode_throughput() {
    use super::attention::{KvCache, attend};
    use crate::backend::{KvRows, KvType};

    let shape = qwen3_30b_attention();
    let (positions, width) = (8192, 4 * 128);
    let mut values = uniform_values(7);
    let (keys, vals) = (values(positions * width), values(positions * width));
    let (q, k, v) = (values(32 * 128), values(width), values(width));
    let big = vec![1f32; 128 << 20];
    for isa in Isa::available() {
        let ceiling = read_bandwidth(isa, &big);
        println!("{isa:?}: read bandwidth {ceiling:.1} GB/s");
        for kv in KvType::ALL {
            let mut cache = KvCache {
                shape,
                first: 0,
                keys: KvRows::encode(kv, &keys),
                values: KvRows::encode(kv, &vals),
            };
            let secs = best_of(10, || {
                std::hint::black_box(attend(isa, false, &mut cache, &q, &k, &v, 1, None));
                cache.truncate(positions);
            });
            let bytes = 2 * positions * kv.row_bytes(width);
            println!(
                "  {kv:<4} after {positions} positions: {:.0} µs a step, {:.1} GB/s of cache ({:.0}% of the probe)",
                secs * 1e6,
                bytes as f64 / secs / 1e9,
                100.0 * bytes as f64 / secs / 1e9 / ceiling
            );
        }
    }
}

/// A prefill chunk's attention: 512 positions of the qwen3-30b-a3b shape
/// onto an empty cache, on every thread, for each KV type: multiply-adds
/// of the scores and the weighted sums a second.
/// `cargo test --release -p moeflux --lib attention_prefill_throughput -- --ignored --nocapture`
#[test]
#[ignore = "benchmark"]
fn attention_prefill_throughput() {
    use super::attention::{KvCache, attend};
    use crate::backend::{KvRows, KvType};

    let shape = qwen3_30b_attention();
    let (n, width) = (512, 4 * 128);
    let mut values = uniform_values(7);
    let (q, k, v) = (values(n * 32 * 128), values(n * width), values(n * width));
    let macs = 2 * (n * (n + 1) / 2) * 32 * 128;
    for isa in Isa::available() {
        for kv in KvType::ALL {
            let mut cache = KvCache {
                shape,
                first: 0,
                keys: KvRows::new(kv),
                values: KvRows::new(kv),
            };
            let secs = best_of(5, || {
                std::hint::black_box(attend(isa, true, &mut cache, &q, &k, &v, n, None));
                cache.truncate(0);
            });
            println!(
                "{isa:?} {kv:<4}: {n} positions in {:.2} ms, {:.1} GMAC/s",
                secs * 1e3,
                macs as f64 / secs / 1e9
            );
        }
    }
}
