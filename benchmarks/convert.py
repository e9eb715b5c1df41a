"""Conversion throughput and peak memory on a generated multi-GB checkpoint.

Writes a synthetic HuggingFace checkpoint (LLaDA2 layout by default: fused q/k/v, per-expert
keys, bf16, sharded safetensors) of about --size-gb, converts it HF -> native -> HF with
`clover convert`, each in a child process, and prints MB/s and the child's peak RSS
(ru_maxrss). The goal: peak well under 2 GB for a 6 GB checkpoint. Everything is written under
a temp dir in --dir (default /tmp) and deleted at the end unless --keep.

With --sizes (e.g. 1,3): HF -> native imports of checkpoints of each size (GB) whose largest tensor is the
same (a 32k vocabulary, 32 experts; more layers for more GB), each in a child: read GB/s, the child's peak
RSS above its RSS before converting (imports and the JAX runtime: the constant), and that against the
largest tensor. The goal: peak RSS < 2x the largest tensor + the constant, at every size. Then a resume:
`clover convert` killed (SIGKILL) halfway through the largest size's import, rerun, its time against a
whole run's.

    python benchmarks/convert.py                 # ~6 GB
    python benchmarks/convert.py --size-gb 1     # quicker
    python benchmarks/convert.py --sizes 1,3     # peak RSS against checkpoint size, and a resume
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np


def _child(src: str, dst: str) -> None:
    """Run one conversion in this process and report its peak RSS."""
    import resource

    import jax

    from clover_jax.commands.convert import few_malloc_arenas
    from clover_jax.convert import convert

    if os.environ.get("CLOVER_BENCH_ARENAS", "few") == "few":
        few_malloc_arenas()  # as `clover convert` does
    jax.devices()  # the runtime up, as a conversion has it: part of the constant, not of the conversion
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    convert(src, dst, progress=True)
    secs = time.perf_counter() - t
    print(json.dumps({"seconds": secs, "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "base_rss_kb": base}))


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def generate(path: str, size_gb: float, layout: str, overrides: dict | None = None) -> dict:
    """A synthetic HF checkpoint of about `size_gb`, written one tensor at a time (`overrides`: config fields)."""
    from clover_jax.config import get_config
    from clover_jax.convert import FAMILIES
    from clover_jax.convert.hf_io import PlannedTensor, ShardedWriter, np_dtype

    base = {"llada2_moe": "llada2-mini", "llada_moe": "llada-moe-7b-a1b"}.get(layout, "llada2-mini")
    cfg = get_config(base, n_layers=2, **(overrides or {}))
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
    return {"layers": n_layers, "tensors": len(plan), "bytes": _dir_bytes(path),
            "largest": max(int(np.prod(t.shape)) * np_dtype(t.dtype).itemsize for t in plan)}


def run_child(src: str, dst: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", src, dst], stdout=subprocess.PIPE, check=True,
                         env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


# --sizes: a 32k vocabulary and 32 experts; the largest tensor is then embed (32768 x 2048 bf16, 134 MB) at any size
SAME_LARGEST = {"vocab_size": 32768, "mask_token_id": 32767, "eos_token_id": 32766, "pad_token_id": 32766,
                "n_experts": 32}


def _generate_child(path: str, size_gb: float, layout: str, overrides: dict | None = None) -> dict:
    # In a child too, so that this parent stays small: a child's ru_maxrss starts from its parent's.
    out = subprocess.run([sys.executable, __file__, "--generate", path, str(size_gb), layout,
                          json.dumps(overrides or {})], stdout=subprocess.PIPE, check=True)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def _cli(src: str, dst: str, kill_after: float | None = None) -> tuple[float, str]:
    """`python -m clover_jax convert SRC DST --no-progress`: (wall seconds, stderr); SIGKILLed after `kill_after`
    seconds if given."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "clover_jax", "convert", src, dst, "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})
    try:
        _, err = proc.communicate(timeout=kill_after)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
    if kill_after is None and proc.returncode:
        raise SystemExit(f"clover convert failed: {err.decode()[-2000:]}")
    return time.perf_counter() - t, err.decode()


def sizes_run(work: str, sizes: list[float], layout: str) -> None:
    """Peak RSS of HF -> native imports against checkpoint size (same largest tensor), then a resume."""
    rows = []
    for size in sizes:
        hf = os.path.join(work, f"hf-{size:g}")
        info = _generate_child(hf, size, layout, SAME_LARGEST)
        r = run_child(hf, os.path.join(work, f"native-{size:g}"))
        peak, base = r["peak_rss_kb"] * 1024, r["base_rss_kb"] * 1024
        rows.append((size, info, r))
        print(f"{size:g} GB target: {info['bytes'] / 1e9:5.2f} GB read, {info['layers']} layers, largest tensor "
              f"{info['largest'] / 1e6:.0f} MB | {info['bytes'] / 1e9 / r['seconds']:5.2f} GB/s "
              f"({r['seconds']:5.1f} s) | peak RSS {peak / 1e6:5.0f} MB = {base / 1e6:.0f} MB before converting + "
              f"{(peak - base) / 1e6:.0f} MB ({(peak - base) / info['largest']:.2f}x the largest tensor)", flush=True)
        shutil.rmtree(os.path.join(work, f"native-{size:g}"), ignore_errors=True)
    growth = (rows[-1][2]["peak_rss_kb"] - rows[0][2]["peak_rss_kb"]) / 1024
    print(f"peak RSS from {rows[0][0]:g} GB to {rows[-1][0]:g} GB: {growth:+.0f} MB", flush=True)

    hf = os.path.join(work, f"hf-{sizes[-1]:g}")
    full, _ = _cli(hf, os.path.join(work, "full"))
    shutil.rmtree(os.path.join(work, "full"), ignore_errors=True)
    dst = os.path.join(work, "resumed")
    _cli(hf, dst, kill_after=full / 2)
    if os.path.exists(dst) or not glob.glob(dst + ".tmp-*"):
        print("resume: the run finished before the kill; nothing to resume")
        return
    resumed, err = _cli(hf, dst)
    said = re.search(r"(\d+) of (\d+) chunks \(([^)]*)\) already written", err)
    print(f"resume ({sizes[-1]:g} GB, killed after {full / 2:.1f} s): whole run {full:.1f} s, resumed run "
          f"{resumed:.1f} s ({resumed / full:.0%}); the resumed run found "
          + (f"{said[1]} of {said[2]} chunks ({said[3]}) written" if said else f"nothing to resume: {err.strip()}"),
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=6.0, help="approximate checkpoint size (default 6)")
    p.add_argument("--layout", default="llada2_moe", choices=["llada2_moe", "llada_moe"])
    p.add_argument("--sizes", default=None, help="comma-separated checkpoint sizes in GB (e.g. 1,3): peak RSS "
                   "against checkpoint size with the same largest tensor, and a resume (instead of --size-gb)")
    p.add_argument("--dir", "--workdir", dest="dir", default="/tmp",
                   help="where the temp dir with everything goes (default /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the generated files")
    p.add_argument("--child", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    p.add_argument("--generate", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.generate:
        path, size, layout, overrides = args.generate
        print(json.dumps(generate(path, float(size), layout, json.loads(overrides))))
        return
    if args.child:
        _child(*args.child)
        return
    work = tempfile.mkdtemp(prefix="clover-convert-bench-", dir=args.dir)
    try:
        if args.sizes:
            sizes_run(work, [float(x) for x in args.sizes.split(",")], args.layout)
            return
        t = time.perf_counter()
        info = _generate_child(os.path.join(work, "hf"), args.size_gb, args.layout)
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
