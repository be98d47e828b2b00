"""torch.cuda's memory APIs on a real GPU, once under torch's caching allocator and once with
npu_pool installed, each in its own process, the same calls in the same order.

    python benchmarks/gpu_apis.py [--json FILE]
    python benchmarks/gpu_apis.py --report FILE    # the table of a saved --json file

The calls are those frameworks make (MindSpeed's ``--record-memory-history``, Megatron's memory
report, verl's offload): ``get/set_per_process_memory_fraction``, the older
``_record_memory_history(True, trace_alloc_max_entries=N)`` form, an out-of-memory observer
(``torch._C._cuda_attach_out_of_memory_observer``), ``memory_stats`` after a freed tensor (its
``max_split_size``, and whether non-releasable memory, ``inactive_split_bytes``, is what
``empty_cache`` does not give back: reserved - active - returned), a request past the cap
(``torch.OutOfMemoryError``, the observer's arguments), allocation after it, ``memory_summary``,
``memory_snapshot``, ``_snapshot()`` (one trace per device, the history's events),
``mem_get_info`` and turning the history off; memory a busy stream still reads, freed and asked
for again on another stream (``record_stream``: a tensor read on a side stream;
``freed_on_another_stream``: one freed on the side stream, which npu_pool may hand to another
stream behind a device-side wait): is what the side stream read intact
(``control_without_record_stream``: the first without ``record_stream``, a user's mistake that
should come out wrong under both, which shows the check sees a reuse); then graph capture and
private pools, which npu_pool refuses (``graph_capture``: a graph whose intermediate tensor is
freed inside the capture, a tensor made after it on the capture's stream, the graph replayed: is
its output right, is that tensor intact; ``mem_pool``: ``torch.cuda.MemPool`` with
``use_mem_pool``; ``c_base_capture_begin``: what the graph class's C base class holds as
``capture_begin``, a Python function where npu_pool replaced it; ``compile_reduce_overhead``:
``torch.compile(mode="reduce-overhead")``). Prints one row per answer with both allocators' values
and whether they agree where they should (byte counts are each allocator's own and are shown, not
compared; the graph rows neither). Exits 2 when no CUDA GPU is usable (or ``--report`` cannot
read its file), 1 when an answer that should agree does not, or a stream's read or a captured
graph came out wrong.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from gpu_check import run_worker  # (beside this script)

MODES = ("native", "npu_pool")
MiB = 1 << 20
# answers both allocators must give alike; the others are each allocator's own figures
SAME = ("fraction_default", "fraction_set", "history_legacy", "observer_attach", "max_split_size",
        "non_releasable_identity", "oom_raises", "observer_calls", "observer_request", "observer_cap",
        "after_oom", "memory_summary", "memory_snapshot", "device_traces", "history_has_events",
        "mem_get_info", "history_off", "record_stream", "freed_on_another_stream", "after_graphs")


def _raised(e: BaseException) -> str:
    return f"raised {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def _answer(call: Callable[[], Any]) -> Any:
    try:
        got = call()
        return "ok" if got is None else got
    except Exception as e:  # noqa: BLE001  (what a user would see is the finding)
        return _raised(e)


def _graph(torch: Any) -> str:
    """Capture ``out = x * 2 + 1`` (its intermediate freed inside the capture), make a tensor on the
    capture's stream after it, replay: what a private pool keeps apart, a shared one hands out."""
    n = 4 << 20  # floats: 16 MiB a tensor
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x = torch.full((n,), 1.0, device="cuda")
        float((x * 2 + 1).sum())  # warm-up on the capture's stream, as torch's documentation advises
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=s):
            tmp = x * 2
            out = tmp + 1
            del tmp
    except Exception as e:  # noqa: BLE001  (the finding)
        torch.cuda.synchronize()
        return _raised(e)
    with torch.cuda.stream(s):
        z = torch.full((n,), 7.0, device="cuda")  # made after the capture
        x.fill_(3.0)
        g.replay()
    torch.cuda.synchronize()
    right, intact = bool((out == 7.0).all()), bool((z == 7.0).all())
    return f"captured; replay {'right' if right else 'WRONG'}; a tensor made after it {'intact' if intact else 'OVERWRITTEN'}"


def _mem_pool(torch: Any) -> Any:
    def use() -> str:
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            t = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        return f"allocated in the pool ({t.numel()} bytes)"
    return _answer(use)


def _streams(torch: Any, record: bool, tell: bool = True) -> str:
    """Memory still read by a busy stream, freed, then asked for again on another stream: with
    ``record``, a tensor of the current stream read on a side stream (``record_stream``), else a
    tensor of the side stream freed there (the pool may hand it to the current stream only behind
    a device-side wait). The side stream sleeps before it reads, so a reuse without waiting would
    overwrite what it reads. ``tell=False`` leaves out the ``record_stream`` call (a user's
    mistake): the control that shows the check sees such a reuse."""
    n, side = 16 << 20, torch.cuda.Stream()  # floats: 64 MiB
    torch.cuda.synchronize()
    if record:
        x = torch.full((n,), 1.0, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        if not record:
            x = torch.full((n,), 1.0, device="cuda")
        torch.cuda._sleep(200_000_000)  # ~0.1 s of the side stream before it reads x
        y = x * 2
    if record and tell:
        x.record_stream(side)
    del x
    z = torch.full((n,), 5.0, device="cuda")  # the current stream, while the side stream still sleeps
    torch.cuda.synchronize()
    right = bool((y == 2).all()) and bool((z == 5).all())
    return "right" if right else "WRONG: memory the side stream still read was handed out"


def _compiled(torch: Any) -> str:
    """torch.compile(mode="reduce-overhead") (CUDA graphs, through torch.cuda.graph) run three times."""
    f = torch.compile(lambda a: a * 2 + 1, mode="reduce-overhead")
    a = torch.ones(1 << 20, device="cuda")
    for _ in range(3):
        out = f(a)
    torch.cuda.synchronize()
    return f"ran; output {'right' if bool((out == 3).all()) else 'WRONG'}"


def _worker(mode: str) -> dict[str, Any]:
    if mode == "npu_pool":
        import npu_pool  # before torch touches the GPU

        npu_pool.install(device_type="cuda")
    import torch

    r: dict[str, Any] = {"torch": torch.__version__}
    torch.cuda.init()
    r["device_name"] = torch.cuda.get_device_name()
    mem = torch.cuda.memory
    r["fraction_default"] = _answer(lambda: mem.get_per_process_memory_fraction(0))
    torch.cuda.set_per_process_memory_fraction(0.5)
    r["fraction_set"] = _answer(lambda: mem.get_per_process_memory_fraction(0))
    r["history_legacy"] = _answer(lambda: mem._record_memory_history(True, trace_alloc_max_entries=10_000,
                                                                     trace_alloc_record_context=True))
    seen: list[tuple] = []
    r["observer_attach"] = _answer(lambda: torch._C._cuda_attach_out_of_memory_observer(
        lambda *a: seen.append(tuple(int(x) for x in a))))
    big = torch.empty(25 * MiB, dtype=torch.uint8, device="cuda")
    keep = [torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")]
    keep += [torch.empty(1000 * i, dtype=torch.uint8, device="cuda") for i in range(1, 9)]
    del big
    st = torch.cuda.memory_stats()
    for key in ("allocated_bytes.all.current", "reserved_bytes.all.current", "active_bytes.all.current",
                "inactive_split_bytes.all.current", "num_device_alloc"):
        r[key] = st.get(key)
    r["max_split_size"] = st.get("max_split_size")
    reserved = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    r["returned_by_empty_cache"] = reserved - torch.cuda.memory_reserved()
    r["non_releasable_identity"] = (st["inactive_split_bytes.all.current"]
                                    == st["reserved_bytes.all.current"] - st["active_bytes.all.current"]
                                    - r["returned_by_empty_cache"])
    cap = int(0.5 * torch.cuda.mem_get_info()[1])
    try:
        torch.empty(1 << 40, dtype=torch.uint8, device="cuda")
        r["oom_raises"] = "not raised"
    except torch.OutOfMemoryError:
        r["oom_raises"] = "torch.OutOfMemoryError"
    except Exception as e:  # noqa: BLE001
        r["oom_raises"] = f"{type(e).__name__}"
    r["observer_calls"] = len(seen)
    r["observer_request"] = seen[0][1] if seen else None
    # torch passes the cap (allowed maximum) when a fraction is set; within 2 MiB of fraction * total
    r["observer_cap"] = abs(seen[0][2] - cap) <= 2 * MiB if seen else None
    r["after_oom"] = _answer(lambda: float(torch.ones(MiB, device="cuda").sum()))
    r["memory_summary"] = _answer(lambda: "Non-releasable memory" in torch.cuda.memory_summary())
    r["memory_snapshot"] = _answer(lambda: isinstance(torch.cuda.memory_snapshot(), list))
    snap = _answer(lambda: mem._snapshot())
    r["device_traces"] = (len(snap["device_traces"]) == torch.cuda.device_count()) if isinstance(snap, dict) else snap
    r["history_has_events"] = (sum(1 for e in snap["device_traces"][0] if e["action"] == "alloc") > 0
                               if isinstance(snap, dict) else snap)
    r["mem_get_info"] = _answer(lambda: torch.cuda.mem_get_info()[1] > 0)
    r["history_off"] = _answer(lambda: mem._record_memory_history(enabled=None))
    del keep
    r["record_stream"] = _answer(lambda: _streams(torch, True))
    r["freed_on_another_stream"] = _answer(lambda: _streams(torch, False))
    r["control_without_record_stream"] = _answer(lambda: _streams(torch, True, tell=False))
    r["graph_capture"] = _answer(lambda: _graph(torch))
    r["mem_pool"] = _mem_pool(torch)
    r["c_base_capture_begin"] = type(torch._C._CUDAGraph.__dict__.get("capture_begin")).__name__
    r["compile_reduce_overhead"] = _answer(lambda: _compiled(torch))
    r["after_graphs"] = _answer(lambda: float(torch.ones(MiB, device="cuda").sum()))
    return r


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def report(res: Any) -> tuple[str, bool]:
    """The markdown table of both runs (``res``: each mode's answers); and whether every answer in
    SAME agrees (in value and type) and no captured graph overwrote a tensor or replayed wrong.
    ValueError for anything but two runs of answers."""
    if not isinstance(res, dict) or not all(isinstance(res.get(m), dict) and res[m] for m in MODES):
        raise ValueError(f"expected the answers of both runs ({', '.join(MODES)}), each a non-empty object")
    nat, np_ = res["native"], res["npu_pool"]
    rows = [f"torch.cuda's memory APIs on {_cell(nat.get('device_name', '?'))}, torch {_cell(nat.get('torch', '?'))}\n",
            "| answer | native (torch caching allocator) | npu_pool | agree |", "|---|---|---|---|"]
    ok = True
    for key in list(nat) + [k for k in np_ if k not in nat]:
        if key in ("torch", "device_name"):
            continue
        a, b = nat.get(key, "(missing)"), np_.get(key, "(missing)")
        same = type(a) is type(b) and a == b
        if key in SAME:
            ok &= same
        if key in ("graph_capture", "compile_reduce_overhead", "record_stream", "freed_on_another_stream"):
            ok &= not any(bad in str(v) for v in (a, b) for bad in ("OVERWRITTEN", "WRONG"))
        rows.append(f"| {_cell(key)} | {_cell(a)} | {_cell(b)} | {('yes' if same else 'NO') if key in SAME else '-'} |")
    return "\n".join(rows), ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write both runs' answers here")
    ap.add_argument("--report", metavar="FILE", help="print the table of a saved --json file")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(_worker(args.worker)), flush=True)
        return 0
    if args.report:
        try:
            with open(args.report, encoding="utf-8") as f:
                res = json.load(f)["runs"]
            text, ok = report(res)
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"cannot read {args.report}: {e}")
        print(text)
        return 0 if ok else 1
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_apis: no CUDA GPU is usable here (torch {torch.__version__})", file=sys.stderr)
        return 2
    res = {mode: run_worker(mode, [], script=__file__) for mode in MODES}
    text, ok = report(res)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"runs": res}, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
