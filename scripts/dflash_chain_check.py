"""Records the official `dflash_generate` greedy run (z-lab `dflash` 0.1.0) of a target/drafter
pair: the output tokens and the accepted length of every round, for ddtree's chain check
(ddtree-engine/tests/dflash_official.rs: a one-path tree of `block_size - 1` nodes per round must
accept exactly as many tokens, round by round).

  python scripts/dflash_chain_check.py --target DIR --drafter DIR --out chain.json \
      [--prompt-ids 5,17,300] [--prompt TEXT] [--max-new-tokens 48]

`--target` is an HF DeepSeek-V3 checkpoint as ddtree loads it (`deepseek_v3` / `kimi_k2`, or a
`kimi_k25` wrapper with `text_config`; compressed-tensors INT4 experts are dequantized);
`--drafter` a `DFlashDraftModel` / `DFlash2DraftModel` directory. `--prompt` needs the target's
`tokenizer.json`. With no arguments it records the random tiny pairs of the goldens
(tiny-kimi + dflash-official/{v1,v2}) into their fixture folders.

Environment: scripts/requirements-golden.txt (transformers 4.57.3) plus scripts/requirements-dflash.txt with
--no-deps. The package's loop is written for transformers 5 caches; on 4.57 two of its cache calls
need a shim, applied here and nothing else changed: caches are plain `DynamicCache()`s (4.57
builds sliding-window layers from the config, which drop keys the package's index-based mask
counts on, and cannot be cropped); `DynamicCache.activate_past_recording` (an
initialization hook that attention-only caches do not need) is a no-op, and `_crop_to(cache, n)`
crops only when the cache is longer than `n` (4.57's `crop(0)` would empty the cache when
nothing is to be removed; the package means "keep the first n"); without CUDA its timer is
`time.perf_counter` (it synchronizes CUDA).
"""

import argparse
import json
import time
from importlib.metadata import version
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.cache_utils import DynamicCache

import dflash.model as dm
from dflash import DFlash2DraftModel, DFlashDraftModel

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "ddtree-engine/tests/fixtures"
DEFAULT_PROMPT = [5, 17, 300, 42, 9]

assert version("dflash") == "0.1.0", version("dflash")


def install_shims() -> None:
    if not hasattr(DynamicCache, "activate_past_recording"):
        DynamicCache.activate_past_recording = lambda self: None
    # 4.57's DynamicCache(config=...) gives sliding-window layers that drop old keys and refuse
    # `crop`; the package's mask is built on key indices, so every key must stay: plain layers.
    dm._make_cache = lambda config: DynamicCache()
    original = dm._crop_to

    def crop_to(cache, length):
        if cache.get_seq_length() > length:
            original(cache, length)

    dm._crop_to = crop_to
    if not torch.cuda.is_available():
        dm._cuda_time = time.perf_counter  # its timer synchronizes CUDA; the stats want only lengths


def load_target(dir: Path) -> DeepseekV3ForCausalLM:
    """An HF DeepSeek-V3 model from ddtree's checkpoint layout, INT4 experts dequantized."""
    raw = json.loads((dir / "config.json").read_text())
    text = raw.get("text_config", raw)
    drop = {"model_type", "architectures", "transformers_version", "quantization_config", "auto_map"}
    cfg = DeepseekV3Config(**{k: v for k, v in text.items() if k not in drop})
    cfg._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    tensors = {}
    for shard in sorted(dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    state = {}
    for name, t in tensors.items():
        short = name.removeprefix("language_model.")
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            out, inp = tensors[base + ".weight_shape"].tolist()
            words = t.to(torch.int64) & 0xFFFFFFFF
            nib = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], dim=-1).reshape(out, -1)[:, :inp]
            scale = tensors[base + ".weight_scale"].float()
            weight = (nib - 8).float() * scale.repeat_interleave(inp // scale.shape[1], dim=1)
            state[short[: -len(".weight_packed")] + ".weight"] = weight
        elif name.endswith((".weight_scale", ".weight_shape")):
            continue
        else:
            state[short] = t.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def load_drafter(dir: Path):
    arch = json.loads((dir / "config.json").read_text()).get("architectures", ["DFlashDraftModel"])[0]
    cls = {"DFlashDraftModel": DFlashDraftModel, "DFlash2DraftModel": DFlash2DraftModel}[arch]
    model = cls.from_pretrained(dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def record(target_dir: Path, drafter_dir: Path, prompt: list[int], max_new_tokens: int) -> dict:
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir)
    out = dm.dflash_generate(
        drafter,
        target,
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        stop_token_ids=None,
        temperature=0.0,
        return_stats=True,
    )
    lengths = list(out.acceptance_lengths)
    # dflash_generate drafts a shorter block when fewer than block_size positions are left; a
    # round is comparable with ddtree's full-block chain only while its block was full.
    block, start, full = drafter.block_size, len(prompt), []
    for n in lengths:
        full.append(min(block, len(prompt) + max_new_tokens - start) == block)
        start += n
    return {
        "generator": "scripts/dflash_chain_check.py",
        "dflash": version("dflash"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "target": str(target_dir),
        "drafter": str(drafter_dir),
        "block_size": block,
        "prompt": prompt,
        "max_new_tokens": max_new_tokens,
        "output": out.output_ids[0, len(prompt):].tolist(),
        "acceptance_lengths": lengths,
        "full_block": full,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path)
    p.add_argument("--drafter", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--prompt-ids", help="comma-separated token ids")
    p.add_argument("--prompt", help="text, tokenized with the target's tokenizer.json")
    p.add_argument("--max-new-tokens", type=int, default=48)
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    install_shims()
    if a.target is None:
        for variant in ["v1", "v2"]:
            dir = FIXTURES / "dflash-official" / variant
            result = record(FIXTURES / "tiny-kimi", dir, DEFAULT_PROMPT, 24)
            result["target"], result["drafter"] = "tiny-kimi", f"dflash-official/{variant}"
            (dir / "chain.json").write_text(json.dumps(result) + "\n")
            print(variant, result["acceptance_lengths"])
        return
    if a.drafter is None or a.out is None:
        p.error("--target needs --drafter and --out")
    if a.prompt is not None:
        from tokenizers import Tokenizer

        prompt = Tokenizer.from_file(str(a.target / "tokenizer.json")).encode(a.prompt, add_special_tokens=False).ids
    elif a.prompt_ids is not None:
        prompt = [int(t) for t in a.prompt_ids.split(",")]
    else:
        prompt = DEFAULT_PROMPT
    result = record(a.target, a.drafter, prompt, a.max_new_tokens)
    a.out.write_text(json.dumps(result) + "\n")
    print("acceptance lengths", result["acceptance_lengths"])


if __name__ == "__main__":
    main()
