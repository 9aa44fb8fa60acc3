"""Tessera's router: the OpenAI-compatible front of engine-level plans. Requests follow the plan's routes in
their planned shares (a whole engine, or prefill on one engine and decode on another); engines' health,
failover to the routes still open, bounded in-flight requests, metrics. A thin front over engines' own
HTTP servers, sharing the serving protocol and HTTP layer of `tessera.serve`."""
