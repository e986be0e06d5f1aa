//! [`Tunable`] for the embedding gather: problem key, candidates, timing workload (see [`crate::tune`]).

use std::fmt;
use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::CudaSlice;
use ddtree_runtime::{bucket_pow2, CompiledKernel, Cost, DevicePool, Gpu, RuntimeError, Tunable, Verdict};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::check;
use crate::embedding::op::EmbeddingOp;
#[allow(unused_imports)]
use crate::tune::*;
use crate::Embedding;

/// An embedding gather of `tokens` ids from a `vocab` x `hidden` table. Tokens are bucketed to
/// powers of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EmbeddingKey {
    /// Tokens gathered.
    pub tokens: usize,
    /// Table rows.
    pub vocab: usize,
    /// Row width.
    pub hidden: usize,
}

impl fmt::Display for EmbeddingKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tokens={} vocab={} hidden={}", self.tokens, self.vocab, self.hidden)
    }
}

/// Embedding timing buffers: the table (shared by every token bucket; the real one is far larger
/// than L2), rotated ids.
pub struct EmbeddingWorkload {
    key: EmbeddingKey,
    table: Arc<Vec<CudaSlice<bf16>>>,
    ids: Vec<CudaSlice<u32>>,
    out: Vec<CudaSlice<bf16>>,
}

impl Tunable for Embedding {
    type Key = EmbeddingKey;
    type Workload = EmbeddingWorkload;

    fn bucket(key: &EmbeddingKey) -> EmbeddingKey {
        EmbeddingKey {
            tokens: bucket_pow2(key.tokens),
            ..*key
        }
    }

    fn candidates(key: &EmbeddingKey) -> Vec<Self::Params> {
        Self::space()
            .into_iter()
            .filter(|p| !p.vec || key.hidden % 8 == 0)
            .collect()
    }

    fn cost(key: &EmbeddingKey) -> Cost {
        Cost {
            bytes: 2.0 * 2.0 * (key.tokens * key.hidden) as f64 + 4.0 * key.tokens as f64,
            flops: 0.0,
        }
    }

    fn workload(
        gpu: &Gpu,
        pool: &mut DevicePool,
        key: &EmbeddingKey,
        copies: usize,
        seed: u64,
    ) -> Result<EmbeddingWorkload, RuntimeError> {
        let fills = Fills::get(gpu, pool)?;
        let mut rng = StdRng::seed_from_u64(seed);
        let ids: Vec<Vec<u32>> = (0..copies.max(1))
            .map(|_| (0..key.tokens).map(|_| rng.random_range(0..key.vocab as u32)).collect())
            .collect();
        let name = format!("embedding.table vocab={} hidden={}", key.vocab, key.hidden);
        Ok(EmbeddingWorkload {
            key: *key,
            table: fills.shared_bf16(gpu, pool, name, key.vocab * key.hidden, seed, (-1.0, 1.0))?,
            ids: ids.iter().map(|v| upload(gpu, v)).collect::<Result<_, _>>()?,
            out: zeros(gpu, copies, key.tokens * key.hidden)?,
        })
    }

    fn run(gpu: &Gpu, k: &CompiledKernel<Self>, w: &mut EmbeddingWorkload, i: usize) -> Result<(), RuntimeError> {
        let EmbeddingKey { tokens, vocab, hidden } = w.key;
        let copies = w.ids.len();
        let (ids, out) = (&w.ids[i % copies], &mut w.out[i % copies]);
        let table = &w.table[i % w.table.len()];
        EmbeddingOp {
            ids,
            table,
            out,
            rows: tokens,
            hidden,
            vocab,
        }
        .launch(k, gpu.stream())
    }

    fn check_key(key: &EmbeddingKey) -> EmbeddingKey {
        // The gather does not depend on the table's length; a small table keeps the check fast.
        EmbeddingKey {
            tokens: key.tokens.min(8),
            vocab: key.vocab.min(512),
            hidden: key.hidden,
        }
    }

    fn check(gpu: &Gpu, p: &Self::Params, key: &EmbeddingKey, seed: u64) -> Result<Verdict, RuntimeError> {
        let mut rng = StdRng::seed_from_u64(seed);
        check::embedding(&check::Target::Gpu(gpu), p, key.tokens, key.vocab, key.hidden, &mut rng)
            .map(verdict)
            .map_err(Into::into)
    }
}
