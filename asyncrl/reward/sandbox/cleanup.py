"""Removing what a run left on the host, whatever it wrote: remove_tree.

shutil.rmtree recurses once per directory level (a 3000-deep tree raises RecursionError) and
works on full paths (past 4096 bytes they fail with ENAMETOOLONG). remove_tree walks with one
open directory at a time, relative to its parent, never following a symlink, and gives itself
back the permissions a tree's owner may have taken away (chmod 000). Nothing may run in the tree
meanwhile (the run's processes are dead by then), so going back up through ".." is safe.
"""

from __future__ import annotations

import errno
import os
import stat

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str | os.PathLike) -> None:
    """Remove a directory and everything under it, iteratively; a missing path is no error."""
    try:
        fd = _open_dir(path, None)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno not in (errno.ENOTDIR, errno.ELOOP):  # a file or a symlink: just unlink it
            raise
        os.unlink(path)
        return
    names: list[str] = []  # the way down from `path`, one name per level
    pending = [_clear_files(fd)]  # per level: its subdirectories still to remove
    while True:
        if pending[-1]:
            child = pending[-1].pop()
            down = _open_dir(child, fd)
            os.close(fd)
            fd = down
            names.append(child)
            pending.append(_clear_files(fd))
            continue
        pending.pop()
        if not names:
            os.close(fd)
            os.rmdir(path)
            return
        up = os.open("..", _OPEN_DIR, dir_fd=fd)
        os.close(fd)
        fd = up
        os.rmdir(names.pop(), dir_fd=fd)


def _open_dir(name: str | os.PathLike, dir_fd: int | None) -> int:
    try:
        return os.open(name, _OPEN_DIR, dir_fd=dir_fd)
    except PermissionError:  # not root, and the tree's owner (us) took the permission away
        os.chmod(name, 0o700, dir_fd=dir_fd)
        return os.open(name, _OPEN_DIR, dir_fd=dir_fd)


def _clear_files(fd: int) -> list[str]:
    """Unlink everything in the directory that is not a directory; return its subdirectories."""
    try:
        os.fchmod(fd, 0o700)  # write and search permission for the unlinks (owner or root)
    except PermissionError:
        pass
    subdirs = []
    for entry in list(os.scandir(fd)):
        try:
            if stat.S_ISDIR(entry.stat(follow_symlinks=False).st_mode):
                subdirs.append(entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
    return subdirs
