//! TLS on the client API: handshakes over a real socket with a rustls client, a certificate
//! replaced on disk while the listener runs, a bad replacement refused, and a client that never
//! finishes its handshake holding up nobody else.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::serve::Listener;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tandem_net::api_tls::{ServerCert, TlsListener};
use tandem_net::tls::write_dev_certs;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn dev_certs(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("api-tls-{name}-{}", std::process::id()));
    write_dev_certs(&dir, &[], 1).expect("certificates");
    dir
}

/// A client that trusts only `dir`'s CA.
fn connector(dir: &Path) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(dir.join("ca.pem")).expect("ca.pem"))
        .expect("a CA certificate");
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// Handshakes with the listener at `addr` as `localhost` and returns the leaf certificate the
/// server presented, after one byte of application data has made the round trip.
async fn leaf(
    addr: std::net::SocketAddr,
    trust: &Path,
    listener: &mut TlsListener,
) -> std::io::Result<Vec<u8>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost").expect("a name");
    let client = connector(trust).connect(name, tcp);
    let server = async {
        let (mut conn, _) = listener.accept().await;
        let mut byte = [0u8];
        conn.read_exact(&mut byte).await?;
        conn.write_all(&byte).await?;
        conn.flush().await?;
        Ok::<_, std::io::Error>(conn)
    };
    let mut client = client.await?;
    client.write_all(b"x").await?;
    let (served, echoed) = tokio::join!(server, async {
        let mut byte = [0u8];
        client.read_exact(&mut byte).await.map(|_| byte)
    });
    served?;
    assert_eq!(&echoed?, b"x");
    let (_, session) = client.get_ref();
    Ok(session.peer_certificates().expect("a certificate")[0].to_vec())
}

fn pem_der(path: &Path) -> Vec<u8> {
    CertificateDer::from_pem_file(path).expect("pem").to_vec()
}

#[tokio::test]
async fn serves_the_certificate_and_swaps_in_a_renewed_one_without_a_restart() {
    let (old, new) = (dev_certs("old"), dev_certs("new"));
    let live = dev_certs("live");
    let (cert, key) = (live.join("router.pem"), live.join("router.key"));
    let served = ServerCert::load(&cert, &key).expect("load");
    let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = tcp.local_addr().expect("addr");
    let mut listener = TlsListener::new(tcp, served.acceptor());

    assert_eq!(
        leaf(addr, &live, &mut listener).await.expect("handshake"),
        pem_der(&cert)
    );
    assert!(!served.reload().expect("unchanged files reload"));

    // A client that trusts another CA refuses the server.
    assert!(leaf(addr, &old, &mut listener).await.is_err());

    // Renewal: new files in place; the next handshake presents them.
    std::fs::copy(new.join("router.pem"), &cert).expect("copy");
    std::fs::copy(new.join("router.key"), &key).expect("copy");
    assert!(served.reload().expect("reload"));
    assert_eq!(
        leaf(addr, &new, &mut listener).await.expect("handshake"),
        pem_der(&new.join("router.pem"))
    );

    // A half-written or mismatched pair is refused, and the certificate in use stays.
    std::fs::copy(old.join("router.key"), &key).expect("copy");
    let err = served
        .reload()
        .expect_err("a key that is not the certificate's");
    assert!(err.to_string().contains("router.key"), "{err}");
    std::fs::write(&cert, "not pem").expect("write");
    let err = served.reload().expect_err("no certificate");
    assert!(err.to_string().contains("router.pem"), "{err}");
    assert_eq!(
        leaf(addr, &new, &mut listener).await.expect("handshake"),
        pem_der(&new.join("router.pem"))
    );
}

#[tokio::test]
async fn a_client_that_never_finishes_its_handshake_holds_up_nobody() {
    let dir = dev_certs("stall");
    let served = ServerCert::load(&dir.join("router.pem"), &dir.join("router.key")).expect("load");
    let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = tcp.local_addr().expect("addr");
    let mut listener = TlsListener::new(tcp, served.acceptor());

    // Connected, silent: its handshake waits for a ClientHello that never comes.
    let _stalled = TcpStream::connect(addr).await.expect("connect");
    let second = tokio::time::timeout(Duration::from_secs(5), leaf(addr, &dir, &mut listener))
        .await
        .expect("the second client is served while the first stalls");
    assert_eq!(second.expect("handshake"), pem_der(&dir.join("router.pem")));

    // Plaintext where TLS is expected is refused at the handshake and never reaches a server.
    let mut plain = TcpStream::connect(addr).await.expect("connect");
    plain
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut reply = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut reply)).await;
    assert!(!reply.starts_with(b"HTTP/"), "{reply:?}");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), listener.accept())
            .await
            .is_err(),
        "no connection was handed to the server"
    );
}

#[test]
fn a_missing_file_is_a_clear_error() {
    let dir = dev_certs("missing");
    let err =
        ServerCert::load(&dir.join("nope.pem"), &dir.join("router.key")).expect_err("no such file");
    assert!(err.to_string().contains("nope.pem"), "{err}");
}
