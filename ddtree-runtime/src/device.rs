//! Device discovery that never panics, and the device fingerprint.

use std::sync::Arc;

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaStream};

use crate::RuntimeError;

/// Whether `libcuda` can be loaded (`CudaContext::new` panics when it cannot, so ask first).
pub fn driver_available() -> bool {
    // SAFETY: only probes for the library with dlopen.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// What identifies a GPU for caching compiled code and tuning results.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    /// Device name, e.g. "NVIDIA H200".
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Number of SMs.
    pub sm_count: i32,
    /// Total memory in bytes.
    pub memory_bytes: usize,
    /// Driver version as reported by `cuDriverGetVersion` (e.g. 13000).
    pub driver_version: i32,
}

impl Fingerprint {
    /// The NVRTC architecture: `sm_90a` on Hopper (arch-specific features on), `sm_XY` before.
    pub fn arch(&self) -> String {
        arch_name(self.compute_capability)
    }
}

/// NVRTC architecture name for a compute capability.
pub fn arch_name((major, minor): (i32, i32)) -> String {
    if major >= 9 {
        format!("sm_{major}{minor}a")
    } else {
        format!("sm_{major}{minor}")
    }
}

/// An opened GPU: its context, a stream, and its fingerprint.
#[derive(Debug, Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    fingerprint: Fingerprint,
}

impl Gpu {
    /// Opens device `ordinal`. Returns [`RuntimeError::NoDriver`] (never panics) where there is
    /// no driver, and [`RuntimeError::NoDevice`] where the ordinal does not exist.
    pub fn open(ordinal: usize) -> Result<Gpu, RuntimeError> {
        if !driver_available() {
            return Err(RuntimeError::NoDriver);
        }
        cudarc::driver::result::init().map_err(RuntimeError::driver("initialising the driver"))?;
        let count = CudaContext::device_count().map_err(RuntimeError::driver("counting devices"))? as usize;
        if ordinal >= count {
            return Err(RuntimeError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(RuntimeError::driver("creating the context"))?;
        let stream = ctx.new_stream().map_err(RuntimeError::driver("creating a stream"))?;
        let mut driver_version = 0;
        // SAFETY: a valid out-pointer; the driver is initialised.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) };
        let fingerprint = Fingerprint {
            name: ctx.name().map_err(RuntimeError::driver("reading the device name"))?,
            compute_capability: ctx.compute_capability().map_err(RuntimeError::driver("reading the compute capability"))?,
            sm_count: ctx
                .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(RuntimeError::driver("reading the SM count"))?,
            memory_bytes: ctx.total_mem().map_err(RuntimeError::driver("reading the memory size"))?,
            driver_version,
        };
        Ok(Gpu { ctx, stream, fingerprint })
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream kernels launch on by default.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The fingerprint.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// The NVRTC architecture of this GPU.
    pub fn arch(&self) -> String {
        self.fingerprint.arch()
    }
}
