"""`python -m shmcache ...`: the same as the `shmcache` command."""

import sys

from shmcache.ops.cli import main

sys.exit(main())
