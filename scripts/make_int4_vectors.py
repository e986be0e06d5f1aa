#!/usr/bin/env python3
"""Writes ddtree-kernels/tests/data/int4_vectors.txt: INT4 g32 test vectors made with the
compressed-tensors package itself (pinned below), for the Rust pack/unpack/quantize tests.

Kimi's rule: scale = bf16(amax / 7) per 32-group; q = compressed_tensors quantize (x / scale in
bf16, round half to even, clamp); weight_packed = compressed_tensors pack_to_int32 (element 0 in
the lowest nibble, stored q + 8); dequant = compressed_tensors dequantize (bf16).

    python3 -m venv /tmp/ct && /tmp/ct/bin/pip install compressed-tensors==0.20.1 torch==2.15.0
    /tmp/ct/bin/python scripts/make_int4_vectors.py
"""
import pathlib

import compressed_tensors
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

assert compressed_tensors.__version__.startswith("0.20.1"), compressed_tensors.__version__

N, K, G = 6, 96, 32
torch.manual_seed(20240604)
w = (torch.randn(N, K) * 0.05).to(torch.bfloat16)
w[1, :32] *= 40.0  # a wide group
w[2, 32:64] = w[2, 32:64].abs()  # a one-signed group
groups = w.view(N, K // G, G)
scale = (groups.abs().amax(dim=-1).float() / 7.0).to(torch.bfloat16)  # [N, K/G]
args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=G)
zp = torch.zeros_like(scale, dtype=torch.int8)
q = quantize(w, scale, zp, args, dtype=torch.int8)
q = q.clamp(-7, 7)  # Kimi's codes never use -8 (a no-op for amax / 7 scales)
packed = pack_to_int32(q, 4)
assert torch.equal(unpack_from_int32(packed, 4, torch.Size([N, K])), q)
deq = dequantize(q, scale, zp, args, dtype=torch.bfloat16)


def bits16(t):
    return [int(v) & 0xFFFF for v in t.contiguous().view(torch.int16).flatten().tolist()]


out = pathlib.Path(__file__).resolve().parent.parent / "ddtree-kernels/tests/data/int4_vectors.txt"
with open(out, "w") as f:
    f.write(f"# compressed-tensors {compressed_tensors.__version__}, torch {torch.__version__}; scripts/make_int4_vectors.py\n")
    f.write(f"shape {N} {K} {G}\n")
    f.write("weight_bf16 " + " ".join(map(str, bits16(w))) + "\n")
    f.write("weight_scale_bf16 " + " ".join(map(str, bits16(scale))) + "\n")
    f.write("codes " + " ".join(map(str, q.flatten().tolist())) + "\n")
    f.write("weight_packed_u32 " + " ".join(str(int(v) & 0xFFFFFFFF) for v in packed.flatten().tolist()) + "\n")
    f.write("dequant_bf16 " + " ".join(map(str, bits16(deq))) + "\n")
print("wrote", out)
