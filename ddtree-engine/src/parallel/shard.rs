//! One rank's slice of every tensor: read from the mmap'd checkpoint (only the rank's rows or
//! columns are converted; no whole-tensor host copy), or made at random with the slice's shapes.

use std::ops::Range;

use crate::backend::{Backend, HostLinear, Matrix};
use crate::config::{ModelConfig, QuantConfig};
use crate::error::{EngineError, Result};
use crate::model::{
    build, ffn_names, float_tensor, linear_tensors, Count, Ffn, LeafSource, LinearTensors, LoadOptions, Model, Random,
    Validate, PREFIXES,
};
use crate::parallel::plan::{RankShard, Split};
use crate::parallel::RankContext;
use crate::weights::{Checkpoint, TensorRef};

/// Bytes per element of a tensor's dtype.
fn elem_bytes(t: &TensorRef<'_>) -> usize {
    t.data.len() / t.numel().max(1)
}

/// The `[rows, cols]` block of a 2-D tensor as raw byte runs, one per row (one run when the
/// block spans whole rows).
fn runs<'a>(t: &TensorRef<'a>, rows: Range<usize>, cols: Range<usize>) -> Vec<&'a [u8]> {
    let (width, es) = (t.shape[1], elem_bytes(t));
    if cols == (0..width) {
        return vec![&t.data[rows.start * width * es..rows.end * width * es]];
    }
    rows.map(|r| &t.data[(r * width + cols.start) * es..(r * width + cols.end) * es])
        .collect()
}

/// The block converted to f32 (see [`TensorRef::to_f32`]).
fn block_f32(t: &TensorRef<'_>, rows: Range<usize>, cols: Range<usize>, check_finite: bool) -> Result<Vec<f32>> {
    let mut out = Vec::with_capacity(rows.len() * cols.len());
    for run in runs(t, rows, cols) {
        out.extend(TensorRef { data: run, ..*t }.to_f32(check_finite)?);
    }
    Ok(out)
}

/// The block as u32 words (see [`TensorRef::to_u32_words`]).
fn block_words(t: &TensorRef<'_>, rows: Range<usize>, cols: Range<usize>) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(rows.len() * cols.len());
    for run in runs(t, rows, cols) {
        out.extend(TensorRef { data: run, ..*t }.to_u32_words()?);
    }
    Ok(out)
}

/// The `(rows, cols)` ranges of a `[out, inp]` weight under `split`.
fn ranges(split: &Split, out: usize, inp: usize) -> (Range<usize>, Range<usize>) {
    match split {
        Split::Replicated => (0..out, 0..inp),
        Split::Rows(r) => (r.clone(), 0..inp),
        Split::Cols(c) => (0..out, c.clone()),
    }
}

/// Reads a rank's slice of one linear layer; INT4 weights split by columns must be cut at
/// whole scale groups.
fn slice_linear(
    ckpt: &Checkpoint,
    quant: Option<&QuantConfig>,
    name: &str,
    (out, inp): (usize, usize),
    split: &Split,
    check_finite: bool,
) -> Result<(HostLinear, usize)> {
    let (rows, cols) = ranges(split, out, inp);
    Ok(match linear_tensors(ckpt, quant, name, out, inp)? {
        LinearTensors::Dense(t) => {
            let data = block_f32(&t, rows.clone(), cols.clone(), check_finite)?;
            let bytes = data.len() * elem_bytes(&t);
            (
                HostLinear::Dense {
                    out: rows.len(),
                    inp: cols.len(),
                    data,
                },
                bytes,
            )
        }
        LinearTensors::Int4 {
            packed,
            scale,
            group_size,
        } => {
            #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` needs Rust 1.87; MSRV is 1.85
            if cols.start % group_size != 0 || cols.len() % group_size != 0 || cols.len() % 8 != 0 {
                return Err(EngineError::Parallel {
                    argument: "--tp".into(),
                    reason: format!(
                        "INT4 tensor `{name}` would be split at columns {}..{}, not at whole groups of {group_size}",
                        cols.start, cols.end
                    ),
                });
            }
            let words = block_words(&packed, rows.clone(), cols.start / 8..cols.end / 8)?;
            let scales = block_f32(
                &scale,
                rows.clone(),
                cols.start / group_size..cols.end / group_size,
                check_finite,
            )?;
            let bytes = words.len() * 4 + scales.len() * elem_bytes(&scale);
            (
                HostLinear::Int4 {
                    out: rows.len(),
                    inp: cols.len(),
                    group_size,
                    packed: words,
                    scales,
                },
                bytes,
            )
        }
    })
}

/// Loads one rank's slice of every tensor onto its backend.
struct ShardLoad<'a, B> {
    ckpt: &'a Checkpoint,
    quant: Option<&'a QuantConfig>,
    config: &'a ModelConfig,
    shard: &'a RankShard,
    backend: &'a B,
    check_finite: bool,
    done: u64,
    total: u64,
    progress: &'a mut dyn FnMut(u64, u64),
}

impl<B> ShardLoad<'_, B> {
    fn advance(&mut self, bytes: usize) {
        self.done += bytes as u64;
        (self.progress)(self.done, self.total);
    }

    fn host_linear(&mut self, name: &str, out: usize, inp: usize, split: &Split) -> Result<HostLinear> {
        let (host, bytes) = slice_linear(self.ckpt, self.quant, name, (out, inp), split, self.check_finite)?;
        self.advance(bytes);
        Ok(host)
    }
}

impl<B: Backend> LeafSource for ShardLoad<'_, B> {
    type W = B::Weight;
    type V = B::Vector;
    type T = B::Tensor;
    type E = B::Experts;

    fn linear(&mut self, name: &str, out: usize, inp: usize) -> Result<B::Weight> {
        let split = self.shard.linear_split(self.config, name);
        let host = self.host_linear(name, out, inp, &split)?;
        self.backend.load_weight(host)
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<B::Vector> {
        let t = float_tensor(self.ckpt, name, &[len])?;
        let data = t.to_f32(self.check_finite)?;
        self.advance(t.data.len());
        self.backend.load_vector(data)
    }

    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<B::Tensor> {
        let t = float_tensor(self.ckpt, name, &[rows, cols])?;
        // The one matrix is the embedding table: vocabulary-parallel.
        let vocab = self.shard.vocab.clone();
        let data = block_f32(&t, vocab.clone(), 0..cols, self.check_finite)?;
        self.advance(data.len() * elem_bytes(&t));
        self.backend.load_matrix(Matrix {
            rows: vocab.len(),
            cols,
            data,
        })
    }

    fn experts(&mut self, prefix: &str, _count: usize, inter: usize, hidden: usize) -> Result<B::Experts> {
        let mut experts = Vec::with_capacity(self.shard.experts.len());
        for e in self.shard.experts.clone() {
            let [gate, up, down] = ffn_names(&format!("{prefix}.{e}"), inter, hidden);
            let all = Split::Replicated;
            experts.push(Ffn {
                gate: self.host_linear(&gate.0, gate.1, gate.2, &all)?,
                up: self.host_linear(&up.0, up.1, up.2, &all)?,
                down: self.host_linear(&down.0, down.1, down.2, &all)?,
            });
        }
        self.backend.load_experts(experts)
    }
}

/// Any leaf source with a rank's shapes: random weights and parameter counts of one rank.
struct ShardShapes<'a, S> {
    inner: &'a mut S,
    config: &'a ModelConfig,
    shard: &'a RankShard,
}

impl<S: LeafSource> LeafSource for ShardShapes<'_, S> {
    type W = S::W;
    type V = S::V;
    type T = S::T;
    type E = S::E;

    fn linear(&mut self, name: &str, out: usize, inp: usize) -> Result<S::W> {
        let (rows, cols) = ranges(&self.shard.linear_split(self.config, name), out, inp);
        self.inner.linear(name, rows.len(), cols.len())
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<S::V> {
        self.inner.vector(name, len)
    }

    fn matrix(&mut self, name: &str, _rows: usize, cols: usize) -> Result<S::T> {
        self.inner.matrix(name, self.shard.vocab.len(), cols)
    }

    fn experts(&mut self, prefix: &str, _count: usize, inter: usize, hidden: usize) -> Result<S::E> {
        self.inner.experts(prefix, self.shard.experts.len(), inter, hidden)
    }
}

impl<B: Backend> Model<B> {
    /// Rank `rank.rank`'s shard of the model in `ckpt` (see [`Model::load`]): every tensor is
    /// validated whole from the headers, then only the rank's rows or columns are read.
    /// `progress(done, total)` gets this rank's bytes read and the checkpoint's total.
    pub fn load_rank(
        backend: B,
        config: ModelConfig,
        ckpt: &Checkpoint,
        options: LoadOptions,
        rank: RankContext<B>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        let prefix = PREFIXES
            .into_iter()
            .find(|p| ckpt.contains(&format!("{p}model.embed_tokens.weight")))
            .ok_or_else(|| EngineError::MissingTensor {
                location: ckpt.location().to_path_buf(),
                tensor: "model.embed_tokens.weight".into(),
            })?;
        check_plan(&config, &rank)?;
        let quant = config.quantization.as_ref();
        let mut validate = Validate { ckpt, quant, bytes: 0 };
        build(&config, prefix, &mut validate)?;
        let mut load = ShardLoad {
            ckpt,
            quant,
            config: &config,
            shard: rank.shard(),
            backend: &backend,
            check_finite: options.check_finite,
            done: 0,
            total: validate.bytes,
            progress,
        };
        let weights = build(&config, prefix, &mut load)?;
        Ok(Self::assemble(backend, config, weights, Some(rank)))
    }

    /// Rank `rank.rank`'s shard of a model of `config`'s shapes with random weights (see
    /// [`Model::random`]; the shards of different ranks are not slices of one random model).
    pub fn random_rank(
        backend: B,
        config: ModelConfig,
        seed: u64,
        rank: RankContext<B>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        check_plan(&config, &rank)?;
        let mut count = Count(0);
        build(
            &config,
            "",
            &mut ShardShapes {
                inner: &mut count,
                config: &config,
                shard: rank.shard(),
            },
        )?;
        let mut random = Random {
            backend: &backend,
            int4_group: config.quantization.as_ref().map(|q| q.group_size),
            seed: seed.wrapping_add(rank.rank as u64 * 0x9E37_79B9_7F4A_7C15),
            done: 0,
            total: count.0,
            progress,
        };
        let weights = build(
            &config,
            "",
            &mut ShardShapes {
                inner: &mut random,
                config: &config,
                shard: rank.shard(),
            },
        )?;
        Ok(Self::assemble(backend, config, weights, Some(rank)))
    }
}

/// The rank's plan must be the plan of this config.
fn check_plan<B: Backend>(config: &ModelConfig, rank: &RankContext<B>) -> Result<()> {
    if rank.plan.config != *config || rank.rank >= rank.plan.spec.world || rank.comm.world() != rank.plan.spec.world {
        return Err(EngineError::Parallel {
            argument: "rank".into(),
            reason: format!(
                "rank {} of a {}-rank plan (communicator of {} ranks) made for another model",
                rank.rank,
                rank.plan.spec.world,
                rank.comm.world()
            ),
        });
    }
    Ok(())
}
