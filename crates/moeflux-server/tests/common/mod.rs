//! A server on the bundled model at 127.0.0.1 on a free port, and an HTTP
//! client's helpers.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use moeflux::{Model, ModelOptions};
use moeflux_server::ServerOptions;
use serde_json::Value;

pub struct TestServer {
    pub addr: SocketAddr,
    pub dir: PathBuf,
    pub model: Arc<Model>,
    pub client: reqwest::Client,
}

pub fn bundled() -> (PathBuf, Arc<Model>) {
    bundled_with(&ModelOptions::default())
}

/// The bundled model opened with `options`.
pub fn bundled_with(options: &ModelOptions) -> (PathBuf, Arc<Model>) {
    let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress).unwrap();
    let model = Arc::new(Model::open(&dir, options).unwrap());
    (dir, model)
}

/// Starts a server on the current runtime; `adjust` changes the options.
pub async fn start(adjust: impl FnOnce(&mut ServerOptions)) -> TestServer {
    start_on(bundled(), adjust).await
}

/// Starts a server on `model` (its directory and the opened model).
pub async fn start_on(
    (dir, model): (PathBuf, Arc<Model>),
    adjust: impl FnOnce(&mut ServerOptions),
) -> TestServer {
    let mut options = ServerOptions::for_model(&model, moeflux::bundled::NAME);
    options.limits.context = 1024;
    adjust(&mut options);
    let app = moeflux_server::router(model.clone(), options).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(moeflux_server::serve(listener, app, std::future::pending()));
    TestServer {
        addr,
        dir,
        model,
        client: reqwest::Client::new(),
    }
}

impl TestServer {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// POSTs `body` (JSON) and returns the status and the parsed answer.
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let response = self
            .client
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap())
    }

    pub async fn get_text(&self, path: &str) -> (u16, String) {
        let response = self.client.get(self.url(path)).send().await.unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    }

    /// A metric's value from /metrics.
    pub async fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get_text("/metrics").await;
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
    }
}

impl TestServer {
    /// Waits (up to 10 s) for a metric to reach `value`.
    pub async fn wait_metric(&self, name: &str, value: f64) {
        let mut got = f64::NAN;
        for _ in 0..500 {
            got = self.metric(name).await;
            if got == value {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        panic!("{name} stayed at {got}, not {value}");
    }
}

/// An SSE stream read event by event.
pub struct Events {
    response: reqwest::Response,
    buffer: String,
}

impl Events {
    pub async fn open(server: &TestServer, path: &str, body: &Value) -> Events {
        let response = server
            .client
            .post(server.url(path))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let kind = response.headers()["content-type"]
            .to_str()
            .unwrap()
            .to_string();
        assert!(kind.starts_with("text/event-stream"), "{kind}");
        Events {
            response,
            buffer: String::new(),
        }
    }

    /// The next `data:` payload; `None` at the end of the stream.
    pub async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let event: String = self.buffer.drain(..end + 2).collect();
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .collect();
                if data.is_empty() {
                    continue; // a keep-alive comment
                }
                return Some(data.join("\n"));
            }
            let chunk = self.response.chunk().await.unwrap()?;
            self.buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    }

    /// Every payload to the end, checking it ends with `[DONE]`.
    pub async fn all(mut self) -> Vec<Value> {
        let mut out = Vec::new();
        while let Some(data) = self.next().await {
            if data == "[DONE]" {
                assert!(self.next().await.is_none(), "data after [DONE]");
                return out;
            }
            out.push(serde_json::from_str(&data).unwrap());
        }
        panic!("the stream ended without [DONE]");
    }
}
