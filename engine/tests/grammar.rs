//! Constrained decoding on the 0.5B Qwen (`tandem model fetch qwen2.5-coder-0.5b`): output that
//! matches a JSON schema and a regex, the same tokens with speculation on and off and after a
//! resume, and a clear error for a grammar that does not compile.

use std::sync::Arc;

use tandem_engine::{
    ChatMessage, Engine, EngineConfig, Error, FinishReason, GenerateOutput, GenerateParams,
    GenerateRequest, Grammar, Model, ModelSource, SpeculateConfig, Stream,
};

fn qwen() -> Arc<Model> {
    ModelSource::parse("qwen2.5-coder-0.5b", &tandem_engine::model_dir_from_env())
        .load()
        .unwrap_or_else(|e| panic!("the grammar tests need the 0.5B Qwen: {e}"))
}

fn chat(model: &Model, text: &str) -> Vec<u32> {
    let rendered = model
        .tokenizer
        .apply_chat_template(&[ChatMessage::new("user", text)], &[])
        .expect("template");
    model.tokenizer.encode(&rendered).expect("encode")
}

fn generate(
    model: &Arc<Model>,
    speculate: SpeculateConfig,
    prompt: &[u32],
    grammar: Grammar,
) -> GenerateOutput {
    generate_with(model, speculate, prompt, params(grammar))
}

fn generate_with(
    model: &Arc<Model>,
    speculate: SpeculateConfig,
    prompt: &[u32],
    params: GenerateParams,
) -> GenerateOutput {
    let mut engine = Engine::new(
        model.clone(),
        EngineConfig {
            threads: 2,
            speculate,
            ..EngineConfig::default()
        },
    )
    .expect("engine");
    let mut out = engine
        .generate_batch(&[GenerateRequest {
            prompt: prompt.to_vec(),
            params,
        }])
        .expect("generation");
    out.remove(0)
}

fn params(grammar: Grammar) -> GenerateParams {
    GenerateParams {
        max_tokens: 96,
        grammar: Some(grammar),
        ..GenerateParams::default()
    }
}

const CAT: &str = r#"{"type": "object", "properties": {"name": {"type": "string"},
    "age": {"type": "integer"}, "indoor": {"type": "boolean"}},
    "required": ["name", "age", "indoor"], "additionalProperties": false}"#;

#[test]
fn output_matches_the_grammar_the_same_with_speculation_and_after_a_resume() {
    let model = qwen();
    let prompt = chat(
        &model,
        "Describe a cat as JSON: its name, age and whether it lives indoors.",
    );
    let grammar = Grammar::JsonSchema(CAT.into());
    let out = generate(&model, SpeculateConfig::off(), &prompt, grammar.clone());
    assert_eq!(out.finish_reason, FinishReason::Stop, "{:?}", out.text);
    let cat: serde_json::Value = serde_json::from_str(&out.text).expect(&out.text);
    assert!(cat["name"].is_string(), "{cat}");
    assert!(cat["age"].is_i64(), "{cat}");
    assert!(cat["indoor"].is_boolean(), "{cat}");
    assert_eq!(cat.as_object().map(|o| o.len()), Some(3), "{cat}");

    // Speculation drafts tokens the grammar may forbid; a forbidden draft is a rejection.
    let spec = generate(&model, SpeculateConfig::on(), &prompt, grammar.clone());
    assert_eq!(spec.token_ids, out.token_ids);

    // A stream resumed after some of the tokens (a failover) is where the uninterrupted one was:
    // it accepts the rest and ends where it did.
    let k = out.token_ids.len() / 2;
    let mut resumed =
        Stream::resume(params(grammar), &model, &prompt, &out.token_ids[..k]).expect("resume");
    let rest: Vec<_> = out.token_ids[k..]
        .iter()
        .map(|&t| resumed.accept(&model.tokenizer, t).finished)
        .collect();
    assert!(rest[..rest.len() - 1].iter().all(Option::is_none));

    let yes_no = generate(
        &model,
        SpeculateConfig::off(),
        &chat(&model, "Is the sky green? Answer yes or no."),
        Grammar::Regex("(yes|no)".into()),
    );
    assert!(
        ["yes", "no"].contains(&yes_no.text.as_str()),
        "{:?}",
        yes_no.text
    );
    assert_eq!(yes_no.finish_reason, FinishReason::Stop);
}

#[test]
fn a_grammar_that_does_not_compile_is_refused_by_name() {
    let model = qwen();
    for grammar in [
        Grammar::JsonSchema("{not json".into()),
        Grammar::JsonSchema(r#"{"type": "frobnicate"}"#.into()),
        Grammar::Regex("(unclosed".into()),
        Grammar::Lark("start: ???".into()),
    ] {
        match Stream::new(params(grammar.clone()), &model, &[1, 2]) {
            Err(Error::InvalidArgument { field, reason }) => {
                assert_eq!(field, "grammar", "{reason}");
            }
            other => panic!("{grammar:?} gave {other:?}"),
        }
    }
}

/// A forced tool call under the tools' grammar (what the router sets for `tool_choice`
/// required or a named function): the forced opening and the reply make one call, of a tool
/// offered, with arguments that match its schema.
#[test]
fn a_forced_call_follows_the_tools_schemas() {
    use tandem_tokenizer::{Arguments, CallGrammar, Piece, ToolCallParser};
    let model = qwen();
    let weather = r#"{"type": "object", "properties": {"city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": false}"#;
    let tools_json: Vec<serde_json::Value> = [("get_weather", weather), ("get_time", "{}")]
        .iter()
        .map(|(name, schema)| {
            serde_json::json!({"type": "function", "function": {"name": name,
                "parameters": serde_json::from_str::<serde_json::Value>(schema).expect("schema")}})
        })
        .collect();
    let format = model
        .tokenizer
        .tool_format()
        .expect("Qwen's template takes tools");
    for function in [None, Some("get_weather")] {
        let forced = format.forced_prefix(function);
        let text = model
            .tokenizer
            .apply_chat_template(
                &[ChatMessage::new(
                    "user",
                    "What is the weather like in Oslo?",
                )],
                &tools_json,
            )
            .expect("template")
            + &forced;
        let prompt = model.tokenizer.encode(&text).expect("encode");
        let grammar = format
            .call_grammar(
                &[
                    CallGrammar {
                        name: "get_weather",
                        arguments: Arguments::Schema(Some(weather)),
                    },
                    CallGrammar {
                        name: "get_time",
                        arguments: Arguments::Schema(None),
                    },
                ],
                function,
            )
            .expect("grammar");
        let out = generate(
            &model,
            SpeculateConfig::off(),
            &prompt,
            Grammar::Lark(grammar),
        );
        assert_eq!(out.finish_reason, FinishReason::Stop, "{:?}", out.text);
        let mut parser = ToolCallParser::new(format, &forced);
        let mut pieces = parser.push(&out.text);
        pieces.extend(parser.finish());
        let [Piece::Call { name, arguments }] = &pieces[..] else {
            panic!("{function:?}: {pieces:?} from {:?}", out.text);
        };
        let args: serde_json::Value = serde_json::from_str(arguments).expect("arguments");
        if name == "get_weather" {
            assert!(args["city"].is_string(), "{args}");
            assert!(
                ["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap_or("")),
                "{args}"
            );
            assert_eq!(args.as_object().map(|o| o.len()), Some(2), "{args}");
        } else {
            assert_eq!(function, None, "{name}");
            assert!(args.is_object(), "{args}");
        }
    }
}

/// Where the model decides whether to call (tool_choice auto), the hold on its reply leaves text
/// and well-formed calls exactly as the model writes them, and holds a call it starts to its
/// tool: here a custom tool's Lark grammar, inside the JSON string of its input. A hold that
/// does not compile leaves the reply free.
#[test]
fn a_held_reply_is_the_models_own_until_a_call_strays() {
    use tandem_tokenizer::{Arguments, BareCalls, CallGrammar, Piece, ToolCallParser};
    let model = qwen();
    let format = model
        .tokenizer
        .tool_format()
        .expect("Qwen's template takes tools");
    let weather = r#"{"type": "object", "properties": {"city": {"type": "string"}},
        "required": ["city"], "additionalProperties": false}"#;
    let shout = "start: WORD (\" \" WORD)*\nWORD: /[A-Z!]+/";
    let input = r#"{"type": "object", "properties": {"input": {"type": "string"}},
        "required": ["input"], "additionalProperties": false}"#;
    let tools_json: Vec<serde_json::Value> = [
        ("get_weather", "Get the current weather in a city", weather),
        ("shout", "Shout a message to the world", input),
    ]
    .iter()
    .map(|(name, description, schema)| {
        serde_json::json!({"type": "function", "function": {"name": name,
            "description": description,
            "parameters": serde_json::from_str::<serde_json::Value>(schema).expect("schema")}})
    })
    .collect();
    let held = format
        .held_grammar(&[
            CallGrammar {
                name: "get_weather",
                arguments: Arguments::Schema(Some(weather)),
            },
            CallGrammar {
                name: "shout",
                arguments: Arguments::Input(shout),
            },
        ])
        .expect("grammar");
    let prompt = |text: &str| {
        let rendered = model
            .tokenizer
            .apply_chat_template(&[ChatMessage::new("user", text)], &tools_json)
            .expect("template");
        model.tokenizer.encode(&rendered).expect("encode")
    };
    let free = || GenerateParams {
        max_tokens: 96,
        ..GenerateParams::default()
    };
    let calls = |text: &str| {
        let bare = BareCalls::new(vec!["get_weather".into(), "shout".into()], |_, _| true);
        let mut parser = ToolCallParser::new(format, "").with_bare_calls(bare);
        let mut pieces = parser.push(text);
        pieces.extend(parser.finish());
        pieces
    };
    // The greedy reply to `ask`, unheld and held.
    let both = |ask: &str| {
        let p = prompt(ask);
        let own = generate_with(&model, SpeculateConfig::off(), &p, free());
        let kept = generate(
            &model,
            SpeculateConfig::off(),
            &p,
            Grammar::ToolCalls(held.clone()),
        );
        (own, kept)
    };
    for (ask, call) in [
        ("What is the weather like in Oslo?", Some("get_weather")),
        ("Write a haiku about the sea.", None),
    ] {
        let (own, kept) = both(ask);
        assert_eq!(
            kept.token_ids, own.token_ids,
            "{ask}: {:?} against {:?}",
            kept.text, own.text
        );
        let pieces = calls(&own.text);
        match call {
            Some(tool) => assert!(
                matches!(&pieces[..], [Piece::Call { name, .. }] if name == tool),
                "{ask}: {pieces:?}"
            ),
            None => assert!(matches!(&pieces[..], [Piece::Text(_)]), "{ask}: {pieces:?}"),
        }
    }

    let (own, kept) = both("Use the shout tool to say hello to the world.");
    let [Piece::Call { name, arguments }] = &calls(&kept.text)[..] else {
        panic!("not one call: {:?} (free: {:?})", kept.text, own.text);
    };
    assert_eq!(name, "shout");
    // Unheld, the model writes an input outside the grammar ("Hello, world!").
    assert_ne!(
        kept.token_ids, own.token_ids,
        "{:?}: the hold changed nothing",
        own.text
    );
    let args: serde_json::Value = serde_json::from_str(arguments).expect("arguments");
    let said = args["input"].as_str().expect("input");
    assert!(
        !said.is_empty()
            && said
                .split(' ')
                .all(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_uppercase() || b == b'!')),
        "{said:?} from {:?} (free: {:?})",
        kept.text,
        own.text
    );

    // A hold that does not compile (a schema llguidance cannot hold) leaves the reply free.
    let broken = Grammar::ToolCalls("start: ???".into());
    let p = prompt("Write a haiku about the sea.");
    let out = generate(&model, SpeculateConfig::off(), &p, broken);
    assert_eq!(
        out.token_ids,
        generate_with(&model, SpeculateConfig::off(), &p, free()).token_ids
    );
}
