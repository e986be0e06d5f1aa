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

/// A DFlash block-diffusion drafter's `config.json` (z-lab `DFlashDraftModel`, `model_type`
/// `qwen3`, with `dflash_config`).
#[derive(Debug, Clone, PartialEq)]
pub struct DFlashConfig {
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
    /// `head_dim` (default `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f32,
    /// `vocab_size` (must equal the target's: the drafter uses its embedding and LM head).
    pub vocab_size: usize,
    /// Rotary embedding (Qwen3: rotate-half pairs, optional YaRN).
    pub rope: RopeConfig,
    /// `block_size` (top level, or `dflash_config.block_size`).
    pub block_size: usize,
    /// `dflash_config.mask_token_id`.
    pub mask_token_id: u32,
    /// `dflash_config.target_layer_ids`, or DFlash's default spread over `num_target_layers`.
    pub target_layer_ids: Vec<usize>,
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
        check_dflash_architecture(&f)?;
        let dflash = f.object("dflash_config")?;
        let act = f.opt_string("hidden_act")?.unwrap_or_else(|| "silu".into());
        if act != "silu" {
            return Err(f.err("hidden_act", format!("unsupported activation {act:?} (only \"silu\")")));
        }
        if f.bool_or("attention_bias", false)? {
            return Err(f.err("attention_bias", "attention biases are not supported".into()));
        }
        if f.bool_or("use_sliding_window", false)? {
            return Err(f.err("use_sliding_window", "sliding-window drafters are not supported".into()));
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
        let head_dim = f.opt_usize("head_dim")?.unwrap_or(hidden_size / heads);
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(f.err("head_dim", format!("must be positive and even, got {head_dim}")));
        }
        let layers = f.positive("num_hidden_layers")?;
        let max_position_embeddings = f.positive("max_position_embeddings")?;
        let block_size = match dflash.opt_usize("block_size")? {
            Some(b) => b,
            None => f.positive("block_size")?,
        };
        if block_size < 2 {
            return Err(f.err("block_size", format!("must be at least 2, got {block_size}")));
        }
        let target_layer_ids = match dflash.get("target_layer_ids") {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|n| n as usize)
                        .ok_or_else(|| dflash.err("target_layer_ids", format!("expected layer indices, got {v}")))
                })
                .collect::<Result<Vec<_>>>()?,
            Some(other) => return Err(dflash.err("target_layer_ids", format!("expected a list, got {other}"))),
            None => default_target_layer_ids(f.positive("num_target_layers")?, layers),
        };
        if target_layer_ids.is_empty() {
            return Err(dflash.err("target_layer_ids", "must name at least one layer".into()));
        }
        Ok(Self {
            hidden_size,
            intermediate_size: f.positive("intermediate_size")?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)? as f32,
            vocab_size: f.positive("vocab_size")?,
            rope: RopeConfig {
                theta: f.f64_or("rope_theta", 10000.0)?,
                interleave: false,
                yarn: parse_rope_scaling(&f, max_position_embeddings)?,
            },
            block_size,
            mask_token_id: dflash.token_id("mask_token_id")?,
            target_layer_ids,
        })
    }
}

/// Drafter classes whose `config.json` [`DFlashConfig`] reads (`architectures`).
pub const DFLASH_ARCHITECTURES: [&str; 1] = ["DFlashDraftModel"];

/// Rejects a drafter config whose `architectures` names no class in [`DFLASH_ARCHITECTURES`]
/// (a missing field is accepted: the layout is then checked field by field).
fn check_dflash_architecture(f: &Fields<'_>) -> Result<()> {
    let Some(value) = f.get("architectures") else {
        return Ok(());
    };
    let names: Vec<&str> = match value {
        Value::Array(items) => items.iter().filter_map(Value::as_str).collect(),
        other => return Err(f.err("architectures", format!("expected a list of class names, got {other}"))),
    };
    if names.iter().any(|n| DFLASH_ARCHITECTURES.contains(n)) {
        return Ok(());
    }
    Err(f.err(
        "architectures",
        format!("unsupported drafter architecture {names:?} (supported: {DFLASH_ARCHITECTURES:?})"),
    ))
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
