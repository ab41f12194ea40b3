//! Mutual TLS between Tandem's nodes, and which role may call what.
//!
//! Every node holds a certificate from the cluster's CA (`tandem certs init` makes a development
//! one) whose subject alternative names carry its role as the URI `spiffe://tandem/ROLE`. Both
//! ends of each connection present one: a server accepts only peers the CA signed, and then
//! lets each role call only the services it needs ([`allowed`]). A decode node's certificate
//! cannot call Prefill, a client's cannot push KV. Every certificate also names
//! [`SERVER_NAME`], and clients verify servers against that name rather than the address they
//! dialled. Addresses change (DNS discovery, scaled services, relays), but only the CA's
//! certificates carry the name.
//!
//! Files in a TLS directory: `ca.pem`, and `ROLE.pem` and `ROLE.key` for each role.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// The name every node certificate carries and every client verifies.
pub const SERVER_NAME: &str = "tandem.internal";

/// The prefix of the URI that names a certificate's role.
pub const ROLE_URI_PREFIX: &str = "spiffe://tandem/";

/// What a certificate lets its holder be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Calls the workers: Prefill, Decode, Worker (info, load, cache events); and its peer
    /// routers' Peer (state, attach).
    Router,
    /// Pushes KV to decode nodes; fetches cached KV from its peers (a drain's moves).
    Prefill,
    /// Serves Decode and KvTransfer; fetches cached KV from decode and prefill nodes.
    Decode,
    /// Operators' tools: health checks and metrics scrapes.
    Client,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Router, Role::Prefill, Role::Decode, Role::Client];

    pub fn name(self) -> &'static str {
        match self {
            Role::Router => "router",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Client => "client",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.name() == name)
    }

    /// The URI SAN that names this role.
    pub fn uri(self) -> String {
        format!("{ROLE_URI_PREFIX}{}", self.name())
    }

    /// This role's certificate and key in a TLS directory.
    pub fn files(self) -> [String; 2] {
        [
            format!("{}.pem", self.name()),
            format!("{}.key", self.name()),
        ]
    }
}

/// The services (or single methods, `Service/Method`, which come before their service) a node
/// serves over mutual TLS, and the roles that may call each. Health, reflection and metrics are
/// open to every role.
const SERVICES: [(&str, &[Role]); 10] = [
    // A pipelined prefill: a stage reads the KV of the stage before.
    ("tandem.v1.Prefill/Relay", &[Role::Prefill]),
    ("tandem.v1.Prefill", &[Role::Router]),
    ("tandem.v1.Decode", &[Role::Router]),
    ("tandem.v1.Worker", &[Role::Router]),
    // Peer fetch: a decode node pulls cached KV from a decode or prefill node, a prefill node
    // from a draining prefill peer.
    ("tandem.v1.KvTransfer/Fetch", &[Role::Decode, Role::Prefill]),
    ("tandem.v1.KvTransfer", &[Role::Prefill]),
    // A router's peer port: routers share their state.
    ("tandem.v1.Peer", &[Role::Router]),
    ("grpc.health.v1.Health", &Role::ALL),
    ("grpc.reflection.v1.ServerReflection", &Role::ALL),
    ("metrics", &Role::ALL),
];

/// The entry of [`SERVICES`] that `path` (`/package.Service/Method`, or an HTTP path such as
/// `/metrics`) names.
fn entry(path: &str) -> Option<&'static (&'static str, &'static [Role])> {
    let method = path.trim_start_matches('/');
    let service = method.split('/').next().unwrap_or("");
    SERVICES.iter().find(|(s, _)| *s == method || *s == service)
}

/// The service `path` names, if a worker serves it.
pub fn service(path: &str) -> Option<&'static str> {
    entry(path).map(|(s, _)| *s)
}

/// The roles that may call `path` on a worker.
pub fn allowed(path: &str) -> &'static [Role] {
    entry(path).map_or(&[], |(_, roles)| *roles)
}

/// The role named by a peer certificate (DER), if it carries exactly one.
pub fn peer_role(der: &[u8]) -> Option<Role> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    let mut roles = san.value.general_names.iter().filter_map(|n| match n {
        x509_parser::extensions::GeneralName::URI(uri) => {
            uri.strip_prefix(ROLE_URI_PREFIX).and_then(Role::parse)
        }
        _ => None,
    });
    let role = roles.next()?;
    roles.next().is_none().then_some(role)
}

#[derive(Debug, thiserror::Error)]
#[error("cannot read {path}: {source} (make the files with `tandem certs init DIR`)")]
pub struct TlsError {
    path: PathBuf,
    source: std::io::Error,
}

/// One node's TLS material: the CA, and its own certificate and key.
#[derive(Clone, Debug)]
pub struct Tls {
    pub role: Role,
    ca: Vec<u8>,
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl Tls {
    /// Reads `ca.pem`, `ROLE.pem` and `ROLE.key` from `dir`.
    pub fn load(dir: &Path, role: Role) -> Result<Self, TlsError> {
        let read = |name: String| {
            let path = dir.join(name);
            std::fs::read(&path).map_err(|source| TlsError { path, source })
        };
        let [cert, key] = role.files();
        Ok(Self {
            role,
            ca: read("ca.pem".into())?,
            cert: read(cert)?,
            key: read(key)?,
        })
    }

    fn identity(&self) -> Identity {
        Identity::from_pem(&self.cert, &self.key)
    }

    /// A server that requires a client certificate from the CA.
    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity())
            .client_ca_root(Certificate::from_pem(&self.ca))
    }

    /// A client that trusts only the CA and presents no certificate, verifying the name it
    /// dials: for a router whose client API serves this CA's router certificate.
    pub fn api_client_config(&self) -> ClientTlsConfig {
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca))
    }

    /// A client that presents this node's certificate and trusts only the CA, for
    /// [`SERVER_NAME`], and gives up a handshake after [`crate::HANDSHAKE_TIMEOUT`].
    pub fn client_config(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca))
            .identity(self.identity())
            .domain_name(SERVER_NAME)
            .timeout(crate::HANDSHAKE_TIMEOUT)
    }
}

/// Writes a development CA (`ca.pem`, `ca.key`) and a certificate per role into `dir`, made with
/// rcgen; returns the files written. Each certificate names its role's URI, [`SERVER_NAME`],
/// `localhost`, 127.0.0.1 and `names`, and is valid for `days`. Keys are written owner-only.
pub fn write_dev_certs(dir: &Path, names: &[String], days: u32) -> Result<Vec<PathBuf>, CertError> {
    std::fs::create_dir_all(dir).map_err(|source| CertError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let now = time::OffsetDateTime::now_utc();
    let valid = |params: &mut CertificateParams| {
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(i64::from(days));
    };
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.distinguished_name
        .push(DnType::CommonName, "tandem development CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    valid(&mut ca);
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let mut written = vec![
        write(dir, "ca.pem", &ca_cert.pem(), 0o644)?,
        write(dir, "ca.key", &ca_key.serialize_pem(), 0o600)?,
    ];
    let issuer = Issuer::new(ca, ca_key);
    let dns: Vec<String> = [SERVER_NAME, "localhost"]
        .into_iter()
        .map(str::to_string)
        .chain(names.iter().cloned())
        .collect();
    for role in Role::ALL {
        let mut params = CertificateParams::new(dns.clone())?;
        params
            .subject_alt_names
            .push(SanType::URI(role.uri().try_into()?));
        params
            .subject_alt_names
            .push(SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()));
        params
            .distinguished_name
            .push(DnType::CommonName, format!("tandem {}", role.name()));
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        valid(&mut params);
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &issuer)?;
        let [cert_file, key_file] = role.files();
        written.push(write(dir, &cert_file, &cert.pem(), 0o644)?);
        written.push(write(dir, &key_file, &key.serialize_pem(), 0o600)?);
    }
    Ok(written)
}

fn write(dir: &Path, name: &str, text: &str, mode: u32) -> Result<PathBuf, CertError> {
    let path = dir.join(name);
    // A key file is replaced, not rewritten in place, so it never exists with wider permissions.
    let _ = std::fs::remove_file(&path);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|source| CertError::Io {
            path: path.clone(),
            source,
        })?;
    Ok(path)
}

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("cannot write {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot make a certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_role_may_call_only_what_it_needs() {
        let may = |path, role| allowed(path).contains(&role);
        assert!(may("/tandem.v1.Prefill/Prefill", Role::Router));
        assert!(!may("/tandem.v1.Prefill/Prefill", Role::Decode));
        assert!(may("/tandem.v1.KvTransfer/Push", Role::Prefill));
        assert!(!may("/tandem.v1.KvTransfer/Push", Role::Client));
        assert!(!may("/tandem.v1.KvTransfer/Push", Role::Router));
        assert!(may("/tandem.v1.Worker/Load", Role::Router));
        assert!(may("/tandem.v1.Worker/Adopt", Role::Router));
        assert!(!may("/tandem.v1.Worker/Adopt", Role::Decode));
        assert!(may("/tandem.v1.KvTransfer/Fetch", Role::Prefill));
        assert!(may("/tandem.v1.KvTransfer/Fetch", Role::Decode));
        assert!(!may("/tandem.v1.KvTransfer/Fetch", Role::Client));
        assert!(!may("/tandem.v1.Decode/Generate", Role::Prefill));
        // A router's peer port: its session tables and streams are for other routers only.
        assert!(may("/tandem.v1.Peer/State", Role::Router));
        assert!(!may("/tandem.v1.Peer/State", Role::Client));
        assert!(!may("/tandem.v1.Peer/Attach", Role::Decode));
        assert!(may("/grpc.health.v1.Health/Check", Role::Client));
        assert!(may("/metrics", Role::Client));
        assert!(!may("/tandem.v1.Unknown/X", Role::Router));
        assert!(allowed("").is_empty());
        assert_eq!(
            service("/tandem.v1.KvTransfer/Push"),
            Some("tandem.v1.KvTransfer")
        );
        assert_eq!(service("/metrics"), Some("metrics"));
        assert_eq!(service("/tandem.v1.Unknown/X"), None);
    }
}
