//! [`Tunable`] for the tree-masked MLA verify attention ([`MlaVerify`]): one key per (query
//! tokens bucket, heads, context-length bucket, output path, allowed kernels), whose candidates
//! are a split-pass variant with a split rule ([`VerifyChoice`]), timed as the engine runs them
//! ([`GpuVerify`]: the split pass, then the combine or the combine fused into the absorbed
//! output projection). Index 0 is the hand-chosen variant ([`default_variant`]) with the
//! automatic split count ([`verify_splits`]), so an untuned GPU runs what it ran before.
//!
//! [`MlaVerify`] is a [`Kernel`] only so that the tuner and the tune cache can name it: its IR
//! is the split pass's (what the tuner compiles up front, which scores out a variant the GPU
//! cannot run, and hashes), its symbol names the variant and the split rule. It is not in the
//! kernel registry: its sources are the split passes', which are there already.

use std::fmt;

use ddtree_codegen::{Kernel, KernelIr, KernelParams, ParamValue};
use ddtree_runtime::cudarc::driver::CudaSlice;
use ddtree_runtime::{bucket_pow2, CompiledKernel, Cost, DevicePool, Gpu, RuntimeError, Tunable, Verdict};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::check;
use crate::tree::check::{random_mask, verify, VerifyCase};
use crate::tree::gpu::{verify_splits, GpuVerify, VerifyShape};
use crate::tree::{MlaVerifySplit, MlaVerifyWg, MlaVerifyWide, VerifyVariant, WideParams, LATENT, ROW};
#[allow(unused_imports)]
use crate::tune::*;

/// Rows x splits the engine's verify partials hold (the split count's cap): 64K rows of 512
/// latent values (64 MiB of bf16), enough for 1024 nodes of 64 heads at one split.
pub const MAX_ROWS_SPLITS: usize = 1 << 16;

/// Under [`VerifyKernels::Auto`], decode steps (at most 64 query rows) whose length bucket
/// holds more keys than this use `mla_verify_wg`, shorter ones `mla_verify_wide`: the one-node
/// `wgmma` kernel reads one 64-key tile per block up to 8K keys, where its 64 KB of partials per
/// block weigh as much as its cache bytes and the 32-row `mma` blocks win; past 16K keys it is
/// ahead (`ddtree bench` on the Kimi K2.6 EP8 slice, docs/journal/verify-attention.md).
pub const WG_DECODE_MIN_KEYS: usize = 16384;

/// Most query rows of a step that takes the 32-row `mla_verify_wide` (and, under `Auto`, stays
/// off `mla_verify_wg` for short contexts): one node of 64 heads.
const WIDE_HALF_MAX_ROWS: usize = 64;

/// The split-pass kernels a verify may take: the engine's `--attention` choice (`Auto` on
/// Hopper unless forced; `Mma` off Hopper).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum VerifyKernels {
    /// Every kernel the dispatch picks from: `mla_verify_narrow`, `mla_verify_wide`,
    /// `mla_verify_wg`.
    #[default]
    Auto,
    /// `mla_verify_wg` only.
    Wgmma,
    /// `mla_verify_wide` only.
    Mma,
}

impl fmt::Display for VerifyKernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            VerifyKernels::Auto => "auto",
            VerifyKernels::Wgmma => "wgmma",
            VerifyKernels::Mma => "mma",
        })
    }
}

/// The hand-chosen split-pass variant for `rows` (node, head) query rows and a length bucket
/// of `keys` keys among `kernels`: `mla_verify_wg`'s default (a 2-deep ring of 64-key tiles,
/// one scoring warpgroup), or the full-width `mma` pass (`mla_verify_wide`, the same ring) with
/// 32 rows per block up to one node of 64 heads (the decode step), else 64. `wg` is the faster
/// one for trees (`tree-bench`); under `Auto`, steps of at most 8 rows take
/// `mla_verify_narrow` (keys as the `mma` M, bulk copies), which fills the MMA with keys where a
/// step has too few query rows to fill it with rows (docs/journal/verify-attention.md).
pub fn default_variant(kernels: VerifyKernels, rows: usize, keys: usize) -> VerifyVariant {
    if kernels == VerifyKernels::Auto && rows <= VerifyVariant::Narrow.rows_per_block() as usize {
        return VerifyVariant::Narrow;
    }
    let wg = match kernels {
        VerifyKernels::Auto => rows > WIDE_HALF_MAX_ROWS || keys > WG_DECODE_MIN_KEYS,
        VerifyKernels::Wgmma => true,
        VerifyKernels::Mma => false,
    };
    if wg {
        VerifyVariant::Wg(MlaVerifyWg::default_params())
    } else {
        VerifyVariant::Wide(WideParams {
            rg: if rows <= WIDE_HALF_MAX_ROWS { 2 } else { 4 },
            bn: 64,
            stages: 2,
            qk: 16,
        })
    }
}

/// The verify attention as the tuner sees it (see the module doc).
pub struct MlaVerify;

/// One verify attention: `tokens` query tokens (tree nodes; 1 for a decode step) of `heads`
/// heads over a length bucket of `keys` cache rows (the engine's graph bucket, a power of two:
/// the grid and split count follow it, the kernel reads the length itself), 576-wide latent
/// rows. With `fused` the split merge runs inside the absorbed output projection (`nope` +
/// `v` head dims), else the combine writes the latent rows. Tokens are bucketed to powers of
/// two, cut where the hand-chosen variant changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct VerifyKey {
    /// Query tokens (tree nodes).
    pub tokens: usize,
    /// Heads.
    pub heads: usize,
    /// Length bucket (keys the grid is sized for).
    pub keys: usize,
    /// `qk_nope_head_dim` (the fused output's `kv_b` layout).
    pub nope: usize,
    /// `v_head_dim`.
    pub v: usize,
    /// The merge fused into the absorbed output projection.
    pub fused: bool,
    /// The kernels the dispatch allows.
    pub kernels: VerifyKernels,
}

impl fmt::Display for VerifyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tokens={} heads={} keys={} nope={} v={} fused={} kernels={}",
            self.tokens, self.heads, self.keys, self.nope, self.v, self.fused, self.kernels
        )
    }
}

impl VerifyKey {
    /// Query rows.
    pub fn rows(&self) -> usize {
        self.tokens * self.heads
    }
}

/// The token bucket of `tokens` at `heads` heads: the power of two above, cut at the last
/// token count of `rows` rows or fewer for each row edge of the hand-chosen rule (8 and 64
/// rows) and of the partials ([`MAX_ROWS_SPLITS`] rows), so that every count of a bucket takes
/// the same variant (a bucket is named by its largest count).
fn bucket_tokens(tokens: usize, heads: usize) -> usize {
    let b = bucket_pow2(tokens);
    let narrow = VerifyVariant::Narrow.rows_per_block() as usize;
    [narrow, WIDE_HALF_MAX_ROWS, MAX_ROWS_SPLITS]
        .into_iter()
        .map(|rows| rows / heads.max(1))
        .find(|&t| tokens <= t && t < b)
        .unwrap_or(b)
}

/// A split rule: the automatic count ([`verify_splits`]) scaled by a power of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Splits {
    /// [`verify_splits`] itself: at most one block per SM.
    Auto,
    /// Half of it (longer splits, a cheaper merge).
    Half,
    /// Twice it (a second wave of shorter splits).
    Double,
    /// Four times it.
    Quadruple,
}

impl Splits {
    fn name(&self) -> &'static str {
        match self {
            Splits::Auto => "auto",
            Splits::Half => "half",
            Splits::Double => "x2",
            Splits::Quadruple => "x4",
        }
    }
}

/// A candidate of [`MlaVerify`]: a split-pass variant and its split rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VerifyChoice {
    /// The split pass.
    pub variant: VerifyVariant,
    /// The split count's rule.
    pub splits: Splits,
}

impl VerifyChoice {
    /// The split count for `rows` query rows over a length bucket of `keys` on `sms` SMs with
    /// partials for `max_rows_splits` rows x splits: [`verify_splits`] scaled by the rule, at
    /// most one split per key tile and what the partials hold.
    pub fn split_count(&self, sms: usize, rows: usize, keys: usize, max_rows_splits: usize) -> usize {
        let auto = verify_splits(&self.variant, sms, rows, keys, max_rows_splits);
        let scaled = match self.splits {
            Splits::Auto => return auto,
            Splits::Half => auto / 2,
            Splits::Double => auto * 2,
            Splits::Quadruple => auto * 4,
        };
        scaled
            .min(keys.div_ceil(self.variant.bn() as usize))
            .min(max_rows_splits / rows.max(1))
            .max(1)
    }
}

impl KernelParams for VerifyChoice {
    fn fields(&self) -> Vec<(&'static str, ParamValue)> {
        let kernel = match self.variant {
            VerifyVariant::Split(_) => "split",
            VerifyVariant::Wide(_) => "wide",
            VerifyVariant::Wg(_) => "wg",
            VerifyVariant::Narrow => "narrow",
        };
        vec![
            ("kernel", ParamValue::Variant(kernel)),
            ("splits", ParamValue::Variant(self.splits.name())),
        ]
    }
}

impl Kernel for MlaVerify {
    type Params = VerifyChoice;
    const NAME: &'static str = "mla_verify";

    /// The hand-chosen decode step of 64 heads (the fallback where a key has none).
    fn space() -> Vec<VerifyChoice> {
        vec![VerifyChoice {
            variant: default_variant(VerifyKernels::Auto, 64, 256),
            splits: Splits::Auto,
        }]
    }

    /// The split pass's IR (see the module doc).
    fn ir(p: &VerifyChoice) -> ddtree_codegen::Result<KernelIr> {
        match &p.variant {
            VerifyVariant::Split(v) => MlaVerifySplit::ir(v),
            VerifyVariant::Wide(v) => MlaVerifyWide::ir(v),
            VerifyVariant::Wg(v) => MlaVerifyWg::ir(v),
            VerifyVariant::Narrow => crate::tree::MlaVerifyNarrow::ir(&()),
        }
    }

    /// The split pass's symbol and the split rule: the tune cache names a winner by it.
    fn symbol(p: &VerifyChoice) -> String {
        format!("{}__{}__splits_{}", Self::NAME, p.variant.symbol(), p.splits.name())
    }
}

/// The split rules every variant is tried with, the automatic one first.
const RULES: [Splits; 4] = [Splits::Auto, Splits::Half, Splits::Double, Splits::Quadruple];

/// The candidates at `key`'s bucket: [`default_variant`] with the automatic split count first,
/// then every variant of the allowed kernels (`Auto`: `mla_verify_wide`, `mla_verify_wg`,
/// `mla_verify_narrow`; the dim-split `mla_verify_split` is left out, as the dispatch never
/// picks it) with every rule of [`RULES`]. `wgmma` fails to compile off Hopper and
/// `mla_verify_narrow` before sm_90; the tuner scores them out there.
fn choices(key: &VerifyKey) -> Vec<VerifyChoice> {
    let default = default_variant(key.kernels, key.rows(), key.keys);
    let wide = MlaVerifyWide::space().into_iter().map(VerifyVariant::Wide);
    let wg = MlaVerifyWg::space().into_iter().map(VerifyVariant::Wg);
    let variants: Vec<VerifyVariant> = match key.kernels {
        VerifyKernels::Auto => wide.chain(wg).chain([VerifyVariant::Narrow]).collect(),
        VerifyKernels::Wgmma => wg.collect(),
        VerifyKernels::Mma => wide.collect(),
    };
    let mut out = vec![VerifyChoice {
        variant: default,
        splits: Splits::Auto,
    }];
    for variant in std::iter::once(default).chain(variants) {
        for splits in RULES {
            let c = VerifyChoice { variant, splits };
            if !out.contains(&c) {
                out.push(c);
            }
        }
    }
    out
}

/// Verify timing buffers: one [`GpuVerify`] per candidate variant (partials of
/// [`MAX_ROWS_SPLITS`], as the engine's), rotated queries and caches, a random tree mask, the
/// full bucket as the prefix, and the fused path's `kv_b`.
pub struct VerifyWorkload {
    key: VerifyKey,
    sms: usize,
    words: usize,
    verifiers: Vec<GpuVerify>,
    q: Vec<CudaSlice<bf16>>,
    cache: Vec<CudaSlice<bf16>>,
    mask: CudaSlice<u32>,
    lens: CudaSlice<u32>,
    kv_b: CudaSlice<bf16>,
    out: Vec<CudaSlice<bf16>>,
    lse: CudaSlice<f32>,
}

/// The softmax scale of a DeepSeek-V3 head (192 query dims), as the checks use.
fn scale() -> f32 {
    1.0 / (192f32).sqrt()
}

impl Tunable for MlaVerify {
    type Key = VerifyKey;
    type Workload = VerifyWorkload;

    fn bucket(key: &VerifyKey) -> VerifyKey {
        VerifyKey {
            tokens: bucket_tokens(key.tokens, key.heads),
            keys: bucket_pow2(key.keys),
            ..*key
        }
    }

    fn candidates(key: &VerifyKey) -> Vec<VerifyChoice> {
        if key.tokens == 0 || key.heads == 0 || key.rows() > MAX_ROWS_SPLITS || key.keys < key.tokens {
            return Vec::new();
        }
        choices(key)
    }

    /// The distinct bytes (cache, queries, output, the fused path's `kv_b`: the floor, and
    /// what decides whether rotated copies pass the L2, as a layer's cache does between
    /// layers); the scores and `P V` over every key.
    fn cost(key: &VerifyKey) -> Cost {
        let rows = key.rows();
        let (out, kv_b) = match key.fused {
            true => (key.v, key.heads * (key.nope + key.v) * LATENT),
            false => (LATENT, 0),
        };
        Cost {
            bytes: 2.0 * (key.keys * ROW + rows * (ROW + out) + kv_b) as f64,
            flops: 2.0 * (rows * key.keys * (ROW + LATENT)) as f64,
        }
    }

    fn workload(
        gpu: &Gpu,
        pool: &mut DevicePool,
        key: &VerifyKey,
        copies: usize,
        seed: u64,
    ) -> Result<VerifyWorkload, RuntimeError> {
        let fills = Fills::get(gpu, pool)?;
        let (rows, tokens) = (key.rows(), key.tokens);
        let mut rng = StdRng::seed_from_u64(seed);
        let (mask, words) = random_mask(&mut rng, tokens, false);
        let mut verifiers = Vec::new();
        for c in choices(key) {
            if verifiers.iter().any(|v: &GpuVerify| *v.variant() == c.variant) {
                continue;
            }
            // A variant that does not compile here (wgmma off Hopper) fails in the tuner too.
            if let Ok(v) = GpuVerify::new(gpu, &c.variant, MAX_ROWS_SPLITS) {
                verifiers.push(v);
            }
        }
        Ok(VerifyWorkload {
            key: *key,
            sms: gpu.fingerprint().sm_count as usize,
            words,
            verifiers,
            q: fills.bf16_sets(gpu, copies, rows * ROW, seed, (-1.0, 1.0))?,
            cache: fills.bf16_sets(gpu, copies, key.keys * ROW, seed + 100, (-1.0, 1.0))?,
            mask: upload(gpu, &mask)?,
            lens: upload(gpu, &[(key.keys - tokens) as u32])?,
            kv_b: fills.bf16(gpu, key.heads * (key.nope + key.v) * LATENT, seed + 200, (-0.1, 0.1))?,
            out: zeros(gpu, copies, rows * if key.fused { key.v } else { LATENT })?,
            lse: zeros(gpu, 1, rows)?.remove(0),
        })
    }

    fn run(gpu: &Gpu, kern: &CompiledKernel<Self>, w: &mut VerifyWorkload, i: usize) -> Result<(), RuntimeError> {
        let key = w.key;
        let choice = *kern.params();
        let Some(v) = w.verifiers.iter_mut().find(|v| *v.variant() == choice.variant) else {
            return Err(RuntimeError::Launch {
                kernel: Self::NAME.into(),
                reason: format!("{} was not compiled for the workload", Self::symbol(&choice)),
            });
        };
        let sh = VerifyShape {
            nodes: key.tokens,
            heads: key.heads,
            prefix: key.keys - key.tokens,
            words: w.words,
            scale: scale(),
        };
        let splits = choice.split_count(w.sms, key.rows(), key.keys, MAX_ROWS_SPLITS);
        let (q, cache) = (&w.q[i % w.q.len()], &w.cache[i % w.cache.len()]);
        let c = i % w.out.len();
        let s = gpu.stream();
        if key.fused {
            return v.run_output(
                s,
                &sh,
                splits,
                q,
                cache,
                &w.mask,
                &w.lens,
                &w.kv_b,
                (key.nope, key.v),
                &mut w.out[c],
            );
        }
        v.run(s, &sh, splits, q, cache, &w.mask, &w.lens, &mut w.out[c], &mut w.lse)
    }

    /// At most 4 tokens over at most 512 keys: the f64 reference scores every (row, key).
    fn check_key(key: &VerifyKey) -> VerifyKey {
        let tokens = key.tokens.min(4);
        VerifyKey {
            tokens,
            keys: key.keys.min(512).max(tokens),
            ..*key
        }
    }

    /// The split pass at the rule's split count on this GPU, then the combine (and, at one or
    /// two tokens, every fused output merge) against the f64 reference: a random tree, a
    /// ragged prefix shorter than the bucket the grid is sized for.
    fn check(gpu: &Gpu, p: &VerifyChoice, key: &VerifyKey, seed: u64) -> Result<Verdict, RuntimeError> {
        let t = check::Target::Gpu(gpu);
        let rng = &mut StdRng::seed_from_u64(seed);
        let bound = key.keys - key.tokens;
        let sms = gpu.fingerprint().sm_count as usize;
        let case = VerifyCase {
            prefix: bound - bound / 3,
            bound,
            nodes: key.tokens,
            heads: key.heads,
            chain: false,
            splits: Some(p.split_count(sms, key.rows(), key.keys, MAX_ROWS_SPLITS)),
        };
        let results = verify(&t, &[p.variant], case, false, rng)?;
        Ok(match results.iter().find(|r| !r.passed) {
            Some(bad) => verdict(bad.clone()),
            None => Verdict {
                passed: true,
                detail: format!("{} cases passed", results.len()),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(tokens: usize, heads: usize, keys: usize, kernels: VerifyKernels) -> VerifyKey {
        VerifyKey {
            tokens,
            heads,
            keys,
            nope: 128,
            v: 128,
            fused: tokens <= 2,
            kernels,
        }
    }

    /// Index 0 of every bucket is the hand-chosen variant with the automatic split count at
    /// every token count of the bucket (heads 1 to 128, contexts 256 to 1M, each kernel
    /// choice, a small GPU and an H100/H200); the candidates are distinct, start with the
    /// default and hold every allowed kernel.
    #[test]
    fn default_candidate_is_the_hand_chosen_variant_and_split_count() {
        let kinds = [VerifyKernels::Auto, VerifyKernels::Wgmma, VerifyKernels::Mma];
        for heads in [1usize, 3, 4, 8, 16, 48, 64, 128] {
            for keys in (8..=20).map(|e| 1usize << e) {
                for tokens in 1..=(MAX_ROWS_SPLITS / heads).min(keys).min(1100) {
                    for kernels in kinds {
                        let k = key(tokens, heads, keys, kernels);
                        let b = MlaVerify::bucket(&k);
                        assert!(b.tokens >= tokens && b.rows() <= MAX_ROWS_SPLITS, "{k}");
                        let c = MlaVerify::candidates(&b);
                        let rows = tokens * heads;
                        let want = default_variant(kernels, rows, keys);
                        assert_eq!(c[0].variant, want, "{k}");
                        assert_eq!(c[0].splits, Splits::Auto, "{k}");
                        for sms in [8, 132] {
                            assert_eq!(
                                c[0].split_count(sms, rows, keys, MAX_ROWS_SPLITS),
                                verify_splits(&want, sms, rows, keys, MAX_ROWS_SPLITS),
                                "{k}"
                            );
                        }
                    }
                }
            }
        }
        let c = MlaVerify::candidates(&key(1, 64, 4096, VerifyKernels::Auto));
        let symbols: Vec<String> = c.iter().map(MlaVerify::symbol).collect();
        let mut uniq = symbols.clone();
        uniq.sort();
        uniq.dedup();
        assert_eq!(uniq.len(), symbols.len());
        for kernel in ["wide", "wg", "narrow"] {
            assert!(
                c.iter().any(|v| v.fields()[0].1 == ParamValue::Variant(kernel)),
                "{kernel}"
            );
        }
        let wg = MlaVerify::candidates(&key(33, 64, 4096, VerifyKernels::Wgmma));
        assert!(wg.iter().all(|v| matches!(v.variant, VerifyVariant::Wg(_))));
        let mma = MlaVerify::candidates(&key(1, 8, 4096, VerifyKernels::Mma));
        assert!(mma.iter().all(|v| matches!(v.variant, VerifyVariant::Wide(_))));
    }

    /// Buckets: powers of two, cut at the rule's row edges; Kimi's 64 heads keep the powers.
    #[test]
    fn token_buckets_cut_at_the_row_edges() {
        assert_eq!(
            (1..=9).map(|t| bucket_tokens(t, 64)).collect::<Vec<_>>(),
            [1, 2, 4, 4, 8, 8, 8, 8, 16]
        );
        // 3 heads: 2 tokens (6 rows) narrow, 3..4 not; 21 tokens (63 rows) the 32-row wide pass.
        assert_eq!(bucket_tokens(2, 3), 2);
        assert_eq!(bucket_tokens(3, 3), 4);
        assert_eq!(bucket_tokens(17, 3), 21);
        assert_eq!(bucket_tokens(22, 3), 32);
        // 100 heads: the partials hold 655 tokens.
        assert_eq!(bucket_tokens(600, 100), 655);
        assert_eq!(bucket_tokens(656, 100), 1024);
    }

    /// Scaled rules stay within the tiles and the partials, and differ from the automatic count
    /// where there is room.
    #[test]
    fn split_rules_scale_within_bounds() {
        let v = default_variant(VerifyKernels::Auto, 64, 32768);
        let at = |splits| VerifyChoice { variant: v, splits }.split_count(132, 64, 32768, MAX_ROWS_SPLITS);
        assert_eq!(at(Splits::Auto), 132);
        assert_eq!(at(Splits::Half), 66);
        assert_eq!(at(Splits::Double), 264);
        assert_eq!(at(Splits::Quadruple), 512);
        let short = VerifyChoice {
            variant: v,
            splits: Splits::Quadruple,
        };
        assert_eq!(short.split_count(132, 64, 256, MAX_ROWS_SPLITS), 4);
        assert_eq!(short.split_count(132, 64 * 1024, 1 << 20, MAX_ROWS_SPLITS), 1);
    }
}
