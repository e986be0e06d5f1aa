//! Host side of the INT4 formats: the compressed-tensors `pack-quantized` checkpoint layout,
//! Kimi's quantizer, the CPU model of the interleaved repack, and the f32 reference GEMM.
//!
//! Checkpoint rule (compressed-tensors `pack_to_int32`): `weight_packed` is int32 `[N, K/8]`,
//! element `8m + j` of a row sits in bits `[4j, 4j + 4)` of word `m`, stored as the unsigned
//! nibble `q + 8`; `weight_scale` is bf16 `[N, K/group]`; `w[r, k] = q * scale[r, k / group]`.

use ddtree_macros::{kernel, KernelParams};
use half::bf16;

/// Words per interleaved tile: 8 rows x 128 k = 32 lanes x 4 words.
pub const TILE_WORDS: usize = 128;

/// Nibble position of element `j` (0..8) of a word in the interleaved order: the word holds
/// elements `0, 2, 4, 6, 1, 3, 5, 7` at nibbles `0..8`, so nibbles `(i, i + 4)` are the
/// consecutive elements `(2i, 2i + 1)` that one lop3 turns into a bf16 pair.
pub const INTERLEAVED_POS: [u32; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// One INT4 matrix (or a stack of `experts` matrices) in the checkpoint layout.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedInt4 {
    /// `weight_packed` as u32 words, `[experts * n, k / 8]`.
    pub packed: Vec<u32>,
    /// `weight_scale`, `[experts * n, k / group]`.
    pub scales: Vec<bf16>,
    /// Output rows per expert (`weight_shape[0]`).
    pub n: usize,
    /// Input columns (`weight_shape[1]`); a multiple of 32 and of `group`.
    pub k: usize,
    /// Group size along K.
    pub group: usize,
    /// Number of stacked matrices (1 for a dense layer).
    pub experts: usize,
}

/// Packs signed codes `q` (row-major `[rows, k]`, each in -8..=7) into checkpoint words.
pub fn pack(q: &[i8], k: usize) -> Vec<u32> {
    assert!(k % 8 == 0 && q.len() % k == 0, "pack: k must be a multiple of 8");
    q.chunks(8)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u32, |w, (j, &v)| w | (((v as i32 + 8) as u32 & 0xf) << (4 * j)))
        })
        .collect()
}

/// Inverse of [`pack`]: signed codes of every element.
pub fn unpack(packed: &[u32]) -> Vec<i8> {
    packed
        .iter()
        .flat_map(|&w| (0..8).map(move |j| ((w >> (4 * j)) & 0xf) as i8 - 8))
        .collect()
}

/// Kimi's QAT rule for one group, as compressed-tensors computes it on bf16 tensors:
/// `scale = bf16(amax / 7)`, `q = clamp(round_half_even(bf16(w / scale)), -7, 7)`. An all-zero
/// group gets scale 0 and codes 0.
fn quantize_group(w: &[f32]) -> (bf16, Vec<i8>) {
    let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = bf16::from_f32(amax / 7.0);
    let s = scale.to_f32();
    let code = |v: f32| bf16::from_f32(v / s).to_f32().round_ties_even().clamp(-7.0, 7.0) as i8;
    (scale, w.iter().map(|&v| if s == 0.0 { 0 } else { code(v) }).collect())
}

/// Quantizes bf16 weights `[experts * n, k]` to INT4 with per-`group` bf16 scales (Kimi's rule,
/// see [`PackedInt4`]).
pub fn quantize(w: &[bf16], n: usize, k: usize, group: usize, experts: usize) -> PackedInt4 {
    assert!(
        k % 32 == 0 && k % group == 0 && w.len() == experts * n * k,
        "quantize: bad shape"
    );
    let mut q = Vec::with_capacity(w.len());
    let mut scales = Vec::with_capacity(w.len() / group);
    for g in w.chunks(group) {
        let f: Vec<f32> = g.iter().map(|v| v.to_f32()).collect();
        let (s, qs) = quantize_group(&f);
        scales.push(s);
        q.extend(qs);
    }
    PackedInt4 {
        packed: pack(&q, k),
        scales,
        n,
        k,
        group,
        experts,
    }
}

impl PackedInt4 {
    /// Random codes in -7..=7 and random positive scales: test and bench data.
    pub fn random(rng: &mut impl rand::Rng, n: usize, k: usize, group: usize, experts: usize, scale_max: f32) -> Self {
        assert!(
            k % 32 == 0 && k % group == 0,
            "random: k must be a multiple of 32 and of the group"
        );
        let q: Vec<i8> = (0..experts * n * k).map(|_| rng.random_range(-7i8..=7)).collect();
        let scales = (0..experts * n * k / group)
            .map(|_| bf16::from_f32(rng.random_range(0.1 * scale_max..scale_max)))
            .collect();
        PackedInt4 {
            packed: pack(&q, k),
            scales,
            n,
            k,
            group,
            experts,
        }
    }

    /// Dequantized weights in f32, `[experts * n, k]` (exact: code times bf16 scale).
    pub fn dequantize(&self) -> Vec<f32> {
        unpack(&self.packed)
            .iter()
            .enumerate()
            .map(|(i, &q)| q as f32 * self.scales[i / self.group].to_f32())
            .collect()
    }

    /// The weights the GEMM multiplies, `[experts * n, k]`: `bf16(q * scale)`, rounded to
    /// nearest even as its `fma.rn.bf16x2` dequantization does before the bf16 mma.
    pub fn dequantize_bf16(&self) -> Vec<f32> {
        self.dequantize().iter().map(|&v| bf16::from_f32(v).to_f32()).collect()
    }

    /// Row `row` (of the `experts * n` rows) of [`PackedInt4::dequantize_bf16`] into `out`
    /// (`k` values), without dequantizing the other rows.
    pub fn dequantize_row_bf16(&self, row: usize, out: &mut [f32]) {
        let (kw, gpr) = (self.k / 8, self.k / self.group);
        let words = &self.packed[row * kw..(row + 1) * kw];
        let scales = &self.scales[row * gpr..(row + 1) * gpr];
        for (c, o) in out[..self.k].iter_mut().enumerate() {
            let q = ((words[c / 8] >> (4 * (c % 8))) & 0xf) as i32 - 8;
            *o = bf16::from_f32(q as f32 * scales[c / self.group].to_f32()).to_f32();
        }
    }

    /// Bytes the kernels read for weights and scales of one expert.
    pub fn bytes_per_expert(&self) -> usize {
        self.n * self.k / 2 + self.n * self.k / self.group * 2
    }
}

/// The bf16 scales as the u32 words the GEMM reads: scale `2i` in the low half of word `i`,
/// `2i + 1` in the high half (the bytes of the bf16 tensor, padded to a whole word).
pub fn scale_words(scales: &[bf16]) -> Vec<u32> {
    scales
        .chunks(2)
        .map(|c| c[0].to_bits() as u32 | (c.get(1).map_or(0, |h| h.to_bits()) as u32) << 16)
        .collect()
}

/// Words of one expert in the interleaved tiled layout (`n` padded to 8 rows, `k` to 128).
pub fn interleaved_words(n: usize, k: usize) -> usize {
    n.div_ceil(8) * k.div_ceil(128) * TILE_WORDS
}

/// CPU model of the GPU repack into the interleaved layout: tile `(n / 8, k / 128)` of each
/// expert holds 32 lanes x 4 words; lane `(g, q)` = `(lane / 4, lane % 4)` word `j` is checkpoint
/// word `k/8 = 16 kb + 4q + j` of row `8 t + g`, nibbles in [`INTERLEAVED_POS`] order. Padding
/// words hold code 0 (`0x88888888`).
pub fn repack_interleaved(p: &PackedInt4) -> Vec<u32> {
    let (n, kw) = (p.n, p.k / 8);
    let per = interleaved_words(n, p.k);
    let kb_n = p.k.div_ceil(128);
    let mut out = vec![0u32; per * p.experts];
    for (i, o) in out.iter_mut().enumerate() {
        let (e, r) = (i / per, i % per);
        let (tile, rest) = (r / (kb_n * TILE_WORDS), r % (kb_n * TILE_WORDS));
        let (kb, lane, j) = (rest / TILE_WORDS, (rest % TILE_WORDS) / 4, rest % 4);
        let (row, word) = (tile * 8 + lane / 4, kb * 16 + (lane % 4) * 4 + j);
        *o = if row < n && word < kw {
            interleave_word(p.packed[(e * n + row) * kw + word])
        } else {
            0x8888_8888
        };
    }
    out
}

/// Moves element `j` of a checkpoint word to nibble [`INTERLEAVED_POS`]`[j]`.
pub fn interleave_word(w: u32) -> u32 {
    (0..8).fold(0, |acc, j| {
        acc | (((w >> (4 * j)) & 0xf) << (4 * INTERLEAVED_POS[j as usize]))
    })
}

/// Words of one fragment block of [`super::gemm_sk`]: a 64-row unit's k128 chunk, 1024 words of
/// packed weights and 128 of scales (4608 bytes).
pub const FRAG_BLOCK_WORDS: usize = 1152;

/// Words of one matrix in fragment blocks (`ceil(n / 64)` units of `ceil(k / 128)` chunks).
pub fn fragment_words(n: usize, k: usize) -> usize {
    n.div_ceil(64) * k.div_ceil(128) * FRAG_BLOCK_WORDS
}

/// The fragment blocks [`super::W4a16GemmSk`] copies whole: block `(u, c)` (rows `64 u ..`,
/// k `128 c ..`) at `(u kbs + c) 1152` words. Word `8 t + s` (`t` a warpgroup thread: warp
/// `t / 32`, `g = lane / 4`, `q = lane % 4`; `s` the k16 step) holds the thread's `wgmma` A
/// fragment of step `s`: rows `r0 = 16 (t / 32) + g` and `r1 = r0 + 8`, elements `(r0, 2q)`,
/// `(r0, 2q + 1)`, `(r1, 2q)`, `(r1, 2q + 1)`, `(r0, 2q + 8)`, `(r0, 2q + 9)`, `(r1, 2q + 8)`,
/// `(r1, 2q + 9)` of the step, pair `i` of them at nibbles `(i, i + 4)` (stored `q + 8`). Words
/// `1024 + 4 p ..` (`p = 8 (t / 32) + g`) hold the bf16 scales of the chunk's four k32 groups
/// of row `r0` (two words, low half first), then of `r1`. Past N or K: code 0, scale 0.
/// Dense matrices only (`experts == 1`).
pub fn repack_fragment(p: &PackedInt4) -> Vec<u32> {
    assert_eq!(p.experts, 1, "repack_fragment: dense matrices only");
    let (n, k, kw, gpr) = (p.n, p.k, p.k / 8, p.k / p.group);
    let kbs = k.div_ceil(128);
    let nib = |row: usize, col: usize| -> u32 {
        if row < n && col < k {
            (p.packed[row * kw + col / 8] >> (4 * (col % 8))) & 0xf
        } else {
            8
        }
    };
    let scale = |row: usize, col: usize| -> u32 {
        if row < n && col < k {
            p.scales[row * gpr + col / p.group].to_bits() as u32
        } else {
            0
        }
    };
    let mut out = vec![0u32; fragment_words(n, k)];
    for (b, blk) in out.chunks_mut(FRAG_BLOCK_WORDS).enumerate() {
        let (u, c) = (b / kbs, b % kbs);
        for (w, word) in blk.iter_mut().enumerate() {
            *word = if w < 1024 {
                let (t, s) = (w / 8, w % 8);
                let (lane, r0) = (t % 32, 64 * u + 16 * (t / 32) + (t % 32) / 4);
                let (q, kb) = (lane % 4, 128 * c + 16 * s);
                let el = [
                    (r0, kb + 2 * q),
                    (r0, kb + 2 * q + 1),
                    (r0 + 8, kb + 2 * q),
                    (r0 + 8, kb + 2 * q + 1),
                    (r0, kb + 2 * q + 8),
                    (r0, kb + 2 * q + 9),
                    (r0 + 8, kb + 2 * q + 8),
                    (r0 + 8, kb + 2 * q + 9),
                ];
                (0..4).fold(0, |acc, i| {
                    let (lo, hi) = (el[2 * i], el[2 * i + 1]);
                    acc | nib(lo.0, lo.1) << (4 * i) | nib(hi.0, hi.1) << (4 * i + 16)
                })
            } else {
                let (pr, j) = ((w - 1024) / 4, (w - 1024) % 4);
                let row = 64 * u + 16 * (pr / 8) + pr % 8 + 8 * (j / 2);
                let g0 = 128 * c + 64 * (j % 2);
                scale(row, g0) | scale(row, g0 + 32) << 16
            };
        }
    }
    out
}

/// Compile-time parameters of [`W4a16Repack`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct RepackParams {
    /// Threads per block.
    pub block: u32,
}

/// GPU repack at load time: checkpoint words `src` (`[experts * n, k / 8]`) into the
/// interleaved tiled layout `dst` (`experts * interleaved_words(n, k)` words), exactly as
/// [`repack_interleaved`]. Any grid: the kernel strides over the output words.
#[kernel(block = p.block, space = [RepackParams { block: 256 }])]
pub fn w4a16_repack(#[comptime] p: &RepackParams, src: &[u32], dst: &mut [u32], n: u32, k: u32, experts: u32) {
    let kw = k / 8;
    let kbs = (k + 127u32) / 128u32;
    let per = (n + 7u32) / 8u32 * kbs * 128u32;
    let stride = grid_dim_x() * p.block;
    for i in (block_idx_x() * p.block + thread_idx_x()..experts * per).step_by(stride) {
        let e = i / per;
        let r = i % per;
        let tile = r / (kbs * 128);
        let rest = r % (kbs * 128);
        let lane = (rest % 128) / 4;
        let row = tile * 8 + lane / 4;
        let word = (rest / 128) * 16 + (lane % 4) * 4 + rest % 4;
        let mut v = 0x8888_8888u32;
        if row < n && word < kw {
            let x = src[(e * n + row) * kw + word];
            v = 0u32;
            #[unroll]
            for t in 0..8u32 {
                v |= ((x >> (4 * t)) & 0xfu32) << (4 * (t / 2 + 4 * (t % 2)));
            }
        }
        dst[i] = v;
    }
}

/// GPU repack at load time into the fragment blocks of [`super::W4a16GemmSk`], exactly as
/// [`repack_fragment`]: checkpoint words `src` (`[n, k / 8]`) and the scale words of
/// [`scale_words`] (`[n, k / group]` bf16) into `dst` ([`fragment_words`]`(n, k)` words). Any
/// grid: the kernel strides over the output words.
#[kernel(block = p.block, space = [RepackParams { block: 256 }])]
pub fn w4a16_repack_fragment(
    #[comptime] p: &RepackParams,
    src: &[u32],
    scales: &[u32],
    dst: &mut [u32],
    n: u32,
    k: u32,
    group: u32,
) {
    let kw = k / 8;
    let gpr = k / group;
    let kbs = (k + 127u32) / 128u32;
    let total = (n + 63u32) / 64u32 * kbs * 1152u32;
    let stride = grid_dim_x() * p.block;
    for i in (block_idx_x() * p.block + thread_idx_x()..total).step_by(stride) {
        let b = i / 1152;
        let w = i % 1152;
        let u = b / kbs;
        let c = b % kbs;
        let mut v = 0u32;
        if w < 1024 {
            // Thread `t`'s word of k16 step `s`: element `e` (register e / 2, rows r0 / r0 + 8 by
            // its parity, k + 8 for registers 2-3) at nibble e / 2, or e / 2 + 4 for odd `e`.
            let t = w / 8;
            let lane = t % 32;
            let r0 = 64 * u + 16 * (t / 32) + lane / 4;
            let kb = 128 * c + 16 * (w % 8) + 2 * (lane % 4);
            #[unroll]
            for e in 0..8u32 {
                let reg = e / 2;
                let row = r0 + 8 * (reg % 2);
                let col = kb + 8 * (reg / 2) + e % 2;
                let mut nib = 8u32;
                if row < n && col < k {
                    nib = (src[row * kw + col / 8] >> (4 * (col % 8))) & 0xfu32;
                }
                v |= nib << (4 * reg + 16 * (e % 2));
            }
        } else {
            // Scale word `j` of row pair `pr`: groups (2 (j % 2), + 1) of row g + 8 (j / 2).
            let pr = (w - 1024) / 4;
            let j = (w - 1024) % 4;
            let row = 64 * u + 16 * (pr / 8) + pr % 8 + 8 * (j / 2);
            #[unroll]
            for h in 0..2u32 {
                let col = 128 * c + 64 * (j % 2) + 32 * h;
                if row < n && col < k {
                    let si = row * gpr + col / group;
                    v |= ((scales[si / 2] >> (16 * (si % 2))) & 0xffffu32) << (16 * h);
                }
            }
        }
        dst[i] = v;
    }
}

/// CPU reference GEMM: `a` `[m, k]` times `w` `[n, k]` transposed, in f32.
pub fn matmul(a: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        let ar = &a[i * k..(i + 1) * k];
        for j in 0..n {
            c[i * n + j] = ar.iter().zip(&w[j * k..(j + 1) * k]).map(|(x, y)| x * y).sum();
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn dequantized_rows_match_the_whole_matrix(seed in 0u64..1000, group_i in 0usize..3) {
            use rand::SeedableRng;
            let group = [32, 64, 128][group_i];
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let p = PackedInt4::random(&mut rng, 5, 256, group, 2, 1.0);
            let all = p.dequantize_bf16();
            let mut row = vec![0f32; p.k];
            for r in 0..p.experts * p.n {
                p.dequantize_row_bf16(r, &mut row);
                prop_assert_eq!(&row[..], &all[r * p.k..(r + 1) * p.k]);
            }
        }

        #[test]
        fn pack_unpack_round_trip(q in prop::collection::vec(-8i8..=7, 8..256)) {
            let k = q.len() / 8 * 8;
            let q = &q[..k];
            prop_assert_eq!(unpack(&pack(q, k)), q.to_vec());
        }

        #[test]
        fn quantized_codes_stay_in_range_and_dequantize_near(vals in prop::collection::vec(-4.0f32..4.0, 64)) {
            let w: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
            let p = quantize(&w, 2, 32, 32, 1);
            prop_assert!(unpack(&p.packed).iter().all(|&q| (-7..=7).contains(&q)));
            let d = p.dequantize();
            for (g, s) in p.scales.iter().enumerate() {
                for i in g * 32..(g + 1) * 32 {
                    // Half a step, plus the bf16 rounding of w / scale (at most 7 * 2^-8 steps).
                    prop_assert!((d[i] - w[i].to_f32()).abs() <= 0.53 * s.to_f32() + 1e-6);
                }
            }
        }

        #[test]
        fn dequantized_weights_are_a_fixed_point(vals in prop::collection::vec(-4.0f32..4.0, 128)) {
            let w: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
            let p = quantize(&w, 1, 128, 32, 1);
            let d: Vec<bf16> = p.dequantize().iter().map(|&v| bf16::from_f32(v)).collect();
            let again = quantize(&d, 1, 128, 32, 1);
            prop_assert_eq!(again.dequantize(), p.dequantize());
        }

        #[test]
        fn interleave_moves_pairs_into_nibbles_i_and_i_plus_4(w in any::<u32>()) {
            let x = interleave_word(w);
            for i in 0..4 {
                prop_assert_eq!((x >> (4 * i)) & 0xf, (w >> (8 * i)) & 0xf);
                prop_assert_eq!((x >> (4 * (i + 4))) & 0xf, (w >> (8 * i + 4)) & 0xf);
            }
        }

        #[test]
        fn matmul_is_linear_in_a(m in 1usize..4, n in 1usize..5, k in 1usize..9, s in -3.0f32..3.0) {
            let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.91).cos()).collect();
            let sa: Vec<f32> = a.iter().map(|v| v * s).collect();
            let c = matmul(&a, &w, m, n, k);
            for (x, y) in matmul(&sa, &w, m, n, k).iter().zip(&c) {
                prop_assert!((x - s * y).abs() <= 1e-4 * (1.0 + y.abs()));
            }
        }
    }

    #[test]
    fn scale_words_hold_two_scales_low_half_first() {
        let s: Vec<bf16> = [1.0f32, -2.0, 0.5].iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(scale_words(&s), vec![0xc000_3f80, 0x0000_3f00]);
    }

    #[test]
    fn bf16_dequantization_rounds_the_product() {
        // 7 * 1.0078125 = 7.0546875 needs 10 significant bits: bf16 rounds it to 7.0625.
        let p = PackedInt4 {
            packed: pack(&[7, 0, 0, 0, 0, 0, 0, 0], 8),
            scales: vec![bf16::from_f32(1.0078125)],
            n: 1,
            k: 8,
            group: 8,
            experts: 1,
        };
        assert_eq!(p.dequantize()[0], 7.0546875);
        assert_eq!(p.dequantize_bf16()[0], 7.0625);
    }

    #[test]
    fn fragment_blocks_hold_every_element_and_scale() {
        let mut rng = rand::rng();
        let p = PackedInt4::random(&mut rng, 70, 160, 32, 1, 1.0);
        let f = repack_fragment(&p);
        let kbs = p.k.div_ceil(128);
        let q = unpack(&p.packed);
        let mut seen = vec![0u32; p.n * p.k];
        for (b, blk) in f.chunks(FRAG_BLOCK_WORDS).enumerate() {
            let (u, c) = (b / kbs, b % kbs);
            for t in 0..128 {
                let (g, qq) = ((t % 32) / 4, t % 4);
                let r0 = 64 * u + 16 * (t / 32) + g;
                for s in 0..8 {
                    let word = blk[8 * t + s];
                    for e in 0..8 {
                        // Element e of the fragment: register e / 2, pair (e / 2) at nibbles
                        // (e / 2, e / 2 + 4); rows r0 / r0 + 8 by register parity.
                        let reg = e / 2;
                        let row = r0 + 8 * (reg % 2);
                        let col = 128 * c + 16 * s + 2 * qq + 8 * (reg / 2) + e % 2;
                        let nib = (word >> (4 * reg + 16 * (e % 2))) & 0xf;
                        if row < p.n && col < p.k {
                            assert_eq!(nib as i8 - 8, q[row * p.k + col]);
                            seen[row * p.k + col] += 1;
                            let sw = blk[1024 + 4 * (8 * (t / 32) + g) + 2 * (reg % 2) + (16 * s % 128) / 64];
                            let sc = if (16 * s % 64) < 32 { sw & 0xffff } else { sw >> 16 };
                            assert_eq!(sc as u16, p.scales[row * (p.k / 32) + col / 32].to_bits());
                        } else {
                            assert_eq!(nib, 8);
                        }
                    }
                }
            }
        }
        assert!(seen.iter().all(|&v| v == 1), "every element exactly once");
    }

    #[test]
    fn repack_keeps_every_element() {
        let mut rng = rand::rng();
        let p = PackedInt4::random(&mut rng, 13, 160, 32, 2, 1.0);
        let r = repack_interleaved(&p);
        let kb_n = p.k.div_ceil(128);
        let per = interleaved_words(p.n, p.k);
        let q = unpack(&p.packed);
        for e in 0..p.experts {
            for row in 0..p.n {
                for kk in 0..p.k {
                    let (tile, g, kb) = (row / 8, row % 8, kk / 128);
                    let (qq, j, el) = ((kk % 128) / 32, (kk % 32) / 8, kk % 8);
                    let word = r[e * per + (tile * kb_n + kb) * TILE_WORDS + (g * 4 + qq) * 4 + j];
                    let nib = (word >> (4 * INTERLEAVED_POS[el])) & 0xf;
                    assert_eq!(nib as i8 - 8, q[(e * p.n + row) * p.k + kk]);
                }
            }
        }
    }
}
