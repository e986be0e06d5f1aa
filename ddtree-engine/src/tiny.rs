//! The tiny model shipped with the engine, embedded in the binary so `ddtree generate` runs with
//! no `--model` from any working directory.
//!
//! It is the `tiny-kimi` golden fixture (`tests/fixtures/tiny-kimi`, made by
//! `scripts/make_golden.py`): a Kimi K2.5-shaped config (`text_config`, `language_model.` tensor
//! prefix), INT4 routed experts, two shards, and a byte-level BPE `tokenizer.json`.

use std::path::Path;

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::{LoadOptions, Model};
use crate::tokenizer::Tokenizer;
use crate::weights::Checkpoint;

/// How the embedded model is named in messages.
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

/// The embedded model's configuration.
pub fn config() -> Result<ModelConfig> {
    ModelConfig::from_json(
        include_str!(fixture!("config.json")),
        &Path::new(NAME).join("config.json"),
    )
}

/// The embedded model's checkpoint.
pub fn checkpoint() -> Result<Checkpoint> {
    Checkpoint::from_static(
        Path::new(NAME),
        Some(include_str!(fixture!("model.safetensors.index.json"))),
        &SHARDS,
    )
}

/// The embedded model's tokenizer.
pub fn tokenizer() -> Result<Tokenizer> {
    Tokenizer::from_hf_bytes(
        &Path::new(NAME).join("tokenizer.json"),
        include_bytes!(fixture!("tokenizer.json")),
    )
}

/// Loads the embedded model onto `backend`.
pub fn load<B: Backend>(backend: B, options: LoadOptions) -> Result<Model<B>> {
    Model::load(backend, config()?, &checkpoint()?, options, &mut |_, _| {})
}
