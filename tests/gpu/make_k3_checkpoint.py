"""Writes a random Kimi K3 checkpoint in K3's naming (K3_DECODE_SPEC.md section
12), with bf16 or MXFP4 routed experts (section 13), for a given config.json.

Weights are drawn so that logits are not near-ties: std 1/sqrt(fan_in) for
projections, std 1 for embeddings, norms near 1.

    python3 make_k3_checkpoint.py CONFIG.json OUT_DIR [--bf16-experts] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re

import torch
from safetensors.torch import save_file

from k3_reference import Config, mxfp4_quantize

PREFIX = "language_model."


def kda_dt_bias(shape, g, device):
    """KDA's gate bias as flash-linear-attention initialises it: the inverse
    softplus of dt, log-uniform in [1e-3, 1e-1]. (Drawn near 0 instead, the
    gate's derivative exp(A_log) sigmoid(f + dt_bias) is up to 8 and a bf16
    rounding of f moves the decay by percents: a comparison then measures the
    test model's sensitivity, not the kernel.)"""
    u = torch.rand(shape, generator=g, device=device)
    dt = torch.exp(u * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3))
    return dt + torch.log(-torch.expm1(-dt))


def make(cfg_path: str, out: str, mxfp4: bool, seed: int, zero: tuple[str, ...] = ()) -> None:
    """Draws on the GPU when there is one (K3's real widths: gigabytes of
    experts to quantise), on the CPU otherwise; the same seed gives the same
    checkpoint on the same kind of device. Tensors whose names match one of
    the regular expressions `zero` are written as zeros (tests/gpu/k3_bisect.py
    cuts parts of the model out this way)."""
    c = Config.load(cfg_path)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    t: dict[str, torch.Tensor] = {}

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=dev)

    def proj(name, rows, cols):
        t[name] = (randn(rows, cols) / math.sqrt(cols)).to(torch.bfloat16).cpu()

    def norm(name, n):
        t[name] = (1.0 + 0.1 * randn(n)).to(torch.bfloat16).cpu()

    h, p = c.hidden, c.kda_heads * c.kda_dim
    t["model.embed_tokens.weight"] = randn(c.vocab, h).to(torch.bfloat16).cpu()
    norm("model.norm.weight", h)
    norm("model.output_attn_res_norm.weight", h)
    proj("model.output_attn_res_proj.weight", 1, h)
    if not c.tied:
        proj("lm_head.weight", c.vocab, h)
        # Rows of varied scale (as tests/gpu/deepseek_v3_decode.py draws them), so that the logits'
        # top two are rarely near-tied; from a generator of their own, the rest of the draw unchanged.
        gs = torch.Generator(device=dev).manual_seed(seed + 7919)
        row = torch.exp(torch.randn(c.vocab, 1, generator=gs, device=dev)).cpu()
        t["lm_head.weight"] = (t["lm_head.weight"].float() * row).to(torch.bfloat16)
    for l in range(c.layers):
        pre = f"model.layers.{l}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            norm(pre + n + ".weight", h)
        for n in ("self_attention_res_proj", "mlp_res_proj"):
            proj(pre + n + ".weight", 1, h)
        a = pre + "self_attn."
        if c.is_mla(l):
            proj(a + "q_a_proj.weight", c.q_lora, h)
            norm(a + "q_a_layernorm.weight", c.q_lora)
            proj(a + "q_b_proj.weight", c.heads * (c.nope + c.rope), c.q_lora)
            proj(a + "kv_a_proj_with_mqa.weight", c.kv_lora + c.rope, h)
            norm(a + "kv_a_layernorm.weight", c.kv_lora)
            proj(a + "kv_b_proj.weight", c.heads * (c.nope + c.v_dim), c.kv_lora)
            proj(a + "o_proj.weight", h, c.heads * c.v_dim)
            proj(a + "g_proj.weight", c.heads * c.v_dim, h)
        else:
            for n in ("q", "v", "g"):
                proj(a + n + "_proj.weight", p, h)
            # Keys correlated with the queries (tests/gpu/deepseek_v3_decode.py, align_kda_keys).
            t[a + "k_proj.weight"] = (0.8 * t[a + "q_proj.weight"].float()
                                      + 0.6 * randn(p, h).cpu() / math.sqrt(h)).to(torch.bfloat16)
            for n in ("q", "v"):
                t[a + n + "_conv1d.weight"] = (randn(p, 1, c.conv) / math.sqrt(c.conv)).float().cpu()
            t[a + "k_conv1d.weight"] = t[a + "q_conv1d.weight"].clone()
            proj(a + "b_proj.weight", c.kda_heads, h)
            proj(a + "f_a_proj.weight", c.kda_dim, h)
            proj(a + "f_b_proj.weight", p, c.kda_dim)
            t[a + "A_log"] = torch.log(torch.empty(c.kda_heads, device=dev).uniform_(1.0, 16.0, generator=g)).float().cpu()
            t[a + "dt_bias"] = kda_dt_bias(p, g, dev).float().cpu()
            norm(a + "o_norm.weight", c.kda_dim)
            proj(a + "o_proj.weight", h, p)
        m = pre + "mlp."
        if l < c.first_dense:
            proj(m + "gate_proj.weight", c.inter, h)
            proj(m + "up_proj.weight", c.inter, h)
            proj(m + "down_proj.weight", h, c.inter)
            continue
        proj(m + "gate.weight", c.experts, h)
        t[m + "gate.e_score_correction_bias"] = (0.01 * randn(c.experts)).float().cpu()
        s = c.moe_inter * c.shared
        proj(m + "shared_experts.gate_proj.weight", s, h)
        proj(m + "shared_experts.up_proj.weight", s, h)
        proj(m + "shared_experts.down_proj.weight", h, s)
        proj(m + "routed_expert_down_proj.weight", c.latent, h)
        norm(m + "routed_expert_norm.weight", c.latent)
        proj(m + "routed_expert_up_proj.weight", h, c.latent)
        for e in range(c.experts):
            for name, rows, cols in (("w1", c.moe_inter, c.latent), ("w3", c.moe_inter, c.latent), ("w2", c.latent, c.moe_inter)):
                w = randn(rows, cols) / math.sqrt(cols)
                key = f"{m}experts.{e}.{name}."
                if mxfp4:
                    packed, scale = mxfp4_quantize(w)
                    t[key + "weight_packed"], t[key + "weight_scale"] = packed.cpu(), scale.cpu()
                else:
                    t[key + "weight"] = w.to(torch.bfloat16).cpu()
    for pattern in zero:
        hits = [k for k in t if re.search(pattern, k)]
        if not hits:
            raise ValueError(f"--zero {pattern!r} matches no tensor of {cfg_path}")
        for k in hits:
            t[k] = torch.zeros_like(t[k])
    os.makedirs(out, exist_ok=True)
    save_file({PREFIX + k: v.contiguous() for k, v in sorted(t.items())}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.load(open(cfg_path))
    text = cfg.get("text_config", cfg)
    if mxfp4:
        text["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    else:
        text.pop("quantization_config", None)
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--bf16-experts", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    make(a.config, a.out, not a.bf16_experts, a.seed)
