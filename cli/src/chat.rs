//! `tandem chat --server`: interactive, multi-turn, with a session id.

use std::io::{BufRead, Write};

use clap::Args;
use tandem_client::{ApiKey, ServerTlsArgs, client, explain, stream};
use tandem_engine::GenerateParams;
use tandem_proto::v1 as pb;

use crate::sampling::{CHAT_DEFAULTS, SamplingArgs};

#[derive(Args, Debug)]
pub(crate) struct ChatArgs {
    /// The router's address, host:port.
    #[arg(long, env = "TANDEM_SERVER", default_value = "127.0.0.1:50051")]
    server: String,
    /// The API key, when the router requires one.
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    #[command(flatten)]
    tls: ServerTlsArgs,
    /// The model to talk to, by its id as `GET /v1/models` lists it (the GGUF file's name
    /// without `.gguf`); unset, the router's default model.
    #[arg(long)]
    model: Option<String>,
    /// A system prompt for the conversation.
    #[arg(long)]
    system: Option<String>,
    /// The most tokens per reply.
    #[arg(long, default_value_t = 256)]
    max_tokens: u32,
    #[command(flatten)]
    sampling: SamplingArgs,
}

/// `tandem chat --server ADDR`: one line per user turn; an empty line or EOF ends.
pub(crate) fn chat(args: &ChatArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // The channel's connection task needs a runtime to be spawned on.
    let _runtime = rt.enter();
    let mut client = client(
        &args.server,
        &ApiKey::new(args.api_key.as_deref())?,
        &args.tls,
    )?;
    let session_id = format!("{:016x}", rand::random::<u64>());
    let mut messages: Vec<pb::ChatMessage> = args
        .system
        .iter()
        .map(|s| pb::ChatMessage {
            role: "system".into(),
            content: s.clone(),
            ..Default::default()
        })
        .collect();
    let sampling = args.sampling.resolve(&CHAT_DEFAULTS);
    eprintln!(
        "chatting with {} (session {session_id}); an empty line ends",
        args.server
    );
    eprintln!(
        "sampling: temperature {}, top-p {}, top-k {}, repetition penalty {}, frequency penalty \
         {}, presence penalty {}, seed {}, up to {} tokens per reply (flags change them)",
        sampling.temperature,
        sampling.top_p,
        sampling.top_k,
        sampling.repetition_penalty,
        sampling.frequency_penalty,
        sampling.presence_penalty,
        sampling.seed,
        args.max_tokens
    );
    let stdin = std::io::stdin();
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
            return Ok(());
        }
        messages.push(pb::ChatMessage {
            role: "user".into(),
            content: line.trim_end().to_string(),
            ..Default::default()
        });
        let request = pb::GenerateRequest {
            model: args.model.clone().unwrap_or_default(),
            session_id: session_id.clone(),
            messages: messages.clone(),
            sampling: Some(tandem_worker::params_to_pb(&GenerateParams {
                sampling: sampling.clone(),
                max_tokens: args.max_tokens as usize,
                ..GenerateParams::default()
            })),
            ..Default::default()
        };
        let mut stdout = std::io::stdout().lock();
        let reply = rt.block_on(stream(&mut client, request, &mut |text| {
            let _ = stdout.write_all(text.as_bytes());
            let _ = stdout.flush();
        }));
        println!();
        match reply {
            Ok(r) => messages.push(pb::ChatMessage {
                role: "assistant".into(),
                content: r.text,
                ..Default::default()
            }),
            Err(e) => {
                let e = rt.block_on(explain(&args.server, &args.tls, e));
                eprintln!("error: {e:#}");
                messages.pop();
            }
        }
    }
}
