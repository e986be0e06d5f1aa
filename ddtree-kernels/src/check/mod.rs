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
//!
//! This module holds the harness; each kernel family's checks live in its folder's `check.rs`
//! (`norm/check.rs`, `gemv_bf16/check.rs`, ...) and are re-exported here.

use std::marker::PhantomData;

use ddtree_codegen::interp::{Buffer, Element, HostArg, InterpError, LoadError, Program, Value};
use ddtree_codegen::{CodegenError, Kernel, Scalar, Ty};
use ddtree_runtime::cudarc::driver::{CudaSlice, DeviceRepr};
use ddtree_runtime::{Gpu, Grid, Launcher, RuntimeError};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

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

pub(crate) fn to_f32(v: &[bf16]) -> Vec<f32> {
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

/// Random f32 values uniform in `[lo, hi)` (not rounded to bf16: they exercise the f32 paths).
pub fn random_f32(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

// Each family's checks live in its folder; they are re-exported here so every check is
// reachable as `check::<name>`, as the tests and `kernel-check` call them.
pub use crate::elementwise::check::*;
pub use crate::embedding::check::*;
pub use crate::gemm_bf16::check::*;
pub use crate::gemv_bf16::check::*;
pub use crate::moe_route::check::*;
pub use crate::norm::check::*;
pub use crate::topk::check::*;
pub use crate::vocab::check::*;

/// A kernel's checks: every candidate at the sizes given.
pub type Suite = fn(&Target<'_>, Sizes, &mut StdRng) -> Result<Vec<CheckResult>, CheckError>;

/// Runs every candidate of every kernel at the sizes of `sizes` and returns the results.
/// Variants that cannot take a size (vector paths need multiples of 8) skip it.
pub fn run_all(t: &Target<'_>, sizes: Sizes, seed: u64) -> Result<Vec<CheckResult>, CheckError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    for entry in crate::registry::ENTRIES {
        out.extend(entry.run(t, sizes, &mut rng)?);
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
