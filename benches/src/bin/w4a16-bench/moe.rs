//! The MoE block's benchmark: grouped GEMM and GEMV pairs over random routings (`--moe`).

#[allow(unused_imports)]
use super::*;

/// The MoE bench data: a Kimi K2.6 EP8 slice (48 local experts, 7168 / 2048, top-8) in both
/// layouts.
pub(super) struct MoeBench {
    pub(super) s13: CudaSlice<u32>,
    pub(super) s2: CudaSlice<u32>,
    pub(super) layouts: Vec<(Layout, CudaSlice<u32>, CudaSlice<u32>)>,
    pub(super) per_expert: usize,
}

pub(super) const MOE_EXPERTS: usize = 48;
pub(super) const MOE_HIDDEN: usize = 7168;
pub(super) const MOE_INTER: usize = 2048;
pub(super) const MOE_TOPK: usize = 8;

/// Random routings per token count (rotated), their device copies, and the mean experts touched.
pub(super) struct Routes {
    pub(super) sets: Vec<(CudaSlice<u32>, CudaSlice<f32>)>,
    pub(super) touched: f64,
}

impl MoeBench {
    pub(super) fn new(gpu: &Gpu, rng: &mut StdRng) -> Result<MoeBench, RuntimeError> {
        let s = gpu.stream();
        // One random expert repeated: the same traffic as distinct experts, far faster to make.
        let one13 = random_weights(rng, 2 * MOE_INTER, MOE_HIDDEN, 1);
        let one2 = random_weights(rng, MOE_HIDDEN, MOE_INTER, 1);
        let rep = |p: &PackedInt4| PackedInt4 {
            packed: p.packed.repeat(MOE_EXPERTS),
            scales: p.scales.repeat(MOE_EXPERTS),
            experts: MOE_EXPERTS,
            ..p.clone()
        };
        let (w13, w2) = (rep(&one13), rep(&one2));
        let mut layouts = Vec::new();
        for l in [Layout::Interleaved, Layout::Checkpoint] {
            layouts.push((l, device_weights(gpu, &w13, l)?, device_weights(gpu, &w2, l)?));
        }
        Ok(MoeBench {
            s13: upload(s, &scale_words(&w13.scales))?,
            s2: upload(s, &scale_words(&w2.scales))?,
            layouts,
            per_expert: w13.bytes_per_expert() + w2.bytes_per_expert(),
        })
    }

    /// The experts in `layout`.
    pub(super) fn experts(&self, layout: Layout) -> DeviceExperts<'_> {
        let (_, w13, w2) = self
            .layouts
            .iter()
            .find(|(l, ..)| *l == layout)
            .expect("both layouts made");
        DeviceExperts {
            w13,
            s13: &self.s13,
            w2,
            s2: &self.s2,
            experts: MOE_EXPERTS as u32,
            hidden: MOE_HIDDEN as u32,
            inter: MOE_INTER as u32,
        }
    }

    /// Eight random routings of `tokens` tokens, each token's top-k among the first
    /// `route_experts` experts (at least top-k, at most all).
    pub(super) fn routes(
        &self,
        s: &Arc<CudaStream>,
        tokens: usize,
        route_experts: usize,
        rng: &mut StdRng,
    ) -> Result<Routes, RuntimeError> {
        let mut sets = Vec::new();
        let mut touched = 0usize;
        for _ in 0..8 {
            let (ids, w) = random_routing(rng, tokens, MOE_TOPK, route_experts.clamp(MOE_TOPK, MOE_EXPERTS));
            let mut t: Vec<u32> = ids.clone();
            t.sort_unstable();
            t.dedup();
            touched += t.len();
            sets.push((upload(s, &ids)?, upload(s, &w)?));
        }
        Ok(Routes {
            touched: touched as f64 / sets.len() as f64,
            sets,
        })
    }

    /// Times `kern`'s `path` on `tokens` tokens.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn time(
        &self,
        s: &Arc<CudaStream>,
        reps: usize,
        kern: &MoeKernels,
        layout: Layout,
        path: MoePath,
        tokens: usize,
        routes: &Routes,
        x: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<f64, RuntimeError> {
        let ex = self.experts(layout);
        let mut bufs = kern.buffers(s, tokens, MOE_TOPK, &ex)?;
        let (t, k) = (tokens as u32, MOE_TOPK as u32);
        time_us(s, reps, |i| {
            let (ids, w) = &routes.sets[i % routes.sets.len()];
            let input = MoeInput {
                x,
                topk_ids: ids,
                topk_w: w,
                tokens: t,
                topk: k,
            };
            // SAFETY: shapes as documented; weights in the kernels' layout.
            unsafe {
                match path {
                    MoePath::Gemv => kern.run_gemv(s, &ex, &input, out, &mut bufs),
                    MoePath::GroupedGemv => kern.run_grouped_gemv(s, &ex, &input, out, &mut bufs),
                    MoePath::Grouped => kern.run_grouped(s, &ex, &input, out, &mut bufs),
                }
            }
        })
    }

    /// One timing of `kern`'s `path` at `tokens` (fresh routing over every expert and input,
    /// 20 calls), printed after `label`: launches for a profiler.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn profile(
        &self,
        s: &Arc<CudaStream>,
        kern: &MoeKernels,
        layout: Layout,
        path: MoePath,
        tokens: usize,
        label: &str,
        rng: &mut StdRng,
    ) -> Result<(), RuntimeError> {
        let routes = self.routes(s, tokens, MOE_EXPERTS, rng)?;
        let x = random_bf16_dev(s, rng, tokens * MOE_HIDDEN)?;
        let mut out = s
            .alloc_zeros::<bf16>(tokens * MOE_HIDDEN)
            .map_err(RuntimeError::driver("allocating"))?;
        let us = self.time(s, 1, kern, layout, path, tokens, &routes, &x, &mut out)?;
        println!("{label} at T = {tokens}: {us:.1} µs");
        Ok(())
    }
}

/// Which of [`MoeKernels`]' paths a timing runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MoePath {
    /// The grouped GEMMs (`run_grouped`).
    Grouped,
    /// The small-token GEMVs (`run_gemv`).
    Gemv,
    /// The grouped GEMVs (`run_grouped_gemv`).
    GroupedGemv,
}

/// Compiled MoE kernels and the (gate_up, down) pair they were made for.
pub(super) type MoePair<P> = (MoeKernels, (P, P));

/// Every grouped (gate_up, down) pair, compiled.
pub(super) fn grouped_kernels(gpu: &Gpu) -> Result<Vec<MoePair<W4a16Params>>, RuntimeError> {
    moe_pairs()
        .into_iter()
        .map(|(u, d)| Ok((MoeKernels::new(gpu, GroupedPair::Mma(u, d))?, (u, d))))
        .collect()
}

/// Every g32 small-token (gate_up, down) pair, compiled (next to the default grouped pair).
pub(super) fn gemv_moe_kernels(gpu: &Gpu) -> Result<Vec<MoePair<GemvW4Params>>, RuntimeError> {
    let (gu, gd) = pairs_default();
    check::gemv_moe_pairs()
        .into_iter()
        .filter(|(u, _)| u.group == 32)
        .map(|(u, d)| {
            Ok((
                MoeKernels::new(gpu, GroupedPair::Mma(gu, gd))?.with_gemv(gpu, Some((&u, &d)))?,
                (u, d),
            ))
        })
        .collect()
}

/// Every g32 grouped GEMV (gate_up, down) pair, compiled (next to the default grouped pair).
pub(super) fn grouped_gemv_kernels(gpu: &Gpu) -> Result<Vec<MoePair<GemvW4Params>>, RuntimeError> {
    let (gu, gd) = pairs_default();
    check::grouped_gemv_pairs()
        .into_iter()
        .filter(|(u, _)| u.group == 32)
        .map(|(u, d)| {
            Ok((
                MoeKernels::new(gpu, GroupedPair::Mma(gu, gd))?.with_grouped_gemv(gpu, Some((&u, &d)))?,
                (u, d),
            ))
        })
        .collect()
}

/// The fastest grouped pair at `tokens`: µs and label.
#[allow(clippy::too_many_arguments)]
pub(super) fn best_grouped(
    mb: &MoeBench,
    s: &Arc<CudaStream>,
    reps: usize,
    kernels: &[MoePair<W4a16Params>],
    tokens: usize,
    routes: &Routes,
    x: &CudaSlice<bf16>,
    out: &mut CudaSlice<bf16>,
) -> Result<(f64, String), RuntimeError> {
    let mut best: Option<(f64, String)> = None;
    for (kern, (up, down)) in kernels {
        let us = mb.time(s, reps, kern, up.layout, MoePath::Grouped, tokens, routes, x, out)?;
        if best.as_ref().is_none_or(|(b, _)| us < *b) {
            best = Some((us, format!("{} / {}", short(up), short(down))));
        }
    }
    Ok(best.expect("at least one grouped pair"))
}

pub(super) fn bench_moe(gpu: &Gpu, bw: f64, args: &Args, rng: &mut StdRng) -> Result<(), RuntimeError> {
    let reps = args.reps;
    let s = gpu.stream();
    let mb = MoeBench::new(gpu, rng)?;
    println!("\nMoE W4A16, Kimi K2.6 EP8 slice: {MOE_EXPERTS} local experts, hidden {MOE_HIDDEN}, inter {MOE_INTER}, top-{MOE_TOPK} routed among the local experts; {:.1} MB per expert", mb.per_expert as f64 / 1e6);
    println!("| T | touched experts | touched MB | grouped µs | GB/s | % of copy | best grouped pair | gemv µs | GB/s | % of copy | best gemv pair | grouped gemv µs | GB/s | % of copy | best grouped gemv pair |");
    println!("|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---|");
    let gemv_kernels = gemv_moe_kernels(gpu)?;
    let grouped_gemv = grouped_gemv_kernels(gpu)?;
    let kernels = grouped_kernels(gpu)?;
    let token_counts = &args.moe_tokens;
    // Every grouped GEMV pair's µs per token count, for the table after this one.
    let mut grouped_gemv_us = vec![Vec::new(); grouped_gemv.len()];
    for &tokens in token_counts {
        let routes = mb.routes(s, tokens, args.route_experts, rng)?;
        let x = random_bf16_dev(s, rng, tokens * MOE_HIDDEN)?;
        let mut out = s
            .alloc_zeros::<bf16>(tokens * MOE_HIDDEN)
            .map_err(RuntimeError::driver("allocating"))?;
        let (us, label) = best_grouped(&mb, s, reps, &kernels, tokens, &routes, &x, &mut out)?;
        let bytes = routes.touched * mb.per_expert as f64;
        let gbs = bytes / (us * 1e-6) / 1e9;
        // The best pair of `pairs` on `path` (those that take `tokens`) as table cells.
        let mut column = |pairs: &[MoePair<GemvW4Params>], path: MoePath| -> Result<String, RuntimeError> {
            let mut best: Option<(f64, String)> = None;
            for (i, (kern, (up, down))) in pairs.iter().enumerate() {
                if path == MoePath::Gemv && !kern.uses_gemv(tokens as u32, MOE_TOPK as u32) {
                    continue;
                }
                let us = mb.time(s, reps, kern, Layout::Interleaved, path, tokens, &routes, &x, &mut out)?;
                if path == MoePath::GroupedGemv {
                    grouped_gemv_us[i].push(us);
                }
                if best.as_ref().is_none_or(|(b, _)| us < *b) {
                    best = Some((us, format!("{} / {}", short_gemv(up), short_gemv(down))));
                }
            }
            Ok(match best {
                Some((gus, gl)) => {
                    let gg = bytes / (gus * 1e-6) / 1e9;
                    format!("{gus:.1} | {gg:.0} | {:.0}% | {gl}", 100.0 * gg / bw)
                }
                None => "- | - | - | (not taken)".into(),
            })
        };
        let gemv_col = column(&gemv_kernels, MoePath::Gemv)?;
        let grouped_gemv_col = column(&grouped_gemv, MoePath::GroupedGemv)?;
        println!(
            "| {tokens} | {:.1} | {:.0} | {us:.1} | {gbs:.0} | {:.0}% | {label} | {gemv_col} | {grouped_gemv_col} |",
            routes.touched,
            bytes / 1e6,
            100.0 * gbs / bw
        );
    }
    println!("\nGrouped GEMV pairs (align + 2 GEMVs + sum), µs");
    println!(
        "| pair | {} |",
        token_counts
            .iter()
            .map(|t| format!("T = {t}"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---|{}", "---:|".repeat(token_counts.len()));
    for ((_, (up, down)), us) in grouped_gemv.iter().zip(&grouped_gemv_us) {
        let cells: Vec<String> = us.iter().map(|u| format!("{u:.1}")).collect();
        println!("| {} / {} | {} |", short_gemv(up), short_gemv(down), cells.join(" | "));
    }
    Ok(())
}
