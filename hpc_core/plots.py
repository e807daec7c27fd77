"""Figures drawn off-screen to PNG, one way everywhere (training curves, LR finder, study
history, governor report, rollout report).

``matplotlib.figure.Figure`` with an Agg canvas, never pyplot: no global backend to switch, no
figure registry to leak from a long-running process, safe from any thread, and nothing tries
to open a display on a device, a CI box or a cluster node. torch-free; matplotlib is imported
only when a figure is drawn.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from registry.atomic import write_bytes_atomic


def figure(**kw: Any) -> Any:
    """A ``Figure`` on the Agg canvas; ``kw`` as for ``Figure`` (figsize, dpi, layout)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kw)
    FigureCanvasAgg(fig)
    return fig


def png_bytes(fig: Any, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def write_png(fig: Any, path: Path, dpi: int = 100) -> Path:
    """The figure as a PNG file, written atomically; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, png_bytes(fig, dpi))
    return path
