//! W4A16 check and bench on the GPU, in one run:
//!
//! 1. every W4A16 candidate (dense, fused, grouped) and the GPU repack against the CPU
//!    reference (fresh random data, poisoned outputs, ragged and Kimi sizes);
//! 2. device copy bandwidth;
//! 3. per shape and M: cuBLAS bf16, every g32 W4A16 candidate (split-K ones at several splits),
//!    the best and the default, as µs, GB/s, % of copy bandwidth and speedup over cuBLAS;
//! 4. the MoE block on a Kimi K2.6 EP8 slice (48 local experts, 7168 / 2048, top-8).
//!
//! For the small-token path (`w4a16_gemv`) the dense table adds, at M <= 16, the best GEMV
//! candidate next to the GEMM, and the MoE table shows the grouped path (align + 2 GEMMs + sum)
//! and the two-launch GEMV path side by side (every candidate pair timed, the best reported).
//!
//! Times are per call in a stream of back-to-back calls (as in a captured decode step), with
//! the weights rotated over more than three times the L2 so every call reads them from DRAM.
//!
//! Usage: `w4a16-bench [--seed N] [--skip-checks] [--reps N] [--moe-only]`. Exits non-zero if any check fails.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use cudarc::driver::{CudaSlice, CudaStream};
use ddtree_codegen::Kernel;
use ddtree_kernels::check::{DevBuf, Sizes, Target};
use ddtree_kernels::w4a16::check::{self, moe_pairs, random_routing};
use ddtree_kernels::w4a16::gemm::{self, default_dense, GemmArgs, Scratch, DENSE_SPACE};
use ddtree_kernels::w4a16::gemv::{self as w4gemv, GemvMode, GemvW4Params, W4a16Gemv, GEMV_SPACE};
use ddtree_kernels::w4a16::layout::{scale_words, PackedInt4};
use ddtree_kernels::w4a16::moe::DeviceExperts;
use ddtree_kernels::w4a16::{Layout, MoeKernels, ReduceParams, W4a16Gemm, W4a16Params, W4a16Reduce};
use ddtree_runtime::timing::median_us;
use ddtree_runtime::{Gpu, RuntimeError};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Parser)]
#[command(about = "Check every W4A16 kernel on the GPU, then time it against cuBLAS bf16 and copy bandwidth")]
struct Args {
    /// Seed for the random inputs (default: from the clock; printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Skip the correctness checks.
    #[arg(long)]
    skip_checks: bool,
    /// Timed samples per measurement (each the mean of a batch of calls).
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// Only the MoE table (after the checks).
    #[arg(long)]
    moe_only: bool,
}

const L2_BYTES: usize = 60 << 20;

/// Calls per timed sample.
const BATCH: usize = 10;

/// Median over `reps` samples of the mean time of `BATCH` back-to-back calls, in µs; `f` gets
/// the call index (to rotate buffers).
fn time_us(
    s: &Arc<CudaStream>,
    reps: usize,
    mut f: impl FnMut(usize) -> Result<(), RuntimeError>,
) -> Result<f64, RuntimeError> {
    let us = median_us(s, 1, reps, |i| {
        for b in 0..BATCH {
            f(i * BATCH + b)?;
        }
        Ok(())
    })?;
    Ok(us / BATCH as f64)
}

fn upload<T: cudarc::driver::DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> Result<CudaSlice<T>, RuntimeError> {
    s.clone_htod(v).map_err(RuntimeError::driver("copying to the GPU"))
}

/// Weights on the GPU in `layout` (interleaved ones repacked there by the repack kernel).
fn device_weights(gpu: &Gpu, p: &PackedInt4, layout: Layout) -> Result<CudaSlice<u32>, RuntimeError> {
    match check::device_weights(&Target::Gpu(gpu), p, layout)? {
        DevBuf::Gpu(d) => Ok(d),
        DevBuf::Host(..) => unreachable!("a GPU target gives device buffers"),
    }
}

/// Copies needed so one rotation of buffers of `bytes` each exceeds L2 three times over.
fn copies(bytes: usize) -> usize {
    (3 * L2_BYTES).div_ceil(bytes).clamp(2, 16)
}

/// Random INT4 weights (any nibble) and scales, fast: timing data only.
fn random_weights(rng: &mut StdRng, n: usize, k: usize, experts: usize) -> PackedInt4 {
    let packed = (0..experts * n * k / 8).map(|_| rng.random::<u32>()).collect();
    let scales = (0..experts * n * k / 32)
        .map(|_| bf16::from_f32(rng.random_range(0.001f32..0.01)))
        .collect();
    PackedInt4 {
        packed,
        scales,
        n,
        k,
        group: 32,
        experts,
    }
}

fn random_bf16_dev(s: &Arc<CudaStream>, rng: &mut StdRng, len: usize) -> Result<CudaSlice<bf16>, RuntimeError> {
    let v: Vec<bf16> = (0..len)
        .map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0)))
        .collect();
    upload(s, &v)
}

struct Timed {
    label: String,
    us: f64,
}

/// One dense shape: weights in both layouts, rotated; every candidate at every M.
fn bench_shape(
    gpu: &Gpu,
    k: usize,
    n: usize,
    ms: &[usize],
    bw: f64,
    reps: usize,
    rng: &mut StdRng,
) -> Result<(), RuntimeError> {
    let s = gpu.stream();
    let q_bytes = n * k / 2 + n * k / 32 * 2;
    let nq = copies(q_bytes);
    let mut wts = Vec::new();
    for _ in 0..nq {
        let p = random_weights(rng, n, k, 1);
        wts.push((
            device_weights(gpu, &p, Layout::Checkpoint)?,
            device_weights(gpu, &p, Layout::Interleaved)?,
            upload(s, &scale_words(&p.scales))?,
        ));
    }
    let nb = copies(n * k * 2);
    let bws: Vec<CudaSlice<bf16>> = (0..nb)
        .map(|_| random_bf16_dev(s, rng, n * k))
        .collect::<Result<_, _>>()?;
    let blas = ddtree_runtime::Blas::new(gpu)?;
    let mut kernels = Vec::new();
    for p in DENSE_SPACE.iter().filter(|p| p.group == 32) {
        let red = if p.splitk {
            Some(gpu.compile::<W4a16Reduce>(&ReduceParams {
                block: 256,
                epilogue: p.epilogue,
            })?)
        } else {
            None
        };
        kernels.push((*p, gpu.compile::<W4a16Gemm>(p)?, red));
    }
    let gemv_kernels: Vec<(GemvW4Params, _)> = GEMV_SPACE
        .iter()
        .filter(|p| p.mode == GemvMode::Dense)
        .map(|p| Ok((*p, gpu.compile::<W4a16Gemv>(p)?)))
        .collect::<Result<_, RuntimeError>>()?;
    for &m in ms {
        let na = 4;
        let acts: Vec<CudaSlice<bf16>> = (0..na)
            .map(|_| random_bf16_dev(s, rng, m * k))
            .collect::<Result<_, _>>()?;
        let mut out = s
            .alloc_zeros::<bf16>(m * n)
            .map_err(RuntimeError::driver("allocating"))?;
        let mut scratch = Scratch::new(s, 8 * m * n)?;
        let cublas = time_us(s, reps, |i| {
            // SAFETY: a is m x k, b is n x k, c is m x n.
            unsafe { blas.linear(&acts[i % na], &bws[i % nb], &mut out, m, n, k) }
        })?;
        let kbs = k.div_ceil(128) as u32;
        let (dp, dsplits) = default_dense(m as u32, n as u32, k as u32);
        let mut timed: Vec<Timed> = Vec::new();
        let mut default_us = f64::NAN;
        for (p, gk, red) in &kernels {
            if (p.mt > 1 && m <= 16 * (p.mt as usize - 1)) || (p.m8 && m > 8) || (p.mt == 1 && m > 64) {
                continue; // never the best: tiles mostly empty, or far too many m blocks
            }
            let splits: Vec<u32> = if p.splitk {
                gemm::SPLITS.iter().copied().filter(|&x| x <= kbs).collect()
            } else {
                vec![1]
            };
            for sp in splits {
                let us = time_us(s, reps, |i| {
                    let (wc, wi, sc) = &wts[i % nq];
                    let w = if p.layout == Layout::Interleaved { wi } else { wc };
                    let args = GemmArgs {
                        a: &acts[i % na],
                        w,
                        scales: sc,
                        residual: None,
                        routing: None,
                        m: m as u32,
                        n: n as u32,
                        k: k as u32,
                    };
                    // SAFETY: shapes as documented; k is a multiple of the group.
                    unsafe { gemm::launch(gk, red.as_ref(), s, &args, &mut scratch, &mut out, sp) }
                })?;
                if *p == dp && sp == dsplits {
                    default_us = us;
                }
                timed.push(Timed {
                    label: format!("{} x{sp}", short(p)),
                    us,
                });
            }
        }
        timed.sort_by(|a, b| a.us.total_cmp(&b.us));
        let best = &timed[0];
        let bytes = (q_bytes + 2 * m * k + 2 * m * n) as f64;
        let gbs = bytes / (best.us * 1e-6) / 1e9;
        // The small-token GEMV: every dense candidate that takes m rows.
        let mut gv: Vec<Timed> = Vec::new();
        for (p, gk) in &gemv_kernels {
            if (w4gemv::max_tokens(p) as usize) < m {
                continue;
            }
            let none = &scratch.part;
            let ids = upload(s, &[0u32])?;
            let us = time_us(s, reps, |i| {
                let (_, wi, sc) = &wts[i % nq];
                // SAFETY: a [m <= 8 chunks, k], interleaved weights [n, k], out [m, n].
                unsafe {
                    W4a16Gemv::launch(
                        gk,
                        s,
                        w4gemv::grid(p, n as u32, 1),
                        &acts[i % na],
                        wi,
                        sc,
                        &ids,
                        none,
                        &mut out,
                        m as u32,
                        n as u32,
                        k as u32,
                        1,
                        1,
                    )
                }
            })?;
            gv.push(Timed {
                label: short_gemv(p),
                us,
            });
        }
        gv.sort_by(|a, b| a.us.total_cmp(&b.us));
        let gemv_col = match gv.first() {
            Some(g) => {
                let gg = bytes / (g.us * 1e-6) / 1e9;
                format!("{:.1} | {:.0}% | {}", g.us, 100.0 * gg / bw, g.label)
            }
            None => "- | - | -".into(),
        };
        println!(
            "| {k}->{n} | {m} | {cublas:.1} | {:.1} | {gbs:.0} | {:.0}% | {:.2}x | {default_us:.1} | {} | {gemv_col} |",
            best.us,
            100.0 * gbs / bw,
            cublas / best.us,
            best.label
        );
    }
    Ok(())
}

/// The first grouped (gate_up, down) pair: the grouped half of a [`MoeKernels`] timed only
/// for its GEMV pair.
fn pairs_default() -> (W4a16Params, W4a16Params) {
    moe_pairs()[0]
}

/// A compact GEMV variant label.
fn short_gemv(p: &GemvW4Params) -> String {
    format!("w{} mt{} st{} c{}", p.warps, p.mt, p.stages, p.chunks)
}

/// A compact variant label.
fn short(p: &W4a16Params) -> String {
    let l = if p.layout == Layout::Interleaved { "il" } else { "ck" };
    let mt = if p.m8 { "m8".to_string() } else { format!("mt{}", p.mt) };
    format!(
        "g{} {l} w{} nt{} {mt} st{}{}{}",
        p.group,
        p.warps,
        p.nt,
        p.stages,
        if p.mt == 1 && !p.aring { " ad" } else { "" },
        if p.splitk { " sk" } else { "" }
    )
}

fn bench_moe(gpu: &Gpu, bw: f64, reps: usize, rng: &mut StdRng) -> Result<(), RuntimeError> {
    let s = gpu.stream();
    let (experts, hidden, inter, topk) = (48usize, 7168usize, 2048usize, 8usize);
    // One random expert repeated: the same traffic as distinct experts, far faster to make.
    let one13 = random_weights(rng, 2 * inter, hidden, 1);
    let one2 = random_weights(rng, hidden, inter, 1);
    let rep = |p: &PackedInt4| PackedInt4 {
        packed: p.packed.repeat(experts),
        scales: p.scales.repeat(experts),
        experts,
        ..p.clone()
    };
    let (w13, w2) = (rep(&one13), rep(&one2));
    let per_expert = w13.bytes_per_expert() + w2.bytes_per_expert();
    let (s13, s2) = (
        upload(s, &scale_words(&w13.scales))?,
        upload(s, &scale_words(&w2.scales))?,
    );
    let mut layouts = Vec::new();
    for l in [Layout::Interleaved, Layout::Checkpoint] {
        layouts.push((l, device_weights(gpu, &w13, l)?, device_weights(gpu, &w2, l)?));
    }
    println!("\nMoE W4A16, Kimi K2.6 EP8 slice: {experts} local experts, hidden {hidden}, inter {inter}, top-{topk} routed among the local experts; {:.1} MB per expert", per_expert as f64 / 1e6);
    println!("| T | touched experts | touched MB | grouped µs | GB/s | % of copy | best grouped pair | gemv µs | GB/s | % of copy | best gemv pair |");
    println!("|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|");
    let gemv_pairs = check::gemv_moe_pairs();
    let gemv_kernels: Vec<MoeKernels> = gemv_pairs
        .iter()
        .map(|(u, d)| MoeKernels::new(gpu, &pairs_default().0, &pairs_default().1)?.with_gemv(gpu, Some((u, d))))
        .collect::<Result<_, _>>()?;
    let pairs = moe_pairs();
    let kernels: Vec<MoeKernels> = pairs
        .iter()
        .map(|(u, d)| MoeKernels::new(gpu, u, d))
        .collect::<Result<_, _>>()?;
    for tokens in [1usize, 2, 4, 8, 16, 32, 64] {
        let sets = 8;
        let mut routes = Vec::new();
        let mut touched = 0usize;
        for _ in 0..sets {
            let (ids, w) = random_routing(rng, tokens, topk, experts);
            let mut t: Vec<u32> = ids.clone();
            t.sort_unstable();
            t.dedup();
            touched += t.len();
            routes.push((upload(s, &ids)?, upload(s, &w)?));
        }
        let x = random_bf16_dev(s, rng, tokens * hidden)?;
        let mut out = s
            .alloc_zeros::<bf16>(tokens * hidden)
            .map_err(RuntimeError::driver("allocating"))?;
        let mut best: Option<(f64, String)> = None;
        for (kern, (up, down)) in kernels.iter().zip(&pairs) {
            let (_, d13, d2) = layouts
                .iter()
                .find(|(l, ..)| *l == up.layout)
                .expect("both layouts made");
            let ex = DeviceExperts {
                w13: d13,
                s13: &s13,
                w2: d2,
                s2: &s2,
                experts: experts as u32,
                hidden: hidden as u32,
                inter: inter as u32,
            };
            let mut bufs = kern.buffers(s, tokens, topk, &ex)?;
            let us = time_us(s, reps, |i| {
                let (ids, w) = &routes[i % sets];
                // SAFETY: shapes as documented; weights in the pair's layout.
                unsafe { kern.run_grouped(s, &ex, &x, ids, w, &mut out, &mut bufs, tokens as u32, topk as u32) }
            })?;
            let label = format!("{} / {}", short(up), short(down));
            if best.as_ref().is_none_or(|(b, _)| us < *b) {
                best = Some((us, label));
            }
        }
        let (us, label) = best.expect("at least one pair");
        let (_, d13, d2) = layouts
            .iter()
            .find(|(l, ..)| *l == Layout::Interleaved)
            .expect("both layouts made");
        let ex = DeviceExperts {
            w13: d13,
            s13: &s13,
            w2: d2,
            s2: &s2,
            experts: experts as u32,
            hidden: hidden as u32,
            inter: inter as u32,
        };
        let mut gbest: Option<(f64, String)> = None;
        for (kern, (up, down)) in gemv_kernels.iter().zip(&gemv_pairs) {
            if !kern.uses_gemv(tokens as u32, topk as u32) {
                continue;
            }
            let mut bufs = kern.buffers(s, tokens, topk, &ex)?;
            let us = time_us(s, reps, |i| {
                let (ids, w) = &routes[i % sets];
                // SAFETY: shapes as documented; interleaved g32 weights.
                unsafe { kern.run_gemv(s, &ex, &x, ids, w, &mut out, &mut bufs, tokens as u32, topk as u32) }
            })?;
            let label = format!("{} / {}", short_gemv(up), short_gemv(down));
            if gbest.as_ref().is_none_or(|(b, _)| us < *b) {
                gbest = Some((us, label));
            }
        }
        let avg_touched = touched as f64 / sets as f64;
        let bytes = avg_touched * per_expert as f64;
        let gbs = bytes / (us * 1e-6) / 1e9;
        let gemv_col = match gbest {
            Some((gus, gl)) => {
                let gg = bytes / (gus * 1e-6) / 1e9;
                format!("{gus:.1} | {gg:.0} | {:.0}% | {gl}", 100.0 * gg / bw)
            }
            None => "- | - | - | (grouped path)".into(),
        };
        println!(
            "| {tokens} | {avg_touched:.1} | {:.0} | {us:.1} | {gbs:.0} | {:.0}% | {label} | {gemv_col} |",
            bytes / 1e6,
            100.0 * gbs / bw
        );
    }
    Ok(())
}

fn run(args: &Args) -> Result<bool, RuntimeError> {
    let gpu = Gpu::open(0)?;
    let f = gpu.fingerprint();
    println!(
        "device: {} ({} SMs), driver {}, arch {}",
        f.name,
        f.sm_count,
        f.driver_version,
        gpu.arch()
    );
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    println!("seed: {seed}");
    let mut all_passed = true;
    if !args.skip_checks {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut results = check::suite(&Target::Gpu(&gpu), Sizes::Full, &mut rng)?;
        results.extend(check::gemv_suite(&Target::Gpu(&gpu), Sizes::Full, &mut rng)?);
        for r in results.iter().filter(|r| !r.passed) {
            println!("FAIL {} {}: {:?}", r.symbol, r.case, r.comparison);
        }
        let worst = results.iter().map(|r| r.comparison.rel_l2).fold(0f32, f32::max);
        let passed = results.iter().filter(|r| r.passed).count();
        println!(
            "checks: {passed} of {} passed (worst rel L2 {worst:.2e})",
            results.len()
        );
        all_passed = passed == results.len();
    }
    let bw = ddtree_benches::copy_bandwidth(&gpu)?;
    println!("\ncopy bandwidth (device to device, read + write): {bw:.0} GB/s");
    println!("\nW4A16 g32 (bytes = packed weights + scales + A + out) vs cuBLAS bf16; default = the heuristic's pick; ad = A read directly, not in the ring");
    println!("| K->N | M | cuBLAS µs | W4A16 µs | GB/s | % of copy | vs cuBLAS | default µs | best variant x splits | GEMV µs | GEMV % of copy | best GEMV |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|");
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let ms = [1, 2, 4, 8, 16, 32, 64, 128, 256];
    if !args.moe_only {
        for (k, n) in [(7168, 4096), (2048, 7168), (7168, 2048), (7168, 36864), (1536, 12288)] {
            bench_shape(&gpu, k, n, &ms, bw, args.reps, &mut rng)?;
        }
    }
    bench_moe(&gpu, bw, args.reps, &mut rng)?;
    println!(
        "\nW4A16 candidates: {}",
        DENSE_SPACE
            .iter()
            .filter(|p| p.group == 32)
            .map(W4a16Gemm::symbol)
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(all_passed)
}

fn main() -> ExitCode {
    ddtree_benches::exit_code(run(&Args::parse()))
}
