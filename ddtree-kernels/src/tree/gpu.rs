//! Host drivers of the tree kernels on a [`Gpu`]: the builder (one launch into device
//! buffers, no host copy) and the staging of its tree as a verify step's inputs, the verify
//! attention (split + combine, or naive), accept (one launch, its result read with one copy)
//! and compaction. Used by the GPU checks, the bench and the CUDA engine backend's greedy
//! rounds.

use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use ddtree_runtime::{CompiledKernel, Gpu, RuntimeError};
use half::bf16;

use super::build::expansion_candidates;
use super::{
    combine_grid, combine_layout, combine_output_grid, Acceptance, CompactRows, DraftTree, MlaCombineOutput,
    MlaVerifyCombine, MlaVerifyNaive, MlaVerifyNarrow, MlaVerifySplit, MlaVerifyWg, MlaVerifyWide, TreeAccept,
    TreeBuild, TreeBuildParams, TreeStage, VerifyVariant, LATENT, MAX_K,
};

fn drv(context: &'static str) -> impl FnOnce(ddtree_runtime::cudarc::driver::DriverError) -> RuntimeError {
    move |source| RuntimeError::Driver {
        context: context.into(),
        source,
    }
}

/// A zeroed device buffer.
pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(s: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<T>, RuntimeError> {
    s.alloc_zeros(n.max(1)).map_err(drv("allocating"))
}

/// Copies `v` to the device.
pub fn upload<T: DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> Result<CudaSlice<T>, RuntimeError> {
    s.clone_htod(v).map_err(drv("copying to the GPU"))
}

/// Copies `d` to the host.
pub fn download<T: DeviceRepr + Default + Clone>(
    s: &Arc<CudaStream>,
    d: &CudaSlice<T>,
) -> Result<Vec<T>, RuntimeError> {
    s.clone_dtoh(d).map_err(drv("copying from the GPU"))
}

/// How far a [`GpuBuilder::build_until`] launch runs (for timing the builder's stages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BuildStage {
    /// The slice top-k and log-sum-exp partials.
    Slice = 0,
    /// Plus the per-depth merges (log-probs, tokens, log-sum-exp).
    Merge = 1,
    /// Plus the best-first expansion loop.
    Expand = 2,
    /// The whole build: plus the tree arrays and mask rows.
    All = 3,
}

/// The GPU tree builder for fixed `depth`, `vocab` and `budget`, with its device buffers.
pub struct GpuBuilder {
    kernel: Arc<CompiledKernel<TreeBuild>>,
    stage: CompiledKernel<TreeStage>,
    depth: usize,
    vocab: usize,
    budget: usize,
    k: usize,
    span: usize,
    nb: usize,
    /// The nodes [`GpuAccept::accept`] walks: the last build's [`GpuBuilder::nodes`], or its
    /// [cut](GpuBuilder::truncate).
    walk: usize,
    /// Per-depth log-sum-exp `[depth]`.
    pub lse: CudaSlice<f32>,
    cand_key: CudaSlice<u32>,
    cand_tok: CudaSlice<u32>,
    part_ms: CudaSlice<f32>,
    counters: CudaSlice<u32>,
    lp: CudaSlice<f32>,
    tok: CudaSlice<u32>,
    /// Node tokens (capacity `budget + 1`).
    pub token: CudaSlice<u32>,
    /// Parents.
    pub parent: CudaSlice<i32>,
    /// Depths.
    pub depth_out: CudaSlice<u32>,
    /// First children.
    pub first_child: CudaSlice<i32>,
    /// Next siblings.
    pub next_sibling: CudaSlice<i32>,
    /// Path log-probs.
    pub path_lp: CudaSlice<f32>,
    /// Node count `[1]`.
    pub n: CudaSlice<u32>,
    /// Mask rows `[n, ceil(n / 32)]` (capacity for `budget + 1` nodes).
    pub mask: CudaSlice<u32>,
}

/// Whether builder variant `p` takes `vocab` at `budget`: each depth's merge holds its
/// `ceil(vocab / tile) * min(budget, vocab)` slice candidates in one tile (`p.tile()`), and a
/// [sorted](TreeBuildParams::sorted) variant merges sorted lists (`k <= 64`, at most 64 slices).
pub fn builder_fits(p: &TreeBuildParams, vocab: usize, budget: usize) -> bool {
    let tile = p.tile() as usize;
    let (slices, k) = (vocab.div_ceil(tile), budget.min(vocab));
    slices * k <= tile && (!p.sorted || (k <= 64 && slices <= 64))
}

/// The first builder variant (the default when it fits) that takes `vocab` at `budget`.
pub fn builder_params(vocab: usize, budget: usize) -> Option<TreeBuildParams> {
    TreeBuild::space().into_iter().find(|p| builder_fits(p, vocab, budget))
}

impl GpuBuilder {
    /// Compiles the first variant that [fits](builder_params) and allocates the buffers.
    /// Needs `budget <= 1024`, `depth <= 16`, and a fitting variant (every vocabulary up to
    /// 163840 at every budget has one).
    pub fn new(gpu: &Gpu, depth: usize, vocab: usize, budget: usize) -> Result<GpuBuilder, RuntimeError> {
        let p = builder_params(vocab, budget).ok_or_else(|| RuntimeError::Launch {
            kernel: TreeBuild::symbol(&TreeBuild::default_params()),
            reason: format!("no tree builder variant takes vocab {vocab} at budget {budget}"),
        })?;
        GpuBuilder::with_params(gpu, &p, depth, vocab, budget)
    }

    /// [`GpuBuilder::new`] with variant `p`, which must [fit](builder_fits) the shape.
    pub fn with_params(
        gpu: &Gpu,
        p: &TreeBuildParams,
        depth: usize,
        vocab: usize,
        budget: usize,
    ) -> Result<GpuBuilder, RuntimeError> {
        GpuBuilder::with_kernel(gpu, Arc::new(gpu.compile::<TreeBuild>(p)?), depth, vocab, budget)
    }

    /// [`GpuBuilder::new`] with a compiled variant (e.g. the tuned one of
    /// [`crate::tune::TreeBuildKey`]), which must [fit](builder_fits) the shape.
    pub fn with_kernel(
        gpu: &Gpu,
        kernel: Arc<CompiledKernel<TreeBuild>>,
        depth: usize,
        vocab: usize,
        budget: usize,
    ) -> Result<GpuBuilder, RuntimeError> {
        let p = *kernel.params();
        assert!(
            (1..=MAX_K).contains(&budget) && (1..=16).contains(&depth) && vocab >= 1,
            "budget 1..=1024, depth 1..=16"
        );
        assert!(
            builder_fits(&p, vocab, budget),
            "vocab {vocab} at budget {budget} needs too many slice candidates for {p:?}"
        );
        let s = gpu.stream();
        let k = budget.min(vocab);
        // Slice blocks per depth: as few as the variant's tile allows.
        let nb = vocab.div_ceil(p.tile() as usize);
        let span = vocab.div_ceil(nb);
        let cap = budget + 1;
        let cands = (depth * nb * k).max(expansion_candidates(budget, k));
        Ok(GpuBuilder {
            kernel,
            stage: gpu.compile::<TreeStage>(&())?,
            depth,
            vocab,
            budget,
            k,
            span,
            nb,
            walk: super::tree_size(depth, vocab, budget),
            lse: zeros(s, depth)?,
            cand_key: zeros(s, cands)?,
            cand_tok: zeros(s, cands)?,
            part_ms: zeros(s, depth * nb * 2)?,
            counters: zeros(s, depth + 1)?,
            lp: zeros(s, depth * k)?,
            tok: zeros(s, depth * k)?,
            token: zeros(s, cap)?,
            parent: zeros(s, cap)?,
            depth_out: zeros(s, cap)?,
            first_child: zeros(s, cap)?,
            next_sibling: zeros(s, cap)?,
            path_lp: zeros(s, cap)?,
            n: zeros(s, 1)?,
            mask: zeros(s, cap * cap.div_ceil(32))?,
        })
    }

    /// Builds the tree from `logits` (`[depth, vocab]` on the device) and the root token
    /// `root[0]`: one launch, no host synchronisation.
    pub fn build(
        &mut self,
        s: &Arc<CudaStream>,
        logits: &CudaSlice<f32>,
        root: &CudaSlice<u32>,
    ) -> Result<(), RuntimeError> {
        self.build_until(s, logits, root, BuildStage::All)
    }

    /// [`GpuBuilder::build`] up to and including `stage` (the later stages' outputs are left
    /// as they were).
    pub fn build_until(
        &mut self,
        s: &Arc<CudaStream>,
        logits: &CudaSlice<f32>,
        root: &CudaSlice<u32>,
        stage: BuildStage,
    ) -> Result<(), RuntimeError> {
        let kernel = self.kernel.clone();
        self.launch(&kernel, s, logits, root, stage)
    }

    /// [`GpuBuilder::build`] launching `kernel`, a compiled copy of this builder's variant (the
    /// tuner times the variants it compiled on buffers made for each).
    pub(crate) fn build_with(
        &mut self,
        kernel: &CompiledKernel<TreeBuild>,
        s: &Arc<CudaStream>,
        logits: &CudaSlice<f32>,
        root: &CudaSlice<u32>,
    ) -> Result<(), RuntimeError> {
        self.launch(kernel, s, logits, root, BuildStage::All)
    }

    fn launch(
        &mut self,
        kernel: &CompiledKernel<TreeBuild>,
        s: &Arc<CudaStream>,
        logits: &CudaSlice<f32>,
        root: &CudaSlice<u32>,
        stage: BuildStage,
    ) -> Result<(), RuntimeError> {
        assert_eq!(
            kernel.params(),
            self.params(),
            "the builder's buffers are sized for its own variant"
        );
        self.walk = self.nodes();
        let (v, k, span, nb) = (self.vocab as u32, self.k as u32, self.span as u32, self.nb as u32);
        let d = self.depth as u32;
        // SAFETY: logits hold depth * vocab values; candidates depth * nb * k and
        // expansion_candidates(budget, k), partials
        // depth * nb * 2, counters depth + 1 (zero between launches); span <= the variant's
        // tile, k <= min(MAX_K, vocab), nb * k <= the tile; the tree outputs hold budget + 1
        // nodes (mask rows included), budget <= 1024, depth <= 16.
        unsafe {
            TreeBuild::launch(
                kernel,
                s,
                (nb, d),
                logits,
                root,
                &mut self.cand_key,
                &mut self.cand_tok,
                &mut self.part_ms,
                &mut self.lp,
                &mut self.tok,
                &mut self.lse,
                &mut self.counters,
                &mut self.token,
                &mut self.parent,
                &mut self.depth_out,
                &mut self.first_child,
                &mut self.next_sibling,
                &mut self.path_lp,
                &mut self.n,
                &mut self.mask,
                v,
                k,
                span,
                d,
                self.budget as u32,
                stage as u32,
            )
        }
    }

    /// The variant this builder launches.
    pub fn params(&self) -> &TreeBuildParams {
        self.kernel.params()
    }

    /// The node count (root included) every [`GpuBuilder::build`] of this builder makes:
    /// [`super::tree_size`], known without reading the tree back.
    pub fn nodes(&self) -> usize {
        super::tree_size(self.depth, self.vocab, self.budget)
    }

    /// Writes the first `n` nodes of the last build's tree (at most [`GpuBuilder::nodes`]; the
    /// top-`(n - 1)` tree) as a verify step's inputs (one launch, no host copy): node tokens to
    /// `tokens`, positions `start + depth` to `positions`, and the mask rows (`[n, ceil(n /
    /// 32)]`) to `mask`; each must hold that many.
    pub fn stage(
        &self,
        s: &Arc<CudaStream>,
        start: u32,
        n: usize,
        tokens: &mut impl DevicePtrMut<u32>,
        positions: &mut impl DevicePtrMut<u32>,
        mask: &mut impl DevicePtrMut<u32>,
    ) -> Result<(), RuntimeError> {
        assert!(
            (1..=self.nodes()).contains(&n),
            "staging {n} of a {}-node tree",
            self.nodes()
        );
        let words = n.div_ceil(32);
        let in_words = self.nodes().div_ceil(32);
        let grid = (n * words).div_ceil(256) as u32;
        // SAFETY: the build wrote nodes() >= n nodes with mask rows of `in_words` words
        // (capacity budget + 1 nodes); the outputs hold n, n and n * words values (the caller's
        // contract).
        unsafe {
            TreeStage::launch(
                &self.stage,
                s,
                grid,
                &self.token,
                &self.depth_out,
                &self.mask,
                tokens,
                positions,
                mask,
                n as u32,
                words as u32,
                in_words as u32,
                start,
            )
        }
    }

    /// The path log-probs of the last build's nodes in best-first order (root first; one read,
    /// for a budget chosen from them).
    pub fn path_logprobs(&self, s: &Arc<CudaStream>) -> Result<Vec<f32>, RuntimeError> {
        s.clone_dtoh(&self.path_lp.slice(..self.nodes()))
            .map_err(drv("copying from the GPU"))
    }

    /// Cuts the last build's tree to its first `n` nodes (its top-`(n - 1)` tree, at most
    /// [`GpuBuilder::nodes`]) for the next [`GpuAccept::accept`], which walks that many: an
    /// asynchronous copy of the count, no host sync.
    pub fn truncate(&mut self, s: &Arc<CudaStream>, n: usize) -> Result<(), RuntimeError> {
        assert!(
            (1..=self.nodes()).contains(&n),
            "cutting a {}-node tree to {n}",
            self.nodes()
        );
        self.walk = n;
        s.memcpy_htod(&[n as u32], &mut self.n)
            .map_err(drv("copying the node count to the GPU"))
    }

    /// Downloads the tree (cut as by [`GpuBuilder::truncate`], if it was) and the per-depth
    /// log-sum-exp (for checks and the host path; not part of a device round).
    pub fn download(&self, s: &Arc<CudaStream>) -> Result<(DraftTree, Vec<f32>), RuntimeError> {
        let cut_to = download(s, &self.n)?[0] as usize;
        // The build wrote `nodes()` nodes with mask rows of that many bits.
        let n = self.nodes().max(cut_to);
        let words = n.div_ceil(32);
        let cut = |v: Vec<u32>| v[..n].to_vec();
        let cuti = |v: Vec<i32>| v[..n].to_vec();
        let mut tree = DraftTree {
            token: cut(download(s, &self.token)?),
            parent: cuti(download(s, &self.parent)?),
            depth: cut(download(s, &self.depth_out)?),
            first_child: cuti(download(s, &self.first_child)?),
            next_sibling: cuti(download(s, &self.next_sibling)?),
            mask: download(s, &self.mask)?[..n * words].to_vec(),
            words,
            path_logprob: download(s, &self.path_lp)?[..n].to_vec(),
        };
        if cut_to < n {
            tree.truncate(cut_to.max(1));
        }
        Ok((tree, download(s, &self.lse)?))
    }
}

/// Greedy accept (and, with sampled targets, the sampling accept) plus compaction.
///
/// The accept result sits in one buffer, `[len, accepted[0..=depth], path_target[0..=depth]]`,
/// so that a host reads it with one copy ([`GpuAccept::read`]).
pub struct GpuAccept {
    accept: CompiledKernel<TreeAccept>,
    compact: CompiledKernel<CompactRows>,
    depth: usize,
    /// The accept result, `1 + 2 (depth + 1)` words as above.
    pub result: CudaSlice<u32>,
}

impl GpuAccept {
    /// Compiles the kernels; `depth` is the tree's maximum depth.
    pub fn new(gpu: &Gpu, depth: usize) -> Result<GpuAccept, RuntimeError> {
        let s = gpu.stream();
        Ok(GpuAccept {
            accept: gpu.compile::<TreeAccept>(&())?,
            compact: gpu.compile::<CompactRows>(&())?,
            depth,
            result: zeros(s, 1 + 2 * (depth + 1))?,
        })
    }

    /// Walks the tree built by `b` (its first `n` nodes after [`GpuBuilder::truncate`]`(n)`)
    /// with the target's tokens per node (`target`, one per node);
    /// writes the result and the bonus token to `bonus[0]` (pass the next build's root buffer).
    /// The builder's depth must be at most this accept's.
    pub fn accept(
        &mut self,
        s: &Arc<CudaStream>,
        b: &GpuBuilder,
        target: &impl DevicePtr<u32>,
        bonus: &mut CudaSlice<u32>,
    ) -> Result<(), RuntimeError> {
        assert!(b.depth <= self.depth, "a tree deeper than the accept's path buffers");
        let d = self.depth + 1;
        let (mut len, mut rest) = self.result.split_at_mut(1);
        let (mut accepted, mut path) = rest.split_at_mut(d);
        // SAFETY: the tree arrays come from one build of b.nodes() >= b.walk nodes (at most
        // 1025, depth at most self.depth); target holds one token per walked node; accepted and
        // path hold depth + 1 entries each (a path has at most depth + 1 nodes).
        unsafe {
            TreeAccept::launch(
                &self.accept,
                s,
                1u32,
                &b.token,
                &b.parent,
                &b.depth_out,
                target,
                &mut accepted,
                &mut path,
                &mut len,
                bonus,
                b.walk as u32,
            )
        }
    }

    /// Reads the result of the last [`GpuAccept::accept`] with one copy: the accepted node
    /// indices and the target's token at each (the bonus is the last token).
    pub fn read(&self, s: &Arc<CudaStream>) -> Result<Acceptance, RuntimeError> {
        let r = download(s, &self.result)?;
        let d = self.depth + 1;
        let len = (r[0] as usize).clamp(1, d);
        let tokens = r[1 + d..1 + d + len].to_vec();
        Ok(Acceptance {
            indices: r[1..1 + len].to_vec(),
            bonus: tokens[len - 1],
            tokens,
        })
    }

    /// Copies the accepted rows of `layers` layers (each `layer_stride` bf16) of `buf`, rows of
    /// `row_len` bf16 starting at row `base`, to contiguous rows after `base`.
    pub fn compact(
        &self,
        s: &Arc<CudaStream>,
        buf: &mut CudaSlice<bf16>,
        layers: usize,
        base: usize,
        row_len: usize,
        layer_stride: usize,
    ) -> Result<(), RuntimeError> {
        assert!(row_len % 8 == 0 && layers * layer_stride <= u32::MAX as usize);
        let d = self.depth + 1;
        // SAFETY: buf holds layers * layer_stride elements and the accepted rows are inside it.
        unsafe {
            CompactRows::launch(
                &self.compact,
                s,
                layers as u32,
                buf,
                &self.result.slice(1..1 + d),
                &self.result.slice(..1),
                base as u32,
                row_len as u32,
                layer_stride as u32,
            )
        }
    }
}

/// The split count [`GpuVerify::auto_splits`] picks for variant `v` on `sms` SMs: at most one
/// block per SM (a block's shared memory fills an SM, so one more block would start a second,
/// mostly idle wave), at least one tile per split of the `keys` (an upper bound of the length;
/// short contexts are latency-bound, so one tile per block is quickest), at most
/// `max_rows_splits / rows`.
pub fn verify_splits(v: &VerifyVariant, sms: usize, rows: usize, keys: usize, max_rows_splits: usize) -> usize {
    let row_blocks = rows.div_ceil(v.rows_per_block() as usize);
    (sms / row_blocks)
        .clamp(1, keys.div_ceil(v.bn() as usize).max(1))
        .min(max_rows_splits / rows)
        .max(1)
}

/// A compiled split pass.
enum SplitKernel {
    Split(CompiledKernel<MlaVerifySplit>),
    Wide(CompiledKernel<MlaVerifyWide>),
    Wg(CompiledKernel<MlaVerifyWg>),
    Narrow(CompiledKernel<MlaVerifyNarrow>),
}

/// The verify attention: split-KV + combine for one variant and split count, or naive.
pub struct GpuVerify {
    variant: VerifyVariant,
    split: SplitKernel,
    combine: CompiledKernel<MlaVerifyCombine>,
    combine_output: CompiledKernel<MlaCombineOutput>,
    naive: CompiledKernel<MlaVerifyNaive>,
    part_o: CudaSlice<u32>,
    part_lse: CudaSlice<f32>,
    max_rows_splits: usize,
}

/// One verify problem's shape.
#[derive(Clone, Copy, Debug)]
pub struct VerifyShape {
    /// Tree nodes (query tokens).
    pub nodes: usize,
    /// Heads.
    pub heads: usize,
    /// Committed prefix rows before the tree rows. For [`GpuVerify::run`] an upper bound (it
    /// sizes the grid; the kernel reads the actual length from the device); for
    /// [`GpuVerify::run_naive`] the length itself.
    pub prefix: usize,
    /// Words per mask row.
    pub words: usize,
    /// Softmax scale.
    pub scale: f32,
}

impl GpuVerify {
    /// Compiles variant `v` and allocates partials (bf16) for up to `max_rows_splits` rows x
    /// splits.
    pub fn new(gpu: &Gpu, v: &VerifyVariant, max_rows_splits: usize) -> Result<GpuVerify, RuntimeError> {
        let s = gpu.stream();
        Ok(GpuVerify {
            variant: *v,
            split: match v {
                VerifyVariant::Split(p) => SplitKernel::Split(gpu.compile::<MlaVerifySplit>(p)?),
                VerifyVariant::Wide(p) => SplitKernel::Wide(gpu.compile::<MlaVerifyWide>(p)?),
                VerifyVariant::Wg(p) => SplitKernel::Wg(gpu.compile::<MlaVerifyWg>(p)?),
                VerifyVariant::Narrow => SplitKernel::Narrow(gpu.compile::<MlaVerifyNarrow>(&())?),
            },
            combine: gpu.compile::<MlaVerifyCombine>(&())?,
            combine_output: gpu.compile::<MlaCombineOutput>(&MlaCombineOutput::space()[0])?,
            naive: gpu.compile::<MlaVerifyNaive>(&())?,
            part_o: zeros(s, max_rows_splits * LATENT / 2)?,
            part_lse: zeros(s, max_rows_splits)?,
            max_rows_splits,
        })
    }

    /// The variant.
    pub fn variant(&self) -> &VerifyVariant {
        &self.variant
    }

    /// The split count of [`verify_splits`] for the upper bound `sh.prefix` of the length.
    pub fn auto_splits(&self, sms: usize, sh: &VerifyShape) -> usize {
        verify_splits(
            &self.variant,
            sms,
            sh.nodes * sh.heads,
            sh.prefix + sh.nodes,
            self.max_rows_splits,
        )
    }

    /// The split pass alone, into this verifier's partials (what [`GpuVerify::run`] runs before
    /// the combine; public for timing it): `q` `[nodes, heads, 576]`, `cache` `[lens[0] + nodes,
    /// 576]` (at least), `mask` `[nodes, words]`, `lens[0]` the committed prefix length on the
    /// device (at most `sh.prefix`, which only sizes the grid).
    #[allow(clippy::too_many_arguments)]
    pub fn split_pass(
        &mut self,
        s: &Arc<CudaStream>,
        sh: &VerifyShape,
        splits: usize,
        q: &CudaSlice<bf16>,
        cache: &impl DevicePtr<bf16>,
        mask: &CudaSlice<u32>,
        lens: &impl DevicePtr<u32>,
    ) -> Result<(), RuntimeError> {
        let rows = sh.nodes * sh.heads;
        assert!(rows * splits <= self.max_rows_splits && sh.nodes >= 1 && splits >= 1);
        let grid = ((rows as u32).div_ceil(self.variant.rows_per_block()), splits as u32);
        let (po, pl) = (&mut self.part_o, &mut self.part_lse);
        let (r, h, n, w) = (rows as u32, sh.heads as u32, sh.nodes as u32, sh.words as u32);
        // SAFETY: shapes as documented; partials hold rows * splits rows.
        unsafe {
            match &self.split {
                SplitKernel::Split(k) => {
                    MlaVerifySplit::launch(k, s, grid, q, cache, mask, lens, po, pl, r, h, n, w, sh.scale)
                }
                SplitKernel::Wide(k) => {
                    MlaVerifyWide::launch(k, s, grid, q, cache, mask, lens, po, pl, r, h, n, w, sh.scale)
                }
                SplitKernel::Wg(k) => {
                    MlaVerifyWg::launch(k, s, grid, q, cache, mask, lens, po, pl, r, h, n, w, sh.scale)
                }
                SplitKernel::Narrow(k) => {
                    MlaVerifyNarrow::launch(k, s, grid, q, cache, mask, lens, po, pl, r, h, n, w, sh.scale)
                }
            }
        }
    }

    /// Split-KV + combine: the inputs of the split pass (`q` `[nodes, heads, 576]`, `cache`
    /// `[lens[0] + nodes, 576]` at least, `mask` `[nodes, words]`, `lens[0]` the committed prefix
    /// length on the device, at most `sh.prefix`, which only sizes the grid); writes `out`
    /// `[nodes, heads, 512]` and `lse` `[nodes, heads]`. No host synchronisation: capturable in a
    /// CUDA graph.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        s: &Arc<CudaStream>,
        sh: &VerifyShape,
        splits: usize,
        q: &CudaSlice<bf16>,
        cache: &impl DevicePtr<bf16>,
        mask: &CudaSlice<u32>,
        lens: &impl DevicePtr<u32>,
        out: &mut impl DevicePtrMut<bf16>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<(), RuntimeError> {
        self.split_pass(s, sh, splits, q, cache, mask, lens)?;
        let rows = sh.nodes * sh.heads;
        let (lsg, lwp) = combine_layout(splits as u32);
        // SAFETY: the partials of the split pass; out and lse hold rows rows.
        unsafe {
            MlaVerifyCombine::launch(
                &self.combine,
                s,
                combine_grid(rows as u32, (lsg, lwp)),
                &self.part_o,
                &self.part_lse,
                out,
                lse,
                rows as u32,
                splits as u32,
                lsg,
                lwp,
            )
        }
    }

    /// Split-KV, then the merge fused with the absorbed output projection
    /// ([`MlaCombineOutput`], the decode step's path): the split pass's inputs as in
    /// [`Self::run`], `kv_b` `[heads (nope + v), 512]`; writes `out` `[nodes, heads v]`. No host
    /// synchronisation.
    #[allow(clippy::too_many_arguments)]
    pub fn run_output(
        &mut self,
        s: &Arc<CudaStream>,
        sh: &VerifyShape,
        splits: usize,
        q: &CudaSlice<bf16>,
        cache: &impl DevicePtr<bf16>,
        mask: &CudaSlice<u32>,
        lens: &impl DevicePtr<u32>,
        kv_b: &impl DevicePtr<bf16>,
        (nope, v): (usize, usize),
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<(), RuntimeError> {
        self.split_pass(s, sh, splits, q, cache, mask, lens)?;
        let (t, h) = (sh.nodes as u32, sh.heads as u32);
        let p = self.combine_output.params();
        // SAFETY: the partials of the split pass; kv_b holds heads * (nope + v) rows of 512, out
        // nodes * heads * v.
        unsafe {
            MlaCombineOutput::launch(
                &self.combine_output,
                s,
                combine_output_grid(p, t, h, v as u32),
                &self.part_o,
                &self.part_lse,
                kv_b,
                out,
                t * h,
                splits as u32,
                h,
                nope as u32,
                v as u32,
            )
        }
    }

    /// The naive per-(node, head) kernel on the same problem.
    #[allow(clippy::too_many_arguments)]
    pub fn run_naive(
        &self,
        s: &Arc<CudaStream>,
        sh: &VerifyShape,
        q: &CudaSlice<bf16>,
        cache: &CudaSlice<bf16>,
        mask: &CudaSlice<u32>,
        out: &mut CudaSlice<bf16>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<(), RuntimeError> {
        let rows = sh.nodes * sh.heads;
        // SAFETY: shapes as documented.
        unsafe {
            MlaVerifyNaive::launch(
                &self.naive,
                s,
                rows as u32,
                q,
                cache,
                mask,
                out,
                lse,
                sh.heads as u32,
                sh.prefix as u32,
                sh.nodes as u32,
                sh.words as u32,
                sh.scale,
            )
        }
    }
}
