"""Memory of one attention layer over a whole prompt, dense against chunked, from XLA's compiled programs.

    python benchmarks/attention_memory.py                       # 2K .. 128K, Clover-35B-A3B's attention shapes
    python benchmarks/attention_memory.py --sizes 4096 --chunk 512
    python benchmarks/attention_memory.py --tpu                 # also compiled for one TPU v5e chip (needs libtpu)

For each prompt length T, `model.layers.attend` over [1, T] queries and keys with a causal [1, T, T] mask
(Clover-35B-A3B's gated attention layers: 16 query heads, 2 KV heads, head_dim 256; bfloat16 q / k / v, float32
scores) is lowered and compiled for this machine's backend from shapes alone (nothing is allocated, nothing runs),
and XLA's `memory_analysis()` gives the temporary bytes the program needs beside its inputs and output: the
dense form's float32 [H, T, T] scores, or the chunked form's [H, chunk, chunk] per step. The mask itself (an input,
T * T bytes) is listed apart; the last column passes it as the sampler does, a `masks.BlockMask` built a chunk at
a time (no [T, T] anywhere). With `--tpu` (libtpu installed, no TPU needed) the chunked form and splash attention
(`model.splash`, the TPU kernel a causal-prefix model's prefill takes) are also compiled for one TPU v5e chip, and
the TPU compiler's temporaries are listed beside them. Prints the table; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

from clover_jax.mesh.layouts import Layout
from clover_jax.model import layers, masks, splash

HEADS, KV_HEADS, HEAD_DIM = 16, 2, 256


def temp_bytes(impl: str, t: int, chunk: int, lazy: bool = False) -> tuple[int, float]:
    """(XLA's temporary bytes, compile seconds) of one attention call over `t` columns; `lazy`: the mask as the
    sampler passes it (`masks.BlockMask`, from [1, T] vectors) instead of a [1, T, T] input."""
    q = jax.ShapeDtypeStruct((1, t, HEADS, HEAD_DIM), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, t, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    if lazy:
        mask = jax.ShapeDtypeStruct((1, t), jnp.int32)  # block ids; every column valid

        def f(q, k, v, ids):
            return layers.attend(q, k, v, masks.BlockMask(ids >= 0, ids, ids >= 0, ids, True), impl, chunk)
    else:
        mask = jax.ShapeDtypeStruct((1, t, t), jnp.bool_)

        def f(q, k, v, m):
            return layers.attend(q, k, v, m, impl, chunk)
    t0 = time.perf_counter()
    compiled = jax.jit(f).lower(q, kv, kv, mask).compile()
    return compiled.memory_analysis().temp_size_in_bytes, time.perf_counter() - t0


def tpu_temp_bytes(impl: str, t: int, chunk: int) -> int:
    """XLA's temporary bytes of the same call (mask passed per chunk) compiled for one TPU v5e chip: "chunked" through
    `layers.attend`, "splash" through `model.splash` (the kernel under shard_map on a one-chip mesh)."""
    from clover_jax.plan import aot

    chip = Layout("v5e-1", (1, 1, 1), ("data", "expert", "tensor"), platform="tpu", topology="v5e:2x2", chip="v5e")
    mesh = chip.mesh_rules(list(aot.topology_mesh(chip).devices.flat))
    q = jax.ShapeDtypeStruct((1, t, HEADS, HEAD_DIM), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, t, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def f(q, k, v, ids):
        if impl == "splash":
            return splash.causal_attention(q, k, v, ids >= 0, None, mesh)
        return layers.attend(q, k, v, masks.BlockMask(ids >= 0, ids, ids >= 0, ids, True), impl, chunk)

    sharding = jax.sharding.NamedSharding(mesh.mesh, jax.sharding.PartitionSpec())
    compiled = jax.jit(f, in_shardings=sharding, out_shardings=sharding).lower(q, kv, kv, ids).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192, 32768, 131072])
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--tpu", action="store_true", help="also compile chunked and splash attention for a TPU v5e chip")
    args = p.parse_args()
    gb = 1e9
    print(f"backend {jax.default_backend()}; heads {HEADS}/{KV_HEADS}, head_dim {HEAD_DIM}, chunk {args.chunk}")
    tpu = " TPU v5e chunked temp GB | TPU v5e splash temp GB |" if args.tpu else ""
    print(f"| prompt | dense temp GB | chunked temp GB | mask GB (input) | chunked, mask per chunk: temp GB |{tpu}")
    print("|---|---|---|---|---|" + ("---|---|" if args.tpu else ""))
    for t in args.sizes:
        dense, _ = temp_bytes("dense", t, args.chunk)
        chunked, _ = temp_bytes("chunked", t, args.chunk)
        lazy, _ = temp_bytes("chunked", t, args.chunk, lazy=True)
        row = f"| {t:,} | {dense / gb:.3f} | {chunked / gb:.3f} | {t * t / gb:.3f} | {lazy / gb:.3f} |"
        if args.tpu:
            row += f" {tpu_temp_bytes('chunked', t, args.chunk) / gb:.3f} | {tpu_temp_bytes('splash', t, 0) / gb:.3f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
