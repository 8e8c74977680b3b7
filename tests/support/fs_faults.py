"""What a kill -9 or a power loss would leave of one directory, at every step of a real run.

``FileSystemRecorder`` watches one directory (a partition log's) while real code works on
real files in it. It intercepts, for the duration of a ``with`` block, the os-level calls
that change files or make them durable, and keeps a shadow model of the directory from
them; the calls themselves still run unchanged. Before every such call it reports a
``Step`` to ``on_step``, where a test can ask what a crash at that moment would leave
(``crash_image``, ``torn_image``, ``power_loss_image``). Images are plain ``{name:
bytes}`` maps; ``materialize`` writes one into another directory to be opened and
checked. Nothing of the code under test is replaced: only the outcome of a crash is
computed, from what the code really did.

Intercepted (the calls tidelog's storage engine makes; ``os`` functions are looked up at
call time, so replacing the module attributes reaches every caller):

- ``os.open`` with ``O_CREAT`` (a new name) or ``O_TRUNC``; ``builtins.open`` and
  ``io.open`` (pathlib's) in a writing mode;
- ``os.pwrite``, ``os.pwritev``, ``os.write`` (content), ``os.ftruncate``,
  ``os.truncate`` (size);
- ``os.rename``, ``os.replace``, ``os.unlink``, ``os.remove`` (names);
- ``os.fsync``, ``os.fdatasync`` on a file (its content becomes durable) or on the
  directory itself (its names become durable). Unless ``sync_to_disk``, these are not
  passed on to the kernel while the recorder is installed (for any file: the images'
  checks too), so a run does not wait for the disk; nothing the code under test sees
  changes.

The two models:

- **kill -9** (``crash_image``): the process stops before the step; the page cache
  survives, so the directory is exactly as the real files are now. ``torn_image`` adds a
  prefix of the write the step was about to make (a write interrupted midway). A step's
  "after" is the next step's "before".
- **power loss** (``power_loss_image``), strict POSIX with an ordered metadata journal:
  a file's content is what its last fsync made durable, plus any of the changes since,
  4 KiB page by page, with either the durable or the current size; a never-fsynced file
  is empty where nothing of it reached the disk (unwritten blocks read as zeros). Names
  (create, rename, unlink) are durable up to the last fsync of the directory, plus an
  in-order prefix of the later ones (ext4's and XFS's journals commit them in order).
  With no ``rng`` the image is the harshest one: no name change after the last
  directory fsync and no content change after each file's last fsync survives.

Limits (what the models do not cover):

- Content written through a Python file object (``open(...).write``) is not a step of
  its own: the opening is one (it creates or truncates), the writes are seen when the
  file is fsynced, renamed or unlinked. tidelog writes that way only whole ``*.tmp``
  files that are renamed into place afterwards.
- Writes through a writable ``mmap`` are not seen at all (tidelog maps its indexes
  read-only and writes them with ``pwrite``).
- Only the one directory is modelled. Its own entry in its parent is taken as durable,
  and so are files outside it (a data directory's checkpoint is the test's to model).
- Sub-directories, hard links and renames into or out of the directory are not
  modelled: they raise ``FaultModelError``. ``check_namespace`` compares the shadow
  with the real directory, so a change the interception missed fails loudly instead of
  making the images wrong.
- Within a power-loss image the pages of one file are chosen independently of each
  other and of other files; a size between the durable and the current one, sectors
  torn inside a page, and name changes committed out of order are not generated.
- Writes to a file after its last name is gone are not tracked (tidelog closes a file
  before it unlinks or retires it).

Not thread-safe: one recorder at a time, driven by one thread.
"""

from __future__ import annotations

import builtins
import io
import os
import random
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Final, NamedTuple

PAGE_BYTES: Final = 4096
"""The unit a power loss keeps or loses of a file written since its last fsync."""

Image = dict[str, bytes]
"""A directory as a crash left it: file name -> content."""

PathArg = str | bytes | os.PathLike[str] | os.PathLike[bytes]
Buffer = bytes | bytearray | memoryview


class FaultModelError(Exception):
    """The code under test did something the models do not cover (see the limits)."""


class StepKind(Enum):
    CREATE = "create"
    WRITE = "write"
    TRUNCATE = "truncate"
    RENAME = "rename"
    UNLINK = "unlink"
    FSYNC = "fsync"
    FSYNC_DIR = "fsync-dir"

    @property
    def changes_files(self) -> bool:
        """Whether a kill -9 image after this step can differ from one before it (an
        fsync changes only what a power loss keeps)."""
        return self not in (StepKind.FSYNC, StepKind.FSYNC_DIR)


@dataclass(frozen=True)
class PendingWrite:
    """A write about to happen: ``data`` at ``position`` of the file ``file_id``."""

    file_id: int
    position: int
    data: bytes


@dataclass(frozen=True)
class Step:
    """One intercepted call, reported before it runs. ``name`` is the file (the source
    of a rename), or "" for the directory."""

    number: int
    kind: StepKind
    name: str
    write: PendingWrite | None = None


class _NameChange(NamedTuple):
    """A change to the directory's names not yet made durable by a directory fsync."""

    kind: StepKind  # CREATE, RENAME or UNLINK
    name: str
    target: str = ""  # RENAME: the new name
    file_id: int = 0  # CREATE: the file


_InodeKey = tuple[int, int]  # (st_dev, st_ino)


class FileSystemRecorder:
    """The shadow of one directory; see the module docstring.

    Files are known by an id the recorder gives them at creation (inode numbers are
    reused, ids never). Invariant outside a call in progress: ``_names`` is the real
    directory's listing (``check_namespace``), and ``_durable_names`` plus ``_pending``
    replayed in order gives ``_names``.
    """

    def __init__(self, directory: Path, *, sync_to_disk: bool = False) -> None:
        self.on_step: Callable[[Step], None] | None = None
        # The models decide what is durable and the test machine is not about to lose
        # power: passing fsyncs on would only make a run as slow as the disk's flushes.
        self.sync_to_disk = sync_to_disk
        self.steps = 0
        self._dir = ""
        self._dir_key: _InodeKey = (0, 0)
        self._next_id = 0
        self._names: dict[str, int] = {}
        self._name_of: dict[int, str] = {}
        self._durable_names: dict[str, int] = {}
        self._pending: list[_NameChange] = []
        self._durable: dict[int, bytes] = {}  # content as of the file's last fsync
        self._detached: dict[int, bytes] = {}  # content when the file lost its name
        self._inodes: dict[_InodeKey, int] = {}
        self._in_callback = False
        directory.mkdir(parents=True, exist_ok=True)
        self._watch(directory)
        # What is there already is taken as durable: the run starts from a synced state.
        for entry in sorted(os.listdir(self._dir)):
            path = os.path.join(self._dir, entry)
            if not stat.S_ISREG(os.lstat(path).st_mode):
                raise FaultModelError(f"{path} is not a regular file")
            file_id = self._new_file(entry)
            self._inodes[_key(os.stat(path))] = file_id
            self._durable[file_id] = _read(path)
        self._durable_names = dict(self._names)

    @property
    def directory(self) -> Path:
        return Path(self._dir)

    def __enter__(self) -> FileSystemRecorder:
        _install(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _uninstall(self)

    # --- images -----------------------------------------------------------------------

    def crash_image(self) -> Image:
        """kill -9 now: the files as they are."""
        return {name: self._current(file_id) for name, file_id in self._names.items()}

    def torn_image(self, write: PendingWrite, written: int) -> Image:
        """kill -9 after the first ``written`` bytes of ``write`` reached the file."""
        image = self.crash_image()
        name = self._name_of.get(write.file_id)
        if name is None:
            return image
        content = bytearray(image[name])
        end = write.position + written
        if len(content) < end:
            content.extend(bytes(end - len(content)))
        content[write.position : end] = write.data[:written]
        image[name] = bytes(content)
        return image

    def power_loss_image(self, rng: random.Random | None = None) -> Image:
        """Power loss now; the harshest image without ``rng`` (see the module docstring)."""
        names = dict(self._durable_names)
        kept = 0 if rng is None else rng.randint(0, len(self._pending))
        for change in self._pending[:kept]:
            _apply(names, change)
        image: Image = {}
        for name, file_id in names.items():
            durable = self._durable.get(file_id, b"")
            if rng is None:
                image[name] = durable
                continue
            current = self._current(file_id)
            image[name] = _mix(durable, current, rng)
        return image

    # --- running on ---------------------------------------------------------------------

    def restart_in(self, directory: Path) -> None:
        """kill -9 now, and go on watching a copy of the directory in ``directory``.

        The copy is what the killed process left (its page cache, not yet durable, keeps
        the same durable state as the original), so a process started on it continues
        the run; the original can then be cleaned up without being recorded.
        """
        directory.mkdir(parents=True)
        copies = {name: self._current(file_id) for name, file_id in self._names.items()}
        materialize(copies, directory)
        self._watch(directory)
        self._inodes = {
            _key(os.stat(os.path.join(self._dir, name))): file_id
            for name, file_id in self._names.items()
        }

    def check_namespace(self) -> None:
        """Raise FaultModelError unless the shadow names are the real directory's."""
        real = {
            entry: _key(os.stat(os.path.join(self._dir, entry))) for entry in os.listdir(self._dir)
        }
        shadow = {name: self._inode_of(file_id) for name, file_id in self._names.items()}
        if real != shadow:
            raise FaultModelError(
                f"the recorder missed a change in {self._dir}: real {sorted(real)}, "
                f"recorded {sorted(shadow)} (an interception is missing, see fs_faults)"
            )

    # --- bookkeeping ----------------------------------------------------------------------

    def _watch(self, directory: Path) -> None:
        self._dir = os.path.abspath(directory)
        self._dir_key = _key(os.stat(self._dir))

    def _new_file(self, name: str) -> int:
        self._next_id += 1
        self._names[name] = self._next_id
        self._name_of[self._next_id] = name
        return self._next_id

    def _inode_of(self, file_id: int) -> _InodeKey | None:
        return next((key for key, fid in self._inodes.items() if fid == file_id), None)

    def _current(self, file_id: int) -> bytes:
        name = self._name_of.get(file_id)
        if name is None:
            return self._detached.get(file_id, b"")
        return _read(os.path.join(self._dir, name))

    def name_in_dir(self, path: PathArg | int) -> str | None:
        """The entry name when ``path`` is a file directly in the watched directory."""
        if isinstance(path, int):
            return None
        full = os.path.abspath(os.fsdecode(path))
        head, tail = os.path.split(full)
        return tail if head == self._dir and tail else None

    def _file_of_fd(self, fd: int) -> int | None:
        """The watched file ``fd`` is open on; None for anything else."""
        if self._in_callback:
            return None
        try:
            info = os.fstat(fd)
        except OSError:
            return None
        file_id = self._inodes.get(_key(info))
        if file_id is None:
            return None
        if file_id not in self._name_of and info.st_nlink > 0:
            # The watched file was unlinked and closed, and its inode number went to a
            # new file elsewhere.
            del self._inodes[_key(info)]
            return None
        return file_id

    def _is_dir_fd(self, fd: int) -> bool:
        try:
            info = os.fstat(fd)
        except OSError:
            return False
        return stat.S_ISDIR(info.st_mode) and _key(info) == self._dir_key

    def _step(self, kind: StepKind, name: str, write: PendingWrite | None = None) -> None:
        self.steps += 1
        if self.on_step is None:
            return
        self._in_callback = True
        try:
            self.on_step(Step(self.steps, kind, name, write))
        finally:
            self._in_callback = False

    # --- interception handlers (called by the hooks below) ----------------------------------

    def _before_open(self, name: str, creates: bool, truncates: bool) -> None:
        if creates:
            self._step(StepKind.CREATE, name)
        elif truncates:
            self._step(StepKind.TRUNCATE, name)

    def _after_open(self, name: str, fd: int, creates: bool) -> None:
        if creates:
            if name in self._names:
                raise FaultModelError(f"{name} was created twice without being removed")
            file_id = self._new_file(name)
            self._pending.append(_NameChange(StepKind.CREATE, name, file_id=file_id))
            self._inodes[_key(os.fstat(fd))] = file_id
        elif name not in self._names:
            raise FaultModelError(f"{name} exists but the recorder never saw it created")

    def _before_write(self, fd: int, position: int, buffers: Sequence[Buffer]) -> None:
        file_id = self._file_of_fd(fd)
        if file_id is not None:
            data = b"".join(bytes(buffer) for buffer in buffers)
            write = PendingWrite(file_id, position, data)
            self._step(StepKind.WRITE, self._name_of.get(file_id, ""), write)

    def _before_truncate(self, fd: int) -> None:
        file_id = self._file_of_fd(fd)
        if file_id is not None:
            self._step(StepKind.TRUNCATE, self._name_of.get(file_id, ""))

    def _detach(self, name: str) -> None:
        """``name`` is about to lose its file: keep the content a power loss may revive."""
        file_id = self._names[name]
        self._detached[file_id] = self._current(file_id)

    def _after_rename(self, source: str, target: str) -> None:
        file_id = self._names.pop(source)
        replaced = self._names.get(target)
        if replaced is not None:
            del self._name_of[replaced]
        self._names[target] = file_id
        self._name_of[file_id] = target
        self._pending.append(_NameChange(StepKind.RENAME, source, target=target))

    def _after_unlink(self, name: str) -> None:
        file_id = self._names.pop(name)
        del self._name_of[file_id]
        self._pending.append(_NameChange(StepKind.UNLINK, name))

    def _after_fsync(self, fd: int) -> None:
        if self._in_callback:
            return
        if self._is_dir_fd(fd):
            self._durable_names = dict(self._names)
            self._pending.clear()
            return
        file_id = self._file_of_fd(fd)
        if file_id is not None:
            # Through /proc: the descriptor may be write-only, the name may be gone.
            self._durable[file_id] = _read(f"/proc/self/fd/{fd}")

    def _before_fsync(self, fd: int) -> None:
        if self._in_callback:
            return
        if self._is_dir_fd(fd):
            self._step(StepKind.FSYNC_DIR, "")
            return
        file_id = self._file_of_fd(fd)
        if file_id is not None:
            self._step(StepKind.FSYNC, self._name_of.get(file_id, ""))


# --- images ------------------------------------------------------------------------------


def materialize(image: Image, directory: Path) -> None:
    """Write ``image``'s files into ``directory`` (created if needed)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in image.items():
        with _REAL_IO_OPEN(os.path.join(directory, name), "wb") as out:
            out.write(content)


def _mix(durable: bytes, current: bytes, rng: random.Random) -> bytes:
    """What a power loss leaves of a file durable as ``durable`` and now ``current``."""
    if durable == current:
        return durable
    choice = rng.random()
    if choice < 0.3:
        return durable
    if choice < 0.6:
        return current
    size = rng.choice((len(durable), len(current)))
    mixed = bytearray(size)  # blocks never written read as zeros
    for start in range(0, size, PAGE_BYTES):
        page = (current if rng.random() < 0.5 else durable)[start : start + PAGE_BYTES]
        mixed[start : start + len(page)] = page
    return bytes(mixed)


def _apply(names: dict[str, int], change: _NameChange) -> None:
    if change.kind is StepKind.CREATE:
        names[change.name] = change.file_id
    elif change.kind is StepKind.RENAME:
        if change.name in names:
            names[change.target] = names.pop(change.name)
    else:
        names.pop(change.name, None)


def _key(info: os.stat_result) -> _InodeKey:
    return info.st_dev, info.st_ino


def _read(path: str) -> bytes:
    with _REAL_IO_OPEN(path, "rb") as source:
        data: bytes = source.read()
        return data


# --- the hooks -----------------------------------------------------------------------------

_REAL_OS: Final[dict[str, Any]] = {
    name: getattr(os, name)
    for name in (
        "open",
        "pwrite",
        "pwritev",
        "write",
        "ftruncate",
        "truncate",
        "rename",
        "replace",
        "unlink",
        "remove",
        "fsync",
        "fdatasync",
    )
}
_REAL_IO_OPEN: Final = io.open
_REAL_BUILTIN_OPEN: Final = builtins.open


@dataclass
class _Hooks:
    active: FileSystemRecorder | None = None


_HOOKED: Final = _Hooks()  # the recorder the hooks report to, while one is installed


def _os_open(path: PathArg, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
    real = _REAL_OS["open"]
    recorder = _HOOKED.active
    if recorder is None or recorder._in_callback:
        return int(real(path, flags, mode, dir_fd=dir_fd))
    if dir_fd is not None:
        _refuse_relative_to_watched(recorder, dir_fd, "os.open")
        return int(real(path, flags, mode, dir_fd=dir_fd))
    name = recorder.name_in_dir(path)
    if name is None:
        return int(real(path, flags, mode))
    exists = os.path.lexists(path)
    creates = bool(flags & os.O_CREAT) and not exists
    recorder._before_open(name, creates, bool(flags & os.O_TRUNC) and exists)
    fd = int(real(path, flags, mode))
    recorder._after_open(name, fd, creates)
    return fd


def _refuse_relative_to_watched(recorder: FileSystemRecorder, dir_fd: int, call: str) -> None:
    """Calls relative to a directory descriptor (``shutil.rmtree``'s) are not modelled;
    only a problem when it is the watched directory's."""
    if recorder._is_dir_fd(dir_fd):
        raise FaultModelError(f"{call} relative to the watched directory")


def _io_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    recorder = _HOOKED.active
    writes = any(flag in mode for flag in "wxa+")
    name = recorder.name_in_dir(file) if recorder is not None and writes else None
    if recorder is None or name is None or recorder._in_callback:
        return _REAL_IO_OPEN(file, mode, *args, **kwargs)
    exists = os.path.lexists(file)
    creates = not exists and any(flag in mode for flag in "wxa")
    recorder._before_open(name, creates, "w" in mode and exists)
    opened = _REAL_IO_OPEN(file, mode, *args, **kwargs)
    recorder._after_open(name, opened.fileno(), creates)
    return opened


def _pwrite(fd: int, data: Buffer, position: int, /) -> int:
    if (recorder := _HOOKED.active) is not None:
        recorder._before_write(fd, position, [data])
    return int(_REAL_OS["pwrite"](fd, data, position))


def _pwritev(fd: int, buffers: Sequence[Buffer], position: int, flags: int = 0, /) -> int:
    if (recorder := _HOOKED.active) is not None:
        recorder._before_write(fd, position, buffers)
    return int(_REAL_OS["pwritev"](fd, buffers, position, flags))


def _write(fd: int, data: Buffer, /) -> int:
    recorder = _HOOKED.active
    if recorder is not None and recorder._file_of_fd(fd) is not None:  # (pipes cannot seek)
        recorder._before_write(fd, os.lseek(fd, 0, os.SEEK_CUR), [data])
    return int(_REAL_OS["write"](fd, data))


def _ftruncate(fd: int, length: int, /) -> None:
    if (recorder := _HOOKED.active) is not None:
        recorder._before_truncate(fd)
    _REAL_OS["ftruncate"](fd, length)


def _truncate(path: PathArg | int, length: int) -> None:
    recorder = _HOOKED.active
    if recorder is not None and not recorder._in_callback:
        if isinstance(path, int):
            recorder._before_truncate(path)
        elif (name := recorder.name_in_dir(path)) is not None:
            recorder._step(StepKind.TRUNCATE, name)
    _REAL_OS["truncate"](path, length)


def _renamer(real_name: str) -> Callable[..., None]:
    def rename(source: PathArg, target: PathArg, **kwargs: Any) -> None:
        real = _REAL_OS[real_name]
        recorder = _HOOKED.active
        if recorder is None or recorder._in_callback:
            real(source, target, **kwargs)
            return
        if kwargs:
            for dir_fd in kwargs.values():
                if dir_fd is not None:
                    _refuse_relative_to_watched(recorder, dir_fd, f"os.{real_name}")
            real(source, target, **kwargs)
            return
        old, new = recorder.name_in_dir(source), recorder.name_in_dir(target)
        if old is None and new is None:
            real(source, target)
            return
        if old is None or new is None:
            raise FaultModelError(f"rename across the watched directory: {source!r} -> {target!r}")
        if old not in recorder._names:
            real(source, target)  # fails, or check_namespace reports what it did
            return
        recorder._step(StepKind.RENAME, old)
        if new in recorder._names:
            recorder._detach(new)
        real(source, target)
        recorder._after_rename(old, new)

    return rename


def _unlinker(real_name: str) -> Callable[..., None]:
    def unlink(path: PathArg, *, dir_fd: int | None = None) -> None:
        real = _REAL_OS[real_name]
        recorder = _HOOKED.active
        if recorder is None or recorder._in_callback:
            real(path, dir_fd=dir_fd)
            return
        if dir_fd is not None:
            _refuse_relative_to_watched(recorder, dir_fd, f"os.{real_name}")
            real(path, dir_fd=dir_fd)
            return
        name = recorder.name_in_dir(path)
        if name is None:
            real(path)
            return
        if name not in recorder._names:
            real(path)  # fails, or check_namespace reports what it did
            return
        recorder._step(StepKind.UNLINK, name)
        recorder._detach(name)
        real(path)
        recorder._after_unlink(name)

    return unlink


def _syncer(real_name: str) -> Callable[[int], None]:
    def sync(fd: int, /) -> None:
        recorder = _HOOKED.active
        if recorder is not None:
            recorder._before_fsync(fd)
        if recorder is None or recorder.sync_to_disk:
            _REAL_OS[real_name](fd)
        if recorder is not None:
            recorder._after_fsync(fd)

    return sync


_HOOKS: Final[dict[str, Callable[..., Any]]] = {
    "open": _os_open,
    "pwrite": _pwrite,
    "pwritev": _pwritev,
    "write": _write,
    "ftruncate": _ftruncate,
    "truncate": _truncate,
    "rename": _renamer("rename"),
    "replace": _renamer("replace"),
    "unlink": _unlinker("unlink"),
    "remove": _unlinker("remove"),
    "fsync": _syncer("fsync"),
    "fdatasync": _syncer("fdatasync"),
}


def _install(recorder: FileSystemRecorder) -> None:
    if _HOOKED.active is not None:
        raise FaultModelError("one FileSystemRecorder at a time")
    _HOOKED.active = recorder
    for name, hook in _HOOKS.items():
        setattr(os, name, hook)
    builtins.open = _io_open
    io.open = _io_open


def _uninstall(recorder: FileSystemRecorder) -> None:
    if _HOOKED.active is not recorder:
        return
    for name, real in _REAL_OS.items():
        setattr(os, name, real)
    builtins.open = _REAL_BUILTIN_OPEN
    io.open = _REAL_IO_OPEN
    _HOOKED.active = None


@contextmanager
def recording(directory: Path, *, sync_to_disk: bool = False) -> Iterator[FileSystemRecorder]:
    """``with recording(path) as recorder:`` a recorder installed for the block."""
    with FileSystemRecorder(directory, sync_to_disk=sync_to_disk) as recorder:
        yield recorder
