"""`tessera.plan.shares.ShareSwitch` and the route table under it: on the latency shares every request takes
the route of the lowest planned latency; once the requests in flight fill that route's engine the table switches
to the plan's shares (and its round robin keeps them from there), and back below the hysteresis; the cool-down
holds a switch back; a closed fastest route sends the latency shares' requests along the open routes; fixed
policies never switch; plans whose routes carry no latency cannot use the latency shares."""

from __future__ import annotations

import pytest

from tessera.plan.deployment import DECODE, PREFILL, WHOLE, PlannedEngine, PlannedRoute
from tessera.plan.shares import ShareSwitch, ShareSwitchError
from tessera.router.table import Endpoint, RouteTable


def engine(name: str, role: str, seqs: int) -> PlannedEngine:
    return PlannedEngine(name=name, roles=(role,), targets=("X",), devices=("X:0",), nodes=("node0",),
                         max_num_seqs=seqs, kv_tokens=100_000, block_size=16, memory_fraction=0.9)


ENGINES = {e.name: e for e in (engine("whole", WHOLE, 8), engine("prefill", PREFILL, 8), engine("decode", DECODE, 4))}
WHOLE_ROUTE = PlannedRoute("whole", 0.25, ("whole",), latency_s=2.0)
PD_ROUTE = PlannedRoute("pd", 0.75, ("prefill", "decode"), latency_s=1.0)  # the fastest; its decode engine holds 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table(policy: str = "auto", cooldown_s: float = 0.0, routes=(WHOLE_ROUTE, PD_ROUTE)) -> RouteTable:
    endpoints = {n: Endpoint(e, f"http://127.0.0.1:{9000 + i}", state="up") for i, (n, e) in enumerate(ENGINES.items())}
    switch = ShareSwitch(list(routes), ENGINES, policy, cooldown_s=cooldown_s)
    return RouteTable(endpoints, list(routes), switch, clock=Clock())


def test_light_load_takes_the_fastest_route_only():
    t = table()
    assert t.switch.mode == "latency" and t.switch.fastest is PD_ROUTE and t.switch.capacity == 4
    for _ in range(20):  # one at a time: never more than one in flight
        h = t.pick()
        assert h.route == "pd"
        t.release(h)
    assert t.switch.switch_count == 0


def test_a_full_fastest_engine_switches_to_the_plan_shares_and_back_below_the_hysteresis():
    t = table()
    picked = [t.pick() for _ in range(4)]  # the 4 picked with 0..3 in flight fill the decode engine
    assert [h.route for h in picked] == ["pd"] * 4
    more = [t.pick() for _ in range(8)]  # from the 5th on: the plan's shares (0.25 / 0.75), round robin afresh
    assert t.switch.mode == "throughput" and t.switch.switch_count == 1
    assert sum(h.route == "whole" for h in more) == 2 and sum(h.route == "pd" for h in more) == 6
    change = t.switch.changes[-1]
    assert (change.before, change.after, change.in_flight) == ("latency", "throughput", 4)
    for h in picked + more[:5]:
        t.release(h)
    assert t.in_flight == 3
    h = t.pick()  # 3 in flight, under 0.8 x 4: back to the latency shares
    assert t.switch.mode == "latency" and h.route == "pd" and t.switch.switch_count == 2


def test_inside_the_band_the_shares_stay():
    t = table()
    picked = [t.pick() for _ in range(5)]
    assert t.switch.mode == "throughput"
    t.release(picked[0])
    t.release(picked[1])  # 3 in flight: below 0.8 x 4 = 3.2 -> latency
    t.pick()
    assert t.switch.mode == "latency"
    t.pick()  # 4 in flight -> throughput again
    assert t.switch.mode == "throughput"
    assert t.switch.switch_count == 3


def test_the_cool_down_holds_a_switch_back():
    t = table(cooldown_s=5.0)
    t.switch._last_switch = 0.0
    t.clock.now = 1.0
    [t.pick() for _ in range(6)]
    assert t.switch.mode == "latency"  # full, but within 5 s of the last switch
    t.clock.now = 6.0
    t.pick()
    assert t.switch.mode == "throughput"


def test_latency_shares_with_the_fastest_route_closed_use_the_open_routes():
    t = table()
    t.endpoints["decode"].state = "down"
    assert {t.pick().route for _ in range(3)} == {"whole"}


def test_fixed_policies_never_switch():
    thr, lat = table("throughput"), table("latency")
    picks = [thr.pick().route for _ in range(8)], [lat.pick().route for _ in range(8)]
    assert picks[0].count("whole") == 2 and picks[1] == ["pd"] * 8
    assert thr.switch.switch_count == lat.switch.switch_count == 0


def test_routes_without_latency_keep_the_plan_shares():
    old = [PlannedRoute("whole", 0.25, ("whole",)), PlannedRoute("pd", 0.75, ("prefill", "decode"))]
    t = table(routes=old)
    assert t.switch.mode == "throughput" and t.switch.fastest is None
    assert sum(t.pick().route == "pd" for _ in range(8)) == 6
    with pytest.raises(ShareSwitchError, match="do not say their latency"):
        ShareSwitch(old, ENGINES, "latency")


def test_a_single_route_has_nothing_to_switch():
    t = table(routes=(PD_ROUTE,))
    assert t.switch.mode == "throughput"
    [t.pick() for _ in range(10)]
    assert t.switch.switch_count == 0


def test_bad_settings_are_refused():
    with pytest.raises(ShareSwitchError, match="choose one of auto, throughput, latency"):
        ShareSwitch([WHOLE_ROUTE, PD_ROUTE], ENGINES, "fastest")
    with pytest.raises(ShareSwitchError, match="hysteresis"):
        ShareSwitch([WHOLE_ROUTE, PD_ROUTE], ENGINES, hysteresis=1.5)
