//! Bad input gives clear errors naming the file, tensor or field, never a panic.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use ddtree_engine::{generate_plain, CpuBackend, EngineError, GenerateOptions, LoadOptions, Model, ModelConfig};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

const SHARD1: &str = "model-00001-of-00002.safetensors";
const SHARD2: &str = "model-00002-of-00002.safetensors";
const PREFIX: &str = "language_model.model.layers.1";

/// A scratch copy of the tiny-kimi fixture, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ddtree-bad-input-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-kimi");
        std::fs::create_dir_all(&dir).unwrap();
        for entry in std::fs::read_dir(src).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
        }
        Self(dir)
    }

    fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }

    /// The shard that holds `tensor`.
    fn shard_of(&self, tensor: &str) -> &'static str {
        let bytes = std::fs::read(self.path(SHARD1)).unwrap();
        if SafeTensors::deserialize(&bytes).unwrap().names().contains(&tensor) {
            SHARD1
        } else {
            SHARD2
        }
    }

    /// Rewrites the shard holding `tensor`, replacing it by `edit(dtype, shape, bytes)` (or dropping it).
    fn edit_tensor(
        &self,
        tensor: &str,
        edit: impl FnOnce(Dtype, Vec<usize>, Vec<u8>) -> Option<(Dtype, Vec<usize>, Vec<u8>)>,
    ) {
        let path = self.path(self.shard_of(tensor));
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        let mut edit = Some(edit);
        for (name, view) in st.tensors() {
            let (dtype, shape, data) = (view.dtype(), view.shape().to_vec(), view.data().to_vec());
            if name == tensor {
                if let Some((d, s, b)) = (edit.take().unwrap())(dtype, shape, data) {
                    owned.push((name, d, s, b));
                }
            } else {
                owned.push((name, dtype, shape, data));
            }
        }
        let views: Vec<(String, TensorView<'_>)> = owned
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
    }

    fn edit_text(&self, file: &str, from: &str, to: &str) {
        let path = self.path(file);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(from), "{file} lacks {from:?}");
        std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
    }

    fn load_with(&self, options: LoadOptions) -> Result<Model<CpuBackend>, EngineError> {
        Model::load_dir(CpuBackend::default(), &self.0, options, &mut |_, _| {})
    }

    fn load_err(&self) -> String {
        match self.load_with(LoadOptions::default()) {
            Ok(_) => panic!("loading should fail"),
            Err(e) => e.to_string(),
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn assert_mentions(msg: &str, parts: &[&str]) {
    for part in parts {
        assert!(msg.contains(part), "error {msg:?} does not mention {part:?}");
    }
}

#[test]
fn pristine_copy_loads_with_monotonic_progress() {
    let s = Scratch::new();
    let mut calls: Vec<(u64, u64)> = Vec::new();
    Model::load_dir(
        CpuBackend::default(),
        &s.0,
        LoadOptions::default(),
        &mut |done, total| calls.push((done, total)),
    )
    .unwrap();
    assert!(calls.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 == w[1].1));
    let &(done, total) = calls.last().unwrap();
    assert!(total > 0 && done == total);
}

#[test]
fn single_unsharded_file_loads() {
    let s = Scratch::new();
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for shard in [SHARD1, SHARD2] {
        let bytes = std::fs::read(s.path(shard)).unwrap();
        for (name, view) in SafeTensors::deserialize(&bytes).unwrap().tensors() {
            owned.push((name, view.dtype(), view.shape().to_vec(), view.data().to_vec()));
        }
        std::fs::remove_file(s.path(shard)).unwrap();
    }
    let views: Vec<(String, TensorView<'_>)> = owned
        .iter()
        .map(|(n, d, sh, b)| (n.clone(), TensorView::new(*d, sh.clone(), b).unwrap()))
        .collect();
    std::fs::write(
        s.path("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    std::fs::remove_file(s.path("model.safetensors.index.json")).unwrap();
    let model = s.load_with(LoadOptions::default()).unwrap();
    let options = GenerateOptions {
        max_new_tokens: 4,
        ..Default::default()
    };
    let sharded = generate_plain(&tiny_model(), &[5, 17], &options).unwrap();
    let single = generate_plain(&model, &[5, 17], &options).unwrap();
    assert_eq!(single.tokens, sharded.tokens);
    std::fs::remove_file(s.path("model.safetensors")).unwrap();
    assert_mentions(&s.load_err(), &["model.safetensors.index.json nor model.safetensors"]);
}

#[test]
fn missing_tensor_names_tensor_and_shard() {
    let s = Scratch::new();
    let tensor = format!("{PREFIX}.self_attn.kv_b_proj.weight");
    let shard = s.shard_of(&tensor);
    s.edit_tensor(&tensor, |_, _, _| None);
    assert_mentions(&s.load_err(), &[&tensor, shard, "missing"]);
}

#[test]
fn tensor_absent_from_index_is_missing() {
    let s = Scratch::new();
    let tensor = format!("{PREFIX}.post_attention_layernorm.weight");
    s.edit_text("model.safetensors.index.json", &format!("\"{tensor}\""), "\"renamed\"");
    assert_mentions(&s.load_err(), &[&tensor, "model.safetensors.index.json", "missing"]);
}

#[test]
fn wrong_shape_names_tensor_and_both_shapes() {
    let s = Scratch::new();
    let tensor = format!("{PREFIX}.self_attn.q_a_layernorm.weight");
    let shard = s.shard_of(&tensor);
    s.edit_tensor(&tensor, |d, _, b| Some((d, vec![47], b[..94].to_vec())));
    assert_mentions(&s.load_err(), &[&tensor, shard, "[47]", "[48]"]);
}

#[test]
fn wrong_dtype_names_tensor() {
    let s = Scratch::new();
    let tensor = format!("{PREFIX}.input_layernorm.weight");
    let shard = s.shard_of(&tensor);
    s.edit_tensor(&tensor, |_, shape, b| Some((Dtype::I16, shape, b)));
    assert_mentions(&s.load_err(), &[&tensor, shard, "I16", "BF16"]);
}

#[test]
fn int4_packed_with_wrong_dtype_is_rejected() {
    let s = Scratch::new();
    let tensor = format!("{PREFIX}.mlp.experts.3.up_proj.weight_packed");
    s.edit_tensor(&tensor, |_, shape, b| Some((Dtype::F32, shape, b)));
    assert_mentions(&s.load_err(), &[&tensor, "F32", "I32"]);
}

#[test]
fn int4_weight_shape_mismatch_is_rejected() {
    let s = Scratch::new();
    let tensor = format!("{PREFIX}.mlp.experts.0.down_proj.weight_shape");
    s.edit_tensor(&tensor, |d, shape, _| {
        Some((d, shape, [64i64, 33].iter().flat_map(|v| v.to_le_bytes()).collect()))
    });
    assert_mentions(&s.load_err(), &[&tensor, "[64, 33]", "expected [64, 32]"]);
}

#[test]
fn int4_without_quantization_config_is_rejected() {
    let s = Scratch::new();
    s.edit_text(
        "config.json",
        "\"quantization_config\"",
        "\"unused_quantization_config\"",
    );
    assert_mentions(&s.load_err(), &["weight_packed", "quantization_config"]);
}

#[test]
fn truncated_shard_names_file() {
    let s = Scratch::new();
    let path = s.path(SHARD2);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    assert_mentions(&s.load_err(), &[SHARD2, "malformed safetensors"]);
    std::fs::write(&path, &bytes[..5]).unwrap();
    assert_mentions(&s.load_err(), &[SHARD2, "malformed safetensors"]);
}

#[test]
fn garbage_header_names_file() {
    let s = Scratch::new();
    let path = s.path(SHARD1);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..16].copy_from_slice(b"not json");
    std::fs::write(&path, &bytes).unwrap();
    assert_mentions(&s.load_err(), &[SHARD1, "malformed safetensors"]);
}

#[test]
fn index_naming_missing_file() {
    let s = Scratch::new();
    s.edit_text(
        "model.safetensors.index.json",
        SHARD2,
        "model-00003-of-00002.safetensors",
    );
    assert_mentions(
        &s.load_err(),
        &[
            "model.safetensors.index.json",
            "model-00003-of-00002.safetensors",
            "does not exist",
        ],
    );
}

#[test]
fn nan_weight_is_detected_unless_the_scan_is_skipped() {
    let s = Scratch::new();
    let tensor = format!("{PREFIX}.self_attn.kv_a_layernorm.weight");
    let shard = s.shard_of(&tensor);
    s.edit_tensor(&tensor, |d, shape, mut b| {
        b[6..8].copy_from_slice(&half::bf16::NAN.to_le_bytes());
        Some((d, shape, b))
    });
    assert_mentions(&s.load_err(), &[&tensor, shard, "NaN", "element 3"]);
    s.load_with(LoadOptions { check_finite: false }).unwrap();
}

#[test]
fn infinite_int4_scale_is_detected() {
    let s = Scratch::new();
    let tensor = format!("{PREFIX}.mlp.experts.5.gate_proj.weight_scale");
    s.edit_tensor(&tensor, |d, shape, mut b| {
        b[0..2].copy_from_slice(&half::bf16::INFINITY.to_le_bytes());
        Some((d, shape, b))
    });
    assert_mentions(&s.load_err(), &[&tensor, "inf"]);
}

fn tiny_model() -> Model<CpuBackend> {
    Scratch::new().load_with(LoadOptions::default()).unwrap()
}

fn generate_err(model: &Model<CpuBackend>, prompt: &[u32]) -> String {
    let options = GenerateOptions {
        max_new_tokens: 4,
        ..Default::default()
    };
    generate_plain(model, prompt, &options).unwrap_err().to_string()
}

#[test]
fn empty_prompt_is_rejected() {
    assert_mentions(&generate_err(&tiny_model(), &[]), &["prompt is empty"]);
}

#[test]
fn token_id_beyond_vocab_is_rejected() {
    assert_mentions(&generate_err(&tiny_model(), &[3, 600]), &["600", "index 1", "512"]);
}

#[test]
fn prompt_longer_than_context_is_rejected_and_generation_stops_at_the_end() {
    let s = Scratch::new();
    s.edit_text(
        "config.json",
        "\"max_position_embeddings\": 262144",
        "\"max_position_embeddings\": 6",
    );
    let model = s.load_with(LoadOptions::default()).unwrap();
    assert_mentions(
        &generate_err(&model, &[5; 7]),
        &["7 tokens", "max_position_embeddings is 6"],
    );
    let options = GenerateOptions {
        max_new_tokens: 10,
        ..Default::default()
    };
    let out = generate_plain(&model, &[5; 4], &options).unwrap();
    assert_eq!(out.stop_reason, ddtree_engine::StopReason::ContextFull);
    assert_eq!(
        out.tokens.len(),
        3,
        "positions 4 and 5 are fed back, the last token is never run"
    );
}

fn config_err(json: &str) -> String {
    ModelConfig::from_json(json, Path::new("config.json"))
        .unwrap_err()
        .to_string()
}

fn tiny_config_json() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-dsv3/config.json")).unwrap()
}

#[test]
fn config_errors_name_the_field() {
    let base = tiny_config_json();
    let cases = [
        (
            "\"model_type\": \"deepseek_v3\"",
            "\"model_type\": \"llama\"",
            "field `model_type`",
        ),
        (
            "\"hidden_size\": 64",
            "\"hidden_size\": \"64\"",
            "field `hidden_size`: expected a non-negative integer",
        ),
        (
            "\"hidden_size\": 64",
            "\"hidden_sighs\": 64",
            "field `hidden_size`: missing",
        ),
        ("\"n_group\": 4", "\"n_group\": 3", "field `n_group`"),
        ("\"topk_group\": 2", "\"topk_group\": 5", "field `topk_group`"),
        (
            "\"hidden_act\": \"silu\"",
            "\"hidden_act\": \"gelu\"",
            "field `hidden_act`",
        ),
        (
            "\"rope_type\": \"yarn\"",
            "\"rope_type\": \"dynamic\"",
            "field `rope_scaling.rope_type`",
        ),
        ("\"factor\": 40.0", "\"factor\": 0.5", "field `rope_scaling.factor`"),
        (
            "\"num_bits\": 4",
            "\"num_bits\": 8",
            "field `quantization_config.config_groups.group_0.weights.num_bits`",
        ),
        ("\"group_size\": 32", "\"group_size\": 12", "weights.group_size`"),
        (
            "\"quant_method\": \"compressed-tensors\"",
            "\"quant_method\": \"fp8\"",
            "field `quantization_config.quant_method`",
        ),
        (
            "\"num_key_value_heads\": 4",
            "\"num_key_value_heads\": 2",
            "field `num_key_value_heads`",
        ),
        (
            "\"attention_bias\": false",
            "\"attention_bias\": true",
            "field `attention_bias`",
        ),
    ];
    for (from, to, expected) in cases {
        assert!(base.contains(from), "fixture lacks {from}");
        let msg = config_err(&base.replacen(from, to, 1));
        assert_mentions(&msg, &["config.json", expected]);
    }
    assert_mentions(
        &config_err("{\"model_type\": \"deepseek_v3\""),
        &["config.json", "invalid JSON"],
    );
    assert_mentions(
        &config_err(&base.replacen("{", "{\"scoring_func\": \"softmax\",", 1)),
        &["field `scoring_func`"],
    );
}

#[test]
fn kimi_k25_config_reads_text_config() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-kimi/config.json");
    let cfg = ModelConfig::from_file(&path).unwrap();
    assert_eq!(cfg.model_type, "kimi_k25");
    assert_eq!(
        (cfg.moe.n_group, cfg.moe.topk_group, cfg.moe.n_routed_experts),
        (1, 1, 8)
    );
    assert_eq!(cfg.quantization.as_ref().map(|q| q.group_size), Some(32));
    assert_eq!(cfg.rope.yarn.as_ref().map(|y| y.factor), Some(64.0));
    assert_eq!(cfg.eos_token_ids, vec![1]);
    let text = std::fs::read_to_string(&path).unwrap();
    let msg = config_err(&text.replacen("\"model_type\": \"kimi_k2\"", "\"model_type\": \"qwen3\"", 1));
    assert_mentions(&msg, &["field `text_config.model_type`"]);

    // A flat `kimi_k2` config (K2 / K2-Thinking) reads the same fields from the top level.
    let flat = tiny_config_json().replacen("\"model_type\": \"deepseek_v3\"", "\"model_type\": \"kimi_k2\"", 1);
    let k2 = ModelConfig::from_json(&flat, Path::new("config.json")).unwrap();
    assert_eq!((k2.model_type.as_str(), k2.moe.n_group), ("kimi_k2", 4));
}
