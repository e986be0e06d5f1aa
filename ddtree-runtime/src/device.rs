//! Device discovery that never panics, the device fingerprint and the device's launch limits.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaStream};
use serde::{Deserialize, Serialize};

use crate::cache::{hash_fields, hex, CubinCache};
use crate::jit::Jit;
use crate::RuntimeError;

/// Whether `libcuda` can be loaded (`CudaContext::new` panics when it cannot, so ask first).
pub fn driver_available() -> bool {
    // SAFETY: only probes for the library with dlopen.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// What identifies a GPU (and its software) for caching tuning results.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
    /// NVRTC version (major, minor); `None` where `libnvrtc` is absent.
    pub nvrtc_version: Option<(i32, i32)>,
}

impl Fingerprint {
    /// The NVRTC architecture: `sm_90a` on Hopper (arch-specific features on), `sm_XY` before.
    pub fn arch(&self) -> String {
        arch_name(self.compute_capability)
    }

    /// A stable, file-name-safe id: the device name, the architecture and a hash of every
    /// field, e.g. `nvidia-h200-sm_90a-1f2e3d4c5b6a7988`.
    pub fn id(&self) -> String {
        let slug: String = self
            .name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '-'
                }
            })
            .collect::<String>()
            .split('-')
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join("-");
        let fields = serde_json::to_string(self).expect("a fingerprint serializes");
        format!(
            "{slug}-{}-{}",
            self.arch(),
            &hex(&hash_fields("ddtree-fingerprint-v1", [fields.as_bytes()]))[..16]
        )
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (major, minor) = self.compute_capability;
        write!(
            f,
            "{} (sm_{major}{minor}, {} SMs, {:.0} GiB), driver {}.{}, NVRTC {}",
            self.name,
            self.sm_count,
            self.memory_bytes as f64 / (1u64 << 30) as f64,
            self.driver_version / 1000,
            self.driver_version % 1000 / 10,
            match self.nvrtc_version {
                Some((a, b)) => format!("{a}.{b}"),
                None => "absent".to_string(),
            }
        )
    }
}

/// The launch limits of a device, checked before every load and launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Threads per block.
    pub max_threads_per_block: u32,
    /// Static shared memory per block, in bytes.
    pub max_shared_per_block: u32,
    /// Static plus dynamic shared memory a block may opt in to, in bytes (227 KiB on sm_90).
    pub max_shared_optin: u32,
    /// 32-bit registers per block.
    pub max_registers_per_block: u32,
    /// Grid size per dimension.
    pub max_grid: [u32; 3],
    /// L2 cache size in bytes (0 if the driver does not say).
    pub l2_bytes: u32,
    /// SM clock in kHz (0 if the driver does not say).
    pub clock_khz: u32,
}

/// NVRTC architecture name for a compute capability.
pub fn arch_name((major, minor): (i32, i32)) -> String {
    if major >= 9 {
        format!("sm_{major}{minor}a")
    } else {
        format!("sm_{major}{minor}")
    }
}

/// An opened GPU: its context, a stream, its fingerprint, its limits and its JIT.
#[derive(Debug, Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    fingerprint: Fingerprint,
    limits: DeviceLimits,
    jit: Arc<Jit>,
    /// Programmatic dependent launch on (shared by clones and the kernels compiled here).
    pub(crate) programmatic: Arc<AtomicBool>,
}

impl Gpu {
    /// Opens device `ordinal`, compiling through the disk cache at
    /// [`crate::cache_root`]`/cubin`. Returns [`RuntimeError::NoDriver`] (never panics) where
    /// there is no driver, and [`RuntimeError::NoDevice`] where the ordinal does not exist.
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
        // The highest priority: a second stream of default priority (the engine's branches)
        // fills the SMs around this one's blocks instead of delaying them.
        let (_, highest) = cudarc::driver::result::stream::get_priority_range()
            .map_err(RuntimeError::driver("reading the stream priority range"))?;
        let stream = ctx
            .new_stream_with_priority(highest)
            .map_err(RuntimeError::driver("creating a stream"))?;
        let mut driver_version = 0;
        // SAFETY: a valid out-pointer; the driver is initialised.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) };
        let attr = |a: CUdevice_attribute, what: &str| {
            ctx.attribute(a)
                .map(|v| v.max(0) as u32)
                .map_err(RuntimeError::driver(format!("reading {what}")))
        };
        use CUdevice_attribute as A;
        let limits = DeviceLimits {
            max_threads_per_block: attr(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "max threads per block")?,
            max_shared_per_block: attr(
                A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
                "shared memory per block",
            )?,
            max_shared_optin: attr(
                A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                "opt-in shared memory per block",
            )?,
            max_registers_per_block: attr(A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK, "registers per block")?,
            max_grid: [
                attr(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, "max grid x")?,
                attr(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y, "max grid y")?,
                attr(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z, "max grid z")?,
            ],
            // Only used for measuring: an unsupported attribute must not make the GPU unusable.
            l2_bytes: attr(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, "the L2 size").unwrap_or(0),
            clock_khz: attr(A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE, "the SM clock").unwrap_or(0),
        };
        let fingerprint = Fingerprint {
            name: ctx.name().map_err(RuntimeError::driver("reading the device name"))?,
            compute_capability: ctx
                .compute_capability()
                .map_err(RuntimeError::driver("reading the compute capability"))?,
            sm_count: ctx
                .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(RuntimeError::driver("reading the SM count"))?,
            memory_bytes: ctx
                .total_mem()
                .map_err(RuntimeError::driver("reading the memory size"))?,
            driver_version,
            nvrtc_version: crate::nvrtc::nvrtc_version().ok(),
        };
        let jit = Arc::new(Jit::new(fingerprint.arch(), Some(CubinCache::at_default_location())));
        Ok(Gpu {
            ctx,
            stream,
            fingerprint,
            limits,
            jit,
            programmatic: Arc::new(AtomicBool::new(false)),
        })
    }

    /// [`Gpu::open`], logging exactly one line either way: the device found (`info`), or why
    /// there is none (`warn`), so that a caller falling back to the CPU need not explain.
    pub fn discover(ordinal: usize) -> Result<Gpu, RuntimeError> {
        let gpu = Gpu::open(ordinal);
        match &gpu {
            Ok(g) => tracing::info!("CUDA device {ordinal}: {}", g.fingerprint),
            Err(e) => tracing::warn!("GPU unavailable, CUDA kernels disabled: {e}"),
        }
        gpu
    }

    /// This GPU compiling through `cache` instead (`None`: no disk cache).
    pub fn with_cache(mut self, cache: Option<CubinCache>) -> Gpu {
        self.jit = Arc::new(Jit::new(self.fingerprint.arch(), cache));
        self
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Turns programmatic dependent launch on or off for every kernel compiled on this GPU
    /// (off by default; ignored below sm_90). With it, a kernel may start launching while the
    /// previous one of its stream drains: every generated kernel waits for its predecessor's
    /// writes (`grid_wait`) before touching what that one writes, and lets its own successor
    /// launch only after that wait, so the stream's order of effects is unchanged and at most
    /// one kernel waits ahead.
    pub fn set_programmatic_launch(&self, on: bool) {
        let supported = self.fingerprint.compute_capability.0 >= 9;
        self.programmatic.store(on && supported, Ordering::Relaxed);
    }

    /// Whether kernels launch with programmatic dependent launch.
    pub fn programmatic_launch(&self) -> bool {
        self.programmatic.load(Ordering::Relaxed)
    }

    /// The stream kernels launch on by default.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The fingerprint.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// The launch limits.
    pub fn limits(&self) -> &DeviceLimits {
        &self.limits
    }

    /// The JIT (NVRTC for this GPU's architecture, through the disk cache).
    pub fn jit(&self) -> &Jit {
        &self.jit
    }

    /// The NVRTC architecture of this GPU.
    pub fn arch(&self) -> String {
        self.fingerprint.arch()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200() -> Fingerprint {
        Fingerprint {
            name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            sm_count: 132,
            memory_bytes: 150_754_820_096,
            driver_version: 13000,
            nvrtc_version: Some((13, 0)),
        }
    }

    #[test]
    fn arch_is_sm_90a_on_hopper() {
        assert_eq!(h200().arch(), "sm_90a");
        assert_eq!(arch_name((8, 0)), "sm_80");
    }

    #[test]
    fn fingerprint_id_is_readable_stable_and_sensitive() {
        let fp = h200();
        let id = fp.id();
        assert!(id.starts_with("nvidia-h200-sm_90a-"), "{id}");
        assert_eq!(id, h200().id());
        let mut other = h200();
        other.nvrtc_version = Some((13, 1));
        assert_ne!(other.id(), id, "an NVRTC upgrade is another fingerprint");
        other = h200();
        other.driver_version = 12080;
        assert_ne!(other.id(), id, "a driver change is another fingerprint");
        assert_eq!(
            fp.to_string(),
            "NVIDIA H200 (sm_90, 132 SMs, 140 GiB), driver 13.0, NVRTC 13.0"
        );
    }

    #[test]
    fn no_driver_is_a_typed_error_with_one_clear_line() {
        if driver_available() {
            eprintln!("skipped no_driver_is_a_typed_error_with_one_clear_line: a CUDA driver is present");
            return;
        }
        let logs = crate::test_log::capture(|| {
            let err = Gpu::discover(0).expect_err("no driver here");
            assert!(matches!(err, RuntimeError::NoDriver), "{err:?}");
        });
        let lines: Vec<&str> = logs.lines().collect();
        assert_eq!(lines.len(), 1, "exactly one log line: {logs:?}");
        assert!(
            lines[0].contains("WARN") && lines[0].contains("no CUDA driver"),
            "{logs}"
        );
        assert!(matches!(Gpu::open(0), Err(RuntimeError::NoDriver)));
    }
}
