"""Which device uploads a round combines, each verified as a device verifies a pull.

The base is an upstream release (``hpc-train publish``). Its lineage is the chain of upstream
releases behind it, followed through ``parent`` links: staleness 0 is the base itself, 1 the
release before it, and so on (device versions on the chain are passed through, not counted).
An update is a device version whose ``parent`` is the upstream release named by its signed
``base`` (a direct fine-tune of a release) and whose release lies on that chain within
``--max-staleness``.

Each update is checked like ``registry.pull``: signature against the trusted keys, the key's
scope over ``NAME@VERSION``, the manifest's schema, names and tiling, the served name and
version (:func:`registry.pull.fetch_verified_manifest`); then against the base: the same model
spec and exactly the base's tensor names, dtypes and shapes. (Chunks are hashed later, in the
pass that reads them: ``hpc_core.aggregation.deltas``.) Whatever fails is skipped with its
reason, never combined.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from registry.errors import RefError, RegistryError, UsageError
from registry.manifest import MAX_MANIFEST_BYTES, Manifest
from registry.names import check_version, manifest_key
from registry.pull import fetch_verified_manifest
from registry.refs import Ref
from registry.signing import TrustedKey
from registry.stores import LocalStore, RegistryStore
from registry.transfer import TransferConfig, with_retries

SAMPLES_METRIC = "train/samples"
"""The manifest metric (``training.metrics``) that carries an update's training sample count."""

_MAX_CHAIN = 1024
"""Parent links followed at most (a chain of device versions between releases included)."""


@dataclass(frozen=True)
class Release:
    """An upstream release on the base's parent chain."""

    manifest: Manifest
    staleness: int


@dataclass(frozen=True)
class Update:
    """A verified device upload that passed every manifest check."""

    manifest: Manifest
    key: TrustedKey
    """The trusted key that verified it (not the signer the manifest claims)."""
    release: Release
    """The upstream release it was fine-tuned from: its delta is taken against this one."""

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def samples(self) -> float | None:
        value = self.manifest.training.metrics.get(SAMPLES_METRIC)
        return value if value is not None and math.isfinite(value) and value > 0 else None


@dataclass(frozen=True)
class Skipped:
    version: str
    reason: str


@dataclass
class Selection:
    base: Manifest
    lineage: list[Release]
    lineage_note: str | None
    """Why the chain stops short of --max-staleness, when it does."""
    updates: list[Update] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    ignored: dict[str, int] = field(default_factory=dict)
    """--updates auto: listed versions that are not this round's (reason -> count)."""


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def load_base(store: RegistryStore, name: str, version: str, trusted: dict[str, TrustedKey],
              cfg: TransferConfig) -> Manifest:
    """The verified base; a device-made version is refused (UsageError: exit 2)."""
    base = fetch_verified_manifest(store, Ref(name, version, store.uri), trusted, cfg).manifest
    if base.base is not None:
        raise UsageError(f"--base {name}@{version} is a device version (its base release is "
                         f"{base.base.version}): name an upstream release")
    return base


def lineage(
    store: RegistryStore, base: Manifest, max_staleness: int, trusted: dict[str, TrustedKey],
    cfg: TransferConfig,
) -> tuple[list[Release], str | None]:
    """The base and up to ``max_staleness`` upstream releases behind it, each verified."""
    chain = [Release(base, 0)]
    current, links = base, 0
    while len(chain) <= max_staleness:
        if current.parent is None:
            return chain, f"{current.ref} has no parent: the chain ends there"
        links += 1
        if links > _MAX_CHAIN:
            return chain, f"more than {_MAX_CHAIN} parent links: the chain is cut there"
        try:
            current = fetch_verified_manifest(
                store, Ref(base.name, current.parent, store.uri), trusted, cfg).manifest
        except RegistryError as e:
            return chain, f"parent {current.parent} of {current.ref} does not verify ({_why(e)})"
        if current.base is None:
            chain.append(Release(current, len(chain)))
    return chain, None


def _tensor_problem(m: Manifest, base: Manifest) -> str | None:
    want = {t.name: (t.dtype, t.shape) for t in base.tensors}
    have = {t.name: (t.dtype, t.shape) for t in m.tensors}
    problems = [f"missing tensor {k}" for k in sorted(set(want) - set(have))]
    problems += [f"unexpected tensor {k}" for k in sorted(set(have) - set(want))]
    problems += [
        f"tensor {k} is {have[k][0]}{list(have[k][1])}, the base's {want[k][0]}{list(want[k][1])}"
        for k in sorted(set(want) & set(have)) if want[k] != have[k]
    ]
    if not problems:
        return None
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


def _outside_round(m: Manifest, releases: dict[str, Release]) -> str | None:
    """Why ``m`` is not an update of this round at all (--updates auto leaves it out)."""
    if m.base is None:
        return "upstream release"
    if m.base.version not in releases:
        return "trained from a release outside --max-staleness"
    return None


def why_not_combinable(m: Manifest, base: Manifest, releases: dict[str, Release]) -> str | None:
    """Why a verified manifest cannot be combined into ``base``, or None when it may: it must
    be a direct fine-tune (its parent its base release) of a release in this round's reach,
    claiming that release's signed sequence, with the base's model spec and tensors."""
    outside = _outside_round(m, releases)
    if outside is not None:
        where = f"{m.base.version}, " if m.base is not None else ""
        return (f"not an update of {base.version}: {outside} ({where}releases in reach: "
                f"{', '.join(releases)})")
    assert m.base is not None
    release = releases[m.base.version].manifest
    if m.base.sequence != release.sequence:
        return (f"claims base {m.base.version} with sequence {m.base.sequence}; that release is "
                f"signed with sequence {release.sequence}")
    if m.parent != m.base.version:
        return (f"parent {m.parent} is not its base release {m.base.version} (a fine-tune of a "
                "fine-tune): only direct fine-tunes of a release are combined")
    if m.model != base.model:
        return (f"model spec {m.model.model_dump(mode='json')} differs from the base's "
                f"{base.model.model_dump(mode='json')}")
    problem = _tensor_problem(m, base)
    if problem is not None:
        return f"tensors differ from the base's: {problem}"
    if release is not base:
        problem = _tensor_problem(release, base)
        if problem is not None:
            return f"its release {release.version} has other tensors than the base: {problem}"
    return None


def listed_versions(store: RegistryStore, name: str) -> list[str]:
    """--updates auto: every version of ``name`` in a folder registry."""
    if not isinstance(store, LocalStore):
        raise UsageError(
            f"--updates auto lists versions, which only a folder registry can do; {store.uri} is "
            "read by key: name the device versions, --updates V1,V2,..."
        )
    return store.list_versions(name)


def parse_updates(text: str) -> list[str] | None:
    """'auto' -> None; 'V1,V2' -> the versions (ValueError on a bad or repeated one)."""
    if text.strip() == "auto":
        return None
    versions = [v.strip() for v in text.split(",") if v.strip()]
    if not versions:
        raise ValueError("--updates needs 'auto' or a comma-separated list of versions")
    for v in versions:
        check_version(v)
    if len(set(versions)) != len(versions):
        raise ValueError("--updates names a version twice")
    return versions


def _unverified(store: RegistryStore, name: str, version: str,
                cfg: TransferConfig) -> Manifest | None:
    try:
        key = manifest_key(name, version)
        data = with_retries(lambda d: store.get(key, MAX_MANIFEST_BYTES, d), cfg, f"GET {key}")
        return None if data is None else Manifest.from_bytes(data, f"{name}@{version}")
    except RegistryError:
        return None


def select(store: RegistryStore, base: Manifest, releases: list[Release], note: str | None,
           requested: list[str] | None, trusted: dict[str, TrustedKey],
           cfg: TransferConfig) -> Selection:
    """Verify and check each candidate; ``requested`` None: every listed version."""
    auto = requested is None
    versions = listed_versions(store, base.name) if requested is None else requested
    by_version = {r.manifest.version: r for r in releases}
    out = Selection(base, releases, note)
    for version in versions:
        if auto and version in by_version:
            continue
        try:
            verified = fetch_verified_manifest(
                store, Ref(base.name, version, store.uri), trusted, cfg)
        except RefError as e:
            out.skipped.append(Skipped(version, _why(e)))
            continue
        except RegistryError as e:
            # Unverifiable. --updates auto leaves out what is plainly not this round's; what
            # claims to be is reported, so an operator sees a device whose uploads fail.
            claimed = _unverified(store, base.name, version, cfg) if auto else None
            outside = _outside_round(claimed, by_version) if claimed is not None else None
            if outside is not None:
                out.ignored[outside] = out.ignored.get(outside, 0) + 1
            else:
                out.skipped.append(Skipped(version, _why(e)))
            continue
        m = verified.manifest
        outside = _outside_round(m, by_version)
        if auto and outside is not None:
            out.ignored[outside] = out.ignored.get(outside, 0) + 1
            continue
        reason = why_not_combinable(m, base, by_version)
        if reason is not None:
            out.skipped.append(Skipped(version, reason))
            continue
        assert m.base is not None
        out.updates.append(Update(m, verified.key, by_version[m.base.version]))
    return out
