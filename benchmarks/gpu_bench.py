"""GPU figures for the real Clover config (random bf16 weights, one device), written as JSON step by step.

    python benchmarks/gpu_bench.py --out gpu-out/gpu_bench.json           # what benchmarks/gpu.sh runs
    JAX_PLATFORMS=cpu python benchmarks/gpu_bench.py --smoke --out /tmp/gpu_bench.json   # every step, tiny

Steps, each in its own try/except (a failing step is recorded with its error and the rest go on; the
JSON is rewritten after every step, so a run killed at its time limit still leaves what it measured):

  env          jax version, backend, devices, memory; whether tokamax imports (and gpu.sh's install log)
  init         random weights of `--config` (default clover-35b-a3b) in `--dtype` (bfloat16): one small
               jitted fill per leaf (normal leaves in slices over their leading axis), so no 35B-sized
               program is compiled and no float32 copy of a whole weight is ever made
  block_pass   one cached refinement pass over a block (`--block`, 32) against a cache of `--cache-len`
               (4096) prompt columns, at batch 1, 8, 64 (`--batches`): median latency of `--iters` calls
               (the cache donated and fed back, as the sampler runs it), and the HBM roofline: (bytes of
               the weights the pass reads + cache bytes) / `--hbm-bw` (4.8e12 B/s, the H200's), the routed
               experts counted at their expected share hit by B x block tokens under uniform routing
  ragged_dot   one MoE layer's grouped matmuls (gate/up: [M, d] x [E, d, width]; down: [M, width] x
               [E, width, d]; M = B x block x top-k rows, random routing) with jax.lax.ragged_dot and with
               tokamax.ragged_dot (each implementation that runs: mosaic, triton, default), ms and roofline
  generate     tokens/s of a full `generate` at batch 1 and 64 (`--gen-batches`): gen 128, block 32, steps
               128, without and with threshold 0.9 (a dynamic knob: the same compiled program)

`--smoke` runs every step on get_config("test-clover-hybrid") with tiny batches, on whatever backend is
there (the CPU check). `--deadline-s` skips the steps that would start after that many seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")) / "gpu_bench.json")
    p.add_argument("--config", default="clover-35b-a3b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--smoke", action="store_true", help="test-clover-hybrid, tiny batches: proves every step runs")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="block-pass batch sizes")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--cache-len", type=int, default=4096, help="prompt columns already in the cache")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--hbm-bw", type=float, default=4.8e12, help="bytes/s of the roofline (H200: 4.8e12)")
    p.add_argument("--gen-batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--gen-length", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--dispatch", default=None, help="MoE dispatch (default: the config's)")
    p.add_argument("--quantize", nargs="*", default=["int8", "fp8"], choices=["int8", "fp8"],
                   help="after the float steps, the block passes again with weight-only quantized random weights "
                        "(the float weights are freed first)")
    p.add_argument("--deadline-s", type=float, default=0.0, help="skip steps starting after this many seconds")
    p.add_argument("--tokamax-log", type=Path, default=None, help="gpu.sh's pip log for tokamax (recorded)")
    args = p.parse_args(argv)
    if args.smoke:
        args.config = "test-clover-hybrid"
        args.batches, args.gen_batches = [1, 2], [1, 2]
        args.block, args.cache_len, args.iters, args.gen_length, args.prompt_len = 8, 64, 3, 16, 8
    return args


class Recorder:
    """The JSON file: {"meta": ..., "steps": {name: {"ok": ..., ...}}}, rewritten after every step."""

    def __init__(self, path: Path, deadline_s: float) -> None:
        self.path, self.deadline_s, self.t0 = path, deadline_s, time.perf_counter()
        self.data: dict[str, Any] = {"meta": {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:]},
                                     "steps": {}}
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def write(self) -> None:
        self.data["meta"]["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)

    def step(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        elapsed = time.perf_counter() - self.t0
        if self.deadline_s and elapsed > self.deadline_s:
            self.data["steps"][name] = {"ok": False, "skipped": f"deadline ({elapsed:.0f} s > {self.deadline_s:.0f})"}
            self.write()
            print(f"[gpu_bench] {name}: skipped (deadline)", flush=True)
            return None
        print(f"[gpu_bench] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            entry: dict[str, Any] = {"ok": True, **fn()}
        except Exception as e:  # recorded, and the next step goes on
            entry = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}",
                     "traceback": traceback.format_exc()[-4000:]}
        entry["step_s"] = round(time.perf_counter() - t0, 3)
        self.data["steps"][name] = entry
        self.write()
        brief = {k: v for k, v in entry.items() if k not in ("traceback", "runs_ms")}
        print(f"[gpu_bench] {name}: {json.dumps(brief, default=str)[:600]}", flush=True)
        return entry if entry["ok"] else None


def median_ms(fn: Callable[[], Any], iters: int) -> tuple[float, list[float]]:
    import jax

    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), [round(t, 3) for t in times]


# ---- weights ----------------------------------------------------------------------------------------------


def random_weights(cfg: Any) -> Any:
    """Weights shaped as params.abstract(cfg), each leaf filled by its own small jitted program; normal
    leaves of more than 2^27 elements are drawn one slice of the leading axis at a time (lax.map)."""
    import jax
    import jax.numpy as jnp

    from clover_jax.model import params

    leaves, treedef = jax.tree.flatten(params.abstract(cfg), is_leaf=params.is_spec)

    def fill(spec: Any) -> Callable[[jax.Array], jax.Array]:
        dt = jnp.dtype(spec.dtype)
        if spec.init != "normal":
            val = {"ones": 1.0, "zeros": 0.0, "constant": spec.value}[spec.init]
            return jax.jit(lambda key: jnp.full(spec.shape, val, dt))

        def normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
            x = spec.std * jax.random.normal(key, shape, jnp.float32)
            if jnp.issubdtype(dt, jnp.integer):  # an int8 qvalue
                x = jnp.clip(jnp.round(x), -127, 127)
            return x.astype(dt)

        if spec.size <= 1 << 27 or len(spec.shape) < 2:
            return jax.jit(lambda key: normal(key, spec.shape))
        return jax.jit(lambda key: jax.lax.map(lambda k: normal(k, spec.shape[1:]),
                                               jax.random.split(key, spec.shape[0])))

    programs: dict[tuple, Callable[[jax.Array], jax.Array]] = {}
    keys = jax.random.split(jax.random.key(0), len(leaves))
    out = []
    for spec, key in zip(leaves, keys, strict=True):
        sig = (spec.shape, str(spec.dtype), spec.init, spec.std, spec.value)
        if sig not in programs:
            programs[sig] = fill(spec)
        out.append(programs[sig](key))
    return jax.block_until_ready(jax.tree.unflatten(treedef, out))


def expected_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts hit by `tokens` tokens each picking top_k of n_experts uniformly at random."""
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)


def touched_weight_bytes(cfg: Any, tokens: int) -> dict[str, float]:
    """Bytes of weights one pass over `tokens` tokens reads: every leaf whole, except the routed experts
    (their expected share under uniform routing) and the embedding (only the rows looked up)."""
    import jax.numpy as jnp

    from clover_jax.model import params

    frac = expected_experts(cfg.n_experts, cfg.n_experts_per_tok, tokens) / cfg.n_experts
    total = experts = experts_all = 0.0
    for name, spec in params.named_leaves(params.abstract(cfg)):
        b = spec.size * jnp.dtype(spec.dtype).itemsize
        name = name.removesuffix(".qvalue").removesuffix(".scale")  # a quantized weight's two leaves
        routed = name.split(".")[-1] in ("gate", "up", "down") and ".mlp." in name and ".shared." not in name \
            and len(spec.shape) == 4 and spec.shape[1] == cfg.n_experts
        if routed:
            experts_all += b
            experts += b * frac
            b *= frac
        elif name == "embed":
            b = min(tokens, spec.shape[0]) * spec.shape[1] * jnp.dtype(spec.dtype).itemsize
        total += b
    return {"weights_bytes": total, "routed_expert_bytes": experts, "routed_expert_bytes_all": experts_all,
            "expected_expert_fraction": frac}


# ---- steps ------------------------------------------------------------------------------------------------


def step_env(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    out: dict[str, Any] = {"jax": jax.__version__, "backend": jax.default_backend(),
                           "devices": [str(d) for d in jax.devices()], "python": sys.version.split()[0]}
    try:
        import jaxlib

        out["jaxlib"] = jaxlib.__version__
    except Exception as e:
        out["jaxlib"] = repr(e)
    try:
        out["memory_stats"] = {k: v for k, v in (jax.devices()[0].memory_stats() or {}).items()
                               if k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use")}
    except Exception as e:
        out["memory_stats"] = repr(e)
    try:
        import tokamax

        out["tokamax"] = getattr(tokamax, "__version__", "imported")
    except Exception as e:
        out["tokamax"] = f"not available: {type(e).__name__}: {e}"
    if args.tokamax_log is not None and args.tokamax_log.is_file():
        out["tokamax_install_log_tail"] = args.tokamax_log.read_text(errors="replace")[-1500:]
    return out


def block_pass(args: argparse.Namespace, cfg: Any, weights: Any, batch: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from clover_jax.model import ModelForward, masks

    fwd = ModelForward(cfg, args.dispatch)
    p, bl = args.cache_len, args.block
    s = p + bl
    valid = jnp.ones((batch, s), bool)
    pos = masks.positions(valid)
    ids = masks.canvas_block_ids(pos, p, bl, cfg.block_size)
    q = slice(p, s)
    mask = masks.attention_mask(valid[:, q], ids[:, q], valid, ids, cfg.is_block_causal)
    toks = jax.random.randint(jax.random.key(batch), (batch, bl), 4, cfg.vocab_size, jnp.int32)

    extra = (pos[:, q], mask, valid[:, q], ids[:, q])

    def run(w: Any, cache: Any, t: jax.Array, pos_q: jax.Array, m: jax.Array, valid_q: jax.Array,
            ids_q: jax.Array) -> tuple[jax.Array, Any]:
        return fwd(w, t, pos_q, m, cache, jnp.int32(p), 0, bl, valid=valid_q, blocks=ids_q, commit=0)

    cache = fwd.init_cache(batch, s)
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache))
    t0 = time.perf_counter()
    exe = jax.jit(run, donate_argnums=(1,)).lower(weights, cache, toks, *extra).compile()
    compile_s = time.perf_counter() - t0
    state = {"cache": cache}

    def once() -> jax.Array:
        logits, state["cache"] = exe(weights, state["cache"], toks, *extra)
        return logits

    jax.block_until_ready(once())  # warm
    ms, runs = median_ms(once, args.iters)
    wb = touched_weight_bytes(cfg, batch * bl)
    roof_s = (wb["weights_bytes"] + cache_bytes) / args.hbm_bw
    state.clear()  # frees the cache before the next batch
    return {"batch": batch, "block": bl, "cache_columns": s, "compile_s": round(compile_s, 2),
            "latency_ms": round(ms, 3), "min_ms": min(runs), "runs_ms": runs, "cache_bytes": cache_bytes, **wb,
            "roofline_ms": float(f"{roof_s * 1e3:.4g}"), "ratio_to_roofline": round(ms / (roof_s * 1e3), 3),
            "hbm_bw": args.hbm_bw, "dispatch": args.dispatch or cfg.moe_dispatch,
            "tokens_per_s_one_pass": round(batch * bl / (ms / 1e3), 1)}


def ragged(args: argparse.Namespace, cfg: Any) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    dt = jnp.dtype(args.dtype)
    e, k, d, f = cfg.n_experts, cfg.n_experts_per_tok, cfg.d_model, cfg.expert_mlp_dim
    try:
        import tokamax
    except Exception as ex:
        tokamax, tok_err = None, f"{type(ex).__name__}: {ex}"
    else:
        tok_err = None
    key = jax.random.key(7)
    rhs = {"gate_up": (0.02 * jax.random.normal(key, (e, d, f), jnp.float32)).astype(dt),
           "down": (0.02 * jax.random.normal(jax.random.fold_in(key, 1), (e, f, d), jnp.float32)).astype(dt)}
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"experts": e, "top_k": k, "d_model": d, "width": f, "dtype": str(dt),
                           "tokamax": tok_err or "imported", "shapes": {}}
    for b in args.batches:
        tokens = b * args.block
        picks = np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]).ravel()
        sizes = jnp.asarray(np.bincount(picks, minlength=e), jnp.int32)
        hit = int((np.bincount(picks, minlength=e) > 0).sum())
        m = tokens * k
        for name, w in rhs.items():
            lhs = (jax.random.normal(jax.random.fold_in(key, m), (m, w.shape[1]), jnp.float32)).astype(dt)
            byts = hit * w.shape[1] * w.shape[2] * dt.itemsize + lhs.nbytes + m * w.shape[2] * dt.itemsize
            row: dict[str, Any] = {"rows": m, "experts_hit": hit, "bytes": byts,
                                   "roofline_ms": float(f"{byts / args.hbm_bw * 1e3:.4g}")}
            cands: dict[str, Callable[..., jax.Array]] = {
                "lax.ragged_dot": lambda a, r, g: jax.lax.ragged_dot(a, r, g, preferred_element_type=dt)}
            if tokamax is not None:
                for impl in ("mosaic", "triton", None):
                    cands[f"tokamax.{impl or 'default'}"] = (
                        lambda a, r, g, impl=impl: tokamax.ragged_dot(a, r, g, preferred_element_type=dt,
                                                                       implementation=impl))
            ref = None
            for cname, fn in cands.items():
                try:
                    exe = jax.jit(fn).lower(lhs, w, sizes).compile()
                    y = jax.block_until_ready(exe(lhs, w, sizes))
                    ms, runs = median_ms(lambda exe=exe, lhs=lhs, w=w, sizes=sizes: exe(lhs, w, sizes),
                                          max(args.iters, 5))
                    res: dict[str, Any] = {"ms": round(ms, 4), "min_ms": min(runs),
                                           "ratio_to_roofline": round(ms / (byts / args.hbm_bw * 1e3), 3)}
                    if ref is None:
                        ref = y
                    else:
                        res["max_abs_diff_vs_lax"] = float(jnp.max(jnp.abs(y.astype(jnp.float32)
                                                                           - ref.astype(jnp.float32))))
                    row[cname] = res
                except Exception as ex:
                    row[cname] = {"error": f"{type(ex).__name__}: {str(ex)[:500]}"}
            out["shapes"][f"B{b}_{name}"] = row
    return out


def gen(args: argparse.Namespace, cfg: Any, weights: Any, batch: int) -> dict[str, Any]:
    import numpy as np

    from clover_jax.sampler import SamplerConfig, generate

    g, bl = args.gen_length, args.block
    prompts = np.random.default_rng(batch).integers(4, cfg.vocab_size - 2, (batch, args.prompt_len)).tolist()
    out: dict[str, Any] = {"batch": batch, "gen_length": g, "block_length": bl, "steps": g,
                           "prompt_len": args.prompt_len, "dispatch": args.dispatch or cfg.moe_dispatch}
    for label, thr in (("steps", 0.0), (f"threshold_{args.threshold}", args.threshold)):
        sc = SamplerConfig(gen_length=g, block_length=bl, steps=g, threshold=thr, eos_stop=False)
        t0 = time.perf_counter()
        first = generate(weights, cfg, prompts, sc, dispatch=args.dispatch)
        first_s = time.perf_counter() - t0
        runs = []
        for _ in range(2):
            t0 = time.perf_counter()
            res = generate(weights, cfg, prompts, sc, dispatch=args.dispatch)
            runs.append((time.perf_counter() - t0, res.stats))
        wall, st = min(runs, key=lambda r: r[0])
        out[label] = {"threshold": thr, "first_call_s": round(first_s, 2), "compile_s": round(first.stats.compile_s, 2),
                      "nfe": st.nfe, "tokens": st.tokens, "tokens_per_pass": round(st.tokens_per_pass, 3),
                      "loop_s": round(st.wall_s, 4), "tokens_per_s": round(st.tokens_per_s, 1),
                      "call_s": round(wall, 4), "tokens_per_s_call": round(st.tokens / wall, 1),
                      "ms_per_pass": round(st.wall_s / max(st.nfe, 1) * 1e3, 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    rec = Recorder(args.out, args.deadline_s)
    print(f"[gpu_bench] writing {args.out}", flush=True)
    rec.step("env", lambda: step_env(args))
    state: dict[str, Any] = {}

    def init() -> dict[str, Any]:
        import jax

        from clover_jax.config import get_config
        from clover_jax.model import params

        cfg = get_config(args.config, dtype=args.dtype)
        t0 = time.perf_counter()
        state["weights"] = random_weights(cfg)
        state["cfg"] = cfg
        pc = params.count_params(cfg)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state["weights"]))
        return {"config": args.config, "dtype": args.dtype, "init_s": round(time.perf_counter() - t0, 2),
                "params_total": pc.total, "params_active": pc.active, "weight_bytes": nbytes,
                "layers": cfg.n_layers, "linear_layers": cfg.n_linear_layers, "d_model": cfg.d_model,
                "experts": cfg.n_experts, "top_k": cfg.n_experts_per_tok, "expert_width": cfg.expert_mlp_dim,
                "vocab": cfg.vocab_size, "attention": cfg.attention, "block_size": cfg.block_size}

    rec.step("init", init)
    if "weights" in state:
        for b in args.batches:
            rec.step(f"block_pass_B{b}", lambda b=b: block_pass(args, state["cfg"], state["weights"], b))
    def ragged_step() -> dict[str, Any]:
        cfg = state.get("cfg")
        if cfg is None:  # init failed: the shapes still come from the config
            from clover_jax.config import get_config

            cfg = get_config(args.config, dtype=args.dtype)
        return ragged(args, cfg)

    rec.step("ragged_dot", ragged_step)
    if "weights" in state:
        for b in args.gen_batches:
            rec.step(f"generate_B{b}", lambda b=b: gen(args, state["cfg"], state["weights"], b))
    for scheme in args.quantize:
        state.clear()  # the float (or previous) weights go before the quantized ones are made

        def qinit(scheme: str = scheme) -> dict[str, Any]:
            import jax

            from clover_jax.config import get_config

            cfg = get_config(args.config, dtype=args.dtype, quantization=scheme)
            t0 = time.perf_counter()
            state["weights"], state["cfg"] = random_weights(cfg), cfg
            nbytes = sum(x.nbytes for x in jax.tree.leaves(state["weights"]))
            return {"quantization": scheme, "init_s": round(time.perf_counter() - t0, 2), "weight_bytes": nbytes}

        rec.step(f"init_{scheme}", qinit)
        if "weights" in state:
            for b in args.batches:
                rec.step(f"block_pass_B{b}_{scheme}",
                         lambda b=b: block_pass(args, state["cfg"], state["weights"], b))
    ok = sum(1 for s in rec.data["steps"].values() if s.get("ok"))
    rec.data["meta"]["steps_ok"] = f"{ok}/{len(rec.data['steps'])}"
    rec.write()
    print(f"[gpu_bench] {ok}/{len(rec.data['steps'])} steps ok; JSON: {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
