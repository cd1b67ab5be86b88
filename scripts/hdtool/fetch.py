"""`fetch`: download the pinned upstream sdist and wheel through pip's index client.

`pip download` cannot be used for the sdist: it would build vLLM to read its metadata. We
ask pip's own PackageFinder (so the user's pip configuration applies: index-url,
extra-index-url, find-links, certificates, proxies) for the release's files and download the
exact file names the pin names. Every file is written to `<name>.part`, hashed, compared with
the pinned sha256 and only then renamed into the cache, so a bad download leaves nothing
behind. Files already in the cache are re-hashed, never re-downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hdtool.pin import HdError, Pin, sha256_file

Log = Callable[[str], None]
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# A download cut off midway (a reset connection, a stalled read) is tried again from the start;
# an HTTP answer below 500 (not found, forbidden) is final. pip's own retries cover only
# opening the connection.
DOWNLOAD_ATTEMPTS = 3
RETRY_PAUSE_S = 10.0


@dataclass(frozen=True)
class RemoteFile:
    filename: str
    url: str
    index_sha256: str | None  # the sha256 the index advertises, if it does


@dataclass(frozen=True)
class Release:
    version: str
    sdist: Path
    sdist_sha256: str
    wheel: Path
    wheel_sha256: str


# --- pip's index client -----------------------------------------------------------------------


class _Index:
    """pip's session + finder, configured from pip's config files and PIP_* variables."""

    def __init__(self) -> None:
        try:
            from pip._internal.commands import create_command
        except ImportError as e:  # pragma: no cover - pip is part of every supported Python
            raise HdError("pip is not importable; fetch uses pip's index client") from e
        with warnings.catch_warnings():
            # pip's internals import its deprecated pkg_resources shim; not ours to fix.
            warnings.simplefilter("ignore", DeprecationWarning)
            self._command = create_command("download")
            try:
                self._options, _ = self._command.parse_args(
                    ["--no-deps", "--no-cache-dir", "--ignore-requires-python"]
                )
            except SystemExit as e:
                raise HdError(f"pip rejected its configuration (exit {e.code}); see above") from e
            self.session = self._command._build_session(self._options)

    def candidates(self, name: str, target_wheel: str | None = None) -> list[Any]:
        """All of the index's candidates for `name` (wheels only those matching the tags of
        `target_wheel`'s file name, or tags related to them, see _target_for)."""
        target = _target_for(target_wheel) if target_wheel else None
        finder = self._command._build_package_finder(
            options=self._options,
            session=self.session,
            target_python=target,
            ignore_requires_python=True,
        )
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                return list(finder.find_all_candidates(name))
        except Exception as e:  # network errors surface here with pip's message
            raise HdError(f"cannot list {name} on the package index: {e}") from e

    def download(self, remote: RemoteFile, dest: Path, expected_sha256: str, log: Log) -> None:
        """Stream remote to dest.part, check sha256, then rename to dest."""
        from pip._internal.network.utils import HEADERS, response_chunks

        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + ".part")
        started = time.monotonic()
        log(f"downloading {remote.filename} from {_redact(remote.url)}")
        for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
            digest = hashlib.sha256()
            size = 0
            try:
                with self.session.get(remote.url, headers=HEADERS, stream=True) as response:
                    response.raise_for_status()
                    with open(part, "wb") as fh:
                        for chunk in response_chunks(response, 1 << 20):
                            fh.write(chunk)
                            digest.update(chunk)
                            size += len(chunk)
                break
            except BaseException as e:
                part.unlink(missing_ok=True)
                if not isinstance(e, Exception):
                    raise
                status = getattr(getattr(e, "response", None), "status_code", None)
                final = status is not None and status < 500
                if final or attempt == DOWNLOAD_ATTEMPTS:
                    tries = "" if attempt == 1 else f" ({attempt} attempts)"
                    raise HdError(f"downloading {remote.filename} failed{tries}: {e}") from e
                log(
                    f"  downloading {remote.filename} failed ({e}); attempt {attempt + 1} of "
                    f"{DOWNLOAD_ATTEMPTS} in {RETRY_PAUSE_S:.0f} s"
                )
                time.sleep(RETRY_PAUSE_S)
        actual = digest.hexdigest()
        if actual != expected_sha256:
            part.unlink(missing_ok=True)
            raise HdError(
                f"sha256 mismatch for {remote.filename} from {_redact(remote.url)}:\n"
                f"  expected {expected_sha256}\n"
                f"  actual   {actual}\n"
                "Nothing was written. If the index serves a different file than the one pinned, "
                "do not use it; if the pin in VERSION is wrong, correct it (a new upstream release "
                "is fetched with `python3 scripts/hd.py fetch --version X`, which prints hashes)."
            )
        os.replace(part, dest)
        seconds = time.monotonic() - started
        log(f"  {size / 1e6:.1f} MB in {seconds:.1f} s, sha256 {actual}")


def _redact(url: str) -> str:
    return re.sub(r"//[^/@]*@", "//***@", url)


def _target_for(wheel_filename: str) -> Any:
    """A pip TargetPython that accepts the tags of wheel_filename, with any newer glibc.

    pip filters wheels by the running interpreter's tags; the pinned wheel is for another
    platform than this machine may be (and a later release may move to a newer manylinux).
    """
    from pip._internal.models.target_python import TargetPython
    from pip._vendor.packaging.utils import InvalidWheelFilename, parse_wheel_filename

    try:
        _, _, _, tags = parse_wheel_filename(wheel_filename)
    except InvalidWheelFilename as e:
        raise HdError(f"{wheel_filename} is not a wheel file name: {e}") from e
    tag = sorted(tags, key=str)[0]
    digits = re.sub(r"^[a-z]+", "", tag.interpreter) or "3"
    version_info = (int(digits[0]), int(digits[1:])) if len(digits) > 1 else (int(digits),)
    platforms = [tag.platform]
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", tag.platform)
    if m:
        arch = m[3]
        platforms = [f"manylinux_2_{n}_{arch}" for n in range(60, 4, -1)]
        platforms += [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]
    return TargetPython(
        platforms=platforms,
        py_version_info=version_info,
        abis=[tag.abi],
        implementation=tag.interpreter[:2],
    )


def _index_sha256(link: Any) -> str | None:
    if getattr(link, "hash_name", None) == "sha256" and link.hash:
        return str(link.hash).lower()
    hashes = getattr(link, "_hashes", None) or {}
    value = hashes.get("sha256")
    return value.lower() if value else None


def _version_matches(candidate: Any, version: str) -> bool:
    from pip._vendor.packaging.version import InvalidVersion, Version

    try:
        return candidate.version == Version(version)
    except InvalidVersion:
        return str(candidate.version) == version


def _remote(candidate: Any) -> RemoteFile:
    link = candidate.link
    return RemoteFile(link.filename, link.url_without_fragment, _index_sha256(link))


def _find_file(candidates: list[Any], filename: str, expected: str | None) -> RemoteFile:
    """The candidate named filename, preferring one whose advertised hash is expected."""
    found = [_remote(c) for c in candidates if c.link.filename == filename]
    if not found:
        raise HdError(f"the package index has no file {filename}")
    for remote in found:
        if expected and remote.index_sha256 == expected:
            return remote
    return found[0]


# --- the pin ----------------------------------------------------------------------------------


def _check_pinned_hash(label: str, value: str) -> None:
    if not _SHA256.match(value):
        raise HdError(f"VERSION: {label} is not a lowercase hex sha256: {value!r}")


def _verify_cached(path: Path, expected: str) -> bool:
    """True if path is cached with the expected hash; HdError if cached with another."""
    if not path.is_file():
        return False
    actual = sha256_file(path)
    if actual != expected:
        raise HdError(
            f"cached {path} does not match VERSION:\n"
            f"  expected {expected}\n  actual   {actual}\n"
            f"Delete it (rm {path}) to download it again, or fix the pin in VERSION."
        )
    return True


def _ensure_pinned(pin: Pin, labels: tuple[str, ...], log: Log) -> list[Path]:
    pinned = {
        "sdist": (pin.sdist, pin.sdist_sha256),
        "wheel": (pin.wheel, pin.wheel_sha256),
    }
    for label in labels:
        _check_pinned_hash(f"{label}_sha256", pinned[label][1])
    paths = []
    index: _Index | None = None
    for label in labels:
        filename, sha = pinned[label]
        path = pin.cache_dir / filename
        if _verify_cached(path, sha):
            log(f"{filename}: cached, sha256 ok")
        else:
            index = index or _Index()
            candidates = index.candidates(
                pin.upstream_name, target_wheel=filename if label == "wheel" else None
            )
            index.download(_find_file(candidates, filename, sha), path, sha, log)
        paths.append(path)
    return paths


def ensure_upstream_files(pin: Pin, log: Log = print) -> tuple[Path, Path]:
    """(sdist, wheel) of the pinned release in pin.cache_dir, downloaded if needed, both
    checked against the sha256 in VERSION before this returns."""
    sdist, wheel = _ensure_pinned(pin, ("sdist", "wheel"), log)
    return sdist, wheel


def ensure_upstream_sdist(pin: Pin, log: Log = print) -> Path:
    """The pinned sdist alone (import needs no wheel), verified like ensure_upstream_files."""
    return _ensure_pinned(pin, ("sdist",), log)[0]


def fetch_release(pin: Pin, version: str, log: Log = print) -> Release:
    """Fetch another upstream release (for a rebase): its sdist and the wheel with the pinned
    wheel's tags. Hashes come from the index (the pin does not know them) and are checked."""
    if version == pin.upstream_version:
        sdist, wheel = ensure_upstream_files(pin, log)
        return Release(version, sdist, pin.sdist_sha256, wheel, pin.wheel_sha256)
    index = _Index()
    sdists = [
        c
        for c in index.candidates(pin.upstream_name)
        if _version_matches(c, version) and c.link.filename.endswith((".tar.gz", ".zip"))
    ]
    wheels = [
        c
        for c in index.candidates(pin.upstream_name, target_wheel=pin.wheel)
        if _version_matches(c, version) and c.link.filename.endswith(".whl")
    ]
    if not sdists or not wheels:
        what = " and no ".join(
            k for k, v in (("sdist", sdists), ("matching wheel", wheels)) if not v
        )
        raise HdError(f"the package index has no {what} for {pin.upstream_name}=={version}")
    same_tags = pin.wheel.split("-", 2)[2]  # e.g. cp38-abi3-manylinux_2_28_x86_64.whl
    wheels.sort(key=lambda c: (not c.link.filename.endswith(same_tags), c.link.filename))
    files = []
    for candidate in (sdists[0], wheels[0]):
        remote = _remote(candidate)
        path = pin.cache_dir / remote.filename
        if remote.index_sha256 is None:
            raise HdError(f"the index gives no sha256 for {remote.filename}; cannot verify it")
        if not _verify_cached(path, remote.index_sha256):
            index.download(remote, path, remote.index_sha256, log)
        else:
            log(f"{remote.filename}: cached, sha256 ok")
        files.append((path, remote.index_sha256))
    return Release(version, files[0][0], files[0][1], files[1][0], files[1][1])


# --- CLI --------------------------------------------------------------------------------------


def _cmd_fetch(args: argparse.Namespace, pin: Pin) -> int:
    started = time.monotonic()
    if args.version and args.version != pin.upstream_version:
        release = fetch_release(pin, args.version)
        print(f"fetched {pin.upstream_name} {release.version} into {pin.cache_dir}")
        print("# for VERSION's [upstream] table when moving the pin:")
        print(f'version = "{release.version}"')
        print(f'sdist = "{release.sdist.name}"')
        print(f'sdist_sha256 = "{release.sdist_sha256}"')
        print(f'wheel = "{release.wheel.name}"')
        print(f'wheel_sha256 = "{release.wheel_sha256}"')
    else:
        sdist, wheel = ensure_upstream_files(pin)
        print(f"fetch: {sdist.name} and {wheel.name} verified in {pin.cache_dir}")
    print(f"fetch: done in {time.monotonic() - started:.1f} s")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fetch",
        help="download and verify the pinned upstream sdist and wheel",
        description="Download the pinned upstream sdist and wheel through pip's index client "
        "into .cache/upstream/, checking each sha256 from VERSION before it is kept. "
        "Cached files are re-hashed instead of downloaded again.",
    )
    p.add_argument(
        "--version",
        help="fetch another upstream release (e.g. for a rebase); prints its hashes",
    )
    p.set_defaults(func=_cmd_fetch)
