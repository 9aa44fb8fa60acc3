"""Production engines Tessera launches for engine-level plans (vLLM): command lines, environments, KV
connector settings, processes, health and restarts. Processes only: Tessera never imports an engine."""
