//! A chat answer's text split as OpenAI clients expect it: the model's
//! thinking (`<think>…</think>`) into `reasoning_content`, Qwen's
//! `<tool_call>{"name": …, "arguments": …}</tool_call>` blocks into
//! `tool_calls`, the rest into `content`; piece by piece while streaming,
//! holding back text that may be the start of a tag.

use serde::Serialize;
use serde_json::Value;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

/// A function call the model made.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON text, as OpenAI sends them.
    pub arguments: String,
}

/// What a piece of the answer adds to each part.
#[derive(Debug, Default, PartialEq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

impl Split {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.tool_calls.is_empty()
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// Nothing seen yet: a `<think>` may open.
    Start,
    Reasoning,
    /// After `</think>`: newlines before the answer are dropped.
    AfterReasoning,
    /// After a tool call: newlines before what follows are dropped.
    AfterBlock,
    Content,
}

/// Splits one choice's streamed text.
pub struct ChatSplitter {
    mode: Mode,
    tools: bool,
    held: String,
    calls: usize,
    /// Reasoning text has been handed out (its leading newlines are gone).
    reasoned: bool,
}

impl ChatSplitter {
    /// `thinking`: the prompt ended inside an opened `<think>`, so the text
    /// is reasoning until `</think>`. `tools`: parse tool calls.
    pub fn new(thinking: bool, tools: bool) -> ChatSplitter {
        ChatSplitter {
            mode: if thinking {
                Mode::Reasoning
            } else {
                Mode::Start
            },
            tools,
            held: String::new(),
            calls: 0,
            reasoned: false,
        }
    }

    /// Whether any tool call was made.
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// Adds text; returns what is settled.
    pub fn push(&mut self, text: &str) -> Split {
        self.held.push_str(text);
        let mut out = Split::default();
        loop {
            match self.mode {
                Mode::Start => {
                    let trimmed = self.held.trim_start();
                    if let Some(rest) = trimmed.strip_prefix(THINK_OPEN) {
                        self.held = rest.to_string();
                        self.mode = Mode::Reasoning;
                    } else if THINK_OPEN.starts_with(trimmed) {
                        return out;
                    } else {
                        self.mode = Mode::Content;
                    }
                }
                Mode::Reasoning => {
                    // The newlines around the thinking are the template's.
                    if !self.reasoned {
                        let trimmed = self.held.trim_start_matches('\n');
                        if trimmed.is_empty() {
                            self.held.clear();
                            return out;
                        }
                        self.held = trimmed.to_string();
                    }
                    match self.held.find(THINK_CLOSE) {
                        Some(at) => {
                            out.reasoning
                                .push_str(self.held[..at].trim_end_matches('\n'));
                            self.held.drain(..at + THINK_CLOSE.len());
                            self.mode = Mode::AfterReasoning;
                        }
                        None => {
                            let body = self.held.len() - partial_tag(&self.held, THINK_CLOSE);
                            let end = self.held[..body].trim_end_matches('\n').len();
                            out.reasoning.extend(self.held.drain(..end));
                            self.reasoned |= end > 0;
                            return out;
                        }
                    }
                }
                Mode::AfterReasoning | Mode::AfterBlock => {
                    let trimmed = self.held.trim_start_matches('\n');
                    if trimmed.is_empty() {
                        self.held.clear();
                        return out;
                    }
                    self.held = trimmed.to_string();
                    self.mode = Mode::Content;
                }
                Mode::Content => {
                    if !self.tools {
                        out.content.push_str(&self.held);
                        self.held.clear();
                        return out;
                    }
                    let Some(open) = self.held.find(CALL_OPEN) else {
                        let keep = partial_tag(&self.held, CALL_OPEN);
                        out.content
                            .extend(self.held.drain(..self.held.len() - keep));
                        return out;
                    };
                    out.content.push_str(&self.held[..open]);
                    self.held.drain(..open);
                    let Some(close) = self.held.find(CALL_CLOSE) else {
                        return out;
                    };
                    let body = &self.held[CALL_OPEN.len()..close];
                    match parse_call(body, self.calls) {
                        Some(call) => {
                            self.calls += 1;
                            out.tool_calls.push(call);
                        }
                        // Not a call after all: the text as it was.
                        None => out.content.push_str(&self.held[..close + CALL_CLOSE.len()]),
                    }
                    self.held.drain(..close + CALL_CLOSE.len());
                    if self.calls > 0 {
                        self.mode = Mode::AfterBlock;
                    }
                }
            }
        }
    }

    /// The text ended: what was held back goes where it was heading.
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        let mut out = Split::default();
        match self.mode {
            Mode::Reasoning => out.reasoning = held,
            Mode::AfterReasoning | Mode::AfterBlock => {}
            Mode::Start | Mode::Content => out.content = held,
        }
        out
    }
}

/// Bytes at the end of `text` that `tag` starts with.
fn partial_tag(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// A call's JSON body: `{"name": "...", "arguments": {...}}`.
fn parse_call(body: &str, index: usize) -> Option<ToolCall> {
    let value: Value = serde_json::from_str(body.trim()).ok()?;
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = match value.get("arguments") {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    };
    Some(ToolCall {
        id: format!("call_{:016x}{index}", rand::random::<u64>()),
        kind: "function",
        function: FunctionCall { name, arguments },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every way of cutting `text` into two pieces gives the same split.
    fn split_all_ways(text: &str, thinking: bool, tools: bool) -> Split {
        let whole = {
            let mut s = ChatSplitter::new(thinking, tools);
            let mut a = s.push(text);
            let b = s.finish();
            a.reasoning += &b.reasoning;
            a.content += &b.content;
            a
        };
        for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            let mut s = ChatSplitter::new(thinking, tools);
            let mut got = Split::default();
            for piece in [s.push(&text[..cut]), s.push(&text[cut..]), s.finish()] {
                got.reasoning += &piece.reasoning;
                got.content += &piece.content;
                got.tool_calls.extend(piece.tool_calls);
            }
            assert_eq!(got.reasoning, whole.reasoning, "cut at {cut}");
            assert_eq!(got.content, whole.content, "cut at {cut}");
            let names = |s: &Split| {
                s.tool_calls
                    .iter()
                    .map(|c| c.function.clone())
                    .collect::<Vec<_>>()
            };
            assert_eq!(names(&got), names(&whole), "cut at {cut}");
        }
        whole
    }

    #[test]
    fn thinking_goes_to_reasoning_wherever_the_text_is_cut() {
        let s = split_all_ways(
            "<think>\nA ball.\n</think>\n\nMr. Darcy danced.",
            false,
            false,
        );
        assert_eq!(s.reasoning, "A ball.");
        assert_eq!(s.content, "Mr. Darcy danced.");
        let s = split_all_ways("<think>\n\n</think>\n\nNo.", false, false);
        assert_eq!((s.reasoning.as_str(), s.content.as_str()), ("", "No."));
        let s = split_all_ways("<think>\nOne.\n\nTwo.\n</think>\n\nNo.", false, false);
        assert_eq!(s.reasoning, "One.\n\nTwo.");
        let s = split_all_ways("Weighing it.</think>\n\nYes.", true, false);
        assert_eq!(
            (s.reasoning.as_str(), s.content.as_str()),
            ("Weighing it.", "Yes.")
        );
        let s = split_all_ways("No tags <think> here.", false, false);
        assert_eq!(
            (s.reasoning.as_str(), s.content.as_str()),
            ("", "No tags <think> here.")
        );
    }

    #[test]
    fn tool_calls_are_parsed_wherever_the_text_is_cut() {
        let text = "Let me look.<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"town\": \"Bath\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\"}\n</tool_call>";
        let s = split_all_ways(text, false, true);
        assert_eq!(s.content, "Let me look.");
        let calls: Vec<_> = s
            .tool_calls
            .iter()
            .map(|c| (c.function.name.as_str(), c.function.arguments.as_str()))
            .collect();
        assert_eq!(calls, [("weather", "{\"town\":\"Bath\"}"), ("time", "{}")]);
        // Without tools, or when the block is no call, the text stays.
        assert_eq!(split_all_ways(text, false, false).content, text);
        let bad = "<tool_call>not json</tool_call>";
        assert_eq!(split_all_ways(bad, false, true).content, bad);
        // A call cut off by the token limit stays text.
        let open = "<tool_call>{\"name\": \"we";
        assert_eq!(split_all_ways(open, false, true).content, open);
    }
}
