//! Runtime errors.

use ddtree_codegen::CodegenError;

/// Everything that can go wrong between a kernel's source and its launch.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// `libcuda` could not be loaded: no NVIDIA driver on this machine.
    #[error("no CUDA driver: libcuda.so could not be loaded (no NVIDIA GPU or driver on this machine)")]
    NoDriver,
    /// The driver loaded but reports no device with this ordinal.
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoDevice {
        /// Requested ordinal.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },
    /// `libnvrtc` could not be loaded.
    #[error("NVRTC not found: libnvrtc.so.13 (or .12) is not on the loader path; install the CUDA toolkit or the `nvidia-cuda-nvrtc` wheel and add its lib folder to LD_LIBRARY_PATH")]
    NoNvrtc,
    /// A driver call failed.
    #[error("CUDA driver error while {context}: {source}")]
    Driver {
        /// What was being done.
        context: String,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// Building the kernel's IR failed (invalid parameters or a DSL error).
    #[error(transparent)]
    Codegen(#[from] CodegenError),
    /// NVRTC rejected the generated source.
    #[error("NVRTC failed to compile `{kernel}` with options [{options}]:\n{log}\n--- source around the error ---\n{excerpt}")]
    Compile {
        /// Kernel symbol.
        kernel: String,
        /// Options passed to NVRTC.
        options: String,
        /// NVRTC's log.
        log: String,
        /// Numbered source lines around each error line (the whole source if none is named).
        excerpt: String,
    },
    /// A launch would exceed the device's or the kernel's resources.
    #[error("cannot launch `{kernel}`: {reason}")]
    Launch {
        /// Kernel symbol.
        kernel: String,
        /// Why.
        reason: String,
    },
}

impl RuntimeError {
    pub(crate) fn driver(context: impl Into<String>) -> impl FnOnce(cudarc::driver::DriverError) -> RuntimeError {
        let context = context.into();
        move |source| RuntimeError::Driver { context, source }
    }
}
