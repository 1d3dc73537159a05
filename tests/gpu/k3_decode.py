"""The compiled K3 megakernel against the project's own K3 reference (run on the H200).

For each seed: a random K3 checkpoint in K3's naming (make_k3_checkpoint.py;
MXFP4 routed experts unless --bf16-experts), the reference
(k3_reference.py, written from K3_DECODE_SPEC.md, fp32 on the GPU) and the
compiled library (scripts/build_model.sh from `mkc codegen` output) load it.

Checks, per seed and per sequence of the batch (tests/gpu/compare.py, as
tests/gpu/deepseek_v3_decode.py; routing gaps from the reference's router):
  - teacher-forced over the prompt plus the reference's greedy tokens: the
    logits' relative L2 error at every step <= 2e-2, or <= the noise floor
    (the largest distance so far between the reference and its bf16 twin,
    K3Reference.twin: every projection's output rounded to bf16, the routing
    held to the reference's, stepped on the same tokens; such steps are
    counted), the argmax equal away from near-ties (at most 2 excluded;
    routing near-ties excused, counted);
  - free-running greedy decode equals the reference's, or the first
    divergence is at a near-tie;
  - one step at a time from the reference's own state (its KV caches, conv
    windows and recurrent state written into the runtime before each step):
    the same bounds at every step, a routing near-tie excusing only its own
    step (no cascade: each step starts from the reference's state);
  - a routing near-tie: the reference's k-th and (k+1)-th selection scores
    closer than twice the router noise (K3Reference.step_with_noise: how far
    rounding the reference's own projections to bf16 moves any score at that
    step) or than 2e-3;
  - state: decoding the second half of the sequence after restoring a state
    saved halfway (KV caches, conv and recurrent state) gives the same logits
    as decoding straight through.

    python3 tests/gpu/k3_decode.py --lib LIB --config CONFIG --seeds 0 1 2 [--bf16-experts] [--json OUT]
Exits 1 if any check fails; prints a table last.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
from compare import TeacherForced, free_running  # noqa: E402
from k3_reference import K3Reference  # noqa: E402
from make_k3_checkpoint import make  # noqa: E402
from mkc_runtime import Model  # noqa: E402

def reference(ckpt, prompts, n_gen, ctx, model, one):
    """Greedy tokens, teacher-forced logits and routing gaps, all sequences in
    lockstep. On the way, the one-step check: before each reference step its
    state (KV caches, conv windows, recurrent state) is written into the
    runtime, which takes the same step; `one` compares the two."""
    b = len(prompts)
    ref = K3Reference(ckpt, batch=b, max_ctx=ctx, device="cuda")
    twin = ref.twin()  # bf16 activations, the reference's routing: the noise floor
    seqs = [list(p) for p in prompts]
    logits, gaps, noise, floor = [], [], [], []
    with torch.no_grad():
        for t in range(len(prompts[0]) + n_gen - 1):
            tokens = [s[t] for s in seqs]
            model.load_state(np.frombuffer(ref.kernel_state(model.state_bytes), dtype=np.uint8))
            nxt, got = model.step(tokens)
            out, nz = ref.step_with_noise(torch.tensor(tokens, device="cuda"))
            twin.forced = ref.expert_ids
            far = (twin.step(torch.tensor(tokens, device="cuda")) - out).norm(dim=-1) / out.norm(dim=-1)
            floor.append(far.cpu().numpy())
            out = out.float().cpu().numpy()
            logits.append(out)
            gaps.append(ref.routing_gap.numpy())
            noise.append(nz.numpy())
            one.step(t, nxt, got, out, gaps[-1], noise[-1])
            if t >= len(prompts[0]) - 1:
                for i in range(b):
                    seqs[i].append(int(np.argmax(out[i])))
    del ref, twin
    torch.cuda.empty_cache()
    # [B, steps, V], then [B, steps] x3
    return seqs, np.stack(logits, axis=1), np.stack(gaps, axis=1), np.stack(noise, axis=1), np.stack(floor, axis=1)


def run_seed(lib, config, seed, prompt_len, n_gen, mxfp4, work):
    ckpt = os.path.join(work, f"seed{seed}")
    make(config, ckpt, mxfp4, seed)
    model = Model(lib, ckpt)
    b = model.batch
    rng = np.random.default_rng(1000 + seed)
    prompts = [list(rng.integers(0, model.vocab, prompt_len)) for _ in range(b)]
    # One step at a time from the reference's own state: every step compared
    # from the same state, so a routing near-tie excuses only its own step
    # and nothing cascades.
    one = TeacherForced(b, cascade=False)
    seqs, want, gaps, noise, floor = reference(ckpt, prompts, n_gen, prompt_len + n_gen + 8, model, one)
    steps = prompt_len + n_gen - 1
    model.reset()
    tf = TeacherForced(b)
    got_all = []
    half_state = None
    for t in range(steps):
        if t == steps // 2:
            half_state = model.save_state()
        nxt, logits = model.step([seqs[s][t] for s in range(b)])
        got_all.append(logits)
        tf.step(t, nxt, logits, want[:, t], gaps[:, t], noise[:, t], floor[:, t])
    # State: restore the halfway state and decode the second half again.
    model.load_state(half_state)
    state_err = 0.0
    for t in range(steps // 2, steps):
        _, logits = model.step([seqs[s][t] for s in range(b)])
        state_err = max(state_err, float(np.abs(logits - got_all[t]).max()))
    # Free-running.
    model.reset()
    gen = [[] for _ in range(b)]
    nxt = None
    for t in range(steps):
        nxt, _ = model.step([prompts[s][t] if t < prompt_len else int(nxt[s]) for s in range(b)])
        if t >= prompt_len - 1:
            for s in range(b):
                gen[s].append(int(nxt[s]))
    free, free_mismatches = free_running(gen, [sq[prompt_len:] for sq in seqs], want, gaps, prompt_len, n_gen, noise)
    model.close()
    shutil.rmtree(ckpt, ignore_errors=True)  # real widths: gigabytes per seed
    return {"seed": seed, "batch": b, "steps": steps, **tf.report(), "state_restore_max_abs_diff": state_err,
            "one_step": one.report(), "router_noise_median": float(np.median(noise)),
            "router_noise_max": float(noise.max()), "mismatches": (tf.mismatches + free_mismatches + one.mismatches)[:10],
            "free_running": free, "ok": tf.ok() and not free_mismatches and state_err == 0.0 and one.ok()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--gen", type=int, default=57)  # 64 steps with the prompt of 8
    ap.add_argument("--bf16-experts", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="mkc_k3_")
    rows = [run_seed(args.lib, args.config, s, args.prompt_len, args.gen, not args.bf16_experts, work) for s in args.seeds]
    shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lib": os.path.basename(args.lib), "config": args.config, "seeds": rows}, f, indent=1)
    print(f"{'lib':32} {'seed':>4} {'batch':>5} {'steps':>5} {'max rel L2':>11} {'median':>9} {'bounded':>7} {'near-ties':>9} {'routing':>8} "
          f"{'state':>6} {'one-step max':>12} {'bnd':>4} {'noise med':>9} {'floor':>8} {'in floor':>8}  free-running")
    for r in rows:
        print(f"{os.path.basename(args.lib):32} {r['seed']:>4} {r['batch']:>5} {r['steps']:>5} {r['max_rel_l2']:>11.3e} {r['median_rel_l2']:>9.2e} {r['steps_bounded']:>7} "
              f"{str(r['near_ties_excluded']):>9} {str(r['routing_near_ties_excluded']):>8} {'same' if r['state_restore_max_abs_diff'] == 0 else 'DIFF':>6} {r['one_step']['max_rel_l2']:>12.3e} "
              f"{r['one_step']['steps_bounded']:>4} {r['router_noise_median']:>9.1e} {max(r['noise_floor']):>8.2e} "
              f"{str(r['within_noise_floor']):>8}  "
              f"{'; '.join(sorted(set(r['free_running'])))}{'' if r['ok'] else '  FAIL: ' + '; '.join(r['mismatches'][:3])}")
    ok = all(r["ok"] for r in rows)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
