"""The remote layer: Mooncake Store behind the node layer (store.py: the client; bridge.py: pull
on a node miss, publish after a compute)."""
