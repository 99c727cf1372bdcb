"""`python -m k3c.cli`: the `k3c` command."""

from k3c.cli import main

main()
