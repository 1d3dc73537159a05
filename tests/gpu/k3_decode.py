"""The compiled K3 megakernel against the project's own K3 reference (run on the H200).

For each seed: a random K3 checkpoint in K3's naming (make_k3_checkpoint.py;
MXFP4 routed experts unless --bf16-experts), the reference
(k3_reference.py, written from K3_DECODE_SPEC.md, fp32 on the GPU) and the
compiled library (scripts/build_model.sh from `mkc codegen` output) load it.

The routing is compared exactly. After every step the runtime gives the
experts each router picked (the routing log, Model.routing()). Where they are
the reference's top-k nothing more happens; where they differ, the reference
re-takes the step from the same state with the kernel's experts, and every
difference must be a routing near-tie: by the reference's scores on that path,
a picked expert falls below the reference's k-th choice (or a dropped one rises
above its (k+1)-th) by less than 2e-3 or than twice the router noise at that
step (K3Reference.step_with_noise: the largest change of any selection score
when the reference rounds its projections' outputs to bf16, as the kernel
stores its activations). Anything else fails. So the reference follows the
kernel through near-ties and every step stays comparable: nothing is excused.

Checks, per seed and per sequence of the batch (tests/gpu/compare.py):
  - teacher-forced over the prompt plus the reference's greedy tokens, the
    kernel from its own state, the reference following its routing: the
    logits' relative L2 error at every step <= 2e-2, or <= the noise floor
    (the largest distance so far between the reference and its bf16 twin,
    K3Reference.twin: every projection's output rounded to bf16, the same
    routing, the same tokens; such steps are counted), the argmax equal away
    from logit near-ties (margin under 1e-2, scaled as the bound is; at most 2
    per sequence);
  - one step at a time from the reference's state (its KV caches, conv
    windows and recurrent state written into the runtime before each step):
    the same routing check, and the 2e-2 bound with no floor at every step;
  - free-running greedy decode equals the reference's tokens, or the first
    divergence is at a logit near-tie (the teacher-forced step's margin);
  - state: the teacher-forced run, which restores the kernel's saved state
    before every step (the one-step check shares the runtime), equals a run
    straight through bit for bit, and so does the second half decoded again
    after restoring the state saved halfway.

    python3 tests/gpu/k3_decode.py --lib LIB --config CONFIG --seeds 0 1 2 [--bf16-experts] [--json OUT]
Exits 1 if any check fails; prints a table last.
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np
import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
from compare import ROUTING_NEAR_TIE, ROUTING_NOISE_FACTOR, TeacherForced, free_running, routing_departure  # noqa: E402
from k3_reference import K3Reference, bf16_state  # noqa: E402
from make_k3_checkpoint import make  # noqa: E402
from mkc_runtime import Model  # noqa: E402
from checkpoints import scratch_dir  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the reference's (tests/gpu/test_k3_decode.py: CPU)


class Routing:
    """The routing check of one comparison (teacher-forced or one step at a time)."""

    def __init__(self, name: str, batch: int):
        self.name = name
        self.followed = [0] * batch  # steps where the reference took the kernel's near-tied experts
        self.largest = 0.0  # the largest departure followed, in selection-score units
        self.mismatches: list[str] = []

    def routed_step(self, ref: K3Reference, start: dict, tokens: torch.Tensor, ids: np.ndarray, t: int,
                    floor: bool = False):
        """From `start`, the reference's step with the kernel's experts `ids` [routers, B, k];
        returns its logits [B, V] (numpy) and, with `floor`, the noise floor of that step [B]: the
        distance to the same step taken from `start` rounded as the runtime stores it (bf16_state).
        `ref` is left after the step from `start`."""
        ref.restore(start)
        ref.forced = None
        out, noise = ref.step_with_noise(tokens)
        layers = sorted(ref.router_scores)
        if len(layers) != ids.shape[0]:
            raise SystemExit(f"the library logs {ids.shape[0]} routers, the reference has {len(layers)} MoE layers")
        k = ids.shape[2]
        own = all(routing_departure(ref.router_scores[l][s].cpu().numpy(), ids[i, s], k) == 0.0
                  for i, l in enumerate(layers) for s in range(ids.shape[1]))
        if not own:  # again, with the kernel's experts in every layer, judged on that path
            ref.restore(start)
            ref.forced = {l: torch.from_numpy(ids[i]) for i, l in enumerate(layers)}
            out, noise = ref.step_with_noise(tokens)
            ref.forced = None
            for s in range(ids.shape[1]):
                tie = max(ROUTING_NEAR_TIE, ROUTING_NOISE_FACTOR * float(noise[s]))
                worst = max(routing_departure(ref.router_scores[l][s].cpu().numpy(), ids[i, s], k)
                            for i, l in enumerate(layers))
                if worst >= tie:
                    self.mismatches.append(f"{self.name} seq {s} step {t}: the kernel's experts depart from the "
                                           f"reference's top-{k} by {worst:.3g} in selection score (near-tie: {tie:.3g})")
                elif worst > 0:
                    self.followed[s] += 1
                    self.largest = max(self.largest, worst)
        out = out.float().cpu().numpy()
        if not floor:
            return out, None
        after = ref.state()
        ref.restore(bf16_state(start))
        ref.forced = {l: torch.from_numpy(ids[i]) for i, l in enumerate(layers)}
        rounded = ref.step(tokens).float().cpu().numpy()
        ref.forced = None
        ref.restore(after)
        return out, np.linalg.norm(rounded - out, axis=-1) / np.linalg.norm(out, axis=-1)


def lockstep(ckpt, prompts, n_gen, ctx, model, tf, one, tf_routing, one_routing):
    """Every step: the kernel from the reference's state (one step at a time) and from its own
    (teacher-forced), each with the reference re-taking the step along the kernel's routing; the
    reference goes on along the teacher-forced kernel's routing and greedy tokens, its bf16 twin
    beside it. Returns the token sequences and the teacher-forced kernel's logits [steps, B, V]."""
    b = len(prompts)
    ref = K3Reference(ckpt, batch=b, max_ctx=ctx, device=DEVICE)
    twin = ref.twin()
    seqs = [list(p) for p in prompts]
    inf = np.full(b, np.inf)  # routing is followed, never excused: no routing gaps
    tf_state = model.save_state()
    got_all, want_all = [], []
    with torch.no_grad():
        for t in range(len(prompts[0]) + n_gen - 1):
            tokens = [s[t] for s in seqs]
            tok = torch.tensor(tokens, device=DEVICE)
            start = ref.state()
            model.load_state(np.frombuffer(ref.kernel_state(model.state_bytes), dtype=np.uint8))
            nxt1, got1 = model.step(tokens)
            ids1 = model.routing()
            model.load_state(tf_state)
            nxt, got = model.step(tokens)
            ids = model.routing()
            tf_state = model.save_state()
            want1, floor1 = one_routing.routed_step(ref, start, tok, ids1, t, floor=True)
            one.step(t, nxt1, got1, want1, inf, None, floor1)
            want, _ = tf_routing.routed_step(ref, start, tok, ids, t)  # the reference goes on from here
            twin.forced = ref.expert_ids
            floor = ((twin.step(tok).float().cpu().numpy() - want) ** 2).sum(-1) ** 0.5 / (want ** 2).sum(-1) ** 0.5
            tf.step(t, nxt, got, want, inf, None, floor)
            got_all.append(got)
            want_all.append(want)
            if t >= len(prompts[0]) - 1:
                for i in range(b):
                    seqs[i].append(int(np.argmax(want[i])))
    del ref, twin
    torch.cuda.empty_cache()
    return seqs, np.stack(got_all), np.stack(want_all)


def run_seed(open_model, config, seed, prompt_len, n_gen, mxfp4, work):
    """open_model(checkpoint dir): the model under test (mkc_runtime.Model's methods)."""
    ckpt = os.path.join(work, f"seed{seed}")
    make(config, ckpt, mxfp4, seed)
    model = open_model(ckpt)
    b = model.batch
    rng = np.random.default_rng(1000 + seed)
    prompts = [list(rng.integers(0, model.vocab, prompt_len)) for _ in range(b)]
    tf, one = TeacherForced(b), TeacherForced(b, cascade=False)
    tf_routing, one_routing = Routing("teacher-forced", b), Routing("one-step", b)
    steps = prompt_len + n_gen - 1
    seqs, got_all, want_all = lockstep(ckpt, prompts, n_gen, steps + 8, model, tf, one, tf_routing, one_routing)
    # State: straight through (no restore) equals the lockstep run, which restored before every step;
    # then the second half again after restoring the state saved halfway.
    model.reset()
    state_err, half_state, straight = 0.0, None, []
    for t in range(steps):
        if t == steps // 2:
            half_state = model.save_state()
        straight.append(model.step([seqs[s][t] for s in range(b)])[1])
        state_err = max(state_err, float(np.abs(straight[-1] - got_all[t]).max()))
    model.load_state(half_state)
    for t in range(steps // 2, steps):
        _, logits = model.step([seqs[s][t] for s in range(b)])
        state_err = max(state_err, float(np.abs(logits - straight[t]).max()))
    # Free-running.
    model.reset()
    gen = [[] for _ in range(b)]
    nxt = None
    for t in range(steps):
        nxt, _ = model.step([prompts[s][t] if t < prompt_len else int(nxt[s]) for s in range(b)])
        if t >= prompt_len - 1:
            for s in range(b):
                gen[s].append(int(nxt[s]))
    never = np.full((b, steps), np.inf)
    free, free_mismatches = free_running(gen, [sq[prompt_len:] for sq in seqs], want_all.transpose(1, 0, 2), never,
                                         prompt_len, n_gen, near=tf.near_tie)
    model.close()
    shutil.rmtree(ckpt, ignore_errors=True)  # real widths: gigabytes per seed
    mismatches = tf.mismatches + tf_routing.mismatches + one.mismatches + one_routing.mismatches + free_mismatches
    return {"seed": seed, "batch": b, "steps": steps, **tf.report(), "state_restore_max_abs_diff": state_err,
            "one_step": one.report(), "routing_followed": tf_routing.followed,
            "one_step_routing_followed": one_routing.followed,
            "largest_departure_followed": max(tf_routing.largest, one_routing.largest),
            "mismatches": mismatches[:10], "free_running": free,
            "ok": not mismatches and tf.ok() and one.ok() and state_err == 0.0}


def table(lib: str, rows: list[dict]) -> str:
    """The report's table: a line per seed (run_seed's rows)."""
    lines = [
        f"{'lib':32} {'seed':>4} {'batch':>5} {'steps':>5} {'max rel L2':>11} {'median':>9} {'floor':>8} {'in floor':>8} "
        f"{'near-ties':>9} {'followed':>8} {'one-step max':>12} {'median':>9} {'followed':>8} {'state':>6}  free-running"]
    for r in rows:
        o = r["one_step"]
        lines.append(
            f"{lib:32} {r['seed']:>4} {r['batch']:>5} {r['steps']:>5} {r['max_rel_l2']:>11.3e} "
            f"{r['median_rel_l2']:>9.2e} {max(r['noise_floor']):>8.2e} {str(r['within_noise_floor']):>8} "
            f"{str(r['near_ties_excluded']):>9} {str(r['routing_followed']):>8} {o['max_rel_l2']:>12.3e} "
            f"{o['median_rel_l2']:>9.2e} {str(r['one_step_routing_followed']):>8} "
            f"{'same' if r['state_restore_max_abs_diff'] == 0 else 'DIFF':>6}  "
            f"{'; '.join(sorted(set(r['free_running'])))}{'' if r['ok'] else '  FAIL: ' + '; '.join(r['mismatches'][:3])}")
    return "\n".join(lines)


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
    work = scratch_dir("mkc_k3_")
    rows = [run_seed(lambda ckpt: Model(args.lib, ckpt), args.config, s, args.prompt_len, args.gen, not args.bf16_experts, work) for s in args.seeds]
    shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lib": os.path.basename(args.lib), "config": args.config, "seeds": rows}, f, indent=1)
    print(table(os.path.basename(args.lib), rows))
    ok = all(r["ok"] for r in rows)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
