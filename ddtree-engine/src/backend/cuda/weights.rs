//! Weights and host data on the GPU: uploads, random weights (made on the device), the INT4 repack.

#[allow(unused_imports)]
use super::*;
use ddtree_kernels::elementwise::op::{FillBf16Op, FillF32Op, FillU32Op};
use ddtree_kernels::w4a16::op::RepackOp;

pub(super) const FILL: FillParams = FillParams { block: 256 };

/// The scale group of INT4 weights (`what`) as the CUDA W4A16 kernels take it: 32, 64 or 128
/// (the GEMMs' and the GEMV's compile-time group); any other group (the checkpoint's
/// `quantization_config` `group_size`) is an error naming `what` and the group.
pub(crate) fn supported_int4_group(group: usize, what: &str) -> Result<u32> {
    if w4gemv::takes_group(group) {
        Ok(group as u32)
    } else {
        Err(fail(format!(
            "{what}: INT4 scale group {group} (quantization_config group_size) is not supported: \
             the W4A16 kernels take groups of 32, 64 or 128"
        )))
    }
}

impl CudaBackend {
    /// Uploads checkpoint-layout INT4 words `[experts * n, k / 8]` and repacks them on the GPU
    /// into the interleaved layout.
    pub(super) fn repack(&self, packed: &[u32], n: usize, k: usize, experts: usize) -> Result<CudaSlice<u32>> {
        let src = self.upload(packed)?;
        let total = interleaved_words(n, k) * experts;
        let mut dst = self.alloc::<u32>(total)?;
        let p = RepackParams { block: 256 };
        let kern = self.variant::<W4a16Repack>(&p)?;
        RepackOp {
            src: &src,
            dst: &mut dst,
            n,
            k,
            experts,
        }
        .launch(&kern, self.stream())?;
        Ok(dst)
    }

    /// Random words (INT4 codes of every value 0..16) and constant scales, straight in the
    /// interleaved layout (random is random in any layout).
    pub(super) fn random_int4(
        &self,
        n: usize,
        k: usize,
        experts: usize,
        group: usize,
        seed: u64,
    ) -> Result<(CudaSlice<u32>, CudaSlice<u32>)> {
        let words = interleaved_words(n, k) * experts;
        let mut packed = self.alloc::<u32>(words)?;
        self.fill_u32(&mut packed, words, seed)?;
        let scale = bf16::from_f32((3.0 / k as f32).sqrt() / 8.0);
        let groups = experts * n * k.div_ceil(group);
        let scales = self.upload(&scale_words(&vec![scale; groups]))?;
        Ok((packed, scales))
    }

    pub(super) fn fill_u32(&self, out: &mut CudaSlice<u32>, n: usize, seed: u64) -> Result<()> {
        let k = self.variant::<FillRandomU32>(&FILL)?;
        check_u32("fill", n)?;
        FillU32Op {
            out,
            n,
            seed: seed as u32,
        }
        .launch(&k, self.stream())?;
        Ok(())
    }

    pub(super) fn fill_bf16(&self, out: &mut CudaSlice<bf16>, n: usize, lo: f32, hi: f32, seed: u64) -> Result<()> {
        let k = self.variant::<FillRandomBf16>(&FILL)?;
        check_u32("fill", n)?;
        FillBf16Op {
            out,
            n,
            seed: seed as u32,
            lo,
            hi,
        }
        .launch(&k, self.stream())?;
        Ok(())
    }

    /// [`Backend::load_vector`] on the GPU.
    pub(super) fn load_vector(&self, data: Vec<f32>) -> Result<CudaVector> {
        let _span = self.profile.span("load_vector");
        let half: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
        Ok(CudaVector {
            len: data.len(),
            bf16: self.upload(&half)?,
            f32: self.upload(&data)?,
        })
    }

    /// [`Backend::load_matrix`] on the GPU.
    pub(super) fn load_matrix(&self, m: Matrix) -> Result<CudaTensor> {
        let _span = self.profile.span("load_matrix");
        let half: Vec<bf16> = m.data.iter().map(|&v| bf16::from_f32(v)).collect();
        Ok(CudaTensor {
            rows: m.rows,
            cols: m.cols,
            data: DeviceData::Bf16(self.upload(&half)?),
        })
    }

    /// [`Backend::load_logits`] on the GPU.
    pub(super) fn load_logits(&self, m: Matrix) -> Result<CudaTensor> {
        let _span = self.profile.span("load_logits");
        Ok(CudaTensor {
            rows: m.rows,
            cols: m.cols,
            data: DeviceData::F32(self.upload(&m.data)?),
        })
    }

    /// [`Backend::load_weight`] on the GPU.
    pub(super) fn load_weight(&self, w: HostLinear) -> Result<CudaWeight> {
        let _span = self.profile.span("load_weight");
        match w {
            HostLinear::Dense { out, inp, data } => {
                let half: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
                Ok(CudaWeight::Dense {
                    out,
                    inp,
                    w: self.upload(&half)?,
                })
            }
            HostLinear::Int4 {
                out,
                inp,
                group_size,
                packed,
                scales,
            } => {
                supported_int4_group(group_size, &format!("INT4 weight [{out}, {inp}]"))?;
                let scales: Vec<bf16> = scales.iter().map(|&v| bf16::from_f32(v)).collect();
                Ok(CudaWeight::Int4 {
                    out,
                    inp,
                    group: group_size,
                    packed: self.repack(&packed, out, inp, 1)?,
                    scales: self.upload(&scale_words(&scales))?,
                })
            }
        }
    }

    /// [`Backend::random_weight`] on the GPU.
    pub(super) fn random_weight(
        &self,
        out: usize,
        inp: usize,
        int4_group: Option<usize>,
        seed: u64,
    ) -> Result<CudaWeight> {
        let _span = self.profile.span("random_weight");
        match int4_group {
            None => {
                let mut w = self.alloc::<bf16>(out * inp)?;
                let bound = (3.0 / inp as f32).sqrt();
                self.fill_bf16(&mut w, out * inp, -bound, bound, seed)?;
                Ok(CudaWeight::Dense { out, inp, w })
            }
            Some(group) => {
                supported_int4_group(group, &format!("INT4 weight [{out}, {inp}]"))?;
                let (packed, scales) = self.random_int4(out, inp, 1, group, seed)?;
                Ok(CudaWeight::Int4 {
                    out,
                    inp,
                    group,
                    packed,
                    scales,
                })
            }
        }
    }

    /// [`Backend::random_vector`] on the GPU.
    pub(super) fn random_vector(&self, len: usize, lo: f32, hi: f32, seed: u64) -> Result<CudaVector> {
        let _span = self.profile.span("random_vector");
        let mut half = self.alloc::<bf16>(len)?;
        self.fill_bf16(&mut half, len, lo, hi, seed)?;
        let mut f = self.alloc::<f32>(len)?;
        let k = self.variant::<FillRandomF32>(&FILL)?;
        FillF32Op {
            out: &mut f,
            n: len,
            seed: seed as u32,
            lo,
            hi,
        }
        .launch(&k, self.stream())?;
        Ok(CudaVector {
            len,
            bf16: half,
            f32: f,
        })
    }

    /// [`Backend::random_matrix`] on the GPU.
    pub(super) fn random_matrix(&self, rows: usize, cols: usize, seed: u64) -> Result<CudaTensor> {
        let _span = self.profile.span("random_matrix");
        let mut t = self.tensor_bf16(rows, cols)?;
        self.fill_bf16(t.bf16_mut("random_matrix")?, rows * cols, -1.0, 1.0, seed)?;
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddtree_kernels::tune::W4GemvKey;
    use ddtree_runtime::Tunable;

    #[test]
    fn int4_groups_other_than_32_64_128_are_an_error_naming_the_weight_and_group() {
        for g in [32, 64, 128] {
            assert_eq!(supported_int4_group(g, "w").unwrap(), g as u32);
        }
        for g in [16, 48, 256] {
            let err = supported_int4_group(g, "INT4 weight [7168, 2048]")
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("INT4 weight [7168, 2048]")
                    && err.contains(&format!("scale group {g}"))
                    && err.contains("group_size")
                    && err.contains("32, 64 or 128"),
                "{err}"
            );
        }
    }

    #[test]
    fn the_dense_int4_gemv_looks_up_the_checkpoint_group() {
        for g in [32, 64, 128] {
            match Lookup::int4_gemv(1, 2048, 7168, g) {
                Some(Lookup::Int4Gemv(key)) => assert_eq!((key.tokens, key.n, key.k, key.group), (1, 2048, 7168, g)),
                other => panic!("group {g}: {other:?}"),
            }
            assert!(!W4a16Gemv::candidates(&W4a16Gemv::bucket(&W4GemvKey {
                tokens: 3,
                n: 2048,
                k: 7168,
                group: g,
            }))
            .is_empty());
        }
        // Other groups, and K not a multiple of the group, take the GEMM.
        assert!(Lookup::int4_gemv(1, 2048, 7168, 48).is_none());
        assert!(Lookup::int4_gemv(1, 2048, 7232, 128).is_none());
        assert!(Lookup::int4_gemv(17, 2048, 7168, 64).is_none());
    }
}
