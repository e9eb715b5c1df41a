"""Conversion throughput and peak memory on a generated multi-GB checkpoint.

Writes a synthetic HuggingFace checkpoint (LLaDA2 layout by default: fused q/k/v, per-expert
keys, bf16, sharded safetensors) of about --size-gb, converts it HF -> native -> HF with
`clover convert`, each in a child process, and prints MB/s and the child's peak RSS
(ru_maxrss). The goal: peak well under 2 GB for a 6 GB checkpoint. Everything is written under
--workdir (default: a temp dir) and deleted at the end unless --keep.

    python benchmarks/convert.py                 # ~6 GB
    python benchmarks/convert.py --size-gb 1     # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np


def _child(src: str, dst: str) -> None:
    """Run one conversion in this process and report its peak RSS."""
    import resource

    from clover_jax.convert import convert

    t = time.perf_counter()
    convert(src, dst, progress=True)
    secs = time.perf_counter() - t
    print(json.dumps({"seconds": secs, "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def generate(path: str, size_gb: float, layout: str) -> dict:
    """A synthetic HF checkpoint of about `size_gb`, written one tensor at a time."""
    from clover_jax.config import get_config
    from clover_jax.convert import FAMILIES
    from clover_jax.convert.hf_io import PlannedTensor, ShardedWriter, np_dtype

    base = {"llada2_moe": "llada2-mini", "llada_moe": "llada-moe-7b-a1b"}.get(layout, "llada2-mini")
    cfg = get_config(base, n_layers=2)
    mod = FAMILIES[layout]
    per_layer = sum(int(np.prod(s)) * 2 for g in mod.groups(cfg) for k, s in zip(g.hf, g.hf_shapes, strict=True)
                    if ".layers.1." in k)
    fixed = 2 * cfg.vocab_size * cfg.d_model * 2
    n_layers = cfg.n_dense_layers + max(1, round((size_gb * 1e9 - fixed) / per_layer))
    cfg = cfg.replace(n_layers=n_layers)
    groups = mod.groups(cfg)
    plan = [PlannedTensor(k, tuple(s), "bfloat16" if g.kind == "matmul" else "float32")
            for g in groups for k, s in zip(g.hf, g.hf_shapes, strict=True)]
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(mod.config_to_hf(cfg), f, indent=2)
    pool32 = np.random.default_rng(0).standard_normal(1 << 22, np.float32) * 0.02
    pools = {dt: pool32.astype(np_dtype(dt)) for dt in ("bfloat16", "float32")}
    writer = ShardedWriter(path, plan, 2 * 1024**3)
    for j, t in enumerate(plan):
        out = np.empty(t.shape, np_dtype(t.dtype))
        flat, pool = out.reshape(-1), pools[t.dtype]
        start = (j * 7919) % (pool.size // 2)
        for a in range(0, flat.size, pool.size // 2):  # tile a random pool: cheap, not all-equal
            n = min(pool.size // 2, flat.size - a)
            flat[a:a + n] = pool[start:start + n]
        writer.write(t.key, out)
    writer.finish()
    return {"layers": n_layers, "tensors": len(plan), "bytes": _dir_bytes(path)}


def run_child(src: str, dst: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", src, dst], stdout=subprocess.PIPE, check=True,
                         env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=6.0, help="approximate checkpoint size (default 6)")
    p.add_argument("--layout", default="llada2_moe", choices=["llada2_moe", "llada_moe"])
    p.add_argument("--workdir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the generated files")
    p.add_argument("--child", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    p.add_argument("--generate", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.generate:
        print(json.dumps(generate(args.generate[0], float(args.generate[1]), args.generate[2])))
        return
    if args.child:
        _child(*args.child)
        return
    work = tempfile.mkdtemp(prefix="clover-convert-bench-", dir=args.workdir)
    try:
        t = time.perf_counter()
        # In a child too, so that this parent stays small: a child's ru_maxrss starts from its parent's.
        out = subprocess.run([sys.executable, __file__, "--generate", os.path.join(work, "hf"), str(args.size_gb),
                              args.layout], stdout=subprocess.PIPE, check=True)
        info = json.loads(out.stdout.decode().strip().splitlines()[-1])
        gen_s = time.perf_counter() - t
        mb = info["bytes"] / 1e6
        print(f"generated {args.layout}: {info['layers']} layers, {info['tensors']} tensors, {mb:.0f} MB "
              f"in {gen_s:.1f} s", flush=True)
        for name, src, dst in (("HF -> native", "hf", "native"), ("native -> HF", "native", "back")):
            r = run_child(os.path.join(work, src), os.path.join(work, dst))
            print(f"{name:13s} {mb / r['seconds']:7.0f} MB/s  {r['seconds']:6.1f} s  "
                  f"peak RSS {r['peak_rss_kb'] / 1024:6.0f} MB", flush=True)
        print(f"native size {_dir_bytes(os.path.join(work, 'native')) / 1e6:.0f} MB, "
              f"HF re-export {_dir_bytes(os.path.join(work, 'back')) / 1e6:.0f} MB")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
