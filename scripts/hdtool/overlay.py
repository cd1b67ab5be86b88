"""What the overlay commit adds to the upstream tree: vllm_overlay/, kernels/ and build info.

Shared by apply (series.py) and the wheel build so both place exactly the same files.
"""

from __future__ import annotations

from pathlib import Path

from hdtool.pin import HdError, Pin, tracked_files

# kernels/ sub-trees that stay out of the vLLM tree (the kernels' own tests run from kernels/).
KERNELS_EXCLUDED_DIRS = ("tests",)


def overlay_plan(pin: Pin) -> dict[str, Path]:
    """Tree-relative path -> source file, for every file from vllm_overlay/ and kernels/.

    The generated build-info module is not included (see buildinfo.build_info_source).
    """
    plan: dict[str, Path] = {}
    for src in tracked_files(pin.root, "vllm_overlay"):
        plan[src.relative_to(pin.overlay_dir).as_posix()] = src
    dest = pin.kernels_dest.strip("/")
    for src in tracked_files(pin.root, "kernels"):
        rel = src.relative_to(pin.kernels_dir)
        if rel.parts[0] in KERNELS_EXCLUDED_DIRS:
            continue
        target = f"{dest}/{rel.as_posix()}"
        if target in plan:
            raise HdError(
                f"{target} comes from both vllm_overlay/ and kernels/; keep it in one of them"
            )
        plan[target] = src
    return plan


def reserved_paths(pin: Pin) -> tuple[set[str], tuple[str, ...]]:
    """(exact paths, directory prefixes) that belong to the overlay commit.

    Patches must not touch them and the upstream tree must not already have them.
    """
    exact = set(overlay_plan(pin)) | {pin.build_info_module}
    prefixes = (pin.kernels_dest.strip("/") + "/",)
    return exact, prefixes


def is_reserved(path: str, exact: set[str], prefixes: tuple[str, ...]) -> bool:
    return path in exact or path.startswith(prefixes) or path + "/" in prefixes


def collisions(pin: Pin, existing: set[str]) -> list[str]:
    """Overlay paths that clash with files in `existing` (an upstream tree's file list).

    A clash is the same path, an upstream file where the overlay needs a directory, an
    upstream directory where the overlay puts a file, or anything under the kernels dest.
    """
    exact, prefixes = reserved_paths(pin)
    existing_dirs: set[str] = set()
    for path in existing:
        parts = path.split("/")
        for n in range(1, len(parts)):
            existing_dirs.add("/".join(parts[:n]))
    problems: list[str] = []
    for path in sorted(exact):
        if path in existing:
            problems.append(f"{path} already exists upstream")
            continue
        if path in existing_dirs:
            problems.append(f"{path} is a directory upstream")
            continue
        parts = path.split("/")
        for n in range(1, len(parts)):
            parent = "/".join(parts[:n])
            if parent in existing:
                problems.append(f"{path}: {parent} is a file upstream")
                break
    for path in sorted(existing):
        if path.startswith(prefixes) and path not in exact:
            problems.append(f"{path} exists upstream inside the kernels destination")
    return problems
