//! Byte-level BPE tokenizer on a small hand-built vocabulary: 256 byte tokens, a few merges, specials
//! and padding, in the layout of a real Qwen GGUF.

use bonsai_engine::tokenizer::{
    byte_to_unicode, unicode_to_byte, StreamDecoder, Tokenizer, TokenizerSpec, TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNUSED, TOKEN_TYPE_USER_DEFINED,
};
use bonsai_engine::Error;

/// Independent GPT-2 byte→unicode table, written the way the GPT-2 paper code describes it.
fn gpt2_table() -> Vec<char> {
    let mut bs: Vec<u32> = (0x21..=0x7e)
        .chain(0xa1..=0xac)
        .chain(0xae..=0xff)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec!['\0'; 256];
    for (b, c) in bs.iter().zip(cs) {
        table[*b as usize] = char::from_u32(c).unwrap();
    }
    table
}

/// Byte-level form of a UTF-8 string.
fn bl(s: &str) -> String {
    let t = gpt2_table();
    s.bytes().map(|b| t[b as usize]).collect()
}

const MERGES: &[(&str, &str)] = &[
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("b", "c"), // rank 4 < rank 5: "abc" → a + bc
    ("a", "b"),
    ("x", "y"), // rank 6 < rank 7: "xyz" → xy + z
    ("y", "z"),
    ("Ġ", "Ġ"),
    ("Ġ", "b"),
];

struct Fixture {
    spec: TokenizerSpec,
}

fn fixture(pre: &str) -> Fixture {
    let table = gpt2_table();
    let mut tokens: Vec<String> = table.iter().map(|c| c.to_string()).collect();
    let mut types = vec![TOKEN_TYPE_NORMAL; 256];
    let mut merges = Vec::new();
    let mut add_merge = |a: &str, b: &str, tokens: &mut Vec<String>, types: &mut Vec<i32>| {
        merges.push(format!("{a} {b}"));
        let m = format!("{a}{b}");
        if !tokens.contains(&m) {
            tokens.push(m);
            types.push(TOKEN_TYPE_NORMAL);
        }
    };
    for (a, b) in MERGES {
        add_merge(a, b, &mut tokens, &mut types);
    }
    // '中' = E4 B8 AD: merged into one token in two steps.
    let zh: Vec<String> = "中"
        .bytes()
        .map(|b| table[b as usize].to_string())
        .collect();
    add_merge(&zh[0], &zh[1], &mut tokens, &mut types);
    add_merge(
        &format!("{}{}", zh[0], zh[1]),
        &zh[2],
        &mut tokens,
        &mut types,
    );
    // Decomposed 'é' = 'e' U+0301 (CC 81): "e" + "\u{301}" → one token.
    let acute = bl("\u{301}");
    let ac: Vec<String> = acute.chars().map(|c| c.to_string()).collect();
    add_merge(&ac[0], &ac[1], &mut tokens, &mut types);
    add_merge("e", &acute, &mut tokens, &mut types);

    for (s, ty) in [
        ("<|endoftext|>", TOKEN_TYPE_CONTROL),
        ("<|im_start|>", TOKEN_TYPE_CONTROL),
        ("<|im_end|>", TOKEN_TYPE_CONTROL),
        ("<think>", TOKEN_TYPE_USER_DEFINED),
        ("</think>", TOKEN_TYPE_USER_DEFINED),
        ("[PAD0]", TOKEN_TYPE_UNUSED),
        ("[PAD1]", TOKEN_TYPE_UNUSED),
    ] {
        tokens.push(s.to_string());
        types.push(ty);
    }
    Fixture {
        spec: TokenizerSpec {
            tokens,
            token_types: types,
            merges,
            pre: pre.to_string(),
            model: "gpt2".to_string(),
        },
    }
}

fn tok() -> Tokenizer {
    Tokenizer::new(fixture("qwen35").spec).expect("fixture tokenizer builds")
}

fn id(t: &Tokenizer, byte_level: &str) -> u32 {
    t.token_id(byte_level)
        .unwrap_or_else(|| panic!("no token {byte_level:?}"))
}

const ADVERSARIAL: &[&str] = &[
    "Hello, world! the then thin",
    "中文测试：你好，世界。日本語のテキスト、한국어",
    "👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 family: 👩🏿‍🚀",
    "e\u{301}te\u{301} cafe\u{301} Z\u{351}\u{36b}a\u{36d}l\u{352}g\u{310}o\u{364}",
    "line1\r\nline2\r\n\r\n\ttab\t\tend  \n   ",
    "12345678901234567890 and 3.14159e-10",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "it's I'M we'Ve they'll she'd you're 'S",
    "مرحبا بالعالم שלום עולם",
    "   leading and trailing spaces   ",
    "",
    "\u{0}\u{1}\u{7f}\u{80}\u{ad}\u{a0}\u{feff}\u{2028}",
    "<|im_end|<|im_start|><<think>>[PAD0]</think",
];

#[test]
fn byte_table_matches_gpt2() {
    let t = gpt2_table();
    for b in 0..=255u8 {
        assert_eq!(byte_to_unicode(b), t[b as usize], "byte {b:#x}");
        assert_eq!(unicode_to_byte(t[b as usize]), Some(b));
    }
    assert_eq!(byte_to_unicode(b' '), 'Ġ');
    assert_eq!(byte_to_unicode(b'\n'), 'Ċ');
    assert_eq!(unicode_to_byte('中'), None);
    assert_eq!(unicode_to_byte(' '), None);
}

#[test]
fn round_trip_adversarial() {
    let t = tok();
    for s in ADVERSARIAL {
        for parse_special in [false, true] {
            let ids = t.encode(s, parse_special).unwrap();
            assert_eq!(
                &t.decode(&ids),
                s,
                "round trip (parse_special={parse_special}) of {s:?}"
            );
            assert!(ids.iter().all(|&i| (i as usize) < t.n_tokens()));
        }
    }
}

#[test]
fn digits_split_one_by_one() {
    let t = tok();
    let s = "12345678901234567890";
    let ids = t.encode(s, false).unwrap();
    let want: Vec<u32> = s.chars().map(|c| id(&t, &c.to_string())).collect();
    assert_eq!(ids, want);
    // "a1b" : letters and digits never share a piece.
    let ids = t.encode("x1y", false).unwrap();
    assert_eq!(ids, vec![id(&t, "x"), id(&t, "1"), id(&t, "y")]);
}

#[test]
fn merges_applied_by_rank() {
    let t = tok();
    assert_eq!(
        t.encode("abc", false).unwrap(),
        vec![id(&t, "a"), id(&t, "bc")]
    );
    assert_eq!(
        t.encode("xyz", false).unwrap(),
        vec![id(&t, "xy"), id(&t, "z")]
    );
    assert_eq!(t.encode(" the", false).unwrap(), vec![id(&t, "Ġthe")]);
    // No "t he" merge: without the leading space only "he" forms.
    assert_eq!(
        t.encode("the", false).unwrap(),
        vec![id(&t, "t"), id(&t, "he")]
    );
    assert_eq!(t.encode("中", false).unwrap(), vec![id(&t, &bl("中"))]);
    assert_eq!(
        t.encode(" the the", false).unwrap(),
        vec![id(&t, "Ġthe"), id(&t, "Ġthe")]
    );
}

#[test]
fn pre_tokenizer_whitespace_lookahead() {
    let t = tok();
    // `\s+(?!\S)` leaves the last space to join the next word: "a", "  ", " b".
    let ids = t.encode("a   b", false).unwrap();
    assert_eq!(ids, vec![id(&t, "a"), id(&t, "ĠĠ"), id(&t, "Ġb")]);
    // Trailing whitespace is one piece; a newline run stays apart from the word before it.
    let ids = t.encode("a\n\nb", false).unwrap();
    assert_eq!(
        ids,
        vec![id(&t, "a"), id(&t, "Ċ"), id(&t, "Ċ"), id(&t, "b")]
    );
}

#[test]
fn qwen35_keeps_combining_marks_with_letters() {
    let s = "e\u{301}";
    let acute = bl("\u{301}");
    let t35 = tok();
    assert_eq!(
        t35.encode(s, false).unwrap(),
        vec![id(&t35, &format!("e{acute}"))]
    );
    // qwen2's regex puts the mark in its own piece, so the "e" + mark merge cannot apply.
    let t2 = Tokenizer::new(fixture("qwen2").spec).unwrap();
    assert_eq!(
        t2.encode(s, false).unwrap(),
        vec![id(&t2, "e"), id(&t2, &acute)]
    );
}

#[test]
fn control_tokens_parsed_only_when_asked() {
    let t = tok();
    let im_start = t.token_id("<|im_start|>").unwrap();
    let im_end = t.token_id("<|im_end|>").unwrap();
    let s = "<|im_start|>user\nhi<|im_end|>";
    let on = t.encode(s, true).unwrap();
    assert_eq!(on[0], im_start);
    assert_eq!(*on.last().unwrap(), im_end);
    assert_eq!(on.iter().filter(|&&i| t.is_special(i)).count(), 2);
    let off = t.encode(s, false).unwrap();
    assert!(
        off.iter().all(|&i| !t.is_special(i)),
        "no special ids without parse_special: {off:?}"
    );
    assert_eq!(t.decode(&off), s);
    // '<' '|' ... as plain bytes.
    assert_eq!(off[0], id(&t, "<"));
    assert!(t.is_control(im_start));
}

#[test]
fn user_defined_tokens_always_matched() {
    // llama.cpp and HF both match user-defined (non-special added) tokens regardless of parse_special.
    let t = tok();
    let think = t.token_id("<think>").unwrap();
    let end_think = t.token_id("</think>").unwrap();
    for ps in [false, true] {
        let ids = t.encode("<think>\nx\n</think>", ps).unwrap();
        assert_eq!(
            ids,
            vec![think, id(&t, "Ċ"), id(&t, "x"), id(&t, "Ċ"), end_think]
        );
    }
    assert!(t.is_special(think));
    assert!(!t.is_control(think));
}

#[test]
fn longest_special_wins() {
    // "</think>" contains no "<think>", but "<<think>>" contains "<think>" once.
    let t = tok();
    let think = t.token_id("<think>").unwrap();
    let ids = t.encode("<<think>>", true).unwrap();
    assert_eq!(ids.iter().filter(|&&i| i == think).count(), 1);
    assert_eq!(t.decode(&ids), "<<think>>");
}

#[test]
fn padding_never_produced_and_decodes_empty() {
    let t = tok();
    let pad0 = t.token_id("[PAD0]").unwrap();
    let pad1 = t.token_id("[PAD1]").unwrap();
    for ps in [false, true] {
        let ids = t.encode("[PAD0][PAD1] x [PAD1]", ps).unwrap();
        assert!(!ids.contains(&pad0) && !ids.contains(&pad1));
        assert_eq!(t.decode(&ids), "[PAD0][PAD1] x [PAD1]");
    }
    assert_eq!(t.decode(&[pad0, pad1]), "");
    assert!(t.token_bytes(pad0).is_empty());
    // Ids past the vocabulary (embedding padding rows, the DSpark mask) decode to nothing.
    let n = t.n_tokens() as u32;
    assert_eq!(t.decode(&[id(&t, "a"), n, n + 100, id(&t, "b")]), "ab");
    assert!(t.token_str(n).is_none());
    assert!(!t.is_special(pad0));
}

#[test]
fn token_accessors() {
    let t = tok();
    assert_eq!(t.token_str(id(&t, "Ġthe")), Some("Ġthe"));
    assert_eq!(t.token_bytes(id(&t, "Ġthe")), b" the".to_vec());
    assert_eq!(t.token_bytes(id(&t, "Ċ")), b"\n".to_vec());
    assert_eq!(
        t.token_bytes(t.token_id("<|im_end|>").unwrap()),
        b"<|im_end|>".to_vec()
    );
    assert_eq!(t.decode(&[t.token_id("<|im_end|>").unwrap()]), "<|im_end|>");
    assert_eq!(t.n_tokens(), fixture("qwen35").spec.tokens.len());
    assert_eq!(t.token_id("no such token"), None);
}

#[test]
fn stream_decoder_holds_back_split_chars() {
    let t = tok();
    let text = "héllo 中文 👍🏽👨‍👩‍👧 e\u{301} end";
    // One byte token per byte: every multi-byte char is split across tokens.
    let ids: Vec<u32> = text
        .bytes()
        .map(|b| id(&t, &byte_to_unicode(b).to_string()))
        .collect();
    let mut d = StreamDecoder::new();
    let mut out = String::new();
    for (i, &tid) in ids.iter().enumerate() {
        let piece = d.push(&t, tid);
        assert!(!piece.contains('\u{fffd}'), "replacement char at byte {i}");
        out.push_str(&piece);
        // Everything emitted so far is a prefix of the text, ending on a char boundary.
        assert!(text.starts_with(&out));
    }
    assert!(d.is_empty());
    assert_eq!(d.flush(), "");
    assert_eq!(out, text);

    // The first byte of '中' alone emits nothing; the third completes it.
    let zh: Vec<u32> = "中"
        .bytes()
        .map(|b| id(&t, &byte_to_unicode(b).to_string()))
        .collect();
    let mut d = StreamDecoder::new();
    assert_eq!(d.push(&t, zh[0]), "");
    assert_eq!(d.push(&t, zh[1]), "");
    assert_eq!(d.push(&t, zh[2]), "中");

    // Multi-char tokens mixed with byte tokens; specials pass through as text.
    let ids = t.encode("<|im_start|>中 the", true).unwrap();
    let mut d = StreamDecoder::new();
    let s: String = ids.iter().map(|&i| d.push(&t, i)).collect();
    assert_eq!(s, "<|im_start|>中 the");
}

#[test]
fn stream_decoder_invalid_and_truncated_bytes() {
    let t = tok();
    let b = |x: u8| id(&t, &byte_to_unicode(x).to_string());
    let mut d = StreamDecoder::new();
    // A lone continuation byte can never become valid: replaced at once.
    assert_eq!(d.push(&t, b(0x80)), "\u{fffd}");
    assert_eq!(d.push(&t, b(b'a')), "a");
    // A lead byte followed by ASCII: the broken sequence is replaced, the ASCII kept.
    assert_eq!(d.push(&t, b(0xe4)), "");
    assert_eq!(d.push(&t, b(b'z')), "\u{fffd}z");
    // An incomplete sequence at the end is flushed lossily.
    assert_eq!(d.push(&t, b(0xf0)), "");
    assert_eq!(d.push(&t, b(0x9f)), "");
    assert!(!d.is_empty());
    assert_eq!(d.flush(), "\u{fffd}");
    assert!(d.is_empty());
    // Padding ids push nothing.
    assert_eq!(d.push(&t, t.token_id("[PAD0]").unwrap()), "");
}

fn expect_tok_err(spec: TokenizerSpec, needle: &str) {
    match Tokenizer::new(spec) {
        Err(Error::Tokenizer(msg)) => {
            assert!(msg.contains(needle), "message {msg:?} lacks {needle:?}")
        }
        Err(e) => panic!("wrong error kind: {e}"),
        Ok(_) => panic!("bad spec accepted (expected error with {needle:?})"),
    }
}

#[test]
fn bad_specs_rejected() {
    let mut s = fixture("qwen35").spec;
    s.model = "llama".into();
    expect_tok_err(s, "gpt2");

    expect_tok_err(fixture("gpt4o").spec, "gpt4o");

    let mut s = fixture("qwen35").spec;
    s.merges.push("Ġ zzz".into());
    expect_tok_err(s, "zzz");

    let mut s = fixture("qwen35").spec;
    s.merges.push("q r".into()); // both sides exist, "qr" does not
    expect_tok_err(s, "qr");

    let mut s = fixture("qwen35").spec;
    s.merges.push("nospace".into());
    expect_tok_err(s, "nospace");

    let mut s = fixture("qwen35").spec;
    s.token_types.pop();
    expect_tok_err(s, "token_type");

    let mut s = fixture("qwen35").spec;
    s.token_types[3] = 9;
    expect_tok_err(s, "token_type 9");

    let mut s = fixture("qwen35").spec;
    s.tokens.clear();
    s.token_types.clear();
    s.merges.clear();
    expect_tok_err(s, "empty");
}

#[test]
fn tokenizer_and_decoder_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Tokenizer>();
    send_sync::<StreamDecoder>();
    send_sync::<bonsai_engine::chat::ChatTemplate>();
    send_sync::<bonsai_engine::sampling::Sampler>();
}
