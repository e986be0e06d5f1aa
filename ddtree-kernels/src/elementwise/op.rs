//! Host ops of the elementwise family: [`AddAssignOp`], [`SiluMulOp`], [`SiluMulSplitOp`], [`RopeOp`], the row copies
//! [`CopyRowsOp`] (bf16 [`CopyRows`] and f32 [`CopyRowsF32`]) and the random fills
//! [`FillBf16Op`], [`FillF32Op`], [`FillU32Op`].

use std::sync::Arc;

use ddtree_codegen::Kernel;
use ddtree_runtime::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use ddtree_runtime::{CompiledKernel, RuntimeError};
use half::bf16;

use super::add::{self, AddAssign};
use super::copy_rows::{self, CopyRows};
use super::fill::{self, FillRandomBf16, FillRandomF32, FillRandomU32};
use super::rope::{self, RopeInterleaved};
use super::silu_mul::{self, SiluMul, SiluMulSplit};
use crate::norm::residual::CopyRowsF32;
use crate::op::{holds, require, size32};

/// `x += y` over `n` bf16 elements, in place ([`AddAssign`], grid [`add::grid`]).
pub struct AddAssignOp<'a, X, Y> {
    /// Updated in place, `[n]`.
    pub x: &'a mut X,
    /// Addend, `[n]`.
    pub y: &'a Y,
    /// Elements.
    pub n: usize,
}

impl<X: DevicePtrMut<bf16>, Y: DevicePtr<bf16>> AddAssignOp<'_, X, Y> {
    /// Checks the sizes and the variant (`vec` needs `n % 8 == 0`) and launches `k` on `stream`.
    pub fn launch(self, k: &CompiledKernel<AddAssign>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = AddAssign::NAME;
        holds(name, "x", &*self.x, self.n)?;
        holds(name, "y", self.y, self.n)?;
        let n = size32(name, "n", self.n)?;
        require(name, !k.params().vec || n % 8 == 0, || {
            format!("{:?} needs n % 8 == 0, n = {n}", k.params())
        })?;
        // SAFETY: both hold n values and the variant takes n (checked above).
        unsafe { AddAssign::launch(k, stream, add::grid(k.params(), n), self.x, self.y, n) }
    }
}

/// `out = silu(gate) * up` over `n` bf16 elements ([`SiluMulSplit`]).
pub struct SiluMulSplitOp<'a, G, U, O> {
    /// Gate, `[n]`.
    pub gate: &'a G,
    /// Up, `[n]`.
    pub up: &'a U,
    /// Output, `[n]`.
    pub out: &'a mut O,
    /// Elements.
    pub n: usize,
    /// Blocks (the kernel strides over any grid); `None`: [`silu_mul::grid_split`].
    pub grid: Option<u32>,
}

impl<G: DevicePtr<bf16>, U: DevicePtr<bf16>, O: DevicePtrMut<bf16>> SiluMulSplitOp<'_, G, U, O> {
    /// Checks the sizes and the variant (`vec` needs `n % 8 == 0`) and launches `k` on `stream`.
    pub fn launch(self, k: &CompiledKernel<SiluMulSplit>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = SiluMulSplit::NAME;
        holds(name, "gate", self.gate, self.n)?;
        holds(name, "up", self.up, self.n)?;
        holds(name, "out", &*self.out, self.n)?;
        require(name, !k.params().vec || self.n % 8 == 0, || {
            format!("{:?} needs n % 8 == 0, n = {}", k.params(), self.n)
        })?;
        let grid = self.grid.unwrap_or_else(|| silu_mul::grid_split(k.params(), self.n));
        let n = size32(name, "n", self.n)?;
        // SAFETY: all three hold n values and the variant takes n (checked above).
        unsafe { SiluMulSplit::launch(k, stream, grid, self.gate, self.up, self.out, n) }
    }
}

/// An indexed, strided row copy: for `r < rows`, `c < cols`,
/// `dst[r * dst_stride + dst_off + c] = src[idx[r] * src_stride + src_off + c]`, one block per
/// row ([`CopyRows`] for bf16, [`CopyRowsF32`] for f32).
pub struct CopyRowsOp<'a, S, I, D> {
    /// Source rows.
    pub src: &'a S,
    /// Source row of each destination row, `[rows]`.
    pub idx: &'a I,
    /// Destination.
    pub dst: &'a mut D,
    /// Rows copied.
    pub rows: usize,
    /// Columns copied per row.
    pub cols: usize,
    /// Source row stride and first column.
    pub src_at: (usize, usize),
    /// Destination row stride and first column.
    pub dst_at: (usize, usize),
}

impl<S, I: DevicePtr<u32>, D> CopyRowsOp<'_, S, I, D> {
    /// The host-side checks: `idx` holds `rows` entries, `dst` the last copied element, and
    /// every size fits `u32`. Returns the kernel's size arguments.
    fn sizes(&self, name: &str, dst_len: usize) -> Result<[u32; 6], RuntimeError> {
        holds(name, "idx", self.idx, self.rows)?;
        let (ds, d0) = self.dst_at;
        let end = (self.rows.max(1) - 1) * ds + d0 + self.cols;
        require(name, self.rows == 0 || dst_len >= end, || {
            format!("`dst` holds {dst_len} elements, the last row ends at {end}")
        })?;
        Ok([
            size32(name, "rows", self.rows)?,
            size32(name, "cols", self.cols)?,
            size32(name, "src_stride", self.src_at.0)?,
            size32(name, "src_off", self.src_at.1)?,
            size32(name, "dst_stride", ds)?,
            size32(name, "dst_off", d0)?,
        ])
    }
}

impl<S: DevicePtr<bf16>, I: DevicePtr<u32>, D: DevicePtrMut<bf16>> CopyRowsOp<'_, S, I, D> {
    /// Checks what the host can see and launches `k` ([`CopyRows`]) on `stream`.
    ///
    /// # Safety
    /// Every `idx[r]` (`r < rows`) names a source row inside `src`:
    /// `idx[r] * src_stride + src_off + cols <= src.len()` (the indices live on the device).
    pub unsafe fn launch_bf16(
        self,
        k: &CompiledKernel<CopyRows>,
        stream: &Arc<CudaStream>,
    ) -> Result<(), RuntimeError> {
        let [rows, cols, ss, so, ds, d0] = self.sizes(CopyRows::NAME, self.dst.len())?;
        // SAFETY: idx and dst checked above; the source rows are the caller's contract.
        unsafe {
            CopyRows::launch(
                k,
                stream,
                copy_rows::grid(rows),
                self.src,
                self.idx,
                self.dst,
                rows,
                cols,
                ss,
                so,
                ds,
                d0,
            )
        }
    }
}

impl<S: DevicePtr<f32>, I: DevicePtr<u32>, D: DevicePtrMut<f32>> CopyRowsOp<'_, S, I, D> {
    /// [`CopyRowsOp::launch_bf16`] for f32 rows ([`CopyRowsF32`]).
    ///
    /// # Safety
    /// As [`CopyRowsOp::launch_bf16`]: every `idx[r]` names a source row inside `src`.
    pub unsafe fn launch_f32(
        self,
        k: &CompiledKernel<CopyRowsF32>,
        stream: &Arc<CudaStream>,
    ) -> Result<(), RuntimeError> {
        let [rows, cols, ss, so, ds, d0] = self.sizes(CopyRowsF32::NAME, self.dst.len())?;
        // SAFETY: idx and dst checked above; the source rows are the caller's contract.
        unsafe {
            CopyRowsF32::launch(
                k,
                stream,
                copy_rows::grid(rows),
                self.src,
                self.idx,
                self.dst,
                rows,
                cols,
                ss,
                so,
                ds,
                d0,
            )
        }
    }
}

/// `n` random bf16 values uniform in `[lo, hi)` from `seed` ([`FillRandomBf16`], grid
/// [`fill::grid`]; [`fill::reference_bf16`] reproduces them).
pub struct FillBf16Op<'a, O> {
    /// Output, `[n]`.
    pub out: &'a mut O,
    /// Elements.
    pub n: usize,
    /// Seed (the values depend only on seed, index and range).
    pub seed: u32,
    /// Lower bound.
    pub lo: f32,
    /// Upper bound (exclusive).
    pub hi: f32,
}

impl<O: DevicePtrMut<bf16>> FillBf16Op<'_, O> {
    /// Checks the size and launches `k` on `stream`.
    pub fn launch(self, k: &CompiledKernel<FillRandomBf16>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = FillRandomBf16::NAME;
        holds(name, "out", &*self.out, self.n)?;
        let n = size32(name, "n", self.n)?;
        let grid = fill::grid(k.params(), self.n);
        // SAFETY: out holds n values (checked above).
        unsafe { FillRandomBf16::launch(k, stream, grid, self.out, n, self.seed, self.lo, self.hi) }
    }
}

/// [`FillBf16Op`] for f32 values ([`FillRandomF32`]; [`fill::reference_f32`]).
pub struct FillF32Op<'a, O> {
    /// Output, `[n]`.
    pub out: &'a mut O,
    /// Elements.
    pub n: usize,
    /// Seed.
    pub seed: u32,
    /// Lower bound.
    pub lo: f32,
    /// Upper bound (exclusive).
    pub hi: f32,
}

impl<O: DevicePtrMut<f32>> FillF32Op<'_, O> {
    /// Checks the size and launches `k` on `stream`.
    pub fn launch(self, k: &CompiledKernel<FillRandomF32>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = FillRandomF32::NAME;
        holds(name, "out", &*self.out, self.n)?;
        let n = size32(name, "n", self.n)?;
        let grid = fill::grid(k.params(), self.n);
        // SAFETY: out holds n values (checked above).
        unsafe { FillRandomF32::launch(k, stream, grid, self.out, n, self.seed, self.lo, self.hi) }
    }
}

/// `n` random 32-bit words from `seed` ([`FillRandomU32`]; [`fill::reference_u32`]).
pub struct FillU32Op<'a, O> {
    /// Output, `[n]`.
    pub out: &'a mut O,
    /// Words.
    pub n: usize,
    /// Seed.
    pub seed: u32,
}

impl<O: DevicePtrMut<u32>> FillU32Op<'_, O> {
    /// Checks the size and launches `k` on `stream`.
    pub fn launch(self, k: &CompiledKernel<FillRandomU32>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = FillRandomU32::NAME;
        holds(name, "out", &*self.out, self.n)?;
        let n = size32(name, "n", self.n)?;
        let grid = fill::grid(k.params(), self.n);
        // SAFETY: out holds n words (checked above).
        unsafe { FillRandomU32::launch(k, stream, grid, self.out, n, self.seed) }
    }
}

/// `out[r, j] = silu(gate_up[r, j]) * gate_up[r, d + j]` for `rows` rows of a fused gate/up
/// projection ([`SiluMul`], grid [`silu_mul::grid`]).
pub struct SiluMulOp<'a, G, O> {
    /// Gate and up, `[rows, 2 * d]` (gate columns first).
    pub gate_up: &'a G,
    /// Output, `[rows, d]`.
    pub out: &'a mut O,
    /// Rows.
    pub rows: usize,
    /// Output width.
    pub d: usize,
}

impl<G: DevicePtr<bf16>, O: DevicePtrMut<bf16>> SiluMulOp<'_, G, O> {
    /// Checks the sizes and the variant (`vec` needs `d % 8 == 0`) and launches `k` on `stream`.
    pub fn launch(self, k: &CompiledKernel<SiluMul>, stream: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let name = SiluMul::NAME;
        let (rows, d) = (self.rows, self.d);
        holds(name, "gate_up", self.gate_up, rows * 2 * d)?;
        holds(name, "out", &*self.out, rows * d)?;
        require(name, !k.params().vec || d % 8 == 0, || {
            format!("{:?} needs d % 8 == 0, d = {d}", k.params())
        })?;
        let grid = silu_mul::grid(k.params(), rows, d);
        let (rows, d) = (size32(name, "rows", rows)?, size32(name, "d", d)?);
        // SAFETY: sizes and the variant's width checked above.
        unsafe { SiluMul::launch(k, stream, grid, self.gate_up, self.out, rows, d) }
    }
}

/// RoPE in place on the variant's `dim` rope dims at `offset` of each of `rows` rows (`rows =
/// tokens * heads`, row stride `stride`), token `t` at `positions[t]` ([`RopeInterleaved`], grid
/// [`rope::grid`] unless given).
pub struct RopeOp<'a, X, P, T> {
    /// Rows rotated in place, `[rows, stride]` (the last row may end after its rope dims).
    pub x: &'a mut X,
    /// Position of each token, `[rows / heads]`.
    pub positions: &'a P,
    /// Cosine table, `[max_pos, dim / 2]`.
    pub cos: &'a T,
    /// Sine table, `[max_pos, dim / 2]`.
    pub sin: &'a T,
    /// Rows (tokens times heads).
    pub rows: usize,
    /// Heads per token.
    pub heads: usize,
    /// Row stride in elements.
    pub stride: usize,
    /// First rope element of a row.
    pub offset: usize,
    /// Blocks; `None`: [`rope::grid`].
    pub grid: Option<u32>,
}

impl<X: DevicePtrMut<bf16>, P: DevicePtr<u32>, T: DevicePtr<f32>> RopeOp<'_, X, P, T> {
    /// Checks the sizes the host can see and launches `k` on `stream`.
    ///
    /// # Safety
    /// Every position (on the device) is a row of the tables: `positions[t] * dim / 2 + dim / 2
    /// <= cos.len()` and `sin.len()`.
    pub unsafe fn launch(
        self,
        k: &CompiledKernel<RopeInterleaved>,
        stream: &Arc<CudaStream>,
    ) -> Result<(), RuntimeError> {
        let name = RopeInterleaved::NAME;
        let (rows, heads, stride, offset, dim) =
            (self.rows, self.heads, self.stride, self.offset, k.params().dim as usize);
        require(name, heads >= 1 && rows % heads == 0, || {
            format!("{rows} rows of {heads} heads")
        })?;
        require(name, offset + dim <= stride, || {
            format!("rope dims {offset}..+{dim} past a row of {stride}")
        })?;
        holds(
            name,
            "x",
            &*self.x,
            if rows == 0 {
                0
            } else {
                (rows - 1) * stride + offset + dim
            },
        )?;
        holds(name, "positions", self.positions, rows / heads)?;
        let grid = self.grid.unwrap_or_else(|| rope::grid(k.params(), rows));
        let (rows, heads) = (size32(name, "rows", rows)?, size32(name, "heads", heads)?);
        let (stride, offset) = (size32(name, "stride", stride)?, size32(name, "offset", offset)?);
        // SAFETY: x and positions checked above; the table rows are the caller's contract.
        unsafe {
            RopeInterleaved::launch(
                k,
                stream,
                grid,
                self.x,
                self.positions,
                self.cos,
                self.sin,
                rows,
                heads,
                stride,
                offset,
            )
        }
    }
}
