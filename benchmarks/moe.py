"""Time and FLOPs of one MoE layer per dispatch strategy, for a fixed token batch, on 8 CPU devices.

    python benchmarks/moe.py                       # 1536 tokens (8 x 192), d 512, 32 experts top-4, width 256
    python benchmarks/moe.py --tokens 256 --strategies ep_gather ep_a2a

Single-device strategies (dense, ragged, tiled) run on device 0; expert-parallel ones (ep_*) run
on the `--layout` mesh (their `mesh=` argument) (default cpu-8: data 2 x expert 4) with the expert
weights sharded by its rules. Each figure is the median wall time of `--runs` warm calls of one
jitted (routing + dispatch), compile excluded. FLOPs: the compiler's cost analysis (summed over
devices for sharded programs) next to the useful count 2*N*(D*E + k*3*D*F). The fake CPU devices
share this host's cores, so the EP rows show the mechanism's overhead, not a speed-up. Prints
figures; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

SINGLE = ("dense", "ragged", "tiled")
EP = ("ep_gather", "ep_a2a", "ep_a2a@dropless", "ep_ragged_a2a")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1536, help="tokens in the batch (default 1536 = 8 x 192)")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-width", type=int, default=256)
    p.add_argument("--layout", default="cpu-8", help="mesh layout for the ep_* strategies")
    p.add_argument("--strategies", nargs="+", default=list(SINGLE + EP),
                   help="dispatches to time; ep_a2a@dropless = ep_a2a with capacity factor = expert-axis size")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from clover_jax.config import get_config
    from clover_jax.mesh import layouts
    from clover_jax.mesh.rules import MeshRules
    from clover_jax.model import moe, params
    from clover_jax.model.moe import expert_parallel

    cfg = get_config("test-clover").replace(
        name="bench-moe", d_model=args.d_model, n_layers=1, n_experts=args.experts, n_experts_per_tok=args.top_k,
        expert_mlp_dim=args.expert_width, n_shared_experts=0, shared_mlp_dim=0, dtype=args.dtype, n_heads=4,
        head_dim=args.d_model // 4)
    rng = np.random.default_rng(0)
    specs = jax.tree.map(lambda s: s, params.abstract(cfg).moe_layers.mlp, is_leaf=params.is_spec)
    arrays = jax.tree.map(lambda s: (rng.standard_normal(s.shape[1:], np.float32) * 0.05).astype(s.dtype), specs,
                          is_leaf=params.is_spec)
    x = jnp.asarray(rng.standard_normal((args.tokens, cfg.d_model), np.float32).astype(args.dtype))
    layout = layouts.load_layout(args.layout)
    mesh = layouts.make_mesh(layout)
    n_ep = mesh.shape.get("expert", 1)
    full = params.weight_shardings(cfg, mesh, layout.rules).moe_layers.mlp
    per_layer = jax.tree.map(lambda sh: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*sh.spec[1:])),
                             full)
    useful = 2 * args.tokens * (cfg.d_model * cfg.n_experts + args.top_k * 3 * cfg.d_model * cfg.expert_mlp_dim)

    print(f"MoE layer: {args.tokens} tokens, d {cfg.d_model}, {cfg.n_experts} experts top-{args.top_k}, width "
          f"{cfg.expert_mlp_dim}, {args.dtype}; {len(jax.devices())} CPU devices on {os.cpu_count()} cores; "
          f"ep_* on {layout.name} {dict(mesh.shape)}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'strategy':<17}{'ms/call':>10}{'compiler GFLOP':>16}{'useful GFLOP':>14}{'useful GFLOP/s':>16}"
          f"{'dropped':>9}")
    for name in args.strategies:
        dispatch, _, variant = name.partition("@")
        sharded = dispatch.startswith("ep_")
        if sharded and mesh.devices.flat[0].platform == "cpu" and dispatch == "ep_ragged_a2a":
            print(f"{name:<17}  skipped: XLA:CPU has no ragged-all-to-all (TPU/GPU only)")
            continue
        w = jax.device_put(arrays, per_layer if sharded else jax.devices()[0])
        xin = jax.device_put(x, jax.devices()[0]) if not sharded else x

        on = MeshRules(mesh, layout.rules) if sharded else None

        def fn(x, w, dispatch=dispatch, on=on):
            r = moe.route(x, w, cfg)
            return moe.DISPATCH[dispatch](x, r, w, cfg, on)

        cf = float(n_ep) if variant == "dropless" else expert_parallel.current_capacity_factor()
        with expert_parallel.capacity_factor(cf):
            compiled = jax.jit(fn).lower(xin, w).compile()
        cost = compiled.cost_analysis()
        cost = (cost[0] if isinstance(cost, list) else cost) or {}
        flops = float(cost.get("flops", 0.0)) * (mesh.size if sharded else 1)
        _, dropped = jax.block_until_ready(compiled(xin, w))
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(xin, w))
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        print(f"{name:<17}{ms:>10.1f}{flops / 1e9:>16.2f}{useful / 1e9:>14.2f}{useful / (ms / 1e3) / 1e9:>16.1f}"
              f"{int(dropped):>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
