"""Two fp16 DeepSpeed engines in one loss, dynamic loss scales forced apart:
what each engine's parameters receive, with graphscale and with DeepSpeed
alone, against a float32 oracle.  Prints a markdown table; exit status 1 if
graphscale's gradients are not ``loss_scale(own) / GAS(own)`` x the plain
gradient for every engine (NOTE [ fp16 engines ] in graphscale/_adapters/deepspeed/__init__.py).

Engines A (GAS 2, initial scale 2**8) and B (GAS 4, initial scale 2**4),
built by tests/helpers/fp16.py's ``Rig``; the checks are tests/deepspeed_engines/test_fp16.py's, as
numbers.  Runs where DeepSpeed's accelerator does fp16 (a GPU with
``DS_ACCELERATOR=cuda``, as scripts/gpu_check.sh runs it); on a CPU pass
``--force-cpu-fp16`` to force DeepSpeed's CPU accelerator to report fp16
support (real engines; only the capability flag is forced).

    DS_ACCELERATOR=cuda python scripts/fp16_check.py --out fp16.md
    python scripts/fp16_check.py --force-cpu-fp16
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import socket
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

CALLS = ("engine:A", "loss", "scale:B")
STAGES = (1, 2, 3)


def init_dist() -> None:
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    if torch.distributed.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(dist_backend="nccl" if get_accelerator().device_name() == "cuda" else "gloo")


def ratios(rig, graph: str, call: str, govern: bool) -> tuple[dict[str, float], str]:
    """Each engine's gradient / plain gradient (least squares), and what DeepSpeed raised."""
    import graphscale

    from helpers.fp16 import GAS, fit_ratio

    plain = rig.plain_grads(graph)
    raised = ""
    inst = graphscale.install(*rig.engines.values()) if govern else None
    try:
        rig.backward(call, rig.roots(graph))
    except RuntimeError as exc:
        raised = str(exc).split(".")[0]
    finally:
        if inst is not None:
            inst.remove()
    got = rig.grads()
    return {n: fit_ratio(got[n], plain[n]) for n in GAS}, raised


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--force-cpu-fp16", action="store_true",
                    help="on DeepSpeed's CPU accelerator, report fp16 as supported (only the flag is forced)")
    ap.add_argument("--out", help="also write the markdown table to this file")
    args = ap.parse_args(argv)
    if args.force_cpu_fp16:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import logging

    import torch
    from deepspeed.accelerator import get_accelerator

    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    acc = get_accelerator()
    if args.force_cpu_fp16:
        if acc.device_name() != "cpu":
            print("scripts/fp16_check.py: --force-cpu-fp16 needs DeepSpeed's CPU accelerator", file=sys.stderr)
            return 2
        type(acc).is_fp16_supported = lambda self: True
    elif not acc.is_fp16_supported():
        print(f"scripts/fp16_check.py: DeepSpeed's {acc.device_name()} accelerator does not do fp16 here "
              "(on a CPU, pass --force-cpu-fp16)", file=sys.stderr)
        return 2
    init_dist()
    from helpers.fp16 import FP16_TOL, GAS, GRAPHS, Rig

    t0 = time.perf_counter()
    import deepspeed

    device = torch.cuda.get_device_name() if acc.device_name() == "cuda" else "CPU (fp16 capability flag forced)"
    lines = [f"fp16 two-engine check: {device}, torch {torch.__version__}, deepspeed {deepspeed.__version__}",
             "",
             "Engines A (GAS 2, loss scale 256) and B (GAS 4, loss scale 16) in one loss. Each cell: the engine's "
             "gradient / the plain float32 gradient (want: A 128, B 4). DeepSpeed alone also raises in its "
             "post-backward check where marked (!).",
             "",
             "| graph | call | ZeRO | graphscale A | graphscale B | max rel. err | DeepSpeed alone A "
             "| DeepSpeed alone B |",
             "|---|---|---|---|---|---|---|---|"]
    bad = 0
    for graph in GRAPHS:
        for call in CALLS:
            for stage in STAGES:
                rig = Rig(stage)
                scales = rig.scales()
                want = {n: scales[n] / GAS[n] for n in GAS}
                gs, gs_raised = ratios(rig, graph, call, govern=True)
                alone, ds_raised = ratios(Rig(stage), graph, call, govern=False)
                err = max(abs(gs[n] / want[n] - 1) for n in GAS)
                ok = err <= FP16_TOL and not gs_raised
                bad += not ok
                mark = "!" if ds_raised else ""
                lines.append(f"| {graph} | {call} | {stage} | {gs['A']:.4g} | {gs['B']:.4g} | {err:.1e}"
                             f"{'' if ok else ' FAIL'} | {alone['A']:.4g}{mark} | {alone['B']:.4g}{mark} |")
    lines += ["", f"{'all exact' if not bad else f'{bad} case(s) NOT exact'} (tolerance {FP16_TOL:g}); "
              f"{time.perf_counter() - t0:.0f} s"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
