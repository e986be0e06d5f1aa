//! Checks of the small-token W4A16 GEMV ([`W4a16Gemv`]): dense, the routed gate_up / down
//! pairs and the grouped pairs, against the CPU references.

#[allow(unused_imports)]
use super::*;

/// The input buffers of a [`W4a16Gemv`] launch.
pub(super) struct GemvBufs<'a> {
    pub(super) x: &'a DevBuf<bf16>,
    pub(super) w: &'a DevBuf<u32>,
    pub(super) s: &'a DevBuf<u32>,
    pub(super) ids: &'a DevBuf<u32>,
    pub(super) route_w: &'a DevBuf<f32>,
    pub(super) sorted: &'a DevBuf<u32>,
    pub(super) block_expert: &'a DevBuf<u32>,
}

/// The launch of one [`W4a16Gemv`] variant (`ys`: [`gemv::grid`]'s).
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_gemv(
    t: &Target<'_>,
    p: &GemvW4Params,
    bufs: GemvBufs<'_>,
    out: &mut DevBuf<bf16>,
    m: usize,
    n: usize,
    k: usize,
    topk: usize,
    experts: usize,
    ys: usize,
) -> Result<(), CheckError> {
    let mut args = [
        Arg::In(bufs.x),
        Arg::In(bufs.w),
        Arg::In(bufs.s),
        Arg::In(bufs.ids),
        Arg::In(bufs.route_w),
        Arg::In(bufs.sorted),
        Arg::In(bufs.block_expert),
        Arg::Out(out),
        Arg::from(m as u32),
        Arg::from(n as u32),
        Arg::from(k as u32),
        Arg::from(topk as u32),
        Arg::from(experts as u32),
    ];
    let grid = gemv::grid(p, n as u32, ys as u32);
    // SAFETY: buffers have the shapes the kernel docs give; k is a multiple of 32 and of the
    // group.
    unsafe { t.launch::<W4a16Gemv>(p, grid, &mut args) }
}

/// Checks one dense [`GemvMode::Dense`] variant at `m x n x k` (weights at its scale group)
/// against the CPU reference.
pub fn gemv_dense(
    t: &Target<'_>,
    p: &GemvW4Params,
    m: usize,
    n: usize,
    k: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let wq = PackedInt4::random(rng, n, k, p.group as usize, 1, 0.05);
    let (a, af) = random_bf16(rng, m * k, -1.0, 1.0);
    let (da, dsc) = (t.upload(&a)?, t.upload(&scale_words(&wq.scales))?);
    let dw = device_weights(t, &wq, Layout::Interleaved)?;
    let none = Unused::new(t)?;
    let mut out = poisoned_bf16(t, m * n)?;
    let bufs = GemvBufs {
        x: &da,
        w: &dw,
        s: &dsc,
        ids: &none.u32s,
        route_w: &none.f32s,
        sorted: &none.u32s,
        block_expert: &none.u32s,
    };
    launch_gemv(t, p, bufs, &mut out, m, n, k, 1, 1, 1)?;
    let want = matmul(&af, &wq.dequantize_bf16(), m, n, k);
    let got = to_f32(&t.download(&out)?);
    let case = format!("m={m} n={n} k={k} group={}", p.group);
    Ok(pipeline(W4a16Gemv::NAME, &[W4a16Gemv::symbol(p)], case, &got, &want))
}

/// Checks the small-token MoE path with one (gate_up, down) pair of [`W4a16Gemv`] variants,
/// launched as [`super::MoeKernels::run`] does for few tokens, on fresh random data
/// ([`MoeData::random`] at the pair's group): see [`gemv_moe_on`].
#[allow(clippy::too_many_arguments)]
pub fn gemv_moe(
    t: &Target<'_>,
    up: &GemvW4Params,
    down: &GemvW4Params,
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
    let data = MoeData::random(shape, up.group as usize, rng);
    gemv_moe_on(t, up, down, &data)
}

/// [`gemv_moe`] on given data (uploaded afresh, outputs poisoned): `act` (rows of local pairs)
/// against [`moe::reference_stage`] of `x` ([`MoeData::act_want`]), and `out` against the
/// router-weighted sum over the local slots of [`moe::reference_stage`] of the kernel's own
/// `act`. Routing picks among `experts + 2` experts, so some pairs belong to another rank and
/// must be skipped. Weights at the pair's scale group.
pub fn gemv_moe_on(
    t: &Target<'_>,
    up: &GemvW4Params,
    down: &GemvW4Params,
    data: &MoeData,
) -> Result<CheckResult, CheckError> {
    assert_eq!(up.group, down.group, "a GEMV pair shares its scale group");
    let group = up.group as usize;
    assert_eq!(data.group(), group, "the data's scale group is the pair's");
    let MoeShape {
        tokens,
        experts,
        hidden,
        inter,
        topk,
    } = data.shape;
    let MoeData {
        w13,
        w2,
        x,
        ids,
        wts,
        act_want,
        ..
    } = data;
    let (d13, d2) = (
        device_weights(t, w13, Layout::Interleaved)?,
        device_weights(t, w2, Layout::Interleaved)?,
    );
    let (s13, s2) = (
        t.upload(&scale_words(&w13.scales))?,
        t.upload(&scale_words(&w2.scales))?,
    );
    let (dx, dids, dw) = (t.upload(x)?, t.upload(ids)?, t.upload(wts)?);
    let pairs = tokens * topk;
    let mut act = poisoned_bf16(t, pairs * inter)?;
    let mut out = poisoned_bf16(t, tokens * hidden)?;
    let bufs = |x, w, s| GemvBufs {
        x,
        w,
        s,
        ids: &dids,
        route_w: &dw,
        sorted: &dids,
        block_expert: &dids,
    };
    launch_gemv(
        t,
        up,
        bufs(&dx, &d13, &s13),
        &mut act,
        pairs,
        2 * inter,
        hidden,
        topk,
        experts,
        pairs,
    )?;
    launch_gemv(
        t,
        down,
        bufs(&act, &d2, &s2),
        &mut out,
        tokens,
        hidden,
        inter,
        topk,
        experts,
        pairs,
    )?;
    let local: Vec<usize> = (0..pairs).filter(|&pr| (ids[pr] as usize) < experts).collect();
    let rows = |v: &[f32], cols: usize| -> Vec<f32> {
        local
            .iter()
            .flat_map(|&pr| v[pr * cols..(pr + 1) * cols].to_vec())
            .collect()
    };
    let act_got = to_f32(&t.download(&act)?);
    // Non-local rows of act are never written: zero them so the down reference reads no NaN.
    let act_in: Vec<f32> = act_got
        .chunks(inter)
        .enumerate()
        .flat_map(|(pr, r)| {
            if (ids[pr] as usize) < experts {
                r.to_vec()
            } else {
                vec![0.0; inter]
            }
        })
        .collect();
    let y = moe::reference_stage(&act_in, ids, topk, w2, Some(wts));
    let out_want: Vec<f32> = (0..tokens * hidden)
        .map(|e| {
            let (tk, c) = (e / hidden, e % hidden);
            (0..topk).map(|j| y[(tk * topk + j) * hidden + c]).sum()
        })
        .collect();
    let symbols = [W4a16Gemv::symbol(up), W4a16Gemv::symbol(down)];
    let case = format!("tokens={tokens} experts={experts} hidden={hidden} inter={inter} topk={topk} group={group}");
    let stages = [
        ("act", rows(&act_got, inter), rows(act_want, inter)),
        ("out", to_f32(&t.download(&out)?), out_want),
    ];
    let mut results = stages
        .into_iter()
        .map(|(stage, got, want)| pipeline("moe_w4a16_gemv", &symbols, format!("{case} stage={stage}"), &got, &want));
    let last = results.next_back().expect("two stages");
    Ok(results.find(|r| !r.passed).unwrap_or(last))
}

/// (gate_up, down) pairs of [`W4a16Gemv`] variants covering every MoE candidate: each gate_up
/// one with the first down one of the same group, `chunks`, `xr` and `sr`, and each down one
/// likewise.
pub fn gemv_moe_pairs() -> Vec<(GemvW4Params, GemvW4Params)> {
    covering_pairs(GemvMode::GateUp, GemvMode::Down, |a, b| {
        a.group == b.group && a.chunks == b.chunks && a.xr == b.xr && a.sr == b.sr
    })
}

/// Grouped (gate_up, down) pairs of [`W4a16Gemv`] variants covering every grouped candidate:
/// each gate_up one with the first down one of the same group and `chunks` (slots per block),
/// and each down one likewise.
pub fn grouped_gemv_pairs() -> Vec<(GemvW4Params, GemvW4Params)> {
    covering_pairs(GemvMode::GroupedGateUp, GemvMode::GroupedDown, |a, b| {
        a.group == b.group && a.chunks == b.chunks
    })
}

/// Pairs of `up` and `down` mode candidates covering both: each `up` one with the first `down`
/// one `like` it, then each `down` one not yet paired with the first `up` one `like` it.
pub(super) fn covering_pairs(
    up: GemvMode,
    down: GemvMode,
    like: impl Fn(&GemvW4Params, &GemvW4Params) -> bool,
) -> Vec<(GemvW4Params, GemvW4Params)> {
    let of = |mode| GEMV_SPACE.iter().filter(move |p| p.mode == mode);
    let mut out = Vec::new();
    for u in of(up) {
        let d = of(down)
            .find(|d| like(u, d))
            .unwrap_or_else(|| panic!("a {down:?} variant like {u:?}"));
        out.push((*u, *d));
    }
    for d in of(down) {
        if !out.iter().any(|(_, x)| x == d) {
            let u = of(up)
                .find(|u| like(u, d))
                .unwrap_or_else(|| panic!("an {up:?} variant like {d:?}"));
            out.push((*u, *d));
        }
    }
    out
}

/// Every [`W4a16Gemv`] candidate: dense ones at ragged sizes with 1 and the most rows they take,
/// routed pairs on small MoE blocks (and, with [`Sizes::Full`], Kimi-sized ones).
pub fn gemv_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = gemv_dense_suite(t, sizes, rng)?;
    out.extend(gemv_moe_suite(t, sizes, sizes == Sizes::Full, rng)?);
    Ok(out)
}

/// Every dense [`W4a16Gemv`] candidate at ragged sizes with 1 and the most rows it takes (and,
/// with [`Sizes::Full`], Kimi-sized ones). K ends in a partial k128 step where the group allows
/// (g32: a k32 group, g64: a k64 group), so the tail's lanes get no scale.
pub fn gemv_dense_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let full = sizes == Sizes::Full;
    let mut out = Vec::new();
    for p in GEMV_SPACE.iter().filter(|p| p.mode == GemvMode::Dense) {
        let mt = gemv::max_tokens(p) as usize;
        let mut cases = match p.group {
            32 => vec![(1, 40, 384), (mt, 19, 160), (mt - 3, 24, 1056)],
            64 => vec![(1, 40, 384), (mt, 19, 192), (mt - 3, 24, 1088)],
            _ => vec![(1, 40, 384), (mt, 19, 256), (mt - 3, 24, 1152)],
        };
        if full {
            cases.extend([
                (1, 4096, 7168),
                (mt, 7168, 2048),
                (mt / 2 + 1, 2048, 7168),
                (3, 4104, 1568usize.next_multiple_of(p.group as usize)),
            ]);
        }
        for (m, n, k) in cases {
            out.push(gemv_dense(t, p, m, n, k, rng)?);
        }
    }
    Ok(out)
}

/// Every (gate_up, down) pair of [`gemv_moe_pairs`] on small MoE blocks; with [`Sizes::Full`]
/// also on wider ones (48 experts, top-8), and with `kimi` on the Kimi K2.6 EP8 slice (slow on
/// the CPU side: the reference dequantizes every expert). Pairs at g64 / g128 take hidden and
/// intermediate sizes rounded up to their group.
pub fn gemv_moe_suite(
    t: &Target<'_>,
    sizes: Sizes,
    kimi: bool,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for (up, down) in gemv_moe_pairs() {
        let tmax = gemv::max_tokens(&up) as usize;
        // (The fourth: more (expert, k step) items than warps, 3 k steps per expert, so `kw`
        // down warps step across experts.)
        let mut cases = vec![
            (1, 3, 128, 32, 2),
            (tmax.min(5), 4, 160, 96, 3),
            (tmax, 3, 256, 32, 4),
            (tmax.min(6), 6, 64, 288, 4),
        ];
        if sizes == Sizes::Full {
            cases = vec![(1, 6, 256, 64, 2), (tmax, 9, 288, 128, 4), (tmax, 48, 512, 128, 8)];
        }
        if kimi {
            cases.extend([(1, 48, 7168, 2048, 8), (tmax, 48, 7168, 2048, 8)]);
        }
        let g = up.group as usize;
        for (tk, e, h, i, topk) in cases {
            let (h, i) = ((h as usize).next_multiple_of(g), (i as usize).next_multiple_of(g));
            out.push(gemv_moe(t, &up, &down, tk, e, h, i, topk, rng)?);
        }
    }
    // The grouped pairs: some experts get more pairs than a block's slots (several blocks).
    for (up, down) in grouped_gemv_pairs() {
        let mut cases = vec![(1, 3, 128, 32, 2), (20, 3, 160, 64, 2)];
        if sizes == Sizes::Full {
            cases = vec![(3, 6, 256, 64, 2), (16, 48, 512, 128, 8), (64, 9, 288, 128, 4)];
        }
        if kimi {
            cases.extend([(16, 48, 7168, 2048, 8), (64, 48, 7168, 2048, 8)]);
        }
        let g = up.group as usize;
        for (tokens, experts, hidden, inter, topk) in cases {
            let shape = MoeShape {
                tokens,
                experts,
                hidden: (hidden as usize).next_multiple_of(g),
                inter: (inter as usize).next_multiple_of(g),
                topk,
            };
            out.push(grouped_gemv_moe(t, &up, &down, shape, rng)?);
        }
    }
    Ok(out)
}
