//! The tune-cache lookups of the CUDA backend, in one place: each op that takes a tuned variant
//! asks [`Lookup`] for its key here, and [`crate::tuning::plan`] enumerates the same
//! constructors over a model's shapes, so `autotune` tunes exactly the keys the engine looks
//! up. The backend also records every lookup it makes ([`CudaBackend::lookups_made`]), which
//! the GPU tests compare with the plan.

use std::fmt;

use ddtree_kernels::gemv::{self, GemvChoice, GemvGateUpSilu, GemvRmsNormBf16, GemvSplitGateUpSilu};
use ddtree_kernels::topk;
use ddtree_kernels::tree::tune_verify::{VerifyKernels, VerifyKey};
use ddtree_kernels::tree::{MlaVerify, TreeBuild, LATENT, ROPE};
use ddtree_kernels::tune::{
    EmbeddingKey, GemvKey, MlaQueryKey, MoeKey, RowsKey, TopkKey, TreeBuildKey, W4GemmKey, W4GemvKey,
};
use ddtree_kernels::w4a16::gemm_wg::{self, W4a16GemmWg};
use ddtree_kernels::w4a16::gemv::W4a16Gemv;
use ddtree_kernels::w4a16::MoeBlock;
use ddtree_kernels::{Embedding, MlaAbsorbQuery, RmsNorm, RowTopk};
use ddtree_runtime::Tunable;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use ddtree_runtime::CompiledKernel;

use super::attention::{MLA_ABSORB_QUERY_MAX_ROWS, VERIFY_PARTIALS};
use super::linear::dense_int4_gemv;
use super::{fail, CudaBackend};
use crate::backend::MlaDims;
use crate::error::Result;
use crate::tuning::{job, Job};

/// One (kernel, key) the CUDA backend looks up in the tune cache.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Lookup {
    /// `rms_norm` of `rows` rows of `n` values.
    RmsNorm(RowsKey),
    /// `embedding` of `tokens` ids.
    Embedding(EmbeddingKey),
    /// `row_topk` with k = 1: the argmax of logits rows, from [`topk::SPLIT_MAX_ROWS`] rows on
    /// (fewer rows take the untuned split path).
    Argmax(TopkKey),
    /// The dense `w4a16_gemv` of an INT4 linear of few rows.
    Int4Gemv(W4GemvKey),
    /// The GPU tree builder.
    TreeBuild(TreeBuildKey),
    /// The RMSNorm fused into the GEMV that consumes it (`rms_norm_linear`: the MLA query's
    /// `q_b(q_norm(x))`), where [`gemv::choose_rms_norm`] takes the fused kernel.
    RmsNormGemv(GemvKey),
    /// The per-column fused gate/up SiLU-and-mul GEMV (`gate_up_silu`).
    GateUpGemv(GemvKey),
    /// The split-K fused gate/up SiLU-and-mul GEMV (`gate_up_silu`).
    GateUpSplitGemv(GemvKey),
    /// The dense `wgmma` W4A16 GEMM of an INT4 linear of [`gemm_wg::WG_MIN_ROWS`] rows or more
    /// (Hopper).
    Int4GemmWg(W4GemmKey),
    /// The absorbed-MLA query kernel (`mla_query` of a few tokens).
    MlaAbsorbQuery(MlaQueryKey),
    /// The routed-expert block (`moe_experts`): its path and (gate_up, down) pair.
    MoeExperts(MoeKey),
    /// The tree-masked MLA verify attention (`mla_attention`, `mla_attention_output`): its
    /// split-pass variant and split rule.
    MlaVerify(VerifyKey),
}

impl Lookup {
    /// `rms_norm` over `rows` rows of `n`.
    pub fn rms_norm(rows: usize, n: usize) -> Lookup {
        Lookup::RmsNorm(RowsKey { rows, n })
    }

    /// `embedding` of `tokens` ids into a `[vocab, hidden]` table.
    pub fn embedding(tokens: usize, vocab: usize, hidden: usize) -> Lookup {
        Lookup::Embedding(EmbeddingKey { tokens, vocab, hidden })
    }

    /// The argmax of `rows` logits rows of `vocab`: a lookup from [`topk::SPLIT_MAX_ROWS`]
    /// rows on, none below (the split top-1 runs a fixed variant).
    pub fn argmax(rows: usize, vocab: usize) -> Option<Lookup> {
        (rows >= topk::SPLIT_MAX_ROWS).then_some(Lookup::Argmax(TopkKey { rows, n: vocab, k: 1 }))
    }

    /// An INT4 linear of `rows` rows over an `[n, k]` weight of scale group `group`: a lookup
    /// where it runs on the dense `w4a16_gemv` ([`dense_int4_gemv`]), none where it runs on a
    /// GEMM.
    pub fn int4_gemv(rows: usize, n: usize, k: usize, group: usize) -> Option<Lookup> {
        dense_int4_gemv(rows, n, k, group).then_some(Lookup::Int4Gemv(W4GemvKey {
            tokens: rows,
            n,
            k,
            group,
        }))
    }

    /// The tree builder for `depth` drafted positions over `vocab` at `budget` nodes.
    pub fn tree_build(depth: usize, vocab: usize, budget: usize) -> Lookup {
        Lookup::TreeBuild(TreeBuildKey { depth, vocab, budget })
    }

    /// `rms_norm_linear` of `rows` rows into a dense `[n, k]` weight on a GPU of `sms` SMs: a
    /// lookup where the fused RMSNorm + GEMV runs ([`gemv::choose_rms_norm`]: one row, a wide
    /// output, `k <= NORM_MAX_K`), none where the norm and the product run apart.
    pub fn rms_norm_linear(rows: usize, n: usize, k: usize, sms: usize) -> Option<Lookup> {
        gemv::choose_rms_norm(rows, n, k, sms).map(|_| Lookup::RmsNormGemv(GemvKey { rows, n, k }))
    }

    /// `gate_up_silu` of `rows` rows over dense `[n, k]` gate and up weights on a GPU of `sms`
    /// SMs: the per-column or split-K fused GEMV ([`gemv::choose_gate_up`]), none where two
    /// products and a SiLU-and-mul run instead.
    pub fn gate_up_silu(rows: usize, n: usize, k: usize, sms: usize) -> Option<Lookup> {
        let key = GemvKey { rows, n, k };
        gemv::choose_gate_up(rows, n, k, sms).map(|c| match c {
            GemvChoice::Warp(_) => Lookup::GateUpGemv(key),
            GemvChoice::Split(_) => Lookup::GateUpSplitGemv(key),
        })
    }

    /// An INT4 linear of `rows` rows over an `[n, k]` weight of scale group `group`: a lookup
    /// where it runs on the `wgmma` GEMM (a GPU with `wgmma`, at least [`gemm_wg::WG_MIN_ROWS`]
    /// rows, past [`dense_int4_gemv`]'s), none where it runs the GEMV or the mma.sync GEMM.
    pub fn int4_gemm_wg(rows: usize, n: usize, k: usize, group: usize, wgmma: bool) -> Option<Lookup> {
        // From WG_MIN_ROWS rows on, past the GEMV's few rows.
        let wg = wgmma && gemm_wg::default_dense_tile(rows as u32).is_some();
        wg.then_some(Lookup::Int4GemmWg(W4GemmKey { m: rows, n, k, group }))
    }

    /// `mla_query` of `rows` tokens of `heads` heads (`nope` + `rope` query dims, `v` value
    /// dims, latent `lora`, rope pairs `interleave`d or not): a lookup where the one-launch
    /// absorbed kernel runs (up to `MLA_ABSORB_QUERY_MAX_ROWS` tokens, a variant for the head
    /// dims), none where cuBLAS's batched GEMM and the rope kernel run.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_absorb_query(
        rows: usize,
        heads: usize,
        lora: usize,
        nope: usize,
        rope: usize,
        v: usize,
        interleave: bool,
    ) -> Option<Lookup> {
        let key = MlaQueryKey {
            rows,
            heads,
            lora,
            nope,
            rope,
            v,
            interleave,
        };
        let absorb = rows <= MLA_ABSORB_QUERY_MAX_ROWS && !MlaAbsorbQuery::candidates(&key).is_empty();
        absorb.then_some(Lookup::MlaAbsorbQuery(key))
    }

    /// The routed-expert block of `tokens` tokens of `topk` slots over `experts` local INT4
    /// experts (gate_up `[2 inter, hidden]`, down `[hidden, inter]`, scale group `group`): every
    /// MoE layer's `moe_experts` looks it up.
    pub fn moe_experts(
        tokens: usize,
        topk: usize,
        experts: usize,
        hidden: usize,
        inter: usize,
        group: usize,
    ) -> Lookup {
        Lookup::MoeExperts(MoeKey {
            tokens,
            topk,
            experts,
            hidden,
            inter,
            group,
        })
    }

    /// The verify attention of `tokens` query tokens over a length bucket of `keys` cache rows
    /// (`CudaBackend::attend`) with MLA dims `d`, its merge `fused` into the absorbed output
    /// projection or not, among `kernels` (the `--attention` choice): a lookup where the
    /// split-KV kernels run (Kimi's 576-wide latent rows, rows that fit the partials), none
    /// where the generic kernel does.
    pub fn mla_verify(tokens: usize, keys: usize, d: MlaDims, fused: bool, kernels: VerifyKernels) -> Option<Lookup> {
        let split = d.kv_lora == LATENT && d.rope == ROPE && tokens * d.heads <= VERIFY_PARTIALS;
        split.then_some(Lookup::MlaVerify(VerifyKey {
            tokens,
            heads: d.heads,
            keys,
            nope: d.nope,
            v: d.v,
            fused,
            kernels,
        }))
    }

    /// Its tuning job.
    pub fn job(&self) -> Box<dyn Job> {
        match self {
            Lookup::RmsNorm(k) => job::<RmsNorm>(*k),
            Lookup::Embedding(k) => job::<Embedding>(*k),
            Lookup::Argmax(k) => job::<RowTopk>(*k),
            Lookup::Int4Gemv(k) => job::<W4a16Gemv>(*k),
            Lookup::TreeBuild(k) => job::<TreeBuild>(*k),
            Lookup::RmsNormGemv(k) => job::<GemvRmsNormBf16>(*k),
            Lookup::GateUpGemv(k) => job::<GemvGateUpSilu>(*k),
            Lookup::GateUpSplitGemv(k) => job::<GemvSplitGateUpSilu>(*k),
            Lookup::Int4GemmWg(k) => job::<W4a16GemmWg>(*k),
            Lookup::MlaAbsorbQuery(k) => job::<MlaAbsorbQuery>(*k),
            Lookup::MoeExperts(k) => job::<MoeBlock>(*k),
            Lookup::MlaVerify(k) => job::<MlaVerify>(*k),
        }
    }

    /// The kernel and the bucketed key, as the tune cache names them.
    pub fn bucket(&self) -> (&'static str, String) {
        fn of<K: Tunable>(k: &K::Key) -> (&'static str, String) {
            (K::NAME, K::bucket(k).to_string())
        }
        match self {
            Lookup::RmsNorm(k) => of::<RmsNorm>(k),
            Lookup::Embedding(k) => of::<Embedding>(k),
            Lookup::Argmax(k) => of::<RowTopk>(k),
            Lookup::Int4Gemv(k) => of::<W4a16Gemv>(k),
            Lookup::TreeBuild(k) => of::<TreeBuild>(k),
            Lookup::RmsNormGemv(k) => of::<GemvRmsNormBf16>(k),
            Lookup::GateUpGemv(k) => of::<GemvGateUpSilu>(k),
            Lookup::GateUpSplitGemv(k) => of::<GemvSplitGateUpSilu>(k),
            Lookup::Int4GemmWg(k) => of::<W4a16GemmWg>(k),
            Lookup::MlaAbsorbQuery(k) => of::<MlaAbsorbQuery>(k),
            Lookup::MoeExperts(k) => of::<MoeBlock>(k),
            Lookup::MlaVerify(k) => of::<MlaVerify>(k),
        }
    }
}

impl fmt::Display for Lookup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (kernel, key) = self.bucket();
        write!(f, "{kernel} {key}")
    }
}

/// The key of tunable kernel `K` in a [`Lookup`] of its kind.
pub trait KeyOf<K: Tunable> {
    /// The key, when the lookup is of `K`.
    fn key_of(&self) -> Option<&K::Key>;
}

macro_rules! key_of {
    ($($kernel:ty => $variant:ident),* $(,)?) => {$(
        impl KeyOf<$kernel> for Lookup {
            fn key_of(&self) -> Option<&<$kernel as Tunable>::Key> {
                match self {
                    Lookup::$variant(k) => Some(k),
                    _ => None,
                }
            }
        }
    )*};
}

key_of!(
    RmsNorm => RmsNorm,
    Embedding => Embedding,
    RowTopk => Argmax,
    W4a16Gemv => Int4Gemv,
    TreeBuild => TreeBuild,
    GemvRmsNormBf16 => RmsNormGemv,
    GemvGateUpSilu => GateUpGemv,
    GemvSplitGateUpSilu => GateUpSplitGemv,
    W4a16GemmWg => Int4GemmWg,
    MlaAbsorbQuery => MlaAbsorbQuery,
    MoeBlock => MoeExperts,
    MlaVerify => MlaVerify,
);

impl CudaBackend {
    /// The tuned variant of `K` for `lookup` (the default where nothing valid is tuned); the
    /// lookup is recorded while [`CudaBackend::record_lookups`] is on.
    pub(super) fn tuned<K: Tunable>(&self, lookup: Lookup) -> Result<Arc<CompiledKernel<K>>>
    where
        Lookup: KeyOf<K>,
    {
        let Some(key) = KeyOf::<K>::key_of(&lookup) else {
            return Err(fail(format!("{lookup} is not a lookup of `{}`", K::NAME)));
        };
        let kernel = self.kernels.get::<K>(key)?;
        if self.record_lookups.load(Ordering::Relaxed) {
            self.lookups.lock().expect("lookup log lock").insert(lookup);
        }
        Ok(kernel)
    }

    /// The tuned parameters of `K` for `lookup` without compiling them (for a kernel whose
    /// launched variant derives from the tuned one, as the `wgmma` GEMM's split-K flag does),
    /// memoized per lookup; recorded as [`CudaBackend::tuned`] records.
    pub(super) fn tuned_params<K: Tunable>(&self, lookup: Lookup) -> Result<K::Params>
    where
        Lookup: KeyOf<K>,
    {
        let Some(key) = KeyOf::<K>::key_of(&lookup) else {
            return Err(fail(format!("{lookup} is not a lookup of `{}`", K::NAME)));
        };
        let memo = self
            .tuned_params
            .lock()
            .expect("tuned params lock")
            .get(&lookup)
            .cloned();
        let params = match memo.and_then(|p| p.downcast::<K::Params>().ok()) {
            Some(p) => (*p).clone(),
            None => {
                let p = self.kernels.choose::<K>(key).params;
                self.tuned_params
                    .lock()
                    .expect("tuned params lock")
                    .insert(lookup.clone(), Arc::new(p.clone()));
                p
            }
        };
        if self.record_lookups.load(Ordering::Relaxed) {
            self.lookups.lock().expect("lookup log lock").insert(lookup);
        }
        Ok(params)
    }

    /// Starts (or stops) recording the tune-cache lookups the backend makes.
    pub fn record_lookups(&self, on: bool) {
        self.record_lookups.store(on, Ordering::Relaxed);
    }

    /// The distinct lookups recorded so far ([`CudaBackend::record_lookups`]).
    pub fn lookups_made(&self) -> Vec<Lookup> {
        let mut v: Vec<Lookup> = self.lookups.lock().expect("lookup log lock").iter().cloned().collect();
        v.sort_by_key(|l| l.to_string());
        v
    }
}
