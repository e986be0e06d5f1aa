//! Greedy DDTree rounds with the tree on the GPU ([`Backend::device_tree_round`]).
//!
//! A round enqueues, on the backend's main stream and without a host sync in between:
//!
//! 1. the tree build ([`GpuBuilder::build`]) from the drafter's logits, its root token copied
//!    to the device;
//! 2. the tree's staging ([`GpuBuilder::stage`]): a kernel writes the node tokens, positions
//!    and mask rows into the forward's staging buffers, the ones recorded CUDA graphs read (at
//!    the same addresses: a buffer is only replaced when it is too small or shared, and that
//!    drops the recordings, as a host-staged step outgrowing it does);
//! 3. the verify forward over the tree (replayed from its CUDA graph, or eager), whose host
//!    inputs only give the step's shape: the node count is known on the host
//!    ([`GpuBuilder::nodes`], [`ddtree_kernels::tree::tree_size`]), and the argmax rows stay on
//!    the device in the persistent outputs;
//! 4. the accept walk over those argmax rows and the compaction of the accepted cache rows
//!    ([`GpuAccept`]), which read the accepted indices on the device.
//!
//! Then one copy to the host, the accept result (accepted length, indices and the target's
//! token at each, the last being the bonus), the round's only host sync. `--budget auto`
//! (uncalibrated) reads the built tree's path log-probs first, picks the top-B tree from them
//! and stages and accepts only its nodes (the first B + 1 in best-first order,
//! [`GpuBuilder::truncate`]). Rounds that keep the tree on the host (calibrated `auto`,
//! sampling, drafter features, kept logits) read the whole tree back after the build
//! ([`Backend::draft_tree`]) and the argmax rows or logits after the verify.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ddtree_kernels::tree::gpu::{builder_params, GpuAccept, GpuBuilder};
use ddtree_kernels::tree::{Acceptance, MAX_K};
use ddtree_runtime::cudarc::driver::{CudaEvent, CudaSlice};

use super::Lookup;
use super::{drv, fail, CudaBackend, CudaKvCache, CudaTensor, DeviceData, Staged, State, CU_EVENT_DEFAULT};
use crate::backend::{BudgetChoice, GreedyVerify, TreeRound, TreeRoundOutcome};
use crate::error::{EngineError, Result};
use crate::mask::AncestorMask;
use crate::model::{ForwardInput, LogitRows};
use ddtree_kernels::tree::{self, build_reference, DraftTree, TreeBuild};

/// The deepest tree the GPU builder takes (and the accept's path buffers hold).
const MAX_DEPTH: usize = 16;

impl CudaBackend {
    /// [`Backend::device_tree_round`]: `None` where the GPU builder or the compaction kernel
    /// does not take the shape (the caller's host path then runs the round).
    pub(super) fn tree_round(
        &self,
        cache: &mut CudaKvCache,
        round: TreeRound<'_, CudaTensor>,
        verify: &mut GreedyVerify<'_, CudaKvCache>,
    ) -> Result<Option<TreeRoundOutcome>> {
        let TreeRound {
            drafted,
            depth,
            budget,
            root,
            start,
            choose,
        } = round;
        let vocab = drafted.cols;
        let (layers, width) = (cache.lens.len(), cache.width);
        let DeviceData::F32(logits) = &drafted.data else {
            return Ok(None);
        };
        let fits = (1..=MAX_DEPTH).contains(&depth)
            && depth <= drafted.rows
            && (1..=MAX_K).contains(&budget)
            && builder_params(vocab, budget).is_some()
            && width % 8 == 0
            && layers * cache.capacity * width <= u32::MAX as usize;
        if !fits {
            return Ok(None);
        }
        if self.kv_len(cache) != start {
            return Err(EngineError::Forward(format!(
                "a tree round at position {start} on a cache of {} rows",
                self.kv_len(cache)
            )));
        }

        // Phase times come from events on the stream (the host only enqueues until the accept
        // result's read): build = staged tree, verify = the forward, accept = the rest of the
        // round's wall time (the accept kernels, the read, and drafter work still running when
        // the build was enqueued).
        let round_start = Instant::now();
        let mark = || {
            self.stream()
                .record_event(Some(CU_EVENT_DEFAULT))
                .map_err(drv("recording an event"))
        };
        let e_build = mark()?;
        let nodes = {
            let mut st = self.state();
            let at = self.builder_index(&mut st, depth, vocab, budget)?;
            self.stage_tree(&mut st, at, logits, root, start, choose)?
        };
        let e_verify = mark()?;
        let words = nodes.div_ceil(32);
        // Stand-ins of the right shape: the staging buffers hold the tree. Each stand-in
        // position bounds its node's (a node's depth is at most its index and the tree's
        // depth), which is all the host side reads of them (the context check, the rope
        // tables' size).
        let tokens = vec![0u32; nodes];
        let positions: Vec<u32> = (0..nodes).map(|i| (start + i.min(depth)) as u32).collect();
        let mask = AncestorMask::causal(nodes);
        let input = ForwardInput {
            tokens: &tokens,
            positions: &positions,
            mask: Some(&mask),
            logits: LogitRows::All,
        };
        self.state().graphs.on_device = Some(super::graph::Step {
            rows: nodes,
            words,
            tree: true,
            prefix: start,
        });
        let verified = verify(cache, input);
        self.state().graphs.on_device = None;
        verified?;
        let e_accept = mark()?;

        let accepted = self.accept_tree(cache, (depth, vocab, budget), start)?;
        let len = accepted.indices.len();
        let valid = accepted.indices[0] == 0
            && accepted.indices.windows(2).all(|w| w[0] < w[1])
            && accepted.indices.iter().all(|&i| (i as usize) < nodes);
        if !valid {
            return Err(fail(format!(
                "the GPU accept of a {nodes}-node tree returned the path {:?}",
                accepted.indices
            )));
        }
        cache.lens.iter_mut().for_each(|l| *l = start + len);
        // The read waited for every event.
        let gpu = |a: &CudaEvent, b: &CudaEvent| {
            a.elapsed_ms(b)
                .map(|ms| Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
                .map_err(drv("reading an event"))
        };
        let build = gpu(&e_build, &e_verify)?;
        let verify_time = gpu(&e_verify, &e_accept)?;
        Ok(Some(TreeRoundOutcome {
            nodes,
            accepted,
            build,
            verify: verify_time,
            accept: round_start.elapsed().saturating_sub(build + verify_time),
        }))
    }

    /// Builds the tree of builder `at` from `logits` under `root`, cuts it to the top-`B` tree
    /// `choose` picks from the path log-probs (read back), if given, and writes it to the
    /// token, position and mask staging buffers (positions from `start`); returns its node
    /// count.
    fn stage_tree(
        &self,
        st: &mut State,
        at: usize,
        logits: &CudaSlice<f32>,
        root: u32,
        start: usize,
        choose: Option<&mut BudgetChoice<'_>>,
    ) -> Result<usize> {
        let nodes = st.builders[at].1.nodes();
        let words = nodes.div_ceil(32);
        for (slot, len) in [
            (Staged::Tokens, nodes),
            (Staged::Positions, nodes),
            (Staged::Mask, nodes * words),
        ] {
            self.device_slot(st, slot, len)?;
        }
        if st.accept.is_none() {
            let accept = GpuAccept::new(self.gpu(), MAX_DEPTH)?;
            st.accept = Some((accept, self.alloc(1)?));
        }
        let State {
            staged,
            builders,
            accept,
            ..
        } = st;
        let (_, root_buf) = accept.as_mut().expect("made above");
        self.stream()
            .memcpy_htod(&[root], root_buf)
            .map_err(drv("copying to the GPU"))?;
        let builder: &mut GpuBuilder = &mut builders[at].1;
        builder.build(self.stream(), logits, root_buf)?;
        let nodes = match choose {
            Some(choose) => {
                self.count_read();
                let lp = builder.path_logprobs(self.stream())?;
                let n = choose(&lp[1..]).min(nodes - 1) + 1;
                builder.truncate(self.stream(), n)?;
                n
            }
            None => nodes,
        };
        let (mut tokens, mut positions, mut mask) = (None, None, None);
        for (slot, _, d) in staged.iter_mut() {
            let dst = match slot {
                Staged::Tokens => &mut tokens,
                Staged::Positions => &mut positions,
                Staged::Mask => &mut mask,
                Staged::Lens => continue,
            };
            *dst = Arc::get_mut(d);
        }
        let (Some(tokens), Some(positions), Some(mask)) = (tokens, positions, mask) else {
            return Err(fail("the staging buffers are in use".into()));
        };
        builder.stage(self.stream(), start as u32, nodes, tokens, positions, mask)?;
        Ok(nodes)
    }

    /// Makes `slot` a buffer of at least `len` values for a kernel to write (its host copy
    /// forgotten): the same buffer when it is large enough and not shared, else a new one (which
    /// drops the recordings that read the old, as [`CudaBackend::staged`] does).
    fn device_slot(&self, st: &mut State, slot: Staged, len: usize) -> Result<()> {
        if let Some(i) = st.staged.iter().position(|(s, ..)| *s == slot) {
            let (_, old, d) = &mut st.staged[i];
            if d.len() >= len && Arc::get_mut(d).is_some() {
                *old = None;
                return Ok(());
            }
            st.staged.remove(i);
        }
        st.graphs.replaced("a staging buffer");
        let d = self.alloc::<u32>(len.next_power_of_two().max(64))?;
        st.staged.push((slot, None, Arc::new(d)));
        Ok(())
    }

    /// The accept walk of the tree of builder `key` over the verify's argmax rows, the
    /// compaction of the accepted rows after `start` in every layer of `cache`, and the one
    /// read of the result.
    fn accept_tree(&self, cache: &mut CudaKvCache, key: (usize, usize, usize), start: usize) -> Result<Acceptance> {
        let mut st = self.state();
        let State {
            builders,
            accept,
            graphs,
            ..
        } = &mut *st;
        let builder = &builders
            .iter()
            .find(|(k, _)| *k == key)
            .ok_or_else(|| fail("the round's tree builder vanished".into()))?
            .1;
        let (accept, root_buf) = accept.as_mut().ok_or_else(|| fail("no GPU accept".into()))?;
        let (_, target) = graphs
            .argmax
            .as_ref()
            .ok_or_else(|| fail("the verify left no argmax rows on the device".into()))?;
        accept.accept(self.stream(), builder, target, root_buf)?;
        let layers = cache.lens.len();
        let (width, capacity) = (cache.width, cache.capacity);
        accept.compact(self.stream(), cache.buf_mut(), layers, start, width, capacity * width)?;
        self.count_read();
        Ok(accept.read(self.stream())?)
    }
}

impl CudaBackend {
    /// The index in `st.builders` of the GPU tree builder for `depth`, `vocab` and `budget`,
    /// made on first use with the tuned variant of its [`TreeBuildKey`] (kernels load once;
    /// buffers are small, a few trees).
    pub(super) fn builder_index(&self, st: &mut State, depth: usize, vocab: usize, budget: usize) -> Result<usize> {
        let key = (depth, vocab, budget);
        if let Some(i) = st.builders.iter().position(|(k, _)| *k == key) {
            return Ok(i);
        }
        let kernel = self.tuned::<TreeBuild>(Lookup::tree_build(depth, vocab, budget))?;
        st.builders.push((
            key,
            tree::gpu::GpuBuilder::with_kernel(self.gpu(), kernel, depth, vocab, budget)?,
        ));
        Ok(st.builders.len() - 1)
    }

    /// [`Backend::draft_tree`] on the GPU.
    pub(super) fn draft_tree(&self, drafted: &CudaTensor, depth: usize, budget: usize, root: u32) -> Result<DraftTree> {
        let _span = self.profile.span("draft_tree");
        let vocab = drafted.cols;
        if depth == 0 || depth > 16 || budget > tree::MAX_K || depth > drafted.rows {
            let host = self.to_host(drafted)?;
            return Ok(build_reference(&host.data[..depth * vocab], depth, vocab, budget, root));
        }
        let logits = drafted.f32("draft_tree")?;
        let root = self.upload(&[root])?;
        let mut st = self.state();
        let at = self.builder_index(&mut st, depth, vocab, budget)?;
        let builder = &mut st.builders[at].1;
        builder.build(self.stream(), logits, &root)?;
        // One read of the whole tree (its arrays copied back one after another).
        self.count_read();
        Ok(builder.download(self.stream())?.0)
    }
}
