//! GPU-versus-CPU checks of the W4A16 kernels: fresh random INT4 weights and bf16 activations,
//! outputs (and split-K partials) poisoned with NaN, every candidate against the f32 reference
//! at ragged M / N / K, the GPU repack against its CPU model bit for bit, and the MoE block.

use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use ddtree_runtime::{Gpu, RuntimeError};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::gemm::{self, GemmArgs, Scratch, DENSE_SPACE, FUSED_SPACE};
use super::layout::{interleaved_words, matmul, repack_interleaved, PackedInt4, RepackParams};
use super::moe::{self, DeviceExperts, MoeKernels};
use super::{Epilogue, Layout, ReduceParams, W4a16Gemm, W4a16Params, W4a16Reduce, W4a16Repack};
use crate::check::{compare, random_bf16, CheckResult, Tolerance};

fn drv(context: &'static str) -> impl Fn(ddtree_runtime::cudarc::driver::DriverError) -> RuntimeError {
    move |source| RuntimeError::Driver {
        context: context.into(),
        source,
    }
}

/// Copies `v` to the device.
pub fn upload<T: DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> Result<CudaSlice<T>, RuntimeError> {
    s.clone_htod(v).map_err(drv("copying to the GPU"))
}

fn download<T: DeviceRepr + Default + Clone>(s: &Arc<CudaStream>, d: &CudaSlice<T>) -> Result<Vec<T>, RuntimeError> {
    s.clone_dtoh(d).map_err(drv("copying from the GPU"))
}

/// Weights on the device in `layout` (interleaved ones repacked by the GPU kernel).
pub fn device_weights(gpu: &Gpu, p: &PackedInt4, layout: Layout) -> Result<CudaSlice<u32>, RuntimeError> {
    let s = gpu.stream();
    let src = upload(s, &p.packed)?;
    if layout == Layout::Checkpoint {
        return Ok(src);
    }
    let rp = RepackParams { block: 256 };
    let k = gpu.compile::<W4a16Repack>(&rp)?;
    let words = interleaved_words(p.n, p.k) * p.experts;
    let mut dst = upload(s, &vec![0xdead_beefu32; words])?;
    let grid = (words as u32).div_ceil(rp.block).clamp(1, 65535);
    // SAFETY: src holds experts * n * k / 8 words, dst experts * interleaved_words(n, k).
    unsafe { W4a16Repack::launch(&k, s, grid, &src, &mut dst, p.n as u32, p.k as u32, p.experts as u32)? };
    Ok(dst)
}

fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// Tolerance for sums of `k` products: bf16 rounding of the dequantized weights and the output,
/// the absolute part scaled by the output's RMS.
fn sum_tolerance(want: &[f32]) -> Tolerance {
    let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len().max(1) as f32).sqrt();
    Tolerance {
        rtol: 1e-2,
        atol: 1e-2 * rms,
        rel_l2: 1e-2,
    }
}

fn result(
    kernel: &'static str,
    symbol: String,
    case: String,
    got: &[f32],
    want: &[f32],
    tol: Tolerance,
) -> CheckResult {
    let comparison = compare(got, want, tol);
    CheckResult {
        kernel,
        symbol,
        passed: comparison.passed(tol),
        case,
        comparison,
    }
}

/// Checks the GPU repack against [`repack_interleaved`] (exact).
pub fn repack(gpu: &Gpu, n: usize, k: usize, experts: usize, rng: &mut StdRng) -> Result<CheckResult, RuntimeError> {
    let p = PackedInt4::random(rng, n, k, 32, experts, 1.0);
    let got = download(gpu.stream(), &device_weights(gpu, &p, Layout::Interleaved)?)?;
    let want = repack_interleaved(&p);
    // Compare the words as exact integers split into halves (f32 holds 16 bits exactly).
    let halves = |v: &[u32]| {
        v.iter()
            .flat_map(|w| [(w & 0xffff) as f32, (w >> 16) as f32])
            .collect::<Vec<_>>()
    };
    let sym = W4a16Repack::symbol(&RepackParams { block: 256 });
    Ok(result(
        W4a16Repack::NAME,
        sym,
        format!("n={n} k={k} experts={experts}"),
        &halves(&got),
        &halves(&want),
        Tolerance::EXACT,
    ))
}

/// Checks one dense variant at `m x n x k` with `splits` k splits.
pub fn dense(
    gpu: &Gpu,
    p: &W4a16Params,
    m: usize,
    n: usize,
    k: usize,
    splits: u32,
    rng: &mut StdRng,
) -> Result<CheckResult, RuntimeError> {
    let s = gpu.stream();
    let gk = gpu.compile::<W4a16Gemm>(p)?;
    let red = if p.splitk {
        Some(gpu.compile::<W4a16Reduce>(&ReduceParams {
            block: 256,
            epilogue: p.epilogue,
        })?)
    } else {
        None
    };
    let wq = PackedInt4::random(rng, n, k, p.group as usize, 1, 0.05);
    let (a, af) = random_bf16(rng, m * k, -1.0, 1.0);
    let (res, resf) = random_bf16(rng, m * n, -1.0, 1.0);
    let (da, dres, dsc) = (upload(s, &a)?, upload(s, &res)?, upload(s, &wq.scales)?);
    let dw = device_weights(gpu, &wq, p.layout)?;
    let cols = gemm::out_cols(p, n as u32) as usize;
    let mut out = upload(s, &vec![bf16::NAN; m * cols])?;
    let mut scratch = Scratch::new(s, 1)?;
    scratch.part = upload(s, &vec![f32::NAN; splits as usize * m * n])?;
    let residual = (p.epilogue == Epilogue::Residual).then_some(&dres);
    let args = GemmArgs {
        a: &da,
        w: &dw,
        scales: &dsc,
        residual,
        routing: None,
        m: m as u32,
        n: n as u32,
        k: k as u32,
    };
    // SAFETY: buffers have the documented shapes; k is a multiple of 32 and of the group.
    unsafe { gemm::launch(&gk, red.as_ref(), s, &args, &mut scratch, &mut out, splits)? };
    let got = to_f32(&download(s, &out)?);
    let full = matmul(&af, &wq.dequantize(), m, n, k);
    let want: Vec<f32> = match p.epilogue {
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
    Ok(result(
        W4a16Gemm::NAME,
        W4a16Gemm::symbol(p),
        case,
        &got,
        &want,
        sum_tolerance(&want),
    ))
}

/// Grouped (gate_up, down) candidate pairs with the same layout and `mt`.
pub fn moe_pairs() -> Vec<(W4a16Params, W4a16Params)> {
    let moe: Vec<&W4a16Params> = FUSED_SPACE.iter().filter(|p| p.moe).collect();
    let mut out = Vec::new();
    for up in moe.iter().filter(|p| p.epilogue == Epilogue::SiluMul) {
        for down in moe.iter().filter(|p| p.epilogue == Epilogue::RouteScale) {
            if up.layout == down.layout && up.mt == down.mt {
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

/// Checks the MoE block with one (gate_up, down) pair. Routing picks among `experts + 2`
/// experts, so some pairs belong to another rank and must be skipped.
#[allow(clippy::too_many_arguments)]
pub fn moe_block(
    gpu: &Gpu,
    pair: &(W4a16Params, W4a16Params),
    tokens: usize,
    experts: usize,
    hidden: usize,
    inter: usize,
    topk: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, RuntimeError> {
    let s = gpu.stream();
    let kern = MoeKernels::new(gpu, &pair.0, &pair.1)?;
    let w13 = PackedInt4::random(rng, 2 * inter, hidden, 32, experts, 0.05);
    let w2 = PackedInt4::random(rng, hidden, inter, 32, experts, 0.05);
    let (x, xf) = random_bf16(rng, tokens * hidden, -1.0, 1.0);
    let (ids, wts) = random_routing(rng, tokens, topk, experts + 2);
    let (d13, d2) = (
        device_weights(gpu, &w13, pair.0.layout)?,
        device_weights(gpu, &w2, pair.1.layout)?,
    );
    let (s13, s2) = (upload(s, &w13.scales)?, upload(s, &w2.scales)?);
    let ex = DeviceExperts {
        w13: &d13,
        s13: &s13,
        w2: &d2,
        s2: &s2,
        experts: experts as u32,
        hidden: hidden as u32,
        inter: inter as u32,
    };
    let (dx, dids, dw) = (upload(s, &x)?, upload(s, &ids)?, upload(s, &wts)?);
    let mut out = upload(s, &vec![bf16::NAN; tokens * hidden])?;
    let mut bufs = kern.buffers(s, tokens, topk, &ex)?;
    // SAFETY: every buffer has the documented shape; weights are in the variants' layout.
    unsafe { kern.run(s, &ex, &dx, &dids, &dw, &mut out, &mut bufs, tokens as u32, topk as u32)? };
    let got = to_f32(&download(s, &out)?);
    let want = moe::reference(&xf, &ids, &wts, topk, &w13, &w2);
    let sym = format!("{} + {}", W4a16Gemm::symbol(&pair.0), W4a16Gemm::symbol(&pair.1));
    let case = format!("tokens={tokens} experts={experts} hidden={hidden} inter={inter} topk={topk}");
    Ok(result("moe_w4a16", sym, case, &got, &want, sum_tolerance(&want)))
}

/// Runs every check: the repack, every dense and fused candidate at ragged sizes (split-K
/// variants with 1 and 3 splits), and every MoE pair. `full` adds Kimi-sized cases for the
/// first candidates.
pub fn run_all(gpu: &Gpu, full: bool, seed: u64) -> Result<Vec<CheckResult>, RuntimeError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = vec![repack(gpu, 13, 160, 2, &mut rng)?, repack(gpu, 64, 1024, 1, &mut rng)?];
    let mut cases: Vec<(usize, usize, usize)> = vec![
        (1, 72, 256),
        (5, 203, 1056),
        (16, 136, 512),
        (37, 96, 1152),
        (130, 264, 640),
    ];
    if full {
        cases.extend([(16, 4096, 7168), (64, 7168, 2048), (200, 1536, 1536)]);
    }
    for p in DENSE_SPACE.iter().chain(FUSED_SPACE).filter(|p| !p.moe) {
        for &(m, n, k) in &cases {
            if k % p.group as usize != 0 || (full && n >= 1536 && *p != DENSE_SPACE[0] && *p != DENSE_SPACE[9]) {
                continue;
            }
            // SiLU-and-mul needs an even n whose halves are whole tiles for the interleaved layout.
            let n = if p.epilogue == Epilogue::SiluMul {
                n.div_ceil(16) * 16
            } else {
                n
            };
            for splits in if p.splitk { vec![1, 3] } else { vec![1] } {
                out.push(dense(gpu, p, m, n, k, splits, &mut rng)?);
            }
        }
    }
    for pair in moe_pairs() {
        let mut mcases = vec![(1, 6, 256, 64, 2), (5, 6, 160, 96, 3), (40, 9, 288, 128, 4)];
        if full {
            mcases.push((16, 8, 7168, 2048, 8));
        }
        for (t, e, h, i, topk) in mcases {
            out.push(moe_block(gpu, &pair, t, e, h, i, topk, &mut rng)?);
        }
    }
    Ok(out)
}
