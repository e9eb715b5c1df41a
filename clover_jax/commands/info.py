"""`clover info`: a config's shape and parameter counts, from the abstract weights (nothing allocated)."""

from __future__ import annotations

import argparse

from clover_jax.config import load_config, preset_names
from clover_jax.model.params import count_params


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `info` subcommand (--config, --list) to `sub`; it dispatches to `run`."""
    p = sub.add_parser("info", help="print a config and its total / active parameter counts")
    p.add_argument("--config", default="clover-35b-a3b", help="preset name or path to config.json")
    p.add_argument("--list", action="store_true", help="list the presets")
    p.set_defaults(func=run)


def _human(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def run(args: argparse.Namespace) -> int:
    """Print the config's shape and its total / active parameter counts (or the preset names)."""
    if args.list:
        print("\n".join(preset_names()))
        return 0
    cfg = load_config(args.config)
    c = count_params(cfg)
    print(f"config            {cfg.name} ({cfg.family})")
    print(f"layers            {cfg.n_layers} ({cfg.n_dense_layers} dense, {cfg.n_moe_layers} MoE)")
    if cfg.is_hybrid:
        group = " + ".join(f"{cfg.layer_group.count(k)} {label}" for k, label in
                           (("linear_attention", "Gated DeltaNet"), ("full_attention", "full attention")))
        print(f"mixers            {cfg.n_linear_layers} Gated DeltaNet ({cfg.linear_num_key_heads} key / "
              f"{cfg.linear_num_value_heads} value heads of {cfg.linear_key_head_dim} / {cfg.linear_value_head_dim}), "
              f"{cfg.n_attention_layers} full attention; {cfg.n_layers // len(cfg.layer_group)} groups of {group}")
        if cfg.has_bd_weights:
            print(f"block diffusion   bd_gdn {cfg.bd_gdn} (Clover's four tensors per Gated DeltaNet layer; right conv "
                  f"of {cfg.bd_conv_right_kernel})")
    print(f"d_model / vocab   {cfg.d_model} / {cfg.vocab_size}")
    print(f"attention         {cfg.n_heads} q heads, {cfg.n_kv_heads} kv heads, head_dim {cfg.head_dim}, "
          f"{cfg.attention}" + (f" (blocks of {cfg.block_size})" if cfg.is_block_causal else ""))
    print(f"experts           {cfg.n_experts} routed (top-{cfg.n_experts_per_tok}, width {cfg.expert_mlp_dim}), "
          f"{cfg.n_shared_experts} shared, {cfg.router} router")
    print(f"total params      {_human(c.total)} ({c.total:,})")
    print(f"active params     {_human(c.active)} ({c.active:,}) per token")
    print(f"  of which embed  {_human(c.embedding)}; routed experts {_human(c.routed_experts)} in all")
    return 0
