//! W4A16 check and bench on the GPU, in one run:
//!
//! 1. every W4A16 candidate (dense, fused, grouped) and the GPU repack against the CPU
//!    reference (fresh random data, poisoned outputs, ragged and Kimi sizes);
//! 2. device copy bandwidth;
//! 3. per shape and M: cuBLAS bf16, every g32 W4A16 candidate (split-K ones at several splits),
//!    the best and the engine's default (the warpgroup kernel's from `WG_MIN_ROWS` rows on
//!    GPUs with `wgmma`, else the tile GEMM's), as µs, GB/s, % of copy bandwidth and speedup
//!    over cuBLAS, and the best candidates of the warpgroup (`wgmma`) kernel and of the
//!    stream-K kernel (`w4a16_gemm_sk`, its activation-tiles launch included) where they run;
//! 4. the MoE block on a Kimi K2.6 EP8 slice (48 local experts, 7168 / 2048, top-8).
//!
//! For the small-token path (`w4a16_gemv`) the dense table adds, at M <= 16, the best GEMV
//! candidate next to the GEMM, and the MoE table shows the grouped path (align + 2 GEMMs + sum),
//! the two-launch GEMV path and the grouped GEMV path (align + 2 GEMVs + sum) side by side
//! (every candidate pair timed, the best reported; then every grouped GEMV pair's times).
//! `--moe-tokens` sets its token counts, `--route-experts N` routes each token's top-8 among the
//! first N experts only (tokens sharing their experts).
//!
//! Times are per call in a stream of back-to-back calls (as in a captured decode step), with
//! the weights rotated over more than three times the L2 so every call reads them from DRAM.
//!
//! `--gemv` runs only the small-token GEMV comparison: the GPU checks of every GEMV candidate
//! (dense at ragged and Kimi sizes, MoE pairs on small and 48-expert blocks), then one table per
//! candidate column: dense M = 1, 2, 4, 16 on 7168->36864, 7168->2048, 2048->7168, 1536->12288
//! (with the default GEMM for reference) and the MoE EP8 slice at T = 1..16 (grouped GEMM vs
//! every GEMV pair; not with `--no-moe`), µs and % of copy bandwidth, the best per row in bold.
//! `--group 64` (or 128) times the dense table's GEMV candidates and GEMM of that scale group
//! (the checks cover every group either way; the MoE table stays g32).
//!
//! Usage: `w4a16-bench [--seed N] [--skip-checks] [--reps N] [--moe-only] [--no-moe] [--ms 16,64,..]
//! [--moe-tokens 1,8,..] [--route-experts N] [--gemv [--group 32|64|128]]`. Exits non-zero if any
//! check fails.

mod hopper;
mod moe;

use hopper::*;
use moe::*;

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use cudarc::driver::{CudaSlice, CudaStream};
use ddtree_codegen::Kernel;
use ddtree_kernels::check::{DevBuf, Sizes, Target};
use ddtree_kernels::w4a16::check::{self, moe_pairs, random_routing};
use ddtree_kernels::w4a16::gemm::{self, default_dense, GemmArgs, GemmTiling, Scratch, W4a16Kernel, DENSE_SPACE};
use ddtree_kernels::w4a16::gemm_sk::{self, SK_SPACE};
use ddtree_kernels::w4a16::gemm_wg::{self, WG_DENSE_SPACE, WG_FUSED_SPACE};
use ddtree_kernels::w4a16::gemv::{self as w4gemv, GemvMode, GemvW4Params, W4a16Gemv, GEMV_SPACE};
use ddtree_kernels::w4a16::layout::{fragment_words, scale_words, PackedInt4, RepackParams};
use ddtree_kernels::w4a16::moe::{DeviceExperts, GroupedPair, MoeInput};
use ddtree_kernels::w4a16::op::DenseGemvOp;
use ddtree_kernels::w4a16::{
    ActTilesParams, Epilogue, Layout, MoeKernels, ReduceParams, W4a16ActTiles, W4a16Gemm, W4a16GemmSk, W4a16GemmWg,
    W4a16Params, W4a16Reduce, W4a16RepackFragment, W4a16SkParams, W4a16WgParams,
};
use ddtree_runtime::timing::median_us;
use ddtree_runtime::{CompiledKernel, Gpu, RuntimeError};
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
    /// Only the small-token GEMV candidates: their checks, then every candidate per row.
    #[arg(long)]
    gemv: bool,
    /// With `--gemv`: the scale group of the dense table's GEMV candidates and GEMM (32, 64 or
    /// 128).
    #[arg(long, default_value_t = 32)]
    group: u32,
    /// Token counts of the dense table.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 4, 8, 16, 32, 64, 128, 256])]
    ms: Vec<usize>,
    /// Skip the MoE table (with `--gemv`: the MoE GEMV checks and table).
    #[arg(long)]
    no_moe: bool,
    /// Token counts of the MoE table.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 4, 8, 16, 32, 64])]
    moe_tokens: Vec<usize>,
    /// The MoE table routes each token's top-8 among the first N of the 48 local experts (48:
    /// all of them; fewer puts more pairs on each touched expert, as tokens with similar
    /// routing do).
    #[arg(long, default_value_t = 48)]
    route_experts: usize,
    /// Only the warpgroup (`wgmma`) kernel: a first launch of every candidate (printed as it
    /// goes), its checks, then every candidate on 7168->36864 at `--ms` against cuBLAS.
    #[arg(long)]
    wg: bool,
    /// Only the stream-K kernel (`w4a16_gemm_sk`): its checks, then every candidate on
    /// 7168->36864 at `--ms` (activation tiles included) against cuBLAS and the best `wgmma`
    /// candidate.
    #[arg(long)]
    sk: bool,
    /// Only a few launches for a profiler (no checks, no tables): the default dense GEMV on
    /// 7168->36864 at one row (20 calls), then the first small-token MoE pair at one and at
    /// eight tokens, then the tables' grouped MoE pair at 16 and 64 tokens (20 calls each).
    #[arg(long)]
    profile: bool,
    /// Launch every kernel with programmatic dependent launch (each kernel's launch overlaps
    /// its predecessor's tail), as the engine does for steps of at most 8 tokens. The checks
    /// run with it too.
    #[arg(long)]
    pdl: bool,
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

/// Packed weight plus scale bytes of an `[n, k]` g32 matrix.
fn q_bytes(n: usize, k: usize) -> usize {
    n * k / 2 + n * k / 32 * 2
}

/// One dense matrix in both layouts (checkpoint, interleaved) with its scale words.
type DenseCopy = (CudaSlice<u32>, CudaSlice<u32>, CudaSlice<u32>);

/// Enough copies of random `[n, k]` weights that one rotation exceeds L2 three times over.
fn dense_weights(gpu: &Gpu, n: usize, k: usize, rng: &mut StdRng) -> Result<Vec<DenseCopy>, RuntimeError> {
    (0..copies(q_bytes(n, k)))
        .map(|_| {
            let p = random_weights(rng, n, k, 1);
            Ok((
                device_weights(gpu, &p, Layout::Checkpoint)?,
                device_weights(gpu, &p, Layout::Interleaved)?,
                upload(gpu.stream(), &scale_words(&p.scales))?,
            ))
        })
        .collect()
}

/// Times one dense W4A16 GEMM variant of either kernel (`kern`: params, kernel, split-K reduce) at `[m, n, k]`
/// with `splits`, rotating weights and activations.
#[allow(clippy::too_many_arguments)]
fn time_gemm<K: W4a16Kernel>(
    s: &Arc<CudaStream>,
    reps: usize,
    kern: (&K::Params, &CompiledKernel<K>, Option<&CompiledKernel<W4a16Reduce>>),
    wts: &[DenseCopy],
    acts: &[CudaSlice<bf16>],
    scratch: &mut Scratch,
    out: &mut CudaSlice<bf16>,
    [m, n, k]: [usize; 3],
    splits: u32,
) -> Result<f64, RuntimeError> {
    let (p, gk, red) = kern;
    time_us(s, reps, |i| {
        let (wc, wi, sc) = &wts[i % wts.len()];
        let w = if p.tiling().layout == Layout::Interleaved {
            wi
        } else {
            wc
        };
        let args = GemmArgs {
            a: &acts[i % acts.len()],
            w,
            scales: sc,
            residual: None,
            routing: None,
            m: m as u32,
            n: n as u32,
            k: k as u32,
        };
        // SAFETY: shapes as documented; k is a multiple of the group.
        unsafe { gemm::launch(gk, red, s, &args, scratch, out, splits) }
    })
}

/// The inputs [`time_splits`] rotates and writes: weights, activations, scratch, output.
type DenseData<'a> = (
    &'a [DenseCopy],
    &'a [CudaSlice<bf16>],
    &'a mut Scratch,
    &'a mut CudaSlice<bf16>,
);

/// [`time_gemm`] at each k split count of `splits`: (splits, µs) pairs.
fn time_splits<K: W4a16Kernel>(
    s: &Arc<CudaStream>,
    reps: usize,
    kern: (&K::Params, &CompiledKernel<K>, Option<&CompiledKernel<W4a16Reduce>>),
    (wts, acts, scratch, out): DenseData<'_>,
    mnk: [usize; 3],
    splits: &[u32],
) -> Result<Vec<(u32, f64)>, RuntimeError> {
    splits
        .iter()
        .map(|&sp| Ok((sp, time_gemm(s, reps, kern, wts, acts, scratch, out, mnk, sp)?)))
        .collect()
}

/// Times one dense [`W4a16Gemv`] variant at `[m, n, k]`, rotating weights and activations;
/// `none` is any non-empty f32 buffer (the unused router weights).
#[allow(clippy::too_many_arguments)]
fn time_gemv(
    s: &Arc<CudaStream>,
    reps: usize,
    gk: &CompiledKernel<W4a16Gemv>,
    wts: &[DenseCopy],
    acts: &[CudaSlice<bf16>],
    none: &CudaSlice<f32>,
    out: &mut CudaSlice<bf16>,
    [m, n, k]: [usize; 3],
) -> Result<f64, RuntimeError> {
    let ids = upload(s, &[0u32])?;
    time_us(s, reps, |i| {
        let (_, wi, sc) = &wts[i % wts.len()];
        let (x, w, scales, rows) = (&acts[i % acts.len()], wi, sc, m);
        let (unused_u32, unused_f32) = (&ids, none);
        DenseGemvOp {
            x,
            w,
            scales,
            out: &mut *out,
            rows,
            n,
            k,
            unused_u32,
            unused_f32,
        }
        .launch(gk, s)
    })
}

/// The dense table's cells for the fastest of `timed` (sorted here): µs, % of the copy
/// bandwidth `bw` at `bytes` moved, speedup over `cublas` µs, and its label; dashes when empty.
fn best_cells(timed: &mut [Timed], bytes: f64, bw: f64, cublas: f64) -> String {
    timed.sort_by(|a, b| a.us.total_cmp(&b.us));
    match timed.first() {
        Some(g) => {
            let gg = bytes / (g.us * 1e-6) / 1e9;
            format!(
                "{:.1} | {:.0}% | {:.2}x | {}",
                g.us,
                100.0 * gg / bw,
                cublas / g.us,
                g.label
            )
        }
        None => "- | - | - | -".into(),
    }
}

/// `wg1 mt1 bn64 st4`: a stream-K candidate's short name.
fn short_sk(p: &W4a16SkParams) -> String {
    format!("wg{} mt{} bn{} st{}", p.wgs, p.mt, p.bn, p.stages)
}

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
    let q_bytes = q_bytes(n, k);
    let wts = dense_weights(gpu, n, k, rng)?;
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
    let reduce = gpu.compile::<W4a16Reduce>(&ReduceParams {
        block: 256,
        epilogue: Epilogue::Plain,
    })?;
    // The warpgroup kernel where the GPU has `wgmma` (plain g32 candidates in either layout).
    let mut wg_kernels = Vec::new();
    if ddtree_kernels::wgmma_supported(gpu.fingerprint().compute_capability) {
        for p in WG_DENSE_SPACE.iter().filter(|p| p.group == 32) {
            wg_kernels.push((*p, gpu.compile::<W4a16GemmWg>(p)?));
        }
    }
    let sk = if wg_kernels.is_empty() {
        None
    } else {
        Some(SkBench::new(gpu, n, k, rng)?)
    };
    let gemv_kernels: Vec<(GemvW4Params, _)> = GEMV_SPACE
        .iter()
        .filter(|p| p.mode == GemvMode::Dense && p.group == 32)
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
        // The engine's pick: the warpgroup kernel's default where it has one, else the tile GEMM's.
        let (dp, dsplits) = default_dense(m as u32, n as u32, k as u32);
        let wg_default = gemm_wg::default_dense(m as u32, n as u32, k as u32).filter(|_| !wg_kernels.is_empty());
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
            let data = (&wts[..], &acts[..], &mut scratch, &mut out);
            for (sp, us) in time_splits(s, reps, (p, gk, red.as_ref()), data, [m, n, k], &splits)? {
                if wg_default.is_none() && *p == dp && sp == dsplits {
                    default_us = us;
                }
                timed.push(Timed {
                    label: format!("{} x{sp}", short(p)),
                    us,
                });
            }
        }
        // The warpgroup kernel: candidates whose N tile is not far above M, split-K ones at up
        // to 4 splits.
        let mut wg: Vec<Timed> = Vec::new();
        for (p, gk) in &wg_kernels {
            if p.bn as usize > 4 * m.next_power_of_two().max(8) && wg_default.map(|d| d.0) != Some(*p) {
                continue;
            }
            let splits: &[u32] = if p.splitk { &[1, 2, 3, 4] } else { &[1] };
            let data = (&wts[..], &acts[..], &mut scratch, &mut out);
            for (sp, us) in time_splits(s, reps, (p, gk, p.splitk.then_some(&reduce)), data, [m, n, k], splits)? {
                if wg_default == Some((*p, sp)) {
                    default_us = us;
                }
                wg.push(Timed {
                    label: format!("{} x{sp}", short_wg(p)),
                    us,
                });
            }
        }
        timed.sort_by(|a, b| a.us.total_cmp(&b.us));
        let best = &timed[0];
        let bytes = (q_bytes + 2 * m * k + 2 * m * n) as f64;
        let wg_col = best_cells(&mut wg, bytes, bw, cublas);
        let gbs = bytes / (best.us * 1e-6) / 1e9;
        // The small-token GEMV: every dense candidate that takes m rows.
        let mut gv: Vec<Timed> = Vec::new();
        for (p, gk) in &gemv_kernels {
            if (w4gemv::max_tokens(p) as usize) < m {
                continue;
            }
            let us = time_gemv(s, reps, gk, &wts, &acts, &scratch.part, &mut out, [m, n, k])?;
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
        // The stream-K kernel: every candidate, the activation-tiles launch included.
        let mut skt: Vec<Timed> = Vec::new();
        if let Some(sk) = &sk {
            for i in 0..sk.kernels.len() {
                skt.push(Timed {
                    label: short_sk(&sk.kernels[i].0),
                    us: sk.time(gpu, reps, i, &acts, &mut out, m)?.1,
                });
            }
        }
        let sk_col = best_cells(&mut skt, bytes, bw, cublas);
        println!(
            "| {k}->{n} | {m} | {cublas:.1} | {:.1} | {gbs:.0} | {:.0}% | {:.2}x | {default_us:.1} | {} | {wg_col} | {gemv_col} | {sk_col} |",
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
    format!(
        "w{} mt{} st{} c{}{}{}{}",
        p.warps,
        p.mt,
        p.stages,
        p.chunks,
        if p.xr { " xr" } else { "" },
        if p.sr { " sr" } else { "" },
        if p.kw { " kw" } else { "" }
    )
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

/// A compact warpgroup-kernel variant label.
fn short_wg(p: &W4a16WgParams) -> String {
    let l = if p.layout == Layout::Interleaved { "il" } else { "ck" };
    format!(
        "wg{} mt{} bn{} st{}{}",
        p.wgs,
        p.mt,
        p.bn,
        p.stages,
        if p.layout == Layout::Interleaved {
            String::new()
        } else {
            format!(" {l}")
        }
    ) + if p.splitk { " sk" } else { "" }
}

/// `us` as "µs (% of copy)" for `bytes` moved, bold when it is `best`.
fn cell(us: Option<f64>, bytes: f64, bw: f64, best: f64) -> String {
    match us {
        None => "-".into(),
        Some(us) => {
            let c = format!("{us:.1} ({:.0}%)", 100.0 * bytes / (us * 1e-6) / 1e9 / bw);
            if us == best {
                format!("**{c}**")
            } else {
                c
            }
        }
    }
}

/// A table row's cells, the fastest in bold.
fn cells(times: &[Option<f64>], bytes: f64, bw: f64) -> String {
    let best = times.iter().flatten().copied().fold(f64::INFINITY, f64::min);
    times
        .iter()
        .map(|t| cell(*t, bytes, bw, best))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// `--gemv`: every dense GEMV candidate of scale group `group` (and the default GEMM at that
/// group) at M = 1, 2, 4, 16 on the decode shapes, then (with `moe`) every g32 GEMV pair (and
/// the best grouped pair) on the MoE slice at T = 1..16.
fn bench_gemv(gpu: &Gpu, bw: f64, reps: usize, moe: bool, group: u32, rng: &mut StdRng) -> Result<(), RuntimeError> {
    let s = gpu.stream();
    if !w4gemv::takes_group(group as usize) {
        return Err(RuntimeError::Launch {
            kernel: W4a16Gemv::NAME.into(),
            reason: format!("--group {group}: the GEMV takes 32, 64 or 128"),
        });
    }
    let dense: Vec<(GemvW4Params, CompiledKernel<W4a16Gemv>)> = GEMV_SPACE
        .iter()
        .filter(|p| p.mode == GemvMode::Dense && p.group == group)
        .map(|p| Ok((*p, gpu.compile::<W4a16Gemv>(p)?)))
        .collect::<Result<_, RuntimeError>>()?;
    // (The weights hold g32 scale words, more than a coarser group reads: the speed does not
    // depend on the values.)
    println!("\nDense GEMV candidates at group {group}, µs (% of copy bandwidth; bytes = packed weights + scales + x + out); GEMM = default_dense's pick and splits");
    let heads: Vec<String> = dense.iter().map(|(p, _)| short_gemv(p)).collect();
    println!("| K->N | M | GEMM | {} |", heads.join(" | "));
    println!("|---|---:|{}", "---:|".repeat(heads.len() + 1));
    for (k, n) in [(7168, 36864), (7168, 2048), (2048, 7168), (1536, 12288)] {
        let wts = dense_weights(gpu, n, k, rng)?;
        for m in [1usize, 2, 4, 16] {
            let acts: Vec<CudaSlice<bf16>> = (0..4)
                .map(|_| random_bf16_dev(s, rng, m * k))
                .collect::<Result<_, _>>()?;
            let mut out = s
                .alloc_zeros::<bf16>(m * n)
                .map_err(RuntimeError::driver("allocating"))?;
            let mut scratch = Scratch::new(s, 8 * m * n)?;
            let (dp, splits) = default_dense(m as u32, n as u32, k as u32);
            let dp = W4a16Params { group, ..dp };
            let gk = gpu.compile::<W4a16Gemm>(&dp)?;
            let red = if dp.splitk {
                Some(gpu.compile::<W4a16Reduce>(&ReduceParams {
                    block: 256,
                    epilogue: dp.epilogue,
                })?)
            } else {
                None
            };
            let mut times = vec![Some(time_gemm(
                s,
                reps,
                (&dp, &gk, red.as_ref()),
                &wts,
                &acts,
                &mut scratch,
                &mut out,
                [m, n, k],
                splits,
            )?)];
            for (p, gk) in &dense {
                times.push(if (w4gemv::max_tokens(p) as usize) < m {
                    None
                } else {
                    Some(time_gemv(s, reps, gk, &wts, &acts, &scratch.part, &mut out, [m, n, k])?)
                });
            }
            let bytes = (n * k / 2 + n * k / group as usize * 2 + 2 * m * k + 2 * m * n) as f64;
            println!("| {k}->{n} | {m} | {} |", cells(&times, bytes, bw));
        }
    }
    if !moe {
        return Ok(());
    }
    let mb = MoeBench::new(gpu, rng)?;
    let gemv_kernels = gemv_moe_kernels(gpu)?;
    let kernels = grouped_kernels(gpu)?;
    println!("\nMoE GEMV pairs on the Kimi K2.6 EP8 slice ({MOE_EXPERTS} experts, {MOE_HIDDEN} / {MOE_INTER}, top-{MOE_TOPK}), µs (% of copy bandwidth over the touched experts' bytes); grouped = the best grouped GEMM pair (align + 2 GEMMs + sum)");
    let heads: Vec<String> = gemv_kernels
        .iter()
        .map(|(_, (u, d))| format!("{} / {}", short_gemv(u), short_gemv(d)))
        .collect();
    println!("| T | touched MB | grouped | {} |", heads.join(" | "));
    println!("|---:|---:|---:|{}", "---:|".repeat(heads.len()));
    for tokens in [1usize, 2, 4, 8, 16] {
        let routes = mb.routes(s, tokens, MOE_EXPERTS, rng)?;
        let x = random_bf16_dev(s, rng, tokens * MOE_HIDDEN)?;
        let mut out = s
            .alloc_zeros::<bf16>(tokens * MOE_HIDDEN)
            .map_err(RuntimeError::driver("allocating"))?;
        let (gus, _) = best_grouped(&mb, s, reps, &kernels, tokens, &routes, &x, &mut out)?;
        let mut times = vec![Some(gus)];
        for (kern, (up, down)) in &gemv_kernels {
            let takes = w4gemv::max_tokens(up).min(w4gemv::max_tokens(down)) as usize >= tokens;
            times.push(if takes {
                Some(mb.time(
                    s,
                    reps,
                    kern,
                    Layout::Interleaved,
                    MoePath::Gemv,
                    tokens,
                    &routes,
                    &x,
                    &mut out,
                )?)
            } else {
                None
            });
        }
        let bytes = routes.touched * mb.per_expert as f64;
        println!("| {tokens} | {:.0} | {} |", bytes / 1e6, cells(&times, bytes, bw));
    }
    Ok(())
}

/// `--profile`: the default dense GEMV at 7168->36864, one row, then the first small-token MoE
/// pair at one and eight tokens and the grouped pair at 16 and 64, 20 calls each (one untimed
/// sample: see [`time_us`]).
fn profile_gemv(gpu: &Gpu, rng: &mut StdRng) -> Result<(), RuntimeError> {
    let s = gpu.stream();
    let (n, k) = (36864, 7168);
    let p = w4gemv::default_params(GemvMode::Dense, 32, 1).expect("a one-row dense GEMV");
    let gk = gpu.compile::<W4a16Gemv>(&p)?;
    let wts = dense_weights(gpu, n, k, rng)?;
    let acts = vec![random_bf16_dev(s, rng, k)?];
    let none = s.alloc_zeros::<f32>(1).map_err(RuntimeError::driver("allocating"))?;
    let mut out = s.alloc_zeros::<bf16>(n).map_err(RuntimeError::driver("allocating"))?;
    let us = time_gemv(s, 1, &gk, &wts, &acts, &none, &mut out, [1, n, k])?;
    println!("{} at 1 x {k} -> {n}: {us:.1} µs", W4a16Gemv::symbol(&p));
    let mb = MoeBench::new(gpu, rng)?;
    let (kern, (up, down)) = gemv_moe_kernels(gpu)?.swap_remove(0);
    let label = format!("MoE pair {} / {}", short_gemv(&up), short_gemv(&down));
    for tokens in [1usize, 8] {
        mb.profile(s, &kern, Layout::Interleaved, MoePath::Gemv, tokens, &label, rng)?;
    }
    // The grouped pairs that won at these token counts (BENCHMARKS.md): m8 tiles up to 32
    // tokens, one m16 tile at 64; interleaved, 4 warps, 4 n8 tiles, 2 stages.
    let grouped = grouped_kernels(gpu)?;
    for tokens in [16usize, 64] {
        let (kern, (up, down)) = grouped
            .iter()
            .find(|(_, (u, _))| {
                u.layout == Layout::Interleaved && u.warps == 4 && u.nt == 4 && u.stages == 2 && u.m8 == (tokens <= 32)
            })
            .expect("the grouped pair of the tables");
        let label = format!("MoE grouped pair {} / {}", short(up), short(down));
        mb.profile(s, kern, up.layout, MoePath::Grouped, tokens, &label, rng)?;
    }
    // The default grouped GEMV pair (align + 2 GEMVs + sum) at 16 and 32 tokens.
    let (kern, (up, down)) = grouped_gemv_kernels(gpu)?.swap_remove(0);
    let label = format!("MoE grouped GEMV pair {} / {}", short_gemv(&up), short_gemv(&down));
    for tokens in [16usize, 32] {
        mb.profile(s, &kern, Layout::Interleaved, MoePath::GroupedGemv, tokens, &label, rng)?;
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
    gpu.set_programmatic_launch(args.pdl);
    if gpu.programmatic_launch() {
        println!("every launch with programmatic dependent launch");
    }
    if args.sk {
        return bench_sk(&gpu, args, seed);
    }
    if args.wg {
        return bench_wg(&gpu, args, seed);
    }
    if args.profile {
        return profile_gemv(&gpu, &mut StdRng::seed_from_u64(seed)).map(|()| true);
    }
    let mut all_passed = true;
    if !args.skip_checks {
        let mut rng = StdRng::seed_from_u64(seed);
        let t = Target::Gpu(&gpu);
        let results = if args.gemv {
            // Every GEMV candidate; the Kimi-sized MoE checks (a slow CPU reference) are left
            // to the full run.
            let mut r = check::gemv_dense_suite(&t, Sizes::Full, &mut rng)?;
            if !args.no_moe {
                r.extend(check::gemv_moe_suite(&t, Sizes::Full, false, &mut rng)?);
            }
            r
        } else {
            let mut r = check::suite(&t, Sizes::Full, &mut rng)?;
            r.extend(check::gemv_suite(&t, Sizes::Full, &mut rng)?);
            if ddtree_kernels::wgmma_supported(gpu.fingerprint().compute_capability) {
                r.extend(check::sk_suite(&t, Sizes::Full, &mut rng)?);
            }
            r
        };
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
    if args.gemv {
        bench_gemv(
            &gpu,
            bw,
            args.reps,
            !args.no_moe,
            args.group,
            &mut StdRng::seed_from_u64(seed ^ 0x5eed),
        )?;
        return Ok(all_passed);
    }
    println!("\nW4A16 g32 (bytes = packed weights + scales + A + out) vs cuBLAS bf16; default = the heuristic's pick; ad = A read directly, not in the ring");
    println!("| K->N | M | cuBLAS µs | W4A16 µs | GB/s | % of copy | vs cuBLAS | default µs | best variant x splits | wgmma µs | wgmma % of copy | wgmma vs cuBLAS | best wgmma | GEMV µs | GEMV % of copy | best GEMV | stream-K µs | stream-K % of copy | stream-K vs cuBLAS | best stream-K |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---|");
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    if !args.moe_only {
        for (k, n) in [(7168, 4096), (2048, 7168), (7168, 2048), (7168, 36864), (1536, 12288)] {
            bench_shape(&gpu, k, n, &args.ms, bw, args.reps, &mut rng)?;
        }
    }
    if !args.no_moe {
        bench_moe(&gpu, bw, args, &mut rng)?;
    }
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

/// Prints the failed checks and a summary line; whether all passed.
fn report_checks(results: &[ddtree_kernels::check::CheckResult]) -> bool {
    for r in results.iter().filter(|r| !r.passed) {
        println!("FAIL {} {}: {:?}", r.symbol, r.case, r.comparison);
    }
    let worst = results.iter().map(|r| r.comparison.rel_l2).fold(0f32, f32::max);
    let ok = results.iter().filter(|r| r.passed).count();
    println!("checks: {ok} of {} passed (worst rel L2 {worst:.2e})", results.len());
    ok == results.len()
}

fn main() -> ExitCode {
    ddtree_benches::exit_code(run(&Args::parse()))
}
