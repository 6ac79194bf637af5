//! Corrupted, hostile and wrong files: each case asserts the specific `Error` variant and a
//! message fragment naming what is wrong.

mod common;

use bonsai_engine::config::{DrafterConfig, TargetConfig};
use bonsai_engine::gguf::{Gguf, Value};
use bonsai_engine::{Error, QuantType};
use common::*;

/// Parse, then validate as a target; the first error.
fn target_err(bytes: Vec<u8>) -> Error {
    match Gguf::from_bytes(bytes) {
        Err(e) => e,
        Ok(g) => TargetConfig::from_gguf(&g).expect_err("expected a validation error"),
    }
}

fn parse_err(bytes: Vec<u8>) -> Error {
    Gguf::from_bytes(bytes).expect_err("expected a parse error")
}

fn q1() -> Builder {
    tiny_target(QuantType::Q1_0)
}

#[track_caller]
fn assert_format(e: Error, frag: &str) {
    match &e {
        Error::Format(m) if m.contains(frag) => {}
        _ => panic!("expected Error::Format containing {frag:?}, got {e:?}"),
    }
}

#[track_caller]
fn assert_tensor(e: Error, tensor: &str, frag: &str) {
    match &e {
        Error::Tensor { name, msg } if name == tensor && msg.contains(frag) => {}
        _ => panic!("expected Error::Tensor({tensor}) containing {frag:?}, got {e:?}"),
    }
}

#[track_caller]
fn assert_metadata(e: Error, key: &str, frag: &str) {
    match &e {
        Error::Metadata { key: k, msg } if k == key && msg.contains(frag) => {}
        _ => panic!("expected Error::Metadata({key}) containing {frag:?}, got {e:?}"),
    }
}

#[track_caller]
fn assert_unsupported(e: Error, frag: &str) {
    match &e {
        Error::Unsupported(m) if m.contains(frag) => {}
        _ => panic!("expected Error::Unsupported containing {frag:?}, got {e:?}"),
    }
}

fn patch_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Packed offsets of the valid file, by tensor index.
fn offsets(b: &Builder) -> Vec<u64> {
    Gguf::from_bytes(b.build())
        .unwrap()
        .tensors()
        .iter()
        .map(|t| t.offset)
        .collect()
}

// ---- container ----------------------------------------------------------------------------

#[test]
fn truncated_header() {
    let bytes = q1().build();
    assert_format(parse_err(bytes[..10].to_vec()), "truncated");
    assert_format(parse_err(Vec::new()), "truncated");
}

#[test]
fn truncated_in_metadata_and_in_tensor_infos() {
    let b = q1();
    let bytes = b.build();
    // Cut inside the last metadata value: the reader names the key it was reading.
    let key = b"tokenizer.ggml.eot_token_id";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4 + 2;
    let e = parse_err(bytes[..at].to_vec());
    assert_format(
        e,
        &format!(
            "truncated: tokenizer.ggml.eot_token_id needs 4 bytes at offset {}",
            at - 2
        ),
    );
    // Cut inside the token array: its count no longer fits the remaining bytes.
    let e = parse_err(bytes[..3600].to_vec());
    assert_format(
        e,
        "metadata key 'tokenizer.ggml.tokens': absurd array count 380",
    );
    // Cut so early that the declared tensor table cannot fit: refused before reading metadata.
    let e = parse_err(bytes[..200].to_vec());
    assert_format(e, "file truncated?");
    let g = Gguf::from_bytes(bytes.clone()).unwrap();
    // Cut inside the tensor-info table (just before the data section).
    let e = parse_err(bytes[..g.data_start() as usize - 40].to_vec());
    assert!(
        matches!(&e, Error::Format(m) if m.contains("truncated") || m.contains("absurd")),
        "{e}"
    );
}

#[test]
fn truncated_data_section() {
    let bytes = q1().build();
    let n = bytes.len();
    let e = parse_err(bytes[..n - 100].to_vec());
    assert_format(e, "past the end of the data section");
}

#[test]
fn bad_magic() {
    let mut bytes = q1().build();
    bytes[0..4].copy_from_slice(b"GGML");
    assert_format(parse_err(bytes), "bad magic");
}

#[test]
fn version_2_and_4_are_refused() {
    for v in [2u32, 4] {
        let mut bytes = q1().build();
        bytes[4..8].copy_from_slice(&v.to_le_bytes());
        assert_format(parse_err(bytes), &format!("unsupported GGUF version {v}"));
    }
}

#[test]
fn absurd_tensor_and_metadata_counts() {
    let mut bytes = q1().build();
    patch_u64(&mut bytes, 8, 1 << 40);
    assert_format(parse_err(bytes), "absurd tensor count");
    let mut bytes = q1().build();
    patch_u64(&mut bytes, 16, u64::MAX);
    assert_format(parse_err(bytes), "absurd metadata count");
}

#[test]
fn absurd_string_length() {
    let mut bytes = q1().build();
    patch_u64(&mut bytes, 24, 1 << 50); // the first key's length
    assert_format(parse_err(bytes), "absurd string length");
}

#[test]
fn absurd_array_count() {
    let mut b = q1();
    let mut raw = 4u32.to_le_bytes().to_vec(); // element type u32
    raw.extend_from_slice(&(u64::MAX / 2).to_le_bytes());
    b.set_raw("evil.array", 9, raw);
    assert_format(parse_err(b.build()), "absurd array count");
}

#[test]
fn bad_value_types() {
    let mut b = q1();
    b.set_raw("evil.type", 13, vec![]);
    assert_format(parse_err(b.build()), "unknown value type 13");
    let mut b = q1();
    let mut raw = 99u32.to_le_bytes().to_vec();
    raw.extend_from_slice(&1u64.to_le_bytes());
    b.set_raw("evil.elem", 9, raw);
    assert_format(parse_err(b.build()), "unknown array element type 99");
    let mut b = q1();
    b.set_raw("evil.bool", 7, vec![2]);
    assert_format(parse_err(b.build()), "bool byte 2");
}

#[test]
fn deeply_nested_arrays_are_capped() {
    let mut v = Value::Array(vec![Value::U8(1)]);
    for _ in 0..6 {
        v = Value::Array(vec![v]);
    }
    let mut b = q1();
    b.set("evil.nested", v);
    assert_format(parse_err(b.build()), "nested deeper");
}

#[test]
fn invalid_utf8_and_empty_names() {
    let mut b = q1();
    b.set_raw("k", 8, {
        let mut r = 2u64.to_le_bytes().to_vec();
        r.extend_from_slice(&[0xff, 0xfe]);
        r
    });
    assert_format(parse_err(b.build()), "not UTF-8");
    let mut b = q1();
    b.tensor_mut("output_norm.weight").name = String::new();
    assert_format(parse_err(b.build()), "name length 0");
}

#[test]
fn duplicate_keys_and_tensor_names() {
    let mut b = q1();
    b.kvs
        .push(("general.name".into(), Kv::V(Value::String("again".into()))));
    assert_format(
        parse_err(b.build()),
        "duplicate metadata key 'general.name'",
    );
    let mut b = q1();
    let mut t = b.tensors[1].clone();
    t.offset = None;
    b.tensors.push(t);
    assert_format(
        parse_err(b.build()),
        "duplicate tensor name 'output_norm.weight'",
    );
}

#[test]
fn bad_dims() {
    for (dims, frag) in [
        (vec![], "n_dims 0"),
        (vec![128, 1, 1, 1, 1], "n_dims 5"),
        (vec![256, 0], "dim 1 is zero"),
        (vec![1 << 32, 1 << 32, 1 << 32], "element count overflows"),
    ] {
        let mut b = q1();
        b.tensor_mut("output_norm.weight").dims = dims;
        assert_format(parse_err(b.build()), frag);
    }
}

#[test]
fn ne0_not_a_multiple_of_the_block() {
    let mut b = q1();
    b.tensor_mut("blk.0.ffn_up.weight").dims = vec![200, 512];
    assert_format(
        parse_err(b.build()),
        "ne0 200 is not a multiple of the Q1_0 block size 128",
    );
}

#[test]
fn offset_past_end() {
    let mut b = q1();
    b.tensors.last_mut().unwrap().offset = Some(1 << 30);
    let name = b.tensors.last().unwrap().name.clone();
    let e = parse_err(b.build());
    assert_format(e, &format!("tensor '{name}': offset 1073741824"));
}

#[test]
fn overlapping_tensors() {
    let mut b = q1();
    let off = offsets(&b);
    // Tensor 5 forced 32 bytes into tensor 4's bytes.
    b.tensors[5].offset = Some(off[4] + 32);
    assert_format(parse_err(b.build()), "overlap");
    // Two tensors at the same offset.
    let mut b = q1();
    b.tensors[7].offset = Some(off[6]);
    b.tensors[6].offset = Some(off[6]);
    assert_format(parse_err(b.build()), "both start at offset");
}

#[test]
fn misaligned_offset() {
    let mut b = q1();
    let off = offsets(&b);
    b.tensors[10].offset = Some(off[10] + 8);
    assert_format(
        parse_err(b.build()),
        "is not a multiple of the alignment 32",
    );
}

#[test]
fn bad_alignment_values() {
    for a in [0u32, 33, 1 << 30] {
        let mut b = q1();
        b.set("general.alignment", Value::U32(a));
        assert_metadata(parse_err(b.build()), "general.alignment", "power of two");
    }
    let mut b = q1();
    b.set("general.alignment", Value::String("32".into()));
    assert_metadata(
        parse_err(b.build()),
        "general.alignment",
        "expected u32, found string",
    );
}

// ---- id 42 --------------------------------------------------------------------------------

#[test]
fn id42_fits_neither_layout() {
    let mut b = tiny_target(QuantType::Q2_0G128);
    // [256, 512]: g128 = 34816 B, g64 = 36864 B; give it 34880 B (extent 34880).
    let t = b.tensor_mut("blk.0.ffn_gate.weight");
    t.data.resize(34816 + 64, 0);
    let e = parse_err(b.build());
    assert_tensor(e, "blk.0.ffn_gate.weight", "fits neither");
    let mut b = tiny_target(QuantType::Q2_0G128);
    b.tensor_mut("blk.0.ffn_gate.weight")
        .data
        .resize(34816 + 64, 0);
    let msg = parse_err(b.build()).to_string();
    assert!(
        msg.contains("34816") && msg.contains("36864") && msg.contains("34880"),
        "{msg}"
    );
}

#[test]
fn id42_tensors_disagree() {
    let mut b = tiny_target(QuantType::Q2_0G128);
    b.tensor_mut("blk.0.ffn_gate.weight").data.resize(36864, 0); // written as g64
    let e = parse_err(b.build());
    assert_tensor(e, "blk.0.ffn_gate.weight", "disagree");
    let msg = parse_err(b.build()).to_string();
    assert!(
        msg.contains("'token_embd.weight' is g128 but this tensor is g64"),
        "{msg}"
    );
}

// ---- model validation ---------------------------------------------------------------------

#[test]
fn unknown_type_on_required_tensor() {
    let mut b = q1();
    b.tensor_mut("blk.0.ffn_up.weight").ggml_type = 99;
    // Tolerated by the container parser...
    let g = Gguf::from_bytes(b.build()).unwrap();
    let t = g.tensor("blk.0.ffn_up.weight").unwrap();
    assert_eq!((t.qtype, t.n_bytes), (None, 0));
    assert!(matches!(g.tensor_data(t), Err(Error::Tensor { .. })));
    // ...refused by the model validation.
    assert_tensor(
        target_err(b.build()),
        "blk.0.ffn_up.weight",
        "unknown ggml type id 99",
    );
}

#[test]
fn missing_tensor() {
    let mut b = q1();
    b.remove_tensor("blk.1.ssm_a");
    assert_tensor(
        target_err(b.build()),
        "blk.1.ssm_a",
        "missing (expected shape [4]",
    );
    let mut b = q1();
    b.remove_tensor("blk.3.attn_k.weight");
    assert_tensor(target_err(b.build()), "blk.3.attn_k.weight", "missing");
}

#[test]
fn extra_tensor() {
    let mut b = q1();
    b.add("blk.0.mystery.weight", &[256], QuantType::F32);
    assert_tensor(
        target_err(b.build()),
        "blk.0.mystery.weight",
        "unexpected tensor",
    );
    // A layer beyond block_count is extra too.
    let mut b = q1();
    b.add("blk.8.attn_norm.weight", &[256], QuantType::F32);
    assert_tensor(
        target_err(b.build()),
        "blk.8.attn_norm.weight",
        "unexpected tensor",
    );
    // GDN-only tensors in an attention layer (kinds come from the index, not the names).
    let mut b = q1();
    b.add("blk.3.ssm_a", &[4], QuantType::F32);
    assert_tensor(target_err(b.build()), "blk.3.ssm_a", "unexpected tensor");
}

#[test]
fn mis_shaped_tensor() {
    let mut b = q1();
    b.remove_tensor("blk.2.ssm_conv1d.weight");
    b.add("blk.2.ssm_conv1d.weight", &[3, 512], QuantType::F32);
    assert_tensor(
        target_err(b.build()),
        "blk.2.ssm_conv1d.weight",
        "expected shape [4, 512], found [3, 512]",
    );
    let mut b = q1();
    b.remove_tensor("blk.7.attn_q.weight");
    b.add("blk.7.attn_q.weight", &[256, 256], QuantType::Q1_0); // q without the gate half
    assert_tensor(
        target_err(b.build()),
        "blk.7.attn_q.weight",
        "expected shape [256, 512]",
    );
}

#[test]
fn disallowed_types() {
    let mut b = q1();
    b.remove_tensor("blk.0.attn_norm.weight");
    b.add("blk.0.attn_norm.weight", &[256], QuantType::F16);
    assert_tensor(
        target_err(b.build()),
        "blk.0.attn_norm.weight",
        "expected type F32, found F16",
    );
    let mut b = tiny_target(QuantType::PQ2_0);
    b.remove_tensor("blk.0.ffn_up.weight");
    b.add("blk.0.ffn_up.weight", &[256, 512], QuantType::Q1_0);
    assert_tensor(
        target_err(b.build()),
        "blk.0.ffn_up.weight",
        "must share token_embd.weight's type",
    );
    let mut b = q1();
    b.remove_tensor("token_embd.weight");
    b.tensors.insert(
        0,
        TensorDef {
            name: "token_embd.weight".into(),
            dims: vec![256, 384],
            ggml_type: 8,
            data: gen_data(QuantType::Q8_0, &[256, 384], "e"),
            offset: None,
        },
    );
    assert_tensor(target_err(b.build()), "token_embd.weight", "found Q8_0");
}

#[test]
fn mixed_fused_and_separate_attention() {
    let mut b = q1();
    // Layer 7 fused, layer 3 separate.
    for n in ["attn_q", "attn_k", "attn_v"] {
        b.remove_tensor(&format!("blk.7.{n}.weight"));
    }
    b.add(
        "blk.7.attn_qkv.weight",
        &[256, 4 * 2 * 64 + 2 * 2 * 64],
        QuantType::Q1_0,
    );
    assert_tensor(
        target_err(b.build()),
        "blk.7.attn_qkv.weight",
        "mix fused attn_qkv and separate",
    );
}

#[test]
fn bad_hyperparameters() {
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "qwen35.ssm.inner_size",
            Value::U32(300),
            "must equal time_step_rank 4 x state_size 64",
        ),
        (
            "qwen35.attention.head_count_kv",
            Value::U32(3),
            "must divide attention.head_count 4",
        ),
        (
            "qwen35.rope.dimension_count",
            Value::U32(65),
            "must be even",
        ),
        (
            "qwen35.attention.value_length",
            Value::U32(32),
            "must equal attention.key_length 64",
        ),
        (
            "qwen35.ssm.group_count",
            Value::U32(3),
            "must divide time_step_rank",
        ),
        ("qwen35.block_count", Value::U32(1 << 30), "imply at least"),
        ("qwen35.embedding_length", Value::U32(0), "must be in 1..="),
        (
            "qwen35.attention.layer_norm_rms_epsilon",
            Value::F32(f32::NAN),
            "finite",
        ),
        (
            "qwen35.block_count",
            Value::String("64".into()),
            "found string",
        ),
        (
            "qwen35.full_attention_interval",
            Value::U32(9),
            "must be <= block_count 8",
        ),
        (
            "tokenizer.ggml.eos_token_id",
            Value::U32(384),
            "out of range of the 384 embedding rows",
        ),
    ];
    for (key, v, frag) in cases {
        let mut b = q1();
        b.set(key, v);
        assert_metadata(target_err(b.build()), key, frag);
    }
    let mut b = q1();
    b.remove_key("qwen35.ssm.state_size");
    assert_metadata(target_err(b.build()), "qwen35.ssm.state_size", "missing");
    // Header and tensor shapes disagree: a header width the tensors do not have.
    let mut b = q1();
    b.set("qwen35.feed_forward_length", Value::U32(384));
    assert_tensor(
        target_err(b.build()),
        "blk.0.ffn_gate.weight",
        "expected shape [256, 384], found [256, 512]",
    );
}

#[test]
fn wrong_architecture() {
    let mut b = q1();
    b.set("general.architecture", Value::String("llama".into()));
    assert_unsupported(
        target_err(b.build()),
        "architecture 'llama' is not supported, expected 'qwen35'",
    );
    let mut b = q1();
    b.remove_key("general.architecture");
    assert_metadata(target_err(b.build()), "general.architecture", "missing");
}

#[test]
fn drafter_passed_as_target_and_target_as_drafter() {
    let e = target_err(tiny_drafter(QuantType::Q2_0G128).build());
    assert_unsupported(e, "DSpark drafter");
    let e = target_err(tiny_drafter(QuantType::Q2_0G128).build());
    assert!(e.to_string().contains("draft="), "{e}");
    let g = Gguf::from_bytes(q1().build()).unwrap();
    assert_unsupported(
        DrafterConfig::from_gguf(&g).unwrap_err(),
        "qwen35 target model",
    );
}

#[test]
fn bonsai2_is_refused() {
    let mut b = tiny_target(QuantType::PQ2_0);
    b.tensor_mut("blk.0.ffn_up.weight").ggml_type = 143;
    b.set("general.file_type", Value::U32(141));
    let e = target_err(b.build());
    assert_unsupported(e, "Ternary-Bonsai-2");
    let mut b = tiny_target(QuantType::PQ2_0);
    b.tensor_mut("blk.0.ffn_up.weight").ggml_type = 143;
    let msg = target_err(b.build()).to_string();
    assert!(
        msg.contains("blk.0.ffn_up.weight") && msg.contains("143"),
        "{msg}"
    );
    let mut b = tiny_target(QuantType::Q1_0);
    b.set("prism.hadamard.block_size", Value::U32(128));
    assert_unsupported(target_err(b.build()), "prism.hadamard.block_size");
    // Also refused when passed as a drafter.
    let mut b = tiny_drafter(QuantType::Q1_0);
    b.set("prism.hadamard.enabled", Value::Bool(true));
    let g = Gguf::from_bytes(b.build()).unwrap();
    assert_unsupported(
        DrafterConfig::from_gguf(&g).unwrap_err(),
        "Ternary-Bonsai-2",
    );
}

// ---- drafter ------------------------------------------------------------------------------

fn drafter() -> DrafterConfig {
    DrafterConfig::from_gguf(&Gguf::from_bytes(tiny_drafter(QuantType::Q2_0G128).build()).unwrap())
        .unwrap()
}

fn target(p: &Tiny) -> TargetConfig {
    TargetConfig::from_gguf(
        &Gguf::from_bytes(tiny_target_with(p, QuantType::Q1_0).build()).unwrap(),
    )
    .unwrap()
}

#[track_caller]
fn assert_mismatch(e: Error, frag: &str) {
    match &e {
        Error::DrafterMismatch(m) if m.contains(frag) => {}
        _ => panic!("expected Error::DrafterMismatch containing {frag:?}, got {e:?}"),
    }
}

#[test]
fn drafter_width_mismatch() {
    let t = target(&Tiny {
        n_embd: 128,
        ..TINY
    });
    let e = drafter().check_against(&t).unwrap_err();
    assert_mismatch(e, "embedding_length: target has 128, drafter has 256");
}

#[test]
fn drafter_vocab_and_tap_layers_mismatch() {
    let t = target(&Tiny {
        n_vocab: 512,
        ..TINY
    });
    assert_mismatch(
        drafter().check_against(&t).unwrap_err(),
        "target has 512, drafter has 384",
    );
    let t = target(&Tiny { n_layer: 4, ..TINY });
    assert_mismatch(
        drafter().check_against(&t).unwrap_err(),
        "layer 5 is out of range of the target's 4 layers",
    );
}

#[test]
fn drafter_validation_errors() {
    let derr = |b: Builder| match Gguf::from_bytes(b.build()) {
        Err(e) => e,
        Ok(g) => DrafterConfig::from_gguf(&g).unwrap_err(),
    };
    let mut b = tiny_drafter(QuantType::Q2_0G128);
    b.remove_tensor("blk.1.ffn_down.weight");
    assert_tensor(derr(b), "blk.1.ffn_down.weight", "missing");
    let mut b = tiny_drafter(QuantType::Q2_0G128);
    b.remove_tensor("dspark.fc.weight");
    b.add("dspark.fc.weight", &[512, 256], QuantType::Q4_1); // 2 taps' width, 3 taps declared
    assert_tensor(derr(b), "dspark.fc.weight", "expected shape [768, 256]");
    let mut b = tiny_drafter(QuantType::Q2_0G128);
    b.remove_tensor("blk.0.attn_q.weight");
    b.add("blk.0.attn_q.weight", &[256, 256], QuantType::Q1_0); // low-bit trunk not allowed
    assert_tensor(derr(b), "blk.0.attn_q.weight", "expected type Q4_0, Q4_1");
    let mut b = tiny_drafter(QuantType::Q2_0G128);
    b.set("dspark.dspark.max_log_snr", Value::F32(-10.0));
    assert_metadata(derr(b), "dspark.dspark.max_log_snr", "max > min");
    let mut b = tiny_drafter(QuantType::Q2_0G128);
    b.set("dspark.dspark.mask_token_id", Value::U32(384));
    assert_metadata(
        derr(b),
        "dspark.dspark.mask_token_id",
        "must be < n_vocab 384",
    );
    let mut b = tiny_drafter(QuantType::Q2_0G128);
    b.set("dspark.vocab_size", Value::U32(248320));
    assert_metadata(
        derr(b),
        "dspark.vocab_size",
        "must equal token_embd.weight rows 384",
    );
    let mut b = tiny_drafter(QuantType::Q2_0G128);
    b.set("dspark.dspark.target_layers", Value::Array(vec![]));
    assert_metadata(derr(b), "dspark.dspark.target_layers", "must not be empty");
    let mut b = tiny_drafter(QuantType::Q2_0G128);
    b.add("dspark.extra.weight", &[256], QuantType::F32);
    assert_tensor(derr(b), "dspark.extra.weight", "unexpected tensor");
    let mut b = tiny_drafter(QuantType::Q2_0G128);
    b.set("general.architecture", Value::String("dflash".into()));
    assert_unsupported(derr(b), "dflash");
}
