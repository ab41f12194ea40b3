//! `tandem-bench agent`: coding-agent sessions replayed against any endpoint that serves
//! Anthropic's Messages API or OpenAI's Responses API (Tandem's router, llama-server, vLLM), to
//! measure what an agent's traffic gets: every turn resends a long system prompt and a tool
//! list, then the history, which grows by a tool call and its result each turn.
//!
//! The workload: `sessions` sessions of the same agent (one system prompt of `system_words`
//! words and `tools` tool definitions of realistic size, shared by every session), each with
//! its own task. After each turn the history grows by an assistant turn that calls a tool and
//! the tool's result (`result_words` words). That assistant turn is scripted, not the model's
//! reply: every system then sees exactly the same prompts, whatever its model answers, so
//! their times and cache shares compare. The model's reply (greedy, at most `max_tokens`) is
//! read whole, as an agent reads it. Turn `t` of every session is sent before turn `t + 1` of
//! any, with `concurrency` requests in flight, so sessions interleave.
//!
//! It reports per turn and overall, as `bench multiturn` does (and `bench plot` draws its
//! results the same way): time to first token (the first text or tool-input delta), the
//! turn's whole time, prompt tokens and the share of them read from a cache (Messages:
//! `cache_read_input_tokens`; Responses: `input_tokens_details.cached_tokens`), and the output
//! tokens per second over the run.

use anyhow::{Context, bail};
use clap::Args;
use serde_json::{Value, json};

use crate::endpoint::{AgentApi, Endpoint, EndpointArgs};
use crate::multiturn::{Results, Turn, send_turn};
use crate::progress_bar;
use crate::workload::words;

#[derive(Args, Debug)]
pub(crate) struct AgentArgs {
    /// The endpoint: `--openai http://host:port` (the HTTP APIs; `--server` is not taken).
    #[command(flatten)]
    endpoint: EndpointArgs,
    /// Which API the agent speaks.
    #[arg(long, value_enum, default_value = "messages")]
    api: AgentApi,
    #[command(flatten)]
    shape: SessionShape,
    /// Turns per session.
    #[arg(long, default_value_t = 6)]
    turns: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 2)]
    concurrency: usize,
    /// Most tokens per reply.
    #[arg(long, default_value_t = 48)]
    max_tokens: u32,
    /// A name for this run in the results (e.g. `tandem-1p1d`).
    #[arg(long, default_value = "run")]
    label: String,
    /// Print the results as JSON (per-turn records and the summary) instead of a table.
    #[arg(long)]
    json: bool,
}

/// The agent's sessions: how many, and the size of what they send.
#[derive(Args, Debug, Clone)]
pub(crate) struct SessionShape {
    /// Sessions (one task each).
    #[arg(long, default_value_t = 4)]
    pub(crate) sessions: usize,
    /// Words in the agent's system prompt (1500 words are about 2,000 tokens).
    #[arg(long, default_value_t = 1500)]
    system_words: usize,
    /// Tool definitions offered on every turn (each a description of 60 words and a schema of
    /// three parameters).
    #[arg(long, default_value_t = 12)]
    tools: usize,
    /// Words in each tool result the history grows by.
    #[arg(long, default_value_t = 150)]
    result_words: usize,
    /// Varies the text.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// One step of a session's history after its task: the scripted assistant turn (a sentence
/// and a tool call) and the tool's result.
struct Step {
    call_id: String,
    tool: String,
    arguments: Value,
    result: String,
}

/// What every session shares, and what each one's history holds so far.
pub(crate) struct Workload {
    shape: SessionShape,
    system: String,
    tools: Vec<(String, String, Value)>,
    tasks: Vec<String>,
    steps: Vec<Vec<Step>>,
}

impl Workload {
    pub(crate) fn new(shape: &SessionShape) -> Self {
        let tools = (0..shape.tools)
            .map(|i| {
                let name = format!("tool_{i}");
                let description = format!(
                    "Use this tool to work on the repository. {}",
                    words(60, shape.seed, usize::MAX - 1, i)
                );
                let schema = json!({
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "The file or directory to act on."},
                        "pattern": {"type": "string", "description": "What to look for, if anything."},
                        "limit": {"type": "integer", "description": "How many results at most."},
                    },
                    "required": ["path"],
                });
                (name, description, schema)
            })
            .collect();
        Self {
            shape: shape.clone(),
            system: format!(
                "You are a coding agent working in a repository. Call tools to read and change \
                 files. {}",
                words(shape.system_words, shape.seed, usize::MAX, 0)
            ),
            tools,
            tasks: (0..shape.sessions)
                .map(|s| format!("Task: {}", words(40, shape.seed, s, 0)))
                .collect(),
            steps: (0..shape.sessions).map(|_| Vec::new()).collect(),
        }
    }

    /// Grows session `s`'s history by turn `turn`'s scripted tool call and its result.
    pub(crate) fn step(&mut self, s: usize, turn: usize) {
        let tool = &self.tools[(s + turn) % self.tools.len().max(1)].0;
        self.steps[s].push(Step {
            call_id: format!("call_{s}_{turn}"),
            tool: tool.clone(),
            arguments: json!({"path": format!("src/module_{turn}.rs"), "limit": 20}),
            result: words(self.shape.result_words, self.shape.seed, s, turn + 1),
        });
    }

    /// Session `s`'s next request in `api`'s shape.
    pub(crate) fn body(&self, api: AgentApi, model: &str, max_tokens: u32, s: usize) -> Value {
        let said = |step: &Step| format!("I will run {} next.", step.tool);
        match api {
            AgentApi::Messages => {
                let mut messages = vec![json!({"role": "user", "content": self.tasks[s]})];
                for step in &self.steps[s] {
                    messages.push(json!({"role": "assistant", "content": [
                        {"type": "text", "text": said(step)},
                        {"type": "tool_use", "id": step.call_id, "name": step.tool,
                         "input": step.arguments},
                    ]}));
                    messages.push(json!({"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": step.call_id,
                         "content": step.result},
                    ]}));
                }
                let tools: Vec<Value> = self
                    .tools
                    .iter()
                    .map(|(name, description, schema)| {
                        json!({"name": name, "description": description, "input_schema": schema})
                    })
                    .collect();
                json!({"model": model, "max_tokens": max_tokens, "stream": true,
                       "temperature": 0.0, "system": self.system, "tools": tools,
                       "messages": messages})
            }
            AgentApi::Responses => {
                // Messages typed as such (`"type": "message"`): llama-server takes an assistant
                // message only so.
                let mut input =
                    vec![json!({"type": "message", "role": "user", "content": self.tasks[s]})];
                for step in &self.steps[s] {
                    input.push(json!({"type": "message", "role": "assistant",
                                      "content": said(step)}));
                    input.push(json!({"type": "function_call", "call_id": step.call_id,
                                      "name": step.tool,
                                      "arguments": step.arguments.to_string()}));
                    input.push(json!({"type": "function_call_output",
                                      "call_id": step.call_id, "output": step.result}));
                }
                let tools: Vec<Value> = self
                    .tools
                    .iter()
                    .map(|(name, description, schema)| {
                        json!({"type": "function", "name": name, "description": description,
                               "parameters": schema})
                    })
                    .collect();
                json!({"model": model, "max_output_tokens": max_tokens, "stream": true,
                       "temperature": 0.0, "instructions": self.system, "tools": tools,
                       "input": input})
            }
        }
    }
}

pub(crate) fn agent(args: &AgentArgs) -> anyhow::Result<()> {
    if args.shape.sessions == 0 || args.turns == 0 || args.concurrency == 0 || args.max_tokens == 0
    {
        bail!("--sessions, --turns, --concurrency and --max-tokens must each be at least 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let started_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let started = std::time::Instant::now();
    let (endpoint, turns) = rt.block_on(run(args))?;
    let seconds = started.elapsed().as_secs_f64();
    let output: u32 = turns.iter().map(|t| t.completion_tokens).sum();
    let results = Results::new(&args.label, endpoint, started_unix_ms, turns);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        results.print_table();
        println!(
            "  throughput: {:.1} output tokens/s over {:.1} s",
            f64::from(output) / seconds,
            seconds
        );
    }
    Ok(())
}

async fn run(args: &AgentArgs) -> anyhow::Result<(String, Vec<Turn>)> {
    if args.endpoint.is_grpc() {
        bail!("bench agent drives the HTTP APIs agents speak: give --openai http://HOST:PORT");
    }
    let endpoint = Endpoint::connect(&args.endpoint).await?;
    let model = endpoint.model().context("the endpoint names no model")?;
    let mut workload = Workload::new(&args.shape);
    let mut out = Vec::new();
    let progress = progress_bar((args.shape.sessions * args.turns) as u64, "agent turns");
    let started = std::time::Instant::now();
    for turn in 0..args.turns {
        let bodies: Vec<(usize, Value)> = (0..args.shape.sessions)
            .map(|s| (s, workload.body(args.api, &model, args.max_tokens, s)))
            .collect();
        let api = args.api;
        let replies = send_turn(turn, bodies, args.concurrency, &progress, started, |body| {
            let endpoint = &endpoint;
            let session = format!("bench-agent-{}", body.0);
            async move { endpoint.agent_turn(api, body.1, &session).await }
        })
        .await?;
        for (s, (sent_ms, reply)) in replies.into_iter().enumerate() {
            out.push(Turn::new(s, turn, sent_ms, &reply));
            workload.step(s, turn);
        }
    }
    progress.finish_and_clear();
    Ok((endpoint.describe(), out))
}
