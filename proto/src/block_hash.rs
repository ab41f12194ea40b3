//! The block-hash spec that the router, prefill and decode nodes share: how a prompt's KV blocks
//! are named, so that a cache on one node and the router's index of it agree on what a block is.
//!
//! A prompt is cut into blocks of [`BLOCK_TOKENS`] token ids; a trailing partial block is not
//! hashed. Hashes are chained, so a block's hash names the whole prefix up to its end, and two
//! prompts share block `i`'s hash only if they share their first `16 * (i + 1)` tokens. The chain
//! is seeded with the model fingerprint, so KV of one model never matches another's, and with
//! the request's cache salt (its tenant and explicit salt; empty for none), so one partition's
//! cached prompts never match, and so never speed up or reveal, another's.
//!
//! Byte layout (XXH3-64 is the xxHash family's 64-bit XXH3, as in the reference C library's
//! `XXH3_64bits` and `XXH3_64bits_withSeed`):
//!
//! ```text
//! root     = XXH3_64bits(b"tandem.block.v1" || fingerprint || salt)  // fingerprint: the 32 bytes
//!                                                  // of SHA-256 of the weights file; salt: UTF-8
//! hash[0]  = XXH3_64bits_withSeed(ids[0..16]  as 16 × u32 little-endian (64 bytes), seed = root)
//! hash[i]  = XXH3_64bits_withSeed(ids[16i..16i+16] as 64 bytes LE,          seed = hash[i-1])
//! ```
//!
//! On the wire a hash is a `fixed64`. `testdata/block_hash_vectors.json` holds vectors computed
//! from this text with Python's `xxhash` package, an implementation independent of this one; a
//! client in another language can check itself against them too.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Tokens per hashed block; the same as the engine's KV block.
pub const BLOCK_TOKENS: usize = 16;

const DOMAIN: &[u8] = b"tandem.block.v1";

/// The hash of one full block and of every token before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// The chain's seed for a model and a cache partition (`salt`, empty for none). The fingerprint
/// has a fixed length, so no two (fingerprint, salt) pairs give the same bytes.
pub fn root(fingerprint: &[u8], salt: &str) -> u64 {
    let mut bytes = Vec::with_capacity(DOMAIN.len() + fingerprint.len() + salt.len());
    bytes.extend_from_slice(DOMAIN);
    bytes.extend_from_slice(fingerprint);
    bytes.extend_from_slice(salt.as_bytes());
    xxh3_64(&bytes)
}

/// The hash of the block `ids` (exactly [`BLOCK_TOKENS`] ids) that follows `parent`.
pub fn next(parent: u64, ids: &[u32; BLOCK_TOKENS]) -> BlockHash {
    let mut bytes = [0u8; BLOCK_TOKENS * 4];
    for (dst, id) in bytes.chunks_exact_mut(4).zip(ids) {
        dst.copy_from_slice(&id.to_le_bytes());
    }
    BlockHash(xxh3_64_with_seed(&bytes, parent))
}

/// The hashes of every full block of `tokens`, in order, in the cache partition `salt`.
pub fn block_hashes(fingerprint: &[u8], salt: &str, tokens: &[u32]) -> Vec<BlockHash> {
    let mut parent = root(fingerprint, salt);
    tokens
        .chunks_exact(BLOCK_TOKENS)
        .map(|block| {
            let ids: [u32; BLOCK_TOKENS] = std::array::from_fn(|i| block[i]);
            let h = next(parent, &ids);
            parent = h.0;
            h
        })
        .collect()
}

/// The most whole blocks of a prompt of `len` tokens that a cache may supply: at least the last
/// token must be computed, since its logits give the first generated token.
pub fn reusable_blocks(len: usize) -> usize {
    len.saturating_sub(1) / BLOCK_TOKENS
}

/// The hashes of a prompt's reusable blocks ([`reusable_blocks`]), as the caches and the
/// router's index key them.
pub fn prompt_hashes(fingerprint: &[u8], salt: &str, prompt: &[u32]) -> Vec<u64> {
    let reusable = reusable_blocks(prompt.len()) * BLOCK_TOKENS;
    block_hashes(fingerprint, salt, &prompt[..reusable])
        .into_iter()
        .map(|h| h.0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize)]
    struct Vector {
        fingerprint_hex: String,
        #[serde(default)]
        salt: String,
        token_ids: Vec<u32>,
        root: String,
        hashes: Vec<String>,
    }

    fn hex(bytes: &str) -> Vec<u8> {
        (0..bytes.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&bytes[i..i + 2], 16).expect("hex"))
            .collect()
    }

    #[test]
    fn vectors_match_the_checked_in_file() {
        let text = include_str!("../testdata/block_hash_vectors.json");
        let vectors: Vec<Vector> = serde_json::from_str(text).expect("vectors parse");
        assert!(vectors.len() >= 3 && vectors.iter().any(|v| !v.salt.is_empty()));
        for v in vectors {
            let fp = hex(&v.fingerprint_hex);
            assert_eq!(format!("{:016x}", root(&fp, &v.salt)), v.root);
            let got: Vec<String> = block_hashes(&fp, &v.salt, &v.token_ids)
                .iter()
                .map(|h| format!("{:016x}", h.0))
                .collect();
            assert_eq!(got, v.hashes, "tokens {:?}", v.token_ids);
        }
    }

    #[test]
    fn chained_partial_and_seeded() {
        let fp = [7u8; 32];
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[20] = 999;
        let (ha, hb) = (block_hashes(&fp, "", &a), block_hashes(&fp, "", &b));
        // 40 tokens: two full blocks, the partial third is not hashed.
        assert_eq!(ha.len(), 2);
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
        // A change in block 0 changes every later hash (the chain).
        let mut c = a.clone();
        c[0] = 1;
        let hc = block_hashes(&fp, "", &c);
        assert!(ha.iter().zip(&hc).all(|(x, y)| x != y));
        // Another model's fingerprint gives other hashes.
        assert_ne!(block_hashes(&[8u8; 32], "", &a)[0], ha[0]);
        // So does another cache partition, from the first block on.
        let salted = block_hashes(&fp, "tenant", &a);
        assert!(ha.iter().zip(&salted).all(|(x, y)| x != y));
    }

    #[test]
    fn a_prompt_reuses_all_but_its_last_token() {
        assert_eq!(reusable_blocks(16), 0);
        assert_eq!(reusable_blocks(17), 1);
        assert_eq!(reusable_blocks(33), 2);
        assert_eq!(reusable_blocks(0), 0);
        let fp = [1u8; 32];
        let p: Vec<u32> = (0..32).collect();
        assert_eq!(
            prompt_hashes(&fp, "", &p),
            vec![block_hashes(&fp, "", &p)[0].0]
        );
    }
}
