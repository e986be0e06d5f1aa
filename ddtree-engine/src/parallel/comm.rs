//! Collectives between ranks: the [`Comm`] trait, its in-process implementation for ranks that
//! are threads of one process on the host ([`InProcessComm`], the CPU backend's and the tests'),
//! and the rank bootstrap ([`Bootstrap`]). The NCCL implementation for GPUs is in
//! [`crate::parallel::nccl`].
//!
//! Every rank calls the same collectives in the same order (the model forward is the same
//! program on every rank); a collective returns on a rank once every rank has entered it.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use half::bf16;

use crate::error::{EngineError, Result};

/// How long a rank waits in one collective for its peers before giving up (a peer that stopped
/// without dropping its handle, e.g. one rank's job failed alone).
const PEER_TIMEOUT: Duration = Duration::from_secs(600);

/// Collectives over the ranks of one group. The buffer types are the implementation's: host
/// slices for [`InProcessComm`], device slices for NCCL.
pub trait Comm {
    /// An f32 buffer.
    type F32: ?Sized;
    /// A bf16 buffer.
    type Bf16: ?Sized;
    /// A u32 buffer.
    type U32: ?Sized;

    /// This rank, `0..world`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world(&self) -> usize;
    /// Element-wise sum over the ranks, in place; every rank gets the same bits.
    fn all_reduce_sum_f32(&self, buf: &mut Self::F32) -> Result<()>;
    /// [`Comm::all_reduce_sum_f32`] for bf16.
    fn all_reduce_sum_bf16(&self, buf: &mut Self::Bf16) -> Result<()>;
    /// Concatenates every rank's `send` (all of one length) in rank order into `recv`.
    fn all_gather_f32(&self, send: &Self::F32, recv: &mut Self::F32) -> Result<()>;
    /// [`Comm::all_gather_f32`] for u32.
    fn all_gather_u32(&self, send: &Self::U32, recv: &mut Self::U32) -> Result<()>;
    /// Copies `root`'s `buf` to every rank's.
    fn broadcast_u32(&self, buf: &mut Self::U32, root: usize) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// Collectives so far and the wall time spent in them on this rank.
    fn stats(&self) -> CommStats {
        CommStats::default()
    }
}

/// Collective counts and time of one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CommStats {
    /// Collectives called.
    pub calls: u64,
    /// Wall time inside them (waiting for peers included).
    pub time: Duration,
}

/// The greedy token of every row across a vocabulary split over the ranks: `local[i]` is row
/// `i`'s `(max, global index)` on this rank; the result is the largest value, the lowest index
/// among equal maxima (as [`crate::spec::sampling::argmax`] on the whole row). Two all-gathers
/// of `rows` values each: the logits themselves are never gathered.
pub fn argmax_reduce<C>(comm: &C, local: &[(f32, u32)]) -> Result<Vec<u32>>
where
    C: Comm<F32 = [f32], U32 = [u32]> + ?Sized,
{
    let (world, rows) = (comm.world(), local.len());
    let values: Vec<f32> = local.iter().map(|p| p.0).collect();
    let ids: Vec<u32> = local.iter().map(|p| p.1).collect();
    let mut all_values = vec![0.0f32; rows * world];
    let mut all_ids = vec![0u32; rows * world];
    comm.all_gather_f32(&values, &mut all_values)?;
    comm.all_gather_u32(&ids, &mut all_ids)?;
    Ok((0..rows)
        .map(|i| {
            let mut best = (all_values[i], all_ids[i]);
            for r in 1..world {
                let c = (all_values[r * rows + i], all_ids[r * rows + i]);
                // NaN never wins; ties go to the lower index.
                if c.0 > best.0 || (c.0 == best.0 && c.1 < best.1) || best.0.is_nan() {
                    best = c;
                }
            }
            best.1
        })
        .collect())
}

/// How ranks find each other before the first collective. In one process the group is made
/// whole ([`InProcessComm::group`], NCCL's `Comm::from_devices`-style unique id handed to each
/// thread); a multi-process launcher would implement this over TCP: rank 0 creates the NCCL
/// unique id and serves it, the others connect and read it (as torchrun's rendezvous does).
pub trait Bootstrap {
    /// What the ranks share to form a group (an NCCL unique id; nothing in process).
    type Token: Clone + Send;
    /// This process's ranks (all of them in one process).
    fn local_ranks(&self) -> std::ops::Range<usize>;
    /// Ranks in the whole group.
    fn world(&self) -> usize;
    /// The token every rank joins with: made by rank 0 and distributed.
    fn token(&self) -> Result<Self::Token>;
    /// A new token for the same ranks, to re-form the group after an abort (an aborted NCCL
    /// communicator's id cannot be joined again).
    fn renew(&self) -> Result<Self::Token>;
}

/// The one-process bootstrap: every rank is a thread of this process.
#[derive(Debug, Clone, Copy)]
pub struct InProcessBootstrap {
    /// Ranks.
    pub world: usize,
}

impl Bootstrap for InProcessBootstrap {
    type Token = ();
    fn local_ranks(&self) -> std::ops::Range<usize> {
        0..self.world
    }
    fn world(&self) -> usize {
        self.world
    }
    fn token(&self) -> Result<()> {
        Ok(())
    }
    fn renew(&self) -> Result<()> {
        Ok(())
    }
}

/// One rank's contribution to an exchange.
#[derive(Debug, Clone)]
enum Payload {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    U32(Vec<u32>),
    None,
}

#[derive(Debug)]
struct State {
    /// Completed exchanges.
    generation: u64,
    /// Ranks that have deposited into the current exchange.
    arrived: usize,
    parts: Vec<Payload>,
    /// Every rank's payload of the last completed exchange.
    result: Arc<Vec<Payload>>,
    /// A rank's handle was dropped in the middle of a run (its thread failed).
    closed: Option<usize>,
}

#[derive(Debug)]
struct Shared {
    world: usize,
    state: Mutex<State>,
    ready: Condvar,
}

/// Collectives between threads of one process over host memory: the CPU backend's ranks and
/// the tests' (not a collective for GPUs: those use NCCL). Reductions sum the ranks' buffers
/// in rank order, so every rank gets bit-identical results.
#[derive(Debug)]
pub struct InProcessComm {
    rank: usize,
    shared: Arc<Shared>,
    stats: Mutex<CommStats>,
    finished: bool,
}

impl InProcessComm {
    /// Handles for a group of `world` ranks, handle `r` for rank `r` (move each to its thread).
    pub fn group(world: usize) -> Vec<InProcessComm> {
        let shared = Arc::new(Shared {
            world,
            state: Mutex::new(State {
                generation: 0,
                arrived: 0,
                parts: vec![Payload::None; world],
                result: Arc::new(Vec::new()),
                closed: None,
            }),
            ready: Condvar::new(),
        });
        (0..world)
            .map(|rank| InProcessComm {
                rank,
                shared: shared.clone(),
                stats: Mutex::new(CommStats::default()),
                finished: false,
            })
            .collect()
    }

    /// Marks this rank as done: dropping it afterwards does not fail its peers.
    pub fn finish(&mut self) {
        self.finished = true;
    }

    /// Stops this rank's part in the current run: peers waiting in (or later entering) a
    /// collective fail with "rank N has stopped" instead of waiting for it. The group stays
    /// unusable until [`InProcessComm::reset`].
    pub fn abort(&self) {
        if let Ok(mut s) = self.shared.state.lock() {
            s.closed.get_or_insert(self.rank);
            self.shared.ready.notify_all();
        }
    }

    /// Makes the group usable again after an [`InProcessComm::abort`]: call it once every rank
    /// has left its collectives (e.g. once every rank's job has returned). Drops any half-done
    /// exchange.
    pub fn reset(&self) -> Result<()> {
        let mut s = self.lock("reset")?;
        s.closed = None;
        s.arrived = 0;
        s.parts = vec![Payload::None; self.shared.world];
        s.generation += 1;
        Ok(())
    }

    fn lock(&self, op: &str) -> Result<MutexGuard<'_, State>> {
        self.shared
            .state
            .lock()
            .map_err(|_| self.error(op, "a peer rank panicked"))
    }

    fn error(&self, op: &str, reason: &str) -> EngineError {
        EngineError::Comm {
            op: op.into(),
            rank: self.rank,
            reason: reason.into(),
        }
    }

    /// Deposits `payload`, waits for every rank's, and returns them all (by rank).
    fn exchange(&self, op: &str, payload: Payload) -> Result<Arc<Vec<Payload>>> {
        let start = Instant::now();
        let mut s = self.lock(op)?;
        if let Some(r) = s.closed {
            return Err(self.error(op, &format!("rank {r} has stopped")));
        }
        let generation = s.generation;
        s.parts[self.rank] = payload;
        s.arrived += 1;
        if s.arrived == self.shared.world {
            let parts = std::mem::replace(&mut s.parts, vec![Payload::None; self.shared.world]);
            s.result = Arc::new(parts);
            s.arrived = 0;
            s.generation += 1;
            self.shared.ready.notify_all();
        } else {
            while s.generation == generation {
                if let Some(r) = s.closed {
                    return Err(self.error(op, &format!("rank {r} has stopped")));
                }
                let (guard, waited) = self
                    .shared
                    .ready
                    .wait_timeout(s, PEER_TIMEOUT)
                    .map_err(|_| self.error(op, "a peer rank panicked"))?;
                s = guard;
                if waited.timed_out() && s.generation == generation {
                    return Err(self.error(
                        op,
                        &format!(
                            "peers have not joined for {} s (a rank has stopped)",
                            PEER_TIMEOUT.as_secs()
                        ),
                    ));
                }
            }
        }
        // The next exchange cannot complete before this rank enters it, so `result` is still
        // this exchange's.
        let result = s.result.clone();
        drop(s);
        if let Ok(mut st) = self.stats.lock() {
            st.calls += 1;
            st.time += start.elapsed();
        }
        Ok(result)
    }

    fn check_len(&self, op: &str, got: usize, want: usize) -> Result<()> {
        if got == want {
            Ok(())
        } else {
            Err(self.error(op, &format!("buffer of {got} values, expected {want}")))
        }
    }
}

impl Drop for InProcessComm {
    fn drop(&mut self) {
        if !self.finished {
            if let Ok(mut s) = self.shared.state.lock() {
                s.closed.get_or_insert(self.rank);
                self.shared.ready.notify_all();
            }
        }
    }
}

impl Comm for InProcessComm {
    type F32 = [f32];
    type Bf16 = [bf16];
    type U32 = [u32];

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<()> {
        if self.shared.world == 1 {
            return Ok(());
        }
        let parts = self.exchange("all_reduce_sum_f32", Payload::F32(buf.to_vec()))?;
        buf.fill(0.0);
        for p in parts.iter() {
            let Payload::F32(v) = p else {
                return Err(self.error("all_reduce_sum_f32", "peers called different collectives"));
            };
            self.check_len("all_reduce_sum_f32", v.len(), buf.len())?;
            buf.iter_mut().zip(v).for_each(|(a, b)| *a += b);
        }
        Ok(())
    }

    fn all_reduce_sum_bf16(&self, buf: &mut [bf16]) -> Result<()> {
        if self.shared.world == 1 {
            return Ok(());
        }
        let parts = self.exchange("all_reduce_sum_bf16", Payload::Bf16(buf.to_vec()))?;
        // Summed in f32 and rounded once, as NCCL's bf16 reduction does within a step.
        let mut acc = vec![0.0f32; buf.len()];
        for p in parts.iter() {
            let Payload::Bf16(v) = p else {
                return Err(self.error("all_reduce_sum_bf16", "peers called different collectives"));
            };
            self.check_len("all_reduce_sum_bf16", v.len(), buf.len())?;
            acc.iter_mut().zip(v).for_each(|(a, b)| *a += b.to_f32());
        }
        buf.iter_mut().zip(acc).for_each(|(b, a)| *b = bf16::from_f32(a));
        Ok(())
    }

    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        self.check_len("all_gather_f32", recv.len(), send.len() * self.shared.world)?;
        let parts = self.exchange("all_gather_f32", Payload::F32(send.to_vec()))?;
        for (chunk, p) in recv.chunks_mut(send.len().max(1)).zip(parts.iter()) {
            let Payload::F32(v) = p else {
                return Err(self.error("all_gather_f32", "peers called different collectives"));
            };
            self.check_len("all_gather_f32", v.len(), send.len())?;
            chunk.copy_from_slice(v);
        }
        Ok(())
    }

    fn all_gather_u32(&self, send: &[u32], recv: &mut [u32]) -> Result<()> {
        self.check_len("all_gather_u32", recv.len(), send.len() * self.shared.world)?;
        let parts = self.exchange("all_gather_u32", Payload::U32(send.to_vec()))?;
        for (chunk, p) in recv.chunks_mut(send.len().max(1)).zip(parts.iter()) {
            let Payload::U32(v) = p else {
                return Err(self.error("all_gather_u32", "peers called different collectives"));
            };
            self.check_len("all_gather_u32", v.len(), send.len())?;
            chunk.copy_from_slice(v);
        }
        Ok(())
    }

    fn broadcast_u32(&self, buf: &mut [u32], root: usize) -> Result<()> {
        if root >= self.shared.world {
            return Err(self.error("broadcast_u32", &format!("root {root} is not a rank")));
        }
        let parts = self.exchange("broadcast_u32", Payload::U32(buf.to_vec()))?;
        let Payload::U32(v) = &parts[root] else {
            return Err(self.error("broadcast_u32", "peers called different collectives"));
        };
        self.check_len("broadcast_u32", v.len(), buf.len())?;
        buf.copy_from_slice(v);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.exchange("barrier", Payload::None).map(|_| ())
    }

    fn stats(&self) -> CommStats {
        self.stats.lock().map(|s| *s).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_ranks<T: Send>(world: usize, f: impl Fn(&InProcessComm) -> T + Sync) -> Vec<T> {
        let f = &f;
        std::thread::scope(|s| {
            let handles: Vec<_> = InProcessComm::group(world)
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        let out = f(&c);
                        c.finish();
                        out
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn collectives_agree_on_every_rank() {
        let out = on_ranks(4, |c| {
            let r = c.rank() as f32;
            let mut sum = vec![r, 1.0];
            c.all_reduce_sum_f32(&mut sum).unwrap();
            let mut h = vec![bf16::from_f32(r)];
            c.all_reduce_sum_bf16(&mut h).unwrap();
            let mut all = vec![0.0; 8];
            c.all_gather_f32(&[r, -r], &mut all).unwrap();
            let mut b = vec![c.rank() as u32 * 10];
            c.broadcast_u32(&mut b, 2).unwrap();
            // Rank r holds vocabulary r*10..: its max is at r*10 + 3 with value 5 - |r - 2|
            // (ranks 1 and 3 tie at 4 below rank 2's 5; row 1 ties everywhere -> rank 0).
            let local = [
                (5.0 - (r - 2.0).abs(), c.rank() as u32 * 10 + 3),
                (1.0, c.rank() as u32 * 10),
            ];
            let greedy = argmax_reduce(c, &local).unwrap();
            c.barrier().unwrap();
            (sum, h[0].to_f32(), all, b[0], greedy, c.stats().calls)
        });
        for o in &out {
            assert_eq!(o.0, vec![6.0, 4.0]);
            assert_eq!(o.1, 6.0);
            assert_eq!(o.2, vec![0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 3.0, -3.0]);
            assert_eq!(o.3, 20);
            assert_eq!(o.4, vec![23, 0]);
            assert_eq!(o.5, 7);
        }
    }

    #[test]
    fn a_failed_rank_releases_its_peers() {
        let mut group = InProcessComm::group(2);
        let failed = group.pop().unwrap();
        let c = group.pop().unwrap();
        let t = std::thread::spawn(move || c.barrier());
        std::thread::sleep(Duration::from_millis(20));
        drop(failed);
        let e = t.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("rank 1 has stopped"), "{e}");
    }
}
