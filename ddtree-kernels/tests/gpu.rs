//! Every kernel variant on the GPU against its CPU reference, at small ragged sizes. Skips (and
//! says so) where there is no CUDA driver or GPU.

use ddtree_kernels::check::{run_all, Sizes, Target};
use ddtree_runtime::{Gpu, RuntimeError};

#[test]
fn every_kernel_matches_its_cpu_reference_on_the_gpu() {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e @ (RuntimeError::NoDriver | RuntimeError::NoDevice { .. })) => {
            eprintln!("skipped: {e}; no GPU check was run");
            return;
        }
        Err(e) => panic!("opening the GPU failed: {e}"),
    };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let results = run_all(&Target::Gpu(&gpu), Sizes::Small, seed).expect("launches succeed");
    assert!(!results.is_empty());
    let failed: Vec<String> = results
        .iter()
        .filter(|r| !r.passed)
        .map(|r| format!("{} {}: {:?}", r.symbol, r.case, r.comparison))
        .collect();
    assert!(
        failed.is_empty(),
        "seed {seed}: {} of {} checks failed:\n{}",
        failed.len(),
        results.len(),
        failed.join("\n")
    );
    eprintln!("{} GPU checks passed (seed {seed})", results.len());
}
