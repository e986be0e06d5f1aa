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

mod graph;
mod round;
mod types;

use std::sync::{Arc, Mutex};

use ddtree_kernels::gemv::{
    self, GemvBf16, GemvBf16F32, GemvChoice, GemvGateUpSilu, GemvRmsNormBf16, GemvSplitBf16, GemvSplitF32,
    GemvSplitGateUpSilu,
};
use ddtree_kernels::residual::{self, AddRmsNorm, CastBf16F32, CastF32Bf16, CastParams, CopyRowsF32};
use ddtree_kernels::tree::{build_reference, DraftTree, TreeBuild, LATENT, ROPE};
use ddtree_kernels::tune::TreeBuildKey;
use ddtree_kernels::w4a16::gemm::{self, default_dense, GemmArgs, GemmTiling, Scratch, W4a16Kernel, FUSED_SPACE};
use ddtree_kernels::w4a16::gemm_wg::{self, W4a16GemmWg, W4a16WgParams};
use ddtree_kernels::w4a16::gemv::{self as w4gemv, GemvMode, W4a16Gemv};
use ddtree_kernels::w4a16::layout::{interleaved_words, quantize, scale_words, PackedInt4};
use ddtree_kernels::w4a16::moe::{DeviceExperts, GroupedPair, MoeInput, MoeKernels};
use ddtree_kernels::w4a16::{Epilogue, Layout, RepackParams, W4a16Params, W4a16Repack};
use ddtree_kernels::{add, fill, topk, tree, tune};
use ddtree_kernels::{
    AddAssign, AddParams, CopyParams, CopyRows, Embedding, FillParams, FillRandomBf16, FillRandomF32, FillRandomU32,
    GqaAttention, GqaParams, MlaAbsorbOutput, MlaAbsorbQuery, MlaAttention, MlaAttnParams, MlaKvAppend, MoeRoute,
    MoeRouteParams, RmsNorm, RopeInterleaved, RowTopk, SiluMulParams, SiluMulSplit, TopkRunner,
};
use ddtree_runtime::blas::{BatchedGemm, RightOperand, Strided};
use ddtree_runtime::cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};
use ddtree_runtime::{Blas, CompiledKernel, Gpu, RuntimeError, TunedKernels};
use half::bf16;

pub use types::{CudaExperts, CudaKvCache, CudaRouting, CudaTensor, CudaVector, CudaWeight, DeviceData};

use crate::backend::{
    unfused_add2_rms_norm, unfused_gate_up_silu, AttentionSpan, Backend, GqaDims, GreedyVerify, HostLinear, Matrix,
    MlaDims, StepInputs, TreeRound, TreeRoundOutcome,
};
use crate::config::MoeConfig;
use crate::error::{EngineError, Result};
use crate::mask::AncestorMask;
use crate::model::Ffn;
use crate::rope::Rope;

/// Set to `1` to time every backend op on the host (its enqueue cost), to `sync` to wait for the
/// GPU at the end of every op (each op's GPU time, serialized, launch latency included), or to
/// `gpu` to bracket every op with CUDA events (each op's GPU time in the steady stream, gaps
/// between kernels included, nothing serialized); the table, per op and per forward row count,
/// is printed to stderr when the backend is dropped.
pub const HOST_PROFILE_ENV: &str = "DDTREE_HOST_PROFILE";

/// How [`HostProfile`] times an op.
enum ProfileMode {
    Host,
    Sync(Arc<CudaStream>),
    Events(Arc<CudaStream>),
}

/// Time per backend op and forward row count (see [`HOST_PROFILE_ENV`]).
struct HostProfile {
    mode: Option<ProfileMode>,
    /// Rows of the forward in flight (set by the embedding, its first op).
    rows: std::sync::atomic::AtomicUsize,
    ops: Mutex<Vec<(&'static str, usize, u64, f64)>>,
    /// Event pairs not yet read back (events mode).
    pending: Mutex<Vec<(&'static str, usize, CudaEvent, CudaEvent)>>,
}

/// One op being timed; adds its time when dropped.
struct Span<'a> {
    profile: &'a HostProfile,
    op: &'static str,
    rows: usize,
    start: std::time::Instant,
    event: Option<CudaEvent>,
}

/// Timing events (cudarc's default disables timing).
const CU_EVENT_DEFAULT: ddtree_runtime::cudarc::driver::sys::CUevent_flags =
    ddtree_runtime::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;

/// Event pairs kept before they are read back (one synchronization per batch).
const PROFILE_EVENT_BATCH: usize = 4096;

impl HostProfile {
    fn from_env(stream: &Arc<CudaStream>) -> HostProfile {
        let mode = match std::env::var(HOST_PROFILE_ENV).unwrap_or_default().as_str() {
            "1" => Some(ProfileMode::Host),
            "sync" => Some(ProfileMode::Sync(stream.clone())),
            "gpu" => Some(ProfileMode::Events(stream.clone())),
            _ => None,
        };
        HostProfile {
            mode,
            rows: Default::default(),
            ops: Mutex::new(Vec::new()),
            pending: Mutex::new(Vec::new()),
        }
    }

    fn span(&self, op: &'static str) -> Option<Span<'_>> {
        let mode = self.mode.as_ref()?;
        // A failed record only loses this op's time; the profile only measures.
        let event = match mode {
            ProfileMode::Events(s) => s.record_event(Some(CU_EVENT_DEFAULT)).ok(),
            _ => None,
        };
        Some(Span {
            profile: self,
            op,
            rows: self.rows.load(std::sync::atomic::Ordering::Relaxed),
            start: std::time::Instant::now(),
            event,
        })
    }

    /// Whether ops are being timed.
    fn on(&self) -> bool {
        self.mode.is_some()
    }

    /// Marks the start of a forward of `rows` rows.
    fn forward_rows(&self, rows: usize) {
        self.rows.store(rows, std::sync::atomic::Ordering::Relaxed);
    }

    fn add(&self, op: &'static str, rows: usize, ms: f64) {
        let mut ops = self.ops.lock().expect("profile lock");
        match ops.iter_mut().find(|(o, r, ..)| *o == op && *r == rows) {
            Some((.., n, t)) => {
                *n += 1;
                *t += ms;
            }
            None => ops.push((op, rows, 1, ms)),
        }
    }

    /// Reads back every pending event pair.
    fn fold_events(&self) {
        let pending = std::mem::take(&mut *self.pending.lock().expect("profile lock"));
        for (op, rows, start, end) in pending {
            if let Ok(ms) = start.elapsed_ms(&end) {
                self.add(op, rows, ms as f64);
            }
        }
    }
}

impl Drop for Span<'_> {
    fn drop(&mut self) {
        let p = self.profile;
        match &p.mode {
            Some(ProfileMode::Events(s)) => {
                if let (Some(start), Ok(end)) = (self.event.take(), s.record_event(Some(CU_EVENT_DEFAULT))) {
                    let full = {
                        let mut pending = p.pending.lock().expect("profile lock");
                        pending.push((self.op, self.rows, start, end));
                        pending.len() >= PROFILE_EVENT_BATCH
                    };
                    if full {
                        p.fold_events();
                    }
                }
                return;
            }
            Some(ProfileMode::Sync(s)) => {
                // A failed sync shows up at the next op; the profile only measures.
                let _ = s.synchronize();
            }
            _ => {}
        }
        p.add(self.op, self.rows, self.start.elapsed().as_secs_f64() * 1e3);
    }
}

impl Drop for HostProfile {
    fn drop(&mut self) {
        let what = match &self.mode {
            None => return,
            Some(ProfileMode::Host) => "host time",
            Some(ProfileMode::Sync(_)) => "GPU time (synchronized)",
            Some(ProfileMode::Events(_)) => "GPU time (events)",
        };
        self.fold_events();
        let mut ops = self.ops.lock().expect("profile lock").clone();
        ops.sort_by(|a, b| a.1.cmp(&b.1).then(b.3.total_cmp(&a.3)));
        eprintln!("{what} per CUDA backend op and forward rows ({HOST_PROFILE_ENV}):");
        eprintln!("| op | rows | calls | total ms | µs per call |");
        for (op, rows, n, ms) in ops {
            eprintln!("| {op} | {rows} | {n} | {ms:.1} | {:.1} |", ms * 1e3 / n as f64);
        }
    }
}

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

/// The tensor-core kernel of the MLA verify attention (the decode step's and the tree's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum AttentionKernel {
    /// `mla_verify_narrow` for steps of at most 8 query rows (a decode step of 8 heads),
    /// `wgmma` for trees and for longer decode steps past [`WG_DECODE_MIN_KEYS`] keys, `mma`
    /// for shorter ones: the faster one of each case on the H200.
    #[default]
    Auto,
    /// `mla_verify_wg`: warpgroup MMA (`wgmma`, sm_90), 64 query rows per block.
    Wgmma,
    /// `mla_verify_wide`: warp-level `mma.sync`, 32 or 64 query rows per block.
    Mma,
}

/// Under [`AttentionKernel::Auto`], decode steps (one node) whose length bucket holds more keys
/// than this use `mla_verify_wg`, shorter ones `mla_verify_wide`. On the H200 (Kimi K2.6 EP8
/// slice, `ddtree bench`, ms/token at 1K / 4K / 8K / 16K / 32K context): `mma` 10.57 / 10.89 /
/// 11.08 / 11.47 / 12.21, `wgmma` 10.67 / 11.08 / 11.33 / 11.51 / 11.87. The one-node kernel
/// reads one 64-key tile per block up to 8K (its 64 KB of partials per block then weigh as much
/// as its cache bytes), where the 32-row `mma` blocks win.
pub const WG_DECODE_MIN_KEYS: usize = 16384;

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
    moe_bufs: Vec<((usize, usize, bool, usize), ddtree_kernels::w4a16::moe::MoeBuffers)>,
    /// The W4A16 split-K partials, one per stream ([`CudaBackend::lane`]): the main stream's
    /// and a branch's linears may run at the same time.
    w4a16: [Scratch; 2],
    /// Verify attention per variant ([`verify_variant`]).
    verify: Vec<tree::gpu::GpuVerify>,
    moe: Vec<((bool, usize), Arc<MoeKernels>)>,
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
    /// The GPU has `wgmma`: dense INT4 products of [`gemm_wg::WG_MIN_ROWS`] rows or more run
    /// on [`W4a16GemmWg`].
    wgmma: bool,
}

/// Most rows of a forward whose kernels launch with programmatic dependent launch. A forward
/// of a few rows is a chain of weight GEMVs that load their first weights before they wait for
/// their predecessor; a larger one (a verify tree of 9 rows and more) runs tensor-core GEMMs
/// that gain nothing from an early start (and whose waiting blocks presumably hold SM slots):
/// on the H200 the Kimi K2.6 EP8 verify forward at budget 8 takes 16.07 ms this way, 16.44
/// with PDL (BENCHMARKS.md, eleventh session).
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

const FILL: FillParams = FillParams { block: 256 };
/// Whether an INT4 `linear` of `rows` rows over an `[n, k]` weight runs the small-token
/// [`W4a16Gemv`] (one launch, no split-K reduce) instead of the tensor-core GEMM. On the H200
/// (`w4a16-bench`) the GEMV wins at every M <= 16 on weights of up to 2^26 elements (7168->2048
/// 10.7 vs 18.6 µs at M = 1, 13.5 vs 17.6 at M = 16; 1536->12288 15.0 vs 19.4 at M = 16) and
/// loses on the 7168->36864 dense MLP (64.6 vs 62.1 µs at M = 1, 114.8 vs 77.3 at M = 16).
/// Needs scale group 32 and `k % 32 == 0`. The variant is the tuned one of the shape and token
/// bucket ([`tune::W4GemvKey`]), the mode's default where nothing is tuned.
pub(crate) fn dense_int4_gemv(rows: usize, n: usize, k: usize, group: usize) -> bool {
    rows <= DENSE_INT4_GEMV_MAX_ROWS && n * k <= 1 << 26 && group == 32 && k % 32 == 0
}
/// Most rows of an INT4 `linear` on the [`W4a16Gemv`] ([`dense_int4_gemv`]).
pub(crate) const DENSE_INT4_GEMV_MAX_ROWS: usize = 16;
/// Scale group of dense routed experts, which [`CudaBackend::load_experts`] quantizes to INT4 for
/// the grouped kernels (the CPU backend's bf16 mode does the same).
pub(crate) const DENSE_EXPERT_GROUP: usize = 32;
/// MoE buffer sets kept for reuse (one per token count and expert shape in flight).
const MOE_BUFFER_SETS: usize = 16;

/// The output of [`CudaBackend::dense_product`]: bf16 activations or f32 (router, LM head).
enum DenseOut<'a> {
    Bf16(&'a mut CudaSlice<bf16>),
    F32(&'a mut CudaSlice<f32>),
}

/// Makes `waiter` wait for every op enqueued on `from` so far, through `event`.
fn wait_for(event: &CudaEvent, from: &CudaStream, waiter: &CudaStream) -> Result<()> {
    event.record(from).map_err(drv("recording an event"))?;
    waiter.wait(event).map_err(drv("waiting for an event"))
}

/// Upload slots whose last contents are kept on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Staged {
    /// A forward's token ids.
    Tokens,
    /// A forward's token positions.
    Positions,
    /// A forward's attention mask.
    Mask,
    /// The cache length before a forward, one value (kernels read it on the device).
    Lens,
}

/// Most tokens for which `mla_query` uses the one-launch absorbed-MLA kernel
/// (`mla_absorb_query`: every weight byte read once, the tokens looped in the kernel, the rope
/// fused); above it cuBLAS's batched GEMM, a row copy and the rope kernel. On the H200
/// (`kernel-check --decode-ops`): 8.3 vs 11.3 µs at 1 token, 10.5 vs 11.4 at 4, 21.2 vs 11.7 at 16.
const MLA_ABSORB_QUERY_MAX_ROWS: usize = 4;

/// Most tokens for which `mla_output` uses `mla_absorb_output` instead of cuBLAS's batched
/// GEMM: 7.5 vs 8.6 µs at 1 token, 10.9 vs 8.1 at 4 on the H200.
const MLA_ABSORB_OUTPUT_MAX_ROWS: usize = 2;

/// The attention kernel choice for a GPU of compute capability `cc`: `wgmma` exists on sm_90
/// (Hopper) only, so `auto` falls back to `mma` elsewhere and an explicit `wgmma` is an error.
fn resolve_attention(kind: AttentionKernel, cc: (i32, i32)) -> Result<AttentionKernel> {
    match kind {
        _ if ddtree_kernels::wgmma_supported(cc) => Ok(kind),
        AttentionKernel::Auto => Ok(AttentionKernel::Mma),
        AttentionKernel::Mma => Ok(kind),
        AttentionKernel::Wgmma => Err(EngineError::Backend {
            backend: "cuda".into(),
            reason: format!(
                "--attention wgmma needs an sm_90 (Hopper) GPU, this one is sm_{}{}; use --attention mma or auto",
                cc.0, cc.1
            ),
        }),
    }
}

/// The verify attention variant for `rows` (node, head) query rows and a length bucket of
/// `keys` keys, by `kind` ([`AttentionKernel`]): `mla_verify_wg`'s default (a 2-deep ring of
/// 64-key tiles, one scoring warpgroup), or the full-width `mma` split pass (`mla_verify_wide`,
/// the same ring) with 32 rows per block up to one node of 64 heads (the decode step), else 64.
/// From `tree-bench` on the H200 (BENCHMARKS.md, seed 504), 64 heads at 32K: `wg` 32.5 / 92.0
/// / 584.0 µs at 1 / 8 / 64 nodes against the best `wide` 37.3 / 159.3 / 1073.0.
/// Under `Auto`, steps of at most 8 rows take `mla_verify_narrow` (keys as the `mma` M, bulk
/// copies): graph-timed split + combine at 8 heads, one node, under PDL (BENCHMARKS.md,
/// twenty-third session) 6.3 / 6.9 / 12.1 / 16.7 µs at 1K / 4K / 16K / 32K against the best
/// other kernel's 6.9 / 7.9 / 12.4 / 17.1 (and `wide`'s 8.1 / 8.5 / 14.0 / 20.1).
fn verify_variant(kind: AttentionKernel, rows: usize, keys: usize) -> tree::VerifyVariant {
    if kind == AttentionKernel::Auto && rows <= tree::VerifyVariant::Narrow.rows_per_block() as usize {
        return tree::VerifyVariant::Narrow;
    }
    let wg = match kind {
        AttentionKernel::Auto => rows > 64 || keys > WG_DECODE_MIN_KEYS,
        AttentionKernel::Wgmma => true,
        AttentionKernel::Mma => false,
    };
    if wg {
        tree::VerifyVariant::Wg(<tree::MlaVerifyWg as ddtree_codegen::Kernel>::default_params())
    } else {
        tree::VerifyVariant::Wide(tree::WideParams {
            rg: if rows <= 64 { 2 } else { 4 },
            bn: 64,
            stages: 2,
            qk: 16,
        })
    }
}

/// Most tokens for which `mla_attention_output` merges the split partials inside the absorbed
/// output projection (`mla_combine_output`: one launch, the latent rows never in global memory)
/// instead of `mla_verify_combine` and then `mla_output`: the decode step (and a two-token
/// verify), where `mla_output` itself takes the absorbed kernel.
const MLA_COMBINE_OUTPUT_MAX_ROWS: usize = MLA_ABSORB_OUTPUT_MAX_ROWS;

/// Split count of the verify attention's partial buffers: rows x splits.
const VERIFY_PARTIALS: usize = 1 << 16;

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

    /// The index in `st.builders` of the GPU tree builder for `depth`, `vocab` and `budget`,
    /// made on first use with the tuned variant of its [`TreeBuildKey`] (kernels load once;
    /// buffers are small, a few trees).
    fn builder_index(&self, st: &mut State, depth: usize, vocab: usize, budget: usize) -> Result<usize> {
        let key = (depth, vocab, budget);
        if let Some(i) = st.builders.iter().position(|(k, _)| *k == key) {
            return Ok(i);
        }
        let kernel = self.kernels.get::<TreeBuild>(&TreeBuildKey { depth, vocab, budget })?;
        st.builders.push((
            key,
            tree::gpu::GpuBuilder::with_kernel(self.gpu(), kernel, depth, vocab, budget)?,
        ));
        Ok(st.builders.len() - 1)
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

    /// `0, 1, .., n - 1` on the device.
    fn identity(&self, n: usize) -> Result<Arc<CudaSlice<u32>>> {
        let mut st = self.state();
        if st.identity.len() < n {
            st.graphs.replaced("the identity index buffer");
            let ids: Vec<u32> = (0..n.next_power_of_two() as u32).collect();
            st.identity = Arc::new(self.upload(&ids)?);
        }
        Ok(st.identity.clone())
    }

    /// `v` on the device in slot `slot`'s buffer: copied there unless the slot holds the same
    /// values already; the buffer keeps its address unless `v` outgrows it.
    fn staged(&self, slot: Staged, v: &[u32]) -> Result<Arc<CudaSlice<u32>>> {
        let mut st = self.state();
        let st = &mut *st;
        if st.graphs.on_device.is_some() && slot != Staged::Lens {
            // A device round's tree, written by a kernel: `v` only stands in for its shape.
            return match st.staged.iter().find(|(s, ..)| *s == slot) {
                Some((_, None, d)) if d.len() >= v.len() => Ok(d.clone()),
                _ => Err(fail(format!(
                    "{slot:?}: a device-staged step without a device-written buffer of {} values",
                    v.len()
                ))),
            };
        }
        if let Some(i) = st.staged.iter().position(|(s, ..)| *s == slot) {
            let (_, old, d) = &mut st.staged[i];
            if old.as_deref() == Some(v) {
                return Ok(d.clone());
            }
            if st.graphs.recording() {
                // Nothing runs while recording: a copy here would be lost. The forward's inputs
                // were staged before the recording began; anything else spoils it.
                st.graphs.spoil(format!("{slot:?} changed while recording"));
                return Ok(d.clone());
            }
            if d.len() >= v.len() {
                if let Some(buf) = Arc::get_mut(d) {
                    if !v.is_empty() {
                        self.main
                            .memcpy_htod(v, &mut buf.slice_mut(..v.len()))
                            .map_err(drv("copying to the GPU"))?;
                        self.after_main()?;
                    }
                    *old = Some(v.to_vec());
                    return Ok(d.clone());
                }
            }
            st.staged.remove(i);
        }
        st.graphs.replaced("a staging buffer");
        // On the main stream (see `upload`).
        // SAFETY: the first `v.len()` values are written here, the rest never read.
        let mut d = unsafe { self.main.alloc::<u32>(v.len().next_power_of_two().max(64)) }
            .map_err(drv("allocating GPU memory"))?;
        if !v.is_empty() {
            self.main
                .memcpy_htod(v, &mut d.slice_mut(..v.len()))
                .map_err(drv("copying to the GPU"))?;
        }
        self.after_main()?;
        let d = Arc::new(d);
        st.staged.push((slot, Some(v.to_vec()), d.clone()));
        Ok(d)
    }

    /// Rope tables covering `positions` positions for `rope` (grown on demand).
    fn rope_tables(&self, rope: &Rope, max_position: u32) -> Result<Arc<RopeTables>> {
        let need = max_position as usize + 1;
        let mut st = self.state();
        if let Some(t) = st.ropes.iter().find(|t| t.rope == *rope && t.positions >= need) {
            return Ok(t.clone());
        }
        st.graphs.replaced("rope tables");
        let positions = need.max(st.max_capacity).next_power_of_two().max(4096);
        let (cos, sin) = rope.tables(positions);
        let t = Arc::new(RopeTables {
            rope: rope.clone(),
            positions,
            cos: self.upload(&cos)?,
            sin: self.upload(&sin)?,
        });
        st.ropes.retain(|old| old.rope != *rope);
        st.ropes.push(t.clone());
        Ok(t)
    }

    /// Copies `rows` rows: `dst[r, dst_off..] = src[idx[r], src_off..]`, `cols` values each.
    #[allow(clippy::too_many_arguments)]
    fn copy_rows(
        &self,
        src: &impl ddtree_runtime::cudarc::driver::DevicePtr<bf16>,
        idx: &CudaSlice<u32>,
        dst: &mut impl ddtree_runtime::cudarc::driver::DevicePtrMut<bf16>,
        rows: usize,
        cols: usize,
        (src_stride, src_off): (usize, usize),
        (dst_stride, dst_off): (usize, usize),
    ) -> Result<()> {
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let k = self.first_variant::<CopyRows>(|_: &CopyParams| true)?;
        // SAFETY: the callers size src, idx and dst for `rows` rows of the given strides.
        unsafe {
            CopyRows::launch(
                &k,
                self.stream(),
                rows as u32,
                src,
                idx,
                dst,
                rows as u32,
                cols as u32,
                src_stride as u32,
                src_off as u32,
                dst_stride as u32,
                dst_off as u32,
            )?
        };
        Ok(())
    }

    fn rope_variant(&self, rope: &Rope) -> Result<Arc<CompiledKernel<RopeInterleaved>>> {
        let (dim, interleave) = (rope.dim() as u32, rope.interleaved());
        self.first_variant::<RopeInterleaved>(|p| p.dim == dim && p.interleave == interleave)
            .map_err(|_| {
                fail(format!(
                    "no rope kernel variant for {dim} dims (interleave {interleave})"
                ))
            })
    }

    /// Ropes `rows = tokens * heads` rows of `stride` values at `offset` in place.
    #[allow(clippy::too_many_arguments)]
    fn rope_rows(
        &self,
        x: &mut impl ddtree_runtime::cudarc::driver::DevicePtrMut<bf16>,
        rope: &Rope,
        positions: &[u32],
        heads: usize,
        stride: usize,
        offset: usize,
    ) -> Result<()> {
        let max = positions.iter().copied().max().unwrap_or(0);
        let tables = self.rope_tables(rope, max)?;
        let k = self.rope_variant(rope)?;
        let pos = self.staged(Staged::Positions, positions)?;
        let rows = positions.len() * heads;
        let pairs = rows * rope.dim() / 2;
        let grid = pairs.div_ceil(k.params().block as usize).max(1) as u32;
        // SAFETY: x holds rows * stride values; positions one per token; tables cover max.
        unsafe {
            RopeInterleaved::launch(
                &k,
                self.stream(),
                grid,
                x,
                &*pos,
                &tables.cos,
                &tables.sin,
                rows as u32,
                heads as u32,
                stride as u32,
                offset as u32,
            )?
        };
        Ok(())
    }

    /// Uploads checkpoint-layout INT4 words `[experts * n, k / 8]` and repacks them on the GPU
    /// into the interleaved layout.
    fn repack(&self, packed: &[u32], n: usize, k: usize, experts: usize) -> Result<CudaSlice<u32>> {
        let src = self.upload(packed)?;
        let total = interleaved_words(n, k) * experts;
        let mut dst = self.alloc::<u32>(total)?;
        let p = RepackParams { block: 256 };
        let kern = self.variant::<W4a16Repack>(&p)?;
        let grid = total.div_ceil(256).clamp(1, 65535) as u32;
        // SAFETY: src holds experts * n * k / 8 words, dst the interleaved words of every expert.
        unsafe {
            W4a16Repack::launch(
                &kern,
                self.stream(),
                grid,
                &src,
                &mut dst,
                n as u32,
                k as u32,
                experts as u32,
            )?
        };
        Ok(dst)
    }

    /// Random words (INT4 codes of every value 0..16) and constant scales, straight in the
    /// interleaved layout (random is random in any layout).
    fn random_int4(
        &self,
        n: usize,
        k: usize,
        experts: usize,
        group: usize,
        seed: u64,
    ) -> Result<(CudaSlice<u32>, CudaSlice<u32>)> {
        let words = interleaved_words(n, k) * experts;
        let mut packed = self.alloc::<u32>(words)?;
        self.fill_u32(&mut packed, words, seed)?;
        let scale = bf16::from_f32((3.0 / k as f32).sqrt() / 8.0);
        let groups = experts * n * k.div_ceil(group);
        let scales = self.upload(&scale_words(&vec![scale; groups]))?;
        Ok((packed, scales))
    }

    fn fill_u32(&self, out: &mut CudaSlice<u32>, n: usize, seed: u64) -> Result<()> {
        let k = self.variant::<FillRandomU32>(&FILL)?;
        // SAFETY: out holds n words.
        unsafe {
            FillRandomU32::launch(
                &k,
                self.stream(),
                fill::grid(&FILL, n),
                out,
                check_u32("fill", n)?,
                seed as u32,
            )?
        };
        Ok(())
    }

    fn fill_bf16(&self, out: &mut CudaSlice<bf16>, n: usize, lo: f32, hi: f32, seed: u64) -> Result<()> {
        let k = self.variant::<FillRandomBf16>(&FILL)?;
        // SAFETY: out holds n values.
        unsafe {
            FillRandomBf16::launch(
                &k,
                self.stream(),
                fill::grid(&FILL, n),
                out,
                check_u32("fill", n)?,
                seed as u32,
                lo,
                hi,
            )?
        };
        Ok(())
    }

    /// A dense W4A16 product on either GEMM kernel (weights interleaved), with its split-K
    /// reduction when the variant splits K.
    fn int4_gemm<K: W4a16Kernel>(
        &self,
        kern: &CompiledKernel<K>,
        splits: u32,
        args: &GemmArgs,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let reduce = if kern.params().tiling().splitk {
            Some(self.variant::<gemm::W4a16Reduce>(&ddtree_kernels::w4a16::ReduceParams {
                block: 256,
                epilogue: Epilogue::Plain,
            })?)
        } else {
            None
        };
        let mut st = self.state();
        let need = splits as usize * args.m as usize * args.n as usize;
        let lane = self.lane();
        if st.w4a16[lane].part.len() < need {
            st.graphs.replaced("the W4A16 split-K scratch");
            st.w4a16[lane] = Scratch::new(self.stream(), need.next_power_of_two())?;
        }
        // SAFETY: weights in the variant's (interleaved) layout; partials sized above.
        unsafe {
            gemm::launch(
                kern,
                reduce.as_deref(),
                self.stream(),
                args,
                &mut st.w4a16[lane],
                out,
                splits,
            )?
        };
        Ok(())
    }

    /// The MoE kernel pair for `pairs` token-expert pairs at scale group `group`: half m tiles
    /// for up to 32 pairs (decode and small trees), one m tile above (the H200 bench's best).
    fn moe_kernels(&self, pairs: usize, group: usize) -> Result<Arc<MoeKernels>> {
        let m8 = pairs <= 32;
        if let Some((_, k)) = self.state().moe.iter().find(|(key, _)| *key == (m8, group)) {
            return Ok(k.clone());
        }
        let pick = |epi: Epilogue| -> Result<W4a16Params> {
            FUSED_SPACE
                .iter()
                .find(|p| p.moe && p.epilogue == epi && p.m8 == m8 && p.mt == 1 && p.layout == Layout::Interleaved)
                .map(|p| W4a16Params {
                    group: group as u32,
                    ..*p
                })
                .ok_or_else(|| fail("no grouped W4A16 variant".into()))
        };
        let k = Arc::new(MoeKernels::new(
            self.gpu(),
            GroupedPair::Mma(pick(Epilogue::SiluMul)?, pick(Epilogue::RouteScale)?),
        )?);
        self.state().moe.push(((m8, group), k.clone()));
        Ok(k)
    }
}

/// Stacks the experts' INT4 (or, quantized here, dense) weights in checkpoint layout:
/// gate_up `[E, 2I, H]` and down `[E, H, I]`.
fn stack_experts(experts: &[Ffn<HostLinear>], group_default: usize) -> Result<(PackedInt4, PackedInt4)> {
    let first = experts
        .first()
        .ok_or_else(|| fail("a MoE layer without experts".into()))?;
    let (inter, hidden) = first.gate.shape();
    let group = match &first.gate {
        HostLinear::Int4 { group_size, .. } => *group_size,
        HostLinear::Dense { .. } => group_default,
    };
    let as_int4 = |w: &HostLinear| -> Result<PackedInt4> {
        let (n, k) = w.shape();
        match w {
            HostLinear::Int4 {
                group_size,
                packed,
                scales,
                ..
            } if *group_size == group => Ok(PackedInt4 {
                packed: packed.clone(),
                scales: scales.iter().map(|&s| bf16::from_f32(s)).collect(),
                n,
                k,
                group,
                experts: 1,
            }),
            HostLinear::Int4 { group_size, .. } => {
                Err(fail(format!("experts mix scale groups {group_size} and {group}")))
            }
            HostLinear::Dense { data, .. } => {
                let w: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
                Ok(quantize(&w, n, k, group, 1))
            }
        }
    };
    let mut up = PackedInt4 {
        packed: Vec::new(),
        scales: Vec::new(),
        n: 2 * inter,
        k: hidden,
        group,
        experts: experts.len(),
    };
    let mut down = PackedInt4 {
        packed: Vec::new(),
        scales: Vec::new(),
        n: hidden,
        k: inter,
        group,
        experts: experts.len(),
    };
    for (e, f) in experts.iter().enumerate() {
        if f.gate.shape() != (inter, hidden) || f.up.shape() != (inter, hidden) || f.down.shape() != (hidden, inter) {
            return Err(fail(format!("expert {e} differs in shape from expert 0")));
        }
        for (w, dst) in [(&f.gate, 0), (&f.up, 0), (&f.down, 1)] {
            let q = as_int4(w)?;
            let dst = if dst == 0 { &mut up } else { &mut down };
            dst.packed.extend_from_slice(&q.packed);
            dst.scales.extend_from_slice(&q.scales);
        }
    }
    Ok((up, down))
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

    fn load_vector(&self, data: Vec<f32>) -> Result<CudaVector> {
        let _span = self.profile.span("load_vector");
        let half: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
        Ok(CudaVector {
            len: data.len(),
            bf16: self.upload(&half)?,
            f32: self.upload(&data)?,
        })
    }

    fn load_matrix(&self, m: Matrix) -> Result<CudaTensor> {
        let _span = self.profile.span("load_matrix");
        let half: Vec<bf16> = m.data.iter().map(|&v| bf16::from_f32(v)).collect();
        Ok(CudaTensor {
            rows: m.rows,
            cols: m.cols,
            data: DeviceData::Bf16(self.upload(&half)?),
        })
    }

    fn load_logits(&self, m: Matrix) -> Result<CudaTensor> {
        let _span = self.profile.span("load_logits");
        Ok(CudaTensor {
            rows: m.rows,
            cols: m.cols,
            data: DeviceData::F32(self.upload(&m.data)?),
        })
    }

    fn load_weight(&self, w: HostLinear) -> Result<CudaWeight> {
        let _span = self.profile.span("load_weight");
        match w {
            HostLinear::Dense { out, inp, data } => {
                let half: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
                Ok(CudaWeight::Dense {
                    out,
                    inp,
                    w: self.upload(&half)?,
                })
            }
            HostLinear::Int4 {
                out,
                inp,
                group_size,
                packed,
                scales,
            } => {
                let scales: Vec<bf16> = scales.iter().map(|&v| bf16::from_f32(v)).collect();
                Ok(CudaWeight::Int4 {
                    out,
                    inp,
                    group: group_size,
                    packed: self.repack(&packed, out, inp, 1)?,
                    scales: self.upload(&scale_words(&scales))?,
                })
            }
        }
    }

    fn load_experts(&self, experts: Vec<Ffn<HostLinear>>) -> Result<CudaExperts> {
        let _span = self.profile.span("load_experts");
        if experts.iter().any(|f| matches!(f.gate, HostLinear::Dense { .. })) {
            tracing::warn!(
                "routed experts are dense in the checkpoint: quantizing them to INT4 g32 for the grouped kernels"
            );
        }
        let (up, down) = stack_experts(&experts, DENSE_EXPERT_GROUP)?;
        Ok(CudaExperts {
            count: experts.len(),
            inter: up.n / 2,
            hidden: up.k,
            group: up.group,
            w13: self.repack(&up.packed, up.n, up.k, up.experts)?,
            s13: self.upload(&scale_words(&up.scales))?,
            w2: self.repack(&down.packed, down.n, down.k, down.experts)?,
            s2: self.upload(&scale_words(&down.scales))?,
        })
    }

    fn random_weight(&self, out: usize, inp: usize, int4_group: Option<usize>, seed: u64) -> Result<CudaWeight> {
        let _span = self.profile.span("random_weight");
        match int4_group {
            None => {
                let mut w = self.alloc::<bf16>(out * inp)?;
                let bound = (3.0 / inp as f32).sqrt();
                self.fill_bf16(&mut w, out * inp, -bound, bound, seed)?;
                Ok(CudaWeight::Dense { out, inp, w })
            }
            Some(group) => {
                let (packed, scales) = self.random_int4(out, inp, 1, group, seed)?;
                Ok(CudaWeight::Int4 {
                    out,
                    inp,
                    group,
                    packed,
                    scales,
                })
            }
        }
    }

    fn random_experts(
        &self,
        count: usize,
        inter: usize,
        hidden: usize,
        int4_group: Option<usize>,
        seed: u64,
    ) -> Result<CudaExperts> {
        let _span = self.profile.span("random_experts");
        let group = int4_group.unwrap_or(32);
        let (w13, s13) = self.random_int4(2 * inter, hidden, count, group, seed)?;
        let (w2, s2) = self.random_int4(hidden, inter, count, group, seed ^ 0x5555)?;
        Ok(CudaExperts {
            count,
            inter,
            hidden,
            group,
            w13,
            s13,
            w2,
            s2,
        })
    }

    fn random_vector(&self, len: usize, lo: f32, hi: f32, seed: u64) -> Result<CudaVector> {
        let _span = self.profile.span("random_vector");
        let mut half = self.alloc::<bf16>(len)?;
        self.fill_bf16(&mut half, len, lo, hi, seed)?;
        let mut f = self.alloc::<f32>(len)?;
        let k = self.variant::<FillRandomF32>(&FILL)?;
        // SAFETY: f holds len values.
        unsafe {
            FillRandomF32::launch(
                &k,
                self.stream(),
                fill::grid(&FILL, len),
                &mut f,
                len as u32,
                seed as u32,
                lo,
                hi,
            )?
        };
        Ok(CudaVector {
            len,
            bf16: half,
            f32: f,
        })
    }

    fn random_matrix(&self, rows: usize, cols: usize, seed: u64) -> Result<CudaTensor> {
        let _span = self.profile.span("random_matrix");
        let mut t = self.tensor_bf16(rows, cols)?;
        self.fill_bf16(t.bf16_mut("random_matrix")?, rows * cols, -1.0, 1.0, seed)?;
        Ok(t)
    }

    fn kv_fill_random(&self, cache: &mut CudaKvCache, len: usize, seed: u64) -> Result<()> {
        let _span = self.profile.span("kv_fill_random");
        if len > cache.capacity {
            return Err(fail(format!(
                "kv_fill_random: {len} rows exceed the capacity {}",
                cache.capacity
            )));
        }
        let n = cache.buf().len();
        self.fill_bf16(cache.buf_mut(), n, -1.0, 1.0, seed)?;
        cache.lens.iter_mut().for_each(|l| *l = len);
        Ok(())
    }

    fn new_kv_cache(&self, layers: usize, row_width: usize, capacity: usize) -> Result<CudaKvCache> {
        let _span = self.profile.span("new_kv_cache");
        if row_width == 0 {
            return Err(fail("KV cache rows must not be empty".into()));
        }
        {
            let mut st = self.state();
            st.max_capacity = st.max_capacity.max(capacity);
        }
        let n = (layers * capacity * row_width).max(1);
        let spare = {
            let mut pool = self.caches.lock().expect("cache pool lock");
            pool.iter().position(|b| b.len() == n).map(|i| pool.swap_remove(i))
        };
        let buf = match spare {
            Some(mut buf) => {
                self.stream()
                    .memset_zeros(&mut buf)
                    .map_err(drv("clearing the KV cache"))?;
                buf
            }
            None => {
                // Free a spare of another size first: caches are the largest buffers.
                self.caches.lock().expect("cache pool lock").clear();
                self.stream()
                    .alloc_zeros::<bf16>(n)
                    .map_err(drv("allocating the KV cache"))?
            }
        };
        Ok(CudaKvCache {
            width: row_width,
            capacity,
            lens: vec![0; layers],
            buf: Some(buf),
            pool: self.caches.clone(),
        })
    }

    fn draft_tree(&self, drafted: &CudaTensor, depth: usize, budget: usize, root: u32) -> Result<DraftTree> {
        let _span = self.profile.span("draft_tree");
        let vocab = drafted.cols;
        if depth == 0 || depth > 16 || budget > tree::MAX_K || depth > drafted.rows {
            let host = self.to_host(drafted)?;
            return Ok(build_reference(&host.data[..depth * vocab], depth, vocab, budget, root));
        }
        let logits = drafted.f32("draft_tree")?;
        let root = self.upload(&[root])?;
        let mut st = self.state();
        let at = self.builder_index(&mut st, depth, vocab, budget)?;
        let builder = &mut st.builders[at].1;
        builder.build(self.stream(), logits, &root)?;
        // One read of the whole tree (its arrays copied back one after another).
        self.count_read();
        Ok(builder.download(self.stream())?.0)
    }

    fn dims(&self, x: &CudaTensor) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn to_host(&self, x: &CudaTensor) -> Result<Matrix> {
        let _span = self.profile.span("to_host");
        let n = x.rows * x.cols;
        let data = match &x.data {
            DeviceData::Bf16(d) => {
                let v: Vec<bf16> = self.read_back(&d.slice(..n))?;
                v.into_iter().map(f32::from).collect()
            }
            DeviceData::F32(d) => self.read_back(&d.slice(..n))?,
        };
        Ok(Matrix {
            rows: x.rows,
            cols: x.cols,
            data,
        })
    }

    fn take_rows(&self, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor> {
        let _span = self.profile.span("take_rows");
        if let Some(&r) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(fail(format!("take_rows: row {r} of {}", x.rows)));
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = self.upload(&idx)?;
        let mut out = self.tensor_bf16(rows.len(), x.cols)?;
        match &x.data {
            DeviceData::Bf16(src) => {
                let dst = out.bf16_mut("take_rows")?;
                self.copy_rows(src, &idx, dst, rows.len(), x.cols, (x.cols, 0), (x.cols, 0))?;
            }
            DeviceData::F32(src) => {
                // Rows of the f32 residual stream come out as bf16 activations (features).
                let n = rows.len() * x.cols;
                let mut picked = self.alloc::<f32>(n)?;
                let k = self.first_variant::<CopyRowsF32>(|_: &CopyParams| true)?;
                // SAFETY: src [x.rows, cols], idx rows below x.rows, picked [rows, cols].
                unsafe {
                    CopyRowsF32::launch(
                        &k,
                        self.stream(),
                        rows.len() as u32,
                        src,
                        &idx,
                        &mut picked,
                        rows.len() as u32,
                        x.cols as u32,
                        x.cols as u32,
                        0,
                        x.cols as u32,
                        0,
                    )?
                };
                let c = self.first_variant::<CastF32Bf16>(|_: &CastParams| true)?;
                // SAFETY: both hold n values.
                unsafe {
                    CastF32Bf16::launch(
                        &c,
                        self.stream(),
                        residual::grid(c.params(), n),
                        &picked,
                        out.bf16_mut("take_rows")?,
                        n as u32,
                    )?
                };
            }
        }
        Ok(out)
    }

    fn embedding(&self, table: &CudaTensor, ids: &[u32]) -> Result<CudaTensor> {
        self.profile.forward_rows(ids.len());
        let _span = self.profile.span("embedding");
        let hidden = table.cols;
        let key = tune::EmbeddingKey {
            tokens: ids.len(),
            vocab: table.rows,
            hidden,
        };
        let k = self.kernels.get::<Embedding>(&key)?;
        let d_ids = self.staged(Staged::Tokens, ids)?;
        let mut out = self.tensor_bf16(ids.len(), hidden)?;
        // SAFETY: the table is [vocab, hidden]; ids are checked by the model; out [ids, hidden].
        unsafe {
            Embedding::launch(
                &k,
                self.stream(),
                ids.len() as u32,
                &*d_ids,
                table.bf16("embedding")?,
                out.bf16_mut("embedding")?,
                hidden as u32,
                table.rows as u32,
            )?
        };
        Ok(out)
    }

    fn rms_norm(&self, x: &CudaTensor, weight: &CudaVector, eps: f32) -> Result<CudaTensor> {
        let _span = self.profile.span("rms_norm");
        if x.cols != weight.len {
            return Err(fail(format!("rms_norm: {} columns, weight of {}", x.cols, weight.len)));
        }
        let mut out = self.tensor_bf16(x.rows, x.cols)?;
        self.rms_rows(
            x.bf16("rms_norm")?,
            &weight.bf16,
            out.bf16_mut("rms_norm")?,
            x.rows,
            x.cols,
            eps,
        )?;
        Ok(out)
    }

    fn rms_norm_linear(&self, x: &CudaTensor, weight: &CudaVector, eps: f32, w: &CudaWeight) -> Result<CudaTensor> {
        let (n, k) = w.shape();
        let sms = self.gpu().fingerprint().sm_count as usize;
        let fused = match w {
            CudaWeight::Dense { w, .. } if x.cols == k && weight.len == k => {
                gemv::choose_rms_norm(x.rows, n, k, sms).map(|p| (p, w))
            }
            _ => None,
        };
        let Some((p, wd)) = fused else {
            return self.linear(&self.rms_norm(x, weight, eps)?, w);
        };
        let _span = self.profile.span("rms_norm_linear");
        let mut out = self.tensor_bf16(x.rows, n)?;
        // SAFETY: a [rows <= p.m, k], norm [k], w [n, k], out [rows, n]; k % 8 == 0 and k <=
        // NORM_MAX_K (choose_rms_norm).
        unsafe {
            GemvRmsNormBf16::launch(
                &*self.variant::<GemvRmsNormBf16>(&p)?,
                self.stream(),
                gemv::grid(&p, n as u32),
                x.bf16("rms_norm_linear")?,
                &weight.bf16,
                eps,
                wd,
                out.bf16_mut("rms_norm_linear")?,
                x.rows as u32,
                n as u32,
                k as u32,
            )?
        };
        Ok(out)
    }

    fn linear(&self, x: &CudaTensor, w: &CudaWeight) -> Result<CudaTensor> {
        let _span = self.profile.span("linear");
        let (n, k) = w.shape();
        if x.cols != k {
            return Err(fail(format!("linear: {} columns into a [{n}, {k}] weight", x.cols)));
        }
        let mut out = self.tensor_bf16(x.rows, n)?;
        let a = x.bf16("linear")?;
        match w {
            CudaWeight::Dense { w, .. } => {
                self.dense_product(a, w, DenseOut::Bf16(out.bf16_mut("linear")?), x.rows, n, k)?
            }
            CudaWeight::Int4 {
                group, packed, scales, ..
            } => {
                if dense_int4_gemv(x.rows, n, k, *group) {
                    let key = tune::W4GemvKey { tokens: x.rows, n, k };
                    let kern = self.kernels.get::<W4a16Gemv>(&key)?;
                    let p = *kern.params();
                    if p.mode != GemvMode::Dense || (w4gemv::max_tokens(&p) as usize) < x.rows {
                        return Err(fail(format!("linear: the W4A16 GEMV variant for {key} is {p:?}")));
                    }
                    let none_u32 = self.identity(1)?;
                    let st = self.state();
                    // SAFETY: a [rows <= 8 chunks, k], weights interleaved [n, k] with g32 scale
                    // words, out [rows, n]; the routing arguments are unused by dense variants.
                    unsafe {
                        W4a16Gemv::launch(
                            &kern,
                            self.stream(),
                            w4gemv::grid(&p, n as u32, 1),
                            a,
                            packed,
                            scales,
                            none_u32.as_ref(),
                            &st.w4a16[self.lane()].part,
                            none_u32.as_ref(),
                            none_u32.as_ref(),
                            out.bf16_mut("linear")?,
                            x.rows as u32,
                            n as u32,
                            k as u32,
                            1,
                            1,
                        )?
                    };
                    return Ok(out);
                }
                let args = GemmArgs {
                    a,
                    w: packed,
                    scales,
                    residual: None,
                    routing: None,
                    m: x.rows as u32,
                    n: n as u32,
                    k: k as u32,
                };
                let dst = out.bf16_mut("linear")?;
                let group = *group as u32;
                match gemm_wg::default_dense(x.rows as u32, n as u32, k as u32).filter(|_| self.wgmma) {
                    Some((p, splits)) => {
                        let kern = self.variant::<W4a16GemmWg>(&W4a16WgParams { group, ..p })?;
                        self.int4_gemm(&kern, splits, &args, dst)?
                    }
                    None => {
                        let (p, splits) = default_dense(x.rows as u32, n as u32, k as u32);
                        let kern = self.variant::<gemm::W4a16Gemm>(&W4a16Params { group, ..p })?;
                        self.int4_gemm(&kern, splits, &args, dst)?
                    }
                }
            }
        }
        Ok(out)
    }

    fn linear_f32(&self, x: &CudaTensor, w: &CudaWeight) -> Result<CudaTensor> {
        let _span = self.profile.span("linear_f32");
        let CudaWeight::Dense { w, out: n, inp: k } = w else {
            return Err(fail("linear_f32 (router, LM head) needs a dense weight".into()));
        };
        if x.cols != *k {
            return Err(fail(format!("linear_f32: {} columns into a [{n}, {k}] weight", x.cols)));
        }
        let mut out = self.alloc::<f32>(x.rows * n)?;
        self.dense_product(x.bf16("linear_f32")?, w, DenseOut::F32(&mut out), x.rows, *n, *k)?;
        Ok(CudaTensor {
            rows: x.rows,
            cols: *n,
            data: DeviceData::F32(out),
        })
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
        self.greedy_graph(cache, forward)
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

    fn argmax_rows(&self, logits: &CudaTensor) -> Result<Vec<u32>> {
        let _span = self.profile.span("argmax_rows");
        let mut values = self.alloc::<f32>(logits.rows)?;
        let mut indices = self.alloc::<u32>(logits.rows)?;
        self.argmax_into(&mut self.state(), logits, &mut values, &mut indices)?;
        self.read_back(&indices)
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        let _span = self.profile.span("add_assign");
        if (x.rows, x.cols) != (y.rows, y.cols) {
            return Err(fail(format!("add: {}x{} vs {}x{}", x.rows, x.cols, y.rows, y.cols)));
        }
        let n = x.rows * x.cols;
        let k = self.first_variant::<AddAssign>(|p: &AddParams| !p.vec || n % 8 == 0)?;
        let grid = add::grid(k.params(), n as u32);
        // SAFETY: both hold n values.
        unsafe { AddAssign::launch(&k, self.stream(), grid, x.bf16_mut("add")?, y.bf16("add")?, n as u32)? };
        Ok(())
    }

    fn residual(&self, x: CudaTensor) -> Result<CudaTensor> {
        let _span = self.profile.span("residual");
        let n = x.rows * x.cols;
        let DeviceData::Bf16(src) = &x.data else {
            return Ok(x);
        };
        let mut dst = self.alloc::<f32>(n)?;
        let k = self.first_variant::<CastBf16F32>(|_: &CastParams| true)?;
        // SAFETY: both hold n values.
        unsafe {
            CastBf16F32::launch(
                &k,
                self.stream(),
                residual::grid(k.params(), n),
                src,
                &mut dst,
                n as u32,
            )?
        };
        Ok(CudaTensor {
            rows: x.rows,
            cols: x.cols,
            data: DeviceData::F32(dst),
        })
    }

    fn add_rms_norm(&self, x: &mut CudaTensor, y: &CudaTensor, weight: &CudaVector, eps: f32) -> Result<CudaTensor> {
        let _span = self.profile.span("add_rms_norm");
        if !matches!(x.data, DeviceData::F32(_)) {
            self.add_assign(x, y)?;
            return self.rms_norm(x, weight, eps);
        }
        self.residual_norm(x, y, None, weight, eps)
    }

    fn add2_rms_norm(
        &self,
        x: &mut CudaTensor,
        a: CudaTensor,
        b: &CudaTensor,
        weight: &CudaVector,
        eps: f32,
    ) -> Result<CudaTensor> {
        if !matches!(x.data, DeviceData::F32(_)) {
            return unfused_add2_rms_norm(self, x, a, b, weight, eps);
        }
        let _span = self.profile.span("add2_rms_norm");
        self.residual_norm(x, &a, Some(b), weight, eps)
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
        let _span = self.profile.span("silu_mul");
        if (gate.rows, gate.cols) != (up.rows, up.cols) {
            return Err(fail("silu_mul: gate and up differ in shape".into()));
        }
        let n = gate.rows * gate.cols;
        let k = self.first_variant::<SiluMulSplit>(|p: &SiluMulParams| !p.vec || n % 8 == 0)?;
        let grid = n
            .div_ceil(k.params().block as usize * if k.params().vec { 8 } else { 1 })
            .clamp(1, 65535) as u32;
        let mut out = self.tensor_bf16(gate.rows, gate.cols)?;
        // SAFETY: all hold n values.
        unsafe {
            SiluMulSplit::launch(
                &k,
                self.stream(),
                grid,
                gate.bf16("silu_mul")?,
                up.bf16("silu_mul")?,
                out.bf16_mut("silu_mul")?,
                n as u32,
            )?
        };
        Ok(out)
    }

    fn gate_up_silu(&self, x: &CudaTensor, gate: &CudaWeight, up: &CudaWeight) -> Result<CudaTensor> {
        let (CudaWeight::Dense { w: g, out: n, inp: k }, CudaWeight::Dense { w: u, out: un, inp: uk }) = (gate, up)
        else {
            return unfused_gate_up_silu(self, x, gate, up);
        };
        // Two dense weights of one shape that `x` fits, and a GEMV shape (few rows, k % 8 == 0).
        let sms = self.gpu().fingerprint().sm_count as usize;
        let fits = (n, k) == (un, uk) && x.cols == *k;
        let Some(choice) = gemv::choose_gate_up(x.rows, *n, *k, sms).filter(|_| fits) else {
            return unfused_gate_up_silu(self, x, gate, up);
        };
        let _span = self.profile.span("gate_up_silu");
        let (r, n32, k32) = (x.rows as u32, *n as u32, *k as u32);
        let mut out = self.tensor_bf16(x.rows, *n)?;
        let (a, o) = (x.bf16("gate_up_silu")?, out.bf16_mut("gate_up_silu")?);
        // SAFETY: a [rows <= p.m, k], gate and up [n, k], out [rows, n]; k % 8 == 0 (the fused
        // GEMVs are only chosen then).
        unsafe {
            match choice {
                GemvChoice::Warp(p) => GemvGateUpSilu::launch(
                    &*self.variant::<GemvGateUpSilu>(&p)?,
                    self.stream(),
                    gemv::grid(&p, n32),
                    a,
                    g,
                    u,
                    o,
                    r,
                    n32,
                    k32,
                )?,
                GemvChoice::Split(p) => GemvSplitGateUpSilu::launch(
                    &*self.variant::<GemvSplitGateUpSilu>(&p)?,
                    self.stream(),
                    gemv::split_grid(&p, n32),
                    a,
                    g,
                    u,
                    o,
                    r,
                    n32,
                    k32,
                )?,
            }
        };
        Ok(out)
    }

    fn concat_cols(&self, parts: &[&CudaTensor]) -> Result<CudaTensor> {
        let _span = self.profile.span("concat_cols");
        let rows = parts.first().map_or(0, |p| p.rows);
        if parts.iter().any(|p| p.rows != rows) {
            return Err(fail("concat_cols: parts differ in rows".into()));
        }
        let cols: usize = parts.iter().map(|p| p.cols).sum();
        let idx = self.identity(rows)?;
        let mut out = self.tensor_bf16(rows, cols)?;
        let mut off = 0;
        for p in parts {
            let dst = out.bf16_mut("concat_cols")?;
            self.copy_rows(
                p.bf16("concat_cols")?,
                &idx,
                dst,
                rows,
                p.cols,
                (p.cols, 0),
                (cols, off),
            )?;
            off += p.cols;
        }
        Ok(out)
    }

    fn head_rms_norm(&self, x: &CudaTensor, weight: &CudaVector, eps: f32) -> Result<CudaTensor> {
        let _span = self.profile.span("head_rms_norm");
        let d = weight.len;
        if d == 0 || x.cols % d != 0 {
            return Err(fail(format!("head_rms_norm: {} columns, heads of {d}", x.cols)));
        }
        let mut out = self.tensor_bf16(x.rows, x.cols)?;
        let rows = x.rows * x.cols / d;
        self.rms_rows(
            x.bf16("head_rms_norm")?,
            &weight.bf16,
            out.bf16_mut("head_rms_norm")?,
            rows,
            d,
            eps,
        )?;
        Ok(out)
    }

    fn rope_heads(&self, x: &mut CudaTensor, rope: &Rope, positions: &[u32]) -> Result<()> {
        let _span = self.profile.span("rope_heads");
        let d = rope.dim();
        if x.cols % d != 0 || positions.len() != x.rows {
            return Err(fail(format!(
                "rope_heads: {}x{} input, rotary size {d}, {} positions",
                x.rows,
                x.cols,
                positions.len()
            )));
        }
        let heads = x.cols / d;
        self.rope_rows(x.bf16_mut("rope_heads")?, rope, positions, heads, d, 0)
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
        let _span = self.profile.span("mla_append_kv");
        let lora = norm.len;
        let width = cache.width;
        if kv_a.cols != width || layer >= cache.lens.len() || lora > width || positions.len() != kv_a.rows {
            return Err(fail(format!("mla_append_kv: bad layer {layer} or shapes")));
        }
        let start = cache.lens[layer];
        if start + kv_a.rows > cache.capacity {
            return Err(EngineError::Forward(format!(
                "KV cache full: {start} + {} rows exceed its capacity of {}",
                kv_a.rows, cache.capacity
            )));
        }
        let max = positions.iter().copied().max().unwrap_or(0);
        let tables = self.rope_tables(rope, max)?;
        let pos = self.staged(Staged::Positions, positions)?;
        let lens = self.staged(Staged::Lens, &[start as u32])?;
        let k = self.variant::<MlaKvAppend>(&ddtree_kernels::attention::mla::choose_append(lora, width - lora))?;
        let mut dst = cache.layer_mut(layer);
        // SAFETY: kv_a [rows, width]; the layer holds capacity rows and start + rows fit.
        unsafe {
            MlaKvAppend::launch(
                &k,
                self.stream(),
                kv_a.rows as u32,
                kv_a.bf16("mla_append_kv")?,
                &norm.bf16,
                &*pos,
                &tables.cos,
                &tables.sin,
                &mut dst,
                &*lens,
                kv_a.rows as u32,
                lora as u32,
                (width - lora) as u32,
                eps,
            )?
        };
        if !rope.interleaved() {
            // The kernel ropes adjacent pairs; for the half-split layout put the raw k_pe back
            // and rope it with the rotate-half variant in place (at a host-side offset: a
            // recording of this cannot be replayed at another length).
            self.state().graphs.spoil("half-split rope of the latent cache".into());
            let idx = self.identity(kv_a.rows)?;
            let rope_dim = width - lora;
            let mut rows = dst.slice_mut(start * width..(start + kv_a.rows) * width);
            let src = kv_a.bf16("mla_append_kv")?;
            self.copy_rows(src, &idx, &mut rows, kv_a.rows, rope_dim, (width, lora), (width, lora))?;
            self.rope_rows(&mut rows, rope, positions, 1, width, lora)?;
        }
        cache.lens[layer] = start + kv_a.rows;
        Ok(())
    }

    fn mla_query(
        &self,
        q: &CudaTensor,
        kv_b: &CudaWeight,
        rope: &Rope,
        positions: &[u32],
        d: MlaDims,
    ) -> Result<CudaTensor> {
        let _span = self.profile.span("mla_query");
        let qk = d.nope + d.rope;
        let lw = d.latent_width();
        let CudaWeight::Dense { w, out, inp } = kv_b else {
            return Err(fail("mla_query: kv_b must be dense".into()));
        };
        if q.cols != d.heads * qk || (*out, *inp) != (d.heads * (d.nope + d.v), d.kv_lora) || positions.len() != q.rows
        {
            return Err(fail("mla_query: q, kv_b or positions do not match the MLA dims".into()));
        }
        let t = q.rows;
        let mut q_abs = self.tensor_bf16(t, d.heads * lw)?;
        let absorb = (t <= MLA_ABSORB_QUERY_MAX_ROWS && d.kv_lora % 8 == 0)
            .then(|| {
                <MlaAbsorbQuery as ddtree_codegen::Kernel>::space()
                    .into_iter()
                    .find(|p| {
                        (p.nope as usize, p.rope as usize, p.interleave) == (d.nope, d.rope, rope.interleaved())
                            && d.kv_lora % p.cols as usize == 0
                    })
            })
            .flatten();
        if let Some(p) = absorb {
            let kern = self.variant::<MlaAbsorbQuery>(&p)?;
            let max = positions.iter().copied().max().unwrap_or(0);
            let tables = self.rope_tables(rope, max)?;
            let pos = self.staged(Staged::Positions, positions)?;
            let grid = ddtree_kernels::attention::mla_absorb::query_grid(&p, d.heads as u32, d.kv_lora as u32);
            // SAFETY: q [t, heads, nope + rope], kv_b [heads * (nope + v), kv_lora] with
            // kv_lora % cols == 0, q_abs [t, heads, lw]; one position per token within the tables.
            unsafe {
                MlaAbsorbQuery::launch(
                    &kern,
                    self.stream(),
                    grid,
                    q.bf16("mla_query")?,
                    w,
                    &*pos,
                    &tables.cos,
                    &tables.sin,
                    q_abs.bf16_mut("mla_query")?,
                    t as u32,
                    d.heads as u32,
                    d.kv_lora as u32,
                    ((d.nope + d.v) * d.kv_lora) as u32,
                )?
            };
            return Ok(q_abs);
        }
        let g = BatchedGemm {
            m: t,
            n: d.kv_lora,
            k: d.nope,
            batch: d.heads,
            a: Strided {
                offset: 0,
                ld: d.heads * qk,
                stride: qk,
            },
            b: Strided {
                offset: 0,
                ld: d.kv_lora,
                stride: (d.nope + d.v) * d.kv_lora,
            },
            b_op: RightOperand::Plain,
            c: Strided {
                offset: 0,
                ld: d.heads * lw,
                stride: lw,
            },
        };
        let qv = q.bf16("mla_query")?;
        // SAFETY: the strides stay inside q [t, heads * qk], kv_b and q_abs [t, heads * lw].
        unsafe { self.blas().batched(&g, qv, w, q_abs.bf16_mut("mla_query")?)? };
        let idx = self.identity(t * d.heads)?;
        self.copy_rows(
            qv,
            &idx,
            q_abs.bf16_mut("mla_query")?,
            t * d.heads,
            d.rope,
            (qk, d.nope),
            (lw, d.kv_lora),
        )?;
        self.rope_rows(q_abs.bf16_mut("mla_query")?, rope, positions, d.heads, lw, d.kv_lora)?;
        Ok(q_abs)
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
        self.attend(q_abs, cache, layer, span, d, scale, None)
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
        let n = q_abs.rows;
        match kv_b {
            CudaWeight::Dense { w, out, inp }
                if n <= MLA_COMBINE_OUTPUT_MAX_ROWS
                    && d.kv_lora == LATENT
                    && d.rope == ROPE
                    && n * d.heads <= VERIFY_PARTIALS
                    && (*out, *inp) == (d.heads * (d.nope + d.v), d.kv_lora) =>
            {
                self.attend(q_abs, cache, layer, span, d, scale, Some(w))
            }
            _ => {
                let o_lat = self.attend(q_abs, cache, layer, span, d, scale, None)?;
                self.mla_output(&o_lat, kv_b, d)
            }
        }
    }

    fn mla_output(&self, o_lat: &CudaTensor, kv_b: &CudaWeight, d: MlaDims) -> Result<CudaTensor> {
        let _span = self.profile.span("mla_output");
        let CudaWeight::Dense { w, out, inp } = kv_b else {
            return Err(fail("mla_output: kv_b must be dense".into()));
        };
        if o_lat.cols != d.heads * d.kv_lora || (*out, *inp) != (d.heads * (d.nope + d.v), d.kv_lora) {
            return Err(fail("mla_output: o_lat or kv_b do not match the MLA dims".into()));
        }
        let t = o_lat.rows;
        let mut o = self.tensor_bf16(t, d.heads * d.v)?;
        let absorb = (t <= MLA_ABSORB_OUTPUT_MAX_ROWS)
            .then(|| {
                <MlaAbsorbOutput as ddtree_codegen::Kernel>::space()
                    .into_iter()
                    .find(|p| p.lora as usize == d.kv_lora && d.v % p.cols as usize == 0)
            })
            .flatten();
        if let Some(p) = absorb {
            let kern = self.variant::<MlaAbsorbOutput>(&p)?;
            let grid = ddtree_kernels::attention::mla_absorb::output_grid(&p, d.heads as u32, d.v as u32);
            // SAFETY: o_lat [t, heads, kv_lora], kv_b [heads * (nope + v), kv_lora], o [t, heads * v];
            // v % cols == 0.
            unsafe {
                MlaAbsorbOutput::launch(
                    &kern,
                    self.stream(),
                    grid,
                    o_lat.bf16("mla_output")?,
                    w,
                    o.bf16_mut("mla_output")?,
                    t as u32,
                    d.heads as u32,
                    d.nope as u32,
                    d.v as u32,
                    ((d.nope + d.v) * d.kv_lora) as u32,
                )?
            };
            return Ok(o);
        }
        let g = BatchedGemm {
            m: t,
            n: d.v,
            k: d.kv_lora,
            batch: d.heads,
            a: Strided {
                offset: 0,
                ld: d.heads * d.kv_lora,
                stride: d.kv_lora,
            },
            b: Strided {
                offset: d.nope * d.kv_lora,
                ld: d.kv_lora,
                stride: (d.nope + d.v) * d.kv_lora,
            },
            b_op: RightOperand::Transposed,
            c: Strided {
                offset: 0,
                ld: d.heads * d.v,
                stride: d.v,
            },
        };
        // SAFETY: the strides stay inside o_lat [t, heads * L], kv_b and o [t, heads * V].
        unsafe {
            self.blas
                .batched(&g, o_lat.bf16("mla_output")?, w, o.bf16_mut("mla_output")?)?
        };
        Ok(o)
    }

    fn moe_route(&self, logits: &CudaTensor, bias: &CudaVector, cfg: &MoeConfig) -> Result<CudaRouting> {
        let _span = self.profile.span("moe_route");
        let experts = cfg.n_routed_experts;
        if logits.cols != experts || bias.len != experts {
            return Err(fail("moe_route: logits or bias do not match the expert count".into()));
        }
        let (t, topk) = (logits.rows, cfg.num_experts_per_tok);
        let mut ids = self.alloc::<u32>(t * topk)?;
        let mut weights = self.alloc::<f32>(t * topk)?;
        let k = self.first_variant::<MoeRoute>(|_: &MoeRouteParams| true)?;
        // SAFETY: logits [t, experts] f32, bias [experts]; outputs [t, topk].
        unsafe {
            MoeRoute::launch(
                &k,
                self.stream(),
                t as u32,
                logits.f32("moe_route")?,
                &bias.f32,
                &mut ids,
                &mut weights,
                experts as u32,
                topk as u32,
                cfg.n_group as u32,
                cfg.topk_group as u32,
                u32::from(cfg.norm_topk_prob),
                cfg.routed_scaling_factor,
            )?
        };
        Ok(CudaRouting {
            tokens: t,
            topk,
            ids,
            weights,
        })
    }

    fn moe_experts(&self, x: &CudaTensor, routing: &CudaRouting, ex: &CudaExperts) -> Result<CudaTensor> {
        let _span = self.profile.span("moe_experts");
        if routing.tokens != x.rows || x.cols != ex.hidden {
            return Err(fail("moe_experts: routing, input and experts disagree in shape".into()));
        }
        let kern = self.moe_kernels(routing.tokens * routing.topk, ex.group)?;
        let dev = DeviceExperts {
            w13: &ex.w13,
            s13: &ex.s13,
            w2: &ex.w2,
            s2: &ex.s2,
            experts: ex.count as u32,
            hidden: ex.hidden as u32,
            inter: ex.inter as u32,
        };
        let key = (routing.tokens, routing.topk, kern.block_m() == 8, ex.inter);
        let mut st = self.state();
        let at = match st.moe_bufs.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                st.graphs.replaced("MoE buffers");
                if st.moe_bufs.len() >= MOE_BUFFER_SETS {
                    st.moe_bufs.remove(0);
                }
                st.moe_bufs
                    .push((key, kern.buffers(self.stream(), routing.tokens, routing.topk, &dev)?));
                st.moe_bufs.len() - 1
            }
        };
        let bufs = &mut st.moe_bufs[at].1;
        let mut out = self.tensor_bf16(x.rows, x.cols)?;
        let input = MoeInput {
            x: x.bf16("moe_experts")?,
            topk_ids: &routing.ids,
            topk_w: &routing.weights,
            tokens: routing.tokens as u32,
            topk: routing.topk as u32,
        };
        // SAFETY: x [T, H], routing [T, topk], experts stacked in the variants' layout.
        unsafe { kern.run(self.stream(), &dev, &input, out.bf16_mut("moe_experts")?, bufs)? };
        Ok(out)
    }

    fn kv_append(&self, cache: &mut CudaKvCache, layer: usize, rows: &CudaTensor) -> Result<()> {
        let _span = self.profile.span("kv_append");
        if layer >= cache.lens.len() || rows.cols != cache.width {
            return Err(fail(format!("kv_append: bad layer {layer} or width {}", rows.cols)));
        }
        let start = cache.lens[layer];
        if start + rows.rows > cache.capacity {
            return Err(EngineError::Forward(format!(
                "cache full: {start} + {} rows exceed its capacity of {}",
                rows.rows, cache.capacity
            )));
        }
        let idx = self.identity(rows.rows)?;
        let w = cache.width;
        let mut layer_rows = cache.layer_mut(layer);
        let mut dst = layer_rows.slice_mut(start * w..);
        self.copy_rows(rows.bf16("kv_append")?, &idx, &mut dst, rows.rows, w, (w, 0), (w, 0))?;
        cache.lens[layer] = start + rows.rows;
        Ok(())
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
        let _span = self.profile.span("gqa_attention");
        let kv_w = dims.kv_heads * dims.head_dim;
        if q.cols != dims.heads * dims.head_dim || cache.width != kv_w || k_layer.max(v_layer) >= cache.lens.len() {
            return Err(fail("gqa_attention: shapes do not match the head layout".into()));
        }
        let keys = cache.lens[k_layer];
        if cache.lens[v_layer] != keys {
            return Err(fail("gqa_attention: key and value layers differ in length".into()));
        }
        let mut out = self.tensor_bf16(q.rows, q.cols)?;
        let k = self.first_variant::<GqaAttention>(|_: &GqaParams| true)?;
        // SAFETY: q [rows, heads * hd], k/v layers hold `keys` rows of kv_heads * hd.
        unsafe {
            GqaAttention::launch(
                &k,
                self.stream(),
                (q.rows * dims.heads) as u32,
                q.bf16("gqa_attention")?,
                &cache.layer(k_layer),
                &cache.layer(v_layer),
                out.bf16_mut("gqa_attention")?,
                q.rows as u32,
                keys as u32,
                dims.heads as u32,
                dims.kv_heads as u32,
                dims.head_dim as u32,
                scale,
            )?
        };
        Ok(out)
    }

    fn kv_len(&self, cache: &CudaKvCache) -> usize {
        cache.lens.first().copied().unwrap_or(0)
    }

    fn kv_truncate(&self, cache: &mut CudaKvCache, len: usize) -> Result<()> {
        let _span = self.profile.span("kv_truncate");
        cache.lens.iter_mut().for_each(|l| *l = (*l).min(len));
        Ok(())
    }

    fn kv_compact(&self, cache: &mut CudaKvCache, base: usize, keep: &[usize]) -> Result<()> {
        let _span = self.profile.span("kv_compact");
        let len = self.kv_len(cache);
        let ascending = keep.windows(2).all(|w| w[0] < w[1]);
        if !ascending || keep.last().is_some_and(|&k| base + k >= len) {
            return Err(EngineError::Forward(format!(
                "kv_compact: keep list {keep:?} after row {base} must ascend and stay below {len}"
            )));
        }
        let moved: Vec<u32> = keep.iter().map(|&k| k as u32).collect();
        if moved.iter().enumerate().any(|(i, &k)| k as usize != i) {
            let accepted = self.upload(&moved)?;
            let count = self.upload(&[moved.len() as u32])?;
            let k = self.variant::<tree::CompactRows>(&())?;
            let layers = cache.lens.len();
            let (width, stride) = (cache.width, check_u32("kv_compact", cache.capacity * cache.width)?);
            // SAFETY: every kept row is below len; rows move down in ascending order.
            unsafe {
                tree::CompactRows::launch(
                    &k,
                    self.stream(),
                    layers as u32,
                    cache.buf_mut(),
                    &accepted,
                    &count,
                    base as u32,
                    width as u32,
                    stride,
                )?
            };
        }
        cache.lens.iter_mut().for_each(|l| *l = base + keep.len());
        Ok(())
    }
}

impl CudaBackend {
    /// [`Backend::mla_attention`]; with `kv_b` (`W_UV`'s source, `[heads (nope + v), kv_lora]`,
    /// for Kimi's 576-wide rows and at most `VERIFY_PARTIALS` rows) the split pass's partials go
    /// straight into the absorbed output projection ([`Backend::mla_attention_output`]'s fused
    /// path) and the result is `[T, heads v]`.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        q_abs: &CudaTensor,
        cache: &CudaKvCache,
        layer: usize,
        span: AttentionSpan<'_>,
        d: MlaDims,
        scale: f32,
        kv_b: Option<&CudaSlice<bf16>>,
    ) -> Result<CudaTensor> {
        let _span = self.profile.span("mla_attention");
        let lw = d.latent_width();
        let n = q_abs.rows;
        if q_abs.cols != d.heads * lw || layer >= cache.lens.len() || cache.width != lw {
            return Err(fail(format!("mla_attention: bad layer {layer} or widths")));
        }
        if cache.lens[layer] != span.prefix_len + n {
            return Err(fail(format!(
                "mla_attention: cache holds {} rows, expected prefix {} + {n} new",
                cache.lens[layer], span.prefix_len
            )));
        }
        let (mask, words) = match span.mask {
            Some(m) => (self.staged(Staged::Mask, m.words())?, m.words_per_row()),
            None => {
                let chain = AncestorMask::causal(n);
                (self.staged(Staged::Mask, chain.words())?, chain.words_per_row())
            }
        };
        let lens = self.staged(Staged::Lens, &[span.prefix_len as u32])?;
        let mut out = self.tensor_bf16(n, d.heads * d.kv_lora)?;
        let q = q_abs.bf16("mla_attention")?;
        let kv = cache.layer(layer);
        // The split-KV tensor-core kernel for Kimi's 576-wide rows (any node count: rows are
        // independent and the mask is read per row); the generic kernel for other widths.
        if d.kv_lora == LATENT && d.rope == ROPE {
            let mut st = self.state();
            let st = &mut *st;
            // The split count (and the kernel) are chosen for the length bucket (the kernel reads
            // the length itself), so one recorded graph serves every length of its bucket.
            let bucket = graph::length_bucket(span.prefix_len + n);
            let p = verify_variant(self.attention, n * d.heads, bucket);
            let at = match st.verify.iter().position(|v| *v.variant() == p) {
                Some(i) => i,
                None => {
                    st.graphs.replaced("the verify attention partials");
                    st.verify
                        .push(tree::gpu::GpuVerify::new(self.gpu(), &p, VERIFY_PARTIALS)?);
                    st.verify.len() - 1
                }
            };
            let verify = &mut st.verify[at];
            let sh = tree::gpu::VerifyShape {
                nodes: n,
                heads: d.heads,
                prefix: bucket - n,
                words,
                scale,
            };
            if n * d.heads <= VERIFY_PARTIALS {
                let splits = verify.auto_splits(self.gpu().fingerprint().sm_count as usize, &sh);
                if let Some(w) = kv_b {
                    let mut o = self.tensor_bf16(n, d.heads * d.v)?;
                    verify.run_output(
                        self.stream(),
                        &sh,
                        splits,
                        q,
                        &kv,
                        &mask,
                        &*lens,
                        w,
                        (d.nope, d.v),
                        o.bf16_mut("mla_attention")?,
                    )?;
                    return Ok(o);
                }
                let mut lse = self.alloc::<f32>(n * d.heads)?;
                verify.run(
                    self.stream(),
                    &sh,
                    splits,
                    q,
                    &kv,
                    &mask,
                    &*lens,
                    out.bf16_mut("mla_attention")?,
                    &mut lse,
                )?;
                return Ok(out);
            }
        }
        if kv_b.is_some() {
            return Err(fail(
                "mla_attention_output: the fused path needs Kimi's latent rows".into(),
            ));
        }
        let k = self.first_variant::<MlaAttention>(|_: &MlaAttnParams| true)?;
        // SAFETY: q [n, heads, lw], the layer's first prefix + n rows, mask [n, words].
        unsafe {
            MlaAttention::launch(
                &k,
                self.stream(),
                (n * d.heads) as u32,
                q,
                &kv,
                &*mask,
                out.bf16_mut("mla_attention")?,
                &*lens,
                d.heads as u32,
                n as u32,
                words as u32,
                d.kv_lora as u32,
                d.rope as u32,
                scale,
            )?
        };
        Ok(out)
    }

    /// The GEMV for `rows` rows, `n` outputs of width `k`, when one applies: up to
    /// [`gemv::MAX_ROWS`] rows (decode and small trees), `k % 8 == 0`; the per-column kernel for
    /// wide outputs, the split-K one for narrow ones ([`gemv::choose`]). Above that cuBLAS is
    /// faster.
    fn gemv_params(&self, rows: usize, n: usize, k: usize) -> Option<GemvChoice> {
        gemv::choose(rows, n, k, self.gpu().fingerprint().sm_count as usize)
    }

    /// `out = a w^T` for `a` `[rows, k]` and a dense bf16 `w` `[n, k]`: the GEMV [`gemv::choose`]
    /// picks for the shape (one warp per column or split-K), cuBLAS when none fits.
    fn dense_product(
        &self,
        a: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        out: DenseOut<'_>,
        rows: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        let (r, n32, k32) = (rows as u32, n as u32, k as u32);
        let s = self.stream();
        // SAFETY (every launch): a [rows <= p.m, k], w [n, k], out [rows, n]; k % 8 == 0 (the
        // GEMVs are only chosen then); cuBLAS: a [m, k], w [n, k], out [m, n].
        unsafe {
            match (self.gemv_params(rows, n, k), out) {
                (Some(GemvChoice::Warp(p)), DenseOut::Bf16(o)) => GemvBf16::launch(
                    &*self.variant::<GemvBf16>(&p)?,
                    s,
                    gemv::grid(&p, n32),
                    a,
                    w,
                    o,
                    r,
                    n32,
                    k32,
                )?,
                (Some(GemvChoice::Warp(p)), DenseOut::F32(o)) => GemvBf16F32::launch(
                    &*self.variant::<GemvBf16F32>(&p)?,
                    s,
                    gemv::grid(&p, n32),
                    a,
                    w,
                    o,
                    r,
                    n32,
                    k32,
                )?,
                (Some(GemvChoice::Split(p)), DenseOut::Bf16(o)) => GemvSplitBf16::launch(
                    &*self.variant::<GemvSplitBf16>(&p)?,
                    s,
                    gemv::split_grid(&p, n32),
                    a,
                    w,
                    o,
                    r,
                    n32,
                    k32,
                )?,
                (Some(GemvChoice::Split(p)), DenseOut::F32(o)) => GemvSplitF32::launch(
                    &*self.variant::<GemvSplitF32>(&p)?,
                    s,
                    gemv::split_grid(&p, n32),
                    a,
                    w,
                    o,
                    r,
                    n32,
                    k32,
                )?,
                (None, DenseOut::Bf16(o)) => self.blas().linear(a, w, o, rows, n, k)?,
                (None, DenseOut::F32(o)) => self.blas().linear(a, w, o, rows, n, k)?,
            }
        }
        Ok(())
    }

    /// The largest value of every row of f32 `logits` and its index (the lowest among equal
    /// maxima) into `values` and `indices` (at least `logits.rows` each): the split top-1 (many
    /// blocks per row, then a merge) for fewer than [`topk::SPLIT_MAX_ROWS`] rows (the decode
    /// step's one row of the vocabulary took 77 µs in one block on the H200), else the tuned
    /// one-block-per-row top-1.
    fn argmax_into(
        &self,
        st: &mut State,
        logits: &CudaTensor,
        values: &mut CudaSlice<f32>,
        indices: &mut CudaSlice<u32>,
    ) -> Result<()> {
        let (rows, n) = (logits.rows, logits.cols);
        if rows < topk::SPLIT_MAX_ROWS {
            if st.argmax.is_none() {
                st.argmax = Some(TopkRunner::new(self.gpu(), 1)?);
            }
            let runner = st.argmax.as_mut().expect("made above");
            if runner.reserve(self.stream(), rows, n)? {
                st.graphs.replaced("the argmax candidates");
            }
            runner.run(self.stream(), logits.f32("argmax")?, values, indices, rows, n)?;
            return Ok(());
        }
        let key = tune::TopkKey { rows, n, k: 1 };
        let k = self.kernels.get::<RowTopk>(&key)?;
        if k.params().k != 1 {
            return Err(fail("argmax: the tuned top-k variant is not k = 1".into()));
        }
        // SAFETY: logits [rows, n]; the outputs hold at least one value and index per row.
        unsafe {
            RowTopk::launch(
                &k,
                self.stream(),
                rows as u32,
                logits.f32("argmax")?,
                values,
                indices,
                n as u32,
            )?
        };
        Ok(())
    }

    /// [`Backend::add_rms_norm`] (`z` `None`) and [`Backend::add2_rms_norm`] on the f32 residual
    /// stream `x`: one [`AddRmsNorm`] launch adding `y` (or `bf16(y + z)`) into `x` and
    /// normalizing it.
    fn residual_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        z: Option<&CudaTensor>,
        weight: &CudaVector,
        eps: f32,
    ) -> Result<CudaTensor> {
        let (rows, n) = (x.rows, x.cols);
        let fits = |t: &CudaTensor| (t.rows, t.cols) == (rows, n);
        if !fits(y) || !z.is_none_or(fits) || n != weight.len {
            return Err(fail(format!(
                "add_rms_norm: {rows}x{n} += {}x{}{}, weight of {}",
                y.rows,
                y.cols,
                z.map_or(String::new(), |z| format!(" + {}x{}", z.rows, z.cols)),
                weight.len
            )));
        }
        let addends = if z.is_some() { 2 } else { 1 };
        let p = residual::choose_add_rms_norm(rows, n, addends)
            .ok_or_else(|| fail(format!("add_rms_norm: no variant with {addends} addend(s)")))?;
        let k = self.variant::<AddRmsNorm>(&p)?;
        let mut out = self.tensor_bf16(rows, n)?;
        let xf = match &mut x.data {
            DeviceData::F32(xf) => xf,
            DeviceData::Bf16(_) => return Err(fail("add_rms_norm: the residual stream is not f32".into())),
        };
        let y16 = y.bf16("add_rms_norm")?;
        // With one addend `z` is not read: any buffer will do.
        let z16 = match z {
            Some(z) => z.bf16("add_rms_norm")?,
            None => y16,
        };
        // SAFETY: x [rows, n] f32, y and z [rows, n] bf16, weight n, out [rows, n].
        unsafe {
            AddRmsNorm::launch(
                &k,
                self.stream(),
                rows as u32,
                xf,
                y16,
                z16,
                &weight.bf16,
                out.bf16_mut("add_rms_norm")?,
                n as u32,
                eps,
            )?
        };
        Ok(out)
    }

    /// RMSNorm of `rows` rows of `n` values with the tuned variant for the shape.
    fn rms_rows(
        &self,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
        rows: usize,
        n: usize,
        eps: f32,
    ) -> Result<()> {
        let k = self.kernels.get::<RmsNorm>(&tune::RowsKey { rows, n })?;
        // SAFETY: x and out hold rows * n values, w n; the tuner's candidates respect n % 8.
        unsafe { RmsNorm::launch(&k, self.stream(), rows as u32, x, w, out, n as u32, eps)? };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_kernel_follows_the_gpu() {
        assert_eq!(
            resolve_attention(AttentionKernel::Auto, (9, 0)).unwrap(),
            AttentionKernel::Auto
        );
        assert_eq!(
            resolve_attention(AttentionKernel::Auto, (8, 0)).unwrap(),
            AttentionKernel::Mma
        );
        assert_eq!(
            resolve_attention(AttentionKernel::Mma, (10, 0)).unwrap(),
            AttentionKernel::Mma
        );
        let err = resolve_attention(AttentionKernel::Wgmma, (8, 9))
            .unwrap_err()
            .to_string();
        assert!(err.contains("sm_90") && err.contains("sm_89"), "{err}");
    }

    #[test]
    fn auto_attention_picks_wgmma_for_trees_and_long_decode_steps() {
        let wg = |v: tree::VerifyVariant| matches!(v, tree::VerifyVariant::Wg(_));
        assert!(!wg(verify_variant(AttentionKernel::Auto, 64, WG_DECODE_MIN_KEYS)));
        assert!(wg(verify_variant(AttentionKernel::Auto, 64, 2 * WG_DECODE_MIN_KEYS)));
        assert!(wg(verify_variant(AttentionKernel::Auto, 9 * 64, 1024)));
        assert!(!wg(verify_variant(AttentionKernel::Mma, 9 * 64, 1 << 20)));
        assert!(wg(verify_variant(AttentionKernel::Wgmma, 64, 256)));
    }

    #[test]
    fn auto_attention_picks_the_narrow_kernel_for_eight_rows() {
        let narrow = |v: tree::VerifyVariant| v == tree::VerifyVariant::Narrow;
        assert!(narrow(verify_variant(AttentionKernel::Auto, 8, 1024)));
        assert!(narrow(verify_variant(AttentionKernel::Auto, 3, 2 * WG_DECODE_MIN_KEYS)));
        assert!(!narrow(verify_variant(AttentionKernel::Auto, 9, 1024)));
        assert!(!narrow(verify_variant(AttentionKernel::Mma, 8, 1024)));
        assert!(!narrow(verify_variant(AttentionKernel::Wgmma, 8, 1024)));
    }
}
