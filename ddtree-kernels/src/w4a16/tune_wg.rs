//! [`Tunable`] for the dense `wgmma` W4A16 GEMM ([`W4a16GemmWg`]) the engine runs for INT4
//! linears of [`gemm_wg::WG_MIN_ROWS`] rows or more on Hopper: problem key, candidates (the
//! plain dense tiles at the key's scale group), timing workload. A candidate's `splitk` is a
//! policy: split K where [`gemm_wg::dense_splits`] does at the actual row count
//! ([`gemm_wg::dense_launch`]), so index 0 ([`gemm_wg::default_dense_tile`]) launches exactly
//! what [`gemm_wg::default_dense`] picks.

use std::fmt;
use std::sync::Arc;

use ddtree_runtime::cudarc::driver::CudaSlice;
use ddtree_runtime::{bucket_pow2, CompiledKernel, Cost, DevicePool, Gpu, RuntimeError, Tunable, Verdict};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::check;
#[allow(unused_imports)]
use crate::tune::*;
use crate::w4a16::gemm::{self, Epilogue, GemmArgs, Layout, ReduceParams, Scratch, W4a16Reduce};
use crate::w4a16::gemm_wg::{self, W4a16GemmWg, W4a16WgParams, WG_DENSE_SPACE};
use crate::w4a16::tune::{int4_cost, int4_weights, W4Weights};

/// A dense INT4 linear on the `wgmma` GEMM: `out[m, n] = a[m, k] . dequant(W)[n, k]^T`, scale
/// group `group`, interleaved weights. `m` is bucketed to powers of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct W4GemmKey {
    /// Rows (tokens).
    pub m: usize,
    /// Output features (weight rows).
    pub n: usize,
    /// Input features.
    pub k: usize,
    /// INT4 scale group.
    pub group: usize,
}

impl fmt::Display for W4GemmKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dense m={} n={} k={} group={}", self.m, self.n, self.k, self.group)
    }
}

/// The plain dense tiles of [`WG_DENSE_SPACE`] (interleaved), at scale group `group`,
/// deduplicated in order.
fn dense_tiles(group: u32) -> Vec<W4a16WgParams> {
    let mut out: Vec<W4a16WgParams> = Vec::new();
    for p in WG_DENSE_SPACE {
        if p.moe || p.epilogue != Epilogue::Plain || p.layout != Layout::Interleaved {
            continue;
        }
        let p = W4a16WgParams { group, ..*p };
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

/// Dense `wgmma` GEMM timing buffers: rotated activations and outputs, the weights (random
/// words, in as many copies as rotate past the L2) shared by every M bucket, the split-K
/// scratch and the reduce kernel.
pub struct W4GemmWorkload {
    key: W4GemmKey,
    a: Vec<CudaSlice<bf16>>,
    w: Arc<Vec<W4Weights>>,
    out: Vec<CudaSlice<bf16>>,
    scratch: Scratch,
    reduce: Arc<CompiledKernel<W4a16Reduce>>,
}

impl Tunable for W4a16GemmWg {
    type Key = W4GemmKey;
    type Workload = W4GemmWorkload;

    fn bucket(key: &W4GemmKey) -> W4GemmKey {
        W4GemmKey {
            m: bucket_pow2(key.m),
            ..*key
        }
    }

    /// Every plain dense tile at the key's group, each with and without split-K (a policy:
    /// [`gemm_wg::dense_launch`]), [`gemm_wg::default_dense_tile`] first; none below
    /// [`gemm_wg::WG_MIN_ROWS`] rows or where `k` is not a multiple of 32 and of the group.
    fn candidates(key: &W4GemmKey) -> Vec<W4a16WgParams> {
        let group = key.group as u32;
        if key.k % 32 != 0 || group == 0 || key.k % key.group != 0 {
            return Vec::new();
        }
        let Some(default) = gemm_wg::default_dense_tile(key.m as u32) else {
            return Vec::new();
        };
        let mut all = vec![W4a16WgParams { group, ..default }];
        for p in dense_tiles(group) {
            for splitk in [false, true] {
                let p = W4a16WgParams { splitk, ..p };
                if !all.contains(&p) {
                    all.push(p);
                }
            }
        }
        all
    }

    fn cost(key: &W4GemmKey) -> Cost {
        let W4GemmKey { m, n, k, group } = *key;
        int4_cost(m, n, k, group)
    }

    fn workload(
        gpu: &Gpu,
        pool: &mut DevicePool,
        key: &W4GemmKey,
        copies: usize,
        seed: u64,
    ) -> Result<W4GemmWorkload, RuntimeError> {
        let fills = Fills::get(gpu, pool)?;
        let W4GemmKey { m, n, k, group } = *key;
        let w = int4_weights(gpu, pool, n, k, group, seed)?;
        let rp = ReduceParams {
            block: 256,
            epilogue: Epilogue::Plain,
        };
        let reduce = pool.get_or_try_insert("w4a16_reduce plain", 0, || gpu.compile::<W4a16Reduce>(&rp))?;
        Ok(W4GemmWorkload {
            key: *key,
            a: fills.bf16_sets(gpu, copies, m * k, seed, (-1.0, 1.0))?,
            w,
            out: zeros(gpu, copies, m * n)?,
            // Up to 4 splits ([`gemm_wg::dense_splits`]).
            scratch: Scratch::new(gpu.stream(), 4 * m * n)?,
            reduce,
        })
    }

    fn run(gpu: &Gpu, kern: &CompiledKernel<Self>, w: &mut W4GemmWorkload, i: usize) -> Result<(), RuntimeError> {
        let W4GemmKey { m, n, k, .. } = w.key;
        let p = kern.params();
        let splits = gemm_wg::dense_splits(p, m as u32, n as u32, k as u32);
        let (wq, sc) = &w.w[i % w.w.len()];
        let args = GemmArgs {
            a: &w.a[i % w.a.len()],
            w: wq,
            scales: sc,
            residual: None,
            routing: None,
            m: m as u32,
            n: n as u32,
            k: k as u32,
        };
        let c = i % w.out.len();
        let reduce = p.splitk.then_some(&*w.reduce);
        // SAFETY: a [m, k], weights and scales of [n, k] at the key's group (interleaved words),
        // out [m, n], scratch for 4 splits of [m, n].
        unsafe { gemm::launch(kern, reduce, gpu.stream(), &args, &mut w.scratch, &mut w.out[c], splits) }
    }

    fn check_key(key: &W4GemmKey) -> W4GemmKey {
        // Ragged rows and columns against the 64- to 256-row tiles, the full reduction length.
        W4GemmKey {
            m: key.m.min(70),
            n: key.n.min(264),
            ..*key
        }
    }

    fn check(gpu: &Gpu, p: &W4a16WgParams, key: &W4GemmKey, seed: u64) -> Result<Verdict, RuntimeError> {
        let splits = gemm_wg::dense_splits(p, key.m as u32, key.n as u32, key.k as u32);
        // A split-K policy that does not split at the check key still checks its split path.
        let splits = if p.splitk { splits.max(2) } else { splits };
        crate::w4a16::check::dense::<W4a16GemmWg>(
            &check::Target::Gpu(gpu),
            p,
            key.m,
            key.n,
            key.k,
            splits,
            &mut StdRng::seed_from_u64(seed),
        )
        .map(verdict)
        .map_err(Into::into)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Index 0 launches exactly [`gemm_wg::default_dense`]'s variant and splits at every row
    /// count of its bucket, and every candidate is a plain dense tile at the key's group.
    #[test]
    fn default_candidate_reproduces_the_hand_chosen_launch() {
        for (n, k) in [(7168, 2048), (2048, 7168), (18432, 7168), (7168, 18432), (256, 512)] {
            for m in [48, 50, 64, 65, 100, 128, 129, 200, 256, 300, 512, 1000] {
                let key = W4GemmKey { m, n, k, group: 32 };
                let c = W4a16GemmWg::candidates(&W4a16GemmWg::bucket(&key));
                let (m, n, k) = (m as u32, n as u32, k as u32);
                assert_eq!(
                    Some(gemm_wg::dense_launch(&c[0], m, n, k)),
                    gemm_wg::default_dense(m, n, k),
                    "{key}"
                );
                assert!(c
                    .iter()
                    .all(|p| p.group == 32 && !p.moe && p.epilogue == Epilogue::Plain));
                let mut uniq = c.clone();
                uniq.dedup();
                assert_eq!(uniq.len(), c.len());
            }
        }
        assert!(W4a16GemmWg::candidates(&W4GemmKey {
            m: 32,
            n: 7168,
            k: 2048,
            group: 32
        })
        .is_empty());
        let g128 = W4a16GemmWg::candidates(&W4GemmKey {
            m: 64,
            n: 7168,
            k: 2048,
            group: 128,
        });
        assert!(!g128.is_empty() && g128.iter().all(|p| p.group == 128));
    }
}
