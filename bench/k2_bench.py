"""Benchmark on the H200: the megakernel against a PyTorch decode step of the
same DeepSeek-V3 / Kimi K2 model and weights, in one process.

The peer is the best PyTorch step we can write: merged projections
(q_a + kv_a, router + shared gate/up, gate/up), weight-absorbed MLA over the
latent cache, routed experts through `torch._grouped_mm`, the whole step
captured in a CUDA graph. Both run at the same positions over the same KV
cache contents (random, `--pos` tokens already in every sequence).

Reported per library (batch): time per step (median of CUDA-event timings),
tokens/s per user, bytes the step must move (weights read once, the distinct
routed experts this step selects, KV cache rows up to the position, the
activations ignored), the floor (bytes / measured HBM read bandwidth) and
each one's fraction of it. Also the two's next tokens and the logits'
relative L2 difference (bf16 peer against fp32-activation kernel: a sanity
check, not a correctness test; tests/gpu/ holds those).

With --fp8 (model_graphs/kimi_k2/bench_4l64e_fp8.json, K2's released format):
the checkpoint holds the decoder layers' linear weights as e4m3 codes with
128 x 128 block scales (powers of two, so that the dequantised values are
exact in bf16), the peer computes with their dequantised values in bf16
(PyTorch has no block-scaled FP8 grouped GEMM to call), and the floor counts
the bytes as stored.

    python3 bench/k2_bench.py --config model_graphs/kimi_k2/bench_4l64e.json \
        --lib target/models/kimi_k2_bench_h200/libkimi_k2_bench_h200.so [--lib ...b8...] --json OUT
    python3 bench/k2_bench.py --config model_graphs/kimi_k2/bench_4l64e_fp8.json --fp8 --lib ... --json OUT
"""

import argparse
import json
import math
import os
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "gpu"))
from mkc_runtime import Model  # noqa: E402
import fp8_checkpoint  # noqa: E402
from checkpoints import scratch_dir  # noqa: E402

BF = torch.bfloat16


def read_bandwidth():
    """HBM read bandwidth: a large bf16 sum, median of 20 (bytes / time)."""
    x = torch.randn(1 << 31, device="cuda", dtype=BF)  # 4 GiB
    for _ in range(3):
        x.sum()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        x.sum()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    bw = x.numel() * 2 / float(np.median(times))
    del x
    return bw


class Dims:
    def __init__(self, c):
        self.c = c
        self.vocab, self.hidden, self.layers = c["vocab_size"], c["hidden_size"], c["num_hidden_layers"]
        self.heads, self.q_lora, self.kv_lora = c["num_attention_heads"], c.get("q_lora_rank") or 0, c["kv_lora_rank"]
        self.nope, self.rope, self.v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        self.inter, self.moe_inter = c["intermediate_size"], c["moe_intermediate_size"]
        self.experts, self.top_k = c["n_routed_experts"], c["num_experts_per_tok"]
        self.shared = c.get("n_shared_experts") or 0
        self.n_group, self.topk_group = c.get("n_group") or 1, c.get("topk_group") or 1
        self.first_dense = c.get("first_k_dense_replace") or 0
        self.scale = c.get("routed_scaling_factor", 1.0)
        self.eps = c.get("rms_norm_eps", 1e-6)
        assert self.q_lora > 0, "the benchmark peer expects a q-LoRA (K2, V3)"

    def moe(self, layer):
        return layer >= self.first_dense


def make_weights(d, seed):
    """Random weights on the GPU, checkpoint-named; expert gate/up kept merged per layer for the peer."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def lin(*shape):
        return (torch.randn(shape, generator=g, device="cuda") / math.sqrt(shape[-1])).to(BF)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=g, device="cuda")).to(BF)

    w = {"model.embed_tokens.weight": torch.randn(d.vocab, d.hidden, generator=g, device="cuda").to(BF),
         "model.norm.weight": norm(d.hidden), "lm_head.weight": lin(d.vocab, d.hidden)}
    merged = {}
    qk = d.nope + d.rope
    for i in range(d.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(d.hidden)
        w[p + "post_attention_layernorm.weight"] = norm(d.hidden)
        a = p + "self_attn."
        w[a + "q_a_proj.weight"] = lin(d.q_lora, d.hidden)
        w[a + "q_a_layernorm.weight"] = norm(d.q_lora)
        w[a + "q_b_proj.weight"] = lin(d.heads * qk, d.q_lora)
        w[a + "kv_a_proj_with_mqa.weight"] = lin(d.kv_lora + d.rope, d.hidden)
        w[a + "kv_a_layernorm.weight"] = norm(d.kv_lora)
        w[a + "kv_b_proj.weight"] = lin(d.heads * (d.nope + d.v), d.kv_lora)
        w[a + "o_proj.weight"] = lin(d.hidden, d.heads * d.v)
        m = p + "mlp."
        if d.moe(i):
            w[m + "gate.weight"] = lin(d.experts, d.hidden)
            w[m + "gate.e_score_correction_bias"] = 0.1 * torch.randn(d.experts, generator=g, device="cuda")
            gu = lin(d.experts, 2 * d.moe_inter, d.hidden)
            dn = lin(d.experts, d.hidden, d.moe_inter)
            merged[i] = (gu, dn)
            for e in range(d.experts):
                w[m + f"experts.{e}.gate_proj.weight"] = gu[e, : d.moe_inter]
                w[m + f"experts.{e}.up_proj.weight"] = gu[e, d.moe_inter:]
                w[m + f"experts.{e}.down_proj.weight"] = dn[e]
            if d.shared:
                s = m + "shared_experts."
                w[s + "gate_proj.weight"] = lin(d.moe_inter * d.shared, d.hidden)
                w[s + "up_proj.weight"] = lin(d.moe_inter * d.shared, d.hidden)
                w[s + "down_proj.weight"] = lin(d.hidden, d.moe_inter * d.shared)
        else:
            w[m + "gate_proj.weight"] = lin(d.inter, d.hidden)
            w[m + "up_proj.weight"] = lin(d.inter, d.hidden)
            w[m + "down_proj.weight"] = lin(d.hidden, d.inter)
    return w, merged


def quantise_fp8(d, w, merged):
    """K2's released format: the decoder layers' linear weights as e4m3 codes with 128 x 128 block scales
    (tests/gpu/fp8_checkpoint.py). Returns the checkpoint's tensors; `w` and `merged` (the peer's weights)
    take their dequantised bf16 values, so both sides compute with the same weights: exactly, as the
    scales here are powers of two. With DeepSeek's amax / 448 scales the bf16 copies were up to 2^-9
    off the library's fp32 dequantisation, the suspected cause of the logits 0.39 apart at batch 1
    (a routing near-tie, gap 8.5e-4; not yet rerun). Arbitrary scales are checked against
    transformers in fp32 (tests/gpu). The experts are dequantised in place: their entries of `w` stay
    views of the peer's merged tensors (a second copy of the experts did not fit an 80 GB card beside
    the library)."""
    ckpt = {}
    for k in list(w):
        t = w[k]
        if fp8_checkpoint.is_fp8(k, t):
            codes, scale = fp8_checkpoint.quantise_tensor(t, pow2=True)
            ckpt[k], ckpt[k + "_scale_inv"] = codes, scale
            if ".experts." in k:
                t.copy_(fp8_checkpoint.dequantise_tensor(codes, scale).to(BF))
            else:
                w[k] = fp8_checkpoint.dequantise_tensor(codes, scale).to(BF)
        else:
            ckpt[k] = t
    return ckpt


def save_checkpoint(w, config, out, shard_bytes=4 << 30):
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    shards, cur, size = [], {}, 0
    for k in w:
        cur[k] = w[k]
        size += w[k].numel() * w[k].element_size()
        if size >= shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
    if cur:
        shards.append(cur)
    index = {"metadata": {}, "weight_map": {}}
    for i, sh in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous().cpu() for k, v in sh.items()}, os.path.join(out, name), metadata={"format": "pt"})
        for k in sh:
            index["weight_map"][k] = name
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)


def rope_table(d, ctx):
    """cos/sin [ctx, rope/2] as transformers computes them (default or DeepSeek YaRN)."""
    c = d.c
    rs = c.get("rope_scaling") or c.get("rope_parameters") or {}
    theta = c.get("rope_theta") or rs.get("rope_theta", 10000.0)
    dim = d.rope
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    kind = rs.get("type") or rs.get("rope_type") or "default"
    mscale = 1.0
    if kind == "yarn":
        factor, orig = rs["factor"], rs.get("original_max_position_embeddings", 4096)
        fast, slow = rs.get("beta_fast", 32.0), rs.get("beta_slow", 1.0)

        def corr(r):
            return dim * math.log(orig / (r * 2 * math.pi)) / (2 * math.log(theta))

        low, high = max(math.floor(corr(fast)), 0), min(math.ceil(corr(slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extra = 1 - ramp
        inv = (1 / (factor * pos_freqs)) * (1 - extra) + (1 / pos_freqs) * extra

        def ms(m):
            return 1.0 if m <= 0 else 0.1 * m * math.log(factor) + 1.0

        m, m_all = rs.get("mscale", 1.0), rs.get("mscale_all_dim", 0.0)
        mscale = ms(m) / ms(m_all) if m_all else ms(1.0)
    else:
        inv = 1 / pos_freqs
    ang = torch.arange(ctx, dtype=torch.float32)[:, None] * inv.float()[None, :]
    return (torch.cos(ang) * mscale).cuda(), (torch.sin(ang) * mscale).cuda()


def softmax_scale(d):
    c = d.c
    rs = c.get("rope_scaling") or {}
    scale = (d.nope + d.rope) ** -0.5
    if (rs.get("type") or rs.get("rope_type")) == "yarn" and rs.get("mscale_all_dim"):
        m = 0.1 * rs["mscale_all_dim"] * math.log(rs["factor"]) + 1.0
        scale *= m * m
    return scale


class CapturedStep:
    """A PyTorch decode step captured in a CUDA graph (the benchmarks' peers):
    a subclass defines `step()`, returning what `out` holds after a replay,
    and the fallback it takes when `torch._grouped_mm` fails (`grouped`)."""

    grouped = True
    graph = None

    def capture(self):
        try:
            self.step()
        except RuntimeError as e:  # torch._grouped_mm unavailable for these shapes: gather the experts
            print(f"peer: torch._grouped_mm failed ({str(e).splitlines()[0]}); gathering expert weights instead")
            self.grouped = False
            self.step()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                self.step()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.step()

    def time(self, n=100):
        for _ in range(10):
            self.graph.replay()
        times = []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self.graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return float(np.median(times))


class Peer(CapturedStep):
    """The PyTorch decode step (bf16 activations), captured in a CUDA graph."""

    def __init__(self, d, w, merged, batch, ctx, caches, pos):
        self.d, self.b, self.ctx = d, batch, ctx
        self.cos, self.sin = rope_table(d, ctx)
        self.scale = softmax_scale(d)
        self.layers = []
        for i in range(d.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            kvb = w[a + "kv_b_proj.weight"].view(d.heads, d.nope + d.v, d.kv_lora)
            L = {
                "n_in": w[p + "input_layernorm.weight"], "n_post": w[p + "post_attention_layernorm.weight"],
                "wa": torch.cat([w[a + "q_a_proj.weight"], w[a + "kv_a_proj_with_mqa.weight"]]),
                "n_qa": w[a + "q_a_layernorm.weight"], "wqb": w[a + "q_b_proj.weight"],
                "n_kva": w[a + "kv_a_layernorm.weight"],
                "w_uk": kvb[:, : d.nope].contiguous(), "w_uv": kvb[:, d.nope:].contiguous(),
                "wo": w[a + "o_proj.weight"], "cache": caches[i],
            }
            m = p + "mlp."
            if d.moe(i):
                # The router in fp32 (as the kernel's and the reference's): in bf16 its near-tied scores
                # would pick other experts than the kernel's at random.
                L["wg"] = w[m + "gate.weight"].float()
                if d.shared:
                    s = m + "shared_experts."
                    L["wr"] = torch.cat([w[s + "gate_proj.weight"], w[s + "up_proj.weight"]])
                    L["wsd"] = w[s + "down_proj.weight"]
                L["bias"] = w[m + "gate.e_score_correction_bias"].float()
                gu, dn = merged[i]
                L["gu_t"], L["dn_t"] = gu.transpose(1, 2), dn.transpose(1, 2)
            else:
                L["wgu"] = torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]])
                L["wd"] = w[m + "down_proj.weight"]
            self.layers.append(L)
        self.embed, self.n_f, self.lm = w["model.embed_tokens.weight"], w["model.norm.weight"], w["lm_head.weight"]
        self.tokens = torch.zeros(batch, dtype=torch.long, device="cuda")
        self.pos = torch.full((batch,), pos, dtype=torch.long, device="cuda")

    def rms(self, x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.d.eps)).to(BF) * w

    def rope(self, x):  # [..., rope], interleaved pairs; cos/sin at each sequence's position
        shape = x.shape
        x = x.float().reshape(self.b, -1, self.d.rope // 2, 2)
        c, s = self.cos[self.pos][:, None, :], self.sin[self.pos][:, None, :]
        a, b = x[..., 0], x[..., 1]
        return torch.stack([a * c - b * s, b * c + a * s], -1).reshape(shape).to(BF)

    def route(self, logits, bias):
        d = self.d
        scores = logits.sigmoid()
        choice = scores + bias
        if d.n_group > 1:
            gs = choice.view(self.b, d.n_group, -1).topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(gs).scatter_(1, gs.topk(d.topk_group, dim=-1)[1], 1)
            mask = keep.unsqueeze(-1).expand(self.b, d.n_group, d.experts // d.n_group).reshape(self.b, -1)
            choice = choice.masked_fill(mask == 0, 0.0)
        top = choice.topk(min(d.top_k + 1, d.experts), dim=-1)
        ids = top[1][:, : d.top_k]
        wts = scores.gather(1, ids)
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * d.scale
        # The routing gap: how far the last chosen expert's score is above the first one left out. Below
        # the router's rounding (bf16 here, fp32 in mkc) the two sides may choose differently.
        gap = (top[0][:, d.top_k - 1] - top[0][:, d.top_k]).min() if d.top_k < d.experts else top[0].new_tensor(1.0)
        return ids, wts, gap

    def experts(self, x, ids, wts, L):
        d = self.d
        flat = ids.flatten()
        if self.grouped:
            order = torch.argsort(flat)
            tok = order // d.top_k
            xs = x[tok]
            counts = torch.zeros(d.experts, dtype=torch.int32, device="cuda").index_add_(
                0, flat, torch.ones_like(flat, dtype=torch.int32))
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            gu = torch._grouped_mm(xs, L["gu_t"], offs)
            act = F.silu(gu[:, : d.moe_inter]) * gu[:, d.moe_inter:]
            y = torch._grouped_mm(act, L["dn_t"], offs)
            y = (y.float() * wts.flatten()[order, None]).to(BF)
            return torch.zeros(self.b, d.hidden, dtype=BF, device="cuda").index_add_(0, tok, y)
        gu = torch.bmm(L["gu_t"][flat].transpose(1, 2), x.repeat_interleave(d.top_k, 0)[:, :, None])[..., 0]
        act = F.silu(gu[:, : d.moe_inter]) * gu[:, d.moe_inter:]
        y = torch.bmm(L["dn_t"][flat].transpose(1, 2), act[:, :, None])[..., 0]
        return (y.float() * wts.flatten()[:, None]).view(self.b, d.top_k, -1).sum(1).to(BF)

    def step(self):
        d, b = self.d, self.b
        h = self.embed[self.tokens]
        ar = torch.arange(b, device="cuda")
        valid = torch.arange(self.ctx, device="cuda")[None, :] <= self.pos[:, None]
        for i, L in enumerate(self.layers):
            x = self.rms(h, L["n_in"])
            a = x @ L["wa"].T
            qa, kva = a[:, : d.q_lora], a[:, d.q_lora:]
            q = (self.rms(qa, L["n_qa"]) @ L["wqb"].T).view(b, d.heads, d.nope + d.rope)
            q_nope, q_pe = q[..., : d.nope], self.rope(q[..., d.nope:])
            ckv = self.rms(kva[:, : d.kv_lora], L["n_kva"])
            kpe = self.rope(kva[:, d.kv_lora:])
            cache = L["cache"]
            cache.index_put_((ar, self.pos), torch.cat([ckv, kpe], -1))
            q_lat = torch.einsum("bhn,hnc->bhc", q_nope, L["w_uk"])
            s = torch.bmm(q_lat, cache[:, :, : d.kv_lora].transpose(1, 2))
            s = s + torch.bmm(q_pe, cache[:, :, d.kv_lora:].transpose(1, 2))
            s = (s.float() * self.scale).masked_fill(~valid[:, None, :], float("-inf"))
            pr = torch.softmax(s, -1).to(BF)
            o_lat = torch.bmm(pr, cache[:, :, : d.kv_lora])
            o = torch.einsum("bhc,hvc->bhv", o_lat, L["w_uv"]).reshape(b, -1)
            h = h + o @ L["wo"].T
            x = self.rms(h, L["n_post"])
            if "wg" in L:
                ids, wts, L["gap"] = self.route(x.float() @ L["wg"].T, L["bias"])
                out = self.experts(x, ids, wts, L)
                if d.shared:
                    n = d.moe_inter * d.shared
                    r = x @ L["wr"].T
                    out = out + (F.silu(r[:, :n]) * r[:, n:]) @ L["wsd"].T
                L["ids"] = ids
            else:
                gu = x @ L["wgu"].T
                out = (F.silu(gu[:, : d.inter]) * gu[:, d.inter:]) @ L["wd"].T
            h = h + out
        logits = self.rms(h, self.n_f) @ self.lm.T
        return logits.float(), torch.argmax(logits, -1)


def step_bytes(d, w, ids_per_layer, batch, pos):
    """Bytes one step must move: every non-expert weight once, the distinct experts used, cache rows 0..pos.
    `w` as the checkpoint stores it (FP8 codes and their block scales counted as stored)."""
    total = 0
    for k, t in w.items():
        if ".experts." in k or k == "model.embed_tokens.weight":
            continue
        total += t.numel() * t.element_size()
    total += batch * d.hidden * 2  # embedding rows
    moe = next(i for i in range(d.layers) if d.moe(i))
    e0 = f"model.layers.{moe}.mlp.experts.0."
    per_expert = sum(t.numel() * t.element_size() for k, t in w.items() if k.startswith(e0))
    for ids in ids_per_layer:
        total += len(set(ids.flatten().tolist())) * per_expert
    total += d.layers * batch * (pos + 1) * (d.kv_lora + d.rope) * 2
    return total


def print_trace_summary(path):
    """Per stage of one profiled step: instructions, summed and longest
    instruction time, and the stage's span (first start to last end); where its
    tasks waited for weight pages (the trace's args.pages), their mean pages and
    the mean split of a task's time: staging its input (start to first page
    wait), waiting for that page, streaming its pages, and its epilogue (last
    page released to end)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    stages = {}
    parts = ("pages", "staged", "first_page", "streamed", "epilogue")
    for e in events:
        s = stages.setdefault(e["name"], {"n": 0, "busy": 0.0, "max": 0.0, "start": 1e30, "end": 0.0, "paged": 0,
                                          **{p: 0.0 for p in parts}})
        s["n"] += 1
        s["busy"] += e["dur"]
        s["max"] = max(s["max"], e["dur"])
        s["start"] = min(s["start"], e["ts"])
        s["end"] = max(s["end"], e["ts"] + e["dur"])
        args = e.get("args", {})
        if "pages" in args:
            s["paged"] += 1
            for p in parts:
                s[p] += args[p]
    total = max(s["end"] for s in stages.values())
    print(f"profile {os.path.basename(path)}: step span {total:.1f} us")
    print(f"  {'stage':40} {'n':>5} {'start us':>9} {'end us':>9} {'span us':>8} {'max us':>8} {'busy us':>9} "
          f"{'pages':>6} {'staged':>7} {'1st pg':>7} {'stream':>7} {'epilog':>7}")
    for name, s in sorted(stages.items(), key=lambda kv: kv[1]["start"]):
        split = "".join(f" {s[p] / s['paged']:>{6 if p == 'pages' else 7}.1f}" for p in parts) if s["paged"] else ""
        print(f"  {name[:40]:40} {s['n']:>5} {s['start']:>9.1f} {s['end']:>9.1f} {s['end'] - s['start']:>8.1f} "
              f"{s['max']:>8.1f} {s['busy']:>9.1f}{split}")


def report(config, bw, rows, json_path):
    """The JSON report (with the GPU, the date and the read bandwidth) and the table."""
    out = {"config": config, "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
           "read_bandwidth_TBps": bw / 1e12, "rows": rows}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    print_table(rows)


def print_table(rows):
    """The benchmarks' last lines: a row per library."""
    print(f"{'library':36} {'B':>2} {'T':>2} {'mkc ms':>8} {'peer ms':>8} {'floor ms':>8} {'mkc %floor':>10} "
          f"{'peer %floor':>11} {'mkc tok/s/u':>11} {'rel L2':>8} {'route gap':>9} next=")
    for r in rows:
        # Where the peer's router parted from the kernel's at a near-tie: the peer on the kernel's routing.
        same = r.get("logits_rel_l2_vs_peer_same_routing")
        print(f"{r['lib']:36} {r['batch']:>2} {r.get('positions', 1):>2} {r['mkc_ms']:>8.3f} {r['peer_ms']:>8.3f} "
              f"{r['floor_ms']:>8.3f} "
              f"{100 * r['mkc_floor_fraction']:>9.1f}% {100 * r['peer_floor_fraction']:>10.1f}% "
              f"{r['mkc_tokens_per_s_per_user']:>11.1f} {r['logits_rel_l2_vs_peer']:>8.2e} "
              f"{r.get('routing_gap_min', float('nan')):>9.1e} {r['next_equal']}"
              + ("" if same is None else f"  (routing parted in {r['rows_routed_apart']} rows; the peer on "
                                         f"mkc's routing: rel L2 {same:.2e}, next= {r['next_equal_same_routing']})"))


def measure(model, lib, state, tokens, trace):
    """The megakernel from `state`: one step's next tokens and logits, then
    milliseconds per step twice (back to back at the same position), then
    (with a trace folder) one profiled step and its per-stage table; closes
    the model. Returns (next, logits, ms, ms_repeat, routes): routes the
    step's expert ids [routers, rows, top_k] (Model.routing), or None."""
    model.load_state(state)
    if getattr(model, "positions", 1) > 1:  # a verify step: every row's choice and logits
        _, _, nxt, logits = model.verify(tokens)
        nxt, logits = nxt.reshape(-1), logits.reshape(model.batch, -1)
    else:
        nxt, logits = model.step(tokens)
    routes = model.routing() if getattr(model, "router_top_k", 0) else None
    model.load_state(state)  # time at the same position
    ms = model.time_steps(tokens, warmup=10, n=100)
    ms2 = model.time_steps(tokens, warmup=5, n=100)
    if trace:
        os.makedirs(trace, exist_ok=True)
        # Named by the library's folder and file: a baseline's library has the same file name.
        folder = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(lib))))
        path = os.path.join(trace, f"{folder}_" + os.path.basename(lib).replace(".so", ".trace.json"))
        model.load_state(state)
        model.profile_step(tokens, path)
        print_trace_summary(path)
    model.close()
    return nxt, logits, ms, ms2, routes


def result_row(lib, batch, pos, load_s, mkc_ms, mkc_ms_repeat, peer, peer_ms, nbytes, bw, nxt, p_next, rel, gap=None,
               positions=1):
    """One library's measurement, as the JSON report and print_table have it (`positions` T > 1: a verify
    step of batch / T sequences of T positions)."""
    floor_ms = nbytes / bw * 1e3
    return {
        "lib": os.path.basename(lib), "batch": batch, "positions": positions, "pos": pos, "load_s": round(load_s, 1),
        "mkc_ms": mkc_ms, "mkc_ms_repeat": mkc_ms_repeat, "peer_ms": peer_ms, "peer_grouped_mm": peer.grouped,
        "bytes": nbytes, "floor_ms": floor_ms, "mkc_floor_fraction": floor_ms / mkc_ms,
        "peer_floor_fraction": floor_ms / peer_ms, "mkc_tokens_per_s_per_user": 1e3 / mkc_ms,
        "peer_tokens_per_s_per_user": 1e3 / peer_ms,
        "next_equal": bool((torch.from_numpy(nxt).cuda() == p_next).all()), "logits_rel_l2_vs_peer": rel,
        "routing_gap_min": gap,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--lib", action="append", required=True, help="one per batch size, built from this config")
    ap.add_argument("--pos", type=int, default=4000)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--trace", help="folder: one profiled step per library as Chrome trace JSON, and a per-stage table")
    ap.add_argument("--fp8", action="store_true",
                    help="the libraries load K2's released FP8 format (a config with its quantization_config); the "
                         "peer computes with the dequantised weights in bf16, the floor counts the FP8 bytes")
    args = ap.parse_args()
    with open(args.config) as f:
        config = json.load(f)
    if args.fp8 != ("quantization_config" in config):
        sys.exit(f"{args.config}: --fp8 needs a config with a quantization_config, and such a config needs --fp8")
    d = Dims(config)
    bw = read_bandwidth()
    w, merged = make_weights(d, args.seed)
    ckpt = quantise_fp8(d, w, merged) if args.fp8 else w
    work = scratch_dir("mkc_bench_")
    t0 = time.time()
    save_checkpoint(ckpt, config, os.path.join(work, "ckpt"))
    # Only the sizes are needed from here on (step_bytes): the FP8 codes leave the GPU.
    ckpt = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in ckpt.items()}
    torch.cuda.empty_cache()
    print(f"checkpoint written in {time.time() - t0:.1f} s; HBM read bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for lib in args.lib:
        t0 = time.time()
        model = Model(lib, os.path.join(work, "ckpt"))
        load_s = time.time() - t0
        b = model.batch
        g = torch.Generator(device="cuda").manual_seed(args.seed + 1)
        caches = [torch.randn(b, args.ctx, d.kv_lora + d.rope, generator=g, device="cuda").to(BF) for _ in range(d.layers)]
        state = np.concatenate([np.full(b, args.pos, dtype=np.int32).view(np.uint8)]
                               + [c.cpu().view(torch.int16).numpy().view(np.uint8).ravel() for c in caches])
        tokens = torch.randint(0, d.vocab, (b,), generator=g, device="cuda")
        nxt, logits, ours_ms, ours_ms2, _ = measure(model, lib, state, tokens.cpu().numpy(), args.trace)
        peer = Peer(d, w, merged, b, args.ctx, caches, args.pos)
        peer.tokens.copy_(tokens)
        peer.capture()
        peer.graph.replay()
        torch.cuda.synchronize()
        # Copies: timing replays the graph, which rewrites its outputs (and, in K3, steps the recurrent state on).
        p_logits, p_next = (x.clone() for x in peer.out)
        rel = float((torch.from_numpy(logits).cuda() - p_logits).norm() / p_logits.norm())
        ids = [L["ids"].cpu() for L in peer.layers if "ids" in L]
        gap = min((float(L["gap"]) for L in peer.layers if "gap" in L), default=float("inf"))
        peer_ms = peer.time()
        nbytes = step_bytes(d, ckpt, ids, b, args.pos)
        rows.append(result_row(lib, b, args.pos, load_s, ours_ms, ours_ms2, peer, peer_ms, nbytes, bw, nxt, p_next, rel,
                               gap))
        del peer, caches
        torch.cuda.empty_cache()
    shutil.rmtree(work, ignore_errors=True)
    report(args.config, bw, rows, args.json)


if __name__ == "__main__":
    main()
