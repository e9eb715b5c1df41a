"""`clover generate`: fill in text after a prompt with the masked-diffusion sampler.

    clover generate "Once upon a time" --gen-length 64 --show
    clover generate --input prompts.jsonl --output out.jsonl --batch-size 8

Batch jobs read one JSON object per line ({"prompt": "...", "id": optional}) and append one line per
prompt to the output, flushed and fsynced after every batch. Run the same command again after a
crash and it skips the ids already written (a torn last line is dropped first), so no row is lost
and none is written twice. OUT.settings.json beside the output records the model and the settings that change the
tokens; a run with others is refused (--force starts the output over).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TextIO

from tqdm import tqdm

from clover_jax import loading
from clover_jax.commands import jobs
from clover_jax.commands.memory_flags import add_memory_arguments, with_memory_flags
from clover_jax.config import BD_GDN_MODES, ModelConfig
from clover_jax.errors import SamplerError, UsageError
from clover_jax.mesh.layouts import add_mesh_argument
from clover_jax.mesh.rules import MeshRules
from clover_jax.model.moe import get_dispatch
from clover_jax.paths import unwritable_reason
from clover_jax.sampler import SamplerConfig, SamplerStats, batch_bucket, check_prompts, check_settings, generate
from clover_jax.sampler import settings as sampler_settings
from clover_jax.tokenizer import Tokenizer

PLACEHOLDER = "░"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `generate` subcommand (prompt or --input job, the sampler's flags, --mesh) to `sub`; it dispatches
    to `run`."""
    p = sub.add_parser("generate", help="generate text with the masked-diffusion sampler",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="Defaults: a checkpoint's generation_config.json replaces the built-in defaults named "
                              "here (the settings taken from it are printed at start); flags override both.")
    p.add_argument("prompt", nargs="?", help="the prompt (or use --input for a batch job)")
    p.add_argument("--input", help="prompts.jsonl: one {\"prompt\": ..., \"id\": ...} object per line")
    p.add_argument("--output", help="out.jsonl for --input jobs (appended to; finished ids are skipped)")
    p.add_argument("--model", default=None,
                   help="checkpoint directory (with config.json) or preset name (random weights); "
                        "default: the shipped clover-tiny model")
    sampler_settings.add_flags(p)
    p.add_argument("--bd-gdn", choices=BD_GDN_MODES, default=None,
                   help="how Gated DeltaNet layers use Clover's block-diffusion tensors: 'reconstructed' (this "
                        "project's reading) or 'none' (the plain causal Gated DeltaNet, as llama.cpp runs it); "
                        "default: the checkpoint's")
    p.add_argument("--dispatch", default=None,
                   help="MoE dispatch (tiled, dense, ragged, ep_gather, ...; default: the model's, or the "
                        "expert-parallel one for --mesh)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per compiled batch in --input jobs")
    p.add_argument("--force", action="store_true",
                   help="--input jobs: start --output over (its rows are discarded), e.g. after changing a setting")
    p.add_argument("--show", action="store_true", help="redraw the canvas on stderr as it fills in")
    p.add_argument("--no-chat-template", action="store_true", help="use the prompt as is")
    p.add_argument("--no-think", action="store_true",
                   help="answer without reasoning first: enable_thinking=false for the chat template (Qwen3.5 / 3.6 "
                        "templates take it)")
    add_memory_arguments(p)
    add_mesh_argument(p)
    p.set_defaults(func=run)


def encode(tok: Tokenizer, text: str, chat: bool, think: bool | None = None) -> list[int]:
    """Token ids of a prompt, through the tokenizer's chat template when `chat` and it has one; `think` False passes
    enable_thinking=False to the template (Qwen3.5 / 3.6 templates then close an empty reasoning themselves)."""
    if chat:
        templated = tok.apply_chat_template(text, **({} if think is None else {"enable_thinking": think}))
        if templated is not None:
            text = templated
    return tok.encode(text)


def render(tok: Tokenizer, ids: Any, mask_id: int) -> str:
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


def make_show(tok: Tokenizer, cfg: ModelConfig, prefix: str, stream: TextIO | None = None) -> Any:
    """A progress callback that draws the canvas on `stream` (default stderr): on a terminal the frame is redrawn
    in place (the cursor goes back up over the last frame, which is erased; the screen and the command line above
    stay), elsewhere one line a pass."""
    out = stream or sys.stderr
    tty = out.isatty()
    drawn = 0  # terminal rows the last frame took

    def show(tokens: Any, block: int, nfe: int) -> None:
        nonlocal drawn
        text = render(tok, tokens[0], cfg.mask_token_id)
        if tty:
            frame = f"[block {block}, pass {nfe}]\n{prefix}{text}\n"
            out.write((f"\x1b[{drawn}F" if drawn else "") + "\x1b[J" + frame)
            drawn = _rows(frame, shutil.get_terminal_size().columns)
        else:
            out.write(f"[block {block}, pass {nfe}] {text!r}\n")
        out.flush()

    return show


def _rows(frame: str, columns: int) -> int:
    """Terminal rows `frame` (ending in a newline) takes at `columns` per row, long lines wrapped."""
    return sum(max(1, -(-len(line) // max(columns, 1))) for line in frame.split("\n")[:-1])


def _note(message: str) -> None:
    """A line on stderr, above a batch job's progress bar when one is drawn."""
    tqdm.write(f"clover generate: {message}", file=sys.stderr)


def check_output(output: str, input_path: str | None) -> None:
    """UsageError, before any work, for an --output that is a directory, the input itself, or not writable."""
    path = os.path.abspath(output)
    if os.path.isdir(path):
        raise UsageError(f"--output {output!r} is a directory; name a .jsonl file")
    if input_path and os.path.exists(path) and os.path.samefile(path, input_path):
        raise UsageError(f"--output {output!r} is the --input file; results would be appended to the prompts")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise UsageError(f"--output {output!r}: its directory does not exist")
    if os.path.exists(path):
        try:  # a real write probe: access() says yes to root on a read-only filesystem
            with open(path, "a"):
                pass
        except OSError as e:
            raise UsageError(f"--output {output!r}: cannot write there ({e.strerror or e})") from None
    elif reason := unwritable_reason(path):
        raise UsageError(f"--output {output!r}: {reason}")


def warn_steps(sc: SamplerConfig) -> None:
    """A warning when --steps is not what runs: split over the blocks with a remainder, or more steps per
    block than the block has tokens (a block ends when it has no mask left)."""
    per_block = sc.block_steps
    runs = min(per_block, sc.block_length) * sc.n_blocks
    if sc.steps is not None and runs != sc.total_steps:
        print(f"clover generate: warning: --steps {sc.total_steps} over {sc.n_blocks} blocks of {sc.block_length} "
              f"runs at most {runs} steps ({min(per_block, sc.block_length)} per block)", file=sys.stderr)


@contextlib.contextmanager
def _say_where(spell: Mapping[str, str], from_file: set[str], stored_file: str) -> Iterator[None]:
    """A SamplerError about a setting no flag gave (its value is the checkpoint's) ends by saying so."""
    try:
        yield
    except SamplerError as e:
        if e.setting in from_file:
            raise SamplerError(f"{e}; {spell[e.setting]} comes from {stored_file} when not given (a flag overrides "
                               "it)", setting=e.setting, param=e.param) from e
        raise


# How fingerprint keys are set on the command line, for the message naming what differs.
FINGERPRINT_LABELS: dict[str, str] = {
    **sampler_settings.FLAGS, "eos_stop": "EOS stop (--no-eos-stop)", "model": "--model", "bd_gdn": "--bd-gdn",
    "chat_template": "the chat template (--no-chat-template)", "think": "thinking (--no-think)"}


def fingerprint(model: str, args: argparse.Namespace, sc: SamplerConfig) -> dict[str, Any]:
    """What a --input job's rows depend on: the model (a checkpoint directory's real path, or a preset's name) and
    every setting that changes the tokens (all the sampler's, as resolved with the checkpoint's
    generation_config.json; --bd-gdn, null for the checkpoint's own; the chat template; thinking). The mesh, the
    MoE dispatch and the batch size are left out: they change how the same tokens are computed, not which."""
    where = os.path.realpath(model) if os.path.isdir(model) else model
    return {"model": where, "bd_gdn": args.bd_gdn, "chat_template": not args.no_chat_template,
            "think": not args.no_think, **dataclasses.asdict(sc)}


def run(args: argparse.Namespace) -> int:
    """Check every flag and prompt, load the model, then generate (one prompt, or a --input job)."""
    if (args.prompt is None) == (args.input is None):
        raise UsageError("give a prompt or --input prompts.jsonl (not both)")
    if args.input and not args.output:
        raise UsageError("--input needs --output out.jsonl")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.output:
        check_output(args.output, args.input)
    model = args.model or loading.default_model()
    stored = loading.sampler_defaults(model)
    sc = sampler_settings.from_flags(args, stored)
    stored_file = os.path.join(model, "generation_config.json")
    # a setting is named by the flag that sets it; a message about one whose value came from the checkpoint's
    # generation_config.json says so
    spell = sampler_settings.FLAGS
    from_file = {k for k in stored if getattr(args, k) is None}
    checked = functools.partial(_say_where, spell, from_file, stored_file)
    with checked():
        check_settings(sc, spell)  # the settings, before reading or loading anything
    defaults = sampler_settings.SETTINGS
    from_model = {k: v for k, v in stored.items()
                  if getattr(args, k) is None and v != defaults[k].default and getattr(sc, k) == v}
    if from_model:
        print(f"clover generate: from {stored_file}: "
              + ", ".join(f"{k}={v}" for k, v in from_model.items()) + " (flags override them)", file=sys.stderr)
    warn_steps(sc)
    if args.dispatch is not None:
        try:
            get_dispatch(args.dispatch)
        except ValueError as e:
            raise UsageError(f"--dispatch: {e}") from e
    todo_jobs = jobs.read_jobs(args.input) if args.input else [(0, args.prompt)]
    job_settings = fingerprint(model, args, sc) if args.input else None
    if args.input:  # rows made under other settings are never appended to: refused before the model loads
        jobs.check_settings(args.output, job_settings, FINGERPRINT_LABELS, args.force)
    cfg, weights, tok, mesh = loading.open_model(model, args.mesh, _note)
    if args.bd_gdn is not None and args.bd_gdn != cfg.bd_gdn:
        if not cfg.has_bd_weights:
            raise UsageError(f"--bd-gdn: {cfg.name} has no block-diffusion Gated DeltaNet tensors")
        cfg = cfg.replace(bd_gdn=args.bd_gdn)
    cfg = with_memory_flags(cfg, args)
    chat = not args.no_chat_template
    done = set()  # --force: none kept; several processes: process 0's reading of the output, in all of them
    if args.input and not args.force:
        done = jobs.shared_finished_ids(args.output, [rid for rid, _ in todo_jobs])
    todo = [(rid, text) for rid, text in todo_jobs if rid not in done]
    think = False if args.no_think else None
    encoded = [(rid, text, encode(tok, text, chat, think)) for rid, text in todo]
    for rid, _, ids in encoded:
        with checked():
            check_prompts(cfg, sc, [ids], spell, labels=[f"prompt {rid!r}" if args.input else "the prompt"])
    if args.input:  # every check passed: (with --force, empty the output and) record the settings
        jobs.record_settings(args.output, job_settings, args.force)
    if args.input and done:
        print(f"clover generate: {len(done)} rows already in {args.output}, {len(todo)} to go", file=sys.stderr)
    if args.input:
        return _run_batch(args, cfg, weights, tok, sc, encoded, mesh)
    return _run_one(args, cfg, weights, tok, sc, encoded[0][1], encoded[0][2], mesh)


def _run_one(args: argparse.Namespace, cfg: ModelConfig, weights: Any, tok: Tokenizer, sc: SamplerConfig, text: str,
             ids: list[int], mesh: MeshRules | None) -> int:
    show = make_show(tok, cfg, text) if args.show else None
    res = generate(weights, cfg, [ids], sc, progress=show, mesh=mesh, dispatch=args.dispatch, on_compile=_note)
    print(tok.decode(res.tokens[0]))
    print(res.stats.line(), file=sys.stderr)
    return 0


def _run_batch(args: argparse.Namespace, cfg: ModelConfig, weights: Any, tok: Tokenizer, sc: SamplerConfig,
               encoded: Sequence[tuple[Any, str, list[int]]], mesh: MeshRules | None) -> int:
    bucket = batch_bucket(args.batch_size, mesh)  # one row count for every batch, the last one included
    stats: list[SamplerStats] = []

    def run_batch(chunk: Sequence[tuple[Any, str, list[int]]]) -> list[dict]:
        show = make_show(tok, cfg, chunk[0][1]) if args.show else None
        res = generate(weights, cfg, [ids for _, _, ids in chunk], sc, progress=show, batch=bucket, mesh=mesh,
                       dispatch=args.dispatch, on_compile=_note)
        st = res.stats
        stats.append(st)
        return [{"id": rid, "prompt": text, "text": tok.decode(out), "tokens": len(out), "finished": fin,
                 "stats": {"nfe": st.nfe, "tokens_per_pass": round(st.tokens_per_pass, 4),
                           "batch_wall_s": round(st.wall_s, 4)}}
                for (rid, text, _), out, fin in zip(chunk, res.tokens, res.finished, strict=True)]

    jobs.run_batches(encoded, args.batch_size, args.output, run_batch)
    if encoded:
        tokens, nfe = sum(s.tokens for s in stats), sum(s.nfe for s in stats)
        wall, compile_s = sum(s.wall_s for s in stats), sum(s.compile_s for s in stats)
        print(f"{nfe} forward passes in all, {tokens} tokens in {wall:.2f} s "
              f"({tokens / max(wall, 1e-9):.1f} tokens/s); compile {compile_s:.1f} s", file=sys.stderr)
    return 0
