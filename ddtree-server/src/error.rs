//! Errors as the OpenAI API reports them: an HTTP status and
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// A request the server answers with an error. Every variant that concerns one request field
/// names it (`param` in the body).
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A field is missing, of the wrong type or out of range (400).
    #[error("{message}")]
    InvalidField {
        /// The field, as the client spelled it (`messages[1].content`).
        param: String,
        /// What is wrong with it.
        message: String,
    },
    /// The body is not a JSON object (400).
    #[error("the request body is not valid JSON: {0}")]
    MalformedJson(String),
    /// A parameter this server does not implement, or does not know (400).
    #[error("{message}")]
    Unsupported {
        /// The field.
        param: String,
        /// Why it is refused.
        message: String,
    },
    /// The prompt, or the prompt plus `max_tokens`, does not fit the context (400).
    #[error("{message}")]
    ContextLength {
        /// `prompt`, `messages` or `max_tokens`.
        param: String,
        /// The lengths involved.
        message: String,
    },
    /// `model` names a model this server does not serve (404).
    #[error("the model `{0}` does not exist; GET /v1/models lists the one served here")]
    ModelNotFound(String),
    /// No route at this path (404).
    #[error("no endpoint {0}")]
    NotFound(String),
    /// The body is over the size limit (413).
    #[error("the request body is larger than the limit of {0} bytes")]
    PayloadTooLarge(usize),
    /// Missing or wrong API key (401).
    #[error("{0}")]
    Unauthorized(&'static str),
    /// The queue in front of the engine is full (429, with `Retry-After`).
    #[error("the server is busy: {0} requests are already waiting; retry later")]
    QueueFull(usize),
    /// The server is shutting down (503).
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The engine cannot serve: a rank group was left unusable by a failure (503).
    #[error("the engine is unavailable: {0}")]
    Unavailable(String),
    /// The engine or template failed on a request that was valid (500).
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    /// A 400 naming `param`.
    pub fn field(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidField {
            param: param.into(),
            message: message.into(),
        }
    }

    /// A 400 for a parameter the server does not support.
    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Unsupported {
            param: param.into(),
            message: message.into(),
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidField { .. }
            | Self::MalformedJson(_)
            | Self::Unsupported { .. }
            | Self::ContextLength { .. } => StatusCode::BAD_REQUEST,
            Self::ModelNotFound(_) | Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::QueueFull(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::ShuttingDown | Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI `error.type`.
    fn kind(&self) -> &'static str {
        match self {
            Self::Unauthorized(_) => "authentication_error",
            Self::QueueFull(_) => "rate_limit_error",
            Self::ShuttingDown | Self::Unavailable(_) | Self::Internal(_) => "server_error",
            Self::ModelNotFound(_) | Self::NotFound(_) => "not_found_error",
            _ => "invalid_request_error",
        }
    }

    /// The OpenAI `error.code`.
    fn code(&self) -> Option<&'static str> {
        match self {
            Self::ModelNotFound(_) => Some("model_not_found"),
            Self::ContextLength { .. } => Some("context_length_exceeded"),
            Self::Unauthorized(_) => Some("invalid_api_key"),
            Self::Unsupported { .. } => Some("unsupported_parameter"),
            Self::PayloadTooLarge(_) => Some("request_too_large"),
            _ => None,
        }
    }

    /// The field the error is about, if any.
    pub fn param(&self) -> Option<&str> {
        match self {
            Self::InvalidField { param, .. } | Self::Unsupported { param, .. } | Self::ContextLength { param, .. } => {
                Some(param)
            }
            Self::ModelNotFound(_) => Some("model"),
            _ => None,
        }
    }

    /// The error object of the OpenAI schema (also sent as an SSE event when a stream fails).
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.to_string(),
            "type": self.kind(),
            "param": self.param(),
            "code": self.code(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), Json(self.body())).into_response();
        if matches!(self, Self::QueueFull(_) | Self::ShuttingDown) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}
