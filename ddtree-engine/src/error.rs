//! The engine's error type: every variant names the file, tensor or field it is about.

use std::path::PathBuf;

/// Result alias used throughout the engine.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// Everything that can go wrong while loading or running a model.
///
/// Bad input (config, weights, prompt, tokenizer files) always maps to one of these variants; the
/// engine never panics on it.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// An I/O operation on `path` failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file could not be parsed.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        /// The JSON file.
        path: PathBuf,
        /// The parser error.
        #[source]
        source: serde_json::Error,
    },
    /// A config field is missing, malformed or has a value the engine does not support.
    #[error("{path}: field `{field}`: {reason}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// Dotted path of the field, e.g. `rope_scaling.factor`.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A safetensors shard is truncated or its header is malformed.
    #[error("{path}: malformed safetensors file: {reason}")]
    Safetensors {
        /// The shard.
        path: PathBuf,
        /// What the parser reported.
        reason: String,
    },
    /// `model.safetensors.index.json` names a shard file that does not exist.
    #[error("{index}: weight_map names shard `{file}` (for tensor `{tensor}`), which does not exist")]
    MissingShard {
        /// The index file.
        index: PathBuf,
        /// The missing shard's file name.
        file: String,
        /// One tensor routed to that shard.
        tensor: String,
    },
    /// A tensor the config implies is not in the checkpoint.
    #[error("{location}: tensor `{tensor}` is missing")]
    MissingTensor {
        /// The checkpoint directory (or index file).
        location: PathBuf,
        /// The missing tensor's name.
        tensor: String,
    },
    /// A tensor has a different shape than the config implies.
    #[error("{file}: tensor `{tensor}` has shape {got:?}, expected {expected:?}")]
    Shape {
        /// The shard holding the tensor.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape in the file.
        got: Vec<usize>,
    },
    /// A tensor has a dtype the engine cannot use for it.
    #[error("{file}: tensor `{tensor}` has dtype {got}, expected {expected}")]
    Dtype {
        /// The shard holding the tensor.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The accepted dtype(s).
        expected: String,
        /// The dtype in the file.
        got: String,
    },
    /// A weight contains NaN or infinity (the load-time scan can be skipped).
    #[error(
        "{file}: tensor `{tensor}` has a non-finite value ({value}) at element {index} \
         (disable the load-time scan to load it anyway)"
    )]
    NonFinite {
        /// The shard holding the tensor.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// Flat index of the first bad element.
        index: usize,
        /// The bad value.
        value: f32,
    },
    /// A tensor's contents are inconsistent (e.g. an INT4 `weight_shape` that disagrees with the config).
    #[error("{file}: tensor `{tensor}`: {reason}")]
    BadTensor {
        /// The shard holding the tensor.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// The prompt has no tokens.
    #[error("the prompt is empty: at least one token is needed")]
    EmptyPrompt,
    /// A token id is not below the vocabulary size.
    #[error("token id {id} at index {index} is out of range: the vocabulary has {vocab_size} tokens")]
    TokenOutOfRange {
        /// The bad id.
        id: u32,
        /// Its index in the input.
        index: usize,
        /// `vocab_size` from the config.
        vocab_size: usize,
    },
    /// The input does not fit in the model's context.
    #[error(
        "{tokens} tokens do not fit in the context: positions up to {max_position} are needed but \
         max_position_embeddings is {context}"
    )]
    ContextOverflow {
        /// Number of tokens that were to be processed.
        tokens: usize,
        /// Highest position the input needs.
        max_position: usize,
        /// `max_position_embeddings` from the config.
        context: usize,
    },
    /// A forward call's inputs are inconsistent (lengths, mask, cache state).
    #[error("invalid forward input: {0}")]
    Forward(String),
    /// A tokenizer file could not be loaded, or text could not be encoded or decoded.
    #[error("tokenizer {path}: {reason}")]
    Tokenizer {
        /// The tokenizer file (or the model directory).
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The requested backend cannot run here.
    #[error("backend `{backend}`: {reason}")]
    Backend {
        /// The backend's name.
        backend: String,
        /// Why it cannot run.
        reason: String,
    },
    /// A parallel layout (`--gpus`, `--ranks`, `--tp`, `--ep`) does not fit the model or cannot
    /// run here.
    #[error("parallel plan: `{argument}`: {reason}")]
    Parallel {
        /// The argument or config field at fault (`--tp`, `num_attention_heads`, ...).
        argument: String,
        /// What is wrong.
        reason: String,
    },
    /// A run needs more memory per rank than the device (or host) has; nothing was allocated.
    #[error(
        "not enough memory on {device}: each of {ranks} rank(s) needs about {need_gib:.1} GiB \
         ({breakdown}), {available_gib:.1} GiB available{hint}"
    )]
    OutOfMemory {
        /// Where the ranks run (`the CPU host`, `GPU 0 (NVIDIA H200)`).
        device: String,
        /// Ranks sharing the model.
        ranks: usize,
        /// GiB one rank needs.
        need_gib: f64,
        /// GiB available to one rank.
        available_gib: f64,
        /// What the need is made of.
        breakdown: String,
        /// What to try instead (starts with `; ` when set).
        hint: String,
    },
    /// A collective (all-reduce, all-gather, broadcast) failed or a peer rank is gone.
    #[error("collective `{op}` on rank {rank}: {reason}")]
    Comm {
        /// The collective.
        op: String,
        /// The calling rank.
        rank: usize,
        /// What went wrong.
        reason: String,
    },
}

impl EngineError {
    /// Wraps an I/O error with the path it is about.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}
