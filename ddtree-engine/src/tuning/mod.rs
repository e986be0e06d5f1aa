//! Kernel tuning for a model: which (kernel, problem key) pairs the engine launches for a
//! model's dimensions, and tuning the ones the per-GPU tune cache lacks.
//!
//! Here (`tuning/mod.rs`), the plan:
//!
//! - [`ModelDims`]: the dimensions that decide the problem keys (from a [`ModelConfig`] or the
//!   built-in Kimi K2.6 preset), and the GPU traits the dispatch depends on (SM count,
//!   `wgmma`);
//! - [`lookups`] / [`plan`]: every key the [`crate::CudaBackend`] can look up in the tune cache
//!   for a model (M = 1, 2, 4, ...), from the same [`Lookup`] constructors its dispatch calls:
//!   what the `autotune` binary tunes; [`startup_plan`]: the keys the [`crate::CudaBackend`] looks up in
//!   the tune cache at startup.
//!
//! In `tuning/run.rs`, the runner:
//!
//! - [`Job`] / [`KeyJob`] / [`job`]: one (kernel, key) of any `Tunable` kernel, type-erased;
//! - [`tune_missing`]: tunes the keys of [`startup_plan`] that the tune cache lacks or holds
//!   stale (the `ddtree` CLI calls it before building the CUDA backend), with [`Progress`];
//! - [`tune_jobs`] and [`progress_line`]: the loop and log line shared with `autotune`;
//!
//! In `tuning/verify_cost.rs`:
//!
//! - [`measure_verify_cost`]: the target's verify latency by tree size, as the cost model of
//!   `--budget auto`, stored per (GPU, model shape) next to the tune cache
//!   ([`save_verify_cost`], [`load_verify_cost`]; `autotune --verify-cost` measures it).
//!
//! The tuner saves the tune cache after every new entry, so an interrupted run keeps what it
//! measured.

use ddtree_kernels::tree::tune_verify::VerifyKernels;
use ddtree_kernels::{gemv, tree};

use crate::backend::cuda::{
    length_bucket, Lookup, DENSE_EXPERT_GROUP, DENSE_INT4_GEMV_MAX_ROWS, MLA_COMBINE_OUTPUT_MAX_ROWS,
};
use crate::backend::MlaDims;
use crate::config::ModelConfig;

mod run;
mod verify_cost;

pub use run::*;
pub use verify_cost::*;

/// The dimensions that decide the problem keys.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelDims {
    /// A name for messages (preset name or model folder).
    pub name: String,
    /// `hidden_size`.
    pub hidden: usize,
    /// `vocab_size`.
    pub vocab: usize,
    /// `intermediate_size` (dense MLP layers).
    pub intermediate: usize,
    /// `moe_intermediate_size` (one expert).
    pub moe_intermediate: usize,
    /// `n_shared_experts`.
    pub shared_experts: usize,
    /// `n_routed_experts`.
    pub routed_experts: usize,
    /// `num_experts_per_tok` (top-k).
    pub experts_per_tok: usize,
    /// Expert-parallel ranks the routed experts are spread over: the MoE keys are for one
    /// rank's `routed_experts / expert_ranks` local experts.
    pub expert_ranks: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `q_lora_rank` (`None`: a plain `q_proj`).
    pub q_lora_rank: Option<usize>,
    /// `kv_lora_rank`.
    pub kv_lora_rank: usize,
    /// `qk_nope_head_dim`.
    pub qk_nope: usize,
    /// `qk_rope_head_dim`.
    pub qk_rope: usize,
    /// `rope_interleave`: adjacent rope pairs (true) or rotate-half pairs.
    pub rope_interleave: bool,
    /// `v_head_dim`.
    pub v_head: usize,
    /// `max_position_embeddings`: the verify attention's keys go up to its length bucket.
    pub max_context: usize,
    /// The INT4 scale group of a quantized checkpoint (`quantization_config`), `None` for a
    /// dense one.
    pub int4_group: Option<usize>,
    /// SMs of the GPU the plan is for: the fused GEMVs' kernel choice depends on it
    /// ([`Lookup::rms_norm_linear`], [`Lookup::gate_up_silu`]). [`PLAN_SMS`] unless
    /// [`ModelDims::on_gpu`] sets the GPU's.
    pub sms: usize,
    /// Whether that GPU has `wgmma` (the dense INT4 GEMM's keys, [`Lookup::int4_gemm_wg`]).
    pub wgmma: bool,
}

/// The SM count a plan assumes until [`ModelDims::on_gpu`] gives the GPU's: an H100 or H200
/// SXM (132 SMs, with `wgmma`).
pub const PLAN_SMS: usize = 132;

impl ModelDims {
    /// Kimi K2.6 (DeepSeek-V3 architecture with 64 heads and 384 experts).
    pub fn kimi_k26() -> ModelDims {
        ModelDims {
            name: "kimi-k2.6".into(),
            hidden: 7168,
            vocab: 163840,
            intermediate: 18432,
            moe_intermediate: 2048,
            shared_experts: 1,
            routed_experts: 384,
            experts_per_tok: 8,
            // Kimi K2.6 runs expert-parallel on 8 GPUs (48 experts each, the kimi-k2.6-ep8 slice).
            expert_ranks: 8,
            heads: 64,
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope: 128,
            qk_rope: 64,
            rope_interleave: true,
            v_head: 128,
            max_context: 262144,
            int4_group: Some(32),
            sms: PLAN_SMS,
            wgmma: true,
        }
    }

    /// The dimensions of `c`, named `name`.
    pub fn from_config(name: String, c: &ModelConfig) -> ModelDims {
        ModelDims {
            name,
            hidden: c.hidden_size,
            vocab: c.vocab_size,
            intermediate: c.intermediate_size,
            moe_intermediate: c.moe.moe_intermediate_size,
            shared_experts: c.moe.n_shared_experts,
            routed_experts: c.moe.n_routed_experts,
            experts_per_tok: c.moe.num_experts_per_tok,
            expert_ranks: 1,
            heads: c.num_attention_heads,
            q_lora_rank: c.q_lora_rank,
            kv_lora_rank: c.kv_lora_rank,
            qk_nope: c.qk_nope_head_dim,
            qk_rope: c.qk_rope_head_dim,
            rope_interleave: c.rope.interleave,
            v_head: c.v_head_dim,
            max_context: c.max_position_embeddings,
            int4_group: c.quantization.as_ref().map(|q| q.group_size),
            sms: PLAN_SMS,
            wgmma: true,
        }
    }

    /// These dimensions on a GPU of `sms` SMs, with `wgmma` or not.
    pub fn on_gpu(self, sms: usize, wgmma: bool) -> ModelDims {
        ModelDims { sms, wgmma, ..self }
    }

    /// These dimensions with the routed experts spread over `ranks` expert-parallel ranks.
    pub fn with_expert_ranks(self, ranks: usize) -> ModelDims {
        ModelDims {
            expert_ranks: ranks.max(1),
            ..self
        }
    }

    /// The routed-expert block's keys, M = 1, 2, 4, ... up to `max_m` ([`Lookup::moe_experts`]:
    /// every MoE layer of a forward of M tokens), over one rank's local experts at the
    /// checkpoint's scale group (the backend quantizes dense experts at
    /// [`DENSE_EXPERT_GROUP`]). None without routed experts.
    fn moe_lookups(&self, max_m: usize) -> Vec<Lookup> {
        let experts = self.routed_experts / self.expert_ranks.max(1);
        if experts == 0 || self.experts_per_tok == 0 {
            return Vec::new();
        }
        let group = self.int4_group.unwrap_or(DENSE_EXPERT_GROUP);
        token_counts(max_m)
            .into_iter()
            .map(|m| {
                Lookup::moe_experts(
                    m,
                    self.experts_per_tok,
                    experts,
                    self.hidden,
                    self.moe_intermediate,
                    group,
                )
            })
            .collect()
    }

    /// The MLA dimensions of the attention layers.
    fn mla(&self) -> MlaDims {
        MlaDims {
            heads: self.heads,
            nope: self.qk_nope,
            rope: self.qk_rope,
            v: self.v_head,
            kv_lora: self.kv_lora_rank,
        }
    }

    /// The kernels the verify attention's keys allow: `--attention auto`, the default, which
    /// resolves to `mma` without `wgmma`.
    fn verify_kernels(&self) -> VerifyKernels {
        if self.wgmma {
            VerifyKernels::Auto
        } else {
            VerifyKernels::Mma
        }
    }

    /// The length buckets of the cache ([`length_bucket`]: 256, 512, ...) up to the model's
    /// context.
    fn length_buckets(&self) -> Vec<usize> {
        let top = length_bucket(self.max_context.max(1));
        std::iter::successors(Some(length_bucket(1)), |k| Some(k * 2))
            .take_while(|&k| k <= top)
            .collect()
    }

    /// The verify attention's keys ([`Lookup::mla_verify`]) of a forward of every token count up
    /// to `max_m` (rounded down to a power of two; decode steps, tree verifies and prefills
    /// alike) over every length bucket that holds it, the merge fused into the output
    /// projection up to [`MLA_COMBINE_OUTPUT_MAX_ROWS`] tokens (the model's
    /// `mla_attention_output` over its dense `kv_b`). None for latent rows other than Kimi's.
    fn verify_lookups(&self, max_m: usize) -> Vec<Lookup> {
        let top = *token_counts(max_m).last().expect("at least 1");
        let buckets = self.length_buckets();
        let mut keys = Vec::new();
        for m in 1..=top {
            for &len in buckets.iter().filter(|&&k| k >= length_bucket(m)) {
                let fused = m <= MLA_COMBINE_OUTPUT_MAX_ROWS;
                keys.extend(Lookup::mla_verify(m, len, self.mla(), fused, self.verify_kernels()));
            }
        }
        keys
    }

    /// The widths the RMS norms run at: hidden and the query latent.
    fn norms(&self) -> Vec<usize> {
        // The latent KV's norm (`kv_lora_rank`) runs fused in `mla_append_kv`, not on `rms_norm`.
        let mut norms = vec![self.hidden];
        norms.extend(self.q_lora_rank);
        norms
    }

    /// The `[n, k]` shapes of the linears that may be INT4 outside the routed experts: the
    /// shared experts' gate and up, and down, the dense MLP's. Which linears are INT4 is
    /// decided at load time from the tensors present, so their keys may go unused (Kimi's
    /// `ignore` list keeps the shared experts and the dense MLP bf16).
    fn int4_shapes(&self) -> Vec<(usize, usize)> {
        let shared = self.moe_intermediate * self.shared_experts;
        [
            (shared, self.hidden),            // shared experts' gate and up
            (self.hidden, shared),            // shared experts' down
            (self.intermediate, self.hidden), // dense MLP gate and up
            (self.hidden, self.intermediate), // dense MLP down
        ]
        .into_iter()
        .filter(|&(n, k)| n > 0 && k > 0)
        .collect()
    }

    /// The dense W4A16 GEMV keys of a quantized checkpoint, M = 1, 2, 4, ... up to `max_m`: the
    /// [`ModelDims::int4_shapes`] at every M where the CUDA backend's `linear` runs them on the
    /// GEMV ([`Lookup::int4_gemv`]). None for a dense checkpoint.
    fn int4_gemv_lookups(&self, max_m: usize) -> Vec<Lookup> {
        let Some(group) = self.int4_group else {
            return Vec::new();
        };
        let mut keys = Vec::new();
        for tokens in token_counts(max_m.min(DENSE_INT4_GEMV_MAX_ROWS)) {
            for (n, k) in self.int4_shapes() {
                keys.extend(Lookup::int4_gemv(tokens, n, k, group));
            }
        }
        keys
    }

    /// The `wgmma` W4A16 GEMM keys of a quantized checkpoint on a GPU with `wgmma`: the
    /// [`ModelDims::int4_shapes`] at every M up to `max_m` where `linear` runs them on that GEMM
    /// ([`Lookup::int4_gemm_wg`]: from 48 rows, the 64 bucket, on).
    fn int4_gemm_wg_lookups(&self, max_m: usize) -> Vec<Lookup> {
        let Some(group) = self.int4_group else {
            return Vec::new();
        };
        let mut keys = Vec::new();
        for m in token_counts(max_m) {
            for (n, k) in self.int4_shapes() {
                keys.extend(Lookup::int4_gemm_wg(m, n, k, group, self.wgmma));
            }
        }
        keys
    }

    /// The fused decode GEMVs' keys, M = 1, 2, 4 up to [`gemv::MAX_ROWS`] (and `max_m`): the MLA query's
    /// `q_b(q_norm(x))` ([`Lookup::rms_norm_linear`]; one row, a wide output) and the gate/up
    /// SiLU-and-mul of the shared experts and the dense MLP over dense weights
    /// ([`Lookup::gate_up_silu`]).
    fn fused_gemv_lookups(&self, max_m: usize) -> Vec<Lookup> {
        let shared = self.moe_intermediate * self.shared_experts;
        let mut keys = Vec::new();
        for m in token_counts(max_m.min(gemv::MAX_ROWS)) {
            if let Some(q_lora) = self.q_lora_rank {
                let q_b = self.heads * (self.qk_nope + self.qk_rope);
                keys.extend(Lookup::rms_norm_linear(m, q_b, q_lora, self.sms));
            }
            for n in [shared, self.intermediate] {
                if n > 0 {
                    keys.extend(Lookup::gate_up_silu(m, n, self.hidden, self.sms));
                }
            }
        }
        keys
    }

    /// The absorbed-MLA query's keys at M = 1, 2, 4, ... up to `max_m` where `mla_query` runs
    /// it ([`Lookup::mla_absorb_query`]: a few tokens, a variant for the head dims).
    fn mla_query_lookups(&self, max_m: usize) -> Vec<Lookup> {
        token_counts(max_m)
            .into_iter()
            .filter_map(|m| {
                Lookup::mla_absorb_query(
                    m,
                    self.heads,
                    self.kv_lora_rank,
                    self.qk_nope,
                    self.qk_rope,
                    self.v_head,
                    self.rope_interleave,
                )
            })
            .collect()
    }
}

/// M = 1, 2, 4, ... up to `max_m` (at least 1).
fn token_counts(max_m: usize) -> Vec<usize> {
    std::iter::successors(Some(1usize), |m| Some(m * 2))
        .take_while(|&m| m <= max_m.max(1))
        .collect()
}

/// Every tune-cache lookup the CUDA backend can make for `d` at M = 1, 2, 4, ..., `max_m`
/// rows, built with the same [`Lookup`] constructors the backend's dispatch calls: `rms_norm`
/// at the hidden and latent widths, `embedding`, the argmax (`row_topk`, k = 1, from
/// [`ddtree_kernels::topk::SPLIT_MAX_ROWS`] rows on), the dense `w4a16_gemv` of a quantized
/// checkpoint's INT4 linears (and, from 48 rows on a GPU with `wgmma`, their `wgmma` GEMM), the
/// fused decode GEMVs (RMSNorm + `q_b`, gate/up SiLU-and-mul), the absorbed-MLA query of a few
/// tokens, the MoE block, the verify attention over every length bucket of the context and the
/// tree builder.
/// Deduplicated by bucket, in a stable order.
pub fn lookups(d: &ModelDims, max_m: usize) -> Vec<Lookup> {
    let mut all = Vec::new();
    for m in token_counts(max_m) {
        all.extend(d.norms().into_iter().map(|n| Lookup::rms_norm(m, n)));
        all.push(Lookup::embedding(m, d.vocab, d.hidden));
        all.extend(Lookup::argmax(m, d.vocab));
    }
    all.extend(d.fused_gemv_lookups(max_m));
    all.extend(d.mla_query_lookups(max_m));
    all.extend(d.int4_gemv_lookups(max_m));
    all.extend(d.int4_gemm_wg_lookups(max_m));
    all.extend(d.moe_lookups(max_m));
    all.extend(d.verify_lookups(max_m));
    all.extend(tree_build_lookups(d.vocab));
    let mut seen = std::collections::HashSet::new();
    all.retain(|l| seen.insert(l.bucket()));
    all
}

/// The tuning jobs of [`lookups`]: what `autotune` tunes for `d`.
pub fn plan(d: &ModelDims, max_m: usize) -> Vec<Box<dyn Job>> {
    lookups(d, max_m).iter().map(Lookup::job).collect()
}

/// The drafted positions per round the GPU tree builder is tuned for: DFlash block sizes 8
/// and 16 (the bonus slot excluded).
pub const TREE_DEPTHS: [usize; 2] = [7, 15];

/// The GPU tree builder's keys at vocabulary `vocab`: every depth of [`TREE_DEPTHS`] at the
/// budget buckets 1, 2, 4, ..., [`tree::MAX_K`].
fn tree_build_lookups(vocab: usize) -> Vec<Lookup> {
    TREE_DEPTHS
        .into_iter()
        .flat_map(|depth| {
            token_counts(tree::MAX_K)
                .into_iter()
                .map(move |budget| Lookup::tree_build(depth, vocab, budget))
        })
        .collect()
}

/// The largest token count [`startup_plan`] covers: a verify forward of the largest `auto`
/// tree ([`crate::spec::AUTO_MAX_BUDGET`] nodes and the root) lands in this bucket.
pub const STARTUP_MAX_M: usize = 512;

/// The keys the CUDA backend looks up in the tune cache for `d` (`rms_norm` at the hidden and
/// latent widths, `embedding`, and `row_topk` with k = 1 for the argmax), M = 1, 2, 4, ...,
/// [`STARTUP_MAX_M`] (a subset of [`lookups`]). The dense `w4a16_gemv` keys are left to `autotune` ([`plan`]): which
/// linears are INT4 is known only once the weights load (Kimi's `ignore` list keeps them all
/// bf16), and without an entry the backend runs the mode's default. Every other kernel the
/// backend launches runs a fixed variant or cuBLAS, so tuning it at startup would only cost
/// time. Deduplicated, in a stable order.
pub fn startup_plan(d: &ModelDims) -> Vec<Box<dyn Job>> {
    lookups(d, STARTUP_MAX_M)
        .iter()
        .filter(|l| matches!(l, Lookup::RmsNorm(_) | Lookup::Embedding(_) | Lookup::Argmax(_)))
        .map(Lookup::job)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(jobs: &[Box<dyn Job>]) -> Vec<String> {
        jobs.iter().map(|j| format!("{} {}", j.kernel(), j.key())).collect()
    }

    fn assert_unique(keys: &[String]) {
        let set: std::collections::HashSet<&String> = keys.iter().collect();
        assert_eq!(set.len(), keys.len(), "duplicate keys in {keys:?}");
    }

    #[test]
    fn kimi_plan_is_stable_and_deduplicated() {
        let d = ModelDims::kimi_k26();
        let k = keys(&plan(&d, 256));
        assert_unique(&k);
        assert_eq!(k, keys(&plan(&d, 256)));
        // 9 token counts; per M: 2 norms (hidden, q_lora_rank) and the embedding, the argmax from M = 32 on (the
        // split top-1 below is untuned); up to M = 16 the INT4 GEMV of the shared expert's
        // gate/up (7168->2048) and down (2048->7168): the dense MLP (18432 x 7168) runs the
        // INT4 GEMM; the tree builder at 2 depths x 11 budget buckets; the fused GEMVs (q_b
        // with its norm at one row; the split-K gate/up of the shared expert and the per-column
        // one of the dense MLP at 1, 2, 4 rows); the `wgmma` INT4 GEMM of the 4 shapes at M =
        // 64, 128, 256; the absorbed-MLA query at 1, 2, 4 rows. No `gemm_bf16` (cuBLAS serves the dense products) and no kernel the
        // backend runs at a fixed variant.
        // The MoE block over one EP8 rank's 48 experts at every M; the verify attention at every
        // M over the 11 length buckets 256 .. 256K.
        assert_eq!(
            k.len(),
            9 * 3 + 4 + 5 * 2 + 2 * 11 + (1 + 3 + 3) + 4 * 3 + 3 + 9 + 9 * 11
        );
        for key in [
            "mla_verify tokens=1 heads=64 keys=256 nope=128 v=128 fused=true kernels=auto",
            "mla_verify tokens=2 heads=64 keys=262144 nope=128 v=128 fused=true kernels=auto",
            "mla_verify tokens=4 heads=64 keys=4096 nope=128 v=128 fused=false kernels=auto",
            "mla_verify tokens=256 heads=64 keys=256 nope=128 v=128 fused=false kernels=auto",
        ] {
            assert!(k.contains(&key.to_string()), "{key}: {k:?}");
        }
        for m in [1, 16, 256] {
            let key = format!("moe_w4a16 tokens={m} topk=8 experts=48 hidden=7168 inter=2048 group=32");
            assert!(k.contains(&key), "{key}: {k:?}");
        }
        for m in [1, 2, 4] {
            let key = format!("mla_absorb_query rows={m} heads=64 lora=512 nope=128 rope=64 v=128 interleave=true");
            assert!(k.contains(&key), "{key}: {k:?}");
        }
        for key in [
            "gemv_rms_norm_bf16 rows=1 n=12288 k=1536",
            "gemv_split_gate_up_silu rows=4 n=2048 k=7168",
            "gemv_gate_up_silu rows=1 n=18432 k=7168",
            "w4a16_gemm_wg dense m=64 n=18432 k=7168 group=32",
            "w4a16_gemm_wg dense m=256 n=7168 k=2048 group=32",
        ] {
            assert!(k.contains(&key.to_string()), "{key}: {k:?}");
        }
        assert!(!k.iter().any(|k| k.starts_with("gemv_rms_norm_bf16 rows=2")), "{k:?}");
        assert!(!k.iter().any(|k| k.starts_with("w4a16_gemm_wg dense m=32 ")), "{k:?}");
        // Without `wgmma` the INT4 GEMM runs its mma.sync default; a small GPU takes the
        // per-column gate/up for the shared expert from two rows on (one row of 7168 takes
        // split-K on any GPU).
        let k80 = keys(&plan(&d.clone().on_gpu(8, false), 256));
        assert!(!k80.iter().any(|k| k.starts_with("w4a16_gemm_wg")));
        // Without `wgmma`, `--attention auto` resolves to `mma`.
        assert_eq!(k80.iter().filter(|k| k.ends_with("kernels=mma")).count(), 9 * 11);
        assert!(
            k80.contains(&"gemv_gate_up_silu rows=2 n=2048 k=7168".to_string()),
            "{k80:?}"
        );
        assert!(!k
            .iter()
            .any(|k| k.starts_with("gemm_bf16") || k.starts_with("silu_mul")));
        assert!(!k.contains(&"row_topk rows=16 n=163840 k=1".to_string()), "{k:?}");
        assert!(
            k.contains(&"tree_build depth=7 vocab=163840 budget=64".to_string()),
            "{k:?}"
        );
        assert!(
            k.contains(&"tree_build depth=15 vocab=163840 budget=1024".to_string()),
            "{k:?}"
        );
        assert!(
            k.contains(&"w4a16_gemv dense tokens=16 n=2048 k=7168 group=32".to_string()),
            "{k:?}"
        );
        assert!(
            k.contains(&"w4a16_gemv dense tokens=1 n=7168 k=2048 group=32".to_string()),
            "{k:?}"
        );
        assert_eq!(k[0], "rms_norm rows=1 n=7168");
        // max_m rounds down to the powers of two it covers.
        assert_eq!(plan(&d, 300).len(), plan(&d, 256).len());
        let s = keys(&startup_plan(&d));
        assert_unique(&s);
        assert_eq!(s.len(), 10 * 3 + 5);
        assert!(s
            .iter()
            .all(|k| ["rms_norm", "embedding", "row_topk"].iter().any(|p| k.starts_with(p))));
        let gemv: Vec<String> = k.iter().filter(|k| k.starts_with("w4a16_gemv")).cloned().collect();
        let want: Vec<String> = [1, 2, 4, 8, 16]
            .iter()
            .flat_map(|t| {
                [
                    format!("w4a16_gemv dense tokens={t} n=2048 k=7168 group=32"),
                    format!("w4a16_gemv dense tokens={t} n=7168 k=2048 group=32"),
                ]
            })
            .collect();
        assert_eq!(gemv, want);
        // A dense checkpoint has no INT4 linears.
        let dense = ModelDims {
            int4_group: None,
            ..d.clone()
        };
        assert!(keys(&plan(&dense, 256)).iter().all(|k| !k.starts_with("w4a16_gemv")));
        assert!(s.contains(&"row_topk rows=512 n=163840 k=1".to_string()), "{s:?}");
        // Every startup key is also one autotune tunes (up to its M).
        let full = keys(&plan(&d, STARTUP_MAX_M));
        assert!(s.iter().all(|k| full.contains(k)));
    }

    #[test]
    fn tiny_plan_is_stable_and_deduplicated() {
        let c = crate::tiny::kimi::config().unwrap();
        let d = ModelDims::from_config("tiny".into(), &c);
        let k = keys(&plan(&d, 8));
        assert_unique(&k);
        assert_eq!(k, keys(&plan(&d, 8)));
        assert!(!k.is_empty());
        let s = keys(&startup_plan(&d));
        assert_unique(&s);
        assert_eq!(s, keys(&startup_plan(&d)));
        // hidden and q latent norms and the embedding per M, M = 1 .. 512; the argmax
        // from M = 32 on.
        assert_eq!(s.len(), 10 * (d.norms().len() + 1) + 5);
        assert_eq!(s[0], format!("rms_norm rows=1 n={}", c.hidden_size));
        // autotune's plan: the INT4 GEMV of the shared experts' and the dense MLP's 4 shapes up
        // to M = 8 here.
        let (h, i, sh) = (c.hidden_size, c.intermediate_size, c.moe.moe_intermediate_size);
        let g = d.int4_group.expect("the tiny Kimi is INT4");
        for key in [
            format!("w4a16_gemv dense tokens=1 n={sh} k={h} group={g}"),
            format!("w4a16_gemv dense tokens=8 n={i} k={h} group={g}"),
            format!("w4a16_gemv dense tokens=2 n={h} k={i} group={g}"),
        ] {
            assert!(k.contains(&key), "{key}: {k:?}");
        }
        assert!(!k.iter().any(|key| key.contains("tokens=16")), "{k:?}");
        // The fused gate/up GEMV of the shared experts and the dense MLP (split-K at these
        // widths on 132 SMs) at 1, 2, 4 rows (to M = 8 here); the q_b output is too narrow for
        // the fused RMSNorm GEMV, and M = 8 has no `wgmma` GEMM key (48 rows and up).
        let shared = c.moe.moe_intermediate_size * c.moe.n_shared_experts;
        for m in [1, 2, 4] {
            for n in [shared, i] {
                let key = format!("gemv_split_gate_up_silu rows={m} n={n} k={h}");
                assert!(k.contains(&key), "{key}: {k:?}");
            }
        }
        assert!(!k
            .iter()
            .any(|k| k.starts_with("gemv_rms_norm_bf16") || k.starts_with("w4a16_gemm_wg")));
        // Its 32-wide latent rows take the generic attention kernel, which is not tuned.
        assert!(!k.iter().any(|k| k.starts_with("mla_verify")), "{k:?}");
        let k256 = keys(&plan(&d, 256));
        assert!(
            k256.contains(&format!("w4a16_gemm_wg dense m=64 n={i} k={h} group=32")),
            "{k256:?}"
        );
    }

    /// The tune-cache lookups the CUDA backend's dispatch makes in a target forward of `rows`
    /// rows of `d` (every op family that takes a tuned variant, at the shapes the forward runs
    /// it; the INT4 linears as if every `int4_shapes` linear were INT4, the fused GEMVs as if
    /// they were dense, as the plan assumes), through the same [`Lookup`] constructors.
    fn forward_lookups(d: &ModelDims, rows: usize) -> Vec<Lookup> {
        let mut v: Vec<Lookup> = d.norms().into_iter().map(|n| Lookup::rms_norm(rows, n)).collect();
        v.push(Lookup::embedding(rows, d.vocab, d.hidden));
        v.extend(Lookup::argmax(rows, d.vocab));
        if let Some(q_lora) = d.q_lora_rank {
            v.extend(Lookup::rms_norm_linear(
                rows,
                d.heads * (d.qk_nope + d.qk_rope),
                q_lora,
                d.sms,
            ));
        }
        let shared = d.moe_intermediate * d.shared_experts;
        for n in [shared, d.intermediate].into_iter().filter(|&n| n > 0) {
            v.extend(Lookup::gate_up_silu(rows, n, d.hidden, d.sms));
        }
        v.extend(Lookup::mla_absorb_query(
            rows,
            d.heads,
            d.kv_lora_rank,
            d.qk_nope,
            d.qk_rope,
            d.v_head,
            d.rope_interleave,
        ));
        // `moe_experts`: every token of the forward, over the rank's local experts.
        if d.routed_experts > 0 {
            v.push(Lookup::moe_experts(
                rows,
                d.experts_per_tok,
                d.routed_experts / d.expert_ranks,
                d.hidden,
                d.moe_intermediate,
                d.int4_group.unwrap_or(DENSE_EXPERT_GROUP),
            ));
        }
        if let Some(group) = d.int4_group {
            for (n, k) in d.int4_shapes() {
                v.extend(Lookup::int4_gemv(rows, n, k, group));
                v.extend(Lookup::int4_gemm_wg(rows, n, k, group, d.wgmma));
            }
        }
        v
    }

    /// The verify attention's lookup of a forward of `rows` rows after `prefix` cache rows, as
    /// `CudaBackend::attend` makes it under `--attention auto` (resolved to `mma` without
    /// `wgmma`): the model's `mla_attention_output` fuses the merge up to
    /// [`MLA_COMBINE_OUTPUT_MAX_ROWS`] tokens.
    fn verify_lookup(d: &ModelDims, rows: usize, prefix: usize) -> Option<Lookup> {
        let kernels = if d.wgmma {
            VerifyKernels::Auto
        } else {
            VerifyKernels::Mma
        };
        let fused = rows <= MLA_COMBINE_OUTPUT_MAX_ROWS;
        Lookup::mla_verify(rows, length_bucket(prefix + rows), d.mla(), fused, kernels)
    }

    /// The dispatch decisions of forwards of every row count 1..=[`STARTUP_MAX_M`] (plain
    /// decode steps, prefills and tree verifies alike; the verify attention after prefixes
    /// that end at, in and past each length bucket up to the context) land in the plan's
    /// buckets, and every plan key but the tree builder's is the bucket of some forward's
    /// lookup: the plan holds what the backend looks up and nothing else, on an H100/H200, a
    /// small GPU without `wgmma`, for the tiny model and Kimi K2.6.
    #[test]
    fn forward_dispatch_decisions_are_the_plan() {
        let tiny = ModelDims::from_config("tiny".into(), &crate::tiny::kimi::config().unwrap());
        for d in [
            ModelDims::kimi_k26(),
            ModelDims::kimi_k26().on_gpu(8, false),
            tiny.clone(),
            tiny.on_gpu(8, false),
        ] {
            let plan: std::collections::HashSet<_> = lookups(&d, STARTUP_MAX_M).iter().map(Lookup::bucket).collect();
            let mut made = std::collections::HashSet::new();
            let prefixes: Vec<usize> = d
                .length_buckets()
                .into_iter()
                .flat_map(|k| [k / 2 + 1, k - 1, k])
                .chain([0, 1, 37])
                .collect();
            for rows in 1..=STARTUP_MAX_M {
                let verify = prefixes
                    .iter()
                    .filter(|&&p| p + rows <= d.max_context)
                    .filter_map(|&p| verify_lookup(&d, rows, p));
                for l in forward_lookups(&d, rows).into_iter().chain(verify) {
                    assert!(
                        plan.contains(&l.bucket()),
                        "{}: {l} at {rows} rows is not in the plan",
                        d.name
                    );
                    made.insert(l.bucket());
                }
            }
            let mut unused: Vec<_> = plan
                .iter()
                .filter(|b| b.0 != "tree_build" && !made.contains(*b))
                .collect();
            unused.sort();
            assert!(unused.is_empty(), "{}: never looked up: {unused:?}", d.name);
        }
    }
}
