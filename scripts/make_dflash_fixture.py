"""Tiny random DFlash drafter for the tiny-kimi target, with golden drafter logits.

Writes ddtree-engine/tests/fixtures/tiny-dflash/: `config.json` in the z-lab `DFlashDraftModel`
layout (`model_type` qwen3, top-level `block_size`, `dflash_config.{mask_token_id,
target_layer_ids}`, `num_target_layers`), `model.safetensors` (bf16, z-lab tensor names:
`fc`, `hidden_norm`, `layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm`) and `golden.json`.

The drafter forward below is written from the architecture description (reference notes 1.7): the
target's hidden states after `target_layer_ids` (HF `hidden_states[id + 1]`) are concatenated,
projected by `fc` and normalized by `hidden_norm`; in every layer the keys/values come from
[context rows, block rows] and the queries from the block rows only, with per-head q/k RMS norms,
Qwen3 (rotate-half) RoPE at absolute positions, GQA and no mask (the block is bidirectional and
sees the whole context); the block is [embed(bonus), embed(MASK) x (block_size - 1)] through the
target's embedding, and the logits are the target's lm_head on the final-normed rows 1..block_size.
The golden recomputes the context keys from all features each round (no cache), so the engine's
cached-and-cropped context keys are checked against a cache-free reference.

Golden scenario (tokens are recorded, so the Rust test replays them exactly):
  round 1: prefill the prompt (features of all prompt tokens), bonus b0 = target argmax; draft.
  round 2: commit [b0, t1, t2] (t1, t2 = the round-1 drafter's argmax at positions 1 and 2), run
           the target over them for their features, bonus b1 = target argmax after t2; draft.

Pinned environment: scripts/requirements-golden.txt (torch 2.9.1, transformers 4.57.3). Run from
the repository root: /tmp/golden-venv/bin/python scripts/make_dflash_fixture.py
"""

import json
import math
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "ddtree-engine/tests/fixtures/tiny-kimi"
OUT = ROOT / "ddtree-engine/tests/fixtures/tiny-dflash"
SEED = 20260
BLOCK_SIZE = 8
MASK_TOKEN_ID = 510
TARGET_LAYER_IDS = [0, 2]  # includes the last target layer: HF takes it after the final norm
PROMPT = [5, 17, 300, 42, 9]


def load_target() -> DeepseekV3ForCausalLM:
    """The tiny-kimi fixture in HF, INT4 experts dequantized."""
    text = json.loads((TARGET / "config.json").read_text())["text_config"]
    drop = {"model_type", "architectures", "transformers_version"}
    cfg = DeepseekV3Config(**{k: v for k, v in text.items() if k not in drop})
    cfg._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    tensors = {}
    for shard in sorted(TARGET.glob("*.safetensors")):
        tensors.update(load_file(shard))
    state = {}
    for name, t in tensors.items():
        name = name.removeprefix("language_model.")
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            out, inp = tensors["language_model." + base + ".weight_shape"].tolist()
            words = t.to(torch.int64) & 0xFFFFFFFF
            nib = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], dim=-1).reshape(out, -1)[:, :inp]
            scale = tensors["language_model." + base + ".weight_scale"].float()
            state[base + ".weight"] = (nib - 8).float() * scale.repeat_interleave(inp // scale.shape[1], dim=1)
        elif name.endswith((".weight_scale", ".weight_shape")):
            continue
        else:
            state[name] = t.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def drafter_config(target: DeepseekV3Config) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        rope_theta=50000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 64.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        attention_bias=False,
        tie_word_embeddings=False,
    )


class Layer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.input_layernorm = Qwen3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.self_attn.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.self_attn.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.self_attn.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.self_attn.q_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)
        self.self_attn.k_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(self, x, ctx, cos, sin):
        a = self.self_attn
        n_ctx, n_blk = ctx.shape[0], x.shape[0]
        h = self.input_layernorm(x)
        q = a.q_norm(a.q_proj(h).view(n_blk, self.heads, self.head_dim))
        kv_in = torch.cat([ctx, h])
        k = a.k_norm(a.k_proj(kv_in).view(n_ctx + n_blk, self.kv_heads, self.head_dim))
        v = a.v_proj(kv_in).view(n_ctx + n_blk, self.kv_heads, self.head_dim)
        q = q * cos[n_ctx:, None] + rotate_half(q) * sin[n_ctx:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.head_dim)
        o = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).reshape(n_blk, -1)
        x = x + a.o_proj(o)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.fc = nn.Linear(len(TARGET_LAYER_IDS) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(cfg)

    def forward(self, target, features, bonus):
        """Logits for the block_size - 1 positions after `bonus`, which sits right after the context."""
        n_ctx = features.shape[0]
        ctx = self.hidden_norm(self.fc(features))
        ids = torch.tensor([bonus] + [MASK_TOKEN_ID] * (BLOCK_SIZE - 1))
        x = target.model.embed_tokens(ids)
        positions = torch.arange(n_ctx + BLOCK_SIZE)[None]
        cos, sin = self.rotary(x[None], positions)
        for layer in self.layers:
            x = layer(x, ctx, cos[0], sin[0])
        return target.lm_head(self.norm(x)[1:])


def init(drafter: Drafter, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in drafter.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            p.copy_(p.to(torch.bfloat16).float())


def features(target, ids: list[int]) -> torch.Tensor:
    out = target(torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1][0] for i in TARGET_LAYER_IDS], dim=-1), out.logits[0]


def rounded(m: torch.Tensor) -> list[list[float]]:
    return [[float(f"{v:.8g}") for v in row] for row in m.tolist()]


def main() -> None:
    torch.manual_seed(SEED)
    target = load_target()
    cfg = drafter_config(target.config)
    drafter = Drafter(cfg).eval()
    init(drafter, SEED)
    with torch.no_grad():
        feats, logits = features(target, PROMPT)
        b0 = int(logits[-1].argmax())
        round1 = drafter(target, feats, b0)
        t1, t2 = (int(round1[i].argmax()) for i in range(2))
        seq = PROMPT + [b0, t1, t2]
        feats2, logits2 = features(target, seq)
        b1 = int(logits2[-1].argmax())
        round2 = drafter(target, feats2, b1)

    OUT.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to(torch.bfloat16).contiguous() for name, p in drafter.named_parameters()}
    save_file(tensors, OUT / "model.safetensors", metadata={"format": "pt"})
    config = {k: v for k, v in cfg.to_dict().items() if not k.startswith("_")}
    config.update(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        block_size=BLOCK_SIZE,
        num_target_layers=target.config.num_hidden_layers,
        dflash_config={"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": TARGET_LAYER_IDS},
    )
    (OUT / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    golden = {
        "generator": "scripts/make_dflash_fixture.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seed": SEED,
        "prompt": PROMPT,
        "bonus": [b0, b1],
        "committed": [b0, t1, t2],
        "round1": rounded(round1),
        "round2": rounded(round2),
    }
    (OUT / "golden.json").write_text(json.dumps(golden) + "\n")
    print(f"tiny-dflash: b0 {b0}, t1 {t1}, t2 {t2}, b1 {b1}, {len(tensors)} tensors")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
