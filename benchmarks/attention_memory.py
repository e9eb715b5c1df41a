"""Memory of one attention layer over a whole prompt, dense against chunked, from XLA's compiled programs.

    python benchmarks/attention_memory.py                       # 2K .. 128K, Clover-35B-A3B's attention shapes
    python benchmarks/attention_memory.py --sizes 4096 --chunk 512

For each prompt length T, `model.layers.attend` over [1, T] queries and keys with a causal [1, T, T] mask
(Clover-35B-A3B's gated attention layers: 16 query heads, 2 KV heads, head_dim 256; bfloat16 q / k / v, float32
scores) is lowered and compiled for this machine's backend from shapes alone (nothing is allocated, nothing runs),
and XLA's `memory_analysis()` gives the temporary bytes the program needs beside its inputs and output: the
dense form's float32 [H, T, T] scores, or the chunked form's [H, chunk, chunk] per step. The mask itself (an input,
T * T bytes) is listed apart; the last column passes it as the sampler does, a `masks.BlockMask` built a chunk at
a time (no [T, T] anywhere). Prints the table; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

from clover_jax.model import layers, masks

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192, 32768, 131072])
    p.add_argument("--chunk", type=int, default=1024)
    args = p.parse_args()
    gb = 1e9
    print(f"backend {jax.default_backend()}; heads {HEADS}/{KV_HEADS}, head_dim {HEAD_DIM}, chunk {args.chunk}")
    print("| prompt | dense temp GB | chunked temp GB | mask GB (input) | chunked, mask per chunk: temp GB |")
    print("|---|---|---|---|---|")
    for t in args.sizes:
        dense, _ = temp_bytes("dense", t, args.chunk)
        chunked, _ = temp_bytes("chunked", t, args.chunk)
        lazy, _ = temp_bytes("chunked", t, args.chunk, lazy=True)
        print(f"| {t:,} | {dense / gb:.3f} | {chunked / gb:.3f} | {t * t / gb:.3f} | {lazy / gb:.3f} |", flush=True)


if __name__ == "__main__":
    main()
