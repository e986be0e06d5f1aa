//! Host ops of the W4A16 family that the host can check in full: [`RepackOp`] and
//! [`DenseGemvOp`]. (The GEMMs and the MoE kernels launch through [`super::gemm::launch`] and
//! [`super::MoeKernels`].)

use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use ddtree_runtime::{CompiledKernel, RuntimeError};
use half::bf16;

use super::gemv::{self, GemvMode, W4a16Gemv};
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

/// `out = x w^T` for a dense INT4 weight on the small-token [`W4a16Gemv`] (a `Dense` variant):
/// `x` `[rows, k]` bf16, `w` interleaved `[n, k]` with the scale words of the variant's group,
/// `out` `[rows, n]`.
pub struct DenseGemvOp<'a, X, W, S, O, U, F> {
    /// Activations, `[rows, k]`.
    pub x: &'a X,
    /// Interleaved INT4 words, `interleaved_words(n, k)`.
    pub w: &'a W,
    /// Scale words (bf16 pairs), `[n, k / group]` scales.
    pub scales: &'a S,
    /// Output, `[rows, n]`.
    pub out: &'a mut O,
    /// Rows (at most the variant's `8 chunks`).
    pub rows: usize,
    /// Outputs per row.
    pub n: usize,
    /// Input width (a multiple of 32 and of the variant's group).
    pub k: usize,
    /// Any non-empty `u32` buffer for the routing arguments a dense variant does not read.
    pub unused_u32: &'a U,
    /// Any non-empty `f32` buffer for the router weights a dense variant does not read.
    pub unused_f32: &'a F,
}

impl<X, W, S, O, U, F> DenseGemvOp<'_, X, W, S, O, U, F>
where
    X: DevicePtr<bf16>,
    W: DevicePtr<u32>,
    S: DevicePtr<u32>,
    O: DevicePtrMut<bf16>,
    U: DevicePtr<u32>,
    F: DevicePtr<f32>,
{
    /// Checks the mode, the row limit, `k % 32 == 0`, `k % group == 0` and the sizes, and
    /// launches `kern` on `stream`.
    pub fn launch(self, kern: &CompiledKernel<W4a16Gemv>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = W4a16Gemv::NAME;
        let p = *kern.params();
        let (rows, n, k) = (self.rows, self.n, self.k);
        require(name, p.mode == GemvMode::Dense, || {
            format!("{p:?} is not a dense variant")
        })?;
        let most = gemv::max_tokens(&p) as usize;
        require(name, rows >= 1 && rows <= most, || {
            format!("{rows} rows, the variant takes 1..={most}")
        })?;
        let group = p.group as usize;
        require(name, gemv::takes_group(group), || {
            format!("scale group {group}: the GEMV takes 32, 64 or 128")
        })?;
        require(name, k % 32 == 0 && k % group == 0, || {
            format!("k = {k} is not a multiple of 32 and of the group {group}")
        })?;
        holds(name, "x", self.x, rows * k)?;
        holds(name, "w", self.w, interleaved_words(n, k))?;
        holds(name, "scales", self.scales, (n * (k / group)).div_ceil(2))?;
        holds(name, "out", &*self.out, rows * n)?;
        holds(name, "unused_u32", self.unused_u32, 1)?;
        holds(name, "unused_f32", self.unused_f32, 1)?;
        let (m, n32, k32) = (
            size32(name, "rows", rows)?,
            size32(name, "n", n)?,
            size32(name, "k", k)?,
        );
        let grid = gemv::grid(&p, n32, 1);
        let (u, f) = (self.unused_u32, self.unused_f32);
        // SAFETY: a dense variant within its row limit, sizes checked above; the routing
        // arguments are not read.
        unsafe {
            W4a16Gemv::launch(
                kern,
                stream,
                grid,
                self.x,
                self.w,
                self.scales,
                u,
                f,
                u,
                u,
                self.out,
                m,
                n32,
                k32,
                1,
                1,
            )
        }
    }
}
