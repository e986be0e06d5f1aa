#!/usr/bin/env python3
"""Trains the built-in tiny DeepSeek-V3-architecture code model (the DDTree target).

Architecture (HF transformers `DeepseekV3ForCausalLM`, pinned in scripts/requirements-train.txt):
MLA with a query LoRA, YaRN rope scaling, a dense first layer, then MoE layers with `noaux_tc`
routing (sigmoid scores + `e_score_correction_bias`, 8 routed experts, top-2) and a shared expert.
The correction bias is trained as DeepSeek-V3 does (auxiliary-loss-free balancing): after every
step each expert's bias moves by BIAS_RATE towards equal load.

Data: scripts/tiny_corpus.py's training files (Rust crate sources + the Python standard library),
tokenized with target/tokenizer.json (run scripts/train_tokenizer.py first), each file as
`<|bos|> text <|eos|>`, shuffled with SEED; batches of random SEQ_LEN windows.

Export (ddtree-engine/models/tiny-code/target/): `config.json` (`deepseek_v3`, compressed-tensors
quantization config), `model.safetensors` with the routed experts INT4 pack-quantized in groups of
32 (scripts/make_golden.py's writer: Kimi's QAT rule) and every other weight in bf16 (the
routing bias in f32), and `golden.json`: HF greedy continuations of a few prompts computed with the
exported (quantized, bf16-rounded) weights in f32, for the engine's test.

    .venv-train/bin/python scripts/train_target.py --steps 1200      # about 25 min on one core

On a GPU machine without the corpus: dump the token stream here (`--dump-tokens tokens.pt`), carry
it with the scripts, train there with `--tokens tokens.pt --device cuda --batch 64 --minutes 8
--no-export --work DIR`, bring DIR/target.pt back and export here with `--export-only --work DIR`
(the golden is computed with the pinned CPU stack).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

import make_golden  # the INT4 writer and quantization config of the golden fixtures
import tiny_corpus as corpus

SEED = 43
SEQ_LEN = 256
BATCH = 8
LR = 3e-3
WARMUP = 50
BIAS_RATE = 1e-3
DATA_TOKENS = 6_000_000
GOLDEN_PROMPTS = ["fn main() {\n", "def parse(self, text):\n", "impl<T> Vec<T> {\n    pub fn "]
GOLDEN_STEPS = 12
WORK = corpus.ROOT / ".venv-train" / "work"

CONFIG = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    intermediate_size=512,
    moe_intermediate_size=128,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=4 * 1024,
    rope_scaling={
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)


def make_model() -> DeepseekV3ForCausalLM:
    cfg = DeepseekV3Config(**CONFIG)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(cfg).float()
    # HF leaves the router weight uninitialised (torch.empty): give it the usual small init.
    with torch.no_grad():
        for layer in model.model.layers:
            if isinstance(getattr(layer.mlp, "gate", None), DeepseekV3TopkRouter):
                layer.mlp.gate.weight.normal_(0.0, cfg.initializer_range)
    return model


def routers(model) -> list[DeepseekV3TopkRouter]:
    return [l.mlp.gate for l in model.model.layers if isinstance(getattr(l.mlp, "gate", None), DeepseekV3TopkRouter)]


def load_tokens(tok: Tokenizer, limit: int) -> torch.Tensor:
    """The training stream: shuffled training files, each `<|bos|> ids <|eos|>`, up to `limit` ids."""
    training, _ = corpus.split(corpus.corpus())
    random.Random(SEED).shuffle(training)
    ids: list[int] = []
    for f in training:
        ids.append(0)
        ids.extend(tok.encode(f.text()).ids)
        ids.append(1)
        if len(ids) >= limit:
            break
    return torch.tensor(ids[:limit], dtype=torch.long)


def heldout_tokens(tok: Tokenizer) -> torch.Tensor:
    _, heldout = corpus.split(corpus.corpus())
    ids: list[int] = []
    for f in heldout:
        ids += [0] + tok.encode(f.text()).ids + [1]
    return torch.tensor(ids, dtype=torch.long)


DEVICE = torch.device("cpu")


def batch(data: torch.Tensor, g: torch.Generator, n: int) -> torch.Tensor:
    """`n` random windows of SEQ_LEN + 1 tokens (the generator stays on the CPU: same draws anywhere)."""
    starts = torch.randint(0, len(data) - SEQ_LEN - 1, (n,), generator=g)
    return torch.stack([data[s : s + SEQ_LEN + 1] for s in starts.tolist()]).to(DEVICE, torch.long)


def load_stream(args, tok: Tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(training, held-out) token streams: from `--tokens` when given, else tokenized from the corpus."""
    if args.tokens:
        d = torch.load(args.tokens)
        return d["train"], d["held"]
    return load_tokens(tok, args.data_tokens), heldout_tokens(tok)


def plan_steps(steps: int, minutes: float | None, step: int, elapsed: float) -> int:
    """With a time budget, the step count that fits it, fixed once after the first steps' timing
    (the warm-up does not depend on it)."""
    if minutes is None or step != 20:
        return steps
    return max(step + 1, int(minutes * 60 / (elapsed / (step + 1)) * 0.92))


def lr_at(step: int, steps: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    t = (step - WARMUP) / max(1, steps - WARMUP)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def eval_loss(model, data: torch.Tensor, batches: int = 8) -> float:
    model.eval()
    g = torch.Generator().manual_seed(1)
    total = 0.0
    for _ in range(batches):
        x = batch(data, g, BATCH)
        logits = model(x[:, :-1]).logits
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).item()
    model.train()
    return total / batches


def train(model, data: torch.Tensor, held: torch.Tensor, steps: int, log, batch_size: int = BATCH,
          minutes: float | None = None) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(SEED)
    loads: dict[int, torch.Tensor] = {}

    def count(router, _inputs, output):
        idx = output[0]
        loads[id(router)] = loads.get(id(router), 0) + torch.bincount(idx.flatten(), minlength=router.n_routed_experts)

    hooks = [r.register_forward_hook(count) for r in routers(model)]
    model.train()
    t0 = time.time()
    step = 0
    while step < steps:
        steps = plan_steps(steps, minutes, step, time.time() - t0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps)
        x = batch(data, g, batch_size)
        logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2)
            for r in routers(model):
                load = loads.pop(id(r)).float()
                r.e_score_correction_bias += BIAS_RATE * torch.sign(load.mean() - load)
        if step % 25 == 0 or step == steps - 1:
            msg = f"step {step}/{steps} loss {loss.item():.3f} lr {lr_at(step, steps):.2e} {time.time() - t0:.0f}s"
            if step % 200 == 0 or step == steps - 1:
                msg += f" held-out {eval_loss(model, held):.3f}"
            log(msg)
        if step % 200 == 199:
            torch.save(model.state_dict(), WORK / "target.pt")
        step += 1
    for h in hooks:
        h.remove()


def greedy(model, ids: list[int], steps: int) -> tuple[list[int], float]:
    ids = list(ids)
    out, margin = [], math.inf
    with torch.no_grad():
        for _ in range(steps):
            row = model(torch.tensor([ids])).logits[0, -1].float()
            top = row.topk(2)[0]
            margin = min(margin, (top[0] - top[1]).item())
            t = int(row.argmax())
            out.append(t)
            ids.append(t)
    return out, margin


def export(model, tok: Tokenizer, log) -> None:
    out = corpus.TARGET_DIR
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(make_golden.bf16_round(p))
    tensors = make_golden.export_tensors(model, "")  # quantizes the experts in place
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_")}
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg["model_type"] = "deepseek_v3"
    cfg["quantization_config"] = make_golden.QUANT_CONFIG
    cfg["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    model.config._attn_implementation = "eager"
    prompts = []
    for text in GOLDEN_PROMPTS:
        ids = tok.encode(text).ids
        gen, margin = greedy(model, ids, GOLDEN_STEPS)
        prompts.append({"text": text, "ids": ids, "generated": gen, "min_margin": margin})
        log(f"greedy {text!r} -> {tok.decode(gen)!r} (margin {margin:.3f})")
    golden = {
        "generator": "scripts/train_target.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompts": prompts,
    }
    (out / "golden.json").write_text(json.dumps(golden) + "\n")
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    log(f"exported {len(tensors)} tensors, {size / 1e6:.2f} MB")


def main() -> None:
    global WORK, DEVICE
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--export-only", action="store_true", help="export the last periodic checkpoint")
    ap.add_argument("--device", default="cpu", help="torch device to train on (cpu, cuda)")
    ap.add_argument("--batch", type=int, default=BATCH, help="sequences per step")
    ap.add_argument("--minutes", type=float, help="time budget: the step count is fitted to it")
    ap.add_argument("--data-tokens", type=int, default=DATA_TOKENS, help="training stream length")
    ap.add_argument("--tokens", help="pre-tokenized streams (from --dump-tokens) instead of the corpus")
    ap.add_argument("--dump-tokens", help="write the training and held-out streams to this file and stop")
    ap.add_argument("--no-export", action="store_true", help="stop after saving the checkpoint")
    ap.add_argument("--work", help=f"checkpoint folder (default {WORK})")
    args = ap.parse_args()
    WORK = Path(args.work) if args.work else WORK
    DEVICE = torch.device(args.device)
    torch.set_num_threads(1)
    WORK.mkdir(parents=True, exist_ok=True)
    logf = open(WORK / "train_target.log", "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    tok = Tokenizer.from_file(str(corpus.TARGET_DIR / "tokenizer.json"))
    assert tok.get_vocab_size() == CONFIG["vocab_size"]
    if args.dump_tokens:
        train_ids, held = load_stream(args, tok)
        torch.save({"train": train_ids.to(torch.int16), "held": held.to(torch.int16)}, args.dump_tokens)
        return log(f"wrote {len(train_ids)} training and {len(held)} held-out tokens to {args.dump_tokens}")
    model = make_model()
    n = sum(p.numel() for p in model.parameters())
    budget = f"{args.minutes} minutes" if args.minutes else f"{args.steps} steps"
    log(f"target: {n / 1e6:.2f} M parameters, {budget} of {args.batch}x{SEQ_LEN} tokens on {DEVICE}")
    if args.export_only:
        model.load_state_dict(torch.load(WORK / "target.pt", map_location="cpu"))
    if not args.export_only:
        data, held = load_stream(args, tok)
        log(f"data: {len(data)} training tokens, {len(held)} held-out tokens")
        model.to(DEVICE)
        train(model, data, held, args.steps, log, args.batch, args.minutes)
        model.cpu()
        torch.save(model.state_dict(), WORK / "target.pt")
        log(f"torch {torch.__version__}, transformers {transformers.__version__}")
        if args.no_export:
            return
    export(model, tok, log)


if __name__ == "__main__":
    main()
