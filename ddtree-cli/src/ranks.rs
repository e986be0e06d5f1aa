//! The multi-rank paths of `ddtree generate` and `ddtree bench`: CPU ranks, GPUs (one thread
//! each, NCCL), one virtual rank; the GPU layout and memory check.

use super::*;

/// On CUDA: picks the layout (`--gpus`; at most the GPUs present) and refuses what does not fit
/// one GPU's memory by the estimate.
pub(crate) fn check_gpus(
    b: &CudaBackend,
    par: &parallel::ParallelArgs,
    estimate: impl Fn(ParallelSpec) -> Result<ddtree_engine::parallel::MemoryEstimate, EngineError>,
) -> Result<ParallelSpec, EngineError> {
    let memory = b.gpu().fingerprint().memory_bytes as u64;
    let devices = ddtree_runtime::cudarc::driver::CudaContext::device_count().map_or(1, |n| n.max(1) as usize);
    let spec = par.gpu_spec(devices, memory, &estimate)?;
    if spec.world > devices {
        return Err(EngineError::Parallel {
            argument: "--gpus".into(),
            reason: format!("{} GPUs asked, {devices} present", spec.world),
        });
    }
    let name = format!("GPU 0 ({})", b.gpu().fingerprint().name);
    estimate(spec)?.check(&name, memory, 1, "split it over more GPUs (--gpus, see `ddtree plan`)")?;
    Ok(spec)
}

/// `generate` on CPU ranks: every rank loads its shard and runs the same generation; rank 0's
/// output is printed after checking that every rank emitted the same tokens.
pub(crate) fn generate_ranks(backend: CpuBackend, args: &GenerateArgs, plan: ParallelPlan) -> Result<(), EngineError> {
    let world = plan.spec.world;
    let runs = run_cpu_ranks(std::sync::Arc::new(plan), |rank| rank_run(backend, args, rank))?;
    report_ranks(args, &format!("cpu x{world} ranks"), world, runs)
}

/// `generate` on GPUs `0..N` of this node, one rank each (NCCL); as [`generate_ranks`].
pub(crate) fn generate_gpu_ranks(args: &GenerateArgs, plan: ParallelPlan) -> Result<(), EngineError> {
    let world = plan.spec.world;
    let options = cuda_options(&args.dev);
    let runs = ddtree_engine::parallel::cuda::run_cuda_ranks(std::sync::Arc::new(plan), options, |backend, rank| {
        rank_run(backend, args, rank)
    })?;
    report_ranks(args, &format!("cuda x{world} GPUs"), world, runs)
}

/// What one rank of a multi-rank `generate` hands back.
pub(crate) type RankRun = (
    String,
    Vec<u32>,
    Generation,
    Option<SpecStats>,
    Duration,
    Option<String>,
    ddtree_engine::parallel::CommStats,
);

/// One rank's generation.
pub(crate) fn rank_run<B: Backend + 'static>(
    backend: B,
    args: &GenerateArgs,
    rank: RankContext<B>,
) -> Result<RankRun, EngineError> {
    let r = run(backend, args, None, Some(rank))?;
    let text = match &r.loaded.tokenizer {
        Some(t) => Some(t.decode(&r.out.tokens)?),
        None => None,
    };
    let comm = r.loaded.model.rank().map(|c| c.comm.stats()).unwrap_or_default();
    Ok((r.loaded.name, r.prompt, r.out, r.stats, r.load_time, text, comm))
}

/// Checks that every rank emitted rank 0's tokens and prints rank 0's report.
pub(crate) fn report_ranks(
    args: &GenerateArgs,
    device: &str,
    world: usize,
    runs: Vec<RankRun>,
) -> Result<(), EngineError> {
    if let Some(i) = runs.iter().position(|r| r.2.tokens != runs[0].2.tokens) {
        return Err(EngineError::Comm {
            op: "generate".into(),
            rank: i,
            reason: format!("rank {i} emitted other tokens than rank 0 (the ranks diverged)"),
        });
    }
    let (name, prompt, out, stats, load, text, comm) = runs.into_iter().next().expect("at least one rank");
    if args.json {
        let mut report = generation_json(&name, device, prompt.len(), &out, stats.as_ref(), text, load);
        report["ranks"] = json!({"world": world, "collectives": comm.calls, "collective_ms": millis(comm.time)});
        println!("{report}");
    } else {
        print_human_named(&name, device, &prompt, &out, stats.as_ref(), text, load);
        println!(
            "ranks: {world}; rank 0 ran {} collectives, {:.2} ms in them",
            comm.calls,
            millis(comm.time)
        );
    }
    Ok(())
}

/// `bench` on CPU ranks: every rank makes its random shard and runs the benchmark; rank 0's
/// report is printed, with its time in collectives.
pub(crate) fn bench_ranks(
    backend: CpuBackend,
    args: &BenchArgs,
    preset: bench::Preset,
    opts: &bench::BenchOptions,
    config: ModelConfig,
    spec: ParallelSpec,
) -> Result<(), EngineError> {
    let plan = std::sync::Arc::new(ParallelPlan::new(&config, spec)?);
    let start = Instant::now();
    let reports = run_cpu_ranks(plan, |rank| bench_rank(backend, rank, preset, opts, &config, None))?;
    print_rank_bench(args, reports, spec, "CPU", start)
}

/// `bench --virtual-rank R`: rank R's share of the plan alone on this device (memory checked
/// against this one device), collectives that move nothing, the rank's bytes as the floor.
pub(crate) fn bench_virtual_rank<B: Backend + 'static>(
    backend: B,
    args: &BenchArgs,
    preset: bench::Preset,
    mut opts: bench::BenchOptions,
    config: ModelConfig,
    rank: usize,
    copy_gb_per_s: Option<f64>,
) -> Result<(), EngineError> {
    let spec = args.par.virtual_spec(rank)?;
    let plan = std::sync::Arc::new(ParallelPlan::new(&config, spec)?);
    let any = &backend as &dyn std::any::Any;
    let hint = "pick a larger --gpus (see `ddtree plan`)";
    if let Some(cuda) = any.downcast_ref::<CudaBackend>() {
        let name = format!("GPU 0 ({})", cuda.gpu().fingerprint().name);
        let memory = cuda.gpu().fingerprint().memory_bytes as u64;
        parallel::bench_estimate(&config, spec, &opts, Storage::Gpu)?.check(&name, memory, 1, hint)?;
    } else {
        let host = ddtree_engine::parallel::memory::host_available()?;
        parallel::bench_estimate(&config, spec, &opts, Storage::Cpu)?.check("the CPU host", host, 1, hint)?;
    }
    opts.rank = Some((plan.clone(), rank));
    let context = RankContext {
        plan,
        rank,
        comm: Box::new(ddtree_engine::parallel::virtual_rank::VirtualComm {
            rank,
            world: spec.world,
        }),
    };
    let start = Instant::now();
    let model = Model::random_rank(backend, config, opts.seed, context, &mut |_, _| {})?;
    eprintln!(
        "{}: rank {rank} of {} (TP {}, EP {}) alone on {}: made in {:.1} s",
        preset.name(),
        spec.world,
        spec.tp,
        spec.ep,
        model.backend().name(),
        start.elapsed().as_secs_f64()
    );
    let report = bench::run(&model, preset, &opts, copy_gb_per_s, &mut |line| eprintln!("{line}"))?;
    println!("{}", bench::render(&report));
    println!(
        "virtual rank {rank} of {}: one rank's compute; collectives not run (bytes per token are the rank's)",
        spec.world
    );
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report).expect("the report serializes");
        std::fs::write(path, text).map_err(|e| EngineError::io(path, e))?;
    }
    Ok(())
}

/// One rank of a multi-rank bench: its random shard, the benchmark (rank 0 prints progress),
/// its time in collectives.
pub(crate) fn bench_rank<B: Backend>(
    backend: B,
    rank: RankContext<B>,
    preset: bench::Preset,
    opts: &bench::BenchOptions,
    config: &ModelConfig,
    copy_gb_per_s: Option<f64>,
) -> Result<(bench::BenchReport, ddtree_engine::parallel::CommStats), EngineError> {
    let r = rank.rank;
    let model = Model::random_rank(backend, config.clone(), opts.seed, rank, &mut |_, _| {})?;
    let report = bench::run(&model, preset, opts, copy_gb_per_s, &mut |line| {
        if r == 0 {
            eprintln!("{line}");
        }
    })?;
    let comm = model.rank().map(|c| c.comm.stats()).unwrap_or_default();
    Ok((report, comm))
}

/// Prints rank 0's bench report and its collective time.
pub(crate) fn print_rank_bench(
    args: &BenchArgs,
    reports: Vec<(bench::BenchReport, ddtree_engine::parallel::CommStats)>,
    spec: ParallelSpec,
    kind: &str,
    start: Instant,
) -> Result<(), EngineError> {
    let (report, comm) = reports.into_iter().next().expect("at least one rank");
    println!("{}", bench::render(&report));
    println!(
        "{} {kind} ranks (TP {}, EP {}); rank 0: {} collectives, {:.1} ms in them; wall {:.1} s",
        spec.world,
        spec.tp,
        spec.ep,
        comm.calls,
        millis(comm.time),
        start.elapsed().as_secs_f64()
    );
    if kind == "GPU" {
        // NCCL collectives are timed with CUDA events around eager enqueues; a step replayed
        // from a CUDA graph runs its collectives inside the graph, uncounted.
        println!("  (eager collectives only, CUDA-event time; steps replayed from CUDA graphs are not split: --no-cuda-graphs for the full count)");
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report).expect("the report serializes");
        std::fs::write(path, text).map_err(|e| EngineError::io(path, e))?;
    }
    Ok(())
}

/// What [`bench_layout`] left to do.
pub(crate) enum BenchPath<B> {
    /// A multi-rank (or virtual-rank) bench ran.
    Done,
    /// One rank on this backend; the memory check passed.
    One(B),
}

/// `bench`'s layout: `--virtual-rank`, GPUs or CPU ranks run here; for one rank, the memory
/// check before anything is allocated.
pub(crate) fn bench_layout<B: Backend + 'static>(
    backend: B,
    args: &BenchArgs,
    preset: bench::Preset,
    opts: &bench::BenchOptions,
    config: &ModelConfig,
    copy_gb_per_s: Option<f64>,
) -> Result<BenchPath<B>, EngineError> {
    if let Some(rank) = args.par.virtual_rank {
        bench_virtual_rank(backend, args, preset, opts.clone(), config.clone(), rank, copy_gb_per_s)?;
        return Ok(BenchPath::Done);
    }
    let any = &backend as &dyn std::any::Any;
    if let Some(cuda) = any.downcast_ref::<CudaBackend>() {
        let spec = check_gpus(cuda, &args.par, |spec| {
            parallel::bench_estimate(config, spec, opts, Storage::Gpu)
        })?;
        if spec.is_parallel() {
            let plan = std::sync::Arc::new(ParallelPlan::new(config, spec)?);
            let options = cuda_options(&args.dev);
            let start = Instant::now();
            let reports = ddtree_engine::parallel::cuda::run_cuda_ranks(plan, options, |backend, rank| {
                bench_rank(backend, rank, preset, opts, config, copy_gb_per_s)
            })?;
            print_rank_bench(args, reports, spec, "GPU", start)?;
            return Ok(BenchPath::Done);
        }
    } else if let Some(&cpu) = any.downcast_ref::<CpuBackend>() {
        let spec = args.par.cpu_spec()?;
        parallel::bench_estimate(config, spec, opts, Storage::Cpu)?.check_host(&format!(
            "preset {} is sized for GPUs: run it on a GPU, or try --preset tiny (`ddtree plan --preset {} --cpu` shows the split)",
            preset.name(),
            preset.name()
        ))?;
        if spec.is_parallel() {
            bench_ranks(cpu, args, preset, opts, config.clone(), spec)?;
            return Ok(BenchPath::Done);
        }
    }
    Ok(BenchPath::One(backend))
}
