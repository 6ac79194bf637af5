//! Byte-level BPE tokenizer built from the GGUF arrays (MODEL.md §5.1, ECOSYSTEM.md §5.1).
//!
//! Encoding, in order:
//! 1. **Special partition** (as llama.cpp `tokenizer_st_partition`): special token strings are cut out of
//!    the text as whole strings before pre-tokenization, longest string first (ties: lower id first),
//!    leftmost non-overlapping occurrences. User-defined tokens (type 4, e.g. `<think>` in Qwen GGUFs)
//!    are always matched; control and unknown tokens (types 3, 2) only when `parse_special` is true.
//!    Unused tokens (type 5, padding such as `[PAD123]`) are never matched and never produced.
//! 2. **No normalizer.** llama.cpp does not NFC-normalize for `gpt2` vocabularies, and exact id parity with
//!    llama.cpp is the goal (HF's `tokenizer.json` for Qwen does apply NFC; the two differ only on text
//!    that is not already NFC).
//! 3. **Pre-tokenizer**: `Split(regex, Isolated)` with the `qwen35` (or `qwen2`) regex, then
//!    `ByteLevel(add_prefix_space = false, use_regex = false)`.
//! 4. **BPE** (HF `tokenizers`, fancy-regex) with the normal tokens as vocabulary and the merges by rank;
//!    no unk, no byte fallback, no dropout.
//!
//! Decoding is ours: every id maps to its raw bytes once, at construction (normal tokens through the
//! GPT-2 unicode→byte table; control/user-defined/unknown tokens as their literal text; unused tokens
//! and ids past the vocabulary as nothing). There is no space clean-up. [`StreamDecoder`] holds back an
//! incomplete UTF-8 sequence until a later token completes it.

use std::collections::HashMap;

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

use crate::error::{Error, Result};

/// `tokenizer.ggml.pre = "qwen35"` (Qwen3.5/3.6): like qwen2 but `\p{M}` joins letters.
pub const QWEN35_PRE_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// `tokenizer.ggml.pre = "qwen2"` (Qwen2/Qwen3).
pub const QWEN2_PRE_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF `tokenizer.ggml.token_type` values.
pub const TOKEN_TYPE_NORMAL: i32 = 1;
pub const TOKEN_TYPE_UNKNOWN: i32 = 2;
pub const TOKEN_TYPE_CONTROL: i32 = 3;
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;
pub const TOKEN_TYPE_UNUSED: i32 = 5;
pub const TOKEN_TYPE_BYTE: i32 = 6;

/// The GGUF tokenizer arrays, as plain values (the GGUF reader fills this).
#[derive(Clone, Debug, Default)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.tokens`, by id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    /// Empty means "all normal".
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`, by rank, each `"a b"`.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.pre`: `"qwen35"` or `"qwen2"`.
    pub pre: String,
    /// `tokenizer.ggml.model`: must be `"gpt2"`.
    pub model: String,
}

/// The GPT-2 byte→unicode table: printable bytes map to themselves, the other 68 bytes to U+0100.. in
/// byte order.
const fn build_byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    let mut b = 0usize;
    while b < 256 {
        let printable =
            (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
        let cp = if printable {
            b as u32
        } else {
            extra += 1;
            0xff + extra
        };
        table[b] = match char::from_u32(cp) {
            Some(c) => c,
            None => '\0',
        };
        b += 1;
    }
    table
}

static BYTE_TO_CHAR: [char; 256] = build_byte_to_char();

/// GPT-2 byte-level encoding of one byte (e.g. `b' '` → `'Ġ'`).
pub fn byte_to_unicode(b: u8) -> char {
    BYTE_TO_CHAR[b as usize]
}

/// Inverse of [`byte_to_unicode`]; `None` for a char outside the 256-char alphabet.
pub fn unicode_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    match cp {
        0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff => Some(cp as u8),
        0x100..=0x143 => {
            // The 68 non-printable bytes, in order, took U+0100..=U+0143.
            let k = (cp - 0x100) as usize;
            (0..=255u8)
                .filter(|&b| BYTE_TO_CHAR[b as usize] as u32 >= 0x100)
                .nth(k)
        }
        _ => None,
    }
}

/// Byte-level decoding of a token string: each char through the unicode→byte table; a char outside
/// the alphabet (malformed vocab) is kept as its own UTF-8.
fn byte_level_decode(s: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    for c in s.chars() {
        match unicode_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

/// A fragment of the input after special-token partition.
enum Frag {
    Text(usize, usize), // byte range into the input
    Special(u32),
}

pub struct Tokenizer {
    /// Pre-tokenizer + BPE only (no normalizer, no added tokens).
    bpe: tokenizers::Tokenizer,
    tokens: Vec<String>,
    types: Vec<i32>,
    /// Raw bytes per id (see module doc).
    bytes: Vec<Vec<u8>>,
    /// Every token string → its lowest id.
    token_to_id: HashMap<String, u32>,
    /// Special ids (types 2, 3, 4), longest text first, ties by lower id.
    specials: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("n_tokens", &self.tokens.len())
            .field("n_specials", &self.specials.len())
            .finish()
    }
}

fn tok_err(msg: impl Into<String>) -> Error {
    Error::Tokenizer(msg.into())
}

impl Tokenizer {
    /// Builds the tokenizer. Errors (`Error::Tokenizer`): model other than `gpt2`, unknown `pre`,
    /// empty vocabulary, `token_types` of the wrong length or with values outside 1..=6, a merge that is
    /// not `"a b"` or refers to (or produces) a string that is not a normal token.
    pub fn new(spec: TokenizerSpec) -> Result<Tokenizer> {
        let TokenizerSpec {
            tokens,
            token_types,
            merges,
            pre,
            model,
        } = spec;
        if model != "gpt2" {
            return Err(tok_err(format!(
                "tokenizer.ggml.model is '{model}', only 'gpt2' (byte-level BPE) is supported"
            )));
        }
        let regex = match pre.as_str() {
            "qwen35" => QWEN35_PRE_REGEX,
            "qwen2" => QWEN2_PRE_REGEX,
            other => {
                return Err(tok_err(format!(
                    "tokenizer.ggml.pre is '{other}', supported: 'qwen35', 'qwen2'"
                )))
            }
        };
        if tokens.is_empty() {
            return Err(tok_err("tokenizer.ggml.tokens is empty"));
        }
        if tokens.len() > u32::MAX as usize {
            return Err(tok_err("tokenizer.ggml.tokens has more than 2^32 entries"));
        }
        let types = if token_types.is_empty() {
            vec![TOKEN_TYPE_NORMAL; tokens.len()]
        } else if token_types.len() != tokens.len() {
            return Err(tok_err(format!(
                "tokenizer.ggml.token_type has {} entries, tokens has {}",
                token_types.len(),
                tokens.len()
            )));
        } else {
            token_types
        };
        if let Some((i, t)) = types
            .iter()
            .enumerate()
            .find(|(_, t)| !(1..=6).contains(*t))
        {
            return Err(tok_err(format!(
                "token {i} has token_type {t}, expected 1..=6"
            )));
        }

        // Vocabulary for BPE: the normal (and byte) tokens; lowest id wins on duplicates.
        let mut bpe_vocab: HashMap<String, u32> = HashMap::new();
        let mut token_to_id: HashMap<String, u32> = HashMap::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            token_to_id.entry(t.clone()).or_insert(i as u32);
            if matches!(types[i], TOKEN_TYPE_NORMAL | TOKEN_TYPE_BYTE) {
                bpe_vocab.entry(t.clone()).or_insert(i as u32);
            }
        }
        let mut bpe_merges = Vec::with_capacity(merges.len());
        for (rank, m) in merges.iter().enumerate() {
            // Split at the first space after the first char (byte-level tokens hold no raw space).
            let first = m.chars().next().map_or(0, char::len_utf8);
            let Some(pos) = m[first..].find(' ').map(|p| p + first) else {
                return Err(tok_err(format!(
                    "merge {rank} '{m}' is not of the form 'a b'"
                )));
            };
            let (a, b) = (&m[..pos], &m[pos + 1..]);
            if a.is_empty() || b.is_empty() {
                return Err(tok_err(format!("merge {rank} '{m}' has an empty side")));
            }
            for part in [a, b] {
                if !bpe_vocab.contains_key(part) {
                    return Err(tok_err(format!(
                        "merge {rank} '{m}' refers to '{part}', which is not a normal token"
                    )));
                }
            }
            let merged = format!("{a}{b}");
            if !bpe_vocab.contains_key(&merged) {
                return Err(tok_err(format!(
                    "merge {rank} '{m}' produces '{merged}', which is not a normal token"
                )));
            }
            bpe_merges.push((a.to_string(), b.to_string()));
        }
        let model = BPE::builder()
            .vocab_and_merges(bpe_vocab.into_iter().collect::<Vocab>(), bpe_merges)
            .fuse_unk(false)
            .byte_fallback(false)
            .ignore_merges(false)
            .build()
            .map_err(|e| tok_err(format!("cannot build BPE model: {e}")))?;
        let split = Split::new(
            SplitPattern::Regex(regex.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| {
            tok_err(format!(
                "cannot compile pre-tokenizer regex for '{pre}': {e}"
            ))
        })?;
        let pre_tok = Sequence::new(vec![
            PreTokenizerWrapper::Split(split),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)),
        ]);
        let mut bpe = tokenizers::Tokenizer::new(model);
        bpe.with_pre_tokenizer(Some(pre_tok));

        let bytes: Vec<Vec<u8>> = tokens
            .iter()
            .zip(&types)
            .map(|(t, &ty)| match ty {
                TOKEN_TYPE_NORMAL | TOKEN_TYPE_BYTE => byte_level_decode(t),
                TOKEN_TYPE_UNKNOWN | TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED => {
                    t.as_bytes().to_vec()
                }
                _ => Vec::new(), // unused / padding
            })
            .collect();

        let mut specials: Vec<u32> = (0..tokens.len() as u32)
            .filter(|&i| {
                matches!(
                    types[i as usize],
                    TOKEN_TYPE_UNKNOWN | TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED
                ) && !tokens[i as usize].is_empty()
            })
            .collect();
        specials.sort_by(|&a, &b| {
            tokens[b as usize]
                .len()
                .cmp(&tokens[a as usize].len())
                .then(a.cmp(&b))
        });

        Ok(Tokenizer {
            bpe,
            tokens,
            types,
            bytes,
            token_to_id,
            specials,
        })
    }

    /// Text → ids. With `parse_special`, control tokens written in the text (`<|im_start|>`) become
    /// their ids; without it they are tokenized as plain text. User-defined tokens are always matched
    /// (as llama.cpp and HF do). Never produces unused/padding ids.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let mut frags = vec![Frag::Text(0, text.len())];
        for &id in &self.specials {
            let ty = self.types[id as usize];
            if !parse_special && ty != TOKEN_TYPE_USER_DEFINED {
                continue;
            }
            let pat = self.tokens[id as usize].as_str();
            let mut next = Vec::with_capacity(frags.len());
            for f in frags {
                let Frag::Text(start, end) = f else {
                    next.push(f);
                    continue;
                };
                let mut cur = start;
                for (off, _) in text[start..end].match_indices(pat) {
                    let at = start + off;
                    if at > cur {
                        next.push(Frag::Text(cur, at));
                    }
                    next.push(Frag::Special(id));
                    cur = at + pat.len();
                }
                if cur < end {
                    next.push(Frag::Text(cur, end));
                }
            }
            frags = next;
        }

        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        for f in frags {
            match f {
                Frag::Special(id) => ids.push(id),
                Frag::Text(s, e) => {
                    let enc = self
                        .bpe
                        .encode_fast(&text[s..e], false)
                        .map_err(|err| tok_err(format!("encode failed: {err}")))?;
                    ids.extend_from_slice(enc.get_ids());
                }
            }
        }
        Ok(ids)
    }

    /// Ids → text (lossy UTF-8). Specials render as their text; unused/padding ids and ids past the
    /// vocabulary render as nothing.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut buf = Vec::new();
        for &id in ids {
            if let Some(b) = self.bytes.get(id as usize) {
                buf.extend_from_slice(b);
            }
        }
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// Raw bytes of one token (byte-level decoded; specials as their text; empty for unused/padding
    /// and out-of-range ids).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.bytes.get(id as usize).cloned().unwrap_or_default()
    }

    /// Same as [`Tokenizer::token_bytes`] without a copy.
    pub fn token_bytes_ref(&self, id: u32) -> &[u8] {
        self.bytes.get(id as usize).map_or(&[], |b| b.as_slice())
    }

    /// The token's string as stored in the GGUF (byte-level form for normal tokens).
    pub fn token_str(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// Id of a GGUF token string (lowest id if the string repeats).
    pub fn token_id(&self, s: &str) -> Option<u32> {
        self.token_to_id.get(s).copied()
    }

    /// Number of token strings (`tokenizer.ggml.tokens`); embedding rows past it are padding.
    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// The GGUF token type of `id`, `None` past the vocabulary.
    pub fn token_type(&self, id: u32) -> Option<i32> {
        self.types.get(id as usize).copied()
    }

    /// True for control, user-defined and unknown tokens (those matched as whole strings).
    pub fn is_special(&self, id: u32) -> bool {
        matches!(
            self.token_type(id),
            Some(TOKEN_TYPE_UNKNOWN | TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED)
        )
    }

    /// True for control tokens only (`<|im_start|>`, `<|endoftext|>`, ...).
    pub fn is_control(&self, id: u32) -> bool {
        self.token_type(id) == Some(TOKEN_TYPE_CONTROL)
    }
}

/// Incremental detokenizer: emits only complete UTF-8, holding back an incomplete trailing sequence
/// until a later token completes it. Invalid bytes (that no continuation can fix) become U+FFFD.
#[derive(Clone, Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> Self {
        StreamDecoder {
            pending: Vec::new(),
        }
    }

    /// Appends the token's bytes; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.pending.extend_from_slice(tok.token_bytes_ref(id));
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    // pending[start..valid] was just validated by from_utf8.
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..valid]).unwrap_or_default(),
                    );
                    match e.error_len() {
                        // Incomplete sequence at the end: keep it for the next token.
                        None => {
                            start = valid;
                            break;
                        }
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid + n;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Whatever is held back, lossily decoded; the decoder is empty afterwards.
    pub fn flush(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }

    /// True when nothing is held back.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}
