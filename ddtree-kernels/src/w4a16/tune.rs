//! [`Tunable`] for the W4A16 GEMV: problem key, candidates, timing workload (see [`crate::tune`]).

use std::fmt;
use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::CudaSlice;
use ddtree_runtime::{
    bucket_pow2, l2_bytes, rotation_copies, CompiledKernel, Cost, DevicePool, Gpu, RuntimeError, Tunable, Verdict,
};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::check;
#[allow(unused_imports)]
use crate::tune::*;
use crate::w4a16::gemv::{self as w4gemv, GemvMode, GemvW4Params, W4a16Gemv};
use crate::w4a16::layout::interleaved_words;
use crate::w4a16::op::DenseGemvOp;

/// A dense W4A16 linear at a few tokens ([`W4a16Gemv`] in [`GemvMode::Dense`]): `out[tokens, n]
/// = x[tokens, k] . dequant(W)[n, k]^T`, INT4 with a bf16 scale per `group` along K. Tokens are
/// bucketed to powers of two (the GEMV takes at most `8 chunks` = 16; larger buckets have no
/// candidates).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct W4GemvKey {
    /// Tokens (rows of x and out).
    pub tokens: usize,
    /// Output features (weight rows).
    pub n: usize,
    /// Input features (the reduction length, a multiple of 32 and of the group).
    pub k: usize,
    /// Scale group size along K (32, 64 or 128; other groups have no candidates).
    pub group: usize,
}

impl fmt::Display for W4GemvKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "dense tokens={} n={} k={} group={}",
            self.tokens, self.n, self.k, self.group
        )
    }
}

/// The interleaved INT4 weight words and bf16 scale words of one `[n, k]` weight.
/// Packed INT4 weights and their scale words, one rotated copy.
pub(super) type W4Weights = (CudaSlice<u32>, CudaSlice<u32>);

/// Bytes and FLOPs of a W4A16 product of `rows` bf16 rows with an INT4 `[n, k]` weight of scale
/// group `group` (packed weights, bf16 scales, activations in, bf16 out).
pub(super) fn int4_cost(rows: usize, n: usize, k: usize, group: usize) -> Cost {
    Cost {
        bytes: (n * k / 2 + 2 * (n * k / group.max(1)) + 2 * rows * k + 2 * rows * n) as f64,
        flops: 2.0 * (rows * n * k) as f64,
    }
}

/// Random INT4 weights and scale words for an `[n, k]` weight of group `group`, as many copies
/// as rotate past the L2, shared through `pool` by every W4A16 tuning job of that shape (any
/// word is 8 valid INT4 codes and any scale word two bf16: the speed does not depend on them).
pub(super) fn int4_weights(
    gpu: &Gpu,
    pool: &mut DevicePool,
    n: usize,
    k: usize,
    group: usize,
    seed: u64,
) -> Result<Arc<Vec<W4Weights>>, RuntimeError> {
    let fills = Fills::get(gpu, pool)?;
    let (words, scale_words) = (interleaved_words(n, k), (n * k / group.max(1)).div_ceil(2));
    let bytes = 4 * (words + scale_words);
    let sets = rotation_copies(l2_bytes(gpu), bytes as f64);
    let name = format!("w4a16.w n={n} k={k} group={group}");
    pool.get_or_try_insert(&name, bytes * sets, || {
        (0..sets as u64)
            .map(|c| {
                let s = seed.wrapping_sub(1).wrapping_add(2 * c);
                Ok((fills.u32(gpu, words, s)?, fills.u32(gpu, scale_words, s + 1)?))
            })
            .collect::<Result<Vec<_>, RuntimeError>>()
    })
}

/// Dense W4A16 GEMV timing buffers: rotated activations and outputs, the weights (random words
/// in as many copies as rotate past the L2) shared by every token bucket, and the unused
/// routing buffers.
pub struct W4GemvWorkload {
    key: W4GemvKey,
    x: Vec<CudaSlice<bf16>>,
    w: Arc<Vec<W4Weights>>,
    out: Vec<CudaSlice<bf16>>,
    ids: CudaSlice<u32>,
    route_w: CudaSlice<f32>,
}

impl Tunable for W4a16Gemv {
    type Key = W4GemvKey;
    type Workload = W4GemvWorkload;

    fn bucket(key: &W4GemvKey) -> W4GemvKey {
        W4GemvKey {
            tokens: bucket_pow2(key.tokens),
            ..*key
        }
    }

    /// The dense variants of the key's group that take `key.tokens` tokens, the mode's default
    /// for that many ([`w4gemv::default_params`]) first; none where the group is not 32, 64 or
    /// 128 or `k` is not a multiple of 32 and of the group.
    fn candidates(key: &W4GemvKey) -> Vec<GemvW4Params> {
        let tokens = key.tokens as u32;
        if !w4gemv::takes_group(key.group) || key.k % 32 != 0 || key.k % key.group != 0 {
            return Vec::new();
        }
        let group = key.group as u32;
        let mut all: Vec<GemvW4Params> = Self::space()
            .into_iter()
            .filter(|p| p.mode == GemvMode::Dense && p.group == group && w4gemv::max_tokens(p) >= tokens)
            .collect();
        if let Some(d) = w4gemv::default_params(GemvMode::Dense, group, tokens) {
            all.retain(|p| *p != d);
            all.insert(0, d);
        }
        all
    }

    fn cost(key: &W4GemvKey) -> Cost {
        let W4GemvKey { tokens, n, k, group } = *key;
        int4_cost(tokens, n, k, group)
    }

    fn workload(
        gpu: &Gpu,
        pool: &mut DevicePool,
        key: &W4GemvKey,
        copies: usize,
        seed: u64,
    ) -> Result<W4GemvWorkload, RuntimeError> {
        let fills = Fills::get(gpu, pool)?;
        let W4GemvKey { tokens, n, k, group } = *key;
        let w = int4_weights(gpu, pool, n, k, group, seed)?;
        Ok(W4GemvWorkload {
            key: *key,
            x: fills.bf16_sets(gpu, copies, tokens * k, seed, (-1.0, 1.0))?,
            w,
            out: zeros(gpu, copies, tokens * n)?,
            ids: upload(gpu, &[0u32])?,
            route_w: upload(gpu, &[0f32])?,
        })
    }

    fn run(gpu: &Gpu, kern: &CompiledKernel<Self>, w: &mut W4GemvWorkload, i: usize) -> Result<(), RuntimeError> {
        let W4GemvKey { tokens, n, k, .. } = w.key;
        let (x, (wq, sc)) = (&w.x[i % w.x.len()], &w.w[i % w.w.len()]);
        let c = i % w.out.len();
        DenseGemvOp {
            x,
            w: wq,
            scales: sc,
            out: &mut w.out[c],
            rows: tokens,
            n,
            k,
            unused_u32: &w.ids,
            unused_f32: &w.route_w,
        }
        .launch(kern, gpu.stream())
    }

    fn check_key(key: &W4GemvKey) -> W4GemvKey {
        // Ragged against 16- and 32-row blocks (128 rows plus 8), full reduction length.
        W4GemvKey {
            n: key.n.min(136),
            ..*key
        }
    }

    fn check(gpu: &Gpu, p: &GemvW4Params, key: &W4GemvKey, seed: u64) -> Result<Verdict, RuntimeError> {
        crate::w4a16::check::gemv_dense(
            &check::Target::Gpu(gpu),
            p,
            key.tokens,
            key.n,
            key.k,
            &mut StdRng::seed_from_u64(seed),
        )
        .map(verdict)
        .map_err(Into::into)
    }
}
