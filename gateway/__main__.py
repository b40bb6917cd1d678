"""`python -m gateway` is the `memstrata` command."""

from gateway.cli import main

main()
