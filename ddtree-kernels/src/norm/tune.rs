//! [`Tunable`] for RMSNorm: problem key, candidates, timing workload (see [`crate::tune`]).

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::CudaSlice;
use ddtree_runtime::{CompiledKernel, Cost, DevicePool, Gpu, RuntimeError, Tunable, Verdict};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::check;
use crate::norm::op::RmsNormOp;
#[allow(unused_imports)]
use crate::tune::*;
use crate::RmsNorm;

/// RMSNorm timing buffers.
pub struct RmsNormWorkload {
    key: RowsKey,
    x: Vec<CudaSlice<bf16>>,
    w: CudaSlice<bf16>,
    out: Vec<CudaSlice<bf16>>,
}

impl Tunable for RmsNorm {
    type Key = RowsKey;
    type Workload = RmsNormWorkload;

    fn bucket(key: &RowsKey) -> RowsKey {
        key.bucketed()
    }

    /// Every variant the width allows; for at most [`crate::rms_norm::FEW_ROWS`] rows the one
    /// that holds the row in registers comes first (the untuned choice: one round trip to
    /// memory per row matters more than bandwidth there).
    fn candidates(key: &RowsKey) -> Vec<Self::Params> {
        let mut all: Vec<_> = Self::space().into_iter().filter(|p| !p.vec || key.n % 8 == 0).collect();
        if key.rows <= crate::rms_norm::FEW_ROWS {
            if let Some(h) = crate::rms_norm::row_holder(&all, key.n) {
                all.retain(|p| *p != h);
                all.insert(0, h);
            }
        }
        all
    }

    fn cost(key: &RowsKey) -> Cost {
        Cost {
            bytes: 2.0 * (2 * key.rows * key.n + key.n) as f64,
            flops: 0.0,
        }
    }

    fn workload(
        gpu: &Gpu,
        pool: &mut DevicePool,
        key: &RowsKey,
        copies: usize,
        seed: u64,
    ) -> Result<RmsNormWorkload, RuntimeError> {
        let fills = Fills::get(gpu, pool)?;
        let n = key.rows * key.n;
        Ok(RmsNormWorkload {
            key: *key,
            x: fills.bf16_sets(gpu, copies, n, seed, (-2.0, 2.0))?,
            w: fills.bf16(gpu, key.n, seed.wrapping_sub(1), (0.5, 1.5))?,
            out: zeros(gpu, copies, n)?,
        })
    }

    fn run(gpu: &Gpu, k: &CompiledKernel<Self>, w: &mut RmsNormWorkload, i: usize) -> Result<(), RuntimeError> {
        let RowsKey { rows, n } = w.key;
        let (x, out) = (&w.x[i % w.x.len()], &mut w.out[i % w.x.len()]);
        let weight = &w.w;
        RmsNormOp {
            x,
            weight,
            out,
            rows,
            n,
            eps: 1e-6,
        }
        .launch(k, gpu.stream())
    }

    fn check_key(key: &RowsKey) -> RowsKey {
        key.fewer_rows(4)
    }

    fn check(gpu: &Gpu, p: &Self::Params, key: &RowsKey, seed: u64) -> Result<Verdict, RuntimeError> {
        check::rms_norm(
            &check::Target::Gpu(gpu),
            p,
            key.rows,
            key.n,
            &mut StdRng::seed_from_u64(seed),
        )
        .map(verdict)
        .map_err(Into::into)
    }
}
