//! Benchmarks for ddtree kernels (see `benches/`).
