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
}

pub(crate) fn serve(backend: AnyBackend, args: &ServeArgs) -> Result<(), EngineError> {
    match backend {
        AnyBackend::Cpu(b) => serve_on(b, args, None),
        AnyBackend::Cuda(b) => {
            let cost = match &args.model {
                Some(dir) => ModelConfig::from_file(&dir.join("config.json")).ok(),
                None => tiny::config().ok(),
            }
            .filter(|_| args.budget == Budget::Auto)
            .and_then(|cfg| tuning::load_verify_cost(b.gpu().fingerprint(), &cfg));
            serve_on(*b, args, cost)
        }
    }
}

/// Loads the model, drafter, tokenizer and chat template, then serves until SIGINT/SIGTERM.
fn serve_on<B: Backend + 'static>(backend: B, args: &ServeArgs, cost: Option<CostModel>) -> Result<(), EngineError> {
    let options = LoadOptions {
        check_finite: !args.skip_nan_check,
    };
    let (id, model, tokenizer, template) = match &args.model {
        None => {
            let model = tiny::load(backend, options)?;
            let template = ddtree_server::ChatTemplate::from_tokenizer_config(
                tiny::TOKENIZER_CONFIG,
                &PathBuf::from(tiny::NAME).join("tokenizer_config.json"),
            )
            .map_err(EngineError::Forward)?;
            ("tiny-code".to_string(), model, Some(tiny::tokenizer()?), template)
        }
        Some(dir) => {
            let config = ModelConfig::from_file(&dir.join("config.json"))?;
            let ckpt = Checkpoint::open(dir)?;
            let model = Model::load(backend, config, &ckpt, options, &mut |_, _| {})?;
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
            (name, model, Tokenizer::from_dir(dir)?, template)
        }
    };
    let gen_args = GenerateArgs {
        model: args.model.clone(),
        prompt: None,
        prompt_ids: None,
        max_tokens: 0,
        ignore_eos: false,
        skip_nan_check: args.skip_nan_check,
        dev: args.dev.clone(),
        json: false,
        drafter: None,
        budget: args.budget,
        calibrate_auto: args.calibrate_auto,
        block_size: args.block_size,
        no_spec: false,
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
        par: Default::default(),
    };
    let drafter: Option<Box<dyn Drafter<B>>> = match (args.drafter.as_deref(), &args.model) {
        (Some("none"), _) | (None, Some(_)) => None,
        (None, None) => Some(Box::new(tiny::load_drafter(&model, args.block_size)?)),
        (Some(which), _) => {
            let which = parse_drafter(which).map_err(EngineError::Forward)?;
            Some(make_drafter(&model, &which, &gen_args)?)
        }
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
    let config = ddtree_server::ServerConfig {
        host: args.host.clone(),
        port: args.port,
        api_key: args.api_key.clone(),
        max_queue: args.max_queue,
        max_body_bytes: args.max_body_bytes,
        shutdown_timeout: Duration::from_secs(args.shutdown_timeout),
        ..Default::default()
    };
    let info = ddtree_server::Engine::info(&engine);
    let text = ddtree_server::ModelText {
        tokenizer,
        chat_template: template,
    };
    ddtree_server::run(&mut engine, text, config, |addr| {
        eprintln!(
            "ddtree serve: listening on http://{addr} (model {}, device {}, drafter {}, context {})",
            info.id, info.device, info.drafter, info.context
        );
    })
    .map_err(|e| EngineError::Forward(e.to_string()))
}
