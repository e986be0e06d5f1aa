//! Tuning jobs and their runner: [`Job`] (one (kernel, key) of any [`Tunable`] kernel,
//! type-erased), [`tune_jobs`] with its [`Progress`] and log lines, [`precompile`], and
//! [`tune_missing`] (the startup tuning of the `ddtree` CLI).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ddtree_runtime::{
    Gpu, KernelSource, Roofline, RuntimeError, TrialStatus, Tunable, TuneCache, TuneOptions, Tuned, TunedKernels, Tuner,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::{startup_plan, ModelDims};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};

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

/// Where tuning reports progress.
pub struct Progress {
    pub(super) bar: ProgressBar,
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
    pub(super) fn start(&self, len: usize) {
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
    pub(super) fn step_done(&self, line: impl FnOnce() -> String) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
