//! Checks of the W4A16 kernels on a [`Target`] (the CPU interpreter or a GPU): fresh random
//! INT4 weights and bf16 activations, outputs (and split-K partials) poisoned with NaN, every
//! candidate against the CPU reference at ragged M / N / K, the repack against its CPU model
//! bit for bit, and the MoE block.
//!
//! The references model the kernels' rounding exactly: weights are `bf16(q * scale)` (the
//! `fma.rn.bf16x2` dequantization before the bf16 mma) and sums are f32. The MoE block is
//! checked stage by stage (gate_up `act`, per-pair `y`, the sum), each stage against a
//! reference from the kernels' own bf16 input of that stage: a bf16 rounding of `act` or `y`
//! that flips with the f32 summation order would otherwise move a cancelling sum of top-k rows
//! by a whole ulp of a row. What remains is f32 summation order and the final bf16 rounding,
//! so the tolerance is one bf16 ulp relative
//! (`2^-7`: a rounding that flips), an absolute part of `1e-3` of the output RMS for outputs
//! near zero, and a relative L2 bound of `4e-3` (bf16 rounding alone is about `1e-3`).

mod gemv_check;

pub use gemv_check::*;

use ddtree_codegen::Kernel;
use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

use super::gemm::{self, rows_per_block, GemmTiling, W4a16Kernel, DENSE_SPACE, FUSED_SPACE};
use super::gemm_sk::{ActTilesParams, W4a16ActTiles, W4a16GemmSk, W4a16SkParams, SK_SPACE};
use super::gemm_wg::{W4a16GemmWg, W4a16WgParams, WG_DENSE_SPACE, WG_FUSED_SPACE};
use super::gemv::{self, GemvMode, GemvW4Params, W4a16Gemv, GEMV_SPACE};
use super::layout::{
    fragment_words, interleaved_words, matmul, repack_fragment, repack_interleaved, scale_words, PackedInt4,
    RepackParams,
};
use super::moe::{self, AlignParams, SumParams};
use super::{
    Epilogue, Layout, MoeAlign, MoeSum, ReduceParams, W4a16Gemm, W4a16Params, W4a16Reduce, W4a16Repack,
    W4a16RepackFragment,
};
use crate::check::{
    compare, poisoned_bf16, random_bf16, result, Arg, CheckError, CheckResult, DevBuf, Sizes, Target, Tolerance,
};

/// Weights on `t` in `layout` (interleaved ones repacked by [`W4a16Repack`]).
pub fn device_weights(t: &Target<'_>, p: &PackedInt4, layout: Layout) -> Result<DevBuf<u32>, CheckError> {
    let src = t.upload(&p.packed)?;
    if layout == Layout::Checkpoint {
        return Ok(src);
    }
    let rp = RepackParams { block: 256 };
    let words = interleaved_words(p.n, p.k) * p.experts;
    let mut dst = t.upload(&vec![0xdead_beefu32; words])?;
    let grid = (words as u32).div_ceil(rp.block).clamp(1, 65535);
    let mut args = [
        Arg::In(&src),
        Arg::Out(&mut dst),
        Arg::from(p.n as u32),
        Arg::from(p.k as u32),
        Arg::from(p.experts as u32),
    ];
    // SAFETY: src holds experts * n * k / 8 words, dst experts * interleaved_words(n, k).
    unsafe { t.launch::<W4a16Repack>(&rp, grid, &mut args)? };
    Ok(dst)
}

fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// The tolerance of the module docs, scaled by the output's RMS.
fn sum_tolerance(want: &[f32]) -> Tolerance {
    let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len().max(1) as f32).sqrt();
    Tolerance {
        rtol: 1.0 / 128.0,
        atol: 1e-3 * rms,
        rel_l2: 4e-3,
    }
}

/// A result for a pipeline of launches, named by its variants joined with ` + `.
fn pipeline(kernel: &'static str, symbols: &[String], case: String, got: &[f32], want: &[f32]) -> CheckResult {
    let tol = sum_tolerance(want);
    let comparison = compare(got, want, tol);
    CheckResult {
        kernel,
        symbol: symbols.join(" + "),
        passed: comparison.passed(tol),
        case,
        comparison,
    }
}

/// Checks the repack against [`repack_interleaved`] (exact).
pub fn repack(t: &Target<'_>, n: usize, k: usize, experts: usize, rng: &mut StdRng) -> Result<CheckResult, CheckError> {
    let p = PackedInt4::random(rng, n, k, 32, experts, 1.0);
    let got = t.download(&device_weights(t, &p, Layout::Interleaved)?)?;
    let want = repack_interleaved(&p);
    Ok(result::<W4a16Repack>(
        &RepackParams { block: 256 },
        format!("n={n} k={k} experts={experts}"),
        &halves(&got),
        &halves(&want),
        Tolerance::EXACT,
    ))
}

/// Words as exact integers split into halves (f32 holds 16 bits exactly), for exact comparisons.
fn halves(v: &[u32]) -> Vec<f32> {
    v.iter().flat_map(|w| [(w & 0xffff) as f32, (w >> 16) as f32]).collect()
}

/// Checks the fragment-block repack ([`W4a16RepackFragment`]) against [`repack_fragment`]
/// (exact), output poisoned.
pub fn fragment_repack(
    t: &Target<'_>,
    n: usize,
    k: usize,
    group: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let p = PackedInt4::random(rng, n, k, group, 1, 1.0);
    let (src, sc) = (t.upload(&p.packed)?, t.upload(&scale_words(&p.scales))?);
    let mut dst = t.upload(&vec![0xdead_beefu32; fragment_words(n, k)])?;
    let rp = RepackParams { block: 256 };
    let mut args = [
        Arg::In(&src),
        Arg::In(&sc),
        Arg::Out(&mut dst),
        Arg::from(n as u32),
        Arg::from(k as u32),
        Arg::from(group as u32),
    ];
    // SAFETY: src is [n, k / 8], the scales [n, k / group] bf16, dst fragment_words(n, k).
    unsafe { t.launch::<W4a16RepackFragment>(&rp, 64u32, &mut args)? };
    Ok(result::<W4a16RepackFragment>(
        &rp,
        format!("n={n} k={k} group={group}"),
        &halves(&t.download(&dst)?),
        &halves(&repack_fragment(&p)),
        Tolerance::EXACT,
    ))
}

/// One-element stand-ins for the buffers a launch does not read.
struct Unused {
    u32s: DevBuf<u32>,
    f32s: DevBuf<f32>,
    bf16s: DevBuf<bf16>,
}

impl Unused {
    fn new(t: &Target<'_>) -> Result<Unused, CheckError> {
        Ok(Unused {
            u32s: t.upload(&[0u32])?,
            f32s: t.upload(&[0f32])?,
            bf16s: t.upload(&[bf16::ZERO])?,
        })
    }
}

/// Checks one dense variant of `K` at `m x n x k` with `splits` k splits.
pub fn dense<K: W4a16Kernel>(
    t: &Target<'_>,
    p: &K::Params,
    m: usize,
    n: usize,
    k: usize,
    splits: u32,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let tl = p.tiling();
    let wq = PackedInt4::random(rng, n, k, tl.group as usize, 1, 0.05);
    let (a, af) = random_bf16(rng, m * k, -1.0, 1.0);
    let (res, resf) = random_bf16(rng, m * n, -1.0, 1.0);
    let (da, dres, dsc) = (t.upload(&a)?, t.upload(&res)?, t.upload(&scale_words(&wq.scales))?);
    let dw = device_weights(t, &wq, tl.layout)?;
    let cols = gemm::out_cols(p, n as u32) as usize;
    let none = Unused::new(t)?;
    let mut gemm_out = poisoned_bf16(t, if tl.splitk { 1 } else { m * cols })?;
    let mut part = t.upload(&vec![f32::NAN; if tl.splitk { splits as usize * m * n } else { 1 }])?;
    let residual = if tl.epilogue == Epilogue::Residual {
        &dres
    } else {
        &none.bf16s
    };
    let mut args = [
        Arg::In(&da),
        Arg::In(&dw),
        Arg::In(&dsc),
        Arg::In(residual),
        Arg::Out(&mut gemm_out),
        Arg::Out(&mut part),
        Arg::In(&none.u32s),
        Arg::In(&none.u32s),
        Arg::In(&none.f32s),
        Arg::from(m as u32),
        Arg::from(n as u32),
        Arg::from(k as u32),
        Arg::from(1u32),
    ];
    let grid = gemm::grid(p, m as u32, n as u32, splits);
    // SAFETY: buffers have the documented shapes; k is a multiple of 32 and of the group.
    unsafe { t.launch::<K>(p, grid, &mut args)? };
    let rp = ReduceParams {
        block: 256,
        epilogue: tl.epilogue,
    };
    let got = if tl.splitk {
        let mut out = poisoned_bf16(t, m * cols)?;
        let rg = ((m * cols) as u32).div_ceil(rp.block).clamp(1, 65535);
        let mut args = [
            Arg::In(&part),
            Arg::In(residual),
            Arg::Out(&mut out),
            Arg::from(m as u32),
            Arg::from(n as u32),
            Arg::from(splits),
        ];
        // SAFETY: part holds splits * m * n values, out m * cols.
        unsafe { t.launch::<W4a16Reduce>(&rp, rg, &mut args)? };
        t.download(&out)?
    } else {
        t.download(&gemm_out)?
    };
    let full = matmul(&af, &wq.dequantize_bf16(), m, n, k);
    let want: Vec<f32> = match tl.epilogue {
        Epilogue::SiluMul => (0..m * cols)
            .map(|i| {
                let (r, c) = (i / cols, i % cols);
                let (g, u) = (full[r * n + c], full[r * n + cols + c]);
                g / (1.0 + (-g).exp()) * u
            })
            .collect(),
        Epilogue::Residual => full.iter().zip(&resf).map(|(x, y)| x + y).collect(),
        _ => full,
    };
    let case = format!("m={m} n={n} k={k} splits={splits}");
    let mut symbols = vec![K::symbol(p)];
    if tl.splitk {
        symbols.push(W4a16Reduce::symbol(&rp));
    }
    Ok(pipeline(K::NAME, &symbols, case, &to_f32(&got), &want))
}

/// Grouped (gate_up, down) candidate pairs with the same layout and rows per block.
pub fn moe_pairs() -> Vec<(W4a16Params, W4a16Params)> {
    let moe: Vec<&W4a16Params> = FUSED_SPACE.iter().filter(|p| p.moe).collect();
    let mut out = Vec::new();
    for up in moe.iter().filter(|p| p.epilogue == Epilogue::SiluMul) {
        for down in moe.iter().filter(|p| p.epilogue == Epilogue::RouteScale) {
            if up.layout == down.layout && up.mt == down.mt && up.m8 == down.m8 {
                out.push((**up, **down));
            }
        }
    }
    out
}

/// Random top-k routing over `route_experts` experts (distinct per token) with weights.
pub fn random_routing(rng: &mut impl Rng, tokens: usize, topk: usize, route_experts: usize) -> (Vec<u32>, Vec<f32>) {
    let mut ids = Vec::with_capacity(tokens * topk);
    for _ in 0..tokens {
        let mut chosen: Vec<u32> = Vec::new();
        while chosen.len() < topk {
            let e = rng.random_range(0..route_experts as u32);
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        ids.extend(chosen);
    }
    let w = (0..tokens * topk).map(|_| rng.random_range(0.05f32..0.5)).collect();
    (ids, w)
}

/// Checks the MoE block with one grouped (gate_up, down) GEMM pair: `moe_align`, the grouped
/// gate_up and down GEMMs and `moe_sum`, launched as [`super::MoeKernels::run`] does (see
/// [`moe_check`]), on fresh random data ([`MoeData::random`] at the pair's group).
#[allow(clippy::too_many_arguments)]
pub fn moe_block<K: W4a16Kernel>(
    t: &Target<'_>,
    pair: &(K::Params, K::Params),
    tokens: usize,
    experts: usize,
    hidden: usize,
    inter: usize,
    topk: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let shape = MoeShape {
        tokens,
        experts,
        hidden,
        inter,
        topk,
    };
    let data = MoeData::random(shape, pair.0.tiling().group as usize, rng);
    moe_block_on::<K>(t, pair, &data)
}

/// [`moe_block`] on given data (at the pair's scale group).
pub fn moe_block_on<K: W4a16Kernel>(
    t: &Target<'_>,
    pair: &(K::Params, K::Params),
    data: &MoeData,
) -> Result<CheckResult, CheckError> {
    let (up, down) = pair;
    let products = MoeProducts {
        bm: rows_per_block(up),
        group: up.tiling().group as usize,
        layouts: [up.tiling().layout, down.tiling().layout],
        symbols: [K::symbol(up), K::symbol(down)],
    };
    let MoeShape {
        hidden, inter, topk, ..
    } = data.shape;
    moe_check(t, &products, data, |io, act, y| {
        let mut part = t.upload(&[0f32])?;
        let (h, i) = (hidden as u32, inter as u32);
        let mut args = [
            Arg::In(io.x),
            Arg::In(io.w13),
            Arg::In(io.s13),
            Arg::In(&io.none.bf16s),
            Arg::Out(act),
            Arg::Out(&mut part),
            Arg::In(io.sorted),
            Arg::In(io.block_expert),
            Arg::In(&io.none.f32s),
            Arg::from(io.pairs),
            Arg::from(2 * i),
            Arg::from(h),
            Arg::from(topk as u32),
        ];
        // SAFETY: x is [T, H], w13 / s13 hold the experts' [2I, H] weights, act [pairs, I].
        unsafe { t.launch::<K>(up, gemm::grid(up, io.mb, 2 * i, 1), &mut args)? };
        let mut args = [
            Arg::In(act),
            Arg::In(io.w2),
            Arg::In(io.s2),
            Arg::In(&io.none.bf16s),
            Arg::Out(y),
            Arg::Out(&mut part),
            Arg::In(io.sorted),
            Arg::In(io.block_expert),
            Arg::In(io.route_w),
            Arg::from(io.pairs),
            Arg::from(h),
            Arg::from(i),
            Arg::from(1u32),
        ];
        // SAFETY: act is [pairs, I], w2 / s2 hold the experts' [H, I] weights, y [pairs, H].
        unsafe { t.launch::<K>(down, gemm::grid(down, io.mb, h, 1), &mut args) }
    })
}

/// Checks the MoE block with one grouped (gate_up, down) pair of [`W4a16Gemv`] variants (the
/// same `chunks`): `moe_align` at `8 chunks` slots per block, the two GEMVs and `moe_sum`, as
/// [`super::MoeKernels::run_grouped_gemv`] launches them (see [`moe_check`]), on fresh random
/// data ([`MoeData::random`] at the pair's group).
pub fn grouped_gemv_moe(
    t: &Target<'_>,
    up: &GemvW4Params,
    down: &GemvW4Params,
    shape: MoeShape,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let data = MoeData::random(shape, up.group as usize, rng);
    grouped_gemv_moe_on(t, up, down, &data)
}

/// [`grouped_gemv_moe`] on given data (at the pair's scale group).
pub fn grouped_gemv_moe_on(
    t: &Target<'_>,
    up: &GemvW4Params,
    down: &GemvW4Params,
    data: &MoeData,
) -> Result<CheckResult, CheckError> {
    assert_eq!(up.chunks, down.chunks, "a grouped GEMV pair shares its slots per block");
    assert_eq!(up.group, down.group, "a grouped GEMV pair shares its scale group");
    let products = MoeProducts {
        bm: 8 * up.chunks,
        group: up.group as usize,
        layouts: [Layout::Interleaved; 2],
        symbols: [W4a16Gemv::symbol(up), W4a16Gemv::symbol(down)],
    };
    let MoeShape {
        experts,
        hidden,
        inter,
        topk,
        ..
    } = data.shape;
    moe_check(t, &products, data, |io, act, y| {
        let bufs = |x, w, s| GemvBufs {
            x,
            w,
            s,
            ids: io.ids,
            route_w: io.route_w,
            sorted: io.sorted,
            block_expert: io.block_expert,
        };
        let pairs = io.pairs as usize;
        let mb = io.mb as usize;
        launch_gemv(
            t,
            up,
            bufs(io.x, io.w13, io.s13),
            act,
            pairs,
            2 * inter,
            hidden,
            topk,
            experts,
            mb,
        )?;
        launch_gemv(
            t,
            down,
            bufs(act, io.w2, io.s2),
            y,
            pairs,
            hidden,
            inter,
            topk,
            experts,
            mb,
        )
    })
}

/// A MoE block's shape: tokens, local experts, hidden size H, expert intermediate size I, top-k.
#[derive(Clone, Copy, Debug)]
pub struct MoeShape {
    /// Tokens T.
    pub tokens: usize,
    /// Local experts.
    pub experts: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Expert intermediate size I.
    pub inter: usize,
    /// Slots per token.
    pub topk: usize,
}

/// The host side of one MoE block check: random INT4 experts (gate_up `[2I, H]`, down
/// `[H, I]`, at one scale group), bf16 activations `x` `[T, H]`, a routing over `experts + 2`
/// experts (some pairs belong to another rank), and the gate_up stage's reference from `x`
/// (which does not depend on the kernels). Candidates checked at one shape and seed can share
/// it: each check uploads it afresh, poisons its outputs and computes the later stages'
/// references from the kernels' own outputs.
pub struct MoeData {
    /// The shape.
    pub shape: MoeShape,
    /// The gate_up experts.
    pub w13: PackedInt4,
    /// The down experts.
    pub w2: PackedInt4,
    /// The activations `[T, H]`.
    pub x: Vec<bf16>,
    /// The routing's experts `[T, topk]`.
    pub ids: Vec<u32>,
    /// The routing's weights `[T, topk]`.
    pub wts: Vec<f32>,
    /// [`moe::reference_stage`] of `x` through `w13` `[pairs, I]`.
    pub act_want: Vec<f32>,
}

impl MoeData {
    /// Random data for `shape` at scale group `group` (drawn from `rng` in the order the checks
    /// always drew it: gate_up, down, `x`, routing).
    pub fn random(shape: MoeShape, group: usize, rng: &mut StdRng) -> MoeData {
        let MoeShape {
            tokens,
            experts,
            hidden,
            inter,
            topk,
        } = shape;
        let w13 = PackedInt4::random(rng, 2 * inter, hidden, group, experts, 0.05);
        let w2 = PackedInt4::random(rng, hidden, inter, group, experts, 0.05);
        let (x, xf) = random_bf16(rng, tokens * hidden, -1.0, 1.0);
        let (ids, wts) = random_routing(rng, tokens, topk, experts + 2);
        let act_want = moe::reference_stage(&xf, &ids, topk, &w13, None);
        MoeData {
            shape,
            w13,
            w2,
            x,
            ids,
            wts,
            act_want,
        }
    }

    /// The scale group.
    pub fn group(&self) -> usize {
        self.w13.group
    }

    /// Pairs whose expert is local.
    pub fn local_pairs(&self) -> usize {
        self.ids.iter().filter(|&&e| (e as usize) < self.shape.experts).count()
    }
}

/// Multiply-adds of the CPU reference of one MoE check at `shape` (each weight dequantized
/// counted as one), whatever the path: `shared`, what [`MoeData::random`] does once (the gate_up
/// stage of every pair), and `per_check`, what each candidate's check adds (the down stage from
/// its own `act`, and the sum of its own `y`). Upper bounds: every pair counted local.
pub fn moe_check_macs(shape: MoeShape) -> (u64, u64) {
    let MoeShape {
        tokens,
        experts,
        hidden,
        inter,
        topk,
    } = shape;
    let pairs = tokens * topk;
    let touched = experts.min(pairs);
    let shared = moe::reference_stage_macs(pairs, touched, 2 * inter, hidden);
    let per_check = moe::reference_stage_macs(pairs, touched, hidden, inter) + (pairs * hidden) as u64;
    (shared, per_check)
}

/// The grouped products a [`moe_check`] runs: `moe_align`'s slots per block, the weights' scale
/// group and layouts (gate_up, down), and the variants' symbols.
struct MoeProducts {
    bm: u32,
    group: usize,
    layouts: [Layout; 2],
    symbols: [String; 2],
}

/// What the grouped products of a [`moe_check`] read: the inputs, the weights and `moe_align`'s
/// blocks.
struct MoeIo<'a> {
    x: &'a DevBuf<bf16>,
    w13: &'a DevBuf<u32>,
    s13: &'a DevBuf<u32>,
    w2: &'a DevBuf<u32>,
    s2: &'a DevBuf<u32>,
    ids: &'a DevBuf<u32>,
    route_w: &'a DevBuf<f32>,
    sorted: &'a DevBuf<u32>,
    block_expert: &'a DevBuf<u32>,
    none: &'a Unused,
    pairs: u32,
    mb: u32,
}

/// Runs `moe_align`, the products (`launch`: gate_up into `act`, then down into `y`) and
/// `moe_sum` on `data` (uploaded afresh, outputs poisoned), and checks them stage by stage:
/// `act` against [`moe::reference_stage`] of `x` ([`MoeData::act_want`]), `y` against the
/// reference of the kernels' own `act`, `out` against the sum of the kernels' own `y` (see the
/// module docs), over the pairs whose expert is local. Routing picks among `experts + 2`
/// experts, so some pairs belong to another rank and must be skipped.
fn moe_check(
    t: &Target<'_>,
    products: &MoeProducts,
    data: &MoeData,
    launch: impl FnOnce(&MoeIo<'_>, &mut DevBuf<bf16>, &mut DevBuf<bf16>) -> Result<(), CheckError>,
) -> Result<CheckResult, CheckError> {
    let MoeShape {
        tokens,
        experts,
        hidden,
        inter,
        topk,
    } = data.shape;
    assert_eq!(data.group(), products.group, "the data's scale group is the pair's");
    let MoeData {
        w13,
        w2,
        x,
        ids,
        wts,
        act_want,
        ..
    } = data;
    let [l13, l2] = products.layouts;
    let (d13, d2) = (device_weights(t, w13, l13)?, device_weights(t, w2, l2)?);
    let (s13, s2) = (
        t.upload(&scale_words(&w13.scales))?,
        t.upload(&scale_words(&w2.scales))?,
    );
    let (dx, dids, dw) = (t.upload(x)?, t.upload(ids)?, t.upload(wts)?);
    let none = Unused::new(t)?;
    let (pairs, bm) = ((tokens * topk) as u32, products.bm);
    let mb = moe::max_blocks(pairs as usize, experts, bm as usize) as u32;
    let mut sorted = t.upload(&vec![0u32; (mb * bm) as usize])?;
    let mut block_expert = t.upload(&vec![0u32; mb as usize])?;
    let mut act = poisoned_bf16(t, pairs as usize * inter)?;
    let mut y = poisoned_bf16(t, pairs as usize * hidden)?;
    let mut out = poisoned_bf16(t, tokens * hidden)?;
    let mut args = [
        Arg::In(&dids),
        Arg::Out(&mut sorted),
        Arg::Out(&mut block_expert),
        Arg::from(pairs),
        Arg::from(experts as u32),
        Arg::from(bm),
        Arg::from(mb),
    ];
    // SAFETY: sorted holds mb * bm slots and block_expert mb >= the blocks align makes.
    unsafe { t.launch::<MoeAlign>(&AlignParams { block: 1024 }, 1, &mut args)? };
    let io = MoeIo {
        x: &dx,
        w13: &d13,
        s13: &s13,
        w2: &d2,
        s2: &s2,
        ids: &dids,
        route_w: &dw,
        sorted: &sorted,
        block_expert: &block_expert,
        none: &none,
        pairs,
        mb,
    };
    launch(&io, &mut act, &mut y)?;
    let h = hidden as u32;
    let sp = SumParams { block: 256 };
    let mut args = [
        Arg::In(&y),
        Arg::In(&dids),
        Arg::Out(&mut out),
        Arg::from(tokens as u32),
        Arg::from(h),
        Arg::from(topk as u32),
        Arg::from(experts as u32),
    ];
    let g = (tokens as u32 * h).div_ceil(sp.block).clamp(1, 65535);
    // SAFETY: y is [pairs, H], out [T, H], ids [T, topk].
    unsafe { t.launch::<MoeSum>(&sp, g, &mut args)? };
    // Stage by stage, each against a reference from the kernels' own input of that stage (see
    // [`moe::reference_stage`]), over the pairs whose expert is local (other rows are not written).
    let local: Vec<usize> = (0..ids.len()).filter(|&pr| (ids[pr] as usize) < experts).collect();
    let rows = |v: &[f32], cols: usize| -> Vec<f32> {
        local
            .iter()
            .flat_map(|&pr| v[pr * cols..(pr + 1) * cols].to_vec())
            .collect()
    };
    let act_got = to_f32(&t.download(&act)?);
    let y_got = to_f32(&t.download(&y)?);
    let y_want = moe::reference_stage(&act_got, ids, topk, w2, Some(wts));
    let out_want: Vec<f32> = (0..tokens * hidden)
        .map(|e| {
            let (tk, c) = (e / hidden, e % hidden);
            (0..topk)
                .map(|j| tk * topk + j)
                .filter(|&pr| (ids[pr] as usize) < experts)
                .map(|pr| y_got[pr * hidden + c])
                .sum()
        })
        .collect();
    let [su, sd] = products.symbols.clone();
    let symbols = [
        MoeAlign::symbol(&AlignParams { block: 1024 }),
        su,
        sd,
        MoeSum::symbol(&sp),
    ];
    let case = format!("tokens={tokens} experts={experts} hidden={hidden} inter={inter} topk={topk}");
    let stages = [
        ("act", rows(&act_got, inter), rows(act_want, inter)),
        ("y", rows(&y_got, hidden), rows(&y_want, hidden)),
        ("out", to_f32(&t.download(&out)?), out_want),
    ];
    let mut results = stages
        .into_iter()
        .map(|(stage, got, want)| pipeline("moe_w4a16", &symbols, format!("{case} stage={stage}"), &got, &want));
    let last = results.next_back().expect("three stages");
    Ok(results.find(|r| !r.passed).unwrap_or(last))
}

/// Every W4A16 kernel: the repack, every dense and fused candidate at ragged sizes (split-K
/// variants with 1 and 3 splits), and every MoE pair. [`Sizes::Small`] keeps the sizes tiny
/// for the interpreter; [`Sizes::Full`] uses larger ragged sizes plus Kimi-sized cases for the
/// default candidates.
pub fn suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let full = sizes == Sizes::Full;
    let mut out = vec![repack(t, 13, 160, 2, rng)?];
    // Small: one m tile's worth of ragged rows, or two tiles' for several m tiles per block.
    let mut cases: Vec<(usize, usize, usize)> = vec![(5, 40, 384), (19, 16, 256)];
    if full {
        out.push(repack(t, 64, 1024, 1, rng)?);
        cases = vec![
            (1, 72, 256),
            (5, 203, 1056),
            (16, 136, 512),
            (37, 96, 1152),
            (130, 264, 640),
        ];
        cases.extend([(16, 4096, 7168), (64, 7168, 2048), (200, 1536, 1536)]);
    }
    let defaults = [
        gemm::default_dense(1, 4096, 7168).0,
        gemm::default_dense(200, 4096, 7168).0,
    ];
    for p in DENSE_SPACE.iter().chain(FUSED_SPACE).filter(|p| !p.moe) {
        for &(m, n, k) in &cases {
            let small_skip = !full && (m > 16) != (p.mt > 1);
            if small_skip || k % p.group as usize != 0 || (n >= 1536 && !defaults.contains(p)) {
                continue;
            }
            // SiLU-and-mul needs an even n whose halves are whole tiles for the interleaved layout.
            let n = if p.epilogue == Epilogue::SiluMul {
                n.div_ceil(16) * 16
            } else {
                n
            };
            for splits in if p.splitk { vec![1, 3] } else { vec![1] } {
                out.push(dense::<W4a16Gemm>(t, p, m, n, k, splits, rng)?);
            }
        }
    }
    if t.runs_wgmma() {
        out.extend(wg_suite(t, sizes, rng)?);
    }
    for (idx, pair) in moe_pairs().iter().enumerate() {
        // (16, 3, .., 4): about 13 pairs per local expert, so a half-m-tile (8-row) block is not
        // enough for one expert and a 16-row one is nearly full.
        let mut mcases = vec![(1, 3, 128, 32, 2), (5, 4, 160, 64, 3), (16, 3, 128, 32, 4)];
        if full {
            mcases = vec![
                (1, 6, 256, 64, 2),
                (5, 6, 160, 96, 3),
                (40, 9, 288, 128, 4),
                (16, 3, 256, 64, 4),
            ];
            if idx == 0 || pair.0.m8 {
                mcases.push((16, 8, 7168, 2048, 8));
            }
        }
        for (tk, e, h, i, topk) in mcases {
            out.push(moe_block::<W4a16Gemm>(t, pair, tk, e, h, i, topk, rng)?);
        }
    }
    Ok(out)
}

/// Grouped (gate_up, down) pairs of [`W4a16GemmWg`] with the same layout and rows per block.
pub fn wg_moe_pairs() -> Vec<(W4a16WgParams, W4a16WgParams)> {
    let moe: Vec<&W4a16WgParams> = WG_FUSED_SPACE.iter().filter(|p| p.moe).collect();
    let mut out = Vec::new();
    for up in moe.iter().filter(|p| p.epilogue == Epilogue::SiluMul) {
        for down in moe.iter().filter(|p| p.epilogue == Epilogue::RouteScale) {
            if up.layout == down.layout && up.bn == down.bn {
                out.push((**up, **down));
            }
        }
    }
    out
}

/// Every [`W4a16GemmWg`] candidate: dense ones at ragged sizes (M past one block of the small
/// `bn`, N past one block, K ending in half a k64 chunk where the group allows), split-K ones
/// with 1 and 3 splits, and the grouped pairs in the MoE block. Needs [`Target::runs_wgmma`].
pub fn wg_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let full = sizes == Sizes::Full;
    let mut out = Vec::new();
    let mut cases: Vec<(usize, usize, usize)> = vec![(5, 136, 384), (37, 264, 288)];
    if full {
        cases = vec![
            (1, 200, 512),
            (19, 264, 1056),
            (70, 520, 640),
            (130, 384, 2048),
            (257, 136, 256),
        ];
        cases.extend([(64, 7168, 2048), (128, 4096, 7168)]);
    }
    for p in WG_DENSE_SPACE.iter().chain(WG_FUSED_SPACE).filter(|p| !p.moe) {
        for &(m, n, k) in &cases {
            if k % p.group as usize != 0 || (n >= 4096 && p != &WG_DENSE_SPACE[0]) {
                continue;
            }
            let n = if p.epilogue == Epilogue::SiluMul {
                n.div_ceil(2) * 2
            } else {
                n
            };
            for splits in if p.splitk { vec![1, 3] } else { vec![1] } {
                out.push(dense::<W4a16GemmWg>(t, p, m, n, k, splits, rng)?);
            }
        }
    }
    let mut mcases = vec![(3, 3, 128, 32, 2)];
    if full {
        mcases = vec![(5, 6, 256, 96, 3), (40, 9, 288, 128, 4), (16, 8, 7168, 2048, 8)];
    }
    for pair in wg_moe_pairs() {
        for &(tk, e, h, i, topk) in &mcases {
            out.push(moe_block::<W4a16GemmWg>(t, &pair, tk, e, h, i, topk, rng)?);
        }
    }
    Ok(out)
}

/// Checks one [`W4a16GemmSk`] variant at `m x n x k` (g32) on a grid of `grid` blocks (at most
/// the iterations), with its activation tiles made by [`W4a16ActTiles`] from poisoned buffers,
/// `part` poisoned, and the tile flags checked to be left zero.
pub fn sk_dense(
    t: &Target<'_>,
    p: &W4a16SkParams,
    m: usize,
    n: usize,
    k: usize,
    grid: u32,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let wq = PackedInt4::random(rng, n, k, 32, 1, 0.05);
    let (a, af) = random_bf16(rng, m * k, -1.0, 1.0);
    let (da, dw) = (t.upload(&a)?, t.upload(&repack_fragment(&wq))?);
    let (mu, nu, ku) = (m as u32, n as u32, k as u32);
    let (tiles, kbs) = p.tiles_chunks(mu, nu, ku);
    let mut grid = grid.clamp(1, tiles * kbs);
    if let Target::Gpu(g) = t {
        // Every block must be resident at once (a tile's head waits for its other ranges).
        let per_sm = g.compile::<W4a16GemmSk>(p)?.max_active_blocks_per_sm()?;
        grid = grid.min(g.fingerprint().sm_count as u32 * per_sm);
    }
    let tp = ActTilesParams { block: 256 };
    let tile_len = mu.div_ceil(p.bn) * kbs * p.bn * 128;
    let mut dat = poisoned_bf16(t, tile_len as usize)?;
    let mut args = [
        Arg::In(&da),
        Arg::Out(&mut dat),
        Arg::from(mu),
        Arg::from(ku),
        Arg::from(p.bn),
    ];
    // SAFETY: `a` is m x k, `at` holds every tile of `bn` rows.
    unsafe { t.launch::<W4a16ActTiles>(&tp, (tile_len / 8).div_ceil(tp.block).min(1024), &mut args)? };
    let mut out = poisoned_bf16(t, m * n)?;
    let mut part = t.upload(&vec![f32::NAN; p.part_len(grid)])?;
    let mut flags = t.upload(&vec![0u32; tiles as usize])?;
    let mut args = [
        Arg::In(&dat),
        Arg::In(&dw),
        Arg::Out(&mut out),
        Arg::Out(&mut part),
        Arg::Out(&mut flags),
        Arg::from(mu),
        Arg::from(nu),
        Arg::from(ku),
    ];
    // SAFETY: buffers have the documented shapes; the grid is at most the iterations and small
    // enough to be resident at once.
    unsafe { t.launch::<W4a16GemmSk>(p, grid, &mut args)? };
    let got = t.download(&out)?;
    let want = matmul(&af, &wq.dequantize_bf16(), m, n, k);
    let symbols = [W4a16ActTiles::symbol(&tp), W4a16GemmSk::symbol(p)];
    let mut r = pipeline(
        W4a16GemmSk::NAME,
        &symbols,
        format!("m={m} n={n} k={k} grid={grid}"),
        &to_f32(&got),
        &want,
    );
    if t.download(&flags)?.iter().any(|&f| f != 0) {
        r.passed = false;
        r.case += " (tile flags left nonzero)";
    }
    Ok(r)
}

/// The fragment repack at ragged sizes and groups 32 / 64 / 128, then every [`W4a16GemmSk`]
/// candidate at ragged sizes (M past one `bn` block, N past one tile and
/// a 64-row unit, K ending in a k32 group) on grids that cut tiles into 1 to 4 ranges (one block
/// for all of it included), and (full)
/// at Kimi sizes. Needs [`Target::runs_wgmma`].
pub fn sk_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut cases: Vec<(usize, usize, usize, u32)> = vec![(37, 200, 416, 3), (19, 72, 288, 5), (19, 72, 288, 1)];
    if sizes == Sizes::Full {
        cases.extend([
            (70, 520, 640, 1),
            (70, 520, 640, 7),
            (130, 384, 2048, 13),
            (64, 7168, 2048, 132),
            (128, 4096, 7168, 264),
        ]);
    }
    let mut out = Vec::new();
    for (n, k, group) in [(70, 160, 32), (200, 416, 32), (136, 384, 128), (72, 320, 64)] {
        out.push(fragment_repack(t, n, k, group, rng)?);
    }
    for p in SK_SPACE {
        for &(m, n, k, grid) in &cases {
            out.push(sk_dense(t, p, m, n, k, grid, rng)?);
        }
    }
    Ok(out)
}
