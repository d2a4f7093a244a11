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
        DType::Q4 | DType::Q8 => layout.scales_offset..layout.total_bytes,
        _ => 0..layout.scales_offset,
    };
    for pair in bytes[params].chunks_exact_mut(2) {
        pair.copy_from_slice(&small(next()));
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
