"""Fault a library's pages back into a process one page at a time.

``cold_pages`` unmaps library pages a fine-tune no longer needs; the ones its training step
does need come back on a minor fault. How much such a fault maps is the kernel's choice:
fault-around maps the neighbouring pages that are already in the page cache, 64 KB by
default, and Linux 6.18 maps the whole large folio around the page instead
("mm/filemap: map entire large folio faultaround"). ext4 keeps a file written in large
writes, which is how pip installs a wheel, in folios of up to 2 MB. So on a freshly installed
host a fine-tune's training step mapped 107 MB of ``libtorch_cpu.so`` where one whose page
cache had been filled by faults mapped 35 MB, and the same job needed ~70 MB more of its
memory budget on one host than on another.

A mapping registered with a userfaultfd in write-protect mode gets no fault-around at all
(the kernel's ``uffd_disable_fault_around``): a read fault maps the one page it needs (and
``MADV_NOHUGEPAGE`` keeps a 2 MB folio from being mapped whole by one PMD). With
``UFFD_FEATURE_WP_ASYNC`` (Linux 6.7) that mode is allowed on any mapping and the kernel
resolves write faults itself, without a handler thread; no page is ever write-protected here,
so the program sees no difference but the granularity of its faults. The descriptor is
opened ``UFFD_USER_MODE_ONLY`` (no privilege needed, and it cannot stall a fault taken inside
the kernel) and stays open for the life of the process: closing it would undo the
registration. A memory probe's library pages after its two training steps measured 13 MB on
a fresh install and on an older one alike, against 133 MB and 46 MB without it.

Where the kernel is older than 6.7, the architecture unknown, or a seccomp filter refuses the
call, ``register`` does nothing and says so once in the log; such a kernel's fault-around maps
64 KB, not whole folios. Linux only.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import threading

log = logging.getLogger(__name__)

_SYSCALL_USERFAULTFD = {"x86_64": 323, "aarch64": 282}
_UFFD_USER_MODE_ONLY = 1
_UFFD_API = 0xAA
_UFFD_FEATURE_WP_ASYNC = 1 << 15
_UFFDIO_REGISTER_MODE_WP = 1 << 1
_MADV_NOHUGEPAGE = 15


def _iowr(nr: int, size: int) -> int:
    """The kernel's _IOWR(0xAA, nr, size) for the userfaultfd ioctls."""
    return (3 << 30) | (size << 16) | (0xAA << 8) | nr


class _Api(ctypes.Structure):
    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64),
                ("ioctls", ctypes.c_uint64)]


class _Register(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64),
                ("mode", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


_UFFDIO_API = _iowr(0x3F, ctypes.sizeof(_Api))
_UFFDIO_REGISTER = _iowr(0x00, ctypes.sizeof(_Register))


class SinglePageFaults:
    """One userfaultfd for this process; ``register`` switches a mapping to one-page faults."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid: int | None = None  # the process that opened it
        self._libc: ctypes.CDLL | None = None

    def _open(self) -> int | None:
        nr = _SYSCALL_USERFAULTFD.get(platform.machine())
        if not sys.platform.startswith("linux") or nr is None:
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fd = int(libc.syscall(ctypes.c_long(nr), ctypes.c_int(
            os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY)))
        if fd < 0:
            log.info("one-page faults unavailable: userfaultfd: %s",
                     os.strerror(ctypes.get_errno()))
            return None
        api = _Api(_UFFD_API, _UFFD_FEATURE_WP_ASYNC, 0)
        if libc.ioctl(fd, _UFFDIO_API, ctypes.byref(api)) != 0:
            log.info("one-page faults unavailable: the kernel has no UFFD_FEATURE_WP_ASYNC "
                     "(Linux >= 6.7): %s", os.strerror(ctypes.get_errno()))
            os.close(fd)
            return None
        self._libc = libc
        return fd

    @property
    def available(self) -> bool:
        with self._lock:
            if self._pid != os.getpid():
                # First use, or a forked child: a userfaultfd acts on the address space of the
                # process that opened it, so a child's registrations would land in its parent.
                if self._fd is not None:
                    os.close(self._fd)
                self._pid, self._fd = os.getpid(), self._open()
            return self._fd is not None

    def register(self, start: int, end: int) -> bool:
        """Fault ``[start, end)`` (one whole mapping) one page at a time from now on; False
        where the kernel cannot (or the range is no longer one mapping)."""
        if not self.available:
            return False
        assert self._libc is not None and self._fd is not None
        # A folio of 2 MB aligned with the mapping is mapped by one page-table entry (a PMD)
        # whatever fault-around says; without huge pages it is mapped page by page.
        self._libc.madvise(start, end - start, _MADV_NOHUGEPAGE)
        reg = _Register(start, end - start, _UFFDIO_REGISTER_MODE_WP, 0)
        return self._libc.ioctl(self._fd, _UFFDIO_REGISTER, ctypes.byref(reg)) == 0


single_page_faults = SinglePageFaults()
