//! Engine events turned into OpenAI's response bodies: whole responses,
//! and the chunks of a stream (`chat.completion.chunk`,
//! `text_completion`), for chat and plain completions alike.

use std::sync::Arc;

use moeflux::text::{FinishReason, TokenLogprob, Tokenizer};
use serde_json::{Value, json};

use crate::engine::Event;
use crate::error::ApiError;
use crate::output::{ChatSplitter, Split};

/// Which endpoint's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Chat,
    Completion,
}

/// What identifies a response and how it is shaped.
pub struct Header {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub kind: Kind,
    /// Report log-probabilities.
    pub logprobs: bool,
    /// Chat: the prompt opened a `<think>` block.
    pub thinking: bool,
    /// Chat: the request gave tools; parse the model's calls.
    pub tools: bool,
    /// Streams: end with a usage chunk.
    pub include_usage: bool,
}

/// One choice's state while events arrive.
struct ChoiceState {
    splitter: ChatSplitter,
    /// Completions: bytes of text so far (for `text_offset`).
    offset: usize,
    finish: Option<&'static str>,
    text: Split,
    logprobs: Vec<Value>,
    legacy: LegacyLogprobs,
}

#[derive(Default)]
struct LegacyLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<f32>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<usize>,
}

/// Builds a response (or a stream's chunks) from engine events.
pub struct Builder {
    header: Header,
    tokenizer: Arc<Tokenizer>,
    choices: Vec<ChoiceState>,
    usage: Option<Value>,
}

fn finish_name(reason: FinishReason, called: bool) -> &'static str {
    match reason {
        FinishReason::EndOfText | FinishReason::StopString | FinishReason::Interrupted
            if called =>
        {
            "tool_calls"
        }
        FinishReason::EndOfText | FinishReason::StopString | FinishReason::Interrupted => "stop",
        FinishReason::MaxTokens | FinishReason::ContextFull => "length",
    }
}

impl Builder {
    pub fn new(header: Header, n: usize, tokenizer: Arc<Tokenizer>) -> Builder {
        let choices = (0..n)
            .map(|_| ChoiceState {
                splitter: ChatSplitter::new(header.thinking, header.tools),
                offset: 0,
                finish: None,
                text: Split::default(),
                logprobs: Vec::new(),
                legacy: LegacyLogprobs::default(),
            })
            .collect();
        Builder {
            header,
            tokenizer,
            choices,
            usage: None,
        }
    }

    fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// The chat form of one token's log-probability.
    fn chat_logprob(&self, lp: &TokenLogprob) -> Value {
        let entry = |id: u32, logprob: f32| {
            let token = self.token_text(id);
            json!({ "token": token, "logprob": logprob, "bytes": token.as_bytes() })
        };
        let mut value = entry(lp.token, lp.logprob);
        value["top_logprobs"] = lp.top.iter().map(|&(id, l)| entry(id, l)).collect();
        value
    }

    /// Takes one event; returns the stream chunks it makes (whole
    /// responses ignore them and call [`Builder::response`] at the end).
    pub fn event(&mut self, event: Event) -> Result<Vec<Value>, ApiError> {
        let mut chunks = Vec::new();
        match event {
            Event::Token {
                choice,
                token,
                text,
                logprob,
            } => {
                let lp = logprob.map(|lp| {
                    let token_text = self.token_text(token);
                    let legacy_top: serde_json::Map<String, Value> = lp
                        .top
                        .iter()
                        .map(|&(id, l)| (self.token_text(id), json!(l)))
                        .collect();
                    (self.chat_logprob(&lp), token_text, lp.logprob, legacy_top)
                });
                let state = &mut self.choices[choice];
                let offset = state.offset;
                state.offset += text.len();
                let mut legacy = None;
                let mut chat_lp = None;
                if let Some((chat, token_text, logprob, top)) = lp {
                    state.logprobs.push(chat.clone());
                    state.legacy.tokens.push(token_text.clone());
                    state.legacy.token_logprobs.push(logprob);
                    state.legacy.top_logprobs.push(Value::Object(top.clone()));
                    state.legacy.text_offset.push(offset);
                    chat_lp = Some(json!({ "content": [chat] }));
                    legacy = Some(json!({
                        "tokens": [token_text], "token_logprobs": [logprob],
                        "top_logprobs": [top], "text_offset": [offset],
                    }));
                }
                match self.header.kind {
                    Kind::Chat => {
                        let split = state.splitter.push(&text);
                        if !split.is_empty() || chat_lp.is_some() {
                            chunks.push(self.chat_chunk(choice, &split, chat_lp, None));
                        }
                        self.choices[choice].text.append(split);
                    }
                    Kind::Completion => {
                        if !text.is_empty() || legacy.is_some() {
                            chunks.push(self.completion_chunk(choice, &text, legacy, None));
                        }
                        self.choices[choice].text.content.push_str(&text);
                    }
                }
            }
            Event::Finish {
                choice,
                reason,
                text,
            } => {
                let state = &mut self.choices[choice];
                match self.header.kind {
                    Kind::Chat => {
                        let mut split = state.splitter.push(&text);
                        split.append(state.splitter.finish());
                        let name = finish_name(reason, state.splitter.called());
                        state.finish = Some(name);
                        chunks.push(self.chat_chunk(choice, &split, None, Some(name)));
                        self.choices[choice].text.append(split);
                    }
                    Kind::Completion => {
                        let name = finish_name(reason, false);
                        state.finish = Some(name);
                        state.text.content.push_str(&text);
                        chunks.push(self.completion_chunk(choice, &text, None, Some(name)));
                    }
                }
            }
            Event::Done {
                prompt_tokens,
                completion_tokens,
            } => {
                let usage = json!({
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                });
                if self.header.include_usage {
                    let mut chunk = self.envelope();
                    chunk["choices"] = json!([]);
                    chunk["usage"] = usage.clone();
                    chunks.push(chunk);
                }
                self.usage = Some(usage);
            }
            Event::Failed(err) => return Err(err),
        }
        Ok(chunks)
    }

    pub fn kind(&self) -> Kind {
        self.header.kind
    }

    /// Whether the `Done` event has come.
    pub fn done(&self) -> bool {
        self.usage.is_some()
    }

    fn envelope(&self) -> Value {
        let object = match self.header.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        let mut chunk = json!({
            "id": self.header.id,
            "object": object,
            "created": self.header.created,
            "model": self.header.model,
        });
        if self.header.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    /// The first chunk of each chat choice: the assistant's role.
    pub fn role_chunks(&self) -> Vec<Value> {
        (0..self.choices.len())
            .map(|i| {
                let mut chunk = self.envelope();
                chunk["choices"] = json!([{
                    "index": i,
                    "delta": { "role": "assistant", "content": "" },
                    "logprobs": null,
                    "finish_reason": null,
                }]);
                chunk
            })
            .collect()
    }

    fn chat_chunk(
        &self,
        choice: usize,
        split: &Split,
        logprobs: Option<Value>,
        finish: Option<&str>,
    ) -> Value {
        let mut delta = serde_json::Map::new();
        if !split.content.is_empty() {
            delta.insert("content".into(), json!(split.content));
        }
        if !split.reasoning.is_empty() {
            delta.insert("reasoning_content".into(), json!(split.reasoning));
        }
        if !split.tool_calls.is_empty() {
            let before = self.choices[choice].text.tool_calls.len();
            let calls: Vec<Value> = split
                .tool_calls
                .iter()
                .enumerate()
                .map(|(i, call)| {
                    let mut v = serde_json::to_value(call).unwrap_or(Value::Null);
                    v["index"] = json!(before + i);
                    v
                })
                .collect();
            delta.insert("tool_calls".into(), Value::Array(calls));
        }
        let mut chunk = self.envelope();
        chunk["choices"] = json!([{
            "index": choice,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
        }]);
        chunk
    }

    fn completion_chunk(
        &self,
        choice: usize,
        text: &str,
        logprobs: Option<Value>,
        finish: Option<&str>,
    ) -> Value {
        let mut chunk = self.envelope();
        chunk["choices"] = json!([{
            "index": choice,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish,
        }]);
        chunk
    }

    /// The whole response, once `Done` has come.
    pub fn response(self) -> Value {
        let logprobs = self.header.logprobs;
        let choices: Vec<Value> = self
            .choices
            .into_iter()
            .enumerate()
            .map(|(i, c)| match self.header.kind {
                Kind::Chat => {
                    let mut message = json!({
                        "role": "assistant",
                        "content": if c.text.content.is_empty() && !c.text.tool_calls.is_empty() {
                            Value::Null
                        } else {
                            json!(c.text.content)
                        },
                    });
                    if !c.text.reasoning.is_empty() {
                        message["reasoning_content"] = json!(c.text.reasoning);
                    }
                    if !c.text.tool_calls.is_empty() {
                        message["tool_calls"] = json!(c.text.tool_calls);
                    }
                    json!({
                        "index": i,
                        "message": message,
                        "logprobs": if logprobs { json!({ "content": c.logprobs }) } else { Value::Null },
                        "finish_reason": c.finish,
                    })
                }
                Kind::Completion => json!({
                    "index": i,
                    "text": c.text.content,
                    "logprobs": if logprobs {
                        json!({
                            "tokens": c.legacy.tokens,
                            "token_logprobs": c.legacy.token_logprobs,
                            "top_logprobs": c.legacy.top_logprobs,
                            "text_offset": c.legacy.text_offset,
                        })
                    } else {
                        Value::Null
                    },
                    "finish_reason": c.finish,
                }),
            })
            .collect();
        json!({
            "id": self.header.id,
            "object": match self.header.kind {
                Kind::Chat => "chat.completion",
                Kind::Completion => "text_completion",
            },
            "created": self.header.created,
            "model": self.header.model,
            "choices": choices,
            "usage": self.usage,
        })
    }
}

impl Split {
    /// Adds `other` after `self`.
    pub fn append(&mut self, other: Split) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
        self.tool_calls.extend(other.tool_calls);
    }
}

#[cfg(test)]
mod tests {
    use moeflux::text::Tokenizer;

    use super::*;

    fn builder(tools: bool, include_usage: bool) -> Builder {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bundled/qwen35-tiny");
        let header = Header {
            id: "chatcmpl-1".into(),
            created: 0,
            model: "m".into(),
            kind: Kind::Chat,
            logprobs: false,
            thinking: false,
            tools,
            include_usage,
        };
        Builder::new(header, 1, Arc::new(Tokenizer::from_dir(&dir).unwrap()))
    }

    fn token(text: &str) -> Event {
        Event::Token {
            choice: 0,
            token: 5,
            text: text.into(),
            logprob: None,
        }
    }

    /// The model's text in pieces cut inside the tags.
    const PIECES: [&str; 6] = [
        "<think>Rain.</th",
        "ink>\n\nLet me see.<tool",
        "_call>\n{\"name\": \"weather\", ",
        "\"arguments\": {\"town\": \"Bath\"}}\n</tool_call>",
        "\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n",
        "</tool_call>",
    ];

    #[test]
    fn tool_calls_stream_as_deltas_and_end_with_their_finish_reason() {
        let mut b = builder(true, true);
        let mut chunks = Vec::new();
        for piece in PIECES {
            chunks.extend(b.event(token(piece)).unwrap());
        }
        let finish = Event::Finish {
            choice: 0,
            reason: FinishReason::EndOfText,
            text: String::new(),
        };
        chunks.extend(b.event(finish).unwrap());
        let done = Event::Done {
            prompt_tokens: 3,
            completion_tokens: 6,
        };
        chunks.extend(b.event(done).unwrap());
        let deltas: Vec<&Value> = chunks[..chunks.len() - 1]
            .iter()
            .map(|c| &c["choices"][0]["delta"])
            .collect();
        let text =
            |key: &str| -> String { deltas.iter().filter_map(|d| d[key].as_str()).collect() };
        assert_eq!(text("reasoning_content"), "Rain.");
        assert_eq!(text("content"), "Let me see.");
        let calls: Vec<&Value> = deltas
            .iter()
            .filter_map(|d| d["tool_calls"].as_array())
            .flatten()
            .collect();
        assert_eq!(calls.len(), 2);
        for (i, (call, (name, args))) in calls
            .iter()
            .zip([("weather", "{\"town\":\"Bath\"}"), ("time", "{}")])
            .enumerate()
        {
            assert_eq!(call["index"], i);
            assert_eq!(call["type"], "function");
            assert!(call["id"].as_str().unwrap().starts_with("call_"));
            assert_eq!(call["function"]["name"], name);
            assert_eq!(call["function"]["arguments"], args);
        }
        let last_choice = &chunks[chunks.len() - 2]["choices"][0];
        assert_eq!(last_choice["finish_reason"], "tool_calls");
        assert_eq!(chunks.last().unwrap()["usage"]["total_tokens"], 9);

        // The whole answer: the same parts in the message.
        let mut b = builder(true, false);
        for piece in PIECES {
            b.event(token(piece)).unwrap();
        }
        for event in [
            Event::Finish {
                choice: 0,
                reason: FinishReason::StopString,
                text: String::new(),
            },
            Event::Done {
                prompt_tokens: 3,
                completion_tokens: 6,
            },
        ] {
            b.event(event).unwrap();
        }
        let answer = b.response();
        let message = &answer["choices"][0]["message"];
        assert_eq!(message["reasoning_content"], "Rain.");
        assert_eq!(message["content"], "Let me see.");
        assert_eq!(message["tool_calls"][1]["function"]["name"], "time");
        assert_eq!(answer["choices"][0]["finish_reason"], "tool_calls");
    }
}
