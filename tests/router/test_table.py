"""`tessera.router.table.RouteTable` on hand-built engines and routes: smooth weighted round robin keeps
every route within one request of its share, a prefill-decode route falls back to its decode engine alone
when its prefill engine is down and closes when its decode engine is, a table with no open route raises
`NoRoute` naming the engines down, ``health()`` reports ok / degraded / down, requests in flight are
counted on pick and released (the prefill hop apart), and a route naming an unknown engine is refused."""

from __future__ import annotations

import pytest

from tessera.plan.deployment import DECODE, PREFILL, WHOLE, PlannedEngine, PlannedRoute
from tessera.router.table import Endpoint, NoRoute, RouteTable


def engine(name: str, role: str, device: str) -> PlannedEngine:
    return PlannedEngine(name=name, roles=(role,), targets=(device,), devices=(f"{device}:0",), nodes=("node0",),
                         max_num_seqs=64, kv_tokens=100_000, block_size=16, memory_fraction=0.9)


WHOLE_L40S = engine("whole-l40s", WHOLE, "L40S")
PREFILL_L40S = engine("prefill-l40s", PREFILL, "L40S")
DECODE_A100 = engine("decode-a100", DECODE, "A100")
WHOLE_ROUTE = PlannedRoute("whole", 0.64, ("whole-l40s",))
PD_ROUTE = PlannedRoute("pd", 0.36, ("prefill-l40s", "decode-a100"))


def table(*routes: PlannedRoute, state: str = "up") -> RouteTable:
    endpoints = {e.name: Endpoint(e, f"http://127.0.0.1:{8000 + i}", "nixl" if e.roles != (WHOLE,) else None,
                                  state=state)
                 for i, e in enumerate((WHOLE_L40S, PREFILL_L40S, DECODE_A100))}
    return RouteTable(endpoints, list(routes or (WHOLE_ROUTE, PD_ROUTE)))


def release_all(t: RouteTable, picked: list) -> None:
    for h in picked:
        t.release(h)


def test_smooth_weighted_round_robin_keeps_every_prefix_within_one_of_its_share():
    t = table()
    counts = {"whole": 0, "pd": 0}
    for n in range(1, 101):
        h = t.pick()
        counts[h.route] += 1
        t.release(h)
        for route in (WHOLE_ROUTE, PD_ROUTE):
            assert abs(counts[route.name] - route.share * n) < 1.0 + 1e-9, (n, counts)
    assert counts == {"whole": 64, "pd": 36}


def test_the_plan_shares_hold_with_requests_left_in_flight():
    t = table()
    picked = [t.pick() for _ in range(100)]
    assert sum(h.route == "whole" for h in picked) == 64
    assert sum(h.route == "pd" for h in picked) == 36


def test_prefill_engine_down_falls_back_to_the_decode_engine_alone():
    t = table()
    t.endpoints["prefill-l40s"].state = "down"
    hops = t.hops(PD_ROUTE)
    assert hops is not None
    assert hops.prefill is None and hops.fallback
    assert hops.decode.name == "decode-a100"
    assert hops.names == ("decode-a100",)
    picked = [t.pick() for _ in range(100)]
    assert sum(h.route == "pd" for h in picked) == 36  # the route keeps its share, served whole
    assert all(h.fallback and h.prefill is None for h in picked if h.route == "pd")
    assert t.endpoints["prefill-l40s"].in_flight == 0


def test_planned_hops_when_every_engine_is_up():
    hops = table().hops(PD_ROUTE)
    assert hops is not None and not hops.fallback
    assert hops.names == ("prefill-l40s", "decode-a100")


def test_decode_engine_down_closes_the_route_and_its_share_goes_to_the_other():
    t = table()
    t.endpoints["decode-a100"].state = "down"
    assert t.hops(PD_ROUTE) is None
    picked = [t.pick() for _ in range(50)]
    assert {h.route for h in picked} == {"whole"}
    assert t.endpoints["prefill-l40s"].in_flight == 0 and t.endpoints["decode-a100"].in_flight == 0


def test_every_route_closed_raises_no_route_naming_the_engines_down():
    t = table()
    t.endpoints["whole-l40s"].state = "down"
    t.endpoints["decode-a100"].state, t.endpoints["decode-a100"].detail = "restarting", "restart 2"
    with pytest.raises(NoRoute) as err:
        t.pick()
    message = str(err.value)
    assert "whole-l40s (down)" in message
    assert "decode-a100 (restarting: restart 2)" in message
    assert "prefill-l40s" not in message  # it is up


def test_health_ok_degraded_down():
    t = table()
    assert t.health() == ("ok", "")

    t.endpoints["prefill-l40s"].state, t.endpoints["prefill-l40s"].detail = "down", "not answering /health"
    status, detail = t.health()
    assert status == "degraded"
    assert "prefill-l40s is down (not answering /health)" in detail
    assert "serving through whole, pd" in detail
    assert "pd prefill on their decode engine" in detail  # the fallback is named

    t.endpoints["prefill-l40s"].state = "up"
    t.endpoints["whole-l40s"].state = "restarting"
    status, detail = t.health()
    assert status == "degraded"
    assert "whole-l40s is restarting" in detail and "serving through pd" in detail
    assert "prefill on their decode engine" not in detail

    t.endpoints["decode-a100"].state = "down"
    status, detail = t.health()
    assert status == "down"
    assert "whole-l40s is restarting" in detail and "decode-a100 is down" in detail


def test_engines_still_starting_are_down():
    t = table(state="starting")
    status, detail = t.health()
    assert status == "down" and "whole-l40s is starting" in detail
    with pytest.raises(NoRoute):
        t.pick()


def test_in_flight_counts_rise_on_pick_and_fall_on_release():
    t = table(PD_ROUTE)
    first, second = t.pick(), t.pick()
    assert t.endpoints["prefill-l40s"].in_flight == 2 and t.endpoints["decode-a100"].in_flight == 2

    t.release(first, prefill_only=True)  # its prefill call is over; decoding goes on
    assert first.released_prefill
    assert t.endpoints["prefill-l40s"].in_flight == 1 and t.endpoints["decode-a100"].in_flight == 2
    t.release(first)  # only its decode hop is left to release
    assert t.endpoints["prefill-l40s"].in_flight == 1 and t.endpoints["decode-a100"].in_flight == 1

    t.release(second)
    assert all(e.in_flight == 0 for e in t.endpoints.values())


def test_release_of_a_fallback_request_touches_only_its_decode_engine():
    t = table(PD_ROUTE)
    t.endpoints["prefill-l40s"].state = "down"
    h = t.pick()
    assert t.endpoints["decode-a100"].in_flight == 1 and t.endpoints["prefill-l40s"].in_flight == 0
    t.release(h, prefill_only=True)  # forward calls it only with a prefill hop; harmless without one
    t.release(h)
    assert all(e.in_flight == 0 for e in t.endpoints.values())


def test_equal_standing_goes_to_the_route_with_fewer_requests_in_flight():
    other = PlannedRoute("whole-b", 0.5, ("whole-l40s",))
    pd = PlannedRoute("pd", 0.5, ("prefill-l40s", "decode-a100"))
    t = table(other, pd)
    t.endpoints["decode-a100"].in_flight = 5  # busy with requests of another router
    assert t.pick().route == "whole-b"


def test_a_route_naming_an_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="visits decode-h100"):
        table(PlannedRoute("pd", 1.0, ("prefill-l40s", "decode-h100")))


def test_a_route_of_three_hops_is_refused():
    with pytest.raises(ValueError, match="3 hops"):
        table(PlannedRoute("long", 1.0, ("prefill-l40s", "decode-a100", "whole-l40s")))
