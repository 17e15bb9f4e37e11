"""tests/ops reuse the real Serve app of tests/cluster (``server``: TP=1 on CPU, ngram speculation) and its
warning filters; ``ray_session`` is in tests/conftest.py."""

from __future__ import annotations

from tests.cluster.conftest import pytest_configure, server  # noqa: F401 - fixture and hook re-used here
