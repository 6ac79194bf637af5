//! `inspect`: a human-readable report on a GGUF file: architecture, sizes, tensor-type histogram,
//! key hyperparameters, a memory estimate per context length and the validation result.
//!
//! It fails only when the container itself cannot be read or parsed; an invalid *model* is reported
//! (the validation error is part of the report).

use std::fmt;
use std::path::{Path, PathBuf};

use crate::config::{architecture, DrafterConfig, TargetConfig, DRAFTER_ARCH};
use crate::error::Result;
use crate::gguf::Gguf;

/// Count and bytes of the tensors of one storage type.
#[derive(Clone, Debug, PartialEq)]
pub struct TypeStat {
    /// `QuantType::name()`, or `type#<id>` for an unknown id.
    pub type_name: String,
    pub count: usize,
    pub bytes: u64,
    pub elements: u64,
}

/// Estimated memory for one sequence at a context length.
#[derive(Clone, Debug, PartialEq)]
pub struct MemEstimate {
    pub n_ctx: usize,
    pub weight_bytes: u64,
    /// GDN recurrent + conv state (f32), per sequence.
    pub state_bytes: u64,
    /// Attention KV at f16 for `n_ctx` tokens.
    pub kv_bytes: u64,
}

impl MemEstimate {
    pub fn total(&self) -> u64 {
        self.weight_bytes + self.state_bytes + self.kv_bytes
    }
}

/// What the validation found.
#[derive(Clone, Debug, PartialEq)]
pub enum Validation {
    Target(TargetConfig),
    Drafter(DrafterConfig),
    /// The error, as `Error::to_string()`, with its kind.
    Invalid {
        kind: &'static str,
        message: String,
    },
}

/// The structured form of [`inspect`].
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    pub path: PathBuf,
    pub file_size: u64,
    pub version: u32,
    pub alignment: u64,
    pub data_start: u64,
    pub architecture: Option<String>,
    pub n_kv: usize,
    pub n_tensors: usize,
    pub n_params: u64,
    /// Sorted by bytes, largest first.
    pub types: Vec<TypeStat>,
    /// Selected metadata as `(key, short value)`.
    pub hparams: Vec<(String, String)>,
    pub memory: Vec<MemEstimate>,
    pub validation: Validation,
}

impl Report {
    /// Build the report for an already parsed file.
    pub fn from_gguf(path: &Path, g: &Gguf) -> Report {
        let mut types: Vec<TypeStat> = Vec::new();
        for t in g.tensors() {
            let name = t.type_name();
            let bytes = if t.qtype.is_some() {
                t.n_bytes as u64
            } else {
                t.extent
            };
            match types.iter_mut().find(|s| s.type_name == name) {
                Some(s) => {
                    s.count += 1;
                    s.bytes = s.bytes.saturating_add(bytes);
                    s.elements = s.elements.saturating_add(t.n_elements());
                }
                None => types.push(TypeStat {
                    type_name: name,
                    count: 1,
                    bytes,
                    elements: t.n_elements(),
                }),
            }
        }
        types.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.type_name.cmp(&b.type_name)));
        let weight_bytes: u64 = types.iter().fold(0u64, |a, s| a.saturating_add(s.bytes));

        let arch = architecture(g).ok().map(str::to_string);
        let validation = match arch.as_deref() {
            Some(DRAFTER_ARCH) => match DrafterConfig::from_gguf(g) {
                Ok(c) => Validation::Drafter(c),
                Err(e) => Validation::Invalid {
                    kind: e.kind(),
                    message: e.to_string(),
                },
            },
            _ => match TargetConfig::from_gguf(g) {
                Ok(c) => Validation::Target(c),
                Err(e) => Validation::Invalid {
                    kind: e.kind(),
                    message: e.to_string(),
                },
            },
        };

        let prefix = arch.as_ref().map(|a| format!("{a}."));
        let general = [
            "general.architecture",
            "general.name",
            "general.file_type",
            "general.alignment",
            "tokenizer.ggml.model",
            "tokenizer.ggml.pre",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.padding_token_id",
        ];
        let mut hparams: Vec<(String, String)> = Vec::new();
        for (k, v) in g.metadata() {
            let by_arch = prefix.as_ref().is_some_and(|p| k.starts_with(p.as_str()));
            if by_arch || general.contains(&k.as_str()) {
                hparams.push((k.clone(), v.to_string()));
            }
        }
        if let Some(n) = g
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.as_array())
            .map(|a| a.len())
        {
            hparams.push(("tokenizer.ggml.tokens".into(), format!("{n} tokens")));
        }
        if g.get("tokenizer.chat_template").is_some() {
            hparams.push(("tokenizer.chat_template".into(), "present".into()));
        }

        let memory = match &validation {
            Validation::Target(c) => {
                let mut ctxs = vec![4096, 32768, c.n_ctx_train];
                ctxs.sort_unstable();
                ctxs.dedup();
                ctxs.into_iter()
                    .map(|n_ctx| MemEstimate {
                        n_ctx,
                        weight_bytes,
                        state_bytes: c.state_bytes() as u64,
                        kv_bytes: (c.kv_bytes_per_token(true) as u64) * n_ctx as u64,
                    })
                    .collect()
            }
            Validation::Drafter(c) => vec![MemEstimate {
                n_ctx: c.n_ctx_train,
                weight_bytes,
                state_bytes: 0,
                kv_bytes: (c.kv_bytes_per_token(true) as u64) * c.n_ctx_train as u64,
            }],
            Validation::Invalid { .. } => {
                vec![MemEstimate {
                    n_ctx: 0,
                    weight_bytes,
                    state_bytes: 0,
                    kv_bytes: 0,
                }]
            }
        };

        Report {
            path: path.to_path_buf(),
            file_size: g.file_len(),
            version: g.version(),
            alignment: g.alignment(),
            data_start: g.data_start(),
            architecture: arch,
            n_kv: g.metadata().len(),
            n_tensors: g.tensors().len(),
            n_params: g
                .tensors()
                .iter()
                .fold(0u64, |a, t| a.saturating_add(t.n_elements())),
            types,
            hparams,
            memory,
            validation,
        }
    }

    pub fn is_valid(&self) -> bool {
        !matches!(self.validation, Validation::Invalid { .. })
    }
}

/// Bytes in binary units with two decimals ("3.58 GiB").
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = b as f64;
    let mut u = 0;
    while x >= 1024.0 && u < UNITS.len() - 1 {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{x:.2} {}", UNITS[u])
    }
}

fn human_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2} B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2} M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.2} K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "file:         {}", self.path.display())?;
        writeln!(
            f,
            "size:         {} ({} bytes)",
            human_bytes(self.file_size),
            self.file_size
        )?;
        writeln!(
            f,
            "container:    GGUF v{}, alignment {}, data at offset {}",
            self.version, self.alignment, self.data_start
        )?;
        writeln!(
            f,
            "architecture: {}",
            self.architecture.as_deref().unwrap_or("(missing)")
        )?;
        writeln!(f, "metadata:     {} keys", self.n_kv)?;
        writeln!(
            f,
            "tensors:      {} ({} parameters)",
            self.n_tensors,
            human_count(self.n_params)
        )?;
        writeln!(f, "\ntensor types:")?;
        for s in &self.types {
            let bpw = if s.elements > 0 {
                s.bytes as f64 * 8.0 / s.elements as f64
            } else {
                0.0
            };
            writeln!(
                f,
                "  {:<12} {:>6} tensors  {:>12}  {:>10} params  {:.3} bpw",
                s.type_name,
                s.count,
                human_bytes(s.bytes),
                human_count(s.elements),
                bpw
            )?;
        }
        writeln!(f, "\nhyperparameters:")?;
        for (k, v) in &self.hparams {
            writeln!(f, "  {k:<44} {v}")?;
        }
        match &self.validation {
            Validation::Target(c) => {
                writeln!(f, "\nmodel:")?;
                writeln!(
                    f,
                    "  layers {} ({} GDN + {} attention, interval {}), n_embd {}, n_ff {}, vocab {}",
                    c.n_layer,
                    c.n_gdn_layers(),
                    c.n_attn_layers(),
                    c.full_attn_interval,
                    c.n_embd,
                    c.n_ff,
                    c.n_vocab
                )?;
                writeln!(
                    f,
                    "  attention {} heads / {} kv x {}, rope {} dims base {}; GDN H_k {} H_v {} d_state {}",
                    c.n_head,
                    c.n_head_kv,
                    c.head_dim,
                    c.n_rot,
                    c.rope_base,
                    c.ssm_n_group,
                    c.ssm_dt_rank,
                    c.ssm_d_state
                )?;
                writeln!(
                    f,
                    "  weights {}, head {}, attention q/k/v {}, stop ids {:?}",
                    c.weight_type.name(),
                    if c.has_output {
                        "untied"
                    } else {
                        "tied to token_embd"
                    },
                    if c.fused_attn_qkv {
                        "fused"
                    } else {
                        "separate"
                    },
                    c.eos_ids
                )?;
            }
            Validation::Drafter(c) => {
                writeln!(f, "\ndrafter:")?;
                writeln!(
                    f,
                    "  layers {}, n_embd {}, heads {} / {} kv x {}, n_ff {}, vocab {}, trained ctx {}",
                    c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_ff, c.n_vocab, c.n_ctx_train
                )?;
                writeln!(
                    f,
                    "  block {}, mask id {}, taps {:?}, markov rank {}, embedding {}, head {}",
                    c.block_size,
                    c.mask_token_id,
                    c.target_layers,
                    c.markov_rank,
                    c.embd_type.name(),
                    c.output_type.name()
                )?;
            }
            Validation::Invalid { .. } => {}
        }
        writeln!(f, "\nmemory estimate (per sequence, f16 KV):")?;
        for m in &self.memory {
            if m.n_ctx == 0 {
                writeln!(f, "  weights {}", human_bytes(m.weight_bytes))?;
            } else {
                writeln!(
                    f,
                    "  ctx {:>7}: weights {} + state {} + KV {} = {}",
                    m.n_ctx,
                    human_bytes(m.weight_bytes),
                    human_bytes(m.state_bytes),
                    human_bytes(m.kv_bytes),
                    human_bytes(m.total())
                )?;
            }
        }
        match &self.validation {
            Validation::Invalid { kind, message } => {
                writeln!(f, "\nvalidation:   FAILED ({kind}): {message}")
            }
            _ => writeln!(f, "\nvalidation:   OK"),
        }
    }
}

/// Parse `path` and build its [`Report`]. Fails only on an unreadable or malformed container.
pub fn report(path: &Path) -> Result<Report> {
    let g = Gguf::open(path)?;
    Ok(Report::from_gguf(path, &g))
}

/// A human-readable report on `path` (see [`Report`]).
pub fn inspect(path: &Path) -> Result<String> {
    Ok(report(path)?.to_string())
}
