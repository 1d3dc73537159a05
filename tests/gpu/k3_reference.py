"""The project's own PyTorch reference of one Kimi K3 decode step.

Written from K3_DECODE_SPEC.md (section numbers below), independently of mkc's
graph file, so that the megakernel can be compared with something that does
not share its mistakes. It runs on CPU or GPU, in fp32 by default (weights as
stored, math in fp32), for a batch of sequences that decode in lockstep.

It reads a checkpoint directory in K3's naming (spec section 12): bf16 or
MXFP4 routed experts (section 13), `language_model.` prefix.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import load_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Section 13: two e2m1 codes per byte along K (low nibble first), one
    e8m0 scale per 32 values; byte 255 (NaN) reads as 0 (SGLang's helper)."""
    n, half = packed.shape
    codes = torch.empty(n, half * 2, dtype=torch.long, device=packed.device)
    codes[:, 0::2] = (packed & 0xF).long()
    codes[:, 1::2] = (packed >> 4).long()
    vals = E2M1.to(packed.device)[codes]
    s = torch.pow(2.0, scale.float() - 127.0)
    s = torch.where(scale == 255, torch.zeros_like(s), s)
    return vals * s.repeat_interleave(32, dim=1)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for writing random checkpoints: per 32 values the
    smallest power-of-two scale that fits the largest magnitude in 6, then
    the nearest e2m1 code."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // 32, 32)
    amax = blocks.abs().amax(dim=2).clamp_min(1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scale = (exp + 127).to(torch.uint8)
    scaled = blocks / torch.pow(2.0, exp)[..., None]
    grid = E2M1[:8].to(w.device)
    idx = (scaled.abs()[..., None] - grid).abs().argmin(dim=-1)
    codes = idx + 8 * (scaled < 0).long()
    codes = codes.reshape(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, scale


@dataclass
class Config:
    vocab: int
    hidden: int
    layers: int
    eps: float
    heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v_dim: int
    kda_heads: int
    kda_dim: int
    conv: int
    lower_bound: float | None
    full_attn_layers: list[int]
    experts: int
    top_k: int
    shared: int
    moe_inter: int
    latent: int
    latent_norm: bool
    inter: int
    first_dense: int
    renorm: bool
    scaling: float
    n_group: int
    topk_group: int
    beta: float
    beta_lin: float | None
    block: int
    logit_scale: float
    tied: bool

    @staticmethod
    def load(path: str) -> "Config":
        c = json.load(open(path))
        c = {**c, **c.get("text_config", {})}
        lin = c["linear_attn_config"]
        return Config(
            vocab=c["vocab_size"], hidden=c["hidden_size"], layers=c["num_hidden_layers"],
            eps=c.get("rms_norm_eps", 1e-6), heads=c["num_attention_heads"], q_lora=c["q_lora_rank"],
            kv_lora=c["kv_lora_rank"], nope=c["qk_nope_head_dim"], rope=c["qk_rope_head_dim"], v_dim=c["v_head_dim"],
            kda_heads=lin["num_heads"], kda_dim=lin["head_dim"], conv=lin.get("short_conv_kernel_size", 4),
            lower_bound=lin.get("gate_lower_bound"), full_attn_layers=lin["full_attn_layers"],
            experts=c["num_experts"], top_k=c["num_experts_per_token"], shared=c.get("num_shared_experts", 0),
            moe_inter=c["moe_intermediate_size"], latent=c["routed_expert_hidden_size"],
            latent_norm=c.get("latent_moe_use_norm", True), inter=c["intermediate_size"],
            first_dense=c.get("first_k_dense_replace", 1), renorm=c.get("moe_renormalize", True),
            scaling=c.get("routed_scaling_factor", 1.0), n_group=c.get("num_expert_group", 1),
            topk_group=c.get("topk_group", 1), beta=c.get("activation_situ_beta", 4.0),
            beta_lin=c.get("activation_situ_linear_beta"), block=c["attn_res_block_size"],
            logit_scale=c.get("logit_scale", 1.0), tied=c.get("tie_word_embeddings", False),
        )

    def is_mla(self, layer: int) -> bool:
        return (layer + 1) in self.full_attn_layers  # 1-based (section 14)


def load_checkpoint(path: str) -> dict[str, torch.Tensor]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(os.path.join(path, f)))
    return out


def rms_norm(x, w, eps):
    """Section 2: fp32 normalisation, fp32 weight multiply."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def situ_glu(gate, up, beta, beta_lin):
    """Section 2: SiTU on the gate, capped linear on the up branch."""
    g = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    u = up if beta_lin is None else beta_lin * torch.tanh(up / beta_lin)
    return g * u


def state_context(c: Config, batch: int, total_bytes: int) -> int:
    """The context length of a compiled runtime whose state (mkc_model_save_state
    format, see pack_state) has `total_bytes`: what makes the sizes add up."""
    p = c.kda_heads * c.kda_dim
    kda = sum(1 for l in range(c.layers) if not c.is_mla(l))
    mla = c.layers - kda
    fixed = 4 * batch + batch * kda * (3 * (c.conv - 1) * p * 2 + c.kda_heads * c.kda_dim * c.kda_dim * 4)
    row = (c.kv_lora + c.rope) * 2
    ctx = (total_bytes - fixed) // (batch * mla * row) if mla else 0
    if fixed + batch * mla * row * ctx != total_bytes:
        raise ValueError(f"the runtime's state ({total_bytes} bytes) does not match this config's layers")
    return ctx


def pack_state(c: Config, batch: int, seq_len: int, kv: dict, conv: dict, ssm: dict, total_bytes: int) -> bytes:
    """A K3 state in the compiled runtime's save format (mkc_model_save_state):
    int32 positions [B], then each state of the graph in order, [B][...] each:
    per KDA layer the q, k, v conv windows (bf16 [W-1][P], oldest first; from
    conv[l] [B, W-1, 3P]) and the recurrent state (fp32 [heads][d (v)][d (k)];
    ssm[l]), per MLA layer the latent KV cache (bf16 [ctx][c + rope]; the first
    seq_len rows of kv[l]), ctx from state_context."""
    p = c.kda_heads * c.kda_dim
    ctx = state_context(c, batch, total_bytes)
    if any(c.is_mla(l) for l in range(c.layers)) and ctx < seq_len:
        raise ValueError(f"position {seq_len} is past the runtime's context ({ctx})")
    parts = [np.full(batch, seq_len, dtype=np.int32).tobytes()]
    for l in range(c.layers):
        if c.is_mla(l):
            cache = torch.zeros(batch, ctx, c.kv_lora + c.rope, dtype=torch.bfloat16)
            cache[:, :seq_len] = kv[l][:, :seq_len].to(torch.bfloat16).cpu()
            parts.append(cache.view(torch.int16).numpy().tobytes())
        else:
            for i in range(3):  # q, k, v
                win = conv[l][:, :, i * p : (i + 1) * p].to(torch.bfloat16).cpu().contiguous()
                parts.append(win.view(torch.int16).numpy().tobytes())
            parts.append(ssm[l].float().cpu().contiguous().numpy().tobytes())
    out = b"".join(parts)
    assert len(out) == total_bytes
    return out


def unpack_state(c: Config, batch: int, data: bytes, device="cpu") -> tuple[int, dict, dict, dict]:
    """pack_state's inverse: (seq_len, kv, conv, ssm) from a state in the runtime's save format
    (the KV caches at the runtime's context; every sequence at the same position)."""
    p = c.kda_heads * c.kda_dim
    ctx = state_context(c, batch, len(data))
    pos = np.frombuffer(data, dtype=np.int32, count=batch)
    if (pos != pos[0]).any():
        raise ValueError(f"sequences at different positions {pos.tolist()}")
    at = 4 * batch
    kv, conv, ssm = {}, {}, {}

    def take(n: int, dtype, shape):
        nonlocal at
        raw = np.frombuffer(data, dtype=np.int16 if dtype == torch.bfloat16 else np.float32, count=n, offset=at)
        at += raw.nbytes
        t = torch.from_numpy(raw.copy())
        return (t.view(torch.bfloat16) if dtype == torch.bfloat16 else t).float().reshape(shape).to(device)

    for l in range(c.layers):
        if c.is_mla(l):
            kv[l] = take(batch * ctx * (c.kv_lora + c.rope), torch.bfloat16, (batch, ctx, c.kv_lora + c.rope))
        else:
            conv[l] = torch.cat([take(batch * (c.conv - 1) * p, torch.bfloat16, (batch, c.conv - 1, p)) for _ in range(3)], -1)
            ssm[l] = take(batch * c.kda_heads * c.kda_dim * c.kda_dim, torch.float32,
                          (batch, c.kda_heads, c.kda_dim, c.kda_dim))
    return int(pos[0]), kv, conv, ssm


def bf16_state(s: dict) -> dict:
    """A K3Reference.state() with its KV cache rows and conv windows rounded to bf16, as the
    compiled runtime stores them (the recurrent state stays fp32)."""
    return {"seq_len": s["seq_len"], "kv": {k: v.bfloat16().float() for k, v in s["kv"].items()},
            "conv": {k: v.bfloat16().float() for k, v in s["conv"].items()}, "ssm": s["ssm"]}


def score_change(a: dict, b: dict, batch: int) -> torch.Tensor:
    """[B]: the largest change of any expert's selection score between two
    steps' `router_scores` (per MoE layer, [B, E]), over the layers."""
    change = torch.zeros(batch)
    for l, scores in b.items():
        d = (a[l] - scores).abs().nan_to_num(nan=0.0)  # both -inf: a dropped group, no change
        change = torch.maximum(change, d.amax(-1).cpu())
    return change


class K3Reference:
    def __init__(self, ckpt_dir: str, batch: int, max_ctx: int, device="cpu", prefix="language_model.",
                 round_bf16: bool = False, round_state: bool = False):
        """round_bf16: every projection's output rounded to bf16 (as an
        implementation that stores its activations in bf16 would; the KV cache
        and conv windows with them). round_state: the activations fp32, what is
        kept for later steps in the graph's dtypes (KV cache rows and conv
        windows bf16, the recurrent state fp32), as the compiled programs keep
        them. How far either alone moves the logits is a noise floor."""
        self.round_bf16 = round_bf16
        self.round_state = round_state
        # Per MoE layer, expert ids [B, top_k] to take instead of this reference's own top-k
        # (twin(): the bf16 twin follows the fp32 reference's routing); `expert_ids` holds, after
        # each step, the ids taken.
        self.forced: dict[int, torch.Tensor] | None = None
        self.expert_ids: dict[int, torch.Tensor] = {}
        self.cfg = Config.load(os.path.join(ckpt_dir, "config.json"))
        self.dev = device
        raw = load_checkpoint(ckpt_dir)
        self.w = {k[len(prefix):] if k.startswith(prefix) else k: v.to(device) for k, v in raw.items()}
        self.batch = batch
        c = self.cfg
        p = c.kda_heads * c.kda_dim
        self.seq_len = 0
        self.kv = {l: torch.zeros(batch, max_ctx, c.kv_lora + c.rope, device=device) for l in range(c.layers) if c.is_mla(l)}
        self.conv = {l: torch.zeros(batch, c.conv - 1, 3 * p, device=device) for l in range(c.layers) if not c.is_mla(l)}
        self.ssm = {l: torch.zeros(batch, c.kda_heads, c.kda_dim, c.kda_dim, device=device) for l in range(c.layers) if not c.is_mla(l)}

    def W(self, name):
        return self.w[name].float()

    def linear(self, x, name):
        y = x.float() @ self.W(name).t()
        return y.bfloat16().float() if self.round_bf16 else y

    # ---- section 5: KDA
    def kda(self, l, x):
        c, pre = self.cfg, f"model.layers.{l}.self_attn."
        h, d = c.kda_heads, c.kda_dim
        z = torch.cat([self.linear(x, pre + n + "_proj.weight") for n in ("q", "k", "v")], dim=-1)  # pre-conv
        wconv = torch.cat([self.W(pre + n + "_conv1d.weight").squeeze(1) for n in ("q", "k", "v")], dim=0)  # [3P, W]
        state = self.conv[l]
        window = torch.cat([state, z[:, None, :]], dim=1)  # [B, W, 3P], oldest first
        y = torch.nn.functional.silu((window * wconv.t()[None]).sum(1))
        self.conv[l] = window[:, 1:].bfloat16().float() if self.round_state else window[:, 1:]  # bf16 windows
        q, k, v = y.split(h * d, dim=-1)
        q, k, v = (t.reshape(-1, h, d) for t in (q, k, v))
        f = self.linear(self.linear(x, pre + "f_a_proj.weight"), pre + "f_b_proj.weight").reshape(-1, h, d)
        a_log = self.W(pre + "A_log").reshape(-1)[:h][None, :, None]
        dt = self.W(pre + "dt_bias").reshape(h, d)[None]
        if c.lower_bound is not None:
            g = c.lower_bound * torch.sigmoid(torch.exp(a_log) * (f + dt))
        else:
            g = -torch.exp(a_log) * torch.nn.functional.softplus(f + dt, threshold=20.0)
        beta = torch.sigmoid(self.linear(x, pre + "b_proj.weight"))  # [B, h]
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * d ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        S = self.ssm[l] * torch.exp(g)[:, :, None, :]  # column i scaled by alpha[i]
        u = beta[..., None] * (v - torch.einsum("bhvk,bhk->bhv", S, k))
        S = S + u[..., :, None] * k[..., None, :]
        self.ssm[l] = S
        o = torch.einsum("bhvk,bhk->bhv", S, q)
        gate = self.linear(x, pre + "g_proj.weight").reshape(-1, h, d)
        o = rms_norm(o, self.W(pre + "o_norm.weight"), 1e-5) * torch.sigmoid(gate)  # o_norm eps 1e-5
        return self.linear(o.reshape(-1, h * d), pre + "o_proj.weight")

    # ---- section 6: gated MLA without RoPE, absorbed
    def mla(self, l, x):
        c, pre = self.cfg, f"model.layers.{l}.self_attn."
        t = self.seq_len
        cq = rms_norm(self.linear(x, pre + "q_a_proj.weight"), self.W(pre + "q_a_layernorm.weight"), c.eps)
        q = self.linear(cq, pre + "q_b_proj.weight").reshape(-1, c.heads, c.nope + c.rope)
        q_nope, q_pe = q.split([c.nope, c.rope], dim=-1)
        kv = self.linear(x, pre + "kv_a_proj_with_mqa.weight")
        ckv, k_pe = kv.split([c.kv_lora, c.rope], dim=-1)
        ckv = rms_norm(ckv, self.W(pre + "kv_a_layernorm.weight"), c.eps)
        row = torch.cat([ckv, k_pe], dim=-1)
        self.kv[l][:, t] = row.bfloat16().float() if self.round_bf16 or self.round_state else row  # a bf16 cache
        cache = self.kv[l][:, : t + 1]  # [B, T, C + R]
        wkvb = self.W(pre + "kv_b_proj.weight").reshape(c.heads, c.nope + c.v_dim, c.kv_lora)
        w_uk, w_uv = wkvb[:, : c.nope], wkvb[:, c.nope :]
        q_lat = torch.einsum("bhn,hnc->bhc", q_nope, w_uk)
        s = (torch.einsum("bhc,btc->bht", q_lat, cache[..., : c.kv_lora])
             + torch.einsum("bhr,btr->bht", q_pe, cache[..., c.kv_lora :])) / math.sqrt(c.nope + c.rope)
        p = torch.softmax(s, dim=-1)
        o_lat = torch.einsum("bht,btc->bhc", p, cache[..., : c.kv_lora])
        o = torch.einsum("bhc,hvc->bhv", o_lat, w_uv).reshape(-1, c.heads * c.v_dim)
        o = o * torch.sigmoid(self.linear(x, pre + "g_proj.weight"))
        return self.linear(o, pre + "o_proj.weight")

    # ---- section 7 and 8
    def dense(self, l, x):
        c, pre = self.cfg, f"model.layers.{l}.mlp."
        h = situ_glu(self.linear(x, pre + "gate_proj.weight"), self.linear(x, pre + "up_proj.weight"), c.beta, c.beta_lin)
        return self.linear(h, pre + "down_proj.weight")

    def expert(self, l, e, name):
        pre = f"model.layers.{l}.mlp.experts.{e}.{name}."
        if pre + "weight_packed" in self.w:
            return mxfp4_dequant(self.w[pre + "weight_packed"], self.w[pre + "weight_scale"])
        return self.W(pre + "weight")

    def moe(self, l, x):
        c, pre = self.cfg, f"model.layers.{l}.mlp."
        z = x.float() @ self.W(pre + "gate.weight").t()
        s = torch.sigmoid(z)
        sel = s + self.W(pre + "gate.e_score_correction_bias")
        if c.n_group > 1:
            g = sel.reshape(-1, c.n_group, c.experts // c.n_group).topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(g).scatter_(1, g.topk(c.topk_group, dim=-1).indices, 1.0)
            sel = sel.masked_fill(keep.repeat_interleave(c.experts // c.n_group, 1) == 0, float("-inf"))
        self.router_scores[l] = sel
        top = sel.topk(min(c.top_k + 1, c.experts), dim=-1)
        ids = top.indices[:, : c.top_k] if self.forced is None else self.forced[l].to(top.indices.device).long()
        self.expert_ids[l] = ids
        if c.top_k < c.experts:  # the routing gap: how close the (k+1)-th choice came
            gap = (top.values[:, c.top_k - 1] - top.values[:, c.top_k]).cpu()
            self.routing_gap = torch.minimum(self.routing_gap, gap)
        wts = s.gather(1, ids)
        if c.renorm:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        wts = wts * c.scaling
        sh = self.linear(situ_glu(self.linear(x, pre + "shared_experts.gate_proj.weight"),
                                  self.linear(x, pre + "shared_experts.up_proj.weight"), c.beta, c.beta_lin),
                         pre + "shared_experts.down_proj.weight")
        r = self.linear(x, pre + "routed_expert_down_proj.weight")
        out = torch.zeros(x.shape[0], c.latent, device=x.device)
        for b in range(x.shape[0]):
            for j in range(c.top_k):
                e = int(ids[b, j])
                h = situ_glu(r[b] @ self.expert(l, e, "w1").t(), r[b] @ self.expert(l, e, "w3").t(), c.beta, c.beta_lin)
                out[b] += wts[b, j] * (h @ self.expert(l, e, "w2").t())
        if c.latent_norm:
            out = rms_norm(out, self.W(pre + "routed_expert_norm.weight"), c.eps)
        return self.linear(out, pre + "routed_expert_up_proj.weight") + sh

    # ---- section 4: block attention residuals
    def mix(self, u, bank, proj, norm):
        rows = torch.stack(bank + [u], dim=1).float()  # [B, n+1, H]
        cw = self.W(norm) * self.W(proj).reshape(-1)
        s = (rows * cw).sum(-1) * torch.rsqrt(rows.pow(2).mean(-1) + self.cfg.eps)
        p = torch.softmax(s, dim=-1)
        return (p[..., None] * rows).sum(1)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Section 3: one decode step for `tokens` [B]; returns fp32 logits [B, V].
        Afterwards `routing_gap` [B] holds, per sequence, the smallest gap over
        the MoE layers between the k-th and (k+1)-th expert choice scores."""
        c = self.cfg
        self.routing_gap = torch.full((tokens.shape[0],), float("inf"))
        self.router_scores: dict[int, torch.Tensor] = {}  # per MoE layer, the selection scores [B, E]
        cvec = self.W("model.embed_tokens.weight")[tokens.to(self.dev)]
        P = None
        bank: list[torch.Tensor] = []
        for l in range(c.layers):
            pre = f"model.layers.{l}."
            u = cvec if P is None else P + cvec
            m = u if not bank else self.mix(u, bank, pre + "self_attention_res_proj.weight", pre + "self_attention_res_norm.weight")
            if l % c.block == 0:
                bank.append(u)
                P = None
            else:
                P = u
            x = rms_norm(m, self.W(pre + "input_layernorm.weight"), c.eps)
            a = self.mla(l, x) if c.is_mla(l) else self.kda(l, x)
            u = a if P is None else P + a
            m = self.mix(u, bank, pre + "mlp_res_proj.weight", pre + "mlp_res_norm.weight")
            P = u
            x = rms_norm(m, self.W(pre + "post_attention_layernorm.weight"), c.eps)
            cvec = self.dense(l, x) if l < c.first_dense else self.moe(l, x)
        u = P + cvec
        h = rms_norm(self.mix(u, bank, "model.output_attn_res_proj.weight", "model.output_attn_res_norm.weight"),
                     self.W("model.norm.weight"), c.eps)
        head = "model.embed_tokens.weight" if c.tied else "lm_head.weight"
        self.seq_len += 1
        return (h @ self.W(head).t()) * c.logit_scale

    @torch.no_grad()
    def step_with_noise(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """step(), and the router noise [B] at this step: the largest change of
        any expert's selection score, over the MoE layers, when the same step
        is taken from the same state with every projection's output rounded to
        bf16 (round_bf16, as an implementation storing bf16 activations)."""
        before = self.state()
        keep, self.round_bf16 = self.round_bf16, True
        self.step(tokens)
        rounded = self.router_scores
        self.restore(before)
        self.round_bf16 = keep
        out = self.step(tokens)
        return out, score_change(rounded, self.router_scores, tokens.shape[0])

    def twin(self) -> "K3Reference":
        """A second reference on the same weights (shared, not copied) and a copy of this one's
        state, keeping its state as the compiled programs do (round_state: bf16 KV cache rows
        and conv windows, fp32 activations and recurrent state). Stepped on the same tokens with
        `forced` set to this one's `expert_ids`, its distance from this reference is what the
        graph's storage dtypes alone do to the logits, the routing held equal: the noise floor
        of a teacher-forced comparison (routing near-ties are judged separately)."""
        other = copy.copy(self)
        other.restore(self.state())
        other.round_bf16, other.round_state, other.forced, other.expert_ids = False, True, None, {}
        return other

    def state(self) -> dict:
        return {"seq_len": self.seq_len, "kv": {k: v.clone() for k, v in self.kv.items()},
                "conv": {k: v.clone() for k, v in self.conv.items()}, "ssm": {k: v.clone() for k, v in self.ssm.items()}}

    def kernel_state(self, total_bytes: int) -> bytes:
        """This reference's state in the compiled runtime's save format (pack_state)."""
        return pack_state(self.cfg, self.batch, self.seq_len, self.kv, self.conv, self.ssm, total_bytes)

    def restore(self, s: dict) -> None:
        self.seq_len = s["seq_len"]
        self.kv = {k: v.clone() for k, v in s["kv"].items()}
        self.conv = {k: v.clone() for k, v in s["conv"].items()}
        self.ssm = {k: v.clone() for k, v in s["ssm"].items()}
