//! Random fills generated on the GPU: `out[i] = lo + (hi - lo) * u(seed, i)` with `u` uniform in
//! `[0, 1)` from a hash of the index. The autotuner builds its timing inputs with these (GiB-sized
//! weights in well under a millisecond instead of seconds of host random numbers and copies); the
//! values depend only on `(seed, i, lo, hi)`, so [`reference_bf16`] / [`reference_f32`] reproduce
//! them bit for bit on the CPU. [`FillRandomU32`] writes the raw 32-bit hash words (random packed
//! INT4 weights), reproduced by [`reference_u32`].

use ddtree_codegen::dsl::*;
use ddtree_macros::{device_fn, kernel, KernelParams};

/// Compile-time parameters of the fill kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct FillParams {
    /// Threads per block.
    pub block: u32,
}

/// Largest element count a fill handles (the grid-stride index is a `u32`).
pub const FILL_MAX: usize = 1 << 31;

/// The murmur3 finalizer (as [`mix`]).
#[device_fn]
fn fill_mix(x: u32) -> u32 {
    let mut h = x;
    h = h ^ (h >> 16);
    h = h * 0x85ebca6bu32;
    h = h ^ (h >> 13);
    h = h * 0xc2b2ae35u32;
    h ^ (h >> 16)
}

/// `lo + (hi - lo) * u` for element `i` (as [`value`]): 24 random bits scaled to `[0, 1)`, one fma.
#[device_fn]
fn fill_value(i: u32, seed: u32, lo: f32, hi: f32) -> f32 {
    let h = fill_mix(fill_mix(i) ^ (seed * 0x9e3779b9u32));
    let u = ((h >> 8) as f32) * 0.000000059604645f32;
    u.mul_add(hi - lo, lo)
}

/// `n` random bf16 in `[lo, hi]` (`hi` itself only by rounding). Any grid: the kernel strides
/// over all elements; `n` must be below [`FILL_MAX`].
#[kernel(block = p.block, space = [FillParams { block: 256 }])]
pub fn fill_random_bf16(#[comptime] p: &FillParams, out: &mut [bf16], n: u32, seed: u32, lo: f32, hi: f32) {
    let stride = grid_dim_x() * p.block;
    let first = block_idx_x() * p.block + thread_idx_x();
    for i in (first..n).step_by(stride) {
        out[i] = fill_value(i, seed, lo, hi) as bf16;
    }
}

/// `n` random f32 in `[lo, hi)`, as [`FillRandomBf16`].
#[kernel(block = p.block, space = [FillParams { block: 256 }])]
pub fn fill_random_f32(#[comptime] p: &FillParams, out: &mut [f32], n: u32, seed: u32, lo: f32, hi: f32) {
    let stride = grid_dim_x() * p.block;
    let first = block_idx_x() * p.block + thread_idx_x();
    for i in (first..n).step_by(stride) {
        out[i] = fill_value(i, seed, lo, hi);
    }
}

/// `n` uniformly random 32-bit words: `out[i]` is the hash of `(seed, i)` that the other fills
/// scale ([`word`]). Any grid: the kernel strides over all elements; `n` must be below
/// [`FILL_MAX`].
#[kernel(block = p.block, space = [FillParams { block: 256 }])]
pub fn fill_random_u32(#[comptime] p: &FillParams, out: &mut [u32], n: u32, seed: u32) {
    let stride = grid_dim_x() * p.block;
    let first = block_idx_x() * p.block + thread_idx_x();
    for i in (first..n).step_by(stride) {
        out[i] = fill_mix(fill_mix(i) ^ (seed * 0x9e3779b9u32));
    }
}

/// The launch grid for `n` elements: one per thread, capped at 8192 blocks (the kernels
/// grid-stride past that).
pub fn grid(p: &FillParams, n: usize) -> u32 {
    n.div_ceil(p.block as usize).clamp(1, 8192) as u32
}

/// The murmur3 finalizer.
fn mix(x: u32) -> u32 {
    let mut h = x;
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// Word `i` of a fill with `seed`: what [`FillRandomU32`] writes and the float fills scale.
pub fn word(i: u32, seed: u32) -> u32 {
    mix(mix(i) ^ seed.wrapping_mul(0x9e37_79b9))
}

/// Element `i` of a float fill: what the kernels compute.
pub fn value(i: u32, seed: u32, lo: f32, hi: f32) -> f32 {
    let h = word(i, seed);
    let u = (h >> 8) as f32 * 0.000_000_059_604_645;
    u.mul_add(hi - lo, lo)
}

/// CPU reference of [`FillRandomF32`].
pub fn reference_f32(n: usize, seed: u32, lo: f32, hi: f32) -> Vec<f32> {
    (0..n as u32).map(|i| value(i, seed, lo, hi)).collect()
}

/// CPU reference of [`FillRandomU32`].
pub fn reference_u32(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| word(i, seed)).collect()
}

/// CPU reference of [`FillRandomBf16`] (round to nearest even).
pub fn reference_bf16(n: usize, seed: u32, lo: f32, hi: f32) -> Vec<bf16> {
    (0..n as u32).map(|i| bf16::from_f32(value(i, seed, lo, hi))).collect()
}

#[cfg(test)]
mod tests {
    use ddtree_codegen::interp::{Buffer, HostArg, Program};
    use ddtree_codegen::Kernel;

    use super::*;

    fn args<'a>(out: &'a mut Buffer, n: usize, seed: u32, lo: f32, hi: f32) -> [HostArg<'a>; 5] {
        [
            HostArg::Out(out),
            HostArg::Scalar((n as u32).into()),
            HostArg::Scalar(seed.into()),
            HostArg::Scalar(lo.into()),
            HostArg::Scalar(hi.into()),
        ]
    }

    /// Ragged `n` over a grid smaller than `n / block` (so threads stride), bit-exact.
    #[test]
    fn interpreter_matches_the_reference_bit_for_bit() {
        let p = FillRandomBf16::default_params();
        let n = 3 * p.block as usize + 37;
        let mut out = Buffer::from_slice(&vec![bf16::NAN; n]);
        Program::of::<FillRandomBf16>(&p)
            .unwrap()
            .launch([2, 1, 1], &mut args(&mut out, n, 7, -1.0, 1.0))
            .unwrap();
        let got: Vec<bf16> = out.to_vec();
        assert_eq!(got, reference_bf16(n, 7, -1.0, 1.0));

        let p = FillRandomF32::default_params();
        let mut out = Buffer::from_slice(&vec![f32::NAN; n]);
        Program::of::<FillRandomF32>(&p)
            .unwrap()
            .launch([grid(&p, n), 1, 1], &mut args(&mut out, n, 7, -20.0, 20.0))
            .unwrap();
        let got: Vec<f32> = out.to_vec();
        let want = reference_f32(n, 7, -20.0, 20.0);
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));

        let p = FillRandomU32::default_params();
        let mut out = Buffer::from_slice(&vec![0xdead_beefu32; n]);
        Program::of::<FillRandomU32>(&p)
            .unwrap()
            .launch(
                [2, 1, 1],
                &mut [
                    HostArg::Out(&mut out),
                    HostArg::Scalar((n as u32).into()),
                    HostArg::Scalar(7u32.into()),
                ],
            )
            .unwrap();
        let got: Vec<u32> = out.to_vec();
        assert_eq!(got, reference_u32(n, 7));
    }

    /// Every nibble of the words (a packed INT4 weight) is uniform over 0..16.
    #[test]
    fn words_have_uniform_nibbles() {
        let w = reference_u32(1 << 14, 3);
        let mut counts = [[0usize; 16]; 8];
        for x in &w {
            for (j, c) in counts.iter_mut().enumerate() {
                c[(x >> (4 * j) & 15) as usize] += 1;
            }
        }
        let expect = w.len() as f32 / 16.0;
        for c in counts.iter().flatten() {
            assert!((*c as f32 - expect).abs() < 0.1 * expect, "{counts:?}");
        }
        assert_ne!(w[..64], reference_u32(64, 4)[..]);
        assert_eq!(value(5, 3, 0.0, 1.0), (word(5, 3) >> 8) as f32 * 0.000_000_059_604_645);
    }

    #[test]
    fn values_are_uniform_in_range_and_depend_on_the_seed() {
        let v = reference_f32(1 << 16, 1, -2.0, 2.0);
        assert!(v.iter().all(|x| (-2.0..2.0).contains(x)));
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        assert!(mean.abs() < 0.02, "mean {mean}");
        let quarter = v.iter().filter(|&&x| x < -1.0).count() as f32 / v.len() as f32;
        assert!((quarter - 0.25).abs() < 0.01, "{quarter}");
        assert_ne!(v[..64], reference_f32(64, 2, -2.0, 2.0)[..]);
        assert_eq!(grid(&FillParams { block: 256 }, 1 << 30), 8192);
        assert_eq!(grid(&FillParams { block: 256 }, 0), 1);
    }
}
