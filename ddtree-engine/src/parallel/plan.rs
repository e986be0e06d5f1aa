//! The parallel plan: how a DeepSeek-V3 / Kimi K2.x model is cut over `world` ranks.
//!
//! - **MLA attention, tensor-parallel over heads** (degree `tp`): rank `r` owns the heads
//!   `r * H / tp ..`, so it holds those heads' rows of `q_b_proj` (or `q_proj`) and `kv_b_proj`
//!   and their columns of `o_proj`. `q_a_proj`, `kv_a_proj_with_mqa` and the norms are
//!   replicated: every rank computes the whole latent row and keeps the whole latent cache (all
//!   heads read the same latent). `o_proj` gives a partial sum: one all-reduce per layer.
//! - **Dense MLP and shared experts, tensor-parallel** (degree `tp`) over the intermediate
//!   dimension: rows of `gate_proj` / `up_proj`, columns of `down_proj`; partial sums.
//! - **Routed experts, expert-parallel** (degree `ep`): rank `r` holds experts
//!   `r * E / ep ..`; the router and its bias are replicated, every rank routes every token the
//!   same way and runs its local experts on the tokens sent to them; partial sums. The routed and
//!   shared partials are added before one all-reduce per layer.
//! - **Embedding and LM head, vocabulary-parallel** over all ranks: rank `r` holds a contiguous
//!   vocabulary slice. The embedding lookup contributes zero rows for ids outside the slice and
//!   is all-reduced; the LM head gives each rank the logits of its slice; greedy decoding
//!   reduces `(max, index)` pairs across ranks instead of gathering the logits, sampling and
//!   logit-recording paths gather them.
//!
//! `tp` and `ep` are each 1 (replicated) or `world`.

use std::fmt::Write as _;
use std::ops::Range;

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};

/// Rank counts the plan accepts.
pub const WORLD_SIZES: [usize; 4] = [1, 2, 4, 8];

/// The degrees of a parallel layout: `world` ranks, attention/dense tensor parallelism `tp`,
/// routed-expert parallelism `ep`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelSpec {
    /// Ranks (GPUs, or CPU threads).
    pub world: usize,
    /// Tensor-parallel degree of attention, the dense MLP and the shared experts (1 or `world`).
    pub tp: usize,
    /// Expert-parallel degree of the routed experts (1 or `world`).
    pub ep: usize,
}

impl ParallelSpec {
    /// One rank: the unsharded model.
    pub const SINGLE: ParallelSpec = ParallelSpec { world: 1, tp: 1, ep: 1 };

    /// `world` ranks with `tp` / `ep` defaulting to `world` (TP attention + EP experts).
    pub fn new(world: usize, tp: Option<usize>, ep: Option<usize>) -> Result<Self> {
        let bad = |argument: &str, reason: String| EngineError::Parallel {
            argument: argument.into(),
            reason,
        };
        if !WORLD_SIZES.contains(&world) {
            return Err(bad(
                "--gpus/--ranks",
                format!("{world} ranks; supported: {WORLD_SIZES:?}"),
            ));
        }
        let tp = tp.unwrap_or(world);
        let ep = ep.unwrap_or(world);
        for (arg, v) in [("--tp", tp), ("--ep", ep)] {
            if v != 1 && v != world {
                return Err(bad(
                    arg,
                    format!("{v}: must be 1 (replicated) or the rank count {world}"),
                ));
            }
        }
        Ok(Self { world, tp, ep })
    }

    /// Whether more than one rank runs.
    pub fn is_parallel(&self) -> bool {
        self.world > 1
    }
}

/// What one rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankShard {
    /// The rank.
    pub rank: usize,
    /// Its attention heads.
    pub heads: Range<usize>,
    /// Its columns of the dense MLP's intermediate dimension.
    pub dense_inter: Range<usize>,
    /// Its columns of the shared experts' intermediate dimension.
    pub shared_inter: Range<usize>,
    /// Its routed experts (global ids).
    pub experts: Range<usize>,
    /// Its vocabulary slice (embedding rows and LM head rows).
    pub vocab: Range<usize>,
}

/// How one checkpoint tensor is cut for a rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Split {
    /// The whole tensor.
    Replicated,
    /// Rows (output features) `range`.
    Rows(Range<usize>),
    /// Columns (input features) `range`.
    Cols(Range<usize>),
}

/// Rank `r`'s part of `0..n` cut into `parts` contiguous chunks (the last may be shorter).
fn chunk(n: usize, parts: usize, r: usize) -> Range<usize> {
    let size = n.div_ceil(parts);
    (r * size).min(n)..((r + 1) * size).min(n)
}

impl RankShard {
    /// How the linear layer `name` (checkpoint naming without `.weight`) is cut: by heads for
    /// `q_b_proj`, `q_proj`, `kv_b_proj` (rows) and `o_proj` (columns), by the intermediate
    /// dimension for the dense MLP and the shared experts, by vocabulary for `lm_head` and
    /// `embed_tokens`; everything else is replicated. `cfg` gives the per-head widths.
    pub fn linear_split(&self, cfg: &ModelConfig, name: &str) -> Split {
        let (parent, leaf) = name.rsplit_once('.').unwrap_or(("", name));
        let heads = |width: usize| self.heads.start * width..self.heads.end * width;
        match leaf {
            "q_b_proj" | "q_proj" => Split::Rows(heads(cfg.qk_head_dim())),
            "kv_b_proj" => Split::Rows(heads(cfg.qk_nope_head_dim + cfg.v_head_dim)),
            "o_proj" => Split::Cols(heads(cfg.v_head_dim)),
            "lm_head" | "embed_tokens" => Split::Rows(self.vocab.clone()),
            "gate_proj" | "up_proj" | "down_proj" => {
                let range = if parent.ends_with("shared_experts") {
                    self.shared_inter.clone()
                } else if parent.ends_with("mlp") {
                    self.dense_inter.clone()
                } else {
                    return Split::Replicated;
                };
                if leaf == "down_proj" {
                    Split::Cols(range)
                } else {
                    Split::Rows(range)
                }
            }
            _ => Split::Replicated,
        }
    }
}

/// How weights are stored, for byte counts: the CUDA backend keeps dense weights in bf16 and
/// INT4 experts packed with bf16 scales; the CPU backend keeps dense weights in f32 and INT4
/// experts packed with f32 scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// The CUDA backend.
    Gpu,
    /// The CPU backend.
    Cpu,
}

impl Storage {
    /// Bytes per dense parameter.
    pub fn dense_bytes(self) -> f64 {
        match self {
            Self::Gpu => 2.0,
            Self::Cpu => 4.0,
        }
    }

    /// Bytes per INT4 parameter in groups of `group` (codes plus scales).
    pub fn int4_bytes(self, group: usize) -> f64 {
        0.5 + self.dense_bytes() / group as f64
    }

    /// Bytes per latent-cache value.
    pub fn cache_bytes(self) -> f64 {
        self.dense_bytes()
    }
}

/// Parameter counts of one rank by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RankParams {
    /// Embedding rows (one row is read per token).
    pub embed: u64,
    /// Attention weights and norms (all read per token).
    pub attention: u64,
    /// Dense MLPs, shared experts, routers and final norm (all read per token).
    pub dense: u64,
    /// Routed experts held.
    pub experts: u64,
    /// Parameters of one routed expert.
    pub per_expert: u64,
    /// LM head rows.
    pub lm_head: u64,
}

/// The plan for one model over `spec.world` ranks.
#[derive(Debug, Clone)]
pub struct ParallelPlan {
    /// The layout.
    pub spec: ParallelSpec,
    /// The model.
    pub config: ModelConfig,
    /// What each rank holds, by rank.
    pub shards: Vec<RankShard>,
}

impl ParallelPlan {
    /// The plan of `cfg` under `spec`; fails naming the config field that does not divide.
    pub fn new(cfg: &ModelConfig, spec: ParallelSpec) -> Result<Self> {
        let field = |name: &str, value: usize, by: usize, arg: &str| -> Result<()> {
            #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` needs Rust 1.87; MSRV is 1.85
            if value % by != 0 {
                return Err(EngineError::Parallel {
                    argument: arg.into(),
                    reason: format!("{name} = {value} is not divisible by {by}"),
                });
            }
            Ok(())
        };
        let shared = cfg.moe.n_shared_experts * cfg.moe.moe_intermediate_size;
        field("num_attention_heads", cfg.num_attention_heads, spec.tp, "--tp")?;
        field("intermediate_size", cfg.intermediate_size, spec.tp, "--tp")?;
        field("n_shared_experts * moe_intermediate_size", shared, spec.tp, "--tp")?;
        field("n_routed_experts", cfg.moe.n_routed_experts, spec.ep, "--ep")?;
        if cfg.vocab_size < spec.world {
            return Err(EngineError::Parallel {
                argument: "--gpus/--ranks".into(),
                reason: format!("vocab_size {} is smaller than {} ranks", cfg.vocab_size, spec.world),
            });
        }
        let shards = (0..spec.world)
            .map(|r| {
                let (t, e) = (r % spec.tp, r % spec.ep);
                RankShard {
                    rank: r,
                    heads: chunk(cfg.num_attention_heads, spec.tp, t),
                    dense_inter: chunk(cfg.intermediate_size, spec.tp, t),
                    shared_inter: chunk(shared, spec.tp, t),
                    experts: chunk(cfg.moe.n_routed_experts, spec.ep, e),
                    vocab: chunk(cfg.vocab_size, spec.world, r),
                }
            })
            .collect();
        Ok(Self {
            spec,
            config: cfg.clone(),
            shards,
        })
    }

    /// Parameters rank `rank` holds, by kind.
    pub fn rank_params(&self, rank: usize) -> RankParams {
        let cfg = &self.config;
        let s = &self.shards[rank];
        let h = cfg.hidden_size as u64;
        let heads = s.heads.len() as u64;
        let q = match cfg.q_lora_rank {
            Some(r) => h * r as u64 + r as u64 + r as u64 * heads * cfg.qk_head_dim() as u64,
            None => h * heads * cfg.qk_head_dim() as u64,
        };
        let attention = q
            + h * cfg.latent_row_width() as u64
            + cfg.kv_lora_rank as u64
            + heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) as u64 * cfg.kv_lora_rank as u64
            + heads * cfg.v_head_dim as u64 * h
            + 2 * h;
        let moe = &cfg.moe;
        let per_expert = 3 * h * moe.moe_intermediate_size as u64;
        let mut p = RankParams {
            embed: s.vocab.len() as u64 * h,
            lm_head: s.vocab.len() as u64 * h,
            per_expert,
            dense: h,
            ..RankParams::default()
        };
        for l in 0..cfg.num_hidden_layers {
            p.attention += attention;
            if cfg.is_moe_layer(l) {
                let e = moe.n_routed_experts as u64;
                p.dense += e * h + e + 3 * h * s.shared_inter.len() as u64;
                p.experts += s.experts.len() as u64 * per_expert;
            } else {
                p.dense += 3 * h * s.dense_inter.len() as u64;
            }
        }
        p
    }

    /// Bytes of weights rank `rank` holds.
    pub fn weight_bytes(&self, rank: usize, storage: Storage) -> u64 {
        let p = self.rank_params(rank);
        let dense = (p.embed + p.attention + p.dense + p.lm_head) as f64 * storage.dense_bytes();
        (dense + p.experts as f64 * self.expert_bytes_per_param(storage)) as u64
    }

    fn expert_bytes_per_param(&self, storage: Storage) -> f64 {
        match &self.config.quantization {
            Some(q) => storage.int4_bytes(q.group_size),
            None => storage.dense_bytes(),
        }
    }

    /// Bytes of latent cache one rank holds for `tokens` tokens (every rank keeps the whole
    /// latent of every layer).
    pub fn cache_bytes(&self, tokens: usize, storage: Storage) -> u64 {
        let cfg = &self.config;
        (cfg.num_hidden_layers as f64 * cfg.latent_row_width() as f64 * tokens as f64 * storage.cache_bytes()) as u64
    }

    /// Bytes rank `rank` reads for one decoded token at `context` cached rows: every attention
    /// and dense weight it holds, one embedding row, its LM head slice, its latent cache, and
    /// its routed experts that the token chooses. Returns `(expected, worst)`: on average
    /// `top_k * local / E` of a token's experts are local; at worst `min(top_k, local)`.
    pub fn decode_read_bytes(&self, rank: usize, context: usize, storage: Storage) -> (u64, u64) {
        let cfg = &self.config;
        let p = self.rank_params(rank);
        let d = storage.dense_bytes();
        let base = (cfg.hidden_size as u64 + p.attention + p.dense + p.lm_head) as f64 * d
            + self.cache_bytes(context, storage) as f64;
        let moe_layers = (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)).count() as f64;
        let local = self.shards[rank].experts.len() as f64;
        let k = cfg.moe.num_experts_per_tok as f64;
        let expert = p.per_expert as f64 * self.expert_bytes_per_param(storage) * moe_layers;
        let expected = k * local / cfg.moe.n_routed_experts as f64;
        ((base + expected * expert) as u64, (base + k.min(local) * expert) as u64)
    }

    /// Bytes each rank sends into all-reduces per decoded token (f32 hidden rows on the CPU,
    /// bf16 on GPUs): the embedding, and per layer the attention output and the MLP output
    /// (where they are partial), plus the argmax pairs of the LM head.
    pub fn allreduce_bytes_per_token(&self, storage: Storage) -> u64 {
        if !self.spec.is_parallel() {
            return 0;
        }
        let cfg = &self.config;
        let row = cfg.hidden_size as f64 * storage.dense_bytes();
        let mut count = 1.0; // the vocabulary-parallel embedding
        for l in 0..cfg.num_hidden_layers {
            if self.spec.tp > 1 {
                count += 1.0;
            }
            if self.spec.tp > 1 || (cfg.is_moe_layer(l) && self.spec.ep > 1) {
                count += 1.0;
            }
        }
        (count * row) as u64 + 8 * self.spec.world as u64
    }

    /// A human-readable table of the plan: per rank its shards, its weight bytes and what it
    /// reads per token at `context`.
    pub fn render(&self, context: usize, storage: Storage) -> String {
        let cfg = &self.config;
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{} ranks: attention/dense TP {}, routed experts EP {}, vocabulary-parallel embedding and LM head",
            self.spec.world, self.spec.tp, self.spec.ep
        );
        let _ = writeln!(
            s,
            "model: {} layers, {} heads, {} routed experts (top-{}), hidden {}, vocab {}; storage {:?}",
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.moe.n_routed_experts,
            cfg.moe.num_experts_per_tok,
            cfg.hidden_size,
            cfg.vocab_size,
            storage
        );
        let _ = writeln!(
            s,
            "{:>4}  {:>9}  {:>11}  {:>11}  {:>11}  {:>15}  {:>9}  {:>14}  {:>11}",
            "rank",
            "heads",
            "dense cols",
            "shared cols",
            "experts",
            "vocab",
            "weights",
            format!("read/tok@{context}"),
            "worst read"
        );
        for shard in &self.shards {
            let (expected, worst) = self.decode_read_bytes(shard.rank, context, storage);
            let r = |x: &Range<usize>| format!("{}..{}", x.start, x.end);
            let _ = writeln!(
                s,
                "{:>4}  {:>9}  {:>11}  {:>11}  {:>11}  {:>15}  {:>6.2} GiB  {:>10.3} GiB  {:>7.3} GiB",
                shard.rank,
                r(&shard.heads),
                r(&shard.dense_inter),
                r(&shard.shared_inter),
                r(&shard.experts),
                r(&shard.vocab),
                gib(self.weight_bytes(shard.rank, storage)),
                gib(expected),
                gib(worst)
            );
        }
        let _ = writeln!(
            s,
            "latent cache per rank: {:.1} KiB per token (replicated: every rank keeps every layer's latent)",
            self.cache_bytes(1, storage) as f64 / 1024.0
        );
        let _ = writeln!(
            s,
            "collectives per decoded token and rank: {} bytes into all-reduces",
            self.allreduce_bytes_per_token(storage)
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::Preset;

    #[test]
    fn kimi_over_eight_ranks_splits_heads_experts_and_vocab_evenly() {
        let cfg = Preset::KimiK26.config().unwrap();
        let plan = ParallelPlan::new(&cfg, ParallelSpec::new(8, None, None).unwrap()).unwrap();
        let s = &plan.shards[3];
        assert_eq!(s.heads, 24..32);
        assert_eq!(s.experts, 144..192);
        assert_eq!(s.vocab, 61440..81920);
        assert_eq!(
            s.linear_split(&cfg, "model.layers.5.self_attn.o_proj"),
            Split::Cols(3072..4096)
        );
        assert_eq!(
            s.linear_split(&cfg, "model.layers.5.mlp.shared_experts.up_proj"),
            Split::Rows(768..1024)
        );
        assert_eq!(
            s.linear_split(&cfg, "model.layers.0.mlp.down_proj"),
            Split::Cols(6912..9216)
        );
        assert_eq!(s.linear_split(&cfg, "model.layers.5.mlp.gate"), Split::Replicated);
        // The whole model is about 595 GB on GPUs; the ranks' shares sum to it.
        let total: u64 = (0..8).map(|r| plan.weight_bytes(r, Storage::Gpu)).sum();
        let single = ParallelPlan::new(&cfg, ParallelSpec::SINGLE).unwrap();
        let one = single.weight_bytes(0, Storage::Gpu);
        assert!(total >= one && (total - one) < one / 10, "{total} vs {one}");
        assert!((500e9..700e9).contains(&(one as f64)), "{one}");
    }

    #[test]
    fn bad_degrees_name_the_argument() {
        let e = ParallelSpec::new(3, None, None).unwrap_err().to_string();
        assert!(e.contains("--gpus/--ranks"), "{e}");
        let e = ParallelSpec::new(4, Some(2), None).unwrap_err().to_string();
        assert!(e.contains("--tp"), "{e}");
        let cfg = crate::tiny::kimi::config().unwrap();
        let e = ParallelPlan::new(&cfg, ParallelSpec::new(8, None, None).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_attention_heads"), "{e}");
    }
}
