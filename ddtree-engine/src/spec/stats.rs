//! Counters and timings of a speculative generation.

use std::time::Duration;

/// What happened during [`crate::spec::generate_speculative`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecStats {
    /// Drafter name.
    pub drafter: String,
    /// Node budget B of each tree (root not counted).
    pub budget: usize,
    /// Whether the budget was `auto` (for now a fixed default, [`crate::spec::AUTO_BUDGET`]).
    pub budget_auto: bool,
    /// Drafter block size (bonus slot included).
    pub block_size: usize,
    /// Draft-verify rounds.
    pub rounds: usize,
    /// Per round, the accepted length: the root (bonus token) plus the accepted drafted tokens.
    pub accept_lengths: Vec<usize>,
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
    /// Tree construction (including the drafter logits' copy to the host).
    pub build: Duration,
    /// Target tree-verify forwards (including the logits' copy to the host and token choice).
    pub verify: Duration,
    /// Acceptance walk, KV compaction and feature selection.
    pub accept: Duration,
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

    /// Generated tokens per target forward.
    pub fn tokens_per_target_forward(&self) -> f64 {
        if self.target_forwards == 0 {
            0.0
        } else {
            self.tokens as f64 / self.target_forwards as f64
        }
    }
}
