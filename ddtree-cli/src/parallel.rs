//! The multi-rank options (`--gpus N|auto`, `--ranks N`, `--tp`, `--ep`), the memory check
//! made before any allocation, and `ddtree plan`.

use std::path::PathBuf;

use ddtree_engine::bench::{BenchOptions, Preset};
use ddtree_engine::parallel::memory::{host_available, MemoryEstimate};
use ddtree_engine::parallel::{ParallelPlan, ParallelSpec, Storage};
use ddtree_engine::spec::TreeSource;
use ddtree_engine::{EngineError, ModelConfig};

/// `--gpus`: a rank count or `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuCount {
    /// The fewest GPUs that hold the model by the memory estimate.
    Auto,
    /// This many.
    N(usize),
}

/// Parses `--gpus`.
pub fn parse_gpus(s: &str) -> Result<GpuCount, String> {
    if s == "auto" {
        return Ok(GpuCount::Auto);
    }
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(GpuCount::N(n)),
        _ => Err(format!("expected a GPU count (1, 2, 4, 8) or `auto`, got {s:?}")),
    }
}

/// How the model is split over ranks.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ParallelArgs {
    /// GPUs to split the model over (1, 2, 4 or 8; attention and dense blocks tensor-parallel,
    /// routed experts expert-parallel, vocabulary-parallel head), or `auto`: the fewest that
    /// hold it by the memory estimate. On the CPU backend, the same plan on CPU ranks.
    #[arg(long, value_parser = parse_gpus)]
    pub gpus: Option<GpuCount>,
    /// CPU ranks: the model split over this many threads of the CPU backend, with in-process
    /// collectives (tests the sharded forward without GPUs).
    #[arg(long, conflicts_with = "gpus")]
    pub ranks: Option<usize>,
    /// Tensor-parallel degree of attention, dense MLPs and shared experts: 1 or the rank count
    /// (default: the rank count).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Expert-parallel degree of the routed experts: 1 or the rank count (default: the rank
    /// count).
    #[arg(long)]
    pub ep: Option<usize>,
    /// `bench` only: run rank R's share of the `--gpus N` (or `--ranks N`) plan alone on this
    /// device, with collectives that move nothing (one rank's compute time against its bytes
    /// floor; the tokens are not the model's).
    #[arg(long)]
    pub virtual_rank: Option<usize>,
    /// DDTree on several ranks: `replicated` (every rank builds the tree from its own drafted
    /// logits) or `rank0` (rank 0 builds it and broadcasts it to the others).
    #[arg(long, value_parser = parse_tree_source, default_value = "replicated")]
    pub tree_source: TreeSource,
}

/// Parses `--tree-source`.
pub fn parse_tree_source(s: &str) -> Result<TreeSource, String> {
    TreeSource::parse(s).map_err(|e| e.to_string())
}

impl ParallelArgs {
    /// The layout a `--virtual-rank` stands in: `--gpus N` or `--ranks N`, required.
    pub fn virtual_spec(&self, rank: usize) -> Result<ParallelSpec, EngineError> {
        let world = match (self.ranks, self.gpus) {
            (Some(n), _) | (None, Some(GpuCount::N(n))) => n,
            _ => {
                return Err(EngineError::Parallel {
                    argument: "--virtual-rank".into(),
                    reason: "needs the plan's rank count: --gpus N (or --ranks N)".into(),
                })
            }
        };
        let spec = ParallelSpec::new(world, self.tp, self.ep)?;
        if rank >= world {
            return Err(EngineError::Parallel {
                argument: "--virtual-rank".into(),
                reason: format!("rank {rank} of a {world}-rank plan"),
            });
        }
        Ok(spec)
    }

    /// The layout on CPU ranks (all sharing the host memory: `--gpus auto` is one rank).
    pub fn cpu_spec(&self) -> Result<ParallelSpec, EngineError> {
        let world = match (self.ranks, self.gpus) {
            (Some(n), _) | (None, Some(GpuCount::N(n))) => n,
            _ => 1,
        };
        ParallelSpec::new(world, self.tp, self.ep)
    }

    /// The layout on GPUs: `--gpus N`, or for `auto` (and by default) the fewest of 1, 2, 4, 8
    /// (at most `devices`) whose ranks fit `memory` bytes each by `estimate`.
    pub fn gpu_spec(
        &self,
        devices: usize,
        memory: u64,
        estimate: impl Fn(ParallelSpec) -> Result<MemoryEstimate, EngineError>,
    ) -> Result<ParallelSpec, EngineError> {
        if self.ranks.is_some() {
            return Err(EngineError::Parallel {
                argument: "--ranks".into(),
                reason: "CPU ranks need --device cpu; on GPUs use --gpus".into(),
            });
        }
        match self.gpus {
            Some(GpuCount::N(n)) => ParallelSpec::new(n, self.tp, self.ep),
            None => ParallelSpec::new(1, self.tp, self.ep),
            Some(GpuCount::Auto) => {
                let mut last = None;
                for world in ddtree_engine::parallel::plan::WORLD_SIZES {
                    if world > devices {
                        break;
                    }
                    let spec = ParallelSpec::new(world, self.tp, self.ep)?;
                    let est = estimate(spec)?;
                    if est.per_rank() <= memory {
                        return Ok(spec);
                    }
                    last = Some(est);
                }
                Err(match last {
                    Some(est) => est
                        .check(
                            &format!("{devices} GPU(s)"),
                            memory,
                            1,
                            "--gpus auto found no GPU count that holds the model",
                        )
                        .expect_err("checked above"),
                    None => EngineError::Parallel {
                        argument: "--gpus".into(),
                        reason: "no GPU found".into(),
                    },
                })
            }
        }
    }
}

/// The memory one rank of `ddtree bench` needs for `config` under `spec`.
pub fn bench_estimate(
    config: &ModelConfig,
    spec: ParallelSpec,
    opts: &BenchOptions,
    storage: Storage,
) -> Result<MemoryEstimate, EngineError> {
    let plan = ParallelPlan::new(config, spec)?;
    let budget = opts
        .budgets
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(ddtree_engine::spec::AUTO_MAX_BUDGET);
    let decode = opts.contexts.iter().copied().max().unwrap_or(0) + opts.decode_steps + 2;
    let spec_cache = opts.prompt_len + opts.spec_tokens + budget + opts.block_size;
    let step = opts.prompt_len.max(budget + 1);
    Ok(MemoryEstimate::new(&plan, storage, decode.max(spec_cache), step))
}

/// Arguments of `ddtree plan`.
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// Model shapes: a bench preset (`kimi-k2.6`, `kimi-k2.6-ep8`, `tiny`).
    #[arg(long, default_value = "kimi-k2.6", conflicts_with = "model")]
    pub preset: String,
    /// HF model directory (its config.json) instead of a preset.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Rank counts to show (default: 1, 2, 4, 8, those the model divides into).
    #[arg(long, value_delimiter = ',')]
    pub gpus: Option<Vec<usize>>,
    /// Tensor-parallel degree (1 or the rank count; default the rank count).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Expert-parallel degree (1 or the rank count; default the rank count).
    #[arg(long)]
    pub ep: Option<usize>,
    /// Context of the bytes-read-per-token column.
    #[arg(long, default_value_t = 1024)]
    pub context: usize,
    /// Latent-cache tokens of the memory estimate.
    #[arg(long, default_value_t = 8192)]
    pub cache_tokens: usize,
    /// Count bytes as the CPU backend stores weights (f32) instead of the GPU's (bf16).
    #[arg(long)]
    pub cpu: bool,
}

/// `ddtree plan`: per rank count, the shards and bytes of every rank and the memory estimate.
pub fn run_plan(args: &PlanArgs) -> Result<(), EngineError> {
    let config = match &args.model {
        Some(dir) => ModelConfig::from_file(&dir.join("config.json"))?,
        None => Preset::parse(&args.preset)?.config()?,
    };
    let storage = if args.cpu { Storage::Cpu } else { Storage::Gpu };
    let explicit = args.gpus.is_some();
    let worlds = args
        .gpus
        .clone()
        .unwrap_or(ddtree_engine::parallel::plan::WORLD_SIZES.to_vec());
    for world in worlds {
        let plan = ParallelSpec::new(world, args.tp, args.ep).and_then(|spec| ParallelPlan::new(&config, spec));
        let plan = match plan {
            Ok(p) => p,
            Err(e) if !explicit => {
                println!("{world} ranks: not possible ({e})\n");
                continue;
            }
            Err(e) => return Err(e),
        };
        print!("{}", plan.render(args.context, storage));
        let est = MemoryEstimate::new(&plan, storage, args.cache_tokens, 512);
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        println!(
            "memory per rank with {} cached tokens: {:.1} GiB (weights {:.1} + cache {:.2} + workspace {:.2})",
            args.cache_tokens,
            gib(est.per_rank()),
            gib(est.weights),
            gib(est.cache),
            gib(est.workspace)
        );
        if args.cpu {
            let host = host_available()?;
            println!(
                "host: {:.1} GiB available; {} ranks need {:.1} GiB together",
                gib(host),
                world,
                gib(est.per_rank() * world as u64)
            );
        }
        println!();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_auto_takes_the_fewest_that_hold_kimi() {
        let config = Preset::KimiK26.config().unwrap();
        let opts = BenchOptions::for_preset(Preset::KimiK26);
        let args = ParallelArgs {
            gpus: Some(GpuCount::Auto),
            ..Default::default()
        };
        let estimate = |spec| bench_estimate(&config, spec, &opts, Storage::Gpu);
        let h200 = 150_000_000_000;
        assert_eq!(args.gpu_spec(8, h200, estimate).unwrap().world, 8);
        let err = args.gpu_spec(4, h200, estimate).unwrap_err().to_string();
        assert!(err.contains("--gpus auto found no GPU count"), "{err}");
        assert!(parse_gpus("3x").is_err() && parse_gpus("auto") == Ok(GpuCount::Auto));
        let cpu = ParallelArgs {
            ranks: Some(2),
            ..Default::default()
        };
        assert_eq!(cpu.cpu_spec().unwrap().world, 2);
        assert!(cpu
            .gpu_spec(8, h200, estimate)
            .unwrap_err()
            .to_string()
            .contains("--ranks"));
    }
}
