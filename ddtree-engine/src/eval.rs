//! `ddtree eval`: acceptance and speed of DDTree with a real drafter against plain decoding.
//!
//! Every prompt is decoded greedily once plainly, then with DDTree in each [`EvalMode`]: fixed
//! budgets, the DFlash chain (one path of `block_size - 1` nodes: each position's argmax, what
//! plain DFlash verifies) and `auto`. For each mode the report gives the mean accepted length per
//! round (τ, the bonus token counted), generated tokens per target forward, how many outputs are
//! identical to plain decoding (greedy DDTree is lossless, so this must be every one) and the
//! wall-clock tokens per second and speedup over plain decoding on the backend that ran it.
//!
//! `auto` needs the backend's per-round costs; [`measure_cost`] times the target's verify
//! forward by tree size on this backend and takes the drafter, build and accept costs per round
//! from the fixed-budget runs, so on the CPU `auto` optimizes the CPU's costs rather than the
//! GPU-shaped [`CostModel::fallback`].

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::backend::{Backend, Matrix};
use crate::error::{EngineError, Result};
use crate::generate::{generate_plain, GenerateOptions};
use crate::model::Model;
use crate::spec::{generate_speculative, Budget, CostModel, DraftRequest, Drafter, SpecOptions, SpecStats};
use crate::tuning::{measure_verify_cost, Progress};

/// The logit every non-argmax entry of a [`Chain`] row gets: its path can never make the top
/// `block_size - 1` of the best-first tree (the argmax path's log-probabilities are ~0).
const CHAIN_OFF_LOGIT: f32 = -1.0e4;

/// Verify sizes [`measure_cost`] times (tokens, root included).
pub const COST_SIZES: [usize; 14] = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 257];

/// A drafter that keeps only each position's argmax of another drafter, so a tree of
/// `block_size - 1` nodes is exactly the DFlash chain (one path, the argmax at every depth).
pub struct Chain<'a, B: Backend> {
    inner: &'a mut dyn Drafter<B>,
}

impl<'a, B: Backend> Chain<'a, B> {
    /// Wraps `inner`.
    pub fn new(inner: &'a mut dyn Drafter<B>) -> Self {
        Self { inner }
    }
}

impl<B: Backend> Drafter<B> for Chain<'_, B> {
    fn name(&self) -> String {
        format!("chain of {}", self.inner.name())
    }

    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    fn target_layers(&self) -> &[usize] {
        self.inner.target_layers()
    }

    fn begin(&mut self, target: &Model<B>, capacity: usize) -> Result<()> {
        self.inner.begin(target, capacity)
    }

    fn draft(&mut self, target: &Model<B>, request: DraftRequest<'_, B::Tensor>) -> Result<B::Tensor> {
        let b = target.backend();
        let logits = b.to_host(&self.inner.draft(target, request)?)?;
        let mut chain = Matrix {
            rows: logits.rows,
            cols: logits.cols,
            data: vec![CHAIN_OFF_LOGIT; logits.rows * logits.cols],
        };
        for r in 0..logits.rows {
            let best = crate::spec::sampling::argmax(logits.row(r)) as usize;
            chain.row_mut(r)[best] = 0.0;
        }
        b.load_logits(chain)
    }
}

/// How one evaluated run decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvalMode {
    /// Plain greedy decoding (the reference).
    Plain,
    /// DDTree with this fixed node budget.
    Fixed(usize),
    /// The DFlash chain: the drafter's argmax path of `block_size - 1` nodes.
    Chain,
    /// DDTree with `--budget auto` on the measured cost model.
    Auto,
}

impl EvalMode {
    /// A short label for tables and JSON.
    pub fn label(self, block_size: usize) -> String {
        match self {
            Self::Plain => "plain".into(),
            Self::Fixed(n) => format!("ddtree B={n}"),
            Self::Chain => format!("dflash chain (B={})", block_size - 1),
            Self::Auto => "ddtree auto".into(),
        }
    }
}

/// What [`evaluate`] runs.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalOptions {
    /// Tokens generated per prompt (no stop tokens: every prompt generates exactly this many,
    /// unless the context fills).
    pub max_new_tokens: usize,
    /// Fixed DDTree budgets to run.
    pub budgets: Vec<usize>,
    /// Whether to run the DFlash chain.
    pub chain: bool,
    /// Whether to run `auto`.
    pub auto: bool,
    /// The cost model of `auto`; `None`: [`measure_cost`] on this backend after the fixed runs.
    pub cost: Option<CostModel>,
}

impl Default for EvalOptions {
    /// 64 tokens a prompt; budgets 1, 16, 32, 64, 128; the chain and `auto`.
    fn default() -> Self {
        Self {
            max_new_tokens: 64,
            budgets: vec![1, 16, 32, 64, 128],
            chain: true,
            auto: true,
            cost: None,
        }
    }
}

/// The totals of one mode over all prompts.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalRow {
    /// The mode.
    pub mode: EvalMode,
    /// Its label ([`EvalMode::label`]).
    pub label: String,
    /// Prompts run.
    pub prompts: usize,
    /// Prompts whose output equals plain decoding's.
    pub identical: usize,
    /// Tokens generated.
    pub tokens: usize,
    /// Draft-verify rounds (0 for plain decoding).
    pub rounds: usize,
    /// Accepted tokens over all rounds (the bonus token of each round counted).
    pub accepted: usize,
    /// Target forwards (plain: one per token; DDTree: the prefill plus one verify per round).
    pub target_forwards: usize,
    /// Tree nodes over all rounds, roots not counted.
    pub tree_nodes: usize,
    /// Wall-clock time of the generations (model loading excluded).
    pub wall: Duration,
    /// Per-phase totals of the DDTree runs: draft, build, verify, accept.
    pub phases: [Duration; 4],
}

impl EvalRow {
    fn new(mode: EvalMode, block_size: usize) -> Self {
        Self {
            mode,
            label: mode.label(block_size),
            prompts: 0,
            identical: 0,
            tokens: 0,
            rounds: 0,
            accepted: 0,
            target_forwards: 0,
            tree_nodes: 0,
            wall: Duration::ZERO,
            phases: [Duration::ZERO; 4],
        }
    }

    /// Mean accepted length per round, the bonus token counted (τ); 1 for plain decoding.
    pub fn mean_accept_len(&self) -> f64 {
        if self.rounds == 0 {
            1.0
        } else {
            self.accepted as f64 / self.rounds as f64
        }
    }

    /// Tree nodes per round, root not counted (the mean chosen budget for `auto`).
    pub fn mean_budget(&self) -> f64 {
        self.tree_nodes as f64 / self.rounds.max(1) as f64
    }

    /// Generated tokens per target forward.
    pub fn tokens_per_forward(&self) -> f64 {
        self.tokens as f64 / self.target_forwards.max(1) as f64
    }

    /// Wall-clock tokens per second.
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.wall.as_secs_f64().max(1e-9)
    }

    fn add_spec(&mut self, stats: &SpecStats) {
        self.rounds += stats.rounds;
        self.accepted += stats.accept_lengths.iter().sum::<usize>();
        self.target_forwards += stats.target_forwards;
        self.tree_nodes += stats.budgets.iter().sum::<usize>();
        for (total, d) in self
            .phases
            .iter_mut()
            .zip([stats.draft, stats.build, stats.verify, stats.accept])
        {
            *total += d;
        }
    }
}

/// The result of [`evaluate`].
#[derive(Debug, Clone, PartialEq)]
pub struct EvalReport {
    /// Target name.
    pub model: String,
    /// Drafter name.
    pub drafter: String,
    /// Drafter block size.
    pub block_size: usize,
    /// Backend name.
    pub backend: String,
    /// Tokens generated per prompt.
    pub max_new_tokens: usize,
    /// Prompt lengths in tokens.
    pub prompt_tokens: Vec<usize>,
    /// Where `auto`'s cost model came from (`None` without an `auto` run).
    pub cost_source: Option<String>,
    /// One row per mode, plain decoding first.
    pub rows: Vec<EvalRow>,
}

impl EvalReport {
    /// The plain-decoding row.
    pub fn plain(&self) -> &EvalRow {
        &self.rows[0]
    }

    /// The row of `mode`, if it ran.
    pub fn row(&self, mode: EvalMode) -> Option<&EvalRow> {
        self.rows.iter().find(|r| r.mode == mode)
    }

    /// Whether every DDTree output equals plain decoding's.
    pub fn lossless(&self) -> bool {
        self.rows.iter().all(|r| r.identical == r.prompts)
    }

    /// The report as JSON (for scripts).
    pub fn to_json(&self) -> Value {
        let plain_tps = self.plain().tokens_per_s();
        let rows: Vec<Value> = self
            .rows
            .iter()
            .map(|r| {
                json!({
                    "mode": r.label,
                    "budget": match r.mode {
                        EvalMode::Plain => Value::Null,
                        EvalMode::Fixed(n) => n.into(),
                        EvalMode::Chain => (self.block_size - 1).into(),
                        EvalMode::Auto => "auto".into(),
                    },
                    "prompts": r.prompts,
                    "identical_to_plain": r.identical,
                    "tokens": r.tokens,
                    "rounds": r.rounds,
                    "mean_accept_len": r.mean_accept_len(),
                    "tokens_per_target_forward": r.tokens_per_forward(),
                    "mean_budget": r.mean_budget(),
                    "wall_s": r.wall.as_secs_f64(),
                    "tokens_per_s": r.tokens_per_s(),
                    "speedup": r.tokens_per_s() / plain_tps,
                    "phase_s": {
                        "draft": r.phases[0].as_secs_f64(),
                        "build": r.phases[1].as_secs_f64(),
                        "verify": r.phases[2].as_secs_f64(),
                        "accept": r.phases[3].as_secs_f64(),
                    },
                })
            })
            .collect();
        json!({
            "model": self.model,
            "drafter": self.drafter,
            "block_size": self.block_size,
            "backend": self.backend,
            "prompts": self.prompt_tokens.len(),
            "prompt_tokens": self.prompt_tokens,
            "max_new_tokens": self.max_new_tokens,
            "auto_cost_model": self.cost_source,
            "lossless": self.lossless(),
            "rows": rows,
        })
    }

    /// The report as a Markdown table, with a header line.
    pub fn table(&self) -> String {
        let plain_tps = self.plain().tokens_per_s();
        let mut s = format!(
            "{} + {} (block {}), {} backend: {} prompts ({} prompt tokens on average), {} tokens each\n\n",
            self.model,
            self.drafter,
            self.block_size,
            self.backend,
            self.prompt_tokens.len(),
            self.prompt_tokens.iter().sum::<usize>() / self.prompt_tokens.len().max(1),
            self.max_new_tokens
        );
        s += "| mode | mean budget | accepted / round | tokens / target forward | identical to plain | tokens/s | speedup |\n";
        s += "|---|---:|---:|---:|---:|---:|---:|\n";
        for r in &self.rows {
            s += &format!(
                "| {} | {} | {:.2} | {:.2} | {}/{} | {:.1} | {:.2}x |\n",
                r.label,
                if r.mode == EvalMode::Plain {
                    "-".to_string()
                } else {
                    format!("{:.1}", r.mean_budget())
                },
                r.mean_accept_len(),
                r.tokens_per_forward(),
                r.identical,
                r.prompts,
                r.tokens_per_s(),
                r.tokens_per_s() / plain_tps
            );
        }
        if let Some(src) = &self.cost_source {
            s += &format!("\nauto: {src}\n");
        }
        s
    }
}

/// A [`CostModel`] for `auto` on `model`'s backend: the verify latency timed at
/// [`COST_SIZES`] ([`measure_verify_cost`]) and the per-round drafter, build and accept costs
/// from `runs` (DDTree rows run on this backend: the drafter's mean over all of them, the build
/// and accept of the largest tree).
pub fn measure_cost<B: Backend>(model: &Model<B>, runs: &[EvalRow]) -> Result<CostModel> {
    let max = model.config().max_position_embeddings;
    let sizes: Vec<usize> = COST_SIZES.iter().copied().filter(|&n| n < max).collect();
    let verify = measure_verify_cost(model, &sizes, &Progress::silent())?;
    let rounds: usize = runs.iter().map(|r| r.rounds).sum();
    let per_round = |d: Duration, n: usize| d.as_secs_f64() * 1e6 / n.max(1) as f64;
    let draft_us = per_round(runs.iter().map(|r| r.phases[0]).sum(), rounds);
    let (build_us, accept_us) = runs
        .iter()
        .max_by_key(|r| r.tree_nodes / r.rounds.max(1))
        .map_or((0.0, 0.0), |r| {
            (per_round(r.phases[1], r.rounds), per_round(r.phases[3], r.rounds))
        });
    let points: Vec<(usize, f64)> = verify.cost.verify.iter().map(|p| (p.tokens, p.us)).collect();
    CostModel::new(
        format!(
            "measured on this {} backend: verify at {} sizes, draft {:.0} µs, build {:.0} µs, accept {:.0} µs per round",
            model.backend().name(),
            points.len(),
            draft_us,
            build_us,
            accept_us
        ),
        draft_us,
        build_us,
        accept_us,
        &points,
    )
}

/// Runs every prompt plainly and in every mode of `options` with `drafter`, reporting each
/// finished row to `progress`.
pub fn evaluate<B: Backend>(
    model: &Model<B>,
    drafter: &mut dyn Drafter<B>,
    model_name: &str,
    prompts: &[Vec<u32>],
    options: &EvalOptions,
    progress: &mut dyn FnMut(&EvalRow),
) -> Result<EvalReport> {
    if prompts.is_empty() {
        return Err(EngineError::Forward("eval: no prompts".into()));
    }
    let block_size = drafter.block_size();
    let gen = GenerateOptions {
        max_new_tokens: options.max_new_tokens,
        ..Default::default()
    };
    let mut plain_row = EvalRow::new(EvalMode::Plain, block_size);
    let mut plain = Vec::with_capacity(prompts.len());
    for p in prompts {
        let t = Instant::now();
        let out = generate_plain(model, p, &gen)?;
        plain_row.wall += t.elapsed();
        plain_row.prompts += 1;
        plain_row.identical += 1;
        plain_row.tokens += out.tokens.len();
        plain_row.target_forwards += out.tokens.len();
        plain.push(out.tokens);
    }
    progress(&plain_row);
    let mut rows = vec![plain_row];

    let mut modes: Vec<EvalMode> = Vec::new();
    modes.extend(options.budgets.iter().map(|&n| EvalMode::Fixed(n)));
    if options.chain {
        modes.push(EvalMode::Chain);
    }
    for mode in modes {
        let row = run_mode(model, drafter, prompts, &plain, &gen, mode, None)?;
        progress(&row);
        rows.push(row);
    }
    let mut cost_source = None;
    if options.auto {
        let cost = match &options.cost {
            Some(c) => c.clone(),
            None => {
                let fixed: Vec<EvalRow> = rows
                    .iter()
                    .filter(|r| matches!(r.mode, EvalMode::Fixed(_)))
                    .cloned()
                    .collect();
                measure_cost(model, &fixed)?
            }
        };
        cost_source = Some(cost.source.clone());
        let row = run_mode(model, drafter, prompts, &plain, &gen, EvalMode::Auto, Some(cost))?;
        progress(&row);
        rows.push(row);
    }
    Ok(EvalReport {
        model: model_name.to_string(),
        drafter: drafter.name(),
        block_size,
        backend: model.backend().name().to_string(),
        max_new_tokens: options.max_new_tokens,
        prompt_tokens: prompts.iter().map(Vec::len).collect(),
        cost_source,
        rows,
    })
}

fn run_mode<B: Backend>(
    model: &Model<B>,
    drafter: &mut dyn Drafter<B>,
    prompts: &[Vec<u32>],
    plain: &[Vec<u32>],
    gen: &GenerateOptions,
    mode: EvalMode,
    cost: Option<CostModel>,
) -> Result<EvalRow> {
    let block_size = drafter.block_size();
    let spec = match mode {
        EvalMode::Fixed(n) => SpecOptions::fixed(n),
        EvalMode::Chain => SpecOptions::fixed(block_size - 1),
        EvalMode::Auto => SpecOptions {
            budget: Budget::Auto,
            ..SpecOptions::auto(cost)
        },
        EvalMode::Plain => unreachable!("plain decoding is run by evaluate itself"),
    };
    let mut row = EvalRow::new(mode, block_size);
    for (p, expected) in prompts.iter().zip(plain) {
        let t = Instant::now();
        let out = if mode == EvalMode::Chain {
            generate_speculative(model, &mut Chain::new(&mut *drafter), p, gen, &spec)?
        } else {
            generate_speculative(model, &mut *drafter, p, gen, &spec)?
        };
        row.wall += t.elapsed();
        row.prompts += 1;
        row.identical += usize::from(&out.generation.tokens == expected);
        row.tokens += out.generation.tokens.len();
        row.add_spec(&out.stats);
    }
    Ok(row)
}

/// Where [`load_and_evaluate`] takes the target, drafter and prompts from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EvalSetup {
    /// HF target directory; `None`: the built-in tiny-code target ([`crate::tiny`]).
    pub model: Option<std::path::PathBuf>,
    /// DFlash drafter directory; `None`: the built-in drafter (only with the built-in target).
    pub drafter: Option<std::path::PathBuf>,
    /// Prompt file in [`crate::tiny::parse_eval_prompts`]'s format; `None`: the built-in
    /// held-out prompts (only with the built-in target, whose tokenizer they were cut for).
    pub prompts: Option<std::path::PathBuf>,
    /// Use only the first this many prompts.
    pub limit: Option<usize>,
    /// Drafter block size override.
    pub block_size: Option<usize>,
    /// Scan the weights for NaN/infinity at load time.
    pub check_finite: bool,
}

/// Loads what `setup` names onto `backend` and runs [`evaluate`].
pub fn load_and_evaluate<B: Backend>(
    backend: B,
    setup: &EvalSetup,
    options: &EvalOptions,
    progress: &mut dyn FnMut(&EvalRow),
) -> Result<EvalReport> {
    use crate::model::LoadOptions;
    use crate::spec::DFlashDrafter;
    use crate::tiny;
    use crate::tokenizer::Tokenizer;
    use crate::weights::Checkpoint;
    use crate::ModelConfig;

    let load = LoadOptions {
        check_finite: setup.check_finite,
    };
    let (model, name, tokenizer) = match &setup.model {
        None => (
            tiny::load(backend, load)?,
            tiny::NAME.to_string(),
            Some(tiny::tokenizer()?),
        ),
        Some(dir) => {
            let config = ModelConfig::from_file(&dir.join("config.json"))?;
            let model = Model::load(backend, config, &Checkpoint::open(dir)?, load, &mut |_, _| {})?;
            (model, dir.display().to_string(), Tokenizer::from_dir(dir)?)
        }
    };
    let mut drafter = match (&setup.drafter, &setup.model) {
        (Some(dir), _) => DFlashDrafter::load(&model, dir, setup.block_size)?,
        (None, None) => tiny::load_drafter(&model, setup.block_size)?,
        (None, Some(_)) => {
            return Err(EngineError::Forward(
                "eval: --model needs --drafter (the built-in drafter belongs to the built-in target)".into(),
            ))
        }
    };
    let prompts = match (&setup.prompts, &setup.model) {
        (Some(path), _) => {
            let text = std::fs::read_to_string(path).map_err(|e| EngineError::io(path, e))?;
            tiny::parse_eval_prompts(&text, path)?
        }
        (None, None) => tiny::eval_prompts()?,
        (None, Some(_)) => {
            return Err(EngineError::Forward(
                "eval: --model needs --prompts (the built-in prompts are for the built-in tokenizer)".into(),
            ))
        }
    };
    let tokenizer = tokenizer.ok_or_else(|| EngineError::Tokenizer {
        path: std::path::PathBuf::from(&name),
        reason: "eval encodes text prompts: no tokenizer.json or tiktoken.model found".into(),
    })?;
    let ids = prompts
        .iter()
        .take(setup.limit.unwrap_or(usize::MAX))
        .map(|p| tokenizer.encode(&p.text))
        .collect::<Result<Vec<_>>>()?;
    evaluate(&model, &mut drafter, &name, &ids, options, progress)
}
