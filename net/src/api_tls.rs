//! TLS on the client API: the router's gRPC and HTTP ports can serve a certificate of the
//! operator's choosing (a public CA's, or one `tandem certs init` made). Clients are not asked
//! for a certificate; API keys identify them. The certificate and key are read again when their
//! files change, so a renewed certificate takes effect without a restart.
//!
//! The handshakes happen here rather than in tonic's or axum's servers because neither can swap
//! its certificate while running, and because one listener type then serves both ports.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;

/// How long a client may take over its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most handshakes in progress at once; past it, the listener stops accepting until one ends.
pub const MAX_HANDSHAKES: usize = 256;
/// How often the certificate files are checked for changes.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ApiTlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

/// The PEM files a [`ServerCert`] comes from.
#[derive(Clone, Debug)]
struct Files {
    cert: PathBuf,
    key: PathBuf,
}

/// The files' contents: the certificate chain's, then the key's.
type Contents = (Vec<u8>, Vec<u8>);

/// A server certificate chain and key, read from PEM files and replaced when they change.
#[derive(Debug)]
pub struct ServerCert {
    files: Files,
    /// The files' contents when last loaded, and what they made.
    current: RwLock<(Contents, Arc<CertifiedKey>)>,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl Files {
    fn read(&self) -> Result<Contents, ApiTlsError> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|source| ApiTlsError::Read {
                path: path.to_owned(),
                source,
            })
        };
        Ok((read(&self.cert)?, read(&self.key)?))
    }

    /// The certified key that `contents` (read from these files) make.
    fn parse(&self, (cert, key): &Contents) -> Result<CertifiedKey, ApiTlsError> {
        let invalid = |path: &Path, reason: String| ApiTlsError::Invalid {
            path: path.to_owned(),
            reason,
        };
        let chain = CertificateDer::pem_slice_iter(cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid(&self.cert, e.to_string()))?;
        if chain.is_empty() {
            return Err(invalid(&self.cert, "no PEM certificate in the file".into()));
        }
        let key = PrivateKeyDer::from_pem_slice(key)
            .map_err(|e| invalid(&self.key, format!("no PEM private key: {e}")))?;
        CertifiedKey::from_der(chain, key, &provider())
            .map_err(|e| invalid(&self.key, e.to_string()))
    }
}

impl ServerCert {
    /// Reads the certificate chain (`cert`, PEM, leaf first) and its private key (`key`, PEM).
    pub fn load(cert: &Path, key: &Path) -> Result<Arc<Self>, ApiTlsError> {
        let files = Files {
            cert: cert.to_owned(),
            key: key.to_owned(),
        };
        let contents = files.read()?;
        let certified = Arc::new(files.parse(&contents)?);
        Ok(Arc::new(Self {
            files,
            current: RwLock::new((contents, certified)),
        }))
    }

    /// Reads the files again and, if they changed and still make a valid pair, serves them from
    /// the next handshake on. Returns whether the certificate was replaced.
    pub fn reload(&self) -> Result<bool, ApiTlsError> {
        let contents = self.files.read()?;
        if self.current.read().unwrap_or_else(|e| e.into_inner()).0 == contents {
            return Ok(false);
        }
        let certified = Arc::new(self.files.parse(&contents)?);
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = (contents, certified);
        Ok(true)
    }

    /// Reloads every [`RELOAD_INTERVAL`] until `cancel`. A file that fails to read or parse
    /// (half written, say) is logged, and the certificate in use is kept.
    pub async fn watch(self: Arc<Self>, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(RELOAD_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = cancel.cancelled() => return,
            }
            match self.reload() {
                Ok(true) => {
                    tracing::info!(cert = %self.files.cert.display(), "API certificate reloaded")
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "API certificate not reloaded; keeping the one in use")
                }
            }
        }
    }

    /// A TLS acceptor that serves this certificate, offering HTTP/2 and HTTP/1.1.
    pub fn acceptor(self: &Arc<Self>) -> TlsAcceptor {
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        TlsAcceptor::from(Arc::new(config))
    }
}

impl ResolvesServerCert for ServerCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .1
                .clone(),
        )
    }
}

/// Connections that have completed their TLS handshake, accepted from a TCP listener. Handshakes
/// run concurrently (at most [`MAX_HANDSHAKES`], each within [`HANDSHAKE_TIMEOUT`]), so a slow or
/// silent client holds up nobody else. Serves axum directly ([`axum::serve::Listener`]) and tonic
/// through [`TlsListener::into_stream`].
#[derive(Debug)]
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: std::io::Result<SocketAddr>,
}

impl TlsListener {
    /// Starts accepting on `listener`; accepting stops when this is dropped.
    pub fn new(listener: TcpListener, acceptor: TlsAcceptor) -> Self {
        let local = listener.local_addr();
        let (tx, ready) = mpsc::channel(16);
        tokio::spawn(async move {
            let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
            loop {
                let permit = tokio::select! {
                    p = handshakes.clone().acquire_owned() => p.expect("never closed"),
                    () = tx.closed() => return,
                };
                let (tcp, peer) = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            // Out of file descriptors, say: wait rather than spin.
                            tracing::warn!(error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    },
                    () = tx.closed() => return,
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    // As in `net::incoming`: small frames must not wait for delayed ACKs.
                    let _ = tcp.set_nodelay(true);
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Self { ready, local }
    }

    /// The connections, as the stream tonic's `serve_with_incoming` takes.
    pub fn into_stream(
        self,
    ) -> impl tokio_stream::Stream<Item = std::io::Result<TlsStream<TcpStream>>> {
        use tokio_stream::StreamExt;
        tokio_stream::wrappers::ReceiverStream::new(self.ready).map(|(tls, _)| Ok(tls))
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(conn) => conn,
            // The accepting task ended, which it does only once this listener is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        match &self.local {
            Ok(addr) => Ok(*addr),
            Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
        }
    }
}
