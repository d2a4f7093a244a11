//! `moeflux serve`: the OpenAI-compatible HTTP server (moeflux-server) on
//! the model, the bundled one by default. Ctrl-C stops taking requests
//! and ends once those in flight are answered.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use moeflux::Model;
use moeflux::backend::Backend;
use moeflux::speculative::DraftSource;
use moeflux::util::human_bytes;
use moeflux_server::ServerOptions;

use super::{DraftArgs, ModelArgs};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every
    /// interface, then set --api-key).
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0: any free one, printed at start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health
    /// (default: the MOEFLUX_API_KEY environment variable, if set).
    #[arg(long, env = "MOEFLUX_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The model's name in /v1/models and requests (default: the model
    /// directory's name, or qwen35-tiny for the bundled model).
    #[arg(long)]
    model_name: Option<String>,
    /// Positions of one sequence, prompt and answer (default: the model's
    /// context, bounded by memory).
    #[arg(long)]
    ctx: Option<usize>,
    /// Sequences decoded together in one batch (a request with n choices
    /// takes n).
    #[arg(long, default_value_t = 16)]
    max_sequences: usize,
    /// Requests waiting for room in the batch; beyond them, 429.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// KV cache memory for all running sequences, in MiB (default: half the
    /// free memory, at least one full context). A request joins the batch
    /// when its prompt and max_tokens fit.
    #[arg(long)]
    kv_cache_mb: Option<u64>,
    /// KV cache memory for sessions of finished requests kept for prefix
    /// reuse, in MiB, within --kv-cache-mb (default: a quarter of it; 0:
    /// off). A request whose prompt starts with a kept session's prompt or
    /// conversation resumes from its checkpoint.
    #[arg(long)]
    prefix_cache_mb: Option<u64>,
    /// Seconds a request may take from arrival: past it, a running request
    /// ends as at its token limit (finish_reason "length") and a waiting
    /// one is answered 503 (default: no limit).
    #[arg(long)]
    request_timeout: Option<f64>,
    /// Largest request body, in MiB.
    #[arg(long, default_value_t = 8)]
    max_body_mb: usize,
    /// Speculative decoding of requests that do not choose (a request's
    /// `draft` field: "lookup", "mtp" or "off").
    #[command(flatten)]
    draft: DraftArgs,
}

pub fn run(args: Args) -> Result<()> {
    let mut files = args.model.resolve(false)?;
    // Requests share steps, or check drafted tokens.
    files.batched = true;
    files.check_context(args.ctx)?;
    if args.max_sequences == 0 || args.queue == 0 {
        bail!("--max-sequences and --queue: must be at least 1");
    }
    if args.max_body_mb == 0 || args.max_body_mb > 4096 {
        bail!("--max-body-mb: must be between 1 and 4096");
    }
    if args.api_key.as_deref() == Some("") {
        bail!("--api-key: must not be empty");
    }
    let draft = args.draft.settings()?;
    // The head stays open for requests that ask for it: only a default
    // that needs a missing one is refused (before the weights are read).
    if draft.is_some_and(|d| d.source == DraftSource::Mtp) && files.config.mtp.is_none() {
        return Err(moeflux::speculative::missing_mtp_head(&files.dir).into());
    }
    let name = match (&args.model_name, &args.model.path.model) {
        (Some(name), _) => name.clone(),
        (None, None) => moeflux::bundled::NAME.to_string(),
        (None, Some(_)) => files
            .dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "moeflux".into()),
    };
    let opened = args.model.load(&files, false)?;
    with_model!(opened, |model| serve(model, &args, name))
}

fn serve<B: Backend + 'static>(model: Arc<Model<B>>, args: &Args, name: String) -> Result<()>
where
    Model<B>: Send + Sync,
{
    let mut options = ServerOptions::for_model(&model, &name);
    options.draft = args.draft.settings()?;
    options.api_key = args.api_key.clone();
    options.max_body_bytes = args.max_body_mb << 20;
    options.limits.max_sequences = args.max_sequences;
    options.max_n = options.max_n.min(args.max_sequences);
    options.limits.queue = args.queue;
    if let Some(ctx) = args.ctx {
        options.limits.context = ctx;
    }
    let per_context = options.limits.context as u64 * model.kv_bytes_per_position();
    match args.kv_cache_mb {
        Some(mb) => {
            let bytes = mb
                .checked_mul(1 << 20)
                .context("--kv-cache-mb: too large")?;
            if bytes < per_context {
                bail!(
                    "--kv-cache-mb: {} holds less than one context of {} positions ({}): \
                     raise it or lower --ctx",
                    human_bytes(bytes),
                    options.limits.context,
                    human_bytes(per_context)
                );
            }
            options.limits.kv_budget = bytes;
        }
        None => options.limits.kv_budget = options.limits.kv_budget.max(per_context),
    }
    options.limits.prefix_cache = match args.prefix_cache_mb {
        Some(mb) => mb
            .checked_mul(1 << 20)
            .filter(|&bytes| bytes <= options.limits.kv_budget)
            .context("--prefix-cache-mb: must be within --kv-cache-mb")?,
        None => options.limits.kv_budget / 4,
    };
    if let Some(seconds) = args.request_timeout {
        let limit = Duration::try_from_secs_f64(seconds)
            .ok()
            .filter(|d| !d.is_zero())
            .context("--request-timeout: must be a positive number of seconds")?;
        options.limits.request_timeout = Some(limit);
    }
    let addr = SocketAddr::new(args.host, args.port);
    let runtime = tokio::runtime::Runtime::new().context("starting the server's runtime")?;
    let served = runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("--host/--port: cannot listen on {addr}"))?;
        let local = listener.local_addr()?;
        eprintln!(
            "moeflux: serving {name} at http://{local}/v1 (context {} tokens, {} sequences per batch, \
             KV budget {}, prefix cache {}{})",
            options.limits.context,
            options.limits.max_sequences,
            human_bytes(options.limits.kv_budget),
            human_bytes(options.limits.prefix_cache),
            if options.api_key.is_some() { ", API key required" } else { "" },
        );
        if options.api_key.is_none() && !args.host.is_loopback() {
            eprintln!("moeflux: warning: listening beyond this machine without --api-key");
        }
        let app = moeflux_server::router(model, options)?;
        moeflux_server::serve(listener, app, async {
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("moeflux: stopping: answering the requests in flight");
        })
        .await
        .context("serving")
    });
    // The engine drops the model (and frees the GPUs, their NCCL
    // communicators included) once the connections holding the router are
    // gone: before the process exits, not while it does.
    drop(runtime);
    if !moeflux_server::wait_for_engines(Duration::from_secs(30)) {
        eprintln!("moeflux: warning: the engine did not stop within 30 s");
    }
    served
}
