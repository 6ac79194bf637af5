//! Chat template rendering with minijinja, configured to behave like HF transformers' jinja2 sandbox
//! (ECOSYSTEM.md §5.2):
//! - `trim_blocks` + `lstrip_blocks`, `{% break %}`/`{% continue %}`, no trailing-newline keep;
//! - Python string/dict/list methods (`startswith`, `split`, `items`, ...) via minijinja-contrib pycompat;
//! - `tojson` like Python `json.dumps(ensure_ascii=False)`: `", "`/`": "` separators, no HTML escaping,
//!   `indent`, `sort_keys`, `ensure_ascii` and `separators` supported;
//! - `raise_exception(msg)` fails the render with `Error::Template` carrying `msg`;
//! - `strftime_now(fmt)`: the current time, formatted (UTC; C `strftime` directives);
//! - messages are Python-like dicts: absent optional fields are absent, not null. An assistant
//!   `tool_calls[i].function.arguments` given as a JSON string is parsed into a mapping first (as
//!   llama.cpp's server does), so templates can iterate it;
//! - globals `bos_token` (default `""`) and `eos_token` (default `"<|im_end|>"`).

use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Value, ValueKind};
use minijinja::{Environment, ErrorKind};
use serde_json::{Map, Value as Json};

use crate::error::{Error, Result};

/// The engine's own qwen35 chat template (also shipped as `python/bonsai/templates/qwen35.jinja`, which
/// the synthetic-model generator writes into `tokenizer.chat_template`).
pub const QWEN35_TEMPLATE: &str = include_str!("../../../python/bonsai/templates/qwen35.jinja");

const NAME: &str = "chat_template";

/// One chat message, as the OpenAI API shapes it (content already flattened to text).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    pub reasoning_content: Option<String>,
    pub tool_calls: Option<Json>,
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        }
    }

    /// The Python-like dict the template sees.
    fn to_dict(&self) -> Json {
        let mut m = Map::new();
        m.insert("role".into(), Json::String(self.role.clone()));
        m.insert("content".into(), Json::String(self.content.clone()));
        if let Some(r) = &self.reasoning_content {
            m.insert("reasoning_content".into(), Json::String(r.clone()));
        }
        if let Some(tc) = &self.tool_calls {
            m.insert("tool_calls".into(), parse_tool_call_arguments(tc));
        }
        if let Some(n) = &self.name {
            m.insert("name".into(), Json::String(n.clone()));
        }
        Json::Object(m)
    }
}

/// `tool_calls[i].function.arguments` (or `tool_calls[i].arguments`) given as a JSON string that holds
/// an object becomes that object; anything else is left as it is.
fn parse_tool_call_arguments(tc: &Json) -> Json {
    let mut tc = tc.clone();
    if let Json::Array(calls) = &mut tc {
        for call in calls {
            let target = match call.get_mut("function") {
                Some(f) if f.is_object() => f,
                _ => call,
            };
            if let Some(args) = target.get_mut("arguments") {
                if let Json::String(s) = args {
                    if let Ok(v @ Json::Object(_)) = serde_json::from_str::<Json>(s) {
                        *args = v;
                    }
                }
            }
        }
    }
    tc
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

fn template_err(e: minijinja::Error) -> Error {
    use std::error::Error as _;
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    Error::Template(msg)
}

impl ChatTemplate {
    /// Compiles `source`. `Error::Template` on a syntax error (the message names the line).
    pub fn new(source: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(template_err)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, source.to_string())
            .map_err(template_err)?;
        Ok(ChatTemplate {
            env,
            bos_token: String::new(),
            eos_token: "<|im_end|>".to_string(),
        })
    }

    /// The engine's built-in qwen35 template.
    pub fn qwen35() -> ChatTemplate {
        ChatTemplate::new(QWEN35_TEMPLATE).expect("the built-in qwen35 template compiles")
    }

    /// Sets the `bos_token` / `eos_token` template variables (from the GGUF's special ids).
    pub fn with_special_tokens(mut self, bos_token: &str, eos_token: &str) -> ChatTemplate {
        self.bos_token = bos_token.to_string();
        self.eos_token = eos_token.to_string();
        self
    }

    /// Renders the conversation. `tools` is the OpenAI `tools` array (passed only when `Some`);
    /// `extra` (`chat_template_kwargs`, an object) adds or overrides variables, `messages` excepted.
    /// `enable_thinking` is always defined for the template.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        enable_thinking: bool,
        tools: Option<&Json>,
        extra: Option<&Json>,
    ) -> Result<String> {
        let mut ctx = Map::new();
        ctx.insert(
            "messages".into(),
            Json::Array(messages.iter().map(ChatMessage::to_dict).collect()),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(add_generation_prompt),
        );
        ctx.insert("enable_thinking".into(), Json::Bool(enable_thinking));
        if let Some(t) = tools {
            ctx.insert("tools".into(), t.clone());
        }
        ctx.insert("bos_token".into(), Json::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Json::String(self.eos_token.clone()));
        match extra {
            None | Some(Json::Null) => {}
            Some(Json::Object(kw)) => {
                for (k, v) in kw {
                    if k != "messages" {
                        ctx.insert(k.clone(), v.clone());
                    }
                }
            }
            Some(other) => {
                return Err(Error::InvalidRequest(format!(
                    "chat_template_kwargs must be an object, got {other}"
                )))
            }
        }
        let tmpl = self.env.get_template(NAME).map_err(template_err)?;
        tmpl.render(json_to_value(&Json::Object(ctx)))
            .map_err(template_err)
    }
}

/// A JSON object as a template mapping that keeps its key order (Python dicts are ordered).
#[derive(Debug)]
struct OrderedMap(Vec<(String, Value)>);

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let k = key.as_str()?;
        self.0.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }
    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(
            self.0
                .iter()
                .map(|(k, _)| Value::from(k.as_str()))
                .collect(),
        )
    }
}

fn json_to_value(j: &Json) -> Value {
    match j {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(a) => Value::from(a.iter().map(json_to_value).collect::<Vec<_>>()),
        Json::Object(m) => Value::from_object(OrderedMap(
            m.iter()
                .map(|(k, v)| (k.clone(), json_to_value(v)))
                .collect(),
        )),
    }
}

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

// ---------------------------------------------------------------------------------------------
// tojson: Python json.dumps

struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

fn tojson(
    value: &Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, minijinja::Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an int or a string",
                    )
                })?;
                Some(" ".repeat(n.max(0) as usize))
            }
        },
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let (item_sep, key_sep) = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    kwargs.assert_all_used()?;
    let json = value_to_json(value)?;
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys,
        ensure_ascii,
    };
    let mut out = String::new();
    write_json(&json, &style, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// A template value as JSON, keeping map order; undefined becomes null.
fn value_to_json(v: &Value) -> std::result::Result<JsonNode, minijinja::Error> {
    Ok(match v.kind() {
        ValueKind::Undefined | ValueKind::None => JsonNode::Null,
        ValueKind::Bool => JsonNode::Bool(v.is_true()),
        ValueKind::Number => {
            if v.is_integer() {
                match v.as_i64() {
                    Some(i) => JsonNode::Int(i.to_string()),
                    None => JsonNode::Int(v.to_string()),
                }
            } else {
                JsonNode::Float(f64::try_from(v.clone()).unwrap_or(f64::NAN))
            }
        }
        ValueKind::String => JsonNode::Str(v.as_str().unwrap_or_default().to_string()),
        ValueKind::Bytes => {
            JsonNode::Str(String::from_utf8_lossy(v.as_bytes().unwrap_or_default()).into_owned())
        }
        ValueKind::Seq | ValueKind::Iterable => JsonNode::Array(
            v.try_iter()?
                .map(|x| value_to_json(&x))
                .collect::<std::result::Result<_, _>>()?,
        ),
        ValueKind::Map => {
            let mut entries = Vec::new();
            for k in v.try_iter()? {
                let item = v.get_item(&k)?;
                let key = match k.as_str() {
                    Some(s) => s.to_string(),
                    None => k.to_string(),
                };
                entries.push((key, value_to_json(&item)?));
            }
            JsonNode::Object(entries)
        }
        _ => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize {v}"),
            ))
        }
    })
}

/// JSON as Python's `json.dumps` sees it (ordered objects, ints kept exact).
enum JsonNode {
    Null,
    Bool(bool),
    Int(String),
    Float(f64),
    Str(String),
    Array(Vec<JsonNode>),
    Object(Vec<(String, JsonNode)>),
}

fn serde_to_node(v: &Json) -> JsonNode {
    match v {
        Json::Null => JsonNode::Null,
        Json::Bool(b) => JsonNode::Bool(*b),
        Json::Number(n) if n.is_f64() => JsonNode::Float(n.as_f64().unwrap_or(f64::NAN)),
        Json::Number(n) => JsonNode::Int(n.to_string()),
        Json::String(s) => JsonNode::Str(s.clone()),
        Json::Array(a) => JsonNode::Array(a.iter().map(serde_to_node).collect()),
        Json::Object(m) => JsonNode::Object(
            m.iter()
                .map(|(k, v)| (k.clone(), serde_to_node(v)))
                .collect(),
        ),
    }
}

/// Serializes `v` as Python's `json.dumps` would with the given style.
pub fn python_json_dumps(v: &Json, indent: Option<usize>, ensure_ascii: bool) -> String {
    let style = JsonStyle {
        indent: indent.map(|n| " ".repeat(n)),
        item_sep: if indent.is_some() {
            ",".into()
        } else {
            ", ".into()
        },
        key_sep: ": ".into(),
        sort_keys: false,
        ensure_ascii,
    };
    let mut out = String::new();
    write_json(&serde_to_node(v), &style, 0, &mut out);
    out
}

fn newline_indent(style: &JsonStyle, level: usize, out: &mut String) {
    if let Some(ind) = &style.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write_json(v: &JsonNode, style: &JsonStyle, level: usize, out: &mut String) {
    match v {
        JsonNode::Null => out.push_str("null"),
        JsonNode::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        JsonNode::Int(i) => out.push_str(i),
        JsonNode::Float(f) => out.push_str(&python_float(*f)),
        JsonNode::Str(s) => write_json_str(s, style.ensure_ascii, out),
        JsonNode::Array(a) => {
            if a.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline_indent(style, level + 1, out);
                write_json(x, style, level + 1, out);
            }
            newline_indent(style, level, out);
            out.push(']');
        }
        JsonNode::Object(m) => {
            if m.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &JsonNode)> = m.iter().map(|(k, v)| (k, v)).collect();
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline_indent(style, level + 1, out);
                write_json_str(k, style.ensure_ascii, out);
                out.push_str(&style.key_sep);
                write_json(x, style, level + 1, out);
            }
            newline_indent(style, level, out);
            out.push('}');
        }
    }
}

fn write_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python `repr(float)`: shortest round-trip digits, exponent form outside [1e-4, 1e16).
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        // Rust's `{:e}` gives shortest digits, e.g. "1e21", "1.5e-7"; Python writes "1e+21", "1.5e-07".
        let s = format!("{f:e}");
        let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = match exp.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exp),
        };
        return format!("{mant}e{sign}{digits:0>2}");
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

// ---------------------------------------------------------------------------------------------
// strftime_now

fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    format_utc(secs, &fmt)
}

/// Formats a Unix time (UTC) with C `strftime` directives: %Y %y %m %d %e %H %I %M %S %p %j %a %A
/// %b %B %h %F %T %D %R %Z %z %s %n %t %%. Unknown directives are kept verbatim.
pub fn format_utc(unix_secs: i64, fmt: &str) -> String {
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = unix_secs.div_euclid(86_400);
    let sod = unix_secs.rem_euclid(86_400);
    let (h, mi, s) = (sod / 3600, (sod % 3600) / 60, sod % 60);
    // Civil date from days since 1970-01-01 (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let wday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let month = MONTHS[(m - 1) as usize];
    let h12 = if h % 12 == 0 { 12 } else { h % 12 };

    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('I') => out.push_str(&format!("{h12:02}")),
            Some('M') => out.push_str(&format!("{mi:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('a') => out.push_str(&DAYS[wday][..3]),
            Some('A') => out.push_str(DAYS[wday]),
            Some('b') | Some('h') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('F') => out.push_str(&format!("{y}-{m:02}-{d:02}")),
            Some('T') => out.push_str(&format!("{h:02}:{mi:02}:{s:02}")),
            Some('R') => out.push_str(&format!("{h:02}:{mi:02}")),
            Some('D') => out.push_str(&format!("{m:02}/{d:02}/{:02}", y.rem_euclid(100))),
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('s') => out.push_str(&unix_secs.to_string()),
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}
