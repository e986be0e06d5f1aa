//! [`Tunable`] for the absorbed-MLA query kernel the engine runs for a few tokens
//! ([`MlaAbsorbQuery`]: `W_UK` absorbed into the query, the rope fused): problem key,
//! candidates (the variants of the key's head dims and rope layout whose columns divide the
//! latent width, in the parameter space's order: index 0 is the engine's untuned pick, the
//! first that fits), timing workload.

use std::fmt;
use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::CudaSlice;
use ddtree_runtime::{bucket_pow2, CompiledKernel, Cost, DevicePool, Gpu, RuntimeError, Tunable, Verdict};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::attention::mla_absorb::MlaQueryParams;
use crate::attention::op::MlaAbsorbQueryOp;
use crate::check;
#[allow(unused_imports)]
use crate::tune::*;
use crate::MlaAbsorbQuery;

/// Rows of the timing workload's rope tables (every position of the workload is below).
const TABLE_ROWS: usize = 64;

/// An absorbed MLA query: `rows` tokens (bucketed to powers of two) of `heads` heads of `nope`
/// non-rope and `rope` rope dims, latent width `lora`, `v` value dims per head (the head
/// stride of `kv_b`), rope pairs interleaved or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MlaQueryKey {
    /// Tokens.
    pub rows: usize,
    /// Attention heads.
    pub heads: usize,
    /// Latent width (`kv_lora_rank`).
    pub lora: usize,
    /// Non-rope query dims per head.
    pub nope: usize,
    /// Rope dims per head.
    pub rope: usize,
    /// Value dims per head.
    pub v: usize,
    /// Adjacent rope pairs (true) or rotate-half pairs.
    pub interleave: bool,
}

impl fmt::Display for MlaQueryKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rows={} heads={} lora={} nope={} rope={} v={} interleave={}",
            self.rows, self.heads, self.lora, self.nope, self.rope, self.v, self.interleave
        )
    }
}

/// Absorbed-query timing buffers: rotated queries and outputs, the `kv_b` weight (shared
/// through the pool), positions and rope tables.
pub struct MlaQueryWorkload {
    key: MlaQueryKey,
    q: Vec<CudaSlice<bf16>>,
    kv_b: Arc<Vec<CudaSlice<bf16>>>,
    positions: CudaSlice<u32>,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    out: Vec<CudaSlice<bf16>>,
}

impl Tunable for MlaAbsorbQuery {
    type Key = MlaQueryKey;
    type Workload = MlaQueryWorkload;

    fn bucket(key: &MlaQueryKey) -> MlaQueryKey {
        MlaQueryKey {
            rows: bucket_pow2(key.rows),
            ..*key
        }
    }

    /// The variants of the key's `nope`, `rope` and pair layout whose `cols` divide `lora`, in
    /// the space's order (the engine's untuned pick first); none where `lora % 8 != 0`.
    fn candidates(key: &MlaQueryKey) -> Vec<MlaQueryParams> {
        if key.lora % 8 != 0 {
            return Vec::new();
        }
        Self::space()
            .into_iter()
            .filter(|p| {
                (p.nope as usize, p.rope as usize, p.interleave) == (key.nope, key.rope, key.interleave)
                    && key.lora % p.cols as usize == 0
            })
            .collect()
    }

    fn cost(key: &MlaQueryKey) -> Cost {
        let MlaQueryKey {
            rows,
            heads,
            lora,
            nope,
            rope,
            ..
        } = *key;
        Cost {
            bytes: (2 * heads * nope * lora + 2 * rows * heads * (nope + rope) + 2 * rows * heads * (lora + rope))
                as f64,
            flops: 2.0 * (rows * heads * nope * lora) as f64,
        }
    }

    fn workload(
        gpu: &Gpu,
        pool: &mut DevicePool,
        key: &MlaQueryKey,
        copies: usize,
        seed: u64,
    ) -> Result<MlaQueryWorkload, RuntimeError> {
        let fills = Fills::get(gpu, pool)?;
        let MlaQueryKey {
            rows,
            heads,
            lora,
            nope,
            rope,
            v,
            ..
        } = *key;
        let name = format!("mla_absorb_query.kv_b heads={heads} lora={lora} nope={nope} v={v}");
        let kv_b = fills.shared_bf16(
            gpu,
            pool,
            name,
            heads * (nope + v) * lora,
            seed.wrapping_sub(1),
            (-1.0, 1.0),
        )?;
        let positions: Vec<u32> = (0..rows).map(|t| (t % TABLE_ROWS) as u32).collect();
        let half = (rope / 2).max(1);
        Ok(MlaQueryWorkload {
            key: *key,
            q: fills.bf16_sets(gpu, copies, rows * heads * (nope + rope), seed, (-1.0, 1.0))?,
            kv_b,
            positions: upload(gpu, &positions)?,
            cos: fills.f32(gpu, TABLE_ROWS * half, seed.wrapping_add(11), (-1.0, 1.0))?,
            sin: fills.f32(gpu, TABLE_ROWS * half, seed.wrapping_add(12), (-1.0, 1.0))?,
            out: zeros(gpu, copies, rows * heads * (lora + rope))?,
        })
    }

    fn run(gpu: &Gpu, kern: &CompiledKernel<Self>, w: &mut MlaQueryWorkload, i: usize) -> Result<(), RuntimeError> {
        let MlaQueryKey {
            rows, heads, lora, v, ..
        } = w.key;
        let c = i % w.out.len();
        let op = MlaAbsorbQueryOp {
            q: &w.q[i % w.q.len()],
            kv_b: &w.kv_b[i % w.kv_b.len()],
            positions: &w.positions,
            cos: &w.cos,
            sin: &w.sin,
            out: &mut w.out[c],
            rows,
            heads,
            lora,
            v,
        };
        // SAFETY: every position is below TABLE_ROWS, the tables' rows.
        unsafe { op.launch(kern, gpu.stream()) }
    }

    fn check_key(key: &MlaQueryKey) -> MlaQueryKey {
        // Fewer heads, the full latent width and head dims.
        MlaQueryKey {
            heads: key.heads.min(3),
            ..*key
        }
    }

    fn check(gpu: &Gpu, p: &MlaQueryParams, key: &MlaQueryKey, seed: u64) -> Result<Verdict, RuntimeError> {
        crate::attention::check::mla_absorb_query(
            &check::Target::Gpu(gpu),
            p,
            key.rows,
            key.heads,
            key.lora,
            key.v,
            &mut StdRng::seed_from_u64(seed),
        )
        .map(verdict)
        .map_err(Into::into)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kimi_candidates_fit_and_keep_the_space_order() {
        let key = MlaQueryKey {
            rows: 3,
            heads: 64,
            lora: 512,
            nope: 128,
            rope: 64,
            v: 128,
            interleave: true,
        };
        let c = MlaAbsorbQuery::candidates(&MlaAbsorbQuery::bucket(&key));
        assert_eq!(c.len(), 4);
        let first = MlaAbsorbQuery::space()
            .into_iter()
            .find(|p| (p.nope, p.rope, p.interleave) == (128, 64, true) && 512 % p.cols == 0);
        assert_eq!(Some(c[0]), first);
        assert_eq!(MlaAbsorbQuery::bucket(&key).rows, 4);
        assert!(MlaAbsorbQuery::candidates(&MlaQueryKey { lora: 100, ..key }).is_empty());
    }
}
