"""fetch and import on synthetic releases served from a local file:// package index."""

from __future__ import annotations

import io
import tarfile

import pytest
from hdtest import (
    NAME,
    RELEASE_010,
    RELEASE_020,
    RELEASE_MTIME,
    WHEEL_TAGS,
    Index,
    Project,
    sha256,
    version_toml,
)

from hdtool import fetch
from hdtool.gitutil import IDENTITY_NAME, dirty_paths, git
from hdtool.pin import HdError
from hdtool.upstream import import_sdist

SDIST = f"{NAME}-0.1.0.tar.gz"
WHEEL = f"{NAME}-0.1.0-{WHEEL_TAGS}.whl"


def test_fetch_downloads_and_verifies_both_files(bare_project: Project, package_index: Index):
    result = bare_project.hd("fetch")
    assert result.rc == 0, result.text
    cache = bare_project.pin.cache_dir
    assert sorted(p.name for p in cache.iterdir()) == sorted([SDIST, WHEEL])  # no .part left
    for name in (SDIST, WHEEL):
        assert (cache / name).read_bytes() == package_index.files[name].read_bytes()


def test_fetch_rehashes_cached_files_instead_of_downloading(
    bare_project: Project, monkeypatch: pytest.MonkeyPatch
):
    assert bare_project.hd("fetch").rc == 0

    def no_index():
        raise AssertionError("the index must not be asked for cached files")

    monkeypatch.setattr(fetch, "_Index", no_index)
    result = bare_project.hd("fetch")
    assert result.rc == 0, result.text
    assert result.out.count("cached, sha256 ok") == 2


class _FlakySession:
    """pip's session whose first `failures` file downloads break off midway (a
    reset connection) or, with `status`, answer that HTTP status."""

    def __init__(self, session, failures: int, status: int | None = None):
        self.session, self.failures, self.status, self.calls = session, failures, status, 0

    def __getattr__(self, name):  # the finder's use of the session is left alone
        return getattr(self.session, name)

    def get(self, url, **kwargs):
        response = self.session.get(url, **kwargs)
        if not url.endswith((".whl", ".tar.gz")):  # the index's pages
            return response
        self.calls += 1
        if self.calls > self.failures:
            return response
        if self.status is not None:
            response.status_code = self.status
            return response
        response.raw.close()
        response.raw = _BrokenStream()
        return response


class _BrokenStream:
    """A response body that breaks off after its first bytes."""

    def stream(self, *args, **kwargs):
        yield b"partial"
        raise ConnectionResetError("connection reset by peer")

    def close(self):
        pass


@pytest.fixture
def flaky_index(monkeypatch: pytest.MonkeyPatch):
    """Makes fetch's index client use a _FlakySession (set `flaky_index.failures` and
    `.status` before fetching); no pause between attempts."""
    monkeypatch.setattr(fetch, "RETRY_PAUSE_S", 0.0)
    settings = {"failures": 0, "status": None, "sessions": []}
    real_init = fetch._Index.__init__

    def init(self):
        real_init(self)
        self.session = _FlakySession(self.session, settings["failures"], settings["status"])
        settings["sessions"].append(self.session)

    monkeypatch.setattr(fetch._Index, "__init__", init)
    return settings


def test_a_download_cut_off_midway_is_tried_again(bare_project: Project, package_index: Index,
                                                   flaky_index):  # fmt: skip
    flaky_index["failures"] = 2
    result = bare_project.hd("fetch")
    assert result.rc == 0, result.text
    assert result.out.count("attempt 2 of 3") == 1 and "attempt 3 of 3" in result.out
    cache = bare_project.pin.cache_dir
    assert sorted(p.name for p in cache.iterdir()) == sorted([SDIST, WHEEL])
    for name in (SDIST, WHEEL):
        assert (cache / name).read_bytes() == package_index.files[name].read_bytes()


def test_downloads_give_up_after_three_attempts_or_a_client_error(
    bare_project: Project, package_index: Index, flaky_index
):
    flaky_index["failures"] = 3
    result = bare_project.hd("fetch")
    assert result.rc == 2 and "failed (3 attempts)" in result.err
    assert not list(bare_project.pin.cache_dir.glob("*.part"))
    flaky_index.update(failures=1, status=404)
    result = bare_project.hd("fetch")
    assert result.rc == 2 and "failed: 404" in result.err, result.text
    assert flaky_index["sessions"][-1].calls == 1


def test_sdist_sha256_mismatch_aborts_before_writing(bare_project: Project, package_index: Index):
    wrong = "ab" * 32
    bare_project.write("VERSION", version_toml(package_index, sdist_sha256=wrong))
    result = bare_project.hd("fetch")
    assert result.rc == 2
    assert "sha256 mismatch" in result.err
    assert f"expected {wrong}" in result.err
    assert f"actual   {sha256(package_index.files[SDIST])}" in result.err
    cache = bare_project.pin.cache_dir
    assert not list(cache.glob("*")), "nothing may be cached after a mismatch"

    result = bare_project.hd("import")
    assert result.rc == 2
    assert "sha256 mismatch" in result.err
    assert not list(cache.glob("*"))
    assert not bare_project.repo.exists(), "no tree may be unpacked or imported"

    result = bare_project.hd("apply")
    assert result.rc == 2
    assert not bare_project.repo.exists()


def test_wheel_sha256_mismatch_keeps_no_wheel(bare_project: Project, package_index: Index):
    bare_project.write("VERSION", version_toml(package_index, wheel_sha256="cd" * 32))
    result = bare_project.hd("fetch")
    assert result.rc == 2
    assert f"sha256 mismatch for {WHEEL}" in result.err
    cache = bare_project.pin.cache_dir
    assert sorted(p.name for p in cache.iterdir()) == [SDIST]


def test_corrupt_cached_file_is_refused_not_used(bare_project: Project):
    assert bare_project.hd("fetch").rc == 0
    cached = bare_project.pin.cache_dir / SDIST
    cached.write_bytes(cached.read_bytes()[:-1] + b"X")
    result = bare_project.hd("fetch")
    assert result.rc == 2
    assert "does not match VERSION" in result.err
    assert f"rm {cached}" in result.err
    assert bare_project.hd("import").rc == 2
    assert not bare_project.repo.exists()


def test_malformed_pinned_hash_is_refused(bare_project: Project, package_index: Index):
    bare_project.write("VERSION", version_toml(package_index, sdist_sha256="ABC"))
    result = bare_project.hd("fetch")
    assert result.rc == 2
    assert "not a lowercase hex sha256" in result.err


def test_fetch_other_version_prints_index_hashes(project: Project, package_index: Index):
    result = project.hd("fetch", "--version", "0.2.0")
    assert result.rc == 0, result.text
    sdist, wheel = f"{NAME}-0.2.0.tar.gz", f"{NAME}-0.2.0-{WHEEL_TAGS}.whl"
    assert f'sdist_sha256 = "{sha256(package_index.files[sdist])}"' in result.out
    assert f'wheel_sha256 = "{sha256(package_index.files[wheel])}"' in result.out
    assert (project.pin.cache_dir / wheel).read_bytes() == package_index.files[wheel].read_bytes()


def test_import_commits_every_file_byte_for_byte(project: Project):
    tree = project.git("ls-tree", "-r", "--full-tree", "v0.1.0").splitlines()
    modes = {line.split("\t", 1)[1]: line.split()[0] for line in tree}
    # .gitignore'd and egg-info files included: the whole sdist, minus nothing.
    assert set(modes) == set(RELEASE_010)
    assert modes["tools/run.sh"] == "100755"
    assert {m for p, m in modes.items() if p != "tools/run.sh"} == {"100644"}
    for path, data in RELEASE_010.items():
        blob = project.git("rev-parse", f"v0.1.0:{path}")
        assert git("cat-file", "blob", blob, cwd=project.repo).stdout == data, path
    # The work tree holds the same bytes (no eol conversion from the tree's .gitattributes).
    assert (project.repo / "vllm" / "crlf.txt").read_bytes() == RELEASE_010["vllm/crlf.txt"]
    assert dirty_paths(project.repo) == []
    log = project.git("log", "--format=%an|%at|%s", "upstream").splitlines()
    newest = RELEASE_MTIME + max(len(p) for p in RELEASE_010)
    assert log == [f"{IDENTITY_NAME}|{newest}|vllm 0.1.0: upstream sdist"]


def test_import_twice_is_a_noop_and_newer_release_stacks(project: Project):
    first = project.rev("v0.1.0")
    result = project.hd("import")
    assert result.rc == 0 and "nothing to do" in result.out
    assert project.rev("upstream") == first

    result = project.hd("import", "--version", "0.2.0")
    assert result.rc == 0, result.text
    second = project.rev("v0.2.0")
    assert project.rev("upstream") == second
    assert project.git("rev-parse", "v0.2.0^") == first
    files = set(project.git("ls-tree", "-r", "--name-only", "v0.2.0").splitlines())
    assert files == set(RELEASE_020)
    assert "vllm/utils.py" not in files
    # The old release's blobs stay reachable for `git am -3` on the new base.
    assert project.git("cat-file", "-t", "v0.1.0:vllm/utils.py") == "blob"

    result = project.hd("import", "--version", "0.2.0")
    assert result.rc == 0 and "nothing to do" in result.out
    assert project.rev("upstream") == second


def test_a_tag_not_imported_from_the_pinned_sdist_is_refused(project: Project):
    """The pinned tag's commit names the sdist's sha256: a tag moved by hand (or a
    build/upstream from elsewhere) must not stand in for the pin on import or apply."""
    git("tag", "-f", "v0.1.0", project.git("commit-tree", "-m", "not an import",
                                          "v0.1.0^{tree}"), cwd=project.repo)  # fmt: skip
    for command in ("import", "apply"):
        result = project.hd(command)
        assert result.rc == 2, (command, result.text)
        assert f"is not the import of {project.pin.sdist}" in result.err
        assert "tag -d v0.1.0" in result.err
    git("tag", "-d", "v0.1.0", cwd=project.repo)
    result = project.hd("import")
    assert result.rc == 0, result.text
    assert project.hd("apply").rc == 0


def test_import_is_deterministic(bare_project: Project, project: Project):
    result = bare_project.hd("import")
    assert result.rc == 0, result.text
    assert bare_project.rev("v0.1.0") == project.rev("v0.1.0")


def test_import_refuses_unsafe_sdist_members_and_leaves_no_ref(project: Project, tmp_path):
    bad = tmp_path / "vllm-9.9.9.tar.gz"
    with tarfile.open(bad, "w:gz") as tf:
        for name in ("vllm-9.9.9/ok.txt", "vllm-9.9.9/../evil.txt"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tf.addfile(info, io.BytesIO(b"hi\n"))
    upstream_before = project.rev("upstream")
    with pytest.raises(HdError, match="unsafe path"):
        import_sdist(project.pin, "9.9.9", bad, sha256(bad))
    assert project.rev("v9.9.9") is None
    assert project.rev("upstream") == upstream_before
    assert dirty_paths(project.repo) == []
