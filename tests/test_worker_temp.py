"""A worker started on its own keeps its children's temporary files in a folder of its own (the
e2e test in tests/e2e/test_pool.py sees it made and gone with a real engine); here, when it
makes one and when it leaves the temporary folder as it is."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from pdserve.worker.main import own_temp_folder


@pytest.fixture()
def clean_env(monkeypatch):
    """This process's temporary folder is an empty one as short as a host's usual one (vLLM's
    socket paths in a folder in it must fit in 107 bytes), and nothing has placed vLLM's
    sockets or torch's cache."""
    top = Path(tempfile.mkdtemp(prefix="pdserve-test-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(top))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(top / "cache"))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)
    yield top
    shutil.rmtree(top)


def test_a_worker_on_its_own_moves_its_childrens_temporary_files_to_a_folder_of_its_own(
        clean_env):
    folder = own_temp_folder()
    assert folder is not None
    assert os.path.dirname(folder) == str(clean_env)
    assert os.path.basename(folder).startswith(f"pdserve-worker-{os.getpid()}-")
    assert os.environ["TMPDIR"] == os.environ["VLLM_RPC_BASE_PATH"] == folder
    assert tempfile.gettempdir() == folder  # read again, not the one found before


def test_sockets_placed_by_the_user_or_serve_stay_where_they_are(clean_env, monkeypatch):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(clean_env / "rpc"))
    assert own_temp_folder() is None
    assert os.environ["TMPDIR"] == str(clean_env)
    assert not [p for p in clean_env.iterdir() if p.name.startswith("pdserve-worker-")]


def test_a_temporary_folder_it_cannot_write_leaves_the_worker_as_it_was(clean_env, monkeypatch,
                                                                       caplog):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(clean_env))

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with caplog.at_level(logging.WARNING, "pdserve.worker"):
        assert own_temp_folder() is None
    assert os.environ["TMPDIR"] == str(clean_env)
    assert "no temporary folder of this worker's own" in caplog.text
