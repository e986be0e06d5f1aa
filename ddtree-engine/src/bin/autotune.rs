//! `autotune`: tunes every kernel variant the engine will launch for a model on this GPU and
//! stores the winners in the per-GPU tune cache, which the engine reads at startup.
//!
//! ```text
//! autotune [--model DIR | --preset kimi-k2.6] [--kernels PATTERN] [--force]
//! autotune --preset kimi-k2.6 --compile-report   # NVRTC time per variant, cold vs warm cache
//! autotune --preset kimi-k2.6 --startup          # warm startup to the first launch
//! autotune --preset kimi-k2.6-ep8 --verify-cost   # verify latency by tree size, for --budget auto
//! ```
//!
//! The problem keys come from the model's dimensions (hidden size, vocab, MLA ranks and head
//! dims, dense and shared-expert MLP widths) for the kernels that exist, with the token count M
//! in powers of two up to `--max-m`. A re-run with a warm cache measures nothing and only
//! prints the table. Caches live under `$DDTREE_CACHE_DIR` (default `~/.cache/ddtree`).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use ddtree_engine::tuning::{self, plan, precompile, tune_jobs, Job, ModelDims, Progress};
use ddtree_engine::{bench, CudaBackend, CudaOptions, Model, ModelConfig};
use ddtree_kernels::tune::RowsKey;
use ddtree_kernels::RmsNorm;
use ddtree_runtime::{
    CubinCache, DevicePool, Gpu, Jit, KernelSource, Roofline, RuntimeError, TrialStatus, Tunable, TuneCache,
    TuneOptions, Tuned, TunedKernels, Tuner,
};
use indicatif::ProgressBar;

#[derive(Parser)]
#[command(about = "Tune the GPU kernel variants a model needs and store the winners in the per-GPU tune cache")]
struct Args {
    /// Model folder with config.json (DeepSeek-V3 / Kimi K2.x).
    #[arg(long, conflicts_with = "preset")]
    model: Option<PathBuf>,
    /// Built-in model dimensions: kimi-k2.6, or a `ddtree bench` preset (kimi-k2.6-ep8, tiny).
    #[arg(long)]
    preset: Option<String>,
    /// Only kernels whose name contains one of these comma-separated substrings.
    #[arg(long)]
    kernels: Option<String>,
    /// Largest token count M (rounded up to a power of two); keys use M = 1, 2, 4, ...
    #[arg(long, default_value_t = 256)]
    max_m: usize,
    /// Re-measure keys that already have a valid entry.
    #[arg(long)]
    force: bool,
    /// Timed launches per candidate (the median is kept).
    #[arg(long, default_value_t = 25)]
    reps: usize,
    /// Print the problem keys and exit (no GPU needed).
    #[arg(long)]
    list: bool,
    /// Expert-parallel ranks the routed experts are spread over (the MoE keys are for one
    /// rank's share); default 8 for kimi-k2.6, else 1.
    #[arg(long)]
    expert_ranks: Option<usize>,
    /// Longest context the verify attention's keys cover (their length buckets go up to it);
    /// default the model's `max_position_embeddings`.
    #[arg(long)]
    max_context: Option<usize>,
    /// Compile every candidate variant one by one with NVRTC into an empty cache and again from
    /// it, printing the time of each (no GPU needed; arch from the GPU, else sm_90a).
    #[arg(long)]
    compile_report: bool,
    /// Measure a warm startup: open the GPU, load the tune cache, load every tuned variant of
    /// the keys (from the compile cache), launch one kernel.
    #[arg(long)]
    startup: bool,
    /// Measure the target's verify latency at every tree length 1..=64 tokens, then every 8th
    /// to 128 and every 16th to 256, on a model of random weights (no files needed) on the CUDA
    /// backend, and store it next to the tune cache as the cost model `ddtree generate --budget
    /// auto` uses on this GPU for this model shape.
    /// Needs --model DIR or --preset kimi-k2.6-ep8|tiny (the full kimi-k2.6 does not fit one GPU).
    #[arg(long)]
    verify_cost: bool,
}

fn selected(jobs: Vec<Box<dyn Job>>, pattern: Option<&str>) -> Vec<Box<dyn Job>> {
    let Some(pattern) = pattern else { return jobs };
    let parts: Vec<&str> = pattern.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    jobs.into_iter()
        .filter(|j| parts.iter().any(|p| j.kernel().contains(p)))
        .collect()
}

fn dims(args: &Args) -> Result<ModelDims, String> {
    match (&args.model, args.preset.as_deref()) {
        (Some(dir), _) => {
            let path = if dir.is_dir() {
                dir.join("config.json")
            } else {
                dir.clone()
            };
            let cfg = ModelConfig::from_file(&path).map_err(|e| e.to_string())?;
            Ok(ModelDims::from_config(dir.display().to_string(), &cfg))
        }
        (None, Some("kimi-k2.6") | None) => Ok(ModelDims::kimi_k26()),
        (None, Some(other)) => match bench::Preset::parse(other) {
            Ok(p) => Ok(ModelDims::from_config(
                p.name().to_string(),
                &p.config().map_err(|e| e.to_string())?,
            )),
            Err(_) => Err(format!(
                "unknown preset `{other}` (known: kimi-k2.6, kimi-k2.6-ep8, tiny)"
            )),
        },
    }
}

/// Log lines go above the progress bar instead of through it.
#[derive(Clone)]
struct BarWriter(ProgressBar);

impl Write for BarWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.suspend(|| std::io::stderr().write_all(buf))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

fn init_logging(bar: &ProgressBar) {
    let bar = bar.clone();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(move || BarWriter(bar.clone()))
        .init();
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("-".to_string(), |v| format!("{v:.digits$}"))
}

/// NVRTC time per variant: into an empty cache (cold), then from it (warm).
fn compile_report(jobs: &[Box<dyn Job>]) -> Result<(), RuntimeError> {
    let arch = Gpu::open(0).map(|g| g.arch()).unwrap_or_else(|_| "sm_90a".to_string());
    let dir = std::env::temp_dir().join(format!("ddtree-compile-report-{}", std::process::id()));
    let jit = Jit::new(arch.clone(), Some(CubinCache::new(&dir)));
    let mut sources: Vec<KernelSource> = jobs.iter().flat_map(|j| j.sources()).collect();
    sources.sort_by(|a, b| a.symbol.cmp(&b.symbol));
    sources.dedup_by(|a, b| a.symbol == b.symbol);
    let (nv_major, nv_minor) = jit.nvrtc_version().ok_or(RuntimeError::NoNvrtc)?;
    println!(
        "NVRTC {nv_major}.{nv_minor}, arch {arch}, {} variants, one at a time\n",
        sources.len()
    );
    println!("| variant | cold ms (NVRTC + cache write) | warm ms (cache read) | cubin KiB |");
    println!("|---|---:|---:|---:|");
    let (mut cold_total, mut warm_total) = (Duration::ZERO, Duration::ZERO);
    for s in &sources {
        let cold = jit.cubin(s)?;
        let warm = jit.cubin(s)?;
        assert!(!cold.cached && warm.cached, "the report's cache folder was fresh");
        cold_total += cold.time;
        warm_total += warm.time;
        println!(
            "| {} | {:.1} | {:.3} | {:.1} |",
            s.symbol,
            ms(cold.time),
            ms(warm.time),
            cold.bytes.len() as f64 / 1024.0
        );
    }
    println!("| total (serial) | {:.0} | {:.1} | |", ms(cold_total), ms(warm_total));
    std::fs::remove_dir_all(&dir).map_err(|e| RuntimeError::Io {
        context: "removing",
        path: dir.clone(),
        source: e,
    })?;
    let par = Instant::now();
    let results = jit.cubins(&sources);
    let cold_par = par.elapsed();
    let failed = results.iter().filter(|r| r.is_err()).count();
    println!(
        "\nparallel cold compile of all {} variants on {} threads: {:.0} ms ({failed} failed)",
        sources.len(),
        threads(),
        ms(cold_par)
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Warm startup: from process start to the first kernel launch finished.
fn startup(process_start: Instant, jobs: &[Box<dyn Job>]) -> Result<(), RuntimeError> {
    let t = Instant::now();
    let gpu = Gpu::open(0)?;
    let open = t.elapsed();
    let t = Instant::now();
    let kernels = TunedKernels::new(gpu.clone());
    let load = t.elapsed();
    let t = Instant::now();
    for j in jobs {
        j.preload(&kernels)?;
    }
    let preload = t.elapsed();
    let t = Instant::now();
    let key = RowsKey { rows: 1, n: 7168 };
    let k = kernels.get::<RmsNorm>(&key)?;
    let mut w = RmsNorm::workload(&gpu, &mut DevicePool::new(usize::MAX), &key, 1, 1)?;
    let inputs = t.elapsed();
    let t = Instant::now();
    RmsNorm::run(&gpu, &k, &mut w, 0)?;
    gpu.stream().synchronize().map_err(|e| RuntimeError::Driver {
        context: "synchronizing".into(),
        source: e,
    })?;
    let launch = t.elapsed();
    let tuned = kernels.cache().entries().len();
    println!(
        "warm startup ({} keys, {tuned} tune entries, {} tune cache):",
        jobs.len(),
        kernels.cache().path().display()
    );
    println!("  open GPU (driver init, context, stream): {:8.1} ms", ms(open));
    println!("  load tune cache:                          {:8.1} ms", ms(load));
    println!(
        "  load the tuned variant of every key:      {:8.1} ms (compile cache reads + module loads)",
        ms(preload)
    );
    println!("  first-launch inputs (rms_norm 1 x 7168):  {:8.1} ms", ms(inputs));
    println!("  first launch + synchronize:               {:8.1} ms", ms(launch));
    println!(
        "  process start to first launch done:       {:8.1} ms",
        ms(process_start.elapsed())
    );
    Ok(())
}

/// The full model configuration `--verify-cost` builds (random weights) and hashes.
fn verify_config(args: &Args) -> Result<ModelConfig, String> {
    match (&args.model, args.preset.as_deref()) {
        (Some(dir), _) => {
            let path = if dir.is_dir() {
                dir.join("config.json")
            } else {
                dir.clone()
            };
            ModelConfig::from_file(&path).map_err(|e| e.to_string())
        }
        (None, Some(name)) if name != "kimi-k2.6" => bench::Preset::parse(name)
            .and_then(|p| p.config())
            .map_err(|e| e.to_string()),
        _ => Err(
            "--verify-cost builds the whole model on one GPU: pass --model DIR or --preset \
                  kimi-k2.6-ep8 (one GPU's share of kimi-k2.6; the full model does not fit) or tiny"
                .into(),
        ),
    }
}

/// `--verify-cost`: tune what is missing, build the model with random weights on the CUDA
/// backend, time its verify forwards and store the cost model.
fn verify_cost(args: &Args, bar: ProgressBar) -> Result<bool, String> {
    let config = verify_config(args)?;
    let gpu = Gpu::discover(0).map_err(|e| format!("{e}; --verify-cost needs a GPU"))?;
    let progress = Progress::with_bar(bar);
    let summary = tuning::tune_missing(&gpu, &config, &progress).map_err(|e| e.to_string())?;
    if let Some(line) = summary.line() {
        println!("{line}");
    }
    let fingerprint = gpu.fingerprint().clone();
    let backend = CudaBackend::new(gpu, CudaOptions::default()).map_err(|e| e.to_string())?;
    let t = Instant::now();
    let model = Model::random(backend, config.clone(), 0, &mut |_, _| {}).map_err(|e| e.to_string())?;
    println!(
        "{:.1} B random parameters in {:.1} s; timing verify forwards at {} sizes: every length 1..={}, \
         then every 8th to 128 and every 16th to {}",
        model.parameter_count() as f64 / 1e9,
        t.elapsed().as_secs_f64(),
        tuning::VERIFY_SIZES.len(),
        tuning::VERIFY_DENSE_UP_TO,
        tuning::VERIFY_SIZES[tuning::VERIFY_SIZES.len() - 1],
    );
    let measured = tuning::measure_verify_cost(&model, &tuning::VERIFY_SIZES, &progress).map_err(|e| e.to_string())?;
    let cost = &measured.cost;
    // The model column is the medians' non-decreasing envelope: it differs where a larger size
    // timed faster.
    println!("\n| tokens | median ms | model ms |\n|---:|---:|---:|");
    for (m, p) in measured.medians.iter().zip(&cost.verify) {
        println!("| {} | {:.3} | {:.3} |", m.tokens, m.us / 1e3, p.us / 1e3);
    }
    let path = tuning::save_verify_cost(&fingerprint, &config, cost).map_err(|e| e.to_string())?;
    println!("\n{}\nverify cost stored: {}", cost.source, path.display());
    Ok(true)
}

fn run(args: &Args, process_start: Instant) -> Result<bool, String> {
    if args.verify_cost {
        let bar = ProgressBar::hidden();
        init_logging(&bar);
        return verify_cost(args, bar);
    }
    let mut d = dims(args)?;
    if let Some(r) = args.expert_ranks {
        d = d.with_expert_ranks(r);
    }
    if let Some(c) = args.max_context {
        d.max_context = c;
    }
    let jobs = selected(plan(&d, args.max_m), args.kernels.as_deref());
    if jobs.is_empty() {
        return Err(format!("no kernel matches `{}`", args.kernels.as_deref().unwrap_or("")));
    }
    if args.list {
        for j in &jobs {
            println!("{} {}", j.kernel(), j.key());
        }
        return Ok(true);
    }
    let bar = ProgressBar::hidden();
    init_logging(&bar);
    if args.compile_report {
        return compile_report(&jobs).map(|()| true).map_err(|e| e.to_string());
    }
    if args.startup {
        return startup(process_start, &jobs).map(|()| true).map_err(|e| e.to_string());
    }
    let start = Instant::now();
    let gpu = Gpu::discover(0).map_err(|e| format!("{e}; autotune needs a GPU"))?;
    // As in the engine: no per-buffer event tracking, so that kernels of a few microseconds
    // are timed from CUDA graphs (`Tunable::runs_per_sample`).
    // SAFETY: every buffer of the tuner lives on the GPU's one stream.
    unsafe { gpu.context().disable_event_tracking() };
    // The plan of this GPU: the fused GEMVs' kernels follow its SM count, the INT4 GEMM keys
    // its `wgmma` (the listed plan assumes an H100/H200).
    let fp = gpu.fingerprint();
    let d = d.on_gpu(
        fp.sm_count as usize,
        ddtree_kernels::wgmma_supported(fp.compute_capability),
    );
    let jobs = selected(plan(&d, args.max_m), args.kernels.as_deref());
    let cache = TuneCache::open(gpu.fingerprint());
    let cache_path = cache.path().to_path_buf();
    let mut tuner = Tuner::new(
        &gpu,
        cache,
        TuneOptions {
            force: args.force,
            reps: args.reps,
            ..Default::default()
        },
    );
    let todo: Vec<&dyn Job> = jobs.iter().map(|j| j.as_ref()).filter(|j| !j.cached(&tuner)).collect();
    println!(
        "{}: {} keys for {} on {}; {} cached, {} to tune",
        d.name,
        jobs.len(),
        d.name,
        gpu.fingerprint(),
        jobs.len() - todo.len(),
        todo.len()
    );
    if !todo.is_empty() {
        let c = precompile(&gpu, &todo);
        println!(
            "compiled {} variants in {:.2} s ({} from the compile cache, {} failed)",
            c.variants,
            c.time.as_secs_f64(),
            c.from_cache,
            c.failed
        );
        let r = Roofline::measure(&gpu).map_err(|e| e.to_string())?;
        println!(
            "roofline: copy bandwidth {:.0} GB/s, bf16 tensor estimate {:.0} TFLOP/s",
            r.bytes_per_s / 1e9,
            r.flops_per_s / 1e12
        );
        tuner.options_mut().roofline = Some(r);
    }
    // A bar on a terminal; in a log (stderr not a terminal) one plain line per finished key.
    let run = tune_jobs(&mut tuner, &jobs, &Progress::with_bar(bar));
    let (rows, errors) = (run.rows, run.errors);
    print_table(&rows);
    for e in &errors {
        println!("ERROR {e}");
    }
    let measured = rows.iter().filter(|r| !r.from_cache).count();
    println!(
        "\n{} keys ({measured} measured, {} from the tune cache) in {:.1} s; tune cache: {}",
        rows.len(),
        rows.len() - measured,
        start.elapsed().as_secs_f64(),
        cache_path.display()
    );
    Ok(errors.is_empty())
}

fn print_table(rows: &[Tuned]) {
    println!("\n| kernel | key | winner | µs | default µs | vs default | GB/s | TFLOP/s | % of floor |");
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|");
    for t in rows {
        let e = &t.entry;
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            e.kernel,
            e.key,
            e.winner.as_deref().unwrap_or("NONE PASSED"),
            opt(e.winner_us, 2),
            opt(e.default_us, 2),
            e.speedup().map_or("-".to_string(), |x| format!("{x:.2}x")),
            opt(e.gbps, 0),
            if e.flops > 0.0 { opt(e.tflops, 1) } else { "-".into() },
            opt(e.percent_of_floor(), 0)
        );
    }
    let rejected: Vec<String> = rows
        .iter()
        .flat_map(|t| t.entry.trials.iter().map(move |tr| (t, tr)))
        .filter(|(_, tr)| tr.status != TrialStatus::Ok)
        .map(|(t, tr)| {
            format!(
                "{:?} {} at {}: {}",
                tr.status,
                tr.variant,
                t.entry.key,
                tr.detail.as_deref().unwrap_or("").lines().next().unwrap_or("")
            )
        })
        .collect();
    if !rejected.is_empty() {
        println!("\n{} candidate runs rejected (never chosen):", rejected.len());
        for r in rejected {
            println!("  {r}");
        }
    }
}

fn main() -> ExitCode {
    let process_start = Instant::now();
    let args = Args::parse();
    match run(&args, process_start) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ddtree_engine::tuning::{job, progress_line};
    use ddtree_kernels::tune::GemmKey;
    use ddtree_kernels::GemmBf16;
    use ddtree_runtime::{Trial, TuneEntry, TuneTimes};

    use super::*;

    fn tuned(winner: Option<(&str, f64)>, from_cache: bool) -> Tuned {
        let trial = |variant: &str, us: Option<f64>, status| Trial {
            variant: variant.into(),
            us,
            status,
            detail: None,
        };
        Tuned {
            entry: TuneEntry {
                kernel: "gemm_bf16".into(),
                key: "m=64 n=7168 k=2048".into(),
                source_hash: "h".into(),
                winner: winner.map(|(w, _)| w.to_string()),
                winner_us: winner.map(|(_, us)| us),
                default: "d".into(),
                default_us: Some(45.0),
                bytes: 1.0,
                flops: 1.0,
                gbps: None,
                tflops: None,
                floor_us: None,
                trials: vec![
                    trial("d", Some(45.0), TrialStatus::Ok),
                    trial("w", Some(41.2), TrialStatus::Ok),
                    trial("x", None, TrialStatus::Wrong),
                ],
            },
            from_cache,
            times: TuneTimes {
                compile: Duration::from_millis(10),
                inputs: Duration::from_millis(20),
                checks: Duration::from_millis(250),
                timing: Duration::from_millis(30),
            },
        }
    }

    #[test]
    fn progress_lines_name_the_key_winner_default_and_time() {
        let job = job::<GemmBf16>(GemmKey {
            m: 40,
            n: 7168,
            k: 2048,
        });
        assert_eq!(
            progress_line(12, 180, job.as_ref(), &Ok(tuned(Some(("w", 41.2)), false))),
            "[12/180] gemm_bf16 m=64 n=7168 k=2048: winner w 41.20 µs (default 45.00 µs), 1 rejected, \
             in 0.31 s (compile 0.01, inputs 0.02, checks 0.25, timing 0.03)"
        );
        assert_eq!(
            progress_line(1, 2, job.as_ref(), &Ok(tuned(None, true))),
            "[1/2] gemm_bf16 m=64 n=7168 k=2048: NONE PASSED (default 45.00 µs), 1 rejected, cached"
        );
        assert_eq!(
            progress_line(2, 2, job.as_ref(), &Err(RuntimeError::NoDriver)),
            format!("[2/2] gemm_bf16 m=64 n=7168 k=2048: ERROR {}", RuntimeError::NoDriver)
        );
    }
}
