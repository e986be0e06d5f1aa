//! [`TensorComm`] for the CUDA backend over NCCL, and the ranks of one node (one thread and
//! CUDA context per GPU). NCCL has run with one rank on one GPU; several GPUs not yet (see
//! docs/multi-gpu.md, "What is left"). The collectives are NCCL's on the backend's compute
//! stream, so a rank's greedy step runs through the backend's CUDA graphs with its all-reduces
//! inside the recording; the vocabulary argmax all-gathers each rank's per-row
//! `(max, column)` on the device and a kernel picks the global token (no host sync); the
//! embedding is one masked lookup kernel over the staged ids before the all-reduce. Eager
//! collectives are timed with CUDA events. After a failed run the group aborts every rank's
//! communicator and re-forms it from a fresh unique id ([`NcclRenewal`]).

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use ddtree_runtime::cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView, DriverError};
use ddtree_runtime::Gpu;

use crate::backend::cuda::{CudaKvCache, CudaTensor, DeviceData, RankReduce};
use crate::backend::Matrix;
use crate::backend::{Backend, CudaBackend, CudaOptions};
use crate::error::{EngineError, Result};
use crate::parallel::comm::{argmax_reduce, Bootstrap, Comm, CommStats, InProcessComm};
use crate::parallel::cpu::gather_vocab_host;
use crate::parallel::nccl::{NcclAbort, NcclBootstrap, NcclComm, NcclRenewal};
use crate::parallel::ranks::run_threads;
use crate::parallel::{AbortHandle, ParallelPlan, RankContext, TensorComm};

/// How long an abort waits for a rank thread inside an NCCL call on the communicator.
const ABORT_WAIT: Duration = Duration::from_secs(10);

/// The CUDA backend's collectives: one rank's NCCL communicator (replaced when the group is
/// re-formed after a failure).
pub struct CudaTensorComm {
    comm: RwLock<NcclComm>,
    /// Aborts the current communicator (shared with the group's abort handle).
    abort: Arc<Mutex<NcclAbort>>,
    renewal: Arc<NcclRenewal>,
    epoch: AtomicU64,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    /// The width of the ranks' vocabulary slices (rank `k`'s starts at `k * slice`).
    slice: usize,
    timing: Mutex<Timing>,
}

/// Eager collectives' event pairs not yet read, and the time read so far.
#[derive(Default)]
struct Timing {
    pending: Vec<(CudaEvent, CudaEvent)>,
    time: Duration,
}

/// Event pairs kept before they are read (each read waits for the pair's end).
const MAX_PENDING: usize = 4096;

fn driver(op: &str, rank: usize) -> impl Fn(DriverError) -> EngineError + '_ {
    move |e| EngineError::Comm {
        op: op.into(),
        rank,
        reason: format!("CUDA error {e}"),
    }
}

fn poisoned(op: &str, rank: usize) -> EngineError {
    EngineError::Comm {
        op: op.into(),
        rank,
        reason: "the communicator's lock is poisoned".into(),
    }
}

impl CudaTensorComm {
    /// Wraps rank `comm.rank()`'s communicator (made on `backend`'s compute stream, from
    /// `renewal`'s epoch-0 id) for `plan`.
    pub fn new(comm: NcclComm, renewal: Arc<NcclRenewal>, plan: &ParallelPlan) -> Self {
        let (rank, world, stream) = (comm.rank(), comm.world(), comm.stream());
        Self {
            abort: Arc::new(Mutex::new(comm.abort_handle())),
            comm: RwLock::new(comm),
            renewal,
            epoch: AtomicU64::new(0),
            stream,
            rank,
            world,
            // Rank 0's slice is a whole one (the plan cuts `div_ceil(vocab, world)` wide).
            slice: plan.shards[0].vocab.len(),
            timing: Mutex::default(),
        }
    }

    fn f32<'a>(x: &'a CudaTensor, op: &str) -> Result<&'a CudaSlice<f32>> {
        match &x.data {
            DeviceData::F32(d) => Ok(d),
            DeviceData::Bf16(_) => Err(EngineError::Forward(format!("{op}: expects f32 logits, got bf16"))),
        }
    }

    /// Runs the collective `f` on the communicator; outside a CUDA graph recording, between two
    /// events whose interval [`TensorComm::stats`] adds to the time in collectives (a recorded
    /// step's collectives are not timed: `--no-cuda-graphs` gives the split).
    fn run(&self, b: &CudaBackend, op: &str, f: impl FnOnce(&NcclComm) -> Result<()>) -> Result<()> {
        let comm = self.comm.read().map_err(|_| poisoned(op, self.rank))?;
        if b.is_recording() {
            return f(&comm);
        }
        // cudarc's default event flags disable timing; these events are timed.
        let flags = ddtree_runtime::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        let mark = || self.stream.record_event(Some(flags)).map_err(driver(op, self.rank));
        let start = mark()?;
        f(&comm)?;
        let end = mark()?;
        if let Ok(mut t) = self.timing.lock() {
            if t.pending.len() >= MAX_PENDING {
                Self::settle(&mut t);
            }
            t.pending.push((start, end));
        }
        Ok(())
    }

    /// Reads the pending event pairs into the total (waits for the last one).
    fn settle(t: &mut Timing) {
        for (a, b) in t.pending.drain(..) {
            if let Ok(ms) = a.elapsed_ms(&b) {
                t.time += Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3);
            }
        }
    }

    fn gather(
        &self,
        b: &CudaBackend,
        values: &CudaView<'_, f32>,
        indices: &CudaView<'_, u32>,
        all_v: &mut CudaSlice<f32>,
        all_i: &mut CudaSlice<u32>,
    ) -> Result<()> {
        self.run(b, "argmax_vocab", |c| {
            c.all_gather("argmax_vocab", values, all_v)?;
            c.all_gather("argmax_vocab", indices, all_i)
        })
    }
}

impl TensorComm<CudaBackend> for CudaTensorComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, b: &CudaBackend, x: &mut CudaTensor) -> Result<()> {
        let op = "all_reduce_sum";
        self.run(b, op, |c| match &mut x.data {
            DeviceData::Bf16(d) => c.all_reduce_sum(op, d),
            DeviceData::F32(d) => c.all_reduce_sum(op, d),
        })
    }

    fn gather_vocab(
        &self,
        b: &CudaBackend,
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
        self.run(b, op, |c| c.all_gather(op, &send, &mut all))?;
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

    /// Each rank's `(max, column)` per row all-gathered on the device and reduced by a kernel;
    /// one read of the tokens.
    fn argmax_vocab(&self, b: &CudaBackend, local: &CudaTensor, _vocab: Range<usize>) -> Result<Vec<u32>> {
        let op = "argmax_vocab";
        Self::f32(local, op)?;
        let rows = local.rows;
        let (values, mut indices) = b.argmax_on_device(local)?;
        let slice = self.slice;
        b.rank_argmax_into(
            &RankReduce {
                rank: self.rank,
                world: self.world,
                slice,
                gather: &|v, i, av, ai| self.gather(b, v, i, av, ai),
            },
            rows,
            &values,
            &mut indices,
        )?;
        b.read_rows(&indices, rows)
    }

    /// The step through the backend's CUDA graphs: the all-reduces and the argmax's
    /// all-gathers are recorded with the kernels (NCCL supports stream capture).
    fn greedy_forward(
        &self,
        b: &CudaBackend,
        cache: &mut CudaKvCache,
        _vocab: Range<usize>,
        forward: &mut dyn FnMut(&mut CudaKvCache) -> Result<CudaTensor>,
    ) -> Result<Vec<u32>> {
        let slice = self.slice;
        let reduce = RankReduce {
            rank: self.rank,
            world: self.world,
            slice,
            gather: &|v, i, av, ai| self.gather(b, v, i, av, ai),
        };
        b.greedy_graph(cache, forward, Some(&reduce))
    }

    fn device_argmax(&self) -> bool {
        true
    }

    fn embedding(&self, b: &CudaBackend, table: &CudaTensor, ids: &[u32], vocab: Range<usize>) -> Result<CudaTensor> {
        let mut out = b.embedding_slice(table, ids, vocab)?;
        self.all_reduce_sum(b, &mut out)?;
        Ok(out)
    }

    fn stats(&self) -> CommStats {
        let calls = self.comm.read().map(|c| c.stats().calls).unwrap_or(0);
        let time = self
            .timing
            .lock()
            .map(|mut t| {
                Self::settle(&mut t);
                t.time
            })
            .unwrap_or_default();
        CommStats { calls, time }
    }

    /// Staged through the device: copy in, NCCL broadcast on the compute stream, copy back
    /// (one host sync, as reading the values back would be anyway).
    fn broadcast_host_u32(&self, b: &CudaBackend, buf: &mut [u32], root: usize) -> Result<()> {
        let (op, s) = ("broadcast_host_u32", &self.stream);
        if buf.is_empty() {
            return Ok(());
        }
        let mut d = s.clone_htod(buf).map_err(driver(op, self.rank))?;
        self.run(b, op, |c| c.broadcast(op, &mut d, root))?;
        buf.copy_from_slice(&s.clone_dtoh(&d).map_err(driver(op, self.rank))?);
        Ok(())
    }

    fn abort(&self) {
        if let Some(h) = self.abort_handle() {
            h();
        }
    }

    fn abort_handle(&self) -> Option<AbortHandle> {
        let current = self.abort.clone();
        Some(Arc::new(move || current.lock().is_ok_and(|a| a.abort(ABORT_WAIT))))
    }

    /// Every rank joins a new communicator from the next epoch's unique id (blocking until all
    /// have), and the backend's recordings, which hold the old one's collectives, are dropped.
    fn recover(&self, b: &CudaBackend) -> Result<()> {
        let op = "recover";
        // A stuck enqueue must not keep the old communicator alive (or the lock held).
        self.abort();
        b.synchronize().map_err(|e| EngineError::Comm {
            op: op.into(),
            rank: self.rank,
            reason: format!("the GPU did not drain after the abort: {e}"),
        })?;
        let epoch = self.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        let id = self.renewal.id(epoch)?;
        let fresh = NcclComm::init(self.stream.clone(), self.rank, self.world, id)?;
        *self.abort.lock().map_err(|_| poisoned(op, self.rank))? = fresh.abort_handle();
        *self.comm.write().map_err(|_| poisoned(op, self.rank))? = fresh;
        b.forget_graphs();
        Ok(())
    }
}

/// Rank `rank` of an NCCL group on GPU `rank` of this node: its backend and collectives.
fn cuda_rank(
    plan: &Arc<ParallelPlan>,
    options: CudaOptions,
    rank: usize,
    renewal: &Arc<NcclRenewal>,
) -> Result<(CudaBackend, RankContext<CudaBackend>)> {
    let world = plan.spec.world;
    let gpu = Gpu::open(rank)?;
    let backend = CudaBackend::new(gpu, options)?;
    let comm = NcclComm::init(backend.gpu().stream().clone(), rank, world, renewal.id(0)?)?;
    let context = RankContext {
        plan: plan.clone(),
        rank,
        comm: Box::new(CudaTensorComm::new(comm, renewal.clone(), plan)),
    };
    Ok((backend, context))
}

/// Runs `f` once per rank of `plan` on GPUs `0..world` of this node: per rank a thread that
/// opens its GPU, makes its [`CudaBackend`] with `options`, joins the NCCL group on the
/// backend's compute stream and calls `f` with the backend and its [`RankContext`].
pub fn run_cuda_ranks<T: Send>(
    plan: Arc<ParallelPlan>,
    options: CudaOptions,
    f: impl Fn(CudaBackend, RankContext<CudaBackend>) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let boot = NcclBootstrap::new(plan.spec.world)?;
    let ranks = boot.local_ranks().collect();
    let renewal = NcclRenewal::new(boot)?;
    run_threads(ranks, |rank| {
        let (backend, context) = cuda_rank(&plan, options, rank, &renewal)?;
        f(backend, context)
    })
}

impl crate::parallel::group::RankGroup<CudaBackend> {
    /// Long-lived ranks on GPUs `0..world` of this node (a server's): per rank a thread that
    /// opens its GPU, makes its [`CudaBackend`] with `options`, joins the NCCL group on the
    /// backend's compute stream and keeps the model `make` loads. After a rank fails alone the
    /// group aborts every rank's communicator and re-forms the group (see
    /// [`crate::parallel::group`]).
    pub fn cuda(
        plan: Arc<ParallelPlan>,
        options: CudaOptions,
        make: impl Fn(CudaBackend, RankContext<CudaBackend>) -> Result<crate::Model<CudaBackend>> + Send + Sync + 'static,
    ) -> Result<Self> {
        let world = plan.spec.world;
        let renewal = NcclRenewal::new(NcclBootstrap::new(world)?)?;
        Self::spawn(world, move |rank| {
            let (backend, context) = cuda_rank(&plan, options, rank, &renewal)?;
            make(backend, context)
        })
    }
}

/// Copy-based collectives for ranks that share one GPU (a test of the sharded CUDA forward
/// without several GPUs, not a collective for real multi-GPU runs: those use NCCL): buffers are
/// read back, combined through an in-process group on the host, and written again. Its steps
/// stay eager (the default [`TensorComm::greedy_forward`]): host copies in the middle of a step
/// cannot be captured in a CUDA graph, and its argmax is reduced on the host.
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
        let mut out = b.embedding_slice(table, ids, vocab)?;
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

    fn recover(&self, _b: &CudaBackend) -> Result<()> {
        self.comm.reset()
    }
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
