//! Checks of MoE routing against their CPU references, on any [`Target`] (see [`crate::check`]).

use ddtree_codegen::Kernel;
use rand::rngs::StdRng;
use rand::Rng;

use crate::check::*;
use crate::moe_route::localize::{self, MoeLocalizeParams};
use crate::{moe_route, MoeLocalize, MoeRoute, MoeRouteParams};

/// One [`moe_route`] problem: tokens, experts, top-k, groups, kept groups, normalization,
/// scale, and whether the bias is all negative (kept experts then lose to dropped ones, whose
/// choices are 0.0).
#[derive(Clone, Copy, Debug)]
pub struct RouteCase {
    /// Tokens (blocks).
    pub tokens: usize,
    /// Routed experts.
    pub experts: usize,
    /// Experts chosen per token.
    pub topk: usize,
    /// Expert groups (1 = no group stage).
    pub n_group: usize,
    /// Groups kept.
    pub topk_group: usize,
    /// Normalize the weights to sum 1 before the scale.
    pub norm: bool,
    /// Routed scaling factor.
    pub scale: f32,
    /// Every bias negative.
    pub negative_bias: bool,
}

/// Checks MoE routing. Logits lie on a grid of 1/16 in `[-4, 4]` and the bias takes the values
/// -2, 0 and 2 (all -2 with `negative_bias`), so equal choices are exact ties (the lower index
/// must win) and unequal ones differ by far more than a last-ulp difference of `exp` between
/// the GPU and the CPU. Ids must match exactly, weights to 1e-5.
pub fn moe_route(
    t: &Target<'_>,
    p: &MoeRouteParams,
    c: RouteCase,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let logits: Vec<f32> = (0..c.tokens * c.experts)
        .map(|_| rng.random_range(-64i32..=64) as f32 / 16.0)
        .collect();
    let bias: Vec<f32> = (0..c.experts)
        .map(|_| {
            if c.negative_bias {
                -2.0
            } else {
                2.0 * rng.random_range(-1i32..=1) as f32
            }
        })
        .collect();
    let (dl, db) = (t.upload(&logits)?, t.upload(&bias)?);
    let mut ids = t.upload(&vec![u32::MAX; c.tokens * c.topk])?;
    let mut weights = t.upload(&vec![f32::NAN; c.tokens * c.topk])?;
    let mut args = [
        Arg::In(&dl),
        Arg::In(&db),
        Arg::Out(&mut ids),
        Arg::Out(&mut weights),
        Arg::from(c.experts as u32),
        Arg::from(c.topk as u32),
        Arg::from(c.n_group as u32),
        Arg::from(c.topk_group as u32),
        Arg::from(c.norm as u32),
        Arg::from(c.scale),
    ];
    // SAFETY: logits hold tokens * experts values, bias experts, the outputs tokens * topk;
    // experts <= 1024, topk <= 16, and the group sizes divide the experts.
    unsafe { t.launch::<MoeRoute>(p, c.tokens as u32, &mut args)? };
    let (gi, gw) = (t.download(&ids)?, t.download(&weights)?);
    let (wi, ww) = moe_route::reference(
        &logits,
        &bias,
        c.experts,
        c.topk,
        c.n_group,
        c.topk_group,
        c.norm,
        c.scale,
    );
    // Ids as f32 (exact below 2^24; a wrong id is off by at least 1, beyond the tolerance).
    let got: Vec<f32> = gi.iter().map(|&i| i as f32).chain(gw).collect();
    let want: Vec<f32> = wi.iter().map(|&i| i as f32).chain(ww).collect();
    let tol = Tolerance {
        rtol: 1e-5,
        atol: 1e-6,
        rel_l2: 1e-5,
    };
    let case = format!(
        "tokens={} experts={} topk={} groups={}/{} norm={} scale={}{}",
        c.tokens,
        c.experts,
        c.topk,
        c.topk_group,
        c.n_group,
        c.norm,
        c.scale,
        if c.negative_bias { " negative bias" } else { "" }
    );
    Ok(result::<MoeRoute>(p, case, &got, &want, tol))
}

/// Every candidate of [`MoeRoute`] at the sizes of `sizes`.
pub fn moe_route_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let case = |tokens, experts, topk, n_group, topk_group, norm, scale, negative_bias| RouteCase {
        tokens,
        experts,
        topk,
        n_group,
        topk_group,
        norm,
        scale,
        negative_bias,
    };
    // The bench slice (48), Kimi (384, no groups), DeepSeek-V3-like groups, groups of one and
    // two experts, all-negative bias (dropped groups win), 1000 experts, top-16.
    let mut cases = vec![
        case(3, 48, 6, 1, 1, true, 2.5, false),
        case(2, 384, 8, 1, 1, true, 2.827, false),
        case(4, 64, 8, 8, 4, true, 2.5, false),
        case(3, 96, 8, 4, 2, false, 1.0, true),
        case(2, 40, 4, 20, 5, true, 1.0, false),
        case(2, 8, 2, 8, 3, false, 1.5, false),
        case(2, 1000, 16, 8, 3, true, 1.5, false),
    ];
    if sizes == Sizes::Full {
        cases.extend([
            case(64, 384, 8, 1, 1, true, 2.827, false),
            case(256, 256, 8, 8, 4, true, 2.5, false),
            case(33, 1024, 16, 32, 8, true, 1.0, false),
            case(17, 160, 6, 8, 3, false, 16.0, true),
        ]);
    }
    let mut out = Vec::new();
    for p in MoeRoute::space() {
        for &c in &cases {
            out.push(moe_route(t, &p, c, rng)?);
        }
    }
    // One rank of EP8 Kimi (48 of 384 experts), the first and last ranks, a rank with every
    // expert, one with none, and more choices than one block's grid-stride covers.
    let mut local = vec![
        (3 * 8, 384, 48..96),
        (5, 16, 0..4),
        (7, 16, 12..16),
        (2, 8, 0..8),
        (2, 8, 3..3),
    ];
    if sizes == Sizes::Full {
        local.push((4099, 8, 48..96));
    }
    for p in MoeLocalize::space() {
        for (tokens, experts, range) in local.clone() {
            out.push(moe_localize(t, &p, tokens * 8, experts, range, rng)?);
        }
    }
    Ok(out)
}

/// Checks [`MoeLocalize`] on `choices` random expert ids below `experts` (and their weights),
/// keeping the rank's `local` experts. Exact.
pub fn moe_localize(
    t: &Target<'_>,
    p: &MoeLocalizeParams,
    choices: usize,
    experts: usize,
    local: std::ops::Range<usize>,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let ids: Vec<u32> = (0..choices).map(|_| rng.random_range(0..experts as u32)).collect();
    let weights: Vec<f32> = (0..choices).map(|_| rng.random_range(0.01f32..3.0)).collect();
    let (mut di, mut dw) = (t.upload(&ids)?, t.upload(&weights)?);
    let (lo, hi) = (local.start as u32, local.end as u32);
    let mut args = [
        Arg::Out(&mut di),
        Arg::Out(&mut dw),
        Arg::from(choices as u32),
        Arg::from(lo),
        Arg::from(hi),
    ];
    // SAFETY: both buffers hold `choices` values; the kernel strides over them.
    unsafe { t.launch::<MoeLocalize>(p, localize::grid(p, choices), &mut args)? };
    let (gi, gw) = (t.download(&di)?, t.download(&dw)?);
    let (wi, ww) = localize::reference(&ids, &weights, lo, hi);
    let got: Vec<f32> = gi.iter().map(|&i| i as f32).chain(gw).collect();
    let want: Vec<f32> = wi.iter().map(|&i| i as f32).chain(ww).collect();
    let tol = Tolerance {
        rtol: 0.0,
        atol: 0.0,
        rel_l2: 0.0,
    };
    let case = format!("choices={choices} experts={experts} local={local:?}");
    Ok(result::<MoeLocalize>(p, case, &got, &want, tol))
}
