"""Which engines count as in a KV read's copy scope (pdserve/kv/copy_scope.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.kv.copy_scope import copy_scope, ucx_offers_cma


@pytest.mark.parametrize("tls, offers", [
    (None, True), ("", True), ("all", True),
    ("cma,tcp", True), ("tcp,cma", True), ("sm,tcp", True), ("shm", True), ("\\cma", True),
    ("tcp", False), ("tcp,posix", False),
    ("^cma", False), ("^sm,ib", False), ("^ib", True),
])
def test_ucx_offers_cma_as_its_transports_say(tls, offers):
    assert ucx_offers_cma(tls) is offers


def scope_of_child(*wrapper: str, tls: str | None = None) -> str:
    env = {} if tls is None else {"UCX_TLS": tls}
    code = "from pdserve.kv.copy_scope import copy_scope; print(copy_scope())"
    out = subprocess.run([*wrapper, sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", **env}, timeout=60, check=True)
    return out.stdout.strip()


def test_processes_of_one_host_and_namespaces_share_a_scope(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    here = copy_scope()
    assert here is not None and scope_of_child() == here
    assert scope_of_child(tls="cma,tcp") == here


def test_ucx_without_cma_has_no_scope():
    assert scope_of_child(tls="tcp") == "None"


@pytest.mark.parametrize("namespaces", [["--net"], ["--pid", "--fork", "--mount-proc"]])
def test_another_network_or_pid_namespace_is_another_scope(namespaces):
    # As engines in two pods of one node, or `ip netns exec` in the cross-host tests.
    there = scope_of_child("unshare", *namespaces)
    assert there not in ("None", scope_of_child()), there
