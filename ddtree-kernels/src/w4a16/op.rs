//! Host op of the W4A16 family that the host can check in full: [`RepackOp`]. (The GEMV, GEMMs
//! and MoE kernels launch through [`super::gemm::launch`] and [`super::MoeKernels`].)

use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use ddtree_runtime::{CompiledKernel, RuntimeError};

use super::layout::{interleaved_words, W4a16Repack};
use crate::op::{holds, require, size32};

/// Checkpoint INT4 words (`[experts * n, k / 8]`) into the interleaved tiled layout
/// (`experts * interleaved_words(n, k)` words) on the GPU ([`W4a16Repack`]).
pub struct RepackOp<'a, S, D> {
    /// Checkpoint words, `[experts * n, k / 8]`.
    pub src: &'a S,
    /// Interleaved words, `experts * interleaved_words(n, k)`.
    pub dst: &'a mut D,
    /// Output rows per expert.
    pub n: usize,
    /// Input width (a multiple of 8).
    pub k: usize,
    /// Experts (1 for a dense weight).
    pub experts: usize,
}

impl<S: DevicePtr<u32>, D: DevicePtrMut<u32>> RepackOp<'_, S, D> {
    /// Checks the sizes and launches `kern` on `stream`, one thread per output word (at most
    /// 65535 blocks; the kernel strides past that).
    pub fn launch(self, kern: &CompiledKernel<W4a16Repack>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = W4a16Repack::NAME;
        let (n, k, experts) = (self.n, self.k, self.experts);
        require(name, k % 8 == 0, || format!("k = {k} is not a multiple of 8"))?;
        let total = interleaved_words(n, k) * experts;
        holds(name, "src", self.src, experts * n * k / 8)?;
        holds(name, "dst", &*self.dst, total)?;
        let grid = total.div_ceil(kern.params().block as usize).clamp(1, 65535) as u32;
        let (n, k, experts) = (
            size32(name, "n", n)?,
            size32(name, "k", k)?,
            size32(name, "experts", experts)?,
        );
        size32(name, "words", total)?;
        // SAFETY: both buffers hold the words the layout maps (checked above).
        unsafe { W4a16Repack::launch(kern, stream, grid, self.src, self.dst, n, k, experts) }
    }
}
