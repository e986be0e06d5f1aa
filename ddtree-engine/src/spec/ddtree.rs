//! The DDTree loop: draft -> build the tree -> one target forward over the tree -> accept ->
//! compact -> next round.
//!
//! Round invariant: the target cache holds every committed token except the bonus token (the
//! last emitted one, chosen by the target at the previous verify). Each round the drafter
//! proposes distributions for the next positions, the backend's tree builder (the CPU reference
//! of [`ddtree_kernels::tree`], or the GPU builder that equals it) picks the best `B` prefixes (for `auto`, the tree is built at the
//! maximum budget and cut to the size [`choose_budget`] finds most profitable, optionally under
//! the drafter's probabilities as calibrated by the earlier rounds, [`Calibration`]), and the target
//! runs `[bonus, nodes..]` at positions `start + depth` under the ancestor mask. The target's token at every node
//! ([`crate::spec::Sampling::choose`]) drives the accept walk; the accepted rows are compacted in the latent
//! cache, their hidden features go to the drafter, and the accepted tokens plus the next bonus
//! are emitted under the same stop rules as plain decoding.
//!
//! Greedy rounds without drafter features or kept logits (and, for `auto`, without calibration)
//! first offer the backend the whole round ([`Backend::device_tree_round`]): the CUDA backend
//! then keeps the tree on the GPU from the build to the compaction and reads back only the
//! accept result (one host sync per round; [`SpecStats::round_host_reads`]), plus for `auto` the
//! built tree's path log-probs that [`choose_budget`] cuts it by. The other rounds (and the CPU
//! backend's) run the host path below, which gives the same tokens; on the GPU it reads the tree
//! back after the build and the argmax rows (or logits) after the verify.

use std::time::Instant;

use ddtree_kernels::tree::{accept_reference, DraftTree};

use crate::backend::{Backend, BudgetChoice, Matrix, TreeRound};
use crate::error::{EngineError, Result};
use crate::generate::{check_prompt, choose_rows, GenerateOptions, Generation, StopReason, TokenSink};
use crate::mask::AncestorMask;
use crate::model::{ForwardInput, LogitRows, Model};
use crate::spec::budget::{choose_budget, Calibration, CostModel};
use crate::spec::drafter::{DraftRequest, Drafter};
use crate::spec::stats::SpecStats;

/// The largest tree `auto` considers unless [`SpecOptions::max_auto_budget`] says otherwise
/// (the paper's best budgets on dense 8B targets were 256-512; Kimi's MoE verify is expected to
/// want far fewer).
pub const AUTO_MAX_BUDGET: usize = 256;

/// `auto` builds each round's tree at up to this many times the last round's choice (the first
/// round at the maximum): building the largest tree every round costs more than the nodes it is
/// never cut to (1.0-1.3 ms per round at 256 nodes vs 0.14 ms at 8 on the H200, Kimi EP8 bench).
/// A choice at the edge of the built tree grows the next one by the same factor.
pub const AUTO_BUILD_GROWTH: usize = 4;

/// The smallest tree `auto` builds once it has a previous choice.
pub const AUTO_MIN_BUILD: usize = 16;

/// The tree node budget B (root not counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    /// Exactly this many nodes (at least 1), fewer only when the drafter's positions run out.
    Fixed(usize),
    /// Chosen every round by [`choose_budget`] from the [`SpecOptions::cost`] model (or
    /// [`CostModel::fallback`]), at most [`SpecOptions::max_auto_budget`].
    Auto,
}

/// Where each rank of a multi-rank model gets the round's draft tree (one rank: ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TreeSource {
    /// Every rank builds the tree from its own drafted logits (the drafter runs on every rank:
    /// its forward uses the target's vocabulary-parallel embedding and LM head, whose
    /// collectives need every rank); the collectives give every rank the same bits, so the
    /// trees are equal. No extra collective.
    #[default]
    Replicated,
    /// Rank 0 builds the tree (and picks `auto`'s budget) and broadcasts it (tokens, parents,
    /// depths, sibling links, path log-probs, ancestor mask) through the rank's collectives;
    /// the other ranks still run the drafter's forward (its collectives) but skip the build.
    /// The rounds take the host path (one `u32` broadcast of the tree per round).
    Rank0,
}

impl TreeSource {
    /// `replicated` or `rank0`.
    pub fn name(self) -> &'static str {
        match self {
            TreeSource::Replicated => "replicated",
            TreeSource::Rank0 => "rank0",
        }
    }

    /// Parses [`TreeSource::name`].
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "replicated" => Ok(TreeSource::Replicated),
            "rank0" => Ok(TreeSource::Rank0),
            _ => Err(EngineError::Forward(format!(
                "unknown tree source {s:?}: expected `replicated` or `rank0`"
            ))),
        }
    }
}

/// Speculative-decoding settings.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecOptions {
    /// Tree node budget.
    pub budget: Budget,
    /// The measured per-round costs `auto` optimizes (e.g. from the tune cache); `None` uses
    /// [`CostModel::fallback`] and the statistics say so. Ignored for fixed budgets.
    pub cost: Option<CostModel>,
    /// The largest budget `auto` may choose: each round's tree is built at up to
    /// [`AUTO_BUILD_GROWTH`] times the last choice (the first at this size), then cut to the
    /// chosen one.
    pub max_auto_budget: usize,
    /// Whether `auto` scores trees with the drafter's probabilities as calibrated by the
    /// earlier rounds ([`Calibration`]) instead of at face value. Off by default: on the H200
    /// at block size 16 it beat every fixed budget on the oracle drafter but lost 8% on a
    /// calibrated one (BENCHMARKS.md).
    pub calibrate: bool,
    /// On several ranks: whether every rank builds the tree or rank 0 builds and broadcasts it.
    pub tree_source: TreeSource,
}

impl Default for SpecOptions {
    /// `auto` with the fallback cost model, up to [`AUTO_MAX_BUDGET`] nodes.
    fn default() -> Self {
        Self::auto(None)
    }
}

impl SpecOptions {
    /// A fixed budget of `nodes` nodes per tree.
    pub fn fixed(nodes: usize) -> Self {
        Self {
            budget: Budget::Fixed(nodes),
            ..Self::auto(None)
        }
    }

    /// The cost-aware budget with this cost model (`None`: [`CostModel::fallback`]), up to
    /// [`AUTO_MAX_BUDGET`] nodes.
    pub fn auto(cost: Option<CostModel>) -> Self {
        Self {
            budget: Budget::Auto,
            cost,
            max_auto_budget: AUTO_MAX_BUDGET,
            calibrate: false,
            tree_source: TreeSource::Replicated,
        }
    }
}

/// Words of the tree broadcast for trees of up to `budget + 1` nodes: `[n, words]`, then per
/// node token, parent, depth, first child, next sibling and path log-prob bits, then the mask.
fn tree_message_len(budget: usize) -> usize {
    let n = budget + 1;
    2 + 6 * n + n * n.div_ceil(32)
}

/// Rank 0's side of [`TreeSource::Rank0`]: broadcasts `tree` to the other ranks.
fn send_tree<B: Backend>(model: &Model<B>, tree: &DraftTree, budget: usize) -> Result<()> {
    let ctx = model.rank().expect("a multi-rank model");
    let mut msg = Vec::with_capacity(tree_message_len(budget));
    msg.extend([tree.len() as u32, tree.words as u32]);
    msg.extend(&tree.token);
    msg.extend(tree.parent.iter().map(|&p| p as u32));
    msg.extend(&tree.depth);
    msg.extend(tree.first_child.iter().map(|&p| p as u32));
    msg.extend(tree.next_sibling.iter().map(|&p| p as u32));
    msg.extend(tree.path_logprob.iter().map(|p| p.to_bits()));
    msg.extend(&tree.mask);
    if msg.len() > tree_message_len(budget) {
        return Err(EngineError::Forward(format!(
            "a tree of {} nodes is larger than the budget {budget}",
            tree.len()
        )));
    }
    msg.resize(tree_message_len(budget), 0);
    ctx.comm.broadcast_host_u32(model.backend(), &mut msg, 0)
}

/// The other ranks' side of [`TreeSource::Rank0`]: rank 0's tree.
fn receive_tree<B: Backend>(model: &Model<B>, budget: usize) -> Result<DraftTree> {
    let ctx = model.rank().expect("a multi-rank model");
    let mut msg = vec![0u32; tree_message_len(budget)];
    ctx.comm.broadcast_host_u32(model.backend(), &mut msg, 0)?;
    let (n, words) = (msg[0] as usize, msg[1] as usize);
    if n == 0 || n > budget + 1 || words != n.div_ceil(32) {
        return Err(EngineError::Forward(format!(
            "received a malformed tree ({n} nodes, {words} mask words)"
        )));
    }
    let field = |k: usize| &msg[2 + k * n..2 + (k + 1) * n];
    let signed = |k: usize| field(k).iter().map(|&v| v as i32).collect::<Vec<i32>>();
    Ok(DraftTree {
        token: field(0).to_vec(),
        parent: signed(1),
        depth: field(2).to_vec(),
        first_child: signed(3),
        next_sibling: signed(4),
        path_logprob: field(5).iter().map(|&b| f32::from_bits(b)).collect(),
        mask: msg[2 + 6 * n..2 + 6 * n + n * words].to_vec(),
        words,
    })
}

/// A speculative generation and its statistics.
#[derive(Debug, Clone)]
pub struct SpecGeneration {
    /// The tokens and stop reason, as plain decoding reports them.
    pub generation: Generation,
    /// Rounds, acceptance and per-phase times.
    pub stats: SpecStats,
}

/// Generates up to `options.max_new_tokens` tokens after `prompt` with DDTree speculative
/// decoding. The output equals [`crate::generate_plain`]'s on the same backend for greedy
/// decoding, and is distributed as plain sampling otherwise (see [`crate::spec::sampling`]).
pub fn generate_speculative<B: Backend>(
    model: &Model<B>,
    drafter: &mut dyn Drafter<B>,
    prompt: &[u32],
    options: &GenerateOptions,
    spec: &SpecOptions,
) -> Result<SpecGeneration> {
    generate_speculative_with_sink(model, drafter, prompt, options, spec, &mut |_| true)
}

/// [`generate_speculative`] that hands the tokens each round commits (the first token after
/// the prefill, then the accepted tokens and the bonus of every round) to `sink` as a group.
pub fn generate_speculative_with_sink<B: Backend>(
    model: &Model<B>,
    drafter: &mut dyn Drafter<B>,
    prompt: &[u32],
    options: &GenerateOptions,
    spec: &SpecOptions,
    sink: &mut TokenSink<'_>,
) -> Result<SpecGeneration> {
    check_prompt(model, prompt)?;
    options.sampling.validate()?;
    let fallback;
    let (budget, auto_cost, budget_mode) = match spec.budget {
        Budget::Fixed(n) => (n, None, "fixed".to_string()),
        Budget::Auto => {
            let (cost, mode) = match &spec.cost {
                Some(cost) => {
                    cost.validate()?;
                    (cost, format!("auto: measured cost model ({})", cost.source))
                }
                None => {
                    fallback = CostModel::fallback();
                    let mode = format!("auto: no measured cost model, {}", fallback.source);
                    (&fallback, mode)
                }
            };
            (spec.max_auto_budget, Some(cost), mode)
        }
    };
    if budget == 0 {
        return Err(EngineError::Forward(
            "the tree budget (for auto, its maximum) must be at least 1 node".into(),
        ));
    }
    let block_size = drafter.block_size();
    if block_size < 2 {
        return Err(EngineError::Forward(format!(
            "drafter block size must be at least 2, got {block_size}"
        )));
    }
    let mut stats = SpecStats {
        drafter: drafter.name(),
        budget,
        budget_auto: spec.budget == Budget::Auto,
        budget_mode,
        block_size,
        ..SpecStats::default()
    };
    let mut out = Generation::empty();
    if options.max_new_tokens == 0 {
        return Ok(SpecGeneration { generation: out, stats });
    }
    let b = model.backend();
    let cfg = model.config();
    let (context, vocab) = (cfg.max_position_embeddings, cfg.vocab_size);
    let layers = drafter.target_layers().to_vec();
    let max_positions = prompt.len() + options.max_new_tokens;
    let mut cache = model.new_cache(max_positions + budget + 1)?;
    drafter.begin(model, max_positions + block_size)?;

    // Prefill: the prompt's features and the first bonus token.
    let started = Instant::now();
    let positions: Vec<u32> = (0..prompt.len() as u32).collect();
    let input = ForwardInput {
        tokens: prompt,
        positions: &positions,
        mask: None,
        logits: LogitRows::Last,
    };
    let prefill = model.forward_with_features(&mut cache, input, &layers)?;
    let (chosen, logits) = choose_rows(b, &prefill.logits, options, &[prompt.len() as u32 - 1])?;
    let row = |logits: &Option<Matrix>, i: usize| logits.as_ref().map_or(&[][..], |h| h.row(i)).to_vec();
    let mut features = prefill.features;
    let first = chosen[0];
    stats.target_forwards = 1;
    stats.prefill = started.elapsed();
    out.prefill = stats.prefill;
    let mut tokens = prompt.to_vec();
    tokens.push(first);
    let mut going = out.emit(options, first, prompt.len(), context, &row(&logits, 0));
    if !sink(&[first]) && going {
        out.stop_reason = StopReason::Cancelled;
        going = false;
    }

    // Greedy verification without drafter features or kept logits may run as one device round
    // (the CUDA backend: the tree stays on the GPU, one read per round; `auto` reads the path
    // log-probs too). Calibrated `auto` learns from the whole tree on the host. A model split
    // over ranks runs device rounds where its comm reduces the argmax on the device (NCCL, a
    // virtual rank) and every rank builds the same tree (`--tree-source replicated`: equal
    // drafted logits, deterministic builder); host-staged virtual ranks on one GPU reduce on
    // the host and take the host path. `--tree-source rank0` on several ranks: rank 0 builds,
    // the others receive (host path).
    let tree_rank = model
        .rank()
        .filter(|c| spec.tree_source == TreeSource::Rank0 && c.comm.world() > 1 && !c.comm.alone())
        .map(|c| c.rank);
    stats.tree_source = match model.rank() {
        Some(c) if c.comm.world() > 1 && !c.comm.alone() => spec.tree_source.name().to_string(),
        _ => "local".to_string(),
    };
    let device_rounds = tree_rank.is_none()
        && model.rank().is_none_or(|c| c.comm.device_argmax())
        && layers.is_empty()
        && options.sampling.is_greedy()
        && !options.record_logits
        && !(auto_cost.is_some() && spec.calibrate);
    let mut last_choice: Option<usize> = None;
    // What the verify rounds say of the drafter's probabilities (`auto` with `calibrate`).
    let mut calibration = Calibration::default();
    while going {
        let start = tokens.len() - 1;
        let bonus = tokens[start];

        let t = Instant::now();
        let request = DraftRequest {
            tokens: &tokens,
            features: features.as_ref(),
        };
        let drafted = drafter.draft(model, request)?;
        stats.draft += t.elapsed();

        let t = Instant::now();
        let (rows, cols) = b.dims(&drafted);
        if rows != block_size - 1 || cols != vocab {
            return Err(EngineError::Forward(format!(
                "drafter {} returned {rows}x{cols} logits, expected {}x{vocab}",
                stats.drafter,
                block_size - 1
            )));
        }
        // Positions past the context cannot be verified.
        let depth = (block_size - 1).min(context - 1 - start);
        let build = match (auto_cost, last_choice) {
            (Some(_), Some(last)) => (AUTO_BUILD_GROWTH * last).clamp(AUTO_MIN_BUILD.min(budget), budget),
            _ => budget,
        };
        let reads = b.host_reads();
        let device = if device_rounds {
            // `auto`: the budget with the best expected rate, from the built tree's path
            // log-probs (best-first order: the top-B tree is the first B nodes).
            let mut choose = auto_cost.map(|cost| move |lp: &[f32]| choose_budget(lp, cost, build, last_choice));
            let round = TreeRound {
                drafted: &drafted,
                depth,
                budget: build,
                root: bonus,
                start,
                choose: choose.as_mut().map(|c| c as &mut BudgetChoice<'_>),
            };
            b.device_tree_round(&mut cache, round, &mut |c, input| model.forward_greedy(c, input))?
        } else {
            None
        };
        let (nodes, accepted, logits) = if let Some(round) = device {
            if auto_cost.is_some() {
                last_choice = Some(round.nodes - 1);
            }
            stats.build += round.build;
            stats.verify += round.verify;
            stats.accept += round.accept;
            (round.nodes, round.accepted, None)
        } else {
            let tree = if tree_rank.is_some_and(|r| r != 0) {
                let t = Instant::now();
                let tree = receive_tree(model, budget)?;
                stats.tree_sync += t.elapsed();
                if auto_cost.is_some() {
                    last_choice = Some(tree.len() - 1);
                }
                tree
            } else {
                let mut tree = b.draft_tree(&drafted, depth, build, bonus)?;
                if let Some(cost) = auto_cost {
                    // Best-first order: the first B nodes are the top-B tree, the one the builder
                    // gives at budget B; with `calibrate` each is scored by its calibrated path
                    // probability.
                    let chosen = if spec.calibrate {
                        choose_budget(&calibration.path_logprobs(&tree)[1..], cost, build, last_choice)
                    } else {
                        choose_budget(&tree.path_logprob[1..], cost, build, last_choice)
                    };
                    tree.truncate(chosen + 1);
                    last_choice = Some(chosen);
                }
                if tree_rank == Some(0) {
                    let t = Instant::now();
                    send_tree(model, &tree, budget)?;
                    stats.tree_sync += t.elapsed();
                }
                tree
            };
            stats.build += t.elapsed();

            let t = Instant::now();
            let mask = AncestorMask::from_words(tree.len(), tree.mask.clone())?;
            let positions = tree.positions(start as u32);
            let input = ForwardInput {
                tokens: &tree.token,
                positions: &positions,
                mask: Some(&mask),
                logits: LogitRows::All,
            };
            // Greedy verification without drafter features is one replayable step (a CUDA
            // graph per tree size on the GPU) that reads back only the argmax rows.
            let (target, logits, verified_features) =
                if layers.is_empty() && options.sampling.is_greedy() && !options.record_logits {
                    (model.forward_greedy(&mut cache, input)?, None, None)
                } else {
                    let verified = model.forward_with_features(&mut cache, input, &layers)?;
                    let (target, logits) = choose_rows(b, &verified.logits, options, &positions)?;
                    (target, logits, verified.features)
                };
            stats.verify += t.elapsed();

            let t = Instant::now();
            let accepted = accept_reference(&tree, &target);
            if auto_cost.is_some() && spec.calibrate {
                calibration.observe_round(&tree, &accepted.indices);
            }
            let keep: Vec<usize> = accepted.indices.iter().map(|&i| i as usize).collect();
            b.kv_compact(&mut cache, start, &keep)?;
            features = match &verified_features {
                Some(f) => Some(b.take_rows(f, &keep)?),
                None => None,
            };
            stats.accept += t.elapsed();
            (tree.len(), accepted, logits)
        };
        if let (Some(before), Some(after)) = (reads, b.host_reads()) {
            stats.round_host_reads.push(after - before);
        }
        stats.budgets.push(nodes - 1);
        stats.rounds += 1;
        stats.target_forwards += 1;
        stats.verified_nodes += nodes;
        stats.accept_lengths.push(accepted.indices.len());

        // Emit the target's token at each accepted node: the accepted drafted tokens (each the
        // target's token at the node before it), then the next bonus.
        let committed = out.tokens.len();
        for (k, (&token, &node)) in accepted.tokens.iter().zip(&accepted.indices).enumerate() {
            tokens.push(token);
            going = out.emit(options, token, start + k + 1, context, &row(&logits, node as usize));
            if !going {
                break;
            }
        }
        if !sink(&out.tokens[committed..]) && going {
            out.stop_reason = StopReason::Cancelled;
            going = false;
        }
    }
    out.decode = stats.draft + stats.build + stats.verify + stats.accept;
    stats.tokens = out.tokens.len();
    Ok(SpecGeneration { generation: out, stats })
}
