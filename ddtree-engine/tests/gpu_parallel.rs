//! The sharded CUDA forward on one GPU: N virtual ranks (threads, each with its own
//! `CudaBackend` on GPU 0) joined by copy-based collectives, against the unsharded forward on
//! the same GPU: same greedy tokens, logits within bf16 tolerance; and one rank's share run
//! alone (`--virtual-rank`) replaying its steps from CUDA graphs. SKIP without a GPU
//! (`DDTREE_REQUIRE_GPU` makes that a failure).

use std::path::PathBuf;
use std::sync::Arc;

use ddtree_engine::parallel::cuda::run_virtual_cuda_ranks;
use ddtree_engine::parallel::virtual_rank::VirtualComm;
use ddtree_engine::parallel::{ParallelPlan, ParallelSpec, RankContext};
use ddtree_engine::{
    generate_plain, Backend, Checkpoint, CudaBackend, CudaOptions, GenerateOptions, Generation, LoadOptions, Model,
    ModelConfig,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Relative to the row's largest logit (at least 1): bf16 activations.
const BF16_TOLERANCE: f32 = 3e-2;

#[test]
fn virtual_ranks_on_one_gpu_match_the_unsharded_forward() {
    let single = match CudaBackend::open(CudaOptions::default()) {
        Ok(b) => b,
        Err(e) => {
            assert!(
                std::env::var("DDTREE_REQUIRE_GPU").is_err(),
                "DDTREE_REQUIRE_GPU is set but the CUDA backend did not open: {e}"
            );
            eprintln!("SKIP: no GPU ({e})");
            return;
        }
    };
    let dir = fixture("tiny-kimi");
    let prompt = [441u32, 13, 423, 2, 453];
    let options = GenerateOptions {
        max_new_tokens: 8,
        record_logits: true,
        ..Default::default()
    };
    let model = Model::load_dir(single, &dir, LoadOptions::default(), &mut |_, _| {}).unwrap();
    let want = generate_plain(&model, &prompt, &options).unwrap();
    drop(model);
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    for world in [2, 4] {
        let plan = Arc::new(ParallelPlan::new(&config, ParallelSpec::new(world, None, None).unwrap()).unwrap());
        let outs = run_virtual_cuda_ranks(plan, CudaOptions::default(), |backend, rank| {
            let model = Model::load_rank(
                backend,
                config.clone(),
                &ckpt,
                LoadOptions::default(),
                rank,
                &mut |_, _| {},
            )?;
            let logged = generate_plain(&model, &prompt, &options)?;
            let greedy = generate_plain(
                &model,
                &prompt,
                &GenerateOptions {
                    record_logits: false,
                    ..options.clone()
                },
            )?;
            Ok((logged, greedy.tokens))
        })
        .unwrap();
        for (rank, (logged, greedy)) in outs.iter().enumerate() {
            let what = format!("{world} virtual ranks, rank {rank}");
            assert_eq!(
                greedy, &logged.tokens,
                "{what}: the reduced argmax against the gathered logits"
            );
            compare(&what, logged, &want);
        }
    }
}

#[test]
fn a_virtual_rank_alone_replays_its_steps_from_cuda_graphs() {
    let backend = match CudaBackend::open(CudaOptions::default()) {
        Ok(b) => b,
        Err(e) => {
            assert!(
                std::env::var("DDTREE_REQUIRE_GPU").is_err(),
                "DDTREE_REQUIRE_GPU is set but the CUDA backend did not open: {e}"
            );
            eprintln!("SKIP: no GPU ({e})");
            return;
        }
    };
    let dir = fixture("tiny-kimi");
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let plan = Arc::new(ParallelPlan::new(&config, ParallelSpec::new(2, None, None).unwrap()).unwrap());
    let rank = RankContext {
        plan,
        rank: 1,
        comm: Box::new(VirtualComm { rank: 1, world: 2 }),
    };
    let ckpt = Checkpoint::open(&dir).unwrap();
    let model = Model::load_rank(backend, config, &ckpt, LoadOptions::default(), rank, &mut |_, _| {}).unwrap();
    let options = GenerateOptions {
        max_new_tokens: 12,
        ..Default::default()
    };
    let a = generate_plain(&model, &[441, 13, 423], &options).unwrap().tokens;
    let b = generate_plain(&model, &[441, 13, 423], &options).unwrap().tokens;
    assert_eq!(a, b, "replayed steps give the eager steps' tokens");
    let (replays, recordings) = model.backend().graph_counts().unwrap();
    assert!(
        recordings >= 1 && replays >= 1,
        "{replays} replays, {recordings} recordings"
    );
}

/// Same tokens as the unsharded run, logits within [`BF16_TOLERANCE`] while the tokens agree.
/// Sharding changes where bf16 rounding happens (each rank's partial sums are rounded before
/// the all-reduce), so the two runs may part at a near tie: that is accepted where the sharded
/// token's unsharded logit is within the tolerance of the unsharded maximum, and the steps
/// after it (different prefixes) are not compared.
fn compare(what: &str, got: &Generation, want: &Generation) {
    assert_eq!(got.tokens.len(), want.tokens.len(), "{what}: token count");
    for (step, (g, w)) in got.logits.iter().zip(&want.logits).enumerate() {
        let scale = w.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        let err = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max) / scale;
        eprintln!("{what}, step {step}: max logit error {err:.2e} (relative)");
        assert!(err < BF16_TOLERANCE, "{what}, step {step}: logits differ by {err:e}");
        let (tg, tw) = (got.tokens[step], want.tokens[step]);
        if tg != tw {
            let gap = (w[tw as usize] - w[tg as usize]) / scale;
            assert!(
                gap < BF16_TOLERANCE,
                "{what}, step {step}: token {tg} where the unsharded run gives {tw}, \
                 {gap:e} below it (not a near tie)"
            );
            eprintln!("{what}: parts from the unsharded run at step {step}, a near tie ({gap:.2e})");
            return;
        }
    }
}
