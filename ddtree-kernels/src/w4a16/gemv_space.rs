//! The compile-time parameters of [`W4a16Gemv`](super::W4a16Gemv) (`w4a16_gemv`), its
//! candidates and their launch geometry (see [`super::gemv`] for the kernel and its design).

use ddtree_macros::KernelParams;

/// What a [`W4a16Gemv`](super::W4a16Gemv) variant computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, KernelParams)]
pub enum GemvMode {
    /// Dense `out[M, N] = x W^T`.
    Dense,
    /// Routed gate_up with SiLU-and-mul into `act[pair, I]`.
    GateUp,
    /// Routed down, router-weighted and summed over the top-k slots into `out[T, H]`.
    Down,
    /// Routed gate_up with SiLU-and-mul into `act[pair, I]`, from `moe_align`'s blocks.
    GroupedGateUp,
    /// Routed down, router-weighted, into `y[pair, H]`, from `moe_align`'s blocks.
    GroupedDown,
}

impl GemvMode {
    /// Whether the mode computes gate_up (gate and up tiles, SiLU-and-mul into `act`).
    pub const fn gate_up(self) -> bool {
        matches!(self, GemvMode::GateUp | GemvMode::GroupedGateUp)
    }

    /// Whether the mode reads `moe_align`'s blocks (`sorted`, `block_expert`).
    pub const fn grouped(self) -> bool {
        matches!(self, GemvMode::GroupedGateUp | GemvMode::GroupedDown)
    }
}

/// Most token-expert pairs a [`GemvMode::Down`] launch takes (its shared routing tables).
pub const MAX_PAIRS: u32 = 128;

/// Compile-time parameters of [`W4a16Gemv`](super::W4a16Gemv).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, KernelParams)]
pub struct GemvW4Params {
    /// Scale group size along K: 32, 64 or 128 (a row's k128 step holds 4, 2 or 1 groups: the
    /// four lanes `q = lane % 4` of a row each read their own scale at g32, pairs `q / 2` share
    /// one at g64, all four one at g128).
    pub group: u32,
    /// What the variant computes.
    pub mode: GemvMode,
    /// Warps per block; they split the k steps (and experts) of the block's rows.
    pub warps: u32,
    /// m16 row tiles per block (`GateUp`: gate tiles, plus as many up tiles).
    pub mt: u32,
    /// k128 steps in each warp's shared-memory ring (the cp.async groups in flight).
    pub stages: u32,
    /// n8 token chunks: tokens (dense rows, pairs of one expert, or `Down` tokens) per launch
    /// are at most `8 chunks`.
    pub chunks: u32,
    /// The activations ride the ring: each k step's `[8 chunks, 128]` x slice is `cp.async`ed
    /// with its weights, `stages` steps ahead, instead of loaded from global memory right before
    /// its mma (an exposed L2 round trip per k step).
    pub xr: bool,
    /// The scales ride the ring: each lane `cp.async`s its scale word of every 8-row tile with
    /// the weights (4 bytes, `stages` steps ahead) and reads it back from shared memory at use,
    /// instead of holding `stages` steps of scale words in registers.
    pub sr: bool,
    /// Interleaved k steps: warp `w` of a block takes k steps `w`, `w + warps`, ... (`Down`: of
    /// its experts' steps one after another) instead of a contiguous range, so the block's warps
    /// read adjacent 512-byte pieces of each 8-row tile at about the same time (one run of
    /// `warps` pieces per tile, not `warps` runs).
    pub kw: bool,
}

const fn gv(mode: GemvMode, warps: u32, mt: u32, stages: u32, chunks: u32, xr: bool) -> GemvW4Params {
    GemvW4Params {
        group: 32,
        mode,
        warps,
        mt,
        stages,
        chunks,
        xr,
        sr: false,
        kw: false,
    }
}

/// [`gvs`] with interleaved k steps (`kw`).
const fn gvk(mode: GemvMode, warps: u32, mt: u32, stages: u32, chunks: u32) -> GemvW4Params {
    GemvW4Params {
        kw: true,
        ..gvs(mode, warps, mt, stages, chunks, false)
    }
}

/// [`gv`] with the scales in the ring (`sr`).
const fn gvs(mode: GemvMode, warps: u32, mt: u32, stages: u32, chunks: u32, xr: bool) -> GemvW4Params {
    GemvW4Params {
        sr: true,
        ..gv(mode, warps, mt, stages, chunks, xr)
    }
}

/// `p` at scale group `group`.
const fn grp(group: u32, p: GemvW4Params) -> GemvW4Params {
    GemvW4Params { group, ..p }
}

const D: GemvMode = GemvMode::Dense;
const G: GemvMode = GemvMode::GateUp;
const W: GemvMode = GemvMode::Down;
const GG: GemvMode = GemvMode::GroupedGateUp;
const GD: GemvMode = GemvMode::GroupedDown;

/// Every candidate. Per mode, the first is the safe default for up to 8 tokens and the first
/// with `chunks == 2` the one for up to 16 ([`default_params`]). The defaults are the fastest
/// on the H200 (`w4a16-bench --gemv`, BENCHMARKS.md): two m16 tiles per warp step with the
/// scales in the ring and a short ring (`Dense` 4 warps x 2 stages: 48.6 µs at 7168->36864,
/// M = 1, 73% of copy bandwidth, vs 59.4 for 8 warps x 4 stages with one tile; `GateUp`
/// 4 warps x 2 stages, `Down` 8 warps x 2 stages: each half 4-6% faster than the one-tile pair,
/// 80.8 µs for the Kimi EP8 slice at one token, vs 88.8): more independent mma chains and
/// dequant work per warp beat more warps. The two-chunk defaults are their two-chunk twins
/// (the pair 556.5 µs at T = 16, vs 632.8, still behind the grouped GEMM's 418.9), except
/// `Dense`, whose two-chunk default takes three m16 tiles per block with x loaded a step ahead:
/// every block reads the whole x of its rows, so more rows per block cut the L2 traffic of x
/// (62.9 µs at 7168->36864, M = 16, vs 80.5 for two tiles and 84.3 for two tiles without x
/// ahead; the four-tile twin 67.5). The `xr` ones (x in
/// the ring) trade shared memory (2 KiB per chunk and stage) for no exposed x latency per k
/// step: 8-16
/// warps splitting k for the narrow shapes (a chain of 2-4 k steps per warp: about two DRAM
/// round trips per block), two m16 tiles per block for the wide ones (x amortized over 32 rows,
/// ~96 KB of weights in flight per SM), and `Down` rings of at most 60 KB so the 448 row slabs
/// of hidden 7168 fit in one wave of 3-4 blocks per SM. The `sr` ones (scales in the ring:
/// 128 bytes more shared memory per 8-row tile and stage, no scale registers) mirror the best
/// of each mode, with and without `xr`, at one and two m16 tiles. The grouped modes' first
/// candidates are their defaults, whatever the token count (a pair must share `chunks`, its
/// slots per `moe_align` block): gate_up as the `GateUp` default, down with **one warp** per
/// block and four stages. An expert's down is only 16 k steps (inter 2048), so warps that split
/// them each wait out a short pipeline and then a block reduction; one warp streams all 16
/// (Kimi EP8 slice at T = 16: the pair 352-369 µs with it vs 402-404 with 4 warps; the grouped
/// GEMM pair 422-441). The `Dense` defaults are the `kw` twins of those (interleaved k steps):
/// 46.4 µs vs 47.7 at 7168->36864, M = 1, 61.7 vs 62.8 at M = 16 (two calls agree to 1 µs);
/// `kw` did not help the MoE modes.
pub const GEMV_SPACE: &[GemvW4Params] = &[
    gvk(D, 4, 2, 2, 1),
    gvk(D, 4, 3, 2, 2),
    gvs(D, 4, 2, 2, 1, false),
    gvs(D, 4, 3, 2, 2, false),
    gvs(D, 4, 2, 2, 2, false),
    gv(D, 8, 1, 4, 1, false),
    gv(D, 4, 1, 8, 2, false),
    gv(D, 4, 1, 8, 1, false),
    gv(D, 4, 2, 4, 1, false),
    gv(D, 8, 1, 4, 2, false),
    gv(D, 8, 1, 4, 1, true),
    gv(D, 16, 1, 2, 1, true),
    gv(D, 4, 2, 4, 1, true),
    gv(D, 16, 1, 2, 2, true),
    gv(D, 4, 2, 4, 2, true),
    gvs(D, 8, 1, 4, 1, false),
    gvs(D, 4, 2, 4, 1, false),
    gvs(D, 8, 2, 2, 1, false),
    gvs(D, 4, 4, 2, 1, false),
    gvs(D, 2, 2, 4, 1, false),
    gvs(D, 2, 2, 2, 1, false),
    gvs(D, 8, 1, 4, 1, true),
    gvs(D, 4, 2, 4, 1, true),
    gvs(D, 4, 4, 2, 2, false),
    // Groups 64 and 128: each mode's defaults (one and two chunks), and a dense one with the
    // scale words in registers.
    grp(64, gvk(D, 4, 2, 2, 1)),
    grp(64, gvk(D, 4, 3, 2, 2)),
    grp(64, gv(D, 8, 1, 4, 1, false)),
    grp(64, gvs(G, 4, 2, 2, 1, false)),
    grp(64, gvs(G, 4, 2, 2, 2, false)),
    grp(64, gvs(W, 8, 2, 2, 1, false)),
    grp(64, gvs(W, 4, 2, 2, 2, false)),
    grp(64, gvs(GG, 4, 2, 2, 1, false)),
    grp(64, gvs(GD, 1, 2, 4, 1, false)),
    grp(128, gvk(D, 4, 2, 2, 1)),
    grp(128, gvk(D, 4, 3, 2, 2)),
    grp(128, gv(D, 8, 1, 4, 1, false)),
    grp(128, gvs(G, 4, 2, 2, 1, false)),
    grp(128, gvs(G, 4, 2, 2, 2, false)),
    grp(128, gvs(W, 8, 2, 2, 1, false)),
    grp(128, gvs(W, 4, 2, 2, 2, false)),
    grp(128, gvs(GG, 4, 2, 2, 1, false)),
    grp(128, gvs(GD, 1, 2, 4, 1, false)),
    gvs(G, 4, 2, 2, 1, false),
    gvs(G, 4, 2, 2, 2, false),
    gv(G, 4, 1, 4, 2, false),
    gv(G, 8, 1, 2, 1, false),
    gv(G, 2, 1, 8, 1, false),
    gv(G, 4, 1, 4, 1, false),
    gv(G, 4, 1, 4, 1, true),
    gv(G, 8, 1, 2, 1, true),
    gv(G, 4, 1, 3, 2, true),
    gvs(G, 8, 1, 2, 1, false),
    gvs(G, 4, 1, 4, 1, true),
    gvs(G, 8, 1, 2, 1, true),
    gvs(G, 4, 1, 4, 1, false),
    gvs(G, 2, 2, 4, 1, false),
    gvs(G, 2, 2, 2, 1, false),
    gvs(G, 8, 2, 2, 1, false),
    gvs(G, 4, 1, 2, 1, false),
    gvk(G, 4, 1, 2, 1),
    gvs(W, 8, 2, 2, 1, false),
    gvs(W, 4, 2, 2, 2, false),
    gv(W, 4, 1, 8, 2, false),
    gv(W, 4, 1, 8, 1, false),
    gv(W, 8, 1, 4, 1, false),
    gv(W, 8, 1, 4, 2, false),
    gv(W, 4, 1, 6, 1, true),
    gv(W, 4, 1, 4, 1, true),
    gv(W, 4, 1, 3, 2, true),
    gvs(W, 4, 1, 6, 1, true),
    gvs(W, 8, 1, 4, 1, false),
    gvs(W, 4, 2, 4, 1, false),
    gvs(W, 8, 2, 4, 1, false),
    gvs(W, 16, 2, 2, 1, false),
    gvs(W, 8, 2, 2, 2, false),
    gvk(W, 8, 2, 2, 1),
    gvk(W, 8, 2, 4, 1),
    gvk(W, 4, 2, 2, 1),
    gvk(W, 8, 1, 2, 1),
    gvs(GG, 4, 2, 2, 1, false),
    gvs(GG, 2, 2, 2, 1, false),
    gvs(GG, 2, 2, 4, 1, false),
    gvs(GG, 4, 2, 2, 2, false),
    gvs(GD, 1, 2, 4, 1, false),
    gvs(GD, 2, 2, 4, 1, false),
    gvs(GD, 1, 4, 2, 1, false),
    gvs(GD, 2, 4, 2, 1, false),
    gvs(GD, 4, 2, 2, 1, false),
    gvs(GD, 1, 2, 8, 1, false),
    gvs(GD, 1, 1, 8, 1, false),
    gvs(GD, 4, 2, 2, 2, false),
    gvs(GD, 1, 2, 4, 2, false),
];

/// Tokens one variant takes: `8 chunks` (the grouped modes: any number; `8 chunks` is their
/// slots per `moe_align` block).
pub fn max_tokens(p: &GemvW4Params) -> u32 {
    if p.mode.grouped() {
        u32::MAX
    } else {
        8 * p.chunks
    }
}

/// The default variant of `mode` at scale group `group` for `tokens` tokens (dense rows, or MoE
/// tokens), if one takes them: the first candidate of the mode and group with enough chunks (the
/// grouped modes: the first).
pub fn default_params(mode: GemvMode, group: u32, tokens: u32) -> Option<GemvW4Params> {
    GEMV_SPACE
        .iter()
        .find(|p| {
            p.mode == mode
                && p.group == group
                && (mode.grouped() || (max_tokens(p) >= tokens && (tokens > 8) == (p.chunks > 1)))
        })
        .copied()
}

/// Whether the GEMV takes scale group `group` (32, 64 or 128).
pub const fn takes_group(group: usize) -> bool {
    matches!(group, 32 | 64 | 128)
}

/// Output rows of one block: `16 mt`.
pub fn rows_per_block(p: &GemvW4Params) -> u32 {
    16 * p.mt
}

/// The grid: row slabs of the output rows (`n`, or `n / 2` for gate_up) in x, and in y for
/// `GateUp` the `ys` candidate leader pairs (the pairs), for the grouped modes the `ys` blocks
/// of `moe_align` (its `max_blocks` at `8 chunks` slots per block).
pub fn grid(p: &GemvW4Params, n: u32, ys: u32) -> (u32, u32, u32) {
    let rows = if p.mode.gate_up() { n / 2 } else { n };
    let y = if p.mode == GemvMode::GateUp || p.mode.grouped() {
        ys.max(1)
    } else {
        1
    };
    (rows.div_ceil(rows_per_block(p)).max(1), y, 1)
}

impl GemvW4Params {
    /// 8-row weight tiles of one k step (gate_up: gate and up).
    pub const fn tiles(&self) -> u32 {
        if self.mode.gate_up() {
            4 * self.mt
        } else {
            2 * self.mt
        }
    }

    /// Offset of the scale words (`sr`) in a k step of the ring: after the tiles and x.
    pub const fn scale_offset(&self) -> u32 {
        self.tiles() * 128 + if self.xr { 512 * self.chunks } else { 0 }
    }

    /// Words of one k step in a warp's ring: the 8-row weight tiles (512 bytes each), then
    /// with `xr` the `[8 chunks, 128]` bf16 x slice, then with `sr` the scale words
    /// `[tiles][32 lanes]`.
    pub const fn stage_words(&self) -> u32 {
        self.scale_offset() + if self.sr { 32 * self.tiles() } else { 0 }
    }

    /// Whether x is loaded a k step ahead into registers (without `xr`): one chunk always;
    /// two chunks only for `Dense` with at least two m16 tiles, whose dequantization hides the
    /// 32 more registers (7168->36864 at 16 rows: 71.1 -> 62.9 µs with three tiles, 85.6 -> 80.5
    /// with two; one tile and the MoE modes were slower).
    pub const fn x_ahead(&self) -> bool {
        !self.xr && (self.chunks == 1 || (matches!(self.mode, GemvMode::Dense) && self.mt >= 2))
    }

    /// Dynamic shared-memory bytes of the ring (every warp's `stages` k steps).
    pub const fn ring_bytes(&self) -> u32 {
        self.warps * self.stages * self.stage_words() * 4
    }

    /// Blocks per SM the registers must allow (`__launch_bounds__`' second argument; 0: ptxas
    /// decides). Three for the `Dense` 4-warp, three-tile, two-chunk variants (the 9-16-row
    /// default): they need about 160 registers, three blocks per SM, as measured, and without
    /// the bound ptxas squeezes them into 128 with a spill in the loop when their code shrinks
    /// a little (as it did when the loop's loads moved to sub-slices).
    pub const fn min_blocks(&self) -> u32 {
        if matches!(self.mode, GemvMode::Dense) && self.warps == 4 && self.mt == 3 && self.chunks == 2 {
            3
        } else {
            0
        }
    }
}
