"""The native checkpoint format: a directory holding

    config.json        ModelConfig.to_dict()
    tokenizer files    whichever of tokenizer.TOKENIZER_FILES the source had
    weights/           an Orbax checkpoint of a flat {dotted weight name: array} dict
    weights/clover_manifest.json   every file under weights/ with its size, checked by `verify` before
                       any load (checkpoints from before it load without one)

Weights stored in an earlier layout (`legacy_leaves`: the Gated DeltaNet conv channels before they were grouped
by key head) are turned into the current one as they load (`load_model`, and `read_migrated` for
`streaming.WeightReader`), so checkpoints written before still load, convert and export unchanged in value.

Weight names are `params.named_leaves` paths (e.g. `moe_layers.mlp.gate`), so the on-disk tree does
not depend on how the dataclasses nest and a mismatch can name the weight. Restore goes straight into
the caller's target shardings: every device reads only its own shard. Saves are atomic (`atomic`).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from clover_jax.checkpoint.atomic import atomic_directory, is_primary, sync_processes
from clover_jax.checkpoint.verify import CONFIG_FILE, WEIGHTS_DIR, orbax_errors, verify, write_manifest
from clover_jax.config import ModelConfig
from clover_jax.errors import CheckpointError, ConfigError
from clover_jax.model import params
from clover_jax.tokenizer import TOKENIZER_FILES


def copy_tokenizer_files(src_dir: str | None, dst_dir: str) -> list[str]:
    """Copy whichever tokenizer files exist in `src_dir`; returns their names."""
    copied = []
    if src_dir:
        for name in TOKENIZER_FILES:
            src = os.path.join(src_dir, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(dst_dir, name))
                copied.append(name)
    return copied


# ---- flat weight dicts -----------------------------------------------------------------------------


def expected_leaves(cfg: ModelConfig) -> dict[str, params.ParamSpec]:
    """Every weight the config implies, by dotted name (None leaves, e.g. a tied lm_head, absent)."""
    return dict(params.named_leaves(params.abstract(cfg)))


def flatten_weights(weights: params.Weights) -> dict[str, Any]:
    """A weight tree as a flat {dotted name: array} dict (`params.named_leaves`; None leaves absent)."""
    return dict(params.named_leaves(weights))


def unflatten_weights(cfg: ModelConfig, flat: Mapping[str, Any]) -> params.Weights:
    """The inverse of `flatten_weights`: the `Weights` tree of `cfg` from {dotted name: array};
    names the config does not imply are ignored, a missing one raises KeyError."""
    specs = params.abstract(cfg)
    names = [n for n, _ in params.named_leaves(specs)]
    treedef = jax.tree.structure(specs, is_leaf=params.is_spec)
    return jax.tree.unflatten(treedef, [flat[n] for n in names])


def summary(items: list[str], n: int = 6) -> str:
    """The first `n` items joined, and how many more."""
    return ", ".join(items[:n]) + (f" ... and {len(items) - n} more" if len(items) > n else "")


def key_problems(want: Mapping[str, Any], found: Mapping[str, Any], what: str, n: int = 6) -> list[str]:
    """'missing WHAT: ...' / 'unexpected WHAT: ...' lines for two key sets (empty when they agree)."""
    missing, extra = sorted(set(want) - set(found)), sorted(set(found) - set(want))
    return ([f"missing {what}: {summary(missing, n)}"] if missing else []) + \
        ([f"unexpected {what}: {summary(extra, n)}"] if extra else [])


def check_leaves(cfg: ModelConfig, found: Mapping[str, tuple[tuple[int, ...], Any]], where: str) -> None:
    """Compare {name: (shape, dtype)} against the config; raise naming every disagreement found."""
    want = expected_leaves(cfg)
    problems = key_problems(want, found, "weights", n=len(want) + len(found))
    for name in sorted(set(want) & set(found)):
        shape, dtype = found[name]
        spec = want[name]
        if tuple(shape) != tuple(spec.shape):
            problems.append(f"weight {name!r} has shape {tuple(shape)} in {where} but the config "
                            f"{cfg.name!r} needs {tuple(spec.shape)}")
        elif np.dtype(dtype) != np.dtype(spec.dtype):
            problems.append(f"weight {name!r} has dtype {np.dtype(dtype)} in {where} but the config "
                            f"{cfg.name!r} needs {np.dtype(spec.dtype)}")
    if problems:
        raise CheckpointError(f"{where} does not match its config: " + "; ".join(problems))


# ---- layouts of earlier versions -------------------------------------------------------------------

# The Gated DeltaNet conv-channel weights, whose C channels were [q | k | v] until they were grouped by key head
# (`params.GatedDeltaNetWeights`, so that they shard by heads); a quantized qkv's qvalue and scale likewise.
GDN_CHANNEL_LEAVES = ("linear_layers.attn.qkv", "linear_layers.attn.conv", "linear_layers.attn.conv_right")
# The conv's shape tells the layouts apart: [..., C] then, [..., Hk, C / Hk] now (qkv is [..., C] in both).
GDN_LAYOUT_WITNESS = "linear_layers.attn.conv"


def _gdn_channels(name: str) -> bool:
    return name in GDN_CHANNEL_LEAVES or name.rsplit(".", 1)[0] in GDN_CHANNEL_LEAVES


def _fused_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A GDN channel leaf's shape in the earlier layout: qkv's is unchanged, the convs' [..., Hk, C / Hk] was
    [..., C]."""
    return tuple(shape) if name.startswith("linear_layers.attn.qkv") else (*shape[:-2], shape[-2] * shape[-1])


def legacy_leaves(cfg: ModelConfig, stored: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict[str, tuple[int, ...]]:
    """{name: its stored shape} of the weights that `stored` ({name: (shape, dtype)}, e.g. `stored_leaves`) holds
    in an earlier layout which `migrate_leaf` turns into the current one, bit for bit: the Gated DeltaNet
    conv-channel weights (GDN_CHANNEL_LEAVES) of a checkpoint whose conv is stored [..., C], C in [q | k | v]
    order. Empty for a checkpoint in the current layout. Anything else that disagrees with the config is left
    to `check_leaves`."""
    specs = expected_leaves(cfg) if cfg.is_hybrid else {}
    witness = specs.get(GDN_LAYOUT_WITNESS)
    if witness is None or tuple(stored.get(GDN_LAYOUT_WITNESS, ((),))[0]) != _fused_shape(GDN_LAYOUT_WITNESS,
                                                                                          witness.shape):
        return {}
    out: dict[str, tuple[int, ...]] = {}
    for name, spec in specs.items():
        if _gdn_channels(name) and name in stored and tuple(stored[name][0]) == _fused_shape(name, spec.shape):
            out[name] = _fused_shape(name, spec.shape)
    return out


def current_leaves(cfg: ModelConfig, stored: Mapping[str, tuple[tuple[int, ...], Any]],
                   ) -> dict[str, tuple[tuple[int, ...], Any]]:
    """`stored` ({name: (shape, dtype)}) as the weights will be after `migrate_leaf`: the legacy ones
    (`legacy_leaves`) with their current shape, for `check_leaves`."""
    legacy = legacy_leaves(cfg, stored)
    specs = expected_leaves(cfg) if legacy else {}
    return {n: ((tuple(specs[n].shape), d) if n in legacy else (s, d)) for n, (s, d) in stored.items()}


def migrate_leaf(cfg: ModelConfig, name: str, x: Any) -> Any:
    """Weight `name`, which `legacy_leaves` names, from its stored layout ([..., C] in [q | k | v] order) to the
    current one (grouped by key head, `params.group_channels`: [..., Hk, C / Hk] for the convs, flattened
    back to [..., C] for qkv): a permutation, numpy or jax."""
    g = params.group_channels(x, cfg)
    return g.reshape(x.shape) if name.startswith("linear_layers.attn.qkv") else g


def read_migrated(cfg: ModelConfig, name: str, read: Callable[[Any], np.ndarray], index: Any = None) -> np.ndarray:
    """`current[index]` of legacy weight `name` (`legacy_leaves`) from `read(i)`, which reads its stored array at
    `i` along the leading axis (an int, a slice): `index` is None, an int or a tuple of ints and slices whose
    first entry applies to that leading axis (layers, for a stacked weight) and the rest after `migrate_leaf`."""
    idx = () if index is None else index if isinstance(index, tuple) else (index,)
    first, rest = (idx[0], idx[1:]) if idx else (slice(None), ())
    a = migrate_leaf(cfg, name, np.asarray(read(first)))
    return a[rest] if isinstance(first, (int, np.integer)) else a[(slice(None), *rest)]


# ---- save / load -----------------------------------------------------------------------------------


def write_metadata_files(tmp: str, cfg: ModelConfig, tokenizer_dir: str | None,
                         extra_files: Mapping[str, str] | None) -> None:
    """config.json, the tokenizer files of `tokenizer_dir` and `extra_files` (name -> text) into `tmp`."""
    with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
        f.write(cfg.to_json() + "\n")
    copy_tokenizer_files(tokenizer_dir, tmp)
    for name, text in (extra_files or {}).items():
        if os.path.basename(name) != name or name in (CONFIG_FILE, WEIGHTS_DIR):
            raise CheckpointError(f"extra file name {name!r} must be a plain file name other than "
                                  f"{CONFIG_FILE} / {WEIGHTS_DIR}")
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)


def save_model(path: str, cfg: ModelConfig, weights: params.Weights, tokenizer_dir: str | None = None,
               extra_files: Mapping[str, str] | None = None, force: bool = False) -> str:
    """Write a native checkpoint directory atomically; returns its absolute path.

    `extra_files` maps plain file names to text contents written next to config.json.
    Weights may be sharded over any mesh: each process writes its own shards.
    """
    flat = flatten_weights(weights)
    check_leaves(cfg, {n: (a.shape, a.dtype) for n, a in flat.items()}, "the weights being saved")
    with atomic_directory(path, force) as tmp:
        if is_primary():
            write_metadata_files(tmp, cfg, tokenizer_dir, extra_files)
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(os.path.join(tmp, WEIGHTS_DIR), flat, save_args={n: _save_args(n, a) for n, a in flat.items()})
        ckptr.wait_until_finished()
        ckptr.close()
        sync_processes("clover-weights-written")  # every process's shards are in place before the manifest lists them
        if is_primary():
            write_manifest(os.path.join(tmp, WEIGHTS_DIR))
    return os.path.abspath(path)


CHUNK_BYTES = 64 * 1024**2


def _save_args(name: str, a: Any) -> Any:
    """Storage chunks that slice reads can use: at most one layer of a stacked weight, and about
    CHUNK_BYTES blocks of large unstacked ones (rows of embed, columns of lm_head). Without this a
    single-device save is one chunk per weight, and reading one layer would decode all of them."""
    itemsize = np.dtype(a.dtype).itemsize
    if "layers." in name and a.ndim > 1:
        return ocp.SaveArgs(chunk_byte_size=max(int(np.prod(a.shape[1:])) * itemsize, CHUNK_BYTES),
                            shard_axes=(0,))
    if a.ndim > 1 and a.size * itemsize > CHUNK_BYTES:
        return ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES)
    return ocp.SaveArgs()


def _check_dir(path: str) -> str:
    """`verify.verify`: the absolute weights directory of a whole native checkpoint, else CheckpointError."""
    return verify(path)


def _read_config(path: str) -> ModelConfig:
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            d = json.load(f)
        return ModelConfig.from_dict(d)
    except (json.JSONDecodeError, ConfigError, TypeError) as e:
        raise CheckpointError(f"{os.path.join(path, CONFIG_FILE)} is not a valid config: {e}") from e


def _read_leaves(path: str, wdir: str) -> dict[str, tuple[tuple[int, ...], Any]]:
    with orbax_errors(path, "the weights metadata"), ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(wdir)
        tree = meta.item_metadata.tree
    return {name: (tuple(m.shape), np.dtype(m.dtype)) for name, m in tree.items()}


def load_checkpoint_config(path: str) -> ModelConfig:
    """The ModelConfig of the native checkpoint at `path`; CheckpointError if `path` is not one, is
    damaged (`verify.verify`) or its config.json is not a valid config."""
    _check_dir(path)
    return _read_config(path)


def stored_leaves(path: str) -> dict[str, tuple[tuple[int, ...], Any]]:
    """{name: (shape, dtype)} of the arrays in a native checkpoint, from metadata only (after `verify`)."""
    return _read_leaves(path, _check_dir(path))


def load_model(path: str, shardings: Any = None) -> tuple[ModelConfig, params.Weights]:
    """Read a native checkpoint into `shardings` (a tree matching params.abstract(cfg), e.g. from
    sharding.weight_shardings; default: the first device). Each device reads only its own shard, except for
    weights stored in an earlier layout (`legacy_leaves`): those are read whole onto every device of their
    sharding, then turned into the current layout (`migrate_leaf`) in their shardings.
    The directory is checked first (`verify.verify`); any Orbax error becomes a one-line CheckpointError."""
    wdir = _check_dir(path)
    cfg = _read_config(path)
    stored = _read_leaves(path, wdir)
    legacy = legacy_leaves(cfg, stored)
    check_leaves(cfg, current_leaves(cfg, stored), f"checkpoint {path!r}")
    specs = expected_leaves(cfg)
    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shard_by_name = {n: one for n in specs}
    else:
        shard_by_name = dict(params.named_leaves(shardings))
        if set(shard_by_name) != set(specs):
            raise CheckpointError("the shardings tree does not match the checkpoint's weights: "
                                  f"differs in {sorted(set(shard_by_name) ^ set(specs))}")
    target = {n: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shard_by_name[n]) for n, s in specs.items()}
    for n, shape in legacy.items():
        target[n] = jax.ShapeDtypeStruct(shape, specs[n].dtype, sharding=_whole(shard_by_name[n]))
    with orbax_errors(path, "the weights"), ocp.StandardCheckpointer() as ckptr:
        flat = ckptr.restore(wdir, target)
    for n in legacy:
        flat[n] = jax.jit(functools.partial(migrate_leaf, cfg, n), out_shardings=shard_by_name[n])(flat[n])
    return cfg, unflatten_weights(cfg, flat)


def _whole(sharding: Any) -> Any:
    """`sharding` with nothing split: the same devices, each with the whole array."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding
