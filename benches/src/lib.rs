//! Pieces shared by the GPU check and bench binaries in `src/bin/`.

use std::process::ExitCode;

use cudarc::cublas::{Gemm, GemmConfig};
use cudarc::driver::CudaSlice;
use ddtree_runtime::timing::median_us;
use ddtree_runtime::{Gpu, RuntimeError};
use half::bf16;

/// Device-to-device copy bandwidth in GB/s (bytes read + written), median of 10 copies of 1 GiB.
pub fn copy_bandwidth(gpu: &Gpu) -> Result<f64, RuntimeError> {
    let s = gpu.stream();
    let n = 1usize << 30;
    let src = s.alloc_zeros::<u8>(n).map_err(RuntimeError::driver("allocating"))?;
    let mut dst = s.alloc_zeros::<u8>(n).map_err(RuntimeError::driver("allocating"))?;
    let us = median_us(s, 3, 10, |_| {
        s.memcpy_dtod(&src, &mut dst).map_err(RuntimeError::driver("copying"))
    })?;
    Ok(2.0 * n as f64 / (us * 1e-6) / 1e9)
}

/// The exit code of a run that returns whether every check passed.
pub fn exit_code(run: Result<bool, RuntimeError>) -> ExitCode {
    match run {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("some checks FAILED");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// cuBLAS bf16 GEMM (f32 compute) as the peer for our kernels.
pub struct Cublas(cudarc::cublas::CudaBlas);

impl Cublas {
    /// A cuBLAS handle on `gpu`'s stream.
    pub fn new(gpu: &Gpu) -> Result<Self, RuntimeError> {
        cudarc::cublas::CudaBlas::new(gpu.stream().clone())
            .map(Cublas)
            .map_err(blas_err)
    }

    /// Row-major `c[m, n] = a[m, k] . b[n, k]^T` (an `nn.Linear`), i.e. column-major
    /// `C^T = B . A^T`.
    ///
    /// # Safety
    /// `a`, `b` and `c` must hold at least `m * k`, `n * k` and `m * n` elements.
    pub unsafe fn linear(
        &self,
        a: &CudaSlice<bf16>,
        b: &CudaSlice<bf16>,
        c: &mut CudaSlice<bf16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), RuntimeError> {
        use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let cfg = GemmConfig {
            transa: CUBLAS_OP_T,
            transb: CUBLAS_OP_N,
            m: n as i32,
            n: m as i32,
            k: k as i32,
            alpha: bf16::ONE,
            lda: k as i32,
            ldb: k as i32,
            beta: bf16::ZERO,
            ldc: n as i32,
        };
        // SAFETY: the caller guarantees the sizes; the config matches them.
        unsafe { self.0.gemm(cfg, b, a, c) }.map_err(blas_err)
    }
}

fn blas_err(e: cudarc::cublas::result::CublasError) -> RuntimeError {
    RuntimeError::Launch {
        kernel: "cublas".into(),
        reason: format!("{e:?}"),
    }
}
