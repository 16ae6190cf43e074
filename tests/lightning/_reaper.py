"""Runs a command as a child subreaper and records the exit status of every process of its tree (tests only).

``python _reaper.py OUT.json -- command ...``: the command's orphans (Lightning's launcher runs rank 1 as a
child of rank 0; it exits after rank 0) are re-parented to this process, which waits for them all and writes
``{"<pid>": {"status": exit status (negative: killed by that signal), "t": time.monotonic() at its exit}}``.
SIGINT does not stop this process (a Ctrl-C to the process group is meant for the command); its children
get the default handling back when they exec. Exits with the command's status. Linux only (``prctl``).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main() -> int:
    out, separator, *command = sys.argv[1:]
    assert separator == "--", "usage: _reaper.py OUT.json -- command ..."
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    proc = subprocess.Popen(command)  # reaped by os.wait below, with the rest of the tree
    first = proc.pid
    exits: dict[str, dict[str, float]] = {}
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        exits[str(pid)] = {"status": os.waitstatus_to_exitcode(status), "t": time.monotonic()}
    with open(out, "w") as stream:
        json.dump(exits, stream)
    return int(exits[str(first)]["status"]) % 256


if __name__ == "__main__":
    sys.exit(main())
