"""Reports drawn from Tessera's results: plots (PNG, matplotlib's Agg backend, no display needed)."""
