"""The value format: values encoded as a small header plus raw array bytes, never pickled
(values.py), read back as zero-copy views (decode.py), and the entry header that binds them to
their key and generation (entry.py)."""
