"""`python -m rollkv_dist` is the `rollkv` command."""

from rollkv_dist.cli import main

raise SystemExit(main())
