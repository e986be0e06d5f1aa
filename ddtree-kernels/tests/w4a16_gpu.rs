//! Every W4A16 candidate (dense, fused, grouped) and the GPU repack against the CPU reference on
//! the GPU, at small ragged sizes. Skips (and says so) where there is no CUDA driver or GPU.

use ddtree_kernels::w4a16::check::run_all;
use ddtree_runtime::{Gpu, RuntimeError};

#[test]
fn every_w4a16_candidate_matches_the_cpu_reference_on_the_gpu() {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e @ (RuntimeError::NoDriver | RuntimeError::NoDevice { .. })) => {
            eprintln!("skipped: {e}; no W4A16 GPU check was run");
            return;
        }
        Err(e) => panic!("opening the GPU failed: {e}"),
    };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let results = run_all(&gpu, false, seed).expect("launches succeed");
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
}
