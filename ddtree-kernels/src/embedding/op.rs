//! Host op of the embedding gather: [`EmbeddingOp`].

use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use ddtree_runtime::{CompiledKernel, RuntimeError};
use half::bf16;

use super::Embedding;
use crate::op::{holds, require, size32};

/// `out[r] = table[ids[r]]` for each of `ids` rows of `hidden` ([`Embedding`], one block per
/// id; an id outside the table gives a zero row, so the ids need no host check).
pub struct EmbeddingOp<'a, I, T, O> {
    /// Token ids, `[rows]`.
    pub ids: &'a I,
    /// Table, `[vocab, hidden]`.
    pub table: &'a T,
    /// Output, `[rows, hidden]`.
    pub out: &'a mut O,
    /// Ids gathered.
    pub rows: usize,
    /// Row width.
    pub hidden: usize,
    /// Table rows.
    pub vocab: usize,
}

impl<I: DevicePtr<u32>, T: DevicePtr<bf16>, O: DevicePtrMut<bf16>> EmbeddingOp<'_, I, T, O> {
    /// Checks the sizes and the variant (`vec` needs `hidden % 8 == 0`) and launches `k` on `stream`.
    pub fn launch(self, k: &CompiledKernel<Embedding>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = Embedding::NAME;
        holds(name, "ids", self.ids, self.rows)?;
        holds(name, "table", self.table, self.vocab * self.hidden)?;
        holds(name, "out", &*self.out, self.rows * self.hidden)?;
        require(name, !k.params().vec || self.hidden % 8 == 0, || {
            format!("{:?} needs hidden % 8 == 0, hidden = {}", k.params(), self.hidden)
        })?;
        let rows = size32(name, "rows", self.rows)?;
        let (hidden, vocab) = (size32(name, "hidden", self.hidden)?, size32(name, "vocab", self.vocab)?);
        // SAFETY: sizes checked above; the kernel bounds-checks each id against vocab.
        unsafe { Embedding::launch(k, stream, rows, self.ids, self.table, self.out, hidden, vocab) }
    }
}
