//! Checks of the embedding gather against their CPU references, on any [`Target`] (see
//! [`crate::check`]).

use ddtree_codegen::Kernel;
use rand::rngs::StdRng;
use rand::Rng;

use crate::check::*;
use crate::{embedding, Embedding, EmbeddingParams};

/// Checks the embedding gather (some ids out of range on purpose).
pub fn embedding(
    t: &Target<'_>,
    p: &EmbeddingParams,
    tokens: usize,
    vocab: usize,
    hidden: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (tab, tf) = random_bf16(rng, vocab * hidden, -1.0, 1.0);
    let ids: Vec<u32> = (0..tokens)
        .map(|i| {
            if i % 7 == 3 {
                vocab as u32 + i as u32
            } else {
                rng.random_range(0..vocab as u32)
            }
        })
        .collect();
    let (dt, di) = (t.upload(&tab)?, t.upload(&ids)?);
    let mut out = poisoned_bf16(t, tokens * hidden)?;
    let mut args = [
        Arg::In(&di),
        Arg::In(&dt),
        Arg::Out(&mut out),
        Arg::from(hidden as u32),
        Arg::from(vocab as u32),
    ];
    // SAFETY: table holds vocab * hidden elements, out tokens * hidden; vec variants need hidden % 8 == 0.
    unsafe { t.launch::<Embedding>(p, tokens as u32, &mut args)? };
    let got = to_f32(&t.download(&out)?);
    let case = format!("tokens={tokens} vocab={vocab} hidden={hidden}");
    Ok(result::<Embedding>(
        p,
        case,
        &got,
        &embedding::reference(&ids, &tf, hidden),
        Tolerance::EXACT,
    ))
}

/// Every candidate of [`Embedding`] at the sizes of `sizes`.
pub fn embedding_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in Embedding::space() {
        let mut cases = vec![(1, 50, 64), (9, 300, 72), (5, 40, 100)];
        if sizes == Sizes::Full {
            cases.push((33, 163840, 7168));
        }
        for (tk, v, h) in cases {
            if p.vec && h % 8 != 0 {
                continue;
            }
            out.push(embedding(t, &p, tk, v, h, rng)?);
        }
    }
    Ok(out)
}
