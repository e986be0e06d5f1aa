//! Checks of the elementwise kernels: SiLU-and-mul, RoPE, the in-place add, row copies and the
//! random fills against their CPU references, on any [`Target`] (see [`crate::check`]).

use ddtree_codegen::Kernel;
use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

use crate::check::*;
use crate::CopyRowsF32;
use crate::{
    add, copy_rows, fill, rope, silu_mul, AddAssign, AddParams, CopyParams, CopyRows, FillParams, FillRandomBf16,
    FillRandomF32, FillRandomU32, RopeInterleaved, RopeParams, SiluMul, SiluMulParams, SiluMulSplit,
};

/// Checks SiLU-and-mul.
pub fn silu_mul(
    t: &Target<'_>,
    p: &SiluMulParams,
    rows: usize,
    d: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (x, xf) = random_bf16(rng, rows * 2 * d, -4.0, 4.0);
    let dx = t.upload(&x)?;
    let mut out = poisoned_bf16(t, rows * d)?;
    let grid = silu_mul::grid(p, rows, d);
    let mut args = [
        Arg::In(&dx),
        Arg::Out(&mut out),
        Arg::from(rows as u32),
        Arg::from(d as u32),
    ];
    // SAFETY: gate_up holds rows * 2d elements and out rows * d; vec variants need d % 8 == 0.
    unsafe { t.launch::<SiluMul>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&out)?);
    Ok(result::<SiluMul>(
        p,
        format!("rows={rows} d={d}"),
        &got,
        &silu_mul::reference(&xf, d),
        Tolerance::BF16,
    ))
}

/// Checks SiLU-and-mul of separate gate and up buffers over `n` elements, on `grid` blocks
/// (`None`: [`silu_mul::grid_split`]; fewer blocks make the threads stride).
pub fn silu_mul_split(
    t: &Target<'_>,
    p: &SiluMulParams,
    n: usize,
    grid: Option<u32>,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (g, gf) = random_bf16(rng, n, -8.0, 8.0);
    let (u, uf) = random_bf16(rng, n, -4.0, 4.0);
    let (dg, du) = (t.upload(&g)?, t.upload(&u)?);
    let mut out = poisoned_bf16(t, n)?;
    let grid = grid.unwrap_or_else(|| silu_mul::grid_split(p, n));
    let mut args = [Arg::In(&dg), Arg::In(&du), Arg::Out(&mut out), Arg::from(n as u32)];
    // SAFETY: gate, up and out hold n elements; vec variants need n % 8 == 0.
    unsafe { t.launch::<SiluMulSplit>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&out)?);
    Ok(result::<SiluMulSplit>(
        p,
        format!("n={n} grid={grid}"),
        &got,
        &silu_mul::reference_split(&gf, &uf),
        Tolerance::BF16,
    ))
}

/// Checks RoPE (in place, in the pair layout of `p`).
#[allow(clippy::too_many_arguments)]
pub fn rope(
    t: &Target<'_>,
    p: &RopeParams,
    tokens: usize,
    heads: usize,
    stride: usize,
    offset: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (dim, half, max_pos) = (p.dim as usize, p.dim as usize / 2, 4096usize);
    let (x, mut xf) = random_bf16(rng, tokens * heads * stride, -2.0, 2.0);
    let positions: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..max_pos as u32)).collect();
    let angles: Vec<f32> = (0..max_pos * half)
        .map(|i| (i / half) as f32 * 10000f32.powf(-2.0 * (i % half) as f32 / dim as f32))
        .collect();
    let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
    let mut dx = t.upload(&x)?;
    let (dp, dc, ds) = (t.upload(&positions)?, t.upload(&cos)?, t.upload(&sin)?);
    let rows = tokens * heads;
    let grid = rope::grid(p, rows);
    let mut args = [
        Arg::Out(&mut dx),
        Arg::In(&dp),
        Arg::In(&dc),
        Arg::In(&ds),
        Arg::from(rows as u32),
        Arg::from(heads as u32),
        Arg::from(stride as u32),
        Arg::from(offset as u32),
    ];
    // SAFETY: x holds rows * stride elements with offset + dim <= stride; tables hold max_pos * dim/2.
    unsafe { t.launch::<RopeInterleaved>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&dx)?);
    rope::reference(
        &mut xf,
        &positions,
        &cos,
        &sin,
        heads,
        stride,
        offset,
        dim,
        p.interleave,
    );
    let case = format!("tokens={tokens} heads={heads} stride={stride} offset={offset}");
    Ok(result::<RopeInterleaved>(p, case, &got, &xf, Tolerance::BF16))
}

/// Checks the in-place add over `n` elements on `grid` blocks (`None`: [`add::grid`]; fewer
/// blocks make the threads stride). `y` is at least 0.5 in magnitude, so an element the kernel
/// skips keeps a value that fails the comparison; 8 guard elements after `n` (1.0 in both
/// buffers) must stay 1.0. The reference is the f32 sum rounded to bf16 (nearest even), exact.
pub fn add_assign(
    t: &Target<'_>,
    p: &AddParams,
    n: usize,
    grid: Option<u32>,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    const GUARD: usize = 8;
    let (mut x, mut xf) = random_bf16(rng, n, -2.0, 2.0);
    let (mut y, mut yf) = random_bf16(rng, n, 0.5, 2.0);
    for (h, f) in y.iter_mut().zip(yf.iter_mut()) {
        if rng.random_bool(0.5) {
            *h = -*h;
            *f = -*f;
        }
    }
    x.extend([bf16::ONE; GUARD]);
    y.extend([bf16::ONE; GUARD]);
    xf.extend([1.0; GUARD]);
    let mut dx = t.upload(&x)?;
    let dy = t.upload(&y)?;
    let grid = grid.unwrap_or_else(|| add::grid(p, n as u32));
    let mut args = [Arg::Out(&mut dx), Arg::In(&dy), Arg::from(n as u32)];
    // SAFETY: x and y hold n + 8 elements; vec variants need n % 8 == 0.
    unsafe { t.launch::<AddAssign>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&dx)?);
    let mut want: Vec<f32> = add::reference(&xf[..n], &yf)
        .into_iter()
        .map(|v| bf16::from_f32(v).to_f32())
        .collect();
    want.extend(&xf[n..]);
    Ok(result::<AddAssign>(
        p,
        format!("n={n} grid={grid}"),
        &got,
        &want,
        Tolerance::EXACT,
    ))
}

/// One [`copy_rows`] case: `rows` rows of `cols` columns gathered from a `src_rows` x
/// `src_stride` source at column `src_off` into a `rows` x `dst_stride` destination at column
/// `dst_off`.
#[derive(Clone, Copy, Debug)]
pub struct CopyCase {
    /// Rows copied (the grid).
    pub rows: usize,
    /// Columns per row.
    pub cols: usize,
    /// Rows of the source.
    pub src_rows: usize,
    /// Source row stride.
    pub src_stride: usize,
    /// Source column offset.
    pub src_off: usize,
    /// Destination row stride.
    pub dst_stride: usize,
    /// Destination column offset.
    pub dst_off: usize,
}

/// Checks a row copy kernel `K` (bf16 [`CopyRows`] or f32 [`CopyRowsF32`]) on `src` / `dst`
/// data: random row indices (repeats included), the copied region of `dst` poisoned with NaN
/// and the rest left random (it must come back unchanged); exact.
fn copy_rows_check<T: Elem + Copy, K: Kernel<Params = CopyParams>>(
    t: &Target<'_>,
    p: &CopyParams,
    c: CopyCase,
    (src, mut dst): (Vec<T>, Vec<T>),
    nan: T,
    to_f32: fn(&[T]) -> Vec<f32>,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let mut want = dst.clone();
    // One spare index: the idx buffer is never empty.
    let idx: Vec<u32> = (0..c.rows + 1)
        .map(|_| rng.random_range(0..c.src_rows as u32))
        .collect();
    copy_rows::reference(
        &src,
        &idx[..c.rows],
        &mut want,
        c.cols,
        c.src_stride,
        c.src_off,
        c.dst_stride,
        c.dst_off,
    );
    let nans = vec![nan; c.cols];
    copy_rows::reference(&nans, &vec![0; c.rows], &mut dst, c.cols, 0, 0, c.dst_stride, c.dst_off);
    let (ds, di) = (t.upload(&src)?, t.upload(&idx)?);
    let mut dd = t.upload(&dst)?;
    let mut args = [
        Arg::In(&ds),
        Arg::In(&di),
        Arg::Out(&mut dd),
        Arg::from(c.rows as u32),
        Arg::from(c.cols as u32),
        Arg::from(c.src_stride as u32),
        Arg::from(c.src_off as u32),
        Arg::from(c.dst_stride as u32),
        Arg::from(c.dst_off as u32),
    ];
    // SAFETY: indices are below src_rows; src_off + cols <= src_stride and dst_off + cols <=
    // dst_stride (the suite's cases); dst holds rows * dst_stride elements.
    unsafe { t.launch::<K>(p, copy_rows::grid(c.rows as u32), &mut args)? };
    let got = to_f32(&t.download(&dd)?);
    let case = format!(
        "rows={} cols={} src={}x{}+{} dst_stride={} dst_off={}",
        c.rows, c.cols, c.src_rows, c.src_stride, c.src_off, c.dst_stride, c.dst_off
    );
    Ok(result::<K>(p, case, &got, &to_f32(&want), Tolerance::EXACT))
}

/// Checks [`CopyRows`] on random bf16 data ([`copy_rows_check`]).
pub fn copy_rows(t: &Target<'_>, p: &CopyParams, c: CopyCase, rng: &mut StdRng) -> Result<CheckResult, CheckError> {
    let (src, _) = random_bf16(rng, c.src_rows * c.src_stride, -4.0, 4.0);
    let (dst, _) = random_bf16(rng, c.rows * c.dst_stride, -4.0, 4.0);
    copy_rows_check::<bf16, CopyRows>(t, p, c, (src, dst), bf16::NAN, to_f32, rng)
}

/// Every candidate of [`SiluMul`] at the sizes of `sizes`.
pub fn silu_mul_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in SiluMul::space() {
        let mut ds = vec![(1, 64), (3, 200), (7, 37)];
        if sizes == Sizes::Full {
            ds.extend([(16, 2048), (9, 18432)]);
        }
        for (rows, d) in ds {
            if p.vec && d % 8 != 0 {
                continue;
            }
            out.push(silu_mul(t, &p, rows, d, rng)?);
        }
    }
    Ok(out)
}

/// Every candidate of [`SiluMulSplit`] at the sizes of `sizes` (one case on 2 blocks, so
/// threads stride).
pub fn silu_mul_split_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in SiluMulSplit::space() {
        let mut cases = vec![(8, None), (600, None), (37, None), (5000, Some(2))];
        if sizes == Sizes::Full {
            cases.extend([(16 * 2048, None), (9 * 18432, None), ((1 << 22) + 8, None)]);
        }
        for (n, grid) in cases {
            if p.vec && n % 8 != 0 {
                continue;
            }
            out.push(silu_mul_split(t, &p, n, grid, rng)?);
        }
    }
    Ok(out)
}

/// Every candidate of [`RopeInterleaved`] at the sizes of `sizes`.
pub fn rope_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in RopeInterleaved::space() {
        let dim = p.dim as usize;
        // (tokens, heads, stride, offset): q rows [tokens, heads, 128 + dim] with rope last, and
        // k_pe rows [tokens, 1, 512 + dim].
        let mut cases = vec![(1, 1, dim, 0), (3, 4, 128 + dim, 128), (5, 1, 512 + dim, 512)];
        if sizes == Sizes::Full {
            cases.extend([(17, 64, 128 + dim, 128), (64, 1, 512 + dim, 512)]);
        }
        for (tk, h, st, off) in cases {
            out.push(rope(t, &p, tk, h, st, off, rng)?);
        }
    }
    Ok(out)
}

/// Every candidate of [`AddAssign`] at the sizes of `sizes` (one case on 2 blocks, so threads
/// stride; the full sizes pass the grid cap).
pub fn add_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in AddAssign::space() {
        let mut cases = vec![(8, None), (1000, None), (37, None), (5000, Some(2))];
        if sizes == Sizes::Full {
            cases.extend([(7168, None), (33 * 7168, None), ((1 << 22) + 8, None)]);
        }
        for (n, grid) in cases {
            if p.vec && n % 8 != 0 {
                continue;
            }
            out.push(add_assign(t, &p, n, grid, rng)?);
        }
    }
    Ok(out)
}

/// Every candidate of [`CopyRows`] at the sizes of `sizes`: a row gather, a column block into a
/// wider row, strided head copies (ragged offsets), rows wider than a block, and no rows.
pub fn copy_rows_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in CopyRows::space() {
        for c in copy_cases(sizes) {
            out.push(copy_rows(t, &p, c, rng)?);
        }
    }
    Ok(out)
}

/// The cases of [`copy_rows_suite`] and [`copy_rows_f32_suite`].
fn copy_cases(sizes: Sizes) -> Vec<CopyCase> {
    let case = |rows, cols, src_rows, src_stride, src_off, dst_stride, dst_off| CopyCase {
        rows,
        cols,
        src_rows,
        src_stride,
        src_off,
        dst_stride,
        dst_off,
    };
    let mut cases = vec![
        case(5, 72, 9, 72, 0, 72, 0),
        case(3, 100, 3, 100, 0, 164, 64),
        case(7, 16, 7, 576, 512, 24, 3),
        case(2, 1100, 4, 1103, 3, 1100, 0),
        case(0, 8, 1, 8, 0, 8, 0),
    ];
    if sizes == Sizes::Full {
        cases.extend([
            case(64, 7168, 1024, 7168, 0, 7168, 0),
            case(17 * 64, 64, 17 * 64, 192, 128, 576, 512),
        ]);
    }
    cases
}

/// Checks the three random fills at `n` elements on `grid` blocks (`None`: [`fill::grid`]),
/// outputs poisoned, bit-exact against [`fill::reference_bf16`] / [`fill::reference_f32`] /
/// [`fill::reference_u32`] (a word is compared as its two 16-bit halves, exact in f32).
pub fn fills(
    t: &Target<'_>,
    p: &FillParams,
    n: usize,
    grid: Option<u32>,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    let seed: u32 = rng.random();
    let (lo, hi) = (-3.0f32, 5.0f32);
    let grid = grid.unwrap_or_else(|| fill::grid(p, n));
    let case = format!("n={n} grid={grid} seed={seed}");
    let mut b = poisoned_bf16(t, n)?;
    let mut args = [
        Arg::Out(&mut b),
        Arg::from(n as u32),
        Arg::from(seed),
        Arg::from(lo),
        Arg::from(hi),
    ];
    // SAFETY: out holds n elements.
    unsafe { t.launch::<FillRandomBf16>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&b)?);
    let want = to_f32(&fill::reference_bf16(n, seed, lo, hi));
    let mut out = vec![result::<FillRandomBf16>(p, case.clone(), &got, &want, Tolerance::EXACT)];

    let mut f = t.upload(&vec![f32::NAN; n])?;
    let mut args = [
        Arg::Out(&mut f),
        Arg::from(n as u32),
        Arg::from(seed),
        Arg::from(lo),
        Arg::from(hi),
    ];
    // SAFETY: out holds n elements.
    unsafe { t.launch::<FillRandomF32>(p, grid, &mut args)? };
    let got = t.download(&f)?;
    let want = fill::reference_f32(n, seed, lo, hi);
    out.push(result::<FillRandomF32>(p, case.clone(), &got, &want, Tolerance::EXACT));

    // Poison: a word the hash gives for no element near (u32::MAX is as good as any).
    let mut w = t.upload(&vec![u32::MAX; n])?;
    let mut args = [Arg::Out(&mut w), Arg::from(n as u32), Arg::from(seed)];
    // SAFETY: out holds n elements.
    unsafe { t.launch::<FillRandomU32>(p, grid, &mut args)? };
    let halves = |v: &[u32]| -> Vec<f32> { v.iter().flat_map(|x| [(x >> 16) as f32, (x & 0xffff) as f32]).collect() };
    let got = halves(&t.download(&w)?);
    let want = halves(&fill::reference_u32(n, seed));
    out.push(result::<FillRandomU32>(p, case, &got, &want, Tolerance::EXACT));
    Ok(out)
}

/// Every candidate of the fill kernels at the sizes of `sizes` (one case on 2 blocks, so
/// threads stride; the full sizes pass the grid cap).
pub fn fill_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut cases = vec![(1, None), (1000, None), (4099, Some(2))];
    if sizes == Sizes::Full {
        cases.extend([(1 << 20, None), ((1 << 24) + 3, None)]);
    }
    let mut out = Vec::new();
    for p in FillRandomU32::space() {
        for &(n, grid) in &cases {
            out.extend(fills(t, &p, n, grid, rng)?);
        }
    }
    Ok(out)
}
/// Checks [`CopyRowsF32`] on random f32 data (not bf16-representable): bit-exact.
pub fn copy_rows_f32(t: &Target<'_>, p: &CopyParams, c: CopyCase, rng: &mut StdRng) -> Result<CheckResult, CheckError> {
    let src = random_f32(rng, c.src_rows * c.src_stride, -4.0, 4.0);
    let dst = random_f32(rng, c.rows * c.dst_stride, -4.0, 4.0);
    copy_rows_check::<f32, CopyRowsF32>(t, p, c, (src, dst), f32::NAN, <[f32]>::to_vec, rng)
}

/// Every candidate of [`CopyRowsF32`] at the cases of [`copy_rows_suite`].
pub fn copy_rows_f32_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in CopyRowsF32::space() {
        for c in copy_cases(sizes) {
            out.push(copy_rows_f32(t, &p, c, rng)?);
        }
    }
    Ok(out)
}
