//! The CUDA backend's device-side values.

use std::sync::{Arc, Mutex};

use ddtree_runtime::cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use half::bf16;

/// A device buffer of bf16 activations or f32 results (logits, router scores).
#[derive(Debug)]
pub enum DeviceData {
    /// bf16 (activations, features).
    Bf16(CudaSlice<bf16>),
    /// f32 (outputs of [`crate::Backend::linear_f32`]).
    F32(CudaSlice<f32>),
}

/// A row-major `[rows, cols]` matrix on the GPU.
#[derive(Debug)]
pub struct CudaTensor {
    /// Rows (tokens).
    pub rows: usize,
    /// Columns (features).
    pub cols: usize,
    /// The values.
    pub data: DeviceData,
}

impl CudaTensor {
    /// The bf16 values, or an error naming `op` for an f32 tensor.
    pub(super) fn bf16(&self, op: &str) -> crate::Result<&CudaSlice<bf16>> {
        match &self.data {
            DeviceData::Bf16(d) => Ok(d),
            DeviceData::F32(_) => Err(super::fail(format!("{op}: expects bf16 activations, got f32"))),
        }
    }

    /// The bf16 values, writable.
    pub(super) fn bf16_mut(&mut self, op: &str) -> crate::Result<&mut CudaSlice<bf16>> {
        match &mut self.data {
            DeviceData::Bf16(d) => Ok(d),
            DeviceData::F32(_) => Err(super::fail(format!("{op}: expects bf16 activations, got f32"))),
        }
    }

    /// The f32 values, or an error naming `op`.
    pub(super) fn f32(&self, op: &str) -> crate::Result<&CudaSlice<f32>> {
        match &self.data {
            DeviceData::F32(d) => Ok(d),
            DeviceData::Bf16(_) => Err(super::fail(format!("{op}: expects f32 values, got bf16"))),
        }
    }
}

/// A 1-D parameter in both precisions the kernels read (norm weights in bf16, routing bias in
/// f32); these are small.
#[derive(Debug)]
pub struct CudaVector {
    /// Length.
    pub len: usize,
    /// bf16 copy.
    pub bf16: CudaSlice<bf16>,
    /// f32 copy.
    pub f32: CudaSlice<f32>,
}

/// A linear layer's weight on the GPU.
#[derive(Debug)]
pub enum CudaWeight {
    /// bf16 `[out, in]`, row-major (cuBLAS).
    Dense {
        /// Output features.
        out: usize,
        /// Input features.
        inp: usize,
        /// The values.
        w: CudaSlice<bf16>,
    },
    /// INT4 in the interleaved tiled layout of `w4a16_gemm`, with bf16 group scales as words.
    Int4 {
        /// Output features.
        out: usize,
        /// Input features.
        inp: usize,
        /// Scale group size along `in`.
        group: usize,
        /// Packed words ([`ddtree_kernels::w4a16::layout::interleaved_words`]).
        packed: CudaSlice<u32>,
        /// Scales `[out, in / group]`, two bf16 per word.
        scales: CudaSlice<u32>,
    },
}

impl CudaWeight {
    /// `(out, in)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Self::Dense { out, inp, .. } | Self::Int4 { out, inp, .. } => (*out, *inp),
        }
    }
}

/// A layer's routed experts stacked for the grouped MoE kernels: fused gate_up `[E, 2I, H]`
/// (gate rows then up rows per expert) and down `[E, H, I]`, INT4 in the interleaved layout.
#[derive(Debug)]
pub struct CudaExperts {
    /// Experts.
    pub count: usize,
    /// Intermediate size I.
    pub inter: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Scale group size.
    pub group: usize,
    /// gate_up words.
    pub w13: CudaSlice<u32>,
    /// gate_up scales as words.
    pub s13: CudaSlice<u32>,
    /// down words.
    pub w2: CudaSlice<u32>,
    /// down scales as words.
    pub s2: CudaSlice<u32>,
}

/// Buffers of dropped caches, kept for the next cache of the same size: a new request then
/// gets the same device address, so the CUDA graphs recorded on the last one still apply.
pub(crate) type CachePool = Arc<Mutex<Vec<CudaSlice<bf16>>>>;

/// The latent cache of every layer in one buffer `[layers, capacity, width]`.
#[derive(Debug)]
pub struct CudaKvCache {
    /// Values per row.
    pub width: usize,
    /// Rows per layer.
    pub capacity: usize,
    /// Rows held by each layer.
    pub lens: Vec<usize>,
    /// The rows (always `Some` until dropped).
    pub(crate) buf: Option<CudaSlice<bf16>>,
    /// Where the buffer goes when the cache is dropped.
    pub(crate) pool: CachePool,
    /// Counts this cache in [`crate::backend::live_kv_caches`].
    pub(crate) _live: crate::backend::LiveCache,
}

impl CudaKvCache {
    /// Every layer's rows.
    pub fn buf(&self) -> &CudaSlice<bf16> {
        self.buf.as_ref().expect("a live cache holds its buffer")
    }

    /// Every layer's rows, writable.
    pub fn buf_mut(&mut self) -> &mut CudaSlice<bf16> {
        self.buf.as_mut().expect("a live cache holds its buffer")
    }

    /// Layer `l`'s rows.
    pub fn layer(&self, l: usize) -> CudaView<'_, bf16> {
        let per = self.capacity * self.width;
        self.buf().slice(l * per..(l + 1) * per)
    }

    /// Layer `l`'s rows, writable.
    pub fn layer_mut(&mut self, l: usize) -> CudaViewMut<'_, bf16> {
        let per = self.capacity * self.width;
        self.buf_mut().slice_mut(l * per..(l + 1) * per)
    }
}

impl Drop for CudaKvCache {
    fn drop(&mut self) {
        if let (Some(buf), Ok(mut pool)) = (self.buf.take(), self.pool.lock()) {
            // One spare: the most recent.
            pool.clear();
            pool.push(buf);
        }
    }
}

/// Expert choices `[tokens, topk]` and their weights, on the GPU.
#[derive(Debug)]
pub struct CudaRouting {
    /// Tokens.
    pub tokens: usize,
    /// Experts per token.
    pub topk: usize,
    /// Expert ids.
    pub ids: CudaSlice<u32>,
    /// Router weights.
    pub weights: CudaSlice<f32>,
}
