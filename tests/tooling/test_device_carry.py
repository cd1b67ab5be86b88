"""What a device call carries: the working tree beside one bundle part (64 MiB in all)."""

import importlib.util
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("slim_bundle", ROOT / "ci/gpu/slim_bundle.py")
slim_bundle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(slim_bundle)

# install.sh travels with every part; 64 KiB is far more than it holds.
INSTALL_SCRIPT_ROOM = 64 * 1024


def test_travelling_bytes_counts_tracked_and_unignored_files(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    ignore_rules = b"/ignored/\n"
    (tmp_path / ".gitignore").write_bytes(ignore_rules)  # untracked, not ignored
    (tmp_path / "tracked.txt").write_bytes(b"x" * 1000)
    (tmp_path / "gone.txt").write_bytes(b"y" * 500)
    git("add", "tracked.txt", "gone.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "t")
    (tmp_path / "gone.txt").unlink()
    (tmp_path / "new.txt").write_bytes(b"z" * 200)
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big.bin").write_bytes(b"w" * 10_000)
    assert slim_bundle.travelling_bytes(tmp_path) == 1000 + 200 + len(ignore_rules)


def test_working_tree_leaves_room_for_a_vllm_bundle_part():
    """`make gpu-bundle`'s and `make gpu-bundle-kernels`' parts must fit one device call
    beside this tree: a tree that grows past the room fails every copy of every bundle on
    the GPU host."""
    sizes = re.findall(r"--part-mib (\d+)", (ROOT / "Makefile").read_text())
    assert len(sizes) == 2, "one --part-mib for each bundle target"
    part_mib = max(int(size) for size in sizes)
    room = (slim_bundle.DEVICE_CALL_MIB - part_mib) * 2**20 - INSTALL_SCRIPT_ROOM
    tree = slim_bundle.travelling_bytes(ROOT)
    assert tree <= room, (
        f"the working tree is {tree / 2**20:.2f} MiB; beside a {part_mib} MiB bundle part a "
        f"device call has {room / 2**20:.2f} MiB for it: move run records or experiment "
        "patches out of the tree, or build smaller parts (Makefile's --part-mib)"
    )
