//! `nccl_bench`: NCCL all-reduce latency for the message sizes of a Kimi K2.6 step (bf16 hidden
//! rows of 7168 values, for 1 to 257 tokens), on `N` GPUs of this node (one thread per GPU),
//! eager and replayed from a CUDA graph. The table projects the collectives' share of a
//! multi-GPU decode step (123 all-reduces per token at TP8 + EP8: docs/multi-gpu.md).
//!
//! ```sh
//! nccl_bench --gpus 8            # default sizes; --hidden, --tokens 1,8,64,257, --iters
//! ```
//!
//! Times are host wall time over `iters` back-to-back collectives after a warm-up, divided by
//! `iters` (launch overhead included, as a decode step pays it); rank 0's numbers are printed.

use std::time::Instant;

use clap::Parser;
use ddtree_engine::parallel::comm::{Bootstrap, Comm};
use ddtree_engine::parallel::nccl::{NcclBootstrap, NcclComm};
use ddtree_engine::parallel::ranks::run_threads;
use ddtree_engine::EngineError;
use ddtree_runtime::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use ddtree_runtime::Gpu;
use half::bf16;

#[derive(Parser)]
#[command(
    name = "nccl_bench",
    about = "NCCL all-reduce latency for the message sizes of a decode step"
)]
struct Args {
    /// GPUs (ranks), one thread each.
    #[arg(long, default_value_t = 8)]
    gpus: usize,
    /// Values per token (Kimi K2.6's hidden size).
    #[arg(long, default_value_t = 7168)]
    hidden: usize,
    /// Token counts (rows) per all-reduce.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 8, 33, 65, 257])]
    tokens: Vec<usize>,
    /// Timed collectives per size.
    #[arg(long, default_value_t = 200)]
    iters: usize,
}

fn cuda(op: &'static str) -> impl Fn(ddtree_runtime::cudarc::driver::DriverError) -> EngineError {
    move |e| EngineError::Backend {
        backend: "cuda".into(),
        reason: format!("{op}: {e}"),
    }
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(rows) => {
            println!("| tokens | bytes | eager µs | graph µs |");
            println!("|---|---|---|---|");
            for (tokens, eager, graph) in rows {
                println!("| {tokens} | {} | {eager:.1} | {graph:.1} |", tokens * args.hidden * 2);
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Per size: (tokens, eager µs, graph µs) on rank 0.
fn run(args: &Args) -> Result<Vec<(usize, f64, f64)>, EngineError> {
    let boot = NcclBootstrap::new(args.gpus)?;
    let id = boot.token()?;
    let world = args.gpus;
    let per_rank = run_threads(boot.local_ranks().collect(), |rank| {
        let gpu = Gpu::open(rank)?;
        // cudarc's per-buffer events would make the capture below wait on work recorded before
        // it (an event outside the capture), which CUDA refuses; the engine runs with them off.
        // SAFETY: every buffer here is made and used on this one stream.
        unsafe { gpu.context().disable_event_tracking() };
        let stream = gpu.stream().clone();
        let comm = NcclComm::init(stream.clone(), rank, world, id)?;
        let mut rows = Vec::new();
        for &tokens in &args.tokens {
            let host = vec![bf16::from_f32(1.0); tokens * args.hidden];
            let mut buf = stream.clone_htod(&host).map_err(cuda("upload"))?;
            for _ in 0..10 {
                comm.all_reduce_sum_bf16(&mut buf)?;
            }
            stream.synchronize().map_err(cuda("sync"))?;
            let t = Instant::now();
            for _ in 0..args.iters {
                comm.all_reduce_sum_bf16(&mut buf)?;
            }
            stream.synchronize().map_err(cuda("sync"))?;
            let eager = t.elapsed().as_secs_f64() * 1e6 / args.iters as f64;
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(cuda("begin capture"))?;
            let captured = (0..args.iters).try_for_each(|_| comm.all_reduce_sum_bf16(&mut buf));
            let graph = stream
                .end_capture(CUgraphInstantiate_flags(0))
                .map_err(cuda("end capture"))?;
            captured?;
            let graph = graph.ok_or_else(|| EngineError::Backend {
                backend: "cuda".into(),
                reason: "empty capture".into(),
            })?;
            graph.launch().map_err(cuda("graph launch"))?;
            stream.synchronize().map_err(cuda("sync"))?;
            let t = Instant::now();
            graph.launch().map_err(cuda("graph launch"))?;
            stream.synchronize().map_err(cuda("sync"))?;
            let replay = t.elapsed().as_secs_f64() * 1e6 / args.iters as f64;
            rows.push((tokens, eager, replay));
        }
        Ok(rows)
    })?;
    Ok(per_rank.into_iter().next().unwrap_or_default())
}
