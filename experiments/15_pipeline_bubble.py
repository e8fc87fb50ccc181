"""python experiments/15_pipeline_bubble.py [--p 4] [--m 8] [--v 2] [--out runs/15_pipeline_bubble]
                                        [--figure docs/img/pipeline_schedules.png]

Topic 15: pipeline bubbles. Every schedule of `jaxscale.pipeline_schedules` (naive, GPipe, 1F1B,
interleaved 1F1B with v virtual stages, ZB-H1) built for p devices and m micro-batches and run by
its discrete-event simulator, T_F = 1 and a whole backward of 2 (ZB-H1: B = W = 1, the paper's
T_F = T_B = T_W), stages of equal cost. Prints simulated bubble against the closed form, the
idle/compute overhead (Megatron's form), the peak micro-batches in flight on device 0 and the
bubble when each stage-to-stage transfer costs 0.1 T_F. Writes bubble.json and a stacked Gantt
chart (gpipe, 1f1b, interleaved, zb-h1) under --out, or at --figure. No JAX; about a second.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from jaxscale import pipeline_schedules as ps

COMM = 0.1


def rows(p: int, m: int, v: int) -> list[dict]:
    out = []
    for name in ps.NAMES:
        mm, vv = (1 if name == "naive" else m), (v if name == "interleaved" else 1)
        sc = ps.make(name, p, mm, vv)
        r = ps.simulate(sc)
        out.append(dict(schedule=name, p=p, m=mm, v=vv, makespan=r.makespan, bubble=r.bubble,
                        formula=ps.formula_bubble(name, p, mm, vv), overhead=r.overhead,
                        in_flight_dev0=r.in_flight[0], peak_in_flight=r.peak_in_flight,
                        bubble_comm=ps.simulate(sc, t_comm=COMM).bubble))
    return out


def table(rs: list[dict]) -> str:
    lines = [f"{'schedule':<12}{'p':>3}{'m':>4}{'v':>3}{'makespan':>10}{'bubble':>9}"
             f"{'formula':>9}{'idle/compute':>14}{'in flight d0':>14}{f'bubble, comm {COMM}':>19}"]
    for r in rs:
        f = "-" if r["formula"] is None else f"{r['formula']:.4f}"
        lines.append(f"{r['schedule']:<12}{r['p']:>3}{r['m']:>4}{r['v']:>3}{r['makespan']:>10g}"
                     f"{r['bubble']:>9.4f}{f:>9}{r['overhead']:>14.4f}{r['in_flight_dev0']:>14g}"
                     f"{r['bubble_comm']:>19.4f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--v", type=int, default=2)
    ap.add_argument("--out", default="runs/15_pipeline_bubble")
    ap.add_argument("--figure", default=None, help="PNG path (default: OUT/pipeline_schedules.png)")
    a = ap.parse_args(argv)
    rs = rows(a.p, a.m, a.v)
    print(table(rs))
    zb, one = (next(r for r in rs if r["schedule"] == n) for n in ("zb-h1", "1f1b"))
    print(f"zb-h1 / 1f1b: bubble fraction {zb['bubble'] / one['bubble']:.3f}, "
          f"idle time {zb['bubble'] * zb['makespan'] / (one['bubble'] * one['makespan']):.3f}, "
          f"idle/compute {zb['overhead'] / one['overhead']:.3f}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bubble.json"), "w") as f:
        json.dump(rs, f, indent=1)
    fig = a.figure or os.path.join(a.out, "pipeline_schedules.png")
    os.makedirs(os.path.dirname(fig) or ".", exist_ok=True)
    scheds = [ps.make(n, a.p, a.m, a.v if n == "interleaved" else 1)
              for n in ("gpipe", "1f1b", "interleaved", "zb-h1")]
    ps.draw(scheds[0], None, fig, also=tuple((s, None) for s in scheds[1:]))
    print(f"wrote {fig} and {os.path.join(a.out, 'bubble.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
