//! [`Tunable`] for row top-k: problem key, candidates, timing workload (see [`crate::tune`]).

use std::fmt;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::CudaSlice;
use ddtree_runtime::{bucket_pow2, CompiledKernel, Cost, DevicePool, Gpu, RuntimeError, Tunable, Verdict};
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::check;
use crate::topk::RowTopkOp;
#[allow(unused_imports)]
use crate::tune::*;
use crate::{RowTopk, TopkParams};

/// Top-`k` of `rows` rows of `n` f32 logits (Kimi: `n = 163840`). Rows are bucketed to powers
/// of two; only variants built for this `k` are candidates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TopkKey {
    /// Rows.
    pub rows: usize,
    /// Row length.
    pub n: usize,
    /// Entries kept per row.
    pub k: usize,
}

impl fmt::Display for TopkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rows={} n={} k={}", self.rows, self.n, self.k)
    }
}

/// Top-k timing buffers.
pub struct TopkWorkload {
    key: TopkKey,
    logits: Vec<CudaSlice<f32>>,
    values: Vec<CudaSlice<f32>>,
    indices: Vec<CudaSlice<u32>>,
}

impl Tunable for RowTopk {
    type Key = TopkKey;
    type Workload = TopkWorkload;

    fn bucket(key: &TopkKey) -> TopkKey {
        TopkKey {
            rows: bucket_pow2(key.rows),
            ..*key
        }
    }

    fn candidates(key: &TopkKey) -> Vec<TopkParams> {
        Self::space()
            .into_iter()
            .filter(|p| p.k as usize == key.k && key.n >= key.k)
            .collect()
    }

    fn cost(key: &TopkKey) -> Cost {
        Cost {
            bytes: 4.0 * (key.rows * key.n) as f64 + 8.0 * (key.rows * key.k) as f64,
            flops: 0.0,
        }
    }

    fn workload(
        gpu: &Gpu,
        pool: &mut DevicePool,
        key: &TopkKey,
        copies: usize,
        seed: u64,
    ) -> Result<TopkWorkload, RuntimeError> {
        let fills = Fills::get(gpu, pool)?;
        Ok(TopkWorkload {
            key: *key,
            logits: (0..copies.max(1) as u64)
                .map(|c| fills.f32(gpu, key.rows * key.n, seed + c, (-20.0, 20.0)))
                .collect::<Result<_, _>>()?,
            values: zeros(gpu, copies, key.rows * key.k)?,
            indices: zeros(gpu, copies, key.rows * key.k)?,
        })
    }

    fn run(gpu: &Gpu, k: &CompiledKernel<Self>, w: &mut TopkWorkload, i: usize) -> Result<(), RuntimeError> {
        let TopkKey { rows, n, .. } = w.key;
        let c = i % w.logits.len();
        let (logits, values, indices) = (&w.logits[c], &mut w.values[c], &mut w.indices[c]);
        RowTopkOp {
            logits,
            values,
            indices,
            rows,
            n,
        }
        .launch(k, gpu.stream())
    }

    fn check_key(key: &TopkKey) -> TopkKey {
        TopkKey {
            rows: key.rows.min(2),
            ..*key
        }
    }

    fn check(gpu: &Gpu, p: &TopkParams, key: &TopkKey, seed: u64) -> Result<Verdict, RuntimeError> {
        check::topk(
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
