//! Running one model over several ranks (GPUs, or CPU threads): the parallel plan, the memory
//! estimate checked before any allocation, the collectives, and what a rank of a model holds.
//!
//! - [`plan`]: which heads, experts, intermediate columns and vocabulary slice each rank holds,
//!   and the bytes each rank holds and reads per token;
//! - [`memory`]: the per-rank memory estimate and the refusal when it does not fit;
//! - [`comm`]: the [`comm::Comm`] trait, the in-process implementation for CPU ranks and tests,
//!   the rank bootstrap;
//! - [`nccl`]: [`comm::Comm`] over NCCL for GPUs;
//! - [`cpu`]: the CPU backend's tensor collectives ([`TensorComm`] over an in-process group);
//! - [`ranks`]: running one closure per rank on its own thread;
//! - [`group`]: long-lived rank threads that each keep their shard (for a server);
//! - [`virtual_rank`]: one rank's share run alone on one device (timing);
//! - `shard`: loading a rank's slice of every tensor from the mmap'd checkpoint.
//!
//! The model forward ([`crate::Model`]) is the same program on every rank: a rank's model holds
//! a [`RankContext`] and reduces where the plan makes partial sums (after the attention output
//! and after the MLP), looks embeddings up vocabulary-parallel and reduces the LM head's argmax
//! across ranks.

pub mod comm;
pub mod cpu;
pub mod cuda;
pub mod group;
pub mod memory;
pub mod nccl;
pub mod plan;
pub mod ranks;
pub(crate) mod shard;
pub mod virtual_rank;

use std::ops::Range;
use std::sync::Arc;

pub use comm::{Comm, CommStats, InProcessComm};
pub use memory::MemoryEstimate;
pub use plan::{ParallelPlan, ParallelSpec, RankShard, Split, Storage};

use crate::backend::Backend;
use crate::error::Result;

/// Collectives on a backend's tensors, as the sharded forward needs them.
pub trait TensorComm<B: Backend> {
    /// The underlying group's rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world(&self) -> usize;
    /// `x` summed over the ranks, in place.
    fn all_reduce_sum(&self, b: &B, x: &mut B::Tensor) -> Result<()>;
    /// Vocabulary-parallel logits (`[rows, vocab.len()]` on this rank, `vocab` its slice) to
    /// the whole `[rows, vocab_size]` logits on every rank (a virtual rank hands its slice
    /// back).
    fn gather_vocab(&self, b: &B, local: B::Tensor, vocab: Range<usize>, vocab_size: usize) -> Result<B::Tensor>;
    /// The greedy token of every row of vocabulary-parallel logits, reduced across ranks
    /// without gathering the logits (lowest index among equal maxima).
    fn argmax_vocab(&self, b: &B, local: &B::Tensor, vocab: Range<usize>) -> Result<Vec<u32>>;
    /// The greedy tokens of one step of this rank (the step staged by the backend's
    /// `begin_forward`): `forward` returns the rank's vocabulary-slice logits. By default
    /// `forward` then [`TensorComm::argmax_vocab`]; the NCCL comm runs the step through the
    /// CUDA backend's graphs with the collectives inside, and a virtual rank through the
    /// backend's [`Backend::greedy_forward`].
    fn greedy_forward(
        &self,
        b: &B,
        cache: &mut B::KvCache,
        vocab: Range<usize>,
        forward: &mut dyn FnMut(&mut B::KvCache) -> Result<B::Tensor>,
    ) -> Result<Vec<u32>> {
        let logits = forward(cache)?;
        self.argmax_vocab(b, &logits, vocab)
    }
    /// Whether [`TensorComm::greedy_forward`] leaves the reduced greedy tokens where the
    /// backend's [`Backend::greedy_forward`] does (on the device, for a device-resident DDTree
    /// round's accept); `false` by default.
    fn device_argmax(&self) -> bool {
        false
    }
    /// Vocabulary-parallel embedding: rows of `table` (this rank's slice `vocab`) for the ids in
    /// it, zero rows for the others, summed over the ranks.
    fn embedding(&self, b: &B, table: &B::Tensor, ids: &[u32], vocab: Range<usize>) -> Result<B::Tensor>;
    /// Collectives so far and the time in them.
    fn stats(&self) -> CommStats;
    /// Copies `root`'s host values `buf` to every rank's `buf` (control decisions and the
    /// DDTree tree of `--tree-source rank0`; a device implementation stages them through the
    /// device).
    fn broadcast_host_u32(&self, b: &B, buf: &mut [u32], root: usize) -> Result<()>;
    /// Whether the rank runs alone (a virtual rank: collectives that move nothing), so that
    /// decisions other ranks would broadcast to it are its own.
    fn alone(&self) -> bool {
        false
    }
    /// Called on a rank whose job failed: peers waiting in a collective for it are released
    /// with an error instead of waiting, where the implementation can do that from the failed
    /// rank (in process). By default nothing.
    fn abort(&self) {}
    /// A handle that aborts this rank's collectives from another thread (the rank group's),
    /// for implementations whose peers cannot be released by the failed rank alone (NCCL:
    /// `ncclCommAbort` on every rank). `None` by default.
    fn abort_handle(&self) -> Option<AbortHandle> {
        None
    }
    /// Makes the group usable again after a failed run, called on every rank at once (an NCCL
    /// group re-forms: every rank joins a new communicator) once every rank's job has
    /// returned. `Err` when the group cannot be recovered (the default).
    fn recover(&self, _b: &B) -> Result<()> {
        Err(crate::error::EngineError::Comm {
            op: "recover".into(),
            rank: self.rank(),
            reason: "this group's collectives cannot be recovered after a failed run; restart the process".into(),
        })
    }
}

/// Aborts one rank's collectives from any thread; `false` when it could not (a thread stuck
/// inside the communicator).
pub type AbortHandle = Arc<dyn Fn() -> bool + Send + Sync>;

/// A rank's part in a multi-rank model: the plan, which rank, and its collectives.
pub struct RankContext<B: Backend> {
    /// The plan (shared by the ranks).
    pub plan: Arc<ParallelPlan>,
    /// This rank.
    pub rank: usize,
    /// Its collectives.
    pub comm: Box<dyn TensorComm<B> + Send + Sync>,
}

impl<B: Backend> RankContext<B> {
    /// What this rank holds.
    pub fn shard(&self) -> &RankShard {
        &self.plan.shards[self.rank]
    }
}

impl<B: Backend> std::fmt::Debug for RankContext<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankContext")
            .field("rank", &self.rank)
            .field("spec", &self.plan.spec)
            .finish()
    }
}
