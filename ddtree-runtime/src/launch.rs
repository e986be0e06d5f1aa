//! Compiled kernel variants and typed launches.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchArgs, LaunchConfig, PushKernelArg};
use ddtree_codegen::{Kernel, KernelId};

use crate::{nvrtc, Gpu, RuntimeError};

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
    registers: i32,
    _kernel: PhantomData<K>,
}

impl Gpu {
    /// Generates, compiles (NVRTC, this GPU's arch) and loads the variant of `K` for `params`.
    pub fn compile<K: Kernel>(&self, params: &K::Params) -> Result<CompiledKernel<K>, RuntimeError> {
        let ir = K::ir(params)?;
        let source = ddtree_codegen::render(&ir);
        let arch = self.arch();
        let ptx = nvrtc::compile_ptx(&source, &ir.symbol, &arch)?;
        let module = self.context().load_module(ptx).map_err(RuntimeError::driver(format!("loading `{}`", ir.symbol)))?;
        let func = module.load_function(&ir.symbol).map_err(RuntimeError::driver(format!("finding `{}`", ir.symbol)))?;
        let registers = func.num_regs().map_err(RuntimeError::driver("reading register use"))?;
        let max_threads = func.max_threads_per_block().map_err(RuntimeError::driver("reading max threads"))?;
        if (ir.threads() as i32) > max_threads {
            let reason = format!(
                "{} threads per block, but the compiled kernel allows {max_threads} ({registers} registers per thread)",
                ir.threads()
            );
            return Err(RuntimeError::Launch { kernel: ir.symbol, reason });
        }
        Ok(CompiledKernel {
            func,
            _module: module,
            params: params.clone(),
            id: K::id(params, &arch),
            block: ir.block,
            shared_bytes: ir.shared_bytes() as u32,
            registers,
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

    /// Starts a launch over `grid`; the generated `launch` functions push the arguments.
    pub fn launcher<'a>(&'a self, stream: &'a Arc<CudaStream>, grid: Grid) -> Result<Launcher<'a>, RuntimeError> {
        let [x, y, z] = grid.0;
        if x == 0 || y == 0 || z == 0 || y > 65535 || z > 65535 || x > i32::MAX as u32 {
            return Err(RuntimeError::Launch {
                kernel: self.id.symbol.clone(),
                reason: format!("grid {:?} is empty or exceeds the limits (x < 2^31, y and z <= 65535)", grid.0),
            });
        }
        let cfg = LaunchConfig { grid_dim: (x, y, z), block_dim: (self.block[0], self.block[1], self.block[2]), shared_mem_bytes: 0 };
        Ok(Launcher { args: stream.launch_builder(&self.func), cfg, symbol: &self.id.symbol })
    }
}

/// A launch being assembled: arguments are pushed in kernel-signature order.
pub struct Launcher<'a> {
    args: LaunchArgs<'a>,
    cfg: LaunchConfig,
    symbol: &'a str,
}

impl<'a> Launcher<'a> {
    /// Pushes the next argument.
    pub fn arg<T>(&mut self, arg: T) -> &mut Self
    where
        LaunchArgs<'a>: PushKernelArg<T>,
    {
        self.args.arg(arg);
        self
    }

    /// Launches.
    ///
    /// # Safety
    /// The pushed arguments must match the kernel's C signature (the generated launchers
    /// guarantee it) and describe valid buffers.
    pub unsafe fn launch(mut self) -> Result<(), RuntimeError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.args.launch(self.cfg) }
            .map(|_| ())
            .map_err(RuntimeError::driver(format!("launching `{}`", self.symbol)))
    }
}
