//! Speculative sampling is lossless: it reproduces plain sampling with the same seed token for
//! token (the noise is keyed by position), and its token distribution matches the target's
//! (a chi-square test against probabilities computed from the model).

use std::collections::HashMap;

use ddtree_engine::spec::{Noisy, Oracle};
use ddtree_engine::{
    generate_plain, generate_speculative, tiny, Backend, CpuBackend, Drafter, ForwardInput, GenerateOptions,
    LoadOptions, LogitRows, Model, Sampling, SpecOptions,
};

fn model() -> Model<CpuBackend> {
    tiny::kimi::load(CpuBackend::default(), LoadOptions::default()).unwrap()
}

fn spec(budget: usize) -> SpecOptions {
    SpecOptions::fixed(budget)
}

#[test]
fn sampled_output_equals_plain_sampling_with_the_same_seed() {
    let model = model();
    let cases = [(1.0, 1.0, 1), (0.7, 0.9, 2), (1.3, 0.5, 3), (0.4, 1.0, 4)];
    for (i, &(temperature, top_p, seed)) in cases.iter().enumerate() {
        let options = GenerateOptions {
            max_new_tokens: 12,
            sampling: Sampling {
                temperature,
                top_p,
                seed,
            },
            ..Default::default()
        };
        let prompt = [3 + i as u32, 40, 400];
        let expected = generate_plain(&model, &prompt, &options).unwrap().tokens;
        let mut drafters: Vec<Box<dyn Drafter<CpuBackend>>> = vec![
            Box::new(Oracle::new(8).unwrap()),
            Box::new(Noisy::new(16, 0.6, seed).unwrap()),
            Box::new(Noisy::new(8, 0.5, seed + 9).unwrap()),
        ];
        for (d, spec) in drafters.iter_mut().zip([spec(6), spec(40), SpecOptions::auto(None)]) {
            let out = generate_speculative(&model, d.as_mut(), &prompt, &options, &spec).unwrap();
            assert_eq!(
                out.generation.tokens,
                expected,
                "T {temperature}, top-p {top_p}, {}",
                d.name()
            );
        }
    }
}

/// `softmax(logits / t)` in f64.
fn probs(logits: &[f32], t: f64) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = logits.iter().map(|&x| ((x as f64 - max) / t).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|v| v / z).collect()
}

fn next_probs(model: &Model<CpuBackend>, ids: &[u32], t: f64) -> Vec<f64> {
    let mut cache = model.new_cache(ids.len()).unwrap();
    let positions: Vec<u32> = (0..ids.len() as u32).collect();
    let input = ForwardInput {
        tokens: ids,
        positions: &positions,
        mask: None,
        logits: LogitRows::Last,
    };
    probs(
        &CpuBackend::default()
            .to_host(&model.forward(&mut cache, input).unwrap())
            .unwrap()
            .data,
        t,
    )
}

#[test]
fn sampled_pairs_follow_the_target_distribution() {
    // The first token comes from the prefill, the second from the tree verify: the joint of the
    // pair over 600 seeds against P(t0) P(t1 | t0) from the model.
    let model = model();
    let prompt = [11u32, 22];
    let t = 1.5;
    let runs = 600;
    let mut counts: HashMap<(u32, u32), usize> = HashMap::new();
    let mut drafter = Noisy::new(4, 0.5, 99).unwrap();
    for seed in 0..runs {
        let options = GenerateOptions {
            max_new_tokens: 2,
            sampling: Sampling {
                temperature: t as f32,
                top_p: 1.0,
                seed,
            },
            ..Default::default()
        };
        let out = generate_speculative(&model, &mut drafter, &prompt, &options, &spec(4)).unwrap();
        *counts
            .entry((out.generation.tokens[0], out.generation.tokens[1]))
            .or_default() += 1;
    }
    // Cells with an expected count of at least 5; the rest pooled into one cell.
    let first = next_probs(&model, &prompt, t);
    let mut cells: Vec<(f64, usize)> = Vec::new();
    let (mut pooled_expected, mut pooled_observed) = (0.0, runs as usize);
    for (t0, &p0) in first.iter().enumerate() {
        if p0 * (runs as f64) < 5.0 {
            continue;
        }
        let second = next_probs(&model, &[prompt[0], prompt[1], t0 as u32], t);
        for (t1, &p1) in second.iter().enumerate() {
            let expected = runs as f64 * p0 * p1;
            if expected >= 5.0 {
                let observed = counts.get(&(t0 as u32, t1 as u32)).copied().unwrap_or(0);
                cells.push((expected, observed));
                pooled_observed -= observed;
            }
        }
    }
    pooled_expected += runs as f64 - cells.iter().map(|c| c.0).sum::<f64>();
    cells.push((pooled_expected, pooled_observed));
    assert!(
        cells.len() >= 4,
        "the test needs a few well-populated cells, got {}",
        cells.len()
    );
    let chi2: f64 = cells.iter().map(|&(e, o)| (o as f64 - e).powi(2) / e).sum();
    // Wilson-Hilferty upper 0.1% quantile of chi-square with k degrees of freedom (z = 3.09).
    let k = (cells.len() - 1) as f64;
    let critical = k * (1.0 - 2.0 / (9.0 * k) + 3.09 * (2.0 / (9.0 * k)).sqrt()).powi(3);
    assert!(
        chi2 < critical,
        "chi2 {chi2:.1} >= {critical:.1} over {} (expected, observed) cells {cells:?}",
        cells.len()
    );
}
