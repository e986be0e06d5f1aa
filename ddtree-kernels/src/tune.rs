//! [`Tunable`] for the kernels of this crate: problem keys, candidate filters, timing inputs
//! and costs. Candidates are checked with the GPU-versus-CPU checks of [`crate::check`] (fresh
//! random inputs, poisoned outputs, the module's CPU reference), at a reduced key where the
//! reference would be slow.
//!
//! Timing inputs are random values generated on the GPU by the [`crate::fill`] kernels (content
//! does not change the speed of these kernels; GiB-sized weights fill in under a millisecond).
//! Weights and tables that do not depend on the token count come from the tuner's
//! [`DevicePool`], so every M bucket of a shape shares them.

use std::fmt;
use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use ddtree_runtime::{
    bucket_pow2, l2_bytes, rotation_copies, CompiledKernel, Cost, DevicePool, Gpu, Grid, RuntimeError, Tunable, Verdict,
};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::check::{self, CheckResult};
use crate::elementwise::op::{FillBf16Op, FillF32Op, FillU32Op};
use crate::embedding::op::EmbeddingOp;
use crate::fill::{self, FillParams, FILL_MAX};
use crate::norm::op::RmsNormOp;
use crate::topk::RowTopkOp;
use crate::tree::gpu::{builder_fits, GpuBuilder};
use crate::tree::{self, TreeBuild, TreeBuildParams, MAX_K};
use crate::w4a16::gemv::{self as w4gemv, GemvMode, GemvW4Params, W4a16Gemv};
use crate::w4a16::layout::interleaved_words;
use crate::{
    gemm_bf16, rope, silu_mul, Embedding, FillRandomBf16, FillRandomF32, FillRandomU32, GemmBf16, RmsNorm,
    RopeInterleaved, RowTopk, SiluMul, TopkParams,
};

fn drv(context: &'static str) -> impl FnOnce(ddtree_runtime::cudarc::driver::DriverError) -> RuntimeError {
    move |source| RuntimeError::Driver {
        context: context.to_string(),
        source,
    }
}

/// A device buffer of `n` elements filled on the GPU by `launch` (a fill kernel `K` over the
/// grid for `n`).
fn random<T, K>(
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
struct Fills {
    bf16: Arc<CompiledKernel<FillRandomBf16>>,
    f32: Arc<CompiledKernel<FillRandomF32>>,
    u32: Arc<CompiledKernel<FillRandomU32>>,
}

impl Fills {
    fn get(gpu: &Gpu, pool: &mut DevicePool) -> Result<Fills, RuntimeError> {
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
    fn bf16(&self, gpu: &Gpu, n: usize, seed: u64, (lo, hi): (f32, f32)) -> Result<CudaSlice<bf16>, RuntimeError> {
        let k = &*self.bf16;
        random(gpu, k, n, |out, _, n| {
            let (n, seed) = (n as usize, seed as u32);
            FillBf16Op { out, n, seed, lo, hi }.launch(k, gpu.stream())
        })
    }

    /// `n` random f32 in `[lo, hi)` from `seed`.
    fn f32(&self, gpu: &Gpu, n: usize, seed: u64, (lo, hi): (f32, f32)) -> Result<CudaSlice<f32>, RuntimeError> {
        let k = &*self.f32;
        random(gpu, k, n, |out, _, n| {
            let (n, seed) = (n as usize, seed as u32);
            FillF32Op { out, n, seed, lo, hi }.launch(k, gpu.stream())
        })
    }

    /// `n` random 32-bit words from `seed` (INT4 weight words: every word is 8 valid codes).
    fn u32(&self, gpu: &Gpu, n: usize, seed: u64) -> Result<CudaSlice<u32>, RuntimeError> {
        let k = &*self.u32;
        random(gpu, k, n, |out, _, n| {
            let (n, seed) = (n as usize, seed as u32);
            FillU32Op { out, n, seed }.launch(k, gpu.stream())
        })
    }

    /// `copies` buffers of `n` random bf16 in `range` (seeds `seed`, `seed + 1`, ...).
    fn bf16_sets(
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
    fn shared_bf16(
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
fn zeros<T: DeviceRepr + ValidAsZeroBits>(
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
fn upload<T: DeviceRepr>(gpu: &Gpu, v: &[T]) -> Result<CudaSlice<T>, RuntimeError> {
    gpu.stream().clone_htod(v).map_err(drv("copying a timing buffer"))
}

fn verdict(r: CheckResult) -> Verdict {
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
    fn bucketed(&self) -> RowsKey {
        RowsKey {
            rows: bucket_pow2(self.rows),
            n: self.n,
        }
    }

    fn fewer_rows(&self, max: usize) -> RowsKey {
        RowsKey {
            rows: self.rows.min(max),
            n: self.n,
        }
    }
}

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
        let grid = silu_mul::grid(k.params(), rows, n);
        let (x, out) = (&w.gate_up[i % w.gate_up.len()], &mut w.out[i % w.gate_up.len()]);
        // SAFETY: gate_up holds rows * 2n elements and out rows * n; vec candidates need n % 8 == 0.
        unsafe { SiluMul::launch(k, gpu.stream(), grid, x, out, rows as u32, n as u32) }
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
        let grid = rope::grid(k.params(), rows);
        // SAFETY: x holds rows * stride elements with offset + dim <= stride (the key's layout);
        // the tables hold ROPE_MAX_POS * dim / 2 values and positions are below ROPE_MAX_POS.
        unsafe {
            RopeInterleaved::launch(
                k,
                gpu.stream(),
                grid,
                x,
                pos,
                cos,
                sin,
                rows as u32,
                heads as u32,
                stride as u32,
                offset as u32,
            )
        }
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
        let grid = gemm_bf16::grid(k.params(), m, n);
        // SAFETY: a is m x k, b is n x k, c is m x n, k % 8 == 0 (the candidate filter).
        unsafe { GemmBf16::launch(k, gpu.stream(), grid, a, b, &mut w.c[c], m as u32, n as u32, kd as u32) }
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

/// A dense W4A16 linear at a few tokens ([`W4a16Gemv`] in [`GemvMode::Dense`]): `out[tokens, n]
/// = x[tokens, k] . dequant(W)[n, k]^T`, INT4 group 32. Tokens are bucketed to powers of two (the
/// GEMV takes at most `8 chunks` = 16; larger buckets have no candidates).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct W4GemvKey {
    /// Tokens (rows of x and out).
    pub tokens: usize,
    /// Output features (weight rows).
    pub n: usize,
    /// Input features (the reduction length, a multiple of 32).
    pub k: usize,
}

impl fmt::Display for W4GemvKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dense tokens={} n={} k={}", self.tokens, self.n, self.k)
    }
}

/// The interleaved INT4 weight words and bf16 scale words of one `[n, k]` g32 weight.
type W4Weights = (CudaSlice<u32>, CudaSlice<u32>);

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

    /// The dense variants that take `key.tokens` tokens, the mode's default for that many
    /// ([`w4gemv::default_params`]) first; none where `k` is not a multiple of the group (32).
    fn candidates(key: &W4GemvKey) -> Vec<GemvW4Params> {
        let tokens = key.tokens as u32;
        if key.k % 32 != 0 {
            return Vec::new();
        }
        let mut all: Vec<GemvW4Params> = Self::space()
            .into_iter()
            .filter(|p| p.mode == GemvMode::Dense && w4gemv::max_tokens(p) >= tokens)
            .collect();
        if let Some(d) = w4gemv::default_params(GemvMode::Dense, tokens) {
            all.retain(|p| *p != d);
            all.insert(0, d);
        }
        all
    }

    fn cost(key: &W4GemvKey) -> Cost {
        let W4GemvKey { tokens, n, k } = *key;
        Cost {
            bytes: (n * k / 2 + 2 * (n * k / 32) + 2 * tokens * k + 2 * tokens * n) as f64,
            flops: 2.0 * (tokens * n * k) as f64,
        }
    }

    fn workload(
        gpu: &Gpu,
        pool: &mut DevicePool,
        key: &W4GemvKey,
        copies: usize,
        seed: u64,
    ) -> Result<W4GemvWorkload, RuntimeError> {
        let fills = Fills::get(gpu, pool)?;
        let W4GemvKey { tokens, n, k } = *key;
        // Random words: any word is 8 valid INT4 codes, any scale word two bf16 (the speed does
        // not depend on the values).
        let (words, scale_words) = (interleaved_words(n, k), (n * k / 32).div_ceil(2));
        let bytes = 4 * (words + scale_words);
        let sets = rotation_copies(l2_bytes(gpu), bytes as f64);
        let name = format!("w4a16_gemv.w n={n} k={k}");
        let w = pool.get_or_try_insert(&name, bytes * sets, || {
            (0..sets as u64)
                .map(|c| {
                    let s = seed.wrapping_sub(1).wrapping_add(2 * c);
                    Ok((fills.u32(gpu, words, s)?, fills.u32(gpu, scale_words, s + 1)?))
                })
                .collect::<Result<Vec<_>, RuntimeError>>()
        })?;
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
        let W4GemvKey { tokens, n, k } = w.key;
        let (x, (wq, sc)) = (&w.x[i % w.x.len()], &w.w[i % w.w.len()]);
        let c = i % w.out.len();
        let grid = w4gemv::grid(kern.params(), n as u32, 1);
        // SAFETY: x is [tokens, k] with tokens <= 8 chunks (the candidate filter), the weights
        // are interleaved [n, k] words with the g32 scale words, out is [tokens, n]; the routing
        // buffers are unused by dense variants.
        unsafe {
            W4a16Gemv::launch(
                kern,
                gpu.stream(),
                grid,
                x,
                wq,
                sc,
                &w.ids,
                &w.route_w,
                &w.ids,
                &w.ids,
                &mut w.out[c],
                tokens as u32,
                n as u32,
                k as u32,
                1,
                1,
            )
        }
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

/// The GPU tree builder's problem: drafter logits for `depth` positions over `vocab` tokens
/// and a node budget. The budget is bucketed to powers of two (a variant that fits a budget
/// fits every smaller one); depth and vocabulary stay exact.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TreeBuildKey {
    /// Drafted positions (the tree's deepest level, `block_size - 1`).
    pub depth: usize,
    /// Vocabulary size (the logits' row length).
    pub vocab: usize,
    /// Node budget (root excluded), at most [`crate::tree::MAX_K`].
    pub budget: usize,
}

impl fmt::Display for TreeBuildKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "depth={} vocab={} budget={}", self.depth, self.vocab, self.budget)
    }
}

/// Tree builder timing buffers: random logits (uniform in [-12, 12), the checks' random
/// profile) in rotated copies, and one builder per candidate (their scratch and outputs are
/// sized by the variant's slice count).
pub struct TreeBuildWorkload {
    logits: Vec<CudaSlice<f32>>,
    root: CudaSlice<u32>,
    builders: Vec<GpuBuilder>,
}

impl Tunable for TreeBuild {
    type Key = TreeBuildKey;
    type Workload = TreeBuildWorkload;

    fn bucket(key: &TreeBuildKey) -> TreeBuildKey {
        TreeBuildKey {
            budget: bucket_pow2(key.budget).min(MAX_K),
            ..*key
        }
    }

    /// The variants that [fit](builder_fits) the key, in space order (the first is the
    /// builder's default): the sorted ones where any fits (at `k <= 64` the sorted merge was the
    /// faster path in every measured case, and builds that short are timed near the host's
    /// launch rate, too coarsely to rank them against the selecting merges), else the others.
    fn candidates(key: &TreeBuildKey) -> Vec<TreeBuildParams> {
        if key.depth == 0 || key.depth > 16 || key.vocab == 0 || key.budget == 0 || key.budget > MAX_K {
            return Vec::new();
        }
        let mut fit: Vec<TreeBuildParams> = Self::space()
            .into_iter()
            .filter(|p| builder_fits(p, key.vocab, key.budget))
            .collect();
        if fit.iter().any(|p| p.sorted) {
            fit.retain(|p| p.sorted);
        }
        fit
    }

    fn cost(key: &TreeBuildKey) -> Cost {
        Cost {
            bytes: 4.0 * (key.depth * key.vocab) as f64,
            flops: 0.0,
        }
    }

    fn workload(
        gpu: &Gpu,
        pool: &mut DevicePool,
        key: &TreeBuildKey,
        copies: usize,
        seed: u64,
    ) -> Result<TreeBuildWorkload, RuntimeError> {
        let fills = Fills::get(gpu, pool)?;
        let TreeBuildKey { depth, vocab, budget } = *key;
        Ok(TreeBuildWorkload {
            logits: (0..copies.max(1) as u64)
                .map(|c| fills.f32(gpu, depth * vocab, seed + c, (-12.0, 12.0)))
                .collect::<Result<_, _>>()?,
            root: upload(gpu, &[1u32])?,
            builders: Self::candidates(key)
                .iter()
                .map(|p| GpuBuilder::with_params(gpu, p, depth, vocab, budget))
                .collect::<Result<_, _>>()?,
        })
    }

    /// A build takes 15 to 30 µs below B = 128, about the spread of a single launch's timing.
    fn runs_per_sample() -> usize {
        16
    }

    fn run(gpu: &Gpu, kern: &CompiledKernel<Self>, w: &mut TreeBuildWorkload, i: usize) -> Result<(), RuntimeError> {
        let logits = &w.logits[i % w.logits.len()];
        let b = w
            .builders
            .iter_mut()
            .find(|b| b.params() == kern.params())
            .ok_or_else(|| RuntimeError::Launch {
                kernel: TreeBuild::symbol(kern.params()),
                reason: "not a candidate of this key".into(),
            })?;
        b.build_with(kern, gpu.stream(), logits, &w.root)
    }

    fn check(gpu: &Gpu, p: &TreeBuildParams, key: &TreeBuildKey, seed: u64) -> Result<Verdict, RuntimeError> {
        let mut rng = StdRng::seed_from_u64(seed);
        let results = tree::check::builder_variant(gpu, p, key.depth, key.vocab, key.budget, &mut rng)?;
        Ok(match results.iter().find(|r| !r.passed) {
            Some(bad) => verdict(bad.clone()),
            None => Verdict {
                passed: true,
                detail: format!("{} cases passed", results.len()),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        };
        let buckets: Vec<usize> = [0, 1, 3, 5, 8, 9, 16]
            .iter()
            .map(|&t| W4a16Gemv::bucket(&key(t)).tokens)
            .collect();
        assert_eq!(buckets, [1, 1, 4, 8, 8, 16, 16]);
        assert_eq!(W4a16Gemv::bucket(&key(3)).to_string(), "dense tokens=4 n=2048 k=7168");
        // Above 16 tokens the engine runs the tensor-core GEMM: no GEMV candidate.
        assert!(W4a16Gemv::candidates(&W4a16Gemv::bucket(&key(17))).is_empty());
    }

    #[test]
    fn w4_gemv_candidates_are_the_dense_space_with_the_default_first() {
        let dense = |t: u32| -> Vec<GemvW4Params> {
            w4gemv::GEMV_SPACE
                .iter()
                .filter(|p| p.mode == GemvMode::Dense && w4gemv::max_tokens(p) >= t)
                .copied()
                .collect()
        };
        for tokens in [1, 2, 4, 8, 16] {
            let c = W4a16Gemv::candidates(&W4GemvKey {
                tokens,
                n: 2048,
                k: 7168,
            });
            assert_eq!(Some(c[0]), w4gemv::default_params(GemvMode::Dense, tokens as u32));
            let mut sorted = c.clone();
            sorted.sort_by_key(|p| dense(tokens as u32).iter().position(|q| q == p));
            assert_eq!(
                sorted,
                dense(tokens as u32),
                "every dense variant that takes {tokens} tokens, once"
            );
        }
        assert!(W4a16Gemv::candidates(&W4GemvKey {
            tokens: 16,
            n: 2048,
            k: 7168
        })
        .iter()
        .all(|p| p.chunks >= 2));
        assert!(W4a16Gemv::candidates(&W4GemvKey {
            tokens: 1,
            n: 64,
            k: 100
        })
        .is_empty());
        let c = W4a16Gemv::check_key(&W4GemvKey {
            tokens: 16,
            n: 36864,
            k: 7168,
        });
        assert_eq!(
            c,
            W4GemvKey {
                tokens: 16,
                n: 136,
                k: 7168
            }
        );
        let cost = W4a16Gemv::cost(&W4GemvKey {
            tokens: 1,
            n: 64,
            k: 64,
        });
        assert_eq!((cost.bytes, cost.flops), ((2048 + 256 + 128 + 128) as f64, 8192.0));
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
