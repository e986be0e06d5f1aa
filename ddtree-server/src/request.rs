//! Request bodies of `/v1/completions` and `/v1/chat/completions`, read field by field so that
//! every error names the field it is about.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// Most stop strings a request may give (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;

/// The prompt of a completion request.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Text, tokenized by the model's tokenizer.
    Text(String),
    /// Token ids, used as given.
    Ids(Vec<u32>),
}

/// One chat message (text content only).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The text (an array of `{"type": "text", "text"}` parts is joined).
    pub content: String,
}

/// The sampling and stopping fields shared by both endpoints.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Params {
    /// `model`, if given.
    pub model: Option<String>,
    /// `max_tokens` (chat: or `max_completion_tokens`); `None`: the endpoint's default.
    pub max_tokens: Option<usize>,
    /// `temperature` (0 = greedy, the default).
    pub temperature: f32,
    /// `top_p`.
    pub top_p: f32,
    /// `seed`.
    pub seed: u32,
    /// Stop strings of `stop` (not part of the returned text).
    pub stop_strings: Vec<String>,
    /// Stop token ids: integers in `stop`, and `stop_token_ids`.
    pub stop_ids: Vec<u32>,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `ignore_eos` (an extension, as vLLM's): keep going past the model's EOS tokens.
    pub ignore_eos: bool,
}

/// A parsed `/v1/completions` body.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    /// `prompt`.
    pub prompt: Prompt,
    /// The other fields.
    pub params: Params,
}

/// A parsed `/v1/chat/completions` body.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// `messages`.
    pub messages: Vec<Message>,
    /// `add_generation_prompt` (an extension; default true): end the rendered prompt with the
    /// template's assistant header.
    pub add_generation_prompt: bool,
    /// The other fields.
    pub params: Params,
}

/// The body's fields, taken out one at a time; what is left at the end is unknown.
struct Fields(Map<String, Value>);

/// The JSON type of a value, for messages.
fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl Fields {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let value: Value = serde_json::from_slice(body).map_err(|e| ApiError::MalformedJson(e.to_string()))?;
        match value {
            Value::Object(map) => Ok(Self(map)),
            other => Err(ApiError::MalformedJson(format!(
                "expected a JSON object, got {}",
                type_name(&other)
            ))),
        }
    }

    /// The raw value of `name`; JSON `null` counts as absent.
    fn raw(&mut self, name: &str) -> Option<Value> {
        self.0.remove(name).filter(|v| !v.is_null())
    }

    /// `name` as a `T`, or a 400 naming it and the expected type.
    fn take<T: DeserializeOwned>(&mut self, name: &str, expected: &str) -> Result<Option<T>, ApiError> {
        match self.raw(name) {
            None => Ok(None),
            Some(v) => {
                let got = type_name(&v);
                serde_json::from_value(v)
                    .map(Some)
                    .map_err(|_| ApiError::field(name, format!("`{name}` must be {expected}, got {got}")))
            }
        }
    }

    /// A parameter accepted only at its neutral value (`neutral` says which values are).
    fn neutral_only(&mut self, name: &str, neutral: impl Fn(&Value) -> bool, why: &str) -> Result<(), ApiError> {
        match self.raw(name) {
            Some(v) if !neutral(&v) => Err(ApiError::unsupported(
                name,
                format!("`{name}` is not supported by this server ({why})"),
            )),
            _ => Ok(()),
        }
    }

    /// Refuses whatever field is left.
    fn finish(self) -> Result<(), ApiError> {
        match self.0.into_iter().next() {
            Some((name, _)) => Err(ApiError::unsupported(
                name.clone(),
                format!("unknown or unsupported parameter `{name}`"),
            )),
            None => Ok(()),
        }
    }
}

fn is_zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}

/// Reads the fields both endpoints share.
fn params(f: &mut Fields, chat: bool) -> Result<Params, ApiError> {
    let mut p = Params {
        model: f.take("model", "a string")?,
        top_p: 1.0,
        ..Params::default()
    };
    let max_completion: Option<i64> = if chat {
        f.take("max_completion_tokens", "an integer")?
    } else {
        None
    };
    let max_tokens: Option<i64> = f.take("max_tokens", "an integer")?;
    for (name, v) in [("max_tokens", max_tokens), ("max_completion_tokens", max_completion)] {
        if let Some(v) = v {
            if v < 1 {
                return Err(ApiError::field(name, format!("`{name}` must be at least 1, got {v}")));
            }
            p.max_tokens = Some(v as usize);
        }
    }
    if let Some(t) = f.take::<f32>("temperature", "a number")? {
        if !(0.0..=2.0).contains(&t) {
            return Err(ApiError::field(
                "temperature",
                format!("`temperature` must be in [0, 2], got {t}"),
            ));
        }
        p.temperature = t;
    }
    if let Some(t) = f.take::<f32>("top_p", "a number")? {
        if !(t > 0.0 && t <= 1.0) {
            return Err(ApiError::field("top_p", format!("`top_p` must be in (0, 1], got {t}")));
        }
        p.top_p = t;
    }
    if let Some(s) = f.take::<i64>("seed", "an integer")? {
        p.seed = u32::try_from(s)
            .map_err(|_| ApiError::field("seed", format!("`seed` must be in 0..={}, got {s}", u32::MAX)))?;
    }
    match f.raw("stop") {
        None => {}
        Some(Value::String(s)) => p.stop_strings.push(s),
        Some(Value::Array(items)) => {
            for (i, item) in items.into_iter().enumerate() {
                match item {
                    Value::String(s) => p.stop_strings.push(s),
                    Value::Number(n) => match n.as_u64().and_then(|n| u32::try_from(n).ok()) {
                        Some(id) => p.stop_ids.push(id),
                        None => {
                            return Err(ApiError::field(
                                format!("stop[{i}]"),
                                format!("`stop[{i}]` is not a token id: {n}"),
                            ))
                        }
                    },
                    other => {
                        return Err(ApiError::field(
                            format!("stop[{i}]"),
                            format!("`stop[{i}]` must be a string or a token id, got {}", type_name(&other)),
                        ))
                    }
                }
            }
        }
        Some(other) => {
            return Err(ApiError::field(
                "stop",
                format!("`stop` must be a string or an array, got {}", type_name(&other)),
            ))
        }
    }
    if p.stop_strings.len() > MAX_STOP_STRINGS {
        return Err(ApiError::field(
            "stop",
            format!(
                "`stop` may hold at most {MAX_STOP_STRINGS} strings, got {}",
                p.stop_strings.len()
            ),
        ));
    }
    if p.stop_strings.iter().any(String::is_empty) {
        return Err(ApiError::field("stop", "`stop` strings must not be empty"));
    }
    p.stop_ids.extend(
        f.take::<Vec<u32>>("stop_token_ids", "an array of token ids")?
            .unwrap_or_default(),
    );
    p.stream = f.take("stream", "a boolean")?.unwrap_or(false);
    if let Some(options) = f.take::<Map<String, Value>>("stream_options", "an object")? {
        let mut options = Fields(options);
        p.include_usage = options
            .take("include_usage", "a boolean")
            .map_err(|_| {
                ApiError::field(
                    "stream_options.include_usage",
                    "`stream_options.include_usage` must be a boolean",
                )
            })?
            .unwrap_or(false);
        if let Err(ApiError::Unsupported { param, .. }) = options.finish() {
            let param = format!("stream_options.{param}");
            return Err(ApiError::unsupported(
                param.clone(),
                format!("unknown parameter `{param}`"),
            ));
        }
    }
    p.ignore_eos = f.take("ignore_eos", "a boolean")?.unwrap_or(false);
    if let Some(n) = f.take::<i64>("n", "an integer")? {
        if n != 1 {
            return Err(ApiError::unsupported(
                "n",
                format!("`n` must be 1 (one choice per request), got {n}"),
            ));
        }
    }
    let _: Option<String> = f.take("user", "a string")?;
    let no = "it needs the logits of every token, which the engine's greedy rounds never read back";
    f.neutral_only("logprobs", |v| v == &Value::Bool(false), no)?;
    f.neutral_only("top_logprobs", is_zero, no)?;
    f.neutral_only("frequency_penalty", is_zero, "only 0")?;
    f.neutral_only("presence_penalty", is_zero, "only 0")?;
    f.neutral_only("logit_bias", |v| v.as_object().is_some_and(Map::is_empty), "only {}")?;
    if chat {
        f.neutral_only(
            "response_format",
            |v| v.get("type") == Some(&Value::from("text")),
            "only text",
        )?;
        f.neutral_only("tools", |v| v.as_array().is_some_and(Vec::is_empty), "no tool calls")?;
        f.neutral_only("tool_choice", |v| v == "none", "no tool calls")?;
        let _: Option<bool> = f.take("parallel_tool_calls", "a boolean")?;
    } else {
        f.neutral_only("best_of", |v| v.as_f64() == Some(1.0), "only 1")?;
        f.neutral_only("echo", |v| v == &Value::Bool(false), "only false")?;
        f.neutral_only("suffix", |v| v.as_str() == Some(""), "no insertion")?;
    }
    Ok(p)
}

/// Parses a `/v1/completions` body.
pub fn parse_completion(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let mut f = Fields::parse(body)?;
    let prompt = match f.raw("prompt") {
        None => return Err(ApiError::field("prompt", "`prompt` is required")),
        Some(v) => prompt(v)?,
    };
    let params = params(&mut f, false)?;
    f.finish()?;
    Ok(CompletionRequest { prompt, params })
}

/// `prompt`: a string, an array of token ids, or a one-element array of either.
fn prompt(v: Value) -> Result<Prompt, ApiError> {
    let bad = |got: &Value| {
        ApiError::field(
            "prompt",
            format!(
                "`prompt` must be a string or an array of token ids, got {}",
                type_name(got)
            ),
        )
    };
    match v {
        Value::String(s) => Ok(Prompt::Text(s)),
        Value::Array(items) => {
            if items.len() == 1 && (items[0].is_string() || items[0].is_array()) {
                return prompt(items.into_iter().next().expect("one item"));
            }
            if items.first().is_some_and(|i| i.is_string() || i.is_array()) {
                return Err(ApiError::unsupported(
                    "prompt",
                    format!(
                        "`prompt` holds {} prompts; this server takes one per request",
                        items.len()
                    ),
                ));
            }
            let mut ids = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                match item.as_u64().and_then(|n| u32::try_from(n).ok()) {
                    Some(id) => ids.push(id),
                    None => {
                        return Err(ApiError::field(
                            format!("prompt[{i}]"),
                            format!("`prompt[{i}]` is not a token id: {item}"),
                        ))
                    }
                }
            }
            Ok(Prompt::Ids(ids))
        }
        other => Err(bad(&other)),
    }
}

/// Parses a `/v1/chat/completions` body.
pub fn parse_chat(body: &[u8]) -> Result<ChatRequest, ApiError> {
    let mut f = Fields::parse(body)?;
    let Some(raw) = f.raw("messages") else {
        return Err(ApiError::field("messages", "`messages` is required"));
    };
    let Value::Array(items) = raw else {
        return Err(ApiError::field(
            "messages",
            format!("`messages` must be an array, got {}", type_name(&raw)),
        ));
    };
    if items.is_empty() {
        return Err(ApiError::field("messages", "`messages` must not be empty"));
    }
    let messages = items
        .into_iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    let add_generation_prompt = f.take("add_generation_prompt", "a boolean")?.unwrap_or(true);
    let params = params(&mut f, true)?;
    f.finish()?;
    Ok(ChatRequest {
        messages,
        add_generation_prompt,
        params,
    })
}

fn message(i: usize, m: Value) -> Result<Message, ApiError> {
    let at = |field: &str| format!("messages[{i}].{field}");
    let Value::Object(map) = m else {
        return Err(ApiError::field(
            format!("messages[{i}]"),
            format!("`messages[{i}]` must be an object, got {}", type_name(&m)),
        ));
    };
    let mut f = Fields(map);
    let role: String = f
        .take("role", "a string")
        .map_err(|_| ApiError::field(at("role"), format!("`{}` must be a string", at("role"))))?
        .ok_or_else(|| ApiError::field(at("role"), format!("`{}` is required", at("role"))))?;
    let content = match f.raw("content") {
        None => String::new(),
        Some(Value::String(s)) => s,
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (k, part) in parts.iter().enumerate() {
                match (
                    part.get("type").and_then(Value::as_str),
                    part.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    _ => {
                        let param = format!("{}[{k}]", at("content"));
                        return Err(ApiError::unsupported(
                            param.clone(),
                            format!("`{param}`: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported"),
                        ));
                    }
                }
            }
            text
        }
        Some(other) => {
            return Err(ApiError::field(
                at("content"),
                format!(
                    "`{}` must be a string or an array of parts, got {}",
                    at("content"),
                    type_name(&other)
                ),
            ))
        }
    };
    let _: Option<String> = f.take("name", "a string")?;
    if let Err(ApiError::Unsupported { param, .. }) = f.finish() {
        let param = at(&param);
        return Err(ApiError::unsupported(
            param.clone(),
            format!("unknown or unsupported field `{param}`"),
        ));
    }
    Ok(Message { role, content })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(r: Result<impl std::fmt::Debug, ApiError>) -> (String, String) {
        let e = r.unwrap_err();
        (e.param().unwrap_or("").to_string(), e.to_string())
    }

    #[test]
    fn completion_fields() {
        let r =
            parse_completion(br#"{"model": "m", "prompt": [[1, 2]], "max_tokens": 5, "stop": ["a", 7], "seed": 3}"#)
                .unwrap();
        assert_eq!(r.prompt, Prompt::Ids(vec![1, 2]));
        assert_eq!(r.params.max_tokens, Some(5));
        assert_eq!(
            (r.params.stop_strings, r.params.stop_ids),
            (vec!["a".to_string()], vec![7])
        );
        assert_eq!(r.params.seed, 3);
        assert_eq!(
            err(parse_completion(br#"{"prompt": "x", "max_tokens": "5"}"#)).0,
            "max_tokens"
        );
        assert_eq!(err(parse_completion(br#"{"prompt": "x", "n": 2}"#)).0, "n");
        assert_eq!(
            err(parse_completion(br#"{"prompt": "x", "logprobs": 1}"#)).0,
            "logprobs"
        );
        assert_eq!(err(parse_completion(br#"{"prompt": "x", "wat": 1}"#)).0, "wat");
        assert_eq!(err(parse_completion(br#"{"prompt": [1, -2]}"#)).0, "prompt[1]");
        assert_eq!(err(parse_completion(br#"{"prompt": ["a", "b"]}"#)).0, "prompt");
        assert_eq!(err(parse_completion(br#"{"max_tokens": 1}"#)).0, "prompt");
        assert_eq!(
            err(parse_completion(br#"{"prompt": "x", "temperature": 9}"#)).0,
            "temperature"
        );
        assert!(err(parse_completion(b"{\"prompt\": ")).1.contains("not valid JSON"));
        assert!(parse_completion(br#"{"prompt": "x", "frequency_penalty": 0, "logprobs": null}"#).is_ok());
    }

    #[test]
    fn chat_fields() {
        let r =
            parse_chat(br#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}"#).unwrap();
        assert_eq!(r.messages[0].content, "hi");
        assert!(r.add_generation_prompt);
        assert_eq!(err(parse_chat(br#"{"messages": []}"#)).0, "messages");
        assert_eq!(
            err(parse_chat(br#"{"messages": [{"content": "x"}]}"#)).0,
            "messages[0].role"
        );
        assert_eq!(
            err(parse_chat(br#"{"messages": [{"role": "user", "content": 3}]}"#)).0,
            "messages[0].content"
        );
        assert_eq!(
            err(parse_chat(
                br#"{"messages": [{"role": "user", "content": "x"}], "tools": [{}]}"#
            ))
            .0,
            "tools"
        );
    }
}
