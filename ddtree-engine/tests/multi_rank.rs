//! DDTree on two CPU ranks with either tree source (`replicated`: every rank builds the tree;
//! `rank0`: rank 0 builds and broadcasts it) against one rank; a rank group's cancellation
//! agreement ([`agreed_sink`]), its recovery after one rank fails alone (also with collectives
//! that, like NCCL's, need the group's abort handles and a re-init on every rank), and the
//! broken state when a rank does not return after a peer failed.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ddtree_engine::backend::live_kv_caches;
use ddtree_engine::backend::Matrix;
use ddtree_engine::parallel::cpu::CpuTensorComm;
use ddtree_engine::parallel::group::{agreed_sink, RankGroup};
use ddtree_engine::parallel::ranks::run_cpu_ranks;
use ddtree_engine::parallel::{
    AbortHandle, CommStats, InProcessComm, ParallelPlan, ParallelSpec, RankContext, TensorComm,
};
use ddtree_engine::spec::{DFlashDrafter, Noisy, Oracle, TreeSource};
use ddtree_engine::{
    generate_plain, generate_plain_with_sink, generate_speculative, generate_speculative_with_sink, Checkpoint,
    CpuBackend, EngineError, GenerateOptions, LoadOptions, Model, ModelConfig, SpecOptions, StopReason,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn load_rank(
    dir: &std::path::Path,
    rank: ddtree_engine::parallel::RankContext<CpuBackend>,
) -> ddtree_engine::Result<Model<CpuBackend>> {
    let config = ModelConfig::from_file(&dir.join("config.json"))?;
    let ckpt = Checkpoint::open(dir)?;
    Model::load_rank(
        CpuBackend::default(),
        config,
        &ckpt,
        LoadOptions::default(),
        rank,
        &mut |_, _| {},
    )
}

fn plan(world: usize) -> Arc<ParallelPlan> {
    let config = ModelConfig::from_file(&fixture("tiny-kimi").join("config.json")).unwrap();
    Arc::new(ParallelPlan::new(&config, ParallelSpec::new(world, None, None).unwrap()).unwrap())
}

const PROMPT: [u32; 3] = [5, 17, 3];

/// Held by every test: `live_kv_caches` counts the caches of the whole process.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn options() -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: 12,
        ..Default::default()
    }
}

#[test]
fn ddtree_with_either_tree_source_on_two_ranks_matches_one_rank() {
    let _serial = serial();
    let one = Model::load_dir(
        CpuBackend::default(),
        &fixture("tiny-kimi"),
        LoadOptions::default(),
        &mut |_, _| {},
    )
    .unwrap();
    let plain = generate_plain(&one, &PROMPT, &options()).unwrap().tokens;
    let dflash = fixture("tiny-dflash");
    let mut one_drafter = DFlashDrafter::load(&one, &dflash, Some(4)).unwrap();
    let one_auto = generate_speculative(&one, &mut one_drafter, &PROMPT, &options(), &SpecOptions::auto(None))
        .unwrap()
        .generation
        .tokens;
    assert_eq!(one_auto, plain);
    let dir = fixture("tiny-kimi");
    let outs = run_cpu_ranks(plan(2), |rank| {
        let model = load_rank(&dir, rank)?;
        let mut runs = vec![generate_plain(&model, &PROMPT, &options())?.tokens];
        for source in [TreeSource::Replicated, TreeSource::Rank0] {
            let with = |spec: SpecOptions| SpecOptions {
                tree_source: source,
                ..spec
            };
            let mut oracle = Oracle::new(4)?;
            let mut noisy = Noisy::new(4, 0.5, 7)?;
            let mut drafter = DFlashDrafter::load(&model, &dflash, Some(4))?;
            let mut calibrated = DFlashDrafter::load(&model, &dflash, Some(4))?;
            for (d, spec) in [
                (
                    &mut oracle as &mut dyn ddtree_engine::Drafter<CpuBackend>,
                    with(SpecOptions::fixed(6)),
                ),
                (&mut noisy, with(SpecOptions::fixed(3))),
                (&mut drafter, with(SpecOptions::auto(None))),
                (
                    &mut calibrated,
                    with(SpecOptions {
                        calibrate: true,
                        ..SpecOptions::auto(None)
                    }),
                ),
            ] {
                let out = generate_speculative(&model, d, &PROMPT, &options(), &spec)?;
                assert_eq!(out.stats.tree_source, source.name());
                if source == TreeSource::Rank0 {
                    assert!(out.stats.tree_sync > Duration::ZERO);
                } else {
                    assert_eq!(out.stats.tree_sync, Duration::ZERO);
                }
                runs.push(out.generation.tokens);
            }
        }
        Ok(runs)
    })
    .unwrap();
    for (rank, runs) in outs.iter().enumerate() {
        for (i, tokens) in runs.iter().enumerate() {
            assert_eq!(tokens, &plain, "rank {rank}, run {i}");
        }
    }
}

#[test]
fn rank0s_decision_stops_every_rank_at_the_same_round_and_frees_the_caches() {
    let _serial = serial();
    let dir = fixture("tiny-kimi");
    let group = RankGroup::cpu(plan(2), move |rank| load_rank(&dir, rank)).unwrap();
    let baseline = live_kv_caches();
    // Rank 0 stops after 3 sink calls; the other ranks' own sinks would go on forever.
    for speculative in [false, true] {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let outs = group
            .run(move |model| {
                let rank0 = model.rank().unwrap().rank == 0;
                let mut failed: Option<EngineError> = None;
                let decide = |_: &[u32]| !rank0 || c.fetch_add(1, Ordering::SeqCst) < 2;
                let mut sink = agreed_sink(model, decide, &mut failed);
                let options = GenerateOptions {
                    max_new_tokens: 40,
                    ..Default::default()
                };
                let out = if speculative {
                    let mut noisy = Noisy::new(4, 0.5, 7)?;
                    generate_speculative_with_sink(
                        model,
                        &mut noisy,
                        &PROMPT,
                        &options,
                        &SpecOptions::fixed(3),
                        &mut sink,
                    )?
                    .generation
                } else {
                    generate_plain_with_sink(model, &PROMPT, &options, &mut sink)?
                };
                drop(sink);
                if let Some(e) = failed {
                    return Err(e);
                }
                Ok(out)
            })
            .unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        assert_eq!(outs[0].tokens, outs[1].tokens);
        assert!(outs.iter().all(|o| o.stop_reason == StopReason::Cancelled));
        assert!(outs[0].tokens.len() < 40);
        assert_eq!(live_kv_caches(), baseline, "every rank's caches are freed");
    }
}

#[test]
fn a_rank_failing_alone_mid_generation_fails_the_job_and_the_group_recovers() {
    let _serial = serial();
    let dir = fixture("tiny-kimi");
    let group = RankGroup::cpu(plan(2), move |rank| load_rank(&dir, rank)).unwrap();
    let reference = group
        .run_rank0(|model| Ok(generate_plain(model, &PROMPT, &options())?.tokens))
        .unwrap();
    for panic in [false, true] {
        let start = Instant::now();
        let err = group
            .run(move |model| {
                let rank1 = model.rank().unwrap().rank == 1;
                // Rank 1 fails after two tokens while rank 0 is (or will be) in a collective.
                let mut sink = |tokens: &[u32]| {
                    let _ = tokens;
                    true
                };
                let mut n = 0;
                let mut fail = |_: &[u32]| {
                    n += 1;
                    if n == 2 && panic {
                        panic!("rank 1 panicked");
                    }
                    n < 2
                };
                let options = options();
                if rank1 {
                    let out = generate_plain_with_sink(model, &PROMPT, &options, &mut fail)?;
                    if out.stop_reason == StopReason::Cancelled {
                        return Err(EngineError::Forward("rank 1 failed alone".into()));
                    }
                    Ok(out.tokens)
                } else {
                    Ok(generate_plain_with_sink(model, &PROMPT, &options, &mut sink)?.tokens)
                }
            })
            .unwrap_err()
            .to_string();
        let want = if panic {
            "the job panicked"
        } else {
            "rank 1 failed alone"
        };
        assert!(err.contains(want), "{err}");
        assert!(start.elapsed() < Duration::from_secs(10), "peers were released");
        assert!(group.health().is_ok(), "{:?}", group.health());
        let again = group
            .run_rank0(|model| Ok(generate_plain(model, &PROMPT, &options())?.tokens))
            .unwrap();
        assert_eq!(again, reference);
    }
}

#[test]
fn a_rank_that_does_not_return_after_a_peer_failed_marks_the_group_broken() {
    let _serial = serial();
    let dir = fixture("tiny-kimi");
    let mut group = RankGroup::cpu(plan(2), move |rank| load_rank(&dir, rank)).unwrap();
    group.straggler_timeout = Duration::from_millis(200);
    let start = Instant::now();
    let err = group
        .run(|model| {
            if model.rank().unwrap().rank == 0 {
                return Err::<(), _>(EngineError::Forward("rank 0 failed".into()));
            }
            // Rank 1 is busy outside any collective (as a rank stuck in an NCCL call would be).
            std::thread::sleep(Duration::from_secs(2));
            Ok(())
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("rank 0 failed"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
    let health = group.health().unwrap_err();
    assert!(
        health.contains("rank 0 failed") && health.contains("[1] did not return"),
        "{health}"
    );
    // Later jobs fail at once instead of hanging.
    let err = group.run(|_| Ok(())).unwrap_err().to_string();
    assert!(err.contains("unusable"), "{err}");
}

/// Collectives that fail as NCCL's do: a failed rank cannot release its peers by itself (its
/// own `abort` does nothing), only the group's abort handles can (`ncclCommAbort` on every
/// rank), and recovery is a re-init that every rank must join at once.
struct NcclLike {
    inner: Arc<CpuTensorComm>,
    rank: usize,
    /// Ranks that have entered `recover` in this round, and the aborts run.
    recovering: Arc<(std::sync::Mutex<usize>, std::sync::Condvar)>,
    aborts: Arc<AtomicUsize>,
}

impl TensorComm<CpuBackend> for NcclLike {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn all_reduce_sum(&self, b: &CpuBackend, x: &mut Matrix) -> ddtree_engine::Result<()> {
        self.inner.all_reduce_sum(b, x)
    }
    fn gather_vocab(&self, b: &CpuBackend, l: Matrix, v: Range<usize>, n: usize) -> ddtree_engine::Result<Matrix> {
        self.inner.gather_vocab(b, l, v, n)
    }
    fn argmax_vocab(&self, b: &CpuBackend, l: &Matrix, v: Range<usize>) -> ddtree_engine::Result<Vec<u32>> {
        self.inner.argmax_vocab(b, l, v)
    }
    fn embedding(&self, b: &CpuBackend, t: &Matrix, ids: &[u32], v: Range<usize>) -> ddtree_engine::Result<Matrix> {
        self.inner.embedding(b, t, ids, v)
    }
    fn stats(&self) -> CommStats {
        self.inner.stats()
    }
    fn broadcast_host_u32(&self, b: &CpuBackend, buf: &mut [u32], root: usize) -> ddtree_engine::Result<()> {
        self.inner.broadcast_host_u32(b, buf, root)
    }
    fn abort(&self) {}
    fn abort_handle(&self) -> Option<AbortHandle> {
        let (inner, aborts) = (self.inner.clone(), self.aborts.clone());
        Some(Arc::new(move || {
            aborts.fetch_add(1, Ordering::SeqCst);
            inner.abort();
            true
        }))
    }
    /// Waits (1 s at most) for every rank to enter, as an NCCL re-init does.
    fn recover(&self, b: &CpuBackend) -> ddtree_engine::Result<()> {
        let world = self.world();
        let (count, joined) = &*self.recovering;
        let mut n = count.lock().unwrap();
        *n += 1;
        joined.notify_all();
        let (n, wait) = joined
            .wait_timeout_while(n, Duration::from_secs(1), |n| *n % world != 0)
            .unwrap();
        if wait.timed_out() {
            return Err(EngineError::Forward(format!("only {} of {world} ranks re-joined", *n)));
        }
        drop(n);
        self.inner.recover(b)
    }
}

#[test]
fn a_group_whose_ranks_cannot_release_peers_aborts_every_rank_and_reinits_on_all() {
    let _serial = serial();
    let dir = fixture("tiny-kimi");
    let plan = plan(2);
    let comms = std::sync::Mutex::new(
        InProcessComm::group(2)
            .into_iter()
            .map(|c| Some(Arc::new(CpuTensorComm::new(c))))
            .collect::<Vec<_>>(),
    );
    let recovering = Arc::new((std::sync::Mutex::new(0), std::sync::Condvar::new()));
    let aborts = Arc::new(AtomicUsize::new(0));
    let (r2, a2) = (recovering.clone(), aborts.clone());
    let group = RankGroup::spawn(2, move |rank| {
        let inner = comms.lock().unwrap()[rank].take().unwrap();
        let comm = NcclLike {
            inner,
            rank,
            recovering: r2.clone(),
            aborts: a2.clone(),
        };
        load_rank(
            &dir,
            RankContext {
                plan: plan.clone(),
                rank,
                comm: Box::new(comm),
            },
        )
    })
    .unwrap();
    let reference = group
        .run_rank0(|model| Ok(generate_plain(model, &PROMPT, &options())?.tokens))
        .unwrap();
    let start = Instant::now();
    let err = group
        .run(|model| {
            if model.rank().unwrap().rank == 1 {
                // Fails while rank 0 waits for it in the prefill's first collective.
                std::thread::sleep(Duration::from_millis(50));
                return Err::<Vec<u32>, _>(EngineError::Forward("rank 1 failed alone".into()));
            }
            Ok(generate_plain(model, &PROMPT, &options())?.tokens)
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("rank 1 failed alone"), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "the abort handles released rank 0"
    );
    assert_eq!(aborts.load(Ordering::SeqCst), 2, "every rank's handle aborted");
    assert_eq!(*recovering.0.lock().unwrap(), 2, "every rank re-joined");
    assert!(group.health().is_ok(), "{:?}", group.health());
    let again = group
        .run_rank0(|model| Ok(generate_plain(model, &PROMPT, &options())?.tokens))
        .unwrap();
    assert_eq!(again, reference);
}
