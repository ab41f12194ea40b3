//! The key file's format: one key per line, `TENANT sha256:HEX [NAME=VALUE]...`, and the cache
//! partition a key's tenant gives its requests.

use sha2::{Digest, Sha256};

use crate::auth::{Class, KeyLimits, MAX_TENANT_BYTES};

/// One line of the key file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyEntry {
    pub tenant: String,
    pub hash: [u8; 32],
    /// What the line sets; unset fields fall back to the router's defaults.
    pub limits: KeyLimits,
}

/// The SHA-256 of a key, as the key file stores it.
pub fn hash_key(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The cache partition of a request: empty (the shared partition) when it has neither a tenant
/// nor a salt, else 32 hex digits of SHA-256 over both. A digest keeps what workers see short and
/// free of tenant names, and the length prefix keeps ("ab", "c") apart from ("a", "bc").
pub fn cache_partition(tenant: &str, salt: &str) -> String {
    if tenant.is_empty() && salt.is_empty() {
        return String::new();
    }
    let mut h = Sha256::new();
    h.update((tenant.len() as u64).to_le_bytes());
    h.update(tenant.as_bytes());
    h.update(salt.as_bytes());
    hex(&h.finalize()[..16])
}

/// A key file line for `tenant` and `key`.
pub fn key_line(tenant: &str, key: &str, limits: KeyLimits) -> String {
    let mut line = format!("{tenant} sha256:{}", hex(&hash_key(key)));
    for (name, value) in [
        ("rpm", limits.requests_per_minute),
        ("tpm", limits.tokens_per_minute),
        ("streams", limits.streams),
        ("weight", limits.weight),
    ] {
        if let Some(v) = value {
            line.push_str(&format!(" {name}={v}"));
        }
    }
    if let Some(class) = limits.class {
        line.push_str(&format!(" class={}", class.name()));
    }
    line
}

/// Whether `tenant` is a valid tenant name: 1 to [`MAX_TENANT_BYTES`] ASCII letters, digits,
/// `.`, `_` or `-`.
pub fn valid_tenant(tenant: &str) -> bool {
    !tenant.is_empty()
        && tenant.len() <= MAX_TENANT_BYTES
        && tenant
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// Parses a key file; an error names the line and never echoes a hash.
pub fn parse_key_file(text: &str) -> std::result::Result<Vec<KeyEntry>, String> {
    let mut entries: Vec<KeyEntry> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut fields = line.split_whitespace();
        let (Some(tenant), Some(hash)) = (fields.next(), fields.next()) else {
            return Err(format!("line {n}: expected `TENANT sha256:HEX [limits]`"));
        };
        if !valid_tenant(tenant) {
            return Err(format!(
                "line {n}: a tenant is 1 to {MAX_TENANT_BYTES} letters, digits, '.', '_' or '-'"
            ));
        }
        let hash = hash
            .strip_prefix("sha256:")
            .and_then(parse_hex32)
            .ok_or_else(|| format!("line {n}: the key must be `sha256:` and 64 hex digits"))?;
        let mut limits = KeyLimits::default();
        for field in fields {
            let (name, value) = field
                .split_once('=')
                .ok_or_else(|| format!("line {n}: `{field}` is not NAME=VALUE"))?;
            if name == "class" {
                let class = Class::parse(value).ok_or_else(|| {
                    format!("line {n}: class must be interactive, standard or batch")
                })?;
                limits.class = Some(class);
                continue;
            }
            let value: u32 = value
                .parse()
                .map_err(|_| format!("line {n}: {name} must be a whole number"))?;
            let slot = match name {
                "rpm" => &mut limits.requests_per_minute,
                "tpm" => &mut limits.tokens_per_minute,
                "streams" => &mut limits.streams,
                "weight" if value == 0 => {
                    return Err(format!("line {n}: weight must be at least 1"));
                }
                "weight" => &mut limits.weight,
                _ => {
                    return Err(format!(
                        "line {n}: unknown limit `{name}` (rpm, tpm, streams, class, weight)"
                    ));
                }
            };
            *slot = Some(value);
        }
        if entries.iter().any(|e| e.hash == hash) {
            return Err(format!("line {n}: the same key is listed twice"));
        }
        entries.push(KeyEntry {
            tenant: tenant.to_string(),
            hash,
            limits,
        });
    }
    Ok(entries)
}

fn parse_hex32(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_files_parse_and_refuse_what_is_malformed() {
        let a = key_line(
            "alice",
            "secret-a",
            KeyLimits {
                requests_per_minute: Some(60),
                ..KeyLimits::default()
            },
        );
        let b = key_line(
            "bob",
            "secret-b",
            KeyLimits {
                class: Some(Class::Batch),
                weight: Some(3),
                ..KeyLimits::default()
            },
        );
        let text = format!("# comment\n\n{a}\n{b}  # trailing comment\n");
        let entries = parse_key_file(&text).expect("parses");
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].tenant, "alice");
        assert_eq!(entries[0].hash, hash_key("secret-a"));
        assert_eq!(entries[0].limits.requests_per_minute, Some(60));
        assert_eq!(entries[1].tenant, "bob");
        assert_eq!(entries[1].limits.class, Some(Class::Batch));
        assert_eq!(entries[1].limits.weight, Some(3));
        for (bad, why) in [
            ("alice", "line 1: expected"),
            ("alice sha256:00", "64 hex"),
            ("al ice sha256:", "64 hex"),
            ("a/b sha256:00", "a tenant is"),
            (&format!("{a} burst=3"), "unknown limit"),
            (&format!("{a} rpm=x"), "whole number"),
            (
                &format!("{a} class=urgent"),
                "interactive, standard or batch",
            ),
            (&format!("{a} weight=0"), "at least 1"),
            (&format!("{a}\n{a}"), "line 2: the same key"),
        ] {
            let e = parse_key_file(bad).expect_err(bad);
            assert!(e.contains(why), "{bad}: {e}");
            assert!(!e.contains(&a[6..]), "{e} echoes the hash");
        }
    }
}
