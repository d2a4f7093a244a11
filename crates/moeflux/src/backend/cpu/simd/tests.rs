use super::*;

/// `dot` has one summation order: vectorised for any instruction set
/// it gives the scalar result bit for bit (what keeps attention and
/// Gated DeltaNet identical across machines).
#[test]
fn dot_is_identical_on_every_isa() {
    for len in [0, 1, 15, 16, 17, 64, 100, 1000] {
        let a: Vec<f32> = (0..len)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let b: Vec<f32> = (0..len)
            .map(|i| ((i * 53 % 89) as f32 - 44.0) / 3.0)
            .collect();
        let plain = dot(&a, &b);
        let exact: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
        let scale: f64 = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| (x as f64 * y as f64).abs())
            .sum();
        assert!((plain as f64 - exact).abs() <= scale * 1e-6, "len {len}");
        for isa in Isa::available() {
            let got = isa.vectorize(
                #[inline(always)]
                || dot(&a, &b),
            );
            assert_eq!(got.to_bits(), plain.to_bits(), "{isa:?} len {len}");
        }
    }
}

/// `dots8` is `dot` of each vector, bit for bit, on every instruction
/// set.
#[test]
fn dots8_are_dot_bit_for_bit() {
    for len in [0, 1, 15, 16, 17, 64, 100, 128] {
        let row = |seed: usize| -> Vec<f32> {
            (0..len)
                .map(|i| ((i * (31 + seed) % 97) as f32 - 48.0) / (3 + seed) as f32)
                .collect()
        };
        let a = row(0);
        let bs: Vec<Vec<f32>> = (1..=8).map(row).collect();
        let refs: [&[f32]; 8] = std::array::from_fn(|k| bs[k].as_slice());
        for isa in Isa::available() {
            let got = isa.dots8(&a, refs);
            for (k, b) in bs.iter().enumerate() {
                let want = dot(&a, b).to_bits();
                assert_eq!(got[k].to_bits(), want, "{isa:?} len {len} #{k}");
            }
        }
    }
}

#[test]
fn exp_is_within_two_ulp_of_the_true_value() {
    let mut worst = 0f64;
    // Every 97th float bit pattern between -87 and 88.
    let (lo, hi) = (87f32.to_bits(), 88f32.to_bits());
    let negatives = (0u32..lo).step_by(97).map(|b| f32::from_bits(b | 1 << 31));
    let positives = (0u32..hi).step_by(97).map(f32::from_bits);
    for x in negatives.chain(positives) {
        let want = (x as f64).exp();
        let ulp = f32::from_bits((want as f32).to_bits() + 1) as f64 - want as f32 as f64;
        worst = worst.max((exp(x) as f64 - want).abs() / ulp);
    }
    assert!(worst <= 2.0, "worst error {worst} ulp");
    assert_eq!(exp(0.0), 1.0);
    assert_eq!(exp(-100.0), 0.0);
    assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp(100.0), f32::INFINITY);
    assert!(exp(f32::NAN).is_nan());
}

#[test]
fn max_and_exp_sum_cover_every_value() {
    for len in [0, 1, 15, 16, 17, 100] {
        let x: Vec<f32> = (0..len)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 3.0)
            .collect();
        let want = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(max(&x), want, "len {len}");
        let mut e = x.clone();
        let total = exp_sum(&mut e, want);
        for (e, &x) in e.iter().zip(&x) {
            assert_eq!(*e, exp(x - want));
        }
        let plain: f32 = e.iter().sum();
        assert!((total - plain).abs() <= 1e-5 * plain.max(1.0), "len {len}");
    }
}

/// NEON is baseline on aarch64, so there the kernel tests (here and in
/// `linear`) run its kernels, not only the scalar ones.
#[cfg(target_arch = "aarch64")]
#[test]
fn neon_is_the_first_choice_on_aarch64() {
    assert_eq!(Isa::available(), [Isa::Neon, Isa::Scalar]);
}

#[test]
fn tiles_cover_every_row_once() {
    for rows in 0..40 {
        for max_rows in [1, 2, 4] {
            let mut seen = vec![0; rows];
            for i in 0..tile_count(rows, max_rows) {
                let (tile, count) = tile(i, rows, max_rows);
                tile[..count].iter().for_each(|&r| seen[r] += 1);
            }
            assert!(seen.iter().all(|&s| s == 1), "{rows} rows by {max_rows}");
        }
    }
}

#[test]
fn four_bit_inputs_are_reordered_per_run() {
    let x: Vec<f32> = (0..64).map(|i| i as f32).collect();
    for isa in Isa::available() {
        let run = isa.q4_run();
        let acts = Acts::new(isa, &x, 1, 64, Some(4));
        for (i, chunk) in acts.x.chunks(2 * run).enumerate() {
            let first = (2 * run * i) as f32;
            let evens: Vec<f32> = (0..run).map(|j| first + 2.0 * j as f32).collect();
            let odds: Vec<f32> = evens.iter().map(|v| v + 1.0).collect();
            assert_eq!(chunk, [evens, odds].concat(), "{isa:?}");
        }
        assert_eq!(*Acts::new(isa, &x, 1, 64, Some(8)).x, x[..]);
    }
}
