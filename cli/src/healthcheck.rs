//! `tandem healthcheck`: one `grpc.health.v1.Health/Check` with a deadline, for container
//! healthchecks (the image has no shell or curl). Exit status 0 when SERVING, 1 otherwise.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;
use tandem_net::tls::{Role, Tls};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

#[derive(Args, Debug)]
pub(crate) struct HealthcheckArgs {
    /// The server's address, ip:port (no name lookup, so it works in the FROM-scratch image).
    #[arg(long, env = "TANDEM_HEALTH_ADDR", default_value = "127.0.0.1:50051")]
    addr: SocketAddr,
    /// The service to ask about; empty means the server as a whole.
    #[arg(long, default_value = "")]
    service: String,
    /// Deadline of the check, in ms (connecting included).
    #[arg(long, default_value_t = 1_000)]
    timeout_ms: u64,
    /// Ask over mutual TLS with the `client` certificate from this `tandem certs init`
    /// directory (for nodes started with `--tls-dir`).
    #[arg(long, env = "TANDEM_TLS_DIR")]
    tls_dir: Option<std::path::PathBuf>,
    /// Ask in plaintext even where `--tls-dir` (or `TANDEM_TLS_DIR`) is set: for a router's
    /// client port, which the nodes' mutual TLS does not cover (the router's container has
    /// the directory for its own calls to the workers).
    #[arg(long)]
    plaintext: bool,
}

pub(crate) fn run(args: &HealthcheckArgs) -> anyhow::Result<()> {
    let deadline = Duration::from_millis(args.timeout_ms);
    let status = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(async {
            let tls = (args.tls_dir.as_deref())
                .filter(|_| !args.plaintext)
                .map(|dir| Tls::load(dir, Role::Client))
                .transpose()?;
            let check = async {
                let channel = tandem_net::channel(
                    &args.addr.to_string(),
                    tls.as_ref().map(Tls::client_config),
                )?;
                let response = HealthClient::new(channel)
                    .check(HealthCheckRequest {
                        service: args.service.clone(),
                    })
                    .await?;
                anyhow::Ok(response.into_inner().status)
            };
            let answer = tokio::time::timeout(deadline, check)
                .await
                .map_err(|_| anyhow::anyhow!("no answer within {} ms", args.timeout_ms))
                .and_then(|answer| answer);
            match answer {
                Err(e)
                    if tls.is_none()
                        && tandem_net::requires_tls(&args.addr.to_string(), deadline).await =>
                {
                    Err(anyhow::anyhow!(
                        "{} requires TLS: pass --tls-dir with the cluster's certificates \
                         (`tandem certs init`) ({e:#})",
                        args.addr
                    ))
                }
                answer => answer,
            }
        })?;
    let status = ServingStatus::try_from(status).unwrap_or(ServingStatus::Unknown);
    anyhow::ensure!(
        status == ServingStatus::Serving,
        "{} is {}",
        args.addr,
        status.as_str_name()
    );
    println!("{} is SERVING", args.addr);
    Ok(())
}
