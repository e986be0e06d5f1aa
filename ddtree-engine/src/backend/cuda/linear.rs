//! Linear layers of the CUDA backend: cuBLAS and the bf16 GEMVs for dense weights, the W4A16 GEMV
//! and GEMMs for INT4 weights, the fused norm + GEMV and gate/up + SiLU products, and argmax.

#[allow(unused_imports)]
use super::*;
use ddtree_kernels::gemv_bf16::op::{GateUpSiluOp, GemvOp, GemvRmsNormOp};
use ddtree_kernels::topk::RowTopkOp;
use ddtree_kernels::w4a16::op::DenseGemvOp;

/// Whether an INT4 `linear` of `rows` rows over an `[n, k]` weight runs the small-token
/// [`W4a16Gemv`] (one launch, no split-K reduce) instead of the tensor-core GEMM: with few rows
/// the product is a weight stream, which the GEMV reads at a higher share of the bandwidth on
/// weights of up to 2^26 elements; on the larger dense MLP the GEMM's wider tiles win
/// (`w4a16-bench`, docs/journal/w4a16-gemv.md). Needs scale group 32, 64 or 128 (the GEMV's
/// variants of the checkpoint's group) and `k` a multiple of 32 and of the group. The variant is
/// the tuned one of the shape, group and token bucket ([`Lookup::int4_gemv`]), the mode's
/// default where nothing is tuned.
pub(crate) fn dense_int4_gemv(rows: usize, n: usize, k: usize, group: usize) -> bool {
    rows <= DENSE_INT4_GEMV_MAX_ROWS && n * k <= 1 << 26 && w4gemv::takes_group(group) && k % 32 == 0 && k % group == 0
}
/// Most rows of an INT4 `linear` on the [`W4a16Gemv`] ([`dense_int4_gemv`]).
pub(crate) const DENSE_INT4_GEMV_MAX_ROWS: usize = 16;

/// The output of [`CudaBackend::dense_product`]: bf16 activations or f32 (router, LM head).
pub(super) enum DenseOut<'a> {
    Bf16(&'a mut CudaSlice<bf16>),
    F32(&'a mut CudaSlice<f32>),
}

impl CudaBackend {
    /// A dense W4A16 product on either GEMM kernel (weights interleaved), with its split-K
    /// reduction when the variant splits K.
    pub(super) fn int4_gemm<K: W4a16Kernel>(
        &self,
        kern: &CompiledKernel<K>,
        splits: u32,
        args: &GemmArgs,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let reduce = if kern.params().tiling().splitk {
            Some(self.variant::<gemm::W4a16Reduce>(&ddtree_kernels::w4a16::ReduceParams {
                block: 256,
                epilogue: Epilogue::Plain,
            })?)
        } else {
            None
        };
        let mut st = self.state();
        let need = splits as usize * args.m as usize * args.n as usize;
        let lane = self.lane();
        if st.w4a16[lane].part.len() < need {
            st.graphs.replaced("the W4A16 split-K scratch");
            st.w4a16[lane] = Scratch::new(self.stream(), need.next_power_of_two())?;
        }
        // SAFETY: weights in the variant's (interleaved) layout; partials sized above.
        unsafe {
            gemm::launch(
                kern,
                reduce.as_deref(),
                self.stream(),
                args,
                &mut st.w4a16[lane],
                out,
                splits,
            )?
        };
        Ok(())
    }

    /// [`Backend::rms_norm_linear`] on the GPU.
    pub(super) fn rms_norm_linear(
        &self,
        x: &CudaTensor,
        weight: &CudaVector,
        eps: f32,
        w: &CudaWeight,
    ) -> Result<CudaTensor> {
        let (n, k) = w.shape();
        let sms = self.gpu().fingerprint().sm_count as usize;
        let fused = match w {
            CudaWeight::Dense { w, .. } if x.cols == k && weight.len == k => {
                Lookup::rms_norm_linear(x.rows, n, k, sms).map(|l| (l, w))
            }
            _ => None,
        };
        let Some((lookup, wd)) = fused else {
            return self.linear(&self.rms_norm(x, weight, eps)?, w);
        };
        let _span = self.profile.span("rms_norm_linear");
        let mut out = self.tensor_bf16(x.rows, n)?;
        GemvRmsNormOp {
            a: x.bf16("rms_norm_linear")?,
            norm: &weight.bf16,
            eps,
            w: wd,
            out: out.bf16_mut("rms_norm_linear")?,
            rows: x.rows,
            n,
            k,
        }
        .launch(&*self.tuned::<GemvRmsNormBf16>(lookup)?, self.stream())?;
        Ok(out)
    }

    /// [`Backend::linear`] on the GPU.
    pub(super) fn linear(&self, x: &CudaTensor, w: &CudaWeight) -> Result<CudaTensor> {
        let _span = self.profile.span("linear");
        let (n, k) = w.shape();
        if x.cols != k {
            return Err(fail(format!("linear: {} columns into a [{n}, {k}] weight", x.cols)));
        }
        let mut out = self.tensor_bf16(x.rows, n)?;
        let a = x.bf16("linear")?;
        match w {
            CudaWeight::Dense { w, .. } => {
                self.dense_product(a, w, DenseOut::Bf16(out.bf16_mut("linear")?), x.rows, n, k)?
            }
            CudaWeight::Int4 {
                group, packed, scales, ..
            } => {
                if let Some(lookup) = Lookup::int4_gemv(x.rows, n, k, *group) {
                    let kern = self.tuned::<W4a16Gemv>(lookup.clone())?;
                    let p = *kern.params();
                    if p.mode != GemvMode::Dense || (w4gemv::max_tokens(&p) as usize) < x.rows {
                        return Err(fail(format!("linear: the W4A16 GEMV variant for {lookup} is {p:?}")));
                    }
                    let none_u32 = self.identity(1)?;
                    let st = self.state();
                    DenseGemvOp {
                        x: a,
                        w: packed,
                        scales,
                        out: out.bf16_mut("linear")?,
                        rows: x.rows,
                        n,
                        k,
                        unused_u32: none_u32.as_ref(),
                        unused_f32: &st.w4a16[self.lane()].part,
                    }
                    .launch(&kern, self.stream())?;
                    return Ok(out);
                }
                let args = GemmArgs {
                    a,
                    w: packed,
                    scales,
                    residual: None,
                    routing: None,
                    m: x.rows as u32,
                    n: n as u32,
                    k: k as u32,
                };
                let dst = out.bf16_mut("linear")?;
                let group = *group as u32;
                match Lookup::int4_gemm_wg(x.rows, n, k, group as usize, self.wgmma) {
                    Some(lookup) => {
                        // The tuned tile (index 0: `gemm_wg::default_dense`'s), split as
                        // `gemm_wg::dense_launch` says at these rows.
                        let tile = self.tuned_params::<W4a16GemmWg>(lookup)?;
                        let (p, splits) = gemm_wg::dense_launch(&tile, x.rows as u32, n as u32, k as u32);
                        let kern = self.variant::<W4a16GemmWg>(&W4a16WgParams { group, ..p })?;
                        self.int4_gemm(&kern, splits, &args, dst)?
                    }
                    None => {
                        let (p, splits) = default_dense(x.rows as u32, n as u32, k as u32);
                        let kern = self.variant::<gemm::W4a16Gemm>(&W4a16Params { group, ..p })?;
                        self.int4_gemm(&kern, splits, &args, dst)?
                    }
                }
            }
        }
        Ok(out)
    }

    /// [`Backend::linear_f32`] on the GPU.
    pub(super) fn linear_f32(&self, x: &CudaTensor, w: &CudaWeight) -> Result<CudaTensor> {
        let _span = self.profile.span("linear_f32");
        let CudaWeight::Dense { w, out: n, inp: k } = w else {
            return Err(fail("linear_f32 (router, LM head) needs a dense weight".into()));
        };
        if x.cols != *k {
            return Err(fail(format!("linear_f32: {} columns into a [{n}, {k}] weight", x.cols)));
        }
        let mut out = self.alloc::<f32>(x.rows * n)?;
        self.dense_product(x.bf16("linear_f32")?, w, DenseOut::F32(&mut out), x.rows, *n, *k)?;
        Ok(CudaTensor {
            rows: x.rows,
            cols: *n,
            data: DeviceData::F32(out),
        })
    }

    /// [`Backend::argmax_rows`] on the GPU.
    pub(super) fn argmax_rows(&self, logits: &CudaTensor) -> Result<Vec<u32>> {
        let (_, indices) = self.argmax_on_device(logits)?;
        self.read_back(&indices)
    }

    /// Each logits row's maximum and its column, left on the device (for the vocabulary-parallel
    /// argmax of ranks, which combines them across ranks).
    pub(crate) fn argmax_on_device(&self, logits: &CudaTensor) -> Result<(CudaSlice<f32>, CudaSlice<u32>)> {
        let _span = self.profile.span("argmax_rows");
        let mut values = self.alloc::<f32>(logits.rows)?;
        let mut indices = self.alloc::<u32>(logits.rows)?;
        self.argmax_into(&mut self.state(), logits, &mut values, &mut indices)?;
        Ok((values, indices))
    }

    /// [`Backend::gate_up_silu`] on the GPU.
    pub(super) fn gate_up_silu(&self, x: &CudaTensor, gate: &CudaWeight, up: &CudaWeight) -> Result<CudaTensor> {
        let (CudaWeight::Dense { w: g, out: n, inp: k }, CudaWeight::Dense { w: u, out: un, inp: uk }) = (gate, up)
        else {
            return unfused_gate_up_silu(self, x, gate, up);
        };
        // Two dense weights of one shape that `x` fits, and a GEMV shape (few rows, k % 8 == 0).
        let sms = self.gpu().fingerprint().sm_count as usize;
        let fits = (n, k) == (un, uk) && x.cols == *k;
        let Some(lookup) = Lookup::gate_up_silu(x.rows, *n, *k, sms).filter(|_| fits) else {
            return unfused_gate_up_silu(self, x, gate, up);
        };
        let _span = self.profile.span("gate_up_silu");
        let mut out = self.tensor_bf16(x.rows, *n)?;
        let op = GateUpSiluOp {
            a: x.bf16("gate_up_silu")?,
            gate: g,
            up: u,
            out: out.bf16_mut("gate_up_silu")?,
            rows: x.rows,
            n: *n,
            k: *k,
        };
        match lookup {
            Lookup::GateUpGemv(_) => op.launch_warp(&*self.tuned::<GemvGateUpSilu>(lookup)?, self.stream())?,
            _ => op.launch_split(&*self.tuned::<GemvSplitGateUpSilu>(lookup)?, self.stream())?,
        }
        Ok(out)
    }

    /// The GEMV for `rows` rows, `n` outputs of width `k`, when one applies: up to
    /// [`gemv::MAX_ROWS`] rows (decode and small trees), `k % 8 == 0`; the per-column kernel for
    /// wide outputs, the split-K one for narrow ones ([`gemv::choose`]). Above that cuBLAS is
    /// faster.
    pub(super) fn gemv_params(&self, rows: usize, n: usize, k: usize) -> Option<GemvChoice> {
        gemv::choose(rows, n, k, self.gpu().fingerprint().sm_count as usize)
    }

    /// `out = a w^T` for `a` `[rows, k]` and a dense bf16 `w` `[n, k]`: the GEMV [`gemv::choose`]
    /// picks for the shape (one warp per column or split-K), cuBLAS when none fits.
    pub(super) fn dense_product(
        &self,
        a: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        out: DenseOut<'_>,
        rows: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        let s = self.stream();
        let Some(choice) = self.gemv_params(rows, n, k) else {
            // SAFETY: cuBLAS reads a [rows, k] and w [n, k] and writes out [rows, n], as sized by
            // the callers.
            unsafe {
                match out {
                    DenseOut::Bf16(o) => self.blas().linear(a, w, o, rows, n, k)?,
                    DenseOut::F32(o) => self.blas().linear(a, w, o, rows, n, k)?,
                }
            }
            return Ok(());
        };
        match (choice, out) {
            (GemvChoice::Warp(p), DenseOut::Bf16(out)) => {
                GemvOp { a, w, out, rows, n, k }.launch_bf16(&*self.variant::<GemvBf16>(&p)?, s)?
            }
            (GemvChoice::Warp(p), DenseOut::F32(out)) => {
                GemvOp { a, w, out, rows, n, k }.launch_f32(&*self.variant::<GemvBf16F32>(&p)?, s)?
            }
            (GemvChoice::Split(p), DenseOut::Bf16(out)) => {
                GemvOp { a, w, out, rows, n, k }.launch_split_bf16(&*self.variant::<GemvSplitBf16>(&p)?, s)?
            }
            (GemvChoice::Split(p), DenseOut::F32(out)) => {
                GemvOp { a, w, out, rows, n, k }.launch_split_f32(&*self.variant::<GemvSplitF32>(&p)?, s)?
            }
        }
        Ok(())
    }

    /// The largest value of every row of f32 `logits` and its index (the lowest among equal
    /// maxima) into `values` and `indices` (at least `logits.rows` each): the split top-1 (many
    /// blocks per row, then a merge) for fewer than [`topk::SPLIT_MAX_ROWS`] rows (one block
    /// per row leaves most SMs idle when a decode step has one row of the whole vocabulary), else the tuned
    /// one-block-per-row top-1.
    pub(super) fn argmax_into(
        &self,
        st: &mut State,
        logits: &CudaTensor,
        values: &mut CudaSlice<f32>,
        indices: &mut CudaSlice<u32>,
    ) -> Result<()> {
        let (rows, n) = (logits.rows, logits.cols);
        if rows < topk::SPLIT_MAX_ROWS {
            if st.argmax.is_none() {
                st.argmax = Some(TopkRunner::new(self.gpu(), 1)?);
            }
            let runner = st.argmax.as_mut().expect("made above");
            if runner.reserve(self.stream(), rows, n)? {
                st.graphs.replaced("the argmax candidates");
            }
            runner.run(self.stream(), logits.f32("argmax")?, values, indices, rows, n)?;
            return Ok(());
        }
        let lookup = Lookup::argmax(rows, n).ok_or_else(|| fail(format!("argmax: no tuned path for {rows} rows")))?;
        let k = self.tuned::<RowTopk>(lookup)?;
        if k.params().k != 1 {
            return Err(fail("argmax: the tuned top-k variant is not k = 1".into()));
        }
        RowTopkOp {
            logits: logits.f32("argmax")?,
            values,
            indices,
            rows,
            n,
        }
        .launch(&k, self.stream())?;
        Ok(())
    }
}
