#!/usr/bin/env python3
"""Trains the built-in DFlash drafter against the frozen built-in target (scripts/train_target.py).

The drafter is z-lab's `DFlashDraftModel` (v1) math, written here with the transformers 4.57.3
Qwen3 building blocks that scripts/make_dflash_fixture.py uses (the official `dflash` 0.1.0
package pins transformers 5, which cannot load the DeepSeek-V3 target with our pinned
4.57.3; the forward is the same: see make_dflash_fixture.py's docstring):

- the target's hidden states after TARGET_LAYER_IDS (HF `hidden_states[id + 1]`) are concatenated,
  projected by `fc` and normalized by `hidden_norm`: the context rows;
- a block is `[embed(anchor token), embed(<|mask|>) x (BLOCK - 1)]` through the target's
  (frozen) embedding; in each Qwen3-style layer the queries come from the block, the keys and
  values from [context rows before the anchor, block rows]; no causal mask inside the block;
- the logits of block rows 1..BLOCK-1 come from the target's (frozen) LM head after `norm`.

Training (the DFlash recipe): per sequence, ANCHORS random anchor positions; the blocks of all
anchors of a sequence are drafted in one pass (each block sees only the context before its own
anchor and itself). The loss at block position k (1-based) is the cross-entropy against the
target's own next-token distribution at that position (teacher-forced on the corpus text: the
drafter learns what the target will verify), weighted by exp(-(k - 1) / GAMMA) as in the DFlash
paper (gamma 4 for block size 8).

Export (ddtree-engine/models/tiny-code/dflash/): `config.json` in the z-lab layout
(`architectures` DFlashDraftModel, `model_type` qwen3, `block_size`, `num_target_layers`,
`dflash_config.{mask_token_id, target_layer_ids}`) and `model.safetensors` (bf16).

    .venv-train/bin/python scripts/train_dflash.py --steps 800

On a GPU machine: `--tokens tokens.pt --device cuda --batch 64 --minutes 8 --no-export --work DIR`
(the target files carried with the scripts), then `--export-only --work DIR` here.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

import tiny_corpus as corpus
import train_target

SEED = 44
BLOCK = 8
GAMMA = 4.0
ANCHORS = 16
TARGET_LAYER_IDS = [1, 2, 3]
MASK_TOKEN_ID = 2  # <|mask|>
BATCH = 8
SEQ_LEN = 256
LR = 2e-3
WARMUP = 40
WORK = train_target.WORK


def load_target() -> DeepseekV3ForCausalLM:
    """The exported target in f32, routed experts dequantized: exactly the weights the engine runs."""
    cfg_json = json.loads((corpus.TARGET_DIR / "config.json").read_text())
    drop = {"model_type", "architectures", "transformers_version", "quantization_config", "dtype"}
    cfg = DeepseekV3Config(**{k: v for k, v in cfg_json.items() if k not in drop})
    cfg._attn_implementation = "sdpa"
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    tensors = load_file(corpus.TARGET_DIR / "model.safetensors")
    state = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            out, inp = tensors[base + ".weight_shape"].tolist()
            words = t.to(torch.int64) & 0xFFFFFFFF
            nib = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], dim=-1).reshape(out, -1)[:, :inp]
            scale = tensors[base + ".weight_scale"].float()
            state[base + ".weight"] = (nib - 8).float() * scale.repeat_interleave(inp // scale.shape[1], dim=1)
        elif not name.endswith((".weight_scale", ".weight_shape")):
            state[name] = t.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def drafter_config(target: DeepseekV3Config) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        max_position_embeddings=target.max_position_embeddings,
        rope_theta=10000.0,
        attention_bias=False,
        tie_word_embeddings=False,
    )


class Layer(nn.Module):
    """One Qwen3-style draft layer with DFlash's context key/value injection."""

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

    def forward(self, x, ctx, rope_q, rope_k, mask):
        """x: [N, Q, H] block rows; ctx: [N, C, H] context rows; mask: [N, Q, C + Q] (True = visible)."""
        a = self.self_attn
        n, q_len, c_len = x.shape[0], x.shape[1], ctx.shape[1]
        h = self.input_layernorm(x)
        q = a.q_norm(a.q_proj(h).view(n, q_len, self.heads, self.head_dim))
        kv_in = torch.cat([ctx, h], dim=1)
        k = a.k_norm(a.k_proj(kv_in).view(n, c_len + q_len, self.kv_heads, self.head_dim))
        v = a.v_proj(kv_in).view(n, c_len + q_len, self.kv_heads, self.head_dim)
        (cq, sq), (ck, sk) = rope_q, rope_k
        q = q * cq[:, :, None] + rotate_half(q) * sq[:, :, None]
        k = k * ck[:, :, None] + rotate_half(k) * sk[:, :, None]
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        o = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None]
        )
        x = x + a.o_proj(o.transpose(1, 2).reshape(n, q_len, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.fc = nn.Linear(len(TARGET_LAYER_IDS) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(cfg)

    def forward(self, target, features, ids, anchors):
        """Block hidden states for every anchor of every sequence.

        features: [N, S, n_ids * H] target features of the sequences `ids` [N, S];
        anchors: [N, A] anchor positions (each >= 1, + BLOCK <= S). Returns [N, A * BLOCK, H]."""
        n, s = ids.shape
        a = anchors.shape[1]
        ctx = self.hidden_norm(self.fc(features))
        dev = ids.device
        offs = torch.arange(BLOCK, device=dev)
        pos = (anchors[:, :, None] + offs).reshape(n, a * BLOCK)  # absolute positions of block rows
        block_ids = torch.full((n, a, BLOCK), MASK_TOKEN_ID, device=dev)
        block_ids[:, :, 0] = ids.gather(1, anchors)
        x = target.model.embed_tokens(block_ids.reshape(n, a * BLOCK))
        # Block row (anchor i) sees context positions < anchor i and the rows of block i.
        ctx_vis = torch.arange(s, device=dev)[None, None, :] < anchors[:, :, None]  # [N, A, S]
        ctx_vis = ctx_vis[:, :, None, :].expand(n, a, BLOCK, s).reshape(n, a * BLOCK, s)
        own = torch.eye(a, dtype=torch.bool, device=dev)[:, None, :, None].expand(a, BLOCK, a, BLOCK).reshape(a * BLOCK, a * BLOCK)
        mask = torch.cat([ctx_vis, own[None].expand(n, -1, -1)], dim=2)
        cos_k, sin_k = self.rotary(x, torch.arange(s, device=dev)[None].expand(n, s))
        cos_q, sin_q = self.rotary(x, pos)
        rope_q = (cos_q, sin_q)
        rope_k = (torch.cat([cos_k, cos_q], dim=1), torch.cat([sin_k, sin_q], dim=1))
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_k, mask)
        return self.norm(x)


def target_pass(target, ids):
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in TARGET_LAYER_IDS], dim=-1)
    return feats, out.logits


def sample_anchors(g: torch.Generator, n: int, s: int) -> torch.Tensor:
    # Anchors from 1 (at least one context row) to s - BLOCK (the block's labels inside the window).
    anchors = torch.stack([torch.randperm(s - BLOCK, generator=g)[:ANCHORS] + 1 for _ in range(n)]).sort(dim=1)[0]
    return anchors.to(train_target.DEVICE)


def block_loss(drafter, target, ids, g, weights):
    """Weighted soft cross-entropy and top-1 agreement per block position (1..BLOCK-1)."""
    feats, tlogits = target_pass(target, ids)
    n, s = ids.shape
    anchors = sample_anchors(g, n, s)
    hidden = drafter(target, feats, ids, anchors).view(n, ANCHORS, BLOCK, -1)[:, :, 1:]
    logits = target.lm_head(hidden)  # [N, A, BLOCK-1, V]
    # Block position k predicts the token at anchor + k: the target's distribution at anchor + k - 1.
    src = anchors[:, :, None] + torch.arange(BLOCK - 1, device=anchors.device)  # [N, A, BLOCK-1]
    t = tlogits.gather(1, src.reshape(n, -1, 1).expand(-1, -1, tlogits.shape[-1])).view(logits.shape)
    p = t.softmax(-1)
    ce = -(p * logits.log_softmax(-1)).sum(-1)  # [N, A, BLOCK-1]
    loss = (ce * weights).sum(-1).mean() / weights.sum()
    agree = (logits.argmax(-1) == t.argmax(-1)).float().mean(dim=(0, 1))
    return loss, agree


def acceptance(agree_chain: torch.Tensor) -> float:
    """Expected tokens per round of a chain if positions were independent: 1 + sum of prefix products."""
    return 1.0 + torch.cumprod(agree_chain, 0).sum().item()


def lr_at(step: int, steps: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    t = (step - WARMUP) / max(1, steps - WARMUP)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def export(drafter: Drafter, cfg: Qwen3Config, target_cfg, log) -> None:
    out = corpus.DRAFTER_DIR
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: p.detach().to(torch.bfloat16).contiguous()
        for name, p in drafter.named_parameters()
        if not name.startswith("rotary")
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in cfg.to_dict().items() if not k.startswith("_")}
    config.update(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        block_size=BLOCK,
        num_target_layers=target_cfg.num_hidden_layers,
        dflash_config={"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": TARGET_LAYER_IDS},
        dtype="bfloat16",
    )
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    log(f"exported {len(tensors)} tensors, {size / 1e6:.2f} MB")


def main() -> None:
    global WORK
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--export-only", action="store_true", help="export the last periodic checkpoint")
    ap.add_argument("--device", default="cpu", help="torch device to train on (cpu, cuda)")
    ap.add_argument("--batch", type=int, default=BATCH, help="sequences per step")
    ap.add_argument("--minutes", type=float, help="time budget: the step count is fitted to it")
    ap.add_argument("--data-tokens", type=int, default=train_target.DATA_TOKENS, help="training stream length")
    ap.add_argument("--tokens", help="pre-tokenized streams (train_target.py --dump-tokens) instead of the corpus")
    ap.add_argument("--no-export", action="store_true", help="stop after saving the checkpoint")
    ap.add_argument("--work", help=f"checkpoint folder (default {WORK})")
    args = ap.parse_args()
    WORK = Path(args.work) if args.work else WORK
    train_target.DEVICE = torch.device(args.device)
    torch.set_num_threads(1)
    WORK.mkdir(parents=True, exist_ok=True)
    logf = open(WORK / "train_dflash.log", "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    target = load_target()
    cfg = drafter_config(target.config)
    torch.manual_seed(SEED)
    drafter = Drafter(cfg)
    log(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f} M parameters, block {BLOCK}, "
        f"target layers {TARGET_LAYER_IDS}, {args.minutes or args.steps} {'minutes' if args.minutes else 'steps'} "
        f"of {args.batch}x{SEQ_LEN} tokens, {ANCHORS} anchors each, on {train_target.DEVICE}")
    if args.export_only:
        drafter.load_state_dict(torch.load(WORK / "dflash.pt", map_location="cpu"))
        return export(drafter, cfg, target.config, log)
    tok = Tokenizer.from_file(str(corpus.TARGET_DIR / "tokenizer.json"))
    data, held = train_target.load_stream(args, tok)
    target.to(train_target.DEVICE)
    drafter.to(train_target.DEVICE)
    weights = torch.exp(-torch.arange(BLOCK - 1, dtype=torch.float32) / GAMMA).to(train_target.DEVICE)
    opt = torch.optim.AdamW(drafter.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(SEED)
    t0 = time.time()
    steps, step = args.steps, 0
    while step < steps:
        steps = train_target.plan_steps(steps, args.minutes, step, time.time() - t0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps)
        drafter.train()
        loss, agree = block_loss(drafter, target, train_target.batch(data, g, args.batch), g, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            msg = (f"step {step}/{steps} loss {loss.item():.3f} top-1 {[round(a, 2) for a in agree.tolist()]} "
                   f"{time.time() - t0:.0f}s")
            if step % 200 == 0 or step == steps - 1:
                drafter.eval()
                hg = torch.Generator().manual_seed(1)
                with torch.no_grad():
                    agrees = torch.stack([block_loss(drafter, target, train_target.batch(held, hg, BATCH), hg, weights)[1]
                                          for _ in range(4)]).mean(0)
                msg += f" held-out top-1 {[round(a, 2) for a in agrees.tolist()]} chain ~{acceptance(agrees):.2f}"
            log(msg)
        if step % 100 == 99:
            torch.save(drafter.state_dict(), WORK / "dflash.pt")
        step += 1
    drafter.cpu()
    torch.save(drafter.state_dict(), WORK / "dflash.pt")
    log(f"transformers {transformers.__version__}, torch {torch.__version__}")
    if not args.no_export:
        export(drafter.cpu(), cfg, target.config, log)


if __name__ == "__main__":
    main()
