"""Attention maps as labelled heatmaps (optional extra: ``pip install attnx[viz]``).

matplotlib is imported only when a map is drawn, so ``import attnx.viz`` works without it.
No pyplot state is touched when an ``ax`` is given; without one a standalone
``matplotlib.figure.Figure`` is made (no GUI backend needed), reachable as ``ax.figure``.

A bright cell says that one query gave one key a larger coefficient in this layer and head; it
is routing, not reasoning (the seed's caveat).

:func:`heatmap`: Parameters
----------
weights : array ``(Sq, Sk)``
    One head's attention weights (e.g. a slice of ``layer(x, return_weights=True)[1]`` or
    :func:`attnx.reference.attention_weights`); masked entries are 0.
query_tokens : sequence of str, length ``Sq``
    Row labels.
key_tokens : sequence of str, length ``Sk``
    Column labels.
ax : matplotlib Axes, optional
    Where to draw; a new figure is made when omitted.
title : str, optional
annotate : bool
    Write each coefficient in its cell (with 2 decimals).

Returns
-------
matplotlib.axes.Axes
    ``ax.figure.savefig("map.png")`` saves it.

Examples
--------
>>> import numpy as np
>>> from attnx import viz
>>> ax = viz.heatmap(np.eye(2), ["a", "b"], ["a", "b"])  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["heatmap"]


def _matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "attnx.viz needs matplotlib: pip install attnx[viz] (or pip install matplotlib)"
        ) from exc
    return Figure


def heatmap(
    weights: npt.ArrayLike,
    query_tokens: Sequence[object],
    key_tokens: Sequence[object],
    ax: Any = None,
    title: str | None = None,
    annotate: bool = True,
) -> Any:
    """Draws one attention map: rows are queries, columns are keys.
    (Parameters, results and an example: :mod:`attnx.viz`.)"""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(
            f"weights: expected one map (Sq, Sk), got shape {w.shape}; select a "
            "batch entry and head first, e.g. weights[0, h]"
        )
    query_tokens = [str(t) for t in query_tokens]
    key_tokens = [str(t) for t in key_tokens]
    if len(query_tokens) != w.shape[0]:
        raise ValueError(
            f"query_tokens: expected {w.shape[0]} labels (rows of weights), got {len(query_tokens)}"
        )
    if len(key_tokens) != w.shape[1]:
        raise ValueError(
            f"key_tokens: expected {w.shape[1]} labels (columns of weights), got {len(key_tokens)}"
        )
    Figure = _matplotlib()
    if ax is None:
        fig = Figure(
            figsize=(1.0 + 0.6 * max(w.shape[1], 3), 0.8 + 0.5 * max(w.shape[0], 3)),
            layout="constrained",
        )
        ax = fig.add_subplot()
    vmax = max(1e-12, float(np.nanmax(w))) if w.size else 1.0
    im = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto")
    ax.set_xticks(
        np.arange(w.shape[1]), labels=key_tokens, rotation=45, ha="right", rotation_mode="anchor"
    )
    ax.set_yticks(np.arange(w.shape[0]), labels=query_tokens)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    if title:
        ax.set_title(title)
    if annotate:
        for i in range(w.shape[0]):
            for j in range(w.shape[1]):
                val = w[i, j]
                color = "black" if np.isfinite(val) and val > 0.6 * vmax else "white"
                ax.text(j, i, f"{val:.2f}", ha="center", va="center", color=color, fontsize=8)
    ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="weight")
    return ax
