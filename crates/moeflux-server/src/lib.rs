//! An OpenAI-compatible HTTP server for moeflux, with continuous batching.
//!
//! [`router`] starts the engine thread (which owns the sessions and runs
//! every running request in one [`moeflux::forward_batch`] per step; see
//! `engine/`) and returns the axum router of the endpoints:
//! `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
//! `GET /health`, `GET /metrics`, `POST /tokenize` and `POST /detokenize`;
//! and a chat page at `/`.
//! [`serve`] runs it on a listener until a shutdown signal.
//!
//! ```no_run
//! use std::sync::Arc;
//! use moeflux::{Model, ModelOptions};
//! use moeflux_server::{ServerOptions, router, serve};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
//! let model = Arc::new(Model::open(&dir, &ModelOptions::default())?);
//! let options = ServerOptions::for_model(&model, "qwen35-tiny");
//! let app = router(model, options)?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! serve(listener, app, async { tokio::signal::ctrl_c().await.ok(); }).await?;
//! # Ok(())
//! # }
//! ```

mod constrain;
mod engine;
mod error;
mod metrics;
mod output;
mod prefix;
mod request;
mod response;
mod routes;

pub use engine::wait_for_engines;

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use moeflux::Model;
use moeflux::backend::Backend;
use moeflux::sampling::SamplerConfig;
use moeflux::speculative::DraftSettings;
use moeflux::text::{ChatOptions, ChatTemplate, Tokenizer};
use serde_json::Value;

pub use engine::Limits;
pub use error::ApiError;

use engine::EngineHandle;
use error::from_library;
use metrics::Metrics;
use request::{Bounds, Message};

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// The name `/v1/models` lists and requests may give as `model`.
    pub model_name: String,
    /// When set, every endpoint but `/health` (and the static chat page,
    /// whose requests send the key) wants `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Most choices (`n`) one request may ask for.
    pub max_n: usize,
    /// Speculative decoding of requests that do not choose (their `draft`
    /// field); `None`: off.
    pub draft: Option<DraftSettings>,
    pub limits: Limits,
}

/// Prompt tokens a step reads by default on a backend that computes on the
/// host: a step of a whole prefill chunk (512 tokens) takes seconds there,
/// which every decoding sequence of the batch would wait.
const HOST_PROMPT_STEP: usize = 64;

impl ServerOptions {
    /// Defaults for `model`: 16 sequences per batch, a queue of 64, the
    /// context bounded by memory ([`Model::default_context`]), half the
    /// backend's free memory (and at least one full context) for KV caches,
    /// a quarter of it for prefix reuse, 8 MiB bodies, no timeout; a step
    /// reads a prefill chunk of prompts (on the host at most 64 tokens).
    pub fn for_model<B: Backend>(model: &Model<B>, name: &str) -> ServerOptions {
        let context = model.default_context();
        let per = model.kv_bytes_per_position();
        let full = context as u64 * per;
        let free = model.backend().state_memory().map_or(full, |m| m / 2);
        ServerOptions {
            model_name: name.to_string(),
            api_key: None,
            max_body_bytes: 8 << 20,
            max_n: 16,
            draft: None,
            limits: Limits {
                max_sequences: 16,
                queue: 64,
                context,
                kv_budget: free.max(full),
                prefill_per_step: match model.backend().forks_on_host() {
                    true => model.prefill_chunk().min(HOST_PROMPT_STEP),
                    false => model.prefill_chunk(),
                },
                prefix_cache: free.max(full) / 4,
                request_timeout: None,
            },
        }
    }
}

/// What the handlers share.
pub(crate) struct AppState {
    engine: EngineHandle,
    tokenizer: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    /// Constrained decoding, or why this model's vocabulary does not allow
    /// it.
    grammars: Result<constrain::Grammars, String>,
    defaults: SamplerConfig,
    options: ServerOptions,
    vocab: usize,
    created: u64,
}

impl AppState {
    fn check_model(&self, asked: Option<&str>) -> Result<(), ApiError> {
        match asked {
            Some(name) if name != self.options.model_name => {
                Err(ApiError::unknown_model(name, &self.options.model_name))
            }
            _ => Ok(()),
        }
    }

    /// The limits of a request whose prompt is in the field `prompt`.
    fn bounds(&self, prompt: &'static str) -> Bounds {
        Bounds {
            prompt,
            vocab: self.vocab,
            context: self.options.limits.context,
            max_n: self.options.max_n.min(self.options.limits.max_sequences),
            draft: self.options.draft,
        }
    }

    /// Token ids given by a client, checked against the vocabulary.
    fn token_ids(&self, param: &str, ids: &[i64]) -> Result<Vec<u32>, ApiError> {
        ids.iter()
            .enumerate()
            .map(|(i, &id)| {
                u32::try_from(id)
                    .ok()
                    .filter(|&id| (id as usize) < self.vocab)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            format!("{param}[{i}]"),
                            format!(
                                "{id} is not a token id of this model (0 to {})",
                                self.vocab - 1
                            ),
                        )
                    })
            })
            .collect()
    }

    /// The conversation through the chat template, tokenized; and whether
    /// the prompt leaves the model inside an opened `<think>`.
    fn chat_prompt(
        &self,
        messages: &[Message],
        tools: Option<&[Value]>,
        options: &ChatOptions,
    ) -> Result<(Vec<u32>, bool), ApiError> {
        let Some(template) = &self.template else {
            return Err(ApiError::bad_body(
                "this model has no chat template: use /v1/completions with a plain prompt",
            ));
        };
        if messages.is_empty() {
            return Err(ApiError::invalid(
                "messages",
                "is empty: give at least one message",
            ));
        }
        let messages = messages
            .iter()
            .enumerate()
            .map(|(i, m)| m.to_template(i))
            .collect::<Result<Vec<_>, _>>()?;
        let text = template
            .render_json(&messages, tools, options)
            .map_err(|e| from_library("messages", e))?;
        let thinking = text.trim_end().ends_with("<think>");
        let ids = self
            .tokenizer
            .encode(&text, false)
            .map_err(|e| from_library("messages", e))?;
        Ok((ids, thinking))
    }

    /// A completion's `prompt`: a text or token ids, alone or as a list of
    /// one.
    fn completion_prompt(&self, prompt: &Value) -> Result<Vec<u32>, ApiError> {
        let encode = |text: &str| {
            self.tokenizer
                .encode(text, true)
                .map_err(|e| from_library("prompt", e))
        };
        let ids = |values: &[Value]| {
            let ids: Option<Vec<i64>> = values.iter().map(Value::as_i64).collect();
            match ids {
                Some(ids) => self.token_ids("prompt", &ids),
                None => Err(ApiError::invalid(
                    "prompt",
                    "a list must hold texts or token ids",
                )),
            }
        };
        match prompt {
            Value::String(text) => encode(text),
            Value::Array(items) => match items.as_slice() {
                [Value::String(text)] => encode(text),
                [Value::Array(inner)] => ids(inner),
                [first, _, ..] if first.is_string() || first.is_array() => Err(ApiError::invalid(
                    "prompt",
                    "one prompt per request: send several requests, or ask for n choices",
                )),
                _ => ids(items),
            },
            _ => Err(ApiError::invalid(
                "prompt",
                "must be a text or a list of token ids",
            )),
        }
    }
}

/// Starts the engine for `model` and returns the server's router.
pub fn router<B: Backend + 'static>(
    model: Arc<Model<B>>,
    options: ServerOptions,
) -> moeflux::Result<Router>
where
    Model<B>: Send + Sync,
{
    if options.limits.max_sequences == 0 || options.limits.context == 0 || options.max_n == 0 {
        return Err(moeflux::Error::invalid(
            "server options",
            "the batch, the context and n must each allow at least one",
        ));
    }
    let dir = model.dir().root().to_path_buf();
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir)?);
    let template = match ChatTemplate::from_dir(&dir, tokenizer.special_tokens(), None) {
        Ok(template) => Some(template),
        Err(moeflux::Error::Config { .. }) => None,
        Err(err) => return Err(err),
    };
    let defaults = SamplerConfig::from_generation_config(&dir)?;
    let vocab = model.config().vocab_size.min(tokenizer.vocab_size().max(1));
    let grammars = constrain::Grammars::new(&dir, tokenizer.clone(), model.config().vocab_size)
        .map_err(|e| e.to_string());
    let metrics = Arc::new(Metrics::default());
    let engine = engine::spawn(model, tokenizer.clone(), options.limits.clone(), metrics)
        .map_err(|e| moeflux::Error::io(&dir, "starting the engine thread", e))?;
    let state = Arc::new(AppState {
        engine,
        tokenizer,
        template,
        grammars,
        defaults,
        vocab,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        options,
    });
    Ok(Router::new()
        .route("/", get(routes::page))
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .route("/v1/models", get(routes::models))
        .route("/v1/chat/completions", post(routes::chat))
        .route("/v1/completions", post(routes::completions))
        .route("/tokenize", post(routes::tokenize))
        .route("/detokenize", post(routes::detokenize))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(DefaultBodyLimit::max(state.options.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            routes::guard,
        ))
        .with_state(state))
}

/// Serves `app` on `listener` until `shutdown` completes; requests in
/// flight are finished first.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}
