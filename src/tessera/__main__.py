"""`python -m tessera ...` runs the command line (what `torchrun -m tessera run ...` starts on each rank)."""

from tessera.cli.main import main

main()
