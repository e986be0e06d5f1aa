//! The tune cache on the CPU: lookups, invalidation when a kernel's source changes, recovery
//! from a corrupt file, fingerprint mismatch, and the default on a miss.

use ddtree_codegen::Kernel;
use ddtree_runtime::{
    source_hash, Choice, CompiledKernel, Cost, DevicePool, Fingerprint, Gpu, Lookup, RuntimeError, Trial, TrialStatus,
    Tunable, TuneCache, TuneEntry, Verdict,
};

/// Two kernels with the same name and parameter space whose bodies differ: what editing a
/// kernel between two runs looks like to the tune cache.
mod v1 {
    use ddtree_macros::{kernel, KernelParams};

    /// Params.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
    pub struct P {
        /// Threads per block.
        pub block: u32,
    }

    #[kernel(block = p.block, space = [P { block: 128 }, P { block: 256 }, P { block: 512 }])]
    pub fn scale(#[comptime] p: &P, x: &mut [f32], n: u32) {
        let i = block_idx_x() * p.block + thread_idx_x();
        if i < n {
            x[i] = x[i] * 2.0f32;
        }
    }
}

mod v2 {
    use ddtree_macros::kernel;

    pub use super::v1::P;

    #[kernel(block = p.block, space = [P { block: 128 }, P { block: 256 }, P { block: 512 }])]
    pub fn scale(#[comptime] p: &P, x: &mut [f32], n: u32) {
        let i = block_idx_x() * p.block + thread_idx_x();
        if i < n {
            x[i] = x[i] * 3.0f32;
        }
    }
}

/// The GPU parts are never reached in these tests.
macro_rules! tunable_on_cpu {
    ($k:ty) => {
        impl Tunable for $k {
            type Key = usize;
            type Workload = ();
            fn bucket(n: &usize) -> usize {
                ddtree_runtime::bucket_pow2(*n)
            }
            fn candidates(_: &usize) -> Vec<v1::P> {
                Self::space()
            }
            fn cost(n: &usize) -> Cost {
                Cost {
                    bytes: 8.0 * *n as f64,
                    flops: *n as f64,
                }
            }
            fn workload(_: &Gpu, _: &mut DevicePool, _: &usize, _: usize, _: u64) -> Result<(), RuntimeError> {
                Err(RuntimeError::NoDriver)
            }
            fn run(_: &Gpu, _: &CompiledKernel<Self>, _: &mut (), _: usize) -> Result<(), RuntimeError> {
                Err(RuntimeError::NoDriver)
            }
            fn check(_: &Gpu, _: &v1::P, _: &usize, _: u64) -> Result<Verdict, RuntimeError> {
                Err(RuntimeError::NoDriver)
            }
        }
    };
}
tunable_on_cpu!(v1::Scale);
tunable_on_cpu!(v2::Scale);

fn h200() -> Fingerprint {
    Fingerprint {
        name: "NVIDIA H200".into(),
        compute_capability: (9, 0),
        sm_count: 132,
        memory_bytes: 150_754_820_096,
        driver_version: 13000,
        nvrtc_version: Some((13, 0)),
    }
}

fn trial(variant: &str, us: Option<f64>, status: TrialStatus) -> Trial {
    Trial {
        variant: variant.into(),
        us,
        status,
        detail: (status != TrialStatus::Ok).then(|| "why".into()),
    }
}

/// An entry for `v1::Scale` at bucket `n` won by candidate 1, as the tuner writes it.
fn v1_entry(n: usize) -> TuneEntry {
    let c = v1::Scale::candidates(&n);
    let s: Vec<String> = c.iter().map(v1::Scale::symbol).collect();
    TuneEntry {
        kernel: v1::Scale::NAME.into(),
        key: n.to_string(),
        source_hash: source_hash::<v1::Scale>(&c),
        winner: Some(s[1].clone()),
        winner_us: Some(2.0),
        default: s[0].clone(),
        default_us: Some(3.0),
        bytes: 8.0 * n as f64,
        flops: n as f64,
        gbps: Some(4.0 * n as f64 / 1e3),
        tflops: None,
        floor_us: Some(1.0),
        trials: vec![
            trial(&s[0], Some(3.0), TrialStatus::Ok),
            trial(&s[1], Some(2.0), TrialStatus::Ok),
            trial(&s[2], None, TrialStatus::Wrong),
        ],
    }
}

#[test]
fn hit_after_insert_and_default_on_miss() {
    let dir = tempfile::tempdir().unwrap();
    let mut cache = TuneCache::load(dir.path().join("t.json"), &h200());
    assert_eq!(cache.lookup::<v1::Scale>(&1000), Lookup::Miss);
    let miss: Choice<v1::P> = cache.choose::<v1::Scale>(&1000, false);
    assert_eq!(miss.params, v1::P { block: 128 }, "index 0 is the default");
    assert_eq!(miss.default_reason.as_deref(), Some("not tuned"));

    cache.insert(v1_entry(1024));
    // 1000 buckets to 1024.
    match cache.lookup::<v1::Scale>(&1000) {
        Lookup::Hit { params, entry } => {
            assert_eq!(params, v1::P { block: 256 });
            assert_eq!(entry.speedup(), Some(1.5));
            assert_eq!(entry.percent_of_floor(), Some(50.0));
        }
        other => panic!("{other:?}"),
    }
    assert!(cache.choose::<v1::Scale>(&1000, false).is_tuned());
    let forced = cache.choose::<v1::Scale>(&1000, true);
    assert_eq!((forced.params, forced.is_tuned()), (v1::P { block: 128 }, false));
    assert_eq!(cache.lookup::<v1::Scale>(&2048), Lookup::Miss, "another bucket");
}

#[test]
fn a_source_change_invalidates_the_entry() {
    let dir = tempfile::tempdir().unwrap();
    let mut cache = TuneCache::load(dir.path().join("t.json"), &h200());
    cache.insert(v1_entry(1024));
    assert_ne!(
        source_hash::<v1::Scale>(&v1::Scale::space()),
        source_hash::<v2::Scale>(&v2::Scale::space()),
        "same name and params, different body"
    );
    match cache.lookup::<v2::Scale>(&1024) {
        Lookup::Stale(why) => assert!(why.contains("source changed"), "{why}"),
        other => panic!("{other:?}"),
    }
    let c = cache.choose::<v2::Scale>(&1024, false);
    assert_eq!(c.params, v1::P { block: 128 });
    assert!(c.default_reason.unwrap().contains("source changed"));
}

#[test]
fn a_winner_that_left_the_candidates_is_stale() {
    let dir = tempfile::tempdir().unwrap();
    let mut cache = TuneCache::load(dir.path().join("t.json"), &h200());
    let mut e = v1_entry(64);
    e.winner = Some("scale__block1024".into());
    cache.insert(e);
    assert!(matches!(cache.lookup::<v1::Scale>(&64), Lookup::Stale(w) if w.contains("no longer a candidate")));
    let mut e = v1_entry(64);
    e.winner = None;
    cache.insert(e);
    assert!(matches!(cache.lookup::<v1::Scale>(&64), Lookup::Stale(w) if w.contains("no candidate passed")));
    assert_eq!(cache.entries().len(), 1, "insert replaces");
}

#[test]
fn save_and_reload_is_readable_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = TuneCache::file_in(dir.path(), &h200());
    assert!(path
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("nvidia-h200-sm_90a-"));
    let mut cache = TuneCache::load(&path, &h200());
    cache.insert(v1_entry(1024));
    cache.insert(v1_entry(8));
    cache.save().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    for needle in [
        "\"kernel\": \"scale\"",
        "\"key\": \"1024\"",
        "\"winner\": \"scale__block256\"",
        "\"status\": \"wrong\"",
        "\"gbps\"",
    ] {
        assert!(text.contains(needle), "{needle} missing from\n{text}");
    }
    let again = TuneCache::load(&path, &h200());
    assert_eq!(again.entries(), cache.entries());
    let keys: Vec<&str> = again.entries().iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, ["1024", "8"], "sorted by (kernel, key)");
}

#[test]
fn a_corrupt_file_gives_an_empty_cache_that_is_rewritten() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.json");
    let mut cache = TuneCache::load(&path, &h200());
    cache.insert(v1_entry(1024));
    cache.save().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, &text[..text.len() / 2]).unwrap();
    let mut broken = TuneCache::load(&path, &h200());
    assert!(broken.entries().is_empty());
    assert_eq!(broken.lookup::<v1::Scale>(&1024), Lookup::Miss);
    broken.insert(v1_entry(16));
    broken.save().unwrap();
    assert_eq!(TuneCache::load(&path, &h200()).entries().len(), 1, "rewritten whole");
}

#[test]
fn another_fingerprint_is_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.json");
    let mut cache = TuneCache::load(&path, &h200());
    cache.insert(v1_entry(1024));
    cache.save().unwrap();
    let mut other = h200();
    other.driver_version = 12080;
    let loaded = TuneCache::load(&path, &other);
    assert!(
        loaded.entries().is_empty(),
        "results from another driver are not trusted"
    );
    assert_eq!(loaded.fingerprint(), &other);
    assert_eq!(TuneCache::load(&path, &h200()).entries().len(), 1);
}
