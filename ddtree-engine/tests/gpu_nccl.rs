//! NCCL through [`NcclComm`]: one rank on one GPU, eagerly and inside a captured CUDA graph; and
//! every GPU of the machine as one rank each (threads), when there are several. Each test says
//! SKIP and returns where there is no GPU or no `libnccl.so.2` (`DDTREE_REQUIRE_GPU` makes that a
//! failure).

use std::sync::Arc;

use ddtree_engine::parallel::comm::{Bootstrap, Comm};
use ddtree_engine::parallel::nccl::{nccl_available, NcclBootstrap, NcclComm, NVLS_ENV};
use ddtree_engine::parallel::ranks::run_threads;
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
