//! Chat templates: the checkpoint's Jinja `chat_template` from `tokenizer_config.json`, rendered
//! with minijinja (with Python string methods, as HF templates use them).

use std::path::Path;

use minijinja::{context, Environment, Error, ErrorKind};
use serde_json::Value;

use crate::error::ApiError;
use crate::request::Message;

/// A compiled chat template and the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

/// A special token of `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_text(config: &Value, key: &str) -> String {
    match config.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// The template of a `tokenizer_config.json` text (`chat_template` as a string, or a list of
    /// `{"name", "template"}` of which `default` is taken); `None` when it has none.
    pub fn from_tokenizer_config(text: &str, path: &Path) -> Result<Option<Self>, String> {
        let config: Value = serde_json::from_str(text).map_err(|e| format!("{}: {e}", path.display()))?;
        let source = match config.get("chat_template") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(list)) => {
                let named = |name: &str| {
                    list.iter()
                        .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
                        .and_then(|t| t.get("template"))
                        .and_then(Value::as_str)
                };
                match named("default") {
                    Some(s) => s.to_string(),
                    None => return Err(format!("{}: `chat_template` has no `default` entry", path.display())),
                }
            }
            _ => return Ok(None),
        };
        Self::new(
            source,
            token_text(&config, "bos_token"),
            token_text(&config, "eos_token"),
        )
        .map(Some)
        .map_err(|e| format!("{}: chat_template: {e}", path.display()))
    }

    /// Compiles `source`.
    pub fn new(source: String, bos_token: String, eos_token: String) -> Result<Self, Error> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        });
        env.add_template_owned("chat", source)?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The prompt text of `messages`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, ApiError> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| ApiError::Internal(format!("chat template: {e}")))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| match e.kind() {
                // `raise_exception` in the template: the messages broke its rules.
                ErrorKind::InvalidOperation => ApiError::field(
                    "messages",
                    format!(
                        "the chat template refused the messages: {}",
                        e.detail().unwrap_or_default()
                    ),
                ),
                _ => ApiError::Internal(format!("rendering the chat template: {e}")),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn renders_hf_style_templates() {
        let config = r#"{"bos_token": {"content": "<s>"}, "chat_template": "{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['user', 'system'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}<|{{ m['role'] }}|>{{ m['content'].strip() }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"}"#;
        let t = ChatTemplate::from_tokenizer_config(config, Path::new("x"))
            .unwrap()
            .unwrap();
        let text = t
            .render(&[msg("system", "be brief "), msg("user", " hi")], true)
            .unwrap();
        assert_eq!(text, "<s><|system|>be brief\n<|user|>hi\n<|assistant|>");
        let text = t.render(&[msg("user", "hi")], false).unwrap();
        assert_eq!(text, "<s><|user|>hi\n");
        let err = t.render(&[msg("tool", "x")], true).unwrap_err();
        assert_eq!(err.param(), Some("messages"));
        assert!(err.to_string().contains("bad role tool"), "{err}");
        assert!(ChatTemplate::from_tokenizer_config("{}", Path::new("x"))
            .unwrap()
            .is_none());
    }
}
