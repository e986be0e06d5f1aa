//! The op-level backend interface the model forward is written against, and its CPU reference.
//!
//! The forward in [`crate::model`] is written once in terms of these ops. [`CpuBackend`] is the f32
//! reference: simple, obviously correct, used in CI and as the oracle for GPU checks; with
//! [`ActivationPrecision::Bf16`] it rounds where the CUDA backend stores bf16, so it reproduces
//! the GPU's numerics. A CUDA backend implements the same trait with device buffers and generated
//! kernels.

mod cpu;
pub mod cuda;

pub use cpu::{ActivationPrecision, CpuBackend, CpuKvCache, CpuRouting};
pub use cuda::{AttentionKernel, CudaBackend, CudaOptions, Lookup};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ddtree_kernels::tree::{build_reference, Acceptance, DraftTree};

use crate::config::MoeConfig;
use crate::error::Result;
use crate::mask::AncestorMask;
use crate::model::{Ffn, ForwardInput};
use crate::rope::Rope;

static LIVE_KV_CACHES: AtomicUsize = AtomicUsize::new(0);

/// Latent KV caches alive in this process, on every backend (a server checks that finished and
/// cancelled requests give theirs back).
pub fn live_kv_caches() -> usize {
    LIVE_KV_CACHES.load(Ordering::Relaxed)
}

/// Held by every KV cache: counts it in [`live_kv_caches`] from creation (or clone) to drop.
#[derive(Debug)]
pub(crate) struct LiveCache(());

impl LiveCache {
    pub(crate) fn new() -> Self {
        LIVE_KV_CACHES.fetch_add(1, Ordering::Relaxed);
        Self(())
    }
}

impl Clone for LiveCache {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl Drop for LiveCache {
    fn drop(&mut self) {
        LIVE_KV_CACHES.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A host row-major `[rows, cols]` f32 matrix: the CPU backend's activation type and the form in
/// which every backend hands results back to the host.
#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    /// Number of rows (tokens).
    pub rows: usize,
    /// Number of columns (features).
    pub cols: usize,
    /// `rows * cols` values, row-major.
    pub data: Vec<f32>,
}

impl Matrix {
    /// An all-zero matrix.
    pub fn zeros(rows: usize, cols: usize) -> Self {
        Self {
            rows,
            cols,
            data: vec![0.0; rows * cols],
        }
    }

    /// Row `r` as a slice.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Row `r` as a mutable slice.
    pub fn row_mut(&mut self, r: usize) -> &mut [f32] {
        &mut self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// A linear layer's weight `[out, in]` as read from the checkpoint, before a backend takes it.
///
/// Which variant a layer gets is decided at load time from the tensors present in the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum HostLinear {
    /// Dense weight (bf16/f16/f32 on disk), converted to f32, row-major `[out, in]`.
    Dense {
        /// Output features.
        out: usize,
        /// Input features.
        inp: usize,
        /// `out * inp` values.
        data: Vec<f32>,
    },
    /// compressed-tensors `pack-quantized` symmetric INT4 with per-group scales along `in`.
    Int4 {
        /// Output features.
        out: usize,
        /// Input features.
        inp: usize,
        /// Scale group size along `in`.
        group_size: usize,
        /// `[out, ceil(in/8)]` words; element `8m + j` of a row is nibble `j` of word `m`, stored
        /// as `q + 8`.
        packed: Vec<u32>,
        /// `[out, in/group_size]` scales.
        scales: Vec<f32>,
    },
}

impl HostLinear {
    /// `(out, in)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Self::Dense { out, inp, .. } | Self::Int4 { out, inp, .. } => (*out, *inp),
        }
    }
}

impl HostLinear {
    /// A random weight with the statistics of [`Backend::random_weight`]: dense entries uniform
    /// in `±sqrt(3 / in)`; INT4 nibbles uniform with scales `sqrt(3 / in) / 8`, so both have
    /// about unit-variance products.
    pub fn random(out: usize, inp: usize, int4_group: Option<usize>, seed: u64) -> Self {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let bound = (3.0 / inp as f32).sqrt();
        match int4_group {
            None => Self::Dense {
                out,
                inp,
                data: (0..out * inp).map(|_| rng.random_range(-bound..bound)).collect(),
            },
            Some(group_size) => Self::Int4 {
                out,
                inp,
                group_size,
                packed: (0..out * inp.div_ceil(8)).map(|_| rng.random()).collect(),
                scales: vec![bound / 8.0; out * inp.div_ceil(group_size)],
            },
        }
    }
}

/// MLA head dimensions, taken from the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaDims {
    /// Attention heads (N).
    pub heads: usize,
    /// `qk_nope_head_dim` (P).
    pub nope: usize,
    /// `qk_rope_head_dim` (R).
    pub rope: usize,
    /// `v_head_dim` (V).
    pub v: usize,
    /// `kv_lora_rank` (L): width of the latent `c_kv`.
    pub kv_lora: usize,
}

impl MlaDims {
    /// Width of one absorbed query head and of one cache row: `L + R`.
    pub fn latent_width(&self) -> usize {
        self.kv_lora + self.rope
    }
}

/// Grouped-query attention head layout (the DFlash drafter's Qwen3-style attention).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GqaDims {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; query head `h` reads key/value head `h / (heads / kv_heads)`.
    pub kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
}

/// The inputs of one forward step, as [`Backend::begin_forward`] sees them.
#[derive(Debug, Clone, Copy)]
pub struct StepInputs<'a> {
    /// The new tokens.
    pub tokens: &'a [u32],
    /// Their positions.
    pub positions: &'a [u32],
    /// Cache rows before the step (every new row sees them).
    pub prefix_len: usize,
    /// The tree mask among the new rows; `None` is a causal chain.
    pub mask: Option<&'a AncestorMask>,
}

/// Which cached rows each new row attends to.
#[derive(Debug, Clone, Copy)]
pub struct AttentionSpan<'a> {
    /// Committed rows `0..prefix_len` of the cache, visible to every new row.
    pub prefix_len: usize,
    /// Visibility among the new rows `prefix_len..`: `None` is causal (a chain); `Some` is a tree
    /// where new row `i` sees new row `j` iff `j` is an ancestor of `i` or `i` itself.
    pub mask: Option<&'a AncestorMask>,
}

impl AttentionSpan<'_> {
    /// Whether new row `i` may attend to new row `j`.
    pub fn sees_new(&self, i: usize, j: usize) -> bool {
        match self.mask {
            None => j <= i,
            Some(mask) => mask.get(i, j),
        }
    }
}

/// One greedy DDTree round as [`Backend::device_tree_round`] takes it: the tree of the best
/// `budget` prefixes of the first `depth` rows of `drafted` under `root`, verified at positions
/// `start + depth` after the cache's first `start` rows.
pub struct TreeRound<'a, T> {
    /// The drafter's f32 logits `[rows, vocab]` (rows at least `depth`).
    pub drafted: &'a T,
    /// Drafted positions the tree may use.
    pub depth: usize,
    /// Tree nodes besides the root.
    pub budget: usize,
    /// The root token (the last round's bonus).
    pub root: u32,
    /// The root's position and the cache length before the round.
    pub start: usize,
    /// `--budget auto`: how many of the built tree's non-root nodes to verify, given their
    /// path log-probs in best-first order (the top-`B` tree is the first `B`; the backend reads
    /// them back, one more read per round). `None` verifies the whole tree.
    pub choose: Option<&'a mut BudgetChoice<'a>>,
}

/// [`TreeRound::choose`]: the nodes to verify besides the root, from the non-root path
/// log-probs in best-first order.
pub type BudgetChoice<'a> = dyn FnMut(&[f32]) -> usize + 'a;

/// What a [`Backend::device_tree_round`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeRoundOutcome {
    /// Tree nodes verified, root included.
    pub nodes: usize,
    /// The accepted path and the tokens it emits (the cache holds its rows after `start`).
    pub accepted: Acceptance,
    /// Device time to build (and stage) the tree (a backend without a device: host time).
    pub build: Duration,
    /// Device time of the verify forward.
    pub verify: Duration,
    /// The rest of the round's wall time: accept and compaction, the read of the result, and
    /// drafter work the device was still running when the build was enqueued.
    pub accept: Duration,
}

/// The greedy verify forward of a [`TreeRound`] ([`crate::Model::forward_greedy`] on the cache it
/// is given): the greedy token of every tree node.
pub type GreedyVerify<'a, C> = dyn FnMut(&mut C, ForwardInput<'_>) -> Result<Vec<u32>> + 'a;

/// The ops a model forward needs. Activations are `[rows, cols]` matrices, one row per token.
pub trait Backend {
    /// A `[rows, cols]` activation matrix (also holds the embedding table).
    type Tensor;
    /// A 1-D parameter (norm weight, routing bias).
    type Vector;
    /// A linear layer's weight, dense or INT4, in the layout this backend's kernels want.
    type Weight;
    /// The latent KV cache of every layer: per token and layer one row of `kv_lora + rope` values
    /// (normalized `c_kv` then roped `k_pe`).
    type KvCache;
    /// Per-token expert choices and weights from [`Backend::moe_route`].
    type Routing;
    /// A layer's routed experts, held together (the CUDA backend stacks them for its grouped
    /// kernels).
    type Experts;

    /// A short name for messages (`"cpu"`, `"cuda"`).
    fn name(&self) -> &'static str;

    /// Takes a 1-D parameter.
    fn load_vector(&self, data: Vec<f32>) -> Result<Self::Vector>;
    /// Takes a matrix parameter (the embedding table).
    fn load_matrix(&self, m: Matrix) -> Result<Self::Tensor>;
    /// Takes host logits (a drafter's proposals) at f32 precision.
    fn load_logits(&self, m: Matrix) -> Result<Self::Tensor>;
    /// Takes a linear weight, repacking it as the backend likes.
    fn load_weight(&self, w: HostLinear) -> Result<Self::Weight>;
    /// Takes a layer's routed experts (expert `e` is `experts[e]`).
    fn load_experts(&self, experts: Vec<Ffn<HostLinear>>) -> Result<Self::Experts>;

    /// A random linear weight `[out, in]` (dense, or INT4 with `int4_group`-wide scale groups)
    /// whose products keep activations near unit scale; for benchmarks on synthetic models.
    fn random_weight(&self, out: usize, inp: usize, int4_group: Option<usize>, seed: u64) -> Result<Self::Weight>;
    /// `count` random experts of intermediate size `inter` over `hidden` ([`Backend::random_weight`]).
    fn random_experts(
        &self,
        count: usize,
        inter: usize,
        hidden: usize,
        int4_group: Option<usize>,
        seed: u64,
    ) -> Result<Self::Experts>;
    /// A random vector with entries uniform in `[lo, hi)`.
    fn random_vector(&self, len: usize, lo: f32, hi: f32, seed: u64) -> Result<Self::Vector>;
    /// A random `[rows, cols]` matrix with entries uniform in `[-1, 1)` (embedding tables).
    fn random_matrix(&self, rows: usize, cols: usize, seed: u64) -> Result<Self::Tensor>;
    /// Fills every layer of `cache` with `len` random rows, as if `len` tokens had been run:
    /// benchmarks of long contexts without the prefill.
    fn kv_fill_random(&self, cache: &mut Self::KvCache, len: usize, seed: u64) -> Result<()>;

    /// An empty latent cache for `layers` layers of rows `row_width` wide, for up to `capacity`
    /// tokens.
    fn new_kv_cache(&self, layers: usize, row_width: usize, capacity: usize) -> Result<Self::KvCache>;

    /// `(rows, cols)` of a tensor.
    fn dims(&self, x: &Self::Tensor) -> (usize, usize);
    /// Copies a tensor back to the host.
    fn to_host(&self, x: &Self::Tensor) -> Result<Matrix>;
    /// Gathers rows `rows` of `x` (in that order).
    fn take_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor>;

    /// Looks up embedding rows for `ids`.
    fn embedding(&self, table: &Self::Tensor, ids: &[u32]) -> Result<Self::Tensor>;
    /// The vocabulary-parallel lookup of a rank holding rows `vocab` (`table` is that slice):
    /// row `id - vocab.start` for ids in `vocab`, a zero row for the others. By default through
    /// the host (the CUDA backend runs one kernel over the staged ids instead).
    fn embedding_slice(
        &self,
        table: &Self::Tensor,
        ids: &[u32],
        vocab: std::ops::Range<usize>,
    ) -> Result<Self::Tensor> {
        let inside = |id: u32| vocab.contains(&(id as usize));
        let local: Vec<u32> = ids
            .iter()
            .map(|&id| if inside(id) { id - vocab.start as u32 } else { 0 })
            .collect();
        let rows = self.embedding(table, &local)?;
        if ids.iter().all(|&id| inside(id)) {
            return Ok(rows);
        }
        let mut host = self.to_host(&rows)?;
        for (t, &id) in ids.iter().enumerate() {
            if !inside(id) {
                host.row_mut(t).fill(0.0);
            }
        }
        self.load_matrix(host)
    }
    /// The DDTree draft tree of the first `depth` rows of `drafted` (f32 logits `[rows, vocab]`):
    /// the best `budget` prefixes under `root`, as [`ddtree_kernels::tree::build_reference`]
    /// builds them (the CUDA backend builds on the GPU and copies the tree back: the host-tree
    /// rounds' one extra read, see [`Backend::device_tree_round`]).
    fn draft_tree(&self, drafted: &Self::Tensor, depth: usize, budget: usize, root: u32) -> Result<DraftTree> {
        let host = self.to_host(drafted)?;
        Ok(build_reference(
            &host.data[..depth * host.cols],
            depth,
            host.cols,
            budget,
            root,
        ))
    }
    /// Runs a whole greedy DDTree round with the tree kept on the device, where this backend
    /// can: builds the tree of `round`, runs `verify` over it (whose inputs are then only the
    /// step's shape: the backend stages the tree's tokens, positions and mask itself), accepts
    /// against the verify's greedy tokens and compacts the accepted rows in `cache`, reading
    /// back only the accept result. `None` (the default, and where the backend cannot for this
    /// round's shape) leaves the cache untouched: the caller runs the host path
    /// ([`Backend::draft_tree`], the forward over its host inputs, the reference accept and
    /// [`Backend::kv_compact`]), which gives the same tokens.
    fn device_tree_round(
        &self,
        _cache: &mut Self::KvCache,
        _round: TreeRound<'_, Self::Tensor>,
        _verify: &mut GreedyVerify<'_, Self::KvCache>,
    ) -> Result<Option<TreeRoundOutcome>> {
        Ok(None)
    }
    /// Copies from the device to the host so far (each waits for the device), where the
    /// backend counts them; `None` by default (the CPU backend has no device).
    fn host_reads(&self) -> Option<u64> {
        None
    }
    /// Forwards replayed from recordings (CUDA graphs) and forwards recorded so far, where the
    /// backend records them; `None` by default.
    fn graph_counts(&self) -> Option<(u64, u64)> {
        None
    }
    /// `x / sqrt(mean(x^2) + eps) * weight`, per row.
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Vector, eps: f32) -> Result<Self::Tensor>;
    /// [`Self::rms_norm`] of `x`, then [`Self::linear`] through `w` (the MLA query path's
    /// `q_b(q_norm(x))`). A backend may fuse the two (the CUDA backend normalizes inside the
    /// decode GEMV).
    fn rms_norm_linear(
        &self,
        x: &Self::Tensor,
        weight: &Self::Vector,
        eps: f32,
        w: &Self::Weight,
    ) -> Result<Self::Tensor> {
        self.linear(&self.rms_norm(x, weight, eps)?, w)
    }
    /// `x W^T` for `W` of shape `[out, in]`.
    fn linear(&self, x: &Self::Tensor, w: &Self::Weight) -> Result<Self::Tensor>;
    /// [`Backend::linear`] whose output keeps f32 precision: router logits and the LM head.
    fn linear_f32(&self, x: &Self::Tensor, w: &Self::Weight) -> Result<Self::Tensor>;
    /// The greedy token of every row of `logits`: the index of the largest value, the lowest
    /// index among equal maxima (as [`crate::Sampling`]'s greedy choice).
    fn argmax_rows(&self, logits: &Self::Tensor) -> Result<Vec<u32>>;
    /// Starts a branch: the ops until [`Backend::end_branch`] depend on every op before, but the
    /// ops after `end_branch` may run concurrently with them until [`Backend::join_branch`].
    /// Inputs of the branch must live until the join, and its outputs may only be read after
    /// it. By default (one queue, as on the CPU) the three calls do nothing. Branches do not
    /// nest.
    fn begin_branch(&self) -> Result<()> {
        Ok(())
    }
    /// Ends the branch begun by [`Backend::begin_branch`]: later ops go to the main queue.
    fn end_branch(&self) -> Result<()> {
        Ok(())
    }
    /// Later ops wait for every op of the branches so far.
    fn join_branch(&self) -> Result<()> {
        Ok(())
    }
    /// Called at the start of every forward (before its first op) with the step's inputs, so a
    /// backend can stage them on the device once; by default nothing.
    fn begin_forward(&self, _step: &StepInputs<'_>) -> Result<()> {
        Ok(())
    }
    /// The greedy token of every logits row of the forward that `forward` runs on `cache` (the
    /// step staged by the last [`Backend::begin_forward`]). By default `forward` then
    /// [`Backend::argmax_rows`]. A backend may instead replay a recording (a CUDA graph) of an
    /// earlier forward of the same shape: `forward` is then not called, and the backend makes
    /// the one host-side effect of a forward, the cache growing by the step's rows, itself.
    /// Inside its own [`Backend::device_tree_round`] a backend may leave the tokens on the
    /// device for the round's accept and return none.
    fn greedy_forward(
        &self,
        cache: &mut Self::KvCache,
        forward: &mut dyn FnMut(&mut Self::KvCache) -> Result<Self::Tensor>,
    ) -> Result<Vec<u32>> {
        let logits = forward(cache)?;
        self.argmax_rows(&logits)
    }
    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;
    /// An activation in the residual stream's precision (the CUDA backend keeps the stream in
    /// f32 between its bf16 blocks); by default unchanged.
    fn residual(&self, x: Self::Tensor) -> Result<Self::Tensor> {
        Ok(x)
    }
    /// The residual add fused with the norm after it: `x += y`, then `rms_norm(x)`.
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        weight: &Self::Vector,
        eps: f32,
    ) -> Result<Self::Tensor> {
        self.add_assign(x, y)?;
        self.rms_norm(x, weight, eps)
    }
    /// The residual add of a layer output in two parts fused with the norm after it: `a += b`
    /// (an activation, stored as [`Backend::add_assign`] stores it), then `x += a` and
    /// `rms_norm(x)` as [`Backend::add_rms_norm`]. By default exactly that; a backend may fuse the
    /// three (the MoE block's routed and shared experts).
    fn add2_rms_norm(
        &self,
        x: &mut Self::Tensor,
        a: Self::Tensor,
        b: &Self::Tensor,
        weight: &Self::Vector,
        eps: f32,
    ) -> Result<Self::Tensor> {
        unfused_add2_rms_norm(self, x, a, b, weight, eps)
    }
    /// `silu(gate) * up`.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor>;
    /// The gate and up projections of a SwiGLU block and their SiLU-and-mul:
    /// `silu(x gate^T) * (x up^T)`. By default [`Backend::linear`] twice and
    /// [`Backend::silu_mul`]; a backend may fuse them (rounding where the unfused ops store).
    fn gate_up_silu(&self, x: &Self::Tensor, gate: &Self::Weight, up: &Self::Weight) -> Result<Self::Tensor> {
        unfused_gate_up_silu(self, x, gate, up)
    }
    /// Concatenates matrices with equal row counts along the feature dimension.
    fn concat_cols(&self, parts: &[&Self::Tensor]) -> Result<Self::Tensor>;
    /// Per-head RMS norm: every consecutive run of `weight.len()` columns of each row is
    /// normalized on its own and scaled by `weight` (Qwen3's `q_norm` / `k_norm`).
    fn head_rms_norm(&self, x: &Self::Tensor, weight: &Self::Vector, eps: f32) -> Result<Self::Tensor>;
    /// Ropes every consecutive run of `rope.dim()` columns of row `t` to `positions[t]`, in place.
    fn rope_heads(&self, x: &mut Self::Tensor, rope: &Rope, positions: &[u32]) -> Result<()>;

    /// From `kv_a = h W_DKV` (`[T, L + R]`): RMS-normalizes `c_kv` (eps `eps`), ropes `k_pe` at
    /// `positions`, and appends the `T` rows to `layer` of the cache.
    #[allow(clippy::too_many_arguments)]
    fn mla_append_kv(
        &self,
        kv_a: &Self::Tensor,
        norm: &Self::Vector,
        eps: f32,
        rope: &Rope,
        positions: &[u32],
        cache: &mut Self::KvCache,
        layer: usize,
    ) -> Result<()>;
    /// From `q` (`[T, N (P + R)]`): ropes each head's `q_pe` and absorbs `q_nope` through `W_UK`
    /// (the first `P` rows of each head's block of `kv_b`), giving `[T, N (L + R)]`.
    fn mla_query(
        &self,
        q: &Self::Tensor,
        kv_b: &Self::Weight,
        rope: &Rope,
        positions: &[u32],
        dims: MlaDims,
    ) -> Result<Self::Tensor>;
    /// Absorbed attention of the new rows over the latent cache of `layer`: scores are
    /// `q_abs . row * scale`, softmax over the rows `span` allows, output `sum p c_kv`
    /// (`[T, N L]`). The new rows are the last `T` rows of the cache.
    fn mla_attention(
        &self,
        q_abs: &Self::Tensor,
        cache: &Self::KvCache,
        layer: usize,
        span: AttentionSpan<'_>,
        dims: MlaDims,
        scale: f32,
    ) -> Result<Self::Tensor>;
    /// Un-absorbs the latent outputs through each head's `W_UV` (the last `V` rows of its block of
    /// `kv_b`): `[T, N L]` -> `[T, N V]`.
    fn mla_output(&self, o_lat: &Self::Tensor, kv_b: &Self::Weight, dims: MlaDims) -> Result<Self::Tensor>;
    /// [`Self::mla_attention`], then [`Self::mla_output`] through `kv_b`: `[T, N V]`. A backend
    /// may fuse the two (the CUDA backend merges the split-KV partials inside the output
    /// projection for the decode step).
    #[allow(clippy::too_many_arguments)]
    fn mla_attention_output(
        &self,
        q_abs: &Self::Tensor,
        cache: &Self::KvCache,
        layer: usize,
        span: AttentionSpan<'_>,
        dims: MlaDims,
        scale: f32,
        kv_b: &Self::Weight,
    ) -> Result<Self::Tensor> {
        let o_lat = self.mla_attention(q_abs, cache, layer, span, dims, scale)?;
        self.mla_output(&o_lat, kv_b, dims)
    }

    /// DeepSeek-V3 `noaux_tc` routing from fp32 router logits `[T, E]`: sigmoid scores, selection
    /// on scores + `bias` with group-limited top-k, weights from the unbiased scores, normalized
    /// and scaled.
    fn moe_route(&self, logits: &Self::Tensor, bias: &Self::Vector, cfg: &MoeConfig) -> Result<Self::Routing>;
    /// `sum_k w_k expert_k(x)` per token for the routed experts.
    fn moe_experts(&self, x: &Self::Tensor, routing: &Self::Routing, experts: &Self::Experts) -> Result<Self::Tensor>;
    /// Expert parallelism: `routing` (global expert ids) restricted to the experts `local`
    /// this rank holds, renumbered from 0, for [`Backend::moe_experts`] over the rank's experts
    /// (tokens with no local expert get zero rows); it takes the routing, so a backend may
    /// rewrite it in place. By default unsupported.
    fn moe_localize(&self, _routing: Self::Routing, local: std::ops::Range<usize>) -> Result<Self::Routing> {
        Err(crate::error::EngineError::Backend {
            backend: self.name().into(),
            reason: format!(
                "expert parallelism (experts {}..{} on this rank) is not implemented on this backend",
                local.start, local.end
            ),
        })
    }

    /// Appends the rows of `rows` (as wide as the cache's rows) to `layer` of a cache used as plain
    /// row storage (the DFlash drafter keeps its keys in layer `2l` and values in `2l + 1`).
    fn kv_append(&self, cache: &mut Self::KvCache, layer: usize, rows: &Self::Tensor) -> Result<()>;
    /// Non-causal grouped-query attention: every row of `q` (`[T, heads * head_dim]`) attends to
    /// every row of cache layers `k_layer` (keys) and `v_layer` (values), each
    /// `kv_heads * head_dim` wide, with scores `q . k * scale`; returns `[T, heads * head_dim]`.
    fn gqa_attention(
        &self,
        q: &Self::Tensor,
        cache: &Self::KvCache,
        k_layer: usize,
        v_layer: usize,
        dims: GqaDims,
        scale: f32,
    ) -> Result<Self::Tensor>;

    /// Number of rows every layer of the cache holds.
    fn kv_len(&self, cache: &Self::KvCache) -> usize;
    /// Drops every row at index `len` and beyond.
    fn kv_truncate(&self, cache: &mut Self::KvCache, len: usize) -> Result<()>;
    /// Keeps rows `base + keep[i]` (ascending) moved to `base + i`, and drops every other row at
    /// index `base` and beyond: the compaction after a tree's accepted path is known.
    fn kv_compact(&self, cache: &mut Self::KvCache, base: usize, keep: &[usize]) -> Result<()>;
}

/// [`Backend::gate_up_silu`]'s default, for backends that fuse only some shapes.
pub(crate) fn unfused_gate_up_silu<B: Backend + ?Sized>(
    b: &B,
    x: &B::Tensor,
    gate: &B::Weight,
    up: &B::Weight,
) -> Result<B::Tensor> {
    b.silu_mul(&b.linear(x, gate)?, &b.linear(x, up)?)
}

/// [`Backend::add2_rms_norm`]'s default, for backends that fuse only some cases.
pub(crate) fn unfused_add2_rms_norm<B: Backend + ?Sized>(
    be: &B,
    x: &mut B::Tensor,
    mut a: B::Tensor,
    b: &B::Tensor,
    weight: &B::Vector,
    eps: f32,
) -> Result<B::Tensor> {
    be.add_assign(&mut a, b)?;
    be.add_rms_norm(x, &a, weight, eps)
}
