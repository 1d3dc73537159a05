"""Long runs of a compiled model on the GPU, and the checkpoints the issue of
hostile input names (run on the H200 or H100).

soak: greedy decode for --steps steps at the library's batch, in episodes of
at most context - 1 steps (a reset between episodes). Every step's logits
must be finite; the device's free memory, sampled every 500 steps, must not
move by more than 1 MiB from the first sample after warm-up (no allocation
per step); a step slower than --step-timeout seconds fails. In the first
episode the state is saved halfway; after the episode it is restored and the
second half decoded again: the tokens must equal the first run's bit for
bit.

checkpoints (K3 libraries, --checks): every MXFP4 expert scale byte set to
255 (e8m0's NaN, which K3_DECODE_SPEC.md reads as 0: SGLang's dequantisation)
must decode exactly as the same checkpoint with those experts' codes and
scales zeroed (finite, the same tokens and logits bit for bit); a shard cut
in the middle of a tensor must be refused when the model opens, naming the
tensor and the file.

    python3 tests/gpu/soak.py --lib LIB --config CONFIG --arch k3|deepseek_v3 --steps 10000 [--checks] [--json OUT]
Exits 1 if any check fails; prints a table last.
"""

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import make_k3_checkpoint  # noqa: E402
from checkpoints import make_checkpoint, scratch_dir  # noqa: E402
from mkc_runtime import MkcError, Model  # noqa: E402

MEMORY_SLACK = 1 << 20


def free_memory():
    free, _ = torch.cuda.mem_get_info()
    return free


def soak(lib, ckpt, steps, seed, step_timeout):
    model = Model(lib, ckpt)
    b, ctx = model.batch, model.context
    rng = np.random.default_rng(seed)
    episode = max(2, min(ctx - 1, steps))
    done, worst_step, nonfinite, memory = 0, 0.0, 0, []
    restart = None
    first_tokens = []
    saved = None
    base = None
    while done < steps:
        model.reset()
        n = min(episode, steps - done)
        tokens = rng.integers(0, model.vocab, b)
        for t in range(n):
            if done == 0 and t == n // 2:
                saved = (model.save_state(), tokens.copy())
            t0 = time.time()
            nxt, logits = model.step(tokens)
            worst_step = max(worst_step, time.time() - t0)
            if not np.isfinite(logits).all():
                nonfinite += 1
            if done == 0 and t >= n // 2:
                first_tokens.append(nxt.copy())
            tokens = nxt
            step = done + t + 1
            if step == 50:
                base = free_memory()
            if base is not None and step % 500 == 0:
                memory.append(free_memory() - base)
        if done == 0 and saved is not None:
            state, tok = saved
            model.load_state(state)
            again = []
            for _ in range(n - n // 2):
                tok, _ = model.step(tok)
                again.append(tok.copy())
            restart = all(np.array_equal(x, y) for x, y in zip(first_tokens, again)) and len(again) == len(first_tokens)
        done += n
    model.close()
    drift = max((abs(m) for m in memory), default=0)
    return {
        "steps": done,
        "batch": b,
        "episode": episode,
        "nonfinite_steps": nonfinite,
        "slowest_step_s": round(worst_step, 3),
        "memory_drift_bytes": int(drift),
        "memory_samples": len(memory),
        "restart_equal": bool(restart),
        "ok": nonfinite == 0 and drift <= MEMORY_SLACK and bool(restart) and worst_step <= step_timeout,
    }


def decode(lib, ckpt, steps, seed):
    model = Model(lib, ckpt)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, model.vocab, model.batch)
    out = []
    for _ in range(steps):
        tokens, logits = model.step(tokens)
        out.append((tokens.copy(), logits.copy()))
    model.close()
    return out


def nan_scales(lib, config, seed, work):
    """All MXFP4 expert scale bytes 255 decodes as the experts zeroed."""
    base = os.path.join(work, "base")
    make_k3_checkpoint.make(config, base, True, seed)
    nan, zero = os.path.join(work, "nan"), os.path.join(work, "zero")
    shutil.copytree(base, nan)
    shutil.copytree(base, zero)
    changed = 0
    for f in sorted(x for x in os.listdir(base) if x.endswith(".safetensors")):
        t = load_file(os.path.join(base, f))
        n, z = dict(t), dict(t)
        for k, v in t.items():
            if ".experts." in k and k.endswith("weight_scale"):
                n[k] = torch.full_like(v, 255)
                z[k] = torch.zeros_like(v)
                z[k.replace("weight_scale", "weight_packed")] = torch.zeros_like(t[k.replace("weight_scale", "weight_packed")])
                changed += 1
        save_file(n, os.path.join(nan, f), metadata={"format": "pt"})
        save_file(z, os.path.join(zero, f), metadata={"format": "pt"})
    a, b = decode(lib, nan, 16, seed), decode(lib, zero, 16, seed)
    finite = all(np.isfinite(x[1]).all() for x in a)
    equal = all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a, b))
    return {"case": "e8m0 255 scales", "tensors": changed, "ok": changed > 0 and finite and equal,
            "detail": f"finite {finite}, equal to zeroed experts {equal}"}


def truncated(lib, config, seed, work):
    """A shard cut inside a tensor's data: refused by name when the model opens."""
    ckpt = os.path.join(work, "cut")
    make_k3_checkpoint.make(config, ckpt, True, seed)
    f = sorted(x for x in os.listdir(ckpt) if x.endswith(".safetensors"))[-1]
    path = os.path.join(ckpt, f)
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.truncate(size - 100)
    try:
        Model(lib, ckpt).close()
        return {"case": "truncated shard", "ok": False, "detail": "opened"}
    except MkcError as e:
        msg = str(e)
        return {"case": "truncated shard", "ok": "truncated tensor" in msg and f in msg,
                "detail": msg.strip().splitlines()[-1]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--arch", choices=["k3", "deepseek_v3", "kimi_linear"], required=True)
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-timeout", type=float, default=5.0)
    ap.add_argument("--checks", action="store_true", help="the e8m0 and truncation checkpoints (K3 libraries)")
    ap.add_argument("--json")
    args = ap.parse_args()
    work = scratch_dir("mkc_soak_")
    try:
        ckpt = os.path.join(work, "ckpt")
        make_checkpoint(args.arch, args.config, args.seed, ckpt)
        t0 = time.time()
        row = soak(args.lib, ckpt, args.steps, args.seed, args.step_timeout)
        row["seconds"] = round(time.time() - t0, 1)
        checks = []
        if args.checks:
            checks = [nan_scales(args.lib, args.config, args.seed, work), truncated(args.lib, args.config, args.seed, work)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"lib": os.path.basename(args.lib), "soak": row, "checks": checks}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(f"{report['lib']}: {row['steps']} steps at batch {row['batch']} (episodes of {row['episode']}) in "
          f"{row['seconds']} s: non-finite steps {row['nonfinite_steps']}, slowest step {row['slowest_step_s']} s, "
          f"free-memory drift {row['memory_drift_bytes']} B over {row['memory_samples']} samples, restart from the "
          f"saved state {'equal' if row['restart_equal'] else 'DIFFERS'}")
    for c in checks:
        print(f"{c['case']}: {'ok' if c['ok'] else 'FAIL'}: {c['detail']}")
    ok = row["ok"] and all(c["ok"] for c in checks)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
