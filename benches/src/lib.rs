//! Pieces shared by the GPU check and bench binaries in `src/bin/`.

use std::process::ExitCode;

use ddtree_runtime::timing::median_us;
use ddtree_runtime::{Gpu, RuntimeError};

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
