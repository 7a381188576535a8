"""The process layer: `EmbeddingCache`, the public facade every process opens (cache.py), over
the node index, with this process's mappings, views and request references."""
