//! `kernel-check --decode-ops`: the small ops of a Kimi K2.6 decode step, each new kernel next to
//! what it replaces, at T = 1, 4 and 16 tokens (cold L2: a flush buffer is overwritten before
//! every timed run). Prints µs and the weight/activation bytes moved per µs (GB/s).

use ddtree_codegen::Kernel;
use ddtree_kernels::attention::mla;
use ddtree_kernels::attention::op::{MlaAbsorbOutputOp, MlaAbsorbQueryOp, MlaKvAppendOp};
use ddtree_kernels::elementwise::op::{AddAssignOp, FillBf16Op, FillF32Op, RopeOp, SiluMulSplitOp};
use ddtree_kernels::gemv::op::{GateUpSiluOp, GemvOp, GemvRmsNormOp};
use ddtree_kernels::gemv::{self, GemvChoice};
use ddtree_kernels::norm::op::{AddRmsNormOp, RmsNormOp};
use ddtree_kernels::residual;
use ddtree_kernels::{
    silu_mul, AddAssign, AddRmsNorm, FillRandomBf16, FillRandomF32, GemvBf16, GemvBf16F32, GemvGateUpSilu,
    GemvRmsNormBf16, GemvSplitBf16, GemvSplitF32, GemvSplitGateUpSilu, MlaAbsorbOutput, MlaAbsorbQuery, MlaKvAppend,
    RmsNorm, RopeInterleaved, SiluMulSplit,
};
use ddtree_runtime::blas::{BatchedGemm, RightOperand, Strided};
use ddtree_runtime::cudarc::driver::CudaSlice;
use ddtree_runtime::timing::median_us_flushed;
use ddtree_runtime::{Blas, Gpu, RuntimeError};
use half::bf16;

const HEADS: usize = 64;
const NOPE: usize = 128;
const ROPE: usize = 64;
const V: usize = 128;
const LORA: usize = 512;
const HIDDEN: usize = 7168;

struct Bufs<'g> {
    gpu: &'g Gpu,
    fill_bf16: ddtree_runtime::CompiledKernel<FillRandomBf16>,
    fill_f32: ddtree_runtime::CompiledKernel<FillRandomF32>,
    seed: u32,
}

impl Bufs<'_> {
    fn bf16(&mut self, n: usize) -> Result<CudaSlice<bf16>, RuntimeError> {
        let s = self.gpu.stream();
        let mut out = s
            .alloc_zeros::<bf16>(n.max(1))
            .map_err(RuntimeError::driver("allocating"))?;
        self.seed += 1;
        let (out_ref, seed) = (&mut out, self.seed);
        FillBf16Op {
            out: out_ref,
            n,
            seed,
            lo: -1.0,
            hi: 1.0,
        }
        .launch(&self.fill_bf16, s)?;
        Ok(out)
    }

    fn f32(&mut self, n: usize, lo: f32, hi: f32) -> Result<CudaSlice<f32>, RuntimeError> {
        let s = self.gpu.stream();
        let mut out = s
            .alloc_zeros::<f32>(n.max(1))
            .map_err(RuntimeError::driver("allocating"))?;
        self.seed += 1;
        let (out_ref, seed) = (&mut out, self.seed);
        FillF32Op {
            out: out_ref,
            n,
            seed,
            lo,
            hi,
        }
        .launch(&self.fill_f32, s)?;
        Ok(out)
    }
}

fn row(op: &str, t: usize, what: &str, us: f64, bytes: f64) {
    println!("| {op} | {t} | {what} | {us:.1} | {:.0} |", bytes / us / 1e3);
}

/// Times the decode ops; see the module docs.
pub fn decode_ops_bench(gpu: &Gpu) -> Result<(), RuntimeError> {
    let s = gpu.stream();
    let sms = gpu.fingerprint().sm_count as usize;
    let blas = Blas::new(gpu)?;
    let mut b = Bufs {
        gpu,
        fill_bf16: gpu.compile::<FillRandomBf16>(&FillRandomBf16::default_params())?,
        fill_f32: gpu.compile::<FillRandomF32>(&FillRandomF32::default_params())?,
        seed: 7,
    };
    let mut flush = s
        .alloc_zeros::<u8>(2 * ddtree_runtime::l2_bytes(gpu).max(64 << 20))
        .map_err(RuntimeError::driver("allocating"))?;
    let time = |flush: &mut CudaSlice<u8>, f: &mut dyn FnMut() -> Result<(), RuntimeError>| {
        median_us_flushed(s, 3, 50, Some(flush), |_| f())
    };
    println!("\n| op | T | kernel | µs | GB/s |");
    println!("|---|---:|---|---:|---:|");

    // The absorbed query and output against cuBLAS's batched GEMM (+ the copy and rope it needs).
    let kv_b = b.bf16(HEADS * (NOPE + V) * LORA)?;
    let w_bytes = (HEADS * NOPE * LORA * 2) as f64;
    let pos_host: Vec<u32> = (0..16).map(|i| 1000 + i).collect();
    let pos = s.clone_htod(&pos_host).map_err(RuntimeError::driver("upload"))?;
    let cos = b.f32(4096 * ROPE / 2, -1.0, 1.0)?;
    let sin = b.f32(4096 * ROPE / 2, -1.0, 1.0)?;
    let qp = <MlaAbsorbQuery as Kernel>::space()[0];
    let qk = gpu.compile::<MlaAbsorbQuery>(&qp)?;
    let op = <MlaAbsorbOutput as Kernel>::space()[0];
    let ok = gpu.compile::<MlaAbsorbOutput>(&op)?;
    let rope_k = gpu.compile::<RopeInterleaved>(&<RopeInterleaved as Kernel>::space()[0])?;
    for t in [1usize, 4, 16] {
        let q = b.bf16(t * HEADS * (NOPE + ROPE))?;
        let mut q_abs = b.bf16(t * HEADS * (LORA + ROPE))?;
        let us = time(&mut flush, &mut || {
            let (q, kv_b, positions, cos, sin, out) = (&q, &kv_b, &pos, &cos, &sin, &mut q_abs);
            let (rows, heads, lora, v) = (t, HEADS, LORA, V);
            let op = MlaAbsorbQueryOp {
                q,
                kv_b,
                positions,
                cos,
                sin,
                out,
                rows,
                heads,
                lora,
                v,
            };
            // SAFETY: the positions (1000..1016) are rows of the 4096-row tables.
            unsafe { op.launch(&qk, s) }
        })?;
        row("mla_query", t, &MlaAbsorbQuery::symbol(&qp), us, w_bytes);
        let g = BatchedGemm {
            m: t,
            n: LORA,
            k: NOPE,
            batch: HEADS,
            a: Strided {
                offset: 0,
                ld: HEADS * (NOPE + ROPE),
                stride: NOPE + ROPE,
            },
            b: Strided {
                offset: 0,
                ld: LORA,
                stride: (NOPE + V) * LORA,
            },
            b_op: RightOperand::Plain,
            c: Strided {
                offset: 0,
                ld: HEADS * (LORA + ROPE),
                stride: LORA + ROPE,
            },
        };
        let us = time(&mut flush, &mut || {
            // SAFETY: the strides stay inside q, kv_b and q_abs; the rope covers t * heads rows.
            unsafe {
                blas.batched(&g, &q, &kv_b, &mut q_abs)?;
                let (x, positions, cos, sin) = (&mut q_abs, &pos, &cos, &sin);
                let (rows, heads, stride, offset) = (t * HEADS, HEADS, LORA + ROPE, LORA);
                RopeOp {
                    x,
                    positions,
                    cos,
                    sin,
                    rows,
                    heads,
                    stride,
                    offset,
                    grid: None,
                }
                .launch(&rope_k, s)
            }
        })?;
        row("mla_query", t, "cuBLAS batched + rope (old path, no copy)", us, w_bytes);

        let o_lat = b.bf16(t * HEADS * LORA)?;
        let mut o = b.bf16(t * HEADS * V)?;
        let us = time(&mut flush, &mut || {
            let (o_lat, kv_b, out) = (&o_lat, &kv_b, &mut o);
            MlaAbsorbOutputOp {
                o_lat,
                kv_b,
                out,
                rows: t,
                heads: HEADS,
                nope: NOPE,
                v: V,
            }
            .launch(&ok, s)
        })?;
        row("mla_output", t, &MlaAbsorbOutput::symbol(&op), us, w_bytes);
        let g = BatchedGemm {
            m: t,
            n: V,
            k: LORA,
            batch: HEADS,
            a: Strided {
                offset: 0,
                ld: HEADS * LORA,
                stride: LORA,
            },
            b: Strided {
                offset: NOPE * LORA,
                ld: LORA,
                stride: (NOPE + V) * LORA,
            },
            b_op: RightOperand::Transposed,
            c: Strided {
                offset: 0,
                ld: HEADS * V,
                stride: V,
            },
        };
        let us = time(&mut flush, &mut || {
            // SAFETY: the strides stay inside o_lat, kv_b and o.
            unsafe { blas.batched(&g, &o_lat, &kv_b, &mut o) }
        })?;
        row("mla_output", t, "cuBLAS batched (old path)", us, w_bytes);
    }

    // GEMVs: the per-column kernel (the old choice) next to `gemv::choose`.
    for (n, k) in [
        (1536, HIDDEN),
        (576, HIDDEN),
        (12288, 1536),
        (HIDDEN, 8192),
        (48, HIDDEN),
        (384, HIDDEN),
    ] {
        let w = b.bf16(n * k)?;
        for t in [1usize, 4] {
            let a = b.bf16(t * k)?;
            let mut out = b.bf16(t * n)?;
            let mut out_f = b.f32(t * n, 0.0, 1.0)?;
            let bytes = (2 * n * k) as f64;
            let f32_out = n <= 384;
            let op = format!("linear{} {k}->{n}", if f32_out { "_f32" } else { "" });
            let m = t.next_power_of_two() as u32;
            let old = <GemvBf16 as Kernel>::space().into_iter().find(|p| p.m == m).expect("m");
            let ko = gpu.compile::<GemvBf16>(&old)?;
            let kf = gpu.compile::<GemvBf16F32>(&old)?;
            let us = time(&mut flush, &mut || {
                let (a, w, rows) = (&a, &w, t);
                if f32_out {
                    GemvOp {
                        a,
                        w,
                        out: &mut out_f,
                        rows,
                        n,
                        k,
                    }
                    .launch_f32(&kf, s)
                } else {
                    GemvOp {
                        a,
                        w,
                        out: &mut out,
                        rows,
                        n,
                        k,
                    }
                    .launch_bf16(&ko, s)
                }
            })?;
            row(&op, t, &format!("{} (old)", GemvBf16::symbol(&old)), us, bytes);
            // Every split-K candidate that takes `t` rows, `gemv::choose`'s pick marked.
            let chosen = match gemv::choose(t, n, k, sms) {
                Some(GemvChoice::Split(p)) => Some(p),
                _ => None,
            };
            for p in <GemvSplitBf16 as Kernel>::space()
                .into_iter()
                .filter(|p| p.m as usize >= t)
            {
                let ks = gpu.compile::<GemvSplitBf16>(&p)?;
                let ksf = gpu.compile::<GemvSplitF32>(&p)?;
                let us = time(&mut flush, &mut || {
                    let (a, w, rows) = (&a, &w, t);
                    if f32_out {
                        GemvOp {
                            a,
                            w,
                            out: &mut out_f,
                            rows,
                            n,
                            k,
                        }
                        .launch_split_f32(&ksf, s)
                    } else {
                        GemvOp {
                            a,
                            w,
                            out: &mut out,
                            rows,
                            n,
                            k,
                        }
                        .launch_split_bf16(&ks, s)
                    }
                })?;
                let mark = if chosen == Some(p) { " (chosen)" } else { "" };
                row(&op, t, &format!("{}{mark}", GemvSplitBf16::symbol(&p)), us, bytes);
            }
        }
    }

    // SwiGLU gate/up (the shared expert, 2048 of 7168, and the dense MLP, 18432 of 7168): two
    // GEMVs of `gemv::choose` and `silu_mul_split` (the unfused path), next to every fused
    // candidate of the kind `gemv::choose_gate_up` picks (its choice marked).
    let silu_p = <SiluMulSplit as Kernel>::space()[0];
    let silu_k = gpu.compile::<SiluMulSplit>(&silu_p)?;
    for (n, k) in [(2048, HIDDEN), (18432, HIDDEN)] {
        let gate = b.bf16(n * k)?;
        let up = b.bf16(n * k)?;
        let bytes = (4 * n * k) as f64;
        let op = format!("gate_up_silu {k}->{n}");
        for t in [1usize, 4] {
            let a = b.bf16(t * k)?;
            let (mut g, mut u, mut out) = (b.bf16(t * n)?, b.bf16(t * n)?, b.bf16(t * n)?);
            let silu_grid = silu_mul::grid_split(&silu_p, t * n);
            let us = match gemv::choose(t, n, k, sms).expect("a GEMV shape") {
                GemvChoice::Warp(p) => {
                    let kg = gpu.compile::<GemvBf16>(&p)?;
                    time(&mut flush, &mut || {
                        let (a, rows) = (&a, t);
                        GemvOp {
                            a,
                            w: &gate,
                            out: &mut g,
                            rows,
                            n,
                            k,
                        }
                        .launch_bf16(&kg, s)?;
                        GemvOp {
                            a,
                            w: &up,
                            out: &mut u,
                            rows,
                            n,
                            k,
                        }
                        .launch_bf16(&kg, s)?;
                        let (gate, up, out, n) = (&g, &u, &mut out, t * n);
                        SiluMulSplitOp {
                            gate,
                            up,
                            out,
                            n,
                            grid: Some(silu_grid),
                        }
                        .launch(&silu_k, s)
                    })?
                }
                GemvChoice::Split(p) => {
                    let kg = gpu.compile::<GemvSplitBf16>(&p)?;
                    time(&mut flush, &mut || {
                        let (a, rows) = (&a, t);
                        GemvOp {
                            a,
                            w: &gate,
                            out: &mut g,
                            rows,
                            n,
                            k,
                        }
                        .launch_split_bf16(&kg, s)?;
                        GemvOp {
                            a,
                            w: &up,
                            out: &mut u,
                            rows,
                            n,
                            k,
                        }
                        .launch_split_bf16(&kg, s)?;
                        let (gate, up, out, n) = (&g, &u, &mut out, t * n);
                        SiluMulSplitOp {
                            gate,
                            up,
                            out,
                            n,
                            grid: Some(silu_grid),
                        }
                        .launch(&silu_k, s)
                    })?
                }
            };
            row(&op, t, "2 x linear + silu_mul_split (old)", us, bytes);
            let m = t.next_power_of_two() as u32;
            let label =
                |symbol: String, chosen: bool| format!("{symbol} ({})", if chosen { "new" } else { "candidate" });
            match gemv::choose_gate_up(t, n, k, sms).expect("a fused shape") {
                GemvChoice::Warp(chosen) => {
                    for p in GemvGateUpSilu::space().into_iter().filter(|p| p.m == m) {
                        let kf = gpu.compile::<GemvGateUpSilu>(&p)?;
                        let us = time(&mut flush, &mut || {
                            let (a, gate, up, out, rows) = (&a, &gate, &up, &mut out, t);
                            GateUpSiluOp {
                                a,
                                gate,
                                up,
                                out,
                                rows,
                                n,
                                k,
                            }
                            .launch_warp(&kf, s)
                        })?;
                        row(&op, t, &label(GemvGateUpSilu::symbol(&p), p == chosen), us, bytes);
                    }
                }
                GemvChoice::Split(chosen) => {
                    for p in GemvSplitGateUpSilu::space().into_iter().filter(|p| p.m == m) {
                        let kf = gpu.compile::<GemvSplitGateUpSilu>(&p)?;
                        let us = time(&mut flush, &mut || {
                            let (a, gate, up, out, rows) = (&a, &gate, &up, &mut out, t);
                            GateUpSiluOp {
                                a,
                                gate,
                                up,
                                out,
                                rows,
                                n,
                                k,
                            }
                            .launch_split(&kf, s)
                        })?;
                        row(&op, t, &label(GemvSplitGateUpSilu::symbol(&p), p == chosen), us, bytes);
                    }
                }
            }
        }
    }

    // The MLA query up-projection with its norm: RmsNorm + the chosen GEMV (the unfused path)
    // next to every `GemvRmsNormBf16` candidate of the row count (the first line marked is
    // `gemv::choose_rms_norm`'s).
    {
        let (n, k) = (12288usize, 1536usize);
        let w = b.bf16(n * k)?;
        let nw = b.bf16(k)?;
        let bytes = (2 * n * k) as f64;
        for t in [1usize, 4] {
            let a = b.bf16(t * k)?;
            let mut normed = b.bf16(t * k)?;
            let mut out = b.bf16(t * n)?;
            let space = <RmsNorm as Kernel>::space();
            let np = ddtree_kernels::rms_norm::row_holder(&space, k).expect("a holder of 1536");
            let nk = gpu.compile::<RmsNorm>(&np)?;
            let Some(GemvChoice::Warp(gp)) = gemv::choose(t, n, k, sms) else {
                continue;
            };
            let gk = gpu.compile::<GemvBf16>(&gp)?;
            let us = time(&mut flush, &mut || {
                let (x, weight, rows, eps) = (&a, &nw, t, 1e-6);
                RmsNormOp {
                    x,
                    weight,
                    out: &mut normed,
                    rows,
                    n: k,
                    eps,
                }
                .launch(&nk, s)?;
                GemvOp {
                    a: &normed,
                    w: &w,
                    out: &mut out,
                    rows,
                    n,
                    k,
                }
                .launch_bf16(&gk, s)
            })?;
            let what = format!("{} + {} (unfused)", RmsNorm::symbol(&np), GemvBf16::symbol(&gp));
            row("q_norm + q_b 1536->12288", t, &what, us, bytes);
            let chosen = gemv::choose_rms_norm(t, n, k, sms);
            let m = t.next_power_of_two() as u32;
            for p in <GemvRmsNormBf16 as Kernel>::space().into_iter().filter(|p| p.m == m) {
                let kk = gpu.compile::<GemvRmsNormBf16>(&p)?;
                let us = time(&mut flush, &mut || {
                    let (a, norm, w, out, rows) = (&a, &nw, &w, &mut out, t);
                    GemvRmsNormOp {
                        a,
                        norm,
                        eps: 1e-6,
                        w,
                        out,
                        rows,
                        n,
                        k,
                    }
                    .launch(&kk, s)
                })?;
                let mark = if chosen == Some(p) { " (chosen)" } else { "" };
                let what = format!("{}{mark}", GemvRmsNormBf16::symbol(&p));
                row("q_norm + q_b 1536->12288", t, &what, us, bytes);
            }
        }
    }

    // Norms: default variant next to the row-in-registers one.
    let nw = b.bf16(HIDDEN)?;
    for t in [1usize, 4, 16] {
        let x = b.bf16(t * HIDDEN)?;
        let mut out = b.bf16(t * HIDDEN)?;
        let bytes = (4 * t * HIDDEN) as f64;
        let space = <RmsNorm as Kernel>::space();
        let held = ddtree_kernels::rms_norm::row_holder(&space, HIDDEN).expect("a holder of 7168");
        for (p, what) in [(space[0], "default"), (held, "holds the row")] {
            let k = gpu.compile::<RmsNorm>(&p)?;
            let us = time(&mut flush, &mut || {
                let (x, weight, out, rows) = (&x, &nw, &mut out, t);
                RmsNormOp {
                    x,
                    weight,
                    out,
                    rows,
                    n: HIDDEN,
                    eps: 1e-6,
                }
                .launch(&k, s)
            })?;
            row(
                "rms_norm 7168",
                t,
                &format!("{} ({what})", RmsNorm::symbol(&p)),
                us,
                bytes,
            );
        }
        let mut xf = b.f32(t * HIDDEN, -1.0, 1.0)?;
        let y = b.bf16(t * HIDDEN)?;
        let old = <AddRmsNorm as Kernel>::space()[0];
        let new = residual::choose_add_rms_norm(t, HIDDEN, 1).expect("a variant");
        for (p, what) in [(old, "old"), (new, "new")] {
            let k = gpu.compile::<AddRmsNorm>(&p)?;
            let us = time(&mut flush, &mut || {
                let (x, y, weight, out, rows) = (&mut xf, &y, &nw, &mut out, t);
                AddRmsNormOp {
                    x,
                    y,
                    z: None,
                    weight,
                    out,
                    rows,
                    n: HIDDEN,
                    eps: 1e-6,
                }
                .launch(&k, s)
            })?;
            row(
                "add_rms_norm 7168",
                t,
                &format!("{} ({what})", AddRmsNorm::symbol(&p)),
                us,
                (12 * t * HIDDEN) as f64,
            );
        }
        // The MoE block's routed + shared outputs into the stream: `add_assign` then the norm,
        // next to the norm's two-addend variant.
        let mut shared = b.bf16(t * HIDDEN)?;
        let n = t * HIDDEN;
        let add_p = <AddAssign as Kernel>::space()[0];
        let add_k = gpu.compile::<AddAssign>(&add_p)?;
        let one = gpu.compile::<AddRmsNorm>(&new)?;
        let us = time(&mut flush, &mut || {
            AddAssignOp {
                x: &mut shared,
                y: &y,
                n,
            }
            .launch(&add_k, s)?;
            let (x, y, weight, out, rows) = (&mut xf, &shared, &nw, &mut out, t);
            AddRmsNormOp {
                x,
                y,
                z: None,
                weight,
                out,
                rows,
                n: HIDDEN,
                eps: 1e-6,
            }
            .launch(&one, s)
        })?;
        row(
            "add2_rms_norm 7168",
            t,
            &format!("{} + {} (old)", AddAssign::symbol(&add_p), AddRmsNorm::symbol(&new)),
            us,
            (18 * t * HIDDEN) as f64,
        );
        let p = residual::choose_add_rms_norm(t, HIDDEN, 2).expect("a two-addend variant");
        let two = gpu.compile::<AddRmsNorm>(&p)?;
        let us = time(&mut flush, &mut || {
            let (x, y, z, weight, out, rows) = (&mut xf, &shared, Some(&y), &nw, &mut out, t);
            AddRmsNormOp {
                x,
                y,
                z,
                weight,
                out,
                rows,
                n: HIDDEN,
                eps: 1e-6,
            }
            .launch(&two, s)
        })?;
        row(
            "add2_rms_norm 7168",
            t,
            &format!("{} (new)", AddRmsNorm::symbol(&p)),
            us,
            (14 * t * HIDDEN) as f64,
        );
        let kv_a = b.bf16(t * (LORA + ROPE))?;
        let g = b.bf16(LORA)?;
        let mut cache = b.bf16(64 * (LORA + ROPE))?;
        let lens = s.clone_htod(&[3u32]).map_err(RuntimeError::driver("upload"))?;
        let old = <MlaKvAppend as Kernel>::space()[0];
        let new = mla::choose_append(LORA, ROPE);
        for (p, what) in [(old, "old"), (new, "new")] {
            let k = gpu.compile::<MlaKvAppend>(&p)?;
            let us = time(&mut flush, &mut || {
                let (kv_a, norm, positions, cos, sin, cache, lens) = (&kv_a, &g, &pos, &cos, &sin, &mut cache, &lens);
                let (rows, lora, rope, eps) = (t, LORA, ROPE, 1e-6);
                let op = MlaKvAppendOp {
                    kv_a,
                    norm,
                    positions,
                    cos,
                    sin,
                    cache,
                    lens,
                    rows,
                    lora,
                    rope,
                    eps,
                };
                // SAFETY: the cache's 64 rows hold 3 + t; the positions are rows of the tables.
                unsafe { op.launch(&k, s) }
            })?;
            row(
                "mla_append_kv",
                t,
                &format!("{} ({what})", MlaKvAppend::symbol(&p)),
                us,
                (4 * t * (LORA + ROPE)) as f64,
            );
        }
    }
    Ok(())
}
