"""Key maps between HuggingFace tensors and native weights, as small invertible `Group`s.

A Group ties a few HF tensors to a few native weight slices (one layer of a stacked weight, or an
unstacked weight) with a pair of pure numpy functions, one per direction. Conversion in either
direction walks the groups and touches one group's tensors at a time, so memory stays near the
largest group: one layer's experts of one projection.

Layout conventions: HF `nn.Linear` weights are [out, in]; native projections are [in..., out...]
(q [D, H, hd], o [H, hd, D]); native experts are stacked [E, D, F] / [E, F, D].
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from clover_jax.config import ModelConfig
from clover_jax.model import params

Slot = tuple[str, int | None]  # (native weight name, index on its leading `layers` axis or None)


@dataclass(frozen=True)
class Group:
    """HF tensors `hf` (of `hf_shapes`) and native slots `native`, tied by `to_native` / `to_hf`: pure numpy
    functions from the arrays of one side, in that order, to those of the other."""

    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    native: tuple[Slot, ...]
    to_native: Callable[[Sequence[np.ndarray]], list[np.ndarray]]
    to_hf: Callable[[Sequence[np.ndarray]], Iterable[np.ndarray]]  # consumed in order, once
    kind: str = "matmul"  # matmul | float32 (norms, router, bias: stored float32 natively)
    # For routed experts: to_native restricted to experts[sl] (reads only those), so that one layer's
    # experts can be produced in parts.
    part: Callable[[Sequence[np.ndarray], slice], list[np.ndarray]] | None = None


def _prod(shape: Sequence[int]) -> int:
    return int(np.prod(shape))


def linear(hf_key: str, slot: Slot, native_shape: tuple[int, ...], n_in: int, kind: str = "matmul") -> Group:
    """HF [out, in] <-> native [in dims..., out dims...]; `n_in` = number of leading input dims."""
    n_i, n_o = _prod(native_shape[:n_in]), _prod(native_shape[n_in:])
    return Group(
        hf=(hf_key,), hf_shapes=((n_o, n_i),), native=(slot,), kind=kind,
        to_native=lambda a: [np.ascontiguousarray(a[0].T).reshape(native_shape)],
        to_hf=lambda a: [np.ascontiguousarray(a[0].reshape(n_i, n_o).T)],
    )


def copy(hf_key: str, slot: Slot, shape: tuple[int, ...], kind: str = "float32") -> Group:
    """One HF tensor of `shape` stored natively as is (norms, biases, the embedding)."""
    return Group(hf=(hf_key,), hf_shapes=(shape,), native=(slot,), kind=kind,
                 to_native=lambda a: [np.asarray(a[0])], to_hf=lambda a: [np.asarray(a[0])])


def fused_qkv(hf_key: str, slots: tuple[Slot, Slot, Slot], d: int, h: int, kv: int, hd: int) -> Group:
    """LLaDA2 `query_key_value` [(h + 2 kv) * hd, D]: rows are [q heads | k heads | v heads]."""

    def to_native(a: Sequence[np.ndarray]) -> list[np.ndarray]:
        w = a[0].T.reshape(d, h + 2 * kv, hd)
        return [np.ascontiguousarray(w[:, :h]), np.ascontiguousarray(w[:, h:h + kv]),
                np.ascontiguousarray(w[:, h + kv:])]

    def to_hf(a: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [np.ascontiguousarray(np.concatenate(a, axis=1).reshape(d, -1).T)]

    return Group(hf=(hf_key,), hf_shapes=(((h + 2 * kv) * hd, d),), native=slots, to_native=to_native, to_hf=to_hf)


def experts(hf_keys: Sequence[str], slot: Slot, e: int, n_in: int, n_out: int) -> Group:
    """E per-expert HF Linears [out, in] <-> native stacked [E, in, out]. `a` may read lazily: one
    expert in memory besides the output."""

    def part(a: Sequence[np.ndarray], sl: slice) -> list[np.ndarray]:
        out = None
        for j, i in enumerate(range(*sl.indices(e))):
            w = a[i]
            if out is None:
                out = np.empty((len(range(*sl.indices(e))), n_in, n_out), w.dtype)
            out[j] = w.T
        return [out]

    def to_hf(a: Sequence[np.ndarray]) -> Iterator[np.ndarray]:
        return (np.ascontiguousarray(a[0][i].T) for i in range(e))  # one expert at a time

    return Group(hf=tuple(hf_keys), hf_shapes=((n_out, n_in),) * e, native=(slot,),
                 to_native=lambda a: part(a, slice(0, e)), to_hf=to_hf, part=part)


def fused_experts_gate_up(hf_key: str, slots: tuple[Slot, Slot], e: int, d: int, f: int) -> Group:
    """transformers 5 in-memory Qwen-MoE arrangement: gate_up_proj [E, 2F, D] (gate rows first)."""

    def part(a: Sequence[np.ndarray], sl: slice) -> list[np.ndarray]:
        w = _rows(a, 0, sl, e)
        return [np.ascontiguousarray(w[:, :f].transpose(0, 2, 1)), np.ascontiguousarray(w[:, f:].transpose(0, 2, 1))]

    def to_hf(a: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [np.ascontiguousarray(np.concatenate([a[0], a[1]], axis=2).transpose(0, 2, 1))]

    return Group(hf=(hf_key,), hf_shapes=((e, 2 * f, d),), native=slots, to_native=lambda a: part(a, slice(0, e)),
                 to_hf=to_hf, part=part)


def fused_experts_down(hf_key: str, slot: Slot, e: int, d: int, f: int) -> Group:
    """transformers 5 in-memory arrangement: down_proj [E, D, F] <-> native [E, F, D]."""
    def part(a: Sequence[np.ndarray], sl: slice) -> list[np.ndarray]:
        return [np.ascontiguousarray(_rows(a, 0, sl, e).transpose(0, 2, 1))]

    return Group(hf=(hf_key,), hf_shapes=((e, d, f),), native=(slot,), to_native=lambda a: part(a, slice(0, e)),
                 to_hf=lambda a: [np.ascontiguousarray(a[0].transpose(0, 2, 1))], part=part)


def gdn_qkv(hf_key: str, slot: Slot, cfg: ModelConfig) -> Group:
    """A Gated DeltaNet's `in_proj_qkv` [C, D], rows [q (Hk dk) | k (Hk dk) | v (Hv dv)] <-> native qkv [D, C]
    with its channels grouped by key head, heads major (`params.group_channels` flattened), a permutation."""
    d, c, hk = cfg.d_model, cfg.linear_conv_dim, cfg.linear_num_key_heads

    def to_native(a: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [np.ascontiguousarray(params.group_channels(np.asarray(a[0]).T, cfg).reshape(d, c))]

    def to_hf(a: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [np.ascontiguousarray(params.ungroup_channels(np.asarray(a[0]).reshape(d, hk, -1), cfg).T)]

    return Group(hf=(hf_key,), hf_shapes=((c, d),), native=(slot,), to_native=to_native, to_hf=to_hf)


def gdn_conv(hf_key: str, slot: Slot, kernel: int, cfg: ModelConfig, squeezed: bool = False) -> Group:
    """A Gated DeltaNet depthwise conv: an `nn.Conv1d` weight [C, 1, K] (or [C, K] with `squeezed`), channels
    [q | k | v] as `gdn_qkv`'s rows <-> native [K, Hk, group] (`params.group_channels`)."""
    c = cfg.linear_conv_dim
    shape = (c, kernel) if squeezed else (c, 1, kernel)

    def to_native(a: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [np.ascontiguousarray(params.group_channels(np.asarray(a[0]).reshape(c, kernel).T, cfg))]

    def to_hf(a: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [np.ascontiguousarray(params.ungroup_channels(np.asarray(a[0]), cfg).T).reshape(shape)]

    return Group(hf=(hf_key,), hf_shapes=(shape,), native=(slot,), to_native=to_native, to_hf=to_hf)


def per_head(hf_key: str, slot: Slot, shape: tuple[int, ...], heads: int) -> Group:
    """A per-head float32 vector stored in the source as `shape` (one value, or one per group of heads) <->
    native [heads]: each value repeated over its group of consecutive heads on import, every group's first
    taken on export, so a round trip is exact."""
    n = _prod(shape)
    rep = heads // n
    return Group(hf=(hf_key,), hf_shapes=(shape,), native=(slot,), kind="float32",
                 to_native=lambda a: [np.repeat(np.asarray(a[0]).reshape(n), rep)],
                 to_hf=lambda a: [np.ascontiguousarray(np.asarray(a[0])[::rep]).reshape(shape)])


def gated_query(hf_key: str, slots: tuple[Slot, Slot], d: int, h: int, hd: int) -> Group:
    """Qwen3.5's `q_proj` [H * 2 * hd, D]: each head's rows are its query, then its output gate
    <-> native q and gate, each [D, H, hd]."""

    def to_native(a: Sequence[np.ndarray]) -> list[np.ndarray]:
        w = a[0].reshape(h, 2, hd, d)
        return [np.ascontiguousarray(w[:, 0].transpose(2, 0, 1)), np.ascontiguousarray(w[:, 1].transpose(2, 0, 1))]

    def to_hf(a: Sequence[np.ndarray]) -> list[np.ndarray]:
        w = np.stack([a[0].transpose(1, 2, 0), a[1].transpose(1, 2, 0)], axis=1)  # [H, 2, hd, D]
        return [np.ascontiguousarray(w.reshape(h * 2 * hd, d))]

    return Group(hf=(hf_key,), hf_shapes=((h * 2 * hd, d),), native=slots, to_native=to_native, to_hf=to_hf)


def fused_qkvz(hf_key: str, slots: tuple[Slot, Slot], d: int, hk: int, dk: int, hv: int, dv: int) -> Group:
    """Qwen3-Next's `in_proj_qkvz` [Hk * (2 dk + 2 r dv), D], r = Hv / Hk: per key head its query, key, its r
    value heads and their r output gates <-> native qkv [D, C], C the key heads' [q | k | v of the head] (the
    native grouping, `params.GatedDeltaNetWeights`) and z [D, Hv, dv]."""
    r = hv // hk
    group = 2 * dk + r * dv
    per_head = group + r * dv

    def to_native(a: Sequence[np.ndarray]) -> list[np.ndarray]:
        w = a[0].reshape(hk, per_head, d)
        z = w[:, group:].reshape(-1, d)
        return [np.ascontiguousarray(w[:, :group].reshape(-1, d).T), np.ascontiguousarray(z.T.reshape(d, hv, dv))]

    def to_hf(a: Sequence[np.ndarray]) -> list[np.ndarray]:
        qkv, z = a[0].T.reshape(hk, group, d), a[1].reshape(d, hv * dv).T.reshape(hk, r * dv, d)
        return [np.ascontiguousarray(np.concatenate([qkv, z], axis=1).reshape(hk * per_head, d))]

    return Group(hf=(hf_key,), hf_shapes=((hk * per_head, d),), native=slots, to_native=to_native, to_hf=to_hf)


def fused_ba(hf_key: str, slots: tuple[Slot, Slot], d: int, hk: int, hv: int) -> Group:
    """Qwen3-Next's `in_proj_ba` [Hk * 2r, D]: per key head its r beta rows, then its r decay rows
    <-> native b and a, each [D, Hv]."""
    r = hv // hk

    def to_native(a: Sequence[np.ndarray]) -> list[np.ndarray]:
        w = a[0].reshape(hk, 2 * r, d)
        return [np.ascontiguousarray(w[:, :r].reshape(hv, d).T), np.ascontiguousarray(w[:, r:].reshape(hv, d).T)]

    def to_hf(a: Sequence[np.ndarray]) -> list[np.ndarray]:
        b, a_ = a[0].T.reshape(hk, r, d), a[1].T.reshape(hk, r, d)
        return [np.ascontiguousarray(np.concatenate([b, a_], axis=1).reshape(hk * 2 * r, d))]

    return Group(hf=(hf_key,), hf_shapes=((hk * 2 * r, d),), native=slots, to_native=to_native, to_hf=to_hf)


def _rows(a: Sequence[np.ndarray], i: int, sl: slice, n: int) -> np.ndarray:
    """Rows `sl` of tensor i: read alone when `a` can (the converter's lazy reader), else sliced."""
    start, stop, _ = sl.indices(n)
    rows = getattr(a, "rows", None)
    return rows(i, start, stop) if rows else a[i][start:stop]


# ---- per-layer building blocks shared by the families -----------------------------------------------------


def mlp_groups(prefix: str, stack: str, i: int, sub: str, d: int, f: int) -> list[Group]:
    """A SwiGLU MLP `{prefix}.{gate,up,down}_proj.weight` <-> native `{stack}.{sub}.{gate,up,down}`."""
    return [
        linear(f"{prefix}.gate_proj.weight", (f"{stack}.{sub}.gate", i), (d, f), 1),
        linear(f"{prefix}.up_proj.weight", (f"{stack}.{sub}.up", i), (d, f), 1),
        linear(f"{prefix}.down_proj.weight", (f"{stack}.{sub}.down", i), (f, d), 1),
    ]


def expert_groups(prefix: str, i: int, cfg: ModelConfig, fused: bool, stack: str = "moe_layers") -> list[Group]:
    """Routed experts under `{prefix}` (e.g. `model.layers.3.mlp.experts`), per-expert or fused, into layer
    `i` of `stack`."""
    e, d, f = cfg.n_experts, cfg.d_model, cfg.expert_mlp_dim
    s = f"{stack}.mlp"
    if fused:
        return [fused_experts_gate_up(f"{prefix}.gate_up_proj", ((f"{s}.gate", i), (f"{s}.up", i)), e, d, f),
                fused_experts_down(f"{prefix}.down_proj", (f"{s}.down", i), e, d, f)]
    keys = lambda p: [f"{prefix}.{j}.{p}.weight" for j in range(e)]
    return [experts(keys("gate_proj"), (f"{s}.gate", i), e, d, f),
            experts(keys("up_proj"), (f"{s}.up", i), e, d, f),
            experts(keys("down_proj"), (f"{s}.down", i), e, f, d)]


def attention_groups(prefix: str, stack: str, i: int, cfg: ModelConfig, names: dict[str, str]) -> list[Group]:
    """Separate q/k/v/o projections (+ optional output gate, QK-norm) under `{prefix}`; `names` maps
    q, k, v, o, gate, q_norm, k_norm to HF module names."""
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    a = f"{stack}.attn"
    g = [
        linear(f"{prefix}.{names['q']}.weight", (f"{a}.q", i), (d, h, hd), 1),
        linear(f"{prefix}.{names['k']}.weight", (f"{a}.k", i), (d, kv, hd), 1),
        linear(f"{prefix}.{names['v']}.weight", (f"{a}.v", i), (d, kv, hd), 1),
        linear(f"{prefix}.{names['o']}.weight", (f"{a}.o", i), (h, hd, d), 2),
    ]
    if cfg.attn_output_gate:
        g.append(linear(f"{prefix}.{names['gate']}.weight", (f"{a}.gate", i), (d, h, hd), 1))
    if cfg.qk_norm:
        g += [copy(f"{prefix}.{names['q_norm']}.weight", (f"{a}.q_norm", i), (hd,)),
              copy(f"{prefix}.{names['k_norm']}.weight", (f"{a}.k_norm", i), (hd,))]
    return g


def layer_stack(cfg: ModelConfig, layer: int) -> tuple[str, int, bool]:
    """(native stack name, index in the stack, is MoE) of HF layer `layer`."""
    if layer < cfg.n_dense_layers:
        return "dense_layers", layer, False
    return "moe_layers", layer - cfg.n_dense_layers, True


def has_fused_experts(keys: Iterable[str]) -> bool:
    """Whether HF keys hold routed experts in transformers 5's fused form (`mlp.experts.gate_up_proj`)."""
    return any(k.endswith(".mlp.experts.gate_up_proj") for k in keys)


def expert_variants(keys: Iterable[str]) -> dict[str, bool]:
    """`source_variants` of a family whose only variant is the experts' form: the `groups` keywords
    that describe a source checkpoint with these HF keys."""
    return {"fused_experts": has_fused_experts(keys)}


def ends(cfg: ModelConfig, embed_key: str, norm_key: str = "model.norm.weight",
         head_key: str = "lm_head.weight") -> list[Group]:
    """The embedding, the final norm and (unless tied) the lm_head, under the given HF keys."""
    v, d = cfg.vocab_size, cfg.d_model
    g = [copy(embed_key, ("embed", None), (v, d), kind="matmul"), copy(norm_key, ("final_norm", None), (d,))]
    if not cfg.tie_embeddings:
        g.append(linear(head_key, ("lm_head", None), (d, v), 1))
    return g


def qwen_style_groups(cfg: ModelConfig, fused_experts: bool, attn: dict[str, str],
                      shared_key: str | None) -> list[Group]:
    """Every tensor of a model keyed in the Qwen3-MoE style (qwen3_moe, llada_moe and clover):
    `model.layers.{i}.{input,post_attention}_layernorm`, `.self_attn.*`, `.mlp.gate` (+ `.expert_bias`),
    `.mlp.experts.*`, the shared expert under `.{shared_key}`, and dense first layers as `.mlp.*`."""
    g = ends(cfg, "model.embed_tokens.weight")
    for layer in range(cfg.n_layers):
        stack, i, moe = layer_stack(cfg, layer)
        p = f"model.layers.{layer}"
        g += [copy(f"{p}.input_layernorm.weight", (f"{stack}.attn_norm", i), (cfg.d_model,)),
              copy(f"{p}.post_attention_layernorm.weight", (f"{stack}.mlp_norm", i), (cfg.d_model,))]
        g += attention_groups(f"{p}.self_attn", stack, i, cfg, attn)
        if moe:
            g.append(linear(f"{p}.mlp.gate.weight", ("moe_layers.mlp.router", i), (cfg.d_model, cfg.n_experts), 1,
                            kind="float32"))
            if cfg.use_expert_bias:
                g.append(copy(f"{p}.mlp.gate.expert_bias", ("moe_layers.mlp.expert_bias", i), (cfg.n_experts,)))
            g += expert_groups(f"{p}.mlp.experts", i, cfg, fused_experts)
            if cfg.n_shared_experts and shared_key:
                g += mlp_groups(f"{p}.{shared_key}", stack, i, "mlp.shared", cfg.d_model, cfg.shared_mlp_dim)
        else:
            g += mlp_groups(f"{p}.mlp", stack, i, "mlp", cfg.d_model, cfg.dense_mlp_dim)
    return g
