#!/usr/bin/env python3
"""Golden fixtures for ddtree-engine, produced by HF transformers' DeepseekV3ForCausalLM.

How it was run (CPU only, no network, no GPU needed):

    python3 -m venv /tmp/golden-venv
    /tmp/golden-venv/bin/pip install -r scripts/requirements-golden.txt
    /tmp/golden-venv/bin/python scripts/make_golden.py

It writes, for each tiny config, under ddtree-engine/tests/fixtures/<name>/:

- config.json (Kimi K2.5 style with `text_config` for tiny-kimi, flat deepseek_v3 for tiny-dsv3),
  with a compressed-tensors `quantization_config`;
- model-0000{1,2}-of-00002.safetensors + model.safetensors.index.json: routed experts as INT4
  pack-quantized (group 32, Kimi QAT rule: scale = amax/7 in bf16, codes in [-7, 7]), every other
  weight rounded to bf16 and stored as BF16 (the routing bias as F32);
- tokenizer.json (tiny-kimi only): a byte-level BPE trained here on a built-in text;
- golden.json: greedy continuations and per-step logits of several prompts, computed with a
  no-cache argmax loop in fp32 (eager attention), plus the per-node logits of one draft tree
  computed by decoding each root-to-node path linearly.

The fixtures are committed; CI never runs this script. Every golden step's top-1/top-2 logit
margin and every router top-k / group selection margin is checked to not be a near tie, so an f32
implementation with different summation order picks the same tokens and experts.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

assert transformers.__version__ == "4.57.3", f"pin transformers==4.57.3, got {transformers.__version__}"

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "ddtree-engine" / "tests" / "fixtures"
GROUP = 32
STEPS = 8
LOGIT_MARGIN = 1e-2
ROUTER_MARGIN = 1e-4

QUANT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": GROUP,
                "dynamic": False,
                "observer": "minmax",
                "actorder": None,
            },
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    moe_intermediate_size=32,
    intermediate_size=128,
    first_k_dense_replace=1,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)

CONFIGS = {
    # Kimi K2.x shape: n_group = topk_group = 1, YaRN factor 64 with mscale 1/1, beta 1/1.
    "tiny-kimi": dict(
        COMMON,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        max_position_embeddings=64 * 4096,
        rope_scaling={
            "type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
        },
    ),
    # DeepSeek-V3 shape: group-limited routing (n_group 4, topk_group 2), YaRN factor 40 with the
    # default betas, two shared experts, half-split (non-interleaved) RoPE.
    "tiny-dsv3": dict(
        COMMON,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_interleave=False,
        max_position_embeddings=40 * 4096,
        rope_scaling={
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
}

CORPUS = """\
The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens and the
target model verifies them in one forward pass. DDTree builds a draft tree from the per-position
distributions of a block diffusion drafter and verifies the whole tree with an ancestor mask.
Hello, world! Numbers like 123, 4567 and 89 appear in text. Multi-head latent attention caches a
compressed latent vector per token. Mixture of experts routes each token to a few experts.
"""

TEXT_PROMPTS = ["The quick brown fox", "Hello, world! 123", "DDTree verifies a draft tree", "a"]
ID_PROMPTS = [[5, 17, 300, 42, 9], [100], [511, 0, 7, 300, 42, 42, 42, 9, 250, 3, 77, 128]]


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    return tok


def bf16_round(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def quantize_int4(w: torch.Tensor):
    """Kimi QAT rule: per group of 32 along `in`, scale = amax/7 (bf16), q = round(w/scale) in [-7, 7]."""
    out, inp = w.shape
    groups = w.reshape(out, inp // GROUP, GROUP)
    scale = bf16_round(groups.abs().amax(dim=-1) / 7.0).clamp_min(2.0**-100)
    q = torch.clamp(torch.round(groups / scale[..., None]), -7, 7)
    deq = (q * scale[..., None]).reshape(out, inp)
    nibbles = (q.reshape(out, inp).to(torch.int64) + 8).numpy()
    words = np.zeros((out, math.ceil(inp / 8)), dtype=np.uint32)
    for j in range(8):
        words |= (nibbles[:, j::8].astype(np.uint32) << np.uint32(4 * j))
    scale_bf16 = scale.to(torch.bfloat16)
    return deq, words.view(np.int32), scale_bf16


def init_weights(model: DeepseekV3ForCausalLM, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                std = (4.0 if "lm_head" in name else 1.0) / math.sqrt(p.shape[1])
                p.copy_(std * torch.randn(p.shape, generator=g))
            p.copy_(bf16_round(p))
        for layer in model.model.layers:
            if isinstance(getattr(layer.mlp, "gate", None), DeepseekV3TopkRouter):
                layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(layer.mlp.gate.e_score_correction_bias.shape, generator=g))


def export_tensors(model: DeepseekV3ForCausalLM, prefix: str) -> dict[str, torch.Tensor]:
    """Checkpoint tensors; quantizes the routed experts in place (the model then runs on their
    dequantized values)."""
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = prefix + name
            if ".mlp.experts." in name:
                deq, packed, scale = quantize_int4(p.detach())
                p.copy_(deq)
                base = key[: -len(".weight")]
                tensors[base + ".weight_packed"] = torch.from_numpy(packed)
                tensors[base + ".weight_scale"] = scale
                tensors[base + ".weight_shape"] = torch.tensor(list(p.shape))
            else:
                tensors[key] = p.detach().to(torch.bfloat16)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                tensors[prefix + name] = b.detach().float()
    return {k: v.contiguous() for k, v in tensors.items()}


def write_shards(tensors: dict[str, torch.Tensor], out: Path) -> None:
    names = list(tensors)
    half = len(names) // 2
    weight_map = {}
    total = 0
    for i, part in enumerate([names[:half], names[half:]]):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        path = out / file
        save_file({n: tensors[n] for n in part}, str(path))
        for n in part:
            weight_map[n] = file
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


class RouterMarginCheck:
    """Records the smallest selection margins of every router call (top-k and group top-k)."""

    def __init__(self, model: DeepseekV3ForCausalLM):
        self.min_margin = math.inf
        for layer in model.model.layers:
            if isinstance(getattr(layer.mlp, "gate", None), DeepseekV3TopkRouter):
                layer.mlp.gate.register_forward_hook(self.hook)

    def hook(self, router, inputs, _output):
        x = inputs[0].reshape(-1, router.config.hidden_size).float()
        scores = torch.sigmoid(x @ router.weight.float().T)
        choice = scores + router.e_score_correction_bias[None]
        if router.n_group > 1:
            grouped = choice.view(-1, router.n_group, router.n_routed_experts // router.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
            s = group_scores.sort(dim=-1, descending=True)[0]
            self.min_margin = min(self.min_margin, (s[:, router.topk_group - 1] - s[:, router.topk_group]).min().item())
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(router.topk_group, dim=-1)[1], 1)
            mask = keep[..., None].expand_as(grouped).reshape(choice.shape).bool()
            choice = choice.masked_fill(~mask, 0.0)
        s = choice.sort(dim=-1, descending=True)[0]
        self.min_margin = min(self.min_margin, (s[:, router.top_k - 1] - s[:, router.top_k]).min().item())


def last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def greedy(model, prompt: list[int]):
    ids = list(prompt)
    generated, logits, margins = [], [], []
    for _ in range(STEPS):
        row = last_logits(model, ids)
        top = row.topk(2)[0]
        margins.append((top[0] - top[1]).item())
        tok = int(row.argmax())
        generated.append(tok)
        logits.append(row)
        ids.append(tok)
    return generated, logits, min(margins)


def rounded(row: torch.Tensor) -> list[float]:
    return [float(f"{v:.8g}") for v in row.tolist()]


def tree_golden(model, prompt: list[int], vocab: int):
    """Per-node logits of a draft tree, each from linear decoding of its root-to-node path."""
    parents = [-1, 0, 0, 1, 1, 2, 3]
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(2, vocab, (len(parents),), generator=g).tolist()
    logits = []
    for node in range(len(parents)):
        path, i = [], node
        while i >= 0:
            path.append(tokens[i])
            i = parents[i]
        logits.append(rounded(last_logits(model, prompt + path[::-1])))
    return {"prompt": prompt, "tokens": tokens, "parents": parents, "logits": logits}


class NearTie(Exception):
    """A golden step or router selection too close to call across implementations."""


def make_first_clean(name: str, first_seed: int, tries: int = 20) -> None:
    """Tries seeds from `first_seed` until no golden step or router choice is a near tie."""
    for seed in range(first_seed, first_seed + tries):
        try:
            return make(name, seed)
        except NearTie as e:
            print(f"{name}: seed {seed}: {e}; trying the next seed")
    sys.exit(f"{name}: no clean seed in {tries} tries")


def make(name: str, seed: int) -> None:
    out = FIXTURES / name
    out.mkdir(parents=True, exist_ok=True)
    cfg_kwargs = CONFIGS[name]
    cfg = DeepseekV3Config(**cfg_kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    init_weights(model, seed)
    kimi = name == "tiny-kimi"
    write_shards(export_tensors(model, "language_model." if kimi else ""), out)

    text_cfg = {k: v for k, v in cfg.to_dict().items() if not k.startswith("_")}
    if kimi:
        text_cfg["model_type"] = "kimi_k2"
        config = {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "text_config": text_cfg,
            "quantization_config": QUANT_CONFIG,
        }
    else:
        config = dict(text_cfg, quantization_config=QUANT_CONFIG)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    prompts = []
    if kimi:
        tok = train_tokenizer(cfg.vocab_size)
        tok.save(str(out / "tokenizer.json"))
        prompts = [{"text": t, "ids": tok.encode(t).ids} for t in TEXT_PROMPTS]
    prompts += [{"ids": ids} for ids in ID_PROMPTS]

    check = RouterMarginCheck(model)
    for p in prompts:
        generated, logits, margin = greedy(model, p["ids"])
        if margin < LOGIT_MARGIN:
            raise NearTie(f"prompt {p['ids']} has a near tie (top-1/top-2 margin {margin:.2e})")
        p.update(generated=generated, min_margin=margin, logits=[rounded(r) for r in logits])
    tree = tree_golden(model, prompts[0]["ids"], cfg.vocab_size)
    if check.min_margin < ROUTER_MARGIN:
        raise NearTie(f"a router selection is a near tie (margin {check.min_margin:.2e})")
    golden = {
        "generator": "scripts/make_golden.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seed": seed,
        "steps": STEPS,
        "min_router_margin": check.min_margin,
        "prompts": prompts,
        "tree": tree,
    }
    (out / "golden.json").write_text(json.dumps(golden) + "\n")
    print(f"{name}: seed {seed}, {len(prompts)} prompts, router margin {check.min_margin:.2e}, "
          f"logit margins {[round(p['min_margin'], 4) for p in prompts]}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    make_first_clean("tiny-kimi", first_seed=1)
    make_first_clean("tiny-dsv3", first_seed=100)
