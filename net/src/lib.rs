//! Transport settings every Tandem process shares, so that both ends of each hop agree: message
//! size limits, HTTP/2 keepalive, mutual TLS with authorization by role ([`crate::tls`]), and
//! one way to serve a set of gRPC services with health, reflection, Prometheus metrics and
//! graceful shutdown.
//!
//! Shutdown order (linkerd's): health turns NOT_SERVING, then the server stops accepting and
//! drains in-flight calls, then, after `grace`, whatever is still running is dropped.
//!
//! The contracts these carry are `tandem-proto`'s; the crate holds the runtime around them:
//! this transport, the nodes' mutual TLS ([`tls`]) and the client API's server TLS
//! ([`api_tls`]).

pub mod api_tls;
mod channels;
pub mod otel;
mod process;
pub mod tls;

pub use channels::Channels;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::response::IntoResponse;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::service::Routes;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint, Server};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::api_tls::{ServerCert, TlsListener};
use crate::tls::{Role, Tls};

/// Calls that reached a mutual-TLS node's authorization, by service, the peer's role and
/// whether the role may make them. A peer the handshake refused never gets this far, so it is
/// never counted.
pub const NODE_CALLS: &str = "tandem_node_calls";

/// HTTP/2 PING interval on idle and busy connections, on both ends.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
/// How long a PING may go unanswered before the connection is declared dead.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(3);
/// Bound on establishing a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Bound on a node-to-node TLS handshake, after the connection is up (tonic's connect timeout
/// covers only TCP): a peer that accepts and then says nothing fails the call within it.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// HTTP/2 flow-control windows. The 64 KiB default makes a KV push wait for a window update
/// every 64 KiB, which on loopback capped transfers at a tenth of a plain TCP copy; these bound
/// what one stream and one connection may have in flight (and so buffer) instead.
pub const STREAM_WINDOW_BYTES: u32 = 4 << 20;
pub const CONNECTION_WINDOW_BYTES: u32 = 8 << 20;
/// Largest HTTP/2 frame each end accepts; bigger frames mean fewer frame headers and wakeups
/// per KV chunk than the 16 KiB default.
pub const MAX_FRAME_BYTES: u32 = 1 << 20;

/// A client endpoint for `addr` (`host:port`, or a full URI) with Tandem's keepalive and connect
/// timeout, over TLS with `tls` (between nodes, [`Tls::client_config`]). Connection happens lazily, on first
/// use.
pub fn channel(
    addr: &str,
    tls: Option<ClientTlsConfig>,
) -> Result<Channel, tonic::transport::Error> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let uri = match addr.split_once("://") {
        Some((_, rest)) => format!("{scheme}://{rest}"),
        None => format!("{scheme}://{addr}"),
    };
    let mut endpoint = Endpoint::from_shared(uri)?;
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls)?;
    }
    Ok(endpoint
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
        .tcp_nodelay(true)
        .initial_stream_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
        .max_frame_size(MAX_FRAME_BYTES)
        .connect_lazy())
}

/// A server builder with Tandem's keepalive, flow-control windows and HTTP/1.1 (for
/// `/metrics`) enabled; [`serve`] uses it, and so should anything else serving Tandem services.
pub fn server() -> Server {
    Server::builder()
        .accept_http1(true)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .initial_stream_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
        .max_frame_size(MAX_FRAME_BYTES)
}

/// The connections `listener` accepts, with TCP_NODELAY set. Servers fed an incoming stream do
/// not set it themselves (tonic's `tcp_nodelay` applies only to sockets it binds), and without it
/// small frames wait for the peer's delayed ACK: token frames arrived in 40-50 ms bursts.
pub fn incoming(
    listener: TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    TcpListenerStream::new(listener).map(|conn| {
        let conn = conn?;
        conn.set_nodelay(true)?;
        Ok(conn)
    })
}

/// What [`serve`] needs besides the listener and the services.
#[derive(Debug)]
pub struct ServeOptions {
    /// The fully qualified names of the services, reported through `grpc.health.v1`.
    pub service_names: Vec<&'static str>,
    /// The health reporter whose server is part of the routes.
    pub health: HealthReporter,
    /// Exposed as Prometheus text at `GET /metrics` (HTTP/1.1) on the same port.
    pub metrics: Arc<Registry>,
    /// How long in-flight calls may run after shutdown begins.
    pub grace: Duration,
    /// TLS, if any.
    pub tls: Option<ServerTls>,
}

/// How a server's port is secured.
#[derive(Debug)]
pub enum ServerTls {
    /// Mutual TLS between nodes, with each call allowed only to the roles
    /// [`crate::tls::allowed`] names.
    Mutual(Tls),
    /// A server certificate only, for clients ([`crate::api_tls`]).
    Server(Arc<ServerCert>),
}

/// Serves `routes` (plus reflection and `/metrics`) on `listener` until `shutdown` completes.
/// Then it reports NOT_SERVING and runs `handoff` while still serving calls (a decode node's
/// peers fetch what it hands off); then the listener closes and in-flight calls get at most
/// `options.grace`.
pub async fn serve(
    listener: TcpListener,
    routes: Routes,
    options: ServeOptions,
    shutdown: impl Future<Output = ()>,
    handoff: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let addr: Option<SocketAddr> = listener.local_addr().ok();
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tandem_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1();
    let mut routes = match reflection {
        Ok(svc) => routes.add_service(svc),
        Err(e) => {
            tracing::warn!(error = %e, "server reflection is unavailable");
            routes
        }
    };
    let registry = options.metrics;
    // The node's own registry is the caller's (shared, and so read-only here); what `serve`
    // counts itself lives in a second one, encoded after it.
    let mut served = Registry::default();
    served.register_collector(Box::new(process::ProcessMetrics));
    let calls = Family::<CallLabels, Counter>::default();
    served.register(
        NODE_CALLS,
        "Calls that reached a node's mutual-TLS authorization, by service, peer role and outcome",
        calls.clone(),
    );
    let served = Arc::new(served);
    let router = std::mem::take(routes.axum_router_mut());
    *routes.axum_router_mut() = router.route(
        "/metrics",
        axum::routing::get(move || {
            let (registry, served) = (registry.clone(), served.clone());
            async move {
                let mut text = String::new();
                let encoded =
                    prometheus_client::encoding::text::encode_registry(&mut text, &registry)
                        .and_then(|()| {
                            prometheus_client::encoding::text::encode_registry(&mut text, &served)
                        })
                        .and_then(|()| prometheus_client::encoding::text::encode_eof(&mut text));
                match encoded {
                    Ok(()) => (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        text,
                    )
                        .into_response(),
                    Err(_) => (
                        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                        "metrics encoding failed",
                    )
                        .into_response(),
                }
            }
        }),
    );

    let mut builder = server();
    if let Some(ServerTls::Mutual(tls)) = &options.tls {
        builder = builder.tls_config(tls.server_config())?;
        let router = std::mem::take(routes.axum_router_mut());
        *routes.axum_router_mut() =
            router.layer(axum::middleware::from_fn_with_state(calls, authorize));
    }
    for name in std::iter::once("").chain(options.service_names.iter().copied()) {
        options
            .health
            .set_service_status(name, ServingStatus::Serving)
            .await;
    }
    let stop_accepting = tokio_util::sync::CancellationToken::new();
    let router = builder
        .layer(tower::util::MapResponseLayer::new(documented_codes))
        .add_routes(routes);
    let stopped = stop_accepting.clone().cancelled_owned();
    let mut server = match &options.tls {
        Some(ServerTls::Server(cert)) => {
            let connections = TlsListener::new(listener, cert.acceptor()).into_stream();
            Box::pin(router.serve_with_incoming_shutdown(connections, stopped))
                as std::pin::Pin<Box<dyn Future<Output = _> + Send>>
        }
        _ => Box::pin(router.serve_with_incoming_shutdown(incoming(listener), stopped)),
    };
    tokio::select! {
        result = &mut server => return result,
        () = shutdown => {}
    }
    tracing::info!(?addr, "shutting down: NOT_SERVING, draining");
    for name in std::iter::once("").chain(options.service_names.iter().copied()) {
        options
            .health
            .set_service_status(name, ServingStatus::NotServing)
            .await;
    }
    tokio::select! {
        result = &mut server => return result,
        () = handoff => {}
    }
    stop_accepting.cancel();
    match tokio::time::timeout(options.grace, server).await {
        Ok(result) => result,
        Err(_) => {
            tracing::warn!(grace = ?options.grace, "grace period over; dropping in-flight calls");
            Ok(())
        }
    }
}

/// The labels of [`NODE_CALLS`]. Every value comes from a fixed set, whatever the peer sends.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    service: &'static str,
    role: &'static str,
    outcome: &'static str,
}

/// Lets a call through only if the peer's certificate names a role that may make it; others get
/// PERMISSION_DENIED. Counts both in [`NODE_CALLS`]. (The TLS handshake has already refused
/// peers without a certificate from the CA.)
async fn authorize(
    axum::extract::State(calls): axum::extract::State<Family<CallLabels, Counter>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let role = request
        .extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()
        .and_then(TlsConnectInfo::peer_certs)
        .and_then(|certs| certs.first().and_then(|c| tls::peer_role(c)));
    let path = request.uri().path();
    let service = tls::service(path);
    let allowed = role.is_some_and(|role| tls::allowed(path).contains(&role));
    calls
        .get_or_create(&CallLabels {
            service: service.unwrap_or("other"),
            role: role.map_or("none", Role::name),
            outcome: if allowed { "allowed" } else { "refused" },
        })
        .inc();
    if allowed {
        return next.run(request).await;
    }
    let who = role.map_or("a certificate without a role", Role::name);
    tracing::warn!(peer = who, path, "call refused: role not allowed");
    let service = service.unwrap_or(path);
    tonic::Status::permission_denied(format!("{who} may not call {service}")).into_http()
}

/// Rewrites the codes tonic's codec gives a request it cannot read, OUT_OF_RANGE (a message
/// over the size limit) and INTERNAL (bytes that are not the message), to INVALID_ARGUMENT: the
/// caller sent them, and neither is a code Tandem's contract lets callers see. Such a refusal
/// is a response with no body whose headers carry the status, which no handler of Tandem's
/// ever sends with either code; statuses in trailers (a stream that failed) pass unchanged.
fn documented_codes<B>(mut response: axum::http::Response<B>) -> axum::http::Response<B> {
    let headers = response.headers_mut();
    let code = headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
        .map(tonic::Code::from);
    if matches!(code, Some(tonic::Code::OutOfRange | tonic::Code::Internal)) {
        headers.insert(
            "grpc-status",
            axum::http::HeaderValue::from(tonic::Code::InvalidArgument as i32),
        );
    }
    response
}

/// The deadline a caller set with the `grpc-timeout` header, as an instant; `None` when the
/// caller set none (or sent one that does not parse, which tonic would have rejected anyway).
pub fn deadline(metadata: &tonic::metadata::MetadataMap) -> Option<tokio::time::Instant> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    let timeout = match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    };
    tokio::time::Instant::now().checked_add(timeout)
}

/// Whether the server at `addr` (`host:port`, or a URI) expects TLS. It sends HTTP/2's
/// connection preface, as a plaintext client does, and looks for a TLS alert record (content
/// type 21, protocol version 3.x) in the answer, which a plaintext HTTP/2 server never sends.
/// A plaintext client reads that alert as a malformed frame and reports an HTTP/2 protocol error
/// or a broken transport; Tandem's clients ask this after a plaintext call fails, to say what
/// is wrong instead.
pub async fn requires_tls(addr: &str, timeout: Duration) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host_port = authority(addr);
    let probe = async {
        let mut conn = tokio::net::TcpStream::connect(host_port).await.ok()?;
        conn.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .ok()?;
        let mut head = [0u8; 2];
        conn.read_exact(&mut head).await.ok()?;
        Some(head == [21, 3])
    };
    matches!(tokio::time::timeout(timeout, probe).await, Ok(Some(true)))
}

/// The `host:port` of `addr`, given as `host:port` or as a URI (`https://host:port/...`).
pub fn authority(addr: &str) -> &str {
    let rest = addr.split_once("://").map_or(addr, |(_, rest)| rest);
    rest.split('/').next().unwrap_or(rest)
}

/// Follows `service`'s health on `channel` until it reports SERVING.
pub async fn wait_serving(
    channel: Channel,
    service: &str,
    timeout: Duration,
) -> Result<(), tokio::time::error::Elapsed> {
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let serving = async {
        loop {
            let request = tonic_health::pb::HealthCheckRequest {
                service: service.to_string(),
            };
            if let Ok(stream) = health.watch(request).await {
                let mut stream = stream.into_inner();
                while let Ok(Some(m)) = stream.message().await {
                    if m.status
                        == tonic_health::pb::health_check_response::ServingStatus::Serving as i32
                    {
                        return;
                    }
                }
            }
            // The server is not accepting yet, or the watch broke: try again shortly.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(timeout, serving).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_header_becomes_a_deadline() {
        let mut md = tonic::metadata::MetadataMap::new();
        assert!(deadline(&md).is_none());
        md.insert("grpc-timeout", "1500m".parse().expect("ascii"));
        let left = deadline(&md).expect("set") - tokio::time::Instant::now();
        assert!(left <= Duration::from_millis(1500) && left > Duration::from_millis(1000));
        md.insert("grpc-timeout", "2x".parse().expect("ascii"));
        assert!(deadline(&md).is_none());
    }
}
