//! Checks of row top-k, one block per row and split against their CPU references, on any [`Target`]
//! (see [`crate::check`]).

use ddtree_codegen::Kernel;
use rand::rngs::StdRng;
use rand::Rng;

use crate::check::*;
use crate::{topk, RowTopk, RowTopkSplit, TopkParams, TopkSplitParams};

/// Checks row top-k (rows seeded with repeated values to exercise the tie rule).
pub fn topk(
    t: &Target<'_>,
    p: &TopkParams,
    rows: usize,
    n: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let mut logits: Vec<f32> = (0..rows * n).map(|_| rng.random_range(-20.0f32..20.0)).collect();
    for r in 0..rows {
        // A few exact ties at the top, at random places.
        let top = 25.0 + r as f32;
        for _ in 0..3 {
            logits[r * n + rng.random_range(0..n)] = top;
        }
    }
    topk_rows(t, p, &logits, n, format!("rows={rows} n={n}"))
}

/// Rows of `n` logits made of ties, row `r` by `r % 4`: (0) every value `±0.0` (all equal);
/// (1) the maximum at every third column from a random start, random smaller values between,
/// a few NaN; (2) every value `-inf` but a few NaN; (3) the maximum in the last `min(n, 40)`
/// columns and at a few random places. NaN never lands in column 0 (the engine's CPU argmax
/// returns 0 for a row starting with NaN, see [`topk::reference`]).
pub fn tie_rows(rows: usize, n: usize, rng: &mut StdRng) -> Vec<f32> {
    let mut logits = vec![0f32; rows * n];
    for (r, row) in logits.chunks_mut(n).enumerate() {
        let top = 3.0 + r as f32;
        match r % 4 {
            0 => row
                .iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = if i % 2 == 1 { -0.0 } else { 0.0 }),
            1 => {
                let start = rng.random_range(0..3);
                for (i, v) in row.iter_mut().enumerate() {
                    *v = if i % 3 == start {
                        top
                    } else {
                        rng.random_range(-20.0..top - 0.5)
                    };
                }
            }
            2 => row.fill(f32::NEG_INFINITY),
            _ => {
                for v in row.iter_mut() {
                    *v = rng.random_range(-20.0..top - 0.5);
                }
                let tail = n.min(40);
                row[n - tail..].fill(top);
                for _ in 0..8 {
                    row[rng.random_range(0..n)] = top;
                }
            }
        }
        if r % 4 != 0 && n > 1 {
            for _ in 0..3.min(n / 8) {
                row[rng.random_range(1..n)] = f32::NAN;
            }
        }
    }
    logits
}

/// Checks row top-k on [`tie_rows`]: equal values must come back lowest column first.
pub fn topk_ties(
    t: &Target<'_>,
    p: &TopkParams,
    rows: usize,
    n: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let logits = tie_rows(rows, n, rng);
    topk_rows(t, p, &logits, n, format!("ties rows={rows} n={n}"))
}

/// Row top-k of `logits` (`[rows, n]`) against [`topk::reference`], values and indices exact.
fn topk_rows(
    t: &Target<'_>,
    p: &TopkParams,
    logits: &[f32],
    n: usize,
    case: String,
) -> Result<CheckResult, CheckError> {
    let kk = p.k as usize;
    let rows = logits.len() / n;
    let dl = t.upload(logits)?;
    let mut vals = t.upload(&vec![f32::NAN; rows * kk])?;
    let mut idx = t.upload(&vec![u32::MAX; rows * kk])?;
    let mut args = [
        Arg::In(&dl),
        Arg::Out(&mut vals),
        Arg::Out(&mut idx),
        Arg::from(n as u32),
    ];
    // SAFETY: logits hold rows * n values with n >= k; outputs hold rows * k.
    unsafe { t.launch::<RowTopk>(p, rows as u32, &mut args)? };
    let (gv, gi) = (t.download(&vals)?, t.download(&idx)?);
    let want = topk::reference(logits, n, kk);
    // Compare values and indices as one exact vector.
    let got: Vec<f32> = gv.iter().zip(&gi).flat_map(|(v, i)| [*v, *i as f32]).collect();
    let want: Vec<f32> = want.iter().flat_map(|(v, i)| [*v, *i as f32]).collect();
    Ok(result::<RowTopk>(p, case, &got, &want, Tolerance::EXACT))
}

/// Checks the split row top-k (part pass `part`, then the merge variant for the same `k`) on
/// fresh rows with exact ties at the top (in one slice and across slices) and a NaN in every
/// row; candidates and outputs are poisoned before the launches.
pub fn topk_split(
    t: &Target<'_>,
    part: &TopkSplitParams,
    rows: usize,
    n: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let kk = part.k as usize;
    let mut logits: Vec<f32> = (0..rows * n).map(|_| rng.random_range(-20.0f32..20.0)).collect();
    for r in 0..rows {
        let row = &mut logits[r * n..(r + 1) * n];
        let top = 25.0 + r as f32;
        // Exact ties: two neighbours (one slice, usually two threads), one a block further
        // on (the same thread's next item), then more at random places.
        let at = rng.random_range(0..n - 1);
        row[at] = top;
        row[at + 1] = top;
        row[(at + part.block as usize).min(n - 1)] = top;
        for _ in 0..kk.max(3) {
            row[rng.random_range(0..n)] = top;
        }
        row[rng.random_range(0..n)] = f32::NAN;
    }
    topk_split_rows(t, part, &logits, n, "")
}

/// Checks the split row top-k (as [`topk_split`]) on [`tie_rows`]: equal values must come back
/// lowest column first, within a slice and across slices.
pub fn topk_split_ties(
    t: &Target<'_>,
    part: &TopkSplitParams,
    rows: usize,
    n: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let logits = tie_rows(rows, n, rng);
    topk_split_rows(t, part, &logits, n, "ties ")
}

/// The split row top-k (part pass `part`, then the merge variant for its `k`) of `logits`
/// (`[rows, n]`) against [`topk::reference`], exact; candidates and outputs poisoned.
fn topk_split_rows(
    t: &Target<'_>,
    part: &TopkSplitParams,
    logits: &[f32],
    n: usize,
    label: &str,
) -> Result<CheckResult, CheckError> {
    let merge = TopkSplitParams::merge(part.k)
        .ok_or_else(|| CheckError::Args(format!("no merge variant for k = {}", part.k)))?;
    let kk = part.k as usize;
    let parts = part.parts(n);
    let rows = logits.len() / n;
    let dl = t.upload(logits)?;
    let mut cv = t.upload(&vec![f32::NAN; rows * parts * kk])?;
    let mut ci = t.upload(&vec![u32::MAX - 1; rows * parts * kk])?;
    let mut vals = t.upload(&vec![f32::NAN; rows * kk])?;
    let mut idx = t.upload(&vec![u32::MAX - 1; rows * kk])?;
    {
        let mut args = [
            Arg::In(&dl),
            Arg::In(&idx),
            Arg::Out(&mut cv),
            Arg::Out(&mut ci),
            Arg::from(n as u32),
        ];
        // SAFETY: logits hold rows * n values; the candidates rows * parts * k; ids is unused.
        unsafe { t.launch::<RowTopkSplit>(part, (parts as u32, rows as u32), &mut args)? };
    }
    let mut args = [
        Arg::In(&cv),
        Arg::In(&ci),
        Arg::Out(&mut vals),
        Arg::Out(&mut idx),
        Arg::from((parts * kk) as u32),
    ];
    // SAFETY: the candidates hold rows * parts * k entries; the outputs rows * k.
    unsafe { t.launch::<RowTopkSplit>(&merge, (1u32, rows as u32), &mut args)? };
    let (gv, gi) = (t.download(&vals)?, t.download(&idx)?);
    let want = topk::reference(logits, n, kk);
    let got: Vec<f32> = gv.iter().zip(&gi).flat_map(|(v, i)| [*v, *i as f32]).collect();
    let want: Vec<f32> = want.iter().flat_map(|(v, i)| [*v, *i as f32]).collect();
    let mut r = result::<RowTopkSplit>(
        part,
        format!("{label}rows={rows} n={n} parts={parts}"),
        &got,
        &want,
        Tolerance::EXACT,
    );
    r.symbol = format!("{} + {}", r.symbol, RowTopkSplit::symbol(&merge));
    Ok(r)
}

/// Every candidate of [`RowTopk`] at the sizes of `sizes`.
pub fn topk_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in RowTopk::space() {
        let mut cases = vec![(1, 100), (3, 1000), (2, 4099)];
        if sizes == Sizes::Full {
            cases.extend([(4, 163840), (17, 163840)]);
        }
        for (rows, n) in cases {
            if n < p.k as usize {
                continue;
            }
            out.push(topk(t, &p, rows, n, rng)?);
        }
        // Rows of ties (every pattern of `tie_rows` at least once).
        let mut ties = vec![(4, 97), (4, 1000)];
        if sizes == Sizes::Full {
            ties.push((8, 163840));
        }
        for (rows, n) in ties {
            if n >= p.k as usize + 3 {
                out.push(topk_ties(t, &p, rows, n, rng)?);
            }
        }
    }
    Ok(out)
}

/// Every part variant of [`RowTopkSplit`], each with the merge variant of its `k`, at the sizes
/// of `sizes` (ragged last slices, slices shorter than `k`, the decode rows of a 163840 vocabulary).
pub fn topk_split_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in RowTopkSplit::space().into_iter().filter(|p| !p.merge) {
        let span = p.span();
        let mut cases = vec![(1, 100), (3, span + 1), (2, 2 * span + p.k as usize / 2 + 1)];
        if sizes == Sizes::Full {
            cases.extend([(1, 163840), (4, 163840), (16, 163840), (31, 163840), (5, 100_003)]);
        }
        for (rows, n) in cases {
            if n < p.k as usize {
                continue;
            }
            out.push(topk_split(t, &p, rows, n, rng)?);
        }
        // Rows of ties, within one slice and across several (ragged last slice).
        let mut ties = vec![(4, 97), (4, 2 * span + 5)];
        if sizes == Sizes::Full {
            ties.push((8, 163840));
        }
        for (rows, n) in ties {
            if n >= p.k as usize + 3 {
                out.push(topk_split_ties(t, &p, rows, n, rng)?);
            }
        }
    }
    Ok(out)
}
