"""Sampler figures for the tiny model on this machine: every cache mode x decoding mode.

    python benchmarks/sampler.py                        # the shipped clover-tiny (random clover-tiny if missing)
    python benchmarks/sampler.py --model clover-tiny --gen-length 128 --block-length 32 --batch 1

Per mode it prints: forward passes (NFE), tokens committed per pass, tokens/s, compile time, and
`loop/bare`: the loop's wall time over the time of the same number of bare forward passes of the
kind the mode runs (whole canvas for `none`; one block against a cache for block-causal `prefix`/
`dual`; for bidirectional caches a full refresh per block plus block- or suffix-wide passes), each
a separate jitted call; `loop/fori`: the same, with the bare passes run inside a lax.fori_loop (so
it isolates the sampler's own work from what XLA does differently to code inside loops).
Then, for the same weights run as a bidirectional model (not for hybrids, which the sampler runs
block-causally only), the agreement (% identical tokens) of the approximate `prefix` / `dual` caches
with the uncached run. Timings are the best of `--runs` warm runs; nothing is asserted.

    python benchmarks/sampler.py --context              # hybrid vs all-attention over long prompts

`--context`: the hybrid hybrid clover-tiny and the all-attention clover-tiny-attention (equal width, depth and
experts; random weights, max_seq_len raised) with cache=prefix at prompts of 256, 2,048 and 16,384
tokens (`--lengths`): tokens/s of a whole generate call (prefill included), the prompt prefill alone,
one cached refinement pass over a block (ms), and the cache bytes per sequence.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir or preset (default: the shipped clover-tiny, "
                                                  "else the clover-tiny preset with random weights)")
    p.add_argument("--gen-length", type=int, default=128)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--entropy-bound", type=float, default=1.0)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--no-bidirectional", action="store_true", help="skip the approximate-cache agreement")
    p.add_argument("--context", action="store_true", help="hybrid vs all-attention at long prompts instead")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 2048, 16384], help="prompt lengths of --context")
    return p.parse_args(argv)


def context_row(cfg, weights, p: int, g: int, bl: int, runs: int) -> tuple[float, float, float]:
    """(tokens/s of a generate call, prefill seconds, seconds of one cached refinement pass) at prompt p."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from clover_jax.model import ModelForward, masks
    from clover_jax.sampler import SamplerConfig, generate

    prompt = np.random.default_rng(p).integers(4, cfg.vocab_size, p).tolist()
    sc = SamplerConfig(gen_length=g, block_length=bl, steps=g, cache="prefix", eos_stop=False)
    generate(weights, cfg, [prompt], sc)  # compile
    total, _ = best_of(runs, lambda: generate(weights, cfg, [prompt], sc))
    fwd = ModelForward(cfg)
    t = p + g
    toks = jnp.asarray(prompt + [cfg.mask_token_id] * g, jnp.int32)[None]
    valid = jnp.ones((1, t), bool)
    pos = masks.positions(valid)
    ids = masks.canvas_block_ids(pos, p, bl, cfg.block_size)

    def run(w, cache, lo: int, width: int, commit):
        q = slice(lo, lo + width)
        mask = masks.attention_mask(valid[:, q], ids[:, q], valid, ids, cfg.is_block_causal)
        return fwd(w, toks[:, q], pos[:, q], mask, cache, jnp.int32(lo), 0, bl, valid=valid[:, q], blocks=ids[:, q],
                   commit=commit)

    prefill = jax.jit(lambda w, c: run(w, c, 0, p, None))
    refine = jax.jit(lambda w, c: run(w, c, p, bl, 0))
    empty = fwd.init_cache(1, t)
    jax.block_until_ready(prefill(weights, empty))
    pre_s, (_, cache) = best_of(runs, lambda: jax.block_until_ready(prefill(weights, empty)))
    jax.block_until_ready(refine(weights, cache))
    pass_s, _ = best_of(max(runs, 3), lambda: jax.block_until_ready(refine(weights, cache)))
    return g / total, pre_s, pass_s


def context_figures(args: argparse.Namespace) -> int:
    """The --context table (see the module docstring)."""
    import jax

    from clover_jax.config import get_config
    from clover_jax.model import params
    from clover_jax.plan.arithmetic import cache_bytes

    g, bl = args.gen_length, args.block_length
    print(f"backend {jax.default_backend()} x{jax.device_count()}; gen {g} tokens in blocks of {bl}, one token a "
          f"pass, cache=prefix, batch 1, best of {args.runs}")
    print(f"{'model':42} {'prompt':>7} {'tok/s':>7} {'prefill s':>10} {'ms/pass':>8} {'cache MB/seq':>13}")
    for name in ("clover-tiny", "clover-tiny-attention"):
        cfg = get_config(name, max_seq_len=max(args.lengths) + g)
        weights = params.init(cfg, jax.random.key(0))
        label = f"{name} ({'3 GDN + 1 attention' if cfg.is_hybrid else '4 attention layers'})"
        for p in args.lengths:
            tps, pre_s, pass_s = context_row(cfg, weights, p, g, bl, args.runs)
            mb = cache_bytes(cfg, 1, p + g) / 1e6
            print(f"{label:42} {p:7d} {tps:7.1f} {pre_s:10.2f} {pass_s * 1e3:8.1f} {mb:13.2f}", flush=True)
    return 0


def best_of(n: int, fn) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def bare_forward_times(cfg, weights, batch: int, p: int, g: int, bl: int, runs: int) -> dict[str, tuple[float, float]]:
    """Seconds per bare forward pass of each window kind the sampler runs: (one jitted call, inside a
    lax.fori_loop of 8 passes with changing tokens, as the sampler runs them)."""
    import jax
    import jax.numpy as jnp

    from clover_jax import model
    from clover_jax.model import masks
    from clover_jax.model.masks import attention_mask

    t = p + g
    tokens = (jnp.arange(t + g, dtype=jnp.int32)[None] * 7 + jnp.arange(batch)[:, None]) % cfg.vocab_size
    valid = jnp.ones((batch, t + g), bool).at[:, t:].set(False)
    pos = masks.positions(valid)
    ids = pos // bl

    def window(lo: int, width: int, cache_len: int | None) -> tuple[float, float]:
        def f(w, cache, shift):
            q = slice(lo, lo + width)
            kv, ki = (valid[:, :cache_len], ids[:, :cache_len]) if cache_len else (valid[:, q], ids[:, q])
            mask = attention_mask(valid[:, q], ids[:, q], kv, ki, cfg.is_block_causal)
            toks = (tokens[:, q] + shift) % cfg.vocab_size
            out = model.forward(w, cfg, toks, pos[:, q], mask, cache, lo, logits_start=0, logits_len=bl)
            return out.logits, out.cache

        def looped(w, cache):
            def body(i, c):
                logits, cache = f(w, c[1], i)
                return c[0] + logits[0, 0, 0], cache
            return jax.lax.fori_loop(0, 8, body, (jnp.float32(0), cache))

        cache = None if cache_len is None else model.init_cache(cfg, batch, cache_len)
        one, many = jax.jit(f), jax.jit(looped)
        jax.block_until_ready((one(weights, cache, 0), many(weights, cache)))
        sec, _ = best_of(max(runs, 3), lambda: jax.block_until_ready(one(weights, cache, 0)))
        sec_loop, _ = best_of(max(runs, 2), lambda: jax.block_until_ready(many(weights, cache)))
        return sec, sec_loop / 8

    return {"full": window(0, t, None), "block": window(p, bl, t), "suffix": window(p, g, t + g),
            "full_cached": window(0, t, t)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.context:
        return context_figures(args)
    import jax

    from clover_jax.config import get_config
    from clover_jax.loading import default_model
    from clover_jax.model import params
    from clover_jax.sampler import SamplerConfig, generate

    model = args.model or default_model()
    if os.path.isdir(model):
        from clover_jax.checkpoint import load_model
        from clover_jax.tokenizer import load_tokenizer

        cfg, weights = load_model(model)
        tok = load_tokenizer(model)
        prompt = tok.encode("First Citizen:\nBefore we proceed any further, hear me speak.\n")
        source = f"checkpoint {model}"
    else:
        cfg = get_config(model)
        weights = params.init(cfg, jax.random.key(0))
        prompt = list(range(10, 10 + 40))
        source = f"preset {model} with RANDOM weights (confidences are flat: threshold/entropy modes commit ~1/pass)"
    g, bl, b = args.gen_length, args.block_length, args.batch
    prompts = [prompt] * b
    print(f"model: {source}; {cfg.attention}; batch {b}, prompt {len(prompt)} tokens, gen {g}, block {bl}, "
          f"backend {jax.default_backend()} x{jax.device_count()}")
    p = bl * (1 << max((-(-len(prompt) // bl)) - 1, 0).bit_length())  # the sampler's prompt bucket
    bare = bare_forward_times(cfg, weights, b, p, g, bl, args.runs)
    print("bare forward ms (one call / in a loop): "
          + ", ".join(f"{k} {v[0] * 1e3:.1f} / {v[1] * 1e3:.1f}" for k, v in bare.items()))

    modes = {
        "low_confidence": dict(steps=g),
        f"threshold {args.threshold}": dict(steps=g, threshold=args.threshold),
        f"entropy_bound {args.entropy_bound}": dict(steps=g, entropy_bound=args.entropy_bound),
    }
    header = (f"{'cache':7} {'mode':22} {'NFE':>5} {'tok/pass':>8} {'tok/s':>8} {'compile s':>9} {'loop/bare':>9} "
              f"{'loop/fori':>9}")
    print(header)
    print("-" * len(header))
    n_blocks = g // bl
    for cache in ("none", "prefix", "dual"):
        for name, kw in modes.items():
            sc = SamplerConfig(gen_length=g, block_length=bl, cache=cache, eos_stop=False, **kw)
            first = generate(weights, cfg, prompts, sc)
            _, res = best_of(args.runs, lambda sc=sc: generate(weights, cfg, prompts, sc))
            st = res.stats
            ratios = []
            for k in (0, 1):  # the same passes as single calls, and inside a fori_loop
                if cache == "none":
                    bare_s = st.nfe * bare["full"][k]
                elif cfg.is_block_causal:  # prefill + block windows (a block's first step is 2 blocks wide)
                    bare_s = bare["full"][k] * p / (p + g) + (st.nfe - 1) * bare["block"][k]
                else:
                    per_step = bare["suffix"][k] if cache == "prefix" else bare["block"][k]
                    bare_s = n_blocks * bare["full_cached"][k] + (st.nfe - n_blocks) * per_step
                ratios.append(st.wall_s / bare_s)
            print(f"{cache:7} {name:22} {st.nfe:5d} {st.tokens_per_pass:8.2f} {st.tokens_per_s:8.1f} "
                  f"{first.stats.compile_s:9.1f} {ratios[0]:9.2f} {ratios[1]:9.2f}")
    if cfg.is_block_causal:
        print("(block-causal: prefix and dual are one program and exact; NFE includes the prompt prefill)")

    if not args.no_bidirectional and not cfg.is_hybrid:
        bcfg = cfg.replace(attention="bidirectional")
        print(f"\nthe same weights run bidirectionally ({bcfg.name}, attention=bidirectional): "
              "agreement with cache=none")
        for name, kw in modes.items():
            ref = generate(weights, bcfg, prompts, SamplerConfig(gen_length=g, block_length=bl, eos_stop=False, **kw))
            cells = []
            for cache in ("prefix", "dual"):
                got = generate(weights, bcfg, prompts, SamplerConfig(gen_length=g, block_length=bl, cache=cache,
                                                                     eos_stop=False, **kw))
                same = float((got.raw == ref.raw).mean() * 100)
                cells.append(f"{cache} {same:5.1f}% identical tokens ({got.stats.nfe} passes, "
                             f"{got.stats.tokens_per_s:.0f} tok/s)")
            print(f"  {name:22} none {ref.stats.nfe} passes, {ref.stats.tokens_per_s:.0f} tok/s | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
