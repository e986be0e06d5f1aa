//! [`Comm`] over NCCL for ranks on GPUs (cudarc's `nccl` module, loaded at run time like the
//! driver): the collectives are enqueued on the rank's compute stream, so they order with the
//! kernels around them and can be captured in CUDA graphs.
//!
//! One process drives one node with one thread (and CUDA context) per GPU: the main thread makes
//! the unique id ([`NcclBootstrap`]), every rank thread calls [`NcclComm::init`] with it at the
//! same time (NCCL's init blocks until all ranks have joined). A multi-process launcher would
//! send the id's 128 bytes to the other processes over TCP instead ([`Bootstrap`]).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ddtree_runtime::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use ddtree_runtime::cudarc::nccl::{self, Id, NcclType};
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
    fn renew(&self) -> Result<Id> {
        Id::new().map_err(|e| nccl_error("get_unique_id", 0, e))
    }
}

/// The unique ids of one process's NCCL group across re-formations, shared by its rank
/// threads: every rank recovering from epoch `e` joins the id made once for `e + 1` (a
/// multi-process launcher would have rank 0 serve it through its [`Bootstrap`]).
#[derive(Debug)]
pub struct NcclRenewal {
    boot: NcclBootstrap,
    /// The latest epoch and its id.
    latest: Mutex<(u64, Id)>,
}

impl NcclRenewal {
    /// The group of `boot`, at epoch 0 with its first id.
    pub fn new(boot: NcclBootstrap) -> Result<Arc<Self>> {
        let id = boot.token()?;
        Ok(Arc::new(Self {
            boot,
            latest: Mutex::new((0, id)),
        }))
    }

    /// The id of `epoch`: made by the first rank that asks, the same for the others.
    pub fn id(&self, epoch: u64) -> Result<Id> {
        let mut latest = self
            .latest
            .lock()
            .map_err(|_| comm_error("renew", 0, "the id's lock is poisoned"))?;
        if latest.0 < epoch {
            *latest = (epoch, self.boot.renew()?);
        }
        if latest.0 != epoch {
            return Err(comm_error(
                "renew",
                0,
                &format!("a rank asked for epoch {epoch}, the group is at {}", latest.0),
            ));
        }
        Ok(latest.1)
    }
}

/// A raw NCCL communicator, shared by a rank's [`NcclComm`] and its [`NcclAbort`] handles:
/// `None` once aborted. The collectives hold the lock only while they enqueue.
#[derive(Debug)]
struct Raw(Mutex<Option<CommPtr>>);

#[derive(Debug, Clone, Copy)]
struct CommPtr(nccl::sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap, which the `Raw` lock ensures (`ncclCommAbort` is documented to be callable from
// another thread to stop a communicator whose operations hang).
unsafe impl Send for CommPtr {}

impl Raw {
    /// Aborts the communicator (`ncclCommAbort`: its pending operations on the device stop
    /// and their streams drain) unless done already. Gives up after `wait` when a thread is
    /// stuck inside an NCCL call holding the lock; returns whether it is aborted.
    fn abort(&self, wait: Duration) -> bool {
        let start = Instant::now();
        loop {
            match self.0.try_lock() {
                Ok(mut g) => {
                    if let Some(p) = g.take() {
                        // SAFETY: the pointer came from `ncclCommInitRank` and is aborted once
                        // (taken out of the lock).
                        if let Err(e) = unsafe { nccl::result::comm_abort(p.0) } {
                            tracing::warn!("ncclCommAbort: {:?}", e.0);
                        }
                    }
                    return true;
                }
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    if let Some(c) = p.into_inner().take() {
                        // SAFETY: as above.
                        let _ = unsafe { nccl::result::comm_abort(c.0) };
                    }
                    return true;
                }
                Err(std::sync::TryLockError::WouldBlock) if start.elapsed() < wait => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(std::sync::TryLockError::WouldBlock) => return false,
            }
        }
    }
}

/// Aborts one rank's communicator from any thread (the rank group's, while the rank's own
/// thread may be stuck waiting for a collective that a failed peer never joined).
#[derive(Debug, Clone)]
pub struct NcclAbort(Arc<Raw>);

impl NcclAbort {
    /// `ncclCommAbort` on the communicator (once); `false` when a thread held it inside an NCCL
    /// call for longer than `wait`.
    pub fn abort(&self, wait: Duration) -> bool {
        self.0.abort(wait)
    }
}

/// One rank's NCCL communicator on its GPU's compute stream (called through NCCL's C API, so
/// that it can be aborted from another thread and re-made: see [`NcclAbort`]).
#[derive(Debug)]
pub struct NcclComm {
    raw: Arc<Raw>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    stats: std::sync::Mutex<CommStats>,
}

impl NcclComm {
    /// Joins the group of `id` as `rank` of `world`, enqueuing on `stream` (the backend's compute
    /// stream). Blocks until every rank has joined: call it from every rank's thread at once.
    pub fn init(stream: Arc<CudaStream>, rank: usize, world: usize, id: Id) -> Result<Self> {
        default_nvls_off();
        // NCCL binds the communicator to the thread's current device.
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| nccl_error_driver("init", rank, e))?;
        let (nranks, r) = (
            i32::try_from(world).map_err(|_| comm_error("init", rank, "world too large"))?,
            i32::try_from(rank).map_err(|_| comm_error("init", rank, "rank too large"))?,
        );
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by a successful init; `id` is the group's unique id.
        let comm = unsafe {
            let unique = nccl::sys::ncclUniqueId {
                internal: *id.internal(),
            };
            nccl::result::comm_init_rank(comm.as_mut_ptr(), nranks, unique, r)
                .map_err(|e| nccl_error("init", rank, e))?;
            comm.assume_init()
        };
        Ok(Self {
            raw: Arc::new(Raw(Mutex::new(Some(CommPtr(comm))))),
            stream,
            rank,
            world,
            stats: Default::default(),
        })
    }

    /// The stream the collectives are enqueued on.
    pub fn stream(&self) -> Arc<CudaStream> {
        self.stream.clone()
    }

    /// A handle that aborts this communicator from any thread.
    pub fn abort_handle(&self) -> NcclAbort {
        NcclAbort(self.raw.clone())
    }

    /// Whether the communicator has been aborted (every collective then fails).
    pub fn aborted(&self) -> bool {
        self.raw.0.lock().map_or(true, |g| g.is_none())
    }

    /// Runs `f` with the live communicator and the raw stream, counting the call.
    fn with(
        &self,
        op: &str,
        f: impl FnOnce(
            nccl::sys::ncclComm_t,
            nccl::sys::cudaStream_t,
        ) -> std::result::Result<nccl::result::NcclStatus, nccl::result::NcclError>,
    ) -> Result<()> {
        let guard = self
            .raw
            .0
            .lock()
            .map_err(|_| comm_error(op, self.rank, "the communicator's lock is poisoned"))?;
        let Some(comm) = *guard else {
            return Err(comm_error(op, self.rank, "the communicator was aborted"));
        };
        if let Ok(mut s) = self.stats.lock() {
            s.calls += 1;
        }
        f(comm.0, self.stream.cu_stream() as _)
            .map(|_| ())
            .map_err(|e| nccl_error(op, self.rank, e))
    }

    /// In-place sum over the ranks of `buf` (any element count, e.g. a view).
    pub fn all_reduce_sum<T: NcclType, B: DevicePtrMut<T>>(&self, op: &str, buf: &mut B) -> Result<()> {
        let n = buf.len();
        let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
        // SAFETY: in place over `n` elements of one device buffer, on the communicator's stream.
        self.with(op, |c, s| unsafe {
            nccl::result::all_reduce(
                ptr as _,
                ptr as _,
                n,
                T::as_nccl_type(),
                nccl::sys::ncclRedOp_t::ncclSum,
                c,
                s,
            )
        })
    }

    /// Every rank's `send` concatenated in rank order into `recv` (`world * send.len()`).
    pub fn all_gather<T: NcclType, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &self,
        op: &str,
        send: &S,
        recv: &mut R,
    ) -> Result<()> {
        let n = send.len();
        if recv.len() < n * self.world {
            return Err(comm_error(
                op,
                self.rank,
                &format!("a gather of {n} values into {}", recv.len()),
            ));
        }
        let (src, _s1) = send.device_ptr(&self.stream);
        let (dst, _s2) = recv.device_ptr_mut(&self.stream);
        // SAFETY: sizes checked above; both buffers on the communicator's device.
        self.with(op, |c, s| unsafe {
            nccl::result::all_gather(src as _, dst as _, n, T::as_nccl_type(), c, s)
        })
    }

    /// `root`'s `buf` to every rank's.
    pub fn broadcast<T: NcclType, B: DevicePtrMut<T>>(&self, op: &str, buf: &mut B, root: usize) -> Result<()> {
        let n = buf.len();
        let root = i32::try_from(root).map_err(|_| comm_error(op, self.rank, "root too large"))?;
        let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
        // SAFETY: in place over `n` elements of one device buffer.
        self.with(op, |c, s| unsafe {
            nccl::result::broadcast(ptr as _, ptr as _, n, T::as_nccl_type(), root, c, s)
        })
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // As cudarc's `Comm` does: abort (a finalize could wait for peers that are gone).
        self.raw.abort(Duration::from_secs(5));
    }
}

impl Comm for NcclComm {
    type F32 = CudaSlice<f32>;
    type Bf16 = CudaSlice<bf16>;
    type U32 = CudaSlice<u32>;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum_f32(&self, buf: &mut CudaSlice<f32>) -> Result<()> {
        self.all_reduce_sum("all_reduce_sum_f32", buf)
    }

    fn all_reduce_sum_bf16(&self, buf: &mut CudaSlice<bf16>) -> Result<()> {
        self.all_reduce_sum("all_reduce_sum_bf16", buf)
    }

    fn all_gather_f32(&self, send: &CudaSlice<f32>, recv: &mut CudaSlice<f32>) -> Result<()> {
        self.all_gather("all_gather_f32", send, recv)
    }

    fn all_gather_u32(&self, send: &CudaSlice<u32>, recv: &mut CudaSlice<u32>) -> Result<()> {
        self.all_gather("all_gather_u32", send, recv)
    }

    fn broadcast_u32(&self, buf: &mut CudaSlice<u32>, root: usize) -> Result<()> {
        self.broadcast("broadcast_u32", buf, root)
    }

    fn barrier(&self) -> Result<()> {
        let rank = self.rank;
        let mut one = self
            .stream
            .alloc_zeros::<f32>(1)
            .map_err(|e| nccl_error_driver("barrier", rank, e))?;
        self.all_reduce_sum_f32(&mut one)?;
        self.stream
            .synchronize()
            .map_err(|e| nccl_error_driver("barrier", rank, e))
    }

    fn stats(&self) -> CommStats {
        self.stats.lock().map(|s| *s).unwrap_or_default()
    }
}

fn comm_error(op: &str, rank: usize, reason: &str) -> EngineError {
    EngineError::Comm {
        op: op.into(),
        rank,
        reason: reason.into(),
    }
}

fn nccl_error_driver(op: &str, rank: usize, e: ddtree_runtime::cudarc::driver::DriverError) -> EngineError {
    EngineError::Comm {
        op: op.into(),
        rank,
        reason: format!("CUDA error {e}"),
    }
}
