//! [`Tunable`] for the bf16 tile GEMM: problem key, candidates, timing workload (see [`crate::tune`]).

use std::fmt;
use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::CudaSlice;
use ddtree_runtime::{bucket_pow2, CompiledKernel, Cost, DevicePool, Gpu, RuntimeError, Tunable, Verdict};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::check;
use crate::gemm_bf16::op::GemmBf16Op;
#[allow(unused_imports)]
use crate::tune::*;
use crate::GemmBf16;

/// `c[m, n] = a[m, k] . b[n, k]^T` in bf16 (a Linear layer: `m` tokens, `n` outputs, `k`
/// inputs). `m` is bucketed to powers of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmKey {
    /// Rows of A and C (tokens).
    pub m: usize,
    /// Rows of B, columns of C (output features).
    pub n: usize,
    /// The reduction length (input features).
    pub k: usize,
}

impl fmt::Display for GemmKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "m={} n={} k={}", self.m, self.n, self.k)
    }
}

/// GEMM timing buffers: rotated activations and outputs, the weights shared by every M bucket.
pub struct GemmWorkload {
    key: GemmKey,
    a: Vec<CudaSlice<bf16>>,
    b: Arc<Vec<CudaSlice<bf16>>>,
    c: Vec<CudaSlice<bf16>>,
}

impl Tunable for GemmBf16 {
    type Key = GemmKey;
    type Workload = GemmWorkload;

    fn bucket(key: &GemmKey) -> GemmKey {
        GemmKey {
            m: bucket_pow2(key.m),
            ..*key
        }
    }

    fn candidates(key: &GemmKey) -> Vec<Self::Params> {
        // Every tile shape handles any m and n; the cp.async loads need k % 8 == 0.
        if key.k % 8 == 0 {
            Self::space()
        } else {
            Vec::new()
        }
    }

    fn cost(key: &GemmKey) -> Cost {
        let GemmKey { m, n, k } = *key;
        Cost {
            bytes: 2.0 * (m * k + n * k + m * n) as f64,
            flops: 2.0 * (m * n * k) as f64,
        }
    }

    fn workload(
        gpu: &Gpu,
        pool: &mut DevicePool,
        key: &GemmKey,
        copies: usize,
        seed: u64,
    ) -> Result<GemmWorkload, RuntimeError> {
        let fills = Fills::get(gpu, pool)?;
        let GemmKey { m, n, k } = *key;
        let name = format!("gemm_bf16.b n={n} k={k}");
        Ok(GemmWorkload {
            key: *key,
            a: fills.bf16_sets(gpu, copies, m * k, seed, (-1.0, 1.0))?,
            b: fills.shared_bf16(gpu, pool, name, n * k, seed.wrapping_sub(1), (-1.0, 1.0))?,
            c: zeros(gpu, copies, m * n)?,
        })
    }

    fn run(gpu: &Gpu, k: &CompiledKernel<Self>, w: &mut GemmWorkload, i: usize) -> Result<(), RuntimeError> {
        let GemmKey { m, n, k: kd } = w.key;
        let (a, b) = (&w.a[i % w.a.len()], &w.b[i % w.b.len()]);
        let c = i % w.c.len();
        GemmBf16Op {
            a,
            b,
            c: &mut w.c[c],
            m,
            n,
            k: kd,
        }
        .launch(k, gpu.stream())
    }

    fn check_key(key: &GemmKey) -> GemmKey {
        // Ragged in m and n against every tile (one 128-wide tile plus 8), full reduction length.
        GemmKey {
            m: key.m.min(40),
            n: key.n.min(136),
            k: key.k,
        }
    }

    fn check(gpu: &Gpu, p: &Self::Params, key: &GemmKey, seed: u64) -> Result<Verdict, RuntimeError> {
        check::gemm(
            &check::Target::Gpu(gpu),
            p,
            key.m,
            key.n,
            key.k,
            &mut StdRng::seed_from_u64(seed),
        )
        .map(verdict)
        .map_err(Into::into)
    }
}
