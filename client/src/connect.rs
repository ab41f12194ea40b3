//! A connection to a router's `tandem.v1.Generation` API: its address, TLS and API key.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use tandem_proto::v1 as pb;
use tonic::Status;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

/// Sends `authorization: Bearer KEY` with every call, when there is a key.
#[derive(Clone, Debug, Default)]
pub struct ApiKey(Option<MetadataValue<Ascii>>);

impl ApiKey {
    pub fn new(key: Option<&str>) -> anyhow::Result<Self> {
        key.map(|k| {
            format!("Bearer {k}")
                .parse()
                .context("an API key must be printable ASCII")
        })
        .transpose()
        .map(Self)
    }

    /// The header value, for HTTP clients.
    pub fn header(&self) -> Option<&str> {
        self.0.as_ref().and_then(|v| v.to_str().ok())
    }
}

impl Interceptor for ApiKey {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(v) = &self.0 {
            request.metadata_mut().insert("authorization", v.clone());
        }
        Ok(request)
    }
}

/// A `tandem.v1.Generation` client that sends its API key.
pub type Client = pb::generation_client::GenerationClient<InterceptedService<Channel, ApiKey>>;

/// How a client verifies a router that serves its API over TLS (`tandem router
/// --api-tls-cert`).
#[derive(Args, Debug, Clone, Default)]
pub struct ServerTlsArgs {
    /// Verify the router's certificate against this CA certificate (PEM) instead of the
    /// system's trusted roots; implies TLS. (A server address starting `https://` also turns
    /// TLS on.)
    #[arg(long, env = "TANDEM_CA_CERT")]
    pub ca_cert: Option<PathBuf>,
    /// The name the router's certificate must carry, when it is not the server address's host
    /// (dialling an IP address, say); implies TLS.
    #[arg(long, env = "TANDEM_TLS_NAME")]
    pub tls_name: Option<String>,
}

impl ServerTlsArgs {
    /// The TLS settings for `server`, or `None` for plaintext.
    pub fn config(&self, server: &str) -> anyhow::Result<Option<ClientTlsConfig>> {
        if !server.starts_with("https://") && self.ca_cert.is_none() && self.tls_name.is_none() {
            return Ok(None);
        }
        let mut config = ClientTlsConfig::new();
        config = match &self.ca_cert {
            Some(path) => {
                let pem = std::fs::read(path).with_context(|| {
                    format!("cannot read the CA certificate {}", path.display())
                })?;
                config.ca_certificate(Certificate::from_pem(pem))
            }
            None => config.with_native_roots(),
        };
        if let Some(name) = &self.tls_name {
            config = config.domain_name(name);
        }
        Ok(Some(config))
    }
}

/// A client of the router at `server`.
pub fn client(server: &str, key: &ApiKey, tls: &ServerTlsArgs) -> anyhow::Result<Client> {
    let channel = tandem_net::channel(server, tls.config(server)?)
        .with_context(|| format!("bad server address {server:?}"))?;
    Ok(tandem_proto::limits!(
        pb::generation_client::GenerationClient::with_interceptor(channel, key.clone())
    ))
}

/// How long a failed plaintext client waits to learn whether the server wanted TLS.
const TLS_PROBE: std::time::Duration = std::time::Duration::from_secs(1);

/// `error`, or, when a plaintext client's call to `server` failed because the server speaks
/// TLS, that: the call's own error then reads as an HTTP/2 protocol error or a broken transport.
pub async fn explain(server: &str, tls: &ServerTlsArgs, error: anyhow::Error) -> anyhow::Error {
    let plaintext = matches!(tls.config(server), Ok(None));
    if plaintext && tandem_net::requires_tls(server, TLS_PROBE).await {
        return anyhow::anyhow!(
            "{server} serves TLS: give the address as https://{}, with --ca-cert when its \
             certificate is not from a public CA ({error:#})",
            tandem_net::authority(server)
        );
    }
    error
}
