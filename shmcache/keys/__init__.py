"""Keys: content-addressed cache keys over framed, full-width digests (key.py; the per-key work in
native.c), the digest framing (framing.py), the frozen preprocessing config every key includes
(preprocessing.py), the dtype names keys and values share (dtypes.py), and the text checks of
validation (text.py)."""
