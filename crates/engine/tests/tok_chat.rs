//! Chat template rendering: the built-in qwen35 template (exact strings) and the HF-compatible
//! environment (tojson, raise_exception, pycompat methods, dict-like messages).

use bonsai_engine::chat::{
    format_utc, python_json_dumps, ChatMessage, ChatTemplate, QWEN35_TEMPLATE,
};
use bonsai_engine::Error;
use serde_json::json;

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage::new(role, content)
}

fn assistant(content: &str, reasoning: Option<&str>) -> ChatMessage {
    ChatMessage {
        reasoning_content: reasoning.map(str::to_string),
        ..msg("assistant", content)
    }
}

fn q35() -> ChatTemplate {
    ChatTemplate::qwen35()
}

#[test]
fn system_and_user_thinking_on_and_off() {
    let m = [msg("system", "You are helpful."), msg("user", "Hi")];
    let base = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n";
    assert_eq!(
        q35().render(&m, true, true, None, None).unwrap(),
        format!("{base}<|im_start|>assistant\n<think>\n")
    );
    assert_eq!(
        q35().render(&m, true, false, None, None).unwrap(),
        format!("{base}<|im_start|>assistant\n<think>\n\n</think>\n\n")
    );
    assert_eq!(q35().render(&m, false, true, None, None).unwrap(), base);
    // No system message; content is trimmed.
    assert_eq!(
        q35()
            .render(&[msg("user", "  Hello there \n")], true, true, None, None)
            .unwrap(),
        "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n<think>\n"
    );
}

#[test]
fn reasoning_kept_only_after_last_user_query() {
    // The assistant turn before the last user query loses its reasoning.
    let m = [
        msg("user", "Q1"),
        assistant("A1", Some("R1")),
        msg("user", "Q2"),
    ];
    assert_eq!(
        q35().render(&m, true, false, None, None).unwrap(),
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n\
         <|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    // After the last query it keeps it.
    let m = [msg("user", "Q1"), assistant("A1", Some("\nR1\n"))];
    assert_eq!(
        q35().render(&m, false, true, None, None).unwrap(),
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n<think>\nR1\n</think>\n\nA1<|im_end|>\n"
    );
    // Reasoning written inside the content is split out the same way.
    let m = [
        msg("user", "Q1"),
        assistant("<think>\nR1\n</think>\n\nA1", None),
        msg("user", "Q2"),
        assistant("<think>\nR2\n</think>\n\nA2", None),
    ];
    assert_eq!(
        q35().render(&m, false, true, None, None).unwrap(),
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n\
         <|im_start|>assistant\n<think>\nR2\n</think>\n\nA2<|im_end|>\n"
    );
    // Empty reasoning renders no think block.
    let m = [msg("user", "Q"), assistant("A", Some("  "))];
    assert_eq!(
        q35().render(&m, false, true, None, None).unwrap(),
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    );
}

fn weather_tool() -> serde_json::Value {
    json!([{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & 'here' in é",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        }
    }])
}

const TOOLS_HEADER: &str = "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n\
{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather <now> & 'here' in é\", \
\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n\
</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n\
<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n\
<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n\
</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n\
- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n\
- Required parameters MUST be specified\n\
- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n\
- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n\
</IMPORTANT>";

#[test]
fn tools_block_calls_and_responses() {
    let tools = weather_tool();
    let m = [msg("system", "Be brief."), msg("user", "Weather in Paris?")];
    assert_eq!(
        q35().render(&m, true, true, Some(&tools), None).unwrap(),
        format!(
            "{TOOLS_HEADER}\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n\
             <|im_start|>assistant\n<think>\n"
        )
    );
    // Without a system message the tools block stands alone.
    let out = q35()
        .render(&m[1..], false, true, Some(&tools), None)
        .unwrap();
    assert!(
        out.starts_with(&format!("{TOOLS_HEADER}<|im_end|>\n<|im_start|>user\n")),
        "{out}"
    );

    // A call with JSON-string arguments (OpenAI shape), two tool results, then the answer.
    let call = ChatMessage {
        tool_calls: Some(json!([
            {"type": "function", "function": {"name": "get_weather",
             "arguments": "{\"city\": \"Paris\", \"days\": 2, \"metric\": true, \"opts\": {\"a\": [1, 2]}}"}},
            {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}
        ])),
        ..assistant("Let me check.", None)
    };
    let m = [
        msg("user", "Weather in Paris?"),
        call,
        ChatMessage {
            name: Some("get_weather".into()),
            ..msg("tool", "{\"temp\": 20}")
        },
        msg("tool", "12:00"),
        assistant("It is 20.", Some("Tool said 20.")),
    ];
    assert_eq!(
        q35().render(&m, false, true, None, None).unwrap(),
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\nLet me check.\n\n\
         <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n\
         <parameter=metric>\nTrue\n</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n</function>\n</tool_call>\n\
         <tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call><|im_end|>\n\
         <|im_start|>user\n<tool_response>\n{\"temp\": 20}\n</tool_response>\n<tool_response>\n12:00\n</tool_response><|im_end|>\n\
         <|im_start|>assistant\n<think>\nTool said 20.\n</think>\n\nIt is 20.<|im_end|>\n"
    );
    // A tool-response-only user turn is not a query: reasoning after the real query survives.
    let m = [
        msg("user", "Q"),
        assistant("", Some("R0")),
        msg("user", "<tool_response>\nx\n</tool_response>"),
        assistant("A", Some("R1")),
    ];
    let out = q35().render(&m, false, true, None, None).unwrap();
    assert!(
        out.contains("<think>\nR0\n</think>") && out.contains("<think>\nR1\n</think>"),
        "{out}"
    );
}

fn template_err(r: bonsai_engine::Result<String>) -> String {
    match r {
        Err(Error::Template(msg)) => msg,
        other => panic!("expected a template error, got {other:?}"),
    }
}

#[test]
fn raise_exception_and_template_errors() {
    let t = ChatTemplate::new("{{ raise_exception('boom: ' ~ messages[0].role) }}").unwrap();
    let e = template_err(t.render(&[msg("user", "x")], true, true, None, None));
    assert!(e.contains("boom: user"), "{e}");

    let e = template_err(q35().render(
        &[msg("user", "x"), msg("system", "late")],
        true,
        true,
        None,
        None,
    ));
    assert!(
        e.contains("System message must be at the beginning."),
        "{e}"
    );
    let e = template_err(q35().render(&[msg("system", "s")], true, true, None, None));
    assert!(e.contains("No user query found"), "{e}");
    let e = template_err(q35().render(&[], true, true, None, None));
    assert!(e.contains("No messages provided."), "{e}");
    let e = template_err(q35().render(
        &[msg("robot", "x"), msg("user", "q")],
        true,
        true,
        None,
        None,
    ));
    assert!(e.contains("Unexpected message role: robot"), "{e}");

    match ChatTemplate::new("{% for x in y %}unclosed") {
        Err(Error::Template(_)) => {}
        other => panic!("syntax error not reported: {other:?}"),
    }
}

fn render_with(src: &str, extra: serde_json::Value) -> String {
    ChatTemplate::new(src)
        .unwrap()
        .render(&[msg("user", "u")], false, true, None, Some(&extra))
        .unwrap()
}

#[test]
fn tojson_like_python_json_dumps() {
    let x = json!({"b": "<&>'é\u{1}\n", "a": [1, 2.5, null, true], "c": {}});
    let extra = json!({ "x": x });
    assert_eq!(
        render_with("{{ x|tojson }}", extra.clone()),
        "{\"b\": \"<&>'é\\u0001\\n\", \"a\": [1, 2.5, null, true], \"c\": {}}"
    );
    assert_eq!(
        render_with("{{ x|tojson(indent=2) }}", extra.clone()),
        "{\n  \"b\": \"<&>'é\\u0001\\n\",\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"c\": {}\n}"
    );
    assert_eq!(
        render_with(
            "{{ x|tojson(ensure_ascii=true, sort_keys=true) }}",
            extra.clone()
        ),
        "{\"a\": [1, 2.5, null, true], \"b\": \"<&>'\\u00e9\\u0001\\n\", \"c\": {}}"
    );
    assert_eq!(
        render_with("{{ x.a|tojson(separators=[',', ':']) }}", extra),
        "[1,2.5,null,true]"
    );
    // Floats as Python repr.
    let f = json!([1e21, 1e-7, 0.0001, 1.0, 1.5e16, 123.456, -2.5e-5]);
    assert_eq!(
        python_json_dumps(&f, None, false),
        "[1e+21, 1e-07, 0.0001, 1.0, 1.5e+16, 123.456, -2.5e-05]"
    );
    assert_eq!(
        render_with("{{ 'a\"b'|tojson }} {{ none|tojson }}", json!({})),
        "\"a\\\"b\" null"
    );
}

#[test]
fn messages_are_python_like_dicts() {
    let src = "{% for m in messages %}{{ m.role }}:{{ 'reasoning_content' in m }}:{{ m.name is defined }}:\
               {{ m.keys()|list|join(',') }};{% endfor %}";
    let t = ChatTemplate::new(src).unwrap();
    let m = [
        msg("user", "u"),
        ChatMessage {
            name: Some("n".into()),
            ..assistant("a", Some("r"))
        },
    ];
    assert_eq!(
        t.render(&m, false, true, None, None).unwrap(),
        "user:False:False:role,content;assistant:True:True:role,content,reasoning_content,name;"
    );
}

#[test]
fn hf_environment_features() {
    // trim_blocks + lstrip_blocks.
    assert_eq!(
        render_with("a\n  {% if true %}\nb\n  {% endif %}\nc", json!({})),
        "a\nb\nc"
    );
    // pycompat methods, loop controls, namespace, slicing, items; booleans print as Python does.
    assert_eq!(
        render_with("{{ 'a,b,c'.split(',')|length }}", json!({})),
        "3"
    );
    assert_eq!(
        render_with(
            "{{ '  x '.strip() }}|{{ 'abc'.startswith('ab') }}|{{ 'xx\\n'.rstrip('\\n') }}",
            json!({})
        ),
        "x|True|xx"
    );
    assert_eq!(
        render_with(
            "{% for i in [1,2,3,4] %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}",
            json!({})
        ),
        "12"
    );
    assert_eq!(
        render_with(
            "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
            json!({"d": {"z": 1, "a": 2}})
        ),
        "z=1;a=2;"
    );
    assert_eq!(render_with("{% set ns = namespace(n=0) %}{% for m in messages[::-1] %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}", json!({})), "1");
    // bos/eos variables, with defaults and overrides.
    assert_eq!(
        render_with("[{{ bos_token }}|{{ eos_token }}]", json!({})),
        "[|<|im_end|>]"
    );
    let t = ChatTemplate::new("[{{ bos_token }}|{{ eos_token }}]")
        .unwrap()
        .with_special_tokens("<s>", "</s>");
    assert_eq!(
        t.render(&[msg("user", "u")], false, true, None, None)
            .unwrap(),
        "[<s>|</s>]"
    );
    // chat_template_kwargs override enable_thinking.
    let out = q35()
        .render(
            &[msg("user", "u")],
            true,
            true,
            None,
            Some(&json!({"enable_thinking": false})),
        )
        .unwrap();
    assert!(out.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    match q35().render(&[msg("user", "u")], true, true, None, Some(&json!([1]))) {
        Err(Error::InvalidRequest(_)) => {}
        other => panic!("non-object kwargs accepted: {other:?}"),
    }
    // strftime_now renders the current date.
    let year = render_with("{{ strftime_now('%Y') }}", json!({}));
    assert!(year.len() == 4 && year.as_str() >= "2024", "{year}");
}

#[test]
fn strftime_formatting() {
    assert_eq!(
        format_utc(0, "%Y-%m-%d %H:%M:%S %a %b %j"),
        "1970-01-01 00:00:00 Thu Jan 001"
    );
    // Python: datetime.utcfromtimestamp(1709211845).strftime(...)
    assert_eq!(
        format_utc(
            1709211845,
            "%Y-%m-%d %H:%M:%S %a %A %b %B %j %I %p %y %e %%"
        ),
        "2024-02-29 13:04:05 Thu Thursday Feb February 060 01 PM 24 29 %"
    );
    assert_eq!(format_utc(-86400, "%F %T"), "1969-12-31 00:00:00");
}

#[test]
fn template_file_matches_const() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../python/bonsai/templates/qwen35.jinja"
    );
    let file = std::fs::read_to_string(path).expect("python/bonsai/templates/qwen35.jinja exists");
    assert_eq!(file, QWEN35_TEMPLATE);
    assert!(QWEN35_TEMPLATE.contains("<|im_start|>"));
}
