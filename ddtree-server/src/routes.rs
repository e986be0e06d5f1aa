//! The HTTP endpoints (axum): request checks, the hand-off to the engine queue, JSON and SSE
//! responses in the OpenAI schema with a `ddtree` extension object.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ddtree_engine::{GenerateOptions, Sampling, StopReason, Tokenizer};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::chat::ChatTemplate;
use crate::engine::{Control, Event, Finished, Job, ModelInfo};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::request::{parse_chat, parse_completion, Params, Prompt};
use crate::text::TextStream;
use crate::ServerConfig;

/// What every handler shares.
pub struct AppState {
    /// The model's facts.
    pub info: ModelInfo,
    /// The tokenizer, if the model has one.
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// The chat template, if the model has one.
    pub template: Option<ChatTemplate>,
    /// Limits and the API key.
    pub config: ServerConfig,
    /// The engine queue.
    pub jobs: SyncSender<Job>,
    /// Counters of `/metrics`.
    pub metrics: Metrics,
    /// Shutdown flags shared with the engine thread.
    pub control: Arc<Control>,
    /// A shutdown signal arrived: refuse new requests.
    pub draining: AtomicBool,
    /// Response id counter.
    pub next_id: AtomicU64,
}

type Shared = Arc<AppState>;

/// The router with every endpoint, the API key check and the request counter.
pub fn router(state: Shared) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .layer(middleware::from_fn_with_state(state.clone(), count));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .with_state(state)
}

/// Counts every `/v1` response by endpoint and status.
async fn count(State(state): State<Shared>, request: Request, next: Next) -> Response {
    let endpoint = request.uri().path().to_string();
    let response = next.run(request).await;
    state.metrics.count_request(&endpoint, response.status().as_u16());
    response
}

/// With an API key set, `/v1` needs `Authorization: Bearer <key>`.
async fn authorize(State(state): State<Shared>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.config.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match given {
            None => {
                return ApiError::Unauthorized("missing API key: send `Authorization: Bearer <key>`").into_response()
            }
            Some(g) if g != key => return ApiError::Unauthorized("wrong API key").into_response(),
            Some(_) => {}
        }
    }
    next.run(request).await
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::NotFound(uri.path().to_string())
}

/// `ok`, or a 503 with the reason when the engine cannot serve (a broken rank group).
async fn health(State(state): State<Shared>) -> Response {
    match state.control.broken() {
        None => "ok".into_response(),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "unavailable", "reason": reason})),
        )
            .into_response(),
    }
}

async fn metrics(State(state): State<Shared>) -> Response {
    let text = state.metrics.render(ddtree_engine::backend::live_kv_caches());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn models(State(state): State<Shared>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.info.id,
            "object": "model",
            "created": now(),
            "owned_by": "ddtree",
            "max_model_len": state.info.context,
        }],
    }))
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The body, or a 413 / 400.
fn body(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge(limit)
        } else {
            ApiError::MalformedJson(e.body_text())
        }
    })
}

/// Which endpoint a generation answers.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

async fn completions(State(state): State<Shared>, raw: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let raw = body(raw, state.config.max_body_bytes)?;
    let request = parse_completion(&raw)?;
    check_model(&state, &request.params)?;
    let prompt = match request.prompt {
        Prompt::Ids(ids) => ids,
        Prompt::Text(text) => {
            if text.is_empty() {
                return Err(ApiError::field("prompt", "`prompt` is empty"));
            }
            let tokenizer = state
                .tokenizer
                .as_ref()
                .ok_or_else(|| ApiError::field("prompt", "this model has no tokenizer: send `prompt` as token ids"))?;
            tokenizer
                .encode(&text)
                .map_err(|e| ApiError::field("prompt", e.to_string()))?
        }
    };
    start(state, Kind::Completion, prompt, "prompt", request.params).await
}

async fn chat_completions(
    State(state): State<Shared>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let raw = body(raw, state.config.max_body_bytes)?;
    let request = parse_chat(&raw)?;
    check_model(&state, &request.params)?;
    let (Some(template), Some(tokenizer)) = (&state.template, &state.tokenizer) else {
        return Err(ApiError::field(
            "messages",
            "this model has no chat template (tokenizer_config.json `chat_template`); use /v1/completions",
        ));
    };
    let text = template.render(&request.messages, request.add_generation_prompt)?;
    let prompt = tokenizer
        .encode(&text)
        .map_err(|e| ApiError::field("messages", e.to_string()))?;
    start(state, Kind::Chat, prompt, "messages", request.params).await
}

fn check_model(state: &AppState, params: &Params) -> Result<(), ApiError> {
    match &params.model {
        Some(m) if *m != state.info.id => Err(ApiError::ModelNotFound(m.clone())),
        _ => Ok(()),
    }
}

/// Checks the prompt and limits, queues the request and answers it (JSON or SSE).
async fn start(
    state: Shared,
    kind: Kind,
    prompt: Vec<u32>,
    prompt_field: &str,
    params: Params,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let info = &state.info;
    if prompt.is_empty() {
        return Err(ApiError::field(prompt_field, format!("`{prompt_field}` is empty")));
    }
    if let Some((i, id)) = prompt
        .iter()
        .enumerate()
        .find(|(_, &id)| id as usize >= info.vocab_size)
    {
        return Err(ApiError::field(
            format!("{prompt_field}[{i}]"),
            format!(
                "token id {id} is out of range: the vocabulary has {} ids",
                info.vocab_size
            ),
        ));
    }
    if let Some(id) = params.stop_ids.iter().find(|&&id| id as usize >= info.vocab_size) {
        return Err(ApiError::field(
            "stop",
            format!(
                "stop token id {id} is out of range: the vocabulary has {} ids",
                info.vocab_size
            ),
        ));
    }
    if prompt.len() >= info.context {
        return Err(ApiError::ContextLength {
            param: prompt_field.into(),
            message: format!(
                "the prompt has {} tokens; the context is {} tokens, with room for at least one more",
                prompt.len(),
                info.context
            ),
        });
    }
    let room = info.context - prompt.len();
    let max_tokens = match params.max_tokens {
        Some(n) if n > room => {
            return Err(ApiError::ContextLength {
                param: "max_tokens".into(),
                message: format!(
                    "`max_tokens` is {n}, but the prompt's {} tokens leave {room} of the context's {}",
                    prompt.len(),
                    info.context
                ),
            })
        }
        Some(n) => n,
        None if kind == Kind::Chat => room,
        None => state.config.default_max_tokens.min(room),
    };
    let mut stop_tokens = if params.ignore_eos {
        Vec::new()
    } else {
        info.eos_ids.clone()
    };
    stop_tokens.extend(&params.stop_ids);
    let options = GenerateOptions {
        max_new_tokens: max_tokens,
        stop_tokens: stop_tokens.clone(),
        record_logits: false,
        sampling: Sampling {
            temperature: params.temperature,
            top_p: params.top_p,
            seed: params.seed,
        },
    };
    if state.draining.load(Ordering::Relaxed) {
        return Err(ApiError::ShuttingDown);
    }
    if let Some(reason) = state.control.broken() {
        return Err(ApiError::Unavailable(reason));
    }
    let (events, receiver) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let prompt_tokens = prompt.len();
    let job = Job {
        prompt,
        options,
        events,
        cancel: cancel.clone(),
    };
    state.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
    if let Err(e) = state.jobs.try_send(job) {
        state.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        return Err(match e {
            TrySendError::Full(_) => ApiError::QueueFull(state.config.max_queue),
            TrySendError::Disconnected(_) => ApiError::ShuttingDown,
        });
    }
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let run = Running {
        id: match kind {
            Kind::Completion => format!("cmpl-{id}-{}", now()),
            Kind::Chat => format!("chatcmpl-{id}-{}", now()),
        },
        kind,
        created: now(),
        prompt_tokens,
        text: TextStream::new(state.tokenizer.clone(), params.stop_strings.clone()),
        stop_tokens,
        tokens: Vec::new(),
        arrived,
        last: None,
        receiver,
        cancel,
        state: state.clone(),
    };
    if params.stream {
        Ok(stream(run, params.include_usage).into_response())
    } else {
        collect(run).await
    }
}

/// A queued or running request, from the HTTP side.
struct Running {
    id: String,
    kind: Kind,
    created: u64,
    prompt_tokens: usize,
    text: TextStream,
    stop_tokens: Vec<u32>,
    tokens: Vec<u32>,
    arrived: Instant,
    last: Option<Instant>,
    receiver: UnboundedReceiver<Event>,
    cancel: Arc<AtomicBool>,
    state: Shared,
}

/// What the next engine event means for the client.
enum Step {
    /// New text and the tokens behind it.
    Delta(String, Vec<u32>),
    /// The end: the rest of the text, the finish reason and the statistics.
    End(String, &'static str, Finished),
}

impl Running {
    /// Waits for the engine's next event.
    async fn next(&mut self) -> Result<Step, ApiError> {
        match self.receiver.recv().await {
            Some(Event::Tokens(tokens)) => {
                let t = Instant::now();
                let metrics = &self.state.metrics;
                match self.last {
                    None => metrics.ttft.observe_n((t - self.arrived).as_secs_f64(), 1),
                    Some(last) if !tokens.is_empty() => {
                        let per = (t - last).as_secs_f64() / tokens.len() as f64;
                        metrics.itl.observe_n(per, tokens.len() as u64);
                    }
                    Some(_) => {}
                }
                self.last = Some(t);
                self.tokens.extend_from_slice(&tokens);
                // A stop token is the last one generated and is not part of the text.
                let shown: Vec<u32> = tokens
                    .iter()
                    .copied()
                    .filter(|id| !self.stop_tokens.contains(id))
                    .collect();
                let piece = self.text.push(&shown).map_err(|e| ApiError::Internal(e.to_string()))?;
                if self.text.stopped() {
                    // The engine stops at its next round.
                    self.cancel.store(true, Ordering::Relaxed);
                }
                Ok(Step::Delta(piece, tokens))
            }
            Some(Event::Done(Ok(done))) => {
                let rest = self.text.finish().map_err(|e| ApiError::Internal(e.to_string()))?;
                let reason = match done.stop_reason {
                    _ if self.text.stopped() => "stop",
                    StopReason::StopToken => "stop",
                    StopReason::MaxTokens | StopReason::ContextFull | StopReason::Cancelled => "length",
                };
                Ok(Step::End(rest, reason, done))
            }
            Some(Event::Done(Err(e))) if self.state.control.abort.load(Ordering::Relaxed) => {
                tracing::debug!("request refused at shutdown: {e}");
                Err(ApiError::ShuttingDown)
            }
            Some(Event::Done(Err(e))) => Err(ApiError::Internal(e)),
            Some(Event::Unavailable(reason)) => Err(ApiError::Unavailable(reason)),
            None => Err(ApiError::Internal("the engine dropped the request".into())),
        }
    }

    fn usage(&self, done: &Finished) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done.tokens.len(),
            "total_tokens": self.prompt_tokens + done.tokens.len(),
        })
    }

    /// The `ddtree` extension object of a finished request.
    fn extension(&self, done: &Finished) -> Value {
        json!({
            "rounds": done.rounds,
            "mean_accepted_length": done.mean_accepted_length,
            "tokens_per_target_forward": done.tokens_per_target_forward,
            "completion_token_ids": done.tokens,
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    /// One streamed chunk with `text` and `finish_reason`.
    fn chunk(&self, text: &str, finish: Option<&str>, extension: Value) -> Value {
        let choice = match self.kind {
            Kind::Completion => json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": null}),
            Kind::Chat => json!({"index": 0, "delta": {"content": text}, "finish_reason": finish, "logprobs": null}),
        };
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.state.info.id,
            "choices": [choice],
            "ddtree": extension,
        })
    }
}

/// A non-streaming answer: every event, then one response.
async fn collect(mut run: Running) -> Result<Response, ApiError> {
    let mut text = String::new();
    loop {
        match run.next().await? {
            Step::Delta(piece, _) => text.push_str(&piece),
            Step::End(rest, reason, done) => {
                text.push_str(&rest);
                let choice = match run.kind {
                    Kind::Completion => json!({"index": 0, "text": text, "finish_reason": reason, "logprobs": null}),
                    Kind::Chat => json!({
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": reason,
                        "logprobs": null,
                    }),
                };
                let body = json!({
                    "id": run.id,
                    "object": run.object(false),
                    "created": run.created,
                    "model": run.state.info.id,
                    "choices": [choice],
                    "usage": run.usage(&done),
                    "ddtree": run.extension(&done),
                });
                return Ok(Json(body).into_response());
            }
        }
    }
}

fn sse(value: &Value) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().data(value.to_string()))
}

/// A streaming answer: one chunk per committed token group, a last chunk with the finish
/// reason and the statistics, the usage chunk when asked, `[DONE]`.
fn stream(run: Running, include_usage: bool) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let mut pending = VecDeque::new();
    if run.kind == Kind::Chat {
        let mut first = run.chunk("", None, json!({}));
        first["choices"][0]["delta"] = json!({"role": "assistant", "content": ""});
        pending.push_back(sse(&first));
    }
    let state = (run, pending, false);
    let events = futures_util::stream::unfold(state, move |(mut run, mut pending, mut ended)| async move {
        loop {
            if let Some(event) = pending.pop_front() {
                return Some((event, (run, pending, ended)));
            }
            if ended {
                return None;
            }
            match run.next().await {
                Ok(Step::Delta(piece, tokens)) => {
                    pending.push_back(sse(&run.chunk(&piece, None, json!({"token_ids": tokens}))));
                }
                Ok(Step::End(rest, reason, done)) => {
                    pending.push_back(sse(&run.chunk(&rest, Some(reason), run.extension(&done))));
                    if include_usage {
                        let mut usage = run.chunk("", None, json!({}));
                        usage["choices"] = json!([]);
                        usage["usage"] = run.usage(&done);
                        pending.push_back(sse(&usage));
                    }
                    pending.push_back(Ok(SseEvent::default().data("[DONE]")));
                    ended = true;
                }
                Err(e) => {
                    pending.push_back(sse(&e.body()));
                    pending.push_back(Ok(SseEvent::default().data("[DONE]")));
                    ended = true;
                }
            }
        }
    });
    Sse::new(events)
}
