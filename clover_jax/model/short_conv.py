"""The short depthwise convolutions of a Gated DeltaNet layer, as array math over [B, T, C] channels (no weights
pytree, no config; `gated_deltanet` applies them to the q/k/v projection, one channel group at a time).

- `causal_conv`: Qwen3.5's causal conv (kernel K, taps t-K+1 .. t), which carries its last K-1 valid inputs
  from one window to the next as a tail, so that a window whose end is padding continues exactly;
- `right_conv`: block diffusion's right-looking conv, restricted to t's block: taps t+1 .. t+Kr as Clover's
  ports read it (cortiq's `bdp_conv`), or t .. t+Kr-1 in this project's earlier reconstruction;
- `two_stream_conv`: the causal conv of the noisy stream in block-diffusion training, whose taps in earlier
  blocks read the clean stream.

None applies an activation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _shift(x: Array, d: int) -> Array:
    """x [B, T, ...] moved d columns later along T: out[:, t] = x[:, t - d], zero where t - d is outside
    (d < 0 looks ahead: out[:, t] = x[:, t + |d|]); all zeros when |d| >= T (a window narrower than the conv)."""
    if d == 0:
        return x
    t = x.shape[1]
    if abs(d) >= t:
        return jnp.zeros_like(x)
    pad = [(0, 0)] * x.ndim
    if d > 0:
        pad[1] = (d, 0)
        return jnp.pad(x[:, :t - d], pad)
    pad[1] = (0, -d)
    return jnp.pad(x[:, -d:], pad)


def causal_conv(x: Array, weight: Array, tail: Array | None = None, valid: Array | None = None,
                keep: Array | None = None) -> tuple[Array, Array]:
    """Depthwise causal conv: y_t = sum_j weight[j] * x_{t-K+1+j}, and the conv's next tail.

    x [B, T, C]; weight [K, C]; tail [B, K-1, C]: the inputs just before x (None: zeros, the start of a
    sequence). Padding columns (valid [B, T] False) count as zero inputs, and the returned tail holds the
    last K-1 valid inputs of (tail, x), so a window whose end is padding continues exactly. keep [B, T]
    (default `valid`): the columns that may enter the returned tail (the sampler's refinement passes keep
    none, so the tail stays that of the committed prefix). No activation.
    """
    b, t, c = x.shape
    k = weight.shape[0]
    if valid is not None:
        x = jnp.where(valid[:, :, None], x, 0)
    if tail is None:
        tail = jnp.zeros((b, k - 1, c), x.dtype)
    full = jnp.concatenate([tail.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    y = sum(full[:, j:j + t] * weight[j].astype(x.dtype) for j in range(k))
    keep = valid if keep is None else keep
    if keep is None:
        return y, full[:, t:]
    # The last K-1 kept entries of `full` (the old tail counts as kept): entry number n - (K-2-s), 1-based.
    ok = jnp.concatenate([jnp.ones((b, k - 1), bool), keep], axis=1)
    count = jnp.cumsum(ok, axis=1)  # [B, K-1+T]
    want = count[:, -1:] - (k - 2 - jnp.arange(k - 1))[None]  # [B, K-1]
    idx = jnp.argmax(count[:, None, :] >= want[:, :, None], axis=-1)  # first entry reaching each count
    return y, jnp.take_along_axis(full, idx[:, :, None], axis=1)


def right_conv(x: Array, weight: Array, blocks: Array, valid: Array, first: int = 1) -> Array:
    """The right-looking depthwise conv inside a block: y_t = sum_j weight[j] * x_{t+first+j}, j = 0 .. Kr-1, over
    the columns that are valid and in t's block (a block never looks into the next one). first=1 is Clover's as
    its ports run it (cortiq's `bdp_conv`: sum_{d=1..kk-1} block[t+d] * right[d-1], x_t itself not among them);
    first=0 this project's earlier reconstruction (x_t .. x_{t+Kr-1}).
    x [B, T, C]; weight [Kr, C]; blocks [B, T] block ids; valid [B, T]."""
    y = jnp.zeros_like(x)
    for j in range(weight.shape[0]):
        d = first + j
        same = (_shift(blocks, -d) == blocks) & _shift(valid, -d)
        y = y + jnp.where(same[:, :, None], _shift(x, -d), 0) * weight[j].astype(x.dtype)
    return y


def two_stream_conv(noisy: Array, clean: Array, weight: Array, blocks: Array) -> Array:
    """The causal conv of the noisy stream of block-diffusion training: a tap inside the column's block reads
    the noisy input, a tap in an earlier block reads the clean one (the committed prefix it will have at
    inference). noisy, clean [B, L, C] aligned by column; weight [K, C]; blocks [B, L]."""
    k = weight.shape[0]
    y = noisy * weight[k - 1].astype(noisy.dtype)
    for d in range(1, k):
        same = (_shift(blocks, d) == blocks)[:, :, None]
        y = y + jnp.where(same, _shift(noisy, d), _shift(clean, d)) * weight[k - 1 - d].astype(noisy.dtype)
    return y

