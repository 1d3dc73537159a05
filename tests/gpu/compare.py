"""The checks shared by the GPU comparisons (deepseek_v3_decode.py against
transformers, k3_decode.py against the project's K3 reference): the compiled
model's logits against a reference's, step by step, per sequence.

Teacher-forced (the model is fed the reference's tokens):
  - the logits' relative L2 error at every step <= MAX_REL_L2;
  - the argmax equal at every step whose reference top-2 margin is not a
    near-tie (margin below NEAR_TIE); at most 2 steps excluded per sequence;
  - a step whose reference routing is itself a near-tie (the k-th and
    (k+1)-th expert choice scores within ROUTING_NEAR_TIE in some layer, or
    within twice the router noise at that step: the largest change of any
    selection score when the reference itself rounds its projections'
    outputs to bf16, as the kernel stores its activations; rounding upstream
    may swap the expert) is excused from the bound and from the argmax check,
    counted (at most 2 per sequence when a flip ends the comparison). If the model did take the other expert there
    (its error at that step is over the bound), what it keeps (KV cache rows,
    recurrent state) legitimately differs from the reference's from then on:
    the sequence's later steps are reported but not held to the bounds.
  - with a noise floor (K3: the distance between the reference and itself
    keeping its state in the graph's dtypes, bf16 KV cache rows and conv
    windows, the same routing; k3_decode.py): a step's bound is the larger of
    MAX_REL_L2 and FLOOR_FACTOR times the floor: teacher-forced, the largest
    floor so far in the sequence (the rounding accumulates in the state); one
    step at a time, that step's (the reference's step from its state rounded to
    bf16). On a small random K3 the storage dtypes alone move the logits by
    more than MAX_REL_L2 at some steps. Steps over MAX_REL_L2 but within the
    bound are counted and reported. The argmax near-tie margin scales with the
    bound (NEAR_TIE x bound / MAX_REL_L2): logits allowed to move further may
    swap closer-run tokens.
Free-running greedy decode equals the reference's, or the first divergence is
at a near-tie (of the logits or of the routing).
"""

from __future__ import annotations

import numpy as np

NEAR_TIE = 1e-2
MAX_REL_L2 = 2e-2
ROUTING_NEAR_TIE = 2e-3
ROUTING_NOISE_FACTOR = 2.0  # the gap closes when one score moves up and the other down
# A step's bound where a noise floor is given: FLOOR_FACTOR times the floor (the floor is one
# realisation of the storage dtypes' rounding; the model under test rounds at the same places but
# sums in another order, with its own fast-math functions).
FLOOR_FACTOR = 2.0


def routing_tie(gap: float, noise: float | None) -> bool:
    """Whether the reference's routing at a step is a near-tie: its gap under
    ROUTING_NEAR_TIE, or under twice the router noise measured at that step."""
    return gap < max(ROUTING_NEAR_TIE, ROUTING_NOISE_FACTOR * (noise or 0.0))


def routing_departure(scores, ids, k: int) -> float:
    """How far the experts `ids` (a model's choice for one sequence in one MoE layer) are from the
    reference's top-k by its selection scores `scores` [E]: 0 when they are the same set; else the
    largest score distance by which a picked expert falls below the reference's k-th choice, or a
    dropped one rises above its (k+1)-th; inf for ids that are not k distinct experts."""
    ids = [int(i) for i in ids]
    if len(set(ids)) != k or not all(0 <= i < len(scores) for i in ids):
        return float("inf")
    order = np.argsort(-np.asarray(scores), kind="stable")
    own, got = {int(i) for i in order[:k]}, set(ids)
    if own == got:
        return 0.0
    kth, after = float(scores[order[k - 1]]), float(scores[order[k]])
    return max([kth - float(scores[x]) for x in got - own] + [float(scores[y]) - after for y in own - got])


def margin(row) -> float:
    """The top-2 margin as a fraction of the top logit's magnitude."""
    top = np.sort(row)[-2:]
    return float(top[1] - top[0]) / max(abs(float(top[1])), 1e-6)


class TeacherForced:
    """Feed it each step's kernel output; `want[s]` is the reference's logits
    for sequence s at that step and `gaps[s]` its routing gap."""

    def __init__(self, batch: int, cascade: bool = True):
        """cascade=False: each step starts from the reference's own state (k3_decode.py's
        one-step check), so a routing flip excuses only its own step."""
        self.b = batch
        self.cascade = cascade
        self.worst = 0.0
        self.errors: list[tuple[float, int, int]] = []
        self.bounded: list[float] = []  # the errors of the steps held to the bound
        self.mismatches: list[str] = []
        self.excluded = [0] * batch
        self.routing_excluded = [0] * batch
        self.routed_apart = [None] * batch  # step where the model took the other expert of a routing near-tie
        self.floor = [0.0] * batch  # the noise floor per sequence (see step)
        self.largest_floor = [0.0] * batch
        self.within_floor = [0] * batch  # steps over MAX_REL_L2 held to the floor's bound instead
        self.near_tie: list[list[float]] = [[] for _ in range(batch)]  # per sequence and step: the margin threshold
        self.steps: list[dict] = []  # per sequence and step: error, bound, margin (the JSON report)

    def step(self, t: int, nxt, logits, want, gaps, noise=None, floor=None) -> None:
        """noise[s]: the router noise of sequence s at this step (or None); floor[s]: the
        distance between the reference and its bf16 twin at this step (or None)."""
        for s in range(self.b):
            w = want[s]
            rel = float(np.linalg.norm(logits[s] - w) / np.linalg.norm(w))
            if floor is not None:  # teacher-forced: the largest so far; one step at a time: this step's
                self.floor[s] = max(self.floor[s], float(floor[s])) if self.cascade else float(floor[s])
                self.largest_floor[s] = max(self.largest_floor[s], self.floor[s])
            self.errors.append((rel, s, t))
            if int(nxt[s]) != int(np.argmax(logits[s])):
                self.mismatches.append(f"seq {s} step {t}: kernel argmax differs from its own logits")
            bound = max(MAX_REL_L2, FLOOR_FACTOR * self.floor[s])
            near = NEAR_TIE * bound / MAX_REL_L2
            self.near_tie[s].append(near)
            self.steps.append({"seq": s, "step": t, "rel_l2": rel, "bound": bound, "margin": margin(w),
                               "argmax_equal": int(nxt[s]) == int(np.argmax(w))})
            if self.routed_apart[s] is not None:
                continue
            tie = routing_tie(float(gaps[s]), None if noise is None else float(noise[s]))
            if rel > MAX_REL_L2 and tie:
                self.routing_excluded[s] += 1
                if self.cascade:
                    self.routed_apart[s] = t
            else:
                self.worst = max(self.worst, rel)
                self.bounded.append(rel)
                if rel > bound:
                    self.mismatches.append(f"seq {s} step {t}: rel L2 {rel:.3g} over the bound {bound:.3g}")
                elif rel > MAX_REL_L2:
                    self.within_floor[s] += 1
            if int(nxt[s]) != int(np.argmax(w)):
                if tie and rel > MAX_REL_L2:
                    pass  # the other expert's logits: counted above with the routing near-ties
                elif margin(w) < near:
                    self.excluded[s] += 1
                else:
                    self.mismatches.append(f"seq {s} step {t}: argmax {int(nxt[s])} vs {int(np.argmax(w))}, "
                                           f"margin {margin(w):.3g}")

    def ok(self) -> bool:
        # Steps excused for a routing near-tie: at most 2 per sequence when a
        # flip ends the comparison (cascade), any number in the one-step check,
        # where each is independent (a wrong router shows at the steps that
        # are not near-ties, which are always held to the bound).
        routing_ok = not self.cascade or max(self.routing_excluded) <= 2
        return not self.mismatches and max(self.excluded) <= 2 and routing_ok

    def report(self) -> dict:
        return {
            "max_rel_l2": self.worst,
            "worst_steps": [{"rel_l2": r, "seq": s, "step": t} for r, s, t in sorted(self.errors, reverse=True)[:5]],
            "median_rel_l2": float(np.median(self.bounded)) if self.bounded else float("nan"),
            "steps_bounded": len(self.bounded),
            "near_ties_excluded": self.excluded,
            "routing_near_ties_excluded": self.routing_excluded,
            "routed_apart_at": self.routed_apart,
            "noise_floor": self.largest_floor,
            "per_step": self.steps,
            "within_noise_floor": self.within_floor,
        }


def free_running(gen, ref_tokens, want, gaps, prompt_len: int, n_gen: int, noise=None,
                 near=None) -> tuple[list[str], list[str]]:
    """gen[s]: the model's greedy tokens; ref_tokens[s]: the reference's
    (after the prompt); want[s][t] / gaps[s][t] / noise[s][t]: the reference's
    logits, routing gap and router noise at step t; near[s][t]: the argmax
    near-tie margin at step t (TeacherForced.near_tie; NEAR_TIE if None).
    Returns (one line per sequence, mismatches)."""
    lines, mismatches = [], []
    for s in range(len(gen)):
        got, ref = list(gen[s][:n_gen]), list(ref_tokens[s][:n_gen])
        if got == ref:
            lines.append("equal")
            continue
        i = next(i for i in range(n_gen) if got[i] != ref[i])
        m = margin(want[s][prompt_len - 1 + i])
        gap = float(gaps[s][prompt_len - 1 + i])
        nz = None if noise is None else float(noise[s][prompt_len - 1 + i])
        tie = m < (NEAR_TIE if near is None else near[s][prompt_len - 1 + i]) or routing_tie(gap, nz)
        lines.append(f"diverges at {i} (margin {m:.3g}, routing gap {gap:.2g}"
                     f"{'' if nz is None else f', router noise {nz:.2g}'}, {'near-tie' if tie else 'NOT a near-tie'})")
        if not tie:
            mismatches.append(f"seq {s} step {prompt_len + i}: free-running decode diverges away from a near-tie")
    return lines, mismatches
