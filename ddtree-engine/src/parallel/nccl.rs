//! [`Comm`] over NCCL for ranks on GPUs (cudarc's `nccl` module, loaded at run time like the
//! driver): the collectives are enqueued on the rank's compute stream, so they order with the
//! kernels around them and can be captured in CUDA graphs.
//!
//! One process drives one node with one thread (and CUDA context) per GPU: the main thread makes
//! the unique id ([`NcclBootstrap`]), every rank thread calls [`NcclComm::init`] with it at the
//! same time (NCCL's init blocks until all ranks have joined). A multi-process launcher would
//! send the id's 128 bytes to the other processes over TCP instead ([`Bootstrap`]).

use std::sync::Arc;

use ddtree_runtime::cudarc::driver::{CudaSlice, CudaStream};
use ddtree_runtime::cudarc::nccl::{self, Id, ReduceOp};
use half::bf16;

use crate::error::{EngineError, Result};
use crate::parallel::comm::{Bootstrap, Comm, CommStats};

/// `NCCL_NVLS_ENABLE`: NVLink multicast (NVLS) is kept off unless the user sets it (it reserves
/// memory and has hung on some drivers).
pub const NVLS_ENV: &str = "NCCL_NVLS_ENABLE";

/// Whether the NCCL library can be loaded here.
pub fn nccl_available() -> bool {
    // SAFETY: only tries to open the shared library.
    unsafe { nccl::sys::is_culib_present() }
}

fn nccl_error(op: &str, rank: usize, e: nccl::result::NcclError) -> EngineError {
    EngineError::Comm {
        op: op.into(),
        rank,
        reason: format!("NCCL error {:?}", e.0),
    }
}

/// Sets [`NVLS_ENV`] to 0 unless the user has set it; call before the first NCCL init.
pub fn default_nvls_off() {
    if std::env::var_os(NVLS_ENV).is_none() {
        // Called before any rank thread starts NCCL (see `NcclBootstrap::new`).
        std::env::set_var(NVLS_ENV, "0");
    }
}

/// The one-process NCCL bootstrap: every rank is a thread of this process with its own GPU.
#[derive(Debug, Clone, Copy)]
pub struct NcclBootstrap {
    world: usize,
    id: Id,
}

impl NcclBootstrap {
    /// Makes the unique id of a group of `world` ranks (fails cleanly when NCCL is absent).
    pub fn new(world: usize) -> Result<Self> {
        if !nccl_available() {
            return Err(EngineError::Backend {
                backend: "nccl".into(),
                reason: "libnccl.so.2 not found: install NCCL (the CUDA toolkit's, or the \
                         nvidia-nccl-cu13 wheel's lib folder on LD_LIBRARY_PATH)"
                    .into(),
            });
        }
        default_nvls_off();
        let id = Id::new().map_err(|e| nccl_error("get_unique_id", 0, e))?;
        Ok(Self { world, id })
    }
}

impl Bootstrap for NcclBootstrap {
    type Token = Id;
    fn local_ranks(&self) -> std::ops::Range<usize> {
        0..self.world
    }
    fn world(&self) -> usize {
        self.world
    }
    fn token(&self) -> Result<Id> {
        Ok(self.id)
    }
}

/// One rank's NCCL communicator on its GPU's compute stream.
#[derive(Debug)]
pub struct NcclComm {
    comm: nccl::Comm,
    stats: std::sync::Mutex<CommStats>,
}

impl NcclComm {
    /// Joins the group of `id` as `rank` of `world`, enqueuing on `stream` (the backend's compute
    /// stream). Blocks until every rank has joined: call it from every rank's thread at once.
    pub fn init(stream: Arc<CudaStream>, rank: usize, world: usize, id: Id) -> Result<Self> {
        default_nvls_off();
        let comm = nccl::Comm::from_rank(stream, rank, world, id).map_err(|e| nccl_error("init", rank, e))?;
        Ok(Self {
            comm,
            stats: Default::default(),
        })
    }

    /// The stream the collectives are enqueued on.
    pub fn stream(&self) -> Arc<CudaStream> {
        self.comm.stream()
    }

    fn count(&self) {
        if let Ok(mut s) = self.stats.lock() {
            s.calls += 1;
        }
    }
}

impl Comm for NcclComm {
    type F32 = CudaSlice<f32>;
    type Bf16 = CudaSlice<bf16>;
    type U32 = CudaSlice<u32>;

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce_sum_f32(&self, buf: &mut CudaSlice<f32>) -> Result<()> {
        self.count();
        self.comm
            .all_reduce_in_place(buf, &ReduceOp::Sum)
            .map(|_| ())
            .map_err(|e| nccl_error("all_reduce_sum_f32", self.rank(), e))
    }

    fn all_reduce_sum_bf16(&self, buf: &mut CudaSlice<bf16>) -> Result<()> {
        self.count();
        self.comm
            .all_reduce_in_place(buf, &ReduceOp::Sum)
            .map(|_| ())
            .map_err(|e| nccl_error("all_reduce_sum_bf16", self.rank(), e))
    }

    fn all_gather_f32(&self, send: &CudaSlice<f32>, recv: &mut CudaSlice<f32>) -> Result<()> {
        self.count();
        self.comm
            .all_gather(send, recv)
            .map(|_| ())
            .map_err(|e| nccl_error("all_gather_f32", self.rank(), e))
    }

    fn all_gather_u32(&self, send: &CudaSlice<u32>, recv: &mut CudaSlice<u32>) -> Result<()> {
        self.count();
        self.comm
            .all_gather(send, recv)
            .map(|_| ())
            .map_err(|e| nccl_error("all_gather_u32", self.rank(), e))
    }

    fn broadcast_u32(&self, buf: &mut CudaSlice<u32>, root: usize) -> Result<()> {
        self.count();
        self.comm
            .broadcast_in_place(buf, root as i32)
            .map(|_| ())
            .map_err(|e| nccl_error("broadcast_u32", self.rank(), e))
    }

    fn barrier(&self) -> Result<()> {
        let stream = self.comm.stream();
        let rank = self.rank();
        let mut one = stream
            .alloc_zeros::<f32>(1)
            .map_err(|e| nccl_error_driver("barrier", rank, e))?;
        self.all_reduce_sum_f32(&mut one)?;
        stream.synchronize().map_err(|e| nccl_error_driver("barrier", rank, e))
    }

    fn stats(&self) -> CommStats {
        self.stats.lock().map(|s| *s).unwrap_or_default()
    }
}

fn nccl_error_driver(op: &str, rank: usize, e: ddtree_runtime::cudarc::driver::DriverError) -> EngineError {
    EngineError::Comm {
        op: op.into(),
        rank,
        reason: format!("CUDA error {e}"),
    }
}
