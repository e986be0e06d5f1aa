//! A long-lived group of ranks for code that serves many requests (a server's engine thread):
//! one thread per rank owns its shard of the model (and any per-rank state a job keeps, such
//! as its drafter: [`RankLocal`]) for the group's lifetime; [`RankGroup::run`] hands the same
//! job to every rank (each runs it on its model, so the collectives inside line up) and returns
//! their results.
//!
//! Failures: a rank whose job fails (an error or a panic) calls [`crate::parallel::TensorComm::abort`], which
//! releases peers waiting for it in a collective (in-process groups). Where the failed rank
//! alone cannot release them (NCCL: a peer's kernels wait for data that never comes), the group
//! aborts every rank's communicator through the handles the ranks gave it at start
//! ([`crate::parallel::TensorComm::abort_handle`]: `ncclCommAbort`). Once every rank has
//! returned, every rank calls [`crate::parallel::TensorComm::recover`] at once (NCCL: a new
//! communicator from a fresh unique id) and the group serves the next job. When that fails, or
//! a rank has not returned [`RankGroup::straggler_timeout`] after a peer failed (stuck in a
//! collective the abort did not end), the group is broken: [`RankGroup::health`] says why and
//! every later job fails at once instead of hanging.
//!
//! Stopping a generation on every rank at the same round: [`agreed_sink`] asks rank 0's sink
//! and broadcasts its decision.
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
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::{Backend, CpuBackend};
use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::parallel::comm::InProcessComm;
use crate::parallel::cpu::CpuTensorComm;
use crate::parallel::{AbortHandle, ParallelPlan, RankContext};

/// What a rank keeps between jobs on its own thread (e.g. its drafter): `None` until a job
/// stores something.
pub type RankLocal = Option<Box<dyn Any>>;

/// A job every rank runs on its model.
type Job<B> = Arc<dyn Fn(&Model<B>, &mut RankLocal) -> Result<Box<dyn Any + Send>> + Send + Sync>;

/// Where a rank sends its job's result.
type Reply = Sender<(usize, Result<Box<dyn Any + Send>>)>;

/// What a rank thread receives.
enum Message<B: Backend> {
    /// Run a job, send its result.
    Job(Job<B>, Reply),
    /// Recover the group's collectives after a failed run ([`crate::parallel::TensorComm::recover`]).
    Recover(Sender<(usize, Result<()>)>),
}

/// How long [`Pending::wait`] waits for the other ranks once one has failed, by default.
pub const STRAGGLER_TIMEOUT: Duration = Duration::from_secs(30);

/// Ranks that each keep their shard of a model on their own thread.
pub struct RankGroup<B: Backend + 'static> {
    senders: Vec<Sender<Message<B>>>,
    handles: Vec<JoinHandle<()>>,
    /// Each rank's abort handle, where its collectives have one.
    aborts: Vec<Option<AbortHandle>>,
    broken: Mutex<Option<String>>,
    /// How long to wait for the other ranks after one failed before declaring the group
    /// broken (default [`STRAGGLER_TIMEOUT`]).
    pub straggler_timeout: Duration,
}

impl<B: Backend + 'static> RankGroup<B> {
    /// Starts `world` rank threads; rank `r` makes its model with `init(r)` (on its own thread,
    /// all ranks at once: an NCCL init waits for its peers). Fails with the most telling rank
    /// error when any rank fails to start.
    pub fn spawn(world: usize, init: impl Fn(usize) -> Result<Model<B>> + Send + Sync + 'static) -> Result<Self> {
        let init = Arc::new(init);
        let (ready_tx, ready_rx) = channel::<(usize, Result<Option<AbortHandle>>)>();
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
        let mut aborts: Vec<Option<AbortHandle>> = vec![None; world];
        for _ in 0..world {
            match ready_rx.recv() {
                Ok((rank, r)) => results[rank] = r.map(|h| aborts[rank] = h),
                Err(_) => break,
            }
        }
        let group = Self {
            senders,
            handles,
            aborts,
            broken: Mutex::new(None),
            straggler_timeout: STRAGGLER_TIMEOUT,
        };
        pick(results)?;
        Ok(group)
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.senders.len()
    }

    /// `Ok` while the group serves jobs; otherwise why it cannot (a rank stuck in a
    /// collective, collectives that could not be recovered, a rank thread gone).
    pub fn health(&self) -> std::result::Result<(), String> {
        match self.broken.lock().map(|b| b.clone()) {
            Ok(None) => Ok(()),
            Ok(Some(reason)) => Err(reason),
            Err(_) => Err("the rank group's state lock is poisoned".into()),
        }
    }

    fn set_broken(&self, reason: String) {
        tracing::error!("rank group broken: {reason}");
        if let Ok(mut b) = self.broken.lock() {
            b.get_or_insert(reason);
        }
    }

    fn check(&self) -> Result<()> {
        self.health().map_err(|reason| EngineError::Comm {
            op: "run".into(),
            rank: 0,
            reason: format!("the rank group is unusable: {reason}"),
        })
    }

    /// Runs `job` on every rank's model (at once) and returns the results in rank order.
    pub fn run<T: Send + 'static>(
        &self,
        job: impl Fn(&Model<B>) -> Result<T> + Send + Sync + 'static,
    ) -> Result<Vec<T>> {
        self.run_local(move |m, _| job(m))
    }

    /// [`RankGroup::run`] with each rank's [`RankLocal`] state.
    pub fn run_local<T: Send + 'static>(
        &self,
        job: impl Fn(&Model<B>, &mut RankLocal) -> Result<T> + Send + Sync + 'static,
    ) -> Result<Vec<T>> {
        self.submit(job)?.wait()
    }

    /// Hands `job` to every rank and returns at once; [`Pending::wait`] collects the results
    /// (meanwhile the caller may serve what the job asks of it, e.g. rank 0's token sink).
    pub fn submit<T: Send + 'static>(
        &self,
        job: impl Fn(&Model<B>, &mut RankLocal) -> Result<T> + Send + Sync + 'static,
    ) -> Result<Pending<'_, B, T>> {
        self.check()?;
        let job: Job<B> = Arc::new(move |m, local| job(m, local).map(|t| Box::new(t) as Box<dyn Any + Send>));
        let (tx, rx) = channel();
        for (rank, s) in self.senders.iter().enumerate() {
            if s.send(Message::Job(job.clone(), tx.clone())).is_err() {
                self.set_broken(format!("rank {rank}'s thread has stopped"));
                return Err(gone(rank));
            }
        }
        Ok(Pending {
            group: self,
            rx,
            _t: std::marker::PhantomData,
        })
    }

    /// [`RankGroup::run`], keeping rank 0's result.
    pub fn run_rank0<T: Send + 'static>(
        &self,
        job: impl Fn(&Model<B>) -> Result<T> + Send + Sync + 'static,
    ) -> Result<T> {
        Ok(self.run(job)?.swap_remove(0))
    }

    /// After a failed run (every rank has returned): recovers the collectives on every rank's
    /// thread at once (an NCCL re-init waits for every rank), or marks the group broken.
    fn recover(&self) {
        let (tx, rx) = channel();
        let mut errors = Vec::new();
        let mut asked = 0;
        for (rank, s) in self.senders.iter().enumerate() {
            match s.send(Message::Recover(tx.clone())) {
                Ok(()) => asked += 1,
                Err(_) => errors.push(gone(rank)),
            }
        }
        drop(tx);
        for _ in 0..asked {
            match rx.recv() {
                Ok((_, Ok(()))) => {}
                Ok((_, Err(e))) => errors.push(e),
                Err(_) => {
                    errors.push(gone(0));
                    break;
                }
            }
        }
        if !errors.is_empty() {
            self.set_broken(format!("after a failed request: {}", pick_error(errors.iter())));
        }
    }

    /// Aborts every rank's collectives that have an abort handle (peers stuck in a collective
    /// with a failed rank are released); ranks whose abort could not run are logged.
    fn abort_all(&self) {
        for (rank, h) in self.aborts.iter().enumerate() {
            if let Some(h) = h {
                if !h() {
                    tracing::warn!("rank {rank}: its collectives could not be aborted");
                }
            }
        }
    }
}

/// A job handed to every rank, not yet collected.
pub struct Pending<'g, B: Backend + 'static, T> {
    group: &'g RankGroup<B>,
    rx: Receiver<(usize, Result<Box<dyn Any + Send>>)>,
    _t: std::marker::PhantomData<T>,
}

impl<B: Backend + 'static, T: Send + 'static> Pending<'_, B, T> {
    /// Every rank's result in rank order, or the most telling error. After a failure the
    /// group's collectives are recovered for the next job (or the group is marked broken).
    pub fn wait(self) -> Result<Vec<T>> {
        let group = self.group;
        let world = group.world();
        let mut results: Vec<Result<T>> = (0..world).map(|r| Err(gone(r))).collect();
        let mut failed_at: Option<Instant> = None;
        let mut returned = 0;
        while returned < world {
            let next = match failed_at {
                None => self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(at) => self
                    .rx
                    .recv_timeout(group.straggler_timeout.saturating_sub(at.elapsed())),
            };
            match next {
                Ok((rank, r)) => {
                    returned += 1;
                    if r.is_err() && failed_at.is_none() {
                        failed_at = Some(Instant::now());
                        if returned < world {
                            // Peers may wait in a collective for the failed rank.
                            group.abort_all();
                        }
                    }
                    results[rank] = r.map(|b| *b.downcast::<T>().expect("the job's own result type"));
                }
                Err(RecvTimeoutError::Timeout) => {
                    let stuck: Vec<usize> = (0..world)
                        .filter(|&r| matches!(&results[r], Err(e) if is_gone(e)))
                        .collect();
                    let first = pick_error(results.iter().filter_map(|r| r.as_ref().err()));
                    group.set_broken(format!(
                        "a request failed ({first}) and rank(s) {stuck:?} did not return within {} s \
                         (stuck in a collective); restart the server",
                        group.straggler_timeout.as_secs()
                    ));
                    return pick(results);
                }
                Err(RecvTimeoutError::Disconnected) => {
                    group.set_broken("a rank thread stopped during a request".into());
                    return pick(results);
                }
            }
        }
        if results.iter().any(Result::is_err) {
            group.recover();
        }
        pick(results)
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
        if self.health().is_err() {
            // A rank may be stuck in a collective: do not wait for it.
            return;
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// A token sink for a generation that runs on every rank of a group: rank 0 asks `decide`
/// (the real sink: a client that may have gone, a stop string), and its decision is broadcast
/// to every rank, so all ranks stop at the same round boundary and none waits in a collective
/// for a peer that stopped. One `u32` broadcast per round. Single-rank models just ask
/// `decide`. A failed broadcast stops the generation and is left in `failed` (return it: the
/// generation's output is then not valid).
pub fn agreed_sink<'a, B: Backend>(
    model: &'a Model<B>,
    mut decide: impl FnMut(&[u32]) -> bool + 'a,
    failed: &'a mut Option<EngineError>,
) -> impl FnMut(&[u32]) -> bool + 'a {
    move |tokens: &[u32]| {
        let Some(ctx) = model.rank().filter(|c| c.comm.world() > 1 && !c.comm.alone()) else {
            return decide(tokens);
        };
        let mut flag = [u32::from(ctx.rank != 0 || decide(tokens))];
        match ctx.comm.broadcast_host_u32(model.backend(), &mut flag, 0) {
            Ok(()) => flag[0] != 0,
            Err(e) => {
                failed.get_or_insert(e);
                false
            }
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

fn is_gone(e: &EngineError) -> bool {
    matches!(e, EngineError::Comm { op, reason, .. } if op == "run" && reason == "the rank's thread has stopped")
}

/// A rank thread: make the model, report, then run jobs until the group is dropped.
fn rank_main<B: Backend>(
    rank: usize,
    init: &(dyn Fn(usize) -> Result<Model<B>> + Send + Sync),
    ready: Sender<(usize, Result<Option<AbortHandle>>)>,
    messages: Receiver<Message<B>>,
) {
    let model = match init(rank) {
        Ok(m) => {
            let _ = ready.send((rank, Ok(m.rank().and_then(|c| c.comm.abort_handle()))));
            m
        }
        Err(e) => {
            let _ = ready.send((rank, Err(e)));
            return;
        }
    };
    drop(ready);
    let mut local: RankLocal = None;
    while let Ok(message) = messages.recv() {
        match message {
            Message::Job(job, reply) => {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&model, &mut local)))
                    .unwrap_or_else(|_| {
                        Err(EngineError::Comm {
                            op: "run".into(),
                            rank,
                            reason: "the job panicked".into(),
                        })
                    });
                drop(job);
                if result.is_err() {
                    // Peers may be waiting for this rank in a collective: release them.
                    if let Some(ctx) = model.rank() {
                        ctx.comm.abort();
                    }
                }
                let _ = reply.send((rank, result));
            }
            Message::Recover(reply) => {
                let r = match model.rank() {
                    Some(ctx) => ctx.comm.recover(model.backend()),
                    None => Ok(()),
                };
                let _ = reply.send((rank, r));
            }
        }
    }
}

fn is_peer(e: &EngineError) -> bool {
    matches!(e, EngineError::Comm { reason, .. } if reason.contains("has stopped"))
}

/// The most telling of some errors: not a peer's "has stopped".
fn pick_error<'a>(errors: impl Iterator<Item = &'a EngineError>) -> String {
    let errors: Vec<&EngineError> = errors.collect();
    errors
        .iter()
        .find(|e| !is_peer(e))
        .or(errors.first())
        .map_or_else(|| "unknown error".into(), |e| e.to_string())
}

/// All results, or the most telling error (not a peer's "has stopped").
fn pick<T>(results: Vec<Result<T>>) -> Result<Vec<T>> {
    if results.iter().all(Result::is_ok) {
        return results.into_iter().collect();
    }
    let mut errors: Vec<EngineError> = results.into_iter().filter_map(Result::err).collect();
    let at = errors.iter().position(|e| !is_peer(e)).unwrap_or(0);
    Err(errors.swap_remove(at))
}
