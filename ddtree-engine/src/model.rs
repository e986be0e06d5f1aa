//! DeepSeek-V3 / Kimi K2.x weights and the model forward, written once against [`Backend`].

use std::path::Path;

use safetensors::Dtype;

use crate::backend::{AttentionSpan, Backend, HostLinear, Matrix, MlaDims, StepInputs};
use crate::config::{ModelConfig, QuantConfig};
use crate::error::{EngineError, Result};
use crate::mask::AncestorMask;
use crate::parallel::RankContext;
use crate::rope::Rope;
use crate::weights::{Checkpoint, TensorRef, FLOAT_DTYPES};

/// Epsilon of the MLA-internal norms (`q_a_layernorm`, `kv_a_layernorm`): HF uses the RMSNorm
/// default whatever `rms_norm_eps` says.
pub const MLA_NORM_EPS: f32 = 1e-6;

/// Tensor-name prefixes under which checkpoints keep the decoder (`language_model.` for the
/// multimodal Kimi K2.5/K2.6), tried in order.
pub(crate) const PREFIXES: [&str; 2] = ["", "language_model."];

/// A SwiGLU feed-forward block: `down(silu(gate x) * up x)`.
#[derive(Debug)]
pub struct Ffn<W> {
    /// `gate_proj`.
    pub gate: W,
    /// `up_proj`.
    pub up: W,
    /// `down_proj`.
    pub down: W,
}

/// The query projection: low-rank (`q_a_proj` + `q_a_layernorm` + `q_b_proj`) or plain `q_proj`.
#[derive(Debug)]
pub enum QProj<W, V> {
    /// `q_lora_rank` is set.
    Lora {
        /// `q_a_proj`.
        a: W,
        /// `q_a_layernorm`.
        norm: V,
        /// `q_b_proj`.
        b: W,
    },
    /// `q_lora_rank` is null.
    Full(W),
}

/// MLA attention weights of one layer.
#[derive(Debug)]
pub struct Attention<W, V> {
    /// Query projection.
    pub q: QProj<W, V>,
    /// `kv_a_proj_with_mqa`: hidden -> `c_kv` + `k_pe`.
    pub kv_a: W,
    /// `kv_a_layernorm`.
    pub kv_a_norm: V,
    /// `kv_b_proj`: per head `W_UK` (P rows) then `W_UV` (V rows).
    pub kv_b: W,
    /// `o_proj`.
    pub o: W,
}

/// The MoE block of one layer.
#[derive(Debug)]
pub struct Moe<W, V, E> {
    /// Router `mlp.gate.weight` `[E, hidden]`.
    pub router: W,
    /// `e_score_correction_bias` `[E]`.
    pub bias: V,
    /// Routed experts, held together as the backend's grouped form.
    pub experts: E,
    /// Shared experts (fused into one FFN), if `n_shared_experts > 0`.
    pub shared: Option<Ffn<W>>,
}

/// A layer's MLP.
#[derive(Debug)]
pub enum Mlp<W, V, E> {
    /// Layers below `first_k_dense_replace`.
    Dense(Ffn<W>),
    /// The other layers.
    Moe(Moe<W, V, E>),
}

/// One decoder layer.
#[derive(Debug)]
pub struct Layer<W, V, E> {
    /// `input_layernorm`.
    pub input_norm: V,
    /// `self_attn`.
    pub attn: Attention<W, V>,
    /// `post_attention_layernorm`.
    pub post_norm: V,
    /// `mlp`.
    pub mlp: Mlp<W, V, E>,
}

/// All weights, generic over the leaf types so the same tree describes a checkpoint being
/// validated and a model loaded on a backend.
#[derive(Debug)]
pub struct Weights<W, V, T, E> {
    /// `model.embed_tokens`.
    pub embed: T,
    /// `model.layers.*`.
    pub layers: Vec<Layer<W, V, E>>,
    /// `model.norm`.
    pub norm: V,
    /// `lm_head` (or the embedding when tied).
    pub lm_head: W,
}

/// Produces the leaves of [`Weights`] by tensor name and expected shape.
pub(crate) trait LeafSource {
    type W;
    type V;
    type T;
    type E;
    fn linear(&mut self, name: &str, out: usize, inp: usize) -> Result<Self::W>;
    fn vector(&mut self, name: &str, len: usize) -> Result<Self::V>;
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Self::T>;
    /// The `count` routed experts under `{prefix}.{e}.{gate,up,down}_proj`.
    fn experts(&mut self, prefix: &str, count: usize, inter: usize, hidden: usize) -> Result<Self::E>;
}

/// The checkpoint names of one SwiGLU block's linears: `(name, out, in)` for gate, up, down.
pub(crate) fn ffn_names(p: &str, inter: usize, hidden: usize) -> [(String, usize, usize); 3] {
    [
        (format!("{p}.gate_proj"), inter, hidden),
        (format!("{p}.up_proj"), inter, hidden),
        (format!("{p}.down_proj"), hidden, inter),
    ]
}

/// The weights a [`LeafSource`] produces.
pub(crate) type SourceWeights<S> =
    Weights<<S as LeafSource>::W, <S as LeafSource>::V, <S as LeafSource>::T, <S as LeafSource>::E>;

/// Walks every tensor the config implies, in checkpoint naming.
pub(crate) fn build<S: LeafSource>(cfg: &ModelConfig, prefix: &str, s: &mut S) -> Result<SourceWeights<S>> {
    let h = cfg.hidden_size;
    let heads = cfg.num_attention_heads;
    let ffn = |s: &mut S, p: &str, inter: usize| -> Result<Ffn<S::W>> {
        let [(g, go, gi), (u, uo, ui), (d, d_o, di)] = ffn_names(p, inter, h);
        Ok(Ffn {
            gate: s.linear(&g, go, gi)?,
            up: s.linear(&u, uo, ui)?,
            down: s.linear(&d, d_o, di)?,
        })
    };
    let m = format!("{prefix}model");
    let embed = s.matrix(&format!("{m}.embed_tokens.weight"), cfg.vocab_size, h)?;
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for l in 0..cfg.num_hidden_layers {
        let p = format!("{m}.layers.{l}");
        let a = format!("{p}.self_attn");
        let q = match cfg.q_lora_rank {
            Some(rank) => QProj::Lora {
                a: s.linear(&format!("{a}.q_a_proj"), rank, h)?,
                norm: s.vector(&format!("{a}.q_a_layernorm.weight"), rank)?,
                b: s.linear(&format!("{a}.q_b_proj"), heads * cfg.qk_head_dim(), rank)?,
            },
            None => QProj::Full(s.linear(&format!("{a}.q_proj"), heads * cfg.qk_head_dim(), h)?),
        };
        let attn = Attention {
            q,
            kv_a: s.linear(&format!("{a}.kv_a_proj_with_mqa"), cfg.latent_row_width(), h)?,
            kv_a_norm: s.vector(&format!("{a}.kv_a_layernorm.weight"), cfg.kv_lora_rank)?,
            kv_b: s.linear(
                &format!("{a}.kv_b_proj"),
                heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                cfg.kv_lora_rank,
            )?,
            o: s.linear(&format!("{a}.o_proj"), h, heads * cfg.v_head_dim)?,
        };
        let mlp = if cfg.is_moe_layer(l) {
            let moe = &cfg.moe;
            let inter = moe.moe_intermediate_size;
            Mlp::Moe(Moe {
                router: s.linear(&format!("{p}.mlp.gate"), moe.n_routed_experts, h)?,
                bias: s.vector(&format!("{p}.mlp.gate.e_score_correction_bias"), moe.n_routed_experts)?,
                experts: s.experts(&format!("{p}.mlp.experts"), moe.n_routed_experts, inter, h)?,
                shared: match moe.n_shared_experts {
                    0 => None,
                    n => Some(ffn(s, &format!("{p}.mlp.shared_experts"), n * inter)?),
                },
            })
        } else {
            Mlp::Dense(ffn(s, &format!("{p}.mlp"), cfg.intermediate_size)?)
        };
        layers.push(Layer {
            input_norm: s.vector(&format!("{p}.input_layernorm.weight"), h)?,
            attn,
            post_norm: s.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
            mlp,
        });
    }
    let norm = s.vector(&format!("{m}.norm.weight"), h)?;
    let head = if cfg.tie_word_embeddings {
        format!("{m}.embed_tokens")
    } else {
        format!("{prefix}lm_head")
    };
    let lm_head = s.linear(&head, cfg.vocab_size, h)?;
    Ok(Weights {
        embed,
        layers,
        norm,
        lm_head,
    })
}

/// The tensors behind one linear layer, dtype- and shape-checked.
pub(crate) enum LinearTensors<'a> {
    Dense(TensorRef<'a>),
    Int4 {
        packed: TensorRef<'a>,
        scale: TensorRef<'a>,
        group_size: usize,
    },
}

pub(crate) fn float_tensor<'a>(ckpt: &'a Checkpoint, name: &str, shape: &[usize]) -> Result<TensorRef<'a>> {
    let t = ckpt.tensor(name)?;
    t.expect_dtype(&FLOAT_DTYPES)?;
    t.expect_shape(shape)?;
    Ok(t)
}

/// Resolves `{name}.weight` (dense) or `{name}.weight_packed` + `weight_scale` + `weight_shape`
/// (INT4), whichever the checkpoint holds.
pub(crate) fn linear_tensors<'a>(
    ckpt: &'a Checkpoint,
    quant: Option<&QuantConfig>,
    name: &str,
    out: usize,
    inp: usize,
) -> Result<LinearTensors<'a>> {
    let dense = format!("{name}.weight");
    let packed_name = format!("{name}.weight_packed");
    if ckpt.contains(&dense) || !ckpt.contains(&packed_name) {
        return Ok(LinearTensors::Dense(float_tensor(ckpt, &dense, &[out, inp])?));
    }
    let packed = ckpt.tensor(&packed_name)?;
    let bad = |t: &TensorRef<'_>, reason: String| EngineError::BadTensor {
        file: t.file.to_path_buf(),
        tensor: t.name.to_string(),
        reason,
    };
    let Some(quant) = quant else {
        return Err(bad(
            &packed,
            "INT4 weight, but config.json has no compressed-tensors quantization_config".into(),
        ));
    };
    packed.expect_dtype(&[Dtype::I32, Dtype::U32])?;
    packed.expect_shape(&[out, inp.div_ceil(8)])?;
    let scale = ckpt.tensor(&format!("{name}.weight_scale"))?;
    #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` needs Rust 1.87; MSRV is 1.85
    if inp % quant.group_size != 0 {
        return Err(bad(
            &scale,
            format!(
                "in_features {inp} is not a multiple of the group size {}",
                quant.group_size
            ),
        ));
    }
    scale.expect_dtype(&FLOAT_DTYPES)?;
    scale.expect_shape(&[out, inp / quant.group_size])?;
    let shape = ckpt.tensor(&format!("{name}.weight_shape"))?;
    shape.expect_shape(&[2])?;
    let dims = shape.to_i64()?;
    if dims != [out as i64, inp as i64] {
        return Err(bad(&shape, format!("holds {dims:?}, expected [{out}, {inp}]")));
    }
    Ok(LinearTensors::Int4 {
        packed,
        scale,
        group_size: quant.group_size,
    })
}

/// A backend's error on taking the weights of `name` (a linear, or a layer's experts), with that
/// name in front (e.g. a scale group the backend's kernels do not take).
fn in_tensor(name: &str, e: EngineError) -> EngineError {
    match e {
        EngineError::Backend { backend, reason } => EngineError::Backend {
            backend,
            reason: format!("{name}: {reason}"),
        },
        e => e,
    }
}

/// Header-only pass: checks presence, dtype and shape of every tensor and sums their bytes.
pub(crate) struct Validate<'a> {
    pub(crate) ckpt: &'a Checkpoint,
    pub(crate) quant: Option<&'a QuantConfig>,
    pub(crate) bytes: u64,
}

impl LeafSource for Validate<'_> {
    type W = ();
    type V = ();
    type T = ();
    type E = ();
    fn linear(&mut self, name: &str, out: usize, inp: usize) -> Result<()> {
        self.bytes += match linear_tensors(self.ckpt, self.quant, name, out, inp)? {
            LinearTensors::Dense(t) => t.data.len(),
            LinearTensors::Int4 { packed, scale, .. } => packed.data.len() + scale.data.len(),
        } as u64;
        Ok(())
    }
    fn vector(&mut self, name: &str, len: usize) -> Result<()> {
        self.bytes += float_tensor(self.ckpt, name, &[len])?.data.len() as u64;
        Ok(())
    }
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<()> {
        self.bytes += float_tensor(self.ckpt, name, &[rows, cols])?.data.len() as u64;
        Ok(())
    }
    fn experts(&mut self, prefix: &str, count: usize, inter: usize, hidden: usize) -> Result<()> {
        for e in 0..count {
            for (name, out, inp) in ffn_names(&format!("{prefix}.{e}"), inter, hidden) {
                self.linear(&name, out, inp)?;
            }
        }
        Ok(())
    }
}

/// Converting pass: reads each tensor, optionally scans it for NaN/inf, hands it to the backend.
struct Load<'a, B> {
    ckpt: &'a Checkpoint,
    quant: Option<&'a QuantConfig>,
    backend: &'a B,
    check_finite: bool,
    done: u64,
    total: u64,
    progress: &'a mut dyn FnMut(u64, u64),
}

impl<B> Load<'_, B> {
    fn advance(&mut self, bytes: usize) {
        self.done += bytes as u64;
        (self.progress)(self.done, self.total);
    }

    /// Reads one linear layer's tensors into host form.
    fn host_linear(&mut self, name: &str, out: usize, inp: usize) -> Result<HostLinear> {
        let (host, bytes) = match linear_tensors(self.ckpt, self.quant, name, out, inp)? {
            LinearTensors::Dense(t) => (
                HostLinear::Dense {
                    out,
                    inp,
                    data: t.to_f32(self.check_finite)?,
                },
                t.data.len(),
            ),
            LinearTensors::Int4 {
                packed,
                scale,
                group_size,
            } => (
                HostLinear::Int4 {
                    out,
                    inp,
                    group_size,
                    packed: packed.to_u32_words()?,
                    scales: scale.to_f32(self.check_finite)?,
                },
                packed.data.len() + scale.data.len(),
            ),
        };
        self.advance(bytes);
        Ok(host)
    }
}

impl<B: Backend> LeafSource for Load<'_, B> {
    type W = B::Weight;
    type V = B::Vector;
    type T = B::Tensor;
    type E = B::Experts;
    fn linear(&mut self, name: &str, out: usize, inp: usize) -> Result<B::Weight> {
        let host = self.host_linear(name, out, inp)?;
        self.backend.load_weight(host).map_err(|e| in_tensor(name, e))
    }
    fn experts(&mut self, prefix: &str, count: usize, inter: usize, hidden: usize) -> Result<B::Experts> {
        let mut experts = Vec::with_capacity(count);
        for e in 0..count {
            let [gate, up, down] = ffn_names(&format!("{prefix}.{e}"), inter, hidden);
            experts.push(Ffn {
                gate: self.host_linear(&gate.0, gate.1, gate.2)?,
                up: self.host_linear(&up.0, up.1, up.2)?,
                down: self.host_linear(&down.0, down.1, down.2)?,
            });
        }
        self.backend.load_experts(experts).map_err(|e| in_tensor(prefix, e))
    }
    fn vector(&mut self, name: &str, len: usize) -> Result<B::Vector> {
        let t = float_tensor(self.ckpt, name, &[len])?;
        let data = t.to_f32(self.check_finite)?;
        self.advance(t.data.len());
        self.backend.load_vector(data)
    }
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<B::Tensor> {
        let t = float_tensor(self.ckpt, name, &[rows, cols])?;
        let data = t.to_f32(self.check_finite)?;
        self.advance(t.data.len());
        self.backend.load_matrix(Matrix { rows, cols, data })
    }
}

/// Random leaves on a backend, for benchmarks of real shapes without a checkpoint: dense
/// linears (INT4 routed experts when the config is quantized), norms near 1, routing biases near
/// 0. Every leaf gets its own seed, so the model is a pure function of the seed.
pub(crate) struct Random<'a, B> {
    pub(crate) backend: &'a B,
    pub(crate) int4_group: Option<usize>,
    pub(crate) seed: u64,
    pub(crate) done: u64,
    pub(crate) total: u64,
    pub(crate) progress: &'a mut dyn FnMut(u64, u64),
}

impl<B> Random<'_, B> {
    fn next_seed(&mut self, params: usize) -> u64 {
        self.done += params as u64;
        (self.progress)(self.done, self.total);
        self.seed = self
            .seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.seed
    }
}

impl<B: Backend> LeafSource for Random<'_, B> {
    type W = B::Weight;
    type V = B::Vector;
    type T = B::Tensor;
    type E = B::Experts;
    fn linear(&mut self, _name: &str, out: usize, inp: usize) -> Result<B::Weight> {
        let seed = self.next_seed(out * inp);
        self.backend.random_weight(out, inp, None, seed)
    }
    fn vector(&mut self, name: &str, len: usize) -> Result<B::Vector> {
        let seed = self.next_seed(len);
        let (lo, hi) = if name.ends_with("e_score_correction_bias") {
            (-0.01, 0.01)
        } else {
            (0.9, 1.1)
        };
        self.backend.random_vector(len, lo, hi, seed)
    }
    fn matrix(&mut self, _name: &str, rows: usize, cols: usize) -> Result<B::Tensor> {
        let seed = self.next_seed(rows * cols);
        self.backend.random_matrix(rows, cols, seed)
    }
    fn experts(&mut self, _prefix: &str, count: usize, inter: usize, hidden: usize) -> Result<B::Experts> {
        let seed = self.next_seed(3 * count * inter * hidden);
        self.backend.random_experts(count, inter, hidden, self.int4_group, seed)
    }
}

/// Counts parameters per leaf (the progress total of [`Model::random`]).
pub(crate) struct Count(pub(crate) u64);

impl LeafSource for Count {
    type W = ();
    type V = ();
    type T = ();
    type E = ();
    fn linear(&mut self, _: &str, out: usize, inp: usize) -> Result<()> {
        self.0 += (out * inp) as u64;
        Ok(())
    }
    fn vector(&mut self, _: &str, len: usize) -> Result<()> {
        self.0 += len as u64;
        Ok(())
    }
    fn matrix(&mut self, _: &str, rows: usize, cols: usize) -> Result<()> {
        self.0 += (rows * cols) as u64;
        Ok(())
    }
    fn experts(&mut self, _: &str, count: usize, inter: usize, hidden: usize) -> Result<()> {
        self.0 += (3 * count * inter * hidden) as u64;
        Ok(())
    }
}

/// Options for [`Model::load`].
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Scan every floating-point weight for NaN/infinity while loading (default on).
    pub check_finite: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self { check_finite: true }
    }
}

/// Which rows of the forward output get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// Every new token (tree verification).
    All,
    /// Only the last new token (prefill, plain decoding).
    Last,
}

/// The new tokens of one forward call.
#[derive(Debug, Clone, Copy)]
pub struct ForwardInput<'a> {
    /// Token ids.
    pub tokens: &'a [u32],
    /// Their positions (`start + depth` for tree nodes).
    pub positions: &'a [u32],
    /// Tree visibility among the new tokens; `None` is causal.
    pub mask: Option<&'a AncestorMask>,
    /// Rows that get logits.
    pub logits: LogitRows,
}

/// What [`Model::forward_with_features`] returns.
#[derive(Debug)]
pub struct ForwardOutput<T> {
    /// Logits `[rows, vocab]` of the rows [`ForwardInput::logits`] asked for.
    pub logits: T,
    /// Hidden states at the requested layers, concatenated, one row per new token.
    pub features: Option<T>,
}

/// A loaded model on a backend.
pub struct Model<B: Backend> {
    backend: B,
    config: ModelConfig,
    weights: Weights<B::Weight, B::Vector, B::Tensor, B::Experts>,
    rope: Rope,
    dims: MlaDims,
    scale: f32,
    /// This rank's part when the model is split over ranks (`None`: the whole model).
    rank: Option<RankContext<B>>,
}

impl<B: Backend> Model<B> {
    /// Validates every tensor `config` implies (presence, dtype, shape) from the headers, then
    /// loads them onto `backend`. `progress(done, total)` is called with bytes as tensors load.
    pub fn load(
        backend: B,
        config: ModelConfig,
        ckpt: &Checkpoint,
        options: LoadOptions,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        let prefix = PREFIXES
            .into_iter()
            .find(|p| ckpt.contains(&format!("{p}model.embed_tokens.weight")))
            .ok_or_else(|| EngineError::MissingTensor {
                location: ckpt.location().to_path_buf(),
                tensor: "model.embed_tokens.weight".into(),
            })?;
        let quant = config.quantization.as_ref();
        let mut validate = Validate { ckpt, quant, bytes: 0 };
        build(&config, prefix, &mut validate)?;
        let mut load = Load {
            ckpt,
            quant,
            backend: &backend,
            check_finite: options.check_finite,
            done: 0,
            total: validate.bytes,
            progress,
        };
        let weights = build(&config, prefix, &mut load)?;
        Ok(Self::assemble(backend, config, weights, None))
    }

    /// A model of `config`'s shapes with random weights made on `backend` (no checkpoint):
    /// for benchmarks. Routed experts are INT4 when `config` has a quantization config.
    /// `progress(done, total)` is called with parameter counts.
    pub fn random(backend: B, config: ModelConfig, seed: u64, progress: &mut dyn FnMut(u64, u64)) -> Result<Self> {
        let mut count = Count(0);
        build(&config, "", &mut count)?;
        let mut random = Random {
            backend: &backend,
            int4_group: config.quantization.as_ref().map(|q| q.group_size),
            seed,
            done: 0,
            total: count.0,
            progress,
        };
        let weights = build(&config, "", &mut random)?;
        Ok(Self::assemble(backend, config, weights, None))
    }

    /// The model from its loaded weights; with `rank`, one rank's shard of it.
    pub(crate) fn assemble(
        backend: B,
        config: ModelConfig,
        weights: Weights<B::Weight, B::Vector, B::Tensor, B::Experts>,
        rank: Option<RankContext<B>>,
    ) -> Self {
        let dims = MlaDims {
            heads: rank
                .as_ref()
                .map_or(config.num_attention_heads, |r| r.shard().heads.len()),
            nope: config.qk_nope_head_dim,
            rope: config.qk_rope_head_dim,
            v: config.v_head_dim,
            kv_lora: config.kv_lora_rank,
        };
        Self {
            rope: Rope::new(&config),
            scale: Rope::softmax_scale(&config),
            backend,
            config,
            weights,
            dims,
            rank,
        }
    }

    /// This rank's part when the model is split over ranks.
    pub fn rank(&self) -> Option<&RankContext<B>> {
        self.rank.as_ref()
    }

    /// Reads `config.json` and the checkpoint from `dir` and loads them.
    pub fn load_dir(backend: B, dir: &Path, options: LoadOptions, progress: &mut dyn FnMut(u64, u64)) -> Result<Self> {
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        Self::load(backend, config, &ckpt, options, progress)
    }

    /// Parameters of the model (weights, norms, embedding), counted from the config.
    pub fn parameter_count(&self) -> u64 {
        let mut count = Count(0);
        build(&self.config, "", &mut count).map_or(0, |_| count.0)
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The backend the model runs on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// An empty latent KV cache for up to `capacity` tokens.
    pub fn new_cache(&self, capacity: usize) -> Result<B::KvCache> {
        self.backend
            .new_kv_cache(self.config.num_hidden_layers, self.config.latent_row_width(), capacity)
    }

    /// Runs the new tokens through the model, appending their latent rows to `cache` (after the
    /// rows already there, which every new token sees), and returns logits `[rows, vocab]`.
    ///
    /// On error the cache is restored to its length before the call.
    pub fn forward(&self, cache: &mut B::KvCache, input: ForwardInput<'_>) -> Result<B::Tensor> {
        Ok(self.forward_with_features(cache, input, &[])?.logits)
    }

    /// [`Model::forward`] that also returns, for every new token, the hidden states after the
    /// decoder layers `feature_layers`, concatenated in that order (`[tokens, len * hidden]`,
    /// `None` when `feature_layers` is empty). As in HF's `hidden_states[id + 1]`, the state
    /// after the last layer is taken after the final norm. These are the DFlash drafter's
    /// target context features.
    pub fn forward_with_features(
        &self,
        cache: &mut B::KvCache,
        input: ForwardInput<'_>,
        feature_layers: &[usize],
    ) -> Result<ForwardOutput<B::Tensor>> {
        self.check_input(&input)?;
        let layers = self.config.num_hidden_layers;
        if let Some(&l) = feature_layers.iter().find(|&&l| l >= layers) {
            return Err(EngineError::Forward(format!(
                "hidden states of layer {l} requested from a model with {layers} layers"
            )));
        }
        let prefix_len = self.begin_forward(cache, &input)?;
        let result = self.forward_inner(cache, input, prefix_len, feature_layers, true);
        if result.is_err() {
            self.backend.kv_truncate(cache, prefix_len)?;
        }
        result
    }

    /// [`Model::forward`] followed by the greedy token of every logits row, through
    /// [`Backend::greedy_forward`]: the CUDA backend records the step as a CUDA graph on its
    /// second occurrence of a shape and replays it after that.
    ///
    /// On error the cache is restored to its length before the call.
    pub fn forward_greedy(&self, cache: &mut B::KvCache, input: ForwardInput<'_>) -> Result<Vec<u32>> {
        self.check_input(&input)?;
        let prefix_len = self.begin_forward(cache, &input)?;
        let result = match &self.rank {
            // Vocabulary-parallel: each rank's argmax over its slice, reduced across ranks.
            Some(r) => r
                .comm
                .greedy_forward(&self.backend, cache, r.shard().vocab.clone(), &mut |c| {
                    Ok(self.forward_inner(c, input, prefix_len, &[], false)?.logits)
                }),
            None => self.backend.greedy_forward(cache, &mut |c| {
                Ok(self.forward_inner(c, input, prefix_len, &[], true)?.logits)
            }),
        };
        if result.is_err() {
            self.backend.kv_truncate(cache, prefix_len)?;
        }
        result
    }

    /// Stages the step's inputs ([`Backend::begin_forward`]); returns the cache length before it.
    fn begin_forward(&self, cache: &B::KvCache, input: &ForwardInput<'_>) -> Result<usize> {
        let prefix_len = self.backend.kv_len(cache);
        self.backend.begin_forward(&StepInputs {
            tokens: input.tokens,
            positions: input.positions,
            prefix_len,
            mask: input.mask,
        })?;
        Ok(prefix_len)
    }

    /// The token embeddings of `ids` (`[ids, hidden]`).
    pub fn embed(&self, ids: &[u32]) -> Result<B::Tensor> {
        check_tokens(ids, self.config.vocab_size)?;
        self.embed_rows(ids)
    }

    /// The embedding lookup (vocabulary-parallel and summed over the ranks when split).
    fn embed_rows(&self, ids: &[u32]) -> Result<B::Tensor> {
        match &self.rank {
            Some(r) => r
                .comm
                .embedding(&self.backend, &self.weights.embed, ids, r.shard().vocab.clone()),
            None => self.backend.embedding(&self.weights.embed, ids),
        }
    }

    /// The LM head applied to already-normalized hidden states: `[rows, vocab]` logits (when
    /// split over ranks, the slices gathered from every rank).
    pub fn lm_head(&self, h: &B::Tensor) -> Result<B::Tensor> {
        self.head(h, true)
    }

    /// The LM head; split over ranks, `gather` assembles the whole logits, otherwise each rank
    /// keeps its vocabulary slice.
    fn head(&self, h: &B::Tensor, gather: bool) -> Result<B::Tensor> {
        let local = self.backend.linear_f32(h, &self.weights.lm_head)?;
        match &self.rank {
            Some(r) if gather => {
                r.comm
                    .gather_vocab(&self.backend, local, r.shard().vocab.clone(), self.config.vocab_size)
            }
            _ => Ok(local),
        }
    }

    /// Sums a partial result over the ranks when `partial` (a tensor-parallel or
    /// expert-parallel block's output).
    fn reduce(&self, x: &mut B::Tensor, partial: bool) -> Result<()> {
        match &self.rank {
            Some(r) if partial => r.comm.all_reduce_sum(&self.backend, x),
            _ => Ok(()),
        }
    }

    /// The tensor- and expert-parallel degrees (1 and 1 on one rank).
    fn degrees(&self) -> (usize, usize) {
        self.rank.as_ref().map_or((1, 1), |r| (r.plan.spec.tp, r.plan.spec.ep))
    }

    fn check_input(&self, input: &ForwardInput<'_>) -> Result<()> {
        let n = input.tokens.len();
        if n == 0 {
            return Err(EngineError::Forward("no tokens to run".into()));
        }
        if input.positions.len() != n {
            return Err(EngineError::Forward(format!(
                "{n} tokens but {} positions",
                input.positions.len()
            )));
        }
        if let Some(mask) = input.mask {
            if mask.len() != n {
                return Err(EngineError::Forward(format!(
                    "{n} tokens but a mask over {} nodes",
                    mask.len()
                )));
            }
        }
        check_tokens(input.tokens, self.config.vocab_size)?;
        let context = self.config.max_position_embeddings;
        let max_position = input.positions.iter().copied().max().unwrap_or(0) as usize;
        if max_position >= context {
            return Err(EngineError::ContextOverflow {
                tokens: n,
                max_position,
                context,
            });
        }
        Ok(())
    }

    fn forward_inner(
        &self,
        cache: &mut B::KvCache,
        input: ForwardInput<'_>,
        prefix_len: usize,
        feature_layers: &[usize],
        gather: bool,
    ) -> Result<ForwardOutput<B::Tensor>> {
        let b = &self.backend;
        let w = &self.weights;
        let eps = self.config.rms_norm_eps;
        let span = AttentionSpan {
            prefix_len,
            mask: input.mask,
        };
        let n = input.tokens.len();
        let all_rows: Vec<usize> = (0..n).collect();
        let mut hidden: Vec<Option<B::Tensor>> = w.layers.iter().map(|_| None).collect();
        let embedded = self.embed_rows(input.tokens)?;
        // Each residual add is fused with the norm that follows it: the next layer's input norm,
        // or after the last layer the final norm.
        let mut h = b.rms_norm(&embedded, w.layers.first().map_or(&w.norm, |l| &l.input_norm), eps)?;
        let mut x = b.residual(embedded)?;
        for (l, layer) in w.layers.iter().enumerate() {
            let a = self.attention(l, &layer.attn, &h, cache, input.positions, span)?;
            let post = b.add_rms_norm(&mut x, &a, &layer.post_norm, eps)?;
            let (m, shared) = self.mlp(&layer.mlp, &post)?;
            let last = l + 1 == w.layers.len();
            let next_norm = if last { &w.norm } else { &w.layers[l + 1].input_norm };
            h = match &shared {
                Some(s) => b.add2_rms_norm(&mut x, m, s, next_norm, eps)?,
                None => b.add_rms_norm(&mut x, &m, next_norm, eps)?,
            };
            if feature_layers.contains(&l) {
                // After the last layer HF's hidden state is the final-normed one, `h` itself.
                hidden[l] = Some(b.take_rows(if last { &h } else { &x }, &all_rows)?);
            }
        }
        let features = match feature_layers {
            [] => None,
            ids => {
                let parts: Vec<&B::Tensor> = ids.iter().filter_map(|&l| hidden[l].as_ref()).collect();
                Some(b.concat_cols(&parts)?)
            }
        };
        if input.logits == LogitRows::Last && n > 1 {
            h = b.take_rows(&h, &[n - 1])?;
        }
        Ok(ForwardOutput {
            logits: self.head(&h, gather)?,
            features,
        })
    }

    fn attention(
        &self,
        layer: usize,
        a: &Attention<B::Weight, B::Vector>,
        h: &B::Tensor,
        cache: &mut B::KvCache,
        positions: &[u32],
        span: AttentionSpan<'_>,
    ) -> Result<B::Tensor> {
        let b = &self.backend;
        // The latent path (kv_a, its norm and rope, the cache append) beside the query path.
        branch(b, || {
            let kv_a = b.linear(h, &a.kv_a)?;
            b.mla_append_kv(&kv_a, &a.kv_a_norm, MLA_NORM_EPS, &self.rope, positions, cache, layer)
        })?;
        let q = match &a.q {
            QProj::Lora { a: qa, norm, b: qb } => b.rms_norm_linear(&b.linear(h, qa)?, norm, MLA_NORM_EPS, qb)?,
            QProj::Full(w) => b.linear(h, w)?,
        };
        let q_abs = b.mla_query(&q, &a.kv_b, &self.rope, positions, self.dims)?;
        b.join_branch()?;
        let o = b.mla_attention_output(&q_abs, cache, layer, span, self.dims, self.scale, &a.kv_b)?;
        let mut out = b.linear(&o, &a.o)?;
        self.reduce(&mut out, self.degrees().0 > 1)?;
        Ok(out)
    }

    /// A layer's MLP: the dense block's or the routed experts' output, and the shared experts'
    /// output, which the caller adds to the residual stream with the routed one
    /// ([`Backend::add2_rms_norm`]).
    fn mlp(
        &self,
        mlp: &Mlp<B::Weight, B::Vector, B::Experts>,
        h: &B::Tensor,
    ) -> Result<(B::Tensor, Option<B::Tensor>)> {
        let b = &self.backend;
        let (tp, ep) = self.degrees();
        match mlp {
            Mlp::Dense(f) => {
                let mut out = ffn(b, f, h)?;
                self.reduce(&mut out, tp > 1)?;
                Ok((out, None))
            }
            Mlp::Moe(m) => {
                // The shared experts beside the router and the routed experts.
                let shared = match &m.shared {
                    Some(s) => Some(branch(b, || ffn(b, s, h))?),
                    None => None,
                };
                let logits = b.linear_f32(h, &m.router)?;
                let mut routing = b.moe_route(&logits, &m.bias, &self.config.moe)?;
                if let Some(r) = self.rank.as_ref().filter(|_| ep > 1) {
                    routing = b.moe_localize(routing, r.shard().experts.clone())?;
                }
                let mut routed = b.moe_experts(h, &routing, &m.experts)?;
                b.join_branch()?;
                match shared {
                    // Both partial: one all-reduce of their sum.
                    Some(s) if tp > 1 && ep > 1 => {
                        b.add_assign(&mut routed, &s)?;
                        self.reduce(&mut routed, true)?;
                        Ok((routed, None))
                    }
                    mut shared => {
                        self.reduce(&mut routed, ep > 1)?;
                        if let Some(s) = shared.as_mut() {
                            self.reduce(s, tp > 1)?;
                        }
                        Ok((routed, shared))
                    }
                }
            }
        }
    }
}

/// Runs `ops` as a branch of `b` ([`Backend::begin_branch`]; ended also when `ops` fails): it
/// may overlap the ops enqueued after it until the caller's [`Backend::join_branch`].
fn branch<B: Backend, T>(b: &B, ops: impl FnOnce() -> Result<T>) -> Result<T> {
    b.begin_branch()?;
    let result = ops();
    b.end_branch()?;
    result
}

/// `down(silu(gate x) * up x)` on any backend ([`Backend::gate_up_silu`], then `down`).
pub fn ffn<B: Backend>(b: &B, f: &Ffn<B::Weight>, x: &B::Tensor) -> Result<B::Tensor> {
    b.linear(&b.gate_up_silu(x, &f.gate, &f.up)?, &f.down)
}

/// Fails on the first id that is not below `vocab_size`.
pub fn check_tokens(tokens: &[u32], vocab_size: usize) -> Result<()> {
    match tokens.iter().position(|&t| t as usize >= vocab_size) {
        Some(index) => Err(EngineError::TokenOutOfRange {
            id: tokens[index],
            index,
            vocab_size,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backend_error_on_loading_weights_names_them() {
        let e = in_tensor(
            "model.layers.1.mlp.down_proj",
            EngineError::Backend {
                backend: "cuda".into(),
                reason: "INT4 weight [64, 96]: INT4 scale group 48 (quantization_config group_size) is not supported"
                    .into(),
            },
        );
        assert_eq!(
            e.to_string(),
            "backend `cuda`: model.layers.1.mlp.down_proj: INT4 weight [64, 96]: INT4 scale group 48 \
             (quantization_config group_size) is not supported"
        );
        assert!(matches!(
            in_tensor("x", EngineError::EmptyPrompt),
            EngineError::EmptyPrompt
        ));
    }
}
