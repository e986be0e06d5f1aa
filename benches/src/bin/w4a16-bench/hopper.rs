//! The Hopper-only W4A16 GEMMs: the wgmma GEMM and the stream-K GEMM with its fragment repack
//! and activation tiles (`--wg`, `--sk`).

#[allow(unused_imports)]
use super::*;

/// One dense shape: weights in both layouts, rotated; every candidate at every M.
/// The stream-K kernel ([`W4a16GemmSk`]) at one `[n, k]` shape: its compiled candidates, the
/// activation-tiles kernel and enough weight copies in the fragment layout to miss L2.
pub(super) struct SkBench {
    pub(super) kernels: Vec<(W4a16SkParams, CompiledKernel<W4a16GemmSk>)>,
    pub(super) tiles: CompiledKernel<W4a16ActTiles>,
    pub(super) tiles_block: u32,
    pub(super) frags: Vec<CudaSlice<u32>>,
    pub(super) n: usize,
    pub(super) k: usize,
}

impl SkBench {
    /// Compiles every candidate and repacks random `[n, k]` g32 weights on the GPU.
    pub(super) fn new(gpu: &Gpu, n: usize, k: usize, rng: &mut StdRng) -> Result<SkBench, RuntimeError> {
        let s = gpu.stream();
        let repack = gpu.compile::<W4a16RepackFragment>(&RepackParams { block: 256 })?;
        let frags = (0..copies(q_bytes(n, k)))
            .map(|_| {
                let w = random_weights(rng, n, k, 1);
                let (src, sc) = (upload(s, &w.packed)?, upload(s, &scale_words(&w.scales))?);
                let mut dst = s
                    .alloc_zeros::<u32>(fragment_words(n, k))
                    .map_err(RuntimeError::driver("allocating"))?;
                // SAFETY: src is [n, k / 8], the scales [n, k / 32] bf16, dst fragment_words(n, k).
                unsafe {
                    W4a16RepackFragment::launch(&repack, s, 1024u32, &src, &sc, &mut dst, n as u32, k as u32, 32)?
                };
                Ok(dst)
            })
            .collect::<Result<_, RuntimeError>>()?;
        let tp = ActTilesParams { block: 256 };
        Ok(SkBench {
            kernels: SK_SPACE
                .iter()
                .map(|p| Ok((*p, gpu.compile::<W4a16GemmSk>(p)?)))
                .collect::<Result<_, RuntimeError>>()?,
            tiles: gpu.compile::<W4a16ActTiles>(&tp)?,
            tiles_block: tp.block,
            frags,
            n,
            k,
        })
    }

    /// Times candidate `i` at `m` rows, the activation-tiles launch included: (grid, µs).
    pub(super) fn time(
        &self,
        gpu: &Gpu,
        reps: usize,
        i: usize,
        acts: &[CudaSlice<bf16>],
        out: &mut CudaSlice<bf16>,
        m: usize,
    ) -> Result<(u32, f64), RuntimeError> {
        let s = gpu.stream();
        let (p, ck) = &self.kernels[i];
        let (mu, nu, ku) = (m as u32, self.n as u32, self.k as u32);
        let (tiles, _) = p.tiles_chunks(mu, nu, ku);
        let g = gemm_sk::grid(
            p,
            gpu.fingerprint().sm_count as u32,
            ck.max_active_blocks_per_sm()?,
            mu,
            nu,
            ku,
        );
        let tile_len = mu.div_ceil(p.bn) as usize * ku.div_ceil(128) as usize * (p.bn * 128) as usize;
        let mut at = s
            .alloc_zeros::<bf16>(tile_len)
            .map_err(RuntimeError::driver("allocating"))?;
        let mut part = s
            .alloc_zeros::<f32>(p.part_len(g))
            .map_err(RuntimeError::driver("allocating"))?;
        let mut flags = s
            .alloc_zeros::<u32>(tiles as usize)
            .map_err(RuntimeError::driver("allocating"))?;
        let tg = (tile_len as u32 / 8).div_ceil(self.tiles_block).min(1024);
        let us = time_us(s, reps, |r| {
            // SAFETY: the buffers have the shapes the kernels document; g is resident.
            unsafe {
                W4a16ActTiles::launch(&self.tiles, s, tg, &acts[r % acts.len()], &mut at, mu, ku, p.bn)?;
                W4a16GemmSk::launch(
                    ck,
                    s,
                    g,
                    &at,
                    &self.frags[r % self.frags.len()],
                    out,
                    &mut part,
                    &mut flags,
                    mu,
                    nu,
                    ku,
                )
            }
        })?;
        Ok((g, us))
    }
}

/// `--wg`: every warpgroup-kernel candidate launched once (a small ragged case, printed as it
/// goes, so a fault names its variant), the full checks of the kernel, then every candidate on
/// 7168->36864 at `--ms` next to cuBLAS bf16 and the copy bandwidth.
pub(super) fn bench_wg(gpu: &Gpu, args: &Args, seed: u64) -> Result<bool, RuntimeError> {
    let t = Target::Gpu(gpu);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut passed = true;
    if !args.skip_checks {
        for p in WG_DENSE_SPACE.iter().chain(WG_FUSED_SPACE).filter(|p| !p.moe) {
            let r = check::dense::<W4a16GemmWg>(&t, p, 37, 264, 384, 1, &mut rng)?;
            println!(
                "{} {} {}: {:?}",
                if r.passed { "PASS" } else { "FAIL" },
                r.symbol,
                r.case,
                r.comparison
            );
            passed &= r.passed;
        }
        let results = check::wg_suite(&t, Sizes::Full, &mut rng)?;
        passed &= report_checks(&results);
    }
    let bw = ddtree_benches::copy_bandwidth(gpu)?;
    println!("\ncopy bandwidth (device to device, read + write): {bw:.0} GB/s");
    let (k, n) = (7168, 36864);
    let s = gpu.stream();
    let wts = dense_weights(gpu, n, k, &mut rng)?;
    let nb = copies(n * k * 2);
    let bws: Vec<CudaSlice<bf16>> = (0..nb)
        .map(|_| random_bf16_dev(s, &mut rng, n * k))
        .collect::<Result<_, _>>()?;
    let blas = ddtree_runtime::Blas::new(gpu)?;
    let reduce = gpu.compile::<W4a16Reduce>(&ReduceParams {
        block: 256,
        epilogue: Epilogue::Plain,
    })?;
    println!("\n| M | variant x splits | µs | % of copy | vs cuBLAS |\n|---:|---|---:|---:|---:|");
    for &m in &args.ms {
        let acts: Vec<CudaSlice<bf16>> = (0..4)
            .map(|_| random_bf16_dev(s, &mut rng, m * k))
            .collect::<Result<_, _>>()?;
        let mut out = s
            .alloc_zeros::<bf16>(m * n)
            .map_err(RuntimeError::driver("allocating"))?;
        let mut scratch = Scratch::new(s, 4 * m * n)?;
        let cublas = time_us(s, args.reps, |i| {
            // SAFETY: a is m x k, b is n x k, c is m x n.
            unsafe { blas.linear(&acts[i % 4], &bws[i % nb], &mut out, m, n, k) }
        })?;
        let bytes = (q_bytes(n, k) + 2 * m * k + 2 * m * n) as f64;
        println!("| {m} | cuBLAS bf16 | {cublas:.1} | | |");
        for p in WG_DENSE_SPACE.iter().filter(|p| p.group == 32) {
            let gk = gpu.compile::<W4a16GemmWg>(p)?;
            let splits: &[u32] = if p.splitk { &[1, 2, 4] } else { &[1] };
            let data = (&wts[..], &acts[..], &mut scratch, &mut out);
            let kern = (p, &gk, p.splitk.then_some(&reduce));
            for (sp, us) in time_splits(s, args.reps, kern, data, [m, n, k], splits)? {
                let pct = 100.0 * bytes / (us * 1e-6) / 1e9 / bw;
                println!(
                    "| {m} | {} x{sp} | {us:.1} | {pct:.0}% | {:.2}x |",
                    short_wg(p),
                    cublas / us
                );
            }
        }
    }
    // The MoE block on the EP8 slice: the best grouped mma.sync pair against each warpgroup pair.
    let mb = MoeBench::new(gpu, &mut rng)?;
    let kernels = grouped_kernels(gpu)?;
    let wg_pairs: Vec<(MoeKernels, (W4a16WgParams, W4a16WgParams))> = check::wg_moe_pairs()
        .into_iter()
        .map(|(u, d)| Ok((MoeKernels::new(gpu, GroupedPair::Wg(u, d))?, (u, d))))
        .collect::<Result<_, RuntimeError>>()?;
    println!("\nMoE, EP8 slice ({MOE_EXPERTS} experts, {MOE_HIDDEN} / {MOE_INTER}, top-{MOE_TOPK}), grouped path");
    println!("| T | touched MB | mma.sync pair µs | % of copy | wgmma pair | µs | % of copy |\n|---:|---:|---:|---:|---|---:|---:|");
    for tokens in [8usize, 16, 32, 64] {
        let routes = mb.routes(s, tokens, MOE_EXPERTS, &mut rng)?;
        let x = random_bf16_dev(s, &mut rng, tokens * MOE_HIDDEN)?;
        let mut out = s
            .alloc_zeros::<bf16>(tokens * MOE_HIDDEN)
            .map_err(RuntimeError::driver("allocating"))?;
        let (us, _) = best_grouped(&mb, s, args.reps, &kernels, tokens, &routes, &x, &mut out)?;
        let bytes = routes.touched * mb.per_expert as f64;
        let pct = |us: f64| 100.0 * bytes / (us * 1e-6) / 1e9 / bw;
        for (kern, (up, _)) in &wg_pairs {
            let wus = mb.time(
                s,
                args.reps,
                kern,
                up.layout,
                MoePath::Grouped,
                tokens,
                &routes,
                &x,
                &mut out,
            )?;
            println!(
                "| {tokens} | {:.0} | {us:.1} | {:.0}% | {} | {wus:.1} | {:.0}% |",
                bytes / 1e6,
                pct(us),
                short_wg(up),
                pct(wus)
            );
        }
    }
    Ok(passed)
}

/// `--sk`: the stream-K kernel's checks, then each candidate on 7168->36864 at `--ms` (the
/// activation-tiles launch included in its time) next to cuBLAS bf16 and the engine's
/// `wgmma` default.
pub(super) fn bench_sk(gpu: &Gpu, args: &Args, seed: u64) -> Result<bool, RuntimeError> {
    let t = Target::Gpu(gpu);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut passed = true;
    if !args.skip_checks {
        let results = check::sk_suite(&t, Sizes::Full, &mut rng)?;
        passed &= report_checks(&results);
    }
    let bw = ddtree_benches::copy_bandwidth(gpu)?;
    println!("\ncopy bandwidth (device to device, read + write): {bw:.0} GB/s");
    let (k, n) = (7168, 36864);
    let s = gpu.stream();
    let sk = SkBench::new(gpu, n, k, &mut rng)?;
    let wts = dense_weights(gpu, n, k, &mut rng)?;
    let nb = copies(n * k * 2);
    let bws: Vec<CudaSlice<bf16>> = (0..nb)
        .map(|_| random_bf16_dev(s, &mut rng, n * k))
        .collect::<Result<_, _>>()?;
    let blas = ddtree_runtime::Blas::new(gpu)?;
    let reduce = gpu.compile::<W4a16Reduce>(&ReduceParams {
        block: 256,
        epilogue: Epilogue::Plain,
    })?;
    println!("\n| M | variant (grid) | µs | % of copy | vs cuBLAS |\n|---:|---|---:|---:|---:|");
    for &m in &args.ms {
        let acts: Vec<CudaSlice<bf16>> = (0..4)
            .map(|_| random_bf16_dev(s, &mut rng, m * k))
            .collect::<Result<_, _>>()?;
        let mut out = s
            .alloc_zeros::<bf16>(m * n)
            .map_err(RuntimeError::driver("allocating"))?;
        let bytes = (q_bytes(n, k) + 2 * m * k + 2 * m * n) as f64;
        let cublas = time_us(s, args.reps, |i| {
            // SAFETY: a is m x k, b is n x k, c is m x n.
            unsafe { blas.linear(&acts[i % 4], &bws[i % nb], &mut out, m, n, k) }
        })?;
        println!("| {m} | cuBLAS bf16 | {cublas:.1} | | |");
        if let Some((p, splits)) = gemm_wg::default_dense(m as u32, n as u32, k as u32) {
            let gk = gpu.compile::<W4a16GemmWg>(&p)?;
            let mut scratch = Scratch::new(s, 4 * m * n)?;
            let data = (&wts[..], &acts[..], &mut scratch, &mut out);
            let kern = (&p, &gk, p.splitk.then_some(&reduce));
            for (sp, us) in time_splits(s, args.reps, kern, data, [m, n, k], &[splits])? {
                let pct = 100.0 * bytes / (us * 1e-6) / 1e9 / bw;
                println!(
                    "| {m} | engine default {} x{sp} | {us:.1} | {pct:.0}% | {:.2}x |",
                    short_wg(&p),
                    cublas / us
                );
            }
        }
        for i in 0..sk.kernels.len() {
            let (g, us) = sk.time(gpu, args.reps, i, &acts, &mut out, m)?;
            let pct = 100.0 * bytes / (us * 1e-6) / 1e9 / bw;
            println!(
                "| {m} | sk {} (grid {g}) | {us:.1} | {pct:.0}% | {:.2}x |",
                short_sk(&sk.kernels[i].0),
                cublas / us
            );
        }
    }
    Ok(passed)
}
