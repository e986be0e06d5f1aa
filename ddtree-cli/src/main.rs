//! `ddtree`: command-line front end of the engine.

mod parallel;
mod ranks;
mod serve;
use serve::{serve, ServeArgs};

use ranks::{bench_layout, check_gpus, generate_gpu_ranks, generate_ranks, BenchPath};

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use ddtree_engine::parallel::ranks::run_cpu_ranks;
use ddtree_engine::parallel::{ParallelPlan, ParallelSpec, RankContext, Storage};
use ddtree_engine::spec::{CostModel, DFlashDrafter, Noisy, Oracle};
use ddtree_engine::{
    bench, generate_plain, generate_speculative, tiny, ActivationPrecision, AttentionKernel, Backend, Budget,
    Checkpoint, CpuBackend, CudaBackend, CudaOptions, Drafter, EngineError, GenerateOptions, Generation, LoadOptions,
    Model, ModelConfig, Sampling, SpecOptions, SpecStats, StopReason, Tokenizer,
};
use ddtree_engine::{eval, tuning};
use ddtree_runtime::Gpu;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;

/// Checkpoints at least this large get a loading progress bar.
const PROGRESS_MIN_BYTES: u64 = 64 << 20;
/// Block size of the `oracle` and `noisy:P` drafters when `--block-size` is not given (the Kimi
/// K2.5 DFlash drafter's).
const TEST_DRAFTER_BLOCK_SIZE: usize = 8;

/// What `--drafter` names.
#[derive(Debug, Clone, PartialEq)]
enum DrafterArg {
    /// A DFlash drafter directory (config.json with `dflash_config` + safetensors).
    Dir(PathBuf),
    /// The target's own greedy continuation.
    Oracle,
    /// The oracle with its top token kept with this probability.
    Noisy(f32),
}

fn parse_drafter(s: &str) -> Result<DrafterArg, String> {
    if s == "oracle" {
        return Ok(DrafterArg::Oracle);
    }
    if let Some(p) = s.strip_prefix("noisy:") {
        return match p.parse::<f32>() {
            Ok(p) if (0.0..=1.0).contains(&p) => Ok(DrafterArg::Noisy(p)),
            _ => Err(format!("noisy:P needs a probability P in [0, 1], got {p:?}")),
        };
    }
    Ok(DrafterArg::Dir(PathBuf::from(s)))
}

fn parse_budget(s: &str) -> Result<Budget, String> {
    if s == "auto" {
        return Ok(Budget::Auto);
    }
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(Budget::Fixed(n)),
        _ => Err(format!("expected a node count >= 1 or `auto`, got {s:?}")),
    }
}

#[derive(Parser)]
#[command(
    name = "ddtree",
    version,
    about = "DDTree speculative decoding for DeepSeek-V3 / Kimi K2.x"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generation from a prompt: DDTree speculative decoding with --drafter (with no --model,
    /// the built-in target with its built-in DFlash drafter), or plain decoding.
    Generate(GenerateArgs),
    /// Acceptance and speed of DDTree against plain decoding on held-out prompts (default: the
    /// built-in pair and its held-out prompts): budgets, the DFlash chain and `auto`.
    Eval(EvalArgs),
    /// The engine on a synthetic model of real shapes (random weights made on the device):
    /// plain decode against the bandwidth floor, DDTree rounds per budget, speedups.
    Bench(BenchArgs),
    /// An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models,
    /// /health, /metrics); see docs/serve.md.
    Serve(ServeArgs),
    /// The parallel plan of a model over 1, 2, 4, 8 GPUs: each rank's heads, experts,
    /// intermediate columns and vocabulary slice, the bytes it holds and reads per token, and
    /// the memory it needs.
    Plan(parallel::PlanArgs),
}

/// Where and how the engine runs.
#[derive(clap::Args, Clone)]
struct DeviceArgs {
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Run every kernel's default variant instead of the tuned one (CUDA).
    #[arg(long)]
    no_autotune: bool,
    /// Run every forward eagerly instead of recording and replaying CUDA graphs (CUDA).
    #[arg(long)]
    no_cuda_graphs: bool,
    /// Enqueue every op on one stream: no concurrent branches (the shared experts beside the
    /// routed ones, the latent path beside the query path) (CUDA).
    #[arg(long)]
    one_stream: bool,
    /// Launch kernels without programmatic dependent launch (by default a kernel may start
    /// while its predecessor drains, and weight GEMVs load their first weights meanwhile) (CUDA).
    #[arg(long)]
    no_pdl: bool,
    /// The tensor-core kernel of the MLA verify attention: `wgmma` (warpgroup MMA), `mma`
    /// (warp-level `mma.sync`), or `auto`: `wgmma` for trees and long decode contexts (CUDA).
    #[arg(long, value_enum, default_value_t = AttentionKernel::Auto)]
    attention: AttentionKernel,
    /// Activation precision of the CPU backend: `bf16` mirrors the CUDA backend's rounding to
    /// bf16, so CPU runs reproduce GPU tokens; `f32` is the reference.
    #[arg(long, value_enum, default_value_t = ActivationPrecision::F32)]
    cpu_activations: ActivationPrecision,
}

/// Arguments of `ddtree bench`.
#[derive(clap::Args)]
struct BenchArgs {
    /// Model shapes: `kimi-k2.6-ep8` (one GPU of 8-way expert parallel Kimi K2.6, ~100 GB) or
    /// `tiny` (the tiny-kimi fixture's shapes).
    #[arg(long, default_value = "kimi-k2.6-ep8")]
    preset: String,
    #[command(flatten)]
    dev: DeviceArgs,
    #[command(flatten)]
    par: parallel::ParallelArgs,
    /// Contexts of the plain-decode runs (comma-separated); default: the preset's.
    #[arg(long, value_delimiter = ',')]
    contexts: Option<Vec<usize>>,
    /// Tree budgets of the DDTree runs; default: the preset's.
    #[arg(long, value_delimiter = ',')]
    budgets: Option<Vec<usize>>,
    /// Drafter profiles: acceptance probabilities (1 = oracle) and/or `switching` (a calibrated
    /// drafter alternating easy and hard stretches); default: the preset's.
    #[arg(long, value_delimiter = ',')]
    accept: Option<Vec<ddtree_engine::bench::DraftProfile>>,
    /// Tokens generated per DDTree run; default: the preset's.
    #[arg(long)]
    tokens: Option<usize>,
    /// Drafter block size of the DDTree runs (bonus slot included; the deepest tree is one
    /// less); default: the preset's.
    #[arg(long)]
    block_size: Option<usize>,
    /// `auto` scores trees with the drafter's probabilities as calibrated by the earlier rounds.
    #[arg(long)]
    calibrate_auto: bool,
    /// Keep only the first N decoder layers of the preset (a quicker run, or a small model
    /// for a profiler); the report's bytes and floor follow.
    #[arg(long)]
    layers: Option<usize>,
    /// Write the report as JSON to this file too.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Arguments of `ddtree eval`.
#[derive(clap::Args)]
struct EvalArgs {
    /// HF target directory; default: the built-in tiny-code target (needs --drafter and --prompts).
    #[arg(long, requires_all = ["drafter", "prompts"])]
    model: Option<PathBuf>,
    /// DFlash drafter directory; default: the built-in drafter.
    #[arg(long)]
    drafter: Option<PathBuf>,
    /// Prompt file (`{"prompts": [{"file": ..., "text": ...}]}`); default: the built-in
    /// held-out prompts.
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Use only the first N prompts.
    #[arg(long)]
    limit: Option<usize>,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Fixed tree budgets (the DFlash chain of block_size - 1 nodes and `auto` run too).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 16, 32, 64, 128])]
    budgets: Vec<usize>,
    /// Drafter block size (bonus slot included); default: the drafter config's.
    #[arg(long)]
    block_size: Option<usize>,
    #[command(flatten)]
    dev: DeviceArgs,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Device {
    /// The CPU reference backend (f32 unless --cpu-activations bf16).
    Cpu,
    /// The CUDA backend on GPU 0.
    Cuda,
    /// CUDA when a GPU is present, else the CPU.
    Auto,
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// HF model directory (config.json, safetensors shards, tokenizer); default: the built-in
    /// tiny-code model (trained on Rust and Python sources), with its DFlash drafter.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt text (needs a tokenizer in the model directory).
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt token ids, comma-separated; default: the BOS token.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Maximum number of tokens to generate.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Keep generating past the EOS token(s) of config.json.
    #[arg(long)]
    ignore_eos: bool,
    /// Skip the load-time scan of the weights for NaN/infinity.
    #[arg(long)]
    skip_nan_check: bool,
    #[command(flatten)]
    dev: DeviceArgs,
    #[command(flatten)]
    par: parallel::ParallelArgs,
    /// Print one JSON object on stdout instead of text (with --drafter, plus the speculative stats).
    #[arg(long)]
    json: bool,
    /// DDTree speculative decoding with this drafter: a DFlash drafter directory, `oracle` (the
    /// target's own greedy continuation) or `noisy:P` (the oracle, right with probability P).
    /// Without it: the built-in drafter with the built-in model, plain decoding with --model.
    #[arg(long, value_parser = parse_drafter)]
    drafter: Option<DrafterArg>,
    /// Tree node budget (root not counted), or `auto`: each round the size (up to 256) with the
    /// most expected tokens per µs under the cost model (a default one when nothing is measured).
    #[arg(long, value_parser = parse_budget, default_value = "auto")]
    budget: Budget,
    /// With `--budget auto`: score trees with the drafter's probabilities as calibrated by the
    /// earlier rounds (how often drafted tokens of each probability were accepted).
    #[arg(long)]
    calibrate_auto: bool,
    /// Drafter block size (bonus slot included); default: the DFlash config's, 8 for test drafters.
    #[arg(long)]
    block_size: Option<usize>,
    /// Plain decoding even with a drafter (for comparisons).
    #[arg(long)]
    no_spec: bool,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling threshold (with --temperature > 0).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Seed of the sampling noise and of the noisy drafter.
    #[arg(long, default_value_t = 0)]
    seed: u32,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "ddtree=info,warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match Cli::parse().command {
        Command::Generate(args) => on_device(&args.dev, || model_config(&args), |b| generate(b, &args)),
        Command::Eval(args) => on_device(
            &args.dev,
            || match &args.model {
                Some(dir) => ModelConfig::from_file(&dir.join("config.json")),
                None => tiny::config(),
            },
            |b| run_eval(b, &args),
        ),
        Command::Serve(args) => on_device(
            &args.dev,
            || match &args.model {
                Some(dir) => ModelConfig::from_file(&dir.join("config.json")),
                None => tiny::config(),
            },
            |b| serve(b, &args),
        ),
        Command::Bench(args) => on_device(
            &args.dev,
            || bench::Preset::parse(&args.preset)?.config(),
            |b| run_bench(b, &args),
        ),
        Command::Plan(args) => parallel::run_plan(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The backend `--device` picked.
enum AnyBackend {
    Cpu(CpuBackend),
    Cuda(Box<CudaBackend>),
}

/// Opens the backend for `device` (`auto`: CUDA when a GPU opens, else the CPU) and runs `f`.
/// On CUDA, unless `--no-autotune`, first tunes the kernel keys of `config()`'s model that the
/// tune cache lacks, so that the backend reads their winners.
fn on_device(
    dev: &DeviceArgs,
    config: impl FnOnce() -> Result<ModelConfig, EngineError>,
    f: impl FnOnce(AnyBackend) -> Result<(), EngineError>,
) -> Result<(), EngineError> {
    let options = cuda_options(dev);
    let gpu = match dev.device {
        Device::Cpu => None,
        Device::Cuda => Some(Gpu::open(0)?),
        Device::Auto => Gpu::open(0)
            .inspect_err(|e| tracing::info!("no usable GPU ({e}); running on the CPU"))
            .ok(),
    };
    let cpu = CpuBackend::new(dev.cpu_activations);
    let backend = match gpu {
        None => AnyBackend::Cpu(cpu),
        Some(gpu) => {
            if !dev.no_autotune {
                tune_kernels(&gpu, &config()?);
            }
            match CudaBackend::new(gpu, options) {
                Ok(b) => AnyBackend::Cuda(Box::new(b)),
                Err(e) if dev.device == Device::Auto => {
                    tracing::info!("no usable GPU ({e}); running on the CPU");
                    AnyBackend::Cpu(cpu)
                }
                Err(e) => return Err(e),
            }
        }
    };
    f(backend)
}

/// The CUDA backend's options from the device flags.
fn cuda_options(dev: &DeviceArgs) -> CudaOptions {
    CudaOptions {
        no_autotune: dev.no_autotune,
        no_graphs: dev.no_cuda_graphs,
        one_stream: dev.one_stream,
        no_pdl: dev.no_pdl,
        attention: dev.attention,
    }
}

/// Tunes the missing kernel keys of `config` on `gpu` (a failure only costs speed: the backend
/// then runs default variants); one line when anything was tuned.
fn tune_kernels(gpu: &Gpu, config: &ModelConfig) {
    match tuning::tune_missing(gpu, config, &tuning::Progress::stderr()) {
        Ok(summary) => {
            for e in &summary.errors {
                tracing::warn!("tuning {e}; the default variant runs");
            }
            if let Some(line) = summary.line() {
                eprintln!("{line}");
            }
        }
        Err(e) => tracing::warn!("kernel tuning failed ({e}); default variants run where untuned"),
    }
}

/// The model configuration `generate` will load (the built-in tiny model's without --model).
fn model_config(args: &GenerateArgs) -> Result<ModelConfig, EngineError> {
    match &args.model {
        Some(dir) => ModelConfig::from_file(&dir.join("config.json")),
        None => tiny::config(),
    }
}

/// A model loaded for the CLI, with what it needs to report.
struct Loaded<B: Backend> {
    name: String,
    model: Model<B>,
    tokenizer: Option<Tokenizer>,
}

fn load<B: Backend>(backend: B, args: &GenerateArgs, rank: Option<RankContext<B>>) -> Result<Loaded<B>, EngineError> {
    let options = LoadOptions {
        check_finite: !args.skip_nan_check,
    };
    let Some(dir) = &args.model else {
        let model = match rank {
            None => tiny::load(backend, options)?,
            Some(rank) => Model::load_rank(
                backend,
                tiny::config()?,
                &tiny::checkpoint()?,
                options,
                rank,
                &mut |_, _| {},
            )?,
        };
        return Ok(Loaded {
            name: tiny::NAME.into(),
            model,
            tokenizer: Some(tiny::tokenizer()?),
        });
    };
    let config = ModelConfig::from_file(&dir.join("config.json"))?;
    let ckpt = Checkpoint::open(dir)?;
    // One bar for all ranks: rank 0 draws it.
    let total = if rank.as_ref().is_some_and(|r| r.rank > 0) {
        0
    } else {
        ckpt.total_bytes()
    };
    let bar = progress_bar(total, "loading weights {bar:40} {bytes}/{total_bytes} ({eta})");
    let mut progress = |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let model = match rank {
        None => Model::load(backend, config, &ckpt, options, &mut progress)?,
        Some(rank) => Model::load_rank(backend, config, &ckpt, options, rank, &mut progress)?,
    };
    bar.finish_and_clear();
    Ok(Loaded {
        name: dir.display().to_string(),
        model,
        tokenizer: Tokenizer::from_dir(dir)?,
    })
}

fn progress_bar(total: u64, template: &str) -> ProgressBar {
    if total < PROGRESS_MIN_BYTES {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(ProgressStyle::with_template(template).expect("static template is valid"));
    bar
}

fn prompt_ids<B: Backend>(args: &GenerateArgs, loaded: &Loaded<B>) -> Result<Vec<u32>, EngineError> {
    if let Some(ids) = &args.prompt_ids {
        return Ok(ids.clone());
    }
    if let Some(text) = &args.prompt {
        let tokenizer = loaded.tokenizer.as_ref().ok_or_else(|| EngineError::Tokenizer {
            path: PathBuf::from(&loaded.name),
            reason: "no tokenizer.json or tiktoken.model found; pass --prompt-ids instead".into(),
        })?;
        return tokenizer.encode(text);
    }
    Ok(loaded.model.config().bos_token_id.into_iter().collect())
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn per_second(tokens: usize, d: Duration) -> Option<f64> {
    (tokens > 0 && !d.is_zero()).then(|| tokens as f64 / d.as_secs_f64())
}

fn stop_reason(reason: StopReason) -> &'static str {
    match reason {
        StopReason::StopToken => "stop_token",
        StopReason::MaxTokens => "max_tokens",
        StopReason::ContextFull => "context_full",
        StopReason::Cancelled => "cancelled",
    }
}

/// One generation's results, before printing.
struct Run<B: Backend> {
    loaded: Loaded<B>,
    prompt: Vec<u32>,
    out: Generation,
    stats: Option<SpecStats>,
    load_time: Duration,
}

fn generate(backend: AnyBackend, args: &GenerateArgs) -> Result<(), EngineError> {
    let config = model_config(args)?;
    match backend {
        AnyBackend::Cpu(b) => {
            let spec = args.par.cpu_spec()?;
            let plan = ParallelPlan::new(&config, spec)?;
            let cache = args.max_tokens + 4096;
            ddtree_engine::parallel::MemoryEstimate::new(&plan, Storage::Cpu, cache, 1024)
                .check_host("load a smaller model, or run on GPUs (see `ddtree plan`)")?;
            if spec.is_parallel() {
                return generate_ranks(b, args, plan);
            }
            generate_on(b, args, None)
        }
        AnyBackend::Cuda(b) => {
            let spec = check_gpus(&b, &args.par, |spec| {
                let plan = ParallelPlan::new(&config, spec)?;
                Ok(ddtree_engine::parallel::MemoryEstimate::new(
                    &plan,
                    Storage::Gpu,
                    args.max_tokens + 4096,
                    1024,
                ))
            })?;
            if spec.is_parallel() {
                drop(b);
                return generate_gpu_ranks(args, ParallelPlan::new(&config, spec)?);
            }
            let cost = stored_verify_cost(&b, args);
            generate_on(*b, args, cost)
        }
    }
}

/// The verify cost `autotune --verify-cost` stored for this GPU and model, when `--budget auto`
/// will use one (otherwise `auto` keeps the fallback model and the statistics say so).
fn stored_verify_cost(backend: &CudaBackend, args: &GenerateArgs) -> Option<CostModel> {
    if args.budget != Budget::Auto || args.no_spec || (args.drafter.is_none() && args.model.is_some()) {
        return None;
    }
    tuning::load_verify_cost(backend.gpu().fingerprint(), &model_config(args).ok()?)
}

fn generate_on<B: Backend + 'static>(
    backend: B,
    args: &GenerateArgs,
    cost: Option<CostModel>,
) -> Result<(), EngineError> {
    let Run {
        loaded,
        prompt,
        out,
        stats,
        load_time,
    } = run(backend, args, cost, None)?;
    let text = match &loaded.tokenizer {
        Some(t) => Some(t.decode(&out.tokens)?),
        None => None,
    };
    if args.json {
        print_json(&loaded, prompt.len(), &out, stats.as_ref(), text, load_time);
    } else {
        print_human(&loaded, &prompt, &out, stats.as_ref(), text, load_time);
    }
    Ok(())
}

/// Generates as `args` say; `cost` is the cost model of `--budget auto` (`None`: the fallback).
fn run<B: Backend + 'static>(
    backend: B,
    args: &GenerateArgs,
    cost: Option<CostModel>,
    rank: Option<RankContext<B>>,
) -> Result<Run<B>, EngineError> {
    let start = Instant::now();
    let loaded = load(backend, args, rank)?;
    let load_time = start.elapsed();
    let prompt = prompt_ids(args, &loaded)?;
    let options = GenerateOptions {
        sampling: Sampling {
            temperature: args.temperature,
            top_p: args.top_p,
            seed: args.seed,
        },
        max_new_tokens: args.max_tokens,
        stop_tokens: if args.ignore_eos {
            Vec::new()
        } else {
            loaded.model.config().eos_token_ids.clone()
        },
        record_logits: false,
    };
    let drafter = match (&args.drafter, &args.model, args.no_spec) {
        (_, _, true) | (None, Some(_), false) => None,
        (Some(which), _, false) => Some(make_drafter(&loaded.model, which, args)?),
        (None, None, false) => {
            Some(Box::new(tiny::load_drafter(&loaded.model, args.block_size)?) as Box<dyn Drafter<B>>)
        }
    };
    let (out, stats) = match drafter {
        Some(mut drafter) => {
            let spec = SpecOptions {
                budget: args.budget,
                calibrate: args.calibrate_auto,
                tree_source: args.par.tree_source,
                ..SpecOptions::auto(cost)
            };
            let out = generate_speculative(&loaded.model, drafter.as_mut(), &prompt, &options, &spec)?;
            (out.generation, Some(out.stats))
        }
        _ => (generate_plain(&loaded.model, &prompt, &options)?, None),
    };
    Ok(Run {
        loaded,
        prompt,
        out,
        stats,
        load_time,
    })
}

fn make_drafter<B: Backend + 'static>(
    model: &Model<B>,
    which: &DrafterArg,
    args: &GenerateArgs,
) -> Result<Box<dyn Drafter<B>>, EngineError> {
    drafter_for(model, which, args.block_size, args.seed)
}

/// The drafter `which` names for `model` (`block_size`: the flag; `seed`: the noisy drafter's).
fn drafter_for<B: Backend + 'static>(
    model: &Model<B>,
    which: &DrafterArg,
    block_size: Option<usize>,
    seed: u32,
) -> Result<Box<dyn Drafter<B>>, EngineError> {
    let block = block_size.unwrap_or(TEST_DRAFTER_BLOCK_SIZE);
    Ok(match which {
        DrafterArg::Oracle => Box::new(Oracle::new(block)?),
        DrafterArg::Noisy(p) => Box::new(Noisy::new(block, *p, seed)?),
        DrafterArg::Dir(dir) => Box::new(DFlashDrafter::load(model, dir, block_size)?),
    })
}

fn run_eval(backend: AnyBackend, args: &EvalArgs) -> Result<(), EngineError> {
    match backend {
        AnyBackend::Cpu(b) => eval_on(b, args),
        AnyBackend::Cuda(b) => eval_on(*b, args),
    }
}

fn eval_on<B: Backend>(backend: B, args: &EvalArgs) -> Result<(), EngineError> {
    let setup = eval::EvalSetup {
        model: args.model.clone(),
        drafter: args.drafter.clone(),
        prompts: args.prompts.clone(),
        limit: args.limit,
        block_size: args.block_size,
        check_finite: true,
    };
    let options = eval::EvalOptions {
        max_new_tokens: args.max_tokens,
        budgets: args.budgets.clone(),
        ..Default::default()
    };
    let report = eval::load_and_evaluate(backend, &setup, &options, &mut |row| {
        eprintln!("eval: {} done ({:.1} s)", row.label, row.wall.as_secs_f64());
    })?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report.to_json()).expect("JSON values serialize")
        );
    } else {
        print!("{}", report.table());
    }
    if !report.lossless() {
        return Err(EngineError::Forward(
            "eval: a DDTree output differs from plain decoding (greedy DDTree must be lossless)".into(),
        ));
    }
    Ok(())
}

fn run_bench(backend: AnyBackend, args: &BenchArgs) -> Result<(), EngineError> {
    match backend {
        AnyBackend::Cpu(b) => bench_on(b, args, None),
        AnyBackend::Cuda(b) => {
            let bw = ddtree_runtime::timing::copy_bandwidth(b.gpu())?;
            bench_on(*b, args, Some(bw))
        }
    }
}

fn bench_on<B: Backend + 'static>(backend: B, args: &BenchArgs, copy_gb_per_s: Option<f64>) -> Result<(), EngineError> {
    let preset = bench::Preset::parse(&args.preset)?;
    let mut opts = bench::BenchOptions::for_preset(preset);
    if let Some(c) = &args.contexts {
        opts.contexts = c.clone();
    }
    if let Some(b) = &args.budgets {
        opts.budgets = b.clone();
    }
    if let Some(a) = &args.accept {
        opts.accept = a.clone();
    }
    if let Some(b) = args.block_size {
        if b < 2 {
            return Err(EngineError::Forward(format!(
                "--block-size must be at least 2 (the bonus slot and one drafted position), got {b}"
            )));
        }
        opts.block_size = b;
    }
    opts.calibrate_auto = args.calibrate_auto;
    if let Some(t) = args.tokens {
        opts.spec_tokens = t;
    }
    let mut config = preset.config()?;
    if let Some(n) = args.layers {
        if n == 0 || n > config.num_hidden_layers {
            return Err(EngineError::Forward(format!(
                "--layers must be 1..={} for preset {}, got {n}",
                config.num_hidden_layers,
                preset.name()
            )));
        }
        config.num_hidden_layers = n;
    }
    // The multi-rank paths, and the memory check before anything is allocated.
    let backend = match bench_layout(backend, args, preset, &opts, &config, copy_gb_per_s)? {
        BenchPath::Done => return Ok(()),
        BenchPath::One(b) => b,
    };
    let start = Instant::now();
    let bar = progress_bar(
        u64::MAX,
        "making random weights {bar:40} {human_pos}/{human_len} parameters ({eta})",
    );
    let model = Model::random(backend, config, opts.seed, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    eprintln!(
        "{}: {:.1} B random parameters on {} in {:.1} s",
        preset.name(),
        model.parameter_count() as f64 / 1e9,
        model.backend().name(),
        start.elapsed().as_secs_f64()
    );
    let report = bench::run(&model, preset, &opts, copy_gb_per_s, &mut |line| eprintln!("{line}"))?;
    println!("{}", bench::render(&report));
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report).expect("the report serializes");
        std::fs::write(path, text).map_err(|e| EngineError::io(path, e))?;
    }
    Ok(())
}

/// The speculative statistics of the JSON report.
fn spec_json(s: &SpecStats) -> serde_json::Value {
    json!({
        "drafter": s.drafter,
        "budget": s.budget,
        "budget_mode": s.budget_mode,
        "mean_budget": s.mean_budget(),
        "budgets": s.budgets,
        "block_size": s.block_size,
        "rounds": s.rounds,
        "mean_accept_len": s.mean_accept_len(),
        "accept_lengths": s.accept_lengths,
        "target_forwards": s.target_forwards,
        "tokens_per_target_forward": s.tokens_per_target_forward(),
        "verified_nodes": s.verified_nodes,
        "round_host_reads": s.round_host_reads,
        "tree_source": s.tree_source,
        "tree_sync_ms": millis(s.tree_sync),
        "phase_ms": {
            "prefill": millis(s.prefill),
            "draft": millis(s.draft),
            "build": millis(s.build),
            "verify": millis(s.verify),
            "accept": millis(s.accept),
        },
    })
}

fn print_json<B: Backend>(
    loaded: &Loaded<B>,
    prompt_tokens: usize,
    out: &Generation,
    stats: Option<&SpecStats>,
    text: Option<String>,
    load: Duration,
) {
    let device = loaded.model.backend().name();
    println!(
        "{}",
        generation_json(&loaded.name, device, prompt_tokens, out, stats, text, load)
    );
}

/// The JSON report of one generation.
fn generation_json(
    name: &str,
    device: &str,
    prompt_tokens: usize,
    out: &Generation,
    stats: Option<&SpecStats>,
    text: Option<String>,
    load: Duration,
) -> serde_json::Value {
    let decode_tokens = out.tokens.len().saturating_sub(1);
    let mut report = json!({
        "model": name,
        "device": device,
        "prompt_tokens": prompt_tokens,
        "tokens": out.tokens,
        "text": text,
        "stop_reason": stop_reason(out.stop_reason),
        "timings": {
            "load_ms": millis(load),
            "prefill_ms": millis(out.prefill),
            "prefill_tokens_per_s": per_second(prompt_tokens, out.prefill),
            "decode_ms": millis(out.decode),
            "decode_tokens": decode_tokens,
            "decode_tokens_per_s": per_second(decode_tokens, out.decode),
        },
    });
    if let Some(stats) = stats {
        report["spec"] = spec_json(stats);
    }
    report
}

fn print_human<B: Backend>(
    loaded: &Loaded<B>,
    prompt: &[u32],
    out: &Generation,
    stats: Option<&SpecStats>,
    text: Option<String>,
    load: Duration,
) {
    let device = loaded.model.backend().name();
    print_human_named(&loaded.name, device, prompt, out, stats, text, load);
}

/// The text report of one generation.
fn print_human_named(
    name: &str,
    device: &str,
    prompt: &[u32],
    out: &Generation,
    stats: Option<&SpecStats>,
    text: Option<String>,
    load: Duration,
) {
    let decode_tokens = out.tokens.len().saturating_sub(1);
    let rate = |r: Option<f64>| r.map_or_else(|| "-".into(), |r| format!("{r:.1} tok/s"));
    println!("model: {name} ({device}), loaded in {:.1} ms", millis(load));
    println!("prompt: {} tokens {:?}", prompt.len(), prompt);
    println!("tokens: {:?}", out.tokens);
    if let Some(text) = text {
        println!("text: {text:?}");
    }
    println!(
        "prefill: {:.2} ms ({}); decode: {decode_tokens} tokens in {:.2} ms ({}); stop: {}",
        millis(out.prefill),
        rate(per_second(prompt.len(), out.prefill)),
        millis(out.decode),
        rate(per_second(decode_tokens, out.decode)),
        stop_reason(out.stop_reason),
    );
    if let Some(s) = stats {
        let budget = if s.budget_auto {
            let mode = s.budget_mode.trim_start_matches("auto: ");
            format!("auto (mean {:.1} of at most {}; {mode})", s.mean_budget(), s.budget)
        } else {
            s.budget.to_string()
        };
        println!(
            "ddtree: drafter {}, budget {}, block {}; {} rounds, mean acceptance {:.2}, {} target forwards \
             ({:.2} tokens each); draft {:.2} ms, build {:.2} ms, verify {:.2} ms, accept {:.2} ms",
            s.drafter,
            budget,
            s.block_size,
            s.rounds,
            s.mean_accept_len(),
            s.target_forwards,
            s.tokens_per_target_forward(),
            millis(s.draft),
            millis(s.build),
            millis(s.verify),
            millis(s.accept),
        );
    }
}

#[cfg(test)]
mod tests;
