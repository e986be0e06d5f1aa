//! Host ops of the bf16 GEMVs: [`GemvOp`] (`out = a w^T`, bf16 or f32 out, one warp per column
//! or split-K), [`GateUpSiluOp`] (gate and up projections with their SiLU-and-mul) and
//! [`GemvRmsNormOp`] (RMSNorm fused in front of the GEMV).
//!
//! Every GEMV needs `1 <= rows <= p.m`, `k % 8 == 0` and `n * k < 2^32`, checked here; the
//! 128-bit loads also need 16-byte aligned buffers, which whole allocations are.

use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use ddtree_runtime::{CompiledKernel, RuntimeError};
use half::bf16;

use super::{
    grid, split_grid, GemvBf16, GemvBf16F32, GemvGateUpSilu, GemvRmsNormBf16, GemvSplitBf16, GemvSplitF32,
    GemvSplitGateUpSilu, NORM_MAX_K,
};
use crate::op::{holds, require, size32};

/// The checks every GEMV shares: `rows` in `1..=m`, `k % 8 == 0`, `n * k < 2^32`, `a`
/// `[rows, k]` and `out` `[rows, n]`. Returns `(rows, n, k)` as the kernel's `u32`s.
fn shape<T>(
    name: &str,
    m: u32,
    a: &impl DevicePtr<bf16>,
    out: &impl DevicePtrMut<T>,
    (rows, n, k): (usize, usize, usize),
) -> Result<(u32, u32, u32), RuntimeError> {
    require(name, rows >= 1 && rows <= m as usize, || {
        format!("{rows} rows, the variant takes 1..={m}")
    })?;
    require(name, k % 8 == 0, || format!("k = {k} is not a multiple of 8"))?;
    require(name, (n as u64) * (k as u64) < 1 << 32, || {
        format!("n * k = {n} * {k} reaches 2^32")
    })?;
    holds(name, "a", a, rows * k)?;
    holds(name, "out", out, rows * n)?;
    Ok((
        size32(name, "rows", rows)?,
        size32(name, "n", n)?,
        size32(name, "k", k)?,
    ))
}

/// `out[r, j] = sum_i a[r, i] * w[j, i]` for `a` `[rows, k]` and an `nn.Linear` weight `w`
/// `[n, k]`, f32 accumulation; the output is bf16 or f32 by the kernel launched.
pub struct GemvOp<'a, A, W, O> {
    /// Activations, `[rows, k]`.
    pub a: &'a A,
    /// Weight, `[n, k]`.
    pub w: &'a W,
    /// Output, `[rows, n]`.
    pub out: &'a mut O,
    /// Rows of `a`.
    pub rows: usize,
    /// Outputs per row.
    pub n: usize,
    /// Reduction length.
    pub k: usize,
}

impl<A: DevicePtr<bf16>, W: DevicePtr<bf16>, O> GemvOp<'_, A, W, O> {
    fn weight(&self, name: &str) -> Result<(), RuntimeError> {
        holds(name, "w", self.w, self.n * self.k)
    }
}

impl<A: DevicePtr<bf16>, W: DevicePtr<bf16>, O: DevicePtrMut<bf16>> GemvOp<'_, A, W, O> {
    /// One warp per column(s), bf16 out ([`GemvBf16`], grid [`grid`]).
    pub fn launch_bf16(self, kern: &CompiledKernel<GemvBf16>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let p = kern.params();
        let (r, n, k) = shape(GemvBf16::NAME, p.m, self.a, &*self.out, (self.rows, self.n, self.k))?;
        self.weight(GemvBf16::NAME)?;
        // SAFETY: shapes, sizes and the row limit checked above.
        unsafe { GemvBf16::launch(kern, stream, grid(p, n), self.a, self.w, self.out, r, n, k) }
    }

    /// Split-K, bf16 out ([`GemvSplitBf16`], grid [`split_grid`]).
    pub fn launch_split_bf16(
        self,
        kern: &CompiledKernel<GemvSplitBf16>,
        stream: &Arc<CudaStream>,
    ) -> Result<(), RuntimeError> {
        let p = kern.params();
        let (r, n, k) = shape(
            GemvSplitBf16::NAME,
            p.m,
            self.a,
            &*self.out,
            (self.rows, self.n, self.k),
        )?;
        self.weight(GemvSplitBf16::NAME)?;
        // SAFETY: shapes, sizes and the row limit checked above.
        unsafe { GemvSplitBf16::launch(kern, stream, split_grid(p, n), self.a, self.w, self.out, r, n, k) }
    }
}

impl<A: DevicePtr<bf16>, W: DevicePtr<bf16>, O: DevicePtrMut<f32>> GemvOp<'_, A, W, O> {
    /// One warp per column(s), f32 out ([`GemvBf16F32`], grid [`grid`]).
    pub fn launch_f32(self, kern: &CompiledKernel<GemvBf16F32>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let p = kern.params();
        let (r, n, k) = shape(GemvBf16F32::NAME, p.m, self.a, &*self.out, (self.rows, self.n, self.k))?;
        self.weight(GemvBf16F32::NAME)?;
        // SAFETY: shapes, sizes and the row limit checked above.
        unsafe { GemvBf16F32::launch(kern, stream, grid(p, n), self.a, self.w, self.out, r, n, k) }
    }

    /// Split-K, f32 out ([`GemvSplitF32`], grid [`split_grid`]).
    pub fn launch_split_f32(
        self,
        kern: &CompiledKernel<GemvSplitF32>,
        stream: &Arc<CudaStream>,
    ) -> Result<(), RuntimeError> {
        let p = kern.params();
        let (r, n, k) = shape(GemvSplitF32::NAME, p.m, self.a, &*self.out, (self.rows, self.n, self.k))?;
        self.weight(GemvSplitF32::NAME)?;
        // SAFETY: shapes, sizes and the row limit checked above.
        unsafe { GemvSplitF32::launch(kern, stream, split_grid(p, n), self.a, self.w, self.out, r, n, k) }
    }
}

/// `out[r, j] = silu(a[r] . gate[j]) * (a[r] . up[j])` for two `[n, k]` weights in one pass.
pub struct GateUpSiluOp<'a, A, W, O> {
    /// Activations, `[rows, k]`.
    pub a: &'a A,
    /// Gate weight, `[n, k]`.
    pub gate: &'a W,
    /// Up weight, `[n, k]`.
    pub up: &'a W,
    /// Output, `[rows, n]`.
    pub out: &'a mut O,
    /// Rows of `a`.
    pub rows: usize,
    /// Outputs per row.
    pub n: usize,
    /// Reduction length.
    pub k: usize,
}

impl<A: DevicePtr<bf16>, W: DevicePtr<bf16>, O: DevicePtrMut<bf16>> GateUpSiluOp<'_, A, W, O> {
    fn weights(&self, name: &str) -> Result<(), RuntimeError> {
        holds(name, "gate", self.gate, self.n * self.k)?;
        holds(name, "up", self.up, self.n * self.k)
    }

    /// One warp per column(s) ([`GemvGateUpSilu`], grid [`grid`]).
    pub fn launch_warp(
        self,
        kern: &CompiledKernel<GemvGateUpSilu>,
        stream: &Arc<CudaStream>,
    ) -> Result<(), RuntimeError> {
        let p = kern.params();
        let (r, n, k) = shape(
            GemvGateUpSilu::NAME,
            p.m,
            self.a,
            &*self.out,
            (self.rows, self.n, self.k),
        )?;
        self.weights(GemvGateUpSilu::NAME)?;
        // SAFETY: shapes, sizes and the row limit checked above.
        unsafe { GemvGateUpSilu::launch(kern, stream, grid(p, n), self.a, self.gate, self.up, self.out, r, n, k) }
    }

    /// Split-K ([`GemvSplitGateUpSilu`], grid [`split_grid`]).
    pub fn launch_split(
        self,
        kern: &CompiledKernel<GemvSplitGateUpSilu>,
        stream: &Arc<CudaStream>,
    ) -> Result<(), RuntimeError> {
        let p = kern.params();
        let (r, n, k) = shape(
            GemvSplitGateUpSilu::NAME,
            p.m,
            self.a,
            &*self.out,
            (self.rows, self.n, self.k),
        )?;
        self.weights(GemvSplitGateUpSilu::NAME)?;
        let g = split_grid(p, n);
        // SAFETY: shapes, sizes and the row limit checked above.
        unsafe { GemvSplitGateUpSilu::launch(kern, stream, g, self.a, self.gate, self.up, self.out, r, n, k) }
    }
}

/// RMSNorm of the rows of `a` (scale `norm`, `eps`) fused in front of `out = norm(a) w^T`
/// ([`GemvRmsNormBf16`], grid [`grid`]); needs `k <= NORM_MAX_K` besides the GEMV's limits.
pub struct GemvRmsNormOp<'a, A, N, W, O> {
    /// Activations before the norm, `[rows, k]`.
    pub a: &'a A,
    /// Norm scale, `[k]`.
    pub norm: &'a N,
    /// Added to the mean square.
    pub eps: f32,
    /// Weight, `[n, k]`.
    pub w: &'a W,
    /// Output, `[rows, n]`.
    pub out: &'a mut O,
    /// Rows of `a`.
    pub rows: usize,
    /// Outputs per row.
    pub n: usize,
    /// Reduction length (the normalized width).
    pub k: usize,
}

impl<A: DevicePtr<bf16>, N: DevicePtr<bf16>, W: DevicePtr<bf16>, O: DevicePtrMut<bf16>> GemvRmsNormOp<'_, A, N, W, O> {
    /// Checks the shapes and launches `kern` on `stream`.
    pub fn launch(self, kern: &CompiledKernel<GemvRmsNormBf16>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = GemvRmsNormBf16::NAME;
        let p = kern.params();
        let (r, n, k) = shape(name, p.m, self.a, &*self.out, (self.rows, self.n, self.k))?;
        require(name, k <= NORM_MAX_K, || {
            format!("k = {k} is longer than NORM_MAX_K = {NORM_MAX_K}")
        })?;
        holds(name, "norm", self.norm, self.k)?;
        holds(name, "w", self.w, self.n * self.k)?;
        // SAFETY: shapes, sizes, the row limit and k <= NORM_MAX_K checked above.
        unsafe {
            GemvRmsNormBf16::launch(
                kern,
                stream,
                grid(p, n),
                self.a,
                self.norm,
                self.eps,
                self.w,
                self.out,
                r,
                n,
                k,
            )
        }
    }
}
