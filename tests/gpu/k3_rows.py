"""A K3 library's rows at a long context against its own batch-1 steps, the reference and the benchmark's peer.

The plain tests decode from short prompts; the benchmark starts at position 4000 (bench/k3_bench.py), where
the MLA cache is split over several CTAs and a verify step's rows meet the split boundaries. From one random
state at --pos (random MLA cache rows, conv windows and KDA state per sequence, as the benchmark draws them),
for each --lib (a plain library of batch B, or a verify library of S sequences of T positions):
  lib        its logits for every row: one step, or one verify step of each sequence's T positions
  single     the batch-1 library (--single) through each sequence's positions, one step at a time
  reference  tests/gpu/k3_reference.py in fp32 through the same positions, the sequences in lockstep
  peer       bench/k3_bench.py's PyTorch step at the library's shape (its verify for T > 1), its routed
             experts through torch._grouped_mm and, apart, gathered (bmm); and through grouped_mm routed as
             the reference (forced_peer): the peer keeps bf16 activations, its router scores 1e-3 to 1e-2
             from the reference's, so its own routing flips the reference's near-ties and those rows part
             by tenths (peer_flipped_rows), which is not a fault of its step
and prints the largest relative L2 over rows of lib against single, and of each against the reference.
Exits 1 if a library's row is further than compare's bound (2e-2) from its own single steps, unless the
reference's routing is a near-tie there (compare.routing_tie: a gap under 2e-3 between the k-th and
(k+1)-th expert scores in some layer, at that position or an earlier one of its sequence).

    python3 tests/gpu/k3_rows.py --config model_graphs/kimi_k3/test_8l48e.json \\
        --single target/models/kimi_k3_dims_8l48e_h200/libkimi_k3_dims_8l48e_h200.so \\
        --lib target/models/kimi_k3_dims_8l48e_t4_h200/libkimi_k3_dims_8l48e_t4_h200.so [--lib ...] [--json OUT]
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
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
from checkpoints import scratch_dir  # noqa: E402
from compare import MAX_REL_L2, routing_tie  # noqa: E402
from k3_bench import Peer, peer_weights, random_state  # noqa: E402
from k3_reference import Config, K3Reference, load_checkpoint, pack_state, state_context  # noqa: E402
from make_k3_checkpoint import make  # noqa: E402
from mkc_runtime import Model  # noqa: E402



def per_row(a, b):
    """|a - b| / |b| (L2) of each row, a and b [rows, vocab]."""
    a, b = torch.as_tensor(a).float().cuda(), torch.as_tensor(b).float().cuda()
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).tolist()


def rel(a, b):
    """Largest over rows of |a - b| / |b| (L2 per row)."""
    return max(per_row(a, b))


def library_rows(model, c, state, tokens):
    """The library's logits [S * T, vocab] from `state` (per-sequence kv, conv, ssm at pos)."""
    seqs, t = model.sequences, model.positions
    pos, kv, conv, ssm = state
    model.load_state(np.frombuffer(pack_state(c, seqs, pos, kv, conv, ssm, model.state_bytes), dtype=np.uint8))
    if t > 1:
        return model.verify(tokens.reshape(seqs, t))[3].reshape(seqs * t, -1)
    return model.step(tokens)[1]


def single_rows(model, c, state, tokens, seqs, t):
    """Each sequence's T positions through the batch-1 library, a step at a time: [S * T, vocab]."""
    pos, kv, conv, ssm = state
    out = []
    for s in range(seqs):
        one = ({l: x[s:s + 1] for l, x in kv.items()}, {l: x[s:s + 1] for l, x in conv.items()},
               {l: x[s:s + 1] for l, x in ssm.items()})
        model.load_state(np.frombuffer(pack_state(c, 1, pos, *one, model.state_bytes), dtype=np.uint8))
        for i in range(t):
            out.append(model.step(tokens[s * t + i:s * t + i + 1])[1][0])
    return np.stack(out)


def reference_rows(ckpt, c, state, tokens, seqs, t):
    """The fp32 reference through the T positions, all sequences in lockstep: logits [S * T, vocab], each
    row's routing gap (the smallest over the MoE layers, at its position and the earlier ones) [S * T] and
    its expert ids per MoE layer [S * T, top_k]."""
    pos, kv, conv, ssm = state
    ref = K3Reference(ckpt, batch=seqs, max_ctx=pos + t + 1, device="cuda")
    full = {}
    for l, x in kv.items():
        full[l] = torch.zeros(seqs, pos + t + 1, x.shape[-1], device="cuda")
        full[l][:, :pos] = x[:, :pos].float()
    ref.restore({"seq_len": pos, "kv": full, "conv": {l: x.float() for l, x in conv.items()},
                 "ssm": {l: x.float() for l, x in ssm.items()}})
    steps, gaps, ids = [], [], []
    with torch.no_grad():
        for i in range(t):
            steps.append(ref.step(torch.as_tensor(tokens.reshape(seqs, t)[:, i], device="cuda")).float())
            gap = ref.routing_gap.float().cpu()
            gaps.append(gap if not gaps else torch.minimum(gaps[-1], gap))
            ids.append(dict(ref.expert_ids))
    del ref
    ids = {l: torch.stack([d[l] for d in ids], 1).reshape(seqs * t, -1) for l in ids[0]}
    return torch.stack(steps, 1).reshape(seqs * t, -1), torch.stack(gaps, 1).reshape(-1).tolist(), ids


def peer_rows(c, w, state, tokens, seqs, t, grouped, forced=None):
    """bench/k3_bench.py's step at the library's shape from the same state (uncaptured), the routed experts
    through torch._grouped_mm or gathered, its own routing or `forced` (Peer.forced): [S * T, vocab] and
    its expert ids per MoE layer."""
    pos, kv, conv, ssm = state
    ctx = pos + t + 1
    cache = {}
    for l, x in kv.items():
        cache[l] = torch.zeros(seqs, ctx, x.shape[-1], dtype=torch.bfloat16, device="cuda")
        cache[l][:, :pos] = x[:, :pos]
    st = (cache, {l: x.clone() for l, x in conv.items()}, {l: x.clone() for l, x in ssm.items()})
    peer = Peer(c, w, seqs * t, ctx, pos, st, t)
    peer.grouped = grouped
    peer.forced = forced
    peer.tokens.copy_(torch.as_tensor(tokens, device="cuda"))
    with torch.no_grad():
        logits = peer.step()[0]
    return logits, peer.ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--single", required=True, help="the batch-1 plain library of the config")
    ap.add_argument("--lib", action="append", required=True, help="a plain or verify library of the config")
    ap.add_argument("--pos", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    c = Config.load(args.config)
    work = scratch_dir("mkc_k3_rows_")
    ckpt = os.path.join(work, "ckpt")
    make(args.config, ckpt, True, args.seed)
    w = None if args.no_peer else peer_weights(c, load_checkpoint(ckpt))
    rows, failed = [], False
    one = Model(args.single, ckpt)
    for lib in args.lib:
        model = Model(lib, ckpt)
        seqs, t = model.sequences, model.positions
        kv, conv, ssm = random_state(c, seqs, args.pos, args.pos, args.seed + 1)
        state = (args.pos, kv, conv, ssm)
        g = torch.Generator(device="cuda").manual_seed(args.seed + 2)
        tokens = torch.randint(0, c.vocab, (seqs * t,), generator=g, device="cuda").cpu().numpy().astype(np.int32)
        mine = library_rows(model, c, state, tokens)
        model.close()
        single = single_rows(one, c, state, tokens, seqs, t)
        ref, gaps, ref_ids = reference_rows(ckpt, c, state, tokens, seqs, t)
        row = {"lib": os.path.basename(lib), "sequences": seqs, "positions": t, "pos": args.pos,
               "lib_vs_single": rel(mine, single), "lib_vs_reference": rel(mine, ref),
               "single_vs_reference": rel(single, ref), "rows_lib_vs_single": per_row(mine, single),
               "rows_lib_vs_reference": per_row(mine, ref), "rows_routing_gap": gaps}
        if w is not None:
            peer, peer_ids = peer_rows(c, w, state, tokens, seqs, t, True)
            row["peer_vs_reference"] = rel(peer, ref)
            row["lib_vs_peer"] = rel(mine, peer)
            row["gathered_peer_vs_reference"] = rel(peer_rows(c, w, state, tokens, seqs, t, False)[0], ref)
            row["forced_peer_vs_reference"] = rel(peer_rows(c, w, state, tokens, seqs, t, True, ref_ids)[0], ref)
            row["peer_flipped_rows"] = [i for i in range(seqs * t) if any(
                set(peer_ids[l][i].tolist()) != set(ref_ids[l][i].tolist()) for l in ref_ids)]
        # Rows past the bound, each excused only by a routing near-tie of the reference there.
        far = row["rows_lib_vs_single"]
        row["ties"] = [i for i, (d, g) in enumerate(zip(far, gaps)) if d > MAX_REL_L2 and routing_tie(g, None)]
        row["pass"] = all(d <= MAX_REL_L2 or i in row["ties"] for i, d in enumerate(far))
        failed |= not row["pass"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    one.close()
    shutil.rmtree(work, ignore_errors=True)
    keys = ["lib_vs_single", "lib_vs_reference", "single_vs_reference", "peer_vs_reference", "lib_vs_peer",
            "gathered_peer_vs_reference", "forced_peer_vs_reference"]
    print(f"{'library':38} {'S':>2} {'T':>2} " + " ".join(f"{k:>19}" for k in keys) + "  check")
    for r in rows:
        print(f"{r['lib']:38} {r['sequences']:2d} {r['positions']:2d} "
              + " ".join(f"{r[k]:19.2e}" if k in r else f"{'-':>19}" for k in keys)
              + ("  pass" if r["pass"] else "  FAIL")
              + (f" (routing near-tie at rows {r['ties']})" if r["ties"] else "")
              + (f" (peer routed otherwise at rows {r['peer_flipped_rows']})" if r.get("peer_flipped_rows") else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("FAIL" if failed else "PASS")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
