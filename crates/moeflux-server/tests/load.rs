//! A bounded load against 127.0.0.1: many concurrent streaming clients,
//! mixed prompt lengths, a quarter of them hanging up mid-stream. Nothing
//! but 429s may fail, and afterwards no sequence or KV memory is left
//! behind. Prints p50/p99 time to first token and between tokens as the
//! clients saw them.

mod common;

use std::time::{Duration, Instant};

use common::start;
use serde_json::{Value, json};

const CLIENTS: usize = 24;
const REQUESTS: usize = 96;

/// One streamed request: (status, time to first token, gaps between
/// tokens); hangs up after `hang_up` tokens when given.
async fn one(
    client: reqwest::Client,
    url: String,
    body: Value,
    hang_up: Option<usize>,
) -> (u16, Option<f64>, Vec<f64>) {
    let start = Instant::now();
    let mut response = client.post(url).json(&body).send().await.unwrap();
    let status = response.status().as_u16();
    if status != 200 {
        return (status, None, Vec::new());
    }
    let (mut first, mut gaps, mut last, mut tokens) = (None, Vec::new(), None, 0);
    let mut buffer = String::new();
    while let Some(chunk) = response.chunk().await.unwrap() {
        buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            let Some(data) = event.strip_prefix("data: ") else {
                continue;
            };
            let data = data.trim_end();
            if data == "[DONE]" {
                return (status, first, gaps);
            }
            let chunk: Value = serde_json::from_str(data).unwrap();
            assert!(chunk.get("error").is_none(), "{chunk}");
            if chunk["choices"][0]["text"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
            {
                let now = Instant::now();
                first.get_or_insert((now - start).as_secs_f64());
                if let Some(before) = last.replace(now) {
                    gaps.push((now - before).as_secs_f64());
                }
                tokens += 1;
                if hang_up.is_some_and(|n| tokens >= n) {
                    return (499, first, gaps);
                }
            }
        }
    }
    panic!("the stream ended without [DONE]");
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    values[((values.len() - 1) as f64 * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_with_hang_ups_leave_nothing_behind() {
    let server = start(|o| o.limits.queue = 8).await;
    let url = server.url("/v1/completions");
    let client = server.client.clone();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        let (client, url) = (client.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let mut results = Vec::new();
            for r in (c..REQUESTS).step_by(CLIENTS) {
                let body = json!({
                    "prompt": "Emma ".repeat(1 + (r * 37) % 150),
                    "max_tokens": 8 + r % 24, "stream": true, "temperature": 0.7, "seed": r,
                    "logit_bias": {"0": -100, "2": -100},
                });
                let hang_up = (r % 4 == 0).then_some(1 + r % 5);
                loop {
                    let result = one(client.clone(), url.clone(), body.clone(), hang_up).await;
                    if result.0 != 429 {
                        results.push(result);
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            results
        }));
    }
    let (mut ttft, mut gaps, mut done, mut hung_up) = (Vec::new(), Vec::new(), 0, 0);
    for task in tasks {
        for (status, first, g) in task.await.unwrap() {
            match status {
                200 => done += 1,
                499 => hung_up += 1,
                other => panic!("status {other}"),
            }
            ttft.extend(first);
            gaps.extend(g);
        }
    }
    assert_eq!((done, hung_up), (REQUESTS - REQUESTS / 4, REQUESTS / 4));
    let refused = server.metric("moeflux_requests_rejected_total").await;
    println!(
        "{REQUESTS} requests from {CLIENTS} clients in {:.1} s ({refused} answered 429 and retried): \
         time to first token p50 {:.1} ms, p99 {:.1} ms; between tokens p50 {:.1} ms, p99 {:.1} ms",
        started.elapsed().as_secs_f64(),
        1e3 * percentile(&mut ttft, 0.5),
        1e3 * percentile(&mut ttft, 0.99),
        1e3 * percentile(&mut gaps, 0.5),
        1e3 * percentile(&mut gaps, 0.99),
    );
    server.wait_metric("moeflux_running_requests", 0.0).await;
    server.wait_metric("moeflux_queue_depth", 0.0).await;
    server.wait_metric("moeflux_kv_reserved_bytes", 0.0).await;
    // Only the sessions kept for prefix reuse hold KV memory.
    let kept = server.metric("moeflux_prefix_cache_bytes").await;
    assert_eq!(server.model.kv_bytes_in_use() as f64, kept);
    // Each request ended once: finished, or cancelled (a client that hung
    // up after its last token was made counts as finished).
    let finished = server.metric("moeflux_requests_finished_total").await;
    let cancelled = server.metric("moeflux_requests_cancelled_total").await;
    assert!(finished >= done as f64, "{finished} finished");
    assert_eq!(finished + cancelled, REQUESTS as f64);
}
