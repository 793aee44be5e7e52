//! Branch-free `exp` and `tanh` for the elementwise kernels, written so the compiler
//! vectorises the loops that call them (the standard library's call into libm one element at a
//! time: about 10 ns per GELU element and per softmax score on this machine, which made GELU
//! and attention's softmax cost more than the matrix products around them).
//!
//! Both are deterministic (plain `f32` arithmetic, no lookup tables, no platform calls), so
//! every backend thread and every run gives the same bits. Accuracy is a few units in the last
//! place over the whole range, checked against `f64` in the tests below.

/// `e^x` in `f32`: range reduction `x = n ln 2 + r`, `|r| <= ln 2 / 2`, a degree-6 polynomial
/// for `e^r` (Cephes's `expf` coefficients), and `2^n` built from its exponent bits. Inputs are
/// clamped to `[-87, 88]` (results from about `1.6e-38` to `1.6e38`; smaller results are
/// where the softmax has nothing left to weigh).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to the nearest integer and leaves it in the low bits.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    // The integer n sits in the low mantissa bits of `shifted` (offset by 0x4B40_0000).
    let k = shifted.to_bits().wrapping_sub(0x4B40_0000) as i32;
    let scale = f32::from_bits((k.wrapping_add(127) as u32) << 23);
    er * scale
}

/// `tanh(x)` in `f32`: the odd rational approximation of degree 13/6 used by Eigen, on `x`
/// clamped to `[-7.9, 7.9]` (where `tanh` rounds to `+-1` in `f32`).
#[inline(always)]
pub(crate) fn tanh(x: f32) -> f32 {
    const CLAMP: f32 = 7.905_311;
    let x = x.clamp(-CLAMP, CLAMP);
    let x2 = x * x;
    let mut p = -2.760_768_5e-16_f32;
    p = p * x2 + 2.000_188e-13;
    p = p * x2 + -8.604_672e-11;
    p = p * x2 + 5.122_297e-8;
    p = p * x2 + 1.485_722_4e-5;
    p = p * x2 + 6.372_619_3e-4;
    p = p * x2 + 4.893_524_6e-3;
    let p = p * x;
    let mut q = 1.198_258_4e-6_f32;
    q = q * x2 + 1.185_347_1e-4;
    q = q * x2 + 2.268_434_6e-3;
    q = q * x2 + 4.893_525e-3;
    p / q
}

/// Independent partial sums in [`sum`] and [`max`]: a fixed count, so the order of additions,
/// and with it the bits, does not depend on the vector width the loop is compiled for.
const PARTIALS: usize = 16;

/// The sum of `x`: element `j` goes to partial `j % 16`, the partials are added in order and
/// the tail last. Unlike a single running sum, its loop vectorises (each partial is one lane).
#[inline(always)]
pub(crate) fn sum(x: &[f32]) -> f32 {
    let mut partial = [0.0f32; PARTIALS];
    let chunks = x.chunks_exact(PARTIALS);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (p, &v) in partial.iter_mut().zip(chunk) {
            *p += v;
        }
    }
    partial.iter().sum::<f32>() + tail.iter().sum::<f32>()
}

/// The sum of `f(v)` over `x` in `f64`, with [`sum`]'s fixed partials.
#[inline(always)]
pub(crate) fn sum_f64(x: &[f32], f: impl Fn(f32) -> f64) -> f64 {
    sum_f64_pairs(x, x, |v, _| f(v))
}

/// The sum of `f(a[j], b[j])` in `f64`, with [`sum`]'s fixed partials.
#[inline(always)]
pub(crate) fn sum_f64_pairs(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f64) -> f64 {
    let mut partial = [0.0f64; PARTIALS];
    let (ca, cb) = (a.chunks_exact(PARTIALS), b.chunks_exact(PARTIALS));
    let tail: f64 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(&x, &y)| f(x, y))
        .sum();
    for (xa, xb) in ca.zip(cb) {
        for ((p, &x), &y) in partial.iter_mut().zip(xa).zip(xb) {
            *p += f(x, y);
        }
    }
    partial.iter().sum::<f64>() + tail
}

/// The largest element of `x` (negative infinity when empty), with [`sum`]'s partials. NaNs
/// are skipped, as `f32::max` skips them.
#[inline(always)]
pub(crate) fn max(x: &[f32]) -> f32 {
    let mut partial = [f32::NEG_INFINITY; PARTIALS];
    let chunks = x.chunks_exact(PARTIALS);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (p, &v) in partial.iter_mut().zip(chunk) {
            *p = p.max(v);
        }
    }
    partial
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Relative error against `f64` over a dense sweep.
    fn worst(f: fn(f32) -> f32, g: fn(f64) -> f64, lo: f32, hi: f32) -> f64 {
        let n = 200_000;
        (0..=n)
            .map(|i| lo + (hi - lo) * i as f32 / n as f32)
            .map(|x| {
                let want = g(f64::from(x));
                (f64::from(f(x)) - want).abs() / want.abs().max(1e-30)
            })
            .fold(0.0, f64::max)
    }

    #[test]
    fn lane_sums_and_maxima_match_plain_ones() {
        for n in [0, 1, 15, 16, 17, 70, 128] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.25)
                .collect();
            let plain: f64 = x.iter().map(|&v| f64::from(v)).sum();
            assert!((f64::from(sum(&x)) - plain).abs() < 1e-5, "sum of {n}");
            let want = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            assert_eq!(max(&x), want, "max of {n}");
        }
        // The order is fixed: element j of the whole chunks goes to partial j % 16, the
        // partials are added in order, then the tail.
        let x: Vec<f32> = (0..70).map(|i| 1.0 / (1.0 + i as f32)).collect();
        let mut want = 0.0f32;
        for p in 0..PARTIALS {
            want += x[..64]
                .iter()
                .skip(p)
                .step_by(PARTIALS)
                .fold(0.0, |a, &v| a + v);
        }
        want += x[64..].iter().sum::<f32>();
        assert_eq!(sum(&x).to_bits(), want.to_bits());
    }

    #[test]
    fn exp_is_accurate_to_a_few_ulps() {
        let e = worst(exp, f64::exp, -87.0, 88.0);
        assert!(e < 4e-7, "relative error {e:e}");
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn tanh_is_accurate_and_saturates() {
        // Relative error away from zero, absolute near it.
        let e = worst(tanh, f64::tanh, 0.01, 9.0);
        assert!(e < 1e-6, "relative error {e:e}");
        let e = worst(tanh, f64::tanh, -9.0, -0.01);
        assert!(e < 1e-6, "relative error {e:e}");
        assert_eq!(tanh(0.0), 0.0);
        assert_eq!(tanh(20.0), 1.0);
        assert_eq!(tanh(-20.0), -1.0);
        assert!((tanh(1e-5) - 1e-5).abs() < 1e-12);
    }
}
