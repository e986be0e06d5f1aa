//! The DFlash block-diffusion drafter (z-lab `DFlashDraftModel`), written against [`Backend`].
//!
//! Qwen3-style layers (pre-norm, GQA attention with per-head q/k RMS norms and rotate-half RoPE,
//! SwiGLU) without an embedding or LM head of their own: the block is
//! `[embed(bonus), embed(mask) x (block_size - 1)]` through the target's embedding and the logits
//! come from the target's LM head on the final-normed rows `1..block_size`. The target's hidden
//! states after `target_layer_ids` are concatenated, projected by `fc` and normalized by
//! `hidden_norm`; in every layer they give keys and values (queries come from the block only),
//! and attention is non-causal: the block sees itself and the whole context. Context keys and
//! values stay cached across rounds; the block's are dropped after each draft (the cache is
//! cropped back to the committed length), so each round only projects the newly committed
//! tokens' features.

use std::path::{Path, PathBuf};

use crate::backend::{Backend, GqaDims, HostLinear};
use crate::config::DFlashConfig;
use crate::error::{EngineError, Result};
use crate::model::{ffn, float_tensor, Ffn, Model};
use crate::rope::Rope;
use crate::spec::drafter::{DraftRequest, Drafter};
use crate::weights::Checkpoint;

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
}

/// A loaded DFlash drafter and its per-sequence context cache.
pub struct DFlashDrafter<B: Backend> {
    name: String,
    config: DFlashConfig,
    block_size: usize,
    fc: B::Weight,
    hidden_norm: B::Vector,
    layers: Vec<Layer<B>>,
    norm: B::Vector,
    rope: Rope,
    /// Per layer `l`, keys in cache layer `2l` and values in `2l + 1`, one row per context token.
    cache: Option<B::KvCache>,
}

/// Reads dense weights by name from a checkpoint.
struct Reader<'a, B> {
    ckpt: &'a Checkpoint,
    backend: &'a B,
}

impl<B: Backend> Reader<'_, B> {
    fn linear(&self, name: &str, out: usize, inp: usize) -> Result<B::Weight> {
        let data = float_tensor(self.ckpt, &format!("{name}.weight"), &[out, inp])?.to_f32(true)?;
        self.backend.load_weight(HostLinear::Dense { out, inp, data })
    }

    fn vector(&self, name: &str, len: usize) -> Result<B::Vector> {
        self.backend
            .load_vector(float_tensor(self.ckpt, &format!("{name}.weight"), &[len])?.to_f32(true)?)
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

    /// Builds the drafter from a parsed config and an open checkpoint; `name` labels reports.
    pub fn from_parts(
        target: &Model<B>,
        config: DFlashConfig,
        ckpt: &Checkpoint,
        name: PathBuf,
        block_size: Option<usize>,
    ) -> Result<Self> {
        let t = target.config();
        let mismatch = |what: &str, drafter: usize, target: usize| {
            Err(EngineError::Forward(format!(
                "DFlash drafter {}: {what} is {drafter} but the target's is {target}",
                name.display()
            )))
        };
        if config.hidden_size != t.hidden_size {
            return mismatch("hidden_size", config.hidden_size, t.hidden_size);
        }
        if config.vocab_size != t.vocab_size {
            return mismatch("vocab_size", config.vocab_size, t.vocab_size);
        }
        if let Some(&l) = config.target_layer_ids.iter().find(|&&l| l >= t.num_hidden_layers) {
            return mismatch("a target layer id", l, t.num_hidden_layers - 1);
        }
        if config.mask_token_id as usize >= t.vocab_size {
            return mismatch("mask_token_id", config.mask_token_id as usize, t.vocab_size - 1);
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
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            name: name.display().to_string(),
            block_size,
            fc: r.linear("fc", h, config.target_layer_ids.len() * h)?,
            hidden_norm: r.vector("hidden_norm", h)?,
            norm: r.vector("norm", h)?,
            rope: Rope::from_parts(d, &config.rope),
            layers,
            config,
            cache: None,
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
        Ok(())
    }

    fn draft(&mut self, target: &Model<B>, request: DraftRequest<'_, B::Tensor>) -> Result<B::Tensor> {
        let b = target.backend();
        let dims = self.dims();
        let eps = self.config.rms_norm_eps;
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
        // The features are the rows from the cached context up to the bonus (rope_heads checks
        // their count against these positions).
        let ctx_len = b.kv_len(cache);
        if ctx_len > start {
            return Err(EngineError::Forward(format!(
                "DFlash drafter: {ctx_len} cached context rows reach past the bonus position {start}"
            )));
        }
        let ctx = b.rms_norm(&b.linear(features, &self.fc)?, &self.hidden_norm, eps)?;
        let ctx_positions: Vec<u32> = (ctx_len as u32..start as u32).collect();
        let block_positions: Vec<u32> = (start as u32..(start + self.block_size) as u32).collect();
        let mut ids = vec![self.config.mask_token_id; self.block_size];
        ids[0] = request.tokens[start];
        let mut x = target.embed(&ids)?;
        let scale = (self.config.head_dim as f32).powf(-0.5);
        for (l, layer) in self.layers.iter().enumerate() {
            let h = b.rms_norm(&x, &layer.input_norm, eps)?;
            let mut q = b.head_rms_norm(&b.linear(&h, &layer.q)?, &layer.q_norm, eps)?;
            b.rope_heads(&mut q, &self.rope, &block_positions)?;
            for (rows, positions) in [(&ctx, &ctx_positions), (&h, &block_positions)] {
                let mut k = b.head_rms_norm(&b.linear(rows, &layer.k)?, &layer.k_norm, eps)?;
                b.rope_heads(&mut k, &self.rope, positions)?;
                b.kv_append(cache, 2 * l, &k)?;
                b.kv_append(cache, 2 * l + 1, &b.linear(rows, &layer.v)?)?;
            }
            let o = b.gqa_attention(&q, cache, 2 * l, 2 * l + 1, dims, scale)?;
            b.add_assign(&mut x, &b.linear(&o, &layer.o)?)?;
            let h = b.rms_norm(&x, &layer.post_norm, eps)?;
            b.add_assign(&mut x, &ffn(b, &layer.mlp, &h)?)?;
        }
        // Keep the context, drop the block.
        b.kv_truncate(cache, start)?;
        let rows: Vec<usize> = (1..self.block_size).collect();
        let h = b.rms_norm(&b.take_rows(&x, &rows)?, &self.norm, eps)?;
        target.lm_head(&h)
    }
}
