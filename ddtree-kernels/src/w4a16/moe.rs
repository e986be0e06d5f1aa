//! `moe_w4a16`: the routed-expert block for `T` tokens with top-k routing, on INT4 experts.
//!
//! 1. `moe_align` sorts the token-expert pairs by expert and pads each expert to blocks of
//!    [`gemm::rows_per_block`] slots (the per-expert block size), so each touched expert's weights are read
//!    once per n tile when its pairs fit one block;
//! 2. grouped gate_up `w4a16_gemm` (`N = 2 I`, SiLU-and-mul fused) into `act[pair, I]`;
//! 3. grouped down `w4a16_gemm` with the router weight applied into `y[pair, H]`;
//! 4. `moe_sum` adds the top-k rows of each token.
//!
//! For at most [`GEMV_MAX_TOKENS`] tokens (the decode step, small trees) [`MoeKernels::run`] takes the
//! small-token path instead: two [`W4a16Gemv`] launches straight from the routing (gate_up into
//! `act`, then down with the router weights and the top-k sum fused into `out`). Up to
//! [`GROUPED_GEMV_MAX_TOKENS`] it takes the grouped GEMV path: the steps above with the two
//! products as [`W4a16Gemv`]'s grouped modes (blocks of one chunk, 8 slots) instead of the GEMMs.
//!
//! Expert ids `>= experts` (experts on other ranks under expert parallelism) are skipped.

use std::sync::Arc;

use ddtree_codegen::dsl::*;
use ddtree_macros::{kernel, KernelParams};
use ddtree_runtime::cudarc::driver::{CudaSlice, CudaStream};
use ddtree_runtime::{CompiledKernel, Gpu, RuntimeError};

use super::gemm::{self, GemmArgs, GemmTiling, Routing, Scratch, W4a16Kernel};
use super::gemv::{self, GemvMode, GemvW4Params, W4a16Gemv};
pub use super::moe_reference::{reference_stage, reference_stage_macs};
use super::{Epilogue, W4a16Gemm, W4a16GemmWg, W4a16Params, W4a16WgParams};

/// Compile-time parameters of [`MoeAlign`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct AlignParams {
    /// Threads of the single block; also the most experts it handles.
    pub block: u32,
}

/// Groups `pairs` token-expert pairs (`topk_ids`, pair `i` = token `i / topk`, slot `i % topk`)
/// by expert into blocks of `bm` slots: `block_expert[b]` is block `b`'s expert and
/// `sorted[b * bm + s]` its pair ids (`u32::MAX` padding and unused blocks). Needs
/// `experts <= block` and `max_blocks >= ceil(pairs / bm) + min(experts, pairs)`. Grid: 1.
#[kernel(block = p.block, space = [AlignParams { block: 1024 }])]
pub fn moe_align(
    #[comptime] p: &AlignParams,
    topk_ids: &[u32],
    sorted: &mut [u32],
    block_expert: &mut [u32],
    pairs: u32,
    experts: u32,
    bm: u32,
    max_blocks: u32,
) {
    comptime_assert!(
        p.block % 32 == 0 && p.block <= 1024,
        "block must be a multiple of 32, at most 1024"
    );
    let count = shared::<u32>(p.block);
    let cursor = shared::<u32>(p.block);
    let wsum = shared::<u32>(32);
    let tid = thread_idx_x();
    count[tid] = 0u32;
    for b in (tid..max_blocks).step_by(p.block) {
        block_expert[b] = u32::MAX;
    }
    for s in (tid..max_blocks * bm).step_by(p.block) {
        sorted[s] = u32::MAX;
    }
    sync_threads();
    for i in (tid..pairs).step_by(p.block) {
        let e = topk_ids[i];
        if e < experts {
            count.atomic_add(e, 1u32);
        }
    }
    sync_threads();
    // Exclusive scan of the blocks per expert (thread = expert).
    let nb = if tid < experts {
        (count[tid] + bm - 1) / bm
    } else {
        0u32
    };
    let mut x = nb;
    #[unroll]
    for s in 0..5u32 {
        let y = shfl_up(x, 1u32 << s);
        if lane_id() >= (1u32 << s) {
            x += y;
        }
    }
    if lane_id() == 31 {
        wsum[warp_id()] = x;
    }
    sync_threads();
    let mut first = x - nb;
    for w in 0..warp_id() {
        first += wsum[w];
    }
    for b in 0..nb {
        block_expert[first + b] = tid;
    }
    cursor[tid] = first * bm;
    sync_threads();
    for i in (tid..pairs).step_by(p.block) {
        let e = topk_ids[i];
        if e < experts {
            sorted[cursor.atomic_add(e, 1u32)] = i;
        }
    }
}

/// Compile-time parameters of [`MoeSum`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct SumParams {
    /// Threads per block.
    pub block: u32,
}

/// `out[t, h] = sum_j y[t * topk + j, h]` over the slots whose expert is local
/// (`topk_ids < experts`). Any grid.
#[kernel(block = p.block, space = [SumParams { block: 256 }])]
pub fn moe_sum(
    #[comptime] p: &SumParams,
    y: &[bf16],
    topk_ids: &[u32],
    out: &mut [bf16],
    tokens: u32,
    hidden: u32,
    topk: u32,
    experts: u32,
) {
    let stride = grid_dim_x() * p.block;
    for e in (block_idx_x() * p.block + thread_idx_x()..tokens * hidden).step_by(stride) {
        let t = e / hidden;
        let h = e % hidden;
        let mut s = 0.0f32;
        for j in 0..topk {
            let pr = t * topk + j;
            if topk_ids[pr] < experts {
                s += y[pr * hidden + h] as f32;
            }
        }
        out[e] = s as bf16;
    }
}

/// The grouped (gate_up, down) variants of a [`MoeKernels`], of either GEMM kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GroupedPair {
    /// [`W4a16Gemm`] (mma.sync).
    Mma(W4a16Params, W4a16Params),
    /// [`W4a16GemmWg`] (`wgmma`, sm_90).
    Wg(W4a16WgParams, W4a16WgParams),
}

/// One way to run the block for a token count: the path and its (gate_up, down) pair. The
/// candidate of the MoE block's `Tunable` ([`super::tune_moe`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MoeVariant {
    /// The small-token path ([`MoeKernels::run_gemv`]): [`GemvMode::GateUp`] and
    /// [`GemvMode::Down`].
    Gemv(GemvW4Params, GemvW4Params),
    /// The grouped GEMV path ([`MoeKernels::run_grouped_gemv`]).
    GroupedGemv(GemvW4Params, GemvW4Params),
    /// The grouped GEMM path ([`MoeKernels::run_grouped`]).
    Grouped(GroupedPair),
}

impl MoeVariant {
    /// The pair's scale group.
    pub fn group(&self) -> u32 {
        match self {
            MoeVariant::Gemv(u, _) | MoeVariant::GroupedGemv(u, _) => u.group,
            MoeVariant::Grouped(GroupedPair::Mma(u, _)) => u.group,
            MoeVariant::Grouped(GroupedPair::Wg(u, _)) => u.group,
        }
    }
}

/// The hand-chosen grouped GEMM pair for `pairs` token-expert pairs at scale group `group`
/// (interleaved): half m tiles for up to 32 pairs (decode and small trees), one m tile above
/// (the H200 bench's best).
pub fn default_grouped(pairs: u32, group: u32) -> Option<GroupedPair> {
    let m8 = pairs <= 32;
    let pick = |epi: Epilogue| {
        gemm::FUSED_SPACE
            .iter()
            .find(|p| p.moe && p.epilogue == epi && p.m8 == m8 && p.mt == 1 && p.layout == super::Layout::Interleaved)
            .map(|p| W4a16Params { group, ..*p })
    };
    Some(GroupedPair::Mma(pick(Epilogue::SiluMul)?, pick(Epilogue::RouteScale)?))
}

/// The hand-chosen variant for `tokens` tokens of `topk` slots on interleaved experts at scale
/// group `group`: what [`MoeKernels::new`] with [`default_grouped`] runs (the small-token pair up
/// to [`GEMV_MAX_TOKENS`], the grouped GEMV pair up to [`GROUPED_GEMV_MAX_TOKENS`], else the
/// grouped GEMM pair).
pub fn default_variant(tokens: u32, topk: u32, group: u32) -> Option<MoeVariant> {
    let small = gemv::takes_group(group as usize);
    if small && tokens <= GEMV_MAX_TOKENS && tokens * topk <= gemv::MAX_PAIRS {
        let t = GEMV_MAX_TOKENS;
        if let (Some(u), Some(d)) = (
            gemv::default_params(GemvMode::GateUp, group, t),
            gemv::default_params(GemvMode::Down, group, t),
        ) {
            if gemv::max_tokens(&u) >= tokens && gemv::max_tokens(&d) >= tokens {
                return Some(MoeVariant::Gemv(u, d));
            }
        }
    }
    if small && tokens <= GROUPED_GEMV_MAX_TOKENS {
        if let (Some(u), Some(d)) = (
            gemv::default_params(GemvMode::GroupedGateUp, group, 1),
            gemv::default_params(GemvMode::GroupedDown, group, 1),
        ) {
            return Some(MoeVariant::GroupedGemv(u, d));
        }
    }
    default_grouped(tokens * topk, group).map(MoeVariant::Grouped)
}

/// The compiled grouped pair.
#[derive(Debug)]
enum GroupedKernels {
    Mma(CompiledKernel<W4a16Gemm>, CompiledKernel<W4a16Gemm>),
    Wg(CompiledKernel<W4a16GemmWg>, CompiledKernel<W4a16GemmWg>),
}

/// The compiled kernels of one MoE configuration: gate_up and down variants must be grouped,
/// with [`Epilogue::SiluMul`] and [`Epilogue::RouteScale`], the same rows per block, group and
/// layout, the layout matching the expert weights they are given.
#[derive(Debug)]
pub struct MoeKernels {
    align: CompiledKernel<MoeAlign>,
    /// The grouped GEMM pair (absent from a [`MoeKernels::for_variant`] of another path).
    grouped: Option<GroupedKernels>,
    sum: CompiledKernel<MoeSum>,
    /// Small-token (gate_up, down) [`W4a16Gemv`] pairs, fewest tokens first (interleaved
    /// experts at group 32, 64 or 128 only).
    gemv: Vec<(CompiledKernel<W4a16Gemv>, CompiledKernel<W4a16Gemv>)>,
    /// The grouped [`W4a16Gemv`] (gate_up, down) pair (interleaved experts at group 32, 64 or
    /// 128 only).
    grouped_gemv: Option<(CompiledKernel<W4a16Gemv>, CompiledKernel<W4a16Gemv>)>,
    /// The scale group of the pair (and of the GEMV pairs).
    group: u32,
    /// The one path [`MoeKernels::run`] takes, for a [`MoeKernels::for_variant`]; `None`: by
    /// token count.
    fixed: Option<MoeVariant>,
}

/// Most tokens for which [`MoeKernels::run`] takes the small-token [`W4a16Gemv`] path (the
/// kernels take up to 16). Measured on the H200 (`w4a16-bench --gemv`, Kimi K2.6 EP8 slice,
/// the two-tile default pair vs the best grouped GEMM pair): 80.8 vs 117.6 µs at T = 1,
/// 137.6 vs 158.3 at T = 2, 216.8 vs 249.0 at T = 4, 321.6 vs 355.7 at T = 8; at T = 16 the
/// two-chunk pair loses (623.1 vs 427.8). The grouped GEMV pair is within 3% of the
/// small-token pair at 2-8 tokens (296-297 vs 305 µs at T = 8) and slower at one (82-84 vs
/// 78), where the small-token path also needs no `moe_align` and `moe_sum` launches and starts
/// its weight copies before it waits for its predecessor.
pub const GEMV_MAX_TOKENS: u32 = 8;

/// Most tokens for which [`MoeKernels::run`] takes the grouped GEMV path (past
/// [`GEMV_MAX_TOKENS`]). Its blocks hold 8 pairs of one expert, so an expert with more pairs is
/// dequantized once per 8 (the grouped GEMM's blocks hold 16 above 4 tokens): it wins where
/// the pairs spread over the experts and loses where tokens share their experts. Measured on
/// the H200 (`w4a16-bench --moe-only --moe-tokens 9,12,16,24,32`, Kimi K2.6 EP8 slice, default
/// grouped GEMV pair vs best grouped GEMM pair, µs): top-8 of all 48 experts 307 vs 365 at
/// T = 9, 368 vs 403 at 12, 359 vs 426 at 16, 389 vs 473 at 24, 496 vs 504 at 32; top-8 of 9
/// experts (`--route-experts 9`) 124 vs 137 at 9, 157 vs 140 at 12, 160 vs 145 at 16, 229 vs
/// 174 at 24, 289 vs 190 at 32. Up to 16 tokens the spread case gains 9-16% and the shared
/// case loses at most 12%.
pub const GROUPED_GEMV_MAX_TOKENS: u32 = 16;

/// One MoE block's input: the activations and their routing.
#[derive(Clone, Copy, Debug)]
pub struct MoeInput<'a> {
    /// Activations `[T, H]`.
    pub x: &'a CudaSlice<bf16>,
    /// Expert of each slot `[T, topk]` (ids `>=` the local experts belong to other ranks).
    pub topk_ids: &'a CudaSlice<u32>,
    /// Router weight of each slot `[T, topk]`.
    pub topk_w: &'a CudaSlice<f32>,
    /// Tokens T.
    pub tokens: u32,
    /// Slots per token.
    pub topk: u32,
}

/// Device buffers of one MoE step for up to `max_tokens` tokens.
#[derive(Debug)]
pub struct MoeBuffers {
    sorted: CudaSlice<u32>,
    block_expert: CudaSlice<u32>,
    act: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
    scratch: Scratch,
}

/// Upper bound on the blocks `moe_align` makes.
pub fn max_blocks(pairs: usize, experts: usize, bm: usize) -> usize {
    pairs.div_ceil(bm) + experts.min(pairs)
}

/// Expert weights on the device, in the layout of the kernels that read them.
#[derive(Debug)]
pub struct DeviceExperts<'a> {
    /// Packed gate_up words.
    pub w13: &'a CudaSlice<u32>,
    /// gate_up scales as words ([`super::layout::scale_words`]).
    pub s13: &'a CudaSlice<u32>,
    /// Packed down words.
    pub w2: &'a CudaSlice<u32>,
    /// down scales as words.
    pub s2: &'a CudaSlice<u32>,
    /// Number of local experts.
    pub experts: u32,
    /// Hidden size H.
    pub hidden: u32,
    /// Expert intermediate size I.
    pub inter: u32,
}

impl MoeKernels {
    /// Compiles the kernels. The pair's variants must share rows per block, group and layout.
    pub fn new(gpu: &Gpu, pair: GroupedPair) -> Result<MoeKernels, RuntimeError> {
        let (tu, grouped) = grouped_kernels(gpu, &pair)?;
        let small = tu.layout == super::Layout::Interleaved && gemv::takes_group(tu.group as usize);
        let group = tu.group;
        Ok(MoeKernels {
            align: gpu.compile::<MoeAlign>(&AlignParams { block: 1024 })?,
            grouped: Some(grouped),
            sum: gpu.compile::<MoeSum>(&SumParams { block: 256 })?,
            gemv: if small {
                let mut v = Vec::new();
                let mut chunks = vec![GEMV_MAX_TOKENS.min(8), GEMV_MAX_TOKENS];
                chunks.dedup();
                for t in chunks {
                    let (Some(u), Some(d)) = (
                        gemv::default_params(GemvMode::GateUp, group, t),
                        gemv::default_params(GemvMode::Down, group, t),
                    ) else {
                        continue;
                    };
                    v.push((gpu.compile::<W4a16Gemv>(&u)?, gpu.compile::<W4a16Gemv>(&d)?));
                }
                v
            } else {
                Vec::new()
            },
            grouped_gemv: match (
                gemv::default_params(GemvMode::GroupedGateUp, group, 1),
                gemv::default_params(GemvMode::GroupedDown, group, 1),
            ) {
                (Some(u), Some(d)) if small => Some((gpu.compile::<W4a16Gemv>(&u)?, gpu.compile::<W4a16Gemv>(&d)?)),
                _ => None,
            },
            group,
            fixed: None,
        })
    }

    /// Compiles the kernels of `v` alone: [`MoeKernels::run`] then takes `v`'s path at any
    /// token count (the engine runs its tuned variant this way).
    pub fn for_variant(gpu: &Gpu, v: &MoeVariant) -> Result<MoeKernels, RuntimeError> {
        let k = MoeKernels {
            align: gpu.compile::<MoeAlign>(&AlignParams { block: 1024 })?,
            grouped: None,
            sum: gpu.compile::<MoeSum>(&SumParams { block: 256 })?,
            gemv: Vec::new(),
            grouped_gemv: None,
            group: v.group(),
            fixed: Some(*v),
        };
        match v {
            MoeVariant::Gemv(u, d) => k.with_gemv(gpu, Some((u, d))),
            MoeVariant::GroupedGemv(u, d) => k.with_grouped_gemv(gpu, Some((u, d))),
            MoeVariant::Grouped(pair) => Ok(MoeKernels {
                grouped: Some(grouped_kernels(gpu, pair)?.1),
                ..k
            }),
        }
    }

    /// The variant a [`MoeKernels::for_variant`] runs.
    pub fn variant(&self) -> Option<&MoeVariant> {
        self.fixed.as_ref()
    }

    /// Replaces the small-token kernels with one (gate_up, down) pair of the grouped pair's
    /// scale group (the bench times each candidate this way); `None` turns the small-token path
    /// off.
    pub fn with_gemv(
        mut self,
        gpu: &Gpu,
        pair: Option<(&GemvW4Params, &GemvW4Params)>,
    ) -> Result<MoeKernels, RuntimeError> {
        self.gemv.clear();
        if let Some((u, d)) = pair {
            if u.mode != GemvMode::GateUp || d.mode != GemvMode::Down {
                return Err(RuntimeError::Launch {
                    kernel: "moe_w4a16_gemv".into(),
                    reason: format!("not a (gate_up, down) pair: {u:?} / {d:?}"),
                });
            }
            if u.group != self.group || d.group != self.group {
                return Err(RuntimeError::Launch {
                    kernel: "moe_w4a16_gemv".into(),
                    reason: format!("not a pair of scale group {}: {u:?} / {d:?}", self.group),
                });
            }
            self.gemv
                .push((gpu.compile::<W4a16Gemv>(u)?, gpu.compile::<W4a16Gemv>(d)?));
        }
        Ok(self)
    }

    /// Replaces the grouped GEMV pair (the bench times each candidate this way); `None` turns
    /// the grouped GEMV path off. The pair must share its slots per block (`chunks`) and the
    /// grouped pair's scale group.
    pub fn with_grouped_gemv(
        mut self,
        gpu: &Gpu,
        pair: Option<(&GemvW4Params, &GemvW4Params)>,
    ) -> Result<MoeKernels, RuntimeError> {
        self.grouped_gemv = match pair {
            None => None,
            Some((u, d)) => {
                if u.mode != GemvMode::GroupedGateUp
                    || d.mode != GemvMode::GroupedDown
                    || u.chunks != d.chunks
                    || u.group != self.group
                    || d.group != self.group
                {
                    return Err(RuntimeError::Launch {
                        kernel: "moe_w4a16_grouped_gemv".into(),
                        reason: format!(
                            "not a grouped (gate_up, down) pair with the same chunks at scale group {}: {u:?} / {d:?}",
                            self.group
                        ),
                    });
                }
                Some((gpu.compile::<W4a16Gemv>(u)?, gpu.compile::<W4a16Gemv>(d)?))
            }
        };
        Ok(self)
    }

    /// The small-token pair that takes `tokens` tokens of `topk` slots, if any.
    fn gemv_for(&self, tokens: u32, topk: u32) -> Option<&(CompiledKernel<W4a16Gemv>, CompiledKernel<W4a16Gemv>)> {
        if tokens * topk > gemv::MAX_PAIRS {
            return None;
        }
        self.gemv
            .iter()
            .find(|(u, d)| gemv::max_tokens(u.params()) >= tokens && gemv::max_tokens(d.params()) >= tokens)
    }

    /// Whether [`MoeKernels::run`] takes the small-token path for `tokens` tokens.
    pub fn uses_gemv(&self, tokens: u32, topk: u32) -> bool {
        match self.fixed {
            // (run_gemv says so where the pair does not take the tokens.)
            Some(MoeVariant::Gemv(..)) => true,
            Some(_) => false,
            None => tokens <= GEMV_MAX_TOKENS && self.gemv_for(tokens, topk).is_some(),
        }
    }

    /// Whether [`MoeKernels::run`] takes the grouped GEMV path for `tokens` tokens.
    pub fn uses_grouped_gemv(&self, tokens: u32, topk: u32) -> bool {
        match self.fixed {
            Some(v) => matches!(v, MoeVariant::GroupedGemv(..)),
            None => !self.uses_gemv(tokens, topk) && tokens <= GROUPED_GEMV_MAX_TOKENS && self.grouped_gemv.is_some(),
        }
    }

    /// Slots per `moe_align` block of the grouped GEMV pair.
    fn grouped_gemv_slots(&self) -> Option<u32> {
        self.grouped_gemv.as_ref().map(|(u, _)| 8 * u.params().chunks)
    }

    /// Slots per block of the grouped GEMM pair (the per-expert block size), where it has one.
    pub fn block_m(&self) -> Option<u32> {
        match self.grouped.as_ref()? {
            GroupedKernels::Mma(u, _) => Some(gemm::rows_per_block(u.params())),
            GroupedKernels::Wg(u, _) => Some(gemm::rows_per_block(u.params())),
        }
    }

    /// Buffers for `tokens` tokens of `topk` slots.
    pub fn buffers(
        &self,
        s: &Arc<CudaStream>,
        tokens: usize,
        topk: usize,
        ex: &DeviceExperts,
    ) -> Result<MoeBuffers, RuntimeError> {
        let pairs = tokens * topk;
        // moe_align's blocks for the grouped GEMM and the grouped GEMV pair.
        let (mut blocks, mut slots) = (0, 0);
        for bm in [self.block_m(), self.grouped_gemv_slots()].into_iter().flatten() {
            let mb = max_blocks(pairs, ex.experts as usize, bm as usize);
            blocks = blocks.max(mb);
            slots = slots.max(mb * bm as usize);
        }
        let drv = |source| RuntimeError::Driver {
            context: "allocating MoE buffers".into(),
            source,
        };
        Ok(MoeBuffers {
            sorted: s.alloc_zeros::<u32>(slots).map_err(drv)?,
            block_expert: s.alloc_zeros::<u32>(blocks).map_err(drv)?,
            act: s.alloc_zeros::<bf16>(pairs * ex.inter as usize).map_err(drv)?,
            y: s.alloc_zeros::<bf16>(pairs * ex.hidden as usize).map_err(drv)?,
            scratch: Scratch::new(s, 1)?,
        })
    }

    /// Runs the block on `input` into `out` `[T, H]`; the
    /// small-token path when [`MoeKernels::uses_gemv`], the grouped GEMV path when
    /// [`MoeKernels::uses_grouped_gemv`], else the grouped GEMM.
    ///
    /// # Safety
    /// Buffers must have the documented shapes, `bufs` made by [`MoeKernels::buffers`] for at
    /// least `tokens` tokens, and the experts stored in the variants' layout.
    pub unsafe fn run(
        &self,
        s: &Arc<CudaStream>,
        ex: &DeviceExperts,
        input: &MoeInput,
        out: &mut CudaSlice<bf16>,
        bufs: &mut MoeBuffers,
    ) -> Result<(), RuntimeError> {
        let (tokens, topk) = (input.tokens, input.topk);
        // SAFETY: forwarded to the caller.
        unsafe {
            if self.uses_gemv(tokens, topk) {
                self.run_gemv(s, ex, input, out, bufs)
            } else if self.uses_grouped_gemv(tokens, topk) {
                self.run_grouped_gemv(s, ex, input, out, bufs)
            } else {
                self.run_grouped(s, ex, input, out, bufs)
            }
        }
    }

    /// The small-token path: [`GemvMode::GateUp`] into `bufs`' `act`, then [`GemvMode::Down`]
    /// into `out`. Needs a pair that takes `tokens` (see [`MoeKernels::uses_gemv`]),
    /// `inter % 8 == 0` and `hidden % 32 == inter % 32 == 0`.
    ///
    /// # Safety
    /// As [`MoeKernels::run`].
    pub unsafe fn run_gemv(
        &self,
        s: &Arc<CudaStream>,
        ex: &DeviceExperts,
        input: &MoeInput,
        out: &mut CudaSlice<bf16>,
        bufs: &mut MoeBuffers,
    ) -> Result<(), RuntimeError> {
        let MoeInput {
            topk_ids, tokens, topk, ..
        } = *input;
        let Some((up, down)) = self.gemv_for(tokens, topk) else {
            return Err(RuntimeError::Launch {
                kernel: "moe_w4a16_gemv".into(),
                reason: format!("no small-token variant takes {tokens} tokens of top-{topk}"),
            });
        };
        gemv_shapes(ex, "moe_w4a16_gemv")?;
        let pairs = tokens * topk;
        // SAFETY: forwarded to the caller; act holds pairs * inter values. The routing stands
        // in for moe_align's blocks, which these modes do not read.
        unsafe {
            gemv_pair(
                s,
                ex,
                input,
                (up, down),
                (topk_ids, topk_ids),
                (pairs, pairs),
                &mut bufs.act,
                out,
                tokens,
            )
        }
    }

    /// The grouped path: `moe_align`, grouped gate_up and down GEMMs, `moe_sum`.
    ///
    /// # Safety
    /// As [`MoeKernels::run`].
    pub unsafe fn run_grouped(
        &self,
        s: &Arc<CudaStream>,
        ex: &DeviceExperts,
        input: &MoeInput,
        out: &mut CudaSlice<bf16>,
        bufs: &mut MoeBuffers,
    ) -> Result<(), RuntimeError> {
        let MoeInput {
            x,
            topk_w,
            tokens,
            topk,
            ..
        } = *input;
        let pairs = tokens * topk;
        // SAFETY: forwarded to the caller; the buffers were sized by `buffers`.
        unsafe {
            let Some(bm) = self.block_m() else {
                return Err(RuntimeError::Launch {
                    kernel: "moe_w4a16".into(),
                    reason: format!("no grouped GEMM pair in {:?}", self.fixed),
                });
            };
            let mb = self.align(s, ex, input, bufs, bm)?;
            let routing = |a_div, route_w| Routing {
                sorted: &bufs.sorted,
                block_expert: &bufs.block_expert,
                route_w,
                max_blocks: mb,
                a_div,
            };
            let up = GemmArgs {
                a: x,
                w: ex.w13,
                scales: ex.s13,
                residual: None,
                routing: Some(routing(topk, None)),
                m: pairs,
                n: 2 * ex.inter,
                k: ex.hidden,
            };
            // (`a` is `bufs.act`, set once the gate_up GEMM has written it.)
            let down = GemmArgs {
                a: x,
                w: ex.w2,
                scales: ex.s2,
                residual: None,
                routing: Some(routing(1, Some(topk_w))),
                m: pairs,
                n: ex.hidden,
                k: ex.inter,
            };
            match self.grouped.as_ref().expect("block_m found the pair") {
                GroupedKernels::Mma(u, d) => {
                    grouped_pair(s, u, d, &up, down, &mut bufs.scratch, &mut bufs.act, &mut bufs.y)?
                }
                GroupedKernels::Wg(u, d) => {
                    grouped_pair(s, u, d, &up, down, &mut bufs.scratch, &mut bufs.act, &mut bufs.y)?
                }
            }
            self.sum(s, ex, input, out, bufs)
        }
    }

    /// The grouped GEMV path: `moe_align` (8 chunks slots per block), the grouped gate_up and
    /// down [`W4a16Gemv`]s, `moe_sum`. Needs the grouped GEMV pair (see
    /// [`MoeKernels::uses_grouped_gemv`]) and `hidden % 32 == inter % 32 == 0`.
    ///
    /// # Safety
    /// As [`MoeKernels::run`].
    pub unsafe fn run_grouped_gemv(
        &self,
        s: &Arc<CudaStream>,
        ex: &DeviceExperts,
        input: &MoeInput,
        out: &mut CudaSlice<bf16>,
        bufs: &mut MoeBuffers,
    ) -> Result<(), RuntimeError> {
        let pairs = input.tokens * input.topk;
        let Some((up, down)) = &self.grouped_gemv else {
            return Err(RuntimeError::Launch {
                kernel: "moe_w4a16_grouped_gemv".into(),
                reason: "no grouped GEMV pair (the experts are not interleaved at group 32, 64 or 128)".into(),
            });
        };
        gemv_shapes(ex, "moe_w4a16_grouped_gemv")?;
        // SAFETY: forwarded to the caller; the buffers were sized by `buffers` (act and y hold
        // pairs rows, sorted and block_expert the blocks at 8 chunks slots).
        unsafe {
            let mb = self.align(s, ex, input, bufs, 8 * up.params().chunks)?;
            gemv_pair(
                s,
                ex,
                input,
                (up, down),
                (&bufs.sorted, &bufs.block_expert),
                (mb, mb),
                &mut bufs.act,
                &mut bufs.y,
                pairs,
            )?;
            self.sum(s, ex, input, out, bufs)
        }
    }

    /// `moe_align` of `input`'s routing into `bufs` at `bm` slots per block; returns the blocks
    /// it may make.
    ///
    /// # Safety
    /// As [`MoeKernels::run`].
    unsafe fn align(
        &self,
        s: &Arc<CudaStream>,
        ex: &DeviceExperts,
        input: &MoeInput,
        bufs: &mut MoeBuffers,
        bm: u32,
    ) -> Result<u32, RuntimeError> {
        let pairs = input.tokens * input.topk;
        let mb = max_blocks(pairs as usize, ex.experts as usize, bm as usize) as u32;
        if ex.experts > self.align.params().block {
            return Err(RuntimeError::Launch {
                kernel: "moe_align".into(),
                reason: format!("{} experts > 1024", ex.experts),
            });
        }
        // SAFETY: forwarded to the caller; sorted holds mb * bm slots, block_expert mb.
        unsafe {
            MoeAlign::launch(
                &self.align,
                s,
                1,
                input.topk_ids,
                &mut bufs.sorted,
                &mut bufs.block_expert,
                pairs,
                ex.experts,
                bm,
                mb,
            )?;
        }
        Ok(mb)
    }

    /// `moe_sum` of `bufs`' `y` (the pairs' router-weighted rows) into `out`.
    ///
    /// # Safety
    /// As [`MoeKernels::run`], with `y` written.
    unsafe fn sum(
        &self,
        s: &Arc<CudaStream>,
        ex: &DeviceExperts,
        input: &MoeInput,
        out: &mut CudaSlice<bf16>,
        bufs: &MoeBuffers,
    ) -> Result<(), RuntimeError> {
        let MoeInput {
            topk_ids, tokens, topk, ..
        } = *input;
        let g = (tokens * ex.hidden).div_ceil(self.sum.params().block).clamp(1, 65535);
        // SAFETY: forwarded to the caller.
        unsafe {
            MoeSum::launch(
                &self.sum, s, g, &bufs.y, topk_ids, out, tokens, ex.hidden, topk, ex.experts,
            )
        }
    }
}

/// Checks and compiles a grouped pair (see [`MoeKernels::new`]); returns the gate_up tiling.
fn grouped_kernels(gpu: &Gpu, pair: &GroupedPair) -> Result<(gemm::Tiling, GroupedKernels), RuntimeError> {
    let (tu, td) = match pair {
        GroupedPair::Mma(u, d) => (u.tiling(), d.tiling()),
        GroupedPair::Wg(u, d) => (u.tiling(), d.tiling()),
    };
    let ok = tu.moe
        && td.moe
        && tu.epilogue == Epilogue::SiluMul
        && td.epilogue == Epilogue::RouteScale
        && tu.rows == td.rows
        && tu.group == td.group
        && tu.layout == td.layout;
    if !ok {
        return Err(RuntimeError::Launch {
            kernel: "moe_w4a16".into(),
            reason: format!("incompatible variants: {pair:?}"),
        });
    }
    let k = match pair {
        GroupedPair::Mma(u, d) => GroupedKernels::Mma(gpu.compile(u)?, gpu.compile(d)?),
        GroupedPair::Wg(u, d) => GroupedKernels::Wg(gpu.compile(u)?, gpu.compile(d)?),
    };
    Ok((tu, k))
}

/// A (gate_up, down) [`W4a16Gemv`] pair: gate_up from `input`'s x into `act`, then down from
/// `act` into `out` (`down_m`: its `m`, tokens or pairs). `blocks`: `moe_align`'s `sorted` and
/// `block_expert` (grouped modes), `ys`: each launch's [`gemv::grid`] y count.
///
/// # Safety
/// As [`MoeKernels::run`]; `act` holds the pairs' `[pairs, inter]` rows, `out` what the down
/// mode writes.
#[allow(clippy::too_many_arguments)]
unsafe fn gemv_pair(
    s: &Arc<CudaStream>,
    ex: &DeviceExperts,
    input: &MoeInput,
    (up, down): (&CompiledKernel<W4a16Gemv>, &CompiledKernel<W4a16Gemv>),
    (sorted, block_expert): (&CudaSlice<u32>, &CudaSlice<u32>),
    (up_ys, down_ys): (u32, u32),
    act: &mut CudaSlice<bf16>,
    out: &mut CudaSlice<bf16>,
    down_m: u32,
) -> Result<(), RuntimeError> {
    let MoeInput {
        x,
        topk_ids,
        topk_w,
        tokens,
        topk,
    } = *input;
    // SAFETY: forwarded to the caller.
    unsafe {
        W4a16Gemv::launch(
            up,
            s,
            gemv::grid(up.params(), 2 * ex.inter, up_ys),
            x,
            ex.w13,
            ex.s13,
            topk_ids,
            topk_w,
            sorted,
            block_expert,
            act,
            tokens * topk,
            2 * ex.inter,
            ex.hidden,
            topk,
            ex.experts,
        )?;
        W4a16Gemv::launch(
            down,
            s,
            gemv::grid(down.params(), ex.hidden, down_ys),
            act,
            ex.w2,
            ex.s2,
            topk_ids,
            topk_w,
            sorted,
            block_expert,
            out,
            down_m,
            ex.hidden,
            ex.inter,
            topk,
            ex.experts,
        )
    }
}

/// The GEMV paths' shape rule: hidden and expert intermediate sizes multiples of 32.
fn gemv_shapes(ex: &DeviceExperts, kernel: &str) -> Result<(), RuntimeError> {
    if ex.inter % 32 != 0 || ex.hidden % 32 != 0 {
        return Err(RuntimeError::Launch {
            kernel: kernel.into(),
            reason: format!("hidden {} and inter {} must be multiples of 32", ex.hidden, ex.inter),
        });
    }
    Ok(())
}

/// The grouped gate_up GEMM into `act`, then the down GEMM with `act` as its A into `y`.
///
/// # Safety
/// As [`gemm::launch`] for both launches.
#[allow(clippy::too_many_arguments)]
unsafe fn grouped_pair<K: W4a16Kernel>(
    s: &Arc<CudaStream>,
    up_k: &CompiledKernel<K>,
    down_k: &CompiledKernel<K>,
    up: &GemmArgs,
    down: GemmArgs,
    scratch: &mut Scratch,
    act: &mut CudaSlice<bf16>,
    y: &mut CudaSlice<bf16>,
) -> Result<(), RuntimeError> {
    // SAFETY: forwarded to the caller.
    unsafe {
        gemm::launch(up_k, None, s, up, scratch, act, 1)?;
        let down = GemmArgs { a: act, ..down };
        gemm::launch(down_k, None, s, &down, scratch, y, 1)
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::w4a16::layout::matmul;
    use crate::w4a16::layout::PackedInt4;

    /// [`reference_stage`] against the whole-matrix formulation (every expert dequantized, one
    /// sequential f32 sum per output), on both stages with pairs of other ranks (NaN inputs
    /// there) and experts no pair routes to.
    #[test]
    fn reference_stage_matches_the_dense_formulation() {
        let mut rng = StdRng::seed_from_u64(3);
        let (tokens, topk, experts, hidden, inter) = (5, 3, 4, 160, 96);
        let ids: Vec<u32> = (0..tokens * topk)
            .map(|_| rng.random_range(0..experts as u32 + 2))
            .collect();
        let wts: Vec<f32> = (0..ids.len()).map(|_| rng.random_range(0.05f32..0.5)).collect();
        for (n, k, route) in [(2 * inter, hidden, None), (hidden, inter, Some(&wts[..]))] {
            let w = PackedInt4::random(&mut rng, n, k, 32, experts, 0.05);
            let rows = if route.is_some() { ids.len() } else { tokens };
            let x: Vec<f32> = (0..rows * k)
                .map(|i| {
                    if route.is_some() && ids[i / k] as usize >= experts {
                        f32::NAN
                    } else {
                        rng.random_range(-1.0f32..1.0)
                    }
                })
                .collect();
            let got = reference_stage(&x, &ids, topk, &w, route);
            let deq = w.dequantize_bf16();
            let cols = if route.is_some() { n } else { n / 2 };
            for (pr, &e) in ids.iter().enumerate() {
                let e = e as usize;
                let got = &got[pr * cols..(pr + 1) * cols];
                if e >= experts {
                    assert!(got.iter().all(|&v| v == 0.0), "pair {pr} of another rank");
                    continue;
                }
                let row = if route.is_some() { pr } else { pr / topk };
                let acc = matmul(&x[row * k..(row + 1) * k], &deq[e * n * k..(e + 1) * n * k], 1, n, k);
                for (c, &g) in got.iter().enumerate() {
                    let want = match route {
                        Some(r) => acc[c] * r[pr],
                        None => acc[c] / (1.0 + (-acc[c]).exp()) * acc[cols + c],
                    };
                    assert!(
                        (g - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "pair {pr} col {c}: {g} vs {want}"
                    );
                }
            }
        }
    }
}
