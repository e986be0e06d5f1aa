//! Host ops of the vocabulary-parallel kernels: [`EmbeddingSliceOp`], [`RankArgmaxOp`].

use std::ops::Range;
use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use ddtree_runtime::{CompiledKernel, RuntimeError};
use half::bf16;

use super::{rank_argmax_grid, EmbeddingSlice, RankArgmax};
use crate::op::{holds, require, size32};

/// A rank's embedding rows ([`EmbeddingSlice`], one block per id): `out[r] = table[ids[r] -
/// vocab.start]` for ids in `vocab`, a zero row for the others. The ids are read on the device,
/// so they need no host check and may be written by a kernel (a device-staged tree).
pub struct EmbeddingSliceOp<'a, I, T, O> {
    /// Token ids (global), `[rows]`.
    pub ids: &'a I,
    /// The rank's table slice, `[vocab.len(), hidden]`.
    pub table: &'a T,
    /// Output, `[rows, hidden]`.
    pub out: &'a mut O,
    /// Ids gathered.
    pub rows: usize,
    /// Row width.
    pub hidden: usize,
    /// The rank's vocabulary slice.
    pub vocab: Range<usize>,
}

impl<I: DevicePtr<u32>, T: DevicePtr<bf16>, O: DevicePtrMut<bf16>> EmbeddingSliceOp<'_, I, T, O> {
    /// Checks the sizes and the variant (`vec` needs `hidden % 8 == 0`) and launches `k` on `stream`.
    pub fn launch(self, k: &CompiledKernel<EmbeddingSlice>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = EmbeddingSlice::NAME;
        require(name, self.vocab.start <= self.vocab.end, || {
            format!("vocabulary slice {:?}", self.vocab)
        })?;
        holds(name, "ids", self.ids, self.rows)?;
        holds(name, "table", self.table, self.vocab.len() * self.hidden)?;
        holds(name, "out", &*self.out, self.rows * self.hidden)?;
        require(name, !k.params().vec || self.hidden % 8 == 0, || {
            format!("{:?} needs hidden % 8 == 0, hidden = {}", k.params(), self.hidden)
        })?;
        let rows = size32(name, "rows", self.rows)?;
        let hidden = size32(name, "hidden", self.hidden)?;
        let (lo, hi) = (
            size32(name, "vocab.start", self.vocab.start)?,
            size32(name, "vocab.end", self.vocab.end)?,
        );
        // SAFETY: sizes checked above; the kernel reads the table only for ids in [lo, hi).
        unsafe { EmbeddingSlice::launch(k, stream, rows, self.ids, self.table, self.out, hidden, lo, hi) }
    }
}

/// The greedy token of every row across the ranks ([`RankArgmax`]) from the all-gathered
/// per-rank maxima and local columns (`[world, rows]` each), rank `k`'s slice starting at
/// `k * slice`.
pub struct RankArgmaxOp<'a, V, I, O> {
    /// Every rank's row maxima, `[world, rows]`.
    pub values: &'a V,
    /// Their columns within each rank's slice, `[world, rows]`.
    pub indices: &'a I,
    /// The global token of each row, `[rows]`.
    pub out: &'a mut O,
    /// Rows.
    pub rows: usize,
    /// Ranks.
    pub world: usize,
    /// The width of a rank's slice (rank `k`'s starts at `k * slice`).
    pub slice: usize,
}

impl<V: DevicePtr<f32>, I: DevicePtr<u32>, O: DevicePtrMut<u32>> RankArgmaxOp<'_, V, I, O> {
    /// Checks the sizes and launches `k` on `stream`.
    pub fn launch(self, k: &CompiledKernel<RankArgmax>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = RankArgmax::NAME;
        require(name, self.world >= 1, || "no ranks".into())?;
        holds(name, "values", self.values, self.world * self.rows)?;
        holds(name, "indices", self.indices, self.world * self.rows)?;
        holds(name, "out", &*self.out, self.rows)?;
        // Global indices must fit below u32::MAX (the "no candidate" index).
        size32(name, "world * slice", self.world * self.slice)?;
        let rows = size32(name, "rows", self.rows)?;
        let (world, slice) = (size32(name, "world", self.world)?, size32(name, "slice", self.slice)?);
        // SAFETY: sizes checked above; the kernel strides over the rows.
        unsafe {
            RankArgmax::launch(
                k,
                stream,
                rank_argmax_grid(k.params(), self.rows),
                self.values,
                self.indices,
                self.out,
                rows,
                world,
                slice,
            )
        }
    }
}
