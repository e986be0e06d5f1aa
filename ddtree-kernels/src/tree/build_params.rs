//! Compile-time parameters and sizing rules of the tree builder ([`super::build::TreeBuild`]).

use ddtree_macros::KernelParams;

/// Compile-time parameters of [`super::build::TreeBuild`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct TreeBuildParams {
    /// Threads per block.
    pub block: u32,
    /// Items (a slice's logits, a depth's candidates) each thread holds in registers.
    pub vpt: u32,
    /// The selects' exact-rank threshold: the radix passes stop once the bucket of the k-th
    /// key holds at most `ties` keys, which are then ranked exactly (key, then token), and
    /// the floor takes only warps with items, the lanes' second-largest keys past two keys per
    /// warp and else the least key (see the module docs). 0: radix passes until the bucket is
    /// taken whole or the keys are equal, and floor 0 past two keys per warp.
    pub ties: u32,
    /// The most keys at or above the floor that a select ranks directly (larger key, then
    /// earlier item, by counting), with no radix pass; more fall back to the radix select.
    /// 0: always the radix select. At most 1024.
    pub direct: u32,
    /// Whether slices write their candidates best first and a depth's merge takes the best
    /// `k` by merging those sorted lists (bitonic merges in warps, no select), when
    /// `k <= 64` and at most 64 slices; else the merge selects as a slice does.
    pub sorted: bool,
    /// Registers for one block per SM (`__launch_bounds__(block, 1)`). Without it `ptxas`
    /// keeps some 512-thread variants under 64 registers, so that two blocks fit, and spills.
    pub one_block: bool,
}

impl TreeBuildParams {
    /// Blocks per SM the registers must allow ([`Self::one_block`]; 0: no bound).
    pub const fn min_blocks(&self) -> u32 {
        if self.one_block {
            1
        } else {
            0
        }
    }

    /// The most items one block holds, `block * vpt`: the longest slice, and the most
    /// candidates (`slices * k`) a depth's merge takes.
    pub const fn tile(&self) -> u32 {
        self.block * self.vpt
    }
}

/// The largest `k` (= min(budget, vocab)) and budget of the builder.
pub const MAX_K: usize = 1024;

/// Nodes (root included) the expansion's shared state holds.
pub(super) const CAP: u32 = 1025;

/// Expansion candidates per round kept in shared memory (key, then reference, in `ctok`,
/// free after the merge); later ones go to the `cand_key` / `cand_tok` scratch.
pub(super) const SHARED_CANDS: u32 = 512;

/// The most expansion candidates of one round at `budget` and `k`:
/// `sum over j in 1..=budget of min(k, budget / j)` (see the module docs).
pub fn expansion_candidates(budget: usize, k: usize) -> usize {
    (1..=budget).map(|j| k.min(budget / j)).sum()
}
