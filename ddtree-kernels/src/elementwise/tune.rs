//! [`Tunable`] for SiLU-and-mul and RoPE: problem key, candidates, timing workload (see [`crate::tune`]).

use std::fmt;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::CudaSlice;
use ddtree_runtime::{bucket_pow2, CompiledKernel, Cost, DevicePool, Gpu, RuntimeError, Tunable, Verdict};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::check;
use crate::elementwise::op::{RopeOp, SiluMulOp};
#[allow(unused_imports)]
use crate::tune::*;
use crate::{RopeInterleaved, SiluMul};

/// SiLU-and-mul timing buffers.
pub struct SiluMulWorkload {
    key: RowsKey,
    gate_up: Vec<CudaSlice<bf16>>,
    out: Vec<CudaSlice<bf16>>,
}

impl Tunable for SiluMul {
    type Key = RowsKey;
    type Workload = SiluMulWorkload;

    fn bucket(key: &RowsKey) -> RowsKey {
        key.bucketed()
    }

    fn candidates(key: &RowsKey) -> Vec<Self::Params> {
        Self::space().into_iter().filter(|p| !p.vec || key.n % 8 == 0).collect()
    }

    fn cost(key: &RowsKey) -> Cost {
        Cost {
            bytes: 2.0 * (3 * key.rows * key.n) as f64,
            flops: 0.0,
        }
    }

    fn workload(
        gpu: &Gpu,
        pool: &mut DevicePool,
        key: &RowsKey,
        copies: usize,
        seed: u64,
    ) -> Result<SiluMulWorkload, RuntimeError> {
        let fills = Fills::get(gpu, pool)?;
        Ok(SiluMulWorkload {
            key: *key,
            gate_up: fills.bf16_sets(gpu, copies, 2 * key.rows * key.n, seed, (-4.0, 4.0))?,
            out: zeros(gpu, copies, key.rows * key.n)?,
        })
    }

    fn run(gpu: &Gpu, k: &CompiledKernel<Self>, w: &mut SiluMulWorkload, i: usize) -> Result<(), RuntimeError> {
        let RowsKey { rows, n } = w.key;
        let (gate_up, out) = (&w.gate_up[i % w.gate_up.len()], &mut w.out[i % w.gate_up.len()]);
        SiluMulOp {
            gate_up,
            out,
            rows,
            d: n,
        }
        .launch(k, gpu.stream())
    }

    fn check_key(key: &RowsKey) -> RowsKey {
        key.fewer_rows(4)
    }

    fn check(gpu: &Gpu, p: &Self::Params, key: &RowsKey, seed: u64) -> Result<Verdict, RuntimeError> {
        check::silu_mul(
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

/// RoPE over `tokens` x `heads` rows of `stride` bf16, rotating `dim` values from `offset` in the
/// pair layout `interleave` (Kimi: q rows `heads=64 stride=192 offset=128`, the k_pe row `heads=1
/// stride=576 offset=512`, `dim=64`, interleaved). Tokens are bucketed to powers of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RopeKey {
    /// Tokens.
    pub tokens: usize,
    /// Heads per token.
    pub heads: usize,
    /// Elements per row.
    pub stride: usize,
    /// First rotated element of a row.
    pub offset: usize,
    /// Rotated elements per row.
    pub dim: usize,
    /// Pair layout ([`crate::RopeParams::interleave`]).
    pub interleave: bool,
}

impl fmt::Display for RopeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let RopeKey {
            tokens,
            heads,
            stride,
            offset,
            dim,
            interleave,
        } = self;
        write!(
            f,
            "tokens={tokens} heads={heads} stride={stride} offset={offset} dim={dim} interleave={interleave}"
        )
    }
}

/// Positions in the timing tables (as in the check).
const ROPE_MAX_POS: usize = 4096;

/// RoPE timing buffers (rotated in place, which does not change the speed).
pub struct RopeWorkload {
    key: RopeKey,
    x: Vec<CudaSlice<bf16>>,
    positions: CudaSlice<u32>,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

impl Tunable for RopeInterleaved {
    type Key = RopeKey;
    type Workload = RopeWorkload;

    fn bucket(key: &RopeKey) -> RopeKey {
        RopeKey {
            tokens: bucket_pow2(key.tokens),
            ..*key
        }
    }

    fn candidates(key: &RopeKey) -> Vec<Self::Params> {
        Self::space()
            .into_iter()
            .filter(|p| p.dim as usize == key.dim && p.interleave == key.interleave)
            .collect()
    }

    fn cost(key: &RopeKey) -> Cost {
        let rotated = 2.0 * 2.0 * (key.tokens * key.heads * key.dim) as f64;
        let tables = 2.0 * 4.0 * (key.tokens * key.dim / 2) as f64 + 4.0 * key.tokens as f64;
        Cost {
            bytes: rotated + tables,
            flops: 0.0,
        }
    }

    fn workload(
        gpu: &Gpu,
        pool: &mut DevicePool,
        key: &RopeKey,
        copies: usize,
        seed: u64,
    ) -> Result<RopeWorkload, RuntimeError> {
        let fills = Fills::get(gpu, pool)?;
        let mut rng = StdRng::seed_from_u64(seed);
        let positions: Vec<u32> = (0..key.tokens)
            .map(|_| rng.random_range(0..ROPE_MAX_POS as u32))
            .collect();
        let table = ROPE_MAX_POS * key.dim / 2;
        Ok(RopeWorkload {
            key: *key,
            x: fills.bf16_sets(gpu, copies, key.tokens * key.heads * key.stride, seed, (-2.0, 2.0))?,
            positions: upload(gpu, &positions)?,
            cos: fills.f32(gpu, table, seed, (-1.0, 1.0))?,
            sin: fills.f32(gpu, table, seed + 1, (-1.0, 1.0))?,
        })
    }

    fn run(gpu: &Gpu, k: &CompiledKernel<Self>, w: &mut RopeWorkload, i: usize) -> Result<(), RuntimeError> {
        let RopeKey {
            tokens,
            heads,
            stride,
            offset,
            ..
        } = w.key;
        let rows = tokens * heads;
        let copies = w.x.len();
        let (x, pos, cos, sin) = (&mut w.x[i % copies], &w.positions, &w.cos, &w.sin);
        let op = RopeOp {
            x,
            positions: pos,
            cos,
            sin,
            rows,
            heads,
            stride,
            offset,
            grid: None,
        };
        // SAFETY: the tables hold ROPE_MAX_POS * dim / 2 values and positions are below
        // ROPE_MAX_POS.
        unsafe { op.launch(k, gpu.stream()) }
    }

    fn check_key(key: &RopeKey) -> RopeKey {
        RopeKey {
            tokens: key.tokens.min(4),
            ..*key
        }
    }

    fn check(gpu: &Gpu, p: &Self::Params, key: &RopeKey, seed: u64) -> Result<Verdict, RuntimeError> {
        let mut rng = StdRng::seed_from_u64(seed);
        check::rope(
            &check::Target::Gpu(gpu),
            p,
            key.tokens,
            key.heads,
            key.stride,
            key.offset,
            &mut rng,
        )
        .map(verdict)
        .map_err(Into::into)
    }
}
