"""Draw the pictures of the documentation site (docs/images/*.png) from real data.

    python scripts/docs_images.py                 # all of them
    python scripts/docs_images.py canvas mesh     # some of them

- `canvas.png`: the shipped clover-tiny model generating 96 tokens after "ROMEO:" three ways (random order and
  confidence order at one token a pass, confidence order at four tokens a pass); each token on a box coloured by
  the forward pass that committed it, read off the sampler's `progress` callback.
- `canvas_moments.png`: the random-order run at six moments (grey boxes are still masked).
- `mesh_experts.png`: which device holds which routed experts of the real clover-35b-a3b config under the
  shipped mesh layouts (sharding/*.toml), read off `weight_shardings` over fake CPU devices (nothing allocated).
- `hbm_per_chip.png`: the per-chip HBM the TPU compiler reported for clover-35b-a3b (`clover plan`), parsed
  from the outputs recorded in benchmarks/README.md.

Run it from the repository root with the project's virtual environment (matplotlib comes with the `notebooks`
extra). It runs on the CPU in about a minute; the images are written as palette PNGs to stay small.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CLOVER_COMPILE_CACHE", "off")
# The largest layout drawn (tpu-v5p-64) has 32 devices; fake CPU devices stand in for them (only shardings are
# computed, nothing is put on a device).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=32").strip()

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import Normalize
from matplotlib.patches import Patch, Rectangle

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "images"
DPI = 100


def save(fig: plt.Figure, name: str) -> Path:
    """Write `fig` as docs/images/NAME, quantized to a 256-colour palette (a third of the bytes)."""
    from PIL import Image

    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / name
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    img = Image.open(path).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    img.save(path, optimize=True)
    print(f"{path.relative_to(ROOT)}: {path.stat().st_size / 1024:.0f} KB")
    return path


# ---- the canvas ----------------------------------------------------------------------------------------------

COLS = 16  # tokens per row of the picture
CMAP = plt.get_cmap("viridis")


def _pieces(tok, ids: np.ndarray) -> list[str]:
    """Each token's own text (what it adds to the decoded string); a line break shows as ↵."""
    pieces, before = [], ""
    for i in range(len(ids)):
        text = tok.decode([int(t) for t in ids[: i + 1]])
        pieces.append(text[len(before):].replace("\n", "↵").strip() or "␣")
        before = text
    return pieces


def _draw_canvas(ax: plt.Axes, pieces: list[str], passes: np.ndarray, norm: Normalize, title: str,
                 block_length: int, fontsize: float = 7) -> None:
    """Token pieces on boxes coloured by their commit pass; a pass of 0 (still masked) is a grey box."""
    for i, (piece, p) in enumerate(zip(pieces, passes, strict=True)):
        r, c = divmod(i, COLS)
        if p == 0:
            ax.add_patch(Rectangle((c, r), 0.94, 0.9, color="0.85"))
            continue
        face = CMAP(norm(p))
        ax.add_patch(Rectangle((c, r), 0.94, 0.9, color=face))
        dark = 0.299 * face[0] + 0.587 * face[1] + 0.114 * face[2] < 0.5
        ax.text(c + 0.47, r + 0.45, piece[:7], ha="center", va="center", fontsize=fontsize,
                color="white" if dark else "black")
    rows_per_block = block_length // COLS
    for b in range(len(pieces) // block_length):
        ax.text(-0.15, (b + 0.5) * rows_per_block, f"block {b}", ha="right", va="center", fontsize=fontsize + 1)
    ax.set_xlim(-1.6, COLS)
    ax.set_ylim(len(pieces) / COLS, 0)
    ax.axis("off")
    ax.set_title(title, loc="left", fontsize=10)


def canvas() -> None:
    """canvas.png and canvas_moments.png: the shipped model's sampler, watched through `progress`."""
    import json

    import clover_jax
    from clover_jax.sampler import CanvasRecorder
    from clover_jax.tokenizer import load_tokenizer

    model_dir = str(clover_jax.shipped.MODEL_DIR)
    cfg, weights = clover_jax.load_model(model_dir)
    tok = load_tokenizer(model_dir)
    with open(os.path.join(model_dir, "generation_config.json")) as f:
        defaults = json.load(f)
    sampler = clover_jax.SamplerConfig(gen_length=96, block_length=defaults["block_length"],
                                       remasking=defaults["remasking"], temperature=defaults["temperature"], seed=4)
    prompt = tok.encode("ROMEO:\n")
    settings = {
        "random order, 1 token a pass (the model's default)": sampler,
        "confidence order, 1 token a pass": sampler.replace(remasking="low_confidence"),
        "confidence order, 4 tokens a pass": sampler.replace(remasking="low_confidence", steps=24),
    }
    runs = {}
    for name, sc in settings.items():
        rec = CanvasRecorder()
        res = clover_jax.generate(weights, cfg, [prompt], sc, progress=rec)
        runs[name] = (res, rec.commit_pass(cfg.mask_token_id))
        print(f"  {name}: {res.stats.line()}")

    norm = Normalize(1, max(r.stats.nfe for r, _ in runs.values()))
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.6 * len(runs)), layout="constrained")
    for ax, (name, (res, commit)) in zip(axes, runs.items(), strict=True):
        _draw_canvas(ax, _pieces(tok, res.raw[0]), commit, norm, f"{name}: {res.stats.nfe} forward passes",
                     sampler.block_length)
    fig.colorbar(plt.cm.ScalarMappable(norm, CMAP), ax=axes, shrink=0.6, label="forward pass")
    fig.suptitle('clover-tiny after "ROMEO:", 96 tokens in blocks of 32: the pass that committed each token',
                 fontsize=11)
    save(fig, "canvas.png")

    res, commit = next(iter(runs.values()))
    pieces = _pieces(tok, res.raw[0])
    moments = 1 + np.arange(1, 7) * sampler.block_length // 2  # pass 1 is the prompt's
    fig, axes = plt.subplots(3, 2, figsize=(11, 5.2), layout="constrained")
    for ax, m in zip(axes.flat, moments, strict=True):
        _draw_canvas(ax, pieces, np.where(commit <= m, commit, 0), norm,
                     f"after pass {m}: {(commit <= m).sum()} of {commit.size} tokens", sampler.block_length,
                     fontsize=5.5)
    fig.colorbar(plt.cm.ScalarMappable(norm, CMAP), ax=axes, shrink=0.6, label="forward pass")
    save(fig, "canvas_moments.png")


# ---- where the experts live ----------------------------------------------------------------------------------

MESH_LAYOUTS = ("cpu-8", "tpu-v5e-8", "tpu-v5e-16", "gpu-8xh100", "tpu-v5p-64")


def mesh() -> None:
    """mesh_experts.png: each device of a layout with the routed experts (and expert-MLP slice) it holds."""
    import jax

    import clover_jax
    from clover_jax.mesh import load_layout
    from clover_jax.model import named_leaves, weight_shardings

    cfg = clover_jax.get_config("clover-35b-a3b")
    devices = jax.devices()
    colours = plt.get_cmap("tab20")
    fig, axes = plt.subplots(len(MESH_LAYOUTS), 1, figsize=(11, 1.9 * len(MESH_LAYOUTS) + 0.6),
                             gridspec_kw={"height_ratios": [load_layout(n).shape[0] + 0.6 for n in MESH_LAYOUTS]})
    for ax, name in zip(axes, MESH_LAYOUTS, strict=True):
        layout = load_layout(name)
        rules = layout.mesh_rules(devices)
        shardings = dict(named_leaves(weight_shardings(cfg, rules.mesh, rules.rules)))
        abstract = dict(named_leaves(clover_jax.model.abstract(cfg)))
        leaf = next(n for n in shardings if n.endswith("mlp.gate") and "shared" not in n and
                    abstract[n].shape[1] == cfg.n_experts)  # [layers, experts, d_model, expert_mlp]
        shape = abstract[leaf].shape
        index = shardings[leaf].devices_indices_map(shape)
        data = layout.shape[layout.axes.index("data")]
        grid = rules.mesh.devices.reshape(data, -1)
        expert_ranges = sorted({(index[d][1].start or 0, index[d][1].stop or shape[1]) for d in grid.flat})
        for (r, c), dev in np.ndenumerate(grid):
            e0, e1 = index[dev][1].start or 0, index[dev][1].stop or shape[1]
            h0, h1 = index[dev][3].start or 0, index[dev][3].stop or shape[3]
            ax.add_patch(Rectangle((c + 0.04, r + 0.06), 0.92, 0.88,
                                   color=colours(expert_ranges.index((e0, e1)) % 20)))
            small = grid.shape[1] > 8
            mlp = "" if (h0, h1) == (0, shape[3]) else f"\nmlp {h0}-{h1 - 1}"
            label = f"{dev.id}\n{e0}-{e1 - 1}" if small else f"device {dev.id}\nexperts {e0}-{e1 - 1}{mlp}"
            ax.text(c + 0.5, r + 0.5, label, ha="center", va="center", fontsize=7 if small else 8)
        ax.set_xlim(0, grid.shape[1])
        ax.set_ylim(grid.shape[0], 0)
        ax.set_xticks([])
        ax.set_yticks([r + 0.5 for r in range(grid.shape[0])], [f"data {r}" for r in range(grid.shape[0])],
                      fontsize=8)
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
        mesh_desc = " x ".join(f"{a} {n}" for a, n in zip(layout.axes, layout.shape, strict=True))
        ax.set_title(f"{name} ({mesh_desc}): {len(expert_ranges)} groups of {shape[1] // len(expert_ranges)} "
                     f"experts", loc="left", fontsize=10)
    fig.suptitle(f"clover-35b-a3b: who holds the {cfg.n_experts} routed experts (`{leaf}` {tuple(shape)}), "
                 "per shipped layout", fontsize=11)
    fig.legend(handles=[Patch(color="0.8", label="one colour = one expert shard; the data rows hold copies")],
               loc="lower center", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save(fig, "mesh_experts.png")


# ---- HBM per chip, from the recorded `clover plan` outputs ------------------------------------------------------

_CMD = re.compile(r"^\$ (clover plan .*)$")
_LAYOUT = re.compile(r"--mesh (\S+)")
_CHIP = re.compile(r"^chip: ([\d.]+) GB HBM")
_PASS = re.compile(r"^pass '([^']+)'")
_HBM = re.compile(r"HBM per chip \(compiler\): ([\d.]+) GB of ([\d.]+) GB")
_OOM = re.compile(r"DOES NOT FIT.*temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")


def parse_plans(text: str) -> list[dict]:
    """The `$ clover plan ...` outputs of a markdown file: per run the command, the layout, the chip's HBM and
    per pass the compiler's GB per chip (or, for a pass the compiler refused, the temporaries it asked for)."""
    runs: list[dict] = []
    cur: dict | None = None
    pass_name = None
    for line in text.splitlines():
        line = line.strip()
        if m := _CMD.match(line):
            cur = {"command": m.group(1), "layout": _LAYOUT.search(line).group(1),
                   "int8": "--quantize int8" in line, "passes": {}}
            runs.append(cur)
        elif cur is None:
            continue
        elif m := _CHIP.match(line):
            cur["hbm"] = float(m.group(1))
        elif m := _PASS.match(line):
            pass_name = m.group(1)
        elif m := _HBM.search(line):
            cur["passes"][pass_name] = ("fits", float(m.group(1)))
        elif m := _OOM.search(line):
            cur["passes"][pass_name] = ("oom", float(m.group(1)))
        elif line.startswith("```"):
            cur = None if line == "```" and cur and cur["passes"] else cur
    return [r for r in runs if r["passes"]]


def hbm() -> None:
    """hbm_per_chip.png: what the TPU compiler placed per chip, per pass and slice."""
    runs = parse_plans((ROOT / "benchmarks" / "README.md").read_text())
    order = ["tpu-v5e-4", "tpu-v5e-4 int8", "tpu-v5e-8", "tpu-v6e-4", "tpu-v5p-8"]
    by_label = {r["layout"] + (" int8" if r["int8"] else ""): r for r in runs}
    runs = [by_label[k] for k in order if k in by_label] + [r for k, r in by_label.items() if k not in order]
    passes = ["cached block", "full canvas"]
    colours = {"cached block": "tab:blue", "full canvas": "tab:orange"}
    fig, ax = plt.subplots(figsize=(10, 4.4))
    width = 0.36
    top = 40.0
    for i, run in enumerate(runs):
        for j, name in enumerate(passes):
            x = i + (j - 0.5) * width
            kind, gb = run["passes"].get(name, ("none", 0.0))
            if kind == "fits":
                ax.bar(x, gb, width, color=colours[name])
                ax.text(x, gb + 0.5, f"{gb:.2f}", ha="center", fontsize=8)
            elif kind == "oom":
                ax.bar(x, gb, width, color="white", edgecolor="tab:red", hatch="///")
                ax.text(x, gb + 0.5, f"ran out of HBM:\n{gb:.2f} GB of\ntemporaries alone", ha="center", fontsize=7,
                        color="tab:red")
            else:
                ax.text(x, 0.5, "not\ncompiled", ha="center", fontsize=7, color="0.4")
        hbm_gb = run["hbm"]
        ax.hlines(min(hbm_gb, top), i - 0.45, i + 0.45, colors="black", linewidth=2.5)
        ax.text(i + 0.47, min(hbm_gb, top) - (1.6 if hbm_gb > top else -0.3),
                f"{hbm_gb:.0f} GB" + (" (above)" if hbm_gb > top else ""), fontsize=7, ha="right")
    labels = [r["layout"] + ("\nint8 weights" if r["int8"] else "\nbf16 weights") for r in runs]
    ax.set_xticks(range(len(runs)), labels, fontsize=8)
    ax.set(ylim=(0, top), ylabel="GB per chip (TPU compiler)",
           title="clover-35b-a3b: HBM per chip as the TPU compiler placed each pass (`clover plan`)")
    ax.legend(handles=[Patch(color=colours[p], label=f"pass '{p}'") for p in passes] +
              [Patch(facecolor="white", edgecolor="tab:red", hatch="///", label="refused: out of HBM"),
               plt.Line2D([], [], color="black", linewidth=2.5, label="the chip's HBM")],
              loc="upper left", fontsize=8)
    fig.tight_layout()
    save(fig, "hbm_per_chip.png")


PICTURES = {"canvas": canvas, "mesh": mesh, "hbm": hbm}


def main(argv: list[str]) -> int:
    names = argv or list(PICTURES)
    unknown = [n for n in names if n not in PICTURES]
    if unknown:
        print(f"unknown picture(s) {unknown}; known: {', '.join(PICTURES)}", file=sys.stderr)
        return 2
    for name in names:
        print(f"{name} ...")
        PICTURES[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
