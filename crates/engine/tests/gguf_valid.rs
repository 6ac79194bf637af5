//! Valid tiny models: parsing, id-42 resolution both ways, zero-copy data, getters, configs,
//! the drafter, and `inspect`.

mod common;

use bonsai_engine::config::{DrafterConfig, TargetConfig};
use bonsai_engine::gguf::{Gguf, Value};
use bonsai_engine::inspect::{self, Validation};
use bonsai_engine::{Error, QuantType};
use common::*;

fn parse(b: &Builder) -> Gguf {
    Gguf::from_bytes(b.build()).expect("valid file parses")
}

#[test]
fn tiny_target_parses_and_validates_for_every_weight_type() {
    for wt in WEIGHT_TYPES {
        let g = parse(&tiny_target(wt));
        assert_eq!(g.version(), 3);
        assert_eq!(g.alignment(), 32);
        assert_eq!(g.data_start() % 32, 0);
        // 3 global + 6 GDN layers x 14 + 2 attention layers x 11.
        assert_eq!(g.tensors().len(), 3 + 6 * 14 + 2 * 11);
        let c = TargetConfig::from_gguf(&g).unwrap_or_else(|e| panic!("{wt:?}: {e}"));
        assert_eq!(c.weight_type, wt, "resolved weight type");
        assert_eq!(
            (
                c.n_layer,
                c.n_embd,
                c.n_ff,
                c.n_head,
                c.n_head_kv,
                c.head_dim
            ),
            (8, 256, 512, 4, 2, 64)
        );
        assert_eq!(
            (
                c.n_rot,
                c.ssm_n_group,
                c.ssm_dt_rank,
                c.ssm_d_state,
                c.ssm_inner
            ),
            (16, 2, 4, 64, 256)
        );
        assert_eq!(
            (
                c.n_vocab,
                c.n_ctx_train,
                c.full_attn_interval,
                c.ssm_conv_kernel
            ),
            (384, 8192, 4, 4)
        );
        assert_eq!(c.rms_eps, 1e-6);
        assert_eq!(c.rope_base, 1e7);
        assert_eq!(c.rope_sections, vec![3, 3, 2, 0]);
        assert!(c.has_output && !c.fused_attn_qkv);
        assert_eq!(c.eos_ids, vec![378, 379]);
        let attn: Vec<usize> = (0..8).filter(|&il| c.is_attn_layer(il)).collect();
        assert_eq!(attn, vec![3, 7]);
        assert_eq!((c.n_attn_layers(), c.n_gdn_layers()), (2, 6));
        assert_eq!(c.conv_dim(), 512);
        // 2 attention layers x (K + V) x 2 kv heads x 64 x 2 bytes.
        assert_eq!(c.kv_bytes_per_token(true), 2 * 2 * 2 * 64 * 2);
        assert_eq!(c.kv_bytes_per_token(false), 2 * 2 * 2 * 64 * 4);
        // 6 GDN layers x (4 heads x 64 x 64 + 3 x 512) x 4 bytes.
        assert_eq!(c.state_bytes(), 6 * (4 * 64 * 64 + 3 * 512) * 4);
        // The config's byte count equals the bytes the file actually holds.
        let file_bytes: u64 = g.tensors().iter().map(|t| t.n_bytes as u64).sum();
        assert_eq!(c.weight_bytes(), file_bytes);
        let params: u64 = g.tensors().iter().map(|t| t.n_elements()).sum();
        assert_eq!(c.n_params(), params);
    }
}

#[test]
fn id42_resolves_g128_and_g64_from_extents() {
    for (wt, bytes_per_row) in [(QuantType::Q2_0G128, 2 * 34), (QuantType::Q2_0G64, 4 * 18)] {
        let g = parse(&tiny_target(wt));
        let t = g.tensor("token_embd.weight").unwrap();
        assert_eq!(t.ggml_type, 42, "stored id stays 42");
        assert_eq!(t.qtype, Some(wt));
        assert_eq!(t.n_bytes, 384 * bytes_per_row);
        assert_eq!(t.row_bytes(), Some(bytes_per_row));
        // Every id-42 tensor got the same resolution, including the tiny ones (ssm_alpha [256, 4]
        // fits both layouts within the 32-byte alignment on its own).
        let alpha = g.tensor("blk.0.ssm_alpha.weight").unwrap();
        assert_eq!(alpha.qtype, Some(wt));
        assert!(g
            .tensors()
            .iter()
            .filter(|t| t.ggml_type == 42)
            .all(|t| t.qtype == Some(wt)));
    }
    // Id 142 is always g128 with no inference.
    let g = parse(&tiny_target(QuantType::PQ2_0));
    let t = g.tensor("token_embd.weight").unwrap();
    assert_eq!((t.ggml_type, t.qtype), (142, Some(QuantType::PQ2_0)));
}

#[test]
fn id42_all_ambiguous_is_refused() {
    // A single id-42 tensor small enough that g128 (272 B) and g64 (288 B) both fit 288 B.
    let mut b = Builder::default();
    b.set("general.architecture", Value::String("qwen35".into()));
    b.add("x", &[256, 4], QuantType::Q2_0G128);
    let e = Gguf::from_bytes(b.build()).unwrap_err();
    assert!(
        matches!(e, Error::Format(ref m) if m.contains("ambiguous")),
        "{e}"
    );
}

#[test]
fn extents_offsets_and_zero_copy_data() {
    let b = tiny_target(QuantType::Q1_0);
    let bytes = b.build();
    let g = Gguf::from_bytes(bytes.clone()).unwrap();
    let ts = g.tensors();
    for (i, t) in ts.iter().enumerate() {
        assert_eq!(t.offset % 32, 0);
        assert_eq!(t.name, b.tensors[i].name, "file order kept");
        let next = ts.get(i + 1).map_or(g.data_len(), |n| n.offset);
        assert_eq!(t.extent, next - t.offset);
        assert!(t.n_bytes as u64 <= t.extent && t.extent < t.n_bytes as u64 + 32);
        let d = g.tensor_data(t).unwrap();
        assert_eq!(d, &b.tensors[i].data[..], "{}", t.name);
        // Zero-copy: the slice points into the file buffer at data_start + offset.
        let base = g.bytes().as_ptr() as usize;
        assert_eq!(
            d.as_ptr() as usize - base,
            (g.data_start() + t.offset) as usize
        );
    }
    assert_eq!(g.file_len(), bytes.len() as u64);
    let norm = g.tensor_f32("output_norm.weight").unwrap();
    assert_eq!(norm.len(), 256);
    assert_eq!(norm[0], 1.0);
    assert_eq!(norm[3], 1.0 + 3.0 * 0.01);
    let t = g.tensor("blk.0.ssm_a").unwrap();
    assert_eq!((t.ne0(), t.n_rows(), t.n_elements()), (4, 1, 4));
    let t = g.tensor("blk.0.ffn_down.weight").unwrap();
    assert_eq!((t.ne0(), t.n_rows(), t.n_elements()), (512, 256, 512 * 256));
    assert!(matches!(g.tensor_f32("nope"), Err(Error::Tensor { .. })));
}

#[test]
fn tensor_f32_dequantizes_q1_0_and_q2_0_blocks() {
    let mut b = Builder::default();
    b.set("general.architecture", Value::String("test".into()));
    // Q1_0 block: d = 0.5, bits 0 and 2 set.
    let mut q1 = vec![0u8; 18];
    q1[0..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
    q1[2] = 0b101;
    b.tensors.push(TensorDef {
        name: "q1".into(),
        dims: vec![128],
        ggml_type: 41,
        data: q1,
        offset: None,
    });
    // Q2_0 g128 tensor large enough to resolve: [2048, 2] (S128 = 1088, S64 = 1152).
    let mut q2 = vec![0x55u8; 2048 / 128 * 34 * 2]; // every code 1 -> 0
    q2[0..2].copy_from_slice(&half::f16::from_f32(2.0).to_bits().to_le_bytes());
    q2[2] = 0b11_10_01_00; // codes 0,1,2,3 -> -2, 0, 2, 4
    b.tensors.push(TensorDef {
        name: "q2".into(),
        dims: vec![2048, 2],
        ggml_type: 42,
        data: q2,
        offset: None,
    });
    let g = Gguf::from_bytes(b.build()).unwrap();
    let v = g.tensor_f32("q1").unwrap();
    assert_eq!(&v[0..4], &[0.5, -0.5, 0.5, -0.5]);
    assert_eq!(g.tensor("q2").unwrap().qtype, Some(QuantType::Q2_0G128));
    let v = g.tensor_f32("q2").unwrap();
    assert_eq!(v.len(), 4096);
    assert_eq!(&v[0..5], &[-2.0, 0.0, 2.0, 4.0, 0.0]);
}

#[test]
fn tied_output_and_fused_attention_qkv_are_accepted() {
    let p = Tiny {
        output: false,
        ..TINY
    };
    let c = TargetConfig::from_gguf(&parse(&tiny_target_with(&p, QuantType::Q1_0))).unwrap();
    assert!(!c.has_output);
    let p = Tiny {
        fused_qkv: true,
        ..TINY
    };
    let g = parse(&tiny_target_with(&p, QuantType::Q2_0G64));
    let c = TargetConfig::from_gguf(&g).unwrap();
    assert!(c.fused_attn_qkv);
    assert_eq!(
        g.tensor("blk.3.attn_qkv.weight").unwrap().dims,
        vec![256, 4 * 2 * 64 + 2 * 2 * 64]
    );
    // Same name, GDN layer: the GDN projection [n_embd, conv_dim].
    assert_eq!(
        g.tensor("blk.0.attn_qkv.weight").unwrap().dims,
        vec![256, 512]
    );
}

#[test]
fn optional_interval_defaults_to_4_and_custom_interval_changes_layer_kinds() {
    let mut b = tiny_target(QuantType::Q1_0);
    b.remove_key("qwen35.full_attention_interval");
    assert_eq!(
        TargetConfig::from_gguf(&parse(&b))
            .unwrap()
            .full_attn_interval,
        4
    );
    let p = Tiny {
        interval: 2,
        ..TINY
    };
    let mut b = tiny_target_with(&p, QuantType::Q1_0);
    b.set("qwen35.full_attention_interval", Value::U32(2));
    let c = TargetConfig::from_gguf(&parse(&b)).unwrap();
    assert_eq!(
        (0..8).filter(|&il| c.is_attn_layer(il)).collect::<Vec<_>>(),
        vec![1, 3, 5, 7]
    );
}

#[test]
fn metadata_values_of_every_type_and_getters() {
    let mut b = Builder::default();
    let all = vec![
        ("u8", Value::U8(200)),
        ("i8", Value::I8(-5)),
        ("u16", Value::U16(60000)),
        ("i16", Value::I16(-300)),
        ("u32", Value::U32(4_000_000_000)),
        ("i32", Value::I32(7)),
        ("f32", Value::F32(0.25)),
        ("bool", Value::Bool(true)),
        ("str", Value::String("héllo".into())),
        ("u64", Value::U64(1 << 40)),
        ("i64", Value::I64(-1)),
        ("f64", Value::F64(1e-300)),
        ("arr_i32", Value::Array(vec![Value::I32(-1), Value::I32(2)])),
        (
            "arr_str",
            Value::Array(vec![Value::String("a".into()), Value::String("b c".into())]),
        ),
        (
            "nested",
            Value::Array(vec![
                Value::Array(vec![Value::U8(1)]),
                Value::Array(vec![Value::U8(2), Value::U8(3)]),
            ]),
        ),
        ("empty", Value::Array(vec![])),
    ];
    for (k, v) in &all {
        b.set(k, v.clone());
    }
    let g = parse(&b);
    assert_eq!(g.metadata().len(), all.len());
    for ((k, v), (k2, v2)) in g.metadata().iter().zip(&all) {
        assert_eq!((k.as_str(), v), (*k2, v2), "round trip in file order");
    }
    assert_eq!(g.get_u32("u8").unwrap(), 200);
    assert_eq!(g.get_u32("i32").unwrap(), 7, "any integer that fits");
    assert_eq!(g.get_u64("u64").unwrap(), 1 << 40);
    assert_eq!(g.get_f32("f32").unwrap(), 0.25);
    assert_eq!(g.get_f32("i32").unwrap(), 7.0);
    assert!(g.get_bool("bool").unwrap());
    assert_eq!(g.get_str("str").unwrap(), "héllo");
    assert_eq!(g.get_i32_array("arr_i32").unwrap(), vec![-1, 2]);
    assert_eq!(g.get_str_array("arr_str").unwrap(), vec!["a", "b c"]);
    assert_eq!(
        g.get_array("nested").unwrap()[1].as_array().unwrap().len(),
        2
    );
    assert!(g.get_array("empty").unwrap().is_empty());
    assert_eq!(g.get("i64").unwrap().as_i64(), Some(-1));

    let e = g.get_u32("str").unwrap_err();
    assert!(
        matches!(&e, Error::Metadata { key, msg } if key == "str" && msg.contains("found string")),
        "{e}"
    );
    let e = g.get_u32("i8").unwrap_err();
    assert!(
        matches!(&e, Error::Metadata { key, .. } if key == "i8"),
        "{e}"
    );
    let e = g.get_u32("u64").unwrap_err();
    assert!(e.to_string().contains("does not fit in u32"), "{e}");
    let e = g.get_u32_array("arr_i32").unwrap_err();
    assert!(e.to_string().contains("element 0"), "{e}");
    let e = g.get_str("absent").unwrap_err();
    assert!(
        matches!(&e, Error::Metadata { key, msg } if key == "absent" && msg == "missing"),
        "{e}"
    );
    let e = g.get_bool("u8").unwrap_err();
    assert!(e.to_string().contains("expected bool, found u8"), "{e}");
}

#[test]
fn custom_alignment_is_honoured() {
    let mut b = tiny_target(QuantType::Q2_0G64);
    b.alignment = 64;
    b.set("general.alignment", Value::U32(64));
    let g = parse(&b);
    assert_eq!(g.alignment(), 64);
    assert_eq!(g.data_start() % 64, 0);
    assert!(g.tensors().iter().all(|t| t.offset % 64 == 0));
    assert_eq!(
        TargetConfig::from_gguf(&g).unwrap().weight_type,
        QuantType::Q2_0G64
    );
}

#[test]
fn drafter_parses_validates_and_fits_target() {
    // The ternary drafter's token_embd is id 42 g128 even next to a g64 target (per-file rule).
    let t = TargetConfig::from_gguf(&parse(&tiny_target(QuantType::Q2_0G64))).unwrap();
    for embd in [QuantType::Q2_0G128, QuantType::Q1_0, QuantType::Q4_1] {
        let g = parse(&tiny_drafter(embd));
        assert_eq!(g.tensors().len(), 13 + 11 * D_LAYERS as usize);
        let d = DrafterConfig::from_gguf(&g).unwrap_or_else(|e| panic!("{embd:?}: {e}"));
        assert_eq!(d.embd_type, embd);
        assert_eq!(d.output_type, QuantType::Q4_1);
        assert_eq!(
            (
                d.n_layer,
                d.n_embd,
                d.n_head,
                d.n_head_kv,
                d.head_dim,
                d.n_ff
            ),
            (2, 256, 4, 2, 64, 256)
        );
        assert_eq!(
            (d.n_vocab, d.block_size, d.mask_token_id, d.markov_rank),
            (384, 4, 383, 32)
        );
        assert_eq!(d.target_layers, vec![1, 3, 5]);
        assert_eq!((d.min_log_snr, d.max_log_snr), (-9.0, 9.0));
        assert!(d.confidence_head && d.confidence_head_with_markov && d.log_snr_conditioning);
        assert_eq!(d.log_snr_dim, 128);
        assert_eq!(d.confidence_in_dim, Some(256 + 32));
        assert_eq!(d.n_ctx_train, 4096);
        assert_eq!(d.kv_bytes_per_token(true), 2 * 2 * 2 * 64 * 2);
        d.check_against(&t).unwrap();
    }
    // Without the confidence head tensors (optional) it still validates.
    let mut b = tiny_drafter(QuantType::Q2_0G128);
    b.remove_tensor("dspark.confidence_head.weight")
        .remove_tensor("dspark.confidence_head.bias");
    assert_eq!(
        DrafterConfig::from_gguf(&parse(&b))
            .unwrap()
            .confidence_in_dim,
        None
    );
}

#[test]
fn open_from_disk_and_inspect() {
    let dir = std::env::temp_dir().join(format!("bonsai-gguf-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("tiny.gguf");
    std::fs::write(&good, tiny_target(QuantType::Q2_0G128).build()).unwrap();
    let g = Gguf::open(&good).unwrap();
    assert_eq!(
        TargetConfig::from_gguf(&g).unwrap().weight_type,
        QuantType::Q2_0G128
    );
    // prefaulting (the drafter's embedding) leaves the mapped bytes as they were, and a slice
    // from outside the map or an empty one is ignored
    let before = g.bytes().to_vec();
    let t = g
        .tensors()
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .unwrap();
    g.prefault(g.tensor_data(t).unwrap());
    g.prefault(g.bytes());
    g.prefault(&before[..100]);
    g.prefault(&[]);
    assert_eq!(g.bytes(), &before[..]);

    let rep = inspect::report(&good).unwrap();
    assert_eq!(rep.architecture.as_deref(), Some("qwen35"));
    assert_eq!(rep.n_tensors, 109);
    assert!(rep.is_valid());
    assert!(matches!(rep.validation, Validation::Target(_)));
    let q2 = rep
        .types
        .iter()
        .find(|s| s.type_name == "Q2_0(g128)")
        .unwrap();
    let f32s = rep.types.iter().find(|s| s.type_name == "F32").unwrap();
    assert_eq!(q2.count + f32s.count, 109);
    assert_eq!(
        rep.memory.iter().map(|m| m.n_ctx).collect::<Vec<_>>(),
        vec![4096, 8192, 32768]
    );
    let m = &rep.memory[0];
    assert_eq!(m.kv_bytes, 4096 * 1024);
    assert_eq!(m.state_bytes, 6 * (4 * 64 * 64 + 3 * 512) * 4);
    let text = inspect::inspect(&good).unwrap();
    assert!(text.contains("validation:   OK"), "{text}");
    assert!(
        text.contains("Q2_0(g128)") && text.contains("qwen35.block_count"),
        "{text}"
    );

    // An invalid model is reported, not an error.
    let mut b = tiny_target(QuantType::Q1_0);
    b.remove_tensor("blk.2.ssm_norm.weight");
    let bad = dir.join("bad.gguf");
    std::fs::write(&bad, b.build()).unwrap();
    let text = inspect::inspect(&bad).unwrap();
    assert!(
        text.contains("FAILED (tensor)") && text.contains("blk.2.ssm_norm.weight"),
        "{text}"
    );
    // A drafter is inspected as a drafter.
    let dr = dir.join("draft.gguf");
    std::fs::write(&dr, tiny_drafter(QuantType::Q2_0G128).build()).unwrap();
    let rep = inspect::report(&dr).unwrap();
    assert!(
        matches!(rep.validation, Validation::Drafter(_)),
        "{:?}",
        rep.validation
    );

    // An unreadable container is an error: garbage bytes, an empty file, a missing path.
    let junk = dir.join("junk.gguf");
    std::fs::write(&junk, b"not a gguf file at all, definitely not").unwrap();
    let e = inspect::inspect(&junk).unwrap_err();
    assert!(
        matches!(&e, Error::Format(m) if m.contains("bad magic") && m.contains("junk.gguf")),
        "{e}"
    );
    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(Gguf::open(&empty), Err(Error::Format(m)) if m.contains("truncated")));
    let e = Gguf::open(&dir.join("missing.gguf")).unwrap_err();
    assert!(
        matches!(&e, Error::Io { path, .. } if path.ends_with("missing.gguf")),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
