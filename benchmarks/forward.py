"""Milliseconds per forward pass for each MoE dispatch, next to transformers' Qwen3-MoE on the same weights.

    python benchmarks/forward.py                  # medium shape: 8 layers, d 512, 32 experts top-4, B = 1 and 8
    python benchmarks/forward.py --batch 1 --dispatch tiled --no-torch
    python benchmarks/forward.py --hybrid             # Qwen3.5 layout: 2 groups of 3 Gated DeltaNet + 1 gated attn
    python benchmarks/forward.py --gdn                # one Gated DeltaNet layer: chunked vs recurrent, T 32..2048
    python benchmarks/forward.py --no-torch --dispatch tiled ragged --quantize int8 fp8 --dtype float32 bfloat16
                                                      # weight-only int8 / fp8 next to the float weights

Every figure is the median wall time of `--runs` warm calls of one jitted forward pass (compile excluded),
the candidates taken in turns so that a busy neighbour on a shared machine slows all of them alike;
transformers runs under torch.inference_mode with as many threads as cores. Prints figures, asserts nothing
about time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (default: 1 8)")
    p.add_argument("--seq", type=int, default=192, help="tokens per row")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dispatch", nargs="+", default=["dense", "ragged", "tiled-jax", "tiled"],
                   help="JAX dispatches to time; NAME-jax: NAME with clover_jax.kernels switched off (pure JAX)")
    p.add_argument("--runs", type=int, default=9, help="timed warm runs per figure (median)")
    p.add_argument("--no-torch", action="store_true", help="skip transformers")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch threads (default: the core count; 1 is fairer on a machine others are loading)")
    p.add_argument("--check", action="store_true", help="also compare logits of each dispatch with transformers")
    p.add_argument("--hybrid", action="store_true",
                   help="the hybrid layout (groups of 3 Gated DeltaNet + 1 gated attention layer, gated shared expert, "
                        "causal) next to transformers' Qwen3_5MoeForCausalLM")
    p.add_argument("--gdn", action="store_true",
                   help="only one Gated DeltaNet layer: chunked vs recurrent form (and transformers') at --gdn-lengths")
    p.add_argument("--gdn-lengths", type=int, nargs="+", default=[32, 256, 2048])
    p.add_argument("--quantize", nargs="+", default=[], choices=["int8", "fp8"],
                   help="also time each dispatch with weight-only quantized matmul weights (candidates NAME@int8, "
                        "NAME@fp8), and print their max |logit diff| against the float weights")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                   help="weight / activation dtypes to time (default float32; candidates NAME:bfloat16)")
    args = p.parse_args(argv)
    for name in ("seq", "layers", "d_model", "heads", "kv_heads", "head_dim", "experts", "top_k", "expert_width",
                 "vocab", "runs"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if any(b <= 0 for b in args.batch):
        p.error("--batch sizes must be positive")
    return args


def make_config(args: argparse.Namespace):
    from clover_jax.config import ModelConfig

    if args.hybrid or args.gdn:
        group = ("linear_attention",) * 3 + ("full_attention",)
        if args.layers % 4:
            raise SystemExit("--hybrid needs --layers in groups of 4 (3 Gated DeltaNet + 1 attention)")
        return ModelConfig(
            name="bench-qwen3-5-moe", family="qwen3_5_moe", vocab_size=args.vocab, d_model=args.d_model,
            n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads, head_dim=args.head_dim,
            n_experts=args.experts, n_experts_per_tok=args.top_k, expert_mlp_dim=args.expert_width,
            n_shared_experts=1, shared_mlp_dim=args.expert_width, shared_expert_gate=True, router="softmax",
            norm_topk_prob=True, attention="block_causal", block_size=1, qk_norm=True, attn_output_gate=True,
            norm_unit_offset=True, partial_rotary_factor=0.25, layer_types=group * (args.layers // 4),
            linear_num_key_heads=args.heads // 2, linear_num_value_heads=args.heads, linear_key_head_dim=args.head_dim,
            linear_value_head_dim=args.head_dim, dtype=args.dtype[0], max_seq_len=max(4096, args.seq), eos_token_id=1,
            pad_token_id=0, init_std=0.05,
        )
    return ModelConfig(
        name="bench-qwen3-moe", family="qwen3_moe", vocab_size=args.vocab, d_model=args.d_model,
        n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads, head_dim=args.head_dim,
        n_experts=args.experts, n_experts_per_tok=args.top_k, expert_mlp_dim=args.expert_width,
        router="softmax", norm_topk_prob=True, attention="bidirectional", qk_norm=True, dtype=args.dtype[0],
        max_seq_len=max(4096, args.seq), eos_token_id=1, pad_token_id=0,
    )


def hf_state_dict(weights, cfg) -> dict[str, np.ndarray]:
    """Our Weights -> transformers Qwen3MoeForCausalLM state dict (experts fused as in transformers 5)."""
    t = lambda a: np.asarray(a, np.float32)
    d, hd = cfg.d_model, cfg.head_dim
    sd = {"model.embed_tokens.weight": t(weights.embed), "model.norm.weight": t(weights.final_norm),
          "lm_head.weight": t(weights.lm_head).T}
    L = weights.moe_layers
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        a = L.attn
        sd[p + "input_layernorm.weight"] = t(L.attn_norm[i])
        sd[p + "post_attention_layernorm.weight"] = t(L.mlp_norm[i])
        sd[p + "self_attn.q_proj.weight"] = t(a.q[i]).reshape(d, -1).T
        sd[p + "self_attn.k_proj.weight"] = t(a.k[i]).reshape(d, -1).T
        sd[p + "self_attn.v_proj.weight"] = t(a.v[i]).reshape(d, -1).T
        sd[p + "self_attn.o_proj.weight"] = t(a.o[i]).reshape(cfg.n_heads * hd, d).T
        sd[p + "self_attn.q_norm.weight"] = t(a.q_norm[i])
        sd[p + "self_attn.k_norm.weight"] = t(a.k_norm[i])
        m = L.mlp
        sd[p + "mlp.gate.weight"] = t(m.router[i]).T
        sd[p + "mlp.experts.gate_up_proj"] = np.concatenate([t(m.gate[i]), t(m.up[i])], -1).transpose(0, 2, 1)
        sd[p + "mlp.experts.down_proj"] = t(m.down[i]).transpose(0, 2, 1)
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def hf_hybrid_model(weights, cfg):
    """transformers' Qwen3_5MoeForCausalLM with our weights, mapped by the qwen3_5_moe converter's own groups
    (experts in transformers 5's fused in-memory form)."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from clover_jax.checkpoint import flatten_weights
    from clover_jax.convert import qwen3_5_moe

    hf = qwen3_5_moe.config_to_hf(cfg)
    hf_cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in hf.items() if k not in ("model_type", "architectures", "dtype",
                                                                             "torch_dtype", "mask_token_id")})
    model = Qwen3_5MoeForCausalLM(hf_cfg).eval()
    flat = {n: np.asarray(a, np.float32) for n, a in flatten_weights(weights).items()}
    sd = {}
    for g in qwen3_5_moe.groups(cfg, fused_experts=True):
        arrays = [flat[n] if i is None else flat[n][i] for n, i in g.native]
        sd.update({k: torch.from_numpy(np.array(a)) for k, a in zip(g.hf, g.to_hf(arrays), strict=True)})
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"weight mapping mismatch: missing {missing}, unexpected {unexpected}")
    return model


def hf_model(weights, cfg):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if cfg.is_hybrid:
        return hf_hybrid_model(weights, cfg)
    hf_cfg = Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        num_experts=cfg.n_experts, num_experts_per_tok=cfg.n_experts_per_tok,
        moe_intermediate_size=cfg.expert_mlp_dim, intermediate_size=cfg.expert_mlp_dim,
        norm_topk_prob=cfg.norm_topk_prob, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    model = Qwen3MoeForCausalLM(hf_cfg).eval()
    sd = {k: torch.from_numpy(v) for k, v in hf_state_dict(weights, cfg).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise RuntimeError(f"weight mapping mismatch: missing {missing}, unexpected {unexpected}")
    return model


def interleaved_ms(calls: dict, runs: int) -> dict[str, list[float]]:
    """Wall ms of `runs` warm calls of each candidate, taken in turns (A B C A B C ...) so that a
    change in the machine's load hits every candidate alike. Each is called once first (compile)."""
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(runs):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    from clover_jax import kernels, model
    from clover_jax.model.moe import DISPATCH
    from clover_jax.model.params import abstract, init, is_spec, quantize_weights

    unknown = [d for d in args.dispatch if d.removesuffix("-jax") not in DISPATCH]
    if unknown:
        print(f"unknown dispatch {unknown}; known: {sorted(DISPATCH)}", file=sys.stderr)
        return 2
    cfg = make_config(args).replace(dtype="float32")
    weights = init(cfg, jax.random.key(0))
    # Every candidate's weights: (config, weights) by suffix; "" = the first --dtype, float.
    variants = {}
    for dt in args.dtype:
        c = cfg.replace(dtype=dt)
        w = jax.tree.map(lambda s, a: a.astype(s.dtype), abstract(c), weights, is_leaf=is_spec)  # routers stay f32
        suffix = "" if dt == args.dtype[0] else f":{dt}"
        variants[suffix] = (c, w)
        for scheme in args.quantize:
            variants[f"{suffix}@{scheme}"] = quantize_weights(c, w, scheme)
    if args.gdn:
        return gdn_layer(args, cfg, weights)
    cores = os.cpu_count() or 1
    print(f"{cfg.n_layers} layers, d {cfg.d_model}, {cfg.n_heads}x{cfg.head_dim} heads ({cfg.n_kv_heads} kv), "
          f"{cfg.n_experts} experts top-{cfg.n_experts_per_tok} width {cfg.expert_mlp_dim}, vocab {cfg.vocab_size}, "
          f"{'/'.join(args.dtype)}{' + ' + '/'.join(args.quantize) if args.quantize else ''}, {args.seq} tokens/row; "
          f"jax {jax.__version__} on {jax.default_backend()}, {cores} cores; "
          f"median of {args.runs} warm runs", flush=True)
    if jax.default_backend() == "cpu":
        state = "on" if kernels.available() else f"off ({kernels.unavailable_reason() or 'CLOVER_KERNELS=0'})"
        print(f"CPU kernels (float32 `tiled` on CPU; `-jax` candidates run without them): {state}", flush=True)

    torch_model = None
    if not args.no_torch:
        try:
            import torch

            torch.set_num_threads(args.torch_threads or cores)
            torch_model = hf_model(weights, cfg)
            print(f"transformers experts implementation: {torch_model.config._experts_implementation}, "
                  f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
        except ImportError as e:
            print(f"transformers skipped: {e}", flush=True)

    rows = []
    for b in args.batch:
        tokens = jax.random.randint(jax.random.key(b), (b, args.seq), 0, cfg.vocab_size)
        calls, fwds = {}, {}
        if torch_model is not None:
            import torch

            ids = torch.from_numpy(np.asarray(tokens).astype(np.int64))
            # bidirectional for Qwen3-MoE; the hybrid runs causally, transformers' default
            mask4 = None if cfg.is_hybrid else torch.ones((b, 1, args.seq, args.seq), dtype=torch.bool)

            def run_torch(ids=ids, mask4=mask4):
                with torch.inference_mode():
                    return torch_model(input_ids=ids, attention_mask=mask4).logits

            calls["transformers"] = run_torch
        for base in args.dispatch:
            for suffix, (c, w) in variants.items():
                # Compiled here, so that a NAME-jax candidate is traced with the CPU kernels off.
                name, dispatch = base + suffix, base.removesuffix("-jax")
                with kernels.switched_off() if base.endswith("-jax") else contextlib.nullcontext():
                    fwd = jax.jit(lambda w, t, d=dispatch, c=c: model.apply(w, c, t, dispatch=d)).lower(
                        w, tokens).compile()
                fwds[name] = (fwd, w)
                calls[name] = lambda fwd=fwd, w=w, tokens=tokens: fwd(w, tokens).block_until_ready()
        times = interleaved_ms(calls, args.runs)
        row = {"B": b}
        ref = calls["transformers"]().numpy() if args.check and torch_model is not None else None
        for name, ts in times.items():
            row[name] = statistics.median(ts)
            extra = ""
            if ref is not None and name != "transformers":
                fwd, w = fwds[name]
                err = float(jnp.max(jnp.abs(fwd(w, tokens) - ref)))
                extra = f" (max |logit diff| vs transformers {err:.2e})"
            elif "@" in name:
                fwd, w = fwds[name]
                plain = name.split("@")[0]
                f0, w0 = fwds[plain]
                r0 = f0(w0, tokens)
                err = float(jnp.max(jnp.abs(fwd(w, tokens) - r0)) / jnp.max(jnp.abs(r0)))
                extra = f" (max |logit diff| vs {plain}, relative to its max |logit|: {err:.2e})"
            print(f"B={b} {name} {row[name]:.1f} ms (min {min(ts):.1f}){extra}", flush=True)
        rows.append(row)

    cols = (["transformers"] if torch_model is not None else []) + [n for n in rows[0] if n != "B"
                                                                     and n != "transformers"]
    print("\n| B | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for row in rows:
        print(f"| {row['B']} | " + " | ".join(f"{row[c]:.0f}" for c in cols) + " |")
    return 0


def gdn_layer(args: argparse.Namespace, cfg, weights) -> int:
    """ms per call of one Gated DeltaNet mixer (B=1) at each length: the chunked and the recurrent form here,
    and transformers' Qwen3_5MoeGatedDeltaNet (its torch chunked fallback) on the same weights."""
    import jax
    import jax.numpy as jnp

    layer = jax.tree.map(lambda a: a[0], weights.linear_layers).attn
    torch_layer = None
    if not args.no_torch:
        import torch

        torch.set_num_threads(args.torch_threads or os.cpu_count() or 1)
        torch_layer = hf_hybrid_model(weights, cfg).model.layers[0].linear_attn
    print(f"one Gated DeltaNet layer: d {cfg.d_model}, {cfg.linear_num_key_heads} key / {cfg.linear_num_value_heads} "
          f"value heads of {cfg.linear_key_head_dim}, B=1, fp32; median of {args.runs} warm runs")
    print("| T | chunked (64) | recurrent | transformers |\n|---|---|---|---|")
    for t in args.gdn_lengths:
        x = jax.random.normal(jax.random.key(t), (1, t, cfg.d_model), jnp.float32)
        calls = {}
        for name, chunk in (("chunked", 0), ("recurrent", 10**9)):
            fn = jax.jit(lambda x, chunk=chunk: _mixer_with(chunk, x, layer, cfg)).lower(x).compile()
            calls[name] = lambda fn=fn, x=x: fn(x).block_until_ready()
        if torch_layer is not None:
            xt = torch.from_numpy(np.asarray(x))

            def run_torch(xt=xt):
                with torch.inference_mode():
                    return torch_layer(xt)

            calls["transformers"] = run_torch
        times = {k: statistics.median(v) for k, v in interleaved_ms(calls, args.runs).items()}
        print(f"| {t} | {times['chunked']:.1f} | {times['recurrent']:.1f} | "
              f"{times.get('transformers', float('nan')):.1f} |", flush=True)
    return 0


def _mixer_with(chunk_threshold: int, x, layer, cfg):
    """The mixer with the chunked form for windows longer than `chunk_threshold` (0: always chunked)."""
    from clover_jax.model import delta_rule, gated_deltanet

    saved = delta_rule.RECURRENT_MAX
    delta_rule.RECURRENT_MAX = chunk_threshold  # read while tracing: this jitted function keeps its form
    try:
        return gated_deltanet.mixer(x, layer, cfg)[0]
    finally:
        delta_rule.RECURRENT_MAX = saved


if __name__ == "__main__":
    sys.exit(main())
