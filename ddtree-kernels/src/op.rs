//! What the host ops share: the argument checks that make their launches safe.
//!
//! Every kernel family has an `op.rs` with a struct of named arguments (or a small runner type,
//! as [`crate::TopkRunner`]) whose `launch` checks the buffer lengths and the variant's
//! constraints against the sizes it is given, then calls the kernel's `unsafe` launcher. Callers
//! (the engine's CUDA backend, the benches, the tuner) use those instead of positional
//! `K::launch` calls. Where a kernel trusts device-side data the host cannot see (row indices, for
//! example), the op's `launch` stays `unsafe` and says what the caller guarantees.

use ddtree_runtime::cudarc::driver::DeviceSlice;
use ddtree_runtime::RuntimeError;

/// A launch refused before it reached the GPU.
pub(crate) fn refuse(kernel: &str, reason: String) -> RuntimeError {
    RuntimeError::Launch {
        kernel: kernel.into(),
        reason,
    }
}

/// Checks that `buf`, argument `what` of `kernel`, holds at least `need` elements.
pub(crate) fn holds<T>(kernel: &str, what: &str, buf: &impl DeviceSlice<T>, need: usize) -> Result<(), RuntimeError> {
    if buf.len() < need {
        return Err(refuse(
            kernel,
            format!(
                "`{what}` holds {} elements, the launch reads or writes {need}",
                buf.len()
            ),
        ));
    }
    Ok(())
}

/// `v`, size argument `what` of `kernel`, as the kernel's `u32`.
pub(crate) fn size32(kernel: &str, what: &str, v: usize) -> Result<u32, RuntimeError> {
    u32::try_from(v).map_err(|_| refuse(kernel, format!("`{what}` = {v} does not fit the kernel's u32")))
}

/// Checks a condition of the launch, refusing it with `reason` otherwise.
pub(crate) fn require(kernel: &str, ok: bool, reason: impl FnOnce() -> String) -> Result<(), RuntimeError> {
    if ok {
        Ok(())
    } else {
        Err(refuse(kernel, reason()))
    }
}
