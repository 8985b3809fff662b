"""File operations on paths the allocation's user can write (its home, its volumes) that never follow
a symlink out of them: the agent runs as root, so a user who swaps a directory for a link to /etc
must not make the agent write, chown or delete there.

Every walk starts from a directory the agent owns and opens each component with O_NOFOLLOW |
O_DIRECTORY relative to the previous one (a link anywhere on the path fails with ELOOP/ENOTDIR);
files are created with O_NOFOLLOW; trees are chowned through fwalk with follow_symlinks=False and
removed with shutil.rmtree, which is fd-based on Linux (`rmtree.avoids_symlink_attacks`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

assert shutil.rmtree.avoids_symlink_attacks


class UnsafePath(OSError):
    pass


def path_parts(relative: str | Path) -> list[str]:
    """The components of a relative path (leading `/`, empty and `.` dropped); UnsafePath on `..`."""
    parts = [p for p in Path(str(relative)).parts if p not in ("/", "", ".")]
    if ".." in parts:
        raise UnsafePath(f"{relative!s}: '..' is not allowed")
    return parts


def open_dir(base: Path, relative: str | Path = "", *, create: bool = False, mode: int = 0o755) -> int:
    """An fd of base/relative reached without following any link below `base` (which the agent owns)."""
    fd = os.open(base, DIR_FLAGS)
    try:
        for part in path_parts(relative):
            if create:
                try:
                    os.mkdir(part, mode, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise UnsafePath(f"{base}/{relative}: {part!r} is not a plain directory ({exc.strerror})") from exc
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_file(base: Path, relative: str | Path, data: bytes, mode: int = 0o644) -> None:
    """Replace base/relative with `data` (write-and-rename inside the directory; no link is followed)."""
    parts = path_parts(relative)
    dfd = open_dir(base, Path(*parts[:-1]) if len(parts) > 1 else "")
    try:
        tmp = f".{parts[-1]}.gpuaas-tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
        try:
            os.write(fd, data)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)


def chown_tree(base: Path, relative: str | Path, uid: int, gid: int) -> None:
    """chown base/relative and everything below it; links are chowned themselves, never followed."""
    fd = open_dir(base, relative)
    try:
        os.chown(fd, uid, gid)
        for _, dirs, files, dfd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
            for name in dirs + files:
                try:
                    os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    pass
    finally:
        os.close(fd)


def make_link(base: Path, relative: str | Path, target: Path) -> Path:
    """A symlink at base/relative pointing to `target` (parents created without following links)."""
    parts = path_parts(relative)
    dfd = open_dir(base, Path(*parts[:-1]) if len(parts) > 1 else "", create=True)
    try:
        try:
            if os.readlink(parts[-1], dir_fd=dfd) == str(target):
                return base.joinpath(*parts)
            os.unlink(parts[-1], dir_fd=dfd)
        except FileNotFoundError:
            pass
        except OSError as exc:  # a real file or directory is there: leave the user's data alone
            raise UnsafePath(f"{base}/{relative} exists and is not a link") from exc
        os.symlink(target, parts[-1], dir_fd=dfd)
        return base.joinpath(*parts)
    finally:
        os.close(dfd)


def remove_link(base: Path, relative: str | Path) -> None:
    parts = path_parts(relative)
    try:
        dfd = open_dir(base, Path(*parts[:-1]) if len(parts) > 1 else "")
    except (UnsafePath, FileNotFoundError):
        return
    try:
        os.readlink(parts[-1], dir_fd=dfd)  # only a link is removed
        os.unlink(parts[-1], dir_fd=dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def rmtree(path: Path) -> None:
    """Remove a tree without following links (a link is removed, never its target)."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
