//! Tree-verify attention in MLA absorbed form (FlashMLA-style split-KV + combine), and a naive
//! per-(node, head) kernel for comparison.
//!
//! Query rows are `(node, head)` pairs, `rows = nodes * heads`, each 576 wide (512 latent +
//! 64 rope). Keys are the `prefix + nodes` cache rows; row `r` sees every prefix row and the
//! tree rows `prefix + t` whose bit `t` is set in its node's mask row. The value of a key is
//! its first 512 entries. The prefix length is read on the device (`lens[0]`), so a launch can
//! be captured in a CUDA graph and replayed as the context grows; the grid is sized on the host
//! from an upper bound.
//!
//! [`MlaVerifySplit`]: one block holds `16 * rg` query rows (all 64 heads of a node at
//! `rg = 4`) in shared memory and streams one chunk of the keys (grid y = splits) once through a
//! `stages`-deep `cp.async` ring of `bn`-key tiles in dynamic shared memory, so each KV byte is
//! read from DRAM once per split for up to 64 rows. Tensor cores (`mma.sync` m16n8k16 bf16,
//! operands through `ldmatrix`): per row group of 16 rows, four warps split the 576-dim score
//! reduction (summed through shared memory in a fixed order, so they agree), and each then owns
//! 128 of the 512 output columns for `P V`; online softmax in f32. [`MlaVerifyWide`]: the same
//! split pass with each warp doing the whole 576-dim score reduction for its 16 rows and part of
//! the tile's keys, the probabilities passed through a bf16 tile in shared memory, and each warp
//! owning 64 output columns of every row for `P V` (each value byte read from shared memory once
//! per tile). [`MlaVerifyCombine`] merges the split partials (bf16) by their log-sum-exp;
//! [`MlaCombineOutput`] merges them inside the absorbed output projection (the decode step).

use ddtree_codegen::Kernel;

mod combine;
mod naive;
mod narrow;
mod split;
mod wg;
mod wide;

pub use combine::*;
pub use naive::*;
pub use narrow::*;
pub use split::*;
pub use wg::*;
pub use wide::*;

/// A split-pass variant: [`MlaVerifySplit`], [`MlaVerifyWide`], [`MlaVerifyWg`] or
/// [`MlaVerifyNarrow`]. All take the same arguments and grid shape (rows per block aside) and
/// write the same partials for [`MlaVerifyCombine`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyVariant {
    /// The dim-split kernel.
    Split(VerifyParams),
    /// The full-width kernel.
    Wide(WideParams),
    /// The warpgroup (`wgmma`) kernel.
    Wg(WgParams),
    /// The kernel for at most 8 rows per block (keys as the `mma` M, bulk copies).
    Narrow,
}

impl Default for VerifyVariant {
    /// The safe default: the full-width kernel's first candidate.
    fn default() -> VerifyVariant {
        VerifyVariant::Wide(MlaVerifyWide::default_params())
    }
}

impl VerifyVariant {
    /// Every candidate of every kernel, the default first.
    pub fn all() -> Vec<VerifyVariant> {
        let wide = MlaVerifyWide::space().into_iter().map(VerifyVariant::Wide);
        wide.chain(MlaVerifySplit::space().into_iter().map(VerifyVariant::Split))
            .chain(MlaVerifyWg::space().into_iter().map(VerifyVariant::Wg))
            .chain(std::iter::once(VerifyVariant::Narrow))
            .collect()
    }

    /// Whether the variant runs on a GPU of compute capability `cc` (`Wg`:
    /// [`crate::wgmma_supported`]; `Narrow`: sm_90 and later, for the bulk copies).
    pub fn runs_on(&self, cc: (i32, i32)) -> bool {
        match self {
            VerifyVariant::Wg(_) => crate::wgmma_supported(cc),
            VerifyVariant::Narrow => cc.0 >= 9,
            _ => true,
        }
    }

    /// Query rows per block.
    pub fn rows_per_block(&self) -> u32 {
        match self {
            VerifyVariant::Split(p) => p.rows_per_block(),
            VerifyVariant::Wide(p) => p.rows_per_block(),
            VerifyVariant::Wg(p) => p.rows_per_block(),
            VerifyVariant::Narrow => 8,
        }
    }

    /// Keys per tile.
    pub fn bn(&self) -> u32 {
        match self {
            VerifyVariant::Split(p) => p.bn,
            VerifyVariant::Wide(p) => p.bn,
            VerifyVariant::Wg(p) => p.bn,
            VerifyVariant::Narrow => NARROW_BN,
        }
    }

    /// The kernel symbol.
    pub fn symbol(&self) -> String {
        match self {
            VerifyVariant::Split(p) => MlaVerifySplit::symbol(p),
            VerifyVariant::Wide(p) => MlaVerifyWide::symbol(p),
            VerifyVariant::Wg(p) => MlaVerifyWg::symbol(p),
            VerifyVariant::Narrow => MlaVerifyNarrow::symbol(&()),
        }
    }
}
