//! The JIT: kernel source to cubin with NVRTC for one architecture, through the on-disk
//! [`CubinCache`], one variant at a time or many in parallel.

use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::cache::{CacheKey, CubinCache};
use crate::{nvrtc, RuntimeError};

/// One kernel variant's CUDA C source and its `extern "C"` symbol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSource {
    /// The variant's symbol.
    pub symbol: String,
    /// Its generated CUDA C.
    pub source: String,
}

impl KernelSource {
    /// The source of `K`'s variant for `params`.
    pub fn of<K: ddtree_codegen::Kernel>(params: &K::Params) -> Result<KernelSource, RuntimeError> {
        let ir = K::ir(params)?;
        Ok(KernelSource {
            source: ddtree_codegen::render(&ir),
            symbol: ir.symbol,
        })
    }
}

/// A compiled cubin and where it came from.
#[derive(Clone, Debug)]
pub struct Cubin {
    /// The cubin bytes.
    pub bytes: Vec<u8>,
    /// Whether it came from the disk cache (else NVRTC compiled it now).
    pub cached: bool,
    /// Time spent getting it (cache read, or compile and cache write).
    pub time: Duration,
}

/// NVRTC for one architecture, with an optional disk cache.
#[derive(Clone, Debug)]
pub struct Jit {
    arch: String,
    nvrtc_version: Option<(i32, i32)>,
    cache: Option<CubinCache>,
}

impl Jit {
    /// A JIT for `arch` (e.g. `sm_90a`) caching in `cache` (`None`: always compile). Reads the
    /// NVRTC version now; where NVRTC is absent, compiling returns [`RuntimeError::NoNvrtc`].
    pub fn new(arch: impl Into<String>, cache: Option<CubinCache>) -> Jit {
        Jit {
            arch: arch.into(),
            nvrtc_version: nvrtc::nvrtc_version().ok(),
            cache,
        }
    }

    /// The target architecture.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// NVRTC's version, if NVRTC is present.
    pub fn nvrtc_version(&self) -> Option<(i32, i32)> {
        self.nvrtc_version
    }

    /// The disk cache, if any.
    pub fn cache(&self) -> Option<&CubinCache> {
        self.cache.as_ref()
    }

    /// The NVRTC options for this architecture.
    pub fn options(&self) -> Vec<String> {
        nvrtc::compile_options(&self.arch)
    }

    /// The cache key of `source` under this JIT's options, architecture and NVRTC version.
    pub fn key(&self, source: &str) -> Result<CacheKey, RuntimeError> {
        let version = self.nvrtc_version.ok_or(RuntimeError::NoNvrtc)?;
        Ok(CacheKey::new(source, &self.options(), &self.arch, version))
    }

    /// The cubin of one variant: from the cache when a valid entry exists, else compiled (and
    /// then stored).
    pub fn cubin(&self, src: &KernelSource) -> Result<Cubin, RuntimeError> {
        let start = Instant::now();
        let key = self.key(&src.source)?;
        if let Some(bytes) = self.cache.as_ref().and_then(|c| c.get(&src.symbol, &key)) {
            return Ok(Cubin {
                bytes,
                cached: true,
                time: start.elapsed(),
            });
        }
        let bytes = nvrtc::compile_cubin(&src.source, &src.symbol, &self.options())?;
        if let Some(cache) = &self.cache {
            cache.put(&src.symbol, &key, &bytes);
        }
        Ok(Cubin {
            bytes,
            cached: false,
            time: start.elapsed(),
        })
    }

    /// The cubins of many variants, compiled in parallel on the rayon thread pool; results are
    /// in the order of `sources`.
    pub fn cubins(&self, sources: &[KernelSource]) -> Vec<Result<Cubin, RuntimeError>> {
        sources.par_iter().map(|s| self.cubin(s)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_ci() -> bool {
        std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
    }

    /// NVRTC is on the loader path, or (outside CI) the test is skipped with a message.
    fn need_nvrtc(test: &str) -> bool {
        if nvrtc::nvrtc_available() {
            return true;
        }
        assert!(
            !on_ci(),
            "CI must provide NVRTC (the nvidia-cuda-nvrtc wheel's lib folder on LD_LIBRARY_PATH)"
        );
        eprintln!("skipped {test}: libnvrtc.so.13 not found (set LD_LIBRARY_PATH)");
        false
    }

    fn source(symbol: &str, body: &str) -> KernelSource {
        KernelSource {
            symbol: symbol.to_string(),
            source: format!("extern \"C\" __global__ void {symbol}(float* out) {{\n{body}\n}}\n"),
        }
    }

    #[test]
    fn cold_then_warm_then_rebuilt_after_corruption() {
        if !need_nvrtc("cold_then_warm_then_rebuilt_after_corruption") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let jit = Jit::new("sm_90a", Some(CubinCache::new(dir.path())));
        let src = source("store_one", "    out[threadIdx.x] = 1.0f;");
        let cold = jit.cubin(&src).unwrap();
        assert!(!cold.cached);
        assert_eq!(&cold.bytes[..4], b"\x7fELF", "a cubin is an ELF image");
        let warm = jit.cubin(&src).unwrap();
        assert!(warm.cached);
        assert_eq!(warm.bytes, cold.bytes);

        let path = jit.cache().unwrap().path(&src.symbol, &jit.key(&src.source).unwrap());
        std::fs::write(&path, b"garbage").unwrap();
        let rebuilt = jit.cubin(&src).unwrap();
        assert!(!rebuilt.cached, "a corrupt entry is recompiled");
        assert!(jit.cubin(&src).unwrap().cached, "and replaced by a valid one");
    }

    #[test]
    fn source_change_misses_the_cache() {
        if !need_nvrtc("source_change_misses_the_cache") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let jit = Jit::new("sm_90a", Some(CubinCache::new(dir.path())));
        assert!(!jit.cubin(&source("k", "    out[0] = 1.0f;")).unwrap().cached);
        assert!(!jit.cubin(&source("k", "    out[0] = 2.0f;")).unwrap().cached);
        assert!(jit.cubin(&source("k", "    out[0] = 1.0f;")).unwrap().cached);
    }

    #[test]
    fn parallel_compile_keeps_order() {
        if !need_nvrtc("parallel_compile_keeps_order") {
            return;
        }
        let jit = Jit::new("sm_90a", None);
        let sources: Vec<_> = (0..6)
            .map(|i| source(&format!("k{i}"), &format!("    out[0] = {i}.0f;")))
            .collect();
        let cubins = jit.cubins(&sources);
        assert_eq!(cubins.len(), 6);
        for (s, c) in sources.iter().zip(&cubins) {
            let c = c.as_ref().unwrap();
            let needle = s.symbol.as_bytes();
            assert!(
                c.bytes
                    .windows(needle.len() + 1)
                    .any(|w| &w[..needle.len()] == needle && w[needle.len()] == 0),
                "{} not in its cubin",
                s.symbol
            );
        }
    }

    #[test]
    fn broken_kernel_error_shows_log_options_and_numbered_source() {
        if !need_nvrtc("broken_kernel_error_shows_log_options_and_numbered_source") {
            return;
        }
        let jit = Jit::new("sm_90a", None);
        let mut body: Vec<String> = (0..12).map(|i| format!("    float v{i} = {i}.0f;")).collect();
        body[6] = "    out[0] = undefined_name + v5;".to_string();
        let src = source("broken", &body.join("\n"));
        let err = jit.cubin(&src).unwrap_err();
        let RuntimeError::Compile {
            ref kernel,
            ref options,
            ref log,
            ref excerpt,
        } = err
        else {
            panic!("not a compile error: {err}")
        };
        assert_eq!(kernel, "broken");
        assert!(options.contains("--gpu-architecture=sm_90a"), "{options}");
        assert!(log.contains("undefined_name") && log.contains("broken.cu(8)"), "{log}");
        // Line 8 of the source (line 1 is the signature) is marked, with 3 lines of context.
        assert!(excerpt.contains("> 8 |     out[0] = undefined_name + v5;"), "{excerpt}");
        assert!(excerpt.contains("  5 | ") && excerpt.contains(" 11 | "), "{excerpt}");
        assert!(!excerpt.contains("  4 | ") && !excerpt.contains(" 12 | "), "{excerpt}");
        let shown = err.to_string();
        assert!(
            shown.starts_with("NVRTC failed to compile `broken` with options [--gpu-architecture=sm_90a"),
            "{shown}"
        );
        assert!(shown.contains("--- source around the error ---"), "{shown}");
    }

    #[test]
    fn without_nvrtc_compiling_is_a_typed_error() {
        if nvrtc::nvrtc_available() {
            eprintln!("skipped without_nvrtc_compiling_is_a_typed_error: NVRTC is present");
            return;
        }
        let jit = Jit::new("sm_90a", None);
        assert!(matches!(jit.cubin(&source("k", "")), Err(RuntimeError::NoNvrtc)));
    }
}
