//! Norms and elementwise ops of the CUDA backend: embedding, RMSNorm (fused with the residual add),
//! residual adds and casts, SiLU-and-multiply.

#[allow(unused_imports)]
use super::*;
use ddtree_kernels::elementwise::op::{AddAssignOp, SiluMulSplitOp};
use ddtree_kernels::embedding::op::EmbeddingOp;
use ddtree_kernels::norm::op::{AddRmsNormOp, CastBf16F32Op, RmsNormOp};
use ddtree_kernels::vocab::op::EmbeddingSliceOp;
use ddtree_kernels::EmbeddingSlice;

impl CudaBackend {
    /// [`Backend::embedding`] on the GPU.
    pub(super) fn embedding(&self, table: &CudaTensor, ids: &[u32]) -> Result<CudaTensor> {
        self.profile.forward_rows(ids.len());
        let _span = self.profile.span("embedding");
        let hidden = table.cols;
        let k = self.tuned::<Embedding>(Lookup::embedding(ids.len(), table.rows, hidden))?;
        let d_ids = self.staged(Staged::Tokens, ids)?;
        let mut out = self.tensor_bf16(ids.len(), hidden)?;
        EmbeddingOp {
            ids: &*d_ids,
            table: table.bf16("embedding")?,
            out: out.bf16_mut("embedding")?,
            rows: ids.len(),
            hidden,
            vocab: table.rows,
        }
        .launch(&k, self.stream())?;
        Ok(out)
    }

    /// [`Backend::embedding_slice`] on the GPU: one [`EmbeddingSlice`] launch over the step's
    /// staged token ids (the global ids: no restaging, and a device round's tree tokens are
    /// read where its kernel wrote them), so a rank's step can be recorded in a CUDA graph.
    pub(super) fn embedding_slice(
        &self,
        table: &CudaTensor,
        ids: &[u32],
        vocab: std::ops::Range<usize>,
    ) -> Result<CudaTensor> {
        self.profile.forward_rows(ids.len());
        let _span = self.profile.span("embedding");
        let hidden = table.cols;
        if table.rows != vocab.len() {
            return Err(fail(format!(
                "embedding_slice: a table of {} rows for the slice {vocab:?}",
                table.rows
            )));
        }
        let k = self.first_variant::<EmbeddingSlice>(|p| !p.vec || hidden % 8 == 0)?;
        let d_ids = self.staged(Staged::Tokens, ids)?;
        let mut out = self.tensor_bf16(ids.len(), hidden)?;
        EmbeddingSliceOp {
            ids: &*d_ids,
            table: table.bf16("embedding")?,
            out: out.bf16_mut("embedding")?,
            rows: ids.len(),
            hidden,
            vocab,
        }
        .launch(&k, self.stream())?;
        Ok(out)
    }

    /// [`Backend::rms_norm`] on the GPU.
    pub(super) fn rms_norm(&self, x: &CudaTensor, weight: &CudaVector, eps: f32) -> Result<CudaTensor> {
        let _span = self.profile.span("rms_norm");
        if x.cols != weight.len {
            return Err(fail(format!("rms_norm: {} columns, weight of {}", x.cols, weight.len)));
        }
        let mut out = self.tensor_bf16(x.rows, x.cols)?;
        self.rms_rows(
            x.bf16("rms_norm")?,
            &weight.bf16,
            out.bf16_mut("rms_norm")?,
            x.rows,
            x.cols,
            eps,
        )?;
        Ok(out)
    }

    /// [`Backend::add_assign`] on the GPU.
    pub(super) fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        let _span = self.profile.span("add_assign");
        if (x.rows, x.cols) != (y.rows, y.cols) {
            return Err(fail(format!("add: {}x{} vs {}x{}", x.rows, x.cols, y.rows, y.cols)));
        }
        let n = x.rows * x.cols;
        let k = self.first_variant::<AddAssign>(|p: &AddParams| !p.vec || n % 8 == 0)?;
        AddAssignOp {
            x: x.bf16_mut("add")?,
            y: y.bf16("add")?,
            n,
        }
        .launch(&k, self.stream())?;
        Ok(())
    }

    /// [`Backend::residual`] on the GPU.
    pub(super) fn residual(&self, x: CudaTensor) -> Result<CudaTensor> {
        let _span = self.profile.span("residual");
        let n = x.rows * x.cols;
        let DeviceData::Bf16(src) = &x.data else {
            return Ok(x);
        };
        let mut dst = self.alloc::<f32>(n)?;
        let k = self.first_variant::<CastBf16F32>(|_: &CastParams| true)?;
        CastBf16F32Op { src, dst: &mut dst, n }.launch(&k, self.stream())?;
        Ok(CudaTensor {
            rows: x.rows,
            cols: x.cols,
            data: DeviceData::F32(dst),
        })
    }

    /// [`Backend::add_rms_norm`] on the GPU.
    pub(super) fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        weight: &CudaVector,
        eps: f32,
    ) -> Result<CudaTensor> {
        let _span = self.profile.span("add_rms_norm");
        if !matches!(x.data, DeviceData::F32(_)) {
            self.add_assign(x, y)?;
            return self.rms_norm(x, weight, eps);
        }
        self.residual_norm(x, y, None, weight, eps)
    }

    /// [`Backend::add2_rms_norm`] on the GPU.
    pub(super) fn add2_rms_norm(
        &self,
        x: &mut CudaTensor,
        a: CudaTensor,
        b: &CudaTensor,
        weight: &CudaVector,
        eps: f32,
    ) -> Result<CudaTensor> {
        if !matches!(x.data, DeviceData::F32(_)) {
            return unfused_add2_rms_norm(self, x, a, b, weight, eps);
        }
        let _span = self.profile.span("add2_rms_norm");
        self.residual_norm(x, &a, Some(b), weight, eps)
    }

    /// [`Backend::silu_mul`] on the GPU.
    pub(super) fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
        let _span = self.profile.span("silu_mul");
        if (gate.rows, gate.cols) != (up.rows, up.cols) {
            return Err(fail("silu_mul: gate and up differ in shape".into()));
        }
        let n = gate.rows * gate.cols;
        let k = self.first_variant::<SiluMulSplit>(|p: &SiluMulParams| !p.vec || n % 8 == 0)?;
        let grid = n
            .div_ceil(k.params().block as usize * if k.params().vec { 8 } else { 1 })
            .clamp(1, 65535) as u32;
        let mut out = self.tensor_bf16(gate.rows, gate.cols)?;
        SiluMulSplitOp {
            gate: gate.bf16("silu_mul")?,
            up: up.bf16("silu_mul")?,
            out: out.bf16_mut("silu_mul")?,
            n,
            grid: Some(grid),
        }
        .launch(&k, self.stream())?;
        Ok(out)
    }

    /// [`Backend::head_rms_norm`] on the GPU.
    pub(super) fn head_rms_norm(&self, x: &CudaTensor, weight: &CudaVector, eps: f32) -> Result<CudaTensor> {
        let _span = self.profile.span("head_rms_norm");
        let d = weight.len;
        if d == 0 || x.cols % d != 0 {
            return Err(fail(format!("head_rms_norm: {} columns, heads of {d}", x.cols)));
        }
        let mut out = self.tensor_bf16(x.rows, x.cols)?;
        let rows = x.rows * x.cols / d;
        self.rms_rows(
            x.bf16("head_rms_norm")?,
            &weight.bf16,
            out.bf16_mut("head_rms_norm")?,
            rows,
            d,
            eps,
        )?;
        Ok(out)
    }

    /// [`Backend::add_rms_norm`] (`z` `None`) and [`Backend::add2_rms_norm`] on the f32 residual
    /// stream `x`: one [`AddRmsNorm`] launch adding `y` (or `bf16(y + z)`) into `x` and
    /// normalizing it.
    pub(super) fn residual_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        z: Option<&CudaTensor>,
        weight: &CudaVector,
        eps: f32,
    ) -> Result<CudaTensor> {
        let (rows, n) = (x.rows, x.cols);
        let fits = |t: &CudaTensor| (t.rows, t.cols) == (rows, n);
        if !fits(y) || !z.is_none_or(fits) || n != weight.len {
            return Err(fail(format!(
                "add_rms_norm: {rows}x{n} += {}x{}{}, weight of {}",
                y.rows,
                y.cols,
                z.map_or(String::new(), |z| format!(" + {}x{}", z.rows, z.cols)),
                weight.len
            )));
        }
        let addends = if z.is_some() { 2 } else { 1 };
        let p = residual::choose_add_rms_norm(rows, n, addends)
            .ok_or_else(|| fail(format!("add_rms_norm: no variant with {addends} addend(s)")))?;
        let k = self.variant::<AddRmsNorm>(&p)?;
        let mut out = self.tensor_bf16(rows, n)?;
        let xf = match &mut x.data {
            DeviceData::F32(xf) => xf,
            DeviceData::Bf16(_) => return Err(fail("add_rms_norm: the residual stream is not f32".into())),
        };
        AddRmsNormOp {
            x: xf,
            y: y.bf16("add_rms_norm")?,
            z: z.map(|z| z.bf16("add_rms_norm")).transpose()?,
            weight: &weight.bf16,
            out: out.bf16_mut("add_rms_norm")?,
            rows,
            n,
            eps,
        }
        .launch(&k, self.stream())?;
        Ok(out)
    }

    /// RMSNorm of `rows` rows of `n` values with the tuned variant for the shape.
    pub(super) fn rms_rows(
        &self,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
        rows: usize,
        n: usize,
        eps: f32,
    ) -> Result<()> {
        let k = self.tuned::<RmsNorm>(Lookup::rms_norm(rows, n))?;
        RmsNormOp {
            x,
            weight: w,
            out,
            rows,
            n,
            eps,
        }
        .launch(&k, self.stream())?;
        Ok(())
    }
}
