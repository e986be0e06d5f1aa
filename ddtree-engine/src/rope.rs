//! Rotary position embedding (plain or YaRN) as HF `DeepseekV3` computes it.

use crate::config::{ModelConfig, RopeConfig, YarnConfig};

/// Precomputed rotary frequencies for the `qk_rope_head_dim` part of queries and keys.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    inv_freq: Vec<f32>,
    attention_factor: f32,
    interleave: bool,
}

/// YaRN's magnitude correction `0.1 * mscale * ln(scale) + 1` (1 for `scale <= 1`).
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl Rope {
    /// Frequencies for `cfg` (HF `_compute_default_rope_parameters` / `_compute_yarn_parameters`).
    pub fn new(cfg: &ModelConfig) -> Self {
        Self::from_parts(cfg.qk_rope_head_dim, &cfg.rope)
    }

    /// Frequencies for rotating `dim` values with the settings `rope` (theta, YaRN, pair layout).
    pub fn from_parts(dim: usize, rope: &RopeConfig) -> Self {
        let base = rope.theta;
        let pos_freqs: Vec<f64> = (0..dim / 2).map(|i| base.powf((2 * i) as f64 / dim as f64)).collect();
        let (inv_freq, attention_factor) = match &rope.yarn {
            None => (pos_freqs.iter().map(|p| 1.0 / p).collect(), 1.0),
            Some(y) => yarn_inv_freq(y, &pos_freqs, dim, base),
        };
        Self {
            inv_freq: inv_freq.into_iter().map(|f: f64| f as f32).collect(),
            attention_factor: attention_factor as f32,
            interleave: rope.interleave,
        }
    }

    /// Number of values one rotation covers (twice the number of frequencies).
    pub fn dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// The softmax scale of MLA attention: `qk_head_dim^-0.5`, times `mscale(factor,
    /// mscale_all_dim)^2` under YaRN when `mscale_all_dim` is set.
    pub fn softmax_scale(cfg: &ModelConfig) -> f32 {
        let base = (cfg.qk_head_dim() as f64).powf(-0.5);
        let m = match &cfg.rope.yarn {
            Some(YarnConfig {
                factor,
                mscale_all_dim: Some(all),
                ..
            }) => yarn_mscale(*factor, *all),
            _ => 1.0,
        };
        (base * m * m) as f32
    }

    /// Whether pairs are adjacent `(2i, 2i+1)` (else `(i, i + d/2)`).
    pub fn interleaved(&self) -> bool {
        self.interleave
    }

    /// `cos` and `sin` tables `[positions, dim / 2]` with the attention factor folded in, computed
    /// exactly as [`Rope::apply`] does (the GPU kernels read them).
    pub fn tables(&self, positions: usize) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let (mut cos, mut sin) = (
            Vec::with_capacity(positions * half),
            Vec::with_capacity(positions * half),
        );
        for p in 0..positions {
            for &f in &self.inv_freq {
                let angle = f * p as f32;
                cos.push(angle.cos() * self.attention_factor);
                sin.push(angle.sin() * self.attention_factor);
            }
        }
        (cos, sin)
    }

    /// Rotates `x` (one head's `qk_rope_head_dim` values) to `position` in place.
    ///
    /// Interleaved mode rotates adjacent pairs `(2i, 2i+1)` by frequency `i`; otherwise pairs
    /// `(i, i + d/2)`. Queries and keys use the same layout, so their dot products match HF's.
    pub fn apply(&self, x: &mut [f32], position: u32) {
        let half = self.inv_freq.len();
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let angle = f * position as f32;
            let (cos, sin) = (angle.cos() * self.attention_factor, angle.sin() * self.attention_factor);
            let (a, b) = if self.interleave {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            let (x0, x1) = (x[a], x[b]);
            x[a] = x0 * cos - x1 * sin;
            x[b] = x1 * cos + x0 * sin;
        }
    }
}

fn yarn_inv_freq(y: &YarnConfig, pos_freqs: &[f64], dim: usize, base: f64) -> (Vec<f64>, f64) {
    let attention_factor = y.attention_factor.unwrap_or(match (y.mscale, y.mscale_all_dim) {
        (Some(m), Some(all)) => yarn_mscale(y.factor, m) / yarn_mscale(y.factor, all),
        _ => yarn_mscale(y.factor, 1.0),
    });
    let original = y.original_max_position_embeddings as f64;
    let correction_dim =
        |rotations: f64| dim as f64 * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
    let (mut low, mut high) = (correction_dim(y.beta_fast), correction_dim(y.beta_slow));
    if y.truncate {
        low = low.floor();
        high = high.ceil();
    }
    let low = low.max(0.0);
    let mut high = high.min(dim as f64 - 1.0);
    if low == high {
        high += 0.001;
    }
    let inv_freq = pos_freqs
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation = 1.0 - ramp;
            let (extra, inter) = (1.0 / p, 1.0 / (y.factor * p));
            inter * (1.0 - extrapolation) + extra * extrapolation
        })
        .collect();
    (inv_freq, attention_factor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kimi_softmax_scale_includes_yarn_mscale_squared() {
        // The reference notes measured HF's `attn.scaling` = 0.35439 for this tiny config
        // (qk_head_dim 32, YaRN factor 64, mscale_all_dim 1).
        let cfg = crate::tiny::kimi::config().unwrap();
        assert!((Rope::softmax_scale(&cfg) - 0.35439).abs() < 1e-5);
        let rope = Rope::new(&cfg);
        assert_eq!(rope.attention_factor, 1.0, "mscale / mscale_all_dim = 1 for Kimi");
        assert_eq!(rope.inv_freq[0], 1.0, "the fastest frequency is extrapolated");
    }

    #[test]
    fn rotation_preserves_norm_and_relative_position() {
        let rope = Rope {
            inv_freq: vec![1.0, 0.1],
            attention_factor: 1.0,
            interleave: true,
        };
        let (mut q, mut k) = ([0.3f32, -1.2, 0.7, 0.5], [1.1f32, 0.4, -0.2, 0.9]);
        let (q0, k0) = (q, k);
        rope.apply(&mut q, 7);
        rope.apply(&mut k, 3);
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        assert!((dot(&q, &q) - dot(&q0, &q0)).abs() < 1e-5);
        let (mut q2, mut k2) = (q0, k0);
        rope.apply(&mut q2, 14);
        rope.apply(&mut k2, 10);
        assert!(
            (dot(&q, &k) - dot(&q2, &k2)).abs() < 1e-5,
            "scores depend only on the offset"
        );
    }
}
