//! Fidelity against llama.cpp on the K-quant files of other architectures, using the
//! `*-tokenize.jsonl` and `*-greedy.jsonl` fixtures in `../shared/fixtures/` (their README says
//! how they were made).
//!
//! Needs the model files (`tandem model fetch qwen2.5-coder-0.5b`); a test fails, saying so,
//! without them. The fixtures directory is `$TANDEM_FIXTURES_DIR`, else `shared/fixtures` beside
//! the checkout.

use std::sync::Arc;

mod common;
use common::{ids, records};
use tandem_engine::{ChatMessage, Engine, EngineConfig, GenerateParams, GenerateRequest, Model};

/// The widest gap, in llama.cpp's own log-probabilities, between its greedy token and ours where
/// the two differ: a divergence must be a near-tie.
const MAX_MARGIN: f64 = 0.75;

fn load(name: &str) -> Arc<Model> {
    tandem_engine::ModelSource::parse(name, &tandem_engine::model_dir_from_env())
        .load()
        .unwrap_or_else(|e| panic!("this test needs {name} (tandem model fetch {name}): {e}"))
}

fn tokenizer_ids_equal_llama_cpp(model: &Model, fixture: &str) {
    let recs = records(&format!("{fixture}-tokenize.jsonl"));
    assert!(!recs.is_empty());
    // The fixtures were tokenized without the file's BOS; `encode` adds it where the file asks.
    let bos = model.tokenizer.encode("").expect("encode");
    for r in recs {
        let text = r["text"].as_str().expect("text");
        let want: Vec<u32> = bos.iter().copied().chain(ids(&r["token_ids"])).collect();
        assert_eq!(
            model.tokenizer.encode(text).expect("encode"),
            want,
            "tokenizing {text:?}"
        );
    }
}

/// Every prompt renders (chat template) and tokenizes to llama.cpp's ids, and every greedy
/// continuation that leaves llama.cpp's does so where llama.cpp itself was near a tie.
fn greedy_continuations_agree(model: &Arc<Model>, fixture: &str) {
    let mut engine = Engine::new(model.clone(), EngineConfig::default()).expect("engine");
    let recs = records(&format!("{fixture}-greedy.jsonl"));
    let (mut equal, mut total) = (0, 0);
    for r in &recs {
        let name = r["name"].as_str().expect("name");
        let prompt_text = r["prompt_text"].as_str().expect("prompt_text");
        if !r["messages"].is_null() {
            let messages: Vec<ChatMessage> =
                serde_json::from_value(r["messages"].clone()).expect("messages");
            let rendered = model
                .tokenizer
                .apply_chat_template(&messages, r["tools"].as_array().map_or(&[], |t| t))
                .expect("template");
            assert_eq!(rendered, prompt_text, "{name}: the rendered chat prompt");
        }
        let prompt = model.tokenizer.encode(prompt_text).expect("encode");
        assert_eq!(prompt, ids(&r["prompt_token_ids"]), "{name}: prompt ids");

        let want = ids(&r["generated_token_ids"]);
        let out = engine
            .generate_batch(&[GenerateRequest {
                prompt,
                params: GenerateParams {
                    max_tokens: want.len(),
                    ..Default::default()
                },
            }])
            .expect("generate")
            .remove(0);
        let same = out
            .token_ids
            .iter()
            .zip(&want)
            .take_while(|(a, b)| a == b)
            .count();
        // We stop before an end-of-generation id; llama.cpp keeps it in its list.
        let want_visible = want
            .iter()
            .filter(|t| !model.tokenizer.eog_ids().contains(t))
            .count();
        total += 1;
        if same >= want_visible && out.token_ids.len() == want_visible {
            equal += 1;
            eprintln!("{name}: all {want_visible} tokens equal llama.cpp's");
            continue;
        }
        // The first difference: llama.cpp's margin between its token and ours.
        let theirs = want[same];
        let top = r["top_logprobs"][same].as_array().expect("top_logprobs");
        let logprob = |id: u32| {
            top.iter()
                .find(|p| p[0].as_u64() == Some(u64::from(id)))
                .map(|p| p[1].as_f64().expect("logprob"))
        };
        let ours = out.token_ids.get(same).copied();
        let margin = match ours {
            Some(ours) => {
                logprob(theirs).expect("llama.cpp's token is its top 1")
                    - logprob(ours).unwrap_or(f64::NEG_INFINITY)
            }
            // We stopped where llama.cpp went on: our token was an end-of-generation id.
            None => {
                let eog = model.tokenizer.eog_ids();
                let best_eog = eog
                    .iter()
                    .filter_map(|&e| logprob(e))
                    .fold(f64::NEG_INFINITY, f64::max);
                logprob(theirs).expect("top 1") - best_eog
            }
        };
        eprintln!(
            "{name}: {same} of {want_visible} tokens equal llama.cpp's; then it picks {theirs}, we {ours:?}, its margin {margin:.3}"
        );
        assert!(
            margin < MAX_MARGIN,
            "{name}: at token {same}, llama.cpp's margin for {theirs} over our {ours:?} is {margin}"
        );
    }
    eprintln!("{equal} of {total} continuations equal llama.cpp's");
    assert!(total > 0);
}

mod qwen2_5_coder_0_5b {
    use super::*;

    const NAME: &str = "qwen2.5-coder-0.5b";

    #[test]
    fn tokenizer_ids_equal_llama_cpp() {
        super::tokenizer_ids_equal_llama_cpp(&load(NAME), NAME);
    }

    #[test]
    fn greedy_continuations_agree_with_llama_cpp() {
        super::greedy_continuations_agree(&load(NAME), NAME);
    }

    #[test]
    fn end_of_generation_is_the_files_whole_set() {
        let model = load(NAME);
        let eog = model.tokenizer.eog_ids();
        // <|endoftext|> and <|im_end|>, among the rest of llama.cpp's end-of-generation texts.
        assert!(eog.contains(&151643) && eog.contains(&151645), "{eog:?}");
    }

    /// A tool round trip renders in Qwen2.5's own format (the call inside `<tool_call>` tags, the
    /// result as a user turn in `<tool_response>` tags), and each turn's prompt is a prefix of
    /// the next one's, so a follow-up after a tool call reuses the cached KV.
    #[test]
    fn a_tool_round_trip_renders_as_the_template_writes_it() {
        let model = load(NAME);
        let tools = [
            serde_json::json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}),
        ];
        let ask = ChatMessage::new("user", "What's the weather in Paris?");
        let call = ChatMessage::tool_call(
            "call_0",
            "get_weather",
            serde_json::json!({"city": "Paris"}),
        );
        let result = ChatMessage::tool_result("call_0", "{\"temperature_c\": 18}");
        let render = |m: &[ChatMessage]| {
            model
                .tokenizer
                .apply_chat_template(m, &tools)
                .expect("render")
        };
        let first = render(std::slice::from_ref(&ask));
        let second = render(&[ask, call, result]);
        let turn = "<tool_call>\n\
            {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n\
            <|im_start|>user\n<tool_response>\n{\"temperature_c\": 18}\n</tool_response><|im_end|>\n\
            <|im_start|>assistant\n";
        assert_eq!(second, format!("{first}{turn}"));
        assert!(first.contains(
            "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""
        ));
    }
}

mod gemma_3_270m {
    use super::*;

    const NAME: &str = "gemma-3-270m";

    #[test]
    fn tokenizer_ids_equal_llama_cpp() {
        super::tokenizer_ids_equal_llama_cpp(&load(NAME), NAME);
    }

    #[test]
    fn greedy_continuations_agree_with_llama_cpp() {
        super::greedy_continuations_agree(&load(NAME), NAME);
    }

    #[test]
    fn a_chat_request_to_a_model_without_a_template_is_refused() {
        let model = load(NAME);
        let err = model
            .tokenizer
            .apply_chat_template(&[ChatMessage::new("user", "Hi")], &[])
            .expect_err("the base model has no chat template");
        assert!(err.to_string().contains("chat_template"), "{err}");
    }
}
