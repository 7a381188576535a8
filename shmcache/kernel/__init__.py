"""Kernel objects: the SysV semaphore set with SEM_UNDO (semaphores.py) and a namespace's shared
memory segments, created, attached, wiped and destroyed under a bootstrap lock (namespace.py)."""
