//! Incremental detokenisation with stop strings: the text of the tokens so far, handed out in
//! pieces that never end inside a multi-byte character and never show a stop string (or the
//! start of one that may still complete).

use std::sync::Arc;

use ddtree_engine::{EngineError, Tokenizer};

/// The text of a growing token sequence (empty without a tokenizer).
pub struct TextStream {
    tokenizer: Option<Arc<Tokenizer>>,
    ids: Vec<u32>,
    stops: Vec<String>,
    /// Bytes of the text handed out so far.
    sent: usize,
    /// The text, once a stop string ended it (cut before the stop string).
    stopped: Option<String>,
}

impl TextStream {
    /// A stream that ends at the first of `stops`.
    pub fn new(tokenizer: Option<Arc<Tokenizer>>, stops: Vec<String>) -> Self {
        Self {
            tokenizer,
            ids: Vec::new(),
            stops,
            sent: 0,
            stopped: None,
        }
    }

    fn decode(&self) -> Result<String, EngineError> {
        match &self.tokenizer {
            Some(t) => t.decode(&self.ids),
            None => Ok(String::new()),
        }
    }

    /// Whether a stop string ended the text.
    pub fn stopped(&self) -> bool {
        self.stopped.is_some()
    }

    /// Adds tokens and returns the text that may be shown now (possibly empty).
    pub fn push(&mut self, ids: &[u32]) -> Result<String, EngineError> {
        if self.stopped.is_some() {
            return Ok(String::new());
        }
        self.ids.extend_from_slice(ids);
        let text = self.decode()?;
        // An incomplete UTF-8 sequence at the end decodes to U+FFFD: wait for the next token.
        let stable = text.trim_end_matches('\u{FFFD}');
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let mut from = self.sent.saturating_sub(longest);
        while !stable.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stops
            .iter()
            .filter_map(|s| stable[from..].find(s.as_str()).map(|i| from + i))
            .min();
        if let Some(at) = hit {
            let piece = stable[self.sent.min(at)..at].to_string();
            self.stopped = Some(stable[..at].to_string());
            self.sent = at;
            return Ok(piece);
        }
        // Hold back the longest tail that starts a stop string.
        let mut end = stable.len();
        for s in &self.stops {
            for k in (1..s.len().min(stable.len() + 1)).rev() {
                if s.is_char_boundary(k) && stable.ends_with(&s[..k]) {
                    end = end.min(stable.len() - k);
                    break;
                }
            }
        }
        let end = end.max(self.sent);
        let piece = stable[self.sent..end].to_string();
        self.sent = end;
        Ok(piece)
    }

    /// The rest of the text once no token follows (held-back characters included).
    pub fn finish(&mut self) -> Result<String, EngineError> {
        if self.stopped.is_some() {
            return Ok(String::new());
        }
        let text = self.decode()?;
        let piece = text.get(self.sent..).unwrap_or_default().to_string();
        self.sent = text.len();
        Ok(piece)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(tokenizer: &Arc<Tokenizer>, ids: &[u32], stops: &[&str]) -> (Vec<String>, bool) {
        let mut s = TextStream::new(Some(tokenizer.clone()), stops.iter().map(|s| s.to_string()).collect());
        let mut out: Vec<String> = ids.iter().map(|&id| s.push(&[id]).unwrap()).collect();
        out.push(s.finish().unwrap());
        (out, s.stopped())
    }

    #[test]
    fn multibyte_characters_are_never_split_and_stops_are_cut() {
        let tokenizer = Arc::new(ddtree_engine::tiny::tokenizer().unwrap());
        let text = "let é = \"ü€\"; // done";
        let ids = tokenizer.encode(text).unwrap();
        let (parts, stopped) = pieces(&tokenizer, &ids, &[]);
        assert!(!stopped);
        assert_eq!(parts.concat(), text);
        assert!(parts.iter().all(|p| !p.contains('\u{FFFD}')), "{parts:?}");
        // The rare characters are byte tokens: one of them alone is not a character.
        assert!(ids
            .iter()
            .any(|&id| tokenizer.decode(&[id]).unwrap().contains('\u{FFFD}')));
        let (parts, stopped) = pieces(&tokenizer, &ids, &["\";"]);
        assert!(stopped);
        assert_eq!(parts.concat(), "let é = \"ü€");
        let (parts, _) = pieces(&tokenizer, &ids, &["zzz", "done"]);
        assert_eq!(parts.concat(), "let é = \"ü€\"; // ");
    }
}
