//! What a run needs per rank (weights, latent cache, workspace), estimated from the config
//! before anything is allocated, and the refusal when the device or host is too small.

use crate::error::{EngineError, Result};
use crate::parallel::plan::{ParallelPlan, Storage};

/// Environment variable that overrides the host memory the CPU backend may use (bytes, or with
/// a `K`/`M`/`G`/`T` suffix, powers of 1024): for tests and for machines whose
/// `MemAvailable` is not what the run may take.
pub const HOST_MEMORY_ENV: &str = "DDTREE_HOST_MEMORY";

/// Fixed reserve per rank: the CUDA context, cuBLAS and NCCL workspaces, kernel images (GPU);
/// the allocator and the process itself (CPU).
fn reserve(storage: Storage) -> u64 {
    match storage {
        Storage::Gpu => 1 << 30,
        Storage::Cpu => 64 << 20,
    }
}

/// The memory one rank of a run needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Ranks of the run.
    pub ranks: usize,
    /// Bytes of weights (the largest rank's share).
    pub weights: u64,
    /// Bytes of latent cache.
    pub cache: u64,
    /// Bytes of activations, logits, staging and the fixed reserve.
    pub workspace: u64,
    /// Where the ranks run.
    pub storage: Storage,
}

impl MemoryEstimate {
    /// The estimate for `plan` with a latent cache of `cache_tokens` tokens and steps of up to
    /// `step_tokens` tokens (the prefill chunk or the largest verified tree).
    pub fn new(plan: &ParallelPlan, storage: Storage, cache_tokens: usize, step_tokens: usize) -> Self {
        let cfg = &plan.config;
        let world = plan.spec.world;
        let weights = (0..world).map(|r| plan.weight_bytes(r, storage)).max().unwrap_or(0);
        let vocab = plan.shards.iter().map(|s| s.vocab.len()).max().unwrap_or(0);
        let heads = plan.shards.iter().map(|s| s.heads.len()).max().unwrap_or(0);
        // Per step row: the residual stream and a dozen hidden-wide temporaries, the query and
        // its absorbed form, the widest MLP intermediate, f32 logits of the local vocabulary.
        let row = 16 * cfg.hidden_size
            + heads * (cfg.qk_head_dim() + 2 * cfg.latent_row_width())
            + 3 * cfg
                .intermediate_size
                .max(cfg.moe.moe_intermediate_size * cfg.moe.num_experts_per_tok)
            + vocab;
        // The CPU backend converts one tensor slice to f32 while loading it (the largest one)
        // before keeping it; on GPUs that copy is on the host, not the device.
        let largest = match storage {
            Storage::Cpu => (vocab * cfg.hidden_size).max(cfg.intermediate_size * cfg.hidden_size) as u64 * 4,
            Storage::Gpu => 0,
        };
        let workspace = (row * step_tokens.max(1)) as u64 * 4 + largest + reserve(storage);
        Self {
            ranks: world,
            weights,
            cache: plan.cache_bytes(cache_tokens, storage),
            workspace,
            storage,
        }
    }

    /// Bytes one rank needs.
    pub fn per_rank(&self) -> u64 {
        self.weights + self.cache + self.workspace
    }

    /// Fails with [`EngineError::OutOfMemory`] unless `ranks_per_pool` ranks fit in `available`
    /// bytes (one GPU holds one rank; the CPU host holds them all).
    pub fn check(&self, device: &str, available: u64, ranks_per_pool: usize, hint: &str) -> Result<()> {
        let need = self.per_rank() * ranks_per_pool as u64;
        if need <= available {
            return Ok(());
        }
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        Err(EngineError::OutOfMemory {
            device: device.into(),
            ranks: self.ranks,
            need_gib: gib(self.per_rank()),
            available_gib: gib(available) / ranks_per_pool as f64,
            breakdown: format!(
                "weights {:.1} GiB + latent cache {:.2} GiB + workspace {:.2} GiB",
                gib(self.weights),
                gib(self.cache),
                gib(self.workspace)
            ),
            hint: if hint.is_empty() {
                String::new()
            } else {
                format!("; {hint}")
            },
        })
    }

    /// [`MemoryEstimate::check`] against the host memory ([`host_available`]), all ranks
    /// together.
    pub fn check_host(&self, hint: &str) -> Result<()> {
        let available = host_available()?;
        let device = if self.ranks == 1 {
            "the CPU host".to_string()
        } else {
            format!("the CPU host ({} ranks share it)", self.ranks)
        };
        self.check(&device, available, self.ranks, hint)
    }
}

/// Parses a byte count: digits with an optional `K`, `M`, `G` or `T` suffix (powers of 1024,
/// an optional trailing `B` or `iB` allowed).
pub fn parse_bytes(s: &str) -> Option<u64> {
    let t = s.trim().to_ascii_uppercase();
    let t = t.strip_suffix("IB").or_else(|| t.strip_suffix('B')).unwrap_or(&t);
    let (digits, shift) = match t.chars().last()? {
        'K' => (&t[..t.len() - 1], 10),
        'M' => (&t[..t.len() - 1], 20),
        'G' => (&t[..t.len() - 1], 30),
        'T' => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let value: f64 = digits.trim().parse().ok()?;
    (value >= 0.0).then(|| (value * (1u64 << shift) as f64) as u64)
}

/// Host memory available to the run: [`HOST_MEMORY_ENV`] when set, else `MemAvailable` from
/// `/proc/meminfo` (unknown elsewhere: no limit).
pub fn host_available() -> Result<u64> {
    if let Ok(v) = std::env::var(HOST_MEMORY_ENV) {
        return parse_bytes(&v).ok_or_else(|| EngineError::Parallel {
            argument: HOST_MEMORY_ENV.into(),
            reason: format!("{v:?} is not a byte count (e.g. 24G, 512M, 1073741824)"),
        });
    }
    let Ok(info) = std::fs::read_to_string("/proc/meminfo") else {
        return Ok(u64::MAX);
    };
    Ok(info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(u64::MAX, |kb| kb * 1024))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::Preset;
    use crate::parallel::plan::ParallelSpec;

    #[test]
    fn byte_counts_parse() {
        assert_eq!(parse_bytes("1024"), Some(1024));
        assert_eq!(parse_bytes("24G"), Some(24 << 30));
        assert_eq!(parse_bytes("512MiB"), Some(512 << 20));
        assert_eq!(parse_bytes("1.5k"), Some(1536));
        assert_eq!(parse_bytes("lots"), None);
    }

    #[test]
    fn kimi_on_eight_gpus_fits_an_h200_but_not_on_four() {
        let cfg = Preset::KimiK26.config().unwrap();
        let est = |world| {
            let plan = ParallelPlan::new(&cfg, ParallelSpec::new(world, None, None).unwrap()).unwrap();
            MemoryEstimate::new(&plan, Storage::Gpu, 8192, 512)
        };
        let h200 = 141_000_000_000;
        assert!(est(8).check("GPU", h200, 1, "").is_ok(), "{:?}", est(8));
        let e = est(4).check("GPU 0", h200, 1, "").unwrap_err().to_string();
        assert!(e.contains("each of 4 rank(s) needs about"), "{e}");
    }
}
