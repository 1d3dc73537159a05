"""Greedy generation in one launch (mkc_model_generate) against the same
number of single steps (mkc_model_step), on the GPU.

For each seed: a random checkpoint of the config (K3: tests/gpu/make_k3_checkpoint.py;
K2 and Kimi Linear: transformers, as tests/gpu/deepseek_v3_decode.py draws it),
a random prompt per sequence fed step by step, the state saved; then
  1. N single steps, each step's argmax fed back: the tokens and the state after;
  2. the state restored, one generate(N): the same tokens, and the same state
     (KV caches, conv windows, recurrent state and positions) byte for byte;
  3. the state restored, generate(N, stop) with stop a token the single steps
     produced: it stops at the step where every sequence has produced it (or
     runs N), each sequence's length where it first did;
  4. a generation that would pass the context, and a stop token outside the
     vocabulary, refused with a message naming them;
  5. tokens/s over --bench steps (wall clock): one generate launch against as
     many mkc_model_step calls (each a launch, a sync and a copy), from the
     same state.

    python3 tests/gpu/generate.py --lib LIB --config CONFIG --arch k3|deepseek_v3|kimi_linear
        [--seeds 0 1 2] [--steps 64] [--bench 256] [--json OUT]
Exits 1 if any check fails; prints a table last.
"""

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from checkpoints import make_checkpoint, scratch_dir  # noqa: E402
from mkc_runtime import MkcError, Model  # noqa: E402


def single_steps(model, first, n):
    tokens, t = [], first
    for _ in range(n):
        t, _ = model.step(t)
        tokens.append(t.copy())
    return np.stack(tokens)


def expected_stop(ref, stop):
    """(steps, length) generate(n, stop) must give, from the single steps' tokens ref [n, batch]."""
    n, b = ref.shape
    length = np.zeros(b, dtype=np.int32)
    for i in range(b):
        hits = np.nonzero(ref[:, i] == stop)[0]
        if hits.size:
            length[i] = hits[0] + 1
    steps = int(length.max()) if (length > 0).all() else n
    length[length > steps] = 0  # cannot happen: steps is the largest
    return steps, length


def refused(fn, *words):
    try:
        fn()
    except MkcError as e:
        msg = str(e)
        return all(w in msg for w in words), msg
    return False, "accepted"


def run_seed(args, seed, work):
    ckpt = os.path.join(work, f"seed{seed}")
    make_checkpoint(args.arch, args.config, seed, ckpt)
    model = Model(args.lib, ckpt)
    b = model.batch
    rng = np.random.default_rng(2000 + seed)
    prompt = rng.integers(0, model.vocab, (args.prompt_len, b)).astype(np.int32)
    for t in prompt[:-1]:
        model.step(t)
    start = model.save_state()
    row = {"seed": seed, "batch": b, "steps": args.steps, "checks": {}}
    checks = row["checks"]

    ref = single_steps(model, prompt[-1], args.steps)
    after_steps = model.save_state()
    model.load_state(start)
    got, length = model.generate(prompt[-1], args.steps)
    after_gen = model.save_state()
    checks["tokens equal"] = bool(got.shape == ref.shape and (got == ref).all())
    if not checks["tokens equal"]:
        first = int(np.argmax((got[: len(ref)] != ref[: len(got)]).any(axis=1))) if len(got) else 0
        row["tokens"] = f"{got.shape[0]} steps; first difference at step {first}"
    checks["no stop, lengths 0"] = bool((length == 0).all())
    diff = np.nonzero(after_gen != after_steps)[0]
    checks["state equal"] = diff.size == 0
    row["state bytes differing"] = int(diff.size)

    # A stop token the single steps produced: the last sequence's token at the middle step.
    stop = int(ref[args.steps // 2, b - 1])
    want_steps, want_length = expected_stop(ref, stop)
    model.load_state(start)
    got_s, length_s = model.generate(prompt[-1], args.steps, stop=stop)
    checks["stop"] = bool(got_s.shape[0] == want_steps and (length_s == want_length).all()
                          and (got_s == ref[:want_steps]).all())
    row["stop"] = {"token": stop, "steps": int(got_s.shape[0]), "want": want_steps, "length": length_s.tolist()}

    ok, msg = refused(lambda: model.generate(prompt[-1], model.context + 1), "context")
    checks["past the context refused"] = ok
    row["context message"] = msg
    ok, msg = refused(lambda: model.generate(prompt[-1], 4, stop=int(model.vocab)), "stop token", "vocabulary")
    checks["stop outside the vocabulary refused"] = ok

    if args.bench and seed == args.seeds[0]:
        model.load_state(start)
        model.generate(prompt[-1], 8)  # warm-up
        model.load_state(start)
        t0 = time.perf_counter()
        model.generate(prompt[-1], args.bench)
        one = time.perf_counter() - t0
        model.load_state(start)
        t0 = time.perf_counter()
        single_steps(model, prompt[-1], args.bench)
        many = time.perf_counter() - t0
        row["bench"] = {"steps": args.bench, "generate_ms": one * 1e3, "single_steps_ms": many * 1e3,
                        "generate_tokens_per_s_per_user": args.bench / one,
                        "single_steps_tokens_per_s_per_user": args.bench / many}
    model.close()
    shutil.rmtree(ckpt, ignore_errors=True)
    row["pass"] = all(checks.values())
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--arch", choices=["k3", "deepseek_v3", "kimi_linear"], required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--bench", type=int, default=256, help="steps timed each way (0: none)")
    ap.add_argument("--json")
    args = ap.parse_args()
    work = scratch_dir("mkc_generate_")
    try:
        rows = [run_seed(args, s, work) for s in args.seeds]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lib": args.lib, "config": args.config, "rows": rows}, f, indent=1)
    print(f"{os.path.basename(args.lib)}: generate against single steps")
    for r in rows:
        failed = [k for k, v in r["checks"].items() if not v]
        print(f"  seed {r['seed']}: {'PASS' if r['pass'] else 'FAIL'}  batch {r['batch']}, {r['steps']} steps, "
              f"stop {r['stop']}" + (f"; failed: {', '.join(failed)}" if failed else "")
              + (f"; state bytes differing {r['state bytes differing']}" if r["state bytes differing"] else ""))
        if "bench" in r:
            bn = r["bench"]
            print(f"  {bn['steps']} steps: one launch {bn['generate_ms']:.2f} ms "
                  f"({bn['generate_tokens_per_s_per_user']:.1f} tokens/s per user), single steps "
                  f"{bn['single_steps_ms']:.2f} ms ({bn['single_steps_tokens_per_s_per_user']:.1f})")
    sys.exit(0 if all(r["pass"] for r in rows) else 1)


if __name__ == "__main__":
    main()
