"""scripts/check_serve.py on the CPU: it refuses, before starting a server, a Python that
cannot import vLLM's serving packages, and says how to stage them."""

from __future__ import annotations

import check_serve
import pytest


def test_missing_serving_packages_are_named_with_the_fix():
    def find_spec(name):
        return None if name in ("uvicorn", "watchfiles") else object()

    with pytest.raises(check_serve.CheckFailed) as failed:
        check_serve.require_serve_modules(find_spec)
    assert "['uvicorn', 'watchfiles']" in str(failed.value)
    assert "ci/gpu/serve_wheels.py" in str(failed.value)


def test_a_python_with_them_passes():
    check_serve.require_serve_modules(lambda name: object())
