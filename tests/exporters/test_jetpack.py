"""The L4T release (JetPack) a board runs, as TensorRT engines record it."""

from __future__ import annotations

from pathlib import Path

import pytest

from exporters.jetpack import l4t_release

# /etc/nv_tegra_release as Jetsons ship it (first lines; JetPack 6.0 as NVIDIA's docs print it,
# JetPack 6.2.x as a device reported it).
NV_TEGRA_RELEASE = {
    "R36.3.0": "# R36 (release), REVISION: 3.0, GCID: 36923193, BOARD: generic, EABI: aarch64, "
               "DATE: Fri Jul 19 23:24:25 UTC 2024\n# KERNEL_VARIANT: oot\n",
    "R36.4.7": "# R36 (release), REVISION: 4.7, GCID: 42132812, BOARD: generic, EABI: aarch64, "
               "DATE: Thu Sep 18 22:54:44 UTC 2025\n# KERNEL_VARIANT: oot\n",
}


@pytest.mark.parametrize("release", sorted(NV_TEGRA_RELEASE))
def test_the_l4t_release_is_read_from_nv_tegra_release(tmp_path: Path, release: str) -> None:
    path = tmp_path / "nv_tegra_release"
    path.write_text(NV_TEGRA_RELEASE[release])
    assert l4t_release(path) == release


def test_no_l4t_release_off_a_jetson(tmp_path: Path) -> None:
    assert l4t_release(tmp_path / "absent") is None
    (tmp_path / "odd").write_text("not a release line\n")
    assert l4t_release(tmp_path / "odd") is None
