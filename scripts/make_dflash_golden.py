"""Goldens for the DFlash drafters from the official z-lab `dflash` package (0.1.0).

Builds tiny random drafters with the package's own classes, `dflash.model.DFlashDraftModel` and
`dflash.model.DFlash2DraftModel`, for the tiny-kimi target fixture, and records what they draft
for two recorded rounds. Writes ddtree-engine/tests/fixtures/dflash-official/<variant>/ with
`config.json`, `model.safetensors` (bf16) and `golden.json`:

  v1           DFlashDraftModel, `block_size` inside `dflash_config`, `target_layer_ids` left to
               the package's default from `num_target_layers`.
  v1-features  DFlashDraftModel with a causal sliding-window layer (`layer_types`,
               `use_sliding_window`, a window shorter than the context), `input_embedding_scale`,
               `output_multiplier`, `final_logit_softcapping`; `mask_token_id` at the top level.
  v2           DFlash2DraftModel (grouped dynamic causal convolutions, candidate selector) with a
               non-causal sliding layer (`is_causal: false`); codebooks stored under the names
               released checkpoints use (`candidate_selector.predecessor_codebook`, no `.weight`).

Scenario (tokens recorded, so the Rust test replays them): round 1 prefills PROMPT into the target,
bonus b0 = target argmax, draft; round 2 commits [b0, t1, t2] (t1, t2 = the drafted path's first
two tokens), runs the target over them, bonus b1, drafts again. The drafter runs with no cache
(the whole context each round), so the engine's cached context is checked against a cache-free
reference. Context = `dflash.extract_context_feature` of the target's HF hidden states.

Recorded: v1 draft logits (`model.compute_logits` on the model's hidden rows 1..B); v2 the
candidate selector's per-position scores at temperature 0 (the tensors `CandidateSelector.select`
takes the argmax of, captured as it runs), their candidate tokens and the chosen path.

Pinned environment: scripts/requirements-golden.txt plus scripts/requirements-dflash.txt (--no-deps)
(its `local` extra pins torch 2.13 / transformers 5.15; the model classes run unchanged on the
transformers 4.57.3 that made the target fixtures; `dflash_generate` needs transformers 5, see
scripts/dflash_chain_check.py). Run from the repository root:
  /tmp/golden-venv/bin/python scripts/make_dflash_golden.py
"""

import json
import math
import sys
from importlib.metadata import version
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from torch.nn import functional as F
from transformers import Qwen3Config

import dflash.model as dm
from dflash import DFlash2DraftModel, DFlashDraftModel, extract_context_feature

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_dflash_fixture import load_target  # noqa: E402  (the tiny-kimi target in HF)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "ddtree-engine/tests/fixtures/dflash-official"
SEED = 20261
MASK_TOKEN_ID = 510
PROMPT = [5, 17, 300, 42, 9]

assert version("dflash") == "0.1.0", version("dflash")

VARIANTS = {
    "v1": dict(
        cls=DFlashDraftModel,
        extra=dict(dflash_config={"mask_token_id": MASK_TOKEN_ID, "block_size": 8}),
    ),
    "v1-features": dict(
        cls=DFlashDraftModel,
        extra=dict(
            block_size=6,
            mask_token_id=MASK_TOKEN_ID,
            dflash_config={"target_layer_ids": [0, 2]},
            use_sliding_window=True,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            input_embedding_scale=1.7,
            output_multiplier=0.6,
            final_logit_softcapping=5.0,
        ),
    ),
    "v2": dict(
        cls=DFlash2DraftModel,
        seed=SEED + 10,
        extra=dict(
            block_size=8,
            dflash_config={
                "mask_token_id": MASK_TOKEN_ID,
                "target_layer_ids": [0, 2],
                "conv_kernel_size": 3,
                "conv_group_size": 16,
                "selector_rank": 8,
                "selector_top_k": 6,
            },
            use_sliding_window=True,
            sliding_window=6,
            layer_types=["full_attention", "sliding_attention"],
            is_causal=False,
        ),
    ),
}


def drafter_config(target_cfg, extra: dict) -> Qwen3Config:
    cfg = Qwen3Config(
        vocab_size=target_cfg.vocab_size,
        hidden_size=target_cfg.hidden_size,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_theta=50000.0,
        attention_bias=False,
        tie_word_embeddings=False,
        num_target_layers=target_cfg.num_hidden_layers,
        **{k: v for k, v in extra.items() if k not in ("layer_types",)},
        layer_types=extra.get("layer_types"),
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def init(model: torch.nn.Module, seed: int) -> None:
    """Deterministic weights, rounded to bf16 (what the fixture stores)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("base_kernel"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "codebook" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            p.copy_(p.to(torch.bfloat16).float())


class ArgmaxRecorder:
    """Stands in for `torch` inside `dflash.model` and records every `torch.argmax` input: in
    `CandidateSelector.select` at temperature 0 these are the per-position candidate scores."""

    def __init__(self):
        self.inputs = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def argmax(self, x, *args, **kwargs):
        self.inputs.append(x.detach().clone())
        return torch.argmax(x, *args, **kwargs)


def target_features(target, model, ids):
    out = target(torch.tensor([ids]), output_hidden_states=True)
    return extract_context_feature(out.hidden_states, model.target_layer_ids), int(out.logits[0, -1].argmax())


def draft(target, model, feats, bonus):
    """One cache-free draft after context `feats` (positions 0..n) with bonus at position n."""
    block = model.block_size
    n = feats.shape[1]
    ids = torch.tensor([[bonus] + [model.mask_token_id] * (block - 1)])
    scale = float(dm._draft_value(model.config, "input_embedding_scale", 1.0))
    noise = F.embedding(ids, target.get_input_embeddings().weight) * scale
    hidden = model(
        target_hidden=feats,
        noise_embedding=noise,
        position_ids=torch.arange(n + block)[None],
        past_key_values=None,
        use_cache=False,
    )[:, 1:, :]
    head = dm._output_head(target)
    if isinstance(model, DFlash2DraftModel):
        recorder = ArgmaxRecorder()
        dm.torch = recorder
        try:
            path, candidates, _ = model.propose(hidden, ids[:, 0], head, 0.0)
        finally:
            dm.torch = torch
        scores = torch.stack([s[0] for s in recorder.inputs])
        # A near tie at the top-k boundary or between the best two scores would make the
        # golden depend on rounding, not on the definition: refuse it (change the seed).
        top = model.compute_logits(hidden, head)[0].topk(model.candidate_selector.top_k + 1).values
        best = scores.topk(2).values
        assert (top[:, -2] - top[:, -1]).min() > 1e-3 and (best[:, 0] - best[:, 1]).min() > 1e-3, "near tie"
        return {
            "path": path[0].tolist(),
            "candidates": candidates[0].tolist(),
            "scores": rounded(scores),
        }
    logits = model.compute_logits(hidden, head)[0]
    return {"path": logits.argmax(-1).tolist(), "logits": rounded(logits)}


def rounded(m: torch.Tensor) -> list[list[float]]:
    return [[float(f"{v:.8g}") for v in row] for row in m.tolist()]


def save(model, cfg, out: Path, variant: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, p in model.named_parameters():
        if name.startswith("candidate_selector.") and "codebook" in name:
            name = name.removesuffix(".weight")  # released checkpoints' names
        tensors[name] = p.detach().to(torch.bfloat16).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = {k: v for k, v in cfg.to_dict().items() if not k.startswith("_")}
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main() -> None:
    torch.manual_seed(SEED)
    target = load_target()
    for i, (variant, spec) in enumerate(VARIANTS.items()):
        cfg = drafter_config(target.config, spec["extra"])
        model = spec["cls"](cfg).float().eval()
        seed = spec.get("seed", SEED + i)
        init(model, seed)
        with torch.no_grad():
            feats, b0 = target_features(target, model, PROMPT)
            round1 = draft(target, model, feats, b0)
            t1, t2 = round1["path"][:2]
            feats2, b1 = target_features(target, model, PROMPT + [b0, t1, t2])
            round2 = draft(target, model, feats2, b1)
        out = OUT / variant
        save(model, cfg, out, variant)
        golden = {
            "generator": "scripts/make_dflash_golden.py",
            "dflash": version("dflash"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "seed": seed,
            "class": type(model).__name__,
            "block_size": model.block_size,
            "target_layer_ids": list(model.target_layer_ids),
            "prompt": PROMPT,
            "bonus": [b0, b1],
            "committed": [b0, t1, t2],
            "rounds": [round1, round2],
        }
        (out / "golden.json").write_text(json.dumps(golden) + "\n")
        print(f"{variant}: layers {model.target_layer_ids}, b0 {b0}, path {round1['path']}, b1 {b1}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
