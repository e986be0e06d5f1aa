//! DDTree speculative decoding reproduces plain greedy decoding token for token, for every
//! drafter, budget and block size, including runs that end inside an accepted path (token limit,
//! stop token, context end), and for the cost-aware `auto` budget under any cost model.

use ddtree_engine::spec::{CostModel, Noisy, Oracle, SpecStats};
use ddtree_engine::{
    generate_plain, generate_speculative, tiny, ActivationPrecision, CpuBackend, Drafter, GenerateOptions, LoadOptions,
    Model, SpecOptions, StopReason,
};

fn model() -> Model<CpuBackend> {
    tiny::kimi::load(CpuBackend::default(), LoadOptions::default()).unwrap()
}

/// Prompts of assorted lengths and token ranges (vocab 512).
fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![0],
        vec![5, 17],
        vec![100, 200, 300],
        vec![511, 0, 7, 7, 7],
        vec![42; 9],
        (1..14).map(|i| i * 37 % 512).collect(),
    ]
}

fn drafter(kind: usize, block_size: usize) -> Box<dyn Drafter<CpuBackend>> {
    match kind {
        0 => Box::new(Oracle::new(block_size).unwrap()),
        1 => Box::new(Noisy::new(block_size, 0.8, 7).unwrap()),
        2 => Box::new(Noisy::new(block_size, 0.4, 11).unwrap()),
        _ => Box::new(Noisy::new(block_size, 0.0, 3).unwrap()),
    }
}

fn plain(model: &Model<CpuBackend>, prompt: &[u32], options: &GenerateOptions) -> (Vec<u32>, StopReason) {
    let out = generate_plain(model, prompt, options).unwrap();
    (out.tokens, out.stop_reason)
}

fn speculative(
    model: &Model<CpuBackend>,
    drafter: &mut dyn Drafter<CpuBackend>,
    prompt: &[u32],
    options: &GenerateOptions,
    budget: usize,
) -> (Vec<u32>, StopReason) {
    let (tokens, stop, stats) = speculative_with(model, drafter, prompt, options, &SpecOptions::fixed(budget));
    assert!(!stats.budget_auto && stats.budget_mode == "fixed");
    assert!(stats.budgets.iter().all(|&b| b <= budget));
    (tokens, stop)
}

fn speculative_with(
    model: &Model<CpuBackend>,
    drafter: &mut dyn Drafter<CpuBackend>,
    prompt: &[u32],
    options: &GenerateOptions,
    spec: &SpecOptions,
) -> (Vec<u32>, StopReason, SpecStats) {
    let out = generate_speculative(model, drafter, prompt, options, spec).unwrap();
    let stats = out.stats;
    assert_eq!(stats.rounds, stats.accept_lengths.len());
    assert_eq!(stats.rounds, stats.budgets.len());
    assert_eq!(stats.target_forwards, stats.rounds + 1);
    assert_eq!(stats.verified_nodes, stats.rounds + stats.budgets.iter().sum::<usize>());
    assert!(stats.budgets.iter().all(|&b| b <= stats.budget));
    assert!(stats
        .accept_lengths
        .iter()
        .zip(&stats.budgets)
        .all(|(&a, &b)| a >= 1 && a <= drafter.block_size() && a <= b + 1));
    (out.generation.tokens, out.generation.stop_reason, stats)
}

/// Cost models from "nodes are free" to "a node costs a whole round", and the fallback.
fn cost_models() -> Vec<(&'static str, Option<CostModel>)> {
    let flat = CostModel::new("flat", 10.0, 1.0, 1.0, &[(1, 1000.0), (512, 1000.0)]).unwrap();
    let gpu = CostModel::new(
        "gpu",
        100.0,
        5.0,
        5.0,
        &[(1, 1000.0), (32, 1010.0), (64, 1040.0), (128, 1700.0)],
    )
    .unwrap();
    let steep = CostModel::new("steep", 0.0, 0.0, 0.0, &[(1, 1000.0), (2, 2000.0)]).unwrap();
    vec![
        ("fallback", None),
        ("flat", Some(flat)),
        ("gpu", Some(gpu)),
        ("steep", Some(steep)),
    ]
}

#[test]
fn greedy_equals_plain_for_every_drafter_budget_and_block_size() {
    let model = model();
    let budgets = [1, 2, 3, 5, 8, 13, 16, 40];
    let mut case = 0usize;
    for prompt in prompts() {
        let options = GenerateOptions {
            max_new_tokens: 10,
            ..Default::default()
        };
        let expected = plain(&model, &prompt, &options);
        for block_size in [8, 16] {
            for kind in 0..4 {
                // Cycle the budgets over the prompts so every (drafter, block, budget) occurs.
                let budget = budgets[case % budgets.len()];
                case += 1;
                let mut d = drafter(kind, block_size);
                let got = speculative(&model, d.as_mut(), &prompt, &options, budget);
                assert_eq!(
                    got,
                    expected,
                    "prompt {prompt:?}, {}, block {block_size}, budget {budget}",
                    d.name()
                );
            }
        }
    }
}

/// The same with the CPU in bf16 mode (the GPU's rounding). Only up to near ties: the verify
/// forward's rows take the rounding of the GPU's many-token MoE kernels, the decode step's single
/// row that of its small-token ones (as on the GPU), and for the tiny model the prompt
/// `(1..14) * 37 % 512` does flip (with every test drafter, block size and budget tried).
#[test]
fn greedy_equals_plain_in_bf16_mode() {
    let model = tiny::kimi::load(CpuBackend::new(ActivationPrecision::Bf16), LoadOptions::default()).unwrap();
    let options = GenerateOptions {
        max_new_tokens: 16,
        ..Default::default()
    };
    for prompt in [vec![5, 17], vec![42; 9]] {
        let expected = plain(&model, &prompt, &options);
        for (kind, budget) in [(0, 8), (1, 3), (2, 16), (3, 40)] {
            let mut d = drafter(kind, 8);
            let got = speculative(&model, d.as_mut(), &prompt, &options, budget);
            assert_eq!(got, expected, "prompt {prompt:?}, {}, budget {budget}", d.name());
        }
    }
}

#[test]
fn every_budget_from_1_to_256_matches() {
    let model = model();
    let prompt = [7, 300, 12];
    let options = GenerateOptions {
        max_new_tokens: 8,
        ..Default::default()
    };
    let expected = plain(&model, &prompt, &options);
    let mut d = Noisy::new(8, 0.5, 5).unwrap();
    for budget in (1..=9).chain([16, 31, 64, 128, 256]) {
        assert_eq!(
            speculative(&model, &mut d, &prompt, &options, budget),
            expected,
            "budget {budget}"
        );
    }
}

#[test]
fn token_limits_inside_an_accepted_path() {
    let model = model();
    let prompt = [9, 8, 7];
    let mut oracle = Oracle::new(16).unwrap();
    for max_new_tokens in 1..=19 {
        let options = GenerateOptions {
            max_new_tokens,
            ..Default::default()
        };
        let expected = plain(&model, &prompt, &options);
        assert_eq!(expected.0.len(), max_new_tokens);
        // The oracle accepts whole blocks, so most limits fall inside an accepted path.
        assert_eq!(
            speculative(&model, &mut oracle, &prompt, &options, 4),
            expected,
            "max {max_new_tokens}"
        );
    }
}

#[test]
fn stop_tokens_inside_an_accepted_path() {
    let model = model();
    for prompt in prompts().into_iter().take(3) {
        let free = plain(
            &model,
            &prompt,
            &GenerateOptions {
                max_new_tokens: 12,
                ..Default::default()
            },
        )
        .0;
        let mut stops = free[1..].to_vec();
        stops.dedup();
        for &stop in stops.iter().step_by(4) {
            let options = GenerateOptions {
                max_new_tokens: 12,
                stop_tokens: vec![stop],
                ..Default::default()
            };
            let expected = plain(&model, &prompt, &options);
            assert_eq!(expected.1, StopReason::StopToken);
            for (kind, budget) in [(0, 3), (1, 16)] {
                let mut d = drafter(kind, 8);
                let got = speculative(&model, d.as_mut(), &prompt, &options, budget);
                assert_eq!(got, expected, "prompt {prompt:?}, stop {stop}, {}", d.name());
            }
        }
    }
}

#[test]
fn context_end_caps_the_tree_depth() {
    let mut cfg = tiny::kimi::config().unwrap();
    cfg.max_position_embeddings = 11;
    let model = Model::load(
        CpuBackend::default(),
        cfg,
        &tiny::kimi::checkpoint().unwrap(),
        LoadOptions::default(),
        &mut |_, _| {},
    )
    .unwrap();
    for prompt_len in [1, 4, 10] {
        let prompt = vec![5; prompt_len];
        let options = GenerateOptions {
            max_new_tokens: 30,
            ..Default::default()
        };
        let expected = plain(&model, &prompt, &options);
        assert_eq!(expected.1, StopReason::ContextFull);
        let mut oracle = Oracle::new(8).unwrap();
        assert_eq!(speculative(&model, &mut oracle, &prompt, &options, 20), expected);
        let mut noisy = Noisy::new(8, 0.6, 4).unwrap();
        let (tokens, stop, _) = speculative_with(&model, &mut noisy, &prompt, &options, &SpecOptions::auto(None));
        assert_eq!((tokens, stop), expected);
    }
}

#[test]
fn auto_budget_equals_plain_for_every_drafter_and_cost_model() {
    let model = model();
    for (p, prompt) in prompts().into_iter().enumerate() {
        let options = GenerateOptions {
            max_new_tokens: 10,
            ..Default::default()
        };
        let expected = plain(&model, &prompt, &options);
        for (c, (name, cost)) in cost_models().into_iter().enumerate() {
            // Every cost model meets every drafter, both block sizes and most caps.
            let (kind, block_size, max) = ((p + c) % 4, [8, 16][p % 2], [256, 40, 7, 1][(p / 2 + c) % 4]);
            let mut d = drafter(kind, block_size);
            // Half the runs with the calibrated gain: it moves the choice, never the tokens.
            let calibrate = (p + c) % 2 == 1;
            let spec = SpecOptions {
                max_auto_budget: max,
                calibrate,
                ..SpecOptions::auto(cost.clone())
            };
            let (tokens, stop, stats) = speculative_with(&model, d.as_mut(), &prompt, &options, &spec);
            let what = format!(
                "prompt {prompt:?}, {}, block {block_size}, cost {name}, max {max}, calibrate {calibrate}",
                d.name()
            );
            assert_eq!((tokens, stop), expected, "{what}");
            assert!(stats.budget_auto && stats.budget == max, "{what}");
            assert!(stats.budgets.iter().all(|&b| b >= 1), "{what}: {:?}", stats.budgets);
            match name {
                "fallback" => assert!(stats.budget_mode.starts_with("auto: no measured cost model"), "{what}"),
                _ => assert_eq!(
                    stats.budget_mode,
                    format!("auto: measured cost model ({name})"),
                    "{what}"
                ),
            }
            if name == "steep" {
                assert!(stats.budgets.iter().all(|&b| b == 1), "{what}: {:?}", stats.budgets);
            }
        }
    }
}

#[test]
fn auto_budget_follows_the_drafter_and_the_cost() {
    let model = model();
    let options = GenerateOptions {
        max_new_tokens: 24,
        ..Default::default()
    };
    let prompt = [7, 300, 12];
    let expected = plain(&model, &prompt, &options);
    let run = |d: &mut dyn Drafter<CpuBackend>, cost: Option<CostModel>| {
        let (tokens, stop, stats) = speculative_with(&model, d, &prompt, &options, &SpecOptions::auto(cost));
        assert_eq!((tokens, stop), expected);
        stats
    };
    let costs = cost_models();
    let gpu = costs[2].1.clone();
    // The oracle is near-certain: its chain of 7 nodes is all the tree worth verifying, and the
    // verify costs the same within 1% up to 32 tokens (`FLAT_TOLERANCE`): the end of that flat
    // stretch is taken.
    let s = run(&mut Oracle::new(8).unwrap(), gpu.clone());
    assert!(s.budgets.iter().all(|&b| b == 31), "{:?}", s.budgets);
    assert!(s.accept_lengths.iter().all(|&a| a == 8));
    // A noisy drafter spreads its mass: wider trees where they are cheap, narrow where not.
    let flat = run(&mut Noisy::new(8, 0.5, 5).unwrap(), costs[1].1.clone());
    let steep = run(&mut Noisy::new(8, 0.5, 5).unwrap(), costs[3].1.clone());
    let mid = run(&mut Noisy::new(8, 0.5, 5).unwrap(), gpu);
    assert!(
        flat.mean_budget() > mid.mean_budget() && mid.mean_budget() > steep.mean_budget(),
        "flat {:.1}, gpu {:.1}, steep {:.1}",
        flat.mean_budget(),
        mid.mean_budget(),
        steep.mean_budget()
    );
    assert_eq!(steep.mean_budget(), 1.0);
    // An invalid cost model is an error, not a panic.
    let mut bad = CostModel::fallback();
    bad.verify.clear();
    let err = generate_speculative(
        &model,
        &mut Oracle::new(8).unwrap(),
        &prompt,
        &options,
        &SpecOptions::auto(Some(bad)),
    );
    assert!(err.unwrap_err().to_string().contains("no verify latency points"));
}

#[test]
fn oracle_accepts_whole_blocks() {
    let model = model();
    let options = GenerateOptions {
        max_new_tokens: 33,
        ..Default::default()
    };
    let mut oracle = Oracle::new(8).unwrap();
    let spec = SpecOptions::fixed(7);
    let out = generate_speculative(&model, &mut oracle, &[1, 2, 3], &options, &spec).unwrap();
    assert_eq!(out.stats.budgets, vec![7; 4]);
    // 1 token from the prefill, then 8 per round (7 drafted + the bonus).
    assert_eq!(out.stats.accept_lengths, vec![8; 4]);
    assert_eq!(out.stats.mean_accept_len(), 8.0);
    assert_eq!(out.stats.tokens_per_target_forward(), 33.0 / 5.0);
}

#[test]
fn wider_trees_recover_noisy_drafts() {
    // A wrong top token keeps the oracle token at rank 1..=8, where a wider tree finds it.
    let model = model();
    let options = GenerateOptions {
        max_new_tokens: 24,
        ..Default::default()
    };
    let mean_accept = |budget: usize| {
        let mut d = Noisy::new(8, 0.3, 21).unwrap();
        let spec = SpecOptions::fixed(budget);
        generate_speculative(&model, &mut d, &[4, 44], &options, &spec)
            .unwrap()
            .stats
            .mean_accept_len()
    };
    let (narrow, wide) = (mean_accept(7), mean_accept(96));
    assert!(
        wide > narrow + 0.5,
        "mean acceptance: budget 7 {narrow:.2}, budget 96 {wide:.2}"
    );
}
