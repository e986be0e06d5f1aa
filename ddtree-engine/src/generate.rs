//! Greedy autoregressive generation: prefill, then one token per step over the latent KV cache.

use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::error::{EngineError, Result};
use crate::model::{check_tokens, ForwardInput, LogitRows, Model};

/// Options for [`generate_greedy`].
#[derive(Debug, Clone, Default)]
pub struct GenerateOptions {
    /// Upper bound on generated tokens.
    pub max_new_tokens: usize,
    /// Generation stops after emitting any of these (the stop token is included in the output).
    pub stop_tokens: Vec<u32>,
    /// Keep the logits each generated token was chosen from.
    pub record_logits: bool,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token was emitted.
    StopToken,
    /// `max_new_tokens` were generated.
    MaxTokens,
    /// The next position would exceed `max_position_embeddings`.
    ContextFull,
}

/// The result of [`generate_greedy`].
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated token ids (not including the prompt).
    pub tokens: Vec<u32>,
    /// Why generation ended.
    pub stop_reason: StopReason,
    /// Time of the prefill forward (which also yields the first token).
    pub prefill: Duration,
    /// Time of all decode steps after the first token.
    pub decode: Duration,
    /// With `record_logits`, the logits behind each generated token.
    pub logits: Vec<Vec<f32>>,
}

/// Index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Checks a prompt against the model: non-empty, ids in the vocabulary, fits in the context.
pub fn check_prompt<B: Backend>(model: &Model<B>, prompt: &[u32]) -> Result<()> {
    if prompt.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    let cfg = model.config();
    check_tokens(prompt, cfg.vocab_size)?;
    if prompt.len() > cfg.max_position_embeddings {
        return Err(EngineError::ContextOverflow {
            tokens: prompt.len(),
            max_position: prompt.len() - 1,
            context: cfg.max_position_embeddings,
        });
    }
    Ok(())
}

/// Greedy decoding of up to `options.max_new_tokens` tokens after `prompt`.
pub fn generate_greedy<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    options: &GenerateOptions,
) -> Result<Generation> {
    check_prompt(model, prompt)?;
    let context = model.config().max_position_embeddings;
    let mut out = Generation {
        tokens: Vec::new(),
        stop_reason: StopReason::MaxTokens,
        prefill: Duration::ZERO,
        decode: Duration::ZERO,
        logits: Vec::new(),
    };
    if options.max_new_tokens == 0 {
        return Ok(out);
    }
    let capacity = (prompt.len() + options.max_new_tokens).min(context);
    let mut cache = model.new_cache(capacity)?;
    let mut tokens = prompt.to_vec();
    let mut positions: Vec<u32> = (0..prompt.len() as u32).collect();
    let mut position = prompt.len();
    loop {
        let start = Instant::now();
        let input = ForwardInput {
            tokens: &tokens,
            positions: &positions,
            mask: None,
            logits: LogitRows::Last,
        };
        let logits = model
            .backend()
            .to_host(&model.forward(&mut cache, input)?)?;
        let row = logits.row(logits.rows - 1);
        let next = argmax(row);
        if options.record_logits {
            out.logits.push(row.to_vec());
        }
        if out.tokens.is_empty() {
            out.prefill = start.elapsed();
        } else {
            out.decode += start.elapsed();
        }
        out.tokens.push(next);
        if options.stop_tokens.contains(&next) {
            out.stop_reason = StopReason::StopToken;
            break;
        }
        if out.tokens.len() >= options.max_new_tokens {
            break;
        }
        if position >= context {
            out.stop_reason = StopReason::ContextFull;
            break;
        }
        tokens = vec![next];
        positions = vec![position as u32];
        position += 1;
    }
    Ok(out)
}
