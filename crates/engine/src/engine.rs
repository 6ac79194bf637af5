//! The engine: loads a model, owns a worker thread that runs requests one after another, and streams
//! events back over a channel per request. The worker never touches Python; cancellation is an
//! `AtomicBool` per request checked before every step.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, GdnMode};
use crate::chat::{ChatMessage, ChatTemplate, QWEN35_TEMPLATE};
use crate::config::{architecture, TargetConfig};
use crate::error::{Error, Result};
use crate::gguf::Gguf;
use crate::model::{forward, LogitRows, SeqState, Weights};
use crate::sampling::{Sampler, SamplerParams};
use crate::tokenizer::{StreamDecoder, Tokenizer, TokenizerSpec};

/// Rows per prefill chunk.
pub const PREFILL_CHUNK: usize = 512;

#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Context length; `None` = min(trained context, 4096).
    pub n_ctx: Option<usize>,
    /// Worker threads for the CPU backend; `None` = all cores.
    pub threads: Option<usize>,
    /// "cpu", "auto", "cuda", "vulkan".
    pub device: String,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            n_ctx: None,
            threads: None,
            device: "auto".into(),
        }
    }
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
    pub completion_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    /// Time from request start to the first token.
    pub ttft_seconds: f64,
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

fn resolve_device(device: &str) -> Result<&'static str> {
    match device {
        "cpu" | "auto" => Ok("cpu"),
        "cuda" => Err(Error::BackendUnavailable(
            "device=\"cuda\": the CUDA backend is not part of this build yet; use device=\"cpu\" or \"auto\"".into(),
        )),
        "vulkan" => Err(Error::BackendUnavailable(
            "device=\"vulkan\": the Vulkan backend is not part of this build yet; use device=\"cpu\" or \"auto\"".into(),
        )),
        other => Err(Error::InvalidRequest(format!(
            "unknown device {other:?}; expected one of \"auto\", \"cpu\", \"cuda\", \"vulkan\""
        ))),
    }
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
        let backend = CpuBackend;
        let weights = pool.install(|| Weights::load(&backend, &g, &cfg))?;
        let state = SeqState::new(&backend, &cfg, n_ctx)?;
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
            device: format!("{device}: {}", pool.install(|| backend.name())),
            threads,
            file_bytes: g.file_len(),
        };
        let (tx, rx) = unbounded::<Cmd>();
        let worker = Worker {
            backend,
            cfg: cfg.clone(),
            weights,
            state,
            tokenizer: tokenizer.clone(),
            stop_ids: stop_ids.clone(),
        };
        let handle = std::thread::Builder::new()
            .name("bonsai-engine".into())
            .spawn(move || pool.install(|| worker.run(rx)))
            .map_err(|e| Error::Backend(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine {
            tx,
            worker: Some(handle),
            info,
            cfg,
            tokenizer,
            template,
            stop_ids,
        })
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
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        self.generate(&req, &events, &cancel)
                    }));
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
                            self.state.reset(&self.backend);
                        }
                    }
                }
            }
        }
    }

    fn all_logits(&mut self, ids: &[u32], chunked: bool) -> Result<Vec<f32>> {
        let nv = self.cfg.n_vocab;
        self.state.reset(&self.backend);
        let mut out = Vec::with_capacity(ids.len() * nv);
        let mut buf = Vec::new();
        if chunked {
            for chunk in ids.chunks(PREFILL_CHUNK) {
                forward(
                    &self.backend,
                    &self.cfg,
                    &self.weights,
                    &mut self.state,
                    chunk,
                    GdnMode::Chunked,
                    LogitRows::All,
                    &mut buf,
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
                )?;
                out.extend_from_slice(&buf);
            }
        }
        Ok(out)
    }

    fn generate(
        &mut self,
        req: &GenRequest,
        events: &Sender<Event>,
        cancel: &AtomicBool,
    ) -> Result<()> {
        let t0 = Instant::now();
        let n_ctx = self.state.n_ctx;
        self.state.reset(&self.backend);
        let mut logits = Vec::new();
        // Prefill in chunks; logits only for the last row of the last chunk.
        let n_chunks = req.prompt.len().div_ceil(PREFILL_CHUNK);
        for (i, chunk) in req.prompt.chunks(PREFILL_CHUNK).enumerate() {
            if cancel.load(Ordering::Relaxed) {
                return self.finish(events, FinishReason::Cancelled, req, 0, t0, t0, None);
            }
            let rows = if i + 1 == n_chunks {
                LogitRows::Last
            } else {
                LogitRows::None
            };
            forward(
                &self.backend,
                &self.cfg,
                &self.weights,
                &mut self.state,
                chunk,
                GdnMode::Chunked,
                rows,
                &mut logits,
            )?;
        }
        let t_prefill = Instant::now();
        let mut ttft = None;
        let mut sampler = Sampler::new(req.params.clone());
        let mut dec = StreamDecoder::new();
        let mut stops = StopFilter {
            stops: req.stop.clone(),
            pending: String::new(),
        };
        let mut n_gen = 0usize;
        loop {
            if cancel.load(Ordering::Relaxed) {
                return self.finish(
                    events,
                    FinishReason::Cancelled,
                    req,
                    n_gen,
                    t0,
                    t_prefill,
                    ttft,
                );
            }
            let s = sampler.sample(&logits);
            sampler.accept(s.id);
            n_gen += 1;
            if ttft.is_none() {
                ttft = Some(t0.elapsed().as_secs_f64());
            }
            let is_stop_id =
                req.stop_ids.contains(&s.id) || (!req.ignore_eos && self.stop_ids.contains(&s.id));
            if is_stop_id {
                let rest = dec.flush();
                let (text, _) = stops.push(&rest);
                if !text.is_empty() {
                    let _ = events.send(Event::Text(text));
                }
                return self.finish(events, FinishReason::Stop, req, n_gen, t0, t_prefill, ttft);
            }
            let piece = dec.push(&self.tokenizer, s.id);
            let (text, hit) = stops.push(&piece);
            let ev = Event::Token(TokenEvent {
                id: s.id,
                text,
                logprob: s.logprob,
                top: s.top,
            });
            if events.send(ev).is_err() {
                // receiver gone: the caller dropped the stream
                return Ok(());
            }
            if hit {
                return self.finish(events, FinishReason::Stop, req, n_gen, t0, t_prefill, ttft);
            }
            if n_gen >= req.max_tokens || self.state.pos >= n_ctx {
                let rest = dec.flush();
                let (mut text, _) = stops.push(&rest);
                text.push_str(&std::mem::take(&mut stops.pending));
                if !text.is_empty() {
                    let _ = events.send(Event::Text(text));
                }
                return self.finish(
                    events,
                    FinishReason::Length,
                    req,
                    n_gen,
                    t0,
                    t_prefill,
                    ttft,
                );
            }
            forward(
                &self.backend,
                &self.cfg,
                &self.weights,
                &mut self.state,
                &[s.id],
                GdnMode::Recurrent,
                LogitRows::Last,
                &mut logits,
            )?;
        }
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
    ) -> Result<()> {
        let usage = Usage {
            prompt_tokens: req.prompt.len(),
            completion_tokens: n_gen,
            prefill_seconds: (t_prefill - t0).as_secs_f64(),
            decode_seconds: t_prefill.elapsed().as_secs_f64(),
            ttft_seconds: ttft.unwrap_or(0.0),
        };
        let _ = events.send(Event::Done { reason, usage });
        Ok(())
    }
}
