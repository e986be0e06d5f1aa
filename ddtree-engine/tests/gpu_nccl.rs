//! NCCL through [`NcclComm`]: one rank on one GPU, eagerly and inside a captured CUDA graph;
//! aborted and re-made; a model's rank steps replayed from CUDA graphs with the collectives
//! inside; a rank group recovering after a failed job; and every GPU of the machine as one
//! rank each (threads), when there are several. Each test says
//! SKIP and returns where there is no GPU or no `libnccl.so.2` (`DDTREE_REQUIRE_GPU` makes that a
//! failure).

use std::sync::Arc;

use std::path::PathBuf;
use std::time::Duration;

use ddtree_engine::parallel::comm::{Bootstrap, Comm};
use ddtree_engine::parallel::cuda::run_cuda_ranks;
use ddtree_engine::parallel::group::RankGroup;
use ddtree_engine::parallel::nccl::{nccl_available, NcclBootstrap, NcclComm, NVLS_ENV};
use ddtree_engine::parallel::ranks::run_threads;
use ddtree_engine::parallel::{ParallelPlan, ParallelSpec};
use ddtree_engine::{
    generate_plain, Backend, Checkpoint, CudaBackend, CudaOptions, EngineError, GenerateOptions, LoadOptions, Model,
    ModelConfig,
};
use ddtree_runtime::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use ddtree_runtime::cudarc::driver::{CudaContext, CudaStream};
use ddtree_runtime::Gpu;

fn skip(reason: &str) {
    assert!(
        std::env::var("DDTREE_REQUIRE_GPU").is_err(),
        "DDTREE_REQUIRE_GPU is set but: {reason}"
    );
    eprintln!("SKIP: {reason}");
}

/// GPU 0's stream, when a GPU and NCCL are here.
fn setup() -> Option<Arc<CudaStream>> {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            skip(&format!("no GPU ({e})"));
            return None;
        }
    };
    if !nccl_available() {
        skip("libnccl.so.2 not found");
        return None;
    }
    // As in the engine: cudarc's per-buffer events would make a capture wait on work recorded
    // before it, which CUDA refuses (CUDA_ERROR_STREAM_CAPTURE_ISOLATION).
    // SAFETY: each test makes and uses its buffers on this one stream.
    unsafe { gpu.context().disable_event_tracking() };
    Some(gpu.stream().clone())
}

#[test]
fn nccl_one_rank_eager_and_in_a_captured_graph() {
    let Some(stream) = setup() else { return };
    let boot = NcclBootstrap::new(1).unwrap();
    assert_eq!(std::env::var(NVLS_ENV).as_deref().unwrap_or("0"), "0");
    let comm = NcclComm::init(stream.clone(), 0, 1, boot.token().unwrap()).unwrap();
    assert_eq!((comm.rank(), comm.world()), (0, 1));
    let values = [1.0f32, -2.0, 3.5];
    let mut x = stream.clone_htod(&values).unwrap();
    comm.all_reduce_sum_f32(&mut x).unwrap();
    assert_eq!(stream.clone_dtoh(&x).unwrap(), values);
    comm.barrier().unwrap();

    // The same collective recorded in a graph: replaying it copies `send` into `recv`.
    let send = stream.clone_htod(&values).unwrap();
    let mut recv = stream.alloc_zeros::<f32>(3).unwrap();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let captured = comm.all_gather_f32(&send, &mut recv);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap();
    captured.unwrap();
    let graph = graph.expect("the capture recorded the all-gather");
    assert_eq!(stream.clone_dtoh(&recv).unwrap(), [0.0; 3], "capture must not run it");
    graph.launch().unwrap();
    stream.synchronize().unwrap();
    assert_eq!(stream.clone_dtoh(&recv).unwrap(), values);
}

#[test]
fn nccl_every_gpu_one_rank_sums_across_them() {
    let Some(_) = setup() else { return };
    let count = CudaContext::device_count().unwrap() as usize;
    let world = [8, 4, 2].into_iter().find(|&n| n <= count);
    let Some(world) = world else {
        // Not a missing GPU: DDTREE_REQUIRE_GPU does not ask for several.
        eprintln!("SKIP: {count} GPU(s): NCCL across GPUs needs at least 2");
        return;
    };
    let boot = NcclBootstrap::new(world).unwrap();
    let id = boot.token().unwrap();
    let sums = run_threads((0..world).collect(), |rank| {
        let gpu = Gpu::open(rank).map_err(ddtree_engine::EngineError::from)?;
        let stream = gpu.stream().clone();
        let comm = NcclComm::init(stream.clone(), rank, world, id)?;
        let mut x = stream.clone_htod(&[rank as f32, 1.0]).unwrap();
        comm.all_reduce_sum_f32(&mut x)?;
        Ok(stream.clone_dtoh(&x).unwrap())
    })
    .unwrap();
    let want = (0..world).sum::<usize>() as f32;
    for s in sums {
        assert_eq!(s, vec![want, world as f32]);
    }
}

#[test]
fn nccl_aborted_communicator_fails_cleanly_and_a_new_one_works() {
    let Some(stream) = setup() else { return };
    let boot = NcclBootstrap::new(1).unwrap();
    let comm = NcclComm::init(stream.clone(), 0, 1, boot.token().unwrap()).unwrap();
    assert!(comm.abort_handle().abort(Duration::from_secs(1)));
    assert!(comm.aborted());
    let mut x = stream.clone_htod(&[1.0f32]).unwrap();
    let e = comm.all_reduce_sum_f32(&mut x).unwrap_err().to_string();
    assert!(e.contains("aborted"), "{e}");
    let fresh = NcclComm::init(stream.clone(), 0, 1, boot.renew().unwrap()).unwrap();
    fresh.all_reduce_sum_f32(&mut x).unwrap();
    assert_eq!(stream.clone_dtoh(&x).unwrap(), [1.0]);
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn plan(world: usize) -> Arc<ParallelPlan> {
    let config = ModelConfig::from_file(&fixture("tiny-kimi").join("config.json")).unwrap();
    Arc::new(ParallelPlan::new(&config, ParallelSpec::new(world, None, None).unwrap()).unwrap())
}

fn load(
    backend: CudaBackend,
    rank: ddtree_engine::parallel::RankContext<CudaBackend>,
) -> ddtree_engine::Result<Model<CudaBackend>> {
    let dir = fixture("tiny-kimi");
    let config = ModelConfig::from_file(&dir.join("config.json"))?;
    Model::load_rank(
        backend,
        config,
        &Checkpoint::open(&dir)?,
        LoadOptions::default(),
        rank,
        &mut |_, _| {},
    )
}

const PROMPT: [u32; 5] = [441, 13, 423, 2, 453];

fn options() -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: 12,
        ..Default::default()
    }
}

/// The unsharded greedy tokens on GPU 0.
fn unsharded() -> Vec<u32> {
    let b = CudaBackend::open(CudaOptions::default()).unwrap();
    let m = Model::load_dir(b, &fixture("tiny-kimi"), LoadOptions::default(), &mut |_, _| {}).unwrap();
    generate_plain(&m, &PROMPT, &options()).unwrap().tokens
}

/// One rank's tokens, graph (replays, recordings), and collective calls and time.
type RankRun = (Vec<u32>, (u64, u64), u64, Duration);

/// Every rank's [`RankRun`].
fn rank_runs(world: usize) -> Vec<RankRun> {
    run_cuda_ranks(plan(world), CudaOptions::default(), |backend, rank| {
        let model = load(backend, rank)?;
        let tokens = generate_plain(&model, &PROMPT, &options())?.tokens;
        let graphs = model.backend().graph_counts().unwrap_or_default();
        let stats = model.rank().map(|c| c.comm.stats()).unwrap_or_default();
        Ok((tokens, graphs, stats.calls, stats.time))
    })
    .unwrap()
}

#[test]
fn nccl_one_rank_model_steps_replay_from_graphs_with_the_collectives_inside() {
    let Some(_) = setup() else { return };
    let want = unsharded();
    let runs = rank_runs(1);
    let (tokens, (replays, recordings), calls, time) = &runs[0];
    eprintln!("1 NCCL rank: {replays} replays, {recordings} recordings, {calls} eager collectives in {time:?}");
    assert_eq!(tokens, &want);
    assert!(
        *recordings >= 1 && *replays >= 1,
        "the decode step was recorded and replayed"
    );
    assert!(*calls > 0 && !time.is_zero(), "eager collectives are counted and timed");
}

#[test]
fn nccl_rank_group_recovers_after_a_failed_job() {
    let Some(_) = setup() else { return };
    let group = RankGroup::cuda(plan(1), CudaOptions::default(), load).unwrap();
    let reference = group
        .run_rank0(|m| Ok(generate_plain(m, &PROMPT, &options())?.tokens))
        .unwrap();
    let err = group
        .run(|_| Err::<(), _>(EngineError::Forward("failed alone".into())))
        .unwrap_err()
        .to_string();
    assert!(err.contains("failed alone"), "{err}");
    assert!(group.health().is_ok(), "{:?}", group.health());
    let again = group
        .run_rank0(|m| Ok(generate_plain(m, &PROMPT, &options())?.tokens))
        .unwrap();
    assert_eq!(
        again, reference,
        "the re-made communicator (and re-recorded graphs) give the same tokens"
    );
}

#[test]
fn nccl_every_gpu_one_model_rank_agrees_and_replays_graphs() {
    let Some(_) = setup() else { return };
    let count = CudaContext::device_count().unwrap() as usize;
    let Some(world) = [4, 2].into_iter().find(|&n| n <= count) else {
        eprintln!("SKIP: {count} GPU(s): model ranks across GPUs need at least 2");
        return;
    };
    let want = unsharded();
    let runs = rank_runs(world);
    for (rank, (tokens, (replays, _), calls, time)) in runs.iter().enumerate() {
        eprintln!("rank {rank} of {world}: {replays} replays, {calls} eager collectives in {time:?}");
        assert_eq!(tokens, &runs[0].0, "rank {rank} agrees with rank 0");
        assert!(*replays >= 1, "rank {rank} replayed its steps");
    }
    // bf16 partial sums may part from the unsharded run at a near tie; say so rather than fail.
    if runs[0].0 != want {
        eprintln!("{world} ranks part from the unsharded run: {:?} vs {want:?}", runs[0].0);
    }
}
