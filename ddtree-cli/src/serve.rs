//! `ddtree serve`: the CLI side of the OpenAI-compatible server (flags, model and drafter
//! loading); the server itself is the `ddtree-server` crate.

use std::path::PathBuf;
use std::time::Duration;

use super::*;

/// Arguments of `ddtree serve`.
#[derive(clap::Args)]
pub(crate) struct ServeArgs {
    /// HF model directory; default: the built-in tiny-code model with its DFlash drafter.
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// DDTree drafter: a DFlash directory, `oracle`, `noisy:P`, or `none` for plain decoding;
    /// default: the built-in drafter with the built-in model, none with --model.
    #[arg(long)]
    pub(crate) drafter: Option<String>,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub(crate) host: String,
    /// Port (0: an ephemeral port, logged at startup).
    #[arg(long, default_value_t = 8000)]
    pub(crate) port: u16,
    /// Require `Authorization: Bearer KEY` on /v1 endpoints.
    #[arg(long)]
    pub(crate) api_key: Option<String>,
    /// Requests that may wait for the engine; more are answered 429.
    #[arg(long, default_value_t = 64)]
    pub(crate) max_queue: usize,
    /// Longest prompt plus completion; default: the model's context.
    #[arg(long)]
    pub(crate) max_model_len: Option<usize>,
    /// Largest request body in bytes (more: 413).
    #[arg(long, default_value_t = 1 << 20)]
    pub(crate) max_body_bytes: usize,
    /// Seconds requests in flight may run after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 10)]
    pub(crate) shutdown_timeout: u64,
    /// The model id of /v1/models and responses; default: `tiny-code` or the directory name.
    #[arg(long)]
    pub(crate) served_model_name: Option<String>,
    /// Tree node budget (root not counted), or `auto`.
    #[arg(long, value_parser = parse_budget, default_value = "auto")]
    pub(crate) budget: Budget,
    /// With `--budget auto`: calibrate the drafter's probabilities by the earlier rounds.
    #[arg(long)]
    pub(crate) calibrate_auto: bool,
    /// Drafter block size (bonus slot included); default: the DFlash config's, 8 for test drafters.
    #[arg(long)]
    pub(crate) block_size: Option<usize>,
    /// Skip the load-time scan of the weights for NaN/infinity.
    #[arg(long)]
    pub(crate) skip_nan_check: bool,
    #[command(flatten)]
    pub(crate) dev: DeviceArgs,
    #[command(flatten)]
    pub(crate) par: parallel::ParallelArgs,
}

pub(crate) fn serve(backend: AnyBackend, args: &ServeArgs) -> Result<(), EngineError> {
    if args.par.virtual_rank.is_some() {
        return Err(EngineError::Parallel {
            argument: "--virtual-rank".into(),
            reason: "is for `bench` only: `serve` runs every rank (--ranks N on the CPU, --gpus N on GPUs)".into(),
        });
    }
    let config = match &args.model {
        Some(dir) => ModelConfig::from_file(&dir.join("config.json"))?,
        None => tiny::config()?,
    };
    // The memory estimate counts one request's latent cache at up to 8K tokens (as `ddtree
    // plan` does): a longer context is allowed, its cache is the request's to fit.
    let context = args
        .max_model_len
        .unwrap_or(config.max_position_embeddings)
        .min(config.max_position_embeddings)
        .min(8192);
    match backend {
        AnyBackend::Cpu(b) => {
            let spec = args.par.cpu_spec()?;
            let plan = ParallelPlan::new(&config, spec)?;
            ddtree_engine::parallel::MemoryEstimate::new(&plan, Storage::Cpu, context + 512, 1024)
                .check_host("load a smaller model, or serve on GPUs (see `ddtree plan`)")?;
            if spec.is_parallel() {
                return serve_ranks(args, plan, RankDevice::Cpu(b));
            }
            serve_on(b, args, None)
        }
        AnyBackend::Cuda(b) => {
            let spec = check_gpus(&b, &args.par, |spec| {
                let plan = ParallelPlan::new(&config, spec)?;
                Ok(ddtree_engine::parallel::MemoryEstimate::new(
                    &plan,
                    Storage::Gpu,
                    context + 512,
                    1024,
                ))
            })?;
            if spec.is_parallel() {
                drop(b);
                return serve_ranks(
                    args,
                    ParallelPlan::new(&config, spec)?,
                    RankDevice::Cuda(cuda_options(&args.dev)),
                );
            }
            let cost = Some(&config)
                .filter(|_| args.budget == Budget::Auto)
                .and_then(|cfg| tuning::load_verify_cost(b.gpu().fingerprint(), cfg));
            serve_on(*b, args, cost)
        }
    }
}

/// Where the ranks of `serve --ranks N` / `--gpus N` run.
enum RankDevice {
    /// Threads of the CPU backend, in-process collectives.
    Cpu(CpuBackend),
    /// GPUs `0..N` of this node, one thread each, NCCL.
    Cuda(CudaOptions),
}

/// Rank `rank`'s shard of the served model.
fn load_serve_rank<B: Backend>(
    backend: B,
    model: Option<&std::path::Path>,
    options: LoadOptions,
    rank: RankContext<B>,
) -> Result<Model<B>, EngineError> {
    match model {
        None => Model::load_rank(
            backend,
            tiny::config()?,
            &tiny::checkpoint()?,
            options,
            rank,
            &mut |_, _| {},
        ),
        Some(dir) => {
            let config = ModelConfig::from_file(&dir.join("config.json"))?;
            let ckpt = Checkpoint::open(dir)?;
            // One bar for all ranks: rank 0 draws it (its shard's bytes of the checkpoint).
            let total = if rank.rank == 0 { ckpt.total_bytes() } else { 0 };
            let bar = progress_bar(total, "loading weights {bar:40} {bytes}/{total_bytes} ({eta})");
            let model = Model::load_rank(backend, config, &ckpt, options, rank, &mut |done, total| {
                bar.set_length(total);
                bar.set_position(done);
            });
            bar.finish_and_clear();
            model
        }
    }
}

/// The drafter factory of `serve` on ranks (every rank makes its own), or `None` for plain
/// decoding.
fn rank_drafter<B: Backend + 'static>(
    args: &ServeArgs,
) -> Result<Option<ddtree_server::DrafterFactory<B>>, EngineError> {
    let block_size = args.block_size;
    Ok(match (args.drafter.as_deref(), &args.model) {
        (Some("none"), _) | (None, Some(_)) => None,
        (None, None) => Some(std::sync::Arc::new(move |model: &Model<B>| {
            Ok(Box::new(tiny::load_drafter(model, block_size)?) as Box<dyn Drafter<B>>)
        })),
        (Some(which), _) => {
            let which = parse_drafter(which).map_err(EngineError::Forward)?;
            Some(std::sync::Arc::new(move |model: &Model<B>| {
                drafter_for(model, &which, block_size, 0)
            }))
        }
    })
}

/// `serve --ranks N` (CPU) or `--gpus N` (CUDA): a rank group keeps every rank's shard and
/// drafter; the server's engine thread drives it ([`ddtree_server::RankEngine`]).
fn serve_ranks(args: &ServeArgs, plan: ParallelPlan, device: RankDevice) -> Result<(), EngineError> {
    use ddtree_engine::parallel::group::RankGroup;
    let (world, tp, ep) = (plan.spec.world, plan.spec.tp, plan.spec.ep);
    let plan = std::sync::Arc::new(plan);
    let options = LoadOptions {
        check_finite: !args.skip_nan_check,
    };
    let start = Instant::now();
    let spec = SpecOptions {
        budget: args.budget,
        calibrate: args.calibrate_auto,
        tree_source: args.par.tree_source,
        ..SpecOptions::auto(None)
    };
    let (id, tokenizer, template) = load_text(args)?;
    let id = args.served_model_name.clone().unwrap_or(id);
    let max_model_len = args.max_model_len.unwrap_or(usize::MAX);
    let dir = args.model.clone();
    let mut engine: Box<dyn ddtree_server::Engine> = match device {
        RankDevice::Cpu(backend) => {
            let group = RankGroup::cpu(plan, move |rank| {
                load_serve_rank(backend, dir.as_deref(), options, rank)
            })?;
            Box::new(ddtree_server::RankEngine::new(
                group,
                id,
                max_model_len,
                spec,
                rank_drafter(args)?,
            )?)
        }
        RankDevice::Cuda(cuda) => {
            let group = RankGroup::cuda(plan, cuda, move |backend, rank| {
                load_serve_rank(backend, dir.as_deref(), options, rank)
            })?;
            Box::new(ddtree_server::RankEngine::new(
                group,
                id,
                max_model_len,
                spec,
                rank_drafter(args)?,
            )?)
        }
    };
    eprintln!(
        "ddtree serve: {world} ranks (TP {tp}, EP {ep}, trees {}) loaded in {:.1} s",
        args.par.tree_source.name(),
        start.elapsed().as_secs_f64()
    );
    run_server(engine.as_mut(), args, tokenizer, template)
}

/// The served id, tokenizer and chat template of `--model` (or the built-in model).
fn load_text(
    args: &ServeArgs,
) -> Result<(String, Option<Tokenizer>, Option<ddtree_server::ChatTemplate>), EngineError> {
    Ok(match &args.model {
        None => {
            let template = ddtree_server::ChatTemplate::from_tokenizer_config(
                tiny::TOKENIZER_CONFIG,
                &PathBuf::from(tiny::NAME).join("tokenizer_config.json"),
            )
            .map_err(EngineError::Forward)?;
            ("tiny-code".to_string(), Some(tiny::tokenizer()?), template)
        }
        Some(dir) => {
            let path = dir.join("tokenizer_config.json");
            let template = match std::fs::read_to_string(&path) {
                Ok(text) => {
                    ddtree_server::ChatTemplate::from_tokenizer_config(&text, &path).map_err(EngineError::Forward)?
                }
                Err(_) => None,
            };
            let name = dir
                .file_name()
                .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
            (name, Tokenizer::from_dir(dir)?, template)
        }
    })
}

/// Serves `engine` as the flags say until SIGINT/SIGTERM.
fn run_server(
    engine: &mut dyn ddtree_server::Engine,
    args: &ServeArgs,
    tokenizer: Option<Tokenizer>,
    chat_template: Option<ddtree_server::ChatTemplate>,
) -> Result<(), EngineError> {
    let config = ddtree_server::ServerConfig {
        host: args.host.clone(),
        port: args.port,
        api_key: args.api_key.clone(),
        max_queue: args.max_queue,
        max_body_bytes: args.max_body_bytes,
        shutdown_timeout: Duration::from_secs(args.shutdown_timeout),
        ..Default::default()
    };
    let info = engine.info();
    let text = ddtree_server::ModelText {
        tokenizer,
        chat_template,
    };
    ddtree_server::run(engine, text, config, |addr| {
        eprintln!(
            "ddtree serve: listening on http://{addr} (model {}, device {}, drafter {}, context {})",
            info.id, info.device, info.drafter, info.context
        );
    })
    .map_err(|e| EngineError::Forward(e.to_string()))
}

/// Loads the model, drafter, tokenizer and chat template, then serves until SIGINT/SIGTERM.
fn serve_on<B: Backend + 'static>(backend: B, args: &ServeArgs, cost: Option<CostModel>) -> Result<(), EngineError> {
    let options = LoadOptions {
        check_finite: !args.skip_nan_check,
    };
    let model = match &args.model {
        None => tiny::load(backend, options)?,
        Some(dir) => {
            let config = ModelConfig::from_file(&dir.join("config.json"))?;
            let ckpt = Checkpoint::open(dir)?;
            let bar = progress_bar(
                ckpt.total_bytes(),
                "loading weights {bar:40} {bytes}/{total_bytes} ({eta})",
            );
            let model = Model::load(backend, config, &ckpt, options, &mut |done, total| {
                bar.set_length(total);
                bar.set_position(done);
            });
            bar.finish_and_clear();
            model?
        }
    };
    let (id, tokenizer, template) = load_text(args)?;
    let drafter: Option<Box<dyn Drafter<B>>> = match rank_drafter::<B>(args)? {
        Some(make) => Some(make(&model)?),
        None => None,
    };
    let max_model_len = args.max_model_len.unwrap_or(usize::MAX);
    let mut engine = ddtree_server::ModelEngine {
        model,
        drafter,
        spec: SpecOptions {
            budget: args.budget,
            calibrate: args.calibrate_auto,
            ..SpecOptions::auto(cost)
        },
        id: args.served_model_name.clone().unwrap_or(id),
        max_model_len,
    };
    run_server(&mut engine, args, tokenizer, template)
}
