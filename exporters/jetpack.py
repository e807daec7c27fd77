"""Which JetPack the board runs: the L4T release, read from ``/etc/nv_tegra_release``.

A TensorRT engine loads only on the TensorRT and CUDA driver that built it, and a JetPack
upgrade may change the driver under an unchanged TensorRT version: the engine build records
the release (``model.engine.json``), the runtime skips an engine built on another one, and the
TensorRT execution provider's cache folder is keyed by it. Standard library only: the serving
runtime imports it, and applications import the runtime.
"""

from __future__ import annotations

import re
from pathlib import Path

TEGRA_RELEASE = Path("/etc/nv_tegra_release")
_L4T_RE = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)")


def l4t_release(path: Path = TEGRA_RELEASE) -> str | None:
    """The Jetson's L4T release from the first line of ``/etc/nv_tegra_release`` (``# R36
    (release), REVISION: 4.3, GCID: ...`` -> ``R36.4.3``, JetPack 6.2); None elsewhere."""
    try:
        with open(path, errors="replace") as f:
            first = f.readline()
    except OSError:
        return None
    m = _L4T_RE.match(first.strip())
    return f"R{m.group(1)}.{m.group(2)}" if m else None
