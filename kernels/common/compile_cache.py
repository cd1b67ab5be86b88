# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compiled kernels kept on disk between processes.

An engine start compiles every kernel variant its plan launches, each
``cute.compile`` ~0.5-3 s of one host CPU core. The prepared kernels compile
through ``compile_kernel``; with a directory configured (``configure``), each
compile is also written there as the object file CuTe DSL exports (the host
launch code with the cubin inside, ``dump_to_object``), and a later process
loads it (``cute.runtime.load_module``, milliseconds) instead of compiling.

An entry's file name is a digest of everything its compile depends on: the
caller's variant key, the kernel class, the source of every file of this
kernels package, the CuTe DSL version, the GPU it compiles for, the host CPU
(the launch code is built for it) and the ``CUTE_DSL_*`` environment. So an
edit to any kernel gives every entry a new name, and nothing is ever looked up
by a stale key. An entry that fails to load is compiled again and replaced; a
file is written under a temporary name and renamed, so processes sharing the
directory never read half of one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import cutlass
import cutlass.cute as cute
import torch

logger = logging.getLogger(__name__)

# The package whose sources name the entries: kernels/ here, cutedsl/ in vLLM.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
ENTRY_SUFFIX = ".o"


@dataclass
class CacheStats:
    """What the cache did in this process: entries loaded, compiled (and
    written), failed to load, failed to write."""

    loaded: int = 0
    compiled: int = 0
    load_failures: int = 0
    write_failures: int = 0


STATS = CacheStats()
_directory: Path | None = None
# The loaded modules own the code of the functions handed out: kept for the
# life of the process, as compiled functions are by the callers' caches.
_modules: list[object] = []


def configure(directory: str | os.PathLike | None) -> Path | None:
    """Keep compiled kernels in ``directory`` (created if missing); ``None``
    turns the cache off. Raises ``ValueError`` naming the path if it is not an
    absolute path to a writable directory."""
    global _directory
    if directory is None:
        _directory = None
        return None
    path = Path(directory)
    if not path.is_absolute():
        raise ValueError(f"kernel cache directory {str(path)!r} is not absolute")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"kernel cache directory {str(path)!r}: {err}") from err
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"kernel cache directory {str(path)!r} is not writable")
    _directory = path
    return path


def cache_directory() -> Path | None:
    """The configured directory, or None when the cache is off."""
    return _directory


def source_digest(root: Path = PACKAGE_ROOT) -> str:
    """sha256 over the relative path and bytes of every ``*.py`` under
    ``root``, in path order."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def _host_cpu() -> str:
    """The machine and, where /proc/cpuinfo has them, the first CPU's model
    and feature flags: the launch code may use any of them."""
    fields = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                name, _, value = line.partition(":")
                if name.strip() in ("model name", "flags"):
                    fields.append(value.strip())
                if not line.strip() and len(fields) > 1:
                    break
    except OSError:
        pass
    return "\n".join(fields)


@lru_cache(maxsize=1)
def _process_toolchain() -> str:
    """What every entry of this process depends on besides its key and GPU."""
    return "\n".join(
        (
            f"sources {source_digest()}",
            f"cutlass-dsl {cutlass.__version__}",
            f"host {_host_cpu()}",
        )
    )


def _gpu_target() -> str:
    cute_env = sorted(kv for kv in os.environ.items() if kv[0].startswith("CUTE_DSL_"))
    capability = (
        torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    )
    return f"gpu {capability} env {cute_env}"


def entry_digest(name: str, key: tuple) -> str:
    """The entry name of variant ``key`` of kernel ``name``. The key must print
    the same in every process (numbers, strings, tuples, dataclasses)."""
    text = repr((name, key))
    if " at 0x" in text:
        raise ValueError(
            f"kernel cache key of {name} prints an object address, which differs "
            f"from process to process: {text}"
        )
    digest = hashlib.sha256()
    for part in (text, _process_toolchain(), _gpu_target()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def compile_kernel(name: str, key: tuple, kernel: object, *args: object) -> object:
    """``cute.compile(kernel, *args)``, through the cache when one is
    configured. ``name`` and ``key`` identify the variant the same way the
    caller's in-process cache does."""
    if _directory is None:
        return cute.compile(kernel, *args)
    digest = entry_digest(f"{name}:{type(kernel).__qualname__}", key)
    path = _directory / f"{digest}{ENTRY_SUFFIX}"
    # The symbol prefix inside the object file: a C identifier.
    prefix = f"hd_{digest[:32]}"
    if path.is_file():
        try:
            module = cute.runtime.load_module(str(path))
            fn = getattr(module, prefix)
        except Exception as err:  # any failure: compile again, replace the file
            STATS.load_failures += 1
            logger.warning(
                "kernel cache: %s did not load (%s); compiling it again", path, err
            )
        else:
            _modules.append(module)
            STATS.loaded += 1
            return fn
    fn = cute.compile(kernel, *args)
    STATS.compiled += 1
    try:
        _write(path, fn.dump_to_object(prefix))
    except Exception as err:  # the compiled function still serves this process
        STATS.write_failures += 1
        logger.warning("kernel cache: could not write %s (%s)", path, err)
    return fn


def _write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=ENTRY_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
