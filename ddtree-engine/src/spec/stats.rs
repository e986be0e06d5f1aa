//! Counters and timings of a speculative generation.

use std::time::Duration;

/// What happened during [`crate::spec::generate_speculative`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecStats {
    /// Drafter name.
    pub drafter: String,
    /// Node budget B of each tree (root not counted): the fixed budget, or for `auto` the
    /// maximum it may choose.
    pub budget: usize,
    /// Whether the budget was `auto` (chosen per round by [`crate::spec::choose_budget`]).
    pub budget_auto: bool,
    /// How the budget was decided: `fixed`, `auto: measured cost model (SOURCE)`, or
    /// `auto: no measured cost model, default cost model: ...` (see
    /// [`crate::spec::CostModel::fallback`]).
    pub budget_mode: String,
    /// Per round, the tree's node count besides the root: the chosen budget for `auto`; for a
    /// fixed budget the budget, or fewer when the drafter's positions run out.
    pub budgets: Vec<usize>,
    /// Drafter block size (bonus slot included).
    pub block_size: usize,
    /// Draft-verify rounds.
    pub rounds: usize,
    /// Per round, the accepted length: the root (bonus token) plus the accepted drafted tokens.
    pub accept_lengths: Vec<usize>,
    /// Per round, the backend's device-to-host reads from the tree build to the end of the
    /// accept ([`crate::Backend::host_reads`]; empty where the backend does not count them): 1
    /// for the CUDA backend's greedy fixed-budget rounds, 2 for its `auto` rounds (the path
    /// log-probs too) and where the tree goes through the host.
    pub round_host_reads: Vec<u64>,
    /// Target forwards: the prefill plus one verify per round.
    pub target_forwards: usize,
    /// Tree nodes verified, roots included.
    pub verified_nodes: usize,
    /// Tokens generated.
    pub tokens: usize,
    /// Prefill forward (and the first token).
    pub prefill: Duration,
    /// Drafter forwards.
    pub draft: Duration,
    /// Tree construction (including the tree's or the drafter logits' copy to the host; for a
    /// round on the device, [`crate::Backend::device_tree_round`], the build and staging's
    /// device time, from events on the stream).
    pub build: Duration,
    /// Target tree-verify forwards (including the argmax rows' or logits' copy to the host and
    /// token choice; on the device, the forward's device time).
    pub verify: Duration,
    /// Acceptance walk, KV compaction and feature selection (on the device, the rest of the
    /// round's wall time: the accept kernels, the read of the result, and drafter work still
    /// running when the build was enqueued).
    pub accept: Duration,
    /// On several ranks, where the trees came from: `replicated` (every rank builds) or
    /// `rank0` (rank 0 builds and broadcasts); `local` on one rank.
    pub tree_source: String,
    /// With `rank0` trees: time in the tree broadcast (rank 0: sending; the others: waiting
    /// for rank 0's build and receiving). Counted in [`SpecStats::build`] too.
    pub tree_sync: Duration,
}

impl SpecStats {
    /// Mean accepted length per round (root counted, as DDTree's τ); 0 without rounds.
    pub fn mean_accept_len(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            self.accept_lengths.iter().sum::<usize>() as f64 / self.rounds as f64
        }
    }

    /// Mean tree size per round (root not counted): the mean chosen budget for `auto`; 0
    /// without rounds.
    pub fn mean_budget(&self) -> f64 {
        if self.budgets.is_empty() {
            0.0
        } else {
            self.budgets.iter().sum::<usize>() as f64 / self.budgets.len() as f64
        }
    }

    /// Generated tokens per target forward.
    pub fn tokens_per_target_forward(&self) -> f64 {
        if self.target_forwards == 0 {
            0.0
        } else {
            self.tokens as f64 / self.target_forwards as f64
        }
    }
}
