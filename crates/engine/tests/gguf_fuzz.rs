//! Property test: random byte mutations and truncations of valid files never panic. Parsing,
//! validation (target and drafter), tensor reads and the inspect report return `Ok` or `Err`.
//! Bounded to run in a few seconds as part of `cargo test`.

mod common;

use std::path::Path;
use std::sync::OnceLock;

use bonsai_engine::config::{DrafterConfig, TargetConfig};
use bonsai_engine::gguf::Gguf;
use bonsai_engine::inspect::Report;
use bonsai_engine::QuantType;
use common::*;
use proptest::prelude::*;

struct Seed {
    bytes: Vec<u8>,
    /// Header + metadata + tensor infos: where mutations are interesting.
    header_len: usize,
    /// Start of the tensor-info table.
    infos_start: usize,
}

fn seeds() -> &'static [Seed] {
    static S: OnceLock<Vec<Seed>> = OnceLock::new();
    S.get_or_init(|| {
        let mk = |b: Builder| {
            let bytes = b.build();
            let g = Gguf::from_bytes(bytes.clone()).unwrap();
            Seed {
                header_len: g.data_start() as usize,
                infos_start: b.infos_start(),
                bytes,
            }
        };
        // A 4-layer target keeps each case cheap; the drafter exercises the other validator.
        let small = Tiny {
            n_layer: 4,
            n_vocab: 128,
            ..TINY
        };
        vec![
            mk(tiny_target_with(&small, QuantType::Q2_0G128)),
            mk(tiny_target_with(&small, QuantType::Q2_0G64)),
            mk(tiny_target_with(
                &Tiny {
                    fused_qkv: true,
                    ..small
                },
                QuantType::Q1_0,
            )),
            mk(tiny_drafter(QuantType::Q2_0G128)),
        ]
    })
}

#[derive(Clone, Debug)]
enum Mutation {
    /// Overwrite one byte (position as a fraction of the header).
    Byte(f64, u8),
    /// Overwrite 8 bytes with an interesting u64 (counts, lengths, dims, offsets).
    Word(f64, u64),
    /// Overwrite 4 bytes with an interesting u32 (types, n_dims, value types).
    Half(f64, u32),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let word = prop_oneof![
        Just(0u64),
        Just(1),
        Just(42),
        Just(u64::MAX),
        Just(1 << 32),
        Just(1 << 62),
        any::<u64>(),
    ];
    let half = prop_oneof![
        Just(0u32),
        Just(5),
        Just(9),
        Just(13),
        Just(42),
        Just(143),
        any::<u32>()
    ];
    prop_oneof![
        (0.0..1.0f64, any::<u8>()).prop_map(|(p, b)| Mutation::Byte(p, b)),
        (0.0..1.0f64, word).prop_map(|(p, w)| Mutation::Word(p, w)),
        (0.0..1.0f64, half).prop_map(|(p, w)| Mutation::Half(p, w)),
    ]
}

/// Everything a loader does with a file; must return, never panic.
fn exercise(bytes: Vec<u8>) {
    let Ok(g) = Gguf::from_bytes(bytes) else {
        return;
    };
    let t = TargetConfig::from_gguf(&g);
    let d = DrafterConfig::from_gguf(&g);
    if let (Ok(t), Ok(d)) = (&t, &d) {
        let _ = d.check_against(t);
    }
    if let Ok(t) = &t {
        let _ = (
            t.weight_bytes(),
            t.state_bytes(),
            t.kv_bytes_per_token(true),
            t.n_params(),
        );
    }
    for ti in g.tensors() {
        if let Ok(data) = g.tensor_data(ti) {
            assert_eq!(data.len(), ti.n_bytes);
        }
        if ti.n_bytes <= 1 << 16 {
            let _ = g.tensor_f32(&ti.name);
        }
    }
    for (k, _) in g.metadata() {
        let _ = (
            g.get_u32(k),
            g.get_f32(k),
            g.get_str_array(k),
            g.get_i32_array(k),
        );
    }
    let _ = Report::from_gguf(Path::new("fuzz.gguf"), &g).to_string();
}

proptest! {
#![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

#[test]
fn gguf_fuzz_mutations_never_panic(
    which in 0..4usize,
    infos_only in any::<bool>(),
    muts in prop::collection::vec(mutation(), 1..4),
    trunc in prop::option::weighted(0.15, 0.0..1.0f64),
) {
    let seed = &seeds()[which];
    let mut bytes = seed.bytes.clone();
    // Mutate anywhere in the header, or only in the tensor-info table (dims, types, offsets).
    let (lo, hl) = (if infos_only { seed.infos_start } else { 0 }, seed.header_len);
    let span = (hl - lo) as f64;
    let pos = |p: f64, w: usize| (lo + (p * span) as usize).min(hl - w);
    for m in &muts {
        match *m {
            Mutation::Byte(p, b) => bytes[pos(p, 1)] = b,
            Mutation::Word(p, w) => {
                let at = pos(p, 8);
                bytes[at..at + 8].copy_from_slice(&w.to_le_bytes());
            }
            Mutation::Half(p, w) => {
                let at = pos(p, 4);
                bytes[at..at + 4].copy_from_slice(&w.to_le_bytes());
            }
        }
    }
    if let Some(f) = trunc {
        // Truncate anywhere in the file (header or data).
        let n = (f * bytes.len() as f64) as usize;
        bytes.truncate(n);
    }
    exercise(bytes);
}

/// Structured edits of a valid model (shapes, types, sizes, hyperparameters): reaches the
/// model validation far more often than byte flips.
#[test]
fn gguf_fuzz_structured_edits_never_panic(
    drafter in any::<bool>(),
    edits in prop::collection::vec((any::<prop::sample::Index>(), 0..6u8, any::<prop::sample::Index>()), 1..3),
) {
    const DIMS: [u64; 9] = [1, 2, 4, 64, 100, 128, 256, 512, 1 << 31];
    const TYPES: [u32; 11] = [0, 1, 2, 3, 8, 30, 41, 42, 142, 143, 99];
    const VALS: [u32; 8] = [0, 1, 3, 4, 64, 255, 256, u32::MAX];
    let small = Tiny { n_layer: 4, n_vocab: 128, ..TINY };
    let mut b = if drafter {
        tiny_drafter(QuantType::Q2_0G128)
    } else {
        tiny_target_with(&small, QuantType::Q2_0G128)
    };
    for (ti, kind, v) in &edits {
        let i = ti.index(b.tensors.len());
        match kind {
            0 => {
                let t = &mut b.tensors[i];
                let k = v.index(t.dims.len());
                t.dims[k] = DIMS[v.index(DIMS.len())];
            }
            1 => b.tensors[i].ggml_type = TYPES[v.index(TYPES.len())],
            2 => {
                let t = &mut b.tensors[i];
                let len = t.data.len();
                t.data.resize(v.index(2 * len + 1), 7);
            }
            3 => b.tensors[i].dims.push(DIMS[v.index(DIMS.len())]),
            4 => {
                b.tensors.remove(i);
            }
            _ => {
                let key = b.kvs[v.index(b.kvs.len())].0.clone();
                b.set(&key, bonsai_engine::gguf::Value::U32(VALS[ti.index(VALS.len())]));
            }
        }
    }
    exercise(b.build());
}
}

#[test]
fn gguf_fuzz_seeds_are_valid() {
    let s = seeds();
    for seed in &s[..3] {
        let g = Gguf::from_bytes(seed.bytes.clone()).unwrap();
        TargetConfig::from_gguf(&g).unwrap();
    }
    DrafterConfig::from_gguf(&Gguf::from_bytes(s[3].bytes.clone()).unwrap()).unwrap();
}

#[test]
fn gguf_fuzz_every_truncation_of_the_header_is_an_error() {
    // Every prefix that cuts the header or tensor table must be refused, never panic.
    let seed = &seeds()[0];
    for n in 0..seed.header_len {
        assert!(
            Gguf::from_bytes(seed.bytes[..n].to_vec()).is_err(),
            "prefix {n} accepted"
        );
    }
}
