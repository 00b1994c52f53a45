"""Atomic writing, for every writer of the package: an output is there whole, or as it was, never half-written.

atomic_file(path)             a temporary file beside `path` that replaces it only when complete
atomic_folder(output)         a temporary folder beside `output` that replaces it only when complete
replace_files(folder, files)  several files of a folder replaced together, rolled back on an error
remove_folder(folder)         renamed away first, then deleted: other processes see it whole or not at all

What they write gets the permissions a plain `open` gives (`0o666 & ~umask`, folders `0o777 & ~umask`), not the
private ones of `tempfile` or of transformers' safetensors files (0o600). A failed or interrupted write leaves no
temporary file or folder behind. Light: the standard library only (`training.resume` imports it before torch).
"""

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def current_umask() -> int:
    umask = os.umask(0)  # reading the umask means setting it: put it back at once
    os.umask(umask)
    return umask


def normal_permissions(folder: Path) -> None:
    """Files 0o666 and folders 0o777 minus the umask, under `folder` (transformers writes safetensors files 0o600)."""
    umask = current_umask()
    for path in Path(folder).rglob("*"):
        if path.is_symlink():  # chmod follows links: what one points to is not ours to change
            continue
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success it replaces `path` (normal permissions), on error it is
    removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes it private
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@contextmanager
def atomic_folder(
    output: Path, *, staging: Path | None = None, replace: bool = True, last: Callable[[Path], None] | None = None
) -> Iterator[Path]:
    """Yield a fresh temporary folder next to `output`; on success its contents get normal permissions and it
    replaces `output`; on any error it is removed (with the parent folders this call created, when left empty).

    staging: an existing folder beside `output` to use as the temporary one (several processes wrote into it under a
    name they all know). replace=False: an `output` that exists at the end is kept and the rename fails (`OSError`),
    e.g. when another process prepared the same folder first. last: called with the temporary folder after the
    permission pass, just before the swap, to move whole folders in as they are (a run's checkpoints)."""
    output = Path(output)
    created = [p for p in [output.parent, *output.parent.parents] if not p.exists()]
    output.parent.mkdir(parents=True, exist_ok=True)
    if staging is None:
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    else:
        tmp = Path(staging)
    old = output.with_name(f".{output.name}.old-{secrets.token_hex(4)}")
    try:
        yield tmp
        tmp.chmod(0o777 & ~current_umask())  # mkdtemp makes it private; the output folder should not be
        normal_permissions(tmp)
        if last is not None:
            last(tmp)
        if replace and output.exists():  # --overwrite: swap only now that the new folder is complete
            output.rename(old)
        tmp.rename(output)
    except BaseException:
        if old.exists() and not output.exists():  # interrupted between the two renames: restore the old folder
            old.rename(output)
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in created:  # the parent folders we created, innermost first, unless something else is in them
            with contextlib.suppress(OSError):  # (healing's progress, kept for the next run, lives beside the output)
                folder.rmdir()
        raise
    shutil.rmtree(old, ignore_errors=True)


def remove_folder(folder: Path) -> None:
    """Rename first (one atomic step: other processes see the folder whole or not at all), then delete."""
    folder = Path(folder)
    doomed = folder.with_name(f".removing-{folder.name}")
    folder.rename(doomed)
    shutil.rmtree(doomed)


def replace_files(folder: Path, files: dict[str, bytes]) -> None:
    """Replace several files of `folder` together: each new content is written and synced under a temporary name
    first, then all are renamed over the old ones (kept as hard links until the end); an error or Ctrl-C during the
    renames renames the old ones back. So the folder is left as it was or fully replaced, and nothing else in it
    (the weights) is touched: same bytes, same inode. A replaced file keeps its permissions; a new one gets the
    umask's."""
    folder = Path(folder)
    staged, backups, swapped = {}, {}, []
    try:
        for name, data in files.items():
            staged[name] = _stage(folder / name, data)
            if (folder / name).exists():
                backups[name] = _backup(folder / name)
        for name, tmp in staged.items():
            os.replace(tmp, folder / name)
            swapped.append(name)
        _sync(folder)
    except BaseException:
        for name in reversed(swapped):
            if name in backups:
                os.replace(backups.pop(name), folder / name)
            else:
                os.remove(folder / name)
        raise
    finally:
        for leftover in (*staged.values(), *backups.values()):
            if os.path.lexists(leftover):
                os.remove(leftover)


def _temporary_name(path: Path, kind: str) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.{kind}")  # hidden: `push` skips it


def _stage(path: Path, data: bytes) -> Path:
    """`data` in a new file next to `path`, synced, with `path`'s permissions (or the umask's for a new file)."""
    tmp = _temporary_name(path, "new")
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~current_umask()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(tmp, mode)  # os.open applies the umask to `mode`; the old file's permissions win
    return tmp


def _backup(path: Path) -> Path:
    backup = _temporary_name(path, "old")
    try:
        os.link(path, backup)  # no copy: the old file stays reachable under a second name
    except OSError:  # a file system without hard links
        shutil.copy2(path, backup)
    return backup


def _sync(folder: Path) -> None:
    """Make the renames durable (POSIX: sync the folder's entry list); skipped where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
