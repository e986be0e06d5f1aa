//! The model split over CPU ranks (threads with in-process collectives) against the same model
//! on one rank and the HF goldens: token-exact greedy continuations, logits within 1e-5 (relative
//! to the row's largest logit) of one rank, tree verification, DDTree with test and DFlash drafters; and the refusals.

use std::path::PathBuf;
use std::sync::Arc;

use ddtree_engine::backend::Backend;
use ddtree_engine::parallel::ranks::run_cpu_ranks;
use ddtree_engine::parallel::{ParallelPlan, ParallelSpec};
use ddtree_engine::spec::{DFlashDrafter, Noisy, Oracle};
use ddtree_engine::{
    generate_plain, generate_speculative, AncestorMask, Checkpoint, CpuBackend, ForwardInput, GenerateOptions,
    LoadOptions, LogitRows, Model, ModelConfig, SpecOptions,
};
use serde::Deserialize;

#[derive(Deserialize)]
struct Golden {
    steps: usize,
    prompts: Vec<Prompt>,
    tree: Tree,
}

#[derive(Deserialize)]
struct Prompt {
    ids: Vec<u32>,
    generated: Vec<u32>,
}

#[derive(Deserialize)]
struct Tree {
    prompt: Vec<u32>,
    tokens: Vec<u32>,
    parents: Vec<i32>,
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn golden(name: &str) -> Golden {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("golden.json")).unwrap()).unwrap()
}

/// Runs `f` on every rank of `name`'s model split as `spec` and returns the ranks' results.
fn on_ranks<T: Send>(name: &str, spec: ParallelSpec, f: impl Fn(&Model<CpuBackend>) -> T + Sync) -> Vec<T> {
    let dir = fixture(name);
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let plan = Arc::new(ParallelPlan::new(&config, spec).unwrap());
    run_cpu_ranks(plan, |rank| {
        let model = Model::load_rank(
            CpuBackend::default(),
            config.clone(),
            &ckpt,
            LoadOptions::default(),
            rank,
            &mut |_, _| {},
        )?;
        Ok(f(&model))
    })
    .unwrap()
}

fn single(name: &str) -> Model<CpuBackend> {
    Model::load_dir(
        CpuBackend::default(),
        &fixture(name),
        LoadOptions::default(),
        &mut |_, _| {},
    )
    .unwrap()
}

/// Max |a - b| over each row relative to the row's largest reference magnitude (at least 1),
/// maximized over the rows (the goldens' measure).
fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            let scale = y.iter().fold(1.0f32, |m, v| m.max(v.abs()));
            x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0, f32::max) / scale
        })
        .fold(0.0, f32::max)
}

const LOGIT_TOLERANCE: f32 = 1e-5;

/// Greedy decoding with recorded logits (the gathered LM head) and without (the argmax reduced
/// across ranks): the golden tokens on every rank, logits within 1e-5 of one rank.
fn check_greedy(name: &str, spec: ParallelSpec) {
    let g = golden(name);
    let one = single(name);
    let options = |record_logits| GenerateOptions {
        max_new_tokens: g.steps,
        record_logits,
        ..Default::default()
    };
    let want: Vec<_> = g
        .prompts
        .iter()
        .map(|p| generate_plain(&one, &p.ids, &options(true)).unwrap())
        .collect();
    let ranks = on_ranks(name, spec, |model| {
        g.prompts
            .iter()
            .map(|p| {
                let logged = generate_plain(model, &p.ids, &options(true)).unwrap();
                let greedy = generate_plain(model, &p.ids, &options(false)).unwrap();
                (logged, greedy.tokens)
            })
            .collect::<Vec<_>>()
    });
    for (rank, outs) in ranks.iter().enumerate() {
        for ((p, w), (logged, greedy)) in g.prompts.iter().zip(&want).zip(outs) {
            let at = format!("{name} {spec:?} rank {rank} prompt {:?}", p.ids);
            assert_eq!(logged.tokens, p.generated, "{at}");
            assert_eq!(greedy, &p.generated, "{at}: reduced argmax");
            let d = max_diff(&logged.logits, &w.logits);
            assert!(d < LOGIT_TOLERANCE, "{at}: logits differ from one rank by {d:e}");
        }
    }
}

/// Tree verification with the ancestor mask: logits within 1e-5 of one rank.
fn check_tree(name: &str, spec: ParallelSpec) {
    let t = golden(name).tree;
    let verify = |model: &Model<CpuBackend>| {
        let mut cache = model.new_cache(64).unwrap();
        let positions: Vec<u32> = (0..t.prompt.len() as u32).collect();
        let prefill = ForwardInput {
            tokens: &t.prompt,
            positions: &positions,
            mask: None,
            logits: LogitRows::Last,
        };
        model.forward(&mut cache, prefill).unwrap();
        let mut depth = vec![0u32; t.parents.len()];
        for i in 1..t.parents.len() {
            depth[i] = depth[t.parents[i] as usize] + 1;
        }
        let tree_positions: Vec<u32> = depth.iter().map(|d| t.prompt.len() as u32 + d).collect();
        let mask = AncestorMask::from_parents(&t.parents).unwrap();
        let input = ForwardInput {
            tokens: &t.tokens,
            positions: &tree_positions,
            mask: Some(&mask),
            logits: LogitRows::All,
        };
        let logits = model
            .backend()
            .to_host(&model.forward(&mut cache, input).unwrap())
            .unwrap();
        (0..logits.rows).map(|r| logits.row(r).to_vec()).collect::<Vec<_>>()
    };
    let want = verify(&single(name));
    for (rank, got) in on_ranks(name, spec, verify).iter().enumerate() {
        let d = max_diff(got, &want);
        assert!(
            d < LOGIT_TOLERANCE,
            "{name} {spec:?} rank {rank}: tree logits differ by {d:e}"
        );
    }
}

fn spec(world: usize) -> ParallelSpec {
    ParallelSpec::new(world, None, None).unwrap()
}

#[test]
fn kimi_greedy_on_two_and_four_ranks_matches_one() {
    check_greedy("tiny-kimi", spec(2));
    check_greedy("tiny-kimi", spec(4));
}

#[test]
fn dsv3_int4_grouped_greedy_on_two_and_four_ranks_matches_one() {
    check_greedy("tiny-dsv3", spec(2));
    check_greedy("tiny-dsv3", spec(4));
}

#[test]
fn replicated_attention_or_experts_match_too() {
    check_greedy("tiny-dsv3", ParallelSpec::new(2, Some(1), None).unwrap());
    check_greedy("tiny-kimi", ParallelSpec::new(2, None, Some(1)).unwrap());
}

#[test]
fn tree_verify_on_ranks_matches_one() {
    check_tree("tiny-kimi", spec(4));
    check_tree("tiny-dsv3", spec(2));
}

#[test]
fn ddtree_on_ranks_is_lossless_and_identical_on_every_rank() {
    let g = golden("tiny-kimi");
    let p = &g.prompts[0];
    let options = GenerateOptions {
        max_new_tokens: 12,
        ..Default::default()
    };
    let plain = generate_plain(&single("tiny-kimi"), &p.ids, &options).unwrap().tokens;
    let dflash = fixture("tiny-dflash");
    for world in [2, 4] {
        let outs = on_ranks("tiny-kimi", spec(world), |model| {
            let mut oracle = Oracle::new(4).unwrap();
            let mut noisy = Noisy::new(4, 0.5, 7).unwrap();
            let mut drafter = DFlashDrafter::load(model, &dflash, Some(4)).unwrap();
            let run = |d: &mut dyn ddtree_engine::Drafter<CpuBackend>, spec: &SpecOptions| {
                generate_speculative(model, d, &p.ids, &options, spec)
                    .unwrap()
                    .generation
                    .tokens
            };
            [
                run(&mut oracle, &SpecOptions::fixed(6)),
                run(&mut noisy, &SpecOptions::fixed(3)),
                run(&mut drafter, &SpecOptions::auto(None)),
            ]
        });
        for (rank, runs) in outs.iter().enumerate() {
            for (i, tokens) in runs.iter().enumerate() {
                assert_eq!(tokens, &plain, "{world} ranks, rank {rank}, drafter {i}");
            }
        }
    }
}

#[test]
fn a_plan_for_another_model_is_refused() {
    let dir = fixture("tiny-kimi");
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let other = ModelConfig::from_file(&fixture("tiny-dsv3").join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let plan = Arc::new(ParallelPlan::new(&other, spec(2)).unwrap());
    let err = run_cpu_ranks(plan, |rank| {
        Model::load_rank(
            CpuBackend::default(),
            config.clone(),
            &ckpt,
            LoadOptions::default(),
            rank,
            &mut |_, _| {},
        )
        .map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("made for another model"), "{err}");
}

#[test]
fn a_rank_group_serves_several_jobs_and_survives_bad_input() {
    use ddtree_engine::parallel::group::RankGroup;
    let g = golden("tiny-dsv3");
    let dir = fixture("tiny-dsv3");
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let plan = Arc::new(ParallelPlan::new(&config, spec(2)).unwrap());
    let group = RankGroup::cpu(plan, move |rank| {
        let ckpt = Checkpoint::open(&dir)?;
        Model::load_rank(
            CpuBackend::default(),
            config.clone(),
            &ckpt,
            LoadOptions::default(),
            rank,
            &mut |_, _| {},
        )
    })
    .unwrap();
    assert_eq!(group.world(), 2);
    let steps = g.steps;
    for p in &g.prompts {
        let ids = p.ids.clone();
        let tokens = group
            .run(move |model| {
                let options = GenerateOptions {
                    max_new_tokens: steps,
                    ..Default::default()
                };
                Ok(generate_plain(model, &ids, &options)?.tokens)
            })
            .unwrap();
        assert_eq!(tokens, vec![p.generated.clone(), p.generated.clone()]);
    }
    // An empty prompt fails alike on every rank, before any collective; the group goes on.
    let err = group
        .run_rank0(|model| Ok(generate_plain(model, &[], &GenerateOptions::default())?.tokens))
        .unwrap_err()
        .to_string();
    assert!(err.contains("prompt is empty"), "{err}");
    let p = &g.prompts[0];
    let ids = p.ids.clone();
    let again = group
        .run_rank0(move |model| {
            let options = GenerateOptions {
                max_new_tokens: steps,
                ..Default::default()
            };
            Ok(generate_plain(model, &ids, &options)?.tokens)
        })
        .unwrap();
    assert_eq!(again, p.generated);
}

#[test]
fn a_rank_that_fails_alone_releases_its_peers_and_its_error_is_reported() {
    let dir = fixture("tiny-kimi");
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let plan = Arc::new(ParallelPlan::new(&config, spec(2)).unwrap());
    let err = run_cpu_ranks(plan, |rank| {
        let model = Model::load_rank(
            CpuBackend::default(),
            config.clone(),
            &ckpt,
            LoadOptions::default(),
            rank,
            &mut |_, _| {},
        )?;
        if model.rank().unwrap().rank == 1 {
            return Err(ddtree_engine::EngineError::Forward("rank 1 gave up".into()));
        }
        // Rank 0 enters the first collective and is released when rank 1's model drops.
        let options = GenerateOptions {
            max_new_tokens: 4,
            ..Default::default()
        };
        generate_plain(&model, &[1, 2, 3], &options).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("rank 1 gave up"), "{err}");
}
