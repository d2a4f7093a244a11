//! A request's greedy tokens and log-probabilities over HTTP equal the
//! library's for the same prompt (TextGeneration on one session), alone
//! and while 15 other requests run in the same batch.

use crate::common::{Events, TestServer, start};
use moeflux::sampling::{Sampler, SamplerConfig};
use moeflux::text::{Generated, TextGeneration, Tokenizer};
use serde_json::{Value, json};

const PROMPT: &str = "It is a truth universally acknowledged, that a single man in possession";
const TOKENS: usize = 24;
const TOP: usize = 3;

/// The library's greedy continuation with the model's other settings.
fn library(server: &TestServer) -> Generated {
    let tokenizer = Tokenizer::from_dir(&server.dir).unwrap();
    let mut config = SamplerConfig::from_generation_config(&server.dir).unwrap();
    config.temperature = 0.0;
    let mut sampler = Sampler::new(config).unwrap();
    let mut session = server.model.session();
    session
        .prefill(&tokenizer.encode(PROMPT, true).unwrap())
        .unwrap();
    let mut generation = TextGeneration::new(&tokenizer, &mut sampler, TOKENS);
    generation.logprobs = Some(TOP);
    generation.run(&mut session, &mut |_| Ok(())).unwrap()
}

/// The server's answer: text, each token's log-probability, the top
/// alternatives' log-probabilities.
async fn over_http(server: &TestServer) -> (String, Vec<f32>, Vec<Vec<f32>>, u64) {
    let body = json!({
        "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "logprobs": TOP,
    });
    let (status, answer) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    let choice = &answer["choices"][0];
    let logprobs = &choice["logprobs"];
    let floats = |v: &Value| v.as_f64().unwrap() as f32;
    let lp = logprobs["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(floats)
        .collect();
    let top = logprobs["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let mut v: Vec<f32> = m.as_object().unwrap().values().map(floats).collect();
            v.sort_by(|a, b| b.total_cmp(a));
            v
        })
        .collect();
    let completion = answer["usage"]["completion_tokens"].as_u64().unwrap();
    (
        choice["text"].as_str().unwrap().to_string(),
        lp,
        top,
        completion,
    )
}

/// Per token, the largest difference between the server's and the
/// library's log-probabilities (the token's and its alternatives').
fn max_difference(want: &Generated, lp: &[f32], top: &[Vec<f32>]) -> f32 {
    assert_eq!(lp.len(), want.logprobs.len());
    let mut max = 0f32;
    for ((w, &l), t) in want.logprobs.iter().zip(lp).zip(top) {
        max = max.max((w.logprob - l).abs());
        // Alternatives whose texts coincide merge in the legacy map.
        for (a, b) in w.top.iter().map(|x| x.1).zip(t) {
            max = max.max((a - b).abs());
        }
    }
    max
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_tokens_and_logprobs_equal_the_library_alone_and_in_a_full_batch() {
    let server = start(|_| {}).await;
    let want = library(&server);
    assert!(
        want.tokens.len() >= 8,
        "a continuation long enough to compare"
    );

    let (text, lp, top, completion) = over_http(&server).await;
    assert_eq!(text, want.text);
    assert_eq!(completion as usize, want.tokens.len());
    // Alone, the request runs the same passes as the library: equal bits.
    let alone = max_difference(&want, &lp, &top);
    assert_eq!(alone, 0.0, "alone, the log-probabilities differ by {alone}");

    // 15 others, end-of-text forbidden so that they outlast the request:
    // prompts from one token to over two prefill chunks, chat and plain.
    let eos: Vec<u32> = Tokenizer::from_dir(&server.dir)
        .unwrap()
        .special_tokens()
        .stop_ids
        .clone();
    let bias: serde_json::Map<String, Value> =
        eos.iter().map(|id| (id.to_string(), json!(-100))).collect();
    let mut others = Vec::new();
    for i in 0..15 {
        let prompt = "Emma ".repeat(1 + 11 * i);
        let body = if i % 3 == 0 {
            json!({
                "messages": [{"role": "user", "content": prompt}], "stream": true,
                "max_tokens": 600, "logit_bias": bias, "seed": i, "temperature": 0.8,
            })
        } else {
            json!({
                "prompt": prompt, "stream": true, "max_tokens": 600,
                "logit_bias": bias, "temperature": 0,
            })
        };
        let path = if i % 3 == 0 {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let mut events = Events::open(&server, path, &body).await;
        // The first token's chunk: the request is in the batch.
        for _ in 0..2 {
            assert!(events.next().await.is_some());
        }
        others.push(events);
    }
    server.wait_metric("moeflux_running_requests", 15.0).await;
    let (text, lp, top, _) = over_http(&server).await;
    assert_eq!(text, want.text, "in a batch, the greedy text differs");
    server.wait_metric("moeflux_running_requests", 15.0).await;
    // In a batch the products run over more rows at once: the engine's
    // batched-equals-alone bound (relative 1e-5 on the logits) allows
    // rounding in the last bits.
    let batched = max_difference(&want, &lp, &top);
    println!("log-probabilities: alone equal, in a batch of 16 within {batched:.2e}");
    assert!(batched <= 1e-4, "in a batch, they differ by {batched}");

    // Clients that go away free their sequences at the next step.
    drop(others);
    server.wait_metric("moeflux_running_requests", 0.0).await;
    // What stays is the finished request's session, kept for prefix reuse.
    let kept = server.metric("moeflux_prefix_cache_bytes").await;
    assert!(kept > 0.0);
    assert_eq!(server.model.kv_bytes_in_use() as f64, kept);
    assert_eq!(
        server.metric("moeflux_requests_cancelled_total").await,
        15.0
    );
}

/// A chat's turns and a prompt continued: with prefix reuse the answers
/// equal those without it (and the library's), and the metrics show the
/// prefix was not read again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_reuse_resumes_from_checkpoints_with_the_same_answers() {
    let mut answers = Vec::new();
    for prefix_cache in [0, 64 << 20] {
        let server = start(|o| o.limits.prefix_cache = prefix_cache).await;
        let mut got = Vec::new();
        // The same prompt twice, then continued by its own answer.
        let first = over_http(&server).await;
        assert_eq!(first.0, library(&server).text);
        got.push(first.0.clone());
        got.push(over_http(&server).await.0);
        let longer = format!("{PROMPT}{} said Emma", first.0);
        let body = json!({"prompt": longer, "max_tokens": 16, "temperature": 0, "logprobs": 2});
        let (status, answer) = server.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{answer}");
        got.push(answer["choices"][0]["text"].to_string());
        got.push(answer["choices"][0]["logprobs"]["token_logprobs"].to_string());
        // Three chat turns, each with the answers before.
        let mut messages = vec![json!({"role": "system", "content": "You are Mr. Knightley."})];
        for question in ["Who is Emma?", "And Harriet?", "Why?"] {
            messages.push(json!({"role": "user", "content": question}));
            let body =
                json!({"messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": true});
            let (status, answer) = server.post("/v1/chat/completions", &body).await;
            assert_eq!(status, 200, "{answer}");
            let message = &answer["choices"][0]["message"];
            got.push(message.to_string());
            got.push(answer["choices"][0]["logprobs"].to_string());
            messages.push(json!({"role": "assistant", "content": message["content"]}));
        }
        let hits = server.metric("moeflux_prefix_cache_hits_total").await;
        let saved = server.metric("moeflux_prefix_cache_tokens_total").await;
        println!(
            "prefix cache of {prefix_cache} bytes: {hits} hits, {saved} prompt tokens not read again"
        );
        if prefix_cache == 0 {
            assert_eq!((hits, saved), (0.0, 0.0));
        } else {
            // The repeated prompt, the continued one, two later turns.
            assert!(hits >= 4.0, "{hits} hits");
            assert!(saved >= 60.0, "{saved} tokens saved");
        }
        answers.push(got);
    }
    assert_eq!(answers[0], answers[1], "prefix reuse changed an answer");
}
