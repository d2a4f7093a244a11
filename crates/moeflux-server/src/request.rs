//! The request bodies of the generation endpoints, as OpenAI defines them,
//! and their checks: every bad value is a 400 naming the field.

use std::collections::BTreeMap;

use moeflux::sampling::SamplerConfig;
use moeflux::speculative::{DraftLength, DraftSettings, DraftSource};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::engine::Settings;
use crate::error::ApiError;

/// Most stop strings a request may give.
const MAX_STOP: usize = 16;
/// Most alternatives per token (OpenAI's bound).
const MAX_TOP_LOGPROBS: u64 = 20;

/// Parses a body as JSON.
pub fn json(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|err| ApiError::bad_body(format!("the body is not valid JSON: {err}")))
}

/// Reads a request from its JSON, naming the field at fault on error.
pub fn fields<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body.clone()).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        if path == "." {
            ApiError::bad_body(format!("the body does not fit this endpoint: {inner}"))
        } else {
            ApiError::invalid(path, inner.to_string())
        }
    })
}

/// Parses a body, naming the field at fault on error.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    fields(&json(body)?)
}

/// One string or several.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Debug, Default)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// The sampling and stopping fields both endpoints take (read from the
/// same body as the endpoint's own fields, not flattened into them, so
/// that errors name the field).
#[derive(Deserialize, Debug, Default)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<OneOrMany>,
    pub n: Option<i64>,
    pub logit_bias: Option<BTreeMap<String, f64>>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// vLLM's extension: generate past end-of-text tokens, up to
    /// `max_tokens` (for benchmarks that want answers of a fixed length).
    pub ignore_eos: Option<bool>,
    /// moeflux's extension: speculative decoding for this request,
    /// `lookup`, `mtp` or `off` (default: the server's `--draft`).
    pub draft: Option<String>,
    /// Tokens drafted per step, 1 to 16 (default: adaptive up to 6).
    pub draft_tokens: Option<i64>,
}

/// `POST /v1/chat/completions`.
#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub response_format: Option<Value>,
    /// Extra chat template variables (vLLM's extension), e.g.
    /// `{"enable_thinking": false}`.
    pub chat_template_kwargs: Option<BTreeMap<String, Value>>,
}

/// One message of a conversation.
#[derive(Deserialize, Debug)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    pub name: Option<String>,
    pub tool_calls: Option<Vec<Value>>,
    pub tool_call_id: Option<String>,
    pub reasoning_content: Option<String>,
}

/// A message's content: text, or parts of which only text is understood.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize, Debug)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    pub prompt: Value,
    /// The legacy form: how many alternatives per token.
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
}

impl Message {
    /// The message as the chat template sees it: content as one string.
    pub fn to_template(&self, index: usize) -> Result<Value, ApiError> {
        let field = |name: &str| format!("messages[{index}].{name}");
        if !matches!(
            self.role.as_str(),
            "system" | "developer" | "user" | "assistant" | "tool"
        ) {
            return Err(ApiError::invalid(
                field("role"),
                format!(
                    "unknown role {:?}: use system, user, assistant or tool",
                    self.role
                ),
            ));
        }
        let content = match &self.content {
            None => String::new(),
            Some(Content::Text(text)) => text.clone(),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for (i, part) in parts.iter().enumerate() {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(t)) => text.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                format!("messages[{index}].content[{i}]"),
                                format!(
                                    "parts of type {kind:?} are not supported: this model reads text parts only"
                                ),
                            ));
                        }
                    }
                }
                text
            }
        };
        if self.content.is_none() && self.tool_calls.is_none() {
            return Err(ApiError::invalid(
                field("content"),
                "is missing: give the message's text",
            ));
        }
        // The developer role is OpenAI's newer name for system.
        let role = if self.role == "developer" {
            "system"
        } else {
            &self.role
        };
        let mut message = serde_json::json!({ "role": role, "content": content });
        if let Some(calls) = &self.tool_calls {
            message["tool_calls"] = Value::from(calls.clone());
        }
        for (key, value) in [
            ("tool_call_id", &self.tool_call_id),
            ("name", &self.name),
            ("reasoning_content", &self.reasoning_content),
        ] {
            if let Some(v) = value {
                message[key] = Value::from(v.as_str());
            }
        }
        Ok(message)
    }
}

/// Checks a number against a range, naming the field.
fn ranged(name: &str, v: Option<f64>, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
    match v {
        Some(x) if !(x.is_finite() && (lo..=hi).contains(&x)) => Err(ApiError::invalid(
            name,
            format!("must be between {lo} and {hi}, got {x}"),
        )),
        v => Ok(v.map(|x| x as f32)),
    }
}

/// The limits a request's settings are checked against.
pub struct Bounds {
    /// The field holding the prompt (`messages` or `prompt`).
    pub prompt: &'static str,
    pub vocab: usize,
    pub context: usize,
    pub max_n: usize,
    /// The server's drafting, for requests that do not choose.
    pub draft: Option<DraftSettings>,
}

impl Common {
    /// The engine's settings for a prompt of `prompt_len` tokens, with the
    /// model's `defaults` for what the request leaves out.
    pub fn settings(
        &self,
        defaults: &SamplerConfig,
        max_tokens: Option<i64>,
        logprobs: Option<usize>,
        prompt_len: usize,
        bounds: &Bounds,
    ) -> Result<Settings, ApiError> {
        let mut s = defaults.clone();
        if let Some(t) = ranged("temperature", self.temperature, 0.0, 2.0)? {
            s.temperature = t;
        }
        if let Some(p) = self.top_p {
            if !(p.is_finite() && p > 0.0 && p <= 1.0) {
                return Err(ApiError::invalid(
                    "top_p",
                    format!("must be in (0, 1], got {p}"),
                ));
            }
            s.top_p = p as f32;
        }
        match self.top_k {
            // -1 is "off" in vLLM and llama.cpp.
            Some(-1) => s.top_k = 0,
            Some(k) if k < 0 => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("must be ≥ 0 (0 or -1: off), got {k}"),
                ));
            }
            Some(k) => s.top_k = usize::try_from(k).unwrap_or(usize::MAX),
            None => {}
        }
        if let Some(m) = ranged("min_p", self.min_p, 0.0, 1.0)? {
            s.min_p = m;
        }
        if let Some(p) = ranged("presence_penalty", self.presence_penalty, -2.0, 2.0)? {
            s.presence_penalty = p;
        }
        if let Some(p) = ranged("frequency_penalty", self.frequency_penalty, -2.0, 2.0)? {
            s.frequency_penalty = p;
        }
        if let Some(r) = self.repetition_penalty {
            if !(r.is_finite() && r > 0.0 && r <= 10.0) {
                return Err(ApiError::invalid(
                    "repetition_penalty",
                    format!("must be in (0, 10] (1 = off), got {r}"),
                ));
            }
            s.repetition_penalty = r as f32;
        }
        // A negative seed is as good a seed as any: its bits are used.
        s.seed = self.seed.map(|seed| seed as u64);
        let n = match self.n {
            None => 1,
            Some(n) if n >= 1 && n as u64 <= bounds.max_n as u64 => n as usize,
            Some(n) => {
                return Err(ApiError::invalid(
                    "n",
                    format!(
                        "must be between 1 and {} on this server, got {n}",
                        bounds.max_n
                    ),
                ));
            }
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(OneOrMany::One(s)) => vec![s.clone()],
            Some(OneOrMany::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOP {
            return Err(ApiError::invalid(
                "stop",
                format!("at most {MAX_STOP} stop strings, got {}", stop.len()),
            ));
        }
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                "stop",
                "an empty stop string would stop at once",
            ));
        }
        let mut logit_bias = Vec::new();
        for (key, &bias) in self.logit_bias.iter().flatten() {
            let param = format!("logit_bias.{key}");
            let id = key
                .parse::<u32>()
                .ok()
                .filter(|&id| (id as usize) < bounds.vocab)
                .ok_or_else(|| {
                    ApiError::invalid(&param, format!("keys are token ids below {}", bounds.vocab))
                })?;
            if !(bias.is_finite() && (-100.0..=100.0).contains(&bias)) {
                return Err(ApiError::invalid(
                    param,
                    format!("must be between -100 and 100, got {bias}"),
                ));
            }
            logit_bias.push((id, bias as f32));
        }
        if prompt_len == 0 {
            return Err(ApiError::invalid(
                bounds.prompt,
                "is empty after tokenization: give some text",
            ));
        }
        if prompt_len >= bounds.context {
            return Err(ApiError::context_length(
                bounds.prompt,
                format!(
                    "the prompt is {prompt_len} tokens, and this server's context is {} tokens: shorten it",
                    bounds.context
                ),
            ));
        }
        let room = bounds.context - prompt_len;
        let max_tokens = match max_tokens {
            None => room,
            Some(m) if m < 1 => {
                return Err(ApiError::invalid(
                    "max_tokens",
                    format!("must be at least 1, got {m}"),
                ));
            }
            Some(m) if m as u64 > room as u64 => {
                return Err(ApiError::context_length(
                    bounds.prompt,
                    format!(
                        "the prompt ({prompt_len} tokens) and max_tokens ({m}) exceed this server's \
                     context of {} tokens: ask for at most {room}",
                        bounds.context
                    ),
                ));
            }
            Some(m) => m as usize,
        };
        s.validate()
            .map_err(|e| ApiError::bad_body(e.to_string()))?;
        let draft = self.draft_settings(bounds.draft)?;
        Ok(Settings {
            n,
            max_tokens,
            sampling: s,
            stop,
            logit_bias,
            logprobs,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            draft,
        })
    }

    /// The request's speculative decoding: its `draft` and `draft_tokens`,
    /// or the server's.
    fn draft_settings(
        &self,
        server: Option<DraftSettings>,
    ) -> Result<Option<DraftSettings>, ApiError> {
        let source = match self.draft.as_deref() {
            None => server.map(|s| s.source),
            Some("off") => None,
            Some("lookup") => Some(DraftSource::Lookup),
            Some("mtp") => Some(DraftSource::Mtp),
            Some(other) => {
                return Err(ApiError::invalid(
                    "draft",
                    format!("must be \"lookup\", \"mtp\" or \"off\", got {other:?}"),
                ));
            }
        };
        let length = match self.draft_tokens {
            None => match (self.draft.is_some(), server) {
                (false, Some(server)) => server.length,
                _ => DraftLength::DEFAULT,
            },
            Some(k) if (1..=16).contains(&k) => DraftLength::Fixed(k as usize),
            Some(k) => {
                return Err(ApiError::invalid(
                    "draft_tokens",
                    format!("must be between 1 and 16, got {k}"),
                ));
            }
        };
        match source {
            Some(source) => Ok(Some(DraftSettings { source, length })),
            None if self.draft_tokens.is_some() && self.draft.as_deref() != Some("off") => {
                Err(ApiError::invalid(
                    "draft_tokens",
                    "sets how many tokens are drafted, and this request drafts none: \
                     add \"draft\": \"lookup\" or \"mtp\"",
                ))
            }
            None => Ok(None),
        }
    }
}

/// `top_logprobs` / legacy `logprobs`: 0 to 20 alternatives.
pub fn top_logprobs(name: &str, v: Option<i64>) -> Result<usize, ApiError> {
    match v {
        None => Ok(0),
        Some(k) if (0..=MAX_TOP_LOGPROBS as i64).contains(&k) => Ok(k as usize),
        Some(k) => Err(ApiError::invalid(
            name,
            format!("must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
        )),
    }
}
