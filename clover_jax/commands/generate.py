"""`clover generate`: fill in text after a prompt with the masked-diffusion sampler.

    clover generate "Once upon a time" --gen-length 64 --show
    clover generate --input prompts.jsonl --output out.jsonl --batch-size 8

Batch jobs read one JSON object per line ({"prompt": "...", "id": optional}) and append one line per
prompt to the output, flushed and fsynced after every batch. Run the same command again after a
crash and it skips the ids already written (a torn last line is dropped first), so no row is lost
and none is written twice.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

PLACEHOLDER = "░"
_RANDOM_WEIGHTS: dict[tuple, Any] = {}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with the masked-diffusion sampler",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="the prompt (or use --input for a batch job)")
    p.add_argument("--input", help="prompts.jsonl: one {\"prompt\": ..., \"id\": ...} object per line")
    p.add_argument("--output", help="out.jsonl for --input jobs (appended to; finished ids are skipped)")
    p.add_argument("--model", default=None,
                   help="checkpoint directory (with config.json) or preset name (random weights); "
                        "default: checkpoints/clover-tiny if present, else the clover-tiny preset")
    p.add_argument("--gen-length", type=int, default=None,
                   help="tokens to generate (a multiple of --block-length; default 128)")
    p.add_argument("--block-length", type=int, default=None, help="semi-autoregressive block size (default 32)")
    p.add_argument("--steps", type=int, default=None, help="refinement steps in all (default: gen-length)")
    p.add_argument("--remasking", default=None,
                   help="low_confidence (default) | random | margin | entropy")
    p.add_argument("--threshold", type=float, default=None,
                   help="also commit every masked token whose confidence exceeds this (0 = off)")
    p.add_argument("--entropy-bound", type=float, default=None,
                   help="also commit lowest-entropy tokens while their entropy sum stays within it (0 = off)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus filter (default 1 = off)")
    p.add_argument("--top-k", type=int, default=None, help="0 = off (default)")
    p.add_argument("--cfg-scale", type=float, default=None, help="classifier-free guidance scale (0 = off)")
    p.add_argument("--cache", default=None,
                   help="auto (default) | none | prefix | dual. auto: prefix for block-causal models (exact), none "
                        "otherwise; prefix/dual are approximations for bidirectional models")
    p.add_argument("--seed", type=int, default=None, help="random seed (default 0)")
    p.add_argument("--no-eos-stop", action="store_true", help="keep generating after EOS")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per compiled batch in --input jobs")
    p.add_argument("--show", action="store_true", help="redraw the canvas on stderr as it fills in")
    p.add_argument("--no-chat-template", action="store_true", help="use the prompt as is")
    from clover_jax.layouts import add_mesh_argument

    add_mesh_argument(p)
    p.set_defaults(func=run)


def default_model() -> str:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for base in (os.getcwd(), repo):
        path = os.path.join(base, "checkpoints", "clover-tiny")
        if os.path.exists(os.path.join(path, "config.json")):
            return path
    return "clover-tiny"


def load(model: str, mesh_name: str | None) -> tuple[Any, Any, Any, Any]:
    """(cfg, weights, tokenizer, (mesh, rules) or None) for a checkpoint dir or a preset name."""
    import jax

    from clover_jax import params
    from clover_jax.cli import UserError
    from clover_jax.config import ConfigError, get_config, preset_names
    from clover_jax.sharding import ShardingError
    from clover_jax.tokenizer import ByteTokenizer, load_tokenizer

    is_dir = os.path.isdir(model)
    try:
        if is_dir:
            from clover_jax.checkpoint import load_checkpoint_config

            cfg = load_checkpoint_config(model)
        else:
            if model not in preset_names():
                raise UserError(f"--model {model!r} is neither a checkpoint directory nor a preset "
                                f"({', '.join(preset_names())})")
            cfg = get_config(model)
        mesh_ctx, shardings = None, None
        if mesh_name:
            from clover_jax.layouts import mesh_from_arg
            from clover_jax.sharding import weight_shardings

            layout, mesh = mesh_from_arg(mesh_name)
            shardings = weight_shardings(cfg, mesh, layout.rules)
            mesh_ctx = (mesh, layout.rules)
        if is_dir:
            from clover_jax.checkpoint import load_model

            cfg, weights = load_model(model, shardings)
            tok = load_tokenizer(model)
        else:
            print(f"clover generate: warning: {model!r} is a preset: RANDOM weights and the byte tokenizer "
                  "(pass --model <checkpoint dir> for a trained model)", file=sys.stderr)
            key = (model, mesh_name)  # repeated runs in one process (notebooks, tests) reuse the init
            if key not in _RANDOM_WEIGHTS:
                _RANDOM_WEIGHTS.clear()
                _RANDOM_WEIGHTS[key] = params.init(cfg, jax.random.key(0), shardings)
            weights = _RANDOM_WEIGHTS[key]
            tok = ByteTokenizer()
    except (ConfigError, ShardingError, ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from e
    return cfg, weights, tok, mesh_ctx


def encode(tok: Any, text: str, chat: bool) -> list[int]:
    if chat:
        templated = tok.apply_chat_template(text)
        if templated is not None:
            text = templated
    return tok.encode(text)


def render(tok: Any, ids: Any, mask_id: int) -> str:
    """Decoded text with each still-masked position shown as a placeholder."""
    out, run = [], []
    for t in ids:
        t = int(t)
        if t == mask_id:
            if run:
                out.append(tok.decode(run))
                run = []
            out.append(PLACEHOLDER)
        else:
            run.append(t)
    if run:
        out.append(tok.decode(run))
    return "".join(out)


def make_show(tok: Any, cfg: Any, prefix: str) -> Any:
    tty = sys.stderr.isatty()

    def show(tokens: Any, block: int, nfe: int) -> None:
        text = render(tok, tokens[0], cfg.mask_token_id)
        if tty:
            sys.stderr.write(f"\x1b[2J\x1b[H[block {block}, pass {nfe}]\n{prefix}{text}\n")
        else:
            sys.stderr.write(f"[block {block}, pass {nfe}] {text!r}\n")
        sys.stderr.flush()

    return show


# Sampler settings a flag can set; a checkpoint's generation_config.json may change the defaults.
SAMPLER_DEFAULTS: dict[str, Any] = {
    "gen_length": 128, "block_length": 32, "steps": None, "remasking": "low_confidence", "threshold": 0.0,
    "entropy_bound": 0.0, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "cfg_scale": 0.0, "cache": "auto",
    "seed": 0,
}
_HF_NAMES = {"max_new_tokens": "gen_length"}  # HuggingFace generation_config.json spellings


def model_sampler_defaults(model: str) -> dict[str, Any]:
    """Sampler defaults stored with a checkpoint (generation_config.json); unknown keys are ignored."""
    path = os.path.join(model, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    from clover_jax.cli import UserError

    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e})") from e
    out = {}
    for key, value in doc.items():
        key = _HF_NAMES.get(key, key)
        if key in SAMPLER_DEFAULTS:
            out[key] = value
    return out


def sampler_config(args: argparse.Namespace, model_defaults: dict[str, Any] | None = None) -> Any:
    """Flags first, then the model's generation_config.json, then the built-in defaults."""
    from clover_jax.sampler import SamplerConfig

    settings = dict(SAMPLER_DEFAULTS, **(model_defaults or {}))
    for key in SAMPLER_DEFAULTS:
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    return SamplerConfig(**settings, eos_stop=not args.no_eos_stop)


# ---- batch jobs ------------------------------------------------------------------------------


def read_jobs(path: str) -> list[tuple[Any, str]]:
    from clover_jax.cli import UserError

    jobs, seen = [], set()
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise UserError(f"cannot read --input {path!r}: {e}") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not valid JSON ({e.msg})") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise UserError(f"{path}:{n}: each line must be an object with a string \"prompt\"")
        rid = obj.get("id", len(jobs))
        if rid in seen:
            raise UserError(f"{path}:{n}: duplicate id {rid!r}")
        seen.add(rid)
        jobs.append((rid, obj["prompt"]))
    return jobs


def finished_ids(path: str) -> set:
    """Ids already in the output. A torn last line (a kill mid-write) is cut off the file first."""
    from clover_jax.cli import UserError

    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    keep = data if data.endswith(b"\n") or not data else data[: data.rfind(b"\n") + 1]
    done = set()
    for n, line in enumerate(keep.splitlines(), 1):
        if not line.strip():
            continue
        try:
            done.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{path}:{n}: existing output line is not a result row; refusing to append") from e
    if len(keep) != len(data):
        print(f"clover generate: dropping a torn last line from {path}", file=sys.stderr)
        with open(path, "r+b") as f:
            f.truncate(len(keep))
            f.flush()
            os.fsync(f.fileno())
    return done


def append_rows(path: str, rows: list[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run(args: argparse.Namespace) -> int:
    from clover_jax.cli import UserError

    if (args.prompt is None) == (args.input is None):
        raise UserError("give a prompt or --input prompts.jsonl (not both)")
    if args.input and not args.output:
        raise UserError("--input needs --output out.jsonl")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise UserError(f"--output {args.output!r}: its directory does not exist")
    from clover_jax.sampler import SamplerError, check_prompts, check_settings

    model = args.model or default_model()
    sc = sampler_config(args, model_sampler_defaults(model) if os.path.isdir(model) else None)
    try:  # check the knobs before reading or loading anything
        check_settings(sc)
    except SamplerError as e:
        raise UserError(str(e)) from e
    jobs = read_jobs(args.input) if args.input else [(0, args.prompt)]
    cfg, weights, tok, mesh_ctx = load(model, args.mesh)
    chat = not args.no_chat_template
    done = finished_ids(args.output) if args.output else set()
    todo = [(rid, text) for rid, text in jobs if rid not in done]
    encoded = [(rid, text, encode(tok, text, chat)) for rid, text in todo]
    for rid, _, ids in encoded:
        try:
            check_prompts(cfg, sc, [ids])
        except SamplerError as e:
            raise UserError(f"prompt {rid!r}: {e}") from e
    if args.input and done:
        print(f"clover generate: {len(done)} rows already in {args.output}, {len(todo)} to go", file=sys.stderr)

    import contextlib

    from clover_jax.sharding import use_mesh

    ctx = use_mesh(*mesh_ctx) if mesh_ctx else contextlib.nullcontext()
    with ctx:
        if args.input:
            return _run_batch(args, cfg, weights, tok, sc, encoded)
        return _run_one(args, cfg, weights, tok, sc, encoded[0][1], encoded[0][2])


def _run_one(args: argparse.Namespace, cfg: Any, weights: Any, tok: Any, sc: Any, text: str, ids: list[int]) -> int:
    from clover_jax.sampler import generate

    show = make_show(tok, cfg, text) if args.show else None
    res = generate(weights, cfg, [ids], sc, progress=show)
    print(tok.decode(res.tokens[0]))
    print(res.stats.line(), file=sys.stderr)
    return 0


def _run_batch(args: argparse.Namespace, cfg: Any, weights: Any, tok: Any, sc: Any, encoded: list) -> int:
    from tqdm import tqdm

    from clover_jax.sampler import batch_bucket, generate

    bucket = batch_bucket(args.batch_size)  # one row count for every batch, the last one included
    total_tokens = total_nfe = 0
    wall = compile_s = 0.0
    with tqdm(total=len(encoded), desc="generate", unit="prompt", file=sys.stderr) as bar:
        for start in range(0, len(encoded), args.batch_size):
            chunk = encoded[start:start + args.batch_size]
            show = make_show(tok, cfg, chunk[0][1]) if args.show else None
            res = generate(weights, cfg, [ids for _, _, ids in chunk], sc, progress=show, batch=bucket)
            st = res.stats
            rows = [{"id": rid, "prompt": text, "text": tok.decode(out), "tokens": len(out), "finished": fin,
                     "stats": {"nfe": st.nfe, "tokens_per_pass": round(st.tokens_per_pass, 4),
                               "batch_wall_s": round(st.wall_s, 4)}}
                    for (rid, text, _), out, fin in zip(chunk, res.tokens, res.finished, strict=True)]
            append_rows(args.output, rows)
            total_tokens += st.tokens
            total_nfe += st.nfe
            wall += st.wall_s
            compile_s += st.compile_s
            bar.update(len(chunk))
    if encoded:
        print(f"{total_nfe} forward passes in all, {total_tokens} tokens in {wall:.2f} s "
              f"({total_tokens / max(wall, 1e-9):.1f} tokens/s); compile {compile_s:.1f} s", file=sys.stderr)
    return 0
