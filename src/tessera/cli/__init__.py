"""The `tessera` command line: one module per command group, each only parsing options into the config
objects of the package it drives (`main` is the root app and mounts the others)."""
