//! How a token is chosen from the target's logits: greedy, or temperature + top-p sampling.
//!
//! Sampling is Gumbel-max with the counter-based noise of the DDTree kernels
//! ([`ddtree_kernels::tree::reference::gumbel_score`]), keyed by `(seed, position, token)` where
//! `position` is the position of the token whose output row is sampled (the kernel's seed
//! argument gets `fmix32(fmix32(seed) ^ position * 0x9e3779b9)`, its row argument the position). The noise therefore does
//! not depend on how tokens are grouped into forwards: plain decoding and tree verification draw
//! the same token from the same logits. In a tree, siblings (same position) share the noise, and
//! the accept walk visits one node per depth, so every emitted token is still a fresh, exact
//! sample from the target's conditional distribution: speculative sampling is lossless, and on a
//! backend whose tree logits equal its sequential logits it is even token-for-token identical to
//! plain sampling with the same seed.

use ddtree_kernels::tree::reference::{fmix32, gumbel_score, order_key};

use crate::error::{EngineError, Result};

/// Token choice settings. The default is greedy decoding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Softmax temperature; `0` is greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling: keep the most likely tokens until their probability reaches `top_p`
    /// (`1` keeps every token).
    pub top_p: f32,
    /// Seed of the sampling noise.
    pub seed: u32,
}

impl Default for Sampling {
    fn default() -> Self {
        Self::greedy()
    }
}

/// Index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampling {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }

    /// Whether this is greedy decoding.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks the settings: a finite temperature `>= 0` and `0 < top_p <= 1`.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(EngineError::Forward(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(EngineError::Forward(format!(
                "top-p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }

    /// The token chosen from `logits`, the output row of the token at `position`.
    pub fn choose(&self, logits: &[f32], position: u32) -> u32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        // The user seed and the position are mixed non-linearly first: with the raw seed, the
        // noise of two positions differs by a fixed XOR pattern across seeds, which showed up as
        // correlated draws over consecutive small seeds.
        let key = fmix32(fmix32(self.seed) ^ position.wrapping_mul(0x9e37_79b9));
        let score = |i: usize| gumbel_score(logits[i], self.temperature, key, position, i as u32);
        let best = |candidates: &mut dyn Iterator<Item = usize>| {
            candidates
                .map(|i| (order_key(score(i)), std::cmp::Reverse(i)))
                .max()
                .map_or(0, |(_, std::cmp::Reverse(i))| i as u32)
        };
        if self.top_p >= 1.0 {
            return best(&mut (0..logits.len()));
        }
        best(&mut self.nucleus(logits).into_iter())
    }

    /// The smallest set of most likely tokens (ties: smaller id first) whose probability under
    /// `softmax(logits / temperature)` reaches `top_p`.
    fn nucleus(&self, logits: &[f32]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| order_key(logits[b]).cmp(&order_key(logits[a])).then(a.cmp(&b)));
        let max = logits[order[0]] as f64;
        let t = self.temperature as f64;
        let weights: Vec<f64> = order.iter().map(|&i| ((logits[i] as f64 - max) / t).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut mass = 0.0;
        let keep = weights
            .iter()
            .position(|w| {
                mass += w / total;
                mass >= self.top_p as f64
            })
            .map_or(order.len(), |k| k + 1);
        order.truncate(keep);
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_first_argmax_and_top_p_restricts_to_the_nucleus() {
        let logits = [0.5f32, 2.0, 2.0, -1.0];
        assert_eq!(Sampling::greedy().choose(&logits, 3), 1);
        let nucleus = Sampling {
            temperature: 1.0,
            top_p: 0.5,
            seed: 9,
        };
        // p = [0.094, 0.42, 0.42, 0.021]: the nucleus of 0.5 is tokens 1 and 2.
        assert_eq!(nucleus.nucleus(&logits), vec![1, 2]);
        for position in 0..200 {
            assert!(matches!(nucleus.choose(&logits, position), 1 | 2));
        }
        assert!(Sampling { top_p: 0.0, ..nucleus }.validate().is_err());
        assert!(Sampling {
            temperature: -1.0,
            ..nucleus
        }
        .validate()
        .is_err());
        assert!(nucleus.validate().is_ok());
    }

    #[test]
    fn sampling_frequencies_follow_the_softmax() {
        // 20000 draws over positions; chi-square with 3 degrees of freedom, p = 1e-4 cut-off 21.1.
        let logits = [1.0f32, 0.0, -0.5, 0.7];
        let s = Sampling {
            temperature: 0.8,
            top_p: 1.0,
            seed: 1234,
        };
        let z: f64 = logits.iter().map(|&x| (x as f64 / 0.8).exp()).sum();
        let n = 20_000;
        let mut counts = [0usize; 4];
        for position in 0..n {
            counts[s.choose(&logits, position as u32) as usize] += 1;
        }
        let chi2: f64 = (0..4)
            .map(|i| {
                let expected = n as f64 * (logits[i] as f64 / 0.8).exp() / z;
                (counts[i] as f64 - expected).powi(2) / expected
            })
            .sum();
        assert!(chi2 < 21.1, "chi2 = {chi2}, counts {counts:?}");
    }
}
