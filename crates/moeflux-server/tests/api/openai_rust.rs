//! `async-openai`, the Rust OpenAI client, against the server: models,
//! chat (whole and streamed, with usage), log-probabilities, n choices,
//! plain completions, json_schema, tool calls (whole and streamed) and
//! errors, each read through the client's own types. What the client
//! cannot parse fails here as it would for a Rust application.

use crate::common::start;
use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::types::chat::{
    ChatCompletionMessageToolCalls, ChatCompletionRequestMessage,
    ChatCompletionRequestUserMessageArgs, ChatCompletionStreamOptions, ChatCompletionTool,
    ChatCompletionToolChoiceOption, ChatCompletionTools, CreateChatCompletionRequest,
    CreateChatCompletionRequestArgs, FinishReason, FunctionObjectArgs, ResponseFormat,
    ResponseFormatJsonSchema, Role, ToolChoiceOptions,
};
use async_openai::types::completions::CreateCompletionRequestArgs;
use futures_util::StreamExt;
use serde_json::{Value, json};

const MODEL: &str = moeflux::bundled::NAME;

fn user(text: &str) -> Vec<ChatCompletionRequestMessage> {
    vec![
        ChatCompletionRequestUserMessageArgs::default()
            .content(text)
            .build()
            .unwrap()
            .into(),
    ]
}

/// A request with the usual model and messages; `adjust` sets the rest.
fn chat(
    text: &str,
    adjust: impl FnOnce(&mut CreateChatCompletionRequestArgs),
) -> CreateChatCompletionRequest {
    let mut args = CreateChatCompletionRequestArgs::default();
    args.model(MODEL).messages(user(text));
    adjust(&mut args);
    args.build().unwrap()
}

/// The server's error as the client parsed it.
fn api_error(result: Result<impl std::fmt::Debug, OpenAIError>) -> async_openai::error::ApiError {
    match result {
        Err(OpenAIError::ApiError(e)) => e,
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_async_openai_client_reads_every_answer() {
    let server = start(|o| o.api_key = Some("sesame".into())).await;
    let config = OpenAIConfig::new()
        .with_api_base(server.url("/v1"))
        .with_api_key("sesame");
    let client = Client::with_config(config.clone());

    let models = client.models().list().await.unwrap();
    assert_eq!(
        models
            .data
            .iter()
            .map(|m| m.id.as_str())
            .collect::<Vec<_>>(),
        [MODEL]
    );

    // A whole answer, greedy, with log-probabilities.
    let answer = client
        .chat()
        .create(chat("Who is Mr. Darcy?", |a| {
            a.max_completion_tokens(12u32)
                .temperature(0.0)
                .logprobs(true)
                .top_logprobs(3u8);
        }))
        .await
        .unwrap();
    assert_eq!(answer.object, "chat.completion");
    assert_eq!(answer.model, MODEL);
    let choice = &answer.choices[0];
    assert_eq!(choice.message.role, Role::Assistant);
    assert!(matches!(
        choice.finish_reason,
        Some(FinishReason::Stop | FinishReason::Length)
    ));
    let usage = answer.usage.as_ref().unwrap();
    assert_eq!(
        usage.total_tokens,
        usage.prompt_tokens + usage.completion_tokens
    );
    let tokens = choice.logprobs.as_ref().unwrap().content.as_ref().unwrap();
    assert_eq!(tokens.len(), usage.completion_tokens as usize);
    for token in tokens {
        assert_eq!(token.top_logprobs.len(), 3);
        assert!(token.logprob <= 0.0);
        // The alternatives come likeliest first (the chosen token need not
        // be the first: the model's repetition penalty moves the choice,
        // not the reported log-probabilities).
        let top: Vec<f32> = token.top_logprobs.iter().map(|t| t.logprob).collect();
        assert!(top.is_sorted_by(|a, b| a >= b), "{token:?}");
        assert!(token.logprob <= top[0], "{token:?}");
        let bytes = token.bytes.as_ref().unwrap();
        assert_eq!(String::from_utf8_lossy(bytes), token.token);
    }
    let content = choice.message.content.clone().unwrap_or_default();

    // The same answer streamed, with usage in the last chunk.
    let mut stream = client
        .chat()
        .create_stream(chat("Who is Mr. Darcy?", |a| {
            a.max_completion_tokens(12u32)
                .temperature(0.0)
                .stream_options(ChatCompletionStreamOptions {
                    include_usage: Some(true),
                    include_obfuscation: None,
                });
        }))
        .await
        .unwrap();
    let (mut text, mut finish, mut streamed_usage, mut chunks) = (String::new(), None, None, 0);
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        assert_eq!(chunk.object, "chat.completion.chunk");
        chunks += 1;
        for c in &chunk.choices {
            text.push_str(c.delta.content.as_deref().unwrap_or(""));
            finish = c.finish_reason.or(finish);
        }
        streamed_usage = chunk.usage.or(streamed_usage);
    }
    assert!(chunks > 2, "{chunks} chunks");
    assert_eq!(text, content);
    assert_eq!(finish, choice.finish_reason);
    assert_eq!(streamed_usage.as_ref(), Some(usage));

    // n choices, seeded: each index once, and the same again.
    let seeded = |_: ()| {
        chat("Who is Mr. Darcy?", |a| {
            #[allow(deprecated)]
            a.max_completion_tokens(8u32)
                .n(3u8)
                .seed(7)
                .temperature(0.9);
        })
    };
    let many = client.chat().create(seeded(())).await.unwrap();
    let mut indices: Vec<u32> = many.choices.iter().map(|c| c.index).collect();
    indices.sort();
    assert_eq!(indices, [0, 1, 2]);
    let again = client.chat().create(seeded(())).await.unwrap();
    let texts = |r: &async_openai::types::chat::CreateChatCompletionResponse| {
        let mut t: Vec<(u32, Option<String>)> = r
            .choices
            .iter()
            .map(|c| (c.index, c.message.content.clone()))
            .collect();
        t.sort();
        t
    };
    assert_eq!(texts(&many), texts(&again));
    assert_eq!(many.usage, again.usage);

    // A plain completion with the legacy log-probabilities.
    let completion = client
        .completions()
        .create(
            CreateCompletionRequestArgs::default()
                .model(MODEL)
                .prompt("It is a truth universally acknowledged,")
                .max_tokens(8u32)
                .temperature(0.0)
                .logprobs(2u8)
                .build()
                .unwrap(),
        )
        .await
        .unwrap();
    let logprobs = completion.choices[0].logprobs.as_ref().unwrap();
    assert_eq!(
        logprobs.token_logprobs.len(),
        completion.usage.unwrap().completion_tokens as usize
    );
    assert_eq!(logprobs.tokens.concat(), completion.choices[0].text);

    // Structured output: the answer parses and fits the schema.
    let schema = json!({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "daughters": {"type": "integer", "maximum": 9}},
        "required": ["name", "daughters"],
        "additionalProperties": false,
    });
    let structured = client
        .chat()
        .create(chat("Describe Mr. Bennet.", |a| {
            #[allow(deprecated)]
            a.max_completion_tokens(100u32)
                .seed(3)
                .response_format(ResponseFormat::JsonSchema {
                    json_schema: ResponseFormatJsonSchema {
                        description: None,
                        name: "person".into(),
                        schema: Some(schema),
                        strict: Some(true),
                    },
                });
        }))
        .await
        .unwrap();
    let person: Value =
        serde_json::from_str(structured.choices[0].message.content.as_deref().unwrap()).unwrap();
    assert!(
        person["name"].is_string() && person["daughters"].is_i64(),
        "{person}"
    );
    assert_eq!(person.as_object().unwrap().len(), 2, "{person}");

    // A forced tool call, whole and streamed.
    let tool = ChatCompletionTools::Function(ChatCompletionTool {
        function: FunctionObjectArgs::default()
            .name("weather")
            .description("The weather in a town")
            .parameters(json!({
                "type": "object",
                "properties": {"town": {"type": "string", "maxLength": 10}},
                "required": ["town"], "additionalProperties": false,
            }))
            .build()
            .unwrap(),
    });
    let request = |_: ()| {
        chat("Rain in Bath?", |a| {
            #[allow(deprecated)]
            a.tools(vec![tool.clone()])
                .tool_choice(ChatCompletionToolChoiceOption::Mode(
                    ToolChoiceOptions::Required,
                ))
                .max_completion_tokens(60u32)
                .seed(2);
        })
    };
    let called = client.chat().create(request(())).await.unwrap();
    let choice = &called.choices[0];
    assert_eq!(choice.finish_reason, Some(FinishReason::ToolCalls));
    let calls = choice.message.tool_calls.as_ref().unwrap();
    let ChatCompletionMessageToolCalls::Function(call) = &calls[0] else {
        panic!("not a function call: {calls:?}");
    };
    assert_eq!(call.function.name, "weather");
    assert!(!call.id.is_empty());
    let arguments: Value = serde_json::from_str(&call.function.arguments).unwrap();
    assert!(arguments["town"].is_string(), "{arguments}");
    let mut stream = client.chat().create_stream(request(())).await.unwrap();
    let (mut name, mut streamed_arguments, mut finish) = (String::new(), String::new(), None);
    while let Some(chunk) = stream.next().await {
        for c in chunk.unwrap().choices {
            for t in c.delta.tool_calls.into_iter().flatten() {
                assert_eq!(t.index, 0);
                let function = t.function.unwrap();
                name.push_str(function.name.as_deref().unwrap_or(""));
                streamed_arguments.push_str(function.arguments.as_deref().unwrap_or(""));
            }
            finish = c.finish_reason.or(finish);
        }
    }
    assert_eq!(
        (name.as_str(), streamed_arguments.as_str(), finish),
        (
            "weather",
            call.function.arguments.as_str(),
            Some(FinishReason::ToolCalls)
        )
    );

    // Errors arrive as the client's ApiError, naming the field.
    let error = api_error(
        client
            .chat()
            .create(chat("Hello", |a| {
                a.temperature(5.0);
            }))
            .await,
    );
    assert_eq!(error.param.as_deref(), Some("temperature"), "{error:?}");
    assert_eq!(error.r#type.as_deref(), Some("invalid_request_error"));
    let error = api_error(
        client
            .chat()
            .create(chat("Hello", |a| {
                a.model("gpt-4o");
            }))
            .await,
    );
    assert!(error.message.contains("gpt-4o"), "{error:?}");
    let error = api_error(
        client
            .chat()
            .create(chat("Hello", |a| {
                a.max_completion_tokens(1_000_000u32);
            }))
            .await,
    );
    assert!(!error.message.is_empty(), "{error:?}");
    let wrong = Client::with_config(config.with_api_key("wrong"));
    let error = api_error(wrong.models().list().await);
    assert!(!error.message.is_empty(), "{error:?}");
    println!(
        "async-openai: models, chat, streaming, usage, logprobs, n, seed, completions, json_schema, \
         tool calls (whole and streamed), errors: ok"
    );
}
