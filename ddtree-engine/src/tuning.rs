//! Kernel tuning for a model: which (kernel, problem key) pairs the engine launches for a
//! model's dimensions, and tuning the ones the per-GPU tune cache lacks.
//!
//! - [`ModelDims`]: the dimensions that decide the problem keys (from a [`ModelConfig`] or the
//!   built-in Kimi K2.6 preset);
//! - [`Job`] / [`KeyJob`] / [`job`]: one (kernel, key) of any [`Tunable`] kernel, type-erased;
//! - [`lookups`] / [`plan`]: every key the [`crate::CudaBackend`] can look up in the tune cache
//!   for a model (M = 1, 2, 4, ...), from the same [`Lookup`] constructors its dispatch calls:
//!   what the `autotune` binary tunes; [`startup_plan`]: the keys the [`crate::CudaBackend`] looks up in
//!   the tune cache (the others it runs at a fixed variant or through cuBLAS);
//! - [`tune_missing`]: tunes the keys of [`startup_plan`] that the tune cache lacks or holds
//!   stale (the `ddtree` CLI calls it before building the CUDA backend), with [`Progress`];
//! - [`tune_jobs`] and [`progress_line`]: the loop and log line shared with `autotune`;
//! - [`measure_verify_cost`]: the target's verify latency by tree size, as the [`CostModel`] of
//!   `--budget auto`, stored per (GPU, model shape) next to the tune cache
//!   ([`save_verify_cost`], [`load_verify_cost`]; `autotune --verify-cost` measures it).
//!
//! The tuner saves the tune cache after every new entry, so an interrupted run keeps what it
//! measured.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ddtree_kernels::tree;
use ddtree_runtime::{
    Fingerprint, Gpu, KernelSource, Roofline, RuntimeError, TrialStatus, Tunable, TuneCache, TuneOptions, Tuned,
    TunedKernels, Tuner,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::backend::cuda::{Lookup, DENSE_INT4_GEMV_MAX_ROWS};
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::mask::AncestorMask;
use crate::model::{ForwardInput, LogitRows, Model};
use crate::spec::{CostModel, VerifyPoint};

/// The dimensions that decide the problem keys.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelDims {
    /// A name for messages (preset name or model folder).
    pub name: String,
    /// `hidden_size`.
    pub hidden: usize,
    /// `vocab_size`.
    pub vocab: usize,
    /// `intermediate_size` (dense MLP layers).
    pub intermediate: usize,
    /// `moe_intermediate_size` (one expert).
    pub moe_intermediate: usize,
    /// `n_shared_experts`.
    pub shared_experts: usize,
    /// `n_routed_experts`.
    pub routed_experts: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `q_lora_rank` (`None`: a plain `q_proj`).
    pub q_lora_rank: Option<usize>,
    /// `kv_lora_rank`.
    pub kv_lora_rank: usize,
    /// `qk_nope_head_dim`.
    pub qk_nope: usize,
    /// `qk_rope_head_dim`.
    pub qk_rope: usize,
    /// `rope_interleave`: adjacent rope pairs (true) or rotate-half pairs.
    pub rope_interleave: bool,
    /// `v_head_dim`.
    pub v_head: usize,
    /// The INT4 scale group of a quantized checkpoint (`quantization_config`), `None` for a
    /// dense one.
    pub int4_group: Option<usize>,
}

impl ModelDims {
    /// Kimi K2.6 (DeepSeek-V3 architecture with 64 heads and 384 experts).
    pub fn kimi_k26() -> ModelDims {
        ModelDims {
            name: "kimi-k2.6".into(),
            hidden: 7168,
            vocab: 163840,
            intermediate: 18432,
            moe_intermediate: 2048,
            shared_experts: 1,
            routed_experts: 384,
            heads: 64,
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope: 128,
            qk_rope: 64,
            rope_interleave: true,
            v_head: 128,
            int4_group: Some(32),
        }
    }

    /// The dimensions of `c`, named `name`.
    pub fn from_config(name: String, c: &ModelConfig) -> ModelDims {
        ModelDims {
            name,
            hidden: c.hidden_size,
            vocab: c.vocab_size,
            intermediate: c.intermediate_size,
            moe_intermediate: c.moe.moe_intermediate_size,
            shared_experts: c.moe.n_shared_experts,
            routed_experts: c.moe.n_routed_experts,
            heads: c.num_attention_heads,
            q_lora_rank: c.q_lora_rank,
            kv_lora_rank: c.kv_lora_rank,
            qk_nope: c.qk_nope_head_dim,
            qk_rope: c.qk_rope_head_dim,
            rope_interleave: c.rope.interleave,
            v_head: c.v_head_dim,
            int4_group: c.quantization.as_ref().map(|q| q.group_size),
        }
    }

    /// The widths the RMS norms run at: hidden, the KV latent and the query latent.
    fn norms(&self) -> Vec<usize> {
        // The latent KV's norm (`kv_lora_rank`) runs fused in `mla_append_kv`, not on `rms_norm`.
        let mut norms = vec![self.hidden];
        norms.extend(self.q_lora_rank);
        norms
    }

    /// The dense W4A16 GEMV keys of a quantized checkpoint, M = 1, 2, 4, ... up to `max_m`:
    /// the `[n, k]` shapes of the linears that may be INT4 outside the routed experts (the
    /// shared experts' gate, up and down, the dense MLP's) at every M where the CUDA backend's
    /// `linear` runs them on the GEMV ([`Lookup::int4_gemv`]). None for a dense checkpoint.
    /// Which linears are INT4 is decided at load time from the tensors present, so some of these
    /// keys may go unused (Kimi's `ignore` list keeps the shared experts and the dense MLP bf16).
    fn int4_gemv_lookups(&self, max_m: usize) -> Vec<Lookup> {
        let Some(group) = self.int4_group else {
            return Vec::new();
        };
        let shared = self.moe_intermediate * self.shared_experts;
        let shapes = [
            (shared, self.hidden),            // shared experts' gate and up
            (self.hidden, shared),            // shared experts' down
            (self.intermediate, self.hidden), // dense MLP gate and up
            (self.hidden, self.intermediate), // dense MLP down
        ];
        let mut keys = Vec::new();
        for tokens in token_counts(max_m.min(DENSE_INT4_GEMV_MAX_ROWS)) {
            for &(n, k) in &shapes {
                if n > 0 && k > 0 {
                    keys.extend(Lookup::int4_gemv(tokens, n, k, group));
                }
            }
        }
        keys
    }
}

/// One (kernel, key) to tune, whatever the kernel.
pub trait Job {
    /// The kernel's name ([`ddtree_runtime::Kernel::NAME`]).
    fn kernel(&self) -> &'static str;
    /// The bucketed key, as the tune cache names it.
    fn key(&self) -> String;
    /// Whether `tuner` holds a valid entry (one whose candidates' sources are unchanged).
    fn cached(&self, tuner: &Tuner<'_>) -> bool;
    /// The sources of every candidate variant (to compile them all up front).
    fn sources(&self) -> Vec<KernelSource>;
    /// Tunes the key (or returns the cached entry).
    fn tune(&self, tuner: &mut Tuner<'_>) -> std::result::Result<Tuned, RuntimeError>;
    /// Loads the key's tuned variant into `kernels`.
    fn preload(&self, kernels: &TunedKernels) -> std::result::Result<(), RuntimeError>;
}

/// The [`Job`] of kernel `K` at one key.
pub struct KeyJob<K: Tunable>(pub K::Key);

impl<K: Tunable> Job for KeyJob<K> {
    fn kernel(&self) -> &'static str {
        K::NAME
    }
    fn key(&self) -> String {
        K::bucket(&self.0).to_string()
    }
    fn cached(&self, tuner: &Tuner<'_>) -> bool {
        tuner.cached::<K>(&self.0).is_some()
    }
    fn sources(&self) -> Vec<KernelSource> {
        K::candidates(&K::bucket(&self.0))
            .iter()
            .filter_map(|p| KernelSource::of::<K>(p).ok())
            .collect()
    }
    fn tune(&self, tuner: &mut Tuner<'_>) -> std::result::Result<Tuned, RuntimeError> {
        tuner.tune::<K>(&self.0)
    }
    fn preload(&self, kernels: &TunedKernels) -> std::result::Result<(), RuntimeError> {
        kernels.preload::<K>(std::slice::from_ref(&self.0))
    }
}

/// The boxed [`KeyJob`] of `K` at `key`.
pub fn job<K: Tunable>(key: K::Key) -> Box<dyn Job> {
    Box::new(KeyJob::<K>(key))
}

/// M = 1, 2, 4, ... up to `max_m` (at least 1).
fn token_counts(max_m: usize) -> Vec<usize> {
    std::iter::successors(Some(1usize), |m| Some(m * 2))
        .take_while(|&m| m <= max_m.max(1))
        .collect()
}

/// Every tune-cache lookup the CUDA backend can make for `d` at M = 1, 2, 4, ..., `max_m`
/// rows, built with the same [`Lookup`] constructors the backend's dispatch calls: `rms_norm`
/// at the hidden and latent widths, `embedding`, the argmax (`row_topk`, k = 1, from
/// [`ddtree_kernels::topk::SPLIT_MAX_ROWS`] rows on), the dense `w4a16_gemv` of a quantized
/// checkpoint's INT4 linears, and the tree builder. Deduplicated by bucket, in a stable order.
pub fn lookups(d: &ModelDims, max_m: usize) -> Vec<Lookup> {
    let mut all = Vec::new();
    for m in token_counts(max_m) {
        all.extend(d.norms().into_iter().map(|n| Lookup::rms_norm(m, n)));
        all.push(Lookup::embedding(m, d.vocab, d.hidden));
        all.extend(Lookup::argmax(m, d.vocab));
    }
    all.extend(d.int4_gemv_lookups(max_m));
    all.extend(tree_build_lookups(d.vocab));
    let mut seen = std::collections::HashSet::new();
    all.retain(|l| seen.insert(l.bucket()));
    all
}

/// The tuning jobs of [`lookups`]: what `autotune` tunes for `d`.
pub fn plan(d: &ModelDims, max_m: usize) -> Vec<Box<dyn Job>> {
    lookups(d, max_m).iter().map(Lookup::job).collect()
}

/// The drafted positions per round the GPU tree builder is tuned for: DFlash block sizes 8
/// and 16 (the bonus slot excluded).
pub const TREE_DEPTHS: [usize; 2] = [7, 15];

/// The GPU tree builder's keys at vocabulary `vocab`: every depth of [`TREE_DEPTHS`] at the
/// budget buckets 1, 2, 4, ..., [`tree::MAX_K`].
fn tree_build_lookups(vocab: usize) -> Vec<Lookup> {
    TREE_DEPTHS
        .into_iter()
        .flat_map(|depth| {
            token_counts(tree::MAX_K)
                .into_iter()
                .map(move |budget| Lookup::tree_build(depth, vocab, budget))
        })
        .collect()
}

/// The largest token count [`startup_plan`] covers: a verify forward of the largest `auto`
/// tree ([`crate::spec::AUTO_MAX_BUDGET`] nodes and the root) lands in this bucket.
pub const STARTUP_MAX_M: usize = 512;

/// The keys the CUDA backend looks up in the tune cache for `d` (`rms_norm` at the hidden and
/// latent widths, `embedding`, and `row_topk` with k = 1 for the argmax), M = 1, 2, 4, ...,
/// [`STARTUP_MAX_M`] (a subset of [`lookups`]). The dense `w4a16_gemv` keys are left to `autotune` ([`plan`]): which
/// linears are INT4 is known only once the weights load (Kimi's `ignore` list keeps them all
/// bf16), and without an entry the backend runs the mode's default. Every other kernel the
/// backend launches runs a fixed variant or cuBLAS, so tuning it at startup would only cost
/// time. Deduplicated, in a stable order.
pub fn startup_plan(d: &ModelDims) -> Vec<Box<dyn Job>> {
    lookups(d, STARTUP_MAX_M)
        .iter()
        .filter(|l| matches!(l, Lookup::RmsNorm(_) | Lookup::Embedding(_) | Lookup::Argmax(_)))
        .map(Lookup::job)
        .collect()
}

/// Where tuning reports progress.
pub struct Progress {
    bar: ProgressBar,
    /// One plain line per key on stderr instead of the bar.
    lines: bool,
    /// The bar is shown (on a terminal); otherwise it stays hidden.
    visible: bool,
}

impl Progress {
    /// On stderr: a bar on a terminal, one plain line per finished key otherwise (a log).
    pub fn stderr() -> Progress {
        Progress::with_bar(ProgressBar::hidden())
    }

    /// [`Progress::stderr`] drawing `bar` (hidden until tuning starts), for callers whose log
    /// writer already prints above that bar.
    pub fn with_bar(bar: ProgressBar) -> Progress {
        let terminal = std::io::stderr().is_terminal();
        Progress {
            bar,
            lines: !terminal,
            visible: terminal,
        }
    }

    /// Nothing at all (tests).
    pub fn silent() -> Progress {
        Progress {
            bar: ProgressBar::hidden(),
            lines: false,
            visible: false,
        }
    }

    /// Shows the bar at 0 of `len` steps (again, when an earlier run finished it).
    fn start(&self, len: usize) {
        if self.visible {
            self.bar.set_length(len as u64);
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
            self.bar.set_style(
                ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} {msg}")
                    .expect("a valid template"),
            );
            self.bar.reset();
        }
    }

    /// One step finished: its log line (made only when lines are printed) and the bar.
    fn step_done(&self, line: impl FnOnce() -> String) {
        if self.lines {
            let mut err = std::io::stderr().lock();
            let _ = writeln!(err, "{}", line());
            let _ = err.flush();
        }
        self.bar.inc(1);
    }
}

/// What [`tune_jobs`] returns.
#[derive(Debug, Default)]
pub struct TuneRun {
    /// One result per job that tuned (or came from the cache), in plan order.
    pub rows: Vec<Tuned>,
    /// `kernel key: error` of every job that failed.
    pub errors: Vec<String>,
}

/// Tunes `jobs` in order (cached ones return at once), reporting to `progress`.
pub fn tune_jobs(tuner: &mut Tuner<'_>, jobs: &[Box<dyn Job>], progress: &Progress) -> TuneRun {
    progress.start(jobs.len());
    let bar = &progress.bar;
    let mut run = TuneRun::default();
    for (i, j) in jobs.iter().enumerate() {
        bar.set_message(format!("{} {}", j.kernel(), j.key()));
        let tuned = j.tune(tuner);
        progress.step_done(|| progress_line(i + 1, jobs.len(), j.as_ref(), &tuned));
        match tuned {
            Ok(t) => run.rows.push(t),
            Err(e) => run.errors.push(format!("{} {}: {e}", j.kernel(), j.key())),
        }
    }
    bar.finish_and_clear();
    run
}

/// What [`precompile`] did.
#[derive(Debug, Clone, Copy)]
pub struct Precompiled {
    /// Distinct candidate variants.
    pub variants: usize,
    /// Of them, read from the compile cache.
    pub from_cache: usize,
    /// Of them, failed to compile.
    pub failed: usize,
    /// Wall time.
    pub time: Duration,
}

/// Compiles every candidate variant of `jobs` in parallel (into the compile cache), so that
/// tuning them one by one only loads modules.
pub fn precompile(gpu: &Gpu, jobs: &[&dyn Job]) -> Precompiled {
    let t = Instant::now();
    let mut sources: Vec<KernelSource> = jobs.iter().flat_map(|j| j.sources()).collect();
    sources.sort_by(|a, b| a.symbol.cmp(&b.symbol));
    sources.dedup_by(|a, b| a.symbol == b.symbol);
    let cubins = gpu.jit().cubins(&sources);
    Precompiled {
        variants: sources.len(),
        from_cache: cubins.iter().filter(|c| c.as_ref().is_ok_and(|c| c.cached)).count(),
        failed: cubins.iter().filter(|c| c.is_err()).count(),
        time: t.elapsed(),
    }
}

/// The log line of the `done`-th of `total` keys:
/// `[12/180] gemm_bf16 m=64 n=7168 k=2048: winner V 41.20 µs (default 45.00 µs) in 0.31 s (...)`.
pub fn progress_line(
    done: usize,
    total: usize,
    job: &dyn Job,
    tuned: &std::result::Result<Tuned, RuntimeError>,
) -> String {
    let head = format!("[{done}/{total}] {} {}", job.kernel(), job.key());
    let t = match tuned {
        Ok(t) => t,
        Err(e) => return format!("{head}: ERROR {e}"),
    };
    let e = &t.entry;
    let us = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2} µs"));
    let winner = match &e.winner {
        Some(w) => format!("winner {w} {}", us(e.winner_us)),
        None => "NONE PASSED".to_string(),
    };
    let bad = e.trials.iter().filter(|t| t.status != TrialStatus::Ok).count();
    let rejected = if bad > 0 {
        format!(", {bad} rejected")
    } else {
        String::new()
    };
    let when = if t.from_cache {
        "cached".to_string()
    } else {
        let x = &t.times;
        format!(
            "in {:.2} s (compile {:.2}, inputs {:.2}, checks {:.2}, timing {:.2})",
            x.total().as_secs_f64(),
            x.compile.as_secs_f64(),
            x.inputs.as_secs_f64(),
            x.checks.as_secs_f64(),
            x.timing.as_secs_f64()
        )
    };
    format!("{head}: {winner} (default {}){rejected}, {when}", us(e.default_us))
}

/// What [`tune_missing`] did.
#[derive(Debug, Clone)]
pub struct TuneSummary {
    /// Keys in the plan.
    pub keys: usize,
    /// Keys measured now (the others had a valid tune-cache entry).
    pub tuned: usize,
    /// `kernel key: error` of the keys that could not be tuned (they run the default variant).
    pub errors: Vec<String>,
    /// Wall time, compiling included.
    pub time: Duration,
    /// The tune cache file.
    pub cache: PathBuf,
}

impl TuneSummary {
    /// The one line the CLI prints after tuning (`None` when everything was cached).
    pub fn line(&self) -> Option<String> {
        (self.tuned > 0 || !self.errors.is_empty()).then(|| {
            let errors = if self.errors.is_empty() {
                String::new()
            } else {
                format!(" ({} failed)", self.errors.len())
            };
            format!(
                "tuned {} of {} kernel keys in {:.1} s{errors}; tune cache: {}",
                self.tuned,
                self.keys,
                self.time.as_secs_f64(),
                self.cache.display()
            )
        })
    }
}

fn tune_error(e: RuntimeError) -> EngineError {
    EngineError::Backend {
        backend: "cuda".into(),
        reason: format!("tuning: {e}"),
    }
}

/// Tunes the keys of `config`'s [`startup_plan`] that `gpu`'s tune cache lacks (or holds
/// stale: tuned for other kernel sources), reporting to `progress`, and leaves the cache saved
/// (the tuner saves after every new entry). Keys that fail to tune are listed in the summary,
/// not errors: the backend runs their default variant. Measures nothing when every key is
/// cached.
pub fn tune_missing(gpu: &Gpu, config: &ModelConfig, progress: &Progress) -> Result<TuneSummary> {
    let start = Instant::now();
    let dims = ModelDims::from_config(config.model_type.clone(), config);
    let jobs = startup_plan(&dims);
    let keys = jobs.len();
    let cache = TuneCache::open(gpu.fingerprint());
    let path = cache.path().to_path_buf();
    let mut tuner = Tuner::new(gpu, cache, TuneOptions::default());
    let todo: Vec<Box<dyn Job>> = jobs.into_iter().filter(|j| !j.cached(&tuner)).collect();
    let mut summary = TuneSummary {
        keys,
        tuned: 0,
        errors: Vec::new(),
        time: Duration::ZERO,
        cache: path,
    };
    if todo.is_empty() {
        summary.time = start.elapsed();
        return Ok(summary);
    }
    let refs: Vec<&dyn Job> = todo.iter().map(|j| j.as_ref()).collect();
    precompile(gpu, &refs);
    tuner.options_mut().roofline = Some(Roofline::measure(gpu).map_err(tune_error)?);
    let run = tune_jobs(&mut tuner, &todo, progress);
    summary.tuned = run.rows.iter().filter(|r| !r.from_cache).count();
    summary.errors = run.errors;
    tuner.cache().save().map_err(tune_error)?;
    summary.time = start.elapsed();
    Ok(summary)
}

/// [`tune_missing`] on GPU `ordinal`, opened here: a clear error where there is no GPU.
pub fn tune_missing_on(ordinal: usize, config: &ModelConfig, progress: &Progress) -> Result<TuneSummary> {
    let gpu = Gpu::open(ordinal).map_err(|e| tune_error_no_gpu(&e))?;
    tune_missing(&gpu, config, progress)
}

fn tune_error_no_gpu(e: &RuntimeError) -> EngineError {
    EngineError::Backend {
        backend: "cuda".into(),
        reason: format!("cannot tune kernels without a GPU: {e}"),
    }
}

/// Every verify length up to this one is timed by `autotune --verify-cost` ([`VERIFY_SIZES`]).
pub const VERIFY_DENSE_UP_TO: usize = 64;

/// The verify sizes `autotune --verify-cost` times ([`measure_verify_cost`]): every length
/// 1..=[`VERIFY_DENSE_UP_TO`], then every 8th to 128 and every 16th to 256 (80 sizes). The
/// verify latency is a staircase (on the H200, Kimi K2.6 EP8 verifies 16 tokens in 22.7 ms and
/// 17 in 25.5 ms: a new 16-row tile), and [`CostModel::verify_us`] interpolates linearly between
/// points, so only points at every length show where the steps are; `auto`'s trees mostly stay
/// below 64 tokens, and above it the points sit on the 8- and 16-row tile edges. At 20-110 ms a
/// forward and 6 forwards a size (one untimed, the median of 5), the curve takes about a minute
/// on Kimi K2.6 EP8, each size's eager first forward and CUDA-graph recording included.
pub const VERIFY_SIZES: [usize; 80] = verify_sizes();

const fn verify_sizes() -> [usize; 80] {
    let mut sizes = [0; 80];
    let (mut i, mut n) = (0, 1);
    while i < sizes.len() {
        sizes[i] = n;
        n += if n < VERIFY_DENSE_UP_TO {
            1
        } else if n < 128 {
            8
        } else {
            16
        };
        i += 1;
    }
    sizes
}
/// Rows of random latent cache the verify forwards of [`measure_verify_cost`] attend to.
pub const VERIFY_CONTEXT: usize = 1024;
/// Untimed verify forwards per size before the timed ones.
const VERIFY_WARMUP: usize = 1;
/// Timed verify forwards per size (the median is kept).
const VERIFY_REPS: usize = 5;
/// The drafter forward per round of a measured cost model, as a fraction of the measured
/// one-token verify (the ratio of [`CostModel::fallback`]: a DFlash drafter has a few layers
/// against the target's dozens, and shares its embedding and head).
pub const DRAFT_FRACTION: f64 = 0.1;
/// The tree build per round, as a fraction of the one-token verify (as in the fallback).
pub const BUILD_FRACTION: f64 = 0.01;
/// The accept walk and cache compaction per round, as a fraction of the one-token verify (as
/// in the fallback).
pub const ACCEPT_FRACTION: f64 = 0.01;

/// A random tree of `n` nodes: node 0 the root, every other node's parent one of the nodes
/// before it, about half of them the previous node (chains with branches, as DDTree builds).
fn random_tree(n: usize, rng: &mut impl rand::Rng) -> Vec<i32> {
    (0..n)
        .map(|i| match i {
            0 => -1,
            _ if rng.random_bool(0.5) => (i - 1) as i32,
            _ => rng.random_range(0..i) as i32,
        })
        .collect()
}

/// What [`measure_verify_cost`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyMeasurement {
    /// The cost model: the medians' non-decreasing envelope
    /// ([`crate::spec::budget::monotone_envelope`]) and the per-round costs.
    pub cost: CostModel,
    /// The median latency at each size, as timed.
    pub medians: Vec<VerifyPoint>,
}

/// Times the target's verify forward on `model` at each of `sizes` tokens (sorted and
/// deduplicated; zero is skipped), reporting each size to `progress`, and returns a
/// [`CostModel`] with those points (made non-decreasing by [`CostModel::new`]) and the medians
/// as timed.
///
/// Each forward is a tree-masked verify ([`LogitRows::All`]) of random tokens in a random tree
/// ([`AncestorMask::from_parents`]) over a cache pre-filled with [`VERIFY_CONTEXT`] random rows
/// ([`Backend::kv_fill_random`]; fewer where the model's context is shorter); it ends with
/// [`Backend::argmax_rows`], which reads back and so synchronises, and the cache is truncated
/// back. After [`VERIFY_WARMUP`] untimed runs the median of [`VERIFY_REPS`] is kept. The
/// per-round draft, build and accept costs are not measured: they are [`DRAFT_FRACTION`],
/// [`BUILD_FRACTION`] and [`ACCEPT_FRACTION`] of the one-token verify.
pub fn measure_verify_cost<B: Backend>(
    model: &Model<B>,
    sizes: &[usize],
    progress: &Progress,
) -> Result<VerifyMeasurement> {
    use rand::{Rng, SeedableRng};
    let mut sizes: Vec<usize> = sizes.iter().copied().filter(|&n| n > 0).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let Some(&largest) = sizes.last() else {
        return Err(EngineError::Forward("measure_verify_cost: no verify sizes".into()));
    };
    let config = model.config();
    let max_position = config.max_position_embeddings;
    if largest >= max_position {
        return Err(EngineError::Forward(format!(
            "measure_verify_cost: {largest} tokens do not fit the model's context of {max_position}"
        )));
    }
    let context = VERIFY_CONTEXT.min(max_position - largest);
    let backend = model.backend();
    let mut cache = model.new_cache(context + largest)?;
    backend.kv_fill_random(&mut cache, context, 0x5eed)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x7e21f1);
    let vocab = config.vocab_size as u32;
    let mut points = Vec::with_capacity(sizes.len());
    progress.start(sizes.len());
    for (i, &n) in sizes.iter().enumerate() {
        progress.bar.set_message(format!("verify forward of {n} tokens"));
        let parents = random_tree(n, &mut rng);
        let mut depth = vec![0u32; n];
        for i in 1..n {
            depth[i] = depth[parents[i] as usize] + 1;
        }
        let mask = AncestorMask::from_parents(&parents)?;
        let positions: Vec<u32> = depth.iter().map(|d| context as u32 + d).collect();
        let mut times = Vec::with_capacity(VERIFY_REPS);
        for rep in 0..VERIFY_WARMUP + VERIFY_REPS {
            let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab)).collect();
            let t = Instant::now();
            model.forward_greedy(
                &mut cache,
                ForwardInput {
                    tokens: &tokens,
                    positions: &positions,
                    mask: Some(&mask),
                    logits: LogitRows::All,
                },
            )?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            backend.kv_truncate(&mut cache, context)?;
            if rep >= VERIFY_WARMUP {
                times.push(us);
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        points.push((n, median));
        progress.step_done(|| {
            format!(
                "[{}/{}] verify {n} tokens: {:.3} ms (median of {VERIFY_REPS})",
                i + 1,
                sizes.len(),
                median / 1e3
            )
        });
    }
    progress.bar.finish_and_clear();
    let one = points[0].1;
    let cost = CostModel::new(
        format!(
            "measured verify on {} ({} layers, hidden {}, {} routed experts), {context}-row cache, \
             non-decreasing envelope of the medians; draft/build/accept {}/{}/{}% of one verify",
            backend.name(),
            config.num_hidden_layers,
            config.hidden_size,
            config.moe.n_routed_experts,
            DRAFT_FRACTION * 100.0,
            BUILD_FRACTION * 100.0,
            ACCEPT_FRACTION * 100.0,
        ),
        one * DRAFT_FRACTION,
        one * BUILD_FRACTION,
        one * ACCEPT_FRACTION,
        &points,
    )?;
    Ok(VerifyMeasurement {
        cost,
        medians: points
            .into_iter()
            .map(|(tokens, us)| VerifyPoint { tokens, us })
            .collect(),
    })
}

/// A stable 16-hex-digit hash of what in `config` decides the verify latency (the layer
/// shapes, expert counts and routing, the quantization group; not the tokens, norms epsilons
/// or rope constants), for the verify-cost file name.
pub fn shape_hash(config: &ModelConfig) -> String {
    let c = config;
    let m = &c.moe;
    let shape = format!(
        "ddtree-verify-shape-v1 vocab={} hidden={} inter={} layers={} heads={} q_lora={:?} kv_lora={} \
         nope={} rope={} v={} interleave={} tied={} experts={} per_tok={} shared={} groups={} topk_groups={} \
         dense_layers={} moe_inter={} int4_group={:?}",
        c.vocab_size,
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.q_lora_rank,
        c.kv_lora_rank,
        c.qk_nope_head_dim,
        c.qk_rope_head_dim,
        c.v_head_dim,
        c.rope.interleave,
        c.tie_word_embeddings,
        m.n_routed_experts,
        m.num_experts_per_tok,
        m.n_shared_experts,
        m.n_group,
        m.topk_group,
        m.first_k_dense_replace,
        m.moe_intermediate_size,
        c.quantization.as_ref().map(|q| q.group_size),
    );
    // FNV-1a, 64 bits: stable across builds and platforms.
    let hash = shape.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{hash:016x}")
}

/// The verify-cost file of `config` on the GPU `fingerprint` in `dir`:
/// `<fingerprint id>.verify-<shape hash>.json`.
pub fn verify_cost_file_in(dir: &Path, fingerprint: &Fingerprint, config: &ModelConfig) -> PathBuf {
    dir.join(format!("{}.verify-{}.json", fingerprint.id(), shape_hash(config)))
}

/// [`verify_cost_file_in`] the tune cache folder ([`ddtree_runtime::cache_root`]`/tune`).
pub fn verify_cost_file(fingerprint: &Fingerprint, config: &ModelConfig) -> PathBuf {
    verify_cost_file_in(&ddtree_runtime::cache_root().join("tune"), fingerprint, config)
}

/// Reads a cost model from `path`: `None` when the file is absent; unreadable or invalid
/// files are logged and ignored.
pub fn load_verify_cost_from(path: &Path) -> Option<CostModel> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!("verify cost {} cannot be read ({e}); ignoring it", path.display());
            return None;
        }
    };
    CostModel::from_json(&text)
        .inspect_err(|e| tracing::warn!("verify cost {} is invalid ({e}); ignoring it", path.display()))
        .ok()
}

/// The stored verify cost of `config` on the GPU `fingerprint`, if `autotune --verify-cost`
/// measured one.
pub fn load_verify_cost(fingerprint: &Fingerprint, config: &ModelConfig) -> Option<CostModel> {
    load_verify_cost_from(&verify_cost_file(fingerprint, config))
}

/// Writes `cost` to `path` (creating the folder).
pub fn save_verify_cost_to(path: &Path, cost: &CostModel) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
    }
    let mut text = cost.to_json();
    text.push('\n');
    std::fs::write(path, text).map_err(|e| EngineError::io(path, e))
}

/// Stores `cost` for `config` on the GPU `fingerprint` next to the tune cache; returns the
/// file.
pub fn save_verify_cost(fingerprint: &Fingerprint, config: &ModelConfig, cost: &CostModel) -> Result<PathBuf> {
    let path = verify_cost_file(fingerprint, config);
    save_verify_cost_to(&path, cost)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(jobs: &[Box<dyn Job>]) -> Vec<String> {
        jobs.iter().map(|j| format!("{} {}", j.kernel(), j.key())).collect()
    }

    fn assert_unique(keys: &[String]) {
        let set: std::collections::HashSet<&String> = keys.iter().collect();
        assert_eq!(set.len(), keys.len(), "duplicate keys in {keys:?}");
    }

    #[test]
    fn kimi_plan_is_stable_and_deduplicated() {
        let d = ModelDims::kimi_k26();
        let k = keys(&plan(&d, 256));
        assert_unique(&k);
        assert_eq!(k, keys(&plan(&d, 256)));
        // 9 token counts; per M: 2 norms (hidden, q_lora_rank) and the embedding, the argmax from M = 32 on (the
        // split top-1 below is untuned); up to M = 16 the INT4 GEMV of the shared expert's
        // gate/up (7168->2048) and down (2048->7168): the dense MLP (18432 x 7168) runs the
        // INT4 GEMM; the tree builder at 2 depths x 11 budget buckets. No `gemm_bf16` (cuBLAS
        // serves the dense products) and no kernel the backend runs at a fixed variant.
        assert_eq!(k.len(), 9 * 3 + 4 + 5 * 2 + 2 * 11);
        assert!(!k
            .iter()
            .any(|k| k.starts_with("gemm_bf16") || k.starts_with("silu_mul")));
        assert!(!k.contains(&"row_topk rows=16 n=163840 k=1".to_string()), "{k:?}");
        assert!(
            k.contains(&"tree_build depth=7 vocab=163840 budget=64".to_string()),
            "{k:?}"
        );
        assert!(
            k.contains(&"tree_build depth=15 vocab=163840 budget=1024".to_string()),
            "{k:?}"
        );
        assert!(
            k.contains(&"w4a16_gemv dense tokens=16 n=2048 k=7168 group=32".to_string()),
            "{k:?}"
        );
        assert!(
            k.contains(&"w4a16_gemv dense tokens=1 n=7168 k=2048 group=32".to_string()),
            "{k:?}"
        );
        assert_eq!(k[0], "rms_norm rows=1 n=7168");
        // max_m rounds down to the powers of two it covers.
        assert_eq!(plan(&d, 300).len(), plan(&d, 256).len());
        let s = keys(&startup_plan(&d));
        assert_unique(&s);
        assert_eq!(s.len(), 10 * 3 + 5);
        assert!(s
            .iter()
            .all(|k| ["rms_norm", "embedding", "row_topk"].iter().any(|p| k.starts_with(p))));
        let gemv: Vec<String> = k.iter().filter(|k| k.starts_with("w4a16_gemv")).cloned().collect();
        let want: Vec<String> = [1, 2, 4, 8, 16]
            .iter()
            .flat_map(|t| {
                [
                    format!("w4a16_gemv dense tokens={t} n=2048 k=7168 group=32"),
                    format!("w4a16_gemv dense tokens={t} n=7168 k=2048 group=32"),
                ]
            })
            .collect();
        assert_eq!(gemv, want);
        // A dense checkpoint has no INT4 linears.
        let dense = ModelDims {
            int4_group: None,
            ..d.clone()
        };
        assert!(keys(&plan(&dense, 256)).iter().all(|k| !k.starts_with("w4a16_gemv")));
        assert!(s.contains(&"row_topk rows=512 n=163840 k=1".to_string()), "{s:?}");
        // Every startup key is also one autotune tunes (up to its M).
        let full = keys(&plan(&d, STARTUP_MAX_M));
        assert!(s.iter().all(|k| full.contains(k)));
    }

    #[test]
    fn tiny_plan_is_stable_and_deduplicated() {
        let c = crate::tiny::kimi::config().unwrap();
        let d = ModelDims::from_config("tiny".into(), &c);
        let k = keys(&plan(&d, 8));
        assert_unique(&k);
        assert_eq!(k, keys(&plan(&d, 8)));
        assert!(!k.is_empty());
        let s = keys(&startup_plan(&d));
        assert_unique(&s);
        assert_eq!(s, keys(&startup_plan(&d)));
        // hidden, kv latent and q latent norms and the embedding per M, M = 1 .. 512; the argmax
        // from M = 32 on.
        assert_eq!(s.len(), 10 * (d.norms().len() + 1) + 5);
        assert_eq!(s[0], format!("rms_norm rows=1 n={}", c.hidden_size));
        // autotune's plan: the INT4 GEMV of the shared experts' and the dense MLP's 4 shapes up
        // to M = 8 here.
        let (h, i, sh) = (c.hidden_size, c.intermediate_size, c.moe.moe_intermediate_size);
        let g = d.int4_group.expect("the tiny Kimi is INT4");
        for key in [
            format!("w4a16_gemv dense tokens=1 n={sh} k={h} group={g}"),
            format!("w4a16_gemv dense tokens=8 n={i} k={h} group={g}"),
            format!("w4a16_gemv dense tokens=2 n={h} k={i} group={g}"),
        ] {
            assert!(k.contains(&key), "{key}: {k:?}");
        }
        assert!(!k.iter().any(|key| key.contains("tokens=16")), "{k:?}");
    }

    #[test]
    fn tune_missing_without_a_gpu_is_a_clear_error() {
        if ddtree_runtime::driver_available() {
            eprintln!("SKIP: a CUDA driver is present; this test checks the no-GPU message");
            return;
        }
        let c = crate::tiny::kimi::config().unwrap();
        let err = tune_missing_on(0, &c, &Progress::silent()).unwrap_err().to_string();
        assert!(err.contains("without a GPU") && err.contains("no CUDA driver"), "{err}");
    }

    fn fingerprint() -> Fingerprint {
        Fingerprint {
            name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            sm_count: 132,
            memory_bytes: 150_000_000_000,
            driver_version: 13000,
            nvrtc_version: Some((13, 0)),
        }
    }

    #[test]
    fn shape_hash_is_stable_and_follows_the_shapes() {
        let tiny = crate::tiny::kimi::config().unwrap();
        assert_eq!(shape_hash(&tiny), shape_hash(&tiny.clone()));
        assert_eq!(shape_hash(&tiny).len(), 16);
        // A pinned value: the file names must not change between builds.
        assert_eq!(shape_hash(&tiny), "5977e3cad7cf9661");
        let mut eos = tiny.clone();
        eos.eos_token_ids.push(7);
        assert_eq!(shape_hash(&eos), shape_hash(&tiny), "tokens do not change the shapes");
        let mut deeper = tiny.clone();
        deeper.num_hidden_layers += 1;
        assert_ne!(shape_hash(&deeper), shape_hash(&tiny));
        let kimi = crate::bench::Preset::KimiK26Ep8.config().unwrap();
        assert_ne!(shape_hash(&kimi), shape_hash(&tiny));
    }

    #[test]
    fn verify_cost_file_round_trips() {
        let dir = std::env::temp_dir().join(format!("ddtree-verify-cost-{}", std::process::id()));
        let config = crate::tiny::kimi::config().unwrap();
        let path = verify_cost_file_in(&dir, &fingerprint(), &config);
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        assert!(
            name.starts_with(&fingerprint().id()) && name.ends_with(&format!(".verify-{}.json", shape_hash(&config))),
            "{name}"
        );
        assert_eq!(load_verify_cost_from(&path), None);
        let cost = CostModel::new("test", 100.0, 10.0, 10.0, &[(1, 1000.0), (8, 1100.0), (64, 2000.0)]).unwrap();
        save_verify_cost_to(&path, &cost).unwrap();
        assert_eq!(load_verify_cost_from(&path), Some(cost));
        std::fs::write(&path, "{\"source\": \"x\"}").unwrap();
        assert_eq!(load_verify_cost_from(&path), None, "an invalid file is ignored");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn verify_cost_measured_on_the_cpu_is_valid() {
        let model = Model::random(
            crate::CpuBackend::default(),
            crate::tiny::kimi::config().unwrap(),
            3,
            &mut |_, _| {},
        )
        .unwrap();
        let m = measure_verify_cost(&model, &[4, 1, 2, 2, 0], &Progress::silent()).unwrap();
        let cost = &m.cost;
        cost.validate().unwrap();
        let tokens: Vec<usize> = cost.verify.iter().map(|p| p.tokens).collect();
        assert_eq!(tokens, [1, 2, 4]);
        assert_eq!(m.medians.iter().map(|p| p.tokens).collect::<Vec<_>>(), tokens);
        assert!(cost.verify.iter().all(|p| p.us > 0.0));
        assert!(cost.verify.windows(2).all(|w| w[0].us <= w[1].us), "{cost:?}");
        // The model is the medians' envelope: each point the least median at its size or above.
        for (i, p) in cost.verify.iter().enumerate() {
            let least = m.medians[i..].iter().map(|q| q.us).fold(f64::INFINITY, f64::min);
            assert_eq!(p.us, least);
        }
        assert!(cost.draft_us > 0.0 && cost.source.contains("cpu"), "{cost:?}");
        assert!(measure_verify_cost(&model, &[], &Progress::silent()).is_err());
    }

    #[test]
    fn verify_sizes_are_dense_where_the_steps_matter() {
        assert!(VERIFY_SIZES.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(
            VERIFY_SIZES[..VERIFY_DENSE_UP_TO],
            *(1..=VERIFY_DENSE_UP_TO).collect::<Vec<_>>()
        );
        let rest: Vec<usize> = (72..=128).step_by(8).chain((144..=256).step_by(16)).collect();
        assert_eq!(VERIFY_SIZES[VERIFY_DENSE_UP_TO..], *rest);
        assert_eq!(
            *VERIFY_SIZES.last().unwrap(),
            crate::spec::AUTO_MAX_BUDGET,
            "the curve reaches the largest auto tree (its root's token is extrapolated)"
        );
    }

    #[test]
    fn summary_line_only_when_something_was_tuned() {
        let mut s = TuneSummary {
            keys: 50,
            tuned: 0,
            errors: Vec::new(),
            time: Duration::from_millis(2500),
            cache: PathBuf::from("/c/tune/x.json"),
        };
        assert_eq!(s.line(), None);
        s.tuned = 12;
        assert_eq!(
            s.line().unwrap(),
            "tuned 12 of 50 kernel keys in 2.5 s; tune cache: /c/tune/x.json"
        );
    }
}
