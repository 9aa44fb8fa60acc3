"""PTX analysis: parse, classify kernel parameter accesses, extract PTX from binaries, instrument ranges."""
