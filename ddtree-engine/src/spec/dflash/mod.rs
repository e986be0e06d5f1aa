//! The DFlash block-diffusion drafters of the z-lab `dflash` package (0.1.0):
//! `DFlashDraftModel` (v1) and `DFlash2DraftModel` (v2), written against [`Backend`].
//!
//! Qwen3-style layers (pre-norm, GQA attention with per-head q/k RMS norms and rotate-half RoPE,
//! SwiGLU) without an embedding or LM head of their own: the block is
//! `[embed(bonus), embed(mask) x (block_size - 1)]` through the target's embedding (times
//! `input_embedding_scale`) and the logits come from the target's LM head on the final-normed
//! rows `1..block_size` (times `output_multiplier`, then soft-capped). The target's hidden
//! states after `target_layer_ids` are concatenated, projected by `fc` and normalized by
//! `hidden_norm`; in every layer they give keys and values (queries come from the block only).
//! Attention is non-causal unless the layer is a `sliding_attention` one (causal, windowed) or
//! `is_causal` says otherwise. Context keys and values stay cached across rounds; the block's are
//! dropped after each draft (the cache is cropped back to the committed length), so each round
//! only projects the newly committed tokens' features.
//!
//! v2 wraps attention and MLP in grouped dynamic causal convolutions along the block and hands
//! the builder its candidate selector's scores instead of raw logits: per position the top-k
//! logits rescored against the token chosen before ([`host::Codebooks::select`]). The scores
//! are conditioned on the selector's greedy path, the one the package drafts at temperature 0.
//!
//! Full (non-causal, unwindowed) attention runs on the backend; the masked attention, the
//! convolutions, the selector and the logit transforms have no backend op and run on the host
//! over the block's rows ([`host`]).

mod host;

pub use host::NOT_A_CANDIDATE;

use std::path::{Path, PathBuf};

use crate::backend::{Backend, GqaDims, HostLinear, Matrix};
use crate::config::{DFlashAttention, DFlashConfig};
use crate::error::{EngineError, Result};
use crate::model::{ffn, float_tensor, Ffn, Model};
use crate::rope::Rope;
use crate::spec::drafter::{DraftRequest, Drafter};
use crate::weights::Checkpoint;
use host::{Codebooks, HostKv};

/// A v2 grouped dynamic causal convolution: `base_kernel` `[2, K, hidden]` (before / after)
/// and the projection to the token-dependent taps `[2 * K * groups, hidden]`.
struct Conv<B: Backend> {
    base: Vec<f32>,
    projection: B::Weight,
}

/// One draft layer's weights.
struct Layer<B: Backend> {
    input_norm: B::Vector,
    q: B::Weight,
    k: B::Weight,
    v: B::Weight,
    o: B::Weight,
    q_norm: B::Vector,
    k_norm: B::Vector,
    post_norm: B::Vector,
    mlp: Ffn<B::Weight>,
    attention: DFlashAttention,
    /// v2: around attention and around the MLP.
    convs: Option<[Conv<B>; 2]>,
}

/// The v2 candidate selector: host codebooks and the hidden projection.
struct Selector<B: Backend> {
    codebooks: Codebooks,
    projection: B::Weight,
}

/// A loaded DFlash drafter (v1 or v2) and its per-sequence context cache.
pub struct DFlashDrafter<B: Backend> {
    name: String,
    config: DFlashConfig,
    block_size: usize,
    fc: B::Weight,
    hidden_norm: B::Vector,
    layers: Vec<Layer<B>>,
    norm: B::Vector,
    rope: Rope,
    selector: Option<Selector<B>>,
    /// Full-attention layer `l`'s keys in cache layer `2l` and values in `2l + 1`, one row
    /// per context token (masked layers leave theirs empty).
    cache: Option<B::KvCache>,
    /// Masked layers' context keys and values (empty for full-attention layers).
    host_kv: Vec<HostKv>,
    /// Context rows cached: every position before the last request's bonus.
    context: usize,
}

/// Reads dense weights by name from a checkpoint.
struct Reader<'a, B> {
    ckpt: &'a Checkpoint,
    backend: &'a B,
}

impl<B: Backend> Reader<'_, B> {
    fn linear(&self, name: &str, out: usize, inp: usize) -> Result<B::Weight> {
        let data = self.host(&format!("{name}.weight"), &[out, inp])?;
        self.backend.load_weight(HostLinear::Dense { out, inp, data })
    }

    fn vector(&self, name: &str, len: usize) -> Result<B::Vector> {
        self.backend.load_vector(self.host(&format!("{name}.weight"), &[len])?)
    }

    fn host(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        float_tensor(self.ckpt, name, shape)?.to_f32(true)
    }

    /// A codebook, stored as `name` in released checkpoints (the package maps it to
    /// `name.weight` on load) or as `name.weight` by `save_pretrained`.
    fn codebook(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        if self.ckpt.contains(name) {
            self.host(name, shape)
        } else {
            self.host(&format!("{name}.weight"), shape)
        }
    }

    fn conv(&self, name: &str, c: &DFlashConfig, taps: usize, group: usize) -> Result<Conv<B>> {
        let h = c.hidden_size;
        Ok(Conv {
            base: self.host(&format!("{name}.base_kernel"), &[2, taps, h])?,
            projection: self.linear(&format!("{name}.kernel_projection"), 2 * taps * (h / group), h)?,
        })
    }
}

impl<B: Backend> DFlashDrafter<B> {
    /// Loads `config.json` and the safetensors weights from `dir` for `target` (whose hidden
    /// size, vocabulary and layer count must fit). `block_size` overrides the config's.
    pub fn load(target: &Model<B>, dir: &Path, block_size: Option<usize>) -> Result<Self> {
        let config = DFlashConfig::from_file(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        Self::from_parts(target, config, &ckpt, dir.to_path_buf(), block_size)
    }

    /// Builds the drafter from a parsed config and an open checkpoint; `name` is the
    /// drafter's directory (it labels reports and names `config.json` in errors).
    pub fn from_parts(
        target: &Model<B>,
        config: DFlashConfig,
        ckpt: &Checkpoint,
        name: PathBuf,
        block_size: Option<usize>,
    ) -> Result<Self> {
        let t = target.config();
        let mismatch = |field: &str, reason: String| {
            Err(EngineError::Config {
                path: name.join("config.json"),
                field: field.into(),
                reason,
            })
        };
        if config.hidden_size != t.hidden_size {
            return mismatch(
                "hidden_size",
                format!("{} differs from the target's {}", config.hidden_size, t.hidden_size),
            );
        }
        if config.vocab_size != t.vocab_size {
            return mismatch(
                "vocab_size",
                format!("{} differs from the target's {}", config.vocab_size, t.vocab_size),
            );
        }
        if let Some(&l) = config.target_layer_ids.iter().find(|&&l| l >= t.num_hidden_layers) {
            return mismatch(
                "dflash_config.target_layer_ids",
                format!("layer {l} is past the target's {} layers", t.num_hidden_layers),
            );
        }
        if config.mask_token_id as usize >= t.vocab_size {
            return mismatch(
                "dflash_config.mask_token_id",
                format!(
                    "{} is outside the target's vocabulary of {}",
                    config.mask_token_id, t.vocab_size
                ),
            );
        }
        let block_size = block_size.unwrap_or(config.block_size);
        if block_size < 2 {
            return Err(EngineError::Forward(format!(
                "DFlash block size must be at least 2, got {block_size}"
            )));
        }
        let r = Reader {
            ckpt,
            backend: target.backend(),
        };
        let (h, d) = (config.hidden_size, config.head_dim);
        let (qw, kvw) = (config.num_attention_heads * d, config.num_key_value_heads * d);
        let inter = config.intermediate_size;
        let layers = (0..config.num_hidden_layers)
            .map(|l| {
                let p = format!("layers.{l}");
                let a = format!("{p}.self_attn");
                let convs = match config.v2 {
                    Some(v2) => Some([
                        r.conv(
                            &format!("{p}.attention_conv"),
                            &config,
                            v2.conv_kernel_size,
                            v2.conv_group_size,
                        )?,
                        r.conv(
                            &format!("{p}.mlp_conv"),
                            &config,
                            v2.conv_kernel_size,
                            v2.conv_group_size,
                        )?,
                    ]),
                    None => None,
                };
                Ok(Layer {
                    input_norm: r.vector(&format!("{p}.input_layernorm"), h)?,
                    q: r.linear(&format!("{a}.q_proj"), qw, h)?,
                    k: r.linear(&format!("{a}.k_proj"), kvw, h)?,
                    v: r.linear(&format!("{a}.v_proj"), kvw, h)?,
                    o: r.linear(&format!("{a}.o_proj"), h, qw)?,
                    q_norm: r.vector(&format!("{a}.q_norm"), d)?,
                    k_norm: r.vector(&format!("{a}.k_norm"), d)?,
                    post_norm: r.vector(&format!("{p}.post_attention_layernorm"), h)?,
                    mlp: Ffn {
                        gate: r.linear(&format!("{p}.mlp.gate_proj"), inter, h)?,
                        up: r.linear(&format!("{p}.mlp.up_proj"), inter, h)?,
                        down: r.linear(&format!("{p}.mlp.down_proj"), h, inter)?,
                    },
                    attention: config.attention[l],
                    convs,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let selector = match config.v2 {
            Some(v2) => {
                let (v, rank) = (config.vocab_size, v2.selector_rank);
                Some(Selector {
                    codebooks: Codebooks {
                        predecessor: r.codebook("candidate_selector.predecessor_codebook", &[v, rank])?,
                        successor: r.codebook("candidate_selector.successor_codebook", &[v, rank])?,
                        rank,
                        top_k: v2.selector_top_k,
                    },
                    projection: r.linear("candidate_selector.hidden_projection", rank, h)?,
                })
            }
            None => None,
        };
        Ok(Self {
            name: name.display().to_string(),
            block_size,
            fc: r.linear("fc", h, config.target_layer_ids.len() * h)?,
            hidden_norm: r.vector("hidden_norm", h)?,
            norm: r.vector("norm", h)?,
            rope: Rope::from_parts(d, &config.rope),
            host_kv: vec![HostKv::default(); layers.len()],
            layers,
            selector,
            config,
            cache: None,
            context: 0,
        })
    }

    /// The drafter's configuration.
    pub fn config(&self) -> &DFlashConfig {
        &self.config
    }

    fn dims(&self) -> GqaDims {
        GqaDims {
            heads: self.config.num_attention_heads,
            kv_heads: self.config.num_key_value_heads,
            head_dim: self.config.head_dim,
        }
    }
}

/// Runs `f` on the host copy of `x` and uploads the result.
fn on_host<B: Backend>(b: &B, x: &B::Tensor, f: impl FnOnce(Matrix) -> Matrix) -> Result<B::Tensor> {
    b.load_matrix(f(b.to_host(x)?))
}

/// v2's `prepare`: the convolution with the first taps, and the second taps for `finish`.
fn conv_prepare<B: Backend>(b: &B, conv: &Conv<B>, x: &B::Tensor, group: usize) -> Result<(B::Tensor, Matrix)> {
    let dynamic = b.to_host(&b.linear(x, &conv.projection)?)?;
    let half = conv.base.len() / 2;
    let out = on_host(b, x, |x| {
        host::grouped_causal_conv(&x, &dynamic, 0, &conv.base[..half], group)
    })?;
    Ok((out, dynamic))
}

/// v2's `finish`: the convolution with the second taps and base kernel.
fn conv_finish<B: Backend>(b: &B, conv: &Conv<B>, x: &B::Tensor, dynamic: &Matrix, group: usize) -> Result<B::Tensor> {
    let half = conv.base.len() / 2;
    let offset = dynamic.cols / 2;
    on_host(b, x, |x| {
        host::grouped_causal_conv(&x, dynamic, offset, &conv.base[half..], group)
    })
}

impl<B: Backend> Drafter<B> for DFlashDrafter<B> {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn target_layers(&self) -> &[usize] {
        &self.config.target_layer_ids
    }

    fn begin(&mut self, target: &Model<B>, capacity: usize) -> Result<()> {
        let width = self.config.num_key_value_heads * self.config.head_dim;
        self.cache = Some(target.backend().new_kv_cache(2 * self.layers.len(), width, capacity)?);
        self.host_kv.iter_mut().for_each(|kv| *kv = HostKv::default());
        self.context = 0;
        Ok(())
    }

    fn draft(&mut self, target: &Model<B>, request: DraftRequest<'_, B::Tensor>) -> Result<B::Tensor> {
        let b = target.backend();
        let dims = self.dims();
        let eps = self.config.rms_norm_eps;
        let width = dims.kv_heads * dims.head_dim;
        let group = self.config.v2.map_or(1, |v2| v2.conv_group_size);
        let cache = self
            .cache
            .as_mut()
            .ok_or_else(|| EngineError::Forward("DFlash drafter used before begin()".into()))?;
        let Some(start) = request.tokens.len().checked_sub(1) else {
            return Err(EngineError::Forward("draft request without tokens".into()));
        };
        let Some(features) = request.features else {
            return Err(EngineError::Forward(
                "the DFlash drafter needs the target's features".into(),
            ));
        };
        // The features are the rows from the cached context up to the bonus.
        let ctx_len = self.context;
        let new_rows = b.dims(features).0;
        if ctx_len + new_rows != start {
            return Err(EngineError::Forward(format!(
                "DFlash drafter: {ctx_len} cached context rows plus {new_rows} new ones do not end at the \
                 bonus position {start}"
            )));
        }
        let ctx = b.rms_norm(&b.linear(features, &self.fc)?, &self.hidden_norm, eps)?;
        let ctx_positions: Vec<u32> = (ctx_len as u32..start as u32).collect();
        let block_positions: Vec<u32> = (start as u32..(start + self.block_size) as u32).collect();
        let mut ids = vec![self.config.mask_token_id; self.block_size];
        ids[0] = request.tokens[start];
        let mut x = target.embed(&ids)?;
        let embed_scale = self.config.input_embedding_scale;
        if embed_scale != 1.0 {
            x = on_host(b, &x, |mut m| {
                m.data.iter_mut().for_each(|v| *v *= embed_scale);
                m
            })?;
        }
        let scale = (self.config.head_dim as f32).powf(-0.5);
        for (l, layer) in self.layers.iter().enumerate() {
            let mut h = b.rms_norm(&x, &layer.input_norm, eps)?;
            let mut taps = None;
            if let Some([conv, _]) = &layer.convs {
                let (conv_h, dynamic) = conv_prepare(b, conv, &h, group)?;
                h = conv_h;
                taps = Some(dynamic);
            }
            let mut q = b.head_rms_norm(&b.linear(&h, &layer.q)?, &layer.q_norm, eps)?;
            b.rope_heads(&mut q, &self.rope, &block_positions)?;
            let full = layer.attention == DFlashAttention::FULL;
            for (rows, positions) in [(&ctx, &ctx_positions), (&h, &block_positions)] {
                let mut k = b.head_rms_norm(&b.linear(rows, &layer.k)?, &layer.k_norm, eps)?;
                b.rope_heads(&mut k, &self.rope, positions)?;
                let v = b.linear(rows, &layer.v)?;
                if full {
                    b.kv_append(cache, 2 * l, &k)?;
                    b.kv_append(cache, 2 * l + 1, &v)?;
                } else {
                    self.host_kv[l].append(&b.to_host(&k)?, &b.to_host(&v)?);
                }
            }
            let o = if full {
                b.gqa_attention(&q, cache, 2 * l, 2 * l + 1, dims, scale)?
            } else {
                let kv = &self.host_kv[l];
                on_host(b, &q, |q| {
                    host::masked_attention(&q, kv, dims, scale, start, layer.attention)
                })?
            };
            let mut a = b.linear(&o, &layer.o)?;
            if let (Some([conv, _]), Some(dynamic)) = (&layer.convs, &taps) {
                a = conv_finish(b, conv, &a, dynamic, group)?;
            }
            b.add_assign(&mut x, &a)?;
            let mut h = b.rms_norm(&x, &layer.post_norm, eps)?;
            let mut taps = None;
            if let Some([_, conv]) = &layer.convs {
                let (conv_h, dynamic) = conv_prepare(b, conv, &h, group)?;
                h = conv_h;
                taps = Some(dynamic);
            }
            let mut m = ffn(b, &layer.mlp, &h)?;
            if let (Some([_, conv]), Some(dynamic)) = (&layer.convs, &taps) {
                m = conv_finish(b, conv, &m, dynamic, group)?;
            }
            b.add_assign(&mut x, &m)?;
        }
        // Keep the context, drop the block.
        b.kv_truncate(cache, start)?;
        self.host_kv.iter_mut().for_each(|kv| kv.truncate(start, width));
        self.context = start;
        let rows: Vec<usize> = (1..self.block_size).collect();
        let h = b.rms_norm(&b.take_rows(&x, &rows)?, &self.norm, eps)?;
        let mut logits = target.lm_head(&h)?;
        let (multiplier, softcap) = (self.config.output_multiplier, self.config.final_logit_softcapping);
        if multiplier != 1.0 || softcap.is_some() || self.selector.is_some() {
            let mut host_logits = b.to_host(&logits)?;
            host::transform_logits(&mut host_logits, multiplier, softcap);
            if let Some(selector) = &self.selector {
                let projected = b.to_host(&b.linear(&h, &selector.projection)?)?;
                host_logits = selector.codebooks.select(&host_logits, &projected, ids[0]);
            }
            logits = b.load_logits(host_logits)?;
        }
        Ok(logits)
    }
}
