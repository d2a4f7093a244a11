//! A model directory's tokenizer (`tokenizer.json`) and its special tokens.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};

pub use crate::format::{
    CONFIG_FILE, GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE,
};
use crate::util::read_json_if_present;

/// The named special tokens transformers passes to chat templates
/// (`PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES`).
const NAMED_SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// One token: its id and its text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecialToken {
    pub id: u32,
    pub text: String,
}

/// The special tokens of a model, gathered the way transformers does:
/// strings from `tokenizer_config.json`, ids from `generation_config.json`
/// and then `config.json` where the tokenizer config names none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<SpecialToken>,
    pub eos: Option<SpecialToken>,
    pub pad: Option<SpecialToken>,
    /// Ids that end generation: `generation_config.json`'s `eos_token_id`
    /// (one id or a list), else `config.json`'s, else the tokenizer's EOS.
    pub stop_ids: Vec<u32>,
    /// `bos_token`, `eos_token`, ... as strings: chat templates read them.
    pub named: BTreeMap<String, String>,
}

/// A Hugging Face tokenizer loaded from `tokenizer.json`, with the special
/// tokens of its model directory.
///
/// Conversion copies the tokenizer files into the model directory, so the
/// directory [`Model::open`](crate::Model::open) takes also gives the
/// tokenizer:
///
/// ```
/// use moeflux::text::Tokenizer;
///
/// let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
/// let tokenizer = Tokenizer::from_dir(&dir)?;
///
/// let ids = tokenizer.encode("Pride and Prejudice", false)?;
/// assert!(!ids.is_empty());
/// assert_eq!(tokenizer.decode(&ids, false)?, "Pride and Prejudice");
///
/// let end = tokenizer.special_tokens().eos.as_ref().unwrap();
/// assert_eq!(end.text, "<|im_end|>");
/// assert_eq!(tokenizer.token_to_id("<|im_end|>"), Some(end.id));
/// # Ok::<(), moeflux::Error>(())
/// ```
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    special: SpecialTokens,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("special", &self.special)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` and the special tokens named by
    /// `tokenizer_config.json`, `generation_config.json` and `config.json`
    /// (each optional).
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join(TOKENIZER_FILE);
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::config(
                    &path,
                    "not found: text input and output need the tokenizer; copy tokenizer.json \
                     (and tokenizer_config.json) from the original Hugging Face checkpoint into \
                     this directory",
                ));
            }
            Err(e) => return Err(Error::io(&path, "reading the tokenizer", e)),
        };
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            Error::bad_file(
                &path,
                format!("not a tokenizer the `tokenizers` library can load: {e}"),
            )
        })?;
        let mut tokenizer = Tokenizer {
            inner,
            path,
            special: SpecialTokens::default(),
        };
        tokenizer.special = tokenizer.read_special_tokens(dir)?;
        Ok(tokenizer)
    }

    /// The `tokenizer.json` this was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// BOS, EOS, padding, the ids that end generation, and the named
    /// tokens chat templates read.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// Ids in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token written as in the vocabulary (`<|im_end|>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary entry of `id` (not decoded: byte-level tokens show
    /// their byte symbols).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Token ids of `text`. `add_special_tokens` runs the tokenizer's post
    /// processor (e.g. a BOS token where the model wants one), as
    /// transformers' `encode` does by default; chat prompts rendered by a
    /// template already hold their special tokens and pass `false`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| Error::bad_file(&self.path, format!("cannot encode text: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`. Invalid UTF-8 (a multi-byte character cut by the
    /// end of `ids`) comes out as U+FFFD; [`super::StreamDecoder`] avoids that when
    /// decoding token by token.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        if let Some(&id) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(Error::invalid(
                "token ids",
                format!(
                    "id {id} has no token in {} ({} ids)",
                    self.path.display(),
                    self.vocab_size()
                ),
            ));
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::bad_file(&self.path, format!("cannot decode token ids: {e}")))
    }

    fn read_special_tokens(&self, dir: &Path) -> Result<SpecialTokens> {
        let tok_cfg = read_json_if_present(&dir.join(TOKENIZER_CONFIG_FILE))?;
        let gen_cfg = read_json_if_present(&dir.join(GENERATION_CONFIG_FILE))?;
        let model_cfg = read_json_if_present(&dir.join(CONFIG_FILE))?;

        let named = match &tok_cfg {
            Some((path, cfg)) => named_tokens(path, cfg)?,
            None => BTreeMap::new(),
        };
        // Ids from generation_config.json, then config.json (or its
        // text_config, as multimodal checkpoints nest it).
        let id_sources: Vec<(&PathBuf, &Value)> = gen_cfg
            .iter()
            .map(|(p, v)| (p, v))
            .chain(model_cfg.iter().flat_map(|(p, v)| {
                std::iter::once((p, v)).chain(v.get("text_config").map(|t| (p, t)))
            }))
            .collect();
        let ids_of = |key: &str| -> Result<Option<(Vec<u32>, &Path)>> {
            for (path, cfg) in &id_sources {
                if let Some(ids) = token_ids(path, cfg, key)? {
                    return Ok(Some((ids, path.as_path())));
                }
            }
            Ok(None)
        };

        let mut special = SpecialTokens {
            named,
            ..SpecialTokens::default()
        };
        let tok_cfg_path = dir.join(TOKENIZER_CONFIG_FILE);
        for (key, slot) in [
            ("bos", &mut special.bos),
            ("eos", &mut special.eos),
            ("pad", &mut special.pad),
        ] {
            let name = format!("{key}_token");
            *slot = match special.named.get(&name) {
                Some(text) => Some(self.known_token(&tok_cfg_path, &name, text)?),
                None => match ids_of(&format!("{key}_token_id"))? {
                    Some((ids, path)) => Some(self.known_id(path, key, ids[0])?),
                    None => None,
                },
            };
        }
        special.stop_ids = match ids_of("eos_token_id")? {
            Some((ids, path)) => {
                for &id in &ids {
                    self.known_id(path, "eos_token_id", id)?;
                }
                ids
            }
            None => special.eos.iter().map(|t| t.id).collect(),
        };
        Ok(special)
    }

    fn known_token(&self, path: &Path, key: &str, text: &str) -> Result<SpecialToken> {
        match self.inner.token_to_id(text) {
            Some(id) => Ok(SpecialToken {
                id,
                text: text.to_string(),
            }),
            None => Err(Error::config(
                path,
                format!(
                    "{key} is {text:?}, which is not a token of {}",
                    self.path.display()
                ),
            )),
        }
    }

    fn known_id(&self, path: &Path, key: &str, id: u32) -> Result<SpecialToken> {
        match self.inner.id_to_token(id) {
            Some(text) => Ok(SpecialToken { id, text }),
            None => Err(Error::config(
                path,
                format!(
                    "{key} {id} is not an id of {} ({} ids)",
                    self.path.display(),
                    self.vocab_size()
                ),
            )),
        }
    }
}

/// The named special tokens of `tokenizer_config.json` as transformers 5
/// collects them: the standard ones, any other `*_token` key holding a
/// token, and the entries of an `extra_special_tokens` object.
fn named_tokens(path: &Path, cfg: &Value) -> Result<BTreeMap<String, String>> {
    let mut named = BTreeMap::new();
    for key in NAMED_SPECIAL_TOKENS {
        if let Some(text) = token_string(path, cfg, key)? {
            named.insert(key.to_string(), text);
        }
    }
    let extra = cfg.get("extra_special_tokens").and_then(Value::as_object);
    let custom = cfg
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(key, _)| key.ends_with("_token") && !NAMED_SPECIAL_TOKENS.contains(&key.as_str()))
        .chain(extra.into_iter().flatten());
    for (key, value) in custom {
        let text = match value {
            Value::String(s) => s,
            Value::Object(o) => match o.get("content") {
                Some(Value::String(s)) => s,
                _ => continue,
            },
            _ => continue,
        };
        named.insert(key.clone(), text.clone());
    }
    Ok(named)
}

/// A special token as `tokenizer_config.json` writes it: a string, or an
/// `AddedToken` object with a `content` field; `null` means none.
fn token_string(path: &Path, cfg: &Value, key: &str) -> Result<Option<String>> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(Error::bad_file(
                path,
                format!("\"{key}\" is an object without a string \"content\""),
            )),
        },
        Some(other) => Err(Error::bad_file(
            path,
            format!("\"{key}\" should be a string or null, found {other}"),
        )),
    }
}

/// A token id field: one id, a list of ids, or `null`.
fn token_ids(path: &Path, cfg: &Value, key: &str) -> Result<Option<Vec<u32>>> {
    let bad = |found: &Value| {
        Error::bad_file(
            path,
            format!("\"{key}\" should be a token id or a list of them, found {found}"),
        )
    };
    let one = |v: &Value| {
        v.as_u64()
            .and_then(|id| u32::try_from(id).ok())
            .ok_or_else(|| bad(v))
    };
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) if items.is_empty() => Ok(None),
        Some(Value::Array(items)) => items.iter().map(one).collect::<Result<_>>().map(Some),
        Some(v) => one(v).map(|id| Some(vec![id])),
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::text::tests::bundled_dir;

    /// A directory holding the bundled tokenizer.json and the given files.
    fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::copy(
            bundled_dir().join(TOKENIZER_FILE),
            dir.path().join(TOKENIZER_FILE),
        )
        .unwrap();
        for (name, text) in files {
            fs::write(dir.path().join(name), text).unwrap();
        }
        dir
    }

    fn error(files: &[(&str, &str)]) -> String {
        let dir = dir_with(files);
        Tokenizer::from_dir(dir.path()).unwrap_err().to_string()
    }

    #[test]
    fn a_missing_tokenizer_says_what_to_copy() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains(&dir.path().join(TOKENIZER_FILE).display().to_string()),
            "{err}"
        );
        assert!(err.contains("copy tokenizer.json"), "{err}");
    }

    #[test]
    fn a_malformed_tokenizer_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(TOKENIZER_FILE), r#"{"model": 3}"#).unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("tokenizer.json") && err.contains("can load"),
            "{err}"
        );
    }

    #[test]
    fn special_tokens_come_from_the_tokenizer_config_first() {
        let dir = dir_with(&[
            (
                TOKENIZER_CONFIG_FILE,
                r#"{"bos_token": {"content": "<|im_start|>", "special": true}, "eos_token": "<|im_end|>",
                    "pad_token": null, "image_token": "<think>", "model_max_length": 10,
                    "extra_special_tokens": {"audio_token": "</think>"}}"#,
            ),
            (
                GENERATION_CONFIG_FILE,
                r#"{"eos_token_id": [2, 0], "pad_token_id": 0}"#,
            ),
        ]);
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let s = tok.special_tokens();
        assert_eq!(
            s.bos,
            Some(SpecialToken {
                id: 1,
                text: "<|im_start|>".into()
            })
        );
        assert_eq!(s.eos.as_ref().unwrap().id, 2);
        // No pad in the tokenizer config: the generation config's id.
        assert_eq!(
            s.pad,
            Some(SpecialToken {
                id: 0,
                text: "<|endoftext|>".into()
            })
        );
        assert_eq!(s.stop_ids, [2, 0]);
        let named: Vec<(&str, &str)> = s
            .named
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            named,
            [
                ("audio_token", "</think>"),
                ("bos_token", "<|im_start|>"),
                ("eos_token", "<|im_end|>"),
                ("image_token", "<think>"),
            ]
        );
    }

    #[test]
    fn ids_fall_back_to_config_json_and_its_text_config() {
        let dir = dir_with(&[(
            CONFIG_FILE,
            r#"{"text_config": {"eos_token_id": 2, "bos_token_id": 1}}"#,
        )]);
        let s = Tokenizer::from_dir(dir.path())
            .unwrap()
            .special_tokens()
            .clone();
        assert_eq!(
            s.eos,
            Some(SpecialToken {
                id: 2,
                text: "<|im_end|>".into()
            })
        );
        assert_eq!(s.bos.map(|t| t.id), Some(1));
        assert_eq!(s.stop_ids, [2]);
        assert!(s.named.is_empty());
        // Nothing anywhere: no special tokens, nothing stops generation but length.
        let dir = dir_with(&[]);
        let s = Tokenizer::from_dir(dir.path())
            .unwrap()
            .special_tokens()
            .clone();
        assert_eq!(s, SpecialTokens::default());
    }

    #[test]
    fn special_tokens_outside_the_vocabulary_are_errors() {
        let err = error(&[(TOKENIZER_CONFIG_FILE, r#"{"eos_token": "</s>"}"#)]);
        assert!(
            err.contains("tokenizer_config.json") && err.contains("\"</s>\""),
            "{err}"
        );
        let err = error(&[(GENERATION_CONFIG_FILE, r#"{"eos_token_id": [2, 99999]}"#)]);
        assert!(
            err.contains("generation_config.json") && err.contains("99999"),
            "{err}"
        );
        let err = error(&[(GENERATION_CONFIG_FILE, r#"{"eos_token_id": "2"}"#)]);
        assert!(
            err.contains("generation_config.json") && err.contains("eos_token_id"),
            "{err}"
        );
        let err = error(&[(TOKENIZER_CONFIG_FILE, r#"{"eos_token": 5}"#)]);
        assert!(
            err.contains("tokenizer_config.json") && err.contains("eos_token"),
            "{err}"
        );
        let err = error(&[(CONFIG_FILE, "[1]")]);
        assert!(
            err.contains("config.json") && err.contains("JSON object"),
            "{err}"
        );
        let err = error(&[(CONFIG_FILE, "{")]);
        assert!(
            err.contains("config.json") && err.contains("malformed JSON"),
            "{err}"
        );
    }

    #[test]
    fn decoding_an_unknown_id_is_an_error() {
        let dir = dir_with(&[]);
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.vocab_size(), 4096);
        let err = tok.decode(&[5, 4096], false).unwrap_err().to_string();
        assert!(err.contains("id 4096") && err.contains("4096 ids"), "{err}");
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
        assert_eq!(tok.id_to_token(2).as_deref(), Some("<|im_end|>"));
    }
}
