//! DDTree speculative-decoding engine for DeepSeek-V3 / Kimi K2.x models.
//!
//! - [`config`]: HF `config.json` (`deepseek_v3`, `kimi_k2`, `kimi_k25`) with YaRN, routing and
//!   compressed-tensors INT4 settings;
//! - [`weights`]: sharded, memory-mapped safetensors checkpoints;
//! - [`backend`]: the op-level [`Backend`] trait, the CPU reference [`CpuBackend`] (f32, or
//!   mirroring the GPU's bf16 rounding) and the [`CudaBackend`];
//! - [`bench`]: `ddtree bench` on synthetic models of real shapes;
//! - [`model`]: the forward (MLA with absorbed attention over the latent cache, tree masks, MoE),
//!   written once against [`Backend`];
//! - [`parallel`]: one model over several ranks (GPUs or CPU threads): the parallel plan, the
//!   memory estimate, collectives (in-process, NCCL), sharded loading, rank groups;
//! - [`generate`]: plain (greedy or sampled) generation;
//! - [`eval`]: `ddtree eval`, acceptance and speed of DDTree against plain decoding;
//! - [`spec`]: DDTree speculative decoding (drafters, the loop, sampling, statistics);
//! - [`tuning`]: the (kernel, key) plan of a model, tuning the missing keys at startup and the
//!   stored verify cost of `--budget auto`;
//! - [`tokenizer`]: HF `tokenizer.json` and Kimi `tiktoken.model`;
//! - [`tiny`]: the models embedded in the binary (the trained tiny-code pair, the tiny-kimi fixture).

#![warn(missing_docs)]

pub mod backend;
pub mod bench;
pub mod config;
pub mod error;
pub mod eval;
pub mod generate;
pub mod mask;
pub mod model;
pub mod parallel;
pub mod rope;
pub mod spec;
pub mod tiny;
pub mod tokenizer;
pub mod tuning;
pub mod weights;

pub use backend::{ActivationPrecision, AttentionKernel, Backend, CpuBackend, CudaBackend, CudaOptions};
pub use config::ModelConfig;
pub use error::{EngineError, Result};
pub use generate::{generate_plain, generate_plain_with_sink, GenerateOptions, Generation, StopReason, TokenSink};
pub use mask::AncestorMask;
pub use model::{ForwardInput, ForwardOutput, LoadOptions, LogitRows, Model};
pub use spec::{
    generate_speculative, generate_speculative_with_sink, Budget, Drafter, Sampling, SpecOptions, SpecStats,
};
pub use tokenizer::Tokenizer;
pub use weights::Checkpoint;
