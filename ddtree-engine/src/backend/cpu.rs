//! The CPU reference backend: f32, or with the CUDA backend's bf16 rounding.

use std::borrow::Cow;

use ddtree_kernels::w4a16::layout::quantize;
use ddtree_kernels::w4a16::moe::GEMV_MAX_TOKENS;
use half::bf16;

use crate::backend::cuda::DENSE_EXPERT_GROUP;
use crate::backend::{AttentionSpan, Backend, GqaDims, HostLinear, Matrix, MlaDims};
use crate::config::MoeConfig;
use crate::error::{EngineError, Result};
use crate::model::Ffn;
use crate::rope::Rope;
use crate::spec::sampling::argmax;

/// The precision in which [`CpuBackend`] stores activations between ops (also the values of
/// `ddtree --cpu-activations`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ActivationPrecision {
    /// f32 everywhere: the reference.
    #[default]
    F32,
    /// Rounded to bf16 (to nearest even) wherever the CUDA backend stores bf16, so CPU runs
    /// reproduce the GPU's numerics (and tokens) up to summation order.
    Bf16,
}

/// The CPU reference backend: plain loops, INT4 weights dequantized row by row on the fly, f32
/// arithmetic throughout.
///
/// With [`ActivationPrecision::F32`] (the default) every value stays f32. With
/// [`ActivationPrecision::Bf16`] the backend rounds to bf16 exactly where the CUDA backend keeps
/// bf16, and nowhere else:
/// - weights as uploaded: dense weights, INT4 scales and the embedding table; a dequantized
///   INT4 weight is `bf16(q * scale)`; dense routed experts are quantized to INT4 as the GPU
///   quantizes them; norm weights are read in bf16, the routing bias in f32;
/// - the output of every op that returns an activation: embedding, `rms_norm`,
///   `head_rms_norm`, the normalized half of `add_rms_norm`, `linear`, `silu_mul`,
///   `add_assign`, `take_rows`, `concat_cols`, `rope_heads`, `mla_query`, `mla_attention`,
///   `mla_output`, `gqa_attention`, `moe_experts`, and the rows `mla_append_kv` and `kv_append`
///   write to the cache;
/// - inside `moe_experts`, as the fused kernels do: the intermediate `silu(gate) * up` (gate
///   and up themselves stay f32), and for more than [`GEMV_MAX_TOKENS`] tokens each routed
///   expert's weighted output before the top-k sum (the grouped path; the small-token path sums
///   in f32 and rounds once).
///
/// The fused ops of the CUDA backend keep the defaults here, which go through the ops above and
/// so round where the fused kernels do: `gate_up_silu` (the gate and up products rounded, then
/// `silu_mul`) and `add2_rms_norm` (the two parts summed by `add_assign`, then `add_rms_norm`).
///
/// f32 stays f32 where the GPU keeps it: the residual stream (`add_rms_norm` adds in f32, the
/// model having made the stream with [`Backend::residual`]), `linear_f32` (router logits, LM
/// head), routing, logits handed in by drafters, and every accumulation inside an op. The
/// tensor-core verify attention the GPU runs for 576-wide latent rows (Kimi's shapes) also
/// rounds its probabilities and split partials to bf16; that is not mirrored (the generic
/// attention kernel, used for other widths and so for the tiny fixtures, is f32 inside).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend {
    activations: ActivationPrecision,
}

impl CpuBackend {
    /// The backend storing activations at `activations` precision.
    pub fn new(activations: ActivationPrecision) -> Self {
        Self { activations }
    }

    /// The activation precision.
    pub fn activations(&self) -> ActivationPrecision {
        self.activations
    }

    /// Rounds `values` to bf16 in place in bf16 mode (a point where the GPU stores bf16).
    fn round(&self, values: &mut [f32]) {
        if self.activations == ActivationPrecision::Bf16 {
            values.iter_mut().for_each(|v| *v = to_bf16(*v));
        }
    }

    /// `m` after [`CpuBackend::round`].
    fn rounded(&self, mut m: Matrix) -> Matrix {
        self.round(&mut m.data);
        m
    }

    /// A 1-D parameter as the GPU's kernels read its bf16 copy (norm weights).
    fn bf16_param<'a>(&self, w: &'a [f32]) -> Cow<'a, [f32]> {
        match self.activations {
            ActivationPrecision::F32 => Cow::Borrowed(w),
            ActivationPrecision::Bf16 => Cow::Owned(w.iter().map(|&v| to_bf16(v)).collect()),
        }
    }

    /// Row `r` of a weight as f32; INT4 rows are dequantized into `scratch` (each value
    /// rounded to bf16 in bf16 mode, as the GPU dequantizes).
    fn weight_row<'a>(&self, w: &'a HostLinear, r: usize, scratch: &'a mut Vec<f32>) -> &'a [f32] {
        match w {
            HostLinear::Dense { inp, data, .. } => &data[r * inp..(r + 1) * inp],
            HostLinear::Int4 {
                inp,
                group_size,
                packed,
                scales,
                ..
            } => {
                let words = &packed[r * inp.div_ceil(8)..];
                let groups = &scales[r * (inp / group_size)..];
                scratch.clear();
                scratch.extend((0..*inp).map(|k| {
                    let nibble = (words[k / 8] >> (4 * (k % 8))) & 0xF;
                    (nibble as i32 - 8) as f32 * groups[k / group_size]
                }));
                self.round(scratch);
                scratch
            }
        }
    }

    /// `x W^T` in f32 (no rounding of the output).
    fn product(&self, x: &Matrix, w: &HostLinear) -> Result<Matrix> {
        let (out_features, in_features) = w.shape();
        check_cols("linear", x, in_features)?;
        let mut out = Matrix::zeros(x.rows, out_features);
        let mut scratch = Vec::new();
        for o in 0..out_features {
            let row = self.weight_row(w, o, &mut scratch);
            for t in 0..x.rows {
                out.data[t * out_features + o] = dot(x.row(t), row);
            }
        }
        Ok(out)
    }
}

/// `v` rounded to the nearest bf16 (ties to even).
fn to_bf16(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

/// Latent KV cache on the host: per layer, `len` rows of `width` values.
#[derive(Debug, Clone)]
pub struct CpuKvCache {
    width: usize,
    capacity: usize,
    layers: Vec<Vec<f32>>,
    _live: super::LiveCache,
}

impl CpuKvCache {
    /// Row `slot` of `layer`.
    pub fn row(&self, layer: usize, slot: usize) -> &[f32] {
        &self.layers[layer][slot * self.width..(slot + 1) * self.width]
    }

    fn len(&self, layer: usize) -> usize {
        self.layers[layer].len() / self.width
    }
}

/// Per token, the chosen experts and their weights, in selection order.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuRouting(pub Vec<Vec<(usize, f32)>>);

fn fail(reason: String) -> EngineError {
    EngineError::Backend {
        backend: "cpu".into(),
        reason,
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators so the loop vectorizes.
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8 * 8;
    for (x, y) in a[..chunks].chunks_exact(8).zip(b[..chunks].chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = a[chunks..].iter().zip(&b[chunks..]).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

/// `x += y` in f32.
fn add(x: &mut Matrix, y: &Matrix) -> Result<()> {
    if (x.rows, x.cols) != (y.rows, y.cols) {
        return Err(fail(format!("add: {}x{} vs {}x{}", x.rows, x.cols, y.rows, y.cols)));
    }
    x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
    Ok(())
}

/// `silu(gate) * up` in f32.
fn silu_mul(gate: &Matrix, up: &Matrix) -> Result<Matrix> {
    if (gate.rows, gate.cols) != (up.rows, up.cols) {
        return Err(fail("silu_mul: gate and up differ in shape".into()));
    }
    let data = gate
        .data
        .iter()
        .zip(&up.data)
        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
        .collect();
    Ok(Matrix {
        rows: gate.rows,
        cols: gate.cols,
        data,
    })
}

/// A dense routed expert's weight quantized to INT4 with `group`-wide scales, as the CUDA
/// backend quantizes it (from its bf16 values, Kimi's rule); INT4 weights unchanged.
fn quantized(w: HostLinear, group: usize) -> Result<HostLinear> {
    let HostLinear::Dense { out, inp, data } = w else {
        return Ok(w);
    };
    #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` needs Rust 1.87; MSRV is 1.85
    if group == 0 || inp % 32 != 0 || inp % group != 0 {
        return Err(fail(format!(
            "load_experts: a dense [{out}, {inp}] expert cannot be quantized in groups of {group}"
        )));
    }
    let values: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
    let q = quantize(&values, out, inp, group, 1);
    Ok(HostLinear::Int4 {
        out,
        inp,
        group_size: group,
        packed: q.packed,
        scales: q.scales.iter().map(|s| s.to_f32()).collect(),
    })
}

fn check_cols(what: &str, x: &Matrix, cols: usize) -> Result<()> {
    if x.cols == cols {
        Ok(())
    } else {
        Err(fail(format!("{what}: input has {} columns, expected {cols}", x.cols)))
    }
}

fn rms_normalize(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mean_sq = x.iter().map(|v| (v * v) as f64).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / ((mean_sq as f32) + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}

/// Indices of the `k` largest values, larger first; ties go to the lower index.
fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

impl Backend for CpuBackend {
    type Tensor = Matrix;
    type Vector = Vec<f32>;
    type Weight = HostLinear;
    type KvCache = CpuKvCache;
    type Routing = CpuRouting;
    type Experts = Vec<Ffn<HostLinear>>;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn load_vector(&self, data: Vec<f32>) -> Result<Vec<f32>> {
        Ok(data)
    }

    fn load_matrix(&self, m: Matrix) -> Result<Matrix> {
        Ok(self.rounded(m))
    }

    fn load_logits(&self, m: Matrix) -> Result<Matrix> {
        Ok(m)
    }

    fn load_weight(&self, mut w: HostLinear) -> Result<HostLinear> {
        match &mut w {
            HostLinear::Dense { data, .. } => self.round(data),
            HostLinear::Int4 { scales, .. } => self.round(scales),
        }
        Ok(w)
    }

    fn load_experts(&self, experts: Vec<Ffn<HostLinear>>) -> Result<Vec<Ffn<HostLinear>>> {
        if self.activations == ActivationPrecision::F32 {
            return Ok(experts);
        }
        // As the CUDA backend stacks them: dense experts quantized at the first expert's group.
        let group = match experts.first().map(|f| &f.gate) {
            Some(HostLinear::Int4 { group_size, .. }) => *group_size,
            _ => DENSE_EXPERT_GROUP,
        };
        let load = |w| self.load_weight(quantized(w, group)?);
        experts
            .into_iter()
            .map(|f| {
                Ok(Ffn {
                    gate: load(f.gate)?,
                    up: load(f.up)?,
                    down: load(f.down)?,
                })
            })
            .collect()
    }

    fn random_weight(&self, out: usize, inp: usize, int4_group: Option<usize>, seed: u64) -> Result<HostLinear> {
        self.load_weight(HostLinear::random(out, inp, int4_group, seed))
    }

    fn random_experts(
        &self,
        count: usize,
        inter: usize,
        hidden: usize,
        int4_group: Option<usize>,
        seed: u64,
    ) -> Result<Vec<Ffn<HostLinear>>> {
        self.load_experts(
            (0..count as u64)
                .map(|e| Ffn {
                    gate: HostLinear::random(inter, hidden, int4_group, seed ^ (3 * e + 1) << 20),
                    up: HostLinear::random(inter, hidden, int4_group, seed ^ (3 * e + 2) << 20),
                    down: HostLinear::random(hidden, inter, int4_group, seed ^ (3 * e + 3) << 20),
                })
                .collect(),
        )
    }

    fn random_vector(&self, len: usize, lo: f32, hi: f32, seed: u64) -> Result<Vec<f32>> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        Ok((0..len).map(|_| lo + (hi - lo) * rng.random::<f32>()).collect())
    }

    fn random_matrix(&self, rows: usize, cols: usize, seed: u64) -> Result<Matrix> {
        let data = self.random_vector(rows * cols, -1.0, 1.0, seed)?;
        self.load_matrix(Matrix { rows, cols, data })
    }

    fn kv_fill_random(&self, cache: &mut CpuKvCache, len: usize, seed: u64) -> Result<()> {
        if len > cache.capacity {
            return Err(fail(format!(
                "kv_fill_random: {len} rows exceed the capacity {}",
                cache.capacity
            )));
        }
        let width = cache.width;
        for (l, layer) in cache.layers.iter_mut().enumerate() {
            *layer = self.random_vector(len * width, -1.0, 1.0, seed ^ (l as u64) << 32)?;
            self.round(layer);
        }
        Ok(())
    }

    fn new_kv_cache(&self, layers: usize, row_width: usize, capacity: usize) -> Result<CpuKvCache> {
        if row_width == 0 {
            return Err(fail("KV cache rows must not be empty".into()));
        }
        Ok(CpuKvCache {
            width: row_width,
            capacity,
            layers: vec![Vec::new(); layers],
            _live: super::LiveCache::new(),
        })
    }

    fn dims(&self, x: &Matrix) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn to_host(&self, x: &Matrix) -> Result<Matrix> {
        Ok(x.clone())
    }

    fn take_rows(&self, x: &Matrix, rows: &[usize]) -> Result<Matrix> {
        let mut out = Matrix::zeros(rows.len(), x.cols);
        for (i, &r) in rows.iter().enumerate() {
            if r >= x.rows {
                return Err(fail(format!("take_rows: row {r} of {}", x.rows)));
            }
            out.row_mut(i).copy_from_slice(x.row(r));
        }
        Ok(self.rounded(out))
    }

    fn embedding(&self, table: &Matrix, ids: &[u32]) -> Result<Matrix> {
        let rows: Vec<usize> = ids.iter().map(|&id| id as usize).collect();
        self.take_rows(table, &rows)
    }

    fn rms_norm(&self, x: &Matrix, weight: &Vec<f32>, eps: f32) -> Result<Matrix> {
        check_cols("rms_norm", x, weight.len())?;
        let weight = self.bf16_param(weight);
        let mut out = Matrix::zeros(x.rows, x.cols);
        for r in 0..x.rows {
            rms_normalize(x.row(r), &weight, eps, out.row_mut(r));
        }
        Ok(self.rounded(out))
    }

    fn linear(&self, x: &Matrix, w: &HostLinear) -> Result<Matrix> {
        Ok(self.rounded(self.product(x, w)?))
    }

    fn linear_f32(&self, x: &Matrix, w: &HostLinear) -> Result<Matrix> {
        self.product(x, w)
    }

    fn argmax_rows(&self, logits: &Matrix) -> Result<Vec<u32>> {
        Ok((0..logits.rows).map(|r| argmax(logits.row(r))).collect())
    }

    fn add_assign(&self, x: &mut Matrix, y: &Matrix) -> Result<()> {
        add(x, y)?;
        self.round(&mut x.data);
        Ok(())
    }

    fn add_rms_norm(&self, x: &mut Matrix, y: &Matrix, weight: &Vec<f32>, eps: f32) -> Result<Matrix> {
        // `x` is the residual stream: the sum stays f32, as on the GPU.
        add(x, y)?;
        self.rms_norm(x, weight, eps)
    }

    fn silu_mul(&self, gate: &Matrix, up: &Matrix) -> Result<Matrix> {
        Ok(self.rounded(silu_mul(gate, up)?))
    }

    fn concat_cols(&self, parts: &[&Matrix]) -> Result<Matrix> {
        let rows = parts.first().map_or(0, |p| p.rows);
        if parts.iter().any(|p| p.rows != rows) {
            return Err(fail("concat_cols: parts differ in rows".into()));
        }
        let cols = parts.iter().map(|p| p.cols).sum();
        let mut out = Matrix::zeros(rows, cols);
        for r in 0..rows {
            let mut at = 0;
            for p in parts {
                out.row_mut(r)[at..at + p.cols].copy_from_slice(p.row(r));
                at += p.cols;
            }
        }
        Ok(self.rounded(out))
    }

    fn head_rms_norm(&self, x: &Matrix, weight: &Vec<f32>, eps: f32) -> Result<Matrix> {
        let d = weight.len();
        #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` needs Rust 1.87; MSRV is 1.85
        if d == 0 || x.cols % d != 0 {
            return Err(fail(format!("head_rms_norm: {} columns, head size {d}", x.cols)));
        }
        let weight = self.bf16_param(weight);
        let mut out = Matrix::zeros(x.rows, x.cols);
        for (src, dst) in x.data.chunks_exact(d).zip(out.data.chunks_exact_mut(d)) {
            rms_normalize(src, &weight, eps, dst);
        }
        Ok(self.rounded(out))
    }

    fn rope_heads(&self, x: &mut Matrix, rope: &Rope, positions: &[u32]) -> Result<()> {
        let d = rope.dim();
        #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` needs Rust 1.87; MSRV is 1.85
        if d == 0 || x.cols % d != 0 || positions.len() != x.rows {
            return Err(fail(format!(
                "rope_heads: {}x{} input, rotary size {d}, {} positions",
                x.rows,
                x.cols,
                positions.len()
            )));
        }
        for (t, &pos) in positions.iter().enumerate() {
            x.row_mut(t).chunks_exact_mut(d).for_each(|head| rope.apply(head, pos));
        }
        self.round(&mut x.data);
        Ok(())
    }

    fn mla_append_kv(
        &self,
        kv_a: &Matrix,
        norm: &Vec<f32>,
        eps: f32,
        rope: &Rope,
        positions: &[u32],
        cache: &mut CpuKvCache,
        layer: usize,
    ) -> Result<()> {
        check_cols("mla_append_kv", kv_a, cache.width)?;
        let kv_lora = norm.len();
        if layer >= cache.layers.len() || kv_lora > cache.width || positions.len() != kv_a.rows {
            return Err(fail(format!("mla_append_kv: bad layer {layer} or shapes")));
        }
        if cache.len(layer) + kv_a.rows > cache.capacity {
            return Err(EngineError::Forward(format!(
                "KV cache full: {} + {} rows exceed its capacity of {}",
                cache.len(layer),
                kv_a.rows,
                cache.capacity
            )));
        }
        let norm = self.bf16_param(norm);
        let mut row = vec![0.0; cache.width];
        for (t, &pos) in positions.iter().enumerate() {
            let src = kv_a.row(t);
            rms_normalize(&src[..kv_lora], &norm, eps, &mut row[..kv_lora]);
            row[kv_lora..].copy_from_slice(&src[kv_lora..]);
            rope.apply(&mut row[kv_lora..], pos);
            self.round(&mut row);
            cache.layers[layer].extend_from_slice(&row);
        }
        Ok(())
    }

    fn mla_query(&self, q: &Matrix, kv_b: &HostLinear, rope: &Rope, positions: &[u32], d: MlaDims) -> Result<Matrix> {
        let qk = d.nope + d.rope;
        check_cols("mla_query", q, d.heads * qk)?;
        if kv_b.shape() != (d.heads * (d.nope + d.v), d.kv_lora) || positions.len() != q.rows {
            return Err(fail("mla_query: kv_b or positions do not match the MLA dims".into()));
        }
        let lw = d.latent_width();
        let mut out = Matrix::zeros(q.rows, d.heads * lw);
        let mut scratch = Vec::new();
        for h in 0..d.heads {
            for p in 0..d.nope {
                let w_uk = self.weight_row(kv_b, h * (d.nope + d.v) + p, &mut scratch);
                for t in 0..q.rows {
                    let coef = q.row(t)[h * qk + p];
                    let dst = &mut out.row_mut(t)[h * lw..h * lw + d.kv_lora];
                    dst.iter_mut().zip(w_uk).for_each(|(o, w)| *o += coef * w);
                }
            }
            for (t, &pos) in positions.iter().enumerate() {
                let pe = &mut out.row_mut(t)[h * lw + d.kv_lora..(h + 1) * lw];
                pe.copy_from_slice(&q.row(t)[h * qk + d.nope..(h + 1) * qk]);
                rope.apply(pe, pos);
            }
        }
        Ok(self.rounded(out))
    }

    fn mla_attention(
        &self,
        q_abs: &Matrix,
        cache: &CpuKvCache,
        layer: usize,
        span: AttentionSpan<'_>,
        d: MlaDims,
        scale: f32,
    ) -> Result<Matrix> {
        let lw = d.latent_width();
        check_cols("mla_attention", q_abs, d.heads * lw)?;
        if layer >= cache.layers.len() || cache.width != lw {
            return Err(fail(format!("mla_attention: bad layer {layer} or cache width")));
        }
        let n_new = q_abs.rows;
        if cache.len(layer) != span.prefix_len + n_new {
            return Err(fail(format!(
                "mla_attention: cache holds {} rows, expected prefix {} + {n_new} new",
                cache.len(layer),
                span.prefix_len
            )));
        }
        let mut out = Matrix::zeros(n_new, d.heads * d.kv_lora);
        let mut slots = Vec::new();
        let mut probs = Vec::new();
        for t in 0..n_new {
            slots.clear();
            slots.extend(0..span.prefix_len);
            slots.extend((0..n_new).filter(|&j| span.sees_new(t, j)).map(|j| span.prefix_len + j));
            for h in 0..d.heads {
                let q = &q_abs.row(t)[h * lw..(h + 1) * lw];
                probs.clear();
                probs.extend(slots.iter().map(|&s| dot(q, cache.row(layer, s)) * scale));
                let max = probs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                probs.iter_mut().for_each(|p| *p = (*p - max).exp());
                let sum: f32 = probs.iter().sum();
                let o = &mut out.row_mut(t)[h * d.kv_lora..(h + 1) * d.kv_lora];
                for (&s, &p) in slots.iter().zip(&probs) {
                    let c_kv = &cache.row(layer, s)[..d.kv_lora];
                    o.iter_mut().zip(c_kv).for_each(|(acc, c)| *acc += p / sum * c);
                }
            }
        }
        Ok(self.rounded(out))
    }

    fn mla_output(&self, o_lat: &Matrix, kv_b: &HostLinear, d: MlaDims) -> Result<Matrix> {
        check_cols("mla_output", o_lat, d.heads * d.kv_lora)?;
        if kv_b.shape() != (d.heads * (d.nope + d.v), d.kv_lora) {
            return Err(fail("mla_output: kv_b does not match the MLA dims".into()));
        }
        let mut out = Matrix::zeros(o_lat.rows, d.heads * d.v);
        let mut scratch = Vec::new();
        for h in 0..d.heads {
            for v in 0..d.v {
                let w_uv = self.weight_row(kv_b, h * (d.nope + d.v) + d.nope + v, &mut scratch);
                for t in 0..o_lat.rows {
                    out.row_mut(t)[h * d.v + v] = dot(&o_lat.row(t)[h * d.kv_lora..(h + 1) * d.kv_lora], w_uv);
                }
            }
        }
        Ok(self.rounded(out))
    }

    fn moe_route(&self, logits: &Matrix, bias: &Vec<f32>, cfg: &MoeConfig) -> Result<CpuRouting> {
        let experts = cfg.n_routed_experts;
        check_cols("moe_route", logits, experts)?;
        if bias.len() != experts {
            return Err(fail("moe_route: bias length differs from the expert count".into()));
        }
        let per_group = experts / cfg.n_group;
        let mut routing = Vec::with_capacity(logits.rows);
        for t in 0..logits.rows {
            let scores: Vec<f32> = logits.row(t).iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect();
            let mut choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
            if cfg.n_group > 1 {
                let group_scores: Vec<f32> = choice
                    .chunks(per_group)
                    .map(|g| top_k(g, 2).iter().map(|&i| g[i]).sum())
                    .collect();
                let kept = top_k(&group_scores, cfg.topk_group);
                for (g, chunk) in choice.chunks_mut(per_group).enumerate() {
                    if !kept.contains(&g) {
                        // HF masks dropped groups with 0.0, not -inf.
                        chunk.fill(0.0);
                    }
                }
            }
            let chosen = top_k(&choice, cfg.num_experts_per_tok);
            let mut weights: Vec<f32> = chosen.iter().map(|&e| scores[e]).collect();
            if cfg.norm_topk_prob {
                let denom = weights.iter().sum::<f32>() + 1e-20;
                weights.iter_mut().for_each(|w| *w /= denom);
            }
            weights.iter_mut().for_each(|w| *w *= cfg.routed_scaling_factor);
            routing.push(chosen.into_iter().zip(weights).collect());
        }
        Ok(CpuRouting(routing))
    }

    fn moe_experts(&self, x: &Matrix, routing: &CpuRouting, experts: &Vec<Ffn<HostLinear>>) -> Result<Matrix> {
        if routing.0.len() != x.rows {
            return Err(fail("moe_experts: routing and input differ in rows".into()));
        }
        if let Some(e) = routing.0.iter().flatten().find(|c| c.0 >= experts.len()) {
            return Err(fail(format!("moe_experts: expert {} of {}", e.0, experts.len())));
        }
        // In bf16 mode as the GPU's MoE kernels: its small-token path (one token, g32 experts)
        // sums the weighted expert outputs in f32 and rounds once, its grouped path rounds each
        // weighted expert output before the sum.
        let small = x.rows <= GEMV_MAX_TOKENS as usize
            && matches!(
                experts.first().map(|f| &f.gate),
                Some(HostLinear::Int4 { group_size: 32, .. })
            );
        let round_pairs = self.activations == ActivationPrecision::Bf16 && !small;
        let mut out = Matrix::zeros(x.rows, x.cols);
        // Expert by expert in index order, as HF accumulates.
        for (e, expert) in experts.iter().enumerate() {
            let (tokens, weights): (Vec<usize>, Vec<f32>) = routing
                .0
                .iter()
                .enumerate()
                .filter_map(|(t, choices)| choices.iter().find(|c| c.0 == e).map(|c| (t, c.1)))
                .unzip();
            if tokens.is_empty() {
                continue;
            }
            // The expert FFN with gate and up in f32 (the GPU fuses SiLU-and-mul into gate_up).
            let xe = self.take_rows(x, &tokens)?;
            let act = silu_mul(&self.product(&xe, &expert.gate)?, &self.product(&xe, &expert.up)?)?;
            let y = self.product(&self.rounded(act), &expert.down)?;
            for (i, (&t, &w)) in tokens.iter().zip(&weights).enumerate() {
                let pair = |v: f32| if round_pairs { to_bf16(v * w) } else { v * w };
                out.row_mut(t)
                    .iter_mut()
                    .zip(y.row(i))
                    .for_each(|(o, &v)| *o += pair(v));
            }
        }
        Ok(self.rounded(out))
    }

    fn moe_localize(&self, routing: CpuRouting, local: std::ops::Range<usize>) -> Result<CpuRouting> {
        Ok(CpuRouting(
            routing
                .0
                .iter()
                .map(|choices| {
                    choices
                        .iter()
                        .filter(|c| local.contains(&c.0))
                        .map(|&(e, w)| (e - local.start, w))
                        .collect()
                })
                .collect(),
        ))
    }

    fn kv_append(&self, cache: &mut CpuKvCache, layer: usize, rows: &Matrix) -> Result<()> {
        check_cols("kv_append", rows, cache.width)?;
        if layer >= cache.layers.len() {
            return Err(fail(format!("kv_append: layer {layer} of {}", cache.layers.len())));
        }
        if cache.len(layer) + rows.rows > cache.capacity {
            return Err(EngineError::Forward(format!(
                "KV cache full: {} + {} rows exceed its capacity of {}",
                cache.len(layer),
                rows.rows,
                cache.capacity
            )));
        }
        let start = cache.layers[layer].len();
        cache.layers[layer].extend_from_slice(&rows.data);
        self.round(&mut cache.layers[layer][start..]);
        Ok(())
    }

    fn gqa_attention(
        &self,
        q: &Matrix,
        cache: &CpuKvCache,
        k_layer: usize,
        v_layer: usize,
        d: GqaDims,
        scale: f32,
    ) -> Result<Matrix> {
        let kv_width = d.kv_heads * d.head_dim;
        check_cols("gqa_attention", q, d.heads * d.head_dim)?;
        #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` needs Rust 1.87; MSRV is 1.85
        let grouped = d.kv_heads > 0 && d.heads % d.kv_heads == 0;
        let layers = cache.layers.len();
        if !grouped || cache.width != kv_width || k_layer >= layers || v_layer >= layers {
            return Err(fail(format!(
                "gqa_attention: {d:?} over cache layers {k_layer}/{v_layer} of {layers}, width {}",
                cache.width
            )));
        }
        let n = cache.len(k_layer);
        if cache.len(v_layer) != n {
            return Err(fail("gqa_attention: keys and values differ in rows".into()));
        }
        let group = d.heads / d.kv_heads;
        let hd = d.head_dim;
        let mut out = Matrix::zeros(q.rows, d.heads * hd);
        let mut probs = vec![0.0f32; n];
        for t in 0..q.rows {
            for h in 0..d.heads {
                let kv = h / group * hd;
                let qh = &q.row(t)[h * hd..(h + 1) * hd];
                for (s, p) in probs.iter_mut().enumerate() {
                    *p = dot(qh, &cache.row(k_layer, s)[kv..kv + hd]) * scale;
                }
                let max = probs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                probs.iter_mut().for_each(|p| *p = (*p - max).exp());
                let sum: f32 = probs.iter().sum();
                let o = &mut out.row_mut(t)[h * hd..(h + 1) * hd];
                for (s, &p) in probs.iter().enumerate() {
                    let v = &cache.row(v_layer, s)[kv..kv + hd];
                    o.iter_mut().zip(v).for_each(|(acc, v)| *acc += p / sum * v);
                }
            }
        }
        Ok(self.rounded(out))
    }

    fn kv_len(&self, cache: &CpuKvCache) -> usize {
        if cache.layers.is_empty() {
            0
        } else {
            cache.len(0)
        }
    }

    fn kv_truncate(&self, cache: &mut CpuKvCache, len: usize) -> Result<()> {
        let width = cache.width;
        for layer in &mut cache.layers {
            layer.truncate(len * width);
        }
        Ok(())
    }

    fn kv_compact(&self, cache: &mut CpuKvCache, base: usize, keep: &[usize]) -> Result<()> {
        let len = self.kv_len(cache);
        let ascending = keep.windows(2).all(|w| w[0] < w[1]);
        if !ascending || keep.last().is_some_and(|&k| base + k >= len) {
            return Err(EngineError::Forward(format!(
                "kv_compact: keep list {keep:?} after row {base} must ascend and stay below {len}"
            )));
        }
        let width = cache.width;
        for layer in &mut cache.layers {
            for (i, &k) in keep.iter().enumerate() {
                layer.copy_within((base + k) * width..(base + k + 1) * width, (base + i) * width);
            }
            layer.truncate((base + keep.len()) * width);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_bf16(values: &[f32]) -> bool {
        values.iter().all(|&v| to_bf16(v) == v)
    }

    #[test]
    fn bf16_mode_rounds_activations_but_not_the_residual_or_f32_outputs() {
        let (f, b) = (CpuBackend::default(), CpuBackend::new(ActivationPrecision::Bf16));
        let x = f.random_matrix(3, 64, 1).unwrap();
        let norm = f.random_vector(64, 0.5, 1.5, 2).unwrap();
        let dense = HostLinear::random(16, 64, None, 3);
        let int4 = HostLinear::random(16, 64, Some(32), 4);
        // f32 mode takes everything as it is and rounds nothing.
        assert_eq!(f.load_weight(dense.clone()).unwrap(), dense);
        assert_eq!(f.load_matrix(x.clone()).unwrap(), x);
        assert!(!is_bf16(&x.data) && !is_bf16(&f.linear(&x, &dense).unwrap().data));
        // bf16 mode: weights, the table and activations are bf16 values.
        let (wd, wq) = (b.load_weight(dense).unwrap(), b.load_weight(int4).unwrap());
        let HostLinear::Dense { data, .. } = &wd else {
            panic!("dense")
        };
        assert!(is_bf16(data));
        let h = b.load_matrix(x.clone()).unwrap();
        assert!(is_bf16(&h.data));
        for w in [&wd, &wq] {
            assert!(is_bf16(&b.linear(&h, w).unwrap().data));
        }
        assert!(is_bf16(&b.rms_norm(&x, &norm, 1e-6).unwrap().data));
        let y = b.linear(&h, &wd).unwrap();
        assert!(is_bf16(&b.silu_mul(&y, &y).unwrap().data));
        assert!(is_bf16(&b.gate_up_silu(&h, &wd, &wq).unwrap().data));
        // ... but router logits / the LM head and the residual stream stay f32.
        assert!(!is_bf16(&b.linear_f32(&h, &wd).unwrap().data));
        let x16 = f.random_matrix(3, 16, 5).unwrap();
        let mut stream = x16.clone();
        let normed = b.add_rms_norm(&mut stream, &y, &norm[..16].to_vec(), 1e-6).unwrap();
        assert!(is_bf16(&normed.data) && !is_bf16(&stream.data));
        let mut sum = x16.clone();
        b.add_assign(&mut sum, &y).unwrap();
        assert!(is_bf16(&sum.data));
        // The two-part residual add rounds the parts' sum, not the stream.
        let z = b.linear(&h, &wq).unwrap();
        let mut two = x16.clone();
        let normed = b
            .add2_rms_norm(&mut two, y.clone(), &z, &norm[..16].to_vec(), 1e-6)
            .unwrap();
        assert!(is_bf16(&normed.data) && !is_bf16(&two.data));
        let want: Vec<f32> = x16
            .data
            .iter()
            .zip(&y.data)
            .zip(&z.data)
            .map(|((x, y), z)| x + to_bf16(y + z))
            .collect();
        assert_eq!(two.data, want);
    }

    #[test]
    fn bf16_mode_quantizes_dense_experts_as_the_gpu_does() {
        let dense = || Ffn {
            gate: HostLinear::random(32, 64, None, 1),
            up: HostLinear::random(32, 64, None, 2),
            down: HostLinear::random(64, 32, None, 3),
        };
        let f = CpuBackend::default().load_experts(vec![dense()]).unwrap();
        assert_eq!((&f[0].gate, &f[0].down), (&dense().gate, &dense().down));
        let b = CpuBackend::new(ActivationPrecision::Bf16)
            .load_experts(vec![dense()])
            .unwrap();
        for w in [&b[0].gate, &b[0].up, &b[0].down] {
            let HostLinear::Int4 { group_size, scales, .. } = w else {
                panic!("not quantized")
            };
            assert!(*group_size == DENSE_EXPERT_GROUP && is_bf16(scales));
        }
    }
}
