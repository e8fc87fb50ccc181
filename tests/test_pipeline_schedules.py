"""Pipeline schedules as data (`jaxscale.strategies.pp.schedules`) run by the simulator
(`simulator.py`): the simulated bubbles against the closed forms, peak activations in flight,
every op once with its dependencies kept, clear errors for bad (p, m, v), and the Gantt PNG.
Pure Python, no JAX work: about a second."""
import itertools

import pytest

from jaxscale.strategies.pp import schedules as ps
from jaxscale.strategies.pp import simulator as sim

PS, MS = (2, 4, 8), (4, 8, 16)


def cases():
    """(name, p, m, v) of every schedule over p = 2, 4, 8 and m = 4, 8, 16 that it accepts."""
    for p in PS:
        yield "naive", p, 1, 1
        for m in MS:
            yield "gpipe", p, m, 1
            yield "1f1b", p, m, 1
            if m >= p:
                yield "zb-h1", p, m, 1
            if m >= 2 * p:
                yield "zb-v", p, m, 2
                for v in (2, 3, 4):
                    if m % p == 0:
                        yield "interleaved", p, m, v


CASES = list(cases())


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_simulated_bubble_equals_formula(name, p, m, v):
    sc = ps.make(name, p, m, v)
    r = sim.simulate(sc, t_f=1.0, t_b=2.0)          # zb-h1: B = W = 1, the ZB unit convention
    assert r.bubble == pytest.approx(ps.formula_bubble(name, p, m, v), abs=1e-12)
    # every device does all its work: m (t_f + t_b), whatever the schedule
    assert r.busy == pytest.approx([m * 3.0] * p)
    # and the last op ends after that work plus the idle time the schedule cannot avoid: the
    # warm-up and cool-down, (p - 1) (t_f + t_b) (naive: every other device's whole work), over v
    # for interleaved chunks, (p - 1) (T_F + T_B - T_W) = (p - 1) for ZB-H1 (B = W = 1), and for
    # ZB-V each device's wait for the first chunk-forwards, (p - 1) T_F / 2 on average
    idle = {"naive": (p - 1) * 3.0, "gpipe": (p - 1) * 3.0, "1f1b": (p - 1) * 3.0,
            "interleaved": (p - 1) * 3.0 / v, "zb-h1": (p - 1) * 1.0,
            "zb-v": (p - 1) * 0.5}[name]
    assert r.makespan == pytest.approx(m * 3.0 + idle, abs=1e-12)


@pytest.mark.parametrize("p,m", [(4, 8), (8, 16)])
def test_gpipe_1f1b_interleaved_formulas_spelled_out(p, m):
    bub = {n: sim.simulate(ps.make(n, p, m, 2 if n == "interleaved" else 1)).bubble
           for n in ("gpipe", "1f1b", "interleaved")}
    assert bub["gpipe"] == pytest.approx((p - 1) / (m + p - 1))
    assert bub["1f1b"] == pytest.approx((p - 1) / (m + p - 1))
    assert bub["interleaved"] == pytest.approx((p - 1) / (2 * m + p - 1))
    assert sim.simulate(ps.naive(p)).bubble == pytest.approx((p - 1) / p)
    # Megatron's form (idle over compute), the one strategies/pp/ plans with
    one = sim.simulate(ps.one_f_one_b(p, m))
    assert one.overhead == pytest.approx((p - 1) / m)
    assert sim.simulate(ps.interleaved(p, m, 2)).overhead == pytest.approx((p - 1) / (2 * m))
    assert sim.simulate(ps.zb_h1(p, m), 1, 1, 1).overhead == pytest.approx((p - 1) / (3 * m))


@pytest.mark.parametrize("p,m", [(p, m) for p in PS for m in MS if m >= p])
def test_zb_h1_about_a_third_of_1f1b(p, m):
    """T_F = T_B = T_W = 1 for ZB-H1; 1F1B runs the same work with B = T_B + T_W = 2. The idle
    time is exactly a third ((p-1) against 3 (p-1) per device); as a fraction of the makespan
    the ratio is (m+p-1)/(3m+p-1): 0.407 at p=4, m=8, tending to 1/3 as m grows."""
    zb, one = sim.simulate(ps.zb_h1(p, m), 1, 1, 1), sim.simulate(ps.one_f_one_b(p, m), 1, 1, 1)
    idle = lambda r: r.bubble * r.makespan                       # noqa: E731  per device
    assert idle(zb) == pytest.approx(p - 1) and idle(one) == pytest.approx(3 * (p - 1))
    assert idle(zb) / idle(one) == pytest.approx(1 / 3)
    assert zb.bubble / one.bubble == pytest.approx((m + p - 1) / (3 * m + p - 1))
    assert 1 / 3 < zb.bubble / one.bubble < 0.5
    if (p, m) == (4, 8):
        assert zb.bubble / one.bubble == pytest.approx(0.407, abs=1e-3)
    # same peak memory as 1F1B on device 0 (activations counted until W)
    assert zb.in_flight[0] == one.in_flight[0] == p
    assert zb.in_flight == [p] * p


@pytest.mark.parametrize("costs", [(2, 1, 1), (1, 2, 1), (1, 1, 0.5), (1, 1, 1)])
def test_zb_h1_closed_form_and_its_limit(costs):
    t_f, t_b, t_w = costs
    for p, m in [(4, 8), (3, 7), (8, 16)]:
        r = sim.simulate(ps.zb_h1(p, m), t_f, t_b, t_w)
        assert r.bubble == pytest.approx(
            ps.formula_bubble("zb-h1", p, m, t_f=t_f, t_b=t_b, t_w=t_w))
        assert r.bubble * r.makespan == pytest.approx((p - 1) * (t_f + t_b - t_w))
    assert ps.formula_bubble("zb-h1", 4, 8, t_f=1, t_b=1, t_w=1.5) is None


def test_zb_split_conventions_agree():
    """t_w None: t_b is the whole backward, split in halves for ZB-H1; 1F1B with t_w runs one B
    of t_b + t_w."""
    a, b = sim.simulate(ps.zb_h1(4, 8), 1, 2), sim.simulate(ps.zb_h1(4, 8), 1, 1, 1)
    assert a.start == b.start and a.makespan == b.makespan
    c, d = sim.simulate(ps.one_f_one_b(4, 8), 1, 2), sim.simulate(ps.one_f_one_b(4, 8), 1, 1, 1)
    assert c.start == d.start


@pytest.mark.parametrize("p", PS)
def test_peak_in_flight(p):
    for m in MS:
        one, gp = sim.simulate(ps.one_f_one_b(p, m)), sim.simulate(ps.gpipe(p, m))
        assert one.in_flight[0] == min(m, p)                     # flat in m once m >= p
        assert one.in_flight == [min(m, p - d) for d in range(p)]
        assert gp.in_flight == [m] * p                           # grows with m
        assert sim.simulate(ps.naive(p)).in_flight == [1] * p
        if m % p == 0 and m > p:
            for v in (2, 4):
                il = sim.simulate(ps.interleaved(p, m, v))
                assert il.in_flight[0] == pytest.approx(p + (p - 1) / v)  # p (1 + (p-1)/(p v))
                assert il.peak_in_flight == il.in_flight[0]
    # interleaved with m = p warms up every forward first: m in flight, like GPipe
    assert sim.simulate(ps.interleaved(p, p, 2)).in_flight[0] == p


def _expected_ops(sc):
    kinds = ("F", "B", "W") if sc.name in ps.SPLIT else ("F", "B")
    return {(k, s, j) for k in kinds for s in range(sc.stages) for j in range(sc.m)}


@pytest.mark.parametrize("name,p,m,v", CASES[::3] + [("interleaved", 4, 8, 2),
                                                     ("zb-v", 4, 8, 2)])
@pytest.mark.parametrize("t_comm", [0.0, 0.3])
def test_every_op_once_and_dependencies_hold(name, p, m, v, t_comm):
    sc = ps.make(name, p, m, v)
    ops = sc.ops()
    assert len(ops) == len(set(ops))
    assert {(o.kind, o.stage, o.micro_batch) for o in ops} == _expected_ops(sc)
    assert all(sc.device_of(o.stage) == o.device and o in sc.programs[o.device] for o in ops)
    r = sim.simulate(sc, 1.0, 2.0, None, t_comm)
    rows = r.table()
    assert len(rows) == len(ops) and rows == sorted(rows, key=lambda x: (x.tick, x.device))
    at = {(x.op, x.stage, x.micro_batch): x.tick for x in rows}
    end = {(o.kind, o.stage, o.micro_batch): r.end[o] for o in ops}
    S = sc.stages
    for (k, s, j), t in at.items():
        def comm(a, b):                    # transfers between devices cost time (ZB-V's turn not)
            return t_comm if sc.device_of(a) != sc.device_of(b) else 0.0
        if k == "F" and s > 0:
            assert t >= end["F", s - 1, j] + comm(s - 1, s) - 1e-9
        if k == "B":
            assert t >= end["F", s, j] - 1e-9                     # own forward first
            if s < S - 1:
                assert t >= end["B", s + 1, j] + comm(s + 1, s) - 1e-9
        if k == "W":
            assert t >= end["B", s, j] - 1e-9
    for prog in sc.programs:                                      # a device does one op at a time
        for a, b in itertools.pairwise(prog):
            assert r.start[b] >= r.end[a] - 1e-9
    if t_comm and p > 1:                                          # transfers cost time
        assert r.makespan > sim.simulate(sc).makespan


def test_table_ticks_are_integers_for_unit_costs():
    rows = sim.simulate(ps.make("1f1b", 4, 8), t_f=1, t_b=1).table()
    assert rows[0] == sim.Row(0, 0, 0, 0, "F")
    assert all(float(x.tick).is_integer() for x in rows)
    for name in ps.SPLIT:
        assert {x.op for x in sim.simulate(ps.make(name, 4, 8)).table()} == {"F", "B", "W"}


def test_deadlocked_program_is_reported():
    bad = ps.Schedule("bad", 2, 1, 1, ((ps.Op("B", 0, 0, 0), ps.Op("F", 0, 0, 0)),
                                       (ps.Op("F", 1, 0, 1), ps.Op("B", 1, 0, 1))))
    with pytest.raises(RuntimeError, match="deadlocks: waiting ops B0@s0"):
        sim.simulate(bad)


@pytest.mark.parametrize("call,message", [
    (lambda: ps.make("pipedream", 4, 8), "plan.schedule='pipedream' is unknown: valid are naive, "
                                         "gpipe, 1f1b, interleaved, zb-h1, zb-v"),
    (lambda: ps.make("zb-v", 4, 6), "m=6 < 2p=8; set plan.accumulate >= 8"),
    (lambda: ps.make("interleaved", 4, 2, 2), "m=2 < p=4; set plan.accumulate >= 4"),
    (lambda: ps.make("zb-h1", 8, 4), "m=4 < p=8; set plan.accumulate >= 8"),
    (lambda: ps.make("interleaved", 4, 10, 2), "multiple of p=4: m=10; use m=8 or m=12"),
    (lambda: ps.make("1f1b", 4, 8, 2), "plan.virtual_stages=2 applies only to "
                                       "plan.schedule=interleaved (got '1f1b'"),
    (lambda: ps.gpipe(0, 4), "pp (p)=0: must be an integer >= 1"),
    (lambda: ps.one_f_one_b(4, 0), "micro-batches (m)=0: must be an integer >= 1"),
    (lambda: ps.formula_bubble("zb-h1", 4, 2), "m=2 < p=4"),
])
def test_bad_inputs(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert message in str(e.value)


def test_good_inputs_pass_checks():
    ps.make("interleaved", 4, 8, 2)
    ps.make("zb-v", 4, 8, 2)
    ps.make("1f1b", 8, 4)                # 1F1B and GPipe run with m < p (bubble formula holds)
    assert sim.simulate(ps.one_f_one_b(8, 4)).bubble == pytest.approx(7 / 11)


def test_draw_writes_png(tmp_path):
    sc = ps.make("interleaved", 4, 8, 2)
    out = sim.draw(sc, sim.simulate(sc), str(tmp_path / "one.png"))
    data = open(out, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    many = sim.draw(ps.gpipe(2, 4), None, str(tmp_path / "many.png"),
                    also=((ps.zb_h1(2, 4), None), (ps.zb_v(2, 4), None), (ps.naive(2), None)))
    assert len(open(many, "rb").read()) > 10_000


@pytest.mark.parametrize("p", PS)
def test_zb_v_halves_zb_h1s_idle_at_1f1b_memory(p):
    """The V placement: device d holds stages d and 2p-1-d (the first and last on device 0, the
    turn at device p-1 local). At T_F = T_B = T_W its idle time is (p-1) T_F / 2 per device, half
    ZB-H1's and a sixth of 1F1B's, with 1F1B's peak: p micro-batches on every device."""
    for m in (2 * p, 3 * p, 4 * p):
        sc = ps.zb_v(p, m)
        assert sc.placement == tuple(list(range(p)) + list(range(p))[::-1])
        assert sc.stage_of(0, 1) == 2 * p - 1 and sc.chunk_of(2 * p - 1) == 1
        zv, zh, one = (sim.simulate(s, 1, 1, 1) for s in (sc, ps.zb_h1(p, m),
                                                          ps.one_f_one_b(p, m)))
        idle = lambda r: r.bubble * r.makespan                   # noqa: E731  per device
        assert idle(zv) == pytest.approx((p - 1) / 2)
        assert idle(zv) / idle(zh) == pytest.approx(0.5)
        assert idle(zv) / idle(one) == pytest.approx(1 / 6)
        assert zv.in_flight == [p] * p == one.in_flight[:1] * p
    assert ps.formula_bubble("zb-v", p, 2 * p, t_w=0.5) is None
