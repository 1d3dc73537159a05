"""How far the K3 reference moves from itself when it keeps its state as the
compiled programs do (bf16 KV cache rows and conv windows): the noise floor of
a teacher-forced comparison, with no kernel involved.

For each seed: a random K3 checkpoint (make_k3_checkpoint.py, MXFP4
experts), the fp32 reference and its twin (K3Reference.twin: the state in
the graph's dtypes, the routing held to the fp32 reference's), both fed the
fp32 reference's greedy tokens after a random prompt. tests/gpu/k3_decode.py
bounds the kernel's teacher-forced error by twice this distance where that
exceeds the 2e-2 bound. Prints, per seed, the relative L2 distance of
their logits (max, median, the steps over the 2e-2 bound of the GPU tests,
the max per 8 steps). `noise_floor` is the side-by-side stepping itself,
which tests/gpu/k3_bisect.py uses too. Runs on the CPU or
the GPU (torch, safetensors).

    python3 tests/gpu/k3_noise_floor.py --config model_graphs/kimi_k3/tiny.json --seeds 0 1 2 [--steps 64]
"""

import argparse
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from compare import MAX_REL_L2  # noqa: E402
from k3_reference import Config, K3Reference, score_change  # noqa: E402
from make_k3_checkpoint import make  # noqa: E402


def noise_floor(ckpt: str, steps: int, batch: int, tokens_at, dev: str) -> tuple[list[float], list[float]]:
    """Steps the fp32 reference and its twin (bf16 state) side by side;
    tokens_at(t, logits) gives step t's tokens [B] (logits: the fp32
    reference's of step t - 1, or None). Per step: the largest relative L2
    distance of their logits over the batch, and the largest change of a
    router selection score."""
    ref = K3Reference(ckpt, batch=batch, max_ctx=steps + 8, device=dev)
    rounded = ref.twin()
    errs, scores, logits = [], [], None
    with torch.no_grad():
        for t in range(steps):
            tok = torch.tensor(tokens_at(t, logits), device=dev)
            want = ref.step(tok).float()
            rounded.forced = ref.expert_ids
            got = rounded.step(tok).float()
            errs.append(float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max()))
            scores.append(float(score_change(rounded.router_scores, ref.router_scores, batch).max()))
            logits = want
    return errs, scores


def floor(config: str, seed: int, steps: int, prompt_len: int, work: str) -> dict:
    """Batch 1, teacher-forced: a random prompt, then the fp32 reference's greedy tokens."""
    ckpt = os.path.join(work, f"seed{seed}")
    make(config, ckpt, True, seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rng = np.random.default_rng(1000 + seed)
    seq = [int(x) for x in rng.integers(0, Config.load(config).vocab, prompt_len)]

    def tokens_at(t, logits):
        if t >= prompt_len:  # the fp32 reference's greedy token after the previous step
            seq.append(int(logits[0].argmax()))
        return [seq[t]]

    errs, _ = noise_floor(ckpt, steps, 1, tokens_at, dev)
    e = np.array(errs)
    return {"seed": seed, "max": float(e.max()), "median": float(np.median(e)),
            "over": [int(i) for i in np.nonzero(e > MAX_REL_L2)[0]], "per8": [float(e[i: i + 8].max()) for i in range(0, steps, 8)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mkc_k3_floor_") as work:
        for s in args.seeds:
            r = floor(args.config, s, args.steps, args.prompt_len, work)
            print(f"seed {r['seed']}: bf16 state vs fp32, {args.steps} teacher-forced steps: max {r['max']:.2e}, "
                  f"median {r['median']:.2e}, {len(r['over'])} steps over {MAX_REL_L2:g}")
            print("    max per 8 steps: " + " ".join(f"{x:.1e}" for x in r["per8"]))


if __name__ == "__main__":
    main()
