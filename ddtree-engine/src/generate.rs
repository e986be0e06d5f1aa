//! Plain autoregressive generation (greedy or sampled): prefill, then one token per step over the
//! latent KV cache. The speculative loop in [`crate::spec`] must reproduce its output.

use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::error::{EngineError, Result};
use crate::model::{check_tokens, ForwardInput, LogitRows, Model};
use crate::spec::Sampling;

/// Options for [`generate_plain`] and [`crate::spec::generate_speculative`].
#[derive(Debug, Clone, Default)]
pub struct GenerateOptions {
    /// Upper bound on generated tokens.
    pub max_new_tokens: usize,
    /// Generation stops after emitting any of these (the stop token is included in the output).
    pub stop_tokens: Vec<u32>,
    /// Keep the logits each generated token was chosen from.
    pub record_logits: bool,
    /// Greedy decoding (the default) or sampling.
    pub sampling: Sampling,
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
    /// The token sink asked to stop (e.g. a server's client went away).
    Cancelled,
}

/// Receives the generated tokens as they are committed: one token per plain step, the accepted
/// tokens of a whole DDTree round at once. Returning `false` stops the generation after those
/// tokens ([`StopReason::Cancelled`] unless it was ending anyway). It only observes: the tokens
/// are the same with or without one.
pub type TokenSink<'a> = dyn FnMut(&[u32]) -> bool + 'a;

/// The result of a generation.
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

impl Generation {
    /// An empty generation (no tokens yet, stop reason `MaxTokens`).
    pub(crate) fn empty() -> Self {
        Self {
            tokens: Vec::new(),
            stop_reason: StopReason::MaxTokens,
            prefill: Duration::ZERO,
            decode: Duration::ZERO,
            logits: Vec::new(),
        }
    }

    /// Appends `token`, the token at position `position`, chosen from `logits`, and returns
    /// whether generation goes on. The stop rules, shared by plain and speculative decoding: a
    /// stop token ends it (and is kept), then the token budget, then the context (a token at
    /// position `max_position_embeddings` cannot be fed back).
    pub(crate) fn emit(
        &mut self,
        options: &GenerateOptions,
        token: u32,
        position: usize,
        context: usize,
        logits: &[f32],
    ) -> bool {
        self.tokens.push(token);
        if options.record_logits {
            self.logits.push(logits.to_vec());
        }
        if options.stop_tokens.contains(&token) {
            self.stop_reason = StopReason::StopToken;
            return false;
        }
        if self.tokens.len() >= options.max_new_tokens {
            return false;
        }
        if position >= context {
            self.stop_reason = StopReason::ContextFull;
            return false;
        }
        true
    }
}

/// The token chosen at every row of `logits` (row `i` at position `positions[i]`), and the
/// logits on the host when they are needed (sampling, or `record_logits`). Greedy decoding
/// without recording reads back only the argmax of each row.
pub(crate) fn choose_rows<B: Backend>(
    b: &B,
    logits: &B::Tensor,
    options: &GenerateOptions,
    positions: &[u32],
) -> Result<(Vec<u32>, Option<crate::backend::Matrix>)> {
    if options.sampling.is_greedy() && !options.record_logits {
        return Ok((b.argmax_rows(logits)?, None));
    }
    let host = b.to_host(logits)?;
    let tokens = (0..host.rows)
        .map(|i| options.sampling.choose(host.row(i), positions[i]))
        .collect();
    Ok((tokens, Some(host)))
}

/// Plain decoding (one forward per token) of up to `options.max_new_tokens` tokens after `prompt`.
pub fn generate_plain<B: Backend>(model: &Model<B>, prompt: &[u32], options: &GenerateOptions) -> Result<Generation> {
    generate_plain_with_sink(model, prompt, options, &mut |_| true)
}

/// [`generate_plain`] that hands every token to `sink` as soon as it is chosen.
pub fn generate_plain_with_sink<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    options: &GenerateOptions,
    sink: &mut TokenSink<'_>,
) -> Result<Generation> {
    check_prompt(model, prompt)?;
    options.sampling.validate()?;
    let context = model.config().max_position_embeddings;
    let mut out = Generation::empty();
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
        let (chosen, host) = if options.sampling.is_greedy() && !options.record_logits {
            (model.forward_greedy(&mut cache, input)?, None)
        } else {
            let logits = model.forward(&mut cache, input)?;
            choose_rows(model.backend(), &logits, options, &[position as u32 - 1])?
        };
        let next = chosen[0];
        let row = host.as_ref().map_or(&[][..], |h| h.row(0));
        if out.tokens.is_empty() {
            out.prefill = start.elapsed();
        } else {
            out.decode += start.elapsed();
        }
        let going = out.emit(options, next, position, context, row);
        if !sink(&[next]) && going {
            out.stop_reason = StopReason::Cancelled;
            break;
        }
        if !going {
            break;
        }
        tokens = vec![next];
        positions = vec![position as u32];
        position += 1;
    }
    Ok(out)
}
