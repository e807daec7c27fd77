"""``python fleet/learn/child.py PARENT_PID -- COMMAND...``: run an upstream command
(``hpc-train aggregate``, ``publish``) that dies with the controller that started it.

PR_SET_PDEATHSIG(SIGKILL) survives exec, so the command is killed the instant its controller
is (kill -9 included) and a restarted controller never finds the previous one still writing
the folder it is about to write. Set here, in the child, because ``subprocess``'s
``preexec_fn`` is unsafe in a process with threads (paho's network thread). Standard library
only: it starts in a few tens of milliseconds. Started by its path, not ``-m``: ``-m`` would
put the controller's working folder first on the module path.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: python fleet/learn/child.py PARENT_PID -- COMMAND...", file=sys.stderr)
        return 2
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != int(argv[0]):
        return 1  # the controller died before the signal was armed
    try:
        os.execvp(argv[2], argv[2:])
    except OSError as e:
        print(f"fleet.learn.child: cannot run {argv[2]}: {e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
