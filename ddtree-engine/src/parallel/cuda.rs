//! [`TensorComm`] for the CUDA backend over NCCL, and the ranks of one node (one thread and
//! CUDA context per GPU). NCCL has run with one rank on one GPU; several GPUs not yet (see
//! docs/multi-gpu.md, "What is left"): the collectives are NCCL's on the backend's compute
//! stream; the vocabulary argmax all-gathers each rank's per-row `(max, column)` from the device
//! and reads the gathered pairs once, and the embedding zeroes the rows of ids outside the
//! rank's slice before the all-reduce.

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use ddtree_runtime::cudarc::driver::{CudaSlice, CudaStream, DriverError};
use ddtree_runtime::Gpu;

use crate::backend::cuda::{CudaTensor, DeviceData};
use crate::backend::Matrix;
use crate::backend::{Backend, CudaBackend, CudaOptions};
use crate::error::{EngineError, Result};
use crate::parallel::comm::{argmax_reduce, Bootstrap, Comm, CommStats, InProcessComm};
use crate::parallel::cpu::gather_vocab_host;
use crate::parallel::nccl::{NcclBootstrap, NcclComm};
use crate::parallel::ranks::run_threads;
use crate::parallel::{ParallelPlan, RankContext, TensorComm};

/// An [`NcclComm`] that may move to its rank's thread.
struct SendComm(NcclComm);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap; `CudaTensorComm` only reaches it through a mutex.
unsafe impl Send for SendComm {}

/// The CUDA backend's collectives: one rank's NCCL communicator.
pub struct CudaTensorComm {
    comm: Mutex<SendComm>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
}

fn driver(op: &str, rank: usize) -> impl Fn(DriverError) -> EngineError + '_ {
    move |e| EngineError::Comm {
        op: op.into(),
        rank,
        reason: format!("CUDA error {e}"),
    }
}

impl CudaTensorComm {
    /// Wraps rank `comm.rank()`'s communicator (made on `backend`'s compute stream).
    pub fn new(comm: NcclComm) -> Self {
        let (rank, world, stream) = (comm.rank(), comm.world(), comm.stream());
        Self {
            comm: Mutex::new(SendComm(comm)),
            stream,
            rank,
            world,
        }
    }

    fn lock(&self, op: &str) -> Result<MutexGuard<'_, SendComm>> {
        self.comm.lock().map_err(|_| EngineError::Comm {
            op: op.into(),
            rank: self.rank,
            reason: "the communicator's lock is poisoned".into(),
        })
    }

    fn f32<'a>(x: &'a CudaTensor, op: &str) -> Result<&'a CudaSlice<f32>> {
        match &x.data {
            DeviceData::F32(d) => Ok(d),
            DeviceData::Bf16(_) => Err(EngineError::Forward(format!("{op}: expects f32 logits, got bf16"))),
        }
    }
}

impl TensorComm<CudaBackend> for CudaTensorComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, _b: &CudaBackend, x: &mut CudaTensor) -> Result<()> {
        let comm = self.lock("all_reduce_sum")?;
        match &mut x.data {
            DeviceData::Bf16(d) => comm.0.all_reduce_sum_bf16(d),
            DeviceData::F32(d) => comm.0.all_reduce_sum_f32(d),
        }
    }

    fn gather_vocab(
        &self,
        _b: &CudaBackend,
        local: CudaTensor,
        vocab: Range<usize>,
        vocab_size: usize,
    ) -> Result<CudaTensor> {
        let op = "gather_vocab";
        let (rows, world, s) = (local.rows, self.world, &self.stream);
        let width = vocab_size.div_ceil(world);
        let src = Self::f32(&local, op)?;
        // Every rank sends `rows * width` values: its slice padded to the widest one.
        let mut send = s.alloc_zeros::<f32>(rows * width).map_err(driver(op, self.rank))?;
        for r in 0..rows {
            s.memcpy_dtod(
                &src.slice(r * vocab.len()..(r + 1) * vocab.len()),
                &mut send.slice_mut(r * width..r * width + vocab.len()),
            )
            .map_err(driver(op, self.rank))?;
        }
        let mut all = s
            .alloc_zeros::<f32>(world * rows * width)
            .map_err(driver(op, self.rank))?;
        self.lock(op)?.0.all_gather_f32(&send, &mut all)?;
        let mut out = s.alloc_zeros::<f32>(rows * vocab_size).map_err(driver(op, self.rank))?;
        for rank in 0..world {
            let start = (rank * width).min(vocab_size);
            let len = ((rank + 1) * width).min(vocab_size) - start;
            for r in 0..rows {
                let from = (rank * rows + r) * width;
                s.memcpy_dtod(
                    &all.slice(from..from + len),
                    &mut out.slice_mut(r * vocab_size + start..r * vocab_size + start + len),
                )
                .map_err(driver(op, self.rank))?;
            }
        }
        Ok(CudaTensor {
            rows,
            cols: vocab_size,
            data: DeviceData::F32(out),
        })
    }

    /// Each rank's `(max, column)` per row stays on the device and is all-gathered through NCCL
    /// with the ranks' slice starts; one read of the gathered pairs, reduced on the host.
    fn argmax_vocab(&self, b: &CudaBackend, local: &CudaTensor, vocab: Range<usize>) -> Result<Vec<u32>> {
        let op = "argmax_vocab";
        let (rows, world, s) = (local.rows, self.world, &self.stream);
        Self::f32(local, op)?;
        let (values, indices) = b.argmax_on_device(local)?;
        let start = s.clone_htod(&[vocab.start as u32]).map_err(driver(op, self.rank))?;
        let mut all_v = s.alloc_zeros::<f32>(rows * world).map_err(driver(op, self.rank))?;
        let mut all_i = s.alloc_zeros::<u32>(rows * world).map_err(driver(op, self.rank))?;
        let mut starts = s.alloc_zeros::<u32>(world).map_err(driver(op, self.rank))?;
        {
            let comm = self.lock(op)?;
            comm.0.all_gather_f32(&values, &mut all_v)?;
            comm.0.all_gather_u32(&indices, &mut all_i)?;
            comm.0.all_gather_u32(&start, &mut starts)?;
        }
        let all_v = s.clone_dtoh(&all_v).map_err(driver(op, self.rank))?;
        let all_i = s.clone_dtoh(&all_i).map_err(driver(op, self.rank))?;
        let starts = s.clone_dtoh(&starts).map_err(driver(op, self.rank))?;
        let pair = |k: usize, r: usize| (all_v[k * rows + r], starts[k] + all_i[k * rows + r]);
        Ok((0..rows)
            .map(|r| {
                let mut best = pair(0, r);
                for k in 1..world {
                    let c = pair(k, r);
                    if c.0 > best.0 || (c.0 == best.0 && c.1 < best.1) || best.0.is_nan() {
                        best = c;
                    }
                }
                best.1
            })
            .collect())
    }

    fn embedding(&self, b: &CudaBackend, table: &CudaTensor, ids: &[u32], vocab: Range<usize>) -> Result<CudaTensor> {
        let mut out = local_embedding(b, &self.stream, self.rank, table, ids, vocab)?;
        self.all_reduce_sum(b, &mut out)?;
        Ok(out)
    }

    fn stats(&self) -> CommStats {
        self.comm.lock().map(|c| c.0.stats()).unwrap_or_default()
    }

    /// Staged through the device: copy in, NCCL broadcast on the compute stream, copy back
    /// (one host sync, as reading the values back would be anyway).
    fn broadcast_host_u32(&self, _b: &CudaBackend, buf: &mut [u32], root: usize) -> Result<()> {
        let (op, s) = ("broadcast_host_u32", &self.stream);
        if buf.is_empty() {
            return Ok(());
        }
        let mut d = s.clone_htod(buf).map_err(driver(op, self.rank))?;
        self.lock(op)?.0.broadcast_u32(&mut d, root)?;
        buf.copy_from_slice(&s.clone_dtoh(&d).map_err(driver(op, self.rank))?);
        Ok(())
    }
}

/// Runs `f` once per rank of `plan` on GPUs `0..world` of this node: per rank a thread that
/// opens its GPU, makes its [`CudaBackend`] with `options`, joins the NCCL group on the
/// backend's compute stream and calls `f` with the backend and its [`RankContext`].
pub fn run_cuda_ranks<T: Send>(
    plan: Arc<ParallelPlan>,
    options: CudaOptions,
    f: impl Fn(CudaBackend, RankContext<CudaBackend>) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let world = plan.spec.world;
    let boot = NcclBootstrap::new(world)?;
    let id = boot.token()?;
    run_threads(boot.local_ranks().collect(), |rank| {
        let gpu = Gpu::open(rank)?;
        let backend = CudaBackend::new(gpu, options)?;
        let comm = NcclComm::init(backend.gpu().stream().clone(), rank, world, id)?;
        let context = RankContext {
            plan: plan.clone(),
            rank,
            comm: Box::new(CudaTensorComm::new(comm)),
        };
        f(backend, context)
    })
}

impl crate::parallel::group::RankGroup<CudaBackend> {
    /// Long-lived ranks on GPUs `0..world` of this node (a server's): per rank a thread that
    /// opens its GPU, makes its [`CudaBackend`] with `options`, joins the NCCL group on the
    /// backend's compute stream and keeps the model `make` loads. NCCL cannot release a peer
    /// stuck in a collective: after a rank fails alone the group is marked broken (see
    /// [`crate::parallel::group`]).
    pub fn cuda(
        plan: Arc<ParallelPlan>,
        options: CudaOptions,
        make: impl Fn(CudaBackend, RankContext<CudaBackend>) -> Result<crate::Model<CudaBackend>> + Send + Sync + 'static,
    ) -> Result<Self> {
        let world = plan.spec.world;
        let boot = NcclBootstrap::new(world)?;
        let id = boot.token()?;
        let id = Mutex::new(id);
        Self::spawn(world, move |rank| {
            let id = *id.lock().map_err(|_| EngineError::Comm {
                op: "init".into(),
                rank,
                reason: "the NCCL id's lock is poisoned".into(),
            })?;
            let gpu = Gpu::open(rank)?;
            let backend = CudaBackend::new(gpu, options)?;
            let comm = NcclComm::init(backend.gpu().stream().clone(), rank, world, id)?;
            let context = RankContext {
                plan: plan.clone(),
                rank,
                comm: Box::new(CudaTensorComm::new(comm)),
            };
            make(backend, context)
        })
    }
}

/// Copy-based collectives for ranks that share one GPU (a test of the sharded CUDA forward
/// without several GPUs, not a collective for real multi-GPU runs: those use NCCL): buffers are
/// read back, combined through an in-process group on the host, and written again.
pub struct HostStagedComm {
    comm: InProcessComm,
    stream: Arc<CudaStream>,
}

impl HostStagedComm {
    /// Rank `comm.rank()` on `stream` (its backend's compute stream).
    pub fn new(comm: InProcessComm, stream: Arc<CudaStream>) -> Self {
        Self { comm, stream }
    }
}

impl TensorComm<CudaBackend> for HostStagedComm {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world()
    }

    fn all_reduce_sum(&self, _b: &CudaBackend, x: &mut CudaTensor) -> Result<()> {
        let (op, rank, s) = ("all_reduce_sum", self.comm.rank(), &self.stream);
        match &mut x.data {
            DeviceData::Bf16(d) => {
                let mut host = s.clone_dtoh(d).map_err(driver(op, rank))?;
                self.comm.all_reduce_sum_bf16(&mut host)?;
                s.memcpy_htod(&host, d).map_err(driver(op, rank))
            }
            DeviceData::F32(d) => {
                let mut host = s.clone_dtoh(d).map_err(driver(op, rank))?;
                self.comm.all_reduce_sum_f32(&mut host)?;
                s.memcpy_htod(&host, d).map_err(driver(op, rank))
            }
        }
    }

    fn gather_vocab(
        &self,
        _b: &CudaBackend,
        local: CudaTensor,
        vocab: Range<usize>,
        vocab_size: usize,
    ) -> Result<CudaTensor> {
        let (op, rank, s) = ("gather_vocab", self.comm.rank(), &self.stream);
        let host = Matrix {
            rows: local.rows,
            cols: local.cols,
            data: s
                .clone_dtoh(CudaTensorComm::f32(&local, op)?)
                .map_err(driver(op, rank))?,
        };
        let all = gather_vocab_host(&self.comm, &host, vocab, vocab_size)?;
        Ok(CudaTensor {
            rows: all.rows,
            cols: all.cols,
            data: DeviceData::F32(s.clone_htod(&all.data).map_err(driver(op, rank))?),
        })
    }

    fn argmax_vocab(&self, b: &CudaBackend, local: &CudaTensor, vocab: Range<usize>) -> Result<Vec<u32>> {
        let (op, rank, s) = ("argmax_vocab", self.comm.rank(), &self.stream);
        CudaTensorComm::f32(local, op)?;
        let (values, indices) = b.argmax_on_device(local)?;
        let values = s.clone_dtoh(&values).map_err(driver(op, rank))?;
        let indices = s.clone_dtoh(&indices).map_err(driver(op, rank))?;
        let pairs: Vec<(f32, u32)> = values
            .into_iter()
            .zip(indices)
            .map(|(v, i)| (v, vocab.start as u32 + i))
            .collect();
        argmax_reduce(&self.comm, &pairs)
    }

    fn embedding(&self, b: &CudaBackend, table: &CudaTensor, ids: &[u32], vocab: Range<usize>) -> Result<CudaTensor> {
        let mut out = local_embedding(b, &self.stream, self.comm.rank(), table, ids, vocab)?;
        self.all_reduce_sum(b, &mut out)?;
        Ok(out)
    }

    fn stats(&self) -> CommStats {
        self.comm.stats()
    }

    fn broadcast_host_u32(&self, _b: &CudaBackend, buf: &mut [u32], root: usize) -> Result<()> {
        self.comm.broadcast_u32(buf, root)
    }

    fn abort(&self) {
        self.comm.abort();
    }

    fn recover(&self) -> Result<()> {
        self.comm.reset()
    }
}

/// The rows of `ids` in this rank's embedding slice `vocab`, zero rows for the other ids.
fn local_embedding(
    b: &CudaBackend,
    stream: &Arc<CudaStream>,
    rank: usize,
    table: &CudaTensor,
    ids: &[u32],
    vocab: Range<usize>,
) -> Result<CudaTensor> {
    let local: Vec<u32> = ids
        .iter()
        .map(|&id| {
            if vocab.contains(&(id as usize)) {
                id - vocab.start as u32
            } else {
                0
            }
        })
        .collect();
    let mut out = b.embedding(table, &local)?;
    let hidden = table.cols;
    if let DeviceData::Bf16(d) = &mut out.data {
        for (t, &id) in ids.iter().enumerate() {
            if !vocab.contains(&(id as usize)) {
                stream
                    .memset_zeros(&mut d.slice_mut(t * hidden..(t + 1) * hidden))
                    .map_err(driver("embedding", rank))?;
            }
        }
    }
    Ok(out)
}

/// Runs `f` once per rank of `plan` as threads that share GPU 0 (each with its own
/// [`CudaBackend`]) joined by [`HostStagedComm`]: the sharded CUDA forward checked on one GPU.
pub fn run_virtual_cuda_ranks<T: Send>(
    plan: Arc<ParallelPlan>,
    options: CudaOptions,
    f: impl Fn(CudaBackend, RankContext<CudaBackend>) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let comms = InProcessComm::group(plan.spec.world);
    run_threads(comms.into_iter().enumerate().collect(), |(rank, comm)| {
        let backend = CudaBackend::new(Gpu::open(0)?, options)?;
        let stream = backend.gpu().stream().clone();
        let context = RankContext {
            plan: plan.clone(),
            rank,
            comm: Box::new(HostStagedComm::new(comm, stream)),
        };
        f(backend, context)
    })
}
