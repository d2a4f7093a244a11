//! The endpoints over real HTTP: response and stream shapes as OpenAI
//! clients read them, errors as OpenAI error objects with 4xx codes, the
//! API key, the queue's 429.

use crate::common::{Events, start};
use serde_json::{Value, json};

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({
        "model": moeflux::bundled::NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completions_answer_in_openai_shapes() {
    let server = start(|_| {}).await;
    let (status, answer) = server
        .post(
            "/v1/chat/completions",
            &chat(
                "Who is Mr. Knightley?",
                json!({"n": 2, "seed": 5, "logprobs": true, "top_logprobs": 2}),
            ),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["model"], moeflux::bundled::NAME);
    let choices = answer["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    let mut completion = 0;
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["message"]["role"], "assistant");
        let reason = choice["finish_reason"].as_str().unwrap();
        assert!(["stop", "length"].contains(&reason), "{reason}");
        let content = choice["logprobs"]["content"].as_array().unwrap();
        assert!(!content.is_empty() && content.len() <= 12);
        for entry in content {
            assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
            assert_eq!(entry["top_logprobs"].as_array().unwrap().len(), 2);
        }
        completion += content.len();
    }
    let usage = &answer["usage"];
    assert_eq!(usage["completion_tokens"], completion);
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 5);
    assert_eq!(usage["total_tokens"], prompt + completion as u64);

    // A stop string ends the text before it.
    let (status, answer) = server
        .post("/v1/completions", &json!({"prompt": "Emma Woodhouse, handsome, clever, and rich,", "max_tokens": 40, "temperature": 0, "stop": [" the", ","]}))
        .await;
    assert_eq!(status, 200, "{answer}");
    let choice = &answer["choices"][0];
    let text = choice["text"].as_str().unwrap();
    assert!(!text.contains(" the") && !text.contains(','), "{text:?}");
    assert_eq!(answer["object"], "text_completion");

    // Token ids in, and the tokenizer endpoints.
    let (_, ids) = server
        .post("/tokenize", &json!({"prompt": "Mr. Darcy"}))
        .await;
    let tokens = ids["tokens"].clone();
    assert_eq!(ids["count"], tokens.as_array().unwrap().len());
    let (_, text) = server.post("/detokenize", &json!({"tokens": tokens})).await;
    assert_eq!(text["prompt"], "Mr. Darcy");
    let (status, answer) = server
        .post(
            "/v1/completions",
            &json!({"prompt": tokens, "max_tokens": 3}),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["usage"]["prompt_tokens"], ids["count"]);

    let (status, models) = server.get_text("/v1/models").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], moeflux::bundled::NAME);
    let (status, health) = server.get_text("/health").await;
    assert_eq!((status, health.as_str()), (200, "{\"status\":\"ok\"}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_server_sent_events_ending_with_usage_and_done() {
    let server = start(|_| {}).await;
    let body = chat(
        "Tell me about Bath.",
        json!({"stream": true, "n": 2, "stream_options": {"include_usage": true}}),
    );
    let chunks = Events::open(&server, "/v1/chat/completions", &body)
        .await
        .all()
        .await;
    let (last, body) = chunks.split_last().unwrap();
    assert_eq!(last["choices"], json!([]));
    let usage = &last["usage"];
    assert!(usage["completion_tokens"].as_u64().unwrap() >= 2);
    let mut text = [String::new(), String::new()];
    let mut finished = [false, false];
    for (k, chunk) in body.iter().enumerate() {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["id"], chunks[0]["id"]);
        assert!(chunk["usage"].is_null(), "usage before the end");
        let choice = &chunk["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        if k < 2 {
            assert_eq!(choice["delta"]["role"], "assistant", "the role comes first");
        }
        assert!(!finished[i], "a chunk after the choice's finish_reason");
        text[i] += choice["delta"]["content"].as_str().unwrap_or_default();
        finished[i] = !choice["finish_reason"].is_null();
    }
    assert_eq!(finished, [true, true]);

    // Without include_usage there is no usage chunk; completions stream
    // text_completion chunks.
    let body = json!({"prompt": "Mr. Darcy", "max_tokens": 5, "stream": true});
    let chunks = Events::open(&server, "/v1/completions", &body)
        .await
        .all()
        .await;
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "text_completion" && c.get("usage").is_none())
    );
    assert!(!chunks.last().unwrap()["choices"][0]["finish_reason"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_openai_errors_with_4xx_codes() {
    let server = start(|o| o.max_body_bytes = 64 << 10).await;
    let cases: Vec<(&str, Value, u16, Option<&str>)> = vec![
        (
            "/v1/chat/completions",
            json!({"messages": []}),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            chat("hi", json!({"model": "gpt-4"})),
            404,
            Some("model"),
        ),
        (
            "/v1/chat/completions",
            chat("hi", json!({"temperature": 3})),
            400,
            Some("temperature"),
        ),
        (
            "/v1/chat/completions",
            chat("hi", json!({"temperature": "hot"})),
            400,
            Some("temperature"),
        ),
        (
            "/v1/chat/completions",
            chat("hi", json!({"top_p": 0})),
            400,
            Some("top_p"),
        ),
        (
            "/v1/chat/completions",
            chat("hi", json!({"n": 0})),
            400,
            Some("n"),
        ),
        (
            "/v1/chat/completions",
            chat("hi", json!({"n": 1000})),
            400,
            Some("n"),
        ),
        (
            "/v1/chat/completions",
            chat("hi", json!({"max_tokens": 0})),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/chat/completions",
            chat("hi", json!({"max_tokens": 100000})),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            chat("hi", json!({"stop": ""})),
            400,
            Some("stop"),
        ),
        (
            "/v1/chat/completions",
            chat("hi", json!({"logit_bias": {"x": 1}})),
            400,
            Some("logit_bias.x"),
        ),
        (
            "/v1/chat/completions",
            chat("hi", json!({"logit_bias": {"99999999": 1}})),
            400,
            Some("logit_bias.99999999"),
        ),
        (
            "/v1/chat/completions",
            chat("hi", json!({"logit_bias": {"5": 1000}})),
            400,
            Some("logit_bias.5"),
        ),
        (
            "/v1/chat/completions",
            chat("hi", json!({"logprobs": true, "top_logprobs": 50})),
            400,
            Some("top_logprobs"),
        ),
        (
            "/v1/chat/completions",
            chat("hi", json!({"top_logprobs": 2})),
            400,
            Some("top_logprobs"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            400,
            Some("messages[0].role"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            400,
            Some("messages[0].content[0]"),
        ),
        (
            "/v1/chat/completions",
            chat("hi", json!({"response_format": {"type": "xml"}})),
            400,
            Some("response_format.type"),
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, -2]}),
            400,
            Some("prompt[1]"),
        ),
        (
            "/v1/completions",
            json!({"prompt": ["a", "b"]}),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": ""}),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "echo": true}),
            400,
            Some("echo"),
        ),
        (
            "/v1/completions",
            json!({"prompt": {"text": "hi"}}),
            400,
            Some("prompt"),
        ),
        (
            "/detokenize",
            json!({"tokens": [4096]}),
            400,
            Some("tokens[0]"),
        ),
        ("/tokenize", json!({}), 400, None),
    ];
    for (path, body, status, param) in cases {
        let (got, answer) = server.post(path, &body).await;
        assert_eq!(got, status, "{path} {body}: {answer}");
        let error = &answer["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{answer}"
        );
        assert!(error["type"].is_string(), "{answer}");
        assert_eq!(error["param"].as_str(), param, "{path} {body}: {answer}");
    }
    // Not JSON, too large, no such endpoint, wrong method: JSON errors too.
    let raw = |path: &str, body: Vec<u8>| server.client.post(server.url(path)).body(body).send();
    for (response, status) in [
        (
            raw("/v1/chat/completions", b"{\"messages\": [".to_vec())
                .await
                .unwrap(),
            400,
        ),
        (
            raw("/v1/completions", vec![b' '; 100 << 10]).await.unwrap(),
            413,
        ),
        (raw("/v1/nothing", b"{}".to_vec()).await.unwrap(), 404),
        (
            server
                .client
                .get(server.url("/v1/completions"))
                .send()
                .await
                .unwrap(),
            405,
        ),
    ] {
        assert_eq!(response.status().as_u16(), status);
        let answer: Value = response.json().await.unwrap();
        assert!(answer["error"]["message"].is_string(), "{answer}");
    }
    // The server still answers.
    let (status, _) = server
        .post(
            "/v1/completions",
            &json!({"prompt": "Emma", "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 200);
    assert!(server.metric("moeflux_client_errors_total").await >= 30.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_key_guards_every_endpoint_but_health() {
    let server = start(|o| o.api_key = Some("sesame".into())).await;
    let body = json!({"prompt": "Emma", "max_tokens": 2});
    for key in [None, Some("Bearer wrong"), Some("sesame")] {
        let mut request = server
            .client
            .post(server.url("/v1/completions"))
            .json(&body);
        if let Some(key) = key {
            request = request.header("authorization", key);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status().as_u16(), 401);
        let answer: Value = response.json().await.unwrap();
        assert_eq!(answer["error"]["type"], "authentication_error");
    }
    assert_eq!(server.get_text("/metrics").await.0, 401);
    assert_eq!(server.get_text("/health").await.0, 200);
    // The page loads without the key; its requests send it.
    let (status, page) = server.get_text("/").await;
    assert_eq!(status, 200);
    assert!(page.contains("v1/chat/completions") && page.contains("Bearer "));
    let response = server
        .client
        .post(server.url("/v1/completions"))
        .bearer_auth("sesame")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_with_retry_after() {
    let server = start(|o| {
        o.limits.max_sequences = 1;
        o.max_n = 1;
        o.limits.queue = 1;
    })
    .await;
    // One runs, one waits for room, one is queued; the rest are refused.
    let body = json!({"prompt": "Emma", "max_tokens": 400, "logit_bias": {"0": -100, "2": -100}});
    let send = || {
        server
            .client
            .post(server.url("/v1/completions"))
            .json(&body)
            .send()
    };
    let first = tokio::spawn(send());
    server.wait_metric("moeflux_running_requests", 1.0).await;
    let mut responses = futures_join((0..5).map(|_| send())).await;
    responses.push(first.await.unwrap());
    let mut statuses: Vec<u16> = Vec::new();
    for response in responses {
        let response = response.unwrap();
        let status = response.status().as_u16();
        if status == 429 {
            assert_eq!(response.headers()["retry-after"], "1");
            let answer: Value = response.json().await.unwrap();
            assert_eq!(answer["error"]["type"], "rate_limit_error");
        }
        statuses.push(status);
    }
    // The second is queued or already waiting for room, freeing the
    // queue's place for the third: two or three are answered.
    let ok = statuses.iter().filter(|&&s| s == 200).count();
    let refused = statuses.iter().filter(|&&s| s == 429).count();
    assert!(ok + refused == 6 && (2..=3).contains(&ok), "{statuses:?}");
    let rejected = server.metric("moeflux_requests_rejected_total").await;
    assert_eq!(rejected, refused as f64);
}

/// Runs the futures together.
async fn futures_join<F>(futures: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for handle in handles {
        out.push(handle.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_tokens_latencies_and_expert_reads() {
    let server = start(|_| {}).await;
    let body =
        json!({"prompt": "Emma", "max_tokens": 6, "n": 3, "logit_bias": {"0": -100, "2": -100}});
    for _ in 0..2 {
        let (status, answer) = server.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{answer}");
    }
    let (status, text) = server.get_text("/metrics").await;
    assert_eq!(status, 200);
    // Prometheus text: comments, then `name{labels} value` lines.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (name, value) = line.rsplit_once(' ').unwrap();
        assert!(name.starts_with("moeflux_"), "{line}");
        assert!(value.parse::<f64>().is_ok(), "{line}");
    }
    assert_eq!(server.metric("moeflux_requests_total").await, 2.0);
    assert_eq!(server.metric("moeflux_requests_finished_total").await, 2.0);
    assert_eq!(server.metric("moeflux_generation_tokens_total").await, 36.0);
    // Three choices read the prompt, then two: the third resumed from the
    // first request's kept session.
    let (_, ids) = server.post("/tokenize", &json!({"prompt": "Emma"})).await;
    let prompt = ids["count"].as_f64().unwrap();
    assert_eq!(
        server.metric("moeflux_prompt_tokens_total").await,
        5.0 * prompt
    );
    assert_eq!(
        server.metric("moeflux_prefix_cache_tokens_total").await,
        prompt
    );
    assert_eq!(
        server
            .metric("moeflux_time_to_first_token_seconds_count")
            .await,
        2.0
    );
    // Three choices of six tokens: five gaps each.
    assert_eq!(
        server.metric("moeflux_inter_token_seconds_count").await,
        30.0
    );
    // The three choices ran in one batch: six passes each time (the
    // prompt, five tokens; the sixth needs none). The second time the
    // resumed choice had its first token at once and ended a pass early.
    let steps = server.metric("moeflux_batch_sequences_count").await;
    let sequences = server.metric("moeflux_batch_sequences_sum").await;
    assert_eq!((steps, sequences), (12.0, 18.0 + 17.0));
    assert_eq!(server.metric("moeflux_queue_depth").await, 0.0);
    server.wait_metric("moeflux_running_requests", 0.0).await;
    let hits = server.metric("moeflux_expert_cache_hits_total").await;
    let rate = server.metric("moeflux_expert_cache_hit_rate").await;
    assert!(hits > 0.0 && rate > 0.0 && rate <= 1.0, "{hits} {rate}");
    assert!(text.contains("moeflux_expert_bytes_read_total "));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_its_timeout_ends_as_at_its_token_limit() {
    let server =
        start(|o| o.limits.request_timeout = Some(std::time::Duration::from_millis(100))).await;
    let body = json!({"prompt": "Emma", "max_tokens": 1000, "logit_bias": {"0": -100, "2": -100}});
    let started = std::time::Instant::now();
    let (status, answer) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
    let generated = answer["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(
        generated < 1000,
        "{generated} tokens: the timeout did not stop it"
    );
    assert!(started.elapsed().as_secs_f64() < 10.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignore_eos_generates_to_max_tokens() {
    let server = start(|_| {}).await;
    let ask = |ignore: bool| {
        chat(
            "Who is Mr. Darcy?",
            json!({"temperature": 0, "max_tokens": 40, "ignore_eos": ignore,
                   "chat_template_kwargs": {"enable_thinking": false}}),
        )
    };
    let (status, ended) = server.post("/v1/chat/completions", &ask(false)).await;
    assert_eq!(status, 200, "{ended}");
    assert_eq!(ended["choices"][0]["finish_reason"], "stop", "{ended}");
    let short = ended["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(short < 40, "{ended}");
    let (status, long) = server.post("/v1/chat/completions", &ask(true)).await;
    assert_eq!(status, 200, "{long}");
    assert_eq!(long["choices"][0]["finish_reason"], "length", "{long}");
    assert_eq!(long["usage"]["completion_tokens"], 40, "{long}");
    // The same answer up to where it ended, then more.
    let (a, b) = (
        ended["choices"][0]["message"]["content"].as_str().unwrap(),
        long["choices"][0]["message"]["content"].as_str().unwrap(),
    );
    assert!(b.starts_with(a) && b.len() > a.len(), "{a:?} / {b:?}");
}
