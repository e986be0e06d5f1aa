//! `ddtree bench`: the engine on a synthetic model of real shapes (random weights made on the
//! backend, no files): plain decode at several contexts against the bytes-per-token floor, and
//! DDTree rounds for a range of budgets with scripted drafters of controlled acceptance.
//!
//! Presets: [`Preset::KimiK26Ep8`] is one GPU's share of an 8-GPU expert-parallel Kimi K2.6
//! deployment (61 layers, the first dense; 48 local routed experts of 7168/2048 INT4 g32 with
//! top-8 routing over them, one shared expert, MLA with 64 heads, vocabulary 163840; about
//! 100 GB). [`Preset::Tiny`] has the embedded tiny-kimi fixture's shapes, so the whole path runs on
//! the CPU in tests.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::backend::{Backend, Matrix};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::generate::{generate_plain, GenerateOptions};
use crate::model::{ForwardInput, LogitRows, Model};
use crate::parallel::{ParallelPlan, Storage};
use crate::spec::budget::CostModel;
use crate::spec::drafter::{DraftRequest, Drafter};
use crate::spec::{generate_speculative, Budget, SpecOptions, SpecStats, TreeSource, AUTO_MAX_BUDGET};

/// Untimed decode steps before the timed ones (kernel loads, allocator pools).
const WARMUP_STEPS: usize = 2;

/// A synthetic model to benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// Kimi K2.6, one GPU's share of 8-way expert parallelism.
    KimiK26Ep8,
    /// The whole Kimi K2.6 (384 routed experts, about 595 GB on GPUs): for `--gpus N`, sharded
    /// by the parallel plan.
    KimiK26,
    /// The embedded tiny-kimi fixture's shapes (CPU-sized).
    Tiny,
}

impl Preset {
    /// The preset's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::KimiK26Ep8 => "kimi-k2.6-ep8",
            Self::KimiK26 => "kimi-k2.6",
            Self::Tiny => "tiny",
        }
    }

    /// Parses a preset name.
    pub fn parse(s: &str) -> Result<Preset> {
        match s {
            "kimi-k2.6-ep8" => Ok(Self::KimiK26Ep8),
            "kimi-k2.6" => Ok(Self::KimiK26),
            "tiny" => Ok(Self::Tiny),
            _ => Err(EngineError::Forward(format!(
                "unknown bench preset {s:?}; presets: kimi-k2.6-ep8, kimi-k2.6, tiny"
            ))),
        }
    }

    /// The model configuration (a `config.json` as the checkpoint would carry it).
    pub fn config(self) -> Result<ModelConfig> {
        match self {
            Self::Tiny => crate::tiny::kimi::config(),
            Self::KimiK26Ep8 => ModelConfig::from_json(KIMI_K26_EP8, std::path::Path::new("<kimi-k2.6-ep8 preset>")),
            Self::KimiK26 => ModelConfig::from_json(
                &KIMI_K26_EP8.replace(r#""n_routed_experts": 48"#, r#""n_routed_experts": 384"#),
                std::path::Path::new("<kimi-k2.6 preset>"),
            ),
        }
    }
}

/// Kimi K2.6's text config with the routed experts cut to one GPU's 48 of 384 (top-8 routing
/// over the local experts, one routing group).
const KIMI_K26_EP8: &str = r#"{
  "model_type": "kimi_k2",
  "architectures": ["DeepseekV3ForCausalLM"],
  "vocab_size": 163840,
  "hidden_size": 7168,
  "intermediate_size": 18432,
  "moe_intermediate_size": 2048,
  "num_hidden_layers": 61,
  "num_attention_heads": 64,
  "num_key_value_heads": 64,
  "n_shared_experts": 1,
  "n_routed_experts": 48,
  "routed_scaling_factor": 2.827,
  "kv_lora_rank": 512,
  "q_lora_rank": 1536,
  "qk_rope_head_dim": 64,
  "v_head_dim": 128,
  "qk_nope_head_dim": 128,
  "topk_method": "noaux_tc",
  "n_group": 1,
  "topk_group": 1,
  "num_experts_per_tok": 8,
  "moe_layer_freq": 1,
  "first_k_dense_replace": 1,
  "norm_topk_prob": true,
  "scoring_func": "sigmoid",
  "hidden_act": "silu",
  "max_position_embeddings": 262144,
  "rms_norm_eps": 1e-5,
  "rope_theta": 50000.0,
  "rope_scaling": {
    "type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0
  },
  "tie_word_embeddings": false,
  "bos_token_id": 163584,
  "eos_token_id": 163585,
  "quantization_config": {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
      "group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 32}
      }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
  }
}"#;

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Contexts (cache rows before the first decoded token) of the plain-decode runs.
    pub contexts: Vec<usize>,
    /// Decode steps timed per context.
    pub decode_steps: usize,
    /// Tree budgets of the DDTree runs.
    pub budgets: Vec<usize>,
    /// Scripted drafter profiles of the DDTree runs.
    pub accept: Vec<DraftProfile>,
    /// Prompt length of the DDTree runs.
    pub prompt_len: usize,
    /// Tokens generated per DDTree run (and by the plain run they are compared with).
    pub spec_tokens: usize,
    /// Drafter block size (bonus slot included).
    pub block_size: usize,
    /// `auto` with calibrated drafter probabilities ([`SpecOptions::calibrate`]).
    pub calibrate_auto: bool,
    /// Seed of the weights, prompts and drafters.
    pub seed: u64,
    /// The model is one rank's share of this plan (`--virtual-rank`): the decode bytes floor is
    /// that rank's ([`ParallelPlan::decode_read_bytes`], expected), not the whole model's.
    pub rank: Option<(Arc<ParallelPlan>, usize)>,
}

impl BenchOptions {
    /// The defaults for `preset`: contexts 1K/8K/32K and budgets 8..256 for Kimi; small ones
    /// for the tiny model.
    pub fn for_preset(preset: Preset) -> BenchOptions {
        match preset {
            Preset::KimiK26Ep8 | Preset::KimiK26 => BenchOptions {
                contexts: vec![1024, 8192, 32768],
                decode_steps: 24,
                budgets: vec![8, 16, 32, 64, 128, 256],
                accept: vec![
                    DraftProfile::Noisy(1.0),
                    DraftProfile::Noisy(0.9),
                    DraftProfile::Noisy(0.7),
                    DraftProfile::Noisy(0.5),
                    DraftProfile::Switching,
                ],
                prompt_len: 128,
                spec_tokens: 48,
                block_size: 8,
                calibrate_auto: false,
                seed: 1,
                rank: None,
            },
            Preset::Tiny => BenchOptions {
                contexts: vec![16, 64],
                decode_steps: 4,
                budgets: vec![4, 16],
                accept: vec![
                    DraftProfile::Noisy(1.0),
                    DraftProfile::Noisy(0.5),
                    DraftProfile::Switching,
                ],
                prompt_len: 8,
                spec_tokens: 12,
                block_size: 4,
                calibrate_auto: false,
                seed: 1,
                rank: None,
            },
        }
    }
}

/// One plain-decode measurement.
#[derive(Debug, Clone, Serialize)]
pub struct DecodeRow {
    /// Cache rows before the first timed token.
    pub context: usize,
    /// Median step time (ms).
    pub step_ms: f64,
    /// Tokens per second at the median step.
    pub tokens_per_s: f64,
    /// Weight and cache bytes one step must read.
    pub bytes_per_token: u64,
    /// `bytes_per_token / step` in GB/s.
    pub gb_per_s: f64,
    /// Of the measured copy bandwidth, when known.
    pub floor_fraction: Option<f64>,
}

/// How a [`Scripted`] drafter drafts (`--accept`: a probability, or `switching`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DraftProfile {
    /// Right at each position with probability P (1: the oracle), otherwise a wrong token ranks
    /// first and the right one second; always ~85% confident, so miscalibrated below 1.
    Noisy(f32),
    /// Calibrated and regime-switching: stretches of [`SWITCH_SPAN`] positions alternate between
    /// an easy regime (top token 92% likely) and a hard one (35%, with the right token often
    /// ranked 2nd to 5th); the right token's rank is drawn from the drafter's own distribution,
    /// so its probabilities are honest. A fixed budget is right for one regime at most.
    Switching,
}

/// Positions per regime of [`DraftProfile::Switching`].
pub const SWITCH_SPAN: usize = 24;

/// The drafter's top-5 probabilities (the rest spread over the vocabulary) per regime of
/// [`DraftProfile::Switching`]: easy, then hard.
const SWITCH_TOP: [[f64; 5]; 2] = [[0.92, 0.04, 0.015, 0.01, 0.005], [0.35, 0.2, 0.15, 0.1, 0.05]];

impl std::fmt::Display for DraftProfile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DraftProfile::Noisy(p) => write!(f, "{p}"),
            DraftProfile::Switching => f.write_str("switching"),
        }
    }
}

impl std::str::FromStr for DraftProfile {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s == "switching" {
            return Ok(DraftProfile::Switching);
        }
        match s.parse::<f32>() {
            Ok(p) if (0.0..=1.0).contains(&p) => Ok(DraftProfile::Noisy(p)),
            _ => Err(format!(
                "`{s}` is not a drafter profile: give an acceptance probability in [0, 1] or `switching`"
            )),
        }
    }
}

impl Serialize for DraftProfile {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// One DDTree run.
#[derive(Debug, Clone, Serialize)]
pub struct SpecRow {
    /// Drafter profile.
    pub accept: DraftProfile,
    /// Budget (`None`: auto).
    pub budget: Option<usize>,
    /// Mean budget chosen per round (auto).
    pub mean_budget: f64,
    /// Rounds.
    pub rounds: usize,
    /// Mean accepted length per round (root included).
    pub mean_accept_len: f64,
    /// Mean round time (ms).
    pub round_ms: f64,
    /// Generated tokens per second after the prefill.
    pub tokens_per_s: f64,
    /// Over plain decoding on the same prompt.
    pub speedup: f64,
    /// Mean per-round phase times (ms): draft, build, verify, accept.
    pub phase_ms: [f64; 4],
    /// Whether the tokens equal plain greedy decoding's.
    pub identical: bool,
    /// Rounds per chosen budget, `(budget, rounds)` by budget.
    pub budgets: Vec<(usize, usize)>,
    /// Forwards replayed from and recorded into CUDA graphs during the timed run (`None`: the
    /// backend records none). A recording costs far more than a replay: a budget chosen once is
    /// run eagerly, a second time recorded, and replayed only from its third round.
    pub graphs: Option<(u64, u64)>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Preset name.
    pub preset: String,
    /// Backend name.
    pub backend: String,
    /// Parameters of the model.
    pub parameters: u64,
    /// Measured copy bandwidth (GB/s), when known.
    pub copy_gb_per_s: Option<f64>,
    /// Plain decode per context.
    pub decode: Vec<DecodeRow>,
    /// Plain decode tokens/s on the DDTree prompt (the speedup baseline).
    pub plain_tokens_per_s: f64,
    /// DDTree runs.
    pub spec: Vec<SpecRow>,
    /// On several ranks: the DDTree rounds with each tree source (every rank builds, or rank 0
    /// builds and broadcasts), first drafter profile, fixed budgets. Empty on one rank.
    pub tree_sources: Vec<TreeSourceRow>,
}

/// One multi-rank DDTree run with a given tree source ([`SpecOptions::tree_source`]).
#[derive(Debug, Clone, Serialize)]
pub struct TreeSourceRow {
    /// `replicated` or `rank0`.
    pub tree_source: String,
    /// Drafter profile.
    pub accept: DraftProfile,
    /// Tree budget.
    pub budget: usize,
    /// Rounds.
    pub rounds: usize,
    /// Wall time per round (draft, build, verify, accept) on rank 0.
    pub round_ms: f64,
    /// Build per round (the broadcast included for `rank0`).
    pub build_ms: f64,
    /// The tree broadcast per round (0 for `replicated`).
    pub sync_ms: f64,
    /// Tokens per second.
    pub tokens_per_s: f64,
    /// Same tokens as plain decoding.
    pub identical: bool,
}

/// Bytes one plain decode step reads at `context` cached rows: every dense weight, the
/// routed experts of one token (top-k, INT4 codes plus scales), the shared experts, the LM
/// head, the latent cache of every layer, and one embedding row.
pub fn decode_bytes(cfg: &ModelConfig, context: usize) -> u64 {
    let (h, heads) = (cfg.hidden_size as u64, cfg.num_attention_heads as u64);
    let lw = cfg.latent_row_width() as u64;
    let q = match cfg.q_lora_rank {
        Some(r) => h * r as u64 + r as u64 * heads * cfg.qk_head_dim() as u64,
        None => h * heads * cfg.qk_head_dim() as u64,
    };
    let attn = 2
        * (q + h * lw
            + heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) as u64 * cfg.kv_lora_rank as u64
            + heads * cfg.v_head_dim as u64 * h);
    let cache = 2 * lw * context as u64;
    let moe = &cfg.moe;
    let inter = moe.moe_intermediate_size as u64;
    let expert = match &cfg.quantization {
        Some(qc) => 3 * h * inter / 2 + 2 * 3 * h * inter / qc.group_size as u64,
        None => 2 * 3 * h * inter,
    };
    let mut total = 2 * h + 2 * cfg.vocab_size as u64 * h;
    for l in 0..cfg.num_hidden_layers {
        total += attn + cache;
        total += if cfg.is_moe_layer(l) {
            2 * moe.n_routed_experts as u64 * h
                + moe.num_experts_per_tok as u64 * expert
                + 2 * 3 * h * inter * moe.n_shared_experts as u64
        } else {
            2 * 3 * h * cfg.intermediate_size as u64
        };
    }
    total
}

/// A drafter that knows the target's greedy continuation and drafts it as its
/// [`DraftProfile`] says. The logits are made on the host and handed over with
/// [`Backend::load_logits`].
pub struct Scripted {
    block_size: usize,
    accept: DraftProfile,
    continuation: Vec<u32>,
    vocab: usize,
    rng: StdRng,
}

impl Scripted {
    /// A drafter of `block_size - 1` positions over `continuation` (prompt + greedy tokens).
    pub fn new(block_size: usize, accept: DraftProfile, continuation: Vec<u32>, vocab: usize, seed: u64) -> Scripted {
        Scripted {
            block_size,
            accept,
            continuation,
            vocab,
            rng: StdRng::seed_from_u64(seed),
        }
    }
}

impl<B: Backend> Drafter<B> for Scripted {
    fn name(&self) -> String {
        match self.accept {
            DraftProfile::Noisy(p) if p >= 1.0 => "scripted oracle".into(),
            a => format!("scripted:{a}"),
        }
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn target_layers(&self) -> &[usize] {
        &[]
    }

    fn begin(&mut self, _target: &Model<B>, _capacity: usize) -> Result<()> {
        Ok(())
    }

    fn draft(&mut self, target: &Model<B>, request: DraftRequest<'_, B::Tensor>) -> Result<B::Tensor> {
        let depth = self.block_size - 1;
        let mut m = Matrix::zeros(depth, self.vocab);
        for i in 0..depth {
            let pos = request.tokens.len() + i;
            let right = self.continuation.get(pos).copied().unwrap_or(0) as usize;
            match self.accept {
                DraftProfile::Noisy(p) => self.noisy_row(m.row_mut(i), right, p),
                DraftProfile::Switching => {
                    let top = &SWITCH_TOP[(pos / SWITCH_SPAN) % 2];
                    self.calibrated_row(m.row_mut(i), right, top)
                }
            }
        }
        target.backend().load_logits(m)
    }
}

impl Scripted {
    /// A [`DraftProfile::Noisy`] row: peaked like a trained drafter (the top token ~85% of the
    /// mass, the runner-up ~11%, three more ~1% each, the rest almost nothing).
    fn noisy_row(&mut self, row: &mut [f32], right: usize, p: f32) {
        row[right] = 28.0;
        if self.rng.random::<f32>() >= p {
            let wrong = (right + self.rng.random_range(1..self.vocab)) % self.vocab;
            row[wrong] = 30.0;
        }
        for _ in 0..3 {
            let other = self.rng.random_range(0..self.vocab);
            if row[other] == 0.0 {
                row[other] = 25.5;
            }
        }
    }

    /// A calibrated row: softmax gives the probabilities `top` to five distinct tokens and the
    /// rest of the mass to the others (logit 0), and the right token takes rank `r` with
    /// probability `top[r]` (or none of the five with the rest).
    fn calibrated_row(&mut self, row: &mut [f32], right: usize, top: &[f64; 5]) {
        let rest = 1.0 - top.iter().sum::<f64>();
        // exp(logit) = p * z with the other tokens' total exp(0) * (vocab - 5) = rest * z.
        let z = (self.vocab - top.len()) as f64 / rest;
        let u: f64 = self.rng.random();
        let mut acc = 0.0;
        let rank = top.iter().position(|&p| {
            acc += p;
            u < acc
        });
        let mut used = vec![right];
        for (r, &p) in top.iter().enumerate() {
            let tok = if Some(r) == rank {
                right
            } else {
                loop {
                    let t = self.rng.random_range(0..self.vocab);
                    if !used.contains(&t) {
                        used.push(t);
                        break t;
                    }
                }
            };
            row[tok] = (p * z).ln() as f32;
        }
    }
}

/// The verify curve `auto` gets from the fixed-budget runs' `(tokens, µs)` points: a staircase
/// that steps up right after each measured size, so a size between two measured ones costs
/// what the larger one does. The verify kernels tile the tokens (cuBLAS and the grouped MoE
/// GEMM by 8-16 rows, the attention by node), so on the H200 a tree of 10-16 tokens costs about
/// as much as one of 17; a straight line between the points made `auto` pick such trees and lose
/// 20% on the `switching` profile (BENCHMARKS.md).
pub fn staircase(points: &[(usize, f64)]) -> Vec<(usize, f64)> {
    let mut sorted = points.to_vec();
    sorted.sort_by_key(|&(t, _)| t);
    let mut out = Vec::with_capacity(2 * sorted.len());
    for (i, &(t, us)) in sorted.iter().enumerate() {
        if let Some(&(prev, _)) = i.checked_sub(1).map(|j| &sorted[j]) {
            if t > prev + 1 {
                out.push((prev + 1, us));
            }
        }
        out.push((t, us));
    }
    out
}

/// Runs the benchmark on `model` (made with [`Model::random`]). `copy_gb_per_s` is the
/// measured bandwidth floor of the device, when known; `progress` gets one line per run.
pub fn run<B: Backend>(
    model: &Model<B>,
    preset: Preset,
    opts: &BenchOptions,
    copy_gb_per_s: Option<f64>,
    progress: &mut dyn FnMut(&str),
) -> Result<BenchReport> {
    let cfg = model.config().clone();
    let b = model.backend();
    let mut decode = Vec::new();
    for &context in &opts.contexts {
        let mut cache = model.new_cache(context + opts.decode_steps + WARMUP_STEPS)?;
        b.kv_fill_random(&mut cache, context, opts.seed)?;
        let mut token = 1u32;
        let mut steps = Vec::with_capacity(opts.decode_steps);
        for i in 0..opts.decode_steps + WARMUP_STEPS {
            let t = Instant::now();
            let position = [(context + i) as u32];
            let input = ForwardInput {
                tokens: &[token],
                positions: &position,
                mask: None,
                logits: LogitRows::Last,
            };
            token = model.forward_greedy(&mut cache, input)?[0];
            if i >= WARMUP_STEPS {
                steps.push(t.elapsed());
            }
        }
        let step = median(&mut steps);
        let bytes = match &opts.rank {
            Some((plan, rank)) => plan.decode_read_bytes(*rank, context, Storage::Gpu).0,
            None => decode_bytes(&cfg, context),
        };
        let gbs = bytes as f64 / step.as_secs_f64() / 1e9;
        let row = DecodeRow {
            context,
            step_ms: step.as_secs_f64() * 1e3,
            tokens_per_s: 1.0 / step.as_secs_f64(),
            bytes_per_token: bytes,
            gb_per_s: gbs,
            floor_fraction: copy_gb_per_s.map(|c| gbs / c),
        };
        progress(&format!(
            "decode ctx {context}: {:.2} ms/token, {:.1} tok/s, {:.2} GB/token, {:.0} GB/s",
            row.step_ms,
            row.tokens_per_s,
            bytes as f64 / 1e9,
            gbs
        ));
        decode.push(row);
    }

    // DDTree against plain decoding on one random prompt.
    let prompt: Vec<u32> = (0..opts.prompt_len)
        .map(|i| ((opts.seed as usize + 7919 * (i + 1)) % cfg.vocab_size) as u32)
        .collect();
    let gen = GenerateOptions {
        max_new_tokens: opts.spec_tokens,
        ..GenerateOptions::default()
    };
    // Untimed first (compiles, tunes, records the CUDA graphs), as every run below.
    generate_plain(model, &prompt, &gen)?;
    let plain = generate_plain(model, &prompt, &gen)?;
    let plain_tps = rate(plain.tokens.len().saturating_sub(1), plain.decode);
    progress(&format!(
        "plain decode on the {}-token prompt: {plain_tps:.1} tok/s",
        prompt.len()
    ));
    let continuation: Vec<u32> = prompt.iter().chain(&plain.tokens).copied().collect();
    let mut spec = Vec::new();
    // The verify latency t(B) measured by the fixed-budget runs (first drafter) feeds `auto`.
    // (The plain decode step is no stand-in for a small tree: from 2 tokens on the verify takes
    // the multi-token kernels, so a one-token point made `auto` pick trees of 7 that cost as much
    // as 8 and lose the runner-up.)
    let mut cost: Option<CostModel> = None;
    let mut points: Vec<(usize, f64)> = Vec::new();
    let mut fixed_us = [0.0f64; 3];
    for &accept in &opts.accept {
        let budgets = opts.budgets.iter().map(|&n| Budget::Fixed(n)).chain([Budget::Auto]);
        for budget in budgets {
            let mut drafter = Scripted::new(opts.block_size, accept, continuation.clone(), cfg.vocab_size, opts.seed);
            let options = match budget {
                Budget::Fixed(n) => SpecOptions::fixed(n),
                Budget::Auto => {
                    if cost.is_none() && !points.is_empty() {
                        let n = points.len() as f64;
                        let [d, b_, a] = fixed_us.map(|x| x / n);
                        cost = Some(CostModel::new(
                            format!("bench {} fixed-budget rounds", preset.name()),
                            d,
                            b_,
                            a,
                            &staircase(&points),
                        )?);
                    }
                    SpecOptions {
                        max_auto_budget: opts.budgets.iter().copied().max().unwrap_or(AUTO_MAX_BUDGET),
                        calibrate: opts.calibrate_auto,
                        ..SpecOptions::auto(cost.clone())
                    }
                }
            };
            // An untimed run first, as for plain decode: the timed one then replays the CUDA
            // graphs of its tree sizes instead of recording them.
            let mut warm = Scripted::new(opts.block_size, accept, continuation.clone(), cfg.vocab_size, opts.seed);
            generate_speculative(model, &mut warm, &prompt, &gen, &options)?;
            let graphs_before = b.graph_counts();
            let out = generate_speculative(model, &mut drafter, &prompt, &gen, &options)?;
            let graphs = b.graph_counts().zip(graphs_before).map(|(a, z)| (a.0 - z.0, a.1 - z.1));
            if let (Budget::Fixed(n), None) = (budget, &cost) {
                let st = &out.stats;
                let rounds = st.rounds.max(1) as f64;
                let us = |d: Duration| d.as_secs_f64() * 1e6 / rounds;
                points.push((n + 1, us(st.verify)));
                fixed_us[0] += us(st.draft);
                fixed_us[1] += us(st.build);
                fixed_us[2] += us(st.accept);
            }
            let row = spec_row(
                accept,
                budget,
                &out.stats,
                &out.generation.tokens,
                &plain.tokens,
                plain_tps,
                graphs,
            );
            let chosen: Vec<String> = row.budgets.iter().map(|(b, n)| format!("{b}x{n}")).collect();
            progress(&format!(
                "ddtree accept {accept} budget {}: {:.2} ms/round, accept {:.2}, {:.1} tok/s ({:.2}x); budgets {}{}",
                row.budget.map_or("auto".to_string(), |n| n.to_string()),
                row.round_ms,
                row.mean_accept_len,
                row.tokens_per_s,
                row.speedup,
                chosen.join(" "),
                row.graphs
                    .map_or(String::new(), |(r, c)| format!("; graphs {r} replayed, {c} recorded")),
            ));
            spec.push(row);
        }
    }
    // Several ranks: the same rounds with each tree source, timed on this rank.
    let mut tree_sources = Vec::new();
    if model.rank().is_some_and(|c| c.comm.world() > 1 && !c.comm.alone()) {
        let accept = opts.accept.first().copied().unwrap_or(DraftProfile::Noisy(1.0));
        for &budget in &opts.budgets {
            for source in [TreeSource::Replicated, TreeSource::Rank0] {
                let options = SpecOptions {
                    tree_source: source,
                    ..SpecOptions::fixed(budget)
                };
                let mut warm = Scripted::new(opts.block_size, accept, continuation.clone(), cfg.vocab_size, opts.seed);
                generate_speculative(model, &mut warm, &prompt, &gen, &options)?;
                let mut drafter =
                    Scripted::new(opts.block_size, accept, continuation.clone(), cfg.vocab_size, opts.seed);
                let out = generate_speculative(model, &mut drafter, &prompt, &gen, &options)?;
                let st = &out.stats;
                let rounds = st.rounds.max(1) as f64;
                let decode = st.draft + st.build + st.verify + st.accept;
                let row = TreeSourceRow {
                    tree_source: source.name().into(),
                    accept,
                    budget,
                    rounds: st.rounds,
                    round_ms: ms(decode) / rounds,
                    build_ms: ms(st.build) / rounds,
                    sync_ms: ms(st.tree_sync) / rounds,
                    tokens_per_s: rate(st.tokens.saturating_sub(1), decode),
                    identical: out.generation.tokens == plain.tokens,
                };
                progress(&format!(
                    "ddtree trees {} accept {accept} budget {budget}: {:.3} ms/round (build {:.3}, broadcast {:.3})",
                    row.tree_source, row.round_ms, row.build_ms, row.sync_ms
                ));
                tree_sources.push(row);
            }
        }
    }
    Ok(BenchReport {
        tree_sources,
        preset: preset.name().into(),
        backend: b.name().into(),
        parameters: model.parameter_count(),
        copy_gb_per_s,
        decode,
        plain_tokens_per_s: plain_tps,
        spec,
    })
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn rate(tokens: usize, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        tokens as f64 / d.as_secs_f64()
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn spec_row(
    accept: DraftProfile,
    budget: Budget,
    s: &SpecStats,
    tokens: &[u32],
    plain: &[u32],
    plain_tps: f64,
    graphs: Option<(u64, u64)>,
) -> SpecRow {
    let rounds = s.rounds.max(1) as f64;
    let decode = s.draft + s.build + s.verify + s.accept;
    let tps = rate(s.tokens.saturating_sub(1), decode);
    SpecRow {
        accept,
        budget: match budget {
            Budget::Fixed(n) => Some(n),
            Budget::Auto => None,
        },
        mean_budget: s.mean_budget(),
        rounds: s.rounds,
        mean_accept_len: s.mean_accept_len(),
        round_ms: ms(decode) / rounds,
        tokens_per_s: tps,
        speedup: if plain_tps > 0.0 { tps / plain_tps } else { 0.0 },
        phase_ms: [
            ms(s.draft) / rounds,
            ms(s.build) / rounds,
            ms(s.verify) / rounds,
            ms(s.accept) / rounds,
        ],
        identical: tokens == plain,
        budgets: {
            let mut counts = std::collections::BTreeMap::new();
            for &b in &s.budgets {
                *counts.entry(b).or_insert(0) += 1;
            }
            counts.into_iter().collect()
        },
        graphs,
    }
}

/// The report as a readable table.
pub fn render(r: &BenchReport) -> String {
    let mut out = format!(
        "ddtree bench: preset {}, backend {}, {:.1} B parameters{}\n\nplain decode\n",
        r.preset,
        r.backend,
        r.parameters as f64 / 1e9,
        r.copy_gb_per_s
            .map_or(String::new(), |c| format!(", copy bandwidth {c:.0} GB/s")),
    );
    out += "| context | ms/token | tok/s | GB/token | GB/s | % of floor |\n|---:|---:|---:|---:|---:|---:|\n";
    for d in &r.decode {
        out += &format!(
            "| {} | {:.2} | {:.1} | {:.2} | {:.0} | {} |\n",
            d.context,
            d.step_ms,
            d.tokens_per_s,
            d.bytes_per_token as f64 / 1e9,
            d.gb_per_s,
            d.floor_fraction.map_or("-".into(), |f| format!("{:.0}%", 100.0 * f))
        );
    }
    out += &format!(
        "\nDDTree vs plain decode ({:.1} tok/s on the same prompt)\n",
        r.plain_tokens_per_s
    );
    out += "| accept P | budget | rounds | accept len | ms/round | draft | build | verify | accept | tok/s | speedup | = greedy |\n";
    out += "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|\n";
    for s in &r.spec {
        let budget = s
            .budget
            .map_or(format!("auto ({:.0})", s.mean_budget), |n| n.to_string());
        out += &format!(
            "| {} | {budget} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} | {:.2}x | {} |\n",
            s.accept,
            s.rounds,
            s.mean_accept_len,
            s.round_ms,
            s.phase_ms[0],
            s.phase_ms[1],
            s.phase_ms[2],
            s.phase_ms[3],
            s.tokens_per_s,
            s.speedup,
            if s.identical { "yes" } else { "NO" }
        );
    }
    if !r.tree_sources.is_empty() {
        out += "\nDDTree tree source on several ranks (rank 0's times per round)\n";
        out += "| trees | accept P | budget | rounds | ms/round | build | broadcast | tok/s | = greedy |\n";
        out += "|---|---:|---:|---:|---:|---:|---:|---:|:-:|\n";
        for t in &r.tree_sources {
            out += &format!(
                "| {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.1} | {} |\n",
                t.tree_source,
                t.accept,
                t.budget,
                t.rounds,
                t.round_ms,
                t.build_ms,
                t.sync_ms,
                t.tokens_per_s,
                if t.identical { "yes" } else { "NO" }
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staircase_steps_up_after_each_measured_size() {
        let pts = [(17, 25.0), (9, 18.0), (18, 26.0), (33, 29.0)];
        assert_eq!(
            staircase(&pts),
            vec![(9, 18.0), (10, 25.0), (17, 25.0), (18, 26.0), (19, 29.0), (33, 29.0)]
        );
        let c = CostModel::new("s", 0.0, 0.0, 0.0, &staircase(&pts)).unwrap();
        assert_eq!((c.verify_us(9), c.verify_us(12), c.verify_us(30)), (18.0, 25.0, 29.0));
    }

    /// The switching drafter's hard regime is calibrated: its top token holds 35% of the softmax
    /// mass and is the right token in about 35% of the rows.
    #[test]
    fn calibrated_rows_are_calibrated() {
        let vocab = 1000;
        let mut d = Scripted::new(8, DraftProfile::Switching, vec![0; 8], vocab, 3);
        let (rows, mut hits, mut top_mass) = (4000, 0, 0.0);
        for i in 0..rows {
            let right = i % vocab;
            let mut row = vec![0.0f32; vocab];
            d.calibrated_row(&mut row, right, &SWITCH_TOP[1]);
            let best = (0..vocab).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap();
            hits += usize::from(best == right);
            let z: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
            top_mass += (row[best] as f64).exp() / z;
        }
        let (hit_rate, mass) = (hits as f64 / rows as f64, top_mass / rows as f64);
        assert!((mass - 0.35).abs() < 1e-3, "top-token mass {mass}");
        assert!((hit_rate - 0.35).abs() < 0.03, "right-token rate {hit_rate}");
    }

    #[test]
    fn drafter_profiles_parse_and_print() {
        for s in ["1", "0.5", "switching"] {
            assert_eq!(s.parse::<DraftProfile>().unwrap().to_string(), s);
        }
        for bad in ["1.5", "-0.1", "sometimes"] {
            assert!(bad.parse::<DraftProfile>().unwrap_err().contains(bad));
        }
    }
}
