"""Type stub of the copy-on-write mapping extension (mapping.c)."""

class Mapping:
    """Some bytes of a file mapped copy-on-write (a writable buffer), unmapped when it dies."""

def map_private(fd: int, offset: int, size: int, /) -> Mapping: ...
