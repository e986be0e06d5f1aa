//! Running the ranks of a multi-rank model: one thread per rank, each with its
//! [`RankContext`]; the first failure (a peer's "rank N has stopped" ranks after the failure
//! that caused it) is returned.

use std::sync::Arc;

use crate::backend::CpuBackend;
use crate::error::{EngineError, Result};
use crate::parallel::comm::InProcessComm;
use crate::parallel::cpu::CpuTensorComm;
use crate::parallel::{ParallelPlan, RankContext};

/// Runs `f` once per rank of `plan` on CPU ranks (threads of this process joined by an
/// in-process group) and returns the ranks' results in rank order.
pub fn run_cpu_ranks<T: Send>(
    plan: Arc<ParallelPlan>,
    f: impl Fn(RankContext<CpuBackend>) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let comms = InProcessComm::group(plan.spec.world);
    let contexts = comms
        .into_iter()
        .enumerate()
        .map(|(rank, c)| RankContext {
            plan: plan.clone(),
            rank,
            comm: Box::new(CpuTensorComm::new(c)) as _,
        })
        .collect();
    run_threads(contexts, f)
}

/// Runs `f(item)` for every item on its own thread (named `ddtree-rank-{i}`), and returns the
/// results in order, or the most telling failure: a panic, else an error that is not a
/// collective's (peers report those when a rank stops early), else the first error.
pub fn run_threads<C: Send, T: Send>(items: Vec<C>, f: impl Fn(C) -> Result<T> + Sync) -> Result<Vec<T>> {
    let f = &f;
    let results: Vec<Result<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = items
            .into_iter()
            .enumerate()
            .map(|(i, item)| {
                std::thread::Builder::new()
                    .name(format!("ddtree-rank-{i}"))
                    .spawn_scoped(s, move || f(item))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(i, h)| match h {
                Err(e) => Err(EngineError::Comm {
                    op: "spawn".into(),
                    rank: i,
                    reason: e.to_string(),
                }),
                Ok(h) => h.join().unwrap_or_else(|_| {
                    Err(EngineError::Comm {
                        op: "run".into(),
                        rank: i,
                        reason: "the rank's thread panicked".into(),
                    })
                }),
            })
            .collect()
    });
    if results.iter().all(Result::is_ok) {
        return results.into_iter().collect();
    }
    let is_peer = |e: &EngineError| matches!(e, EngineError::Comm { reason, .. } if reason.contains("has stopped"));
    let mut errors: Vec<EngineError> = results.into_iter().filter_map(Result::err).collect();
    let pick = errors.iter().position(|e| !is_peer(e)).unwrap_or(0);
    Err(errors.swap_remove(pick))
}
