"""Keys: content-addressed cache keys over framed, full-width digests (key.py), the digest framing
(framing.py), the frozen preprocessing config every key includes (preprocessing.py), and the
dtype names keys and values share (dtypes.py)."""
