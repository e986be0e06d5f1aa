//! [`Tunable`] for the kernels of this crate: problem keys, candidate filters, timing inputs
//! and costs. Candidates are checked with the GPU-versus-CPU checks of [`crate::check`] (fresh
//! random inputs, poisoned outputs, the module's CPU reference), at a reduced key where the
//! reference would be slow.
//!
//! Timing inputs are random values generated on the GPU by the [`crate::fill`] kernels (content
//! does not change the speed of these kernels; GiB-sized weights fill in under a millisecond).
//! Weights and tables that do not depend on the token count come from the tuner's
//! [`DevicePool`], so every M bucket of a shape shares them.
//!
//! This module holds what the impls share (the GPU fills, buffers, [`RowsKey`]); each family's
//! impl lives in its folder's `tune.rs` and is re-exported here.

use std::fmt;
use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use ddtree_runtime::{
    bucket_pow2, l2_bytes, rotation_copies, CompiledKernel, DevicePool, Gpu, Grid, RuntimeError, Verdict,
};
use half::bf16;

use crate::check::CheckResult;
use crate::elementwise::op::{FillBf16Op, FillF32Op, FillU32Op};
use crate::fill::{self, FillParams, FILL_MAX};
use crate::{FillRandomBf16, FillRandomF32, FillRandomU32};

pub(crate) fn drv(context: &'static str) -> impl FnOnce(ddtree_runtime::cudarc::driver::DriverError) -> RuntimeError {
    move |source| RuntimeError::Driver {
        context: context.to_string(),
        source,
    }
}

/// A device buffer of `n` elements filled on the GPU by `launch` (a fill kernel `K` over the
/// grid for `n`).
pub(crate) fn random<T, K>(
    gpu: &Gpu,
    kernel: &CompiledKernel<K>,
    n: usize,
    launch: impl FnOnce(&mut CudaSlice<T>, Grid, u32) -> Result<(), RuntimeError>,
) -> Result<CudaSlice<T>, RuntimeError>
where
    T: DeviceRepr + ValidAsZeroBits,
    K: Kernel<Params = FillParams>,
{
    if n >= FILL_MAX {
        return Err(RuntimeError::Launch {
            kernel: K::NAME.to_string(),
            reason: format!("{n} elements, at most {FILL_MAX} per fill"),
        });
    }
    let mut out = gpu
        .stream()
        .alloc_zeros::<T>(n.max(1))
        .map_err(drv("allocating a timing buffer"))?;
    launch(&mut out, fill::grid(kernel.params(), n).into(), n as u32)?;
    Ok(out)
}

/// The GPU fill kernels, loaded once per tuning run (through the pool).
pub(crate) struct Fills {
    bf16: Arc<CompiledKernel<FillRandomBf16>>,
    f32: Arc<CompiledKernel<FillRandomF32>>,
    u32: Arc<CompiledKernel<FillRandomU32>>,
}

impl Fills {
    pub(crate) fn get(gpu: &Gpu, pool: &mut DevicePool) -> Result<Fills, RuntimeError> {
        Ok(Fills {
            bf16: pool.get_or_try_insert(FillRandomBf16::NAME, 0, || {
                gpu.compile::<FillRandomBf16>(&FillRandomBf16::default_params())
            })?,
            f32: pool.get_or_try_insert(FillRandomF32::NAME, 0, || {
                gpu.compile::<FillRandomF32>(&FillRandomF32::default_params())
            })?,
            u32: pool.get_or_try_insert(FillRandomU32::NAME, 0, || {
                gpu.compile::<FillRandomU32>(&FillRandomU32::default_params())
            })?,
        })
    }

    /// `n` random bf16 in `[lo, hi]` from `seed`.
    pub(crate) fn bf16(
        &self,
        gpu: &Gpu,
        n: usize,
        seed: u64,
        (lo, hi): (f32, f32),
    ) -> Result<CudaSlice<bf16>, RuntimeError> {
        let k = &*self.bf16;
        random(gpu, k, n, |out, _, n| {
            let (n, seed) = (n as usize, seed as u32);
            FillBf16Op { out, n, seed, lo, hi }.launch(k, gpu.stream())
        })
    }

    /// `n` random f32 in `[lo, hi)` from `seed`.
    pub(crate) fn f32(
        &self,
        gpu: &Gpu,
        n: usize,
        seed: u64,
        (lo, hi): (f32, f32),
    ) -> Result<CudaSlice<f32>, RuntimeError> {
        let k = &*self.f32;
        random(gpu, k, n, |out, _, n| {
            let (n, seed) = (n as usize, seed as u32);
            FillF32Op { out, n, seed, lo, hi }.launch(k, gpu.stream())
        })
    }

    /// `n` random 32-bit words from `seed` (INT4 weight words: every word is 8 valid codes).
    pub(crate) fn u32(&self, gpu: &Gpu, n: usize, seed: u64) -> Result<CudaSlice<u32>, RuntimeError> {
        let k = &*self.u32;
        random(gpu, k, n, |out, _, n| {
            let (n, seed) = (n as usize, seed as u32);
            FillU32Op { out, n, seed }.launch(k, gpu.stream())
        })
    }

    /// `copies` buffers of `n` random bf16 in `range` (seeds `seed`, `seed + 1`, ...).
    pub(crate) fn bf16_sets(
        &self,
        gpu: &Gpu,
        copies: usize,
        n: usize,
        seed: u64,
        range: (f32, f32),
    ) -> Result<Vec<CudaSlice<bf16>>, RuntimeError> {
        (0..copies.max(1) as u64)
            .map(|c| self.bf16(gpu, n, seed + c, range))
            .collect()
    }

    /// Random bf16 weights of `n` elements in `range`, shared through `pool` under `name`
    /// (which must name the shape), in as many copies as rotate past the L2.
    pub(crate) fn shared_bf16(
        &self,
        gpu: &Gpu,
        pool: &mut DevicePool,
        name: String,
        n: usize,
        seed: u64,
        range: (f32, f32),
    ) -> Result<Arc<Vec<CudaSlice<bf16>>>, RuntimeError> {
        let copies = rotation_copies(l2_bytes(gpu), 2.0 * n as f64);
        pool.get_or_try_insert(&name, 2 * n * copies, || self.bf16_sets(gpu, copies, n, seed, range))
    }
}

/// `copies` zeroed buffers of `n` elements (outputs).
pub(crate) fn zeros<T: DeviceRepr + ValidAsZeroBits>(
    gpu: &Gpu,
    copies: usize,
    n: usize,
) -> Result<Vec<CudaSlice<T>>, RuntimeError> {
    (0..copies.max(1))
        .map(|_| {
            gpu.stream()
                .alloc_zeros::<T>(n.max(1))
                .map_err(drv("allocating a timing buffer"))
        })
        .collect()
}

/// A host vector on the device (small inputs: ids, positions).
pub(crate) fn upload<T: DeviceRepr>(gpu: &Gpu, v: &[T]) -> Result<CudaSlice<T>, RuntimeError> {
    gpu.stream().clone_htod(v).map_err(drv("copying a timing buffer"))
}

pub(crate) fn verdict(r: CheckResult) -> Verdict {
    Verdict {
        passed: r.passed,
        detail: format!("{}: {:?}", r.case, r.comparison),
    }
}

/// A row-wise problem: `rows` rows of width `n` (for SiLU-and-mul, `n` is the output width
/// `d`). Rows are bucketed to powers of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowsKey {
    /// Rows (tokens).
    pub rows: usize,
    /// Row width.
    pub n: usize,
}

impl fmt::Display for RowsKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rows={} n={}", self.rows, self.n)
    }
}

impl RowsKey {
    pub(crate) fn bucketed(&self) -> RowsKey {
        RowsKey {
            rows: bucket_pow2(self.rows),
            n: self.n,
        }
    }

    pub(crate) fn fewer_rows(&self, max: usize) -> RowsKey {
        RowsKey {
            rows: self.rows.min(max),
            n: self.n,
        }
    }
}

// Each family's `Tunable` impl lives in its folder; keys and workloads are re-exported here.
pub use crate::attention::tune::*;
pub use crate::elementwise::tune::*;
pub use crate::embedding::tune::*;
pub use crate::gemm_bf16::tune::*;
pub use crate::gemv_bf16::tune::*;
pub use crate::norm::tune::*;
pub use crate::topk::tune::*;
pub use crate::tree::tune::*;
pub use crate::tree::tune_verify::{VerifyKernels, VerifyKey, VerifyWorkload};
pub use crate::w4a16::tune::*;
pub use crate::w4a16::tune_moe::*;
pub use crate::w4a16::tune_wg::*;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::gpu::builder_fits;
    use crate::tree::{self, TreeBuild};
    use crate::w4a16::gemv::{self as w4gemv, GemvMode, GemvW4Params, W4a16Gemv};
    use crate::{Embedding, GemmBf16, RmsNorm, RopeInterleaved, RowTopk};
    use ddtree_runtime::Tunable;

    #[test]
    fn keys_bucket_rows_to_powers_of_two_and_keep_shapes() {
        assert_eq!(
            RmsNorm::bucket(&RowsKey { rows: 3, n: 7168 }),
            RowsKey { rows: 4, n: 7168 }
        );
        assert_eq!(
            GemmBf16::bucket(&GemmKey {
                m: 130,
                n: 7168,
                k: 2048
            }),
            GemmKey {
                m: 256,
                n: 7168,
                k: 2048
            }
        );
        let rope = RopeKey {
            tokens: 17,
            heads: 64,
            stride: 192,
            offset: 128,
            dim: 64,
            interleave: true,
        };
        assert_eq!(RopeInterleaved::bucket(&rope).tokens, 32);
        assert_eq!(
            rope.to_string(),
            "tokens=17 heads=64 stride=192 offset=128 dim=64 interleave=true"
        );
    }

    #[test]
    fn candidates_fit_the_key_and_keep_the_default_first() {
        let topk: Vec<u32> = RowTopk::candidates(&TopkKey {
            rows: 1,
            n: 163840,
            k: 8,
        })
        .iter()
        .map(|p| p.k)
        .collect();
        assert!(!topk.is_empty() && topk.iter().all(|&k| k == 8));
        assert!(RowTopk::candidates(&TopkKey { rows: 1, n: 4, k: 8 }).is_empty());
        let rope = RopeInterleaved::candidates(&RopeKey {
            tokens: 1,
            heads: 1,
            stride: 576,
            offset: 512,
            dim: 64,
            interleave: true,
        });
        assert!(rope.iter().all(|p| p.dim == 64 && p.interleave));
        assert_eq!(rope[0], RopeInterleaved::default_params());
        let half = RopeInterleaved::candidates(&RopeKey {
            tokens: 1,
            heads: 32,
            stride: 128,
            offset: 0,
            dim: 128,
            interleave: false,
        });
        assert!(!half.is_empty() && half.iter().all(|p| p.dim == 128 && !p.interleave));
        let ragged = RmsNorm::candidates(&RowsKey { rows: 1, n: 1001 });
        assert!(!ragged.is_empty() && ragged.iter().all(|p| !p.vec));
        assert_eq!(
            RmsNorm::candidates(&RowsKey { rows: 64, n: 7168 })[0],
            RmsNorm::default_params()
        );
        let one = RmsNorm::candidates(&RowsKey { rows: 1, n: 7168 })[0];
        assert!(
            crate::rms_norm::holds_row(&one, 7168) && one.block * one.hold == 1024,
            "{one:?}"
        );
        let q_a = RmsNorm::candidates(&RowsKey { rows: 1, n: 1536 })[0];
        assert_eq!((q_a.block, q_a.hold), (256, 1));
        assert!(GemmBf16::candidates(&GemmKey { m: 1, n: 8, k: 12 }).is_empty());
    }

    #[test]
    fn w4_gemv_keys_bucket_tokens_up_to_the_gemv_limit() {
        let key = |tokens| W4GemvKey {
            tokens,
            n: 2048,
            k: 7168,
            group: 32,
        };
        let buckets: Vec<usize> = [0, 1, 3, 5, 8, 9, 16]
            .iter()
            .map(|&t| W4a16Gemv::bucket(&key(t)).tokens)
            .collect();
        assert_eq!(buckets, [1, 1, 4, 8, 8, 16, 16]);
        assert_eq!(
            W4a16Gemv::bucket(&key(3)).to_string(),
            "dense tokens=4 n=2048 k=7168 group=32"
        );
        // Above 16 tokens the engine runs the tensor-core GEMM: no GEMV candidate.
        assert!(W4a16Gemv::candidates(&W4a16Gemv::bucket(&key(17))).is_empty());
    }

    #[test]
    fn w4_gemv_candidates_are_the_dense_space_of_the_group_with_the_default_first() {
        let dense = |t: u32, group: u32| -> Vec<GemvW4Params> {
            w4gemv::GEMV_SPACE
                .iter()
                .filter(|p| p.mode == GemvMode::Dense && p.group == group && w4gemv::max_tokens(p) >= t)
                .copied()
                .collect()
        };
        for group in [32, 64, 128] {
            for tokens in [1, 2, 4, 8, 16] {
                let c = W4a16Gemv::candidates(&W4GemvKey {
                    tokens,
                    n: 2048,
                    k: 7168,
                    group,
                });
                assert_eq!(
                    Some(c[0]),
                    w4gemv::default_params(GemvMode::Dense, group as u32, tokens as u32)
                );
                let mut sorted = c.clone();
                sorted.sort_by_key(|p| dense(tokens as u32, group as u32).iter().position(|q| q == p));
                assert_eq!(
                    sorted,
                    dense(tokens as u32, group as u32),
                    "every dense g{group} variant that takes {tokens} tokens, once"
                );
                assert!(c.iter().all(|p| p.group == group as u32));
            }
        }
        assert!(W4a16Gemv::candidates(&W4GemvKey {
            tokens: 16,
            n: 2048,
            k: 7168,
            group: 32,
        })
        .iter()
        .all(|p| p.chunks >= 2));
        for (k, group) in [(100, 32), (7168, 48), (7168, 256), (7200, 64), (7232, 128)] {
            assert!(
                W4a16Gemv::candidates(&W4GemvKey {
                    tokens: 1,
                    n: 64,
                    k,
                    group,
                })
                .is_empty(),
                "k = {k}, group {group}"
            );
        }
        let c = W4a16Gemv::check_key(&W4GemvKey {
            tokens: 16,
            n: 36864,
            k: 7168,
            group: 64,
        });
        assert_eq!(
            c,
            W4GemvKey {
                tokens: 16,
                n: 136,
                k: 7168,
                group: 64,
            }
        );
        let cost = |group| {
            let c = W4a16Gemv::cost(&W4GemvKey {
                tokens: 1,
                n: 64,
                k: 128,
                group,
            });
            (c.bytes, c.flops)
        };
        assert_eq!(cost(32), ((4096 + 512 + 256 + 128) as f64, 16384.0));
        assert_eq!(cost(128), ((4096 + 128 + 256 + 128) as f64, 16384.0));
    }

    #[test]
    fn check_keys_stay_small_but_keep_the_reduction() {
        let g = GemmBf16::check_key(&GemmKey {
            m: 256,
            n: 163840,
            k: 7168,
        });
        assert_eq!(g, GemmKey { m: 40, n: 136, k: 7168 });
        assert_eq!(
            Embedding::check_key(&EmbeddingKey {
                tokens: 256,
                vocab: 163840,
                hidden: 7168
            })
            .vocab,
            512
        );
    }

    #[test]
    fn tree_build_keys_bucket_the_budget_and_keep_fitting_variants() {
        let key = TreeBuildKey {
            depth: 7,
            vocab: 163840,
            budget: 50,
        };
        let b = TreeBuild::bucket(&key);
        assert_eq!(b, TreeBuildKey { budget: 64, ..key });
        assert_eq!(b.to_string(), "depth=7 vocab=163840 budget=64");
        // The default first; every candidate fits the bucket and so every budget in it.
        let c = TreeBuild::candidates(&b);
        assert_eq!(c[0], tree::gpu::builder_params(163840, 64).unwrap());
        assert!(c.len() > 1 && c.iter().all(|p| p.sorted));
        assert!(c
            .iter()
            .all(|p| builder_fits(p, 163840, 64) && builder_fits(p, 163840, 50)));
        // Sorted variants take at most 64 per depth: past it the selecting merges.
        let mid = TreeBuild::candidates(&TreeBuildKey { budget: 128, ..key });
        assert!(mid.len() > 1 && mid.iter().all(|p| !p.sorted));
        // 1024 leaves the widest tiles.
        let big = TreeBuild::candidates(&TreeBuildKey { budget: 1024, ..key });
        assert!(!big.is_empty() && big.iter().all(|p| !p.sorted && p.tile() >= 12 * 1024));
        assert!(TreeBuild::candidates(&TreeBuildKey { depth: 17, ..key }).is_empty());
        assert_eq!(TreeBuild::bucket(&TreeBuildKey { budget: 1000, ..key }).budget, 1024);
    }

    #[test]
    fn costs() {
        let c = GemmBf16::cost(&GemmKey { m: 2, n: 3, k: 4 });
        assert_eq!((c.bytes, c.flops), (2.0 * (8 + 12 + 6) as f64, 48.0));
        assert_eq!(RmsNorm::cost(&RowsKey { rows: 1, n: 8 }).bytes, 2.0 * 24.0);
    }
}
