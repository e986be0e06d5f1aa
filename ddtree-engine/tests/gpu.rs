//! The CUDA backend against the CPU references on the tiny fixtures: teacher-forced top-1
//! agreement with the f32 CPU (at least [`AGREEMENT_FLOOR`]) and with the CPU in bf16 mode that
//! mirrors the GPU's rounding (at least [`AGREEMENT_GOAL`]), each with the largest logit error
//! reported; and DDTree == plain greedy on the GPU, token for token, for the test drafters (every
//! budget, `auto` included) and the DFlash drafter, with every greedy fixed-budget round reading
//! back only its accept result (the tree stays on the GPU). Each test says SKIP and returns
//! where no GPU is present (`DDTREE_REQUIRE_GPU=1` turns that into a failure, for GPU machines).

mod common;

use common::{fixture, load, sequences, teacher_forced, Agreement};
use ddtree_engine::spec::{DFlashDrafter, Noisy, Oracle};
use ddtree_engine::{
    generate_plain, generate_speculative, ActivationPrecision, Backend, Budget, CpuBackend, CudaBackend, CudaOptions,
    Drafter, GenerateOptions, Model, SpecOptions, SpecStats,
};

/// The agreement the GPU is held to against the f32 CPU. On the H200 the bf16 backend measures
/// 97.0% (tiny-kimi) and 92.7% (tiny-dsv3, group-limited routing): the rows that differ are near
/// ties of the CPU's own top two or follow a routed-expert choice that flipped on a near tie of
/// the router scores (the largest logit errors). BENCHMARKS.md has the numbers.
const AGREEMENT_FLOOR: f64 = 0.90;

/// The agreement the GPU is held to against the CPU in bf16 mode, which rounds where the GPU
/// stores bf16 and so differs from it only in summation order: the goal. On the H200
/// both fixtures measure 100% (max |logit error| 0.20 and 0.094; BENCHMARKS.md); the bf16-mode
/// CPU itself agrees with the f32 CPU at the GPU's rates (tests/bf16_mirror.rs).
const AGREEMENT_GOAL: f64 = 0.99;

fn gpu() -> Option<CudaBackend> {
    match CudaBackend::open(CudaOptions::default()) {
        Ok(b) => Some(b),
        Err(e) => {
            assert!(
                std::env::var("DDTREE_REQUIRE_GPU").is_err(),
                "DDTREE_REQUIRE_GPU is set but the CUDA backend did not open: {e}"
            );
            eprintln!("SKIP: no GPU ({e})");
            None
        }
    }
}

/// Every round of `stats` read back exactly `reads` times from the GPU (build to accept).
fn assert_reads(stats: &SpecStats, reads: u64, case: &str) {
    assert_eq!(
        stats.round_host_reads.len(),
        stats.rounds,
        "{case}: rounds without a read count"
    );
    assert!(
        stats.round_host_reads.iter().all(|&r| r == reads),
        "{case}: reads per round {:?}, expected {reads}",
        stats.round_host_reads
    );
}

#[test]
fn gpu_agrees_with_cpu_teacher_forced() {
    let Some(_) = gpu() else { return };
    let mut results = Vec::new();
    for name in ["tiny-kimi", "tiny-dsv3"] {
        let f32_cpu = load(CpuBackend::default(), name);
        let bf16_cpu = load(CpuBackend::new(ActivationPrecision::Bf16), name);
        let cuda = load(gpu().unwrap(), name);
        let (mut vs_f32, mut vs_bf16) = (Agreement::default(), Agreement::default());
        let f32_label = format!("{name}: GPU vs f32 CPU");
        let bf16_label = format!("{name}: GPU vs bf16-mirror CPU");
        for seq in sequences(&f32_cpu) {
            let got = teacher_forced(&cuda, &seq);
            vs_f32.add(&f32_label, seq.len(), &teacher_forced(&f32_cpu, &seq), &got);
            vs_bf16.add(&bf16_label, seq.len(), &teacher_forced(&bf16_cpu, &seq), &got);
        }
        eprintln!("{}", vs_f32.line(&f32_label));
        eprintln!("{}", vs_bf16.line(&bf16_label));
        results.push((f32_label, vs_f32.rate(), AGREEMENT_FLOOR));
        results.push((bf16_label, vs_bf16.rate(), AGREEMENT_GOAL));
    }
    for (label, rate, floor) in results {
        assert!(
            rate >= floor,
            "{label}: top-1 agreement {:.1}% < {:.0}%",
            100.0 * rate,
            100.0 * floor
        );
    }
}

#[test]
fn ddtree_equals_plain_greedy_on_the_gpu() {
    let Some(b) = gpu() else { return };
    let model = load(b, "tiny-kimi");
    let cpu = load(CpuBackend::default(), "tiny-kimi");
    let opts = GenerateOptions {
        max_new_tokens: 24,
        ..GenerateOptions::default()
    };
    let prompts: [&[u32]; 3] = [&[5, 17], &[100, 200, 300], &[42; 9]];
    let (mut same_as_cpu, mut runs) = (0, 0);
    for prompt in prompts {
        let plain = generate_plain(&model, prompt, &opts).unwrap().tokens;
        same_as_cpu += usize::from(generate_plain(&cpu, prompt, &opts).unwrap().tokens == plain);
        for block in [4, 8] {
            for budget in [1, 3, 8, 32] {
                for kind in 0..3 {
                    let mut drafter: Box<dyn Drafter<CudaBackend>> = match kind {
                        0 => Box::new(Oracle::new(block).unwrap()),
                        1 => Box::new(Noisy::new(block, 0.7, 3).unwrap()),
                        _ => Box::new(Noisy::new(block, 0.2, 9).unwrap()),
                    };
                    let spec = if budget == 32 && kind == 1 {
                        SpecOptions::auto(None)
                    } else {
                        SpecOptions::fixed(budget)
                    };
                    let out = generate_speculative(&model, drafter.as_mut(), prompt, &opts, &spec).unwrap();
                    let case = format!("prompt {prompt:?} block {block} budget {budget} drafter {kind}");
                    assert_eq!(out.generation.tokens, plain, "{case}");
                    // A fixed-budget greedy round reads back its accept result only; `auto`
                    // also reads the built tree's path log-probs to pick its budget.
                    let reads = if spec.budget == Budget::Auto { 2 } else { 1 };
                    assert_reads(&out.stats, reads, &case);
                    runs += 1;
                }
            }
        }
    }
    eprintln!(
        "DDTree == plain greedy on the GPU in {runs} runs; GPU plain == CPU plain on {same_as_cpu}/{} prompts",
        prompts.len()
    );
}

/// The kernel, and the size fields (rows, tokens, depth, budget, keys) of a lookup's bucketed key: the
/// run below exercises a plan key when it looked up the same kernel at the same sizes.
fn size_tag((kernel, key): &(&'static str, String)) -> String {
    let sizes: Vec<&str> = key
        .split(' ')
        .filter(|f| {
            ["rows=", "tokens=", "depth=", "budget=", "m=", "keys="]
                .iter()
                .any(|p| f.starts_with(p))
        })
        .collect();
    format!("{kernel} {}", sizes.join(" "))
}

/// Every tune-cache lookup the backend makes in plain decoding and in DDTree rounds (fixed
/// budgets and `auto`; a verify of 33 rows takes the tuned argmax) is a key of the autotune
/// plan; and every plan key at the kernel and sizes the run exercised was looked up (the plan
/// holds nothing the backend does not launch).
#[test]
fn backend_lookups_are_the_plan() {
    let Some(b) = gpu() else { return };
    b.record_lookups(true);
    let model = load(b, "tiny-kimi");
    let opts = GenerateOptions {
        max_new_tokens: 24,
        ..GenerateOptions::default()
    };
    let prompt: Vec<u32> = (0..40).map(|i| 5 + 7 * i).collect();
    generate_plain(&model, &prompt, &opts).unwrap();
    for spec in [SpecOptions::fixed(8), SpecOptions::fixed(32), SpecOptions::auto(None)] {
        let mut drafter = Noisy::new(8, 0.7, 3).unwrap();
        generate_speculative(&model, &mut drafter, &prompt, &opts, &spec).unwrap();
    }
    let made: std::collections::HashSet<_> = model.backend().lookups_made().iter().map(|l| l.bucket()).collect();
    let fp = model.backend().gpu().fingerprint();
    let dims = ddtree_engine::tuning::ModelDims::from_config("tiny-kimi".into(), model.config()).on_gpu(
        fp.sm_count as usize,
        ddtree_kernels::wgmma_supported(fp.compute_capability),
    );
    let plan: std::collections::HashSet<_> =
        ddtree_engine::tuning::lookups(&dims, ddtree_engine::tuning::STARTUP_MAX_M)
            .iter()
            .map(|l| l.bucket())
            .collect();
    let mut missing: Vec<_> = made.iter().filter(|l| !plan.contains(*l)).collect();
    missing.sort();
    assert!(missing.is_empty(), "looked up but not in the plan: {missing:?}");
    let seen: std::collections::HashSet<String> = made.iter().map(size_tag).collect();
    let mut unused: Vec<_> = plan
        .iter()
        .filter(|l| seen.contains(&size_tag(l)) && !made.contains(*l))
        .collect();
    unused.sort();
    assert!(
        unused.is_empty(),
        "in the plan but never looked up at sizes the run used: {unused:?}"
    );
    eprintln!("{} distinct tune-cache lookups, all in the plan", made.len());
}

#[test]
fn dflash_drafter_on_the_gpu_matches_plain_greedy() {
    let Some(b) = gpu() else { return };
    let model = load(b, "tiny-kimi");
    let mut drafter = DFlashDrafter::load(&model, &fixture("tiny-dflash"), Some(4)).unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 16,
        ..GenerateOptions::default()
    };
    let plain = generate_plain(&model, &[5, 17], &opts).unwrap().tokens;
    let out = generate_speculative(&model, &mut drafter, &[5, 17], &opts, &SpecOptions::fixed(8)).unwrap();
    assert_eq!(out.generation.tokens, plain);
    eprintln!(
        "DFlash on the GPU: {} rounds, mean acceptance {:.2}",
        out.stats.rounds,
        out.stats.mean_accept_len()
    );
}

/// Greedy forwards replayed from CUDA graphs give the tokens of eager forwards: plain decoding
/// and DDTree verification (a graph per tree size), on a fixture whose every op can be
/// recorded (tiny-kimi) and on one whose half-split rope cannot (tiny-dsv3: eager fallback).
#[test]
fn cuda_graph_replays_equal_eager_forwards() {
    let Some(b) = gpu() else { return };
    let eager = CudaBackend::open(CudaOptions {
        no_graphs: true,
        ..CudaOptions::default()
    })
    .unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 24,
        ..GenerateOptions::default()
    };
    let graphs = load(b, "tiny-kimi");
    let eager = load(eager, "tiny-kimi");
    for prompt in [&[5u32, 17][..], &[42; 9]] {
        let want = generate_plain(&eager, prompt, &opts).unwrap().tokens;
        assert_eq!(
            generate_plain(&graphs, prompt, &opts).unwrap().tokens,
            want,
            "plain {prompt:?}"
        );
        for budget in [3, 8] {
            let mut drafter = Noisy::new(4, 0.7, 5).unwrap();
            let spec = SpecOptions::fixed(budget);
            let out = generate_speculative(&graphs, &mut drafter, prompt, &opts, &spec).unwrap();
            assert_eq!(out.generation.tokens, want, "DDTree {prompt:?} budget {budget}");
        }
    }
    let (replays, recordings) = graphs.backend().graph_counts().unwrap();
    assert!(
        replays > 0 && recordings > 0,
        "no forward was replayed ({replays}, {recordings})"
    );
    assert_eq!(eager.backend().graph_counts(), Some((0, 0)));
    let dsv3 = load(CudaBackend::open(CudaOptions::default()).unwrap(), "tiny-dsv3");
    let dsv3_eager = CudaBackend::open(CudaOptions {
        no_graphs: true,
        ..CudaOptions::default()
    })
    .unwrap();
    let dsv3_eager = load(dsv3_eager, "tiny-dsv3");
    let tokens = generate_plain(&dsv3, &[5, 17], &opts).unwrap().tokens;
    assert_eq!(tokens, generate_plain(&dsv3_eager, &[5, 17], &opts).unwrap().tokens);
    assert_eq!(
        dsv3.backend().graph_counts().unwrap().0,
        0,
        "half-split rope must not be replayed"
    );
    eprintln!("CUDA graphs: {replays} replays of {recordings} recordings == eager on tiny-kimi; tiny-dsv3 eager");
}

/// Greedy fixed-budget DDTree keeps the tree on the GPU: build, staging into the verify step's
/// inputs, verify, accept and compaction, then one read of the accept result per round. Checked
/// with CUDA graphs (the verify replayed from the device-written staging buffers) and without
/// (eager forwards), on tiny-kimi and on tiny-dsv3 (its half-split rope runs eagerly), at
/// budgets up to a tree that takes every prefix (block 2: one drafted position; budget 600 over
/// a vocabulary of 512 gives 512 nodes besides the root, a size the host knows without reading
/// the tree). The tokens equal plain greedy decoding's.
#[test]
fn device_tree_rounds_read_back_once_per_round_and_equal_plain_greedy() {
    let Some(_) = gpu() else { return };
    let opts = GenerateOptions {
        max_new_tokens: 24,
        ..GenerateOptions::default()
    };
    for name in ["tiny-kimi", "tiny-dsv3"] {
        for no_graphs in [false, true] {
            let b = CudaBackend::open(CudaOptions {
                no_graphs,
                ..CudaOptions::default()
            })
            .unwrap();
            let model = load(b, name);
            let mut replays = 0;
            for prompt in [&[5u32, 17][..], &[42; 9]] {
                let plain = generate_plain(&model, prompt, &opts).unwrap().tokens;
                let before = model.backend().graph_counts().unwrap().0;
                for (block, budget) in [(4, 1), (4, 3), (8, 8), (8, 32), (2, 600)] {
                    let mut drafter = Noisy::new(block, 0.7, 5).unwrap();
                    let spec = SpecOptions::fixed(budget);
                    let out = generate_speculative(&model, &mut drafter, prompt, &opts, &spec).unwrap();
                    let case = format!(
                        "{name} graphs {} prompt {prompt:?} block {block} budget {budget}",
                        !no_graphs
                    );
                    assert_eq!(out.generation.tokens, plain, "{case}");
                    assert!(out.stats.rounds > 0, "{case}: no rounds");
                    assert_reads(&out.stats, 1, &case);
                    let nodes = if block == 2 { 512 } else { budget };
                    assert!(
                        out.stats.budgets.iter().all(|&n| n == nodes),
                        "{case}: tree sizes {:?}, expected {nodes}",
                        out.stats.budgets
                    );
                }
                replays += model.backend().graph_counts().unwrap().0 - before;
            }
            if name == "tiny-kimi" && !no_graphs {
                assert!(replays > 0, "{name}: no device-staged verify was replayed");
            } else {
                assert_eq!(replays, 0, "{name} graphs {}: replays", !no_graphs);
            }
            eprintln!(
                "{name}, graphs {}: device tree rounds == plain greedy, one read per round ({replays} replays)",
                !no_graphs
            );
        }
    }
}

/// `got` against `want` within `steps` bf16 rounding steps of `want` (plus a floor scaled by
/// `want`'s RMS, for sums that cancel); returns the share of bit-identical values. NaN fails.
fn assert_within_bf16_steps(got: &[f32], want: &[f32], steps: f32, case: &str) -> f64 {
    assert_eq!(got.len(), want.len(), "{case}: lengths");
    let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len().max(1) as f32).sqrt();
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = steps * w.abs() / 128.0 + 1e-3 * rms;
        assert!((g - w).abs() <= tol, "{case}: element {i} is {g}, unfused {w}");
    }
    got.iter().zip(want).filter(|(g, w)| g.to_bits() == w.to_bits()).count() as f64 / got.len().max(1) as f64
}

/// The fused decode ops against the ops they replace, on the GPU at Kimi K2.6 shapes and at a
/// tiny one: `gate_up_silu` (one GEMV over both weights, split-K for the shared expert's 2048
/// columns, per column for the dense MLP's 18432) against two `linear`s and `silu_mul`, within
/// one bf16 step (a gate or up sum may round the other way with another summation order); and
/// `add2_rms_norm` against `add_assign` then `add_rms_norm`: the f32 residual stream bit for
/// bit, the normalized rows within one bf16 step. The share of bit-identical outputs is printed.
#[test]
fn fused_decode_ops_equal_the_ops_they_replace() {
    let Some(b) = gpu() else { return };
    let mut seed = 0;
    let mut next = || {
        seed += 1;
        seed
    };
    for (n, k) in [(2048, 7168), (18432, 7168), (96, 64)] {
        let gate = b.random_weight(n, k, None, next()).unwrap();
        let up = b.random_weight(n, k, None, next()).unwrap();
        for rows in 1..=4 {
            let x = b.random_matrix(rows, k, next()).unwrap();
            let fused = b.to_host(&b.gate_up_silu(&x, &gate, &up).unwrap()).unwrap();
            let g = b.linear(&x, &gate).unwrap();
            let u = b.linear(&x, &up).unwrap();
            let want = b.to_host(&b.silu_mul(&g, &u).unwrap()).unwrap();
            let case = format!("gate_up_silu {k}->{n}, {rows} rows");
            let same = assert_within_bf16_steps(&fused.data, &want.data, 1.0, &case);
            eprintln!("{case}: {:.2}% bit-identical to the unfused ops", 100.0 * same);
        }
    }
    for (rows, n) in [(1, 7168), (4, 7168), (3, 64), (40, 7168)] {
        let stream = || b.residual(b.random_matrix(rows, n, 100).unwrap()).unwrap();
        let (mut fused_x, mut want_x) = (stream(), stream());
        let routed = || b.random_matrix(rows, n, 101).unwrap();
        let shared = b.random_matrix(rows, n, 102).unwrap();
        let weight = b.random_vector(n, 0.5, 1.5, 103).unwrap();
        let fused = b.add2_rms_norm(&mut fused_x, routed(), &shared, &weight, 1e-6).unwrap();
        let mut sum = routed();
        b.add_assign(&mut sum, &shared).unwrap();
        let want = b.add_rms_norm(&mut want_x, &sum, &weight, 1e-6).unwrap();
        let case = format!("add2_rms_norm {rows}x{n}");
        let (fx, wx) = (b.to_host(&fused_x).unwrap(), b.to_host(&want_x).unwrap());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fx.data), bits(&wx.data), "{case}: the residual stream differs");
        let (f, w) = (b.to_host(&fused).unwrap(), b.to_host(&want).unwrap());
        let same = assert_within_bf16_steps(&f.data, &w.data, 1.0, &case);
        eprintln!("{case}: stream bit-identical, {:.2}% of the normed rows", 100.0 * same);
    }
}

/// A dense INT4 `linear` gives the same rows whichever kernel the row count picks (the GEMV up
/// to 16 rows, the mma.sync tile GEMM, and on sm_90 the `wgmma` GEMM from
/// `gemm_wg::WG_MIN_ROWS` rows): every product against the GEMV's, eight rows at a time, within
/// two bf16 steps (the sums run in another order). NaN fails.
#[test]
fn int4_linear_agrees_across_its_kernels() {
    let Some(b) = gpu() else { return };
    for (n, k) in [(2048, 7168), (264, 384)] {
        let w = b.random_weight(n, k, Some(32), 7).unwrap();
        for rows in [17, 47, 48, 64, 130] {
            let x = b.random_matrix(rows, k, rows as u64).unwrap();
            let got = b.to_host(&b.linear(&x, &w).unwrap()).unwrap();
            let mut want = Vec::with_capacity(rows * n);
            for lo in (0..rows).step_by(8) {
                let idx: Vec<usize> = (lo..rows.min(lo + 8)).collect();
                let part = b.linear(&b.take_rows(&x, &idx).unwrap(), &w).unwrap();
                want.extend(b.to_host(&part).unwrap().data);
            }
            let case = format!("int4 linear {k}->{n}, {rows} rows");
            let same = assert_within_bf16_steps(&got.data, &want, 2.0, &case);
            eprintln!("{case}: {:.2}% bit-identical to the GEMV's rows", 100.0 * same);
        }
    }
}

/// Forwards with concurrent branches (the shared experts beside the routed ones, the latent path
/// beside the query path, on a second stream) and with programmatic dependent launch give the
/// logits of one-stream forwards without it bit for bit (the same kernels, only their order and
/// overlap change), teacher-forced on both fixtures, and the same greedy tokens with CUDA
/// graphs recorded across both streams; both features are also checked alone.
#[test]
fn branches_and_pdl_equal_one_stream_without_pdl() {
    let Some(b) = gpu() else { return };
    let open = |one_stream, no_pdl| {
        CudaBackend::open(CudaOptions {
            one_stream,
            no_pdl,
            ..CudaOptions::default()
        })
        .unwrap()
    };
    let bits = |rows: Vec<Vec<f32>>| -> Vec<Vec<u32>> {
        rows.iter().map(|r| r.iter().map(|v| v.to_bits()).collect()).collect()
    };
    let mut first = Some(b);
    for name in ["tiny-kimi", "tiny-dsv3"] {
        let single = load(open(true, true), name);
        for (what, subject) in [
            (
                "two streams + PDL",
                load(first.take().unwrap_or_else(|| gpu().unwrap()), name),
            ),
            ("two streams", load(open(false, true), name)),
            ("one stream + PDL", load(open(true, false), name)),
        ] {
            let case = format!("{name} ({what})");
            for seq in sequences(&single) {
                let want = bits(teacher_forced(&single, &seq));
                assert!(
                    want.iter().flatten().all(|&v| f32::from_bits(v).is_finite()),
                    "{case}: NaN logits"
                );
                assert_eq!(bits(teacher_forced(&subject, &seq)), want, "{case}: logits of {seq:?}");
            }
            check_greedy(&single, &subject, &case);
            eprintln!(
                "{case}: forwards == one-stream forwards without PDL bit for bit ({} graph replays)",
                subject.backend().graph_counts().unwrap().0
            );
        }
    }
}

/// `subject` generates `reference`'s plain greedy tokens, plainly and with DDTree.
fn check_greedy(reference: &Model<CudaBackend>, subject: &Model<CudaBackend>, case: &str) {
    let opts = GenerateOptions {
        max_new_tokens: 24,
        ..GenerateOptions::default()
    };
    for prompt in [&[5u32, 17][..], &[42; 9]] {
        let want = generate_plain(reference, prompt, &opts).unwrap().tokens;
        assert_eq!(
            generate_plain(subject, prompt, &opts).unwrap().tokens,
            want,
            "{case} plain {prompt:?}"
        );
        let mut drafter = Noisy::new(8, 0.7, 5).unwrap();
        let out = generate_speculative(subject, &mut drafter, prompt, &opts, &SpecOptions::fixed(8)).unwrap();
        assert_eq!(out.generation.tokens, want, "{case} DDTree {prompt:?}");
    }
}
