//! [`Tunable`] for the fused decode GEMVs the engine launches: the RMSNorm + GEMV of the MLA
//! query path ([`GemvRmsNormBf16`]) and the gate/up SiLU-and-mul GEMVs of the shared experts
//! and dense MLPs ([`GemvGateUpSilu`], [`GemvSplitGateUpSilu`]). Which of the two gate/up
//! kernels runs is [`gemv::choose_gate_up`]'s rule (per column or split-K, by the shape and
//! the SM count); the tuner picks the variant within that kernel. Index 0 of every candidate
//! list is the engine's untuned choice ([`gemv::choose_rms_norm`], [`gemv::choose_gate_up`]).

use std::fmt;
use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::CudaSlice;
use ddtree_runtime::{bucket_pow2, CompiledKernel, Cost, DevicePool, Gpu, RuntimeError, Tunable, Verdict};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::check;
use crate::gemv_bf16::op::{GateUpSiluOp, GemvRmsNormOp};
use crate::gemv_bf16::{self as gemv, GemvGateUpSilu, GemvRmsNormBf16, GemvSplitGateUpSilu, NORM_MAX_K};
#[allow(unused_imports)]
use crate::tune::*;

/// A bf16 GEMV problem: `rows` activation rows (bucketed to powers of two, at most
/// [`gemv::MAX_ROWS`] in the engine) against an `[n, k]` weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemvKey {
    /// Activation rows (tokens).
    pub rows: usize,
    /// Output columns (weight rows).
    pub n: usize,
    /// Reduction length.
    pub k: usize,
}

impl fmt::Display for GemvKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rows={} n={} k={}", self.rows, self.n, self.k)
    }
}

impl GemvKey {
    fn bucketed(&self) -> GemvKey {
        GemvKey {
            rows: bucket_pow2(self.rows),
            ..*self
        }
    }

    /// The rows the kernels are compiled for at this key (`m` of the variant the engine picks).
    fn m(&self) -> u32 {
        bucket_pow2(self.rows) as u32
    }

    /// A smaller key for the CPU check: ragged columns, the full reduction length.
    fn checked(&self) -> GemvKey {
        GemvKey {
            n: self.n.min(136),
            ..*self
        }
    }

    fn valid(&self) -> bool {
        self.rows >= 1 && self.k % 8 == 0 && self.n > 0 && (self.n as u64) * (self.k as u64) < 1 << 32
    }
}

/// `candidates` with `default` moved to the front (kept where it is absent).
fn default_first<P: PartialEq + Copy>(mut all: Vec<P>, default: Option<P>) -> Vec<P> {
    if let Some(d) = default {
        all.retain(|p| *p != d);
        all.insert(0, d);
    }
    all
}

/// Timing buffers of the fused GEMVs: rotated activations and outputs, `weights` random `[n,
/// k]` weights (2 for gate and up) shared through the pool, and a norm scale.
pub struct GemvWorkload {
    key: GemvKey,
    x: Vec<CudaSlice<bf16>>,
    w: Vec<Arc<Vec<CudaSlice<bf16>>>>,
    norm: CudaSlice<bf16>,
    out: Vec<CudaSlice<bf16>>,
}

fn gemv_workload(
    gpu: &Gpu,
    pool: &mut DevicePool,
    key: &GemvKey,
    weights: usize,
    copies: usize,
    seed: u64,
) -> Result<GemvWorkload, RuntimeError> {
    let fills = Fills::get(gpu, pool)?;
    let GemvKey { rows, n, k } = *key;
    let w = (0..weights)
        .map(|i| {
            let name = format!("gemv_bf16.w{i} n={n} k={k}");
            fills.shared_bf16(gpu, pool, name, n * k, seed.wrapping_sub(1 + i as u64), (-1.0, 1.0))
        })
        .collect::<Result<Vec<_>, RuntimeError>>()?;
    Ok(GemvWorkload {
        key: *key,
        x: fills.bf16_sets(gpu, copies, rows * k, seed, (-1.0, 1.0))?,
        w,
        norm: fills.bf16(gpu, k, seed.wrapping_add(7), (0.5, 1.5))?,
        out: zeros(gpu, copies, rows * n)?,
    })
}

fn gemv_cost(key: &GemvKey, weights: usize) -> Cost {
    let GemvKey { rows, n, k } = *key;
    Cost {
        bytes: (2 * weights * n * k + 2 * rows * k + 2 * rows * n) as f64,
        flops: 2.0 * (weights * rows * n * k) as f64,
    }
}

impl Tunable for GemvRmsNormBf16 {
    type Key = GemvKey;
    type Workload = GemvWorkload;

    fn bucket(key: &GemvKey) -> GemvKey {
        key.bucketed()
    }

    /// The variants that take the rows, the one with the most warps among those compiled for
    /// exactly the bucket's rows first ([`gemv::choose_rms_norm`]'s pick, which the engine makes
    /// for one row); none where `k` is longer than [`NORM_MAX_K`] or not a multiple of 8.
    fn candidates(key: &GemvKey) -> Vec<gemv::GemvParams> {
        if !key.valid() || key.k > NORM_MAX_K as usize {
            return Vec::new();
        }
        let m = key.m();
        let all: Vec<_> = Self::space().into_iter().filter(|p| p.m >= m).collect();
        let default = all.iter().filter(|p| p.m == m).max_by_key(|p| p.warps).copied();
        default_first(all, default)
    }

    fn cost(key: &GemvKey) -> Cost {
        gemv_cost(key, 1)
    }

    fn workload(
        gpu: &Gpu,
        pool: &mut DevicePool,
        key: &GemvKey,
        copies: usize,
        seed: u64,
    ) -> Result<GemvWorkload, RuntimeError> {
        gemv_workload(gpu, pool, key, 1, copies, seed)
    }

    fn run(gpu: &Gpu, kern: &CompiledKernel<Self>, w: &mut GemvWorkload, i: usize) -> Result<(), RuntimeError> {
        let GemvKey { rows, n, k } = w.key;
        let c = i % w.out.len();
        GemvRmsNormOp {
            a: &w.x[i % w.x.len()],
            norm: &w.norm,
            eps: 1e-6,
            w: &w.w[0][i % w.w[0].len()],
            out: &mut w.out[c],
            rows,
            n,
            k,
        }
        .launch(kern, gpu.stream())
    }

    fn check_key(key: &GemvKey) -> GemvKey {
        key.checked()
    }

    fn check(gpu: &Gpu, p: &gemv::GemvParams, key: &GemvKey, seed: u64) -> Result<Verdict, RuntimeError> {
        let r = check::gemv_rms_norm(
            &check::Target::Gpu(gpu),
            p,
            key.rows,
            key.n,
            key.k,
            &mut StdRng::seed_from_u64(seed),
        )?;
        Ok(verdict(r.into_iter().next().expect("one case")))
    }
}

/// The gate/up workload's launch.
fn gate_up_op<'a>(
    w: &'a mut GemvWorkload,
    i: usize,
) -> GateUpSiluOp<'a, CudaSlice<bf16>, CudaSlice<bf16>, CudaSlice<bf16>> {
    let GemvKey { rows, n, k } = w.key;
    let c = i % w.out.len();
    GateUpSiluOp {
        a: &w.x[i % w.x.len()],
        gate: &w.w[0][i % w.w[0].len()],
        up: &w.w[1][i % w.w[1].len()],
        out: &mut w.out[c],
        rows,
        n,
        k,
    }
}

/// The two gate/up SiLU kernels' [`Tunable`]s: the same key, workload, candidates (the variants
/// that take the rows, [`gemv::choose_gate_up`]'s, the first compiled for exactly the bucket's
/// rows, first) and check; they differ in their parameters, launch and check function.
macro_rules! gate_up_tunable {
    ($kernel:ty, $params:ty, $launch:ident, $check:path) => {
        impl Tunable for $kernel {
            type Key = GemvKey;
            type Workload = GemvWorkload;

            fn bucket(key: &GemvKey) -> GemvKey {
                key.bucketed()
            }

            fn candidates(key: &GemvKey) -> Vec<$params> {
                if !key.valid() {
                    return Vec::new();
                }
                let m = key.m();
                let all: Vec<_> = Self::space().into_iter().filter(|p| p.m >= m).collect();
                let default = all.iter().find(|p| p.m == m).copied();
                default_first(all, default)
            }

            fn cost(key: &GemvKey) -> Cost {
                gemv_cost(key, 2)
            }

            fn workload(
                gpu: &Gpu,
                pool: &mut DevicePool,
                key: &GemvKey,
                copies: usize,
                seed: u64,
            ) -> Result<GemvWorkload, RuntimeError> {
                gemv_workload(gpu, pool, key, 2, copies, seed)
            }

            fn run(gpu: &Gpu, kern: &CompiledKernel<Self>, w: &mut GemvWorkload, i: usize) -> Result<(), RuntimeError> {
                gate_up_op(w, i).$launch(kern, gpu.stream())
            }

            fn check_key(key: &GemvKey) -> GemvKey {
                key.checked()
            }

            fn check(gpu: &Gpu, p: &$params, key: &GemvKey, seed: u64) -> Result<Verdict, RuntimeError> {
                let r = $check(
                    &check::Target::Gpu(gpu),
                    p,
                    key.rows,
                    key.n,
                    key.k,
                    &mut StdRng::seed_from_u64(seed),
                )?;
                Ok(verdict(r.into_iter().next().expect("one case")))
            }
        }
    };
}

gate_up_tunable!(GemvGateUpSilu, gemv::GemvParams, launch_warp, check::gemv_gate_up);
gate_up_tunable!(
    GemvSplitGateUpSilu,
    gemv::GemvSplitParams,
    launch_split,
    check::gemv_split_gate_up
);

#[cfg(test)]
mod tests {
    use super::*;

    /// Index 0 is the engine's untuned pick ([`gemv::choose_rms_norm`], [`gemv::choose_gate_up`])
    /// at every shape it makes one, on an H100/H200 (132 SMs) and a small GPU.
    #[test]
    fn default_candidates_are_the_engines_choices() {
        for sms in [132, 8] {
            for rows in 1..=gemv::MAX_ROWS {
                for (n, k) in [
                    (12288, 1536),
                    (2048, 7168),
                    (18432, 7168),
                    (64, 32),
                    (96, 64),
                    (576, 7168),
                ] {
                    let key = GemvKey { rows, n, k };
                    if let Some(p) = gemv::choose_rms_norm(rows, n, k, sms) {
                        assert_eq!(
                            GemvRmsNormBf16::candidates(&GemvRmsNormBf16::bucket(&key))[0],
                            p,
                            "{key}"
                        );
                    }
                    match gemv::choose_gate_up(rows, n, k, sms) {
                        Some(gemv::GemvChoice::Warp(p)) => {
                            assert_eq!(GemvGateUpSilu::candidates(&GemvGateUpSilu::bucket(&key))[0], p, "{key}")
                        }
                        Some(gemv::GemvChoice::Split(p)) => assert_eq!(
                            GemvSplitGateUpSilu::candidates(&GemvSplitGateUpSilu::bucket(&key))[0],
                            p,
                            "{key}"
                        ),
                        None => {}
                    }
                }
            }
        }
        let key = GemvKey {
            rows: 3,
            n: 2048,
            k: 7168,
        };
        assert!(GemvGateUpSilu::candidates(&GemvGateUpSilu::bucket(&key))
            .iter()
            .all(|p| p.m >= 4));
        assert!(GemvRmsNormBf16::candidates(&GemvKey {
            rows: 1,
            n: 64,
            k: 4096
        })
        .is_empty());
    }
}
