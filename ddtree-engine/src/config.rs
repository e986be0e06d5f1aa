//! HF `config.json` for DeepSeek-V3 and Kimi K2.x (`deepseek_v3`, `kimi_k2`, `kimi_k25`).
//!
//! Fields are read one by one from the JSON value so that every error names the exact field
//! (`text_config.rope_scaling.factor`, ...). Values the engine does not implement are errors, not
//! silent fallbacks.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{EngineError, Result};

/// `model_type` values whose text model is a DeepSeek-V3 decoder.
const TEXT_MODEL_TYPES: [&str; 2] = ["deepseek_v3", "kimi_k2"];
/// `model_type` values of multimodal wrappers that keep the decoder under `text_config`.
const WRAPPER_MODEL_TYPES: [&str; 1] = ["kimi_k25"];

/// Rotary embedding settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// `rope_theta`.
    pub theta: f64,
    /// `rope_interleave`: rotate adjacent pairs `(2i, 2i+1)` (true, the default) or the two halves.
    pub interleave: bool,
    /// `rope_scaling` of type `yarn`, if any.
    pub yarn: Option<YarnConfig>,
}

/// YaRN parameters from `rope_scaling`, with the HF defaults filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct YarnConfig {
    /// `factor`.
    pub factor: f64,
    /// `original_max_position_embeddings` (falls back to `max_position_embeddings`).
    pub original_max_position_embeddings: usize,
    /// `beta_fast` (default 32).
    pub beta_fast: f64,
    /// `beta_slow` (default 1).
    pub beta_slow: f64,
    /// `mscale` (absent = not set).
    pub mscale: Option<f64>,
    /// `mscale_all_dim` (absent = not set).
    pub mscale_all_dim: Option<f64>,
    /// `attention_factor`, the cos/sin multiplier, if given explicitly.
    pub attention_factor: Option<f64>,
    /// `truncate` (default true): floor/ceil the correction range.
    pub truncate: bool,
}

/// Mixture-of-experts routing and shapes.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// `n_routed_experts`.
    pub n_routed_experts: usize,
    /// `num_experts_per_tok` (top-k).
    pub num_experts_per_tok: usize,
    /// `n_shared_experts` (their intermediate size is `n_shared_experts * moe_intermediate_size`).
    pub n_shared_experts: usize,
    /// `n_group`: expert groups for group-limited routing.
    pub n_group: usize,
    /// `topk_group`: groups kept per token.
    pub topk_group: usize,
    /// `norm_topk_prob`: normalize the selected weights to sum to one.
    pub norm_topk_prob: bool,
    /// `routed_scaling_factor`.
    pub routed_scaling_factor: f32,
    /// `first_k_dense_replace`: layers below this index use a dense MLP.
    pub first_k_dense_replace: usize,
    /// `moe_intermediate_size`.
    pub moe_intermediate_size: usize,
}

/// compressed-tensors `pack-quantized` W4A16 settings.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantConfig {
    /// Scale group size along the input dimension (32 for Kimi).
    pub group_size: usize,
}

/// The validated model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Top-level `model_type`.
    pub model_type: String,
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `intermediate_size` (dense MLP layers).
    pub intermediate_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `q_lora_rank`; `None` means a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// `kv_lora_rank` (512 for Kimi).
    pub kv_lora_rank: usize,
    /// `qk_nope_head_dim`.
    pub qk_nope_head_dim: usize,
    /// `qk_rope_head_dim`.
    pub qk_rope_head_dim: usize,
    /// `v_head_dim`.
    pub v_head_dim: usize,
    /// `rms_norm_eps` (input, post-attention and final norms; the MLA-internal norms use 1e-6).
    pub rms_norm_eps: f32,
    /// `max_position_embeddings`: the context length.
    pub max_position_embeddings: usize,
    /// Rotary embedding.
    pub rope: RopeConfig,
    /// Experts and routing.
    pub moe: MoeConfig,
    /// `tie_word_embeddings`.
    pub tie_word_embeddings: bool,
    /// `bos_token_id`, if any.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (a number or a list).
    pub eos_token_ids: Vec<u32>,
    /// `quantization_config`, if the checkpoint is compressed-tensors INT4.
    pub quantization: Option<QuantConfig>,
}

impl ModelConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| EngineError::io(path, e))?;
        Self::from_json(&text, path)
    }

    /// Parses and validates config JSON; `path` is only used in error messages.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|source| EngineError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let top = Fields::root(path, &value)?;
        let model_type = top.string("model_type")?;
        let text_cfg = if WRAPPER_MODEL_TYPES.contains(&model_type.as_str()) {
            top.object("text_config")?
        } else if TEXT_MODEL_TYPES.contains(&model_type.as_str()) {
            top.clone()
        } else {
            return Err(top.err(
                "model_type",
                format!(
                    "unsupported model type {model_type:?} (supported: {:?} and {:?})",
                    TEXT_MODEL_TYPES, WRAPPER_MODEL_TYPES
                ),
            ));
        };
        if text_cfg.prefix != top.prefix {
            if let Some(inner) = text_cfg.opt_string("model_type")? {
                if !TEXT_MODEL_TYPES.contains(&inner.as_str()) {
                    return Err(text_cfg.err(
                        "model_type",
                        format!("unsupported text model type {inner:?} (supported: {TEXT_MODEL_TYPES:?})"),
                    ));
                }
            }
        }
        let quantization = match text_cfg.get("quantization_config") {
            Some(_) => Some(parse_quant(&text_cfg.object("quantization_config")?)?),
            None if top.get("quantization_config").is_some() => Some(parse_quant(&top.object("quantization_config")?)?),
            None => None,
        };
        parse_text_config(&text_cfg, model_type, quantization)
    }

    /// Dimension of one query/key head: `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Width of one latent KV cache row: `kv_lora_rank + qk_rope_head_dim` (576 for Kimi).
    pub fn latent_row_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// Whether layer `layer` uses the MoE block (otherwise a dense MLP).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        layer >= self.moe.first_k_dense_replace
    }
}

/// Which z-lab DFlash model class a drafter config names in `architectures`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DFlashArchitecture {
    /// `DFlashDraftModel`: Qwen3-style layers; draft logits from the target's LM head.
    V1,
    /// `DFlash2DraftModel`: v1 plus grouped dynamic causal convolutions around attention and
    /// MLP, and the candidate selector that rescores each position's top-k candidates.
    V2,
}

/// What one draft layer's attention sees (the package's `_attention_mask`): the block's queries
/// sit after the context, query `i` at key index `start + i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DFlashAttention {
    /// Keys after the query are hidden.
    pub causal: bool,
    /// Keys `window` or more positions away (before the query; after it too when not causal)
    /// are hidden.
    pub sliding_window: Option<usize>,
}

impl DFlashAttention {
    /// Non-causal, no window: the block sees itself and the whole context.
    pub const FULL: Self = Self {
        causal: false,
        sliding_window: None,
    };

    /// Whether the query at key index `query` sees key index `key`.
    pub fn sees(&self, query: usize, key: usize) -> bool {
        if self.causal && key > query {
            return false;
        }
        match self.sliding_window {
            Some(w) => query.abs_diff(key) < w,
            None => true,
        }
    }
}

/// `DFlash2DraftModel`'s extra fields (each from `dflash_config` or the top level).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DFlash2Config {
    /// `conv_kernel_size`: taps of each grouped dynamic causal convolution.
    pub conv_kernel_size: usize,
    /// `conv_group_size`: channels sharing one dynamic tap (divides `hidden_size`).
    pub conv_group_size: usize,
    /// `selector_rank`: width of the predecessor/successor codebooks.
    pub selector_rank: usize,
    /// `selector_top_k`: candidates rescored per position.
    pub selector_top_k: usize,
}

/// A DFlash block-diffusion drafter's `config.json` (z-lab `DFlashDraftModel` or
/// `DFlash2DraftModel`, `model_type` `qwen3`). As in the package, the DFlash fields
/// (`block_size`, `mask_token_id`, `target_layer_ids`, `input_embedding_scale`, ...) are read
/// from `dflash_config` first and the top level second.
#[derive(Debug, Clone, PartialEq)]
pub struct DFlashConfig {
    /// `architectures[0]` (absent: v1).
    pub architecture: DFlashArchitecture,
    /// `hidden_size` (must equal the target's).
    pub hidden_size: usize,
    /// `intermediate_size` of the SwiGLU MLPs.
    pub intermediate_size: usize,
    /// `num_hidden_layers`: draft layers.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `num_key_value_heads` (GQA).
    pub num_key_value_heads: usize,
    /// `head_dim` (Qwen3's default 128).
    pub head_dim: usize,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f32,
    /// `vocab_size` (must equal the target's: the drafter uses its embedding and LM head).
    pub vocab_size: usize,
    /// Rotary embedding (Qwen3: rotate-half pairs, optional YaRN).
    pub rope: RopeConfig,
    /// `block_size` (default 16).
    pub block_size: usize,
    /// `mask_token_id`.
    pub mask_token_id: u32,
    /// `target_layer_ids`, or DFlash's default spread over `num_target_layers`.
    pub target_layer_ids: Vec<usize>,
    /// `input_embedding_scale` (default 1): multiplies the block's target embeddings.
    pub input_embedding_scale: f32,
    /// `output_multiplier` (default 1): multiplies the draft logits.
    pub output_multiplier: f32,
    /// `final_logit_softcapping`: `c * tanh(logits / c)` when set and positive.
    pub final_logit_softcapping: Option<f32>,
    /// Per draft layer, from `layer_types`, `sliding_window` / `use_sliding_window` and
    /// `is_causal`.
    pub attention: Vec<DFlashAttention>,
    /// The v2 fields (`Some` exactly for [`DFlashArchitecture::V2`]).
    pub v2: Option<DFlash2Config>,
}

impl DFlashConfig {
    /// Reads and validates a drafter `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| EngineError::io(path, e))?;
        Self::from_json(&text, path)
    }

    /// Parses and validates drafter config JSON; `path` is only used in error messages.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|source| EngineError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let f = Fields::root(path, &value)?;
        let dflash = match f.get("dflash_config") {
            None | Some(Value::Null) => None,
            Some(_) => Some(f.object("dflash_config")?),
        };
        // The package's `_draft_value`: `dflash_config[name]`, else the top-level field.
        let draft = |name: &str| draft_field(dflash.as_ref(), &f, name);
        let architecture = match f.get("architectures") {
            None | Some(Value::Null) => DFlashArchitecture::V1,
            Some(Value::Array(items)) => match items.first().and_then(Value::as_str) {
                Some("DFlashDraftModel") => DFlashArchitecture::V1,
                Some("DFlash2DraftModel") => DFlashArchitecture::V2,
                other => {
                    return Err(f.err(
                        "architectures",
                        format!(
                            "unsupported drafter architecture {other:?} (supported: \"DFlashDraftModel\", \
                             \"DFlash2DraftModel\")"
                        ),
                    ))
                }
            },
            Some(other) => return Err(f.err("architectures", format!("expected a list, got {other}"))),
        };
        let act = f.opt_string("hidden_act")?.unwrap_or_else(|| "silu".into());
        if act != "silu" {
            return Err(f.err("hidden_act", format!("unsupported activation {act:?} (only \"silu\")")));
        }
        if f.bool_or("attention_bias", false)? {
            return Err(f.err("attention_bias", "attention biases are not supported".into()));
        }
        if f.get("rope_parameters").is_some() {
            return Err(f.err(
                "rope_parameters",
                "transformers 5 rope_parameters are not supported; use rope_theta / rope_scaling".into(),
            ));
        }
        let hidden_size = f.positive("hidden_size")?;
        let heads = f.positive("num_attention_heads")?;
        let kv_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(heads);
        #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` needs Rust 1.87; MSRV is 1.85
        if kv_heads == 0 || heads % kv_heads != 0 {
            return Err(f.err(
                "num_key_value_heads",
                format!("must be positive and divide num_attention_heads ({heads}), got {kv_heads}"),
            ));
        }
        let head_dim = f.opt_usize("head_dim")?.unwrap_or(128);
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(f.err("head_dim", format!("must be positive and even, got {head_dim}")));
        }
        let layers = f.positive("num_hidden_layers")?;
        let max_position_embeddings = f.positive("max_position_embeddings")?;
        let block_size = draft("block_size").opt_usize("block_size")?.unwrap_or(16);
        if block_size < 2 {
            return Err(draft("block_size").err("block_size", format!("must be at least 2, got {block_size}")));
        }
        let mask_token_id = match draft("mask_token_id").get("mask_token_id") {
            Some(_) => draft("mask_token_id").token_id("mask_token_id")?,
            None if dflash.is_none() => {
                return Err(f.err(
                    "dflash_config",
                    "missing (a DFlash drafter needs dflash_config.mask_token_id)".into(),
                ))
            }
            None => return Err(dflash.as_ref().unwrap_or(&f).err("mask_token_id", "missing".into())),
        };
        let t = draft("target_layer_ids");
        let target_layer_ids = match t.get("target_layer_ids") {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|n| n as usize)
                        .ok_or_else(|| t.err("target_layer_ids", format!("expected layer indices, got {v}")))
                })
                .collect::<Result<Vec<_>>>()?,
            None | Some(Value::Null) => default_target_layer_ids(f.positive("num_target_layers")?, layers),
            Some(other) => return Err(t.err("target_layer_ids", format!("expected a list, got {other}"))),
        };
        if target_layer_ids.is_empty() {
            return Err(t.err("target_layer_ids", "must name at least one layer".into()));
        }
        let float = |name: &str, default: f64| -> Result<f32> {
            let v = draft(name).f64_or(name, default)?;
            Ok(v as f32)
        };
        let softcap = draft("final_logit_softcapping").opt_f64("final_logit_softcapping")?;
        let v2 = match architecture {
            DFlashArchitecture::V1 => None,
            DFlashArchitecture::V2 => {
                let field = |name: &str| draft(name).positive(name);
                let v2 = DFlash2Config {
                    conv_kernel_size: field("conv_kernel_size")?,
                    conv_group_size: field("conv_group_size")?,
                    selector_rank: field("selector_rank")?,
                    selector_top_k: field("selector_top_k")?,
                };
                #[allow(clippy::manual_is_multiple_of)] // MSRV 1.85
                if hidden_size % v2.conv_group_size != 0 {
                    return Err(draft("conv_group_size").err(
                        "conv_group_size",
                        format!("must divide hidden_size ({hidden_size}), got {}", v2.conv_group_size),
                    ));
                }
                Some(v2)
            }
        };
        let vocab_size = f.positive("vocab_size")?;
        if let Some(v2) = v2 {
            if v2.selector_top_k > vocab_size {
                return Err(draft("selector_top_k").err(
                    "selector_top_k",
                    format!("exceeds vocab_size ({vocab_size}): {}", v2.selector_top_k),
                ));
            }
        }
        Ok(Self {
            architecture,
            hidden_size,
            intermediate_size: f.positive("intermediate_size")?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)? as f32,
            vocab_size,
            rope: RopeConfig {
                theta: f.f64_or("rope_theta", 10000.0)?,
                interleave: false,
                yarn: parse_rope_scaling(&f, max_position_embeddings)?,
            },
            block_size,
            mask_token_id,
            target_layer_ids,
            input_embedding_scale: float("input_embedding_scale", 1.0)?,
            output_multiplier: float("output_multiplier", 1.0)?,
            final_logit_softcapping: softcap.filter(|&c| c > 0.0).map(|c| c as f32),
            attention: parse_dflash_attention(&f, layers)?,
            v2,
        })
    }
}

/// Where a DFlash field lives: `dflash_config` when it holds `name`, else the top level.
fn draft_field<'b, 'a>(dflash: Option<&'b Fields<'a>>, top: &'b Fields<'a>, name: &str) -> &'b Fields<'a> {
    match dflash {
        Some(d) if d.get(name).is_some() => d,
        _ => top,
    }
}

/// Qwen3Config's layer types (`layer_types`, else `sliding_attention` from layer
/// `max_window_layers` on when `use_sliding_window`) and the DFlash attention rule: a
/// sliding layer is causal with the window, `is_causal` overrides causality for every layer.
fn parse_dflash_attention(f: &Fields<'_>, layers: usize) -> Result<Vec<DFlashAttention>> {
    // Qwen3Config drops the window unless `use_sliding_window`.
    let window = if f.bool_or("use_sliding_window", false)? {
        match f.get("sliding_window") {
            None => Some(4096),
            Some(Value::Null) => None,
            Some(_) => Some(f.positive("sliding_window")?),
        }
    } else {
        None
    };
    let sliding: Vec<bool> = match f.get("layer_types") {
        None | Some(Value::Null) => {
            let first = f.opt_usize("max_window_layers")?.unwrap_or(28);
            (0..layers).map(|i| window.is_some() && i >= first).collect()
        }
        Some(Value::Array(items)) => {
            if items.len() != layers {
                return Err(f.err(
                    "layer_types",
                    format!("has {} entries for {layers} num_hidden_layers", items.len()),
                ));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("full_attention") => Ok(false),
                    Some("sliding_attention") => Ok(true),
                    _ => Err(f.err(
                        &format!("layer_types[{i}]"),
                        format!("unsupported layer type {v} (only \"full_attention\" and \"sliding_attention\")"),
                    )),
                })
                .collect::<Result<_>>()?
        }
        Some(other) => return Err(f.err("layer_types", format!("expected a list, got {other}"))),
    };
    let is_causal = match f.get("is_causal") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(other) => return Err(f.err("is_causal", format!("expected a boolean, got {other}"))),
    };
    Ok(sliding
        .into_iter()
        .map(|s| DFlashAttention {
            causal: is_causal.unwrap_or(s),
            sliding_window: if s { window } else { None },
        })
        .collect())
}

/// DFlash's `build_target_layer_ids`: `n_draft` layers spread evenly from layer 1 to
/// `n_target - 3` (the middle layer for a one-layer drafter), rounded half to even as Python does.
pub fn default_target_layer_ids(n_target: usize, n_draft: usize) -> Vec<usize> {
    if n_draft == 1 {
        return vec![n_target / 2];
    }
    let (start, end) = (1.0, n_target as f64 - 3.0);
    (0..n_draft)
        .map(|i| (start + i as f64 * (end - start) / (n_draft - 1) as f64).round_ties_even() as usize)
        .collect()
}

fn parse_text_config(f: &Fields<'_>, model_type: String, quantization: Option<QuantConfig>) -> Result<ModelConfig> {
    let heads = f.positive("num_attention_heads")?;
    if let Some(kv_heads) = f.opt_usize("num_key_value_heads")? {
        if kv_heads != heads {
            return Err(f.err(
                "num_key_value_heads",
                format!("must equal num_attention_heads ({heads}) for MLA, got {kv_heads}"),
            ));
        }
    }
    let act = f.opt_string("hidden_act")?.unwrap_or_else(|| "silu".into());
    if act != "silu" {
        return Err(f.err("hidden_act", format!("unsupported activation {act:?} (only \"silu\")")));
    }
    if f.bool_or("attention_bias", false)? {
        return Err(f.err("attention_bias", "attention biases are not supported".into()));
    }
    if let Some(freq) = f.opt_usize("moe_layer_freq")? {
        if freq != 1 {
            return Err(f.err("moe_layer_freq", format!("only 1 is supported, got {freq}")));
        }
    }
    let scoring = f.opt_string("scoring_func")?.unwrap_or_else(|| "sigmoid".into());
    if scoring != "sigmoid" {
        return Err(f.err("scoring_func", format!("unsupported {scoring:?} (only \"sigmoid\")")));
    }
    let topk_method = f.opt_string("topk_method")?.unwrap_or_else(|| "noaux_tc".into());
    if topk_method != "noaux_tc" {
        return Err(f.err(
            "topk_method",
            format!("unsupported {topk_method:?} (only \"noaux_tc\")"),
        ));
    }
    let num_hidden_layers = f.positive("num_hidden_layers")?;
    let moe = parse_moe(f, num_hidden_layers)?;
    let max_position_embeddings = f.positive("max_position_embeddings")?;
    let qk_rope_head_dim = f.positive("qk_rope_head_dim")?;
    if qk_rope_head_dim % 2 != 0 {
        return Err(f.err("qk_rope_head_dim", format!("must be even, got {qk_rope_head_dim}")));
    }
    let q_lora_rank = match f.get("q_lora_rank") {
        None | Some(Value::Null) => None,
        Some(_) => Some(f.positive("q_lora_rank")?),
    };
    let rope = RopeConfig {
        theta: f.f64_or("rope_theta", 10000.0)?,
        interleave: f.bool_or("rope_interleave", true)?,
        yarn: parse_rope_scaling(f, max_position_embeddings)?,
    };
    let eos_token_ids = match f.get("eos_token_id") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => (0..items.len())
            .map(|i| f.token_id_at("eos_token_id", i))
            .collect::<Result<_>>()?,
        Some(_) => vec![f.token_id("eos_token_id")?],
    };
    let bos_token_id = match f.get("bos_token_id") {
        None | Some(Value::Null) => None,
        Some(_) => Some(f.token_id("bos_token_id")?),
    };
    Ok(ModelConfig {
        model_type,
        vocab_size: f.positive("vocab_size")?,
        hidden_size: f.positive("hidden_size")?,
        intermediate_size: f.positive("intermediate_size")?,
        num_hidden_layers,
        num_attention_heads: heads,
        q_lora_rank,
        kv_lora_rank: f.positive("kv_lora_rank")?,
        qk_nope_head_dim: f.positive("qk_nope_head_dim")?,
        qk_rope_head_dim,
        v_head_dim: f.positive("v_head_dim")?,
        rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)? as f32,
        max_position_embeddings,
        rope,
        moe,
        tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
        bos_token_id,
        eos_token_ids,
        quantization,
    })
}

fn parse_moe(f: &Fields<'_>, num_hidden_layers: usize) -> Result<MoeConfig> {
    let n_routed_experts = f.positive("n_routed_experts")?;
    let num_experts_per_tok = f.positive("num_experts_per_tok")?;
    let n_group = f.opt_usize("n_group")?.unwrap_or(1);
    let topk_group = f.opt_usize("topk_group")?.unwrap_or(1);
    if n_group == 0 || n_routed_experts % n_group != 0 {
        return Err(f.err(
            "n_group",
            format!("must be positive and divide n_routed_experts ({n_routed_experts}), got {n_group}"),
        ));
    }
    let per_group = n_routed_experts / n_group;
    if n_group > 1 && per_group < 2 {
        return Err(f.err(
            "n_group",
            format!("groups need at least 2 experts each, got {per_group}"),
        ));
    }
    if topk_group == 0 || topk_group > n_group {
        return Err(f.err("topk_group", format!("must be in 1..={n_group}, got {topk_group}")));
    }
    if num_experts_per_tok > topk_group * per_group {
        return Err(f.err(
            "num_experts_per_tok",
            format!(
                "{num_experts_per_tok} exceeds the {} experts in the {topk_group} kept groups",
                topk_group * per_group
            ),
        ));
    }
    let first_k_dense_replace = f.opt_usize("first_k_dense_replace")?.unwrap_or(0);
    if first_k_dense_replace > num_hidden_layers {
        return Err(f.err(
            "first_k_dense_replace",
            format!("{first_k_dense_replace} exceeds num_hidden_layers ({num_hidden_layers})"),
        ));
    }
    Ok(MoeConfig {
        n_routed_experts,
        num_experts_per_tok,
        n_shared_experts: f.opt_usize("n_shared_experts")?.unwrap_or(0),
        n_group,
        topk_group,
        norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
        routed_scaling_factor: f.f64_or("routed_scaling_factor", 1.0)? as f32,
        first_k_dense_replace,
        moe_intermediate_size: f.positive("moe_intermediate_size")?,
    })
}

fn parse_rope_scaling(f: &Fields<'_>, max_position_embeddings: usize) -> Result<Option<YarnConfig>> {
    match f.get("rope_scaling") {
        None | Some(Value::Null) => return Ok(None),
        Some(_) => {}
    }
    let s = f.object("rope_scaling")?;
    // HF reads `rope_type` and falls back to the legacy `type`.
    let (key, kind) = match s.opt_string("rope_type")? {
        Some(kind) => ("rope_type", kind),
        None => ("type", s.string("type")?),
    };
    match kind.as_str() {
        "default" => return Ok(None),
        "yarn" => {}
        other => {
            return Err(s.err(key, format!("unsupported rope scaling {other:?} (only \"yarn\")")));
        }
    }
    let factor = s.f64("factor")?;
    if factor < 1.0 {
        return Err(s.err("factor", format!("must be >= 1, got {factor}")));
    }
    let nonzero = |name: &str| -> Result<Option<f64>> {
        // HF treats 0 and absent alike (`config.get(..) or default`).
        Ok(s.opt_f64(name)?.filter(|v| *v != 0.0))
    };
    Ok(Some(YarnConfig {
        factor,
        original_max_position_embeddings: match s.opt_usize("original_max_position_embeddings")? {
            Some(0) | None => max_position_embeddings,
            Some(v) => v,
        },
        beta_fast: nonzero("beta_fast")?.unwrap_or(32.0),
        beta_slow: nonzero("beta_slow")?.unwrap_or(1.0),
        mscale: nonzero("mscale")?,
        mscale_all_dim: nonzero("mscale_all_dim")?,
        attention_factor: s.opt_f64("attention_factor")?,
        truncate: s.bool_or("truncate", true)?,
    }))
}

fn parse_quant(q: &Fields<'_>) -> Result<QuantConfig> {
    let method = q.string("quant_method")?;
    if method != "compressed-tensors" {
        return Err(q.err(
            "quant_method",
            format!("unsupported {method:?} (only \"compressed-tensors\" INT4 pack-quantized)"),
        ));
    }
    if let Some(format) = q.opt_string("format")? {
        if format != "pack-quantized" {
            return Err(q.err("format", format!("unsupported {format:?} (only \"pack-quantized\")")));
        }
    }
    let groups = q.object("config_groups")?;
    let mut group_size = None;
    for name in groups.keys() {
        let g = groups.object(&name)?;
        if !matches!(g.get("input_activations"), None | Some(Value::Null)) {
            return Err(g.err(
                "input_activations",
                "only weight-only (W4A16) quantization is supported".into(),
            ));
        }
        let w = g.object("weights")?;
        let bits = w.usize("num_bits")?;
        if bits != 4 {
            return Err(w.err("num_bits", format!("only 4-bit weights are supported, got {bits}")));
        }
        let kind = w.opt_string("type")?.unwrap_or_else(|| "int".into());
        if kind != "int" {
            return Err(w.err("type", format!("only \"int\" is supported, got {kind:?}")));
        }
        if !w.bool_or("symmetric", true)? {
            return Err(w.err("symmetric", "only symmetric quantization is supported".into()));
        }
        let strategy = w.string("strategy")?;
        if strategy != "group" {
            return Err(w.err("strategy", format!("only \"group\" is supported, got {strategy:?}")));
        }
        let size = w.positive("group_size")?;
        if size % 8 != 0 {
            return Err(w.err("group_size", format!("must be a multiple of 8, got {size}")));
        }
        if group_size.is_some_and(|g| g != size) {
            return Err(w.err(
                "group_size",
                format!("all config groups must share one group size, got {size}"),
            ));
        }
        group_size = Some(size);
    }
    match group_size {
        Some(group_size) => Ok(QuantConfig { group_size }),
        None => Err(q.err("config_groups", "no quantization group is defined".into())),
    }
}

/// A JSON object plus the dotted prefix used to name its fields in errors.
#[derive(Clone)]
struct Fields<'a> {
    path: &'a Path,
    prefix: String,
    obj: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn root(path: &'a Path, value: &'a Value) -> Result<Self> {
        match value {
            Value::Object(obj) => Ok(Self {
                path,
                prefix: String::new(),
                obj,
            }),
            _ => Err(EngineError::Config {
                path: path.to_path_buf(),
                field: "<root>".into(),
                reason: "expected a JSON object".into(),
            }),
        }
    }

    fn err(&self, name: &str, reason: String) -> EngineError {
        EngineError::Config {
            path: PathBuf::from(self.path),
            field: format!("{}{name}", self.prefix),
            reason,
        }
    }

    fn get(&self, name: &str) -> Option<&'a Value> {
        self.obj.get(name)
    }

    fn keys(&self) -> Vec<String> {
        self.obj.keys().cloned().collect()
    }

    fn required(&self, name: &str) -> Result<&'a Value> {
        self.get(name).ok_or_else(|| self.err(name, "missing".into()))
    }

    fn object(&self, name: &str) -> Result<Fields<'a>> {
        match self.required(name)? {
            Value::Object(obj) => Ok(Fields {
                path: self.path,
                prefix: format!("{}{name}.", self.prefix),
                obj,
            }),
            other => Err(self.err(name, format!("expected an object, got {other}"))),
        }
    }

    fn opt_string(&self, name: &str) -> Result<Option<String>> {
        match self.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(self.err(name, format!("expected a string, got {other}"))),
        }
    }

    fn string(&self, name: &str) -> Result<String> {
        self.opt_string(name)?.ok_or_else(|| self.err(name, "missing".into()))
    }

    fn opt_usize(&self, name: &str) -> Result<Option<usize>> {
        match self.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| self.err(name, format!("expected a non-negative integer, got {v}"))),
        }
    }

    fn usize(&self, name: &str) -> Result<usize> {
        self.opt_usize(name)?.ok_or_else(|| self.err(name, "missing".into()))
    }

    fn positive(&self, name: &str) -> Result<usize> {
        match self.usize(name)? {
            0 => Err(self.err(name, "must be positive, got 0".into())),
            n => Ok(n),
        }
    }

    fn token_id(&self, name: &str) -> Result<u32> {
        let v = self.required(name)?;
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| self.err(name, format!("expected a token id, got {v}")))
    }

    fn token_id_at(&self, name: &str, index: usize) -> Result<u32> {
        let v = &self.required(name)?[index];
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| self.err(&format!("{name}[{index}]"), format!("expected a token id, got {v}")))
    }

    fn opt_f64(&self, name: &str) -> Result<Option<f64>> {
        match self.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(self.err(name, format!("expected a finite number, got {v}"))),
            },
        }
    }

    fn f64(&self, name: &str) -> Result<f64> {
        self.opt_f64(name)?.ok_or_else(|| self.err(name, "missing".into()))
    }

    fn f64_or(&self, name: &str, default: f64) -> Result<f64> {
        Ok(self.opt_f64(name)?.unwrap_or(default))
    }

    fn bool_or(&self, name: &str, default: bool) -> Result<bool> {
        match self.get(name) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(self.err(name, format!("expected a boolean, got {other}"))),
        }
    }
}
