//! A bounded load against 127.0.0.1: 64 concurrent streaming clients
//! sending 500 requests with mixed prompt lengths (2 to 600 tokens) and
//! short answers, a quarter of them hanging up mid-stream. Nothing
//! but 429s may fail (a client retries them); afterwards no request, queued
//! job, KV reservation or sequence is left (the KV memory in use is the
//! prefix cache's alone), and the process's resident memory is back within
//! 5% of its level after a warm-up round of the same load (two requests a
//! client). Prints p50/p99 time to first token and between tokens as the
//! clients saw them.
//!
//! The server runs in this process, so its memory is this process's
//! (VmRSS of /proc/self/status, Linux only; elsewhere that check is
//! skipped), measured once glibc has handed its free pages back, and with
//! the prefix cache refilled by the same requests each time (its sessions'
//! memory depends on which it holds).
//!
//! The full size runs in CI (30 to 45 s on two cores); MOEFLUX_LOAD_CLIENTS
//! and MOEFLUX_LOAD_REQUESTS change it (1500 requests: memory within 2%
//! too).

mod common;

use std::time::{Duration, Instant};

use common::{TestServer, start};
use serde_json::{Value, json};

/// What one streamed request came to.
struct Outcome {
    /// 200, 499 for a client that hung up, or the error status.
    status: u16,
    first: Option<f64>,
    gaps: Vec<f64>,
}

/// One streamed request; hangs up after `hang_up` tokens when given.
async fn one(client: &reqwest::Client, url: &str, body: &Value, hang_up: Option<usize>) -> Outcome {
    let start = Instant::now();
    let mut response = client.post(url).json(body).send().await.unwrap();
    let status = response.status().as_u16();
    let mut outcome = Outcome {
        status,
        first: None,
        gaps: Vec::new(),
    };
    if status != 200 {
        return outcome;
    }
    let (mut last, mut tokens) = (None, 0);
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
                return outcome;
            }
            let chunk: Value = serde_json::from_str(data).unwrap();
            assert!(chunk.get("error").is_none(), "{chunk}");
            if chunk["choices"][0]["text"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
            {
                let now = Instant::now();
                outcome.first.get_or_insert((now - start).as_secs_f64());
                if let Some(before) = last.replace(now) {
                    outcome.gaps.push((now - before).as_secs_f64());
                }
                tokens += 1;
                if hang_up.is_some_and(|n| tokens >= n) {
                    outcome.status = 499;
                    return outcome;
                }
            }
        }
    }
    panic!("the stream ended without [DONE]");
}

/// Request `r`'s body: prompts of 2 to 151 tokens, every seventh of 401
/// to 600; 8 to 31 tokens out, sampled.
fn body(r: usize) -> Value {
    let words = if r % 7 == 3 {
        400 + (r * 13) % 200
    } else {
        1 + (r * 37) % 150
    };
    json!({
        "prompt": format!("{r} {}", "Emma ".repeat(words)),
        "max_tokens": 8 + r % 24, "stream": true, "temperature": 0.7, "seed": r,
        "logit_bias": {"0": -100, "2": -100},
    })
}

/// Totals of a round.
#[derive(Default)]
struct Round {
    done: usize,
    hung_up: usize,
    ttft: Vec<f64>,
    gaps: Vec<f64>,
    seconds: f64,
}

/// `requests` requests numbered from `from`, spread over `clients`
/// concurrent clients; a client answered 429 retries after 50 ms.
async fn round(server: &TestServer, clients: usize, from: usize, requests: usize) -> Round {
    let url = server.url("/v1/completions");
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (client, url) = (server.client.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for r in (from + c..from + requests).step_by(clients) {
                let body = body(r);
                // A quarter hang up, after 1 to 5 tokens.
                let hang_up = (r % 4 == 0).then_some(1 + r % 5);
                loop {
                    let outcome = one(&client, &url, &body, hang_up).await;
                    if outcome.status != 429 {
                        outcomes.push(outcome);
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            outcomes
        }));
    }
    let mut totals = Round::default();
    for task in tasks {
        for outcome in task.await.unwrap() {
            match outcome.status {
                200 => totals.done += 1,
                499 => totals.hung_up += 1,
                other => panic!("status {other}"),
            }
            totals.ttft.extend(outcome.first);
            totals.gaps.extend(outcome.gaps);
        }
    }
    totals.seconds = started.elapsed().as_secs_f64();
    assert_eq!(totals.done + totals.hung_up, requests);
    totals
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    values[((values.len() - 1) as f64 * p).round() as usize]
}

/// This process's resident memory, in bytes (Linux): as it is, and after
/// the allocator has handed its free pages back (glibc's `malloc_trim`),
/// which leaves what is in use, whatever the allocator happened to keep.
fn rss() -> Option<(u64, u64)> {
    let now = vm_rss()?;
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn malloc_trim(pad: usize) -> i32;
        }
        // SAFETY: glibc's malloc_trim takes any padding and only returns
        // free memory to the system.
        unsafe { malloc_trim(0) };
    }
    Some((now, vm_rss()?))
}

fn vm_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

/// Waits until nothing runs, waits or holds KV memory but the prefix
/// cache; checks that every request ended once.
async fn settled(server: &TestServer, requests: usize) {
    server.wait_metric("moeflux_running_requests", 0.0).await;
    server.wait_metric("moeflux_queue_depth", 0.0).await;
    server.wait_metric("moeflux_kv_reserved_bytes", 0.0).await;
    let kept = server.metric("moeflux_prefix_cache_bytes").await;
    assert_eq!(server.model.kv_bytes_in_use() as f64, kept);
    assert_eq!(server.metric("moeflux_kv_in_use_bytes").await, kept);
    let finished = server.metric("moeflux_requests_finished_total").await;
    let cancelled = server.metric("moeflux_requests_cancelled_total").await;
    assert_eq!(finished + cancelled, requests as f64);
}

/// Fills the prefix cache with the same sessions whatever it held: six
/// requests one after the other of 601 prompt tokens (1.2 MiB of KV cache
/// each on the bundled model), so that memory is measured in the same
/// state after the warm-up and after the run.
async fn refill_prefix_cache(server: &TestServer) {
    for i in 0..6 {
        let (status, answer) = server
            .post(
                "/v1/completions",
                &json!({"prompt": format!("refill{i} {}", "Emma ".repeat(599)),
                        "max_tokens": 8, "temperature": 0}),
            )
            .await;
        assert_eq!(status, 200, "{answer}");
    }
}

fn setting(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().expect(name))
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_with_hang_ups_leave_nothing_behind() {
    let clients = setting("MOEFLUX_LOAD_CLIENTS", 64);
    let requests = setting("MOEFLUX_LOAD_REQUESTS", 500);
    // 16 running and 32 waiting, so that some of the 64 clients get 429s;
    // a prefix cache of a few sessions (whose states, beyond the KV cache
    // counted here, take memory too).
    let server = start(|o| {
        o.limits.max_sequences = 16;
        o.limits.queue = 32;
        o.limits.prefix_cache = 4 << 20;
    })
    .await;

    // Warm-up: the same load, two requests per client.
    let warm = clients * 2;
    round(&server, clients, 0, warm).await;
    refill_prefix_cache(&server).await;
    settled(&server, warm + 6).await;
    let warm_rss = rss();

    let mut run = round(&server, clients, warm, requests).await;
    let hanging = (warm..warm + requests).filter(|r| r % 4 == 0).count();
    assert_eq!((run.done, run.hung_up), (requests - hanging, hanging));
    refill_prefix_cache(&server).await;
    settled(&server, warm + requests + 12).await;
    let refused = server.metric("moeflux_requests_rejected_total").await;
    println!(
        "{requests} requests from {clients} clients in {:.1} s ({refused} answers 429, retried): \
         time to first token p50 {:.1} ms, p99 {:.1} ms; between tokens p50 {:.1} ms, p99 {:.1} ms",
        run.seconds,
        1e3 * percentile(&mut run.ttft, 0.5),
        1e3 * percentile(&mut run.ttft, 0.99),
        1e3 * percentile(&mut run.gaps, 0.5),
        1e3 * percentile(&mut run.gaps, 0.99),
    );
    match (warm_rss, rss()) {
        (Some((raw_before, before)), Some((raw_after, after))) => {
            let mib = |b: u64| b as f64 / 1048576.0;
            println!(
                "resident memory: {:.1} MiB after the warm-up ({warm} requests), {:.1} MiB after the run ({:+.2}%); \
                 before the allocator's free pages went back {:.1} and {:.1} MiB",
                mib(before),
                mib(after),
                100.0 * (after as f64 / before as f64 - 1.0),
                mib(raw_before),
                mib(raw_after),
            );
            assert!(
                after as f64 <= before as f64 * 1.05,
                "resident memory grew from {before} to {after} bytes"
            );
        }
        _ => println!("resident memory: not measured (no /proc/self/status)"),
    }
}
