//! Thin PyO3 binding of bonsai-engine: argument conversion, GIL release, the streaming iterator,
//! and one exception family rooted at `bonsai.BonsaiError`. The Python package (`python/bonsai`)
//! builds the public API on top of these classes.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bonsai_engine::backend::KvType;
use bonsai_engine::chat::ChatMessage;
use bonsai_engine::engine::{
    DraftSource, Engine, EngineOptions, Event, GenRequest, PREFILL_CHUNK, PROMPT_CACHE_ENTRIES,
};
use bonsai_engine::sampling::SamplerParams;
use bonsai_engine::spec::{PolicyMode, Rollback, SpecStats};
use bonsai_engine::Error;
use crossbeam_channel::{Receiver, RecvTimeoutError};
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

pyo3::create_exception!(
    _bonsai,
    BonsaiError,
    PyException,
    "Base class of every bonsai error."
);
pyo3::create_exception!(
    _bonsai,
    ModelError,
    BonsaiError,
    "The model file is unreadable, corrupt or unsupported."
);
pyo3::create_exception!(
    _bonsai,
    InvalidRequestError,
    BonsaiError,
    "A request or argument is invalid."
);
pyo3::create_exception!(
    _bonsai,
    ContextOverflowError,
    InvalidRequestError,
    "The prompt does not fit the context."
);
pyo3::create_exception!(
    _bonsai,
    BackendUnavailableError,
    BonsaiError,
    "The requested device is not available."
);
pyo3::create_exception!(
    _bonsai,
    EngineError,
    BonsaiError,
    "The engine failed while running a request."
);

fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::Io { .. }
        | Error::Format(_)
        | Error::Unsupported(_)
        | Error::Metadata { .. }
        | Error::Tensor { .. }
        | Error::DrafterMismatch(_)
        | Error::Tokenizer(_) => ModelError::new_err(msg),
        Error::InvalidRequest(_) | Error::Template(_) => InvalidRequestError::new_err(msg),
        Error::ContextOverflow(_) => ContextOverflowError::new_err(msg),
        Error::BackendUnavailable(_) => BackendUnavailableError::new_err(msg),
        _ => EngineError::new_err(msg),
    }
}

/// The compiled engine. Use `bonsai.Engine`, which wraps this class.
#[pyclass(module = "bonsai._bonsai", frozen)]
struct RawEngine {
    inner: Arc<Engine>,
}

#[pymethods]
impl RawEngine {
    #[new]
    #[pyo3(signature = (model, device="auto", n_ctx=None, threads=None, draft=None, speculative="auto", rollback="replay", kv_cache="f16", prompt_cache=true, prompt_cache_entries=PROMPT_CACHE_ENTRIES, prefill_chunk=PREFILL_CHUNK))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: PathBuf,
        device: &str,
        n_ctx: Option<usize>,
        threads: Option<usize>,
        draft: Option<String>,
        speculative: &str,
        rollback: &str,
        kv_cache: &str,
        prompt_cache: bool,
        prompt_cache_entries: usize,
        prefill_chunk: usize,
    ) -> PyResult<Self> {
        let kv_type = KvType::parse(kv_cache).ok_or_else(|| {
            InvalidRequestError::new_err(format!(
                "kv_cache must be \"f16\" or \"q8_0\", got {kv_cache:?}"
            ))
        })?;
        let speculative = PolicyMode::parse(speculative).ok_or_else(|| {
            InvalidRequestError::new_err(format!(
                "speculative must be \"auto\", \"always\" or \"never\", got {speculative:?}"
            ))
        })?;
        let rollback = match rollback {
            "replay" => Rollback::Replay,
            "reforward" => Rollback::Reforward,
            other => {
                return Err(InvalidRequestError::new_err(format!(
                    "rollback must be \"replay\" or \"reforward\", got {other:?}"
                )))
            }
        };
        let draft = draft.map(|d| {
            if d == "ngram" {
                DraftSource::Ngram
            } else {
                DraftSource::Dspark(PathBuf::from(d))
            }
        });
        let opts = EngineOptions {
            n_ctx,
            threads,
            device: device.to_string(),
            draft,
            speculative,
            rollback,
            kv_type,
            prompt_cache,
            prompt_cache_entries,
            prefill_chunk,
        };
        let e = py.detach(|| Engine::load(&model, &opts)).map_err(to_py)?;
        Ok(RawEngine { inner: Arc::new(e) })
    }

    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let i = self.inner.info();
        let d = PyDict::new(py);
        d.set_item("path", i.path.to_string_lossy().to_string())?;
        d.set_item("architecture", &i.architecture)?;
        d.set_item("name", &i.name)?;
        d.set_item("weight_type", &i.weight_type)?;
        d.set_item("n_layer", i.n_layer)?;
        d.set_item("n_embd", i.n_embd)?;
        d.set_item("n_vocab", i.n_vocab)?;
        d.set_item("n_ctx", i.n_ctx)?;
        d.set_item("n_ctx_train", i.n_ctx_train)?;
        d.set_item("device", &i.device)?;
        d.set_item("threads", i.threads)?;
        d.set_item("file_bytes", i.file_bytes)?;
        d.set_item("stop_ids", self.inner.stop_ids().to_vec())?;
        Ok(d)
    }

    #[pyo3(signature = (text, special=true))]
    fn tokenize(&self, py: Python<'_>, text: &str, special: bool) -> PyResult<Vec<u32>> {
        let text = text.to_string();
        py.detach(|| self.inner.tokenize(&text, special))
            .map_err(to_py)
    }

    fn detokenize(&self, ids: Vec<u32>) -> String {
        self.inner.detokenize(&ids)
    }

    fn token_bytes<'py>(&self, py: Python<'py>, id: u32) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.tokenizer().token_bytes(id))
    }

    /// messages: a JSON list of {role, content, reasoning_content?, tool_calls?, name?}.
    #[pyo3(signature = (messages_json, add_generation_prompt=true, enable_thinking=true, tools_json=None, extra_json=None))]
    fn render_chat(
        &self,
        messages_json: &str,
        add_generation_prompt: bool,
        enable_thinking: bool,
        tools_json: Option<&str>,
        extra_json: Option<&str>,
    ) -> PyResult<String> {
        let bad =
            |what: &str, e: serde_json::Error| InvalidRequestError::new_err(format!("{what}: {e}"));
        let raw: Vec<serde_json::Value> =
            serde_json::from_str(messages_json).map_err(|e| bad("messages", e))?;
        let mut msgs = Vec::with_capacity(raw.len());
        for (i, m) in raw.iter().enumerate() {
            let get = |k: &str| m.get(k).and_then(|v| v.as_str()).map(String::from);
            let role = get("role").ok_or_else(|| {
                InvalidRequestError::new_err(format!("messages[{i}] has no string 'role'"))
            })?;
            let content = match m.get("content") {
                None | Some(serde_json::Value::Null) => String::new(),
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Array(parts)) => parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(|t| t.as_str()))
                    .collect::<Vec<_>>()
                    .join(""),
                Some(other) => {
                    return Err(InvalidRequestError::new_err(format!(
                    "messages[{i}].content must be a string or a list of text parts, found {other}"
                )))
                }
            };
            msgs.push(ChatMessage {
                role,
                content,
                reasoning_content: get("reasoning_content"),
                tool_calls: m.get("tool_calls").cloned().filter(|v| !v.is_null()),
                name: get("name"),
            });
        }
        let tools: Option<serde_json::Value> = tools_json
            .map(serde_json::from_str)
            .transpose()
            .map_err(|e| bad("tools", e))?;
        let extra: Option<serde_json::Value> = extra_json
            .map(serde_json::from_str)
            .transpose()
            .map_err(|e| bad("chat_template_kwargs", e))?;
        self.inner
            .render_chat(
                &msgs,
                add_generation_prompt,
                enable_thinking,
                tools.as_ref(),
                extra.as_ref(),
            )
            .map_err(to_py)
    }

    /// The speculative-decoding policy: mode, R, tok/s each way, decisions (`None` without a drafter).
    fn policy<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(r) = self.inner.spec_report() else {
            return Ok(None);
        };
        let p = &r.policy;
        let d = PyDict::new(py);
        d.set_item("kind", r.kind)?;
        d.set_item("mode", p.mode.as_str())?;
        d.set_item("enabled", p.enabled)?;
        d.set_item("R", p.r())?;
        d.set_item("tok_per_s_spec", p.tps_spec())?;
        d.set_item("tok_per_s_plain", p.tps_plain())?;
        d.set_item("round_seconds", p.t_round.value)?;
        d.set_item("plain_step_seconds", p.t_plain.value)?;
        d.set_item("tokens_per_round", p.tok_round.value)?;
        d.set_item("acceptance", p.accept.value)?;
        d.set_item("rounds_measured", p.t_round.n)?;
        d.set_item("plain_steps_measured", p.t_plain.n)?;
        d.set_item("embd_shared", r.embd_shared)?;
        d.set_item("window", r.window)?;
        d.set_item(
            "rollback",
            match r.rollback {
                Rollback::Replay => "replay",
                Rollback::Reforward => "reforward",
            },
        )?;
        let decisions = PyList::empty(py);
        for x in &p.decisions {
            let e = PyDict::new(py);
            e.set_item("at_token", x.at_token)?;
            e.set_item("action", x.action)?;
            e.set_item("R", x.r)?;
            e.set_item("tok_per_s_spec", x.tps_spec)?;
            e.set_item("tok_per_s_plain", x.tps_plain)?;
            e.set_item("acceptance", x.acceptance)?;
            e.set_item("reason", &x.reason)?;
            decisions.append(e)?;
        }
        d.set_item("decisions", decisions)?;
        Ok(Some(d))
    }

    /// Engine-wide speculative-decoding counters (`None` without a drafter).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self.inner.spec_report() {
            None => Ok(None),
            Some(r) => spec_dict(py, &r.totals).map(Some),
        }
    }

    /// Queue a generation; returns a stream of events.
    #[pyo3(signature = (prompt, max_tokens, temperature, top_k, top_p, min_p, presence_penalty,
                        frequency_penalty, repetition_penalty, penalty_last_n, seed, n_logprobs,
                        logit_bias, stop, stop_ids, ignore_eos, speculative=None))]
    fn submit(
        &self,
        prompt: Vec<u32>,
        max_tokens: usize,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        min_p: f32,
        presence_penalty: f32,
        frequency_penalty: f32,
        repetition_penalty: f32,
        penalty_last_n: usize,
        seed: u64,
        n_logprobs: usize,
        logit_bias: Vec<(u32, f32)>,
        stop: Vec<String>,
        stop_ids: Vec<u32>,
        ignore_eos: bool,
        speculative: Option<bool>,
    ) -> PyResult<Stream> {
        let params = SamplerParams {
            temperature,
            top_k,
            top_p,
            min_p,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            penalty_last_n,
            seed,
            n_logprobs,
            logit_bias,
        };
        let req = GenRequest {
            prompt,
            params,
            max_tokens,
            stop,
            stop_ids,
            ignore_eos,
            speculative,
        };
        let (rx, cancel) = self.inner.submit(req).map_err(to_py)?;
        Ok(Stream {
            rx,
            cancel,
            done: AtomicBool::new(false),
        })
    }

    /// Logits of every row of a fresh sequence, as little-endian f32 bytes `[len(ids), n_vocab]`.
    #[pyo3(signature = (ids, chunked=true))]
    fn logits<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
        chunked: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let v = py
            .detach(|| self.inner.logits(&ids, chunked))
            .map_err(to_py)?;
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        Ok(PyBytes::new(py, &bytes))
    }
}

/// A request's event stream. Iterating yields event tuples:
/// `("token", id, text, logprob, [(id, logprob), ...])`, `("text", text)`,
/// `("done", finish_reason, usage_dict)`. Errors are raised.
#[pyclass(module = "bonsai._bonsai", frozen)]
struct Stream {
    rx: Receiver<Event>,
    cancel: Arc<AtomicBool>,
    done: AtomicBool,
}

/// Speculation counters as a dict: drafts, accepted tokens, acceptance rate, tokens per round.
fn spec_dict<'py>(py: Python<'py>, s: &SpecStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("rounds", s.rounds)?;
    d.set_item("drafted_tokens", s.drafted)?;
    d.set_item("accepted_tokens", s.accepted)?;
    d.set_item("acceptance_rate", s.acceptance_rate())?;
    d.set_item("tokens_per_round", s.tokens_per_round())?;
    d.set_item("round_tokens", s.round_tokens)?;
    d.set_item("plain_tokens", s.plain_tokens)?;
    d.set_item("round_seconds", s.round_seconds)?;
    d.set_item("plain_seconds", s.plain_seconds)?;
    d.set_item("draft_seconds", s.draft_seconds)?;
    Ok(d)
}

fn event_to_py<'py>(py: Python<'py>, ev: Event) -> PyResult<Bound<'py, PyTuple>> {
    match ev {
        Event::Token(t) => {
            let top = PyList::new(py, t.top.iter().map(|&(i, l)| (i, l)))?;
            PyTuple::new(
                py,
                [
                    "token".into_pyobject(py)?.into_any(),
                    t.id.into_pyobject(py)?.into_any(),
                    t.text.into_pyobject(py)?.into_any(),
                    t.logprob.into_pyobject(py)?.into_any(),
                    top.into_any(),
                ],
            )
        }
        Event::Text(s) => PyTuple::new(
            py,
            [
                "text".into_pyobject(py)?.into_any(),
                s.into_pyobject(py)?.into_any(),
            ],
        ),
        Event::Done { reason, usage } => {
            let d = PyDict::new(py);
            d.set_item("prompt_tokens", usage.prompt_tokens)?;
            d.set_item("cached_tokens", usage.cached_tokens)?;
            d.set_item("completion_tokens", usage.completion_tokens)?;
            d.set_item("prefill_seconds", usage.prefill_seconds)?;
            d.set_item("decode_seconds", usage.decode_seconds)?;
            d.set_item("ttft_seconds", usage.ttft_seconds)?;
            if usage.spec.rounds > 0 || usage.spec.plain_tokens > 0 {
                d.set_item("speculative", spec_dict(py, &usage.spec)?)?;
            }
            PyTuple::new(
                py,
                [
                    "done".into_pyobject(py)?.into_any(),
                    reason.as_str().into_pyobject(py)?.into_any(),
                    d.into_any(),
                ],
            )
        }
        Event::Error(e) => Err(to_py(e)),
    }
}

#[pymethods]
impl Stream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        if self.done.load(Ordering::Relaxed) {
            return Ok(None);
        }
        loop {
            let r = py.detach(|| self.rx.recv_timeout(Duration::from_millis(50)));
            match r {
                Ok(ev) => return self.convert(py, ev).map(Some),
                Err(RecvTimeoutError::Timeout) => {
                    if let Err(e) = py.check_signals() {
                        self.cancel.store(true, Ordering::Relaxed);
                        return Err(e);
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.done.store(true, Ordering::Relaxed);
                    return Ok(None);
                }
            }
        }
    }

    /// Wait up to `timeout` seconds for at least one event, then return every queued event
    /// (possibly none). Used by the asyncio bridge from a worker thread.
    #[pyo3(signature = (timeout=0.05))]
    fn next_batch<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        let mut out = Vec::new();
        if self.done.load(Ordering::Relaxed) {
            return Ok(out);
        }
        let first = py.detach(|| {
            self.rx
                .recv_timeout(Duration::from_secs_f64(timeout.max(0.0)))
        });
        match first {
            Ok(ev) => out.push(self.convert(py, ev)?),
            Err(RecvTimeoutError::Timeout) => return Ok(out),
            Err(RecvTimeoutError::Disconnected) => {
                self.done.store(true, Ordering::Relaxed);
                return Ok(out);
            }
        }
        while let Ok(ev) = self.rx.try_recv() {
            out.push(self.convert(py, ev)?);
        }
        Ok(out)
    }

    /// True once the final event has been delivered.
    #[getter]
    fn finished(&self) -> bool {
        self.done.load(Ordering::Relaxed)
    }

    /// Stop generation within one step. Idempotent.
    fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Stream {
    fn convert<'py>(&self, py: Python<'py>, ev: Event) -> PyResult<Bound<'py, PyTuple>> {
        let last = matches!(ev, Event::Done { .. } | Event::Error(_));
        if last {
            self.done.store(true, Ordering::Relaxed);
        }
        event_to_py(py, ev)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

/// A human-readable report of a GGUF file: architecture, sizes, tensor types, memory estimate and
/// the validation result. Raises only when the container itself cannot be read.
#[pyfunction]
fn inspect(py: Python<'_>, path: PathBuf) -> PyResult<String> {
    py.detach(|| bonsai_engine::inspect::inspect(&path))
        .map_err(to_py)
}

#[pymodule]
fn _bonsai(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_function(wrap_pyfunction!(inspect, m)?)?;
    m.add_class::<RawEngine>()?;
    m.add_class::<Stream>()?;
    m.add("BonsaiError", py.get_type::<BonsaiError>())?;
    m.add("ModelError", py.get_type::<ModelError>())?;
    m.add("InvalidRequestError", py.get_type::<InvalidRequestError>())?;
    m.add(
        "ContextOverflowError",
        py.get_type::<ContextOverflowError>(),
    )?;
    m.add(
        "BackendUnavailableError",
        py.get_type::<BackendUnavailableError>(),
    )?;
    m.add("EngineError", py.get_type::<EngineError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
