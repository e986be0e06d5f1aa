//! Host op of the tree family's cache compaction: [`CompactRowsOp`]. (The builder, accept and
//! verify kernels launch through the runner types of [`super::gpu`].)

use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use ddtree_runtime::{CompiledKernel, RuntimeError};
use half::bf16;

use super::CompactRows;
use crate::op::{holds, require, size32};

/// In every one of `layers` layers of `buf` (`layer_stride` elements apart), row
/// `base + accepted[i]` moves to row `base + i` for `i < accept_len[0]` ([`CompactRows`], one
/// block per layer).
pub struct CompactRowsOp<'a, B, A, L> {
    /// The rows, `[layers, layer_stride]`.
    pub buf: &'a mut B,
    /// Kept rows after `base`, ascending.
    pub accepted: &'a A,
    /// How many of `accepted` to keep, `[1]`.
    pub accept_len: &'a L,
    /// Layers.
    pub layers: usize,
    /// First row that moves.
    pub base: usize,
    /// Row width (a multiple of 8).
    pub row_len: usize,
    /// Elements between layers.
    pub layer_stride: usize,
}

impl<B: DevicePtrMut<bf16>, A: DevicePtr<u32>, L: DevicePtr<u32>> CompactRowsOp<'_, B, A, L> {
    /// Checks what the host can see and launches `k` on `stream`.
    ///
    /// # Safety
    /// On the device, `accept_len[0] <= accepted.len()`, and the kept rows ascend (`accepted[i]
    /// >= i`) and lie inside a layer: `(base + accepted[i] + 1) * row_len <= layer_stride`.
    pub unsafe fn launch(self, k: &CompiledKernel<CompactRows>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = CompactRows::NAME;
        require(name, self.row_len % 8 == 0, || {
            format!("rows of {} are not a multiple of 8", self.row_len)
        })?;
        holds(name, "buf", &*self.buf, self.layers * self.layer_stride)?;
        holds(name, "accept_len", self.accept_len, 1)?;
        let layers = size32(name, "layers", self.layers)?;
        let (base, row_len) = (size32(name, "base", self.base)?, size32(name, "row_len", self.row_len)?);
        let stride = size32(name, "layer_stride", self.layer_stride)?;
        // SAFETY: the buffer spans every layer (checked above); the kept rows are the caller's
        // contract.
        unsafe {
            CompactRows::launch(
                k,
                stream,
                layers,
                self.buf,
                self.accepted,
                self.accept_len,
                base,
                row_len,
                stride,
            )
        }
    }
}
