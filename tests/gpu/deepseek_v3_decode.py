"""The megakernel against transformers' DeepseekV3ForCausalLM or
KimiLinearForCausalLM (--arch kimi_linear), run on the H200.

For each seed: a random model with the given config (weights drawn
with unit-scale fan-in variance so that logits are not near-ties), saved by
transformers `save_pretrained` in bf16; the reference is transformers in fp32
on the saved bf16 weights (eager attention, no cache: every step recomputes
the whole sequence). The compiled model (a library built by
scripts/build_model.sh from `mkc codegen` output) loads the same checkpoint.

Checks (tests/gpu/compare.py), per seed and per sequence of the batch:
teacher-forced over the prompt plus the reference's greedy tokens, the
logits' relative L2 error <= 2e-2 and the argmax equal away from near-ties
(at most 2 excluded; steps where the reference's routing is a near-tie are
excused and counted, and if the kernel took the other expert there, the
sequence's later steps are reported, not bounded); free-running greedy decode
equal to the reference's or diverging first at a near-tie.
And once: a checkpoint with a tensor missing, and one with a tensor of the
wrong shape, are refused with the tensor's name.

With --fp8 (a library compiled from a config with K2's quantization_config):
the saved checkpoint is quantised to K2's released FP8 format and the library
loads that; the reference runs in fp32 on its dequantised weights
(tests/gpu/fp8_checkpoint.py, each block checked).

    python3 tests/gpu/deepseek_v3_decode.py --lib LIB --config CONFIG --seeds 0 1 2 [--arch kimi_linear] [--fp8] [--json OUT]
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

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from compare import TeacherForced, free_running  # noqa: E402
from make_k3_checkpoint import kda_dt_bias  # noqa: E402
import fp8_checkpoint  # noqa: E402
from checkpoints import scratch_dir  # noqa: E402
from mkc_runtime import MkcError, Model  # noqa: E402



ARCH = "deepseek_v3"  # --arch
FP8 = False  # --fp8


def model_classes():
    import transformers

    if ARCH == "kimi_linear":
        return transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM
    return transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM


def make_checkpoint(config_path, seed, out_dir):
    config_cls, model_cls = model_classes()
    with open(config_path) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)  # drawn in bf16; --fp8 quantises the saved checkpoint
    config = config_cls(**cfg)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = model_cls(config).to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("A_log"):  # KDA decay rates exp(A_log) in [1, 16]
                p.copy_(torch.empty(p.shape, device="cuda").uniform_(1, 16, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(kda_dt_bias(p.shape, g, "cuda"))
            elif "conv1d" in name:  # short convolutions: unit gain over the window
                p.copy_(torch.randn(p.shape, generator=g, device="cuda") / p.shape[-1] ** 0.5)
            elif "norm" in name or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, device="cuda"))
            elif "e_score_correction_bias" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, device="cuda"))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g, device="cuda"))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, device="cuda") / p.shape[-1] ** 0.5)
                if name.startswith("lm_head"):
                    # Rows of log-normal norms: the top logits stand apart.
                    p.mul_(torch.exp(torch.randn(p.shape[0], 1, generator=g, device="cuda")))
        if align_kda_keys(dict(model.named_parameters()), g) == 0 and ARCH == "kimi_linear":
            raise RuntimeError("no KDA q_proj/k_proj pair found to align: parameter names changed?")
    model.save_pretrained(out_dir)
    del model
    torch.cuda.empty_cache()


def align_kda_keys(params, g, corr=0.8):
    """KDA layers: keys drawn correlated with the queries (k = 0.8 q + 0.6
    noise, the same short convolution). With independent random q and k, a
    head's output early in a sequence is about v (k . q), and the per-head
    gated RMSNorm keeps only the sign of k . q, which is near zero as often as
    not: any rounding flips a head, and the comparison measures that, not the
    kernel (tests/gpu/k3_bisect.py shows it as the noise floor). Returns how
    many layers it aligned."""
    aligned = 0
    for name, q in params.items():
        if name.endswith("self_attn.q_proj.weight") and name.replace("q_proj", "k_proj") in params:
            k = params[name.replace("q_proj", "k_proj")]
            noise = torch.randn(q.shape, generator=g, device=q.device) / q.shape[-1] ** 0.5
            k.copy_(corr * q.float() + (1 - corr * corr) ** 0.5 * noise)
            qc, kc = name.replace("q_proj", "q_conv1d"), name.replace("q_proj", "k_conv1d")
            if qc in params and kc in params:
                params[kc].copy_(params[qc])
            aligned += 1
    return aligned


def reference(ckpt, prompts, n_gen):
    """Greedy tokens, teacher-forced logits and routing gaps per prompt, fp32,
    no cache; and the router noise per position: the largest change of any
    selection score when the same checkpoint runs in bf16 (transformers'
    routers compute in fp32 from the bf16 hidden state, as the kernel's)."""
    _, model_cls = model_classes()
    ref = model_cls.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").cuda().eval()
    low = model_cls.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="eager").cuda().eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(n_gen):
                logits = ref(torch.tensor([seq], device="cuda"), use_cache=False).logits[0, -1]
                seq.append(int(torch.argmax(logits)))
            full, scores = routed(ref, seq)
            _, scores_bf16 = routed(low, seq)
            noise = np.zeros(len(seq))
            for a, b in zip(scores, scores_bf16):
                noise = np.maximum(noise, (a - b).abs().nan_to_num(nan=0.0).amax(-1).cpu().numpy())
            out.append((seq, full, routing_gaps(scores, ref.config, len(seq)), noise))
    del ref, low
    torch.cuda.empty_cache()
    return out


def routed(model, seq):
    """The model's logits over the whole sequence [n, V] and its routers'
    selection scores, one [n, E] per MoE layer (choice_scores)."""
    captured = []
    hooks = [moe.gate.register_forward_hook(lambda mod, inp, o: captured.append((mod, o)))
             for moe in (getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
                         for layer in model.model.layers) if hasattr(moe, "gate")]
    full = model(torch.tensor([seq], device="cuda"), use_cache=False).logits[0].float().cpu().numpy()
    for h in hooks:
        h.remove()
    return full, [choice_scores(mod, o, model.config, len(seq)) for mod, o in captured]


def choice_scores(mod, o, config, n):
    """A router's selection scores [n, E]: sigmoid of its logits plus the
    correction bias, the experts of dropped groups at 0 (as the router ranks them)."""
    logits = (o[0] if isinstance(o, tuple) else o).float().reshape(n, -1)
    choice = torch.sigmoid(logits) + mod.e_score_correction_bias.float()
    ng = getattr(config, "n_group", None) or getattr(config, "num_expert_group", 1) or 1
    tg = getattr(config, "topk_group", 1) or 1
    if ng > 1:
        gs = choice.view(n, ng, -1).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(tg, dim=-1)[1], 1)
        mask = keep.unsqueeze(-1).expand(n, ng, choice.shape[1] // ng).reshape(n, -1)
        choice = choice.masked_fill(mask == 0, 0.0)
    return choice


def routing_gaps(scores, config, n):
    """Per position, the smallest gap (over MoE layers) between the k-th and
    (k+1)-th expert choice scores of the reference's router: where it is tiny,
    rounding anywhere upstream may swap an expert (a routing near-tie)."""
    k = getattr(config, "num_experts_per_tok", None) or config.num_experts_per_token
    gaps = np.full(n, np.inf)
    for choice in scores:
        top = choice.topk(k + 1, dim=-1)[0]
        gaps = np.minimum(gaps, (top[:, k - 1] - top[:, k]).cpu().numpy())
    return gaps


DEBUG = False  # --debug: bounded waits that report instead of hanging


def run_seed(lib, config, seed, prompt_len, n_gen, work):
    ckpt = os.path.join(work, f"seed{seed}")
    ref_ckpt = ckpt
    if FP8:
        # The library loads the FP8 checkpoint; the reference its dequantised fp32 copy.
        bf16 = ckpt + "_bf16"
        make_checkpoint(config, seed, bf16)
        fp8_checkpoint.quantise(bf16, ckpt)
        ref_ckpt = ckpt + "_ref"
        fp8_checkpoint.dequantise(ckpt, ref_ckpt)
        shutil.rmtree(bf16, ignore_errors=True)
    else:
        make_checkpoint(config, seed, ckpt)
    model = Model(lib, ckpt)
    b = model.batch
    vocab = model.vocab
    rng = np.random.default_rng(1000 + seed)
    prompts = [list(rng.integers(0, vocab, prompt_len)) for _ in range(b)]
    refs = reference(ref_ckpt, prompts, n_gen)
    steps = prompt_len + n_gen - 1
    # Teacher-forced: feed the reference sequence; logits after token t
    # compare with the reference's at position t.
    model.reset()
    tf = TeacherForced(b)
    t0 = time.time()
    for t in range(steps):
        nxt, logits = model.step([refs[s][0][t] for s in range(b)], debug=DEBUG)
        tf.step(t, nxt, logits, [refs[s][1][t] for s in range(b)], [refs[s][2][t] for s in range(b)],
                [refs[s][3][t] for s in range(b)])
    tf_time = time.time() - t0
    # Free-running greedy decode.
    model.reset()
    gen = [[] for _ in range(b)]
    nxt = None
    for t in range(steps):
        tokens = [prompts[s][t] if t < prompt_len else int(nxt[s]) for s in range(b)]
        nxt, _ = model.step(tokens, debug=DEBUG)
        if t >= prompt_len - 1:
            for s in range(b):
                gen[s].append(int(nxt[s]))
    free, free_mismatches = free_running(gen, [r[0][prompt_len:] for r in refs], [r[1] for r in refs],
                                         [r[2] for r in refs], prompt_len, n_gen, [r[3] for r in refs])
    model.close()
    return {
        "seed": seed,
        "batch": b,
        "steps": steps,
        **tf.report(),
        "mismatches": (tf.mismatches + free_mismatches)[:10],
        "free_running": free,
        "teacher_forced_s": round(tf_time, 2),
        "router_noise_median": float(np.median(np.concatenate([r[3] for r in refs]))) if refs[0][3].size else 0.0,
        "ok": tf.ok() and not free_mismatches,
    }, ckpt


def bad_checkpoints(lib, ckpt, work):
    """A tensor missing, a tensor mis-shaped: both refused, naming it."""
    from safetensors.torch import load_file, save_file

    results = []
    files = [f for f in os.listdir(ckpt) if f.endswith(".safetensors")]
    for case in ("missing", "shape"):
        bad = os.path.join(work, f"bad_{case}")
        shutil.copytree(ckpt, bad)
        path = os.path.join(bad, files[0])
        tensors = load_file(path)
        key = sorted(k for k in tensors if "o_proj" in k)[0]
        if case == "missing":
            del tensors[key]
        else:
            tensors[key] = tensors[key][:, :-8].contiguous()
        save_file(tensors, path, metadata={"format": "pt"})
        index = os.path.join(bad, "model.safetensors.index.json")
        if case == "missing" and os.path.exists(index):
            with open(index) as f:
                idx = json.load(f)
            idx["weight_map"].pop(key, None)
            with open(index, "w") as f:
                json.dump(idx, f)
        try:
            Model(lib, bad)
            results.append({"case": case, "tensor": key, "ok": False, "message": "accepted"})
        except MkcError as e:
            msg = str(e)
            results.append({"case": case, "tensor": key, "ok": key in msg, "message": msg.strip().splitlines()[-1]})
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--bad-checkpoints", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--debug", action="store_true")
    ap.add_argument("--arch", choices=["deepseek_v3", "kimi_linear"], default="deepseek_v3")
    ap.add_argument("--fp8", action="store_true", help="the library loads an FP8 checkpoint (K2 as released)")
    args = ap.parse_args()
    global DEBUG, ARCH, FP8
    DEBUG = args.debug
    ARCH = args.arch
    FP8 = args.fp8
    work = scratch_dir("mkc_k2_")
    rows, ckpt = [], None
    for seed in args.seeds:
        row, ckpt = run_seed(args.lib, args.config, seed, args.prompt_len, args.gen, work)
        rows.append(row)
    bad = bad_checkpoints(args.lib, ckpt, work) if args.bad_checkpoints else []
    shutil.rmtree(work, ignore_errors=True)
    report = {"lib": os.path.basename(args.lib), "config": args.config, "seeds": rows, "bad_checkpoints": bad}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(f"{'lib':32} {'seed':>4} {'batch':>5} {'steps':>5} {'max rel L2':>11} {'near-ties':>9} {'routing':>8}  free-running")
    for r in rows:
        print(f"{report['lib']:32} {r['seed']:>4} {r['batch']:>5} {r['steps']:>5} {r['max_rel_l2']:>11.3e} "
              f"{str(r['near_ties_excluded']):>9} {str(r['routing_near_ties_excluded']):>8}  {'; '.join(sorted(set(r['free_running'])))}"
              f"{'' if r['ok'] else '  FAIL: ' + '; '.join(r['mismatches'][:3])}")
    for b in bad:
        print(f"bad checkpoint ({b['case']} {b['tensor']}): {'refused' if b['ok'] else 'NOT REFUSED'}: {b['message']}")
    ok = all(r["ok"] for r in rows) and all(b["ok"] for b in bad)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
