//! GPU-versus-CPU checks of every kernel: fresh random inputs, outputs poisoned with NaN before
//! the launch, comparison against the module's CPU reference with a tolerance by precision.
//!
//! Shared by the GPU tests (`tests/gpu.rs`) and the `ddtree-kernel-check` binary, which runs
//! every candidate of every kernel at several sizes, ragged edges included.

use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use ddtree_runtime::{Gpu, RuntimeError};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::{
    embedding, gemm_bf16, rms_norm, rope, silu_mul, topk, Embedding, EmbeddingParams, GemmBf16, GemmParams, RmsNorm,
    RmsNormParams, RopeInterleaved, RopeParams, RowTopk, SiluMul, SiluMulParams, TopkParams,
};

/// Element-wise tolerance `|got - want| <= atol + rtol * |want|`, plus a bound on the relative
/// L2 error over the whole output.
#[derive(Clone, Copy, Debug)]
pub struct Tolerance {
    /// Relative part.
    pub rtol: f32,
    /// Absolute part.
    pub atol: f32,
    /// Bound on `||got - want|| / ||want||`.
    pub rel_l2: f32,
}

impl Tolerance {
    /// bf16 outputs computed in f32: one bf16 rounding (2^-9 relative) plus f32 reordering.
    pub const BF16: Tolerance = Tolerance { rtol: 1e-2, atol: 1e-3, rel_l2: 1e-2 };
    /// Exact results (indices, copies).
    pub const EXACT: Tolerance = Tolerance { rtol: 0.0, atol: 0.0, rel_l2: 0.0 };
}

/// How a GPU output compares with its reference.
#[derive(Clone, Debug)]
pub struct Comparison {
    /// Elements compared.
    pub len: usize,
    /// Largest absolute difference (NaN counts as infinite).
    pub max_abs: f32,
    /// `||got - want|| / ||want||`.
    pub rel_l2: f32,
    /// Elements outside the tolerance, NaN included.
    pub bad: usize,
    /// The first bad element: (index, got, want).
    pub first_bad: Option<(usize, f32, f32)>,
}

impl Comparison {
    /// Whether every element is within tolerance and no value is NaN.
    pub fn passed(&self, tol: Tolerance) -> bool {
        self.bad == 0 && self.rel_l2 <= tol.rel_l2
    }
}

/// Compares `got` with `want`. A NaN in `got` (an unwritten, poisoned element) always fails.
pub fn compare(got: &[f32], want: &[f32], tol: Tolerance) -> Comparison {
    assert_eq!(got.len(), want.len(), "compare: length mismatch");
    let (mut num, mut den, mut max_abs, mut bad, mut first_bad) = (0f64, 0f64, 0f32, 0, None);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let d = (g - w).abs();
        let ok = !g.is_nan() && d <= tol.atol + tol.rtol * w.abs();
        if !ok {
            bad += 1;
            first_bad.get_or_insert((i, g, w));
        }
        max_abs = if d.is_nan() { f32::INFINITY } else { max_abs.max(d) };
        num += (d as f64).powi(2);
        den += (w as f64).powi(2);
    }
    let rel_l2 = if den > 0.0 { (num / den).sqrt() as f32 } else if num > 0.0 { f32::INFINITY } else { 0.0 };
    let rel_l2 = if rel_l2.is_nan() { f32::INFINITY } else { rel_l2 };
    Comparison { len: got.len(), max_abs, rel_l2, bad, first_bad }
}

/// One check: a kernel variant at one problem size.
#[derive(Clone, Debug)]
pub struct CheckResult {
    /// Kernel name.
    pub kernel: &'static str,
    /// Variant symbol.
    pub symbol: String,
    /// Problem size, e.g. `rows=3 n=7168`.
    pub case: String,
    /// Comparison with the reference.
    pub comparison: Comparison,
    /// Whether it passed.
    pub passed: bool,
}

/// Random bf16 values uniform in `[lo, hi)`, with their exact f32 values.
pub fn random_bf16(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> (Vec<bf16>, Vec<f32>) {
    let h: Vec<bf16> = (0..n).map(|_| bf16::from_f32(rng.random_range(lo..hi))).collect();
    let f = h.iter().map(|v| v.to_f32()).collect();
    (h, f)
}

fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

fn upload<T: DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> Result<CudaSlice<T>, RuntimeError> {
    s.clone_htod(v).map_err(|e| RuntimeError::Driver { context: "copying to the GPU".into(), source: e })
}

fn download<T: DeviceRepr + Default + Clone>(s: &Arc<CudaStream>, d: &CudaSlice<T>) -> Result<Vec<T>, RuntimeError> {
    s.clone_dtoh(d).map_err(|e| RuntimeError::Driver { context: "copying from the GPU".into(), source: e })
}

/// A bf16 output buffer poisoned with NaN.
fn poisoned_bf16(s: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<bf16>, RuntimeError> {
    upload(s, &vec![bf16::NAN; n])
}

fn result<K: Kernel>(p: &K::Params, case: String, got: &[f32], want: &[f32], tol: Tolerance) -> CheckResult {
    let comparison = compare(got, want, tol);
    CheckResult { kernel: K::NAME, symbol: K::symbol(p), passed: comparison.passed(tol), case, comparison }
}

/// Problem sizes: `small` for quick tests, otherwise up to the engine's real sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sizes {
    /// A few small, ragged sizes.
    Small,
    /// Small ragged sizes plus the Kimi K2.6 sizes (hidden 7168, vocab 163840).
    Full,
}

/// Checks RMSNorm.
pub fn rms_norm(gpu: &Gpu, p: &RmsNormParams, rows: usize, n: usize, rng: &mut StdRng) -> Result<CheckResult, RuntimeError> {
    let s = gpu.stream();
    let k = gpu.compile::<RmsNorm>(p)?;
    let (x, xf) = random_bf16(rng, rows * n, -2.0, 2.0);
    let (w, wf) = random_bf16(rng, n, 0.5, 1.5);
    let (dx, dw) = (upload(s, &x)?, upload(s, &w)?);
    let mut out = poisoned_bf16(s, rows * n)?;
    let eps = 1e-6f32;
    // SAFETY: x and out hold rows * n elements, weight n; vec variants are only run with n % 8 == 0.
    unsafe { RmsNorm::launch(&k, s, rows as u32, &dx, &dw, &mut out, n as u32, eps)? };
    let got = to_f32(&download(s, &out)?);
    Ok(result::<RmsNorm>(p, format!("rows={rows} n={n}"), &got, &rms_norm::reference(&xf, &wf, n, eps), Tolerance::BF16))
}

/// Checks SiLU-and-mul.
pub fn silu_mul(gpu: &Gpu, p: &SiluMulParams, rows: usize, d: usize, rng: &mut StdRng) -> Result<CheckResult, RuntimeError> {
    let s = gpu.stream();
    let k = gpu.compile::<SiluMul>(p)?;
    let (x, xf) = random_bf16(rng, rows * 2 * d, -4.0, 4.0);
    let dx = upload(s, &x)?;
    let mut out = poisoned_bf16(s, rows * d)?;
    let grid = ((rows * d).div_ceil(p.block as usize * if p.vec { 8 } else { 1 })).clamp(1, 4096) as u32;
    // SAFETY: gate_up holds rows * 2d elements and out rows * d; vec variants need d % 8 == 0.
    unsafe { SiluMul::launch(&k, s, grid, &dx, &mut out, rows as u32, d as u32)? };
    let got = to_f32(&download(s, &out)?);
    Ok(result::<SiluMul>(p, format!("rows={rows} d={d}"), &got, &silu_mul::reference(&xf, d), Tolerance::BF16))
}

/// Checks interleaved RoPE (in place).
pub fn rope(gpu: &Gpu, p: &RopeParams, tokens: usize, heads: usize, stride: usize, offset: usize, rng: &mut StdRng) -> Result<CheckResult, RuntimeError> {
    let s = gpu.stream();
    let k = gpu.compile::<RopeInterleaved>(p)?;
    let (dim, half, max_pos) = (p.dim as usize, p.dim as usize / 2, 4096usize);
    let (x, mut xf) = random_bf16(rng, tokens * heads * stride, -2.0, 2.0);
    let positions: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..max_pos as u32)).collect();
    let angles: Vec<f32> = (0..max_pos * half).map(|i| (i / half) as f32 * 10000f32.powf(-2.0 * (i % half) as f32 / dim as f32)).collect();
    let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
    let mut dx = upload(s, &x)?;
    let (dp, dc, ds) = (upload(s, &positions)?, upload(s, &cos)?, upload(s, &sin)?);
    let rows = tokens * heads;
    let grid = (rows * half).div_ceil(p.block as usize) as u32;
    // SAFETY: x holds rows * stride elements with offset + dim <= stride; tables hold max_pos * dim/2.
    unsafe { RopeInterleaved::launch(&k, s, grid, &mut dx, &dp, &dc, &ds, rows as u32, heads as u32, stride as u32, offset as u32)? };
    let got = to_f32(&download(s, &dx)?);
    rope::reference(&mut xf, &positions, &cos, &sin, heads, stride, offset, dim);
    Ok(result::<RopeInterleaved>(p, format!("tokens={tokens} heads={heads} stride={stride} offset={offset}"), &got, &xf, Tolerance::BF16))
}

/// Checks the embedding gather (some ids out of range on purpose).
pub fn embedding(gpu: &Gpu, p: &EmbeddingParams, tokens: usize, vocab: usize, hidden: usize, rng: &mut StdRng) -> Result<CheckResult, RuntimeError> {
    let s = gpu.stream();
    let k = gpu.compile::<Embedding>(p)?;
    let (t, tf) = random_bf16(rng, vocab * hidden, -1.0, 1.0);
    let ids: Vec<u32> = (0..tokens).map(|i| if i % 7 == 3 { vocab as u32 + i as u32 } else { rng.random_range(0..vocab as u32) }).collect();
    let (dt, di) = (upload(s, &t)?, upload(s, &ids)?);
    let mut out = poisoned_bf16(s, tokens * hidden)?;
    // SAFETY: table holds vocab * hidden elements, out tokens * hidden; vec variants need hidden % 8 == 0.
    unsafe { Embedding::launch(&k, s, tokens as u32, &di, &dt, &mut out, hidden as u32, vocab as u32)? };
    let got = to_f32(&download(s, &out)?);
    Ok(result::<Embedding>(p, format!("tokens={tokens} vocab={vocab} hidden={hidden}"), &got, &embedding::reference(&ids, &tf, hidden), Tolerance::EXACT))
}

/// Checks row top-k (rows seeded with repeated values to exercise the tie rule).
pub fn topk(gpu: &Gpu, p: &TopkParams, rows: usize, n: usize, rng: &mut StdRng) -> Result<CheckResult, RuntimeError> {
    let s = gpu.stream();
    let k = gpu.compile::<RowTopk>(p)?;
    let kk = p.k as usize;
    let mut logits: Vec<f32> = (0..rows * n).map(|_| rng.random_range(-20.0f32..20.0)).collect();
    for r in 0..rows {
        // A few exact ties at the top, at random places.
        let top = 25.0 + r as f32;
        for _ in 0..3 {
            logits[r * n + rng.random_range(0..n)] = top;
        }
    }
    let dl = upload(s, &logits)?;
    let mut vals = upload(s, &vec![f32::NAN; rows * kk])?;
    let mut idx = upload(s, &vec![u32::MAX; rows * kk])?;
    // SAFETY: logits hold rows * n values with n >= k; outputs hold rows * k.
    unsafe { RowTopk::launch(&k, s, rows as u32, &dl, &mut vals, &mut idx, n as u32)? };
    let (gv, gi) = (download(s, &vals)?, download(s, &idx)?);
    let want = topk::reference(&logits, n, kk);
    // Compare values and indices as one exact vector.
    let got: Vec<f32> = gv.iter().zip(&gi).flat_map(|(v, i)| [*v, *i as f32]).collect();
    let want: Vec<f32> = want.iter().flat_map(|(v, i)| [*v, *i as f32]).collect();
    Ok(result::<RowTopk>(p, format!("rows={rows} n={n}"), &got, &want, Tolerance::EXACT))
}

/// Checks the tile GEMM.
pub fn gemm(gpu: &Gpu, p: &GemmParams, m: usize, n: usize, kd: usize, rng: &mut StdRng) -> Result<CheckResult, RuntimeError> {
    let s = gpu.stream();
    let k = gpu.compile::<GemmBf16>(p)?;
    let (a, af) = random_bf16(rng, m * kd, -1.0, 1.0);
    let (b, bf) = random_bf16(rng, n * kd, -1.0, 1.0);
    let (da, db) = (upload(s, &a)?, upload(s, &b)?);
    let mut c = poisoned_bf16(s, m * n)?;
    let grid = ((n as u32).div_ceil(p.bn), (m as u32).div_ceil(p.bm));
    // SAFETY: a is m x k, b is n x k, c is m x n, k % 8 == 0 (callers pick such k).
    unsafe { GemmBf16::launch(&k, s, grid, &da, &db, &mut c, m as u32, n as u32, kd as u32)? };
    let got = to_f32(&download(s, &c)?);
    let want = gemm_bf16::reference(&af, &bf, m, n, kd);
    // Sums of k products: scale the absolute tolerance with the typical output size.
    let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len().max(1) as f32).sqrt();
    let tol = Tolerance { rtol: 1e-2, atol: 1e-2 * rms, rel_l2: 1e-2 };
    Ok(result::<GemmBf16>(p, format!("m={m} n={n} k={kd}"), &got, &want, tol))
}

/// Runs every candidate of every kernel at the sizes of `sizes` and returns the results.
/// Variants that cannot take a size (vector paths need multiples of 8) skip it.
pub fn run_all(gpu: &Gpu, sizes: Sizes, seed: u64) -> Result<Vec<CheckResult>, RuntimeError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let full = sizes == Sizes::Full;
    let mut out = Vec::new();
    for p in RmsNorm::space() {
        let mut ns = vec![(1, 64), (3, 136), (5, 1000)];
        if full {
            ns.extend([(7, 7168), (64, 1536), (33, 512)]);
        }
        for (rows, n) in ns {
            if p.vec && n % 8 != 0 {
                continue;
            }
            out.push(rms_norm(gpu, &p, rows, n, &mut rng)?);
        }
    }
    for p in SiluMul::space() {
        let mut ds = vec![(1, 64), (3, 200), (7, 37)];
        if full {
            ds.extend([(16, 2048), (9, 18432)]);
        }
        for (rows, d) in ds {
            if p.vec && d % 8 != 0 {
                continue;
            }
            out.push(silu_mul(gpu, &p, rows, d, &mut rng)?);
        }
    }
    for p in RopeInterleaved::space() {
        let dim = p.dim as usize;
        // (tokens, heads, stride, offset): q rows [tokens, heads, 128 + dim] with rope last, and
        // k_pe rows [tokens, 1, 512 + dim].
        let mut cases = vec![(1, 1, dim, 0), (3, 4, 128 + dim, 128), (5, 1, 512 + dim, 512)];
        if full {
            cases.extend([(17, 64, 128 + dim, 128), (64, 1, 512 + dim, 512)]);
        }
        for (t, h, st, off) in cases {
            out.push(rope(gpu, &p, t, h, st, off, &mut rng)?);
        }
    }
    for p in Embedding::space() {
        let mut cases = vec![(1, 50, 64), (9, 300, 72), (5, 40, 100)];
        if full {
            cases.push((33, 163840, 7168));
        }
        for (t, v, h) in cases {
            if p.vec && h % 8 != 0 {
                continue;
            }
            out.push(embedding(gpu, &p, t, v, h, &mut rng)?);
        }
    }
    for p in RowTopk::space() {
        let mut cases = vec![(1, 100), (3, 1000), (2, 4099)];
        if full {
            cases.extend([(4, 163840), (17, 163840)]);
        }
        for (rows, n) in cases {
            if n < p.k as usize {
                continue;
            }
            out.push(topk(gpu, &p, rows, n, &mut rng)?);
        }
    }
    for p in GemmBf16::space() {
        let mut cases = vec![(1, 8, 16), (37, 50, 72), (128, 128, 64), (130, 200, 264)];
        if full {
            cases.extend([(256, 7168, 2048), (16, 4096, 7168), (513, 1000, 1032)]);
        }
        for (m, n, k) in cases {
            out.push(gemm(gpu, &p, m, n, k, &mut rng)?);
        }
    }
    Ok(out)
}
