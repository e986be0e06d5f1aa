//! [`TensorComm`] for the CPU backend: host matrices through an [`InProcessComm`] group.

use std::ops::Range;

use crate::backend::{CpuBackend, Matrix};
use crate::error::Result;
use crate::parallel::comm::{argmax_reduce, Comm, CommStats, InProcessComm};
use crate::parallel::TensorComm;
use crate::spec::sampling::argmax;

/// The CPU backend's collectives: one rank's handle of an in-process group.
#[derive(Debug)]
pub struct CpuTensorComm {
    comm: InProcessComm,
}

impl CpuTensorComm {
    /// Wraps rank `comm.rank()`'s handle.
    pub fn new(comm: InProcessComm) -> Self {
        Self { comm }
    }

    /// Marks the rank as done (see [`InProcessComm::finish`]).
    pub fn finish(&mut self) {
        self.comm.finish();
    }
}

impl TensorComm<CpuBackend> for CpuTensorComm {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world()
    }

    fn all_reduce_sum(&self, _b: &CpuBackend, x: &mut Matrix) -> Result<()> {
        self.comm.all_reduce_sum_f32(&mut x.data)
    }

    fn gather_vocab(&self, _b: &CpuBackend, local: Matrix, vocab: Range<usize>, vocab_size: usize) -> Result<Matrix> {
        gather_vocab_host(&self.comm, &local, vocab, vocab_size)
    }

    fn argmax_vocab(&self, _b: &CpuBackend, local: &Matrix, vocab: Range<usize>) -> Result<Vec<u32>> {
        let pairs: Vec<(f32, u32)> = (0..local.rows)
            .map(|r| match local.cols {
                0 => (f32::NEG_INFINITY, u32::MAX),
                _ => {
                    let i = argmax(local.row(r));
                    (local.row(r)[i as usize], vocab.start as u32 + i)
                }
            })
            .collect();
        argmax_reduce(&self.comm, &pairs)
    }

    fn embedding(&self, _b: &CpuBackend, table: &Matrix, ids: &[u32], vocab: Range<usize>) -> Result<Matrix> {
        let mut out = Matrix::zeros(ids.len(), table.cols);
        for (t, &id) in ids.iter().enumerate() {
            if vocab.contains(&(id as usize)) {
                out.row_mut(t).copy_from_slice(table.row(id as usize - vocab.start));
            }
        }
        self.comm.all_reduce_sum_f32(&mut out.data)?;
        Ok(out)
    }

    fn stats(&self) -> CommStats {
        self.comm.stats()
    }

    fn broadcast_host_u32(&self, _b: &CpuBackend, buf: &mut [u32], root: usize) -> Result<()> {
        self.comm.broadcast_u32(buf, root)
    }

    fn abort(&self) {
        self.comm.abort();
    }

    fn recover(&self, _b: &CpuBackend) -> Result<()> {
        self.comm.reset()
    }
}

/// Vocabulary-parallel logits on the host to the whole `[rows, vocab_size]` logits: every rank
/// sends its slice padded to the widest one, the all-gather's rank-major blocks are laid out
/// row by row.
pub(crate) fn gather_vocab_host(
    comm: &InProcessComm,
    local: &Matrix,
    vocab: Range<usize>,
    vocab_size: usize,
) -> Result<Matrix> {
    let world = comm.world();
    // Every rank sends the same count: its slice padded to the largest one's width.
    let width = vocab_size.div_ceil(world);
    let rows = local.rows;
    let mut send = vec![0.0f32; rows * width];
    for r in 0..rows {
        send[r * width..r * width + vocab.len()].copy_from_slice(local.row(r));
    }
    let mut all = vec![0.0f32; world * rows * width];
    comm.all_gather_f32(&send, &mut all)?;
    let mut out = Matrix::zeros(rows, vocab_size);
    for rank in 0..world {
        let start = (rank * width).min(vocab_size);
        let len = ((rank + 1) * width).min(vocab_size) - start;
        for r in 0..rows {
            let src = &all[(rank * rows + r) * width..][..len];
            out.row_mut(r)[start..start + len].copy_from_slice(src);
        }
    }
    Ok(out)
}
