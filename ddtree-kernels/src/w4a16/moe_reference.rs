//! CPU reference of the routed-expert block's two stages ([`super::moe`]).

use super::layout::PackedInt4;

/// CPU references of the routed-expert block's two GEMM stages, each from the stage's own
/// input so that a bf16 rounding that flips between the kernels and the CPU (f32 summation
/// order) cannot propagate into the next stage: `gate_up` returns the SiLU-and-mul activation
/// `[pairs, I]` from `x` `[T, H]`, `down` the router-weighted `[pairs, H]` from `act` `[pairs, I]`
/// (the kernels' `act`). Both are f32 before the kernels' bf16 rounding; rows of pairs whose
/// expert is not local (`ids >= experts`) are zero.
///
/// Each weight row of a routed expert is dequantized once and dotted with the inputs of every
/// pair routed to that expert; slabs of rows run in parallel, and each dot product sums in f32
/// over eight strided partial sums (within the f32 summation order the tolerance allows). The
/// work is [`reference_stage_macs`] multiply-adds.
pub fn reference_stage(x: &[f32], ids: &[u32], topk: usize, w: &PackedInt4, route: Option<&[f32]>) -> Vec<f32> {
    use rayon::prelude::*;
    /// Output columns per work item.
    const SLAB: usize = 64;
    let (n, k) = (w.n, w.k);
    let cols = if route.is_some() { n } else { n / 2 };
    let mut pairs_of = vec![Vec::new(); w.experts];
    for (pr, &e) in ids.iter().enumerate() {
        if let Some(p) = pairs_of.get_mut(e as usize) {
            p.push(pr);
        }
    }
    let items: Vec<(usize, usize)> = (0..w.experts)
        .filter(|&e| !pairs_of[e].is_empty())
        .flat_map(|e| (0..cols).step_by(SLAB).map(move |c0| (e, c0)))
        .collect();
    let width = |c0: usize| (c0 + SLAB).min(cols) - c0;
    let slabs: Vec<Vec<f32>> = items
        .par_iter()
        .map(|&(e, c0)| {
            let prs = &pairs_of[e];
            let wd = width(c0);
            let mut rows = vec![0f32; 2 * k];
            let (r0, r1) = rows.split_at_mut(k);
            let mut vals = vec![0f32; prs.len() * wd];
            for c in c0..c0 + wd {
                w.dequantize_row_bf16(e * n + c, r0);
                if route.is_none() {
                    w.dequantize_row_bf16(e * n + cols + c, r1);
                }
                for (i, &pr) in prs.iter().enumerate() {
                    let row = if route.is_some() { pr } else { pr / topk };
                    let xr = &x[row * k..(row + 1) * k];
                    vals[i * wd + c - c0] = match route {
                        Some(wts) => dot(xr, r0) * wts[pr],
                        None => {
                            let (g, u) = (dot(xr, r0), dot(xr, r1));
                            g / (1.0 + (-g).exp()) * u
                        }
                    };
                }
            }
            vals
        })
        .collect();
    let mut out = vec![0f32; ids.len() * cols];
    for (&(e, c0), vals) in items.iter().zip(&slabs) {
        let wd = width(c0);
        for (i, &pr) in pairs_of[e].iter().enumerate() {
            out[pr * cols + c0..pr * cols + c0 + wd].copy_from_slice(&vals[i * wd..(i + 1) * wd]);
        }
    }
    out
}

/// Multiply-adds of one [`reference_stage`] call over `local_pairs` pairs whose expert is local,
/// with `w`'s shape `[n, k]`: every pair's dot products, plus the dequantization of the
/// `touched` experts' weights (counted as one multiply-add per weight).
pub fn reference_stage_macs(local_pairs: usize, touched: usize, n: usize, k: usize) -> u64 {
    (local_pairs * n * k + touched * n * k) as u64
}

/// `a . b` in f32 over eight strided partial sums (vectorizable; `a` and `b` the same length).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    acc.iter().sum::<f32>() + tail
}
