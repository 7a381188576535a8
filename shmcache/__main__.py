"""`python -m shmcache ...`: the same as the `shmcache` command."""

import sys

from shmcache.cli import main

sys.exit(main())
