//! The on-disk compile cache: one cubin per (source, options, arch, NVRTC version), stored with a
//! header that names its key and checksums its bytes, so that a corrupt, truncated or foreign
//! entry is detected, reported once and rebuilt instead of being loaded.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use crate::RuntimeError;

/// The environment variable that overrides the cache root.
pub const CACHE_DIR_ENV: &str = "DDTREE_CACHE_DIR";

/// The cache root: `$DDTREE_CACHE_DIR` if set, else `ddtree` under the user's cache folder
/// (`~/.cache/ddtree` on Linux), else `ddtree-cache` under the temporary folder. Compiled
/// cubins live in `cubin/` below it, tuning results in `tune/`.
pub fn cache_root() -> PathBuf {
    match std::env::var_os(CACHE_DIR_ENV) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => dirs::cache_dir()
            .map(|d| d.join("ddtree"))
            .unwrap_or_else(|| std::env::temp_dir().join("ddtree-cache")),
    }
}

/// A SHA-256 over length-prefixed fields: each field's length, then its bytes, so that no two
/// different field lists hash the same stream.
pub(crate) fn hash_fields<'a>(domain: &'a str, fields: impl IntoIterator<Item = &'a [u8]>) -> [u8; 32] {
    let mut h = Sha256::new();
    for f in std::iter::once(domain.as_bytes()).chain(fields) {
        h.update((f.len() as u64).to_le_bytes());
        h.update(f);
    }
    h.finalize().into()
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The key of one compiled cubin: a hash of the source, the NVRTC options, the architecture
/// and the NVRTC version. Any change to one of them is a different key.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheKey([u8; 32]);

impl CacheKey {
    /// The key for `source` compiled with `options` for `arch` by NVRTC `nvrtc_version`.
    pub fn new(source: &str, options: &[String], arch: &str, nvrtc_version: (i32, i32)) -> CacheKey {
        let opts = options.join("\0");
        let version = format!("{}.{}", nvrtc_version.0, nvrtc_version.1);
        CacheKey(hash_fields(
            "ddtree-cubin-key-v1",
            [source.as_bytes(), opts.as_bytes(), arch.as_bytes(), version.as_bytes()],
        ))
    }

    /// The key as 64 hex digits.
    pub fn hex(&self) -> String {
        hex(&self.0)
    }
}

impl fmt::Debug for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CacheKey({})", self.hex())
    }
}

impl fmt::Display for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

/// First bytes of every entry.
const MAGIC: &[u8; 8] = b"DDTCUBIN";
/// Entry format version.
const FORMAT: u32 = 1;
/// magic, format, key, payload length, payload checksum.
const HEADER_LEN: usize = 8 + 4 + 32 + 8 + 32;

/// Why a cache entry was not used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BadEntry {
    /// Shorter than its header or than the length it declares.
    Truncated,
    /// Not a ddtree cubin entry, or one of another format version.
    NotAnEntry,
    /// A valid entry, but for another key (a hash-prefix collision or a copied file).
    Foreign,
    /// The payload does not match its checksum.
    Corrupt,
}

impl fmt::Display for BadEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BadEntry::Truncated => "truncated",
            BadEntry::NotAnEntry => "not a ddtree cubin entry (or of another format version)",
            BadEntry::Foreign => "an entry for another key",
            BadEntry::Corrupt => "corrupt (checksum mismatch)",
        })
    }
}

/// Serializes an entry: header, then the cubin.
fn encode(key: &CacheKey, cubin: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + cubin.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT.to_le_bytes());
    out.extend_from_slice(&key.0);
    out.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(cubin));
    out.extend_from_slice(cubin);
    out
}

/// Checks an entry read from disk against `key` and returns its cubin.
fn decode(key: &CacheKey, bytes: &[u8]) -> Result<Vec<u8>, BadEntry> {
    if bytes.len() < 12 {
        return Err(if MAGIC.starts_with(bytes) {
            BadEntry::Truncated
        } else {
            BadEntry::NotAnEntry
        });
    }
    if &bytes[..8] != MAGIC || bytes[8..12] != FORMAT.to_le_bytes() {
        return Err(BadEntry::NotAnEntry);
    }
    if bytes.len() < HEADER_LEN {
        return Err(BadEntry::Truncated);
    }
    if bytes[12..44] != key.0 {
        return Err(BadEntry::Foreign);
    }
    let len = u64::from_le_bytes(bytes[44..52].try_into().expect("8 bytes")) as usize;
    let payload = &bytes[HEADER_LEN..];
    if payload.len() < len {
        return Err(BadEntry::Truncated);
    }
    if payload.len() > len || Sha256::digest(payload)[..] != bytes[52..84] {
        return Err(BadEntry::Corrupt);
    }
    Ok(payload.to_vec())
}

/// Writes `bytes` to `path` through a temporary file in the same folder and a rename, so that
/// readers (other processes included) never see a partial file.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), RuntimeError> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(RuntimeError::io("creating the cache folder", dir))?;
    let tmp = dir.join(format!(
        ".{}.{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("entry"),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&tmp, bytes).map_err(RuntimeError::io("writing", &tmp))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        RuntimeError::Io {
            context: "renaming into place",
            path: path.to_path_buf(),
            source: e,
        }
    })
}

/// The cubin cache in one folder. Lookups never fail: a missing entry is a miss; an unreadable
/// or invalid one is reported (`tracing::warn`) and treated as a miss, and the rebuilt cubin
/// replaces it. Write failures are reported once per process and otherwise ignored.
#[derive(Clone, Debug)]
pub struct CubinCache {
    dir: PathBuf,
}

impl CubinCache {
    /// The cache in `dir` (created on the first write).
    pub fn new(dir: impl Into<PathBuf>) -> CubinCache {
        CubinCache { dir: dir.into() }
    }

    /// The cache under [`cache_root`]`/cubin`.
    pub fn at_default_location() -> CubinCache {
        CubinCache::new(cache_root().join("cubin"))
    }

    /// Its folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of `symbol`'s entry for `key`: the symbol keeps the folder readable, the key
    /// prefix separates variants of one symbol.
    pub fn path(&self, symbol: &str, key: &CacheKey) -> PathBuf {
        self.dir.join(format!("{symbol}-{}.cubin", &key.hex()[..16]))
    }

    /// The cubin for `key`, if a valid entry exists.
    pub fn get(&self, symbol: &str, key: &CacheKey) -> Option<Vec<u8>> {
        let path = self.path(symbol, key);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(
                    "compile cache entry {} cannot be read ({e}); recompiling `{symbol}`",
                    path.display()
                );
                return None;
            }
        };
        match decode(key, &bytes) {
            Ok(cubin) => Some(cubin),
            Err(bad) => {
                tracing::warn!(
                    "compile cache entry {} is {bad}; recompiling `{symbol}` and replacing it",
                    path.display()
                );
                None
            }
        }
    }

    /// Stores `cubin` for `key`. A failure is logged (once per process) and otherwise ignored:
    /// the cache only saves time.
    pub fn put(&self, symbol: &str, key: &CacheKey, cubin: &[u8]) {
        static WARNED: AtomicBool = AtomicBool::new(false);
        if let Err(e) = write_atomic(&self.path(symbol, key), &encode(key, cubin)) {
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!("the compile cache cannot be written ({e}); kernels will be recompiled each run");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(src: &str) -> CacheKey {
        CacheKey::new(src, &["--gpu-architecture=sm_90a".to_string()], "sm_90a", (13, 0))
    }

    #[test]
    fn key_is_stable_across_runs_and_builds() {
        // Pinned: changing the key derivation silently orphans every cache on every machine, so
        // it must be a deliberate change (bump the domain string and this value together).
        assert_eq!(key("extern \"C\" __global__ void k() {}").hex(), PINNED_KEY);
        assert_eq!(key("a"), key("a"));
    }

    const PINNED_KEY: &str = "94170ba608217fdc628a502c3d6347e75aff0763cf970a99d0db3dda7d27b3e1";

    #[test]
    fn key_changes_with_every_field() {
        let opts = vec!["--gpu-architecture=sm_90a".to_string()];
        let base = CacheKey::new("src", &opts, "sm_90a", (13, 0));
        assert_ne!(base, CacheKey::new("src ", &opts, "sm_90a", (13, 0)), "source");
        assert_ne!(
            base,
            CacheKey::new("src", &["--gpu-architecture=sm_90".to_string()], "sm_90a", (13, 0)),
            "options"
        );
        assert_ne!(base, CacheKey::new("src", &opts, "sm_90", (13, 0)), "arch");
        assert_ne!(base, CacheKey::new("src", &opts, "sm_90a", (13, 1)), "NVRTC version");
        // Length prefixes keep field boundaries: moving bytes between fields changes the key.
        let split = |a: &str, b: &str| CacheKey::new(a, &[b.to_string()], "x", (1, 0));
        assert_ne!(split("ab", "c"), split("a", "bc"));
    }

    #[test]
    fn entries_round_trip_and_bad_ones_are_classified() {
        let k = key("k");
        let cubin = b"\x7fELF fake cubin".to_vec();
        let entry = encode(&k, &cubin);
        assert_eq!(decode(&k, &entry), Ok(cubin.clone()));
        assert_eq!(decode(&key("other"), &entry), Err(BadEntry::Foreign));
        assert_eq!(decode(&k, &entry[..entry.len() - 1]), Err(BadEntry::Truncated));
        assert_eq!(decode(&k, &entry[..20]), Err(BadEntry::Truncated));
        assert_eq!(decode(&k, &entry[..4]), Err(BadEntry::Truncated));
        assert_eq!(
            decode(&k, b"\x7fELF raw cubin without header"),
            Err(BadEntry::NotAnEntry)
        );
        assert_eq!(decode(&k, b""), Err(BadEntry::Truncated));
        let mut flipped = entry.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert_eq!(decode(&k, &flipped), Err(BadEntry::Corrupt));
        let mut longer = entry;
        longer.push(0);
        assert_eq!(decode(&k, &longer), Err(BadEntry::Corrupt));
    }

    #[test]
    fn corrupt_file_is_a_miss_and_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let cache = CubinCache::new(dir.path().join("cubin"));
        let k = key("k");
        assert_eq!(cache.get("k", &k), None, "empty cache");
        cache.put("k", &k, b"cubin v1");
        assert_eq!(cache.get("k", &k).as_deref(), Some(&b"cubin v1"[..]));
        let path = cache.path("k", &k);
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 2] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(cache.get("k", &k), None, "a corrupt entry is a miss");
        cache.put("k", &k, b"cubin v2");
        assert_eq!(
            cache.get("k", &k).as_deref(),
            Some(&b"cubin v2"[..]),
            "the rebuilt entry replaces it"
        );
        let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .collect();
        assert_eq!(leftovers.len(), 1, "no temporary files left behind: {leftovers:?}");
    }

    #[test]
    fn foreign_file_under_our_name_is_a_miss() {
        let dir = tempfile::tempdir().unwrap();
        let cache = CubinCache::new(dir.path());
        let (k, other) = (key("k"), key("other"));
        // Another key's valid entry copied to this key's file name.
        std::fs::write(cache.path("k", &k), encode(&other, b"other cubin")).unwrap();
        assert_eq!(cache.get("k", &k), None);
    }

    #[test]
    fn cache_root_honours_the_environment_variable() {
        // Read-only check of the fallback; the override itself is exercised by the JIT tests
        // through `CubinCache::new`, so no test mutates the process environment.
        let root = cache_root();
        match std::env::var_os(CACHE_DIR_ENV) {
            Some(d) if !d.is_empty() => assert_eq!(root, PathBuf::from(d)),
            _ => assert!(
                root.ends_with("ddtree") || root.ends_with("ddtree-cache"),
                "{}",
                root.display()
            ),
        }
    }
}
