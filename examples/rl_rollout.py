"""RL rollouts from an NVFP4-quantized copy of a bf16 policy, and the log-probability mismatch it costs.

Each iteration emulates an RL step: the bf16 policy receives an update (a small random perturbation
standing in for an optimizer step), its MoE experts are quantized online with
``jax_nvfp4.nn.quantize_moe``, a batch of prompts is rolled out by one jitted generate call per mode
(bf16 = the policy itself, w4a16, w4a4), and the bf16 policy scores the sampled sequences by teacher
forcing, as a trainer would. Reported per mode:

- rollout throughput: generated tokens per second of the jitted generate call (after compilation);
- mean / max |delta logp|: |log pi_rollout(token) - log pi_policy(token)| over the generated tokens;
- KL: the k3 estimate ``E[r - 1 - log r]``, ``r = pi_policy / pi_rollout`` of KL(rollout || policy) on
  the sampled tokens (exact in expectation with top_p = 1; log-probabilities are those of
  ``softmax(logits / temperature)``);
- with ``--routing-replay``, the same mismatch when the policy replays the rollout's expert choices.

The bf16 row measures the engine alone (cached decoding vs one teacher-forced pass, both bf16).

    python examples/rl_rollout.py                      # tiny random model on the CPU, seconds
    python examples/rl_rollout.py --config qwen3-30b-a3b --layers 8 --batch 64 --prompt-len 128 \\
        --new-tokens 256                               # Qwen3-30B-A3B shapes on a GPU (random weights)
    python examples/rl_rollout.py --config gpt-oss-20b --layers 8 ...   # gpt-oss-20b shapes
    python examples/rl_rollout.py --expert-parallel 8  # the NVFP4 rollout copy's experts split over 8 devices

With ``--expert-parallel N`` the quantized rollout copy holds ``E / N`` experts of every block on each of the first
N devices (``jax_nvfp4.nn.expert_parallel``, a mesh axis "ep") and rolls out under ``jax.set_mesh``; the bf16 policy
stays on the default device.

Weights are random (drawn on the default device); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jax_nvfp4 import nn as nvnn
from jax_nvfp4.backends.base import names as backend_names

MODES = ("bf16", "w4a16", "w4a4")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--config", default="tiny", choices=sorted(MODELS),
                   help="model shapes (default tiny; gpt-oss-*: the gpt-oss decoder, sliding windows, sinks, biases)")
    p.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    p.add_argument("--batch", type=int, default=8, help="sequences per rollout")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt columns (prompts are left-padded, "
                   "real lengths uniform in [prompt-len/2, prompt-len])")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per sequence")
    p.add_argument("--iters", type=int, default=3, help="RL iterations (update, quantize, roll out, score)")
    p.add_argument("--modes", default="bf16,w4a16,w4a4", help="comma-separated rollout modes")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--update-scale", type=float, default=0.01,
                   help="relative size of the emulated policy update (0: none)")
    p.add_argument("--backend", default="auto", choices=("auto",) + backend_names(),
                   help="jax_nvfp4.moe backend (default auto)")
    p.add_argument("--recipe", default="nvfp4", choices=("nvfp4", "4over6"))
    p.add_argument("--routing-replay", action="store_true",
                   help="also score with the policy replaying the rollout's expert choices")
    p.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                   help="split the rollout copy's experts over the first N devices (default 1: no split)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes must be a comma-separated subset of {MODES}, got {args.modes!r}")
    args.modes = modes
    if args.prompt_len < 2 or args.new_tokens < 1 or args.batch < 1 or args.iters < 1:
        p.error("--prompt-len >= 2, --new-tokens >= 1, --batch >= 1 and --iters >= 1 are required")
    if args.iters == 1:
        print("note: with --iters 1 the times include compilation (iteration 0); take --iters >= 2 for throughput",
              file=sys.stderr)
    if not 1 <= args.expert_parallel <= jax.device_count():
        p.error(f"--expert-parallel must be in [1, {jax.device_count()}] (the devices JAX sees), got {args.expert_parallel}")
    return args


@functools.partial(jax.jit, donate_argnums=0)
def _perturb(params, key, scale):
    """``p + scale * rms(p) * N(0, 1)`` for every parameter: a stand-in for an optimizer step."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    out = []
    for p, k in zip(leaves, keys):
        pf = p.astype(jnp.float32)
        rms = jnp.sqrt(jnp.mean(pf * pf))
        out.append((pf + scale * rms * jax.random.normal(k, p.shape, jnp.float32)).astype(p.dtype))
    return jax.tree.unflatten(treedef, out)


def update_policy(policy, key, scale):
    params = nnx.state(policy, nnx.Param)
    if jax.default_backend() == "cpu":  # CPU buffers cannot be donated; copy instead of warning
        params = jax.tree.map(jnp.copy, params)
    nnx.update(policy, _perturb(params, key, jnp.float32(scale)))


def make_prompts(key, batch, length, vocab):
    """Random left-padded prompts: tokens int32 [B, P], mask bool [B, P] (real lengths in [P/2, P])."""
    kt, kl = jax.random.split(key)
    tokens = jax.random.randint(kt, (batch, length), 0, vocab, jnp.int32)
    lengths = jax.random.randint(kl, (batch,), max(1, length // 2), length + 1)
    mask = jnp.arange(length)[None, :] >= (length - lengths)[:, None]
    return jnp.where(mask, tokens, 0), mask


def mismatch(rollout_lp, policy_lp, mask):
    """mean |delta|, max |delta| and the k3 KL estimate over the generated tokens (host floats)."""
    m = np.asarray(mask)
    d = (np.asarray(policy_lp, np.float64) - np.asarray(rollout_lp, np.float64))[m]
    return dict(mean_abs_dlogp=float(np.mean(np.abs(d))), max_abs_dlogp=float(np.max(np.abs(d))),
                kl_k3=float(np.mean(np.expm1(d) - d)))


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def rollout_model(policy, quantized, mode):
    if mode == "bf16":
        return policy
    return quantized if mode == "w4a16" else nvnn.set_moe_options(quantized, mode="w4a4")


# --config name -> (config, model class): the Qwen3-MoE presets and the gpt-oss ones.
MODELS = {**{n: (c, nvnn.Qwen3MoeForCausalLM) for n, c in nvnn.CONFIGS.items()},
          **{("gpt-oss-tiny" if n == "tiny" else n): (c, nvnn.GptOssForCausalLM)
             for n, c in nvnn.GPT_OSS_CONFIGS.items()}}


def run(args, log=print):
    cfg, model_cls = MODELS[args.config]
    cfg = cfg.replace(moe_backend=args.backend)
    mesh = None
    if args.expert_parallel > 1:
        mesh = jax.make_mesh((args.expert_parallel,), ("ep",), devices=jax.devices()[:args.expert_parallel])
    if args.layers is not None:
        cfg = cfg.replace(num_hidden_layers=args.layers)
    key = jax.random.key(args.seed)
    t0 = time.perf_counter()
    policy = model_cls(cfg, rngs=nnx.Rngs(args.seed))  # random weights, on the default device
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(policy, nnx.Param)))
    jax.block_until_ready(nnx.state(policy))
    inter = cfg.moe_intermediate_size if hasattr(cfg, "moe_intermediate_size") else cfg.intermediate_size
    log(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}")
    log(f"model: {args.config} ({cfg.num_hidden_layers} layers, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}, "
        f"H {cfg.hidden_size}, I {inter}, vocab {cfg.vocab_size}), {_count(n_params)} bf16 "
        f"parameters, random init {time.perf_counter() - t0:.1f} s")
    log(f"rollout: batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
        f"temperature {args.temperature}, top_p {args.top_p}, modes {', '.join(args.modes)}, backend {args.backend}"
        + (f", NVFP4 experts split over {args.expert_parallel} devices" if mesh is not None else ""))
    prompts, pmask = make_prompts(jax.random.fold_in(key, 1), args.batch, args.prompt_len, cfg.vocab_size)
    mesh_prompts = None
    if mesh is not None:  # (on a mesh of Explicit axes a jitted call's arrays must all be on it)
        mesh_prompts = jax.device_put((prompts, pmask), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    p = args.prompt_len
    rows = {m: dict(times=[], tokens=0, stats=[], replay=[]) for m in args.modes}
    quant_times = []
    bar = tqdm(range(args.iters), desc="rl iterations", disable=args.no_progress, dynamic_ncols=True)
    for it in bar:
        if it > 0 and args.update_scale > 0:
            update_policy(policy, jax.random.fold_in(key, 1000 + it), args.update_scale)
        t0 = time.perf_counter()
        quantized = nvnn.quantize_moe(policy, recipe=args.recipe)
        if mesh is not None:
            quantized = nvnn.expert_parallel(quantized, mesh, "ep", inplace=True)
        jax.block_until_ready(nnx.state(quantized, nvnn.QuantizedWeight))
        quant_times.append(time.perf_counter() - t0)
        postfix = {}
        for mode in args.modes:
            model = rollout_model(policy, quantized, mode)
            t0 = time.perf_counter()
            split = mesh is not None and mode != "bf16"
            toks, tmask = mesh_prompts if split else (prompts, pmask)
            with jax.set_mesh(mesh) if split else contextlib.nullcontext():
                out = nvnn.generate(model, toks, prompt_mask=tmask, key=jax.random.fold_in(key, it),
                                    max_new_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p,
                                    return_routing=args.routing_replay)
                jax.block_until_ready(out)
            dt = time.perf_counter() - t0
            seq = jnp.concatenate([prompts, out.tokens], axis=1)
            smask = jnp.concatenate([pmask, out.mask], axis=1)
            temp = args.temperature if args.temperature > 0 else 1.0
            policy_lp = nvnn.sequence_logprobs(policy, seq, attention_mask=smask, temperature=temp)[:, p - 1:]
            r = rows[mode]
            r["times"].append(dt)
            r["tokens"] = int(out.mask.sum())
            r["stats"].append(mismatch(out.logprobs, policy_lp, out.mask))
            if args.routing_replay:
                replay_lp = nvnn.sequence_logprobs(policy, seq, attention_mask=smask, temperature=temp,
                                                   topk_ids=out.routing)[:, p - 1:]
                r["replay"].append(mismatch(out.logprobs, replay_lp, out.mask))
            postfix[mode] = f"{r['stats'][-1]['mean_abs_dlogp']:.4f}"
        del quantized, model, out  # free the NVFP4 copy before the next update
        bar.set_postfix({f"|dlogp| {m}": v for m, v in postfix.items()})
    bar.close()
    return summarize(args, cfg, rows, quant_times, log)


def summarize(args, cfg, rows, quant_times, log):
    steady = slice(1, None) if args.iters > 1 else slice(None)  # iteration 0 includes compilation
    results = []
    for mode, r in rows.items():
        t = statistics.median(r["times"][steady])
        res = dict(mode=mode, rollout_s=t, first_rollout_s=r["times"][0], generated_tokens=r["tokens"],
                   tokens_per_s=r["tokens"] / t,
                   **{k: float(np.mean([s[k] for s in r["stats"]])) for k in r["stats"][0]})
        res["max_abs_dlogp"] = float(np.max([s["max_abs_dlogp"] for s in r["stats"]]))
        if r["replay"]:
            res["replay_mean_abs_dlogp"] = float(np.mean([s["mean_abs_dlogp"] for s in r["replay"]]))
            res["replay_kl_k3"] = float(np.mean([s["kl_k3"] for s in r["replay"]]))
        results.append(res)
    q = statistics.median(quant_times[steady])
    placed = f" and their split over {args.expert_parallel} devices" if args.expert_parallel > 1 else ""
    log(f"online quantization of the experts (quantize_moe){placed}: {q * 1e3:.1f} ms "
        f"(first, with compilation: {quant_times[0]:.2f} s)")
    head = f"{'mode':6s} {'tokens/s':>10s} {'rollout s':>10s} {'mean|dlogp|':>12s} {'max|dlogp|':>11s} {'KL(k3)':>10s}"
    if args.routing_replay:
        head += f" {'replay mean|dlogp|':>19s} {'replay KL':>10s}"
    log(head)
    for r in results:
        line = (f"{r['mode']:6s} {r['tokens_per_s']:10.1f} {r['rollout_s']:10.3f} {r['mean_abs_dlogp']:12.5f} "
                f"{r['max_abs_dlogp']:11.4f} {r['kl_k3']:10.2e}")
        if args.routing_replay:
            line += f" {r['replay_mean_abs_dlogp']:19.5f} {r['replay_kl_k3']:10.2e}"
        log(line)
    out = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, config=args.config,
               layers=cfg.num_hidden_layers, batch=args.batch, prompt_len=args.prompt_len,
               new_tokens=args.new_tokens, iters=args.iters, temperature=args.temperature, top_p=args.top_p,
               backend=args.backend, recipe=args.recipe, expert_parallel=args.expert_parallel, quantize_s=q,
               first_quantize_s=quant_times[0],
               results=results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        log(f"wrote {args.json}")
    return out


def main(argv=None):
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
