//! Tokenizers: HF `tokenizer.json` (DeepSeek-V3, the tiny test model) and Kimi's `tiktoken.model`
//! with the special tokens of `tokenizer_config.json`.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde_json::Value;
use tiktoken_rs::CoreBPE;

use crate::error::{EngineError, Result};

/// Kimi's pre-tokenizer pattern (`tokenization_kimi.py`): Han runs split apart, letters with
/// character-class intersection, digits in groups of at most 3.
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// Special-token slots after the BPE ranks: 256 reserved plus 2 (as `tokenization_kimi.py`).
pub const KIMI_SPECIAL_SLOTS: usize = 256 + 2;

/// A text tokenizer.
pub enum Tokenizer {
    /// HF `tokenizers` JSON.
    Hf {
        /// Where it came from (for messages).
        path: PathBuf,
        /// The tokenizer.
        inner: Box<tokenizers::Tokenizer>,
    },
    /// tiktoken BPE ranks plus special tokens.
    Tiktoken {
        /// The `tiktoken.model` file.
        path: PathBuf,
        /// The BPE.
        bpe: Box<CoreBPE>,
        /// Number of valid ids (ranks plus special slots).
        vocab: usize,
    },
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (kind, path) = match self {
            Self::Hf { path, .. } => ("hf", path),
            Self::Tiktoken { path, .. } => ("tiktoken", path),
        };
        f.debug_struct("Tokenizer")
            .field("kind", &kind)
            .field("path", path)
            .finish()
    }
}

fn tok_err(path: &Path, reason: impl Into<String>) -> EngineError {
    EngineError::Tokenizer {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| EngineError::io(path, e))
}

impl Tokenizer {
    /// The tokenizer of a model directory: `tokenizer.json` if present, else `tiktoken.model`
    /// (with `tokenizer_config.json` for special tokens), else `None`.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let hf = dir.join("tokenizer.json");
        if hf.is_file() {
            return Self::from_hf_bytes(&hf, &read(&hf)?).map(Some);
        }
        let tiktoken = dir.join("tiktoken.model");
        if tiktoken.is_file() {
            let config = dir.join("tokenizer_config.json");
            let config = if config.is_file() {
                Some((config.clone(), read(&config)?))
            } else {
                None
            };
            let config = config.as_ref().map(|(p, b)| (p.as_path(), b.as_slice()));
            return Self::from_tiktoken_bytes(&tiktoken, &read(&tiktoken)?, config).map(Some);
        }
        Ok(None)
    }

    /// Parses a HF `tokenizer.json`; `path` is for messages.
    pub fn from_hf_bytes(path: &Path, bytes: &[u8]) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| tok_err(path, e.to_string()))?;
        Ok(Self::Hf {
            path: path.to_path_buf(),
            inner: Box::new(inner),
        })
    }

    /// Builds a Kimi tiktoken tokenizer from `tiktoken.model` (lines of `base64-bytes rank`, ranks
    /// `0..n`) and optionally `tokenizer_config.json`, whose `added_tokens_decoder` names the
    /// special ids `n..n+258`; unnamed ones become `<|reserved_token_{id}|>`.
    pub fn from_tiktoken_bytes(path: &Path, model: &[u8], config: Option<(&Path, &[u8])>) -> Result<Self> {
        let text = std::str::from_utf8(model).map_err(|_| tok_err(path, "not UTF-8 text"))?;
        let mut ranks: HashMap<Vec<u8>, u32> = HashMap::new();
        let mut seen_ranks = HashSet::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let bad = |what: &str| tok_err(path, format!("line {}: {what}: {line:?}", i + 1));
            let mut parts = line.split_whitespace();
            let (Some(token), Some(rank), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(bad("expected `<base64 token> <rank>`"));
            };
            let token = base64::engine::general_purpose::STANDARD
                .decode(token)
                .map_err(|_| bad("invalid base64"))?;
            let rank: u32 = rank.parse().map_err(|_| bad("invalid rank"))?;
            if !seen_ranks.insert(rank) || ranks.insert(token, rank).is_some() {
                return Err(bad("duplicate token or rank"));
            }
        }
        let n = ranks.len();
        if let Some(&r) = ranks.values().find(|&&r| r as usize >= n) {
            return Err(tok_err(path, format!("ranks must be 0..{n}, found {r}")));
        }
        let names = match config {
            Some((config_path, bytes)) => special_names(config_path, bytes)?,
            None => HashMap::new(),
        };
        let mut specials: HashMap<String, u32> = HashMap::new();
        for id in n..n + KIMI_SPECIAL_SLOTS {
            let id = id as u32;
            let name = names
                .get(&id)
                .cloned()
                .unwrap_or_else(|| format!("<|reserved_token_{id}|>"));
            if specials.insert(name.clone(), id).is_some() {
                return Err(tok_err(path, format!("special token {name:?} is defined twice")));
            }
        }
        let bpe = CoreBPE::new(
            ranks.into_iter().collect(),
            specials.into_iter().collect(),
            KIMI_PATTERN,
        )
        .map_err(|e| tok_err(path, e.to_string()))?;
        Ok(Self::Tiktoken {
            path: path.to_path_buf(),
            bpe: Box::new(bpe),
            vocab: n + KIMI_SPECIAL_SLOTS,
        })
    }

    /// Encodes text (special tokens written literally in the text are recognized).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Self::Hf { path, inner } => Ok(inner
                .encode(text, true)
                .map_err(|e| tok_err(path, e.to_string()))?
                .get_ids()
                .to_vec()),
            Self::Tiktoken { bpe, .. } => Ok(bpe.encode_with_special_tokens(text)),
        }
    }

    /// Decodes ids to text; invalid UTF-8 (a token split mid-character) is replaced.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Self::Hf { path, inner } => inner.decode(ids, false).map_err(|e| tok_err(path, e.to_string())),
            Self::Tiktoken { path, bpe, vocab } => {
                if let Some(id) = ids.iter().find(|&&id| id as usize >= *vocab) {
                    return Err(tok_err(
                        path,
                        format!("cannot decode id {id}: vocabulary has {vocab} ids"),
                    ));
                }
                let bytes: Vec<u8> = bpe._decode_native_and_split(ids.to_vec()).flatten().collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
        }
    }
}

/// `added_tokens_decoder` of `tokenizer_config.json`: id -> content.
fn special_names(path: &Path, bytes: &[u8]) -> Result<HashMap<u32, String>> {
    let value: Value = serde_json::from_slice(bytes).map_err(|source| EngineError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    let Some(decoder) = value.get("added_tokens_decoder") else {
        return Ok(HashMap::new());
    };
    let bad = |reason: String| EngineError::Config {
        path: path.to_path_buf(),
        field: "added_tokens_decoder".into(),
        reason,
    };
    let decoder = decoder.as_object().ok_or_else(|| bad("not an object".into()))?;
    decoder
        .iter()
        .map(|(id, entry)| {
            let id: u32 = id.parse().map_err(|_| bad(format!("key {id:?} is not a token id")))?;
            let content = entry
                .get("content")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("entry {id} has no string `content`")))?;
            Ok((id, content.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny tiktoken vocabulary: the 256 bytes, then merges "th" (256), "the" (257), " the" (258).
    fn tiny() -> Tokenizer {
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let mut model: String = (0..=255u8).map(|b| format!("{} {b}\n", b64(&[b]))).collect();
        for (i, tok) in [&b"th"[..], b"the", b" the"].iter().enumerate() {
            model.push_str(&format!("{} {}\n", b64(tok), 256 + i));
        }
        let config = br#"{"added_tokens_decoder": {"259": {"content": "[BOS]"}, "260": {"content": "[EOS]"}}}"#;
        Tokenizer::from_tiktoken_bytes(
            Path::new("tiktoken.model"),
            model.as_bytes(),
            Some((Path::new("tokenizer_config.json"), config)),
        )
        .unwrap()
    }

    #[test]
    fn tiktoken_encodes_merges_and_specials() {
        let tok = tiny();
        let ids = tok.encode("the the[EOS]").unwrap();
        assert_eq!(ids, vec![257, 258, 260]);
        assert_eq!(tok.decode(&ids).unwrap(), "the the[EOS]");
        assert_eq!(tok.encode("<|reserved_token_261|>").unwrap(), vec![261]);
        // Han characters are split from Latin letters by the Kimi pattern.
        let han = tok.encode("the中").unwrap();
        assert_eq!(han[0], 257);
        assert_eq!(tok.decode(&han).unwrap(), "the中");
    }

    #[test]
    fn tiktoken_rejects_bad_files() {
        let path = Path::new("tiktoken.model");
        let err = Tokenizer::from_tiktoken_bytes(path, b"YQ== 0\nYQ== 1\n", None).unwrap_err();
        assert!(err.to_string().contains("line 2"), "{err}");
        let err = Tokenizer::from_tiktoken_bytes(path, b"YQ== 5\n", None).unwrap_err();
        assert!(err.to_string().contains("ranks must be 0..1"), "{err}");
        let err = Tokenizer::from_tiktoken_bytes(path, b"!!! 0\n", None).unwrap_err();
        assert!(err.to_string().contains("invalid base64"), "{err}");
        assert!(tiny().decode(&[100_000]).is_err());
    }
}
