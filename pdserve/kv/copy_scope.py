"""Where a KV read can be a copy: which engines UCX's cross-memory attach (cma) could reach.

A decode engine reads a busy step's KV inside that step only from a prefill engine whose reads
are copied as they are posted (kv/cpu_nixl.py). Seeing one read land as it was posted is not
proof: over TCP a read also lands before it is checked when the reader's thread is descheduled
between the two long enough for the holder to answer. So both engines also name their scope, and
only a peer in the reader's own scope counts: the same boot of the same machine, the same pid and
network namespaces (UCX offers cma only to a peer in its own pid namespace; one in another network
namespace is taken for another host, the safe side), with cma among the transports UCX may use.
"""

from __future__ import annotations

import os

# Names in UCX_TLS that take in cma: itself, and the aliases for every shared-memory transport.
_CMA_NAMES = frozenset({"cma", "sm", "shm"})


def ucx_offers_cma(tls: str | None) -> bool:
    """Whether UCX, with this UCX_TLS (None: unset, every transport), may use cma."""
    if not tls:
        return True
    excluded = tls.startswith("^")
    names = {n.strip().lstrip("\\") for n in tls.lstrip("^").split(",")}
    if excluded:
        return not names & _CMA_NAMES
    return bool(names & (_CMA_NAMES | {"all"}))


def copy_scope() -> str | None:
    """This process's scope, or None when its UCX may not use cma or the scope is unknown."""
    if not ucx_offers_cma(os.environ.get("UCX_TLS")):
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pid_ns, net_ns = (os.stat(f"/proc/self/ns/{ns}").st_ino for ns in ("pid", "net"))
    except OSError:  # not Linux, or /proc hidden: no peer counts as in scope
        return None
    return f"{boot}/pid:{pid_ns}/net:{net_ns}"
