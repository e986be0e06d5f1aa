//! Host ops of the attention family: [`GqaAttentionOp`] and [`MlaAbsorbOutputOp`], checked in
//! full on the host, and [`MlaKvAppendOp`], [`MlaAttentionOp`] and [`MlaAbsorbQueryOp`], whose
//! `launch` stays `unsafe`: they read positions or the cache length on the device.

use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use ddtree_runtime::{CompiledKernel, RuntimeError};
use half::bf16;

use super::mla_absorb::{output_grid, query_grid};
use super::{GqaAttention, MlaAbsorbOutput, MlaAbsorbQuery, MlaAttention, MlaKvAppend};
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

/// Appends `rows` latent rows to a layer of the MLA cache at the length `lens[0]` (read on the
/// device): the first `lora` values RMS-normalized by `norm`, the last `rope` rotated to each
/// token's position ([`MlaKvAppend`], one block per row).
pub struct MlaKvAppendOp<'a, A, N, P, T, C, L> {
    /// New rows, `[rows, lora + rope]`.
    pub kv_a: &'a A,
    /// Latent norm scale, `[lora]`.
    pub norm: &'a N,
    /// Position of each row, `[rows]`.
    pub positions: &'a P,
    /// Cosine table, `[max_pos, rope / 2]`.
    pub cos: &'a T,
    /// Sine table, `[max_pos, rope / 2]`.
    pub sin: &'a T,
    /// The layer's cache, `[capacity, lora + rope]`.
    pub cache: &'a mut C,
    /// The cache length before the append, `[1]`.
    pub lens: &'a L,
    /// Rows appended.
    pub rows: usize,
    /// Latent width.
    pub lora: usize,
    /// Rope width (even).
    pub rope: usize,
    /// Added to the mean square.
    pub eps: f32,
}

impl<A, N, P, T, C, L> MlaKvAppendOp<'_, A, N, P, T, C, L>
where
    A: DevicePtr<bf16>,
    N: DevicePtr<bf16>,
    P: DevicePtr<u32>,
    T: DevicePtr<f32>,
    C: DevicePtrMut<bf16>,
    L: DevicePtr<u32>,
{
    /// Checks what the host can see (input sizes, `rope` even, `vec` widths) and launches `k`.
    ///
    /// # Safety
    /// `lens[0] + rows` rows fit the cache, and every position is a row of the tables.
    pub unsafe fn launch(self, k: &CompiledKernel<MlaKvAppend>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = MlaKvAppend::NAME;
        let (rows, lora, rope) = (self.rows, self.lora, self.rope);
        require(name, rope % 2 == 0, || format!("rope = {rope} is odd"))?;
        require(name, !k.params().vec || (lora % 8 == 0 && rope % 8 == 0), || {
            format!("{:?} needs lora and rope multiples of 8: {lora}, {rope}", k.params())
        })?;
        holds(name, "kv_a", self.kv_a, rows * (lora + rope))?;
        holds(name, "norm", self.norm, lora)?;
        holds(name, "positions", self.positions, rows)?;
        holds(name, "lens", self.lens, 1)?;
        let (r, lora, rope) = (
            size32(name, "rows", rows)?,
            size32(name, "lora", lora)?,
            size32(name, "rope", rope)?,
        );
        // SAFETY: inputs checked above; the cache room and the table rows are the caller's contract.
        unsafe {
            MlaKvAppend::launch(
                k,
                stream,
                r,
                self.kv_a,
                self.norm,
                self.positions,
                self.cos,
                self.sin,
                self.cache,
                self.lens,
                r,
                lora,
                rope,
                self.eps,
            )
        }
    }
}

/// Absorbed-MLA attention of `nodes` query rows over a layer's latent cache of `lens[0]` prefix
/// rows plus the `nodes` new ones, under a tree mask ([`MlaAttention`], one block per (node,
/// head)).
pub struct MlaAttentionOp<'a, Q, C, M, O, L> {
    /// Queries, `[nodes, heads, lora + rope]`.
    pub q: &'a Q,
    /// The layer's cache, `[prefix + nodes, lora + rope]` at least.
    pub cache: &'a C,
    /// Tree mask, `[nodes, words]`.
    pub mask: &'a M,
    /// Output, `[nodes, heads, lora]`.
    pub out: &'a mut O,
    /// The prefix length, `[1]`.
    pub lens: &'a L,
    /// Heads.
    pub heads: usize,
    /// Query rows (new cache rows).
    pub nodes: usize,
    /// Mask words per node.
    pub words: usize,
    /// Latent width.
    pub lora: usize,
    /// Rope width.
    pub rope: usize,
    /// Score scale.
    pub scale: f32,
}

impl<Q, C, M, O, L> MlaAttentionOp<'_, Q, C, M, O, L>
where
    Q: DevicePtr<bf16>,
    C: DevicePtr<bf16>,
    M: DevicePtr<u32>,
    O: DevicePtrMut<bf16>,
    L: DevicePtr<u32>,
{
    /// Checks what the host can see and launches `k` on `stream`.
    ///
    /// # Safety
    /// The cache holds `lens[0] + nodes` rows (the prefix length lives on the device).
    pub unsafe fn launch(self, k: &CompiledKernel<MlaAttention>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = MlaAttention::NAME;
        let (heads, nodes, words, lora, rope) = (self.heads, self.nodes, self.words, self.lora, self.rope);
        require(name, words * 32 >= nodes, || {
            format!("{words} mask words for {nodes} nodes")
        })?;
        holds(name, "q", self.q, nodes * heads * (lora + rope))?;
        holds(name, "cache", self.cache, nodes * (lora + rope))?;
        holds(name, "mask", self.mask, nodes * words)?;
        holds(name, "out", &*self.out, nodes * heads * lora)?;
        holds(name, "lens", self.lens, 1)?;
        let grid = size32(name, "nodes * heads", nodes * heads)?;
        let (heads, nodes, words) = (
            size32(name, "heads", heads)?,
            size32(name, "nodes", nodes)?,
            size32(name, "words", words)?,
        );
        let (lora, rope) = (size32(name, "lora", lora)?, size32(name, "rope", rope)?);
        // SAFETY: host-side sizes checked above; the prefix rows are the caller's contract.
        unsafe {
            MlaAttention::launch(
                k, stream, grid, self.q, self.cache, self.mask, self.out, self.lens, heads, nodes, words, lora, rope,
                self.scale,
            )
        }
    }
}

/// The absorbed MLA query ([`MlaAbsorbQuery`], grid [`query_grid`]): the non-rope dims of each
/// head projected through `W_UK` into the latent space, the rope dims rotated to each token's
/// position; `out` is `[rows, heads, lora + rope]` (the variant's `nope` and `rope`).
pub struct MlaAbsorbQueryOp<'a, Q, W, P, T, O> {
    /// Queries, `[rows, heads, nope + rope]`.
    pub q: &'a Q,
    /// `kv_b_proj` weight, `[heads * (nope + v), lora]`.
    pub kv_b: &'a W,
    /// Position of each token, `[rows]`.
    pub positions: &'a P,
    /// Cosine table, `[max_pos, rope / 2]`.
    pub cos: &'a T,
    /// Sine table, `[max_pos, rope / 2]`.
    pub sin: &'a T,
    /// Output, `[rows, heads, lora + rope]`.
    pub out: &'a mut O,
    /// Tokens.
    pub rows: usize,
    /// Heads.
    pub heads: usize,
    /// Latent width (a multiple of the variant's `cols`).
    pub lora: usize,
    /// Value width per head (with `nope`, the rows of a head in `kv_b`).
    pub v: usize,
}

impl<Q, W, P, T, O> MlaAbsorbQueryOp<'_, Q, W, P, T, O>
where
    Q: DevicePtr<bf16>,
    W: DevicePtr<bf16>,
    P: DevicePtr<u32>,
    T: DevicePtr<f32>,
    O: DevicePtrMut<bf16>,
{
    /// Checks what the host can see (sizes, `lora % cols == 0`) and launches `k` on `stream`.
    ///
    /// # Safety
    /// Every position (on the device) is a row of the tables.
    pub unsafe fn launch(
        self,
        k: &CompiledKernel<MlaAbsorbQuery>,
        stream: &Arc<CudaStream>,
    ) -> Result<(), RuntimeError> {
        let name = MlaAbsorbQuery::NAME;
        let p = *k.params();
        let (rows, heads, lora, v) = (self.rows, self.heads, self.lora, self.v);
        let (nope, rope) = (p.nope as usize, p.rope as usize);
        require(name, lora % p.cols as usize == 0, || {
            format!("lora = {lora} is not a multiple of {p:?}'s cols")
        })?;
        let w_head = (nope + v) * lora;
        holds(name, "q", self.q, rows * heads * (nope + rope))?;
        holds(name, "kv_b", self.kv_b, heads * w_head)?;
        holds(name, "positions", self.positions, rows)?;
        holds(name, "out", &*self.out, rows * heads * (lora + rope))?;
        let (rows, heads) = (size32(name, "rows", rows)?, size32(name, "heads", heads)?);
        let (lora, w_head) = (size32(name, "lora", lora)?, size32(name, "w_head", w_head)?);
        let grid = query_grid(&p, heads, lora);
        // SAFETY: sizes checked above; the table rows are the caller's contract.
        unsafe {
            MlaAbsorbQuery::launch(
                k,
                stream,
                grid,
                self.q,
                self.kv_b,
                self.positions,
                self.cos,
                self.sin,
                self.out,
                rows,
                heads,
                lora,
                w_head,
            )
        }
    }
}
