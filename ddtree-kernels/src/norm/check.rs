//! Checks of RMSNorm, the fused residual add + RMSNorm and the residual-stream casts against their
//! CPU references, on any [`Target`] (see [`crate::check`]).

use ddtree_codegen::Kernel;
use half::bf16;
use rand::rngs::StdRng;

use crate::check::*;
use crate::{add, residual, rms_norm, RmsNorm, RmsNormParams};
use crate::{AddRmsNorm, AddRmsNormParams, CastBf16F32, CastF32Bf16, CastParams};

/// Checks RMSNorm.
pub fn rms_norm(
    t: &Target<'_>,
    p: &RmsNormParams,
    rows: usize,
    n: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (x, xf) = random_bf16(rng, rows * n, -2.0, 2.0);
    let (w, wf) = random_bf16(rng, n, 0.5, 1.5);
    let (dx, dw) = (t.upload(&x)?, t.upload(&w)?);
    let mut out = poisoned_bf16(t, rows * n)?;
    let eps = 1e-6f32;
    let mut args = [
        Arg::In(&dx),
        Arg::In(&dw),
        Arg::Out(&mut out),
        Arg::from(n as u32),
        Arg::from(eps),
    ];
    // SAFETY: x and out hold rows * n elements, weight n; vec variants are only run with n % 8 == 0.
    unsafe { t.launch::<RmsNorm>(p, rows as u32, &mut args)? };
    let got = to_f32(&t.download(&out)?);
    Ok(result::<RmsNorm>(
        p,
        format!("rows={rows} n={n}"),
        &got,
        &rms_norm::reference(&xf, &wf, n, eps),
        Tolerance::BF16,
    ))
}

/// Every candidate of [`RmsNorm`] at the sizes of `sizes`.
pub fn rms_norm_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in RmsNorm::space() {
        let mut ns = vec![(1, 64), (3, 136), (5, 1000)];
        if sizes == Sizes::Full {
            ns.extend([(7, 7168), (64, 1536), (33, 512)]);
        }
        for (rows, n) in ns {
            if p.vec && n % 8 != 0 {
                continue;
            }
            out.push(rms_norm(t, &p, rows, n, rng)?);
        }
    }
    Ok(out)
}

/// Checks the fused residual add + RMSNorm on `rows` rows of `n`: `x` random f32 (not
/// bf16-representable), `out` poisoned. The new `x` must equal the f32 sum exactly (with two
/// addends, of `x` and the bf16-rounded sum of `y` and `z`; without addends the input, bit for
/// bit). An addend the variant must not read is a single NaN. `out` is compared with the
/// reference rounded to bf16, within one bf16 step (a rounding that flips with the summation
/// order).
pub fn add_rms_norm(
    t: &Target<'_>,
    p: &AddRmsNormParams,
    rows: usize,
    n: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    let eps = 1e-6f32;
    let x = random_f32(rng, rows * n, -3.0, 3.0);
    let mut addend = |used: bool| {
        if used {
            random_bf16(rng, rows * n, -2.0, 2.0)
        } else {
            (vec![bf16::NAN], vec![])
        }
    };
    let (y, yf) = addend(p.addends > 0);
    let (z, zf) = addend(p.addends == 2);
    let (w, wf) = random_bf16(rng, n, 0.5, 1.5);
    let added: Option<Vec<f32>> = match p.addends {
        0 => None,
        1 => Some(yf),
        _ => Some(
            add::reference(&yf, &zf)
                .into_iter()
                .map(|v| bf16::from_f32(v).to_f32())
                .collect(),
        ),
    };
    let (want_x, want) = residual::reference(&x, added.as_deref(), &wf, n, eps);
    let want: Vec<f32> = want.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    let mut dx = t.upload(&x)?;
    let (dy, dz, dw) = (t.upload(&y)?, t.upload(&z)?, t.upload(&w)?);
    let mut dout = poisoned_bf16(t, rows * n)?;
    let mut args = [
        Arg::Out(&mut dx),
        Arg::In(&dy),
        Arg::In(&dz),
        Arg::In(&dw),
        Arg::Out(&mut dout),
        Arg::from(n as u32),
        Arg::from(eps),
    ];
    // SAFETY: x, out and the addends the variant reads hold rows * n elements, weight n.
    unsafe { t.launch::<AddRmsNorm>(p, rows as u32, &mut args)? };
    let got_x = t.download(&dx)?;
    let got = to_f32(&t.download(&dout)?);
    let case = format!("rows={rows} n={n}");
    let tol = Tolerance {
        rtol: 1.0 / 128.0,
        atol: 1e-6,
        rel_l2: 1e-3,
    };
    // Bit patterns as two exact halves, so the unchanged `x` is compared bit for bit.
    let halves = |v: &[f32]| -> Vec<f32> {
        v.iter()
            .flat_map(|x| [(x.to_bits() >> 16) as f32, (x.to_bits() & 0xffff) as f32])
            .collect()
    };
    Ok(vec![
        result::<AddRmsNorm>(
            p,
            format!("{case} x"),
            &halves(&got_x),
            &halves(&want_x),
            Tolerance::EXACT,
        ),
        result::<AddRmsNorm>(p, format!("{case} out"), &got, &want, tol),
    ])
}

/// Every candidate of [`AddRmsNorm`] at the sizes of `sizes` (rows shorter than a block, rows
/// not a multiple of 8, rows wider than the largest block).
pub fn add_rms_norm_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in AddRmsNorm::space() {
        let mut ns = vec![(1, 64), (2, 7), (3, 136), (4, 1000), (2, 1500), (1, 2056)];
        if sizes == Sizes::Full {
            ns.extend([(1, 7168), (7, 7168), (64, 7168), (33, 512), (3, 7171), (1, 1536)]);
        }
        for (rows, n) in ns {
            if p.hold > 0 && n % 8 != 0 {
                continue;
            }
            out.extend(add_rms_norm(t, &p, rows, n, rng)?);
        }
    }
    Ok(out)
}

/// Elements after `n` in the cast outputs, holding a value the kernel must leave alone.
const CAST_GUARD: usize = 8;

/// Checks the bf16 -> f32 cast over `n` elements on `grid` blocks (`None`: [`residual::grid`]):
/// output poisoned, 8 guard elements after `n` must stay 7.0; exact (infinities included).
pub fn cast_bf16_f32(
    t: &Target<'_>,
    p: &CastParams,
    n: usize,
    grid: Option<u32>,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (mut src, _) = random_bf16(rng, n, -100.0, 100.0);
    for (i, v) in [
        bf16::INFINITY,
        bf16::NEG_INFINITY,
        bf16::NEG_ZERO,
        bf16::MAX,
        bf16::MIN_POSITIVE_SUBNORMAL,
    ]
    .into_iter()
    .enumerate()
    {
        if i * 7 < n {
            src[i * 7] = v;
        }
    }
    let mut dst = vec![f32::NAN; n];
    dst.extend([7.0; CAST_GUARD]);
    let mut want = to_f32(&src);
    want.extend([7.0; CAST_GUARD]);
    let ds = t.upload(&src)?;
    let mut dd = t.upload(&dst)?;
    let grid = grid.unwrap_or_else(|| residual::grid(p, n));
    let mut args = [Arg::In(&ds), Arg::Out(&mut dd), Arg::from(n as u32)];
    // SAFETY: src holds n elements, dst n + 8.
    unsafe { t.launch::<CastBf16F32>(p, grid, &mut args)? };
    let got = t.download(&dd)?;
    Ok(result::<CastBf16F32>(
        p,
        format!("n={n} grid={grid}"),
        &got,
        &want,
        Tolerance::EXACT,
    ))
}

/// Checks the f32 -> bf16 cast over `n` elements on `grid` blocks (`None`: [`residual::grid`]):
/// random f32 plus exact ties (both parities), infinities, signed zero, subnormals and values
/// that round up to infinity; output poisoned, 8 guard elements after `n` must stay 7.0;
/// bit-exact against round to nearest even.
pub fn cast_f32_bf16(
    t: &Target<'_>,
    p: &CastParams,
    n: usize,
    grid: Option<u32>,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let mut src = random_f32(rng, n, -100.0, 100.0);
    let specials = [
        f32::from_bits(0x3f80_8000), // tie, even below: rounds down
        f32::from_bits(0x3f81_8000), // tie, odd below: rounds up
        f32::from_bits(0xbf81_8000),
        f32::from_bits(0x3f80_8001), // just above a tie
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        f32::MAX, // rounds to infinity
        f32::from_bits(0x0000_8000),
        f32::from_bits(0x0001_7fff),
    ];
    for (i, v) in specials.into_iter().enumerate() {
        if i * 3 < n {
            src[i * 3] = v;
        }
    }
    let mut dst = vec![bf16::NAN; n];
    dst.extend([bf16::from_f32(7.0); CAST_GUARD]);
    let ds = t.upload(&src)?;
    let mut dd = t.upload(&dst)?;
    let grid = grid.unwrap_or_else(|| residual::grid(p, n));
    let mut args = [Arg::In(&ds), Arg::Out(&mut dd), Arg::from(n as u32)];
    // SAFETY: src holds n elements, dst n + 8.
    unsafe { t.launch::<CastF32Bf16>(p, grid, &mut args)? };
    // Bit patterns, exact in f32; a NaN (an unwritten element) stays NaN and fails.
    let bits = |v: &[bf16]| -> Vec<f32> {
        v.iter()
            .map(|x| if x.is_nan() { f32::NAN } else { x.to_bits() as f32 })
            .collect()
    };
    let got = bits(&t.download(&dd)?);
    let mut want: Vec<bf16> = src.iter().map(|&v| bf16::from_f32(v)).collect();
    want.extend([bf16::from_f32(7.0); CAST_GUARD]);
    Ok(result::<CastF32Bf16>(
        p,
        format!("n={n} grid={grid}"),
        &got,
        &bits(&want),
        Tolerance::EXACT,
    ))
}

/// Cast cases: `(n, grid)`; one on 2 blocks so threads stride, the full sizes pass the grid cap.
fn cast_cases(sizes: Sizes) -> Vec<(usize, Option<u32>)> {
    let mut cases = vec![(1, None), (37, None), (1000, None), (5001, Some(2))];
    if sizes == Sizes::Full {
        cases.extend([(7168, None), (33 * 7168, None), ((1 << 22) + 3, None)]);
    }
    cases
}

/// Every candidate of [`CastBf16F32`] at the sizes of `sizes`.
pub fn cast_bf16_f32_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in CastBf16F32::space() {
        for (n, grid) in cast_cases(sizes) {
            out.push(cast_bf16_f32(t, &p, n, grid, rng)?);
        }
    }
    Ok(out)
}

/// Every candidate of [`CastF32Bf16`] at the sizes of `sizes`.
pub fn cast_f32_bf16_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in CastF32Bf16::space() {
        for (n, grid) in cast_cases(sizes) {
            out.push(cast_f32_bf16(t, &p, n, grid, rng)?);
        }
    }
    Ok(out)
}
