//! CUDA runtime for ddtree kernels: device discovery that never panics, NVRTC compilation to
//! cubin through an on-disk cache, typed launches with resource checks, an autotuner with a
//! per-GPU tune cache, and the startup API that hands out tuned variants.
//!
//! It knows no particular kernel: everything is generic over [`ddtree_codegen::Kernel`] and,
//! for tuning, [`Tunable`].
//!
//! - [`Gpu::open`] / [`Gpu::discover`]: the device, its [`Fingerprint`] and [`DeviceLimits`];
//! - [`Jit`] and [`CubinCache`]: NVRTC to cubin, cached under [`cache_root`];
//! - [`Gpu::compile`] / [`Gpu::compile_many`]: loaded [`CompiledKernel`]s;
//! - [`Tunable`], [`Tuner`], [`TuneCache`]: benchmark and check every candidate, keep the winner;
//! - [`TunedKernels`]: "the tuned variant of kernel K at key X", with the default on a miss.
#![warn(missing_docs)]

pub mod blas;
mod cache;
mod device;
mod error;
mod jit;
mod launch;
pub mod nvrtc;
#[cfg(test)]
mod test_log;
pub mod timing;
mod tune;
mod tuned;

pub use blas::Blas;
pub use cache::{cache_root, BadEntry, CacheKey, CubinCache, CACHE_DIR_ENV};
pub use cudarc;
pub use device::{arch_name, driver_available, DeviceLimits, Fingerprint, Gpu};
pub use error::{ResourceLimit, RuntimeError};
pub use jit::{Cubin, Jit, KernelSource};
pub use launch::{check_block, check_grid, CompiledKernel, Grid, Launcher};
pub use tune::{
    bucket_pow2, l2_bytes, rotation_copies, source_hash, Cost, DevicePool, Lookup, Roofline, Trial, TrialStatus,
    Tunable, TuneCache, TuneEntry, TuneOptions, TuneTimes, Tuned, Tuner, Verdict,
};
pub use tuned::{Choice, TunedKernels, FORCE_DEFAULT_ENV};
