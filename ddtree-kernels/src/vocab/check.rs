//! Checks of the vocabulary-parallel kernels against their CPU references, on any [`Target`]
//! (see [`crate::check`]). Both are exact.

use ddtree_codegen::Kernel;
use rand::rngs::StdRng;
use rand::Rng;

use crate::check::*;
use crate::vocab::{self, EmbeddingSlice, EmbeddingSliceParams, RankArgmax, RankArgmaxParams};

/// Checks [`EmbeddingSlice`] for a rank holding `lo..hi` of a `vocab`-row table: ids inside and
/// outside the slice (and past the vocabulary).
pub fn embedding_slice(
    t: &Target<'_>,
    p: &EmbeddingSliceParams,
    tokens: usize,
    vocab: usize,
    slice: std::ops::Range<usize>,
    hidden: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (tab, tf) = random_bf16(rng, slice.len() * hidden, -1.0, 1.0);
    let ids: Vec<u32> = (0..tokens)
        .map(|i| match i % 5 {
            // The slice's edges, and an id past the vocabulary.
            0 if !slice.is_empty() => slice.start as u32,
            1 if !slice.is_empty() => slice.end as u32 - 1,
            2 => (vocab + i) as u32,
            _ => rng.random_range(0..vocab as u32),
        })
        .collect();
    let (dt, di) = (t.upload(&tab)?, t.upload(&ids)?);
    let mut out = poisoned_bf16(t, tokens * hidden)?;
    let mut args = [
        Arg::In(&di),
        Arg::In(&dt),
        Arg::Out(&mut out),
        Arg::from(hidden as u32),
        Arg::from(slice.start as u32),
        Arg::from(slice.end as u32),
    ];
    // SAFETY: the table holds the slice's rows, out tokens * hidden; vec variants need hidden % 8 == 0.
    unsafe { t.launch::<EmbeddingSlice>(p, tokens as u32, &mut args)? };
    let got = to_f32(&t.download(&out)?);
    let want = vocab::embedding_slice_reference(&ids, &tf, hidden, slice.start as u32, slice.end as u32);
    let case = format!("tokens={tokens} vocab={vocab} slice={slice:?} hidden={hidden}");
    Ok(result::<EmbeddingSlice>(p, case, &got, &want, Tolerance::EXACT))
}

/// Checks [`RankArgmax`] on `rows` rows over `world` ranks of slices `slice` wide: random
/// maxima with ties across ranks, and ranks without a candidate (`(-inf, u32::MAX)`).
pub fn rank_argmax(
    t: &Target<'_>,
    p: &RankArgmaxParams,
    rows: usize,
    world: usize,
    slice: u32,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let n = rows * world;
    let mut values = Vec::with_capacity(n);
    let mut indices = Vec::with_capacity(n);
    for i in 0..n {
        let (v, c) = match i % 7 {
            3 => (f32::NEG_INFINITY, u32::MAX),
            // Few distinct values: ties between ranks are common.
            _ => (rng.random_range(0..4) as f32, rng.random_range(0..slice)),
        };
        values.push(v);
        indices.push(c);
    }
    let (dv, di) = (t.upload(&values)?, t.upload(&indices)?);
    let mut out = t.upload(&vec![7u32; rows])?;
    let mut args = [
        Arg::In(&dv),
        Arg::In(&di),
        Arg::Out(&mut out),
        Arg::from(rows as u32),
        Arg::from(world as u32),
        Arg::from(slice),
    ];
    // SAFETY: values and indices hold world * rows entries, out rows; the kernel strides.
    unsafe { t.launch::<RankArgmax>(p, vocab::rank_argmax_grid(p, rows), &mut args)? };
    // Indices compared as f64-exact f32 would lose u32::MAX: compare their halves.
    let split = |v: &[u32]| -> Vec<f32> {
        v.iter()
            .flat_map(|&i| [(i >> 16) as f32, (i & 0xffff) as f32])
            .collect()
    };
    let got = split(&t.download(&out)?);
    let want = split(&vocab::rank_argmax_reference(&values, &indices, rows, world, slice));
    let case = format!("rows={rows} world={world} slice={slice}");
    Ok(result::<RankArgmax>(p, case, &got, &want, Tolerance::EXACT))
}

/// Every candidate of [`EmbeddingSlice`] and [`RankArgmax`] at the sizes of `sizes`.
pub fn vocab_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in EmbeddingSlice::space() {
        // A middle rank, the last (short) rank, an empty slice, a ragged width.
        let mut cases = vec![
            (9, 300, 100..200, 64),
            (5, 300, 296..300, 72),
            (4, 50, 50..50, 64),
            (6, 40, 0..20, 100),
        ];
        if sizes == Sizes::Full {
            cases.push((33, 163840, 61440..81920, 7168));
        }
        for (tokens, v, slice, h) in cases {
            if p.vec && h % 8 != 0 {
                continue;
            }
            out.push(embedding_slice(t, &p, tokens, v, slice, h, rng)?);
        }
    }
    for p in RankArgmax::space() {
        let mut cases = vec![(1, 1, 50), (7, 2, 40), (33, 8, 20480), (5, 3, 1)];
        if sizes == Sizes::Full {
            cases.push((1000, 8, 20480));
        }
        for (rows, world, slice) in cases {
            out.push(rank_argmax(t, &p, rows, world, slice, rng)?);
        }
    }
    Ok(out)
}
