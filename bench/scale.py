"""Benchmark: the paper's scaling claim, checked by a calibrated simulation of 8 to 1024 workers.

Why it exists: the paper's headline is near-linear scaling to 1024 GPUs where a single
controller becomes the bottleneck; nothing here can run 1024 GPUs. So this measures what runs
here and simulates the rest (``distflow/sim``), saying which is which:

1. **Calibration (measured here).** ``bench/message.py`` (zmq, 64 KiB and 1 MiB payloads),
   ``bench/redistribute.py --quick --parts handoff --sizes 2,8`` and ``bench/mesh.py`` (small)
   are run and their final JSON lines read: per-message and per-byte CPU of a part sent to
   another host, of a posted same-host part, of a split and a join, SWIM's idle CPU per node;
   and the extra CPU of a step after a sleep (``scale_validate.measure_wake``).
2. **Validation (measured here vs the model).** Real processes at N = 2, 4, 8 (producers,
   consumers, a controller; the real channel and ``scatter``), generation and update replaced by
   sleeps of known length; the model (``distflow.sim.local``, the same costs on this machine's
   cores, processor-shared) predicts wall time and CPU per step. Error = |model - real| / real.
3. **Results (simulated).** One synchronous step (``max_staleness: 0``, colocated rollout and
   trainer per GPU) for N = 8 ... 1024, DistFlow against ``controller: single`` as built, on the
   7B and 32B cost tables (``distflow.sim.costs``: assumed GPU speeds, not measured) and 2k, 8k
   and 32k-token samples; scaling efficiency = per-worker token throughput / that at N = 8.
   Owner routing is the nodes' own ``distflow.buffer.routing`` on the same sample ids.

Prints the tables and ends with one JSON line (``validation_error_max``,
``distflow_efficiency_512``, ``single_efficiency_512``: 32B table, 8k-token samples, as built).
Run: ``python bench/scale.py [--calibration FILE] [--plot docs/scaling.png] [--quick]``
(about 6-8 minutes on 2 cores; ``--calibration`` reuses the benches' saved lines).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from distflow.sim.calibrate import Calibration, load_or_run, with_wake  # noqa: E402
from distflow.sim.cluster import StepResult, controller_saturation_n, simulate  # noqa: E402
from distflow.sim.costs import TABLES, Network, Workload  # noqa: E402
from distflow.sim.local import LocalStep, predict  # noqa: E402

LENGTHS = (2048, 8192, 32768)
HEADLINE = ("32b", 8192)


def validate(cal: Calibration, sizes: list[int], samples: int, reps: int, cores: float,
             kind: str = "auto") -> tuple[list[dict], float]:
    """Real runs against the model at each N; returns (rows, the largest relative error). ``kind``:
    the channel (``auto``: posted parts on this host; ``zmq``: every part an acked message)."""
    from scale_validate import SAMPLE_BYTES, measure

    rows, worst = [], 0.0
    for n in sizes:
        m = measure(n, samples, reps, base=0.3, spread=0.2, update_s=0.2, kind=kind)
        st = LocalStep(n, samples, SAMPLE_BYTES, tuple(m["gen_s"]), m["update_s"])
        for d in ("distflow", "single"):
            wall, cpu = predict(d, st, cal, cores, remote=kind == "zmq")
            ew = abs(wall - m[f"{d}_wall_s"]) / m[f"{d}_wall_s"]
            ec = abs(cpu - m[f"{d}_cpu_s"]) / m[f"{d}_cpu_s"]
            worst = max(worst, ew, ec)
            rows.append({"n": n, "design": d, "real_wall_s": m[f"{d}_wall_s"], "model_wall_s": wall, "err_wall": ew,
                         "real_cpu_ms": m[f"{d}_cpu_s"] * 1e3, "model_cpu_ms": cpu * 1e3, "err_cpu": ec,
                         "real_cpu_range_ms": [x * 1e3 for x in m[f"{d}_cpu_range"]]})
    return rows, worst


def mean_step(design: str, n: int, table: str, wl: Workload, net: Network, cal: Calibration, steps: int,
              **kw: Any) -> dict[str, float]:
    """Per-worker throughput and phase times over ``steps`` simulated steps (different samples each)."""
    steps = max(steps, min(32, 256 // n))  # small N is cheap: more steps, less sampling noise in the baseline
    rs: list[StepResult] = [simulate(design, n, TABLES[table], wl, net, cal, step=s, **kw) for s in range(steps)]
    tot_s = sum(r.step_s for r in rs)
    return {"step_s": tot_s / steps, "tok_s_per_worker": sum(r.tokens for r in rs) / tot_s / n,
            "gen_s": statistics.mean(r.gen_s for r in rs), "route_s": statistics.mean(r.route_s for r in rs),
            "train_s": statistics.mean(r.train_s for r in rs), "router_cpu_s": statistics.mean(r.router_cpu_s for r in rs),
            "router_link_s": statistics.mean(r.router_link_s for r in rs),
            "imbalance": statistics.mean(r.trainer_tokens_max_over_mean for r in rs),
            "mib_per_worker": statistics.mean(r.bytes for r in rs) / n / 2**20}


def curve(design: str, ns: list[int], table: str, wl: Workload, net: Network, cal: Calibration, steps: int,
          **kw: Any) -> dict[int, dict[str, float]]:
    out = {n: mean_step(design, n, table, wl, net, cal, steps, **kw) for n in ns}
    base = out[ns[0]]["tok_s_per_worker"]
    for r in out.values():
        r["eff"] = r["tok_s_per_worker"] / base
    return out


def e512(c: dict[int, dict[str, float]]) -> float | None:
    return round(c[512]["eff"], 4) if 512 in c else None


def crossing(c: dict[int, dict[str, float]], level: float) -> int | None:
    """The smallest simulated N whose efficiency is below ``level`` (None: none is)."""
    return next((n for n in sorted(c) if c[n]["eff"] < level), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--calibration", default=None, metavar="FILE",
                    help="the benches' JSON lines saved by an earlier run (default: run the benches now)")
    ap.add_argument("--save-calibration", default=os.path.join(ROOT, "outputs", "scale_calibration.json"),
                    metavar="FILE", help="where the benches' JSON lines are written when they are run")
    ap.add_argument("--sizes", default="2,4,8", help="validation sizes (real processes)")
    ap.add_argument("--samples", type=int, default=32, help="samples per producer in the validation runs")
    ap.add_argument("--reps", type=int, default=7, help="validation repetitions per design and size")
    ap.add_argument("--zmq-sizes", default="2,4",
                    help="sizes of a second validation with every part an acked zmq message (as between hosts); "
                         "reported apart (validation_zmq_error_max); '' to skip")
    ap.add_argument("--skip-validation", action="store_true", help="simulate only (no validation_error_max)")
    ap.add_argument("--ns", default="8,16,32,64,128,256,512,1024")
    ap.add_argument("--steps", type=int, default=2, help="simulated steps averaged per point")
    ap.add_argument("--inter-gbps", type=float, default=200.0, help="one NIC, each direction")
    ap.add_argument("--nics-per-host", type=int, default=8)
    ap.add_argument("--gpus-per-host", type=int, default=8)
    ap.add_argument("--latency-us", type=float, default=10.0)
    ap.add_argument("--prompts-per-worker", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--remote-scale", type=float, default=1.0,
                    help="multiply the calibrated CPU of a part sent to another host (a sensitivity check: the zmq "
                         "validation finds a many-peer step paying more per message than bench/message.py's one in "
                         "flight)")
    ap.add_argument("--quick", action="store_true", help="validation at N=2,4 with 3 reps; 1 simulated step")
    ap.add_argument("--plot", default=None, metavar="PNG", help="save the efficiency plot (matplotlib)")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.reps, args.steps = "2,4", 3, 1
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    t_start = time.time()
    cores = os.cpu_count() or 1
    print(f"machine: {cores} cores, {platform.machine()}, Python {platform.python_version()}; "
          f"load average at start {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")

    # 1. calibration (measured)
    path = args.calibration or args.save_calibration
    if args.calibration is None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    cal, lines = load_or_run(path, ROOT, rerun=args.calibration is None)
    figures: dict[str, Any] = {"cores": cores, "calibration_file": os.path.relpath(path, ROOT),
                               "calibrated": lines.get("when")}
    if not args.skip_validation:
        from scale_validate import measure_wake

        cal = with_wake(cal, measure_wake())
    if args.remote_scale != 1.0:
        k = args.remote_scale
        cal = dataclasses.replace(cal, remote_tx_s=cal.remote_tx_s * k, remote_rx_s=cal.remote_rx_s * k,
                                  remote_tx_s_per_byte=cal.remote_tx_s_per_byte * k,
                                  remote_rx_s_per_byte=cal.remote_rx_s_per_byte * k,
                                  source=f"{cal.source}; remote part costs x{k:g} (--remote-scale)")
        figures["remote_scale"] = k
    print(f"calibration ({cal.source}; measured, CPU per event):")
    print(f"  part to another host (zmq message + ack): sender {cal.remote_tx_s * 1e6:.0f} us + "
          f"{cal.remote_tx_s_per_byte * 1e9:.2f} ns/B, receiver {cal.remote_rx_s * 1e6:.0f} us + "
          f"{cal.remote_rx_s_per_byte * 1e9:.2f} ns/B")
    print(f"  posted same-host part: producer {cal.post_tx_s * 1e6:.1f} us, consumer {cal.post_rx_s * 1e6:.1f} us; "
          f"split {cal.pack_s_per_byte * 1e9:.3f} ns/B, join {cal.join_s_per_byte * 1e9:.3f} ns/B; scatter call "
          f"{cal.scatter_s * 1e6:.0f} us, step take {cal.take_s * 1e6:.0f} us; after a sleep +{cal.wake_s * 1e6:.0f} us "
          f"per process; SWIM idle {cal.mesh_cpu_fraction * 100:.2f}% of a core per node")
    figures.update({f"cal_{k}": (round(v, 12) if isinstance(v, float) else v) for k, v in cal.to_json().items()
                    if k != "source"})

    # 2. validation (measured vs model)
    if not args.skip_validation:
        for kind, sz, key in (("auto", args.sizes, "validation"), ("zmq", args.zmq_sizes, "validation_zmq")):
            if not sz:
                continue
            rows, worst = validate(cal, [int(x) for x in sz.split(",")], args.samples, args.reps, cores, kind)
            print(f"\nvalidation, channel {kind} ({'posted parts, one host' if kind == 'auto' else 'every part an acked zmq message, as between hosts'}): "
                  f"real processes vs model on this machine ({args.samples} samples of "
                  f"{(1024 * 8 + 3072 * 16) // 1024} KiB per producer; generation sleeps 0.3-0.5 s, update 0.2 s; "
                  f"median of {args.reps}; model on {cores} cores, processor-shared)")
            print(f"  {'N':>3} {'design':9} {'real s':>8} {'model s':>8} {'err':>6} | {'real CPU ms':>11} "
                  f"{'[range]':>15} {'model ms':>9} {'err':>6}")
            for r in rows:
                lo, hi = r["real_cpu_range_ms"]
                print(f"  {r['n']:3d} {r['design']:9} {r['real_wall_s']:8.3f} {r['model_wall_s']:8.3f} "
                      f"{r['err_wall'] * 100:5.1f}% | {r['real_cpu_ms']:11.2f} {f'[{lo:.1f}-{hi:.1f}]':>15} "
                      f"{r['model_cpu_ms']:9.2f} {r['err_cpu'] * 100:5.1f}%")
            print(f"  largest error {worst * 100:.1f}% (target <= 15%); load average now {os.getloadavg()[0]:.1f}")
            figures[f"{key}_error_max"] = round(worst, 4)
            figures[key] = [{k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]
    else:
        figures["validation_error_max"] = None

    # 3. results (simulated)
    ns = [int(x) for x in args.ns.split(",")]
    net = Network(gpus_per_host=args.gpus_per_host, inter_gbps=args.inter_gbps, latency_s=args.latency_us * 1e-6,
                  nics_per_host=args.nics_per_host)
    base_wl = Workload(prompts_per_worker=args.prompts_per_worker, group_size=args.group_size)
    print(f"\nsimulated: {base_wl.samples_per_worker} samples per worker per step ({args.prompts_per_worker} prompts x "
          f"{args.group_size}), responses lognormal (median 1/4 of the cap, sigma 1), {args.gpus_per_host} GPUs per "
          f"host, {args.nics_per_host} x {args.inter_gbps:.0f} Gb/s NICs per host (the controller's host: 1), "
          f"{args.latency_us:.0f} us; efficiency = per-worker tokens/s vs N={ns[0]}; mean of max({args.steps}, min(32, 256/N)) steps")
    curves: dict[tuple[str, int, str], dict[int, dict[str, float]]] = {}
    for table in TABLES:
        for length in LENGTHS:
            wl = base_wl.replace(sample_tokens=length)
            curves[(table, length, "distflow")] = curve("distflow", ns, table, wl, net, cal, args.steps)
            curves[(table, length, "single")] = curve("single", ns, table, wl, net, cal, args.steps)
            d, s = curves[(table, length, "distflow")], curves[(table, length, "single")]
            print(f"\n{table} table, {length // 1024}k-token samples ({d[ns[0]]['mib_per_worker']:.2f} MiB per worker "
                  f"per step): step {d[ns[0]]['step_s']:.1f} s at N={ns[0]} (generation {d[ns[0]]['gen_s']:.1f} s, "
                  f"train {d[ns[0]]['train_s']:.1f} s)")
            print(f"  {'N':>5} | {'DistFlow eff':>12} {'step s':>8} {'route s':>8} {'imbal':>6} | {'single eff':>10} "
                  f"{'step s':>8} {'ctrl CPU s':>10} {'ctrl NIC s':>10}")
            for n in ns:
                print(f"  {n:5d} | {d[n]['eff']:12.3f} {d[n]['step_s']:8.1f} {d[n]['route_s']:8.3f} "
                      f"{d[n]['imbalance']:6.2f} | {s[n]['eff']:10.3f} {s[n]['step_s']:8.1f} "
                      f"{s[n]['router_cpu_s']:10.2f} {s[n]['router_link_s']:10.4f}")
            below = crossing(s, 0.6)
            compute = d[ns[0]]["step_s"]
            nsat = controller_saturation_n(compute, d[ns[0]]["mib_per_worker"] * 2**20, cal)
            print(f"  single controller below 60%: from N={below if below else '> ' + str(ns[-1])}; its CPU "
                  f"per step equals the N={ns[0]} step ({compute:.0f} s) at N = {nsat:.0f} (closed form: "
                  f"N x N part messages at {cal.remote_tx_s * 1e6:.0f} us); its NIC is busy "
                  f"{s[ns[-1]]['router_link_s'] / s[ns[-1]]['step_s'] * 100:.2f}% of a step at N={ns[-1]}")
            key = f"{table}_{length // 1024}k"
            figures.setdefault("curves", {}).update({f"{key}_{x}": [round(c[n]["eff"], 3) for n in ns]
                                                     for x, c in (("distflow", d), ("single", s))})
            figures[f"distflow_efficiency_512_{key}"] = round(d[512]["eff"], 4) if 512 in d else None
            figures[f"single_efficiency_512_{key}"] = round(s[512]["eff"], 4) if 512 in s else None
            figures[f"single_below_60_n_{key}"] = below
            figures[f"single_saturation_n_{key}"] = round(nsat, 1)

    # the fixes, on the headline table
    table, length = HEADLINE
    wl = base_wl.replace(sample_tokens=length)
    fixes = {"distflow, route_by tokens (rotated by producer)": curve("distflow", ns, table, wl, net, cal,
                                                                      args.steps, balance="tokens"),
             "distflow, tokens unrotated (before the fix)": curve("distflow", ns, table, wl, net, cal, args.steps,
                                                                  balance="tokens_unrotated"),
             "single, gathered then one split (fix)": curve("single", ns, table, wl, net, cal, args.steps,
                                                            controller="gathered"),
             "distflow, owner, 64 samples per worker": curve("distflow", ns, table,
                                                             wl.replace(prompts_per_worker=8), net, cal, args.steps)}
    print(f"\nvariants on the {table} table, {length // 1024}k-token samples (efficiency at N = "
          f"{', '.join(map(str, ns))}):")
    for name, c in fixes.items():
        print(f"  {name:44s} " + " ".join(f"{c[n]['eff']:.3f}" for n in ns)
              + f"   (trainer max/mean tokens at N={ns[-1]}: {c[ns[-1]]['imbalance']:.2f})")
    figures["variants"] = {name: [round(c[n]["eff"], 3) for n in ns] for name, c in fixes.items()}
    figures["ns"] = ns
    figures["distflow_tokens_efficiency_512"] = e512(fixes["distflow, route_by tokens (rotated by producer)"])
    figures["distflow_unrotated_efficiency_512"] = e512(fixes["distflow, tokens unrotated (before the fix)"])
    figures["single_gathered_efficiency_512"] = e512(fixes["single, gathered then one split (fix)"])
    figures["distflow_owner_64_efficiency_512"] = e512(fixes["distflow, owner, 64 samples per worker"])
    key = f"{table}_{length // 1024}k"
    figures["distflow_efficiency_512"] = figures[f"distflow_efficiency_512_{key}"]
    figures["single_efficiency_512"] = figures[f"single_efficiency_512_{key}"]
    figures["headline"] = f"{table} table, {length // 1024}k-token samples, as built"
    figures["target_met"] = (None if figures["distflow_efficiency_512"] is None else
                             bool(figures["distflow_efficiency_512"] >= 0.9 and figures["single_efficiency_512"] < 0.6))
    if args.plot:
        plot(args.plot, curves, fixes, ns, figures)
        print(f"\nplot: {args.plot}")
    if figures["target_met"] is not None:
        print(f"\nheadline ({figures['headline']}): DistFlow {figures['distflow_efficiency_512']:.3f} vs single "
              f"controller {figures['single_efficiency_512']:.3f} at N=512 (ratio "
              f"{figures['distflow_efficiency_512'] / figures['single_efficiency_512']:.2f}x); route_by tokens "
              f"{figures['distflow_tokens_efficiency_512']:.3f}; target (>= 0.90 vs < 0.60) "
              f"{'met' if figures['target_met'] else 'not met'}; {time.time() - t_start:.0f} s")
    print(json.dumps(figures))


def plot(path: str, curves: dict, fixes: dict, ns: list[int], figures: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    colors = {2048: "tab:blue", 8192: "tab:green", 32768: "tab:red"}
    for ax, table in zip(axes, TABLES):
        for length in LENGTHS:
            c = colors[length]
            d, s = curves[(table, length, "distflow")], curves[(table, length, "single")]
            ax.plot(ns, [d[n]["eff"] for n in ns], "-o", color=c, ms=3, label=f"DistFlow, {length // 1024}k")
            ax.plot(ns, [s[n]["eff"] for n in ns], "--s", color=c, ms=3, label=f"single controller, {length // 1024}k")
        if table == HEADLINE[0]:
            f = fixes["distflow, route_by tokens (rotated by producer)"]
            ax.plot(ns, [f[n]["eff"] for n in ns], ":^", color="black", ms=3,
                    label=f"DistFlow, route_by: tokens, {HEADLINE[1] // 1024}k")
        ax.axhline(0.9, color="grey", lw=0.6)
        ax.axhline(0.6, color="grey", lw=0.6, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("workers (GPUs)")
        ax.set_title(f"{table.upper()} cost table (simulated)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"scaling efficiency vs N={ns[0]}")
    axes[0].set_ylim(0, 1.05)
    axes[1].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"One synchronous step, calibrated on this machine ({figures.get('calibrated')}); "
                 f"validation error max {figures.get('validation_error_max')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
