//! The models shipped with the engine, embedded in the binary so `ddtree generate` runs with no
//! `--model` from any working directory.
//!
//! The default is **tiny-code** (`models/tiny-code`, made by `scripts/train_*.py`, see
//! `docs/models.md`): a 4-layer DeepSeek-V3-architecture target (MLA with a query LoRA, YaRN, a
//! dense first layer, 8 routed INT4 experts with `noaux_tc` top-2 routing and a shared expert)
//! trained on Rust crate sources and the Python standard library, its byte-level BPE tokenizer,
//! and a DFlash drafter trained against it ([`load_drafter`]). [`eval_prompts`] are prompts cut
//! from held-out corpus files for `ddtree eval`.
//!
//! [`kimi`] is the random-weight `tiny-kimi` golden fixture that the HF golden tests run.

use std::path::Path;

use crate::backend::Backend;
use crate::config::{DFlashConfig, ModelConfig};
use crate::error::{EngineError, Result};
use crate::model::{LoadOptions, Model};
use crate::spec::DFlashDrafter;
use crate::tokenizer::Tokenizer;
use crate::weights::Checkpoint;

/// How the embedded target is named in messages.
pub const NAME: &str = "tiny-code (built in)";
/// How the embedded drafter is named in messages.
pub const DRAFTER_NAME: &str = "tiny-code DFlash (built in)";

macro_rules! model_file {
    ($file:literal) => {
        concat!(env!("CARGO_MANIFEST_DIR"), "/models/tiny-code/", $file)
    };
}

static TARGET: [(&str, &[u8]); 1] = [(
    "model.safetensors",
    include_bytes!(model_file!("target/model.safetensors")),
)];
static DRAFTER: [(&str, &[u8]); 1] = [(
    "model.safetensors",
    include_bytes!(model_file!("dflash/model.safetensors")),
)];

/// The embedded target's `tokenizer_config.json` (special tokens and the chat template).
pub const TOKENIZER_CONFIG: &str = include_str!(model_file!("target/tokenizer_config.json"));

/// The embedded target's configuration.
pub fn config() -> Result<ModelConfig> {
    ModelConfig::from_json(
        include_str!(model_file!("target/config.json")),
        &Path::new(NAME).join("config.json"),
    )
}

/// The embedded target's checkpoint.
pub fn checkpoint() -> Result<Checkpoint> {
    Checkpoint::from_static(Path::new(NAME), None, &TARGET)
}

/// The embedded target's tokenizer.
pub fn tokenizer() -> Result<Tokenizer> {
    Tokenizer::from_hf_bytes(
        &Path::new(NAME).join("tokenizer.json"),
        include_bytes!(model_file!("target/tokenizer.json")),
    )
}

/// Loads the embedded target onto `backend`.
pub fn load<B: Backend>(backend: B, options: LoadOptions) -> Result<Model<B>> {
    Model::load(backend, config()?, &checkpoint()?, options, &mut |_, _| {})
}

/// The embedded drafter's configuration.
pub fn drafter_config() -> Result<DFlashConfig> {
    DFlashConfig::from_json(
        include_str!(model_file!("dflash/config.json")),
        &Path::new(DRAFTER_NAME).join("config.json"),
    )
}

/// The embedded drafter's checkpoint.
pub fn drafter_checkpoint() -> Result<Checkpoint> {
    Checkpoint::from_static(Path::new(DRAFTER_NAME), None, &DRAFTER)
}

/// Loads the embedded DFlash drafter for `target` (the embedded target: it shares its
/// embedding and LM head); `block_size` overrides the config's.
pub fn load_drafter<B: Backend>(target: &Model<B>, block_size: Option<usize>) -> Result<DFlashDrafter<B>> {
    DFlashDrafter::from_parts(
        target,
        drafter_config()?,
        &drafter_checkpoint()?,
        DRAFTER_NAME.into(),
        block_size,
    )
}

/// One evaluation prompt: text cut from a held-out corpus file (never trained on).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct EvalPrompt {
    /// The corpus file it comes from (`rust/<crate>-<version>/<path>` or `python3.11/<path>`).
    pub file: String,
    /// The prompt text.
    pub text: String,
}

#[derive(serde::Deserialize)]
struct EvalPrompts {
    prompts: Vec<EvalPrompt>,
}

/// Parses an evaluation prompt file (`{"prompts": [{"file", "text"}, ...]}`, as
/// `scripts/train_tokenizer.py` writes); `path` names it in errors.
pub fn parse_eval_prompts(text: &str, path: &Path) -> Result<Vec<EvalPrompt>> {
    let parsed: EvalPrompts = serde_json::from_str(text).map_err(|source| EngineError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(parsed.prompts)
}

/// The embedded held-out evaluation prompts of the built-in pair.
pub fn eval_prompts() -> Result<Vec<EvalPrompt>> {
    parse_eval_prompts(
        include_str!(model_file!("eval_prompts.json")),
        &Path::new(NAME).join("eval_prompts.json"),
    )
}

/// The random-weight `tiny-kimi` golden fixture (`tests/fixtures/tiny-kimi`, made by
/// `scripts/make_golden.py`): a Kimi K2.5-shaped config (`text_config`, `language_model.`
/// tensor prefix), INT4 routed experts, two shards, and a byte-level BPE `tokenizer.json`.
pub mod kimi {
    use std::path::Path;

    use crate::backend::Backend;
    use crate::config::ModelConfig;
    use crate::error::Result;
    use crate::model::{LoadOptions, Model};
    use crate::tokenizer::Tokenizer;
    use crate::weights::Checkpoint;

    /// How the fixture is named in messages.
    pub const NAME: &str = "tiny-kimi (built in)";

    macro_rules! fixture {
        ($file:literal) => {
            concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-kimi/", $file)
        };
    }

    static SHARDS: [(&str, &[u8]); 2] = [
        (
            "model-00001-of-00002.safetensors",
            include_bytes!(fixture!("model-00001-of-00002.safetensors")),
        ),
        (
            "model-00002-of-00002.safetensors",
            include_bytes!(fixture!("model-00002-of-00002.safetensors")),
        ),
    ];

    /// The fixture's configuration.
    pub fn config() -> Result<ModelConfig> {
        ModelConfig::from_json(
            include_str!(fixture!("config.json")),
            &Path::new(NAME).join("config.json"),
        )
    }

    /// The fixture's checkpoint.
    pub fn checkpoint() -> Result<Checkpoint> {
        Checkpoint::from_static(
            Path::new(NAME),
            Some(include_str!(fixture!("model.safetensors.index.json"))),
            &SHARDS,
        )
    }

    /// The fixture's tokenizer.
    pub fn tokenizer() -> Result<Tokenizer> {
        Tokenizer::from_hf_bytes(
            &Path::new(NAME).join("tokenizer.json"),
            include_bytes!(fixture!("tokenizer.json")),
        )
    }

    /// Loads the fixture onto `backend`.
    pub fn load<B: Backend>(backend: B, options: LoadOptions) -> Result<Model<B>> {
        Model::load(backend, config()?, &checkpoint()?, options, &mut |_, _| {})
    }
}
