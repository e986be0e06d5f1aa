//! Host op of the bf16 tile GEMM: [`GemmBf16Op`].

use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use ddtree_runtime::{CompiledKernel, RuntimeError};
use half::bf16;

use super::{grid, GemmBf16};
use crate::op::{holds, require, size32};

/// `c = a b^T` for `a` `[m, k]`, `b` `[n, k]`, `c` `[m, n]`, all row-major bf16 ([`GemmBf16`],
/// grid [`grid`]).
pub struct GemmBf16Op<'a, A, B, C> {
    /// Left operand, `[m, k]`.
    pub a: &'a A,
    /// Right operand, `[n, k]`.
    pub b: &'a B,
    /// Output, `[m, n]`.
    pub c: &'a mut C,
    /// Rows of `a` and `c`.
    pub m: usize,
    /// Rows of `b`, columns of `c`.
    pub n: usize,
    /// Reduction length (a multiple of 8).
    pub k: usize,
}

impl<A: DevicePtr<bf16>, B: DevicePtr<bf16>, C: DevicePtrMut<bf16>> GemmBf16Op<'_, A, B, C> {
    /// Checks the sizes and `k % 8 == 0` and launches `kern` on `stream`.
    pub fn launch(self, kern: &CompiledKernel<GemmBf16>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = GemmBf16::NAME;
        let (m, n, k) = (self.m, self.n, self.k);
        require(name, k % 8 == 0, || format!("k = {k} is not a multiple of 8"))?;
        holds(name, "a", self.a, m * k)?;
        holds(name, "b", self.b, n * k)?;
        holds(name, "c", &*self.c, m * n)?;
        let g = grid(kern.params(), m, n);
        let (m, n, k) = (size32(name, "m", m)?, size32(name, "n", n)?, size32(name, "k", k)?);
        // SAFETY: sizes and k % 8 == 0 checked above.
        unsafe { GemmBf16::launch(kern, stream, g, self.a, self.b, self.c, m, n, k) }
    }
}
