"""One error hierarchy for the registry and the device's model storage.

Every class carries the exit code a command line reports for it, so ``hpc-train publish``,
``agentctl pull`` and the daemon map errors the same way without a table of their own:

    1  network or registry failure (worth retrying later)
    2  bad reference, arguments, key file or device state the user must fix
    3  refused: the bytes or the signature are not trusted (the active model is untouched)
    4  not enough disk
    5  another process holds the device's state lock
"""

from __future__ import annotations


class RegistryError(Exception):
    """Base of every registry and storage error."""

    exit_code = 1


# -- 1: network and registry failures ---------------------------------------------------------


class StoreError(RegistryError):
    """A registry request failed in a way that retrying will not fix."""


class StoreNotFoundError(StoreError):
    """The object does not exist in the registry."""


class StoreConflictError(StoreError):
    """The registry refused a write that conflicts with what it holds (HTTP 409): the object
    exists with other bytes, or the version's sequence was taken meanwhile."""


class StoreTransientError(StoreError):
    """A network or server hiccup: worth retrying after a back-off."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SlowTransferError(StoreTransientError):
    """The server sent less than the minimum rate over a whole window (it drips bytes)."""


class FetchFailedError(RegistryError):
    """A request kept failing through every retry, or ran out of its deadline."""


class DeadlineExceededError(FetchFailedError):
    """A request (with its retries) took longer than its total deadline."""


# -- 2: bad input ----------------------------------------------------------------------------


class UsageError(RegistryError):
    """Input the user must fix: a reference, a key file, a version name, device state."""

    exit_code = 2


class RefError(UsageError):
    """The model reference cannot be resolved."""


class KeyFileError(UsageError):
    """A key file that is missing, unreadable, of the wrong type or too open."""


class PublishError(UsageError):
    """The version could not be published (bad input or registry state)."""


class VersionExistsError(PublishError):
    """Versions are immutable; this one is already in the registry."""


# -- 3: refused ------------------------------------------------------------------------------


class RefusedError(RegistryError):
    """A manifest, a signature or the bytes they describe were refused."""

    exit_code = 3


class InvalidManifestError(RefusedError):
    """The manifest does not parse or is inconsistent (bad JSON, schema, ranges)."""


class MalformedJsonError(InvalidManifestError):
    """JSON from outside that is too deep, holds absurd numbers or duplicate keys."""


class UnsafeNameError(RefusedError):
    """A tensor name or artefact path could escape its slot (``..``, absolute, odd characters)."""


class PickleRefusedError(RefusedError):
    """A file is (or is shaped like) a Python pickle; those run code when loaded."""


class NotSafetensorsError(RefusedError):
    """A model file is not a well-formed safetensors file."""


class IntegrityError(RefusedError):
    """Bytes do not match the hashes or sizes the signed manifest promises."""


class ChunkHashError(IntegrityError):
    def __init__(self, message: str, sha256: str) -> None:
        super().__init__(message)
        self.sha256 = sha256


class TensorHashError(IntegrityError):
    """A tensor's bytes assembled from verified chunks still hash differently."""


class TruncatedError(IntegrityError):
    """A chunk or file is shorter than the manifest says."""


class SpecMismatchError(RefusedError):
    """Tensor names, dtypes or shapes differ from the module the model spec builds."""


class ManifestMismatchError(RefusedError):
    """The signed manifest is for another name or version than the one requested."""


class DowngradeError(RefusedError):
    """The version's signed sequence is below the highest this device ever installed."""


class SignatureError(RefusedError):
    """The manifest's signature does not establish that a trusted key signed these bytes."""


class UnsignedManifestError(SignatureError):
    """There is no manifest.sig, or it is not a signature document."""


class UnknownKeyError(SignatureError):
    """Signed by a key that is not among the trusted keys."""


class BadSignatureError(SignatureError):
    """Signed by a trusted key id, but the bytes do not verify: tampered or corrupted."""


class KeyScopeError(SignatureError):
    """Signed by a trusted key that may not sign this model name or version."""


class LineageError(SignatureError):
    """A version signed by a device-scoped key that does not descend from a verified upstream
    release: it names no ``base``, or its base is missing, not upstream-signed, or not the
    release it claims. A device key can never make an upstream release."""


# -- 4: disk ---------------------------------------------------------------------------------


class InsufficientDiskError(RegistryError):
    exit_code = 4


class ResumeMismatchError(StoreTransientError):
    """A ranged request was answered for another range: the partial is dropped and refetched."""


# -- device storage (agent.storage) ----------------------------------------------------------


class SlotError(UsageError):
    """The device's model storage is not in a state that allows the operation."""


class NoActiveModelError(SlotError):
    pass


class NoPreviousVersionError(SlotError):
    pass


class NoStagedVersionError(SlotError):
    """commit() of a version that is not the one staged."""


class CorruptSlotError(SlotError):
    pass


class UnsafeStateError(RefusedError):
    """A symlink (or other non-regular entry) planted in the state directory (CWE-59)."""


class StateBusyError(SlotError):
    """Another process holds the state lock."""

    exit_code = 5
