//! [`Tunable`] for the tree builder: problem key, candidates, timing workload (see [`crate::tune`]).

use std::fmt;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::CudaSlice;
use ddtree_runtime::{bucket_pow2, CompiledKernel, Cost, DevicePool, Gpu, RuntimeError, Tunable, Verdict};
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::tree::gpu::{builder_fits, GpuBuilder};
use crate::tree::{self, TreeBuild, TreeBuildParams, MAX_K};
#[allow(unused_imports)]
use crate::tune::*;

/// The GPU tree builder's problem: drafter logits for `depth` positions over `vocab` tokens
/// and a node budget. The budget is bucketed to powers of two (a variant that fits a budget
/// fits every smaller one); depth and vocabulary stay exact.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TreeBuildKey {
    /// Drafted positions (the tree's deepest level, `block_size - 1`).
    pub depth: usize,
    /// Vocabulary size (the logits' row length).
    pub vocab: usize,
    /// Node budget (root excluded), at most [`crate::tree::MAX_K`].
    pub budget: usize,
}

impl fmt::Display for TreeBuildKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "depth={} vocab={} budget={}", self.depth, self.vocab, self.budget)
    }
}

/// Tree builder timing buffers: random logits (uniform in [-12, 12), the checks' random
/// profile) in rotated copies, and one builder per candidate (their scratch and outputs are
/// sized by the variant's slice count).
pub struct TreeBuildWorkload {
    logits: Vec<CudaSlice<f32>>,
    root: CudaSlice<u32>,
    builders: Vec<GpuBuilder>,
}

impl Tunable for TreeBuild {
    type Key = TreeBuildKey;
    type Workload = TreeBuildWorkload;

    fn bucket(key: &TreeBuildKey) -> TreeBuildKey {
        TreeBuildKey {
            budget: bucket_pow2(key.budget).min(MAX_K),
            ..*key
        }
    }

    /// The variants that [fit](builder_fits) the key, in space order (the first is the
    /// builder's default): the sorted ones where any fits (at `k <= 64` the sorted merge was the
    /// faster path in every measured case, and builds that short are timed near the host's
    /// launch rate, too coarsely to rank them against the selecting merges), else the others.
    fn candidates(key: &TreeBuildKey) -> Vec<TreeBuildParams> {
        if key.depth == 0 || key.depth > 16 || key.vocab == 0 || key.budget == 0 || key.budget > MAX_K {
            return Vec::new();
        }
        let mut fit: Vec<TreeBuildParams> = Self::space()
            .into_iter()
            .filter(|p| builder_fits(p, key.vocab, key.budget))
            .collect();
        if fit.iter().any(|p| p.sorted) {
            fit.retain(|p| p.sorted);
        }
        fit
    }

    fn cost(key: &TreeBuildKey) -> Cost {
        Cost {
            bytes: 4.0 * (key.depth * key.vocab) as f64,
            flops: 0.0,
        }
    }

    fn workload(
        gpu: &Gpu,
        pool: &mut DevicePool,
        key: &TreeBuildKey,
        copies: usize,
        seed: u64,
    ) -> Result<TreeBuildWorkload, RuntimeError> {
        let fills = Fills::get(gpu, pool)?;
        let TreeBuildKey { depth, vocab, budget } = *key;
        Ok(TreeBuildWorkload {
            logits: (0..copies.max(1) as u64)
                .map(|c| fills.f32(gpu, depth * vocab, seed + c, (-12.0, 12.0)))
                .collect::<Result<_, _>>()?,
            root: upload(gpu, &[1u32])?,
            builders: Self::candidates(key)
                .iter()
                .map(|p| GpuBuilder::with_params(gpu, p, depth, vocab, budget))
                .collect::<Result<_, _>>()?,
        })
    }

    /// A build takes 15 to 30 µs below B = 128, about the spread of a single launch's timing.
    fn runs_per_sample() -> usize {
        16
    }

    fn run(gpu: &Gpu, kern: &CompiledKernel<Self>, w: &mut TreeBuildWorkload, i: usize) -> Result<(), RuntimeError> {
        let logits = &w.logits[i % w.logits.len()];
        let b = w
            .builders
            .iter_mut()
            .find(|b| b.params() == kern.params())
            .ok_or_else(|| RuntimeError::Launch {
                kernel: TreeBuild::symbol(kern.params()),
                reason: "not a candidate of this key".into(),
            })?;
        b.build_with(kern, gpu.stream(), logits, &w.root)
    }

    fn check(gpu: &Gpu, p: &TreeBuildParams, key: &TreeBuildKey, seed: u64) -> Result<Verdict, RuntimeError> {
        let mut rng = StdRng::seed_from_u64(seed);
        let results = tree::check::builder_variant(gpu, p, key.depth, key.vocab, key.budget, &mut rng)?;
        Ok(match results.iter().find(|r| !r.passed) {
            Some(bad) => verdict(bad.clone()),
            None => Verdict {
                passed: true,
                detail: format!("{} cases passed", results.len()),
            },
        })
    }
}
