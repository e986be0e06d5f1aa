//! Host ops of row top-k: [`TopkRunner`] (the split or one-block-per-row path by row count,
//! with its candidate buffers) and [`RowTopkOp`] (one [`RowTopk`] launch of a given variant).

use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use ddtree_runtime::{CompiledKernel, Gpu, RuntimeError};

use super::{RowTopk, RowTopkSplit, TopkSplitParams};
use crate::op::{holds, require, size32};

/// Rows below which [`TopkRunner`] takes the split path: with fewer rows than about a quarter
/// of the SMs, one block per row leaves the GPU mostly idle, while from 32 rows on the
/// one-block-per-row kernel has blocks enough and skips the second launch.
pub const SPLIT_MAX_ROWS: usize = 32;

/// Row top-k on a [`Gpu`] for one `k`: [`RowTopkSplit`] (part + merge) for fewer than
/// [`SPLIT_MAX_ROWS`] rows, [`RowTopk`] (its default variant for `k`) otherwise.
pub struct TopkRunner {
    k: usize,
    full: CompiledKernel<RowTopk>,
    part_p: TopkSplitParams,
    part: CompiledKernel<RowTopkSplit>,
    merge: CompiledKernel<RowTopkSplit>,
    /// The split path's candidate values and columns, grown on demand.
    cand: Option<(CudaSlice<f32>, CudaSlice<u32>)>,
}

fn bad_args(reason: String) -> RuntimeError {
    RuntimeError::Launch {
        kernel: RowTopkSplit::NAME.into(),
        reason,
    }
}

impl TopkRunner {
    /// Compiles the kernels for `k` (one of the `k`s of both spaces: 1, 8, 32).
    pub fn new(gpu: &Gpu, k: usize) -> Result<TopkRunner, RuntimeError> {
        let kk = k as u32;
        let full = RowTopk::space().into_iter().find(|p| p.k == kk);
        let (Some(full), Some(part_p), Some(merge_p)) = (full, TopkSplitParams::part(kk), TopkSplitParams::merge(kk))
        else {
            return Err(bad_args(format!("no top-k variant for k = {k}")));
        };
        Ok(TopkRunner {
            k,
            full: gpu.compile::<RowTopk>(&full)?,
            part_p,
            part: gpu.compile::<RowTopkSplit>(&part_p)?,
            merge: gpu.compile::<RowTopkSplit>(&merge_p)?,
            cand: None,
        })
    }

    /// Makes sure the split path's candidate buffers hold `rows` rows of `n` columns (no-op for
    /// the one-block-per-row path); returns whether they were (re)allocated, which moves their
    /// address (a recorded CUDA graph that used the old ones is stale then).
    pub fn reserve(&mut self, s: &Arc<CudaStream>, rows: usize, n: usize) -> Result<bool, RuntimeError> {
        if rows >= SPLIT_MAX_ROWS {
            return Ok(false);
        }
        let need = rows * self.part_p.parts(n) * self.k;
        if self.cand.as_ref().is_some_and(|c| c.0.len() >= need) {
            return Ok(false);
        }
        let drv = |source| RuntimeError::Driver {
            context: "allocating top-k candidates".into(),
            source,
        };
        self.cand = Some((
            s.alloc_zeros::<f32>(need).map_err(drv)?,
            s.alloc_zeros::<u32>(need).map_err(drv)?,
        ));
        Ok(true)
    }

    /// Writes each row's `k` best (value, column) pairs of `logits` (`[rows, n]`) to `values` /
    /// `indices` (`[rows, k]`), best first, by [`reference`]'s order. Checks the sizes; grows
    /// the candidate buffers of the split path on first use of a larger shape.
    pub fn run(
        &mut self,
        s: &Arc<CudaStream>,
        logits: &CudaSlice<f32>,
        values: &mut CudaSlice<f32>,
        indices: &mut CudaSlice<u32>,
        rows: usize,
        n: usize,
    ) -> Result<(), RuntimeError> {
        let k = self.k;
        if rows == 0 || n < k || n > u32::MAX as usize / rows || logits.len() < rows * n {
            return Err(bad_args(format!(
                "{rows} rows of n = {n} need n >= k = {k} and {} logits, got {}",
                rows * n,
                logits.len()
            )));
        }
        if values.len() < rows * k || indices.len() < rows * k {
            return Err(bad_args(format!("outputs need {} entries", rows * k)));
        }
        if rows >= SPLIT_MAX_ROWS {
            // SAFETY: logits hold rows * n values with n >= k; the outputs hold rows * k.
            return unsafe { RowTopk::launch(&self.full, s, rows as u32, logits, values, indices, n as u32) };
        }
        self.reserve(s, rows, n)?;
        let parts = self.part_p.parts(n);
        let (cv, ci) = self.cand.as_mut().expect("reserved above");
        let grid = (parts as u32, rows as u32);
        // SAFETY: logits hold rows * n values; the candidates rows * parts * k; ids is unused by
        // the part pass; the merge reads rows * parts * k candidates and writes rows * k.
        unsafe {
            RowTopkSplit::launch(&self.part, s, grid, logits, indices, cv, ci, n as u32)?;
            RowTopkSplit::launch(
                &self.merge,
                s,
                (1u32, rows as u32),
                cv,
                ci,
                values,
                indices,
                (parts * k) as u32,
            )
        }
    }
}

/// The `k` best values of each of `rows` rows of `n` f32 logits and their columns, best first,
/// with one [`RowTopk`] launch (one block per row; `k` is the variant's).
pub struct RowTopkOp<'a, L, V, I> {
    /// Logits, `[rows, n]`.
    pub logits: &'a L,
    /// Best values, `[rows, k]`.
    pub values: &'a mut V,
    /// Their columns, `[rows, k]`.
    pub indices: &'a mut I,
    /// Rows.
    pub rows: usize,
    /// Row length (at least `k`).
    pub n: usize,
}

impl<L: DevicePtr<f32>, V: DevicePtrMut<f32>, I: DevicePtrMut<u32>> RowTopkOp<'_, L, V, I> {
    /// Checks the sizes (`n >= k`) and launches `kernel` on `stream`.
    pub fn launch(self, kernel: &CompiledKernel<RowTopk>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = RowTopk::NAME;
        let (rows, n, k) = (self.rows, self.n, kernel.params().k as usize);
        require(name, n >= k, || format!("rows of {n} for the top {k}"))?;
        holds(name, "logits", self.logits, rows * n)?;
        holds(name, "values", &*self.values, rows * k)?;
        holds(name, "indices", &*self.indices, rows * k)?;
        let (rows, n) = (size32(name, "rows", rows)?, size32(name, "n", n)?);
        // SAFETY: logits hold rows * n values with n >= k; the outputs rows * k (checked above).
        unsafe { RowTopk::launch(kernel, stream, rows, self.logits, self.values, self.indices, n) }
    }
}
