//! Host ops of the norm family: [`RmsNormOp`], [`AddRmsNormOp`] and the residual-stream casts
//! [`CastBf16F32Op`] / [`CastF32Bf16Op`].

use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use ddtree_runtime::{CompiledKernel, RuntimeError};
use half::bf16;

use super::residual::{self, AddRmsNorm, CastBf16F32, CastF32Bf16};
use super::rms_norm::RmsNorm;
use crate::op::{holds, require, size32};

/// RMSNorm of `rows` rows of `n` bf16 values ([`RmsNorm`], one block per row).
pub struct RmsNormOp<'a, X, W, O> {
    /// Input, `[rows, n]`.
    pub x: &'a X,
    /// Scale, `[n]`.
    pub weight: &'a W,
    /// Output, `[rows, n]`.
    pub out: &'a mut O,
    /// Rows.
    pub rows: usize,
    /// Row length.
    pub n: usize,
    /// Added to the mean square.
    pub eps: f32,
}

impl<X: DevicePtr<bf16>, W: DevicePtr<bf16>, O: DevicePtrMut<bf16>> RmsNormOp<'_, X, W, O> {
    /// Checks the sizes against the buffers and the variant (`vec` needs `n % 8 == 0`) and
    /// launches `k` on `stream`.
    pub fn launch(self, k: &CompiledKernel<RmsNorm>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = RmsNorm::NAME;
        let (rows, n) = (self.rows, self.n);
        holds(name, "x", self.x, rows * n)?;
        holds(name, "weight", self.weight, n)?;
        holds(name, "out", self.out, rows * n)?;
        require(name, !k.params().vec || n % 8 == 0, || {
            format!("{:?} needs n % 8 == 0, n = {n}", k.params())
        })?;
        let (rows, n) = (size32(name, "rows", rows)?, size32(name, "n", n)?);
        // SAFETY: x and out hold rows * n values, weight n, and the variant takes n (checked above).
        unsafe { RmsNorm::launch(k, stream, rows, self.x, self.weight, self.out, n, self.eps) }
    }
}

/// The residual add fused with the following RMSNorm ([`AddRmsNorm`]) on `rows` rows of `n`:
/// `x += y` (or `x += bf16(y + z)` with `z`), then `out = rmsnorm(x) * weight`.
pub struct AddRmsNormOp<'a, X, Y, W, O> {
    /// The f32 residual stream, `[rows, n]`, updated in place.
    pub x: &'a mut X,
    /// First addend, `[rows, n]`.
    pub y: &'a Y,
    /// Second addend, `[rows, n]`; needed exactly when the variant adds two.
    pub z: Option<&'a Y>,
    /// Scale, `[n]`.
    pub weight: &'a W,
    /// Normalized output, `[rows, n]`.
    pub out: &'a mut O,
    /// Rows.
    pub rows: usize,
    /// Row length.
    pub n: usize,
    /// Added to the mean square.
    pub eps: f32,
}

impl<X: DevicePtrMut<f32>, Y: DevicePtr<bf16>, W: DevicePtr<bf16>, O: DevicePtrMut<bf16>> AddRmsNormOp<'_, X, Y, W, O> {
    /// Checks the sizes, that `z` is given exactly for a two-addend variant and that a holding
    /// variant gets `n % 8 == 0`, and launches `k` on `stream`.
    pub fn launch(self, k: &CompiledKernel<AddRmsNorm>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = AddRmsNorm::NAME;
        let (rows, n, p) = (self.rows, self.n, *k.params());
        holds(name, "x", &*self.x, rows * n)?;
        holds(name, "weight", self.weight, n)?;
        holds(name, "out", &*self.out, rows * n)?;
        if p.addends >= 1 {
            holds(name, "y", self.y, rows * n)?;
        }
        require(name, (p.addends == 2) == self.z.is_some(), || {
            format!("{p:?} adds {} addend(s); z given: {}", p.addends, self.z.is_some())
        })?;
        if let Some(z) = self.z {
            holds(name, "z", z, rows * n)?;
        }
        require(name, p.hold == 0 || n % 8 == 0, || {
            format!("{p:?} needs n % 8 == 0, n = {n}")
        })?;
        let (rows, n) = (size32(name, "rows", rows)?, size32(name, "n", n)?);
        // With fewer than two addends `z` is not read: any buffer will do.
        let z = self.z.unwrap_or(self.y);
        // SAFETY: every buffer the variant reads or writes holds rows * n values (weight n),
        // checked above.
        unsafe { AddRmsNorm::launch(k, stream, rows, self.x, self.y, z, self.weight, self.out, n, self.eps) }
    }
}

/// bf16 -> f32 over `n` elements ([`CastBf16F32`], grid [`residual::grid`]).
pub struct CastBf16F32Op<'a, S, D> {
    /// Input, `[n]`.
    pub src: &'a S,
    /// Output, `[n]`.
    pub dst: &'a mut D,
    /// Elements.
    pub n: usize,
}

impl<S: DevicePtr<bf16>, D: DevicePtrMut<f32>> CastBf16F32Op<'_, S, D> {
    /// Checks the sizes and launches `k` on `stream`.
    pub fn launch(self, k: &CompiledKernel<CastBf16F32>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = CastBf16F32::NAME;
        holds(name, "src", self.src, self.n)?;
        holds(name, "dst", &*self.dst, self.n)?;
        let n = size32(name, "n", self.n)?;
        // SAFETY: both hold n values (checked above).
        unsafe { CastBf16F32::launch(k, stream, residual::grid(k.params(), self.n), self.src, self.dst, n) }
    }
}

/// f32 -> bf16 over `n` elements, rounded to nearest even ([`CastF32Bf16`], grid
/// [`residual::grid`]).
pub struct CastF32Bf16Op<'a, S, D> {
    /// Input, `[n]`.
    pub src: &'a S,
    /// Output, `[n]`.
    pub dst: &'a mut D,
    /// Elements.
    pub n: usize,
}

impl<S: DevicePtr<f32>, D: DevicePtrMut<bf16>> CastF32Bf16Op<'_, S, D> {
    /// Checks the sizes and launches `k` on `stream`.
    pub fn launch(self, k: &CompiledKernel<CastF32Bf16>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = CastF32Bf16::NAME;
        holds(name, "src", self.src, self.n)?;
        holds(name, "dst", &*self.dst, self.n)?;
        let n = size32(name, "n", self.n)?;
        // SAFETY: both hold n values (checked above).
        unsafe { CastF32Bf16::launch(k, stream, residual::grid(k.params(), self.n), self.src, self.dst, n) }
    }
}
