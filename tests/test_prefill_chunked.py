"""Chunked prefill (`sampler.step.prefill`, ModelConfig.prefill_chunk, `--prefill-chunk`): a prompt written into
the cache in windows gives the tokens and logits of one pass over it, for every kind of model a cache serves
(causal-prefix hybrids, block-causal attention-only models on both block grids, left-padded rows of different
lengths, self-speculative decoding, the serving engine), and its passes are never wider than a window."""

import collections
import importlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.config import get_config
from clover_jax.errors import ConfigError
from clover_jax.model import ModelForward, params
from clover_jax.sampler import SamplerConfig, generate
from clover_jax.sampler import step as denoise
from tests.engine_requests import serve, tokens

sampler_generate = importlib.import_module("clover_jax.sampler.generate")  # the module, not the function


@pytest.mark.parametrize("width, chunk, overlap", [(37, 8, 0), (64, 16, 0), (40, 16, 8), (41, 20, 4), (9, 8, 0)])
def test_the_windows_cover_the_prompt_once_and_overlap_by_a_block(width, chunk, overlap):
    widths = []  # the static width of every window traced

    def run(counts, start, w):
        widths.append(w)
        return jax.lax.dynamic_update_slice_in_dim(counts, jax.lax.dynamic_slice_in_dim(counts, start, w) + 1,
                                                   start, 0)

    lo = 3
    counts = np.asarray(jax.jit(lambda c: denoise.prefill(run, c, lo, width, chunk, overlap))(
        jnp.zeros(lo + width + 5, jnp.int32)))
    assert max(widths) <= chunk and len(widths) == 2  # the first window and the loop's body
    assert not counts[:lo].any() and not counts[lo + width:].any()  # nothing outside the prompt
    seen = counts[lo:lo + width]
    assert seen.min() == 1
    if overlap == 0:
        assert (seen == 1).all()  # every column once: a Gated DeltaNet state advances over it once
    else:
        # each window but the first writes `overlap` columns again, and no more windows run than covering needs
        assert seen.max() == 2 and (seen.sum() - width) % overlap == 0
        windows = 1 + (seen.sum() - width) // overlap
        assert windows == -(-(width - overlap) // (chunk - overlap))


def test_one_pass_when_the_prompt_fits_a_window_or_no_cut_is_exact():
    calls = []

    def run(c, start, w):
        calls.append(w)
        return c

    for width, chunk, overlap in ((16, 16, 0), (40, 0, 0), (40, 16, None), (40, 16, 32)):
        calls.clear()
        denoise.prefill(run, None, 0, width, chunk, overlap)
        assert calls == [width], (width, chunk, overlap)


def test_which_models_cut_where():
    assert denoise.prefill_overlap(get_config("test-clover-prefix"), 8) == 0  # causal clean text: any cut
    assert denoise.prefill_overlap(get_config("test-clover"), 8) == 8  # block-causal attention: one block again
    assert denoise.prefill_overlap(get_config("test-llada2"), 16) == 16  # its grid's blocks
    assert denoise.prefill_overlap(get_config("test-clover-hybrid"), 8) is None  # a clean block read whole


@dataclass(frozen=True)
class _Widths(ModelForward):
    """The model, noting the width of every window it is traced with (on `seen`, a list it shares)."""

    seen: list | None = None

    def __hash__(self):
        return id(self)

    def __call__(self, weights, tokens, *args, **kwargs):
        self.seen.append(tokens.shape[1])
        return super().__call__(weights, tokens, *args, **kwargs)


def _run(name, chunk, sc, prompts):
    cfg = get_config(name).replace(dtype="float32", prefill_chunk=chunk)
    weights = params.init(cfg, jax.random.key(0))
    seen = []
    res = generate(weights, cfg, prompts, sc, forward_fn=_Widths(cfg, seen=seen),
                   record_logits=not sc.self_speculative)
    return res, seen


PROMPTS = [list(range(5, 42)), list(range(60, 83))]  # 37 and 23 tokens: the second row left-padded


@pytest.mark.parametrize("name, grid", [("test-clover-prefix", "auto"), ("test-clover", "auto"),
                                        ("test-llada2", "auto"), ("test-clover", "absolute"),
                                        ("test-qwen3-5-moe", "auto")])
def test_a_windowed_prefill_gives_the_tokens_of_one_pass(name, grid):
    sc = SamplerConfig(gen_length=16, block_length=8, steps=16, block_grid=grid)
    whole, seen_whole = _run(name, 0, sc, PROMPTS)
    chunked, seen = _run(name, 12, sc, PROMPTS)
    prompt_cols = max(seen_whole)  # the prefill is the widest pass of one-pass prefill
    assert prompt_cols >= 32 and max(seen) <= 16  # windows of 12 (two blocks of 8 at least, so 16 at most)
    assert chunked.tokens == whole.tokens and chunked.stats.nfe == whole.stats.nfe
    np.testing.assert_allclose(chunked.logits, whole.logits, atol=2e-4, rtol=1e-4)


def test_the_rows_of_a_batch_share_the_budget():
    cfg = get_config("test-clover-prefix")
    cols = lambda chunk, rows: denoise.prefill_columns(cfg.replace(prefill_chunk=chunk), rows)
    assert (cols(4096, 1), cols(4096, 8), cols(4096, 32), cols(4096, 256)) == (4096, 512, 128, 64)
    assert (cols(12, 2), cols(0, 4)) == (12, 0)  # a budget below the floor is taken whole; 0 stays one pass
    sc = SamplerConfig(gen_length=16, block_length=8, steps=16)
    prompts = [list(range(5, 160)), list(range(3, 120))]
    whole, _ = _run("test-clover-prefix", 0, sc, prompts)
    shared, seen = _run("test-clover-prefix", 128, sc, prompts)  # two rows: 64 columns a window
    assert max(seen) == 64 and shared.tokens == whole.tokens


def test_self_speculative_decoding_prefills_in_windows_too():
    sc = SamplerConfig(gen_length=16, block_length=8, self_speculative=True)
    whole, _ = _run("test-clover-prefix", 0, sc, PROMPTS[:1])
    chunked, seen = _run("test-clover-prefix", 8, sc, PROMPTS[:1])
    assert max(seen) <= 2 * 8 + 1  # a round's window (2L + 1) is the widest pass left
    assert chunked.tokens == whole.tokens


def test_a_hybrid_that_reads_clean_blocks_whole_prefills_in_one_pass():
    sc = SamplerConfig(gen_length=16, block_length=8, steps=16)
    whole, seen_whole = _run("test-clover-hybrid", 0, sc, PROMPTS)
    chunked, seen = _run("test-clover-hybrid", 12, sc, PROMPTS)
    assert max(seen) == max(seen_whole) >= 37 and chunked.tokens == whole.tokens


def _serve(chunk):
    """Both prompts through the engine (prefix cache): their tokens and the widest pass it traced."""
    from clover_jax.serving.engine import Engine
    from clover_jax.serving.requests import Request

    cfg = get_config("test-clover-prefix").replace(dtype="float32", prefill_chunk=chunk)
    weights = params.init(cfg, jax.random.key(0))
    seen = []
    eng = Engine(weights, cfg, block_length=8, max_prompt=64, max_tokens=16, batch_sizes=(2,),
                 forward_fn=_Widths(cfg, seen=seen))
    events = serve(eng, [Request(tuple(p), 16, SamplerConfig(eos_stop=False)) for p in PROMPTS], drain=True)
    return [tokens(e) for e in events], max(seen)


def test_the_serving_engine_prefills_in_windows():
    (whole, widest), (chunked, widest_chunked) = _serve(0), _serve(8)
    assert chunked == whole and all(len(t) == 16 for t in whole)
    assert widest >= 37 and widest_chunked <= 16  # the engine's one-pass prefill, then windows of 8


def test_a_bad_prefill_chunk_is_named():
    with pytest.raises(ConfigError, match="prefill_chunk must be >= 0"):
        get_config("test-clover").replace(prefill_chunk=-1)


def test_the_flag_reaches_the_prefill_and_keeps_the_text(capsys, monkeypatch):
    from clover_jax import cli
    from clover_jax.commands.memory_flags import with_memory_flags

    cfg = get_config("test-clover")
    for command in ("generate", "serve"):
        args = cli.build_parser().parse_args([command, *(["x"] if command == "generate" else []),
                                              "--prefill-chunk", "0"])
        assert with_memory_flags(cfg, args).prefill_chunk == 0
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "x", "--prefill-chunk", "-1"])
    chunks = []  # the chunk each prefill was traced with
    real = denoise.prefill

    def noted(run, cache, lo, width, chunk, overlap):
        chunks.append((width, chunk))
        return real(run, cache, lo, width, chunk, overlap)

    monkeypatch.setattr(denoise, "prefill", noted)
    # no program compiled by an earlier test in this process (same shapes) may stand in for the traced one
    monkeypatch.setattr(sampler_generate, "_PROGRAMS", collections.OrderedDict())
    prompt = "ROMEO: " + "What light through yonder window breaks? " * 3  # longer than 16 columns
    texts = []
    for extra in ([], ["--prefill-chunk", "16"]):
        assert cli.main(["--compile-cache", "off", "generate", prompt, "--gen-length", "32", "--temperature", "0",
                         *extra]) == 0  # (traced afresh: the disk cache would skip the trace)
        texts.append(capsys.readouterr().out)
        (width, chunk), = chunks[-1:]
        assert width > 16 and chunk == (16 if extra else 4096)
    assert texts[0] == texts[1] and texts[0].strip()
