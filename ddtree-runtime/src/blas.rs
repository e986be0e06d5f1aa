//! cuBLAS through cudarc for the dense bf16 products: row-major `nn.Linear` with bf16 or f32
//! output, and strided batches of per-head products (MLA's query absorption and output
//! un-absorption). f32 accumulation throughout.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType, cudaDataType_t};
use cudarc::cublas::{result, CudaBlas};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::{Gpu, RuntimeError};

/// Output element types of [`Blas`] products.
pub trait BlasOut: Copy {
    /// The cuBLAS data type.
    const TYPE: cudaDataType;
}

impl BlasOut for bf16 {
    const TYPE: cudaDataType = cudaDataType_t::CUDA_R_16BF;
}

impl BlasOut for f32 {
    const TYPE: cudaDataType = cudaDataType_t::CUDA_R_32F;
}

/// How the right operand of a [`Blas::batched`] product is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RightOperand {
    /// Row-major `[n, k]`, used transposed: `C = A . B^T` (an `nn.Linear` weight).
    Transposed,
    /// Row-major `[k, n]`: `C = A . B`.
    Plain,
}

/// One row-major operand of a strided batch: element offset of batch 0, row stride, and the
/// stride between batches (all in elements).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    /// Offset of batch 0's first element.
    pub offset: usize,
    /// Elements between consecutive rows.
    pub ld: usize,
    /// Elements between consecutive batches.
    pub stride: usize,
}

/// A strided batch of row-major products `C_b[m, n] = A_b[m, k] . op(B_b)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchedGemm {
    /// Rows of every `A_b` and `C_b`.
    pub m: usize,
    /// Columns of every `C_b`.
    pub n: usize,
    /// Reduction length.
    pub k: usize,
    /// Batches.
    pub batch: usize,
    /// `A` layout.
    pub a: Strided,
    /// `B` layout.
    pub b: Strided,
    /// How `B` is stored.
    pub b_op: RightOperand,
    /// `C` layout.
    pub c: Strided,
}

/// A cuBLAS handle on one stream of a GPU (one handle per stream: a handle's workspace is not
/// shared between concurrent streams).
pub struct Blas {
    handle: CudaBlas,
    stream: Arc<CudaStream>,
}

fn blas_err(what: &'static str) -> impl FnOnce(result::CublasError) -> RuntimeError {
    move |e| RuntimeError::Launch {
        kernel: format!("cublas {what}"),
        reason: format!("{e:?}"),
    }
}

impl Blas {
    /// A handle on `gpu`'s stream (loads the cuBLAS library).
    pub fn new(gpu: &Gpu) -> Result<Blas, RuntimeError> {
        Blas::on_stream(gpu.stream().clone())
    }

    /// A handle whose calls are enqueued on `stream`.
    pub fn on_stream(stream: Arc<CudaStream>) -> Result<Blas, RuntimeError> {
        Ok(Blas {
            handle: CudaBlas::new(stream.clone()).map_err(blas_err("init"))?,
            stream,
        })
    }

    /// Row-major `c[m, n] = a[m, k] . w[n, k]^T` (an `nn.Linear`), bf16 inputs, f32 accumulation,
    /// output `O`.
    ///
    /// # Safety
    /// `a`, `w` and `c` must hold at least `m * k`, `n * k` and `m * n` elements.
    pub unsafe fn linear<O: BlasOut>(
        &self,
        a: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        c: &mut impl DevicePtrMut<O>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), RuntimeError> {
        let g = BatchedGemm {
            m,
            n,
            k,
            batch: 1,
            a: Strided {
                offset: 0,
                ld: k,
                stride: 0,
            },
            b: Strided {
                offset: 0,
                ld: k,
                stride: 0,
            },
            b_op: RightOperand::Transposed,
            c: Strided {
                offset: 0,
                ld: n,
                stride: 0,
            },
        };
        // SAFETY: forwarded to the caller; the layout is dense.
        unsafe { self.batched(&g, a, w, c) }
    }

    /// The strided batch `g`: column-major cuBLAS computes `C_b^T = op(B_b)^T . A_b^T`.
    ///
    /// # Safety
    /// Every batch's operands must lie inside `a`, `b` and `c` as `g` describes them.
    pub unsafe fn batched<O: BlasOut>(
        &self,
        g: &BatchedGemm,
        a: &impl DevicePtr<bf16>,
        b: &impl DevicePtr<bf16>,
        c: &mut impl DevicePtrMut<O>,
    ) -> Result<(), RuntimeError> {
        let (pa, _ra) = a.device_ptr(&self.stream);
        let (pb, _rb) = b.device_ptr(&self.stream);
        let (pc, _rc) = c.device_ptr_mut(&self.stream);
        let elem = |p: u64, off: usize, size: usize| (p + (off * size) as u64) as *const c_void;
        let transa = match g.b_op {
            RightOperand::Transposed => cublasOperation_t::CUBLAS_OP_T,
            RightOperand::Plain => cublasOperation_t::CUBLAS_OP_N,
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let bf = cudaDataType_t::CUDA_R_16BF;
        // SAFETY: the pointers are live device buffers on this handle's stream; the caller
        // guarantees the extents.
        unsafe {
            result::gemm_strided_batched_ex(
                *self.handle.handle(),
                transa,
                cublasOperation_t::CUBLAS_OP_N,
                g.n as i32,
                g.m as i32,
                g.k as i32,
                (&alpha as *const f32).cast(),
                elem(pb, g.b.offset, 2),
                bf,
                g.b.ld as i32,
                g.b.stride as i64,
                elem(pa, g.a.offset, 2),
                bf,
                g.a.ld as i32,
                g.a.stride as i64,
                (&beta as *const f32).cast(),
                elem(pc, g.c.offset, std::mem::size_of::<O>()) as *mut c_void,
                O::TYPE,
                g.c.ld as i32,
                g.c.stride as i64,
                g.batch as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err("gemm"))
    }
}
