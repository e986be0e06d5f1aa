//! CUDA graphs of greedy forwards: the decode step and each tree-size bucket of the verify step.
//!
//! The first two greedy forwards of a shape run eagerly (the first compiles, tunes and sizes
//! every buffer it needs; see [`EAGER_RUNS`] for the second); the third is recorded with stream capture into a graph, which then runs in place
//! of the forward's ~30 launches per layer for every later forward of that shape. A recording
//! is valid for one shape ([`GraphKey`]: rows, mask width, cache, length bucket) because
//! everything that changes from step to step is read on the device: the step's tokens,
//! positions, mask and cache length sit in the staging buffers that
//! [`Backend::begin_forward`] fills before the launch, at fixed addresses, and the kernels read
//! the cache length from there (the attention's split count is sized for the length bucket).
//! The only host sync of a step is the read of the argmax rows, and a device-staged step (a
//! greedy tree round, [`super::round`]) has none: its tokens, positions and mask were written
//! to the staging buffers by a kernel before the replay, on the same stream, and its argmax
//! rows stay in the persistent outputs for the accept kernel.
//!
//! A recording is dropped when a buffer it reads is replaced (a staging buffer outgrown, a
//! scratch buffer reallocated: the generation counter moves), and a shape whose recording fails
//! twice (an op that cannot be replayed, such as the half-split rope at a host-side offset) is
//! left to eager forwards.

use ddtree_kernels::vocab::op::RankArgmaxOp;
use ddtree_kernels::RankArgmax;
use ddtree_runtime::cudarc::driver::{sys, CudaGraph, CudaSlice, CudaView, DevicePtr};

use super::{drv, fail, CudaBackend, CudaKvCache, CudaTensor, Staged};
use crate::backend::StepInputs;
use crate::error::{EngineError, Result};
use crate::mask::AncestorMask;

/// Cache lengths (prefix plus new rows) that share a recording: up to the next power of two,
/// at least 256.
pub(crate) fn length_bucket(len: usize) -> usize {
    len.next_power_of_two().max(256)
}

/// Recordings kept at once (each holds its activations' memory); past it the least recently
/// replayed one is dropped.
const MAX_GRAPHS: usize = 24;

/// Eager forwards of a shape before it is recorded: the first one compiles, tunes and sizes the
/// buffers it needs; a second one, instead of a recording, keeps a shape that comes up rarely
/// (a tree size `auto` picks once in a while) from paying for one: on the H200 the one
/// recording of a 33-token Kimi K2.6 EP8 verify in a 30-round `bench` run cost about 45 ms
/// (derived from the round times), several eager rounds' worth.
const EAGER_RUNS: usize = 2;

/// Failed recordings of one shape after which its forwards stay eager.
const MAX_FAILURES: usize = 2;

/// The shape of the step staged by the last `begin_forward`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Step {
    pub(super) rows: usize,
    pub(super) words: usize,
    pub(super) tree: bool,
    pub(super) prefix: usize,
}

/// What one recording is valid for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GraphKey {
    rows: usize,
    words: usize,
    tree: bool,
    bucket: usize,
    /// The cache buffer's device address and capacity.
    cache: (u64, usize),
    /// Rank and world of a rank's step (its collectives are in the recording); `(0, 1)` alone.
    rank: (usize, usize),
}

/// How a rank of a vocabulary-parallel model reduces its greedy tokens across the ranks on the
/// device, inside the step (and its recording): its argmax rows, `(max, local column)`, are
/// all-gathered and [`RankArgmax`] writes the global tokens to the persistent outputs.
pub(crate) struct RankReduce<'a> {
    /// This rank.
    pub(crate) rank: usize,
    /// Ranks.
    pub(crate) world: usize,
    /// The width of a rank's vocabulary slice (rank `k`'s starts at `k * slice`).
    pub(crate) slice: usize,
    /// All-gathers `rows` values and indices into `[world, rows]` buffers, enqueued on the
    /// backend's main stream (NCCL: capturable).
    #[allow(clippy::type_complexity)]
    pub(crate) gather:
        &'a dyn Fn(&CudaView<'_, f32>, &CudaView<'_, u32>, &mut CudaSlice<f32>, &mut CudaSlice<u32>) -> Result<()>,
}

/// One recorded greedy forward.
struct Recorded {
    key: GraphKey,
    graph: CudaGraph,
    generation: u64,
    /// Logits rows it takes the argmax of.
    logit_rows: usize,
}

/// The backend's recordings and recording state.
pub(super) struct Graphs {
    off: bool,
    recording: bool,
    spoiled: Option<String>,
    /// Moves whenever a buffer a recording may read is replaced.
    generation: u64,
    step: Option<Step>,
    recorded: Vec<Recorded>,
    /// Shapes run eagerly so far, with their eager forwards (recorded after [`EAGER_RUNS`]).
    seen: Vec<(GraphKey, usize)>,
    failures: Vec<(GraphKey, usize)>,
    /// Persistent argmax outputs (values, indices) the recordings and device-staged steps
    /// write (the accept of a device round reads the indices).
    pub(super) argmax: Option<(CudaSlice<f32>, CudaSlice<u32>)>,
    /// The step whose tokens, positions and mask a device round wrote to the staging buffers
    /// (set for the duration of its forward): the forward's host inputs only give its shape,
    /// and its argmax rows are not read back.
    pub(super) on_device: Option<Step>,
    /// Forwards replayed and recorded (for the bench and tests).
    pub(super) replays: u64,
    pub(super) recordings: u64,
}

impl Graphs {
    /// No recordings at all when `off`.
    pub(super) fn new(off: bool) -> Graphs {
        Graphs {
            off,
            recording: false,
            spoiled: None,
            generation: 0,
            step: None,
            recorded: Vec::new(),
            seen: Vec::new(),
            failures: Vec::new(),
            argmax: None,
            on_device: None,
            replays: 0,
            recordings: 0,
        }
    }

    /// Whether a forward is being recorded (nothing runs; nothing may be copied or allocated
    /// for keeps).
    pub(super) fn recording(&self) -> bool {
        self.recording
    }

    /// Marks the recording in progress as unusable.
    pub(super) fn spoil(&mut self, why: String) {
        if self.recording && self.spoiled.is_none() {
            self.spoiled = Some(why);
        }
    }

    /// A buffer recordings may read is being replaced: they are dropped when next used, and a
    /// recording in progress is spoiled (the buffer would be the recording's own).
    pub(super) fn replaced(&mut self, what: &str) {
        self.generation += 1;
        self.spoil(format!("{what} allocated while recording"));
    }

    fn failed(&mut self, key: GraphKey, why: &str) {
        self.seen.retain(|(k, _)| *k != key);
        let n = match self.failures.iter_mut().find(|(k, _)| *k == key) {
            Some((_, n)) => {
                *n += 1;
                *n
            }
            None => {
                self.failures.push((key, 1));
                1
            }
        };
        if n == MAX_FAILURES {
            tracing::warn!("CUDA graph of {key:?} not recorded ({why}); its forwards run eagerly");
        } else {
            tracing::debug!("CUDA graph of {key:?} not recorded ({why}); will retry");
        }
    }
}

impl CudaBackend {
    /// [`Backend::begin_forward`]: stages tokens, positions, mask and cache length (only the
    /// length for a device-staged step, whose shape `step` must have).
    pub(super) fn stage_step(&self, step: &StepInputs<'_>) -> Result<()> {
        let n = step.tokens.len();
        let on_device = self.state().graphs.on_device;
        if let Some(staged) = on_device {
            let words = step.mask.map(AncestorMask::words_per_row);
            if (n, words, step.prefix_len) != (staged.rows, Some(staged.words), staged.prefix) {
                return Err(fail(format!(
                    "a forward of {n} rows (mask words {words:?}) after {} cache rows in place of the device-staged tree step {staged:?}",
                    step.prefix_len
                )));
            }
            self.staged(Staged::Lens, &[step.prefix_len as u32])?;
            self.state().graphs.step = Some(staged);
            return Ok(());
        }
        let chain;
        let mask = match step.mask {
            Some(m) => m,
            None => {
                chain = AncestorMask::causal(n);
                &chain
            }
        };
        self.staged(Staged::Tokens, step.tokens)?;
        self.staged(Staged::Positions, step.positions)?;
        self.staged(Staged::Mask, mask.words())?;
        self.staged(Staged::Lens, &[step.prefix_len as u32])?;
        self.state().graphs.step = Some(Step {
            rows: n,
            words: mask.words_per_row(),
            tree: step.mask.is_some(),
            prefix: step.prefix_len,
        });
        Ok(())
    }

    /// [`Backend::greedy_forward`]: eager on a shape's first [`EAGER_RUNS`] forwards, recorded on
    /// the next, replayed after that.
    pub(crate) fn greedy_graph(
        &self,
        cache: &mut CudaKvCache,
        forward: &mut dyn FnMut(&mut CudaKvCache) -> Result<CudaTensor>,
        reduce: Option<&RankReduce<'_>>,
    ) -> Result<Vec<u32>> {
        let (key, step, on_device) = {
            let st = self.state();
            let on_device = st.graphs.on_device.is_some();
            match st.graphs.step {
                Some(step) if !st.graphs.off && !self.profile.on() => {
                    let (ptr, _sync) = cache.buf().device_ptr(self.stream());
                    let key = GraphKey {
                        rows: step.rows,
                        words: step.words,
                        tree: step.tree,
                        bucket: length_bucket(step.prefix + step.rows),
                        cache: (ptr, cache.capacity),
                        rank: reduce.map_or((0, 1), |r| (r.rank, r.world)),
                    };
                    (key, step, on_device)
                }
                _ => {
                    drop(st);
                    return self.eager(cache, forward, on_device, reduce);
                }
            }
        };
        if step.prefix + step.rows > cache.capacity {
            return Err(EngineError::Forward(format!(
                "KV cache full: {} + {} rows exceed its capacity of {}",
                step.prefix, step.rows, cache.capacity
            )));
        }
        {
            let mut st = self.state();
            let g = &mut st.graphs;
            if g.failures.iter().any(|(k, n)| *k == key && *n >= MAX_FAILURES) {
                drop(st);
                return self.eager(cache, forward, on_device, reduce);
            }
            if let Some(i) = g.recorded.iter().position(|r| r.key == key) {
                if g.recorded[i].generation == g.generation {
                    drop(st);
                    return self.replay(cache, key, step, on_device);
                }
                g.recorded.remove(i);
            }
            let runs = match g.seen.iter_mut().find(|(k, _)| *k == key) {
                Some((_, n)) => n,
                None => {
                    g.seen.push((key, 0));
                    &mut g.seen.last_mut().expect("pushed above").1
                }
            };
            if *runs < EAGER_RUNS {
                *runs += 1;
                drop(st);
                return self.eager(cache, forward, on_device, reduce);
            }
            let need = step.rows;
            if g.argmax.as_ref().is_none_or(|(_, i)| i.len() < need) {
                // Before the recording: allocated inside it, they would be the recording's own.
                g.replaced("the argmax outputs");
                let n = need.next_power_of_two();
                g.argmax = Some((self.alloc(n)?, self.alloc(n)?));
            }
            g.recording = true;
            self.recording.store(true, std::sync::atomic::Ordering::Relaxed);
            g.spoiled = None;
        }
        let generation = self.state().graphs.generation;
        let begun = self
            .main
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
        let result = match begun {
            Ok(()) => forward(cache).and_then(|logits| self.argmax_kept(&logits, reduce)),
            Err(e) => Err(fail(format!("starting a CUDA graph capture: {e}"))),
        };
        // A branch's outputs are freed on the side stream after its join, when the main stream
        // is done with them: a capture must end with the side stream joined.
        let joined = self.join_side();
        let result = result.and_then(|rows| joined.map(|()| rows));
        let graph = match begun {
            Ok(()) => self
                .main
                // Node priorities: a branch's kernels keep the side stream's lower priority.
                .end_capture(
                    sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH
                        | sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY,
                ),
            Err(e) => Err(e),
        };
        self.recording.store(false, std::sync::atomic::Ordering::Relaxed);
        // The recording ran nothing: undo its one host-side effect.
        self.kv_truncate(cache, step.prefix)?;
        let mut st = self.state();
        let g = &mut st.graphs;
        g.recording = false;
        let spoiled = g.spoiled.take();
        let why = match (result, graph) {
            (Ok(logit_rows), Ok(Some(graph))) if spoiled.is_none() && g.generation == generation => {
                g.recordings += 1;
                if g.recorded.len() >= MAX_GRAPHS {
                    g.recorded.remove(0);
                }
                g.recorded.push(Recorded {
                    key,
                    graph,
                    generation,
                    logit_rows,
                });
                drop(st);
                return self.replay(cache, key, step, on_device);
            }
            (Err(e), _) => e.to_string(),
            (_, Err(e)) => format!("ending the capture: {e}"),
            (_, Ok(None)) => "the capture was empty".into(),
            _ => spoiled.unwrap_or_else(|| "a buffer was replaced while recording".into()),
        };
        g.failed(key, &why);
        drop(st);
        self.eager(cache, forward, on_device, reduce)
    }

    /// Runs `forward` and reads its argmax rows back, or with `on_device` leaves them in the
    /// persistent outputs (and returns no rows).
    fn eager(
        &self,
        cache: &mut CudaKvCache,
        forward: &mut dyn FnMut(&mut CudaKvCache) -> Result<CudaTensor>,
        on_device: bool,
        reduce: Option<&RankReduce<'_>>,
    ) -> Result<Vec<u32>> {
        let logits = forward(cache)?;
        if on_device || reduce.is_some() {
            let rows = self.argmax_kept(&logits, reduce)?;
            if on_device {
                return Ok(Vec::new());
            }
            let st = self.state();
            let (_, indices) = st.graphs.argmax.as_ref().expect("written by argmax_kept");
            return self.read_back(&indices.slice(..rows));
        }
        self.argmax_rows(&logits)
    }

    /// Launches the recording of `key` and reads its argmax rows (none with `on_device`: they
    /// stay in the persistent outputs).
    fn replay(&self, cache: &mut CudaKvCache, key: GraphKey, step: Step, on_device: bool) -> Result<Vec<u32>> {
        let mut st = self.state();
        let recorded = &mut st.graphs.recorded;
        let i = recorded
            .iter()
            .position(|r| r.key == key)
            .ok_or_else(|| fail("CUDA graph vanished before its replay".into()))?;
        // Most recently replayed last: a new recording past `MAX_GRAPHS` evicts the coldest
        // one, not the oldest (the decode step's and the common tree sizes' stay).
        let rec = recorded.remove(i);
        recorded.push(rec);
        let rec = recorded.last().expect("pushed above");
        rec.graph.launch().map_err(drv("launching a CUDA graph"))?;
        let rows = rec.logit_rows;
        let (_, indices) = st.graphs.argmax.as_ref().expect("recordings write the argmax outputs");
        let out = if on_device {
            Vec::new()
        } else {
            self.read_back(&indices.slice(..rows))?
        };
        drop(st);
        self.state().graphs.replays += 1;
        for len in cache.lens.iter_mut() {
            *len = step.prefix + step.rows;
        }
        Ok(out)
    }

    /// The argmax of every row of `logits` into the persistent outputs (grown when too small:
    /// recordings allocate them before they start), reduced across the ranks with `reduce`;
    /// returns the row count.
    fn argmax_kept(&self, logits: &CudaTensor, reduce: Option<&RankReduce<'_>>) -> Result<usize> {
        let mut st = self.state();
        let st = &mut *st;
        let g = &mut st.graphs;
        if g.argmax.as_ref().is_none_or(|(_, i)| i.len() < logits.rows) {
            g.replaced("the argmax outputs");
            let n = logits.rows.next_power_of_two();
            g.argmax = Some((self.alloc(n)?, self.alloc(n)?));
        }
        let (mut values, mut indices) = g.argmax.take().expect("allocated above");
        let mut done = self.argmax_into(st, logits, &mut values, &mut indices);
        if let (Ok(()), Some(r)) = (&done, reduce) {
            done = self.rank_argmax(r, logits.rows, &values, &mut indices);
        }
        st.graphs.argmax = Some((values, indices));
        done?;
        Ok(logits.rows)
    }

    /// Every rank's `(max, local column)` of `rows` rows all-gathered, and the global greedy
    /// token of each row written over `indices` (no host sync: capturable with NCCL).
    fn rank_argmax(
        &self,
        r: &RankReduce<'_>,
        rows: usize,
        values: &CudaSlice<f32>,
        indices: &mut CudaSlice<u32>,
    ) -> Result<()> {
        let mut all_v = self.alloc::<f32>(r.world * rows)?;
        let mut all_i = self.alloc::<u32>(r.world * rows)?;
        (r.gather)(&values.slice(..rows), &indices.slice(..rows), &mut all_v, &mut all_i)?;
        let k = self.first_variant::<RankArgmax>(|_| true)?;
        RankArgmaxOp {
            values: &all_v,
            indices: &all_i,
            out: &mut indices.slice_mut(..rows),
            rows,
            world: r.world,
            slice: r.slice,
        }
        .launch(&k, &self.main)?;
        Ok(())
    }

    /// [`CudaBackend::rank_argmax`] outside a step: `values` / `indices` from
    /// [`CudaBackend::argmax_on_device`].
    pub(crate) fn rank_argmax_into(
        &self,
        r: &RankReduce<'_>,
        rows: usize,
        values: &CudaSlice<f32>,
        indices: &mut CudaSlice<u32>,
    ) -> Result<()> {
        self.rank_argmax(r, rows, values, indices)
    }

    /// Reads the first `rows` values of `indices` (counted in the host reads).
    pub(crate) fn read_rows(&self, indices: &CudaSlice<u32>, rows: usize) -> Result<Vec<u32>> {
        self.read_back(&indices.slice(..rows))
    }

    /// Whether a greedy forward is being recorded (nothing runs: no events to time).
    pub(crate) fn is_recording(&self) -> bool {
        self.recording.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Drops every recording (when next used): the communicator their collectives were
    /// recorded with has been replaced.
    pub(crate) fn forget_graphs(&self) {
        self.state().graphs.replaced("the communicator");
    }

    /// Forwards replayed from and recorded into CUDA graphs so far.
    pub(super) fn graph_counts_now(&self) -> (u64, u64) {
        let st = self.state();
        (st.graphs.replays, st.graphs.recordings)
    }
}
