//! Attention ops of the CUDA backend: rope, the MLA latent-cache path (append, absorbed query and output,
//! the verify attention and its variant choice) and the drafter's GQA attention.

#[allow(unused_imports)]
use super::*;
use ddtree_kernels::attention::op::{
    GqaAttentionOp, MlaAbsorbOutputOp, MlaAbsorbQueryOp, MlaAttentionOp, MlaKvAppendOp,
};
use ddtree_kernels::elementwise::op::RopeOp;
use ddtree_kernels::tree::tune_verify::{self, MlaVerify, VerifyKernels};

/// The tensor-core kernel of the MLA verify attention (the decode step's and the tree's). Its
/// tune keys (`mla_verify`) carry the choice: a tuned GPU runs the best variant and split count
/// among the kernels it allows, an untuned one the hand-chosen variant below.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum AttentionKernel {
    /// `mla_verify_narrow` for steps of at most 8 query rows (a decode step of 8 heads),
    /// `wgmma` for trees and for longer decode steps past [`WG_DECODE_MIN_KEYS`] keys, `mma`
    /// for shorter ones: the faster one of each case on the H200.
    #[default]
    Auto,
    /// `mla_verify_wg` only: warpgroup MMA (`wgmma`, sm_90), 64 query rows per block.
    Wgmma,
    /// `mla_verify_wide` only: warp-level `mma.sync`, 32 or 64 query rows per block.
    Mma,
}

pub use ddtree_kernels::tree::tune_verify::WG_DECODE_MIN_KEYS;

impl AttentionKernel {
    /// The verify attention's kernels this choice allows (its tune keys carry it).
    pub(super) fn verify_kernels(self) -> VerifyKernels {
        match self {
            AttentionKernel::Auto => VerifyKernels::Auto,
            AttentionKernel::Wgmma => VerifyKernels::Wgmma,
            AttentionKernel::Mma => VerifyKernels::Mma,
        }
    }
}

/// Most tokens for which `mla_query` uses the one-launch absorbed-MLA kernel
/// (`mla_absorb_query`: every weight byte read once, the tokens looped in the kernel, the rope
/// fused); above it cuBLAS's batched GEMM, a row copy and the rope kernel, whose tensor cores
/// win once the tokens make the weights worth reusing (`kernel-check --decode-ops`,
/// docs/journal/decode-ops.md).
pub(super) const MLA_ABSORB_QUERY_MAX_ROWS: usize = 4;

/// Most tokens for which `mla_output` uses `mla_absorb_output` instead of cuBLAS's batched
/// GEMM (the same trade as [`MLA_ABSORB_QUERY_MAX_ROWS`], with an earlier crossover).
pub(super) const MLA_ABSORB_OUTPUT_MAX_ROWS: usize = 2;

/// The attention kernel choice for a GPU of compute capability `cc`: `wgmma` exists on sm_90
/// (Hopper) only, so `auto` falls back to `mma` elsewhere and an explicit `wgmma` is an error.
pub(super) fn resolve_attention(kind: AttentionKernel, cc: (i32, i32)) -> Result<AttentionKernel> {
    match kind {
        _ if ddtree_kernels::wgmma_supported(cc) => Ok(kind),
        AttentionKernel::Auto => Ok(AttentionKernel::Mma),
        AttentionKernel::Mma => Ok(kind),
        AttentionKernel::Wgmma => Err(EngineError::Backend {
            backend: "cuda".into(),
            reason: format!(
                "--attention wgmma needs an sm_90 (Hopper) GPU, this one is sm_{}{}; use --attention mma or auto",
                cc.0, cc.1
            ),
        }),
    }
}

/// Most tokens for which `mla_attention_output` merges the split partials inside the absorbed
/// output projection (`mla_combine_output`: one launch, the latent rows never in global memory)
/// instead of `mla_verify_combine` and then `mla_output`: the decode step (and a two-token
/// verify), where `mla_output` itself takes the absorbed kernel.
pub(crate) const MLA_COMBINE_OUTPUT_MAX_ROWS: usize = MLA_ABSORB_OUTPUT_MAX_ROWS;

/// Split count of the verify attention's partial buffers: rows x splits.
pub(crate) const VERIFY_PARTIALS: usize = tune_verify::MAX_ROWS_SPLITS;

impl CudaBackend {
    /// Rope tables covering `positions` positions for `rope` (grown on demand).
    pub(super) fn rope_tables(&self, rope: &Rope, max_position: u32) -> Result<Arc<RopeTables>> {
        let need = max_position as usize + 1;
        let mut st = self.state();
        if let Some(t) = st.ropes.iter().find(|t| t.rope == *rope && t.positions >= need) {
            return Ok(t.clone());
        }
        st.graphs.replaced("rope tables");
        let positions = need.max(st.max_capacity).next_power_of_two().max(4096);
        let (cos, sin) = rope.tables(positions);
        let t = Arc::new(RopeTables {
            rope: rope.clone(),
            positions,
            cos: self.upload(&cos)?,
            sin: self.upload(&sin)?,
        });
        st.ropes.retain(|old| old.rope != *rope);
        st.ropes.push(t.clone());
        Ok(t)
    }

    pub(super) fn rope_variant(&self, rope: &Rope) -> Result<Arc<CompiledKernel<RopeInterleaved>>> {
        let (dim, interleave) = (rope.dim() as u32, rope.interleaved());
        self.first_variant::<RopeInterleaved>(|p| p.dim == dim && p.interleave == interleave)
            .map_err(|_| {
                fail(format!(
                    "no rope kernel variant for {dim} dims (interleave {interleave})"
                ))
            })
    }

    /// Ropes `rows = tokens * heads` rows of `stride` values at `offset` in place.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rope_rows(
        &self,
        x: &mut impl ddtree_runtime::cudarc::driver::DevicePtrMut<bf16>,
        rope: &Rope,
        positions: &[u32],
        heads: usize,
        stride: usize,
        offset: usize,
    ) -> Result<()> {
        let max = positions.iter().copied().max().unwrap_or(0);
        let tables = self.rope_tables(rope, max)?;
        let k = self.rope_variant(rope)?;
        let pos = self.staged(Staged::Positions, positions)?;
        let rows = positions.len() * heads;
        let pairs = rows * rope.dim() / 2;
        let grid = pairs.div_ceil(k.params().block as usize).max(1) as u32;
        let op = RopeOp {
            x,
            positions: &*pos,
            cos: &tables.cos,
            sin: &tables.sin,
            rows,
            heads,
            stride,
            offset,
            grid: Some(grid),
        };
        // SAFETY: the tables cover every position up to max.
        unsafe { op.launch(&k, self.stream())? };
        Ok(())
    }

    /// [`Backend::rope_heads`] on the GPU.
    pub(super) fn rope_heads(&self, x: &mut CudaTensor, rope: &Rope, positions: &[u32]) -> Result<()> {
        let _span = self.profile.span("rope_heads");
        let d = rope.dim();
        if x.cols % d != 0 || positions.len() != x.rows {
            return Err(fail(format!(
                "rope_heads: {}x{} input, rotary size {d}, {} positions",
                x.rows,
                x.cols,
                positions.len()
            )));
        }
        let heads = x.cols / d;
        self.rope_rows(x.bf16_mut("rope_heads")?, rope, positions, heads, d, 0)
    }

    /// [`Backend::mla_append_kv`] on the GPU.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mla_append_kv(
        &self,
        kv_a: &CudaTensor,
        norm: &CudaVector,
        eps: f32,
        rope: &Rope,
        positions: &[u32],
        cache: &mut CudaKvCache,
        layer: usize,
    ) -> Result<()> {
        let _span = self.profile.span("mla_append_kv");
        let lora = norm.len;
        let width = cache.width;
        if kv_a.cols != width || layer >= cache.lens.len() || lora > width || positions.len() != kv_a.rows {
            return Err(fail(format!("mla_append_kv: bad layer {layer} or shapes")));
        }
        let start = cache.lens[layer];
        if start + kv_a.rows > cache.capacity {
            return Err(EngineError::Forward(format!(
                "KV cache full: {start} + {} rows exceed its capacity of {}",
                kv_a.rows, cache.capacity
            )));
        }
        let max = positions.iter().copied().max().unwrap_or(0);
        let tables = self.rope_tables(rope, max)?;
        let pos = self.staged(Staged::Positions, positions)?;
        let lens = self.staged(Staged::Lens, &[start as u32])?;
        let k = self.variant::<MlaKvAppend>(&ddtree_kernels::attention::mla::choose_append(lora, width - lora))?;
        let mut dst = cache.layer_mut(layer);
        let op = MlaKvAppendOp {
            kv_a: kv_a.bf16("mla_append_kv")?,
            norm: &norm.bf16,
            positions: &*pos,
            cos: &tables.cos,
            sin: &tables.sin,
            cache: &mut dst,
            lens: &*lens,
            rows: kv_a.rows,
            lora,
            rope: width - lora,
            eps,
        };
        // SAFETY: start + rows fit the layer's capacity (checked above); the tables cover max.
        unsafe { op.launch(&k, self.stream())? };
        if !rope.interleaved() {
            // The kernel ropes adjacent pairs; for the half-split layout put the raw k_pe back
            // and rope it with the rotate-half variant in place (at a host-side offset: a
            // recording of this cannot be replayed at another length).
            self.state().graphs.spoil("half-split rope of the latent cache".into());
            let idx = self.identity(kv_a.rows)?;
            let rope_dim = width - lora;
            let mut rows = dst.slice_mut(start * width..(start + kv_a.rows) * width);
            let src = kv_a.bf16("mla_append_kv")?;
            self.copy_rows(src, &idx, &mut rows, kv_a.rows, rope_dim, (width, lora), (width, lora))?;
            self.rope_rows(&mut rows, rope, positions, 1, width, lora)?;
        }
        cache.lens[layer] = start + kv_a.rows;
        Ok(())
    }

    /// [`Backend::mla_query`] on the GPU.
    pub(super) fn mla_query(
        &self,
        q: &CudaTensor,
        kv_b: &CudaWeight,
        rope: &Rope,
        positions: &[u32],
        d: MlaDims,
    ) -> Result<CudaTensor> {
        let _span = self.profile.span("mla_query");
        let qk = d.nope + d.rope;
        let lw = d.latent_width();
        let CudaWeight::Dense { w, out, inp } = kv_b else {
            return Err(fail("mla_query: kv_b must be dense".into()));
        };
        if q.cols != d.heads * qk || (*out, *inp) != (d.heads * (d.nope + d.v), d.kv_lora) || positions.len() != q.rows
        {
            return Err(fail("mla_query: q, kv_b or positions do not match the MLA dims".into()));
        }
        let t = q.rows;
        let mut q_abs = self.tensor_bf16(t, d.heads * lw)?;
        let absorb = Lookup::mla_absorb_query(t, d.heads, d.kv_lora, d.nope, d.rope, d.v, rope.interleaved());
        if let Some(lookup) = absorb {
            let kern = self.tuned::<MlaAbsorbQuery>(lookup)?;
            let max = positions.iter().copied().max().unwrap_or(0);
            let tables = self.rope_tables(rope, max)?;
            let pos = self.staged(Staged::Positions, positions)?;
            let op = MlaAbsorbQueryOp {
                q: q.bf16("mla_query")?,
                kv_b: w,
                positions: &*pos,
                cos: &tables.cos,
                sin: &tables.sin,
                out: q_abs.bf16_mut("mla_query")?,
                rows: t,
                heads: d.heads,
                lora: d.kv_lora,
                v: d.v,
            };
            // SAFETY: the tables cover every position up to max.
            unsafe { op.launch(&kern, self.stream())? };
            return Ok(q_abs);
        }
        let g = BatchedGemm {
            m: t,
            n: d.kv_lora,
            k: d.nope,
            batch: d.heads,
            a: Strided {
                offset: 0,
                ld: d.heads * qk,
                stride: qk,
            },
            b: Strided {
                offset: 0,
                ld: d.kv_lora,
                stride: (d.nope + d.v) * d.kv_lora,
            },
            b_op: RightOperand::Plain,
            c: Strided {
                offset: 0,
                ld: d.heads * lw,
                stride: lw,
            },
        };
        let qv = q.bf16("mla_query")?;
        // SAFETY: the strides stay inside q [t, heads * qk], kv_b and q_abs [t, heads * lw].
        unsafe { self.blas().batched(&g, qv, w, q_abs.bf16_mut("mla_query")?)? };
        let idx = self.identity(t * d.heads)?;
        self.copy_rows(
            qv,
            &idx,
            q_abs.bf16_mut("mla_query")?,
            t * d.heads,
            d.rope,
            (qk, d.nope),
            (lw, d.kv_lora),
        )?;
        self.rope_rows(q_abs.bf16_mut("mla_query")?, rope, positions, d.heads, lw, d.kv_lora)?;
        Ok(q_abs)
    }

    /// [`Backend::mla_attention`] on the GPU.
    pub(super) fn mla_attention(
        &self,
        q_abs: &CudaTensor,
        cache: &CudaKvCache,
        layer: usize,
        span: AttentionSpan<'_>,
        d: MlaDims,
        scale: f32,
    ) -> Result<CudaTensor> {
        self.attend(q_abs, cache, layer, span, d, scale, None)
    }

    /// [`Backend::mla_attention_output`] on the GPU.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mla_attention_output(
        &self,
        q_abs: &CudaTensor,
        cache: &CudaKvCache,
        layer: usize,
        span: AttentionSpan<'_>,
        d: MlaDims,
        scale: f32,
        kv_b: &CudaWeight,
    ) -> Result<CudaTensor> {
        let n = q_abs.rows;
        match kv_b {
            CudaWeight::Dense { w, out, inp }
                if n <= MLA_COMBINE_OUTPUT_MAX_ROWS
                    && d.kv_lora == LATENT
                    && d.rope == ROPE
                    && n * d.heads <= VERIFY_PARTIALS
                    && (*out, *inp) == (d.heads * (d.nope + d.v), d.kv_lora) =>
            {
                self.attend(q_abs, cache, layer, span, d, scale, Some(w))
            }
            _ => {
                let o_lat = self.attend(q_abs, cache, layer, span, d, scale, None)?;
                self.mla_output(&o_lat, kv_b, d)
            }
        }
    }

    /// [`Backend::mla_output`] on the GPU.
    pub(super) fn mla_output(&self, o_lat: &CudaTensor, kv_b: &CudaWeight, d: MlaDims) -> Result<CudaTensor> {
        let _span = self.profile.span("mla_output");
        let CudaWeight::Dense { w, out, inp } = kv_b else {
            return Err(fail("mla_output: kv_b must be dense".into()));
        };
        if o_lat.cols != d.heads * d.kv_lora || (*out, *inp) != (d.heads * (d.nope + d.v), d.kv_lora) {
            return Err(fail("mla_output: o_lat or kv_b do not match the MLA dims".into()));
        }
        let t = o_lat.rows;
        let mut o = self.tensor_bf16(t, d.heads * d.v)?;
        let absorb = (t <= MLA_ABSORB_OUTPUT_MAX_ROWS)
            .then(|| {
                <MlaAbsorbOutput as ddtree_codegen::Kernel>::space()
                    .into_iter()
                    .find(|p| p.lora as usize == d.kv_lora && d.v % p.cols as usize == 0)
            })
            .flatten();
        if let Some(p) = absorb {
            let kern = self.variant::<MlaAbsorbOutput>(&p)?;
            MlaAbsorbOutputOp {
                o_lat: o_lat.bf16("mla_output")?,
                kv_b: w,
                out: o.bf16_mut("mla_output")?,
                rows: t,
                heads: d.heads,
                nope: d.nope,
                v: d.v,
            }
            .launch(&kern, self.stream())?;
            return Ok(o);
        }
        let g = BatchedGemm {
            m: t,
            n: d.v,
            k: d.kv_lora,
            batch: d.heads,
            a: Strided {
                offset: 0,
                ld: d.heads * d.kv_lora,
                stride: d.kv_lora,
            },
            b: Strided {
                offset: d.nope * d.kv_lora,
                ld: d.kv_lora,
                stride: (d.nope + d.v) * d.kv_lora,
            },
            b_op: RightOperand::Transposed,
            c: Strided {
                offset: 0,
                ld: d.heads * d.v,
                stride: d.v,
            },
        };
        // SAFETY: the strides stay inside o_lat [t, heads * L], kv_b and o [t, heads * V].
        unsafe {
            self.blas
                .batched(&g, o_lat.bf16("mla_output")?, w, o.bf16_mut("mla_output")?)?
        };
        Ok(o)
    }

    /// [`Backend::gqa_attention`] on the GPU.
    pub(super) fn gqa_attention(
        &self,
        q: &CudaTensor,
        cache: &CudaKvCache,
        k_layer: usize,
        v_layer: usize,
        dims: GqaDims,
        scale: f32,
    ) -> Result<CudaTensor> {
        let _span = self.profile.span("gqa_attention");
        let kv_w = dims.kv_heads * dims.head_dim;
        if q.cols != dims.heads * dims.head_dim || cache.width != kv_w || k_layer.max(v_layer) >= cache.lens.len() {
            return Err(fail("gqa_attention: shapes do not match the head layout".into()));
        }
        let keys = cache.lens[k_layer];
        if cache.lens[v_layer] != keys {
            return Err(fail("gqa_attention: key and value layers differ in length".into()));
        }
        let mut out = self.tensor_bf16(q.rows, q.cols)?;
        let k = self.first_variant::<GqaAttention>(|_: &GqaParams| true)?;
        GqaAttentionOp {
            q: q.bf16("gqa_attention")?,
            k: &cache.layer(k_layer),
            v: &cache.layer(v_layer),
            out: out.bf16_mut("gqa_attention")?,
            rows: q.rows,
            keys,
            heads: dims.heads,
            kv_heads: dims.kv_heads,
            head_dim: dims.head_dim,
            scale,
        }
        .launch(&k, self.stream())?;
        Ok(out)
    }

    /// [`Backend::mla_attention`]; with `kv_b` (`W_UV`'s source, `[heads (nope + v), kv_lora]`,
    /// for Kimi's 576-wide rows and at most `VERIFY_PARTIALS` rows) the split pass's partials go
    /// straight into the absorbed output projection ([`Backend::mla_attention_output`]'s fused
    /// path) and the result is `[T, heads v]`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend(
        &self,
        q_abs: &CudaTensor,
        cache: &CudaKvCache,
        layer: usize,
        span: AttentionSpan<'_>,
        d: MlaDims,
        scale: f32,
        kv_b: Option<&CudaSlice<bf16>>,
    ) -> Result<CudaTensor> {
        let _span = self.profile.span("mla_attention");
        let lw = d.latent_width();
        let n = q_abs.rows;
        if q_abs.cols != d.heads * lw || layer >= cache.lens.len() || cache.width != lw {
            return Err(fail(format!("mla_attention: bad layer {layer} or widths")));
        }
        if cache.lens[layer] != span.prefix_len + n {
            return Err(fail(format!(
                "mla_attention: cache holds {} rows, expected prefix {} + {n} new",
                cache.lens[layer], span.prefix_len
            )));
        }
        let (mask, words) = match span.mask {
            Some(m) => (self.staged(Staged::Mask, m.words())?, m.words_per_row()),
            None => {
                let chain = AncestorMask::causal(n);
                (self.staged(Staged::Mask, chain.words())?, chain.words_per_row())
            }
        };
        let lens = self.staged(Staged::Lens, &[span.prefix_len as u32])?;
        let mut out = self.tensor_bf16(n, d.heads * d.kv_lora)?;
        let q = q_abs.bf16("mla_attention")?;
        let kv = cache.layer(layer);
        // The split-KV tensor-core kernel for Kimi's 576-wide rows (any node count: rows are
        // independent and the mask is read per row); the generic kernel for other widths.
        // The variant and split count are chosen for the length bucket (the kernel reads the
        // length itself), so one recorded graph serves every length of its bucket.
        let bucket = graph::length_bucket(span.prefix_len + n);
        let kernels = self.attention.verify_kernels();
        let lookup = Lookup::mla_verify(n, bucket, d, kv_b.is_some(), kernels);
        if let Some(lookup) = lookup {
            // The tuned variant and split rule, else the hand-chosen ones (`default_variant`, `verify_splits`).
            let choice = self.tuned_params::<MlaVerify>(lookup)?;
            let sms = self.gpu().fingerprint().sm_count as usize;
            let splits = choice.split_count(sms, n * d.heads, bucket, VERIFY_PARTIALS);
            let mut st = self.state();
            let st = &mut *st;
            let at = match st.verify.iter().position(|v| *v.variant() == choice.variant) {
                Some(i) => i,
                None => {
                    st.graphs.replaced("the verify attention partials");
                    st.verify
                        .push(tree::gpu::GpuVerify::new(self.gpu(), &choice.variant, VERIFY_PARTIALS)?);
                    st.verify.len() - 1
                }
            };
            let verify = &mut st.verify[at];
            let sh = tree::gpu::VerifyShape {
                nodes: n,
                heads: d.heads,
                prefix: bucket - n,
                words,
                scale,
            };
            if let Some(w) = kv_b {
                let mut o = self.tensor_bf16(n, d.heads * d.v)?;
                verify.run_output(
                    self.stream(),
                    &sh,
                    splits,
                    q,
                    &kv,
                    &mask,
                    &*lens,
                    w,
                    (d.nope, d.v),
                    o.bf16_mut("mla_attention")?,
                )?;
                return Ok(o);
            }
            let mut lse = self.alloc::<f32>(n * d.heads)?;
            verify.run(
                self.stream(),
                &sh,
                splits,
                q,
                &kv,
                &mask,
                &*lens,
                out.bf16_mut("mla_attention")?,
                &mut lse,
            )?;
            return Ok(out);
        }
        if kv_b.is_some() {
            return Err(fail(
                "mla_attention_output: the fused path needs Kimi's latent rows".into(),
            ));
        }
        let k = self.first_variant::<MlaAttention>(|_: &MlaAttnParams| true)?;
        let op = MlaAttentionOp {
            q,
            cache: &kv,
            mask: &*mask,
            out: out.bf16_mut("mla_attention")?,
            lens: &*lens,
            heads: d.heads,
            nodes: n,
            words,
            lora: d.kv_lora,
            rope: d.rope,
            scale,
        };
        // SAFETY: the layer holds the prefix + n rows (the cache's length bookkeeping).
        unsafe { op.launch(&k, self.stream())? };
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hand-chosen variant under `kind` (index 0 of the verify attention's candidates).
    fn verify_variant(kind: AttentionKernel, rows: usize, keys: usize) -> tree::VerifyVariant {
        tune_verify::default_variant(kind.verify_kernels(), rows, keys)
    }

    #[test]
    fn attention_kernel_follows_the_gpu() {
        assert_eq!(
            resolve_attention(AttentionKernel::Auto, (9, 0)).unwrap(),
            AttentionKernel::Auto
        );
        assert_eq!(
            resolve_attention(AttentionKernel::Auto, (8, 0)).unwrap(),
            AttentionKernel::Mma
        );
        assert_eq!(
            resolve_attention(AttentionKernel::Mma, (10, 0)).unwrap(),
            AttentionKernel::Mma
        );
        let err = resolve_attention(AttentionKernel::Wgmma, (8, 9))
            .unwrap_err()
            .to_string();
        assert!(err.contains("sm_90") && err.contains("sm_89"), "{err}");
    }

    #[test]
    fn auto_attention_picks_wgmma_for_trees_and_long_decode_steps() {
        let wg = |v: tree::VerifyVariant| matches!(v, tree::VerifyVariant::Wg(_));
        assert!(!wg(verify_variant(AttentionKernel::Auto, 64, WG_DECODE_MIN_KEYS)));
        assert!(wg(verify_variant(AttentionKernel::Auto, 64, 2 * WG_DECODE_MIN_KEYS)));
        assert!(wg(verify_variant(AttentionKernel::Auto, 9 * 64, 1024)));
        assert!(!wg(verify_variant(AttentionKernel::Mma, 9 * 64, 1 << 20)));
        assert!(wg(verify_variant(AttentionKernel::Wgmma, 64, 256)));
    }

    #[test]
    fn auto_attention_picks_the_narrow_kernel_for_eight_rows() {
        let narrow = |v: tree::VerifyVariant| v == tree::VerifyVariant::Narrow;
        assert!(narrow(verify_variant(AttentionKernel::Auto, 8, 1024)));
        assert!(narrow(verify_variant(AttentionKernel::Auto, 3, 2 * WG_DECODE_MIN_KEYS)));
        assert!(!narrow(verify_variant(AttentionKernel::Auto, 9, 1024)));
        assert!(!narrow(verify_variant(AttentionKernel::Mma, 8, 1024)));
        assert!(!narrow(verify_variant(AttentionKernel::Wgmma, 8, 1024)));
    }
}
