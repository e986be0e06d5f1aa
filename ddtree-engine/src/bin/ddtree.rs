//! `ddtree`: command-line front end of the engine.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use ddtree_engine::{
    generate_plain, tiny, Checkpoint, CpuBackend, EngineError, GenerateOptions, Generation, LoadOptions, Model,
    ModelConfig, StopReason, Tokenizer,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;

/// Checkpoints at least this large get a loading progress bar.
const PROGRESS_MIN_BYTES: u64 = 64 << 20;

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
    /// Greedy generation from a prompt.
    Generate(GenerateArgs),
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Device {
    /// The f32 CPU reference backend.
    Cpu,
    /// The CUDA backend (not built yet).
    Cuda,
    /// The best available backend (currently the CPU).
    Auto,
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// HF model directory (config.json, safetensors shards, tokenizer); default: the built-in tiny model.
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
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Print one JSON object on stdout instead of text.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let Command::Generate(args) = Cli::parse().command;
    match generate(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A model loaded for the CLI, with what it needs to report.
struct Loaded {
    name: String,
    model: Model<CpuBackend>,
    tokenizer: Option<Tokenizer>,
}

fn load(args: &GenerateArgs) -> Result<Loaded, EngineError> {
    if args.device == Device::Cuda {
        return Err(EngineError::Backend {
            backend: "cuda".into(),
            reason: "the CUDA backend is not built yet; use --device cpu or --device auto".into(),
        });
    }
    let options = LoadOptions {
        check_finite: !args.skip_nan_check,
    };
    let Some(dir) = &args.model else {
        return Ok(Loaded {
            name: tiny::NAME.into(),
            model: tiny::load(CpuBackend, options)?,
            tokenizer: Some(tiny::tokenizer()?),
        });
    };
    let config = ModelConfig::from_file(&dir.join("config.json"))?;
    let ckpt = Checkpoint::open(dir)?;
    let bar = progress_bar(ckpt.total_bytes());
    let model = Model::load(CpuBackend, config, &ckpt, options, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    Ok(Loaded {
        name: dir.display().to_string(),
        model,
        tokenizer: Tokenizer::from_dir(dir)?,
    })
}

fn progress_bar(total: u64) -> ProgressBar {
    if total < PROGRESS_MIN_BYTES {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("loading weights {bar:40} {bytes}/{total_bytes} ({eta})")
            .expect("static template is valid"),
    );
    bar
}

fn prompt_ids(args: &GenerateArgs, loaded: &Loaded) -> Result<Vec<u32>, EngineError> {
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
    }
}

fn generate(args: &GenerateArgs) -> Result<(), EngineError> {
    let start = Instant::now();
    let loaded = load(args)?;
    let load_time = start.elapsed();
    let prompt = prompt_ids(args, &loaded)?;
    let options = GenerateOptions {
        max_new_tokens: args.max_tokens,
        stop_tokens: if args.ignore_eos {
            Vec::new()
        } else {
            loaded.model.config().eos_token_ids.clone()
        },
        record_logits: false,
        ..Default::default()
    };
    let out = generate_plain(&loaded.model, &prompt, &options)?;
    let text = match &loaded.tokenizer {
        Some(t) => Some(t.decode(&out.tokens)?),
        None => None,
    };
    if args.json {
        print_json(&loaded, prompt.len(), &out, text, load_time);
    } else {
        print_human(&loaded, &prompt, &out, text, load_time);
    }
    Ok(())
}

fn print_json(loaded: &Loaded, prompt_tokens: usize, out: &Generation, text: Option<String>, load: Duration) {
    let decode_tokens = out.tokens.len().saturating_sub(1);
    let report = json!({
        "model": loaded.name,
        "device": "cpu",
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
    println!("{report}");
}

fn print_human(loaded: &Loaded, prompt: &[u32], out: &Generation, text: Option<String>, load: Duration) {
    let decode_tokens = out.tokens.len().saturating_sub(1);
    let rate = |r: Option<f64>| r.map_or_else(|| "-".into(), |r| format!("{r:.1} tok/s"));
    println!("model: {} (cpu), loaded in {:.1} ms", loaded.name, millis(load));
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn cli_parses_prompt_ids_and_rejects_two_prompts() {
        let cli = Cli::try_parse_from(["ddtree", "generate", "--prompt-ids", "1,2,3", "--json"]).unwrap();
        let Command::Generate(args) = cli.command;
        assert_eq!(args.prompt_ids, Some(vec![1, 2, 3]));
        assert!(args.json && args.device == Device::Auto && args.model.is_none());
        assert!(Cli::try_parse_from(["ddtree", "generate", "--prompt", "a", "--prompt-ids", "1"]).is_err());
        assert!(Cli::try_parse_from(["ddtree", "generate", "--device", "tpu"]).is_err());
    }

    #[test]
    fn cuda_device_is_a_clear_error() {
        let cli = Cli::try_parse_from(["ddtree", "generate", "--device", "cuda"]).unwrap();
        let Command::Generate(args) = cli.command;
        let err = generate(&args).unwrap_err().to_string();
        assert!(err.contains("CUDA backend is not built yet"), "{err}");
    }

    #[test]
    fn text_prompt_without_tokenizer_names_the_model() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-dsv3");
        let cli =
            Cli::try_parse_from(["ddtree", "generate", "--prompt", "hi", "--model", dir.to_str().unwrap()]).unwrap();
        let Command::Generate(args) = cli.command;
        let err = generate(&args).unwrap_err().to_string();
        assert!(err.contains("tiny-dsv3") && err.contains("--prompt-ids"), "{err}");
    }
}
