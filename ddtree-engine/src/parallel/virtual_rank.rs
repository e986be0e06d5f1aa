//! One rank's share of a multi-rank model run alone (`--virtual-rank R`): the rank's shard of
//! every tensor on one device, with collectives that move nothing. The outputs are not the
//! model's (the other ranks' partial sums are missing); the point is timing one rank's compute
//! on one GPU (e.g. one rank of TP8 + EP8 Kimi) against its bytes floor, with the collectives'
//! cost measured separately.

use std::ops::Range;

use crate::backend::Backend;
use crate::error::Result;
use crate::parallel::comm::CommStats;
use crate::parallel::TensorComm;

/// Collectives of a rank running alone: reductions keep the local values, the logits are the
/// rank's slice (token `i` = its row `i`), the embedding gives zero rows for ids outside the
/// rank's slice. Its steps are the backend's plain greedy steps (CUDA graphs included).
#[derive(Debug, Clone, Copy)]
pub struct VirtualComm {
    /// The rank it stands for.
    pub rank: usize,
    /// Ranks of the plan.
    pub world: usize,
}

impl<B: Backend> TensorComm<B> for VirtualComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, _b: &B, _x: &mut B::Tensor) -> Result<()> {
        Ok(())
    }

    /// The rank's own slice: the "vocabulary" of a virtual rank is its slice, token `i` being
    /// its `i`-th row, both here and in [`TensorComm::argmax_vocab`] (so greedy DDTree still
    /// matches plain decoding on it).
    fn gather_vocab(&self, _b: &B, local: B::Tensor, _vocab: Range<usize>, _vocab_size: usize) -> Result<B::Tensor> {
        Ok(local)
    }

    fn argmax_vocab(&self, b: &B, local: &B::Tensor, _vocab: Range<usize>) -> Result<Vec<u32>> {
        b.argmax_rows(local)
    }

    fn greedy_forward(
        &self,
        b: &B,
        cache: &mut B::KvCache,
        _vocab: Range<usize>,
        forward: &mut dyn FnMut(&mut B::KvCache) -> Result<B::Tensor>,
    ) -> Result<Vec<u32>> {
        // Alone, the reduced argmax is the local one: the backend's own step (and recording).
        b.greedy_forward(cache, forward)
    }

    fn device_argmax(&self) -> bool {
        true
    }

    fn embedding(&self, b: &B, table: &B::Tensor, ids: &[u32], vocab: Range<usize>) -> Result<B::Tensor> {
        b.embedding_slice(table, ids, vocab)
    }

    fn stats(&self) -> CommStats {
        CommStats::default()
    }

    /// Alone, the rank is its own root: `buf` stays as it is.
    fn broadcast_host_u32(&self, _b: &B, _buf: &mut [u32], _root: usize) -> Result<()> {
        Ok(())
    }

    fn recover(&self, _b: &B) -> Result<()> {
        Ok(())
    }

    fn alone(&self) -> bool {
        true
    }
}
