//! Constrained decoding through llguidance: `response_format` (a JSON
//! object, or one that fits a JSON schema) and `tool_choice` `required` or
//! a named function (a `<tool_call>` block whose call parses and whose
//! arguments fit the function's parameters) are enforced while sampling,
//! by masking the tokens that cannot continue the grammar.

use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use moeflux::text::{TOKENIZER_FILE, Tokenizer};
use serde_json::{Value, json};

use crate::error::ApiError;

/// The model's vocabulary as llguidance sees it: each token's bytes, and
/// tokenization through the model's own tokenizer.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.tokenizer
            .encode(&String::from_utf8_lossy(s), false)
            .unwrap_or_default()
    }
}

/// Makes a grammar's matcher for each constrained request.
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    /// The vocabulary of the model in `dir` (`tokenizer.json`), `vocab`
    /// logits wide, ending on the tokenizer's first stop id.
    pub fn new(dir: &Path, tokenizer: Arc<Tokenizer>, vocab: usize) -> moeflux::Result<Grammars> {
        let path = dir.join(TOKENIZER_FILE);
        let bad = |msg: String| moeflux::Error::bad_file(&path, msg);
        let text =
            std::fs::read_to_string(&path).map_err(|e| moeflux::Error::io(&path, "reading", e))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| bad(format!("the vocabulary for constrained decoding: {e}")))?;
        words.resize(vocab.max(words.len()), Vec::new());
        let eos = tokenizer
            .special_tokens()
            .stop_ids
            .first()
            .copied()
            .ok_or_else(|| bad("no end-of-text token to end a constrained answer".into()))?;
        let trie = TokTrie::from(&TokRxInfo::new(words.len() as u32, eos), &words);
        let env = Arc::new(Vocabulary { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&(env as _))
            .map_err(|e| bad(format!("the vocabulary for constrained decoding: {e}")))?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A matcher for `grammar`; a grammar that does not compile is the
    /// request's fault (`param`).
    pub fn matcher(&self, param: &str, grammar: TopLevelGrammar) -> Result<Matcher, ApiError> {
        // A schema the compiler does not foresee must not end the server.
        let made =
            std::panic::catch_unwind(AssertUnwindSafe(|| self.factory.create_parser(grammar)));
        match made {
            Ok(Ok(parser)) => Ok(Matcher::new(Ok(parser))),
            Ok(Err(e)) => Err(ApiError::invalid(param, format!("cannot be enforced: {e}"))),
            Err(_) => Err(ApiError::invalid(
                param,
                "cannot be enforced: the grammar compiler failed on it",
            )),
        }
    }
}

/// `schema` written as OpenAI writes JSON (`{"a": 1, "b": 2}`), with no
/// freedom in the whitespace: a model free to add whitespace may add it
/// forever. A schema's own `x-guidance` options are kept.
fn compact(mut schema: Value) -> Value {
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(
            || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// The grammar `response_format` asks for; `None` for plain text.
pub fn response_format(format: &Value) -> Result<Option<TopLevelGrammar>, ApiError> {
    let kind = format.get("type").and_then(Value::as_str);
    match kind {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(TopLevelGrammar::from_json_schema(compact(
            json!({"type": "object"}),
        )))),
        Some("json_schema") => {
            let schema = format
                .get("json_schema")
                .and_then(|s| s.get("schema"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "response_format.json_schema.schema",
                        "is missing: give the JSON schema the answer must fit",
                    )
                })?;
            if !schema.is_object() {
                return Err(ApiError::invalid(
                    "response_format.json_schema.schema",
                    "must be a JSON schema object",
                ));
            }
            Ok(Some(TopLevelGrammar::from_json_schema(compact(
                schema.clone(),
            ))))
        }
        _ => Err(ApiError::invalid(
            "response_format.type",
            "must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

/// The grammar of one `<tool_call>` block calling one of `tools` (each
/// `{"type": "function", "function": {"name", "parameters"}}`): the name
/// one of theirs, the arguments fitting its parameters.
pub fn tool_call(tools: &[Value]) -> Result<TopLevelGrammar, ApiError> {
    let mut calls = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let function = tool.get("function");
        let name = function
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::invalid(format!("tools[{i}].function.name"), "is missing"))?;
        let parameters = function
            .and_then(|f| f.get("parameters"))
            .cloned()
            .unwrap_or_else(|| json!({"type": "object"}));
        calls.push(json!({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        }));
    }
    if calls.is_empty() {
        return Err(ApiError::invalid(
            "tools",
            "is empty: tool_choice needs a function to call",
        ));
    }
    let schema = compact(json!({"anyOf": calls}));
    let lark =
        format!("start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {schema}\n");
    Ok(TopLevelGrammar::from_lark(lark))
}
