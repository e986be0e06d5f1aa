//! The CUDA backend: bf16 activations on the GPU, the generated kernels of `ddtree-kernels`
//! (tuned variants from the per-GPU tune cache), cuBLAS for the dense bf16 products, INT4
//! routed experts through the grouped W4A16 MoE kernels, and the latent cache in device memory.
//!
//! Every op enqueues on the GPU's stream, or inside a branch ([`Backend::begin_branch`]: the
//! shared experts, the latent KV path) on a second, lower-priority stream that forks from it
//! and joins it again; nothing synchronises except the copies back to
//! the host ([`Backend::to_host`], [`Backend::argmax_rows`], a replayed greedy forward's argmax
//! rows, the host tree of [`Backend::draft_tree`], and a device tree round's accept result),
//! which [`Backend::host_reads`] counts. A greedy fixed-budget DDTree round
//! ([`Backend::device_tree_round`], module `round`) reads back only its accept result.

mod attention;
mod cache;
mod graph;
mod linear;
mod lookups;
mod moe;
mod norm;
mod profile;
mod round;
mod staging;
mod types;
mod weights;

use std::sync::{Arc, Mutex};

use ddtree_kernels::gemv::{
    self, GemvBf16, GemvBf16F32, GemvChoice, GemvGateUpSilu, GemvRmsNormBf16, GemvSplitBf16, GemvSplitF32,
    GemvSplitGateUpSilu,
};
use ddtree_kernels::residual::{self, AddRmsNorm, CastBf16F32, CastF32Bf16, CastParams, CopyRowsF32};
use ddtree_kernels::tree::{DraftTree, LATENT, ROPE};
use ddtree_kernels::w4a16::gemm::{self, default_dense, GemmArgs, GemmTiling, Scratch, W4a16Kernel};
use ddtree_kernels::w4a16::gemm_wg::{self, W4a16GemmWg, W4a16WgParams};
use ddtree_kernels::w4a16::gemv::{self as w4gemv, GemvMode, W4a16Gemv};
use ddtree_kernels::w4a16::layout::{interleaved_words, quantize, scale_words, PackedInt4};
use ddtree_kernels::w4a16::moe::{DeviceExperts, MoeInput, MoeKernels, MoeVariant};
use ddtree_kernels::w4a16::{Epilogue, RepackParams, W4a16Params, W4a16Repack};
use ddtree_kernels::{topk, tree};
use ddtree_kernels::{
    AddAssign, AddParams, CopyParams, CopyRows, Embedding, FillParams, FillRandomBf16, FillRandomF32, FillRandomU32,
    GqaAttention, GqaParams, MlaAbsorbOutput, MlaAbsorbQuery, MlaAttention, MlaAttnParams, MlaKvAppend, MoeRoute,
    MoeRouteParams, RmsNorm, RopeInterleaved, RowTopk, SiluMulParams, SiluMulSplit, TopkRunner,
};
use ddtree_runtime::blas::{BatchedGemm, RightOperand, Strided};
use ddtree_runtime::cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};
use ddtree_runtime::{Blas, CompiledKernel, Gpu, RuntimeError, TunedKernels};
use half::bf16;

pub(crate) use attention::MLA_COMBINE_OUTPUT_MAX_ROWS;
pub use attention::{AttentionKernel, WG_DECODE_MIN_KEYS};
pub(crate) use graph::length_bucket;
pub(crate) use graph::RankReduce;
pub(crate) use linear::DENSE_INT4_GEMV_MAX_ROWS;
pub use lookups::Lookup;
pub(crate) use moe::DENSE_EXPERT_GROUP;
pub use profile::HOST_PROFILE_ENV;
pub use types::{CudaExperts, CudaKvCache, CudaRouting, CudaTensor, CudaVector, CudaWeight, DeviceData};
#[allow(unused_imports)]
use {attention::*, linear::*, moe::*, profile::*, staging::*, weights::*};

use crate::backend::{
    unfused_add2_rms_norm, unfused_gate_up_silu, AttentionSpan, Backend, GqaDims, GreedyVerify, HostLinear, Matrix,
    MlaDims, StepInputs, TreeRound, TreeRoundOutcome,
};
use crate::config::MoeConfig;
use crate::error::{EngineError, Result};
use crate::mask::AncestorMask;
use crate::model::Ffn;
use crate::rope::Rope;

/// Options of [`CudaBackend::new`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CudaOptions {
    /// Ignore the tune cache: every kernel runs its default variant (`--no-autotune`).
    pub no_autotune: bool,
    /// Run every greedy forward eagerly instead of recording and replaying CUDA graphs
    /// (`--no-cuda-graphs`).
    pub no_graphs: bool,
    /// Enqueue every op on one stream: no concurrent branches ([`Backend::begin_branch`],
    /// `--one-stream`). Also the case while ops are profiled (`DDTREE_PROFILE`).
    pub one_stream: bool,
    /// Launch kernels without programmatic dependent launch (`--no-pdl`; see
    /// [`Gpu::set_programmatic_launch`]).
    pub no_pdl: bool,
    /// The tensor-core kernel of the MLA verify attention (`--attention`).
    pub attention: AttentionKernel,
}

/// The second stream of [`Backend::begin_branch`]: a branch's ops run there, concurrently
/// with the main stream's until [`Backend::join_branch`]. It has its own cuBLAS handle (a
/// handle's workspace serves one stream at a time).
struct SideStream {
    stream: Arc<CudaStream>,
    blas: Blas,
    /// Recorded on the main stream when a branch begins and on the side stream when it is
    /// joined (reused: a wait takes the work recorded at the time of the wait).
    fork: CudaEvent,
    join: CudaEvent,
}

/// Rope tables uploaded for one [`Rope`].
struct RopeTables {
    rope: Rope,
    positions: usize,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

/// A [`Staged`] slot: its device buffer and the values last copied to it (`None`: written on
/// the device).
type StagedSlot = (Staged, Option<Vec<u32>>, Arc<CudaSlice<u32>>);

/// Scratch state behind the backend's `&self` ops.
struct State {
    ropes: Vec<Arc<RopeTables>>,
    identity: Arc<CudaSlice<u32>>,
    /// One device buffer per [`Staged`] slot with the values last copied to it (`None` when a
    /// kernel wrote it: a device round's tree): a forward uploads its inputs once, not once per
    /// layer, and always to the same address (recorded graphs read them there).
    staged: Vec<StagedSlot>,
    /// CUDA graphs of greedy forwards, and whether one is being recorded.
    graphs: graph::Graphs,
    /// The largest cache capacity asked for: rope tables cover it from the start.
    max_capacity: usize,
    /// MoE buffers per (tokens, top-k, variant, expert intermediate size).
    moe_bufs: Vec<(
        (usize, usize, MoeVariant, usize),
        ddtree_kernels::w4a16::moe::MoeBuffers,
    )>,
    /// The W4A16 split-K partials, one per stream ([`CudaBackend::lane`]): the main stream's
    /// and a branch's linears may run at the same time.
    w4a16: [Scratch; 2],
    /// Verify attention per variant ([`Lookup::mla_verify`]).
    verify: Vec<tree::gpu::GpuVerify>,
    /// The MoE block's kernels per variant ([`Lookup::moe_experts`]).
    moe: Vec<(MoeVariant, Arc<MoeKernels>)>,
    builders: Vec<((usize, usize, usize), tree::gpu::GpuBuilder)>,
    /// The device rounds' accept and compaction, and their root token buffer.
    accept: Option<(tree::gpu::GpuAccept, CudaSlice<u32>)>,
    /// The split top-1 of few logits rows ([`CudaBackend::argmax_into`]), made on first use.
    argmax: Option<TopkRunner>,
}

/// The CUDA backend on one GPU.
pub struct CudaBackend {
    kernels: TunedKernels,
    profile: HostProfile,
    /// The stream every op is enqueued on outside branches.
    main: Arc<CudaStream>,
    blas: Blas,
    /// The branches' stream (`None`: one stream).
    side: Option<SideStream>,
    /// Ops are being enqueued on the side stream (between `begin_branch` and `end_branch`).
    on_side: std::sync::atomic::AtomicBool,
    state: Mutex<State>,
    /// The spare KV-cache buffer (see [`types::CachePool`]).
    caches: types::CachePool,
    /// A greedy forward is being recorded (readable without the state lock).
    recording: std::sync::atomic::AtomicBool,
    /// Copies to the host so far ([`Backend::host_reads`]).
    reads: std::sync::atomic::AtomicU64,
    /// Programmatic dependent launch for forwards of at most [`PDL_MAX_ROWS`] rows (not
    /// `--no-pdl`).
    pdl: bool,
    /// The verify attention's kernel (`--attention`).
    attention: AttentionKernel,
    /// Whether tune-cache lookups are recorded ([`CudaBackend::record_lookups`]), and those made.
    record_lookups: std::sync::atomic::AtomicBool,
    lookups: Mutex<std::collections::HashSet<Lookup>>,
    /// The tuned parameters per lookup ([`CudaBackend::tuned_params`]).
    tuned_params: Mutex<std::collections::HashMap<Lookup, Arc<dyn std::any::Any + Send + Sync>>>,
    /// The GPU has `wgmma`: dense INT4 products of [`gemm_wg::WG_MIN_ROWS`] rows or more run
    /// on [`W4a16GemmWg`].
    wgmma: bool,
}

/// Most rows of a forward whose kernels launch with programmatic dependent launch. A forward
/// of a few rows is a chain of weight GEMVs that load their first weights before they wait for
/// their predecessor; a larger one (a verify tree of 9 rows and more) runs tensor-core GEMMs
/// that gain nothing from an early start (and whose waiting blocks presumably hold SM slots), and
/// measured slower with it (docs/journal/engine-decode.md).
pub const PDL_MAX_ROWS: usize = 8;

pub(crate) fn fail(reason: String) -> EngineError {
    EngineError::Backend {
        backend: "cuda".into(),
        reason,
    }
}

fn rt(e: RuntimeError) -> EngineError {
    fail(e.to_string())
}

impl From<RuntimeError> for EngineError {
    fn from(e: RuntimeError) -> Self {
        rt(e)
    }
}

fn drv(what: &'static str) -> impl FnOnce(ddtree_runtime::cudarc::driver::DriverError) -> EngineError {
    move |e| fail(format!("{what}: {e}"))
}

/// The largest `u32` element index the kernels take.
fn check_u32(what: &str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| fail(format!("{what}: {n} elements exceed the kernels' 32-bit indexing")))
}

/// Makes `waiter` wait for every op enqueued on `from` so far, through `event`.
fn wait_for(event: &CudaEvent, from: &CudaStream, waiter: &CudaStream) -> Result<()> {
    event.record(from).map_err(drv("recording an event"))?;
    waiter.wait(event).map_err(drv("waiting for an event"))
}

impl CudaBackend {
    /// The backend on `gpu`, with tuned variants from `gpu`'s tune cache (defaults with
    /// `options.no_autotune`).
    pub fn new(gpu: Gpu, options: CudaOptions) -> Result<CudaBackend> {
        let gpu_cc = gpu.fingerprint().compute_capability;
        let attention = resolve_attention(options.attention, gpu_cc)?;
        let stream = gpu.stream().clone();
        // cudarc's per-buffer event tracking only costs time here.
        // SAFETY: a buffer is used on the stream that allocated it, or on the other stream in a
        // branch whose begin and join order it (`begin_branch`; shared state made in a branch
        // is made on the main stream, which the side stream then waits for: `after_main`).
        unsafe { gpu.context().disable_event_tracking() };
        // Each kernel may launch while its predecessor drains (the weight GEMVs and absorbed-MLA
        // kernels load weights before they wait for it); per forward, see `begin_forward`.
        gpu.set_programmatic_launch(!options.no_pdl);
        let blas = Blas::new(&gpu)?;
        let profile = HostProfile::from_env(&stream);
        let side = if options.one_stream || profile.on() {
            None
        } else {
            // Default priority, below the main stream's (`Gpu::open`): the critical path's
            // blocks go first, a branch's fill the SMs around them.
            let side = stream.fork().map_err(drv("making the side stream"))?;
            let event = || gpu.context().new_event(None).map_err(drv("making an event"));
            Some(SideStream {
                blas: Blas::on_stream(side.clone())?,
                fork: event()?,
                join: event()?,
                stream: side,
            })
        };
        let state = State {
            ropes: Vec::new(),
            identity: Arc::new(stream.alloc_zeros::<u32>(1).map_err(drv("allocating"))?),
            staged: Vec::new(),
            graphs: graph::Graphs::new(options.no_graphs),
            max_capacity: 0,
            moe_bufs: Vec::new(),
            w4a16: [
                Scratch::new(&stream, 1)?,
                Scratch::new(side.as_ref().map_or(&stream, |s| &s.stream), 1)?,
            ],
            verify: Vec::new(),
            moe: Vec::new(),
            builders: Vec::new(),
            accept: None,
            argmax: None,
        };
        Ok(CudaBackend {
            profile,
            kernels: if options.no_autotune {
                TunedKernels::new(gpu).defaults_only()
            } else {
                TunedKernels::new(gpu)
            },
            main: stream,
            blas,
            side,
            on_side: Default::default(),
            state: Mutex::new(state),
            caches: Default::default(),
            recording: Default::default(),
            reads: Default::default(),
            pdl: !options.no_pdl,
            attention,
            record_lookups: Default::default(),
            lookups: Default::default(),
            tuned_params: Default::default(),
            wgmma: ddtree_kernels::wgmma_supported(gpu_cc),
        })
    }

    /// Opens GPU 0 (`Gpu::open`) and builds the backend on it.
    pub fn open(options: CudaOptions) -> Result<CudaBackend> {
        CudaBackend::new(Gpu::open(0)?, options)
    }

    /// The GPU.
    pub fn gpu(&self) -> &Gpu {
        self.kernels.gpu()
    }

    /// The tuned kernels (tune cache and compiled variants).
    pub fn kernels(&self) -> &TunedKernels {
        &self.kernels
    }

    /// Waits for every enqueued op.
    pub fn synchronize(&self) -> Result<()> {
        if let Some(s) = &self.side {
            s.stream.synchronize().map_err(drv("synchronizing"))?;
        }
        self.main.synchronize().map_err(drv("synchronizing"))
    }

    /// The stream ops are enqueued on now: the side stream inside a branch, else the main one.
    fn stream(&self) -> &Arc<CudaStream> {
        match &self.side {
            Some(s) if self.on_side() => &s.stream,
            _ => &self.main,
        }
    }

    /// The cuBLAS handle of [`CudaBackend::stream`].
    fn blas(&self) -> &Blas {
        match &self.side {
            Some(s) if self.on_side() => &s.blas,
            _ => &self.blas,
        }
    }

    /// Whether ops go to the side stream now (inside a branch).
    fn on_side(&self) -> bool {
        self.on_side.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// 0 on the main stream, 1 inside a branch: the index of per-stream scratch.
    fn lane(&self) -> usize {
        usize::from(self.side.is_some() && self.on_side())
    }

    /// After shared state (uploads, staging, tables) was made on the main stream: inside a
    /// branch the side stream waits for it.
    fn after_main(&self) -> Result<()> {
        if self.on_side() {
            self.fork_side()
        } else {
            Ok(())
        }
    }

    /// Makes the side stream wait for every op enqueued on the main stream so far.
    fn fork_side(&self) -> Result<()> {
        self.side
            .as_ref()
            .map_or(Ok(()), |s| wait_for(&s.fork, &self.main, &s.stream))
    }

    /// Makes the main stream wait for every op enqueued on the side stream so far.
    fn join_side(&self) -> Result<()> {
        self.side
            .as_ref()
            .map_or(Ok(()), |s| wait_for(&s.join, &s.stream, &self.main))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("backend state lock")
    }

    /// Copies `src` to the host (waiting for the GPU), counted in [`Backend::host_reads`].
    fn read_back<T: DeviceRepr>(&self, src: &impl DevicePtr<T>) -> Result<Vec<T>> {
        self.count_read();
        self.main.clone_dtoh(src).map_err(drv("copying from the GPU"))
    }

    /// Counts one copy to the host ([`Backend::host_reads`]).
    fn count_read(&self) {
        self.reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every caller writes the buffer fully before reading it.
        unsafe { self.stream().alloc::<T>(n.max(1)) }.map_err(drv("allocating GPU memory"))
    }

    fn upload<T: DeviceRepr + ValidAsZeroBits>(&self, v: &[T]) -> Result<CudaSlice<T>> {
        if self.recording.load(std::sync::atomic::Ordering::Relaxed) {
            // A copy from host memory cannot be replayed: the recording fails (the forward then
            // runs eagerly).
            return Err(fail("a host-to-device copy inside a CUDA graph recording".into()));
        }
        // On the main stream, even inside a branch: what is uploaded may be kept and used on
        // both streams (tables, index buffers).
        let d = if v.is_empty() {
            self.main.alloc_zeros::<T>(1).map_err(drv("allocating"))?
        } else {
            self.main.clone_htod(v).map_err(drv("copying to the GPU"))?
        };
        self.after_main()?;
        Ok(d)
    }

    fn tensor_bf16(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        Ok(CudaTensor {
            rows,
            cols,
            data: DeviceData::Bf16(self.alloc(rows * cols)?),
        })
    }

    fn variant<K: ddtree_codegen::Kernel>(&self, p: &K::Params) -> Result<Arc<CompiledKernel<K>>> {
        Ok(self.kernels.variant::<K>(p)?)
    }

    /// The first variant in `K`'s space that `ok` accepts.
    fn first_variant<K: ddtree_codegen::Kernel>(
        &self,
        ok: impl Fn(&K::Params) -> bool,
    ) -> Result<Arc<CompiledKernel<K>>> {
        let p = K::space()
            .into_iter()
            .find(|p| ok(p))
            .ok_or_else(|| fail(format!("no variant of `{}` fits", K::NAME)))?;
        self.variant::<K>(&p)
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Vector = CudaVector;
    type Weight = CudaWeight;
    type KvCache = CudaKvCache;
    type Routing = CudaRouting;
    type Experts = CudaExperts;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn dims(&self, x: &CudaTensor) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn graph_counts(&self) -> Option<(u64, u64)> {
        Some(self.graph_counts_now())
    }

    fn begin_branch(&self) -> Result<()> {
        if self.side.is_none() {
            return Ok(());
        }
        if self.on_side.swap(true, std::sync::atomic::Ordering::Relaxed) {
            return Err(fail("begin_branch inside a branch: branches do not nest".into()));
        }
        self.fork_side()
    }

    fn end_branch(&self) -> Result<()> {
        self.on_side.store(false, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn join_branch(&self) -> Result<()> {
        self.join_side()
    }

    fn begin_forward(&self, step: &StepInputs<'_>) -> Result<()> {
        // Recorded graphs keep the launch attributes of their recording.
        self.gpu()
            .set_programmatic_launch(self.pdl && step.tokens.len() <= PDL_MAX_ROWS);
        self.stage_step(step)
    }

    fn greedy_forward(
        &self,
        cache: &mut CudaKvCache,
        forward: &mut dyn FnMut(&mut CudaKvCache) -> Result<CudaTensor>,
    ) -> Result<Vec<u32>> {
        self.greedy_graph(cache, forward, None)
    }

    fn device_tree_round(
        &self,
        cache: &mut CudaKvCache,
        round: TreeRound<'_, CudaTensor>,
        verify: &mut GreedyVerify<'_, CudaKvCache>,
    ) -> Result<Option<TreeRoundOutcome>> {
        self.tree_round(cache, round, verify)
    }

    fn host_reads(&self) -> Option<u64> {
        Some(self.reads.load(std::sync::atomic::Ordering::Relaxed))
    }

    fn load_vector(&self, data: Vec<f32>) -> Result<CudaVector> {
        CudaBackend::load_vector(self, data)
    }

    fn load_matrix(&self, m: Matrix) -> Result<CudaTensor> {
        CudaBackend::load_matrix(self, m)
    }

    fn load_logits(&self, m: Matrix) -> Result<CudaTensor> {
        CudaBackend::load_logits(self, m)
    }

    fn load_weight(&self, w: HostLinear) -> Result<CudaWeight> {
        CudaBackend::load_weight(self, w)
    }

    fn load_experts(&self, experts: Vec<Ffn<HostLinear>>) -> Result<CudaExperts> {
        CudaBackend::load_experts(self, experts)
    }

    fn random_weight(&self, out: usize, inp: usize, int4_group: Option<usize>, seed: u64) -> Result<CudaWeight> {
        CudaBackend::random_weight(self, out, inp, int4_group, seed)
    }

    fn random_experts(
        &self,
        count: usize,
        inter: usize,
        hidden: usize,
        int4_group: Option<usize>,
        seed: u64,
    ) -> Result<CudaExperts> {
        CudaBackend::random_experts(self, count, inter, hidden, int4_group, seed)
    }

    fn random_vector(&self, len: usize, lo: f32, hi: f32, seed: u64) -> Result<CudaVector> {
        CudaBackend::random_vector(self, len, lo, hi, seed)
    }

    fn random_matrix(&self, rows: usize, cols: usize, seed: u64) -> Result<CudaTensor> {
        CudaBackend::random_matrix(self, rows, cols, seed)
    }

    fn kv_fill_random(&self, cache: &mut CudaKvCache, len: usize, seed: u64) -> Result<()> {
        CudaBackend::kv_fill_random(self, cache, len, seed)
    }

    fn new_kv_cache(&self, layers: usize, row_width: usize, capacity: usize) -> Result<CudaKvCache> {
        CudaBackend::new_kv_cache(self, layers, row_width, capacity)
    }

    fn draft_tree(&self, drafted: &CudaTensor, depth: usize, budget: usize, root: u32) -> Result<DraftTree> {
        CudaBackend::draft_tree(self, drafted, depth, budget, root)
    }

    fn to_host(&self, x: &CudaTensor) -> Result<Matrix> {
        CudaBackend::to_host(self, x)
    }

    fn take_rows(&self, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor> {
        CudaBackend::take_rows(self, x, rows)
    }

    fn embedding(&self, table: &CudaTensor, ids: &[u32]) -> Result<CudaTensor> {
        CudaBackend::embedding(self, table, ids)
    }

    fn embedding_slice(&self, table: &CudaTensor, ids: &[u32], vocab: std::ops::Range<usize>) -> Result<CudaTensor> {
        CudaBackend::embedding_slice(self, table, ids, vocab)
    }

    fn rms_norm(&self, x: &CudaTensor, weight: &CudaVector, eps: f32) -> Result<CudaTensor> {
        CudaBackend::rms_norm(self, x, weight, eps)
    }

    fn rms_norm_linear(&self, x: &CudaTensor, weight: &CudaVector, eps: f32, w: &CudaWeight) -> Result<CudaTensor> {
        CudaBackend::rms_norm_linear(self, x, weight, eps, w)
    }

    fn linear(&self, x: &CudaTensor, w: &CudaWeight) -> Result<CudaTensor> {
        CudaBackend::linear(self, x, w)
    }

    fn linear_f32(&self, x: &CudaTensor, w: &CudaWeight) -> Result<CudaTensor> {
        CudaBackend::linear_f32(self, x, w)
    }

    fn argmax_rows(&self, logits: &CudaTensor) -> Result<Vec<u32>> {
        CudaBackend::argmax_rows(self, logits)
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        CudaBackend::add_assign(self, x, y)
    }

    fn residual(&self, x: CudaTensor) -> Result<CudaTensor> {
        CudaBackend::residual(self, x)
    }

    fn add_rms_norm(&self, x: &mut CudaTensor, y: &CudaTensor, weight: &CudaVector, eps: f32) -> Result<CudaTensor> {
        CudaBackend::add_rms_norm(self, x, y, weight, eps)
    }

    fn add2_rms_norm(
        &self,
        x: &mut CudaTensor,
        a: CudaTensor,
        b: &CudaTensor,
        weight: &CudaVector,
        eps: f32,
    ) -> Result<CudaTensor> {
        CudaBackend::add2_rms_norm(self, x, a, b, weight, eps)
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
        CudaBackend::silu_mul(self, gate, up)
    }

    fn gate_up_silu(&self, x: &CudaTensor, gate: &CudaWeight, up: &CudaWeight) -> Result<CudaTensor> {
        CudaBackend::gate_up_silu(self, x, gate, up)
    }

    fn concat_cols(&self, parts: &[&CudaTensor]) -> Result<CudaTensor> {
        CudaBackend::concat_cols(self, parts)
    }

    fn head_rms_norm(&self, x: &CudaTensor, weight: &CudaVector, eps: f32) -> Result<CudaTensor> {
        CudaBackend::head_rms_norm(self, x, weight, eps)
    }

    fn rope_heads(&self, x: &mut CudaTensor, rope: &Rope, positions: &[u32]) -> Result<()> {
        CudaBackend::rope_heads(self, x, rope, positions)
    }

    fn mla_append_kv(
        &self,
        kv_a: &CudaTensor,
        norm: &CudaVector,
        eps: f32,
        rope: &Rope,
        positions: &[u32],
        cache: &mut CudaKvCache,
        layer: usize,
    ) -> Result<()> {
        CudaBackend::mla_append_kv(self, kv_a, norm, eps, rope, positions, cache, layer)
    }

    fn mla_query(
        &self,
        q: &CudaTensor,
        kv_b: &CudaWeight,
        rope: &Rope,
        positions: &[u32],
        d: MlaDims,
    ) -> Result<CudaTensor> {
        CudaBackend::mla_query(self, q, kv_b, rope, positions, d)
    }

    fn mla_attention(
        &self,
        q_abs: &CudaTensor,
        cache: &CudaKvCache,
        layer: usize,
        span: AttentionSpan<'_>,
        d: MlaDims,
        scale: f32,
    ) -> Result<CudaTensor> {
        CudaBackend::mla_attention(self, q_abs, cache, layer, span, d, scale)
    }

    fn mla_attention_output(
        &self,
        q_abs: &CudaTensor,
        cache: &CudaKvCache,
        layer: usize,
        span: AttentionSpan<'_>,
        d: MlaDims,
        scale: f32,
        kv_b: &CudaWeight,
    ) -> Result<CudaTensor> {
        CudaBackend::mla_attention_output(self, q_abs, cache, layer, span, d, scale, kv_b)
    }

    fn mla_output(&self, o_lat: &CudaTensor, kv_b: &CudaWeight, d: MlaDims) -> Result<CudaTensor> {
        CudaBackend::mla_output(self, o_lat, kv_b, d)
    }

    fn moe_route(&self, logits: &CudaTensor, bias: &CudaVector, cfg: &MoeConfig) -> Result<CudaRouting> {
        CudaBackend::moe_route(self, logits, bias, cfg)
    }

    fn moe_experts(&self, x: &CudaTensor, routing: &CudaRouting, ex: &CudaExperts) -> Result<CudaTensor> {
        CudaBackend::moe_experts(self, x, routing, ex)
    }

    fn moe_localize(&self, routing: CudaRouting, local: std::ops::Range<usize>) -> Result<CudaRouting> {
        CudaBackend::moe_localize(self, routing, local)
    }

    fn kv_append(&self, cache: &mut CudaKvCache, layer: usize, rows: &CudaTensor) -> Result<()> {
        CudaBackend::kv_append(self, cache, layer, rows)
    }

    fn gqa_attention(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        k_layer: usize,
        v_layer: usize,
        dims: GqaDims,
        scale: f32,
    ) -> Result<CudaTensor> {
        CudaBackend::gqa_attention(self, q, cache, k_layer, v_layer, dims, scale)
    }

    fn kv_len(&self, cache: &CudaKvCache) -> usize {
        CudaBackend::kv_len(self, cache)
    }

    fn kv_truncate(&self, cache: &mut CudaKvCache, len: usize) -> Result<()> {
        CudaBackend::kv_truncate(self, cache, len)
    }

    fn kv_compact(&self, cache: &mut CudaKvCache, base: usize, keep: &[usize]) -> Result<()> {
        CudaBackend::kv_compact(self, cache, base, keep)
    }
}

impl CudaBackend {}
