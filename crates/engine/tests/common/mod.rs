//! Test-only GGUF byte builder and tiny synthetic `qwen35` / `dspark` models in the real on-disk
//! layout (names, types, metadata). Data bytes are deterministic pseudo-random blocks with a sane
//! f16 scale; F32 tensors hold values near 1.
#![allow(dead_code)]

use bonsai_engine::gguf::Value;
use bonsai_engine::QuantType;

/// One metadata entry: a typed value, or raw bytes after an arbitrary value-type id (corruption).
#[derive(Clone, Debug)]
pub enum Kv {
    V(Value),
    Raw { type_id: u32, bytes: Vec<u8> },
}

#[derive(Clone, Debug)]
pub struct TensorDef {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub data: Vec<u8>,
    /// Force this offset (relative to the data section) instead of the packed one.
    pub offset: Option<u64>,
}

#[derive(Clone, Debug)]
pub struct Builder {
    pub magic: [u8; 4],
    pub version: u32,
    pub alignment: u64,
    pub kvs: Vec<(String, Kv)>,
    pub tensors: Vec<TensorDef>,
}

fn wstr(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Encode a value's payload (without its type id).
pub fn encode_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => wstr(out, s),
        Value::Array(a) => {
            // Element type of an empty array: u8.
            let et = a.first().map_or(0, |e| e.type_id());
            out.extend_from_slice(&et.to_le_bytes());
            out.extend_from_slice(&(a.len() as u64).to_le_bytes());
            for e in a {
                encode_value(out, e);
            }
        }
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

fn round_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

impl Default for Builder {
    fn default() -> Self {
        Builder {
            magic: *b"GGUF",
            version: 3,
            alignment: 32,
            kvs: Vec::new(),
            tensors: Vec::new(),
        }
    }
}

impl Builder {
    pub fn set(&mut self, key: &str, v: Value) -> &mut Self {
        match self.kvs.iter_mut().find(|(k, _)| k == key) {
            Some(e) => e.1 = Kv::V(v),
            None => self.kvs.push((key.to_string(), Kv::V(v))),
        }
        self
    }
    pub fn set_raw(&mut self, key: &str, type_id: u32, bytes: Vec<u8>) -> &mut Self {
        self.kvs.retain(|(k, _)| k != key);
        self.kvs.push((key.to_string(), Kv::Raw { type_id, bytes }));
        self
    }
    pub fn remove_key(&mut self, key: &str) -> &mut Self {
        self.kvs.retain(|(k, _)| k != key);
        self
    }
    pub fn tensor_mut(&mut self, name: &str) -> &mut TensorDef {
        self.tensors
            .iter_mut()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }
    pub fn remove_tensor(&mut self, name: &str) -> &mut Self {
        let n = self.tensors.len();
        self.tensors.retain(|t| t.name != name);
        assert_eq!(self.tensors.len() + 1, n, "no tensor {name}");
        self
    }
    /// Add a tensor of a known type with generated data.
    pub fn add(&mut self, name: &str, dims: &[u64], qt: QuantType) -> &mut Self {
        let data = gen_data(qt, dims, name);
        self.tensors.push(TensorDef {
            name: name.into(),
            dims: dims.to_vec(),
            ggml_type: qt.ggml_id(),
            data,
            offset: None,
        });
        self
    }

    /// Header and metadata bytes.
    fn build_head(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&self.magic);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            wstr(&mut out, k);
            match v {
                Kv::V(v) => {
                    out.extend_from_slice(&v.type_id().to_le_bytes());
                    encode_value(&mut out, v);
                }
                Kv::Raw { type_id, bytes } => {
                    out.extend_from_slice(&type_id.to_le_bytes());
                    out.extend_from_slice(bytes);
                }
            }
        }
        out
    }

    /// Byte offset where the tensor-info table starts.
    pub fn infos_start(&self) -> usize {
        self.build_head().len()
    }

    /// Serialize. Tensors are packed in order at aligned offsets unless `offset` is forced; forced
    /// offsets outside the packed data region get no data written.
    pub fn build(&self) -> Vec<u8> {
        let mut out = self.build_head();
        let a = self.alignment;
        let mut offsets = Vec::new();
        let mut running = 0u64;
        for t in &self.tensors {
            let off = match t.offset {
                Some(o) => o,
                None => {
                    let o = running;
                    running = round_up(o + t.data.len() as u64, a);
                    o
                }
            };
            offsets.push(off);
        }
        for (t, off) in self.tensors.iter().zip(&offsets) {
            wstr(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.to_le_bytes());
            out.extend_from_slice(&off.to_le_bytes());
        }
        let data_start = round_up(out.len() as u64, a) as usize;
        out.resize(data_start + running as usize, 0);
        for (t, &off) in self.tensors.iter().zip(&offsets) {
            let start = data_start + off as usize;
            if off >= running {
                continue;
            }
            let end = (start + t.data.len()).min(out.len());
            let n = end - start;
            out[start..end].copy_from_slice(&t.data[..n]);
        }
        out
    }
}

/// Deterministic pseudo-random bytes (xorshift), seeded by the name.
pub fn prng_bytes(seed: &str, n: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for b in seed.bytes() {
        x = (x ^ b as u64).wrapping_mul(0x100_0000_01B3);
    }
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(n);
    out
}

/// Data for a tensor: F32 near 1.0, F16/BF16 small values, blocked types random codes with a
/// sane f16 scale at the start of every block.
pub fn gen_data(qt: QuantType, dims: &[u64], seed: &str) -> Vec<u8> {
    let n: u64 = dims.iter().product();
    let rows: u64 = dims[1..].iter().product();
    let len = qt
        .row_bytes(dims[0] as usize)
        .expect("ne0 multiple of block")
        * rows as usize;
    let mut b = prng_bytes(seed, len);
    match qt {
        QuantType::F32 => {
            for (i, c) in b.chunks_exact_mut(4).enumerate() {
                c.copy_from_slice(&(1.0 + (i % 7) as f32 * 0.01).to_le_bytes());
            }
        }
        QuantType::F16 | QuantType::BF16 => {
            for c in b.chunks_exact_mut(2) {
                c.copy_from_slice(&0x3C00u16.to_le_bytes());
            }
        }
        _ => {
            let scale = half::f16::from_f32(0.02).to_bits().to_le_bytes();
            let bb = qt.block_bytes();
            for blk in b.chunks_exact_mut(bb) {
                blk[0..2].copy_from_slice(&scale);
                if qt == QuantType::Q4_1 {
                    blk[2..4].copy_from_slice(&scale);
                }
            }
        }
    }
    assert_eq!(n as usize % qt.block_elems(), 0);
    b
}

/// Hyperparameters of the tiny target.
#[derive(Clone, Debug)]
pub struct Tiny {
    pub n_embd: u64,
    pub n_layer: u64,
    pub interval: u64,
    pub n_ff: u64,
    pub n_head: u64,
    pub n_head_kv: u64,
    pub head_dim: u64,
    pub n_rot: u64,
    pub h_k: u64,
    pub h_v: u64,
    pub d_state: u64,
    pub inner: u64,
    pub n_vocab: u64,
    pub conv_kernel: u64,
    pub fused_qkv: bool,
    pub output: bool,
}

pub const TINY: Tiny = Tiny {
    n_embd: 256,
    n_layer: 8,
    interval: 4,
    n_ff: 512,
    n_head: 4,
    n_head_kv: 2,
    head_dim: 64,
    n_rot: 16,
    h_k: 2,
    h_v: 4,
    d_state: 64,
    inner: 256,
    n_vocab: 384,
    conv_kernel: 4,
    fused_qkv: false,
    output: true,
};

fn s(x: &str) -> Value {
    Value::String(x.into())
}

/// A complete, valid tiny `qwen35` model with low-bit type `wt`.
pub fn tiny_target_with(p: &Tiny, wt: QuantType) -> Builder {
    let mut b = Builder::default();
    let a = "qwen35";
    b.set("general.architecture", s(a));
    b.set("general.name", s("tiny-bonsai"));
    b.set(&format!("{a}.block_count"), Value::U32(p.n_layer as u32));
    b.set(&format!("{a}.context_length"), Value::U32(8192));
    b.set(
        &format!("{a}.embedding_length"),
        Value::U32(p.n_embd as u32),
    );
    b.set(
        &format!("{a}.feed_forward_length"),
        Value::U32(p.n_ff as u32),
    );
    b.set(
        &format!("{a}.attention.head_count"),
        Value::U32(p.n_head as u32),
    );
    b.set(
        &format!("{a}.attention.head_count_kv"),
        Value::U32(p.n_head_kv as u32),
    );
    b.set(
        &format!("{a}.attention.key_length"),
        Value::U32(p.head_dim as u32),
    );
    b.set(
        &format!("{a}.attention.value_length"),
        Value::U32(p.head_dim as u32),
    );
    b.set(
        &format!("{a}.attention.layer_norm_rms_epsilon"),
        Value::F32(1e-6),
    );
    b.set(&format!("{a}.rope.freq_base"), Value::F32(1e7));
    b.set(
        &format!("{a}.rope.dimension_count"),
        Value::U32(p.n_rot as u32),
    );
    b.set(
        &format!("{a}.rope.dimension_sections"),
        Value::Array(vec![
            Value::I32(3),
            Value::I32(3),
            Value::I32(2),
            Value::I32(0),
        ]),
    );
    b.set(
        &format!("{a}.full_attention_interval"),
        Value::U32(p.interval as u32),
    );
    b.set(
        &format!("{a}.ssm.conv_kernel"),
        Value::U32(p.conv_kernel as u32),
    );
    b.set(&format!("{a}.ssm.state_size"), Value::U32(p.d_state as u32));
    b.set(&format!("{a}.ssm.group_count"), Value::U32(p.h_k as u32));
    b.set(&format!("{a}.ssm.time_step_rank"), Value::U32(p.h_v as u32));
    b.set(&format!("{a}.ssm.inner_size"), Value::U32(p.inner as u32));
    b.set("tokenizer.ggml.model", s("gpt2"));
    b.set("tokenizer.ggml.pre", s("qwen35"));
    let n_tok = p.n_vocab - 4; // a few padding rows, as in the real file
    b.set(
        "tokenizer.ggml.tokens",
        Value::Array((0..n_tok).map(|i| s(&format!("t{i}"))).collect()),
    );
    b.set(
        "tokenizer.ggml.token_type",
        Value::Array((0..n_tok).map(|_| Value::I32(1)).collect()),
    );
    b.set("tokenizer.ggml.eos_token_id", Value::U32(n_tok as u32 - 2));
    b.set("tokenizer.ggml.eot_token_id", Value::U32(n_tok as u32 - 1));

    let (e, v, hd) = (p.n_embd, p.n_vocab, p.head_dim);
    let conv_dim = 2 * p.h_k * p.d_state + p.inner;
    let f = QuantType::F32;
    b.add("token_embd.weight", &[e, v], wt);
    b.add("output_norm.weight", &[e], f);
    if p.output {
        b.add("output.weight", &[e, v], wt);
    }
    for il in 0..p.n_layer {
        let n = |x: &str| format!("blk.{il}.{x}");
        b.add(&n("attn_norm.weight"), &[e], f);
        if (il + 1) % p.interval == 0 {
            if p.fused_qkv {
                let rows = p.n_head * 2 * hd + 2 * p.n_head_kv * hd;
                b.add(&n("attn_qkv.weight"), &[e, rows], wt);
            } else {
                b.add(&n("attn_q.weight"), &[e, p.n_head * 2 * hd], wt);
                b.add(&n("attn_k.weight"), &[e, p.n_head_kv * hd], wt);
                b.add(&n("attn_v.weight"), &[e, p.n_head_kv * hd], wt);
            }
            b.add(&n("attn_q_norm.weight"), &[hd], f);
            b.add(&n("attn_k_norm.weight"), &[hd], f);
            b.add(&n("attn_output.weight"), &[p.n_head * hd, e], wt);
        } else {
            b.add(&n("attn_qkv.weight"), &[e, conv_dim], wt);
            b.add(&n("attn_gate.weight"), &[e, p.inner], wt);
            b.add(&n("ssm_beta.weight"), &[e, p.h_v], wt);
            b.add(&n("ssm_alpha.weight"), &[e, p.h_v], wt);
            b.add(&n("ssm_conv1d.weight"), &[p.conv_kernel, conv_dim], f);
            b.add(&n("ssm_dt.bias"), &[p.h_v], f);
            b.add(&n("ssm_a"), &[p.h_v], f);
            // -exp(A_log) < 0, as in a trained model: each step's decay exp(a · softplus(…)) stays
            // below 1 (0.77–0.97 here). The generic F32 fill (~1.0) made it grow ~3.7× a step, so
            // the recurrent state overflowed to NaN after ~70 positions, and the int8 activation
            // quantizer, which maps NaN to 0, hid that from the logits.
            b.tensor_mut(&n("ssm_a")).data = (0..p.h_v)
                .flat_map(|i| (-(0.02 + 0.03 * (i % 7) as f32)).to_le_bytes())
                .collect();
            b.add(&n("ssm_norm.weight"), &[p.d_state], f);
            b.add(&n("ssm_out.weight"), &[p.inner, e], wt);
        }
        b.add(&n("post_attention_norm.weight"), &[e], f);
        b.add(&n("ffn_gate.weight"), &[e, p.n_ff], wt);
        b.add(&n("ffn_up.weight"), &[e, p.n_ff], wt);
        b.add(&n("ffn_down.weight"), &[p.n_ff, e], wt);
    }
    b
}

pub fn tiny_target(wt: QuantType) -> Builder {
    tiny_target_with(&TINY, wt)
}

/// The kernels of a GDN layer's conv, recurrence and gated norm in every `GdnFused` mode (the
/// launch what-if benchmarks drop them together).
pub const GDN_DECODE_KERNELS: [&str; 7] = [
    "gdn_conv",
    "gdn_step",
    "gated_norm_quant",
    "gdn_conv_step",
    "gdn_conv_step_norm_d128",
    "gdn_conv_step_norm_early_d128",
    "gdn_conv_step_norm_p16_d128",
];

/// The same for verify rows: the snapshot-writing and batched-norm fused kernels, and the record
/// writer of the unfused record path.
pub const GDN_VERIFY_KERNELS: [&str; 4] = [
    "gdn_conv_step_norm_snap_d128",
    "gdn_conv_step_norm_bn_d128",
    "gdn_conv_step_norm_bn_early_d128",
    "gdn_rec_write",
];

/// The 27B decode attention kernels (the launch what-if benchmarks drop them together).
pub const ATTN_DECODE_KERNELS: [&str; 3] = ["attn_prep", "attn_chunks_hd256", "attn_merge_quant"];

/// Tiny drafter geometry.
pub const D_LAYERS: u64 = 2;
pub const D_TAPS: [u32; 3] = [1, 3, 5];
pub const D_RANK: u64 = 32;

/// A complete, valid tiny `dspark` drafter for [`TINY`], with `token_embd` of type `embd`.
pub fn tiny_drafter(embd: QuantType) -> Builder {
    let mut b = Builder::default();
    let a = "dspark";
    let (e, v, hd, nh, nkv, ff) = (TINY.n_embd, TINY.n_vocab, 64u64, 4u64, 2u64, 256u64);
    b.set("general.architecture", s(a));
    b.set(&format!("{a}.block_count"), Value::U32(D_LAYERS as u32));
    b.set(&format!("{a}.embedding_length"), Value::U32(e as u32));
    b.set(&format!("{a}.attention.head_count"), Value::U32(nh as u32));
    b.set(
        &format!("{a}.attention.head_count_kv"),
        Value::U32(nkv as u32),
    );
    b.set(&format!("{a}.attention.key_length"), Value::U32(hd as u32));
    b.set(
        &format!("{a}.attention.value_length"),
        Value::U32(hd as u32),
    );
    b.set(&format!("{a}.feed_forward_length"), Value::U32(ff as u32));
    b.set(&format!("{a}.rope.freq_base"), Value::F32(1e7));
    b.set(
        &format!("{a}.attention.layer_norm_rms_epsilon"),
        Value::F32(1e-6),
    );
    b.set(&format!("{a}.context_length"), Value::U32(4096));
    b.set(&format!("{a}.vocab_size"), Value::U32(v as u32));
    b.set(&format!("{a}.{a}.block_size"), Value::U32(4));
    b.set(&format!("{a}.{a}.mask_token_id"), Value::U32(v as u32 - 1));
    b.set(
        &format!("{a}.{a}.target_layers"),
        Value::Array(D_TAPS.iter().map(|&x| Value::U32(x)).collect()),
    );
    b.set(&format!("{a}.{a}.markov_rank"), Value::U32(D_RANK as u32));
    b.set(&format!("{a}.{a}.confidence_head"), Value::Bool(true));
    b.set(
        &format!("{a}.{a}.confidence_head_with_markov"),
        Value::Bool(true),
    );
    b.set(&format!("{a}.{a}.log_snr_conditioning"), Value::Bool(true));
    b.set(&format!("{a}.{a}.min_log_snr"), Value::F32(-9.0));
    b.set(&format!("{a}.{a}.max_log_snr"), Value::F32(9.0));
    b.set("tokenizer.ggml.model", s("none"));

    let (f, q41, bf) = (QuantType::F32, QuantType::Q4_1, QuantType::BF16);
    b.add("token_embd.weight", &[e, v], embd);
    b.add("output.weight", &[e, v], q41);
    b.add("output_norm.weight", &[e], f);
    b.add("dspark.fc.weight", &[D_TAPS.len() as u64 * e, e], q41);
    b.add("dspark.hidden_norm.weight", &[e], f);
    b.add("dspark.log_snr_fc1.weight", &[128, e], bf);
    b.add("dspark.log_snr_fc1.bias", &[e], f);
    b.add("dspark.log_snr_fc2.weight", &[e, e], bf);
    b.add("dspark.log_snr_fc2.bias", &[e], f);
    b.add("dspark.markov_head_a.weight", &[D_RANK, v], bf);
    b.add("dspark.markov_head_b.weight", &[D_RANK, v], bf);
    b.add("dspark.confidence_head.weight", &[e + D_RANK, 1], bf);
    b.add("dspark.confidence_head.bias", &[1], f);
    for il in 0..D_LAYERS {
        let n = |x: &str| format!("blk.{il}.{x}");
        b.add(&n("attn_norm.weight"), &[e], f);
        b.add(&n("ffn_norm.weight"), &[e], f);
        b.add(&n("attn_q.weight"), &[e, nh * hd], q41);
        b.add(&n("attn_k.weight"), &[e, nkv * hd], q41);
        b.add(&n("attn_v.weight"), &[e, nkv * hd], q41);
        b.add(&n("attn_output.weight"), &[nh * hd, e], q41);
        b.add(&n("attn_q_norm.weight"), &[hd], f);
        b.add(&n("attn_k_norm.weight"), &[hd], f);
        b.add(&n("ffn_gate.weight"), &[e, ff], q41);
        b.add(&n("ffn_up.weight"), &[e, ff], q41);
        b.add(&n("ffn_down.weight"), &[ff, e], q41);
    }
    b
}

/// The four target weight formats.
pub const WEIGHT_TYPES: [QuantType; 4] = [
    QuantType::Q1_0,
    QuantType::Q2_0G128,
    QuantType::Q2_0G64,
    QuantType::PQ2_0,
];

/// The target's projection matrices grouped as the CUDA backend launches them for one token (one
/// entry per launch: matrices sharing an input go together), by category, plus single-matrix
/// `_alone` categories when `alone`. For the mat-vec benchmarks.
pub fn mat_categories<B: bonsai_engine::backend::Backend>(
    w: &bonsai_engine::model::Weights<B>,
    alone: bool,
) -> Vec<(&'static str, Vec<Vec<&B::Mat>>)> {
    use bonsai_engine::model::Mixer;
    let mut cats: Vec<(&'static str, Vec<Vec<&B::Mat>>)> = vec![
        ("gdn_in(qkv|z|b|a)", vec![]),
        ("gdn_qkv_alone", vec![]),
        ("ssm_out", vec![]),
        ("attn_in(q|k|v)", vec![]),
        ("attn_out", vec![]),
        ("ffn_gate|up", vec![]),
        ("ffn_gate_alone", vec![]),
        ("ffn_down", vec![]),
        ("head", vec![vec![w.head_mat()]]),
    ];
    for l in &w.layers {
        match &l.mixer {
            Mixer::Gdn(x) => {
                cats[0].1.push(vec![&x.qkv, &x.gate, &x.beta, &x.alpha]);
                cats[1].1.push(vec![&x.qkv]);
                cats[2].1.push(vec![&x.ssm_out]);
            }
            Mixer::Attn(x) => {
                cats[3].1.push(vec![&x.q, &x.k, &x.v]);
                cats[4].1.push(vec![&x.out]);
            }
        }
        cats[5].1.push(vec![&l.mlp.gate, &l.mlp.up]);
        cats[6].1.push(vec![&l.mlp.gate]);
        cats[7].1.push(vec![&l.mlp.down]);
    }
    cats.retain(|(n, _)| alone || !n.ends_with("_alone"));
    cats
}

/// Run one request on `e` to the end: the token ids and the usage (panics on an engine error).
pub fn complete(
    e: &bonsai_engine::engine::Engine,
    pr: &[u32],
    n: usize,
    params: &bonsai_engine::sampling::SamplerParams,
) -> (Vec<u32>, bonsai_engine::engine::Usage) {
    let (toks, usage) = complete_with_logprobs(e, pr, n, params);
    (toks.into_iter().map(|t| t.0).collect(), usage)
}

/// The tests' seeded sampling: temperature 0.8, top-k 8, top-p 0.95.
pub fn sampled(seed: u64) -> bonsai_engine::sampling::SamplerParams {
    bonsai_engine::sampling::SamplerParams {
        temperature: 0.8,
        top_k: 8,
        top_p: 0.95,
        seed,
        ..Default::default()
    }
}

/// An engine on `device` that drafts every step it can (with `draft`), with `prefill_chunk` rows
/// per prefill forward and a context of four chunks; panics if it lands on another device.
pub fn chunked_engine(
    path: &std::path::Path,
    device: &str,
    draft: Option<bonsai_engine::engine::DraftSource>,
    rollback: bonsai_engine::spec::Rollback,
    kv_type: bonsai_engine::backend::KvType,
    prefill_chunk: usize,
    // the prompt cache with this many stashed lineages (`None`: off)
    cache: Option<usize>,
) -> bonsai_engine::engine::Engine {
    let opts = bonsai_engine::engine::EngineOptions {
        n_ctx: Some(4 * prefill_chunk),
        threads: Some(2),
        device: device.into(),
        draft,
        speculative: bonsai_engine::spec::PolicyMode::Always,
        rollback,
        kv_type,
        prompt_cache: cache.is_some(),
        prompt_cache_entries: cache.unwrap_or(0),
        prefill_chunk,
    };
    let e = bonsai_engine::engine::Engine::load(path, &opts).unwrap();
    assert!(
        e.info().device.starts_with(device),
        "device {}",
        e.info().device
    );
    e
}

/// Normalized mean squared error of `a` against the reference `b`: Σ(a − b)² / Σb².
pub fn nmse(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| ((x - y) as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    num / den.max(1e-30)
}

/// The model a CUDA benchmark runs on: `$var` names a GGUF and a CUDA device exists; otherwise
/// `None`, after saying on stderr that `test` was skipped (a skipped bench proves nothing).
pub fn cuda_bench_model(test: &str, var: &str) -> Option<String> {
    let Ok(path) = std::env::var(var) else {
        eprintln!("SKIPPED {test}: {var} not set (not counted as run)");
        return None;
    };
    if !bonsai_engine::backend::cuda::CudaBackend::available() {
        eprintln!("SKIPPED {test}: no CUDA device (not counted as run)");
        return None;
    }
    Some(path)
}

/// Launches of a profiled run (`Gpu::profile_end`: name and grid, µs) grouped by name and grid,
/// most time first: `(name, launches, total µs)`.
pub fn group_launches(launches: &[(String, f32)]) -> Vec<(String, usize, f64)> {
    let mut agg: Vec<(String, usize, f64)> = Vec::new();
    for (name, us) in launches {
        match agg.iter_mut().find(|a| &a.0 == name) {
            Some(a) => {
                a.1 += 1;
                a.2 += *us as f64;
            }
            None => agg.push((name.clone(), 1, *us as f64)),
        }
    }
    agg.sort_by(|a, b| b.2.total_cmp(&a.2));
    agg
}

/// `ids` through the target at `st.pos` (chunked GDN), its last logits row into `lg`: the prefill a
/// DSpark test or bench stages into its drafter. Returns the taps of every row (`layers`, in the
/// drafter's tap layout).
pub fn prefill_with_taps<B: bonsai_engine::backend::Backend>(
    b: &B,
    cfg: &bonsai_engine::config::TargetConfig,
    w: &bonsai_engine::model::Weights<B>,
    st: &mut bonsai_engine::model::SeqState<B>,
    ids: &[u32],
    layers: &[usize],
    lg: &mut Vec<f32>,
) -> Vec<f32> {
    use bonsai_engine::model::{forward, Capture, LogitRows, TapRequest};
    let mut taps = Vec::new();
    forward(
        b,
        cfg,
        w,
        st,
        ids,
        bonsai_engine::backend::GdnMode::Chunked,
        LogitRows::Last,
        lg,
        Capture {
            taps: Some(TapRequest {
                layers,
                rows: 0..ids.len(),
                out: &mut taps,
            }),
            gdn_rec: None,
        },
    )
    .unwrap();
    taps
}

/// One request on `e` to the end: `(token id, logprob bits)` per generated token and the usage.
pub fn complete_with_logprobs(
    e: &bonsai_engine::engine::Engine,
    pr: &[u32],
    n: usize,
    params: &bonsai_engine::sampling::SamplerParams,
) -> (Vec<(u32, u32)>, bonsai_engine::engine::Usage) {
    use bonsai_engine::engine::{Event, GenRequest};
    let req = GenRequest {
        prompt: pr.to_vec(),
        params: params.clone(),
        max_tokens: n,
        stop: Vec::new(),
        stop_ids: Vec::new(),
        ignore_eos: true,
        speculative: None,
    };
    let (rx, _cancel) = e.submit(req).unwrap();
    let mut out = Vec::new();
    loop {
        match rx.recv().expect("engine event") {
            Event::Token(t) => out.push((t.id, t.logprob.to_bits())),
            Event::Text(_) => {}
            Event::Done { usage, .. } => return (out, usage),
            Event::Error(err) => panic!("generation failed: {err}"),
        }
    }
}

/// Runs a sequence of requests on `cached` (an engine with the prompt cache, `entries` stashed
/// lineages: 0 or [`bonsai_engine::engine::PROMPT_CACHE_ENTRIES`]; `chunk` rows per prefill forward
/// and boundaries at multiples of `granule`, the backend's prefill granule where it divides the
/// chunk, else the chunk) and `fresh` (without) and checks
/// that each gives a fresh prefill's tokens (and, with `same_logprobs`, logprob bits) and resumes
/// exactly the prompt tokens expected: a chat's next turns, repeats, a prefix of the cached prompt,
/// an unrelated prompt, a logits call, short prompts, users of one system prompt, and conversations
/// interleaved (with `entries` > 0 each resumes its own history from the stash, the least recently
/// used dropped past `entries`). Returns the resumed prompt tokens summed over the requests.
pub fn prompt_cache_equals_fresh(
    cached: &bonsai_engine::engine::Engine,
    fresh: &bonsai_engine::engine::Engine,
    same_logprobs: bool,
    chunk: usize,
    granule: usize,
    entries: usize,
    label: &str,
) -> usize {
    use bonsai_engine::sampling::SamplerParams;
    assert!(
        entries == 0 || entries == bonsai_engine::engine::PROMPT_CACHE_ENTRIES,
        "the expected resumed lengths are for 0 or {} stashed lineages",
        bonsai_engine::engine::PROMPT_CACHE_ENTRIES
    );
    let stash = entries > 0;
    let c = chunk;
    let nv = cached.info().n_vocab as u32;
    let toks = |n: usize, seed: u32| -> Vec<u32> {
        let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(12_345);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x % nv
            })
            .collect()
    };
    let a = toks(2 * c + c / 7, 1); // its last chunk starts at 2c
    let b = [a.clone(), toks(c / 4, 2)].concat(); // shorter than 3c
    let a_plus1 = [&a[..2 * c], &toks(1, 3)[..]].concat();
    let other = toks(c + c / 6, 4);
    let short = toks(10, 5);
    // one system prompt of 1.5 chunks, users of a chunk each, and their next turns
    let user = |seed: u32| [&a[..c + c / 2], &toks(c, seed)[..]].concat();
    let (user_a, user_b, user_c, user_d) = (user(6), user(7), user(8), user(11));
    let next = |u: &[u32], seed: u32| [u, &toks(c / 2, seed)[..]].concat();
    let (user_a2, user_b2, user_c2) = (next(&user_a, 9), next(&user_b, 12), next(&user_c, 10));
    let greedy = SamplerParams::greedy();
    let sampled = sampled(77);
    // The expected resumed lengths, with the stash and with the live lineage only. With the
    // granule equal to the chunk every boundary is a chunk start; with a 64-row granule under
    // 512-row chunks (the CPU backend's default) the `Tail` slot sits at the last multiple of 64
    // before each prompt's end, and the `Shared` one at a multiple of 64 too. The 64 / 512 values
    // come from a small model of the rules in `PromptCache`'s documentation, written for this test
    // and not from the engine's code (a: 1,097 tokens, its tail 1,088; b: 1,225, tail 1,216; users:
    // 1,280 with a 768-token system prompt).
    let fine = granule < c;
    assert!(
        !fine || (granule, c) == (64, 512),
        "the expected resumed lengths with a finer granule are for 64 / 512, not {granule} / {c}"
    );
    let want = |coarse: [usize; 2], fine_rows: [usize; 2]| {
        let w = if fine { fine_rows } else { coarse };
        if stash {
            w[0]
        } else {
            w[1]
        }
    };
    // (what, prompt, sampling, prompt tokens expected from the cache)
    let steps: Vec<(&str, &[u32], &SamplerParams, usize)> = vec![
        ("long prompt", &a, &greedy, 0),
        (
            "its next chat turn",
            &b,
            &greedy,
            want([2 * c; 2], [1088; 2]),
        ),
        (
            "the long prompt again, sampled",
            &a,
            &sampled,
            want([2 * c; 2], [1024; 2]),
        ),
        (
            "the cached prefix + 1 token",
            &a_plus1,
            &greedy,
            want([2 * c; 2], [1024; 2]),
        ),
        ("the cached prefix alone", &a[..2 * c], &greedy, 0),
        (
            "the next turn again (the stash has the longer boundary)",
            &b,
            &greedy,
            want([2 * c, c], [1216, 960]),
        ),
        ("an unrelated prompt", &other, &greedy, 0),
        ("(logits call)", &[], &greedy, 0),
        (
            "the unrelated prompt after a logits call",
            &other,
            &greedy,
            0,
        ),
        ("a short prompt", &short, &greedy, 0),
        ("the short prompt again", &short, &greedy, 0),
        (
            "user A of a system prompt (a stashed chunk boundary)",
            &user_a,
            &greedy,
            want([c, 0], [512, 0]),
        ),
        (
            "user B of the system prompt (saves its boundary)",
            &user_b,
            &greedy,
            want([0, 0], [512, 0]),
        ),
        (
            "user C of the system prompt",
            &user_c,
            &greedy,
            want([c; 2], [512, 768]),
        ),
        (
            "user B again",
            &user_b,
            &greedy,
            want([2 * c, c], [1216, 768]),
        ),
        (
            "user A's next turn",
            &user_a2,
            &greedy,
            want([2 * c, c], [1216, 768]),
        ),
        (
            "user C's next turn",
            &user_c2,
            &greedy,
            want([2 * c, c], [1216, 768]),
        ),
        (
            "user D of the system prompt (drops the oldest lineage)",
            &user_d,
            &greedy,
            want([c; 2], [512, 768]),
        ),
        (
            "user B's next turn",
            &user_b2,
            &greedy,
            want([2 * c, c], [1216, 768]),
        ),
        (
            "the first chat's next turn again (its lineage was dropped)",
            &b,
            &greedy,
            want([c; 2], [960, 768]),
        ),
    ];
    let mut resumed = 0;
    for (what, p, params, want_cached) in steps {
        if p.is_empty() {
            cached.logits(&short, true).expect("logits");
            continue;
        }
        let (got, u) = complete_with_logprobs(cached, p, 12, params);
        let (want, u0) = complete_with_logprobs(fresh, p, 12, params);
        assert_eq!(
            u0.cached_tokens, 0,
            "{label}: the engine without a cache resumed"
        );
        assert_eq!(
            u.cached_tokens, want_cached,
            "{label} {what}: resumed {} prompt tokens, expected {want_cached}",
            u.cached_tokens
        );
        let ids = |v: &[(u32, u32)]| v.iter().map(|t| t.0).collect::<Vec<_>>();
        assert_eq!(
            ids(&got),
            ids(&want),
            "{label} {what} ({} prompt tokens, {} resumed): tokens differ from a fresh prefill",
            p.len(),
            u.cached_tokens
        );
        if same_logprobs {
            assert_eq!(
                got, want,
                "{label} {what}: logprob bits differ from a fresh prefill"
            );
        }
        resumed += u.cached_tokens;
    }
    resumed
}
