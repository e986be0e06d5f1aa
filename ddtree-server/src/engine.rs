//! The engine side: one thread owns the model and runs the queued requests one at a time,
//! first come first served, handing each round's committed tokens back as they come.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ddtree_engine::spec::SpecGeneration;
use ddtree_engine::{
    generate_plain_with_sink, generate_speculative_with_sink, Backend, Drafter, EngineError, GenerateOptions,
    Generation, Model, SpecOptions, StopReason, TokenSink,
};
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::Metrics;

/// What the server needs to know of the model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The id of `/v1/models` and of responses.
    pub id: String,
    /// Vocabulary size (token ids must be below it).
    pub vocab_size: usize,
    /// Longest prompt plus completion.
    pub context: usize,
    /// The model's end-of-sequence tokens.
    pub eos_ids: Vec<u32>,
    /// The device, as logged.
    pub device: String,
    /// The drafter, or `none` for plain decoding.
    pub drafter: String,
}

/// The result of one generation.
#[derive(Debug, Clone)]
pub struct Finished {
    /// Every generated token (a stop token included).
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub stop_reason: StopReason,
    /// DDTree rounds (0 for plain decoding).
    pub rounds: usize,
    /// Mean accepted length per round (1 for plain decoding: one token per forward).
    pub mean_accepted_length: f64,
    /// Generated tokens per target forward.
    pub tokens_per_target_forward: f64,
    /// Target forwards.
    pub target_forwards: usize,
}

impl Finished {
    /// The result of a DDTree generation.
    pub fn speculative(out: SpecGeneration) -> Self {
        let s = &out.stats;
        Finished {
            rounds: s.rounds,
            mean_accepted_length: s.mean_accept_len(),
            tokens_per_target_forward: s.tokens_per_target_forward(),
            target_forwards: s.target_forwards,
            tokens: out.generation.tokens,
            stop_reason: out.generation.stop_reason,
        }
    }

    /// The result of plain decoding.
    pub fn plain(out: Generation) -> Self {
        let n = out.tokens.len();
        Finished {
            rounds: 0,
            mean_accepted_length: 1.0,
            tokens_per_target_forward: if n == 0 { 0.0 } else { 1.0 },
            target_forwards: n,
            tokens: out.tokens,
            stop_reason: out.stop_reason,
        }
    }
}

/// A model the server can run: implemented for [`ModelEngine`]; tests may script their own.
pub trait Engine {
    /// The model's facts.
    fn info(&self) -> ModelInfo;
    /// Generates after `prompt`, handing committed tokens to `sink` as they come.
    fn generate(
        &mut self,
        prompt: &[u32],
        options: &GenerateOptions,
        sink: &mut TokenSink<'_>,
    ) -> Result<Finished, EngineError>;
    /// `Ok` while the engine can serve; otherwise why not (e.g. a rank group left unusable by
    /// a failure). The server then answers `/health` and new requests with 503.
    fn health(&self) -> Result<(), String> {
        Ok(())
    }
}

/// A loaded target with an optional DDTree drafter.
pub struct ModelEngine<B: Backend> {
    /// The target model.
    pub model: Model<B>,
    /// The drafter; `None` decodes plainly.
    pub drafter: Option<Box<dyn Drafter<B>>>,
    /// Tree budget and cost model.
    pub spec: SpecOptions,
    /// Served model id.
    pub id: String,
    /// Largest prompt plus completion (at most the model's context).
    pub max_model_len: usize,
}

impl<B: Backend> Engine for ModelEngine<B> {
    fn info(&self) -> ModelInfo {
        let cfg = self.model.config();
        ModelInfo {
            id: self.id.clone(),
            vocab_size: cfg.vocab_size,
            context: self.max_model_len.min(cfg.max_position_embeddings),
            eos_ids: cfg.eos_token_ids.clone(),
            device: self.model.backend().name().to_string(),
            drafter: self.drafter.as_ref().map_or_else(|| "none".to_string(), |d| d.name()),
        }
    }

    fn generate(
        &mut self,
        prompt: &[u32],
        options: &GenerateOptions,
        sink: &mut TokenSink<'_>,
    ) -> Result<Finished, EngineError> {
        match self.drafter.as_mut() {
            Some(drafter) => {
                let out =
                    generate_speculative_with_sink(&self.model, drafter.as_mut(), prompt, options, &self.spec, sink)?;
                Ok(Finished::speculative(out))
            }
            None => Ok(Finished::plain(generate_plain_with_sink(
                &self.model,
                prompt,
                options,
                sink,
            )?)),
        }
    }
}

/// What the engine thread sends back for a request.
#[derive(Debug)]
pub enum Event {
    /// Tokens committed by one round (or one plain step).
    Tokens(Vec<u32>),
    /// The generation ended.
    Done(Result<Finished, String>),
    /// The engine cannot serve (503): the request was not run.
    Unavailable(String),
}

/// A request waiting for the engine.
#[derive(Debug)]
pub struct Job {
    /// Prompt token ids (checked against the vocabulary and context).
    pub prompt: Vec<u32>,
    /// Limits, stop tokens, sampling.
    pub options: GenerateOptions,
    /// Where the tokens go; closed when the client has gone.
    pub events: UnboundedSender<Event>,
    /// Set by the HTTP side to stop the generation at the next round (a stop string was hit).
    pub cancel: Arc<AtomicBool>,
}

/// Flags the HTTP side and the engine thread share.
#[derive(Debug, Default)]
pub struct Control {
    /// The HTTP server has stopped: the engine thread may return once the queue is empty.
    pub stopped: AtomicBool,
    /// The shutdown deadline passed: cancel the running request and refuse the queued ones.
    pub abort: AtomicBool,
    /// Set when the engine reports it cannot serve ([`Engine::health`]): why.
    pub unusable: std::sync::Mutex<Option<String>>,
}

impl Control {
    /// Why the engine cannot serve, if it cannot.
    pub fn broken(&self) -> Option<String> {
        self.unusable.lock().ok().and_then(|b| b.clone())
    }

    fn check(&self, engine: &dyn Engine) {
        if let Err(reason) = engine.health() {
            if let Ok(mut b) = self.unusable.lock() {
                if b.is_none() {
                    tracing::error!("the engine cannot serve: {reason}; refusing requests (503)");
                    *b = Some(reason);
                }
            }
        }
    }
}

/// Runs queued jobs until the HTTP side has stopped and the queue is empty.
pub fn engine_loop(engine: &mut dyn Engine, jobs: Receiver<Job>, metrics: &Metrics, control: &Control) {
    control.check(engine);
    loop {
        let job = match jobs.recv_timeout(Duration::from_millis(50)) {
            Ok(job) => job,
            Err(RecvTimeoutError::Timeout) if !control.stopped.load(Ordering::Relaxed) => continue,
            Err(_) => return,
        };
        metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        if control.abort.load(Ordering::Relaxed) {
            let _ = job.events.send(Event::Done(Err("the server is shutting down".into())));
            continue;
        }
        if let Some(reason) = control.broken() {
            let _ = job.events.send(Event::Unavailable(reason));
            continue;
        }
        if job.events.is_closed() {
            // The client left while queued.
            metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        metrics.running.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let events = job.events.clone();
        let mut sink = |tokens: &[u32]| {
            let _ = events.send(Event::Tokens(tokens.to_vec()));
            !events.is_closed() && !job.cancel.load(Ordering::Relaxed) && !control.abort.load(Ordering::Relaxed)
        };
        // A panic in the engine fails this request (500), not the server.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            engine.generate(&job.prompt, &job.options, &mut sink)
        }));
        metrics.running.fetch_sub(1, Ordering::Relaxed);
        control.check(engine);
        let result = match result.unwrap_or_else(|_| Err(EngineError::Forward("the engine panicked".into()))) {
            Ok(done) => {
                metrics
                    .prompt_tokens
                    .fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
                metrics
                    .generated_tokens
                    .fetch_add(done.tokens.len() as u64, Ordering::Relaxed);
                let accepted = (done.mean_accepted_length * done.rounds as f64).round() as u64;
                metrics.rounds.fetch_add(done.rounds as u64, Ordering::Relaxed);
                metrics.accepted_tokens.fetch_add(accepted, Ordering::Relaxed);
                metrics
                    .target_forwards
                    .fetch_add(done.target_forwards as u64, Ordering::Relaxed);
                if done.stop_reason == StopReason::Cancelled {
                    metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                tracing::debug!(
                    tokens = done.tokens.len(),
                    ms = started.elapsed().as_millis() as u64,
                    reason = ?done.stop_reason,
                    "request done"
                );
                Ok(done)
            }
            Err(e) => Err(e.to_string()),
        };
        let _ = job.events.send(Event::Done(result));
    }
}
