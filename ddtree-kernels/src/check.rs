//! Kernel-versus-CPU-reference checks of every kernel: fresh random inputs, outputs poisoned
//! with NaN before the launch, comparison against the module's CPU reference with a tolerance by
//! precision.
//!
//! Every check runs on a [`Target`]: the CPU interpreter ([`Target::Interp`], what CI uses; it
//! also reports out-of-bounds accesses, shared-memory races and barrier divergence) or a GPU
//! ([`Target::Gpu`]). A check uploads with [`Target::upload`], launches with [`Target::launch`]
//! (arguments in signature order: [`Arg::In`], [`Arg::Out`], [`Arg::from`] a scalar) and
//! downloads with [`Target::download`]; [`on_each_target`] runs a test body on the interpreter
//! and, when one is present, on the GPU. Shared by the tests (`tests/interp.rs`, `tests/gpu.rs`)
//! and the `kernel-check` binary, which runs every candidate of every kernel at several sizes,
//! ragged edges included.

use std::marker::PhantomData;

use ddtree_codegen::interp::{Buffer, Element, HostArg, InterpError, LoadError, Program, Value};
use ddtree_codegen::{CodegenError, Kernel, Scalar, Ty};
use ddtree_runtime::cudarc::driver::{CudaSlice, DeviceRepr};
use ddtree_runtime::{Gpu, Grid, Launcher, RuntimeError};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::{
    add, copy_rows, embedding, fill, gemm_bf16, moe_route, residual, rms_norm, rope, silu_mul, topk, AddAssign,
    AddParams, CopyParams, CopyRows, Embedding, EmbeddingParams, FillParams, FillRandomBf16, FillRandomF32,
    FillRandomU32, GemmBf16, GemmParams, MoeRoute, MoeRouteParams, RmsNorm, RmsNormParams, RopeInterleaved, RopeParams,
    RowTopk, RowTopkSplit, SiluMul, SiluMulParams, SiluMulSplit, TopkParams, TopkSplitParams,
};
use crate::{
    gemv, GemvBf16, GemvBf16F32, GemvGateUpSilu, GemvParams, GemvRmsNormBf16, GemvSplitBf16, GemvSplitF32,
    GemvSplitGateUpSilu, GemvSplitParams,
};
use crate::{AddRmsNorm, AddRmsNormParams, CastBf16F32, CastF32Bf16, CastParams, CopyRowsF32};

/// Where checks run.
#[derive(Clone, Copy, Debug)]
pub enum Target<'g> {
    /// The CPU interpreter of `ddtree-codegen` (no GPU needed; hazards are errors).
    Interp,
    /// A GPU.
    Gpu(&'g Gpu),
}

impl Target<'_> {
    /// Whether `wgmma` kernels run here: the interpreter, or a GPU where
    /// [`crate::wgmma_supported`] holds.
    pub fn runs_wgmma(&self) -> bool {
        match self {
            Target::Interp => true,
            Target::Gpu(g) => crate::wgmma_supported(g.fingerprint().compute_capability),
        }
    }
}

/// A buffer on a [`Target`].
#[derive(Debug)]
pub enum DevBuf<T: DeviceRepr> {
    /// Host memory for the interpreter.
    Host(Buffer, PhantomData<T>),
    /// Device memory.
    Gpu(CudaSlice<T>),
}

/// Element types checks move to and from a target (the DSL scalars).
pub trait Elem: Element + DeviceRepr + Default + Clone {}
impl<T: Element + DeviceRepr + Default + Clone> Elem for T {}

/// A [`DevBuf`] of any element type, as a launch argument.
pub trait Operand {
    /// The DSL element type.
    fn elem(&self) -> Scalar;
    /// The host buffer (interpreter targets).
    fn host(&self) -> Option<&Buffer>;
    /// The host buffer, writable.
    fn host_mut(&mut self) -> Option<&mut Buffer>;
    /// Pushes the device pointer as a read-only argument.
    fn push<'a>(&'a self, l: &mut Launcher<'a>) -> Result<(), CheckError>;
    /// Pushes the device pointer as a writable argument.
    fn push_mut<'a>(&'a mut self, l: &mut Launcher<'a>) -> Result<(), CheckError>;
}

fn wrong_target() -> CheckError {
    CheckError::Args("a buffer was uploaded to a different target".into())
}

impl<T: Elem> Operand for DevBuf<T> {
    fn elem(&self) -> Scalar {
        T::SCALAR
    }
    fn host(&self) -> Option<&Buffer> {
        match self {
            DevBuf::Host(b, _) => Some(b),
            DevBuf::Gpu(_) => None,
        }
    }
    fn host_mut(&mut self) -> Option<&mut Buffer> {
        match self {
            DevBuf::Host(b, _) => Some(b),
            DevBuf::Gpu(_) => None,
        }
    }
    fn push<'a>(&'a self, l: &mut Launcher<'a>) -> Result<(), CheckError> {
        match self {
            DevBuf::Gpu(s) => {
                l.buffer(s);
                Ok(())
            }
            DevBuf::Host(..) => Err(wrong_target()),
        }
    }
    fn push_mut<'a>(&'a mut self, l: &mut Launcher<'a>) -> Result<(), CheckError> {
        match self {
            DevBuf::Gpu(s) => {
                l.buffer_mut(s);
                Ok(())
            }
            DevBuf::Host(..) => Err(wrong_target()),
        }
    }
}

/// One launch argument, in kernel-signature order.
pub enum Arg<'b> {
    /// A `&[T]` slice.
    In(&'b dyn Operand),
    /// A `&mut [T]` slice.
    Out(&'b mut dyn Operand),
    /// A scalar (`Arg::from(n as u32)`).
    Val(Value),
}

impl<V: Into<Value>> From<V> for Arg<'_> {
    fn from(v: V) -> Self {
        Arg::Val(v.into())
    }
}

/// Why a check could not run (a failed comparison is a [`CheckResult`], not an error).
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// GPU runtime error.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// The interpreter found a hazard (out-of-bounds access, race, divergence, ...).
    #[error(transparent)]
    Interp(#[from] InterpError),
    /// Building or lowering the kernel failed.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The arguments do not match the kernel signature.
    #[error("bad launch arguments: {0}")]
    Args(String),
}

/// For GPU-only callers (the tuner): interpreter hazards and argument errors become launch errors.
impl From<CheckError> for RuntimeError {
    fn from(e: CheckError) -> Self {
        match e {
            CheckError::Runtime(e) => e,
            CheckError::Load(LoadError::Codegen(e)) => RuntimeError::Codegen(e),
            other => RuntimeError::Launch {
                kernel: String::new(),
                reason: other.to_string(),
            },
        }
    }
}

impl From<CodegenError> for CheckError {
    fn from(e: CodegenError) -> Self {
        CheckError::Load(e.into())
    }
}

impl Target<'_> {
    /// `interpreter` or the GPU's name.
    pub fn name(&self) -> String {
        match self {
            Target::Interp => "interpreter".to_string(),
            Target::Gpu(g) => g.fingerprint().name.clone(),
        }
    }

    /// Copies `v` to the target.
    pub fn upload<T: Elem>(&self, v: &[T]) -> Result<DevBuf<T>, CheckError> {
        Ok(match self {
            Target::Interp => DevBuf::Host(Buffer::from_slice(v), PhantomData),
            Target::Gpu(g) => DevBuf::Gpu(g.stream().clone_htod(v).map_err(|source| RuntimeError::Driver {
                context: "copying to the GPU".into(),
                source,
            })?),
        })
    }

    /// Copies a buffer back.
    pub fn download<T: Elem>(&self, b: &DevBuf<T>) -> Result<Vec<T>, CheckError> {
        match (self, b) {
            (Target::Interp, DevBuf::Host(h, _)) => Ok(h.to_vec()),
            (Target::Gpu(g), DevBuf::Gpu(d)) => {
                Ok(g.stream().clone_dtoh(d).map_err(|source| RuntimeError::Driver {
                    context: "copying from the GPU".into(),
                    source,
                })?)
            }
            _ => Err(wrong_target()),
        }
    }

    /// Launches the variant of `K` for `p` over `grid`. The argument list is checked against
    /// the kernel signature on every target.
    ///
    /// # Safety
    /// On a GPU the kernel trusts its scalar arguments: sizes and counts must describe the
    /// buffers passed, as the kernel's documentation states. (The interpreter checks every
    /// access and reports violations as [`CheckError::Interp`].)
    pub unsafe fn launch<K: Kernel>(
        &self,
        p: &K::Params,
        grid: impl Into<Grid>,
        args: &mut [Arg<'_>],
    ) -> Result<(), CheckError> {
        let grid = grid.into();
        match self {
            Target::Interp => {
                let prog = Program::of::<K>(p)?;
                let mut host = Vec::with_capacity(args.len());
                for a in args.iter_mut() {
                    host.push(match a {
                        Arg::In(b) => HostArg::In(b.host().ok_or_else(wrong_target)?),
                        Arg::Out(b) => HostArg::Out(b.host_mut().ok_or_else(wrong_target)?),
                        Arg::Val(v) => HostArg::Scalar(*v),
                    });
                }
                prog.launch(grid.0, &mut host)?;
            }
            Target::Gpu(gpu) => {
                let ir = K::ir(p)?;
                check_signature(&ir.args, args)?;
                let k = gpu.compile::<K>(p)?;
                let mut l = k.launcher(gpu.stream(), grid)?;
                for a in args.iter_mut() {
                    match a {
                        Arg::In(b) => b.push(&mut l)?,
                        Arg::Out(b) => b.push_mut(&mut l)?,
                        Arg::Val(v) => push_value(&mut l, v),
                    }
                }
                // SAFETY: the argument types match the C signature (checked above); the caller
                // upholds the size contract.
                unsafe { l.launch()? };
            }
        }
        Ok(())
    }
}

fn push_value<'a>(l: &mut Launcher<'a>, v: &'a Value) {
    match v {
        Value::F32(x) => l.arg(x),
        Value::U32(x) => l.arg(x),
        Value::I32(x) => l.arg(x),
        Value::U64(x) => l.arg(x),
        Value::Bool(x) => l.arg(x),
        Value::Bf16(x) => l.arg(x),
        Value::F16(x) => l.arg(x),
    };
}

/// Checks an argument list against a kernel's signature (the GPU has no other check).
fn check_signature(params: &[ddtree_codegen::ir::Arg], args: &[Arg<'_>]) -> Result<(), CheckError> {
    if params.len() != args.len() {
        return Err(CheckError::Args(format!(
            "the kernel takes {} arguments, got {}",
            params.len(),
            args.len()
        )));
    }
    for (p, a) in params.iter().zip(args) {
        let ok = match (&p.ty, a) {
            (Ty::Slice { elem, mutable: false }, Arg::In(b)) => b.elem() == *elem,
            (Ty::Slice { elem, .. }, Arg::Out(b)) => b.elem() == *elem,
            (Ty::Scalar(s), Arg::Val(v)) => v.scalar() == *s,
            _ => false,
        };
        if !ok {
            return Err(CheckError::Args(format!("argument `{}` must be {}", p.name, p.ty)));
        }
    }
    Ok(())
}

/// Runs `body` on the interpreter, then on GPU 0 when there is one (saying so when there is
/// not), and panics listing every failed check or error. `body` gets the target and a random
/// generator seeded from the clock, or from `DDTREE_CHECK_SEED` to repeat a run (the seed is
/// printed on failure).
pub fn on_each_target(mut body: impl FnMut(&Target<'_>, &mut StdRng) -> Result<Vec<CheckResult>, CheckError>) {
    let seed = match std::env::var("DDTREE_CHECK_SEED") {
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .unwrap_or_else(|e| panic!("DDTREE_CHECK_SEED={v:?} is not a u64 seed: {e}")),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
    };
    let mut run = |t: &Target<'_>| {
        let mut rng = StdRng::seed_from_u64(seed);
        let results = body(t, &mut rng).unwrap_or_else(|e| panic!("{} (seed {seed}): {e}", t.name()));
        assert_passed(t, seed, &results);
    };
    run(&Target::Interp);
    match Gpu::open(0) {
        Ok(gpu) => run(&Target::Gpu(&gpu)),
        Err(e @ (RuntimeError::NoDriver | RuntimeError::NoDevice { .. })) => eprintln!("GPU run skipped: {e}"),
        Err(e) => panic!("opening the GPU failed: {e}"),
    }
}

/// Panics listing the failed checks, if any.
pub fn assert_passed(t: &Target<'_>, seed: u64, results: &[CheckResult]) {
    assert!(!results.is_empty(), "no check ran");
    let failed: Vec<String> = results
        .iter()
        .filter(|r| !r.passed)
        .map(|r| format!("{} {}: {:?}", r.symbol, r.case, r.comparison))
        .collect();
    assert!(
        failed.is_empty(),
        "{} (seed {seed}): {} of {} checks failed:\n{}",
        t.name(),
        failed.len(),
        results.len(),
        failed.join("\n")
    );
}

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
    pub const BF16: Tolerance = Tolerance {
        rtol: 1e-2,
        atol: 1e-3,
        rel_l2: 1e-2,
    };
    /// Exact results (indices, copies).
    pub const EXACT: Tolerance = Tolerance {
        rtol: 0.0,
        atol: 0.0,
        rel_l2: 0.0,
    };

    /// bf16 outputs that are sums of many products (GEMMs, GEMVs, attention): [`Self::BF16`]'s
    /// relative parts, with the absolute part scaled to the reference's RMS (1e-2 of it), since
    /// a small output may be the cancellation of large terms.
    pub fn bf16_sums(want: &[f32]) -> Tolerance {
        let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len().max(1) as f32).sqrt();
        Tolerance {
            rtol: 1e-2,
            atol: 1e-2 * rms,
            rel_l2: 1e-2,
        }
    }
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

/// Compares `got` with `want`. A NaN in `got` (an unwritten, poisoned element) always fails;
/// equal values pass, infinities included.
pub fn compare(got: &[f32], want: &[f32], tol: Tolerance) -> Comparison {
    assert_eq!(got.len(), want.len(), "compare: length mismatch");
    let (mut num, mut den, mut max_abs, mut bad, mut first_bad) = (0f64, 0f64, 0f32, 0, None);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let d = if g == w { 0.0 } else { (g - w).abs() };
        let ok = g == w || (!g.is_nan() && d <= tol.atol + tol.rtol * w.abs());
        if !ok {
            bad += 1;
            first_bad.get_or_insert((i, g, w));
        }
        max_abs = if d.is_nan() { f32::INFINITY } else { max_abs.max(d) };
        num += (d as f64).powi(2);
        if w.is_finite() {
            den += (w as f64).powi(2);
        }
    }
    let rel_l2 = if den > 0.0 {
        (num / den).sqrt() as f32
    } else if num > 0.0 {
        f32::INFINITY
    } else {
        0.0
    };
    let rel_l2 = if rel_l2.is_nan() { f32::INFINITY } else { rel_l2 };
    Comparison {
        len: got.len(),
        max_abs,
        rel_l2,
        bad,
        first_bad,
    }
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

/// A bf16 output buffer poisoned with NaN.
pub fn poisoned_bf16<'g>(t: &Target<'g>, n: usize) -> Result<DevBuf<bf16>, CheckError> {
    t.upload(&vec![bf16::NAN; n])
}

/// Compares `got` with `want` for variant `p` of `K` and records the result.
pub fn result<K: Kernel>(p: &K::Params, case: String, got: &[f32], want: &[f32], tol: Tolerance) -> CheckResult {
    let comparison = compare(got, want, tol);
    CheckResult {
        kernel: K::NAME,
        symbol: K::symbol(p),
        passed: comparison.passed(tol),
        case,
        comparison,
    }
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
pub fn rms_norm(
    t: &Target<'_>,
    p: &RmsNormParams,
    rows: usize,
    n: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (x, xf) = random_bf16(rng, rows * n, -2.0, 2.0);
    let (w, wf) = random_bf16(rng, n, 0.5, 1.5);
    let (dx, dw) = (t.upload(&x)?, t.upload(&w)?);
    let mut out = poisoned_bf16(t, rows * n)?;
    let eps = 1e-6f32;
    let mut args = [
        Arg::In(&dx),
        Arg::In(&dw),
        Arg::Out(&mut out),
        Arg::from(n as u32),
        Arg::from(eps),
    ];
    // SAFETY: x and out hold rows * n elements, weight n; vec variants are only run with n % 8 == 0.
    unsafe { t.launch::<RmsNorm>(p, rows as u32, &mut args)? };
    let got = to_f32(&t.download(&out)?);
    Ok(result::<RmsNorm>(
        p,
        format!("rows={rows} n={n}"),
        &got,
        &rms_norm::reference(&xf, &wf, n, eps),
        Tolerance::BF16,
    ))
}

/// Checks SiLU-and-mul.
pub fn silu_mul(
    t: &Target<'_>,
    p: &SiluMulParams,
    rows: usize,
    d: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (x, xf) = random_bf16(rng, rows * 2 * d, -4.0, 4.0);
    let dx = t.upload(&x)?;
    let mut out = poisoned_bf16(t, rows * d)?;
    let grid = silu_mul::grid(p, rows, d);
    let mut args = [
        Arg::In(&dx),
        Arg::Out(&mut out),
        Arg::from(rows as u32),
        Arg::from(d as u32),
    ];
    // SAFETY: gate_up holds rows * 2d elements and out rows * d; vec variants need d % 8 == 0.
    unsafe { t.launch::<SiluMul>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&out)?);
    Ok(result::<SiluMul>(
        p,
        format!("rows={rows} d={d}"),
        &got,
        &silu_mul::reference(&xf, d),
        Tolerance::BF16,
    ))
}

/// Checks SiLU-and-mul of separate gate and up buffers over `n` elements, on `grid` blocks
/// (`None`: [`silu_mul::grid_split`]; fewer blocks make the threads stride).
pub fn silu_mul_split(
    t: &Target<'_>,
    p: &SiluMulParams,
    n: usize,
    grid: Option<u32>,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (g, gf) = random_bf16(rng, n, -8.0, 8.0);
    let (u, uf) = random_bf16(rng, n, -4.0, 4.0);
    let (dg, du) = (t.upload(&g)?, t.upload(&u)?);
    let mut out = poisoned_bf16(t, n)?;
    let grid = grid.unwrap_or_else(|| silu_mul::grid_split(p, n));
    let mut args = [Arg::In(&dg), Arg::In(&du), Arg::Out(&mut out), Arg::from(n as u32)];
    // SAFETY: gate, up and out hold n elements; vec variants need n % 8 == 0.
    unsafe { t.launch::<SiluMulSplit>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&out)?);
    Ok(result::<SiluMulSplit>(
        p,
        format!("n={n} grid={grid}"),
        &got,
        &silu_mul::reference_split(&gf, &uf),
        Tolerance::BF16,
    ))
}

/// Checks RoPE (in place, in the pair layout of `p`).
#[allow(clippy::too_many_arguments)]
pub fn rope(
    t: &Target<'_>,
    p: &RopeParams,
    tokens: usize,
    heads: usize,
    stride: usize,
    offset: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (dim, half, max_pos) = (p.dim as usize, p.dim as usize / 2, 4096usize);
    let (x, mut xf) = random_bf16(rng, tokens * heads * stride, -2.0, 2.0);
    let positions: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..max_pos as u32)).collect();
    let angles: Vec<f32> = (0..max_pos * half)
        .map(|i| (i / half) as f32 * 10000f32.powf(-2.0 * (i % half) as f32 / dim as f32))
        .collect();
    let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
    let mut dx = t.upload(&x)?;
    let (dp, dc, ds) = (t.upload(&positions)?, t.upload(&cos)?, t.upload(&sin)?);
    let rows = tokens * heads;
    let grid = rope::grid(p, rows);
    let mut args = [
        Arg::Out(&mut dx),
        Arg::In(&dp),
        Arg::In(&dc),
        Arg::In(&ds),
        Arg::from(rows as u32),
        Arg::from(heads as u32),
        Arg::from(stride as u32),
        Arg::from(offset as u32),
    ];
    // SAFETY: x holds rows * stride elements with offset + dim <= stride; tables hold max_pos * dim/2.
    unsafe { t.launch::<RopeInterleaved>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&dx)?);
    rope::reference(
        &mut xf,
        &positions,
        &cos,
        &sin,
        heads,
        stride,
        offset,
        dim,
        p.interleave,
    );
    let case = format!("tokens={tokens} heads={heads} stride={stride} offset={offset}");
    Ok(result::<RopeInterleaved>(p, case, &got, &xf, Tolerance::BF16))
}

/// Checks the embedding gather (some ids out of range on purpose).
pub fn embedding(
    t: &Target<'_>,
    p: &EmbeddingParams,
    tokens: usize,
    vocab: usize,
    hidden: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (tab, tf) = random_bf16(rng, vocab * hidden, -1.0, 1.0);
    let ids: Vec<u32> = (0..tokens)
        .map(|i| {
            if i % 7 == 3 {
                vocab as u32 + i as u32
            } else {
                rng.random_range(0..vocab as u32)
            }
        })
        .collect();
    let (dt, di) = (t.upload(&tab)?, t.upload(&ids)?);
    let mut out = poisoned_bf16(t, tokens * hidden)?;
    let mut args = [
        Arg::In(&di),
        Arg::In(&dt),
        Arg::Out(&mut out),
        Arg::from(hidden as u32),
        Arg::from(vocab as u32),
    ];
    // SAFETY: table holds vocab * hidden elements, out tokens * hidden; vec variants need hidden % 8 == 0.
    unsafe { t.launch::<Embedding>(p, tokens as u32, &mut args)? };
    let got = to_f32(&t.download(&out)?);
    let case = format!("tokens={tokens} vocab={vocab} hidden={hidden}");
    Ok(result::<Embedding>(
        p,
        case,
        &got,
        &embedding::reference(&ids, &tf, hidden),
        Tolerance::EXACT,
    ))
}

/// Checks the in-place add over `n` elements on `grid` blocks (`None`: [`add::grid`]; fewer
/// blocks make the threads stride). `y` is at least 0.5 in magnitude, so an element the kernel
/// skips keeps a value that fails the comparison; 8 guard elements after `n` (1.0 in both
/// buffers) must stay 1.0. The reference is the f32 sum rounded to bf16 (nearest even), exact.
pub fn add_assign(
    t: &Target<'_>,
    p: &AddParams,
    n: usize,
    grid: Option<u32>,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    const GUARD: usize = 8;
    let (mut x, mut xf) = random_bf16(rng, n, -2.0, 2.0);
    let (mut y, mut yf) = random_bf16(rng, n, 0.5, 2.0);
    for (h, f) in y.iter_mut().zip(yf.iter_mut()) {
        if rng.random_bool(0.5) {
            *h = -*h;
            *f = -*f;
        }
    }
    x.extend([bf16::ONE; GUARD]);
    y.extend([bf16::ONE; GUARD]);
    xf.extend([1.0; GUARD]);
    let mut dx = t.upload(&x)?;
    let dy = t.upload(&y)?;
    let grid = grid.unwrap_or_else(|| add::grid(p, n as u32));
    let mut args = [Arg::Out(&mut dx), Arg::In(&dy), Arg::from(n as u32)];
    // SAFETY: x and y hold n + 8 elements; vec variants need n % 8 == 0.
    unsafe { t.launch::<AddAssign>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&dx)?);
    let mut want: Vec<f32> = add::reference(&xf[..n], &yf)
        .into_iter()
        .map(|v| bf16::from_f32(v).to_f32())
        .collect();
    want.extend(&xf[n..]);
    Ok(result::<AddAssign>(
        p,
        format!("n={n} grid={grid}"),
        &got,
        &want,
        Tolerance::EXACT,
    ))
}

/// One [`copy_rows`] case: `rows` rows of `cols` columns gathered from a `src_rows` x
/// `src_stride` source at column `src_off` into a `rows` x `dst_stride` destination at column
/// `dst_off`.
#[derive(Clone, Copy, Debug)]
pub struct CopyCase {
    /// Rows copied (the grid).
    pub rows: usize,
    /// Columns per row.
    pub cols: usize,
    /// Rows of the source.
    pub src_rows: usize,
    /// Source row stride.
    pub src_stride: usize,
    /// Source column offset.
    pub src_off: usize,
    /// Destination row stride.
    pub dst_stride: usize,
    /// Destination column offset.
    pub dst_off: usize,
}

/// Checks a row copy kernel `K` (bf16 [`CopyRows`] or f32 [`CopyRowsF32`]) on `src` / `dst`
/// data: random row indices (repeats included), the copied region of `dst` poisoned with NaN
/// and the rest left random (it must come back unchanged); exact.
fn copy_rows_check<T: Elem + Copy, K: Kernel<Params = CopyParams>>(
    t: &Target<'_>,
    p: &CopyParams,
    c: CopyCase,
    (src, mut dst): (Vec<T>, Vec<T>),
    nan: T,
    to_f32: fn(&[T]) -> Vec<f32>,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let mut want = dst.clone();
    // One spare index: the idx buffer is never empty.
    let idx: Vec<u32> = (0..c.rows + 1)
        .map(|_| rng.random_range(0..c.src_rows as u32))
        .collect();
    copy_rows::reference(
        &src,
        &idx[..c.rows],
        &mut want,
        c.cols,
        c.src_stride,
        c.src_off,
        c.dst_stride,
        c.dst_off,
    );
    let nans = vec![nan; c.cols];
    copy_rows::reference(&nans, &vec![0; c.rows], &mut dst, c.cols, 0, 0, c.dst_stride, c.dst_off);
    let (ds, di) = (t.upload(&src)?, t.upload(&idx)?);
    let mut dd = t.upload(&dst)?;
    let mut args = [
        Arg::In(&ds),
        Arg::In(&di),
        Arg::Out(&mut dd),
        Arg::from(c.rows as u32),
        Arg::from(c.cols as u32),
        Arg::from(c.src_stride as u32),
        Arg::from(c.src_off as u32),
        Arg::from(c.dst_stride as u32),
        Arg::from(c.dst_off as u32),
    ];
    // SAFETY: indices are below src_rows; src_off + cols <= src_stride and dst_off + cols <=
    // dst_stride (the suite's cases); dst holds rows * dst_stride elements.
    unsafe { t.launch::<K>(p, copy_rows::grid(c.rows as u32), &mut args)? };
    let got = to_f32(&t.download(&dd)?);
    let case = format!(
        "rows={} cols={} src={}x{}+{} dst_stride={} dst_off={}",
        c.rows, c.cols, c.src_rows, c.src_stride, c.src_off, c.dst_stride, c.dst_off
    );
    Ok(result::<K>(p, case, &got, &to_f32(&want), Tolerance::EXACT))
}

/// Checks [`CopyRows`] on random bf16 data ([`copy_rows_check`]).
pub fn copy_rows(t: &Target<'_>, p: &CopyParams, c: CopyCase, rng: &mut StdRng) -> Result<CheckResult, CheckError> {
    let (src, _) = random_bf16(rng, c.src_rows * c.src_stride, -4.0, 4.0);
    let (dst, _) = random_bf16(rng, c.rows * c.dst_stride, -4.0, 4.0);
    copy_rows_check::<bf16, CopyRows>(t, p, c, (src, dst), bf16::NAN, to_f32, rng)
}

/// Checks row top-k (rows seeded with repeated values to exercise the tie rule).
pub fn topk(
    t: &Target<'_>,
    p: &TopkParams,
    rows: usize,
    n: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let mut logits: Vec<f32> = (0..rows * n).map(|_| rng.random_range(-20.0f32..20.0)).collect();
    for r in 0..rows {
        // A few exact ties at the top, at random places.
        let top = 25.0 + r as f32;
        for _ in 0..3 {
            logits[r * n + rng.random_range(0..n)] = top;
        }
    }
    topk_rows(t, p, &logits, n, format!("rows={rows} n={n}"))
}

/// Rows of `n` logits made of ties, row `r` by `r % 4`: (0) every value `±0.0` (all equal);
/// (1) the maximum at every third column from a random start, random smaller values between,
/// a few NaN; (2) every value `-inf` but a few NaN; (3) the maximum in the last `min(n, 40)`
/// columns and at a few random places. NaN never lands in column 0 (the engine's CPU argmax
/// returns 0 for a row starting with NaN, see [`topk::reference`]).
pub fn tie_rows(rows: usize, n: usize, rng: &mut StdRng) -> Vec<f32> {
    let mut logits = vec![0f32; rows * n];
    for (r, row) in logits.chunks_mut(n).enumerate() {
        let top = 3.0 + r as f32;
        match r % 4 {
            0 => row
                .iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = if i % 2 == 1 { -0.0 } else { 0.0 }),
            1 => {
                let start = rng.random_range(0..3);
                for (i, v) in row.iter_mut().enumerate() {
                    *v = if i % 3 == start {
                        top
                    } else {
                        rng.random_range(-20.0..top - 0.5)
                    };
                }
            }
            2 => row.fill(f32::NEG_INFINITY),
            _ => {
                for v in row.iter_mut() {
                    *v = rng.random_range(-20.0..top - 0.5);
                }
                let tail = n.min(40);
                row[n - tail..].fill(top);
                for _ in 0..8 {
                    row[rng.random_range(0..n)] = top;
                }
            }
        }
        if r % 4 != 0 && n > 1 {
            for _ in 0..3.min(n / 8) {
                row[rng.random_range(1..n)] = f32::NAN;
            }
        }
    }
    logits
}

/// Checks row top-k on [`tie_rows`]: equal values must come back lowest column first.
pub fn topk_ties(
    t: &Target<'_>,
    p: &TopkParams,
    rows: usize,
    n: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let logits = tie_rows(rows, n, rng);
    topk_rows(t, p, &logits, n, format!("ties rows={rows} n={n}"))
}

/// Row top-k of `logits` (`[rows, n]`) against [`topk::reference`], values and indices exact.
fn topk_rows(
    t: &Target<'_>,
    p: &TopkParams,
    logits: &[f32],
    n: usize,
    case: String,
) -> Result<CheckResult, CheckError> {
    let kk = p.k as usize;
    let rows = logits.len() / n;
    let dl = t.upload(logits)?;
    let mut vals = t.upload(&vec![f32::NAN; rows * kk])?;
    let mut idx = t.upload(&vec![u32::MAX; rows * kk])?;
    let mut args = [
        Arg::In(&dl),
        Arg::Out(&mut vals),
        Arg::Out(&mut idx),
        Arg::from(n as u32),
    ];
    // SAFETY: logits hold rows * n values with n >= k; outputs hold rows * k.
    unsafe { t.launch::<RowTopk>(p, rows as u32, &mut args)? };
    let (gv, gi) = (t.download(&vals)?, t.download(&idx)?);
    let want = topk::reference(logits, n, kk);
    // Compare values and indices as one exact vector.
    let got: Vec<f32> = gv.iter().zip(&gi).flat_map(|(v, i)| [*v, *i as f32]).collect();
    let want: Vec<f32> = want.iter().flat_map(|(v, i)| [*v, *i as f32]).collect();
    Ok(result::<RowTopk>(p, case, &got, &want, Tolerance::EXACT))
}

/// Checks the split row top-k (part pass `part`, then the merge variant for the same `k`) on
/// fresh rows with exact ties at the top (in one slice and across slices) and a NaN in every
/// row; candidates and outputs are poisoned before the launches.
pub fn topk_split(
    t: &Target<'_>,
    part: &TopkSplitParams,
    rows: usize,
    n: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let kk = part.k as usize;
    let mut logits: Vec<f32> = (0..rows * n).map(|_| rng.random_range(-20.0f32..20.0)).collect();
    for r in 0..rows {
        let row = &mut logits[r * n..(r + 1) * n];
        let top = 25.0 + r as f32;
        // Exact ties: two neighbours (one slice, usually two threads), one a block further
        // on (the same thread's next item), then more at random places.
        let at = rng.random_range(0..n - 1);
        row[at] = top;
        row[at + 1] = top;
        row[(at + part.block as usize).min(n - 1)] = top;
        for _ in 0..kk.max(3) {
            row[rng.random_range(0..n)] = top;
        }
        row[rng.random_range(0..n)] = f32::NAN;
    }
    topk_split_rows(t, part, &logits, n, "")
}

/// Checks the split row top-k (as [`topk_split`]) on [`tie_rows`]: equal values must come back
/// lowest column first, within a slice and across slices.
pub fn topk_split_ties(
    t: &Target<'_>,
    part: &TopkSplitParams,
    rows: usize,
    n: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let logits = tie_rows(rows, n, rng);
    topk_split_rows(t, part, &logits, n, "ties ")
}

/// The split row top-k (part pass `part`, then the merge variant for its `k`) of `logits`
/// (`[rows, n]`) against [`topk::reference`], exact; candidates and outputs poisoned.
fn topk_split_rows(
    t: &Target<'_>,
    part: &TopkSplitParams,
    logits: &[f32],
    n: usize,
    label: &str,
) -> Result<CheckResult, CheckError> {
    let merge = TopkSplitParams::merge(part.k)
        .ok_or_else(|| CheckError::Args(format!("no merge variant for k = {}", part.k)))?;
    let kk = part.k as usize;
    let parts = part.parts(n);
    let rows = logits.len() / n;
    let dl = t.upload(logits)?;
    let mut cv = t.upload(&vec![f32::NAN; rows * parts * kk])?;
    let mut ci = t.upload(&vec![u32::MAX - 1; rows * parts * kk])?;
    let mut vals = t.upload(&vec![f32::NAN; rows * kk])?;
    let mut idx = t.upload(&vec![u32::MAX - 1; rows * kk])?;
    {
        let mut args = [
            Arg::In(&dl),
            Arg::In(&idx),
            Arg::Out(&mut cv),
            Arg::Out(&mut ci),
            Arg::from(n as u32),
        ];
        // SAFETY: logits hold rows * n values; the candidates rows * parts * k; ids is unused.
        unsafe { t.launch::<RowTopkSplit>(part, (parts as u32, rows as u32), &mut args)? };
    }
    let mut args = [
        Arg::In(&cv),
        Arg::In(&ci),
        Arg::Out(&mut vals),
        Arg::Out(&mut idx),
        Arg::from((parts * kk) as u32),
    ];
    // SAFETY: the candidates hold rows * parts * k entries; the outputs rows * k.
    unsafe { t.launch::<RowTopkSplit>(&merge, (1u32, rows as u32), &mut args)? };
    let (gv, gi) = (t.download(&vals)?, t.download(&idx)?);
    let want = topk::reference(logits, n, kk);
    let got: Vec<f32> = gv.iter().zip(&gi).flat_map(|(v, i)| [*v, *i as f32]).collect();
    let want: Vec<f32> = want.iter().flat_map(|(v, i)| [*v, *i as f32]).collect();
    let mut r = result::<RowTopkSplit>(
        part,
        format!("{label}rows={rows} n={n} parts={parts}"),
        &got,
        &want,
        Tolerance::EXACT,
    );
    r.symbol = format!("{} + {}", r.symbol, RowTopkSplit::symbol(&merge));
    Ok(r)
}

/// Checks the tile GEMM.
pub fn gemm(
    t: &Target<'_>,
    p: &GemmParams,
    m: usize,
    n: usize,
    kd: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (a, af) = random_bf16(rng, m * kd, -1.0, 1.0);
    let (b, bf) = random_bf16(rng, n * kd, -1.0, 1.0);
    let (da, db) = (t.upload(&a)?, t.upload(&b)?);
    let mut c = poisoned_bf16(t, m * n)?;
    let grid = gemm_bf16::grid(p, m, n);
    let mut args = [
        Arg::In(&da),
        Arg::In(&db),
        Arg::Out(&mut c),
        Arg::from(m as u32),
        Arg::from(n as u32),
        Arg::from(kd as u32),
    ];
    // SAFETY: a is m x k, b is n x k, c is m x n, k % 8 == 0 (callers pick such k).
    unsafe { t.launch::<GemmBf16>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&c)?);
    let want = gemm_bf16::reference(&af, &bf, m, n, kd);
    // Sums of k products: scale the absolute tolerance with the typical output size.
    let tol = Tolerance::bf16_sums(&want);
    Ok(result::<GemmBf16>(p, format!("m={m} n={n} k={kd}"), &got, &want, tol))
}

/// Every candidate of [`RmsNorm`] at the sizes of `sizes`.
pub fn rms_norm_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in RmsNorm::space() {
        let mut ns = vec![(1, 64), (3, 136), (5, 1000)];
        if sizes == Sizes::Full {
            ns.extend([(7, 7168), (64, 1536), (33, 512)]);
        }
        for (rows, n) in ns {
            if p.vec && n % 8 != 0 {
                continue;
            }
            out.push(rms_norm(t, &p, rows, n, rng)?);
        }
    }
    Ok(out)
}

/// Every candidate of [`SiluMul`] at the sizes of `sizes`.
pub fn silu_mul_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in SiluMul::space() {
        let mut ds = vec![(1, 64), (3, 200), (7, 37)];
        if sizes == Sizes::Full {
            ds.extend([(16, 2048), (9, 18432)]);
        }
        for (rows, d) in ds {
            if p.vec && d % 8 != 0 {
                continue;
            }
            out.push(silu_mul(t, &p, rows, d, rng)?);
        }
    }
    Ok(out)
}

/// Every candidate of [`SiluMulSplit`] at the sizes of `sizes` (one case on 2 blocks, so
/// threads stride).
pub fn silu_mul_split_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in SiluMulSplit::space() {
        let mut cases = vec![(8, None), (600, None), (37, None), (5000, Some(2))];
        if sizes == Sizes::Full {
            cases.extend([(16 * 2048, None), (9 * 18432, None), ((1 << 22) + 8, None)]);
        }
        for (n, grid) in cases {
            if p.vec && n % 8 != 0 {
                continue;
            }
            out.push(silu_mul_split(t, &p, n, grid, rng)?);
        }
    }
    Ok(out)
}

/// Every candidate of [`RopeInterleaved`] at the sizes of `sizes`.
pub fn rope_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in RopeInterleaved::space() {
        let dim = p.dim as usize;
        // (tokens, heads, stride, offset): q rows [tokens, heads, 128 + dim] with rope last, and
        // k_pe rows [tokens, 1, 512 + dim].
        let mut cases = vec![(1, 1, dim, 0), (3, 4, 128 + dim, 128), (5, 1, 512 + dim, 512)];
        if sizes == Sizes::Full {
            cases.extend([(17, 64, 128 + dim, 128), (64, 1, 512 + dim, 512)]);
        }
        for (tk, h, st, off) in cases {
            out.push(rope(t, &p, tk, h, st, off, rng)?);
        }
    }
    Ok(out)
}

/// Every candidate of [`Embedding`] at the sizes of `sizes`.
pub fn embedding_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in Embedding::space() {
        let mut cases = vec![(1, 50, 64), (9, 300, 72), (5, 40, 100)];
        if sizes == Sizes::Full {
            cases.push((33, 163840, 7168));
        }
        for (tk, v, h) in cases {
            if p.vec && h % 8 != 0 {
                continue;
            }
            out.push(embedding(t, &p, tk, v, h, rng)?);
        }
    }
    Ok(out)
}

/// Every candidate of [`AddAssign`] at the sizes of `sizes` (one case on 2 blocks, so threads
/// stride; the full sizes pass the grid cap).
pub fn add_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in AddAssign::space() {
        let mut cases = vec![(8, None), (1000, None), (37, None), (5000, Some(2))];
        if sizes == Sizes::Full {
            cases.extend([(7168, None), (33 * 7168, None), ((1 << 22) + 8, None)]);
        }
        for (n, grid) in cases {
            if p.vec && n % 8 != 0 {
                continue;
            }
            out.push(add_assign(t, &p, n, grid, rng)?);
        }
    }
    Ok(out)
}

/// Every candidate of [`CopyRows`] at the sizes of `sizes`: a row gather, a column block into a
/// wider row, strided head copies (ragged offsets), rows wider than a block, and no rows.
pub fn copy_rows_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in CopyRows::space() {
        for c in copy_cases(sizes) {
            out.push(copy_rows(t, &p, c, rng)?);
        }
    }
    Ok(out)
}

/// The cases of [`copy_rows_suite`] and [`copy_rows_f32_suite`].
fn copy_cases(sizes: Sizes) -> Vec<CopyCase> {
    let case = |rows, cols, src_rows, src_stride, src_off, dst_stride, dst_off| CopyCase {
        rows,
        cols,
        src_rows,
        src_stride,
        src_off,
        dst_stride,
        dst_off,
    };
    let mut cases = vec![
        case(5, 72, 9, 72, 0, 72, 0),
        case(3, 100, 3, 100, 0, 164, 64),
        case(7, 16, 7, 576, 512, 24, 3),
        case(2, 1100, 4, 1103, 3, 1100, 0),
        case(0, 8, 1, 8, 0, 8, 0),
    ];
    if sizes == Sizes::Full {
        cases.extend([
            case(64, 7168, 1024, 7168, 0, 7168, 0),
            case(17 * 64, 64, 17 * 64, 192, 128, 576, 512),
        ]);
    }
    cases
}

/// Every candidate of [`RowTopk`] at the sizes of `sizes`.
pub fn topk_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in RowTopk::space() {
        let mut cases = vec![(1, 100), (3, 1000), (2, 4099)];
        if sizes == Sizes::Full {
            cases.extend([(4, 163840), (17, 163840)]);
        }
        for (rows, n) in cases {
            if n < p.k as usize {
                continue;
            }
            out.push(topk(t, &p, rows, n, rng)?);
        }
        // Rows of ties (every pattern of `tie_rows` at least once).
        let mut ties = vec![(4, 97), (4, 1000)];
        if sizes == Sizes::Full {
            ties.push((8, 163840));
        }
        for (rows, n) in ties {
            if n >= p.k as usize + 3 {
                out.push(topk_ties(t, &p, rows, n, rng)?);
            }
        }
    }
    Ok(out)
}

/// Every part variant of [`RowTopkSplit`], each with the merge variant of its `k`, at the sizes
/// of `sizes` (ragged last slices, slices shorter than `k`, the decode rows of a 163840 vocabulary).
pub fn topk_split_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in RowTopkSplit::space().into_iter().filter(|p| !p.merge) {
        let span = p.span();
        let mut cases = vec![(1, 100), (3, span + 1), (2, 2 * span + p.k as usize / 2 + 1)];
        if sizes == Sizes::Full {
            cases.extend([(1, 163840), (4, 163840), (16, 163840), (31, 163840), (5, 100_003)]);
        }
        for (rows, n) in cases {
            if n < p.k as usize {
                continue;
            }
            out.push(topk_split(t, &p, rows, n, rng)?);
        }
        // Rows of ties, within one slice and across several (ragged last slice).
        let mut ties = vec![(4, 97), (4, 2 * span + 5)];
        if sizes == Sizes::Full {
            ties.push((8, 163840));
        }
        for (rows, n) in ties {
            if n >= p.k as usize + 3 {
                out.push(topk_split_ties(t, &p, rows, n, rng)?);
            }
        }
    }
    Ok(out)
}

/// Every candidate of [`GemmBf16`] at the sizes of `sizes`.
pub fn gemm_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in GemmBf16::space() {
        let mut cases = vec![(1, 8, 16), (37, 50, 72), (128, 128, 64), (130, 200, 264)];
        if sizes == Sizes::Full {
            cases.extend([(256, 7168, 2048), (16, 4096, 7168), (513, 1000, 1032)]);
        }
        for (m, n, k) in cases {
            out.push(gemm(t, &p, m, n, k, rng)?);
        }
    }
    Ok(out)
}

/// One [`moe_route`] problem: tokens, experts, top-k, groups, kept groups, normalization,
/// scale, and whether the bias is all negative (kept experts then lose to dropped ones, whose
/// choices are 0.0).
#[derive(Clone, Copy, Debug)]
pub struct RouteCase {
    /// Tokens (blocks).
    pub tokens: usize,
    /// Routed experts.
    pub experts: usize,
    /// Experts chosen per token.
    pub topk: usize,
    /// Expert groups (1 = no group stage).
    pub n_group: usize,
    /// Groups kept.
    pub topk_group: usize,
    /// Normalize the weights to sum 1 before the scale.
    pub norm: bool,
    /// Routed scaling factor.
    pub scale: f32,
    /// Every bias negative.
    pub negative_bias: bool,
}

/// Checks MoE routing. Logits lie on a grid of 1/16 in `[-4, 4]` and the bias takes the values
/// -2, 0 and 2 (all -2 with `negative_bias`), so equal choices are exact ties (the lower index
/// must win) and unequal ones differ by far more than a last-ulp difference of `exp` between
/// the GPU and the CPU. Ids must match exactly, weights to 1e-5.
pub fn moe_route(
    t: &Target<'_>,
    p: &MoeRouteParams,
    c: RouteCase,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let logits: Vec<f32> = (0..c.tokens * c.experts)
        .map(|_| rng.random_range(-64i32..=64) as f32 / 16.0)
        .collect();
    let bias: Vec<f32> = (0..c.experts)
        .map(|_| {
            if c.negative_bias {
                -2.0
            } else {
                2.0 * rng.random_range(-1i32..=1) as f32
            }
        })
        .collect();
    let (dl, db) = (t.upload(&logits)?, t.upload(&bias)?);
    let mut ids = t.upload(&vec![u32::MAX; c.tokens * c.topk])?;
    let mut weights = t.upload(&vec![f32::NAN; c.tokens * c.topk])?;
    let mut args = [
        Arg::In(&dl),
        Arg::In(&db),
        Arg::Out(&mut ids),
        Arg::Out(&mut weights),
        Arg::from(c.experts as u32),
        Arg::from(c.topk as u32),
        Arg::from(c.n_group as u32),
        Arg::from(c.topk_group as u32),
        Arg::from(c.norm as u32),
        Arg::from(c.scale),
    ];
    // SAFETY: logits hold tokens * experts values, bias experts, the outputs tokens * topk;
    // experts <= 1024, topk <= 16, and the group sizes divide the experts.
    unsafe { t.launch::<MoeRoute>(p, c.tokens as u32, &mut args)? };
    let (gi, gw) = (t.download(&ids)?, t.download(&weights)?);
    let (wi, ww) = moe_route::reference(
        &logits,
        &bias,
        c.experts,
        c.topk,
        c.n_group,
        c.topk_group,
        c.norm,
        c.scale,
    );
    // Ids as f32 (exact below 2^24; a wrong id is off by at least 1, beyond the tolerance).
    let got: Vec<f32> = gi.iter().map(|&i| i as f32).chain(gw).collect();
    let want: Vec<f32> = wi.iter().map(|&i| i as f32).chain(ww).collect();
    let tol = Tolerance {
        rtol: 1e-5,
        atol: 1e-6,
        rel_l2: 1e-5,
    };
    let case = format!(
        "tokens={} experts={} topk={} groups={}/{} norm={} scale={}{}",
        c.tokens,
        c.experts,
        c.topk,
        c.topk_group,
        c.n_group,
        c.norm,
        c.scale,
        if c.negative_bias { " negative bias" } else { "" }
    );
    Ok(result::<MoeRoute>(p, case, &got, &want, tol))
}

/// Every candidate of [`MoeRoute`] at the sizes of `sizes`.
pub fn moe_route_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let case = |tokens, experts, topk, n_group, topk_group, norm, scale, negative_bias| RouteCase {
        tokens,
        experts,
        topk,
        n_group,
        topk_group,
        norm,
        scale,
        negative_bias,
    };
    // The bench slice (48), Kimi (384, no groups), DeepSeek-V3-like groups, groups of one and
    // two experts, all-negative bias (dropped groups win), 1000 experts, top-16.
    let mut cases = vec![
        case(3, 48, 6, 1, 1, true, 2.5, false),
        case(2, 384, 8, 1, 1, true, 2.827, false),
        case(4, 64, 8, 8, 4, true, 2.5, false),
        case(3, 96, 8, 4, 2, false, 1.0, true),
        case(2, 40, 4, 20, 5, true, 1.0, false),
        case(2, 8, 2, 8, 3, false, 1.5, false),
        case(2, 1000, 16, 8, 3, true, 1.5, false),
    ];
    if sizes == Sizes::Full {
        cases.extend([
            case(64, 384, 8, 1, 1, true, 2.827, false),
            case(256, 256, 8, 8, 4, true, 2.5, false),
            case(33, 1024, 16, 32, 8, true, 1.0, false),
            case(17, 160, 6, 8, 3, false, 16.0, true),
        ]);
    }
    let mut out = Vec::new();
    for p in MoeRoute::space() {
        for &c in &cases {
            out.push(moe_route(t, &p, c, rng)?);
        }
    }
    Ok(out)
}

/// Checks the three random fills at `n` elements on `grid` blocks (`None`: [`fill::grid`]),
/// outputs poisoned, bit-exact against [`fill::reference_bf16`] / [`fill::reference_f32`] /
/// [`fill::reference_u32`] (a word is compared as its two 16-bit halves, exact in f32).
pub fn fills(
    t: &Target<'_>,
    p: &FillParams,
    n: usize,
    grid: Option<u32>,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    let seed: u32 = rng.random();
    let (lo, hi) = (-3.0f32, 5.0f32);
    let grid = grid.unwrap_or_else(|| fill::grid(p, n));
    let case = format!("n={n} grid={grid} seed={seed}");
    let mut b = poisoned_bf16(t, n)?;
    let mut args = [
        Arg::Out(&mut b),
        Arg::from(n as u32),
        Arg::from(seed),
        Arg::from(lo),
        Arg::from(hi),
    ];
    // SAFETY: out holds n elements.
    unsafe { t.launch::<FillRandomBf16>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&b)?);
    let want = to_f32(&fill::reference_bf16(n, seed, lo, hi));
    let mut out = vec![result::<FillRandomBf16>(p, case.clone(), &got, &want, Tolerance::EXACT)];

    let mut f = t.upload(&vec![f32::NAN; n])?;
    let mut args = [
        Arg::Out(&mut f),
        Arg::from(n as u32),
        Arg::from(seed),
        Arg::from(lo),
        Arg::from(hi),
    ];
    // SAFETY: out holds n elements.
    unsafe { t.launch::<FillRandomF32>(p, grid, &mut args)? };
    let got = t.download(&f)?;
    let want = fill::reference_f32(n, seed, lo, hi);
    out.push(result::<FillRandomF32>(p, case.clone(), &got, &want, Tolerance::EXACT));

    // Poison: a word the hash gives for no element near (u32::MAX is as good as any).
    let mut w = t.upload(&vec![u32::MAX; n])?;
    let mut args = [Arg::Out(&mut w), Arg::from(n as u32), Arg::from(seed)];
    // SAFETY: out holds n elements.
    unsafe { t.launch::<FillRandomU32>(p, grid, &mut args)? };
    let halves = |v: &[u32]| -> Vec<f32> { v.iter().flat_map(|x| [(x >> 16) as f32, (x & 0xffff) as f32]).collect() };
    let got = halves(&t.download(&w)?);
    let want = halves(&fill::reference_u32(n, seed));
    out.push(result::<FillRandomU32>(p, case, &got, &want, Tolerance::EXACT));
    Ok(out)
}

/// Every candidate of the fill kernels at the sizes of `sizes` (one case on 2 blocks, so
/// threads stride; the full sizes pass the grid cap).
pub fn fill_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut cases = vec![(1, None), (1000, None), (4099, Some(2))];
    if sizes == Sizes::Full {
        cases.extend([(1 << 20, None), ((1 << 24) + 3, None)]);
    }
    let mut out = Vec::new();
    for p in FillRandomU32::space() {
        for &(n, grid) in &cases {
            out.extend(fills(t, &p, n, grid, rng)?);
        }
    }
    Ok(out)
}

/// Random f32 values uniform in `[lo, hi)` (not rounded to bf16: they exercise the f32 paths).
pub fn random_f32(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// Checks the fused residual add + RMSNorm on `rows` rows of `n`: `x` random f32 (not
/// bf16-representable), `out` poisoned. The new `x` must equal the f32 sum exactly (with two
/// addends, of `x` and the bf16-rounded sum of `y` and `z`; without addends the input, bit for
/// bit). An addend the variant must not read is a single NaN. `out` is compared with the
/// reference rounded to bf16, within one bf16 step (a rounding that flips with the summation
/// order).
pub fn add_rms_norm(
    t: &Target<'_>,
    p: &AddRmsNormParams,
    rows: usize,
    n: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    let eps = 1e-6f32;
    let x = random_f32(rng, rows * n, -3.0, 3.0);
    let mut addend = |used: bool| {
        if used {
            random_bf16(rng, rows * n, -2.0, 2.0)
        } else {
            (vec![bf16::NAN], vec![])
        }
    };
    let (y, yf) = addend(p.addends > 0);
    let (z, zf) = addend(p.addends == 2);
    let (w, wf) = random_bf16(rng, n, 0.5, 1.5);
    let added: Option<Vec<f32>> = match p.addends {
        0 => None,
        1 => Some(yf),
        _ => Some(
            add::reference(&yf, &zf)
                .into_iter()
                .map(|v| bf16::from_f32(v).to_f32())
                .collect(),
        ),
    };
    let (want_x, want) = residual::reference(&x, added.as_deref(), &wf, n, eps);
    let want: Vec<f32> = want.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    let mut dx = t.upload(&x)?;
    let (dy, dz, dw) = (t.upload(&y)?, t.upload(&z)?, t.upload(&w)?);
    let mut dout = poisoned_bf16(t, rows * n)?;
    let mut args = [
        Arg::Out(&mut dx),
        Arg::In(&dy),
        Arg::In(&dz),
        Arg::In(&dw),
        Arg::Out(&mut dout),
        Arg::from(n as u32),
        Arg::from(eps),
    ];
    // SAFETY: x, out and the addends the variant reads hold rows * n elements, weight n.
    unsafe { t.launch::<AddRmsNorm>(p, rows as u32, &mut args)? };
    let got_x = t.download(&dx)?;
    let got = to_f32(&t.download(&dout)?);
    let case = format!("rows={rows} n={n}");
    let tol = Tolerance {
        rtol: 1.0 / 128.0,
        atol: 1e-6,
        rel_l2: 1e-3,
    };
    // Bit patterns as two exact halves, so the unchanged `x` is compared bit for bit.
    let halves = |v: &[f32]| -> Vec<f32> {
        v.iter()
            .flat_map(|x| [(x.to_bits() >> 16) as f32, (x.to_bits() & 0xffff) as f32])
            .collect()
    };
    Ok(vec![
        result::<AddRmsNorm>(
            p,
            format!("{case} x"),
            &halves(&got_x),
            &halves(&want_x),
            Tolerance::EXACT,
        ),
        result::<AddRmsNorm>(p, format!("{case} out"), &got, &want, tol),
    ])
}

/// Every candidate of [`AddRmsNorm`] at the sizes of `sizes` (rows shorter than a block, rows
/// not a multiple of 8, rows wider than the largest block).
pub fn add_rms_norm_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in AddRmsNorm::space() {
        let mut ns = vec![(1, 64), (2, 7), (3, 136), (4, 1000), (2, 1500), (1, 2056)];
        if sizes == Sizes::Full {
            ns.extend([(1, 7168), (7, 7168), (64, 7168), (33, 512), (3, 7171), (1, 1536)]);
        }
        for (rows, n) in ns {
            if p.hold > 0 && n % 8 != 0 {
                continue;
            }
            out.extend(add_rms_norm(t, &p, rows, n, rng)?);
        }
    }
    Ok(out)
}

/// Elements after `n` in the cast outputs, holding a value the kernel must leave alone.
const CAST_GUARD: usize = 8;

/// Checks the bf16 -> f32 cast over `n` elements on `grid` blocks (`None`: [`residual::grid`]):
/// output poisoned, 8 guard elements after `n` must stay 7.0; exact (infinities included).
pub fn cast_bf16_f32(
    t: &Target<'_>,
    p: &CastParams,
    n: usize,
    grid: Option<u32>,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (mut src, _) = random_bf16(rng, n, -100.0, 100.0);
    for (i, v) in [
        bf16::INFINITY,
        bf16::NEG_INFINITY,
        bf16::NEG_ZERO,
        bf16::MAX,
        bf16::MIN_POSITIVE_SUBNORMAL,
    ]
    .into_iter()
    .enumerate()
    {
        if i * 7 < n {
            src[i * 7] = v;
        }
    }
    let mut dst = vec![f32::NAN; n];
    dst.extend([7.0; CAST_GUARD]);
    let mut want = to_f32(&src);
    want.extend([7.0; CAST_GUARD]);
    let ds = t.upload(&src)?;
    let mut dd = t.upload(&dst)?;
    let grid = grid.unwrap_or_else(|| residual::grid(p, n));
    let mut args = [Arg::In(&ds), Arg::Out(&mut dd), Arg::from(n as u32)];
    // SAFETY: src holds n elements, dst n + 8.
    unsafe { t.launch::<CastBf16F32>(p, grid, &mut args)? };
    let got = t.download(&dd)?;
    Ok(result::<CastBf16F32>(
        p,
        format!("n={n} grid={grid}"),
        &got,
        &want,
        Tolerance::EXACT,
    ))
}

/// Checks the f32 -> bf16 cast over `n` elements on `grid` blocks (`None`: [`residual::grid`]):
/// random f32 plus exact ties (both parities), infinities, signed zero, subnormals and values
/// that round up to infinity; output poisoned, 8 guard elements after `n` must stay 7.0;
/// bit-exact against round to nearest even.
pub fn cast_f32_bf16(
    t: &Target<'_>,
    p: &CastParams,
    n: usize,
    grid: Option<u32>,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let mut src = random_f32(rng, n, -100.0, 100.0);
    let specials = [
        f32::from_bits(0x3f80_8000), // tie, even below: rounds down
        f32::from_bits(0x3f81_8000), // tie, odd below: rounds up
        f32::from_bits(0xbf81_8000),
        f32::from_bits(0x3f80_8001), // just above a tie
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        f32::MAX, // rounds to infinity
        f32::from_bits(0x0000_8000),
        f32::from_bits(0x0001_7fff),
    ];
    for (i, v) in specials.into_iter().enumerate() {
        if i * 3 < n {
            src[i * 3] = v;
        }
    }
    let mut dst = vec![bf16::NAN; n];
    dst.extend([bf16::from_f32(7.0); CAST_GUARD]);
    let ds = t.upload(&src)?;
    let mut dd = t.upload(&dst)?;
    let grid = grid.unwrap_or_else(|| residual::grid(p, n));
    let mut args = [Arg::In(&ds), Arg::Out(&mut dd), Arg::from(n as u32)];
    // SAFETY: src holds n elements, dst n + 8.
    unsafe { t.launch::<CastF32Bf16>(p, grid, &mut args)? };
    // Bit patterns, exact in f32; a NaN (an unwritten element) stays NaN and fails.
    let bits = |v: &[bf16]| -> Vec<f32> {
        v.iter()
            .map(|x| if x.is_nan() { f32::NAN } else { x.to_bits() as f32 })
            .collect()
    };
    let got = bits(&t.download(&dd)?);
    let mut want: Vec<bf16> = src.iter().map(|&v| bf16::from_f32(v)).collect();
    want.extend([bf16::from_f32(7.0); CAST_GUARD]);
    Ok(result::<CastF32Bf16>(
        p,
        format!("n={n} grid={grid}"),
        &got,
        &bits(&want),
        Tolerance::EXACT,
    ))
}

/// Cast cases: `(n, grid)`; one on 2 blocks so threads stride, the full sizes pass the grid cap.
fn cast_cases(sizes: Sizes) -> Vec<(usize, Option<u32>)> {
    let mut cases = vec![(1, None), (37, None), (1000, None), (5001, Some(2))];
    if sizes == Sizes::Full {
        cases.extend([(7168, None), (33 * 7168, None), ((1 << 22) + 3, None)]);
    }
    cases
}

/// Every candidate of [`CastBf16F32`] at the sizes of `sizes`.
pub fn cast_bf16_f32_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in CastBf16F32::space() {
        for (n, grid) in cast_cases(sizes) {
            out.push(cast_bf16_f32(t, &p, n, grid, rng)?);
        }
    }
    Ok(out)
}

/// Every candidate of [`CastF32Bf16`] at the sizes of `sizes`.
pub fn cast_f32_bf16_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in CastF32Bf16::space() {
        for (n, grid) in cast_cases(sizes) {
            out.push(cast_f32_bf16(t, &p, n, grid, rng)?);
        }
    }
    Ok(out)
}

/// Checks [`CopyRowsF32`] on random f32 data (not bf16-representable): bit-exact.
pub fn copy_rows_f32(t: &Target<'_>, p: &CopyParams, c: CopyCase, rng: &mut StdRng) -> Result<CheckResult, CheckError> {
    let src = random_f32(rng, c.src_rows * c.src_stride, -4.0, 4.0);
    let dst = random_f32(rng, c.rows * c.dst_stride, -4.0, 4.0);
    copy_rows_check::<f32, CopyRowsF32>(t, p, c, (src, dst), f32::NAN, <[f32]>::to_vec, rng)
}

/// Every candidate of [`CopyRowsF32`] at the cases of [`copy_rows_suite`].
pub fn copy_rows_f32_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in CopyRowsF32::space() {
        for c in copy_cases(sizes) {
            out.push(copy_rows_f32(t, &p, c, rng)?);
        }
    }
    Ok(out)
}

/// Checks both GEMVs ([`GemvBf16`], [`GemvBf16F32`]) for variant `p` on `rows` rows of `a`
/// (`[rows, k]`, in `[-1, 1)`) against `w` (`[n, k]`, in `[-1, 1)`), outputs poisoned with NaN,
/// against [`gemv::reference`] (f64 sums). The bf16 output gets the bf16 tolerance (scaled by
/// the output's RMS for the absolute part, as sums of `k` products cancel); the f32 output a
/// tolerance far below one bf16 rounding, so an output rounded to bf16 fails.
pub fn gemv_pair(
    t: &Target<'_>,
    p: &GemvParams,
    rows: usize,
    n: usize,
    kd: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    gemv_outputs::<GemvBf16, GemvBf16F32>(t, p, gemv::grid(p, n as u32), rows, n, kd, rng)
}

/// [`gemv_pair`] for any pair of GEMV kernels of the same arguments: `B` with bf16 output, `F`
/// with f32 output, both launched on `grid`.
fn gemv_outputs<B: Kernel, F: Kernel<Params = B::Params>>(
    t: &Target<'_>,
    p: &B::Params,
    grid: u32,
    rows: usize,
    n: usize,
    kd: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    let (a, af) = random_bf16(rng, rows * kd, -1.0, 1.0);
    let (w, wf) = random_bf16(rng, n * kd, -1.0, 1.0);
    let (da, dw) = (t.upload(&a)?, t.upload(&w)?);
    let want = gemv::reference(&af, &wf, rows, n, kd);
    let case = format!("rows={rows} n={n} k={kd}");

    let mut ob = poisoned_bf16(t, rows * n)?;
    let mut args = [
        Arg::In(&da),
        Arg::In(&dw),
        Arg::Out(&mut ob),
        Arg::from(rows as u32),
        Arg::from(n as u32),
        Arg::from(kd as u32),
    ];
    // SAFETY: a is rows x k, w is n x k, out rows x n; k % 8 == 0 and 1 <= rows <= p.m (the
    // suites' cases).
    unsafe { t.launch::<B>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&ob)?);
    let tol = Tolerance::bf16_sums(&want);
    let mut out = vec![result::<B>(p, case.clone(), &got, &want, tol)];

    let mut of = t.upload(&vec![f32::NAN; rows * n])?;
    let mut args = [
        Arg::In(&da),
        Arg::In(&dw),
        Arg::Out(&mut of),
        Arg::from(rows as u32),
        Arg::from(n as u32),
        Arg::from(kd as u32),
    ];
    // SAFETY: as above.
    unsafe { t.launch::<F>(p, grid, &mut args)? };
    let got = t.download(&of)?;
    // f32 output: only the summation order differs from the reference.
    let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len().max(1) as f32).sqrt();
    let tol = Tolerance {
        rtol: 1e-4,
        atol: 1e-4 * rms,
        rel_l2: 1e-5,
    };
    out.push(result::<F>(p, case, &got, &want, tol));
    Ok(out)
}

/// Every row count `1..=m` over the `small` cases (the largest on each), and with
/// [`Sizes::Full`] rows 1 and `m` on the `full` cases: the GEMV suites' sweep.
fn gemv_sweep(
    sizes: Sizes,
    m: usize,
    small: &[(usize, usize)],
    full: &[(usize, usize)],
    mut check: impl FnMut(usize, usize, usize) -> Result<Vec<CheckResult>, CheckError>,
) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for (i, &(n, k)) in small.iter().enumerate() {
        for rows in 1..=m {
            if rows == m || rows % small.len() == i {
                out.extend(check(rows, n, k)?);
            }
        }
    }
    if sizes == Sizes::Full {
        for &(n, k) in full {
            for rows in [1, m] {
                out.extend(check(rows, n, k)?);
                if m == 1 {
                    break;
                }
            }
        }
    }
    Ok(out)
}

/// Every candidate of [`GemvBf16`] and [`GemvBf16F32`] at the sizes of `sizes`: every row count
/// `1..=m` over small cases with ragged `n` (not multiples of a block's columns) and `k` from 8
/// up; the full sizes add the Kimi K2.6 decode shapes at 1 and `m` rows (the LM head, 163840 x
/// 7168, only once, at 1 row on the default candidate: its inputs are 2.3 GB).
pub fn gemv_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let small = [(1, 8), (37, 24), (70, 136), (5, 520), (19, 1032)];
    let full = [
        (1536, 7168),
        (576, 7168),
        (2048, 7168),
        (48, 7168),
        (1031, 7168),
        (12288, 1536),
        (7168, 8192),
        (7168, 2048),
        (163840, 1024),
        (3, 8),
        (101, 24),
    ];
    let mut out = Vec::new();
    for p in GemvBf16::space() {
        out.extend(gemv_sweep(sizes, p.m as usize, &small, &full, |rows, n, k| {
            gemv_pair(t, &p, rows, n, k, rng)
        })?);
        if sizes == Sizes::Full && p == GemvBf16::space()[0] {
            out.extend(gemv_pair(t, &p, 1, 163840, 7168, rng)?);
        }
    }
    Ok(out)
}

/// Checks [`GemvRmsNormBf16`] for variant `p` on `rows` rows of `a` (`[rows, k]`, in `[-2, 2)`)
/// with a norm weight in `[0.5, 1.5)` and `w` (`[n, k]`, in `[-1, 1)`), the output poisoned with
/// NaN, against [`gemv::reference`] of the rows normalized by [`crate::rms_norm::reference`] and
/// rounded to bf16 (as the unfused `RmsNorm` stores them), with the bf16 GEMV's tolerance.
pub fn gemv_rms_norm(
    t: &Target<'_>,
    p: &GemvParams,
    rows: usize,
    n: usize,
    kd: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    let eps = 1e-6f32;
    let (a, af) = random_bf16(rng, rows * kd, -2.0, 2.0);
    let (g, gf) = random_bf16(rng, kd, 0.5, 1.5);
    let (w, wf) = random_bf16(rng, n * kd, -1.0, 1.0);
    let (da, dg, dw) = (t.upload(&a)?, t.upload(&g)?, t.upload(&w)?);
    let normed: Vec<f32> = crate::rms_norm::reference(&af, &gf, kd, eps)
        .iter()
        .map(|&v| bf16::from_f32(v).to_f32())
        .collect();
    let want = gemv::reference(&normed, &wf, rows, n, kd);
    let mut out = poisoned_bf16(t, rows * n)?;
    let mut args = [
        Arg::In(&da),
        Arg::In(&dg),
        Arg::from(eps),
        Arg::In(&dw),
        Arg::Out(&mut out),
        Arg::from(rows as u32),
        Arg::from(n as u32),
        Arg::from(kd as u32),
    ];
    // SAFETY: a is rows x k, norm k, w n x k, out rows x n; k % 8 == 0, k <= NORM_MAX_K and
    // 1 <= rows <= p.m (the suite's cases).
    unsafe { t.launch::<GemvRmsNormBf16>(p, gemv::grid(p, n as u32), &mut args)? };
    let got = to_f32(&t.download(&out)?);
    let tol = Tolerance::bf16_sums(&want);
    Ok(vec![result::<GemvRmsNormBf16>(
        p,
        format!("rows={rows} n={n} k={kd}"),
        &got,
        &want,
        tol,
    )])
}

/// Every candidate of [`GemvRmsNormBf16`], swept as [`gemv_suite`] sweeps (every row count
/// `1..=m` on small ragged cases, `k` up to [`gemv::NORM_MAX_K`]); the full sizes add the MLA
/// query up-projection of Kimi K2.6 (12288 x 1536).
pub fn gemv_rms_norm_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let small = [(1, 8), (37, 24), (70, 136), (5, 520), (19, 2048)];
    let full = [(12288, 1536), (1031, 1536), (101, 24)];
    let mut out = Vec::new();
    for p in GemvRmsNormBf16::space() {
        out.extend(gemv_sweep(sizes, p.m as usize, &small, &full, |rows, n, k| {
            gemv_rms_norm(t, &p, rows, n, k, rng)
        })?);
    }
    Ok(out)
}

/// Checks the split-K GEMVs [`GemvSplitBf16`] and [`GemvSplitF32`] as [`gemv_pair`] does.
pub fn gemv_split_pair(
    t: &Target<'_>,
    p: &GemvSplitParams,
    rows: usize,
    n: usize,
    kd: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    gemv_outputs::<GemvSplitBf16, GemvSplitF32>(t, p, gemv::split_grid(p, n as u32), rows, n, kd, rng)
}

/// Every candidate of [`GemvSplitBf16`] and [`GemvSplitF32`]: every row count `1..=m` over
/// small cases with ragged `n` and `k` (shorter and longer than one pass of the block); the full
/// sizes add the router (48 and 384 columns of 7168) and the small-`n` projections.
pub fn gemv_split_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let small = [(1, 8), (3, 24), (5, 1032), (2, 4104)];
    let full = [
        (48, 7168),
        (384, 7168),
        (576, 7168),
        (1536, 7168),
        (7, 7176),
        (1031, 1536),
    ];
    let mut out = Vec::new();
    for p in GemvSplitBf16::space() {
        out.extend(gemv_sweep(sizes, p.m as usize, &small, &full, |rows, n, k| {
            gemv_split_pair(t, &p, rows, n, k, rng)
        })?);
    }
    Ok(out)
}

/// Checks a fused gate/up GEMV `K` ([`GemvGateUpSilu`] or [`GemvSplitGateUpSilu`]) for variant
/// `p` on `grid` blocks: `rows` rows of `a` (`[rows, k]`) against `gate` and `up` (`[n, k]`),
/// all in `[-1, 1)`, the output poisoned with NaN, against [`gemv::reference_gate_up_silu`]
/// (f64 sums). The tolerance is the bf16 GEMV's, its absolute part scaled by the output's RMS:
/// a gate or up sum whose bf16 rounding flips with the summation order moves an output by
/// about one bf16 step.
#[allow(clippy::too_many_arguments)]
fn gate_up_output<K: Kernel>(
    t: &Target<'_>,
    p: &K::Params,
    grid: u32,
    rows: usize,
    n: usize,
    kd: usize,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    let (a, af) = random_bf16(rng, rows * kd, -1.0, 1.0);
    let (g, gf) = random_bf16(rng, n * kd, -1.0, 1.0);
    let (u, uf) = random_bf16(rng, n * kd, -1.0, 1.0);
    let (da, dg, du) = (t.upload(&a)?, t.upload(&g)?, t.upload(&u)?);
    let want = gemv::reference_gate_up_silu(&af, &gf, &uf, rows, n, kd);
    let mut out = poisoned_bf16(t, rows * n)?;
    let mut args = [
        Arg::In(&da),
        Arg::In(&dg),
        Arg::In(&du),
        Arg::Out(&mut out),
        Arg::from(rows as u32),
        Arg::from(n as u32),
        Arg::from(kd as u32),
    ];
    // SAFETY: a is rows x k, gate and up n x k, out rows x n; k % 8 == 0 and 1 <= rows <= p.m
    // (the suites' cases).
    unsafe { t.launch::<K>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&out)?);
    let tol = Tolerance::bf16_sums(&want);
    Ok(vec![result::<K>(
        p,
        format!("rows={rows} n={n} k={kd}"),
        &got,
        &want,
        tol,
    )])
}

/// Every candidate of [`GemvGateUpSilu`] at the sizes of `sizes`, swept as [`gemv_suite`] sweeps
/// (every row count `1..=m` on small ragged cases); the full sizes add the dense MLP of Kimi K2.6
/// (18432 x 7168) and the shared expert's shape (2048 x 7168).
pub fn gemv_gate_up_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let small = [(1, 8), (37, 24), (70, 136), (5, 520), (19, 1032)];
    let full = [(18432, 7168), (2048, 7168), (1031, 7168), (101, 24)];
    let mut out = Vec::new();
    for p in GemvGateUpSilu::space() {
        out.extend(gemv_sweep(sizes, p.m as usize, &small, &full, |rows, n, k| {
            gate_up_output::<GemvGateUpSilu>(t, &p, gemv::grid(&p, n as u32), rows, n, k, rng)
        })?);
    }
    Ok(out)
}

/// Every candidate of [`GemvSplitGateUpSilu`], swept as [`gemv_split_suite`] sweeps; the full
/// sizes add the shared expert of Kimi K2.6 (2048 x 7168).
pub fn gemv_split_gate_up_suite(
    t: &Target<'_>,
    sizes: Sizes,
    rng: &mut StdRng,
) -> Result<Vec<CheckResult>, CheckError> {
    let small = [(1, 8), (3, 24), (5, 1032), (2, 4104)];
    let full = [(2048, 7168), (576, 7168), (7, 7176), (1031, 1536)];
    let mut out = Vec::new();
    for p in GemvSplitGateUpSilu::space() {
        out.extend(gemv_sweep(sizes, p.m as usize, &small, &full, |rows, n, k| {
            gate_up_output::<GemvSplitGateUpSilu>(t, &p, gemv::split_grid(&p, n as u32), rows, n, k, rng)
        })?);
    }
    Ok(out)
}

/// A kernel's checks: every candidate at the sizes given.
pub type Suite = fn(&Target<'_>, Sizes, &mut StdRng) -> Result<Vec<CheckResult>, CheckError>;

/// Every kernel's suite, in catalogue order.
pub const SUITES: &[Suite] = &[
    rms_norm_suite,
    silu_mul_suite,
    silu_mul_split_suite,
    rope_suite,
    embedding_suite,
    add_suite,
    copy_rows_suite,
    topk_suite,
    topk_split_suite,
    gemm_suite,
    fill_suite,
    crate::w4a16::check::suite,
    crate::w4a16::check::gemv_suite,
    crate::attention::check::kv_append_suite,
    crate::attention::check::mla_attention_suite,
    crate::attention::check::gqa_attention_suite,
    crate::tree::check::verify_suite,
    moe_route_suite,
    add_rms_norm_suite,
    cast_bf16_f32_suite,
    cast_f32_bf16_suite,
    copy_rows_f32_suite,
    gemv_suite,
    gemv_split_suite,
    gemv_gate_up_suite,
    gemv_split_gate_up_suite,
    gemv_rms_norm_suite,
    crate::attention::check::mla_absorb_query_suite,
    crate::attention::check::mla_absorb_output_suite,
];

/// Runs every candidate of every kernel at the sizes of `sizes` and returns the results.
/// Variants that cannot take a size (vector paths need multiples of 8) skip it.
pub fn run_all(t: &Target<'_>, sizes: Sizes, seed: u64) -> Result<Vec<CheckResult>, CheckError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    for suite in SUITES {
        out.extend(suite(t, sizes, &mut rng)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_infinities_pass_and_nan_never_does() {
        let inf = f32::INFINITY;
        let c = compare(&[-inf, 1.0, inf], &[-inf, 1.0, inf], Tolerance::EXACT);
        assert!(c.passed(Tolerance::EXACT), "{c:?}");
        assert_eq!(c.rel_l2, 0.0);
        for got in [[inf, 1.0], [f32::NAN, 1.0], [-inf, 1.5]] {
            let c = compare(&got, &[-inf, 1.0], Tolerance::BF16);
            assert!(!c.passed(Tolerance::BF16), "{got:?} passed: {c:?}");
        }
        assert!(!compare(&[f32::NAN], &[f32::NAN], Tolerance::BF16).passed(Tolerance::BF16));
        assert!(!compare(&[-inf], &[2.0], Tolerance::BF16).passed(Tolerance::BF16));
    }
}
