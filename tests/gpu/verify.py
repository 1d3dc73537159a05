"""Speculative verify steps (mkc_model_verify) against plain greedy decoding (mkc_model_step), on the GPU.

Two libraries of one config and batch: PLAIN (positions 1) and VERIFY (`mkc codegen --positions T`), the same
random checkpoint. For each seed:
  1. PLAIN decodes a random prompt per sequence, then --steps greedy tokens a step at a time: the reference
     tokens, each step's top-2 logit margin, and its state (positions, KV caches) after each step.
  2. VERIFY's first step from PLAIN's state after the prompt, the reference's tokens as drafts: every
     position's logits within 2e-2 of the largest of PLAIN's at that step. Then VERIFY starts from PLAIN's
     state after the prompt (the two programs' states are laid out alike) and
     decodes until every sequence has --steps tokens, each step a sequence's last token and T - 1 drafts
     from one source:
       right   the reference's next tokens (every draft stands)
       wrong   the reference's tokens plus one (none stands)
       mixed   the reference's tokens, each replaced by a random one with probability 1/2
       ngram   prompt lookup over the sequence's history (device/mkc/speculative.h's ngram_draft)
     Its tokens must equal the reference's, or part from them only at a near-tie of the reference's logits
     (compare.NEAR_TIE) or after a routing flip (below); the drafts that stood are counted.
     Routing: every row whose inputs are the reference's (a sequence's last token and the drafts that
     stood) routes as PLAIN's step of that token did (both libraries' routing logs, expert sets per
     router), or its first difference is a flip of the last pick alone (one expert out, one in, each the
     last of its top-k: a near-tie of the (k)-th and (k+1)-th choices, which the two programs' numerics --
     a verify step has positions x sequences rows, and the MXFP4 experts round 5 to 8 rows' inputs to one
     fp16 part -- may order either way). After such a flip the sequence's tokens and state may part.
  3. After the `wrong` run (every step rejects T - 1 rows), VERIFY's state against PLAIN's after as many
     tokens, through save_state: PLAIN's next step from each gives the same logits (within compare's bound
     of 2e-2 relative), the positions are equal, and so is every part of the state within 2e-2 of its
     largest value: K2's MLA cache rows before the positions; K3's too, its conv windows and KDA's
     recurrent state whole (cache rows past the positions hold rejected drafts, which no later step reads);
     Kimi Linear's through the next step alone. A sequence whose routing flipped is compared before the
     flip's row (its cache rows) or not at all (its next step, windows and recurrent state).
  4. mkc_model_generate_speculative (prompt lookup, one launch) from the same start: the reference's tokens
     and, after them, PLAIN's state (step 2's routing flips excused as there); on the first seed, tokens/s
     per user over --bench tokens against PLAIN's single steps, from a repetitive prompt and from a random
     one.
  5. mkc_model_step on VERIFY, and a verify step that would pass the context, refused by name.

    python3 tests/gpu/verify.py --plain LIB --verify LIB --config CONFIG [--arch deepseek_v3|k3|kimi_linear]
        [--seeds 0 1 2] [--steps 64] [--json OUT]
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
from compare import NEAR_TIE, margin  # noqa: E402
from generate import refused  # noqa: E402
from mkc_runtime import Model  # noqa: E402

SOURCES = ("right", "wrong", "mixed", "ngram")


def ngram_draft(history, min_n, max_n, max_draft):
    """device/mkc/speculative.h's ngram_draft: the longest recurring n-gram ending the history, its earliest
    earlier occurrence with tokens after it, up to max_draft of those."""
    length = len(history)
    for n in range(max_n, max(min_n, 1) - 1, -1):
        if n >= length:
            continue
        tail = history[length - n:]
        for i in range(length - n):
            if history[i:i + n] == tail:
                return history[i + n:i + n + max_draft]
    return []


def drafts(source, ref, done, history, count, vocab, rng):
    """count drafts for a sequence that has produced `done` tokens (ref[done] is the next one's reference)."""
    want = [int(x) for x in ref[done + 1:done + 1 + count]]
    want += [int(x) for x in rng.integers(0, vocab, count - len(want))]
    if source == "right":
        return want
    if source == "wrong":
        return [(t + 1) % vocab for t in want]
    if source == "mixed":
        return [t if rng.random() < 0.5 else int(rng.integers(0, vocab)) for t in want]
    got = ngram_draft(history, 1, 3, count)
    return got + [int(x) for x in rng.integers(0, vocab, count - len(got))]


def routing_flip(want, got):
    """PLAIN's routing of a token [routers, top_k] against VERIFY's of the same token: None where every
    router chose the same experts, else the first router that did not, with its picks and whether the
    difference is the last pick's alone (one expert out, one in, each ranked last)."""
    for router, (w, g) in enumerate(zip(want, got)):
        if set(w.tolist()) == set(g.tolist()):
            continue
        out, came = set(w.tolist()) - set(g.tolist()), set(g.tolist()) - set(w.tolist())
        last = len(out) == 1 and len(came) == 1 and int(w[-1]) in out and int(g[-1]) in came
        return {"router": router, "plain": w.tolist(), "verify": g.tolist(), "last_pick": last}
    return None


def run_verify(model, start, source, ref, margins, routes, prompt, rng):
    """Decodes with VERIFY from `start` until every sequence has len(ref) tokens; `routes` [n, routers, b,
    top_k] is PLAIN's routing at each reference step. Returns (tokens per sequence, drafts accepted, verify
    steps, the first unexplained difference or None, each sequence's first routing flip or None)."""
    model.load_state(start)
    b, t, n = model.sequences, model.positions, ref.shape[0]
    out = [[] for _ in range(b)]
    flips = [None] * b
    last = [int(x) for x in prompt[-1]]
    accepted_total, steps = 0, 0
    while min(len(o) for o in out) < n:
        tokens = np.zeros((b, t), dtype=np.int32)
        for s in range(b):
            history = [int(x) for x in prompt[:, s]] + out[s]
            tokens[s] = [last[s]] + drafts(source, ref[:, s], len(out[s]) - 1, history, t - 1, model.vocab, rng)
        accepted, nxt, _, _ = model.verify(tokens)
        got_routes = model.routing().reshape(routes.shape[1], b, t, -1) if routes is not None else None
        steps += 1
        for s in range(b):
            done = len(out[s])
            # Rows 0..accepted[s] had the reference's inputs while the sequence still follows it.
            if routes is not None and flips[s] is None and [int(x) for x in ref[:done, s]] == out[s][:n]:
                for j in range(int(accepted[s]) + 1):
                    if done + j >= n:
                        break
                    flip = routing_flip(routes[done + j, :, s], got_routes[:, s, j])
                    if flip:
                        flips[s] = dict(flip, token=done + j)
                        break
            got = [int(x) for x in tokens[s, 1:1 + accepted[s]]] + [int(nxt[s])]
            out[s] += got
            last[s] = int(nxt[s])
            accepted_total += int(accepted[s])
    got = np.array([o[:n] for o in out], dtype=np.int32).T
    return out, accepted_total, steps, first_difference(got, ref, margins, flips), flips


def first_difference(got, ref, margins, flips):
    """Where got [n, sequences] parts from ref: each sequence's first differing token with the reference's
    top-2 margin there, excused at a near-tie (below compare.NEAR_TIE) or at or after the sequence's routing
    flip of the last pick (`flips[s]`, see routing_flip); of those, the first that is not excused, else the
    first (every sequence is looked at: one sequence's excused difference must not hide another's), with
    all of them under "sequences"; or None."""
    firsts = []
    for s in range(ref.shape[1]):
        for i in range(ref.shape[0]):
            if got[i, s] != ref[i, s]:
                flip = flips[s]
                after_flip = flip is not None and flip["last_pick"] and flip["token"] <= i
                near_tie = bool(margins[i, s] < NEAR_TIE)
                firsts.append({"sequence": s, "token": i, "margin": float(margins[i, s]), "near_tie": near_tie,
                               "after_routing_flip": after_flip, "excused": near_tie or after_flip})
                break
    if not firsts:
        return None
    worst = next((d for d in firsts if not d["excused"]), firsts[0])
    return dict(worst, sequences=firsts)


def earliest_flips(runs):
    """Per sequence, the earliest of the runs' first routing flips (or None)."""
    out = []
    for per_run in zip(*runs):
        found = [f for f in per_run if f is not None]
        out.append(min(found, key=lambda f: f["token"]) if found else None)
    return out


def parted(flips, diff):
    """Per sequence, where its tokens or its state may part from the reference's: the earliest of its routing
    flip and its first (excused) token difference, as {"token": i}, or None; the state checks compare the
    others, and each sequence's cache rows before that token."""
    out = [None if f is None else {"token": f["token"]} for f in flips]
    for d in (diff or {}).get("sequences", []):
        s = d["sequence"]
        if out[s] is None or d["token"] < out[s]["token"]:
            out[s] = {"token": d["token"]}
    return out


def bench(plain, verify, start, prompt, n, rng):
    """Tokens/s per user (wall clock) over n tokens: PLAIN's single steps and its greedy generation in one
    launch against generation with prompt lookup in one launch on VERIFY, from a prompt that repeats a motif
    in every sequence and from a random one."""
    out = {}
    b = plain.batch
    for kind in ("repetitive", "random"):
        motif = rng.integers(0, plain.vocab, 5)
        hist = np.stack([np.tile(motif, 4) if kind == "repetitive" else rng.integers(0, plain.vocab, 20)
                         for _ in range(b)]).astype(np.int32)
        plain.load_state(start)
        t0 = time.perf_counter()
        tok = hist[:, -1]
        for _ in range(n):
            tok, _ = plain.step(tok)
        single = time.perf_counter() - t0
        plain.load_state(start)
        t0 = time.perf_counter()
        plain.generate(hist[:, -1], n)
        launch = time.perf_counter() - t0
        verify.load_state(start)
        t0 = time.perf_counter()
        _, steps = verify.generate_speculative(hist, n)
        spec = time.perf_counter() - t0
        out[kind] = {"tokens": n, "single_steps_tokens_per_s_per_user": n / single,
                     "one_launch_tokens_per_s_per_user": n / launch,
                     "speculative_tokens_per_s_per_user": n / spec, "verify_steps": steps,
                     "tokens_per_verify_step": n / steps}
    return out


def same_positions(pa, pb, limit):
    """Each sequence's positions equal, but where it parted from the reference (limit[s], its parting row,
    below them: after that its own tokens may accept other drafts)."""
    return all(x == y or lim < min(x, y) for x, y, lim in zip(pa.tolist(), pb.tolist(), limit))


def cache_rows_equal(model, a, b, layers, ctx, limit):
    """Positions equal, and every state byte row before them (and before limit[s]: a routing flip's row)
    equal to bf16 rounding: the state is positions [sequences] int32, then per layer [sequences][ctx][row]
    bf16 (K2: the MLA caches)."""
    seqs = model.sequences
    pa, pb = a[: 4 * seqs].view(np.int32), b[: 4 * seqs].view(np.int32)
    if not same_positions(pa, pb, limit):
        return False, f"positions {pa.tolist()} against {pb.tolist()}"
    rest = (a.size - 4 * seqs) // 2
    row = rest // (layers * seqs * ctx)
    ca = a[4 * seqs:].view(np.uint16).reshape(layers, seqs, ctx, row)
    cb = b[4 * seqs:].view(np.uint16).reshape(layers, seqs, ctx, row)
    worst = 0.0
    for s in range(seqs):
        rows = min(int(pa[s]), int(pb[s]), limit[s])
        if rows == 0:
            continue
        fa = (ca[:, s, :rows].astype(np.uint32) << 16).view(np.float32)
        fb = (cb[:, s, :rows].astype(np.uint32) << 16).view(np.float32)
        worst = max(worst, float(np.abs(fa - fb).max() / max(np.abs(fb).max(), 1e-6)))
    return worst < 2e-2, f"cache rows before the positions: max difference {worst:.2e} of the largest value"


def k3_state_equal(c, seqs, a, b, limit):
    """A K3 state (k3_reference.pack_state's layout) against another: positions equal (same_positions); per KDA layer the
    conv windows and the recurrent state whole, per MLA layer the cache rows before the positions, each
    within 2e-2 of its largest value (rows past the positions hold rejected drafts, which no step reads).
    A sequence whose routing flipped (limit[s] below its position: the flip's row) is compared before the
    flip in its cache rows only: its windows and recurrent state hold every token since."""
    from k3_reference import state_context

    pa, pb = a[: 4 * seqs].view(np.int32), b[: 4 * seqs].view(np.int32)
    if not same_positions(pa, pb, limit):
        return False, f"positions {pa.tolist()} against {pb.tolist()}"
    ctx = state_context(c, seqs, a.size)
    p = c.kda_heads * c.kda_dim
    at, worst = 4 * seqs, {"conv": 0.0, "recurrent": 0.0, "cache": 0.0}

    def rel(x, y):
        return float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-6)) if x.size else 0.0

    def bf16(buf, shape):
        return (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)

    for layer in range(c.layers):
        if c.is_mla(layer):
            n = seqs * ctx * (c.kv_lora + c.rope) * 2
            ca, cb = (bf16(x[at:at + n], (seqs, ctx, c.kv_lora + c.rope)) for x in (a, b))
            for s in range(seqs):
                rows = min(int(pa[s]), int(pb[s]), limit[s])
                worst["cache"] = max(worst["cache"], rel(ca[s, :rows], cb[s, :rows]))
            at += n
        else:
            whole = [s for s in range(seqs) if limit[s] >= min(pa[s], pb[s])]
            for _ in range(3):  # q, k, v windows
                n = seqs * (c.conv - 1) * p * 2
                wa, wb = (bf16(x[at:at + n], (seqs, -1))[whole] for x in (a, b))
                worst["conv"] = max(worst["conv"], rel(wa, wb))
                at += n
            n = seqs * c.kda_heads * c.kda_dim * c.kda_dim * 4
            ra, rb = (x[at:at + n].view(np.float32).reshape(seqs, -1)[whole] for x in (a, b))
            worst["recurrent"] = max(worst["recurrent"], rel(ra, rb))
            at += n
    ok = max(worst.values()) < 2e-2
    return ok, "state: max difference of the largest value: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())


def flip_rows(start, flips):
    """Per sequence, the cache row its routing flip wrote (its position at `start` plus the flip's token),
    or a bound past every row where its routing did not flip."""
    pos = start[: 4 * len(flips)].view(np.int32)
    return [int(pos[s]) + f["token"] if f is not None else 1 << 30 for s, f in enumerate(flips)]


def state_parts_equal(args, verify, got, want, limit):
    """The state part by part where its layout is known here: K2's MLA cache rows, K3's windows, recurrent
    states and cache rows (each sequence's before limit[s]); (what, ok, message), or None (Kimi Linear: the
    next step's check alone)."""
    if args.arch == "deepseek_v3":
        return ("cache rows",) + cache_rows_equal(verify, got, want, args.layers, verify.context, limit)
    if args.arch == "k3":
        return ("conv windows, recurrent state, cache rows",) + k3_state_equal(args.k3, verify.sequences, got, want,
                                                                               limit)
    return None


def same_next_step(plain, state, want, token, flips):
    """PLAIN's next step (token) from `state` (another program's, through save_state) against its step from
    its own state `want`: logits within 2e-2 of the largest, in the sequences that did not part (`flips`: a
    routing flip or a token difference, as `parted` gives them)."""
    plain.load_state(state)
    _, got = plain.step(token)
    plain.load_state(want)
    _, ref = plain.step(token)
    kept = [s for s, f in enumerate(flips) if f is None]
    if not kept:
        return True, "the next step's logits from it: every sequence parted from the reference, none compared"
    got, ref = got[kept], ref[kept]
    worst = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6))
    return worst < 2e-2, f"the next step's logits from it ({len(kept)} sequences): max difference {worst:.2e} of the largest"


def run_seed(args, seed, work):
    ckpt = os.path.join(work, f"seed{seed}")
    make_checkpoint(args.arch, args.config, seed, ckpt)
    plain, verify = Model(args.plain, ckpt), Model(args.verify, ckpt)
    row = {"seed": seed, "positions": verify.positions, "checks": {}, "sources": {}}
    checks = row["checks"]
    b = plain.batch
    if verify.sequences != b or verify.state_bytes != plain.state_bytes:
        raise SystemExit(f"{args.verify}: {verify.sequences} sequences of state {verify.state_bytes} bytes; "
                         f"{args.plain} has {b} of {plain.state_bytes}: not the same config and batch")
    rng = np.random.default_rng(3000 + seed)
    # A repetitive half (prompt lookup finds its n-grams) and a random half.
    motif = rng.integers(0, plain.vocab, 5)
    prompt = np.stack([np.tile(motif, 4) if s % 2 == 0 else rng.integers(0, plain.vocab, 20) for s in range(b)],
                      axis=1).astype(np.int32)
    for tok in prompt[:-1]:
        plain.step(tok)
    start = plain.save_state()
    ref, margins, states, first, routes = [], [], [], [], []
    tok = prompt[-1]
    for i in range(args.steps):
        tok, logits = plain.step(tok)
        if plain.router_top_k:
            routes.append(plain.routing())
        ref.append(tok.copy())
        margins.append([margin(logits[s]) for s in range(b)])
        states.append(plain.save_state())
        if i < verify.positions:
            first.append(logits)
    ref, margins = np.stack(ref), np.array(margins)
    routes = np.stack(routes) if routes else None  # [steps, routers, b, top_k]
    # The first verify step with the reference's tokens as drafts: each position's logits against the plain
    # step's at that position (every row, not only its argmax).
    verify.load_state(start)
    t = verify.positions
    tokens = np.stack([np.concatenate([[prompt[-1, s]], ref[: t - 1, s]]) for s in range(b)]).astype(np.int32)
    _, _, _, logits = verify.verify(tokens)
    want = np.stack(first, 1)  # [sequences, positions, vocab]
    worst = float(np.abs(logits - want).max() / max(np.abs(want).max(), 1e-6))
    checks["every position's logits"] = worst < 2e-2
    row["logits"] = f"the first verify step's logits against the plain steps': max difference {worst:.2e} of the largest"
    runs = []
    for source in SOURCES:
        out, accepted, steps, diff, flips = run_verify(verify, start, source, ref, margins, routes, prompt, rng)
        runs.append(flips)
        checks[f"{source}: tokens equal"] = diff is None or diff["excused"]
        checks[f"{source}: routing as plain's, or a flip of the last pick"] = all(
            f is None or f["last_pick"] for f in flips)
        row["sources"][source] = {"verify_steps": steps, "drafts_accepted": accepted, "difference": diff,
                                  "routing_flips": flips,
                                  "tokens_per_step": sum(min(len(o), args.steps) for o in out) / (steps * b)}
        if source == "wrong" and (diff is None or diff["excused"]):
            # Every sequence advanced one token a step: the state after `steps` tokens.
            after, apart = verify.save_state(), parted(flips, diff)
            ok, msg = same_next_step(plain, after, states[steps - 1], ref[steps - 1], apart)
            checks["state after rejections: next step"] = ok
            row["state"] = msg
            parts = state_parts_equal(args, verify, after, states[steps - 1], flip_rows(start, apart))
            if parts:
                what, ok, msg = parts
                checks[f"state after rejections: {what}"] = ok
                row["state"] += "; " + msg
    # Generation with prompt-lookup drafts (mkc_model_generate_speculative) from the same start.
    verify.load_state(start)
    # One launch logs no step's routing: the runs' flips stand for it (the same reference, the same program).
    got, steps = verify.generate_speculative(prompt.T, args.steps)
    flips = earliest_flips(runs)
    diff = first_difference(got.T, ref, margins, flips)
    checks["generate_speculative: tokens equal"] = diff is None or diff["excused"]
    row["generate_speculative"] = {"verify_steps": steps, "tokens_per_step": args.steps / steps, "difference": diff}
    if diff is None or diff["excused"]:
        after, apart = verify.save_state(), parted(flips, diff)
        ok, msg = same_next_step(plain, after, states[-1], ref[-1], apart)
        checks["generate_speculative: state"] = ok
        row["generate_speculative"]["state"] = msg
        parts = state_parts_equal(args, verify, after, states[-1], flip_rows(start, apart))
        if parts:
            what, ok, msg = parts
            checks[f"generate_speculative: {what}"] = ok
            row["generate_speculative"]["state"] += "; " + msg
    if seed == args.seeds[0] and args.bench:
        row["bench"] = bench(plain, verify, start, prompt, args.bench, rng)
    checks["mkc_model_step refused"], row["step message"] = refused(
        lambda: verify.step(np.zeros(verify.batch, dtype=np.int32)), "verify step")
    full = start.copy()
    full[: 4 * b].view(np.int32)[:] = verify.context - verify.positions + 1
    verify.load_state(full)
    checks["past the context refused"], row["context message"] = refused(
        lambda: verify.verify(np.zeros((b, verify.positions), dtype=np.int32)), "context")
    plain.close()
    verify.close()
    shutil.rmtree(ckpt, ignore_errors=True)
    row["pass"] = all(checks.values())
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plain", required=True, help="the library of positions 1")
    ap.add_argument("--verify", required=True, help="the library of the same config and batch, positions T")
    ap.add_argument("--config", required=True)
    ap.add_argument("--arch", choices=["deepseek_v3", "k3", "kimi_linear"], default="deepseek_v3")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--bench", type=int, default=256, help="tokens timed each way on the first seed (0: none)")
    ap.add_argument("--json")
    args = ap.parse_args()
    with open(args.config) as f:
        config = json.load(f)
        args.layers = config.get("text_config", config)["num_hidden_layers"]
    if args.arch == "k3":
        from k3_reference import Config

        args.k3 = Config.load(args.config)
    work = scratch_dir("mkc_verify_")
    rows = [run_seed(args, seed, work) for seed in args.seeds]
    shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plain": args.plain, "verify": args.verify, "config": args.config, "seeds": rows}, f, indent=1)
    print(f"{'seed':>4} {'T':>2} " + " ".join(f"{s + ' tok/step':>16}" for s in SOURCES + ("generate",)) +
          "  checks")
    for r in rows:
        per = " ".join(f"{r['sources'][s]['tokens_per_step']:>16.2f}" for s in SOURCES)
        per += f" {r['generate_speculative']['tokens_per_step']:>16.2f}"
        bad = [k for k, v in r["checks"].items() if not v]
        print(f"{r['seed']:>4} {r['positions']:>2} {per}  {'all pass' if not bad else 'FAIL: ' + '; '.join(bad)}")
    for r in rows:
        print(f"seed {r['seed']}: {r['logits']}")
    for r in rows:
        for source, m in r["sources"].items():
            for s, f in enumerate(m["routing_flips"]):
                if f is not None:
                    print(f"seed {r['seed']} {source}: sequence {s}'s routing flipped at token {f['token']}, router "
                          f"{f['router']}: plain {f['plain']}, verify {f['verify']}"
                          f"{'' if f['last_pick'] else ' (NOT the last pick alone)'}")
    for r in rows:
        for kind, m in r.get("bench", {}).items():
            print(f"seed {r['seed']} {kind} prompt: {m['tokens']} tokens, single steps "
                  f"{m['single_steps_tokens_per_s_per_user']:.1f} tok/s/user, one launch "
                  f"{m['one_launch_tokens_per_s_per_user']:.1f}, prompt lookup in one launch "
                  f"{m['speculative_tokens_per_s_per_user']:.1f} ({m['tokens_per_verify_step']:.2f} a verify step)")
    ok = all(r["pass"] for r in rows)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
