//! Token ids to text, one id at a time, for streaming output.

use crate::error::Result;
use crate::text::tokenizer::Tokenizer;

/// Turns generated ids into text as they arrive, emitting only whole
/// characters.
///
/// Decoding one id alone is wrong in two ways: byte-level BPE splits a
/// multi-byte character (an emoji, CJK) across ids, and decoders that treat
/// the first token of a text specially (SentencePiece's leading space)
/// need the preceding ids. So each step decodes a small window, the ids
/// already emitted (context) plus those pending, and emits what the window
/// added beyond the context's text. A trailing U+FFFD (an incomplete UTF-8
/// sequence) is held back until a later id completes it; invalid bytes
/// followed by more text, and whatever is pending at [`finish`], come out
/// as U+FFFD.
///
/// [`finish`]: StreamDecoder::finish
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    skip_special_tokens: bool,
    /// `ids[..context]` were emitted and are decoded again only as context.
    ids: Vec<u32>,
    context: usize,
    /// The text of `ids[..context]`.
    context_text: String,
    /// Bytes of the pending text already emitted.
    emitted: usize,
}

impl Tokenizer {
    /// A decoder that turns ids into text as they are generated.
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, skip_special_tokens)
    }
}

impl<'a> StreamDecoder<'a> {
    pub(crate) fn new(tokenizer: &'a Tokenizer, skip_special_tokens: bool) -> Self {
        StreamDecoder {
            tokenizer,
            skip_special_tokens,
            ids: Vec::new(),
            context: 0,
            context_text: String::new(),
            emitted: 0,
        }
    }

    /// Adds one id and returns the text that became complete (often empty).
    pub fn step(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        let pending = &text[common_prefix(&self.context_text, &text)..];
        let complete = pending.trim_end_matches('\u{FFFD}');
        let out = complete.get(self.emitted..).unwrap_or_default().to_owned();
        self.emitted = self.emitted.max(complete.len());
        if complete.len() == pending.len() {
            // A clean boundary: the pending ids become the next context.
            self.ids.drain(..self.context);
            self.context = self.ids.len();
            self.context_text = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
            self.emitted = 0;
        }
        Ok(out)
    }

    /// Ends the stream: returns what is still held back (an incomplete
    /// character comes out as U+FFFD) and starts afresh.
    pub fn finish(&mut self) -> Result<String> {
        let text = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        let pending = &text[common_prefix(&self.context_text, &text)..];
        let out = pending.get(self.emitted..).unwrap_or_default().to_owned();
        self.ids.clear();
        self.context = 0;
        self.context_text.clear();
        self.emitted = 0;
        Ok(out)
    }
}

/// Length of the longest common prefix of `a` and `b`, on a character
/// boundary. It is all of `a` unless the decoder rewrote the context.
fn common_prefix(a: &str, b: &str) -> usize {
    if b.starts_with(a) {
        return a.len();
    }
    a.char_indices()
        .zip(b.chars())
        .find(|((_, ca), cb)| ca != cb)
        .map_or(a.len().min(b.len()), |((i, _), _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::tests::bundled_tokenizer;

    /// Decodes `ids` one by one, returning each step's output.
    fn stream(tok: &Tokenizer, ids: &[u32]) -> (Vec<String>, String) {
        let mut dec = tok.stream_decoder(false);
        let steps = ids.iter().map(|&id| dec.step(id).unwrap()).collect();
        (steps, dec.finish().unwrap())
    }

    #[test]
    fn streamed_text_equals_decoded_text_and_never_splits_a_character() {
        let tok = bundled_tokenizer();
        for text in [
            "It is a truth universally acknowledged.",
            "naïve café — déjà vu, Größe",
            "日本語のテキストと中文测试",
            "emoji: 🎉 👍🏽 👨‍👩‍👧 and ❤️!",
            "  spaces\tand\nnewlines\n\n",
        ] {
            let ids = tok.encode(text, false).unwrap();
            let (steps, tail) = stream(&tok, &ids);
            assert_eq!(steps.concat() + &tail, text, "{text:?}");
            assert_eq!(tail, "");
            for s in &steps {
                assert!(!s.contains('\u{FFFD}'), "{text:?}: step emitted {s:?}");
            }
        }
    }

    #[test]
    fn an_emoji_split_over_byte_tokens_comes_out_whole_at_its_last_byte() {
        let tok = bundled_tokenizer();
        // The bundled tokenizer has no merges for the emoji: one id a byte.
        let ids = tok.encode("a🎉b", false).unwrap();
        assert_eq!(ids.len(), 6, "{ids:?}");
        let (steps, tail) = stream(&tok, &ids);
        assert_eq!(steps, ["a", "", "", "", "🎉", "b"]);
        assert_eq!(tail, "");
    }

    #[test]
    fn incomplete_and_invalid_bytes_are_flushed_as_replacement_characters() {
        let tok = bundled_tokenizer();
        let emoji = tok.encode("🎉", false).unwrap();
        assert_eq!(emoji.len(), 4, "{emoji:?}");
        // The emoji's first two bytes, then plain text: the bytes can never
        // complete, so they come out as U+FFFD before the text.
        let mut ids = emoji[..2].to_vec();
        ids.extend(tok.encode("ok", false).unwrap());
        let (steps, tail) = stream(&tok, &ids);
        assert_eq!(steps[0], "");
        assert_eq!(steps[1], "");
        assert_eq!(steps[2..].concat(), "\u{FFFD}ok");
        assert_eq!(tail, "");
        // Cut off at the end of the stream: finish flushes them.
        let (steps, tail) = stream(&tok, &emoji[..3]);
        assert!(steps.iter().all(String::is_empty));
        assert_eq!(tail, "\u{FFFD}");
    }

    #[test]
    fn special_tokens_are_kept_or_skipped() {
        let tok = bundled_tokenizer();
        let ids = tok
            .encode("<|im_start|>assistant\nHello.<|im_end|>", false)
            .unwrap();
        let mut keep = tok.stream_decoder(false);
        let mut skip = tok.stream_decoder(true);
        let (mut a, mut b) = (String::new(), String::new());
        for &id in &ids {
            a += &keep.step(id).unwrap();
            b += &skip.step(id).unwrap();
        }
        assert_eq!(a, "<|im_start|>assistant\nHello.<|im_end|>");
        assert_eq!(b, "assistant\nHello.");
    }

    #[test]
    fn unknown_ids_are_an_error() {
        let tok = bundled_tokenizer();
        let mut dec = tok.stream_decoder(false);
        let err = dec.step(u32::MAX).unwrap_err().to_string();
        assert!(
            err.contains("4294967295") && err.contains("tokenizer.json"),
            "{err}"
        );
    }

    #[test]
    fn common_prefix_stops_at_a_character_boundary() {
        assert_eq!(common_prefix("abc", "abcd"), 3);
        assert_eq!(common_prefix("aé", "aè"), 1);
        assert_eq!(common_prefix("abc", "ab"), 2);
        assert_eq!(common_prefix("", "x"), 0);
    }
}
