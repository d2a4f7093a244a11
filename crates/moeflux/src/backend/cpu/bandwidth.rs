//! The memory read bandwidth this machine sustains: the ceiling every
//! decode-speed figure is reported against.

use std::time::Instant;

use rayon::prelude::*;

use super::simd::Isa;

/// Best time of `reps` runs of `f`.
pub(crate) fn best_of(reps: usize, mut f: impl FnMut()) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Sum with 64 independent lanes, so only memory limits it.
#[inline(always)]
fn sum(data: &[f32]) -> f32 {
    let mut acc = [0f32; 64];
    for c in data.chunks_exact(64) {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum()
}

/// Read bandwidth: all threads summing disjoint parts of a 512 MiB array.
pub(crate) fn read_bandwidth(isa: Isa, data: &[f32]) -> f64 {
    let parts = data.len().div_ceil(4 * rayon::current_num_threads());
    let secs = best_of(5, || {
        let s: f32 = data
            .par_chunks(parts)
            .map(|c| {
                isa.vectorize(
                    #[inline(always)]
                    || sum(c),
                )
            })
            .sum();
        std::hint::black_box(s);
    });
    std::mem::size_of_val(data) as f64 / secs / 1e9
}

/// Read bandwidth in GB/s with every thread streaming through 512 MiB,
/// using the kernels' instruction set.
pub fn memory_read_bandwidth() -> f64 {
    let data = vec![1f32; 128 << 20];
    read_bandwidth(Isa::get(), &data)
}
