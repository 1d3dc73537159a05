"""Checks of the project's K3 reference that need no GPU (they run on one too).

    python3 -m pytest tests/gpu/test_k3_reference.py      (needs torch, safetensors, pytest)

The megakernel comparison (K3 issue) uses this reference on the H200.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from k3_reference import E2M1, K3Reference, mxfp4_dequant, mxfp4_quantize  # noqa: E402
from make_k3_checkpoint import make  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "model_graphs", "kimi_k3", "tiny.json")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", params=["mxfp4", "bf16"])
def checkpoint(request, tmp_path_factory):
    out = str(tmp_path_factory.mktemp(request.param))
    make(TINY, out, mxfp4=request.param == "mxfp4", seed=1)
    return out


def test_mxfp4_codes_and_round_trip():
    # Section 13: low nibble first, code 8+ negative, e8m0 scale 2^(s-127).
    packed = torch.tensor([[0x21, 0xF9] * 16], dtype=torch.uint8)
    scale = torch.tensor([[128, 126]], dtype=torch.uint8)
    w = mxfp4_dequant(packed, scale)
    assert w[0, :4].tolist() == [1.0, 2.0, -1.0, -12.0]
    assert w[0, 32:36].tolist() == [0.25, 0.5, -0.25, -3.0]
    # Values already on the grid survive quantization exactly.
    x = (E2M1[torch.randint(0, 16, (8, 64))] * 4.0)
    x[:, ::32] = 24.0  # each block's largest magnitude sets its scale
    p, s = mxfp4_quantize(x)
    assert torch.equal(mxfp4_dequant(p, s), x)


def test_the_checkpoint_matches_the_graph_file(checkpoint):
    mkc = os.path.join(ROOT, "target", "release", "mkc")
    if not os.path.exists(mkc):
        pytest.skip("build mkc first: cargo build --release")
    r = subprocess.run([mkc, "check", os.path.join(ROOT, "model_graphs/kimi_k3/graph.mkc"), "--checkpoint", checkpoint],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checkpoint matches the graph" in r.stdout


def test_decoding_is_finite_and_distinct(checkpoint):
    ref = K3Reference(checkpoint, batch=2, max_ctx=32, device=DEVICE)
    tokens = torch.tensor([3, 77])
    for _ in range(6):
        logits = ref.step(tokens)
        assert torch.isfinite(logits).all()
        top2 = logits.topk(2, dim=-1).values
        assert ((top2[:, 0] - top2[:, 1]) > 1e-3).all(), "near-tie logits: the weights are too small"
        tokens = logits.argmax(-1)
    # The two sequences are independent: one of them alone gives the same logits.
    a = K3Reference(checkpoint, batch=2, max_ctx=32, device=DEVICE)
    b = K3Reference(checkpoint, batch=1, max_ctx=32, device=DEVICE)
    la = a.step(torch.tensor([3, 77]))
    lb = b.step(torch.tensor([77]))
    torch.testing.assert_close(la[1:], lb, rtol=1e-5, atol=1e-5)


def test_a_restart_from_saved_state_continues_the_same_sequence(checkpoint):
    ref = K3Reference(checkpoint, batch=1, max_ctx=32, device=DEVICE)
    seq = [5, 9, 200, 31, 8, 100, 7, 64]
    for t in seq[:4]:
        ref.step(torch.tensor([t]))
    saved = ref.state()
    first = [ref.step(torch.tensor([t])) for t in seq[4:]]
    other = K3Reference(checkpoint, batch=1, max_ctx=32, device=DEVICE)
    other.restore(saved)
    again = [other.step(torch.tensor([t])) for t in seq[4:]]
    for x, y in zip(first, again):
        assert torch.equal(x, y)


def test_the_twin_follows_the_routing_it_is_given(checkpoint):
    ref = K3Reference(checkpoint, batch=2, max_ctx=32, device=DEVICE)
    ref.step(torch.tensor([3, 77]))
    twin = ref.twin()
    assert twin.round_state and not twin.round_bf16 and twin.w is ref.w  # weights shared, not copied
    twin.round_state = False  # unrounded and given the reference's routing: the same step exactly
    for t in ([9, 41], [200, 5]):
        want = ref.step(torch.tensor(t))
        twin.forced = ref.expert_ids
        assert torch.equal(twin.step(torch.tensor(t)), want)
    # Routed to other experts, the step differs: the forced ids are the ones taken.
    twin.forced = {l: (ids + 1) % ref.cfg.experts for l, ids in ref.expert_ids.items()}
    assert not torch.equal(twin.step(torch.tensor([1, 2])), ref.step(torch.tensor([1, 2])))
    assert all(torch.equal(twin.expert_ids[l], twin.forced[l]) for l in twin.forced)


def test_the_bound_is_the_larger_of_2e2_and_twice_the_noise_floor():
    from compare import TeacherForced

    want = np.array([[1.0, 0.0, 0.0, 0.0]])
    off = lambda rel: want + np.array([[0.0, rel, 0.0, 0.0]])  # noqa: E731  relative L2 error `rel`
    tf = TeacherForced(1)  # teacher-forced: the largest floor so far
    tf.step(0, [0], off(0.01), want, [1.0], [0.0], [0.03])
    tf.step(1, [0], off(0.055), want, [1.0], [0.0], [0.001])  # within twice the floor of step 0
    assert tf.ok() and tf.within_floor == [1]
    tf.step(2, [0], off(0.065), want, [1.0], [0.0], [0.001])
    assert not tf.ok() and "over the bound 0.06" in tf.mismatches[0]
    one = TeacherForced(1, cascade=False)  # one step at a time: that step's floor
    one.step(0, [0], off(0.01), want, [1.0], [0.0], [0.03])
    one.step(1, [0], off(0.03), want, [1.0], [0.0], [0.001])
    assert not one.ok()
    plain = TeacherForced(1)  # no floor: 2e-2
    plain.step(0, [0], off(0.03), want, [1.0], [0.0])
    assert not plain.ok()
