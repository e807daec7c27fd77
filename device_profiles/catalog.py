"""The profiles shipped in this package: list, load by name, load a file; each validated."""

from __future__ import annotations

import difflib
from functools import cache
from pathlib import Path

from pydantic import ValidationError

from device_profiles.schema import DeviceProfile
from hpc_core.config import ConfigError, read_yaml

PROFILE_DIR = Path(__file__).resolve().parent


class ProfileError(Exception):
    """A profile that is missing, unreadable or invalid; the message says what to fix."""


def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


@cache
def load_profile(name: str) -> DeviceProfile:
    """The validated profile ``name`` (a file name in this package, without .yaml)."""
    path = PROFILE_DIR / f"{name}.yaml"
    if not path.is_file():
        close = difflib.get_close_matches(name, list_profiles(), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(list_profiles())}"
        raise ProfileError(f"no device profile {name!r} ({hint})")
    return load_profile_file(path)


def load_profile_file(path: Path) -> DeviceProfile:
    # The training configs' reader: YAML 1.2 (`off` stays a string), no duplicate keys.
    try:
        tree = read_yaml(path)
    except ConfigError as e:
        raise ProfileError(str(e)) from e
    if tree.get("name") != path.stem:
        raise ProfileError(f"{path}: name must equal the file name {path.stem!r}")
    try:
        return DeviceProfile.model_validate(tree)
    except ValidationError as e:
        # Reuse the training config's formatter: same "path: message (hint)" lines everywhere.
        from registry.validation import format_errors

        lines = "\n".join(format_errors(e, DeviceProfile))
        raise ProfileError(f"{path}: {e.error_count()} error(s)\n{lines}") from None
