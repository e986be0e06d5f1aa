//! Runtime errors.

use std::path::PathBuf;

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
    /// A launch failed for a reason outside the resource checks (e.g. a library call).
    #[error("cannot launch `{kernel}`: {reason}")]
    Launch {
        /// Kernel symbol.
        kernel: String,
        /// Why.
        reason: String,
    },
    /// A variant or launch would exceed the device's or the compiled kernel's resources.
    #[error("cannot launch `{kernel}`: {limit}")]
    Resources {
        /// Kernel symbol.
        kernel: String,
        /// Which limit, with the numbers.
        #[source]
        limit: ResourceLimit,
    },
    /// Reading or writing a cache file failed.
    #[error("{context} `{}`: {source}", path.display())]
    Io {
        /// What was being done.
        context: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// A launch resource that a kernel variant or a grid exceeds.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ResourceLimit {
    /// More threads per block than the compiled kernel allows (its register use limits it).
    #[error("{threads} threads per block, but the compiled kernel allows {max} ({registers} registers per thread)")]
    Threads {
        /// Threads per block requested.
        threads: u32,
        /// The kernel's maximum.
        max: u32,
        /// Registers per thread.
        registers: u32,
    },
    /// More static shared memory per block than the device offers.
    #[error("{bytes} B of shared memory per block, but the device allows {max} B")]
    SharedMemory {
        /// Bytes per block.
        bytes: u32,
        /// The device's maximum per block.
        max: u32,
    },
    /// More registers per block than the device's register file holds.
    #[error("{registers} registers per thread x {threads} threads = {} per block, but the device has {max}", *registers as u64 * *threads as u64)]
    Registers {
        /// Registers per thread.
        registers: u32,
        /// Threads per block.
        threads: u32,
        /// Registers per block on the device.
        max: u32,
    },
    /// An empty grid or one beyond the device's grid limits.
    #[error("grid {grid:?} is empty or exceeds the device limits {max:?}")]
    Grid {
        /// The grid requested.
        grid: [u32; 3],
        /// The device's maximum per dimension.
        max: [u32; 3],
    },
}

impl RuntimeError {
    /// Wraps a driver error with what was being done: `.map_err(RuntimeError::driver("copying"))`.
    pub fn driver(context: impl Into<String>) -> impl FnOnce(cudarc::driver::DriverError) -> RuntimeError {
        let context = context.into();
        move |source| RuntimeError::Driver { context, source }
    }

    pub(crate) fn io(context: &'static str, path: &std::path::Path) -> impl FnOnce(std::io::Error) -> RuntimeError {
        let path = path.to_path_buf();
        move |source| RuntimeError::Io { context, path, source }
    }
}
