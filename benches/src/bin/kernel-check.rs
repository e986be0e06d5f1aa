//! GPU check and bench of the DSL kernels, in one run:
//!
//! 1. every candidate of every kernel against its CPU reference (fresh random inputs, poisoned
//!    outputs, ragged sizes and the Kimi K2.6 sizes);
//! 2. device copy bandwidth;
//! 3. the bf16 tile GEMM's TFLOP/s for every candidate next to cuBLAS bf16 on the same shapes;
//! 4. row top-k at the decode sizes (rows 1, 4, 16 of n = 163840, k = 1 and 8): the one-block-
//!    per-row `RowTopk` default next to the split path of `TopkRunner`, whose output is checked.
//!
//! 5. with `--decode-ops`: only the checks of the decode-step kernels (absorbed MLA query and
//!    output, GEMVs and the fused gate/up GEMVs, norms and the residual norm of one or two
//!    addends, latent append) and their timings next to what they replace
//!    ([`ddtree_benches::decode_ops`]).
//!
//! Usage: `kernel-check [--small] [--seed N] [--skip-bench] [--topk-only] [--decode-ops]`. Exits
//! non-zero if any check fails.

use std::process::ExitCode;

use clap::Parser;
use ddtree_codegen::Kernel;
use ddtree_kernels::check::{self, CheckResult, Sizes, Target};
use ddtree_kernels::gemm_bf16::op::GemmBf16Op;
use ddtree_kernels::topk::RowTopkOp;
use ddtree_kernels::{topk, GemmBf16, RowTopk, TopkRunner};
use ddtree_runtime::timing::median_us;
use ddtree_runtime::{Gpu, RuntimeError};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Parser)]
#[command(
    about = "Check every DSL kernel on the GPU against its CPU reference, then time the tile GEMM against cuBLAS"
)]
struct Args {
    /// Only the small ragged sizes.
    #[arg(long)]
    small: bool,
    /// Seed for the random inputs (default: from the clock; printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Skip the bandwidth, GEMM and top-k timings.
    #[arg(long)]
    skip_bench: bool,
    /// Only the top-k checks (both kernels) and the top-k timings.
    #[arg(long)]
    topk_only: bool,
    /// Only the decode-step kernels' checks and their timings (T = 1, 4, 16 on Kimi shapes).
    #[arg(long)]
    decode_ops: bool,
}

fn gemm_bench(gpu: &Gpu, shapes: &[(usize, usize, usize)]) -> Result<(), RuntimeError> {
    let s = gpu.stream();
    let blas = ddtree_runtime::Blas::new(gpu)?;
    let mut rng = rand::rng();
    println!("\n| shape (m x n x k) | variant | µs | TFLOP/s | vs cuBLAS |");
    println!("|---|---|---:|---:|---:|");
    for &(m, n, k) in shapes {
        let flops = 2.0 * m as f64 * n as f64 * k as f64;
        // Enough copies of the operands to exceed the 60 MB L2 several times over.
        let bytes = 2 * (m * k + n * k);
        let copies = (256usize << 20).div_ceil(bytes).clamp(1, 8);
        let mut a_bufs = Vec::new();
        let mut b_bufs = Vec::new();
        for _ in 0..copies {
            let a: Vec<bf16> = (0..m * k)
                .map(|_| bf16::from_f32(rng.random_range(-1.0..1.0)))
                .collect();
            let b: Vec<bf16> = (0..n * k)
                .map(|_| bf16::from_f32(rng.random_range(-1.0..1.0)))
                .collect();
            a_bufs.push(s.clone_htod(&a).map_err(RuntimeError::driver("upload"))?);
            b_bufs.push(s.clone_htod(&b).map_err(RuntimeError::driver("upload"))?);
        }
        let mut c = s
            .alloc_zeros::<bf16>(m * n)
            .map_err(RuntimeError::driver("allocating"))?;
        let cublas_us = median_us(s, 5, 30, |i| {
            // SAFETY: shapes and leading dimensions match the buffers.
            unsafe { blas.linear(&a_bufs[i % copies], &b_bufs[i % copies], &mut c, m, n, k) }
        })?;
        println!(
            "| {m} x {n} x {k} | cuBLAS bf16 | {cublas_us:.1} | {:.1} | 1.00 |",
            flops / cublas_us / 1e6
        );
        for p in GemmBf16::space() {
            let kern = gpu.compile::<GemmBf16>(&p)?;
            let us = median_us(s, 5, 30, |i| {
                let (a, b) = (&a_bufs[i % copies], &b_bufs[i % copies]);
                GemmBf16Op {
                    a,
                    b,
                    c: &mut c,
                    m,
                    n,
                    k,
                }
                .launch(&kern, s)
            })?;
            println!(
                "| {m} x {n} x {k} | {} | {us:.1} | {:.1} | {:.2} |",
                GemmBf16::symbol(&p),
                flops / us / 1e6,
                cublas_us / us
            );
        }
    }
    Ok(())
}

/// Times row top-k at the decode sizes: `RowTopk`'s default variant for `k` (one block per row)
/// next to `TopkRunner`'s split path, after checking the runner's output against
/// `topk::reference`. Returns whether every output matched.
fn topk_bench(gpu: &Gpu) -> Result<bool, RuntimeError> {
    let s = gpu.stream();
    let n = 163840usize;
    let mut rng = rand::rng();
    let mut all_ok = true;
    println!("\n| rows | n | k | RowTopk default | µs | split (TopkRunner) µs | speed-up | split output |");
    println!("|---:|---:|---:|---|---:|---:|---:|---|");
    for k in [1usize, 8] {
        let full_p = RowTopk::space()
            .into_iter()
            .find(|p| p.k as usize == k)
            .expect("RowTopk has a variant for k = 1 and 8");
        let full = gpu.compile::<RowTopk>(&full_p)?;
        let mut runner = TopkRunner::new(gpu, k)?;
        for rows in [1usize, 4, 16] {
            let logits: Vec<f32> = (0..rows * n).map(|_| rng.random_range(-20.0f32..20.0)).collect();
            let dl = s.clone_htod(&logits).map_err(RuntimeError::driver("upload"))?;
            let mut values = s
                .alloc_zeros::<f32>(rows * k)
                .map_err(RuntimeError::driver("allocating"))?;
            let mut indices = s
                .alloc_zeros::<u32>(rows * k)
                .map_err(RuntimeError::driver("allocating"))?;
            runner.run(s, &dl, &mut values, &mut indices, rows, n)?;
            let gv = s.clone_dtoh(&values).map_err(RuntimeError::driver("download"))?;
            let gi = s.clone_dtoh(&indices).map_err(RuntimeError::driver("download"))?;
            let got: Vec<(f32, u32)> = gv.into_iter().zip(gi).collect();
            let ok = got == topk::reference(&logits, n, k);
            all_ok &= ok;
            let full_us = median_us(s, 10, 100, |_| {
                let (logits, values, indices) = (&dl, &mut values, &mut indices);
                RowTopkOp {
                    logits,
                    values,
                    indices,
                    rows,
                    n,
                }
                .launch(&full, s)
            })?;
            let split_us = median_us(s, 10, 100, |_| runner.run(s, &dl, &mut values, &mut indices, rows, n))?;
            println!(
                "| {rows} | {n} | {k} | {} | {full_us:.1} | {split_us:.1} | {:.1}x | {} |",
                RowTopk::symbol(&full_p),
                full_us / split_us,
                if ok { "exact" } else { "MISMATCH" }
            );
        }
    }
    Ok(all_ok)
}

/// Prints the failures and the per-kernel table of `results`.
fn report(results: &[CheckResult]) {
    for r in results.iter().filter(|r| !r.passed) {
        println!("FAIL {} {}: {:?}", r.symbol, r.case, r.comparison);
    }
    println!("\n| kernel | variants | checks | passed | worst rel L2 | worst max abs |");
    println!("|---|---:|---:|---:|---:|---:|");
    // First-appearance order; a suite may interleave kernels (the GEMV pair).
    let mut kernels: Vec<&str> = Vec::new();
    for r in results {
        if !kernels.contains(&r.kernel) {
            kernels.push(r.kernel);
        }
    }
    for k in kernels {
        let rs: Vec<_> = results.iter().filter(|r| r.kernel == k).collect();
        let variants: std::collections::BTreeSet<&str> = rs.iter().map(|r| r.symbol.as_str()).collect();
        let worst_l2 = rs.iter().map(|r| r.comparison.rel_l2).fold(0f32, f32::max);
        let worst_abs = rs.iter().map(|r| r.comparison.max_abs).fold(0f32, f32::max);
        println!(
            "| {k} | {} | {} | {} | {worst_l2:.2e} | {worst_abs:.2e} |",
            variants.len(),
            rs.len(),
            rs.iter().filter(|r| r.passed).count()
        );
    }
}

fn run(args: &Args) -> Result<bool, RuntimeError> {
    let gpu = Gpu::open(0)?;
    let f = gpu.fingerprint();
    let (nv_major, nv_minor) = ddtree_runtime::nvrtc::nvrtc_version()?;
    println!(
        "device: {} (sm_{}{}, {} SMs, {:.0} GiB), driver {}, NVRTC {nv_major}.{nv_minor}, arch {}",
        f.name,
        f.compute_capability.0,
        f.compute_capability.1,
        f.sm_count,
        f.memory_bytes as f64 / (1u64 << 30) as f64,
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
    let target = Target::Gpu(&gpu);
    let sizes = if args.small { Sizes::Small } else { Sizes::Full };
    let results = if args.decode_ops {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut out = Vec::new();
        for suite in [
            ddtree_kernels::attention::check::mla_absorb_query_suite as check::Suite,
            ddtree_kernels::attention::check::mla_absorb_output_suite,
            ddtree_kernels::attention::check::kv_append_suite,
            check::gemv_suite,
            check::gemv_split_suite,
            check::gemv_gate_up_suite,
            check::gemv_split_gate_up_suite,
            check::gemv_rms_norm_suite,
            check::rms_norm_suite,
            check::add_rms_norm_suite,
        ] {
            out.extend(suite(&target, sizes, &mut rng)?);
        }
        out
    } else if args.topk_only {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut out = check::topk_suite(&target, sizes, &mut rng)?;
        out.extend(check::topk_split_suite(&target, sizes, &mut rng)?);
        out
    } else {
        check::run_all(&target, sizes, seed)?
    };
    report(&results);
    let mut all_passed = results.iter().all(|r| r.passed);
    if args.decode_ops {
        if !args.skip_bench {
            ddtree_benches::decode_ops::decode_ops_bench(&gpu)?;
        }
    } else if args.topk_only {
        all_passed &= topk_bench(&gpu)?;
    } else if !args.skip_bench {
        println!(
            "\ncopy bandwidth (device to device, read + write): {:.0} GB/s",
            ddtree_benches::copy_bandwidth(&gpu)?
        );
        gemm_bench(
            &gpu,
            &[
                (4096, 4096, 4096),
                (8192, 8192, 8192),
                (256, 7168, 2048),
                (2048, 7168, 7168),
            ],
        )?;
        all_passed &= topk_bench(&gpu)?;
    }
    Ok(all_passed)
}

fn main() -> ExitCode {
    ddtree_benches::exit_code(run(&Args::parse()))
}
