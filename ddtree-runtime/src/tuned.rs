//! The startup API: "the tuned variant of kernel K at key X", from the tune cache, compiled on
//! first use (or eagerly with [`TunedKernels::preload`]) and shared afterwards; the default
//! variant where nothing valid is tuned.

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use ddtree_codegen::Kernel;

use crate::{CompiledKernel, Gpu, Lookup, RuntimeError, Tunable, TuneCache};

/// Set to `1` to ignore the tune cache and run every kernel's default variant (debugging,
/// bisecting a numerical difference).
pub const FORCE_DEFAULT_ENV: &str = "DDTREE_FORCE_DEFAULT";

/// Which variant serves a key, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice<P> {
    /// Its parameters.
    pub params: P,
    /// `None` for a tuned winner; for the default, why no tuned winner was used.
    pub default_reason: Option<String>,
}

impl<P> Choice<P> {
    /// Whether it is a tuned winner (else the default).
    pub fn is_tuned(&self) -> bool {
        self.default_reason.is_none()
    }
}

impl TuneCache {
    /// The variant for `K` at `key`: the valid tuned winner of its bucket, else the default
    /// (candidate 0 of the bucket, or the kernel's default where no candidate fits) with the
    /// reason. `force_default` ignores tuned winners.
    pub fn choose<K: Tunable>(&self, key: &K::Key, force_default: bool) -> Choice<K::Params> {
        let bucket = K::bucket(key);
        let reason = match self.lookup::<K>(&bucket) {
            Lookup::Hit { params, .. } if !force_default => {
                return Choice {
                    params,
                    default_reason: None,
                }
            }
            Lookup::Hit { .. } => format!("{FORCE_DEFAULT_ENV} is set"),
            Lookup::Stale(why) => why,
            Lookup::Miss => "not tuned".to_string(),
        };
        let params = K::candidates(&bucket)
            .into_iter()
            .next()
            .unwrap_or_else(K::default_params);
        Choice {
            params,
            default_reason: Some(reason),
        }
    }
}

/// Tuned kernels of one GPU: the tune cache plus every variant compiled so far.
pub struct TunedKernels {
    gpu: Gpu,
    cache: TuneCache,
    force_default: bool,
    /// Loaded variants by symbol, each a `CompiledKernel<K>`.
    compiled: Mutex<HashMap<String, Arc<dyn Any + Send + Sync>>>,
    /// Keys already reported as untuned, by `kernel key`.
    reported: Mutex<HashSet<String>>,
    /// The variant [`TunedKernels::get`] chose per `kernel bucket`: the tune-cache lookup (which
    /// hashes every candidate's generated source) runs once per bucket, not once per launch.
    chosen: Mutex<HashMap<String, Arc<dyn Any + Send + Sync>>>,
}

impl TunedKernels {
    /// Opens the tune cache of `gpu`'s fingerprint ([`TuneCache::open`]).
    pub fn new(gpu: Gpu) -> TunedKernels {
        let cache = TuneCache::open(gpu.fingerprint());
        TunedKernels::with_cache(gpu, cache)
    }

    /// Uses `cache` as the tune cache.
    pub fn with_cache(gpu: Gpu, cache: TuneCache) -> TunedKernels {
        let force_default = std::env::var(FORCE_DEFAULT_ENV).is_ok_and(|v| !v.is_empty() && v != "0");
        if force_default {
            tracing::info!("{FORCE_DEFAULT_ENV} is set: every kernel runs its default variant");
        }
        TunedKernels {
            gpu,
            cache,
            force_default,
            compiled: Mutex::new(HashMap::new()),
            reported: Mutex::new(HashSet::new()),
            chosen: Mutex::new(HashMap::new()),
        }
    }

    /// Ignores tuned winners from now on: every kernel runs its default variant (the engine's
    /// `--no-autotune`).
    pub fn defaults_only(mut self) -> TunedKernels {
        self.force_default = true;
        self
    }

    /// The GPU.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The tune cache.
    pub fn cache(&self) -> &TuneCache {
        &self.cache
    }

    /// The variant for `K` at `key` ([`TuneCache::choose`]), logging a hint to run `autotune`
    /// for an untuned key (the first one at `info`, later ones at `debug`, each key once).
    pub fn choose<K: Tunable>(&self, key: &K::Key) -> Choice<K::Params> {
        let choice = self.cache.choose::<K>(key, self.force_default);
        if let Some(reason) = &choice.default_reason {
            let bucket = K::bucket(key);
            let mut reported = self.reported.lock().expect("not poisoned");
            let first = reported.is_empty();
            if reported.insert(format!("{} {bucket}", K::NAME)) {
                let symbol = K::symbol(&choice.params);
                if first {
                    tracing::info!(
                        "`{}` at {bucket}: {reason}, using the default `{symbol}`; run `autotune` to tune this GPU (tune cache {})",
                        K::NAME,
                        self.cache.path().display()
                    );
                } else {
                    tracing::debug!("`{}` at {bucket}: {reason}, using the default `{symbol}`", K::NAME);
                }
            }
        }
        choice
    }

    /// The compiled variant for `K` at `key` ([`TunedKernels::choose`]), compiling it on first
    /// use (through the disk cache) and sharing it afterwards.
    pub fn get<K: Tunable>(&self, key: &K::Key) -> Result<Arc<CompiledKernel<K>>, RuntimeError> {
        let id = format!("{} {}", K::NAME, K::bucket(key));
        if let Some(k) = self.chosen.lock().expect("not poisoned").get(&id) {
            if let Ok(k) = k.clone().downcast::<CompiledKernel<K>>() {
                return Ok(k);
            }
        }
        let kernel = self.variant::<K>(&self.choose::<K>(key).params)?;
        self.chosen.lock().expect("not poisoned").insert(id, kernel.clone());
        Ok(kernel)
    }

    /// Variant `params` of any kernel (tuned or not), compiled on first use (through the disk
    /// cache) and shared afterwards.
    pub fn variant<K: Kernel>(&self, params: &K::Params) -> Result<Arc<CompiledKernel<K>>, RuntimeError> {
        let symbol = K::symbol(params);
        if let Some(k) = self.loaded::<K>(&symbol) {
            return Ok(k);
        }
        let kernel = Arc::new(self.gpu.compile::<K>(params)?);
        self.compiled
            .lock()
            .expect("not poisoned")
            .entry(symbol)
            .or_insert_with(|| kernel.clone());
        Ok(kernel)
    }

    /// Compiles the variants for all `keys` now, in parallel, so that later [`TunedKernels::get`]
    /// calls return at once.
    pub fn preload<K: Tunable>(&self, keys: &[K::Key]) -> Result<(), RuntimeError> {
        let mut params: Vec<K::Params> = Vec::new();
        for key in keys {
            let p = self.choose::<K>(key).params;
            if self.loaded::<K>(&K::symbol(&p)).is_none() && !params.contains(&p) {
                params.push(p);
            }
        }
        let compiled = self.gpu.compile_many::<K>(&params);
        let mut map = self.compiled.lock().expect("not poisoned");
        for (p, k) in params.iter().zip(compiled) {
            map.entry(K::symbol(p)).or_insert(Arc::new(k?));
        }
        Ok(())
    }

    fn loaded<K: Kernel>(&self, symbol: &str) -> Option<Arc<CompiledKernel<K>>> {
        let map = self.compiled.lock().expect("not poisoned");
        map.get(symbol)
            .cloned()
            .and_then(|k| k.downcast::<CompiledKernel<K>>().ok())
    }
}
