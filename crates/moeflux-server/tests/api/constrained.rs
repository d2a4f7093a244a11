//! Structured output and forced tool calls, enforced while sampling: the
//! answers parse and fit their schema whatever the model would rather
//! write (the bundled model was trained on novels, not JSON).

use crate::common::{Events, start};
use serde_json::{Value, json};

fn person() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "married": {"type": "boolean"},
            "daughters": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["name", "married", "daughters"],
        "additionalProperties": false,
    })
}

fn fits_person(v: &Value) -> bool {
    let o = v.as_object().unwrap();
    o.len() == 3
        && o["name"].as_str().is_some_and(|n| n.chars().count() <= 12)
        && o["married"].is_boolean()
        && o["daughters"].as_u64().is_some_and(|d| d <= 9)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_and_json_object_answers_parse_and_fit() {
    let server = start(|_| {}).await;
    let ask = |format: Value, seed: u64| {
        json!({
            "messages": [{"role": "user", "content": "Describe Mr. Bennet."}],
            "response_format": format, "max_tokens": 200, "temperature": 0.8,
            "seed": seed, "n": 2,
        })
    };
    let schema =
        json!({"type": "json_schema", "json_schema": {"name": "person", "schema": person()}});
    for seed in 0..2 {
        let (status, answer) = server
            .post("/v1/chat/completions", &ask(schema.clone(), seed))
            .await;
        assert_eq!(status, 200, "{answer}");
        for choice in answer["choices"].as_array().unwrap() {
            assert_eq!(choice["finish_reason"], "stop", "{choice}");
            let text = choice["message"]["content"].as_str().unwrap();
            let value: Value =
                serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(fits_person(&value), "{value}");
        }
    }
    let (status, answer) = server
        .post(
            "/v1/chat/completions",
            &ask(json!({"type": "json_object"}), 3),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    let choice = &answer["choices"][0];
    if choice["finish_reason"] == "stop" {
        let text = choice["message"]["content"].as_str().unwrap();
        let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(value.is_object(), "{value}");
    }

    // A schema that cannot be compiled is the request's fault.
    let bad = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}});
    let (status, answer) = server.post("/v1/chat/completions", &ask(bad, 0)).await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(answer["error"]["param"], "response_format");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_required_or_named_tool_choice_always_makes_a_call_that_parses() {
    let server = start(|_| {}).await;
    let tools = json!([
        {"type": "function", "function": {"name": "weather", "parameters": {
            "type": "object", "properties": {"town": {"type": "string", "maxLength": 10}},
            "required": ["town"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "post", "parameters": person()}},
    ]);
    for (choice, want) in [
        (json!("required"), None),
        (
            json!({"type": "function", "function": {"name": "post"}}),
            Some("post"),
        ),
    ] {
        let body = json!({
            "messages": [{"role": "user", "content": "Is it raining in Bath?"}],
            "tools": tools, "tool_choice": choice, "max_tokens": 200, "temperature": 0.7, "seed": 1,
        });
        let (status, answer) = server.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{answer}");
        let choice = &answer["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{choice}");
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{choice}");
        let function = &calls[0]["function"];
        let name = function["name"].as_str().unwrap();
        let args: Value = serde_json::from_str(function["arguments"].as_str().unwrap()).unwrap();
        match name {
            "weather" => assert!(
                args["town"]
                    .as_str()
                    .is_some_and(|t| t.chars().count() <= 10)
            ),
            "post" => assert!(fits_person(&args), "{args}"),
            other => panic!("called {other}"),
        }
        if let Some(want) = want {
            assert_eq!(name, want);
        }

        // Streamed: the call comes as a tool_calls delta.
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let chunks = Events::open(&server, "/v1/chat/completions", &streamed)
            .await
            .all()
            .await;
        let calls: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
            .flatten()
            .collect();
        assert_eq!(calls.len(), 1, "{chunks:?}");
        assert_eq!(calls[0]["function"], *function, "the same call streamed");
        assert_eq!(
            chunks.last().unwrap()["choices"][0]["finish_reason"],
            "tool_calls"
        );
    }
    let body = json!({
        "messages": [{"role": "user", "content": "Hi"}], "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "dance"}},
    });
    let (status, answer) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(
        (status, answer["error"]["param"].as_str()),
        (400, Some("tool_choice"))
    );
}
