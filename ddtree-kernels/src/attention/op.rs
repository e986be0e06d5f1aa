//! Host ops of the attention family that the host can check in full: [`GqaAttentionOp`] and
//! [`MlaAbsorbOutputOp`]. (The MLA kernels that read positions or cache lengths on the device are
//! still launched directly.)

use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use ddtree_runtime::{CompiledKernel, RuntimeError};
use half::bf16;

use super::mla_absorb::output_grid;
use super::{GqaAttention, MlaAbsorbOutput};
use crate::op::{holds, require, size32};

/// Grouped-query attention without a mask over `keys` cached rows ([`GqaAttention`], one block
/// per (row, head)).
pub struct GqaAttentionOp<'a, Q, K, V, O> {
    /// Queries, `[rows, heads * head_dim]`.
    pub q: &'a Q,
    /// Keys, `[keys, kv_heads * head_dim]`.
    pub k: &'a K,
    /// Values, `[keys, kv_heads * head_dim]`.
    pub v: &'a V,
    /// Output, `[rows, heads * head_dim]`.
    pub out: &'a mut O,
    /// Query rows.
    pub rows: usize,
    /// Keys attended.
    pub keys: usize,
    /// Query heads (a multiple of `kv_heads`).
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Score scale.
    pub scale: f32,
}

impl<Q: DevicePtr<bf16>, K: DevicePtr<bf16>, V: DevicePtr<bf16>, O: DevicePtrMut<bf16>> GqaAttentionOp<'_, Q, K, V, O> {
    /// Checks the sizes and `heads % kv_heads == 0` and launches `kern` on `stream`.
    pub fn launch(self, kern: &CompiledKernel<GqaAttention>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = GqaAttention::NAME;
        let (rows, keys, h, kvh, hd) = (self.rows, self.keys, self.heads, self.kv_heads, self.head_dim);
        require(name, kvh >= 1 && h % kvh == 0, || {
            format!("{h} heads over {kvh} kv heads")
        })?;
        holds(name, "q", self.q, rows * h * hd)?;
        holds(name, "k", self.k, keys * kvh * hd)?;
        holds(name, "v", self.v, keys * kvh * hd)?;
        holds(name, "out", &*self.out, rows * h * hd)?;
        let grid = size32(name, "rows * heads", rows * h)?;
        let (rows, keys) = (size32(name, "rows", rows)?, size32(name, "keys", keys)?);
        let (h, kvh, hd) = (
            size32(name, "heads", h)?,
            size32(name, "kv_heads", kvh)?,
            size32(name, "head_dim", hd)?,
        );
        // SAFETY: sizes and the head grouping checked above.
        unsafe {
            GqaAttention::launch(
                kern, stream, grid, self.q, self.k, self.v, self.out, rows, keys, h, kvh, hd, self.scale,
            )
        }
    }
}

/// The absorbed MLA output projection ([`MlaAbsorbOutput`], grid [`output_grid`]):
/// `out[t, h * v + j] = o_lat[t, h] . kv_b[h, nope + j]` over the variant's latent width `lora`.
pub struct MlaAbsorbOutputOp<'a, L, W, O> {
    /// Latent attention output, `[rows, heads, lora]`.
    pub o_lat: &'a L,
    /// `kv_b_proj` weight, `[heads * (nope + v), lora]`.
    pub kv_b: &'a W,
    /// Output, `[rows, heads * v]`.
    pub out: &'a mut O,
    /// Tokens.
    pub rows: usize,
    /// Heads.
    pub heads: usize,
    /// Non-rope key width per head (the rows of `kv_b` before a head's value rows).
    pub nope: usize,
    /// Value width per head (a multiple of the variant's `cols`).
    pub v: usize,
}

impl<L: DevicePtr<bf16>, W: DevicePtr<bf16>, O: DevicePtrMut<bf16>> MlaAbsorbOutputOp<'_, L, W, O> {
    /// Checks the sizes and `v % cols == 0` and launches `kern` on `stream`.
    pub fn launch(self, kern: &CompiledKernel<MlaAbsorbOutput>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = MlaAbsorbOutput::NAME;
        let p = *kern.params();
        let (rows, heads, nope, v, lora) = (self.rows, self.heads, self.nope, self.v, p.lora as usize);
        require(name, v % p.cols as usize == 0, || {
            format!("v = {v} is not a multiple of {p:?}'s cols")
        })?;
        let w_head = (nope + v) * lora;
        holds(name, "o_lat", self.o_lat, rows * heads * lora)?;
        holds(name, "kv_b", self.kv_b, heads * w_head)?;
        holds(name, "out", &*self.out, rows * heads * v)?;
        let (rows, heads) = (size32(name, "rows", rows)?, size32(name, "heads", heads)?);
        let (nope, v, w_head) = (
            size32(name, "nope", nope)?,
            size32(name, "v", v)?,
            size32(name, "w_head", w_head)?,
        );
        let grid = output_grid(&p, heads, v);
        // SAFETY: sizes and the column split checked above.
        unsafe {
            MlaAbsorbOutput::launch(
                kern, stream, grid, self.o_lat, self.kv_b, self.out, rows, heads, nope, v, w_head,
            )
        }
    }
}
