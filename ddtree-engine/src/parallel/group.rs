//! A long-lived group of ranks for code that serves many requests (a server's engine thread):
//! one thread per rank owns its shard of the model for the group's lifetime; [`RankGroup::run`]
//! hands the same job to every rank (each runs it on its model, so the collectives inside line
//! up) and returns their results.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use ddtree_engine::{CpuBackend, LoadOptions, Model, generate_plain, GenerateOptions};
//! # use ddtree_engine::parallel::{group::RankGroup, ParallelPlan, ParallelSpec};
//! # fn main() -> ddtree_engine::Result<()> {
//! let config = ddtree_engine::tiny::config()?;
//! let plan = Arc::new(ParallelPlan::new(&config, ParallelSpec::new(2, None, None)?)?);
//! let group = RankGroup::cpu(plan, move |rank| {
//!     let ckpt = ddtree_engine::tiny::checkpoint()?;
//!     Model::load_rank(CpuBackend::default(), config.clone(), &ckpt, LoadOptions::default(), rank, &mut |_, _| {})
//! })?;
//! let options = GenerateOptions { max_new_tokens: 8, ..Default::default() };
//! let tokens = group.run_rank0(move |model| Ok(generate_plain(model, &[1, 2, 3], &options)?.tokens))?;
//! # Ok(()) }
//! ```

use std::any::Any;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::backend::{Backend, CpuBackend};
use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::parallel::comm::InProcessComm;
use crate::parallel::cpu::CpuTensorComm;
use crate::parallel::{ParallelPlan, RankContext};

/// A job every rank runs on its model.
type Job<B> = Arc<dyn Fn(&Model<B>) -> Result<Box<dyn Any + Send>> + Send + Sync>;

/// What a rank thread receives: a job and where to send its result.
type Message<B> = (Job<B>, Sender<(usize, Result<Box<dyn Any + Send>>)>);

/// Ranks that each keep their shard of a model on their own thread.
pub struct RankGroup<B: Backend + 'static> {
    senders: Vec<Sender<Message<B>>>,
    handles: Vec<JoinHandle<()>>,
}

impl<B: Backend + 'static> RankGroup<B> {
    /// Starts `world` rank threads; rank `r` makes its model with `init(r)` (on its own thread,
    /// all ranks at once: an NCCL init waits for its peers). Fails with the most telling rank
    /// error when any rank fails to start.
    pub fn spawn(world: usize, init: impl Fn(usize) -> Result<Model<B>> + Send + Sync + 'static) -> Result<Self> {
        let init = Arc::new(init);
        let (ready_tx, ready_rx) = channel::<(usize, Result<()>)>();
        let mut senders = Vec::with_capacity(world);
        let mut handles = Vec::with_capacity(world);
        for rank in 0..world {
            let (tx, rx) = channel::<Message<B>>();
            let (init, ready) = (init.clone(), ready_tx.clone());
            let handle = std::thread::Builder::new()
                .name(format!("ddtree-rank-{rank}"))
                .spawn(move || rank_main(rank, init.as_ref(), ready, rx))
                .map_err(|e| EngineError::Comm {
                    op: "spawn".into(),
                    rank,
                    reason: e.to_string(),
                })?;
            senders.push(tx);
            handles.push(handle);
        }
        drop(ready_tx);
        let mut results: Vec<Result<()>> = (0..world).map(|_| Ok(())).collect();
        for _ in 0..world {
            match ready_rx.recv() {
                Ok((rank, r)) => results[rank] = r,
                Err(_) => break,
            }
        }
        let group = Self { senders, handles };
        pick(results)?;
        Ok(group)
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.senders.len()
    }

    /// Runs `job` on every rank's model (at once) and returns the results in rank order.
    pub fn run<T: Send + 'static>(
        &self,
        job: impl Fn(&Model<B>) -> Result<T> + Send + Sync + 'static,
    ) -> Result<Vec<T>> {
        let job: Job<B> = Arc::new(move |m| job(m).map(|t| Box::new(t) as Box<dyn Any + Send>));
        let (tx, rx) = channel();
        for (rank, s) in self.senders.iter().enumerate() {
            s.send((job.clone(), tx.clone())).map_err(|_| gone(rank))?;
        }
        drop(tx);
        let mut results: Vec<Result<T>> = (0..self.world()).map(|r| Err(gone(r))).collect();
        for _ in 0..self.world() {
            let Ok((rank, r)) = rx.recv() else { break };
            results[rank] = r.map(|b| *b.downcast::<T>().expect("the job's own result type"));
        }
        pick(results)
    }

    /// [`RankGroup::run`], keeping rank 0's result.
    pub fn run_rank0<T: Send + 'static>(
        &self,
        job: impl Fn(&Model<B>) -> Result<T> + Send + Sync + 'static,
    ) -> Result<T> {
        Ok(self.run(job)?.swap_remove(0))
    }
}

impl RankGroup<CpuBackend> {
    /// CPU ranks joined by an in-process group: rank `r` makes its model with `make(context)`
    /// (typically [`Model::load_rank`] or [`Model::random_rank`]).
    pub fn cpu(
        plan: Arc<ParallelPlan>,
        make: impl Fn(RankContext<CpuBackend>) -> Result<Model<CpuBackend>> + Send + Sync + 'static,
    ) -> Result<Self> {
        let comms: Mutex<Vec<Option<InProcessComm>>> =
            Mutex::new(InProcessComm::group(plan.spec.world).into_iter().map(Some).collect());
        let world = plan.spec.world;
        Self::spawn(world, move |rank| {
            let comm = comms
                .lock()
                .ok()
                .and_then(|mut c| c[rank].take())
                .ok_or_else(|| gone(rank))?;
            make(RankContext {
                plan: plan.clone(),
                rank,
                comm: Box::new(CpuTensorComm::new(comm)),
            })
        })
    }
}

impl<B: Backend + 'static> Drop for RankGroup<B> {
    fn drop(&mut self) {
        self.senders.clear();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

fn gone(rank: usize) -> EngineError {
    EngineError::Comm {
        op: "run".into(),
        rank,
        reason: "the rank's thread has stopped".into(),
    }
}

/// A rank thread: make the model, report, then run jobs until the group is dropped.
fn rank_main<B: Backend>(
    rank: usize,
    init: &(dyn Fn(usize) -> Result<Model<B>> + Send + Sync),
    ready: Sender<(usize, Result<()>)>,
    jobs: Receiver<Message<B>>,
) {
    let model = match init(rank) {
        Ok(m) => {
            let _ = ready.send((rank, Ok(())));
            m
        }
        Err(e) => {
            let _ = ready.send((rank, Err(e)));
            return;
        }
    };
    drop(ready);
    while let Ok((job, reply)) = jobs.recv() {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&model))).unwrap_or_else(|_| {
            Err(EngineError::Comm {
                op: "run".into(),
                rank,
                reason: "the job panicked".into(),
            })
        });
        // A failed collective leaves the group out of step: this rank stops, which releases
        // peers blocked in a collective ("rank N has stopped"). Other errors (bad input, which
        // every rank meets alike) keep the rank serving.
        let fatal = matches!(result, Err(EngineError::Comm { .. }));
        let _ = reply.send((rank, result));
        if fatal {
            return;
        }
    }
}

/// All results, or the most telling error (not a peer's "has stopped").
fn pick<T>(results: Vec<Result<T>>) -> Result<Vec<T>> {
    if results.iter().all(Result::is_ok) {
        return results.into_iter().collect();
    }
    let is_peer = |e: &EngineError| matches!(e, EngineError::Comm { reason, .. } if reason.contains("has stopped"));
    let mut errors: Vec<EngineError> = results.into_iter().filter_map(Result::err).collect();
    let at = errors.iter().position(|e| !is_peer(e)).unwrap_or(0);
    Err(errors.swap_remove(at))
}
