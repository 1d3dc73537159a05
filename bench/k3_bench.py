"""Benchmark on the H200: the K3 megakernel against a PyTorch decode step of the
same Kimi K3 model and weights, in one process.

The weights are a random K3 checkpoint in K3's naming with MXFP4 routed
experts (tests/gpu/make_k3_checkpoint.py); both load it. The peer is the best
PyTorch step we can write: merged projections (KDA's q/k/v/g/f_a/b, MLA's
q_a/kv_a/gate, the shared gate/up with the latent down; the router in fp32), the
KDA recurrence in fp32 in place, weight-absorbed MLA over the latent cache,
routed experts through `torch._grouped_mm` on bf16 copies of the experts
(the H200 has no FP4 math; dequantising the chosen experts every step would
cost more than reading the bf16 copies), the whole step captured in a CUDA
graph. Both start from the same state: `--pos` random rows in every MLA
cache, random KDA conv windows and recurrent state.

Reported per library: time per step (median of CUDA-event timings), tokens/s
per user, the bytes the step must move (every non-expert weight once, the
distinct routed experts this step selects in MXFP4, the KV rows up to the
position, the KDA state read and written), the floor (bytes / measured HBM
read bandwidth) and each one's fraction of it; the two's next tokens and the
logits' relative L2 difference from the same state (a sanity check: the
correctness tests are in tests/gpu/).

    python3 bench/k3_bench.py --config model_graphs/kimi_k3/test_8l96e.json \\
        --lib target/models/kimi_k3_dims_8l96e_h200/libkimi_k3_dims_8l96e_h200.so --json OUT [--trace DIR]

A verify library (`mkc codegen --positions T`) is timed as a verify step of its sequences' T positions
(the step and its commit, at the same positions) against the peer verifying the same T positions (its
MLA one pass over a sequence's cache for all T, KDA's recurrence and conv windows through them in order).
"""

import argparse
import os
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "gpu"))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
from k2_bench import CapturedStep, measure, read_bandwidth, report, result_row  # noqa: E402
from k3_reference import Config, load_checkpoint, mxfp4_dequant, pack_state, state_context  # noqa: E402
from make_k3_checkpoint import PREFIX, make  # noqa: E402
from mkc_runtime import Model  # noqa: E402
from checkpoints import scratch_dir  # noqa: E402

BF = torch.bfloat16


def situ(gate, up, c):
    """SiTU-GLU in fp32 (spec section 2)."""
    gate, up = gate.float(), up.float()
    g = c.beta * torch.tanh(gate / c.beta) * torch.sigmoid(gate)
    return g * (up if c.beta_lin is None else c.beta_lin * torch.tanh(up / c.beta_lin))


class Peer(CapturedStep):
    """The PyTorch K3 decode step (bf16 activations, fp32 where the spec
    keeps fp32), captured in a CUDA graph. `state` holds its KV caches, conv
    windows and recurrent state, which the step updates in place. `forced`: per MoE layer, expert ids
    [rows, top_k] to take instead of its own top-k (tests/gpu/k3_rows.py routes it as the reference did:
    with bf16 activations its router scores sit some 1e-3 to 1e-2 from the fp32 reference's, and a
    near-tie at that scale picks other experts, which moves that row's logits by tenths)."""

    forced = None

    def __init__(self, c, w, batch, ctx, pos, state, positions=1):
        # A verify step (positions T > 1): batch rows, batch / T sequences of T consecutive positions from
        # `pos`, causal among them; the state is the sequences' (and takes all T positions).
        self.c, self.b, self.ctx, self.t, self.seqs = c, batch, ctx, positions, batch // positions
        self.kv, self.conv, self.ssm = state
        h, d, p = c.kda_heads, c.kda_dim, c.kda_heads * c.kda_dim
        self.layers = []
        for l in range(c.layers):
            pre = f"model.layers.{l}."
            a, m = pre + "self_attn.", pre + "mlp."
            L = {"n_in": w[pre + "input_layernorm.weight"], "n_post": w[pre + "post_attention_layernorm.weight"],
                 "cw_attn": (w[pre + "self_attention_res_norm.weight"].float()
                             * w[pre + "self_attention_res_proj.weight"].float().reshape(-1)),
                 "cw_mlp": w[pre + "mlp_res_norm.weight"].float() * w[pre + "mlp_res_proj.weight"].float().reshape(-1),
                 "mla": c.is_mla(l), "dense": l < c.first_dense, "wo": w[a + "o_proj.weight"]}
            if L["mla"]:
                kvb = w[a + "kv_b_proj.weight"].view(c.heads, c.nope + c.v_dim, c.kv_lora)
                L.update(w_in=torch.cat([w[a + "q_a_proj.weight"], w[a + "kv_a_proj_with_mqa.weight"],
                                         w[a + "g_proj.weight"]]),
                         n_qa=w[a + "q_a_layernorm.weight"], wqb=w[a + "q_b_proj.weight"],
                         n_kva=w[a + "kv_a_layernorm.weight"], w_uk=kvb[:, : c.nope].contiguous(),
                         w_uv=kvb[:, c.nope:].contiguous())
            else:
                L.update(w_in=torch.cat([w[a + n + "_proj.weight"] for n in ("q", "k", "v", "g", "f_a", "b")]),
                         wconv=torch.cat([w[a + n + "_conv1d.weight"].squeeze(1) for n in ("q", "k", "v")]).t().float(),
                         f_b=w[a + "f_b_proj.weight"], a=torch.exp(w[a + "A_log"].float().reshape(-1)[:h])[None, :, None],
                         dt=w[a + "dt_bias"].float().reshape(1, h, d), o_norm=w[a + "o_norm.weight"].float())
            if L["dense"]:
                L.update(w_gu=torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]), w_d=w[m + "down_proj.weight"])
            else:
                s = m + "shared_experts."
                L.update(w_gate=w[m + "gate.weight"].float(),
                         w_moe=torch.cat([w[s + "gate_proj.weight"], w[s + "up_proj.weight"],
                                          w[m + "routed_expert_down_proj.weight"]]),
                         bias=w[m + "gate.e_score_correction_bias"].float(), w_sd=w[s + "down_proj.weight"],
                         n_lat=w[m + "routed_expert_norm.weight"], w_up=w[m + "routed_expert_up_proj.weight"],
                         gu_t=w["experts_gu_t", l], dn_t=w["experts_dn_t", l])
            self.layers.append(L)
        self.embed, self.n_f = w["model.embed_tokens.weight"], w["model.norm.weight"]
        self.lm = w["model.embed_tokens.weight"] if c.tied else w["lm_head.weight"]
        self.cw_out = w["model.output_attn_res_norm.weight"].float() * w["model.output_attn_res_proj.weight"].float().reshape(-1)
        self.tokens = torch.zeros(batch, dtype=torch.long, device="cuda")
        self.pos = pos + torch.arange(batch, device="cuda") % positions  # each row's position
        self.seq = torch.arange(batch, device="cuda") // positions  # each row's sequence
        self.valid = torch.arange(ctx, device="cuda")[None, :] <= self.pos[:, None]
        self.ids = {}
        self.gaps = {}

    def rms(self, x, w, eps=None):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + (self.c.eps if eps is None else eps))).to(BF) * w

    def mix(self, u, bank, cw):
        rows = torch.stack(bank + [u], 1).float()  # [B, n + 1, H]
        s = (rows @ cw) * torch.rsqrt(rows.pow(2).mean(-1) + self.c.eps)
        return (torch.softmax(s, -1)[..., None] * rows).sum(1).to(BF)

    def kda(self, l, x, L):
        c, b = self.c, self.b
        h, d = c.kda_heads, c.kda_dim
        p = h * d
        y = x @ L["w_in"].T
        z, gate_in, fa, braw = y[:, : 3 * p], y[:, 3 * p: 4 * p], y[:, 4 * p: 4 * p + d], y[:, 4 * p + d:]
        st = self.conv[l]  # [sequences, W-1, 3P] bf16, oldest first
        # Each sequence's window through its T positions: the state's rows, then the positions.
        full = torch.cat([st, z.view(self.seqs, self.t, 3 * p)], 1)  # [sequences, W-1+T, 3P]
        win = full.unfold(1, st.shape[1] + 1, 1)  # [sequences, T, 3P, W]
        conv = F.silu((win.float() * L["wconv"].t()[None, None]).sum(-1)).reshape(b, 3 * p)
        st.copy_(full[:, self.t:])
        q, k, v = (t.reshape(b, h, d) for t in conv.split(p, -1))
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * d ** -0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        f = (fa @ L["f_b"].T).float().view(b, h, d)
        if c.lower_bound is not None:
            g = c.lower_bound * torch.sigmoid(L["a"] * (f + L["dt"]))
        else:
            g = -L["a"] * F.softplus(f + L["dt"], threshold=20.0)
        beta = torch.sigmoid(braw.float())
        S = self.ssm[l]  # [sequences, h, d (v), d (k)] fp32
        outs = []
        for t in range(self.t):  # a sequence's positions in order
            rows = slice(t, None, self.t)
            S.mul_(torch.exp(g[rows])[:, :, None, :])
            u = beta[rows][..., None] * (v[rows] - torch.einsum("bhvk,bhk->bhv", S, k[rows]))
            S.add_(u[..., :, None] * k[rows][..., None, :])
            outs.append(torch.einsum("bhvk,bhk->bhv", S, q[rows]))
        o = torch.stack(outs, 1).reshape(b, h, d)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * L["o_norm"]
        o = o * torch.sigmoid(gate_in.float().view(b, h, d))
        return o.reshape(b, p).to(BF) @ L["wo"].T

    def mla(self, l, x, L):
        c, b = self.c, self.b
        y = x @ L["w_in"].T
        qa, kva, gg = y[:, : c.q_lora], y[:, c.q_lora: c.q_lora + c.kv_lora + c.rope], y[:, c.q_lora + c.kv_lora + c.rope:]
        q = (self.rms(qa, L["n_qa"]) @ L["wqb"].T).view(b, c.heads, c.nope + c.rope)
        q_nope, q_pe = q[..., : c.nope], q[..., c.nope:]
        ckv = self.rms(kva[:, : c.kv_lora], L["n_kva"])
        cache = self.kv[l]  # [sequences, ctx, c + rope]
        cache.index_put_((self.seq, self.pos), torch.cat([ckv, kva[:, c.kv_lora:]], -1))
        q_lat = torch.einsum("bhn,hnc->bhc", q_nope, L["w_uk"])
        # A sequence's T positions' heads against its cache in one pass, each row masked at its position.
        n, hh = self.seqs, self.t * c.heads
        s = torch.bmm(q_lat.reshape(n, hh, c.kv_lora), cache[:, :, : c.kv_lora].transpose(1, 2))
        s = s + torch.bmm(q_pe.reshape(n, hh, c.rope), cache[:, :, c.kv_lora:].transpose(1, 2))
        s = s.view(b, c.heads, -1)
        s = (s.float() * (c.nope + c.rope) ** -0.5).masked_fill(~self.valid[:, None, :], float("-inf"))
        o_lat = torch.bmm(torch.softmax(s, -1).to(BF).view(n, hh, -1), cache[:, :, : c.kv_lora]).view(b, c.heads, -1)
        o = torch.einsum("bhc,hvc->bhv", o_lat, L["w_uv"]).reshape(b, -1)
        return (o.float() * torch.sigmoid(gg.float())).to(BF) @ L["wo"].T

    def moe(self, l, x, L):
        c, b = self.c, self.b
        sh = c.moe_inter * c.shared
        r = x @ L["w_moe"].T
        sg, su, z = r[:, :sh], r[:, sh: 2 * sh], r[:, 2 * sh:]
        # The router in fp32 (as the kernel's and the reference's): in bf16 its
        # near-tied scores would pick other experts than the kernel at random.
        scores = torch.sigmoid(x.float() @ L["w_gate"].T)
        top = (scores + L["bias"]).topk(c.top_k + 1, dim=-1)  # num_expert_group 1 in K3
        ids = top[1][:, : c.top_k] if self.forced is None else self.forced[l]
        # The routing gap (k2_bench.Peer.route): a near-tie explains a difference in the logits.
        self.gaps[l] = (top[0][:, c.top_k - 1] - top[0][:, c.top_k]).min()
        wts = scores.gather(1, ids)
        if c.renorm:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        wts = wts * c.scaling
        self.ids[l] = ids
        flat = ids.flatten()
        if self.grouped:
            order = torch.argsort(flat)
            tok = order // c.top_k
            counts = torch.zeros(c.experts, dtype=torch.int32, device="cuda").index_add_(
                0, flat, torch.ones_like(flat, dtype=torch.int32))
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            gu = torch._grouped_mm(z[tok], L["gu_t"], offs)
            act = situ(gu[:, : c.moe_inter], gu[:, c.moe_inter:], c).to(BF)
            y = torch._grouped_mm(act, L["dn_t"], offs).float() * wts.flatten()[order, None]
            out = torch.zeros(b, c.latent, device="cuda").index_add_(0, tok, y)
        else:
            zz = z.repeat_interleave(c.top_k, 0)[:, :, None]
            gu = torch.bmm(L["gu_t"][flat].transpose(1, 2), zz)[..., 0]
            act = situ(gu[:, : c.moe_inter], gu[:, c.moe_inter:], c).to(BF)
            y = torch.bmm(L["dn_t"][flat].transpose(1, 2), act[:, :, None])[..., 0].float()
            out = (y * wts.flatten()[:, None]).view(b, c.top_k, -1).sum(1)
        if c.latent_norm:
            out = self.rms(out, L["n_lat"])
        out = out.to(BF) @ L["w_up"].T
        return out + situ(sg, su, c).to(BF) @ L["w_sd"].T

    def step(self):
        c = self.c
        cvec = self.embed[self.tokens]
        bank, P = [], None
        for l, L in enumerate(self.layers):
            u = cvec if P is None else P + cvec
            m = u if not bank else self.mix(u, bank, L["cw_attn"])
            if l % c.block == 0:
                bank.append(u)
                P = None
            else:
                P = u
            x = self.rms(m, L["n_in"])
            a = self.mla(l, x, L) if L["mla"] else self.kda(l, x, L)
            u = a if P is None else P + a
            m = self.mix(u, bank, L["cw_mlp"])
            P = u
            x = self.rms(m, L["n_post"])
            if L["dense"]:
                gu = x @ L["w_gu"].T
                cvec = situ(gu[:, : c.inter], gu[:, c.inter:], c).to(BF) @ L["w_d"].T
            else:
                cvec = self.moe(l, x, L)
        h = self.rms(self.mix(P + cvec, bank, self.cw_out), self.n_f)
        logits = (h @ self.lm.T).float() * c.logit_scale
        return logits, torch.argmax(logits, -1)


def reset(state, first):
    """The peer's state (kv, conv, ssm dicts) back to `first`'s values, in place."""
    for mine, want in zip(state, first):
        for l in mine:
            mine[l].copy_(want[l])


def check_grouped(peer, state, first):
    """The peer's routed experts through torch._grouped_mm against the same experts gathered (bmm), one eager
    step each from `first`: where they part (more than 1e-2 relative L2), the peer gathers, and says so."""
    with torch.no_grad():
        try:
            grouped = peer.step()[0].clone()
        except RuntimeError:  # unavailable for these shapes: CapturedStep.capture says so and gathers
            reset(state, first)
            return
        reset(state, first)
        peer.grouped = False
        gathered = peer.step()[0]
        reset(state, first)
    rel = float((grouped - gathered).norm() / gathered.norm())
    peer.grouped = rel <= 1e-2
    if not peer.grouped:
        print(f"peer: torch._grouped_mm parts from the gathered experts ({rel:.2e} relative L2); gathering instead",
              flush=True)


def peer_weights(c, raw):
    """The checkpoint's tensors on the GPU (prefix dropped), with each MoE
    layer's MXFP4 experts dequantised to bf16 and stacked for _grouped_mm:
    gate/up as [E, latent, 2 I] and down as [E, I, latent] (transposed views)."""
    w = {k[len(PREFIX):] if k.startswith(PREFIX) else k: v for k, v in raw.items() if ".experts." not in k}
    w = {k: v.cuda() for k, v in w.items()}
    for l in range(c.first_dense, c.layers):
        pre = f"{PREFIX}model.layers.{l}.mlp.experts."

        def expert(e, name):
            key = f"{pre}{e}.{name}."
            if key + "weight_packed" in raw:
                return mxfp4_dequant(raw[key + "weight_packed"].cuda(), raw[key + "weight_scale"].cuda()).to(BF)
            return raw[key + "weight"].cuda()

        # Stacked as stored ([E, 2I, latent], [E, latent, I]) and read transposed, as _grouped_mm wants them.
        w["experts_gu_t", l] = torch.stack([torch.cat([expert(e, "w1"), expert(e, "w3")]) for e in range(c.experts)]
                                           ).transpose(1, 2)
        w["experts_dn_t", l] = torch.stack([expert(e, "w2") for e in range(c.experts)]).transpose(1, 2)
    return w


def step_bytes(c, raw, ids, batch, pos):
    """Bytes one step must move: every non-expert weight once (the embedding:
    its rows), the distinct routed experts used (as stored: MXFP4 codes and
    scales), KV cache rows 0..pos, the KDA conv windows and recurrent state
    read and written; `batch` sequences (a verify step's rows share theirs)."""
    total = 0
    for k, t in raw.items():
        if ".experts." in k or k.endswith("model.embed_tokens.weight"):
            continue
        total += t.numel() * t.element_size()
    total += batch * c.hidden * 2
    for l, chosen in ids.items():
        pre = f"{PREFIX}model.layers.{l}.mlp.experts."
        for e in set(chosen.flatten().tolist()):
            total += sum(t.numel() * t.element_size() for k, t in raw.items() if k.startswith(f"{pre}{e}."))
    p = c.kda_heads * c.kda_dim
    for l in range(c.layers):
        if c.is_mla(l):
            total += batch * (pos + 1) * (c.kv_lora + c.rope) * 2
        else:
            total += 2 * batch * (c.kda_heads * c.kda_dim * c.kda_dim * 4 + (c.conv - 1) * 3 * p * 2)
    return total


def random_state(c, batch, ctx, pos, seed):
    """MLA caches with `pos` random rows, random KDA conv windows and recurrent state."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    p = c.kda_heads * c.kda_dim
    kv, conv, ssm = {}, {}, {}
    for l in range(c.layers):
        if c.is_mla(l):
            kv[l] = torch.zeros(batch, ctx, c.kv_lora + c.rope, dtype=BF, device="cuda")
            kv[l][:, :pos] = torch.randn(batch, pos, c.kv_lora + c.rope, generator=g, device="cuda").to(BF)
        else:
            conv[l] = torch.randn(batch, c.conv - 1, 3 * p, generator=g, device="cuda").to(BF)
            ssm[l] = 0.1 * torch.randn(batch, c.kda_heads, c.kda_dim, c.kda_dim, generator=g, device="cuda")
    return kv, conv, ssm


def routed_apart(routes, ids):
    """The rows whose experts differ between the kernel's routing `routes` [routers, rows, top_k] and the
    peer's `ids` (per MoE layer [rows, top_k], the routers in layer order): how many, 0 where either is
    missing."""
    if routes is None or len(routes) != len(ids):
        return 0
    rows = set()
    for i, l in enumerate(sorted(ids)):
        theirs = ids[l].tolist()
        rows |= {r for r, mine in enumerate(routes[i].tolist()) if set(mine) != set(theirs[r])}
    return len(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--lib", action="append", required=True, help="one per batch size, built from this config")
    ap.add_argument("--pos", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--trace", help="folder: one profiled step per library as Chrome trace JSON, and a per-stage table")
    args = ap.parse_args()
    c = Config.load(args.config)
    bw = read_bandwidth()
    work = scratch_dir("mkc_k3_bench_")
    ckpt = os.path.join(work, "ckpt")
    t0 = time.time()
    make(args.config, ckpt, True, args.seed)
    raw = load_checkpoint(ckpt)
    w = peer_weights(c, raw)
    print(f"checkpoint written and loaded in {time.time() - t0:.1f} s; HBM read bandwidth {bw / 1e12:.2f} TB/s",
          flush=True)
    rows = []
    for lib in args.lib:
        t0 = time.time()
        model = Model(lib, ckpt)
        load_s = time.time() - t0
        # Rows b: a verify program's (positions T > 1) are b / T sequences of T positions, whose state is
        # the sequences'.
        b, t = model.batch, getattr(model, "positions", 1)
        seqs = b // t
        ctx = state_context(c, seqs, model.state_bytes)
        kv0, conv0, ssm0 = random_state(c, seqs, ctx, args.pos, args.seed + 1)
        state = np.frombuffer(pack_state(c, seqs, args.pos, kv0, conv0, ssm0, model.state_bytes), dtype=np.uint8)
        g = torch.Generator(device="cuda").manual_seed(args.seed + 2)
        tokens = torch.randint(0, c.vocab, (b,), generator=g, device="cuda")
        nxt, logits, ours_ms, ours_ms2, routes = measure(model, lib, state, tokens.cpu().numpy(), args.trace)
        st = ({l: t.clone() for l, t in kv0.items()}, {l: t.clone() for l, t in conv0.items()},
              {l: t.clone() for l, t in ssm0.items()})
        peer = Peer(c, w, b, ctx, args.pos, st, t)
        peer.tokens.copy_(tokens)
        check_grouped(peer, st, (kv0, conv0, ssm0))
        peer.capture()
        reset(st, (kv0, conv0, ssm0))  # capturing ran steps: back to the same state
        peer.graph.replay()
        torch.cuda.synchronize()
        # Copies: timing replays the graph, which rewrites its outputs (and, in K3, steps the recurrent state on).
        p_logits, p_next = (x.clone() for x in peer.out)
        rel = float((torch.from_numpy(logits).cuda() - p_logits).norm() / p_logits.norm())
        ids = {l: t.cpu() for l, t in peer.ids.items()}
        gap = min((float(g) for g in peer.gaps.values()), default=float("inf"))
        apart, same = routed_apart(routes, ids), None
        if apart:
            # The peer's bf16 router parted from the kernel's fp32 one at a near-tie (a tenth of the logits
            # moves with it): the peer again, eagerly, on the kernel's routing.
            reset(st, (kv0, conv0, ssm0))
            peer.forced = {l: torch.from_numpy(routes[i]).long().cuda() for i, l in enumerate(sorted(ids))}
            with torch.no_grad():
                f_logits = peer.step()[0].float()
            peer.forced = None
            same = (float((torch.from_numpy(logits).cuda() - f_logits).norm() / f_logits.norm()),
                    bool((torch.from_numpy(nxt).cuda() == f_logits.argmax(-1)).all()))
        peer_ms = peer.time()
        if t > 1:
            # The peer's verify against its own single steps through the same positions (one row of each
            # sequence a step), from the same state; and ours against those steps.
            st1 = ({l: x.clone() for l, x in kv0.items()}, {l: x.clone() for l, x in conv0.items()},
                   {l: x.clone() for l, x in ssm0.items()})
            single = Peer(c, w, seqs, ctx, args.pos, st1)
            single.grouped = peer.grouped
            steps = []
            for i in range(t):
                single.pos.fill_(args.pos + i)
                single.valid = torch.arange(ctx, device="cuda")[None, :] <= single.pos[:, None]
                single.tokens.copy_(tokens.view(seqs, t)[:, i])
                with torch.no_grad():
                    steps.append(single.step()[0])
            seq_logits = torch.stack(steps, 1).reshape(b, -1)
            ours = torch.from_numpy(logits).cuda()
            print(f"{os.path.basename(lib)}: logits rel L2 against the peer's single steps: peer's verify "
                  f"{float((p_logits - seq_logits).norm() / seq_logits.norm()):.2e}, mkc's verify "
                  f"{float((ours - seq_logits).norm() / seq_logits.norm()):.2e}", flush=True)
            del single, st1
        nbytes = step_bytes(c, raw, ids, seqs, args.pos)
        rows.append(result_row(lib, b, args.pos, load_s, ours_ms, ours_ms2, peer, peer_ms, nbytes, bw, nxt, p_next, rel,
                               gap, t))
        if same is not None:
            rows[-1].update(rows_routed_apart=apart, logits_rel_l2_vs_peer_same_routing=same[0],
                            next_equal_same_routing=same[1])
        del peer, st, kv0, conv0, ssm0
        torch.cuda.empty_cache()
    shutil.rmtree(work, ignore_errors=True)
    report(args.config, bw, rows, args.json)


if __name__ == "__main__":
    main()
