//! Finding replicas: each configured target is `host:port`. An IP address is one replica for
//! good; a name is resolved now and every [`RESOLVE_INTERVAL`], and the set follows its
//! answers: a compose service scaled up or down, a Kubernetes headless Service's ready pods,
//! a restarted container's new address. Replicas join and leave without a restart.
//!
//! Names are resolved in-process (hickory, over /etc/resolv.conf and /etc/hosts), not through
//! glibc's `getaddrinfo`, which a statically linked binary in a `FROM scratch` image cannot use
//! (it would need glibc's shared NSS modules). Replicas are then dialled by IP address.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hickory_resolver::TokioResolver;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cluster::replica::Role;
use crate::cluster::replicas::Replicas;
use crate::error::{Error, Result};

/// How often a name is resolved again.
pub const RESOLVE_INTERVAL: Duration = Duration::from_secs(2);

/// A configured replica target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Addr(SocketAddr),
    Name { host: String, port: u16 },
}

impl Target {
    /// Parses `host:port` (or `[v6]:port`); a scheme such as `http://` is not accepted.
    pub fn parse(s: &str) -> Result<Self> {
        let invalid = |reason: &str| Error::InvalidArgument {
            field: "replicas",
            reason: format!("{s:?}: {reason}"),
        };
        if let Ok(addr) = s.parse::<SocketAddr>() {
            return Ok(Target::Addr(addr));
        }
        let (host, port) = s
            .rsplit_once(':')
            .ok_or_else(|| invalid("expected host:port"))?;
        let port: u16 = port
            .parse()
            .map_err(|_| invalid("the port is not a number from 0 to 65535"))?;
        let valid = !host.is_empty()
            && host.len() <= 253
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_');
        if !valid {
            return Err(invalid("the host is neither an IP address nor a DNS name"));
        }
        Ok(Target::Name {
            host: host.to_string(),
            port,
        })
    }
}

/// Adds every target's replicas, and keeps following the names until `cancel`.
pub fn start(
    replicas: &Arc<Replicas>,
    targets: &[(Role, String)],
    tracker: &TaskTracker,
    cancel: &CancellationToken,
) -> Result<()> {
    let mut names = Vec::new();
    for (role, spec) in targets {
        match Target::parse(spec)? {
            Target::Addr(addr) => {
                replicas.add(*role, &addr.to_string(), spec)?;
            }
            Target::Name { host, port } => names.push((*role, spec.clone(), host, port)),
        }
    }
    if names.is_empty() {
        return Ok(());
    }
    let resolver = resolver()?;
    for (role, spec, host, port) in names {
        let (replicas, resolver, cancel) = (replicas.clone(), resolver.clone(), cancel.clone());
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(RESOLVE_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = cancel.cancelled() => return,
                }
                if let Some(addrs) = lookup(&resolver, &host, port).await {
                    let addrs = addrs.iter().map(SocketAddr::to_string).collect();
                    follow(&replicas, role, &spec, &addrs);
                }
            }
        });
    }
    Ok(())
}

/// Every address `spec` (`host:port`) stands for now, resolved the same way as replicas' names.
pub async fn resolve(spec: &str) -> Result<Vec<SocketAddr>> {
    match Target::parse(spec)? {
        Target::Addr(addr) => Ok(vec![addr]),
        Target::Name { host, port } => {
            let answer =
                resolver()?
                    .lookup_ip(host.as_str())
                    .await
                    .map_err(|e| Error::InvalidArgument {
                        field: "address",
                        reason: format!("cannot resolve {host}: {e}"),
                    })?;
            Ok(answer.iter().map(|ip| SocketAddr::new(ip, port)).collect())
        }
    }
}

/// Addresses given as `host:port` specs (routers: the picker's endpoints, a router's peers),
/// followed as replicas' are: each name resolved again at every [`Specs::addresses`], with one
/// resolver kept across them.
#[derive(Debug)]
pub struct Specs {
    targets: Vec<(String, Target)>,
    /// Only when a spec is a name.
    resolver: Option<TokioResolver>,
}

impl Specs {
    pub fn parse(specs: &[String]) -> Result<Self> {
        let targets = (specs.iter())
            .map(|s| Ok((s.clone(), Target::parse(s)?)))
            .collect::<Result<Vec<_>>>()?;
        let names = (targets.iter()).any(|(_, t)| matches!(t, Target::Name { .. }));
        let resolver = if names { Some(resolver()?) } else { None };
        Ok(Self { targets, resolver })
    }

    /// Every spec's addresses now, sorted; `None` when a lookup failed (as opposed to a name
    /// with no addresses), and what the caller follows should stay as it is.
    pub async fn addresses(&self) -> Option<Vec<SocketAddr>> {
        let mut addrs = BTreeSet::new();
        for (_, target) in &self.targets {
            match (target, &self.resolver) {
                (Target::Addr(addr), _) => {
                    addrs.insert(*addr);
                }
                (Target::Name { host, port }, Some(resolver)) => {
                    addrs.extend(lookup(resolver, host, *port).await?);
                }
                (Target::Name { .. }, None) => {}
            }
        }
        Some(addrs.into_iter().collect())
    }
}

/// A resolver from the system's configuration that caches nothing: every lookup asks again,
/// so that a replica leaving or joining shows up at the next interval, whatever the TTL.
fn resolver() -> Result<TokioResolver> {
    let mut builder = TokioResolver::builder_tokio().map_err(|e| Error::InvalidArgument {
        field: "replicas",
        reason: format!("cannot read the system's DNS configuration: {e}"),
    })?;
    builder.options_mut().cache_size = 0;
    Ok(builder.build())
}

/// The name's addresses now: `Some(empty)` when it has none (every replica left), `None` when
/// the lookup failed and the set should stay as it is.
async fn lookup(resolver: &TokioResolver, host: &str, port: u16) -> Option<BTreeSet<SocketAddr>> {
    match resolver.lookup_ip(host).await {
        Ok(answer) => Some(
            answer
                .iter()
                .map(|ip: IpAddr| SocketAddr::new(ip, port))
                .collect(),
        ),
        Err(e) if e.is_no_records_found() || e.is_nx_domain() => Some(BTreeSet::new()),
        Err(e) => {
            tracing::warn!(host, error = %e, "DNS lookup failed; keeping what it named as it is");
            None
        }
    }
}

/// Makes the replicas found through `spec` exactly `addrs`.
fn follow(replicas: &Arc<Replicas>, role: Role, spec: &str, addrs: &BTreeSet<String>) {
    for r in replicas.all() {
        if r.role == role && r.target == spec && !addrs.contains(&r.addr) {
            replicas.remove(role, &r.addr);
        }
    }
    for addr in addrs {
        if let Err(e) = replicas.add(role, addr, spec) {
            tracing::warn!(replica = %addr, error = %e, "cannot add a replica");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_addresses_or_names() {
        assert_eq!(
            Target::parse("10.0.0.7:50053").ok(),
            Some(Target::Addr("10.0.0.7:50053".parse().expect("addr")))
        );
        assert_eq!(
            Target::parse("[::1]:50053").ok(),
            Some(Target::Addr("[::1]:50053".parse().expect("addr")))
        );
        assert_eq!(
            Target::parse("decode:50053").ok(),
            Some(Target::Name {
                host: "decode".into(),
                port: 50053
            })
        );
        for bad in [
            "decode",
            "decode:",
            "decode:99999",
            ":50053",
            "http://decode:1",
            "a b:1",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad} is refused");
        }
    }

    /// `localhost` comes from /etc/hosts through the same resolver, and the set follows it.
    #[tokio::test]
    async fn a_name_becomes_its_addresses() {
        let replicas = Arc::new(Replicas::new(16, CancellationToken::new()));
        let resolver = resolver().expect("resolver");
        let addrs: BTreeSet<String> = (lookup(&resolver, "localhost", 50053).await)
            .expect("lookup")
            .iter()
            .map(SocketAddr::to_string)
            .collect();
        assert!(addrs.contains("127.0.0.1:50053"), "{addrs:?}");
        follow(&replicas, Role::Decode, "localhost:50053", &addrs);
        assert_eq!(replicas.all().len(), addrs.len());
        // The name's answers shrink to nothing: its replicas leave; others stay.
        replicas
            .add(Role::Decode, "10.0.0.9:50053", "10.0.0.9:50053")
            .expect("add");
        follow(&replicas, Role::Decode, "localhost:50053", &BTreeSet::new());
        let left: Vec<String> = replicas.all().iter().map(|r| r.addr.clone()).collect();
        assert_eq!(left, ["10.0.0.9:50053"]);
    }
}
