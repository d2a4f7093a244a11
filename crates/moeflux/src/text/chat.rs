//! Chat templates: Jinja templates shipped with a model that turn a
//! conversation into the prompt text the model was trained on.
//!
//! Rendered the way transformers' `apply_chat_template` renders them
//! (`chat_template_utils._compile_jinja_template`): `trim_blocks` and
//! `lstrip_blocks` on, a single trailing newline of the template dropped,
//! no auto-escaping, loop controls, Python string methods (`.strip()`,
//! `.split()`, ...), `raise_exception`, and as variables `messages`,
//! `add_generation_prompt`, `tools` (none unless given to
//! [`ChatTemplate::render_json`]) and `documents` (none), the
//! tokenizer's named special tokens (`bos_token`, `eos_token`, ...) and any
//! extra options (e.g. Qwen3's `enable_thinking`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Serde, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind, Output, State, Value, escape_formatter};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::text::tokenizer::{SpecialTokens, TOKENIZER_CONFIG_FILE};
use crate::util::read_json_if_present;

pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
pub const CHAT_TEMPLATE_DIR: &str = "additional_chat_templates";
const DEFAULT_NAME: &str = "default";

/// Variables every render sets; extra options may not replace them.
const RESERVED: [&str; 4] = ["messages", "add_generation_prompt", "tools", "documents"];

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, or whatever else the template knows.
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    /// A message of any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        ChatMessage::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        ChatMessage::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        ChatMessage::new("assistant", content)
    }
}

/// How to render a conversation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatOptions {
    /// End with the header of an assistant turn, for the model to write it.
    pub add_generation_prompt: bool,
    /// Further template variables, e.g. `enable_thinking: false` for Qwen3.
    /// They override the special-token variables, as in transformers.
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// A compiled chat template.
///
/// ```
/// use moeflux::text::{ChatMessage, ChatOptions, ChatTemplate, Tokenizer};
///
/// let dir = moeflux::bundled::model_dir(&moeflux::util::NoProgress)?;
/// let tokenizer = Tokenizer::from_dir(&dir)?;
/// let template = ChatTemplate::from_dir(&dir, tokenizer.special_tokens(), None)?;
///
/// let messages = [ChatMessage::user("Tell me about Mr. Knightley.")];
/// let options = ChatOptions {
///     add_generation_prompt: true,
///     ..ChatOptions::default()
/// };
/// let prompt = template.render(&messages, &options)?;
/// assert_eq!(
///     prompt,
///     "<|im_start|>user\nTell me about Mr. Knightley.<|im_end|>\n<|im_start|>assistant\n"
/// );
/// // The rendered text holds its special tokens already.
/// let ids = tokenizer.encode(&prompt, false)?;
/// # assert!(!ids.is_empty());
/// # Ok::<(), moeflux::Error>(())
/// ```
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The file the template came from, for errors.
    origin: PathBuf,
    /// Its name in the environment, which error locations show.
    label: String,
    special: BTreeMap<String, String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("label", &self.label)
            .finish_non_exhaustive()
    }
}

/// The message of a template's `raise_exception`, kept as the error's
/// source so that it can be told from the template's own failures.
#[derive(Debug)]
struct TemplateRaised(String);

impl std::fmt::Display for TemplateRaised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TemplateRaised {}

fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(
        minijinja::Error::new(ErrorKind::InvalidOperation, message.clone())
            .with_source(TemplateRaised(message)),
    )
}

/// Prints values as jinja2 does, with Python's `str()`: `True`, `False`
/// and `None` where minijinja would print `true`, `false` and `none`.
fn python_formatter(
    out: &mut Output,
    state: &mut State,
    value: &Value,
) -> std::result::Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::Bool if value.is_true() => out.write_str("True")?,
        ValueKind::Bool => out.write_str("False")?,
        ValueKind::None => out.write_str("None")?,
        _ => escape_formatter(out, state, value)?,
    }
    Ok(())
}

impl ChatTemplate {
    /// The chat template of a model directory, found where transformers 5
    /// looks: `chat_template.jinja` (and named ones in
    /// `additional_chat_templates/*.jinja`), else the `chat_template` entry
    /// of `tokenizer_config.json` (a string, or a list of `{name, template}`).
    /// `name` picks a named template; without it the `default` one is used.
    pub fn from_dir(
        dir: &Path,
        special: &SpecialTokens,
        name: Option<&str>,
    ) -> Result<ChatTemplate> {
        let templates = find_templates(dir)?;
        if templates.is_empty() {
            return Err(Error::config(
                dir,
                format!(
                    "no chat template: neither {CHAT_TEMPLATE_FILE} nor a \"chat_template\" entry in \
                     {TOKENIZER_CONFIG_FILE}; copy them from the original Hugging Face checkpoint, \
                     or give the prompt as plain text"
                ),
            ));
        }
        let wanted = name.unwrap_or(DEFAULT_NAME);
        let Some(found) = templates.iter().find(|t| t.name == wanted) else {
            let names: Vec<&str> = templates.iter().map(|t| t.name.as_str()).collect();
            let msg = match name {
                Some(n) => format!("no chat template named {n:?}; this model has {names:?}"),
                None => format!(
                    "several chat templates and none named \"default\": pick one of {names:?}"
                ),
            };
            return Err(Error::invalid(
                "chat template",
                format!("{}: {msg}", dir.display()),
            ));
        };
        let label = if found.name == DEFAULT_NAME {
            "chat_template".to_string()
        } else {
            format!("chat_template[{}]", found.name)
        };
        ChatTemplate::new(&found.source, &found.origin, &label, special)
    }

    /// Compiles `source`; `origin` is the file it came from and `label` its
    /// name in error locations.
    pub fn new(
        source: &str,
        origin: &Path,
        label: &str,
        special: &SpecialTokens,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| Error::bad_file(origin, format!("chat template syntax: {e}")))?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_formatter(python_formatter);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(label.to_string(), source.to_string())
            .map_err(|e| {
                Error::bad_file(origin, format!("the chat template does not parse: {e}"))
            })?;
        Ok(ChatTemplate {
            env,
            origin: origin.to_path_buf(),
            label: label.to_string(),
            special: special.named.clone(),
        })
    }

    /// The file the template came from.
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// The prompt text for `messages`.
    pub fn render(&self, messages: &[ChatMessage], options: &ChatOptions) -> Result<String> {
        self.render_values(Value::from(Serde(messages)), Value::from(()), options)
    }

    /// The prompt text for messages given as JSON (as an OpenAI request
    /// carries them: an assistant's `tool_calls`, a tool's `tool_call_id`)
    /// and the function definitions the template lists for the model
    /// (`tools`, `None` when there are none).
    ///
    /// ```
    /// use moeflux::text::{ChatOptions, ChatTemplate, SpecialTokens};
    /// use serde_json::json;
    ///
    /// let source = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}\
    ///     {% for m in messages %}{{ m.role }}:{{ m.content }}\
    ///     {% for c in m.tool_calls %}<{{ c.function.name }}>{% endfor %};{% endfor %}";
    /// let template =
    ///     ChatTemplate::new(source, "t.jinja".as_ref(), "t", &SpecialTokens::default())?;
    /// let tools = [json!({"type": "function", "function": {"name": "weather"}})];
    /// let messages = [
    ///     json!({"role": "user", "content": "Rain in Bath?"}),
    ///     json!({"role": "assistant", "content": "",
    ///            "tool_calls": [{"function": {"name": "weather", "arguments": "{}"}}]}),
    ///     json!({"role": "tool", "content": "rain", "tool_call_id": "call_1"}),
    /// ];
    /// let text = template.render_json(&messages, Some(&tools), &ChatOptions::default())?;
    /// assert_eq!(text, "[weather]user:Rain in Bath?;assistant:<weather>;tool:rain;");
    /// # Ok::<(), moeflux::Error>(())
    /// ```
    pub fn render_json(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        options: &ChatOptions,
    ) -> Result<String> {
        let tools = match tools {
            Some(tools) => Value::from(Serde(tools)),
            None => Value::from(()),
        };
        self.render_values(Value::from(Serde(messages)), tools, options)
    }

    fn render_values(
        &self,
        messages: Value,
        tools: Value,
        options: &ChatOptions,
    ) -> Result<String> {
        if let Some(key) = options
            .extra
            .keys()
            .find(|k| RESERVED.contains(&k.as_str()))
        {
            return Err(Error::invalid(
                "chat template options",
                format!("{key:?} is set by moeflux itself and cannot be given as an option"),
            ));
        }
        let mut vars: BTreeMap<String, Value> = self
            .special
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        for (key, value) in &options.extra {
            vars.insert(key.clone(), Value::from(Serde(value)));
        }
        vars.insert("messages".into(), messages);
        vars.insert(
            "add_generation_prompt".into(),
            Value::from(options.add_generation_prompt),
        );
        vars.insert("tools".into(), tools);
        vars.insert("documents".into(), Value::from(()));

        let template = self
            .env
            .get_template(&self.label)
            .map_err(|e| Error::bad_file(&self.origin, format!("chat template: {e}")))?;
        template.render(Value::from(vars)).map_err(|e| {
            let raised = std::iter::successors(std::error::Error::source(&e), |s| s.source())
                .find_map(|s| s.downcast_ref::<TemplateRaised>());
            match raised {
                Some(msg) => Error::invalid(
                    "chat messages",
                    format!(
                        "{}: the chat template rejected the conversation: {msg}",
                        self.origin.display()
                    ),
                ),
                None => Error::bad_file(&self.origin, format!("the chat template failed: {e}")),
            }
        })
    }
}

/// One template found in a model directory.
struct FoundTemplate {
    name: String,
    source: String,
    origin: PathBuf,
}

/// Every chat template of `dir`: the `.jinja` files if there are any (they
/// take priority, as in transformers), else those of `tokenizer_config.json`.
fn find_templates(dir: &Path) -> Result<Vec<FoundTemplate>> {
    let mut found = Vec::new();
    let main = dir.join(CHAT_TEMPLATE_FILE);
    if let Some(source) = read_if_present(&main)? {
        found.push(FoundTemplate {
            name: DEFAULT_NAME.into(),
            source,
            origin: main,
        });
    }
    let extra_dir = dir.join(CHAT_TEMPLATE_DIR);
    if extra_dir.is_dir() {
        let entries = std::fs::read_dir(&extra_dir)
            .map_err(|e| Error::io(&extra_dir, "listing chat templates", e))?;
        let mut paths = Vec::new();
        for entry in entries {
            let path = entry
                .map_err(|e| Error::io(&extra_dir, "listing chat templates", e))?
                .path();
            if path.extension().is_some_and(|x| x == "jinja") {
                paths.push(path);
            }
        }
        paths.sort();
        for path in paths {
            let name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let source = std::fs::read_to_string(&path)
                .map_err(|e| Error::io(&path, "reading the chat template", e))?;
            found.push(FoundTemplate {
                name,
                source,
                origin: path,
            });
        }
    }
    if !found.is_empty() {
        return Ok(found);
    }

    let Some((path, cfg)) = read_json_if_present(&dir.join(TOKENIZER_CONFIG_FILE))? else {
        return Ok(found);
    };
    let bad = |msg: &str| Error::bad_file(&path, format!("\"chat_template\" {msg}"));
    match cfg.get("chat_template") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::String(source)) => found.push(FoundTemplate {
            name: DEFAULT_NAME.into(),
            source: source.clone(),
            origin: path.clone(),
        }),
        Some(serde_json::Value::Array(items)) => {
            for item in items {
                let field = |key: &str| item.get(key).and_then(serde_json::Value::as_str);
                let (Some(name), Some(source)) = (field("name"), field("template")) else {
                    return Err(bad(
                        "list entries need string \"name\" and \"template\" fields",
                    ));
                };
                found.push(FoundTemplate {
                    name: name.into(),
                    source: source.into(),
                    origin: path.clone(),
                });
            }
        }
        Some(_) => return Err(bad("should be a string or a list of {name, template}")),
    }
    Ok(found)
}

fn read_if_present(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, "reading the chat template", e)),
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    fn special(named: &[(&str, &str)]) -> SpecialTokens {
        SpecialTokens {
            named: named
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..SpecialTokens::default()
        }
    }

    fn render(dir: &Path, name: Option<&str>) -> Result<String> {
        let template = ChatTemplate::from_dir(dir, &SpecialTokens::default(), name)?;
        template.render(&[ChatMessage::user("hi")], &ChatOptions::default())
    }

    /// Expected outputs from transformers 5.17's `render_jinja_template`.
    #[test]
    fn whitespace_control_and_python_methods_match_jinja2() {
        let source = r#"{{ bos_token }}{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'system' %}
        [{{ m.content.strip().upper() }}]
    {% else %}
        {{ loop.index }}/{{ messages|length }} {{ m.role.title() }}: {{ m.content.replace('  ', ' ').split(',')[0] }}{% if loop.last %}.{% endif %}
        {% set ns.n = ns.n + m.content.count('a') %}
    {% endif %}
{% endfor %}
{% for m in messages[::-1] %}{{ m.role[0] }}{% if not loop.last %},{% endif %}{% endfor %}
a-count={{ ns.n }} tools={{ tools is none }} docs={{ documents is none }} think={{ enable_thinking is defined and enable_thinking }}
{% if 'x' in custom_token %}custom{% endif %}
{% if add_generation_prompt %}
<assistant>
{% endif %}
"#;
        let tokens = special(&[("bos_token", "<s>"), ("custom_token", "<x>")]);
        let template = ChatTemplate::new(source, Path::new("t.jinja"), "t", &tokens).unwrap();
        let messages = [
            ChatMessage::system("  be brief \n"),
            ChatMessage::user("a  banana, please"),
            ChatMessage::assistant("Here,  a banana"),
        ];
        let options = ChatOptions {
            add_generation_prompt: true,
            extra: [("enable_thinking".to_string(), serde_json::Value::Bool(true))].into(),
        };
        assert_eq!(
            template.render(&messages, &options).unwrap(),
            "<s>        [BE BRIEF]\n        2/3 User: a banana        3/3 Assistant: Here.a,u,sa-count=9 \
             tools=True docs=True think=True\ncustom<assistant>\n"
        );
        assert_eq!(
            template.render(&messages, &ChatOptions::default()).unwrap(),
            "<s>        [BE BRIEF]\n        2/3 User: a banana        3/3 Assistant: Here.a,u,sa-count=9 \
             tools=True docs=True think=False\ncustom"
        );
    }

    #[test]
    fn options_override_special_tokens_but_not_messages() {
        let tokens = special(&[("bos_token", "<s>")]);
        let template = ChatTemplate::new(
            "{{ bos_token }}{{ messages[0].content }}",
            Path::new("t"),
            "t",
            &tokens,
        )
        .unwrap();
        let mut options = ChatOptions::default();
        options.extra.insert("bos_token".into(), "<BOS>".into());
        assert_eq!(
            template
                .render(&[ChatMessage::user("x")], &options)
                .unwrap(),
            "<BOS>x"
        );
        options
            .extra
            .insert("messages".into(), serde_json::Value::Null);
        let err = template
            .render(&[ChatMessage::user("x")], &options)
            .unwrap_err();
        assert!(err.to_string().contains("\"messages\""), "{err}");
    }

    #[test]
    fn template_files_take_priority_over_tokenizer_config() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::write(
            d.join(TOKENIZER_CONFIG_FILE),
            r#"{"chat_template": "config {{ messages[0].content }}"}"#,
        )
        .unwrap();
        assert_eq!(render(d, None).unwrap(), "config hi");
        fs::write(
            d.join(CHAT_TEMPLATE_FILE),
            "jinja {{ messages[0].content }}\n",
        )
        .unwrap();
        assert_eq!(render(d, None).unwrap(), "jinja hi"); // trailing newline dropped
        fs::create_dir(d.join(CHAT_TEMPLATE_DIR)).unwrap();
        fs::write(
            d.join(CHAT_TEMPLATE_DIR).join("tool_use.jinja"),
            "tools {{ messages[0].content }}",
        )
        .unwrap();
        assert_eq!(render(d, Some("tool_use")).unwrap(), "tools hi");
        assert_eq!(render(d, None).unwrap(), "jinja hi");
        let err = render(d, Some("rag")).unwrap_err().to_string();
        assert!(
            err.contains("\"rag\"") && err.contains("tool_use") && err.contains("default"),
            "{err}"
        );
    }

    #[test]
    fn named_templates_in_tokenizer_config() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let write = |json: &str| fs::write(d.join(TOKENIZER_CONFIG_FILE), json).unwrap();
        write(
            r#"{"chat_template": [{"name": "default", "template": "D{{ messages|length }}"},
                                  {"name": "rag", "template": "R"}]}"#,
        );
        assert_eq!(render(d, None).unwrap(), "D1");
        assert_eq!(render(d, Some("rag")).unwrap(), "R");
        write(
            r#"{"chat_template": [{"name": "a", "template": "A"}, {"name": "b", "template": "B"}]}"#,
        );
        let err = render(d, None).unwrap_err().to_string();
        assert!(
            err.contains("none named \"default\"") && err.contains("\"a\", \"b\""),
            "{err}"
        );
        write(r#"{"chat_template": [{"name": "a"}]}"#);
        let err = render(d, None).unwrap_err().to_string();
        assert!(
            err.contains("tokenizer_config.json") && err.contains("\"template\""),
            "{err}"
        );
        write(r#"{"chat_template": 3}"#);
        assert!(
            render(d, None)
                .unwrap_err()
                .to_string()
                .contains("tokenizer_config.json")
        );
    }

    #[test]
    fn a_missing_template_says_where_it_looked() {
        let dir = tempfile::tempdir().unwrap();
        let err = render(dir.path(), None).unwrap_err().to_string();
        assert!(
            err.contains(CHAT_TEMPLATE_FILE) && err.contains(TOKENIZER_CONFIG_FILE),
            "{err}"
        );
        assert!(err.contains(&dir.path().display().to_string()), "{err}");
    }

    #[test]
    fn a_malformed_template_names_its_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(
            dir.path().join(CHAT_TEMPLATE_FILE),
            "{% for m in messages %}\n{{ m.content }\n{% endfor %}",
        )
        .unwrap();
        let err = render(dir.path(), None).unwrap_err().to_string();
        assert!(
            err.contains(CHAT_TEMPLATE_FILE) && err.contains("does not parse"),
            "{err}"
        );
        assert!(err.contains("chat_template:2"), "{err}");
    }

    #[test]
    fn raise_exception_becomes_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(
            dir.path().join(CHAT_TEMPLATE_FILE),
            "{% if messages[0].role != 'system' %}{{ raise_exception('Conversations must start with a system message') }}{% endif %}",
        )
        .unwrap();
        let err = render(dir.path(), None).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
        let err = err.to_string();
        assert!(
            err.contains("Conversations must start with a system message"),
            "{err}"
        );
        assert!(err.contains(CHAT_TEMPLATE_FILE), "{err}");
    }

    #[test]
    fn other_render_failures_blame_the_template() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(
            dir.path().join(CHAT_TEMPLATE_FILE),
            "{{ messages | no_such_filter }}",
        )
        .unwrap();
        let err = render(dir.path(), None).unwrap_err();
        assert!(matches!(err, Error::BadFile { .. }), "{err:?}");
        assert!(err.to_string().contains("no_such_filter"), "{err}");
    }
}
