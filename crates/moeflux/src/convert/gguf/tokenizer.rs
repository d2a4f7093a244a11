//! The tokenizer files of a GGUF model, rebuilt from its metadata:
//! `tokenizer.json` (byte-level BPE: `tokenizer.ggml.tokens`, `merges`,
//! `token_type`, the pre-tokenizer regex `tokenizer.ggml.pre` names),
//! `tokenizer_config.json` (the chat template, the special tokens) and
//! `generation_config.json` (the ids that end generation, as llama.cpp
//! picks them, and `general.sampling.*` defaults). A GGUF that embeds the
//! original `tokenizer.huggingface.json` gives it verbatim.

use std::collections::BTreeSet;

use serde_json::{Map, Value as Json, json};

use super::{GgufFile, TokenizerFiles};
use crate::error::Result;

/// llama.cpp's token types.
const NORMAL: i64 = 1;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;
const UNUSED: i64 = 5;

/// The Hugging Face pre-tokenizer regex of the `tokenizer.ggml.pre` values
/// Qwen models use (llama.cpp's llama-vocab.cpp lists the same patterns).
fn pre_tokenizer_regex(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "qwen2" => {
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        }
        "qwen35" => {
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        }
        _ => return None,
    })
}

/// Texts of control tokens llama.cpp treats as end of generation.
const END_OF_GENERATION: &[&str] = &[
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
];

fn to_json(value: &Json) -> Vec<u8> {
    (serde_json::to_string_pretty(value).expect("JSON values serialize") + "\n").into_bytes()
}

/// The tokenizer files of a GGUF model, and notes on what could not be
/// rebuilt.
pub(super) fn side_files(meta: &GgufFile, config: &Json) -> Result<TokenizerFiles> {
    let mut files = Vec::new();
    let mut notes = Vec::new();
    let tokens = meta.strings("tokenizer.ggml.tokens")?;
    let id = |key: &str| -> Result<Option<u32>> {
        let v = meta.uint(key)?;
        Ok(v.and_then(|v| u32::try_from(v).ok())
            .filter(|&v| tokens.as_ref().is_some_and(|t| (v as usize) < t.len())))
    };
    let text = |id: Option<u32>| -> Option<String> { Some(tokens.as_ref()?[id? as usize].clone()) };
    let types = match &tokens {
        Some(t) => {
            let types = meta
                .ints("tokenizer.ggml.token_type")?
                .unwrap_or_else(|| vec![NORMAL; t.len()]);
            if types.len() != t.len() {
                return Err(meta.field_error(
                    "tokenizer.ggml.token_type",
                    format!("{} types for {} tokens", types.len(), t.len()),
                ));
            }
            types
        }
        None => Vec::new(),
    };
    let (bos, eos, pad, unk) = (
        id("tokenizer.ggml.bos_token_id")?,
        id("tokenizer.ggml.eos_token_id")?,
        id("tokenizer.ggml.padding_token_id")?,
        id("tokenizer.ggml.unknown_token_id")?,
    );
    let add_bos = meta.bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false);

    let tokenizer_json = if let Some(hf) = meta.string("tokenizer.huggingface.json")? {
        Some(hf.as_bytes().to_vec())
    } else {
        match (meta.string("tokenizer.ggml.model")?, &tokens) {
            (None, _) | (_, None) => {
                notes.push(
                    "the GGUF holds no tokenizer: the model takes and prints token ids only"
                        .to_string(),
                );
                None
            }
            (Some("gpt2"), Some(tokens)) => {
                let pre = meta.string("tokenizer.ggml.pre")?.unwrap_or("default");
                match pre_tokenizer_regex(pre) {
                    Some(regex) => Some(to_json(&bpe_tokenizer(
                        meta,
                        tokens,
                        &types,
                        regex,
                        add_bos.then(|| bos.zip(text(bos))).flatten(),
                    )?)),
                    None => {
                        notes.push(format!(
                            "tokenizer not rebuilt: its pre-tokenizer `{pre}` is not one moeflux \
                             knows (qwen2, qwen35); copy the model's tokenizer.json and \
                             tokenizer_config.json into the converted folder"
                        ));
                        None
                    }
                }
            }
            (Some(model), _) => {
                notes.push(format!(
                    "tokenizer not rebuilt: tokenizer model `{model}` is not byte-level BPE; copy \
                     the model's tokenizer.json and tokenizer_config.json into the converted folder"
                ));
                None
            }
        }
    };
    let Some(tokenizer_json) = tokenizer_json else {
        return Ok(TokenizerFiles { files, notes });
    };
    files.push(("tokenizer.json".to_string(), tokenizer_json));

    let mut tc = Map::new();
    tc.insert("add_bos_token".into(), json!(add_bos));
    tc.insert("add_eos_token".into(), json!(false));
    for (key, token) in [
        ("bos_token", bos),
        ("eos_token", eos),
        ("pad_token", pad),
        ("unk_token", unk),
    ] {
        if let Some(t) = text(token) {
            tc.insert(key.into(), json!(t));
        }
    }
    if let Some(template) = meta.string("tokenizer.chat_template")? {
        tc.insert("chat_template".into(), json!(template));
    }
    tc.insert("clean_up_tokenization_spaces".into(), json!(false));
    if let Some(n) = config.get("max_position_embeddings") {
        tc.insert("model_max_length".into(), n.clone());
    }
    tc.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    files.push((
        "tokenizer_config.json".to_string(),
        to_json(&Json::Object(tc)),
    ));

    // Generation ends at eos, eot, eom and the control tokens llama.cpp
    // treats as end of generation.
    let mut stop: Vec<u32> = Vec::new();
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        if let Some(t) = id(key)?
            && !stop.contains(&t)
        {
            stop.push(t);
        }
    }
    let tokens = tokens.as_deref().unwrap_or_default();
    let known: BTreeSet<&str> = END_OF_GENERATION.iter().copied().collect();
    for (i, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
        if ty == CONTROL && known.contains(t.as_str()) && !stop.contains(&(i as u32)) {
            stop.push(i as u32);
        }
    }
    let mut gc = Map::new();
    if let Some(b) = bos {
        gc.insert("bos_token_id".into(), json!(b));
    }
    if !stop.is_empty() {
        gc.insert("eos_token_id".into(), json!(stop));
    }
    if let Some(p) = pad {
        gc.insert("pad_token_id".into(), json!(p));
    }
    for (key, hf) in [
        ("general.sampling.temp", "temperature"),
        ("general.sampling.top_k", "top_k"),
        ("general.sampling.top_p", "top_p"),
        ("general.sampling.min_p", "min_p"),
        ("general.sampling.penalty_repeat", "repetition_penalty"),
    ] {
        if let Some(v) = meta.float(key)? {
            let v = if hf == "top_k" {
                json!(v as u64)
            } else {
                json!(v)
            };
            gc.insert(hf.into(), v);
        }
    }
    if let Some(t) = gc.get("temperature").and_then(Json::as_f64) {
        gc.insert("do_sample".into(), json!(t > 0.0));
    }
    files.push((
        "generation_config.json".to_string(),
        to_json(&Json::Object(gc)),
    ));
    Ok(TokenizerFiles { files, notes })
}

/// A byte-level BPE `tokenizer.json`.
fn bpe_tokenizer(
    meta: &GgufFile,
    tokens: &[String],
    types: &[i64],
    regex: &str,
    bos: Option<(u32, String)>,
) -> Result<Json> {
    let merges = meta.strings("tokenizer.ggml.merges")?.ok_or_else(|| {
        meta.field_error(
            "tokenizer.ggml.merges",
            "missing: a BPE tokenizer needs its merges",
        )
    })?;
    let merges: Vec<Json> = merges
        .iter()
        .map(|m| match m.split_once(' ') {
            Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains(' ') => Ok(json!([a, b])),
            _ => Err(meta.field_error(
                "tokenizer.ggml.merges",
                format!("`{m}` is not two tokens separated by a space"),
            )),
        })
        .collect::<Result<_>>()?;
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (i, (t, &ty)) in tokens.iter().zip(types).enumerate() {
        if ty == UNUSED || vocab.contains_key(t) {
            continue;
        }
        vocab.insert(t.clone(), json!(i));
        if ty == CONTROL || ty == USER_DEFINED {
            added.push(json!({
                "id": i,
                "content": t,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": ty == CONTROL,
            }));
        }
    }
    let post_processor = match bos {
        Some((id, text)) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": text, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}
            ],
            "special_tokens": {text.clone(): {"id": text, "ids": [id], "tokens": [text]}}
        }),
        None => json!({
            "type": "ByteLevel",
            "add_prefix_space": false,
            "trim_offsets": false,
            "use_regex": false
        }),
    };
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
            ]
        },
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges
        }
    }))
}
