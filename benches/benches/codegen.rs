//! CPU-side cost of generating kernel source: building the IR and rendering CUDA C for every
//! variant (this runs at engine startup before NVRTC).

use criterion::{criterion_group, criterion_main, Criterion};
use ddtree_codegen::Kernel;
use ddtree_kernels::{GemmBf16, RmsNorm};

fn bench(c: &mut Criterion) {
    c.bench_function("source/rms_norm default", |b| {
        b.iter(|| RmsNorm::source(&RmsNorm::default_params()).unwrap())
    });
    c.bench_function("source/gemm_bf16 default", |b| {
        b.iter(|| GemmBf16::source(&GemmBf16::default_params()).unwrap())
    });
    c.bench_function("source/catalogue (every variant)", |b| {
        b.iter(|| ddtree_kernels::catalogue().unwrap())
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
