//! Every candidate of every kernel on the CPU interpreter (and on the GPU when one is present)
//! against its CPU reference, at small ragged sizes: one test per suite of the registry
//! (`ddtree_kernels::registry`); plus the interpreter's speed on a tile GEMM.
#![allow(clippy::result_large_err)]

use std::time::Instant;

use ddtree_codegen::Kernel;
use ddtree_kernels::check::{self, Sizes, Target};
use ddtree_kernels::registry::Entry;
use ddtree_kernels::GemmBf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

/// Runs the registry's suite `name` on every target and checks it covered every candidate of
/// its kernels (those needing `wgmma` only where it runs).
fn run_entry(name: &str) {
    let entry = Entry::named(name).expect("a registry entry");
    check::on_each_target(|t, rng| {
        if !entry.runs_on(t) {
            println!("{name}: skipped on this GPU (no wgmma)");
            return Ok(Vec::new());
        }
        let results = entry.run(t, Sizes::Small, rng)?;
        let missed = entry.unchecked(t, &results);
        assert!(missed.is_empty(), "candidates not checked: {missed:?}");
        Ok(results)
    });
}

macro_rules! suite_tests {
    (suites { $( $name:ident: [ $( $(#[$flag:ident])? $k:path ),+ ] => $suite:path; )* } elsewhere [ $($o:path),* ]) => {
        $(
            #[test]
            fn $name() {
                run_entry(stringify!($name));
            }
        )*
    };
}
ddtree_kernels::for_each_suite!(suite_tests);

/// The budget: a 64x64x64 tile GEMM interprets in a few seconds in a debug build.
#[test]
fn a_64_cubed_tile_gemm_interprets_in_seconds() {
    let p = GemmBf16::space()
        .into_iter()
        .find(|p| p.bm == 64 && p.bn == 64 && p.bk == 64)
        .expect("a 64x64x64 tile");
    let start = Instant::now();
    let r = check::gemm(&Target::Interp, &p, 64, 64, 64, &mut StdRng::seed_from_u64(1)).expect("runs");
    let secs = start.elapsed().as_secs_f64();
    assert!(r.passed, "{:?}", r.comparison);
    eprintln!(
        "64x64x64 tile GEMM ({}) on the interpreter: {secs:.2} s",
        GemmBf16::symbol(&p)
    );
    assert!(secs < 10.0, "interpreting a 64x64x64 GEMM took {secs:.1} s");
}
