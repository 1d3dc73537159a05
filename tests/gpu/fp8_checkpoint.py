"""FP8 checkpoints in Kimi K2's (and DeepSeek-V3's) released format, from a
bf16 checkpoint, and their dequantised fp32 copy for the reference.

The released models store every linear layer's weight of the decoder layers
(attention projections, dense MLP, shared and routed experts; not the
router's gate, the embeddings, the norms or the LM head) as float8_e4m3fn
`<name>.weight` with one fp32 `<name>.weight_scale_inv` per 128 x 128 block
(partial at the edges), W = e4m3 * scale, and say so in config.json:
`quantization_config: {quant_method: fp8, fmt: e4m3, activation_scheme:
dynamic, weight_block_size: [128, 128]}`. Here each block's scale is its
largest magnitude over 448 (e4m3's largest finite value), as DeepSeek's
quantiser has it.

    quantise(bf16_dir, fp8_dir)     the FP8 checkpoint (what the library loads)
    dequantise(fp8_dir, ref_dir)    fp32 weights W = e4m3 * scale, no quantization_config
                                    (what transformers' reference loads), checked block by block

    python3 tests/gpu/fp8_checkpoint.py --self-test   (CPU: quantise, dequantise and check a
                                                       random checkpoint, partial blocks included)
"""

import argparse
import json
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

from checkpoints import scratch_dir

BLOCK = 128
E4M3_MAX = 448.0
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
# The decoder layers' linear weights the released checkpoints store in FP8.
FP8_PARTS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
             "down_proj")


def is_fp8(key, tensor):
    """Whether `key` is stored in FP8 in the released format."""
    if not key.startswith("model.layers.") or not key.endswith(".weight") or tensor.dim() != 2:
        return False
    return key[: -len(".weight")].rsplit(".", 1)[-1] in FP8_PARTS


def block_view(rows, cols, device="cpu"):
    """The block index of every element of a [rows, cols] matrix."""
    r = torch.arange(rows, device=device) // BLOCK
    c = torch.arange(cols, device=device) // BLOCK
    return r[:, None], c[None, :]


def quantise_tensor(w, pow2=False):
    """A [rows, k] matrix as (e4m3 codes, fp32 scales [ceil(rows/128), ceil(k/128)]), on its device.
    pow2: each scale the power of two at or above amax / 448, so that every dequantised weight (an
    e4m3 value, four significant bits, times a power of two) is exact in bf16 (bench/k2_bench.py:
    its bf16 peer then computes with exactly the library's weights)."""
    w = w.float()
    rows, k = w.shape
    br, bk = -(-rows // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(br * BLOCK, bk * BLOCK, device=w.device)
    padded[:rows, :k] = w
    amax = padded.reshape(br, BLOCK, bk, BLOCK).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    r, c = block_view(rows, k, w.device)
    codes = (w / scale[r, c]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale.float()


def dequantise_tensor(codes, scale):
    """W = e4m3 * scale, fp32."""
    r, c = block_view(*codes.shape, codes.device)
    return codes.float() * scale[r, c]


def shards(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))


def copy_side_files(src, dst, skip=()):
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f not in skip:
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))


def rewrite_config(d, quantised):
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    if quantised:
        cfg["quantization_config"] = dict(QUANTIZATION_CONFIG)
    else:
        cfg.pop("quantization_config", None)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def rewrite_index(d, owner):
    """model.safetensors.index.json's weight_map for the keys of `owner` (key -> shard)."""
    path = os.path.join(d, "model.safetensors.index.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        idx = json.load(f)
    idx["weight_map"] = dict(sorted(owner.items()))
    idx.get("metadata", {}).pop("total_size", None)
    with open(path, "w") as f:
        json.dump(idx, f, indent=2)


def quantise(src, dst):
    """The FP8 checkpoint of the bf16 checkpoint `src`, in `dst`. Returns the count of FP8 matrices."""
    copy_side_files(src, dst)
    owner, count = {}, 0
    for shard in shards(src):
        out = {}
        for key, t in load_file(os.path.join(src, shard)).items():
            if is_fp8(key, t):
                codes, scale = quantise_tensor(t)
                out[key] = codes.contiguous()
                out[key + "_scale_inv"] = scale.contiguous()
                owner[key + "_scale_inv"] = shard
                count += 1
            else:
                out[key] = t.contiguous()
            owner[key] = shard
        save_file(out, os.path.join(dst, shard), metadata={"format": "pt"})
    rewrite_config(dst, True)
    rewrite_index(dst, owner)
    return count


def dequantise(src, dst):
    """fp32 copy of the FP8 checkpoint `src` in `dst` (every tensor fp32, no quantization_config),
    each FP8 matrix checked against its codes and scales: every element equals e4m3 * scale of its
    block, computed one block at a time apart from dequantise_tensor. Returns the count."""
    copy_side_files(src, dst)
    owner, count = {}, 0
    for shard in shards(src):
        tensors = load_file(os.path.join(src, shard))
        out = {}
        for key, t in tensors.items():
            if key.endswith("_scale_inv"):
                continue
            if t.dtype == torch.float8_e4m3fn:
                scale = tensors[key + "_scale_inv"]
                w = dequantise_tensor(t, scale)
                check_blocks(key, t, scale, w)
                out[key] = w.contiguous()
                count += 1
            else:
                out[key] = t.float().contiguous()
            owner[key] = shard
        save_file(out, os.path.join(dst, shard), metadata={"format": "pt"})
    rewrite_config(dst, False)
    rewrite_index(dst, owner)
    return count


def check_blocks(key, codes, scale, w):
    rows, k = codes.shape
    if tuple(scale.shape) != (-(-rows // BLOCK), -(-k // BLOCK)):
        raise ValueError(f"{key}_scale_inv: shape {tuple(scale.shape)} for codes [{rows}, {k}]")
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = codes[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float() * scale[i, j].item()
            if not torch.equal(blk, w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]):
                raise ValueError(f"{key}: block ({i}, {j}) does not dequantise to e4m3 x scale")


def self_test():
    """Quantise, dequantise and check a random checkpoint of odd shapes on the CPU."""
    torch.manual_seed(0)
    work = scratch_dir("mkc_fp8_")
    try:
        src, fp8, ref = (os.path.join(work, d) for d in ("bf16", "fp8", "ref"))
        os.makedirs(src)
        tensors = {
            "model.layers.0.self_attn.kv_b_proj.weight": torch.randn(300, 200),  # partial blocks both ways
            "model.layers.0.mlp.experts.3.down_proj.weight": torch.randn(128, 128) * 1e-3,
            "model.layers.0.mlp.gate.weight": torch.randn(8, 64),  # the router: stays bf16
            "model.layers.0.input_layernorm.weight": torch.randn(64),
            "model.embed_tokens.weight": torch.randn(32, 64),
        }
        tensors["model.layers.0.self_attn.kv_b_proj.weight"][5, 7] = 0.0
        tensors["model.layers.0.self_attn.kv_b_proj.weight"][256:, :] = 0.0  # an all-zero block row
        tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
        save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(src, "config.json"), "w") as f:
            json.dump({"model_type": "deepseek_v3"}, f)
        assert quantise(src, fp8) == 2, "two FP8 matrices"
        q = load_file(os.path.join(fp8, "model.safetensors"))
        assert q["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
        assert q["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
        assert tuple(q["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"].shape) == (3, 2)
        with open(os.path.join(fp8, "config.json")) as f:
            assert json.load(f)["quantization_config"]["weight_block_size"] == [BLOCK, BLOCK]
        assert dequantise(fp8, ref) == 2
        d = load_file(os.path.join(ref, "model.safetensors"))
        for key, t in tensors.items():
            got = d[key]
            assert got.dtype == torch.float32, key
            err = (got - t.float()).abs().max().item()
            if key in ("model.layers.0.self_attn.kv_b_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight"):
                # e4m3 keeps 4 significant bits: within 2^-4 of each block's largest magnitude.
                bound = t.float().abs().max().item() / 16
                assert err <= bound, f"{key}: {err} > {bound}"
            else:
                assert err == 0, f"{key} changed"
        assert d["model.layers.0.self_attn.kv_b_proj.weight"][256:].abs().max().item() == 0
        # The check can fail: weights that are not e4m3 x the given scales are caught.
        codes = q["model.layers.0.self_attn.kv_b_proj.weight"]
        scale = q["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"]
        try:
            check_blocks("kv_b", codes, scale * 1.5, dequantise_tensor(codes, scale))
            raise AssertionError("a wrong scale passed the block check")
        except ValueError:
            pass
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("fp8_checkpoint self-test PASS")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        self_test()
    sys.exit(0)
