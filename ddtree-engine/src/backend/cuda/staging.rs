//! Staged inputs and row movement: per-forward uploads kept at fixed addresses (CUDA graphs read
//! them there), index buffers, row gathers, concatenation and copies back to the host.

#[allow(unused_imports)]
use super::*;
use ddtree_kernels::elementwise::op::CopyRowsOp;
use ddtree_kernels::norm::op::CastF32Bf16Op;

/// Upload slots whose last contents are kept on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Staged {
    /// A forward's token ids.
    Tokens,
    /// A forward's token positions.
    Positions,
    /// A forward's attention mask.
    Mask,
    /// The cache length before a forward, one value (kernels read it on the device).
    Lens,
}

impl CudaBackend {
    /// `0, 1, .., n - 1` on the device.
    pub(super) fn identity(&self, n: usize) -> Result<Arc<CudaSlice<u32>>> {
        let mut st = self.state();
        if st.identity.len() < n {
            st.graphs.replaced("the identity index buffer");
            let ids: Vec<u32> = (0..n.next_power_of_two() as u32).collect();
            st.identity = Arc::new(self.upload(&ids)?);
        }
        Ok(st.identity.clone())
    }

    /// `v` on the device in slot `slot`'s buffer: copied there unless the slot holds the same
    /// values already; the buffer keeps its address unless `v` outgrows it.
    pub(super) fn staged(&self, slot: Staged, v: &[u32]) -> Result<Arc<CudaSlice<u32>>> {
        let mut st = self.state();
        let st = &mut *st;
        if st.graphs.on_device.is_some() && slot != Staged::Lens {
            // A device round's tree, written by a kernel: `v` only stands in for its shape.
            return match st.staged.iter().find(|(s, ..)| *s == slot) {
                Some((_, None, d)) if d.len() >= v.len() => Ok(d.clone()),
                _ => Err(fail(format!(
                    "{slot:?}: a device-staged step without a device-written buffer of {} values",
                    v.len()
                ))),
            };
        }
        if let Some(i) = st.staged.iter().position(|(s, ..)| *s == slot) {
            let (_, old, d) = &mut st.staged[i];
            if old.as_deref() == Some(v) {
                return Ok(d.clone());
            }
            if st.graphs.recording() {
                // Nothing runs while recording: a copy here would be lost. The forward's inputs
                // were staged before the recording began; anything else spoils it.
                st.graphs.spoil(format!("{slot:?} changed while recording"));
                return Ok(d.clone());
            }
            if d.len() >= v.len() {
                if let Some(buf) = Arc::get_mut(d) {
                    if !v.is_empty() {
                        self.main
                            .memcpy_htod(v, &mut buf.slice_mut(..v.len()))
                            .map_err(drv("copying to the GPU"))?;
                        self.after_main()?;
                    }
                    *old = Some(v.to_vec());
                    return Ok(d.clone());
                }
            }
            st.staged.remove(i);
        }
        st.graphs.replaced("a staging buffer");
        // On the main stream (see `upload`).
        // SAFETY: the first `v.len()` values are written here, the rest never read.
        let mut d = unsafe { self.main.alloc::<u32>(v.len().next_power_of_two().max(64)) }
            .map_err(drv("allocating GPU memory"))?;
        if !v.is_empty() {
            self.main
                .memcpy_htod(v, &mut d.slice_mut(..v.len()))
                .map_err(drv("copying to the GPU"))?;
        }
        self.after_main()?;
        let d = Arc::new(d);
        st.staged.push((slot, Some(v.to_vec()), d.clone()));
        Ok(d)
    }

    /// Copies `rows` rows: `dst[r, dst_off..] = src[idx[r], src_off..]`, `cols` values each.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn copy_rows(
        &self,
        src: &impl ddtree_runtime::cudarc::driver::DevicePtr<bf16>,
        idx: &CudaSlice<u32>,
        dst: &mut impl ddtree_runtime::cudarc::driver::DevicePtrMut<bf16>,
        rows: usize,
        cols: usize,
        (src_stride, src_off): (usize, usize),
        (dst_stride, dst_off): (usize, usize),
    ) -> Result<()> {
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let k = self.first_variant::<CopyRows>(|_: &CopyParams| true)?;
        let op = CopyRowsOp {
            src,
            idx,
            dst,
            rows,
            cols,
            src_at: (src_stride, src_off),
            dst_at: (dst_stride, dst_off),
        };
        // SAFETY: the callers' indices name rows inside src at its stride.
        unsafe { op.launch_bf16(&k, self.stream())? };
        Ok(())
    }

    /// [`Backend::to_host`] on the GPU.
    pub(super) fn to_host(&self, x: &CudaTensor) -> Result<Matrix> {
        let _span = self.profile.span("to_host");
        let n = x.rows * x.cols;
        let data = match &x.data {
            DeviceData::Bf16(d) => {
                let v: Vec<bf16> = self.read_back(&d.slice(..n))?;
                v.into_iter().map(f32::from).collect()
            }
            DeviceData::F32(d) => self.read_back(&d.slice(..n))?,
        };
        Ok(Matrix {
            rows: x.rows,
            cols: x.cols,
            data,
        })
    }

    /// [`Backend::take_rows`] on the GPU.
    pub(super) fn take_rows(&self, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor> {
        let _span = self.profile.span("take_rows");
        if let Some(&r) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(fail(format!("take_rows: row {r} of {}", x.rows)));
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = self.upload(&idx)?;
        let mut out = self.tensor_bf16(rows.len(), x.cols)?;
        match &x.data {
            DeviceData::Bf16(src) => {
                let dst = out.bf16_mut("take_rows")?;
                self.copy_rows(src, &idx, dst, rows.len(), x.cols, (x.cols, 0), (x.cols, 0))?;
            }
            DeviceData::F32(src) => {
                // Rows of the f32 residual stream come out as bf16 activations (features).
                let n = rows.len() * x.cols;
                let mut picked = self.alloc::<f32>(n)?;
                let k = self.first_variant::<CopyRowsF32>(|_: &CopyParams| true)?;
                let op = CopyRowsOp {
                    src,
                    idx: &idx,
                    dst: &mut picked,
                    rows: rows.len(),
                    cols: x.cols,
                    src_at: (x.cols, 0),
                    dst_at: (x.cols, 0),
                };
                // SAFETY: src is [x.rows, cols] and every index is below x.rows (checked above).
                unsafe { op.launch_f32(&k, self.stream())? };
                let c = self.first_variant::<CastF32Bf16>(|_: &CastParams| true)?;
                CastF32Bf16Op {
                    src: &picked,
                    dst: out.bf16_mut("take_rows")?,
                    n,
                }
                .launch(&c, self.stream())?;
            }
        }
        Ok(out)
    }

    /// [`Backend::concat_cols`] on the GPU.
    pub(super) fn concat_cols(&self, parts: &[&CudaTensor]) -> Result<CudaTensor> {
        let _span = self.profile.span("concat_cols");
        let rows = parts.first().map_or(0, |p| p.rows);
        if parts.iter().any(|p| p.rows != rows) {
            return Err(fail("concat_cols: parts differ in rows".into()));
        }
        let cols: usize = parts.iter().map(|p| p.cols).sum();
        let idx = self.identity(rows)?;
        let mut out = self.tensor_bf16(rows, cols)?;
        let mut off = 0;
        for p in parts {
            let dst = out.bf16_mut("concat_cols")?;
            self.copy_rows(
                p.bf16("concat_cols")?,
                &idx,
                dst,
                rows,
                p.cols,
                (p.cols, 0),
                (cols, off),
            )?;
            off += p.cols;
        }
        Ok(out)
    }
}
