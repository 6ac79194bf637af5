//! Model configs read from the GGUF header, and full tensor validation (MODEL.md §2, §4.2–4.3, §7).
//!
//! Everything is driven by the header: the real Bonsai-27B values in MODEL.md are only what a real
//! file will contain, never constants here. [`TargetConfig::from_gguf`] reads the `qwen35.*` keys,
//! checks the derived relations, then checks that *every* tensor the config implies is present with
//! the implied shape and an allowed type, and that no other tensor is present.
//!
//! # Storage conventions of the `qwen35` GGUF (the converter's transforms, MODEL.md §2.4)
//!
//! - **Norms are stored as `1 + w`**: `attn_norm`, `post_attention_norm`, `output_norm`,
//!   `attn_q_norm`, `attn_k_norm` already include the `+1` of HF's `Qwen3_5RMSNorm`. The engine
//!   multiplies by every stored norm weight as is. **Exception:** `ssm_norm` is the raw `w` of the
//!   gated RMSNorm (applied as `x̂·w`), shared by all v-heads, `[d_state]`.
//! - **`ssm_a = −exp(A_log)`** is precomputed (so `g = ssm_a · softplus(a + ssm_dt.bias) ≤ 0`);
//!   `ssm_dt.bias` is HF's `dt_bias`. Note the name `ssm_a` has no `.weight` suffix.
//! - **Tiled V-head order**: every V-indexed tensor (`attn_qkv` v part, `attn_gate`, `ssm_beta`,
//!   `ssm_alpha`, `ssm_dt.bias`, `ssm_a`, `ssm_conv1d` v channels, `ssm_out` input columns) is in
//!   tiled order, so **GGUF v-head `h` uses k-head `h mod H_k`** (`H_k = ssm_n_group`).
//! - **`attn_q` rows per head are `q ‖ gate`**: head `h` owns rows `2·hd·h .. 2·hd·(h+1)`, the first
//!   `hd` the query and the next `hd` the output gate.
//! - **GQA is grouped**: q head `h` uses kv head `h / (n_head / n_head_kv)`, the opposite of the GDN
//!   tiled map.
//! - Layer `il` is full attention iff `(il + 1) % full_attn_interval == 0`, decided by index,
//!   never by tensor name (`attn_qkv` names the GDN projection in GDN layers and the optional fused
//!   q/k/v in attention layers).
//!
//! # `dspark` drafter conventions (MODEL.md §4.2–4.3)
//!
//! - DSpark-specific keys carry the arch prefix twice (`dspark.dspark.block_size`); generic keys once.
//! - Drafter norms are stored as plain `w` (no `+1`).
//! - Per-tensor types are read from the header; `token_embd` may be low-bit (its id 42 is resolved
//!   per file, so a g128 drafter embedding can pair with a g64 target).

use bonsai_kernels_cpu::quant::GGML_TYPE_PTQ1_0;
use bonsai_kernels_cpu::QuantType;

use crate::error::{Error, Result};
use crate::gguf::{Gguf, TensorInfo};

/// The target architecture this engine serves.
pub const TARGET_ARCH: &str = "qwen35";
/// The drafter architecture this engine serves.
pub const DRAFTER_ARCH: &str = "dspark";

/// `general.architecture`.
pub fn architecture(g: &Gguf) -> Result<&str> {
    g.get_str("general.architecture")
}

/// Refuse Ternary-Bonsai-2 files: tensors of type 143 (PTQ1_0) or any `prism.hadamard.*` key.
pub fn refuse_bonsai2(g: &Gguf) -> Result<()> {
    let hint = match g.get("general.file_type").and_then(|v| v.as_u64()) {
        Some(141) => " (general.file_type = 141)",
        _ => "",
    };
    if let Some(t) = g.tensors().iter().find(|t| t.ggml_type == GGML_TYPE_PTQ1_0) {
        return Err(Error::Unsupported(format!(
            "Ternary-Bonsai-2 files are not supported: tensor '{}' has type 143 (PTQ1_0, \
             Hadamard-rotated weights){hint}",
            t.name
        )));
    }
    if let Some((k, _)) = g
        .metadata()
        .iter()
        .find(|(k, _)| k.starts_with("prism.hadamard."))
    {
        return Err(Error::Unsupported(format!(
            "Ternary-Bonsai-2 files are not supported: key '{k}' marks Hadamard-rotated \
             weights{hint}"
        )));
    }
    Ok(())
}

/// Which storage types a tensor may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TypeClass {
    /// The target's low-bit matrices: Q1_0 / Q2_0 (g128, g64) / PQ2_0, one type for the file.
    LowBit,
    /// Exactly F32 (target norms, `ssm_a`, `ssm_dt.bias`, `ssm_conv1d`).
    F32,
    /// A float vector: F32, F16 or BF16 (drafter norms and biases).
    Float,
    /// A drafter trunk matrix: Q4_0, Q4_1, Q8_0, F16, BF16 or F32.
    Trunk,
    /// A drafter embedding or head: any trunk type or a low-bit type.
    Embedding,
}

impl TypeClass {
    pub fn allows(self, q: QuantType) -> bool {
        use QuantType::*;
        match self {
            TypeClass::LowBit => q.is_lowbit(),
            TypeClass::F32 => q == F32,
            TypeClass::Float => matches!(q, F32 | F16 | BF16),
            TypeClass::Trunk => matches!(q, Q4_0 | Q4_1 | Q8_0 | F16 | BF16 | F32),
            TypeClass::Embedding => TypeClass::Trunk.allows(q) || q.is_lowbit(),
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            TypeClass::LowBit => "a low-bit type (Q1_0, Q2_0 g128/g64, PQ2_0)",
            TypeClass::F32 => "F32",
            TypeClass::Float => "F32, F16 or BF16",
            TypeClass::Trunk => "Q4_0, Q4_1, Q8_0, F16, BF16 or F32",
            TypeClass::Embedding => "a low-bit type or Q4_0, Q4_1, Q8_0, F16, BF16, F32",
        }
    }
}

/// One tensor a config implies: name, shape (ggml order) and allowed types.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub class: TypeClass,
}

impl TensorSpec {
    fn new(name: impl Into<String>, dims: &[usize], class: TypeClass) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dims: dims.iter().map(|&d| d as u64).collect(),
            class,
        }
    }
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// The `qwen35` target, read from the header and validated against the tensor table.
#[derive(Clone, Debug, PartialEq)]
pub struct TargetConfig {
    pub n_layer: usize,
    pub n_ctx_train: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    /// `attention.key_length`; `value_length` must be equal.
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    /// `rope.dimension_count`: rotated dims per head (NEOX pairs `(d, d + n_rot/2)`).
    pub n_rot: usize,
    /// `rope.dimension_sections` (M-RoPE; for text it reduces to plain NEOX). Empty if absent.
    pub rope_sections: Vec<i32>,
    pub full_attn_interval: usize,
    pub ssm_conv_kernel: usize,
    /// `ssm.state_size`: the k-head dim and the v-head dim.
    pub ssm_d_state: usize,
    /// `ssm.group_count` = `H_k`, the number of GDN k-heads.
    pub ssm_n_group: usize,
    /// `ssm.time_step_rank` = `H_v`, the number of GDN v-heads.
    pub ssm_dt_rank: usize,
    /// `ssm.inner_size` = `H_v · d_state`.
    pub ssm_inner: usize,
    /// Rows of `token_embd` (the logits width).
    pub n_vocab: usize,
    /// The one type of all the low-bit matrices.
    pub weight_type: QuantType,
    /// False: the head is tied to `token_embd`.
    pub has_output: bool,
    /// Attention layers use one fused `attn_qkv` instead of `attn_q/k/v`.
    pub fused_attn_qkv: bool,
    /// `tokenizer.ggml.eos_token_id`, then `eot_token_id`, when present (deduplicated).
    pub eos_ids: Vec<u32>,
}

fn prefixed(arch: &str, key: &str) -> String {
    format!("{arch}.{key}")
}

/// A required positive integer key.
fn get_pos(g: &Gguf, key: &str) -> Result<usize> {
    let v = g.get_u64(key)?;
    if v == 0 || v > u32::MAX as u64 {
        return Err(Error::metadata(
            key,
            format!("must be in 1..={}, found {v}", u32::MAX),
        ));
    }
    Ok(v as usize)
}

/// Largest accepted model dimension (width, head count, head dim, state size, ...). Real values
/// are at most a few tens of thousands; the cap keeps every derived product far from overflow.
pub const MAX_MODEL_DIM: usize = 1 << 20;

/// A required positive model dimension, at most [`MAX_MODEL_DIM`].
fn get_dim(g: &Gguf, key: &str) -> Result<usize> {
    let v = get_pos(g, key)?;
    if v > MAX_MODEL_DIM {
        return Err(Error::metadata(
            key,
            format!("must be in 1..={MAX_MODEL_DIM}, found {v}"),
        ));
    }
    Ok(v)
}

/// `block_count` is bounded by the tensor table: each layer needs at least `per_layer` tensors.
fn check_layer_count(g: &Gguf, key: &str, n_layer: usize, per_layer: usize) -> Result<()> {
    let need = n_layer.saturating_mul(per_layer);
    if need > g.tensors().len() {
        return Err(Error::metadata(
            key,
            format!(
                "{n_layer} layers imply at least {need} tensors, but the file has only {}",
                g.tensors().len()
            ),
        ));
    }
    Ok(())
}

/// A required finite, positive float key.
fn get_pos_f32(g: &Gguf, key: &str) -> Result<f32> {
    let v = g.get_f32(key)?;
    if !(v.is_finite() && v > 0.0) {
        return Err(Error::metadata(
            key,
            format!("must be finite and > 0, found {v}"),
        ));
    }
    Ok(v)
}

fn check_arch(g: &Gguf, expected: &str) -> Result<()> {
    let arch = architecture(g)?;
    if arch == expected {
        return Ok(());
    }
    Err(Error::Unsupported(match (arch, expected) {
        (DRAFTER_ARCH, TARGET_ARCH) => {
            "this file is a DSpark drafter (architecture 'dspark'), not a target model; pass it as \
             draft=... next to a qwen35 model"
                .to_string()
        }
        (TARGET_ARCH, DRAFTER_ARCH) => {
            "this file is a qwen35 target model, not a DSpark drafter (expected architecture \
             'dspark')"
                .to_string()
        }
        ("dflash", _) => {
            "architecture 'dflash' (a converted DSpark drafter) is not supported; use \
                          the original 'dspark' file"
                .to_string()
        }
        _ => format!("architecture '{arch}' is not supported, expected '{expected}'"),
    }))
}

/// `token_embd.weight`, present and of shape `[n_embd, n_vocab]` (target and drafter alike).
fn token_embd(g: &Gguf, n_embd: usize) -> Result<&TensorInfo> {
    let embd = g.tensor("token_embd.weight").ok_or_else(|| {
        Error::tensor(
            "token_embd.weight",
            format!("missing (expected shape [{n_embd}, n_vocab])"),
        )
    })?;
    if embd.dims.len() != 2 || embd.dims[0] != n_embd as u64 {
        return Err(Error::tensor(
            "token_embd.weight",
            format!(
                "expected shape [{n_embd}, n_vocab], found {}",
                shape(&embd.dims)
            ),
        ));
    }
    Ok(embd)
}

fn shape(dims: &[u64]) -> String {
    format!("{dims:?}")
}

/// Check that every spec is present with its shape and an allowed type, that every `LowBit`
/// tensor has type `lowbit`, and that no tensor outside `specs` exists.
fn validate_tensors(g: &Gguf, specs: &[TensorSpec], lowbit: Option<QuantType>) -> Result<()> {
    for s in specs {
        let t = g.tensor(&s.name).ok_or_else(|| {
            Error::tensor(
                &s.name,
                format!(
                    "missing (expected shape {}, type {})",
                    shape(&s.dims),
                    s.class.describe()
                ),
            )
        })?;
        check_tensor(t, s, lowbit)?;
    }
    let names: std::collections::HashSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    let extra: Vec<&str> = g
        .tensors()
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| !names.contains(n))
        .collect();
    if let Some(first) = extra.first() {
        let list: Vec<&str> = extra.iter().take(8).copied().collect();
        return Err(Error::tensor(
            *first,
            format!(
                "unexpected tensor: not part of the model the header describes ({} unexpected: {}{})",
                extra.len(),
                list.join(", "),
                if extra.len() > 8 { ", ..." } else { "" }
            ),
        ));
    }
    Ok(())
}

fn check_tensor(t: &TensorInfo, s: &TensorSpec, lowbit: Option<QuantType>) -> Result<()> {
    if t.dims != s.dims {
        return Err(Error::tensor(
            &t.name,
            format!(
                "expected shape {}, found {}",
                shape(&s.dims),
                shape(&t.dims)
            ),
        ));
    }
    let q = t.qtype.ok_or_else(|| {
        Error::tensor(
            &t.name,
            format!(
                "unknown ggml type id {} (expected {})",
                t.ggml_type,
                s.class.describe()
            ),
        )
    })?;
    if !s.class.allows(q) {
        return Err(Error::tensor(
            &t.name,
            format!("expected type {}, found {}", s.class.describe(), q.name()),
        ));
    }
    if let (TypeClass::LowBit, Some(w)) = (s.class, lowbit) {
        if q != w {
            return Err(Error::tensor(
                &t.name,
                format!(
                    "expected type {} (all low-bit matrices must share token_embd.weight's type), \
                     found {}",
                    w.name(),
                    q.name()
                ),
            ));
        }
    }
    Ok(())
}

impl TargetConfig {
    /// Layer `il` is full attention iff `(il + 1) % full_attn_interval == 0`.
    pub fn is_attn_layer(&self, il: usize) -> bool {
        (il + 1) % self.full_attn_interval == 0
    }
    pub fn n_attn_layers(&self) -> usize {
        (0..self.n_layer)
            .filter(|&il| self.is_attn_layer(il))
            .count()
    }
    pub fn n_gdn_layers(&self) -> usize {
        self.n_layer - self.n_attn_layers()
    }
    /// GDN v-head dim (`ssm_inner / H_v`, equal to `d_state`).
    pub fn ssm_head_v_dim(&self) -> usize {
        self.ssm_inner / self.ssm_dt_rank
    }
    /// GDN q and k width: `H_k · d_state`.
    pub fn ssm_key_dim(&self) -> usize {
        self.ssm_n_group * self.ssm_d_state
    }
    /// GDN conv channels: `q ‖ k ‖ v` = `2·H_k·d_state + ssm_inner`.
    pub fn conv_dim(&self) -> usize {
        2 * self.ssm_key_dim() + self.ssm_inner
    }
    /// Rows of the fused attention q/k/v: `n_head·2·hd + 2·n_head_kv·hd`.
    pub fn fused_qkv_rows(&self) -> usize {
        self.n_head * 2 * self.head_dim + 2 * self.n_head_kv * self.head_dim
    }

    /// Read the `qwen35.*` keys and validate every tensor. Refuses Bonsai 2, a drafter, or any
    /// other architecture with `Error::Unsupported`.
    pub fn from_gguf(g: &Gguf) -> Result<TargetConfig> {
        refuse_bonsai2(g)?;
        check_arch(g, TARGET_ARCH)?;
        let k = |s: &str| prefixed(TARGET_ARCH, s);

        let n_layer = get_pos(g, &k("block_count"))?;
        check_layer_count(g, &k("block_count"), n_layer, 9)?;
        let n_ctx_train = get_pos(g, &k("context_length"))?;
        let n_embd = get_dim(g, &k("embedding_length"))?;
        let n_ff = get_dim(g, &k("feed_forward_length"))?;
        let n_head = get_dim(g, &k("attention.head_count"))?;
        let n_head_kv = get_dim(g, &k("attention.head_count_kv"))?;
        let head_dim = get_dim(g, &k("attention.key_length"))?;
        let v_len = get_dim(g, &k("attention.value_length"))?;
        let rms_eps = get_pos_f32(g, &k("attention.layer_norm_rms_epsilon"))?;
        let rope_base = get_pos_f32(g, &k("rope.freq_base"))?;
        let n_rot = get_dim(g, &k("rope.dimension_count"))?;
        let sections_key = k("rope.dimension_sections");
        let rope_sections = if g.get(&sections_key).is_some() {
            g.get_i32_array(&sections_key)?
        } else {
            Vec::new()
        };
        let interval_key = k("full_attention_interval");
        let full_attn_interval = if g.get(&interval_key).is_some() {
            get_pos(g, &interval_key)?
        } else {
            4
        };
        let ssm_conv_kernel = get_dim(g, &k("ssm.conv_kernel"))?;
        let ssm_d_state = get_dim(g, &k("ssm.state_size"))?;
        let ssm_n_group = get_dim(g, &k("ssm.group_count"))?;
        let ssm_dt_rank = get_dim(g, &k("ssm.time_step_rank"))?;
        let ssm_inner = get_dim(g, &k("ssm.inner_size"))?;

        // Derived relations.
        let bad = |key: &str, msg: String| Err(Error::metadata(k(key), msg));
        if v_len != head_dim {
            return bad(
                "attention.value_length",
                format!("must equal attention.key_length {head_dim}, found {v_len}"),
            );
        }
        if n_head % n_head_kv != 0 {
            return bad(
                "attention.head_count_kv",
                format!("must divide attention.head_count {n_head}, found {n_head_kv}"),
            );
        }
        if n_rot > head_dim || n_rot % 2 != 0 {
            return bad(
                "rope.dimension_count",
                format!("must be even and <= key_length {head_dim}, found {n_rot}"),
            );
        }
        if rope_sections.len() > 4
            || rope_sections.iter().any(|&s| s < 0)
            || rope_sections.iter().map(|&s| s as i64).sum::<i64>() > (n_rot / 2) as i64
        {
            return bad(
                "rope.dimension_sections",
                format!(
                    "expected at most 4 non-negative sections summing to <= n_rot/2 = {}, found {:?}",
                    n_rot / 2,
                    rope_sections
                ),
            );
        }
        if full_attn_interval > n_layer {
            return bad(
                "full_attention_interval",
                format!("must be <= block_count {n_layer}, found {full_attn_interval}"),
            );
        }
        if ssm_inner != ssm_dt_rank.saturating_mul(ssm_d_state) {
            return bad(
                "ssm.inner_size",
                format!(
                    "must equal time_step_rank {ssm_dt_rank} x state_size {ssm_d_state} = {}, \
                     found {ssm_inner}",
                    ssm_dt_rank.saturating_mul(ssm_d_state)
                ),
            );
        }
        if ssm_dt_rank % ssm_n_group != 0 {
            return bad(
                "ssm.group_count",
                format!("must divide time_step_rank (H_v) {ssm_dt_rank}, found {ssm_n_group}"),
            );
        }

        // Facts taken from the tensor table.
        let embd = token_embd(g, n_embd)?;
        let n_vocab = embd.dims[1] as usize;
        let weight_type = match embd.qtype {
            Some(q) if q.is_lowbit() => q,
            Some(q) => {
                return Err(Error::tensor(
                    "token_embd.weight",
                    format!(
                        "expected type {}, found {}",
                        TypeClass::LowBit.describe(),
                        q.name()
                    ),
                ))
            }
            None => {
                return Err(Error::tensor(
                    "token_embd.weight",
                    format!(
                        "unknown ggml type id {} (expected {})",
                        embd.ggml_type,
                        TypeClass::LowBit.describe()
                    ),
                ))
            }
        };
        let be = weight_type.block_elems();
        for (key, v) in [
            ("embedding_length", n_embd),
            ("feed_forward_length", n_ff),
            ("ssm.inner_size", ssm_inner),
            ("attention.head_count", n_head * head_dim),
        ] {
            if v % be != 0 {
                return bad(
                    key,
                    format!(
                        "a low-bit matrix input width of {v} is not a multiple of the {} block \
                         size {be}",
                        weight_type.name()
                    ),
                );
            }
        }
        let has_output = g.tensor("output.weight").is_some();

        let mut cfg = TargetConfig {
            n_layer,
            n_ctx_train,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            rms_eps,
            rope_base,
            n_rot,
            rope_sections,
            full_attn_interval,
            ssm_conv_kernel,
            ssm_d_state,
            ssm_n_group,
            ssm_dt_rank,
            ssm_inner,
            n_vocab,
            weight_type,
            has_output,
            fused_attn_qkv: false,
            eos_ids: Vec::new(),
        };

        // Fused or separate attention q/k/v: all attention layers must agree.
        let mut fused: Option<(bool, usize)> = None;
        for il in (0..n_layer).filter(|&il| cfg.is_attn_layer(il)) {
            let f = g.tensor(&format!("blk.{il}.attn_qkv.weight")).is_some();
            match fused {
                None => fused = Some((f, il)),
                Some((f0, il0)) if f0 != f => {
                    let name = format!("blk.{il}.attn_{}.weight", if f { "qkv" } else { "q" });
                    return Err(Error::tensor(
                        name,
                        format!(
                            "attention layers mix fused attn_qkv and separate attn_q/k/v (layer \
                             {il0} is {}, layer {il} is {})",
                            if f0 { "fused" } else { "separate" },
                            if f { "fused" } else { "separate" }
                        ),
                    ));
                }
                _ => {}
            }
        }
        cfg.fused_attn_qkv = fused.is_some_and(|(f, _)| f);

        validate_tensors(g, &cfg.expected_tensors(), Some(weight_type))?;

        // Stop ids from the header.
        for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
            if g.get(key).is_some() {
                let id = g.get_u32(key)?;
                if id as usize >= n_vocab {
                    return Err(Error::metadata(
                        key,
                        format!("token id {id} is out of range of the {n_vocab} embedding rows"),
                    ));
                }
                if !cfg.eos_ids.contains(&id) {
                    cfg.eos_ids.push(id);
                }
            }
        }
        if let Some(tokens) = g.get("tokenizer.ggml.tokens") {
            let n = tokens.as_array().map(|a| a.len()).ok_or_else(|| {
                Error::metadata(
                    "tokenizer.ggml.tokens",
                    format!("expected array, found {}", tokens.type_name()),
                )
            })?;
            if n > n_vocab {
                return Err(Error::metadata(
                    "tokenizer.ggml.tokens",
                    format!("{n} tokens but token_embd.weight has only {n_vocab} rows"),
                ));
            }
        }
        Ok(cfg)
    }

    /// Every tensor this config implies, in file order (MODEL.md §2.3).
    pub fn expected_tensors(&self) -> Vec<TensorSpec> {
        use TypeClass::{LowBit, F32};
        let (e, v) = (self.n_embd, self.n_vocab);
        let mut s = vec![
            TensorSpec::new("token_embd.weight", &[e, v], LowBit),
            TensorSpec::new("output_norm.weight", &[e], F32),
        ];
        if self.has_output {
            s.push(TensorSpec::new("output.weight", &[e, v], LowBit));
        }
        let hd = self.head_dim;
        for il in 0..self.n_layer {
            let p = |n: &str| format!("blk.{il}.{n}");
            s.push(TensorSpec::new(p("attn_norm.weight"), &[e], F32));
            if self.is_attn_layer(il) {
                if self.fused_attn_qkv {
                    s.push(TensorSpec::new(
                        p("attn_qkv.weight"),
                        &[e, self.fused_qkv_rows()],
                        LowBit,
                    ));
                } else {
                    s.push(TensorSpec::new(
                        p("attn_q.weight"),
                        &[e, self.n_head * 2 * hd],
                        LowBit,
                    ));
                    s.push(TensorSpec::new(
                        p("attn_k.weight"),
                        &[e, self.n_head_kv * hd],
                        LowBit,
                    ));
                    s.push(TensorSpec::new(
                        p("attn_v.weight"),
                        &[e, self.n_head_kv * hd],
                        LowBit,
                    ));
                }
                s.push(TensorSpec::new(p("attn_q_norm.weight"), &[hd], F32));
                s.push(TensorSpec::new(p("attn_k_norm.weight"), &[hd], F32));
                s.push(TensorSpec::new(
                    p("attn_output.weight"),
                    &[self.n_head * hd, e],
                    LowBit,
                ));
            } else {
                let hv = self.ssm_dt_rank;
                s.push(TensorSpec::new(
                    p("attn_qkv.weight"),
                    &[e, self.conv_dim()],
                    LowBit,
                ));
                s.push(TensorSpec::new(
                    p("attn_gate.weight"),
                    &[e, self.ssm_inner],
                    LowBit,
                ));
                s.push(TensorSpec::new(p("ssm_beta.weight"), &[e, hv], LowBit));
                s.push(TensorSpec::new(p("ssm_alpha.weight"), &[e, hv], LowBit));
                s.push(TensorSpec::new(
                    p("ssm_conv1d.weight"),
                    &[self.ssm_conv_kernel, self.conv_dim()],
                    F32,
                ));
                s.push(TensorSpec::new(p("ssm_dt.bias"), &[hv], F32));
                s.push(TensorSpec::new(p("ssm_a"), &[hv], F32));
                s.push(TensorSpec::new(
                    p("ssm_norm.weight"),
                    &[self.ssm_d_state],
                    F32,
                ));
                s.push(TensorSpec::new(
                    p("ssm_out.weight"),
                    &[self.ssm_inner, e],
                    LowBit,
                ));
            }
            s.push(TensorSpec::new(p("post_attention_norm.weight"), &[e], F32));
            s.push(TensorSpec::new(
                p("ffn_gate.weight"),
                &[e, self.n_ff],
                LowBit,
            ));
            s.push(TensorSpec::new(p("ffn_up.weight"), &[e, self.n_ff], LowBit));
            s.push(TensorSpec::new(
                p("ffn_down.weight"),
                &[self.n_ff, e],
                LowBit,
            ));
        }
        s
    }

    /// Parameter count implied by the config (all tensors; the tied head counted once).
    pub fn n_params(&self) -> u64 {
        self.expected_tensors().iter().map(|t| t.n_elements()).sum()
    }

    /// Bytes of all weights as stored (low-bit matrices at `weight_type`, the rest F32).
    pub fn weight_bytes(&self) -> u64 {
        self.expected_tensors()
            .iter()
            .map(|t| {
                let q = if t.class == TypeClass::LowBit {
                    self.weight_type
                } else {
                    QuantType::F32
                };
                let rows: u64 = t.dims[1..].iter().product();
                q.row_bytes(t.dims[0] as usize).unwrap_or(0) as u64 * rows
            })
            .sum()
    }

    /// Attention KV bytes per context token: `n_attn · 2 · n_head_kv · hd · (2 | 4)`.
    pub fn kv_bytes_per_token(&self, kv_f16: bool) -> usize {
        let elt = if kv_f16 { 2 } else { 4 };
        self.n_attn_layers() * 2 * self.n_head_kv * self.head_dim * elt
    }

    /// Per-sequence recurrent state, f32: GDN `S` (`H_v × d_state × d_v`) plus the conv state
    /// (`(conv_kernel − 1) × conv_dim`), for every GDN layer.
    pub fn state_bytes(&self) -> usize {
        let s = self
            .ssm_dt_rank
            .saturating_mul(self.ssm_d_state)
            .saturating_mul(self.ssm_head_v_dim());
        let conv = self
            .ssm_conv_kernel
            .saturating_sub(1)
            .saturating_mul(self.conv_dim());
        self.n_gdn_layers()
            .saturating_mul(s.saturating_add(conv))
            .saturating_mul(4)
    }
}

/// The `dspark` drafter, read from the header and validated against the tensor table.
#[derive(Clone, Debug, PartialEq)]
pub struct DrafterConfig {
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    /// `dspark.context_length`: the drafter's trained positions (window bound).
    pub n_ctx_train: usize,
    /// Rows of `token_embd` (equal to `dspark.vocab_size` when present).
    pub n_vocab: usize,
    pub block_size: usize,
    pub mask_token_id: u32,
    /// Target layers whose *outputs* are tapped (0-based).
    pub target_layers: Vec<usize>,
    pub markov_rank: usize,
    pub min_log_snr: f32,
    pub max_log_snr: f32,
    pub confidence_head: bool,
    pub confidence_head_with_markov: bool,
    pub log_snr_conditioning: bool,
    /// Input width of the log-SNR MLP (`log_snr_fc1.weight` ne0; sin ‖ cos halves).
    pub log_snr_dim: usize,
    /// Input width of the confidence head (`n_embd` or `n_embd + markov_rank`), if present.
    pub confidence_in_dim: Option<usize>,
    pub embd_type: QuantType,
    pub output_type: QuantType,
}

impl DrafterConfig {
    /// Read the `dspark.*` keys and validate all tensors (MODEL.md §4.2–4.3).
    pub fn from_gguf(g: &Gguf) -> Result<DrafterConfig> {
        refuse_bonsai2(g)?;
        check_arch(g, DRAFTER_ARCH)?;
        let k = |s: &str| prefixed(DRAFTER_ARCH, s);
        let kk = |s: &str| format!("{DRAFTER_ARCH}.{DRAFTER_ARCH}.{s}");

        let n_layer = get_pos(g, &k("block_count"))?;
        check_layer_count(g, &k("block_count"), n_layer, 11)?;
        let n_embd = get_dim(g, &k("embedding_length"))?;
        let n_head = get_dim(g, &k("attention.head_count"))?;
        let n_head_kv = get_dim(g, &k("attention.head_count_kv"))?;
        let head_dim = get_dim(g, &k("attention.key_length"))?;
        let v_len = get_dim(g, &k("attention.value_length"))?;
        let n_ff = get_dim(g, &k("feed_forward_length"))?;
        let rope_base = get_pos_f32(g, &k("rope.freq_base"))?;
        let rms_eps = get_pos_f32(g, &k("attention.layer_norm_rms_epsilon"))?;
        let n_ctx_train = get_pos(g, &k("context_length"))?;
        let block_size = get_dim(g, &kk("block_size"))?;
        let mask_token_id = g.get_u32(&kk("mask_token_id"))?;
        let target_layers: Vec<usize> = g
            .get_u32_array(&kk("target_layers"))?
            .into_iter()
            .map(|x| x as usize)
            .collect();
        let markov_rank = get_dim(g, &kk("markov_rank"))?;
        let opt_bool = |key: String, default: bool| -> Result<bool> {
            if g.get(&key).is_some() {
                g.get_bool(&key)
            } else {
                Ok(default)
            }
        };
        let confidence_head = opt_bool(kk("confidence_head"), false)?;
        let confidence_head_with_markov = opt_bool(kk("confidence_head_with_markov"), false)?;
        let log_snr_conditioning = opt_bool(kk("log_snr_conditioning"), true)?;

        let bad = |key: String, msg: String| Err(Error::metadata(key, msg));
        if v_len != head_dim {
            return bad(
                k("attention.value_length"),
                format!("must equal attention.key_length {head_dim}, found {v_len}"),
            );
        }
        if n_head % n_head_kv != 0 {
            return bad(
                k("attention.head_count_kv"),
                format!("must divide attention.head_count {n_head}, found {n_head_kv}"),
            );
        }
        if head_dim % 2 != 0 {
            return bad(
                k("attention.key_length"),
                format!("must be even (NEOX RoPE), found {head_dim}"),
            );
        }
        if target_layers.is_empty() {
            return bad(kk("target_layers"), "must not be empty".into());
        }
        let (mut min_log_snr, mut max_log_snr) = (0.0, 0.0);
        if log_snr_conditioning {
            min_log_snr = g.get_f32(&kk("min_log_snr"))?;
            max_log_snr = g.get_f32(&kk("max_log_snr"))?;
            if !(min_log_snr.is_finite() && max_log_snr.is_finite() && max_log_snr > min_log_snr) {
                return bad(
                    kk("max_log_snr"),
                    format!("log-SNR bounds must be finite with max > min, found min {min_log_snr}, max {max_log_snr}"),
                );
            }
        }

        // Facts from the tensor table.
        let embd = token_embd(g, n_embd)?;
        let n_vocab = embd.dims[1] as usize;
        if g.get(&k("vocab_size")).is_some() {
            let vs = g.get_u64(&k("vocab_size"))?;
            if vs != n_vocab as u64 {
                return bad(
                    k("vocab_size"),
                    format!("must equal token_embd.weight rows {n_vocab}, found {vs}"),
                );
            }
        }
        if mask_token_id as usize >= n_vocab {
            return bad(
                kk("mask_token_id"),
                format!("must be < n_vocab {n_vocab}, found {mask_token_id}"),
            );
        }
        let log_snr_dim = match g.tensor("dspark.log_snr_fc1.weight") {
            Some(t) if t.dims.len() == 2 && t.dims[0] > 0 && t.dims[0] % 2 == 0 => {
                t.dims[0] as usize
            }
            Some(t) => {
                return Err(Error::tensor(
                    &t.name,
                    format!(
                        "expected shape [even width, {n_embd}], found {}",
                        shape(&t.dims)
                    ),
                ))
            }
            None if log_snr_conditioning => {
                return Err(Error::tensor(
                    "dspark.log_snr_fc1.weight",
                    format!(
                        "missing (log_snr_conditioning is on; expected shape [width, {n_embd}])"
                    ),
                ))
            }
            None => 0,
        };
        let confidence_in_dim = match g.tensor("dspark.confidence_head.weight") {
            None => None,
            Some(t) => {
                let w = t.dims[0];
                let ok_w = w == n_embd as u64 || w == (n_embd + markov_rank) as u64;
                let ok_rest = t.dims[1..].iter().all(|&d| d == 1);
                if !(ok_w && ok_rest) {
                    return Err(Error::tensor(
                        &t.name,
                        format!(
                            "expected shape [{n_embd} or {}, 1], found {}",
                            n_embd + markov_rank,
                            shape(&t.dims)
                        ),
                    ));
                }
                Some(w as usize)
            }
        };

        let type_of = |name: &str| g.tensor(name).and_then(|t| t.qtype);
        let mut cfg = DrafterConfig {
            n_layer,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_ff,
            rms_eps,
            rope_base,
            n_ctx_train,
            n_vocab,
            block_size,
            mask_token_id,
            target_layers,
            markov_rank,
            min_log_snr,
            max_log_snr,
            confidence_head,
            confidence_head_with_markov,
            log_snr_conditioning,
            log_snr_dim,
            confidence_in_dim,
            embd_type: QuantType::F32,
            output_type: QuantType::F32,
        };
        let mut specs = cfg.expected_tensors();
        // The confidence head's exact shape was taken from the file above.
        if let Some(t) = g.tensor("dspark.confidence_head.weight") {
            if let Some(s) = specs.iter_mut().find(|s| s.name == t.name) {
                s.dims = t.dims.clone();
            }
        }
        validate_tensors(g, &specs, None)?;
        cfg.embd_type = type_of("token_embd.weight").expect("validated");
        cfg.output_type = type_of("output.weight").expect("validated");
        Ok(cfg)
    }

    /// Every tensor this config implies (MODEL.md §4.3): 13 global + 11 per layer.
    pub fn expected_tensors(&self) -> Vec<TensorSpec> {
        use TypeClass::{Embedding, Float, Trunk};
        let (e, v, r) = (self.n_embd, self.n_vocab, self.markov_rank);
        let mut s = vec![
            TensorSpec::new("token_embd.weight", &[e, v], Embedding),
            TensorSpec::new("output_norm.weight", &[e], Float),
            TensorSpec::new("output.weight", &[e, v], Embedding),
            TensorSpec::new(
                "dspark.fc.weight",
                &[self.target_layers.len() * e, e],
                Trunk,
            ),
            TensorSpec::new("dspark.hidden_norm.weight", &[e], Float),
        ];
        if self.log_snr_dim > 0 {
            s.push(TensorSpec::new(
                "dspark.log_snr_fc1.weight",
                &[self.log_snr_dim, e],
                Trunk,
            ));
            s.push(TensorSpec::new("dspark.log_snr_fc1.bias", &[e], Float));
            s.push(TensorSpec::new("dspark.log_snr_fc2.weight", &[e, e], Trunk));
            s.push(TensorSpec::new("dspark.log_snr_fc2.bias", &[e], Float));
        }
        s.push(TensorSpec::new(
            "dspark.markov_head_a.weight",
            &[r, v],
            Trunk,
        ));
        s.push(TensorSpec::new(
            "dspark.markov_head_b.weight",
            &[r, v],
            Trunk,
        ));
        if let Some(w) = self.confidence_in_dim {
            s.push(TensorSpec::new(
                "dspark.confidence_head.weight",
                &[w, 1],
                Trunk,
            ));
            s.push(TensorSpec::new("dspark.confidence_head.bias", &[1], Float));
        }
        let (hd, q, kv) = (
            self.head_dim,
            self.n_head * self.head_dim,
            self.n_head_kv * self.head_dim,
        );
        for il in 0..self.n_layer {
            let p = |n: &str| format!("blk.{il}.{n}");
            s.push(TensorSpec::new(p("attn_norm.weight"), &[e], Float));
            s.push(TensorSpec::new(p("attn_q.weight"), &[e, q], Trunk));
            s.push(TensorSpec::new(p("attn_k.weight"), &[e, kv], Trunk));
            s.push(TensorSpec::new(p("attn_v.weight"), &[e, kv], Trunk));
            s.push(TensorSpec::new(p("attn_q_norm.weight"), &[hd], Float));
            s.push(TensorSpec::new(p("attn_k_norm.weight"), &[hd], Float));
            s.push(TensorSpec::new(p("attn_output.weight"), &[q, e], Trunk));
            s.push(TensorSpec::new(p("ffn_norm.weight"), &[e], Float));
            s.push(TensorSpec::new(
                p("ffn_gate.weight"),
                &[e, self.n_ff],
                Trunk,
            ));
            s.push(TensorSpec::new(p("ffn_up.weight"), &[e, self.n_ff], Trunk));
            s.push(TensorSpec::new(
                p("ffn_down.weight"),
                &[self.n_ff, e],
                Trunk,
            ));
        }
        s
    }

    /// Drafter KV bytes per context row: `n_layer · 2 · n_head_kv · hd · (2 | 4)`.
    pub fn kv_bytes_per_token(&self, kv_f16: bool) -> usize {
        let elt = if kv_f16 { 2 } else { 4 };
        self.n_layer * 2 * self.n_head_kv * self.head_dim * elt
    }

    /// Refuse a drafter that does not fit `t`: embedding width, vocabulary, tap layers.
    pub fn check_against(&self, t: &TargetConfig) -> Result<()> {
        if self.n_embd != t.n_embd {
            return Err(Error::DrafterMismatch(format!(
                "embedding_length: target has {}, drafter has {}",
                t.n_embd, self.n_embd
            )));
        }
        if self.n_vocab != t.n_vocab {
            return Err(Error::DrafterMismatch(format!(
                "vocabulary (token_embd rows): target has {}, drafter has {}",
                t.n_vocab, self.n_vocab
            )));
        }
        if let Some(&l) = self.target_layers.iter().find(|&&l| l >= t.n_layer) {
            return Err(Error::DrafterMismatch(format!(
                "target_layers {:?}: layer {l} is out of range of the target's {} layers",
                self.target_layers, t.n_layer
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real Bonsai-27B geometry (MODEL.md §2.1), as a literal: only to cross-check the
    /// derived counts against the published ones, never used by the loader.
    fn bonsai_27b(weight_type: QuantType) -> TargetConfig {
        TargetConfig {
            n_layer: 64,
            n_ctx_train: 262144,
            n_embd: 5120,
            n_ff: 17408,
            n_head: 24,
            n_head_kv: 4,
            head_dim: 256,
            rms_eps: 1e-6,
            rope_base: 1e7,
            n_rot: 64,
            rope_sections: vec![11, 11, 10, 0],
            full_attn_interval: 4,
            ssm_conv_kernel: 4,
            ssm_d_state: 128,
            ssm_n_group: 16,
            ssm_dt_rank: 48,
            ssm_inner: 6144,
            n_vocab: 248320,
            weight_type,
            has_output: true,
            fused_attn_qkv: false,
            eos_ids: vec![],
        }
    }

    #[test]
    fn real_geometry_reproduces_published_counts() {
        let c = bonsai_27b(QuantType::Q2_0G128);
        let specs = c.expected_tensors();
        assert_eq!(specs.len(), 851, "MODEL.md §2.3 tensor count");
        let low: Vec<_> = specs
            .iter()
            .filter(|s| s.class == TypeClass::LowBit)
            .collect();
        assert_eq!(low.len(), 498, "MODEL.md §1.5 low-bit matrices");
        assert_eq!(
            low.iter().map(|s| s.n_elements()).sum::<u64>(),
            26_893_352_960
        );
        assert_eq!(
            (c.n_attn_layers(), c.n_gdn_layers(), c.conv_dim()),
            (16, 48, 10240)
        );
        assert_eq!(c.kv_bytes_per_token(true), 64 * 1024, "MODEL.md §3.6");
        // 48 x 48 x 128 x 128 x 4 B (151.0 MB) + 48 x 3 x 10240 x 4 B (5.9 MB).
        assert_eq!(c.state_bytes(), 150_994_944 + 5_898_240);
        assert_eq!(c.fused_qkv_rows(), 14336);
        // Low-bit bytes at 34/128 B per weight are 6.806 GB of the published 7,165,121,600 B
        // file; the F32 side tensors add about 10.6 MB.
        let f32_bytes: u64 = specs
            .iter()
            .filter(|s| s.class == TypeClass::F32)
            .map(|s| 4 * s.n_elements())
            .sum();
        assert_eq!(c.weight_bytes(), 26_893_352_960 / 128 * 34 + f32_bytes);
        assert!((10_000_000..11_000_000).contains(&f32_bytes), "{f32_bytes}");
        assert!(c.weight_bytes() < 7_165_121_600);
        let g64 = bonsai_27b(QuantType::Q2_0G64);
        assert_eq!(g64.weight_bytes(), 26_893_352_960 / 64 * 18 + f32_bytes);
        assert!(g64.weight_bytes() < 7_585_330_240);
    }

    #[test]
    fn type_classes() {
        assert!(TypeClass::LowBit.allows(QuantType::PQ2_0));
        assert!(!TypeClass::LowBit.allows(QuantType::Q4_1));
        assert!(
            TypeClass::Trunk.allows(QuantType::Q4_1) && !TypeClass::Trunk.allows(QuantType::Q1_0)
        );
        assert!(TypeClass::Embedding.allows(QuantType::Q2_0G128));
        assert!(!TypeClass::F32.allows(QuantType::F16) && TypeClass::Float.allows(QuantType::BF16));
    }
}
