//! Checks of the bf16 GEMVs (plain, split-k, fused gate/up SiLU, fused RMSNorm) against their CPU
//! references, on any [`Target`] (see [`crate::check`]).

use ddtree_codegen::Kernel;
use half::bf16;
use rand::rngs::StdRng;

use crate::check::*;
use crate::{
    gemv, GemvBf16, GemvBf16F32, GemvGateUpSilu, GemvParams, GemvRmsNormBf16, GemvSplitBf16, GemvSplitF32,
    GemvSplitGateUpSilu, GemvSplitParams,
};

/// Checks both GEMVs ([`GemvBf16`], [`GemvBf16F32`]) for variant `p` on `rows` rows of `a`
/// (`[rows, k]`, in `[-1, 1)`) against `w` (`[n, k]`, in `[-1, 1)`), outputs poisoned with NaN,
/// against [`gemv::reference`] (f64 sums). The bf16 output gets the bf16 tolerance (scaled by
/// the output's RMS for the absolute part, as sums of `k` products cancel); the f32 output a
/// tolerance far below one bf16 rounding, so an output rounded to bf16 fails.
pub fn gemv_pair(
    t: &Target<'_>,
    p: &GemvParams,
    rows: usize,
    n: usize,
    kd: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    gemv_outputs::<GemvBf16, GemvBf16F32>(t, p, gemv::grid(p, n as u32), rows, n, kd, rng)
}

/// [`gemv_pair`] for any pair of GEMV kernels of the same arguments: `B` with bf16 output, `F`
/// with f32 output, both launched on `grid`.
fn gemv_outputs<B: Kernel, F: Kernel<Params = B::Params>>(
    t: &Target<'_>,
    p: &B::Params,
    grid: u32,
    rows: usize,
    n: usize,
    kd: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    let (a, af) = random_bf16(rng, rows * kd, -1.0, 1.0);
    let (w, wf) = random_bf16(rng, n * kd, -1.0, 1.0);
    let (da, dw) = (t.upload(&a)?, t.upload(&w)?);
    let want = gemv::reference(&af, &wf, rows, n, kd);
    let case = format!("rows={rows} n={n} k={kd}");

    let mut ob = poisoned_bf16(t, rows * n)?;
    let mut args = [
        Arg::In(&da),
        Arg::In(&dw),
        Arg::Out(&mut ob),
        Arg::from(rows as u32),
        Arg::from(n as u32),
        Arg::from(kd as u32),
    ];
    // SAFETY: a is rows x k, w is n x k, out rows x n; k % 8 == 0 and 1 <= rows <= p.m (the
    // suites' cases).
    unsafe { t.launch::<B>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&ob)?);
    let tol = Tolerance::bf16_sums(&want);
    let mut out = vec![result::<B>(p, case.clone(), &got, &want, tol)];

    let mut of = t.upload(&vec![f32::NAN; rows * n])?;
    let mut args = [
        Arg::In(&da),
        Arg::In(&dw),
        Arg::Out(&mut of),
        Arg::from(rows as u32),
        Arg::from(n as u32),
        Arg::from(kd as u32),
    ];
    // SAFETY: as above.
    unsafe { t.launch::<F>(p, grid, &mut args)? };
    let got = t.download(&of)?;
    // f32 output: only the summation order differs from the reference.
    let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len().max(1) as f32).sqrt();
    let tol = Tolerance {
        rtol: 1e-4,
        atol: 1e-4 * rms,
        rel_l2: 1e-5,
    };
    out.push(result::<F>(p, case, &got, &want, tol));
    Ok(out)
}

/// Every row count `1..=m` over the `small` cases (the largest on each), and with
/// [`Sizes::Full`] rows 1 and `m` on the `full` cases: the GEMV suites' sweep.
fn gemv_sweep(
    sizes: Sizes,
    m: usize,
    small: &[(usize, usize)],
    full: &[(usize, usize)],
    mut check: impl FnMut(usize, usize, usize) -> Result<Vec<CheckResult>, CheckError>,
) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for (i, &(n, k)) in small.iter().enumerate() {
        for rows in 1..=m {
            if rows == m || rows % small.len() == i {
                out.extend(check(rows, n, k)?);
            }
        }
    }
    if sizes == Sizes::Full {
        for &(n, k) in full {
            for rows in [1, m] {
                out.extend(check(rows, n, k)?);
                if m == 1 {
                    break;
                }
            }
        }
    }
    Ok(out)
}

/// Every candidate of [`GemvBf16`] and [`GemvBf16F32`] at the sizes of `sizes`: every row count
/// `1..=m` over small cases with ragged `n` (not multiples of a block's columns) and `k` from 8
/// up; the full sizes add the Kimi K2.6 decode shapes at 1 and `m` rows (the LM head, 163840 x
/// 7168, only once, at 1 row on the default candidate: its inputs are 2.3 GB).
pub fn gemv_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let small = [(1, 8), (37, 24), (70, 136), (5, 520), (19, 1032)];
    let full = [
        (1536, 7168),
        (576, 7168),
        (2048, 7168),
        (48, 7168),
        (1031, 7168),
        (12288, 1536),
        (7168, 8192),
        (7168, 2048),
        (163840, 1024),
        (3, 8),
        (101, 24),
    ];
    let mut out = Vec::new();
    for p in GemvBf16::space() {
        out.extend(gemv_sweep(sizes, p.m as usize, &small, &full, |rows, n, k| {
            gemv_pair(t, &p, rows, n, k, rng)
        })?);
        if sizes == Sizes::Full && p == GemvBf16::space()[0] {
            out.extend(gemv_pair(t, &p, 1, 163840, 7168, rng)?);
        }
    }
    Ok(out)
}

/// Checks [`GemvRmsNormBf16`] for variant `p` on `rows` rows of `a` (`[rows, k]`, in `[-2, 2)`)
/// with a norm weight in `[0.5, 1.5)` and `w` (`[n, k]`, in `[-1, 1)`), the output poisoned with
/// NaN, against [`gemv::reference`] of the rows normalized by [`crate::rms_norm::reference`] and
/// rounded to bf16 (as the unfused `RmsNorm` stores them), with the bf16 GEMV's tolerance.
pub fn gemv_rms_norm(
    t: &Target<'_>,
    p: &GemvParams,
    rows: usize,
    n: usize,
    kd: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    let eps = 1e-6f32;
    let (a, af) = random_bf16(rng, rows * kd, -2.0, 2.0);
    let (g, gf) = random_bf16(rng, kd, 0.5, 1.5);
    let (w, wf) = random_bf16(rng, n * kd, -1.0, 1.0);
    let (da, dg, dw) = (t.upload(&a)?, t.upload(&g)?, t.upload(&w)?);
    let normed: Vec<f32> = crate::rms_norm::reference(&af, &gf, kd, eps)
        .iter()
        .map(|&v| bf16::from_f32(v).to_f32())
        .collect();
    let want = gemv::reference(&normed, &wf, rows, n, kd);
    let mut out = poisoned_bf16(t, rows * n)?;
    let mut args = [
        Arg::In(&da),
        Arg::In(&dg),
        Arg::from(eps),
        Arg::In(&dw),
        Arg::Out(&mut out),
        Arg::from(rows as u32),
        Arg::from(n as u32),
        Arg::from(kd as u32),
    ];
    // SAFETY: a is rows x k, norm k, w n x k, out rows x n; k % 8 == 0, k <= NORM_MAX_K and
    // 1 <= rows <= p.m (the suite's cases).
    unsafe { t.launch::<GemvRmsNormBf16>(p, gemv::grid(p, n as u32), &mut args)? };
    let got = to_f32(&t.download(&out)?);
    let tol = Tolerance::bf16_sums(&want);
    Ok(vec![result::<GemvRmsNormBf16>(
        p,
        format!("rows={rows} n={n} k={kd}"),
        &got,
        &want,
        tol,
    )])
}

/// Every candidate of [`GemvRmsNormBf16`], swept as [`gemv_suite`] sweeps (every row count
/// `1..=m` on small ragged cases, `k` up to [`gemv::NORM_MAX_K`]); the full sizes add the MLA
/// query up-projection of Kimi K2.6 (12288 x 1536).
pub fn gemv_rms_norm_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let small = [(1, 8), (37, 24), (70, 136), (5, 520), (19, 2048)];
    let full = [(12288, 1536), (1031, 1536), (101, 24)];
    let mut out = Vec::new();
    for p in GemvRmsNormBf16::space() {
        out.extend(gemv_sweep(sizes, p.m as usize, &small, &full, |rows, n, k| {
            gemv_rms_norm(t, &p, rows, n, k, rng)
        })?);
    }
    Ok(out)
}

/// Checks the split-K GEMVs [`GemvSplitBf16`] and [`GemvSplitF32`] as [`gemv_pair`] does.
pub fn gemv_split_pair(
    t: &Target<'_>,
    p: &GemvSplitParams,
    rows: usize,
    n: usize,
    kd: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    gemv_outputs::<GemvSplitBf16, GemvSplitF32>(t, p, gemv::split_grid(p, n as u32), rows, n, kd, rng)
}

/// Every candidate of [`GemvSplitBf16`] and [`GemvSplitF32`]: every row count `1..=m` over
/// small cases with ragged `n` and `k` (shorter and longer than one pass of the block); the full
/// sizes add the router (48 and 384 columns of 7168) and the small-`n` projections.
pub fn gemv_split_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let small = [(1, 8), (3, 24), (5, 1032), (2, 4104)];
    let full = [
        (48, 7168),
        (384, 7168),
        (576, 7168),
        (1536, 7168),
        (7, 7176),
        (1031, 1536),
    ];
    let mut out = Vec::new();
    for p in GemvSplitBf16::space() {
        out.extend(gemv_sweep(sizes, p.m as usize, &small, &full, |rows, n, k| {
            gemv_split_pair(t, &p, rows, n, k, rng)
        })?);
    }
    Ok(out)
}

/// Checks a fused gate/up GEMV `K` ([`GemvGateUpSilu`] or [`GemvSplitGateUpSilu`]) for variant
/// `p` on `grid` blocks: `rows` rows of `a` (`[rows, k]`) against `gate` and `up` (`[n, k]`),
/// all in `[-1, 1)`, the output poisoned with NaN, against [`gemv::reference_gate_up_silu`]
/// (f64 sums). The tolerance is the bf16 GEMV's, its absolute part scaled by the output's RMS:
/// a gate or up sum whose bf16 rounding flips with the summation order moves an output by
/// about one bf16 step.
#[allow(clippy::too_many_arguments)]
fn gate_up_output<K: Kernel>(
    t: &Target<'_>,
    p: &K::Params,
    grid: u32,
    rows: usize,
    n: usize,
    kd: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    let (a, af) = random_bf16(rng, rows * kd, -1.0, 1.0);
    let (g, gf) = random_bf16(rng, n * kd, -1.0, 1.0);
    let (u, uf) = random_bf16(rng, n * kd, -1.0, 1.0);
    let (da, dg, du) = (t.upload(&a)?, t.upload(&g)?, t.upload(&u)?);
    let want = gemv::reference_gate_up_silu(&af, &gf, &uf, rows, n, kd);
    let mut out = poisoned_bf16(t, rows * n)?;
    let mut args = [
        Arg::In(&da),
        Arg::In(&dg),
        Arg::In(&du),
        Arg::Out(&mut out),
        Arg::from(rows as u32),
        Arg::from(n as u32),
        Arg::from(kd as u32),
    ];
    // SAFETY: a is rows x k, gate and up n x k, out rows x n; k % 8 == 0 and 1 <= rows <= p.m
    // (the suites' cases).
    unsafe { t.launch::<K>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&out)?);
    let tol = Tolerance::bf16_sums(&want);
    Ok(vec![result::<K>(
        p,
        format!("rows={rows} n={n} k={kd}"),
        &got,
        &want,
        tol,
    )])
}

/// Checks [`GemvGateUpSilu`] variant `p` at `rows` rows of an `[n, k]` gate and up (the
/// autotuner's check).
pub fn gemv_gate_up(
    t: &Target<'_>,
    p: &GemvParams,
    rows: usize,
    n: usize,
    kd: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    gate_up_output::<GemvGateUpSilu>(t, p, gemv::grid(p, n as u32), rows, n, kd, rng)
}

/// Checks [`GemvSplitGateUpSilu`] variant `p` at `rows` rows of an `[n, k]` gate and up (the
/// autotuner's check).
pub fn gemv_split_gate_up(
    t: &Target<'_>,
    p: &GemvSplitParams,
    rows: usize,
    n: usize,
    kd: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    gate_up_output::<GemvSplitGateUpSilu>(t, p, gemv::split_grid(p, n as u32), rows, n, kd, rng)
}

/// Every candidate of [`GemvGateUpSilu`] at the sizes of `sizes`, swept as [`gemv_suite`] sweeps
/// (every row count `1..=m` on small ragged cases); the full sizes add the dense MLP of Kimi K2.6
/// (18432 x 7168) and the shared expert's shape (2048 x 7168).
pub fn gemv_gate_up_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let small = [(1, 8), (37, 24), (70, 136), (5, 520), (19, 1032)];
    let full = [(18432, 7168), (2048, 7168), (1031, 7168), (101, 24)];
    let mut out = Vec::new();
    for p in GemvGateUpSilu::space() {
        out.extend(gemv_sweep(sizes, p.m as usize, &small, &full, |rows, n, k| {
            gate_up_output::<GemvGateUpSilu>(t, &p, gemv::grid(&p, n as u32), rows, n, k, rng)
        })?);
    }
    Ok(out)
}

/// Every candidate of [`GemvSplitGateUpSilu`], swept as [`gemv_split_suite`] sweeps; the full
/// sizes add the shared expert of Kimi K2.6 (2048 x 7168).
pub fn gemv_split_gate_up_suite(
    t: &Target<'_>,
    sizes: Sizes,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    let small = [(1, 8), (3, 24), (5, 1032), (2, 4104)];
    let full = [(2048, 7168), (576, 7168), (7, 7176), (1031, 1536)];
    let mut out = Vec::new();
    for p in GemvSplitGateUpSilu::space() {
        out.extend(gemv_sweep(sizes, p.m as usize, &small, &full, |rows, n, k| {
            gate_up_output::<GemvSplitGateUpSilu>(t, &p, gemv::split_grid(&p, n as u32), rows, n, k, rng)
        })?);
    }
    Ok(out)
}
