//! `tandem keys new`: makes an API key, appends its hash to a key file (created owner-only),
//! and prints the key once; the router (`--api-keys`) picks the new line up within a second.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use clap::{Args, Subcommand};
use tandem_router::auth::{key_line, parse_key_file, valid_tenant};
use tandem_router::{Class, KeyLimits};

#[derive(Subcommand, Debug)]
pub(crate) enum KeysCommand {
    /// Make a key for a tenant: its hash goes into the file, the key itself to stdout, once.
    New(NewArgs),
}

#[derive(Args, Debug)]
pub(crate) struct NewArgs {
    /// The key file the router reads (`--api-keys`); created if missing.
    #[arg(long)]
    file: PathBuf,
    /// The tenant the key belongs to (letters, digits, '.', '_', '-'; at most 64): its own
    /// prefix-cache partition, shared by the tenant's keys.
    #[arg(long)]
    tenant: String,
    /// Requests per minute for this key (unset: the router's default; 0: unlimited).
    #[arg(long)]
    rpm: Option<u32>,
    /// Prompt plus max_tokens per minute for this key (unset: the router's default; 0:
    /// unlimited).
    #[arg(long)]
    tpm: Option<u32>,
    /// Concurrent generations for this key (unset: the router's default; 0: unlimited).
    #[arg(long)]
    streams: Option<u32>,
    /// The highest priority class the key's requests may ask for with `x-priority`, and theirs
    /// without it: interactive, standard or batch (unset: standard).
    #[arg(long, value_parser = parse_class)]
    class: Option<Class>,
    /// The key's share of the tokens served within its class, against the other keys' (unset:
    /// 1).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    weight: Option<u32>,
}

fn parse_class(name: &str) -> Result<Class, String> {
    Class::parse(name).ok_or_else(|| "expected interactive, standard or batch".to_string())
}

pub(crate) fn run(command: &KeysCommand) -> anyhow::Result<()> {
    match command {
        KeysCommand::New(args) => new(args),
    }
}

fn new(args: &NewArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        valid_tenant(&args.tenant),
        "a tenant is 1 to 64 letters, digits, '.', '_' or '-'"
    );
    // Refuse to append to a file the router would then reject as a whole.
    let existing = match std::fs::read_to_string(&args.file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => anyhow::bail!("cannot read {}: {e}", args.file.display()),
    };
    parse_key_file(&existing)
        .map_err(|e| anyhow::anyhow!("{} is not a valid key file: {e}", args.file.display()))?;
    let key = format!(
        "tk-{:032x}{:032x}",
        rand::random::<u128>(),
        rand::random::<u128>()
    );
    let limits = KeyLimits {
        requests_per_minute: args.rpm,
        tokens_per_minute: args.tpm,
        streams: args.streams,
        class: args.class,
        weight: args.weight,
    };
    let mut line = key_line(&args.tenant, &key, limits);
    if !existing.is_empty() && !existing.ends_with('\n') {
        line.insert(0, '\n');
    }
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&args.file)
        .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", args.file.display()))?;
    writeln!(file, "{line}")?;
    eprintln!(
        "added a key for tenant {} to {}; it is shown only now:",
        args.tenant,
        args.file.display()
    );
    println!("{key}");
    Ok(())
}
