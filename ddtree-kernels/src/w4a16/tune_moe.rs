//! [`Tunable`] for the routed-expert block ([`MoeBlock`]): one key per (expert shape, top-k,
//! token bucket), whose candidates are whole [`MoeVariant`]s, a path with its (gate_up, down)
//! pair, timed as the engine runs them ([`MoeKernels::for_variant`]: `moe_align`, both
//! products and `moe_sum` where the path has them). Index 0 is [`moe::default_variant`], the
//! hand-chosen path and pair, so an untuned GPU runs what it ran before.
//!
//! [`MoeBlock`] is a [`Kernel`] only so that the tuner and the tune cache can name it: its IR
//! is the gate_up kernel's (what the tuner compiles up front and hashes), its symbol names both
//! halves. Both halves of every pair are variants of one DSL kernel, so an edit of the down
//! kernel's body changes the hashed gate_up source as well.

use std::fmt;
use std::sync::{Arc, Mutex};

use ddtree_codegen::{Kernel, KernelIr, KernelParams, ParamValue};
use ddtree_runtime::cudarc::driver::CudaSlice;
use ddtree_runtime::{bucket_pow2, CompiledKernel, Cost, DevicePool, Gpu, RuntimeError, Tunable, Verdict};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::check;
#[allow(unused_imports)]
use crate::tune::*;
use crate::w4a16::check::{
    gemv_moe_on, gemv_moe_pairs, grouped_gemv_moe_on, grouped_gemv_pairs, moe_block_on, moe_check_macs, moe_pairs,
    random_routing, wg_moe_pairs, MoeData, MoeShape,
};
use crate::w4a16::gemv::{self as w4gemv, W4a16Gemv};
use crate::w4a16::layout::interleaved_words;
use crate::w4a16::moe::{
    self, DeviceExperts, GroupedPair, MoeBuffers, MoeInput, MoeKernels, MoeVariant, GROUPED_GEMV_MAX_TOKENS,
};
use crate::w4a16::{Layout, W4a16Gemm, W4a16GemmWg, W4a16Params, W4a16WgParams};

/// The routed-expert block as the tuner sees it (see the module doc).
pub struct MoeBlock;

/// One MoE block launch: `tokens` tokens of `topk` slots over `experts` local INT4 experts
/// (gate_up `[2 inter, hidden]`, down `[hidden, inter]`, scale group `group`, interleaved).
/// Tokens are bucketed to powers of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MoeKey {
    /// Tokens T.
    pub tokens: usize,
    /// Slots per token.
    pub topk: usize,
    /// Local experts (the routed experts of one expert-parallel rank).
    pub experts: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Expert intermediate size I.
    pub inter: usize,
    /// INT4 scale group.
    pub group: usize,
}

impl fmt::Display for MoeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tokens={} topk={} experts={} hidden={} inter={} group={}",
            self.tokens, self.topk, self.experts, self.hidden, self.inter, self.group
        )
    }
}

impl KernelParams for MoeVariant {
    fn fields(&self) -> Vec<(&'static str, ParamValue)> {
        let path = match self {
            MoeVariant::Gemv(..) => "gemv",
            MoeVariant::GroupedGemv(..) => "grouped_gemv",
            MoeVariant::Grouped(GroupedPair::Mma(..)) => "grouped_mma",
            MoeVariant::Grouped(GroupedPair::Wg(..)) => "grouped_wg",
        };
        vec![("path", ParamValue::Variant(path))]
    }
}

/// The symbols of a variant's (gate_up, down) kernels.
fn pair_symbols(v: &MoeVariant) -> (String, String) {
    match v {
        MoeVariant::Gemv(u, d) | MoeVariant::GroupedGemv(u, d) => (W4a16Gemv::symbol(u), W4a16Gemv::symbol(d)),
        MoeVariant::Grouped(GroupedPair::Mma(u, d)) => (W4a16Gemm::symbol(u), W4a16Gemm::symbol(d)),
        MoeVariant::Grouped(GroupedPair::Wg(u, d)) => (W4a16GemmWg::symbol(u), W4a16GemmWg::symbol(d)),
    }
}

impl Kernel for MoeBlock {
    type Params = MoeVariant;
    const NAME: &'static str = "moe_w4a16";

    /// The hand-chosen decode-step variant at group 32 (the fallback where a key has none).
    fn space() -> Vec<MoeVariant> {
        moe::default_variant(1, 8, 32).into_iter().collect()
    }

    /// The gate_up kernel's IR (see the module doc).
    fn ir(p: &MoeVariant) -> ddtree_codegen::Result<KernelIr> {
        match p {
            MoeVariant::Gemv(u, _) | MoeVariant::GroupedGemv(u, _) => W4a16Gemv::ir(u),
            MoeVariant::Grouped(GroupedPair::Mma(u, _)) => W4a16Gemm::ir(u),
            MoeVariant::Grouped(GroupedPair::Wg(u, _)) => W4a16GemmWg::ir(u),
        }
    }

    /// Both kernels' symbols: the tune cache names a winner by it.
    fn symbol(p: &MoeVariant) -> String {
        let (u, d) = pair_symbols(p);
        format!("{}__{u}__{d}", Self::NAME)
    }
}

/// The candidates at `key`'s bucket, [`moe::default_variant`] first: the small-token GEMV pairs
/// that take the tokens, the grouped GEMV pairs up to twice [`GROUPED_GEMV_MAX_TOKENS`] (past it
/// they lose to the GEMM wherever tokens share experts), and every grouped GEMM pair
/// (`mma.sync`, and `wgmma`, which fails to compile off Hopper and is then scored out), all
/// at the key's group on interleaved experts.
fn variants(key: &MoeKey) -> Vec<MoeVariant> {
    let (tokens, topk, group) = (key.tokens as u32, key.topk as u32, key.group as u32);
    let Some(default) = moe::default_variant(tokens, topk, group) else {
        return Vec::new();
    };
    let mut all = vec![default];
    // The GEMV paths' shape rule (`moe.rs`'s `gemv_shapes`).
    let gemv_ok = w4gemv::takes_group(key.group) && key.hidden % 32 == 0 && key.inter % 32 == 0;
    if gemv_ok && tokens * topk <= w4gemv::MAX_PAIRS {
        all.extend(
            gemv_moe_pairs()
                .into_iter()
                .filter(|(u, d)| u.group == group && w4gemv::max_tokens(u) >= tokens && w4gemv::max_tokens(d) >= tokens)
                .map(|(u, d)| MoeVariant::Gemv(u, d)),
        );
    }
    if gemv_ok && tokens <= 2 * GROUPED_GEMV_MAX_TOKENS {
        all.extend(
            grouped_gemv_pairs()
                .into_iter()
                .filter(|(u, _)| u.group == group)
                .map(|(u, d)| MoeVariant::GroupedGemv(u, d)),
        );
    }
    let interleaved = |l: Layout| l == Layout::Interleaved;
    all.extend(
        moe_pairs()
            .into_iter()
            .filter(|(u, _)| interleaved(u.layout))
            .map(|(u, d)| {
                let g = |p: W4a16Params| W4a16Params { group, ..p };
                MoeVariant::Grouped(GroupedPair::Mma(g(u), g(d)))
            }),
    );
    all.extend(
        wg_moe_pairs()
            .into_iter()
            .filter(|(u, _)| interleaved(u.layout))
            .map(|(u, d)| {
                let g = |p: W4a16WgParams| W4a16WgParams { group, ..p };
                MoeVariant::Grouped(GroupedPair::Wg(g(u), g(d)))
            }),
    );
    let mut out: Vec<MoeVariant> = Vec::new();
    for v in all {
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

/// The routings each timing rotates over.
const ROUTINGS: usize = 8;

/// MoE block timing buffers: every candidate compiled with its own buffers, the experts'
/// weights (shared by every token bucket), rotated activations, routings and outputs.
pub struct MoeWorkload {
    key: MoeKey,
    kernels: Vec<(MoeVariant, MoeKernels, MoeBuffers)>,
    w: Arc<[CudaSlice<u32>; 4]>,
    x: Vec<CudaSlice<bf16>>,
    routes: Vec<(CudaSlice<u32>, CudaSlice<f32>)>,
    out: Vec<CudaSlice<bf16>>,
}

impl Tunable for MoeBlock {
    type Key = MoeKey;
    type Workload = MoeWorkload;

    fn bucket(key: &MoeKey) -> MoeKey {
        MoeKey {
            tokens: bucket_pow2(key.tokens),
            ..*key
        }
    }

    fn candidates(key: &MoeKey) -> Vec<MoeVariant> {
        variants(key)
    }

    /// The expected touched experts' weights (top-k of uniform routing) and the activations.
    fn cost(key: &MoeKey) -> Cost {
        let MoeKey {
            tokens,
            topk,
            experts,
            hidden,
            inter,
            group,
        } = *key;
        let e = experts.max(1) as f64;
        let touched = e * (1.0 - (1.0 - topk as f64 / e).max(0.0).powi(tokens as i32));
        let per_expert = 3 * hidden * inter;
        let weights = per_expert / 2 + 2 * (per_expert / group.max(1));
        let pairs = tokens * topk;
        Cost {
            bytes: touched * weights as f64 + (2 * tokens * hidden * 2 + 2 * pairs * inter * 2) as f64,
            flops: 2.0 * (pairs * per_expert) as f64,
        }
    }

    fn workload(
        gpu: &Gpu,
        pool: &mut DevicePool,
        key: &MoeKey,
        copies: usize,
        seed: u64,
    ) -> Result<MoeWorkload, RuntimeError> {
        let fills = Fills::get(gpu, pool)?;
        let MoeKey {
            tokens,
            topk,
            experts,
            hidden,
            inter,
            group,
        } = *key;
        // One copy: the experts far exceed the L2. Random words: the speed does not depend on them.
        let words13 = experts * interleaved_words(2 * inter, hidden);
        let words2 = experts * interleaved_words(hidden, inter);
        let scales13 = (experts * 2 * inter * hidden / group.max(1)).div_ceil(2);
        let scales2 = (experts * hidden * inter / group.max(1)).div_ceil(2);
        let name = format!("moe.w experts={experts} hidden={hidden} inter={inter} group={group}");
        let w = pool.get_or_try_insert(&name, 4 * (words13 + words2 + scales13 + scales2), || {
            Ok([
                fills.u32(gpu, words13, seed)?,
                fills.u32(gpu, scales13, seed + 1)?,
                fills.u32(gpu, words2, seed + 2)?,
                fills.u32(gpu, scales2, seed + 3)?,
            ])
        })?;
        let mut rng = StdRng::seed_from_u64(seed);
        let routes = (0..ROUTINGS)
            .map(|_| {
                let (ids, wts) = random_routing(&mut rng, tokens, topk, experts);
                Ok((upload(gpu, &ids)?, upload(gpu, &wts)?))
            })
            .collect::<Result<Vec<_>, RuntimeError>>()?;
        let mut kernels = Vec::new();
        for v in variants(key) {
            // A variant that does not compile here (wgmma off Hopper) fails in the tuner too.
            let Ok(k) = MoeKernels::for_variant(gpu, &v) else {
                continue;
            };
            let bufs = k.buffers(gpu.stream(), tokens, topk, &experts_of(&w, key))?;
            kernels.push((v, k, bufs));
        }
        Ok(MoeWorkload {
            key: *key,
            kernels,
            w,
            x: fills.bf16_sets(gpu, copies, tokens * hidden, seed, (-1.0, 1.0))?,
            routes,
            out: zeros(gpu, copies, tokens * hidden)?,
        })
    }

    fn run(gpu: &Gpu, kern: &CompiledKernel<Self>, w: &mut MoeWorkload, i: usize) -> Result<(), RuntimeError> {
        let key = w.key;
        let Some((_, k, bufs)) = w.kernels.iter_mut().find(|(v, ..)| v == kern.params()) else {
            return Err(RuntimeError::Launch {
                kernel: Self::NAME.into(),
                reason: format!("{} was not compiled for the workload", Self::symbol(kern.params())),
            });
        };
        let (ids, wts) = &w.routes[i % w.routes.len()];
        let input = MoeInput {
            x: &w.x[i % w.x.len()],
            topk_ids: ids,
            topk_w: wts,
            tokens: key.tokens as u32,
            topk: key.topk as u32,
        };
        let c = i % w.out.len();
        // SAFETY: x [T, H], routing [T, topk] over the local experts, the experts' words and
        // scales sized for the key's shape, buffers made by `buffers` for T tokens.
        unsafe { k.run(gpu.stream(), &experts_of(&w.w, &key), &input, &mut w.out[c], bufs) }
    }

    fn check_key(key: &MoeKey) -> MoeKey {
        // A few experts past top-k (some tokens share them), half-size experts with the full
        // hidden reduction (every k step and ring wrap of the real one), at most 16 tokens
        // (two GEMV chunks, several grouped blocks per expert). The reference's cost:
        // [`check_macs`].
        MoeKey {
            tokens: key.tokens.min(16),
            experts: key.experts.min(key.topk + 2),
            inter: key.inter.min(512),
            ..*key
        }
    }

    /// Every candidate at `key` on the same data ([`check_data`]: the weights, inputs, routing
    /// and gate_up reference are made once per check key and seed, as each check used to redraw
    /// them identically from the seed), uploaded afresh with its outputs poisoned; the later
    /// stages' references come from the candidate's own outputs.
    fn check(gpu: &Gpu, v: &MoeVariant, key: &MoeKey, seed: u64) -> Result<Verdict, RuntimeError> {
        let t = check::Target::Gpu(gpu);
        let data = check_data(key, seed);
        match v {
            MoeVariant::Gemv(u, d) => gemv_moe_on(&t, u, d, &data),
            MoeVariant::GroupedGemv(u, d) => grouped_gemv_moe_on(&t, u, d, &data),
            MoeVariant::Grouped(GroupedPair::Mma(u, d)) => moe_block_on::<W4a16Gemm>(&t, &(*u, *d), &data),
            MoeVariant::Grouped(GroupedPair::Wg(u, d)) => moe_block_on::<W4a16GemmWg>(&t, &(*u, *d), &data),
        }
        .map(verdict)
        .map_err(Into::into)
    }
}

/// The check shape of a check key.
fn check_shape(key: &MoeKey) -> MoeShape {
    MoeShape {
        tokens: key.tokens,
        experts: key.experts,
        hidden: key.hidden,
        inter: key.inter,
        topk: key.topk,
    }
}

/// The data of check key `key` at `seed`, made on first use and kept for the next candidate:
/// the tuner checks a key's candidates one after another. Only the last key's is kept (the
/// packed experts: about 62 MB at Kimi K2.6's EP8 check key).
fn check_data(key: &MoeKey, seed: u64) -> Arc<MoeData> {
    static LAST: Mutex<Option<(MoeKey, u64, Arc<MoeData>)>> = Mutex::new(None);
    let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((k, s, data)) = &*last {
        if k == key && *s == seed {
            return data.clone();
        }
    }
    *last = None;
    let rng = &mut StdRng::seed_from_u64(seed);
    let data = Arc::new(MoeData::random(check_shape(key), key.group, rng));
    *last = Some((*key, seed, data.clone()));
    data
}

/// Multiply-adds of the CPU reference when checking `key`'s candidates at its check key
/// ([`moe_check_macs`]): once per check key, and per candidate.
pub fn check_macs(key: &MoeKey) -> (u64, u64) {
    moe_check_macs(check_shape(&MoeBlock::check_key(key)))
}

/// The workload's experts as the kernels read them.
fn experts_of<'a>(w: &'a [CudaSlice<u32>; 4], key: &MoeKey) -> DeviceExperts<'a> {
    DeviceExperts {
        w13: &w[0],
        s13: &w[1],
        w2: &w[2],
        s2: &w[3],
        experts: key.experts as u32,
        hidden: key.hidden as u32,
        inter: key.inter as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The check of every Kimi K2.6 EP8 token bucket stays cheap on the CPU side: the gate_up
    /// reference (made once per check key) under 1.1 G multiply-adds, each candidate's down and
    /// sum references under 0.55 G (with the 16 host cores of a GPU machine, well under a
    /// second per key for all candidates), and every candidate checked at the full hidden size.
    #[test]
    fn check_reference_work_is_bounded() {
        for group in [32usize, 64, 128] {
            for tokens in [1usize, 2, 4, 8, 16, 32, 64, 128, 256, 512, 4096] {
                let key = MoeKey {
                    tokens,
                    topk: 8,
                    experts: 48,
                    hidden: 7168,
                    inter: 2048,
                    group,
                };
                let ck = MoeBlock::check_key(&key);
                assert_eq!(
                    (ck.hidden, ck.group, ck.topk),
                    (key.hidden, key.group, key.topk),
                    "{key}"
                );
                let (shared, per_candidate) = check_macs(&key);
                let n = MoeBlock::candidates(&key).len() as u64;
                eprintln!("{key}: {n} candidates, shared {shared}, per candidate {per_candidate}");
                assert!(shared <= 1_100_000_000, "{key}: {shared}");
                assert!(per_candidate <= 550_000_000, "{key}: {per_candidate}");
            }
        }
    }
    use crate::w4a16::gemv::GemvMode;
    use crate::w4a16::moe::GEMV_MAX_TOKENS;

    /// Index 0 of every token bucket is the hand-chosen variant at every token count of the
    /// bucket (the path thresholds and the GEMM's half-tile switch fall on bucket edges), and
    /// each candidate is a well-formed pair at the key's group.
    #[test]
    fn default_candidate_is_the_hand_chosen_variant() {
        for group in [32usize, 64, 128] {
            for topk in [1usize, 2, 4, 6, 8] {
                for tokens in 1..=512usize {
                    let key = MoeKey {
                        tokens,
                        topk,
                        experts: 48,
                        hidden: 7168,
                        inter: 2048,
                        group,
                    };
                    let c = MoeBlock::candidates(&MoeBlock::bucket(&key));
                    let (t, k, g) = (tokens as u32, topk as u32, group as u32);
                    assert_eq!(Some(c[0]), moe::default_variant(t, k, g), "{key}");
                    assert!(c.iter().all(|v| v.group() == g), "{key}");
                    if tokens > 1 {
                        continue;
                    }
                    let symbols: Vec<String> = c.iter().map(MoeBlock::symbol).collect();
                    let mut uniq = symbols.clone();
                    uniq.sort();
                    uniq.dedup();
                    assert_eq!(uniq.len(), symbols.len(), "{key}");
                }
            }
        }
        // Kimi K2.6's EP8 slice: the small-token pair to 8 tokens, the grouped GEMV pair to 16,
        // then the grouped GEMM.
        let path = |tokens| match moe::default_variant(tokens, 8, 32).unwrap() {
            MoeVariant::Gemv(u, d) => {
                assert_eq!((u.mode, d.mode), (GemvMode::GateUp, GemvMode::Down));
                "gemv"
            }
            MoeVariant::GroupedGemv(..) => "grouped_gemv",
            MoeVariant::Grouped(GroupedPair::Mma(..)) => "mma",
            MoeVariant::Grouped(GroupedPair::Wg(..)) => "wg",
        };
        assert_eq!(path(1), "gemv");
        assert_eq!(path(GEMV_MAX_TOKENS), "gemv");
        assert_eq!(path(GEMV_MAX_TOKENS + 1), "grouped_gemv");
        assert_eq!(path(GROUPED_GEMV_MAX_TOKENS), "grouped_gemv");
        assert_eq!(path(GROUPED_GEMV_MAX_TOKENS + 1), "mma");
        // Every path has alternatives at a decode step.
        let c = MoeBlock::candidates(&MoeKey {
            tokens: 1,
            topk: 8,
            experts: 48,
            hidden: 7168,
            inter: 2048,
            group: 32,
        });
        for p in ["gemv", "grouped_gemv", "grouped_mma", "grouped_wg"] {
            assert!(
                c.iter().filter(|v| v.fields()[0].1 == ParamValue::Variant(p)).count() >= 1,
                "{p}"
            );
        }
    }
}
