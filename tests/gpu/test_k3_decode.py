"""The K3 comparison harness (k3_decode.py) run against stand-ins for the compiled library, on
the CPU: it passes a model that computes K3 with bf16 activations, and fails models that are
wrong in the ways a kernel can be (a router that picks another expert away from a near-tie, a
layer's output off by a percent, a state restore that loses the recurrent state).

    python3 -m pytest tests/gpu/test_k3_decode.py      (needs torch, safetensors, pytest)
"""

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import k3_decode  # noqa: E402
from k3_reference import Config, K3Reference, pack_state, unpack_state  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "model_graphs", "kimi_k3", "tiny.json")
CTX = 24


class StandIn:
    """mkc_runtime.Model's methods over the K3 reference, its state kept in the runtime's save
    format (bf16 KV caches and conv windows), restored from it before every step of the
    comparison: as the compiled programs compute K3."""

    def __init__(self, ckpt, batch=1, fault=None):
        self.ref = K3Reference(ckpt, batch=batch, max_ctx=CTX, round_state=True)
        self.c = Config.load(os.path.join(ckpt, "config.json"))
        self.batch, self.vocab, self.fault = batch, self.c.vocab, fault
        self.state_bytes = len(self._bytes())
        self.routers = sum(1 for l in range(self.c.layers) if l >= self.c.first_dense)
        self.router_top_k = self.c.top_k

    def _bytes(self):
        """The state in the runtime's format, its KV caches CTX rows long."""
        r, c, b = self.ref, self.c, self.batch
        p = c.kda_heads * c.kda_dim
        fixed = 4 * b + b * len(r.conv) * (3 * (c.conv - 1) * p * 2 + c.kda_heads * c.kda_dim * c.kda_dim * 4)
        total = fixed + b * len(r.kv) * CTX * (c.kv_lora + c.rope) * 2
        return pack_state(c, b, r.seq_len, r.kv, r.conv, r.ssm, total)

    def step(self, tokens):
        if self.fault == "router":  # the (k+1)-th expert instead of the k-th, in the last MoE layer
            self.ref.forced = None
            before = self.ref.state()
            self.ref.step(torch.tensor(tokens))
            ids = {l: self.ref.router_scores[l].topk(self.c.top_k + 1, dim=-1).indices for l in self.ref.router_scores}
            last = max(ids)
            ids = {l: v[:, : self.c.top_k] for l, v in ids.items()}
            swapped = ids[last].clone()
            swapped[:, -1] = self.ref.router_scores[last].topk(self.c.top_k + 1, dim=-1).indices[:, -1]
            ids[last] = swapped
            self.ref.restore(before)
            self.ref.forced = ids
        logits = self.ref.step(torch.tensor(tokens)).float().numpy()
        self.ref.forced = None
        if self.fault == "scale":
            logits = logits * 1.03
        return logits.argmax(-1).astype(np.int32), logits

    def routing(self):
        return np.stack([self.ref.expert_ids[l].numpy() for l in sorted(self.ref.expert_ids)]).astype(np.int32)

    def save_state(self):
        return np.frombuffer(self._bytes(), dtype=np.uint8).copy()

    def load_state(self, buf):
        seq_len, kv, conv, ssm = unpack_state(self.c, self.batch, bytes(buf))
        if self.fault == "restore":
            ssm = {l: torch.zeros_like(v) for l, v in ssm.items()}
        self.ref.restore({"seq_len": seq_len, "kv": kv, "conv": conv, "ssm": ssm})

    def reset(self):
        for d in (self.ref.kv, self.ref.conv, self.ref.ssm):
            for v in d.values():
                v.zero_()
        self.ref.seq_len = 0

    def close(self):
        pass


def run(tmp_path, fault=None, seed=3):
    return k3_decode.run_seed(lambda ckpt: StandIn(ckpt, fault=fault), TINY, seed, 4, 8, True, str(tmp_path))


@pytest.mark.skipif(k3_decode.DEVICE != "cpu", reason="the stand-in runs on the CPU")
def test_a_bf16_k3_passes(tmp_path):
    r = run(tmp_path)
    assert r["ok"], r["mismatches"]
    assert r["steps_bounded"] == 11 and r["one_step"]["steps_bounded"] == 11
    assert r["state_restore_max_abs_diff"] == 0.0 and r["free_running"] == ["equal"]
    lines = k3_decode.table("stand-in", [r]).splitlines()
    assert len(lines) == 2 and lines[1].split()[:4] == ["stand-in", "3", "1", "11"]


@pytest.mark.skipif(k3_decode.DEVICE != "cpu", reason="the stand-in runs on the CPU")
@pytest.mark.parametrize("fault,says", [("router", "depart from the reference's top-2"),
                                        ("scale", "over the bound"),
                                        ("restore", "over the bound")])
def test_a_wrong_model_fails(tmp_path, fault, says):
    r = run(tmp_path, fault)
    assert not r["ok"]
    assert any(says in m for m in r["mismatches"]), r["mismatches"]
