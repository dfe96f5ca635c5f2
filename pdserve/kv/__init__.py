"""KV transfer on CPU hosts: `cpu_nixl.PDCpuNixlConnector`. Which connector an engine uses, and
with which role, is decided in pdserve/worker/engine.py (`kv_transfer_config`)."""
