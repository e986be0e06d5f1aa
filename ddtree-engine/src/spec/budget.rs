//! The cost-aware tree budget behind `--budget auto`.
//!
//! The DDTree paper fixes the node budget B for a whole run and picks it by a sweep. The best B
//! depends on the hardware (how the target's verify latency grows with the tree) and on the
//! round (a confident draft wants a chain, an uncertain one a wide tree or none at all). `auto`
//! chooses B every round from what both sides already know:
//!
//! * **Gain.** Under the drafter's factorized distribution the expected number of accepted
//!   drafted tokens of a tree is the sum of its nodes' path probabilities (DDTree Prop. 1). The
//!   best-first builder emits nodes in descending path log-prob order and every prefix of that
//!   order is a prefix-closed tree (the top-B tree, Prop. 2), so one tree built at the maximum
//!   budget gives the expected accepted length of every smaller budget as a prefix sum:
//!   `E(B) = sum_{i <= B} exp(path_logprob_i)`. A round emits `E(B) + 1` tokens (the bonus).
//! * **Cost.** A [`CostModel`]: fixed per-round costs (drafter forward, tree build, accept +
//!   compaction) plus the target's verify latency `t(n)` for a forward of `n = B + 1` tokens,
//!   from a table of measured points made non-decreasing ([`monotone_envelope`]).
//!
//! [`choose_budget`] returns the `B` in `1..=max_budget` with the most expected tokens per µs,
//! `(E(B) + 1) / (draft + build + t(B + 1) + accept)`, by one pass over the prefix sums, among
//! the sizes at the end of a flat stretch of `t` (within [`FLAT_TOLERANCE`]). The
//! loop ([`crate::spec::generate_speculative`]) builds the tree at the maximum budget, calls it,
//! and truncates the tree to the chosen size ([`ddtree_kernels::tree::DraftTree::truncate`]),
//! which is exactly the tree the builder gives at that budget; acceptance is unchanged, so the
//! output is the same as for any fixed budget.
//!
//! * **Calibration** (opt-in, `SpecOptions::calibrate`). Taken at face value, a drafter that
//!   says 85% and is always right makes `auto` undervalue deep chains (and one that is
//!   overconfident, wide trees). [`Calibration`] learns, from every round's verify, how often a
//!   drafted edge of each probability is the target's token (histogram binning on the log-odds,
//!   starting from the identity), and the gain then uses the calibrated path probabilities. It
//!   only moves the budget choice; the output is unchanged.

use ddtree_kernels::tree::DraftTree;
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

/// One measured point of the verify latency: a target forward of `tokens` tree tokens (the root
/// included, so `tokens = B + 1`) over the cache took `us` µs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct VerifyPoint {
    /// Tokens in the verify forward, root included (`B + 1`).
    pub tokens: usize,
    /// Median latency in µs.
    pub us: f64,
}

/// Per-round costs of DDTree on one (device, model, drafter), in µs; stored as JSON in a tune
/// cache:
///
/// ```json
/// {"source": "H200, kimi-k2.6 + K2.5-DFlash, 2026-05-01", "draft_us": 1500.0,
///  "build_us": 60.0, "accept_us": 80.0,
///  "verify": [{"tokens": 1, "us": 21000.0}, {"tokens": 64, "us": 23000.0},
///             {"tokens": 256, "us": 61000.0}]}
/// ```
///
/// `verify` is sorted by `tokens` (strictly increasing) and, as [`CostModel::new`] and
/// [`CostModel::from_json`] leave it, non-decreasing in `us`: both replace each point's latency
/// by the least of its own and every larger size's ([`monotone_envelope`]; a larger forward does
/// the work of a smaller one, and timing noise is mostly delay). The stored form is unchanged:
/// files written before this rule load with the envelope applied. Between points the latency is interpolated
/// linearly (a step of the real curve between two points is smeared over the segment: measure
/// densely where the steps matter, as `autotune --verify-cost` does up to 64 tokens), below the
/// first point it is the first point's, past the last point it grows with the last segment's
/// slope. Use [`CostModel::new`] or [`CostModel::from_json`] rather than building the struct by
/// hand.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Where the numbers come from (device, model, date), shown in the statistics.
    pub source: String,
    /// Drafter forward per round.
    pub draft_us: f64,
    /// Tree build per round (the top-K and the best-first heap, at the maximum budget).
    pub build_us: f64,
    /// Accept walk, KV compaction and feature selection per round.
    pub accept_us: f64,
    /// Target verify latency by forward length; at least one point.
    pub verify: Vec<VerifyPoint>,
}

/// The per-token verify cost up to 64 tokens of [`CostModel::fallback`], in µs.
const FALLBACK_FLAT_SLOPE_US: f64 = 10.0;
/// The per-token verify cost past 64 tokens of [`CostModel::fallback`], in µs.
const FALLBACK_SLOPE_US: f64 = 150.0;

impl CostModel {
    /// A validated cost model; `verify` is `(tokens, µs)` points in any order.
    pub fn new(
        source: impl Into<String>,
        draft_us: f64,
        build_us: f64,
        accept_us: f64,
        verify: &[(usize, f64)],
    ) -> Result<Self> {
        let mut verify: Vec<VerifyPoint> = verify.iter().map(|&(tokens, us)| VerifyPoint { tokens, us }).collect();
        verify.sort_by_key(|p| p.tokens);
        Self {
            source: source.into(),
            draft_us,
            build_us,
            accept_us,
            verify,
        }
        .normalized()
    }

    /// Validates `self` and takes the [`monotone_envelope`] of its verify curve.
    fn normalized(mut self) -> Result<Self> {
        // Validate first: the envelope would hide an infinite latency behind a smaller one.
        self.validate()?;
        monotone_envelope(&mut self.verify);
        // Lowered latencies can make a round free.
        self.validate()?;
        Ok(self)
    }

    /// The model `auto` uses when nothing was measured (the CPU backend, or no tune-cache
    /// entry). A GPU-shaped guess, no measurement of any machine: a verify forward of one token
    /// takes 10 ms, each further token costs 10 µs up to 64 tokens (0.1% of a forward: the
    /// weights are read once, the tokens ride along) and 150 µs after that (1.5%: compute and,
    /// for MoE, more experts); the drafter forward 1 ms, build and accept 0.1 ms each. With it
    /// `auto` keeps a node while its path probability pays for its share of the round: below
    /// 64 tokens any node with probability above about `(E + 1) / 1100`.
    pub fn fallback() -> Self {
        let at64 = 10_000.0 + 63.0 * FALLBACK_FLAT_SLOPE_US;
        Self::new(
            "default cost model: verify 10 ms + 10 µs per token up to 64 tokens, +150 µs per \
             token after; draft 1 ms, build and accept 0.1 ms each",
            1_000.0,
            100.0,
            100.0,
            &[(1, 10_000.0), (64, at64), (128, at64 + 64.0 * FALLBACK_SLOPE_US)],
        )
        .expect("the default cost model is valid")
    }

    /// Checks the invariants: finite non-negative costs, at least one verify point, `tokens`
    /// at least 1 and strictly increasing.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(EngineError::Forward(format!("cost model `{}`: {reason}", self.source)));
        for (name, v) in [
            ("draft_us", self.draft_us),
            ("build_us", self.build_us),
            ("accept_us", self.accept_us),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(format!("{name} must be finite and >= 0, got {v}"));
            }
        }
        if self.verify.is_empty() {
            return bad("no verify latency points".into());
        }
        for (i, p) in self.verify.iter().enumerate() {
            if p.tokens == 0 || !(p.us.is_finite() && p.us >= 0.0) {
                return bad(format!(
                    "verify point {i} ({} tokens, {} µs) is invalid",
                    p.tokens, p.us
                ));
            }
            if i > 0 && self.verify[i - 1].tokens >= p.tokens {
                return bad(format!(
                    "verify points must have strictly increasing tokens (point {i})"
                ));
            }
        }
        if self.round_us(1) <= 0.0 {
            return bad("a round must cost more than 0 µs".into());
        }
        Ok(())
    }

    /// Parses and validates a cost model from JSON (the tune-cache form) and takes the
    /// [`monotone_envelope`] of its verify curve.
    pub fn from_json(text: &str) -> Result<Self> {
        let model: Self =
            serde_json::from_str(text).map_err(|e| EngineError::Forward(format!("cost model JSON: {e}")))?;
        model.normalized()
    }

    /// The JSON form [`CostModel::from_json`] reads.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a cost model serializes")
    }

    /// Verify latency of a forward of `tokens` tokens (root included), in µs: piecewise linear
    /// through the measured points, flat below the first, the last segment's slope (at least 0,
    /// for a struct built by hand with a falling curve) past the last.
    pub fn verify_us(&self, tokens: usize) -> f64 {
        let pts = self.verify.as_slice();
        let x = tokens as f64;
        let i = pts.partition_point(|p| p.tokens <= tokens);
        let line = |a: &VerifyPoint, b: &VerifyPoint| {
            let slope = (b.us - a.us) / (b.tokens - a.tokens) as f64;
            (slope, a.us + slope * (x - a.tokens as f64))
        };
        if i == 0 {
            pts[0].us
        } else if i == pts.len() {
            match pts {
                [.., a, b] => {
                    let (slope, _) = line(a, b);
                    b.us + slope.max(0.0) * (x - b.tokens as f64)
                }
                _ => pts[0].us,
            }
        } else {
            line(&pts[i - 1], &pts[i]).1
        }
    }

    /// The fixed per-round costs: draft + build + accept.
    pub fn fixed_us(&self) -> f64 {
        self.draft_us + self.build_us + self.accept_us
    }

    /// Expected duration of a round with a tree of `budget` nodes besides the root.
    pub fn round_us(&self, budget: usize) -> f64 {
        self.fixed_us() + self.verify_us(budget + 1)
    }
}

/// Replaces each point's latency by the least latency at its size or any larger one, making the
/// curve non-decreasing (points sorted by `tokens`). Idempotent; a NaN stays where it is.
pub fn monotone_envelope(points: &mut [VerifyPoint]) {
    let mut floor = f64::INFINITY;
    for p in points.iter_mut().rev() {
        if p.us > floor {
            p.us = floor;
        } else {
            floor = p.us;
        }
    }
}

/// How much the verify latency may rise, relative to the start of a stretch of sizes, and the
/// stretch still count as flat in [`choose_budget`]: 1%. Below it a rise is measurement noise
/// or not worth a separate tree size (each size the verify step meets costs a CUDA-graph
/// recording); a tile edge of the verify step is a larger step (BENCHMARKS.md: on the H200 Kimi
/// K2.6 EP8 verifies 16 tokens in 22.7 ms, 17 in 25.5 ms, 12% more).
pub const FLAT_TOLERANCE: f64 = 0.01;

/// How much higher another budget's expected rate must be than that of the last round's choice
/// for [`choose_budget`] to leave it: 5%. The expected accepted length is an estimate from the
/// drafter's probabilities, which a drafter's hard stretches inflate, and a tree size the verify
/// step has not met yet runs eagerly before its CUDA graph is recorded. On the H200 (Kimi K2.6
/// EP8, block 8, BENCHMARKS.md) `auto` without it chose 32 in one round of 30 on the `switching`
/// profile and 8 in the others, and ran 5.6% slower than budget 8 throughout.
pub const SWITCH_MARGIN: f64 = 0.05;

/// The budget with the most expected tokens per µs.
///
/// `path_logprobs` are the path log-probs of a tree's non-root nodes in the builder's
/// best-first order (`DraftTree::path_logprob[1..]`); the top-`B` tree is their first `B`, and
/// its expected accepted length is `E(B) = sum of exp(path_logprobs[..B])`. Returns the `B` in
/// `1..=min(max_budget, path_logprobs.len())` maximizing `(E(B) + 1) / cost.round_us(B)` (the
/// smallest on ties), or 0 when that range is empty (a tree of the root alone).
///
/// Only sizes at the end of a flat stretch of the verify curve compete. The forward lengths
/// `n = B + 1` = 1, 2, 3, ... split into stretches: a stretch starts at `n = 1` and at the first
/// length whose latency exceeds `1 + `[`FLAT_TOLERANCE`] times the latency at the start of the
/// stretch before; its last length is its top (as is every length at or past the last measured
/// point, where the curve is extrapolated). Inside a stretch a larger tree costs at most the
/// tolerance more and gains at least as much, so the best top has at least `1 / (1 + `
/// [`FLAT_TOLERANCE`]`)` of the best size's rate whenever that size's stretch ends in range; and
/// a few repeated sizes let the verify step replay its CUDA graphs instead of recording a new
/// size every round. A step of the curve (a tile edge) above the tolerance always ends a
/// stretch; a steady slope ends one every 1% of latency. When the range holds no top, every
/// size competes.
///
/// `previous`, the previous round's choice, is kept unless the best size's rate exceeds its rate by
/// more than [`SWITCH_MARGIN`] (when it is in range). O(max_budget).
pub fn choose_budget(path_logprobs: &[f32], cost: &CostModel, max_budget: usize, previous: Option<usize>) -> usize {
    let fixed = cost.fixed_us();
    let flat = 1.0 + FLAT_TOLERANCE;
    let mut expected = 1.0f64;
    let mut best = (0usize, f64::NEG_INFINITY);
    let mut best_any = (0usize, f64::NEG_INFINITY);
    let mut previous_rate = None;
    // Past the last measured point the curve is extrapolated: every size there counts as a top.
    let last = cost.verify.last().map_or(1, |p| p.tokens);
    // The latency at the start of the current stretch, and at the current size.
    let mut start = cost.verify_us(1);
    let mut us = cost.verify_us(2);
    for (i, &lp) in path_logprobs.iter().take(max_budget).enumerate() {
        let b = i + 1;
        expected += (lp as f64).exp();
        if us > start * flat {
            start = us;
        }
        let next = cost.verify_us(b + 2);
        let rate = expected / (fixed + us);
        if Some(b) == previous {
            previous_rate = Some(rate);
        }
        if rate > best_any.1 {
            best_any = (b, rate);
        }
        if (next > start * flat || b + 1 >= last) && rate > best.1 {
            best = (b, rate);
        }
        us = next;
    }
    let best = if best.0 == 0 { best_any } else { best };
    match (previous, previous_rate) {
        (Some(l), Some(r)) if best.1 <= r * (1.0 + SWITCH_MARGIN) => l,
        _ => best.0,
    }
}

/// Log-odds bins of [`Calibration`]: `BINS` of width 1 centred on -9.5 .. 9.5.
const BINS: usize = 20;

/// Pseudo-observations each bin starts with, at its centre's probability (the identity map).
const PRIOR: f64 = 2.0;

/// Online calibration of the drafter's edge probabilities: for a drafted edge of probability
/// `q` (a node's path probability over its parent's), the observed rate at which the target
/// took that token, per log-odds bin of `q`.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    hits: [f64; BINS],
    seen: [f64; BINS],
}

impl Default for Calibration {
    /// The identity map: every bin holds [`PRIOR`] observations at its centre.
    fn default() -> Self {
        let mut c = Calibration {
            hits: [0.0; BINS],
            seen: [PRIOR; BINS],
        };
        for (b, h) in c.hits.iter_mut().enumerate() {
            let centre = b as f64 - BINS as f64 / 2.0 + 0.5;
            *h = PRIOR / (1.0 + (-centre).exp());
        }
        c
    }
}

impl Calibration {
    fn bin(q: f64) -> usize {
        let q = q.clamp(1e-12, 1.0 - 1e-12);
        let logit = (q / (1.0 - q)).ln() + BINS as f64 / 2.0;
        (logit.max(0.0) as usize).min(BINS - 1)
    }

    /// The calibrated probability of a drafted edge of probability `q`.
    pub fn map(&self, q: f64) -> f64 {
        let b = Self::bin(q);
        self.hits[b] / self.seen[b]
    }

    /// Records one observation: an edge of probability `q` was (`hit`) or was not the target's
    /// token.
    pub fn observe(&mut self, q: f64, hit: bool) {
        let b = Self::bin(q);
        self.seen[b] += 1.0;
        if hit {
            self.hits[b] += 1.0;
        }
    }

    /// Records a verified round: every child of an accepted node of `tree` (`accepted`: node
    /// indices, root first) was drafted with its edge probability and is a hit when it is the
    /// next accepted node.
    pub fn observe_round(&mut self, tree: &DraftTree, accepted: &[u32]) {
        for (i, &a) in accepted.iter().enumerate() {
            let next = accepted.get(i + 1).map(|&n| n as i32);
            let mut c = tree.first_child[a as usize];
            while c >= 0 {
                let q = f64::from(tree.path_logprob[c as usize] - tree.path_logprob[a as usize]).exp();
                self.observe(q, Some(c) == next);
                c = tree.next_sibling[c as usize];
            }
        }
    }

    /// The calibrated path log-probability of every node of `tree` (root 0), in node order.
    pub fn path_logprobs(&self, tree: &DraftTree) -> Vec<f32> {
        let mut out = vec![0.0f32; tree.len()];
        for i in 1..tree.len() {
            let p = tree.parent[i] as usize;
            let q = f64::from(tree.path_logprob[i] - tree.path_logprob[p]).exp();
            out[i] = out[p] + self.map(q).max(1e-30).ln() as f32;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> CostModel {
        CostModel::new("t", 100.0, 10.0, 20.0, &[(64, 2000.0), (1, 1000.0), (32, 1000.0)]).unwrap()
    }

    #[test]
    fn verify_latency_interpolates_and_extrapolates() {
        let c = table();
        assert_eq!(c.verify[0].tokens, 1, "points are sorted");
        assert_eq!(c.verify_us(1), 1000.0);
        assert_eq!(c.verify_us(16), 1000.0);
        assert_eq!(c.verify_us(48), 1500.0);
        assert_eq!(c.verify_us(64), 2000.0);
        assert_eq!(c.verify_us(96), 3000.0, "the last slope continues");
        assert_eq!(c.round_us(47), 130.0 + 1500.0);
        let one = CostModel::new("one", 0.0, 0.0, 0.0, &[(8, 50.0)]).unwrap();
        assert_eq!((one.verify_us(1), one.verify_us(500)), (50.0, 50.0));
        // A noisy table whose last segment falls: flat past the end, never below.
        let noisy = CostModel::new("n", 0.0, 0.0, 0.0, &[(1, 50.0), (64, 60.0), (128, 55.0)]).unwrap();
        assert_eq!(noisy.verify_us(1000), 55.0);
        let f = CostModel::fallback();
        assert_eq!(
            (f.verify_us(1), f.verify_us(64), f.verify_us(164)),
            (10_000.0, 10_630.0, 25_630.0)
        );
    }

    #[test]
    fn invalid_models_are_rejected() {
        assert!(CostModel::new("x", 1.0, 1.0, 1.0, &[]).is_err());
        assert!(CostModel::new("x", 1.0, 1.0, 1.0, &[(0, 5.0)]).is_err());
        assert!(CostModel::new("x", 1.0, 1.0, 1.0, &[(2, 5.0), (2, 6.0)]).is_err());
        assert!(CostModel::new("x", f64::NAN, 1.0, 1.0, &[(2, 5.0)]).is_err());
        assert!(CostModel::new("x", 1.0, 1.0, 1.0, &[(2, -5.0)]).is_err());
        assert!(CostModel::new("x", 0.0, 0.0, 0.0, &[(1, 0.0)]).is_err(), "a free round");
        let err = CostModel::from_json(r#"{"source":"s","draft_us":1,"build_us":1,"accept_us":1,"verify":[]}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no verify latency points"), "{err}");
        assert!(CostModel::from_json("{").is_err());
    }

    #[test]
    fn json_round_trip() {
        let c = table();
        assert_eq!(CostModel::from_json(&c.to_json()).unwrap(), c);
        let doc = r#"{"source": "H200", "draft_us": 1500.0, "build_us": 60.0, "accept_us": 80.0,
            "verify": [{"tokens": 1, "us": 21000.0}, {"tokens": 64, "us": 23000.0}]}"#;
        let c = CostModel::from_json(doc).unwrap();
        assert_eq!(c.verify_us(32), 21000.0 + 2000.0 * 31.0 / 63.0);
    }

    /// The first forward length of every flat stretch up to `max_tokens`, by the definition:
    /// 1, then each first length whose latency exceeds the tolerance over the previous start's.
    fn stretch_starts(cost: &CostModel, max_tokens: usize) -> Vec<usize> {
        let mut starts = vec![1];
        for n in 2..=max_tokens {
            let start = *starts.last().unwrap();
            if cost.verify_us(n) > cost.verify_us(start) * (1.0 + FLAT_TOLERANCE) {
                starts.push(n);
            }
        }
        starts
    }

    /// Brute force: the argmax over every B of the ratio, recomputing the sum each time.
    fn brute(lp: &[f32], cost: &CostModel, max: usize) -> usize {
        let last = cost.verify.last().map_or(1, |p| p.tokens);
        let starts = stretch_starts(cost, max + 2);
        let best = |tops_only: bool| {
            let mut best = (0, f64::NEG_INFINITY);
            for b in 1..=max.min(lp.len()) {
                if tops_only && !starts.contains(&(b + 2)) && b + 1 < last {
                    continue;
                }
                let e: f64 = 1.0 + lp[..b].iter().map(|&x| (x as f64).exp()).sum::<f64>();
                let r = e / cost.round_us(b);
                if r > best.1 {
                    best = (b, r);
                }
            }
            best.0
        };
        match best(true) {
            0 => best(false),
            b => b,
        }
    }

    #[test]
    fn sizes_inside_a_flat_stretch_do_not_compete() {
        // A staircase: 9 tokens 18 ms, 10..17 tokens 25 ms, then 29 ms to 33.
        let stairs = CostModel::new(
            "stairs",
            0.0,
            0.0,
            0.0,
            &[
                (9, 18_000.0),
                (10, 25_000.0),
                (17, 25_000.0),
                (18, 29_000.0),
                (33, 29_000.0),
            ],
        )
        .unwrap();
        let lp = vec![-0.05f32; 40];
        // A tree of 12 nodes: 16 would pay, 12 costs as much; the step below is taken.
        assert_eq!(choose_budget(&lp[..12], &stairs, 256, None), 8);
        assert_eq!(choose_budget(&lp, &stairs, 32, None), 32);
        // Past the last point (flat extrapolation) every size is a top.
        assert_eq!(choose_budget(&lp, &stairs, 256, None), 40);
        assert_eq!(choose_budget(&lp, &stairs, 20, None), 16);
        // No step top in range: every size competes.
        assert_eq!(choose_budget(&lp[..5], &stairs, 256, None), 5);
    }

    #[test]
    fn the_last_choice_stays_unless_another_is_clearly_better() {
        // 9 tokens 18 ms, 10..17 tokens 25 ms: budget 8 or 16.
        let stairs = CostModel::new(
            "stairs",
            0.0,
            0.0,
            0.0,
            &[(9, 18_000.0), (10, 25_000.0), (17, 25_000.0)],
        )
        .unwrap();
        let rate = |lp: &[f32], b: usize, us: f64| (1.0 + lp[..b].iter().map(|&l| (l as f64).exp()).sum::<f64>()) / us;
        // A chain where 16 is 2% better than 8, and one where it is 20% better.
        for (p16, clearly) in [(0.47f32, false), (0.75, true)] {
            let lp: Vec<f32> = (0..16).map(|i| if i < 8 { -0.01 } else { p16.ln() }).collect();
            let gain = rate(&lp, 16, 25_000.0) / rate(&lp, 8, 18_000.0) - 1.0;
            assert!(gain > 0.0 && (gain > SWITCH_MARGIN) == clearly, "gain {gain}");
            assert_eq!(choose_budget(&lp, &stairs, 16, None), 16, "gain {gain}");
            assert_eq!(choose_budget(&lp, &stairs, 16, Some(16)), 16, "gain {gain}");
            let kept = if clearly { 16 } else { 8 };
            assert_eq!(choose_budget(&lp, &stairs, 16, Some(8)), kept, "gain {gain}");
            // A last choice out of range (a smaller tree this round) does not count.
            assert_eq!(choose_budget(&lp[..12], &stairs, 16, Some(16)), 8);
        }
    }

    #[test]
    fn choice_follows_the_gain_and_the_cost() {
        let flat = CostModel::new("flat", 0.0, 0.0, 0.0, &[(1, 100.0), (300, 100.0)]).unwrap();
        let lp: Vec<f32> = (0..40).map(|i| -0.1 * i as f32).collect();
        // Free nodes: take all of them, up to the cap.
        assert_eq!(choose_budget(&lp, &flat, 256, None), 40);
        assert_eq!(choose_budget(&lp, &flat, 7, None), 7);
        assert_eq!(choose_budget(&[], &flat, 7, None), 0);
        assert_eq!(choose_budget(&lp, &flat, 0, None), 0);
        // Every extra token costs as much as a whole round: one node.
        let steep = CostModel::new("steep", 0.0, 0.0, 0.0, &[(1, 100.0), (2, 200.0)]).unwrap();
        assert_eq!(choose_budget(&lp, &steep, 256, None), 1);
        // A node is worth its cost when p > (E + 1) * slope / round: confident chain then a
        // tail of improbable nodes.
        let lin = CostModel::new("lin", 0.0, 0.0, 0.0, &[(1, 1000.0), (2, 1010.0)]).unwrap();
        let mut lp = vec![-0.05f32; 7];
        lp.extend([-6.0f32; 50]);
        assert_eq!(choose_budget(&lp, &lin, 256, None), 7);
        for seed in 0..50u64 {
            let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut acc = 0f32;
            let lp: Vec<f32> = (0..120)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    acc -= (x >> 40) as f32 / (1u64 << 24) as f32 * 0.3;
                    acc
                })
                .collect();
            for cost in [&table(), &lin, &CostModel::fallback()] {
                assert_eq!(
                    choose_budget(&lp, cost, 100, None),
                    brute(&lp, cost, 100),
                    "seed {seed}"
                );
            }
        }
    }

    /// A deterministic pseudo-random number in [-1, 1) for `i`.
    fn jitter(i: usize) -> f64 {
        let x = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let x = (x ^ (x >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        (x >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }

    /// A Kimi-shaped staircase measured at every length 1..=128: 20 ms up to 16 tokens, 3 ms
    /// more for each further 16-row tile, each point off by up to `noise` (relative).
    fn noisy_stairs(noise: f64) -> CostModel {
        let pts: Vec<(usize, f64)> = (1..=128)
            .map(|n: usize| {
                let tiles = n.div_ceil(16) as f64;
                (n, (17_000.0 + 3_000.0 * tiles) * (1.0 + noise * jitter(n)))
            })
            .collect();
        CostModel::new("noisy stairs", 2_000.0, 100.0, 100.0, &pts).unwrap()
    }

    #[test]
    fn the_verify_curve_is_made_non_decreasing() {
        let c = CostModel::new(
            "n",
            0.0,
            0.0,
            0.0,
            &[(4, 90.0), (1, 100.0), (8, 120.0), (16, 110.0), (32, 130.0)],
        )
        .unwrap();
        let us: Vec<f64> = c.verify.iter().map(|p| p.us).collect();
        assert_eq!(
            us,
            [90.0, 90.0, 110.0, 110.0, 130.0],
            "each point is the least at its size or above"
        );
        let mut again = c.verify.clone();
        monotone_envelope(&mut again);
        assert_eq!(again, c.verify, "idempotent");
        assert_eq!(c.verify_us(12), 110.0);
        // NaN and infinity are rejected, not hidden behind a smaller latency further on.
        assert!(CostModel::new("x", 1.0, 1.0, 1.0, &[(1, f64::INFINITY), (2, 5.0)]).is_err());
        assert!(CostModel::new("x", 1.0, 1.0, 1.0, &[(1, f64::NAN), (2, 5.0)]).is_err());
        // A round the envelope makes free is rejected.
        assert!(CostModel::new("x", 0.0, 0.0, 0.0, &[(1, 5.0), (8, 0.0)]).is_err());
        let mut nan = vec![
            VerifyPoint { tokens: 1, us: 3.0 },
            VerifyPoint {
                tokens: 2,
                us: f64::NAN,
            },
        ];
        monotone_envelope(&mut nan);
        assert!(nan[1].us.is_nan() && nan[0].us == 3.0, "{nan:?}");
    }

    #[test]
    fn an_old_noisy_cost_file_still_loads() {
        // The form `autotune --verify-cost` stored before the envelope: powers of two, a noisy
        // dip at 8 tokens (below 4) and one at 256.
        let old = r#"{
  "source": "measured verify on cuda (61 layers, hidden 7168, 48 routed experts), 1024-row cache; draft/build/accept 10/1/1% of one verify",
  "draft_us": 1820.5, "build_us": 182.05, "accept_us": 182.05,
  "verify": [
    {"tokens": 1, "us": 18205.0}, {"tokens": 2, "us": 18600.1}, {"tokens": 4, "us": 18710.9},
    {"tokens": 8, "us": 18650.3}, {"tokens": 16, "us": 22711.0}, {"tokens": 32, "us": 29010.4},
    {"tokens": 64, "us": 40200.0}, {"tokens": 128, "us": 61900.2}, {"tokens": 256, "us": 61000.0}
  ]
}"#;
        let c = CostModel::from_json(old).unwrap();
        assert_eq!(c.verify.len(), 9);
        assert_eq!((c.verify_us(4), c.verify_us(8)), (18650.3, 18650.3));
        assert_eq!((c.verify_us(128), c.verify_us(256)), (61000.0, 61000.0));
        assert!(c.verify.windows(2).all(|w| w[0].us <= w[1].us));
        assert_eq!(CostModel::from_json(&c.to_json()).unwrap(), c);
    }

    #[test]
    fn rises_below_the_tolerance_are_flat() {
        // 0.5% between 8 and 9 tokens, 12% at 17: 8 is inside the first stretch, 16 ends it.
        let c = CostModel::new(
            "c",
            0.0,
            0.0,
            0.0,
            &[
                (1, 20_000.0),
                (8, 20_000.0),
                (9, 20_100.0),
                (16, 20_100.0),
                (17, 22_500.0),
                (64, 22_500.0),
            ],
        )
        .unwrap();
        let lp = [-0.02f32; 40];
        assert_eq!(
            choose_budget(&lp[..10], &c, 256, None),
            10,
            "no top in range: every size competes"
        );
        assert_eq!(choose_budget(&lp[..20], &c, 256, None), 15);
        assert_eq!(choose_budget(&lp[..10], &c, 256, None), brute(&lp[..10], &c, 256));
        // 2% is a step: 8 ends a stretch.
        let c = CostModel::new(
            "c",
            0.0,
            0.0,
            0.0,
            &[(1, 20_000.0), (8, 20_000.0), (9, 20_400.0), (64, 20_400.0)],
        )
        .unwrap();
        assert_eq!(choose_budget(&lp[..10], &c, 256, None), 7);
        // A steady slope of 0.3% a token (of the first latency) ends a stretch every 4 lengths:
        // tops at 4, 8, 12, ... tokens, not at every length and not nowhere.
        let ramp = CostModel::new("ramp", 0.0, 0.0, 0.0, &[(1, 10_000.0), (101, 13_000.0)]).unwrap();
        let starts = stretch_starts(&ramp, 60);
        assert_eq!(&starts[..5], [1, 5, 9, 13, 17], "{starts:?}");
        for len in 5..40 {
            let b = choose_budget(&lp[..len], &ramp, 256, None);
            assert_eq!(b, brute(&lp[..len], &ramp, 256));
            assert!(starts.contains(&(b + 2)), "{len} nodes: {b} is no top ({starts:?})");
        }
    }

    #[test]
    fn on_a_noisy_staircase_only_stair_tops_compete() {
        let stairs = noisy_stairs(0.004);
        // Profiles of path probabilities: near-certain chains, geometric decays, a cliff, a
        // random walk, and nothing worth drafting.
        let mut profiles: Vec<Vec<f32>> = vec![
            vec![-0.001; 127],
            vec![-0.01; 127],
            (0..127).map(|i| -0.02 * i as f32).collect(),
            (0..127).map(|i| -0.05 * i as f32).collect(),
            (0..127).map(|i| -0.15 * i as f32).collect(),
            (0..127).map(|i| if i < 40 { -0.01 } else { -8.0 }).collect(),
            (0..127)
                .map(|i| -0.01 * i as f32 - 0.5 * jitter(i).abs() as f32 * (i as f32).sqrt())
                .collect(),
        ];
        for p in &mut profiles {
            // Best-first order: path log-probs never increase.
            for i in 1..p.len() {
                p[i] = p[i].min(p[i - 1]);
            }
        }
        let mut chosen = std::collections::BTreeSet::new();
        for (k, lp) in profiles.iter().enumerate() {
            for max in [20, 47, 64, 100, 127] {
                let b = choose_budget(lp, &stairs, max, None);
                assert_eq!(b, brute(lp, &stairs, max), "profile {k}, max {max}");
                assert_eq!(
                    (b + 1) % 16,
                    0,
                    "profile {k}, max {max}: {} tokens is no stair top",
                    b + 1
                );
                chosen.insert(b);
            }
        }
        assert!(chosen.len() >= 4, "the profiles reach several stairs: {chosen:?}");
        // Nothing worth drafting: the smallest stair top, the end of the cheapest stair.
        let tiny = vec![-20.0f32; 127];
        assert_eq!(choose_budget(&tiny, &stairs, 127, None), 15);
        // Without the tolerance, the noise inside a stair makes tops of lengths inside it.
        let strict_tops = (2..127)
            .filter(|&n| stairs.verify_us(n + 1) > stairs.verify_us(n) && n % 16 != 0)
            .count();
        assert!(strict_tops > 10, "the noise must matter: {strict_tops}");
    }

    #[test]
    fn a_top_is_within_the_tolerance_of_the_best_size() {
        for noise in [0.0, 0.004] {
            let stairs = noisy_stairs(noise);
            for seed in 0..50usize {
                let decay = 0.002 + 0.2 * (jitter(seed) + 1.0) / 2.0;
                let lp: Vec<f32> = (0..127).map(|i| -(decay * i as f64) as f32).collect();
                let rate =
                    |b: usize| (1.0 + lp[..b].iter().map(|&x| (x as f64).exp()).sum::<f64>()) / stairs.round_us(b);
                let best = (1..=127).map(rate).fold(0.0, f64::max);
                let b = choose_budget(&lp, &stairs, 127, None);
                assert!(rate(b) * (1.0 + FLAT_TOLERANCE) >= best, "seed {seed}: {b}");
            }
        }
    }

    /// A chain of `n` drafted nodes, each with edge probability `q`.
    fn chain(n: usize, q: f32) -> DraftTree {
        let words = (n + 1).div_ceil(32);
        DraftTree {
            token: (0..=n as u32).collect(),
            parent: (0..=n as i32).map(|i| i - 1).collect(),
            depth: (0..=n as u32).collect(),
            first_child: (0..=n as i32)
                .map(|i| if (i as usize) < n { i + 1 } else { -1 })
                .collect(),
            next_sibling: vec![-1; n + 1],
            mask: vec![0; (n + 1) * words],
            words,
            path_logprob: (0..=n).map(|i| i as f32 * q.ln()).collect(),
        }
    }

    #[test]
    fn calibration_starts_near_the_identity_and_learns_the_hit_rate() {
        let mut c = Calibration::default();
        for q in [0.01, 0.3, 0.85, 0.99] {
            let m = c.map(q);
            assert!((m.ln() - q.ln()).abs() < 0.6, "q {q}: {m}");
        }
        // An underconfident drafter: 85% edges that are always taken.
        let t = chain(15, 0.85);
        let all: Vec<u32> = (0..=15).collect();
        for _ in 0..20 {
            c.observe_round(&t, &all);
        }
        assert!(c.map(0.85) > 0.95, "{}", c.map(0.85));
        let lp = c.path_logprobs(&t);
        assert!(lp[15] > (0.5f32).ln(), "{lp:?}");
        // Then `auto` keeps the whole chain where the raw probabilities stop early.
        let cost = CostModel::new("t", 0.0, 0.0, 0.0, &[(1, 1000.0), (9, 1000.0), (17, 1400.0)]).unwrap();
        assert_eq!(choose_budget(&t.path_logprob[1..], &cost, 16, None), 8);
        assert_eq!(choose_budget(&lp[1..], &cost, 16, None), 15);
        // An overconfident one: 85% edges taken a third of the time.
        let mut c = Calibration::default();
        for r in 0..30 {
            let upto = if r % 3 == 0 { 1 } else { 0 };
            c.observe_round(&t, &all[..=upto]);
        }
        assert!(c.map(0.85) < 0.6, "{}", c.map(0.85));
    }
}
