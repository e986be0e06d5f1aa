//! The autotuner: for one kernel and one problem key, check every candidate against the
//! kernel's CPU reference, time the ones that pass with CUDA events, and keep the winner and
//! every timing in the [`TuneCache`].
//!
//! A kernel takes part by implementing [`Tunable`]: how to bucket a key, which candidates fit
//! it, how to build inputs and launch once, how to check a candidate, and what the key costs in
//! bytes and FLOPs.

mod cache;
mod pool;

use std::any::TypeId;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::CudaSlice;
use ddtree_codegen::Kernel;
use sha2::{Digest, Sha256};

pub use cache::{Lookup, Trial, TrialStatus, TuneCache, TuneEntry};
pub use pool::DevicePool;

use crate::jit::KernelSource;
use crate::timing::{graph_us_flushed, median_us_batched};
use crate::{CompiledKernel, Gpu, RuntimeError};

/// What one launch at a key moves and computes, for GB/s, TFLOP/s and the roofline floor.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Cost {
    /// Bytes read and written in device memory (each byte once: the ideal).
    pub bytes: f64,
    /// Floating-point operations (a multiply-add counts 2).
    pub flops: f64,
}

/// The outcome of checking one candidate against the CPU reference.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// Whether every output was within tolerance (NaN never is).
    pub passed: bool,
    /// The case checked and how it compared, for reports.
    pub detail: String,
}

/// A kernel the autotuner can tune: it builds inputs for a problem key, launches one
/// candidate on them, checks a candidate against its CPU reference, and states the key's cost.
///
/// Index 0 of [`Tunable::candidates`] is the safe default used when nothing is tuned.
pub trait Tunable: Kernel {
    /// The problem key (e.g. rows and width). Its `Display` form names the key in the tune
    /// cache, so it must be stable and unambiguous.
    type Key: Clone + fmt::Debug + fmt::Display + Send + Sync + 'static;
    /// Device inputs and outputs for timing one key, in `copies` rotated sets.
    type Workload;

    /// The bucket `key` belongs to (dimensions that vary at run time rounded up, e.g. rows to a
    /// power of two). Tuning and lookups use the bucket.
    fn bucket(key: &Self::Key) -> Self::Key;

    /// The candidates that can run at `key` (the parameter space filtered by the key, e.g. a
    /// top-k kernel's `k`), the default first.
    fn candidates(key: &Self::Key) -> Vec<Self::Params>;

    /// Bytes moved and FLOPs done by one launch at `key`.
    fn cost(key: &Self::Key) -> Cost;

    /// Builds inputs and outputs for `key`: `copies` sets where that fits in memory (the tuner
    /// rotates over them so that inputs do not stay in L2), fewer where it does not. Data that
    /// does not depend on the bucketed dimension (weights, tables) should come from `pool`, so
    /// that every bucket of a shape shares it; random contents should be generated on the GPU.
    fn workload(
        gpu: &Gpu,
        pool: &mut DevicePool,
        key: &Self::Key,
        copies: usize,
        seed: u64,
    ) -> Result<Self::Workload, RuntimeError>;

    /// Calls of [`Tunable::run`] back to back per timing sample (the time per call is kept):
    /// more than 1 for kernels of a few microseconds, whose single launch, timed alone, is
    /// mostly launch latency and noise. Meant for keys whose inputs rotate past the L2. With
    /// cudarc's event tracking off (as the engine and `autotune` run), the calls are captured
    /// once into a CUDA graph and each sample replays it, so that the host's launch rate does
    /// not bound the sample; else they are launched one by one.
    fn runs_per_sample() -> usize {
        1
    }

    /// Launches `kernel` once on set `i` (modulo the sets built) of `workload`.
    fn run(
        gpu: &Gpu,
        kernel: &CompiledKernel<Self>,
        workload: &mut Self::Workload,
        i: usize,
    ) -> Result<(), RuntimeError>
    where
        Self: Sized;

    /// The key at which candidates are checked against the CPU reference: `key` itself unless
    /// the reference would be too slow there (e.g. fewer rows of a large GEMM), keeping what
    /// matters for correctness (ragged edges, the reduction length).
    fn check_key(key: &Self::Key) -> Self::Key {
        key.clone()
    }

    /// Runs candidate `params` at `key` on fresh random inputs (outputs poisoned) and compares
    /// it with the CPU reference.
    fn check(gpu: &Gpu, params: &Self::Params, key: &Self::Key, seed: u64) -> Result<Verdict, RuntimeError>;
}

/// `n` rounded up to a power of two (1 for 0).
pub fn bucket_pow2(n: usize) -> usize {
    n.max(1).next_power_of_two()
}

/// The L2 size of `gpu` in bytes (50 MiB where the driver does not report it).
pub fn l2_bytes(gpu: &Gpu) -> usize {
    match gpu.limits().l2_bytes as usize {
        0 => 50 << 20,
        b => b,
    }
}

/// How many copies of `bytes` of inputs make a working set of twice the L2 (1 to 32): rotating
/// over them, no run finds its inputs in L2.
pub fn rotation_copies(l2_bytes: usize, bytes: f64) -> usize {
    (2.0 * l2_bytes as f64 / bytes.max(1.0)).ceil().clamp(1.0, 32.0) as usize
}

/// A hash of the candidates' generated sources (their symbols and CUDA C, in order): a tune
/// entry is valid only while this is unchanged, so editing a kernel's body, its parameter
/// space or the code generator re-tunes it. Memoized per process (generating the sources is
/// the slow part of a startup lookup).
pub fn source_hash<K: Kernel>(candidates: &[K::Params]) -> String {
    static MEMO: OnceLock<Mutex<HashMap<(TypeId, String), String>>> = OnceLock::new();
    let symbols: Vec<String> = candidates.iter().map(K::symbol).collect();
    let memo_key = (TypeId::of::<K>(), symbols.join("\0"));
    let memo = MEMO.get_or_init(Default::default);
    if let Some(h) = memo.lock().expect("not poisoned").get(&memo_key) {
        return h.clone();
    }
    let mut h = Sha256::new();
    h.update(b"ddtree-tune-source-v1\0");
    for p in candidates {
        let text = match KernelSource::of::<K>(p) {
            Ok(s) => format!("{}\0{}", s.symbol, s.source),
            Err(e) => format!("{}\0error: {e}", K::symbol(p)),
        };
        h.update((text.len() as u64).to_le_bytes());
        h.update(text.as_bytes());
    }
    let hash = crate::cache::hex(&h.finalize()[..16]);
    memo.lock().expect("not poisoned").insert(memo_key, hash.clone());
    hash
}

/// The device's roofline: the floor of a key is `max(bytes / bandwidth, flops / tensor rate)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Roofline {
    /// Device memory bandwidth in bytes/s (measured with a device-to-device copy).
    pub bytes_per_s: f64,
    /// Dense bf16 tensor-core rate in FLOP/s.
    pub flops_per_s: f64,
}

impl Roofline {
    /// Measures the copy bandwidth (1 GiB device to device, read + write counted) and
    /// estimates the dense bf16 tensor rate as SMs x SM clock x FLOP/clock/SM of the
    /// architecture (4096 on Hopper: 989 TFLOP/s on an H100/H200 SXM at 1.83 GHz).
    pub fn measure(gpu: &Gpu) -> Result<Roofline, RuntimeError> {
        let s = gpu.stream();
        let n = 1usize << 30;
        let src = s
            .alloc_zeros::<u8>(n)
            .map_err(RuntimeError::driver("allocating the bandwidth buffers"))?;
        let mut dst = s
            .alloc_zeros::<u8>(n)
            .map_err(RuntimeError::driver("allocating the bandwidth buffers"))?;
        let us = crate::timing::median_us(s, 2, 7, |_| {
            s.memcpy_dtod(&src, &mut dst).map_err(RuntimeError::driver("copying"))
        })?;
        let fp = gpu.fingerprint();
        let clock_hz = match gpu.limits().clock_khz {
            0 => 1.755e9,
            khz => khz as f64 * 1e3,
        };
        let per_sm_clock = match fp.compute_capability {
            (m, _) if m >= 10 => 8192.0,
            (9, _) => 4096.0,
            (8, 0) => 2048.0,
            _ => 1024.0,
        };
        Ok(Roofline {
            bytes_per_s: 2.0 * n as f64 / (us * 1e-6),
            // 1.755 GHz (the H100/H200 SXM boost clock) where the driver does not report one.
            flops_per_s: fp.sm_count as f64 * clock_hz * per_sm_clock,
        })
    }

    /// The floor of `cost` in microseconds.
    pub fn floor_us(&self, cost: Cost) -> f64 {
        (cost.bytes / self.bytes_per_s).max(cost.flops / self.flops_per_s) * 1e6
    }
}

/// How the tuner measures.
#[derive(Clone, Debug)]
pub struct TuneOptions {
    /// Untimed launches before timing.
    pub warmup: usize,
    /// Timed launches; the median is kept.
    pub reps: usize,
    /// Re-tune keys that have a valid cache entry.
    pub force: bool,
    /// A candidate wins over an earlier one only when faster by more than this fraction
    /// (0.02 = 2%), so near ties go to the lower index and winners do not flip-flop.
    pub noise: f64,
    /// Seed of the random inputs.
    pub seed: u64,
    /// For GB/s and % of floor in the entries, if measured.
    pub roofline: Option<Roofline>,
}

impl Default for TuneOptions {
    fn default() -> Self {
        TuneOptions {
            warmup: 3,
            reps: 25,
            force: false,
            noise: 0.02,
            seed: 0x7d7_2ee5,
            roofline: None,
        }
    }
}

/// Where the time of tuning one key went (all zero for a cached entry).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TuneTimes {
    /// Generating and loading the candidates.
    pub compile: Duration,
    /// Building the timing inputs.
    pub inputs: Duration,
    /// Checking candidates against the CPU reference (checks shared with earlier keys are free).
    pub checks: Duration,
    /// Timing the candidates that passed.
    pub timing: Duration,
}

impl TuneTimes {
    /// The total.
    pub fn total(&self) -> Duration {
        self.compile + self.inputs + self.checks + self.timing
    }
}

/// The result of tuning one key.
#[derive(Clone, Debug)]
pub struct Tuned {
    /// The entry (as stored in the tune cache).
    pub entry: TuneEntry,
    /// Whether it came from the cache (no measurement was made).
    pub from_cache: bool,
    /// Where the time went.
    pub times: TuneTimes,
}

/// Tunes keys of any [`Tunable`] kernel on one GPU, storing each result in a [`TuneCache`]
/// (saved after every new entry, so an interrupted run keeps what it measured).
pub struct Tuner<'g> {
    gpu: &'g Gpu,
    cache: TuneCache,
    opts: TuneOptions,
    /// Check results by (variant symbol, check key): many keys share a check key.
    verdicts: HashMap<(String, String), Result<Verdict, String>>,
    /// Twice the L2, overwritten before timed runs whose inputs fit in L2.
    flush: Option<CudaSlice<u8>>,
    /// Device data shared between workloads (a quarter of the device memory at most).
    pool: DevicePool,
}

impl<'g> Tuner<'g> {
    /// A tuner for `gpu` storing into `cache`.
    pub fn new(gpu: &'g Gpu, cache: TuneCache, opts: TuneOptions) -> Tuner<'g> {
        Tuner {
            gpu,
            cache,
            opts,
            verdicts: HashMap::new(),
            flush: None,
            pool: DevicePool::new(gpu.fingerprint().memory_bytes / 4),
        }
    }

    /// The tune cache.
    pub fn cache(&self) -> &TuneCache {
        &self.cache
    }

    /// The options.
    pub fn options(&self) -> &TuneOptions {
        &self.opts
    }

    /// The options, to change between keys (e.g. to add the roofline once measured).
    pub fn options_mut(&mut self) -> &mut TuneOptions {
        &mut self.opts
    }

    /// The valid cache entry that [`Tuner::tune`] would return for `K` at `key` without
    /// measuring (none when [`TuneOptions::force`] is on).
    pub fn cached<K: Tunable>(&self, key: &K::Key) -> Option<&TuneEntry> {
        if self.opts.force {
            return None;
        }
        let key = K::bucket(key);
        let entry = self.cache.entry(K::NAME, &key.to_string())?;
        (entry.source_hash == source_hash::<K>(&K::candidates(&key))).then_some(entry)
    }

    /// Tunes `K` at the bucket of `key`, unless the cache holds a valid entry (and
    /// [`TuneOptions::force`] is off). Each candidate is compiled (in parallel), checked against
    /// the CPU reference, and timed only if it passed; failures score +inf and wrong results are
    /// reported and never chosen. Errors only where no input could be built for the key.
    pub fn tune<K: Tunable>(&mut self, key: &K::Key) -> Result<Tuned, RuntimeError> {
        if let Some(entry) = self.cached::<K>(key) {
            return Ok(Tuned {
                entry: entry.clone(),
                from_cache: true,
                times: TuneTimes::default(),
            });
        }
        let mut times = TuneTimes::default();
        let t = Instant::now();
        let key = K::bucket(key);
        let candidates = K::candidates(&key);
        let hash = source_hash::<K>(&candidates);
        let compiled = self.gpu.compile_many::<K>(&candidates);
        times.compile = t.elapsed();
        let cost = K::cost(&key);
        let l2_bytes = l2_bytes(self.gpu);
        let copies = rotation_copies(l2_bytes, cost.bytes);
        let t = Instant::now();
        let mut workload = if compiled.iter().any(|c| c.is_ok()) {
            Some(K::workload(self.gpu, &mut self.pool, &key, copies, self.opts.seed)?)
        } else {
            None
        };
        times.inputs = t.elapsed();
        let cold = copies as f64 * cost.bytes >= 2.0 * l2_bytes as f64;
        if !cold && self.flush.is_none() {
            let n = 2 * l2_bytes;
            self.flush = Some(
                self.gpu
                    .stream()
                    .alloc_zeros::<u8>(n)
                    .map_err(RuntimeError::driver("allocating the L2 flush buffer"))?,
            );
        }
        let check_key = K::check_key(&key);
        let mut trials = Vec::with_capacity(candidates.len());
        for (p, kernel) in candidates.iter().zip(&compiled) {
            let variant = K::symbol(p);
            let kernel = match kernel {
                Ok(k) => k,
                Err(e) => {
                    tracing::warn!("`{variant}` at {key}: failed to compile or load: {e}");
                    trials.push(Trial::failed(variant, e.to_string()));
                    continue;
                }
            };
            let t = Instant::now();
            let verdict = self
                .verdicts
                .entry((variant.clone(), check_key.to_string()))
                .or_insert_with(|| K::check(self.gpu, p, &check_key, self.opts.seed).map_err(|e| e.to_string()))
                .clone();
            times.checks += t.elapsed();
            match verdict {
                Err(e) => {
                    tracing::warn!("`{variant}` at {key}: the check failed to run: {e}");
                    trials.push(Trial::failed(variant, e));
                    continue;
                }
                Ok(v) if !v.passed => {
                    tracing::warn!("`{variant}` at {key}: WRONG result, rejected: {}", v.detail);
                    trials.push(Trial {
                        variant,
                        us: None,
                        status: TrialStatus::Wrong,
                        detail: Some(v.detail),
                    });
                    continue;
                }
                Ok(_) => {}
            }
            let w = workload.as_mut().expect("built when a candidate compiled");
            let flush = if cold { None } else { self.flush.as_mut() };
            let (gpu, stream) = (self.gpu, self.gpu.stream());
            let t = Instant::now();
            let per_sample = K::runs_per_sample();
            let (warmup, reps) = (self.opts.warmup, self.opts.reps);
            let timed = if per_sample > 1 && !gpu.context().is_event_tracking() {
                graph_us_flushed(stream, per_sample, warmup, reps, flush, |i| K::run(gpu, kernel, w, i))
            } else {
                median_us_batched(stream, warmup, reps, per_sample, flush, |i| K::run(gpu, kernel, w, i))
            };
            times.timing += t.elapsed();
            match timed {
                Ok(us) => trials.push(Trial {
                    variant,
                    us: Some(us),
                    status: TrialStatus::Ok,
                    detail: None,
                }),
                Err(e) => {
                    tracing::warn!("`{variant}` at {key}: failed to launch: {e}");
                    trials.push(Trial::failed(variant, e.to_string()));
                }
            }
        }
        let entry = TuneEntry::new(
            K::NAME,
            key.to_string(),
            hash,
            cost,
            trials,
            self.opts.noise,
            self.opts.roofline,
        );
        self.cache.insert(entry.clone());
        if let Err(e) = self.cache.save() {
            tracing::warn!("the tune cache cannot be saved: {e}");
        }
        Ok(Tuned {
            entry,
            from_cache: false,
            times,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pow2_buckets() {
        let b: Vec<usize> = [0, 1, 2, 3, 5, 64, 65, 200, 256]
            .iter()
            .map(|&n| bucket_pow2(n))
            .collect();
        assert_eq!(b, [1, 1, 2, 4, 8, 64, 128, 256, 256]);
    }

    #[test]
    fn rotation_covers_twice_the_l2_within_1_to_32_copies() {
        let l2 = 50 << 20;
        assert_eq!(rotation_copies(l2, 2e9), 1);
        assert_eq!(rotation_copies(l2, 40.0 * (1 << 20) as f64), 3);
        assert_eq!(rotation_copies(l2, 1.0), 32);
        assert_eq!(rotation_copies(l2, 0.0), 32);
    }

    #[test]
    fn floor_is_the_slower_of_memory_and_compute() {
        let r = Roofline {
            bytes_per_s: 4e12,
            flops_per_s: 1e15,
        };
        assert!((r.floor_us(Cost { bytes: 4e6, flops: 1.0 }) - 1.0).abs() < 1e-9);
        assert!((r.floor_us(Cost { bytes: 1.0, flops: 2e9 }) - 2.0).abs() < 1e-9);
    }
}
