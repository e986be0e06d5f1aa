//! Host ops of MoE routing: [`MoeRouteOp`], [`MoeLocalizeOp`].

use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use ddtree_runtime::{CompiledKernel, RuntimeError};

use super::localize::grid;
use super::{MoeLocalize, MoeRoute, MAX_EXPERTS, MAX_GROUPS, MAX_TOPK};
use crate::op::{holds, require, size32};

/// DeepSeek-V3 `noaux_tc` routing of `tokens` tokens ([`MoeRoute`], one block per token): the
/// `topk` best experts of each token, best first, and their weights.
pub struct MoeRouteOp<'a, L, B, I, W> {
    /// Router logits, `[tokens, experts]`.
    pub logits: &'a L,
    /// Correction bias, `[experts]`.
    pub bias: &'a B,
    /// Chosen experts, `[tokens, topk]`.
    pub ids: &'a mut I,
    /// Their weights, `[tokens, topk]`.
    pub weights: &'a mut W,
    /// Tokens.
    pub tokens: usize,
    /// Experts.
    pub experts: usize,
    /// Experts per token.
    pub topk: usize,
    /// Expert groups (1: no group selection).
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// Whether the weights are divided by their sum.
    pub norm: bool,
    /// Factor on the weights.
    pub scale: f32,
}

impl<L: DevicePtr<f32>, B: DevicePtr<f32>, I: DevicePtrMut<u32>, W: DevicePtrMut<f32>> MoeRouteOp<'_, L, B, I, W> {
    /// Checks the sizes and the kernel's limits (`experts <= 1024`, `1 <= topk <= min(16,
    /// experts)`; with groups `experts % n_group == 0`, `n_group <= 32`, `topk_group <=
    /// n_group`) and launches `k` on `stream`.
    pub fn launch(self, k: &CompiledKernel<MoeRoute>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = MoeRoute::NAME;
        let (t, e, topk, g, tg) = (self.tokens, self.experts, self.topk, self.n_group, self.topk_group);
        holds(name, "logits", self.logits, t * e)?;
        holds(name, "bias", self.bias, e)?;
        holds(name, "ids", &*self.ids, t * topk)?;
        holds(name, "weights", &*self.weights, t * topk)?;
        require(name, e <= MAX_EXPERTS as usize, || {
            format!("{e} experts, at most {MAX_EXPERTS}")
        })?;
        require(name, topk >= 1 && topk <= (MAX_TOPK as usize).min(e), || {
            format!("top-{topk} of {e} experts (at most {MAX_TOPK})")
        })?;
        require(
            name,
            g <= 1 || (e % g == 0 && g <= MAX_GROUPS as usize && tg <= g),
            || format!("{e} experts in {g} groups keeping {tg} (at most {MAX_GROUPS} groups)"),
        )?;
        let (tokens, experts, topk) = (
            size32(name, "tokens", t)?,
            size32(name, "experts", e)?,
            size32(name, "topk", topk)?,
        );
        let (n_group, topk_group) = (size32(name, "n_group", g)?, size32(name, "topk_group", tg)?);
        // SAFETY: sizes and the kernel's limits checked above.
        unsafe {
            MoeRoute::launch(
                k,
                stream,
                tokens,
                self.logits,
                self.bias,
                self.ids,
                self.weights,
                experts,
                topk,
                n_group,
                topk_group,
                u32::from(self.norm),
                self.scale,
            )
        }
    }
}

/// One expert-parallel rank's view of a routing, in place ([`MoeLocalize`]): choices of experts
/// in `local` renumbered from 0, the others set to `local.len()` (an id the MoE kernels skip)
/// with weight 0.
pub struct MoeLocalizeOp<'a, I, W> {
    /// Chosen experts, `[choices]`.
    pub ids: &'a mut I,
    /// Their weights, `[choices]`.
    pub weights: &'a mut W,
    /// Choices (tokens x top-k).
    pub choices: usize,
    /// The rank's experts.
    pub local: std::ops::Range<usize>,
}

impl<I: DevicePtrMut<u32>, W: DevicePtrMut<f32>> MoeLocalizeOp<'_, I, W> {
    /// Checks the sizes and launches `k` on `stream`.
    pub fn launch(self, k: &CompiledKernel<MoeLocalize>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = MoeLocalize::NAME;
        holds(name, "ids", &*self.ids, self.choices)?;
        holds(name, "weights", &*self.weights, self.choices)?;
        require(name, self.local.start <= self.local.end, || {
            format!("expert range {:?}", self.local)
        })?;
        let n = size32(name, "choices", self.choices)?;
        let (lo, hi) = (
            size32(name, "local.start", self.local.start)?,
            size32(name, "local.end", self.local.end)?,
        );
        // SAFETY: both buffers hold `choices` values (checked above); the kernel strides over them.
        unsafe {
            MoeLocalize::launch(
                k,
                stream,
                grid(k.params(), self.choices),
                self.ids,
                self.weights,
                n,
                lo,
                hi,
            )
        }
    }
}
