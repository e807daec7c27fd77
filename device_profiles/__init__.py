"""Board profiles: one validated YAML per board, auto-detection, and nvpmodel power modes.

    load_profile("jetson-orin-nano-8gb")   # -> DeviceProfile
    list_profiles()                         # -> ["generic-x86", "jetson-agx-orin-32gb", ...]
    detect_profile()                        # the profile of the machine we run on
"""

from __future__ import annotations

from pathlib import Path

from device_profiles.catalog import (
    PROFILE_DIR,
    ProfileError,
    list_profiles,
    load_profile,
    load_profile_file,
)
from device_profiles.schema import DeviceProfile


def detect_profile(root: Path = Path("/"), machine: str | None = None) -> DeviceProfile:
    """The profile of this machine, from the device tree (see ``device_profiles.detect``)."""
    from device_profiles.detect import detect

    return detect(root=root, machine=machine).profile


__all__ = [
    "PROFILE_DIR",
    "DeviceProfile",
    "ProfileError",
    "detect_profile",
    "list_profiles",
    "load_profile",
    "load_profile_file",
]
