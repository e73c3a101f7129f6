//! SHA-256 config hashes that pod templates carry, so a config change rolls its consumers
//! (render stage, pure).

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

/// SHA-256 (lower-case hex) over every key and value of a ConfigMap's data, each length-prefixed
/// so that no two different maps hash alike. Stable across processes and releases, unlike
/// `DefaultHasher`.
pub fn config_hash(data: &BTreeMap<String, String>) -> String {
    let mut hasher = Sha256::new();
    for (key, value) in data {
        for part in [key, value] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part.as_bytes());
        }
    }
    hex(&hasher.finalize())
}

/// `<base>-<first 10 hex digits of hash>`: the name of an immutable copy of `base` whose data
/// has the config hash `hash`, so new content gets a new name and the same content keeps it.
pub fn hashed_name(base: &str, hash: &str) -> String {
    // A ConfigMap name may be 253 characters; keep room for the suffix.
    let base: String = base.chars().take(240).collect();
    format!("{}-{}", base.trim_end_matches(['-', '.']), &hash[..10])
}

/// SHA-256 (lower-case hex) of arbitrary bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}
