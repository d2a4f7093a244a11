//! The HTTP endpoints.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use futures_util::StreamExt;
use futures_util::stream;
use llguidance::api::TopLevelGrammar;
use moeflux::text::ChatOptions;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::AppState;
use crate::constrain;
use crate::engine::{Event, Job};
use crate::error::{ApiError, from_library};
use crate::request::{self, ChatRequest, Common, CompletionRequest, parse};
use crate::response::{Builder, Header, Kind};

type ApiResult<T> = Result<T, ApiError>;

/// The body, or the reason it could not be read (413 beyond the limit).
fn body(body: Result<Bytes, BytesRejection>) -> ApiResult<Bytes> {
    body.map_err(|rejection| ApiError {
        status: rejection.status(),
        ..ApiError::bad_body(match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => {
                "the body is larger than this server's limit (--max-body-mb)".to_string()
            }
            _ => format!("the body could not be read: {rejection}"),
        })
    })
}

/// Checks the API key (all endpoints but /health and the page) and counts
/// 4xx answers.
pub async fn guard(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    // The page holds nothing secret; its requests carry the key.
    if let Some(key) = &state.options.api_key
        && !matches!(request.uri().path(), "/health" | "/")
    {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| same(g.as_bytes(), key.as_bytes())) {
            state.engine.metrics.client_errors.inc();
            return ApiError::unauthorized().into_response();
        }
    }
    let response = next.run(request).await;
    if response.status().is_client_error() {
        state.engine.metrics.client_errors.inc();
    }
    response
}

/// Compares in time independent of where the texts differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub async fn not_found(request: Request) -> ApiError {
    ApiError::not_found(request.uri().path())
}

pub async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

/// The chat page: one static file, no build step.
pub async fn page() -> Html<&'static str> {
    Html(include_str!("chat.html"))
}

pub async fn health() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

pub async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.options.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "moeflux",
            "max_model_len": state.options.limits.context,
        }],
    }))
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.engine.metrics.render(),
    )
        .into_response()
}

#[derive(Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<request::Message>>,
    add_special_tokens: Option<bool>,
}

pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    raw: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<Value>> {
    let req: TokenizeRequest = parse(&body(raw)?)?;
    state.check_model(req.model.as_deref())?;
    let tokens = match (req.prompt, req.messages) {
        (Some(prompt), None) => state
            .tokenizer
            .encode(&prompt, req.add_special_tokens.unwrap_or(true))
            .map_err(|e| from_library("prompt", e))?,
        (None, Some(messages)) => state.chat_prompt(&messages, None, &Default::default())?.0,
        _ => {
            return Err(ApiError::bad_body(
                "give either \"prompt\" (a text) or \"messages\" (a conversation)",
            ));
        }
    };
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": state.options.limits.context,
        "tokens": tokens,
    })))
}

#[derive(Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<i64>,
}

pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    raw: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<Value>> {
    let req: DetokenizeRequest = parse(&body(raw)?)?;
    state.check_model(req.model.as_deref())?;
    let ids = state.token_ids("tokens", &req.tokens)?;
    let text = state
        .tokenizer
        .decode(&ids, false)
        .map_err(|e| from_library("tokens", e))?;
    Ok(Json(json!({ "prompt": text })))
}

pub async fn chat(
    State(state): State<Arc<AppState>>,
    raw: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let value = request::json(&body(raw)?)?;
    let common: Common = request::fields(&value)?;
    let req: ChatRequest = request::fields(&value)?;
    state.check_model(common.model.as_deref())?;
    let (tools, grammar) = constraints(&req)?;
    let mut options = ChatOptions {
        add_generation_prompt: true,
        ..ChatOptions::default()
    };
    options
        .extra
        .extend(req.chat_template_kwargs.clone().unwrap_or_default());
    let (prompt, thinking) = state.chat_prompt(&req.messages, tools, &options)?;
    let top = request::top_logprobs("top_logprobs", req.top_logprobs)?;
    if req.top_logprobs.is_some() && req.logprobs != Some(true) {
        return Err(ApiError::invalid(
            "top_logprobs",
            "needs \"logprobs\": true",
        ));
    }
    let logprobs = (req.logprobs == Some(true)).then_some(top);
    let max_tokens = req.max_completion_tokens.or(common.max_tokens);
    let settings = common.settings(
        &state.defaults,
        max_tokens,
        logprobs,
        prompt.len(),
        &state.bounds("messages"),
    )?;
    // A grammar starts the answer at once: no thinking before it.
    let thinking = thinking && grammar.is_none();
    let constraints = match grammar {
        Some((param, grammar)) => {
            let grammars = state.grammars.as_ref().map_err(|why| {
                ApiError::invalid(param, format!("cannot be enforced with this model: {why}"))
            })?;
            (0..settings.n)
                .map(|_| grammars.matcher(param, grammar.clone()))
                .collect::<Result<_, _>>()?
        }
        None => Vec::new(),
    };
    let header = Header {
        id: format!("chatcmpl-{:024x}", rand::random::<u128>() >> 32),
        created: now(),
        model: state.options.model_name.clone(),
        kind: Kind::Chat,
        logprobs: logprobs.is_some(),
        thinking,
        tools: tools.is_some(),
        include_usage: common
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
    };
    run(
        state,
        Job::new(prompt, settings, constraints),
        header,
        common.stream.unwrap_or(false),
    )
    .await
}

/// A grammar the answer must follow, with the field that asked for it.
type Grammar = (&'static str, TopLevelGrammar);

/// The tools the template lists, and the grammar the answer must follow.
fn constraints(req: &ChatRequest) -> ApiResult<(Option<&[Value]>, Option<Grammar>)> {
    let tools = req.tools.as_deref().filter(|t| !t.is_empty());
    let format = match &req.response_format {
        Some(format) => constrain::response_format(format)?,
        None => None,
    };
    let choice = match &req.tool_choice {
        None => None,
        Some(Value::String(s)) if s == "auto" => None,
        Some(Value::String(s)) if s == "none" => {
            return Ok((None, format.map(|g| ("response_format", g))));
        }
        Some(Value::String(s)) if s == "required" => {
            let tools = tools
                .ok_or_else(|| ApiError::invalid("tool_choice", "\"required\" needs tools"))?;
            Some(constrain::tool_call(tools)?)
        }
        Some(named) => {
            let name = named
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            let named: Vec<Value> = tools
                .unwrap_or_default()
                .iter()
                .filter(|t| {
                    t.get("function")
                        .and_then(|f| f.get("name"))
                        .and_then(Value::as_str)
                        == Some(name)
                })
                .cloned()
                .collect();
            if named.is_empty() {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("names {name:?}, which is not among the tools"),
                ));
            }
            Some(constrain::tool_call(&named)?)
        }
    };
    match (format, choice) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "response_format",
            "cannot be combined with a tool_choice that forces a call",
        )),
        (Some(g), None) => Ok((tools, Some(("response_format", g)))),
        (None, Some(g)) => Ok((tools, Some(("tool_choice", g)))),
        (None, None) => Ok((tools, None)),
    }
}

pub async fn completions(
    State(state): State<Arc<AppState>>,
    raw: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let value = request::json(&body(raw)?)?;
    let common: Common = request::fields(&value)?;
    let req: CompletionRequest = request::fields(&value)?;
    state.check_model(common.model.as_deref())?;
    if req.echo == Some(true) {
        return Err(ApiError::invalid(
            "echo",
            "is not supported: the answer holds the new text only",
        ));
    }
    if req.suffix.is_some() {
        return Err(ApiError::invalid(
            "suffix",
            "is not supported: this model does not fill in the middle",
        ));
    }
    if let Some(best_of) = req.best_of
        && best_of != common.n.unwrap_or(1)
    {
        return Err(ApiError::invalid("best_of", "is supported only equal to n"));
    }
    let prompt = state.completion_prompt(&req.prompt)?;
    let top = request::top_logprobs("logprobs", req.logprobs)?;
    let logprobs = req.logprobs.map(|_| top);
    let settings = common.settings(
        &state.defaults,
        common.max_tokens,
        logprobs,
        prompt.len(),
        &state.bounds("prompt"),
    )?;
    let header = Header {
        id: format!("cmpl-{:024x}", rand::random::<u128>() >> 32),
        created: now(),
        model: state.options.model_name.clone(),
        kind: Kind::Completion,
        logprobs: logprobs.is_some(),
        thinking: false,
        tools: false,
        include_usage: common
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
    };
    run(
        state,
        Job::new(prompt, settings, Vec::new()),
        header,
        common.stream.unwrap_or(false),
    )
    .await
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Queues the job and answers with the whole response or a stream.
async fn run(
    state: Arc<AppState>,
    (job, mut inbox): (Job, mpsc::UnboundedReceiver<Event>),
    header: Header,
    stream: bool,
) -> ApiResult<Response> {
    let n = job.settings.n;
    state.engine.submit(job)?;
    state.engine.metrics.requests.inc();
    if !stream {
        let mut builder = Builder::new(header, n, state.tokenizer.clone());
        while let Some(event) = inbox.recv().await {
            builder.event(event)?;
            if builder.done() {
                return Ok(Json(builder.response()).into_response());
            }
        }
        return Err(ApiError::unavailable(
            "the engine stopped during the request",
        ));
    }
    let builder = Builder::new(header, n, state.tokenizer.clone());
    let first = match builder.kind() {
        Kind::Chat => builder.role_chunks(),
        Kind::Completion => Vec::new(),
    };
    // Dropping the stream (the client went away) drops `inbox`, which the
    // engine sees at its next step.
    let rest = stream::unfold(
        (inbox, builder, false),
        |(mut inbox, mut builder, ended)| async move {
            if ended {
                return None;
            }
            let chunks = match inbox.recv().await {
                None => vec![ApiError::unavailable("the engine stopped during the request").body()],
                Some(event) => match builder.event(event) {
                    Ok(chunks) => {
                        let ended = builder.done();
                        return Some((chunks, (inbox, builder, ended)));
                    }
                    Err(err) => vec![err.body()],
                },
            };
            Some((chunks, (inbox, builder, true)))
        },
    )
    .flat_map(stream::iter);
    Ok(sse(stream::iter(first).chain(rest)))
}

/// Server-sent events from JSON chunks, ending with `[DONE]`.
fn sse(chunks: impl futures_util::Stream<Item = Value> + Send + 'static) -> Response {
    let events = chunks
        .map(|chunk| Ok::<_, Infallible>(SseEvent::default().data(chunk.to_string())))
        .chain(stream::once(async {
            Ok(SseEvent::default().data("[DONE]"))
        }));
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}
