//! The drafter's steps that the [`crate::Backend`] trait has no op for, computed on the host
//! over the block's few rows: masked (causal / sliding-window) attention, DFlash v2's grouped
//! dynamic causal convolution and candidate selector, and the logit transforms. Each is the
//! package's definition written out row by row; the backend ops around them stay on the device.

use crate::backend::{GqaDims, Matrix};
use crate::config::DFlashAttention;

/// The logit that tokens outside a position's candidates get from the v2 selector: far below
/// any score, so their probability is 0, yet finite so that tree path log-probs stay ordered
/// and their differences defined.
pub const NOT_A_CANDIDATE: f32 = -1.0e30;

/// One masked layer's keys and values, row by row (`kv_heads * head_dim` wide each).
#[derive(Debug, Default, Clone)]
pub(super) struct HostKv {
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
}

impl HostKv {
    pub fn rows(&self, width: usize) -> usize {
        self.keys.len() / width
    }

    pub fn append(&mut self, keys: &Matrix, values: &Matrix) {
        self.keys.extend_from_slice(&keys.data);
        self.values.extend_from_slice(&values.data);
    }

    pub fn truncate(&mut self, rows: usize, width: usize) {
        self.keys.truncate(rows * width);
        self.values.truncate(rows * width);
    }
}

/// Grouped-query attention of `q` (`[T, heads * head_dim]`) over the rows of `kv`, query `t`
/// at key index `first_query + t`, seeing only the keys `rule` lets it see.
pub(super) fn masked_attention(
    q: &Matrix,
    kv: &HostKv,
    dims: GqaDims,
    scale: f32,
    first_query: usize,
    rule: DFlashAttention,
) -> Matrix {
    let hd = dims.head_dim;
    let width = dims.kv_heads * hd;
    let n = kv.rows(width);
    let group = dims.heads / dims.kv_heads;
    let mut out = Matrix::zeros(q.rows, dims.heads * hd);
    let mut scores = vec![0.0f32; n];
    for t in 0..q.rows {
        let visible: Vec<usize> = (0..n).filter(|&k| rule.sees(first_query + t, k)).collect();
        for h in 0..dims.heads {
            let kvh = h / group * hd;
            let qh = &q.row(t)[h * hd..(h + 1) * hd];
            for &k in &visible {
                let key = &kv.keys[k * width + kvh..k * width + kvh + hd];
                scores[k] = qh.iter().zip(key).map(|(a, b)| a * b).sum::<f32>() * scale;
            }
            let max = visible.iter().map(|&k| scores[k]).fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for &k in &visible {
                scores[k] = (scores[k] - max).exp();
                sum += scores[k];
            }
            let o = &mut out.row_mut(t)[h * hd..(h + 1) * hd];
            for &k in &visible {
                let v = &kv.values[k * width + kvh..k * width + kvh + hd];
                let p = scores[k] / sum;
                o.iter_mut().zip(v).for_each(|(acc, v)| *acc += p * v);
            }
        }
    }
    out
}

/// DFlash v2's grouped dynamic causal convolution along the block's rows:
/// `out[t][c] = sum_{o < K, o <= t} (base[o][c] + dynamic[t][o][c / group]) * x[t - o][c]`.
/// `base` is `[K, hidden]` (one of the two halves of `base_kernel`), `dynamic` holds row `t`'s
/// `[K, hidden / group]` taps at `dynamic.row(t)[offset..]`.
pub(super) fn grouped_causal_conv(x: &Matrix, dynamic: &Matrix, offset: usize, base: &[f32], group: usize) -> Matrix {
    let (rows, hidden) = (x.rows, x.cols);
    let groups = hidden / group;
    let taps = base.len() / hidden;
    let mut out = Matrix::zeros(rows, hidden);
    for t in 0..rows {
        let dyn_t = &dynamic.row(t)[offset..offset + taps * groups];
        for o in 0..taps.min(t + 1) {
            let src = x.row(t - o).to_vec();
            let dst = out.row_mut(t);
            for (c, (acc, v)) in dst.iter_mut().zip(&src).enumerate() {
                *acc += (base[o * hidden + c] + dyn_t[o * groups + c / group]) * v;
            }
        }
    }
    out
}

/// `output_multiplier` then, when set, `c * tanh(logits / c)`, in place.
pub(super) fn transform_logits(logits: &mut Matrix, multiplier: f32, softcap: Option<f32>) {
    for x in &mut logits.data {
        *x *= multiplier;
        if let Some(c) = softcap {
            *x = (*x / c).tanh() * c;
        }
    }
}

/// The v2 candidate selector's codebooks (`[vocab, rank]` each, on the host).
pub(super) struct Codebooks {
    pub predecessor: Vec<f32>,
    pub successor: Vec<f32>,
    pub rank: usize,
    pub top_k: usize,
}

impl Codebooks {
    /// The selector's greedy pass: per position, the top-k logits as candidates, each scored
    /// `logit + sum_r predecessor[prev][r] * hidden[r] * successor[candidate][r]` where `prev` is
    /// the token chosen at the position before (the bonus `anchor` for the first) and `hidden`
    /// the position's projected hidden state; the best score is chosen. Returns the scores as
    /// logits `[positions, vocab]` ([`NOT_A_CANDIDATE`] off the candidates): the path the
    /// package proposes at temperature 0 is their row-wise argmax.
    pub fn select(&self, logits: &Matrix, projected: &Matrix, anchor: u32) -> Matrix {
        let (rank, vocab) = (self.rank, logits.cols);
        let mut out = Matrix {
            rows: logits.rows,
            cols: vocab,
            data: vec![NOT_A_CANDIDATE; logits.rows * vocab],
        };
        let mut prev = anchor as usize;
        for p in 0..logits.rows {
            let row = logits.row(p);
            let candidates = top_k(row, self.top_k);
            let pred = &self.predecessor[prev * rank..(prev + 1) * rank];
            let u: Vec<f32> = pred.iter().zip(projected.row(p)).map(|(a, b)| a * b).collect();
            let mut best = (f32::NEG_INFINITY, u32::MAX);
            for &c in &candidates {
                let succ = &self.successor[c as usize * rank..(c as usize + 1) * rank];
                let score = row[c as usize] + u.iter().zip(succ).map(|(a, b)| a * b).sum::<f32>();
                out.row_mut(p)[c as usize] = score;
                if score > best.0 || (score == best.0 && c < best.1) {
                    best = (score, c);
                }
            }
            prev = best.1 as usize;
        }
        out
    }
}

/// The `k` largest entries' indices (equal values: smaller index first).
fn top_k(row: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    let better = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k, better);
        idx.truncate(k);
    }
    idx.sort_by(better);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_conv_only_looks_back() {
        // Two taps, one group of 2 channels: out[t] = (b0 + d0) x[t] + (b1 + d1) x[t-1].
        let x = Matrix {
            rows: 3,
            cols: 2,
            data: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        };
        let dynamic = Matrix {
            rows: 3,
            cols: 2,
            data: vec![0.5, 0.25, 0.0, 0.0, 1.0, 1.0],
        };
        let base = [1.0, 1.0, 2.0, 2.0];
        let out = grouped_causal_conv(&x, &dynamic, 0, &base, 2);
        assert_eq!(out.data, vec![1.5, 3.0, 5.0, 8.0, 19.0, 24.0]);
    }

    #[test]
    fn masks_follow_the_package_rule() {
        let causal_window = DFlashAttention {
            causal: true,
            sliding_window: Some(3),
        };
        assert!(causal_window.sees(5, 3) && !causal_window.sees(5, 2) && !causal_window.sees(5, 6));
        let window = DFlashAttention {
            causal: false,
            sliding_window: Some(2),
        };
        assert!(window.sees(5, 6) && !window.sees(5, 7) && !window.sees(5, 3));
        assert!(DFlashAttention::FULL.sees(0, 100));
    }

    #[test]
    fn top_k_breaks_ties_by_index() {
        assert_eq!(top_k(&[1.0, 3.0, 3.0, 0.0, 2.0], 3), vec![1, 2, 4]);
    }
}
