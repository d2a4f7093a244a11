//! Text in, text out: the tokenizer, chat templates and streaming
//! detokenization of a model directory, matching Hugging Face
//! transformers.
//!
//! - [`Tokenizer`]: `tokenizer.json` through the `tokenizers` crate, with
//!   the special tokens of `tokenizer_config.json`,
//!   `generation_config.json` and `config.json`;
//! - [`StreamDecoder`]: ids to text as they are generated, whole
//!   characters only;
//! - [`ChatTemplate`]: the model's Jinja chat template, rendered as
//!   transformers renders it;
//! - [`TextGeneration`]: generated text streamed as it arrives, with stop
//!   strings, limits and interruption; [`complete`]: prompt in, text out.

mod chat;
mod generation;
mod stream;
mod tokenizer;

pub use chat::{CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE, ChatMessage, ChatOptions, ChatTemplate};
pub use generation::{Completion, FinishReason, Generated, TextGeneration, TokenLogprob, complete};
pub use stream::StreamDecoder;
pub use tokenizer::{
    CONFIG_FILE, GENERATION_CONFIG_FILE, SpecialToken, SpecialTokens, TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE, Tokenizer,
};

#[cfg(test)]
pub(crate) mod tests {
    //! Parity with transformers on the bundled model's tokenizer and chat
    //! template, against the fixtures `tools/train_bundled_model.py` wrote
    //! into `bundled/qwen35-tiny/reference.json`.

    use std::path::PathBuf;

    use serde_json::Value;

    use super::*;

    pub(crate) fn bundled_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bundled/qwen35-tiny")
    }

    pub(crate) fn bundled_tokenizer() -> Tokenizer {
        Tokenizer::from_dir(&bundled_dir()).unwrap()
    }

    fn reference() -> Value {
        let path = bundled_dir().join("reference.json");
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
    }

    fn ids(v: &Value) -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    }

    #[test]
    fn encode_and_decode_match_transformers() {
        let tok = bundled_tokenizer();
        let cases = reference()["encode"].as_array().unwrap().clone();
        assert!(cases.len() >= 10);
        for case in cases {
            let text = case["text"].as_str().unwrap();
            assert_eq!(
                tok.encode(text, false).unwrap(),
                ids(&case["ids"]),
                "{text:?}"
            );
            assert_eq!(
                tok.encode(text, true).unwrap(),
                ids(&case["ids_with_special_tokens"]),
                "{text:?}"
            );
            let ids = ids(&case["ids"]);
            assert_eq!(
                tok.decode(&ids, false).unwrap(),
                case["decoded"].as_str().unwrap()
            );
            assert_eq!(
                tok.decode(&ids, true).unwrap(),
                case["decoded_skip_special"].as_str().unwrap()
            );
        }
    }

    #[test]
    fn heldout_text_tokenizes_as_in_transformers() {
        let tok = bundled_tokenizer();
        let reference = reference();
        let ppl = &reference["perplexity"];
        let text = std::fs::read_to_string(bundled_dir().join("heldout.txt")).unwrap();
        let got = tok.encode(&text, false).unwrap();
        assert_eq!(got.len() as u64, ppl["n_tokens"].as_u64().unwrap());
        assert_eq!(got[..32], ids(&ppl["first_ids"]));
    }

    #[test]
    fn special_tokens_match_transformers() {
        let tok = bundled_tokenizer();
        let reference = reference();
        let want = &reference["special_tokens"];
        let special = tok.special_tokens();
        let eos = special.eos.as_ref().unwrap();
        assert_eq!(eos.text, want["eos_token"].as_str().unwrap());
        assert_eq!(u64::from(eos.id), want["eos_token_id"].as_u64().unwrap());
        let pad = special.pad.as_ref().unwrap();
        assert_eq!(u64::from(pad.id), want["pad_token_id"].as_u64().unwrap());
        assert_eq!(special.bos, None);
        assert_eq!(special.stop_ids, ids(&want["generation_eos_token_ids"]));
        assert_eq!(special.named["eos_token"], eos.text);
    }

    #[test]
    fn chat_template_renders_as_in_transformers() {
        let tok = bundled_tokenizer();
        let template = ChatTemplate::from_dir(&bundled_dir(), tok.special_tokens(), None).unwrap();
        let cases = reference()["chat_template"].as_array().unwrap().clone();
        let (mut rendered, mut raised) = (0, 0);
        for case in cases {
            let messages: Vec<ChatMessage> = case["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| {
                    ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap())
                })
                .collect();
            let options = ChatOptions {
                add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
                extra: case["kwargs"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            };
            let got = template.render(&messages, &options);
            if let Some(error) = case.get("error") {
                let err = got.unwrap_err().to_string();
                assert!(err.contains(error.as_str().unwrap()), "{err}");
                assert!(err.contains("tokenizer_config.json"), "{err}");
                raised += 1;
            } else {
                let text = got.unwrap();
                assert_eq!(
                    text,
                    case["text"].as_str().unwrap(),
                    "{messages:?} {options:?}"
                );
                assert_eq!(tok.encode(&text, false).unwrap(), ids(&case["ids"]));
                rendered += 1;
            }
        }
        assert!(
            rendered >= 5 && raised >= 2,
            "{rendered} rendered, {raised} raised"
        );
    }
}
