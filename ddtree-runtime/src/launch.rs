//! Compiled kernel variants and typed launches.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop,
};
use cudarc::nvrtc::Ptx;
use ddtree_codegen::{Kernel, KernelId, KernelIr};

use crate::jit::KernelSource;
use crate::{DeviceLimits, Gpu, ResourceLimit, RuntimeError};

/// A grid shape (x, y, z).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid(pub [u32; 3]);

impl From<u32> for Grid {
    fn from(x: u32) -> Self {
        Grid([x, 1, 1])
    }
}

impl From<(u32, u32)> for Grid {
    fn from((x, y): (u32, u32)) -> Self {
        Grid([x, y, 1])
    }
}

impl From<(u32, u32, u32)> for Grid {
    fn from((x, y, z): (u32, u32, u32)) -> Self {
        Grid([x, y, z])
    }
}

/// One variant of kernel `K`, compiled and loaded on a GPU.
#[derive(Debug)]
pub struct CompiledKernel<K: Kernel> {
    func: CudaFunction,
    _module: Arc<CudaModule>,
    params: K::Params,
    id: KernelId,
    block: [u32; 3],
    shared_bytes: u32,
    dyn_smem: u32,
    registers: i32,
    spill_bytes: i32,
    max_grid: [u32; 3],
    /// The owning [`Gpu`]'s programmatic-dependent-launch switch.
    programmatic: Arc<AtomicBool>,
    _kernel: PhantomData<K>,
}

/// Checks a block against the compiled kernel's and the device's limits: threads per block
/// (`kernel_max_threads` is what the driver allows for the kernel's register use), static
/// shared memory, static plus dynamic shared memory (`dyn_bytes`, against the opt-in limit) and
/// the register file.
pub fn check_block(
    threads: u32,
    shared_bytes: u32,
    dyn_bytes: u32,
    registers: u32,
    kernel_max_threads: u32,
    limits: &DeviceLimits,
) -> Result<(), ResourceLimit> {
    if shared_bytes > limits.max_shared_per_block {
        return Err(ResourceLimit::SharedMemory {
            bytes: shared_bytes,
            max: limits.max_shared_per_block,
        });
    }
    if dyn_bytes > 0 && shared_bytes + dyn_bytes > limits.max_shared_optin {
        return Err(ResourceLimit::SharedMemory {
            bytes: shared_bytes + dyn_bytes,
            max: limits.max_shared_optin,
        });
    }
    if registers as u64 * threads as u64 > limits.max_registers_per_block as u64 {
        return Err(ResourceLimit::Registers {
            registers,
            threads,
            max: limits.max_registers_per_block,
        });
    }
    let max = kernel_max_threads.min(limits.max_threads_per_block);
    if threads > max {
        return Err(ResourceLimit::Threads {
            threads,
            max,
            registers,
        });
    }
    Ok(())
}

/// Checks a grid against the device's limits; an empty grid is refused too.
pub fn check_grid(grid: [u32; 3], max: [u32; 3]) -> Result<(), ResourceLimit> {
    if grid.iter().zip(&max).any(|(&g, &m)| g == 0 || g > m) {
        return Err(ResourceLimit::Grid { grid, max });
    }
    Ok(())
}

impl Gpu {
    /// Generates, compiles (NVRTC for this GPU's arch, through the disk cache) and loads the
    /// variant of `K` for `params`, checking its launch resources.
    pub fn compile<K: Kernel>(&self, params: &K::Params) -> Result<CompiledKernel<K>, RuntimeError> {
        let ir = K::ir(params)?;
        let src = KernelSource {
            source: ddtree_codegen::render(&ir),
            symbol: ir.symbol.clone(),
        };
        let cubin = self.jit().cubin(&src)?;
        self.load(params, &ir, cubin.bytes)
    }

    /// Compiles many variants of `K` at once: the NVRTC work runs in parallel on the rayon
    /// pool, loading follows in order. One result per parameter set, in order.
    pub fn compile_many<K: Kernel>(&self, params: &[K::Params]) -> Vec<Result<CompiledKernel<K>, RuntimeError>> {
        let irs: Vec<Result<KernelIr, RuntimeError>> =
            params.iter().map(|p| K::ir(p).map_err(RuntimeError::from)).collect();
        let sources: Vec<KernelSource> = irs
            .iter()
            .flatten()
            .map(|ir| KernelSource {
                source: ddtree_codegen::render(ir),
                symbol: ir.symbol.clone(),
            })
            .collect();
        let mut cubins = self.jit().cubins(&sources).into_iter();
        params
            .iter()
            .zip(irs)
            .map(|(p, ir)| {
                let ir = ir?;
                let cubin = cubins.next().expect("one cubin per IR")?;
                self.load(p, &ir, cubin.bytes)
            })
            .collect()
    }

    /// Loads a cubin of `K`'s variant `params` (whose IR is `ir`) and checks its resources.
    fn load<K: Kernel>(
        &self,
        params: &K::Params,
        ir: &KernelIr,
        cubin: Vec<u8>,
    ) -> Result<CompiledKernel<K>, RuntimeError> {
        let symbol = &ir.symbol;
        let module = self
            .context()
            .load_module(Ptx::from_binary(cubin))
            .map_err(RuntimeError::driver(format!("loading `{symbol}`")))?;
        let func = module
            .load_function(symbol)
            .map_err(RuntimeError::driver(format!("finding `{symbol}`")))?;
        let attr = |v: Result<i32, cudarc::driver::DriverError>, what: &str| {
            v.map_err(RuntimeError::driver(format!("reading {what} of `{symbol}`")))
        };
        let registers = attr(func.num_regs(), "register use")?;
        let max_threads = attr(func.max_threads_per_block(), "max threads")?;
        let shared = attr(func.shared_size_bytes(), "shared memory")?;
        let spill_bytes = attr(func.local_size_bytes(), "local memory")?;
        check_block(
            ir.threads(),
            shared.max(0) as u32,
            ir.dyn_smem,
            registers.max(0) as u32,
            max_threads.max(0) as u32,
            self.limits(),
        )
        .map_err(|limit| RuntimeError::Resources {
            kernel: symbol.clone(),
            limit,
        })?;
        if ir.dyn_smem > 0 {
            // Above 48 KiB the function must opt in; done once here, not per launch.
            func.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                ir.dyn_smem as i32,
            )
            .map_err(RuntimeError::driver(format!(
                "allowing {} B of dynamic shared memory for `{symbol}`",
                ir.dyn_smem
            )))?;
        }
        Ok(CompiledKernel {
            func,
            _module: module,
            params: params.clone(),
            id: K::id(params, &self.arch()),
            block: ir.block,
            shared_bytes: shared.max(0) as u32,
            dyn_smem: ir.dyn_smem,
            registers,
            spill_bytes,
            max_grid: self.limits().max_grid,
            programmatic: self.programmatic.clone(),
            _kernel: PhantomData,
        })
    }
}

impl<K: Kernel> CompiledKernel<K> {
    /// The parameters this variant was generated with.
    pub fn params(&self) -> &K::Params {
        &self.params
    }

    /// Its stable id.
    pub fn id(&self) -> &KernelId {
        &self.id
    }

    /// Registers per thread.
    pub fn registers(&self) -> i32 {
        self.registers
    }

    /// Static shared memory per block in bytes.
    pub fn shared_bytes(&self) -> u32 {
        self.shared_bytes
    }

    /// Dynamic shared memory every launch passes, in bytes.
    pub fn dyn_smem(&self) -> u32 {
        self.dyn_smem
    }

    /// Local memory per thread in bytes (register spills).
    pub fn spill_bytes(&self) -> i32 {
        self.spill_bytes
    }

    /// Blocks of this variant that fit on one SM at once (the driver's occupancy calculator at
    /// the variant's block and dynamic shared memory): what a persistent grid may hold per SM.
    pub fn max_active_blocks_per_sm(&self) -> Result<u32, RuntimeError> {
        self.func
            .occupancy_max_active_blocks_per_multiprocessor(self.block.iter().product(), self.dyn_smem as usize, None)
            .map_err(RuntimeError::driver("querying the occupancy"))
    }

    /// Threads per block.
    pub fn block(&self) -> [u32; 3] {
        self.block
    }

    /// Starts a launch over `grid` (checked against the device's grid limits); the generated
    /// `launch` functions push the arguments.
    pub fn launcher<'a>(&'a self, stream: &'a Arc<CudaStream>, grid: Grid) -> Result<Launcher<'a>, RuntimeError> {
        check_grid(grid.0, self.max_grid).map_err(|limit| RuntimeError::Resources {
            kernel: self.id.symbol.clone(),
            limit,
        })?;
        Ok(Launcher {
            func: &self.func,
            stream,
            grid: grid.0,
            block: self.block,
            dyn_smem: self.dyn_smem,
            programmatic: self.programmatic.load(Ordering::Relaxed),
            params: Vec::with_capacity(16),
            owned: Vec::new(),
            guards: Vec::new(),
            symbol: &self.id.symbol,
        })
    }
}

/// A launch being assembled: arguments are pushed in kernel-signature order and must outlive
/// the launcher.
pub struct Launcher<'a> {
    func: &'a CudaFunction,
    stream: &'a Arc<CudaStream>,
    grid: [u32; 3],
    block: [u32; 3],
    dyn_smem: u32,
    programmatic: bool,
    /// One pointer per kernel parameter, to its value.
    params: Vec<*mut c_void>,
    /// Device addresses pushed by [`Launcher::buffer`] / [`Launcher::buffer_mut`], boxed so
    /// that `params`' pointers to them stay valid when the vector grows.
    #[allow(clippy::vec_box)]
    owned: Vec<Box<sys::CUdeviceptr>>,
    /// Their stream-ordering guards (cudarc's event tracking), dropped after the launch.
    guards: Vec<SyncOnDrop<'a>>,
    symbol: &'a str,
}

impl<'a> Launcher<'a> {
    /// Pushes the next argument: a scalar, or a device address (`CUdeviceptr`).
    pub fn arg<T: DeviceRepr>(&mut self, arg: &'a T) -> &mut Self {
        self.params.push(arg as *const T as *mut c_void);
        self
    }

    /// Pushes a device buffer the kernel reads as the next argument.
    pub fn buffer<T>(&mut self, buf: &'a CudaSlice<T>) -> &mut Self {
        let (ptr, guard) = buf.device_ptr(self.stream);
        self.push_address(ptr, guard)
    }

    /// Pushes a device buffer the kernel writes as the next argument.
    pub fn buffer_mut<T>(&mut self, buf: &'a mut CudaSlice<T>) -> &mut Self {
        let (ptr, guard) = buf.device_ptr_mut(self.stream);
        self.push_address(ptr, guard)
    }

    fn push_address(&mut self, ptr: sys::CUdeviceptr, guard: SyncOnDrop<'a>) -> &mut Self {
        let slot = Box::new(ptr);
        self.params.push(&*slot as *const sys::CUdeviceptr as *mut c_void);
        self.owned.push(slot);
        self.guards.push(guard);
        self
    }

    /// Launches; with programmatic dependent launch on (see [`Gpu::set_programmatic_launch`])
    /// the kernel may start while the previous kernel of the stream drains.
    ///
    /// # Safety
    /// The pushed arguments must match the kernel's C signature (the generated launchers
    /// guarantee it) and describe valid buffers.
    pub unsafe fn launch(mut self) -> Result<(), RuntimeError> {
        let what = || format!("launching `{}`", self.symbol);
        self.stream
            .context()
            .bind_to_thread()
            .map_err(RuntimeError::driver(what()))?;
        let [gx, gy, gz] = self.grid;
        let [bx, by, bz] = self.block;
        // SAFETY: an all-zero attribute value is valid; the field set is the one `id` names.
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: unsafe { std::mem::zeroed() },
        };
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: gx,
            gridDimY: gy,
            gridDimZ: gz,
            blockDimX: bx,
            blockDimY: by,
            blockDimZ: bz,
            sharedMemBytes: self.dyn_smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.programmatic),
        };
        // SAFETY: `params` holds one pointer per kernel parameter to a value that outlives the
        // call (the caller's contract and the `'a` borrows); `cfg` and `attr` outlive the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                self.func.cu_function(),
                self.params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(RuntimeError::driver(what()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200: DeviceLimits = DeviceLimits {
        max_threads_per_block: 1024,
        max_shared_per_block: 49152,
        max_shared_optin: 232448,
        max_registers_per_block: 65536,
        max_grid: [2147483647, 65535, 65535],
        l2_bytes: 62914560,
        clock_khz: 1980000,
    };

    #[test]
    fn block_checks_name_the_limit() {
        assert_eq!(check_block(256, 16384, 0, 64, 1024, &H200), Ok(()));
        assert_eq!(
            check_block(1024, 0, 0, 128, 512, &H200),
            Err(ResourceLimit::Registers {
                registers: 128,
                threads: 1024,
                max: 65536
            })
        );
        assert_eq!(
            check_block(1024, 0, 0, 40, 768, &H200),
            Err(ResourceLimit::Threads {
                threads: 1024,
                max: 768,
                registers: 40
            })
        );
        assert_eq!(
            check_block(2048, 0, 0, 16, 2048, &H200),
            Err(ResourceLimit::Threads {
                threads: 2048,
                max: 1024,
                registers: 16
            })
        );
        assert_eq!(
            check_block(128, 65536, 0, 32, 1024, &H200),
            Err(ResourceLimit::SharedMemory {
                bytes: 65536,
                max: 49152
            })
        );
        assert_eq!(check_block(128, 16384, 200 * 1024, 32, 1024, &H200), Ok(()));
        assert_eq!(
            check_block(128, 16384, 220 * 1024, 32, 1024, &H200),
            Err(ResourceLimit::SharedMemory {
                bytes: 16384 + 220 * 1024,
                max: 232448
            })
        );
        let e = RuntimeError::Resources {
            kernel: "k".into(),
            limit: ResourceLimit::SharedMemory {
                bytes: 65536,
                max: 49152,
            },
        };
        assert_eq!(
            e.to_string(),
            "cannot launch `k`: 65536 B of shared memory per block, but the device allows 49152 B"
        );
    }

    #[test]
    fn grid_checks() {
        assert_eq!(check_grid([1, 1, 1], H200.max_grid), Ok(()));
        assert!(check_grid([0, 1, 1], H200.max_grid).is_err());
        assert!(check_grid([1, 65536, 1], H200.max_grid).is_err());
        assert!(check_grid([u32::MAX, 1, 1], H200.max_grid).is_err());
    }
}
