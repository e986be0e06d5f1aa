//! `ddtree serve`: an OpenAI-compatible HTTP server in front of the DDTree engine.
//!
//! - [`run`] binds the address, serves HTTP on a tokio runtime and runs the engine on the
//!   calling thread until SIGINT/SIGTERM (then: stop accepting, finish or cancel the requests in
//!   flight within [`ServerConfig::shutdown_timeout`], return);
//! - [`routes`]: `/v1/completions`, `/v1/chat/completions` (plain JSON or Server-Sent Events),
//!   `/v1/models`, `/health`, `/metrics`;
//! - [`engine`]: the [`Engine`] trait, [`ModelEngine`] and the engine thread's FCFS loop;
//! - [`ranks`]: [`RankEngine`], the engine on a model split over several ranks (CPU or GPUs);
//! - [`request`]: request bodies read field by field; [`error`]: the OpenAI error schema;
//! - [`chat`]: chat templates (minijinja); [`text`]: incremental detokenisation and stop
//!   strings; [`metrics`]: the Prometheus text of `/metrics`.
//!
//! Requests reach the engine through a bounded queue ([`ServerConfig::max_queue`]; full: 429
//! with `Retry-After`). The engine runs one request at a time; a request whose client went away
//! stops at its next round and gives its KV cache back.

#![warn(missing_docs)]

pub mod chat;
pub mod engine;
pub mod error;
pub mod metrics;
pub mod ranks;
pub mod request;
pub mod routes;
pub mod text;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::Arc;
use std::time::Duration;

use ddtree_engine::Tokenizer;
use tokio::sync::Notify;

pub use chat::ChatTemplate;
pub use engine::{Engine, Finished, ModelEngine, ModelInfo};
pub use error::ApiError;
pub use ranks::{DrafterFactory, RankEngine};

/// How the server listens and what it accepts.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to bind (default `127.0.0.1`).
    pub host: String,
    /// Port (0: an ephemeral port, reported to `on_ready`).
    pub port: u16,
    /// When set, `/v1/*` needs `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Requests that may wait for the engine; one more is a 429.
    pub max_queue: usize,
    /// Largest request body in bytes; a larger one is a 413.
    pub max_body_bytes: usize,
    /// After SIGINT/SIGTERM, how long requests in flight may run before they are cancelled.
    pub shutdown_timeout: Duration,
    /// `max_tokens` of a completion request that gives none (OpenAI's default is 16); chat
    /// requests default to the rest of the context.
    pub default_max_tokens: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8000,
            api_key: None,
            max_queue: 64,
            max_body_bytes: 1 << 20,
            shutdown_timeout: Duration::from_secs(10),
            default_max_tokens: 16,
        }
    }
}

/// Why the server could not run.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Binding the address or starting the runtime failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// A setting is unusable.
    #[error("{0}")]
    Config(String),
}

/// The text side of the model: tokenizer and chat template (both optional: without a tokenizer
/// only token-id prompts work and responses carry no text; without a template no chat).
#[derive(Default)]
pub struct ModelText {
    /// The tokenizer.
    pub tokenizer: Option<Tokenizer>,
    /// The chat template.
    pub chat_template: Option<ChatTemplate>,
}

/// Serves `engine` until SIGINT or SIGTERM: HTTP on a tokio runtime, the engine on this thread.
/// `on_ready` gets the bound address (the real port when `config.port` is 0) once requests are
/// answered. Returns after the shutdown completed.
pub fn run(
    engine: &mut dyn Engine,
    text: ModelText,
    config: ServerConfig,
    on_ready: impl FnOnce(SocketAddr),
) -> Result<(), ServerError> {
    if config.max_queue == 0 {
        return Err(ServerError::Config("--max-queue must be at least 1".into()));
    }
    let io = |what: &str| {
        let what = what.to_string();
        move |source| ServerError::Io { what, source }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(io("starting the tokio runtime"))?;
    let bind = format!("{}:{}", config.host, config.port);
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(&bind))
        .map_err(io(&format!("binding {bind}")))?;
    let addr = listener.local_addr().map_err(io("reading the bound address"))?;
    let (jobs, queue) = sync_channel(config.max_queue);
    let timeout = config.shutdown_timeout;
    let state = Arc::new(routes::AppState {
        info: engine.info(),
        tokenizer: text.tokenizer.map(Arc::new),
        template: text.chat_template,
        config,
        jobs,
        metrics: Default::default(),
        control: Default::default(),
        draining: AtomicBool::new(false),
        next_id: AtomicU64::new(0),
    });
    let app = routes::router(state.clone());
    let control = state.control.clone();
    let signalled = Arc::new(Notify::new());
    let server = {
        let (state, signalled, control) = (state.clone(), signalled.clone(), control.clone());
        runtime.spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown({
                let signalled = signalled.clone();
                async move {
                    shutdown_signal().await;
                    state.draining.store(true, Ordering::Relaxed);
                    signalled.notify_one();
                }
            });
            let deadline = {
                let control = control.clone();
                async move {
                    signalled.notified().await;
                    tracing::info!("shutting down: finishing requests in flight (up to {timeout:?})");
                    tokio::time::sleep(timeout).await;
                    tracing::warn!("shutdown deadline passed: cancelling requests in flight");
                    control.abort.store(true, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            };
            tokio::select! {
                result = serve => {
                    if let Err(e) = result {
                        tracing::error!("HTTP server: {e}");
                    }
                }
                () = deadline => tracing::warn!("connections still open after the deadline; closing them"),
            }
            control.stopped.store(true, Ordering::Relaxed);
        })
    };
    on_ready(addr);
    engine::engine_loop(engine, queue, &state.metrics, &control);
    let _ = runtime.block_on(server);
    runtime.shutdown_timeout(Duration::from_secs(1));
    tracing::info!("server stopped");
    Ok(())
}

/// SIGINT (Ctrl-C) or, on Unix, SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
