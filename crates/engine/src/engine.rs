//! The engine: loads a model, owns a worker thread that runs requests one after another, and streams
//! events back over a channel per request. The worker never touches Python; cancellation is an
//! `AtomicBool` per request checked before every step.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use bonsai_kernels_cpu::par::SpinPool;
use crossbeam_channel::{bounded, unbounded, Receiver, Sender};

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::backend::cuda_drafter::{CudaDraftState, CudaDrafter};
use crate::backend::vulkan::VulkanBackend;
use crate::backend::{Backend, GdnMode, KvType};
use crate::chat::{ChatMessage, ChatTemplate, QWEN35_TEMPLATE};
use crate::config::{architecture, TargetConfig};
use crate::drafter::{DraftState, Drafter};
use crate::error::{Error, Result};
use crate::gguf::Gguf;
use crate::model::{forward, Capture, LogitRows, SeqState, TapRequest, Weights};
use crate::sampling::{RowNeed, Sampled, Sampler, SamplerParams};
use crate::spec::{
    ngram_draft, verify_round, Policy, PolicyMode, Rollback, RoundBufs, SpecStats, Timer,
};
use crate::tokenizer::{StreamDecoder, Tokenizer, TokenizerSpec};

/// Rows per prefill chunk (the default of [`EngineOptions::prefill_chunk`]).
pub const PREFILL_CHUNK: usize = 512;
/// Lineages the prompt cache keeps besides the live one (the default of
/// [`EngineOptions::prompt_cache_entries`]).
pub const PROMPT_CACHE_ENTRIES: usize = 4;

#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Context length; `None` = min(trained context, 4096).
    pub n_ctx: Option<usize>,
    /// Worker threads for the CPU backend; `None` = all cores.
    pub threads: Option<usize>,
    /// "cpu", "auto", "cuda", "vulkan".
    pub device: String,
    /// Speculative decoding: a DSpark drafter file, or n-gram self-speculation.
    pub draft: Option<DraftSource>,
    /// When to draft (only with `draft`).
    pub speculative: PolicyMode,
    /// GDN rollback after a partial accept.
    pub rollback: Rollback,
    /// Attention KV cache storage (f16, or q8_0 on CPU).
    pub kv_type: KvType,
    /// Keep the state at the last prompt's last prefill-chunk boundary, at its last boundary of the
    /// backend's finer prefill split ([`crate::backend::Backend::prefill_granule`]; the CPU's 64
    /// rows) and at the last boundary of the prefix it shared with the prompt before it, and
    /// resume a request whose prompt starts with those tokens from there, computing exactly what a
    /// fresh prefill does ([`Usage::cached_tokens`] counts the tokens skipped).
    pub prompt_cache: bool,
    /// With `prompt_cache`: how many other lineages (other conversations, earlier branches of one)
    /// the cache keeps besides the live sequence's, least recently used dropped first. Each holds a
    /// copy of its KV rows and one to three GDN states in the backend's memory (27B: ~157 MB per
    /// state plus 64 KiB per f16 KV row). 0: only the live sequence's lineage.
    pub prompt_cache_entries: usize,
    /// Prompt rows per prefill forward ([`PREFILL_CHUNK`] by default). Chunks start at its
    /// multiples, and the prompt cache's boundaries are its multiples too.
    pub prefill_chunk: usize,
}

/// Where drafts come from.
#[derive(Clone, Debug)]
pub enum DraftSource {
    /// A `dspark` GGUF.
    Dspark(PathBuf),
    /// N-gram self-speculation over the sequence (no weights).
    Ngram,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            n_ctx: None,
            threads: None,
            device: "auto".into(),
            draft: None,
            speculative: PolicyMode::Auto,
            rollback: Rollback::Replay,
            kv_type: KvType::F16,
            prompt_cache: true,
            prompt_cache_entries: PROMPT_CACHE_ENTRIES,
            prefill_chunk: PREFILL_CHUNK,
        }
    }
}

/// Where a DSpark drafter's context goes when a request's sequence starts at `resume` (0: empty) and
/// the drafter holds positions up to `next_pos`: `Some(resume)` keeps its rows before `resume`,
/// which is possible when a fresh prefill would stage from `resume` or earlier (the window of a
/// `p_len`-token prompt) and the rows reach `resume`; `None` empties it. The drafter's context
/// only steers what it proposes, never what the target accepts: the output is the same either way.
fn draft_resume(next_pos: usize, resume: usize, p_len: usize, window: usize) -> Option<usize> {
    (resume > 0 && next_pos >= resume && p_len.saturating_sub(window) <= resume).then_some(resume)
}

/// Drafts per round (the drafter's block size; n-gram drafts use the same bound).
const NGRAM_K: usize = 4;
/// Longest suffix the n-gram proposer matches.
const NGRAM_MAX_N: usize = 3;

/// The engine's speculative-decoding state visible to callers.
#[derive(Clone, Debug)]
pub struct SpecReport {
    /// "dspark" or "ngram".
    pub kind: &'static str,
    pub policy: Policy,
    pub totals: SpecStats,
    /// DSpark only: the target's embedding is shared (bytes equal).
    pub embd_shared: bool,
    /// DSpark only: drafter context window (rows).
    pub window: usize,
    pub rollback: Rollback,
}

/// What a caller may know about the loaded model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub path: PathBuf,
    pub architecture: String,
    pub name: String,
    pub weight_type: String,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_vocab: usize,
    pub n_ctx: usize,
    pub n_ctx_train: usize,
    pub device: String,
    pub threads: usize,
    pub file_bytes: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

#[derive(Clone, Debug)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub params: SamplerParams,
    pub max_tokens: usize,
    /// Stop strings: generation ends before the first occurrence; the text is not emitted.
    pub stop: Vec<String>,
    /// Extra stop token ids on top of the model's end-of-turn / end-of-text ids.
    pub stop_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// `None`: the engine's policy; `Some(false)`: plain decoding; `Some(true)`: draft every step.
    pub speculative: Option<bool>,
}

#[derive(Clone, Debug)]
pub struct TokenEvent {
    pub id: u32,
    /// Text this token completes (may be empty while a UTF-8 sequence or a possible stop string is
    /// held back).
    pub text: String,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

#[derive(Clone, Debug)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens resumed from the prompt cache instead of prefilled (a multiple of
    /// [`EngineOptions::prefill_chunk`] or of the backend's prefill granule, at most
    /// `prompt_tokens − 1`).
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    /// Time from request start to the first token.
    pub ttft_seconds: f64,
    /// Speculative decoding counters of this request (zero without a drafter).
    pub spec: SpecStats,
}

#[derive(Debug)]
pub enum Event {
    Token(TokenEvent),
    /// Text released at the end without a token of its own (held-back bytes, stop-string prefix).
    Text(String),
    Done {
        reason: FinishReason,
        usage: Usage,
    },
    Error(Error),
}

enum Cmd {
    Generate {
        req: GenRequest,
        events: Sender<Event>,
        cancel: Arc<AtomicBool>,
    },
    Logits {
        ids: Vec<u32>,
        chunked: bool,
        reply: Sender<Result<Vec<f32>>>,
    },
    Shutdown,
}

/// A loaded model with its worker. Cheap to share behind an `Arc`; all methods take `&self`.
pub struct Engine {
    tx: Sender<Cmd>,
    worker: Option<JoinHandle<()>>,
    info: ModelInfo,
    cfg: TargetConfig,
    tokenizer: Arc<Tokenizer>,
    template: ChatTemplate,
    stop_ids: Vec<u32>,
    spec: Option<Arc<Mutex<SpecReport>>>,
}

/// The tokenizer described by a GGUF's `tokenizer.ggml.*` arrays.
pub fn tokenizer_from_gguf(g: &Gguf) -> Result<Tokenizer> {
    let model = g.get_str("tokenizer.ggml.model")?.to_string();
    let tokens: Vec<String> = g
        .get_str_array("tokenizer.ggml.tokens")?
        .into_iter()
        .map(String::from)
        .collect();
    let token_types = match g.get("tokenizer.ggml.token_type") {
        Some(_) => g.get_i32_array("tokenizer.ggml.token_type")?,
        None => vec![1; tokens.len()],
    };
    let merges = match g.get("tokenizer.ggml.merges") {
        Some(_) => g
            .get_str_array("tokenizer.ggml.merges")?
            .into_iter()
            .map(String::from)
            .collect(),
        None => Vec::new(),
    };
    let pre = match g.get("tokenizer.ggml.pre") {
        Some(_) => g.get_str("tokenizer.ggml.pre")?.to_string(),
        None => "qwen35".to_string(),
    };
    Tokenizer::new(TokenizerSpec {
        tokens,
        token_types,
        merges,
        pre,
        model,
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Device {
    Cpu,
    Cuda,
    Vulkan,
}

/// `auto` picks CUDA when a driver and a device are present, then a Vulkan GPU (never a CPU
/// implementation such as llvmpipe), else the CPU. `"vulkan"` takes any Vulkan device, a CPU one
/// included. Speculative decoding runs on every backend (on CUDA the target's verify and rollback
/// run on the device, and so does the DSpark drafter unless `BONSAI_GPU_DRAFTER=0`; on Vulkan the
/// verify and rollback run on the device and the drafter on the host).
fn resolve_device(device: &str) -> Result<Device> {
    match device {
        "cpu" => Ok(Device::Cpu),
        "auto" => Ok(if CudaBackend::available() {
            Device::Cuda
        } else if VulkanBackend::available() {
            Device::Vulkan
        } else {
            Device::Cpu
        }),
        "cuda" => {
            if CudaBackend::available() {
                Ok(Device::Cuda)
            } else {
                Err(Error::BackendUnavailable(
                    "device=\"cuda\": no CUDA driver (libcuda) or no CUDA device found; use device=\"cpu\" or \"auto\"".into(),
                ))
            }
        }
        "vulkan" => match bonsai_kernels_vulkan::Vulkan::devices() {
            Ok(d) if !d.is_empty() => Ok(Device::Vulkan),
            Ok(_) => Err(Error::BackendUnavailable(
                "device=\"vulkan\": the Vulkan loader found no device with Vulkan 1.2 and bufferDeviceAddress; use device=\"cpu\" or \"auto\"".into(),
            )),
            Err(e) => Err(Error::BackendUnavailable(format!(
                "device=\"vulkan\": {e}; install a Vulkan driver (libvulkan1 and an ICD) or use device=\"cpu\" or \"auto\""
            ))),
        },
        other => Err(Error::InvalidRequest(format!(
            "unknown device {other:?}; expected one of \"auto\", \"cpu\", \"cuda\", \"vulkan\""
        ))),
    }
}

type Started = (
    Sender<Cmd>,
    JoinHandle<()>,
    Option<Arc<Mutex<SpecReport>>>,
    String,
);

/// Load weights on `backend`, build the per-sequence state (and the speculative context when a
/// draft source is given), and start the worker thread inside `pool`. The only place that is
/// generic over the backend at start-up; `Engine::load` matches on the device once.
#[allow(clippy::too_many_arguments)]
fn start_worker<B: Backend>(
    backend: B,
    gpu: Option<Arc<bonsai_kernels_cuda::Gpu>>,
    device: &str,
    pool: rayon::ThreadPool,
    spin: Option<SpinPool>,
    g: &Arc<Gguf>,
    cfg: &TargetConfig,
    n_ctx: usize,
    opts: &EngineOptions,
    tokenizer: &Arc<Tokenizer>,
    stop_ids: &[u32],
) -> Result<Started> {
    let weights = pool.install(|| Weights::load(&backend, g, cfg))?;
    let state = SeqState::new(&backend, cfg, n_ctx)?;
    let mut spec_ctx = None;
    if let Some(src) = &opts.draft {
        let (proposer, kind, embd_shared, window) = match src {
            DraftSource::Dspark(p) => {
                let d = pool.install(|| Drafter::load(p, g, cfg))?;
                let (shared, window) = (d.embd_shared, d.window());
                match gpu.filter(|_| gpu_drafter_enabled()) {
                    Some(gpu) => {
                        let d = pool.install(|| CudaDrafter::new(gpu, d))?;
                        let st = d.new_state()?;
                        // the verify's taps stay on the device, where the drafter stages them
                        if let Some(cuda) = as_cuda(&backend) {
                            cuda.set_verify_taps_on_host(false);
                        }
                        let p = Proposer::DsparkGpu(Box::new(d), Box::new(st));
                        (p, "dspark", shared, window)
                    }
                    None => {
                        let st = d.new_state();
                        (Proposer::Dspark(Box::new(d), st), "dspark", shared, window)
                    }
                }
            }
            DraftSource::Ngram => (Proposer::Ngram, "ngram", false, 0),
        };
        let report = Arc::new(Mutex::new(SpecReport {
            kind,
            policy: Policy::new(opts.speculative),
            totals: SpecStats::default(),
            embd_shared,
            window,
            rollback: opts.rollback,
        }));
        spec_ctx = Some(SpecCtx {
            proposer,
            bufs: RoundBufs::new(&backend, cfg, NGRAM_K + 1)?,
            rollback: opts.rollback,
            report,
        });
    }
    let spec_report = spec_ctx.as_ref().map(|c| c.report.clone());
    let device_name = format!("{device}: {}", pool.install(|| backend.name()));
    let granule = backend
        .prefill_granule()
        .filter(|&g| g > 0 && opts.prefill_chunk % g == 0)
        .unwrap_or(opts.prefill_chunk);
    let (tx, rx) = unbounded::<Cmd>();
    let worker = Worker {
        backend,
        cfg: cfg.clone(),
        weights,
        state,
        tokenizer: tokenizer.clone(),
        stop_ids: stop_ids.to_vec(),
        spec: spec_ctx,
        cache: opts
            .prompt_cache
            .then(|| PromptCache::new(opts.prompt_cache_entries)),
        cached: 0,
        chunk: opts.prefill_chunk,
        granule,
    };
    let handle = std::thread::Builder::new()
        .name("bonsai-engine".into())
        .spawn(move || {
            pool.install(|| match &spin {
                // the forward's parallel loops on the spinning pool (bonsai_kernels_cpu::par)
                Some(sp) => sp.install(|| worker.run(rx)),
                None => worker.run(rx),
            })
        })
        .map_err(|e| Error::Backend(format!("cannot start the engine thread: {e}")))?;
    Ok((tx, handle, spec_report, device_name))
}

impl Engine {
    pub fn load(path: &Path, opts: &EngineOptions) -> Result<Engine> {
        let device = resolve_device(&opts.device)?;
        let g = Arc::new(Gguf::open(path)?);
        let arch = architecture(&g)?.to_string();
        let cfg = TargetConfig::from_gguf(&g)?;
        let tokenizer = Arc::new(tokenizer_from_gguf(&g)?);
        let template_src = match g.get("tokenizer.chat_template") {
            Some(_) => g.get_str("tokenizer.chat_template")?.to_string(),
            None => QWEN35_TEMPLATE.to_string(),
        };
        let template = ChatTemplate::new(&template_src)?;
        if opts.prefill_chunk == 0 {
            return Err(Error::InvalidRequest("prefill_chunk must be ≥ 1".into()));
        }
        let n_ctx = opts.n_ctx.unwrap_or_else(|| cfg.n_ctx_train.min(4096));
        if n_ctx < 2 || n_ctx > cfg.n_ctx_train {
            return Err(Error::InvalidRequest(format!(
                "n_ctx {n_ctx} is outside 2..={} (the model's trained context)",
                cfg.n_ctx_train
            )));
        }
        let mut stop_ids = cfg.eos_ids.clone();
        for s in ["<|im_end|>", "<|endoftext|>"] {
            if let Some(id) = tokenizer.token_id(s) {
                stop_ids.push(id);
            }
        }
        stop_ids.sort_unstable();
        stop_ids.dedup();
        let threads = opts
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        if threads == 0 {
            return Err(Error::InvalidRequest("threads must be ≥ 1".into()));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("bonsai-cpu-{i}"))
            .build()
            .map_err(|e| Error::Backend(format!("cannot start {threads} threads: {e}")))?;
        if device == Device::Cpu {
            cpu_malloc_tune();
        }
        let started = match device {
            Device::Cpu => start_worker(
                CpuBackend::new(opts.kv_type),
                None,
                "cpu",
                pool,
                cpu_spin_pool(threads)?,
                &g,
                &cfg,
                n_ctx,
                opts,
                &tokenizer,
                &stop_ids,
            )?,
            Device::Cuda => {
                if opts.kv_type != KvType::F16 {
                    return Err(Error::BackendUnavailable(format!(
                        "kv_cache=\"{}\" is available on the CPU and Vulkan backends only in this version; the CUDA backend uses f16",
                        opts.kv_type.name()
                    )));
                }
                let b = CudaBackend::new(0)?;
                let gpu = Some(b.gpu_arc());
                start_worker(
                    b, gpu, "cuda", pool, None, &g, &cfg, n_ctx, opts, &tokenizer, &stop_ids,
                )?
            }
            Device::Vulkan => {
                let b = VulkanBackend::new(true, opts.kv_type)?;
                start_worker(
                    b, None, "vulkan", pool, None, &g, &cfg, n_ctx, opts, &tokenizer, &stop_ids,
                )?
            }
        };
        let (tx, handle, spec_report, device_name) = started;
        let info = ModelInfo {
            path: path.to_path_buf(),
            architecture: arch,
            name: g
                .get("general.name")
                .and_then(|v| v.as_str())
                .unwrap_or("")
                .to_string(),
            weight_type: cfg.weight_type.name().to_string(),
            n_layer: cfg.n_layer,
            n_embd: cfg.n_embd,
            n_vocab: cfg.n_vocab,
            n_ctx,
            n_ctx_train: cfg.n_ctx_train,
            device: device_name,
            threads,
            file_bytes: g.file_len(),
        };
        Ok(Engine {
            tx,
            worker: Some(handle),
            info,
            cfg,
            tokenizer,
            template,
            stop_ids,
            spec: spec_report,
        })
    }

    /// Speculative decoding: the policy with its decisions and the engine-wide counters
    /// (`None` without a drafter).
    pub fn spec_report(&self) -> Option<SpecReport> {
        self.spec
            .as_ref()
            .map(|r| r.lock().expect("spec report lock").clone())
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }
    pub fn config(&self) -> &TargetConfig {
        &self.cfg
    }
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    pub fn tokenize(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        self.tokenizer.encode(text, special)
    }

    pub fn detokenize(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids)
    }

    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        enable_thinking: bool,
        tools: Option<&serde_json::Value>,
        extra: Option<&serde_json::Value>,
    ) -> Result<String> {
        self.template.render(
            messages,
            add_generation_prompt,
            enable_thinking,
            tools,
            extra,
        )
    }

    /// Validate a request and queue it. Events arrive on the returned receiver; setting the returned
    /// flag cancels the request within one step.
    pub fn submit(&self, req: GenRequest) -> Result<(Receiver<Event>, Arc<AtomicBool>)> {
        self.validate(&req)?;
        let (etx, erx) = unbounded();
        let cancel = Arc::new(AtomicBool::new(false));
        self.tx
            .send(Cmd::Generate {
                req,
                events: etx,
                cancel: cancel.clone(),
            })
            .map_err(|_| Error::EngineStopped("the engine thread has exited".into()))?;
        Ok((erx, cancel))
    }

    fn validate(&self, req: &GenRequest) -> Result<()> {
        req.params.validate(self.cfg.n_vocab)?;
        if req.prompt.is_empty() {
            return Err(Error::InvalidRequest("the prompt is empty".into()));
        }
        if req.max_tokens == 0 {
            return Err(Error::InvalidRequest("max_tokens must be ≥ 1".into()));
        }
        if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= self.cfg.n_vocab) {
            return Err(Error::InvalidRequest(format!(
                "prompt token id {bad} is out of range (vocabulary has {} rows)",
                self.cfg.n_vocab
            )));
        }
        if req.prompt.len() >= self.info.n_ctx {
            return Err(Error::ContextOverflow(format!(
                "the prompt has {} tokens but the context is {} (at least one position must remain for generation)",
                req.prompt.len(),
                self.info.n_ctx
            )));
        }
        if req.stop.iter().any(|s| s.is_empty()) {
            return Err(Error::InvalidRequest(
                "stop strings must not be empty".into(),
            ));
        }
        Ok(())
    }

    /// Logits of every row of a fresh sequence over `ids` (oracle tests and debugging).
    /// `chunked`: prefill in chunks with the chunked GDN; otherwise one token at a time.
    /// Returns `[ids.len(), n_vocab]` row-major.
    pub fn logits(&self, ids: &[u32], chunked: bool) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Err(Error::InvalidRequest("logits of an empty sequence".into()));
        }
        if ids.len() > self.info.n_ctx {
            return Err(Error::ContextOverflow(format!(
                "{} tokens, context is {}",
                ids.len(),
                self.info.n_ctx
            )));
        }
        let (tx, rx) = bounded(1);
        self.tx
            .send(Cmd::Logits {
                ids: ids.to_vec(),
                chunked,
                reply: tx,
            })
            .map_err(|_| Error::EngineStopped("the engine thread has exited".into()))?;
        rx.recv()
            .map_err(|_| Error::EngineStopped("the engine thread has exited".into()))?
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.tx.send(Cmd::Shutdown);
        if let Some(h) = self.worker.take() {
            let _ = h.join();
        }
    }
}

struct Worker<B: Backend> {
    backend: B,
    cfg: TargetConfig,
    weights: Weights<B>,
    state: SeqState<B>,
    tokenizer: Arc<Tokenizer>,
    stop_ids: Vec<u32>,
    spec: Option<SpecCtx<B>>,
    /// `None` with `prompt_cache` off.
    cache: Option<PromptCache<B>>,
    /// Prompt tokens the current request resumed from the cache.
    cached: usize,
    /// Rows per prefill forward.
    chunk: usize,
    /// The prompt cache's boundaries are its multiples: the backend's prefill granule where that
    /// divides `chunk`, else `chunk`.
    granule: usize,
}

/// The prompt cache. The live lineage: GDN states saved at prefill boundaries of the prompt the
/// live KV rows were prefilled from, whose attention KV rows are still the live cache's first rows.
/// Three slots ([`Slot`]): `Last`, the start of that prompt's last prefill chunk; `Tail`, the last
/// boundary before its end at the backend's finer split ([`Backend::prefill_granule`]; the next
/// turn of a chat starts with the whole prompt, and resumes there); and `Shared`, the last boundary
/// inside the prefix it shared with a prompt before it (a system prompt that many conversations
/// start with).
///
/// Other lineages (other conversations, an earlier branch of this one) wait in `stash`, at most
/// `cap` of them, least recently used first, each with its slots and a copy of the KV rows they
/// cover. The live lineage goes there when a request would overwrite the rows of its furthest slot:
/// another lineage resumes, a fresh prefill starts, or the request resumes at an earlier slot.
///
/// A prompt that starts with a slot's tokens and is longer resumes at the longest such slot, live or
/// stashed (the live one on a tie): the GDN states are copied back, the KV is truncated to the
/// boundary (after a stashed lineage's rows are copied in), and prefill runs from it. A stashed
/// lineage resumed at its furthest slot becomes the live one and leaves the stash; resumed at an
/// earlier slot it is copied and stays. Every boundary is a multiple of the prefill granule, which
/// divides the prefill chunk, and a prefill split at such multiples gives every row the bits of a
/// fresh chunked prefill (the granule is the chunk itself where the backend promises nothing finer),
/// so a resumed request computes exactly what a fresh one does: the same logits, bit for bit. The
/// state after generated tokens is not kept: those went through decode steps, whose float order
/// differs from a chunked prefill's.
struct PromptCache<B: Backend> {
    /// The prompt prefix every valid live slot's tokens are a prefix of (the live KV rows' tokens;
    /// as long as the furthest slot).
    tokens: Vec<u32>,
    /// Indexed by [`Slot`].
    slots: [Snapshot<B>; 3],
    /// Stashed lineages, least recently used first.
    stash: Vec<Stashed<B>>,
    /// The most lineages `stash` holds ([`EngineOptions::prompt_cache_entries`]).
    cap: usize,
    /// GDN buffers of dropped slots, reused by the next save.
    spare: Vec<Vec<B::Gdn>>,
}

/// A prompt cache slot (see [`PromptCache`]).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Slot {
    Last = 0,
    Tail = 1,
    Shared = 2,
}

/// Every GDN layer's state after the first `len` tokens of its lineage (`len` 0: empty; the buffers
/// are allocated at the first save).
struct Snapshot<B: Backend> {
    len: usize,
    gdn: Vec<B::Gdn>,
}

impl<B: Backend> Default for Snapshot<B> {
    fn default() -> Self {
        Snapshot {
            len: 0,
            gdn: Vec::new(),
        }
    }
}

/// The furthest of `slots` (0: none).
fn top_slot<B: Backend>(slots: &[Snapshot<B>; 3]) -> usize {
    slots.iter().map(|s| s.len).max().unwrap_or(0)
}

/// A lineage out of the live KV cache.
struct Stashed<B: Backend> {
    /// `[top]`: the tokens of the rows `kv` holds; `top` is the furthest slot's length.
    tokens: Vec<u32>,
    slots: [Snapshot<B>; 3],
    /// Per attention layer, a copy of the KV rows `0..top`.
    kv: Vec<B::Kv>,
}

/// Where a request's sequence starts ([`Worker::resume_prompt`]).
struct Resume {
    /// Prompt tokens resumed from the cache (0: a fresh sequence).
    len: usize,
    /// On a fresh sequence: the last granule boundary inside the prefix the prompt shares with a
    /// cached lineage's tokens, where [`Worker::save_prompt`] keeps the `Shared` slot (0: none).
    shared: usize,
    /// The rows before `len` are the live sequence's own (false: another lineage's were copied in,
    /// or the sequence starts empty).
    same_sequence: bool,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<B: Backend> PromptCache<B> {
    fn new(cap: usize) -> Self {
        PromptCache {
            tokens: Vec::new(),
            slots: Default::default(),
            stash: Vec::new(),
            cap,
            spare: Vec::new(),
        }
    }

    /// Forget the live lineage's slots (the stash stays).
    fn clear(&mut self) {
        self.tokens.clear();
        for s in &mut self.slots {
            s.len = 0;
        }
    }

    /// Keep a slot's GDN buffers for the next save (as many as the live lineage has slots).
    fn recycle(&mut self, s: Snapshot<B>) {
        if !s.gdn.is_empty() && self.spare.len() < self.slots.len() {
            self.spare.push(s.gdn);
        }
    }

    fn recycle_entry(&mut self, e: Stashed<B>) {
        for s in e.slots {
            self.recycle(s);
        }
    }

    /// Forget the live slots past `keep` and the tokens past it.
    fn forget_past(&mut self, keep: usize) {
        for s in &mut self.slots {
            if s.len > keep {
                s.len = 0;
            }
        }
        self.tokens.truncate(keep);
    }

    /// The live lineage is about to lose its rows past `keep`: move its slots past `keep` into the
    /// stash with a copy of the KV rows up to its furthest slot (the live KV is truncated there).
    /// Without room (`cap` 0) or memory for the copy, those slots are forgotten instead.
    fn stash_live(&mut self, b: &B, cfg: &TargetConfig, st: &mut SeqState<B>, keep: usize) {
        let top = top_slot(&self.slots);
        if top <= keep {
            return;
        }
        if self.cap == 0 {
            return self.forget_past(keep);
        }
        let mut kv = Vec::with_capacity(st.kv.len());
        for live in &mut st.kv {
            b.truncate_kv(live, top);
            match b.new_kv(cfg, top) {
                Ok(mut copy) => {
                    b.copy_kv(live, &mut copy);
                    kv.push(copy);
                }
                Err(e) => {
                    eprintln!(
                        "bonsai: prompt cache: a conversation is not kept (its KV copy: {e})"
                    );
                    return self.forget_past(keep);
                }
            }
        }
        let take = |s: &mut Snapshot<B>| {
            if s.len > keep {
                std::mem::take(s)
            } else {
                Snapshot::default()
            }
        };
        let [l, t, sh] = &mut self.slots;
        let entry = Stashed {
            tokens: self.tokens[..top].to_vec(),
            slots: [take(l), take(t), take(sh)],
            kv,
        };
        self.tokens.truncate(keep);
        // an entry of the same rows is superseded
        if let Some(i) = self.stash.iter().position(|e| e.tokens == entry.tokens) {
            let old = self.stash.remove(i);
            self.recycle_entry(old);
        }
        self.push_entry(entry);
    }

    /// Put `e` in the stash as its most recently used entry, dropping the least recently used past
    /// `cap`.
    fn push_entry(&mut self, e: Stashed<B>) {
        self.stash.push(e);
        while self.stash.len() > self.cap {
            let old = self.stash.remove(0);
            self.recycle_entry(old);
        }
    }

    /// Copy stashed lineage `e`'s KV rows and the GDN state of its slot of length `len` into the
    /// live sequence (whose slots are empty). At its furthest slot the lineage is the live one from
    /// now on; otherwise it goes back to the stash (most recently used) and the live lineage is its
    /// first `len` tokens, with no slot yet.
    fn restore(&mut self, b: &B, st: &mut SeqState<B>, e: Stashed<B>, len: usize) -> Result<()> {
        for (live, copy) in st.kv.iter_mut().zip(&e.kv) {
            b.copy_kv(copy, live);
            b.truncate_kv(live, len);
        }
        let slot = e
            .slots
            .iter()
            .find(|s| s.len == len)
            .ok_or_else(|| Error::Backend(format!("prompt cache: no slot of {len} tokens")))?;
        b.copy_gdn_all(&slot.gdn, &mut st.gdn)?;
        st.pos = len;
        if len == top_slot(&e.slots) {
            let old = std::mem::replace(&mut self.slots, e.slots);
            for s in old {
                self.recycle(s);
            }
            self.tokens = e.tokens;
        } else {
            self.tokens.clear();
            self.tokens.extend_from_slice(&e.tokens[..len]);
            for s in &mut self.slots {
                s.len = 0;
            }
            self.push_entry(e);
        }
        Ok(())
    }
}

/// The CUDA backend behind a generic one, if that is what it is.
fn as_cuda<B: Backend + 'static>(b: &B) -> Option<&CudaBackend> {
    (b as &dyn std::any::Any).downcast_ref::<CudaBackend>()
}

enum Proposer {
    /// The host drafter (CPU backend, or `BONSAI_GPU_DRAFTER=0`).
    Dspark(Box<Drafter>, DraftState),
    /// The drafter on the GPU (CUDA backend; same stream as the target).
    DsparkGpu(Box<CudaDrafter>, Box<CudaDraftState>),
    Ngram,
}

/// The CPU forward allocates its activation buffers per op (a prefill chunk's are megabytes).
/// glibc serves such blocks with `mmap` and returns them with `munmap`, so every op paid fresh
/// zeroed page faults, and every free a TLB shootdown on the cores running the pool. With the
/// mmap threshold at glibc's maximum (32 MiB) and freed heap kept (trim threshold 1 GiB), the
/// blocks are reused instead: on the 2-core development VM the `small` 512-token prefill went
/// 1.30–1.36 → 1.05–1.21 s (the time outside the parallel loops 257–276 → 62–115 ms).
/// Process-wide and once; `BONSAI_CPU_MALLOC=0` leaves glibc's defaults (the cost: up to 1 GiB of
/// freed memory kept by the process instead of returned to the system).
fn cpu_malloc_tune() {
    if std::env::var("BONSAI_CPU_MALLOC").as_deref() == Ok("0") {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: mallopt only changes glibc's allocation thresholds; it is called before the
            // CPU forward allocates, and glibc serializes it with its own arena locks.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
                libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
            }
        });
    }
}

/// The CPU forward's spinning thread pool (`bonsai_kernels_cpu::par::SpinPool`) of `threads`
/// threads in all, for 4 threads or more: its workers wait for the next parallel loop spinning,
/// for `BONSAI_CPU_SPIN_US` µs (default 1000) after the last one, then park. `BONSAI_CPU_SPIN=0`
/// never, `=1` from 2 threads: otherwise the loops run on the engine's rayon pool (whose idle
/// threads park at once; on the 2-core development VM rayon was ~5 % faster).
fn cpu_spin_pool(threads: usize) -> Result<Option<SpinPool>> {
    let min_threads = match std::env::var("BONSAI_CPU_SPIN").as_deref() {
        Ok("0") => return Ok(None),
        Ok("1") => 2,
        _ => 4,
    };
    if threads < min_threads {
        return Ok(None);
    }
    let us = match std::env::var("BONSAI_CPU_SPIN_US") {
        Ok(v) => v.trim().parse::<u64>().map_err(|_| {
            Error::InvalidRequest(format!(
                "BONSAI_CPU_SPIN_US={v:?} is not a whole number of µs"
            ))
        })?,
        Err(_) => 1000,
    };
    SpinPool::new(threads, std::time::Duration::from_micros(us))
        .map(Some)
        .map_err(|e| Error::Backend(format!("cannot start {threads} spinning threads: {e}")))
}

/// `BONSAI_GPU_DRAFTER=0` keeps the DSpark drafter on the host with the CUDA backend (default: on
/// the GPU).
fn gpu_drafter_enabled() -> bool {
    std::env::var("BONSAI_GPU_DRAFTER").map_or(true, |v| v != "0")
}

/// The worker's speculative-decoding context.
struct SpecCtx<B: Backend> {
    proposer: Proposer,
    bufs: RoundBufs<B>,
    rollback: Rollback,
    report: Arc<Mutex<SpecReport>>,
}

/// Per-request output bookkeeping: streaming detokenization, stop strings, counts.
struct Emitter {
    dec: StreamDecoder,
    stops: StopFilter,
    n_gen: usize,
    ttft: Option<f64>,
}

/// Holds back text that could still become a stop string.
struct StopFilter {
    stops: Vec<String>,
    pending: String,
}

impl StopFilter {
    /// Add text; returns (text safe to emit, stop hit).
    fn push(&mut self, s: &str) -> (String, bool) {
        self.pending.push_str(s);
        if self.stops.is_empty() {
            return (std::mem::take(&mut self.pending), false);
        }
        if let Some(i) = self
            .stops
            .iter()
            .filter_map(|st| self.pending.find(st.as_str()))
            .min()
        {
            let out = self.pending[..i].to_string();
            self.pending.clear();
            return (out, true);
        }
        // keep the longest suffix of pending that is a proper prefix of some stop string
        let mut keep = 0;
        for st in &self.stops {
            for (i, _) in st.char_indices().skip(1) {
                if i <= self.pending.len() && self.pending.ends_with(&st[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }
}

impl<B: Backend> Worker<B> {
    fn run(mut self, rx: Receiver<Cmd>) {
        while let Ok(cmd) = rx.recv() {
            match cmd {
                Cmd::Shutdown => break,
                Cmd::Logits {
                    ids,
                    chunked,
                    reply,
                } => {
                    let r = self.all_logits(&ids, chunked);
                    let _ = reply.send(r);
                }
                Cmd::Generate {
                    req,
                    events,
                    cancel,
                } => {
                    let t0 = Instant::now();
                    bonsai_kernels_cpu::par::take_stats();
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        self.generate(&req, &events, &cancel)
                    }));
                    if let Some((loops, inside)) = bonsai_kernels_cpu::par::take_stats() {
                        // BONSAI_CPU_PAR_STATS=1: where a request's CPU time went
                        let all = t0.elapsed();
                        eprintln!(
                            "bonsai par stats: request {:.1} ms, {loops} parallel loops, {:.1} ms inside them, {:.1} ms outside",
                            all.as_secs_f64() * 1e3,
                            inside.as_secs_f64() * 1e3,
                            all.saturating_sub(inside).as_secs_f64() * 1e3
                        );
                    }
                    match r {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            let _ = events.send(Event::Error(e));
                        }
                        Err(p) => {
                            let msg = p
                                .downcast_ref::<String>()
                                .cloned()
                                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                                .unwrap_or_else(|| "unknown panic".into());
                            let _ = events.send(Event::Error(Error::Backend(format!(
                                "internal error: {msg}"
                            ))));
                            // the sequence state may be half-updated: start clean
                            self.forget_prompt(true);
                            self.state.reset(&self.backend);
                        }
                    }
                }
            }
        }
    }

    fn all_logits(&mut self, ids: &[u32], chunked: bool) -> Result<Vec<f32>> {
        let nv = self.cfg.n_vocab;
        self.forget_prompt(false);
        self.state.reset(&self.backend);
        let mut out = Vec::with_capacity(ids.len() * nv);
        let mut buf = Vec::new();
        if chunked {
            for chunk in ids.chunks(self.chunk) {
                forward(
                    &self.backend,
                    &self.cfg,
                    &self.weights,
                    &mut self.state,
                    chunk,
                    GdnMode::Chunked,
                    LogitRows::All,
                    &mut buf,
                    Capture::none(),
                )?;
                out.extend_from_slice(&buf);
            }
        } else {
            for &id in ids {
                forward(
                    &self.backend,
                    &self.cfg,
                    &self.weights,
                    &mut self.state,
                    &[id],
                    GdnMode::Recurrent,
                    LogitRows::All,
                    &mut buf,
                    Capture::none(),
                )?;
                out.extend_from_slice(&buf);
            }
        }
        Ok(out)
    }

    /// Start a request's sequence: resume from the prompt cache's longest slot, live or stashed,
    /// that `prompt` starts with and is longer than, or start empty (see [`PromptCache`]). The
    /// live lineage goes to the stash first where the sequence would lose its furthest slot's rows.
    fn resume_prompt(&mut self, prompt: &[u32]) -> Result<Resume> {
        let granule = self.granule;
        let Some(c) = &mut self.cache else {
            self.state.reset(&self.backend);
            return Ok(Resume {
                len: 0,
                shared: 0,
                same_sequence: false,
            });
        };
        let fits = |len: usize, common: usize| len > 0 && len <= common && len < prompt.len();
        let common_live = common_prefix(prompt, &c.tokens);
        let live = c
            .slots
            .iter()
            .map(|s| s.len)
            .filter(|&l| fits(l, common_live))
            .max()
            .unwrap_or(0);
        let mut common_any = common_live;
        // the stash's longest fitting slot: (length, entry)
        let mut stashed: Option<(usize, usize)> = None;
        for (i, e) in c.stash.iter().enumerate() {
            let common = common_prefix(prompt, &e.tokens);
            common_any = common_any.max(common);
            for l in e.slots.iter().map(|s| s.len) {
                if fits(l, common) && stashed.is_none_or(|(best, _)| l > best) {
                    stashed = Some((l, i));
                }
            }
        }
        let (b, cfg, st) = (&self.backend, &self.cfg, &mut self.state);
        if let Some((len, i)) = stashed.filter(|&(len, _)| len > live) {
            let e = c.stash.remove(i);
            c.stash_live(b, cfg, st, 0);
            c.restore(b, st, e, len)?;
            return Ok(Resume {
                len,
                shared: 0,
                same_sequence: false,
            });
        }
        if live > 0 {
            c.stash_live(b, cfg, st, live);
            let slot = c
                .slots
                .iter()
                .find(|s| s.len == live)
                .expect("the live slot");
            b.copy_gdn_all(&slot.gdn, &mut st.gdn)?;
            for kv in &mut st.kv {
                b.truncate_kv(kv, live);
            }
            st.pos = live;
            return Ok(Resume {
                len: live,
                shared: 0,
                same_sequence: true,
            });
        }
        c.stash_live(b, cfg, st, 0);
        c.clear();
        st.reset(b);
        Ok(Resume {
            len: 0,
            shared: common_any.min(prompt.len().saturating_sub(1)) / granule * granule,
            same_sequence: false,
        })
    }

    /// Put the live GDN state, which is the state after `prefix`, into the prompt cache's slot
    /// `which`. Where its buffers cannot be allocated the cache turns off (a warning on stderr) and
    /// the request goes on.
    fn save_prompt(&mut self, prefix: &[u32], which: Slot) -> Result<()> {
        let Some(c) = &mut self.cache else {
            return Ok(());
        };
        debug_assert_eq!(prefix.len(), self.state.pos);
        let slot = &mut c.slots[which as usize];
        if slot.gdn.is_empty() {
            if let Some(g) = c.spare.pop() {
                slot.gdn = g;
            } else {
                let bufs: Result<Vec<_>> = (0..self.state.gdn.len())
                    .map(|_| self.backend.new_gdn(&self.cfg))
                    .collect();
                match bufs {
                    Ok(g) => slot.gdn = g,
                    Err(e) => {
                        eprintln!("bonsai: prompt cache off (its state buffers: {e})");
                        self.cache = None;
                        return Ok(());
                    }
                }
            }
        }
        slot.len = 0;
        self.backend.copy_gdn_all(&self.state.gdn, &mut slot.gdn)?;
        slot.len = prefix.len();
        c.tokens.clear();
        c.tokens.extend_from_slice(prefix);
        Ok(())
    }

    /// Forget the live lineage (the live KV rows are about to change from position 0); `all`: the
    /// stash too.
    fn forget_prompt(&mut self, all: bool) {
        if let Some(c) = &mut self.cache {
            c.clear();
            if all {
                c.stash.clear();
            }
        }
    }

    fn generate(
        &mut self,
        req: &GenRequest,
        events: &Sender<Event>,
        cancel: &AtomicBool,
    ) -> Result<()> {
        let t0 = Instant::now();
        let n_ctx = self.state.n_ctx;
        let p_len = req.prompt.len();
        // the sequence resumes at `resume` (the prompt cache) or starts empty
        let Resume {
            len: resume,
            shared,
            same_sequence,
        } = self.resume_prompt(&req.prompt)?;
        self.cached = resume;
        let use_spec = self.spec.is_some() && req.speculative != Some(false);
        let force = req.speculative == Some(true);
        let mut stats = SpecStats::default();
        // DSpark: the tap layers and window. The drafter's context restarts with the sequence, or
        // keeps its rows before a boundary resumed in the same sequence (every request, drafting or
        // not, so that its rows always belong to the live sequence).
        let own = if same_sequence { resume } else { 0 };
        let (tap_layers, window) = match self.spec.as_mut().map(|c| &mut c.proposer) {
            Some(Proposer::Dspark(d, st)) => {
                match draft_resume(st.next_pos(), own, p_len, d.window()) {
                    Some(p) => st.truncate(p),
                    None => st.reset(),
                }
                (Some(d.cfg.target_layers.clone()), d.window())
            }
            Some(Proposer::DsparkGpu(d, st)) => {
                match draft_resume(st.next_pos(), own, p_len, d.window()) {
                    Some(p) => st.truncate(p),
                    None => st.reset(),
                }
                (Some(d.cfg.target_layers.clone()), d.window())
            }
            _ => (None, 0),
        };
        let (tap_layers, window) = if use_spec {
            (tap_layers, window)
        } else {
            (None, 0)
        };
        let mut logits = Vec::new();
        // a row's best entries, when the backend computes them for the sampler
        let mut top: Vec<(u32, f32)> = Vec::new();
        let mut taps = Vec::new();
        // Prefill in chunks from `resume` (chunks start at multiples of the chunk either way);
        // logits only for the last row of the last chunk. With a drafter, the taps of the last
        // `window` prompt positions are captured per chunk and staged right away. The state at the
        // last chunk's start goes into the prompt cache, and on a fresh prefill also the state at
        // the last boundary of the prefix shared with the previous prompt.
        // Prefill pieces: the chunk grid from `resume`, split at the boundaries the prompt cache
        // keeps (all multiples of the granule, which divides the chunk): `Last` at the start of the
        // last chunk of the prompt's chunk grid, `Tail` at the last granule boundary before its
        // end, `Shared` (fresh prefills) where the prompt leaves the prefix shared with a cached one.
        let last = p_len.saturating_sub(1) / self.chunk * self.chunk;
        let tail = p_len.saturating_sub(1) / self.granule * self.granule;
        let mut starts: Vec<usize> = (resume..p_len).step_by(self.chunk).collect();
        starts.extend([shared, last, tail].into_iter().filter(|&x| x > resume));
        starts.sort_unstable();
        starts.dedup();
        for (i, &pos0) in starts.iter().enumerate() {
            if cancel.load(Ordering::Relaxed) {
                return self.finish(events, FinishReason::Cancelled, req, 0, t0, t0, None, stats);
            }
            let end = starts.get(i + 1).copied().unwrap_or(p_len);
            let chunk = &req.prompt[pos0..end];
            if pos0 > resume && pos0 == last {
                self.save_prompt(&req.prompt[..pos0], Slot::Last)?;
            } else if pos0 > resume && pos0 == tail {
                self.save_prompt(&req.prompt[..pos0], Slot::Tail)?;
            } else if pos0 > 0 && pos0 == shared {
                self.save_prompt(&req.prompt[..pos0], Slot::Shared)?;
            }
            let rows = if end == p_len {
                LogitRows::Last
            } else {
                LogitRows::None
            };
            let first = p_len.saturating_sub(window).max(pos0) - pos0;
            let tap_req = match &tap_layers {
                Some(l) if first < chunk.len() => Some(TapRequest {
                    layers: l,
                    rows: first..chunk.len(),
                    out: &mut taps,
                }),
                _ => None,
            };
            let tapped = tap_req.as_ref().map_or(0, |t| t.rows.len());
            forward(
                &self.backend,
                &self.cfg,
                &self.weights,
                &mut self.state,
                chunk,
                GdnMode::Chunked,
                rows,
                &mut logits,
                Capture {
                    taps: tap_req,
                    gdn_rec: None,
                },
            )?;
            if tapped > 0 {
                self.stage(&taps, pos0 + first, tapped)?;
            }
        }
        let t_prefill = Instant::now();
        let mut sampler = Sampler::new(req.params.clone());
        let mut em = Emitter {
            dec: StreamDecoder::new(),
            stops: StopFilter {
                stops: req.stop.clone(),
                pending: String::new(),
            },
            n_gen: 0,
            ttft: None,
        };
        let mut history: Vec<u32> = if use_spec {
            req.prompt.clone()
        } else {
            Vec::new()
        };
        // The first token comes from the prefill logits.
        let s = sampler.sample(&logits);
        sampler.accept(s.id);
        let mut pending: Vec<Sampled> = vec![s];
        // `fed`: positions fed when the first pending token was sampled (the plain loop's `pos`).
        let mut fed = self.state.pos;
        loop {
            let mut id_last = 0;
            for (j, s) in pending.drain(..).enumerate() {
                id_last = s.id;
                if use_spec {
                    history.push(s.id);
                }
                if let Some(reason) = self.emit(req, events, &mut em, s, fed + j, t0)? {
                    return self
                        .finish(events, reason, req, em.n_gen, t0, t_prefill, em.ttft, stats);
                }
            }
            if cancel.load(Ordering::Relaxed) {
                return self.finish(
                    events,
                    FinishReason::Cancelled,
                    req,
                    em.n_gen,
                    t0,
                    t_prefill,
                    em.ttft,
                    stats,
                );
            }
            let start = self.state.pos;
            let room = start + NGRAM_K < n_ctx;
            let want = use_spec && room && (force || self.want_round());
            if want {
                let timer = Timer::start();
                let draft = self.propose(id_last, start, &history)?;
                stats.draft_seconds += timer.secs();
                if !draft.is_empty() {
                    let ctx = self.spec.as_mut().expect("use_spec");
                    let out = verify_round(
                        &self.backend,
                        &self.cfg,
                        &self.weights,
                        &mut self.state,
                        &mut ctx.bufs,
                        &mut sampler,
                        id_last,
                        &draft,
                        tap_layers.as_deref(),
                        ctx.rollback,
                    )?;
                    let keep = out.n_acc + 1;
                    if tap_layers.is_some() {
                        self.stage_verified(start, keep, draft.len() + 1)?;
                    }
                    let secs = timer.secs();
                    stats.rounds += 1;
                    stats.drafted += draft.len() as u64;
                    stats.accepted += out.n_acc as u64;
                    stats.round_tokens += keep as u64;
                    stats.round_seconds += secs;
                    if let Some(c) = &self.spec {
                        c.report
                            .lock()
                            .expect("spec report lock")
                            .policy
                            .record_round(secs, keep, draft.len(), out.n_acc);
                    }
                    fed = start + 1;
                    pending = out.tokens;
                    continue;
                }
            }
            // a plain decode step (with the drafter's context row when drafting is possible)
            let timer = Timer::start();
            let mut row_stats = None;
            top.clear();
            match &tap_layers {
                Some(l) => {
                    forward(
                        &self.backend,
                        &self.cfg,
                        &self.weights,
                        &mut self.state,
                        &[id_last],
                        GdnMode::Recurrent,
                        LogitRows::Last,
                        &mut logits,
                        Capture {
                            taps: Some(TapRequest {
                                layers: l,
                                rows: 0..1,
                                out: &mut taps,
                            }),
                            gdn_rec: None,
                        },
                    )?;
                    self.stage(&taps, start, 1)?;
                }
                // no side outputs: the backend's decode step (a graph replay on CUDA), with the
                // row's statistics, and its best entries for a top-k draw, when the backend has
                // them (then the row need not be copied and scanned on the host)
                None => {
                    row_stats = match sampler.row_need() {
                        RowNeed::Top(n) => self.backend.decode_step_top(
                            &self.cfg,
                            &self.weights,
                            &mut self.state,
                            id_last,
                            n,
                            &mut logits,
                            &mut top,
                        )?,
                        need => self.backend.decode_step_stats(
                            &self.cfg,
                            &self.weights,
                            &mut self.state,
                            id_last,
                            &mut logits,
                            need == RowNeed::Row,
                        )?,
                    }
                }
            }
            let s = match row_stats
                .and_then(|st| sampler.sample_from_top(&st, &top, self.cfg.n_vocab))
            {
                Some(s) => s,
                None if logits.len() == self.cfg.n_vocab => sampler.sample(&logits),
                None => {
                    return Err(Error::Backend(format!(
                        "{}: the decode step gave neither usable statistics nor the logits row",
                        self.backend.name()
                    )))
                }
            };
            sampler.accept(s.id);
            if use_spec {
                let secs = timer.secs();
                stats.plain_tokens += 1;
                stats.plain_seconds += secs;
                if let Some(c) = &self.spec {
                    c.report
                        .lock()
                        .expect("spec report lock")
                        .policy
                        .record_plain(secs);
                }
            }
            fed = self.state.pos;
            pending = vec![s];
        }
    }

    fn want_round(&self) -> bool {
        self.spec.as_ref().is_some_and(|c| {
            c.report
                .lock()
                .expect("spec report lock")
                .policy
                .want_round()
        })
    }

    /// Stage the first `keep` rows of the last verify (`n` rows from `start`) into the drafter's
    /// context: from the host copy of their taps, or, where the verify left them on the device (a
    /// GPU drafter on CUDA), from there.
    fn stage_verified(&mut self, start: usize, keep: usize, n: usize) -> Result<()> {
        let cuda = as_cuda(&self.backend);
        let ctx = self.spec.as_mut().expect("a round ran");
        let taps = &ctx.bufs.taps;
        match &mut ctx.proposer {
            Proposer::DsparkGpu(d, st) => d.stage_verified(st, cuda, taps, start, keep),
            Proposer::Dspark(d, st) => {
                let w = taps.len() / n.max(1);
                d.stage(st, &taps[..keep * w], start, keep)
            }
            Proposer::Ngram => Ok(()),
        }
    }

    /// Stage committed positions into the drafter's context (DSpark only).
    fn stage(&mut self, taps: &[f32], pos0: usize, n: usize) -> Result<()> {
        match self.spec.as_mut().map(|c| &mut c.proposer) {
            Some(Proposer::Dspark(d, st)) => d.stage(st, taps, pos0, n),
            Some(Proposer::DsparkGpu(d, st)) => d.stage(st, taps, pos0, n),
            _ => Ok(()),
        }
    }

    /// Drafts for the next round (empty: no proposal, decode plainly).
    fn propose(&mut self, id_last: u32, start: usize, history: &[u32]) -> Result<Vec<u32>> {
        match self.spec.as_mut().map(|c| &mut c.proposer) {
            Some(Proposer::Dspark(d, st)) => d.draft(st, id_last, start),
            Some(Proposer::DsparkGpu(d, st)) => d.draft(st, id_last, start),
            Some(Proposer::Ngram) => Ok(ngram_draft(history, NGRAM_MAX_N, NGRAM_K)),
            None => Ok(Vec::new()),
        }
    }

    /// Stream one sampled token. `fed`: positions fed when it was sampled. Returns the finish reason
    /// when the request ends with it.
    fn emit(
        &self,
        req: &GenRequest,
        events: &Sender<Event>,
        em: &mut Emitter,
        s: Sampled,
        fed: usize,
        t0: Instant,
    ) -> Result<Option<FinishReason>> {
        em.n_gen += 1;
        if em.ttft.is_none() {
            em.ttft = Some(t0.elapsed().as_secs_f64());
        }
        let is_stop_id =
            req.stop_ids.contains(&s.id) || (!req.ignore_eos && self.stop_ids.contains(&s.id));
        if is_stop_id {
            let rest = em.dec.flush();
            let (text, _) = em.stops.push(&rest);
            if !text.is_empty() {
                let _ = events.send(Event::Text(text));
            }
            return Ok(Some(FinishReason::Stop));
        }
        let piece = em.dec.push(&self.tokenizer, s.id);
        let (text, hit) = em.stops.push(&piece);
        let ev = Event::Token(TokenEvent {
            id: s.id,
            text,
            logprob: s.logprob,
            top: s.top,
        });
        if events.send(ev).is_err() {
            // receiver gone: the caller dropped the stream
            return Ok(Some(FinishReason::Cancelled));
        }
        if hit {
            return Ok(Some(FinishReason::Stop));
        }
        if em.n_gen >= req.max_tokens || fed >= self.state.n_ctx {
            let rest = em.dec.flush();
            let (mut text, _) = em.stops.push(&rest);
            text.push_str(&std::mem::take(&mut em.stops.pending));
            if !text.is_empty() {
                let _ = events.send(Event::Text(text));
            }
            return Ok(Some(FinishReason::Length));
        }
        Ok(None)
    }

    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        events: &Sender<Event>,
        reason: FinishReason,
        req: &GenRequest,
        n_gen: usize,
        t0: Instant,
        t_prefill: Instant,
        ttft: Option<f64>,
        spec: SpecStats,
    ) -> Result<()> {
        if let Some(c) = &self.spec {
            c.report.lock().expect("spec report lock").totals.add(&spec);
        }
        let usage = Usage {
            spec,
            prompt_tokens: req.prompt.len(),
            cached_tokens: self.cached,
            completion_tokens: n_gen,
            prefill_seconds: (t_prefill - t0).as_secs_f64(),
            decode_seconds: t_prefill.elapsed().as_secs_f64(),
            ttft_seconds: ttft.unwrap_or(0.0),
        };
        let _ = events.send(Event::Done { reason, usage });
        Ok(())
    }
}
