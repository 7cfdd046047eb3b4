"""Clean-up for the bare back end, used only where no namespace could be created (e.g. root in a
container without CAP_SYS_ADMIN): the run shares the host's process table and /tmp, so what it
left must be found and removed.

- Processes: with a cgroup, everything in it is killed (cgroups.Slot.kill). Without one, every
  process of the run's own uid: `kill -9 -1` run as that uid reaches exactly those, setsid() or
  not; this needs a scan of /proc to know when they are gone, which is what made a run cost ~4x
  a bare subprocess before the pid namespace replaced it. The caller is made a child subreaper so
  that the orphans it kills are its own to reap (a container's PID 1 often never reaps).
- Files: what that uid left at the top of /tmp, /var/tmp and /dev/shm.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from asyncrl.reward.sandbox import rootfs
from asyncrl.reward.sandbox.cleanup import remove_tree

SHARED_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
PR_SET_CHILD_SUBREAPER = 36
KILL = shutil.which("kill", path="/usr/bin:/bin") or "/bin/kill"
_subreaper_pid = 0  # the process that made itself a subreaper (forked children are not)


def become_subreaper() -> None:
    global _subreaper_pid
    if _subreaper_pid != os.getpid():
        rootfs.libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        _subreaper_pid = os.getpid()


def processes_of(uid: int, zombies: bool = False) -> list[tuple[int, int]]:
    """(pid, parent pid) of the processes whose real uid is `uid`; zombies only when asked."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue  # exited while we looked
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("Uid", "").split()[:1] == [str(uid)]:
            if zombies or not fields.get("State", "").strip().startswith("Z"):
                found.append((int(name), int(fields.get("PPid", "0"))))
    return found


def kill_uid(uid: int) -> None:
    for attempt in range(100):
        if not processes_of(uid):
            return
        subprocess.run([KILL, "-9", "--", "-1"], user=uid, group=uid, extra_groups=[], env={},
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.001 * attempt)


def reap_orphans(uid: int) -> None:
    for pid, ppid in processes_of(uid, zombies=True):
        if ppid == os.getpid():
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def remove_leftovers(uid: int, keep: Path) -> None:
    keep_id = (keep.stat().st_dev, keep.stat().st_ino)  # the caller's run directory may sit in /tmp
    for top in SHARED_TMP_DIRS:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
                if st.st_uid == uid and (st.st_dev, st.st_ino) != keep_id:
                    remove_tree(entry.path)
            except OSError:
                pass  # gone already, or a directory it made that root cannot remove
