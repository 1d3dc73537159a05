"""How far the K3 reference moves from itself when its activations are bf16:
the noise floor of a teacher-forced comparison, with no kernel involved.

For each seed: a random K3 checkpoint (make_k3_checkpoint.py, MXFP4
experts), the fp32 reference and the same reference with every projection's
output rounded to bf16 (K3Reference(round_bf16=True), as an implementation
storing bf16 activations would), both fed the fp32 reference's greedy
tokens after a random prompt. Prints, per seed, the relative L2 distance of
their logits (max, median, the steps over the 2e-2 bound of the GPU tests,
the max per 8 steps) and the smallest routing gap met. Runs on the CPU or
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
from k3_reference import K3Reference  # noqa: E402
from make_k3_checkpoint import make  # noqa: E402


def floor(config: str, seed: int, steps: int, prompt_len: int, work: str) -> dict:
    ckpt = os.path.join(work, f"seed{seed}")
    make(config, ckpt, True, seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ref = K3Reference(ckpt, batch=1, max_ctx=steps + 8, device=dev)
    low = K3Reference(ckpt, batch=1, max_ctx=steps + 8, device=dev, round_bf16=True)
    rng = np.random.default_rng(1000 + seed)
    seq = list(rng.integers(0, ref.cfg.vocab, prompt_len))
    errs, gap = [], float("inf")
    for t in range(steps):
        tok = torch.tensor([seq[t]], device=dev)
        a = ref.step(tok).float()
        gap = min(gap, float(ref.routing_gap[0]))
        b = low.step(tok).float()
        errs.append(float((a - b).norm() / a.norm()))
        if t >= prompt_len - 1:
            seq.append(int(a.argmax()))
    e = np.array(errs)
    return {"seed": seed, "max": float(e.max()), "median": float(np.median(e)),
            "over": [int(i) for i in np.nonzero(e > MAX_REL_L2)[0]], "per8": [float(e[i: i + 8].max()) for i in range(0, steps, 8)],
            "min_gap": gap}


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
            print(f"seed {r['seed']}: bf16 activations vs fp32, {args.steps} teacher-forced steps: max {r['max']:.2e}, "
                  f"median {r['median']:.2e}, {len(r['over'])} steps over {MAX_REL_L2:g}, smallest routing gap {r['min_gap']:.1e}")
            print("    max per 8 steps: " + " ".join(f"{x:.1e}" for x in r["per8"]))


if __name__ == "__main__":
    main()
