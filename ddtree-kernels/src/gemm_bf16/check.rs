//! Checks of the bf16 tile GEMM against their CPU references, on any [`Target`] (see
//! [`crate::check`]).

use ddtree_codegen::Kernel;
use rand::rngs::StdRng;

use crate::check::*;
use crate::{gemm_bf16, GemmBf16, GemmParams};

/// Checks the tile GEMM.
pub fn gemm(
    t: &Target<'_>,
    p: &GemmParams,
    m: usize,
    n: usize,
    kd: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (a, af) = random_bf16(rng, m * kd, -1.0, 1.0);
    let (b, bf) = random_bf16(rng, n * kd, -1.0, 1.0);
    let (da, db) = (t.upload(&a)?, t.upload(&b)?);
    let mut c = poisoned_bf16(t, m * n)?;
    let grid = gemm_bf16::grid(p, m, n);
    let mut args = [
        Arg::In(&da),
        Arg::In(&db),
        Arg::Out(&mut c),
        Arg::from(m as u32),
        Arg::from(n as u32),
        Arg::from(kd as u32),
    ];
    // SAFETY: a is m x k, b is n x k, c is m x n, k % 8 == 0 (callers pick such k).
    unsafe { t.launch::<GemmBf16>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&c)?);
    let want = gemm_bf16::reference(&af, &bf, m, n, kd);
    // Sums of k products: scale the absolute tolerance with the typical output size.
    let tol = Tolerance::bf16_sums(&want);
    Ok(result::<GemmBf16>(p, format!("m={m} n={n} k={kd}"), &got, &want, tol))
}

/// Every candidate of [`GemmBf16`] at the sizes of `sizes`.
pub fn gemm_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in GemmBf16::space() {
        let mut cases = vec![(1, 8, 16), (37, 50, 72), (128, 128, 64), (130, 200, 264)];
        if sizes == Sizes::Full {
            cases.extend([(256, 7168, 2048), (16, 4096, 7168), (513, 1000, 1032)]);
        }
        for (m, n, k) in cases {
            out.push(gemm(t, &p, m, n, k, rng)?);
        }
    }
    Ok(out)
}
