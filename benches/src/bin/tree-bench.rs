//! DDTree step kernels on the GPU, in one run: checks against the CPU references (builder,
//! verify attention, sampling, accept, compaction), then timings: build (every variant, and the
//! engine's: the tuned variant of the key from this GPU's tune cache, else the default) +
//! accept at B = 16/64/256/1024 (L = 7 and 15, V = 163840) as device time of back-to-back
//! calls replayed from a CUDA graph (no host launch overhead, as a captured engine step), the
//! builder's stages (slice, merge, expansion, tree arrays + masks) the same way, and verify
//! attention at ctx 1K/4K/16K/32K x nodes 1/2/4/8/16/32/64 x heads 8 and 64 against the floor
//! (measured copy bandwidth and cuBLAS bf16 rate) and the naive per-(node, head) kernel.
//! Verify attention times every candidate of `mla_verify_wide`, `mla_verify_split` and
//! `mla_verify_wg` (rows per block, KV tile, ring depth) at the automatic split count, half and
//! twice it (split pass + combine, graph-timed as the builder, each call on another copy of
//! the cache so that it comes from DRAM; the naive kernel is timed eagerly), prints each
//! candidate's best and marks the case's best, and times the best one's split pass alone (the
//! rest is the combine); the prefix length is passed on the device, as the engine does. Prints
//! a compact table at the end; exits non-zero if a check fails.
//!
//! Usage: `tree-bench [--seed N] [--skip-checks] [--skip-bench] [--build-only | --verify-only]
//! [--contexts 1024,32768] [--heads 8] [--nodes 1,64] [--pdl]`.

use std::process::ExitCode;

use clap::Parser;
use ddtree_codegen::Kernel;
use ddtree_kernels::check::{CheckResult, Sizes, Target};
use ddtree_kernels::tree::check::{self, random_mask, LOGITS_PROFILES};
use ddtree_kernels::tree::gpu::{
    builder_fits, upload, zeros, BuildStage, GpuAccept, GpuBuilder, GpuVerify, VerifyShape,
};
use ddtree_kernels::tree::{MlaVerifyWg, TreeBuild, VerifyVariant, WideParams, LATENT, ROW};
use ddtree_kernels::tune::TreeBuildKey;
use ddtree_runtime::timing::{graph_us, median_us};
use ddtree_runtime::{Gpu, RuntimeError, TunedKernels};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

#[derive(Parser)]
#[command(about = "Check and time the DDTree step kernels on the GPU")]
struct Args {
    /// Seed for the random inputs (default: from the clock; printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Skip the checks.
    #[arg(long)]
    skip_checks: bool,
    /// Skip the timings.
    #[arg(long)]
    skip_bench: bool,
    /// Only the builder and accept (checks and timings), not the verify attention.
    #[arg(long, conflicts_with = "verify_only")]
    build_only: bool,
    /// Only the verify-attention timings, not the builder's (the checks are all run).
    #[arg(long)]
    verify_only: bool,
    /// For a profiler: two builds (L = 7, B = 64, V = 163840, `random` or `confident` logits)
    /// stopped after stage 0-3 (slice, merge, expansion, all), nothing else.
    #[arg(long, value_names = ["STAGE", "LOGITS"], num_args = 2)]
    profile_build: Option<Vec<String>>,
    /// For a profiler: two launches of the verify attention (`--profile-nodes` nodes x
    /// `--profile-heads` heads, the automatic split count) at context CTX, nothing else:
    /// `--profile-variant`, or as the engine's `--attention auto` on sm_90: `mla_verify_narrow`
    /// for at most 8 rows, `mla_verify_wg`'s default for trees and past 16K keys, else
    /// `mla_verify_wide` rg2.
    #[arg(long, value_name = "CTX")]
    profile_verify: Option<usize>,
    /// Nodes of `--profile-verify` (a random tree).
    #[arg(long, value_name = "NODES", default_value_t = 1)]
    profile_nodes: usize,
    /// Heads of `--profile-verify`.
    #[arg(long, value_name = "HEADS", default_value_t = 64)]
    profile_heads: usize,
    /// The split-pass variant of `--profile-verify`: the first whose symbol contains this
    /// (default: as the engine picks, see `--profile-verify`).
    #[arg(long, value_name = "SYMBOL")]
    profile_variant: Option<String>,
    /// Verify timings only at these contexts (comma-separated; default 1024,4096,16384,32768).
    #[arg(long, value_delimiter = ',', default_values_t = [1024usize, 4096, 16384, 32768])]
    contexts: Vec<usize>,
    /// Verify timings only at these head counts (default 8,64).
    #[arg(long, value_delimiter = ',', default_values_t = [8usize, 64])]
    heads: Vec<usize>,
    /// Verify timings only at these node counts (default 1,2,4,8,16,32,64).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4, 8, 16, 32, 64])]
    nodes: Vec<usize>,
    /// Launch every kernel with programmatic dependent launch (each kernel's launch overlaps
    /// its predecessor's tail), as the engine does for steps of at most 8 tokens.
    #[arg(long)]
    pdl: bool,
}

/// `--profile-build STAGE LOGITS`: two launches of the default builder (profile the second).
fn profile_build(gpu: &Gpu, rng: &mut StdRng, stage: &str, logits: &str) -> Result<(), String> {
    let stage = match stage {
        "0" => BuildStage::Slice,
        "1" => BuildStage::Merge,
        "2" => BuildStage::Expand,
        "3" => BuildStage::All,
        _ => return Err(format!("--profile-build: stage must be 0..3, got {stage}")),
    };
    let Some((_, make)) = LOGITS_PROFILES.into_iter().find(|(name, _)| *name == logits) else {
        return Err(format!(
            "--profile-build: logits must be random or confident, got {logits}"
        ));
    };
    let s = gpu.stream();
    let (l, v, b) = (7, 163840, 64);
    let host = make(rng, l, v);
    let run = || -> Result<(), RuntimeError> {
        let lg = upload(s, &host)?;
        let root = upload(s, &[5u32])?;
        let mut bld = GpuBuilder::new(gpu, l, v, b)?;
        for _ in 0..2 {
            bld.build_until(s, &lg, &root, stage)?;
        }
        s.synchronize().map_err(RuntimeError::driver("synchronizing"))
    };
    run().map_err(|e| e.to_string())
}

/// `--profile-verify CTX` (with `--profile-nodes`, `--profile-heads`, `--profile-variant`): two
/// launches of the verify attention (profile the second).
fn profile_verify(gpu: &Gpu, rng: &mut StdRng, args: &Args, ctx: usize) -> Result<(), RuntimeError> {
    let s = gpu.stream();
    let (nodes, heads) = (args.profile_nodes, args.profile_heads);
    let v = match &args.profile_variant {
        Some(name) => VerifyVariant::all()
            .into_iter()
            .find(|v| v.symbol().contains(name.as_str()))
            .ok_or_else(|| RuntimeError::Launch {
                kernel: name.clone(),
                reason: "no verify variant's symbol contains this".into(),
            })?,
        None if nodes * heads <= VerifyVariant::Narrow.rows_per_block() as usize => VerifyVariant::Narrow,
        None if nodes > 1 || ctx > 16384 => VerifyVariant::Wg(MlaVerifyWg::default_params()),
        None => VerifyVariant::Wide(WideParams {
            rg: 2,
            bn: 64,
            stages: 2,
            qk: 16,
        }),
    };
    let mut verify = GpuVerify::new(gpu, &v, BENCH_PARTIALS)?;
    let (cache, _) = ddtree_kernels::check::random_bf16(rng, (ctx + nodes) * ROW, -1.0, 1.0);
    let (q, _) = ddtree_kernels::check::random_bf16(rng, nodes * heads * ROW, -1.0, 1.0);
    let (mask, words) = random_mask(rng, nodes, false);
    let (cache, q, mask, lens) = (
        upload(s, &cache)?,
        upload(s, &q)?,
        upload(s, &mask)?,
        upload(s, &[ctx as u32])?,
    );
    let mut out = zeros::<bf16>(s, nodes * heads * LATENT)?;
    let mut lse = zeros::<f32>(s, nodes * heads)?;
    let sh = VerifyShape {
        nodes,
        heads,
        prefix: ctx,
        words,
        scale: 0.1,
    };
    let splits = verify.auto_splits(132, &sh);
    println!("profile-verify: ctx {ctx}, {} with {splits} splits", v.symbol());
    for _ in 0..2 {
        verify.run(s, &sh, splits, &q, &cache, &mask, &lens, &mut out, &mut lse)?;
    }
    s.synchronize().map_err(RuntimeError::driver("synchronizing"))
}

fn checks(gpu: &Gpu, rng: &mut StdRng, build_only: bool) -> Vec<CheckResult> {
    let mut all = Vec::new();
    let mut push = |what: String, r: Result<Vec<CheckResult>, RuntimeError>| match r {
        Ok(v) => all.extend(v),
        Err(e) => {
            println!("ERROR {what}: {e}");
            all.push(CheckResult {
                kernel: "error",
                symbol: what,
                case: e.to_string(),
                comparison: ddtree_kernels::check::compare(
                    &[f32::NAN],
                    &[0.0],
                    ddtree_kernels::check::Tolerance::EXACT,
                ),
                passed: false,
            });
        }
    };
    for &(l, v, b) in &[
        (7, 163840, 16),
        (7, 163840, 64),
        (7, 163840, 256),
        (15, 163840, 1024),
        (7, 163840, 1024),
        (15, 163840, 64),
        (15, 163840, 256),
        (7, 163840, 64),
        (3, 1000, 300),
        (2, 50, 40),
        (4, 9, 30),
        (5, 20000, 700),
    ] {
        push(format!("builder {l} {v} {b}"), check::builder(gpu, l, v, b, rng));
    }
    if !build_only {
        push(
            "verify".into(),
            check::verify_suite(&Target::Gpu(gpu), Sizes::Full, rng).map_err(RuntimeError::from),
        );
    }
    for &(l, v, b) in &[(7, 163840, 64), (15, 163840, 256), (7, 1000, 1024)] {
        push(format!("accept {l} {v} {b}"), check::accept(gpu, l, v, b, rng));
    }
    all
}

fn bf16_rate(gpu: &Gpu) -> Result<f64, RuntimeError> {
    let s = gpu.stream();
    let blas = ddtree_runtime::Blas::new(gpu)?;
    let n = 8192usize;
    let a = upload(s, &vec![bf16::from_f32(0.01); n * n])?;
    let mut c = zeros::<bf16>(s, n * n)?;
    let us = median_us(s, 2, 5, |_| {
        // SAFETY: a and c hold n * n elements.
        unsafe { blas.linear(&a, &a, &mut c, n, n, n) }
    })?;
    Ok(2.0 * (n as f64).powi(3) / (us * 1e-6) / 1e12)
}

/// Graph replays per timing sample (each build reads the next of the rotated logits copies).
const PER_GRAPH: usize = 16;

fn bench_build(gpu: &Gpu, rng: &mut StdRng, rows: &mut Vec<String>) -> Result<(), RuntimeError> {
    let s = gpu.stream();
    let tuned = TunedKernels::new(gpu.clone());
    let v = 163840usize;
    let mut phases = Vec::new();
    println!("\nDevice time per call, {PER_GRAPH} calls back to back in a CUDA graph (as a captured engine step); eager = one launch timed alone, host launch overhead included.");
    println!("\n| logits | L | B | default variant µs (first that fits) | best variant µs | engine's variant µs | accept µs | compact 61 layers µs | build+accept µs (engine's) | build eager µs (engine's) |");
    println!("|---|---:|---:|---:|---|---|---:|---:|---:|---:|");
    for ((name, make), l) in LOGITS_PROFILES.into_iter().flat_map(|m| [7usize, 15].map(|l| (m, l))) {
        let copies: Vec<_> = (0..8).map(|_| upload(s, &make(rng, l, v))).collect::<Result<_, _>>()?;
        for b in [16usize, 64, 256, 1024] {
            let mut acc = GpuAccept::new(gpu, l)?;
            let mut root = upload(s, &[5u32])?;
            let target = upload(s, &vec![0u32; b + 1])?;
            let mut best: Option<(f64, String)> = None;
            let mut default_us = None;
            for p in TreeBuild::space() {
                if !builder_fits(&p, v, b) {
                    println!(
                        "  {} skipped at V = {v}, B = {b} (too many slice candidates)",
                        TreeBuild::symbol(&p)
                    );
                    continue;
                }
                let mut bld = GpuBuilder::with_params(gpu, &p, l, v, b)?;
                let us = graph_us(s, PER_GRAPH, 3, 20, |i| bld.build(s, &copies[i % copies.len()], &root))?;
                println!("  {} at L = {l}, B = {b}: {us:.1} µs", TreeBuild::symbol(&p));
                default_us.get_or_insert(us);
                if best.as_ref().is_none_or(|x| us < x.0) {
                    best = Some((us, TreeBuild::symbol(&p)));
                }
            }
            let (best_us, best_sym) = best.expect("at least one variant");
            let default_us = default_us.expect("a variant that fits");
            // The engine's builder: the tuned variant of the key (from this GPU's tune cache,
            // `autotune --kernels tree_build`), else the default.
            let key = TreeBuildKey {
                depth: l,
                vocab: v,
                budget: b,
            };
            let choice = tuned.choose::<TreeBuild>(&key);
            let engine_sym = format!(
                "{}{}",
                TreeBuild::symbol(&choice.params),
                if choice.is_tuned() { " (tuned)" } else { " (default)" }
            );
            let mut bld = GpuBuilder::with_kernel(gpu, tuned.get::<TreeBuild>(&key)?, l, v, b)?;
            let eager = median_us(s, 5, 50, |i| bld.build(s, &copies[i % copies.len()], &root))?;
            // Cumulative stage times; each stage's own time is the difference.
            let mut cum = [0.0f64; 4];
            for (c, stage) in cum.iter_mut().zip([
                BuildStage::Slice,
                BuildStage::Merge,
                BuildStage::Expand,
                BuildStage::All,
            ]) {
                *c = graph_us(s, PER_GRAPH, 3, 20, |i| {
                    bld.build_until(s, &copies[i % copies.len()], &root, stage)
                })?;
            }
            phases.push((name, l, b, cum));
            bld.build(s, &copies[0], &root)?;
            let accept = graph_us(s, PER_GRAPH, 3, 20, |_| acc.accept(s, &bld, &target, &mut root))?;
            let mut cache = zeros::<bf16>(s, 61 * 4096 * ROW)?;
            let compact = median_us(s, 3, 20, |_| acc.compact(s, &mut cache, 61, 3000, ROW, 4096 * ROW))?;
            let both = graph_us(s, PER_GRAPH, 3, 20, |i| {
                bld.build(s, &copies[i % copies.len()], &root)?;
                acc.accept(s, &bld, &target, &mut root)
            })?;
            let engine_us = cum[3];
            println!(
                "| {name} | {l} | {b} | {default_us:.1} | {best_us:.1} {best_sym} | {engine_us:.1} {engine_sym} | {accept:.1} | {compact:.1} | {both:.1} | {eager:.1} |"
            );
            rows.push(format!("build {name:<9} L={l:<2} B={b:<5} default {default_us:>8.1} µs (best {best_us:.1} {best_sym}; engine {engine_us:.1} {engine_sym})  accept {accept:>6.1} µs  compact {compact:>6.1} µs  build+accept {both:>8.1} µs  (eager build {eager:.1} µs)"));
        }
    }
    println!("\nBuilder stages (the engine's variant, tuned or default, graph-timed; a stage = the launch stopped after it minus the launch stopped before it):");
    println!("\n| logits | L | B | slice µs | merge µs | expand loop µs | tree+mask µs | total µs |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (name, l, b, c) in phases {
        println!(
            "| {name} | {l} | {b} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            c[0],
            c[1] - c[0],
            c[2] - c[1],
            c[3] - c[2],
            c[3]
        );
        rows.push(format!(
            "stages {name:<9} L={l:<2} B={b:<5} slice {:>6.1}  merge {:>6.1}  expand {:>7.1}  tree+mask {:>6.1}  total {:>7.1} µs",
            c[0],
            c[1] - c[0],
            c[2] - c[1],
            c[3] - c[2],
            c[3]
        ));
    }
    Ok(())
}

/// The most KV splits the verify bench tries.
const MAX_SPLITS: usize = 256;

/// Rows x splits of each variant's partial buffers in the verify bench.
const BENCH_PARTIALS: usize = 64 * 64 * 64;

/// Most nodes at which the verify table also times the decode step's path (split pass, then
/// `mla_combine_output`), as the engine takes it for one or two tokens.
const OUTPUT_MAX_NODES: usize = 2;

/// Verify attention at ctx 1K/4K/16K/32K x nodes 1/2/4/8/16/32/64 x heads 8 and 64: every
/// candidate of the split passes (with the combine) at the automatic split count, half and
/// twice it, and the naive per-(node, head) kernel; one line per candidate (its best split
/// count) with µs, % of the copy floor (cache bytes at the measured copy bandwidth), TFLOP/s and
/// % of the cuBLAS bf16 rate, the case's best marked `*`; the summary line gives the best's
/// speedup over the naive kernel.
fn bench_verify(
    gpu: &Gpu,
    rng: &mut StdRng,
    args: &Args,
    bw: f64,
    tflops: f64,
    rows_out: &mut Vec<String>,
) -> Result<(), RuntimeError> {
    let s = gpu.stream();
    let sms = 132;
    let mut verifiers = Vec::new();
    let cc = gpu.fingerprint().compute_capability;
    for v in VerifyVariant::all() {
        if !v.runs_on(cc) {
            println!(
                "skipping {}: wgmma needs an sm_90 GPU, this one is sm_{}{}",
                v.symbol(),
                cc.0,
                cc.1
            );
            continue;
        }
        match GpuVerify::new(gpu, &v, BENCH_PARTIALS) {
            Ok(g) => verifiers.push(g),
            Err(e) => println!("skipping {}: {e}", v.symbol()),
        }
    }
    println!("\nVerify: split pass + combine, device time per call, {PER_GRAPH} calls back to back in a CUDA graph (naive: eager).");
    println!("\n| ctx | nodes x heads | variant | splits | µs | % copy floor | TFLOP/s | % bf16 rate | best |");
    println!("|---:|---|---|---:|---:|---:|---:|---:|---|");
    let cases = args
        .contexts
        .iter()
        .flat_map(|&c| args.heads.iter().map(move |&h| (c, h)))
        .flat_map(|(c, h)| args.nodes.iter().map(move |&n| (c, h, n)));
    for (ctx, heads, nodes) in cases {
        let rows = nodes * heads;
        let keys = ctx + nodes;
        let bytes = keys * ROW * 2;
        let copies = (256usize << 20).div_ceil(bytes).clamp(2, 64);
        let (one, _) = ddtree_kernels::check::random_bf16(rng, keys * ROW, -1.0, 1.0);
        let caches: Vec<_> = (0..copies).map(|_| upload(s, &one)).collect::<Result<_, _>>()?;
        let (qh, _) = ddtree_kernels::check::random_bf16(rng, rows * ROW, -1.0, 1.0);
        let q = upload(s, &qh)?;
        let (mask, words) = random_mask(rng, nodes, false);
        let visible: usize = (0..nodes)
            .map(|i| {
                ctx + mask[i * words..][..words]
                    .iter()
                    .map(|w| w.count_ones() as usize)
                    .sum::<usize>()
            })
            .sum::<usize>()
            * heads;
        let flops = visible as f64 * 2.0 * (ROW + LATENT) as f64;
        let dm = upload(s, &mask)?;
        let dl = upload(s, &[ctx as u32])?;
        let mut out = zeros::<bf16>(s, rows * LATENT)?;
        let mut lse = zeros::<f32>(s, rows)?;
        let sh = VerifyShape {
            nodes,
            heads,
            prefix: ctx,
            words,
            scale: 0.1,
        };
        // (µs, symbol, splits, verifier) per variant: its best split count.
        let mut timed = Vec::new();
        for (vi, v) in verifiers.iter_mut().enumerate() {
            let auto = v.auto_splits(sms, &sh);
            let mut best: Option<(f64, usize)> = None;
            let mut tries = vec![auto, (auto / 2).max(1), (auto * 2).min(MAX_SPLITS)];
            tries.sort_unstable();
            tries.dedup();
            for splits in tries.into_iter().filter(|&n| rows * n <= BENCH_PARTIALS) {
                let us = graph_us(s, PER_GRAPH, 3, 20, |i| {
                    v.run(s, &sh, splits, &q, &caches[i % copies], &dm, &dl, &mut out, &mut lse)
                })?;
                if best.is_none_or(|b| us < b.0) {
                    best = Some((us, splits));
                }
            }
            if let Some((us, splits)) = best {
                timed.push((us, v.variant().symbol(), splits, Some(vi)));
            }
        }
        let naive_us = median_us(s, 1, 5, |i| {
            verifiers[0].run_naive(s, &sh, &q, &caches[i % copies], &dm, &mut out, &mut lse)
        })?;
        // The case's best split pass (the first of equal times).
        let best = (0..timed.len()).min_by(|&a, &b| timed[a].0.total_cmp(&timed[b].0));
        // The best candidate's split pass alone (the rest of its time is the combine).
        let split_us = match best.and_then(|b| timed[b].3.map(|vi| (vi, timed[b].2))) {
            Some((vi, splits)) => graph_us(s, PER_GRAPH, 3, 20, |i| {
                verifiers[vi].split_pass(s, &sh, splits, &q, &caches[i % copies], &dm, &dl)
            })?,
            None => f64::NAN,
        };
        // The decode step's path for one or two tokens: the same split pass, then the merge
        // fused with the absorbed output projection (Kimi's 128 + 128 dims per head).
        let output_us = match best.and_then(|b| timed[b].3.map(|vi| (vi, timed[b].2))) {
            Some((vi, splits)) if nodes <= OUTPUT_MAX_NODES => {
                let (nope, v) = (128, 128);
                let (kh, _) = ddtree_kernels::check::random_bf16(rng, heads * (nope + v) * LATENT, -1.0, 1.0);
                let kv_b = upload(s, &kh)?;
                let mut o = zeros::<bf16>(s, nodes * heads * v)?;
                let us = graph_us(s, PER_GRAPH, 3, 20, |i| {
                    let c = &caches[i % copies];
                    verifiers[vi].run_output(s, &sh, splits, &q, c, &dm, &dl, &kv_b, (nope, v), &mut o)
                })?;
                format!("  split + combine_output {us:.1} µs")
            }
            _ => String::new(),
        };
        timed.push((naive_us, "mla_verify_naive".to_string(), 1, None));
        // Percent of the copy floor (reading the cache once at the measured copy bandwidth).
        let of_copy = |us: f64| 100.0 * bytes as f64 / (bw * 1e9) / (us * 1e-6);
        for (i, (us, sym, splits, _)) in timed.iter().enumerate() {
            let copy_pct = of_copy(*us);
            let tf = flops / (us * 1e-6) / 1e12;
            let tf_pct = 100.0 * tf / tflops;
            let mark = if best == Some(i) { "*" } else { "" };
            let case = format!("| {ctx} | {nodes} x {heads} | {sym} | {splits} | {us:.1} |");
            println!("{case} {copy_pct:.0}% | {tf:.1} | {tf_pct:.0}% | {mark} |");
            if best == Some(i) {
                let speedup = naive_us / us;
                let split_pct = of_copy(split_us);
                rows_out.push(format!(
                    "verify ctx={ctx:<5} nodes={nodes:<2} heads={heads:<2} {us:>8.1} µs {copy_pct:>4.0}% copy \
                     {tf:>6.1} TF/s ({tf_pct:.0}%)  best [{sym} s={splits}]  split pass alone {split_us:.1} µs \
                     ({split_pct:.0}% copy)  naive {naive_us:.1} µs ({speedup:.1}x){output_us}"
                ));
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            println!("no GPU: {e}");
            return ExitCode::SUCCESS;
        }
    };
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    // One stream, as in the engine: cudarc's per-buffer event tracking would add host work to
    // every launch and break stream capture.
    // SAFETY: every buffer of this run lives on the GPU's one stream.
    unsafe { gpu.context().disable_event_tracking() };
    gpu.set_programmatic_launch(args.pdl);
    println!(
        "tree-bench on {} (seed {seed}{})",
        gpu.arch(),
        if gpu.programmatic_launch() {
            ", programmatic dependent launch"
        } else {
            ""
        }
    );
    let mut rng = StdRng::seed_from_u64(seed);
    // The profiler modes run their launches and nothing else.
    let profiled = match (&args.profile_build, args.profile_verify) {
        (Some(v), _) => Some(profile_build(&gpu, &mut rng, &v[0], &v[1])),
        (None, Some(ctx)) => Some(profile_verify(&gpu, &mut rng, &args, ctx).map_err(|e| e.to_string())),
        (None, None) => None,
    };
    if let Some(result) = profiled {
        return match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                println!("{e}");
                ExitCode::FAILURE
            }
        };
    }
    let mut failed = 0;
    let mut total = 0;
    if !args.skip_checks {
        let results = checks(&gpu, &mut rng, args.build_only);
        total = results.len();
        for r in &results {
            if !r.passed {
                failed += 1;
                println!("FAIL {} {} {}: {:?}", r.kernel, r.symbol, r.case, r.comparison);
            }
        }
        println!("checks: {} of {total} passed", total - failed);
    }
    let mut summary = Vec::new();
    if !args.skip_bench {
        let bw = ddtree_benches::copy_bandwidth(&gpu).unwrap_or_else(|e| {
            println!("copy bandwidth failed: {e}; assuming 4200 GB/s");
            4200.0
        });
        let tf = bf16_rate(&gpu).unwrap_or_else(|e| {
            println!("cuBLAS bf16 rate failed: {e}; assuming 700 TFLOP/s");
            700.0
        });
        println!("copy bandwidth {bw:.0} GB/s, cuBLAS bf16 8192^3 {tf:.0} TFLOP/s");
        summary.push(format!("floor: copy {bw:.0} GB/s, bf16 {tf:.0} TFLOP/s"));
        if !args.verify_only {
            if let Err(e) = bench_build(&gpu, &mut rng, &mut summary) {
                println!("build bench failed: {e}");
            }
        }
        if !args.build_only {
            if let Err(e) = bench_verify(&gpu, &mut rng, &args, bw, tf, &mut summary) {
                println!("verify bench failed: {e}");
            }
        }
    }
    println!("\n=== summary (seed {seed}) ===");
    if !args.skip_checks {
        println!("checks: {} of {total} passed", total - failed);
    }
    for l in &summary {
        println!("{l}");
    }
    if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
