"""Where does a compiled K3 model part from the reference? (run on the H200)

The same library and seed, with parts of the model cut out by zeroing their
output projections in the checkpoint (make_k3_checkpoint.py --zero): each
variant decodes a few teacher-forced steps of random tokens and prints the
logits' relative L2 error against tests/gpu/k3_reference.py per step. The
part whose removal makes the error vanish is the one to look at.

    python3 tests/gpu/k3_bisect.py --lib LIB --config CONFIG [--seed 0] [--steps 8] [--variant NAME=REGEX,...]
        [--only full "no KDA out" ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import numpy as np
import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import k3_noise_floor  # noqa: E402
from k3_reference import Config, K3Reference  # noqa: E402
from make_k3_checkpoint import make  # noqa: E402
from mkc_runtime import Model  # noqa: E402
from checkpoints import scratch_dir  # noqa: E402


def default_variants(c: Config) -> dict[str, list[str]]:
    kda = [l for l in range(c.layers) if not c.is_mla(l)]
    mla = [l for l in range(c.layers) if c.is_mla(l)]

    def layers(ls, name):
        return [rf"\.layers\.({'|'.join(map(str, ls))})\.{name}"] if ls else []

    v = {
        "full": [],
        "no KDA out": layers(kda, r"self_attn\.o_proj"),
        "no MLA out": layers(mla, r"self_attn\.o_proj"),
        "no dense MLP": layers(list(range(min(c.first_dense, c.layers))), r"mlp\.down_proj"),
        "no routed experts": [r"routed_expert_up_proj"] if c.layers > c.first_dense else [],
        "no shared experts": [r"shared_experts\.down_proj"] if c.layers > c.first_dense else [],
    }
    v = {k: p for k, p in v.items() if k == "full" or p}
    v["none of them"] = sorted({p for ps in v.values() for p in ps})
    return v


def run(lib, config, seed, steps, zero, work, noise_floor=False):
    ckpt = os.path.join(work, "ckpt")
    make(config, ckpt, True, seed, tuple(zero))
    model = Model(lib, ckpt)
    b = model.batch
    rng = np.random.default_rng(2000 + seed)
    tokens = rng.integers(0, model.vocab, (steps, b))
    ref = K3Reference(ckpt, batch=b, max_ctx=steps + 8, device="cuda")
    model.reset()
    errs = []
    with torch.no_grad():
        for t in range(steps):
            want = ref.step(torch.tensor(tokens[t], device="cuda")).float().cpu().numpy()
            _, got = model.step([int(x) for x in tokens[t]])
            errs.append(max(float(np.linalg.norm(got[s] - want[s]) / np.linalg.norm(want[s])) for s in range(b)))
    model.close()
    del ref
    if noise_floor:  # the same steps through the reference keeping its state in bf16 (its twin)
        floor, score_noise = k3_noise_floor.noise_floor(ckpt, steps, b, lambda t, _: [int(x) for x in tokens[t]], "cuda")
        errs = (errs, floor, score_noise)
    torch.cuda.empty_cache()
    shutil.rmtree(ckpt, ignore_errors=True)
    return errs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--variant", action="append", default=[], help="NAME=REGEX[,REGEX...]: tensors to zero")
    ap.add_argument("--only", nargs="+", help="run only these of the default variants")
    args = ap.parse_args()
    variants = default_variants(Config.load(args.config))
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only}
    for v in args.variant:
        name, _, pats = v.partition("=")
        variants[name] = [p for p in pats.split(",") if p]
    work = scratch_dir("mkc_bisect_")
    rows = []
    for name, zero in variants.items():
        errs = run(args.lib, args.config, args.seed, args.steps, zero, work, noise_floor=name == "full")
        if name == "full":
            errs, floor, score_noise = errs
            rows.append(("reference, bf16 state", floor))
            rows.append(("  its router scores", score_noise))
        rows.append((name, errs))
    shutil.rmtree(work, ignore_errors=True)
    print(f"{os.path.basename(args.lib)}, seed {args.seed}: max over the batch of the logits' relative L2 error per step "
          "(the first row: the fp32 reference against itself keeping its state in bf16, the noise floor; "
          "the second: the largest change that makes in a router's selection scores, against which a "
          "routing near-tie threshold is set)")
    for name, errs in rows:
        print(f"  {name:20} " + " ".join(f"{e:8.2e}" for e in errs))


if __name__ == "__main__":
    sys.exit(main())
