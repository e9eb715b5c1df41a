"""Causal attention through Pallas splash attention, TPU's flash-attention kernel.

Splash attention reads a static mask (its sparsity decides which key blocks a query block skips) and-ed with
segment ids (a query sees a key only where their ids are equal). A causal window of queries, columns
[offset, offset + W) of a cache of S columns, is not a static mask when `offset` is traced (a chunked prefill's
windows), so it runs as two kernel calls whose softmaxes are merged by their log-sum-exps:

    the window's own keys   the window's fresh K/V, static `CausalMask` (key column <= query column), segment ids
                            from validity (a padding query sees padding keys only, so no row is empty)
    the cache before it     the cache in segments of CACHE_SEGMENT columns, as many as cover `offset` (a loop of
                            traced length: the first window reads none), `FullMask`, segment ids: a key counts when
                            it is valid and before `offset`

which equals one softmax over all (what `layers.attend` computes from the mask). Lengths are padded to the
kernel's blocks (queries and keys at the end, in segments no real query shares). Rows and KV heads are mapped
over (`vmap`); the H / K query heads of a KV head are the kernel's heads (its MQA form). On a mesh the kernel runs
under `shard_map` (Mosaic kernels are not partitioned by the compiler): rows over the batch axes, heads over the
heads' axes. Off TPU the same kernel runs in Pallas' interpret mode (exact, slow: for tests and for checking).

The caller promises that the mask is causal in columns (`masks.BlockMask.causal`): a prompt's prefill of a
causal-prefix model, or a cache-free pass over clean text of one. Other masks (block-causal, the block being
denoised) stay with `layers.attend`.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as kmask
from jax.sharding import PartitionSpec

from clover_jax.errors import ShardingError
from clover_jax.mesh.rules import MeshRules
from clover_jax.model import layers

Array = jax.Array

MIN_QUERIES = 128  # a narrower window (a block pass) stays with `layers.attend`: a kernel block of mostly padding
MAX_BLOCK = 512  # the kernel's query / key block (MaxText's default for prefill)
CACHE_SEGMENT = 8192  # columns of the cache a window reads in one kernel call


def platform(mesh: MeshRules | None) -> str:
    """The platform a program runs on: its mesh's devices' (a TPU topology when `clover plan` compiles for one),
    else JAX's default backend."""
    devices = getattr(mesh.mesh, "devices", None) if mesh is not None else None
    if devices is not None and getattr(devices, "size", 0):
        return str(devices.flat[0].platform)
    return jax.default_backend()


def _specs(mesh: MeshRules) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec]:
    """The shard_map specs of q [B, W, H, hd], k / v [B, *, K, hd] and [B, *] vectors on `mesh`."""
    return (mesh.spec(("batch", None, "q_heads", None)), mesh.spec(("batch", None, "kv_heads", None)),
            mesh.spec(("batch", None)))


def _heads_apart(q_spec: PartitionSpec, kv_spec: PartitionSpec) -> ShardingError | None:
    """The error for rules that put query and KV heads on different mesh axes (each device must hold the KV heads
    its query heads read), or None."""
    if q_spec[2] == kv_spec[2]:
        return None
    return ShardingError(f"splash attention needs query and KV heads on the same mesh axes; the rules put them on "
                         f"{q_spec[2]!r} and {kv_spec[2]!r} (use --attention chunked)")


def _divides(mesh: MeshRules, spec: PartitionSpec, shape: tuple[int, ...]) -> bool:
    """Whether every axis of `shape` is a whole number of shards under `spec` (shard_map takes no uneven shards)."""
    for n, axes in zip(shape, spec, strict=False):
        shards = 1
        for a in (() if axes is None else (axes,) if isinstance(axes, str) else axes):
            shards *= mesh.size(a)
        if n % shards:
            return False
    return True


def applies(impl: str, causal: bool, q_shape: tuple[int, ...], kv_heads: int, mesh: MeshRules | None) -> bool:
    """Whether a window's attention (q_shape [B, W, H, hd], `kv_heads` K) runs through splash attention: its mask is
    causal in columns, the window is a prefill's (at least MIN_QUERIES wide), `impl` (ModelConfig.attention_impl)
    is "splash", or "auto" on a TPU with heads of a whole number of the kernel's 128 lanes (Clover's 256; a small
    model's narrower heads stay with XLA unless "splash" is asked for), and on a mesh its rows and heads split
    evenly (shard_map takes no uneven shards: the server's one-row admissions on a mesh with a data axis stay with
    XLA). Rules that put query and KV heads on different mesh axes: "auto" stays with XLA, "splash" is a
    ShardingError."""
    b, queries, h, hd = q_shape
    if not causal or queries < MIN_QUERIES:
        return False
    if not (impl == "splash" or (impl == "auto" and platform(mesh) == "tpu" and hd % 128 == 0)):
        return False
    if mesh is None:
        return True
    q_spec, kv_spec, _ = _specs(mesh)
    if (apart := _heads_apart(q_spec, kv_spec)) is not None:
        if impl == "splash":
            raise apart
        return False
    return _divides(mesh, q_spec, (b, queries, h, hd)) and _divides(mesh, kv_spec, (b, queries, kv_heads, hd))


def _block(n: int) -> int:
    """The kernel block for a length of n columns: MAX_BLOCK, or n rounded up to 128 when shorter."""
    return min(MAX_BLOCK, -(-n // 128) * 128)


def _pad(x: Array, n: int, axis: int, value: int = 0) -> Array:
    width = [(0, 0)] * x.ndim
    width[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, width, constant_values=value) if n > x.shape[axis] else x


def _local(q: Array, k: Array, v: Array, q_valid: Array, k_cache: Array | None, v_cache: Array | None,
           cache_valid: Array | None, offset: Array, interpret: bool) -> Array:
    """`causal_attention` on one device's rows and heads."""
    b, t, h, hd = q.shape
    kvh = k.shape[2]
    g = h // kvh
    blk = _block(t)
    tp = -(-t // blk) * blk
    sizes = kernel.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
                              block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
    # [b, kvh, g, tp, hd]: the g query heads of a KV head are the kernel's heads; scaled here, in q's dtype (the
    # kernel does not scale; exact for a head_dim that is a power of 4, such as Clover's 256).
    qs = (q * jnp.asarray(hd**-0.5, q.dtype)).reshape(b, t, kvh, g, hd).transpose(0, 2, 3, 1, 4)
    qs = _pad(qs, tp, 3)
    heads = lambda x: _pad(x.transpose(0, 2, 1, 3), tp, 2)  # [b, T, K, hd] -> [b, K, tp, hd]
    seg = _pad(q_valid.astype(jnp.int32), tp, 1, -1)  # padding 0, columns past the window -1
    with_lse = k_cache is not None

    def run(mask: kmask.Mask, q: Array, k: Array, v: Array, q_seg: Array, k_seg: Array, blocks: kernel.BlockSizes
            ) -> tuple[Array, Array | None]:
        call = kernel.make_splash_mqa_single_device(kmask.MultiHeadMask([mask] * g), block_sizes=blocks,
                                                    save_residuals=with_lse, interpret=interpret)
        one = lambda q, k, v, qs_, ks_: call(q, k, v, kernel.SegmentIds(qs_, ks_))
        per_head = jax.vmap(one, in_axes=(0, 0, 0, None, None))  # KV heads
        # Mosaic multiplies 16-bit operands at their own precision only (a process-wide "highest", as tests set for
        # float32 parity on the CPU, would fail its compile); float32 ones keep the process's setting.
        with contextlib.nullcontext() if q.dtype == jnp.float32 else jax.default_matmul_precision("default"):
            res = jax.vmap(per_head, in_axes=(0, 0, 0, 0, 0))(q, k, v, q_seg, k_seg)  # rows
        return (res[0], res[1][0]) if with_lse else (res, None)

    own, own_lse = run(kmask.CausalMask((tp, tp)), qs, heads(k), heads(v), seg, seg, sizes)
    if with_lse:
        # The cache before the window, CACHE_SEGMENT columns at a time, only as many segments as cover `offset`
        # (a loop of traced length; for a cache longer than a segment, a prefill's windows read about half the keys
        # a full read would). Each segment is cut from the cache as it is and only the cut is laid out head-major;
        # the last one is shifted back to end at the cache's end, its columns an earlier segment read not counted.
        s = k_cache.shape[1]
        if s < CACHE_SEGMENT:  # a short cache: one segment, padded to whole kernel blocks
            seg_cols = -(-s // 128) * 128
            k_cache, v_cache = _pad(k_cache, seg_cols, 1), _pad(v_cache, seg_cols, 1)
            cache_valid = _pad(cache_valid, seg_cols, 1)
        else:
            seg_cols = CACHE_SEGMENT
        sb = 128 * math.gcd(seg_cols // 128, MAX_BLOCK // 128)  # the largest kernel block that divides a segment
        col = jnp.arange(k_cache.shape[1])[None]
        before = cache_valid & (col < offset)
        q_seg = jnp.ones((b, tp), jnp.int32)
        csizes = kernel.BlockSizes(block_q=blk, block_kv=sb, block_kv_compute=sb)

        def segment(i: Array, acc: tuple[Array, Array]) -> tuple[Array, Array]:
            start = jnp.minimum(i * seg_cols, k_cache.shape[1] - seg_cols)
            cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, seg_cols, axis=1)
            ids = (cut(before) & (cut(col) >= i * seg_cols)).astype(jnp.int32)
            part = run(kmask.FullMask((tp, seg_cols)), qs, cut(k_cache).transpose(0, 2, 1, 3),
                       cut(v_cache).transpose(0, 2, 1, 3), q_seg, ids, csizes)
            return layers.merge_lse([acc, (part[0].astype(jnp.float32), part[1])])

        n = (jnp.asarray(offset, jnp.int32) + seg_cols - 1) // seg_cols
        own, _ = jax.lax.fori_loop(0, n, segment, (own.astype(jnp.float32), own_lse))
        own = own.astype(q.dtype)
    return own[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, h, hd)


def causal_attention(q: Array, k: Array, v: Array, q_valid: Array, cache: tuple[Array, Array, Array, Array] | None,
                     mesh: MeshRules | None = None) -> Array:
    """Causal grouped-query attention of a window through splash attention: q [B, W, H, hd]; k / v [B, W, K, hd] the
    window's own keys; q_valid [B, W] its real columns; cache: None (the window is the whole sequence) or
    (k_cache, v_cache [B, S, K, hd], cache_valid [B, S], offset []) when the window is columns
    [offset, offset + W) of a cache whose columns before `offset` it also reads. Returns [B, W, H, hd]: what
    `layers.attend` gives under the mask "valid keys at columns <= the query's" (a padding query's row is
    unspecified, finite). Interpret mode where the program does not run on a TPU."""
    interpret = platform(mesh) != "tpu"
    args: tuple = (q, k, v, q_valid, *(cache if cache is not None else ()))

    def fn(q: Array, k: Array, v: Array, qv: Array, *rest: Array) -> Array:
        kc, vc, cv, off = rest if rest else (None, None, None, jnp.int32(0))
        return _local(q, k, v, qv, kc, vc, cv, off, interpret)

    if mesh is None:
        return fn(*args)
    q_spec, kv_spec, row = _specs(mesh)
    if (apart := _heads_apart(q_spec, kv_spec)) is not None:
        raise apart
    specs = (q_spec, kv_spec, kv_spec, row, *((kv_spec, kv_spec, row, PartitionSpec()) if cache is not None else ()))
    return jax.shard_map(fn, mesh=mesh.mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)
