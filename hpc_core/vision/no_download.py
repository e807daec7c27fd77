"""No weights are downloaded at run time: every downloader torchvision and timm reach is
refused while an ecosystem model is built.

The builders always pass ``weights=None`` / ``weights_backbone=None`` / ``pretrained=False``;
this guard makes a builder that would still fetch something (a timm model whose architecture
pulls a pretrained sub-network, a torchvision change of defaults) fail loudly with the fix,
instead of reaching the network from an upstream job or a device. Pretrained weights come from
a local file pinned by sha256 (``model.weights``, :mod:`hpc_core.vision.weights`).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

# (module, attribute) of each function that fetches weights. torch.hub's are imported by name
# into torchvision and timm, so each copy is replaced; modules not imported yet are skipped.
DOWNLOADERS: tuple[tuple[str, str], ...] = (
    ("torch.hub", "load_state_dict_from_url"),
    ("torch.hub", "download_url_to_file"),
    ("torch.utils.model_zoo", "load_url"),
    ("torchvision._internally_replaced_utils", "load_state_dict_from_url"),
    ("torchvision.models._api", "load_state_dict_from_url"),
    ("timm.models._builder", "load_state_dict_from_url"),
    ("timm.models._builder", "download_cached_file"),
    ("timm.models._builder", "load_state_dict_from_hf"),
    ("timm.models._builder", "load_custom_from_hf"),
    ("timm.models._hub", "download_url_to_file"),
    ("timm.models._hub", "hf_hub_download"),
    ("timm.models._hub", "download_cached_file"),
    ("timm.models._hub", "load_state_dict_from_hf"),
    ("timm.models._hub", "load_custom_from_hf"),
    ("huggingface_hub", "hf_hub_download"),
)

_lock = threading.RLock()


class DownloadRefused(RuntimeError):
    """A model builder tried to fetch weights from the network."""


def _refuser(model: str, where: str) -> Callable[..., NoReturn]:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        url = next((a for a in args if isinstance(a, str)), kwargs.get("url", "?"))
        raise DownloadRefused(
            f"model {model!r} tried to download weights ({where}: {url}); edgetrain never "
            "downloads at run time: build it without pretrained weights and give a local "
            "file instead, model.weights: {path: FILE.safetensors, sha256: HEX}"
        )

    return refuse


@contextlib.contextmanager
def downloads_refused(model: str) -> Iterator[None]:
    """While inside, every known weight downloader raises :class:`DownloadRefused` naming
    ``model`` and the ``model.weights`` fix."""
    with _lock:
        saved: list[tuple[Any, str, Any]] = []
        try:
            for module_name, attr in DOWNLOADERS:
                module = sys.modules.get(module_name)
                if module is None and module_name.startswith("torch."):
                    module = importlib.import_module(module_name)
                if module is None or not hasattr(module, attr):
                    continue
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, _refuser(model, f"{module_name}.{attr}"))
            yield
        finally:
            for module, attr, original in reversed(saved):
                setattr(module, attr, original)
