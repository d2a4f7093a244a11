//! Speculative decoding per request: a request with `"draft": "lookup"`
//! answers with the tokens it gets without drafts (greedy), alone and in a
//! batch with others; the drafts checked and kept show in /metrics; bad
//! drafting fields are 400s naming them.

use crate::common::{Events, TestServer, start, start_on};
use moeflux::ModelOptions;
use serde_json::{Value, json};

/// A prompt whose greedy continuation repeats some of its own phrases
/// (which prompt lookup drafts) within [`TOKENS`] tokens.
fn prompt() -> String {
    "It is a truth universally acknowledged, that".to_string()
}

const TOKENS: usize = 120;

/// The greedy answer's text and each token's log-probability.
async fn greedy(
    server: &TestServer,
    draft: Option<Value>,
    draft_tokens: Option<usize>,
) -> (String, Vec<f64>) {
    let mut body = json!({
        "prompt": prompt(), "max_tokens": TOKENS, "temperature": 0, "logprobs": 0,
    });
    if let Some(draft) = draft {
        body["draft"] = draft;
    }
    if let Some(k) = draft_tokens {
        body["draft_tokens"] = json!(k);
    }
    let (status, answer) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    let choice = &answer["choices"][0];
    let lp = choice["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    (choice["text"].as_str().unwrap().to_string(), lp)
}

fn max_difference(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Log-probabilities of a drafted answer against plain decoding's: a
/// check runs several tokens in one pass, bounded as the library's
/// prefill-against-decode tests bound it.
const TOLERANCE: f64 = 1e-4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafted_requests_answer_as_plain_decoding_alone_and_in_a_batch() {
    let server = start(|_| {}).await;
    let (want, want_lp) = greedy(&server, None, None).await;
    assert_eq!(want_lp.len(), TOKENS);
    assert_eq!(server.metric("moeflux_draft_checks_total").await, 0.0);

    for draft in [json!("lookup"), json!("mtp"), json!("off")] {
        let (text, lp) = greedy(&server, Some(draft.clone()), None).await;
        assert_eq!(text, want, "draft {draft}");
        let diff = max_difference(&lp, &want_lp);
        assert!(
            diff <= TOLERANCE,
            "draft {draft}: log-probabilities differ by {diff}"
        );
    }
    let (text, lp) = greedy(&server, Some(json!("lookup")), Some(3)).await;
    assert_eq!(text, want, "three tokens drafted a step");
    let diff = max_difference(&lp, &want_lp);
    assert!(
        diff <= TOLERANCE,
        "three a step: log-probabilities differ by {diff}"
    );
    let checks = server.metric("moeflux_draft_checks_total").await;
    let drafted = server.metric("moeflux_drafted_tokens_total").await;
    let kept = server.metric("moeflux_draft_accepted_tokens_total").await;
    println!("alone: {checks} checks, {kept} of {drafted} drafts kept");
    assert!(checks > 0.0 && kept > 0.0, "{checks} checks, {kept} kept");
    assert!(kept <= drafted);
    let rate = server.metric("moeflux_draft_acceptance_rate").await;
    assert!((rate - kept / drafted).abs() < 1e-9);

    // Others in the batch: drafted and plain, sampled and greedy, with
    // fixed and adaptive draft lengths.
    let mut others = Vec::new();
    for i in 0..5 {
        let mut body = json!({
            "prompt": format!("{} {}", prompt(), "Emma ".repeat(i)), "stream": true,
            "max_tokens": 300, "ignore_eos": true, "temperature": if i % 2 == 0 { 0.0 } else { 0.9 },
            "seed": i,
        });
        if i < 3 {
            body["draft"] = json!("lookup");
            body["draft_tokens"] = json!(i + 1);
        }
        let mut events = Events::open(&server, "/v1/completions", &body).await;
        for _ in 0..2 {
            assert!(events.next().await.is_some());
        }
        others.push(events);
    }
    server.wait_metric("moeflux_running_requests", 5.0).await;
    let (text, lp) = greedy(&server, Some(json!("lookup")), Some(3)).await;
    assert_eq!(text, want, "drafted in a batch, the greedy text differs");
    let diff = max_difference(&lp, &want_lp);
    println!("in a batch of 6: log-probabilities within {diff:.2e}");
    assert!(
        diff <= TOLERANCE,
        "in a batch, log-probabilities differ by {diff}"
    );
    assert!(server.metric("moeflux_draft_checks_total").await > checks);
    // The sampled and drafted streams run to their token limit.
    let mut lengths = Vec::new();
    for events in others {
        let chunks = events.all().await;
        let last = chunks
            .iter()
            .rev()
            .find(|c| c["choices"][0]["finish_reason"].is_string());
        lengths.push(last.map(|c| c["choices"][0]["finish_reason"].clone()));
    }
    assert!(
        lengths.iter().all(|f| f == &Some(json!("length"))),
        "{lengths:?}"
    );
    server.wait_metric("moeflux_running_requests", 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_drafting_fields_are_refused_naming_them() {
    let server = start(|_| {}).await;
    let cases = [
        (json!({"draft": "sometimes"}), "draft"),
        (json!({"draft_tokens": 3}), "draft_tokens"),
        (
            json!({"draft": "lookup", "draft_tokens": 0}),
            "draft_tokens",
        ),
        (
            json!({"draft": "lookup", "draft_tokens": 17}),
            "draft_tokens",
        ),
        (json!({"draft": 4}), "draft"),
    ];
    for (fields, param) in cases {
        let mut body = json!({"prompt": "Emma", "max_tokens": 4});
        for (k, v) in fields.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, answer) = server.post("/v1/completions", &body).await;
        assert_eq!(status, 400, "{body}: {answer}");
        assert_eq!(answer["error"]["param"], param, "{body}: {answer}");
    }
}

/// A model opened without its multi-token-prediction head refuses
/// requests that draft with it, naming the field, and serves the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafting_with_a_head_the_model_lacks_is_refused() {
    let without = ModelOptions {
        mtp_head: false,
        ..ModelOptions::default()
    };
    let server = start_on(crate::common::bundled_with(&without), |_| {}).await;
    let body = json!({"prompt": "Emma", "max_tokens": 4, "draft": "mtp"});
    let (status, answer) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(answer["error"]["param"], "draft", "{answer}");
    assert!(
        answer["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("multi-token-prediction head")),
        "{answer}"
    );
    let body = json!({"prompt": "Emma", "max_tokens": 4, "draft": "lookup"});
    let (status, answer) = server.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
}
